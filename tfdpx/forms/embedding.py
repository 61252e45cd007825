"""Per-example gradients of an embedding table from the rows of the tokens present.

Example `i` looks up ids `ids_i` (`[T]`) and gets output gradients `D_i`
(`[T, dim]`). Its gradient is zero except on the rows of its ids: row `u` is
the sum of `D_i[t]` over the positions `t` with `ids_i[t] = u`. So each
(example, id) pair present in the batch is one row `R` of a segment sum, and
every statistic is a segment sum over those rows. Cost `O(B T dim)` (plus a
sort of the `B T` ids); a `[B, vocab, dim]` tensor is formed only by
`materialized()`, the escape hatch. Inner products with the gradients of
another batch (`cross_grams`) join the two batches' pairs on their ids.
"""

import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients
from tfdpx import xla
from tfdpx.forms import unit


# Joined pairs whose rows `cross_grams` gathers at a time.
JOIN_CHUNK = 2**13


def sorted_segment_sum(data: tf.Tensor, segment_ids: tf.Tensor,
                       num_segments) -> tf.Tensor:
  """`tf.math.unsorted_segment_sum` for non-decreasing `segment_ids`.

  Outside XLA: `tf.math.segment_sum`, padded to `num_segments` rows.
  TensorFlow 2.21's CPU `UnsortedSegmentSum` takes 2.4 times as long as
  `SegmentSum` on the text benchmark's `[32768, 64]` rows (2.1 against
  0.9 ms; 2.15: 1.0 against 0.9). XLA has no `SegmentSum` whose output size
  depends on the data, so under XLA the unsorted op stays.
  """
  if xla.in_xla():
    return tf.math.unsorted_segment_sum(data, segment_ids, num_segments)
  sums = tf.math.segment_sum(data, segment_ids)
  padding = [[0, num_segments - tf.shape(sums)[0]]] + [[0, 0]] * (
      data.shape.rank - 1)
  sums = tf.pad(sums, padding)
  # As static as the unsorted op's: callers read the table's shape from it.
  sums.set_shape([tf.get_static_value(num_segments)] + data.shape[1:])
  return sums


def _starts(sorted_keys: tf.Tensor) -> tf.Tensor:
  """`[n]` bool: where a run of equal keys starts (empty for `n = 0`)."""
  return tf.concat([tf.ones_like(sorted_keys[:1], tf.bool),
                    tf.not_equal(sorted_keys[1:], sorted_keys[:-1])], 0)


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
    batch64 = tf.cast(batch, tf.int64)
    example = tf.broadcast_to(tf.range(batch64)[:, tf.newaxis], tf.shape(ids))
    # Id-major keys: the pairs come out sorted by id, so the weighted sum
    # into the table is a sorted segment sum too.
    keys = tf.reshape(ids * batch64 + example, [-1])
    # One segment per (example, id) pair present, by sorting (tf.unique has
    # no XLA kernel).
    order = tf.argsort(keys)
    keys = tf.gather(keys, order)
    first = _starts(keys)
    segment = tf.cumsum(tf.cast(first, tf.int32)) - 1
    grads = tf.gather(tf.reshape(tap_grad, [-1, self._dim]), order)
    if xla.in_xla():
      # Static shapes: a slot per lookup. The slots past the number of pairs
      # stay empty (zero rows) and take the last pair's key, so that ids
      # stay sorted; each segment's key is read at its first position (an
      # int32 segment minimum: int64 segment reductions have no GPU kernel).
      slots = tf.size(keys)
      self._pairs = tf.reduce_sum(tf.cast(first, tf.int32))
      start = tf.math.unsorted_segment_min(tf.range(slots), segment, slots)
      pair = tf.gather(keys, tf.gather(
          start, tf.minimum(tf.range(slots), self._pairs - 1)))
      self._rows = tf.math.unsorted_segment_sum(grads, segment, slots)
    else:
      # A slot per pair (`_pairs` None): no empty slots to fill and pad
      # (the pads alone took 1.5 ms of the text benchmark's step).
      self._pairs = None
      pair = tf.boolean_mask(keys, first)
      self._rows = tf.math.segment_sum(grads, segment)
    self._example = tf.cast(pair % batch64, tf.int32)
    self._id = tf.cast(pair // batch64, tf.int32)
    self._sq_norms = None
    self._starts = None
    self._segments = None

  def _per_example(self, per_pair: tf.Tensor) -> tf.Tensor:
    """Sums a `[U, ...]` statistic of the pairs over each example's pairs."""
    return tf.math.unsorted_segment_sum(per_pair, self._example, self._batch)

  def _pair_sq_norms(self) -> tf.Tensor:
    """`|row|^2` of each pair's gradient row, float32 `[slots]` (once)."""
    if self._sq_norms is None:
      self._sq_norms = gradients.row_sq_norms(tf.cast(self._rows, tf.float32))
    return self._sq_norms

  def sq_norms(self):
    return [self._per_example(self._pair_sq_norms())]

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
    # one, as large as the batch's embedding output. A loop over indices,
    # not tf.map_fn, whose unstacking copies all k directions first (GEP:
    # k of them the size of the table, 6 of 32 ms on the text model).
    stacked = tf.convert_to_tensor(directions[0])
    count = tf.shape(stacked)[0]
    _, dots = tf.while_loop(
        lambda c, _: c < count,
        lambda c, dots: (c + 1, dots.write(c, one(stacked[c]))),
        (tf.constant(0), tf.TensorArray(tf.float32, count)),
        parallel_iterations=1)
    return [tf.transpose(tf.reshape(dots.stack(), [count, -1]))]

  def masked_sq_norms(self, masks):
    picked = tf.gather(tf.cast(masks[0], tf.float32), self._id)
    rows = tf.cast(self._rows, tf.float32)
    return [self._per_example(tf.reduce_sum(picked * tf.square(rows),
                                            axis=1))]

  def weighted_sum(self, weights, keep, rows=None):
    window = rows[0] if rows else None
    example, pair_rows = self._example, self._rows
    if window is not None and not xla.in_xla():
      # The pairs are sorted by id: those on the window's rows are one run
      # of slots, summed alone (GEP's groups cut the table into windows;
      # masking every pair per window did each group's work on all pairs).
      # Under XLA the run's length would be a dynamic shape.
      start, stop = window
      first, last = (tf.reduce_sum(tf.cast(self._id < bound, tf.int32))
                     for bound in window)
      example, pair_rows = example[first:last], pair_rows[first:last]
      ids, inside, size = self._id[first:last] - start, None, stop - start
    else:
      ids, inside, size = self._window(window)
    rows = clipping.zero_rows(pair_rows, tf.gather(keep, example),
                              many_rows=True)
    scale = tf.cast(tf.gather(weights, example), rows.dtype)
    if inside is not None:
      # A kept example's rows are finite (so is its norm): outside the
      # window a zero scale adds exact zeros, with no select over the rows.
      scale = tf.where(inside, scale, tf.zeros_like(scale))
    # Dense [vocab, dim]: the noise covers the rows no example touched too.
    # A window maps the ids outside it to 0: no longer sorted.
    segment_sum = (tf.math.unsorted_segment_sum if inside is not None else
                   sorted_segment_sum)
    total = segment_sum(rows * scale[:, tf.newaxis], ids, size)
    return [tf.cast(total, self._table.dtype)]

  # --- row forms: the touched rows only, never `[vocab, dim]` ----------------

  row_gathered = True

  def _touching(self) -> tf.Tensor:
    """`[slots]` bool: the slots holding a pair whose gradient row is not
    zero (its squared norm is positive): an example touches the rows where
    its gradient is not zero, not merely the ids it looks up, so that a
    padding row of a fixed-shape batch (sample weight 0: zero gradients)
    touches none."""
    return self._filled(self._pair_sq_norms() > 0)

  def _filled(self, mask: tf.Tensor) -> tf.Tensor:
    """`mask` on the slots holding a pair only (all of them outside XLA)."""
    if self._pairs is None:
      return mask
    return tf.logical_and(tf.range(tf.size(self._id)) < self._pairs, mask)

  def _row_starts(self) -> tf.Tensor:
    """`[slots]` bool: the slots where a distinct id starts (pairs are
    sorted by id; the empty slots join the last pair's row), once."""
    if self._starts is None:
      self._starts = _starts(self._id)
    return self._starts

  def _row_segments(self) -> tf.Tensor:
    """Each slot's row among the distinct ids, in order, once."""
    if self._segments is None:
      self._segments = tf.cumsum(tf.cast(self._row_starts(), tf.int32)) - 1
    return self._segments

  def rows_touched(self, keep):
    """`[B]` int32: the rows each kept example touches."""
    counted = tf.logical_and(self._touching(),
                             tf.gather(keep, self._example))
    return [self._per_example(tf.cast(counted, tf.int32))]

  def row_counts(self, weights):
    segment = self._row_segments()
    weight = tf.where(self._touching(), tf.gather(weights, self._example),
                      0.0)
    if self._pairs is None:  # A row per distinct id, no sentinels.
      return [gradients.RowCounts(tf.boolean_mask(self._id, self._row_starts()),
                                  tf.math.segment_sum(weight, segment))]
    slots = tf.size(self._id)
    distinct = tf.reduce_max(segment) + 1
    rows = tf.math.unsorted_segment_min(self._id, segment, slots)
    rows = tf.where(tf.range(slots) < distinct, rows, self._vocab)
    return [gradients.RowCounts(
        rows, tf.math.unsorted_segment_sum(weight, segment, slots))]

  def row_sums(self, weights, keep):
    rows = clipping.zero_rows(self._rows, tf.gather(keep, self._example),
                              many_rows=True)
    scaled = rows * tf.cast(tf.gather(weights, self._example),
                            rows.dtype)[:, tf.newaxis]
    segment = self._row_segments()
    sums = (tf.math.segment_sum(scaled, segment) if self._pairs is None else
            tf.math.unsorted_segment_sum(scaled, segment, tf.size(self._id)))
    return [tf.cast(sums, self._table.dtype)]

  def cross_gram_form(self, other):
    return isinstance(other, EmbeddingUnit) and other._table is self._table  # pylint: disable=protected-access

  def _ids_in(self, first: int, last: int, absent: int) -> tf.Tensor:
    """Each slot's id if it holds a pair with an id in `[first, last]`,
    else `absent`."""
    present = self._filled(tf.logical_and(self._id >= first,
                                          self._id <= last))
    return tf.where(present, self._id, absent)

  def cross_grams(self, other, spans, dtype):
    """`<g_i, h_j>` over the flat span: a join of the pairs on their ids.

    Every (pair of this batch, pair of `other`) with the same id adds the
    inner product of their rows to entry `(example, other example)`; a span
    that starts or stops inside an id's row takes that id's part of the row
    in a join of its own.
    """
    if not self.cross_gram_form(other):
      raise NotImplementedError('cross Grams need the same embedding table')
    if spans[0] is None:
      return [None]
    start, stop = spans[0]
    (first, head), (last, tail) = (divmod(start, self._dim),
                                   divmod(stop, self._dim))
    if first == last:  # Inside one id's row.
      return [self._join(other, first, first, head, tail, dtype)]
    parts = []
    if head:
      parts.append(self._join(other, first, first, head, self._dim, dtype))
      first += 1
    if first < last:
      parts.append(self._join(other, first, last - 1, 0, self._dim, dtype))
    if tail:
      parts.append(self._join(other, last, last, 0, tail, dtype))
    return [tf.add_n(parts)]

  def _join(self, other, first, last, lo, hi, dtype):
    """The cross Gram matrix over ids `[first, last]`, columns `[lo, hi)`.

    The joined pairs are numbered `q = 0 .. total - 1`, my matched pairs'
    blocks one after another, and taken `JOIN_CHUNK` at a time, one chunk
    after another: memory does not grow with their number (all examples
    sharing a frequent token make `B M` joined pairs for it alone). Only
    sorts, gathers and segment sums: `tf.searchsorted` is quadratic under XLA.
    """
    ids = last - first + 1
    mine, theirs = self._ids_in(first, last, -1), other._ids_in(first, last, -1)  # pylint: disable=protected-access
    # Their pairs sorted by id (absent last), and where each id's run starts.
    their_key = tf.where(theirs >= 0, theirs - first, ids)
    order = tf.argsort(their_key, stable=True)
    their_counts = tf.math.unsorted_segment_sum(
        tf.ones_like(their_key), their_key, ids + 1)[:ids]
    their_starts = tf.cumsum(their_counts, exclusive=True)
    # My pairs with a match first (in order), then my block of each.
    my_key = tf.where(mine >= 0, mine - first, 0)
    counts = tf.where(mine >= 0, tf.gather(their_counts, my_key), 0)
    matched = tf.argsort(tf.cast(tf.equal(counts, 0), tf.int32), stable=True)
    counts = tf.gather(counts, matched)
    runs = tf.gather(their_starts, tf.gather(my_key, matched))
    blocks = tf.cumsum(counts, exclusive=True)
    total = tf.reduce_sum(counts)
    # Past the last pair, blocks that start after any chunk.
    padded = tf.concat([blocks, tf.fill([JOIN_CHUNK], total + JOIN_CHUNK)], 0)
    last_pair = tf.size(counts) - 1
    their_rows, their_examples = other._rows, other._example  # pylint: disable=protected-access
    size = other._batch  # pylint: disable=protected-access

    def columns(gathered):  # Sliced after the gather: no copy of all rows.
      if (lo, hi) != (0, self._dim):
        gathered = gathered[:, lo:hi]
      return tf.cast(gathered, dtype)

    def chunk(q0, grams):
      q = q0 + tf.range(JOIN_CHUNK)
      joined = q < total
      # The pair whose block holds q0, then one more for each block that
      # starts inside the chunk (at most JOIN_CHUNK of them).
      first_pair = tf.reduce_sum(tf.cast(blocks <= q0, tf.int32)) - 1
      local = tf.slice(padded, [first_pair + 1], [JOIN_CHUNK]) - q0
      starts = tf.math.unsorted_segment_sum(
          tf.ones_like(local), tf.where(local < JOIN_CHUNK, local, JOIN_CHUNK),
          JOIN_CHUNK + 1)[:JOIN_CHUNK]
      pair = tf.minimum(first_pair + tf.cumsum(starts), last_pair)
      match = tf.gather(order, tf.where(
          joined, tf.gather(runs, pair) + q - tf.gather(blocks, pair), 0))
      mine_slot = tf.gather(matched, pair)
      products = tf.reduce_sum(
          columns(tf.gather(self._rows, mine_slot)) *
          columns(tf.gather(their_rows, match)), axis=1)
      cell = (tf.gather(self._example, mine_slot) * size +
              tf.gather(their_examples, match))
      return q0 + JOIN_CHUNK, grams + tf.math.unsorted_segment_sum(
          tf.where(joined, products, tf.zeros_like(products)), cell,
          self._batch * size)

    # One chunk at a time: in parallel their temporaries would all be alive.
    _, grams = tf.while_loop(
        lambda q0, _: q0 < total, chunk,
        [tf.constant(0, total.dtype), tf.zeros([self._batch * size], dtype)],
        parallel_iterations=1)
    return tf.reshape(grams, [self._batch, size])

  def materialized(self):
    flat = tf.math.unsorted_segment_sum(
        self._rows, self._example * self._vocab + self._id,
        self._batch * self._vocab)
    return [tf.reshape(flat, [-1, self._vocab, self._dim])]
