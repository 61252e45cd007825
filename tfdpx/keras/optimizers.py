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
import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized as tfp_vectorized

from tfdpx import accounting
from tfdpx import clipping
from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx import per_example
from tfdpx.keras import validation
from tfdpx.privatizers.gaussian import Gaussian

_REFUSED_KWARGS = ('clipnorm', 'clipvalue', 'global_clipnorm')
_LOG = logging.getLogger(__name__)

JACOBIAN_WARNING = (
    'tfdpx: per-example gradients by tape.jacobian (the compile path) cost '
    'the square of the batch size: at batch 250 a step of the tensorflow-'
    'privacy tutorial CNN measured 350 times a non-private step. Train '
    'tfdpx.keras.make_private(model) instead: the same optimizer, per-layer '
    'per-example statistics in linear time (2 times a non-private step '
    'on that CNN; see benchmarks/README.md).')

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


def _key_variable(name: str, value: Optional[int]) -> tf.Variable:
  """A variable of the noise key that no checkpoint or graph holds.

  A plain variable, not an optimizer weight, so that no checkpoint tracks it.
  `value` None draws a secret from the operating system. In TF1 graph mode
  (`get_updates`: Estimator, Keras without eager execution) it is a local
  variable, which savers leave out, initialized by Keras's session too, and
  the secret is drawn by its initializer when a session runs it, not written
  into the graph as a constant (Estimator saves the graph).

  Args:
    name: the variable's name.
    value: its initial value, or None for a fresh secret.
  """
  aggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA
  if tf.executing_eagerly():
    initial = _secret_seed() if value is None else value
    return tf.Variable(tf.constant(initial, tf.int64), trainable=False,
                       name=name, aggregation=aggregation)
  if value is None:
    initial = tf.reshape(tf.numpy_function(
        lambda: np.int64(_secret_seed()), [], tf.int64, stateful=True), [])
  else:
    initial = tf.constant(value, tf.int64)
  variable = tf.compat.v1.Variable(
      initial, trainable=False, name=name, use_resource=True,
      aggregation=aggregation,
      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
  keras_backend.track_variable(variable)  # Keras's session initializes it.
  return variable


def _check_connected(grads, var_list):
  """Refuses gradients that are None (variables the loss does not reach)."""
  unconnected = [v.name for g, v in zip(grads, var_list) if g is None]
  if unconnected:
    raise ValueError(
        'None values not supported: the loss does not depend on the '
        f'trainable variables {unconnected}, so their per-example gradients '
        'are None (unconnected_gradients_to_zero=False, as in tensorflow-'
        'privacy). Pass unconnected_gradients_to_zero=True to give them zero '
        'gradients, or make them non-trainable.')


class DPOptimizerMixin:
  """Turns a tensorflow-privacy vectorized DP optimizer into a tfdpx one.

  Each step: per-record gradients (the Jacobian of the loss vector, or those a
  private model hands to `privatize`) go through `privatizer.update`, the
  noisy sum is divided by the public denominator, and the base optimizer
  (SGD, Adam, Adagrad) applies the result.
  """

  def __init__(self,
               l2_norm_clip: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               num_microbatches: Optional[int] = None,
               unconnected_gradients_to_zero: bool = False,
               *args,  # pylint: disable=keyword-arg-before-vararg
               privatizer: Optional[core.Privatizer] = None,
               expected_batch_size: Optional[float] = None,
               noise_seed: Optional[int] = None,
               **kwargs):
    """The arguments of tensorflow-privacy's vectorized DP optimizers, and more.

    `DPSGD(l2_norm_clip, noise_multiplier, num_microbatches, learning_rate=...)`
    means what `VectorizedDPKerasSGDOptimizer` with the same arguments means.

    Args:
      l2_norm_clip: with `noise_multiplier`, shorthand for
        `privatizer=gaussian(l2_norm_clip, noise_multiplier)` (DP-SGD).
      noise_multiplier: see `l2_norm_clip`.
      num_microbatches: as in tensorflow-privacy: split each batch into this
        many equal microbatches of consecutive rows, privatize one record per
        microbatch (the gradient of its mean loss) and divide the noisy sum by
        `num_microbatches`. A record holding several examples changes
        arbitrarily when one of them does, which doubles its sensitivity: the
        optimizer records how many examples its records held
        (`examples_per_record`), and `dp_event` doubles the sensitivity unless
        every record was one example (batches of exactly
        `num_microbatches` rows, as in tensorflow-privacy's tutorials).
      unconnected_gradients_to_zero: as in tensorflow-privacy: on the compile
        and graph paths (the Jacobian of the loss), a trainable variable the
        loss does not depend on gets a zero gradient if True; if False (the
        default) it raises the error tensorflow-privacy raises ("None values
        not supported"), naming the variables. A model made private
        (`make_private`) gives such variables zero gradients either way.
      *args: positional arguments of the base Keras optimizer after these
        four (`learning_rate`, ...), as in tensorflow-privacy.
      privatizer: the noise step (`tfdpx.privatizers.*`), or its
        `serialize`d form, instead of `l2_norm_clip` and `noise_multiplier`.
        Keyword only.
      expected_batch_size: the public denominator of the noisy sum (the
        expected number of examples per batch), the one to pass for Poisson
        sampling. Without it the denominator is `num_microbatches` or, if that
        is None too, the batch size of the first step: public for shuffled
        fixed-size batches (tensorflow-privacy divides by each step's batch
        size, which for a smaller last batch reveals the number of
        examples), not for Poisson-sampled ones, so such an optimizer's
        Poisson-sampling epsilon is refused.
      noise_seed: a known integer key of the noise, for reproducible
        experiments only: anyone who knows it can subtract the noise, so a
        run with it is NOT private (`noise_seed_is_known`, and every privacy
        statement says so). `None` (the default) draws a secret key from the
        operating system and keeps it out of the config and checkpoints.
      **kwargs: arguments of the base Keras optimizer (`learning_rate`, ...).

    Raises:
      ValueError: naming the argument, for a missing or inconsistent privacy
        argument, a privatizer passed by position, or `clipnorm`,
        `clipvalue`, `global_clipnorm`.
    """
    for name in _REFUSED_KWARGS:
      if kwargs.get(name) is not None:
        raise ValueError(
            f'{name} is not supported by tfdpx optimizers: clipping is part of '
            'the privatizer (its l2_norm_clip); gradient clipping after the '
            'noise would not change privacy and clipping before it must be '
            'per example.')
    if isinstance(l2_norm_clip, (core.Privatizer, dict)):
      raise ValueError(
          'privatizer is keyword-only: pass privatizer=...; the first '
          'positional argument is l2_norm_clip, as in tensorflow-privacy')
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
      if (isinstance(num_microbatches, bool) or
          int(num_microbatches) != num_microbatches or num_microbatches < 1):
        raise ValueError(
            f'num_microbatches must be a positive integer, got '
            f'{num_microbatches!r}')
      num_microbatches = int(num_microbatches)
    if not isinstance(unconnected_gradients_to_zero, bool):
      raise ValueError(
          'unconnected_gradients_to_zero must be True or False, got '
          f'{unconnected_gradients_to_zero!r} (it is the fourth positional '
          'argument, as in tensorflow-privacy; pass learning_rate=... by name)')
    if expected_batch_size is not None:
      expected_batch_size = core.check_positive('expected_batch_size',
                                                expected_batch_size)
    if noise_seed is not None and (int(noise_seed) != noise_seed or
                                   noise_seed < 0):
      raise ValueError(
          f'noise_seed must be a non-negative integer, got {noise_seed!r}')

    config = privatizer.config
    super().__init__(
        float(config.get('l2_norm_clip', float('nan'))),
        float(config.get('noise_multiplier', float('nan'))),
        num_microbatches, unconnected_gradients_to_zero, *args, **kwargs)
    self._privatizer = privatizer
    self._expected_batch_size = expected_batch_size
    self._noise_seed = None if noise_seed is None else int(noise_seed)
    self._noise_key = None
    self._saved_dp_steps = 0
    self._dp_state_vars = None
    self._dp_state_structure = None
    self._dp_steps = None
    self._examples_per_record = None
    self._first_batch_size = None
    self._warned_jacobian = False
    self._warned_no_model = False
    self._eagerly_checked = None  # id() of the model checked in eager mode.

  # --- privacy ---------------------------------------------------------------

  @property
  def privatizer(self) -> core.Privatizer:
    return self._privatizer

  @property
  def denominator(self) -> Optional[float]:
    """The public number the noisy sum is divided by.

    None if none was given (neither `num_microbatches` nor
    `expected_batch_size`): every step then divides by the batch size of the
    first step, a public number for shuffled fixed-size batches (tensorflow-
    privacy divides by each step's own, which for a last, smaller batch
    reveals the number of examples).
    """
    if self._num_microbatches is not None:
      return float(self._num_microbatches)
    return self._expected_batch_size

  @property
  def noise_seed_is_known(self) -> bool:
    """True if the noise key was passed in (`noise_seed`): not private."""
    return self._noise_seed is not None

  @property
  def examples_per_record(self) -> Optional[int]:
    """The most examples one privatized record held in any step so far.

    1 without `num_microbatches`. With it, the largest batch size divided by
    `num_microbatches` of the steps taken (a variable: checkpoints restore
    it), or None before the first step.
    """
    if self._num_microbatches is None:
      return 1
    with tf.init_scope():
      seen = int(tf.keras.backend.get_value(self._examples_per_record_seen))
    return seen or None

  @property
  def records_are_microbatches(self) -> bool:
    """Whether a record may hold several examples (doubled sensitivity).

    Decided by the steps taken (`examples_per_record`); before the first step,
    one example per record only if `expected_batch_size == num_microbatches`.
    """
    seen = self.examples_per_record
    if seen is None:
      return self._expected_batch_size != self._num_microbatches
    return seen > 1

  def dp_event(self, step: int) -> dp_accounting.DpEvent:
    """The event of step `step` as this optimizer runs it (before sampling)."""
    event = self._privatizer.dp_event(step)
    if self.records_are_microbatches:
      event = accounting.scale_sensitivity(event, 2.0)
    return event

  @property
  def _examples_per_record_seen(self) -> tf.Variable:
    """The variable behind `examples_per_record` (with `num_microbatches`).

    Created on first use, so that a checkpoint restores it even before the
    first step; it joins `weights` (the order `.h5` files keep) only with
    the other DP weights, in `_create_dp_weights`.
    """
    if self._examples_per_record is None:
      with tf.init_scope():
        self._examples_per_record = self.add_weight(
            'dp_examples_per_record', shape=[], dtype=tf.int64,
            trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    return self._examples_per_record

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
    if self._num_microbatches is not None:
      self._weights.append(self._examples_per_record_seen)
    if self.denominator is None:
      with tf.init_scope():
        self._first_batch_size = self.add_weight(
            'dp_first_batch_size', shape=[], dtype=tf.int64, trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._weights.append(self._first_batch_size)

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
      with tf.init_scope():
        self._noise_key = [_key_variable('noise_secret', self._noise_seed),
                           _key_variable('noise_counter', 0)]
    secret, counter = self._noise_key
    count = counter.read_value()
    with tf.control_dependencies([count]):
      advanced = counter.assign_add(1)
    # The key depends on the counter's advance, so that the advance runs with
    # the noise also in TF1 graph mode, which runs only what is fetched.
    with tf.control_dependencies([advanced]):
      return tf.stack([secret.read_value(), tf.identity(count)])

  def privatize(self, per_example_grads, var_list, *, public_grads=None,
                num_examples=None):
    """Privatized mean gradient from per-record gradients.

    Args:
      per_example_grads: the records' gradients: a
        `tfdpx.gradients.PerExampleGradients` (a model made private hands its
        engine's, which answers statistics per layer) or one
        `[num_records, *var.shape]` tensor per variable.
      var_list: the trainable variables, in the same order.
      public_grads: per-example gradients of public data, for privatizers that
        need them.
      num_examples: the number of examples (rows of this replica's batch)
        the records were formed from, a scalar tensor; without
        `num_microbatches`, by default, the number of records. With it, it
        tells how many examples each record held (`examples_per_record`).

    Returns:
      One gradient per variable: the privatizer's noisy sum divided by
      `denominator` (if None, by the global batch size of the first step)
      and, under `tf.distribute`, by the number of replicas, since
      `apply_gradients` sums the replicas' identical shares.

    Raises:
      ValueError: if the privatizer needs public gradients and none are given.
    """
    if self._privatizer.requires_public_grads and public_grads is None:
      raise ValueError(
          f'{self._privatizer.name} needs per-example gradients of public '
          'data; train a model made private with public data '
          '(tfdpx.keras.make_private)')
    grads = gradients.as_per_example_gradients(per_example_grads)
    if num_examples is None and self._num_microbatches is None:
      num_examples = grads.batch_size()
    return self._privatized(
        var_list, lambda state, seed: self._privatizer.update(
            grads, state, seed, public_grads=public_grads),
        num_examples)

  def _privatized(self, var_list, update, num_examples=None):
    """Runs `update(state, seed)`, keeps its new state, returns the mean.

    `num_examples` (this replica's batch size, a scalar tensor, or None)
    gives the denominator at the first step when none was given, and with
    `num_microbatches` how many examples each record held.
    """
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
      updates = [variable.assign(value) for variable, value in zip(
          self._dp_state_vars, tf.nest.flatten(new_state))]
      updates.append(self.dp_steps.assign_add(1))
      if self._num_microbatches is not None and num_examples is not None:
        per_record = tf.cast(num_examples // self._num_microbatches, tf.int64)
        seen = self._examples_per_record_seen
        updates.append(seen.assign(tf.maximum(seen, per_record)))
      denominator = self.denominator
      if denominator is None:  # The global batch size of the first step.
        first = self._first_batch_size
        batch_size = noise.replica_sum(
            [tf.cast(num_examples, tf.int64)])[0]
        denominator = tf.where(first > 0, first, tf.maximum(batch_size, 1))
        updates.append(first.assign(denominator))
    # Under tf.distribute every replica holds the same global noisy sum, and
    # apply_gradients sums the replicas' gradients: each returns its share.
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else 1
    # The result depends on the updates, so that TF1 graph mode, which runs
    # only what is fetched, runs them.
    with tf.control_dependencies(updates):
      return [s / tf.cast(denominator * replicas, s.dtype) for s in noisy_sum]

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
        `tfdpx.keras.check_private_compatible(model, compile_path=True)`, or
        for a variable the loss does not depend on, unless
        `unconnected_gradients_to_zero`.
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
      grads = tape.jacobian(records, var_list,
                            unconnected_gradients=self._unconnected_gradients)
      _check_connected(grads, var_list)
      final = self._privatized_records(grads, var_list, loss)
    return list(zip(final, var_list))

  def get_gradients(self, loss, params):
    """Privatized gradients in TF1 graph mode (`get_updates`, Estimator).

    tensorflow-privacy's graph-mode path: the per-record gradients of the
    loss vector, through `privatize`, as `_compute_gradients` does.

    Args:
      loss: the per-example loss, `[B, ...]` (not reduced over the batch).
      params: the variables.

    Returns:
      One privatized gradient per variable.

    Raises:
      ValueError: for a loss reduced over the batch, or a variable the loss
        does not depend on unless `unconnected_gradients_to_zero`.
    """
    self._check_model()
    params = tf.nest.flatten(params)
    records = per_example.record_losses(loss, self._num_microbatches)
    with tf.name_scope(self._name + '/gradients'):
      _check_connected(tf.gradients(tf.reduce_sum(records), params,
                                    unconnected_gradients=(
                                        self._unconnected_gradients)),
                       params)
      grads = tf.vectorized_map(
          lambda record: tf.gradients(
              record, params,
              unconnected_gradients=tf.UnconnectedGradients.ZERO), records)
      return self._privatized_records(grads, params, loss)

  @property
  def _unconnected_gradients(self) -> tf.UnconnectedGradients:
    if self._unconnected_gradients_to_zero:
      return tf.UnconnectedGradients.ZERO
    return tf.UnconnectedGradients.NONE

  def _privatized_records(self, grads, var_list, loss):
    """`privatize` of the per-record gradients of the per-example `loss`."""
    grads, _ = clipping.drop_nonfinite(grads)  # Before any privatizer.
    return self.privatize(grads, var_list, num_examples=tf.shape(loss)[0])

  def get_config(self):
    config = super().get_config()
    config.update({
        'privatizer': core.serialize(self._privatizer),
        'num_microbatches': self._num_microbatches,
        'expected_batch_size': self._expected_batch_size,
        'noise_seed': self._noise_seed,
        'unconnected_gradients_to_zero': self._unconnected_gradients_to_zero,
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
        `dp_steps`, `dp_state_<i>`, ...).
      var_list: the model's trainable variables.
    """
    self._create_all_weights(var_list)
    saved = restored._trackable_children()  # pylint: disable=protected-access
    for variable in self.weights:
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
