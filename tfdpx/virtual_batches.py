"""Virtual batches: one logical batch privatized from several physical ones.

A privatizer's step is `prepare` (from public data and the state), then
`clipped_sums` (sums over the batch of per-example terms, the only part that
reads private data), then `release` (noise on the global sums). The clipped
sums of a logical batch are the sums of its physical batches' clipped sums,
so the logical batch is processed `physical_batch_size` rows at a time, in a
`tf.while_loop` that keeps one physical batch's activations and per-example
statistics alive at a time, and released once: one noise draw, one privacy
event, whatever the number of physical batches. The release equals that of
the logical batch processed whole, up to the order of float additions.
"""

from typing import Any, Callable, Tuple

import tensorflow as tf

from tfdpx import core
from tfdpx import gradients

# `chunk(i)` -> the per-example gradients of physical batch `i`, and a
# function called after the privatizer read them that returns what else the
# caller wants from that batch (outputs, losses, counts): a nest of tensors
# of equal shapes for every physical batch.
Chunk = Callable[[tf.Tensor], Tuple[gradients.PerExampleGradients,
                                    Callable[[], Any]]]


def split(tensors: Any, physical_batch_size: int) -> Tuple[Any, tf.Tensor]:
  """Splits a batch into physical batches of `physical_batch_size` rows.

  Args:
    tensors: a nest of `[n, ...]` tensors (inputs, labels, sample weights).
    physical_batch_size: rows per physical batch, p.

  Returns:
    `(chunks, num_chunks)`: each tensor as `[k, p, ...]` with
    `k = ceil(n / p)` (an int32 scalar, static when `n` is), the last
    physical batch padded with zero rows; pass sample weights that are 0 on
    those rows (`sample_weights`), so that they add nothing to any sum.
  """
  flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten(tensors)]
  rows = tf.shape(flat[0])[0]
  num_chunks = (rows + physical_batch_size - 1) // physical_batch_size
  static_rows = flat[0].shape[0]
  static_chunks = (None if static_rows is None else
                   -(-static_rows // physical_batch_size))

  def chunked(t):
    padding = num_chunks * physical_batch_size - rows
    padded = tf.pad(t, [[0, padding]] + [[0, 0]] * (t.shape.rank - 1))
    out = tf.reshape(padded, tf.concat(
        [[num_chunks, physical_batch_size], tf.shape(t)[1:]], 0))
    out.set_shape([static_chunks, physical_batch_size] + t.shape[1:])
    return out

  chunks = tf.nest.pack_sequence_as(tensors, [chunked(t) for t in flat])
  if static_chunks is not None:
    num_chunks = tf.constant(static_chunks, tf.int32)
  return chunks, num_chunks


def sample_weights(sample_weight, num_rows: tf.Tensor) -> tf.Tensor:
  """The batch's sample weights (1 if None), to `split` with the batch."""
  if sample_weight is None:
    return tf.ones([num_rows], tf.float32)
  return sample_weight


def update(privatizer: core.Privatizer, state: core.State, seed: tf.Tensor,
           num_chunks: tf.Tensor, chunk: Chunk,
           public_grads=None) -> Tuple[Any, core.State, Any]:
  """`privatizer.update` of a logical batch given as `num_chunks` parts.

  Args:
    privatizer: the noise step; it must implement `clipped_sums` and
      `release` (all of tfdpx's do).
    state, seed: as `Privatizer.update`.
    num_chunks: the number of physical batches, >= 1.
    chunk: `chunk(i)` gives physical batch `i`'s per-example gradients and a
      function that returns its extras (see `Chunk`).
    public_grads: as `Privatizer.update`; computed once per logical batch.

  Returns:
    `(noisy_sum, new_state, extras)`: the release, the next state, and each
    extra stacked over the physical batches (`[k, ...]`).
  """
  if public_grads is not None:
    public_grads = gradients.as_per_example_gradients(public_grads)
  # The first physical batch outside the loop: `prepare` may look at the
  # layout and forms of the private gradients (never at their values).
  grads, extras_of = chunk(tf.constant(0))
  plan = privatizer.prepare(state, seed, grads, public_grads)
  sums = privatizer.clipped_sums(grads, state, plan)
  extras = extras_of()
  flat_extras = tf.nest.flatten(extras)
  arrays = [tf.TensorArray(e.dtype, size=num_chunks, element_shape=e.shape)
            .write(0, e) for e in flat_extras]

  def body(i, sums, arrays):
    grads, extras_of = chunk(i)
    more = privatizer.clipped_sums(grads, state, plan)
    extras = tf.nest.flatten(extras_of())
    return (i + 1, privatizer.add_sums(sums, more),
            [a.write(i, e) for a, e in zip(arrays, extras)])

  # One physical batch at a time: that is the memory the loop is for.
  _, sums, arrays = tf.while_loop(
      lambda i, *_: i < num_chunks, body, (tf.constant(1), sums, arrays),
      shape_invariants=(tf.TensorShape([]), privatizer.sums_shapes(sums),
                        [tf.TensorShape(None)] * len(arrays)),
      parallel_iterations=1)
  noisy_sum, new_state = privatizer.release(privatizer.global_sums(sums), state,
                                            plan, seed)
  return noisy_sum, new_state, tf.nest.pack_sequence_as(
      extras, [a.stack() for a in arrays])
