"""One example reaches the update only through its own clipped record.

Issue 17: data-dependent `add_loss` terms, tied weights around fast clipping,
non-finite records and random layers in the fallback, on every training path.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx.privatizers import dpdr
from tfdpx.privatizers import gaussian
from tfdpx.keras.version import KERAS_3

_COMPILE_PATH = pytest.mark.keras2_only('the compile path')

L = tf.keras.layers
NONE = 'none'


class _SqrtLoss(tf.keras.losses.Loss):
  """`sqrt(y * sum|p|)`: where y == 0 the gradient is NaN (sqrt at 0)."""

  def call(self, y_true, y_pred):
    return tf.sqrt(tf.cast(y_true[:, 0], y_pred.dtype) *
                   tf.reduce_sum(tf.abs(y_pred), axis=-1))


def _mse():
  return tf.keras.losses.MeanSquaredError(reduction=NONE)


def _optimizer(privatizer, batch, learning_rate=1.0):
  return tfdpx.keras.DPSGD(privatizer=privatizer, expected_batch_size=batch,
                           learning_rate=learning_rate, noise_seed=3)


def _update(model, x, y, optimizer, loss, **compile_kwargs):
  """The change of the weights in one step on the batch (x, y)."""
  model.compile(optimizer, loss, **compile_kwargs)
  start = model.get_weights()
  model.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0)
  return [w - s for s, w in zip(start, model.get_weights())]


def _norm(update):
  return float(np.sqrt(sum(np.sum(np.square(u)) for u in update)))


def _private(model, path, **engine):
  if path == 'compile':
    return model
  return tfdpx.keras.make_private(
      model, fast_clipping=path != 'materialized',
      use_layer_rules=path != 'no_rules', **engine)


# --- 1. add_loss that depends on the data ------------------------------------


class IntegerLoss(L.Layer):
  """Adds a loss computed from integer inputs only."""

  def call(self, inputs):
    ids, x = inputs
    self.add_loss(tf.reduce_mean(tf.cast(ids, tf.float32)))
    return x


class StopGradientLoss(L.Layer):
  """Adds a loss of its input behind tf.stop_gradient."""

  def call(self, inputs):
    self.add_loss(tf.reduce_sum(tf.stop_gradient(inputs)))
    return inputs


def _integer_loss_model():
  ids, x = tf.keras.Input((3,), dtype='int32'), tf.keras.Input((2,))
  h = IntegerLoss(name='integer_loss')([ids, L.Dense(2)(x)])
  data = [np.array([[100, 200, 300]]), np.ones((1, 2), 'float32')]
  return tf.keras.Model([ids, x], L.Dense(1)(h)), data


def _stop_gradient_loss_model():
  model = tf.keras.Sequential([
      tf.keras.Input((2,)), L.Dense(2),
      StopGradientLoss(name='stop_gradient_loss'), L.Dense(1)])
  return model, np.full((1, 2), 5.0, 'float32')


@pytest.mark.parametrize('run_eagerly', [False, True], ids=['graph', 'eager'])
@pytest.mark.parametrize('build', [_integer_loss_model,
                                   _stop_gradient_loss_model])
def test_an_add_loss_depending_on_the_data_is_refused_at_the_first_fit(
    build, run_eagerly):
  # On the code before the fix, both trained: released norm 200 and 10 > C.
  tf.keras.utils.set_random_seed(0)
  model, x = build()
  private = tfdpx.keras.make_private(model)
  private.compile(_optimizer(gaussian(1.0, 1e-9), 1), _mse(),
                  run_eagerly=run_eagerly)
  name = model.layers[-2].name
  with pytest.raises(ValueError, match=f'{name}.*per-example loss'):
    private.fit(x, np.zeros((1, 1)), verbose=0)


class WeightLoss(L.Layer):
  """Adds a penalty of its own weight in `call`: no data in it."""

  def build(self, input_shape):
    self.scale = self.add_weight(name='scale', shape=[], initializer='ones')

  def call(self, inputs):
    self.add_loss(tf.square(self.scale))
    return inputs * self.scale


@pytest.mark.parametrize('run_eagerly', [False, True], ids=['graph', 'eager'])
def test_data_independent_losses_train_outside_the_clip(run_eagerly):
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([
      tf.keras.Input((2,)),
      L.Dense(2, kernel_regularizer=tf.keras.regularizers.L2(1.0)),
      WeightLoss(), L.Dense(1)])
  kernel = model.layers[0].kernel.numpy()
  # A clip of 1e-9 silences the data: what moves is the penalties' gradient.
  step = _update(tfdpx.keras.make_private(model), np.ones((4, 2)),
                 np.zeros((4, 1)), _optimizer(gaussian(1e-9, 0.0), 4, 0.1),
                 _mse(), run_eagerly=run_eagerly)
  np.testing.assert_allclose(step[0], -0.1 * 2 * kernel, rtol=1e-4)
  np.testing.assert_allclose(step[2], -0.1 * 2 * 1.0, rtol=1e-4)


# --- 2. Tied weights ---------------------------------------------------------


def _tied_model():
  """A Dense layer whose input is computed from its own kernel (a raw op)."""
  tf.keras.utils.set_random_seed(0)
  inputs = tf.keras.Input((4,))
  dense = L.Dense(4, use_bias=False)
  dense.build((None, 4))
  x = L.Lambda(lambda t: tf.matmul(t, dense.kernel, transpose_b=True))(inputs)
  return tf.keras.Model(inputs, L.Dense(1)(dense(x)))


def test_tied_weights_are_clipped_as_one_record_on_every_path():
  x, y = np.full((1, 4), 3.0, 'float32'), np.ones((1, 1), 'float32')
  updates = {}
  # The compile path, where there is one (Keras 2), is the reference.
  reference = 'materialized' if KERAS_3 else 'compile'
  paths = ('fast', 'materialized', 'no_rules') + (() if KERAS_3 else
                                                   ('compile',))
  for path in paths:
    updates[path] = _update(_private(_tied_model(), path), x, y,
                            _optimizer(gaussian(1.0, 1e-9), 1), _mse())
    # Fast clipping released 2.16 before the fix (C = 1).
    assert _norm(updates[path]) <= 1.0 + 1e-5, path
    assert _norm(updates[path]) > 0.99, path  # Clipped: the record is large.
  for path in ('fast', 'materialized', 'no_rules'):
    for got, want in zip(updates[path], updates[reference]):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


# --- 4. Non-finite records ---------------------------------------------------


def _small_model():
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential([
      tf.keras.Input((4,)), L.Dense(3, activation='tanh'), L.Dense(2)])


def _batch(cause):
  """A batch of 4 whose example 1 has a non-finite gradient, and its label."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(4, 4)).astype('float32')
  y = np.ones((4, 1), 'float32')
  if cause == 'nan_loss':
    y[1] = 0.0
  else:
    x[1, 0] = np.inf
  return x, y


@pytest.mark.parametrize('path, privatizer, cause', [
    ('fast', 'gaussian', 'nan_loss'),
    ('fast', 'gaussian', 'inf_input'),
    ('materialized', 'dpdr', 'nan_loss'),
    ('materialized', 'dpdr', 'inf_input'),
    pytest.param('compile', 'gaussian', 'nan_loss', marks=_COMPILE_PATH),
    pytest.param('compile', 'dpdr', 'nan_loss', marks=_COMPILE_PATH),
])
def test_a_non_finite_record_is_dropped_and_the_rest_released(
    path, privatizer, cause):
  # Before the fix every one of these updates was NaN.
  make = {'gaussian': lambda: gaussian(0.5, 0.7),
          'dpdr': lambda: dpdr(0.5, 0.7)}[privatizer]
  x, y = _batch(cause)
  keep = [0, 2, 3]
  loss = _SqrtLoss(reduction=NONE)
  with_bad = _update(_private(_small_model(), path), x, y,
                     _optimizer(make(), 4), loss)
  without = _update(_private(_small_model(), path), x[keep], y[keep],
                    _optimizer(make(), 4), loss)
  for got, want in zip(with_bad, without):
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('path', ['fast', 'materialized'])
def test_the_count_of_dropped_records_is_a_training_metric(path):
  x, y = _batch('nan_loss')
  model = _private(_small_model(), path)
  model.compile(_optimizer(gaussian(0.5, 0.7), 4), _SqrtLoss(reduction=NONE))
  logs = model.fit(x, y, batch_size=4, verbose=0).history
  assert logs['dropped_records'] == [1]
  quiet = _private(_small_model(), path, release_training_metrics=False)
  quiet.compile(_optimizer(gaussian(0.5, 0.7), 4), _SqrtLoss(reduction=NONE))
  assert 'dropped_records' not in quiet.fit(x, y, batch_size=4,
                                            verbose=0).history


@_COMPILE_PATH
def test_the_compile_path_stays_finite_when_an_input_is_infinite():
  # The Jacobian's batched weight gradient multiplies the infinite input by
  # the other rows' zero weights: every record of that variable is NaN and
  # dropped (docs/per_example.md); the step must still be finite.
  x, y = _batch('inf_input')
  update = _update(_small_model(), x, y, _optimizer(gaussian(0.5, 0.7), 4),
                   _SqrtLoss(reduction=NONE))
  assert all(np.all(np.isfinite(u)) for u in update)


# --- 6. Random layers in the fallback ----------------------------------------


class FixedMaskDense(L.Layer):
  """Dense after a dropout mask drawn statelessly from a fixed seed.

  The same mask on every call with the same input shape, so the compile path
  and make_private see the same masks; recomputing one example (shape
  [1, d]) draws a different one.
  """

  def build(self, input_shape):
    self.kernel = self.add_weight(name='kernel', shape=[input_shape[-1], 3])

  def call(self, inputs, training=None):
    if training:
      keep = tf.random.stateless_uniform(tf.shape(inputs), [1, 2]) < 0.5
      inputs = tf.where(keep, inputs * 2.0, 0.0)
    return tf.matmul(inputs, self.kernel)


class Subclassed(tf.keras.Model):
  """A subclassed model: one fallback unit with randomness inside."""

  def __init__(self):
    super().__init__()
    self.masked, self.dense = FixedMaskDense(), L.Dense(2)

  def call(self, inputs, training=None):
    return self.dense(self.masked(inputs, training=training))


def _random_model(kind):
  tf.keras.utils.set_random_seed(0)
  if kind == 'subclassed':
    model = Subclassed()
    model(tf.zeros([1, 5]))
    return model
  return tf.keras.Sequential([tf.keras.Input((5,)), FixedMaskDense(),
                              L.Dense(2)])


@_COMPILE_PATH  # Its reference.
@pytest.mark.parametrize('kind', ['layer', 'subclassed'])
@pytest.mark.parametrize('path', ['fast', 'materialized'])
def test_a_random_fallback_layer_gets_the_gradient_of_the_forward_that_ran(
    kind, path):
  # Before the fix the per-example recomputation drew other masks.
  x = np.random.default_rng(0).normal(size=(6, 5)).astype('float32')
  y = np.ones((6, 2), 'float32')
  updates = [
      _update(_private(_random_model(kind), p), x, y,
              _optimizer(gaussian(0.3, 0.0), 6), _mse())
      for p in (path, 'compile')
  ]
  for got, want in zip(*updates):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
