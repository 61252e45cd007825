r"""The f-DP one-run bound (Mahloujifar, Melis, Chaudhuri 2024).

The game is Steinke et al.'s (`bounds`): m canaries, each included
independently with probability 1/2, one training run, r guesses (a number
fixed in advance) and v of them correct. The hypothesis is now a whole
tradeoff curve f: "the run is f-DP for adding or removing one record". A
hypothesis is given by its *inverse blow-up* `B^{-1}(y)`: an event of
probability y under one neighbour's output has probability at least
`B^{-1}(y)` under the other's (`B = 1 - f` is the blow-up; f convex makes B
concave).

Our reading of the bound. Let N be the number of correct guesses,
`p_l = P[N = l]`, and for i = 0..r

    a_i = E[N 1{N >= i}] / m          (right guesses in runs with >= i right)
    b_i = E[(r - N) 1{N >= i}] / m    (wrong guesses in the same runs)

so `a_0 + b_0 = r / m`. Take canary j and fix the other canaries' inclusion.
A right guess on j in a run with at least i right guesses is, on the same
output, a wrong guess on j in a run with at least i - 1 right guesses once
j's inclusion is flipped. f-DP for j, then Jensen's inequality over the
other canaries and over j (B concave), give

    b_{i-1} >= B^{-1}(a_i)    for i = 1..r.                            (1)

Suppose `P[N >= v] >= tau`. Moving the mass above v down to v keeps (1) for
i <= v and the total mass, so take `a_v = v tau / m`, `b_v = (r - v) tau / m`
(the least these can be). Going down from v with the least `b_{i-1}` that
(1) and `b_{i-1} >= b_i` allow,

    b_{i-1} = max(b_i, B^{-1}(a_i)),
    a_{i-1} = a_i + (i - 1) / (r - i + 1) * (b_{i-1} - b_i),

bounds every true `a_i`, `b_i` from below (by induction, the excess of a_i
is at least `i / (r - i)` times that of b_i, both non-negative). If the
bounds end with `a_0 + b_0 > r / m`, no f-DP run reaches v correct guesses
with probability tau: v rejects f at level tau.

Hypotheses (`Hypothesis`, vectorized over a parameter):
  * `gaussian(mu)`: mu-GDP, `B^{-1}(y) = Phi(Phi^{-1}(y) - mu)`. Its lower
    bound on mu is the paper's "empirical privacy"; `gaussian_epsilon`
    turns mu into the epsilon at delta of a mu-GDP mechanism, a lower bound
    on the run's epsilon only if its tradeoff curve is Gaussian-shaped.
  * `approximate_dp(epsilon, delta)`: (epsilon, delta)-DP; valid for every
    mechanism.
  * `privacy_profile(epsilons, deltas)`: the curve of a privacy profile
    (the accountant's claim: `claimed_profile`), every line
    `y <= e^eps x + delta(eps)` and its mirror image.
"""

import math
from typing import Callable, Sequence

import dp_accounting
import numpy as np
from scipy import optimize
from scipy import special

# An inverse blow-up: probabilities in [0, 1] -> probabilities; its
# argument broadcasts against the hypothesis' parameters.
Hypothesis = Callable[[np.ndarray], np.ndarray]


def gaussian(mu) -> Hypothesis:
  """mu-GDP (Dong, Roth, Su 2019): `Phi(Phi^{-1}(y) - mu)`."""
  mu = np.asarray(mu, np.float64)
  return lambda y: special.ndtr(special.ndtri(y) - mu)


def _below_lines(y, growth, delta):
  """The least probability that (eps, delta)-DP, `growth = e^eps`, allows
  where the other neighbour's is y: `y <= e^eps x + delta` and its mirror
  image `1 - y >= e^-eps (1 - x - delta)`."""
  return np.maximum(0.0, np.maximum((y - delta) / growth,
                                    1 - delta - growth * (1 - y)))


def approximate_dp(epsilon, delta: float) -> Hypothesis:
  """(epsilon, delta)-DP: `max(0, (y - delta) e^-eps, 1 - delta - e^eps (1 - y))`."""
  growth = np.exp(np.asarray(epsilon, np.float64))
  return lambda y: _below_lines(y, growth, delta)


def privacy_profile(epsilons: Sequence[float],
                    deltas: Sequence[float]) -> Hypothesis:
  """The tradeoff curve of `(epsilon_k, delta_k)`-DP for every k at once.

  A curve from finitely many of a mechanism's lines lies below its true
  one, so a test of it is conservative. One hypothesis (no parameter).
  """
  growth = np.exp(np.asarray(epsilons, np.float64))
  deltas = np.asarray(deltas, np.float64)
  if growth.shape != deltas.shape or growth.ndim != 1:
    raise ValueError('epsilons and deltas must be 1-D and of one length')

  return lambda y: np.max(
      _below_lines(np.asarray(y, np.float64)[..., None], growth, deltas),
      axis=-1)


_PROFILES = {}  # claimed_profile's, by (repr(event), num_epsilons)


def claimed_profile(event: dp_accounting.DpEvent, *,
                    num_epsilons: int = 100) -> Hypothesis:
  """The tradeoff curve that `event` claims, from dp_accounting's PLD.

  Its deltas are pessimistic (at least the true ones: a coarse
  discretization, 1e-2), and it keeps `num_epsilons` lines from 0 to the
  epsilon at delta 1e-12: each makes the curve lower, the test of it more
  conservative. Profiles are kept by the event's repr (DpEvents holding
  lists are unhashable): repeated audits of one setting build one.
  """
  key = (repr(event), num_epsilons)
  if key not in _PROFILES:
    accountant = dp_accounting.pld.PLDAccountant(
        value_discretization_interval=1e-2)
    accountant.compose(event)
    top = accountant.get_epsilon(1e-12)
    if math.isinf(top):  # Not private: it claims nothing (delta 1 at eps 0).
      _PROFILES[key] = privacy_profile([0.0], [1.0])
    else:
      epsilons = np.linspace(0.0, top, num_epsilons)
      _PROFILES[key] = privacy_profile(
          epsilons, [accountant.get_delta(e) for e in epsilons])
  return _PROFILES[key]


def rejects(hypothesis: Hypothesis, num_canaries: int, num_guesses: int,
            num_correct: int, *, level: float) -> np.ndarray:
  """Where `num_correct` of `num_guesses` rejects `hypothesis` at `level`.

  Returns:
    A bool array over the hypothesis' parameters: True where no run that
    satisfies it has `num_correct` or more right with probability `level`.
  """
  m, r, v = num_canaries, num_guesses, num_correct
  if not 0 <= v <= r <= m or r < 1:
    raise ValueError(f'need 0 <= num_correct <= num_guesses <= '
                     f'num_canaries and num_guesses >= 1, got {v}, {r}, {m}')
  if not 0 < level < 1:
    raise ValueError(f'level must be in (0, 1), got {level!r}')
  zeros = np.zeros_like(hypothesis(np.float64(0.5)))  # the parameters' shape
  right = zeros + v * level / m
  wrong = zeros + (r - v) * level / m
  for i in range(v, 0, -1):
    least = np.maximum(wrong, hypothesis(np.minimum(right, 1.0)))
    if np.all(least == wrong):
      break  # (1) holds as it is: nothing changes further down.
    right = right + (i - 1) / (r - i + 1) * (least - wrong)
    wrong = least
    if np.all(right + wrong > r / m):
      break  # Rejected everywhere; the sums only grow.
  return right + wrong > r / m


def largest_rejected(rejected: Callable[[np.ndarray], np.ndarray], *,
                     high: float, limit: float = 1e3, points: int = 257,
                     rounds: int = 2) -> float:
  """The largest parameter that `rejected` (True below a threshold) rejects.

  A grid of `points` from 0 to `high` (doubled while its top is rejected,
  up to `limit`; `inf` beyond), then `rounds - 1` finer grids between the
  last rejected point and the next. The result is rejected: it errs low.
  """
  low = 0.0
  while True:
    grid = np.linspace(low, high, points)
    inside = rejected(grid)
    if not inside[0]:
      return 0.0
    if not inside[-1]:
      break
    low, high = high, 2 * high
    if high > limit:
      return math.inf
  for _ in range(rounds - 1):
    last = int(np.flatnonzero(inside)[-1])  # rejected below a threshold
    grid = np.linspace(grid[last], grid[last + 1], points)
    inside = rejected(grid)
  return float(grid[np.flatnonzero(inside)[-1]])


def gaussian_mu_lower_bound(num_canaries: int, num_guesses: int,
                            num_correct: int, *, level: float) -> float:
  """The largest mu for which the run is rejected as mu-GDP."""
  return largest_rejected(lambda mu: rejects(
      gaussian(mu), num_canaries, num_guesses, num_correct, level=level),
                          high=8.0)


def epsilon_lower_bound(num_canaries: int, num_guesses: int,
                        num_correct: int, *, delta: float,
                        level: float) -> float:
  """The largest epsilon for which the run is rejected as (eps, delta)-DP."""
  return largest_rejected(lambda eps: rejects(
      approximate_dp(eps, delta), num_canaries, num_guesses, num_correct,
      level=level), high=32.0)


def gaussian_epsilon(mu: float, delta: float) -> float:
  """The epsilon at `delta` of mu-GDP (Dong, Roth, Su, Corollary 2.13):
  `delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)`."""
  if mu <= 0:
    return 0.0
  if math.isinf(mu) or delta <= 0:
    return math.inf  # No mu-GDP mechanism with mu > 0 is pure DP.

  def log_excess(eps):  # log delta(eps) - log delta, decreasing in eps
    high = special.log_ndtr(-eps / mu + mu / 2)
    low = eps + special.log_ndtr(-eps / mu - mu / 2)
    return high + np.log1p(-np.exp(min(low - high, 0.0))) - math.log(delta)

  if log_excess(0.0) <= 0:
    return 0.0
  top = 1.0
  while log_excess(top) > 0:
    top *= 2
  return float(optimize.brentq(log_excess, 0.0, top, xtol=1e-9))
