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
| `sum_i w_i G_i` | `A^T diag(w) D`, one matmul | the same over all positions, or the layer's own backward pass; several: chunks of `[c, p, o]` |
| `<G_i, H_j>` (another batch) | `(a a'^T) * (d d'^T)` | not offered |

The choice is made from static shapes, once per layer and batch shape.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients
from tfdpx.forms import chunks
from tfdpx.forms import unit

RowsOf = Callable[[List[tf.Tensor]], tf.Tensor]

# Kernels of at most this many entries (64 KiB of float32 per example), whose
# norms have no ghost form, keep their per-example gradients for the step: at
# batch 1024, 64 MiB per layer.
CACHED_KERNEL_SIZE = 16384

# A convolution's kernel of at most this many entries (3 x 3 x 64 x 113) is
# kept too if it is no larger than the input patches each statistic would
# extract again (`o <= T`): at batch 1024, at most 256 MiB per layer.
CACHED_CONV_KERNEL_SIZE = 65536

# A statistic reduced from per-example kernel gradients forms at most this
# many entries at once (16 MiB of float32): the encoder's 256 x 1024 kernels
# 16 examples a chunk, not `chunk_size`. A convolution's input patches, `T p`
# entries an example, are extracted at most this many at once too: the CIFAR
# CNN's second convolution, 900 x 288, 16 examples a chunk (at 128, 127 MiB).
CHUNK_ENTRIES = 1 << 22


class ProductUnit(unit.Unit):
  """A layer call whose kernel gradient is `A_i^T D_i` (plus a bias)."""

  def __init__(self, kernel: tf.Variable, bias: Optional[tf.Variable],
               rows_of: RowsOf, elems: Sequence[tf.Tensor],
               tap_grad: tf.Tensor, chunk_size: int,
               weighted_sum: Optional[Callable] = None,
               patch_rows: Optional[Sequence[int]] = None):
    """Args:
      kernel: the kernel; its gradient is `A_i^T D_i` reshaped to its shape.
      bias: the bias (gradient `sum_t D_i[t]`, in its shape), or None.
      rows_of: maps a chunk of `elems` (`[c, ...]` each) to `A` of the chunk,
        `[c, T, p]` (Dense: the inputs; convolutions: the input patches).
      elems: the batched tensors `rows_of` needs.
      tap_grad: `D`, `[B, T, o]`.
      chunk_size: examples per chunk where `[c, p, o]` gradients are formed.
      weighted_sum: optional exact `weighted_sum(weights, keep)` of the
        kernel and bias (the layer's own backward pass); default one matmul
        over all positions.
      patch_rows: for a convolution, whose `rows_of` extracts input
        patches: the kernel row (of its flattened input axes) that each
        column of `A` makes. Keeping the per-example kernels spares
        extracting the patches again, so larger kernels are kept
        (`CACHED_CONV_KERNEL_SIZE`); columns out of order (a depthwise
        convolution extracts patches channel by channel) are put in order
        in the per-example kernels once formed, `p o` entries an example,
        instead of `A`'s `T p`.
    """
    super().__init__([kernel] + ([bias] if bias is not None else []))
    self._kernel, self._bias = kernel, bias
    self._rows_of = rows_of
    self._elems = list(elems)
    self._d = tap_grad
    self._chunk_size = int(chunk_size)
    self._weighted_sum = weighted_sum
    self._patches = patch_rows is not None
    # The column of `A` that makes each kernel row, or None: in order.
    self._row_columns = None
    if self._patches and list(patch_rows) != sorted(patch_rows):
      self._row_columns = sorted(range(len(patch_rows)),
                                 key=lambda c: patch_rows[c])
    self._steps = tap_grad.shape[1]
    self._out = tap_grad.shape[-1]
    self._in = kernel.shape.num_elements() // self._out
    self._bias_rows = None
    self._kernel_cache = None
    self._cross_parts = {}

  # --- helpers ---------------------------------------------------------------

  def _a(self) -> tf.Tensor:
    """`A` of the whole batch, `[B, T, p]`, its columns in the kernel's row
    order (cheap for Dense: its inputs)."""
    a = tf.cast(self._rows_of(self._elems), self._d.dtype)
    if self._row_columns is None:
      return a
    return tf.gather(a, self._row_columns, axis=-1)

  def _bias_grads(self) -> gradients.MaterializedGradients:
    if self._bias_rows is None:
      self._bias_rows = gradients.MaterializedGradients([tf.reshape(
          tf.reduce_sum(self._d, axis=1), [-1, *self._bias.shape])])
    return self._bias_rows

  def _columns(self, rows) -> Tuple[int, int]:
    """The columns `[lo, hi)` of `A` that make the kernel's rows `rows`."""
    if rows is None:
      return 0, self._in
    per_row = self._in // self._kernel.shape[0]
    return rows[0] * per_row, rows[1] * per_row

  def _kernel_shape(self, rows) -> List[int]:
    """The kernel's shape, or that of its slices `rows` of the first axis."""
    shape = self._kernel.shape.as_list()
    return shape if rows is None else [rows[1] - rows[0]] + shape[1:]

  def _kernel_of(self, chunk: List[tf.Tensor], rows=None) -> tf.Tensor:
    """The chunk's per-example kernel gradients, `[c, *kernel.shape]`.

    With `rows`, only those slices of the kernel's first axis (from the
    matching columns of `A`: nothing else is formed).
    """
    *elems, d = chunk
    lo, hi = self._columns(rows)
    a = tf.cast(self._rows_of(elems), d.dtype)
    if self._row_columns is None:
      grads = tf.einsum('ctp,cto->cpo', a[..., lo:hi], d)
    elif rows is not None:
      grads = tf.einsum('ctp,cto->cpo', tf.gather(
          a, self._row_columns[lo:hi], axis=-1), d)
    else:  # Put in order as `[c, p, o]`, not as `[c, T, p]`.
      grads = tf.gather(tf.einsum('ctp,cto->cpo', a, d), self._row_columns,
                        axis=1)
    return tf.reshape(grads, [-1, *self._kernel_shape(rows)])

  def _all_kernels(self) -> tf.Tensor:
    """`[B, *kernel.shape]`, formed chunk by chunk."""
    return chunks.map_rows(
        lambda chunk: [self._kernel_of(chunk)], self._elems + [self._d],
        self._rows_chunk(),
        [tf.TensorSpec(self._kernel.shape, self._d.dtype)])[0]

  def _rows_chunk(self) -> int:
    """Examples a chunk whose `A` is formed: `chunk_size`, and for the
    patches of a convolution on `T` positions at most `CHUNK_ENTRIES`."""
    if not self._patches or self._steps is None:
      return self._chunk_size
    return max(1, min(self._chunk_size,
                      CHUNK_ENTRIES // (self._steps * self._in)))

  def _cached_kernel(self) -> Optional[tf.Tensor]:
    """`[B, *kernel.shape]`, formed once, if it is kept (`_keeps_kernel`).

    Every later statistic of the step (norms, dots, masked norms, weighted
    sums) then reduces the same tensor instead of forming the patches and
    products again: GEP reads the tutorial CNN's second convolution three
    times a step on the private batch (the dots of its two groups, the finite
    check's norms) and five on the anchors (also each group's weighted sums).
    A larger kernel is formed chunk by chunk for each statistic, so memory
    stays bounded by the chunk. `sq_norms` of a kernel with the ghost form
    does not call this: DP-SGD, which asks only for norms, never forms its
    per-example gradients.
    """
    if not self._keeps_kernel():
      return None
    if self._kernel_cache is None:
      self._kernel_cache = self._all_kernels()
    return self._kernel_cache

  def _keeps_kernel(self) -> bool:
    """Whether the per-example kernels are formed once for the step."""
    size = self._kernel.shape.num_elements()
    if size <= CACHED_KERNEL_SIZE:
      return True
    # A convolution's patches (`T p` an example) cost more to extract again
    # than a kernel of `p o <= T p` entries costs to keep.
    return (self._patches and size <= CACHED_CONV_KERNEL_SIZE and
            self._steps is not None and self._out <= self._steps)

  def _kernel_rows(self, statistic, spec: tf.TensorSpec,
                   rows=None) -> tf.Tensor:
    """`statistic` of the kernel gradients (cached, or chunk by chunk).

    With `rows`, of their slices `rows` of the kernel's first axis.
    """
    cached = self._cached_kernel()
    if cached is not None:
      return statistic(gradients.MaterializedGradients(
          [gradients.slice_rows(cached, rows)]))[0]
    return chunks.map_rows(
        lambda chunk: [statistic(gradients.MaterializedGradients(
            [self._kernel_of(chunk, rows)]))[0]],
        self._elems + [self._d], self._budget_chunk(rows), [spec])[0]

  def _budget_chunk(self, rows) -> int:
    """Examples a chunk whose kernel gradients (their slices `rows`) fit
    `CHUNK_ENTRIES`, at most `chunk_size`."""
    lo, hi = self._columns(rows)
    return max(1, min(self._rows_chunk(),
                      CHUNK_ENTRIES // ((hi - lo) * self._out)))

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
    elif self._ghost() and self._kernel_cache is None:  # Else reuse it.
      def ghost(chunk):
        *elems, g = chunk
        a = tf.cast(self._rows_of(elems), tf.float32)
        g = tf.cast(g, tf.float32)
        return [tf.reduce_sum(tf.einsum('bti,bsi->bts', a, a) *
                              tf.einsum('bto,bso->bts', g, g), axis=[1, 2])]
      kernel = chunks.map_rows(ghost, self._elems + [self._d],
                               self._rows_chunk(),
                               [tf.TensorSpec([], tf.float32)])[0]
    else:
      kernel = self._kernel_rows(lambda g: g.sq_norms(),
                                 tf.TensorSpec([], tf.float32))
    return self._with_bias(kernel, lambda g: g.sq_norms())

  def dots(self, directions, rows=None):
    rows = rows or [None] * len(directions)
    kernel_dirs = directions[0]
    kernel = None
    if kernel_dirs is not None:
      k = kernel_dirs.shape[0]
      if self._steps == 1:
        # Only the columns of `a` that meet the directions' rows.
        lo, hi = self._columns(rows[0])
        a = tf.cast(self._a()[:, 0, lo:hi], tf.float32)
        d = tf.cast(self._d[:, 0], tf.float32)
        v = tf.reshape(tf.cast(kernel_dirs, tf.float32),
                       [k, hi - lo, self._out])
        kernel = tf.einsum('bko,bo->bk', tf.einsum('bp,kpo->bko', a, v), d)
      else:
        kernel = self._kernel_rows(lambda g: g.dots([kernel_dirs]),
                                   tf.TensorSpec([k], tf.float32), rows[0])
    out = [kernel]
    if self._bias is not None:
      out += self._bias_grads().dots(directions[1:], rows[1:])
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

  def _contracted_sums(self, weights, keep, rows):
    """`[K, ...]` weighted sums (`weights` `[B, K]`) contracted from the
    kernel gradients: those formed for an earlier statistic of the step
    (cheaper than any pass over the positions: the tutorial CNN's first
    convolution, 256 x 1024 products against a backward pass over 196
    positions), or else formed chunk by chunk. On `T` positions, one pass
    per column (`weighted_sum`) costs `K T p o` an example; forming the
    kernel gradients `T p o` and contracting them `K p o` (GEP's power step
    on the encoder's anchors: K = 16, T = 128)."""
    rows = rows or [None] * len(self.variables)
    w = tf.where(keep[:, tf.newaxis], tf.cast(weights, self._d.dtype), 0.0)
    if self._kernel_cache is not None:
      kernel = tf.tensordot(w, clipping.zero_rows(
          gradients.slice_rows(self._kernel_cache, rows[0]), keep), [[0], [0]])
    else:
      def partial(chunk, valid):
        *elems, w_chunk, keep_chunk = chunk
        grads = self._kernel_of(elems, rows[0])
        return [tf.tensordot(w_chunk, clipping.zero_rows(
            grads, tf.logical_and(keep_chunk, valid)), [[0], [0]])]
      kernel = chunks.sum_rows(
          partial, self._elems + [self._d, w, keep],
          self._budget_chunk(rows[0]),
          [tf.TensorSpec([w.shape[1], *self._kernel_shape(rows[0])],
                         self._d.dtype)])[0]
    out = [tf.cast(kernel, self._kernel.dtype)]
    if self._bias is not None:
      out.append(tf.cast(tf.tensordot(w, clipping.zero_rows(
          gradients.slice_rows(self._bias_grads().materialized()[0], rows[1]),
          keep), [[0], [0]]), self._bias.dtype))
    return out

  def _contracts(self, k: int) -> bool:
    """Whether `k` weighted sums on `T` positions are cheaper contracted
    from the kernel gradients than one pass over the positions each:
    `T + k < k T` (never for `T = 1`)."""
    t = self._steps
    return k > 1 and (t is None or (k - 1) * (t - 1) > 1)

  def weighted_sum(self, weights, keep, rows=None):
    if self._kernel_cache is not None:
      return [s[0] for s in self._contracted_sums(weights[:, tf.newaxis],
                                                  keep, rows)]
    if self._weighted_sum is not None:
      return unit.sliced_sums(self._weighted_sum(weights, keep), rows)
    rows = rows or [None] * len(self.variables)
    lo, hi = self._columns(rows[0])
    d = unit.weighted_rows(self._d, weights, keep)
    a = clipping.zero_rows(self._a()[..., lo:hi], keep)
    kernel = tf.reshape(
        tf.matmul(tf.reshape(a, [-1, hi - lo]),
                  tf.reshape(d, [-1, self._out]), transpose_a=True),
        self._kernel_shape(rows[0]))
    out = [tf.cast(kernel, self._kernel.dtype)]
    if self._bias is not None:
      bias = tf.cast(tf.reshape(tf.reduce_sum(d, axis=[0, 1]),
                                self._bias.shape), self._bias.dtype)
      out.append(gradients.slice_rows(bias, rows[1], axis=0))
    return out

  def weighted_sums(self, weights, keep, rows=None):
    if self._kernel_cache is not None or self._contracts(weights.shape[1]):
      return self._contracted_sums(weights, keep, rows)
    if self._weighted_sum is not None or self._steps != 1:
      # [B, T, K, o] weighted copies of D would be too large on sequences.
      return super().weighted_sums(weights, keep, rows)
    # Vectors: all K columns in one matmul, `A^T [w_1 d, ..., w_K d]`.
    rows = rows or [None] * len(self.variables)
    lo, hi = self._columns(rows[0])
    k = weights.shape[1]
    a = clipping.zero_rows(self._a()[:, 0, lo:hi], keep)
    d = clipping.zero_rows(self._d[:, 0], keep)
    w = tf.where(keep[:, tf.newaxis], tf.cast(weights, d.dtype), 0.0)
    weighted = tf.reshape(w[:, :, tf.newaxis] * d[:, tf.newaxis],
                          [-1, k * self._out])
    kernel = tf.reshape(tf.matmul(a, weighted, transpose_a=True),
                        [hi - lo, k, self._out])
    kernel = tf.reshape(tf.transpose(kernel, [1, 0, 2]),
                        [k, *self._kernel_shape(rows[0])])
    out = [tf.cast(kernel, self._kernel.dtype)]
    if self._bias is not None:
      bias = tf.cast(tf.reshape(tf.matmul(w, d, transpose_a=True),
                                [k, *self._bias.shape]), self._bias.dtype)
      out.append(gradients.slice_rows(bias, rows[1]))
    return out

  def cross_gram_form(self, other):
    return (isinstance(other, ProductUnit) and self._steps == 1 and
            other._steps == 1 and other._kernel is self._kernel and  # pylint: disable=protected-access
            other._bias is self._bias)  # pylint: disable=protected-access

  def cross_grams(self, other, spans, dtype):
    """On vectors: `<a d^T, a' d'^T> = (a . a') (d . d')` on each span.

    The kernel's flat entry `q o + c` is row `q` of `A`, column `c` of `D`: a
    span is whole rows of the kernel plus at most a partial row at each end.
    """
    if not self.cross_gram_form(other):
      raise NotImplementedError('cross Grams need two units on vectors')

    def part(side, lo, hi):
      """`x[:, lo:hi] x'[:, lo:hi]^T` for x = a or d, formed once a step.

      GEP's groups cut a layer's kernel into spans and ask for each: the
      column Gram of whole rows (all of D) recurs in every span.
      """
      key = (other, dtype, side, lo, hi)
      if key not in self._cross_parts:
        x, x_other = [tf.cast(u._a() if side == 'a' else u._d, dtype)[:, 0]  # pylint: disable=protected-access
                      for u in (self, other)]
        self._cross_parts[key] = tf.matmul(x[:, lo:hi], x_other[:, lo:hi],
                                           transpose_b=True)
      return self._cross_parts[key]

    def gram(rows, columns):
      """`sum` over kernel rows `rows` and columns `columns` of the products."""
      return part('a', *rows) * part('d', *columns)

    out = [None] * len(self.variables)
    if spans[0] is not None:
      o = self._out
      (q0, c0), (q1, c1) = divmod(spans[0][0], o), divmod(spans[0][1], o)
      if q0 == q1:
        terms = [gram((q0, q0 + 1), (c0, c1))]
      else:
        terms = [gram((q0, q0 + 1), (c0, o))] if c0 else []
        if q0 + bool(c0) < q1:
          terms.append(gram((q0 + bool(c0), q1), (0, o)))
        if c1:
          terms.append(gram((q1, q1 + 1), (0, c1)))
      out[0] = tf.add_n(terms)
    if self._bias is not None and spans[1] is not None:
      out[1] = part('d', *spans[1])
    return out

  def materialized(self):
    kernel = self._cached_kernel()
    if kernel is None:
      kernel = self._all_kernels()
    return self._with_bias(kernel, lambda g: g.materialized())
