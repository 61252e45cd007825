"""Per-layer rules: each example's weight gradient from one batched pass.

A rule knows the mathematics of one Keras layer type. During the batched
forward pass it returns the layer's output and a *tap*: the tensor whose
gradient (one row per example) determines the layer's weight gradients, e.g.
the pre-activation output of a Dense layer. After one batched backward pass to
the taps, the rule turns the layer's input and the tap's gradient into
per-example weight gradients `[B, *var.shape]` (Dense: an outer product by
`einsum`; convolutions: `tf.image.extract_patches` and `einsum`; Embedding: a
segment sum; normalization layers: the normalized input times the output
gradient). This is how Opacus's hooks work, done without hooks.

The registry is keyed by the exact layer class, so a subclass (Conv2DTranspose
is a Conv2D subclass) never inherits a rule that does not fit its `call`. Add a
rule for your own layer with `register(MyLayer, LayerRule(forward, grads))`.
"""

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

Grads = List[Tuple[tf.Variable, tf.Tensor]]


@dataclasses.dataclass(frozen=True)
class LayerRule:
  """How to get per-example weight gradients of one layer type.

  Attributes:
    forward: `forward(layer, inputs) -> (outputs, tap)`; `outputs` must equal
      `layer(inputs)`, and `tap` is an intermediate tensor of shape `[B, ...]`
      from which the weights' gradients follow.
    grads: `grads(layer, inputs, tap_grad) -> [(variable, [B, *var.shape])]`,
      given the layer's input and the gradient of the summed loss with respect
      to `tap`. Variables it omits get no gradient from this call.
    supports: `supports(layer, inputs) -> bool`; when False this call goes
      to the vectorized fallback instead (an unusual configuration or input).
    sq_norms: optional `sq_norms(layer, inputs, tap_grad) ->
      [(variable, [B])]`, each example's squared L2 norm of each variable's
      gradient computed without the gradient itself (fast clipping), or None
      where that is not cheaper; without it the norms come from `grads`.
  """
  forward: Callable[[tf.keras.layers.Layer, tf.Tensor],
                    Tuple[tf.Tensor, tf.Tensor]]
  grads: Callable[[tf.keras.layers.Layer, tf.Tensor, tf.Tensor], Grads]
  supports: Callable[[tf.keras.layers.Layer, tf.Tensor],
                     bool] = lambda layer, inputs: True
  sq_norms: Optional[Callable[[tf.keras.layers.Layer, tf.Tensor, tf.Tensor],
                              Optional[List[Tuple[tf.Variable,
                                                  tf.Tensor]]]]] = None


_RULES: Dict[type, LayerRule] = {}


def register(layer_class: type, rule: LayerRule) -> None:
  """Registers `rule` for layers whose class is exactly `layer_class`."""
  if not (isinstance(layer_class, type) and
          issubclass(layer_class, tf.keras.layers.Layer)):
    raise ValueError(
        f'layer_class must be a Keras layer class, got {layer_class!r}')
  _RULES[layer_class] = rule


def lookup(layer: tf.keras.layers.Layer, inputs) -> Optional[LayerRule]:
  """The rule for calling `layer` on `inputs`, or None (use the fallback)."""
  rule = _RULES.get(type(layer))
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


def _dense_grads(layer, inputs, tap_grad):
  inputs = tf.cast(inputs, tap_grad.dtype)
  if inputs.shape.rank == 2:
    kernel = tf.einsum('bi,bo->bio', inputs, tap_grad)
    bias = tap_grad
  else:
    batch = tf.shape(inputs)[0]
    x = tf.reshape(inputs, [batch, -1, inputs.shape[-1]])
    g = tf.reshape(tap_grad, [batch, -1, tap_grad.shape[-1]])
    kernel = tf.einsum('bti,bto->bio', x, g)
    bias = tf.reduce_sum(g, axis=1)
  grads = [(layer.kernel, kernel)]
  if layer.use_bias:
    grads.append((layer.bias, bias))
  return grads


def _dense_sq_norms(layer, inputs, tap_grad):
  # The kernel gradient of one example is x^T g (x: [T, I], g: [T, O]); its
  # squared norm is sum_{t,s} (x_t . x_s)(g_t . g_s), "ghost" norms (Goodfellow
  # 2015; Li et al. 2022), cheaper than x^T g unless T^2 > I * O.
  inputs = tf.cast(inputs, tap_grad.dtype)
  if inputs.shape.rank == 2:
    g_squared = tf.reduce_sum(tf.square(tap_grad), axis=1)
    kernel = tf.reduce_sum(tf.square(inputs), axis=1) * g_squared
    bias = g_squared
  else:
    steps = inputs.shape[1:-1].num_elements()
    if steps is None or steps * steps > layer.kernel.shape.num_elements():
      return None
    batch = tf.shape(inputs)[0]
    x = tf.reshape(inputs, [batch, steps, inputs.shape[-1]])
    g = tf.reshape(tap_grad, [batch, steps, tap_grad.shape[-1]])
    kernel = tf.reduce_sum(
        tf.einsum('bti,bsi->bts', x, x) * tf.einsum('bto,bso->bts', g, g),
        axis=[1, 2])
    bias = tf.reduce_sum(tf.square(tf.reduce_sum(g, axis=1)), axis=1)
  norms = [(layer.kernel, kernel)]
  if layer.use_bias:
    norms.append((layer.bias, bias))
  return [(v, tf.cast(n, tf.float32)) for v, n in norms]


# --- Conv1D / Conv2D ---------------------------------------------------------


def _conv_supports(layer, inputs):
  # Grouped, channels-first and extra-batch-dim convolutions take the fallback.
  return (layer.groups == 1 and layer.data_format == 'channels_last' and
          inputs.shape.rank == layer.rank + 2)


def _conv_pad(layer, inputs):
  if layer.padding == 'causal':
    left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
    inputs = tf.pad(inputs, [[0, 0], [left, 0], [0, 0]])
  return inputs


def _conv_forward(layer, inputs):
  # Conv.call (groups == 1, channels_last) without its activation.
  dtype = layer.compute_dtype
  inputs = tf.cast(inputs, dtype)
  pre = layer.convolution_op(_conv_pad(layer, inputs),
                             tf.cast(layer.kernel, dtype))
  if layer.use_bias:
    pre = tf.nn.bias_add(pre, tf.cast(layer.bias, dtype))
  return layer.activation(pre), pre


def _conv_grads(layer, inputs, tap_grad):
  inputs = tf.cast(_conv_pad(layer, inputs), tap_grad.dtype)
  padding = 'SAME' if layer.padding == 'same' else 'VALID'
  if layer.rank == 1:  # A 1-D convolution is a 2-D one of height 1.
    inputs = inputs[:, tf.newaxis]
    tap_grad = tap_grad[:, tf.newaxis]
    sizes = [1, 1, layer.kernel_size[0], 1]
    strides = [1, 1, layer.strides[0], 1]
    rates = [1, 1, layer.dilation_rate[0], 1]
  else:
    sizes = [1, *layer.kernel_size, 1]
    strides = [1, *layer.strides, 1]
    rates = [1, *layer.dilation_rate, 1]
  patches = tf.image.extract_patches(
      inputs, sizes=sizes, strides=strides, rates=rates, padding=padding)
  kernel = tf.einsum('bhwp,bhwo->bpo', patches, tap_grad)
  kernel = tf.reshape(kernel, [-1, *layer.kernel.shape])
  grads = [(layer.kernel, kernel)]
  if layer.use_bias:
    grads.append((layer.bias, tf.reduce_sum(tap_grad, axis=[1, 2])))
  return grads


# --- Embedding ---------------------------------------------------------------


def _embedding_grads(layer, inputs, tap_grad):
  batch = tf.shape(tap_grad)[0]
  vocab, dim = layer.embeddings.shape
  ids = tf.reshape(tf.cast(inputs, tf.int32), [batch, -1])
  rows = ids + vocab * tf.range(batch)[:, tf.newaxis]
  grad = tf.math.unsorted_segment_sum(
      tf.reshape(tap_grad, [-1, dim]), tf.reshape(rows, [-1]), batch * vocab)
  return [(layer.embeddings, tf.reshape(grad, [batch, vocab, dim]))]


def _embedding_supports(layer, inputs):
  del inputs
  return not layer.sparse


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


def _layer_norm_grads(layer, inputs, tap_grad):
  x = tf.cast(inputs, tf.float32)
  mean, variance = tf.nn.moments(x, layer.axis, keepdims=True)
  normalized = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
  return _affine_grads(layer, tf.cast(normalized, tap_grad.dtype), tap_grad,
                       list(layer.axis))


def _layer_norm_supports(layer, inputs):
  del inputs
  return 0 not in layer.axis  # Normalizing over the batch mixes examples.


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


register(tf.keras.layers.Dense,
         LayerRule(_dense_forward, _dense_grads, sq_norms=_dense_sq_norms))
register(tf.keras.layers.Conv1D,
         LayerRule(_conv_forward, _conv_grads, _conv_supports))
register(tf.keras.layers.Conv2D,
         LayerRule(_conv_forward, _conv_grads, _conv_supports))
register(tf.keras.layers.Embedding,
         LayerRule(_called_normally, _embedding_grads, _embedding_supports))
register(tf.keras.layers.LayerNormalization,
         LayerRule(_called_normally, _layer_norm_grads, _layer_norm_supports))
register(tf.keras.layers.GroupNormalization,
         LayerRule(_called_normally, _group_norm_grads, _group_norm_supports))
