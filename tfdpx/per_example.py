"""Per-example gradient engines.

The compile-path engine (`jacobian`) is the one tensorflow-privacy's
vectorized optimizers use: the Jacobian of the per-example (or
per-microbatch) loss vector with respect to every trainable variable. It is
correct for any Keras model; its cost grows with the square of the batch.

The engine of models made private (`model_gradients`) costs one batched
forward and one batched backward pass plus, per layer, a rule
(`tfdpx.layer_rules`) or a chunked `tf.vectorized_map` fallback: linear in the
batch. See docs/per_example.md.
"""

import logging
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
# One batched forward pass records, for every layer call that owns trainable
# weights, either a rule's tap (`tfdpx.layer_rules`) or the layer's outputs
# (the fallback). One batched backward pass of the summed loss then gives every
# tap's and every fallback output's gradient, one row per example; rules turn
# those rows into per-example weight gradients, and the fallback runs each
# example's backward pass through the layer alone with `tf.vectorized_map`, in
# chunks. A row only depends on its own example as long as no layer mixes the
# examples of a batch, which is why BatchNormalization is refused.


class GradientResult(NamedTuple):
  """What one pass of `model_gradients` computes.

  Attributes:
    per_example_grads: one `[B, *var.shape]` tensor per variable of `var_list`,
      or None when `clipped_sum` is given instead.
    clipped_sum: with fast clipping, one tensor per variable: the sum of the
      examples' gradients, each clipped to the global L2 norm asked for;
      otherwise None.
    outputs: the model's outputs on the batch (for metrics).
    losses: the `[B]` per-example losses.
    regularization_loss: the sum of `model.losses`, or None if there are none.
    regularization_grads: its gradient, one tensor per variable, or None.
  """
  per_example_grads: Optional[List[tf.Tensor]]
  clipped_sum: Optional[List[tf.Tensor]]
  outputs: Any
  losses: tf.Tensor
  regularization_loss: Optional[tf.Tensor]
  regularization_grads: Optional[List[tf.Tensor]]


def _is_graph_network(layer) -> bool:
  return (isinstance(layer, tf.keras.Model) and
          getattr(layer, '_is_graph_network', False))


def _is_float(tensor) -> bool:
  return tf.is_tensor(tensor) and tensor.dtype.is_floating


class _Recorder:
  """Runs a model layer by layer, recording what the backward pass needs."""

  def __init__(self, tape: tf.GradientTape, use_rules: bool):
    self.tape = tape
    self.use_rules = use_rules
    self.rule_calls = []  # (layer, rule, inputs, tap)
    self.fallback_calls = []  # (layer, args, kwargs, float outputs)
    self.activations = []  # Every float tensor computed from the data.

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
    if not layer.trainable_weights:
      outputs = layer(*args, **kwargs)
    else:
      rule = None
      if (self.use_rules and len(args) == 1 and
          set(kwargs) <= {'training', 'mask'}):
        rule = layer_rules.lookup(layer, args[0])
      if rule is not None:
        outputs, tap = rule.forward(layer, args[0])
        self.tape.watch(tap)
        mask = layer.compute_mask(args[0], getattr(args[0], '_keras_mask',
                                                   None))
        if mask is not None:
          outputs._keras_mask = mask  # pylint: disable=protected-access
        self.rule_calls.append((layer, rule, args[0], tap))
      else:
        outputs = layer(*args, **kwargs)
        float_outputs = [t for t in tf.nest.flatten(outputs) if _is_float(t)]
        self.tape.watch(float_outputs)
        self.fallback_calls.append((layer, args, kwargs, float_outputs))
    self.activations.extend(
        t for t in tf.nest.flatten(outputs) if _is_float(t))
    return outputs


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


def _fallback_grads(layer, args, kwargs, outputs, output_grads, chunk_size):
  """Per-example gradients of `layer.trainable_weights` by vectorized_map."""
  variables = layer.trainable_weights
  flat = tf.nest.flatten((args, kwargs))
  batched = [i for i, t in enumerate(flat)
             if tf.is_tensor(t) and t.shape.rank]
  del outputs  # Recomputed per example.

  def one_example(elems):
    example = list(flat)
    for i, tensor in zip(batched, elems):
      example[i] = tensor[tf.newaxis]
    grads_in = [g[tf.newaxis] for g in elems[len(batched):]]
    call_args, call_kwargs = tf.nest.pack_sequence_as((args, kwargs), example)
    with tf.GradientTape() as tape:
      out = layer(*call_args, **call_kwargs)
    targets = [t for t in tf.nest.flatten(out) if _is_float(t)]
    grads = tape.gradient(targets, variables, output_gradients=grads_in,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return [tf.convert_to_tensor(g) for g in grads]  # Embeddings: dense.

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


class _Unit(NamedTuple):
  """One layer call's share of the per-example gradients.

  `outputs` are the call's tap or outputs and `output_grads` their gradients
  from the batched backward pass; the variables' gradients follow from them.
  """
  variables: List[tf.Variable]
  outputs: List[tf.Tensor]
  output_grads: List[tf.Tensor]
  grads: Callable[[], List[Tuple[tf.Variable, tf.Tensor]]]
  sq_norms: Callable[[], Optional[List[Tuple[tf.Variable, tf.Tensor]]]]


def _rule_unit(layer, rule, inputs, tap, tap_grad) -> _Unit:
  def sq_norms():
    return rule.sq_norms(layer, inputs, tap_grad) if rule.sq_norms else None
  return _Unit(layer.trainable_weights, [tap], [tap_grad],
               lambda: rule.grads(layer, inputs, tap_grad), sq_norms)


def _fallback_unit(layer, args, kwargs, outputs, output_grads,
                   chunk_size) -> _Unit:
  return _Unit(
      layer.trainable_weights, outputs, output_grads,
      lambda: _fallback_grads(layer, args, kwargs, outputs, output_grads,
                              chunk_size), lambda: None)


def _weighted_sum(tape, unit: _Unit, factors: tf.Tensor):
  """`sum_b factors[b] * g_b` for the unit's per-example gradients `g_b`.

  Row b of an output gradient belongs to example b alone, so backpropagating
  the factor-weighted output gradients to the unit's own variables (only
  through the unit's own ops) gives the weighted sum without forming any
  per-example gradient.
  """
  weighted = [
      g * tf.reshape(tf.cast(factors, g.dtype), [-1] + [1] * (g.shape.rank - 1))
      for g in unit.output_grads
  ]
  grads = tape.gradient(unit.outputs, unit.variables,
                        output_gradients=weighted,
                        unconnected_gradients=tf.UnconnectedGradients.ZERO)
  return [(v, tf.convert_to_tensor(g))  # Embeddings: dense.
          for v, g in zip(unit.variables, grads)]


def _shares_variables(units: Sequence[_Unit]) -> bool:
  refs = [v.ref() for unit in units for v in unit.variables]
  return len(refs) != len(set(refs))


def model_gradients(model: tf.keras.Model, inputs: Any,
                    per_example_loss: Callable[[Any], tf.Tensor],
                    var_list: Sequence[tf.Variable],
                    chunk_size: int = 128,
                    use_rules: bool = True,
                    l2_norm_clip: Optional[float] = None) -> GradientResult:
  """Per-example gradients of a Keras model in one batched pass.

  Args:
    model: a Keras model whose layers treat examples independently.
    inputs: the batch's inputs.
    per_example_loss: maps the model's outputs to the `[B]` loss vector (with
      any sample weights applied).
    var_list: the variables to differentiate, usually
      `model.trainable_variables`.
    chunk_size: examples per `tf.vectorized_map` call of the fallback.
    use_rules: False sends every layer to the fallback (for tests and
      benchmarks).
    l2_norm_clip: if given, fast clipping: compute each example's global
      gradient norm layer by layer (without materializing the gradient where
      a rule knows the norm, as for Dense), then the clipped sum (layers with
      such norms: by backpropagating their factor-weighted output gradients
      to their own weights; others: by contracting their materialized
      gradients with the factors), and return it as `clipped_sum`. A model that uses one variable in several layer calls
      gets `per_example_grads` instead (the norm of a sum is not a sum of
      norms).

  Returns:
    A `GradientResult`. Gradients exclude `model.losses`, whose gradient is
    returned separately.

  Raises:
    ValueError: if a regularization loss depends on the data.
  """
  inputs = tf.nest.map_structure(tf.convert_to_tensor, inputs)
  with tf.GradientTape(persistent=True) as tape:
    recorder = _Recorder(tape, use_rules)
    float_inputs = [t for t in tf.nest.flatten(inputs) if _is_float(t)]
    tape.watch(float_inputs)
    outputs = recorder.run(model, inputs)
    losses = per_example_loss(outputs)
    total = tf.reduce_sum(losses)
    regularization = model.losses
    regularization = tf.add_n(regularization) if regularization else None

  regularization_grads = None
  if regularization is not None:
    links = tape.gradient(regularization, float_inputs + recorder.activations)
    if any(g is not None for g in links):
      raise ValueError(
          'a loss added with add_loss depends on the data. Models made '
          'private add the gradient of model.losses outside the clipped '
          'per-example sum, which is only private for data-independent terms '
          '(weight regularizers); put data-dependent terms into the loss.')
    regularization_grads = tape.gradient(
        regularization, list(var_list),
        unconnected_gradients=tf.UnconnectedGradients.ZERO)

  taps = [tap for _, _, _, tap in recorder.rule_calls]
  fallback_outputs = [o for _, _, _, o in recorder.fallback_calls]
  grads = tape.gradient(total, [taps, fallback_outputs],
                        unconnected_gradients=tf.UnconnectedGradients.ZERO)
  units = [
      _rule_unit(layer, rule, layer_inputs, tap, tap_grad)
      for (layer, rule, layer_inputs, tap), tap_grad in zip(
          recorder.rule_calls, grads[0])
  ] + [
      _fallback_unit(layer, args, kwargs, outs, out_grads, chunk_size)
      for (layer, args, kwargs, outs), out_grads in zip(
          recorder.fallback_calls, grads[1])
  ]
  batch = tf.shape(losses)[0]

  if l2_norm_clip is not None and not _shares_variables(units):
    wanted = {v.ref() for v in var_list}
    squares = [tf.zeros([batch])]
    materialized = {}  # Units without cheap norms: index -> gradients.
    for i, unit in enumerate(units):
      pairs = unit.sq_norms()
      if pairs is None:
        materialized[i] = unit.grads()
        pairs = [(v, clipping.squared_norm(g)) for v, g in materialized[i]]
      squares.extend(sq for v, sq in pairs if v.ref() in wanted)
    factors = clipping.clip_factor(tf.sqrt(tf.add_n(squares)), l2_norm_clip)
    sums = {}
    for i, unit in enumerate(units):
      if i in materialized:  # Already there: one contraction each.
        pairs = [(v, tf.tensordot(tf.cast(factors, g.dtype), g, axes=1))
                 for v, g in materialized[i]]
      else:
        pairs = _weighted_sum(tape, unit, factors)
      sums.update((v.ref(), g) for v, g in pairs)
    del tape
    clipped_sum = [sums[v.ref()] if v.ref() in sums else tf.zeros_like(v)
                   for v in var_list]
    return GradientResult(None, clipped_sum, outputs, losses, regularization,
                          regularization_grads)
  del tape

  sums = {}
  for unit in units:
    for variable, grad in unit.grads():
      key = variable.ref()
      grad = tf.cast(grad, variable.dtype)
      sums[key] = sums[key] + grad if key in sums else grad
  per_example_grads = [
      sums[v.ref()] if v.ref() in sums else
      tf.zeros(tf.concat([[batch], tf.shape(v)], 0), v.dtype)
      for v in var_list
  ]
  return GradientResult(per_example_grads, None, outputs, losses,
                        regularization, regularization_grads)


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
