"""Per-example gradients that are products `G_i = A_i^T D_i`, without forming them.

A Dense layer on vectors has `A_i = a_i` (`[1, p]`, its input) and
`D_i = d_i` (`[1, o]`, the gradient of its pre-activation); on sequences `T`
positions; a convolution is a Dense layer over its input patches (`T` output
positions, `p` = kernel volume x input channels). The bias gradient is
`sum_t D_i[t]`. (Goodfellow 2015; Li et al. 2022; Bu et al. 2023;
`shared/notes/per-example-statistics.md`.)

| statistic | T = 1 | T > 1 |
|---|---|---|
| `\\|G_i\\|^2` | `\\|a\\|^2 \\|d\\|^2` | ghost `<A A^T, D D^T>` if `T (p + o) < p o`, else chunks of `[c, p, o]` |
| `<G_i, V>` | `a^T V d` | chunks of `[c, p, o]` |
| `\\|M * G_i\\|^2` | `(a*a)^T M (d*d)` | chunks of `[c, p, o]` |
| `sum_i w_i G_i` | `A^T diag(w) D`, one matmul | the same over all positions, or the layer's own backward pass |

The choice is made from static shapes, once per layer and batch shape.
"""

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients
from tfdpx.forms import chunks
from tfdpx.forms import unit

RowsOf = Callable[[List[tf.Tensor]], tf.Tensor]

# Kernels of at most this many entries (64 KiB of float32 per example) keep
# their per-example gradients for the step: at batch 1024, 64 MiB per layer.
CACHED_KERNEL_SIZE = 16384


class ProductUnit(unit.Unit):
  """A layer call whose kernel gradient is `A_i^T D_i` (plus a bias)."""

  def __init__(self, kernel: tf.Variable, bias: Optional[tf.Variable],
               rows_of: RowsOf, elems: Sequence[tf.Tensor],
               tap_grad: tf.Tensor, chunk_size: int,
               weighted_sum: Optional[Callable] = None):
    """Args:
      kernel: the kernel; its gradient is `A_i^T D_i` reshaped to its shape.
      bias: the bias (gradient `sum_t D_i[t]`), or None.
      rows_of: maps a chunk of `elems` (`[c, ...]` each) to `A` of the chunk,
        `[c, T, p]` (Dense: the inputs; convolutions: the input patches).
      elems: the batched tensors `rows_of` needs.
      tap_grad: `D`, `[B, T, o]`.
      chunk_size: examples per chunk where `[c, p, o]` gradients are formed.
      weighted_sum: optional exact `weighted_sum(weights, keep)` of the
        kernel and bias (the layer's own backward pass); default one matmul
        over all positions.
    """
    super().__init__([kernel] + ([bias] if bias is not None else []))
    self._kernel, self._bias = kernel, bias
    self._rows_of = rows_of
    self._elems = list(elems)
    self._d = tap_grad
    self._chunk_size = int(chunk_size)
    self._weighted_sum = weighted_sum
    self._steps = tap_grad.shape[1]
    self._out = tap_grad.shape[-1]
    self._in = kernel.shape.num_elements() // self._out
    self._bias_rows = None
    self._kernel_cache = None

  # --- helpers ---------------------------------------------------------------

  def _a(self) -> tf.Tensor:
    """`A` of the whole batch, `[B, T, p]` (cheap for Dense: its inputs)."""
    return tf.cast(self._rows_of(self._elems), self._d.dtype)

  def _bias_grads(self) -> gradients.MaterializedGradients:
    if self._bias_rows is None:
      self._bias_rows = gradients.MaterializedGradients(
          [tf.reduce_sum(self._d, axis=1)])
    return self._bias_rows

  def _kernel_of(self, chunk: List[tf.Tensor]) -> tf.Tensor:
    """The chunk's per-example kernel gradients, `[c, *kernel.shape]`."""
    *elems, d = chunk
    a = tf.cast(self._rows_of(elems), d.dtype)
    grads = tf.einsum('ctp,cto->cpo', a, d)
    return tf.reshape(grads, [-1, *self._kernel.shape])

  def _cached_kernel(self) -> Optional[tf.Tensor]:
    """`[B, *kernel.shape]`, formed once, if one example's is small.

    Several statistics of one step (the finite check's norms, a privatizer's
    norms, dots or masked norms) then reduce the same tensor instead of
    forming the patches and products again; a larger kernel is formed chunk
    by chunk for each statistic, so memory stays bounded by the chunk.
    """
    if self._kernel.shape.num_elements() > CACHED_KERNEL_SIZE:
      return None
    if self._kernel_cache is None:
      self._kernel_cache = self.materialized()[0]
    return self._kernel_cache

  def _kernel_rows(self, statistic, spec: tf.TensorSpec) -> tf.Tensor:
    """`statistic` of the kernel gradients (cached, or chunk by chunk)."""
    cached = self._cached_kernel()
    if cached is not None:
      return statistic(gradients.MaterializedGradients([cached]))[0]
    return chunks.map_rows(
        lambda chunk: [statistic(gradients.MaterializedGradients(
            [self._kernel_of(chunk)]))[0]],
        self._elems + [self._d], self._chunk_size, [spec])[0]

  def _ghost(self) -> bool:
    """Gram matrices over positions are cheaper than `[p, o]` per example."""
    t, p, o = self._steps, self._in, self._out
    return t is not None and t * (p + o) < p * o

  def _with_bias(self, kernel, bias_statistic):
    return [kernel] + ([bias_statistic(self._bias_grads())[0]]
                       if self._bias is not None else [])

  # --- statistics ------------------------------------------------------------

  def sq_norms(self):
    d = tf.cast(self._d, tf.float32)
    if self._steps == 1:
      a = tf.cast(self._a(), tf.float32)
      kernel = (tf.reduce_sum(tf.square(a), axis=[1, 2]) *
                tf.reduce_sum(tf.square(d), axis=[1, 2]))
    elif self._ghost():
      def ghost(chunk):
        *elems, g = chunk
        a = tf.cast(self._rows_of(elems), tf.float32)
        g = tf.cast(g, tf.float32)
        return [tf.reduce_sum(tf.einsum('bti,bsi->bts', a, a) *
                              tf.einsum('bto,bso->bts', g, g), axis=[1, 2])]
      kernel = chunks.map_rows(ghost, self._elems + [self._d],
                               self._chunk_size,
                               [tf.TensorSpec([], tf.float32)])[0]
    else:
      kernel = self._kernel_rows(lambda g: g.sq_norms(),
                                 tf.TensorSpec([], tf.float32))
    return self._with_bias(kernel, lambda g: g.sq_norms())

  def dots(self, directions):
    kernel_dirs = directions[0]
    bias_dirs = [directions[1]] if self._bias is not None else []
    kernel = None
    if kernel_dirs is not None:
      k = kernel_dirs.shape[0]
      if self._steps == 1:
        a = tf.cast(self._a()[:, 0], tf.float32)
        d = tf.cast(self._d[:, 0], tf.float32)
        v = tf.reshape(tf.cast(kernel_dirs, tf.float32),
                       [k, self._in, self._out])
        kernel = tf.einsum('bko,bo->bk', tf.einsum('bp,kpo->bko', a, v), d)
      else:
        kernel = self._kernel_rows(lambda g: g.dots([kernel_dirs]),
                                   tf.TensorSpec([k], tf.float32))
    out = [kernel]
    if self._bias is not None:
      out += self._bias_grads().dots(bias_dirs)
    return out

  def masked_sq_norms(self, masks):
    if self._steps == 1:
      a = tf.cast(self._a()[:, 0], tf.float32)
      d = tf.cast(self._d[:, 0], tf.float32)
      m = tf.reshape(tf.cast(masks[0], tf.float32), [self._in, self._out])
      kernel = tf.reduce_sum(tf.matmul(tf.square(a), m) * tf.square(d),
                             axis=1)
    else:
      kernel = self._kernel_rows(lambda g: g.masked_sq_norms(masks[:1]),
                                 tf.TensorSpec([], tf.float32))
    return self._with_bias(kernel, lambda g: g.masked_sq_norms(masks[1:]))

  def weighted_sum(self, weights, keep):
    if self._weighted_sum is not None:
      return self._weighted_sum(weights, keep)
    d = unit.weighted_rows(self._d, weights, keep)
    a = clipping.zero_rows(self._a(), keep)
    kernel = tf.reshape(
        tf.matmul(tf.reshape(a, [-1, self._in]),
                  tf.reshape(d, [-1, self._out]), transpose_a=True),
        self._kernel.shape)
    out = [tf.cast(kernel, self._kernel.dtype)]
    if self._bias is not None:
      out.append(tf.cast(tf.reduce_sum(d, axis=[0, 1]), self._bias.dtype))
    return out

  def materialized(self):
    if self._kernel_cache is not None:
      return self._with_bias(self._kernel_cache, lambda g: g.materialized())
    kernel = chunks.map_rows(
        lambda chunk: [self._kernel_of(chunk)], self._elems + [self._d],
        self._chunk_size,
        [tf.TensorSpec(self._kernel.shape, self._d.dtype)])[0]
    return self._with_bias(kernel, lambda g: g.materialized())
