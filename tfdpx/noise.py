"""Gaussian noise: the only place tfdpx draws noise.

All draws are `tf.random.stateless_normal`, keyed by the step's seed, a named
stream and the variable index, so a privatizer stays a pure function and two
releases of one step never share a draw.
"""

import zlib
from typing import List, Sequence

import tensorflow as tf


def substream(seed: tf.Tensor, name: str) -> tf.Tensor:
  """The seed of the named random stream `name` derived from `seed`.

  Args:
    seed: int64 tensor of shape `[2]`.
    name: a stable label (e.g. "alpha", "perp", "mask"); equal names give equal
      streams, different names independent ones.

  Returns:
    An int64 tensor of shape `[2]`.
  """
  label = zlib.crc32(name.encode()) & 0x7FFFFFFF
  return tf.random.experimental.stateless_fold_in(seed, label)


def gaussian_like(
    tensors: Sequence[tf.Tensor], stddev, seed: tf.Tensor
) -> List[tf.Tensor]:
  """Independent N(0, stddev^2) noise shaped like each tensor in `tensors`.

  Args:
    tensors: tensors whose shape and dtype the noise takes.
    stddev: standard deviation (Python number or scalar tensor).
    seed: int64 `[2]` seed; tensor `i` uses `fold_in(seed, i)`.

  Returns:
    One noise tensor per input.
  """
  noise = []
  for i, t in enumerate(tensors):
    key = tf.random.experimental.stateless_fold_in(seed, i)
    draw = tf.random.stateless_normal(tf.shape(t), key, dtype=tf.float32)
    noise.append(tf.cast(draw * tf.cast(stddev, tf.float32), t.dtype))
  return noise


def gaussian_sum(
    records: Sequence[tf.Tensor], l2_norm_clip, noise_multiplier, seed: tf.Tensor
) -> List[tf.Tensor]:
  """Sum over the batch axis plus Gaussian noise of std `l2_norm_clip * noise_multiplier`.

  The records must already be clipped so that, over all tensors together, each
  example's L2 norm is at most `l2_norm_clip`: then this is the Gaussian
  mechanism with noise multiplier `noise_multiplier`.

  Args:
    records: one `[B, ...]` tensor per variable (or per released part).
    l2_norm_clip: the L2 bound of one example's records.
    noise_multiplier: noise std in units of `l2_norm_clip`.
    seed: int64 `[2]` seed of this release.

  Returns:
    One `[...]` tensor per record tensor.
  """
  sums = [tf.reduce_sum(r, axis=0) for r in records]
  stddev = tf.cast(l2_norm_clip, tf.float32) * tf.cast(noise_multiplier,
                                                       tf.float32)
  return [s + n for s, n in zip(sums, gaussian_like(sums, stddev, seed))]
