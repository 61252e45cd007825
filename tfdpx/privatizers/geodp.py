"""GeoDP: noise on the magnitude and the angles of the clipped gradient sum.

GeoDP (Duan et al. 2025) writes the clipped batch gradient, all trainable
variables flattened into one vector of length d, in hyperspherical
coordinates (a magnitude and d - 1 angles), adds Gaussian noise to the
magnitude and to every angle, and converts back. Its privacy proof divides the
angle noise by the batch size and shrinks it by a "bounding factor" beta that
nothing enforces; accounted honestly, its own settings are not private (spec
geodp.md §5). This module offers both:

- `mode="sound"` (default): a Gaussian mechanism with the true sensitivity of
  the angles, the box diameter sqrt(d + 2) * pi, whatever the batch size.
- `mode="paper"`: Algorithm 1 exactly, for reproduction only, with the honest
  (near-infinite) epsilon in its `dp_event`.
"""

import logging
import math
import warnings

import dp_accounting
import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import hyperspherical
from tfdpx import noise

MODES = ('sound', 'paper')
# Angles converted before the others (`GeoDP.release`): where the product of
# their noisy sines vanishes, as it does under sound-mode noise, the rest of
# the output is 0 and its angles are never formed.
LEADING_ANGLES = 4096
MAGNITUDE_POSTPROCESS = ('none', 'abs', 'relu')
ANGLE_POSTPROCESS = ('none', 'clamp')

PAPER_MODE_WARNING = (
    'GeoDP mode="paper" reproduces Algorithm 1 of Duan et al., whose angle '
    'noise is divided by the batch size and scaled by beta although the true '
    'sensitivity of the angles is sqrt(d + 2) * pi: it is NOT meaningfully '
    'private. Its dp_event reports the honest noise multiplier '
    '(sigma^-2 + (beta * sigma / B)^-2)^-1/2; with the paper\'s settings '
    'epsilon is around 1e10 to 1e12 (docs/geodp.md). Use mode="sound" for '
    'differential privacy.')


def _combined_multiplier(*multipliers: float) -> float:
  """(sum z_i^-2)^-1/2: the multiplier of one release of several Gaussians."""
  if any(z == 0 for z in multipliers):
    return 0.0
  return 1.0 / math.sqrt(sum(z**-2 for z in multipliers))


@core.register
class GeoDP(core.Privatizer):
  """Geometric perturbation: Gaussian noise on the magnitude and the angles.

  One step: clip each example's gradient (all variables together) to global
  L2 norm `l2_norm_clip` = C; sum; flatten the sum S in `per_example_grads`
  order (the model's `trainable_variables` order; d = number of parameters);
  convert to (r, theta) = (||S||, d - 1 angles) in float64
  (`tfdpx.hyperspherical`); add N(0, sigma_r^2) to r and independent
  N(0, sigma_theta^2) to each angle; convert back and cast to each variable's
  dtype. (Angles past the first `LEADING_ANGLES` are formed, noised and
  converted only where the output reads them: under large angle noise the
  product of the leading sines is 0 in float64, and so is every later
  coordinate, whatever its angle; docs/geodp.md, Numerics.) The result is
  the privatized sum; the optimizer divides it by the expected batch size.
  Angles are scale invariant, so theta(S) = theta(S / B): the paper's
  mean-level formulas are applied at sum level by multiplying only the
  magnitude noise by B.

  Noise (spec geodp.md §2.3, §5.3, §5.4), with z = `noise_multiplier`,
  lambda = `direction_budget_fraction`, B = `expected_batch_size`:

  - `mode="sound"`: sigma_r = z_r * C and sigma_theta = z_theta *
    sqrt(d + 2) * pi (never divided by B), with z_r = z / sqrt(1 - lambda)
    and z_theta = z / sqrt(lambda), so that (z_r^-2 + z_theta^-2)^-1/2 = z:
    a step costs what a DP-SGD step with multiplier z costs. `beta` must be 1
    and `expected_batch_size` must not be given.
  - `mode="paper"`: Algorithm 1 with sigma = z on both parts: sigma_r = z * C
    (the paper's C * sigma / B on the mean) and sigma_theta = sqrt(d + 2) *
    beta * pi * z / B. Not private in any useful sense; warns at
    construction. `direction_budget_fraction` must stay 0.5 (unused).

  The direction is uniformly random for any realistic d in sound mode (per
  angle std sqrt(d + 2) * pi * z_theta: 464 rad at d = 21,840 and z_theta =
  1), and the prefix products of noisy sines put the output's mass on the
  first ~100 flattened coordinates (spec §2.4, §5.4).

  Privacy:
    Each example's gradient, over all trainable variables together, is
    clipped to global L2 norm C. Under add/remove-one-example adjacency ||S||
    moves by at most C, and theta(S) by at most the diameter sqrt(d + 2) * pi
    of the angle box [0, pi]^(d-2) x (-pi, pi] (one example can move the
    angles of a sum anywhere, whatever B is: spec §5.2 P1). Scaling r by
    1 / sigma_r and theta by 1 / sigma_theta makes the step a Gaussian
    mechanism with unit noise on a query of L2 sensitivity
    (z_r^-2 + z_theta^-2)^1/2, so one step is
    `GaussianDpEvent((z_r^-2 + z_theta^-2)^-1/2)`, with z_r = sigma_r / C and
    z_theta = sigma_theta / (sqrt(d + 2) * pi). That is `noise_multiplier` in
    sound mode and (z^-2 + (beta * z / B)^-2)^-1/2, about beta * z / B, in
    paper mode (`privacy_claim_valid` is False there: the paper's own
    (epsilon, delta + delta') claim does not hold). Dividing by B and the
    post-processing options are post-processing.

  References:
    J. Duan, H. Hu, Q. Ye, X. Sun, "Analyzing and Optimizing Perturbation of
    DP-SGD Geometrically", arXiv:2504.05618, 2025 (Algorithm 1).
    I. Mironov, K. Talwar, L. Zhang, "Renyi Differential Privacy of the
    Sampled Gaussian Mechanism", arXiv:1908.10530, 2019.
  """

  name = 'geodp'

  def __init__(self,
               l2_norm_clip: float,
               noise_multiplier: float,
               mode: str = 'sound',
               beta: float = 1.0,
               direction_budget_fraction: float = 0.5,
               expected_batch_size=None,
               magnitude_postprocess: str = 'none',
               angle_postprocess: str = 'none'):
    """Args:
      l2_norm_clip: clip norm C of each example's gradient, > 0 (`inf`
        allowed).
      noise_multiplier: sound mode: the effective multiplier z of the whole
        step, >= 0. Paper mode: Algorithm 1's sigma on both parts (the
        effective multiplier is then `self.noise_multiplier`).
      mode: "sound" (differentially private) or "paper" (Algorithm 1, for
        reproduction; not private).
      beta: Algorithm 1's bounding factor in (0, 1]; paper mode only (must be
        1 in sound mode).
      direction_budget_fraction: lambda in (0, 1), the share of the step's
        budget (in z^-2) spent on the angles; sound mode only.
      expected_batch_size: the B of Algorithm 1's noise scales, > 0; required
        in paper mode, refused in sound mode (whose noise does not depend on
        B).
      magnitude_postprocess: what to do with a negative noisy magnitude:
        "none" (keep it, which flips the direction, as the paper's code does),
        "abs" or "relu".
      angle_postprocess: "none" (Algorithm 1) or "clamp" (the first d - 2
        angles into [0, pi], the last into [-pi, pi], as the paper's
        logistic regression code does).

    Raises:
      ValueError: naming the argument that is out of range or not allowed in
        `mode`.
    """
    self._l2_norm_clip = core.check_positive('l2_norm_clip', l2_norm_clip)
    self._noise_multiplier = core.check_positive(
        'noise_multiplier', noise_multiplier, allow_zero=True)
    if mode not in MODES:
      raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    self._mode = mode
    self._beta = core.check_positive('beta', beta)
    if self._beta > 1:
      raise ValueError(f'beta must be in (0, 1], got {beta!r}')
    self._direction_budget_fraction = core.check_positive(
        'direction_budget_fraction', direction_budget_fraction)
    if self._direction_budget_fraction >= 1:
      raise ValueError('direction_budget_fraction must be in (0, 1), got '
                       f'{direction_budget_fraction!r}')
    if magnitude_postprocess not in MAGNITUDE_POSTPROCESS:
      raise ValueError(
          f'magnitude_postprocess must be one of {MAGNITUDE_POSTPROCESS}, '
          f'got {magnitude_postprocess!r}')
    if angle_postprocess not in ANGLE_POSTPROCESS:
      raise ValueError(f'angle_postprocess must be one of '
                       f'{ANGLE_POSTPROCESS}, got {angle_postprocess!r}')
    self._magnitude_postprocess = magnitude_postprocess
    self._angle_postprocess = angle_postprocess
    z = self._noise_multiplier
    if mode == 'sound':
      if self._beta != 1:
        raise ValueError(
            f'beta must be 1 in mode="sound", got {beta!r}: nothing enforces '
            'the paper\'s "privacy region", so beta < 1 only removes noise '
            '(spec geodp.md §5.2 P2)')
      if expected_batch_size is not None:
        raise ValueError(
            'expected_batch_size is only for mode="paper": the sound angle '
            'noise is not divided by the batch size (spec geodp.md §5.2 P1)')
      self._expected_batch_size = None
      lam = self._direction_budget_fraction
      self._magnitude_multiplier = z / math.sqrt(1 - lam)
      self._direction_multiplier = z / math.sqrt(lam)
    else:
      if self._direction_budget_fraction != 0.5:
        raise ValueError(
            'direction_budget_fraction is only for mode="sound"; Algorithm 1 '
            'puts the same sigma on both parts')
      if expected_batch_size is None:
        raise ValueError(
            'expected_batch_size is required in mode="paper": Algorithm 1 '
            'divides the angle noise by the batch size B')
      self._expected_batch_size = core.check_positive('expected_batch_size',
                                                      expected_batch_size)
      self._magnitude_multiplier = z
      # Spec §5.3: Algorithm 1's sqrt(d + 2) * beta * pi * z / B against the
      # true angle sensitivity sqrt(d + 2) * pi.
      self._direction_multiplier = self._beta * z / self._expected_batch_size
      logging.warning(PAPER_MODE_WARNING)
      warnings.warn(PAPER_MODE_WARNING, UserWarning, stacklevel=3)

  @property
  def config(self):
    return {
        'l2_norm_clip': self._l2_norm_clip,
        'noise_multiplier': self._noise_multiplier,
        'mode': self._mode,
        'beta': self._beta,
        'direction_budget_fraction': self._direction_budget_fraction,
        'expected_batch_size': self._expected_batch_size,
        'magnitude_postprocess': self._magnitude_postprocess,
        'angle_postprocess': self._angle_postprocess,
    }

  @property
  def magnitude_multiplier(self) -> float:
    """z_r: the magnitude noise std over its sensitivity C."""
    return self._magnitude_multiplier

  @property
  def direction_multiplier(self) -> float:
    """z_theta: per-angle noise std over the sensitivity sqrt(d + 2) * pi."""
    return self._direction_multiplier

  @property
  def noise_multiplier(self) -> float:
    """The effective multiplier of a step, (z_r^-2 + z_theta^-2)^-1/2."""
    return _combined_multiplier(self._magnitude_multiplier,
                                self._direction_multiplier)

  @property
  def privacy_claim_valid(self) -> bool:
    """False in paper mode: the paper's privacy claim does not hold."""
    return self._mode == 'sound'

  def noise_stddevs(self, d: int):
    """`(sigma_r, sigma_theta)`: the noise std on ||S|| and on each angle.

    Args:
      d: number of flattened parameters, >= 2.

    Returns:
      Two Python floats.
    """
    # A zero multiplier gives no noise, also for an infinite clip norm.
    magnitude = (self._magnitude_multiplier * self._l2_norm_clip
                 if self._magnitude_multiplier else 0.0)
    return magnitude, self._direction_multiplier * math.sqrt(d + 2) * math.pi

  @property
  def reference_l2_norm_clip(self):
    return self._l2_norm_clip

  def clipped_sums(self, per_example_grads, state, plan):
    del state, plan  # GeoDP has no state and fixes nothing in advance.
    factors, _ = clipping.clip_factors(per_example_grads, self._l2_norm_clip)
    return noise.batch_sum(per_example_grads, factors)

  def release(self, sums, state, plan, seed):
    del plan
    flat = tf.concat(
        [tf.reshape(tf.cast(s, tf.float64), [-1]) for s in sums], axis=0)
    d = flat.shape[0]
    magnitude_std, angle_std = self.noise_stddevs(d)
    head = min(d - 1, LEADING_ANGLES)
    every_angle = head == d - 1
    if every_angle:
      r, theta = hyperspherical.to_spherical(flat)
    else:
      r, theta = hyperspherical.leading_angles(flat, head)
    [r_noise] = noise.gaussian_like([r], magnitude_std,
                                    noise.substream(seed, 'magnitude'))
    [theta_noise] = noise.gaussian_like([theta], angle_std,
                                        noise.substream(seed, 'direction'))
    r = self._postprocessed_magnitude(r + r_noise)
    theta = self._postprocessed_angles(theta + theta_noise, every_angle)
    if every_angle:
      return _split(hyperspherical.to_cartesian(r, theta), sums), state

    def all_angles():
      """Every coordinate, from the other angles with their own noise."""
      rest = hyperspherical.to_spherical(flat)[1][head:]
      [rest_noise] = noise.gaussian_like(
          [rest], angle_std, noise.substream(seed, 'direction/rest'))
      rest = self._postprocessed_angles(rest + rest_noise, True)
      return _split(hyperspherical.to_cartesian(
          r, tf.concat([theta, rest], axis=0)), sums)

    # Under large angle noise (sound mode) the product of the first angles'
    # sines vanishes: every later coordinate is then 0 whatever its angle,
    # and neither those angles nor their noise are computed.
    leading, vanished = hyperspherical.leading_coordinates(r, theta)
    return tf.cond(
        vanished,
        lambda: _split(tf.pad(leading, [[0, d - head]]), sums),
        all_angles), state

  def _postprocessed_magnitude(self, r):
    if self._magnitude_postprocess == 'abs':
      return tf.abs(r)
    if self._magnitude_postprocess == 'relu':
      return tf.nn.relu(r)
    return r

  def _postprocessed_angles(self, theta, with_last):
    """`theta`, clamped if asked; `with_last`: it ends with the last angle."""
    if self._angle_postprocess != 'clamp':
      return theta
    if not with_last:
      return tf.clip_by_value(theta, 0.0, math.pi)
    return tf.concat([tf.clip_by_value(theta[:-1], 0.0, math.pi),
                      tf.clip_by_value(theta[-1:], -math.pi, math.pi)], 0)

  def dp_event(self, step):
    del step  # Every step costs the same.
    return dp_accounting.GaussianDpEvent(self.noise_multiplier)


def _split(flat, sums):
  """The flat float64 output as one tensor per sum, in its shape and dtype."""
  sizes = [s.shape.num_elements() for s in sums]
  return [tf.cast(tf.reshape(part, s.shape), s.dtype)
          for part, s in zip(tf.split(flat, sizes), sums)]


def geodp(l2_norm_clip: float,
          noise_multiplier: float,
          mode: str = 'sound',
          beta: float = 1.0,
          direction_budget_fraction: float = 0.5,
          expected_batch_size=None,
          magnitude_postprocess: str = 'none',
          angle_postprocess: str = 'none') -> GeoDP:
  """The GeoDP privatizer; see `GeoDP`."""
  return GeoDP(l2_norm_clip, noise_multiplier, mode, beta,
               direction_budget_fraction, expected_batch_size,
               magnitude_postprocess, angle_postprocess)
