"""The Gaussian sampler every noise step draws from (`tfdpx.noise`)."""

import math

import numpy as np
import pytest
import scipy.stats
import tensorflow as tf

from tests import stats
from tfdpx import noise
from tfdpx import philox


# 2,000,001 pairs: this seed's first words put pairs in the tails of the
# radius (checked below), so the blocks that read their third words are used.
LARGE = 4_000_001


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


def _words(k, turn):
  """The three words `box_muller` reads a 53-bit `k` and a 24-bit turn from:
  `k`'s 32 high bits, then 8 (below the turn), then 13."""
  return [[k >> 21], [(turn << 8) | ((k >> 13) & 255)], [(k & 8191) << 19]]


@pytest.mark.parametrize('threshold', [6.0, 7.0, 8.0])
def test_the_radius_exceeds_a_threshold_with_its_exact_probability(
    threshold):
  """Beyond what sampling can check: the 53-bit uniform `(k + 1/2) 2^-53`
  gives a radius above `t` exactly for `k < 2^53 exp(-t^2 / 2) - 1/2`, so
  P(radius > t) is `exp(-t^2 / 2)` to within 2^-53 (the tail of a standard
  normal pair's radius) at 6, 7 and 8 standard deviations."""
  edge = math.floor(2.0**53 * math.exp(-threshold**2 / 2) - 0.5)

  def radius(k):
    words = tf.constant(_words(k, turn=0), tf.uint32)
    return float(noise.box_muller(words)[0])  # Angle ~0: the radius.

  assert radius(edge) > threshold * (1 - 1e-6)
  assert radius(edge + 2) < threshold
  assert radius(edge - 1) > radius(edge) > radius(edge + 1)


@pytest.mark.parametrize('size', [1000, LARGE])
def test_xla_draws_agree_with_the_default_kernels(size):
  seed = tf.constant([3, 4], tf.int64)
  eager = noise.standard_normal([size], seed).numpy()
  compiled = tf.function(noise.standard_normal, jit_compile=True)(
      tf.constant([size]), seed).numpy()
  np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-6)


def test_stddev_scales_every_draw():
  seed = tf.constant([8, 9], tf.int64)
  unit = noise.standard_normal([1001], seed).numpy()
  scaled = noise.standard_normal([1001], seed, 2.5).numpy()
  np.testing.assert_allclose(scaled, 2.5 * unit, rtol=1e-15)


def _words_read(size, seed):
  """The words `standard_normal` reads, laid out as `box_muller` takes them:
  rows 0 and 1 of the `[3, pairs]` draw, and row 2 with the r-th block that
  holds a tail pair given row 2's r-th block. Also the marked blocks."""
  pairs = -(-((size + 1) // 2) // noise._BLOCK) * noise._BLOCK
  words = philox.bits([3, pairs], seed).numpy()
  tails = (words[0] < 2**11) | (words[0] >= 2**32 - 2**11)
  marked = np.flatnonzero(np.any(tails.reshape(-1, noise._BLOCK), axis=1))
  row_2 = words[2].reshape(-1, noise._BLOCK)
  read = row_2.copy()
  read[marked] = row_2[:len(marked)]
  return np.stack([words[0], words[1], read.reshape(-1)]), marked


@pytest.mark.parametrize('size', [1, 7, 2049, LARGE])
@pytest.mark.parametrize('dtype', [tf.float64, tf.float32])
@pytest.mark.parametrize('mode', ['eager', 'graph', 'xla'])
def test_draws_are_box_muller_of_the_words_read(size, dtype, mode):
  """`standard_normal` draws a pair's third word only where `box_muller`
  reads it, from row 2's blocks in order; the draws are `box_muller`'s of
  those words, bit for bit, eager, in a graph and under XLA (against
  `box_muller` under XLA: its float32 trigonometry differs in the last
  bits)."""
  seed = tf.constant([3, 4], tf.int64)
  draw, reference = noise.standard_normal, noise.box_muller
  if mode != 'eager':
    draw, reference = [tf.function(f, autograph=False,
                                   jit_compile=mode == 'xla')
                       for f in (draw, reference)]
  words, marked = _words_read(size, seed)
  if size == LARGE:  # Marked blocks, the first not block 0: reads moved.
    assert len(marked) >= 2 and marked[0] > 0, marked
  np.testing.assert_array_equal(
      draw(tf.constant([size]), seed, dtype=dtype).numpy(),
      reference(tf.constant(words), dtype=dtype).numpy()[:size])


def _exact_radius(k):
  """sqrt(-2 log u), u = (k + 1/2) 2^-53, with `log1p` above 1/2 (float64
  is exact for both u and 1 - u there)."""
  k = np.asarray(k, np.float64)
  below = (k + 0.5) * 2.0**-53
  above = (2.0**53 - k - 0.5) * 2.0**-53
  with np.errstate(divide='ignore'):  # The branch np.where drops.
    log_u = np.where(k < 2.0**52, np.log(below), np.log1p(-above))
  return np.sqrt(-2 * log_u)


def test_radius_reads_all_53_bits_in_the_tails_and_40_elsewhere():
  rng = np.random.default_rng(5)
  ks = [int(2**e) for e in rng.uniform(0, 53, 3000)]
  ks += [2**53 - 1 - k for k in ks]  # Radii near 0.
  ks = sorted(set(ks + [0, 2**32 - 1, 2**32, 2**53 - 2**32 - 1,
                        2**53 - 2**32, 2**53 - 1]))
  words = tf.constant(np.concatenate([_words(k, 0) for k in ks], axis=1),
                      tf.uint32)
  radius = noise.box_muller(words).numpy()[:len(ks)]  # Cosines of angle ~0.
  exact = _exact_radius(np.array(ks, np.float64))
  error = np.abs(radius / exact - 1)
  tails = np.array([k < 2**32 or k >= 2**53 - 2**32 for k in ks])
  assert np.all(error[tails] <= 1e-15)
  # The middle of the last 13 bits: within 2^-21 of the exact radius.
  assert np.all(error[~tails] <= 2.0**-21)
  assert np.max(error[~tails]) > 2.0**-24  # Not all 53 bits after all.


@pytest.mark.parametrize('mode', ['eager', 'graph', 'xla'])
def test_bits_from_an_offset_are_the_rest_of_the_stream(mode):
  seed = tf.constant([6, 7], tf.int64)
  whole = philox.bits([3, 1024], seed).numpy().reshape(-1)
  fn = lambda offset: philox.bits([2, 100], seed, offset=offset)
  if mode != 'eager':
    fn = tf.function(fn, jit_compile=mode == 'xla')
  for offset in [0, 4, 2048, 2400]:
    np.testing.assert_array_equal(
        fn(tf.constant(offset)).numpy().reshape(-1),
        whole[offset:offset + 200])
