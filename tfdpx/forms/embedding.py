"""Per-example gradients of an embedding table from the rows of the tokens present.

Example `i` looks up ids `ids_i` (`[T]`) and gets output gradients `D_i`
(`[T, dim]`). Its gradient is zero except on the rows of its ids: row `u` is
the sum of `D_i[t]` over the positions `t` with `ids_i[t] = u`. So each
(example, id) pair present in the batch is one row `R` of a segment sum, and
every statistic is a segment sum over those rows. Cost `O(B T dim)` (plus a
sort of the `B T` ids); a `[B, vocab, dim]` tensor is formed only by
`materialized()`, the escape hatch.
"""

import tensorflow as tf

from tfdpx import clipping
from tfdpx.forms import unit


class EmbeddingUnit(unit.Unit):
  """The share of an embedding lookup `table[ids]` of the per-example gradients."""

  def __init__(self, table: tf.Variable, ids: tf.Tensor, tap_grad: tf.Tensor):
    """Args:
      table: the `[vocab, dim]` embedding variable.
      ids: the looked-up ids, `[B, ...]` (integer or integral float).
      tap_grad: the gradient of the lookup's output, `[B, ..., dim]`.
    """
    super().__init__([table])
    self._table = table
    self._vocab, self._dim = table.shape
    batch = tf.shape(tap_grad)[0]
    self._batch = batch
    ids = tf.reshape(tf.cast(ids, tf.int64), [batch, -1])
    example = tf.broadcast_to(tf.range(batch, dtype=tf.int64)[:, tf.newaxis],
                              tf.shape(ids))
    keys = tf.reshape(example * self._vocab + ids, [-1])
    # One segment per (example, id) pair present, by sorting (tf.unique has
    # no XLA kernel); segments past the number of pairs stay empty (zero).
    order = tf.argsort(keys)
    keys = tf.gather(keys, order)
    first = tf.concat([[True], tf.not_equal(keys[1:], keys[:-1])], axis=0)
    segment = tf.cumsum(tf.cast(first, tf.int32)) - 1
    slots = tf.size(keys)
    pair = tf.maximum(
        tf.math.unsorted_segment_max(keys, segment, slots), 0)
    self._example = tf.cast(pair // self._vocab, tf.int32)  # Of each slot.
    self._id = tf.cast(pair % self._vocab, tf.int32)
    self._rows = tf.math.unsorted_segment_sum(
        tf.gather(tf.reshape(tap_grad, [-1, self._dim]), order), segment,
        slots)

  def _per_example(self, per_pair: tf.Tensor) -> tf.Tensor:
    """Sums a `[U, ...]` statistic of the pairs over each example's pairs."""
    return tf.math.unsorted_segment_sum(per_pair, self._example, self._batch)

  def sq_norms(self):
    rows = tf.cast(self._rows, tf.float32)
    return [self._per_example(tf.reduce_sum(tf.square(rows), axis=1))]

  def _window(self, rows):
    """`(ids, inside, size)` of the pairs on the table rows `rows`.

    `ids` are the pairs' ids relative to `rows[0]` (0 for a pair outside),
    `inside` says which pairs lie in `rows` (None: all), `size` the number of
    table rows.
    """
    if rows is None:
      return self._id, None, self._vocab
    start, stop = rows
    inside = tf.logical_and(self._id >= start, self._id < stop)
    return tf.where(inside, self._id - start, 0), inside, stop - start

  def dots(self, directions, rows=None):
    if directions[0] is None:
      return [None]
    ids, inside, _ = self._window(rows[0] if rows else None)
    rows = tf.cast(self._rows, tf.float32)

    def one(direction):
      picked = tf.gather(tf.cast(direction, tf.float32), ids)
      per_pair = tf.reduce_sum(picked * rows, axis=1)
      if inside is not None:
        per_pair = tf.where(inside, per_pair, 0.0)
      return self._per_example(per_pair)

    # One direction at a time, no [k, U, dim] tensor: each gathers a [U, dim]
    # one, as large as the batch's embedding output.
    dots = tf.map_fn(one, directions[0], parallel_iterations=1,
                     fn_output_signature=tf.TensorSpec([None], tf.float32))
    return [tf.transpose(dots)]

  def masked_sq_norms(self, masks):
    picked = tf.gather(tf.cast(masks[0], tf.float32), self._id)
    rows = tf.cast(self._rows, tf.float32)
    return [self._per_example(tf.reduce_sum(picked * tf.square(rows),
                                            axis=1))]

  def weighted_sum(self, weights, keep, rows=None):
    ids, inside, size = self._window(rows[0] if rows else None)
    kept = tf.gather(keep, self._example)
    if inside is not None:
      kept = tf.logical_and(kept, inside)
    rows = clipping.zero_rows(self._rows, kept)
    scale = tf.cast(tf.gather(weights, self._example), rows.dtype)
    # Dense [vocab, dim]: the noise covers the rows no example touched too.
    total = tf.math.unsorted_segment_sum(rows * scale[:, tf.newaxis], ids,
                                         size)
    return [tf.cast(total, self._table.dtype)]

  def materialized(self):
    flat = tf.math.unsorted_segment_sum(
        self._rows, self._example * self._vocab + self._id,
        self._batch * self._vocab)
    return [tf.reshape(flat, [-1, self._vocab, self._dim])]
