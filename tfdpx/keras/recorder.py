"""The engine of models made private: one batched pass, then per-layer units.

`model_gradients` runs a Keras model layer by layer (the only place tfdpx
reads Keras's functional internals), records for every layer call that reads
a trainable variable either a rule's tap (`tfdpx.keras.layer_rules`) or, for
the fallback, the call's outputs, runs one batched backward pass of the summed
loss to every tap and fallback output (row `i` of each belongs to example `i`
alone, as long as no layer mixes the examples of a batch: model validation),
and turns each call into a unit (`tfdpx.forms`). The units together answer a
privatizer's questions (`tfdpx.per_example.UnitGradients`): per-example
statistics and weighted sums, without forming per-example gradients where a
layer family has a cheaper exact form.

One definition holds on every path: an example's gradient is the gradient of
its loss through the very forward pass that produced the loss (the same
dropout masks). The fallback therefore never recomputes a call that draws
random numbers; it differentiates the recorded call instead (exact, quadratic
in the batch for that layer). A variable read by several layer calls (tied
weights) gets the sum of every call's share. See docs/per_example.md.
"""

import contextlib
import logging
import re
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients
from tfdpx import per_example
from tfdpx.forms import materialized as materialized_forms
from tfdpx.forms import unit as unit_lib
from tfdpx.keras import composites
from tfdpx.keras import layer_rules
from tfdpx.keras import recurrent_rules  # pylint: disable=unused-import
from tfdpx.keras.stack import keras_version

_LOG = logging.getLogger(__name__)

_key = per_example.variable_key


def _unique_keys(variables):
  return list(dict.fromkeys(_key(v) for v in variables))


def _unique(variables) -> List[tf.Variable]:
  keys = {}
  for variable in variables:
    keys.setdefault(_key(variable), variable)
  return list(keys.values())


# Types of the ops that draw random numbers: stateful and stateless random
# ops (tf.random, Keras's generators, tf.nn.dropout) and tf.random.Generator's.
_RANDOM_OP = re.compile(
    r'Random|Multinomial|TruncatedNormal|^Rng|^StatefulUniform|'
    r'^StatefulStandardNormal')


def _is_float(tensor) -> bool:
  return tf.is_tensor(tensor) and tensor.dtype.is_floating


class _FallbackCall(NamedTuple):
  """A recorded layer call without a rule.

  `variables` are the wanted variables it reads and its layer's trainable
  weights (of a composite layer's call: those of its sublayer calls without
  the batch axis); `tape` recorded the call's own ops (with those variables
  among its sources); `ops` are the graph ops the call created (None in eager
  mode); `masks` are `(position, mask)` of the batched arguments (in the flat
  arguments) that carried a Keras mask when the call began: a layer such as
  `MultiHeadAttention` reads its inputs' masks itself (Keras 3's also deletes
  them), so each example's recomputation must carry its row of them.
  """
  layer: tf.keras.layers.Layer
  args: Any
  kwargs: Any
  outputs: List[tf.Tensor]
  variables: List[tf.Variable]
  tape: tf.GradientTape
  ops: Optional[List[tf.Operation]]
  masks: List[Tuple[int, tf.Tensor]]


class _RuleCall(NamedTuple):
  """A recorded layer call with a rule: its input, its tap(s) and what its
  forward saved for its units (`layer_rules.LayerRule.forward`)."""
  layer: tf.keras.layers.Layer
  rule: layer_rules.LayerRule
  inputs: tf.Tensor
  tap: Any
  saved: Any


class CallPath(NamedTuple):
  """How the engine takes one layer call (`tfdpx.keras.describe`).

  Attributes:
    layer: the layer called.
    entry: its record: the `_RuleCall` or the `_FallbackCall`.
    variables: the trainable variables whose per-example gradients this
      call's unit gives.
    rule: the layer's rule (`layer_rules.LayerRule`), or None: the fallback.
    reason: for the fallback, why the call takes it.
  """
  layer: tf.keras.layers.Layer
  entry: Any
  variables: List[tf.Variable]
  rule: Optional[layer_rules.LayerRule]
  reason: Optional[str]


class _Mark(NamedTuple):
  """How much a recorder had recorded at some point (to roll back to it)."""
  rule_calls: int
  fallback_calls: int
  unattributed: int
  paths: int


class Recorder:
  """Runs a model layer by layer, recording what the backward pass needs."""

  def __init__(self, tape: tf.GradientTape, use_rules: bool,
               var_list: Sequence[tf.Variable]):
    self.tape = tape
    self.use_rules = use_rules
    self.wanted = {_key(v): v for v in var_list}
    self.rule_calls = []  # _RuleCall
    self.fallback_calls = []  # _FallbackCall
    self.unattributed = []  # Wanted variables read where no unit sees it.
    self.paths = []  # CallPath of each recorded call, rules and fallback.
    # id(entry) -> zero from an op that fails at run time unless the rows of
    # that sublayer call are the examples; its unit reads it.
    self.row_checks = {}
    self.batch_rows = None  # The batch's static size (None: unknown).
    self.batch_size = None  # Its size at run time.

  def run(self, model, inputs, training=True):
    """The model's outputs on `inputs`, computed in training mode."""
    if self.batch_size is None:
      first = tf.nest.flatten(inputs)[0]
      self.batch_rows = first.shape[0]
      self.batch_size = tf.shape(first)[0]
    if isinstance(model, tf.keras.Sequential):
      for layer in model.layers:
        inputs = self.call(layer, (inputs,), {}, training=training)
      return inputs
    if keras_version.is_graph_network(model):
      return keras_version.run_graph(
          model, inputs,
          lambda layer, args, kwargs: self.call(layer, args, kwargs,
                                                training=training))
    return self.call(model, (inputs,), {}, nested_run=False,
                     training=training)

  def call(self, layer, args, kwargs, nested_run=True, training=True):
    """Calls `layer` (in training mode unless told otherwise), recording
    rule taps and fallbacks."""
    if nested_run and _nested_graph(layer):
      return self.run(layer, args[0], training)
    kwargs = dict(kwargs)
    takes_training, takes_mask = keras_version.call_arguments(layer)
    if takes_training and kwargs.get('training') is None:
      kwargs['training'] = training
    if takes_mask and kwargs.get('mask') is None and args:
      # Explicit, so that the fallback slices the mask with the inputs.
      mask = tf.nest.map_structure(lambda t: getattr(t, '_keras_mask', None),
                                   args[0])
      if any(m is not None for m in tf.nest.flatten(mask)):
        kwargs['mask'] = mask
    return self._dispatch(layer, args, kwargs,
                          lambda: layer(*args, **kwargs))

  def _dispatch(self, layer, args, kwargs, run):
    """Records one call: with its rule, opened (a composite) or fallback.

    `run()` computes the call's outputs where no rule applies.
    """
    weights = getattr(layer, 'trainable_weights', [])
    if not (self.use_rules and weights):
      reason = None if self.use_rules else 'use_layer_rules=False'
      return self._record(layer, args, kwargs, run, None, reason)
    rule, reason = self._rule(layer, args, kwargs)
    if rule is not None:
      return self._record(layer, args, kwargs, run, rule)
    closed = composites.closed_reason(layer)
    if closed is None:
      return self._descend(layer, args, kwargs, run)
    return self._record(layer, args, kwargs, run, None, reason or closed)

  def _rule(self, layer, args, kwargs):
    """`(rule, None)` for a call with a rule, else `(None, why not)`."""
    rule = layer_rules.registered(layer)
    if rule is None:
      return None, None
    others = sorted(k for k, v in kwargs.items() if v is not None and
                    k not in ('training', 'mask') + rule.keywords)
    if len(args) != 1 or others:
      return None, ('is called with other arguments than one input '
                    f'({len(args)} positional, keywords {others})')
    rule = layer_rules.lookup(layer, args[0])
    if rule is None:
      return None, 'its rule does not cover this configuration or input'
    return rule, None

  def _record(self, layer, args, kwargs, run, rule, reason=None):
    """The outputs of one layer call; records its rule tap or its fallback."""
    start = _GraphPosition()
    masks = _input_masks(args, kwargs)
    weights = getattr(layer, 'trainable_weights', [])
    if rule is not None and kwargs.get('mask') is not None and getattr(
        args[0], '_keras_mask', None) is None:
      args[0]._keras_mask = kwargs['mask']  # pylint: disable=protected-access
    # The call's own tape: which variables it reads (also another layer's,
    # e.g. tied weights) and, for a random call, its recorded ops.
    with tf.GradientTape(persistent=True) as own:
      if rule is not None:
        keywords = {k: kwargs[k] for k in rule.keywords if k in kwargs}
        outputs, tap, *saved = rule.forward(layer, args[0], **keywords)
      else:
        outputs = run()
    read = [self.wanted[k] for k in
            _unique_keys(own.watched_variables()) if k in self.wanted]
    if rule is not None:
      self.tape.watch(tap)
      # As Keras passes masks on: only through layers that support them.
      if getattr(layer, 'supports_masking', False):
        output_masks = layer.compute_mask(
            args[0], getattr(args[0], '_keras_mask', None))
        # A recurrent layer returning its states: one mask an output.
        for output, mask in zip(tf.nest.flatten(outputs),
                                tf.nest.flatten(output_masks)):
          if mask is not None:
            output._keras_mask = mask  # pylint: disable=protected-access
      entry = _RuleCall(layer, rule, args[0], tap, (saved or [None])[0])
      self.rule_calls.append(entry)
      variables = keras_version.tf_variables(weights)
      self.paths.append(CallPath(layer, entry, _unique(variables), rule,
                                 None))
      # The rule's gradients cover its layer's weights and nothing else.
      owned = {_key(v) for v in variables}
      self.unattributed.extend(v for v in read if _key(v) not in owned)
    elif weights or read:
      if reason is None:
        reason = ('reads weights of another layer' if not weights else
                  f'no rule for {type(layer).__name__}')
      self._add_fallback(
          _FallbackCall(layer, args, kwargs, _floats(outputs),
                        _unique(keras_version.tf_variables(weights) + read),
                        own, start.ops_since(), masks), reason)
    return outputs

  def _add_fallback(self, call: _FallbackCall, reason: str) -> None:
    self.tape.watch(call.outputs)
    self.fallback_calls.append(call)
    self.paths.append(CallPath(call.layer, call, call.variables, None,
                               reason))

  def _mark(self) -> _Mark:
    return _Mark(len(self.rule_calls), len(self.fallback_calls),
                 len(self.unattributed), len(self.paths))

  def _roll_back(self, mark: _Mark) -> None:
    """Forgets what was recorded after `mark`."""
    del self.rule_calls[mark.rule_calls:]
    del self.fallback_calls[mark.fallback_calls:]
    del self.unattributed[mark.unattributed:]
    del self.paths[mark.paths:]

  def _descend(self, layer, args, kwargs, run):
    """Calls a composite layer (`tfdpx.keras.composites`), recording each
    call of a sublayer with trainable weights as a layer call of its own.

    The sublayers' `call` is replaced for the duration of the layer's call:
    the layer's own code runs unchanged (its masks, softmax and dropout), and
    what reaches the weights goes through the sublayers' records. Where that
    cannot give each example's share (`_opened_fault`), the whole call is one
    fallback unit instead, and the report says why. A sublayer called on a
    tensor without the batch axis (a position table) gets its per-example
    gradients from a fallback unit of the whole call restricted to its
    weights.
    """
    mark = self._mark()
    subs = composites.trainable_sublayers(layer)
    # `outside` stops recording during the sublayer calls: it sees the
    # variables the layer's own code reads.
    outside = tf.GradientTape()
    for sub in subs:
      sub.call = self._recording(sub, outside)
    start = _GraphPosition()
    masks = _input_masks(args, kwargs)
    try:
      with tf.GradientTape(persistent=True) as own, outside:
        outputs = run()
    finally:
      for sub in subs:
        if 'call' in vars(sub):
          del sub.call  # The class's method again.
    fault = self._opened_fault(mark, outside, start.graph)
    if fault is not None:
      self._roll_back(mark)
      return self._record(layer, args, kwargs, run, None, fault)
    unbatched = self._unbatched_calls(mark)
    if unbatched:
      variables = _unique([v for path in unbatched for v in path.variables])
      names = sorted({path.layer.name for path in unbatched})
      self._forget(unbatched)
      self._add_fallback(
          _FallbackCall(layer, args, kwargs, _floats(outputs), variables, own,
                        start.ops_since(), masks),
          f'calls {names} on tensors without the batch axis (a table shared '
          'by the examples): their weights take the fallback of the whole '
          'call')
    return outputs

  def _recording(self, sub, outside: tf.GradientTape):
    """What replaces `sub.call` while its composite layer is called."""
    original = sub.call

    @tf.autograph.experimental.do_not_convert
    def recorded(*args, **kwargs):
      del sub.call  # The class's method while this call is recorded.
      # Already stopped where another sublayer calls this one.
      pause = (outside.stop_recording() if outside._recording  # pylint: disable=protected-access
               else contextlib.nullcontext())
      try:
        with pause:
          return self._recorded_call(sub, original, args, kwargs)
      finally:
        sub.call = recorded

    return recorded

  def _recorded_call(self, sub, original, args, kwargs):
    """Records a sublayer's call inside its composite layer's call."""
    if _nested_graph(sub):
      training = kwargs.get('training')
      return self.run(sub, args[0], True if training is None else training)
    return self._dispatch(sub, args, kwargs, lambda: original(*args, **kwargs))

  def _opened_fault(self, mark: _Mark, outside: tf.GradientTape,
                    graph) -> Optional[str]:
    """Why the sublayer calls recorded since `mark` do not give each
    example's share of the gradients, or None.

    `outside` recorded the composite layer's own code, not its sublayer
    calls.
    """
    read = [self.wanted[k] for k in _unique_keys(outside.watched_variables())
            if k in self.wanted]
    read += self.unattributed[mark.unattributed:]
    if read:
      names = sorted({v.name for v in read})
      return f'reads trainable weights {names} outside their layers\' calls'
    recorded = ([t for call in self.rule_calls[mark.rule_calls:]
                 for t in tf.nest.flatten(call.tap)] +
                [t for call in self.fallback_calls[mark.fallback_calls:]
                 for t in call.outputs])
    if graph is not None and any(getattr(t, 'graph', graph) is not graph
                                 for t in recorded):
      names = sorted({path.layer.name for path in self.paths[mark.paths:]})
      return (f'calls sublayers {names} inside a loop, a condition or a '
              'function of its own')
    return None

  def _unbatched_calls(self, mark: _Mark) -> List[CallPath]:
    """The sublayer calls recorded since `mark` whose inputs do not have the
    batch's static first axis.

    Where neither the batch's nor an input's first axis is static, their
    sizes are compared at run time.
    """
    found = []
    for path in self.paths[mark.paths:]:
      if path.rule is not None:
        inputs = [path.entry.inputs]
      else:
        flat = tf.nest.flatten((path.entry.args, path.entry.kwargs))
        inputs = [flat[i] for i in _batched_positions(path.entry.args,
                                                      path.entry.kwargs)]
      if not inputs or any(t.shape[0] != self.batch_rows for t in inputs):
        found.append(path)
      elif self.batch_rows is None:
        self.row_checks[id(path.entry)] = tf.add_n(
            [_rows_check(t, self.batch_size, path.layer.name)
             for t in inputs])
    return found

  def _forget(self, paths: Sequence[CallPath]) -> None:
    """Forgets the recorded calls of `paths`."""
    entries = {id(path.entry) for path in paths}
    self.rule_calls = [c for c in self.rule_calls if id(c) not in entries]
    self.fallback_calls = [c for c in self.fallback_calls
                           if id(c) not in entries]
    self.paths = [p for p in self.paths if id(p.entry) not in entries]

  def read_outside(self, read: Sequence[tf.Variable]) -> None:
    """Notes variables read outside the layer calls (e.g. by the loss)."""
    self.unattributed.extend(self.wanted[k] for k in _unique_keys(read)
                             if k in self.wanted)


class _GraphPosition:
  """The graph being built (None in eager mode) and its ops so far."""

  def __init__(self):
    self.graph = (None if tf.executing_eagerly() else
                  tf.compat.v1.get_default_graph())
    self._first = (len(self.graph.get_operations()) if self.graph is not None
                   else 0)

  def ops_since(self) -> Optional[List[tf.Operation]]:
    """The ops created since (None in eager mode)."""
    if self.graph is None:
      return None
    return self.graph.get_operations()[self._first:]


def _input_masks(args, kwargs) -> List[Tuple[int, tf.Tensor]]:
  """`(position, mask)` of the call's batched arguments that carry a Keras
  mask (before the call: Keras 3's MultiHeadAttention deletes them)."""
  flat = tf.nest.flatten((args, kwargs))
  return [(i, flat[i]._keras_mask) for i in _batched_positions(args, kwargs)  # pylint: disable=protected-access
          if getattr(flat[i], '_keras_mask', None) is not None]


def _rows_check(tensor: tf.Tensor, batch_size: tf.Tensor,
                layer_name: str) -> tf.Tensor:
  """Zero, from an op that fails unless `tensor` has `batch_size` rows.

  A composite layer that folds other axes into the first one (examples and
  positions, `tf.reshape(x, [-1, d])`) before calling a sublayer would make
  that call's rows other than the examples. The error names the op, and so
  the layer. No string constant (an `Assert`'s message has no GPU kernel).
  """
  name = re.sub(r'[^A-Za-z0-9_.-]', '_',
                f'tfdpx_rows_of_{layer_name}_are_not_the_examples_keep_the_'
                'batch_axis_first_docs_models_md')
  return tf.reduce_sum(tf.concat([tf.zeros([tf.shape(tensor)[0], 1]),
                                  tf.zeros([batch_size, 1])], axis=1,
                                 name=name))


def _floats(outputs) -> List[tf.Tensor]:
  return [t for t in tf.nest.flatten(outputs) if _is_float(t)]


def _nested_graph(layer) -> bool:
  """A nested functional or Sequential model: run layer by layer."""
  return isinstance(layer, tf.keras.Model) and (
      keras_version.is_graph_network(layer) or
      isinstance(layer, tf.keras.Sequential))


def _function_names(attrs) -> List[str]:
  names = []
  for value in attrs.values():
    if value.HasField('func'):
      names.append(value.func.name)
    if value.HasField('list'):
      names.extend(f.name for f in value.list.func)
  return names


def _draws_random_numbers(ops: Sequence[tf.Operation], library) -> bool:
  """Whether `ops`, or a function or loop body they call, draw random numbers.

  Args:
    ops: graph operations.
    library: `{name: FunctionDef}` of the graph's functions.
  """
  pending = []
  for op in ops:
    if _RANDOM_OP.search(op.type):
      return True
    pending.extend(_function_names(op.node_def.attr))
  seen = set()
  while pending:
    name = pending.pop()
    if name in seen:
      continue
    seen.add(name)
    if name not in library:
      return True  # Unknown body: assume it does.
    for node in library[name].node_def:
      if _RANDOM_OP.search(node.op):
        return True
      pending.extend(_function_names(node.attr))
  return False


def _random_calls(calls: Sequence[_FallbackCall]) -> List[bool]:
  """For each fallback call recorded in graph mode: does it draw randomness?"""
  library = {}
  if any(_function_names(op.node_def.attr) for call in calls
         for op in call.ops):
    graph = tf.compat.v1.get_default_graph()  # The forward pass's graph.
    library = {f.signature.name: f
               for f in graph.as_graph_def().library.function}
  return [_draws_random_numbers(call.ops, library) for call in calls]


def _depends_on(tensor, sources) -> bool:
  """Whether graph tensor `tensor` is computed from an op in `sources`.

  Follows every op input (float or integer, differentiable or not, and the
  inputs of loops, conditionals and function calls, which take every value
  their bodies use), so it is structural, not a gradient.
  """
  if getattr(tensor, 'graph', None) is None:
    return False  # An eager constant.
  stack, seen = [tensor.op], set()
  while stack:
    op = stack.pop()
    if op in sources:
      return True
    if op not in seen:
      seen.add(op)
      stack.extend(t.op for t in op.inputs)
  return False


def _data_dependent_loss_layers(model, terms, inputs) -> List[str]:
  """The names of the layers whose `add_loss` terms depend on `inputs`."""
  sources = {t.op for t in tf.nest.flatten(inputs)
             if getattr(t, 'graph', None) is not None}
  names = []
  for term in terms:
    if _depends_on(term, sources):
      # The layers holding the term, outermost first: the last one added it.
      owners = [layer for layer in model._flatten_layers()  # pylint: disable=protected-access
                if any(t is term for t in layer.losses)]
      names.append((owners or [model])[-1].name)
  return list(dict.fromkeys(names))


def _analysis(recorder, model, terms, inputs):
  """Random fallback calls and data-dependent `add_loss` layers (graph mode)."""
  random = (_random_calls(recorder.fallback_calls)
            if recorder.fallback_calls else [])
  return random, _data_dependent_loss_layers(model, terms, inputs)


def traced(model, inputs, use_rules, var_list):
  """`(paths, *_analysis)` of a trace of one forward pass on `inputs` (a
  batch, or specs): for an eager step, and for `tfdpx.keras.describe`."""
  found = []

  def forward(inputs):
    with tf.GradientTape(persistent=True) as tape:
      recorder = Recorder(tape, use_rules, var_list)
      recorder.run(model, inputs)
    found.append((recorder.paths,
                  *_analysis(recorder, model, model.losses, inputs)))

  tf.function(forward).get_concrete_function(inputs)
  return found[0]


def is_recurrent_loop(layer) -> bool:
  return isinstance(layer, tf.keras.layers.RNN) and not layer.unroll


def _dense(grads) -> List[tf.Tensor]:
  return [tf.convert_to_tensor(g) for g in grads]  # Embeddings: dense.


def _float32(tensor: tf.Tensor) -> tf.Tensor:
  """A 16-bit float `tensor` in float32 (other tensors as they are).

  Under a mixed precision policy a layer's inputs and output gradients are
  16-bit; the units form every statistic and sum of a layer from the same
  float32 values, so that a clip factor and the sum it weights see the same
  per-example gradient (docs/mixed_precision.md).
  """
  if layer_rules.half_precision(tensor.dtype):
    return tf.cast(tensor, tf.float32)
  return tensor


def _finite_rows(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """`[B]` bool: whether each row of every `[B, ...]` tensor is finite."""
  return tf.math.is_finite(clipping.per_example_global_norm(tensors))


def _example_grads(call: _FallbackCall):
  """`grads_of(chunk)`: per-example gradients of a deterministic call.

  The chunk holds the call's batched arguments and its output gradients. Each
  example's call is recomputed alone with `tf.vectorized_map`; without
  randomness in the call that is the computation of the batched forward pass,
  row by row.
  """
  layer, variables = call.layer, call.variables
  flat = tf.nest.flatten((call.args, call.kwargs))
  batched = _batched_positions(call.args, call.kwargs)
  masked = [i for i, _ in call.masks]

  def one_example(elems, rows=1):
    # The example as a batch of `rows` copies; only the first copy's output
    # gradient is nonzero, so the call's gradient is the example's.
    example = list(flat)
    for i, tensor in zip(batched, elems):
      example[i] = tf.stack([tensor] * rows)
    masks = elems[len(batched):len(batched) + len(masked)]
    for i, mask in zip(masked, masks):
      example[i]._keras_mask = tf.stack([mask] * rows)  # pylint: disable=protected-access
    grads_in = [tf.stack([g] + [tf.zeros_like(g)] * (rows - 1))
                for g in elems[len(batched) + len(masked):]]
    call_args, call_kwargs = tf.nest.pack_sequence_as((call.args, call.kwargs),
                                                      example)
    with tf.GradientTape() as tape:
      out = layer(*call_args, **call_kwargs)
    targets = [t for t in tf.nest.flatten(out) if _is_float(t)]
    return _dense(tape.gradient(
        targets, variables, output_gradients=grads_in,
        unconnected_gradients=tf.UnconnectedGradients.ZERO))

  signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]

  def loop(chunk):
    return tf.map_fn(one_example, chunk, fn_output_signature=signature)

  def grads_of(chunk):
    if is_recurrent_loop(layer):
      return loop(chunk)  # pfor fails on the gradient of its while loop.
    rows = 2 if _one_row_batches_crash() else 1
    try:
      return tf.vectorized_map(lambda e: one_example(e, rows), chunk)
    except Exception:  # pylint: disable=broad-except
      # pfor cannot vectorize some gradients: loop over the chunk's examples
      # instead; a genuine error in the layer reappears there.
      _LOG.warning(
          'tfdpx: tf.vectorized_map cannot vectorize the per-example '
          'gradient of layer %r; looping over examples instead (slower).',
          layer.name)
      return loop(chunk)

  return grads_of


def _one_row_batches_crash() -> bool:
  """Whether a vectorized call on batches of one example may crash.

  TensorFlow 2.21.0's oneDNN batch matmul corrupts the heap when a rank-4
  left operand with an axis of size 1 meets a rank-2 right operand
  (tensorflow/tensorflow#117700, fixed upstream after 2.21.0). That is what
  `tf.vectorized_map` makes of a one-example call to a projection, e.g. in
  Keras 3's MultiHeadAttention. A batch of two rows avoids it at twice the
  call's cost. TensorFlow 2.15 is not affected (checked); the versions
  between are taken as affected (not checked).
  """
  if tuple(int(p) for p in tf.__version__.split('.')[:2]) < (2, 16):
    return False
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
  except ImportError:
    return True
  return _pywrap_util_port.IsMklEnabled()


def _batched_positions(args, kwargs) -> List[int]:
  """Positions in the flat call arguments of the tensors with a batch axis."""
  return [i for i, t in enumerate(tf.nest.flatten((args, kwargs)))
          if tf.is_tensor(t) and not isinstance(t, tf.Variable) and
          t.shape.rank]


def _recorded_grads(call: _FallbackCall, output_grads, chunk_size,
                    expected_batch_size=None) -> List[tf.Tensor]:
  """Per-example gradients of a random call, from the forward pass that ran.

  Recomputing the call would draw new random numbers (dropout masks), so
  each example's gradient is instead the Jacobian row of
  `sum(outputs[b] * output_grads[b])` through the recorded call: exact, but
  one backward pass of the call over the whole batch per example, `tile`
  rows at a time.
  """
  _LOG.warning(
      'tfdpx: layer %r draws random numbers in training (dropout, noise); its '
      'per-example gradients come from the recorded forward pass by a '
      'Jacobian over the batch, whose cost grows with the square of the batch '
      'size. Move the randomness into a separate layer (e.g. a Dropout layer '
      'before it) to keep the engine linear.', call.layer.name)
  finite = _finite_rows(output_grads)
  tile = min(chunk_size, expected_batch_size or chunk_size)
  with call.tape:
    # An example with a non-finite output gradient must not reach the other
    # rows of the Jacobian (as 0 * NaN): zero it here, mark it below.
    rows = tf.add_n([
        tf.reduce_sum(tf.reshape(o * tf.stop_gradient(
            clipping.zero_rows(tf.cast(g, o.dtype), finite)),
                                 [tf.shape(o)[0], -1]), axis=1)
        for o, g in zip(call.outputs, output_grads)])
    count = tf.shape(rows)[0]
    chunks = (count + tile - 1) // tile
    # Zero rows pad the batch to whole chunks of `tile` rows (by a product:
    # pfor fails on the gradient of a concatenation's dynamic slices).
    rows = tf.linalg.matvec(tf.eye(chunks * tile, count, dtype=rows.dtype),
                            rows)
  signature = [tf.TensorSpec([tile, *v.shape], v.dtype)
               for v in call.variables]

  def jacobian(use_pfor):
    # One chunk of a static `tile` rows at a time: TensorFlow's own tiling
    # (`parallel_iterations`) fails on a batch of dynamic size that is
    # smaller than one tile or a whole number of tiles.
    def chunk(k):
      with call.tape:
        part = tf.gather(rows, k * tile + tf.range(tile))
      return _dense(call.tape.jacobian(
          part, call.variables,
          unconnected_gradients=tf.UnconnectedGradients.ZERO,
          experimental_use_pfor=use_pfor))

    stacked = tf.map_fn(chunk, tf.range(chunks), fn_output_signature=signature)
    return [tf.reshape(g, [-1, *v.shape])[:count]
            for g, v in zip(stacked, call.variables)]

  if is_recurrent_loop(call.layer):
    grads = jacobian(False)  # pfor fails on the gradient of its while loop.
  else:
    try:
      grads = jacobian(True)
    except Exception:  # pylint: disable=broad-except
      _LOG.warning(
          'tfdpx: pfor cannot vectorize the Jacobian of layer %r; looping '
          'over examples instead (slower).', call.layer.name)
      grads = jacobian(False)
  nan = float('nan')
  return [tf.where(tf.reshape(finite, [-1] + [1] * v.shape.rank), g,
                   tf.constant(nan, g.dtype))
          for v, g in zip(call.variables, grads)]


def _fallback_unit(call: _FallbackCall, output_grads, chunk_size,
                   draws_random_numbers, loss_scale=1.0,
                   expected_batch_size=None) -> unit_lib.Unit:
  """The unit of a layer call without a rule.

  Its output gradients stay in the layer's dtype and scale (the per-example
  recomputation runs in that dtype); its per-example gradients are divided by
  `loss_scale` (in the variables' dtype).
  """

  def unscaled(grads):
    return grads if loss_scale == 1 else [g / loss_scale for g in grads]

  if draws_random_numbers and call.outputs:
    grads = unscaled(_recorded_grads(call, output_grads, chunk_size,
                                     expected_batch_size))
    return materialized_forms.MaterializedUnit(
        call.variables, lambda _: grads, [], chunk_size=None)
  flat = tf.nest.flatten((call.args, call.kwargs))
  elems = ([flat[i] for i in _batched_positions(call.args, call.kwargs)] +
           [mask for _, mask in call.masks] + list(output_grads))
  example_grads = _example_grads(call)
  unit = materialized_forms.MaterializedUnit(
      call.variables, lambda chunk: unscaled(example_grads(chunk)), elems,
      chunk_size, expected_batch_size=expected_batch_size)
  if any(layer_rules.half_precision(g.dtype) for g in output_grads):
    # A backward pass would sum in 16 bits what the norms saw per example:
    # the sum comes from the per-example gradients themselves.
    return unit

  def weighted_sum(weights, keep):
    # One weighted backward pass through the recorded call (row b of the
    # output gradients belongs to example b alone), except in a step that
    # drops a record, whose non-finite activations would reach the others'
    # rows of the batched product as 0 * NaN.
    weighted = [unit_lib.weighted_rows(g, weights, keep)
                for g in output_grads]
    recorded = unscaled(_dense(call.tape.gradient(
        call.outputs, call.variables, output_gradients=weighted,
        unconnected_gradients=tf.UnconnectedGradients.ZERO)))
    return tf.cond(tf.reduce_all(keep), lambda: recorded,
                   lambda: unit.materialized_weighted_sum(weights, keep))

  unit.set_weighted_sum(weighted_sum)
  return unit


def model_gradients(model: tf.keras.Model, inputs: Any,
                    per_example_loss: Callable[[Any], tf.Tensor],
                    var_list: Sequence[tf.Variable],
                    chunk_size: int = 128,
                    use_rules: bool = True,
                    loss_scale: float = 1.0,
                    expected_batch_size: Optional[int] = None,
                    on_paths: Optional[Callable[[List[CallPath], List[bool]],
                                                None]] = None
                   ) -> per_example.GradientResult:
  """The per-example gradients of a Keras model, from one batched pass.

  Each example's gradient is the gradient of its loss through the very
  forward pass that produced the loss (the same dropout masks). An example
  whose gradient is not finite is dropped (`dropped_records`) before anything
  else sees it.

  Args:
    model: a Keras model whose layers treat examples independently.
    inputs: the batch's inputs.
    per_example_loss: maps the model's outputs to the `[B]` loss vector (with
      any sample weights applied).
    var_list: the variables to differentiate, usually
      `model.trainable_variables`.
    chunk_size: examples per chunk where per-example gradients are formed
      (the fallback, convolutions' statistics) and rows per pass of a random
      layer's Jacobian.
    use_rules: False sends every layer to the fallback (for tests and
      benchmarks).
    loss_scale: the backward pass runs on the losses times this public
      constant (float16 layers: small gradients would underflow), and every
      per-example gradient is divided by it again in float32 before any
      statistic; 1 (the default) for float32 and bfloat16.
    expected_batch_size: where the batch size is known only at run time
      (`tf.data ... .batch(B)`, Keras's numpy adapter), the forms are chosen
      as for a static batch of this size (e.g. whether a unit keeps its
      per-example gradients for the step); None: as for a large batch.
    on_paths: called with the recorder's `CallPath`s and, for each fallback
      call, whether it draws random numbers (`tfdpx.keras.report`).

  Returns:
    A `per_example.GradientResult` whose `grads` answer per-example
    statistics. Gradients exclude `model.losses`, whose gradient is returned
    separately.

  Raises:
    ValueError: if a term of `model.losses` depends on the inputs, or a
      variable of `var_list` is read outside the model's layer calls (e.g. by
      the loss).
  """
  inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
  var_list = keras_version.tf_variables(var_list)
  with tf.GradientTape(persistent=True) as tape:
    recorder = Recorder(tape, use_rules, var_list)
    # Under a scope of its own: Keras 3 opens each layer's name scope, and
    # at the root a name starting with '_' (from a class `_Layer`) is invalid.
    with tf.name_scope('tfdpx_engine'):
      outputs = recorder.run(model, inputs)
    with tf.GradientTape() as loss_tape:
      losses = per_example_loss(outputs)
    recorder.read_outside(loss_tape.watched_variables())
    total = tf.reduce_sum(losses)
    if loss_scale != 1:
      total = tf.cast(total, tf.float32) * loss_scale
    terms = model.losses
    regularization = tf.add_n(terms) if terms else None

  if recorder.unattributed:
    names = list(dict.fromkeys(v.name for v in recorder.unattributed))
    raise ValueError(
        f'trainable variables {names} are read outside the layer calls of '
        'the model that tfdpx can account for (by the loss, or by a layer '
        'rule that does not give their gradient): tfdpx cannot tell which '
        'examples their gradient comes from. Read them inside a layer (a '
        'custom layer that receives the variable), or train without '
        'make_private.')
  if tf.executing_eagerly() and (terms or recorder.fallback_calls):
    _, random, dependent = traced(model, inputs, use_rules, var_list)
  else:
    random, dependent = _analysis(recorder, model, terms, inputs)
  if dependent:
    raise ValueError(
        f'a loss added with add_loss in layer(s) {dependent} depends on the '
        'data (on the model inputs, through any operation, including integer '
        'inputs and tf.stop_gradient). Models made private add the gradient '
        'of model.losses outside the clipped per-example sum, which is only '
        'private for terms that do not depend on the data (weight '
        'regularizers); put data-dependent terms into the per-example loss.')
  if len(random) != len(recorder.fallback_calls):
    random = [True] * len(recorder.fallback_calls)  # Eager and trace differ.
  if on_paths is not None:
    on_paths(recorder.paths, random)

  regularization_grads = None
  if regularization is not None:
    # None for a variable no regularizer reads: its gradient stays as the
    # privatizer released it (a table's selected rows stay sparse).
    regularization_grads = tape.gradient(regularization, list(var_list))

  taps = [call.tap for call in recorder.rule_calls]
  fallback_outputs = [call.outputs for call in recorder.fallback_calls]
  grads = tape.gradient(total, [taps, fallback_outputs],
                        unconnected_gradients=tf.UnconnectedGradients.ZERO)
  def unscaled(tap_grad):
    tap_grad = _float32(tap_grad)
    return tap_grad / loss_scale if loss_scale != 1 else tap_grad

  def checked(call, tensors):
    """`tensors` the unit reads, plus the zero of the call's rows check (so
    that the check runs before any statistic of the call)."""
    check = recorder.row_checks.get(id(call))
    if check is None:
      return tensors
    return tf.nest.map_structure(lambda t: t + tf.cast(check, t.dtype),
                                 tensors)

  units = [
      unit for call, tap_grad in zip(recorder.rule_calls, grads[0])
      for unit in call.rule.make_units(layer_rules.RuleCall(
          call.layer, _float32(call.inputs), call.tap,
          checked(call, tf.nest.map_structure(unscaled, tap_grad)), tape,
          chunk_size, expected_batch_size, call.saved))
  ] + [
      _fallback_unit(call, checked(call, out_grads), chunk_size, draws,
                     loss_scale, expected_batch_size)
      for call, out_grads, draws in zip(recorder.fallback_calls, grads[1],
                                        random)
  ]
  value = per_example.UnitGradients(var_list, units, tf.shape(losses)[0])
  return per_example.GradientResult(value, outputs, losses, regularization,
                                    regularization_grads)


def public_gradients(model: tf.keras.Model, inputs: Any, targets: Any,
                     per_example_loss: Callable[[Any, Any], tf.Tensor],
                     var_list: Sequence[tf.Variable],
                     chunk_size: int,
                     use_rules: bool = True,
                     loss_scale: float = 1.0
                    ) -> gradients.PerExampleGradients:
  """Per-example gradients of public examples, as the engine's lazy value.

  One pass over all public examples; like the private batch's, the value
  answers dots and weighted sums per layer, so the `[m, *var.shape]` tensors
  are formed only for layers without a cheaper form (and then in chunks).

  Args:
    model: the model.
    inputs: the public inputs (all of them).
    targets: the public targets.
    per_example_loss: `per_example_loss(targets, outputs) -> [B]`.
    var_list: the variables to differentiate.
    chunk_size: examples per chunk where per-example gradients are formed.
    use_rules, loss_scale: as in `model_gradients`.

  Returns:
    A `tfdpx.gradients.PerExampleGradients`. Never clipped or noised: public
    data costs no privacy.
  """
  targets = tf.nest.map_structure(tf.convert_to_tensor, targets)
  return model_gradients(
      model, inputs, lambda outputs: per_example_loss(targets, outputs),
      var_list, chunk_size, use_rules, loss_scale).grads
