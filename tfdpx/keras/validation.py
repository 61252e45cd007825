"""Which models DP training refuses, and why.

DP-SGD's guarantee holds only if each example reaches a step through its own
clipped record and nothing else. `check_private_compatible` refuses the models
in which an example can go around its record; every DP path runs it: models
made private at `make_private` (where the layers are already built) and when
their train step is traced, the compile path (a plain model compiled with a
tfdpx optimizer) when its train step is traced.

Refused:
- Layers that mix the examples of a batch: a trainable BatchNormalization
  (training mode normalizes with batch statistics), and LayerNormalization,
  GroupNormalization or UnitNormalization over the batch axis. An example
  then changes every other example's output and gradient, so clipping its own
  record no longer bounds its influence.
- Stateful layers (`stateful=True` recurrent layers): the state carries one
  batch's data into the next step outside any clip.
- Activity regularizers: a data-dependent loss over the whole batch.
- On the compile path, layers computing in float16 (the mixed_float16
  policy): float16 needs loss scaling, which models made private do with a
  fixed public scale. bfloat16 (mixed_bfloat16) is supported everywhere:
  every statistic and sum is formed in float32 from the same per-example
  values.
- Layers that write a variable of the model from the data in a training
  forward pass (BatchNormalization's moving statistics, a custom
  `self.v.assign(tf.reduce_mean(inputs))`): the variable then holds a function
  of the batch that no clip bounds, and checkpoints and the saved model release
  it. Found by tracing one training forward pass and following every write to a
  model variable back to the inputs.
- On the compile path only, terms of `model.losses` that are not one value
  per example (weight regularizers, scalar `add_loss` terms): Keras adds them
  to the per-example loss vector, which it cannot do (in Keras 2.15 its loss
  container fails with a shape error before tfdpx runs). `make_private`
  supports weight regularizers.

Not detected: a custom layer that mixes examples in its computation (e.g.
subtracts the batch mean).
"""

from typing import Any, Dict, List, Optional

import tensorflow as tf

from tfdpx.keras.version import KERAS_3

# pylint: disable=g-import-not-at-top
if KERAS_3:
  from keras import KerasTensor
  from keras.src.layers.normalization.batch_normalization import BatchNormalization as _BatchNormalization
  from tfdpx.keras.keras3 import tf_variables
else:
  from keras.src.engine.keras_tensor import KerasTensor
  from keras.src.layers.normalization.batch_normalization import BatchNormalizationBase as _BatchNormalization
  from tfdpx.keras.keras2 import tf_variables
# pylint: enable=g-import-not-at-top

# Ops that read a variable; any other op given a variable's handle may write it.
_READS = frozenset({'ReadVariableOp', 'ResourceGather', 'ResourceGatherNd',
                    'VariableShape', 'VarIsInitializedOp'})
# A shape is not data: the batch size is public (fixed-size batches) or part
# of the sampling the accountant covers, and random layers size their draws
# with it.
_SHAPES = frozenset({'Shape', 'ShapeN', 'Size', 'Rank'})
# Ops that call functions: attributes naming them, and the index of the first
# op input that is the functions' first input.
_CALLS = {
    'If': (('then_branch', 'else_branch'), 1),
    'StatelessIf': (('then_branch', 'else_branch'), 1),
    'Case': (('branches',), 1),
    'StatelessCase': (('branches',), 1),
    'While': (('cond', 'body'), 0),
    'StatelessWhile': (('cond', 'body'), 0),
    'PartitionedCall': (('f',), 0),
    'StatefulPartitionedCall': (('f',), 0),
}


def check_private_compatible(model: tf.keras.layers.Layer, inputs: Any = None,
                             *, compile_path: bool = False) -> None:
  """Refuses a model in which an example reaches a step around its record.

  tfdpx runs this on every DP path; call it yourself before a custom training
  loop that calls a tfdpx optimizer's `minimize` directly (such a loop is not
  checked otherwise).

  Args:
    model: a Keras model or layer.
    inputs: a batch of inputs (a nest of tensors, `tf.TensorSpec`s, or a
      functional model's `model.inputs`) with which to trace one training
      forward pass, looking for layers that write a variable from the data.
      Without it only the layers' configurations are checked.
    compile_path: also refuse terms of `model.losses` that are not one value
      per example, which the compile path cannot add (see the module
      docstring).

  Raises:
    ValueError: naming the layer and the fix, for a layer that mixes the
      examples of a batch, a stateful layer, an activity regularizer, a layer
      that writes a model variable from the data in training, or (with
      `compile_path`) a layer computing in float16 (no loss scaling there), a
      layer with a weight regularizer or a scalar `add_loss` term.
  """
  layers = _layers(model)
  for layer in layers:
    _check_layer(layer, compile_path)
  if compile_path:
    _check_losses(model, layers)
  if inputs is not None:
    _check_writes(model, layers, inputs)


def _computes_in_float16(layer) -> bool:
  return (getattr(layer, 'compute_dtype', None) == 'float16' and
          not isinstance(layer, tf.keras.layers.InputLayer))


def computes_in_float16(model) -> bool:
  """Whether a layer of `model` computes in float16 (`mixed_float16`)."""
  return any(_computes_in_float16(layer) for layer in _layers(model))


def _layers(model) -> List[tf.keras.layers.Layer]:
  if KERAS_3:  # Keras 3 layers are not tf.Modules.
    return list(model._flatten_layers())  # pylint: disable=protected-access
  return [model] + [m for m in model.submodules
                    if isinstance(m, tf.keras.layers.Layer)]


def _includes_batch_axis(axis, rank: Optional[int]) -> bool:
  """True if `axis` (an int or a list) includes axis 0 of a `rank` input."""
  axes = list(axis) if isinstance(axis, (list, tuple)) else [axis]
  return 0 in [a % rank if rank else a for a in axes]


def _normalizes_over_batch(layer) -> bool:
  """True for a normalization layer that normalizes over the batch axis."""
  if isinstance(layer, _BatchNormalization):
    return layer.trainable  # Frozen, Keras runs it in inference mode.
  if isinstance(layer, tf.keras.layers.GroupNormalization):
    # Its axis (split into groups) stays negative; the rank comes with build.
    rank = layer.input_spec.ndim if layer.built else None
    return _includes_batch_axis(layer.axis, rank)
  if isinstance(layer, (tf.keras.layers.LayerNormalization,
                        tf.keras.layers.UnitNormalization)):
    # The axes normalized over; build makes them non-negative.
    return _includes_batch_axis(layer.axis, None)
  return False


def _check_layer(layer, compile_path: bool = False) -> None:
  name = f'layer {layer.name!r} ({type(layer).__name__})'
  if _normalizes_over_batch(layer):
    if isinstance(layer, _BatchNormalization):
      fix = ('Use tf.keras.layers.GroupNormalization or LayerNormalization '
             'instead, or freeze it (layer.trainable = False runs it in '
             'inference mode).')
    else:
      fix = ('Normalize over the features only (an axis argument without '
             'the batch axis 0).')
    raise ValueError(
        f'{name} mixes the examples of a batch in training mode: it '
        'normalizes each example with statistics over the batch, so its '
        'gradient depends on the other examples and per-example clipping no '
        f'longer bounds its influence. {fix}')
  if not isinstance(layer, tf.keras.Model) and getattr(layer, 'stateful',
                                                       False):
    raise ValueError(
        f'{name} is stateful: its state carries the data of one batch into '
        'the next step, outside any per-example clip, and checkpoints and the '
        'saved model release it. Use stateful=False.')
  if compile_path and _computes_in_float16(layer):
    policy = getattr(getattr(layer, 'dtype_policy', None), 'name', None)
    raise ValueError(
        f'{name} computes in float16 (dtype policy {policy!r}): float16 '
        'needs loss scaling, which the compile path does not do (Keras would '
        'wrap the optimizer in a LossScaleOptimizer, whose dynamic scale '
        'follows overflows of the private batch). Train '
        'tfdpx.keras.make_private(model), which scales the loss by a fixed '
        "public factor, or use mixed_bfloat16 (docs/mixed_precision.md).")
  if getattr(layer, 'activity_regularizer', None) is not None:
    raise ValueError(
        f'{name} has an activity_regularizer: a loss that depends on the '
        'data of the whole batch, outside the clipped per-example records. '
        'Add the penalty to the per-example loss instead.')


def _not_per_example(layer) -> bool:
  """True if one of `layer.losses` is not one value per example."""
  return any(loss.shape.rank != 1 for loss in layer.losses)


def _check_losses(model, layers) -> None:
  # Keras adds model.losses to the per-example loss vector `[B]`: a term of
  # shape [B] joins each example's loss (inside its clip); any other, e.g. a
  # scalar weight regularizer, fails in Keras's loss container.
  if not _not_per_example(model):
    return
  owners = [layer for layer in layers[1:] if _not_per_example(layer)]
  owner = min(owners or [model], key=lambda layer: len(layer.losses))
  raise ValueError(
      f'layer {owner.name!r} adds a loss to model.losses that is not one '
      'value per example (a weight regularizer or add_loss). The compile path '
      'cannot add it to the per-example losses (Keras 2.15 fails with an AddN '
      'shape error). Train tfdpx.keras.make_private(model) instead: it adds '
      'the gradient of weight regularizers after the noise.')


def _spec(value) -> tf.TypeSpec:
  if isinstance(value, tf.TypeSpec):
    return value
  if isinstance(value, KerasTensor):  # Keras 3's has no type_spec.
    return tf.TensorSpec(value.shape, value.dtype)
  return tf.type_spec_from_value(value)


def _check_writes(model, layers, inputs) -> None:
  """Refuses a layer that writes a model variable from the data in training.

  Traces (never runs) one training forward pass on `inputs`' specs and follows
  every op that is given a model variable's handle and does not only read it
  (assignments, scatters, ...): if any of its other inputs depends on the
  inputs of the pass, the variable is written from the data.
  """
  specs = tf.nest.map_structure(_spec, inputs)
  graph = tf.function(lambda x: model(x, training=True)).get_concrete_function(
      specs).graph
  owners = {}  # id of a variable's handle -> (variable, layer owning it).
  for layer in layers:
    for variable, tf_variable in zip(
        layer.weights, tf_variables(layer.weights)):
      if not isinstance(tf_variable, tf.Variable):
        # Keras 2's lookup layers list their vocabulary table's handler among
        # their weights: a table, not a variable; only `adapt` writes it.
        continue
      # A distributed variable's graph captures are its components'.
      for component in getattr(tf_variable, 'values', (tf_variable,)):
        key = id(component.handle)
        if key not in owners or len(layer.weights) <= len(
            owners[key][1].weights):
          owners[key] = (variable, layer)
  captured = {internal.ref() for _, internal in graph.captures}
  handles = {internal.ref(): owners[id(external)]
             for external, internal in graph.captures
             if id(external) in owners}
  data = {t.ref() for t in graph.inputs if t.ref() not in captured}
  written = {}
  _taint(graph, graph, data, handles, written)
  if written:
    variable, layer = next(iter(written.values()))
    raise ValueError(
        f'layer {layer.name!r} ({type(layer).__name__}) writes the variable '
        f'{getattr(variable, "path", variable.name)!r} from the data in a '
        'training forward pass: the '
        'variable then holds a function of the batch that no per-example '
        'clip bounds, and checkpoints and the saved model release it. Make '
        'the update independent of the data, move it out of training (e.g. '
        'compute it on public data), or freeze the layer if that stops it.')


def _taint(root, graph, tainted, handles, written) -> set:
  """The data-dependent tensors of `graph`; records data-dependent writes.

  Args:
    root: the outermost graph (its library holds every function).
    graph: the graph to scan; its ops come in a topological order.
    tainted: refs of the graph's tensors that depend on the data.
    handles: refs of the graph's variable handles -> (variable, layer).
    written: filled with id(variable) -> (variable, layer) for each model
      variable written from the data.

  Returns:
    The refs of every tensor of `graph` that depends on the data.
  """
  tainted = set(tainted)
  handles = dict(handles)
  for op in graph.get_operations():
    inputs = list(op.inputs)
    dirty = [t.ref() in tainted for t in inputs]
    owned = [handles.get(t.ref()) for t in inputs]
    if op.type in _CALLS:
      outputs = _taint_call(root, op, dirty, owned, written)
      tainted.update(t.ref() for t, d in zip(op.outputs, outputs) if d)
      continue
    if op.type == 'Identity' and owned[0] is not None:
      handles[op.outputs[0].ref()] = owned[0]
    elif op.type not in _READS:
      for owner in owned:
        if owner is not None and any(
            d for d, o in zip(dirty, owned) if o is None):
          written[id(owner[0])] = owner
    if any(dirty) and op.type not in _SHAPES:
      tainted.update(t.ref() for t in op.outputs)
  return tainted


def _taint_call(root, op, dirty, owned, written) -> List[bool]:
  """Scans the functions `op` calls; which of its outputs depend on the data."""
  attrs, offset = _CALLS[op.type]
  loop = op.type in ('While', 'StatelessWhile')
  dirty, owned = list(dirty[offset:]), owned[offset:]
  while True:
    outputs = [False] * len(op.outputs)
    found: Dict[Any, Any] = {}
    for attr in attrs:
      value = op.get_attr(attr)
      for function in value if isinstance(value, list) else [value]:
        function = root._get_function(function.name).graph  # pylint: disable=protected-access
        tainted = _taint(
            root, function,
            {t.ref() for t, d in zip(function.inputs, dirty) if d},
            {t.ref(): o for t, o in zip(function.inputs, owned) if o},
            found)
        if attr != 'cond':  # A loop's condition is not one of its outputs.
          outputs = [a or t.ref() in tainted
                     for a, t in zip(outputs, function.outputs)]
    if not loop or all(d or not o for d, o in zip(dirty, outputs)):
      break
    # A loop variable the body makes data-dependent stays so from then on.
    dirty = [d or o for d, o in zip(dirty, outputs)]
  written.update(found)
  return dirty if loop else outputs
