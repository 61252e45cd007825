"""Noise schedules: step -> noise multiplier, read by the graph and the accountant.

A schedule is a small serializable value. `value(step)` (plain Python, used by
`dp_event`) and `tf_value(step)` (a graph op, used by `update`) evaluate the
same formula with the same float64 operations. Steps are 0-based, as in
`dp_event(step)`; the paper's 1-based iteration is `k = step + 1`.

Graph and Python may still differ in the last bit (measured: 1 ulp for
`z0 / sqrt(k)`), so the accountant reads `accounted_value(step)`: the value
rounded down by a relative 1e-12 wherever the graph computes it with roots
(never for constants, floors and tables). The noise is therefore never
below what the accountant is told (spec 4.7.3).

References:
  Jiang et al., "Balancing Utility and Privacy: Dynamically Private SGD with
  Random Projection", TMLR 2025 (spec `d2p2.md`, sections 2.4 and 4.3).
"""

import abc
import math
from typing import Any, Dict, Sequence, Union

import tensorflow as tf

from tfdpx import core

_REGISTRY: Dict[str, type] = {}
# Relative rounding-down of accounted values computed with roots.
ROUNDING_MARGIN = 1e-12


def _register(cls):
  _REGISTRY[cls.name] = cls
  return cls


class Schedule(abc.ABC):
  """A data-independent map from the 0-based step to a noise multiplier."""

  name: str = ''

  @abc.abstractmethod
  def value(self, step: int) -> float:
    """The noise multiplier of step `step` (Python float, for the accountant)."""

  @abc.abstractmethod
  def tf_value(self, step: tf.Tensor) -> tf.Tensor:
    """The same value as a float64 graph tensor, for int64 step(s) `step`."""

  def accounted_value(self, step: int) -> float:
    """The multiplier the accountant is told: `value(step)`, never above the
    graph's value (see the module doc)."""
    return self.value(step)

  @abc.abstractmethod
  def rescaled(self, noise_multiplier: float) -> 'Schedule':
    """The same shape, starting from `noise_multiplier` at step 0."""

  @property
  @abc.abstractmethod
  def config(self) -> Dict[str, Any]:
    """Constructor arguments, JSON-able."""

  def __eq__(self, other):
    return type(self) is type(other) and self.config == other.config

  def __hash__(self):
    return hash((type(self), repr(sorted(self.config.items()))))

  def __repr__(self):
    args = ', '.join(f'{k}={v!r}' for k, v in self.config.items())
    return f'{type(self).__name__}({args})'


def _root(e, power: float, sqrt, pow_):
  """`e ** power`, via square roots for the powers 1/2 and 1/4."""
  if power == 0.5:
    return sqrt(e)
  if power == 0.25:
    return sqrt(sqrt(e))
  return pow_(e, power)


@_register
class PowerDecay(Schedule):
  """`z(step) = max(minimum, initial * (step // period + 1) ** -power)`.

  `power=0.5, period=1` is the paper's per-iteration `z0 / sqrt(k)`;
  `power=0.25, period=steps_per_epoch` is the official code's per-epoch
  `z0 / epoch ** (1/4)`; `power=0` is a constant.
  """

  name = 'power_decay'

  def __init__(self, initial: float, power: float = 0.0, period: int = 1,
               minimum: float = 0.0):
    """Args:
      initial: the multiplier of the first period, >= 0.
      power: decay exponent, >= 0.
      period: steps per period (1: per step; steps per epoch: per epoch).
      minimum: floor the schedule never goes under, >= 0.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    self._initial = core.check_positive('initial', initial, allow_zero=True)
    self._power = core.check_positive('power', power, allow_zero=True)
    if isinstance(period, bool) or int(period) != period or period < 1:
      raise ValueError(f'period must be a positive integer, got {period!r}')
    self._period = int(period)
    self._minimum = core.check_positive('minimum', minimum, allow_zero=True)
    if math.isinf(self._initial) or math.isinf(self._minimum):
      raise ValueError('initial and minimum must be finite')

  @property
  def config(self):
    return {'initial': self._initial, 'power': self._power,
            'period': self._period, 'minimum': self._minimum}

  def value(self, step):
    if step < 0:
      raise ValueError(f'step must be >= 0, got {step!r}')
    e = float(int(step) // self._period + 1)
    decayed = self._initial / _root(e, self._power, math.sqrt, math.pow)
    return max(self._minimum, decayed)

  def tf_value(self, step):
    step = tf.cast(step, tf.int64)
    e = tf.cast(step // self._period + 1, tf.float64)
    decayed = tf.constant(self._initial, tf.float64) / _root(
        e, self._power, tf.sqrt, tf.pow)
    return tf.maximum(tf.constant(self._minimum, tf.float64), decayed)

  def accounted_value(self, step):
    value = self.value(step)
    if self._power == 0 or value == self._minimum:
      return value  # Computed exactly by both.
    return value * (1.0 - ROUNDING_MARGIN)

  def rescaled(self, noise_multiplier):
    return PowerDecay(noise_multiplier, self._power, self._period,
                      self._minimum)


@_register
class Piecewise(Schedule):
  """A table: `values[i]` from step `boundaries[i-1]` on (`values[0]` first).

  For any user-defined data-independent schedule (a JSON-able table instead
  of a callable, so the privatizer stays serializable).
  """

  name = 'piecewise'

  def __init__(self, boundaries: Sequence[int], values: Sequence[float]):
    """Args:
      boundaries: strictly increasing positive steps where the value changes.
      values: `len(boundaries) + 1` multipliers, each >= 0.

    Raises:
      ValueError: for inconsistent lengths, unsorted boundaries or bad values.
    """
    boundaries = [int(b) for b in boundaries]
    if len(values) != len(boundaries) + 1:
      raise ValueError('values must have one more entry than boundaries')
    if any(b <= a for a, b in zip([0] + boundaries, boundaries)):
      raise ValueError(
          f'boundaries must be strictly increasing and > 0, got {boundaries}')
    self._boundaries = boundaries
    self._values = [core.check_positive('values', v, allow_zero=True)
                    for v in values]
    if any(math.isinf(v) for v in self._values):
      raise ValueError('values must be finite')

  @property
  def config(self):
    return {'boundaries': list(self._boundaries), 'values': list(self._values)}

  def value(self, step):
    if step < 0:
      raise ValueError(f'step must be >= 0, got {step!r}')
    index = sum(1 for b in self._boundaries if step >= b)
    return self._values[index]

  def tf_value(self, step):
    step = tf.cast(step, tf.int64)
    values = tf.constant(self._values, tf.float64)
    if not self._boundaries:
      return values[0]
    index = tf.reduce_sum(tf.cast(
        step[..., None] >= tf.constant(self._boundaries, tf.int64), tf.int32),
                          axis=-1)
    return tf.gather(values, index)

  def rescaled(self, noise_multiplier):
    first = self._values[0]
    if first == 0:
      raise ValueError('a table starting at 0 cannot be rescaled')
    factor = float(noise_multiplier) / first
    return Piecewise(self._boundaries, [v * factor for v in self._values])


NAMES = ('constant', 'inv_sqrt_step', 'inv_fourth_root_epoch')


def constant(noise_multiplier: float) -> PowerDecay:
  """The same multiplier at every step (DP-SGD, DP2-SGD)."""
  return PowerDecay(noise_multiplier)


def inv_sqrt_step(noise_multiplier: float,
                  min_noise_multiplier: float) -> PowerDecay:
  """The paper's text: `max(z_min, z0 / sqrt(k))`, k the 1-based step."""
  return PowerDecay(noise_multiplier, 0.5, 1, min_noise_multiplier)


def inv_fourth_root_epoch(noise_multiplier: float, steps_per_epoch: int,
                          min_noise_multiplier: float) -> PowerDecay:
  """The official code: `max(z_min, z0 / e ** (1/4))`, e the 1-based epoch."""
  return PowerDecay(noise_multiplier, 0.25, steps_per_epoch,
                    min_noise_multiplier)


def get(noise_schedule: Union[str, Schedule, Dict[str, Any]],
        noise_multiplier: float, *, min_noise_multiplier=None,
        steps_per_epoch=None) -> Schedule:
  """Resolves a schedule name, object or `serialize`d form.

  Args:
    noise_schedule: one of `NAMES`, a `Schedule`, or `serialize`'s output.
    noise_multiplier: the multiplier at step 0 (a given schedule is rescaled
      to start there).
    min_noise_multiplier: the floor; required (>= 0) for a decaying name.
    steps_per_epoch: required for 'inv_fourth_root_epoch'.

  Returns:
    A `Schedule` whose `value(0)` is `max(floor, noise_multiplier)`.

  Raises:
    ValueError: naming the missing or inconsistent argument.
  """
  if isinstance(noise_schedule, dict):
    noise_schedule = deserialize(noise_schedule)
  if isinstance(noise_schedule, Schedule):
    if min_noise_multiplier is not None or steps_per_epoch is not None:
      raise ValueError(
          'min_noise_multiplier and steps_per_epoch only apply to a schedule '
          'given by name; a Schedule object carries its own')
    return noise_schedule.rescaled(noise_multiplier)
  if noise_schedule not in NAMES:
    raise ValueError(
        f'noise_schedule must be one of {NAMES} or a Schedule, got '
        f'{noise_schedule!r}')
  if noise_schedule == 'constant':
    if min_noise_multiplier is not None or steps_per_epoch is not None:
      raise ValueError('the constant schedule takes no min_noise_multiplier '
                       'or steps_per_epoch')
    return constant(noise_multiplier)
  if min_noise_multiplier is None:
    raise ValueError(
        f'min_noise_multiplier is required for {noise_schedule!r}: without a '
        'floor the noise of a decaying schedule goes to 0 and so does privacy')
  if noise_schedule == 'inv_sqrt_step':
    if steps_per_epoch is not None:
      raise ValueError("steps_per_epoch does not apply to 'inv_sqrt_step'")
    return inv_sqrt_step(noise_multiplier, min_noise_multiplier)
  if steps_per_epoch is None:
    raise ValueError(
        "steps_per_epoch is required for 'inv_fourth_root_epoch'")
  return inv_fourth_root_epoch(noise_multiplier, steps_per_epoch,
                               min_noise_multiplier)


def serialize(schedule: Schedule) -> Dict[str, Any]:
  """A JSON-able description of `schedule`."""
  return {'name': schedule.name, 'config': schedule.config}


def deserialize(description: Dict[str, Any]) -> Schedule:
  """Rebuilds a schedule from `serialize`'s output."""
  name = description.get('name')
  if name not in _REGISTRY:
    raise ValueError(
        f'unknown schedule {name!r}; registered: {sorted(_REGISTRY)}')
  return _REGISTRY[name](**description['config'])
