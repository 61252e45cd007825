"""Accounting: epsilon, calibration and statements against independent computations."""

import math

import dp_accounting
import pytest
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib

from tfdpx import accounting
from tfdpx.privatizers import gaussian

N, BATCH, EPOCHS, NOISE, DELTA = 60000, 256, 15, 1.1, 1e-5
Q = BATCH / N


def _steps(epochs=EPOCHS):
  # tensorflow-privacy's convention: ceil(epochs / q) Poisson steps.
  return int(math.ceil(epochs / Q))


def test_gaussian_epsilon_equals_tensorflow_privacy_statement_value():
  expected = compute_dp_sgd_privacy_lib._compute_dp_sgd_example_privacy(
      num_epochs=EPOCHS, noise_multiplier=NOISE, example_delta=DELTA,
      used_microbatching=False, poisson_subsampling_probability=Q)
  got = accounting.epsilon(gaussian(1.0, NOISE), steps=_steps(),
                           sampling_probability=Q, delta=DELTA)
  assert got == pytest.approx(expected, rel=1e-6)
  assert 0.5 < got < 5  # A realistic regime, not a degenerate one.


def test_gaussian_epsilon_equals_compute_dp_sgd_privacy_with_its_orders():
  orders = ([1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] +
            list(range(5, 64)) + [128, 256, 512])
  expected, _ = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy(
      N, BATCH, NOISE, EPOCHS, DELTA)
  got = accounting.epsilon(gaussian(1.0, NOISE), steps=_steps(),
                           sampling_probability=Q, delta=DELTA, orders=orders)
  assert got == pytest.approx(expected, rel=1e-6)


def test_training_event_groups_equal_steps_and_keeps_floats():
  event = accounting.training_event(gaussian(1.0, 2), steps=10,
                                    sampling_probability=0.1)
  assert len(event.events) == 1
  inner = event.events[0]
  assert inner.count == 10
  assert isinstance(inner.event.event.noise_multiplier, float)


def test_zero_noise_is_infinite_epsilon():
  assert math.isinf(accounting.epsilon(gaussian(1.0, 0.0), steps=5,
                                       sampling_probability=0.1, delta=1e-5))


def test_calibration_lands_within_one_percent_below_the_target():
  for target in (1.0, 3.0, 8.0):
    z = accounting.calibrate_noise_multiplier(
        target, gaussian(1.0, 1.0), steps=_steps(), sampling_probability=Q,
        delta=DELTA)
    eps = accounting.epsilon(gaussian(1.0, z), steps=_steps(),
                             sampling_probability=Q, delta=DELTA)
    assert 0.99 * target <= eps <= target, (target, z, eps)


def test_calibration_keeps_the_clip_norm():
  z = accounting.calibrate_noise_multiplier(
      2.0, gaussian(0.3, 1.0), steps=100, sampling_probability=0.01,
      delta=1e-5)
  assert gaussian(0.3, 1.0).with_noise_multiplier(z).config == {
      'l2_norm_clip': 0.3, 'noise_multiplier': z}


def test_scale_sensitivity_halves_every_gaussian():
  event = dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(2.0),
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(4.0), 3),
      dp_accounting.NonPrivateDpEvent(),
  ])
  scaled = accounting.scale_sensitivity(event, 2.0)
  assert scaled == dp_accounting.ComposedDpEvent([
      dp_accounting.GaussianDpEvent(1.0),
      dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3),
      dp_accounting.NonPrivateDpEvent(),
  ])
  with pytest.raises(ValueError, match='cannot rescale'):
    accounting.scale_sensitivity(dp_accounting.LaplaceDpEvent(1.0), 2.0)


def test_statement_names_its_sampling_assumption():
  poisson = accounting.privacy_statement(
      gaussian(1.0, NOISE), steps=_steps(), num_examples=N,
      expected_batch_size=BATCH, delta=DELTA, sampling='poisson')
  shuffle = accounting.privacy_statement(
      gaussian(1.0, NOISE), steps=_steps(), num_examples=N,
      expected_batch_size=BATCH, delta=DELTA, sampling='shuffle')
  assert 'Poisson, as the accountant assumes' in poisson
  assert 'not a proven upper bound' in shuffle
  with pytest.raises(ValueError, match='sampling'):
    accounting.privacy_statement(gaussian(1.0, 1.0), steps=1, num_examples=10,
                                 expected_batch_size=1, delta=1e-5,
                                 sampling='random')


@pytest.mark.parametrize('kwargs, name', [
    ({'steps': -1, 'sampling_probability': 0.1, 'delta': 1e-5}, 'steps'),
    ({'steps': 3, 'sampling_probability': 1.5, 'delta': 1e-5},
     'sampling_probability'),
    ({'steps': 3, 'sampling_probability': 0.1, 'delta': 0.0}, 'delta'),
])
def test_bad_arguments_are_named(kwargs, name):
  with pytest.raises(ValueError, match=name):
    accounting.epsilon(gaussian(1.0, 1.0), **kwargs)
