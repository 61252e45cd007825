"""The white-box scores of the audit (`tfdpx.audit.scores`)."""

import numpy as np
import pytest
from scipy import stats

from tfdpx import correlation
from tfdpx.audit import scores


def test_the_likelihood_ratio_is_the_mixtures_over_the_null():
  rng = np.random.default_rng(0)
  mu, q = 1.3, 0.4
  y = rng.normal(size=(20, 7))
  mixture = (1 - q) * stats.norm.pdf(y) + q * stats.norm.pdf(y, loc=mu)
  direct = np.sum(np.log(mixture / stats.norm.pdf(y)), axis=0)
  np.testing.assert_allclose(scores.likelihood_ratio(y, mu, q), direct,
                             rtol=1e-12)


def test_the_likelihood_ratio_separates_better_than_the_total():
  """Neyman-Pearson on Poisson-sampled Gaussian steps: at small noise and
  q = 0.2, the sum of the steps loses to the likelihood ratio."""
  rng = np.random.default_rng(1)
  mu, q, steps, m = 3.0, 0.2, 20, 4000
  included = rng.random(m) < 0.5
  sampled = (rng.random((steps, m)) < q) & included
  y = rng.normal(size=(steps, m)) + mu * sampled

  def auc(score):
    return stats.mannwhitneyu(score[included], score[~included]).statistic / (
        included.sum() * (~included).sum())

  assert auc(scores.likelihood_ratio(y, mu, q)) > auc(scores.total(y)) + 0.01


def test_the_spread_is_zero_without_a_canary_when_noise_repeats():
  rng = np.random.default_rng(2)
  noise = rng.normal(size=5)  # One draw per coordinate, reused every step.
  shares = np.zeros((10, 5))
  shares[[1, 4, 7], 2] = 1.0  # Canary 2 sampled in three steps.
  spread = scores.spread(shares + noise)
  assert spread[2] > 0.4
  np.testing.assert_allclose(np.delete(spread, 2), 0.0, atol=1e-12)


def test_q_must_be_a_rate():
  with pytest.raises(ValueError, match='q'):
    scores.likelihood_ratio(np.zeros((2, 2)), 1.0, 0.0)


def test_releases_undo_keras_momentum():
  """Keras SGD with momentum: v_t = beta v_{t-1} - lr g_t, the weight moves
  by v_t. The releases recovered from the moves are -lr g_t."""
  rng = np.random.default_rng(3)
  beta, lr = 0.9, 0.1
  grads = rng.standard_normal((6, 4))
  velocity, moves = np.zeros(4), []
  for g in grads:
    velocity = beta * velocity - lr * g
    moves.append(velocity)
  np.testing.assert_allclose(scores.releases(np.array(moves), beta),
                             -lr * grads, rtol=1e-12)
  np.testing.assert_array_equal(scores.releases(grads, 0.0), grads)
  with pytest.raises(ValueError, match='momentum'):
    scores.releases(grads, 1.0)


def test_the_matched_filter_whitens_correlated_noise_and_finds_its_step():
  """Releases `C^-1 z` (noise alone) become `C^T z / |C e_t|`, independent
  N(0, 1) per step apart from the columns' overlaps; one participation at
  step t (no noise) gives `|C e_t|` at t, and at a step whose column it
  does not overlap, 0."""
  steps, m = 12, 20000
  strategy = correlation.banded_toeplitz(3, steps)
  c = strategy.toeplitz_coefficients(steps)
  matrix = np.array([[c[t - s] if t >= s else 0.0 for s in range(steps)]
                     for t in range(steps)])
  norms = np.linalg.norm(matrix, axis=0)
  z = np.random.default_rng(2).normal(size=(steps, m))
  u = scores.matched(np.linalg.solve(matrix, z), strategy)
  np.testing.assert_allclose(u, matrix.T @ z / norms[:, None], atol=1e-9)
  np.testing.assert_allclose(np.std(u, axis=1), 1.0, atol=0.05)
  for t in (0, 5, 11):
    alone = scores.matched(np.eye(steps)[:, [t]], strategy)[:, 0]
    assert alone[t] == pytest.approx(norms[t], rel=1e-12)
    far = [s for s in range(steps) if abs(s - t) >= 3]
    np.testing.assert_allclose(alone[far], 0.0, atol=1e-12)


def test_the_cyclic_likelihood_ratio_is_the_mixture_over_the_groups():
  """Under cyclic sampling over 3 groups the canary's group is a secret
  uniform draw: the ratio averages the groups' own ratios, each over its
  steps t = g mod 3; with one group it is the plain ratio."""
  rng = np.random.default_rng(3)
  mu, q = 0.8, 0.5
  y = rng.normal(size=(10, 5))
  mixture = (1 - q) * stats.norm.pdf(y) + q * stats.norm.pdf(y, loc=mu)
  ratio = mixture / stats.norm.pdf(y)
  direct = np.log(np.mean([np.prod(ratio[g::3], axis=0) for g in range(3)],
                          axis=0))
  np.testing.assert_allclose(scores.likelihood_ratio(y, mu, q, groups=3),
                             direct, rtol=1e-12)
  np.testing.assert_allclose(scores.likelihood_ratio(y, mu, q, groups=1),
                             np.sum(np.log(ratio), axis=0), rtol=1e-12)
