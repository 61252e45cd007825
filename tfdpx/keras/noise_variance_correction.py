"""Adam's second moment less the noise's own variance (DP-AdamBC), for both
Keras versions.

Adam divides each coordinate's step by the root of its second moment `v`.
The privatizer's noise adds its variance to every coordinate's `v`; where it
dominates (under DP, most coordinates) Adam's step is the first moment over
the noise's std, whatever the gradient's own scale (Tang et al. 2024: DP-Adam
is then DP-SGD with momentum). That variance is public (the noise multiplier,
the clip norm, the public denominator of the noisy sum and, with noise
correlated across steps, the strategy), so the optimizer can take it out:
the step divides by `sqrt(max(v_hat - phi_hat, floor)) + epsilon`, `phi_hat`
the bias-corrected moving average (Adam's `beta_2`) of the steps' noise
variances and `floor` `noise_variance_correction` times one independent
draw's variance (epsilon is added to the bias-corrected root; Keras adds it
before the correction).

Noise correlated across steps (`tfdpx.privatizers.correlated`) makes each
step's noise larger than one draw (row t of `C^-1` has norm above 1) and
their sums over steps smaller. Keras's Adam divides by the larger per-step
noise, which takes back part of what the correlation gains (the text model
in docs/correlated_noise.md); corrected, the denominators
of noise-dominated coordinates are the floor's, the same as with independent
noise of that multiplier (`noise_variance_correction=1`: about Keras's Adam
under independent noise).

Post-processing of the released gradients with public values: the privacy
is the privatizer's.

References:
  Tang, Shpilevskiy, Lecuyer, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD
  (Unless You Apply Bias Correction)", AAAI 2024.
"""

import math
import numbers
from typing import Optional

import numpy as np
from scipy import signal
import tensorflow as tf

from tfdpx import core

# Steps of the tabulated moving average; later steps take its last entry
# (a strategy's row norms settle within tens of steps, and the average
# then converges as beta_2^t).
TABLE_STEPS = 1 << 16


class NoiseVarianceCorrection:
  """One optimizer's correction: the public noise moments and the floor."""

  def __init__(self, correction: float, privatizer: core.Privatizer,
               denominator: Optional[float], beta_2: float, amsgrad: bool):
    """Args:
      correction: the floor, in variances of one independent draw, > 0.
      privatizer: the optimizer's noise step.
      denominator: the optimizer's public denominator of the noisy sum
        (`expected_batch_size`, or `num_microbatches`).
      beta_2, amsgrad: Adam's.

    Raises:
      ValueError: naming the argument that rules the correction out.
    """
    if isinstance(correction, bool) or not (
        isinstance(correction, (int, float)) and correction > 0 and
        math.isfinite(correction)):
      raise ValueError('noise_variance_correction must be None or a positive '
                       'number (the floor, in variances of one noise draw), '
                       f'got {correction!r}')
    variance = privatizer.coordinate_noise_variance
    if variance is None or not math.isfinite(variance):
      raise ValueError(
          f'noise_variance_correction: the privatizer {privatizer!r} does not '
          'put one public noise variance on every coordinate (supported: '
          'gaussian, and correlated(gaussian))')
    if denominator is None:
      raise ValueError(
          'noise_variance_correction needs expected_batch_size (or '
          'num_microbatches): the averaged gradient\'s noise variance is the '
          'sum\'s over the denominator squared, known in advance only for a '
          'given denominator')
    if amsgrad:
      raise ValueError(
          'noise_variance_correction does not apply to amsgrad=True')
    if isinstance(beta_2, bool) or not isinstance(beta_2, numbers.Real):
      raise ValueError('noise_variance_correction needs a constant beta_2, '
                       f'got {beta_2!r}')
    self.correction = float(correction)
    # One draw's variance on a coordinate of the averaged gradient.
    self._draw = variance / denominator**2
    self.floor = self.correction * self._draw
    self._correlation = privatizer.correlation
    self._beta_2 = float(beta_2)
    self._moments = {}

  @classmethod
  def of(cls, optimizer, correction: Optional[float], beta_2: float
         ) -> Optional['NoiseVarianceCorrection']:
    """A tfdpx Adam's correction; None for `correction` None."""
    if correction is None:
      return None
    return cls(correction, optimizer.privatizer, optimizer.denominator, beta_2,
               optimizer.amsgrad)

  def noise_moments(self, steps: int = TABLE_STEPS) -> np.ndarray:
    """`phi_hat_t`, t = 0 .. steps - 1: the bias-corrected moving average of
    the per-coordinate noise variances of the averaged gradient at steps 0
    to t (step t's: one draw's, times the squared norm of row t of `C^-1`
    with correlated noise)."""
    variances = np.full(steps, self._draw)
    if self._correlation is not None:
      # Not noise_covariance's diagonal: that forms a steps x steps matrix.
      variances *= np.cumsum(self._correlation.inverse_coefficients(steps)**2)
    average = signal.lfilter([1.0 - self._beta_2], [1.0, -self._beta_2],
                             variances)
    return average / (1.0 - self._beta_2**np.arange(1, steps + 1))

  def denominator(self, v_hat: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
    """`sqrt(max(v_hat - phi_hat_step, floor))`, `step` 0-based."""
    with tf.init_scope():
      # One constant per graph (an eager one, which every trace captures).
      graph = (None if tf.executing_eagerly() else
               tf.compat.v1.get_default_graph())
      if graph not in self._moments:
        self._moments[graph] = tf.constant(self.noise_moments(), tf.float32)
      moments = self._moments[graph]
    step = tf.minimum(tf.cast(step, tf.int64), TABLE_STEPS - 1)
    phi_hat = tf.cast(tf.gather(moments, step), v_hat.dtype)
    return tf.sqrt(tf.maximum(v_hat - phi_hat,
                              tf.cast(self.floor, v_hat.dtype)))
