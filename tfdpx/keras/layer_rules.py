"""Per-layer rules: each example's share of the gradients from one batched pass.

A rule knows the mathematics of one Keras layer type. During the batched
forward pass it returns the layer's output and a *tap*: the tensor whose
gradient (one row per example) determines the layer's weight gradients, e.g.
the pre-activation output of a Dense layer. After one batched backward pass to
the taps, the rule turns the layer's input and the tap's gradient into a
*unit* (`tfdpx.forms`): the per-example statistics of that call's share of the
gradients, by the cheapest exact form of its family (Dense and convolutions:
`tfdpx.forms.dense`; Embedding: `tfdpx.forms.embedding`; normalization layers:
their small per-example gradients, `tfdpx.forms.materialized`). This is how
Opacus's hooks and ghost clipping work, done without hooks.

The registry is keyed by the exact layer class, so a subclass (Conv2DTranspose
is a Conv2D subclass) never inherits a rule that does not fit its `call`. Add a
rule for your own layer with `register(MyLayer, LayerRule(forward, grads))`:
`grads` gives a chunk's per-example gradients, from which every statistic is
reduced chunk by chunk; a rule may give a `unit` instead, with cheaper forms.
"""

import dataclasses
import math
import string
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import tensorflow as tf

from tfdpx import clipping
from tfdpx import per_example
from tfdpx.forms import dense as dense_forms
from tfdpx.forms import embedding as embedding_forms
from tfdpx.forms import materialized as materialized_forms
from tfdpx.forms import unit as unit_lib
from tfdpx.keras.stack import keras_version

_key = per_example.variable_key

Grads = List[Tuple[tf.Variable, tf.Tensor]]


class RuleCall(NamedTuple):
  """What one recorded call of a layer with a rule gives its unit.

  Attributes:
    layer: the layer.
    inputs: its input `[B, ...]`.
    tap: the tap the rule's `forward` returned (recorded on `tape`).
    tap_grad: the gradient of the summed loss with respect to `tap`.
    tape: the persistent tape of the forward pass.
    chunk_size: examples per chunk where per-example gradients are formed.
    expected_batch_size: the batch size to plan forms for where the static
      one is unknown, or None.
    saved: what the rule's `forward` saved for its units, or None.
  """
  layer: tf.keras.layers.Layer
  inputs: tf.Tensor
  tap: tf.Tensor
  tap_grad: tf.Tensor
  tape: tf.GradientTape
  chunk_size: int
  expected_batch_size: Optional[int] = None
  saved: Any = None


@dataclasses.dataclass(frozen=True)
class LayerRule:
  """How to get the per-example statistics of one layer type.

  Attributes:
    forward: `forward(layer, inputs) -> (outputs, tap)`; `outputs` must equal
      `layer(inputs)`, and `tap` is an intermediate tensor of shape `[B, ...]`
      (or a tuple of them) from which the weights' gradients follow. It may
      return a third value, saved for `unit` (`RuleCall.saved`).
    grads: `grads(layer, inputs, tap_grad) -> [(variable, [B, *var.shape])]`,
      given (a chunk of) the layer's input and the gradient of the summed
      loss with respect to `tap`. Variables it omits get no gradient from
      this call. Every statistic is reduced from these, chunk by chunk.
    supports: `supports(layer, inputs) -> bool`; when False this call goes
      to the vectorized fallback instead (an unusual configuration or input).
    unit: optional `unit(call: RuleCall)` with cheaper exact forms: a
      `tfdpx.forms.unit.Unit`, or a list of units of disjoint variables that
      together cover the layer's trainable weights; used instead of `grads`
      when given.
    form: how the rule's statistics are formed, in a few words, for
      `tfdpx.keras.describe`.
    keywords: keyword arguments of the layer's call that the rule takes
      (`forward(layer, inputs, **keywords)`); a call with any other
      (not None) keyword takes the fallback.
  """
  forward: Callable[[tf.keras.layers.Layer, tf.Tensor],
                    Tuple[tf.Tensor, tf.Tensor]]
  grads: Optional[Callable[[tf.keras.layers.Layer, tf.Tensor, tf.Tensor],
                           Grads]] = None
  supports: Callable[[tf.keras.layers.Layer, tf.Tensor],
                     bool] = lambda layer, inputs: True
  unit: Optional[Callable[[RuleCall], Union[unit_lib.Unit,
                                            List[unit_lib.Unit]]]] = None
  form: str = 'rule: per-example gradients formed in chunks'
  keywords: Tuple[str, ...] = ()

  def __post_init__(self):
    if self.grads is None and self.unit is None:
      raise ValueError('a LayerRule needs grads or unit')

  def make_units(self, call: RuleCall) -> List[unit_lib.Unit]:
    """The units of one recorded call."""
    if self.unit is not None:
      units = self.unit(call)
      return list(units) if isinstance(units, (list, tuple)) else [units]
    variables = keras_version.tf_variables(call.layer.trainable_weights)

    def grads_of(chunk):
      inputs, tap_grad = chunk
      given = {_key(v): g for v, g in self.grads(call.layer, inputs,
                                                 tap_grad)}
      return [tf.convert_to_tensor(given[_key(v)]) if _key(v) in given else
              tf.zeros(tf.concat([tf.shape(tap_grad)[:1], v.shape], 0),
                       v.dtype) for v in variables]

    return [materialized_forms.MaterializedUnit(
        variables, grads_of, [call.inputs, call.tap_grad], call.chunk_size,
        expected_batch_size=call.expected_batch_size)]


_RULES: Dict[type, LayerRule] = {}


def register(layer_class: type, rule: LayerRule) -> None:
  """Registers `rule` for layers whose class is exactly `layer_class`."""
  if not (isinstance(layer_class, type) and
          issubclass(layer_class, tf.keras.layers.Layer)):
    raise ValueError(
        f'layer_class must be a Keras layer class, got {layer_class!r}')
  _RULES[layer_class] = rule


# Rules of classes tfdpx does not import, by module and name.
_NAMED_RULES: Dict[str, LayerRule] = {}


def registered(layer: tf.keras.layers.Layer) -> Optional[LayerRule]:
  """The rule registered for `layer`'s exact class, or None."""
  cls = type(layer)
  return _RULES.get(cls) or _NAMED_RULES.get(
      f'{cls.__module__}.{cls.__qualname__}')


def lookup(layer: tf.keras.layers.Layer, inputs) -> Optional[LayerRule]:
  """The rule for calling `layer` on `inputs`, or None (use the fallback)."""
  rule = registered(layer)
  if (rule is None or not layer.built or not isinstance(inputs, tf.Tensor) or
      not rule.supports(layer, inputs)):
    return None
  return rule


def _called_normally(layer, inputs):
  """Forward of a layer whose output is its own tap (no activation)."""
  outputs = layer(inputs)
  return outputs, outputs


# --- Dense -------------------------------------------------------------------


def _dense_forward(layer, inputs):
  # Dense.call without its activation, so that the pre-activation is the tap.
  dtype = layer.compute_dtype
  inputs = tf.cast(inputs, dtype)
  kernel = tf.cast(layer.kernel, dtype)
  rank = inputs.shape.rank
  if rank == 2:
    pre = tf.matmul(inputs, kernel)
  else:
    pre = tf.tensordot(inputs, kernel, [[rank - 1], [0]])
    pre.set_shape(inputs.shape[:-1].concatenate(kernel.shape[-1:]))
  if layer.use_bias:
    pre = tf.nn.bias_add(pre, tf.cast(layer.bias, dtype))
  return layer.activation(pre), pre


def _as_rows(tensor: tf.Tensor, width: int) -> tf.Tensor:
  """`[B, ...]` as `[B, T, width]`, T positions of `width` entries.

  `T` stays static when the batch size is not (`tf.data ... .batch(B)`,
  Keras's numpy adapter): the forms are chosen from it (`tfdpx.forms.dense`).
  """
  size = tensor.shape[1:].num_elements()
  if size:  # A constant shape: two graph ops, not nine.
    return tf.reshape(tensor, [-1, size // width, width])
  rows = tf.reshape(tensor, [tf.shape(tensor)[0], -1, width])
  rows.set_shape([tensor.shape[0], None, width])
  return rows


def _sequence_rows(tensor: tf.Tensor) -> tf.Tensor:
  """`[B, ..., n]` as `[B, T, n]`: a Dense layer acts on each position."""
  return _as_rows(tensor, tensor.shape[-1])


def _trainable(variable) -> bool:
  return variable is not None and variable.trainable


def _bias_unit(bias, tap_rows: tf.Tensor) -> unit_lib.Unit:
  """A bias alone (its kernel frozen): gradient `sum_t D_i[t]`, small."""
  return materialized_forms.MaterializedUnit(
      [bias], lambda elems: [tf.reshape(tf.reduce_sum(elems[0], axis=1),
                                        [-1, *bias.shape])],
      [tap_rows], chunk_size=None)


def _product_units(call: RuleCall, rows_of, tap_rows: tf.Tensor,
                   free_shape) -> List[unit_lib.Unit]:
  """The units of a layer whose pre-activation is `A K + b` per position.

  `rows_of(inputs)` lays a batch of inputs out as `A` (`[B, T, p]`) and
  `tap_rows` is the pre-activation's gradient as `D` (`[B, T, o]`), o the
  product of `free_shape`, the kernel's output axes. Only trainable weights
  get a unit: a frozen kernel costs nothing per example.

  Keras 3's LoRA (`enable_lora`): `K = W + s a b`, with `a` the kernel's
  shape up to its last axis, then the rank r, and `b` `[r, e]` (e the last
  output axis, q the product of the others): b's gradient is a product over
  `T q` positions of `s A a` (`[T q, r]`) and `D` (`[T q, e]`), a's one of
  `A` and `s D b^T` (`[T, q r]`). Nothing of size p o per example.
  """
  layer = call.layer
  bias = layer.bias if _trainable(layer.bias) else None
  inputs = [call.inputs]
  if not getattr(layer, 'lora_enabled', False):
    if _trainable(layer.kernel):
      return [dense_forms.ProductUnit(
          layer.kernel, bias, lambda elems: rows_of(elems[0]), inputs,
          tap_rows, call.chunk_size)]
    return [_bias_unit(bias, tap_rows)] if bias is not None else []
  scale = layer.lora_alpha / layer.lora_rank
  a, b = layer.lora_kernel_a, layer.lora_kernel_b
  e, rank = b.shape[-1], b.shape[0]
  p = a.shape.num_elements() // (rank * math.prod(free_shape[:-1]))

  def lora_rows(elems):  # s A a, [B, T q, r].
    rows = tf.cast(rows_of(elems[0]), tf.float32)
    return _as_rows(scale * tf.matmul(
        rows, tf.reshape(tf.cast(a, tf.float32), [p, -1])), rank)

  d = tf.cast(tap_rows, tf.float32)
  units = []
  if _trainable(layer._kernel):  # pylint: disable=protected-access
    units.append(dense_forms.ProductUnit(
        layer._kernel, None, lambda elems: rows_of(elems[0]), inputs,  # pylint: disable=protected-access
        tap_rows, call.chunk_size))
  if _trainable(a):
    back = scale * tf.matmul(_as_rows(d, e), tf.cast(b, tf.float32),
                             transpose_b=True)  # s D b^T, [B, T q, r]
    units.append(dense_forms.ProductUnit(
        a, None, lambda elems: rows_of(elems[0]), inputs,
        _as_rows(back, d.shape[-1] // e * rank), call.chunk_size))
  if _trainable(b):
    units.append(dense_forms.ProductUnit(b, None, lora_rows, inputs,
                                         _as_rows(d, e), call.chunk_size))
  if bias is not None:
    units.append(_bias_unit(bias, tap_rows))
  return units


def _dense_units(call: RuleCall) -> List[unit_lib.Unit]:
  return _product_units(call, _sequence_rows, _sequence_rows(call.tap_grad),
                        [call.layer.units])


def _backward_weighted_sum(call: RuleCall, forward):
  """`weighted_sum(weights, keep)` by one weighted backward pass of the call.

  Row b of the tap gradient belongs to example b alone, so backpropagating
  the weighted tap gradient to the layer's own weights (through its own ops
  only) gives the weighted sum without any per-example gradient.
  """
  variables = keras_version.tf_variables(call.layer.trainable_weights)

  def weighted_sum(weights, keep):
    weighted = unit_lib.weighted_rows(call.tap_grad, weights, keep)
    recorded = call.tape.gradient(
        call.tap, variables, output_gradients=weighted,
        unconnected_gradients=tf.UnconnectedGradients.ZERO)

    def without_dropped_inputs():
      # A dropped example's non-finite input times its zero weight is NaN in
      # the recorded product over the batch: recompute the tap without it.
      with tf.GradientTape() as kept:
        _, kept_tap = forward(call.layer,
                              clipping.zero_rows(call.inputs, keep))
      return kept.gradient(kept_tap, variables, output_gradients=weighted,
                           unconnected_gradients=tf.UnconnectedGradients.ZERO)

    return tf.cond(tf.reduce_all(keep), lambda: recorded,
                   without_dropped_inputs)

  return weighted_sum


# --- Conv1D / Conv2D ---------------------------------------------------------


def _conv_supports(layer, inputs):
  # Grouped, channels-first, extra-batch-dim and (Keras 3) LoRA convolutions
  # take the fallback.
  return (layer.groups == 1 and layer.data_format == 'channels_last' and
          inputs.shape.rank == layer.rank + 2 and
          not getattr(layer, 'lora_enabled', False))


def _conv_pad(layer, inputs):
  if layer.padding == 'causal':
    left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
    inputs = tf.pad(inputs, [[0, 0], [left, 0], [0, 0]])
  return inputs


def _conv_forward(layer, inputs):
  # Conv.call (groups == 1, channels_last) without its activation.
  dtype = layer.compute_dtype
  inputs = tf.cast(inputs, dtype)
  # tf.nn.convolution, not layer.convolution_op: Keras 3's passes 'causal'
  # on, where the padding was already done.
  pre = tf.nn.convolution(
      _conv_pad(layer, inputs), tf.cast(layer.kernel, dtype),
      strides=list(layer.strides),
      padding='SAME' if layer.padding == 'same' else 'VALID',
      dilations=list(layer.dilation_rate))
  if layer.use_bias:
    pre = tf.nn.bias_add(pre, tf.cast(layer.bias, dtype))
  return layer.activation(pre), pre


def _onednn() -> bool:
  """Whether TensorFlow runs its oneDNN kernels in this process (decided at
  start-up: the CPU, `TF_ENABLE_ONEDNN_OPTS`)."""
  try:
    from tensorflow.python.util import _pywrap_util_port  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  return bool(_pywrap_util_port.IsMklEnabled())


def _depthwise_patches(layer) -> bool:
  """Whether `_conv_patches` extracts the patches by a depthwise convolution.

  With oneDNN, a depthwise convolution with one-hot kernels extracts them
  (each output channel is one tap of one input channel), as exactly as
  `tf.image.extract_patches` and up to 3.5 times faster. Without oneDNN it is
  the other way round (TensorFlow's own depthwise kernel: 1.8 to 2.3 times
  slower on the tutorial CNN's two layers), and that kernel (CPU, GPU)
  refuses unequal strides: those and every convolution without oneDNN take
  `tf.image.extract_patches`.
  """
  # A 1-D convolution is a 2-D one of height 1 with equal strides (below).
  return (layer.rank == 1 or layer.strides[0] == layer.strides[1]) and _onednn()


def _patch_rows(layer, channels: int) -> List[int]:
  """The kernel row (of its flattened input axes: taps, then channels) of
  each column of `_conv_patches`."""
  taps = math.prod(layer.kernel_size)
  if not _depthwise_patches(layer):  # Already in that order.
    return list(range(taps * channels))
  return [tap * channels + channel for channel in range(channels)
          for tap in range(taps)]


def _conv_patches(layer, inputs):
  """The input patches of each output position, `[B, T, p]`.

  `p` is the kernel volume times the input channels: in the order of the
  kernel's first axes from `tf.image.extract_patches`, so the kernel
  gradient of example `i` is `patches_i^T D_i` reshaped to the kernel's
  shape; channel by channel from a depthwise convolution
  (`_depthwise_patches`), whose columns `_patch_rows` orders (the per-example
  products are put in order, not the larger patches).
  """
  padding = 'SAME' if layer.padding == 'same' else 'VALID'
  if layer.rank == 1:  # A 1-D convolution is a 2-D one of height 1,
    inputs = inputs[:, tf.newaxis]
    size = [1, layer.kernel_size[0]]
    # whose one output row any stride along the height keeps: equal strides.
    strides = [1, layer.strides[0], layer.strides[0], 1]
    dilations = [1, layer.dilation_rate[0]]
  else:
    size = list(layer.kernel_size)
    strides = [1, *layer.strides, 1]
    dilations = list(layer.dilation_rate)
  taps = size[0] * size[1]
  if _depthwise_patches(layer):
    one_hot = tf.reshape(tf.eye(taps, dtype=inputs.dtype), [*size, 1, taps])
    patches = tf.nn.depthwise_conv2d(
        inputs, tf.tile(one_hot, [1, 1, inputs.shape[-1], 1]),
        strides=strides, padding=padding,
        dilations=dilations)  # [B, H, W, channels * taps]
  else:  # Already in kernel order: [B, H, W, taps * channels].
    patches = tf.image.extract_patches(
        inputs, sizes=[1, *size, 1], strides=strides,
        rates=[1, *dilations, 1], padding=padding)
  return _sequence_rows(patches)


def half_precision(dtype) -> bool:
  """Whether `dtype` is a 16-bit float (a mixed precision compute dtype)."""
  return tf.as_dtype(dtype) in (tf.bfloat16, tf.float16)


def _conv_unit(call: RuleCall) -> List[unit_lib.Unit]:
  layer = call.layer
  bias = layer.bias if layer.use_bias and _trainable(layer.bias) else None
  if not _trainable(layer.kernel):  # Frozen: the bias alone, if trainable.
    return ([_bias_unit(bias, _sequence_rows(call.tap_grad))]
            if bias is not None else [])
  # Under mixed precision the layer's own backward pass would sum in 16
  # bits; the patch form sums the float32 values the norms come from.
  backward = (None if half_precision(call.tap.dtype) else
              _backward_weighted_sum(call, _conv_forward))
  return [dense_forms.ProductUnit(
      layer.kernel, bias, lambda elems: _conv_patches(layer, elems[0]),
      [_conv_pad(layer, call.inputs)], _sequence_rows(call.tap_grad),
      call.chunk_size, backward,
      patch_rows=_patch_rows(layer, call.inputs.shape[-1]))]


# --- EinsumDense --------------------------------------------------------------


class _EinsumAxes(NamedTuple):
  """An EinsumDense equation read as a Dense layer on sequences.

  The kernel gradient of example i is `A_i^T D_i`, with `A_i` its input laid
  out as `[positions, contracted]` and `D_i` its output gradient as
  `[positions, free]`. Attributes are the letters of the equation (`...`
  spelled out): `inputs`, `outputs` of the operands; `positions` in the input
  and the output only (besides the batch, `inputs[0]`), in input order;
  `contracted` in the input and the kernel, in kernel order; `free` in the
  kernel and the output, in kernel order.
  """
  inputs: str
  outputs: str
  positions: str
  contracted: str
  free: str


def _einsum_axes(layer, inputs) -> Optional[_EinsumAxes]:
  """`layer.equation` as `_EinsumAxes`, or None if it is not of that form.

  Not of that form: a letter repeated in an operand, an output that does not
  start with the batch, an input letter summed away or shared by all three
  operands, a kernel whose free letters are not all after its contracted
  ones, or a bias over other than the free letters.
  """
  equation = layer.equation.replace(' ', '')
  operands, outputs = equation.split('->')
  x, kernel = operands.split(',')
  if '...' in x:
    spelled = ''.join(c for c in string.ascii_letters if c not in equation)
    spelled = spelled[:inputs.shape.rank - (len(x) - 3)]
    x, outputs = x.replace('...', spelled), outputs.replace('...', spelled)
  if ('...' in kernel or len(x) != inputs.shape.rank or
      any(len(set(s)) != len(s) for s in (x, kernel, outputs))):
    return None
  batch = x[0]
  positions = ''.join(c for c in x[1:] if c in outputs and c not in kernel)
  contracted = ''.join(c for c in kernel if c in x and c not in outputs)
  free = ''.join(c for c in kernel if c in outputs and c not in x)
  bias_axes = ''.join(c for c in outputs if c in (layer.bias_axes or ''))
  if (batch in kernel or outputs[0] != batch or not contracted or
      len(x) != 1 + len(positions) + len(contracted) or
      kernel != contracted + free or
      len(outputs) != 1 + len(positions) + len(free) or
      (layer.bias is not None and
       (bias_axes != free or not outputs.endswith(free)))):
    return None
  return _EinsumAxes(x, outputs, positions, contracted, free)


def _not_quantized(layer, inputs):
  # Keras 3's quantized kernels have no float per-example gradient.
  del inputs
  return getattr(layer, 'quantization_mode', None) is None


def _einsum_supports(layer, inputs):
  axes = _einsum_axes(layer, inputs)
  # LoRA's b spans the kernel's last axis, which must be an output axis.
  return (_not_quantized(layer, inputs) and axes is not None and
          (axes.free or not getattr(layer, 'lora_enabled', False)))


def _einsum_forward(layer, inputs):
  # EinsumDense.call without its activation, so that the output is the tap.
  dtype = layer.compute_dtype
  pre = tf.einsum(layer.equation, tf.cast(inputs, dtype),
                  tf.cast(layer.kernel, dtype))
  if layer.bias is not None:
    pre = pre + tf.cast(layer.bias, dtype)
  return layer.activation(pre), pre


def _letter_rows(tensor: tf.Tensor, letters: str, positions: str,
                 last: str) -> tf.Tensor:
  """`tensor` (axes `letters`, batch first) as `[B, T, n]`.

  `T` runs over the axes `positions`, `n` over the axes `last`, each in that
  order; like `_sequence_rows`, `T` stays static when the batch size is not.
  """
  order = [0] + [letters.index(c) for c in positions + last]
  if order != list(range(len(letters))):
    tensor = tf.transpose(tensor, order)
  return _as_rows(tensor, tensor.shape[1 + len(positions):].num_elements())


def _einsum_units(call: RuleCall) -> List[unit_lib.Unit]:
  layer = call.layer
  axes = _einsum_axes(layer, call.inputs)
  kernel_shape = (layer._kernel if getattr(layer, 'lora_enabled', False)  # pylint: disable=protected-access
                  else layer.kernel).shape
  return _product_units(
      call,
      lambda x: _letter_rows(x, axes.inputs, axes.positions, axes.contracted),
      _letter_rows(call.tap_grad, axes.outputs, axes.positions, axes.free),
      kernel_shape[len(axes.contracted):])


# --- Embedding ---------------------------------------------------------------


def _embedding_unit(call: RuleCall) -> unit_lib.Unit:
  return embedding_forms.EmbeddingUnit(call.layer.embeddings, call.inputs,
                                       call.tap_grad)


def _embedding_supports(layer, inputs):
  del inputs
  # Keras 3 has no sparse embeddings; its LoRA ones take the fallback.
  return not (getattr(layer, 'sparse', False) or
              getattr(layer, 'lora_enabled', False))


def _reversible_forward(layer, inputs, reverse=False):
  """A ReversibleEmbedding's lookup, or (`reverse`) its tied output logits
  `h E^T`, whose tap is the logits before any soft cap."""
  if not reverse:
    outputs = layer(inputs)
    return outputs, outputs, False
  dtype = layer.compute_dtype
  logits = tf.matmul(tf.cast(inputs, dtype), tf.cast(layer.embeddings, dtype),
                     transpose_b=True)
  outputs = logits
  if layer.logit_soft_cap is not None:
    cap = layer.logit_soft_cap
    outputs = tf.tanh(logits / cap) * cap
  return outputs, logits, True


def _reversible_supports(layer, inputs):
  # Untied output embeddings (a kernel of their own) take the fallback.
  return (_embedding_supports(layer, inputs) and layer.tie_weights and
          getattr(layer, 'reverse_dtype', None) is None)


def _reversible_unit(call: RuleCall) -> unit_lib.Unit:
  if not call.saved:
    return _embedding_unit(call)
  # The logits' kernel is E^T: its gradient `A_i^T D_i` transposed is
  # `D_i^T A_i`, a product with the roles of the input and the tap's
  # gradient exchanged.
  return dense_forms.ProductUnit(
      call.layer.embeddings, None, lambda elems: _sequence_rows(elems[0]),
      [call.tap_grad], _sequence_rows(call.inputs), call.chunk_size)


# --- LayerNormalization / GroupNormalization ---------------------------------


def _affine_grads(layer, normalized, tap_grad, param_axes):
  """Per-example gradients of gamma and beta of `gamma * normalized + beta`.

  `param_axes` are the input axes that gamma and beta span, in their order.
  """
  rank = tap_grad.shape.rank
  others = [a for a in range(1, rank) if a not in param_axes]
  order = sorted(param_axes)
  perm = [0] + [1 + order.index(a) for a in param_axes]
  grads = []
  if layer.scale:
    gamma = tf.reduce_sum(normalized * tap_grad, axis=others)
    grads.append((layer.gamma, tf.transpose(gamma, perm)))
  if layer.center:
    beta = tf.reduce_sum(tap_grad, axis=others)
    grads.append((layer.beta, tf.transpose(beta, perm)))
  return [(v, tf.reshape(g, [-1, *v.shape])) for v, g in grads]


def _layer_norm_axes(layer, inputs):
  # Keras 3 keeps negative axes.
  return [a % inputs.shape.rank for a in layer.axis]


def _layer_norm_grads(layer, inputs, tap_grad):
  x = tf.cast(inputs, tf.float32)
  axes = _layer_norm_axes(layer, inputs)
  mean, variance = tf.nn.moments(x, axes, keepdims=True)
  normalized = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
  return _affine_grads(layer, tf.cast(normalized, tap_grad.dtype), tap_grad,
                       axes)


def _layer_norm_supports(layer, inputs):
  # Normalizing over the batch mixes examples; Keras 3's RMS scaling has no
  # mean and no beta.
  return (0 not in _layer_norm_axes(layer, inputs) and
          not getattr(layer, 'rms_scaling', False))


def _group_axis(layer, inputs):
  return layer.axis % inputs.shape.rank


def _group_norm_grads(layer, inputs, tap_grad):
  x = tf.cast(inputs, tf.float32)
  grouped = layer._reshape_into_groups(x)  # pylint: disable=protected-access
  group_axis = _group_axis(layer, inputs)  # Where the groups axis lands.
  axes = [a for a in range(1, grouped.shape.rank) if a != group_axis]
  mean, variance = tf.nn.moments(grouped, axes, keepdims=True)
  normalized = (grouped - mean) * tf.math.rsqrt(variance + layer.epsilon)
  normalized = tf.reshape(normalized, tf.shape(x))
  return _affine_grads(layer, tf.cast(normalized, tap_grad.dtype), tap_grad,
                       [group_axis])


def _group_norm_supports(layer, inputs):
  # A masked call uses masked moments: the fallback handles it.
  return (_group_axis(layer, inputs) != 0 and
          getattr(inputs, '_keras_mask', None) is None)


_PRODUCT = 'ghost norms or per-example kernels (tfdpx.forms.dense)'
_SMALL = 'small per-example gradients (tfdpx.forms.materialized)'

register(tf.keras.layers.Dense,
         LayerRule(_dense_forward, supports=_not_quantized, unit=_dense_units,
                   form=_PRODUCT))
register(tf.keras.layers.Conv1D,
         LayerRule(_conv_forward, supports=_conv_supports, unit=_conv_unit,
                   form=_PRODUCT + ' over patches'))
register(tf.keras.layers.Conv2D,
         LayerRule(_conv_forward, supports=_conv_supports, unit=_conv_unit,
                   form=_PRODUCT + ' over patches'))
register(tf.keras.layers.EinsumDense,
         LayerRule(_einsum_forward, supports=_einsum_supports,
                   unit=_einsum_units, form=_PRODUCT))
register(tf.keras.layers.Embedding,
         LayerRule(_called_normally, supports=_embedding_supports,
                   unit=_embedding_unit,
                   form='segment sums over the ids present '
                   '(tfdpx.forms.embedding)'))
_REVERSIBLE = LayerRule(
    _reversible_forward, supports=_reversible_supports, unit=_reversible_unit,
    form='segment sums over the ids present, or (reverse) ' + _PRODUCT,
    keywords=('reverse',))
if hasattr(tf.keras.layers, 'ReversibleEmbedding'):  # Keras 3.
  register(tf.keras.layers.ReversibleEmbedding, _REVERSIBLE)
# keras-hub's subclass of it.
_NAMED_RULES['keras_hub.src.layers.modeling.reversible_embedding.'
             'ReversibleEmbedding'] = _REVERSIBLE
register(tf.keras.layers.LayerNormalization,
         LayerRule(_called_normally, _layer_norm_grads, _layer_norm_supports,
                   form=_SMALL))
register(tf.keras.layers.GroupNormalization,
         LayerRule(_called_normally, _group_norm_grads, _group_norm_supports,
                   form=_SMALL))
