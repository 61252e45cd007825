"""DPDR: gradient decomposition and reconstruction (Liu et al. 2024).

Early in training consecutive gradients point in similar directions. DPDR keeps
the direction `b` of the previous released (noisy) gradient and, for the first
steps, splits each example's gradient into its coefficients along `b` (one per
block) and the remainder orthogonal to `b`. Both parts are clipped and noised
separately and the step releases `alpha * b + g_perp`; afterwards it is DP-SGD.
Spec: `shared/specs/dpdr.md`.
"""

import math
from typing import List, Optional, Sequence, Tuple

import dp_accounting
import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx.privatizers import per_layer

GRANULARITIES = ('variable', 'layer', 'global')

# A block of the released gradient whose squared norm is at most this gets a
# zero base (spec §7 P4): no division by zero, no NaN.
_MIN_SQUARED_NORM = 1e-12


def _block_ids(params: Sequence[tf.Variable], granularity: str) -> List[int]:
  """The block of each variable, numbered 0..m-1 in order of appearance."""
  if granularity == 'variable':
    return list(range(len(params)))
  if granularity == 'global':
    return [0] * len(params)
  return per_layer.layer_groups(params)


def _flat(t: tf.Tensor) -> tf.Tensor:
  """`[B, *shape]` -> `[B, prod(shape)]`."""
  return tf.reshape(t, [tf.shape(t)[0], -1])


def _broadcast(per_example: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
  """`[B]` -> `[B, 1, ..., 1]` with the rank of `like`."""
  return tf.reshape(per_example, [-1] + [1] * (like.shape.rank - 1))


def decompose(per_example_grads: Sequence[tf.Tensor],
              base: Sequence[tf.Tensor],
              blocks: tf.Tensor) -> Tuple[tf.Tensor, List[tf.Tensor]]:
  """Splits each example's gradient along and across the base, per block.

  Args:
    per_example_grads: one `[B, *var.shape]` tensor per variable.
    base: one `var.shape` tensor per variable; over the variables of one
      block it is a unit vector or zero.
    blocks: int32 `[num_variables]`, the block (0..m-1) of each variable.

  Returns:
    `(alpha, perp)`: `alpha[i, l] = <g_l^(i), b_l>` as a float32
    `[B, num_variables]` tensor (columns `m` and above are zero), and the
    orthogonal parts `g^(i) - alpha^(i)_l b_l`, shaped like the input.
  """
  num_slots = len(per_example_grads)
  # In float32 whatever the gradient dtype (spec §7 P16).
  dots = tf.stack([
      tf.linalg.matvec(_flat(tf.cast(g, tf.float32)),
                       tf.reshape(tf.cast(b, tf.float32), [-1]))
      for g, b in zip(per_example_grads, base)
  ], axis=1)  # [B, num_variables]
  alpha = tf.transpose(
      tf.math.unsorted_segment_sum(tf.transpose(dots), blocks, num_slots))
  alpha_of_variable = _of_variable(alpha, blocks, len(base), axis=1)
  perp = [g - tf.cast(_broadcast(a, g), g.dtype) * b
          for g, b, a in zip(per_example_grads, base, alpha_of_variable)]
  return alpha, perp


def _of_variable(per_block: tf.Tensor, blocks: tf.Tensor, num_variables: int,
                 axis: int = 0) -> List[tf.Tensor]:
  """Each variable's entry of a per-block tensor, along `axis`: one unstack,
  not a slice per variable (four graph ops each)."""
  return tf.unstack(tf.gather(per_block, blocks, axis=axis),
                    num=num_variables, axis=axis)


def reconstruct(alpha: tf.Tensor, perp: Sequence[tf.Tensor],
                base: Sequence[tf.Tensor], blocks: tf.Tensor) -> List[tf.Tensor]:
  """`alpha_l * b_l + perp_l` per block, for aggregated `alpha` `[slots]`."""
  alpha_of_variable = _of_variable(alpha, blocks, len(base))
  return [p + tf.cast(a, p.dtype) * b
          for p, b, a in zip(perp, base, alpha_of_variable)]


def effective_noise_multiplier(perp_noise_multiplier: float,
                               alpha_noise_multiplier: float) -> float:
  """`(sigma_perp^-2 + sigma_alpha^-2)^-1/2`: two releases of one sample.

  Two Gaussian mechanisms on the same sampled batch, each of noise multiplier
  sigma_i relative to its own L2 sensitivity, have the Renyi divergence of a
  single Gaussian mechanism with this multiplier (spec §5.2).

  Returns:
    The effective multiplier, 0 if either part is noiseless, and the other
    part's multiplier if one is infinite.
  """
  if perp_noise_multiplier == 0 or alpha_noise_multiplier == 0:
    return 0.0
  return (perp_noise_multiplier**-2 + alpha_noise_multiplier**-2)**-0.5


@core.register
class DPDR(core.Privatizer):
  """DPDR's gradient decomposition and reconstruction, then DP-SGD.

  Step 0 and every step `>= decomposition_steps` are DP-SGD steps. Each step
  `t` with `1 <= t <= decomposition_steps - 1` is a decomposition ("GDR")
  step: with `b` the previous released gradient normalized per block (or 0
  for a block whose released gradient was 0), each example's gradient `g`
  gives `alpha_l = <g_l, b_l>` per block `l` and `g_perp = g - alpha * b`;
  the `m`-vector `alpha` is clipped to L2 norm `alpha_l2_norm_clip`, `g_perp`
  to global L2 norm `perp_l2_norm_clip`; both sums get independent Gaussian
  noise, and the step returns `alpha_sum * b + perp_sum` per block. The new
  `b` is computed from that returned (noisy) sum only.

  The state holds the step counter (`step`), the base `b` (`base`, one tensor
  per variable) and the block of each variable (`blocks`, fixed by `init`).

  Privacy:
    DP-SGD steps clip each example's whole gradient to global L2 norm
    `l2_norm_clip` and add N(0, (noise_multiplier * l2_norm_clip)^2) noise to
    the sum: `GaussianDpEvent(noise_multiplier)`. A decomposition step clips
    each example's coefficient vector to L2 norm `alpha_l2_norm_clip` and its
    orthogonal part to global L2 norm `perp_l2_norm_clip`, and noises the two
    sums with multipliers `alpha_noise_multiplier` and
    `perp_noise_multiplier` relative to those norms. Both releases use the
    same sampled batch, so the step is one Gaussian event with
    `sigma_eff = (perp_noise_multiplier^-2 + alpha_noise_multiplier^-2)^-1/2`
    (not two separately sampled events, which would understate the cost).
    `b` is a function of earlier released outputs only (adaptive
    composition; reconstruction is post-processing). The sum of the
    orthogonal parts is formed as a weighted sum of whole gradients minus
    their part along `b`; an example whose whole gradient exceeds
    1024 `perp_l2_norm_clip` is also scaled to that norm, so that float
    rounding of the subtraction stays far below the clip norm
    (`clipping.bound_for_subtraction`; a scaling by at most 1, so the
    sensitivities are unchanged), and the orthogonal part's norm, a
    difference of squared norms rounded at the scale of |g|^2, is rounded up
    by `2^-16 |g|^2` (`clipping.part_norms`) so that its clip holds in
    float32. By default the parts'
    multipliers split `noise_multiplier` so that `sigma_eff` equals it and
    every step costs what a DP-SGD step costs. Adjacency: add or remove one
    example.

  References:
    Y. Liu, L. Xiong, Y. Liu, Y. Gu, R. Liu, H. Chen, "DPDR: Gradient
    Decomposition and Reconstruction for Differentially Private Deep
    Learning", arXiv:2406.02744, 2024.
  """

  name = 'dpdr'

  def __init__(self,
               l2_norm_clip: float,
               noise_multiplier: float,
               decomposition_steps: int = 50,
               alpha_share: float = 0.1,
               granularity: str = 'variable',
               perp_l2_norm_clip: Optional[float] = None,
               alpha_l2_norm_clip: Optional[float] = None,
               perp_noise_multiplier: Optional[float] = None,
               alpha_noise_multiplier: Optional[float] = None):
    """Args:
      l2_norm_clip: clip norm of DP-SGD steps, > 0 (`inf` allowed); also the
        default of both parts' clip norms.
      noise_multiplier: noise multiplier of DP-SGD steps, >= 0; by default
        also the effective multiplier of decomposition steps.
      decomposition_steps: the paper's `s`: steps 1..s-1 decompose; `s <= 1`
        is plain DP-SGD.
      alpha_share: rho in (0, 1), the share of the decomposition step's
        budget (its 1 / sigma_eff^2) spent on the coefficients:
        `sigma_alpha = noise_multiplier / sqrt(rho)`,
        `sigma_perp = noise_multiplier / sqrt(1 - rho)` (spec §3.7). Not used
        when both part multipliers are given.
      granularity: blocks of the decomposition: 'variable' (each trainable
        variable), 'layer' (variables of one Keras layer, by the name scope
        before the last '/'), or 'global' (one block).
      perp_l2_norm_clip: clip norm of the orthogonal part; default
        `l2_norm_clip`.
      alpha_l2_norm_clip: clip norm of the coefficient vector; default
        `l2_norm_clip`.
      perp_noise_multiplier: explicit multiplier of the orthogonal part (the
        paper's Table 2 `sigma_perp`); give both or neither.
      alpha_noise_multiplier: explicit multiplier of the coefficients; give
        both or neither. `dp_event` then reports their true `sigma_eff`.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    self._l2_norm_clip = core.check_positive('l2_norm_clip', l2_norm_clip)
    self._noise_multiplier = core.check_positive(
        'noise_multiplier', noise_multiplier, allow_zero=True)
    if (isinstance(decomposition_steps, bool) or
        int(decomposition_steps) != decomposition_steps or
        decomposition_steps < 0):
      raise ValueError('decomposition_steps must be a non-negative integer, '
                       f'got {decomposition_steps!r}')
    self._decomposition_steps = int(decomposition_steps)
    alpha_share = core.check_positive('alpha_share', alpha_share)
    if not alpha_share < 1:
      raise ValueError(f'alpha_share must be in (0, 1), got {alpha_share!r}')
    self._alpha_share = alpha_share
    if granularity not in GRANULARITIES:
      raise ValueError(
          f'granularity must be one of {GRANULARITIES}, got {granularity!r}')
    self._granularity = granularity
    self._perp_l2_norm_clip = None if perp_l2_norm_clip is None else (
        core.check_positive('perp_l2_norm_clip', perp_l2_norm_clip))
    self._alpha_l2_norm_clip = None if alpha_l2_norm_clip is None else (
        core.check_positive('alpha_l2_norm_clip', alpha_l2_norm_clip))
    if (perp_noise_multiplier is None) != (alpha_noise_multiplier is None):
      missing = ('alpha_noise_multiplier' if alpha_noise_multiplier is None
                 else 'perp_noise_multiplier')
      raise ValueError(
          f'{missing} is missing: give both part multipliers or neither')
    self._perp_noise_multiplier = None if perp_noise_multiplier is None else (
        core.check_positive('perp_noise_multiplier', perp_noise_multiplier,
                            allow_zero=True))
    self._alpha_noise_multiplier = None if alpha_noise_multiplier is None else (
        core.check_positive('alpha_noise_multiplier', alpha_noise_multiplier,
                            allow_zero=True))

  @property
  def config(self):
    return {
        'l2_norm_clip': self._l2_norm_clip,
        'noise_multiplier': self._noise_multiplier,
        'decomposition_steps': self._decomposition_steps,
        'alpha_share': self._alpha_share,
        'granularity': self._granularity,
        'perp_l2_norm_clip': self._perp_l2_norm_clip,
        'alpha_l2_norm_clip': self._alpha_l2_norm_clip,
        'perp_noise_multiplier': self._perp_noise_multiplier,
        'alpha_noise_multiplier': self._alpha_noise_multiplier,
    }

  # --- the numbers update and dp_event share ---------------------------------

  @property
  def perp_l2_norm_clip(self) -> float:
    if self._perp_l2_norm_clip is None:
      return self._l2_norm_clip
    return self._perp_l2_norm_clip

  @property
  def alpha_l2_norm_clip(self) -> float:
    if self._alpha_l2_norm_clip is None:
      return self._l2_norm_clip
    return self._alpha_l2_norm_clip

  @property
  def perp_noise_multiplier(self) -> float:
    if self._perp_noise_multiplier is None:
      return self._noise_multiplier / math.sqrt(1 - self._alpha_share)
    return self._perp_noise_multiplier

  @property
  def alpha_noise_multiplier(self) -> float:
    if self._alpha_noise_multiplier is None:
      return self._noise_multiplier / math.sqrt(self._alpha_share)
    return self._alpha_noise_multiplier

  @property
  def decomposition_noise_multiplier(self) -> float:
    """`sigma_eff` of a decomposition step (spec §5.2)."""
    return effective_noise_multiplier(self.perp_noise_multiplier,
                                      self.alpha_noise_multiplier)

  def decomposes(self, step: int) -> bool:
    """Whether step `step` (0-based) is a decomposition step."""
    return 1 <= step < self._decomposition_steps

  def dp_event(self, step):
    if self.decomposes(step):
      return dp_accounting.GaussianDpEvent(
          float(self.decomposition_noise_multiplier))
    return dp_accounting.GaussianDpEvent(self._noise_multiplier)

  # --- the mechanism ---------------------------------------------------------

  def init(self, params):
    return {
        'step': tf.constant(0, tf.int64),
        'base': [tf.zeros(p.shape, p.dtype) for p in params],
        'blocks': tf.constant(_block_ids(params, self._granularity), tf.int32),
    }

  @property
  def has_gaussian_releases(self) -> bool:
    return True

  def gaussian_release_shapes(self, params):
    """The sum of the orthogonal parts (of the gradients at DP-SGD steps),
    then the alpha sums, one per block, released at every step."""
    return [[tf.TensorShape(p.shape) for p in params], [tf.TensorShape(
        [len(params)])]]

  @property
  def reference_l2_norm_clip(self):
    # Its other norms (perp, alpha) scale with it under adaptive clipping.
    return self._l2_norm_clip

  def _decomposing(self, step: tf.Tensor) -> tf.Tensor:
    return tf.logical_and(step >= 1, step < self._decomposition_steps)

  def clipped_sums(self, per_example_grads, state, plan):
    del plan  # The base is the state's.
    grads = gradients.as_per_example_gradients(per_example_grads)
    base, blocks = state['base'], state['blocks']
    decomposing = self._decomposing(state['step'])
    # Statistics only: |g_v|^2 and <g_v, b_v> per variable. The orthogonal
    # parts are never formed: |g_perp|^2 = sum_v |g_v|^2 - 2 a_l(v) <g_v, b_v>
    # + a_l(v)^2 |b_v|^2, and the clipped sum of g_perp is the weighted sum of
    # g minus (sum_i f_i a_i,l(v)) b_v. (At DP-SGD steps b is zero, and so are
    # the dots.)
    sq_norms = tf.stack(grads.sq_norms(), axis=1)  # [B, num_variables]
    dots = tf.concat(grads.dots([b[tf.newaxis] for b in base]), axis=1)
    num_slots = len(base)
    alpha = tf.transpose(tf.math.unsorted_segment_sum(
        tf.transpose(dots), blocks, num_slots))  # [B, slots]
    alpha_of_variable = tf.gather(alpha, blocks, axis=1)  # [B, num_variables]
    base_sq = tf.stack([tf.reduce_sum(tf.square(tf.cast(b, tf.float32)))
                        for b in base])
    perp_sq = tf.reduce_sum(
        sq_norms - 2.0 * alpha_of_variable * dots +
        tf.square(alpha_of_variable) * base_sq, axis=1)
    # Rounded at the scale of |g|^2: an upper bound by `part_norms`.
    whole_sq = tf.reduce_sum(sq_norms, axis=1)
    norms = tf.sqrt(whole_sq)
    perp_factors = clipping.bound_for_subtraction(
        clipping.clip_factor(clipping.part_norms(perp_sq, whole_sq),
                             self.perp_l2_norm_clip),
        norms, self.perp_l2_norm_clip)
    dp_sgd_factors = clipping.clip_factor(norms, self._l2_norm_clip)
    factors = tf.where(decomposing, perp_factors, dp_sgd_factors)
    # Clip the alpha vector by its L2 norm (spec §7 P1: the paper's rule has
    # no absolute value) and g_perp by its global L2 norm (§5.4 flags 7-8).
    alpha_factors = clipping.clip_factor(tf.norm(alpha, axis=1),
                                         self.alpha_l2_norm_clip)
    weighted, = noise.batch_sum([alpha], factors)  # sum_i f_i a_i, [slots]
    alpha_sum, = noise.batch_sum([alpha], alpha_factors)
    return {'weighted': weighted, 'alpha': alpha_sum,
            'grads': noise.batch_sum(grads, factors)}

  def release(self, sums, state, plan, seed):
    del plan
    base, blocks, step = state['base'], state['blocks'], state['step']
    decomposing = self._decomposing(step)
    weighted, alpha_sum, grad_sum = sums['weighted'], sums['alpha'], sums[
        'grads']
    weighted_of_variable = _of_variable(
        tf.where(decomposing, weighted, tf.zeros_like(weighted)), blocks,
        len(base))
    perp_sum = [g - tf.cast(w, g.dtype) * b
                for g, b, w in zip(grad_sum, base, weighted_of_variable)]
    # DP-SGD steps: the computation and draws of `gaussian(l2_norm_clip,
    # noise_multiplier)` (spec §8 U7).
    noisy = noise.add_gaussian(
        perp_sum,
        tf.where(decomposing, tf.constant(self.perp_l2_norm_clip, tf.float64),
                 tf.constant(self._l2_norm_clip, tf.float64)),
        tf.where(decomposing,
                 tf.constant(self.perp_noise_multiplier, tf.float64),
                 tf.constant(self._noise_multiplier, tf.float64)),
        tf.where(decomposing,
                 tf.cast(noise.substream(seed, 'perp'), seed.dtype), seed))
    alpha_sum = tf.where(decomposing, alpha_sum, tf.zeros_like(alpha_sum))
    alpha_sum, = noise.add_gaussian([alpha_sum], self.alpha_l2_norm_clip,
                                    self.alpha_noise_multiplier,
                                    noise.substream(seed, 'alpha'))
    rebuilt = reconstruct(alpha_sum, noisy, base, blocks)
    noisy_sum = [tf.where(decomposing, r, s) for r, s in zip(rebuilt, noisy)]
    new_state = {
        'step': step + 1,
        'base': self._normalized(noisy_sum, blocks),
        'blocks': blocks,
    }
    return noisy_sum, new_state

  @staticmethod
  def _normalized(released, blocks):
    """The next base: each block of the released sum over its L2 norm."""
    num_slots = len(released)
    squares = tf.stack([tf.reduce_sum(tf.square(tf.cast(r, tf.float32)))
                        for r in released])
    norm_sq = tf.math.unsorted_segment_sum(squares, blocks, num_slots)
    # All the blocks' scales at once, not a few graph ops per variable.
    nonzero = norm_sq > _MIN_SQUARED_NORM
    scales = tf.where(nonzero,
                      tf.math.rsqrt(tf.where(nonzero, norm_sq, 1.0)), 0.0)
    return [r * tf.cast(scale, r.dtype) for r, scale in zip(
        released, _of_variable(scales, blocks, num_slots))]


def dpdr(l2_norm_clip: float,
         noise_multiplier: float,
         decomposition_steps: int = 50,
         alpha_share: float = 0.1,
         granularity: str = 'variable',
         *,
         perp_l2_norm_clip: Optional[float] = None,
         alpha_l2_norm_clip: Optional[float] = None,
         perp_noise_multiplier: Optional[float] = None,
         alpha_noise_multiplier: Optional[float] = None) -> DPDR:
  """The DPDR privatizer; see `DPDR` for the arguments and the privacy."""
  return DPDR(l2_norm_clip, noise_multiplier, decomposition_steps,
              alpha_share, granularity,
              perp_l2_norm_clip=perp_l2_norm_clip,
              alpha_l2_norm_clip=alpha_l2_norm_clip,
              perp_noise_multiplier=perp_noise_multiplier,
              alpha_noise_multiplier=alpha_noise_multiplier)
