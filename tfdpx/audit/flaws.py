"""Deliberately broken DP-SGD, to show that an audit catches a broken step.

Never train with it: it accounts for a guarantee its release does not have.
"""

from tfdpx import clipping
from tfdpx import core
from tfdpx import noise
from tfdpx.privatizers.gaussian import Gaussian

FLAWS = ('no_noise', 'no_clip')


@core.register
class FlawedGaussian(Gaussian):
  """DP-SGD with one flaw, accounted as if it had none.

  Privacy:
    None. `dp_event` is DP-SGD's at `noise_multiplier`, but `'no_noise'`
    releases the clipped sum without noise, and `'no_clip'` sums the gradients
    unclipped (noise still `noise_multiplier * l2_norm_clip`). An audit of it
    must give a lower bound above the epsilon printed for it.
  """

  name = 'flawed_gaussian'

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               flaw: str):
    super().__init__(l2_norm_clip, noise_multiplier)
    if flaw not in FLAWS:
      raise ValueError(f'flaw must be one of {FLAWS}, got {flaw!r}')
    self._flaw = flaw

  @property
  def config(self):
    return {**super().config, 'flaw': self._flaw}

  def clipped_sums(self, per_example_grads, state, plan):
    if self._flaw != 'no_clip':
      return super().clipped_sums(per_example_grads, state, plan)
    factors, _ = clipping.clip_factors(per_example_grads, float('inf'))
    return noise.batch_sum(per_example_grads, factors)

  def release(self, sums, state, plan, seed):
    if self._flaw != 'no_noise':
      return super().release(sums, state, plan, seed)
    return noise.add_gaussian(sums, self._l2_norm_clip, 0.0, seed), state
