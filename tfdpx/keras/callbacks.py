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
