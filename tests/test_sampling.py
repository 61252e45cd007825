"""Poisson sampling with fixed-shape masked batches."""

import numpy as np
import tensorflow as tf

import tfdpx
from tfdpx import sampling


def _batches(seed, steps=200, n=100, q=0.1):
  x = np.arange(n, dtype=np.float32)[:, None]
  y = np.arange(n, dtype=np.int32)
  return list(sampling.poisson_batches(x, y, sampling_probability=q,
                                       steps=steps, seed=seed))


def test_batches_have_one_shape_and_binomial_sizes():
  batches = _batches(0)
  size = sampling.max_batch_size(100, 0.1)
  assert all(b[0].shape == (size, 1) and b[2].shape == (size,)
             for b in batches)
  counts = np.array([b[2].numpy().sum() for b in batches])
  # Binomial(100, 0.1): mean 10, variance 9; 200 draws.
  assert abs(counts.mean() - 10) < 5 * 3 / np.sqrt(200)
  assert abs(counts.var() / 9 - 1) < 5 * np.sqrt(2 / 199)


def test_each_example_is_sampled_with_probability_q():
  batches = _batches(1, steps=400)
  hits = np.zeros(100)
  for x, _, w in batches:
    np.add.at(hits, x.numpy()[:, 0].astype(int), w.numpy())
  # Each count is Binomial(400, 0.1): sd 6.
  assert np.all(np.abs(hits - 40) < 5 * 6)


def test_sampling_is_a_function_of_the_seed():
  first, again, other = _batches(2, 5), _batches(2, 5), _batches(3, 5)
  for a, b in zip(first, again):
    np.testing.assert_array_equal(a[0], b[0])
  assert any(not np.array_equal(a[2], c[2]) for a, c in zip(first, other))


def test_padding_contributes_nothing_and_the_denominator_is_expected():
  n, q = 40, 0.25
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 3)).astype('float32')
  y = (x[:, 0] > 0).astype('int32')
  (xb, yb, wb), = list(sampling.poisson_batches(
      x, y, sampling_probability=q, steps=1, seed=4))
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))])
  kernel = model.get_weights()[0].copy()
  loss = tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
  model.compile(tfdpx.keras.DPSGD(privatizer=tfdpx.privatizers.gaussian(
      1e9, 0.0), expected_batch_size=n * q, learning_rate=1.0), loss)
  model.train_on_batch(xb, yb, sample_weight=wb)
  sampled = wb.numpy() > 0
  # Reference: the sum of the sampled examples' gradients over q * n (the
  # bias starts at zero, so the logits are x @ kernel).
  logits = xb.numpy()[sampled] @ kernel
  probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
  probs[np.arange(len(probs)), yb.numpy()[sampled]] -= 1
  expected = kernel - xb.numpy()[sampled].T @ probs / (n * q)
  np.testing.assert_allclose(model.get_weights()[0], expected, rtol=1e-5,
                             atol=1e-6)
  assert 0 < sampled.sum() < len(sampled)
