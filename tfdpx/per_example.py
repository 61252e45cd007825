"""Per-example gradient engines.

The compile-path engine (`jacobian`) is the one tensorflow-privacy's
vectorized optimizers use: the Jacobian of the per-example (or
per-microbatch) loss vector with respect to every trainable variable. It is
correct for any Keras model; its cost grows with the square of the batch.

The engine of models made private (`model_gradients`) costs one batched
forward and one batched backward pass plus, per layer call, a rule
(`tfdpx.layer_rules`) or a chunked `tf.vectorized_map` fallback: linear in the
batch.

One definition holds on every path: an example's gradient is the gradient of
its loss through the very forward pass that produced the loss (the same
dropout masks). The fallback therefore never recomputes a call that draws
random numbers; it differentiates the recorded call instead (exact, quadratic
in the batch for that layer). A variable read by several layer calls (tied
weights) gets the sum of every call's share. Records whose gradient is not
finite are dropped (zeroed) before any privatizer sees them. See
docs/per_example.md.
"""

import logging
import re
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

from tfdpx import clipping
from tfdpx import layer_rules

_LOG = logging.getLogger(__name__)

SCALAR_LOSS_HELP = (
    'tfdpx optimizers need one loss per example, but the loss is a scalar. '
    'Compile with an unreduced loss, e.g. '
    'loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, '
    'reduction=tf.keras.losses.Reduction.NONE).')


def record_losses(losses: tf.Tensor,
                  num_microbatches: Optional[int] = None) -> tf.Tensor:
  """The loss of each record: each example, or the mean of each microbatch.

  Args:
    losses: per-example losses, shape `[B, ...]` (extra axes are averaged).
    num_microbatches: split the batch into this many equal microbatches;
      `None` means one record per example.

  Returns:
    A `[num_records]` tensor.

  Raises:
    ValueError: if `losses` is a scalar (the loss was reduced over the batch).
  """
  losses = tf.convert_to_tensor(losses)
  if losses.shape.rank == 0:
    raise ValueError(SCALAR_LOSS_HELP)
  records = num_microbatches if num_microbatches else tf.shape(losses)[0]
  return tf.reduce_mean(tf.reshape(losses, [records, -1]), axis=1)


def jacobian(tape: tf.GradientTape, record_loss: tf.Tensor,
             var_list: Sequence[tf.Variable]) -> List[tf.Tensor]:
  """Per-record gradients `[num_records, *var.shape]` for each variable.

  Variables the loss does not depend on get zero gradients.
  """
  return tape.jacobian(
      record_loss, list(var_list),
      unconnected_gradients=tf.UnconnectedGradients.ZERO)


# --- The linear-time engine for models made private --------------------------
#
# One batched forward pass records every layer call that reads a trainable
# variable: a rule's tap (`tfdpx.layer_rules`) or, for the fallback, the call's
# outputs. One batched backward pass of the summed loss then gives every tap's
# and every fallback output's gradient, one row per example. Rules turn those
# rows into per-example weight gradients; the fallback runs each example's
# backward pass through the layer alone with `tf.vectorized_map`, in chunks, or,
# for a call that draws random numbers, differentiates the recorded call
# itself. A row only depends on its own example as long as no layer mixes the
# examples of a batch, which is why BatchNormalization is refused.
#
# A variable's per-example gradient is the sum over the calls that read it of
# each call's share (the chain rule), so a variable read by several calls (a
# layer called twice, tied weights) is exact on the materialized path; fast
# clipping materializes such variables, because the norm of a sum is not the
# sum of the norms.

Grads = List[Tuple[tf.Variable, tf.Tensor]]

# Types of the ops that draw random numbers: stateful and stateless random
# ops (tf.random, Keras's generators, tf.nn.dropout) and tf.random.Generator's.
_RANDOM_OP = re.compile(
    r'Random|Multinomial|TruncatedNormal|^Rng|^StatefulUniform|'
    r'^StatefulStandardNormal')


class GradientResult(NamedTuple):
  """What one pass of `model_gradients` computes.

  Attributes:
    per_example_grads: one `[B, *var.shape]` tensor per variable of `var_list`,
      or None when `clipped_sum` is given instead.
    clipped_sum: with fast clipping, one tensor per variable: the sum of the
      examples' gradients, each clipped to the global L2 norm asked for;
      otherwise None.
    outputs: the model's outputs on the batch (for metrics).
    losses: the `[B]` per-example losses (NaN where an example's is).
    regularization_loss: the sum of `model.losses`, or None if there are none.
    regularization_grads: its gradient, one tensor per variable, or None.
    dropped_records: the int32 number of examples whose gradient was not
      finite and was zeroed (`clipping.drop_nonfinite`). It depends on the
      data and no epsilon covers it, like a training metric.
  """
  per_example_grads: Optional[List[tf.Tensor]]
  clipped_sum: Optional[List[tf.Tensor]]
  outputs: Any
  losses: tf.Tensor
  regularization_loss: Optional[tf.Tensor]
  regularization_grads: Optional[List[tf.Tensor]]
  dropped_records: tf.Tensor


def _is_graph_network(layer) -> bool:
  return (isinstance(layer, tf.keras.Model) and
          getattr(layer, '_is_graph_network', False))


def _is_float(tensor) -> bool:
  return tf.is_tensor(tensor) and tensor.dtype.is_floating


def _key(variable):
  # A mixed-precision AutoCastVariable and the variable it wraps (which a tape
  # reports as read) share a handle.
  return variable.handle.ref()


def _unique_keys(variables):
  return list(dict.fromkeys(_key(v) for v in variables))


def _unique(variables) -> List[tf.Variable]:
  keys = {}
  for variable in variables:
    keys.setdefault(_key(variable), variable)
  return list(keys.values())


class _FallbackCall(NamedTuple):
  """A recorded layer call without a rule.

  `variables` are the wanted variables it reads and its layer's trainable
  weights; `tape` recorded the call's own ops (with those variables as its
  only sources); `ops` are the graph ops the call created (None in eager mode).
  """
  layer: tf.keras.layers.Layer
  args: Any
  kwargs: Any
  outputs: List[tf.Tensor]
  variables: List[tf.Variable]
  tape: tf.GradientTape
  ops: Optional[List[tf.Operation]]


class _Recorder:
  """Runs a model layer by layer, recording what the backward pass needs."""

  def __init__(self, tape: tf.GradientTape, use_rules: bool,
               var_list: Sequence[tf.Variable]):
    self.tape = tape
    self.use_rules = use_rules
    self.wanted = {_key(v): v for v in var_list}
    self.rule_calls = []  # (layer, rule, inputs, tap)
    self.fallback_calls = []  # _FallbackCall
    self.unattributed = []  # Wanted variables read where no unit sees it.

  def run(self, model, inputs):
    """The model's outputs on `inputs`, computed in training mode."""
    if _is_graph_network(model) and not isinstance(model, tf.keras.Sequential):
      return self._run_graph(model, inputs)
    if isinstance(model, tf.keras.Sequential):
      for layer in model.layers:
        inputs = self.call(layer, (inputs,), {})
      return inputs
    return self.call(model, (inputs,), {}, nested_run=False)

  def _run_graph(self, model, inputs):
    # The loop of Keras's Functional._run_internal_graph, with self.call.
    # pylint: disable=protected-access
    inputs = model._flatten_to_reference_inputs(inputs)
    tensors = {}
    for reference, value in zip(model.inputs, inputs):
      value = model._conform_to_reference_input(value, ref_input=reference)
      key = str(id(reference))
      tensors[key] = [value] * model._tensor_usage_count[key]
    for depth in sorted(model._nodes_by_depth, reverse=True):
      for node in model._nodes_by_depth[depth]:
        if node.is_input or any(k not in tensors for k in node.flat_input_ids):
          continue
        args, kwargs = node.map_arguments(tensors)
        outputs = self.call(node.layer, args, kwargs)
        for key, value in zip(node.flat_output_ids, tf.nest.flatten(outputs)):
          tensors[key] = [value] * model._tensor_usage_count[key]
    outputs = [tensors[str(id(x))].pop() for x in model.outputs]
    return tf.nest.pack_sequence_as(model._nested_outputs, outputs)
    # pylint: enable=protected-access

  def call(self, layer, args, kwargs, nested_run=True):
    """Calls `layer` in training mode, recording a rule tap or a fallback."""
    if nested_run and isinstance(layer, tf.keras.Model) and (
        _is_graph_network(layer) or isinstance(layer, tf.keras.Sequential)):
      return self.run(layer, args[0])
    kwargs = dict(kwargs)
    spec = layer._call_spec  # pylint: disable=protected-access
    if spec.expects_training_arg and kwargs.get('training') is None:
      kwargs['training'] = True
    if spec.expects_mask_arg and kwargs.get('mask') is None and args:
      # Explicit, so that the fallback slices the mask with the inputs.
      mask = tf.nest.map_structure(lambda t: getattr(t, '_keras_mask', None),
                                   args[0])
      if any(m is not None for m in tf.nest.flatten(mask)):
        kwargs['mask'] = mask
    rule = None
    if (self.use_rules and layer.trainable_weights and len(args) == 1 and
        set(kwargs) <= {'training', 'mask'}):
      rule = layer_rules.lookup(layer, args[0])
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    first_op = len(graph.get_operations()) if graph is not None else 0
    # The call's own tape: which variables it reads (also another layer's,
    # e.g. tied weights) and, for a random call, its recorded ops.
    with tf.GradientTape(persistent=True) as own:
      if rule is not None:
        outputs, tap = rule.forward(layer, args[0])
      else:
        outputs = layer(*args, **kwargs)
    read = [self.wanted[k] for k in
            _unique_keys(own.watched_variables()) if k in self.wanted]
    if rule is not None:
      self.tape.watch(tap)
      mask = layer.compute_mask(args[0], getattr(args[0], '_keras_mask',
                                                 None))
      if mask is not None:
        outputs._keras_mask = mask  # pylint: disable=protected-access
      self.rule_calls.append((layer, rule, args[0], tap))
      # The rule's gradients cover its layer's weights and nothing else.
      owned = {_key(v) for v in layer.trainable_weights}
      self.unattributed.extend(v for v in read if _key(v) not in owned)
    elif layer.trainable_weights or read:
      float_outputs = [t for t in tf.nest.flatten(outputs) if _is_float(t)]
      self.tape.watch(float_outputs)
      ops = graph.get_operations()[first_op:] if graph is not None else None
      self.fallback_calls.append(_FallbackCall(
          layer, args, kwargs, float_outputs,
          _unique(list(layer.trainable_weights) + read), own, ops))
    return outputs

  def read_outside(self, read: Sequence[tf.Variable]) -> None:
    """Notes variables read outside the layer calls (e.g. by the loss)."""
    self.unattributed.extend(self.wanted[k] for k in _unique_keys(read)
                             if k in self.wanted)


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


def _traced_analysis(model, inputs, use_rules, var_list):
  """`_analysis` in eager mode, from a trace of the same forward pass."""
  found = []

  def forward(inputs):
    with tf.GradientTape(persistent=True) as tape:
      recorder = _Recorder(tape, use_rules, var_list)
      recorder.run(model, inputs)
    found.append(_analysis(recorder, model, model.losses, inputs))

  tf.function(forward).get_concrete_function(inputs)
  return found[0]


def chunked(fn: Callable[[List[tf.Tensor]], List[tf.Tensor]],
            elems: Sequence[tf.Tensor], chunk_size: int,
            signature: Sequence[tf.TensorSpec]) -> List[tf.Tensor]:
  """`fn` over the batch in chunks of `chunk_size` examples.

  The batch is padded to whole chunks by repeating its examples (so that every
  chunk is a valid batch and shapes stay static under XLA); the extra rows
  are dropped from the result.

  Args:
    fn: maps a list of `[c, ...]` tensors to a list of `[c, ...]` tensors.
    elems: the batch, tensors of equal leading dimension B.
    chunk_size: the largest number of examples `fn` sees at once.
    signature: one `tf.TensorSpec` per output of `fn`, without the batch axis.

  Returns:
    The outputs of `fn`, `[B, ...]` each.
  """
  elems = list(elems)
  static_batch = elems[0].shape[0]
  if static_batch is not None and static_batch <= chunk_size:
    return list(fn(elems))
  batch = tf.shape(elems[0])[0]
  num_chunks = (batch + chunk_size - 1) // chunk_size
  index = tf.range(num_chunks * chunk_size) % batch

  def split(tensor):
    shape = tf.concat([tf.stack([num_chunks, chunk_size]),
                       tf.shape(tensor)[1:]], axis=0)
    chunks = tf.reshape(tf.gather(tensor, index), shape)
    chunks.set_shape([None, chunk_size, *tensor.shape[1:]])
    return chunks

  specs = [tf.TensorSpec([chunk_size, *s.shape], s.dtype) for s in signature]
  outputs = tf.map_fn(lambda chunk: list(fn(chunk)),
                      [split(e) for e in elems], fn_output_signature=specs)
  return [tf.reshape(o, [-1, *s.shape])[:batch]
          for o, s in zip(outputs, signature)]


def _is_recurrent_loop(layer) -> bool:
  return isinstance(layer, tf.keras.layers.RNN) and not layer.unroll


def _dense(grads) -> List[tf.Tensor]:
  return [tf.convert_to_tensor(g) for g in grads]  # Embeddings: dense.


def _finite_rows(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """`[B]` bool: whether each row of every `[B, ...]` tensor is finite."""
  return tf.math.is_finite(clipping.per_example_global_norm(tensors))


def _fallback_grads(call: _FallbackCall, output_grads, chunk_size) -> Grads:
  """Per-example gradients of a deterministic call, by vectorized_map.

  Each example's call is recomputed alone; without randomness in the call
  that is the computation of the batched forward pass, row by row.
  """
  layer, variables = call.layer, call.variables
  flat = tf.nest.flatten((call.args, call.kwargs))
  batched = [i for i, t in enumerate(flat)
             if tf.is_tensor(t) and not isinstance(t, tf.Variable) and
             t.shape.rank]

  def one_example(elems):
    example = list(flat)
    for i, tensor in zip(batched, elems):
      example[i] = tensor[tf.newaxis]
    grads_in = [g[tf.newaxis] for g in elems[len(batched):]]
    call_args, call_kwargs = tf.nest.pack_sequence_as((call.args, call.kwargs),
                                                      example)
    with tf.GradientTape() as tape:
      out = layer(*call_args, **call_kwargs)
    targets = [t for t in tf.nest.flatten(out) if _is_float(t)]
    return _dense(tape.gradient(
        targets, variables, output_gradients=grads_in,
        unconnected_gradients=tf.UnconnectedGradients.ZERO))

  def loop(chunk):
    return tf.map_fn(one_example, chunk, fn_output_signature=signature)

  def one_chunk(chunk):
    if _is_recurrent_loop(layer):
      return loop(chunk)  # pfor fails on the gradient of its while loop.
    try:
      return tf.vectorized_map(one_example, chunk)
    except Exception:  # pylint: disable=broad-except
      # pfor cannot vectorize some gradients: loop over the chunk's examples
      # instead; a genuine error in the layer reappears there.
      _LOG.warning(
          'tfdpx: tf.vectorized_map cannot vectorize the per-example '
          'gradient of layer %r; looping over examples instead (slower).',
          layer.name)
      return loop(chunk)

  signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
  grads = chunked(one_chunk, [flat[i] for i in batched] + list(output_grads),
                  chunk_size, signature)
  return list(zip(variables, grads))


def _recorded_grads(call: _FallbackCall, output_grads, chunk_size) -> Grads:
  """Per-example gradients of a random call, from the forward pass that ran.

  Recomputing the call would draw new random numbers (dropout masks), so
  each example's gradient is instead the Jacobian row of
  `sum(outputs[b] * output_grads[b])` through the recorded call: exact, but
  one backward pass of the call over the whole batch per example.
  """
  _LOG.warning(
      'tfdpx: layer %r draws random numbers in training (dropout, noise); its '
      'per-example gradients come from the recorded forward pass by a '
      'Jacobian over the batch, whose cost grows with the square of the batch '
      'size. Move the randomness into a separate layer (e.g. a Dropout layer '
      'before it) to keep the engine linear.', call.layer.name)
  finite = _finite_rows(output_grads)
  with call.tape:
    # An example with a non-finite output gradient must not reach the other
    # rows of the Jacobian (as 0 * NaN): zero it here, mark it below.
    rows = tf.add_n([
        tf.reduce_sum(tf.reshape(o * tf.stop_gradient(
            clipping.zero_rows(tf.cast(g, o.dtype), finite)),
                                 [tf.shape(o)[0], -1]), axis=1)
        for o, g in zip(call.outputs, output_grads)])

  def jacobian(use_pfor):
    return _dense(call.tape.jacobian(
        rows, call.variables,
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
        parallel_iterations=chunk_size, experimental_use_pfor=use_pfor))

  if _is_recurrent_loop(call.layer):
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
  return [(v, tf.where(tf.reshape(finite, [-1] + [1] * v.shape.rank), g,
                       tf.constant(nan, g.dtype)))
          for v, g in zip(call.variables, grads)]


class _Unit(NamedTuple):
  """One layer call's share of the per-example gradients.

  `grads()` materializes them; `sq_norms()` gives each example's squared
  norms without them, or None; `weighted_sum(factors, keep)`, given with
  `sq_norms`, is `sum_b factors[b] * g_b` over the examples that `keep`
  (`[B]` bool) keeps.
  """
  variables: List[tf.Variable]
  grads: Callable[[], Grads]
  sq_norms: Callable[[], Optional[Grads]]
  weighted_sum: Optional[Callable[[tf.Tensor, tf.Tensor], Grads]]


def _rule_unit(tape, layer, rule, inputs, tap, tap_grad) -> _Unit:
  """A unit whose per-example gradients follow from a rule."""
  variables = layer.trainable_weights

  def sq_norms():
    return rule.sq_norms(layer, inputs, tap_grad) if rule.sq_norms else None

  def weighted_sum(factors, keep):
    # Row b of the tap gradient belongs to example b alone, so backpropagating
    # the factor-weighted tap gradient to the layer's own weights (through its
    # own ops only) gives the weighted sum without any per-example gradient.
    factors = tf.reshape(tf.cast(factors, tap_grad.dtype),
                         [-1] + [1] * (tap_grad.shape.rank - 1))
    weighted = clipping.zero_rows(tap_grad * factors, keep)
    recorded = _dense(tape.gradient(
        tap, variables, output_gradients=weighted,
        unconnected_gradients=tf.UnconnectedGradients.ZERO))

    def without_dropped_inputs():
      # A dropped example's non-finite input times its zero weight is NaN in
      # the recorded product over the batch: recompute the tap without it.
      with tf.GradientTape() as kept:
        _, kept_tap = rule.forward(layer, clipping.zero_rows(inputs, keep))
      return _dense(kept.gradient(
          kept_tap, variables, output_gradients=weighted,
          unconnected_gradients=tf.UnconnectedGradients.ZERO))

    sums = tf.cond(tf.reduce_all(keep), lambda: recorded,
                   without_dropped_inputs)
    return list(zip(variables, sums))

  return _Unit(variables, lambda: rule.grads(layer, inputs, tap_grad),
               sq_norms, weighted_sum if rule.sq_norms else None)


def _fallback_unit(call: _FallbackCall, output_grads, chunk_size,
                   draws_random_numbers) -> _Unit:
  # Without float outputs no gradient flows: nothing to record.
  grads = (_recorded_grads if draws_random_numbers and call.outputs else
           _fallback_grads)
  return _Unit(call.variables,
               lambda: grads(call, output_grads, chunk_size),
               lambda: None, None)


def _add_grads(sums, pairs):
  """Adds each `(variable, [B, ...])` of `pairs` into `sums[variable.ref()]`."""
  for variable, grad in pairs:
    key = variable.ref()
    grad = tf.cast(grad, variable.dtype)
    sums[key] = (variable, sums[key][1] + grad) if key in sums else (
        variable, grad)


def _shared(units: Sequence[_Unit]):
  """The refs of the variables that more than one unit reads."""
  refs = [v.ref() for unit in units for v in unit.variables]
  return {ref for ref in refs if refs.count(ref) > 1}


def model_gradients(model: tf.keras.Model, inputs: Any,
                    per_example_loss: Callable[[Any], tf.Tensor],
                    var_list: Sequence[tf.Variable],
                    chunk_size: int = 128,
                    use_rules: bool = True,
                    l2_norm_clip: Optional[float] = None) -> GradientResult:
  """Per-example gradients of a Keras model in one batched pass.

  Each example's gradient is the gradient of its loss through the very
  forward pass that produced the loss (the same dropout masks). An example
  whose gradient is not finite is dropped (zeroed) before anything else sees
  it and counted in `dropped_records`.

  Args:
    model: a Keras model whose layers treat examples independently.
    inputs: the batch's inputs.
    per_example_loss: maps the model's outputs to the `[B]` loss vector (with
      any sample weights applied).
    var_list: the variables to differentiate, usually
      `model.trainable_variables`.
    chunk_size: examples per `tf.vectorized_map` call of the fallback (and
      rows per pass of a random layer's Jacobian).
    use_rules: False sends every layer to the fallback (for tests and
      benchmarks).
    l2_norm_clip: if given, fast clipping: compute each example's global
      gradient norm layer by layer (without materializing the gradient where
      a rule knows the norm, as for Dense, unless another layer call also
      reads the variable), then the clipped sum (layers with such norms: by
      backpropagating their factor-weighted output gradients to their own
      weights; others: by contracting their materialized gradients with the
      factors), and return it as `clipped_sum`.

  Returns:
    A `GradientResult`. Gradients exclude `model.losses`, whose gradient is
    returned separately.

  Raises:
    ValueError: if a term of `model.losses` depends on the inputs, or a
      variable of `var_list` is read outside the model's layer calls (e.g. by
      the loss).
  """
  inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
  with tf.GradientTape(persistent=True) as tape:
    recorder = _Recorder(tape, use_rules, var_list)
    outputs = recorder.run(model, inputs)
    with tf.GradientTape() as loss_tape:
      losses = per_example_loss(outputs)
    recorder.read_outside(loss_tape.watched_variables())
    total = tf.reduce_sum(losses)
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
    random, dependent = _traced_analysis(model, inputs, use_rules, var_list)
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

  regularization_grads = None
  if regularization is not None:
    regularization_grads = tape.gradient(
        regularization, list(var_list),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)

  taps = [tap for _, _, _, tap in recorder.rule_calls]
  fallback_outputs = [call.outputs for call in recorder.fallback_calls]
  grads = tape.gradient(total, [taps, fallback_outputs],
                        unconnected_gradients=tf.UnconnectedGradients.ZERO)
  units = [
      _rule_unit(tape, layer, rule, layer_inputs, tap, tap_grad)
      for (layer, rule, layer_inputs, tap), tap_grad in zip(
          recorder.rule_calls, grads[0])
  ] + [
      _fallback_unit(call, out_grads, chunk_size, draws)
      for call, out_grads, draws in zip(recorder.fallback_calls, grads[1],
                                        random)
  ]
  batch = tf.shape(losses)[0]
  wanted = {v.ref() for v in var_list}

  if l2_norm_clip is not None:
    shared = _shared(units)
    ghosts, materialized = [], {}
    squares = [tf.zeros([batch])]
    for unit in units:
      pairs = None
      if unit.weighted_sum and not any(v.ref() in shared
                                       for v in unit.variables):
        pairs = unit.sq_norms()
      if pairs is None:
        _add_grads(materialized, unit.grads())
      else:
        ghosts.append(unit)
        squares.extend(sq for v, sq in pairs if v.ref() in wanted)
    squares.extend(clipping.squared_norm(g)
                   for ref, (_, g) in materialized.items() if ref in wanted)
    squares = tf.add_n(squares)
    keep = tf.math.is_finite(squares)
    factors = tf.where(keep, clipping.clip_factor(tf.sqrt(squares),
                                                  l2_norm_clip), 0.0)
    all_kept = tf.reduce_all(keep)

    def kept(g):  # A copy only in a step that drops a record.
      return tf.cond(all_kept, lambda: g, lambda: clipping.zero_rows(g, keep))

    sums = {ref: tf.tensordot(tf.cast(factors, g.dtype), kept(g), axes=1)
            for ref, (_, g) in materialized.items()}
    for unit in ghosts:
      sums.update((v.ref(), g) for v, g in unit.weighted_sum(factors, keep))
    del tape
    clipped_sum = [sums[v.ref()] if v.ref() in sums else tf.zeros_like(v)
                   for v in var_list]
    dropped = tf.reduce_sum(tf.cast(tf.logical_not(keep), tf.int32))
    return GradientResult(None, clipped_sum, outputs, losses, regularization,
                          regularization_grads, dropped)

  sums = {}
  for unit in units:
    _add_grads(sums, unit.grads())
  del tape
  per_example_grads = [
      sums[v.ref()][1] if v.ref() in sums else
      tf.zeros(tf.concat([[batch], tf.shape(v)], 0), v.dtype)
      for v in var_list
  ]
  per_example_grads, dropped = clipping.drop_nonfinite(per_example_grads)
  return GradientResult(per_example_grads, None, outputs, losses,
                        regularization, regularization_grads, dropped)


def microbatch_means(per_example_grads: Sequence[tf.Tensor],
                     num_microbatches: Optional[int]) -> List[tf.Tensor]:
  """Per-record gradients: each example's, or each microbatch's mean.

  The gradient of a microbatch's mean loss (`record_losses`) is the mean of
  its examples' gradients.
  """
  if not num_microbatches:
    return list(per_example_grads)
  return [
      tf.reduce_mean(
          tf.reshape(g, tf.concat([[num_microbatches, -1], tf.shape(g)[1:]],
                                  0)), axis=1) for g in per_example_grads
  ]


def public_gradients(model: tf.keras.Model, inputs: Any, targets: Any,
                     per_example_loss: Callable[[Any, Any], tf.Tensor],
                     var_list: Sequence[tf.Variable],
                     chunk_size: int,
                     use_rules: bool = True) -> List[tf.Tensor]:
  """Per-example gradients of public examples, computed in chunks.

  Args:
    model: the model.
    inputs: the public inputs (all of them).
    targets: the public targets.
    per_example_loss: `per_example_loss(targets, outputs) -> [B]`.
    var_list: the variables to differentiate.
    chunk_size: public examples per pass of the engine.
    use_rules: as in `model_gradients`.

  Returns:
    One `[num_public, *var.shape]` tensor per variable. Never clipped or
    noised: public data costs no privacy.
  """
  structure = (inputs, targets)
  flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]

  def chunk_grads(chunk):
    chunk_inputs, chunk_targets = tf.nest.pack_sequence_as(structure, chunk)
    result = model_gradients(
        model, chunk_inputs,
        lambda outputs: per_example_loss(chunk_targets, outputs), var_list,
        chunk_size, use_rules)
    return result.per_example_grads

  signature = [tf.TensorSpec(v.shape, v.dtype) for v in var_list]
  return chunked(chunk_grads, flat, chunk_size, signature)
