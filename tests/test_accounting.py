"""Accounting: epsilon, calibration and statements against independent computations."""

import math

import dp_accounting
from dp_accounting import rdp
import numpy as np
import pytest

import tfdpx
from tfdpx import accounting
from tfdpx import core
from tfdpx.privatizers import gaussian
from tfdpx.keras.version import KERAS_3

if not KERAS_3:  # tensorflow-privacy is on Stack A only.
  from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib  # pylint: disable=g-import-not-at-top

_TFP = pytest.mark.keras2_only(
    "compares with tensorflow-privacy's figure; tensorflow-privacy is not "
    'on the Keras 3 stack (the dp_accounting comparisons run on both)')

N, BATCH, EPOCHS, NOISE, DELTA = 60000, 256, 15, 1.1, 1e-5
Q = BATCH / N


def _steps(epochs=EPOCHS):
  # tensorflow-privacy's convention: ceil(epochs / q) Poisson steps.
  return int(math.ceil(epochs / Q))


@_TFP
def test_gaussian_epsilon_equals_tensorflow_privacy_statement_value():
  expected = compute_dp_sgd_privacy_lib._compute_dp_sgd_example_privacy(
      num_epochs=EPOCHS, noise_multiplier=NOISE, example_delta=DELTA,
      used_microbatching=False, poisson_subsampling_probability=Q)
  got = accounting.epsilon(gaussian(1.0, NOISE), steps=_steps(),
                           sampling_probability=Q, delta=DELTA)
  assert got == pytest.approx(expected, rel=1e-6)
  assert 0.5 < got < 5  # A realistic regime, not a degenerate one.


@_TFP
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


def test_calibration_for_shuffled_batches_uses_the_once_per_epoch_bound():
  steps_per_epoch, steps = 16, 80
  z = accounting.calibrate_noise_multiplier(
      3.0, gaussian(1.0, 1.0), steps=steps, steps_per_epoch=steps_per_epoch,
      delta=DELTA)
  eps = accounting.epsilon_once_per_epoch(
      gaussian(1.0, z), steps=steps, steps_per_epoch=steps_per_epoch,
      delta=DELTA)
  assert 0.99 * 3.0 <= eps <= 3.0
  # No amplification: far more noise than Poisson sampling needs.
  assert z > 1.5 * accounting.calibrate_noise_multiplier(
      3.0, gaussian(1.0, 1.0), steps=steps,
      sampling_probability=1 / steps_per_epoch, delta=DELTA)
  with pytest.raises(ValueError, match='not both or neither'):
    accounting.calibrate_noise_multiplier(3.0, gaussian(1.0, 1.0), steps=10,
                                          delta=DELTA)


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


def _statement(source, sampling, **kwargs):
  return accounting.privacy_statement(
      source, sampling=sampling, **{'steps': 80, 'num_examples': 4000,
                                    'expected_batch_size': 250,
                                    'delta': 1e-5, **kwargs})


def test_statement_requires_and_names_its_sampling():
  poisson = _statement(gaussian(1.0, NOISE), 'poisson')
  shuffle = _statement(gaussian(1.0, NOISE), 'shuffle')
  assert 'Poisson, as the accountant assumes' in poisson
  assert 'once per epoch' in shuffle
  assert 'which this run did not use: not a guarantee' in shuffle
  for statement in (poisson, shuffle):
    assert 'Keras logs' in statement and 'docs/privacy.md' in statement
    assert 'NOT PRIVATE' not in statement
  with pytest.raises(TypeError, match='sampling'):
    accounting.privacy_statement(gaussian(1.0, 1.0), steps=1, num_examples=10,
                                 expected_batch_size=1, delta=1e-5)
  with pytest.raises(ValueError, match='sampling'):
    _statement(gaussian(1.0, 1.0), 'random')
  with pytest.raises(ValueError, match='expected_batch_size'):
    _statement(gaussian(1.0, 1.0), 'shuffle', expected_batch_size=5000)


# The demo's settings: n = 4000, batch 250, 5 epochs, delta 1e-5, the noise
# multiplier calibrated to Poisson epsilon 3 over ceil(n / batch) = 16 steps
# per epoch. tensorflow-privacy's statement for them reads "Epsilon with each
# example occurring once per epoch: 9.465" and "assuming Poisson sampling (*):
# 2.998".
DEMO = {'num_examples': 4000, 'expected_batch_size': 250, 'delta': 1e-5}


def _demo_noise_multiplier():
  return accounting.calibrate_noise_multiplier(
      3.0, gaussian(1.0, 1.0), steps=5 * 16, sampling_probability=250 / 4000,
      delta=1e-5)


@_TFP
def test_shuffle_epsilon_is_tensorflow_privacy_once_per_epoch_figure():
  z = _demo_noise_multiplier()
  poisson = accounting.epsilon(gaussian(1.0, z), steps=80,
                               sampling_probability=250 / 4000, delta=1e-5)
  assert round(poisson, 3) == 2.998
  expected = compute_dp_sgd_privacy_lib._compute_dp_sgd_example_privacy(
      num_epochs=5, noise_multiplier=z, example_delta=1e-5,
      used_microbatching=False)
  assert round(expected, 3) == 9.465
  got = accounting.epsilon_once_per_epoch(gaussian(1.0, z), steps=80,
                                          steps_per_epoch=16, delta=1e-5)
  assert got == pytest.approx(expected, rel=1e-9)
  statement = accounting.privacy_statement(gaussian(1.0, z), sampling='shuffle',
                                           steps=80, **DEMO)
  assert _headline(statement).endswith(': 9.465')
  assert 'aside: epsilon 2.998 assuming Poisson sampling' in statement
  # A partial last epoch counts as an epoch, and the statement rounds n / batch
  # down: 85 steps at n = 4249 are 6 epochs of 16 steps (not 5 of 17).
  six_epochs = accounting.epsilon_once_per_epoch(
      gaussian(1.0, z), steps=85, steps_per_epoch=16, delta=1e-5)
  assert six_epochs > accounting.epsilon_once_per_epoch(
      gaussian(1.0, z), steps=85, steps_per_epoch=17, delta=1e-5)
  assert _headline(accounting.privacy_statement(
      gaussian(1.0, z), sampling='shuffle', steps=85,
      **{**DEMO, 'num_examples': 4249})).endswith(f': {six_epochs:.4g}')


def _headline(statement):
  """The line of the statement that gives the epsilon."""
  line, = [line for line in statement.splitlines()
           if line.lstrip().startswith('epsilon')]
  return line


class _Steps(core.Privatizer):
  """A third-party privatizer whose step events are given as a list."""

  name = 'test_steps'

  def __init__(self, events):
    self._events = events

  def update(self, per_example_grads, state, seed, *, public_grads=None):
    raise NotImplementedError

  @property
  def config(self):
    return {}

  def dp_event(self, step):
    return self._events[step]


def _rdp_epsilon(event, delta=1e-5):
  accountant = rdp.RdpAccountant()
  accountant.compose(event)
  return accountant.get_epsilon(delta)


def test_once_per_epoch_charges_each_epoch_its_worst_step():
  g = dp_accounting.GaussianDpEvent
  # Epochs of 3 steps, a decaying schedule, a partial last epoch.
  zs = [4.0, 3.0, 5.0, 2.5, 2.0, 3.0, 6.0]
  got = accounting.epsilon_once_per_epoch(
      _Steps([g(z) for z in zs]), steps=7, steps_per_epoch=3, delta=1e-5)
  assert got == pytest.approx(_rdp_epsilon(dp_accounting.ComposedDpEvent(
      [g(3.0), g(2.0), g(6.0)])), rel=1e-12)
  # Two Gaussian releases of one step are one Gaussian of sigma_eff.
  two = dp_accounting.ComposedDpEvent([g(np.float32(2.0)), g(3)])
  got = accounting.epsilon_once_per_epoch(_Steps([two, g(5.0)]), steps=2,
                                          steps_per_epoch=2, delta=1e-5)
  assert got == pytest.approx(_rdp_epsilon(g((2**-2 + 3**-2)**-0.5)))
  # A step event of another kind: every step of its epoch is composed.
  sampled = dp_accounting.PoissonSampledDpEvent(0.5, g(1.0))
  got = accounting.epsilon_once_per_epoch(
      _Steps([sampled, g(2.0), g(3.0)]), steps=3, steps_per_epoch=3,
      delta=1e-5)
  assert got == pytest.approx(_rdp_epsilon(dp_accounting.ComposedDpEvent(
      [sampled, g(2.0), g(3.0)])), rel=1e-12)
  nonprivate = _Steps([g(5.0), dp_accounting.NonPrivateDpEvent(), g(5.0)])
  assert math.isinf(accounting.epsilon_once_per_epoch(
      nonprivate, steps=3, steps_per_epoch=10, delta=1e-5))
  assert math.isinf(accounting.epsilon_once_per_epoch(
      gaussian(1.0, 0.0), steps=3, steps_per_epoch=1, delta=1e-5))


def test_composed_float32_noise_is_accounted_as_floats():
  """dp-accounting 0.4.3 would use only the first of two float32 releases."""
  g = dp_accounting.GaussianDpEvent
  kwargs = {'steps': 100, 'sampling_probability': 0.1, 'delta': 1e-5}
  floats = accounting.epsilon(
      _Steps([dp_accounting.ComposedDpEvent([g(2.0), g(3.0)])] * 100),
      **kwargs)
  for cast in (np.float32, np.float64, int):
    event = dp_accounting.ComposedDpEvent([g(cast(2.0)), g(cast(3.0))])
    assert accounting.epsilon(_Steps([event] * 100), **kwargs) == floats
  sigma_eff = (2.0**-2 + 3.0**-2)**-0.5
  assert floats == pytest.approx(
      accounting.epsilon(gaussian(1.0, sigma_eff), **kwargs), rel=1e-12)
  assert floats > accounting.epsilon(gaussian(1.0, 2.0), **kwargs)


def test_step_events_are_normalized_to_python_numbers():
  g = dp_accounting.GaussianDpEvent
  event = accounting.normalized_event(dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(g(np.float32(2.0)), np.int64(3)),
      dp_accounting.PoissonSampledDpEvent(np.float32(0.5), g(1)),
      dp_accounting.NoOpDpEvent(), dp_accounting.NonPrivateDpEvent()]))
  self_composed, sampled, noop, nonprivate = event.events
  assert type(self_composed.count) is int
  assert type(self_composed.event.noise_multiplier) is float
  assert type(sampled.sampling_probability) is float
  assert type(sampled.event.noise_multiplier) is float
  assert isinstance(noop, dp_accounting.NoOpDpEvent)
  assert isinstance(nonprivate, dp_accounting.NonPrivateDpEvent)


@pytest.mark.parametrize('event, match', [
    (dp_accounting.GaussianDpEvent(-1.0), 'noise_multiplier'),
    (dp_accounting.GaussianDpEvent(float('nan')), 'noise_multiplier'),
    (dp_accounting.GaussianDpEvent('2'), 'noise_multiplier'),
    (dp_accounting.PoissonSampledDpEvent(
        1.5, dp_accounting.GaussianDpEvent(1.0)), 'sampling_probability'),
    (dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(1.0), 2.5), 'count'),
    (dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(1.0), -1), 'count'),
    (dp_accounting.LaplaceDpEvent(1.0), 'LaplaceDpEvent'),
])
def test_bad_step_events_are_refused_by_name(event, match):
  with pytest.raises(ValueError, match=match):
    accounting.epsilon(_Steps([event] * 3), steps=3, sampling_probability=0.1,
                       delta=1e-5)
  with pytest.raises(ValueError, match=r'dp_event\(0\)'):
    accounting.epsilon_once_per_epoch(_Steps([event] * 3), steps=3,
                                      steps_per_epoch=1, delta=1e-5)


def test_infinite_noise_releases_nothing():
  kwargs = {'steps': 10, 'sampling_probability': 0.1, 'delta': 1e-5}
  assert accounting.epsilon(gaussian(1.0, math.inf), **kwargs) == 0
  mixed = _Steps([dp_accounting.GaussianDpEvent(math.inf),
                  dp_accounting.GaussianDpEvent(1.0)] * 5)
  assert accounting.epsilon(mixed, **kwargs) == pytest.approx(
      accounting.epsilon(gaussian(1.0, 1.0), **{**kwargs, 'steps': 5}))


def _microbatched(**kwargs):
  return tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=NOISE,
                           num_microbatches=4, expected_batch_size=8, **kwargs)


def test_microbatches_are_refused_under_poisson_sampling():
  """Rows shift when one example is added: no Poisson bound holds."""
  optimizer = _microbatched()
  assert optimizer.records_are_microbatches
  with pytest.raises(ValueError, match='num_microbatches.*Poisson'):
    accounting.epsilon(optimizer, steps=10, sampling_probability=0.1,
                       delta=1e-5)
  with pytest.raises(ValueError, match='num_microbatches.*Poisson'):
    _statement(optimizer, 'poisson')
  # One record per example stays accountable under Poisson sampling.
  per_example = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=NOISE,
                                  num_microbatches=8, expected_batch_size=8)
  assert not per_example.records_are_microbatches
  assert accounting.epsilon(per_example, steps=10, sampling_probability=0.1,
                            delta=1e-5) == accounting.epsilon(
                                gaussian(1.0, NOISE), steps=10,
                                sampling_probability=0.1, delta=1e-5)


def test_microbatches_under_shuffling_double_the_sensitivity():
  statement = _statement(_microbatched(), 'shuffle')
  assert 'sensitivity is doubled' in statement
  assert 'no Poisson-sampling figure' in statement
  assert accounting.epsilon_once_per_epoch(
      _microbatched(), steps=80, steps_per_epoch=16,
      delta=1e-5) == accounting.epsilon_once_per_epoch(
          gaussian(1.0, NOISE / 2), steps=80, steps_per_epoch=16, delta=1e-5)


def test_statement_of_a_known_noise_seed_says_not_private():
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=NOISE,
                                expected_batch_size=250, noise_seed=0)
  for sampling in ('poisson', 'shuffle'):
    assert _headline(_statement(optimizer, sampling)).endswith(
        'NOT PRIVATE: the noise seed is known')


@pytest.mark.parametrize('kwargs, match', [
    ({'sampling': 'poisson'}, 'sampling_probability'),
    ({'sampling': 'shuffle'}, 'steps_per_epoch'),
    ({'sampling': 'poisson', 'sampling_probability': 0.1,
      'steps_per_epoch': 3}, 'steps_per_epoch'),
    ({'sampling': 'shuffle', 'sampling_probability': 0.1,
      'steps_per_epoch': 3}, 'sampling_probability'),
    ({'sampling': 'shuffle', 'steps_per_epoch': 0}, 'steps_per_epoch'),
    ({'sampling': 'shuffle', 'steps_per_epoch': 2.5}, 'steps_per_epoch'),
    ({'sampling': 'poisson', 'sampling_probability': 0.0},
     'sampling_probability'),
    ({'sampling': 'random', 'sampling_probability': 0.1}, 'sampling'),
    ({'sampling': 'poisson', 'sampling_probability': 0.1, 'delta': 1.0},
     'delta'),
])
def test_missing_or_extra_sampling_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    accounting.epsilon_for_sampling(gaussian(1.0, 1.0), steps=3,
                                    **{'delta': 1e-5, **kwargs})


def test_epsilon_for_sampling_dispatches_on_the_sampling():
  privatizer = gaussian(1.0, NOISE)
  assert accounting.epsilon_for_sampling(
      privatizer, sampling='poisson', steps=30, sampling_probability=0.1,
      delta=1e-5) == accounting.epsilon(privatizer, steps=30,
                                        sampling_probability=0.1, delta=1e-5)
  assert accounting.epsilon_for_sampling(
      privatizer, sampling='shuffle', steps=30, steps_per_epoch=10,
      delta=1e-5) == accounting.epsilon_once_per_epoch(
          privatizer, steps=30, steps_per_epoch=10, delta=1e-5)


@pytest.mark.parametrize('kwargs, name', [
    ({'steps': -1, 'sampling_probability': 0.1, 'delta': 1e-5}, 'steps'),
    ({'steps': 3, 'sampling_probability': 1.5, 'delta': 1e-5},
     'sampling_probability'),
    ({'steps': 3, 'sampling_probability': 0.1, 'delta': 0.0}, 'delta'),
])
def test_bad_arguments_are_named(kwargs, name):
  with pytest.raises(ValueError, match=name):
    accounting.epsilon(gaussian(1.0, 1.0), **kwargs)
