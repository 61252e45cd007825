"""White-box canary scores from every step's release on each canary's coordinate.

A gradient canary (`canaries.GradientCanaries`) owns one coordinate that only
it moves: with SGD, step t's update of that coordinate is the release's
coordinate times `-learning_rate / denominator`, which the attacker of the
threat model sees (every release). Standardized by the noise's standard
deviation there, a step's value is `y_t ~ N(b_t mu, 1)`, with `b_t = 1` when
the canary was in step t's batch (probability q if it is in the data, never
if not) and `mu = 1 / z` for DP-SGD at noise multiplier z (its clipped
contribution is the clip norm, its noise `z` times it).

Each score is a function of the canary's own values only; higher means more
likely included. Any such score gives a valid one-run bound; these are the
ones that have power against the cases `tfdpx.audit.flaws` plants.
"""

import numpy as np
from scipy import linalg
from scipy import special


def releases(updates: np.ndarray, momentum: float) -> np.ndarray:
  """Each step's own release from the coordinate's changes: `[T, m] -> [T, m]`.

  SGD with momentum (Keras: `v_t = momentum v_{t-1} - lr g_t`, the weight
  moves by `v_t`) spreads a step's release over every later change; an
  attacker who knows the optimizer undoes it: `-lr g_t = v_t - momentum
  v_{t-1}`. With plain SGD (momentum 0) the changes are the releases.
  """
  if not 0 <= momentum < 1:
    raise ValueError(f'momentum must be in [0, 1), got {momentum!r}')
  updates = np.asarray(updates, np.float64)
  before = np.concatenate([np.zeros_like(updates[:1]), updates[:-1]])
  return updates - momentum * before


def matched(released: np.ndarray, strategy) -> np.ndarray:
  """Each step's matched filter under noise correlated by `strategy`:
  `[T, m] -> [T, m]`, `u_t = <C y, C e_t> / |C e_t|`.

  The releases are `y = x + C^-1 z` (`tfdpx.privatizers.correlated`, `C`
  the strategy's lower-triangular Toeplitz matrix over the T steps), so the
  attacker, who knows the strategy, whitens them: `C y = C x + z`, the
  steps' noise independent again. A participation at step t adds column t
  of `C` (norm at most 1, less in the last bands) times the clipped
  contribution, and `u_t`, the whitened releases' dot with that column's
  direction, is the most powerful score for it: in units of the noise's
  standard deviation `u_t ~ N(mu |C e_t|, 1)` for a canary in step t and in
  no other step within the bands around it, `N(0, 1)` for one in none.
  """
  released = np.asarray(released, np.float64)
  c = strategy.toeplitz_coefficients(released.shape[0])
  matrix = linalg.toeplitz(c, np.zeros_like(c))
  return (matrix.T @ (matrix @ released)) / np.linalg.norm(
      matrix, axis=0)[:, np.newaxis]


def total(updates: np.ndarray) -> np.ndarray:
  """The sum of the steps' values (with SGD, the final coordinate):
  `[T, m] -> [m]`.

  Most powerful for the Gaussian mechanism without sampling (q = 1).
  """
  return np.sum(updates, axis=0)


def likelihood_ratio(standardized: np.ndarray, mu: float, q: float,
                     groups: int = 1) -> np.ndarray:
  """`sum_t log(1 - q + q exp(mu y_t - mu^2 / 2))`: `[T, m] -> [m]`.

  The log-likelihood ratio of "in the data" (each step's batch holds the
  canary with probability q, independently) against "not in it", for
  independent Gaussian steps: by Neyman-Pearson the most powerful score for
  DP-SGD with Poisson sampling, where `total` is not when q < 1.

  With `groups` > 1, cyclic Poisson sampling: the canary's group g is a
  secret, uniform over the groups, and only steps `t = g mod groups` can
  hold it, each with probability q: the ratio is the mean over g of the
  ratios of g's steps (`log mean_g exp(sum_{t = g mod groups} ...)`).
  """
  if not 0 < q <= 1:
    raise ValueError(f'q must be in (0, 1], got {q!r}')
  y = np.asarray(standardized, np.float64)
  shifted = mu * y - mu**2 / 2
  per_step = np.logaddexp(np.log1p(-q) if q < 1 else -np.inf,
                          np.log(q) + shifted)
  per_group = np.array([np.sum(per_step[g::groups], axis=0)
                        for g in range(groups)])
  return special.logsumexp(per_group, axis=0) - np.log(groups)


def spread(updates: np.ndarray) -> np.ndarray:
  """The standard deviation of the steps' values: `[T, m] -> [m]`.

  Without a canary a coordinate moves by noise alone, with it by noise plus
  the canary's share in the steps that sampled it: more spread, and none at
  all when every step reuses one noise draw (`flaws` 'reused_noise').
  """
  return np.std(np.asarray(updates, np.float64), axis=0)

