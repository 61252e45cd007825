"""Privacy accounting: privatizer events -> epsilon, calibration, statements.

Everything here is host-side Python over `dp_accounting` (RDP). The training
event is built only from `dp_event(step)` of the privatizer (or optimizer) that
added the noise; nothing here rebuilds an event from hyperparameters.

Sampling assumption: `sampling_probability` is the probability of each example
to be in a batch under Poisson sampling. Keras `fit` over shuffled fixed-size
batches is not Poisson sampling; the Poisson epsilon is then the customary
approximation, not a proven bound (see `privacy_statement`).
"""

import functools
import math
from typing import Optional, Sequence

import dp_accounting
from dp_accounting import rdp
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np

from tfdpx import core

SAMPLING_ASSUMPTIONS = ('poisson', 'shuffle')


def _events_of(source):
  """`step -> DpEvent` of a privatizer or of a tfdpx optimizer."""
  if isinstance(source, core.Privatizer):
    return source.dp_event
  if hasattr(source, 'dp_event') and hasattr(source, 'privatizer'):
    return source.dp_event
  raise TypeError(
      'expected a tfdpx privatizer or optimizer, got '
      f'{type(source).__name__}')


def training_event(
    source, *, steps: int, sampling_probability: float
) -> dp_accounting.DpEvent:
  """The event of `steps` Poisson-sampled steps of `source`.

  Consecutive equal step events are grouped into one `SelfComposedDpEvent`,
  so a constant schedule costs one RDP evaluation.

  Args:
    source: a privatizer or a tfdpx optimizer (`dp_event(step)`).
    steps: number of steps, >= 0.
    sampling_probability: Poisson sampling probability q in (0, 1].

  Returns:
    A `ComposedDpEvent` over runs of equal step events.

  Raises:
    ValueError: for a bad `steps` or `sampling_probability`.
  """
  if int(steps) != steps or steps < 0:
    raise ValueError(f'steps must be a non-negative integer, got {steps!r}')
  if not 0 < sampling_probability <= 1:
    raise ValueError(
        f'sampling_probability must be in (0, 1], got {sampling_probability!r}')
  dp_event = _events_of(source)
  runs = []  # [event, count]
  for step in range(int(steps)):
    event = dp_event(step)
    if runs and runs[-1][0] == event:
      runs[-1][1] += 1
    else:
      runs.append([event, 1])
  q = float(sampling_probability)
  return dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, event), count)
      for event, count in runs
  ])


def epsilon(
    source,
    *,
    steps: Optional[int] = None,
    sampling_probability: float,
    delta: float,
    orders: Optional[Sequence[float]] = None,
) -> float:
  """Epsilon (RDP accountant) of `steps` Poisson-sampled steps of `source`.

  Args:
    source: a privatizer or a tfdpx optimizer.
    steps: number of steps; for an optimizer, `None` means the steps it has
      privatized so far.
    sampling_probability: Poisson sampling probability q = expected batch / n.
    delta: target delta in (0, 1).
    orders: RDP orders; default `dp_accounting`'s, as tensorflow-privacy's
      `compute_dp_sgd_privacy_statement` uses.

  Returns:
    Epsilon, `inf` if any step is not private.

  Raises:
    ValueError: for a bad argument, naming it.
  """
  if not 0 < delta < 1:
    raise ValueError(f'delta must be in (0, 1), got {delta!r}')
  if steps is None:
    if not hasattr(source, 'dp_steps'):
      raise ValueError('steps is required for a privatizer')
    steps = int(source.dp_steps.numpy())
  event = training_event(source, steps=steps,
                         sampling_probability=sampling_probability)
  orders = tuple(orders if orders is not None
                 else rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
  total = _cached_rdp(event, orders)
  if total is None:
    accountant = rdp.RdpAccountant(list(orders))
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))
  eps, _ = rdp_privacy_accountant.compute_epsilon(orders, total, delta)
  return float(eps)


@functools.lru_cache(maxsize=256)
def _sampled_gaussian_rdp(q: float, noise_multiplier: float,
                          orders: tuple) -> np.ndarray:
  """RDP of one Poisson-sampled Gaussian step, as `RdpAccountant` computes it."""
  # pylint: disable-next=protected-access
  return rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(
      q, noise_multiplier, orders)


def _cached_rdp(event, orders):
  """The RDP of a `training_event` of Gaussian steps, or None.

  A schedule gives one distinct step event per run; `epsilon` is called again
  after every epoch with a longer history, so each distinct (q, z) is
  evaluated once and kept in a small cache. Sums the same per-order values
  `RdpAccountant` adds up; None for any other event (then the accountant
  composes it).
  """
  total = np.zeros(len(orders))
  for run in event.events:
    sampled = run.event
    if not (isinstance(sampled, dp_accounting.PoissonSampledDpEvent) and
            isinstance(sampled.event, dp_accounting.GaussianDpEvent)):
      return None
    total += run.count * _sampled_gaussian_rdp(
        float(sampled.sampling_probability),
        float(sampled.event.noise_multiplier), orders)
  return total


def calibrate_noise_multiplier(
    target_epsilon: float,
    privatizer: core.Privatizer,
    *,
    steps: int,
    sampling_probability: float,
    delta: float,
    rtol: float = 1e-3,
) -> float:
  """The smallest effective `noise_multiplier` whose epsilon is <= target.

  Bisects over `privatizer.with_noise_multiplier(z)`; the result's epsilon is
  never above `target_epsilon` and within `rtol` (relative) below it, unless
  even the largest searched multiplier cannot reach it.

  Args:
    target_epsilon: epsilon to reach, > 0.
    privatizer: the privatizer to calibrate (its other settings are kept).
    steps, sampling_probability, delta: as in `epsilon`.
    rtol: relative tolerance of the epsilon reached.

  Returns:
    The noise multiplier (Python float).

  Raises:
    ValueError: if no multiplier up to 1e4 reaches `target_epsilon`.
  """
  core.check_positive('target_epsilon', target_epsilon)

  def eps(z):
    return epsilon(privatizer.with_noise_multiplier(z), steps=steps,
                   sampling_probability=sampling_probability, delta=delta)

  lo, hi = 0.0, 1.0
  while eps(hi) > target_epsilon:
    lo, hi = hi, 2 * hi
    if hi > 1e4:
      raise ValueError(
          f'target_epsilon={target_epsilon} is not reachable with '
          'noise_multiplier <= 1e4')
  # Invariant: eps(hi) <= target < eps(lo) (eps(0) is infinite).
  while True:
    mid = (lo + hi) / 2
    e = eps(mid)
    if e <= target_epsilon:
      hi = mid
      if e >= target_epsilon * (1 - rtol):
        return hi
    else:
      lo = mid
    if hi - lo < 1e-9:
      return hi


def privacy_statement(
    source,
    *,
    steps: Optional[int] = None,
    num_examples: int,
    expected_batch_size: float,
    delta: float,
    sampling: str = 'poisson',
) -> str:
  """A human-readable privacy statement naming its assumptions.

  Args:
    source: a privatizer or a tfdpx optimizer.
    steps: number of training steps (optimizer: default its own count).
    num_examples: size n of the training set.
    expected_batch_size: expected batch size; q = expected_batch_size / n.
    delta: target delta.
    sampling: 'poisson' (each example joins each batch independently with
      probability q) or 'shuffle' (fixed-size batches from a shuffled pass).

  Returns:
    The statement, several lines of text.

  Raises:
    ValueError: for an unknown `sampling`.
  """
  if sampling not in SAMPLING_ASSUMPTIONS:
    raise ValueError(
        f'sampling must be one of {SAMPLING_ASSUMPTIONS}, got {sampling!r}')
  q = expected_batch_size / num_examples
  if steps is None and hasattr(source, 'dp_steps'):
    steps = int(source.dp_steps.numpy())
  eps = epsilon(source, steps=steps, sampling_probability=q, delta=delta)
  privatizer = getattr(source, 'privatizer', source)
  lines = [
      'tfdpx privacy statement',
      f'  noise step: {privatizer!r}',
      f'  {steps} steps, n = {num_examples}, expected batch size '
      f'{expected_batch_size:g} (q = {q:.6g}), delta = {delta:g}',
      '  adjacency: add or remove one training example; every intermediate '
      'model is covered, not only the final one.',
      f'  epsilon (RDP accountant, Poisson sampling): {eps:.4g}',
  ]
  if sampling == 'poisson':
    lines.append('  sampling: Poisson, as the accountant assumes.')
  else:
    lines.append(
        '  sampling: shuffled fixed-size batches. The epsilon above assumes '
        'Poisson sampling; for shuffled batches it is the customary '
        'approximation, not a proven upper bound. Train with Poisson sampling '
        'for a guarantee.')
  if math.isinf(eps):
    lines.append('  WARNING: at least one step is not differentially private.')
  return '\n'.join(lines)


def scale_sensitivity(event: dp_accounting.DpEvent,
                      factor: float) -> dp_accounting.DpEvent:
  """`event` for a mechanism whose L2 sensitivity is `factor` times larger.

  Every Gaussian noise multiplier inside `event` is divided by `factor`. Used
  for microbatches: one example changes one microbatch mean from one clipped
  record to another, so the sensitivity doubles (as tensorflow-privacy's
  `compute_dp_sgd_privacy_statement` with `used_microbatching` assumes).

  Raises:
    ValueError: for an event kind this function cannot rescale.
  """
  if isinstance(event, dp_accounting.GaussianDpEvent):
    return dp_accounting.GaussianDpEvent(
        float(event.noise_multiplier) / float(factor))
  if isinstance(event, (dp_accounting.NonPrivateDpEvent,
                        dp_accounting.NoOpDpEvent)):
    return event
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return dp_accounting.ComposedDpEvent(
        [scale_sensitivity(e, factor) for e in event.events])
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    return dp_accounting.SelfComposedDpEvent(
        scale_sensitivity(event.event, factor), event.count)
  if isinstance(event, dp_accounting.PoissonSampledDpEvent):
    return dp_accounting.PoissonSampledDpEvent(
        event.sampling_probability, scale_sensitivity(event.event, factor))
  raise ValueError(f'cannot rescale the sensitivity of {event!r}')
