"""Random projections of a flat vector, never held as a dense d x p matrix.

Two families, both keyed by a public, data-independent int64 `[2]` key (never
by the noise seed):

* Gaussian: `A` in R^{d x p} with i.i.d. N(0, 1) entries (the D2P2 paper's
  distribution). `A` is generated in blocks of `block_rows` rows from
  `fold_in(key, block)`, used, and dropped; the backward product regenerates
  the same blocks. Memory O(block_rows * p), time O(d * p).
* SRHT (subsampled randomized Hadamard transform): `R = S (H / sqrt(d')) D`
  restricted to the first d columns, with d' = 2^ceil(log2 d), D random signs,
  H the Walsh-Hadamard matrix and S a random choice of p of its d' rows (the
  images of 0..p-1 under a keyed Feistel permutation of [0, d'), so they are
  distinct whatever the key). The rows of `R` are (sub-)orthonormal, so
  `||R||_op <= 1`. Memory O(d'), time O(d' log d') (the Hadamard transform
  by 64 x 64 blocks).

Everything is float32 and traceable with `tf.function(jit_compile=True)`. The
Gaussian entries come from raw Philox bits by the Box-Muller transform, which
agrees with and without XLA up to float32 rounding of `log`/`cos`.

References:
  spec `d2p2.md`, sections 2.5 and 2.10; Ailon and Chazelle, "The fast
  Johnson-Lindenstrauss transform", 2009 (SRHT).
"""

import math

import numpy as np
import tensorflow as tf

from tfdpx import philox

# A Gaussian block holds at most this many entries (16 MiB of float32).
BLOCK_ENTRIES = 1 << 22


def projected_dim(d: int, ratio: float) -> int:
  """`p = max(1, floor(ratio * d))` (spec P9)."""
  return max(1, int(math.floor(ratio * d)))


def default_block_rows(d: int, p: int) -> int:
  """Rows per Gaussian block: at most `BLOCK_ENTRIES` entries, at most d rows."""
  return max(1, min(d, BLOCK_ENTRIES // p))


def standard_normal_f32(shape, key) -> tf.Tensor:
  """N(0, 1) float32 draws by Box-Muller from raw Philox bits.

  Each pair of uniforms gives two independent normals, `r cos t` and
  `r sin t`: the random bits (the bulk of the cost on a CPU) and the
  logarithms are those of half the draws.
  """
  shape = tf.cast(shape, tf.int32)
  size = tf.reduce_prod(shape)
  bits = tf.bitwise.right_shift(  # 24 random bits.
      philox.bits(tf.stack([2, (size + 1) // 2]), key), 8)
  u = (tf.cast(bits, tf.float32) + 0.5) * (2.0**-24)  # In (0, 1).
  radius = tf.sqrt(-2.0 * tf.math.log(u[0]))
  angle = (2.0 * math.pi) * u[1]
  pairs = tf.concat([radius * tf.cos(angle), radius * tf.sin(angle)], 0)
  return tf.reshape(pairs[:size], shape)


def gaussian_block(key, block, block_rows: int, p: int) -> tf.Tensor:
  """Rows `block * block_rows ...` of `A` (some may lie past row d)."""
  return standard_normal_f32([block_rows, p], philox.fold_in(key, block))


def _num_blocks(d, block_rows):
  return -(-d // block_rows)


def gaussian_forward(x, key, p: int, block_rows: int = None) -> tf.Tensor:
  """`A^T x` for a flat float32 `x` of length d, blockwise."""
  d = int(x.shape[0])
  block_rows = block_rows or default_block_rows(d, p)
  blocks = _num_blocks(d, block_rows)
  rows = tf.reshape(tf.pad(x, [[0, blocks * block_rows - d]]),
                    [blocks, block_rows])

  def body(j, acc):
    a = gaussian_block(key, j, block_rows, p)
    return j + 1, acc + tf.linalg.matvec(a, rows[j], transpose_a=True)

  _, out = tf.while_loop(lambda j, _: j < blocks, body,
                         (tf.constant(0), tf.zeros([p], tf.float32)))
  return out


def gaussian_backward(v, key, d: int, block_rows: int = None) -> tf.Tensor:
  """`A v` (length d) for a float32 `v` of length p, blockwise."""
  p = int(v.shape[0])
  block_rows = block_rows or default_block_rows(d, p)
  blocks = _num_blocks(d, block_rows)
  parts = tf.TensorArray(tf.float32, size=blocks,
                         element_shape=[block_rows])

  def body(j, parts):
    a = gaussian_block(key, j, block_rows, p)
    return j + 1, parts.write(j, tf.linalg.matvec(a, v))

  _, parts = tf.while_loop(lambda j, _: j < blocks, body,
                           (tf.constant(0), parts))
  return tf.reshape(parts.stack(), [-1])[:d]


def gaussian_dense(key, d: int, p: int, block_rows: int = None) -> tf.Tensor:
  """The whole `A` (d x p). For tests and small d only."""
  block_rows = block_rows or default_block_rows(d, p)
  blocks = [gaussian_block(key, j, block_rows, p)
            for j in range(_num_blocks(d, block_rows))]
  return tf.concat(blocks, axis=0)[:d]


def gaussian_max_singular_value(key, d: int, p: int,
                                block_rows: int = None) -> tf.Tensor:
  """Exact `sigma_max(A)` (float64) from the p x p Gram matrix, blockwise.

  `A^T A` is accumulated in float64 from the float32 blocks (the cast is
  exact) and its largest eigenvalue taken by `eigvalsh`: no power iteration,
  which would only give a lower bound. Cost O(d p^2 + p^3).
  """
  block_rows = block_rows or default_block_rows(d, p)
  blocks = _num_blocks(d, block_rows)
  valid = tf.reshape(
      tf.cast(tf.range(blocks * block_rows) < d, tf.float64),
      [blocks, block_rows, 1])

  def body(j, gram):
    a = tf.cast(gaussian_block(key, j, block_rows, p), tf.float64) * valid[j]
    return j + 1, gram + tf.matmul(a, a, transpose_a=True)

  _, gram = tf.while_loop(lambda j, _: j < blocks, body,
                          (tf.constant(0), tf.zeros([p, p], tf.float64)))
  return tf.sqrt(tf.maximum(tf.reduce_max(tf.linalg.eigvalsh(gram)), 0.0))


# --- SRHT --------------------------------------------------------------------


def padded_dim(d: int) -> int:
  """d' = the smallest power of two >= d."""
  return 1 << max(0, (d - 1).bit_length())


# The Hadamard transform applies `H_s` (`s x s`, s <= FWHT_BLOCK) along one
# axis at a time: `H_n` is the Kronecker product of such factors (Sylvester
# order), so log2(n) / 6 matmuls replace the log2(n) butterfly stages of half
# a dozen graph ops each (the MLP's 2^17-entry kernel: 17).
FWHT_BLOCK = 64


def _sylvester(size: int) -> np.ndarray:
  """The `size x size` Walsh-Hadamard matrix (Sylvester order)."""
  h = np.ones([1, 1], np.float32)
  while h.shape[0] < size:
    h = np.block([[h, h], [h, -h]])
  return h


def fwht(x: tf.Tensor) -> tf.Tensor:
  """Unnormalized Walsh-Hadamard transform (Sylvester order) of a flat x.

  The length must be a power of two; `fwht(fwht(x)) = len(x) * x`.
  """
  n = int(x.shape[0])
  factors = []
  while math.prod(factors) < n:
    factors.append(min(n // math.prod(factors), FWHT_BLOCK))
  # A smaller remainder factor first: the batched products in the middle
  # then have wide rows (2^21: 3.1 against 4.0 ms). The factors of a
  # Sylvester matrix commute: H_2^(a+b) = H_2^a (x) H_2^b in either order.
  factors = factors[-1:] + factors[:-1]
  if len(factors) <= 1:  # n <= FWHT_BLOCK; n = 1 has no factor.
    return tf.linalg.matvec(tf.constant(_sylvester(n), x.dtype), x)
  # `H_n = H_a (x) H_b (x) ...` acts on x laid out row-major as an array of
  # shape `factors`, one axis per factor. Each axis is multiplied where it
  # lies (first from the left, middle ones as a batch, last from the right):
  # no transposes, which cost as much as the products.
  y = tf.reshape(x, [factors[0], -1])
  y = tf.matmul(tf.constant(_sylvester(factors[0]), x.dtype), y)
  before = factors[0]
  for s in factors[1:-1]:
    y = tf.matmul(tf.constant(_sylvester(s), x.dtype),
                  tf.reshape(y, [before, s, -1]))
    before *= s
  y = tf.matmul(tf.reshape(y, [-1, factors[-1]]),
                tf.constant(_sylvester(factors[-1]), x.dtype))
  return tf.reshape(y, [n])


# Rounds of the Feistel permutation that picks the SRHT rows: more than the
# four that make a keyed Feistel network a pseudo-random permutation.
FEISTEL_ROUNDS = 8


# Compiled by XLA wherever it runs: TensorFlow's gather costs about 2.5 ns per
# index on a CPU (0.6 ms for the MLP's 30k rows over eight rounds), while XLA
# fuses the rounds into one loop (0.2 ms). The output is the same integers.
@tf.function(jit_compile=True)
def feistel_permutation(indices, key, bits: int) -> tf.Tensor:
  """A keyed bijection of [0, 2^bits) applied to int32 `indices`.

  An alternating Feistel network: each round XORs one half of the index with
  a random table looked up at the other half, which is invertible whatever the
  table, so distinct indices have distinct images. The tables are Philox bits
  of `key`; everything is integer arithmetic, equal on every backend. This
  replaces sorting 2^bits random keys (8 ms at 2^17 on a CPU core, every step).
  """
  low_bits = bits // 2
  high_bits = bits - low_bits
  low_mask, high_mask = (1 << low_bits) - 1, (1 << high_bits) - 1
  # All rounds' tables from one draw (one op, not one per round: each random
  # op is dozens of graph nodes).
  tables = tf.cast(philox.bits([FEISTEL_ROUNDS, 1 << high_bits], key),
                   tf.int32)
  high = tf.bitwise.right_shift(indices, low_bits)
  low = tf.bitwise.bitwise_and(indices, low_mask)
  for r in range(FEISTEL_ROUNDS):
    if r % 2 == 0:  # high ^= T_r(low)
      high = tf.bitwise.bitwise_xor(high, tf.bitwise.bitwise_and(
          tf.gather(tables[r], low), high_mask))
    else:  # low ^= T_r(high)
      low = tf.bitwise.bitwise_xor(low, tf.bitwise.bitwise_and(
          tf.gather(tables[r], high), low_mask))
  return tf.bitwise.bitwise_or(tf.bitwise.left_shift(high, low_bits), low)


# Compiled by XLA wherever it runs: TensorFlow's CPU kernels write the
# `[words, 32]` shifted words, then the bits, then the floats (1.6 ms a step
# for the text model's 2^21 signs); XLA makes them in one loop. The output is
# the same numbers.
@tf.function(jit_compile=True)
def _signs(drawn) -> tf.Tensor:
  """One sign (float32 +-1) per bit of the uint32 words `drawn`: bit b of
  word w is the sign of row 32 w + b."""
  bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(
      drawn[:, tf.newaxis], tf.constant(np.arange(32, dtype=np.uint32))), 1)
  return 1.0 - 2.0 * tf.cast(tf.reshape(bits, [-1]), tf.float32)


def srht_parts(key, d: int, p: int):
  """The random signs `[d']` (float32 +-1) and chosen rows `[p]` (int32)."""
  dp = padded_dim(d)
  if p > dp:
    raise ValueError(f'cannot choose p={p} rows out of {dp}')
  drawn = philox.bits([-(-dp // 32)], key)
  signs = _signs(drawn)[:dp]
  rows = feistel_permutation(tf.range(p, dtype=tf.int32),
                             philox.fold_in_from(drawn, 1),
                             dp.bit_length() - 1)
  return signs, rows


# Compiled by XLA wherever it runs: TensorFlow's CPU scatters take about 10
# ns per row (UnsortedSegmentSum; scatter_nd is slower still), XLA's loop 2.5
# (1.0 against 4.2 ms for the text model's 384k of 2^21 rows).
@tf.function(jit_compile=True)
def _spread(v, rows, size: int) -> tf.Tensor:
  """`[size]` zeros with `v` at the distinct `rows`."""
  return tf.scatter_nd(rows[:, tf.newaxis], v, [size])


def srht_forward(x, key, p: int, parts=None) -> tf.Tensor:
  """`R x` (length p) for a flat float32 `x` of length d.

  `parts`: `srht_parts(key, d, p)` if already drawn.
  """
  d = int(x.shape[0])
  dp = padded_dim(d)
  signs, rows = srht_parts(key, d, p) if parts is None else parts
  mixed = fwht(signs * tf.pad(x, [[0, dp - d]])) * (1.0 / math.sqrt(dp))
  return tf.gather(mixed, rows)


def srht_backward(v, key, d: int, parts=None) -> tf.Tensor:
  """`R^T v` (length d) for a float32 `v` of length p; `parts` as above."""
  p = int(v.shape[0])
  dp = padded_dim(d)
  signs, rows = srht_parts(key, d, p) if parts is None else parts
  spread = _spread(v, rows, dp)
  return (signs * fwht(spread) * (1.0 / math.sqrt(dp)))[:d]
