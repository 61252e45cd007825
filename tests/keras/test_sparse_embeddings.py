"""sparse_embeddings in Keras training: sparse updates of the selected rows."""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import privatizers

VOCAB, LENGTH, BATCH = 500, 4, 16


def _model():
  tf.keras.utils.set_random_seed(2)
  ids = tf.keras.Input([LENGTH], dtype='int32')
  rows = tf.keras.layers.Embedding(VOCAB, 6, name='table')(ids)
  pooled = tf.keras.layers.GlobalAveragePooling1D()(rows)
  return tf.keras.Model(ids, tf.keras.layers.Dense(3)(pooled))


def _data(first_id, last_id, n=64, seed=0):
  """A `tf.data` pipeline (batch axis None when traced) over ids in
  `[first_id, last_id)`."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(first_id, last_id, size=[n, LENGTH]).astype('int32')
  labels = rng.integers(0, 3, n)
  return tf.data.Dataset.from_tensor_slices((ids, labels)).batch(BATCH), ids


INNER = {'gaussian': privatizers.gaussian,
         # Decomposing at every step after the first.
         'dpdr': lambda clip, z: privatizers.dpdr(clip, z,
                                                  decomposition_steps=100)}


def _private(optimizer_class, noise_multiplier, physical_batch_size=None,
             inner='gaussian', **kwargs):
  model = tfdpx.keras.make_private(_model(),
                                   physical_batch_size=physical_batch_size)
  privatizer = privatizers.sparse_embeddings(
      INNER[inner](1.0, noise_multiplier), false_positive_rate=1e-9)
  model.compile(optimizer_class(privatizer=privatizer, noise_seed=3,
                                expected_batch_size=BATCH, **kwargs),
                tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction='none'),
                jit_compile=False)
  return model


def _changed_rows(model, fit):
  table = model.get_layer('table').embeddings
  before = table.numpy()
  fit()
  return set(np.flatnonzero(np.any(table.numpy() != before, axis=1)))


OPTIMIZERS = {
    'sgd': lambda **k: tfdpx.keras.DPSGD(learning_rate=0.5, **k),
    'momentum': lambda **k: tfdpx.keras.DPSGD(learning_rate=0.5,
                                              momentum=0.9, **k),
    'nesterov': lambda **k: tfdpx.keras.DPSGD(
        learning_rate=0.5, momentum=0.9, nesterov=True, **k),
    'adam': lambda **k: tfdpx.keras.DPAdam(learning_rate=0.01, **k),
    'adagrad': lambda **k: tfdpx.keras.DPAdagrad(learning_rate=0.1, **k),
}


@pytest.mark.parametrize('name, inner', [
    *((name, 'gaussian') for name in sorted(OPTIMIZERS)),
    ('sgd', 'dpdr'), ('adam', 'dpdr')])
def test_rows_not_selected_get_no_update(name, inner):
  # Without noise every touched row is selected, and no other: a row the
  # second data set does not touch must keep the value the first gave it,
  # which dense Adam or momentum (decaying moments over all rows) breaks,
  # and so would dense DPDR (its base, on the first set's rows, is part of
  # each release).
  model = _private(OPTIMIZERS[name], 0.0, inner=inner)
  first, first_ids = _data(0, 100)
  second, second_ids = _data(200, 300, seed=1)
  assert _changed_rows(model, lambda: model.fit(first, verbose=0)) == set(
      np.unique(first_ids))
  head = model.layers[-1].kernel.numpy()
  assert _changed_rows(model, lambda: model.fit(second, verbose=0)) == set(
      np.unique(second_ids))
  assert np.any(model.layers[-1].kernel.numpy() != head)


def test_noisy_selection_updates_touched_rows_and_false_positives_only():
  # Counts of about 5 against a threshold of 0.6 * Phi^-1(1 - 1e-9) = 3.6:
  # most touched rows are selected; with false_positive_rate 1e-9 the
  # untouched rows stay as they were.
  model = _private(OPTIMIZERS['sgd'], 0.3)
  data, ids = _data(0, 5, n=256)
  changed = _changed_rows(model, lambda: model.fit(data, verbose=0))
  assert changed and changed <= set(np.unique(ids))


def test_numpy_input_and_history_are_as_with_dense_training():
  model = _private(OPTIMIZERS['sgd'], 0.5)
  _, ids = _data(0, 50)
  history = model.fit(ids, np.zeros(len(ids)), batch_size=BATCH, verbose=0)
  assert np.isfinite(history.history['loss'][0])


@pytest.mark.parametrize('name, inner', [('sgd', 'gaussian'),
                                         ('adam', 'gaussian'),
                                         ('sgd', 'dpdr')])
def test_virtual_batches_train_as_whole_batches(name, inner):
  # Physical batches of 5 rows (the last one of each batch of 16 padded):
  # the same noisy rows selected and the same weights after an epoch. Counts
  # of about 4 against a threshold of 3.6 in two steps: some rows are
  # selected, not all.
  data, _ = _data(0, 8, n=2 * BATCH)
  whole, parts = (_private(OPTIMIZERS[name], 0.3, physical_batch_size=size,
                           inner=inner)
                  for size in (None, 5))
  assert 0 < len(_changed_rows(whole, lambda: whole.fit(data, verbose=0))) < 8
  parts.fit(data, verbose=0)
  for a, b in zip(whole.trainable_weights, parts.trainable_weights):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)


def test_xla_is_refused_with_the_reason():
  privatizer = privatizers.sparse_embeddings(privatizers.gaussian(1.0, 1.0))
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction='none')
  data, _ = _data(0, 50)
  model = tfdpx.keras.make_private(_model())
  model.compile(tfdpx.keras.DPSGD(privatizer=privatizer,
                                  expected_batch_size=BATCH), loss,
                jit_compile=True)
  with pytest.raises(Exception, match='jit_compile=False'):
    model.fit(data, verbose=0)


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_first_step_equals_the_dense_release(name):
  # Before any row was selected the lazy and the dense updates agree: the
  # update of each selected row follows the optimizer's own formula.
  data, _ = _data(0, 100, n=BATCH)
  trained = []
  for sparse in (True, False):
    model = tfdpx.keras.make_private(_model())
    privatizer = privatizers.gaussian(1.0, 0.0)
    if sparse:
      privatizer = privatizers.sparse_embeddings(privatizer)
    model.compile(OPTIMIZERS[name](privatizer=privatizer,
                                   expected_batch_size=BATCH),
                  tf.keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, reduction='none'), jit_compile=False)
    model.fit(data, verbose=0)
    trained.append([v.numpy() for v in model.trainable_variables])
  for sparse, dense in zip(*trained):
    np.testing.assert_allclose(sparse, dense, rtol=1e-5, atol=1e-6)


def test_random_sparsification_moves_the_kept_coordinates_of_touched_rows():
  # sparsified around sparse_embeddings, no noise, plain SGD: the second step
  # (window 1, half the coordinates zeroed) moves exactly the coordinates of
  # the rows it touches that the mask keeps.
  privatizer = privatizers.sparsified(
      privatizers.sparse_embeddings(privatizers.gaussian(1.0, 0.0)), 0.5,
      epochs=2, steps_per_epoch=1)
  model = tfdpx.keras.make_private(_model())
  model.compile(OPTIMIZERS['sgd'](privatizer=privatizer,
                                  expected_batch_size=BATCH),
                tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction='none'), jit_compile=False)
  model.fit(_data(0, 100, n=BATCH)[0], verbose=0)
  table = model.get_layer('table').embeddings
  before = table.numpy()
  data, ids = _data(200, 300, n=BATCH, seed=1)
  model.fit(data, verbose=0)
  mask = privatizer.masks(1, [v.shape for v in model.trainable_variables])[
      [v.name for v in model.trainable_variables].index(table.name)].numpy()
  touched = np.zeros_like(mask)
  touched[np.unique(ids)] = 1
  np.testing.assert_array_equal(table.numpy() != before,
                                (touched * mask) > 0)
  assert 0.3 < mask[np.unique(ids)].mean() < 0.7
