"""What models made private need from Keras 2 (tf.keras in TensorFlow 2.15).

The per-example loss from the compiled loss container, the functional model
class, the optimizer classes a model with DP arguments converts, how the DP
optimizer's state is saved with the model and the training logs.
`tfdpx.keras.keras3` answers the same questions for Keras 3.
"""

from typing import Any, Dict

import numpy as np
import tensorflow as tf
from keras.src.engine import compile_utils
from keras.src.engine import functional as functional_lib
from keras.src.engine import training as training_lib
from keras.src.optimizers.legacy import optimizer_v2
from keras.src.saving import serialization_lib
from keras.src.utils import losses_utils

from tfdpx import per_example
from tfdpx.keras.dp_optimizer import DPOptimizerMixin

Functional = functional_lib.Functional
is_functional_init = training_lib.is_functional_model_init_params

# Keys of the DP optimizer's weights among the model's own `.keras` variables.
_OPTIMIZER_KEY = 'tfdpx_optimizer_{}'


def per_example_loss(model: tf.keras.Model, y_true, y_pred,
                     sample_weight=None) -> tf.Tensor:
  """The compiled loss of each example, `[B]`, without updating metrics.

  The same computation as the compiled loss container (loss weights, masks,
  sample weights) with `model.losses` left out.

  Raises:
    ValueError: if the compiled loss reduces over the batch.
  """
  # pylint: disable=protected-access
  container = model.compiled_loss
  y_true = container._conform_to_outputs(y_pred, y_true)
  sample_weight = container._conform_to_outputs(y_pred, sample_weight)
  if not container._built:
    container.build(y_pred)
  values = []
  for y_t, y_p, weight, loss, loss_weight in zip(
      tf.nest.flatten(y_true), tf.nest.flatten(y_pred),
      tf.nest.flatten(sample_weight), container._losses,
      container._loss_weights):
    if y_t is None or loss is None:
      continue
    y_t, y_p, weight = compile_utils.match_dtype_and_rank(y_t, y_p, weight)
    weight = losses_utils.apply_mask(y_p, weight, losses_utils.get_mask(y_p))
    value = per_example.record_losses(_unreduced(loss, y_t, y_p, weight))
    if loss_weight is not None:
      value *= loss_weight
    values.append(value)
  # pylint: enable=protected-access
  if not values:
    raise ValueError('the model has no compiled loss')
  return tf.add_n(values)


def _unreduced(loss, y_true, y_pred, sample_weight) -> tf.Tensor:
  """`loss` of each example alone, `[B, ...]`, whatever its reduction.

  A loss reduced over the batch (Keras's default, as tensorflow-privacy's DP
  models take it) gives, for one example alone, its weighted values averaged
  (`sum_over_batch_size`) or summed (`sum`) over the other axes.
  """
  reduction = loss.reduction
  if reduction == losses_utils.ReductionV2.NONE:
    return loss(y_true, y_pred, sample_weight=sample_weight)
  values = losses_utils.compute_weighted_loss(
      loss.call(y_true, y_pred), sample_weight,
      reduction=losses_utils.ReductionV2.NONE)
  if reduction == losses_utils.ReductionV2.SUM and values.shape.rank > 1:
    values = tf.reduce_sum(values, axis=list(range(1, values.shape.rank)))
  return values


def _reduces_over_batch(container) -> bool:
  """Whether a built loss container's losses reduce over the batch."""
  losses = container._losses  # pylint: disable=protected-access
  return any(loss.reduction != losses_utils.ReductionV2.NONE
             for loss in losses if loss is not None)


# The plain Keras optimizers a model with DP arguments converts.
PLAIN_OPTIMIZERS = (
    ((tf.keras.optimizers.SGD, tf.keras.optimizers.legacy.SGD), 'SGD'),
    ((tf.keras.optimizers.Adam, tf.keras.optimizers.legacy.Adam), 'Adam'),
    ((tf.keras.optimizers.Adagrad, tf.keras.optimizers.legacy.Adagrad),
     'Adagrad'),
)


def training_logs(model, x, y, sample_weight, result) -> Dict[str, Any]:
  """The loss and compiled metrics of a private batch, as Keras logs them."""
  regularization = None
  if result.regularization_loss is not None:
    regularization = [result.regularization_loss]
    if not _reduces_over_batch(model.compiled_loss):
      # Per example, as Keras's container adds it to unreduced losses.
      regularization = [tf.fill(tf.shape(result.losses),
                                result.regularization_loss)]
  model.compiled_loss(y, result.outputs, sample_weight,
                      regularization_losses=regularization)
  return model.compute_metrics(x, y, result.outputs, sample_weight)


class ModelHooks:
  """What a model made private overrides in Keras 2: saving and loading.

  Keras 2.15 writes no variables of a legacy (OptimizerV2) optimizer into a
  .keras file, and gives a SavedModel's back only as a RestoredOptimizer that
  is then replaced by a fresh one at compile. Both would restart the step
  count behind epsilon at 0, so models made private carry the state.
  """

  def save_own_variables(self, store):
    super().save_own_variables(store)
    if isinstance(self.optimizer, DPOptimizerMixin):
      for i, value in enumerate(self.optimizer.get_weights()):
        store[_OPTIMIZER_KEY.format(i)] = value

  def load_own_variables(self, store):
    saved = []
    while _OPTIMIZER_KEY.format(len(saved)) in store.keys():
      saved.append(np.asarray(store[_OPTIMIZER_KEY.format(len(saved))]))
    own = {k: store[k] for k in store.keys()
           if k not in {_OPTIMIZER_KEY.format(i) for i in range(len(saved))}}
    super().load_own_variables(own)
    if saved:
      # pylint: disable-next=protected-access
      self.optimizer._create_all_weights(self.trainable_variables)
      self.optimizer.set_weights(saved)

  def _restore_optimizer_state(self, restored):
    if (isinstance(restored, optimizer_v2.RestoredOptimizer) and
        isinstance(self.optimizer, DPOptimizerMixin)):
      # A SavedModel's optimizer variables, as Keras 2.15 loads them.
      self.optimizer.restore_state_from(restored, self.trainable_variables)

  def compile_from_config(self, config):
    # Keras skips compiling a model whose class overrides `compile` when it
    # loads a .keras file; this one compiles as tf.keras.Model does.
    self.compile(**serialization_lib.deserialize_keras_object(config))


def is_graph_network(layer) -> bool:
  """A functional model (Sequential models built on an input included)."""
  return (isinstance(layer, tf.keras.Model) and
          getattr(layer, '_is_graph_network', False))


def run_graph(model, inputs, call):
  """Runs a functional model's layers, each by `call(layer, args, kwargs)`."""
  # The loop of Keras's Functional._run_internal_graph, with `call`.
  # pylint: disable=protected-access
  inputs = model._flatten_to_reference_inputs(inputs)
  tensors = {}
  for reference, value in zip(model.inputs, inputs):
    value = model._conform_to_reference_input(value, ref_input=reference)
    key = str(id(reference))
    tensors[key] = [value] * model._tensor_usage_count[key]
  for depth in sorted(model._nodes_by_depth, reverse=True):
    for node in model._nodes_by_depth[depth]:
      if node.is_input or any(k not in tensors for k in node.flat_input_ids):
        continue
      args, kwargs = node.map_arguments(tensors)
      outputs = call(node.layer, args, kwargs)
      for key, value in zip(node.flat_output_ids, tf.nest.flatten(outputs)):
        tensors[key] = [value] * model._tensor_usage_count[key]
  outputs = [tensors[str(id(x))].pop() for x in model.outputs]
  return tf.nest.pack_sequence_as(model._nested_outputs, outputs)
  # pylint: enable=protected-access


def call_arguments(layer):
  """Whether `layer.call` takes `training` and `mask`."""
  spec = layer._call_spec  # pylint: disable=protected-access
  return spec.expects_training_arg, spec.expects_mask_arg


def graph_endpoints(model):
  """The inputs and outputs to rebuild a functional `model` from."""
  return model.inputs, model.outputs


class FunctionalConstructor:
  """The constructor of a functional model made private.

  Keras saves the layer graph of a `Functional` subclass only if its
  constructor's arguments are exactly `Functional`'s.
  """

  def __init__(self, inputs, outputs, name=None, trainable=True, **engine):
    super().__init__(inputs, outputs, name=name, trainable=trainable,
                     **engine)


# Keras's recurrent loop (masks, direction, unrolling), for the recurrent rules.
rnn = tf.keras.backend.rnn


def tf_variables(variables):
  """Keras 2 variables are TensorFlow variables."""
  return list(variables)


def logs_without_training_metrics(model, y, outputs):
  del model, y, outputs
  return {}
