"""The choice of bands against independent computations."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import linalg

from tfdpx import band_selection
from tfdpx import privatizers

DELTA = 1e-5


def _setting(**changes):
  setting = dict(target_epsilon=8.0, examples=320, batch_size=32, epochs=1,
                 delta=DELTA)
  return setting | changes


def _rdp(q, noise_multiplier, steps):
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(noise_multiplier)), steps))
  return accountant.get_epsilon(DELTA)


def _prefix_sum_error(inverse):
  """RMS over steps of the prefix sums' noise std, from the matrix C^-1."""
  prefix = np.cumsum(inverse, axis=0)
  return math.sqrt(np.mean(np.sum(prefix**2, axis=1)))


@pytest.mark.parametrize('bands', [1, 2, 4])
def test_trajectory_noise_is_the_calibrated_multiplier_times_the_error(bands):
  """z_b reaches the target under dp_accounting's own RDP of one group's
  Poisson-sampled steps (one band: DP-SGD's), and the error is that of the
  strategy's inverse written as a matrix."""
  setting = _setting()
  steps = 10  # ceil(320 / 32), one epoch.
  gaussian = privatizers.gaussian(1.0, 1.0)
  noise = band_selection.trajectory_noise(gaussian, bands, **setting)
  strategy = band_selection.correlation.banded_toeplitz(bands, steps)
  coefficients = strategy.toeplitz_coefficients(steps)
  inverse = np.linalg.inv(linalg.toeplitz(coefficients,
                                          np.zeros_like(coefficients)))
  z = noise / _prefix_sum_error(inverse)
  q = bands * 32 / 320
  eps = _rdp(q, z, math.ceil(steps / bands))
  assert 8.0 * (1 - 2e-3) <= eps <= 8.0 * (1 + 1e-9)
  assert _rdp(q, z * 0.99, math.ceil(steps / bands)) > 8.0
  if bands == 1:
    assert _prefix_sum_error(inverse) == pytest.approx(math.sqrt(5.5))


def test_least_noise_bands_trades_cancellation_for_amplification():
  """One pass at epsilon 8: bands win; ten passes at epsilon 0.5: DP-SGD's
  amplification wins. Groups smaller than the batch are not tried."""
  gaussian = privatizers.gaussian(1.0, 1.0)
  one_pass = band_selection.trajectory_noise_by_bands(gaussian, **_setting())
  assert sorted(one_pass) == [1, 2, 4, 8]
  chosen = band_selection.least_noise_bands(gaussian, **_setting())
  assert chosen > 1 and one_pass[chosen] == min(one_pass.values())
  assert one_pass[chosen] < 0.9 * one_pass[1]
  assert band_selection.least_noise_bands(
      gaussian, **_setting(target_epsilon=0.5, epochs=10)) == 1
  assert sorted(band_selection.trajectory_noise_by_bands(
      gaussian, max_bands=2, **_setting(target_epsilon=0.5, epochs=10))) == [
          1, 2]


def test_groups_smaller_than_the_batch_are_refused():
  with pytest.raises(ValueError, match='at most 10 bands'):
    band_selection.trajectory_noise(privatizers.gaussian(1.0, 1.0), 16,
                                    **_setting())
