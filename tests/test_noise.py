"""The Gaussian sampler every noise step draws from (`tfdpx.noise`)."""

import math

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from tests import stats
from tfdpx import noise


def _draws(shape, seed=(3, 4)):
  return noise.standard_normal(shape, tf.constant(seed, tf.int64)).numpy()


def test_draws_are_standard_normal():
  z = _draws([400_001])  # Odd: the last Box-Muller pair is cut.
  assert z.shape == (400_001,) and z.dtype == np.float64
  assert abs(z.mean()) < stats.Z / math.sqrt(z.size)
  assert stats.std_matches(z, 1.0)
  # Kolmogorov-Smirnov at the 1e-6 level: a wrong shape (uniform angle
  # bug, radius of the wrong law) fails, a correct sampler almost never.
  assert scipy.stats.kstest(z, 'norm').pvalue > 1e-6


def test_cosine_and_sine_draws_are_uncorrelated():
  z = _draws([200_000])
  first, second = z[:100_000], z[100_000:]
  assert abs(np.corrcoef(first, second)[0, 1]) < stats.Z / math.sqrt(1e5)
  assert abs(np.corrcoef(first**2, second**2)[0, 1]) < stats.Z / math.sqrt(1e5)


def test_shape_keys_and_streams():
  a = _draws([7, 3])
  assert a.shape == (7, 3)
  np.testing.assert_array_equal(a, _draws([7, 3]))
  assert not np.any(a == _draws([7, 3], seed=(3, 5)))


def test_tails_reach_as_far_as_53_bit_uniforms_allow():
  # The smallest uniform, 2^-54, gives the largest radius: a float32
  # uniform would stop at sqrt(-2 log 2^-25) = 5.9, cutting the tail where
  # a neighbouring dataset's shifted noise still has mass.
  zero = tf.zeros([3, 1], tf.uint32)
  largest = noise.box_muller(zero).numpy()
  assert largest[0] == pytest.approx(math.sqrt(2 * 54 * math.log(2)), rel=1e-6)
  ones = tf.fill([3, 1], tf.constant(0xFFFFFFFF, tf.uint32))
  smallest = noise.box_muller(ones).numpy()
  assert np.all(np.abs(smallest) < 1e-7)


@pytest.mark.parametrize('threshold', [4.0, 5.0])
def test_tail_frequencies_match_the_normal_law(threshold):
  """Two-sided: the count of |z| > 4 and > 5 in 10^8 draws against its
  binomial law (expected 6334 and 57). A tail cut short, or too heavy,
  fails."""
  draws, count = 10**8, 0
  for chunk in range(10):
    count += int(np.sum(np.abs(_draws([draws // 10], seed=(11, chunk))) >
                        threshold))
  expected = draws * 2 * scipy.stats.norm.sf(threshold)
  assert abs(count - expected) <= stats.Z * math.sqrt(expected), (count,
                                                                  expected)


@pytest.mark.parametrize('threshold', [6.0, 7.0, 8.0])
def test_the_radius_exceeds_a_threshold_with_its_exact_probability(
    threshold):
  """Beyond what sampling can check: the 53-bit uniform `(k + 1/2) 2^-53`
  gives a radius above `t` exactly for `k < 2^53 exp(-t^2 / 2) - 1/2`, so
  P(radius > t) is `exp(-t^2 / 2)` to within 2^-53 (the tail of a standard
  normal pair's radius) at 6, 7 and 8 standard deviations."""
  edge = math.floor(2.0**53 * math.exp(-threshold**2 / 2) - 0.5)

  def radius(k):
    # The words box_muller reads k from: its 27 high bits, its 26 low bits.
    words = tf.constant([[(k >> 26) << 5], [(k & (2**26 - 1)) << 6], [0]],
                        tf.uint32)
    return float(noise.box_muller(words)[0])  # Angle ~0: the radius.

  assert radius(edge) > threshold * (1 - 1e-6)
  assert radius(edge + 2) < threshold
  assert radius(edge - 1) > radius(edge) > radius(edge + 1)


def test_xla_draws_agree_with_the_default_kernels():
  seed = tf.constant([8, 9], tf.int64)
  eager = noise.standard_normal([1000], seed).numpy()
  compiled = tf.function(noise.standard_normal, jit_compile=True)(
      tf.constant([1000]), seed).numpy()
  np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-6)


def test_stddev_scales_every_draw():
  seed = tf.constant([8, 9], tf.int64)
  unit = noise.standard_normal([1001], seed).numpy()
  scaled = noise.standard_normal([1001], seed, 2.5).numpy()
  np.testing.assert_allclose(scaled, 2.5 * unit, rtol=1e-15)
