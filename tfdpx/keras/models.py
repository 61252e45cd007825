"""Keras models whose training step computes per-example gradients fast.

`make_private(model)` returns a model sharing `model`'s layers and weights
whose `train_step` computes per-example statistics with the linear-time engine
(`tfdpx.keras.recorder.model_gradients`: per-layer forms, vectorized fallback)
instead of the optimizer's `tape.jacobian`, then hands them to the optimizer's
`privatize`, the same call the compile path makes. `DPModel` and
`DPSequential` are the classes behind it, for subclassing. See
docs/per_example.md.
"""

from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf
from keras.src.engine import compile_utils
from keras.src.engine import functional as functional_lib
from keras.src.engine import training as training_lib
from keras.src.optimizers.legacy import optimizer_v2
from keras.src.saving import serialization_lib
from keras.src.utils import losses_utils

from tfdpx import gradients
from tfdpx import noise
from tfdpx import per_example
from tfdpx.keras import optimizers
from tfdpx.keras import recorder
from tfdpx.keras import validation

DEFAULT_CHUNK_SIZE = 128

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
    value = per_example.record_losses(loss(y_t, y_p, sample_weight=weight))
    if loss_weight is not None:
      value *= loss_weight
    values.append(value)
  # pylint: enable=protected-access
  if not values:
    raise ValueError('the model has no compiled loss')
  return tf.add_n(values)


class _PrivateTraining:
  """The engine settings and training step shared by the model classes."""

  def _set_engine(self, chunk_size, public_data, public_chunk_size,
                  use_layer_rules, fast_clipping, release_training_metrics):
    if int(chunk_size) != chunk_size or chunk_size < 1:
      raise ValueError(
          f'chunk_size must be a positive integer, got {chunk_size!r}')
    if public_data is not None:
      if not isinstance(public_data, (tuple, list)) or len(public_data) != 2:
        raise ValueError('public_data must be a pair (x_public, y_public)')
      if (public_chunk_size is not None and
          (int(public_chunk_size) != public_chunk_size or
           public_chunk_size < 1)):
        raise ValueError(f'public_chunk_size must be a positive integer, got '
                         f'{public_chunk_size!r}')
      public_data = tf.nest.map_structure(np.asarray, tuple(public_data))
    elif public_chunk_size is not None:
      raise ValueError('public_chunk_size needs public_data')
    self._dp_chunk_size = int(chunk_size)
    self._dp_public_data = public_data
    self._dp_public_chunk_size = int(public_chunk_size or chunk_size)
    self._dp_use_layer_rules = bool(use_layer_rules)
    self._dp_fast_clipping = bool(fast_clipping)
    self._dp_release_training_metrics = bool(release_training_metrics)
    self._dp_checked_eagerly = False

  @property
  def public_data(self) -> Optional[Tuple[Any, Any]]:
    return self._dp_public_data

  def train_step(self, data):
    """One DP step: per-example gradients, `privatize`, apply."""
    x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
    optimizer = self.optimizer
    if not isinstance(optimizer, optimizers.DPOptimizerMixin):
      raise ValueError(
          'a model made private trains with a tfdpx optimizer '
          f'(tfdpx.keras.DPSGD, DPAdam, DPAdagrad), got '
          f'{type(optimizer).__name__}')
    if not self.built:  # Creates the variables without running the model.
      self.build(tf.nest.map_structure(lambda t: t.shape, x))
    # Before the forward pass, which in eager mode would already write. The
    # trace (once per traced step; eager steps: once) finds layers writing
    # variables from the data; the layer checks are cheap and always run.
    trace = not (tf.executing_eagerly() and self._dp_checked_eagerly)
    validation.check_private_compatible(self, x if trace else None)
    self._dp_checked_eagerly = tf.executing_eagerly()
    var_list = self.trainable_variables
    result = recorder.model_gradients(
        self, x,
        lambda outputs: per_example_loss(self, y, outputs, sample_weight),
        var_list, self._dp_chunk_size, self._dp_use_layer_rules)
    grads = self._privatize(optimizer, result.grads, var_list)
    if result.regularization_grads is not None:
      # model.losses are data-independent (model_gradients checks): their
      # gradient is added after the noise, outside the clipped sum.
      grads = [g + r for g, r in zip(grads, result.regularization_grads)]
    optimizer.apply_gradients(zip(grads, var_list))
    if not self._dp_release_training_metrics:
      return {}  # Nothing computed from the private batch.
    regularization = None
    if result.regularization_loss is not None:
      # Per example, as Keras's container adds it to unreduced losses.
      regularization = [tf.fill(tf.shape(result.losses),
                                result.regularization_loss)]
    self.compiled_loss(y, result.outputs, sample_weight,
                       regularization_losses=regularization)
    logs = self.compute_metrics(x, y, result.outputs, sample_weight)
    # Examples of this (global) batch whose gradient was not finite and was
    # left out: a training metric, not covered by epsilon.
    logs['dropped_records'] = noise.replica_sum([result.dropped_records])[0]
    return logs

  def _privatize(self, optimizer, grads, var_list):
    if not self._dp_fast_clipping:
      # Every per-example gradient formed, for comparisons.
      grads = gradients.MaterializedGradients(grads.materialized())
    records = per_example.microbatched(grads, optimizer._num_microbatches)  # pylint: disable=protected-access
    public_grads = None
    if self._dp_public_data is not None:
      x_public, y_public = self._dp_public_data
      public_grads = recorder.public_gradients(
          self, x_public, y_public,
          lambda y_true, outputs: per_example_loss(self, y_true, outputs),
          var_list, self._dp_public_chunk_size, self._dp_use_layer_rules)
    return optimizer.privatize(records, var_list, public_grads=public_grads)

  def get_config(self):
    return {**super().get_config(), 'chunk_size': self._dp_chunk_size,
            'use_layer_rules': self._dp_use_layer_rules,
            'fast_clipping': self._dp_fast_clipping,
            'release_training_metrics': self._dp_release_training_metrics}

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    engine = {k: config.pop(k)
              for k in ('chunk_size', 'use_layer_rules', 'fast_clipping',
                        'release_training_metrics')
              if k in config}
    model = super().from_config(config, custom_objects)
    model._set_engine(  # pylint: disable=protected-access
        engine.get('chunk_size', DEFAULT_CHUNK_SIZE), None, None,
        engine.get('use_layer_rules', True), engine.get('fast_clipping', True),
        engine.get('release_training_metrics', True))
    return model

  # --- Saving: the DP optimizer's state is the privacy ledger ----------------
  # Keras 2.15 writes no variables of a legacy (OptimizerV2) optimizer into
  # a .keras file, and gives a SavedModel's back only as a RestoredOptimizer
  # that is then replaced by a fresh one at compile. Both would restart the
  # step count behind epsilon at 0, so models made private carry the state.

  def save_own_variables(self, store):
    super().save_own_variables(store)
    if isinstance(self.optimizer, optimizers.DPOptimizerMixin):
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

  def compile(self, *args, **kwargs):  # pylint: disable=arguments-differ
    restored = getattr(self, 'optimizer', None)
    super().compile(*args, **kwargs)
    if (isinstance(restored, optimizer_v2.RestoredOptimizer) and
        isinstance(self.optimizer, optimizers.DPOptimizerMixin)):
      # A SavedModel's optimizer variables, as Keras 2.15 loads them.
      self.optimizer.restore_state_from(restored, self.trainable_variables)

  def compile_from_config(self, config):
    # Keras skips compiling a model whose class overrides `compile` when it
    # loads a .keras file; this one compiles as tf.keras.Model does.
    self.compile(**serialization_lib.deserialize_keras_object(config))


@tf.keras.saving.register_keras_serializable(package='tfdpx')
class DPModel(_PrivateTraining, tf.keras.Model):
  """A Keras Model whose `train_step` computes per-example gradients fast.

  Use it like `tf.keras.Model`: functional (`DPModel(inputs, outputs)`, which
  gives a `DPFunctional`) or subclassed (override `call`). Compile it with a
  tfdpx optimizer and an unreduced loss. Functional models get the per-layer
  rules; a subclassed model's own `call` is one unit for the vectorized
  fallback.
  """

  def __new__(cls, *args, **kwargs):
    # Keras would turn DPModel itself into a Functional subclass for good
    # (inject_functional_model_class); build the functional class instead.
    if cls is DPModel and training_lib.is_functional_model_init_params(
        args, kwargs):
      return super().__new__(DPFunctional, *args, **kwargs)
    return super().__new__(cls, *args, **kwargs)

  def __init__(self, *args, chunk_size: int = DEFAULT_CHUNK_SIZE,
               public_data=None, public_chunk_size: Optional[int] = None,
               use_layer_rules: bool = True, fast_clipping: bool = True,
               release_training_metrics: bool = True, **kwargs):
    """Args:
      *args: as `tf.keras.Model`.
      chunk_size: examples per `tf.vectorized_map` call of the fallback (and
        public examples per engine pass); bounds memory for large batches.
      public_data: optional `(x_public, y_public)`; each step then also
        computes the per-example gradients of all public examples (in chunks
        of `public_chunk_size`) and passes them to `privatize` as
        `public_grads`, for privatizers that need them (GEP). Public data is
        never clipped or noised and costs no privacy.
      public_chunk_size: public examples per engine pass (default
        `chunk_size`).
      use_layer_rules: False sends every layer to the vectorized fallback (for
        comparisons; slower).
      fast_clipping: True (the default) hands the privatizer per-example
        statistics computed layer by layer (norms, dots, weighted sums by
        ghost forms, segment sums or chunks; `docs/per_example.md`) without
        forming per-example gradients where a cheaper exact form exists.
        False forms every per-example gradient first (for comparisons); the
        release is the same up to float rounding.
      release_training_metrics: False makes `train_step` return nothing
        computed from the private batch (no loss, no compiled metrics), so
        `fit`'s logs, progress bar and History hold only what callbacks add
        (e.g. `tfdpx.keras.PrivacyCallback`'s epsilon). True (Keras's
        behaviour) logs the loss and metrics of each private training batch,
        and `dropped_records` (how many of its examples had a non-finite
        gradient and were left out), which the reported epsilon does not
        cover.
      **kwargs: as `tf.keras.Model`.

    Raises:
      ValueError: naming the argument that is invalid.
    """
    super().__init__(*args, **kwargs)
    self._set_engine(chunk_size, public_data, public_chunk_size,
                     use_layer_rules, fast_clipping, release_training_metrics)


@tf.keras.saving.register_keras_serializable(package='tfdpx')
class DPFunctional(DPModel, functional_lib.Functional):
  """A functional `DPModel`: `DPModel(inputs, outputs)` builds one."""

  def __init__(self, inputs, outputs, name=None, trainable=True, **engine):
    """Args:
      inputs, outputs, name, trainable: as `tf.keras.Model(inputs, outputs)`;
        Keras's constructor signature, so that Keras saves and revives the
        layer graph (`.keras`, `.h5`, SavedModel).
      **engine: `DPModel`'s engine arguments.
    """
    super().__init__(inputs, outputs, name=name, trainable=trainable,
                     **engine)


@tf.keras.saving.register_keras_serializable(package='tfdpx')
class DPSequential(_PrivateTraining, tf.keras.Sequential):
  """A Sequential model whose `train_step` computes per-example gradients fast."""

  def __init__(self, layers=None, name=None, *,
               chunk_size: int = DEFAULT_CHUNK_SIZE, public_data=None,
               public_chunk_size: Optional[int] = None,
               use_layer_rules: bool = True, fast_clipping: bool = True,
               release_training_metrics: bool = True):
    """Args:
      layers, name: as `tf.keras.Sequential`.
      chunk_size, public_data, public_chunk_size, use_layer_rules,
        fast_clipping, release_training_metrics: as `DPModel`.

    Raises:
      ValueError: naming the argument that is invalid.
    """
    super().__init__(layers, name)
    self._set_engine(chunk_size, public_data, public_chunk_size,
                     use_layer_rules, fast_clipping, release_training_metrics)



# The legacy .h5 format names a model's class by its bare `__name__`, not by
# the registered 'tfdpx>' name.
tf.keras.utils.get_custom_objects().update(
    {cls.__name__: cls for cls in (DPModel, DPFunctional, DPSequential)})

class _Wrapped(DPModel):
  """A subclassed model made private: its `call` is one fallback unit."""

  def __init__(self, model, **engine):
    super().__init__(name=model.name + '_private', **engine)
    self.wrapped = model

  def call(self, inputs, training=None):
    return self.wrapped(inputs, training=training)


def make_private(model: tf.keras.Model, *,
                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                 public_data=None, public_chunk_size: Optional[int] = None,
                 use_layer_rules: bool = True,
                 fast_clipping: bool = True,
                 release_training_metrics: bool = True) -> tf.keras.Model:
  """A model sharing `model`'s layers and weights, trained with fast DP steps.

  Compile the returned model with a tfdpx optimizer (`tfdpx.keras.DPSGD`, ...)
  and an unreduced loss, exactly as for the compile path, and call `fit`: each
  step runs one batched forward and backward pass and hands the optimizer's
  `privatize` the per-example gradients as statistics on demand, answered per
  layer (ghost norms and weighted sums for Dense and convolutions, segment
  sums over the tokens present for Embedding, small per-example gradients
  for LayerNormalization and GroupNormalization, a chunked
  `tf.vectorized_map` fallback for any other layer). `evaluate` and
  `predict` are Keras's own.

  Args:
    model: a Sequential, functional or subclassed Keras model. Functional and
      Sequential models get the per-layer rules; a subclassed model is one
      fallback unit.
    chunk_size, public_data, public_chunk_size, use_layer_rules,
      fast_clipping, release_training_metrics: see `DPModel`.

  Returns:
    A `DPModel` or `DPSequential`.

  Raises:
    ValueError: for a layer that mixes the examples of a batch, a stateful
      layer, an activity regularizer or a layer that writes a variable from
      the data (`tfdpx.keras.check_private_compatible`; layers not built yet
      are checked at the first step), or a bad argument.

  Privacy:
    Each example's gradient is computed from that example alone as long as no
    layer mixes the examples of a batch (a trainable BatchNormalization and
    normalizations over the batch axis are refused; a custom layer that mixes
    examples is not detected). No layer may carry data from one step to the
    next or into the saved model: stateful layers and layers that write a
    variable from the data are refused. The gradient of
    `model.losses` (weight regularizers) is data-independent and added after
    the noise, outside the clipped sum; a loss added with `add_loss` that
    depends on the data is refused at the first step. Public data never
    enters the private sum.

    Epsilon bounds what the noisy updates release (the weights, the
    optimizer's state), not what Keras logs: by default `fit` reports the loss
    and metrics of every private training batch (progress bar, History,
    callbacks such as TensorBoard), functions of the batch that are neither
    clipped nor noised. With
    `release_training_metrics=False` the training step returns none of them;
    measure accuracy with `evaluate` on held-out data that is not part of the
    private training set.
  """
  functional = getattr(model, '_is_graph_network', False)
  validation.check_private_compatible(model,
                                      model.inputs if functional else None)
  engine = dict(chunk_size=chunk_size, public_data=public_data,
                public_chunk_size=public_chunk_size,
                use_layer_rules=use_layer_rules, fast_clipping=fast_clipping,
                release_training_metrics=release_training_metrics)
  if isinstance(model, tf.keras.Sequential) and not model.built:
    return DPSequential(model.layers, name=model.name + '_private', **engine)
  if functional:
    return DPModel(model.inputs, model.outputs, name=model.name + '_private',
                   **engine)
  return _Wrapped(model, **engine)
