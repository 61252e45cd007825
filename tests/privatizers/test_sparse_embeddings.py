"""sparse_embeddings: the row forms, the selection, its noise and its event."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats as scipy_stats
import tensorflow as tf

import tfdpx
from tfdpx import accounting
from tfdpx import gradients
from tfdpx import noise
from tfdpx import per_example
from tfdpx import virtual_batches
from tfdpx.forms import embedding
from tfdpx.privatizers import adaptive_clipping
from tfdpx.privatizers import dpdr
from tfdpx.privatizers import gaussian
from tfdpx.privatizers import sparse_embeddings
from tests import stats


def _seed(n):
  return tf.constant([n, 7], tf.int64)


def _engine(ids, tap_grad, vocab):
  """The engine's per-example gradients of one lookup `table[ids]`."""
  table = tf.Variable(tf.zeros([vocab, tap_grad.shape[-1]]))
  unit = embedding.EmbeddingUnit(table, tf.constant(ids), tf.constant(tap_grad))
  return per_example.UnitGradients([table], [unit],
                                   tf.constant(ids.shape[0])), table


def _reference(engine):
  """The same gradients materialized, `[B, vocab, dim]`: the dense reference."""
  return gradients.MaterializedGradients(engine.materialized(),
                                         row_gathered=[True])


def _lookups(batch=6, length=5, vocab=40, dim=3, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, vocab, size=[batch, length])
  ids[0, 1] = ids[0, 0]  # An id twice in one example: one row touched.
  tap_grad = rng.normal(size=[batch, length, dim]).astype(np.float32)
  return ids, tap_grad


def test_engine_row_forms_match_the_dense_reference():
  ids, tap_grad = _lookups()
  engine, _ = _engine(ids, tap_grad, 40)
  reference = _reference(engine)
  weights = tf.constant(np.linspace(0.5, 2, 6), tf.float32)
  np.testing.assert_array_equal(engine.rows_touched()[0],
                                reference.rows_touched()[0])
  np.testing.assert_array_equal(
      engine.rows_touched()[0], [len(set(row)) for row in ids])
  counts, want = engine.row_counts(weights)[0], reference.row_counts(weights)[0]
  touched = int(tf.reduce_sum(tf.cast(counts.rows < 40, tf.int32)))
  assert touched == len(np.unique(ids))
  np.testing.assert_array_equal(counts.rows[:touched], want.rows)
  np.testing.assert_array_equal(counts.rows[touched:], 40)  # Sentinels.
  np.testing.assert_allclose(counts.counts[:touched], want.counts, rtol=1e-6)
  np.testing.assert_array_equal(counts.counts[touched:], 0)
  sums = engine.row_sums(weights)[0]
  np.testing.assert_allclose(sums[:touched], reference.row_sums(weights)[0],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(sums[touched:], 0)
  assert engine.weighted_sum_of(weights, [False]) == [None]


def test_noiseless_release_is_the_clipped_sum_on_the_touched_rows():
  ids, tap_grad = _lookups()
  engine, table = _engine(ids, tap_grad, 40)
  privatizer = sparse_embeddings(gaussian(1.0, 0.0))
  noisy, _ = privatizer.update(engine, privatizer.init([table]), _seed(1))
  assert isinstance(noisy[0], tf.IndexedSlices)
  np.testing.assert_array_equal(np.sort(noisy[0].indices), np.unique(ids))
  dense, _ = gaussian(1.0, 0.0).update(engine, {}, _seed(1))
  np.testing.assert_allclose(tf.convert_to_tensor(noisy[0]), dense[0],
                             rtol=1e-5, atol=1e-6)


def _noisy_step():
  """`(ids, engine, privatizer, state)`: a step that leaves some touched rows
  out and selects some untouched ones."""
  ids, tap_grad = _lookups(batch=16, vocab=300)
  engine, table = _engine(ids, tap_grad, 300)
  privatizer = sparse_embeddings(gaussian(0.5, 0.3), selection_share=0.5,
                                 false_positive_rate=0.02)
  return ids, engine, privatizer, privatizer.init([table])


def test_engine_and_dense_reference_release_the_same_rows_with_one_key():
  ids, engine, privatizer, state = _noisy_step()
  got, _ = privatizer.update(engine, state, _seed(3))
  want, _ = privatizer.update(_reference(engine), state, _seed(3))
  np.testing.assert_array_equal(got[0].indices, want[0].indices)
  np.testing.assert_allclose(got[0].values, want[0].values, rtol=1e-5,
                             atol=1e-6)
  # Some touched rows are left out and some untouched ones are in: the
  # comparison covers both kinds.
  touched = set(np.unique(ids))
  assert 0 < len(touched & set(got[0].indices.numpy())) < len(touched)
  assert set(got[0].indices.numpy()) - touched


def _selection_rate(privatizer, rows_per_example, examples_per_row, groups,
                    seeds):
  """The fraction of touched rows selected, each row touched by
  `examples_per_row` examples that each touch `rows_per_example` rows."""
  vocab = groups * rows_per_example
  ids = np.repeat(np.arange(vocab).reshape(groups, rows_per_example),
                  examples_per_row, axis=0)
  tap_grad = np.ones(list(ids.shape) + [1], np.float32)
  engine, table = _engine(ids, tap_grad, vocab)
  state = privatizer.init([table])
  selected = 0
  for seed in range(seeds):
    noisy, _ = privatizer.update(engine, state, _seed(100 + seed))
    selected += int(tf.size(noisy[0].indices))
  return selected / (vocab * seeds), vocab * seeds


@pytest.mark.parametrize('rows_per_example', [1, 4])
def test_selection_noise_and_contribution_bound_match_the_event(
    rows_per_example):
  # Each example's contribution is 1 / sqrt(rows it touches), so each row's
  # count is examples_per_row / sqrt(rows_per_example) = 4 here; the count's
  # noise is z_s = z / sqrt(share) = 2 and the threshold z_s * Phi^-1(1 -
  # rate) = 2: a row is selected with probability Phi((4 - 2) / 2).
  z, share, rate = 1.0, 0.25, scipy_stats.norm.sf(1.0)
  examples_per_row = 4 * int(math.sqrt(rows_per_example))
  privatizer = sparse_embeddings(gaussian(1.0, z), selection_share=share,
                                 false_positive_rate=rate)
  assert privatizer.selection_noise_multiplier == pytest.approx(2.0)
  measured, trials = _selection_rate(privatizer, rows_per_example,
                                     examples_per_row, 4000, 4)
  expected = scipy_stats.norm.cdf((4 - 2) / 2)
  tolerance = stats.Z * math.sqrt(expected * (1 - expected) / trials)
  assert abs(measured - expected) < tolerance
  # Two-sided: a count noise 10% off, contributions not clipped or clipped
  # to 1 / rows would each move the rate out of the band.
  wrong = [scipy_stats.norm.cdf((4 - 2.2) / 2.2),
           scipy_stats.norm.cdf((4 - 1.8) / 1.8)]
  if rows_per_example > 1:
    wrong += [scipy_stats.norm.cdf((8 - 2) / 2), scipy_stats.norm.cdf(0)]
  assert all(abs(w - expected) > 2 * tolerance for w in wrong)


@pytest.mark.parametrize('sparsified', [False, True])
def test_false_positives_at_the_tail_rate_with_the_gradient_noise(sparsified):
  # With `sparsified` around it (a window zeroing half the coordinates) the
  # coordinates the mask keeps carry the same noise, the others none.
  vocab, rate, clip, z = 100_000, 2e-3, 0.5, 1.0
  ids, tap_grad = _lookups(batch=8, vocab=10, dim=4)
  engine, table = _engine(ids, tap_grad, vocab)
  selection = sparse_embeddings(gaussian(clip, z), false_positive_rate=rate)
  privatizer, state = selection, selection.init([table])
  if sparsified:
    privatizer = tfdpx.privatizers.sparsified(selection, 0.5, epochs=2,
                                              steps_per_epoch=1)
    state = {**privatizer.init([table]), 'step': tf.constant(1, tf.int64)}
    mask = privatizer.masks(1, [table.shape])[0].numpy()
  found, values = 0, []
  for seed in range(5):
    noisy, _ = privatizer.update(engine, state, _seed(seed))
    indices = noisy[0].indices.numpy()
    assert len(np.unique(indices)) == len(indices)
    assert indices.min() >= 0 and indices.max() < vocab
    false = indices >= 10
    found += int(false.sum())
    released = noisy[0].values.numpy()[false]
    if sparsified:
      kept = mask[indices[false]] > 0
      assert np.all(released[~kept] == 0)
      released = released[kept]
    values.append(released)
  trials = 5 * (vocab - 10)
  tolerance = stats.Z * math.sqrt(trials * rate * (1 - rate))
  assert abs(found - trials * rate) < tolerance
  # A false positive's sum is zero: what is released there is the gradient
  # noise alone, with the std the event names for the gradient.
  assert selection.gradient_noise_multiplier == pytest.approx(
      z / math.sqrt(0.75))
  assert privatizer.dp_event(0) == selection.dp_event(0)
  assert stats.std_matches(np.concatenate(values),
                           selection.gradient_noise_multiplier * clip)
  assert not stats.std_matches(np.concatenate(values), z * clip)


@pytest.mark.parametrize('chunk', [None, 7])  # 7: the loop over chunks.
def test_bernoulli_positions_are_a_bernoulli_process(chunk):
  size, rate = 50_000, 0.01
  positions = noise.bernoulli_positions(size, rate, _seed(5), chunk).numpy()
  assert np.all(np.diff(positions) > 0) and positions.max() < size
  tolerance = stats.Z * math.sqrt(size * rate * (1 - rate))
  assert abs(len(positions) - size * rate) < tolerance
  gaps = np.diff(positions)  # Geometric: mean 1 / rate, variance (1-p)/p^2.
  assert abs(gaps.mean() - 1 / rate) < stats.Z * math.sqrt(
      (1 - rate) / rate**2 / len(gaps))
  assert noise.bernoulli_positions(size, 0.0, _seed(5)).shape == [0]


@pytest.mark.parametrize('inner', [gaussian, dpdr])
def test_one_step_costs_the_noise_multiplier_it_names(inner):
  # DPDR: its 49 decomposition steps too (each the composition of its two
  # parts at sigma_eff z_g, and the selection).
  z, q, steps, delta = 1.3, 0.01, 500, 1e-5
  privatizer = sparse_embeddings(inner(1.0, z), selection_share=0.3)
  got = accounting.epsilon(privatizer, steps=steps, sampling_probability=q,
                           delta=delta)
  # Independently: the two Gaussian releases of each sampled batch, z_s and
  # z_g with z_s^-2 + z_g^-2 = z^-2, composed by dp_accounting's RDP.
  z_s, z_g = z / math.sqrt(0.3), z / math.sqrt(0.7)
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent((z_s**-2 + z_g**-2)**-0.5)), steps)
  ledger = dp_accounting.rdp.RdpAccountant()
  ledger.compose(event)
  assert got == pytest.approx(ledger.get_epsilon(delta), rel=1e-6)
  assert got == pytest.approx(
      accounting.epsilon(gaussian(1.0, z), steps=steps,
                         sampling_probability=q, delta=delta), rel=1e-9)


def test_calibration_and_config_keep_the_split():
  privatizer = sparse_embeddings(adaptive_clipping(gaussian(1.0, 1.0), 64.0),
                                 selection_share=0.2, false_positive_rate=1e-6)
  again = tfdpx.deserialize(tfdpx.serialize(privatizer))
  assert again == privatizer
  louder = privatizer.with_noise_multiplier(2.0)
  assert louder.noise_multiplier == pytest.approx(2.0)
  assert louder.selection_noise_multiplier == pytest.approx(2.0 / math.sqrt(0.2))
  assert accounting.epsilon(louder, steps=100, sampling_probability=0.01,
                            delta=1e-5) == pytest.approx(
                                accounting.epsilon(
                                    gaussian(1.0, 2.0), steps=100,
                                    sampling_probability=0.01, delta=1e-5),
                                rel=1e-9)


def test_refuses_what_it_cannot_run():
  with pytest.raises(ValueError, match='inner'):
    sparse_embeddings(tfdpx.privatizers.d2p2(1.0))
  with pytest.raises(ValueError, match='inner: .* got geodp'):  # Named inside.
    sparse_embeddings(adaptive_clipping(tfdpx.privatizers.geodp(1.0, 1.0),
                                        64.0))
  with pytest.raises(ValueError, match='selection_share'):
    sparse_embeddings(gaussian(1.0, 1.0), selection_share=1.0)
  with pytest.raises(ValueError, match='false_positive_rate'):
    sparse_embeddings(gaussian(1.0, 1.0), false_positive_rate=0.5)
  dense = gradients.MaterializedGradients([tf.ones([2, 3])])
  privatizer = sparse_embeddings(gaussian(1.0, 1.0))
  with pytest.raises(ValueError, match='embedding table'):
    privatizer.update(dense, privatizer.init([tf.Variable(tf.ones([3]))]),
                      _seed(0))


def test_other_wrappers_refuse_to_wrap_it():
  inner = sparse_embeddings(gaussian(1.0, 1.0))
  with pytest.raises(ValueError, match='inner'):
    adaptive_clipping(inner, 64.0)
  with pytest.raises(ValueError, match='inner: per_layer_clipping cannot'):
    tfdpx.privatizers.per_layer_clipping(inner)


def test_a_padding_row_touches_no_row():
  # A padding row of a fixed-shape Poisson batch has sample weight 0, hence
  # zero gradients: it must add nothing to the counts, or the counts would
  # depend on how many rows the batch has (sensitivity 2, not 1).
  ids, tap_grad = _lookups(batch=4)
  tap_grad[3] = 0.0
  engine, _ = _engine(ids, tap_grad, 40)
  assert engine.rows_touched()[0].numpy()[3] == 0
  counts = engine.row_counts(tf.ones([4]))[0]
  for row, count in zip(counts.rows.numpy(), counts.counts.numpy()):
    if row < 40:
      assert count == len({i for i in range(3) if row in ids[i]})


def test_update_is_pure_and_keyed_by_the_seed():
  _, engine, privatizer, state = _noisy_step()
  first, second, other = (privatizer.update(engine, state, _seed(n))[0][0]
                          for n in (4, 4, 5))
  np.testing.assert_array_equal(first.indices, second.indices)
  np.testing.assert_array_equal(first.values, second.values)
  assert not np.array_equal(first.indices, other.indices)


@pytest.mark.parametrize('wrap', ['per_layer', 'adaptive_per_layer'])
def test_noiseless_release_under_per_layer_clipping_is_the_dense_one(wrap):
  # A table and a dense variable, each its own clipping group: the sparse
  # release equals the dense one on the touched rows and the other variable.
  rng = np.random.default_rng(1)
  table = np.zeros([5, 30, 3], np.float32)
  for i in range(5):
    table[i, rng.choice(30, 4, replace=False)] = rng.normal(size=[4, 3])
  grads = gradients.MaterializedGradients(
      [table, rng.normal(size=[5, 7]).astype(np.float32)],
      row_gathered=[True, False])
  inner = tfdpx.privatizers.per_layer_clipping(gaussian(0.5, 0.0))
  if wrap == 'adaptive_per_layer':
    inner = adaptive_clipping(inner, 5.0, count_noise_multiplier=1.0)
  params = [tf.Variable(table[0]), tf.Variable(tf.zeros([7]))]
  privatizer = sparse_embeddings(inner)
  sparse, _ = privatizer.update(grads, privatizer.init(params), _seed(2))
  dense, _ = inner.update(grads, inner.init(params), _seed(2))
  np.testing.assert_array_equal(np.sort(sparse[0].indices),
                                np.flatnonzero(np.any(table != 0, (0, 2))))
  np.testing.assert_allclose(tf.convert_to_tensor(sparse[0]), dense[0],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sparse[1], dense[1], rtol=1e-5, atol=1e-6)


def _two_tables(batch=11, seed=3):
  """Two lookups (tables of 300 x 3 and 50 x 2) and a dense variable, as one
  model's per-example gradients: `(variables, gradients_of(rows))`, where
  `gradients_of(rows)` answers for the batch rows `rows` (a 1-D tensor; a
  row past the batch is a padding row: its ids looked up, zero gradient)."""
  rng = np.random.default_rng(seed)
  ids = [rng.integers(0, 300, size=[batch, 6]), rng.integers(0, 50, [batch, 2])]
  tap_grads = [rng.normal(size=[batch, 6, 3]), rng.normal(size=[batch, 2, 2])]
  dense = rng.normal(size=[batch, 4])
  params = [tf.Variable(tf.zeros([300, 3])), tf.Variable(tf.zeros([50, 2])),
            tf.Variable(tf.zeros([4]))]

  def gradients_of(rows):
    def taken(x):  # Padding rows: id 0, zero gradient.
      padded = np.concatenate([x, np.zeros_like(x[:1])], 0)
      return tf.gather(tf.constant(padded), tf.minimum(rows, batch))
    units = [embedding.EmbeddingUnit(p, taken(i), tf.cast(taken(g), tf.float32))
             for p, i, g in zip(params, ids, tap_grads)]
    lookups = per_example.UnitGradients(params[:2], units, tf.size(rows))
    return gradients.MaterializedGradients(
        lookups.materialized() + [tf.cast(taken(dense), tf.float32)],
        row_gathered=[True, True, False])

  return params, gradients_of


@pytest.mark.parametrize('physical_batch_size', [1, 4, 11])
@pytest.mark.parametrize('wrap', ['gaussian', 'adaptive_per_layer',
                                  'sparsified'])
def test_virtual_batches_release_what_the_whole_batch_releases(
    physical_batch_size, wrap):
  # Same key: the same rows selected and the same noisy values, whatever the
  # split (a row touched in several physical batches counted once, padding
  # rows touching nothing), with rows left out and false positives in.
  params, gradients_of = _two_tables()
  inner = gaussian(0.5, 0.3)
  if wrap == 'adaptive_per_layer':
    inner = adaptive_clipping(tfdpx.privatizers.per_layer_clipping(inner),
                              11.0, count_noise_multiplier=1.0)
  privatizer = sparse_embeddings(inner, selection_share=0.5,
                                 false_positive_rate=0.02)
  state = privatizer.init(params)
  if wrap == 'sparsified':  # In a window zeroing half the coordinates.
    privatizer = tfdpx.privatizers.sparsified(privatizer, 0.5, epochs=2,
                                              steps_per_epoch=1)
    state = {**privatizer.init(params), 'step': tf.constant(1, tf.int64)}
  whole, whole_state = privatizer.update(gradients_of(tf.range(11)), state,
                                         _seed(6))
  num_chunks = -(-11 // physical_batch_size)

  def chunk(i):
    return gradients_of(tf.range(physical_batch_size) +
                        i * physical_batch_size), tuple
  parts, parts_state, _ = virtual_batches.update(
      privatizer, state, _seed(6), tf.constant(num_chunks), chunk)
  for a, b in zip(whole[:2], parts[:2]):
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_allclose(a.values, b.values, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(whole[2], parts[2], rtol=1e-5, atol=1e-6)
  for a, b in zip(tf.nest.flatten(whole_state), tf.nest.flatten(parts_state)):
    np.testing.assert_allclose(a, b, rtol=1e-5)
  touched = set(np.flatnonzero(np.any(
      gradients_of(tf.range(11)).materialized()[0] != 0, (0, 2))))
  released = set(whole[0].indices.numpy())
  assert 0 < len(touched & released) < len(touched) and released - touched


@pytest.mark.parametrize('noise_multiplier', [0.0, 1.0])
def test_random_sparsification_masks_the_selected_rows(noise_multiplier):
  # sparsified around it, in a window zeroing half the coordinates: without
  # noise the release is the dense RS release on the touched rows; with
  # noise the masked coordinates of the selected rows carry no noise, the
  # others do.
  params, gradients_of = _two_tables()
  grads = gradients_of(tf.range(11))

  def rs(inner):
    return tfdpx.privatizers.sparsified(inner, 0.5, epochs=2,
                                        steps_per_epoch=1)
  privatizer = rs(sparse_embeddings(gaussian(0.5, noise_multiplier),
                                    false_positive_rate=0.3))
  state = {**privatizer.init(params), 'step': tf.constant(1, tf.int64)}
  released, _ = privatizer.update(grads, state, _seed(8))
  masks = privatizer.masks(1, [p.shape for p in params])
  if noise_multiplier == 0:
    dense = rs(gaussian(0.5, 0.0))
    want, _ = dense.update(grads, {**dense.init(params), 'step': state['step']},
                           _seed(8))
    for got, wanted in zip(released, want):
      np.testing.assert_allclose(tf.convert_to_tensor(got), wanted,
                                 rtol=1e-5, atol=1e-6)
    return
  for table, mask in zip(released[:2], masks[:2]):
    kept = tf.gather(mask, table.indices).numpy() > 0
    values = table.values.numpy()
    assert np.all(values[~kept] == 0) and np.all(values[kept] != 0)
    assert 0.3 < kept.mean() < 0.7


def test_engine_and_dense_reference_release_the_same_masked_rows():
  # sparsified around it: the engine's masked row forms against the masked
  # materialized gradients, one noise key.
  ids, engine, selection, _ = _noisy_step()
  privatizer = tfdpx.privatizers.sparsified(selection, 0.5, epochs=2,
                                            steps_per_epoch=1)
  table = tf.Variable(tf.zeros([300, 3]))
  state = {**privatizer.init([table]), 'step': tf.constant(1, tf.int64)}
  got, _ = privatizer.update(engine, state, _seed(3))
  want, _ = privatizer.update(_reference(engine), state, _seed(3))
  np.testing.assert_array_equal(got[0].indices, want[0].indices)
  np.testing.assert_allclose(got[0].values, want[0].values, rtol=1e-5,
                             atol=1e-6)
  assert np.any(got[0].values.numpy() == 0)  # Masked coordinates.
  assert set(got[0].indices.numpy()) & set(np.unique(ids))


def _dpdr_state(privatizer, params, base_rows, step=1, seed=4):
  """`(state, inner state)` of `privatizer` (sparse_embeddings around DPDR,
  perhaps inside wrappers) at step `step`, DPDR's base on the tables' rows
  `base_rows` (a unit vector per variable), as after a step that released
  those rows."""
  rng = np.random.default_rng(seed)
  base = []
  for i, p in enumerate(params):
    b = rng.normal(size=p.shape).astype(np.float32)
    if i < len(base_rows):
      b[np.setdiff1d(np.arange(p.shape[0]), base_rows[i])] = 0
    norm = np.linalg.norm(b)
    base.append(tf.constant(b / norm if norm else b))

  def with_base(state):
    if 'base' in state:
      return {**state, 'step': tf.constant(step, tf.int64), 'base': base}
    return {**state, 'inner': with_base(state['inner'])}
  state = with_base(privatizer.init(params))
  return state, state['inner']


def _dpdr_base(state):
  return state['base'] if 'base' in state else _dpdr_base(state['inner'])


@pytest.mark.parametrize('wrap', [None, 'per_layer', 'adaptive'])
def test_dpdr_releases_its_dense_release_on_the_selected_rows(wrap):
  # A decomposition step without noise, every touched row selected: on them
  # and on the dense variable the release is dense DPDR's (a base on rows
  # the batch touches and on rows it does not), and the next base is the
  # release normalized, zero on every other row.
  params, gradients_of = _two_tables()
  grads = gradients_of(tf.range(11))
  # A coefficient clip that binds (per-layer clipping alone keeps every
  # record within 0.5): the base's part does not cancel on untouched rows.
  inner = dpdr(0.5, 0.0, decomposition_steps=5, alpha_l2_norm_clip=0.05)
  if wrap == 'per_layer':
    inner = tfdpx.privatizers.per_layer_clipping(inner)
  elif wrap == 'adaptive':
    inner = adaptive_clipping(inner, 11.0, count_noise_multiplier=1.0)
  privatizer = sparse_embeddings(inner)
  state, dense_state = _dpdr_state(privatizer, params,
                                   [np.arange(0, 300, 2), np.arange(25)])
  got, got_state = privatizer.update(grads, state, _seed(2))
  want, want_state = inner.update(grads, dense_state, _seed(2))
  base = _dpdr_base(got_state)
  for i in range(2):
    touched = np.flatnonzero(np.any(grads.materialized()[i] != 0, (0, 2)))
    np.testing.assert_array_equal(np.sort(got[i].indices), touched)
    np.testing.assert_allclose(got[i].values, tf.gather(want[i],
                                                        got[i].indices),
                               rtol=1e-5, atol=1e-6)
    # Dense DPDR releases the base's part on rows no example touched too.
    untouched = np.setdiff1d(np.arange(params[i].shape[0]), touched)
    assert np.any(want[i].numpy()[untouched] != 0)
    expected = np.zeros(params[i].shape, np.float32)
    expected[got[i].indices.numpy()] = (got[i].values.numpy() /
                                        np.linalg.norm(got[i].values))
    np.testing.assert_allclose(base[i], expected, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(base[2], _dpdr_base(want_state)[2], rtol=1e-5)
  # The decomposition did something: the release is not DP-SGD's.
  dp_sgd, _ = sparse_embeddings(gaussian(0.5, 0.0)).update(
      grads, sparse_embeddings(gaussian(0.5, 0.0)).init(params), _seed(2))
  assert not np.allclose(tf.convert_to_tensor(got[0]),
                         tf.convert_to_tensor(dp_sgd[0]), atol=1e-4)


def test_dpdr_engine_and_dense_reference_release_the_same_rows_with_one_key():
  ids, engine, _, _ = _noisy_step()
  privatizer = sparse_embeddings(dpdr(0.5, 0.3, decomposition_steps=5),
                                 selection_share=0.5, false_positive_rate=0.02)
  table = tf.Variable(tf.zeros([300, 3]))
  state, _ = _dpdr_state(privatizer, [table], [np.unique(ids)[::2]])
  got, got_state = privatizer.update(engine, state, _seed(3))
  want, want_state = privatizer.update(_reference(engine), state, _seed(3))
  np.testing.assert_array_equal(got[0].indices, want[0].indices)
  np.testing.assert_allclose(got[0].values, want[0].values, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(_dpdr_base(got_state)[0],
                             _dpdr_base(want_state)[0], rtol=1e-5, atol=1e-7)
  touched = set(np.unique(ids))
  assert 0 < len(touched & set(got[0].indices.numpy())) < len(touched)
  assert set(got[0].indices.numpy()) - touched


@pytest.mark.parametrize('step', [0, 1])
def test_dpdr_noise_on_the_released_rows_matches_its_event(step):
  # A false positive's sums are zero. At a decomposition step (1), with a
  # zero base on the table, what is released there is the orthogonal part's
  # noise alone, std z_perp C with z_perp = z_g / sqrt(1 - alpha_share); at
  # a DP-SGD step (0), z_g C. Two-sided: each rejects the other's std.
  vocab, rate, clip, z, share = 100_000, 2e-3, 0.5, 1.0, 0.5
  ids, tap_grad = _lookups(batch=8, vocab=10, dim=4)
  engine, table = _engine(ids, tap_grad, vocab)
  inner = dpdr(clip, z, decomposition_steps=5, alpha_share=share)
  privatizer = sparse_embeddings(inner, false_positive_rate=rate)
  state, _ = _dpdr_state(privatizer, [table], [np.arange(0)], step=step)
  values = []
  for seed in range(5):
    noisy, new_state = privatizer.update(engine, state, _seed(seed))
    false = noisy[0].indices.numpy() >= 10
    values.append(noisy[0].values.numpy()[false])
    base = _dpdr_base(new_state)[0].numpy()
    assert set(np.flatnonzero(np.any(base != 0, 1))) <= set(
        noisy[0].indices.numpy())
  z_g = privatizer.gradient_noise_multiplier
  perp = z_g / math.sqrt(1 - share)
  want, other = (perp, z_g) if step else (z_g, perp)
  values = np.concatenate(values)
  assert values.size > 1000
  assert stats.std_matches(values, want * clip)
  assert not stats.std_matches(values, other * clip)
