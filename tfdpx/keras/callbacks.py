"""Keras callbacks that report privacy."""

import tensorflow as tf

from tfdpx import accounting


class PrivacyCallback(tf.keras.callbacks.Callback):
  """Adds `epsilon` to the epoch logs (History, progress bar, TensorBoard).

  Epsilon is computed from the optimizer's own step counter (`dp_steps`) and
  its events (`dp_event`), so a resumed run continues its ledger.
  """

  def __init__(self, *, sampling_probability: float, delta: float):
    """Args:
      sampling_probability: Poisson sampling probability q = batch / n (with
        shuffled fixed-size batches the reported epsilon is the Poisson
        approximation; see `tfdpx.accounting.privacy_statement`).
      delta: target delta.
    """
    super().__init__()
    if not 0 < sampling_probability <= 1:
      raise ValueError(f'sampling_probability must be in (0, 1], got '
                       f'{sampling_probability!r}')
    if not 0 < delta < 1:
      raise ValueError(f'delta must be in (0, 1), got {delta!r}')
    self.sampling_probability = sampling_probability
    self.delta = delta

  def on_epoch_end(self, epoch, logs=None):
    optimizer = self.model.optimizer
    if not hasattr(optimizer, 'dp_steps'):
      raise ValueError('PrivacyCallback needs a tfdpx optimizer, got '
                       f'{type(optimizer).__name__}')
    if logs is not None:
      logs['epsilon'] = accounting.epsilon(
          optimizer, sampling_probability=self.sampling_probability,
          delta=self.delta)


class EpsilonBudget(tf.keras.callbacks.Callback):
  """Stops training before the next step would take epsilon above a budget.

  After every batch it computes the epsilon of one more step (from the
  optimizer's `dp_steps` and events); if that exceeds `target_epsilon`, it
  sets `model.stop_training`, so the reported epsilon never exceeds the budget.
  """

  def __init__(self, target_epsilon: float, *, sampling_probability: float,
               delta: float):
    super().__init__()
    if not target_epsilon > 0:
      raise ValueError(f'target_epsilon must be > 0, got {target_epsilon!r}')
    self.target_epsilon = target_epsilon
    self.sampling_probability = sampling_probability
    self.delta = delta
    self.stopped_at_step = None

  def _next_step_exceeds(self):
    optimizer = self.model.optimizer
    steps = int(optimizer.dp_steps.numpy()) + 1
    return accounting.epsilon(
        optimizer, steps=steps, sampling_probability=self.sampling_probability,
        delta=self.delta) > self.target_epsilon

  def on_train_begin(self, logs=None):
    if self._next_step_exceeds():
      raise ValueError('the privacy budget target_epsilon='
                       f'{self.target_epsilon} is already spent')

  def on_train_batch_end(self, batch, logs=None):
    if self._next_step_exceeds():
      self.model.stop_training = True
      self.stopped_at_step = int(self.model.optimizer.dp_steps.numpy())
