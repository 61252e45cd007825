"""Poisson sampling for `tf.data` with fixed-shape, masked batches.

Each step, every example joins the batch independently with probability q,
which is what the RDP accountant assumes. To keep one shape (so XLA compiles
once), a batch is padded to `max_batch_size` rows; padded rows are zeros with
sample weight 0, so their per-example loss and gradient are exactly 0 and they
add nothing to the clipped sum. The privatized sum is divided by the public
expected batch size `q * n`, never by the realized size.
"""

import itertools
import math
from typing import Optional

import numpy as np
from scipy import stats
import tensorflow as tf

# Per-step probability that a Poisson batch has more examples than the padded
# shape holds (those extra examples would be dropped).
OVERFLOW_PROBABILITY = 1e-12


def max_batch_size(num_examples: int, sampling_probability: float) -> int:
  """The smallest size a Poisson batch exceeds with probability <= 1e-12."""
  return int(stats.binom.isf(OVERFLOW_PROBABILITY, num_examples,
                             sampling_probability)) + 1


def secret_entropy() -> int:
  """A fresh 128-bit secret from the operating system's entropy source."""
  return np.random.SeedSequence().entropy


def poisson_batches(x, y, *, sampling_probability: float, steps: int,
                    seed: Optional[int] = None,
                    batch_size: Optional[int] = None) -> tf.data.Dataset:
  """`steps` Poisson-sampled batches `(x, y, sample_weight)` of one shape.

  Every iteration over the dataset (Keras `fit` iterates it once per epoch)
  draws new, independent batches.

  Args:
    x: array of examples, `[n, ...]`.
    y: array of labels, `[n, ...]`.
    sampling_probability: q in (0, 1], each example's probability to be in a
      batch.
    steps: number of batches per iteration.
    seed: `None` (the default and the only private choice) draws a 128-bit
      secret from the operating system. An integer makes the sampling
      reproducible, for experiments only: iteration `i` of the dataset then
      depends only on `(seed, i)` (it differs between iterations). Whoever
      knows the seed knows which steps hold each example, which removes the
      amplification by subsampling that the Poisson epsilon relies on.
    batch_size: padded batch size; default `max_batch_size(n, q)`.

  Returns:
    A dataset of `steps` tuples whose `sample_weight` is 1 for sampled
    examples and 0 for padding rows, which are all zeros in `x` and `y`.

  Raises:
    ValueError: for a bad `sampling_probability` or `seed`.

  Privacy:
    A batch larger than `batch_size` would drop examples, which the
    accountant does not model; with the default size this happens with
    probability at most 1e-12 per step, and the statement's delta should be
    read as `delta + steps * 1e-12`.
  """
  n = len(x)
  if not 0 < sampling_probability <= 1:
    raise ValueError(f'sampling_probability must be in (0, 1], got '
                     f'{sampling_probability!r}')
  if seed is not None and (int(seed) != seed or seed < 0):
    raise ValueError(f'seed must be a non-negative integer or None, got '
                     f'{seed!r}')
  root = secret_entropy() if seed is None else int(seed)
  size = batch_size or max_batch_size(n, sampling_probability)
  x, y = np.asarray(x), np.asarray(y)
  iterations = itertools.count()

  def generate():
    # A new generator per iteration of the dataset, keyed by its index.
    rng = np.random.default_rng(
        np.random.SeedSequence(root, spawn_key=(next(iterations),)))
    for _ in range(steps):
      chosen = np.flatnonzero(rng.random(n) < sampling_probability)[:size]
      xb = np.zeros((size,) + x.shape[1:], x.dtype)
      yb = np.zeros((size,) + y.shape[1:], y.dtype)
      weight = np.zeros(size, np.float32)
      xb[:len(chosen)], yb[:len(chosen)], weight[:len(chosen)] = (
          x[chosen], y[chosen], 1)
      yield xb, yb, weight

  signature = (
      tf.TensorSpec((size,) + x.shape[1:], tf.as_dtype(x.dtype)),
      tf.TensorSpec((size,) + y.shape[1:], tf.as_dtype(y.dtype)),
      tf.TensorSpec((size,), tf.float32),
  )
  dataset = tf.data.Dataset.from_generator(generate,
                                           output_signature=signature)
  return dataset.apply(tf.data.experimental.assert_cardinality(steps))


def steps_per_epoch(num_examples: int, expected_batch_size: float) -> int:
  """Steps of one expected pass over the data, `ceil(n / expected batch)`."""
  return int(math.ceil(num_examples / expected_batch_size))
