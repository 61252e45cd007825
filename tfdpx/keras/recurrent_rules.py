"""Per-layer rules of the recurrent layers: LSTM, GRU and SimpleRNN.

A recurrent layer's gate pre-activations at step t are
`z_t = x_t W + h_{t-1} U + b`. With `d_t` the gradient of the loss with
respect to `z_t`, one example's weight gradients are sums over its steps:
`sum_t x_t^T d_t` (W), `sum_t h_{t-1}^T d_t` (U), `sum_t d_t` (b): the product
forms of a Dense layer on sequences (`tfdpx.forms.dense`), with the inputs
`x_t` for W and the previous states `h_{t-1}` for U.

The rule runs the layer's recurrence itself (Keras's own loop,
`keras_version.rnn`, with the layer's masks, direction and unrolling): the
input projections `x_t W + b` of every step are computed before the loop,
and that tensor is the tap: its gradient is `d_t` for every step, from the
one batched backward pass through the loop. The loop also returns each
step's previous state. GRU (`reset_after=True`, Keras's default) multiplies
the recurrent projection by its reset gate, so its recurrent part
`h_{t-1} U + b_r` has a gradient of its own: a second tap, zeros added to it
inside the loop.

Not covered (the fallback takes them): dropout and recurrent dropout (their
masks are drawn by the cell), GRU with `reset_after=False`, `time_major`
inputs, calls with an initial state or constants, and other cells.
"""

from typing import List

import tensorflow as tf

from tfdpx.forms import dense as dense_forms
from tfdpx.forms import materialized as materialized_forms
from tfdpx.forms import unit as unit_lib
from tfdpx.keras import layer_rules
from tfdpx.keras.stack import keras_version

_GATES = {tf.keras.layers.LSTM: 4, tf.keras.layers.GRU: 3,
          tf.keras.layers.SimpleRNN: 1}


def _is_gru(layer) -> bool:
  return type(layer) is tf.keras.layers.GRU  # pylint: disable=unidiomatic-typecheck


def _supports(layer, inputs) -> bool:
  cell = layer.cell
  return (inputs.shape.rank == 3 and not getattr(layer, 'time_major', False)
          and not cell.dropout and not cell.recurrent_dropout and
          (not _is_gru(layer) or cell.reset_after))


def _step(layer, units: int):
  """The cell's step on the precomputed input projections.

  The step's inputs are `x_t W + b` (and, for GRU, the zeros of the second
  tap); its output is `[h_t, h_{t-1}]`, so that the loop also gives every
  step's previous state.
  """
  cell = layer.cell
  dtype = layer.compute_dtype
  recurrent = tf.cast(cell.recurrent_kernel, dtype)
  act, gate = cell.activation, getattr(cell, 'recurrent_activation', None)
  if isinstance(layer, tf.keras.layers.LSTM):
    def step(projected, states):
      h, c = states
      z = projected + tf.matmul(h, recurrent)
      i, f, g, o = tf.split(z, 4, axis=-1)
      c_new = gate(f) * c + gate(i) * act(g)
      h_new = gate(o) * act(c_new)
      return tf.concat([h_new, h], -1), [h_new, c_new]
  elif _is_gru(layer):
    bias = (tf.cast(cell.bias[1], dtype) if cell.use_bias else
            tf.zeros([3 * units], dtype))

    def step(projected, states):
      (h,) = states
      x, zero = tf.split(projected, 2, axis=-1)
      inner = tf.matmul(h, recurrent) + bias + zero
      x_z, x_r, x_h = tf.split(x, 3, axis=-1)
      r_z, r_r, r_h = tf.split(inner, 3, axis=-1)
      z, r = gate(x_z + r_z), gate(x_r + r_r)
      h_new = z * h + (1 - z) * act(x_h + r * r_h)
      return tf.concat([h_new, h], -1), [h_new]
  else:
    def step(projected, states):
      (h,) = states
      h_new = act(projected + tf.matmul(h, recurrent))
      return tf.concat([h_new, h], -1), [h_new]
  return step


def _forward(layer, inputs):
  """The layer's outputs, its tap(s) and each step's previous state."""
  cell = layer.cell
  units = cell.units
  dtype = layer.compute_dtype
  x = tf.cast(inputs, dtype)
  projected = tf.tensordot(x, tf.cast(cell.kernel, dtype), [[2], [0]])
  projected.set_shape(x.shape[:2].concatenate([_GATES[type(layer)] * units]))
  if cell.use_bias:
    bias = cell.bias[0] if _is_gru(layer) else cell.bias
    projected = projected + tf.cast(bias, dtype)
  tap = projected
  if _is_gru(layer):
    recurrent_tap = tf.zeros_like(projected)
    tap = (projected, recurrent_tap)
    projected = tf.concat([projected, recurrent_tap], -1)
  batch = tf.shape(x)[0]
  states = [tf.zeros([batch, units], dtype)] * (
      2 if isinstance(layer, tf.keras.layers.LSTM) else 1)
  mask = getattr(inputs, '_keras_mask', None)
  last, outputs, states = keras_version.rnn(
      _step(layer, units), projected, states,
      go_backwards=layer.go_backwards, mask=mask, unroll=layer.unroll,
      zero_output_for_mask=layer.zero_output_for_mask,
      return_all_outputs=True)
  previous = outputs[..., units:]
  if layer.go_backwards:  # The loop's order is the inputs' reversed.
    previous = tf.reverse(previous, [1])
  output = outputs[..., :units] if layer.return_sequences else last[..., :units]
  if layer.return_state:
    output = [output] + list(states)
  return output, tap, previous


def _units(call: layer_rules.RuleCall) -> List[unit_lib.Unit]:
  cell = call.layer.cell
  taps = call.tap_grad if isinstance(call.tap_grad, tuple) else (
      call.tap_grad, call.tap_grad)
  d_inputs, d_recurrent = taps
  gru = _is_gru(call.layer)
  bias = cell.bias if cell.use_bias and not gru else None
  rows = lambda elems: elems[0]
  units = [
      dense_forms.ProductUnit(cell.kernel, bias, rows, [call.inputs],
                              d_inputs, call.chunk_size),
      dense_forms.ProductUnit(cell.recurrent_kernel, None, rows,
                              [tf.cast(call.saved, call.inputs.dtype)],
                              d_recurrent, call.chunk_size)]
  if gru and cell.use_bias:
    units.append(materialized_forms.MaterializedUnit(
        [cell.bias], lambda elems: [tf.stack(
            [tf.reduce_sum(d, axis=1) for d in elems], axis=1)],
        [d_inputs, d_recurrent], chunk_size=None))
  return units


_FORM = 'product forms over time steps (tfdpx.forms.dense)'

for _layer_class in _GATES:
  layer_rules.register(_layer_class, layer_rules.LayerRule(
      _forward, supports=_supports, unit=_units, form=_FORM))
