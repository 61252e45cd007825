"""Virtual batches: a logical batch privatized from physical batches."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import privatizers
from tfdpx import sampling

NONE = 'none'
SHAPE = (6, 6, 1)


def _model():
  tf.keras.utils.set_random_seed(1)
  return tf.keras.Sequential([
      tf.keras.layers.InputLayer(SHAPE),
      tf.keras.layers.Conv2D(3, 3, activation='tanh'),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(4)])


def _data(n, seed=0, scale=1.0):
  rng = np.random.default_rng(seed)
  return ((scale * rng.normal(size=(n,) + SHAPE)).astype('float32'),
          rng.integers(0, 4, n))


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=NONE)


def _train(privatizer, data, physical_batch_size=None, *, batch_size=None,
           public_data=None, jit_compile=False, epochs=1, learning_rate=0.5,
           expected_batch_size=None):
  """Trains a fresh model; returns (weight change, history, optimizer)."""
  model = tfdpx.keras.make_private(_model(), public_data=public_data,
                                   physical_batch_size=physical_batch_size)
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer, noise_seed=7,
                                learning_rate=learning_rate,
                                expected_batch_size=expected_batch_size)
  model.compile(optimizer, _loss(), jit_compile=jit_compile)
  before = [v.numpy() for v in model.trainable_variables]
  if isinstance(data, tf.data.Dataset):
    history = model.fit(data, epochs=epochs, verbose=0)
  else:
    history = model.fit(*data, batch_size=batch_size, epochs=epochs,
                        shuffle=False, verbose=0)
  change = [v.numpy() - b for v, b in zip(model.trainable_variables, before)]
  return change, history.history, optimizer


def _assert_same(a, b):
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


PRIVATIZERS = {
    'gaussian': lambda: privatizers.gaussian(0.5, 1.0),
    # Step 1 on decomposes along step 0's release.
    'dpdr': lambda: privatizers.dpdr(0.5, 1.0, decomposition_steps=5),
    'gep': lambda: privatizers.gep(3, 0.3, 0.4, 1.0),
    'sparsified(gaussian)': lambda: privatizers.sparsified(
        privatizers.gaussian(0.5, 1.0), 0.5, 2, 1),
    'd2p2': lambda: privatizers.d2p2(1.0),
    'geodp': lambda: privatizers.geodp(0.5, 1.0),
}


@pytest.mark.parametrize('name', sorted(PRIVATIZERS))
def test_a_logical_batch_releases_what_one_real_batch_releases(name):
  """Same noise key: the weights after two logical batches of 20 examples in
  physical batches of 8 (the last padded with 4 rows) equal those after two
  real batches of 20, and so do the logged losses and the step count."""
  data = _data(40)
  public = _data(6, seed=1) if name == 'gep' else None
  whole, whole_logs, whole_optimizer = _train(
      PRIVATIZERS[name](), data, batch_size=20, public_data=public)
  parts, parts_logs, parts_optimizer = _train(
      PRIVATIZERS[name](), data, 8, batch_size=20, public_data=public)
  _assert_same(whole, parts)
  assert max(np.abs(w).max() for w in whole) > 1e-2  # Something was released.
  np.testing.assert_allclose(whole_logs['loss'], parts_logs['loss'],
                             rtol=1e-6)
  assert parts_logs['dropped_records'] == [0]
  assert int(whole_optimizer.dp_steps.numpy()) == 2
  assert int(parts_optimizer.dp_steps.numpy()) == 2


def test_under_jit_compile_too():
  data = _data(24)
  whole, _, _ = _train(PRIVATIZERS['gaussian'](), data, batch_size=24)
  parts, _, _ = _train(PRIVATIZERS['gaussian'](), data, 8, batch_size=24,
                       jit_compile=True)
  _assert_same(whole, parts)


def _independent_epsilon(q, noise_multiplier, steps, delta):
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)
  return accountant.get_epsilon(delta)


def test_poisson_batches_are_one_step_each_whatever_their_physical_batches():
  """Poisson batches padded to a fixed shape (sample weight 0), in physical
  batches of 4: the same release as the whole batch, one privacy event per
  logical batch, and the epsilon of that many sampled Gaussian steps."""
  x, y = _data(60)
  q, steps = 0.2, 3

  def batches():
    return sampling.poisson_batches(x, y, sampling_probability=q,
                                    steps=steps, seed=5)

  expected_batch_size = q * len(x)
  whole, _, _ = _train(PRIVATIZERS['gaussian'](), batches(),
                       expected_batch_size=expected_batch_size)
  parts, _, optimizer = _train(PRIVATIZERS['gaussian'](), batches(), 4,
                               expected_batch_size=expected_batch_size)
  _assert_same(whole, parts)
  assert int(optimizer.dp_steps.numpy()) == steps
  assert tfdpx.accounting.epsilon(
      optimizer, sampling_probability=q, delta=1e-5) == pytest.approx(
          _independent_epsilon(q, 1.0, steps, 1e-5), rel=1e-9)


def test_a_record_spread_over_physical_batches_is_clipped_once():
  """One example with a huge gradient in a logical batch of 4 (3 padding
  rows), physical batches of 1, negligible noise: the released sum (the
  weight change at learning rate 1 over the denominator 1) has norm at most
  the clip norm, and about it (the clip is active)."""
  l2_norm_clip = 0.5
  x, y = _data(1, scale=1e3)
  x = np.concatenate([x, np.zeros((3,) + SHAPE, 'float32')])
  y = np.concatenate([y, np.zeros(3, y.dtype)])
  weights = np.array([1, 0, 0, 0], 'float32')
  data = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(4)
  change, _, _ = _train(privatizers.gaussian(l2_norm_clip, 1e-9), data, 1,
                        learning_rate=1.0, expected_batch_size=1)
  norm = math.sqrt(sum(np.sum(np.square(c)) for c in change))
  assert l2_norm_clip * 0.99 <= norm <= l2_norm_clip * (1 + 1e-5)


@pytest.mark.parametrize('value', [0, -3, 2.5, True, '8'])
def test_a_bad_physical_batch_size_is_refused_by_name(value):
  with pytest.raises(ValueError, match='physical_batch_size'):
    tfdpx.keras.make_private(_model(), physical_batch_size=value)


def test_microbatches_are_refused_with_virtual_batches():
  model = tfdpx.keras.make_private(_model(), physical_batch_size=4)
  model.compile(tfdpx.keras.DPSGD(1.0, 1.0, num_microbatches=4,
                                  learning_rate=0.1), _loss())
  with pytest.raises(ValueError, match='num_microbatches'):
    model.fit(*_data(8), batch_size=8, verbose=0)


def test_the_physical_batch_size_is_part_of_the_config():
  model = tfdpx.keras.make_private(_model(), physical_batch_size=4)
  config = model.get_config()
  assert config['physical_batch_size'] == 4
  assert type(model).from_config(config).get_config()[
      'physical_batch_size'] == 4


def test_gradient_accumulation_steps_is_refused_for_virtual_batches():
  """Keras 3's optimizers would average k noisy releases; the error names
  the argument and what does the large batch instead."""
  with pytest.raises(ValueError,
                     match='gradient_accumulation_steps.*physical_batch_size'):
    tfdpx.keras.DPSGD(1.0, 1.0, gradient_accumulation_steps=4,
                      learning_rate=0.1)


def test_the_tutorial_cnn_at_a_logical_batch_of_4096_in_physical_256():
  """Issue 21's case: one logical batch of 4096 in 16 physical batches of
  256 updates the tutorial CNN as one real batch of 4096 (same noise key)."""
  from examples import models  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  x = rng.uniform(size=(4096, 28, 28, 1)).astype('float32')
  y = rng.integers(0, 10, 4096)
  changes = []
  for physical_batch_size in (None, 256):
    tf.keras.utils.set_random_seed(2)
    model = tfdpx.keras.make_private(models.tutorial_cnn((28, 28, 1)),
                                     physical_batch_size=physical_batch_size)
    model.compile(tfdpx.keras.DPSGD(1.0, 1.1, expected_batch_size=4096,
                                    learning_rate=1.0, noise_seed=3), _loss())
    before = [v.numpy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=4096, verbose=0)
    changes.append([v.numpy() - b
                    for v, b in zip(model.trainable_variables, before)])
  _assert_same(*changes)
