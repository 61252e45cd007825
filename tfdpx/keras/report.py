"""Which path each layer of a model takes in the engine: `describe(model)`.

Opacus validates a model and names each module it cannot handle; here every
layer call with trainable weights is listed with the form its per-example
statistics take (a rule's: ghost norms, segment sums, small per-example
gradients; or the fallback, and why), frozen layers are listed as skipped,
and the share of trainable weights on the fallback is summed up. The engine
logs one warning naming the fallback layers when that share is above zero,
when a model made private first traces its training step.
"""

import logging
from typing import Any, List, NamedTuple, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdpx import per_example
from tfdpx.keras import recorder as recorder_lib
from tfdpx.keras.stack import keras_version

_LOG = logging.getLogger(__name__)

_key = per_example.variable_key

FALLBACK = 'fallback: each example recomputed (tf.vectorized_map, in chunks)'
FALLBACK_RANDOM = ('fallback: Jacobian of the recorded call (it draws random '
                   'numbers; cost grows with the square of the batch)')
FALLBACK_LOOP = 'fallback: a loop over examples (recurrent)'


class LayerPath(NamedTuple):
  """One layer call in `ModelReport.rows`.

  Attributes:
    layer: the layer's name.
    kind: its class name.
    parameters: the trainable parameters whose per-example gradients the call
      gives.
    path: the form of its per-example statistics (a rule's form, or one of
      the fallbacks).
    reason: why the fallback (None on a rule's path).
  """
  layer: str
  kind: str
  parameters: int
  path: str
  reason: Optional[str]

  @property
  def fallback(self) -> bool:
    return self.reason is not None


class ModelReport(NamedTuple):
  """What `describe` found.

  Attributes:
    rows: one `LayerPath` per layer call that reads trainable weights, in
      the order of the forward pass (a shared layer once per call).
    frozen: the names of layers with weights and none trainable (skipped).
    parameters: the model's trainable parameters the pass reads.
    fallback_parameters: those of them with a share on the fallback.
  """
  rows: List[LayerPath]
  frozen: List[str]
  parameters: int
  fallback_parameters: int

  @property
  def fallback_share(self) -> float:
    """The share of trainable parameters on the fallback, in [0, 1]."""
    return self.fallback_parameters / self.parameters if self.parameters else 0.

  @property
  def fallback_layers(self) -> List[str]:
    return list(dict.fromkeys(row.layer for row in self.rows if row.fallback))

  def warning(self) -> Optional[str]:
    """One line naming the fallback layers, or None if there are none."""
    if not self.fallback_parameters:
      return None
    layers = '; '.join(f'{row.layer!r} ({row.kind}) {row.reason}'
                       for row in self.rows if row.fallback)
    return (f'tfdpx: {self.fallback_share:.1%} of the trainable parameters '
            f'take the slower fallback path: {layers}. See '
            'tfdpx.keras.describe(model) and docs/models.md.')

  def __str__(self):
    header = ('layer', 'class', 'parameters', 'path')
    lines = [header] + [
        (row.layer, row.kind, f'{row.parameters:,}',
         row.path + (f' ({row.reason})' if row.reason else ''))
        for row in self.rows]
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    text = ['  '.join(cell.ljust(width) for cell, width in
                      zip(line[:3], widths)) + '  ' + line[3]
            for line in lines]
    if self.frozen:
      text.append(f'frozen (skipped): {", ".join(self.frozen)}')
    text.append(f'on the fallback: {self.fallback_parameters:,} of '
                f'{self.parameters:,} trainable parameters '
                f'({self.fallback_share:.1%})')
    return '\n'.join(text)


def _size(variables) -> int:
  return int(sum(np.prod(v.shape, dtype=np.int64) for v in variables))


def _frozen(model) -> List[str]:
  """The outermost layers of `model` with weights and none trainable."""
  found, pending = [], [model]
  while pending:
    layer = pending.pop(0)
    subs = layer._flatten_layers(include_self=False, recursive=False)  # pylint: disable=protected-access
    if layer.weights and not layer.trainable_weights and layer is not model:
      found.append(layer.name)
    else:
      pending.extend(subs)
  return found


def report_of(model, paths: Sequence['recorder_lib.CallPath'],
              random: Sequence[bool]) -> ModelReport:
  """The report of a recorded forward pass.

  Args:
    model: the model.
    paths: the recorder's `paths`.
    random: for each fallback call, in order, whether it draws random numbers.
  """
  rows, on_fallback, every = [], {}, {}
  draws = iter(random)
  for path in paths:
    for v in path.variables:
      every[_key(v)] = v
    if path.rule is not None:
      form = path.rule.form
      reason = None
    else:
      if next(draws, False):
        form = FALLBACK_RANDOM
      elif recorder_lib.is_recurrent_loop(path.layer):
        form = FALLBACK_LOOP
      else:
        form = FALLBACK
      reason = path.reason
      for v in path.variables:
        on_fallback[_key(v)] = v
    rows.append(LayerPath(path.layer.name, type(path.layer).__name__,
                          _size(path.variables), form, reason))
  return ModelReport(rows, _frozen(model), _size(every.values()),
                     _size(on_fallback.values()))


def _specs(model, inputs):
  if inputs is None:
    if not keras_version.is_graph_network(model):
      raise ValueError(
          f'describe({model.name!r}): a subclassed model needs `inputs` (a '
          'batch, or tf.TensorSpecs) to trace its forward pass')
    inputs = keras_version.graph_endpoints(model)[0]

  def spec(t):
    if isinstance(t, tf.TypeSpec):
      return t
    shape = getattr(t, 'shape', None)
    if shape is None:
      t = tf.convert_to_tensor(t)
      shape = t.shape
    return tf.TensorSpec([None, *shape[1:]], t.dtype)

  return tf.nest.map_structure(spec, inputs)


def describe(model: tf.keras.Model, inputs: Any = None, *,
             use_layer_rules: bool = True) -> ModelReport:
  """Each layer's path through the engine of models made private.

  Traces (never runs) one training forward pass as `make_private`'s train
  step records it, with the batch size unknown as `fit` traces it.

  Args:
    model: a Keras model (plain or made private).
    inputs: a batch of inputs or a nest of `tf.TensorSpec`s; optional for
      functional and Sequential models (their inputs are known).
    use_layer_rules: as `make_private`'s.

  Returns:
    A `ModelReport`; `print(report)` shows it as a table.

  Raises:
    ValueError: for a subclassed model without `inputs`.
  """
  paths, random, _ = recorder_lib.traced(
      model, _specs(model, inputs), use_layer_rules,
      keras_version.tf_variables(model.trainable_variables))
  return report_of(model, paths, random)


def warn_fallback(report: ModelReport) -> None:
  """Logs `report.warning()`, if any, once."""
  line = report.warning()
  if line is not None:
    _LOG.warning('%s', line)
