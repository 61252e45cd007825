"""Model validation: the same refusals on every DP path."""

import logging

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx.keras.stack import optimizers

L = tf.keras.layers
NONE = 'none'
BATCH = 8


class MeanWriter(L.Layer):
  """Stores the batch mean of its inputs in a non-trainable variable."""

  def build(self, input_shape):
    self.stored = self.add_weight(name='stored', shape=[], trainable=False,
                                  initializer='zeros')

  def call(self, inputs):
    self.stored.assign(tf.reduce_mean(tf.cast(inputs, tf.float32)))
    return inputs


class LoopWriter(L.Layer):
  """Writes its variable from the data inside a tf.cond in a tf.while_loop."""

  def build(self, input_shape):
    self.stored = self.add_weight(name='stored', shape=[], trainable=False,
                                  initializer='zeros')

  def call(self, inputs):
    # Explicit control flow: Keras 3 does not autograph a layer's call.
    def write():
      self.stored.assign_add(tf.reduce_max(inputs))
      return tf.constant(0)

    def body(i):
      tf.cond(tf.reduce_sum(inputs) > -1e9, write, lambda: tf.constant(0))
      return (i + 1,)

    tf.while_loop(lambda i: i < 2, body, (tf.constant(0),))
    return inputs


class Counter(L.Layer):
  """Counts its calls and tracks an average of its weight: no data."""

  def build(self, input_shape):
    self.kernel = self.add_weight(name='kernel', shape=[input_shape[-1], 2])
    self.calls = self.add_weight(name='calls', shape=[], trainable=False,
                                 initializer='zeros')
    self.average = self.add_weight(name='average', shape=[input_shape[-1], 2],
                                   trainable=False, initializer='zeros')

  def call(self, inputs):
    self.calls.assign_add(1.0)
    self.average.assign(0.9 * self.average + 0.1 * self.kernel)
    self.calls.assign(tf.cast(tf.shape(inputs)[0], tf.float32))  # A shape.
    return tf.matmul(inputs, self.kernel)


def _sequential(*layers, input_shape=(4,), batch_size=None, dtype='float32'):
  tf.keras.utils.set_random_seed(0)
  return tf.keras.Sequential(
      [tf.keras.Input(input_shape, batch_size=batch_size, dtype=dtype),
       *layers])


# name -> (model factory, what the error must say).
REFUSED = {
    'batch_norm': (
        lambda: _sequential(L.Dense(3), L.BatchNormalization(name='bn'),
                            L.Dense(2)),
        "'bn'.*mixes the examples.*GroupNormalization or LayerNormalization"),
    'sync_batch_norm': (
        lambda: _sequential(L.Dense(3), L.BatchNormalization(
            synchronized=True, name='bn'), L.Dense(2)),
        "'bn'.*mixes the examples.*GroupNormalization or LayerNormalization"),
    'layer_norm_over_batch': (
        lambda: _sequential(L.LayerNormalization(axis=0, name='norm'),
                            L.Dense(2), batch_size=BATCH),
        "'norm'.*mixes the examples.*over the features only"),
    'group_norm_over_batch': (
        lambda: _sequential(L.GroupNormalization(2, axis=0, name='norm'),
                            L.Dense(2), batch_size=BATCH),
        "'norm'.*mixes the examples.*over the features only"),
    'unit_norm_over_batch': (
        lambda: _sequential(L.Dense(3), L.UnitNormalization(0, name='norm'),
                            L.Dense(2)),
        "'norm'.*mixes the examples.*over the features only"),
    'stateful_rnn': (
        lambda: _sequential(L.LSTM(3, stateful=True, name='rnn'), L.Dense(2),
                            input_shape=(5, 4), batch_size=BATCH),
        "'rnn'.*stateful.*stateful=False"),
    'writes_a_variable': (
        lambda: _sequential(MeanWriter(name='writer'), L.Dense(2)),
        "'writer'.*writes the variable '([\\w/]*/)?writer/stored.*from the data"),
    'writes_in_control_flow': (
        lambda: _sequential(LoopWriter(name='writer'), L.Dense(2)),
        "'writer'.*writes the variable '([\\w/]*/)?writer/stored.*from the data"),
    'writes_from_integer_inputs': (
        lambda: _sequential(MeanWriter(name='writer'), L.Embedding(10, 3),
                            L.Flatten(), L.Dense(2), dtype='int32'),
        "'writer'.*writes the variable '([\\w/]*/)?writer/stored.*from the data"),
}


def _data(model):
  rng = np.random.default_rng(0)
  spec = model.inputs[0]
  shape = (BATCH, *spec.shape[1:])
  if tf.as_dtype(spec.dtype).is_integer:
    x = rng.integers(0, 10, size=shape).astype('int32')
  else:
    x = rng.normal(size=shape).astype('float32')
  return x, rng.integers(0, 2, size=BATCH)


def _compile(model, **kwargs):
  model.compile(
      tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                        expected_batch_size=BATCH, learning_rate=0.1),
      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction=NONE), **kwargs)
  return model


def _fit(model):
  x, y = _data(model)
  model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


@pytest.mark.keras2_only('the compile path')
@pytest.mark.parametrize('run_eagerly', [False, True])
@pytest.mark.parametrize('name', sorted(REFUSED))
def test_the_compile_path_refuses_at_the_first_step(name, run_eagerly):
  make, match = REFUSED[name]
  model = _compile(make(), run_eagerly=run_eagerly)
  with pytest.raises(ValueError, match=match):
    _fit(model)


@pytest.mark.keras2_only('the compile path')
def test_the_compile_path_refuses_float16_layers_naming_the_fix():
  """It has no loss scaling (models made private have: see
  tests/keras/test_mixed_precision.py)."""
  model = _compile(_sequential(L.Dense(3), L.Dense(2, dtype='mixed_float16',
                                                   name='half')))
  with pytest.raises(ValueError, match="'half'.*computes in float16.*"
                     "'mixed_float16'.*loss scaling.*make_private"):
    _fit(model)


@pytest.mark.parametrize('name', sorted(REFUSED))
def test_make_private_refuses_at_construction(name):
  make, match = REFUSED[name]
  with pytest.raises(ValueError, match=match):
    tfdpx.keras.make_private(make())


class Subclassed(tf.keras.Model):
  """A subclassed model (no inputs known before the first step)."""

  def __init__(self, inner):
    super().__init__()
    self.inner = inner

  def call(self, inputs, training=None):
    return self.inner(inputs, training=training)


@pytest.mark.parametrize('run_eagerly', [False, True])
@pytest.mark.parametrize('name', sorted(n for n in REFUSED if 'writes' in n))
def test_make_private_refuses_a_writer_in_a_subclassed_model_before_it_writes(
    name, run_eagerly):
  # Only the first step shows what a subclassed model's call does.
  make, match = REFUSED[name]
  inner = make()
  x, y = _data(inner)
  private = _compile(tfdpx.keras.make_private(Subclassed(inner)),
                     run_eagerly=run_eagerly)
  with pytest.raises(ValueError, match=match):
    private.fit(x, y, batch_size=BATCH, verbose=0)
  assert inner.layers[0].stored.numpy() == 0.0


@pytest.mark.keras2_only('the compile path')
@pytest.mark.parametrize('name', sorted(n for n in REFUSED if 'writes' in n))
def test_the_compile_path_refuses_a_writer_in_a_subclassed_model(name):
  make, match = REFUSED[name]
  inner = make()
  x, y = _data(inner)
  model = _compile(Subclassed(inner))
  with pytest.raises(ValueError, match=match):
    model.fit(x, y, batch_size=BATCH, verbose=0)
  assert inner.layers[0].stored.numpy() == 0.0  # Refused while tracing.


ACCEPTED = {
    'keras_layers': lambda: _sequential(
        L.Reshape((2, 2, 1)), L.Conv2D(2, 2, padding='same'),
        L.Conv2DTranspose(2, 2, padding='same'),
        L.SeparableConv2D(2, 2, padding='same'),
        L.DepthwiseConv2D(2, padding='same'), L.Reshape((4, 2)),
        L.Conv1D(2, 2, padding='causal'), L.LayerNormalization(),
        L.GroupNormalization(2), L.Dropout(0.3), L.GaussianNoise(0.1),
        L.Flatten(), L.Dense(2)),
    'recurrent_layers': lambda: _sequential(
        L.Reshape((4, 1)), L.LSTM(3, return_sequences=True),
        L.GRU(3, return_sequences=True, dropout=0.2),
        L.Bidirectional(L.SimpleRNN(2, return_sequences=True)),
        L.Flatten(), L.Dense(2)),
    'attention': lambda: tf.keras.Model(*_attention()),
    'frozen_batch_norm': lambda: _sequential(
        L.Dense(3), L.BatchNormalization(trainable=False), L.Dense(2)),
    'data_independent_writes': lambda: _sequential(Counter(), L.Dense(2)),
}


def _attention():
  inputs = tf.keras.Input((5,), dtype='int32')
  x = L.Embedding(10, 4)(inputs)
  x = L.MultiHeadAttention(2, 2)(x, x)
  return inputs, L.Dense(2)(L.Flatten()(x))


def _paths():
  """Every accepted model on both paths; the recurrent layers' jacobian on
  the compile path (35 s here, 4 times make_private's) in make test-all."""
  for name in sorted(ACCEPTED):
    for private in (False, True):
      slow = name == 'recurrent_layers' and not private
      yield pytest.param(name, private, id=f'{name}-{private}',
                         marks=[pytest.mark.slow] if slow else [])


@pytest.mark.keras2_only('the compile path')
@pytest.mark.parametrize('name,private', _paths())
def test_accepted_models_train_on_both_paths(name, private):
  model = ACCEPTED[name]()
  model = _compile(tfdpx.keras.make_private(model) if private else model)
  _fit(model)
  assert model.optimizer.dp_steps.numpy() == 1


@pytest.mark.keras2_only('the compile path')
def test_weight_regularizers_are_refused_for_the_compile_path_by_name():
  model = _sequential(
      L.Dense(3, kernel_regularizer='l2', name='regularized'), L.Dense(2))
  with pytest.raises(ValueError, match="'regularized'.*make_private"):
    tfdpx.keras.check_private_compatible(model, compile_path=True)
  tfdpx.keras.check_private_compatible(model)  # make_private supports them.
  _fit(_compile(tfdpx.keras.make_private(model)))


@pytest.mark.keras2_only('the compile path')
def test_the_compile_path_accepts_a_per_example_add_loss():
  # Keras adds a [B] term to each example's loss: inside that example's clip.
  inputs = tf.keras.Input((4,))
  hidden = L.Dense(3)(inputs)
  model = tf.keras.Model(inputs, L.Dense(2)(hidden))
  model.add_loss(0.1 * tf.reduce_sum(tf.square(hidden), axis=1))
  tfdpx.keras.check_private_compatible(model, model.inputs, compile_path=True)
  _fit(_compile(model))
  assert model.optimizer.dp_steps.numpy() == 1


def test_check_private_compatible_traces_only_with_inputs():
  model = _sequential(MeanWriter(name='writer'), L.Dense(2))
  tfdpx.keras.check_private_compatible(model)  # Layer configurations only.
  x, _ = _data(model)
  for inputs in (x, model.inputs, tf.TensorSpec([None, 4])):
    with pytest.raises(ValueError, match="'writer'"):
      tfdpx.keras.check_private_compatible(model, inputs)
  assert model.layers[0].stored.numpy() == 0.0  # Traced, never run.


@pytest.mark.keras2_only('the compile path')
def test_a_custom_training_loop_warns_once_naming_the_check(caplog):
  model = _sequential(L.Dense(2))
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                expected_batch_size=BATCH)
  x, y = _data(model)
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=NONE)
  with caplog.at_level(logging.WARNING, logger=optimizers.__name__):
    for _ in range(2):
      optimizer.minimize(lambda: loss(y, model(x, training=True)),
                         model.trainable_variables)
  warnings = [r for r in caplog.records
              if 'check_private_compatible' in r.getMessage()]
  assert len(warnings) == 1
  caplog.clear()
  _compile(model)  # Called from its model's train step: checked, no warning.
  with caplog.at_level(logging.WARNING, logger=optimizers.__name__):
    _fit(model)
  assert not [r for r in caplog.records
              if 'check_private_compatible' in r.getMessage()]
