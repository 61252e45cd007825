"""The audit's statistics, checked on mechanisms whose epsilon is known."""

import math

import dp_accounting
import numpy as np
import pytest

from tfdpx.audit import bounds


def _binomial_tail(r, v, p):
  return sum(math.comb(r, k) * p**k * (1 - p)**(r - k) for k in range(v, r + 1))


@pytest.mark.parametrize('r,v,eps', [(10, 7, 0.5), (100, 90, 2.0),
                                     (50, 25, 0.0)])
def test_the_pure_dp_p_value_is_the_binomial_tail(r, v, eps):
  p = math.exp(eps) / (1 + math.exp(eps))
  assert bounds.one_run_p_value(1000, r, v, eps, 0.0) == pytest.approx(
      _binomial_tail(r, v, p), rel=1e-9)


def test_the_delta_term_is_the_theorems():
  # Steinke et al., approximate DP: 2 m delta max_i P[v - i <= Bin(r, p) < v] / i.
  m, r, v, eps, delta = 1000, 40, 35, 1.0, 1e-4
  p = 1 / (1 + math.exp(-eps))
  pmf = [math.comb(r, k) * p**k * (1 - p)**(r - k) for k in range(r + 1)]
  weight = max(sum(pmf[v - i:v]) / i for i in range(1, v + 1))
  assert bounds.one_run_p_value(m, r, v, eps, delta) == pytest.approx(
      _binomial_tail(r, v, p) + 2 * m * delta * weight, rel=1e-9)


def _randomized_response(rng, m, eps):
  """Scores of m canaries from eps-DP randomized response of each bit."""
  included = rng.random(m) < 0.5
  truthful = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
  reported = np.where(truthful, included, ~included)
  return reported + 0.01 * rng.random(m), included


def test_one_run_bound_holds_at_its_confidence_on_randomized_response():
  # eps-DP randomized response is exactly eps-DP: the bound may exceed eps
  # in at most 5% of audits (a binomial count of 200, with slack).
  rng = np.random.default_rng(0)
  eps = 1.0
  above = sum(
      bounds.one_run_audit(*_randomized_response(rng, 1000, eps),
                           delta=0.0)['epsilon_lower_bound'] > eps
      for _ in range(200))
  assert above <= 0.05 * 200 + 3 * math.sqrt(200 * 0.05 * 0.95)


def test_one_run_bound_is_nearly_tight_with_many_canaries():
  rng = np.random.default_rng(1)
  found = bounds.one_run_audit(*_randomized_response(rng, 100_000, 2.0),
                               delta=0.0)
  assert 1.9 < found['epsilon_lower_bound'] <= 2.0
  assert found['num_guesses'] == 100_000


def test_a_useless_attack_proves_nothing():
  rng = np.random.default_rng(2)
  scores, included = rng.random(1000), rng.random(1000) < 0.5
  assert bounds.one_run_audit(scores, included,
                              delta=1e-5)['epsilon_lower_bound'] < 0.3
  assert bounds.one_run_epsilon_lower_bound(1000, 100, 50, delta=0) == 0


def test_delta_lowers_the_bound():
  without = bounds.one_run_epsilon_lower_bound(1000, 200, 190, delta=0)
  with_delta = bounds.one_run_epsilon_lower_bound(1000, 200, 190, delta=1e-3)
  assert 0 < with_delta < without


def test_guesses_count_top_as_in_and_bottom_as_out():
  scores = np.array([5, 4, 3, 2, 1, 0.0])
  included = np.array([True, False, True, False, True, False])
  # Top 2: 5 (in, right), 4 (out, wrong); bottom 2: 0 (out, right),
  # 1 (in, wrong).
  assert bounds.guesses(scores, included, 4) == (4, 2)
  with pytest.raises(ValueError, match='num_guesses'):
    bounds.guesses(scores, included, 8)


def gaussian_mechanism_epsilon(shift, delta):
  """Exact epsilon of the Gaussian mechanism, sensitivity `shift`, std 1."""
  accountant = dp_accounting.pld.PLDAccountant()
  accountant.compose(dp_accounting.GaussianDpEvent(1 / shift))
  return accountant.get_epsilon(delta)


def test_two_run_bound_holds_and_detects_a_gaussian():
  rng = np.random.default_rng(3)
  shift, delta = 3.0, 1e-5
  true_eps = gaussian_mechanism_epsilon(shift, delta)
  found = [bounds.two_run_epsilon_lower_bound(
      rng.normal(shift, 1, 1000), rng.normal(0, 1, 1000), delta=delta)
           for _ in range(40)]
  eps = np.array([f['epsilon_lower_bound'] for f in found])
  assert np.sum(eps > true_eps) <= 0.05 * 40 + 3 * math.sqrt(40 * 0.05)
  assert np.median(eps) > 1.5
  # Nothing to detect: the same distribution in and out.
  nothing = bounds.two_run_epsilon_lower_bound(
      rng.normal(0, 1, 1000), rng.normal(0, 1, 1000), delta=delta)
  assert nothing['epsilon_lower_bound'] < 0.3


def test_several_attacks_share_the_confidence():
  """A dict of scores is one attack per score and fraction (Bonferroni):
  a useless second score costs the first some of its bound, never adds."""
  rng = np.random.default_rng(4)
  scores, included = _randomized_response(rng, 1000, 2.0)
  alone = bounds.one_run_audit(scores, included, delta=1e-5)
  named = bounds.one_run_audit({'rr': scores}, included, delta=1e-5)
  assert named['epsilon_lower_bound'] == alone['epsilon_lower_bound']
  assert named['score'] == 'rr' and alone['score'] is None
  both = bounds.one_run_audit({'rr': scores, 'noise': rng.random(1000)},
                              included, delta=1e-5)
  assert both['score'] == 'rr'
  assert 0 < both['epsilon_lower_bound'] < alone['epsilon_lower_bound']


def test_the_ceiling_is_the_bound_of_all_guesses_right():
  """The one-run ceiling is the largest all-correct bound over the attack
  sizes (1,000 canaries: 5.24, all guessed, as docs/auditing.md says); the
  two-run one that of a perfect separation (2.57 for 100 + 100 runs)."""
  rng = np.random.default_rng(5)
  included = rng.random(1000) < 0.5
  perfect = bounds.one_run_audit(included + 0.01 * rng.random(1000), included,
                                 delta=1e-5)
  assert perfect['ceiling'] == pytest.approx(5.24, abs=0.01)
  # Not 1,000 right: the halves guessed "in" and "out" are not the split.
  assert 4.5 < perfect['epsilon_lower_bound'] <= perfect['ceiling']
  noise = bounds.one_run_audit(rng.random(1000), included, delta=1e-5)
  assert noise['ceiling'] == perfect['ceiling']
  two = bounds.two_run_epsilon_lower_bound(np.arange(100) + 1000.0,
                                           np.arange(100.0), delta=1e-5)
  assert two['ceiling'] == pytest.approx(2.57, abs=0.01)
  assert two['epsilon_lower_bound'] == pytest.approx(two['ceiling'])
