"""Keras optimizers that privatize gradients with a tfdpx privatizer.

One mixin over tensorflow-privacy's vectorized DP Keras optimizers: the
privatizer is a constructor argument, the optimizer owns the variables holding
the privatizer's state and its step counter (so checkpoints restore them), and
the noisy sum is divided by a public denominator.
"""

import inspect
import logging
import os
from typing import Optional

import dp_accounting
import tensorflow as tf
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized as tfp_vectorized

from tfdpx import accounting
from tfdpx import clipping
from tfdpx import core
from tfdpx import gradients
from tfdpx import per_example
from tfdpx.keras import validation
from tfdpx.privatizers.gaussian import Gaussian

_REFUSED_KWARGS = ('clipnorm', 'clipvalue', 'global_clipnorm')
_LOG = logging.getLogger(__name__)

JACOBIAN_WARNING = (
    'tfdpx: per-example gradients by tape.jacobian (the compile path) cost '
    'the square of the batch size: at batch 256 a step of the tensorflow-'
    'privacy tutorial CNN measured 100 to 200 times a non-private step. Train '
    'tfdpx.keras.make_private(model) instead: the same optimizer, per-layer '
    'per-example gradients in linear time (1.4 times a non-private step on '
    'that CNN; see benchmarks/README.md).')

NO_MODEL_WARNING = (
    'tfdpx: this optimizer was not called from the train step of the Keras '
    'model it is compiled with (a custom training loop?), so tfdpx cannot '
    'check the model: layers that mix examples, stateful layers or layers '
    'writing variables from the data make the training not private. Call '
    'tfdpx.keras.check_private_compatible(model, inputs, compile_path=True) '
    'on a batch of inputs before training.')


# The config key that records how many private steps a saved optimizer took.
_SAVED_DP_STEPS = 'dp_steps_when_saved'


def _secret_seed() -> int:
  return int.from_bytes(os.urandom(8), 'little') & 0x7FFFFFFFFFFFFFFF


class DPOptimizerMixin:
  """Turns a tensorflow-privacy vectorized DP optimizer into a tfdpx one.

  Each step: per-record gradients (the Jacobian of the loss vector, or those a
  private model hands to `privatize`) go through `privatizer.update`, the
  noisy sum is divided by the public denominator, and the base optimizer
  (SGD, Adam, Adagrad) applies the result.
  """

  def __init__(self,
               privatizer: Optional[core.Privatizer] = None,
               *,
               l2_norm_clip: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               num_microbatches: Optional[int] = None,
               expected_batch_size: Optional[float] = None,
               noise_seed: Optional[int] = None,
               **kwargs):
    """Args:
      privatizer: the noise step (`tfdpx.privatizers.*`), or its
        `serialize`d form. Leave `None` to pass tensorflow-privacy's
        `l2_norm_clip` and `noise_multiplier` instead (DP-SGD).
      l2_norm_clip: with `noise_multiplier`, shorthand for
        `privatizer=gaussian(l2_norm_clip, noise_multiplier)`.
      noise_multiplier: see `l2_norm_clip`.
      num_microbatches: as in tensorflow-privacy: average the losses of this
        many equal microbatches and privatize one record per microbatch. One
        example then changes one record arbitrarily, so its sensitivity
        doubles; `dp_event` accounts for that unless
        `expected_batch_size == num_microbatches` (one example per record).
      expected_batch_size: the public denominator of the noisy sum (the
        expected number of examples per batch). Required unless
        `num_microbatches` is given, which is then the denominator.
      noise_seed: a known integer key of the noise, for reproducible
        experiments only: anyone who knows it can subtract the noise, so a
        run with it is NOT private (`noise_seed_is_known`, and every privacy
        statement says so). `None` (the default) draws a secret key from the
        operating system and keeps it out of the config and checkpoints.
      **kwargs: arguments of the base Keras optimizer (`learning_rate`, ...).

    Raises:
      ValueError: naming the argument, for a missing or inconsistent privacy
        argument or for `clipnorm`, `clipvalue`, `global_clipnorm`.
    """
    for name in _REFUSED_KWARGS:
      if kwargs.get(name) is not None:
        raise ValueError(
            f'{name} is not supported by tfdpx optimizers: clipping is part of '
            'the privatizer (its l2_norm_clip); gradient clipping after the '
            'noise would not change privacy and clipping before it must be '
            'per example.')
    if isinstance(privatizer, dict):
      privatizer = core.deserialize(privatizer)
    if privatizer is None:
      if l2_norm_clip is None or noise_multiplier is None:
        raise ValueError(
            'pass privatizer=..., or both l2_norm_clip and noise_multiplier')
      privatizer = Gaussian(l2_norm_clip, noise_multiplier)
    elif l2_norm_clip is not None or noise_multiplier is not None:
      raise ValueError(
          'l2_norm_clip and noise_multiplier belong to the privatizer; do not '
          'pass them together with privatizer=...')
    if not isinstance(privatizer, core.Privatizer):
      raise ValueError(
          f'privatizer must be a tfdpx privatizer, got {privatizer!r}')
    if num_microbatches is not None:
      if int(num_microbatches) != num_microbatches or num_microbatches < 1:
        raise ValueError(
            f'num_microbatches must be a positive integer, got '
            f'{num_microbatches!r}')
      num_microbatches = int(num_microbatches)
    if expected_batch_size is not None:
      expected_batch_size = core.check_positive('expected_batch_size',
                                                expected_batch_size)
    elif num_microbatches is None:
      raise ValueError(
          'expected_batch_size is required: the noisy sum is divided by this '
          'public number, not by the realized batch size (or pass '
          'num_microbatches, which is then the denominator)')
    if noise_seed is not None and (int(noise_seed) != noise_seed or
                                   noise_seed < 0):
      raise ValueError(
          f'noise_seed must be a non-negative integer, got {noise_seed!r}')

    config = privatizer.config
    super().__init__(
        float(config.get('l2_norm_clip', float('nan'))),
        float(config.get('noise_multiplier', float('nan'))),
        num_microbatches, True, **kwargs)
    self._privatizer = privatizer
    self._expected_batch_size = expected_batch_size
    self._noise_seed = None if noise_seed is None else int(noise_seed)
    self._noise_key = None
    self._saved_dp_steps = 0
    self._dp_state_vars = None
    self._dp_state_structure = None
    self._dp_steps = None
    self._warned_jacobian = False
    self._warned_no_model = False
    self._eagerly_checked = None  # id() of the model checked in eager mode.

  # --- privacy ---------------------------------------------------------------

  @property
  def privatizer(self) -> core.Privatizer:
    return self._privatizer

  @property
  def denominator(self) -> float:
    """The public number the noisy sum is divided by."""
    if self._num_microbatches is not None:
      return float(self._num_microbatches)
    return self._expected_batch_size

  @property
  def noise_seed_is_known(self) -> bool:
    """True if the noise key was passed in (`noise_seed`): not private."""
    return self._noise_seed is not None

  @property
  def records_are_microbatches(self) -> bool:
    return (self._num_microbatches is not None and
            self._expected_batch_size != self._num_microbatches)

  def dp_event(self, step: int) -> dp_accounting.DpEvent:
    """The event of step `step` as this optimizer runs it (before sampling)."""
    event = self._privatizer.dp_event(step)
    if self.records_are_microbatches:
      event = accounting.scale_sensitivity(event, 2.0)
    return event

  @property
  def dp_steps(self) -> tf.Variable:
    """Number of privatized steps so far (a variable; checkpoints restore it)."""
    if self._dp_steps is None:
      with tf.init_scope():
        self._dp_steps = self.add_weight(
            'dp_steps', shape=[], dtype=tf.int64, trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._weights.append(self._dp_steps)
    return self._dp_steps

  def _create_all_weights(self, var_list):
    """Keras's weights, then the privatizer state and `dp_steps`.

    Keras calls this before setting saved optimizer weights (`.h5`), so the
    DP weights are created in the same order as in training and restored
    with the others.
    """
    super()._create_all_weights(var_list)
    self._create_dp_weights(var_list)

  def _create_dp_weights(self, var_list):
    if self._dp_state_vars is not None:
      return
    with tf.init_scope():
      state = self._privatizer.init(var_list)
      flat = tf.nest.flatten(state)
      self._dp_state_structure = state
      self._dp_state_vars = []
      for i, value in enumerate(flat):
        value = tf.convert_to_tensor(value)
        variable = self.add_weight(
            f'dp_state_{i}', shape=value.shape, dtype=value.dtype,
            trainable=False,
            initializer=lambda shape, dtype=None, v=value: v,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._dp_state_vars.append(variable)
        self._weights.append(variable)
    _ = self.dp_steps

  def _next_noise_key(self) -> tf.Tensor:
    """The key of this step's noise, `[secret, release counter]`; advances it.

    Keys never repeat. The secret is 63 bits of OS entropy drawn when the
    variables are created (or the known `noise_seed`); the counter counts
    this optimizer's releases and only increases. Neither variable is tracked
    by checkpoints or saved models: an optimizer restored to an earlier step
    keeps counting from its own releases, and a new process draws a new
    secret, so a rollback or a restart never draws the noise of an earlier
    release again (with a known `noise_seed` a new process starts its counter
    at 0 again: such runs are not private anyway).

    Under `tf.distribute` both are mirrored variables: MirroredStrategy gives
    every replica the primary's initial value, and MultiWorkerMirroredStrategy
    broadcasts the chief's, so every replica of every worker draws the same
    noise for the same all-reduced sum.
    """
    if self._noise_key is None:
      secret = (_secret_seed() if self._noise_seed is None
                else self._noise_seed)
      with tf.init_scope():
        # Plain tf.Variables, not add_weight: kept out of self._weights and
        # of every checkpoint.
        self._noise_key = [
            tf.Variable(tf.constant(value, tf.int64), trainable=False,
                        name=name,
                        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            for name, value in (('noise_secret', secret),
                                ('noise_counter', 0))]
    secret, counter = self._noise_key
    key = tf.stack([secret.read_value(), counter.read_value()])
    with tf.control_dependencies([key]):
      counter.assign_add(1)
    return key

  def privatize(self, per_example_grads, var_list, *, public_grads=None):
    """Privatized mean gradient from per-record gradients.

    Args:
      per_example_grads: the records' gradients: a
        `tfdpx.gradients.PerExampleGradients` (a model made private hands its
        engine's, which answers statistics per layer) or one
        `[num_records, *var.shape]` tensor per variable.
      var_list: the trainable variables, in the same order.
      public_grads: per-example gradients of public data, for privatizers that
        need them.

    Returns:
      One gradient per variable: the privatizer's noisy sum divided by
      `denominator` (and, under `tf.distribute`, by the number of replicas,
      since `apply_gradients` sums the replicas' identical shares).

    Raises:
      ValueError: if the privatizer needs public gradients and none are given.
    """
    if self._privatizer.requires_public_grads and public_grads is None:
      raise ValueError(
          f'{self._privatizer.name} needs per-example gradients of public '
          'data; train a model made private with public data '
          '(tfdpx.keras.make_private)')
    grads = gradients.as_per_example_gradients(per_example_grads)
    return self._privatized(
        var_list, lambda state, seed: self._privatizer.update(
            grads.materialized(), state, seed, public_grads=public_grads))

  def _privatized(self, var_list, update):
    """Runs `update(state, seed)`, keeps its new state, returns the mean."""
    with tf.init_scope():
      self._create_all_weights(var_list)
    self._check_ledger_restored()
    self._was_dp_gradients_called = True
    state = tf.nest.pack_sequence_as(
        self._dp_state_structure, [v.read_value() for v in self._dp_state_vars])
    noisy_sum, new_state = update(state, self._next_noise_key())
    # The updates wait for the noisy sum, which depends on the data: a step
    # that fails for want of data (the end of a dataset of unknown length)
    # must not advance the state or the step count.
    with tf.control_dependencies(noisy_sum):
      for variable, value in zip(self._dp_state_vars,
                                 tf.nest.flatten(new_state)):
        variable.assign(value)
      self.dp_steps.assign_add(1)
    # Under tf.distribute every replica holds the same global noisy sum, and
    # apply_gradients sums the replicas' gradients: each returns its share.
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else 1
    return [s / tf.cast(self.denominator * replicas, s.dtype)
            for s in noisy_sum]

  # --- Keras hooks -----------------------------------------------------------

  def _calling_model(self) -> Optional[tf.keras.Model]:
    """The Keras model whose train step is calling this optimizer, or None.

    Keras's `Model.train_step` hands the optimizer only the loss, the
    variables and the tape; the model is the one among the callers' local
    variables (`self` of `train_step`) that is compiled with this optimizer.
    """
    frame = inspect.currentframe()
    try:
      while frame is not None:
        for value in frame.f_locals.values():
          if isinstance(value, tf.keras.Model):
            optimizer = getattr(value, 'optimizer', None)
            if (optimizer is self or
                getattr(optimizer, 'inner_optimizer', None) is self):
              return value
        frame = frame.f_back
      return None
    finally:
      del frame

  def _check_model(self):
    """Runs the model validation of every DP path on the compile path."""
    model = self._calling_model()
    if model is None:
      if not self._warned_no_model:
        self._warned_no_model = True
        _LOG.warning(NO_MODEL_WARNING)
      return
    if tf.executing_eagerly() and self._eagerly_checked == id(model):
      return  # Eager steps: once per model. Traced steps: at every trace.
    spec = model.save_spec()  # Set by the forward pass of this step.
    validation.check_private_compatible(
        model, spec[0][0] if spec and spec[0] else None, compile_path=True)
    self._eagerly_checked = id(model) if tf.executing_eagerly() else None

  def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
    """Per-record gradients by the Jacobian, then `privatize`.

    Raises:
      ValueError: if the calling Keras model fails
        `tfdpx.keras.check_private_compatible(model, compile_path=True)`.
    """
    del grad_loss  # A per-example loss has no upstream gradient.
    self._check_model()
    if not callable(loss) and tape is None:
      raise ValueError('`tape` is required when a `Tensor` loss is passed.')
    tape = tape if tape is not None else tf.GradientTape()
    with tape:
      if callable(loss):
        if not callable(var_list):
          tape.watch(var_list)
        loss = loss()
      if callable(var_list):
        var_list = var_list()
      records = per_example.record_losses(loss, self._num_microbatches)
    var_list = tf.nest.flatten(var_list)
    if not self._warned_jacobian:
      self._warned_jacobian = True
      _LOG.warning(JACOBIAN_WARNING)
    with tf.name_scope(self._name + '/gradients'):
      grads = per_example.jacobian(tape, records, var_list)
      grads, _ = clipping.drop_nonfinite(grads)  # Before any privatizer.
      final = self.privatize(grads, var_list)
    return list(zip(final, var_list))

  def get_gradients(self, loss, params):
    raise NotImplementedError(
        'tfdpx optimizers run in TF2 (eager or tf.function) through minimize '
        'or Keras fit; the TF1 get_gradients path is not supported.')

  def get_config(self):
    config = super().get_config()
    config.update({
        'privatizer': core.serialize(self._privatizer),
        'num_microbatches': self._num_microbatches,
        'expected_batch_size': self._expected_batch_size,
        'noise_seed': self._noise_seed,
    })
    if self._dp_steps is not None:
      config[_SAVED_DP_STEPS] = int(tf.keras.backend.get_value(self._dp_steps))
    elif self._saved_dp_steps:  # Loaded, not yet restored: keep the record.
      config[_SAVED_DP_STEPS] = self._saved_dp_steps
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    saved_dp_steps = config.pop(_SAVED_DP_STEPS, 0)
    optimizer = super().from_config(config, custom_objects)
    optimizer._saved_dp_steps = saved_dp_steps  # pylint: disable=protected-access
    return optimizer

  def restore_state_from(self, restored, var_list) -> None:
    """Takes the step counts and privatizer state of a `restored` optimizer.

    Keras 2 loads a SavedModel's optimizer as a `RestoredOptimizer` that
    holds the saved variables and cannot train; a model made private hands
    it here when it is compiled with a fresh DP optimizer.

    Args:
      restored: the trackable with the saved variables (by name: `iter`,
        `dp_steps`, `dp_state_<i>`).
      var_list: the model's trainable variables.
    """
    self._create_all_weights(var_list)
    saved = restored._trackable_children()  # pylint: disable=protected-access
    for variable in [self.iterations, self.dp_steps] + self._dp_state_vars:
      name = variable.name.split('/')[-1].split(':')[0]
      if name in saved:
        variable.assign(saved[name])

  def _check_ledger_restored(self):
    """Refuses to train on from a saved config without its saved state.

    A reloaded optimizer whose config records N private steps but whose
    `dp_steps` was not restored would report the epsilon of the new steps
    only.
    """
    if not self._saved_dp_steps:
      return
    with tf.init_scope():
      steps = int(tf.keras.backend.get_value(self.dp_steps))
    if steps < self._saved_dp_steps:
      raise ValueError(
          f'this optimizer was saved after {self._saved_dp_steps} private '
          f'steps, but its state was not restored (dp_steps = {steps}): its '
          'epsilon would leave out the earlier steps. Keras 2 saves no '
          'optimizer variables of a plain model in the .keras and SavedModel '
          'formats; save a model made private (tfdpx.keras.make_private), '
          'use the .h5 format, or restore with tf.train.Checkpoint.')
    self._saved_dp_steps = 0


@tf.keras.saving.register_keras_serializable(package='tfdpx')
class DPSGD(DPOptimizerMixin, tfp_vectorized.VectorizedDPKerasSGDOptimizer):
  """SGD on privatized gradients. See `DPOptimizerMixin` for the DP arguments."""


@tf.keras.saving.register_keras_serializable(package='tfdpx')
class DPAdam(DPOptimizerMixin, tfp_vectorized.VectorizedDPKerasAdamOptimizer):
  """Adam on privatized gradients. See `DPOptimizerMixin` for the DP arguments."""


@tf.keras.saving.register_keras_serializable(package='tfdpx')
class DPAdagrad(DPOptimizerMixin,
                tfp_vectorized.VectorizedDPKerasAdagradOptimizer):
  """Adagrad on privatized gradients. See `DPOptimizerMixin` for the DP arguments."""
