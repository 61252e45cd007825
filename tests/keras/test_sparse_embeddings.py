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


def _private(optimizer_class, noise_multiplier, **kwargs):
  model = tfdpx.keras.make_private(_model())
  privatizer = privatizers.sparse_embeddings(
      privatizers.gaussian(1.0, noise_multiplier), false_positive_rate=1e-9)
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


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_rows_not_selected_get_no_update(name):
  # Without noise every touched row is selected, and no other: a row the
  # second data set does not touch must keep the value the first gave it,
  # which dense Adam or momentum (decaying moments over all rows) breaks.
  model = _private(OPTIMIZERS[name], 0.0)
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


def test_virtual_batches_and_xla_are_refused_with_the_reason():
  privatizer = privatizers.sparse_embeddings(privatizers.gaussian(1.0, 1.0))
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction='none')
  data, _ = _data(0, 50)
  model = tfdpx.keras.make_private(_model(), physical_batch_size=8)
  model.compile(tfdpx.keras.DPSGD(privatizer=privatizer,
                                  expected_batch_size=BATCH), loss,
                jit_compile=False)
  with pytest.raises(ValueError, match='virtual batches'):
    model.fit(data, verbose=0)
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
