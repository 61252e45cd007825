"""What models made private need from Keras 3 (TensorFlow backend).

The same questions as `tfdpx.keras.keras2` answers for Keras 2: the
per-example loss from the compiled loss, the functional model class, how the
engine runs a functional model layer by layer, the optimizer classes a model
with DP arguments converts, saving and the training logs.
"""

from typing import Any, Callable, Dict, Tuple

import keras
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.losses import loss as loss_lib
from keras.src.models import functional as functional_lib
from keras.src.models import model as model_lib

from tfdpx import per_example

Functional = functional_lib.Functional
is_functional_init = model_lib.functional_init_arguments

# The plain Keras optimizers a model with DP arguments converts.
PLAIN_OPTIMIZERS = (
    ((keras.optimizers.SGD,), 'SGD'),
    ((keras.optimizers.Adam,), 'Adam'),
    ((keras.optimizers.Adagrad,), 'Adagrad'),
)


def is_graph_network(layer) -> bool:
  """A functional model, or a Sequential model built on an input."""
  if isinstance(layer, keras.Sequential):
    return getattr(layer, '_functional', None) is not None
  return isinstance(layer, Functional)


def run_graph(model, inputs, call: Callable[[Any, Tuple, Dict], Any]):
  """Runs a functional model's layers, each by `call(layer, args, kwargs)`."""
  # pylint: disable=protected-access
  inputs = model._standardize_inputs(inputs)
  outputs = model._run_through_graph(
      inputs, operation_fn=lambda layer: lambda *a, **k: call(layer, a, k))
  # pylint: enable=protected-access
  return functional_lib.unpack_singleton(outputs)


def call_arguments(layer) -> Tuple[bool, bool]:
  """Whether `layer.call` takes `training` and `mask` (an operation: no)."""
  return (getattr(layer, '_call_has_training_arg', False),
          getattr(layer, '_call_has_mask_arg', False))


def _resolve(path, nest):
  for key in path:
    nest = nest[key]
  return nest


def per_example_loss(model: keras.Model, y_true, y_pred,
                     sample_weight=None) -> tf.Tensor:
  """The compiled loss of each example, `[B]`, without updating metrics.

  Each compiled loss's unreduced values, with masks and sample weights
  applied per example (Keras's batch reduction rescales a mask by the number
  of valid entries of the whole batch, which would make an example's loss
  depend on the others), averaged (`sum_over_batch_size`) or summed (`sum`)
  over the axes after the batch axis, times its loss weight; `model.losses`
  left out.

  Raises:
    ValueError: if the model has no compiled loss.
  """
  container = getattr(model, '_compile_loss', None)
  if container is None:
    raise ValueError('the model has no compiled loss')
  if not container.built:
    container.build(y_true, y_pred)
  values = []
  # pylint: disable-next=protected-access
  for path, loss, loss_weight, _ in container._flat_losses:
    weight = sample_weight
    if sample_weight is not None and tf.nest.is_nested(sample_weight):
      weight = _resolve(path, sample_weight)
    value = per_example.record_losses(_unreduced(
        loss, _resolve(path, y_true), _resolve(path, y_pred), weight))
    if loss_weight is not None:
      value *= loss_weight
    values.append(value)
  return tf.add_n(values)


def _unreduced(loss, y_true, y_pred, sample_weight) -> tf.Tensor:
  """`loss` of each example alone, `[B, ...]`, whatever its reduction."""
  in_mask = getattr(y_pred, '_keras_mask', None)
  y_pred = tf.cast(y_pred, loss.dtype)
  y_true = tf.cast(y_true, loss.dtype)
  values = loss.call(y_true, y_pred)
  out_mask = getattr(values, '_keras_mask', None)
  for mask in (in_mask, out_mask):
    if mask is not None:
      values, mask = loss_lib.squeeze_or_expand_to_same_rank(
          values, tf.cast(mask, values.dtype))
      values = values * mask
  if sample_weight is not None:
    values, weight = loss_lib.squeeze_or_expand_to_same_rank(
        values, tf.cast(sample_weight, values.dtype))
    values = values * weight
  if loss.reduction == 'sum' and values.shape.rank > 1:
    values = tf.reduce_sum(values, axis=list(range(1, values.shape.rank)))
  return values


def training_logs(model, x, y, sample_weight, result) -> Dict[str, Any]:
  """The loss and compiled metrics of a private batch, as Keras logs them."""
  # The compiled loss (mean of the per-example losses) and model.losses, as
  # `compute_loss` adds them; not from `model.losses` again, which holds the
  # values of the engine's last layer calls.
  loss = tf.reduce_mean(result.losses)
  if result.regularization_loss is not None:
    loss += result.regularization_loss
  # pylint: disable=protected-access
  model._loss_tracker.update_state(
      loss_lib.unscale_loss_for_distribution(loss),
      sample_weight=tf.shape(result.losses)[0])
  # pylint: enable=protected-access
  return model.compute_metrics(x, y, result.outputs, sample_weight)


class ModelHooks:
  """What a model made private overrides in Keras 3: compiling on loading.

  Keras 3 saves the optimizer's variables with the model (`.keras`) and
  restores them when the loaded model is compiled, which Keras skips for a
  class that overrides `compile`; this one compiles as `keras.Model` does.
  """

  def _restore_optimizer_state(self, restored):
    del restored  # Keras 3 restores the optimizer's variables itself.

  def compile_from_config(self, config):
    self.compile(**keras.saving.deserialize_keras_object(config))
    if getattr(self, 'optimizer', None) is not None and self.built:
      self.optimizer.build(self.trainable_variables)  # Then loaded.


def graph_endpoints(model):
  """The inputs and outputs to rebuild a functional `model` from."""
  # Their structures: a list of one input would not match a single tensor.
  # pylint: disable=protected-access
  graph = model._functional if isinstance(model, keras.Sequential) else model
  return graph._inputs_struct, graph._outputs_struct


class FunctionalConstructor:
  """The constructor of a functional model made private.

  Keras saves the layer graph of a `Functional` subclass only if its
  constructor's arguments are exactly `Functional`'s.
  """

  def __init__(self, inputs, outputs, name=None, **engine):
    super().__init__(inputs, outputs, name=name, **engine)


# Keras's recurrent loop (masks, direction, unrolling), for the recurrent rules.
rnn = keras_backend.rnn


def tf_variables(variables):
  """The TensorFlow variables behind Keras 3 variables.

  What the engine and the privatizers work with: a tape gives their
  gradients (zeros where unconnected), their dtype is a `tf.DType` and their
  `name` is the layer path (`model/dense/kernel:0`), which DPDR's `layer`
  blocks group by (a Keras 3 variable's own `name` is `kernel`).
  """
  return [v.value if isinstance(v, keras.Variable) else v for v in variables]


def logs_without_training_metrics(model, y, outputs):
  """The public step count: Keras 3's fit cannot carry an empty result."""
  # pylint: disable=protected-access
  metrics = model._compile_metrics
  if metrics is not None and not metrics.built:
    # Creates the metrics (no update: nothing of the batch enters them), so
    # that evaluation on held-out data can report them.
    metrics.build(y, outputs)
  return {'dp_steps': model.optimizer.dp_steps}
