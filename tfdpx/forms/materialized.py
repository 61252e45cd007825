"""Statistics from per-example gradients formed in chunks of examples.

For small parameters (normalization layers' scale and offset), layers with no
cheaper exact form (the vectorized fallback) and variables shared by several
layer calls. The chunk's gradients are reduced at once to the statistic asked
for, so memory is bounded by the chunk size; when the whole batch's gradients
are small they are formed once and kept for every statistic of the step.
"""

from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients
from tfdpx.forms import chunks
from tfdpx.forms import unit

# Up to this many bytes of per-example gradients a unit keeps them for the
# step instead of forming them again for each statistic.
CACHE_BYTES = 64 * 2**20

GradsOf = Callable[[List[tf.Tensor]], List[tf.Tensor]]
_ROW_NORM = tf.TensorSpec([], tf.float32)


def _weighted_total(grads: Sequence[tf.Tensor], weights, keep):
  return [tf.tensordot(tf.cast(weights, g.dtype), clipping.zero_rows(g, keep),
                       axes=1) for g in grads]


class MaterializedUnit(unit.Unit):
  """A unit whose statistics reduce its materialized per-example gradients."""

  def __init__(self, variables: Sequence[tf.Variable], grads_of: GradsOf,
               elems: Sequence[tf.Tensor], chunk_size: int,
               weighted_sum: Optional[Callable] = None,
               cache_bytes: int = CACHE_BYTES,
               expected_batch_size: Optional[int] = None):
    """Args:
      variables: the variables the unit gives shares of.
      grads_of: maps a chunk of `elems` (`[c, ...]` each) to its per-example
        gradients, one `[c, *var.shape]` tensor per variable.
      elems: the batched tensors `grads_of` needs (leading dimension B).
      chunk_size: the largest number of examples formed at once; None forms
        the whole batch at once (`grads_of(elems)`) and keeps it.
      weighted_sum: optional cheaper exact `weighted_sum(weights, keep)`
        (e.g. a weighted backward pass through the recorded call).
      cache_bytes: keep the whole batch's gradients if they take at most this
        many bytes.
      expected_batch_size: the batch size this decision plans for where the
        static one is unknown (`tf.data ... .batch(B)`): the same choice as
        for a static batch of that size. None: not kept.
    """
    super().__init__(variables)
    self._grads_of = grads_of
    self._elems = list(elems)
    self._chunk_size = chunk_size
    self._weighted_sum = weighted_sum
    batch = self._elems[0].shape[0] if self._elems else None
    if batch is None:
      batch = expected_batch_size
    size = sum(np.prod(v.shape, dtype=np.int64) * tf.as_dtype(v.dtype).size
               for v in self.variables)
    self._cache = chunk_size is None or (batch is not None and
                                         batch * size <= cache_bytes)
    self._grads = None
    self._signature = [tf.TensorSpec(v.shape, v.dtype) for v in variables]

  def _whole(self) -> gradients.MaterializedGradients:
    if self._grads is None:
      if self._chunk_size is None:
        grads = self._grads_of(self._elems)
      else:
        grads = chunks.map_rows(self._grads_of, self._elems,
                                self._chunk_size, self._signature)
      self._grads = gradients.MaterializedGradients(grads)
    return self._grads

  def _reduce(self, statistic, specs):
    """`statistic` of the per-example gradients, row by row over the batch.

    `statistic` maps a `MaterializedGradients` to per-row tensors, one per
    entry of `specs` (their shapes without the batch axis).
    """
    if self._cache:
      return statistic(self._whole())
    return chunks.map_rows(
        lambda chunk: statistic(gradients.MaterializedGradients(
            self._grads_of(chunk))), self._elems, self._chunk_size, specs)

  def sq_norms(self):
    return self._reduce(lambda g: g.sq_norms(),
                        [_ROW_NORM] * len(self.variables))

  def masked_sq_norms(self, masks):
    return self._reduce(lambda g: g.masked_sq_norms(masks),
                        [_ROW_NORM] * len(self.variables))

  def dots(self, directions, rows=None):
    out = [None] * len(directions)
    wanted = [i for i, d in enumerate(directions) if d is not None]
    if wanted:
      found = self._reduce(
          lambda g: [d for d in g.dots(directions, rows) if d is not None],
          [tf.TensorSpec([directions[i].shape[0]], tf.float32)
           for i in wanted])
      for i, d in zip(wanted, found):
        out[i] = d
    return out

  def set_weighted_sum(self, weighted_sum: Callable) -> None:
    """Sets a cheaper exact `weighted_sum(weights, keep)` (see __init__)."""
    self._weighted_sum = weighted_sum

  def weighted_sum(self, weights, keep, rows=None):
    if self._weighted_sum is not None:
      return unit.sliced_sums(self._weighted_sum(weights, keep), rows)
    return unit.sliced_sums(self.materialized_weighted_sum(weights, keep),
                            rows)

  def materialized_weighted_sum(self, weights, keep):
    """`weighted_sum` from the materialized gradients (chunk by chunk)."""
    if self._cache:
      return _weighted_total(self._whole().materialized(), weights, keep)

    def partial(chunk, valid):
      *elems, w, k = chunk
      return _weighted_total(self._grads_of(elems), w,
                             tf.logical_and(k, valid))

    return chunks.sum_rows(partial, self._elems + [weights, keep],
                           self._chunk_size, self._signature)

  def materialized(self):
    return self._whole().materialized()
