"""Lower bounds on epsilon from an attacker's guesses about canaries.

Tests of the null hypothesis "the training run is (eps, delta)-DP", rejected
at a confidence level; the largest rejected eps is the lower bound. The
f-DP one-run test, of whole tradeoff curves, is `fdp_bounds`;
`one_run_audit` reports both.

* One run (Steinke, Nasr, Jagielski 2023): m canaries, each included
  independently with probability 1/2; the attacker guesses in or out for r of
  them and abstains on the rest. Under (eps, delta)-DP the number of correct
  guesses is at most Binomial(r, e^eps / (1 + e^eps)) plus a term in delta
  (their theorem for approximate DP), whatever the canaries' dependence
  through training.
* Two runs (classic: Jagielski et al. 2020, Nasr et al. 2021): independent
  trials with and without one canary, a threshold on the attacker's score,
  and Clopper-Pearson bounds on its false positive and false negative rates:
  `eps >= log((1 - delta - FNR) / FPR)`.
"""

import functools
import math
from typing import Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from tfdpx.audit import fdp_bounds


def one_run_p_value(num_canaries: int, num_guesses: int, num_correct: int,
                    epsilon: float, delta: float) -> float:
  """Probability of `num_correct` or more correct guesses under (eps, delta)-DP.

  Args:
    num_canaries: m, the canaries, each included with probability 1/2.
    num_guesses: r <= m, the guesses made (the rest are abstentions).
    num_correct: v <= r, the correct guesses.
    epsilon, delta: the DP guarantee of the null hypothesis.

  Returns:
    An upper bound on the p-value (at most 1).
  """
  m, r, v = num_canaries, num_guesses, num_correct
  if not 0 <= v <= r <= m:
    raise ValueError(f'need 0 <= num_correct <= num_guesses <= num_canaries, '
                     f'got {v}, {r}, {m}')
  accuracy = 1 / (1 + math.exp(-epsilon))  # eps-DP randomized response
  tail = stats.binom.sf(v - 1, r, accuracy)  # P[Binomial(r, p) >= v]
  if delta == 0 or v == 0:
    return min(1.0, tail)
  # The delta term: max over i of P[v - i <= Binomial(r, p) < v] / i.
  below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, accuracy)
  delta_weight = np.max(np.cumsum(below) / np.arange(1, v + 1))
  return min(1.0, tail + 2 * m * delta * delta_weight)


def one_run_epsilon_lower_bound(num_canaries: int, num_guesses: int,
                                num_correct: int, *, delta: float,
                                confidence: float = 0.95) -> float:
  """The largest eps that `num_correct` of `num_guesses` rejects.

  The bound holds with probability `confidence` over the canaries' random
  inclusion and the training run: 0 if even eps = 0 is not rejected.
  """
  p = 1 - confidence

  def rejected(eps):
    return one_run_p_value(num_canaries, num_guesses, num_correct, eps,
                           delta) < p

  if not rejected(0.0):
    return 0.0
  lo, hi = 0.0, 1.0
  while rejected(hi):
    lo, hi = hi, 2 * hi
    if hi > 1e3:
      return math.inf
  for _ in range(40):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
  return lo


def guesses(scores: Sequence[float], included: Sequence[bool],
            num_guesses: int) -> Tuple[int, int]:
  """`(guesses, correct)`: "in" for the top half, "out" for the bottom half.

  The `num_guesses // 2` highest-scoring canaries are guessed included and as
  many lowest-scoring ones excluded; ties are broken at random.
  """
  scores = np.asarray(scores, np.float64)
  included = np.asarray(included, bool)
  half = num_guesses // 2
  if not 0 < 2 * half <= len(scores):
    raise ValueError(f'num_guesses must be in [2, {len(scores)}], got '
                     f'{num_guesses}')
  order = np.lexsort((np.random.default_rng().random(len(scores)), scores))
  correct = np.sum(~included[order[:half]]) + np.sum(included[order[-half:]])
  return 2 * half, int(correct)


# The attacks' sizes, as shares of the canaries: each costs the others
# confidence; these did best in simulated audits of DP-SGD, half its noise
# and no sampling (docs/auditing.md).
GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.5, 1.0)


def one_run_audit(scores, included: Sequence[bool], *,
                  delta: float, confidence: float = 0.95,
                  guess_fractions: Sequence[float] = GUESS_FRACTIONS,
                  claim: Optional[fdp_bounds.Hypothesis] = None) -> dict:
  """The one-run lower bounds from canary scores (higher: more likely in).

  Each score (one array, or a dict of named arrays: several attacks) and
  each fraction of the canaries is one attack (`guesses`). Each statement
  below holds at `confidence` on its own: its tests share
  `1 - confidence` equally (Bonferroni), so the best attack's is valid.

  * `epsilon_lower_bound`: the run is not (eps, delta)-DP for a smaller
    eps. Per attack, Steinke et al.'s test (`one_run_epsilon_lower_bound`)
    and the f-DP test of (eps, delta)-DP (`fdp_bounds`): two tests an
    attack. It holds for every mechanism.
  * `gaussian_mu_lower_bound`: the run is not mu-GDP for a smaller mu (the
    f-DP test, Mahloujifar et al. 2024); `gaussian_epsilon` is the epsilon
    at `delta` of a mechanism that is exactly that mu-GDP: a lower bound on
    the run's epsilon when its tradeoff curve is Gaussian-shaped (the
    paper's empirical epsilon), not for every mechanism.
  * `claim_rejected` (given `claim`, e.g. `fdp_bounds.claimed_profile` of
    the accountant's event): whether the run is shown not to satisfy the
    tradeoff curve it claims, a test of the whole curve, not only of its
    epsilon at delta. None without a claim.

  Returns:
    A dict: the statements above; the attack of `epsilon_lower_bound`:
    `score` (its name; None for a single array), `num_guesses`,
    `num_correct`, `test` ('steinke' or 'f-dp'); and the ceilings
    `ceiling` and `gaussian_ceiling`, the largest `epsilon_lower_bound` and
    `gaussian_epsilon` these attacks could give (every guess right): a
    bound far below its ceiling is a step's privacy or the attack's lack of
    power, one near it may be either.
  """
  named = scores if isinstance(scores, dict) else {None: scores}
  attacks = []  # (name, canaries, guesses, correct)
  for name, values in named.items():
    for fraction in guess_fractions:
      r, v = guesses(values, included, max(2, int(fraction * len(values))))
      attacks.append((name, len(values), r, v))
  # Steinke's and the f-DP (eps, delta) test share half of alpha per attack
  # each; the mu-GDP test and the claim test have the whole per attack.
  gaussian_level = (1 - confidence) / len(attacks)
  steinke_confidence, fdp_level = 1 - gaussian_level / 2, gaussian_level / 2
  best = {'epsilon_lower_bound': -1.0}
  mu = 0.0
  for name, m, r, v in attacks:
    eps, test = _epsilon_bound(m, r, v, delta, steinke_confidence, fdp_level)
    if eps > best['epsilon_lower_bound']:
      best = {'epsilon_lower_bound': eps, 'score': name, 'num_guesses': r,
              'num_correct': v, 'test': test}
    mu = max(mu, fdp_bounds.gaussian_mu_lower_bound(m, r, v,
                                                    level=gaussian_level))
  # Every guess right; the bounds grow with the guesses' number, but not
  # monotonically in their share: each size is tried once.
  perfect = [_all_right(m, r, delta, steinke_confidence, fdp_level,
                        gaussian_level)
             for m, r in sorted({(m, r) for _, m, r, _ in attacks})]
  rejected = None
  if claim is not None:
    rejected = any(bool(fdp_bounds.rejects(claim, m, r, v,
                                           level=gaussian_level))
                   for _, m, r, v in attacks)
  return {**best,
          'ceiling': max(eps for eps, _ in perfect),
          'gaussian_mu_lower_bound': mu,
          'gaussian_epsilon': fdp_bounds.gaussian_epsilon(mu, delta),
          'gaussian_ceiling': fdp_bounds.gaussian_epsilon(
              max(mu for _, mu in perfect), delta),
          'claim_rejected': rejected}


def _epsilon_bound(m, r, v, delta, steinke_confidence, fdp_level):
  """The better of Steinke's and the f-DP (eps, delta) bound, and its name."""
  return max(
      (one_run_epsilon_lower_bound(m, r, v, delta=delta,
                                   confidence=steinke_confidence), 'steinke'),
      (fdp_bounds.epsilon_lower_bound(m, r, v, delta=delta, level=fdp_level),
       'f-dp'))


@functools.lru_cache(maxsize=256)  # The same for every audit of a setting.
def _all_right(m, r, delta, steinke_confidence, fdp_level, gaussian_level):
  """`(epsilon bound, mu bound)` of r right guesses of r."""
  return (_epsilon_bound(m, r, r, delta, steinke_confidence, fdp_level)[0],
          fdp_bounds.gaussian_mu_lower_bound(m, r, r, level=gaussian_level))


def _rate_upper_bounds(errors: np.ndarray, trials: int,
                       alpha: float) -> np.ndarray:
  """One-sided Clopper-Pearson upper bounds on rates, level `1 - alpha`."""
  errors = np.asarray(errors)
  bound = stats.beta.ppf(1 - alpha, errors + 1,
                         np.maximum(trials - errors, 1))
  return np.where(errors >= trials, 1.0, bound)


def two_run_epsilon_lower_bound(in_scores: Sequence[float],
                                out_scores: Sequence[float], *, delta: float,
                                confidence: float = 0.95) -> dict:
  """The classic bound from independent runs with and without a canary.

  The attack guesses "with" when the score is at least a threshold. The
  threshold is chosen on the first half of each list of scores and the
  rates are bounded on the second half, so the choice costs no confidence.
  Both rates' bounds hold together at `confidence` (union bound).

  Returns:
    A dict: `epsilon_lower_bound`, `threshold`, the upper bounds
    `false_positive_rate`, `false_negative_rate`, and `ceiling` (the bound
    of a perfect separation).
  """
  ins = np.asarray(in_scores, np.float64)
  outs = np.asarray(out_scores, np.float64)
  if min(len(ins), len(outs)) < 4:
    raise ValueError('need at least 4 runs with and 4 without the canary')
  alpha = (1 - confidence) / 2

  def bounds_at(thresholds, ins, outs):
    false_positives = len(outs) - np.searchsorted(outs, thresholds, 'left')
    false_negatives = np.searchsorted(ins, thresholds, 'left')
    fpr = _rate_upper_bounds(false_positives, len(outs), alpha)
    fnr = _rate_upper_bounds(false_negatives, len(ins), alpha)
    eps = np.log(np.maximum(1 - delta - fnr, 1e-300) / fpr)
    return np.maximum(eps, 0.0), fpr, fnr

  # Runs are independent: the halves in run order are independent too.
  fit_in, test_in = (np.sort(h) for h in np.array_split(ins, 2))
  fit_out, test_out = (np.sort(h) for h in np.array_split(outs, 2))
  candidates = np.unique(np.concatenate([fit_in, fit_out]))
  threshold = candidates[np.argmax(bounds_at(candidates, fit_in, fit_out)[0])]
  eps, fpr, fnr = (float(v) for v in bounds_at(threshold, test_in, test_out))
  # Perfect separation of the rate-bounding halves.
  perfect_fpr, perfect_fnr = (float(_rate_upper_bounds(0, len(h), alpha))
                              for h in (test_out, test_in))
  return {'epsilon_lower_bound': eps, 'threshold': float(threshold),
          'false_positive_rate': fpr, 'false_negative_rate': fnr,
          'ceiling': max(0.0, math.log((1 - delta - perfect_fnr) /
                                       perfect_fpr))}
