"""User-level privacy: users sampled, each user's examples one record."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import privatizers
from tfdpx import sampling

NONE = 'none'


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=NONE)


def _model(units=4, inputs=5):
  tf.keras.utils.set_random_seed(1)
  return tf.keras.Sequential([tf.keras.Input((inputs,)),
                              tf.keras.layers.Dense(units, activation='tanh'),
                              tf.keras.layers.Dense(3)])


# --- sampling ------------------------------------------------------------------


def test_user_batches_hold_whole_users_in_fixed_slots():
  n, k = 60, 4
  x = np.arange(n, dtype='float32')[:, None] + 1  # Row i holds i + 1.
  y = np.zeros(n, 'int64')
  users = np.arange(n) % 20  # Users of 3 examples each.
  data = sampling.poisson_user_batches(x, y, users, sampling_probability=0.3,
                                       steps=50, examples_per_user=k, seed=1)
  counts = np.zeros(20)
  for xb, _, weight in data:
    xb, weight = xb.numpy()[:, 0], weight.numpy()
    assert xb.shape == weight.shape  # One shape for every batch.
    assert len(xb) % k == 0
    for slot in range(len(xb) // k):
      rows = xb[slot * k:(slot + 1) * k][weight[slot * k:(slot + 1) * k] > 0]
      if len(rows):
        owners = set(((rows - 1) % 20).astype(int))
        assert len(owners) == 1  # One user per slot ...
        assert len(rows) == 3  # ... with all of their examples.
        counts[owners.pop()] += 1
    assert np.all(xb[weight == 0] == 0)
  # Each user in a batch with probability 0.3 (50 steps): binomial bounds.
  assert abs(counts.mean() - 15) < 5 * math.sqrt(50 * 0.3 * 0.7 / 20)


def test_a_user_with_more_examples_than_the_bound_contributes_a_subset():
  x = np.arange(1, 11, dtype='float32')[:, None]
  data = sampling.poisson_user_batches(x, np.zeros(10), np.zeros(10),
                                       sampling_probability=1.0, steps=3,
                                       examples_per_user=4, seed=0)
  for _, _, weight in data:
    assert weight.numpy().sum() == 4


@pytest.mark.parametrize('kwargs, name', [
    ({'examples_per_user': 0}, 'examples_per_user'),
    ({'sampling_probability': 0.0}, 'sampling_probability'),
    ({'user_ids': np.zeros(3)}, 'user_ids'),
    ({'seed': -1}, 'seed'),
])
def test_bad_sampling_arguments_are_named(kwargs, name):
  args = dict(x=np.zeros((4, 2)), y=np.zeros(4), user_ids=np.arange(4),
              sampling_probability=0.5, steps=1, examples_per_user=2)
  with pytest.raises(ValueError, match=name):
    sampling.poisson_user_batches(**{**args, **kwargs})


# --- records -------------------------------------------------------------------


def _user_batch(k=4, users=3, seed=0, scale=1.0):
  """`users` full slots of `k` rows, the last slot half padding."""
  rng = np.random.default_rng(seed)
  rows = users * k
  x = (scale * rng.normal(size=(rows, 5))).astype('float32')
  y = rng.integers(0, 3, rows)
  weight = np.ones(rows, 'float32')
  weight[-k // 2:] = 0
  x[-k // 2:] = 0
  return x, y, weight


def _fit(privatizer, batch, *, examples_per_user=4, expected_batch_size=3.0,
         learning_rate=1.0, physical_batch_size=None, units=4, loss=None):
  plain = _model(units)
  model = tfdpx.keras.make_private(plain, examples_per_user=examples_per_user,
                                   physical_batch_size=physical_batch_size)
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer, noise_seed=5,
                                learning_rate=learning_rate,
                                expected_batch_size=expected_batch_size)
  model.compile(optimizer, loss or _loss())
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(tf.data.Dataset.from_tensors(batch), verbose=0)
  change = [v.numpy() - b for v, b in zip(model.trainable_variables, before)]
  return change, optimizer


def test_each_user_is_one_record_clipped_as_a_whole():
  """Independent computation: per slot, the gradient of the (weighted) sum
  of its examples' losses, clipped, summed over slots, divided by the
  expected number of users: the update at zero noise. The clip norm lies
  between the users' norms, so that a record that is a mean, not a sum,
  would show."""
  k = 4
  batch = _user_batch(k)
  x, y, weight = batch
  model = _model()
  records = []
  for slot in range(len(x) // k):
    rows = slice(slot * k, (slot + 1) * k)
    with tf.GradientTape() as tape:
      losses = _loss()(y[rows], model(x[rows])) * weight[rows]
      loss = tf.reduce_sum(losses)
    records.append([g.numpy() for g in tape.gradient(
        loss, model.trainable_variables)])
  norms = [math.sqrt(sum(np.sum(g**2) for g in r)) for r in records]
  l2_norm_clip = float(np.median(norms))
  assert min(norms) < l2_norm_clip < max(norms)
  total = [sum(min(1.0, l2_norm_clip / n) * r[v]
               for r, n in zip(records, norms))
           for v in range(len(records[0]))]
  change, _ = _fit(privatizers.gaussian(l2_norm_clip, 0.0), batch)
  for c, t in zip(change, total):
    np.testing.assert_allclose(c, -t / 3.0, rtol=1e-5, atol=1e-7)


def test_one_user_with_many_huge_examples_moves_the_release_by_at_most_c():
  """Four examples of one user, each with a huge gradient: the release
  (learning rate 1, denominator 1, negligible noise) has norm at most C, and
  about C; examples clipped one by one would have moved it up to 4 C."""
  l2_norm_clip = 0.5
  x, y, weight = _user_batch(k=4, users=1, scale=1e3)
  weight[:] = 1
  x[:] = x[0]  # The same example four times: aligned gradients.
  change, _ = _fit(privatizers.gaussian(l2_norm_clip, 1e-9), (x, y, weight),
                   expected_batch_size=1.0)
  norm = math.sqrt(sum(np.sum(c**2) for c in change))
  assert 0.99 * l2_norm_clip <= norm <= l2_norm_clip * (1 + 1e-5)


class _ZeroLoss(tf.keras.losses.Loss):

  def call(self, y_true, y_pred):
    return tf.reduce_sum(0.0 * y_pred, axis=-1)


def test_noise_is_added_once_per_batch_of_users():
  """Two-sided: zero gradients, the update's std is lr z C / expected users."""
  z, c, lr, users = 1.3, 0.8, 0.5, 3.0
  change, _ = _fit(privatizers.gaussian(c, z), _user_batch(),
                   learning_rate=lr, expected_batch_size=users, units=12000,
                   loss=_ZeroLoss(reduction=NONE))
  samples = np.concatenate([d.ravel() for d in change])
  expected = lr * z * c / users
  assert stats.relative_tolerance(samples.size) < 0.012
  assert stats.std_matches(samples, expected)
  assert not stats.std_matches(samples, expected * 1.03)
  assert not stats.std_matches(samples, expected / 1.03)


def test_epsilon_and_statement_are_user_level():
  z, q, steps, delta = 1.1, 0.05, 40, 1e-5
  _, optimizer = _fit(privatizers.gaussian(1.0, z), _user_batch())
  assert optimizer.records_are_users
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(z)), steps)
  assert tfdpx.accounting.epsilon(
      optimizer, steps=steps, sampling_probability=q,
      delta=delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
  statement = tfdpx.accounting.privacy_statement(
      optimizer, sampling='poisson', steps=steps, num_examples=1000,
      num_users=60, expected_batch_size=3, delta=delta)
  assert 'user-level' in statement and '60 users (1000 examples)' in statement
  assert 'q = 0.05' in statement
  with pytest.raises(ValueError, match='num_users'):
    tfdpx.accounting.privacy_statement(
        optimizer, sampling='poisson', steps=steps, num_examples=1000,
        expected_batch_size=3, delta=delta)
  example_level = tfdpx.keras.DPSGD(1.0, z, expected_batch_size=3)
  with pytest.raises(ValueError, match='num_users'):
    tfdpx.accounting.privacy_statement(
        example_level, sampling='poisson', steps=steps, num_examples=1000,
        num_users=60, expected_batch_size=3, delta=delta)


def test_the_user_level_mark_survives_the_config():
  _, optimizer = _fit(privatizers.gaussian(1.0, 1.0), _user_batch())
  assert type(optimizer).from_config(
      optimizer.get_config()).records_are_users


def test_virtual_batches_of_whole_users_release_the_same():
  batch = _user_batch(users=4)
  whole, _ = _fit(privatizers.gaussian(0.3, 1.0), batch)
  parts, _ = _fit(privatizers.gaussian(0.3, 1.0), batch,
                  physical_batch_size=8)
  for a, b in zip(whole, parts):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_refusals_name_the_argument():
  with pytest.raises(ValueError, match='examples_per_user'):
    tfdpx.keras.make_private(_model(), examples_per_user=0)
  with pytest.raises(ValueError, match='physical_batch_size'):
    tfdpx.keras.make_private(_model(), examples_per_user=4,
                             physical_batch_size=6)
  with pytest.raises(ValueError, match='expected_batch_size'):
    _fit(privatizers.gaussian(1.0, 1.0), _user_batch(),
         expected_batch_size=None)
  model = tfdpx.keras.make_private(_model(), examples_per_user=4)
  model.compile(tfdpx.keras.DPSGD(1.0, 1.0, num_microbatches=3,
                                  expected_batch_size=3), _loss())
  with pytest.raises(ValueError, match='num_microbatches'):
    model.fit(tf.data.Dataset.from_tensors(_user_batch()), verbose=0)
