"""Noise correlated across steps in Keras training: cyclic batches, the
callback's epsilon, a secret history and resuming."""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import accounting
from tfdpx import correlation
from tfdpx import privatizers
from tfdpx import sampling

N, GROUPS, Q, DELTA = 64, 4, 0.5, 1e-5


def _data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(N, 5)).astype('float32')
  return x, (x[:, 0] > 0).astype('int32')


def _model(noise_seed=None, noise_multiplier=0.8, strategy=None):
  tf.keras.utils.set_random_seed(0)
  model = tfdpx.keras.make_private(tf.keras.Sequential([
      tf.keras.Input((5,)), tf.keras.layers.Dense(4, activation='relu'),
      tf.keras.layers.Dense(2)]))
  privatizer = privatizers.correlated(
      privatizers.gaussian(1.0, noise_multiplier),
      strategy or correlation.banded_toeplitz(GROUPS, 40))
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer,
                                expected_batch_size=N * Q / GROUPS,
                                learning_rate=0.2, noise_seed=noise_seed)
  model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction='none'))
  return model


def _batches(steps, first_step=0, q=Q):
  x, y = _data()
  return sampling.cyclic_poisson_batches(
      x, y, sampling_probability=q, groups=GROUPS, steps=steps,
      first_step=first_step, seed=3)


def _secret_history(optimizer):
  return [v.numpy() for v in optimizer.secret_checkpoint().secret_state]


def test_fit_logs_the_amplified_epsilon_of_cyclic_batches():
  model = _model()
  history = model.fit(_batches(6), epochs=2, verbose=0, callbacks=[
      tfdpx.keras.PrivacyCallback(sampling='cyclic_poisson',
                                  sampling_probability=Q, groups=GROUPS,
                                  delta=DELTA)])
  optimizer = model.optimizer
  assert int(optimizer.dp_steps.numpy()) == 12
  assert history.history['epsilon'][-1] == pytest.approx(
      accounting.epsilon_cyclic_poisson(
          optimizer.privatizer, steps=12, sampling_probability=Q,
          groups=GROUPS, delta=DELTA), rel=1e-12)
  assert all(np.any(h != 0) for h in _secret_history(optimizer))
  with pytest.raises(ValueError, match='cyclic_poisson'):
    accounting.epsilon(optimizer, sampling_probability=Q / GROUPS,
                       delta=DELTA)


def test_no_checkpoint_or_saved_model_holds_the_history(tmp_path):
  model = _model()
  model.fit(_batches(4), verbose=0)
  secret = _secret_history(model.optimizer)
  # The last GROUPS - 1 noises of each variable.
  assert [h.shape for h in secret] == [
      s for s in ((5, 4), (4,), (4, 2), (2,)) for _ in range(GROUPS - 1)]
  path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
      os.path.join(tmp_path, 'ckpt'))
  names = [name for name, _ in tf.train.list_variables(path)]
  assert not [n for n in names if 'secret' in n], names
  assert any('dp_state' in n or 'dp_steps' in n for n in names), names
  values = [tf.train.load_variable(path, n) for n in names]
  for history in secret:
    assert not any(np.shape(v) == history.shape and np.allclose(v, history)
                   for v in values)
  optimizer_variables = model.optimizer.variables
  if callable(optimizer_variables):  # Keras 2.
    optimizer_variables = optimizer_variables()
  assert not [v for v in optimizer_variables if 'secret' in v.name]


@pytest.mark.parametrize('strategy', [None, correlation.blt(2, 40)],
                         ids=['banded', 'blt'])
def test_resuming_with_the_secret_checkpoint_continues_the_noise(
    tmp_path, strategy):
  """Stopped after 4 steps and resumed in a new model and optimizer, from
  the model's checkpoint and the secret one, with the same noise keys (a
  known seed, its release counter set), the run ends where an uninterrupted
  run ends; without the secret checkpoint it does not. Every member of a
  group is sampled (q = 1), so that both runs see the same batches."""
  whole = _model(noise_seed=5, strategy=strategy)
  whole.fit(_batches(8, q=1.0), verbose=0)

  def resumed(restore_secret):
    first = _model(noise_seed=5, strategy=strategy)
    first.fit(_batches(4, q=1.0), verbose=0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        os.path.join(tmp_path, f'model{restore_secret}'))
    secret_path = first.optimizer.secret_checkpoint().save(
        os.path.join(tmp_path, f'secret{restore_secret}'))
    second = _model(noise_seed=5, strategy=strategy)
    second.optimizer.create_variables(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(
        path).assert_existing_objects_matched()
    if restore_secret:
      second.optimizer.secret_checkpoint().restore(
          secret_path).assert_consumed()
    # pylint: disable-next=protected-access
    second.optimizer._noise_key_variables().counter.assign(4)
    second.fit(_batches(4, first_step=4, q=1.0), verbose=0)
    assert int(second.optimizer.dp_steps.numpy()) == 8
    return second

  for a, b in zip(whole.get_weights(), resumed(True).get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  restarted = resumed(False).get_weights()
  assert not all(np.allclose(a, b, atol=1e-6)
                 for a, b in zip(whole.get_weights(), restarted))


def test_fit_steps_follow_the_cycle_across_epochs():
  """Three epochs of 3 steps (not a multiple of the 4 groups) train on
  groups 0, 1, 2, 3, 0, ... in order: the steps `fit` takes follow the
  cycle the accountant assumes. Checked against single steps on the
  expected batches (every member sampled, no noise)."""
  fitted = _model(noise_multiplier=0.0)
  fitted.fit(_batches(3, q=1.0), epochs=3, verbose=0)
  stepped = _model(noise_multiplier=0.0)
  x, y = _data()
  group_of = sampling.example_groups(N, GROUPS, seed=3)
  for step in range(9):
    rows = np.flatnonzero(group_of == step % GROUPS)
    stepped.train_on_batch(x[rows], y[rows])
  for a, b in zip(fitted.get_weights(), stepped.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
