"""The DP optimizer's privacy release, common to Keras 2 and Keras 3.

`DPOptimizerMixin` holds what does not depend on the Keras version: the DP
arguments and their checks, the noise key, the privatizer's state, the step
count behind epsilon and `privatize` (per-record gradients -> noisy mean).
`tfdpx.keras.optimizers` (Keras 2, over tensorflow-privacy's vectorized
optimizers) and `tfdpx.keras.optimizers_keras3` (Keras 3) add how variables
are created and how gradients reach it.
"""

import os
from typing import List, Optional

import dp_accounting
import tensorflow as tf

from tfdpx import accounting
from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx import virtual_batches
from tfdpx.privatizers.gaussian import Gaussian


_REFUSED_KWARGS = ('clipnorm', 'clipvalue', 'global_clipnorm')

# The config key that records how many private steps a saved optimizer took.
_SAVED_DP_STEPS = 'dp_steps_when_saved'


def secret_seed() -> int:
  return int.from_bytes(os.urandom(8), 'little') & 0x7FFFFFFFFFFFFFFF



def _values(gradient):
  """The tensor of a gradient (a `tf.IndexedSlices`'s values)."""
  if isinstance(gradient, tf.IndexedSlices):
    return gradient.values
  return gradient


def _map_values(function, gradient):
  """`function` of a gradient's values, keeping a `tf.IndexedSlices`'s rows."""
  if isinstance(gradient, tf.IndexedSlices):
    return tf.IndexedSlices(function(gradient.values), gradient.indices,
                            gradient.dense_shape)
  return function(gradient)


class _NoiseKey:
  """The noise key's two variables, held where no checkpoint tracks them.

  A plain object: Keras and `tf.train.Checkpoint` track the variables an
  optimizer holds in its attributes, lists and tuples, not those of an
  untracked object.
  """

  def __init__(self, secret: tf.Variable, counter: tf.Variable):
    self.secret = secret
    self.counter = counter



class _SecretState:
  """The variables of the privatizer's secret state (`core.secret_leaves`):
  a plain object, which no checkpoint tracks, as `_NoiseKey`."""

  def __init__(self, variables: List[tf.Variable]):
    self.variables = variables


class DPOptimizerMixin:
  """What makes a Keras optimizer a tfdpx DP optimizer, on either Keras.

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
        `clipvalue`, `global_clipnorm`, `gradient_accumulation_steps` (see
        `physical_batch_size` of `tfdpx.keras.make_private`).
    """
    for name in _REFUSED_KWARGS:
      if kwargs.get(name) is not None:
        raise ValueError(
            f'{name} is not supported by tfdpx optimizers: clipping is part of '
            'the privatizer (its l2_norm_clip); gradient clipping after the '
            'noise would not change privacy and clipping before it must be '
            'per example.')
    if kwargs.get('gradient_accumulation_steps') is not None:
      # Keras 3's optimizers would average k privatized (noisy) gradients:
      # k noise draws and k privacy events per update, not the large batch
      # this argument means in tensorflow-privacy's non-vectorized optimizers.
      raise ValueError(
          'gradient_accumulation_steps is not supported by tfdpx optimizers. '
          'For a large logical batch with the memory of a small one, use '
          'virtual batches: tfdpx.keras.make_private(model, '
          'physical_batch_size=...) sums the clipped gradients of each '
          'physical batch and adds noise once per logical batch.')
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

    self._init_base(privatizer, num_microbatches,
                    unconnected_gradients_to_zero, args, kwargs)
    self._privatizer = privatizer
    self._num_microbatches = num_microbatches
    self._unconnected_gradients_to_zero = unconnected_gradients_to_zero
    self._expected_batch_size = expected_batch_size
    self._noise_seed = None if noise_seed is None else int(noise_seed)
    self._noise_key = None
    self._saved_dp_steps = 0
    self._dp_state_vars = None  # The public state's, which checkpoints keep.
    self._secret_state = None
    self._dp_state_structure = None
    self._dp_steps = None
    self._examples_per_record = None
    self._first_batch_size = None
    self._user_level = False

  # --- what each Keras version supplies -------------------------------------

  def _init_base(self, privatizer, num_microbatches,
                 unconnected_gradients_to_zero, args, kwargs):
    """Initializes the base Keras optimizer."""
    raise NotImplementedError

  def _before_release(self, var_list):
    """Creates the DP variables if needed (in an init scope)."""
    raise NotImplementedError

  def _create_weights(self, var_list):
    """Creates the optimizer's and the DP weights if needed (in an init
    scope)."""
    raise NotImplementedError

  def _new_key_variable(self, name: str, value: Optional[int]) -> tf.Variable:
    """A variable of the noise key; `value` None draws a secret."""
    raise NotImplementedError

  def _new_secret_variable(self, name: str, value: tf.Tensor) -> tf.Variable:
    """A variable initialized to `value` that no checkpoint holds."""
    raise NotImplementedError

  def _create_state_variables(self, state, public_variable) -> List[tf.Variable]:
    """The variables of the privatizer state `state`.

    Each public leaf by `public_variable(name, value)`, returned in order:
    the caller keeps them in `_dp_state_vars`, which checkpoints track. Each
    secret leaf (`core.secret_leaves`: the noise history of correlated noise)
    in a variable no checkpoint, saved model or weight list holds, as the
    noise key's (`_SecretState`).
    """
    self._dp_state_structure = state
    public, secret = [], []
    for i, (value, is_secret) in enumerate(zip(tf.nest.flatten(state),
                                               core.secret_leaves(state))):
      value = tf.convert_to_tensor(value)
      if is_secret:
        secret.append(self._new_secret_variable(f'dp_secret_{i}', value))
      else:
        public.append(public_variable(f'dp_state_{i}', value))
    self._secret_state = _SecretState(secret)
    return public

  def _state_variables(self) -> List[tf.Variable]:
    """Every variable of the privatizer state, in `tf.nest.flatten` order."""
    public = iter(self._dp_state_vars)
    secret = iter(self._secret_state.variables)
    return [next(secret) if is_secret else next(public)
            for is_secret in core.secret_leaves(self._dp_state_structure)]

  def _read_int(self, variable) -> int:
    """The value of an integer variable, outside any trace."""
    with tf.init_scope():
      return int(variable.numpy())

  @property
  def dp_steps(self) -> tf.Variable:
    """Number of privatized steps so far (a variable; checkpoints restore it)."""
    raise NotImplementedError

  @property
  def _examples_per_record_seen(self) -> tf.Variable:
    """The most examples per record so far (with `num_microbatches`)."""
    raise NotImplementedError

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
  def expected_batch_size(self) -> Optional[float]:
    """The expected number of records (examples, or users) per batch."""
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
    return self._read_int(self._examples_per_record_seen) or None

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

  @property
  def records_are_users(self) -> bool:
    """Whether the records were users (user-level privacy): set by a model
    made private with `examples_per_user`, kept in the config."""
    return self._user_level

  def use_user_records(self):
    """Marks the records as users (each a sum over one user's examples).

    Raises:
      ValueError: with `num_microbatches`, or without `expected_batch_size`
        (the noisy sum must be divided by the public expected number of
        users, not by a count of the batch).
    """
    if self._num_microbatches is not None:
      raise ValueError('num_microbatches cannot be combined with user-level '
                       'records (examples_per_user)')
    if self._expected_batch_size is None:
      raise ValueError(
          'user-level records (examples_per_user) need the optimizer\'s '
          'expected_batch_size: the expected number of users per batch')
    self._user_level = True

  def dp_event(self, step: int) -> dp_accounting.DpEvent:
    """The event of step `step` as this optimizer runs it (before sampling)."""
    event = self._privatizer.dp_event(step)
    if self.records_are_microbatches:
      event = accounting.scale_sensitivity(event, 2.0)
    return event

  def privatizer_logs(self):
    """The privatizer's `logs` of its current state (e.g. the adapted clip
    norm): computed from released data only. Empty before the first step."""
    if self._dp_state_vars is None:
      return {}
    return self._privatizer.logs(tf.nest.pack_sequence_as(
        self._dp_state_structure,
        [tf.convert_to_tensor(v) for v in self._state_variables()]))

  def secret_checkpoint(self) -> tf.train.Checkpoint:
    """A checkpoint of the privatizer's secret state, for a secret store.

    The last noises of noise correlated across steps
    (`tfdpx.privatizers.correlated`) are as secret as the noise key, so no
    checkpoint or saved model of the model or optimizer holds them. Save
    this checkpoint only where the training data may be kept, and restore it
    with the model's own checkpoint: the resumed run then continues the
    correlation (noise that cancels as the strategy intends). Resumed
    without it, the correlation restarts, which is as private.

    Returns:
      A `tf.train.Checkpoint` of the secret state's variables (none for a
      privatizer without secret state).

    Raises:
      ValueError: before the optimizer's variables exist (a first step, or
        `create_variables(model.trainable_variables)`).
    """
    if self._dp_state_vars is None:
      raise ValueError(
          'the optimizer has no variables yet: train a step or call '
          'create_variables(model.trainable_variables) first')
    return tf.train.Checkpoint(secret_state=self._secret_state.variables)

  def create_variables(self, var_list) -> None:
    """Creates the variables a step writes, before any step is traced.

    The optimizer's own and the DP weights for `var_list` (the variables it
    will update) and the noise key. A step creates whatever is missing, so
    this is optional; a model made private calls it before Keras traces its
    step, since a variable created in the first trace makes tf.function trace
    the step a second time.
    """
    self._create_weights(var_list)
    self._noise_key_variables()

  def _noise_key_variables(self) -> '_NoiseKey':
    """The noise key's variables (`_next_noise_key`), created if need be."""
    if self._noise_key is None:
      with tf.init_scope():
        self._noise_key = _NoiseKey(
            self._new_key_variable('noise_secret', self._noise_seed),
            self._new_key_variable('noise_counter', 0))
    return self._noise_key

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
    key = self._noise_key_variables()
    secret, counter = key.secret, key.counter
    count = counter.read_value()
    with tf.control_dependencies([count]):
      advanced = counter.assign_add(1)
    # The key depends on the counter's advance, so that the advance runs with
    # the noise also in TF1 graph mode, which runs only what is fetched.
    with tf.control_dependencies([advanced]):
      return tf.stack([secret.read_value(), tf.identity(count)])

  def _check_public_grads(self, public_grads):
    if self._privatizer.requires_public_grads and public_grads is None:
      raise ValueError(
          f'{self._privatizer.name} needs per-example gradients of public '
          'data; train a model made private with public data '
          '(tfdpx.keras.make_private(model, public_data=...), or '
          'model.set_public_data(...) on a loaded one)')

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
    self._check_public_grads(public_grads)
    grads = gradients.as_per_example_gradients(per_example_grads)
    if num_examples is None and self._num_microbatches is None:
      num_examples = grads.batch_size()
    return self._privatized(
        var_list, lambda state, seed: self._privatizer.update(
            grads, state, seed, public_grads=public_grads),
        num_examples)

  def privatize_chunks(self, num_chunks, chunk, var_list, *, public_grads=None,
                       num_examples=None):
    """`privatize` of a logical batch given as physical batches (virtual batches).

    Args:
      num_chunks: the number of physical batches, an int32 scalar >= 1.
      chunk: `chunk(i)` -> physical batch `i`'s per-example gradients and a
        function returning its extras (`tfdpx.virtual_batches.Chunk`).
      var_list, public_grads: as `privatize`.
      num_examples: the number of rows of the logical batch on this
        replica (before it is padded to whole physical batches), a scalar
        tensor: the denominator at the first step when none was given.

    Returns:
      `(gradients, extras)`: as `privatize`'s return, and each physical
      batch's extras stacked (`[num_chunks, ...]`).

    Raises:
      ValueError: with `num_microbatches` (a microbatch would have to lie in
        one physical batch), or as `privatize`.
    """
    if self._num_microbatches is not None:
      raise ValueError('num_microbatches cannot be combined with virtual '
                       'batches (physical_batch_size)')
    self._check_public_grads(public_grads)
    extras = []

    def update(state, seed):
      noisy_sum, new_state, stacked = virtual_batches.update(
          self._privatizer, state, seed, num_chunks, chunk, public_grads)
      extras.append(stacked)
      return noisy_sum, new_state

    return self._privatized(var_list, update, num_examples), extras[0]

  def _privatized(self, var_list, update, num_examples=None):
    """Runs `update(state, seed)`, keeps its new state, returns the mean.

    `num_examples` (this replica's batch size, a scalar tensor, or None)
    gives the denominator at the first step when none was given, and with
    `num_microbatches` how many examples each record held.
    """
    self._before_release(var_list)
    self._check_ledger_restored()
    variables = self._state_variables()
    state = tf.nest.pack_sequence_as(
        self._dp_state_structure, [tf.convert_to_tensor(v) for v in variables])
    noisy_sum, new_state = update(state, self._next_noise_key())
    # The updates wait for the noisy sum, which depends on the data: a step
    # that fails for want of data (the end of a dataset of unknown length)
    # must not advance the state or the step count.
    with tf.control_dependencies([_values(s) for s in noisy_sum]):
      updates = [variable.assign(value) for variable, value in zip(
          variables, tf.nest.flatten(new_state))]
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
    # only what is fetched, runs them. Only the identities wait for them: a
    # constant made under these dependencies (the denominator) would carry
    # them, and grappler's constant folding, pushing it into the noisy sum's
    # own products, would make the updates wait for themselves (a cycle:
    # grappler then gives up on the whole step).
    with tf.control_dependencies(updates):
      noisy_sum = [_map_values(tf.identity, s) for s in noisy_sum]
    return [_map_values(lambda v: v / tf.cast(denominator * replicas, v.dtype),
                        s) for s in noisy_sum]

  # --- Keras hooks -----------------------------------------------------------

  def get_config(self):
    config = super().get_config()
    config.update({
        'privatizer': core.serialize(self._privatizer),
        'num_microbatches': self._num_microbatches,
        'expected_batch_size': self._expected_batch_size,
        'noise_seed': self._noise_seed,
        'unconnected_gradients_to_zero': self._unconnected_gradients_to_zero,
    })
    if self._user_level:
      config['user_level'] = True
    if self._dp_steps is not None:
      config[_SAVED_DP_STEPS] = self._read_int(self._dp_steps)
    elif self._saved_dp_steps:  # Loaded, not yet restored: keep the record.
      config[_SAVED_DP_STEPS] = self._saved_dp_steps
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    saved_dp_steps = config.pop(_SAVED_DP_STEPS, 0)
    user_level = config.pop('user_level', False)
    optimizer = super().from_config(config, custom_objects)
    optimizer._saved_dp_steps = saved_dp_steps  # pylint: disable=protected-access
    optimizer._user_level = user_level  # pylint: disable=protected-access
    return optimizer

  def _check_ledger_restored(self):
    """Refuses to train on from a saved config without its saved state.

    A reloaded optimizer whose config records N private steps but whose
    `dp_steps` was not restored would report the epsilon of the new steps
    only.
    """
    if not self._saved_dp_steps:
      return
    steps = self._read_int(self.dp_steps)
    if steps < self._saved_dp_steps:
      raise ValueError(
          f'this optimizer was saved after {self._saved_dp_steps} private '
          f'steps, but its state was not restored (dp_steps = {steps}): its '
          'epsilon would leave out the earlier steps. Save and load a model '
          'made private (tfdpx.keras.make_private), which carries its '
          "optimizer's variables, or restore with tf.train.Checkpoint.")
    self._saved_dp_steps = 0

