"""The statistics one layer call contributes to the per-example gradients."""

import abc
from typing import List, Optional, Sequence

import tensorflow as tf

from tfdpx import clipping
from tfdpx import gradients


class Unit(abc.ABC):
  """One layer call's share `g_iv` of the per-example gradients.

  Every method returns one entry per variable of `variables`, in order. Row
  `i` depends on example `i` alone (model validation refuses layers that mix
  the examples of a batch).
  """

  def __init__(self, variables: Sequence[tf.Variable]):
    self.variables = list(variables)

  @abc.abstractmethod
  def sq_norms(self) -> List[tf.Tensor]:
    """`|g_iv|^2`, float32 `[B]` each."""

  @abc.abstractmethod
  def dots(self, directions: Sequence[Optional[tf.Tensor]],
           rows: gradients.Rows = None) -> List[Optional[tf.Tensor]]:
    """`<g_iv, d_jv>` for `[k_v, *shape]` directions (None: not needed).

    With `rows`, as in `PerExampleGradients.dots`: `directions[v]` covers the
    slices `rows[v]` of the first axis (None: the whole variable).
    """

  @abc.abstractmethod
  def masked_sq_norms(self, masks: Sequence[tf.Tensor]) -> List[tf.Tensor]:
    """`|m_v * g_iv|^2`, float32 `[B]` each."""

  @abc.abstractmethod
  def weighted_sum(self, weights: tf.Tensor, keep: tf.Tensor,
                   rows: gradients.Rows = None) -> List[tf.Tensor]:
    """`sum_i w_i g_iv` over the rows `keep` (`[B]` bool) keeps.

    A row that is not kept contributes nothing, even where it is not finite
    (a select, never `0 * NaN`). With `rows`, only the slices `rows[v]` of
    each variable's first axis (None: the whole variable).
    """

  def weighted_sums(self, weights: tf.Tensor, keep: tf.Tensor,
                    rows: gradients.Rows = None) -> List[tf.Tensor]:
    """`weighted_sum` for each column of `weights` (`[B, K]`): `[K, ...]`.

    One `weighted_sum` per column (K static); a unit with a cheaper form for
    all columns at once overrides this.
    """
    columns = tf.unstack(weights, axis=1)
    return [tf.stack(sums) for sums in
            zip(*[self.weighted_sum(w, keep, rows) for w in columns])]

  @abc.abstractmethod
  def materialized(self) -> List[tf.Tensor]:
    """`g_iv` itself, `[B, *shape]` each (the escape hatch)."""

  # A unit of one table whose example `i` has a gradient on the rows it
  # touches only answers `rows_touched`, `row_counts` and `row_sums` (as
  # `PerExampleGradients` does, for its one variable).
  row_gathered = False

  def cross_gram_form(self, other: 'Unit') -> bool:
    """Whether `cross_grams` with `other` (the same layer's unit on another
    batch) has a cheap exact form. Default: no."""
    del other
    return False

  def cross_grams(self, other: 'Unit', spans: gradients.Spans,
                  dtype: tf.DType) -> List[Optional[tf.Tensor]]:
    """`<g_iv, h_jv>` over `spans[v]` of each variable, `[B, M]` in `dtype`.

    As `PerExampleGradients.cross_grams`, for `h` the gradients of `other`;
    only where `cross_gram_form(other)`.
    """
    raise NotImplementedError(f'{type(self).__name__} has no cross Gram form')


def weighted_rows(tensor: tf.Tensor, weights: tf.Tensor,
                  keep: tf.Tensor) -> tf.Tensor:
  """Row `i` of `[B, ...]` `tensor` times `weights[i]`; zero where not kept."""
  factor = tf.reshape(tf.cast(weights, tensor.dtype),
                      [-1] + [1] * (tensor.shape.rank - 1))
  return clipping.zero_rows(tensor * factor, keep)


def sliced_sums(sums: Sequence[tf.Tensor],
                rows: gradients.Rows) -> List[tf.Tensor]:
  """Whole-variable sums restricted to `rows` of their first axis."""
  if rows is None:
    return list(sums)
  return [gradients.slice_rows(s, r, axis=0) for s, r in zip(sums, rows)]
