"""Banded Toeplitz strategies: their matrices, error and sensitivity against
brute force on small cases."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import correlation


def _matrix(strategy, steps):
  """`C` itself, `steps x steps`."""
  c = strategy.coefficients
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


def test_online_noise_is_the_inverse_applied_to_the_draws():
  """Step by step with `correlate`, the noise is `C^-1 z`."""
  strategy = correlation.banded_toeplitz(4, 30)
  steps, width = 10, 3
  draws = np.random.default_rng(0).normal(size=(steps, width))
  history = [[tf.zeros([width])] * (strategy.bands - 1)]
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
  c = strategy.coefficients
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
