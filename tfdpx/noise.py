"""Sums over the batch and Gaussian noise: the only place tfdpx draws noise.

All draws come from stateless Philox bits keyed by the step's seed and a
named stream (one draw per release, split over the variables), so a
privatizer stays a pure function and two releases of one step never share a
draw.

Under a `tf.distribute` strategy every replica sums its own examples
(`batch_sum`), the sums are all-reduced (`replica_sum`, once a step in
`Privatizer.update`), and every replica then draws the same noise from
the same seed: the noise of a step is added once to the global sum, never once
per replica.

Correlated noise across steps (`tfdpx.privatizers.correlated`) is drawn here
too: while a step releases under `correlated_releases`, each `add_gaussian`
of the step adds its strategy's correlated noise (`tfdpx.correlation`) in
place of independent noise.
"""

import contextlib
import math
import threading
import zlib
from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from tfdpx import gradients
from tfdpx import philox
from tfdpx import xla


def _float64(value) -> tf.Tensor:
  # tf.cast of a Python float goes through float32 (0.7 -> 0.69999999).
  if tf.is_tensor(value):
    return tf.cast(value, tf.float64)
  return tf.constant(value, tf.float64)


# The radius of a pair of draws reads a 53-bit uniform, but its last 13 bits
# matter only in the tails: a pair reads them (its third word) only if its
# first word lies within `_EDGE` of 0 or of 2^32, one pair in 2^20. The
# third words come in blocks of `_BLOCK` pairs, drawn only for the blocks
# that hold such a pair (a draw of 1.3 million holds 0.6 on average).
_EDGE = 2**11
_BLOCK = 4096


def standard_normal(shape, seed: tf.Tensor, stddev=1.0,
                    dtype=tf.float64) -> tf.Tensor:
  """N(0, stddev^2) draws of `shape`, from raw Philox bits.

  `tf.random.stateless_normal` gives different numbers under XLA than on the
  default CPU kernels for the same seed, and its float32 version cannot
  reach past 5.7 standard deviations; the raw Philox bits agree on every
  backend, so the normals are made from them here: `box_muller` of the
  columns of one `[3, pairs]` draw (pairs rounded up to whole blocks of
  `_BLOCK`), with row 2 read by block: the r-th block (in order) that holds
  a pair in the radius's tails reads the r-th block of row 2. Only the words
  read are drawn: rows 0 and 1 whole, and as many blocks of row 2 as there
  are such blocks (one contiguous draw), so a draw costs about two 32-bit
  words per pair instead of three. Under XLA, which needs static shapes,
  row 2 is drawn whole, its blocks gathered, and `box_muller` takes the
  three rows: the same draws. Every
  pair's words are independent uniform words, whichever block of row 2 it
  reads.

  Args:
    shape: output shape (list or 1-D int tensor).
    seed: int64 `[2]` seed.
    stddev: standard deviation (Python number or scalar tensor); it scales
      the radius of each pair (half the products of scaling the draws).
    dtype: tf.float64 or tf.float32 (the precision the noise is added at:
      the radius is computed in float64 either way).

  Returns:
    A tensor of `shape` and `dtype`.
  """
  shape = tf.cast(shape, tf.int32)
  size = tf.reduce_prod(shape)
  blocks = ((size + 1) // 2 + _BLOCK - 1) // _BLOCK
  pairs = blocks * _BLOCK
  words = philox.bits(tf.stack([2, pairs]), seed)  # Rows 0 and 1.
  high = _high(words[0], words[1])
  in_tails = _in_tails(high)
  by_block = tf.stack([blocks, _BLOCK])
  marked = tf.reduce_any(tf.reshape(in_tails, by_block), axis=1)
  if xla.in_xla():
    rank = tf.cumsum(tf.cast(marked, tf.int32), exclusive=True)
    third = tf.gather(philox.bits(by_block, seed, offset=2 * pairs), rank)
    draws = box_muller(tf.concat([words, tf.reshape(third, [1, -1])], 0),
                       stddev, dtype)
  else:
    log_u = _log_uniform(high)
    ids = tf.where(marked)[:, 0]
    third = philox.bits(tf.stack([tf.size(ids), _BLOCK]), seed,
                        offset=2 * pairs)
    log_u = tf.reshape(log_u, by_block)
    exact = tf.where(
        tf.gather(tf.reshape(in_tails, by_block), ids),
        _log_uniform(tf.gather(tf.reshape(high, by_block), ids), third),
        tf.gather(log_u, ids))
    log_u = tf.reshape(
        tf.tensor_scatter_nd_update(log_u, ids[:, tf.newaxis], exact), [-1])
    draws = _pairs(log_u, words[1], stddev, dtype)
  return tf.reshape(draws[:size], shape)


def box_muller(bits: tf.Tensor, stddev=1.0, dtype=tf.float64) -> tf.Tensor:
  """Two N(0, stddev^2) draws from each column of three 32-bit words.

  The radius `sqrt(-2 log u)` takes a 53-bit uniform `u = (k + 1/2) 2^-53`
  (`k`: word 0, then the low 8 bits of word 1, then the high 13 of word 2),
  so draws reach 8.6 standard deviations, as far as float64 inverse-CDF
  sampling does: a tail cut short at 5.7 (a float32 uniform) would leave
  outputs only a neighbouring dataset can produce. The last 13 bits are read
  only in the tails, where word 0 is below 2^11 or at least 2^32 - 2^11
  (`u` below 2^-21 or above 1 - 2^-21: a radius above 5.4 or below 0.001).
  Elsewhere they are set to their middle: that moves `u` by less than
  2^-41 and the radius by less than a relative 5e-7 (8 float32 units in the
  last place at most, far less inside), and lets `standard_normal` draw
  word 2 only where a pair needs it. The angle only sets the sign and split
  between the two draws; 24 bits in float32 (the high bits of word 1) give
  it to float32 precision, which is what the noise is added at, at a third
  of the cost of float64 trigonometry.

  Args:
    bits: uint32 `[3, n]`.
    stddev: standard deviation (Python number or scalar tensor).
    dtype: tf.float64 or tf.float32.

  Returns:
    `[2 n]` of `dtype`: the cosine draws, then the sine draws.
  """
  high = _high(bits[0], bits[1])
  log_u = tf.where(_in_tails(high), _log_uniform(high, bits[2]),
                   _log_uniform(high))
  return _pairs(log_u, bits[1], stddev, dtype)


def _high(first: tf.Tensor, second: tf.Tensor) -> tf.Tensor:
  """The 40 high bits of `box_muller`'s `k` (word 0, then the low 8 bits of
  word 1), float64 (exact)."""
  return tf.cast(first, tf.float64) * 2.0**8 + tf.cast(
      tf.bitwise.bitwise_and(second, 255), tf.float64)


def _in_tails(high: tf.Tensor) -> tf.Tensor:
  """Whether word 0 is within `_EDGE` of 0 or of 2^32 (`high` below
  `_EDGE 2^8` or at least `2^40 - _EDGE 2^8`: symmetric about the middle,
  and exact in float64)."""
  middle = (2.0**40 - 1) / 2
  return tf.abs(high - middle) > middle - _EDGE * 2.0**8


def _log_uniform(high: tf.Tensor, third: Optional[tf.Tensor] = None
                 ) -> tf.Tensor:
  """`log u` (float64) of `box_muller`'s `u` from `_high` and word 2.

  Without word 2, `u`'s last 13 bits at their middle. With it, the exact
  `u`, from `1 - u` above 1/2, so that a radius near 0 keeps its precision
  too.
  """
  if third is None:
    return tf.math.log((high + 0.5) * 2.0**-40)
  k = high * 2.0**13 + tf.cast(tf.bitwise.right_shift(third, 19), tf.float64)
  # Both exact: u = (k + 1/2) 2^-53, and u - 1 = (k + 1/2 - 2^53) 2^-53.
  return tf.where(k < 2.0**52, tf.math.log((k + 0.5) * 2.0**-53),
                  tf.math.log1p((k - 2.0**53 + 0.5) * 2.0**-53))


def _pairs(log_u: tf.Tensor, angle_word: tf.Tensor, stddev,
           dtype) -> tf.Tensor:
  """The cosine draws, then the sine draws, of radii `sqrt(-2 log u)`."""
  radius = tf.sqrt(-2.0 * log_u) * _float64(stddev)
  turn = tf.cast(tf.bitwise.right_shift(angle_word, 8), tf.float32)
  angle = (turn + 0.5) * (2.0 * math.pi * 2.0**-24)
  trig = tf.stack([tf.cos(angle), tf.sin(angle)])
  if dtype == tf.float32:
    return tf.reshape(tf.cast(radius, tf.float32) * trig, [-1])
  if dtype != tf.float64:
    raise ValueError(f'dtype must be tf.float32 or tf.float64, got {dtype!r}')
  return tf.reshape(radius * tf.cast(trig, tf.float64), [-1])


def substream(seed: tf.Tensor, name: str) -> tf.Tensor:
  """The seed of the named random stream `name` derived from `seed`.

  Args:
    seed: int64 tensor of shape `[2]`.
    name: a stable label (e.g. "alpha", "perp", "mask"); equal names give equal
      streams, different names independent ones.

  Returns:
    An int32 tensor of shape `[2]` (a valid stateless seed).
  """
  label = zlib.crc32(name.encode()) & 0x7FFFFFFF
  return philox.fold_in(seed, label)


def gaussian_like(
    tensors: Sequence[tf.Tensor], stddev, seed: tf.Tensor
) -> List[tf.Tensor]:
  """Independent N(0, stddev^2) noise shaped like each tensor in `tensors`.

  One draw of all the coordinates from `seed`, split per tensor (one random
  op per release, not one per variable).

  Args:
    tensors: tensors whose shape and dtype the noise takes.
    stddev: standard deviation (Python number or scalar tensor).
    seed: int64 `[2]` seed of this release.

  Returns:
    One noise tensor per input.
  """
  tensors = [tf.convert_to_tensor(t) for t in tensors]
  sizes = [tf.size(t) for t in tensors]
  dtype = (tf.float64 if any(t.dtype == tf.float64 for t in tensors) else
           tf.float32)
  draws = tf.split(
      standard_normal(tf.reshape(tf.add_n(sizes), [1]), seed, stddev, dtype),
      tf.stack(sizes), num=len(tensors))
  return [tf.cast(tf.reshape(d, tf.shape(t)), t.dtype)
          for d, t in zip(draws, tensors)]


def replica_sum(sums: Sequence[tf.Tensor]) -> List[tf.Tensor]:
  """All-reduces each replica's sums under `tf.distribute`; identity otherwise.

  Args:
    sums: one tensor per variable (or per released part): this replica's sum
      over its examples.

  Returns:
    The sums over the global batch, identical on every replica.
  """
  sums = list(sums)
  context = tf.distribute.get_replica_context()
  if context is not None and context.num_replicas_in_sync > 1:
    sums = context.all_reduce(tf.distribute.ReduceOp.SUM, sums)
  return sums


def batch_sum(records, weights: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
  """Sum over this replica's batch of each record, optionally weighted.

  Every privatizer's `clipped_sums` sums its (clipped) per-example records
  with this function; `Privatizer.update` all-reduces the sums of a step
  (`replica_sum`) before `release`.

  Args:
    records: a `tfdpx.gradients.PerExampleGradients` (its `weighted_sum`: a
      model made private answers it with one backward pass) or one `[B, ...]`
      tensor per variable (or per released part).
    weights: optional `[B]` factors (e.g. clip factors): the sum is then
      `sum_b weights[b] * records[b]`, and the weighted records are never
      materialized.

  Returns:
    One `[...]` tensor per variable.
  """
  records = gradients.as_per_example_gradients(records)
  if weights is None:
    weights = tf.ones([records.batch_size()], tf.float32)
  return records.weighted_sum(weights)


class CorrelatedReleases:
  """The Gaussian releases of one step, drawn as correlated noise.

  The `i`-th `add_gaussian` of the step draws N(0, 1) noise shaped like its
  sums, turns it into this step's correlated noise with the history of
  release `i` (`correlate(draws, history) -> (noise, new_history)`) and
  scales it by its own std.
  """

  def __init__(self, correlate: Callable, histories: Sequence[List[tf.Tensor]]):
    self._correlate = correlate
    self._histories = list(histories)
    self.new_histories: List[List[tf.Tensor]] = []

  def draw(self, sums: Sequence[tf.Tensor], stddev,
           seed: tf.Tensor) -> List[tf.Tensor]:
    """The correlated noise of the step's next release, std `stddev`."""
    i = len(self.new_histories)
    if i >= len(self._histories):
      raise ValueError(
          f'this step made more Gaussian releases than the {i} its privatizer '
          'declared (gaussian_release_shapes)')
    history = self._histories[i]
    shapes = [tuple(s.shape) for s in sums]
    # Each part's history: its last noises, shaped like the part.
    declared = [tuple(h[0].shape) if h else shape
                for h, shape in zip(history, shapes)]
    if len(history) != len(shapes) or shapes != declared:
      raise ValueError(
          f'Gaussian release {i} has shapes {shapes}, but its privatizer '
          f'declared {declared} (gaussian_release_shapes)')
    draws = gaussian_like(sums, 1.0, seed)
    noise, new_history = self._correlate(draws, history)
    self.new_histories.append(new_history)
    return [n * tf.cast(stddev, n.dtype) for n in noise]

  def check_complete(self) -> None:
    """Raises a ValueError unless every declared release was drawn."""
    if len(self.new_histories) != len(self._histories):
      raise ValueError(
          f'this step made {len(self.new_histories)} Gaussian releases, but '
          f'its privatizer declared {len(self._histories)} '
          '(gaussian_release_shapes)')


# The releases being drawn as correlated noise, per thread (MirroredStrategy
# traces each replica's step in its own thread).
_ACTIVE = threading.local()


@contextlib.contextmanager
def correlated_releases(releases: CorrelatedReleases):
  """Within this context `add_gaussian` draws through `releases`."""
  previous = getattr(_ACTIVE, 'releases', None)
  if previous is not None:
    raise ValueError('correlated noise cannot be nested')
  _ACTIVE.releases = releases
  try:
    yield releases
  finally:
    _ACTIVE.releases = None


def add_gaussian(sums: Sequence[tf.Tensor], l2_norm_clip, noise_multiplier,
                 seed: tf.Tensor) -> List[tf.Tensor]:
  """Adds N(0, (l2_norm_clip * noise_multiplier)^2) noise to each coordinate.

  Under `correlated_releases` the noise is instead the strategy's
  combination of this step's and earlier steps' draws of that std (row t of
  `C^-1 z`, `tfdpx.correlation`).

  Args:
    sums: sums over the global batch of records clipped so that, over all
      tensors together, each example's L2 norm is at most `l2_norm_clip`: then
      this is the Gaussian mechanism with noise multiplier `noise_multiplier`.
    l2_norm_clip: the L2 bound of one example's records.
    noise_multiplier: noise std in units of `l2_norm_clip`.
    seed: int64 `[2]` seed of this release.

  Returns:
    One noisy tensor per sum.
  """
  # multiply_no_nan: zero noise stays zero for an infinite clip norm.
  stddev = tf.math.multiply_no_nan(_float64(l2_norm_clip),
                                   _float64(noise_multiplier))
  releases = getattr(_ACTIVE, 'releases', None)
  if releases is not None:
    noise = releases.draw(sums, stddev, seed)
  else:
    noise = gaussian_like(sums, stddev, seed)
  return [s + n for s, n in zip(sums, noise)]


def bernoulli_positions(size: int, rate: float, seed: tf.Tensor,
                        chunk: int = None) -> tf.Tensor:
  """The positions `j < size` of a Bernoulli(`rate`) process, ascending.

  Each position is in the result independently with probability `rate`,
  but the cost grows with the number drawn, `size * rate` on average, not
  with `size`: the gaps between positions are geometric, `floor(log u /
  log(1 - rate)) + 1` for a 53-bit uniform `u` (`P(gap > k) = P(u <= (1 -
  rate)^k) = (1 - rate)^k`), drawn a chunk at a time until past `size`
  (one chunk, without a loop, unless the positions outnumber their mean by
  six standard deviations). Not under XLA (the number drawn is random).

  Args:
    size: the number of positions, a Python int.
    rate: the probability of each, a Python float in [0, 1).
    seed: int64 `[2]` seed of this draw.
    chunk: gaps drawn at a time (default: their mean number plus six
      standard deviations, plus 16).

  Returns:
    int32 `[n]`, ascending.
  """
  if rate == 0 or size == 0:
    return tf.zeros([0], tf.int32)
  mean = size * rate
  chunk = chunk or int(math.ceil(mean + 6 * math.sqrt(mean) + 16))
  log_keep = math.log1p(-rate)

  def gaps_after(index, last):
    """Positions after `last` from chunk `index` of the gaps."""
    words = philox.bits([2, chunk], philox.fold_in(seed, index))
    # A 53-bit uniform in (0, 1): 32 high bits, then 21 more.
    k = (tf.cast(words[0], tf.float64) * 2.0**21 + tf.cast(
        tf.bitwise.right_shift(words[1], 11), tf.float64))
    gaps = tf.floor(tf.math.log((k + 0.5) * 2.0**-53) / log_keep) + 1
    # Past `size` every gap ends the draw; capped so the sum stays exact.
    gaps = tf.cast(tf.minimum(gaps, float(size) + 1), tf.int64)
    return last + tf.cumsum(gaps)

  def draw(index, last, found):
    positions = gaps_after(index, last)
    return (index + 1, positions[-1],
            found.write(index, positions[positions < size]))

  def more():
    # Rarely (the chunk is the mean plus 6 standard deviations): a loop.
    _, _, found = tf.while_loop(
        lambda index, last, found: last < size, draw,
        (tf.constant(1), first[-1],
         tf.TensorArray(tf.int64, size=1, dynamic_size=True,
                        infer_shape=False).write(0, first)))
    return found.concat()

  first = gaps_after(tf.constant(0), tf.constant(-1, tf.int64))
  # One chunk almost always reaches past `size`: no loop in the step.
  found = tf.cond(first[-1] >= size, lambda: first[first < size], more)
  return tf.reshape(tf.cast(found, tf.int32), [-1])
