"""Per-example gradients: the value privatizers read, and its sources.

The compile-path engine (`jacobian`) is the one tensorflow-privacy's
vectorized optimizers use: the Jacobian of the per-example (or
per-microbatch) loss vector with respect to every trainable variable. It is
correct for any Keras model; its cost grows with the square of the batch.

The engine of models made private (`tfdpx.keras.recorder.model_gradients`)
costs one batched forward and one batched backward pass, after which each
layer call is a *unit* (`tfdpx.forms`) and `UnitGradients` answers a
privatizer's questions unit by unit: linear in the batch, and without forming
per-example gradients where a layer family has a cheaper exact form.

Records are examples, or microbatch means (`microbatched`: the one place
microbatches are formed). Records whose gradient is not finite are dropped
(zeroed) before any privatizer sees them. See docs/per_example.md.
"""

import functools
from typing import Any, List, NamedTuple, Optional, Sequence

import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients
from tfdpx import lanes
from tfdpx.forms import unit as unit_lib

# `weighted_sums` of a layer whose per-example gradient has at most this many
# entries: one contraction of its materialized gradients (formed once, B times
# this size); of a larger layer, its unit's `weighted_sums` (one matmul for all
# columns, or a backward-like pass per column), never its per-example gradients.
SMALL_UNIT_SIZE = 16384

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


def variable_key(variable):
  """A key equal for a variable and the mixed-precision wrapper around it.

  A mixed-precision AutoCastVariable and the variable it wraps (which a tape
  reports as read) share a handle.
  """
  return variable.handle.ref()


class GradientResult(NamedTuple):
  """What one pass of the engine of models made private computes.

  Attributes:
    grads: the per-example gradients of `var_list`, a
      `gradients.PerExampleGradients` that answers statistics on demand.
    outputs: the model's outputs on the batch (for metrics).
    losses: the `[B]` per-example losses (NaN where an example's is).
    regularization_loss: the sum of `model.losses`, or None if there are none.
    regularization_grads: its gradient, one tensor per variable (None for a
      variable no regularizer reads), or None.

  How many examples were dropped for a non-finite gradient is
  `grads.dropped_records()`, asked for after the privatizer's statistics: the
  first statistic a unit answers decides whether it keeps its per-example
  kernel gradients (`tfdpx.forms.dense.ProductUnit`).
  """
  grads: gradients.PerExampleGradients
  outputs: Any
  losses: tf.Tensor
  regularization_loss: Optional[tf.Tensor]
  regularization_grads: Optional[List[tf.Tensor]]


class UnitGradients(gradients.PerExampleGradients):
  """The per-example gradients of a model's variables, answered by its units.

  A variable read by exactly one unit (layer call) takes that unit's forms. A
  variable read by several (a layer called twice, tied weights) takes the sum
  of their materialized shares: the norm of a sum is not the sum of the
  norms. A variable read by none has zero gradients. An example whose
  gradient is not finite (its squared norm is NaN or infinite) is dropped:
  every statistic is zero on its row and it has no weight in a sum, whatever
  its values (selects, never `0 * NaN`).
  """

  def __init__(self, var_list: Sequence[tf.Variable],
               units: Sequence[unit_lib.Unit], batch_size: tf.Tensor):
    self._vars = list(var_list)
    self._units = list(units)
    self._batch = batch_size
    index = {variable_key(v): i for i, v in enumerate(self._vars)}
    self._readers = {}  # Variable index -> [(unit, position in the unit)].
    for unit in self._units:
      for j, v in enumerate(unit.variables):
        i = index.get(variable_key(v))
        if i is not None:
          self._readers.setdefault(i, []).append((unit, j))
    self._shared_grads = None
    self._raw_sq_norms = None
    self._keep = None

  @property
  def shapes(self):
    return [v.shape for v in self._vars]

  @property
  def dtypes(self):
    return [v.dtype for v in self._vars]

  def batch_size(self):
    return self._batch

  # --- assembling the units' answers -----------------------------------------

  def _shared(self):
    """`i -> [B, *shape]` for the variables several units read."""
    if self._shared_grads is None:
      self._shared_grads, formed = {}, {}
      for i, readers in self._readers.items():
        if len(readers) < 2:
          continue
        shares = []
        for unit, j in readers:
          if id(unit) not in formed:
            formed[id(unit)] = unit.materialized()
          shares.append(tf.cast(formed[id(unit)][j], self._vars[i].dtype))
        self._shared_grads[i] = tf.add_n(shares)
    return self._shared_grads

  def _collect(self, of_unit, of_shared, of_unread):
    """One answer per variable.

    Args:
      of_unit: `of_unit(unit, wanted)` answers for the unit's variables;
        `wanted[j]` is the index in `var_list` of the unit's variable `j`
        where this unit alone reads it, else None (its answer is ignored).
      of_shared: `of_shared(i, per_example)` for a variable several units
        read.
      of_unread: `of_unread(i)` for a variable no unit reads.
    """
    # In lanes (tfdpx.lanes), not all at once, to bound the peak; the last
    # layer's first: its output gradient is ready first.
    asked = []  # (wanted, the unit's computation)
    for unit in reversed(self._units):
      wanted = [None] * len(unit.variables)
      for i, readers in self._readers.items():
        if len(readers) == 1 and readers[0][0] is unit:
          wanted[readers[0][1]] = i
      if any(w is not None for w in wanted):
        asked.append((wanted, functools.partial(of_unit, unit, wanted)))
    answers = {}
    for (wanted, _), unit_answers in zip(
        asked, lanes.in_lanes(compute for _, compute in asked)):
      for j, answer in enumerate(unit_answers):
        if wanted[j] is not None:
          answers[wanted[j]] = answer
    shared = self._shared() if any(
        len(r) > 1 for r in self._readers.values()) else {}
    return [answers[i] if i in answers else
            of_shared(i, shared[i]) if i in shared else of_unread(i)
            for i in range(len(self._vars))]

  def _zeros(self, *shape):
    return tf.zeros(tf.concat([[self._batch], shape], 0), tf.float32)

  def _keep_rows(self) -> tf.Tensor:
    """`[B]` bool: the examples whose gradient is finite."""
    if self._keep is None:
      self._raw_sq_norms = self._collect(
          lambda unit, wanted: unit.sq_norms(),
          lambda i, g: gradients.MaterializedGradients([g]).sq_norms()[0],
          lambda i: self._zeros())
      self._keep = tf.math.is_finite(tf.add_n(self._raw_sq_norms))
    return self._keep

  def _kept(self, statistics):
    keep = self._keep_rows()
    return [None if s is None else clipping.zero_rows(s, keep)
            for s in statistics]

  def _kept_weights(self, weights: tf.Tensor) -> tf.Tensor:
    """float32 `weights` (`[B]` or `[B, K]`), zero on the dropped examples:
    a dropped example has no weight in any sum, whatever its values."""
    weights = tf.cast(weights, tf.float32)
    keep = self._keep_rows()
    if weights.shape.rank == 2:
      keep = keep[:, tf.newaxis]
    return tf.where(keep, weights, 0.0)

  def dropped_records(self) -> tf.Tensor:
    """The int32 number of examples dropped for a non-finite gradient."""
    return tf.reduce_sum(tf.cast(tf.logical_not(self._keep_rows()), tf.int32))

  # --- the statistics --------------------------------------------------------

  def sq_norms(self):
    self._keep_rows()
    return self._kept(self._raw_sq_norms)

  def dots(self, directions, rows=None):
    if len(directions) != len(self._vars):
      raise ValueError(f'directions has {len(directions)} entries for '
                       f'{len(self._vars)} variables')
    rows = rows or [None] * len(self._vars)

    def of_unit(unit, wanted):
      return unit.dots([None if i is None else directions[i] for i in wanted],
                       [None if i is None else rows[i] for i in wanted])

    def of_shared(i, g):
      return gradients.MaterializedGradients([g]).dots([directions[i]],
                                                       [rows[i]])[0]

    def of_unread(i):
      d = directions[i]
      return None if d is None else self._zeros(d.shape[0])

    return self._kept(self._collect(of_unit, of_shared, of_unread))

  def masked_sq_norms(self, masks):
    if len(masks) != len(self._vars):
      raise ValueError(f'masks has {len(masks)} entries for '
                       f'{len(self._vars)} variables')

    def of_unit(unit, wanted):
      return unit.masked_sq_norms([
          masks[i] if i is not None else tf.ones(v.shape, v.dtype)
          for i, v in zip(wanted, unit.variables)])

    def of_shared(i, g):
      return gradients.MaterializedGradients([g]).masked_sq_norms(
          [masks[i]])[0]

    return self._kept(self._collect(of_unit, of_shared,
                                    lambda i: self._zeros()))

  def weighted_sum(self, weights):
    return self.weighted_sum_of(weights, [True] * len(self._vars))

  def weighted_sum_of(self, weights, wanted):
    keep = self._keep_rows()
    weights = self._kept_weights(weights)

    def of_unit(unit, indices):
      if not any(i is not None and wanted[i] for i in indices):
        return [None] * len(indices)  # None of its variables asked for.
      return unit.weighted_sum(weights, keep)

    def of_shared(i, g):
      if not wanted[i]:
        return None
      return tf.tensordot(tf.cast(weights, g.dtype),
                          clipping.zero_rows(g, keep), axes=1)

    def of_unread(i):
      return tf.zeros_like(self._vars[i]) if wanted[i] else None

    sums = self._collect(of_unit, of_shared, of_unread)
    return [tf.cast(s, v.dtype) if w else None
            for s, v, w in zip(sums, self._vars, wanted)]

  def weighted_sums(self, weights, rows=None):
    keep = self._keep_rows()
    weights = self._kept_weights(weights)
    needed = [True] * len(self._vars) if rows is None else [
        r is not None for r in rows]
    rows = rows or [None] * len(self._vars)

    def contraction(g, r):
      return tf.tensordot(tf.cast(weights, g.dtype),
                          gradients.slice_rows(clipping.zero_rows(g, keep), r),
                          axes=[[0], [0]])

    def of_unit(unit, wanted):
      if not any(i is not None and needed[i] for i in wanted):
        return [None] * len(wanted)  # None of its variables asked for.
      unit_rows = [None if i is None else rows[i] for i in wanted]
      size = sum(v.shape.num_elements() for v in unit.variables)
      if size <= SMALL_UNIT_SIZE:
        return [contraction(g, r)
                for g, r in zip(unit.materialized(), unit_rows)]
      return unit.weighted_sums(weights, keep, unit_rows)

    def of_shared(i, g):
      return contraction(g, rows[i]) if needed[i] else None

    def of_unread(i):
      if not needed[i]:
        return None
      shape = self._vars[i].shape.as_list()
      if rows[i] is not None:
        shape[0] = rows[i][1] - rows[i][0]
      return tf.zeros([weights.shape[1], *shape], self._vars[i].dtype)

    sums = self._collect(of_unit, of_shared, of_unread)
    return [tf.cast(s, v.dtype) if wanted else None
            for s, v, wanted in zip(sums, self._vars, needed)]

  # --- row forms ---------------------------------------------------------------

  def _row_unit(self, i):
    """The unit answering variable `i`'s row forms, or None."""
    readers = self._readers.get(i, [])
    if len(readers) == 1 and readers[0][0].row_gathered:
      return readers[0][0]
    return None

  def row_gathered(self):
    return [self._row_unit(i) is not None for i in range(len(self._vars))]

  def _row_answers(self, answer):
    return [None if unit is None else answer(unit)[0]
            for unit in map(self._row_unit, range(len(self._vars)))]

  def rows_touched(self):
    keep = self._keep_rows()
    return self._row_answers(lambda unit: unit.rows_touched(keep))

  def row_counts(self, weights):
    weights = self._kept_weights(weights)
    return self._row_answers(lambda unit: unit.row_counts(weights))

  def row_sums(self, weights):
    keep = self._keep_rows()
    weights = self._kept_weights(weights)
    return self._row_answers(lambda unit: unit.row_sums(weights, keep))

  def _pair(self, i, other: 'UnitGradients'):
    """`(unit, position, other's unit)` if variable `i` has a cross Gram form
    with `other`, `()` if neither batch reads it (zero), else None."""
    mine, theirs = self._readers.get(i), other._readers.get(i)  # pylint: disable=protected-access
    if mine is None and theirs is None:
      return ()
    if (mine is None or theirs is None or len(mine) > 1 or len(theirs) > 1 or
        mine[0][1] != theirs[0][1] or
        not mine[0][0].cross_gram_form(theirs[0][0])):
      return None
    return mine[0][0], mine[0][1], theirs[0][0]

  def cross_gram_forms(self, other):
    if not isinstance(other, UnitGradients) or other.shapes != self.shapes:
      return [False] * len(self._vars)
    return [self._pair(i, other) is not None for i in range(len(self._vars))]

  def cross_grams(self, other, spans, dtype=tf.float32):
    keep = self._cross_keep(other)
    return [None if g is None else tf.where(keep, g, tf.zeros_like(g))
            for g in self._unmasked_cross_grams(other, spans, dtype)]

  def cross_gram(self, other, spans, dtype=tf.float32):
    # One mask on the sum: a dropped example's entries are not finite in
    # every term, so in the sum.
    grams = [g for g in self._unmasked_cross_grams(other, spans, dtype)
             if g is not None]
    total = tf.add_n(grams)
    return tf.where(self._cross_keep(other), total, tf.zeros_like(total))

  def _cross_keep(self, other):
    """`[B, M]`: whether both examples of an entry are kept; a dropped
    example (not finite) of either batch has no share."""
    return tf.logical_and(self._keep_rows()[:, tf.newaxis],
                          other._keep_rows()[tf.newaxis, :])  # pylint: disable=protected-access

  def _unmasked_cross_grams(self, other, spans, dtype):
    forms = self.cross_gram_forms(other)
    answers = {}  # id(unit) -> that unit's answer for all its spans.
    out = []
    for i, span in enumerate(spans):
      if span is None:
        out.append(None)
        continue
      if not forms[i]:
        raise ValueError(f'variable {i} ({self._vars[i].name}) has no cross '
                         'Gram form (check cross_gram_forms first)')
      pair = self._pair(i, other)
      if not pair:  # Read by neither batch: zero gradients.
        out.append(tf.zeros([self._batch, other.batch_size()], dtype))
        continue
      unit, position, other_unit = pair
      if id(unit) not in answers:
        index = {variable_key(v): j for j, v in enumerate(self._vars)}
        answers[id(unit)] = unit.cross_grams(other_unit, [
            spans[index[variable_key(v)]] if variable_key(v) in index
            else None for v in unit.variables], dtype)
      out.append(answers[id(unit)][position])
    return out

  def materialized(self):
    keep = self._keep_rows()

    def of_unread(i):
      v = self._vars[i]
      return tf.zeros(tf.concat([[self._batch], tf.shape(v)], 0), v.dtype)

    grads = self._collect(lambda unit, wanted: unit.materialized(),
                          lambda i, g: g, of_unread)
    return [clipping.zero_rows(tf.cast(g, v.dtype), keep)
            for g, v in zip(grads, self._vars)]


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




def microbatched(grads: gradients.PerExampleGradients,
                 num_microbatches: Optional[int]
                 ) -> gradients.PerExampleGradients:
  """The records: each example's gradient, or each microbatch's mean.

  A microbatch's gradient is not a per-example statistic (the norm of a mean
  is not a mean of norms), so microbatch records are materialized: the one
  path that forms every per-example gradient.
  """
  if not num_microbatches:
    return grads
  return gradients.MaterializedGradients(
      microbatch_means(grads.materialized(), num_microbatches))


def user_records(grads: gradients.PerExampleGradients,
                 examples_per_user: int) -> gradients.PerExampleGradients:
  """One record per user: the sum of each `examples_per_user` consecutive rows.

  The batch layout of `tfdpx.sampling.poisson_user_batches` (a user per slot
  of that many rows, unused rows zero). The norm of a sum is not a sum of
  norms, so user records are materialized, as microbatch records are.

  Raises:
    ValueError: if the batch size is not a multiple of `examples_per_user`.
  """
  per_example = grads.materialized()
  rows = per_example[0].shape[0]
  if rows is not None and rows % examples_per_user:
    raise ValueError(
        f'a batch of {rows} rows is not a whole number of user slots of '
        f'examples_per_user={examples_per_user} rows; build the batches with '
        'tfdpx.sampling.poisson_user_batches and the same examples_per_user')
  return gradients.MaterializedGradients([
      tf.reduce_sum(tf.reshape(g, tf.concat(
          [[-1, examples_per_user], tf.shape(g)[1:]], 0)), axis=1)
      for g in per_example])

