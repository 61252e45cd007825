"""PLD accounting (`accountant='pld'`) against independent dp_accounting runs."""

import dp_accounting
from dp_accounting import pld
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import accounting
from tfdpx.privatizers import gaussian
from tests.compile_path import trainable

# The tensorflow-privacy tutorial: n = 60000, batch 256, noise multiplier 1.1,
# 60 epochs, delta 1e-5, Poisson sampling.
Q = 256 / 60000
STEPS = 60 * 60000 // 256
DELTA = 1e-5


def _independent_pld_epsilon(noise_multiplier, steps=STEPS, q=Q):
  # Built here from the mechanism's description, not from tfdpx's events,
  # on dp_accounting's default (finer) discretization.
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(noise_multiplier)), steps)
  accountant = pld.PLDAccountant()
  accountant.compose(event)
  return accountant.get_epsilon(DELTA)


def test_pld_epsilon_is_below_rdp_and_matches_an_independent_computation():
  kwargs = dict(steps=STEPS, sampling_probability=Q, delta=DELTA)
  rdp_eps = accounting.epsilon(gaussian(1.0, 1.1), **kwargs)
  pld_eps = accounting.epsilon(gaussian(1.0, 1.1), accountant='pld', **kwargs)
  assert pld_eps < rdp_eps
  reference = _independent_pld_epsilon(1.1)
  assert pld_eps == pytest.approx(reference, rel=0.01)
  # The library's coarser grid rounds the loss up: never below the finer one
  # by more than float noise.
  assert pld_eps >= reference * (1 - 1e-6)


def test_pld_calibration_needs_less_noise_and_meets_its_target():
  kwargs = dict(steps=STEPS, delta=DELTA, sampling_probability=Q)
  z_rdp = accounting.calibrate_noise_multiplier(3.0, gaussian(1.0, 1.0),
                                                **kwargs)
  z_pld = accounting.calibrate_noise_multiplier(3.0, gaussian(1.0, 1.0),
                                                accountant='pld', **kwargs)
  assert z_pld < z_rdp
  assert _independent_pld_epsilon(z_pld) <= 3.0 * 1.01
  assert accounting.epsilon(gaussian(1.0, z_pld), accountant='pld',
                            **kwargs) <= 3.0


def test_pld_once_per_epoch_is_the_composition_of_worst_steps():
  eps = accounting.epsilon_once_per_epoch(
      gaussian(1.0, 1.1), steps=40, steps_per_epoch=10, delta=DELTA,
      accountant='pld')
  reference = pld.PLDAccountant()
  reference.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.GaussianDpEvent(1.1), 4))
  assert eps == pytest.approx(reference.get_epsilon(DELTA), rel=0.01)


def test_statement_names_the_accountant():
  statement = accounting.privacy_statement(
      gaussian(1.0, 1.1), sampling='poisson', steps=STEPS, num_examples=60000,
      expected_batch_size=256, delta=DELTA, accountant='pld')
  assert 'PLD accountant' in statement and 'RDP' not in statement
  assert 'RDP accountant' in accounting.privacy_statement(
      gaussian(1.0, 1.1), sampling='poisson', steps=STEPS, num_examples=60000,
      expected_batch_size=256, delta=DELTA)


def test_unknown_accountant_is_refused_by_name():
  with pytest.raises(ValueError, match='accountant'):
    accounting.epsilon(gaussian(1.0, 1.1), steps=10, sampling_probability=Q,
                       delta=DELTA, accountant='prv')
  with pytest.raises(ValueError, match='accountant'):
    tfdpx.keras.PrivacyCallback(sampling='poisson', sampling_probability=Q,
                                delta=DELTA, accountant='moments')


def test_an_event_pld_cannot_account_is_named():
  # Every step event tfdpx normalizes is one PLD accounts; a sampled
  # composition (here two releases that are not combined) is not.
  event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.ComposedDpEvent(
      [dp_accounting.GaussianDpEvent(1.0), dp_accounting.LaplaceDpEvent(1.0)]))
  with pytest.raises(ValueError,
                     match="PoissonSampledDpEvent.*accountant='rdp'"):
    accounting._event_epsilon(event, DELTA, 'pld', None)  # pylint: disable=protected-access


def test_privacy_callback_logs_the_pld_epsilon():
  x = np.random.default_rng(0).normal(size=(32, 5)).astype('float32')
  y = (x[:, 0] > 0).astype('int32')
  tf.keras.utils.set_random_seed(0)
  model = trainable(
      tf.keras.Sequential([tf.keras.layers.Dense(2, input_shape=(5,))]))
  model.compile(
      tfdpx.keras.DPSGD(1.0, 1.1, expected_batch_size=8, learning_rate=0.1),
      tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction='none'))
  history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[
      tfdpx.keras.PrivacyCallback(sampling='poisson', sampling_probability=0.25,
                                  delta=DELTA, accountant='pld')])
  assert history.history['epsilon'][0] == pytest.approx(
      _independent_pld_epsilon(1.1, steps=4, q=0.25), rel=0.01)
