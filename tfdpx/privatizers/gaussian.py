"""The DP-SGD baseline: clip each example, sum, add Gaussian noise."""

import dp_accounting
import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import noise


@core.register
class Gaussian(core.Privatizer):
  """DP-SGD's Gaussian mechanism (Abadi et al. 2016).

  Privacy:
    Each example's gradient, over all trainable variables together, is clipped
    to global L2 norm `l2_norm_clip`; the sum of the clipped gradients gets
    N(0, (noise_multiplier * l2_norm_clip)^2) noise on every coordinate. Under
    add/remove-one-example adjacency one step is
    `GaussianDpEvent(noise_multiplier)`, the same at every step.

  References:
    Abadi et al., "Deep Learning with Differential Privacy", CCS 2016.
  """

  name = 'gaussian'

  def __init__(self, l2_norm_clip: float, noise_multiplier: float):
    """Args:
      l2_norm_clip: clip norm C of each example's gradient, > 0 (`inf` allowed).
      noise_multiplier: noise std over C, >= 0.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    self._l2_norm_clip = core.check_positive('l2_norm_clip', l2_norm_clip)
    self._noise_multiplier = core.check_positive(
        'noise_multiplier', noise_multiplier, allow_zero=True)

  @property
  def config(self):
    return {'l2_norm_clip': self._l2_norm_clip,
            'noise_multiplier': self._noise_multiplier}

  @property
  def reference_l2_norm_clip(self):
    return self._l2_norm_clip

  @property
  def coordinate_noise_variance(self) -> float:
    if not self._noise_multiplier:
      return 0.0  # Also with an infinite clip norm.
    return (self._noise_multiplier * self._l2_norm_clip)**2

  @property
  def has_gaussian_releases(self) -> bool:
    return True

  def gaussian_release_shapes(self, params):
    return [[tf.TensorShape(p.shape) for p in params]]

  def clipped_sums(self, per_example_grads, state, plan):
    del state, plan  # DP-SGD has no state and fixes nothing in advance.
    # Norms, then one weighted sum: the clipped gradients are never formed.
    factors, _ = clipping.clip_factors(per_example_grads, self._l2_norm_clip)
    return noise.batch_sum(per_example_grads, factors)

  def release(self, sums, state, plan, seed):
    del plan
    return noise.add_gaussian(sums, self._l2_norm_clip, self._noise_multiplier,
                              seed), state

  def dp_event(self, step):
    del step  # Every step costs the same.
    return dp_accounting.GaussianDpEvent(self._noise_multiplier)


def gaussian(l2_norm_clip: float, noise_multiplier: float) -> Gaussian:
  """The DP-SGD baseline privatizer; see `Gaussian`."""
  return Gaussian(l2_norm_clip, noise_multiplier)
