"""Accounting of noise correlated across steps, against independent
dp_accounting computations."""

import math

import dp_accounting
import pytest

import tfdpx
from tfdpx import accounting
from tfdpx import correlation
from tfdpx import privatizers

DELTA = 1e-5


def _correlated(bands, noise_multiplier=1.1, inner=None):
  inner = inner or privatizers.gaussian(1.0, noise_multiplier)
  return privatizers.correlated(inner,
                                correlation.banded_toeplitz(bands, 100))


def _rdp(event):
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(event)
  return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize('steps,groups', [(100, 4), (101, 4), (30, 8)])
def test_cyclic_poisson_is_dp_sgd_over_the_group_steps(steps, groups):
  """Amplified banded MF: the group with the most steps, each a
  Poisson-sampled Gaussian step (Choquette-Choo et al. 2023, Theorem 4)."""
  q = 0.05
  expected = _rdp(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(1.1)), math.ceil(steps / groups)))
  eps = accounting.epsilon_for_sampling(
      _correlated(4), sampling='cyclic_poisson', steps=steps,
      sampling_probability=q, groups=groups, delta=DELTA)
  assert eps == pytest.approx(expected, rel=1e-9)
  fewer = accounting.epsilon_cyclic_poisson(
      _correlated(4), steps=steps - groups, sampling_probability=q,
      groups=groups, delta=DELTA)
  assert fewer < eps  # One step fewer for every group.


def test_cyclic_poisson_takes_the_worst_group_step_by_step():
  """DPDR's step events differ (DP-SGD and decomposition steps); every
  group is composed from its own steps' events."""
  privatizer = _correlated(2, inner=privatizers.dpdr(
      1.0, 1.1, decomposition_steps=3, alpha_noise_multiplier=5.0,
      perp_noise_multiplier=1.5))
  groups, steps, q = 2, 6, 0.1
  worst = max(
      _rdp(dp_accounting.ComposedDpEvent([
          accounting._poisson_sampled(q, accounting.normalized_event(  # pylint: disable=protected-access
              privatizer.dp_event(t))) for t in range(g, steps, groups)]))
      for g in range(groups))
  assert accounting.epsilon_cyclic_poisson(
      privatizer, steps=steps, sampling_probability=q, groups=groups,
      delta=DELTA) == pytest.approx(worst, rel=1e-9)


def test_independent_noise_under_one_group_is_poisson_sampling():
  gaussian = privatizers.gaussian(1.0, 1.1)
  assert accounting.epsilon_cyclic_poisson(
      gaussian, steps=50, sampling_probability=0.02, groups=1,
      delta=DELTA) == pytest.approx(accounting.epsilon(
          gaussian, steps=50, sampling_probability=0.02, delta=DELTA))


def test_correlated_noise_needs_separated_steps():
  with pytest.raises(ValueError, match='cyclic_poisson'):
    accounting.epsilon(_correlated(4), steps=10, sampling_probability=0.1,
                       delta=DELTA)
  with pytest.raises(ValueError, match='groups=3: .* pass groups >= 4'):
    accounting.epsilon_cyclic_poisson(_correlated(4), steps=10,
                                      sampling_probability=0.1, groups=3,
                                      delta=DELTA)
  with pytest.raises(ValueError, match='groups'):
    accounting.check_accounting_arguments('cyclic_poisson', delta=DELTA,
                                          sampling_probability=0.1)
  with pytest.raises(ValueError, match="groups is for sampling='cyclic"):
    accounting.check_accounting_arguments('poisson', delta=DELTA,
                                          sampling_probability=0.1, groups=2)


def test_shuffled_batches_are_one_gaussian_of_the_worst_pattern():
  """Once per epoch at any position: one Gaussian mechanism whose
  sensitivity is the strategy's worst pattern, larger than DP-SGD's
  sqrt(epochs) because participations at an epoch's boundary overlap."""
  privatizer = _correlated(3, noise_multiplier=2.0)
  steps, steps_per_epoch = 40, 10
  sensitivity = privatizer.correlation.once_per_epoch_sensitivity(
      steps, steps_per_epoch)
  assert sensitivity > 2.0 * 1.01  # 4 epochs: DP-SGD's would be 2.
  expected = _rdp(dp_accounting.GaussianDpEvent(2.0 / sensitivity))
  eps = accounting.epsilon_for_sampling(
      privatizer, sampling='shuffle', steps=steps,
      steps_per_epoch=steps_per_epoch, delta=DELTA)
  assert eps == pytest.approx(expected, rel=1e-9)
  assert eps > accounting.epsilon_once_per_epoch(
      privatizers.gaussian(1.0, 2.0), steps=steps,
      steps_per_epoch=steps_per_epoch, delta=DELTA)


def test_calibration_and_statement_under_cyclic_sampling():
  privatizer = _correlated(4)
  z = accounting.calibrate_noise_multiplier(
      3.0, privatizer, steps=200, delta=DELTA, sampling_probability=0.08,
      groups=4)
  eps = accounting.epsilon_cyclic_poisson(
      privatizer.with_noise_multiplier(z), steps=200,
      sampling_probability=0.08, groups=4, delta=DELTA)
  assert 3.0 * (1 - 1e-3) <= eps <= 3.0
  assert privatizer.with_noise_multiplier(z).correlation == (
      privatizer.correlation)
  statement = accounting.privacy_statement(
      privatizer, sampling='cyclic_poisson', steps=200, num_examples=1000,
      expected_batch_size=20, delta=DELTA, groups=4)
  assert 'correlated across steps' in statement
  assert 'cyclic Poisson: 4 groups' in statement
  cyclic = accounting.epsilon_cyclic_poisson(
      privatizer, steps=200, sampling_probability=0.08, groups=4,
      delta=DELTA)
  assert f'{cyclic:.4g}' in statement
  shuffled = tfdpx.accounting.privacy_statement(
      privatizer, sampling='shuffle', steps=200, num_examples=1000,
      expected_batch_size=20, delta=DELTA)
  assert 'no Poisson-sampling figure: correlated noise' in shuffled


def test_blt_is_accounted_without_amplification():
  """A BLT's columns never end: cyclic Poisson sampling amplifies nothing
  and is refused, as plain Poisson sampling is; shuffled batches are one
  Gaussian mechanism of the BLT's once-per-epoch bound, and one epoch (one
  participation) costs at most DP-SGD's single step."""
  privatizer = privatizers.correlated(privatizers.gaussian(1.0, 2.0),
                                      correlation.blt(2, 100))
  with pytest.raises(ValueError, match='not banded.*sampling=.shuffle'):
    accounting.epsilon_cyclic_poisson(privatizer, steps=100,
                                      sampling_probability=0.1, groups=100,
                                      delta=DELTA)
  with pytest.raises(ValueError, match="nearby steps.* sampling='shuffle'"):
    accounting.epsilon(privatizer, steps=100, sampling_probability=0.1,
                       delta=DELTA)
  for steps_per_epoch in (100, 25):
    sensitivity = privatizer.correlation.once_per_epoch_sensitivity(
        100, steps_per_epoch)
    eps = accounting.epsilon_for_sampling(
        privatizer, sampling='shuffle', steps=100,
        steps_per_epoch=steps_per_epoch, delta=DELTA)
    assert eps == pytest.approx(
        _rdp(dp_accounting.GaussianDpEvent(2.0 / sensitivity)), rel=1e-9)
  assert eps > _rdp(dp_accounting.GaussianDpEvent(2.0 / 2.0))  # 4 epochs.
  assert accounting.epsilon_for_sampling(
      privatizer, sampling='shuffle', steps=100, steps_per_epoch=100,
      delta=DELTA) <= _rdp(dp_accounting.GaussianDpEvent(2.0))
  statement = accounting.privacy_statement(
      privatizer, sampling='shuffle', steps=100, num_examples=1000,
      expected_batch_size=10, delta=DELTA)
  assert 'blt(buffers=2)' in statement and '2 secret tensors' in statement


def test_independent_noise_has_the_banded_claim_under_cyclic_sampling():
  """Why an audit cannot catch banded noise replaced by independent noise
  of the same multiplier (b = 1): under cyclic Poisson sampling with
  groups >= bands each participation is its step's event whatever the
  bands, so independent noise has exactly the claimed epsilon. (The noise
  covariance test, tests/privatizers/test_correlated.py, catches it.)"""
  inner = privatizers.gaussian(1.0, 0.9)
  for bands in (2, 4):
    banded = privatizers.correlated(inner,
                                    correlation.banded_toeplitz(bands, 40))
    for accountant in ('rdp', 'pld'):
      kwargs = dict(steps=40, sampling_probability=0.3, groups=4, delta=1e-5,
                    accountant=accountant)
      assert accounting.epsilon_cyclic_poisson(banded, **kwargs) == (
          accounting.epsilon_cyclic_poisson(inner, **kwargs))
