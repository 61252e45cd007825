"""D2P2's own mathematics (spec d2p2.md section 7: properties 1, 10-20)."""

import json
import math

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import clipping
from tfdpx import projections

KEY = tf.constant([7, 11], tf.int64)


def _grads(seed, shapes, batch=5, scale=1.0):
  rng = np.random.default_rng(seed)
  return [tf.constant(scale * rng.normal(size=(batch,) + s), tf.float32)
          for s in shapes]


def _step(privatizer, grads, seed=(1, 2), steps=1):
  state = privatizer.init([tf.Variable(tf.zeros(g.shape[1:])) for g in grads])
  for step in range(steps):
    out, state = privatizer.update(
        grads, state, tf.constant([seed[0], seed[1] + step], tf.int64))
  return [o.numpy() for o in out], state


# --- 1. automatic clipping ------------------------------------------------------


def test_auto_clip_norm_direction_and_zero():
  grads = _grads(0, [(4, 3), (7,)], batch=6, scale=50.0)
  grads = [tf.concat([g, tf.zeros((1,) + g.shape[1:])], 0) for g in grads]
  factors = clipping.normalize_factors(grads, 0.01).numpy()
  flat_in = np.concatenate([g.numpy().reshape(7, -1) for g in grads], 1)
  flat_out = flat_in * factors[:, np.newaxis]
  norms_in = np.linalg.norm(flat_in, axis=1)
  norms_out = np.linalg.norm(flat_out, axis=1)
  np.testing.assert_allclose(norms_out, norms_in / (norms_in + 0.01),
                             rtol=1e-5)
  assert np.all(norms_out < 1)
  np.testing.assert_array_equal(flat_out[-1], 0.0)


@pytest.mark.parametrize('gamma', [0.0, -0.1, math.inf])
def test_gamma_must_be_positive_and_finite(gamma):
  with pytest.raises(ValueError, match='gamma'):
    tfdpx.privatizers.d2p2(1.0, gamma=gamma)


@pytest.mark.parametrize('kwargs, argument', [
    (dict(projection='dense'), 'projection'),
    (dict(projection_ratio=0.0), 'projection_ratio'),
    (dict(projection_ratio=1.5), 'projection_ratio'),
    (dict(projection_order='later'), 'projection_order'),
    (dict(back_projection='half'), 'back_projection'),
    (dict(resample_projection='daily'), 'resample_projection'),
    (dict(projection_seed=-1), 'projection_seed'),
])
def test_arguments_are_validated(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    tfdpx.privatizers.d2p2(1.0, **kwargs)


# --- 10. shapes -----------------------------------------------------------------


def test_projected_dim_and_tiny_tensors():
  privatizer = tfdpx.privatizers.d2p2(1.0)
  assert privatizer.projected_dim((100, 7)) == 210
  assert privatizer.projected_dim((4,)) == 1
  for shape in [(3,), (1, 3), (2,), (1,)]:
    assert not privatizer.projected(shape)
    assert privatizer.projected_dim(shape) == math.prod(shape)
  shapes = [(3,), (2,), (4,), (5, 2)]
  for kwargs in [{}, dict(projection='srht'),
                 dict(projection_order='project_first')]:
    out, _ = _step(tfdpx.privatizers.d2p2(1.0, **kwargs), _grads(1, shapes))
    assert [o.shape for o in out] == shapes
    assert all(np.all(np.isfinite(o)) for o in out)


# --- 11-13. the Gaussian projection --------------------------------------------


def test_gaussian_entries_are_standard_normal():
  a = projections.gaussian_dense(KEY, 400, 300).numpy().ravel()
  n = a.size
  assert abs(a.mean()) < stats.Z / math.sqrt(n)
  assert stats.std_matches(a, 1.0)
  assert not stats.std_matches(a, 1.02) and not stats.std_matches(a, 0.98)


def test_projection_preserves_the_squared_norm_in_expectation():
  v = tf.constant(np.random.default_rng(3).normal(size=60), tf.float32)
  trials, p = 400, 10
  forward = tf.function(lambda key: projections.gaussian_forward(v, key, p))
  ratios = [float(tf.reduce_sum(tf.square(forward(
      tf.constant([t, 1], tf.int64)))) / p / tf.reduce_sum(tf.square(v)))
            for t in range(trials)]
  # ||A^T v||^2 / (p ||v||^2) ~ chi^2_p / p: mean 1, std sqrt(2 / p).
  assert abs(np.mean(ratios) - 1) < stats.Z * math.sqrt(2 / p / trials)


@pytest.mark.parametrize('block_rows', [1, 3, 7, 64])
def test_blockwise_products_equal_the_dense_matrix(block_rows):
  d, p = 50, 13
  a = projections.gaussian_dense(KEY, d, p, block_rows).numpy()
  x = np.random.default_rng(0).normal(size=d).astype('float32')
  v = np.random.default_rng(1).normal(size=p).astype('float32')
  np.testing.assert_allclose(
      projections.gaussian_forward(tf.constant(x), KEY, p, block_rows),
      a.T @ x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      projections.gaussian_backward(tf.constant(v), KEY, d, block_rows),
      a @ v, rtol=1e-5, atol=1e-5)
  # The backward pass regenerates bit-identical blocks: A^T e_i == (A e_j)...
  dense_again = projections.gaussian_dense(KEY, d, p, block_rows).numpy()
  np.testing.assert_array_equal(a, dense_again)


def test_resampling_every_step_and_never():
  every = tfdpx.privatizers.d2p2(1.0)
  never = tfdpx.privatizers.d2p2(1.0, resample_projection='never')
  def dense(privatizer, step):
    return projections.gaussian_dense(privatizer.projection_key(0, step),
                                      20, 6).numpy()
  assert not np.array_equal(dense(every, 0), dense(every, 1))
  np.testing.assert_array_equal(dense(every, 3), dense(tfdpx.privatizers.d2p2(2.0), 3))
  np.testing.assert_array_equal(dense(never, 0), dense(never, 5))
  other_seed = tfdpx.privatizers.d2p2(1.0, projection_seed=1)
  assert not np.array_equal(dense(every, 0), dense(other_seed, 0))


# --- 14. sensitivity bounds -------------------------------------------------------


@pytest.mark.parametrize('d, p', [(10, 3), (16, 4), (64, 19), (300, 90)])
def test_mode_c_delta_is_at_least_the_exact_operator_norm(d, p):
  a = projections.gaussian_dense(KEY, d, p).numpy().astype('float64')
  exact = np.linalg.svd(a, compute_uv=False)[0]
  computed = float(projections.gaussian_max_singular_value(KEY, d, p))
  assert computed >= exact * (1 - 1e-12)
  assert computed == pytest.approx(exact, rel=1e-9)
  privatizer = tfdpx.privatizers.d2p2(1.0, projection='gaussian',
                                      projection_order='project_first',
                                      projection_ratio=p / d + 1e-9)
  assert privatizer.projected_dim((d,)) == p
  delta = float(privatizer.sensitivity([(d,), (3,)], 0))
  key = privatizer.projection_key(0, 0)
  own = np.linalg.svd(projections.gaussian_dense(key, d, p).numpy(),
                      compute_uv=False)[0] / math.sqrt(p)
  assert delta >= max(1.0, own)
  assert delta == pytest.approx(max(1.0, own), rel=2e-5)
  assert delta > 2.0  # About 1 + sqrt(d / p): the paper's claim of 1 is wrong.


def test_mode_c_refuses_dimensions_it_cannot_bound_exactly():
  privatizer = tfdpx.privatizers.d2p2(1.0, projection='gaussian',
                                      projection_order='project_first')
  with pytest.raises(ValueError, match='project_first'):
    privatizer.init([tf.Variable(tf.zeros((100, 50)))])


@pytest.mark.parametrize('d', [16, 100])
def test_srht_rows_are_orthonormal_and_norm_at_most_one(d):
  p = projections.projected_dim(d, 0.3)
  r = _dense_srht(KEY, d, p)
  assert r.shape == (p, d)
  assert np.linalg.svd(r, compute_uv=False)[0] <= 1 + 1e-6
  if d == projections.padded_dim(d):
    np.testing.assert_allclose(r @ r.T, np.eye(p), atol=1e-6)
  np.testing.assert_allclose(  # Backward is the transpose.
      projections.srht_backward(tf.ones([p]), KEY, d).numpy(),
      r.T @ np.ones(p), atol=1e-5)


def _butterfly(x):
  """The transform by its definition's butterflies, in float64."""
  y = np.array(x, np.float64)
  half = 1
  while half < len(y):
    pairs = y.reshape(-1, 2, half)
    y = np.concatenate([pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]],
                       axis=1).reshape(-1)
    half *= 2
  return y


@pytest.mark.parametrize('n', [1, 2, 32, 2048, 2**13, 2**17, 2**19])
def test_fwht_is_the_hadamard_matrix(n):
  # Up to 64: one block; 2048: two (64 x 32); 2^13 and 2^17: three; 2^19:
  # four (64 x 64 x 64 x 2), so two middle factors.
  x = np.random.default_rng(0).normal(size=n)
  if n <= 2048:
    from scipy import linalg  # pylint: disable=g-import-not-at-top
    expected = linalg.hadamard(n) @ x
  else:
    expected = _butterfly(x)
  got = projections.fwht(tf.constant(x, tf.float32)).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-5,
                             atol=1e-5 * np.sqrt(n))


# --- 15-16. post-processing structure and noise calibration ----------------------


def _released(privatizer, d, trials, z):
  """The p-space vectors behind `trials` outputs of zero gradients."""
  p = privatizer.projected_dim((d,))
  key = privatizer.projection_key(0, 0)
  update = tf.function(privatizer.update)
  state = privatizer.init([tf.Variable(tf.zeros((d,)))])
  outs = [update([tf.zeros((3, d))], state,
                 tf.constant([t, 0], tf.int64))[0][0].numpy()
          for t in range(trials)]
  return np.array(outs), p, key


def test_mode_n_noise_is_z_in_d_space_projected():
  d, z, trials = 64, 1.7, 200
  privatizer = tfdpx.privatizers.d2p2(z, projection='gaussian',
                                      back_projection='paper',
                                      resample_projection='never')
  outs, p, key = _released(privatizer, d, trials, z)
  a = projections.gaussian_dense(key, d, p).numpy().astype('float64')
  # 15: every output lies in the column space of A.
  coef, *_ = np.linalg.lstsq(a, outs.T, rcond=None)
  np.testing.assert_allclose(a @ coef, outs.T, atol=1e-3 * np.abs(outs).max())
  # 16: v = A^T (z xi) / sqrt(p) has covariance z^2 A^T A / p: whiten it.
  cov = a.T @ a / p
  w = np.linalg.cholesky(np.linalg.inv(cov)).T @ coef / z
  assert stats.std_matches(w, 1.0)
  assert not stats.std_matches(w, 1.15) and not stats.std_matches(w, 1 / 1.15)


def test_mode_c_noise_is_z_delta_in_p_space():
  d, z, trials = 64, 0.9, 300
  privatizer = tfdpx.privatizers.d2p2(z, projection='gaussian',
                                      projection_order='project_first',
                                      back_projection='paper',
                                      resample_projection='never')
  outs, p, key = _released(privatizer, d, trials, z)
  a = projections.gaussian_dense(key, d, p).numpy().astype('float64')
  coef, *_ = np.linalg.lstsq(a, outs.T, rcond=None)
  delta = float(privatizer.sensitivity([(d,)], 0))
  assert stats.std_matches(coef, z * delta)
  assert not stats.std_matches(coef, z * delta * 1.15)
  assert not stats.std_matches(coef, z)  # Not the paper's uncalibrated z.


def _dense_srht(key, d, p):
  forward = tf.function(lambda e: projections.srht_forward(e, key, p))
  return np.stack([forward(tf.constant(e, tf.float32)).numpy()
                   for e in np.eye(d)], axis=1)


@pytest.mark.parametrize('gain', ['paper', 'unbiased'])
def test_mode_o_noise_is_z_in_p_space(gain):
  d, z, trials = 128, 1.3, 60
  privatizer = tfdpx.privatizers.d2p2(z, projection='srht', back_projection=gain,
                         resample_projection='never')
  outs, p, key = _released(privatizer, d, trials, z)
  c = d / math.sqrt(p) if gain == 'paper' else d / p
  r = _dense_srht(key, d, p)
  v = (r @ outs.T) / c  # R R^T = I for d a power of two.
  assert stats.std_matches(v, z)
  assert not stats.std_matches(v, z * 1.15)
  assert privatizer.expected_output_noise_std(0, [(d,)]) == pytest.approx(
      c * z * math.sqrt(p / d))
  assert stats.std_matches(outs, privatizer.expected_output_noise_std(
      0, [(d,)]))


@pytest.mark.parametrize('gain', ['paper', 'unbiased'])
def test_mode_n_expected_output_noise_std(gain):
  d, z, trials = 40, 1.0, 300
  privatizer = tfdpx.privatizers.d2p2(  # Resampled: the mean over A.
      z, projection='gaussian', back_projection=gain)
  update = tf.function(privatizer.update)
  outs = [update([tf.zeros((2, d))], {'step': tf.constant(t, tf.int64)},
                 tf.constant([t, 9], tf.int64))[0][0].numpy()
          for t in range(trials)]
  expected = privatizer.expected_output_noise_std(0, [(d,)])
  p = privatizer.projected_dim((d,))
  assert p == 12
  assert expected == pytest.approx(
      z * math.sqrt(p + d + 1) / (1 if gain == 'paper' else math.sqrt(p)))
  # Coordinates share one A per trial; trials are independent: compare the
  # mean squared value over trials with its standard error.
  per_trial = np.mean(np.square(outs), axis=1)
  se = per_trial.std() / math.sqrt(trials)
  assert abs(per_trial.mean() - expected**2) < stats.Z * se
  assert abs(per_trial.mean() - (1.1 * expected)**2) > 2 * se


# --- 17. RNG separation; 18/20 degenerate cases ------------------------------------


def test_noise_and_projection_streams_are_separate():
  grads = _grads(4, [(8, 4)])
  # The projection never depends on the noise seed: noiseless outputs agree.
  quiet = tfdpx.privatizers.d2p2(0.0, projection='srht')
  np.testing.assert_array_equal(_step(quiet, grads, seed=(1, 0))[0][0],
                                _step(quiet, grads, seed=(2, 0))[0][0])
  # The noise never depends on the projection seed.
  plain = [tfdpx.privatizers.d2p2(1.0, projection='none', projection_seed=s) for s in (0, 9)]
  np.testing.assert_array_equal(_step(plain[0], grads)[0][0],
                                _step(plain[1], grads)[0][0])


def test_empty_batch_gives_pure_noise():
  privatizer = tfdpx.privatizers.d2p2(1.0, projection='none')
  out, state = _step(privatizer, [tf.zeros((0, 50, 40))])
  assert np.all(np.isfinite(out[0]))
  assert stats.std_matches(out[0], 1.0)
  assert int(state['step']) == 1


def test_the_step_lives_in_the_state_and_drives_the_schedule():
  privatizer = tfdpx.privatizers.d2p2(2.0, noise_schedule='inv_sqrt_step',
                         min_noise_multiplier=0.5, projection='none')
  zeros = [tf.zeros((1, 300, 100))]
  for step in (0, 3, 99):
    out, _ = privatizer.update(zeros, {'step': tf.constant(step, tf.int64)},
                               tf.constant([1, step], tf.int64))
    expected = max(0.5, 2.0 / math.sqrt(step + 1))
    assert stats.std_matches(out[0].numpy(), expected), step


# --- 19. variants are configurations ----------------------------------------------


@pytest.mark.parametrize('kwargs', [
    dict(noise_schedule='inv_fourth_root_epoch', steps_per_epoch=10,
         min_noise_multiplier=0.3),  # D2P2-SGD
    dict(projection='srht'),  # DP2-SGD (structured)
    dict(projection_order='project_first', resample_projection='never'),
])
def test_variants_round_trip_and_trace_with_xla(kwargs):
  privatizer = tfdpx.privatizers.d2p2(1.2, **kwargs)
  assert tfdpx.deserialize(json.loads(json.dumps(
      tfdpx.serialize(privatizer)))) == privatizer
  grads = _grads(5, [(6, 5), (3,), (20,)])
  state = privatizer.init([tf.Variable(tf.zeros(g.shape[1:])) for g in grads])
  key = tf.constant([3, 4], tf.int64)
  eager, _ = privatizer.update(grads, state, key)
  compiled, _ = tf.function(privatizer.update, jit_compile=True)(
      grads, state, key)
  for a, b in zip(eager, compiled):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-4)
  assert isinstance(privatizer.dp_event(0).noise_multiplier, float)


def test_auto_clipped_dpsgd_costs_what_dpsgd_costs():
  eps = [tfdpx.accounting.epsilon(p, steps=50, sampling_probability=0.02,
                                  delta=1e-5)
         for p in (tfdpx.privatizers.d2p2(1.1, projection='none'), tfdpx.privatizers.d2p2(1.1),
                   tfdpx.privatizers.gaussian(1.0, 1.1))]
  assert eps[0] == eps[1] == eps[2]


@pytest.mark.parametrize('bits', [0, 1, 2, 5, 6, 13])
def test_feistel_permutation_is_a_bijection(bits):
  everything = tf.range(1 << bits, dtype=tf.int32)
  image = projections.feistel_permutation(everything, KEY, bits).numpy()
  np.testing.assert_array_equal(np.sort(image), everything.numpy())
  if bits >= 5:  # Not the identity, and another key permutes otherwise.
    assert np.mean(image == everything.numpy()) < 0.2
    other = projections.feistel_permutation(
        everything, tf.constant([7, 7], tf.int64), bits).numpy()
    assert np.mean(image == other) < 0.2


def test_srht_rows_are_uniform_over_keys():
  # Each of the d' rows is chosen with probability p / d' under a fresh key:
  # the counts over many keys must fit that binomial, two-sided.
  d, p, keys = 64, 16, 2000
  draw = tf.function(lambda key: projections.srht_parts(key, d, p)[1])
  counts = np.zeros(d)
  for k in range(keys):
    rows = draw(tf.constant([k, 1], tf.int64)).numpy()
    assert len(set(rows)) == p and rows.min() >= 0 and rows.max() < d
    counts[rows] += 1
  expected = keys * p / d
  chi2 = np.sum((counts - expected)**2 / (expected * (1 - p / d)))
  assert scipy.stats.chi2.sf(chi2, d - 1) > 1e-6
  # Pairs of rows are chosen together as often as without replacement says.
  together = np.zeros((d, d))
  for k in range(300):
    rows = draw(tf.constant([k, 2], tf.int64)).numpy()
    together[np.ix_(rows, rows)] += 1
  off = together[~np.eye(d, dtype=bool)] / 300
  assert abs(off.mean() - p * (p - 1) / (d * (d - 1))) < 0.01


def test_srht_parts_agree_under_xla():
  d, p = 1000, 300
  eager = projections.srht_parts(KEY, d, p)
  compiled = tf.function(lambda k: projections.srht_parts(k, d, p),
                         jit_compile=True)(KEY)
  for a, b in zip(eager, compiled):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_standard_normal_f32_gives_independent_normal_pairs():
  # Box-Muller's two outputs of one pair (r cos t, r sin t) land in the two
  # halves of the flat draw; both halves must be N(0, 1) and independent.
  n = 200_001
  z = projections.standard_normal_f32([n], tf.constant([5, 6], tf.int64))
  z = z.numpy().astype(np.float64)
  assert z.shape == (n,) and np.all(np.isfinite(z))
  assert scipy.stats.kstest(z, 'norm').pvalue > 1e-3
  assert abs(z.mean()) < 5 / math.sqrt(n)
  assert abs(z.var() - 1) < 5 * math.sqrt(2 / n)
  half = n // 2
  cosines, sines = z[:half], z[half + 1:2 * half + 1]
  for a, b in [(cosines, sines), (cosines**2, sines**2)]:
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(half)
