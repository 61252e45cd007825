"""Keras callbacks that report privacy.

Both take the sampling of the batches explicitly: `sampling='poisson'` with
`sampling_probability=q` (`tfdpx.sampling.poisson_batches`),
`sampling='shuffle'` with `steps_per_epoch` (fixed-size batches from a
shuffled pass, Keras' default), or `sampling='cyclic_poisson'` with
`sampling_probability` and `groups` (`tfdpx.sampling.cyclic_poisson_batches`,
for noise correlated across steps); `tfdpx.accounting.epsilon_for_sampling`
then gives the epsilon that holds for it.
"""

import logging
from typing import Optional

import tensorflow as tf

from tfdpx import accounting
from tfdpx.keras import models
from tfdpx.keras import validation
from tfdpx.keras.stack import keras_version

_LOG = logging.getLogger(__name__)

KNOWN_SEED_WARNING = (
    'tfdpx: NOT PRIVATE: the noise seed is known (noise_seed=...), so anyone '
    'who knows it can subtract the noise; the epsilon logged for this run '
    'describes the noise, not a guarantee.')


def _dp_optimizer(model, callback):
  optimizer = model.optimizer
  if not hasattr(optimizer, 'dp_steps'):
    raise ValueError(f'{callback} needs a tfdpx optimizer, got '
                     f'{type(optimizer).__name__}')
  return optimizer


def _check_before_training(model, callback):
  """What a callback can check before the first step is traced.

  A plain model compiled with a tfdpx optimizer (the compile path) is
  validated here, before Keras's own train step runs: that step fails on
  weight regularizers inside Keras (`tf.add_n` of the unreduced loss and a
  scalar), with an error that does not say why.
  """
  optimizer = _dp_optimizer(model, callback)
  if not isinstance(model, (models.DPModel, models.DPSequential)):
    functional = keras_version.is_graph_network(model)
    inputs = keras_version.graph_endpoints(model)[0] if functional else None
    validation.check_private_compatible(model, inputs, compile_path=True)
  if optimizer.noise_seed_is_known:
    _LOG.warning(KNOWN_SEED_WARNING)


def _sampling_arguments(sampling, delta, sampling_probability,
                        steps_per_epoch, accountant, groups):
  """The checked keyword arguments of `accounting.epsilon_for_sampling`."""
  accounting.check_accounting_arguments(
      sampling, delta=delta, sampling_probability=sampling_probability,
      steps_per_epoch=steps_per_epoch, groups=groups)
  return dict(sampling=sampling, sampling_probability=sampling_probability,
              steps_per_epoch=steps_per_epoch, groups=groups,
              accountant=accounting.check_accountant(accountant))


class PrivacyCallback(tf.keras.callbacks.Callback):
  """Adds `epsilon` to the epoch logs (History, progress bar, TensorBoard).

  Epsilon is computed from the optimizer's own step counter (`dp_steps`) and
  its events (`dp_event`), so a resumed run continues its ledger.
  """

  def __init__(self, *, sampling: str, delta: float,
               sampling_probability: Optional[float] = None,
               steps_per_epoch: Optional[int] = None,
               accountant: str = 'rdp',
               groups: Optional[int] = None):
    """Args:
      sampling: 'poisson', 'shuffle' or 'cyclic_poisson', how the batches
        are drawn.
      delta: target delta.
      sampling_probability: with `sampling='poisson'`: q = expected batch
        size / n; with 'cyclic_poisson', within the step's group.
      steps_per_epoch: with `sampling='shuffle'` only: steps of one pass over
        the data (`n // batch_size` for `drop_remainder` batches).
      accountant: 'rdp' (default) or 'pld' (`tfdpx.accounting.ACCOUNTANTS`).
      groups: with `sampling='cyclic_poisson'` only: the number of groups.

    Raises:
      ValueError: naming a missing, extra or bad argument.
    """
    super().__init__()
    self.sampling_arguments = _sampling_arguments(
        sampling, delta, sampling_probability, steps_per_epoch, accountant,
        groups)
    self.delta = delta

  def _epsilon(self, steps=None):
    return accounting.epsilon_for_sampling(
        _dp_optimizer(self.model, 'PrivacyCallback'), steps=steps,
        delta=self.delta, **self.sampling_arguments)

  def on_train_begin(self, logs=None):
    _check_before_training(self.model, 'PrivacyCallback')
    # Refuses an optimizer it cannot account before the first step (steps=0
    # leaves the optimizer's step counter to be created by the first step).
    self._epsilon(steps=0)

  def on_epoch_end(self, epoch, logs=None):
    if logs is not None:
      logs['epsilon'] = self._epsilon()


class EpsilonBudget(tf.keras.callbacks.Callback):
  """Stops training before the next execution would take epsilon past a budget.

  Keras calls batch callbacks once per execution of `steps_per_execution`
  steps (`compile`). After every execution this computes the epsilon after
  one more full execution (from the optimizer's `dp_steps` and events); if
  that exceeds `target_epsilon` it sets `model.stop_training`, so epsilon
  never exceeds the budget. It may stop up to `steps_per_execution - 1` steps
  earlier than necessary.
  """

  def __init__(self, target_epsilon: float, *, sampling: str, delta: float,
               sampling_probability: Optional[float] = None,
               steps_per_epoch: Optional[int] = None,
               accountant: str = 'rdp',
               groups: Optional[int] = None):
    """Args:
      target_epsilon: the budget, > 0.
      sampling, delta, sampling_probability, steps_per_epoch, accountant,
        groups: as in `PrivacyCallback`.

    Raises:
      ValueError: naming a missing, extra or bad argument.
    """
    super().__init__()
    if not target_epsilon > 0:
      raise ValueError(f'target_epsilon must be > 0, got {target_epsilon!r}')
    self.target_epsilon = target_epsilon
    self.sampling_arguments = _sampling_arguments(
        sampling, delta, sampling_probability, steps_per_epoch, accountant,
        groups)
    self.delta = delta
    self.stopped_at_step = None
    self._execution_steps = 1

  def _compiled_steps_per_execution(self) -> int:
    variable = getattr(self.model, '_steps_per_execution', None)
    if variable is not None:  # Keras 2: a variable.
      return int(variable.numpy())
    return int(getattr(self.model, 'steps_per_execution', 1))  # Keras 3.

  def _epsilon_after_next_execution(self) -> float:
    optimizer = _dp_optimizer(self.model, 'EpsilonBudget')
    # Keras shortens the last execution of an epoch by assigning the
    # variable; the next execution may be a full one again.
    steps = int(optimizer.dp_steps.numpy()) + max(
        self._execution_steps, self._compiled_steps_per_execution())
    return accounting.epsilon_for_sampling(
        optimizer, steps=steps, delta=self.delta, **self.sampling_arguments)

  def on_train_begin(self, logs=None):
    _check_before_training(self.model, 'EpsilonBudget')
    if getattr(self.model, 'autotune_steps_per_execution', False):
      raise ValueError(
          "EpsilonBudget cannot bound steps_per_execution='auto' (Keras may "
          'grow it without limit between two callbacks); compile with an '
          'integer steps_per_execution')
    self._execution_steps = self._compiled_steps_per_execution()
    eps = self._epsilon_after_next_execution()
    if eps > self.target_epsilon:
      raise ValueError(
          f'the privacy budget target_epsilon={self.target_epsilon} is spent: '
          f'the next {self._execution_steps} step(s) (steps_per_execution) '
          f'would take epsilon to {eps:.4g}')

  def on_train_batch_end(self, batch, logs=None):
    if self._epsilon_after_next_execution() > self.target_epsilon:
      self.model.stop_training = True
      self.stopped_at_step = int(self.model.optimizer.dp_steps.numpy())
