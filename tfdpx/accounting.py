"""Privacy accounting: privatizer events -> epsilon, calibration, statements.

Everything here is host-side Python over `dp_accounting`. The training event
is built only from `dp_event(step)` of the privatizer (or optimizer) that
added the noise; nothing here rebuilds an event from hyperparameters. Every
step event is validated and normalized (`normalized_event`) before it is
composed.

Two accountants turn the same event into epsilon (`ACCOUNTANTS`): 'rdp' (the
default, Renyi DP as tensorflow-privacy reports it) and 'pld' (privacy loss
distributions, `dp_accounting.pld.PLDAccountant`), which gives a tighter
epsilon for the same noise, hence less noise for the same epsilon. PLD
discretizes the privacy loss pessimistically (`PLD_DISCRETIZATION`), so its
epsilon stays an upper bound.

Sampling is an explicit choice (`SAMPLING_ASSUMPTIONS`):

- 'poisson': each example joins each batch independently with probability
  `sampling_probability` (`tfdpx.sampling.poisson_batches`); `epsilon` is the
  RDP bound with amplification by subsampling.
- 'shuffle': fixed-size batches from a shuffled pass over the data (Keras'
  default `fit`); `epsilon_once_per_epoch` is the bound with each example in
  one step of each epoch and no amplification, as tensorflow-privacy's
  `compute_dp_sgd_privacy_statement` states it ("Epsilon with each example
  occurring once per epoch").
- 'cyclic_poisson': each example in one of `groups` groups drawn at random,
  group `t mod groups` Poisson-sampled with `sampling_probability` at step t
  (`tfdpx.sampling.cyclic_poisson_batches`); `epsilon_cyclic_poisson` is the
  worst group's Poisson-sampled steps. It is the sampling that amplifies
  noise correlated across steps (`tfdpx.privatizers.correlated`, with
  `groups >= bands`).

Noise correlated across steps (a privatizer's `correlation`) changes how
the steps compose: under 'cyclic_poisson' each participation is its step's
event (a banded strategy's columns do not overlap; a BLT, whose columns never
end, is refused); under 'shuffle' the run is one
Gaussian mechanism whose sensitivity is the strategy's worst once-per-epoch
pattern; under 'poisson' it is refused (one example may be in consecutive
steps, whose columns overlap).
"""

import functools
import math
from typing import List, Optional, Sequence

import dp_accounting
from dp_accounting import pld
from dp_accounting import rdp
from dp_accounting.rdp import rdp_privacy_accountant
import numpy as np

from tfdpx import core

SAMPLING_ASSUMPTIONS = ('poisson', 'shuffle', 'cyclic_poisson')
ACCOUNTANTS = ('rdp', 'pld')
ACCOUNTANT_NAMES = {'rdp': 'RDP accountant', 'pld': 'PLD accountant'}

# Value discretization interval of the PLD accountant: the privacy loss is
# rounded up to multiples of it (pessimistic), so the epsilon is a bound;
# 1e-3 keeps a 14,000-step run under a second and within 0.5% above a ten
# times finer grid (the tutorial: 2.391 against 2.382).
PLD_DISCRETIZATION = 1e-3

# Step events tfdpx can account; anything else is refused by name.
_NORMALIZED_TYPES = (
    'GaussianDpEvent', 'ComposedDpEvent', 'SelfComposedDpEvent',
    'PoissonSampledDpEvent', 'NoOpDpEvent', 'NonPrivateDpEvent')


def _events_of(source):
  """`step -> DpEvent` of a privatizer or of a tfdpx optimizer."""
  if isinstance(source, core.Privatizer):
    return source.dp_event
  if hasattr(source, 'dp_event') and hasattr(source, 'privatizer'):
    return source.dp_event
  raise TypeError(
      'expected a tfdpx privatizer or optimizer, got '
      f'{type(source).__name__}')


def _steps_of(source, steps: Optional[int]) -> int:
  """`steps`, or for an optimizer by default the steps it has privatized."""
  if steps is None:
    if not hasattr(source, 'dp_steps'):
      raise ValueError('steps is required for a privatizer')
    steps = int(source.dp_steps.numpy())
  if int(steps) != steps or steps < 0:
    raise ValueError(f'steps must be a non-negative integer, got {steps!r}')
  return int(steps)


def normalized_event(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
  """`event` validated, with Python numbers, as `dp_accounting` needs them.

  dp-accounting 0.4.3 silently uses only the first of several Gaussian noise
  multipliers inside a `ComposedDpEvent` under `PoissonSampledDpEvent` when
  they are `numpy.float32` or `int`, and reports a smaller epsilon; every
  number is therefore converted here: noise multipliers and sampling
  probabilities to `float`, counts to `int`, recursively through Composed,
  SelfComposed and PoissonSampled events.

  Args:
    event: a step event. Accepted kinds: `GaussianDpEvent` (noise multiplier
      >= 0, `inf` allowed), `ComposedDpEvent`, `SelfComposedDpEvent` (count an
      integer >= 0), `PoissonSampledDpEvent` (probability in [0, 1]),
      `NoOpDpEvent`, `NonPrivateDpEvent`. Other kinds (Laplace, sampling
      without replacement, tree aggregation, ...) are refused rather than
      converted: their fields and adjacency differ and none of tfdpx's noise
      steps produces them.

  Returns:
    An equal event built from Python `float` and `int`.

  Raises:
    ValueError: naming the event, for another kind of event or a bad number.
  """
  if isinstance(event, (dp_accounting.NoOpDpEvent,
                        dp_accounting.NonPrivateDpEvent)):
    return event
  if isinstance(event, dp_accounting.GaussianDpEvent):
    z = _number(event, 'noise_multiplier', event.noise_multiplier)
    if not z >= 0:  # Also NaN.
      raise ValueError(f'{event!r}: noise_multiplier must be >= 0')
    return dp_accounting.GaussianDpEvent(z)
  if isinstance(event, dp_accounting.PoissonSampledDpEvent):
    q = _number(event, 'sampling_probability', event.sampling_probability)
    if not 0 <= q <= 1:
      raise ValueError(f'{event!r}: sampling_probability must be in [0, 1]')
    return dp_accounting.PoissonSampledDpEvent(q,
                                               normalized_event(event.event))
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    count = _number(event, 'count', event.count)
    if not math.isfinite(count) or count != int(count):
      raise ValueError(f'{event!r}: count must be an integer')
    if count < 0:
      raise ValueError(f'{event!r}: count must be >= 0')
    return dp_accounting.SelfComposedDpEvent(normalized_event(event.event),
                                             int(count))
  if isinstance(event, dp_accounting.ComposedDpEvent):
    return dp_accounting.ComposedDpEvent(
        [normalized_event(e) for e in event.events])
  raise ValueError(
      f'cannot account {event!r}: tfdpx accounts steps made of '
      f'{", ".join(_NORMALIZED_TYPES)}')


def _number(event, field, value) -> float:
  """`value` as a float; numpy and TensorFlow scalars pass, text does not."""
  try:
    if isinstance(value, (str, bytes, bool)):
      raise TypeError
    return float(value)
  except (TypeError, ValueError):
    raise ValueError(f'{event!r}: {field} must be a number') from None


def _step_events(source, start: int, stop: int) -> List[dp_accounting.DpEvent]:
  """The normalized events of steps `start, ..., stop - 1` of `source`."""
  dp_event = _events_of(source)
  events = []
  for step in range(start, stop):
    try:
      events.append(normalized_event(dp_event(step)))
    except ValueError as e:
      raise ValueError(f'{source!r}, dp_event({step}): {e}') from None
  return events


def _inverse_square_noise(event) -> Optional[float]:
  """Sum of `z**-2` over the Gaussian releases of one batch in `event`.

  Several Gaussian releases of the same batch are exactly one Gaussian release
  with `z_eff = (sum z_i**-2)**-0.5` (the rule `dp_accounting` applies under
  Poisson sampling). 0 means nothing is released, `inf` a release without
  noise. None if `event` holds anything but Gaussian, NoOp and NonPrivate
  events (composed or self-composed). `event` must be normalized.
  """
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return 0.0
  if isinstance(event, dp_accounting.NonPrivateDpEvent):
    return math.inf
  if isinstance(event, dp_accounting.GaussianDpEvent):
    z = event.noise_multiplier
    return math.inf if z == 0 else z**-2  # inf**-2 == 0.0.
  if isinstance(event, dp_accounting.SelfComposedDpEvent):
    part = _inverse_square_noise(event.event)
    if part is None:
      return None
    return 0.0 if event.count == 0 else event.count * part  # Not 0 * inf.
  if isinstance(event, dp_accounting.ComposedDpEvent):
    parts = [_inverse_square_noise(e) for e in event.events]
    return None if None in parts else math.fsum(parts)
  return None


def _gaussian_event(inverse_square: float) -> dp_accounting.DpEvent:
  """The one event equivalent to Gaussian releases with this `sum z**-2`."""
  if inverse_square == 0:
    return dp_accounting.NoOpDpEvent()
  if math.isinf(inverse_square):
    return dp_accounting.NonPrivateDpEvent()
  return dp_accounting.GaussianDpEvent(inverse_square**-0.5)


def _group_runs(events) -> dp_accounting.ComposedDpEvent:
  """Consecutive equal events as one `SelfComposedDpEvent` each."""
  runs = []  # [event, count]
  for event in events:
    if runs and runs[-1][0] == event:
      runs[-1][1] += 1
    else:
      runs.append([event, 1])
  return dp_accounting.ComposedDpEvent(
      [dp_accounting.SelfComposedDpEvent(e, count) for e, count in runs])


def _correlation_of(source):
  """The noise correlation of a privatizer or optimizer, None if independent
  or one band (independent too)."""
  strategy = getattr(source, 'privatizer', source).correlation
  return strategy if strategy is not None and strategy.history_length else None


def _refuse_correlation_under_poisson(source):
  strategy = _correlation_of(source)
  if strategy is not None:
    raise ValueError(
        f"sampling: the noise is correlated across steps ({strategy!r}); "
        'under plain Poisson sampling one example can be in nearby steps, '
        'whose noise is correlated, and no Poisson-sampling epsilon bounds '
        f'it. {_correlated_sampling_advice(strategy)}')


def _correlated_sampling_advice(strategy):
  shuffle = "account shuffled batches with sampling='shuffle'."
  if strategy.bands is None:  # Columns that never end.
    return shuffle[0].upper() + shuffle[1:]
  return ('Train on cyclic Poisson batches (tfdpx.sampling.'
          f'cyclic_poisson_batches, groups >= {strategy.bands}) and account '
          f"with sampling='cyclic_poisson', or {shuffle}")


def _has_public_denominator(source) -> bool:
  """False for an optimizer that divides by a batch size it saw."""
  return not hasattr(source, 'denominator') or source.denominator is not None


def _refuse_microbatches_under_poisson(source):
  if not _has_public_denominator(source):
    raise ValueError(
        'expected_batch_size: this optimizer was given neither '
        'expected_batch_size nor num_microbatches, so it divides each noisy '
        'sum by the size of its first batch (tensorflow-privacy: of each '
        'batch); the size of a Poisson-sampled batch depends on the data, so '
        'no Poisson-sampling epsilon bounds it. Pass expected_batch_size='
        '<expected batch size> to train with Poisson sampling, or account '
        "with sampling='shuffle' (fixed-size batches).")
  if getattr(source, 'records_are_microbatches', False):
    raise ValueError(
        'num_microbatches: this optimizer averages microbatches of rows, and '
        'under Poisson sampling adding or removing one example shifts the '
        'rows of the batch and changes many microbatch records, so no '
        'Poisson-sampling epsilon bounds it. Use num_microbatches=None (one '
        'record per example) with Poisson sampling, or train on shuffled '
        "fixed-size batches and account with sampling='shuffle'.")


def _poisson_sampled(q: float, event) -> dp_accounting.DpEvent:
  """`event` (normalized) run on a Poisson sample with probability `q`."""
  inverse_square = _inverse_square_noise(event)
  if inverse_square is None:
    raise ValueError(
        f'{event!r}: the RDP accountant can Poisson-sample only Gaussian '
        'releases (composed or not)')
  event = _gaussian_event(inverse_square)
  if not isinstance(event, dp_accounting.GaussianDpEvent):
    return event  # Nothing released, or not private even when subsampled.
  return dp_accounting.PoissonSampledDpEvent(q, event)


def training_event(
    source, *, steps: int, sampling_probability: float
) -> dp_accounting.DpEvent:
  """The event of `steps` Poisson-sampled steps of `source`.

  Each step event is normalized (`normalized_event`); Gaussian releases of
  one step are combined into one Gaussian event (infinite noise: `NoOpDpEvent`,
  zero noise: `NonPrivateDpEvent`); consecutive equal step events are grouped
  into one `SelfComposedDpEvent`, so a constant schedule costs one RDP
  evaluation.

  Args:
    source: a privatizer or a tfdpx optimizer (`dp_event(step)`).
    steps: number of steps, >= 0.
    sampling_probability: Poisson sampling probability q in (0, 1].

  Returns:
    A `ComposedDpEvent` over runs of equal step events.

  Raises:
    ValueError: for a bad `steps`, `sampling_probability` or step event, or
      for an optimizer with `num_microbatches` records, without a public
      denominator, or with noise correlated across steps (none boundable
      under Poisson sampling).
  """
  steps = _steps_of(source, steps)
  q = _checked_sampling_probability(sampling_probability)
  _refuse_microbatches_under_poisson(source)
  _refuse_correlation_under_poisson(source)
  return _group_runs(
      _poisson_sampled(q, event) for event in _step_events(source, 0, steps))


def epsilon(
    source,
    *,
    steps: Optional[int] = None,
    sampling_probability: float,
    delta: float,
    orders: Optional[Sequence[float]] = None,
    accountant: str = 'rdp',
) -> float:
  """Epsilon of `steps` Poisson-sampled steps of `source`.

  Args:
    source: a privatizer or a tfdpx optimizer.
    steps: number of steps; for an optimizer, `None` means the steps it has
      privatized so far.
    sampling_probability: Poisson sampling probability q = expected batch / n.
    delta: target delta in (0, 1).
    orders: RDP orders; default `dp_accounting`'s, as tensorflow-privacy's
      `compute_dp_sgd_privacy_statement` uses.
    accountant: 'rdp' or 'pld' (`ACCOUNTANTS`).

  Returns:
    Epsilon, `inf` if any step is not private.

  Raises:
    ValueError: for a bad argument, naming it; for an optimizer with
      `num_microbatches` records, without a public denominator or with noise
      correlated across steps (see `training_event`).
  """
  _check_delta(delta)
  check_accountant(accountant)
  event = training_event(source, steps=steps,
                         sampling_probability=sampling_probability)
  return _event_epsilon(event, delta, accountant, orders)


def epsilon_cyclic_poisson(
    source,
    *,
    steps: Optional[int] = None,
    sampling_probability: float,
    groups: int,
    delta: float,
    accountant: str = 'rdp',
) -> float:
  """Epsilon of cyclic Poisson sampling: group `t mod groups` at step t.

  The epsilon of `cyclic_poisson_event`, the costliest group's steps; 0
  before the first step.
  """
  event = cyclic_poisson_event(
      source, steps=steps, sampling_probability=sampling_probability,
      groups=groups, delta=delta, accountant=accountant)
  if isinstance(event, dp_accounting.NoOpDpEvent):
    return 0.0
  return _event_epsilon(event, delta, accountant, None)


def cyclic_poisson_event(
    source,
    *,
    steps: Optional[int] = None,
    sampling_probability: float,
    groups: int,
    delta: float,
    accountant: str = 'rdp',
) -> dp_accounting.DpEvent:
  """The event of cyclic Poisson sampling: its costliest group's steps.

  Each example is in one group (drawn independently of the others, as
  add/remove adjacency needs), so it can be only in that group's steps,
  each with probability `sampling_probability`; the run costs the worst
  group's Poisson-sampled step events. With noise correlated by a banded
  strategy of `b <= groups` bands, the columns of one example's steps do
  not overlap and each participation is its step's event: this is amplified
  banded matrix factorization (Choquette-Choo et al. 2023, "(Amplified)
  Banded Matrix Factorization", Theorem 4), DP-SGD's accounting over the
  group's steps.

  Args:
    source: a privatizer or a tfdpx optimizer.
    steps: number of steps; for an optimizer, `None` means the steps it has
      privatized so far.
    sampling_probability: q in (0, 1], the probability of each example of
      the step's group (expected batch size * groups / n).
    groups: the number of groups, at least the strategy's bands.
    delta: target delta in (0, 1).
    accountant: 'rdp' or 'pld' (`ACCOUNTANTS`).

  Returns:
    The Poisson-sampled step events of the group whose epsilon at `delta`
    is the largest (`NoOpDpEvent` before the first step): an upper bound on
    every example's, whichever its group.

  Raises:
    ValueError: for a bad argument, naming it; `groups` fewer than the
      bands of the noise correlation; an optimizer with `num_microbatches`
      records or without a public denominator.
  """
  _check_delta(delta)
  check_accountant(accountant)
  steps = _steps_of(source, steps)
  q = _checked_sampling_probability(sampling_probability)
  groups = _checked_groups(groups)
  _refuse_microbatches_under_poisson(source)
  strategy = _correlation_of(source)
  if strategy is not None and strategy.bands is None:
    raise ValueError(
        f"sampling='cyclic_poisson': {strategy!r} is not banded, its noise "
        'is correlated with every later step, so no separation of an '
        "example's steps keeps its columns apart and cyclic sampling "
        f'amplifies nothing. {_correlated_sampling_advice(strategy)}')
  if strategy is not None and groups < strategy.bands:
    raise ValueError(
        f'groups={groups}: the noise is correlated over {strategy.bands} '
        f'steps ({strategy!r}), so an example\'s steps must be at least '
        f'{strategy.bands} apart: pass groups >= {strategy.bands}')
  events = _step_events(source, 0, steps)
  runs = []
  for group in range(min(groups, steps)):
    run = _group_runs(_poisson_sampled(q, e) for e in events[group::groups])
    if run not in runs:
      runs.append(run)
  if not runs:
    return dp_accounting.NoOpDpEvent()
  return max(runs, key=lambda run: _event_epsilon(run, delta, accountant,
                                                   None))


def _checked_groups(groups) -> int:
  return core.check_positive_int('groups', groups)


def _check_delta(delta):
  if not 0 < delta < 1:
    raise ValueError(f'delta must be in (0, 1), got {delta!r}')


def _checked_sampling_probability(sampling_probability) -> float:
  if not 0 < sampling_probability <= 1:
    raise ValueError(
        f'sampling_probability must be in (0, 1], got {sampling_probability!r}')
  return float(sampling_probability)


def _checked_steps_per_epoch(steps_per_epoch) -> int:
  if (isinstance(steps_per_epoch, bool) or
      int(steps_per_epoch) != steps_per_epoch or steps_per_epoch < 1):
    raise ValueError(
        f'steps_per_epoch must be an integer >= 1, got {steps_per_epoch!r}')
  return int(steps_per_epoch)


def _rdp_epsilon(event, orders, delta) -> float:
  accountant = rdp.RdpAccountant(list(orders))
  accountant.compose(event)
  return float(accountant.get_epsilon(delta))


def check_accountant(accountant: str) -> str:
  """`accountant` if it is one of `ACCOUNTANTS`, else a ValueError naming it."""
  if accountant not in ACCOUNTANTS:
    raise ValueError(
        f'accountant must be one of {ACCOUNTANTS}, got {accountant!r}')
  return accountant


def _pld_epsilon(event, delta) -> float:
  accountant = pld.PLDAccountant(
      value_discretization_interval=PLD_DISCRETIZATION)
  try:
    accountant.compose(event)
  except dp_accounting.UnsupportedEventError as error:
    raise ValueError(
        f'the PLD accountant cannot account this event: {event!r} ({error}); '
        "use accountant='rdp'") from None
  return float(accountant.get_epsilon(delta))


def _event_epsilon(event, delta, accountant, orders) -> float:
  """Epsilon of a training event by the chosen accountant."""
  if check_accountant(accountant) == 'pld':
    return _pld_epsilon(event, delta)
  orders = tuple(orders if orders is not None
                 else rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
  total = _cached_rdp(event, orders)
  if total is None:
    return _rdp_epsilon(event, orders, delta)
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
    if isinstance(sampled, dp_accounting.NoOpDpEvent):
      continue
    if not (isinstance(sampled, dp_accounting.PoissonSampledDpEvent) and
            isinstance(sampled.event, dp_accounting.GaussianDpEvent)):
      return None
    total += run.count * _sampled_gaussian_rdp(
        sampled.sampling_probability, sampled.event.noise_multiplier, orders)
  return total


def _worst_step(events) -> dp_accounting.DpEvent:
  """An event that bounds one example's cost in one epoch of `events`.

  The example is in exactly one of the epoch's steps, and the adversary may
  choose which. If every step is Gaussian, that is the step with the least
  effective noise (exact); otherwise the composition of every step of the
  epoch (sound: it covers any one of them, but looser).
  """
  inverse_squares = [_inverse_square_noise(e) for e in events]
  if None in inverse_squares:
    return dp_accounting.ComposedDpEvent(list(events))
  return _gaussian_event(max(inverse_squares))


def epsilon_once_per_epoch(
    source,
    *,
    steps: Optional[int] = None,
    steps_per_epoch: int,
    delta: float,
    orders: Optional[Sequence[float]] = None,
    accountant: str = 'rdp',
) -> float:
  """Epsilon of shuffled batches: each example in one step of each epoch.

  This is tensorflow-privacy's "Epsilon with each example occurring once per
  epoch" (`compute_dp_sgd_privacy_statement`): composition over epochs with no
  amplification by sampling, for fixed-size batches from a shuffled pass (the
  default of Keras `fit`). The run has `ceil(steps / steps_per_epoch)` epochs
  (the last one possibly partial). An example is in one step of each epoch,
  at a position the adversary may choose, so an epoch costs its worst step:
  the smallest effective noise multiplier when all of its steps are Gaussian
  releases (as every tfdpx noise step, also with a D2P2 schedule); otherwise
  (a third-party step event of another kind) the composition of every step of
  the epoch, which is sound but looser. A step that is not private makes
  epsilon infinite. With noise correlated across steps the whole run is one
  Gaussian mechanism: the smallest step multiplier over the strategy's
  `once_per_epoch_sensitivity` (two participations at an epoch's boundary
  fall within one band).

  Args:
    source: a privatizer or a tfdpx optimizer (an optimizer with
      `num_microbatches` records reports their doubled sensitivity in its
      events).
    steps: number of steps; for an optimizer, `None` means the steps it has
      privatized so far.
    steps_per_epoch: steps of one pass over the data, an integer >= 1. When in
      doubt take fewer (more epochs): e.g. `n // batch_size`.
    delta: target delta in (0, 1).
    orders: RDP orders; default `dp_accounting`'s.
    accountant: 'rdp' or 'pld' (`ACCOUNTANTS`).

  Returns:
    Epsilon, `inf` if any step is not private.

  Raises:
    ValueError: for a bad argument, naming it, or a bad step event.
  """
  _check_delta(delta)
  check_accountant(accountant)
  steps = _steps_of(source, steps)
  steps_per_epoch = _checked_steps_per_epoch(steps_per_epoch)
  strategy = _correlation_of(source)
  if strategy is not None:
    event = _correlated_once_per_epoch(
        _step_events(source, 0, steps),
        strategy.once_per_epoch_sensitivity(steps, steps_per_epoch))
    return _event_epsilon(_group_runs([event]), delta, accountant, orders)
  epochs = (_worst_step(_step_events(source, start,
                                     min(start + steps_per_epoch, steps)))
            for start in range(0, steps, steps_per_epoch))
  return _event_epsilon(_group_runs(epochs), delta, accountant, orders)


def _correlated_once_per_epoch(events, sensitivity: float
                               ) -> dp_accounting.DpEvent:
  """The run of correlated noise with one participation per epoch.

  All releases together are `C X + Z` (in units of each step's noise), one
  Gaussian mechanism whose sensitivity over every participation is
  `sensitivity` at the least noise of any step: its multiplier is the
  smallest effective multiplier of a step over `sensitivity`.
  """
  if not events:
    return dp_accounting.NoOpDpEvent()
  inverse_squares = [_inverse_square_noise(e) for e in events]
  if None in inverse_squares:
    raise ValueError(
        'correlated noise is accounted only for steps of Gaussian releases')
  worst = _gaussian_event(max(inverse_squares))
  if not isinstance(worst, dp_accounting.GaussianDpEvent):
    return worst
  return dp_accounting.GaussianDpEvent(
      worst.noise_multiplier / sensitivity)


def check_accounting_arguments(sampling: str, *, delta: float,
                               sampling_probability: Optional[float] = None,
                               steps_per_epoch: Optional[int] = None,
                               groups: Optional[int] = None) -> None:
  """Validates the description of how the batches were sampled, and delta.

  Args:
    sampling: 'poisson' (with `sampling_probability`), 'shuffle' (with
      `steps_per_epoch`) or 'cyclic_poisson' (with `sampling_probability`
      and `groups`).
    delta: target delta in (0, 1).
    sampling_probability: Poisson sampling probability q in (0, 1]; only with
      `sampling='poisson'` or 'cyclic_poisson' (there, within the group).
    steps_per_epoch: steps of one shuffled pass, an integer >= 1; only with
      `sampling='shuffle'`.
    groups: the number of groups of cyclic Poisson sampling, an integer >=
      1; only with `sampling='cyclic_poisson'`.

  Raises:
    ValueError: naming the argument that is unknown, missing, extra or bad.
  """
  _check_delta(delta)
  if groups is not None and sampling != 'cyclic_poisson':
    raise ValueError(
        f"groups is for sampling='cyclic_poisson', not {sampling!r}")
  if sampling in ('poisson', 'cyclic_poisson'):
    if steps_per_epoch is not None:
      raise ValueError(
          f"steps_per_epoch is for sampling='shuffle'; sampling={sampling!r} "
          'takes sampling_probability')
    if sampling_probability is None:
      raise ValueError(
          f"sampling={sampling!r} needs sampling_probability (expected batch "
          'size / number of examples, of the group\'s examples for '
          "'cyclic_poisson')")
    _checked_sampling_probability(sampling_probability)
    if sampling == 'cyclic_poisson':
      if groups is None:
        raise ValueError("sampling='cyclic_poisson' needs groups")
      _checked_groups(groups)
  elif sampling == 'shuffle':
    if sampling_probability is not None:
      raise ValueError(
          "sampling_probability is for sampling='poisson'; sampling='shuffle' "
          'takes steps_per_epoch only')
    if steps_per_epoch is None:
      raise ValueError(
          "sampling='shuffle' needs steps_per_epoch (steps of one pass over "
          'the data, e.g. n // batch_size)')
    _checked_steps_per_epoch(steps_per_epoch)
  else:
    raise ValueError(
        f'sampling must be one of {SAMPLING_ASSUMPTIONS}, got {sampling!r}')


def epsilon_for_sampling(
    source,
    *,
    sampling: str,
    delta: float,
    steps: Optional[int] = None,
    sampling_probability: Optional[float] = None,
    steps_per_epoch: Optional[int] = None,
    accountant: str = 'rdp',
    groups: Optional[int] = None,
) -> float:
  """The epsilon that holds for how the batches were sampled.

  `sampling='poisson'`: `epsilon` (amplification by Poisson subsampling).
  `sampling='shuffle'`: `epsilon_once_per_epoch` (no amplification).
  `sampling='cyclic_poisson'`: `epsilon_cyclic_poisson`.

  Args:
    source: a privatizer or a tfdpx optimizer.
    sampling, delta, sampling_probability, steps_per_epoch, groups: as in
      `check_accounting_arguments`.
    steps: number of steps; for an optimizer, `None` means the steps it has
      privatized so far.
    accountant: 'rdp' or 'pld' (`ACCOUNTANTS`).

  Returns:
    Epsilon, `inf` if any step is not private.

  Raises:
    ValueError: as `check_accounting_arguments`, `epsilon`,
      `epsilon_once_per_epoch` and `epsilon_cyclic_poisson`.
  """
  check_accounting_arguments(
      sampling, delta=delta, sampling_probability=sampling_probability,
      steps_per_epoch=steps_per_epoch, groups=groups)
  if sampling == 'cyclic_poisson':
    return epsilon_cyclic_poisson(
        source, steps=steps, sampling_probability=sampling_probability,
        groups=groups, delta=delta, accountant=accountant)
  if sampling == 'poisson':
    return epsilon(source, steps=steps,
                   sampling_probability=sampling_probability, delta=delta,
                   accountant=accountant)
  return epsilon_once_per_epoch(source, steps=steps,
                                steps_per_epoch=steps_per_epoch, delta=delta,
                                accountant=accountant)


def calibrate_noise_multiplier(
    target_epsilon: float,
    privatizer: core.Privatizer,
    *,
    steps: int,
    delta: float,
    sampling_probability: Optional[float] = None,
    steps_per_epoch: Optional[int] = None,
    rtol: float = 1e-3,
    accountant: str = 'rdp',
    groups: Optional[int] = None,
) -> float:
  """The smallest effective `noise_multiplier` whose epsilon is <= target.

  Bisects over `privatizer.with_noise_multiplier(z)`; the result's epsilon is
  never above `target_epsilon` and within `rtol` (relative) below it, unless
  even the largest searched multiplier cannot reach it.

  Args:
    target_epsilon: epsilon to reach, > 0.
    privatizer: the privatizer to calibrate (its other settings are kept).
    steps, delta: as in `epsilon`.
    sampling_probability: for Poisson sampling (`epsilon`).
    steps_per_epoch: instead, for shuffled fixed-size batches
      (`epsilon_once_per_epoch`).
    groups: with `sampling_probability`, cyclic Poisson sampling over this
      many groups (`epsilon_cyclic_poisson`).
    rtol: relative tolerance of the epsilon reached.
    accountant: 'rdp' or 'pld' (`ACCOUNTANTS`); PLD's tighter epsilon gives
      a smaller multiplier for the same target.

  Returns:
    The noise multiplier (Python float).

  Raises:
    ValueError: if no multiplier up to 1e4 reaches `target_epsilon`, or
      unless exactly one of `sampling_probability` and `steps_per_epoch` is
      given.
  """
  core.check_positive('target_epsilon', target_epsilon)
  check_accountant(accountant)
  if (sampling_probability is None) == (steps_per_epoch is None):
    raise ValueError('pass sampling_probability (Poisson sampling) or '
                     'steps_per_epoch (shuffled batches), not both or neither')
  sampling = 'poisson' if steps_per_epoch is None else 'shuffle'
  if groups is not None:
    sampling = 'cyclic_poisson'

  def eps(z):
    return epsilon_for_sampling(
        privatizer.with_noise_multiplier(z), sampling=sampling, steps=steps,
        delta=delta, sampling_probability=sampling_probability,
        steps_per_epoch=steps_per_epoch, accountant=accountant, groups=groups)

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
    sampling: str,
    steps: Optional[int] = None,
    num_examples: int,
    expected_batch_size: float,
    delta: float,
    accountant: str = 'rdp',
    num_users: Optional[int] = None,
    groups: Optional[int] = None,
) -> str:
  """A human-readable privacy statement naming its assumptions.

  The headline epsilon is the one that holds for `sampling`: with Poisson
  sampling `epsilon`; with shuffled fixed-size batches `epsilon_once_per_epoch`
  over `num_examples // expected_batch_size` steps per epoch (rounding down
  counts more epochs, never fewer), and the Poisson figure only as a labelled
  aside, which is not a guarantee for that run.

  Args:
    source: a privatizer or a tfdpx optimizer.
    sampling: how the batches were drawn: 'poisson' (each example joins each
      batch independently with probability q, `tfdpx.sampling.poisson_batches`),
      'shuffle' (fixed-size batches from a shuffled pass, Keras' default) or
      'cyclic_poisson' (`groups` groups, one Poisson-sampled per step,
      `tfdpx.sampling.cyclic_poisson_batches`).
    steps: number of training steps (optimizer: default its own count).
    num_examples: size n of the training set.
    expected_batch_size: expected batch size (the batch size for 'shuffle');
      q = expected_batch_size / n (`* groups` for 'cyclic_poisson', the
      probability within the step's group).
    delta: target delta.
    accountant: 'rdp' or 'pld' (`ACCOUNTANTS`); the statement names it.
    num_users: for an optimizer whose records were users
      (`records_are_users`: a model made private with `examples_per_user`),
      the number of users, required: the statement is then user-level and
      `expected_batch_size` is the expected number of users per batch, q =
      expected_batch_size / num_users.
    groups: with `sampling='cyclic_poisson'` only, the number of groups.

  Returns:
    The statement, several lines of text.

  Raises:
    ValueError: for an unknown `sampling`, a bad argument, `num_users`
      missing for user records or given for example records, or, under
      Poisson sampling, an optimizer with `num_microbatches` records or
      without a public denominator.
  """
  check_accountant(accountant)
  name = ACCOUNTANT_NAMES[accountant]
  user_level = getattr(source, 'records_are_users', False)
  if user_level and num_users is None:
    raise ValueError('num_users: this optimizer\'s records were users '
                     '(user-level); pass the number of users')
  if not user_level and num_users is not None:
    raise ValueError('num_users: this optimizer\'s records were examples, '
                     'not users; its guarantee is per example')
  records = num_users if user_level else num_examples
  q = expected_batch_size / records
  steps = _steps_of(source, steps)
  if sampling == 'cyclic_poisson':
    if groups is None:
      raise ValueError("sampling='cyclic_poisson' needs groups")
    q = min(1.0, expected_batch_size * _checked_groups(groups) / records)
    sampling_arguments = {'sampling_probability': q, 'groups': groups}
  elif sampling == 'shuffle':
    if expected_batch_size > records:
      raise ValueError(
          f'expected_batch_size={expected_batch_size} is larger than '
          f'the {records} records: no full shuffled batch')
    sampling_arguments = {
        'steps_per_epoch': int(records // expected_batch_size)}
  else:
    sampling_arguments = {'sampling_probability': q}
  eps = epsilon_for_sampling(source, sampling=sampling, steps=steps,
                             delta=delta, accountant=accountant,
                             **sampling_arguments)
  privatizer = getattr(source, 'privatizer', source)
  known_seed = ''
  if getattr(source, 'noise_seed_is_known', False):
    known_seed = '  NOT PRIVATE: the noise seed is known'
  if user_level:
    size = (f'  {steps} steps, {num_users} users ({num_examples} examples), '
            f'expected users per batch {expected_batch_size:g} (q = {q:.6g}), '
            f'delta = {delta:g}')
    adjacency = ('  adjacency: user-level: add or remove one user with all '
                 'of their examples (one record: the sum of their examples\' '
                 'gradients, clipped as one); every intermediate model is '
                 'covered, not only the final one.')
  else:
    size = (f'  {steps} steps, n = {num_examples}, expected batch size '
            f'{expected_batch_size:g} (q = {q:.6g}), delta = {delta:g}')
    adjacency = ('  adjacency: add or remove one training example; every '
                 'intermediate model is covered, not only the final one.')
  lines = ['tfdpx privacy statement', f'  noise step: {privatizer!r}', size,
           adjacency]
  strategy = _correlation_of(source)
  if strategy is not None:
    lines.append(
        f'  noise: correlated across steps ({strategy!r}: each step\'s noise '
        f'combines its draw with {strategy.history_length} secret tensors '
        'of earlier noise).')
  microbatches = getattr(source, 'records_are_microbatches', False)
  if microbatches:
    lines.append(
        '  records: microbatches; one example changes one microbatch record, '
        'so the sensitivity is doubled (accounted).')
  public_denominator = _has_public_denominator(source)
  if not public_denominator:
    lines.append(
        '  denominator: the size of the first batch (no expected_batch_size '
        'given), public for fixed-size shuffled batches.')
  if sampling == 'poisson':
    lines += [
        f'  sampling: Poisson{" over users" if user_level else ""}, as the '
        'accountant assumes.',
        f'  epsilon ({name}, Poisson sampling): {eps:.4g}{known_seed}',
    ]
  elif sampling == 'cyclic_poisson':
    lines += [
        f'  sampling: cyclic Poisson: {groups} groups, group t mod {groups} '
        f'Poisson-sampled at step t with probability {q:.6g}.',
        f'  epsilon ({name}, cyclic Poisson sampling): {eps:.4g}{known_seed}',
    ]
  else:
    steps_per_epoch = sampling_arguments['steps_per_epoch']
    epochs = math.ceil(steps / steps_per_epoch)
    lines += [
        '  sampling: fixed-size batches from a shuffled pass, '
        f'{steps_per_epoch} steps per epoch ({epochs} epochs).',
        f'  epsilon ({name}, each example occurring once per epoch, no '
        f'amplification by sampling): {eps:.4g}{known_seed}',
    ]
    if microbatches:
      lines.append('  (no Poisson-sampling figure: microbatch records are not '
                   'bounded under Poisson sampling)')
    elif not public_denominator:
      lines.append('  (no Poisson-sampling figure: the size of a Poisson '
                   'batch is not public)')
    elif strategy is not None:
      lines.append('  (no Poisson-sampling figure: correlated noise is not '
                   'bounded under plain Poisson sampling)')
    else:
      poisson = epsilon(source, steps=steps, sampling_probability=q,
                        delta=delta, accountant=accountant)
      lines.append(
          f'  aside: epsilon {poisson:.4g} assuming Poisson sampling, which '
          'this run did not use: not a guarantee.')
  lines.append(
      '  not covered: the training-set loss and metrics that Keras logs '
      '(see docs/privacy.md).')
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
