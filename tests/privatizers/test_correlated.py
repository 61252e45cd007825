"""Noise correlated across steps: its covariance, state and refusals."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import correlation
from tfdpx import privatizers
from tests import stats

SHAPES = [(200, 150), (60,)]


def _zeros(batch=3):
  return [tf.zeros((batch,) + s) for s in SHAPES]


def _noises(privatizer, steps, seed=7, state=None, first=0):
  """The released sums of zero gradients at steps `first..steps-1` (the
  noise alone), flattened, and the final state."""
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES]) if (
      state is None) else state
  out = []
  for step in range(first, steps):
    key = tf.constant([seed, step], tf.int64)
    noisy, state = privatizer.update(_zeros(), state, key)
    out.append(np.concatenate([n.numpy().ravel() for n in noisy]))
  return np.array(out), state


@pytest.mark.parametrize('strategy', [
    correlation.banded_toeplitz(3, 20),
    correlation.BufferedLinearToeplitz([0.8, 0.3], [0.5, 0.3])],
                         ids=['banded', 'blt'])
def test_noise_covariance_across_steps_is_that_of_the_strategy(strategy):
  """Two-sided: each coordinate's noise over 6 steps has covariance
  `(sigma C)^2 C^-1 C^-T`; the independent noise of DP-SGD, and the
  covariance of a strategy with other coefficients, are rejected."""
  noise_multiplier, l2_norm_clip, steps = 1.2, 0.5, 6
  privatizer = privatizers.correlated(
      privatizers.gaussian(l2_norm_clip, noise_multiplier), strategy)
  noises, _ = _noises(privatizer, steps)
  std = noise_multiplier * l2_norm_clip

  def matches(covariance):
    return _covariance_matches(noises / std, covariance)
  expected = strategy.noise_covariance(steps)
  assert matches(expected)
  assert not matches(np.eye(steps))
  other = correlation.BandedToeplitz([1.0, 0.6, 0.4]).noise_covariance(steps)
  assert not matches(other)
  assert not matches(expected * 1.03)
  assert not matches(expected / 1.03)


def test_resuming_from_the_state_continues_the_same_noise():
  """A run stopped after 3 steps and resumed from its state (as a
  checkpoint restores the optimizer's variables) releases what one
  uninterrupted run releases with the same keys."""
  for strategy in (correlation.banded_toeplitz(4, 20), correlation.blt(2, 20)):
    _check_resume(privatizers.correlated(privatizers.gaussian(1.0, 1.0),
                                         strategy))


def _check_resume(privatizer):
  whole, _ = _noises(privatizer, 7)
  first, state = _noises(privatizer, 3)
  saved = tf.nest.map_structure(lambda t: tf.constant(np.asarray(t)), state)
  rest, _ = _noises(privatizer, 7, state=saved, first=3)
  np.testing.assert_array_equal(np.concatenate([first, rest]), whole)
  fresh, _ = _noises(privatizer, 7, first=3)  # Without the history.
  assert not np.allclose(fresh, rest)


def test_dpdr_keeps_a_history_for_each_release():
  privatizer = privatizers.correlated(
      privatizers.dpdr(1.0, 1.0, decomposition_steps=3),
      correlation.banded_toeplitz(3, 20))
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES])
  perp, alpha = state['noise_history']
  assert [[w.shape for w in h] for h in perp] == [[s, s] for s in SHAPES]
  assert [[w.shape for w in h] for h in alpha] == [[(2,), (2,)]]
  _, state = _noises(privatizer, 2)
  assert np.any(state['noise_history'][1][0][0].numpy() != 0)


def test_gep_correlates_both_releases_on_a_kept_basis():
  """Two-sided, as for DP-SGD: GEP's residual noise and its lifted embedding
  noise (a basis kept over the run, spanned by the anchors e_0..e_1999) each
  have covariance across steps `std^2 C^-1 C^-T`, at their own std; the
  history holds both releases at their declared shapes."""
  size, k, steps, s1, s2, z = 4000, 2000, 6, 1.0, 0.5, 1.1
  strategy = correlation.banded_toeplitz(3, 20)
  privatizer = privatizers.correlated(
      privatizers.gep(k, s1, s2, z, num_groups=1, basis_refresh_steps=steps),
      strategy)
  state = privatizer.init([tf.Variable(tf.zeros([size]))])
  embedding, residual = state['noise_history']
  assert [[w.shape for w in h] for h in embedding] == [[(k,), (k,)]]
  assert [[w.shape for w in h] for h in residual] == [[(size,), (size,)]]
  anchors = [tf.eye(k, size)]
  noises = []
  for step in range(steps):
    noisy, state = privatizer.update(
        [tf.zeros([3, size])], state, tf.constant([5, step], tf.int64),
        public_grads=anchors)
    noises.append(noisy[0].numpy())
  noises = np.array(noises)
  sigma = 2**0.5 * z  # Each part's multiplier (the default split).
  expected = strategy.noise_covariance(steps)
  # In the anchors' span: residual plus embedding noise; outside: residual.
  for part, std in ((noises[:, :k], math.hypot(sigma * s1, sigma * s2)),
                    (noises[:, k:], sigma * s2)):
    assert _covariance_matches(part / std, expected)
    assert not _covariance_matches(part / std, np.eye(steps))
    assert not _covariance_matches(part / std, expected * 1.15)
    assert not _covariance_matches(part / std, expected / 1.15)


def _covariance_matches(noises, covariance):
  """Whitened by `covariance`, the steps' noises (`[steps, n]`) are
  independent N(0, 1): their pooled std and every cross-step correlation."""
  steps, n = noises.shape
  white = np.linalg.solve(np.linalg.cholesky(covariance), noises)
  cross = (white @ white.T / n)[~np.eye(steps, dtype=bool)]
  return (stats.std_matches(white, 1.0) and
          np.all(np.abs(cross) < stats.Z / math.sqrt(n)))


def test_gep_pads_an_embedding_clamped_to_its_anchors():
  """With fewer anchors than basis vectors GEP releases a shorter embedding;
  its correlated release is padded to the declared size and runs."""
  privatizer = privatizers.correlated(
      privatizers.gep(8, 1.0, 1.0, 1.0, num_groups=1, biased=True),
      correlation.blt(2, 20))
  state = privatizer.init([tf.Variable(tf.zeros([50]))])
  for step in range(2):
    with pytest.warns(UserWarning, match='clamped'):
      noisy, state = privatizer.update(
          [tf.ones([3, 50])], state, tf.constant([1, step], tf.int64),
          public_grads=[tf.random.normal([3, 50], seed=step)])
  (history,), = state['noise_history']
  assert [h.shape for h in history] == [(8,), (8,)]
  assert np.all(np.isfinite(noisy[0].numpy()))


def test_history_is_not_logged():
  privatizer = privatizers.correlated(
      privatizers.adaptive_clipping(privatizers.gaussian(1.0, 1.0),
                                    expected_batch_size=3),
      correlation.banded_toeplitz(2, 20))
  _, state = _noises(privatizer, 2)
  assert set(privatizer.logs(state)) == {'l2_norm_clip'}


@pytest.mark.parametrize('inner,reason', [
    (privatizers.d2p2(1.0, projection_ratio=0.5), 'd2p2 does not release'),
    (privatizers.geodp(1.0, 1.0), 'geodp does not release'),
    (privatizers.sparse_embeddings(privatizers.gaussian(1.0, 1.0)),
     'sparse_embeddings'),
    (privatizers.correlated(privatizers.gaussian(1.0, 1.0),
                            correlation.banded_toeplitz(2, 10)),
     'already correlated'),
])
def test_refuses_what_it_cannot_correlate(inner, reason):
  with pytest.raises(ValueError, match=reason):
    privatizers.correlated(inner, correlation.banded_toeplitz(2, 10))
  with pytest.raises(ValueError, match='strategy'):
    privatizers.correlated(privatizers.gaussian(1.0, 1.0), 'banded')


def test_a_step_must_draw_the_releases_it_declared():
  class Undeclared(privatizers.Gaussian):
    name = 'undeclared_test'

    def gaussian_release_shapes(self, params):
      return [[tf.TensorShape([1])]]

  privatizer = privatizers.correlated(Undeclared(1.0, 1.0),
                                      correlation.banded_toeplitz(2, 10))
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES])
  with pytest.raises(ValueError, match='declared'):
    privatizer.update(_zeros(), state, tf.constant([1, 2], tf.int64))


def test_one_band_is_independent_noise_of_the_same_std():
  privatizer = privatizers.correlated(privatizers.gaussian(1.0, 2.0),
                                      correlation.banded_toeplitz(1, 10))
  noises, _ = _noises(privatizer, 3)
  for step in noises:
    assert stats.std_matches(step, 2.0)
  measured = noises @ noises.T / noises.shape[1] / 4.0
  assert np.all(np.abs(measured - np.eye(3)) < stats.Z * math.sqrt(2 / noises.shape[1]))
  # One band is plain DP-SGD for the accountant too.
  assert tfdpx.accounting.epsilon(
      privatizer, steps=100, sampling_probability=0.01,
      delta=1e-5) == tfdpx.accounting.epsilon(
          privatizers.gaussian(1.0, 2.0), steps=100,
          sampling_probability=0.01, delta=1e-5)
