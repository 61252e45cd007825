"""The per-example gradients of one batch, as statistics on demand.

A privatizer never needs the per-example gradients `g_i` themselves, only a
few per-example statistics and one weighted sum (DESIGN.md, "Data flow";
`shared/notes/per-example-statistics.md`):

| noise step | statistics | release |
|---|---|---|
| DP-SGD, D2P2, GeoDP | `sq_norms` | `weighted_sum` |
| DPDR | `sq_norms`, `dots` with the base (one direction per variable) | `weighted_sum`, plus the base |
| RS (around any step) | the inner step's, of `masked(masks)` | the same, masked |
| GEP | `sq_norms`, `dots` with the k basis vectors of each group, or `cross_grams` with the anchors | `weighted_sum`, plus the basis |

`PerExampleGradients` is that interface. `MaterializedGradients` answers it
from `[B, *var.shape]` tensors (the compile path's Jacobian, microbatch
records, tests); the engine of models made private answers it layer by layer
(ghost norms, segment sums, chunked materialization) without forming those
tensors where a cheaper exact form exists. Every privatizer takes either
(`as_per_example_gradients`).

Rows are the examples of this replica's batch. Statistics are float32; sums
have each variable's dtype and cover this replica only: privatizers
all-reduce them with `tfdpx.noise.replica_sum` under `tf.distribute`.
"""

import abc
from typing import (Callable, List, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import tensorflow as tf

from tfdpx import xla

Directions = Sequence[Optional[tf.Tensor]]
# Per variable, a range `(start, stop)` of its first axis, or None.
Rows = Optional[Sequence[Optional[Tuple[int, int]]]]
# Per variable, a range `(start, stop)` of its flattened entries, or None.
Spans = Sequence[Optional[Tuple[int, int]]]


def slice_rows(tensor: tf.Tensor, rows: Optional[Tuple[int, int]],
               axis: int = 1) -> tf.Tensor:
  """`tensor` restricted to `rows` of its variable's first axis (`axis`)."""
  if rows is None:
    return tensor
  start, stop = rows
  return tensor[(slice(None),) * axis + (slice(start, stop),)]


def row_sq_norms(rows: tf.Tensor) -> tf.Tensor:
  """`|rows[i]|^2` of `[N, n]` float32 rows, `[N]`.

  The square of TensorFlow's Euclidean-norm reduction: one pass, with no
  `[N, n]` temporary of squares (`reduce_sum(square(rows))` forms one: the
  CIFAR CNN's last kernel gradients, 144 MiB at batch 1024), and 2.5 times as
  fast on CPU. Not the contraction einsum('bn,bn->b'), which runs as N dot
  products: 3 to 8 times slower. Under XLA, which has no Euclidean-norm
  kernel, the square and the sum (fused there).
  """
  if xla.in_xla():
    return tf.reduce_sum(tf.square(rows), axis=1)
  return tf.square(tf.math.reduce_euclidean_norm(rows, axis=1))


def _flat(tensor: tf.Tensor) -> tf.Tensor:
  """`[B, ...]` as `[B, rest]`.

  A constant shape where the rest is static and not empty: two graph ops
  (the reshape and its shape), against eight from the dynamic shape.
  """
  rest = tensor.shape[1:].num_elements()
  if rest:
    return tf.reshape(tensor, [-1, rest])
  return tf.reshape(tensor, tf.stack([tf.shape(tensor)[0], -1]))


class PerExampleGradients(abc.ABC):
  """The per-example gradients of one batch, one block per variable.

  `g_iv` is example `i`'s gradient for variable `v` (shape `shapes[v]`).
  """

  @property
  @abc.abstractmethod
  def shapes(self) -> List[tf.TensorShape]:
    """The variables' shapes, in order."""

  @property
  @abc.abstractmethod
  def dtypes(self) -> List[tf.DType]:
    """The variables' dtypes, in order."""

  @abc.abstractmethod
  def batch_size(self) -> tf.Tensor:
    """The number of rows B (this replica's examples), an int32 scalar."""

  @abc.abstractmethod
  def sq_norms(self) -> List[tf.Tensor]:
    """`|g_iv|^2`: one float32 `[B]` per variable."""

  @abc.abstractmethod
  def dots(self, directions: Directions,
           rows: Rows = None) -> List[Optional[tf.Tensor]]:
    """`<g_iv, d_jv>` for k_v directions per variable.

    Args:
      directions: per variable, a `[k_v, *shape]` tensor of directions, or
        None for a variable that is not needed.
      rows: optional, per variable, `(start, stop)` when its directions are
        zero outside those slices of its first axis: `directions[v]` is then
        `[k_v, stop - start, *shape[1:]]`, and the engine does the work of
        those slices only (GEP's groups cut variables). None: whole.

    Returns:
      Per variable, a float32 `[B, k_v]`, or None where `directions` is None.
    """

  @abc.abstractmethod
  def masked_sq_norms(self, masks: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """`|m_v * g_iv|^2` for one mask `m_v` (shaped like the variable) each."""

  @abc.abstractmethod
  def weighted_sum(self, weights: tf.Tensor) -> List[tf.Tensor]:
    """`sum_i w_i g_iv` over this replica's rows, one tensor per variable.

    Args:
      weights: float32 `[B]`.
    """

  @abc.abstractmethod
  def materialized(self) -> List[tf.Tensor]:
    """`g_iv` itself: one `[B, *shape]` tensor per variable (escape hatch)."""

  def weighted_sum_of(self, weights: tf.Tensor,
                      wanted: Sequence[bool]) -> List[Optional[tf.Tensor]]:
    """`weighted_sum` of the variables `wanted` only (None for the others),
    without the work of the others where the engine can skip it."""
    return [s if w else None
            for s, w in zip(self.weighted_sum(weights), wanted)]

  def weighted_sums(self, weights: tf.Tensor,
                    rows: Rows = None) -> List[Optional[tf.Tensor]]:
    """`sum_i w_ic g_iv` for each column c of `weights` (float32 `[B, K]`).

    One `weighted_sum` per column (K static), so nothing larger than the
    result is formed.

    Args:
      weights: float32 `[B, K]`.
      rows: optional, per variable, None to skip it or `(start, stop)` to
        sum only those slices of its first axis. Default: every variable,
        whole.

    Returns:
      Per variable, a `[K, *shape]` tensor (`[K, stop - start, *shape[1:]]`
      with `rows`; None for a skipped variable).
    """
    columns = tf.unstack(tf.convert_to_tensor(weights), axis=1)
    sums = [tf.stack(s) for s in zip(*[self.weighted_sum(w) for w in columns])]
    return rows_of_sums(sums, rows)

  def cross_gram_forms(self, other: 'PerExampleGradients') -> List[bool]:
    """Per variable, whether `cross_grams` with `other` can answer for it.

    True where an exact form costs about what the two batches' layer inputs
    and output gradients cost, without forming either side's per-example
    gradients (a Dense layer on vectors: `(a a'^T) * (d d'^T)`). Default: none.
    """
    del other
    return [False] * len(self.shapes)

  def cross_grams(self, other: 'PerExampleGradients', spans: Spans,
                  dtype: tf.DType = tf.float32) -> List[Optional[tf.Tensor]]:
    """`<g_iv, h_jv>` over a span of each variable, `[B, M]` in `dtype`.

    Args:
      other: per-example gradients `h` of another batch (`M` rows) with this
        layout (GEP: the anchors; `other` may be `self`).
      spans: per variable, the range `(start, stop)` of its flattened entries
        to take the inner product over, or None for a variable not needed.
        Only variables with `cross_gram_forms(other)` may have a span.
      dtype: the dtype the products are formed and summed in.

    Returns:
      Per variable, a `[B, M]` tensor, or None where `spans` is None.
    """
    raise NotImplementedError(
        f'{type(self).__name__} has no cross Gram forms')

  def cross_gram(self, other: 'PerExampleGradients', spans: Spans,
                 dtype: tf.DType = tf.float32) -> tf.Tensor:
    """`sum_v <g_iv, h_jv>` over the spans (see `cross_grams`), `[B, M]`:
    the inner products over one group of spans (GEP's groups)."""
    return tf.add_n([g for g in self.cross_grams(other, spans, dtype)
                     if g is not None])

  def masked(self, masks: Sequence[tf.Tensor]) -> 'PerExampleGradients':
    """The gradients `m_v * g_iv`, for data-independent masks `m_v`."""
    return MaskedGradients(self, masks)

  # --- row-gathered variables (embedding tables) -----------------------------

  def row_gathered(self) -> List[bool]:
    """Per variable, whether its gradients are answered by rows: a table
    read by one lookup, whose example `i` has a gradient on the rows it looks
    up only (`rows_touched`, `row_counts`, `row_sums`). An example *touches*
    the rows where its gradient is not zero: a padding row of a fixed-shape
    batch (sample weight 0) touches none. Default: none."""
    return [False] * len(self.shapes)

  def rows_touched(self) -> List[Optional[tf.Tensor]]:
    """Per row-gathered variable, int32 `[B]`: how many distinct rows each
    example touches (0 for a dropped example); None for the others."""
    raise NotImplementedError(f'{type(self).__name__} has no row forms')

  def row_counts(self, weights: tf.Tensor) -> List[Optional['RowCounts']]:
    """Per row-gathered variable, the rows this batch touches and, for each,
    the sum of `weights` (float32 `[B]`) over the examples touching it;
    None for the others."""
    raise NotImplementedError(f'{type(self).__name__} has no row forms')

  def row_sums(self, weights: tf.Tensor) -> List[Optional[tf.Tensor]]:
    """Per row-gathered variable, `sum_i w_i g_iv[r]` for the rows `r` of
    `row_counts` (`[N, *shape[1:]]`, zero in padding slots): the weighted
    sum without the untouched rows. None for the others."""
    raise NotImplementedError(f'{type(self).__name__} has no row forms')


class RowCounts(NamedTuple):
  """The rows of a table one batch touches, and a weighted count of each.

  Attributes:
    rows: int32 `[N]`, distinct rows ascending, every row touched among
      them (a row only looked up with a zero gradient may be too, with count
      0); under XLA, where shapes are static, slots past their number may
      hold the table's row count (a sentinel past every row).
    counts: float32 `[N]`, per row the sum of the weights of the examples
      touching it (0 in the sentinel slots).
  """
  rows: tf.Tensor
  counts: tf.Tensor


def rows_of_sums(sums: Sequence[tf.Tensor],
                  rows: Rows) -> List[Optional[tf.Tensor]]:
  """`weighted_sums`' answer for `rows` from the whole `[K, *shape]` sums."""
  if rows is None:
    return list(sums)
  return [None if r is None else slice_rows(s, r) for s, r in zip(sums, rows)]


def global_sq_norms(grads: PerExampleGradients) -> tf.Tensor:
  """`|g_i|^2` over all variables together, float32 `[B]`."""
  return tf.add_n(grads.sq_norms())


class MaterializedGradients(PerExampleGradients):
  """Statistics of explicitly given `[B, *var.shape]` tensors."""

  def __init__(self, per_example_grads: Sequence[tf.Tensor],
               cross_gram_forms: Optional[Sequence[bool]] = None,
               row_gathered: Optional[Sequence[bool]] = None):
    """Args:
      per_example_grads: one `[B, *var.shape]` tensor per variable.
      cross_gram_forms: per variable, whether `cross_grams` with other
        materialized gradients answers for it (default: all). Tests set it to
        another value's `cross_gram_forms`, so that a privatizer that chooses
        between forms takes the same one on both.
      row_gathered: per variable (of rank 2 or more), whether to answer the
        row forms for it, an example touching the rows where its gradient is
        not zero: the dense reference of an embedding table's row forms.
        Default: none.
    """
    self._grads = [tf.convert_to_tensor(g) for g in per_example_grads]
    if not self._grads:
      raise ValueError('per_example_grads is empty')
    self._forms = ([True] * len(self._grads) if cross_gram_forms is None
                   else [bool(f) for f in cross_gram_forms])
    self._row_gathered = ([False] * len(self._grads) if row_gathered is None
                          else [bool(r) for r in row_gathered])

  @property
  def shapes(self):
    return [g.shape[1:] for g in self._grads]

  @property
  def dtypes(self):
    return [g.dtype for g in self._grads]

  def batch_size(self):
    return tf.shape(self._grads[0])[0]

  def sq_norms(self):
    return [row_sq_norms(_flat(tf.cast(g, tf.float32))) for g in self._grads]

  def dots(self, directions, rows=None):
    if len(directions) != len(self._grads):
      raise ValueError(f'directions has {len(directions)} entries for '
                       f'{len(self._grads)} variables')
    rows = rows or [None] * len(self._grads)
    out = []
    for g, d, r in zip(self._grads, directions, rows):
      if d is None:
        out.append(None)
        continue
      out.append(tf.matmul(_flat(tf.cast(slice_rows(g, r), tf.float32)),
                           _flat(tf.cast(d, tf.float32)), transpose_b=True))
    return out

  def masked_sq_norms(self, masks):
    return MaterializedGradients(
        [g * tf.cast(m, g.dtype) for g, m in zip(self._grads, masks)]
    ).sq_norms()

  def weighted_sum(self, weights):
    return [tf.tensordot(tf.cast(weights, g.dtype), g, axes=1)
            for g in self._grads]

  def weighted_sums(self, weights, rows=None):
    def sums(g):
      return tf.tensordot(tf.cast(weights, g.dtype), g, axes=[[0], [0]])
    if rows is None:
      return [sums(g) for g in self._grads]
    return [None if r is None else sums(slice_rows(g, r))
            for g, r in zip(self._grads, rows)]

  def materialized(self):
    return list(self._grads)

  def row_gathered(self):
    return list(self._row_gathered)

  def _touched(self, g: tf.Tensor) -> tf.Tensor:
    """`[B, rows]` bool: where example `i`'s gradient on a row is not zero."""
    rows = tf.reshape(g, tf.concat([tf.shape(g)[:2], [-1]], 0))
    return tf.reduce_any(tf.not_equal(rows, 0), axis=2)

  def _rows(self, touched: tf.Tensor) -> tf.Tensor:
    """The distinct rows any example touches, ascending (no sentinels)."""
    return tf.cast(tf.where(tf.reduce_any(touched, axis=0))[:, 0], tf.int32)

  def rows_touched(self):
    return [tf.reduce_sum(tf.cast(self._touched(g), tf.int32), axis=1)
            if gathered else None
            for g, gathered in zip(self._grads, self._row_gathered)]

  def row_counts(self, weights):
    out = []
    for g, gathered in zip(self._grads, self._row_gathered):
      if not gathered:
        out.append(None)
        continue
      touched = self._touched(g)
      rows = self._rows(touched)
      counts = tf.tensordot(tf.cast(weights, tf.float32),
                            tf.cast(touched, tf.float32), axes=1)
      out.append(RowCounts(rows, tf.gather(counts, rows)))
    return out

  def row_sums(self, weights):
    return [tf.gather(tf.tensordot(tf.cast(weights, g.dtype), g, axes=1),
                      self._rows(self._touched(g))) if gathered else None
            for g, gathered in zip(self._grads, self._row_gathered)]

  def cross_gram_forms(self, other):
    if not isinstance(other, MaterializedGradients):
      return [False] * len(self._grads)
    return list(self._forms)

  def cross_grams(self, other, spans, dtype=tf.float32):
    out = []
    for g, h, span in zip(self._grads, other.materialized(), spans):
      if span is None:
        out.append(None)
        continue
      start, stop = span
      out.append(tf.matmul(tf.cast(_flat(g)[:, start:stop], dtype),
                           tf.cast(_flat(h)[:, start:stop], dtype),
                           transpose_b=True))
    return out


class GradientsView(PerExampleGradients):
  """A data-independent transformation of other per-example gradients `g`,
  answered from `g`'s statistics: same layout and rows."""

  def __init__(self, grads: PerExampleGradients):
    self._grads = grads

  @property
  def shapes(self):
    return self._grads.shapes

  @property
  def dtypes(self):
    return self._grads.dtypes

  def batch_size(self):
    return self._grads.batch_size()

  # The rows touched are `g`'s: a view scales or masks the rows of each
  # example, and a row whose every looked-up coordinate a mask zeroes still
  # counts (it only adds rows; each example's contribution stays its own).
  # `row_sums` is each view's own.
  def row_gathered(self):
    return self._grads.row_gathered()

  def rows_touched(self):
    return self._grads.rows_touched()

  def row_counts(self, weights):
    return self._grads.row_counts(weights)


class MaskedGradients(GradientsView):
  """`m_v * g_iv` for per-variable masks `m_v` that do not depend on the data."""

  def __init__(self, grads: PerExampleGradients, masks: Sequence[tf.Tensor]):
    if len(masks) != len(grads.shapes):
      raise ValueError(f'masks has {len(masks)} entries for '
                       f'{len(grads.shapes)} variables')
    super().__init__(grads)
    self._masks = [tf.convert_to_tensor(m) for m in masks]

  def sq_norms(self):
    return self._grads.masked_sq_norms(self._masks)

  def dots(self, directions, rows=None):
    # <m * g, d> = <g, m * d>.
    rows = rows or [None] * len(self._masks)
    return self._grads.dots([
        None if d is None else
        d * tf.cast(slice_rows(m, r, axis=0), d.dtype)[tf.newaxis]
        for d, m, r in zip(directions, self._masks, rows)], rows)

  def masked_sq_norms(self, masks):
    return self._grads.masked_sq_norms(
        [m * tf.cast(n, m.dtype) for m, n in zip(self._masks, masks)])

  def weighted_sum(self, weights):
    return [s * tf.cast(m, s.dtype)
            for s, m in zip(self._grads.weighted_sum(weights), self._masks)]

  def materialized(self):
    return [g * tf.cast(m, g.dtype)[tf.newaxis]
            for g, m in zip(self._grads.materialized(), self._masks)]

  def weighted_sum_of(self, weights, wanted):
    return [None if s is None else s * tf.cast(m, s.dtype)
            for s, m in zip(self._grads.weighted_sum_of(weights, wanted),
                            self._masks)]

  def row_sums(self, weights):
    counts = self._grads.row_counts(weights)
    return [None if s is None else s * tf.cast(tf.gather(
        m, tf.minimum(c.rows, m.shape[0] - 1)), s.dtype)  # Sentinels: 0 sums.
            for s, c, m in zip(self._grads.row_sums(weights), counts,
                               self._masks)]


class ScaledGradients(GradientsView):
  """`c * g_iv` for one scalar `c` that does not depend on the data.

  Answered from `g`'s own statistics (norms times `c^2`, dots and sums times
  `c`): nothing is formed that `g` would not form. Adaptive clipping hands a
  privatizer its gradients scaled so that its fixed clip norms act as the
  adapted ones.
  """

  def __init__(self, grads: PerExampleGradients, scale: tf.Tensor):
    super().__init__(grads)
    self._scale = tf.cast(scale, tf.float32)

  def sq_norms(self):
    return [n * tf.square(self._scale) for n in self._grads.sq_norms()]

  def dots(self, directions, rows=None):
    return [None if d is None else d * self._scale
            for d in self._grads.dots(directions, rows)]

  def masked_sq_norms(self, masks):
    return [n * tf.square(self._scale)
            for n in self._grads.masked_sq_norms(masks)]

  def weighted_sum(self, weights):
    return self._grads.weighted_sum(weights * self._scale)

  def weighted_sums(self, weights, rows=None):
    return self._grads.weighted_sums(weights * self._scale, rows)

  def cross_gram_forms(self, other):
    return self._grads.cross_gram_forms(other)

  def cross_grams(self, other, spans, dtype=tf.float32):
    return [None if g is None else g * tf.cast(self._scale, g.dtype)
            for g in self._grads.cross_grams(other, spans, dtype)]

  def materialized(self):
    return [g * tf.cast(self._scale, g.dtype)
            for g in self._grads.materialized()]

  def row_sums(self, weights):
    return self._grads.row_sums(weights * self._scale)

  def weighted_sum_of(self, weights, wanted):
    return self._grads.weighted_sum_of(weights * self._scale, wanted)


def as_per_example_gradients(
    grads: Union[PerExampleGradients, Sequence[tf.Tensor]]
) -> PerExampleGradients:
  """`grads` as a `PerExampleGradients` (a list of `[B, ...]` tensors too)."""
  if isinstance(grads, PerExampleGradients):
    return grads
  return MaterializedGradients(grads)


class Deferred(PerExampleGradients):
  """Per-example gradients built where they are first used.

  A model made private hands its public gradients this way: their forward
  and backward passes are built by the first method called, in the graph
  context of that call, so a branch that never calls one (GEP between
  refreshes of its basis, in a `tf.cond`) never runs them. Use the value
  in one graph context only. `masked` stays deferred.
  """

  def __init__(self, build: Callable[[], Union[PerExampleGradients,
                                                 Sequence[tf.Tensor]]]):
    self._build = build
    self._value = None

  def get(self) -> PerExampleGradients:
    if self._value is None:
      self._value = as_per_example_gradients(self._build())
    return self._value

  @property
  def shapes(self):
    return self.get().shapes

  @property
  def dtypes(self):
    return self.get().dtypes

  def batch_size(self):
    return self.get().batch_size()

  def sq_norms(self):
    return self.get().sq_norms()

  def dots(self, directions, rows=None):
    return self.get().dots(directions, rows)

  def masked_sq_norms(self, masks):
    return self.get().masked_sq_norms(masks)

  def weighted_sum(self, weights):
    return self.get().weighted_sum(weights)

  def weighted_sums(self, weights, rows=None):
    return self.get().weighted_sums(weights, rows)

  def materialized(self):
    return self.get().materialized()

  def cross_gram_forms(self, other):
    return self.get().cross_gram_forms(other)

  def cross_grams(self, other, spans, dtype=tf.float32):
    return self.get().cross_grams(other, spans, dtype)

  def masked(self, masks):
    return Deferred(lambda: self.get().masked(masks))

  def row_gathered(self):
    return self.get().row_gathered()

  def rows_touched(self):
    return self.get().rows_touched()

  def row_counts(self, weights):
    return self.get().row_counts(weights)

  def row_sums(self, weights):
    return self.get().row_sums(weights)

  def weighted_sum_of(self, weights, wanted):
    return self.get().weighted_sum_of(weights, wanted)
