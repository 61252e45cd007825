"""AutoGraph leaves tfdpx's code as written and converts the user's as Keras
does (tfdpx/autograph.py)."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.autograph.impl import api as autograph_api  # pylint: disable=g-direct-tensorflow-import

import tfdpx
from tfdpx.keras.version import KERAS_3

L = tf.keras.layers
BATCH = 8


class SignFlip(L.Layer):
  """Python control flow on a tensor: a graph only once AutoGraph converts
  `call` (Keras 2 does wherever AutoGraph's status is on, as in `fit`)."""

  def call(self, inputs):
    if tf.reduce_sum(inputs) > 0:
      return inputs
    return -inputs


class PythonBranchLoss(tf.keras.losses.Loss):
  """A loss whose `call` branches in Python on a tensor."""

  def call(self, y_true, y_pred):
    y_true = tf.cast(y_true, y_pred.dtype)
    if tf.reduce_max(y_pred) > 1e9:
      return tf.zeros_like(y_pred[:, 0])
    return tf.reduce_sum(tf.square(y_true - y_pred), axis=-1)


def _data():
  rng = np.random.default_rng(0)
  return (rng.normal(size=(2 * BATCH, 4)).astype('float32'),
          rng.normal(size=(2 * BATCH, 2)).astype('float32'))


def _model():
  # Keras 3 converts neither a layer's `call` nor a loss's, in plain Keras
  # either: the user's control flow there is explicit.
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([tf.keras.Input((4,)), L.Dense(3),
                              *([] if KERAS_3 else [SignFlip()]), L.Dense(2)])


def _compile(model):
  loss = (tf.keras.losses.MeanSquaredError(reduction='none') if KERAS_3 else
          PythonBranchLoss(reduction='none'))
  model.compile(tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                  expected_batch_size=BATCH,
                                  learning_rate=0.1), loss)
  return model


def _converted_modules(monkeypatch):
  """The modules of the functions AutoGraph converts from now on because
  converted code calls them (not those handed to `tf.function` itself)."""
  modules = []
  original = autograph_api._convert_actual  # pylint: disable=protected-access

  def recording(entity, program_ctx):
    if not program_ctx.options.user_requested:
      modules.append(getattr(entity, '__module__', None) or '')
    return original(entity, program_ctx)

  monkeypatch.setattr(autograph_api, '_convert_actual', recording)
  return modules


def _fit(model, x, y):
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def _traced_train_steps(model, x, y):
  # As a user's own loop over `train_step` (and our pipeline tests) run it.
  step = tf.function(model.train_step)
  for i in range(0, len(x), BATCH):
    step((x[i:i + BATCH], y[i:i + BATCH]))


def _custom_loop(model, x, y):
  # A loop of the user's own: Keras's `minimize` calls the loss unconverted.
  loss = model.loss

  @tf.function
  def step(x, y):
    model.optimizer.minimize(
        lambda: loss(y, model(x, training=True)), model.trainable_variables)

  for i in range(0, len(x), BATCH):
    step(x[i:i + BATCH], y[i:i + BATCH])


def _make_private():
  return tfdpx.keras.make_private(_model())


PATHS = {
    'fit_make_private': (_make_private, _fit),
    'traced_train_step': (_make_private, _traced_train_steps),
}
if not KERAS_3:  # The compile path and `minimize` are Keras 2's.
  PATHS['fit_compile_path'] = (_model, _fit)
  PATHS['custom_loop'] = (_model, _custom_loop)


@pytest.mark.parametrize('path', sorted(PATHS))
def test_tfdpx_runs_as_written_and_the_users_code_as_keras_converts_it(
    path, monkeypatch):
  make, train = PATHS[path]
  model = _compile(make())
  x, y = _data()
  modules = _converted_modules(monkeypatch)
  train(model, x, y)
  assert model.optimizer.dp_steps.numpy() == 2
  ours = sorted({m for m in modules if m.split('.')[0] == 'tfdpx'})
  assert not ours, f'AutoGraph converted tfdpx code: {ours}'
  if not KERAS_3:
    assert __name__ in modules, 'the user layer and loss were not converted'
