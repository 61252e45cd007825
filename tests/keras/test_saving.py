"""A saved model made private reloads with its privacy ledger, in every format.

The DP optimizer's variables (the count of private steps behind epsilon and
the privatizer's state) must survive `model.save` / `load_model`, so that a
resumed run's epsilon accounts for every step taken.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx

NONE = 'none'
FORMATS = [
    'model.keras',
    pytest.param('model.h5', marks=pytest.mark.keras2_only(
        "Keras 3's legacy .h5 does not restore a trainable optimizer (Keras "
        'fails at the first step on loading): save .keras (docs/keras3.md)')),
    pytest.param('saved_model', marks=pytest.mark.keras2_only(
        'Keras 3 saves a model to train on as .keras only (model.export '
        'writes the serving SavedModel: tests/keras/test_keras3.py)')),
]
BATCH = 8


def _data(n=24):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 5)).astype('float32')
  return x, (x[:, 0] > 0).astype('int32')


def _model(kind):
  tf.keras.utils.set_random_seed(0)
  if kind == 'functional':
    inputs = tf.keras.Input((5,))
    hidden = tf.keras.layers.Dense(4, activation='tanh')(inputs)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(2)(hidden))
  return tf.keras.Sequential([tf.keras.layers.Dense(4, activation='tanh'),
                              tf.keras.layers.Dense(2)])


def _compiled(model):
  # DPDR keeps a state (its previous noisy direction and a step counter).
  privatizer = tfdpx.privatizers.dpdr(1.0, 1.0, decomposition_steps=10)
  model.compile(tfdpx.keras.DPSGD(privatizer=privatizer,
                                  expected_batch_size=BATCH,
                                  learning_rate=0.1),
                tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction=NONE))
  return model


def _state(optimizer):
  return [v.numpy() for v in optimizer._dp_state_vars]  # pylint: disable=protected-access


@pytest.mark.parametrize('kind', ['functional', 'sequential'])
@pytest.mark.parametrize('filename', FORMATS)
def test_model_made_private_reloads_with_its_ledger(tmp_path, kind,
                                                    filename):
  x, y = _data()
  model = _compiled(tfdpx.keras.make_private(_model(kind)))
  model.fit(x, y, batch_size=BATCH, verbose=0)
  assert int(model.optimizer.dp_steps.numpy()) == 3
  path = str(tmp_path / filename)
  model.save(path)

  loaded = tf.keras.models.load_model(path)
  assert isinstance(loaded, tfdpx.keras.DPModel if kind == 'functional'
                    else (tfdpx.keras.DPModel, tfdpx.keras.DPSequential))
  optimizer = loaded.optimizer
  assert isinstance(optimizer, tfdpx.keras.DPSGD)
  assert int(optimizer.dp_steps.numpy()) == 3
  assert int(optimizer.iterations.numpy()) == 3
  for a, b in zip(_state(optimizer), _state(model.optimizer)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(loaded.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-6)

  loaded.fit(x, y, batch_size=BATCH, verbose=0)
  assert int(optimizer.dp_steps.numpy()) == 6
  expected = tfdpx.accounting.epsilon(optimizer.privatizer, steps=6,
                                      sampling_probability=0.1, delta=1e-5)
  assert tfdpx.accounting.epsilon(optimizer, sampling_probability=0.1,
                                  delta=1e-5) == expected


@pytest.mark.keras2_only('the compile path')
def test_plain_model_h5_reloads_with_its_ledger(tmp_path):
  x, y = _data()
  model = _compiled(_model('functional'))
  model.fit(x, y, batch_size=BATCH, verbose=0)
  path = str(tmp_path / 'model.h5')
  model.save(path)
  loaded = tf.keras.models.load_model(path)
  assert int(loaded.optimizer.dp_steps.numpy()) == 3
  for a, b in zip(_state(loaded.optimizer), _state(model.optimizer)):
    np.testing.assert_array_equal(a, b)
  loaded.fit(x, y, batch_size=BATCH, verbose=0)
  assert int(loaded.optimizer.dp_steps.numpy()) == 6


@pytest.mark.keras2_only('the compile path')
@pytest.mark.parametrize('filename', ['model.keras', 'saved_model'])
def test_plain_model_without_saved_optimizer_state_refuses_to_train_on(
    tmp_path, filename):
  # Keras 2 saves no optimizer variables of a plain model in these formats:
  # training on would restart the ledger at 0, so the optimizer refuses.
  x, y = _data()
  model = _compiled(_model('functional'))
  model.fit(x, y, batch_size=BATCH, verbose=0)
  path = str(tmp_path / filename)
  model.save(path)
  loaded = tf.keras.models.load_model(path)
  with pytest.raises(ValueError, match='saved after 3 private steps'):
    loaded.fit(x, y, batch_size=BATCH, verbose=0)
