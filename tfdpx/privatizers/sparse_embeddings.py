"""Sparse embedding updates: DP partition selection of the rows a step updates.

A step of dense DP-SGD adds noise to every row of every embedding table, and
the optimizer writes every row: for a table of 10^6 rows of which a batch
touches a few thousand, nearly all of the step. After Ghazi et al. 2023
(DP-FEST, the frequency-based selection of "Sparsity-Preserving
Differentially Private Training of Large Embedding Models"), each step here
first selects rows by DP partition selection, a noisy count of the examples
touching each row against a threshold, and then releases the clipped
gradient sum with noise on the selected rows only, as a `tf.IndexedSlices`.
Rows no example touched are selected as false positives at the rate the
threshold's Gaussian tail implies, drawn without visiting every row
(`noise.bernoulli_positions`). See docs/sparse_embeddings.md.
"""

import math
from typing import Any, Dict

import dp_accounting
import tensorflow as tf
from scipy import special

from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx import xla
from tfdpx.privatizers.adaptive import AdaptiveClipping
from tfdpx.privatizers.dpdr import DPDR
from tfdpx.privatizers.gaussian import Gaussian
from tfdpx.privatizers.per_layer import PerLayerClipping

_COUNT_STREAM = 'sparse_embeddings/counts'
_FALSE_POSITIVE_STREAM = 'sparse_embeddings/false_positives'


def _noise_step(inner: core.Privatizer) -> core.Privatizer:
  """The noise step inside `inner`'s clipping wrappers."""
  while isinstance(inner, (AdaptiveClipping, PerLayerClipping)):
    inner = inner.inner
  return inner


def _is_supported(inner: core.Privatizer) -> bool:
  """Whether `inner` releases a sum of clipped records plus i.i.d. Gaussian
  noise of any shape per variable (so that its noise can cover the selected
  rows only), with no state but per-variable tensors `_state_on_rows` knows."""
  return isinstance(_noise_step(inner), (Gaussian, DPDR))


def _variable_sums(privatizer: core.Privatizer, sums) -> list:
  """The per-variable sums inside the clipped sums of a supported inner step
  (`_is_supported`): `gaussian`'s own, DPDR's sums of the whole gradients,
  under its wrappers' extras."""
  if isinstance(privatizer, AdaptiveClipping):
    return _variable_sums(privatizer.inner, sums['inner'])
  if isinstance(privatizer, PerLayerClipping):
    return _variable_sums(privatizer.inner, sums)
  if isinstance(privatizer, DPDR):
    return list(sums['grads'])
  return list(sums)


def _with_variable_sums(privatizer: core.Privatizer, sums, variable_sums):
  """`sums` with its per-variable sums replaced by `variable_sums`."""
  if isinstance(privatizer, AdaptiveClipping):
    return {**sums, 'inner': _with_variable_sums(
        privatizer.inner, sums['inner'], variable_sums)}
  if isinstance(privatizer, PerLayerClipping):
    return _with_variable_sums(privatizer.inner, sums, variable_sums)
  if isinstance(privatizer, DPDR):
    return {**sums, 'grads': list(variable_sums)}
  return list(variable_sums)


def _state_on_rows(privatizer: core.Privatizer, state, released,
                   shapes=None):
  """A supported inner step's state with its per-variable tensors of each
  table (DPDR's base) on the table's released rows only.

  Args:
    privatizer: a supported inner step (`_is_supported`).
    state: its state.
    released: `{variable index: rows}`, each table's released rows.
    shapes: None to gather each table's tensor on its rows; else
      `{variable index: table shape}`, and the tensors (on the rows) are
      scattered back into the table's shape, zero elsewhere.

  Returns:
    The state, only the tables' per-variable tensors changed.
  """
  if isinstance(privatizer, (AdaptiveClipping, PerLayerClipping)):
    return {**state, 'inner': _state_on_rows(privatizer.inner, state['inner'],
                                             released, shapes)}
  if not isinstance(privatizer, DPDR):
    return state
  base = list(state['base'])
  for i, rows in released.items():
    base[i] = (tf.gather(base[i], rows) if shapes is None else
               tf.scatter_nd(rows[:, tf.newaxis], base[i], shapes[i]))
  return {**state, 'base': base}


def _merged(table):
  """A table's sums whose rows repeat (parts of a batch concatenated) on
  distinct rows, ascending: the values of each row summed."""
  rows, _ = tf.unique(tf.sort(table['rows']))  # Unique keeps the order.
  position = tf.searchsorted(rows, table['rows'])
  return {'rows': rows, **{
      key: tf.math.unsorted_segment_sum(table[key], position, tf.size(rows))
      for key in ('counts', 'row_sums')}}


class _TouchedRows(gradients.GradientsView):
  """The gradients an inner step sums, with each table's sum on the rows
  this batch touches only (`row_sums`, ascending rows) instead of the whole
  `[rows, dim]` sum. Norms and the other variables are the gradients' own."""

  def __init__(self, grads: gradients.PerExampleGradients, tables):
    super().__init__(grads)
    self._tables = tables

  def sq_norms(self):
    return self._grads.sq_norms()

  def dots(self, directions, rows=None):
    return self._grads.dots(directions, rows)

  def masked_sq_norms(self, masks):
    return self._grads.masked_sq_norms(masks)

  def materialized(self):
    return self._grads.materialized()

  def weighted_sum(self, weights):
    return self._sums(weights, [True] * len(self.shapes))

  def weighted_sums(self, weights, rows=None):
    # Per-layer clipping asks a group's variables at a time.
    wanted = ([True] * len(self.shapes) if rows is None else
              [r is not None for r in rows])
    columns = [self._sums(w, wanted) for w in tf.unstack(weights, axis=1)]
    return gradients.rows_of_sums(
        [tf.stack([c[i] for c in columns]) if wanted[i] else None
         for i in range(len(wanted))], rows)

  def _sums(self, weights, wanted):
    """The weighted sums of the variables `wanted` (None for the others)."""
    sums = self._grads.weighted_sum_of(
        weights, [w and i not in self._tables for i, w in enumerate(wanted)])
    if not any(wanted[i] for i in self._tables):
      return sums
    row_sums = self._grads.row_sums(weights)
    for i in self._tables:
      if wanted[i]:
        sums[i] = row_sums[i]
    return sums


@core.register
class SparseEmbeddings(core.Wrapper):
  """DP partition selection of embedding rows around a Gaussian step.

  For each embedding table read by one lookup (`row_gathered` variables of
  the per-example gradients: a Keras `Embedding`), one step

  1. counts, for each row, the examples touching it (those whose gradient
     on it is not zero: a padding row touches none), each example weighted
     by `min(1, 1 / sqrt(n_i))`, `n_i` the rows it touches in all tables
     together (so its contribution vector has L2 norm at most 1);
  2. adds N(0, z_s^2) to each count and selects the rows whose noisy count
     exceeds the threshold `tau = z_s * Phi^-1(1 - false_positive_rate)`;
     rows no example touched have count 0 and are selected with probability
     `false_positive_rate` each, drawn as a Bernoulli process over the
     table's rows (the same distribution, without visiting every row);
  3. runs `inner` (its clipping of each example's whole gradient, over all
     variables) with its noise on the selected rows' sums only (a false
     positive's sum is zero: noise alone), and releases each table's
     result as `tf.IndexedSlices` of the selected rows; the other variables
     as `inner` releases them.

  With `dpdr` inside, the release is DPDR's restricted to the selected rows:
  its base `b` (the previous release normalized) is zero on a table except
  on the rows the last step released; each example's coefficients along `b`
  and orthogonal part are DPDR's, clipped as DPDR clips them, and the step
  releases `alpha * b + g_perp` on the selected rows. DPDR keeps `b` as one
  tensor of each table's shape: memory and a pass per step that grow with
  the table, not with the rows touched.

  `inner`'s noise multiplier `z` names the whole step: the selection gets
  `z_s = z / sqrt(selection_share)` and the gradient
  `z_g = z / sqrt(1 - selection_share)`, so that `z_s^-2 + z_g^-2 = z^-2`.

  Privacy:
    Each example's gradient over all trainable variables is clipped to
    `inner`'s `l2_norm_clip` C (adaptively, under `adaptive_clipping`; group
    by group to norms whose root sum of squares is C, under
    `per_layer_clipping`; under `dpdr`'s decomposition steps its
    coefficient vector and orthogonal part to their own norms, as `dpdr`
    says), and its contribution vector to the counts to L2 norm 1. The
    release (the selected rows and the noisy sums on them) is a function of
    the counts of all rows plus N(0, z_s^2) noise each and of `inner`'s
    release at `z_g` over all coordinates (for `gaussian` the clipped sum
    plus N(0, (z_g C)^2) noise each; for `dpdr` its two noisy sums, whose
    base is a function of earlier releases): Gaussian mechanisms on the same
    batch, one step is `ComposedDpEvent([inner's event at z_g,
    GaussianDpEvent(z_s)])`, with effective noise multiplier `z` for a
    `gaussian` or default-split `dpdr` inner (add/remove one example). The
    released row indices are part of the release and covered by it.

  Virtual batches and replicas: each physical batch's counts and clipped
  sums are kept on the rows it touches; the parts are merged row by row
  (`add_sums`, `global_sums`: the replicas' rows gathered) and the
  selection is drawn once, on the logical global batch's counts, in
  `release`.

  Not supported: XLA (the number of rows selected is random); inner steps
  other than `gaussian` and `dpdr` under `per_layer_clipping` and
  `adaptive_clipping` (their projections, bases or angles are of the whole
  gradient).

  References:
    Ghazi, Huang, Kamath, Kumar, Manurangsi, Sinha, Zhang, "Sparsity-
    Preserving Differentially Private Training of Large Embedding Models",
    NeurIPS 2023.
  """

  name = 'sparse_embeddings'
  releases_rows = True
  wraps_row_releases = True  # Its own inner check says what it takes.

  def __init__(self, inner: core.Privatizer, selection_share: float = 0.25,
               false_positive_rate: float = 1e-5):
    """Args:
      inner: `gaussian(...)` or `dpdr(...)`, optionally inside
        `per_layer_clipping` and `adaptive_clipping` (e.g.
        `adaptive_clipping(per_layer_clipping(gaussian(...)))`), or its
        `tfdpx.serialize`d form; its noise multiplier is the whole step's.
      selection_share: the share of the step's budget (of `z^-2`) spent on
        the selection, in (0, 1).
      false_positive_rate: the probability that a row no example touched is
        selected, in (0, 0.5); it sets the threshold.

    Raises:
      ValueError: naming the argument that is out of range or unsupported.
    """
    self._set_inner(inner)
    if not _is_supported(self._inner):
      raise ValueError(
          f'inner: sparse_embeddings takes gaussian(...) or dpdr(...), '
          f'optionally inside per_layer_clipping and adaptive_clipping, got '
          f'{_noise_step(self._inner).name}: its noise, mask, projection, '
          'basis or angles cover every row of a table')
    share = core.check_positive('selection_share', selection_share)
    if share >= 1:
      raise ValueError(
          f'selection_share must be in (0, 1), got {selection_share!r}')
    rate = core.check_positive('false_positive_rate', false_positive_rate)
    if rate >= 0.5:
      raise ValueError(
          f'false_positive_rate must be in (0, 0.5), got '
          f'{false_positive_rate!r}')
    self._share = share
    self._rate = rate
    z = self._inner.noise_multiplier
    self._selection_noise_multiplier = z / math.sqrt(share)
    self._gradient_inner = (
        self._inner.with_noise_multiplier(z / math.sqrt(1 - share)) if z > 0
        else self._inner)

  @property
  def config(self) -> Dict[str, Any]:
    return {'inner': core.serialize(self._inner),
            'selection_share': self._share,
            'false_positive_rate': self._rate}

  @property
  def has_gaussian_releases(self) -> bool:
    """False: the rows released, and so the noise's shape, vary by step."""
    return False

  @property
  def selection_noise_multiplier(self) -> float:
    """`z_s`: the counts' noise std (the contribution bound is 1)."""
    return self._selection_noise_multiplier

  @property
  def gradient_noise_multiplier(self) -> float:
    """`z_g`: the gradient noise std over `inner`'s clip norm."""
    return self._gradient_inner.noise_multiplier

  @property
  def threshold(self) -> float:
    """`tau`: a row is selected when its noisy count exceeds it."""
    return self.selection_noise_multiplier * float(
        special.ndtri(1 - self._rate))

  @property
  def effective_false_positive_rate(self) -> float:
    """The rate untouched rows are selected at: 0 without selection noise."""
    return self._rate if self.selection_noise_multiplier > 0 else 0.0

  def dp_event(self, step):
    return dp_accounting.ComposedDpEvent([
        self._gradient_inner.dp_event(step),
        dp_accounting.GaussianDpEvent(self._selection_noise_multiplier)])

  def logs(self, state):
    """`inner`'s logs, and `selected_rows`: the mean number of rows selected
    a step so far, over all tables (the released indices: no privacy cost)."""
    return {**self._gradient_inner.logs(state['inner']),
            'selected_rows': state['selected_rows'] / tf.maximum(
                tf.cast(state['steps'], tf.float32), 1.0)}

  # --- the step ----------------------------------------------------------------

  def init(self, params):
    return {'inner': self._gradient_inner.init(params),
            'selected_rows': tf.constant(0.0, tf.float32),
            'steps': tf.constant(0, tf.int64)}

  def prepare(self, state, seed, per_example_grads, public_grads):
    tables = [i for i, gathered in enumerate(per_example_grads.row_gathered())
              if gathered]
    if not tables:
      raise ValueError(
          'sparse_embeddings: no trainable variable is an embedding table '
          'read by one lookup. Train a model made private '
          '(tfdpx.keras.make_private) with a Keras Embedding layer; '
          'tfdpx.keras.describe(model) lists each layer\'s form.')
    if xla.in_xla():
      raise ValueError(
          'sparse_embeddings does not run under XLA (the number of rows '
          'selected is random): compile with jit_compile=False')
    # Data-independent: a Bernoulli process over each table's rows.
    candidates = [
        noise.bernoulli_positions(
            int(per_example_grads.shapes[i][0]),
            self.effective_false_positive_rate,
            noise.substream(seed, f'{_FALSE_POSITIVE_STREAM}/{i}'))
        for i in tables]
    return {'tables': tables, 'candidates': candidates,
            'count_key': noise.substream(seed, _COUNT_STREAM),
            'shapes': {i: per_example_grads.shapes[i].as_list()
                       for i in tables},
            'inner': self._gradient_inner.prepare(
                state['inner'], seed, per_example_grads, public_grads)}

  def clipped_sums(self, per_example_grads, state, plan):
    grads = gradients.as_per_example_gradients(per_example_grads)
    tables = plan['tables']
    touched_per_example = grads.rows_touched()
    rows_touched = tf.add_n([touched_per_example[i] for i in tables])
    # Each example's contribution vector (1 on each row it touches) clipped
    # to L2 norm 1.
    weights = tf.minimum(1.0, tf.math.rsqrt(
        tf.cast(tf.maximum(rows_touched, 1), tf.float32)))
    # Outside XLA (prepare refuses it) the row counts hold no sentinel
    # slots: one entry per distinct row touched.
    row_counts = grads.row_counts(weights)
    inner_sums = self._gradient_inner.clipped_sums(
        _TouchedRows(grads, tables), state['inner'], plan['inner'])
    variable_sums = _variable_sums(self._gradient_inner, inner_sums)
    row_sums = [variable_sums[i] for i in tables]
    for i in tables:  # The tables' sums are keyed by rows: apart.
      variable_sums[i] = tf.zeros([], variable_sums[i].dtype)
    return {
        'inner': _with_variable_sums(self._gradient_inner, inner_sums,
                                     variable_sums),
        'tables': [{'rows': row_counts[i].rows, 'counts': row_counts[i].counts,
                    'row_sums': sums} for i, sums in zip(tables, row_sums)]}

  def add_sums(self, sums, more):
    return {'inner': super().add_sums(sums['inner'], more['inner']),
            'tables': [_merged(tf.nest.map_structure(
                lambda a, b: tf.concat([a, b], 0), part, other))
                       for part, other in zip(sums['tables'], more['tables'])]}

  def global_sums(self, sums):
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
      return sums
    # Every replica's rows, then merged: the same global sums everywhere.
    return {'inner': super().global_sums(sums['inner']),
            'tables': [_merged(tf.nest.map_structure(
                lambda t: context.all_gather(t, axis=0), table))
                       for table in sums['tables']]}

  def sums_shapes(self, sums):
    return {'inner': super().sums_shapes(sums['inner']),
            'tables': tf.nest.map_structure(  # Rows: as many as touched.
                lambda t: tf.TensorShape([None]).concatenate(t.shape[1:]),
                sums['tables'])}

  def release(self, sums, state, plan, seed):
    # The selection: noise on the counts of the rows the (logical) batch
    # touches. A row looked up with a zero gradient (by a padding row) has
    # count 0: untouched, it is left to the false positives, and the draws
    # go to the touched rows in ascending order however the batch was split.
    touched = [tf.where(t['counts'] > 0)[:, 0] for t in sums['tables']]
    counts = [tf.gather(t['counts'], at)
              for t, at in zip(sums['tables'], touched)]
    draws = noise.gaussian_like(counts, self.selection_noise_multiplier,
                                plan['count_key'])
    variable_sums = _variable_sums(self._gradient_inner, sums['inner'])
    released = []
    for i, table, touched_at, count, draw, candidates in zip(
        plan['tables'], sums['tables'], touched, counts, draws,
        plan['candidates']):
      rows, row_sums = table['rows'], table['row_sums']
      # Gathered, not masked: the selected rows are few.
      selected = tf.boolean_mask(touched_at, count + draw > self.threshold)
      # A candidate on a touched row is that row's own test's to decide.
      padded = tf.concat([tf.gather(rows, touched_at),
                          [plan['shapes'][i][0]]], 0)  # A sentinel.
      false_positives = tf.boolean_mask(candidates, tf.not_equal(
          tf.gather(padded, tf.searchsorted(padded, candidates)), candidates))
      released.append(tf.concat([tf.gather(rows, selected), false_positives],
                                0))
      # A false positive's sum is zero: the inner step's noise alone.
      zeros = tf.zeros(tf.concat([tf.shape(false_positives),
                                  tf.shape(row_sums)[1:]], 0), row_sums.dtype)
      variable_sums[i] = tf.concat([tf.gather(row_sums, selected), zeros], 0)
    # DPDR's base on a table is zero off the rows the last step released:
    # its release (and its next base) covers the released rows only.
    released_rows = dict(zip(plan['tables'], released))
    noisy_sum, inner_state = self._gradient_inner.release(
        _with_variable_sums(self._gradient_inner, sums['inner'],
                            variable_sums),
        _state_on_rows(self._gradient_inner, state['inner'], released_rows),
        plan['inner'], seed)
    inner_state = _state_on_rows(self._gradient_inner, inner_state,
                                 released_rows, plan['shapes'])
    noisy_sum, selected_rows = list(noisy_sum), state['selected_rows']
    for i, rows in zip(plan['tables'], released):
      noisy_sum[i] = tf.IndexedSlices(
          noisy_sum[i], rows, dense_shape=tf.constant(plan['shapes'][i],
                                                      tf.int64))
      selected_rows += tf.cast(tf.size(rows), tf.float32)
    return noisy_sum, {'inner': inner_state, 'selected_rows': selected_rows,
                       'steps': state['steps'] + 1}


def sparse_embeddings(inner: core.Privatizer, selection_share: float = 0.25,
                      false_positive_rate: float = 1e-5) -> SparseEmbeddings:
  """DP partition selection of embedding rows around `inner`; see
  `SparseEmbeddings`."""
  return SparseEmbeddings(inner, selection_share, false_positive_rate)
