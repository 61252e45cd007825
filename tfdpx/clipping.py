"""Per-example clipping over all variables together (global L2 norm)."""

from typing import List, Sequence, Tuple

import tensorflow as tf

from tfdpx import gradients


def per_example_global_norm(per_example: Sequence[tf.Tensor]) -> tf.Tensor:
  """The L2 norm of each example over all tensors, shape `[B]`, in float32."""
  return tf.sqrt(tf.add_n(
      gradients.MaterializedGradients(per_example).sq_norms()))


def drop_nonfinite(
    per_example: Sequence[tf.Tensor]) -> Tuple[List[tf.Tensor], tf.Tensor]:
  """Zeroes every record whose gradient is not finite, before any clipping.

  One NaN or infinite record would make the released sum NaN (and so reveal
  that the example was in the batch); a zero record contributes nothing, as
  if the example had not been sampled.

  Args:
    per_example: one `[B, ...]` tensor per variable.

  Returns:
    `(records, num_dropped)`: the tensors with every record that has a NaN or
    infinite entry zeroed, and the int32 number of such records. The count
    depends on the data and no epsilon covers it (like a training metric).
  """
  per_example = list(per_example)
  keep = tf.reduce_all(tf.stack([
      tf.reduce_all(tf.math.is_finite(
          tf.reshape(g, [tf.shape(g)[0], -1])), axis=1)
      for g in per_example]), axis=0)
  num_dropped = tf.reduce_sum(tf.cast(tf.logical_not(keep), tf.int32))
  return [zero_rows(g, keep) for g in per_example], num_dropped


# Rows at least this long are copied by `zero_rows` only when one is dropped.
_COPY_ROW_SIZE = 1024


def zero_rows(per_example: tf.Tensor, keep: tf.Tensor,
              many_rows: bool = False) -> tf.Tensor:
  """`per_example` with the rows where `keep` (`[B]` bool) is False zeroed.

  A select, not a product: a zeroed row stays zero even if it held NaN. On
  rows of `_COPY_ROW_SIZE` entries or more (gradients, activations), or
  with `many_rows` (short rows, but many of them: an embedding's rows of
  (example, id) pairs), the select, a copy, runs only in a step that drops
  a record: on the tutorial CNN's materialized kernel gradients it cost 2 ms
  a call. Other rows (statistics) are selected outright, without a
  `tf.cond` to trace.
  """
  rank = per_example.shape.rank
  rows = keep if rank == 1 else tf.reshape(keep, [-1] + [1] * (rank - 1))
  row_size = per_example.shape[1:].num_elements()
  if not many_rows and row_size is not None and row_size < _COPY_ROW_SIZE:
    return tf.where(rows, per_example, tf.zeros_like(per_example))
  return tf.cond(
      tf.reduce_all(keep), lambda: tf.identity(per_example),
      lambda: tf.where(rows, per_example, tf.zeros_like(per_example)))


def clip_factors(per_example, l2_norm_clip) -> Tuple[tf.Tensor, tf.Tensor]:
  """The factors `1 / max(norm / C, 1)` that clip each example, and the norms.

  Pass the factors as the `weights` of `noise.batch_sum`: the clipped sum is
  then one weighted sum, and no clipped copy of the per-example gradients is
  formed.

  Args:
    per_example: a `tfdpx.gradients.PerExampleGradients` (only its `sq_norms`
      are asked for) or one `[B, ...]` tensor per variable.
    l2_norm_clip: positive clip norm C (may be `inf`).

  Returns:
    `(factors, norms)`, both `[B]` float32.
  """
  grads = gradients.as_per_example_gradients(per_example)
  norms = tf.sqrt(gradients.global_sq_norms(grads))
  return clip_factor(norms, l2_norm_clip), norms


def clip_factor(norms: tf.Tensor, l2_norm_clip) -> tf.Tensor:
  """`1 / max(norm / C, 1)`: 1 for a zero norm and for an infinite C."""
  return 1.0 / tf.maximum(norms / tf.cast(l2_norm_clip, tf.float32), 1.0)


# A released part `f_i (g_i - P g_i)` computed as `f_i g_i - P (f_i g_i)`
# inside weighted sums is exact only up to float rounding of `f_i |g_i|`.
# Bounding `f_i |g_i|` by this many clip norms keeps that rounding below about
# 1e-4 of the clip norm in float32 (DPDR, GEP).
SUBTRACTION_BOUND = 1024.0


def bound_for_subtraction(factors: tf.Tensor, norms: tf.Tensor,
                          l2_norm_clip) -> tf.Tensor:
  """`factors`, lowered so that `factors * norms <= SUBTRACTION_BOUND * C`.

  For a privatizer that clips a part of each gradient (`g - P g`, whose norm
  can be far below `|g| = norms`) but forms its sum by subtracting `P` from a
  weighted sum of whole gradients: the cancellation then happens in floating
  point at the scale of `factors * norms`, and an example with a huge
  gradient along `P` could move the sum by more than C through rounding. The
  extra scaling applies only to such examples (whole gradient above 1024 C),
  is a per-example scaling by at most 1, and so leaves every sensitivity as
  it was.

  Args:
    factors: `[B]` clip factors of the part.
    norms: `[B]` norms of the whole gradients.
    l2_norm_clip: the part's clip norm C.
  """
  return tf.minimum(factors,
                    clip_factor(norms, SUBTRACTION_BOUND * l2_norm_clip))


# Relative rounding a part's squared norm may carry when it is computed from
# float32 statistics of the whole gradient (`|g|^2 - 2 <g, Pg> + |Pg|^2`):
# about ten times what these sums were measured to carry (~1e-6).
CANCELLATION_MARGIN = 2.0**-16


def part_norms(part_sq: tf.Tensor, whole_sq: tf.Tensor) -> tf.Tensor:
  """Norms of a part of each gradient from a difference of squared norms.

  The difference rounds at the scale of the whole gradient's `|g|^2`, not of
  the part: for a small part of a large gradient (a residual of 1.5 C next to
  1000 C in the subspace) the computed norm came out up to 15% too small, and
  the part was released above its clip norm. Adding `CANCELLATION_MARGIN
  |g|^2` makes each norm an upper bound of the part's (float32 rounding of the
  statistics stays far below the margin); it raises a norm by at most
  `2^-8 |g|`, so an ordinary example's clip factor barely moves.

  Args:
    part_sq: `[B]` squared norms of the parts, as computed (may be negative).
    whole_sq: `[B]` squared norms of the whole gradients.
  """
  return tf.sqrt(tf.maximum(part_sq, 0.0) + CANCELLATION_MARGIN * whole_sq)


def normalize_factors(per_example, gamma) -> tf.Tensor:
  """Automatic clipping's factors `1 / (||g|| + gamma)`, float32 `[B]`.

  Each example times its factor has norm below 1 (for `gamma > 0`), so the L2
  sensitivity of the weighted sum is 1.

  Args:
    per_example: a `tfdpx.gradients.PerExampleGradients` or one `[B, ...]`
      tensor per variable.
    gamma: positive stability constant.
  """
  grads = gradients.as_per_example_gradients(per_example)
  norms = tf.sqrt(gradients.global_sq_norms(grads))
  return 1.0 / (norms + tf.cast(gamma, tf.float32))
