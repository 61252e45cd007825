"""Adaptive (quantile) clipping around a clip-then-noise step.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021 (tensorflow-privacy's
`QuantileAdaptiveClipSumQuery`): the clip norm follows a chosen quantile of
the per-example gradient norms, estimated from a noisy count released with
each step, so that no grid search over clip norms is needed.
"""

from typing import Optional

import dp_accounting
import tensorflow as tf

from tfdpx import core
from tfdpx import gradients
from tfdpx import noise

_COUNT_STREAM = 'adaptive_clipping/count'


@core.register
class AdaptiveClipping(core.Wrapper):
  """Quantile-based adaptive clipping around `inner` (Andrew et al. 2021).

  Every clip norm of `inner` is multiplied by a common factor `s_t` (1 at
  the first step), which follows the geometric rule of Andrew et al.:

    b_t     = 1 - (#{i : |g_i| > s_t C} + N(0, z_c^2)) / n
    s_{t+1} = s_t * exp(-learning_rate * (b_t - target_unclipped_quantile))

  where `C` is `inner.reference_l2_norm_clip` (DP-SGD, GeoDP, DPDR: its
  `l2_norm_clip`; GEP: `sqrt(s1^2 + s2^2)`), `z_c` is
  `count_noise_multiplier` and `n` the public `expected_batch_size`. The
  current clip norm `s_t C` is `clip_norm(state)` (logged as `l2_norm_clip`
  by models made private).

  A clipping at `s C` of `g` is `s` times a clipping at `C` of `g / s`:
  `inner` runs unchanged on the per-example gradients scaled by `1 / s_t`
  (`gradients.ScaledGradients`), and its release is multiplied by `s_t`.
  So all of `inner`'s norms adapt together and keep their ratios (DPDR's
  `l2_norm_clip`, `perp_l2_norm_clip`, `alpha_l2_norm_clip`; GEP's
  embedding and residual clips), and so does its noise, which stays
  `noise_multiplier` times each norm. D2P2 normalizes instead of clipping and
  has nothing to adapt. To sparsify, wrap this privatizer in `sparsified`
  (the count is then of the masked gradients that are clipped).

  Privacy:
    A step releases `inner`'s release (clipped to `s_t` times its norms,
    with noise `noise_multiplier` times them: `inner.dp_event(step)`, since
    `s_t` depends only on earlier releases) and the count of examples whose
    gradient norm exceeds `s_t C`, sensitivity 1 under add/remove-one, with
    N(0, z_c^2) noise: `GaussianDpEvent(z_c)`. One step is
    `ComposedDpEvent([inner.dp_event(step), GaussianDpEvent(z_c)])`; its
    effective noise multiplier is `(z^-2 + z_c^-2)^-1/2`. Padding rows and
    dropped (non-finite) examples have zero gradients and are never counted.
  """

  name = 'adaptive_clipping'

  def __init__(self, inner: core.Privatizer, expected_batch_size: float,
               target_unclipped_quantile: float = 0.5,
               learning_rate: float = 0.2,
               count_noise_multiplier: Optional[float] = None):
    """Args:
      inner: the clip-then-noise step whose clip norms adapt (`gaussian`,
        `geodp`, `dpdr`, `gep`), or its `tfdpx.serialize`d form.
      expected_batch_size: the public expected number of examples per
        (logical) batch, `n`, which turns the count into a fraction.
      target_unclipped_quantile: the fraction of examples the clip norm
        should leave unclipped, in [0, 1] (0.5: the median norm).
      learning_rate: of the geometric update, >= 0 (0.2 in Andrew et al.).
      count_noise_multiplier: std of the count's noise, `z_c` (its
        sensitivity is 1). Default `expected_batch_size / 20`, a noise of
        0.05 in the fraction, as tensorflow-privacy recommends.

    Raises:
      ValueError: naming the argument, for a bad value or an `inner` without
        a clip norm to adapt.
    """
    self._set_inner(inner)
    if self.inner.reference_l2_norm_clip is None:
      raise ValueError(
          f'inner: {self.inner.name} has no clip norm that adaptive clipping '
          'can scale (it takes gaussian, geodp, dpdr or gep; to sparsify, '
          'wrap adaptive_clipping in sparsified)')
    self._expected_batch_size = core.check_positive('expected_batch_size',
                                                    expected_batch_size)
    quantile = core.check_positive('target_unclipped_quantile',
                                   target_unclipped_quantile, allow_zero=True)
    if quantile > 1:
      raise ValueError('target_unclipped_quantile must be in [0, 1], got '
                       f'{target_unclipped_quantile!r}')
    self._quantile = quantile
    self._learning_rate = core.check_positive('learning_rate', learning_rate,
                                              allow_zero=True)
    if count_noise_multiplier is None:
      count_noise_multiplier = self._expected_batch_size / 20
    self._count_noise_multiplier = core.check_positive(
        'count_noise_multiplier', count_noise_multiplier)

  @property
  def config(self):
    return {'inner': core.serialize(self._inner),
            'expected_batch_size': self._expected_batch_size,
            'target_unclipped_quantile': self._quantile,
            'learning_rate': self._learning_rate,
            'count_noise_multiplier': self._count_noise_multiplier}

  @property
  def noise_multiplier(self) -> float:
    """The effective noise multiplier of a step (gradient and count)."""
    z = self._inner.noise_multiplier
    if z == 0:
      return 0.0
    return (z**-2 + self._count_noise_multiplier**-2)**-0.5

  def with_noise_multiplier(self, noise_multiplier: float
                           ) -> 'AdaptiveClipping':
    """The same wrapper whose effective noise multiplier is the one given.

    The count keeps its noise; `inner` gets `(z^-2 - z_c^-2)^-1/2`.

    Raises:
      ValueError: if `noise_multiplier` is not below `count_noise_multiplier`
        (the count alone would cost more).
    """
    z = float(noise_multiplier)
    if z == 0:
      inner = 0.0
    elif z >= self._count_noise_multiplier:
      raise ValueError(
          f'noise_multiplier {z} must be below count_noise_multiplier '
          f'{self._count_noise_multiplier}: the count alone costs that much')
    else:
      inner = (z**-2 - self._count_noise_multiplier**-2)**-0.5
    return type(self)(**{**self.config,
                         'inner': self._inner.with_noise_multiplier(inner)})

  def dp_event(self, step):
    return dp_accounting.ComposedDpEvent([
        self._inner.dp_event(step),
        dp_accounting.GaussianDpEvent(self._count_noise_multiplier)])

  def clip_norm(self, state: core.State) -> tf.Tensor:
    """The clip norm `s_t C` of the next step (a float32 scalar)."""
    return state['scale'] * self._inner.reference_l2_norm_clip

  def logs(self, state):
    return {**super().logs(state), 'l2_norm_clip': self.clip_norm(state)}

  # --- the step ----------------------------------------------------------------

  def init(self, params):
    return {'inner': self._inner.init(params),
            'scale': tf.constant(1.0, tf.float32)}

  def _scaled(self, grads, state):
    return gradients.ScaledGradients(
        gradients.as_per_example_gradients(grads), 1.0 / state['scale'])

  def prepare(self, state, seed, per_example_grads, public_grads):
    return self._inner.prepare(state['inner'], seed,
                               self._scaled(per_example_grads, state),
                               public_grads)

  def clipped_sums(self, per_example_grads, state, plan):
    scaled = self._scaled(per_example_grads, state)
    sums = self._inner.clipped_sums(scaled, state['inner'], plan)
    # Clipped means |g| > s C, that is |g / s| > C.
    above = gradients.global_sq_norms(scaled) > self._inner.reference_l2_norm_clip**2
    return {'inner': sums,
            'above': tf.reduce_sum(tf.cast(above, tf.float32))}

  def release(self, sums, state, plan, seed):
    noisy_sum, inner_state = self._inner.release(sums['inner'], state['inner'],
                                                 plan, seed)
    scale = state['scale']
    noisy_sum = [s * tf.cast(scale, s.dtype) for s in noisy_sum]
    count_noise = noise.standard_normal(
        [], noise.substream(seed, _COUNT_STREAM), self._count_noise_multiplier)
    unclipped = 1.0 - (sums['above'] + tf.cast(count_noise, tf.float32)
                       ) / self._expected_batch_size
    new_scale = scale * tf.exp(-self._learning_rate *
                               (unclipped - self._quantile))
    return noisy_sum, {'inner': inner_state, 'scale': new_scale}


def adaptive_clipping(inner: core.Privatizer, expected_batch_size: float,
                      target_unclipped_quantile: float = 0.5,
                      learning_rate: float = 0.2,
                      count_noise_multiplier: Optional[float] = None
                     ) -> AdaptiveClipping:
  """Adaptive clipping around `inner`; see `AdaptiveClipping`."""
  return AdaptiveClipping(inner, expected_batch_size,
                          target_unclipped_quantile, learning_rate,
                          count_noise_multiplier)
