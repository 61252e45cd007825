"""Noise schedules (spec d2p2.md section 7, properties 3-9)."""

import json
import math

import dp_accounting
from dp_accounting import rdp
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import schedules

DELTA = 1e-5


def test_inv_sqrt_step_is_z0_over_sqrt_k_with_the_floor():
  schedule = schedules.get('inv_sqrt_step', 3.0, min_noise_multiplier=0.5)
  assert schedule.value(0) == 3.0  # k = step + 1 = 1 (spec P22).
  for step in range(100):
    assert schedule.value(step) == max(0.5, 3.0 / math.sqrt(step + 1))
  assert schedule.value(10**6) == 0.5


def test_inv_fourth_root_epoch_is_constant_within_an_epoch():
  schedule = schedules.get('inv_fourth_root_epoch', 3.0, steps_per_epoch=59,
                           min_noise_multiplier=0.1)
  values = [schedule.value(step) for step in range(59 * 3)]
  assert values[:59] == [3.0] * 59
  assert values[59] == pytest.approx(3.0 / 2**0.25, rel=1e-15)
  for step, value in enumerate(values):
    assert value == 3.0 / math.sqrt(math.sqrt(step // 59 + 1))


@pytest.mark.parametrize('schedule', [
    schedules.constant(1.3),
    schedules.inv_sqrt_step(3.0, 0.4),
    schedules.inv_fourth_root_epoch(2.0, 7, 0.9),
    schedules.PowerDecay(2.0, 0.3, 3, 0.2),
])
def test_schedules_are_non_increasing_floored_and_start_at_z0(schedule):
  values = [schedule.value(step) for step in range(400)]
  assert values[0] == schedule.config['initial']
  assert all(b <= a for a, b in zip(values, values[1:]))
  assert min(values) >= schedule.config['minimum']


def test_constant_is_z0_at_every_step():
  schedule = schedules.get('constant', 1.7)
  assert {schedule.value(step) for step in range(1000)} == {1.7}


@pytest.mark.parametrize('schedule', [
    schedules.constant(1.3),
    schedules.inv_sqrt_step(3.0, 0.1),
    schedules.inv_fourth_root_epoch(3.0, 59, 0.1),
    schedules.PowerDecay(2.0, 0.3, 3, 0.2),
    schedules.Piecewise([5, 9], [2.0, 1.5, 1.25]),
])
def test_graph_and_python_values_agree_with_and_without_xla(schedule):
  steps = tf.range(3000, dtype=tf.int64)
  expected = np.array([schedule.value(s) for s in range(3000)])
  accounted = np.array([schedule.accounted_value(s) for s in range(3000)])
  eager = schedule.tf_value(steps).numpy()
  compiled = tf.function(schedule.tf_value, jit_compile=True)(steps).numpy()
  scalar = np.array([schedule.tf_value(tf.constant(s, tf.int64)).numpy()
                     for s in (0, 1, 2, 58, 59, 2999)])
  np.testing.assert_array_equal(scalar, eager[[0, 1, 2, 58, 59, 2999]])
  for graph in (eager, compiled):
    np.testing.assert_allclose(graph, expected, rtol=1e-14)
    assert np.all(graph >= accounted)  # Never less noise than accounted.
  np.testing.assert_allclose(accounted, expected, rtol=2e-12)


def test_piecewise_table():
  schedule = schedules.Piecewise([2, 4], [3.0, 2.0, 1.0])
  assert [schedule.value(s) for s in range(6)] == [3, 3, 2, 2, 1, 1]
  assert schedule.rescaled(6.0).config['values'] == [6.0, 4.0, 2.0]


@pytest.mark.parametrize('schedule', [
    schedules.inv_fourth_root_epoch(3.0, 59, 0.1),
    schedules.Piecewise([5], [2.0, 1.0]),
])
def test_schedules_round_trip_through_json(schedule):
  rebuilt = schedules.deserialize(
      json.loads(json.dumps(schedules.serialize(schedule))))
  assert rebuilt == schedule


@pytest.mark.parametrize('kwargs, argument', [
    (dict(noise_schedule='inv_sqrt_step'), 'min_noise_multiplier'),
    (dict(noise_schedule='inv_fourth_root_epoch', min_noise_multiplier=0.1),
     'steps_per_epoch'),
    (dict(noise_schedule='constant', min_noise_multiplier=0.1),
     'min_noise_multiplier'),
    (dict(noise_schedule='cosine'), 'noise_schedule'),
])
def test_decaying_schedules_need_their_floor_and_period(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    tfdpx.privatizers.d2p2(3.0, **kwargs)


@pytest.mark.parametrize('kwargs, argument', [
    (dict(initial=-1.0), 'initial'), (dict(initial=1.0, power=-1), 'power'),
    (dict(initial=1.0, period=0), 'period'),
    (dict(initial=1.0, minimum=-0.1), 'minimum'),
])
def test_power_decay_validates_its_arguments(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    schedules.PowerDecay(**kwargs)


# --- accounting (properties 6, 7 and 9) -----------------------------------------


def _code_schedule(z0=3.0, steps_per_epoch=59):
  return tfdpx.privatizers.d2p2(
      z0, noise_schedule='inv_fourth_root_epoch',
      steps_per_epoch=steps_per_epoch, min_noise_multiplier=0.1,
      projection='none')


def _per_step_events_epsilon(privatizer, steps, q):
  """RDP over one event per step, without any grouping."""
  accountant = rdp.RdpAccountant()
  accountant.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.PoissonSampledDpEvent(q, privatizer.dp_event(step))
      for step in range(steps)]))
  return accountant.get_epsilon(DELTA)


def test_dp_event_follows_the_schedule_and_grouping_is_exact():
  privatizer = _code_schedule(3.0, steps_per_epoch=3)
  zs = [privatizer.dp_event(step).noise_multiplier for step in range(9)]
  planned = [3.0] * 3 + [3.0 / 2**0.25] * 3 + [3.0 / 3**0.25] * 3
  np.testing.assert_allclose(zs, planned, rtol=1e-11)
  assert all(z <= p for z, p in zip(zs, planned))
  assert all(type(z) is float for z in zs)  # pylint: disable=unidiomatic-typecheck
  grouped = tfdpx.accounting.epsilon(privatizer, steps=9,
                                     sampling_probability=0.05, delta=DELTA)
  assert grouped == pytest.approx(
      _per_step_events_epsilon(privatizer, 9, 0.05), rel=1e-12)


def test_dynamic_costs_more_than_static_and_epsilon_is_monotone():
  q, steps = 0.05, 60

  def eps(z0, steps=steps):
    return tfdpx.accounting.epsilon(_code_schedule(z0, 20), steps=steps,
                                    sampling_probability=q, delta=DELTA)

  static = tfdpx.accounting.epsilon(tfdpx.privatizers.d2p2(
      2.0, projection='none'), steps=steps, sampling_probability=q,
                                    delta=DELTA)
  assert eps(2.0) > static
  assert eps(2.5) < eps(2.0)
  assert eps(2.0, steps=40) < eps(2.0)


def test_calibration_reaches_the_target_and_keeps_the_floor():
  privatizer = tfdpx.privatizers.d2p2(
      1.0, noise_schedule='inv_fourth_root_epoch', steps_per_epoch=10,
      min_noise_multiplier=0.8, projection='none')
  z0 = tfdpx.accounting.calibrate_noise_multiplier(
      2.0, privatizer, steps=30, sampling_probability=0.05, delta=DELTA)
  calibrated = privatizer.with_noise_multiplier(z0)
  eps = tfdpx.accounting.epsilon(calibrated, steps=30,
                                 sampling_probability=0.05, delta=DELTA)
  assert 2.0 * (1 - 1e-3) <= eps <= 2.0
  assert min(calibrated.dp_event(s).noise_multiplier
             for s in range(30)) >= 0.8


def test_regression_official_code_schedule_fmnist():
  """Spec 4.6 / property 9: FMNIST, q = 1/59, 40 epochs, z_e = 3 / e^(1/4).

  The spec's RDP values (dp_accounting 0.6.0): dynamic 3.070, static 1.174.
  Recomputed here from one event per distinct z with dp_accounting directly.
  """
  q, steps = 1 / 59, 40 * 59
  privatizer = _code_schedule()
  eps = tfdpx.accounting.epsilon(privatizer, steps=steps,
                                 sampling_probability=q, delta=DELTA)
  zs = [3.0 / e**0.25 for e in range(1, 41)]
  accountant = rdp.RdpAccountant()
  accountant.compose(dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)),
          59) for z in zs]))
  assert eps == pytest.approx(accountant.get_epsilon(DELTA), rel=1e-9)
  assert eps == pytest.approx(3.070, rel=0.01)


# dp_accounting 0.4.3 gives 35.84 for the 0.5 floor, 2.9% under the spec's
# 36.9 (0.6.0): its optimum is at the fractional order 1.6 with z = 0.5, where
# the two versions' fractional-order series differ. Tolerance 4% there, 1%
# elsewhere.
@pytest.mark.slow
@pytest.mark.parametrize('name, n, make, expected', [
    ('fmnist static', 60000, lambda spe: tfdpx.privatizers.d2p2(
        3.0, projection='none'), 1.174),
    ('svhn static', 73257, lambda spe: tfdpx.privatizers.d2p2(
        3.0, projection='none'), 1.051),
    ('svhn code dynamic', 73257, lambda spe: _code_schedule(3.0, spe), 2.735),
    ('fmnist 3/sqrt(k) floor 0.5', 60000, lambda spe: tfdpx.privatizers.d2p2(
        3.0, noise_schedule='inv_sqrt_step', min_noise_multiplier=0.5,
        projection='none'), (36.9, 0.04)),
    ('fmnist 3/sqrt(k) floor 1.0', 60000, lambda spe: tfdpx.privatizers.d2p2(
        3.0, noise_schedule='inv_sqrt_step', min_noise_multiplier=1.0,
        projection='none'), 5.57),
    ('fmnist 3/sqrt(k) floor 1.5', 60000, lambda spe: tfdpx.privatizers.d2p2(
        3.0, noise_schedule='inv_sqrt_step', min_noise_multiplier=1.5,
        projection='none'), 2.83),
])
def test_spec_worked_schedules(name, n, make, expected):
  """Spec 4.6 table (RDP column), B = 1024, 40 epochs, q = 1/ceil(n/B)."""
  steps_per_epoch = math.ceil(n / 1024)
  expected, rel = expected if isinstance(expected, tuple) else (expected,
                                                                0.01)
  eps = tfdpx.accounting.epsilon(
      make(steps_per_epoch), steps=40 * steps_per_epoch,
      sampling_probability=1 / steps_per_epoch, delta=DELTA)
  assert eps == pytest.approx(expected, rel=rel), (name, eps)


@pytest.mark.slow
def test_mode_c_with_the_true_sensitivity_of_the_code_projection():
  """Spec 4.6: FMNIST code schedule, accounted with Delta = 2.83 (mode P's
  hidden sensitivity) gives RDP 40.8 (dp_accounting 0.6.0; 0.4.3 gives 39.80,
  2.5% lower, at low orders with z < 1.1) instead of the reported 2.75.

  Mode C reports `GaussianDpEvent(z_k)` for noise `z_k Delta` on a
  sensitivity-`Delta` release; the paper's noise `z_k` on that release is the
  same as `z_k / Delta` on sensitivity 1.
  """
  q, delta_sens = 1 / 59, 2.83
  paper_noise = _code_schedule().with_noise_multiplier(3.0 / delta_sens)
  eps = tfdpx.accounting.epsilon(paper_noise, steps=40 * 59,
                                 sampling_probability=q, delta=DELTA)
  assert eps == pytest.approx(40.8, rel=0.03)
