"""Models made private: `make_private`, `DPModel`, `DPSequential`."""

import logging

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import core
from tfdpx.keras import recorder
from tfdpx.keras.stack import optimizers
from tfdpx.privatizers import gaussian
from tests.privatizers import cases

L = tf.keras.layers
NONE = 'none'


def _data(n=12, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 6, 6, 1)).astype('float32')
  y = rng.integers(0, 3, size=(n,))
  return x, y


def _cnn(seed=0, **dense_kwargs):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      tf.keras.Input((6, 6, 1)),
      L.Conv2D(3, 3, strides=2, padding='same', activation='relu'),
      L.Flatten(),
      L.Dense(3, **dense_kwargs),
  ])


def _loss(reduction=NONE):
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=reduction)


def _sgd(privatizer=None, **kwargs):
  return tfdpx.keras.DPSGD(
      privatizer=privatizer or gaussian(0.5, 1.0), expected_batch_size=12,
      noise_seed=3, learning_rate=0.5, **kwargs)


@pytest.mark.keras2_only('the compile path')
@pytest.mark.parametrize('num_microbatches,fast_clipping',
                         [(None, True), (None, False), (4, True)])
def test_compile_path_and_make_private_give_the_same_noisy_update(
    num_microbatches, fast_clipping):
  x, y = _data()
  plain, private_base = _cnn(), _cnn()
  plain.compile(_sgd(num_microbatches=num_microbatches), _loss())
  private = tfdpx.keras.make_private(private_base,
                                     fast_clipping=fast_clipping)
  private.compile(_sgd(num_microbatches=num_microbatches), _loss())
  start = plain.get_weights()
  plain.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
  private.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
  for a, b, s in zip(plain.get_weights(), private.get_weights(), start):
    assert not np.allclose(a, s)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('privatizer, physical_batch_size', [
    ('gaussian', None), ('gaussian', 4), ('dpdr', None), ('gep', None),
    ('adaptive(gaussian)', None)])
def test_fit_traces_the_step_once(privatizer, physical_batch_size,
                                  monkeypatch):
  # A variable created in the first trace (the optimizer's, the privatizer
  # state, the noise key) makes tf.function trace the step a second time.
  # (Keras's own metrics, built in the first trace, do so for plain models
  # too: none are compiled here.)
  case = cases.case_named(privatizer)
  x, y = _data()
  model = tfdpx.keras.make_private(
      _cnn(), public_data=_data(4, seed=1) if case.needs_public else None,
      physical_batch_size=physical_batch_size)
  model.compile(_sgd(case.make(1.0, 1.0)), _loss())
  traces = []
  step = type(model).train_step
  monkeypatch.setattr(type(model), 'train_step',
                      lambda self, data: traces.append(1) or step(self, data))
  # Batches of 8 and 4 rows: one trace for both (batch dimension None).
  model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=2,
            verbose=0)
  assert len(traces) == 1


def test_make_private_shares_layers_and_weights():
  model = _cnn()
  private = tfdpx.keras.make_private(model)
  assert isinstance(private, tfdpx.keras.DPModel)
  assert all(a is b for a, b in zip(model.layers, private.layers[1:]))
  private.compile(_sgd(), _loss(), metrics=['accuracy'])
  x, y = _data()
  history = private.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert {'loss', 'accuracy'} <= set(history.history)
  for a, b in zip(model.get_weights(), private.get_weights()):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(model.predict(x, verbose=0),
                             private.predict(x, verbose=0))
  assert len(private.evaluate(x, y, verbose=0)) == 2


def _text(seed=0):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      tf.keras.Input((6,), dtype='int32'),
      L.Embedding(9, 4),
      L.GlobalAveragePooling1D(),
      L.Dense(3),
  ])


def _token_data(n=12, seed=0):
  # Few ids, so that examples repeat tokens and share them.
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 7, size=(n, 6)).astype('int32'),
          rng.integers(0, 3, size=(n,)))


# The Embedding's segment sums take another op under XLA (forms/embedding.py).
@pytest.mark.parametrize('make, data', [(_cnn, _data), (_text, _token_data)],
                         ids=['cnn', 'embedding'])
def test_jit_compile_trains_to_the_same_weights(make, data):
  x, y = data()
  runs = []
  for jit_compile in (False, True):
    model = tfdpx.keras.make_private(make())
    model.compile(_sgd(), _loss(), jit_compile=jit_compile)
    model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0)
    runs.append(model.get_weights())
  for a, b in zip(*runs):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert not np.allclose(runs[0][0], make().get_weights()[0])


def test_dp_sequential_and_subclassed_dp_model_train():
  x, y = _data()
  sequential = tfdpx.keras.DPSequential(
      [L.Conv2D(2, 3), L.Flatten(), L.Dense(3)], chunk_size=5)

  class Subclassed(tfdpx.keras.DPModel):

    def __init__(self):
      super().__init__(chunk_size=5)
      self.flatten, self.dense = L.Flatten(), L.Dense(3)

    def call(self, inputs, training=None):
      return self.dense(self.flatten(inputs))

  for model in (sequential, Subclassed()):
    model.compile(_sgd(), _loss())
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    assert model.optimizer.dp_steps.numpy() == 1


def _without_noise_step(model, x, y, **fit_kwargs):
  model.compile(
      tfdpx.keras.DPSGD(privatizer=gaussian(float('inf'), 0.0),
                        expected_batch_size=len(y), learning_rate=1.0),
      _loss())
  start = model.get_weights()
  model.fit(x, y, batch_size=len(y), epochs=1, shuffle=False, verbose=0,
            **fit_kwargs)
  return [s - w for s, w in zip(start, model.get_weights())]


def test_sample_weights_weight_each_example():
  x, y = _data()
  weights = np.linspace(0.0, 2.0, len(y)).astype('float32')
  step = _without_noise_step(tfdpx.keras.make_private(_cnn()), x, y,
                             sample_weight=weights)
  reference = _cnn()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(weights * _loss()(y, reference(x))) / len(y)
  expected = tape.gradient(loss, reference.trainable_variables)
  for got, want in zip(step, expected):
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-6)


def test_regularization_gradient_is_added_outside_the_clip():
  x, y = _data()
  regularizer = tf.keras.regularizers.L2(10.0)
  model = tfdpx.keras.make_private(_cnn(kernel_regularizer=regularizer))
  kernel = model.layers[-1].kernel.numpy()
  # A clip of 1e-9 silences the data; the large penalty's gradient survives.
  model.compile(
      tfdpx.keras.DPSGD(privatizer=gaussian(1e-9, 0.0), expected_batch_size=12,
                        learning_rate=0.01), _loss())
  model.fit(x, y, batch_size=12, epochs=1, verbose=0)
  np.testing.assert_allclose(model.layers[-1].kernel.numpy(),
                             kernel - 0.01 * 2 * 10.0 * kernel, rtol=1e-4,
                             atol=1e-7)


def test_batch_normalization_is_refused_with_a_clear_error():
  model = tf.keras.Sequential(
      [tf.keras.Input((4,)), L.Dense(3), L.BatchNormalization(), L.Dense(2)])
  with pytest.raises(ValueError, match='GroupNormalization or LayerNorm'):
    tfdpx.keras.make_private(model)
  model.layers[1].trainable = False  # Frozen: inference mode, allowed.
  tfdpx.keras.make_private(model)

  class WithBatchNorm(tfdpx.keras.DPModel):

    def __init__(self):
      super().__init__()
      self.norm, self.dense = L.BatchNormalization(), L.Dense(2)

    def call(self, inputs, training=None):
      return self.dense(self.norm(inputs, training=training))

  subclassed = WithBatchNorm()
  subclassed.compile(_sgd(), _loss())
  with pytest.raises(ValueError, match='mixes the examples'):
    subclassed.fit(np.ones((4, 4)), np.zeros(4), verbose=0)


def test_activity_regularizer_is_refused():
  model = tf.keras.Sequential([
      tf.keras.Input((4,)),
      L.Dense(2, activity_regularizer=tf.keras.regularizers.L2(1.0))])
  with pytest.raises(ValueError, match='activity_regularizer'):
    tfdpx.keras.make_private(model)


@pytest.mark.keras2_only('legacy optimizers')
def test_a_plain_optimizer_is_refused():
  model = tfdpx.keras.make_private(_cnn())
  model.compile(tf.keras.optimizers.legacy.SGD(), _loss())
  x, y = _data()
  with pytest.raises(ValueError, match='tfdpx optimizer'):
    model.fit(x, y, verbose=0)


@pytest.mark.keras2_only('the compile path')
def test_the_compile_path_warns_once_and_names_make_private(caplog):
  x, y = _data()
  model = _cnn()
  model.compile(_sgd(), _loss())
  with caplog.at_level(logging.WARNING, logger=optimizers.__name__):
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
  warnings = [r for r in caplog.records if 'make_private' in r.getMessage()]
  assert len(warnings) == 1
  caplog.clear()
  private = tfdpx.keras.make_private(_cnn())
  private.compile(_sgd(), _loss())
  with caplog.at_level(logging.WARNING, logger=optimizers.__name__):
    private.fit(x, y, batch_size=4, epochs=1, verbose=0)
  assert not [r for r in caplog.records if 'make_private' in r.getMessage()]


class _PublicSum(core.Privatizer):
  """Test double: releases the plain sum of the public per-example gradients."""

  name = 'test_public_sum'
  requires_public_grads = True

  @property
  def config(self):
    return {'noise_multiplier': 0.0}

  def update(self, per_example_grads, state, seed, *, public_grads=None):
    del per_example_grads, seed
    return [tf.reduce_sum(g, axis=0) for g in public_grads.materialized()], state

  def dp_event(self, step):
    return dp_accounting.NonPrivateDpEvent()


def test_public_data_reaches_the_privatizer_unclipped():
  x, y = _data()
  x_public, y_public = _data(n=7, seed=1)
  reference = _cnn()
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(_loss()(y_public, reference(x_public)))
  expected = tape.gradient(loss, reference.trainable_variables)

  model = tfdpx.keras.make_private(
      _cnn(), public_data=(x_public, y_public), public_chunk_size=3)
  model.compile(
      tfdpx.keras.DPSGD(privatizer=_PublicSum(), expected_batch_size=1.0,
                        learning_rate=1.0), _loss())
  start = model.get_weights()
  model.fit(x, y, batch_size=12, epochs=1, verbose=0)
  for s, w, want in zip(start, model.get_weights(), expected):
    np.testing.assert_allclose(s - w, want.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('refresh_steps', [1, 3])
def test_gep_runs_the_public_pass_on_refresh_steps_only(refresh_steps,
                                                         monkeypatch):
  """Eagerly, step by step: the anchors' forward and backward passes run on
  the steps that compute GEP's basis, not on those that keep it."""
  calls = []
  public_gradients = recorder.public_gradients

  def counted(*args, **kwargs):
    calls.append(1)
    return public_gradients(*args, **kwargs)

  monkeypatch.setattr(recorder, 'public_gradients', counted)
  model = tfdpx.keras.make_private(_cnn(), public_data=_data(n=7, seed=1))
  model.compile(
      tfdpx.keras.DPSGD(privatizer=tfdpx.privatizers.gep(
          4, 1.0, 0.5, 1.0, basis_refresh_steps=refresh_steps),
                        expected_batch_size=2, learning_rate=0.1),
      _loss(), run_eagerly=True)
  x, y = _data(n=14)
  model.fit(x, y, batch_size=2, epochs=1, verbose=0)  # Steps 0 to 6.
  assert len(calls) == {1: 7, 3: 3}[refresh_steps]


def test_a_privatizer_needing_public_data_fails_without_it():
  model = tfdpx.keras.make_private(_cnn())
  model.compile(
      tfdpx.keras.DPSGD(privatizer=_PublicSum(), expected_batch_size=1.0),
      _loss())
  x, y = _data()
  with pytest.raises(ValueError, match='public'):
    model.fit(x, y, verbose=0)


@pytest.mark.parametrize('kwargs, match', [
    ({'chunk_size': 0}, 'chunk_size'),
    ({'public_data': np.ones(3)}, 'public_data'),
    ({'public_chunk_size': 4}, 'public_chunk_size'),
])
def test_bad_engine_arguments_are_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tfdpx.keras.make_private(_cnn(), **kwargs)


@pytest.mark.parametrize('release', [True, False])
def test_training_metrics_are_released_only_if_asked(release):
  x, y = _data()
  private = tfdpx.keras.make_private(_cnn(), release_training_metrics=release)
  private.compile(_sgd(), _loss(), metrics=['accuracy'])
  privacy = tfdpx.keras.PrivacyCallback(sampling='poisson',
                                        sampling_probability=0.5, delta=1e-5)
  batch_logs_seen = []
  batch_logs = tf.keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs=None: batch_logs_seen.append(
          dict(logs)))
  start = private.get_weights()
  history = private.fit(x, y, batch_size=6, epochs=2, verbose=0,
                        validation_data=_data(n=6, seed=1),
                        callbacks=[privacy, batch_logs])
  assert private.optimizer.dp_steps.numpy() == 4
  assert not np.allclose(private.get_weights()[0], start[0])
  # Validation metrics (held-out data) and epsilon are always there.
  assert {'val_loss', 'val_accuracy', 'epsilon'} <= set(history.history)
  released = {'loss', 'accuracy'} & set(history.history)
  assert released == ({'loss', 'accuracy'} if release else set())
  assert batch_logs_seen
  for log in batch_logs_seen:  # Keras 3's fit needs one entry: the step count.
    assert ({'loss', 'accuracy'} <= set(log) if release else
            set(log) <= {'dp_steps'})
  assert private.get_config()['release_training_metrics'] == release
  sequential = tfdpx.keras.DPSequential([L.Dense(2)],
                                        release_training_metrics=release)
  rebuilt = tfdpx.keras.DPSequential.from_config(sequential.get_config())
  assert rebuilt.get_config()['release_training_metrics'] == release


# --- tensorflow-privacy's DP model arguments


def _dp_sequential(**kwargs):
  return tfdpx.keras.DPSequential(layers=_cnn().layers, **kwargs)


@pytest.mark.parametrize('base, dp_class, hyperparameters', [
    (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.5), tfdpx.keras.DPSGD,
     {'learning_rate': 0.1, 'momentum': 0.5}),
    (lambda: tf.keras.optimizers.Adam(0.01, beta_1=0.8), tfdpx.keras.DPAdam,
     {'learning_rate': 0.01, 'beta_1': 0.8}),
    pytest.param(lambda: tf.keras.optimizers.legacy.Adagrad(0.2),
                 tfdpx.keras.DPAdagrad, {'learning_rate': 0.2},
                 marks=pytest.mark.keras2_only('legacy optimizers')),
    (lambda: tf.keras.optimizers.Adagrad(0.2), tfdpx.keras.DPAdagrad,
     {'learning_rate': 0.2}),
    (lambda: 'sgd', tfdpx.keras.DPSGD, {'learning_rate': 0.01}),
])
def test_dp_arguments_compile_a_plain_optimizer_into_its_tfdpx_version(
    base, dp_class, hyperparameters):
  model = _dp_sequential(l2_norm_clip=0.5, noise_multiplier=1.0,
                         num_microbatches=4, expected_batch_size=12)
  model.compile(base(), _loss('sum_over_batch_size'))
  optimizer = model.optimizer
  assert type(optimizer) is dp_class  # pylint: disable=unidiomatic-typecheck
  assert optimizer.privatizer == gaussian(0.5, 1.0)
  config = optimizer.get_config()
  assert (config['num_microbatches'], config['expected_batch_size']) == (4, 12)
  for name, value in hyperparameters.items():
    assert config[name] == pytest.approx(value)


def test_dp_arguments_train_as_the_tfdpx_optimizer_with_them():
  # tensorflow-privacy's way (DP arguments on the model, a plain optimizer,
  # a loss reduced over the batch) and tfdpx's (a tfdpx optimizer, an
  # unreduced loss) give the same steps.
  x, y = _data()
  weights = np.linspace(0.1, 1.0, len(x)).astype('float32')
  tf_privacy_way = _dp_sequential(l2_norm_clip=0.5, noise_multiplier=0.0)
  tf_privacy_way.compile(tf.keras.optimizers.SGD(0.5),
                         _loss('sum_over_batch_size'))
  tfdpx_way = tfdpx.keras.make_private(_cnn())
  tfdpx_way.compile(tfdpx.keras.DPSGD(0.5, 0.0, learning_rate=0.5), _loss())
  start = tfdpx_way.get_weights()
  for model in (tf_privacy_way, tfdpx_way):
    model.fit(x, y, sample_weight=weights, batch_size=6, epochs=2,
              shuffle=False, verbose=0)
  for a, b, s in zip(tf_privacy_way.get_weights(), tfdpx_way.get_weights(),
                     start):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert not np.allclose(b, s)
  assert tf_privacy_way.optimizer.dp_steps.numpy() == 4


def test_a_model_with_dp_arguments_reloads(tmp_path):
  x, y = _data()
  model = _dp_sequential(l2_norm_clip=0.5, noise_multiplier=1.0,
                         expected_batch_size=6)
  model.compile(tf.keras.optimizers.SGD(0.1), _loss('sum_over_batch_size'))
  model.fit(x, y, batch_size=6, verbose=0)
  path = str(tmp_path / 'model.keras')
  model.save(path)
  loaded = tf.keras.models.load_model(path)
  assert isinstance(loaded.optimizer, tfdpx.keras.DPSGD)
  assert loaded.optimizer.get_config() == model.optimizer.get_config()
  assert loaded.optimizer.dp_steps.numpy() == 2
  assert loaded.get_config()['l2_norm_clip'] == 0.5


@pytest.mark.parametrize('build, compile_with, match', [
    (lambda: tfdpx.keras.DPSequential(1.0, 0.5, [L.Dense(2)]), None,
     'keyword-only'),
    (lambda: _dp_sequential(l2_norm_clip=1.0), None, 'noise_multiplier'),
    (lambda: _dp_sequential(num_microbatches=2), None, 'num_microbatches'),
    (lambda: _dp_sequential(l2_norm_clip=1.0, noise_multiplier=0.5,
                            num_microbatches=True), None, 'num_microbatches'),
    (lambda: _dp_sequential(l2_norm_clip=-1.0, noise_multiplier=0.5), None,
     'l2_norm_clip'),
    (lambda: _dp_sequential(l2_norm_clip=1.0, noise_multiplier=0.5),
     lambda: tf.keras.optimizers.RMSprop(), 'RMSprop'),
    (lambda: _dp_sequential(l2_norm_clip=1.0, noise_multiplier=0.5),
     lambda: tf.keras.optimizers.SGD(weight_decay=0.1), 'weight_decay'),
    (lambda: _dp_sequential(l2_norm_clip=1.0, noise_multiplier=0.5),
     lambda: tfdpx.keras.DPSGD(1.0, 2.0), 'DP arguments'),
])
def test_bad_dp_arguments_are_refused_by_name(build, compile_with, match):
  with pytest.raises(ValueError, match=match):
    model = build()
    model.compile(compile_with(), _loss('sum_over_batch_size'))
