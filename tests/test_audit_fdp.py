"""The f-DP one-run bound, checked against a linear program, mechanisms of
known privacy and dp_accounting."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import optimize

from tests.test_audit_bounds import gaussian_mechanism_epsilon
from tfdpx.audit import bounds
from tfdpx.audit import fdp_bounds


def _smallest_rejecting_level(hypothesis, m, r, v):
  """The least level at which v of r rejects: the bound on P[N >= v]."""
  low, high = 1e-12, 1.0
  for _ in range(60):
    middle = math.sqrt(low * high)
    if fdp_bounds.rejects(hypothesis, m, r, v, level=middle):
      high = middle
    else:
      low = middle
  return high


def _linear_program_tail(epsilon, delta, m, r, v):
  """max P[N >= v] over distributions of N that satisfy (1) of
  `fdp_bounds` for (epsilon, delta)-DP, whose two lines make (1) linear."""
  growth, count = math.exp(epsilon), np.arange(r + 1)

  def right(i):  # a_i as a row over p_0..p_r
    return np.where(count >= i, count / m, 0.0)

  def wrong(i):  # b_i
    return np.where(count >= i, (r - count) / m, 0.0)

  rows, limits = [], []
  for i in range(1, r + 1):
    rows += [right(i) / growth - wrong(i - 1), growth * right(i) - wrong(i - 1)]
    limits += [delta / growth, growth - 1 + delta]
  found = optimize.linprog(-(count >= v).astype(float), A_ub=np.array(rows),
                           b_ub=limits, A_eq=np.ones((1, r + 1)), b_eq=[1],
                           bounds=[(0, None)] * (r + 1), method='highs')
  assert found.success
  return -found.fun


@pytest.mark.parametrize('epsilon,delta,m,r,v', [
    (1.0, 0.0, 100, 20, 16), (0.5, 1e-3, 50, 30, 22), (2.0, 1e-2, 40, 10, 9),
    (1.0, 1e-5, 1000, 60, 50)])
def test_the_recursion_is_the_linear_programs_optimum(epsilon, delta, m, r,
                                                      v):
  """The recursion's least rejecting level is the largest P[N >= v] that
  the constraints allow, as HiGHS finds it."""
  tail = _linear_program_tail(epsilon, delta, m, r, v)
  hypothesis = fdp_bounds.approximate_dp(epsilon, delta)
  assert fdp_bounds.rejects(hypothesis, m, r, v, level=tail * 1.001)
  assert not fdp_bounds.rejects(hypothesis, m, r, v, level=tail * 0.999)


def _binomial_tail(r, v, p):
  return sum(math.comb(r, k) * p**k * (1 - p)**(r - k) for k in range(v, r + 1))


@pytest.mark.parametrize('epsilon,r,v', [(0.5, 20, 17), (0.5, 200, 160),
                                         (1.0, 20, 17), (1.0, 200, 160)])
def test_the_bound_holds_and_is_near_the_tail_of_randomized_response(
    epsilon, r, v):
  """eps-DP randomized response of each canary's bit makes N exactly
  Binomial(r, e^eps / (1 + e^eps)): the bound on P[N >= v] must be at least
  that tail, and is within 20% of it here."""
  exact = _binomial_tail(r, v, 1 / (1 + math.exp(-epsilon)))
  bound = _smallest_rejecting_level(
      fdp_bounds.approximate_dp(epsilon, 0.0), 1000, r, v)
  assert exact <= bound <= 1.2 * exact


@pytest.mark.parametrize('mu,delta', [(0.5, 1e-5), (1.0, 1e-5), (3.0, 1e-3)])
def test_gaussian_epsilon_is_the_gaussian_mechanisms(mu, delta):
  # The Gaussian mechanism of sensitivity mu and std 1 is exactly mu-GDP.
  assert fdp_bounds.gaussian_epsilon(mu, delta) == pytest.approx(
      gaussian_mechanism_epsilon(mu, delta), rel=2e-3)


def _gaussian_scores(rng, m, mu):
  """Each canary's score N(mu, 1) if included, N(0, 1) if not: mu-GDP."""
  included = rng.random(m) < 0.5
  return rng.standard_normal(m) + mu * included, included


def test_gdp_bound_holds_at_its_confidence_and_comes_near_mu():
  """Over 100 audits of a mu-GDP release, mu's lower bound exceeds mu in at
  most 5% (with binomial slack); with 100,000 canaries and 1,000 guesses it
  is within 30% of mu."""
  rng = np.random.default_rng(0)
  mu = 1.0
  above = sum(bounds.one_run_audit(*_gaussian_scores(rng, 1000, mu),
                                   delta=1e-5)['gaussian_mu_lower_bound'] > mu
              for _ in range(100))
  assert above <= 0.05 * 100 + 3 * math.sqrt(100 * 0.05 * 0.95)
  many = bounds.one_run_audit(*_gaussian_scores(rng, 100_000, mu),
                              delta=1e-5, guess_fractions=(0.01,))
  assert 0.7 * mu < many['gaussian_mu_lower_bound'] <= mu


def test_a_claimed_curve_is_rejected_only_when_the_release_exceeds_it():
  """The curve of a Gaussian mechanism from dp_accounting: a release that
  satisfies it is rejected in at most 5% of audits; one at twice its mu
  (half its noise) in most."""
  rng = np.random.default_rng(1)
  claim = fdp_bounds.claimed_profile(dp_accounting.GaussianDpEvent(1.0))

  def rejected(mu):
    return bounds.one_run_audit(*_gaussian_scores(rng, 1000, mu), delta=1e-5,
                                claim=claim)['claim_rejected']

  assert sum(rejected(1.0) for _ in range(60)) <= 3 + 3 * math.sqrt(2.85)
  assert sum(rejected(2.0) for _ in range(10)) >= 8


def test_a_release_that_claims_no_privacy_is_never_rejected():
  claim = fdp_bounds.claimed_profile(dp_accounting.NonPrivateDpEvent())
  assert not fdp_bounds.rejects(claim, 1000, 100, 100, level=0.05)
  strict = fdp_bounds.claimed_profile(dp_accounting.GaussianDpEvent(10.0))
  assert fdp_bounds.rejects(strict, 1000, 100, 100, level=0.05)


def test_more_right_guesses_reject_more():
  mus = np.linspace(0.0, 4.0, 41)
  previous = np.zeros_like(mus, bool)
  for v in range(50, 101, 5):
    now = fdp_bounds.rejects(fdp_bounds.gaussian(mus), 1000, 100, v,
                             level=0.05)
    assert np.all(now >= previous)
    previous = now
  assert previous[0] and not previous[-1]


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match='num_correct'):
    fdp_bounds.rejects(fdp_bounds.gaussian(1.0), 10, 5, 6, level=0.05)
  with pytest.raises(ValueError, match='level'):
    fdp_bounds.rejects(fdp_bounds.gaussian(1.0), 10, 5, 4, level=0)
  with pytest.raises(ValueError, match='epsilons and deltas'):
    fdp_bounds.privacy_profile([0.0, 1.0], [0.1])
