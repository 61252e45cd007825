"""The privatizer contract: a small value holding pure functions.

A privatizer turns the per-example gradients of one batch into a privatized
sum. It is the only place where a tfdpx training step touches private data, and
it describes its own privacy cost (`dp_event`) from the same numbers it uses to
add noise. See DESIGN.md, "Core abstraction: the privatizer".
"""

import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import dp_accounting
import tensorflow as tf

from tfdpx import gradients

State = Dict[str, Any]
PerExampleGradientsLike = Union[gradients.PerExampleGradients,
                                Sequence[tf.Tensor]]
"""A privatizer's state: a dict (nest) of tensors, held by the optimizer."""

_REGISTRY: Dict[str, type] = {}


def register(cls):
  """Class decorator: makes a privatizer class (de)serializable by its `name`."""
  if not cls.name or cls.name in _REGISTRY:
    raise ValueError(f'privatizer name {cls.name!r} is empty or taken')
  _REGISTRY[cls.name] = cls
  return cls


class Privatizer(abc.ABC):
  """Base class of the noise steps.

  Subclasses implement `update` and `dp_event`, keep their hyperparameters in
  `config` (JSON-able; `from_config(config)` rebuilds an equal privatizer) and
  never hold Python state that changes during training: everything that
  changes lives in the `state` nest that `init` creates and `update` returns.

  Attributes:
    name: registry key used by `serialize` / `deserialize`.
    requires_public_grads: True when `update` needs `public_grads`.
  """

  name: str = ''
  requires_public_grads: bool = False

  def init(self, params: Sequence[tf.Variable]) -> State:
    """Returns the initial state for the trainable variables `params`."""
    del params
    return {}

  @abc.abstractmethod
  def update(
      self,
      per_example_grads: PerExampleGradientsLike,
      state: State,
      seed: tf.Tensor,
      *,
      public_grads: Optional[PerExampleGradientsLike] = None,
  ) -> Tuple[List[tf.Tensor], State]:
    """Privatizes one batch.

    A privatizer asks `per_example_grads` only for the statistics it needs
    (`sq_norms`, `dots`, `masked`, ...) and the weighted sums it releases
    (`weighted_sum`): a model made private answers them per layer without
    forming the per-example gradients where a cheaper exact form exists.

    Args:
      per_example_grads: the per-example gradients of this replica's batch:
        a `tfdpx.gradients.PerExampleGradients`, or one `[B, *var.shape]`
        tensor per trainable variable (`gradients.as_per_example_gradients`
        turns either into the former).
      state: the state returned by `init` or by the previous `update`.
      seed: int64 tensor of shape `[2]`, the key of every random draw.
      public_grads: per-example gradients of public data, same layout and
        either form (a model made private hands its engine's lazy value), for
        privatizers with `requires_public_grads`.

    Returns:
      `(noisy_sum, new_state)`: the privatized sum over the batch, one tensor
      per variable, and the next state. Equal inputs give bitwise-equal outputs.
    """

  @abc.abstractmethod
  def dp_event(self, step: int) -> dp_accounting.DpEvent:
    """The privacy event of step `step` (0-based) before sampling."""

  @property
  @abc.abstractmethod
  def config(self) -> Dict[str, Any]:
    """Constructor arguments, JSON-able."""

  @property
  def noise_multiplier(self) -> float:
    """Effective noise multiplier of a whole step (one meaning everywhere)."""
    return self.config['noise_multiplier']

  @classmethod
  def from_config(cls, config: Dict[str, Any]) -> 'Privatizer':
    return cls(**config)

  def with_noise_multiplier(self, noise_multiplier: float) -> 'Privatizer':
    """An equal privatizer but for the effective `noise_multiplier`."""
    return type(self).from_config(
        {**self.config, 'noise_multiplier': float(noise_multiplier)})

  def __eq__(self, other):
    return type(self) is type(other) and self.config == other.config

  def __hash__(self):
    return hash((type(self), repr(sorted(self.config.items()))))

  def __repr__(self):
    args = ', '.join(f'{k}={v!r}' for k, v in self.config.items())
    return f'{self.name}({args})'


def serialize(privatizer: Privatizer) -> Dict[str, Any]:
  """A JSON-able description of `privatizer`."""
  return {'name': privatizer.name, 'config': privatizer.config}


def deserialize(description: Dict[str, Any]) -> Privatizer:
  """Rebuilds a privatizer from `serialize`'s output."""
  name = description.get('name')
  if name not in _REGISTRY:
    raise ValueError(
        f'unknown privatizer {name!r}; registered: {sorted(_REGISTRY)}')
  return _REGISTRY[name].from_config(description['config'])


def check_positive(name: str, value, *, allow_zero: bool = False) -> float:
  """Validates a constructor argument; returns it as a Python float.

  Raises:
    ValueError: naming `name`, if `value` is not a number > 0 (>= 0 with
      `allow_zero`). `inf` is accepted (an infinite clip norm in tests).
  """
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(f'{name} must be a number, got {value!r}') from None
  if number != number or number < 0 or (number == 0 and not allow_zero):
    bound = '>= 0' if allow_zero else '> 0'
    raise ValueError(f'{name} must be {bound}, got {value!r}')
  return number
