"""The privatizer contract: a small value holding pure functions.

A privatizer turns the per-example gradients of one batch into a privatized
sum. It is the only place where a tfdpx training step touches private data, and
it describes its own privacy cost (`dp_event`) from the same numbers it uses to
add noise. See DESIGN.md, "Core abstraction: the privatizer".
"""

import abc
import collections.abc
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import dp_accounting
import tensorflow as tf

from tfdpx import gradients
from tfdpx import noise

State = Dict[str, Any]
# The part of a privatizer's state that is as secret as the noise key: the
# last noises of correlated noise (`tfdpx.privatizers.correlated`). The
# optimizer keeps it out of checkpoints and saved models.
SECRET_STATE_KEY = 'noise_history'
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

  Subclasses implement a step in three parts, `prepare` (what the step fixes
  before reading private data), `clipped_sums` (sums over the batch of
  per-example terms: the only part that reads private data) and `release`
  (noise on the global sums), which `update` composes; and `dp_event`. Split
  so, a step runs unchanged over a logical batch summed from several
  physical ones (virtual batches). A subclass may override `update` instead
  (no virtual batches then). They keep their hyperparameters in `config`
  (JSON-able; `from_config(config)` rebuilds an equal privatizer) and never
  hold Python state that changes during training: everything that changes
  lives in the `state` nest that `init` creates and `update` returns.

  Attributes:
    name: registry key used by `serialize` / `deserialize`.
    requires_public_grads: True when `update` needs `public_grads`.
    releases_rows: True when its release holds `tf.IndexedSlices` (the
      selected rows of embedding tables): a wrapper then may not treat it
      as dense tensors (`Wrapper.wraps_row_releases`).
  """

  name: str = ''
  requires_public_grads: bool = False
  releases_rows: bool = False

  def init(self, params: Sequence[tf.Variable]) -> State:
    """Returns the initial state for the trainable variables `params`."""
    del params
    return {}

  def update(
      self,
      per_example_grads: PerExampleGradientsLike,
      state: State,
      seed: tf.Tensor,
      *,
      public_grads: Optional[PerExampleGradientsLike] = None,
  ) -> Tuple[List[tf.Tensor], State]:
    """Privatizes one batch: `prepare`, `clipped_sums`, all-reduce, `release`.

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
    grads = gradients.as_per_example_gradients(per_example_grads)
    if public_grads is not None:
      public_grads = gradients.as_per_example_gradients(public_grads)
    plan = self.prepare(state, seed, grads, public_grads)
    sums = self.clipped_sums(grads, state, plan)
    return self.release(self.global_sums(sums), state, plan, seed)

  def prepare(self, state: State, seed: tf.Tensor,
              per_example_grads: gradients.PerExampleGradients,
              public_grads: Optional[gradients.PerExampleGradients]) -> Any:
    """What a step fixes before it reads private data (its *plan*).

    Masks, projection keys, a public subspace: anything `clipped_sums` and
    `release` share within one step. It must not depend on the private
    gradients' values; `per_example_grads` is given for its layout and forms
    only (which statistics its engine answers cheaply). Default: None.
    """
    del state, seed, per_example_grads, public_grads
    return None

  def clipped_sums(self, per_example_grads: gradients.PerExampleGradients,
                   state: State, plan: Any) -> Any:
    """This replica's clipped sums over the rows of `per_example_grads`.

    A nest of tensors, each a sum over the rows of a function of one row (and
    of `state` and `plan`), so that the sums of the physical batches of a
    logical batch add up to the sums of the logical batch: the one place a
    step reads private data. Virtual batches (`physical_batch_size`) call it
    once per physical batch and add the results.
    """
    raise NotImplementedError(
        f'{type(self).__name__} implements update() only; virtual batches '
        'need clipped_sums() and release()')

  def add_sums(self, sums: Any, more: Any) -> Any:
    """The clipped sums of two parts of a batch together (virtual batches
    add each physical batch's): elementwise by default. A privatizer whose
    sums are keyed by rows (`releases_rows`) merges its row lists here."""
    return tf.nest.map_structure(tf.add, sums, more)

  def global_sums(self, sums: Any) -> Any:
    """This replica's clipped sums summed over all replicas (`tf.distribute`;
    the identity on one): all-reduced by default."""
    return global_sums(sums)

  def sums_shapes(self, sums: Any) -> Any:
    """The shapes `add_sums` keeps for all parts of a batch: `sums`' own by
    default; None where a part's sums grow (rows of embedding tables)."""
    return tf.nest.map_structure(lambda s: s.shape, sums)

  def release(self, sums: Any, state: State, plan: Any,
              seed: tf.Tensor) -> Tuple[List[tf.Tensor], State]:
    """Noise on the global clipped `sums`: `(noisy_sum, new_state)`.

    `sums` is `clipped_sums`' nest summed over the whole (logical, global)
    batch. Everything here is noise and post-processing.
    """
    raise NotImplementedError(
        f'{type(self).__name__} implements update() only; virtual batches '
        'need clipped_sums() and release()')

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

  @property
  def has_gaussian_releases(self) -> bool:
    """Whether every step's noise is a fixed set of Gaussian releases
    (`gaussian_release_shapes`), which correlated noise across steps
    (`tfdpx.privatizers.correlated`) can take. False (the default) where it
    is not (a projection per step, noise on angles, rows selected per
    step): correlated noise refuses it."""
    return False

  def gaussian_release_shapes(
      self, params: Sequence[tf.Variable]) -> List[List[tf.TensorShape]]:
    """The shapes of the step's Gaussian releases (`noise.add_gaussian`).

    One list of shapes per release, in the order a step draws them, for the
    trainable variables `params`; a step must draw exactly these at every
    step. Correlated noise across steps keeps the last noises of each.
    Defined where `has_gaussian_releases`.
    """
    raise NotImplementedError(
        f'{self.name} does not release a fixed set of Gaussian sums')

  @property
  def correlation(self):
    """The noise correlation across steps (`tfdpx.correlation`), or None for
    independent noise at every step (default)."""
    return None

  @property
  def coordinate_noise_variance(self) -> Optional[float]:
    """The variance of the Gaussian noise one independent draw puts on every
    coordinate of a step's noisy sum (DP-SGD: `(noise_multiplier *
    l2_norm_clip)**2`); with `correlation`, step t's noise is a combination
    of such draws. None (the default) where the coordinates' noise is not
    one public variance (a projection, sparsification, per-layer or adaptive
    clipping): Adam's noise variance correction (`tfdpx.keras.DPAdam`)
    refuses such a step."""
    return None

  @property
  def reference_l2_norm_clip(self) -> Optional[float]:
    """The norm adaptive clipping compares each example's gradient norm
    with (`tfdpx.privatizers.adaptive_clipping`); None if the privatizer has
    no clip norm that scales (default)."""
    return None

  def logs(self, state: State) -> Dict[str, tf.Tensor]:
    """Values computed from released data only (e.g. an adapted clip norm),
    for training logs: default none."""
    del state
    return {}

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


class Wrapper(Privatizer):
  """A privatizer around another (`inner`), whose state is under 'inner'.

  Subclasses call `_set_inner` in their constructor and keep `inner`'s
  `tfdpx.serialize`d form under 'inner' in their `config`.
  """

  # Whether this wrapper may wrap a privatizer that `releases_rows`.
  wraps_row_releases: bool = False

  def _set_inner(self, inner) -> None:
    """Sets `inner` (a privatizer or its serialized form).

    Raises:
      ValueError: if `inner` is neither.
    """
    if isinstance(inner, dict):
      inner = deserialize(inner)
    if not isinstance(inner, Privatizer):
      raise ValueError(f'inner must be a tfdpx privatizer, got {inner!r}')
    if inner.releases_rows and not self.wraps_row_releases:
      raise ValueError(
          f'inner: {self.name} cannot wrap {inner.name}, whose release holds '
          f'selected rows of embedding tables; put {self.name} inside it '
          'where it supports that')
    self._inner = inner

  @property
  def inner(self) -> Privatizer:
    return self._inner

  @property
  def requires_public_grads(self) -> bool:
    return self._inner.requires_public_grads

  @property
  def releases_rows(self) -> bool:
    return self._inner.releases_rows

  @property
  def noise_multiplier(self) -> float:
    return self._inner.noise_multiplier

  @property
  def has_gaussian_releases(self) -> bool:
    return self._inner.has_gaussian_releases

  def gaussian_release_shapes(self, params):
    """`inner`'s: a wrapper changes what is clipped and how the release is
    post-processed, not the shapes of the Gaussian releases."""
    return self._inner.gaussian_release_shapes(params)

  @property
  def correlation(self):
    return self._inner.correlation

  def with_noise_multiplier(self, noise_multiplier: float) -> 'Wrapper':
    """The same wrapper around `inner.with_noise_multiplier(...)`."""
    return type(self).from_config({
        **self.config,
        'inner': self._inner.with_noise_multiplier(noise_multiplier)})

  def logs(self, state):
    return self._inner.logs(state['inner'])


def secret_leaves(state: State) -> List[bool]:
  """Per leaf of `tf.nest.flatten(state)`: whether it is secret (under a
  `SECRET_STATE_KEY` key at any depth)."""
  def marks(value, secret):
    # Plain containers of the same layout: Keras wraps the state's lists and
    # dicts in tracking types of its own.
    if isinstance(value, collections.abc.Mapping):
      return {k: marks(v, secret or k == SECRET_STATE_KEY)
              for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [marks(v, secret) for v in value]
    return secret
  return tf.nest.flatten(marks(state, False))


def global_sums(sums: Any) -> Any:
  """A nest of this replica's sums, all-reduced under `tf.distribute`."""
  return tf.nest.pack_sequence_as(
      sums, noise.replica_sum(tf.nest.flatten(sums)))


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


def check_positive_int(name: str, value) -> int:
  """Validates a count argument (a batch or group size); returns it as int.

  Raises:
    ValueError: naming `name`, if `value` is not a whole number >= 1 (a bool
      or a string is not).
  """
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or
      int(value) != value or value < 1):
    raise ValueError(f'{name} must be a positive integer, got {value!r}')
  return int(value)


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
