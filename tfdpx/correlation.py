"""Correlated noise across steps: banded Toeplitz and BLT strategies (matrix mechanism).

DP-SGD adds fresh noise `z_t` at every step, so the model, a prefix sum of
the noisy updates, carries the sum of every step's noise. The matrix
mechanism (DP-FTRL; Denisov et al. 2022, Choquette-Choo et al. 2023) releases
`C x + z` instead, for a lower-triangular strategy matrix `C` and the clipped
sums `x` of every step, and trains on its post-processing `C^-1 (C x + z) = x
+ C^-1 z`: the noise of step t is row t of `C^-1 z`, a combination of this
step's draw and the earlier steps' noise that partly cancels in the prefix
sums.

Here `C` is banded Toeplitz: `C[t, t - j] = c_j` for `0 <= j < bands`, with
`|c| = 1`, so that every column has norm at most 1 and one participation
moves `C x` by at most the clip norm. The noise of step t is found online
from the previous `bands - 1` noise vectors:
`w_t = (z_t - sum_{j >= 1} c_j w_{t-j}) / c_0`, in units of the step's noise
std (each step scales its own `w_t`, so a step's Gaussian release is exactly
the one its `dp_event` states, whatever the other steps' noise).

What one example costs depends on when it participates (`tfdpx.accounting`):
- in steps at least `bands` apart (`tfdpx.sampling.cyclic_poisson_batches`,
  `groups >= bands`), the columns of its steps do not overlap, and with
  Poisson sampling inside each group the whole run costs what DP-SGD with
  the group's sampling probability costs over the group's steps
  (Choquette-Choo et al. 2023, amplified banded MF);
- once per epoch at any position (shuffled batches), two participations at
  an epoch's boundary overlap; `once_per_epoch_sensitivity` bounds the worst
  pattern, and the run is one Gaussian mechanism of that sensitivity.

A BLT strategy (`blt`, Dvijotham et al. 2024) is Toeplitz but not banded:
its coefficients are sums of `d` geometric sequences, so the noise needs
only `d` decaying sums of the past noise, and one participation (a single
epoch) gets far less prefix-sum error than any band count of the same
memory. Its columns never end, so nothing is amplified by cyclic sampling:
a run is one Gaussian mechanism of `once_per_epoch_sensitivity` (an upper
bound for any coefficients).

References:
  Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and
  Near-Optimal Noise Generation for Streaming Differential Privacy", FOCS
  2024 (arXiv 2404.16706); McMahan, Xu, Zhang, "Don't use tree aggregation,
  use BLTs" (arXiv 2408.08868).
  Choquette-Choo, McMahan, Rush, Thakurta, "Multi-Epoch Matrix Factorization
  Mechanisms for Private Machine Learning", ICML 2023.
  Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified)
  Banded Matrix Factorization: A unified approach to private training",
  NeurIPS 2023 (arXiv 2306.08153).
"""

import functools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import linalg
from scipy import optimize
from scipy import signal
from scipy import special
import tensorflow as tf


class ToeplitzStrategy:
  """What banded and BLT strategies share: a lower-triangular Toeplitz `C`
  of column norm at most 1, known by its first coefficients."""

  name = ''

  def toeplitz_coefficients(self, steps: int) -> np.ndarray:
    """`c_0, ..., c_{steps-1}`: `C[t, t - k] = c_k`."""
    raise NotImplementedError

  def inverse_coefficients(self, steps: int) -> np.ndarray:
    """The first `steps` coefficients of `C^-1` (lower-triangular Toeplitz):
    the noise of step t is `sum_k r_k z_{t-k}`."""
    impulse = np.zeros(steps)
    impulse[:1] = 1.0
    numerator, denominator = self._transfer_function()
    return signal.lfilter(denominator, numerator, impulse)

  def _transfer_function(self) -> Tuple[np.ndarray, np.ndarray]:
    """`C`'s generating function `sum_k c_k x^k` as `numerator /
    denominator` (polynomials, lowest power first)."""
    raise NotImplementedError

  @property
  def history_length(self) -> int:
    """The tensors shaped like the noise that a step keeps for the next."""
    raise NotImplementedError

  @property
  def bands(self):
    """The number of nonzero diagonals; None if every column is full."""
    raise NotImplementedError

  @property
  def config(self) -> Dict[str, Any]:
    raise NotImplementedError

  def __eq__(self, other):
    return type(self) is type(other) and self.config == other.config

  def __hash__(self):
    return hash(repr(self.config))

  def noise_covariance(self, steps: int) -> np.ndarray:
    """`C^-1 C^-T` over `steps` steps: the covariance across steps of one
    coordinate's noise, in units of the noise std squared."""
    r = self.inverse_coefficients(steps)
    inverse = linalg.toeplitz(r, np.zeros_like(r))
    return inverse @ inverse.T

  def _once_per_epoch_bound(self, steps: int, steps_per_epoch: int) -> float:
    """An upper bound on `once_per_epoch_sensitivity` for any coefficients.

    Participations `p_1 < ... < p_k`, one per epoch, are at least `(l - i -
    1) steps_per_epoch + 1` apart (`l > i`), and `|(C^T C)[p, p + d]|` is at
    most `R(d) = sum_j |c_j c_{j+d}|` over the run's coefficients; with
    `Rmax(d)`, the largest `R` at distances `>= d`, `|C x|^2 <= k R(0) + 2
    sum_{g >= 1} (k - g) Rmax((g - 1) steps_per_epoch + 1)`.
    """
    if steps < 1:
      return 0.0
    c = np.abs(self.toeplitz_coefficients(steps))
    overlap = signal.correlate(c, c, mode='full', method='auto')[steps - 1:]
    largest_beyond = np.maximum.accumulate(overlap[::-1])[::-1]
    epochs = -(-steps // steps_per_epoch)
    total = epochs * overlap[0]
    for gap in range(1, epochs):
      total += 2 * (epochs - gap) * largest_beyond[
          (gap - 1) * steps_per_epoch + 1]
    return math.sqrt(max(total, 0.0))

  def prefix_sum_error(self, steps: int, momentum: float = 0.0) -> float:
    """Root mean squared noise of the model's trajectory over `steps` steps,
    per coordinate, in units of the noise std: of the prefix sums under SGD
    (`sqrt((steps + 1) / 2)` for DP-SGD, one band), or of `workload`'s
    momentum sums under SGD with `momentum`."""
    p = workload(self.inverse_coefficients(steps), momentum)
    return math.sqrt(np.sum((steps - np.arange(steps)) * p * p) / steps)


class BandedToeplitz(ToeplitzStrategy):
  """A banded lower-triangular Toeplitz strategy with unit column norm.

  A small serializable value: `coefficients` (`c_0 > 0`, `c_j` for the
  `j`-th subdiagonal) define `C`; they are scaled to unit L2 norm, the
  sensitivity of one participation.
  """

  name = 'banded_toeplitz'

  def __init__(self, coefficients: Sequence[float]):
    """Args:
      coefficients: `c_0, ..., c_{bands-1}`, finite, `c_0 > 0`; scaled here
        to unit norm.

    Raises:
      ValueError: naming `coefficients`, if empty, not finite, or `c_0 <= 0`.
    """
    try:
      c = np.asarray(coefficients, np.float64)
    except (TypeError, ValueError):
      raise ValueError(
          f'coefficients must be numbers, got {coefficients!r}') from None
    if c.ndim != 1 or not c.size or not np.all(np.isfinite(c)) or c[0] <= 0:
      raise ValueError('coefficients must be a non-empty list of finite '
                       f'numbers with coefficients[0] > 0, got {coefficients!r}')
    self._coefficients = tuple(float(v) for v in c / np.linalg.norm(c))

  @property
  def coefficients(self) -> Tuple[float, ...]:
    return self._coefficients

  @property
  def bands(self) -> int:
    """The number of bands `b`: each step's noise reads `b - 1` earlier ones."""
    return len(self._coefficients)

  @property
  def config(self) -> Dict[str, Any]:
    return {'coefficients': list(self._coefficients)}

  def __repr__(self):
    return f'banded_toeplitz(bands={self.bands})'

  @property
  def history_length(self) -> int:
    return self.bands - 1

  def toeplitz_coefficients(self, steps: int) -> np.ndarray:
    c = np.zeros(steps)
    n = min(steps, self.bands)
    c[:n] = self._coefficients[:n]
    return c

  def _transfer_function(self):
    return np.asarray(self._coefficients), np.ones(1)

  def correlate(self, draws: List[tf.Tensor], history: List[List[tf.Tensor]]
                ) -> Tuple[List[tf.Tensor], List[List[tf.Tensor]]]:
    """This step's noise from its independent draws and the last noises.

    Args:
      draws: independent N(0, 1) draws `z_t`, one tensor per released part.
      history: per part, the `bands - 1` last noises `[w_{t-1}, ...,
        w_{t-b+1}]`, each shaped like the part (zeros before the first step).

    Returns:
      `(noise, new_history)`: `w_t = (z_t - sum_j c_j w_{t-j}) / c_0` per
      part (its std the norm of row t of `C^-1`, `1 / c_0` at the first
      step), and the history with `w_t` in front. The history is a list of
      tensors, not one stacked tensor, so that shifting it moves no data:
      assigning a variable the tensor of another shares its buffer, while a
      stacked shift copies `bands - 1` copies of the coordinates every step.
    """
    if self.bands == 1:
      return [z / self._coefficients[0] for z in draws], [[] for _ in draws]
    noise = _banded_noise(list(draws), [list(past) for past in history],
                          tf.constant(self._coefficients, draws[0].dtype))
    return noise, [[w] + list(past[:-1]) for w, past in zip(noise, history)]

  def once_per_epoch_sensitivity(self, steps: int,
                                 steps_per_epoch: int) -> float:
    """The largest L2 change of `C x` from one example in one step of each
    epoch (at positions an adversary chooses), for clipped records of norm 1.

    With participations at `p_1 < p_2 < ...` and records `g_i` of norm at
    most 1, `|C x|^2 = sum_{i,k} (C^T C)[p_i, p_k] <g_i, g_k>`, at most
    `sum_{i,k} |(C^T C)[p_i, p_k]|`; with `steps_per_epoch >= bands` only
    consecutive epochs' steps can be within `bands` of each other, so the
    worst positions follow from one pass over the epochs (dynamic
    programming). `(C^T C)[p, p + d]` is bounded by `sum_j |c_j c_{j+d}|`
    (columns cut short by the run's end hold less).

    Raises:
      ValueError: if `steps_per_epoch < bands`.
    """
    b = self.bands
    if steps_per_epoch < b:
      raise ValueError(
          f'steps_per_epoch={steps_per_epoch} is smaller than the strategy\'s '
          f'{b} bands: an example in one step of each epoch could be in '
          'several steps within one band; use fewer bands')
    c = np.abs(np.asarray(self._coefficients))
    overlap = np.array([c[:b - d] @ c[d:] for d in range(b)])  # [b]
    best = None  # Worst total for the previous epoch's participation at p.
    for start in range(0, steps, steps_per_epoch):
      size = min(steps_per_epoch, steps - start)
      if best is None:
        best = np.full(size, overlap[0])
        continue
      # Without an overlap the previous epoch's best; at distance d < b the
      # last positions of the previous epoch add 2 |(C^T C)[p', p]|.
      here = np.full(size, best.max())
      for d in range(1, b):
        for p in range(min(d, size)):  # p - d is the previous epoch's p'.
          previous = len(best) - (d - p)
          if previous >= 0:
            here[p] = max(here[p], best[previous] + 2 * overlap[d])
      best = here + overlap[0]
    return math.sqrt(best.max()) if best is not None else 0.0


def workload(r: np.ndarray, momentum: float = 0.0) -> np.ndarray:
  """The coefficients of `A R` for lower-triangular Toeplitz `R` (`r`) and
  the workload `A` of SGD's trajectory: the prefix sums (`A` all ones), or
  with `momentum` beta (Keras' SGD: the weights move by `v_t = beta v_{t-1}
  - lr g_t`) `A[t, k] = (1 - beta^(t-k+1)) / (1 - beta)`, the prefix sums of
  the momentum filter."""
  return np.cumsum(signal.lfilter([1.0], [1.0, -momentum], r))


def _prefix_sum_loss(c: np.ndarray, steps: int, momentum: float = 0.0
                    ) -> Tuple[float, np.ndarray]:
  """Mean squared trajectory noise of `c` over `steps` (per unit noise std
  and unit column norm; `workload`) and its gradient in `c[1:]`.

  `A C^-1` (A: the workload) is Toeplitz with `p = workload(r)` on its
  diagonals (r: `C^-1`'s coefficients), so `|A C^-1|_F^2 = sum_k (steps -
  k) p_k^2`; times `|c|^2` (the sensitivity) it does not depend on the scale
  of `c`. `dr / dc_j` is minus `r * r` delayed by j.
  """
  impulse = np.zeros(steps)
  impulse[:1] = 1.0
  with np.errstate(over='ignore', invalid='ignore'):
    p = workload(signal.lfilter([1.0], c, impulse), momentum)
    weights = steps - np.arange(steps)
    frobenius = float(np.sum(weights * p * p))
    norm = float(c @ c)
    p2 = workload(signal.lfilter([1.0], np.convolve(c, c), impulse), momentum)
    u = weights * p
    d_frobenius = np.array([-2.0 * (u[j:] @ p2[:steps - j])
                            for j in range(1, len(c))])
    gradient = (d_frobenius * norm + 2.0 * frobenius * c[1:]) / steps
  return frobenius * norm / steps, gradient


def _square_root_coefficients(bands: int) -> np.ndarray:
  """The first `bands` coefficients of `(1 - x)^-1/2`, `C(2k, k) / 4^k`: the
  square-root factorization of the prefix sums (Fichtenberger et al. 2023),
  a good start for the optimization."""
  k = np.arange(bands)
  return np.exp(special.gammaln(2 * k + 1) - 2 * special.gammaln(k + 1) -
                k * np.log(4.0))


@functools.lru_cache(maxsize=64)
def optimal_coefficients(bands: int, steps: int,
                         momentum: float = 0.0) -> Tuple[float, ...]:
  """Banded Toeplitz coefficients minimizing the trajectory's error.

  Minimizes `prefix_sum_error(steps, momentum)` (the noise of SGD's
  trajectory, with `momentum` that of SGD with momentum) over `c_1, ...,
  c_{bands-1}` with `c_0 = 1` by L-BFGS from the square-root
  factorization's coefficients, as Choquette-Choo et al. (2023) optimize
  banded strategies for the prefix-sum and momentum workloads; cached per
  `(bands, steps, momentum)`.

  Returns:
    The coefficients scaled to unit norm.
  """
  start = _square_root_coefficients(bands)
  if bands == 1:
    return (1.0,)

  def log_loss(x):
    loss, gradient = _prefix_sum_loss(np.concatenate([[1.0], x]), steps,
                                      momentum)
    if not np.isfinite(loss) or not np.all(np.isfinite(gradient)):
      return 1e3, np.zeros_like(x)  # An unstable C^-1: far from the optimum.
    return math.log(loss), gradient / loss

  result = optimize.minimize(log_loss, start[1:], jac=True, method='L-BFGS-B',
                             options={'maxiter': 1000})
  best = start
  candidate = np.concatenate([[1.0], result.x])
  if (_prefix_sum_loss(candidate, steps, momentum)[0] <
      _prefix_sum_loss(start, steps, momentum)[0]):
    best = candidate
  return tuple(float(v) for v in best / np.linalg.norm(best))


def _check_positive_ints(**values):
  for name, value in values.items():
    if isinstance(value, bool) or int(value) != value or value < 1:
      raise ValueError(f'{name} must be a positive integer, got {value!r}')


def _checked_momentum(momentum) -> float:
  if isinstance(momentum, bool) or not 0 <= momentum < 1:
    raise ValueError(f'momentum must be in [0, 1), got {momentum!r}')
  return float(momentum)


def banded_toeplitz(bands: int, steps: int,
                    momentum: float = 0.0) -> BandedToeplitz:
  """The banded Toeplitz strategy for `steps` training steps.

  Args:
    bands: the number of bands `b >= 1` (1 is DP-SGD's independent noise);
      each step keeps the last `b - 1` noise vectors, one copy of the noised
      coordinates each. Amplification needs participations at least `b`
      steps apart (`tfdpx.sampling.cyclic_poisson_batches` with `groups=b`).
    steps: the number of training steps the error is optimized for.
    momentum: the optimizer's SGD momentum, in [0, 1): the error optimized
      is that of its trajectory (`workload`).

  Returns:
    A `BandedToeplitz` with `optimal_coefficients(bands, steps, momentum)`.

  Raises:
    ValueError: naming the argument that is not a positive integer, or a
      momentum outside [0, 1).
  """
  _check_positive_ints(bands=bands, steps=steps)
  return BandedToeplitz(optimal_coefficients(int(bands), int(steps),
                                             _checked_momentum(momentum)))


# The noise of a step is a few multiply-adds per coordinate over the draws
# and the history, which TensorFlow's kernels run as one pass over memory
# each (about 30 passes of the noise's size for 8 bands): XLA fuses them into
# one (e.g. 10.3 -> 4 ms a step for the 1.3 million coordinates of the text
# model, 8 bands, AMD EPYC), in one launch for every part of a release.
@tf.function(jit_compile=True)
def _banded_noise(draws, history, coefficients):
  """Per part, `(z - sum_j c_j w_{t-j}) / c_0`."""
  return [(z - tf.add_n([coefficients[j + 1] * w for j, w in enumerate(past)]))
          / coefficients[0] for z, past in zip(draws, history)]


@tf.function(jit_compile=True)
def _blt_noise(draws, history, decays, output_scales, norm):
  """Per part, BLT's noise `norm * v` and new buffers `theta_i s_i + v`,
  `v = z - sum_i w_i s_i`."""
  noise, new_history = [], []
  for z, buffers in zip(draws, history):
    v = z - tf.add_n([output_scales[i] * s for i, s in enumerate(buffers)])
    noise.append(v * norm)
    new_history.append([decays[i] * s + v for i, s in enumerate(buffers)])
  return noise, new_history


class BufferedLinearToeplitz(ToeplitzStrategy):
  """A buffered-linear Toeplitz (BLT) strategy with column norm at most 1.

  `C`'s coefficients are `c_0 = 1` and `c_k = sum_i w_i theta_i^(k-1)` for
  `k >= 1` (`decays` theta in [0, 1), `output_scales` w), divided by their
  norm over an infinite run, `sqrt(1 + sum_ij w_i w_j / (1 - theta_i
  theta_j))`, so that every column of a run of any length has norm at most
  1. `C^-1` is a BLT too: the noise needs `buffers` decaying sums of the
  past noise, however long the run (Dvijotham et al. 2024), where a banded
  strategy of comparable error reads many more earlier noises. Its columns
  never end, so no separation of an example's steps keeps them apart:
  cyclic Poisson sampling amplifies nothing, and a run is accounted as one
  Gaussian mechanism (`once_per_epoch_sensitivity`).
  """

  name = 'blt'

  def __init__(self, decays: Sequence[float], output_scales: Sequence[float]):
    """Args:
      decays: `theta_1, ..., theta_d`, each in [0, 1).
      output_scales: `w_1, ..., w_d`, finite.

    Raises:
      ValueError: naming the argument, for one that is not a list of `d >= 1`
        such numbers, or lists of different lengths.
    """
    try:
      theta = np.asarray(decays, np.float64)
      w = np.asarray(output_scales, np.float64)
    except (TypeError, ValueError):
      raise ValueError(f'decays and output_scales must be numbers, got '
                       f'{decays!r} and {output_scales!r}') from None
    if theta.ndim != 1 or not theta.size or not np.all(
        (theta >= 0) & (theta < 1)):
      raise ValueError('decays must be a non-empty list of numbers in [0, 1), '
                       f'got {decays!r}')
    if w.shape != theta.shape or not np.all(np.isfinite(w)):
      raise ValueError(f'output_scales must be {theta.size} finite numbers, '
                       f'one per decay, got {output_scales!r}')
    self._decays = tuple(float(v) for v in theta)
    self._output_scales = tuple(float(v) for v in w)
    # |c|^2 = 1 + sum_{k >= 1} (sum_i w_i theta_i^(k-1))^2.
    self._norm = math.sqrt(
        1.0 + float(w @ (1.0 / (1.0 - np.outer(theta, theta))) @ w))

  @property
  def decays(self) -> Tuple[float, ...]:
    return self._decays

  @property
  def output_scales(self) -> Tuple[float, ...]:
    return self._output_scales

  @property
  def buffers(self) -> int:
    """The number of buffers `d`: a step keeps `d` sums of past noise."""
    return len(self._decays)

  @property
  def bands(self) -> None:
    """None: not banded, every column reaches the run's last step."""
    return None

  @property
  def history_length(self) -> int:
    return self.buffers

  @property
  def config(self) -> Dict[str, Any]:
    return {'decays': list(self._decays),
            'output_scales': list(self._output_scales)}

  def __repr__(self):
    return f'blt(buffers={self.buffers})'

  def toeplitz_coefficients(self, steps: int) -> np.ndarray:
    k = np.arange(steps - 1)[:, np.newaxis]
    later = (np.asarray(self._decays) ** k) @ np.asarray(self._output_scales)
    return np.concatenate([[1.0], later])[:steps] / self._norm

  def _transfer_function(self):
    # 1 + sum_i w_i x / (1 - theta_i x), over the product of the
    # denominators, divided by the norm.
    denominator = np.ones(1)
    for theta in self._decays:
      denominator = np.convolve(denominator, [1.0, -theta])
    numerator = np.concatenate([denominator, [0.0]])
    for i, w in enumerate(self._output_scales):
      others = np.ones(1)
      for j, theta in enumerate(self._decays):
        if j != i:
          others = np.convolve(others, [1.0, -theta])
      numerator[1:1 + others.size] += w * others
    return numerator, self._norm * denominator

  def correlate(self, draws: List[tf.Tensor], history: List[List[tf.Tensor]]
                ) -> Tuple[List[tf.Tensor], List[List[tf.Tensor]]]:
    """This step's noise from its independent draws and the buffers.

    Args:
      draws: independent N(0, 1) draws `z_t`, one tensor per released part.
      history: per part, the `buffers` sums `s_i = sum_{u < t} theta_i^(t-1-u)
        v_u`, each shaped like the part (zeros before the first step).

    Returns:
      `(noise, new_history)`: with `v_t = z_t - sum_i w_i s_i` (row t of the
      unnormalized `C^-1` applied to the draws), the noise `norm * v_t` and
      the buffers `theta_i s_i + v_t`.
    """
    dtype = draws[0].dtype
    return _blt_noise(list(draws), [list(buffers) for buffers in history],
                      tf.constant(self._decays, dtype),
                      tf.constant(self._output_scales, dtype),
                      tf.constant(self._norm, dtype))

  def once_per_epoch_sensitivity(self, steps: int,
                                 steps_per_epoch: int) -> float:
    """An upper bound on the largest L2 change of `C x` from one example in
    one step of each epoch (at positions an adversary chooses), for clipped
    records of norm 1: `_once_per_epoch_bound`, at most 1 for one epoch."""
    return self._once_per_epoch_bound(steps, steps_per_epoch)


def _blt_loss(x: np.ndarray, steps: int, momentum: float,
              steps_per_epoch: Optional[int]) -> float:
  """The log trajectory error of the BLT with decays `sigmoid(x[:d])` and
  output scales `exp(x[d:])`, times its once-per-epoch sensitivity with
  `steps_per_epoch`: the error at a given epsilon."""
  d = x.size // 2
  decays = special.expit(x[:d])
  if np.any(decays >= 1.0):  # Rounded to 1: an unbounded BLT.
    return 1e3
  strategy = BufferedLinearToeplitz(decays, np.exp(x[d:]))
  with np.errstate(over='ignore', invalid='ignore'):
    error = strategy.prefix_sum_error(steps, momentum)
    if steps_per_epoch is not None:
      error *= strategy.once_per_epoch_sensitivity(steps, steps_per_epoch)
  return math.log(error) if np.isfinite(error) and error > 0 else 1e3


@functools.lru_cache(maxsize=64)
def optimal_blt_parameters(buffers: int, steps: int, momentum: float = 0.0,
                           steps_per_epoch: Optional[int] = None
                           ) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
  """BLT decays and output scales minimizing the trajectory's error.

  Minimizes `prefix_sum_error(steps, momentum)` (for one participation), or
  with `steps_per_epoch` its product with `once_per_epoch_sensitivity`
  (the noise at a given epsilon when each example is in one step of every
  epoch), over decays in (0, 1) and positive output scales by L-BFGS
  (numerical gradient), from decays spread geometrically towards 1, as
  Dvijotham et al. (2024) and McMahan et al. (2024) optimize BLTs; cached
  per argument.
  """
  # 1 - theta_i from 1 / steps^(i / buffers): time scales over the run.
  gaps = steps ** (-np.arange(1, buffers + 1) / buffers)
  starts = [np.concatenate([special.logit(1.0 - 0.5 * gaps),
                            np.full(buffers, math.log(scale / buffers))])
            for scale in (0.1, 0.3, 1.0)]
  if buffers > 1:  # One buffer more than the best with one fewer.
    decays, scales = optimal_blt_parameters(buffers - 1, steps, momentum,
                                            steps_per_epoch)
    starts.append(np.concatenate([special.logit(decays), [0.0],
                                  np.log(scales), [math.log(1e-3)]]))
  best = min((optimize.minimize(_blt_loss, start,
                                args=(steps, momentum, steps_per_epoch),
                                method='L-BFGS-B', options={'maxiter': 500})
              for start in starts), key=lambda result: result.fun)
  return (tuple(float(v) for v in special.expit(best.x[:buffers])),
          tuple(float(v) for v in np.exp(best.x[buffers:])))


def blt(buffers: int, steps: int, momentum: float = 0.0,
        steps_per_epoch: Optional[int] = None) -> BufferedLinearToeplitz:
  """The BLT strategy for `steps` training steps.

  Args:
    buffers: the number of buffers `d >= 1`; each step keeps `d` tensors of
      the noised coordinates' size and reads and rewrites each once.
    steps: the number of training steps the error is optimized for.
    momentum: the optimizer's SGD momentum, in [0, 1), as in
      `banded_toeplitz`.
    steps_per_epoch: the steps of one pass over shuffled data, when the run
      has several: the error is then optimized at a given epsilon, with the
      sensitivity of one participation per epoch
      (`once_per_epoch_sensitivity`, what the accountant charges); None
      optimizes for one participation.

  Returns:
    A `BufferedLinearToeplitz` with `optimal_blt_parameters(buffers, steps,
    momentum, steps_per_epoch)`.

  Raises:
    ValueError: naming the argument that is not a positive integer, or a
      momentum outside [0, 1).
  """
  _check_positive_ints(buffers=buffers, steps=steps)
  if steps_per_epoch is not None:
    _check_positive_ints(steps_per_epoch=steps_per_epoch)
    steps_per_epoch = int(steps_per_epoch)
  return BufferedLinearToeplitz(*optimal_blt_parameters(
      int(buffers), int(steps), _checked_momentum(momentum), steps_per_epoch))


STRATEGIES = {cls.name: cls for cls in (BandedToeplitz,
                                         BufferedLinearToeplitz)}


def deserialize(description: Dict[str, Any]) -> ToeplitzStrategy:
  """A strategy from its `{'name': ..., 'config': ...}` description."""
  cls = STRATEGIES.get(description.get('name'))
  if cls is None:
    raise ValueError(f'unknown noise correlation {description!r}')
  return cls(**description['config'])


def serialize(strategy: ToeplitzStrategy) -> Dict[str, Any]:
  return {'name': strategy.name, 'config': strategy.config}
