"""Hyperspherical coordinates of a vector: one magnitude and d - 1 angles.

Conventions (0-based, spec geodp.md §2.2): for x in R^d, d >= 2, with suffix
norms s[k] = ||x[k:]||,

  r        = s[0]
  theta[k] = atan2(s[k + 1], x[k])     for k = 0 .. d - 3, in [0, pi]
  theta[d - 2] = atan2(x[d - 1], x[d - 2]),               in (-pi, pi]

and the inverse

  x[k]     = r * prod_{i < k} sin(theta[i]) * cos(theta[k])   for k < d - 1
  x[d - 1] = r * prod_{i < d - 1} sin(theta[i]).

`atan2(0, 0)` is 0, so the zero vector is (0, 0, ..., 0) and a zero tail gives
zero angles; nothing is ever NaN.

All arithmetic is float64 whatever the input dtype (spec §2.4): suffix norms
from a reverse cumulative sum of squares after scaling by max |x| (no
cancellation, no under- or overflow of the squares), angles by `atan2` (no
`acos`), and the prefix products of sines as `exp` of an exclusive cumulative
sum of `log |sin|` with a separate sign parity (no underflowing
chain of multiplications), the sines and cosines by `sin_cos` (a
vectorized float64 reduction and polynomial, as exact as tf.sin and tf.cos
and ten times faster on a CPU). The cumulative sums are blocked (`_cumsum`), so
the cost is O(d) and the numbers are the same eager and under
`tf.function(jit_compile=True)`. Lengths must be static (variables' shapes
always are).

`leading_angles` and `leading_coordinates` convert the first angles only,
and say when the rest of the output is exactly 0 whatever the other angles
(large angle noise: GeoDP then never forms them).

References:
  J. Duan, H. Hu, Q. Ye, X. Sun, "Analyzing and Optimizing Perturbation of
  DP-SGD Geometrically", arXiv:2504.05618, Eq. 24-27.
"""

from decimal import Decimal
from fractions import Fraction
import math
from typing import Tuple

import numpy as np
import tensorflow as tf


# Block length of `_cumsum`: a few dozen flops per element, measured fastest.
_BLOCK = 32

# Stands for log(0): exp of anything below about -745 is 0 in float64.
_LOG_ZERO = -1e4


def _cumsum(x: tf.Tensor, *, exclusive: bool = False,
            reverse: bool = False) -> tf.Tensor:
  """Cumulative sums along the last axis, fast eager and under XLA.

  `tf.math.cumsum` compiles under XLA to a reduce-window whose CPU cost is
  quadratic in the length (minutes at d = 10^6). Here each row is cut into
  blocks of `_BLOCK`, each block is summed by a product with a triangular
  matrix of ones (lower for `reverse`, so nothing is reversed), and the
  block totals are scanned recursively: O(n) work, the same numbers eager and
  compiled, rounding error growing with the block length and log n rather
  than with n.

  Args:
    x: a tensor `[..., n]` of static shape.
    exclusive: leave out each element itself (the first output is 0).
    reverse: sum from the end.

  Returns:
    A tensor like `x`.
  """
  n = x.shape[-1]
  if n == 0:
    return x
  if exclusive:
    zero = tf.zeros_like(x[..., :1])
    if reverse:
      return tf.concat([_cumsum(x[..., 1:], reverse=True), zero], axis=-1)
    return tf.concat([zero, _cumsum(x[..., :-1])], axis=-1)
  rows = x.shape[:-1]
  block = min(_BLOCK, n)
  blocks = -(-n // block)
  padding = [[0, 0]] * len(rows) + [[0, blocks * block - n]]
  padded = tf.reshape(tf.pad(x, padding), rows + [blocks, block])
  ones = np.triu(np.ones((block, block)))
  within = tf.matmul(padded, tf.constant(ones.T if reverse else ones, x.dtype))
  if blocks > 1:
    totals = within[..., 0] if reverse else within[..., -1]
    within += _cumsum(totals, exclusive=True, reverse=reverse)[..., tf.newaxis]
  return tf.reshape(within, rows + [blocks * block])[..., :n]


def _half_pi_parts() -> Tuple[float, float, float]:
  """pi/2 as `p1 + p2 + p3` (to 2^-120): `p1` and `p2` with 33 significant
  bits, so their products with an integer below 2^20 are exact doubles."""
  half_pi = Fraction(Decimal('3.14159265358979323846264338327950288419716939'
                             '93751058209749445923078164062862')) / 2
  p1 = Fraction(math.floor(half_pi * 2**32), 2**32)
  p2 = Fraction(math.floor((half_pi - p1) * 2**66), 2**66)
  return float(p1), float(p2), float(half_pi - p1 - p2)


_HALF_PI_PARTS = _half_pi_parts()

# Taylor coefficients of (sin(r) - r) / r^3 and (cos(r) - 1 + r^2 / 2) / r^4
# in z = r^2: on |r| <= pi / 4 the first terms left out are below 2^-54.
_SIN_TERMS = [(-1)**(i + 1) / math.factorial(2 * i + 3) for i in range(8)]
_COS_TERMS = [(-1)**i / math.factorial(2 * i + 4) for i in range(8)]


def _polynomial(z: tf.Tensor, terms) -> tf.Tensor:
  value = tf.constant(terms[-1], z.dtype)
  for term in reversed(terms[:-1]):
    value = value * z + term
  return value


# Compiled by XLA wherever it runs: TensorFlow's float64 sin and cos are
# scalar library calls (22 ms for 1.3M angles on a CPU, two cores), while XLA
# fuses the reduction and the polynomials into one vectorized loop (2-3 ms).
@tf.function(jit_compile=True)
def sin_cos(theta: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """`(sin(theta), cos(theta))` of a float64 tensor, within 2^-52 of each.

  The angles are reduced to `r` in [-pi/4, pi/4] by the nearest multiple
  `k pi/2` (Cody and Waite's three-part pi/2: exact for |k| < 2^20), and
  sin and cos of `r` are Taylor polynomials. Angles of magnitude 2^19 pi/2
  or more anywhere in `theta` send the whole tensor to tf.sin and tf.cos.
  """
  p1, p2, p3 = _HALF_PI_PARTS

  def reduced():
    k = tf.floor(theta * (2 / math.pi) + 0.5)
    r = ((theta - k * p1) - k * p2) - k * p3
    z = r * r
    sin = r + r * z * _polynomial(z, _SIN_TERMS)
    # One rounding at the scale of 1, as for the sine at that of r: a
    # rounding of 1 - z/2 first would bias the products of a million sines.
    cos = 1.0 - (0.5 * z - z * z * _polynomial(z, _COS_TERMS))
    quarter = k - 4.0 * tf.floor(0.25 * k)  # k mod 4, exactly.
    # theta = r + k pi/2: rotate (cos r, sin r) by k quarter turns.
    sin, cos = (tf.where(quarter < 2, sin, -sin),
                tf.where(quarter < 2, cos, -cos))
    odd = tf.logical_or(tf.equal(quarter, 1.0), tf.equal(quarter, 3.0))
    return tf.where(odd, cos, sin), tf.where(odd, -sin, cos)

  small = tf.reduce_max(tf.abs(theta)) < 2.0**19 * math.pi / 2
  return tf.cond(small, reduced, lambda: (tf.sin(theta), tf.cos(theta)))


def _check_length(d):
  if d is None:
    raise ValueError('the vector length must be known when tracing')
  if d < 2:
    raise ValueError(
        f'hyperspherical coordinates need a vector of length >= 2, got {d}')


def _scaled(x: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """`x` in float64 over its largest magnitude (no under- or overflow of
  its squares), and that magnitude; `x` checked to be 1-D of length >= 2."""
  x = tf.convert_to_tensor(x)
  if x.shape.rank != 1:
    raise ValueError(f'x must be a 1-D tensor, got shape {x.shape}')
  _check_length(x.shape[0])
  x = tf.cast(x, tf.float64)
  largest = tf.reduce_max(tf.abs(x))
  return x / tf.where(largest > 0, largest, tf.ones_like(largest)), largest


def to_spherical(x: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """The magnitude and angles of the vector `x`.

  Args:
    x: a 1-D float tensor of static length d >= 2 (any float dtype).

  Returns:
    `(r, theta)`: a float64 scalar r = ||x|| >= 0 and a float64 `[d - 1]`
    tensor of angles; `theta[:d - 2]` in [0, pi], `theta[d - 2]` in (-pi, pi].

  Raises:
    ValueError: if `x` is not 1-D or its length is unknown or below 2.
  """
  scaled, largest = _scaled(x)
  # Suffix sums tail first; never total - prefix (cancellation in small tails).
  suffix = tf.sqrt(_cumsum(tf.square(scaled), reverse=True))
  r = suffix[0] * largest
  head = tf.atan2(suffix[1:-1], scaled[:-2])
  last = tf.atan2(scaled[-1:], scaled[-2:-1])
  return r, tf.concat([head, last], axis=0)


def leading_angles(x: tf.Tensor, n: int) -> Tuple[tf.Tensor, tf.Tensor]:
  """`(r, theta[:n])` of `to_spherical(x)`, for `1 <= n < d - 1`.

  The suffix norms of the first `n + 1` coordinates are their reverse
  cumulative sum of squares plus the sum of the other squares: sums of
  non-negative terms, as in `to_spherical`, whose values these equal up to
  rounding. Elementwise work over `x`, but angles for `n` coordinates only.
  """
  scaled, largest = _scaled(x)
  if not 1 <= n < scaled.shape[0] - 1:
    raise ValueError(f'n must be in [1, {scaled.shape[0] - 2}], got {n}')
  head = scaled[:n + 1]
  rest = tf.reduce_sum(tf.square(scaled[n + 1:]))
  suffix = tf.sqrt(_cumsum(tf.square(head), reverse=True) + rest)
  return suffix[0] * largest, tf.atan2(suffix[1:], head[:-1])


# Where the log of a prefix product of sines is below this, `to_cartesian`'s
# later coordinates are all exactly 0: float64 exp is 0 below about -745,
# and the margin is far above any rounding of the cumulative sums.
_VANISHED = -1000.0


def leading_coordinates(r: tf.Tensor,
                        theta: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """The first `n` coordinates of `to_cartesian(r, angles)` for any `angles`
  whose first `n` are `theta`, and whether all later ones are exactly 0.

  Coordinate `k` reads only the angles before it and its own, so the first
  `n` are known from `theta`; every later one is a multiple of the product of
  the sines of `theta`, which `to_cartesian` computes as exactly 0 when the
  sum of their logs is below `_VANISHED`. Under large angle noise that
  happens within a few thousand angles (spec geodp.md §2.4: `|sin|` averages
  `exp(-ln 2)`), so the other angles need not be known.

  Returns:
    `(x[:n], vanished)`: float64 `[n]` and a bool scalar.
  """
  theta = tf.cast(tf.convert_to_tensor(theta), tf.float64)
  sin, _ = sin_cos(theta)
  vanished = tf.reduce_sum(_log_abs(sin)) < _VANISHED
  return to_cartesian(r, theta)[:-1], vanished


def _log_abs(sin: tf.Tensor) -> tf.Tensor:
  # log|sin| <= 0, so the log prefix never increases: a zero sine, logged as
  # _LOG_ZERO (far below the log of the smallest float64) instead of -inf,
  # makes every later prefix exp(...) == 0 exactly, without NaN.
  return tf.maximum(tf.math.log(tf.abs(sin)), _LOG_ZERO)


def to_cartesian(r: tf.Tensor, theta: tf.Tensor) -> tf.Tensor:
  """The vector of magnitude `r` and angles `theta`; inverts `to_spherical`.

  Any real angles are accepted (noisy angles outside their ranges flip the
  signs of later coordinates, as the formulas say) and a negative `r` flips
  the whole vector.

  Args:
    r: a scalar magnitude.
    theta: a 1-D tensor of d - 1 >= 1 angles (static length).

  Returns:
    A float64 `[d]` tensor.

  Raises:
    ValueError: if `theta` is not 1-D or its length is unknown or 0.
  """
  theta = tf.cast(tf.convert_to_tensor(theta), tf.float64)
  if theta.shape.rank != 1:
    raise ValueError(f'theta must be a 1-D tensor, got shape {theta.shape}')
  _check_length(None if theta.shape[0] is None else theta.shape[0] + 1)
  r = tf.cast(r, tf.float64)
  sin, cos = sin_cos(theta)
  log_abs = _log_abs(sin)
  # prefix[k] = prod_{i < k} sin(theta[i]), for k = 0 .. d - 1, from one
  # scan of two rows: log |sin| and the count of negative sines.
  log_prefix, negatives = tf.unstack(tf.pad(
      _cumsum(tf.stack([log_abs, tf.cast(sin < 0, tf.float64)])),
      [[0, 0], [1, 0]]))
  # The counts are exact integers, so half of one is whole or whole + 0.5;
  # this parity is exact and ten times faster than float64 FloorMod on CPU.
  half = 0.5 * negatives
  sign = 1.0 - 4.0 * (half - tf.floor(half))
  prefix = sign * tf.exp(log_prefix)
  return r * prefix * tf.concat([cos, [1.0]], 0)
