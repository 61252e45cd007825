"""Hyperspherical conversions: spec geodp.md §2.2, §2.4 and §7 items 1-7."""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import hyperspherical


def _round_trip(x):
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  return hyperspherical.to_cartesian(r, theta).numpy()


def _relative_error(y, x):
  return np.linalg.norm(y - x) / np.linalg.norm(x)


def _inputs(d, rng):
  """The spec's input families (§7.1) at length d."""
  gaussian = rng.normal(size=d)
  blocks = gaussian.copy()
  blocks[d // 4:d // 2] = 0.0
  tail = gaussian.copy()
  tail[max(1, d // 2):] = 0.0
  return {
      'gaussian': gaussian,
      'heavy_tailed': rng.standard_t(1.5, size=d),
      'zero_blocks': blocks,
      'zero_tail': tail,
      'negative': -np.abs(gaussian),
      'tiny': 1e-30 * gaussian,
      'huge': 1e30 * gaussian,
  }


@pytest.mark.parametrize('d', [2, 3, 10, 1000])
def test_round_trip_float64(d):
  rng = np.random.default_rng(d)
  for name, x in _inputs(d, rng).items():
    y = _round_trip(x)
    assert _relative_error(y, x) < 1e-13, name
    assert np.max(np.abs(y - x)) <= 1e-13 * np.linalg.norm(x), name


def test_round_trip_float32_input_is_accurate_to_float32():
  x = np.random.default_rng(0).normal(size=5000).astype(np.float32)
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  y = tf.cast(hyperspherical.to_cartesian(r, theta), tf.float32).numpy()
  assert _relative_error(y, x) < 1e-6
  assert np.max(np.abs(y - x)) <= 1e-6 * np.linalg.norm(x)


def test_round_trip_at_a_million_coordinates():
  """Issue #8 acceptance: relative error below 1e-10 at d = 10^6 (float64).

  The time is measured by benchmarks/hyperspherical_speed.py, not here.
  """
  x = np.random.default_rng(1).normal(size=1_000_000)
  x[-1000:] = 0.0  # A zero tail as well.
  assert _relative_error(_round_trip(x), x) < 1e-10


def test_ranges():
  x = np.random.default_rng(2).normal(size=500)
  x[::7] = 0.0
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  theta = theta.numpy()
  assert r.numpy() >= 0
  assert np.all((theta[:-1] >= 0) & (theta[:-1] <= math.pi))
  assert -math.pi < theta[-1] <= math.pi


def test_known_values():
  r, theta = hyperspherical.to_spherical(tf.constant([1.0, math.sqrt(3)],
                                                     tf.float64))
  np.testing.assert_allclose(r.numpy(), 2.0, rtol=1e-15)
  np.testing.assert_allclose(theta.numpy(), [math.pi / 3], rtol=1e-15)
  _, theta = hyperspherical.to_spherical(tf.constant([1.0, 1.0], tf.float64))
  np.testing.assert_allclose(theta.numpy(), [math.pi / 4], rtol=1e-15)
  r, theta = hyperspherical.to_spherical(tf.constant([1.0, 1.0, 1.0],
                                                     tf.float64))
  np.testing.assert_allclose(r.numpy(), math.sqrt(3), rtol=1e-15)
  np.testing.assert_allclose(theta.numpy(),
                             [math.atan(math.sqrt(2)), math.pi / 4],
                             rtol=1e-15)
  for x in np.random.default_rng(3).normal(size=(20, 2)):
    _, theta = hyperspherical.to_spherical(tf.constant(x))
    np.testing.assert_allclose(theta.numpy(), [math.atan2(x[1], x[0])],
                               rtol=1e-14)


def test_scale_invariance():
  x = np.random.default_rng(4).normal(size=300)
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  for c in (1e-20, 0.5, 4096.0, 1e25):
    rc, thetac = hyperspherical.to_spherical(tf.constant(c * x))
    np.testing.assert_allclose(thetac.numpy(), theta.numpy(), rtol=1e-14,
                               atol=1e-15)
    np.testing.assert_allclose(rc.numpy(), c * r.numpy(), rtol=1e-14)


def test_suffix_identity():
  """r * prod_{i<k} sin(theta_i) = ||x[k:]|| (spec §7.5)."""
  x = np.random.default_rng(5).normal(size=2000)
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  prefix = np.concatenate([[1.0], np.cumprod(np.sin(theta.numpy()))])
  suffix = np.sqrt(np.cumsum(np.square(x)[::-1])[::-1])
  np.testing.assert_allclose(r.numpy() * prefix, suffix, rtol=1e-12)


@pytest.mark.parametrize('jit', [False, True])
def test_zero_vector_and_zero_tails_are_safe(jit):
  forward = tf.function(hyperspherical.to_spherical, jit_compile=jit)
  inverse = tf.function(hyperspherical.to_cartesian, jit_compile=jit)
  rng = np.random.default_rng(6)
  cases = [np.zeros(5), np.zeros(2), np.concatenate([rng.normal(size=3),
                                                      np.zeros(40)]),
           np.concatenate([np.zeros(10), rng.normal(size=3), np.zeros(10)])]
  for x in cases:
    r, theta = forward(tf.constant(x))
    assert np.all(np.isfinite(theta.numpy())) and np.isfinite(r.numpy())
    y = inverse(r, theta).numpy()
    assert np.all(np.isfinite(y))
    # Zeros come back within rounding: sin and cos of the float64 nearest
    # pi and pi / 2 are about 1e-16, not 0.
    assert np.all(np.abs(y[x == 0]) <= 1e-15 * np.linalg.norm(x))
    np.testing.assert_allclose(y, x, atol=1e-15 * max(1, np.linalg.norm(x)))
  r, theta = forward(tf.zeros(7, tf.float64))
  assert r.numpy() == 0 and np.all(theta.numpy() == 0)
  # A zero magnitude with arbitrary (noisy) angles is the zero vector.
  y = inverse(tf.constant(0.0, tf.float64),
              tf.constant(rng.normal(size=6) * 100))
  np.testing.assert_array_equal(y.numpy(), 0.0)


def _long_double_inverse(r, theta):
  theta = theta.astype(np.longdouble)
  prefix = np.concatenate([[1.0], np.cumprod(np.sin(theta))])
  return r * prefix * np.concatenate([np.cos(theta), [1.0]])


@pytest.mark.parametrize('noise_std', [0.003, 1e3])
def test_inverse_matches_an_extended_precision_reference(noise_std):
  """Spec §7.7: noisy angles, checked against long double products."""
  rng = np.random.default_rng(7)
  x = rng.normal(size=100_000)
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  noisy = theta.numpy() + noise_std * rng.normal(size=theta.shape[0])
  y = hyperspherical.to_cartesian(r, tf.constant(noisy)).numpy()
  assert np.all(np.isfinite(y))
  reference = _long_double_inverse(r.numpy(), noisy)
  error = float(np.linalg.norm((y - reference).astype(np.float64)))
  assert error <= 1e-12 * float(np.linalg.norm(reference.astype(np.float64)))
  # The norm is |r| whatever the angles.
  np.testing.assert_allclose(np.linalg.norm(y), r.numpy(), rtol=1e-12)


def test_new_magnitude_with_exact_angles_keeps_the_direction():
  """Spec §7.9: no angle noise, (r*, theta(g)) -> (r* / r) * g."""
  x = np.random.default_rng(8).normal(size=1000)
  r, theta = hyperspherical.to_spherical(tf.constant(x))
  for r_new in (2.5, -0.3):
    y = hyperspherical.to_cartesian(tf.constant(r_new, tf.float64),
                                    theta).numpy()
    cosine = y @ x / (np.linalg.norm(y) * np.linalg.norm(x))
    np.testing.assert_allclose(cosine, math.copysign(1.0, r_new), atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(y), abs(r_new), rtol=1e-12)


def test_xla_matches_eager():
  x = tf.constant(np.random.default_rng(9).normal(size=100_000))
  forward = tf.function(hyperspherical.to_spherical, jit_compile=True)
  inverse = tf.function(hyperspherical.to_cartesian, jit_compile=True)
  r, theta = hyperspherical.to_spherical(x)
  r_xla, theta_xla = forward(x)
  np.testing.assert_allclose(r_xla.numpy(), r.numpy(), rtol=1e-14)
  np.testing.assert_allclose(theta_xla.numpy(), theta.numpy(), rtol=1e-12,
                             atol=1e-14)
  noisy = theta + 3.0 * tf.constant(
      np.random.default_rng(10).normal(size=theta.shape[0]))
  np.testing.assert_allclose(inverse(r, noisy).numpy(),
                             hyperspherical.to_cartesian(r, noisy).numpy(),
                             rtol=1e-9, atol=1e-14 * r.numpy())


@pytest.mark.parametrize('n', [1, 2, 31, 32, 33, 1025, 40_000])
def test_blocked_cumulative_sum(n):
  x = np.random.default_rng(n).normal(size=n)
  t = tf.constant(x)
  scale = np.sum(np.abs(x))
  expected = {
      (False, False): np.cumsum(x),
      (True, False): np.concatenate([[0.0], np.cumsum(x)[:-1]]),
      (False, True): np.cumsum(x[::-1])[::-1],
      (True, True): np.concatenate([np.cumsum(x[::-1])[::-1][1:], [0.0]]),
  }
  for (exclusive, reverse), want in expected.items():
    got = hyperspherical._cumsum(t, exclusive=exclusive, reverse=reverse)
    np.testing.assert_allclose(got.numpy(), want, rtol=0,
                               atol=1e-14 * scale)
    # Rows are scanned independently: the second row is the first times -3.
    rows = hyperspherical._cumsum(tf.stack([t, -3.0 * t]),
                                  exclusive=exclusive, reverse=reverse)
    np.testing.assert_allclose(rows.numpy(), [want, -3.0 * want], rtol=0,
                               atol=3e-14 * scale)


def test_invalid_lengths_raise():
  with pytest.raises(ValueError, match='length'):
    hyperspherical.to_spherical(tf.constant([1.0]))
  with pytest.raises(ValueError, match='length'):
    hyperspherical.to_cartesian(tf.constant(1.0), tf.zeros([0]))
  with pytest.raises(ValueError, match='1-D'):
    hyperspherical.to_spherical(tf.zeros([2, 2]))
  unknown = tf.function(hyperspherical.to_spherical).get_concrete_function
  with pytest.raises(ValueError, match='length'):
    unknown(tf.TensorSpec([None], tf.float32))


@pytest.mark.parametrize('scale', [1.0, 1e3, 1e5, 1e7])
def test_sin_cos_within_one_unit_at_1_of_numpys(scale):
  """Noisy angles reach thousands of radians (GeoDP's angle noise grows
  with sqrt(d)); 1e7 takes the tf.sin / tf.cos path."""
  rng = np.random.default_rng(3)
  theta = rng.normal(0, scale, 20_000)
  # Next to multiples of pi/2, where the reduction cancels most digits.
  quarters = rng.integers(-2**19 + 1, 2**19, 2_000) * (math.pi / 2)
  theta = np.concatenate([theta, quarters, quarters + 1e-9, [0.0, -0.0]])
  sin, cos = hyperspherical.sin_cos(tf.constant(theta))
  np.testing.assert_allclose(sin.numpy(), np.sin(theta), rtol=0, atol=2**-52)
  np.testing.assert_allclose(cos.numpy(), np.cos(theta), rtol=0, atol=2**-52)


def test_a_million_sines_multiply_without_drift():
  """The prefix products multiply up to a million sines near 1: a bias of a
  hundredth of a unit in the last place in each (a rounding of 1 - r^2/2
  before the rest of the cosine of the reduced angle) shows as a 7e-13 drift;
  unbiased roundings stay near eps sqrt(d)."""
  x = tf.constant(np.random.default_rng(0).normal(size=1_000_000))
  _, theta = hyperspherical.to_spherical(x)
  sin, _ = hyperspherical.sin_cos(theta)
  drift = np.sum(np.log(np.abs(sin.numpy())) -
                 np.log(np.abs(np.sin(theta.numpy()))))
  assert abs(drift) < 1e-13


@pytest.mark.parametrize('n', [1, 100, 4999])
def test_leading_angles_are_those_of_to_spherical(n):
  rng = np.random.default_rng(n)
  for name, x in _inputs(5001, rng).items():
    r, theta = hyperspherical.to_spherical(tf.constant(x))
    r_lead, lead = hyperspherical.leading_angles(tf.constant(x), n)
    np.testing.assert_allclose(r_lead.numpy(), r.numpy(), rtol=1e-14,
                               err_msg=name)
    np.testing.assert_allclose(lead.numpy(), theta.numpy()[:n], rtol=1e-13,
                               atol=1e-15, err_msg=name)
  with pytest.raises(ValueError, match='n must be'):
    hyperspherical.leading_angles(tf.zeros([10]), 9)


@pytest.mark.parametrize('noise_std', [0.0, 1.0, 100.0])
def test_leading_coordinates_are_those_of_to_cartesian(noise_std):
  """The first n coordinates whatever the later angles; the later ones
  exactly 0 where `vanished` says so, which large noise makes true."""
  rng = np.random.default_rng(3)
  d, n = 20000, 4096
  r, theta = hyperspherical.to_spherical(tf.constant(rng.normal(size=d)))
  theta = theta + noise_std * rng.normal(size=d - 1)
  whole = hyperspherical.to_cartesian(r, theta).numpy()
  lead, vanished = hyperspherical.leading_coordinates(r, theta[:n])
  np.testing.assert_allclose(lead.numpy(), whole[:n], rtol=1e-12,
                             atol=1e-15 * np.abs(whole).max())
  assert bool(vanished) == (noise_std > 0)
  if vanished:
    assert np.all(whole[n:] == 0.0)
  else:  # Unperturbed angles: the tail keeps its share of the norm.
    assert np.linalg.norm(whole[n:]) > 0.5 * np.linalg.norm(whole)


@pytest.mark.parametrize('log_product', [-700.0, -1100.0])
def test_leading_coordinates_vanish_only_where_the_rest_is_zero(log_product):
  """At the edge: a product of sines of exp(-700) still leaves a non-zero
  coordinate after it (float64 exp is 0 below about -745)."""
  n = 4096
  theta = np.zeros(n + 10)  # cos = 1 after the leading angles.
  theta[:n] = np.arcsin(np.exp(log_product / n))
  whole = hyperspherical.to_cartesian(1.0, theta).numpy()
  _, vanished = hyperspherical.leading_coordinates(1.0, theta[:n])
  assert (whole[n] != 0.0) == (log_product > -745)
  assert bool(vanished) == (log_product < -1000)
