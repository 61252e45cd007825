"""PrivacyCallback and EpsilonBudget: the epsilon of the run's sampling."""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import accounting
from tfdpx.privatizers import gaussian
from tests.compile_path import trainable

NOISE, DELTA = 1.0, 1e-5


def _data(n, features=5, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype('float32')
  y = (x[:, 0] > 0).astype('int32')
  return x, y


def _model(steps_per_execution=1, **optimizer_kwargs):
  tf.keras.utils.set_random_seed(0)
  model = trainable(
      tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(5,))]))
  optimizer = tfdpx.keras.DPSGD(
      **{'l2_norm_clip': 1.0, 'noise_multiplier': NOISE,
         'expected_batch_size': 8, 'learning_rate': 0.1, **optimizer_kwargs})
  model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction='none'),
                steps_per_execution=steps_per_execution)
  return model


def _epsilon(steps, sampling):
  return accounting.epsilon_for_sampling(gaussian(1.0, NOISE), steps=steps,
                                         delta=DELTA, **sampling)


POISSON = {'sampling': 'poisson', 'sampling_probability': 0.25}


@pytest.mark.parametrize('sampling', [
    POISSON, {'sampling': 'shuffle', 'steps_per_epoch': 4}])
def test_privacy_callback_logs_the_epsilon_of_its_sampling(sampling):
  x, y = _data(32)
  history = _model().fit(
      x, y, batch_size=8, epochs=3, verbose=0,
      callbacks=[tfdpx.keras.PrivacyCallback(delta=DELTA, **sampling)])
  logged = history.history['epsilon']
  assert logged == [pytest.approx(_epsilon(4 * e, sampling), rel=1e-12)
                    for e in (1, 2, 3)]
  assert logged[0] < logged[1] < logged[2]


@pytest.mark.parametrize('callback', [
    lambda **kw: tfdpx.keras.PrivacyCallback(**kw),
    lambda **kw: tfdpx.keras.EpsilonBudget(5.0, **kw),
])
@pytest.mark.parametrize('kwargs, match', [
    ({}, 'sampling'),
    ({'sampling': 'poisson'}, 'sampling_probability'),
    ({'sampling': 'shuffle'}, 'steps_per_epoch'),
    ({'sampling': 'poisson', 'sampling_probability': 0.25,
      'steps_per_epoch': 4}, 'steps_per_epoch'),
    ({'sampling': 'shuffle', 'sampling_probability': 0.25,
      'steps_per_epoch': 4}, 'sampling_probability'),
    ({'sampling': 'uniform', 'sampling_probability': 0.25}, 'sampling'),
    ({'sampling': 'poisson', 'sampling_probability': 0.25, 'delta': 0},
     'delta'),
])
def test_missing_or_extra_arguments_are_named(callback, kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    callback(**{'delta': DELTA, **kwargs})


@pytest.mark.parametrize('callback', [
    tfdpx.keras.PrivacyCallback(delta=DELTA, **POISSON),
    tfdpx.keras.EpsilonBudget(50.0, delta=DELTA, **POISSON),
])
def test_microbatches_under_poisson_are_refused_before_the_first_step(
    callback):
  model = _model(num_microbatches=4)
  x, y = _data(32)
  with pytest.raises(ValueError, match='num_microbatches.*Poisson'):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
  assert int(model.optimizer.dp_steps.numpy()) == 0


def test_microbatches_with_shuffling_are_accounted_at_double_sensitivity():
  model = _model(num_microbatches=4)
  x, y = _data(32)
  history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
      tfdpx.keras.PrivacyCallback(delta=DELTA, sampling='shuffle',
                                  steps_per_epoch=4)])
  assert history.history['epsilon'][0] == accounting.epsilon_once_per_epoch(
      gaussian(1.0, NOISE / 2), steps=4, steps_per_epoch=4, delta=DELTA)


# (examples, steps_per_execution, last step that fits): epochs of 4 steps run
# as one execution; epochs of 6 steps as executions of 4 and 2, after which
# the next execution has 4 steps again.
@pytest.mark.parametrize('n, steps_per_execution, stop', [
    (32, 1, 9), (32, 4, 8), (48, 4, 6)])
@pytest.mark.parametrize('sampling', ['poisson', 'shuffle'])
def test_budget_stops_at_or_before_the_target(n, steps_per_execution, stop,
                                              sampling):
  # For 'shuffle', accounting with one step per epoch (conservative) makes
  # epsilon grow at every step, as under Poisson sampling.
  sampling = ({'sampling': 'poisson', 'sampling_probability': 8 / n}
              if sampling == 'poisson' else
              {'sampling': 'shuffle', 'steps_per_epoch': 1})
  # The target lies between the epsilons after 9 and 10 steps: any run that
  # executes step 10 overshoots.
  target = (_epsilon(9, sampling) + _epsilon(10, sampling)) / 2
  assert _epsilon(9, sampling) < target < _epsilon(10, sampling)
  model = _model(steps_per_execution)
  budget = tfdpx.keras.EpsilonBudget(target, delta=DELTA, **sampling)
  x, y = _data(n)
  model.fit(x, y, batch_size=8, epochs=10, verbose=0, callbacks=[budget])
  steps = int(model.optimizer.dp_steps.numpy())
  assert accounting.epsilon_for_sampling(
      model.optimizer, delta=DELTA, **sampling) <= target
  assert steps == budget.stopped_at_step == stop


def test_budget_refuses_to_start_an_execution_it_cannot_afford():
  target = (_epsilon(3, POISSON) + _epsilon(4, POISSON)) / 2
  x, y = _data(32)
  model = _model(steps_per_execution=4)
  with pytest.raises(ValueError, match='target_epsilon.*steps_per_execution'):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        tfdpx.keras.EpsilonBudget(target, delta=DELTA, **POISSON)])
  assert int(model.optimizer.dp_steps.numpy()) == 0
  # One step at a time, three of them fit.
  model = _model()
  model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
      tfdpx.keras.EpsilonBudget(target, delta=DELTA, **POISSON)])
  assert int(model.optimizer.dp_steps.numpy()) == 3


@pytest.mark.keras2_only("steps_per_execution='auto' (Keras 3's TensorFlow "
                         'backend has none)')
def test_budget_refuses_autotuned_steps_per_execution():
  x, y = _data(32)
  model = _model(steps_per_execution='auto')
  with pytest.raises(ValueError, match="steps_per_execution='auto'"):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
        tfdpx.keras.EpsilonBudget(5.0, delta=DELTA, **POISSON)])


@pytest.mark.parametrize('callback', [
    lambda: tfdpx.keras.PrivacyCallback(delta=DELTA, **POISSON),
    lambda: tfdpx.keras.EpsilonBudget(5.0, delta=DELTA, **POISSON),
])
def test_callbacks_refuse_a_regularizer_on_the_compile_path_by_name(callback):
  # Without the callback Keras's own train step fails inside its loss
  # container (tf.add_n of the [B] loss and a scalar) without saying why.
  x, y = _data(8)
  model = tf.keras.Sequential([tf.keras.layers.Dense(
      2, input_shape=(5,), kernel_regularizer='l2', name='regularized')])
  model.compile(tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                  expected_batch_size=8),
                tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True,
                    reduction='none'))
  with pytest.raises(ValueError, match="'regularized'.*make_private"):
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[callback()])


@pytest.mark.parametrize('noise_seed', [None, 3])
def test_privacy_callback_says_not_private_when_the_noise_seed_is_known(
    caplog, noise_seed):
  x, y = _data(8)
  with caplog.at_level('WARNING'):
    _model(noise_seed=noise_seed).fit(
        x, y, batch_size=8, verbose=0,
        callbacks=[tfdpx.keras.PrivacyCallback(delta=DELTA, **POISSON)])
  warned = 'NOT PRIVATE: the noise seed is known' in caplog.text
  assert warned == (noise_seed is not None)
