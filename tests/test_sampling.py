"""Poisson sampling with fixed-shape masked batches."""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import sampling
from tests.compile_path import trainable


def _dataset(seed, steps=200, n=100, q=0.1):
  x = np.arange(1, n + 1, dtype=np.float32)[:, None]  # No example is zero.
  y = np.arange(1, n + 1, dtype=np.int32)
  return sampling.poisson_batches(x, y, sampling_probability=q, steps=steps,
                                  seed=seed)


def _iterations(dataset, count=2):
  """`count` iterations over `dataset`, as `fit` makes one per epoch."""
  return [[tuple(t.numpy() for t in batch) for batch in dataset]
          for _ in range(count)]


def _members(batch):
  """The indices of the examples sampled into `batch`."""
  x, _, w = batch
  return set(x[w > 0, 0].astype(int) - 1)


@pytest.mark.parametrize('seed', [0, None])
def test_every_iteration_has_one_shape_and_binomial_sizes(seed):
  size = sampling.max_batch_size(100, 0.1)
  for batches in _iterations(_dataset(seed)):
    assert all(b[0].shape == (size, 1) and b[2].shape == (size,)
               for b in batches)
    counts = np.array([b[2].sum() for b in batches])
    # Binomial(100, 0.1): mean 10, variance 9; 200 draws.
    assert abs(counts.mean() - 10) < stats.Z * 3 / np.sqrt(200)
    assert abs(counts.var() / 9 - 1) < stats.Z * np.sqrt(2 / 199)


def test_each_example_is_sampled_with_probability_q_in_every_iteration():
  for batches in _iterations(_dataset(1, steps=400)):
    hits = np.zeros(100)
    for batch in batches:
      hits[list(_members(batch))] += 1
    # Each count is Binomial(400, 0.1): sd 6.
    assert np.all(np.abs(hits - 40) < stats.Z * 6)


@pytest.mark.parametrize('seed', [1, None])
def test_iterations_draw_independent_samples(seed):
  """Keras re-iterates the dataset each epoch: the batches must be new."""
  first, second = _iterations(_dataset(seed))
  overlaps = np.array([len(_members(a) & _members(b))
                       for a, b in zip(first, second)])
  # Independent: each example is in both batches of a step with probability
  # q^2, so an overlap is Binomial(100, 0.01): mean 1, variance 0.99. (The
  # same batches again would give a mean of 10.)
  assert abs(overlaps.mean() - 1) < stats.Z * np.sqrt(0.99 / len(overlaps))


def test_a_known_seed_reproduces_every_iteration():
  first, again = _iterations(_dataset(2, 5)), _iterations(_dataset(2, 5))
  other = _iterations(_dataset(3, 5))
  for iteration, iteration_again in zip(first, again):
    for a, b in zip(iteration, iteration_again):
      np.testing.assert_array_equal(a[0], b[0])
  assert any(not np.array_equal(a[2], c[2])
             for a, c in zip(first[0], other[0]))
  assert any(not np.array_equal(a[0], b[0])
             for a, b in zip(first[0], first[1]))


def test_without_a_seed_each_dataset_has_its_own_secret():
  a, = _iterations(_dataset(None, 5), 1)
  b, = _iterations(_dataset(None, 5), 1)
  assert any(not np.array_equal(u[0], v[0]) for u, v in zip(a, b))


def test_the_secret_has_at_least_64_bits_of_os_entropy():
  draws = [sampling.secret_entropy() for _ in range(32)]
  assert len(set(draws)) == len(draws)
  # 128 uniform bits: each draw is below 2**64 with probability 2**-64.
  assert all(isinstance(d, int) and 2**64 <= d < 2**128 for d in draws)


def test_padding_rows_are_zeros_with_zero_weight():
  for batches in _iterations(_dataset(5, steps=20)):
    for x, y, w in batches:
      k = int(w.sum())
      assert 0 < k < len(w)
      np.testing.assert_array_equal(w, np.r_[np.ones(k), np.zeros(len(w) - k)])
      assert np.all(x[k:] == 0) and np.all(y[k:] == 0)
      assert np.all(x[:k] > 0)


def test_a_bad_seed_is_named():
  with pytest.raises(ValueError, match='seed'):
    _dataset(-1)


def test_padding_contributes_nothing_and_the_denominator_is_expected():
  n, q = 40, 0.25
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 3)).astype('float32')
  y = (x[:, 0] > 0).astype('int32')
  (xb, yb, wb), = list(sampling.poisson_batches(
      x, y, sampling_probability=q, steps=1, seed=4))
  tf.keras.utils.set_random_seed(0)
  model = trainable(
      tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(3,))]))
  kernel = model.get_weights()[0].copy()
  loss = tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction='none')
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


def _cyclic(steps, groups=4, n=100, q=0.5, first_step=0, seed=0):
  x = np.arange(1, n + 1, dtype=np.float32)[:, None]
  y = np.arange(1, n + 1, dtype=np.int32)
  return sampling.cyclic_poisson_batches(
      x, y, sampling_probability=q, groups=groups, steps=steps,
      first_step=first_step, seed=seed)


def test_cyclic_batches_sample_the_group_of_their_step():
  """Step t samples group t mod 4 only, each member with probability q, and
  the next iteration (epoch) continues the cycle: an example's steps are at
  least 4 apart across epochs too (7 steps an iteration)."""
  steps_of = {}
  counts = np.zeros(100)
  group_of = sampling.example_groups(100, 4, seed=0)
  batches = [b for iteration in _iterations(_cyclic(7), count=40)
             for b in iteration]
  for step, batch in enumerate(batches):
    members = _members(batch)
    assert all(group_of[i] == step % 4 for i in members), step
    for i in members:
      steps_of.setdefault(i, []).append(step)
      counts[i] += 1
  gaps = [b - a for s in steps_of.values() for a, b in zip(s, s[1:])]
  assert min(gaps) == 4
  # Each example is in 70 of its group's steps, each with probability 1/2.
  assert np.all(np.abs(counts - 35) < stats.Z * np.sqrt(70 / 4))


def test_cyclic_groups_are_drawn_for_each_example_independently():
  """Add/remove adjacency: an example's group must not depend on the
  others (groups by position, i mod 4, would move every later example when
  one is removed). Over 400 secret runs, each example is in each group a
  quarter of the time, and two examples share a group a quarter of the
  time, whether 1 or 4 positions apart (by position: never, always)."""
  runs = 400
  seen = np.array([sampling.example_groups(12, 4, sampling.secret_entropy())
                   for _ in range(runs)])
  for g in range(4):
    share = np.mean(seen == g, axis=0)
    assert np.all(np.abs(share - 0.25) < stats.Z * np.sqrt(0.1875 / runs))
  for gap in (1, 4):
    same = np.mean(seen[:, :-gap] == seen[:, gap:])
    assert abs(same - 0.25) < stats.Z * np.sqrt(0.1875 / runs)
  batches = _iterations(_cyclic(4, n=12, q=1.0), count=1)[0]
  assert sorted(i for b in batches for i in _members(b)) == list(range(12))


def test_cyclic_batches_resume_the_cycle_at_first_step():
  group_of = sampling.example_groups(100, 4, seed=0)
  resumed = _iterations(_cyclic(3, first_step=6), count=1)[0]
  assert [{group_of[i] for i in _members(b)} for b in resumed] == [
      {2}, {3}, {0}]
  with pytest.raises(ValueError, match='first_step'):
    _cyclic(3, first_step=-1)
  with pytest.raises(ValueError, match='needs its seed'):
    _cyclic(3, first_step=6, seed=None)
  with pytest.raises(ValueError, match='groups'):
    _cyclic(3, groups=0)
