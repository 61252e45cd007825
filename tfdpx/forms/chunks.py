"""Running a per-example computation over the batch in chunks of examples.

Memory is then bounded by the chunk size, not by the batch: a chunk's
per-example gradients are formed, reduced at once (to norms, dots or a
weighted partial sum), and dropped before the next chunk.
"""

from typing import Callable, List, Sequence

import tensorflow as tf


def _split(elems: Sequence[tf.Tensor], chunk_size: int):
  """The rows of each chunk, `[num_chunks, c]`, padded by repeating rows.

  `c` is `chunk_size`, or the batch size if smaller: a batch whose size is
  known only at run time (`tf.data ... .batch(B)`) that fits one chunk is
  one chunk of itself, as a static one is (`_fits_one_chunk`), not padded to
  `chunk_size`. Every chunk is a valid batch and shapes stay static under
  XLA; `valid` (`[num_chunks, c]` bool) marks the real rows. A chunk's rows
  are gathered where it is computed (`_rows`), not all chunks up front: that
  copy of the whole batch's inputs and output gradients, made for every
  unit, could be alive for all the units at once.
  """
  batch = tf.shape(elems[0])[0]
  static_batch = elems[0].shape[0]
  static_size = None if static_batch is None else min(static_batch,
                                                      chunk_size)
  # At least 1: a Poisson batch may be empty.
  size = static_size or tf.maximum(tf.minimum(batch, chunk_size), 1)
  num_chunks = (batch + size - 1) // size
  position = tf.reshape(tf.range(num_chunks * size), [num_chunks, size])
  rows = position % batch
  rows.set_shape([None, static_size])
  return rows, position < batch, batch


def _rows(elems: Sequence[tf.Tensor], rows: tf.Tensor) -> List[tf.Tensor]:
  """The chunk `rows` (`[c]`) of each of `elems`."""
  return [tf.gather(e, rows) for e in elems]


def _one_at_a_time(fn, chunks, signature):
  """`tf.map_fn` over the chunks, one chunk after the other.

  A graph runs up to 10 iterations of a `map_fn` side by side by default, so
  every chunk of the batch would be alive at once (the tutorial CNN at batch
  1024: the first convolution's patches of all 8 chunks, 49 MiB).
  """
  return tf.map_fn(fn, chunks, fn_output_signature=signature,
                   parallel_iterations=1)


def _fits_one_chunk(elems, chunk_size) -> bool:
  static_batch = elems[0].shape[0]
  return static_batch is not None and static_batch <= chunk_size


def map_rows(fn: Callable[[List[tf.Tensor]], List[tf.Tensor]],
             elems: Sequence[tf.Tensor], chunk_size: int,
             signature: Sequence[tf.TensorSpec]) -> List[tf.Tensor]:
  """`fn` over the batch in chunks of `chunk_size` examples.

  Args:
    fn: maps a list of `[c, ...]` tensors to a list of `[c, ...]` tensors,
      row by row (row `i` of an output depends on row `i` of the inputs).
    elems: the batch, tensors of equal leading dimension B.
    chunk_size: the largest number of examples `fn` sees at once.
    signature: one `tf.TensorSpec` per output of `fn`, without the batch axis.

  Returns:
    The outputs of `fn`, `[B, ...]` each.
  """
  elems = list(elems)
  if _fits_one_chunk(elems, chunk_size):
    return list(fn(elems))
  rows, _, batch = _split(elems, chunk_size)
  size = rows.shape[1]
  specs = [tf.TensorSpec([size, *s.shape], s.dtype) for s in signature]
  outputs = _one_at_a_time(lambda chunk: list(fn(_rows(elems, chunk))), rows,
                           specs)
  return [tf.reshape(o, [-1, *s.shape])[:batch]
          for o, s in zip(outputs, signature)]


def sum_rows(fn: Callable[[List[tf.Tensor], tf.Tensor], List[tf.Tensor]],
             elems: Sequence[tf.Tensor], chunk_size: int,
             signature: Sequence[tf.TensorSpec]) -> List[tf.Tensor]:
  """The sum over chunks of `fn(chunk, valid)`.

  Args:
    fn: maps a list of `[c, ...]` tensors and `valid` (`[c]` bool: False for
      the padding rows of the last chunk, which must contribute nothing) to
      a list of partial sums.
    elems: the batch, tensors of equal leading dimension B.
    chunk_size: the largest number of examples `fn` sees at once.
    signature: one `tf.TensorSpec` per output of `fn`.

  Returns:
    The summed outputs of `fn`.
  """
  elems = list(elems)
  if _fits_one_chunk(elems, chunk_size):
    return list(fn(elems, tf.ones([tf.shape(elems[0])[0]], tf.bool)))
  rows, valid, _ = _split(elems, chunk_size)
  outputs = _one_at_a_time(
      lambda args: list(fn(_rows(elems, args[0]), args[1])), (rows, valid),
      list(signature))
  return [tf.reduce_sum(o, axis=0) for o in outputs]
