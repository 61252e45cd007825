"""Banded Toeplitz and BLT strategies: their matrices, error and sensitivity
against brute force on small cases."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import correlation


def _matrix(strategy, steps):
  """`C` itself, `steps x steps`."""
  c = strategy.toeplitz_coefficients(steps)
  matrix = np.zeros((steps, steps))
  for j, value in enumerate(c):
    matrix += np.diag(np.full(max(steps - j, 0), value), -j)[:steps, :steps]
  return matrix


def test_coefficients_have_unit_norm_and_validate():
  strategy = correlation.BandedToeplitz([2.0, 1.0, 1.0])
  assert strategy.bands == 3
  np.testing.assert_allclose(np.linalg.norm(strategy.coefficients), 1.0)
  for bad in ([], [0.0, 1.0], [-1.0], [1.0, math.nan], 'ab'):
    with pytest.raises(ValueError, match='coefficients'):
      correlation.BandedToeplitz(bad)
  for name, args in (('bands', (0, 10)), ('steps', (2, 1.5))):
    with pytest.raises(ValueError, match=name):
      correlation.banded_toeplitz(*args)


def test_config_round_trips():
  strategy = correlation.banded_toeplitz(4, 50)
  rebuilt = correlation.deserialize(correlation.serialize(strategy))
  assert rebuilt == strategy and rebuilt.bands == 4
  with pytest.raises(ValueError, match='unknown noise correlation'):
    correlation.deserialize({'name': 'tree', 'config': {}})


def test_inverse_and_covariance_are_those_of_the_matrix():
  strategy = correlation.banded_toeplitz(3, 20)
  matrix = _matrix(strategy, 9)
  inverse = np.linalg.inv(matrix)
  np.testing.assert_allclose(inverse[:, 0], strategy.inverse_coefficients(9),
                             atol=1e-12)
  np.testing.assert_allclose(strategy.noise_covariance(9), inverse @ inverse.T,
                             atol=1e-10)


@pytest.mark.parametrize('bands', [1, 2, 5])
def test_prefix_sum_error_is_that_of_the_matrix(bands):
  steps = 12
  strategy = correlation.banded_toeplitz(bands, steps)
  workload = np.tril(np.ones((steps, steps)))
  error = workload @ np.linalg.inv(_matrix(strategy, steps))
  expected = math.sqrt(np.sum(error**2) / steps)  # Column norm 1.
  assert strategy.prefix_sum_error(steps) == pytest.approx(expected,
                                                           rel=1e-9)


@pytest.mark.parametrize('strategy', [
    correlation.banded_toeplitz(3, 12),
    correlation.BufferedLinearToeplitz([0.9, 0.0], [0.4, -0.2])],
                         ids=['banded', 'blt'])
def test_momentum_error_is_that_of_the_matrix(strategy):
  """SGD with momentum 0.9 moves the weights by the momentum sums of the
  releases: the workload written out from Keras' update rule, `v_t = beta
  v_{t-1} + g_t`, `w_t = sum_{s <= t} v_s`."""
  steps, beta = 12, 0.9
  velocity = np.zeros((steps, steps))  # Row t: v_t's weight on each g_k.
  for t in range(steps):
    velocity[t] = beta * (velocity[t - 1] if t else 0.0) + np.eye(steps)[t]
  workload = np.cumsum(velocity, axis=0)
  error = workload @ np.linalg.inv(_matrix(strategy, steps))
  expected = math.sqrt(np.sum(error**2) / steps)
  assert strategy.prefix_sum_error(steps, momentum=beta) == pytest.approx(
      expected, rel=1e-9)


def test_strategies_optimized_for_momentum_win_on_its_trajectory():
  """At momentum 0.9 over 300 steps, the strategies optimized for its
  workload have less trajectory error under it than those optimized for the
  prefix sums, and both less than DP-SGD; the loss's analytic gradient is
  its finite difference."""
  steps, beta = 300, 0.9
  dp_sgd = correlation.banded_toeplitz(1, steps).prefix_sum_error(steps, beta)
  for build, size in ((correlation.banded_toeplitz, 8),
                      (correlation.blt, 2)):
    tuned = build(size, steps, momentum=beta).prefix_sum_error(steps, beta)
    plain = build(size, steps).prefix_sum_error(steps, beta)
    assert tuned < 0.99 * plain < dp_sgd
  c = np.array([1.0, 0.6, 0.3])
  # pylint: disable-next=protected-access
  loss, gradient = correlation._prefix_sum_loss(c, steps, beta)
  for j, derivative in enumerate(gradient, start=1):
    shifted = c.copy()
    shifted[j] += 1e-6
    # pylint: disable-next=protected-access
    assert (correlation._prefix_sum_loss(shifted, steps, beta)[0] - loss
           ) / 1e-6 == pytest.approx(derivative, rel=1e-4)
  for bad in (-0.1, 1.0, True):
    with pytest.raises(ValueError, match='momentum'):
      correlation.banded_toeplitz(2, 10, momentum=bad)
    with pytest.raises(ValueError, match='momentum'):
      correlation.blt(2, 10, momentum=bad)


def test_blts_optimized_for_several_epochs_win_at_a_given_epsilon():
  """Over 12 shuffled epochs of 50 steps the accountant charges a BLT its
  once-per-epoch sensitivity: optimized for that, its error times the
  sensitivity is at least 5% below the one-participation optimum's (which
  is still below DP-SGD's, unamplified); in one epoch the two agree."""
  def at_epsilon(strategy, steps, steps_per_epoch):
    return strategy.prefix_sum_error(steps) * (
        strategy.once_per_epoch_sensitivity(steps, steps_per_epoch))
  steps, per_epoch = 600, 50
  several = at_epsilon(correlation.blt(2, steps, steps_per_epoch=per_epoch),
                       steps, per_epoch)
  one = at_epsilon(correlation.blt(2, steps), steps, per_epoch)
  dp_sgd = at_epsilon(correlation.banded_toeplitz(1, steps), steps, per_epoch)
  assert several < 0.95 * one < dp_sgd
  assert at_epsilon(correlation.blt(2, 100, steps_per_epoch=100), 100,
                    100) == pytest.approx(
                        correlation.blt(2, 100).prefix_sum_error(100),
                        rel=1e-2)
  with pytest.raises(ValueError, match='steps_per_epoch'):
    correlation.blt(2, 100, steps_per_epoch=0)


def test_optimized_bands_beat_dp_sgd_and_the_square_root_start():
  steps = 500
  dp_sgd = math.sqrt((steps + 1) / 2)
  assert correlation.banded_toeplitz(1, steps).prefix_sum_error(
      steps) == pytest.approx(dp_sgd)
  errors = [correlation.banded_toeplitz(b, steps).prefix_sum_error(steps)
            for b in (2, 4, 16)]
  assert errors[0] < 0.8 * dp_sgd and errors[2] < errors[1] < errors[0]
  # pylint: disable-next=protected-access
  start = correlation.BandedToeplitz(correlation._square_root_coefficients(16))
  assert errors[2] < 0.95 * start.prefix_sum_error(steps)


# A BLT whose parameters are not the optimizer's: two decays, one of them 0.
BLT = correlation.BufferedLinearToeplitz([0.9, 0.0], [0.4, -0.2])


def _blt_matrix(steps):
  """BLT's `C` from its definition, entry by entry, column norm 1 in the
  limit."""
  (t1, t2), (w1, w2) = BLT.decays, BLT.output_scales
  c = [1.0] + [w1 * t1**(k - 1) + w2 * t2**(k - 1) for k in range(1, 4000)]
  matrix = np.zeros((steps, steps))
  for t in range(steps):
    for u in range(t + 1):
      matrix[t, u] = c[t - u]
  return matrix / np.linalg.norm(c)


def test_blt_is_its_definition_with_columns_of_norm_at_most_one():
  matrix = _blt_matrix(12)
  np.testing.assert_allclose(_matrix(BLT, 12), matrix, atol=1e-12)
  inverse = np.linalg.inv(matrix)
  np.testing.assert_allclose(BLT.inverse_coefficients(12), inverse[:, 0],
                             atol=1e-10)
  norms = [np.linalg.norm(BLT.toeplitz_coefficients(n)) for n in (1, 10, 500)]
  assert norms[0] < norms[1] < norms[2] <= 1.0
  assert norms[2] == pytest.approx(1.0, abs=1e-12)
  workload = np.tril(np.ones((12, 12)))
  assert BLT.prefix_sum_error(12) == pytest.approx(
      math.sqrt(np.sum((workload @ inverse)**2) / 12), rel=1e-9)


def test_blt_validates_and_round_trips():
  assert BLT.buffers == BLT.history_length == 2
  rebuilt = correlation.deserialize(correlation.serialize(BLT))
  assert rebuilt == BLT and rebuilt.decays == (0.9, 0.0)
  for decays, scales, name in (([], [], 'decays'), ([1.0], [0.1], 'decays'),
                               ([-0.1], [0.1], 'decays'),
                               ([0.5], [0.1, 0.2], 'output_scales'),
                               ([0.5], [math.inf], 'output_scales')):
    with pytest.raises(ValueError, match=name):
      correlation.BufferedLinearToeplitz(decays, scales)
  for name, args in (('buffers', (0, 10)), ('steps', (2, 0))):
    with pytest.raises(ValueError, match=name):
      correlation.blt(*args)


def test_optimized_blt_beats_banded_strategies_for_one_participation():
  """One participation (one epoch): two buffers come within 10% of three and
  beat 64 bands, each far below DP-SGD (prefix-sum error per noise std)."""
  steps = 1000
  dp_sgd = math.sqrt((steps + 1) / 2)
  errors = [correlation.blt(d, steps).prefix_sum_error(steps)
            for d in (1, 2, 3)]
  assert errors[0] < 0.2 * dp_sgd
  assert errors[2] <= errors[1] * (1 + 1e-9) < errors[0]
  assert errors[1] < 1.1 * errors[2]
  assert errors[1] < correlation.banded_toeplitz(64, steps).prefix_sum_error(
      steps)


@pytest.mark.parametrize('strategy', [correlation.banded_toeplitz(4, 30), BLT],
                         ids=['banded', 'blt'])
def test_online_noise_is_the_inverse_applied_to_the_draws(strategy):
  """Step by step with `correlate`, the noise is `C^-1 z`."""
  steps, width = 10, 3
  draws = np.random.default_rng(0).normal(size=(steps, width))
  history = [[tf.zeros([width])] * strategy.history_length]
  noises = []
  for t in range(steps):
    (noise,), history = strategy.correlate(
        [tf.constant(draws[t], tf.float32)], history)
    noises.append(noise.numpy())
  expected = np.linalg.solve(_matrix(strategy, steps), draws)
  np.testing.assert_allclose(np.array(noises), expected, rtol=1e-5,
                             atol=1e-5)


def _worst_pattern(strategy, steps, steps_per_epoch, rows):
  """Brute force: the largest `|C u|` over one step per epoch (u the
  indicator of the steps: records all equal, the worst for `C^T C >= 0`),
  with `C` of `rows` rows."""
  full = np.zeros((rows, steps))
  c = strategy.toeplitz_coefficients(rows)
  for t in range(steps):
    for j, value in enumerate(c):
      if t + j < rows:
        full[t + j, t] = value
  epochs = [range(s, min(s + steps_per_epoch, steps))
            for s in range(0, steps, steps_per_epoch)]
  return max(np.linalg.norm(full[:, list(p)].sum(axis=1))
             for p in itertools.product(*epochs))


@pytest.mark.parametrize('bands,steps,steps_per_epoch',
                         [(2, 8, 2), (3, 10, 3), (3, 11, 4), (4, 12, 5),
                          (1, 6, 2)])
def test_once_per_epoch_sensitivity_is_the_worst_pattern(
    bands, steps, steps_per_epoch):
  strategy = correlation.banded_toeplitz(bands, 40)
  assert min(strategy.coefficients) > 0  # Then C^T C >= 0: u is the worst.
  bound = strategy.once_per_epoch_sensitivity(steps, steps_per_epoch)
  # Exact where no column is cut short by the run's end, and an upper bound
  # of the real (shorter) columns.
  assert bound == pytest.approx(
      _worst_pattern(strategy, steps, steps_per_epoch, steps + bands), rel=1e-9)
  assert bound >= _worst_pattern(strategy, steps, steps_per_epoch, steps)
  epochs = math.ceil(steps / steps_per_epoch)
  assert bound >= math.sqrt(epochs) * (1 - 1e-12)
  if bands > 1:
    assert bound > math.sqrt(epochs) * 1.01  # Boundaries overlap.


def test_once_per_epoch_sensitivity_bounds_records_in_any_direction():
  strategy = correlation.banded_toeplitz(3, 40)
  steps, steps_per_epoch = 9, 3
  bound = strategy.once_per_epoch_sensitivity(steps, steps_per_epoch)
  matrix = _matrix(strategy, steps)
  rng = np.random.default_rng(1)
  for _ in range(200):
    steps_taken = [rng.integers(s, s + steps_per_epoch)
                   for s in range(0, steps, steps_per_epoch)]
    records = rng.normal(size=(len(steps_taken), 4))
    records /= np.linalg.norm(records, axis=1, keepdims=True)
    x = np.zeros((steps, 4))
    x[steps_taken] = records
    assert np.linalg.norm(matrix @ x) <= bound * (1 + 1e-9)


def test_once_per_epoch_sensitivity_refuses_short_epochs():
  with pytest.raises(ValueError, match='steps_per_epoch=2 .* 3 bands'):
    correlation.banded_toeplitz(3, 10).once_per_epoch_sensitivity(10, 2)


@pytest.mark.parametrize('steps,steps_per_epoch', [(8, 2), (10, 3), (12, 5),
                                                   (9, 9)])
def test_blt_once_per_epoch_sensitivity_bounds_every_pattern(
    steps, steps_per_epoch):
  """Above the worst of every pattern with records in any direction (the
  brute force over indicators, and records of both signs), and not far above
  it for an optimized BLT, whose coefficients are positive."""
  optimized = correlation.blt(2, 40)
  bound = optimized.once_per_epoch_sensitivity(steps, steps_per_epoch)
  worst = _worst_pattern(optimized, steps, steps_per_epoch, steps)
  assert worst <= bound * (1 + 1e-12) < 1.25 * worst
  if steps == steps_per_epoch:  # One participation: its column's norm.
    assert bound == pytest.approx(np.linalg.norm(
        optimized.toeplitz_coefficients(steps)), rel=1e-12)
  matrix = _matrix(BLT, steps)  # Coefficients of both signs.
  bound = BLT.once_per_epoch_sensitivity(steps, steps_per_epoch)
  rng = np.random.default_rng(2)
  epochs = [range(s, min(s + steps_per_epoch, steps))
            for s in range(0, steps, steps_per_epoch)]
  for pattern in itertools.product(*epochs):
    for _ in range(5):
      records = rng.normal(size=(len(pattern), 3))
      records /= np.linalg.norm(records, axis=1, keepdims=True)
      x = np.zeros((steps, 3))
      x[list(pattern)] = records
      assert np.linalg.norm(matrix @ x) <= bound * (1 + 1e-9)
