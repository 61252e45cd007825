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
"""

import math
import zlib
from typing import List, Optional, Sequence

import tensorflow as tf

from tfdpx import gradients
from tfdpx import philox


def _float64(value) -> tf.Tensor:
  # tf.cast of a Python float goes through float32 (0.7 -> 0.69999999).
  if tf.is_tensor(value):
    return tf.cast(value, tf.float64)
  return tf.constant(value, tf.float64)


def standard_normal(shape, seed: tf.Tensor, stddev=1.0) -> tf.Tensor:
  """N(0, stddev^2) draws of `shape` in float64, from raw Philox bits.

  `tf.random.stateless_normal` gives different numbers under XLA than on the
  default CPU kernels for the same seed, and its float32 version cannot
  reach past 5.7 standard deviations; the raw Philox bits agree on every
  backend, so the normals are made from them here (`box_muller`).

  Args:
    shape: output shape (list or 1-D int tensor).
    seed: int64 `[2]` seed.
    stddev: standard deviation (Python number or scalar tensor); it scales
      the radius of each pair (half the products of scaling the draws).

  Returns:
    A float64 tensor of `shape`.
  """
  shape = tf.cast(shape, tf.int32)
  size = tf.reduce_prod(shape)
  pairs = (size + 1) // 2
  # One draw, in rows: each word's slice is contiguous.
  bits = philox.bits(tf.stack([3, pairs]), seed)
  return tf.reshape(box_muller(bits, stddev)[:size], shape)


def box_muller(bits: tf.Tensor, stddev=1.0) -> tf.Tensor:
  """Two N(0, stddev^2) float64 draws from each column of three 32-bit words.

  The radius `sqrt(-2 log u)` takes a 53-bit uniform `u` (words 0 and 1),
  so draws reach 8.6 standard deviations, as far as float64 inverse-CDF
  sampling does: a tail cut short at 5.7 (a float32 uniform) would leave
  outputs only a neighbouring dataset can produce. The angle only sets the
  sign and split between the two draws; 24 bits in float32 (word 2) give it
  to float32 precision, which is what the noise is added at, at a third of
  the cost of float64 trigonometry.

  Args:
    bits: uint32 `[3, n]`.
    stddev: standard deviation (Python number or scalar tensor).

  Returns:
    float64 `[2 n]`: the cosine draws, then the sine draws.
  """
  high = tf.cast(tf.bitwise.right_shift(bits[0], 5), tf.float64)
  low = tf.cast(tf.bitwise.right_shift(bits[1], 6), tf.float64)
  uniform = (high * 2.0**26 + low + 0.5) * 2.0**-53  # In (0, 1), never 0 or 1.
  radius = tf.sqrt(-2.0 * tf.math.log(uniform)) * _float64(stddev)
  turn = tf.cast(tf.bitwise.right_shift(bits[2], 8), tf.float32)
  angle = (turn + 0.5) * (2.0 * math.pi * 2.0**-24)
  return tf.reshape(
      radius * tf.cast(tf.stack([tf.cos(angle), tf.sin(angle)]), tf.float64),
      [-1])


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
  draws = tf.split(
      standard_normal(tf.reshape(tf.add_n(sizes), [1]), seed, stddev),
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


def add_gaussian(sums: Sequence[tf.Tensor], l2_norm_clip, noise_multiplier,
                 seed: tf.Tensor) -> List[tf.Tensor]:
  """Adds N(0, (l2_norm_clip * noise_multiplier)^2) noise to each coordinate.

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
  return [s + n for s, n in zip(sums, gaussian_like(sums, stddev, seed))]
