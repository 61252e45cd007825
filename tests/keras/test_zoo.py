"""The zoo (`zoo.py`): users' models train through `make_private`, their
per-example statistics equal single-example tapes, and the report names
exactly the layers without a rule."""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests.keras import zoo
from tfdpx.keras import recorder

NAMES = sorted(zoo.ZOO)
DETERMINISTIC = [n for n in NAMES if not zoo.ZOO[n].random]


def _problem(name, dropout):
  tf.keras.utils.set_random_seed(1)
  case = zoo.ZOO[name]
  model = case.build(dropout)
  x = case.inputs(np.random.default_rng(0))
  return case, model, x


def _targets(outputs):
  rng = np.random.default_rng(2)
  return [rng.normal(size=t.shape).astype('float32')
          for t in tf.nest.flatten(outputs)]


def _squared_error(targets, outputs):
  return tf.add_n([
      tf.reduce_sum(tf.reshape(tf.square(tf.cast(o, tf.float32) - t),
                               [tf.shape(o)[0], -1]), axis=1)
      for t, o in zip(targets, tf.nest.flatten(outputs))])


def _rows(x, i):
  return tf.nest.map_structure(lambda t: t[i:i + 1], x)


def _relative_error(got, want, floor):
  """|got - want| / |want|; below `floor`, relative to `floor`: a gradient
  that is zero in exact arithmetic (attention's key bias: the softmax does
  not see it) is rounding noise in both."""
  return np.linalg.norm(got - want) / max(np.linalg.norm(want), floor)


@pytest.mark.parametrize('name', NAMES)
def test_the_report_names_exactly_the_layers_without_a_rule(name):
  case, model, x = _problem(name, 0.1)
  report = tfdpx.keras.describe(model, x)
  assert {row.kind for row in report.rows if row.fallback} == case.fallback
  assert report.parameters == sum(
      int(np.prod(v.shape)) for v in model.trainable_variables)
  assert (report.fallback_parameters > 0) == bool(case.fallback)
  if case.fallback:
    assert all(row.reason for row in report.rows if row.fallback)
    assert report.warning() is not None


@pytest.mark.parametrize('name', DETERMINISTIC)
def test_statistics_equal_single_example_tapes(name):
  _, model, x = _problem(name, 0.0)
  targets = _targets(model(x))
  variables = model.trainable_variables
  expected = []
  for i in range(zoo.BATCH):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_squared_error([t[i:i + 1] for t in targets],
                                          model(_rows(x, i), training=True)))
    expected.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(
        loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)])
  expected = [np.stack(column) for column in zip(*expected)]
  weights = np.random.default_rng(3).normal(size=zoo.BATCH).astype('float32')
  spec = tf.nest.map_structure(
      lambda t: tf.TensorSpec([None, *np.shape(t)[1:]],
                              tf.convert_to_tensor(t).dtype), x)

  @tf.function(input_signature=[spec])  # The batch size unknown, as in fit.
  def statistics(x):
    grads = recorder.model_gradients(
        model, x, lambda outputs: _squared_error(targets, outputs), variables,
        chunk_size=2).grads
    return grads.sq_norms(), grads.weighted_sum(tf.constant(weights))

  sq_norms, sums = statistics(x)
  want_norms = [np.sum(g.reshape(zoo.BATCH, -1).astype('float64')**2, axis=1)
                for g in expected]
  want_sums = [np.tensordot(weights.astype('float64'), g, 1)
               for g in expected]
  for got, want in ((sq_norms, want_norms), (sums, want_sums)):
    floor = 1e-3 * np.sqrt(sum(np.sum(w**2) for w in want))
    for v, g, w in zip(variables, got, want):
      assert _relative_error(g.numpy(), w, floor) <= 1e-5, v.name


def _compiled(name, model):
  privatizer = tfdpx.privatizers.gaussian(1.0, 0.5)
  if name == 'mnist_convnet':  # keras.io: one-hot labels, a loss by name.
    optimizer = tfdpx.keras.DPAdam(privatizer=privatizer,
                                   expected_batch_size=5)
    model.compile(optimizer, 'categorical_crossentropy')
    return
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer, expected_batch_size=5,
                                learning_rate=0.1)
  mse = tf.keras.losses.MeanSquaredError(reduction='none')
  if name == 'two_outputs':
    model.compile(optimizer, loss={
        'score': mse, 'label': tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction='none')},
                  loss_weights={'score': 0.5, 'label': 1.0})
  else:
    model.compile(optimizer, loss=mse)


def _labels(name, model, x):
  rng = np.random.default_rng(4)
  if name == 'mnist_convnet':
    return tf.one_hot(rng.integers(0, 3, size=7), 3).numpy()
  if name == 'two_outputs':
    return {'score': rng.normal(size=(7, 1)).astype('float32'),
            'label': rng.integers(0, 3, size=(7,))}
  return rng.normal(size=model(x).shape[1:]).astype('float32')[None].repeat(
      7, axis=0)


@pytest.mark.parametrize('name', NAMES)
def test_trains_from_a_dataset_with_a_partial_last_batch(name):
  case, model, _ = _problem(name, 0.1)
  rng = np.random.default_rng(0)
  x = tf.nest.map_structure(lambda *t: np.concatenate(t)[:7],
                            case.inputs(rng), case.inputs(rng))
  y = _labels(name, model, _rows(x, 0))
  private = tfdpx.keras.make_private(model)
  _compiled(name, private)
  before = [v.numpy().copy() for v in model.trainable_variables]
  # Batches of 5 and 2 (batch dimension None when traced), sample weights.
  data = tf.data.Dataset.from_tensor_slices(
      (x, y, np.linspace(0.5, 1.5, 7).astype('float32'))).batch(5)
  history = private.fit(data, epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history['loss']))
  after = model.trainable_variables
  assert all(np.all(np.isfinite(v.numpy())) for v in after)
  assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, after))


@pytest.mark.parametrize('name', ['mlp_block', 'subclassed_model'])
def test_make_private_warns_once_naming_the_fallback_layers(name, caplog):
  case, model, _ = _problem(name, 0.1)
  with caplog.at_level('WARNING', logger='tfdpx.keras.report'):
    private = tfdpx.keras.make_private(model)
    _compiled(name, private)
    x = case.inputs(np.random.default_rng(0))
    y = np.zeros((zoo.BATCH, *model(x).shape[1:]), 'float32')
    private.fit(x, y, batch_size=zoo.BATCH, epochs=2, verbose=0)
  lines = [r.getMessage() for r in caplog.records
           if 'take the slower fallback path' in r.getMessage()]
  if case.fallback:
    assert len(lines) == 1
    assert re.search(r"'linear(_\d+)?' \(Linear\) computes with trainable "
                     'weights it owns directly', lines[0])
  else:
    assert not lines
