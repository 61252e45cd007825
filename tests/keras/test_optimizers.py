"""tfdpx Keras optimizers through `model.compile` / `fit` (the Jacobian path)."""

import inspect
import re

import numpy as np
import pytest
import tensorflow as tf

# The Keras 2 optimizers over tensorflow-privacy's; their Keras 3 versions are
# tested in test_keras3.py.
pytest.importorskip('tensorflow_privacy', reason='Keras 2 only: the '
                    "optimizers over tensorflow-privacy's (Stack A)")
# pylint: disable=g-import-not-at-top,wrong-import-position
from tensorflow_privacy.privacy.analysis import compute_dp_sgd_privacy_lib
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized as tfp_vectorized

import tfdpx
from tests import stats
from tfdpx import gradients
from tfdpx import noise
from tfdpx.privatizers import gaussian

NONE = 'none'


def _data(n=32, features=5, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype('float32')
  y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype('int32')
  return x, y


def _mlp(seed=0, features=5):
  tf.keras.utils.set_random_seed(seed)
  return tf.keras.Sequential([
      tf.keras.layers.Dense(4, activation='tanh', input_shape=(features,)),
      tf.keras.layers.Dense(2),
  ])


def _loss(reduction=NONE):
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=reduction)


@pytest.mark.parametrize('jit_compile', [False, True])
@pytest.mark.parametrize('dp_class, base_class', [
    (tfdpx.keras.DPSGD, tf.keras.optimizers.legacy.SGD),
    (tfdpx.keras.DPAdam, tf.keras.optimizers.legacy.Adam),
    (tfdpx.keras.DPAdagrad, tf.keras.optimizers.legacy.Adagrad),
])
def test_no_noise_and_no_clip_gives_the_plain_optimizer(jit_compile, dp_class,
                                                         base_class):
  x, y = _data()
  private, plain = _mlp(), _mlp()
  private.compile(
      dp_class(privatizer=gaussian(1e9, 0.0), expected_batch_size=8,
               learning_rate=0.1), _loss(), jit_compile=jit_compile)
  plain.compile(base_class(learning_rate=0.1), _loss('sum_over_batch_size'))
  private.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
  for a, b in zip(private.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not np.allclose(private.get_weights()[0], _mlp().get_weights()[0])


class _MisScaledGaussian(tfdpx.privatizers.Gaussian):
  """Adds 3% more noise than its event claims: the check below must catch it."""

  def update(self, per_example_grads, state, seed, *, public_grads=None):
    grads = gradients.as_per_example_gradients(per_example_grads)
    zeros = [tf.zeros(s, d) for s, d in zip(grads.shapes, grads.dtypes)]
    return noise.add_gaussian(zeros, self.config['l2_norm_clip'],
                              1.03 * self.noise_multiplier, seed), state


class _ZeroLoss(tf.keras.losses.Loss):
  """A per-example loss whose gradient is exactly zero."""

  def call(self, y_true, y_pred):
    return tf.reduce_sum(0.0 * y_pred, axis=-1)


def _pure_noise_update(privatizer, steps, batch, lr, private=False):
  """Weight change of `steps` SGD steps whose per-example gradients are zero.

  `private=True` trains the model made private (DP-SGD: fast clipping).
  """
  tf.keras.utils.set_random_seed(1)
  model = tf.keras.Sequential([tf.keras.layers.Dense(1000, input_shape=(100,))])
  if private:
    model = tfdpx.keras.make_private(model)
  zero_loss = _ZeroLoss(reduction=NONE)
  model.compile(tfdpx.keras.DPSGD(privatizer=privatizer,
                                  expected_batch_size=batch, learning_rate=lr,
                                  noise_seed=7), zero_loss)
  before = np.concatenate([w.ravel() for w in model.get_weights()])
  x = np.ones((steps * batch, 100), 'float32')
  model.fit(x, np.zeros(steps * batch), batch_size=batch, epochs=1, verbose=0)
  after = np.concatenate([w.ravel() for w in model.get_weights()])
  return after - before


@pytest.mark.parametrize('private', [False, True],
                         ids=['compile_path', 'make_private'])
def test_zero_gradients_give_noise_of_the_claimed_std(private):
  lr, z, c, batch, steps = 0.1, 1.3, 0.8, 8, 1
  expected = np.sqrt(steps) * lr * z * c / batch
  delta = _pure_noise_update(gaussian(c, z), steps, batch, lr, private)
  assert stats.relative_tolerance(delta.size) < 0.012
  assert stats.std_matches(delta, expected)
  # Two-sided: a step that claims 3% less or more noise is rejected.
  assert not stats.std_matches(delta, expected * 1.03)
  assert not stats.std_matches(delta, expected / 1.03)


def test_noise_of_a_wrong_scale_is_detected():
  lr, z, c, batch, steps = 0.1, 1.3, 0.8, 8, 1
  expected = np.sqrt(steps) * lr * z * c / batch
  delta = _pure_noise_update(_MisScaledGaussian(c, z), steps, batch, lr)
  assert not stats.std_matches(delta, expected)


def test_checkpoint_restores_optimizer_and_privatizer_state(tmp_path):
  x, y = _data(n=64)

  def make():
    model = _mlp()
    # No noise, clipping active: the resumed run must then equal the
    # uninterrupted one exactly (Adam's slots, iterations and the ledger are
    # restored; the noise of a resumed run is fresh by design).
    optimizer = tfdpx.keras.DPAdam(l2_norm_clip=0.5, noise_multiplier=0.0,
                                   expected_batch_size=16, learning_rate=0.05)
    model.compile(optimizer, _loss())
    return model, optimizer

  model, optimizer = make()
  model.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)
  path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
      str(tmp_path / 'ckpt'))
  model.fit(x[32:], y[32:], batch_size=16, shuffle=False, verbose=0)
  uninterrupted = model.get_weights()

  resumed, resumed_optimizer = make()
  tf.train.Checkpoint(model=resumed, optimizer=resumed_optimizer).restore(
      path).expect_partial()
  resumed.fit(x[32:], y[32:], batch_size=16, shuffle=False, verbose=0)
  assert int(resumed_optimizer.dp_steps.numpy()) == 4
  for a, b in zip(uninterrupted, resumed.get_weights()):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('noise_seed', [None, 7])
def test_a_rollback_never_draws_the_same_noise_twice(tmp_path, noise_seed):
  # Restore a checkpoint and take the same step again: if the noise repeated,
  # the difference of the two releases would be the difference of the data,
  # noise-free. With zero per-example gradients each update is pure noise:
  # the two must be independent draws, so their difference has sqrt(2) times
  # the std of one (two-sided), and is never zero.
  lr, z, c, batch = 0.1, 1.3, 0.8, 8
  tf.keras.utils.set_random_seed(1)
  model = tf.keras.Sequential([tf.keras.layers.Dense(1000, input_shape=(100,))])
  optimizer = tfdpx.keras.DPSGD(privatizer=gaussian(c, z),
                                expected_batch_size=batch, learning_rate=lr,
                                noise_seed=noise_seed)
  model.compile(optimizer, _ZeroLoss(reduction=NONE))
  x, y = np.ones((batch, 100), 'float32'), np.zeros(batch)
  model.fit(x, y, batch_size=batch, verbose=0)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
  path = checkpoint.save(str(tmp_path / 'ckpt'))
  before = np.concatenate([w.ravel() for w in model.get_weights()])
  releases = []
  for _ in range(2):
    checkpoint.restore(path)
    assert int(optimizer.dp_steps.numpy()) == 1
    model.fit(x, y, batch_size=batch, verbose=0)
    releases.append(
        np.concatenate([w.ravel() for w in model.get_weights()]) - before)
  assert int(optimizer.dp_steps.numpy()) == 2
  expected = lr * z * c / batch
  assert stats.std_matches(releases[0], expected)
  assert stats.std_matches(releases[1] - releases[0], np.sqrt(2) * expected)


def test_config_round_trips_with_the_privacy_arguments():
  optimizer = tfdpx.keras.DPAdam(
      privatizer=gaussian(0.7, 1.2), expected_batch_size=64, noise_seed=3,
      learning_rate=0.01, beta_1=0.8)
  rebuilt = tfdpx.keras.DPAdam.from_config(optimizer.get_config())
  assert rebuilt.privatizer == optimizer.privatizer
  assert rebuilt.get_config() == optimizer.get_config()
  assert rebuilt.denominator == 64
  deserialized = tf.keras.optimizers.deserialize(
      tf.keras.optimizers.serialize(optimizer), use_legacy_optimizer=True)
  assert isinstance(deserialized, tfdpx.keras.DPAdam)
  assert deserialized.get_config() == optimizer.get_config()


def test_secret_seed_stays_out_of_the_config_and_checkpoints(tmp_path):
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                expected_batch_size=8)
  assert optimizer.get_config()['noise_seed'] is None
  assert not optimizer.noise_seed_is_known
  model = _mlp()
  model.compile(optimizer, _loss())
  x, y = _data(n=8)
  model.fit(x, y, batch_size=8, verbose=0)
  secret = int(optimizer._noise_key.secret.numpy())  # pylint: disable=protected-access
  path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
      str(tmp_path / 'ckpt'))
  reader = tf.train.load_checkpoint(path)
  for name, _ in tf.train.list_variables(path):
    value = np.asarray(reader.get_tensor(name))
    assert not (value.dtype == np.int64 and np.any(value == secret)), name
  assert all(not any(v is k for k in (optimizer._noise_key.secret,
                                       optimizer._noise_key.counter))  # pylint: disable=protected-access
             for v in optimizer.weights)


def test_is_a_tensorflow_privacy_optimizer():
  args = dict(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=8)
  assert isinstance(tfdpx.keras.DPSGD(**args),
                    tfp_vectorized.VectorizedDPKerasSGDOptimizer)
  assert isinstance(tfdpx.keras.DPAdam(**args),
                    tfp_vectorized.VectorizedDPKerasAdamOptimizer)
  assert isinstance(tfdpx.keras.DPAdagrad(**args),
                    tfp_vectorized.VectorizedDPKerasAdagradOptimizer)


@pytest.mark.parametrize('kwargs, match', [
    ({'clipnorm': 1.0}, 'clipnorm'),
    ({'clipvalue': 1.0}, 'clipvalue'),
    ({'global_clipnorm': 1.0}, 'global_clipnorm'),
    ({'l2_norm_clip': 1.0, 'expected_batch_size': 8}, 'noise_multiplier'),
    ({'privatizer': gaussian(1, 1), 'l2_norm_clip': 1.0,
      'expected_batch_size': 8}, 'l2_norm_clip'),
    ({'l2_norm_clip': -1.0, 'noise_multiplier': 1.0,
      'expected_batch_size': 8}, 'l2_norm_clip'),
    ({'l2_norm_clip': 1.0, 'noise_multiplier': 1.0,
      'expected_batch_size': 0}, 'expected_batch_size'),
    ({'l2_norm_clip': 1.0, 'noise_multiplier': 1.0, 'num_microbatches': 0},
     'num_microbatches'),
    ({'l2_norm_clip': 1.0, 'noise_multiplier': 1.0, 'num_microbatches': True},
     'num_microbatches'),
    ({'l2_norm_clip': 1.0, 'noise_multiplier': 1.0,
      'unconnected_gradients_to_zero': 0.15}, 'unconnected_gradients_to_zero'),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tfdpx.keras.DPSGD(**kwargs)


def test_scalar_loss_gets_an_error_that_says_how_to_fix_it():
  x, y = _data()
  model = _mlp()
  model.compile(tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                  expected_batch_size=8),
                _loss('sum_over_batch_size'))
  with pytest.raises(ValueError, match='reduction=tf.keras.losses.Reduction.NONE'):
    model.fit(x, y, batch_size=8, verbose=0)


def test_microbatches_double_the_sensitivity_in_the_event():
  per_record = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=2.0,
                                 num_microbatches=8, expected_batch_size=8)
  microbatched = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=2.0,
                                   num_microbatches=4, expected_batch_size=8)
  assert per_record.dp_event(0).noise_multiplier == 2.0
  assert microbatched.dp_event(0).noise_multiplier == 1.0
  assert microbatched.denominator == 4


def test_microbatched_fit_matches_the_mean_of_microbatch_means():
  x, y = _data(n=8)
  private, plain = _mlp(), _mlp()
  private.compile(tfdpx.keras.DPSGD(privatizer=gaussian(1e9, 0.0),
                                    num_microbatches=4, learning_rate=0.1),
                  _loss())
  plain.compile(tf.keras.optimizers.legacy.SGD(0.1),
                _loss('sum_over_batch_size'))
  private.fit(x, y, batch_size=8, epochs=1, verbose=0)
  plain.fit(x, y, batch_size=8, epochs=1, verbose=0)
  for a, b in zip(private.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_privacy_callback_logs_the_epsilon_of_the_steps_taken():
  x, y = _data(n=32)
  model = _mlp()
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                expected_batch_size=8, learning_rate=0.1)
  model.compile(optimizer, _loss())
  callback = tfdpx.keras.PrivacyCallback(
      sampling='poisson', sampling_probability=8 / 32, delta=1e-5)
  history = model.fit(x, y, batch_size=8, epochs=2, verbose=0,
                      callbacks=[callback])
  for epoch, logged in enumerate(history.history['epsilon']):
    expected = tfdpx.accounting.epsilon(
        gaussian(1.0, 1.1), steps=4 * (epoch + 1), sampling_probability=0.25,
        delta=1e-5)
    assert logged == pytest.approx(expected, rel=1e-12)
  assert history.history['epsilon'][1] > history.history['epsilon'][0]


def test_a_step_without_data_does_not_count():
  """Keras runs one more step at the end of a dataset of unknown length."""
  x, y = _data(n=24)
  model = _mlp()
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                                expected_batch_size=8)
  model.compile(optimizer, _loss())
  unknown_length = tf.data.Dataset.from_generator(
      lambda: ((x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)),
      output_signature=(tf.TensorSpec((8, 5), tf.float32),
                        tf.TensorSpec((8,), tf.int32)))
  model.fit(unknown_length, epochs=2, verbose=0)
  assert int(optimizer.dp_steps.numpy()) == 6


@pytest.mark.parametrize('filename', ['model.keras', 'model.h5'])
def test_model_saved_with_its_optimizer_reloads(tmp_path, filename):
  x, y = _data()
  model = _mlp()
  privatizer = tfdpx.privatizers.dpdr(0.5, 1.0, decomposition_steps=3)
  model.compile(tfdpx.keras.DPSGD(privatizer=privatizer, expected_batch_size=8,
                                  learning_rate=0.1, noise_seed=3), _loss())
  model.fit(x, y, batch_size=8, verbose=0)
  path = str(tmp_path / filename)
  model.save(path)
  loaded = tf.keras.models.load_model(path)
  assert isinstance(loaded.optimizer, tfdpx.keras.DPSGD)
  assert loaded.optimizer.privatizer == privatizer
  assert loaded.optimizer.get_config() == model.optimizer.get_config()
  np.testing.assert_allclose(loaded.predict(x, verbose=0),
                             model.predict(x, verbose=0), rtol=1e-6)


# --- tensorflow-privacy's arguments (a drop-in for its vectorized optimizers)


def test_takes_tensorflow_privacys_positional_arguments():
  ours = list(inspect.signature(tfdpx.keras.DPSGD.__init__).parameters)
  theirs = list(inspect.signature(
      tfp_vectorized.VectorizedDPKerasSGDOptimizer.__init__).parameters)
  assert ours[:6] == theirs[:6]  # self, the four DP arguments, *args.
  positional = tfdpx.keras.DPSGD(1.0, 1.1, 8, True, 0.15, 0.9)
  keyword = tfdpx.keras.DPSGD(
      l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=8,
      unconnected_gradients_to_zero=True, learning_rate=0.15, momentum=0.9)
  assert positional.get_config() == keyword.get_config()
  assert positional.privatizer == gaussian(1.0, 1.1)
  with pytest.raises(ValueError, match=r'privatizer is keyword-only'):
    tfdpx.keras.DPSGD(gaussian(1.0, 1.1), expected_batch_size=8)


class WithUnusedLayer(tf.keras.Model):
  """A model with a trainable layer that the loss does not depend on."""

  def __init__(self):
    super().__init__()
    self.used = tf.keras.layers.Dense(2)
    self.unused = tf.keras.layers.Dense(2)
    self.unused.build((None, 5))  # Variables 'kernel:0' and 'bias:0'.

  def call(self, inputs):
    return self.used(inputs)


@pytest.mark.parametrize('to_zero', [False, True])
def test_unconnected_gradients_to_zero_both_ways(to_zero):
  x, y = _data(n=8)
  tf.keras.utils.set_random_seed(0)
  model = WithUnusedLayer()
  model(x[:1])  # Builds the used layer.
  model.compile(tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=0.0,
                                  unconnected_gradients_to_zero=to_zero,
                                  learning_rate=0.5), _loss())
  unused = [w.numpy() for w in model.unused.weights]
  if not to_zero:  # tensorflow-privacy's default and error.
    with pytest.raises(ValueError, match=r'None values not supported.*'
                       r"'kernel:0', 'bias:0'.*"
                       r'unconnected_gradients_to_zero=True'):
      model.fit(x, y, batch_size=8, verbose=0)
    return
  used = [w.numpy() for w in model.used.weights]
  model.fit(x, y, batch_size=8, verbose=0)
  for before, after in zip(unused, model.unused.weights):
    np.testing.assert_array_equal(before, after.numpy())
  assert not np.allclose(used[0], model.used.weights[0].numpy())


def test_without_a_public_denominator_the_first_batch_size_divides():
  # Neither num_microbatches nor expected_batch_size, as tensorflow-privacy
  # allows: the size of the first batch divides every step. A smaller last
  # batch divided by its own size would reveal the number of examples.
  x, y = _data(n=24)
  private, plain = _mlp(), _mlp()
  optimizer = tfdpx.keras.DPSGD(1e9, 0.0, learning_rate=0.1)
  assert optimizer.denominator is None
  private.compile(optimizer, _loss())
  plain.compile(tf.keras.optimizers.legacy.SGD(0.1),
                _loss('sum_over_batch_size'))
  for model in (private, plain):
    model.fit(x[:16], y[:16], batch_size=16, verbose=0)
  for a, b in zip(private.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  before = plain.get_weights()
  for model in (private, plain):
    model.fit(x[16:], y[16:], batch_size=8, verbose=0)
  for start, a, b in zip(before, private.get_weights(), plain.get_weights()):
    np.testing.assert_allclose(a - start, (b - start) / 2, rtol=1e-4,
                               atol=1e-7)


def test_without_a_public_denominator_no_poisson_epsilon_is_claimed():
  optimizer = tfdpx.keras.DPSGD(1.0, 1.1)
  with pytest.raises(ValueError, match='expected_batch_size=<expected batch'):
    tfdpx.accounting.epsilon(optimizer, steps=10, sampling_probability=0.01,
                             delta=1e-5)
  statement = tfdpx.accounting.privacy_statement(
      optimizer, sampling='shuffle', steps=10, num_examples=1000,
      expected_batch_size=10, delta=1e-5)
  assert 'denominator: the size of the first batch' in statement
  assert 'assuming Poisson sampling' not in statement


def _tensorflow_privacy_epsilons(n, batch, epochs, noise_multiplier, delta,
                                 used_microbatching):
  """Its statement's two figures: once per epoch, and Poisson sampling."""
  text = compute_dp_sgd_privacy_lib.compute_dp_sgd_privacy_statement(
      n, batch, epochs, noise_multiplier, delta,
      used_microbatching=used_microbatching)
  return [float(e) for e in re.findall(r'Epsilon .*:\s+([\d.]+)', text)]


@pytest.mark.parametrize('num_microbatches, used_microbatching',
                         [(8, False), (4, True)])
def test_epsilon_agrees_with_tensorflow_privacys_statement(
    num_microbatches, used_microbatching):
  # tensorflow-privacy's tutorial sets num_microbatches to the batch size:
  # each record is one example, and its statement then counts no
  # microbatching. Half as many microbatches hold two examples each.
  n, batch, epochs, z, delta = 60000, 8, 3, 1.1, 1e-5
  x, y = _data(n=batch)
  model = _mlp()
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=z,
                                num_microbatches=num_microbatches,
                                learning_rate=0.1)
  model.compile(optimizer, _loss())
  model.fit(x, y, batch_size=batch, verbose=0)
  assert optimizer.examples_per_record == batch // num_microbatches
  once, poisson = _tensorflow_privacy_epsilons(n, batch, epochs, z, delta,
                                               used_microbatching)
  steps = epochs * n // batch
  assert tfdpx.accounting.epsilon_once_per_epoch(
      optimizer, steps=steps, steps_per_epoch=n // batch,
      delta=delta) == pytest.approx(once, abs=1e-3)
  if not used_microbatching:  # Poisson: refused for microbatches.
    assert tfdpx.accounting.epsilon(
        optimizer, steps=steps, sampling_probability=batch / n,
        delta=delta) == pytest.approx(poisson, abs=1e-3)


def test_records_of_several_examples_are_accounted_even_if_declared_single(
    tmp_path):
  x, y = _data(n=8)
  model = _mlp()
  # Declared one example per record, but fed batches of 8 for 4 records.
  optimizer = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                                num_microbatches=4, expected_batch_size=4,
                                learning_rate=0.1)
  assert not optimizer.records_are_microbatches  # Before any step.
  model.compile(optimizer, _loss())
  model.fit(x, y, batch_size=8, verbose=0)
  assert optimizer.examples_per_record == 2
  assert optimizer.records_are_microbatches
  assert optimizer.dp_event(0).noise_multiplier == pytest.approx(0.55)
  # A checkpoint keeps what was seen, also before the next step.
  path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / 'c'))
  restored = tfdpx.keras.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.1,
                               num_microbatches=4, expected_batch_size=4)
  tf.train.Checkpoint(optimizer=restored).restore(path)
  assert restored.examples_per_record == 2


def test_get_updates_privatizes_in_graph_mode():
  """tensorflow-privacy's TF1 path: fresh noise of the claimed std each step.

  The key of the noise must be in no graph (Estimator saves the graph) and in
  no checkpoint (a saver saves the global variables).
  """
  lr, z, c, batch = 0.1, 1.3, 0.8, 8
  with tf.Graph().as_default() as graph:
    x = tf.compat.v1.placeholder(tf.float32, [batch, 100])
    layer = tf.keras.layers.Dense(1000)
    loss = tf.reduce_sum(0.0 * layer(x), axis=1)  # Zero per-example grads.
    optimizer = tfdpx.keras.DPSGD(c, z, None, learning_rate=lr)
    train = optimizer.get_updates(loss, layer.trainable_weights)
    with tf.compat.v1.Session() as session:
      session.run([tf.compat.v1.global_variables_initializer(),
                   tf.compat.v1.local_variables_initializer()])
      releases = []
      for _ in range(2):
        before = session.run(layer.kernel)
        session.run(train, {x: np.ones((batch, 100), 'float32')})
        releases.append(session.run(layer.kernel) - before)
      assert session.run(optimizer.dp_steps) == 2
      # pylint: disable-next=protected-access
      secret = session.run(optimizer._noise_key.secret)
    saved = {v.name for v in tf.compat.v1.global_variables()}
  assert not any('noise' in name for name in saved), saved
  constants = [tf.make_ndarray(node.attr['value'].tensor)
               for node in graph.as_graph_def().node if node.op == 'Const']
  assert not any(np.any(value == secret) for value in constants
                 if value.dtype == np.int64)
  expected = lr * z * c / batch  # The realized batch size divides.
  assert stats.std_matches(releases[0], expected)
  assert stats.std_matches(releases[1] - releases[0], np.sqrt(2) * expected)
