"""D2P2-SGD: automatic clipping, a dynamic noise schedule, random projection.

One privatizer covers the paper's family; the variants are configurations:

* D2P2-SGD: a decaying `noise_schedule` and a projection (the paper's
  `projection='gaussian'`, or the default, structured `'srht'`);
* D2P-SGD: a decaying schedule and `projection='none'` (noise in d dims);
* DP2-SGD: `noise_schedule='constant'` and a projection;
* auto-clipped DP-SGD: `'constant'` and `projection='none'`.

Order of operations (spec `d2p2.md` section 2.10). Every example's gradient,
over all variables together, is normalized to `g / (||g|| + gamma)` (norm
below 1), the batch is summed, and then per variable:

* mode N (`projection_order='noise_first'`, the default for 'gaussian'):
  `v = A^T (S + z xi) / sqrt(p)`, `U = c A v`. The noisy sum is a DP-SGD
  release with sensitivity 1; both projections are post-processing.
* mode C (`'gaussian'` with `'project_first'`, the paper's order):
  `v = A^T S / sqrt(p) + z Delta xi`, `U = c A v`, with `Delta` the exact
  `max_l sigma_max(A_l) / sqrt(p_l)` (at least 1), from an eigen-decomposition
  of the p x p Gram matrix, never power iteration. The paper assumes
  `Delta = 1`, which understates epsilon (spec 4.4-4.5).
* mode O (`'srht'` with `'project_first'`, the default for 'srht'):
  `v = R S + z xi`, `U = c R^T v`; `||R||_op <= 1`, so the sensitivity is 1.

`c` is the back-projection gain: 'unbiased' (the default) makes the
expected update the clipped sum (`U = A v / sqrt(p)`; SRHT `c = d'/p`), so
a learning rate tuned for DP-SGD carries over; 'paper' keeps the paper's
expected gain `sqrt(p)` along the gradient (`U = A v`; SRHT `c =
d'/sqrt(p)`: 52 to 234 per variable on the tutorial CNN at ratio 0.3,
against 3.3 unbiased, where DP-SGD's learning rates then train nothing:
docs/defaults.md). Tensors with at most 3 entries are not projected (spec
P9/C11). Projection matrices come from the public `projection_seed` (and the
step, for `resample_projection='every_step'`), never from the noise seed; the
Gaussian matrix is generated in blocks and never held whole.
"""

import math
from typing import Optional, Sequence

import dp_accounting
import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import noise
from tfdpx import philox
from tfdpx import projections
from tfdpx import schedules

PROJECTIONS = ('gaussian', 'srht', 'none')
ORDERS = ('noise_first', 'project_first')
GAINS = ('paper', 'unbiased')
RESAMPLING = ('every_step', 'never')
# Tensors with at most this many entries are never projected.
MAX_UNPROJECTED_SIZE = 3
# Mode C computes the exact operator norm; its cost grows as d p^2 + p^3.
MAX_EXACT_PROJECTED_DIM = 1024
# Relative margin on mode C's Delta for float32 rounding in the projection.
_DELTA_MARGIN = 1e-5


def _choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f'{name} must be one of {allowed}, got {value!r}')
  return value


@core.register
class D2P2(core.Privatizer):
  """D2P2-SGD's noise step, accounted honestly (Jiang et al., TMLR 2025).

  Privacy:
    Each example's gradient over all trainable variables together is
    normalized to `g / (||g|| + gamma)`, so its L2 norm is below 1 whatever
    the input: the L2 sensitivity of the summed batch is 1 under add/remove
    adjacency. In modes N, O and without projection the noise on that sum (or
    on its norm-non-expanding SRHT image) has std `z_k` per coordinate; in
    mode C it has std `z_k * Delta_k` on a projection whose sensitivity is
    `Delta_k`. Every step is therefore `GaussianDpEvent(z_k)` with `z_k` the
    schedule's multiplier of that step (0-based `step`, read by the graph from
    the state's step counter and by `dp_event` from the same schedule object).
    The projection and the back-projection gain are public and
    data-independent: post-processing.

  References:
    Jiang, Hasan, Saadati, Balu, Liu, Sarkar, "Balancing Utility and Privacy:
    Dynamically Private SGD with Random Projection", TMLR 2025; Bu et al.,
    "Automatic clipping", NeurIPS 2023; spec `d2p2.md`.
  """

  name = 'd2p2'

  def __init__(self,
               noise_multiplier: float,
               *,
               noise_schedule='constant',
               min_noise_multiplier: Optional[float] = None,
               steps_per_epoch: Optional[int] = None,
               gamma: float = 0.01,
               projection: str = 'srht',
               projection_ratio: float = 0.3,
               projection_order: Optional[str] = None,
               back_projection: str = 'unbiased',
               resample_projection: str = 'every_step',
               projection_seed: int = 0):
    """Args:
      noise_multiplier: `z0`, the multiplier of step 0 (noise std over the
        sensitivity 1 of the auto-clipped sum), >= 0.
      noise_schedule: 'constant', 'inv_sqrt_step' (paper text,
        `z0 / sqrt(k)`), 'inv_fourth_root_epoch' (official code,
        `z0 / e ** (1/4)` per epoch), or a `tfdpx.schedules.Schedule` (or its
        serialized form), rescaled to start at `noise_multiplier`.
      min_noise_multiplier: floor of a decaying named schedule (required).
      steps_per_epoch: for 'inv_fourth_root_epoch'.
      gamma: stability constant of automatic clipping, > 0.
      projection: 'srht' (the default: a structured projection, O(d log d)
        per variable and step), 'gaussian' (the paper's dense Gaussian
        matrix: O(d p) normals per variable and step, regenerated in blocks,
        seconds per step on a 26k-parameter CNN) or 'none'.
      projection_ratio: `p / d` in (0, 1].
      projection_order: 'noise_first' (mode N) or 'project_first' (mode C for
        'gaussian', mode O for 'srht'); default N for 'gaussian', O for
        'srht'.
      back_projection: 'unbiased' or 'paper' gain (see the module doc).
      resample_projection: 'every_step' (paper) or 'never' (official code).
      projection_seed: public non-negative integer seed of the projections.

    Raises:
      ValueError: naming the argument that is out of range or inconsistent.
    """
    self._noise_multiplier = core.check_positive(
        'noise_multiplier', noise_multiplier, allow_zero=True)
    if min_noise_multiplier is not None:
      min_noise_multiplier = core.check_positive(
          'min_noise_multiplier', min_noise_multiplier, allow_zero=True)
    self._schedule = schedules.get(
        noise_schedule, self._noise_multiplier,
        min_noise_multiplier=min_noise_multiplier,
        steps_per_epoch=steps_per_epoch)
    self._gamma = core.check_positive('gamma', gamma)
    if math.isinf(self._gamma):
      raise ValueError(f'gamma must be finite, got {gamma!r}')
    self._projection = _choice('projection', projection, PROJECTIONS)
    self._ratio = core.check_positive('projection_ratio', projection_ratio)
    if self._ratio > 1:
      raise ValueError(
          f'projection_ratio must be in (0, 1], got {projection_ratio!r}')
    if projection_order is None:
      projection_order = ('project_first' if projection == 'srht'
                          else 'noise_first')
    self._order = _choice('projection_order', projection_order, ORDERS)
    self._gain = _choice('back_projection', back_projection, GAINS)
    self._resample = _choice('resample_projection', resample_projection,
                             RESAMPLING)
    if (isinstance(projection_seed, bool) or
        int(projection_seed) != projection_seed or projection_seed < 0):
      raise ValueError(
          f'projection_seed must be a non-negative integer, got '
          f'{projection_seed!r}')
    self._projection_seed = int(projection_seed)

  # --- description -------------------------------------------------------------

  @property
  def config(self):
    return {
        'noise_multiplier': self._noise_multiplier,
        'noise_schedule': schedules.serialize(self._schedule),
        'gamma': self._gamma,
        'projection': self._projection,
        'projection_ratio': self._ratio,
        'projection_order': self._order,
        'back_projection': self._gain,
        'resample_projection': self._resample,
        'projection_seed': self._projection_seed,
    }

  @property
  def schedule(self) -> schedules.Schedule:
    """The noise schedule that both `update` and `dp_event` read."""
    return self._schedule

  @property
  def mode(self) -> str:
    """The spec's letter: 'N', 'C', 'O', or 'none' without projection."""
    if self._projection == 'none':
      return 'none'
    if self._order == 'noise_first':
      return 'N'
    return 'C' if self._projection == 'gaussian' else 'O'

  def dp_event(self, step):
    # Every mode's noise is z_k times its sensitivity (1, or Delta_k in C).
    return dp_accounting.GaussianDpEvent(
        float(self._schedule.accounted_value(step)))

  # --- projections ---------------------------------------------------------------

  def projected(self, shape: Sequence[int]) -> bool:
    """Whether a variable of this shape is projected."""
    return (self._projection != 'none' and
            math.prod(shape) > MAX_UNPROJECTED_SIZE)

  def projected_dim(self, shape: Sequence[int]) -> int:
    """p of a variable of this shape (its size if it is not projected)."""
    d = math.prod(shape)
    return projections.projected_dim(d, self._ratio) if self.projected(
        shape) else d

  def projection_key(self, index: int, step) -> tf.Tensor:
    """The public key of variable `index`'s projection at `step`."""
    return philox.fold_in(self.step_key(step), index)

  def step_key(self, step) -> tf.Tensor:
    """The public key of all the projections of `step`."""
    base = noise.substream(
        tf.constant([self._projection_seed, 0], tf.int64), 'd2p2/projection')
    k = step if self._resample == 'every_step' else 0
    return philox.fold_in(base, tf.cast(k, tf.int64))

  def _gain_factor(self, d, p):
    if self._projection == 'gaussian':
      return 1.0 if self._gain == 'paper' else 1.0 / math.sqrt(p)
    dp = projections.padded_dim(d)
    return dp / math.sqrt(p) if self._gain == 'paper' else dp / p

  def _forward(self, x, key, p, parts):
    if self._projection == 'gaussian':
      return projections.gaussian_forward(x, key, p) / math.sqrt(p)
    return projections.srht_forward(x, key, p, parts)

  def _backward(self, v, key, d, p, parts):
    if self._projection == 'gaussian':
      out = projections.gaussian_backward(v, key, d)
    else:
      out = projections.srht_backward(v, key, d, parts)
    return out * self._gain_factor(d, p)

  def _srht_parts(self, key, shape):
    """The SRHT's signs and rows of one variable and step, drawn once for
    both directions; None without an SRHT projection of that variable."""
    if self._projection != 'srht' or not self.projected(shape):
      return None
    return projections.srht_parts(key, math.prod(shape),
                                  self.projected_dim(shape))

  def _check_shapes(self, shapes):
    if self.mode != 'C':
      return
    for shape in shapes:
      if self.projected(shape) and (
          self.projected_dim(shape) > MAX_EXACT_PROJECTED_DIM):
        raise ValueError(
            f'projection_order=project_first with a Gaussian projection (mode '
            f'C) computes the exact sensitivity, limited to projected '
            f'dimensions <= {MAX_EXACT_PROJECTED_DIM}; a variable of shape '
            f'{tuple(shape)} projects to {self.projected_dim(shape)}. Use '
            "projection_order='noise_first' (mode N) or projection='srht'.")

  def sensitivity(self, shapes: Sequence[Sequence[int]], step) -> tf.Tensor:
    """L2 sensitivity of the released vector (float64 scalar tensor).

    1 in modes N, O and without projection; in mode C the exact
    `max(1, max_l sigma_max(A_l) / sqrt(p_l))` over projected variables, with
    a relative margin of 1e-5 for float32 rounding.
    """
    if self.mode != 'C':
      return tf.constant(1.0, tf.float64)
    self._check_shapes(shapes)
    delta = tf.constant(1.0, tf.float64)
    for index, shape in enumerate(shapes):
      if not self.projected(shape):
        continue
      d, p = math.prod(shape), self.projected_dim(shape)
      sigma = projections.gaussian_max_singular_value(
          self.projection_key(index, step), d, p)
      delta = tf.maximum(delta, sigma / math.sqrt(p))
    return delta * (1.0 + _DELTA_MARGIN)

  def expected_output_noise_std(self, step: int,
                                shapes: Sequence[Sequence[int]]):
    """RMS over all output coordinates of the noise, for zero gradients.

    Exact without projection and in mode O; in mode N the expectation over
    the Gaussian projection (`c^2 z^2 (p + d + 1)` per coordinate of a
    projected variable). `None` in mode C (it depends on the realized
    `Delta_k`).

    Args:
      step: 0-based step.
      shapes: the variables' shapes.

    Returns:
      A Python float, or None.
    """
    if self.mode == 'C':
      return None
    z = self._schedule.value(step)
    total, size = 0.0, 0
    for shape in shapes:
      d = math.prod(shape)
      size += d
      if not self.projected(shape):
        total += d * z * z
        continue
      p = self.projected_dim(shape)
      c = self._gain_factor(d, p)
      if self.mode == 'N':
        if self._projection != 'gaussian':
          return None
        total += d * c * c * z * z * (p + d + 1)
      else:  # Mode O: c^2 z^2 tr(R R^T) = c^2 z^2 p d / d'.
        total += c * c * z * z * p * d / projections.padded_dim(d)
    return math.sqrt(total / size)

  # --- the step ------------------------------------------------------------------

  def init(self, params):
    self._check_shapes([tuple(v.shape) for v in params])
    return {'step': tf.constant(0, tf.int64)}

  def clipped_sums(self, per_example_grads, state, plan):
    del state, plan  # The normalization is the same at every step.
    # Automatic clipping as the weights of one sum: the normalized gradients
    # are never formed.
    return noise.batch_sum(per_example_grads, clipping.normalize_factors(
        per_example_grads, self._gamma))

  def release(self, sums, state, plan, seed):
    del plan
    step = state['step']
    shapes = [tuple(s.shape) for s in sums]
    z = self._schedule.tf_value(step)
    noise_seed = noise.substream(seed, 'd2p2/noise')
    # Each projected variable's key, `projection_key(index, step)`: one
    # fold-in of all the indices.
    keys = tf.unstack(philox.fold_in(self.step_key(step),
                                     tf.range(len(shapes))), num=len(shapes))
    keys = [key if self.projected(shape) else None
            for key, shape in zip(keys, shapes)]
    parts = [self._srht_parts(key, shape) for key, shape in zip(keys, shapes)]
    if self.mode in ('none', 'N'):
      # A DP-SGD release of sensitivity 1; the projections post-process it.
      released = noise.add_gaussian(sums, 1.0, z, noise_seed)
      out = [self._back(key, self._project(key, r, part), shape, part)
             for key, r, shape, part in zip(keys, released, shapes, parts)]
    else:
      delta = self.sensitivity(shapes, step)
      projected = [self._project(key, s, part)
                   for key, s, part in zip(keys, sums, parts)]
      noisy = [v + n for v, n in zip(
          projected, noise.gaussian_like(projected, z * delta, noise_seed))]
      out = [self._back(key, v, shape, part)
             for key, v, shape, part in zip(keys, noisy, shapes, parts)]
    return out, {'step': step + 1}

  def _project(self, key, total, parts) -> tf.Tensor:
    if key is None:
      return total
    p = self.projected_dim(total.shape)
    return self._forward(tf.reshape(total, [-1]), key, p, parts)

  def _back(self, key, v, shape, parts) -> tf.Tensor:
    if key is None:
      return v
    d, p = math.prod(shape), self.projected_dim(shape)
    return tf.reshape(self._backward(v, key, d, p, parts), shape)


def d2p2(noise_multiplier: float, **kwargs) -> D2P2:
  """The D2P2-SGD privatizer; see `D2P2` for the arguments."""
  return D2P2(noise_multiplier, **kwargs)

