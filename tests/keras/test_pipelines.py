"""The user's input pipelines: the same forms and the same training for a
static and an unknown batch size, and strided convolutions on every CPU.

`fit` traces `tf.data ... .batch(B)` and numpy input (Keras's array adapter)
with batch dimension None, `drop_remainder=True` and Poisson batches with a
static one. A form chosen from the static batch size alone would be another,
slower form for the user's pipeline (the MLP's DP-SGD step took 14 ms
against 2.5 ms: every Dense layer formed its per-example kernels).
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests.keras import traced_steps
from tests import stats
from tests.privatizers import cases
from tfdpx import per_example
from tfdpx.forms import dense as dense_forms
from tfdpx.forms import materialized as materialized_forms
from tfdpx.keras import recorder

L = tf.keras.layers


@pytest.fixture
def formed(monkeypatch):
  """The per-example gradients formed while tracing, one entry a formation:
  the first variable of a Dense or convolution unit forming a chunk's (or the
  batch's) kernels, or of a materialized unit forming its gradients."""
  variables = []
  kernel_of = dense_forms.ProductUnit._kernel_of  # pylint: disable=protected-access

  def counted_kernels(unit, chunk, rows=None):
    variables.append(unit.variables[0])
    return kernel_of(unit, chunk, rows)

  init = materialized_forms.MaterializedUnit.__init__

  def counted_init(unit, unit_variables, grads_of, *args, **kwargs):
    def counted(chunk):
      variables.append(unit_variables[0])
      return grads_of(chunk)
    init(unit, unit_variables, counted, *args, **kwargs)

  monkeypatch.setattr(dense_forms.ProductUnit, '_kernel_of', counted_kernels)
  monkeypatch.setattr(materialized_forms.MaterializedUnit, '__init__',
                      counted_init)
  return variables


def _formed_in_trace(formed, model, model_name, batch):
  """Indices of `model`'s variables whose per-example kernels are formed in
  a trace of its step on batches of `batch` rows (None: unknown)."""
  formed.clear()
  traced_steps.train_step_graph(
      model, traced_steps.batch_spec(model_name, batch))
  index = {per_example.variable_key(v): i
           for i, v in enumerate(model.trainable_variables)}
  return sorted(index[per_example.variable_key(v)] for v in formed)


def _formed_in_both(formed, model_name, privatizer, batch):
  """`_formed_in_trace` of one built model, with `batch` static and unknown
  (the build's own step traced another static batch before either)."""
  model = traced_steps.built(
      traced_steps.private_model(model_name, privatizer, batch), model_name)
  return (_formed_in_trace(formed, model, model_name, batch),
          _formed_in_trace(formed, model, model_name, None))


def _cases():
  """Every noise step on the MLP, CNN and text model; below the chunk size
  (128), the wrappers' own statistics and the steps that ask for DP-SGD's
  statistics alone (`NORMS_ONLY`) but on the CNN in `make test-all`."""
  slow = pytest.mark.slow
  for privatizer in traced_steps.PRIVATIZERS:
    wrapper = privatizer.startswith(('adaptive', 'per_layer'))
    for model_name, batch in (('mlp', 256), ('cnn', 256), ('text', 256),
                              ('cnn', 64)):
      marks = [slow] if wrapper or (batch < 128 and privatizer not in (
          'gaussian', 'dpdr')) or (privatizer in traced_steps.NORMS_ONLY and
                                   model_name != 'cnn') else []
      yield pytest.param(model_name, batch, privatizer, marks=marks)


@pytest.mark.parametrize('model_name,batch,privatizer', _cases())
def test_the_same_per_example_kernels_are_formed_for_an_unknown_batch_size(
    formed, model_name, batch, privatizer):
  static, unknown = _formed_in_both(formed, model_name, privatizer, batch)
  assert unknown == static


def test_the_count_sees_a_form_chosen_from_the_static_batch_size(
    formed, monkeypatch):
  # The test above can fail: a unit that forms its kernels only when the
  # batch size is unknown is counted (as the Dense rule did before).
  ghost = dense_forms.ProductUnit._ghost  # pylint: disable=protected-access
  monkeypatch.setattr(
      dense_forms.ProductUnit, '_ghost',
      lambda unit: ghost(unit) and unit._d.shape[0] is not None)  # pylint: disable=protected-access
  static, unknown = _formed_in_both(formed, 'cnn', 'gaussian', 256)
  assert len(unknown) > len(static)


# --- strided convolutions -----------------------------------------------------

# TensorFlow's own depthwise convolution (CPU without oneDNN, GPU) refuses
# unequal strides; a Conv1D's patches are a 2-D convolution of height 1.
STRIDED = {
    'conv1d': (lambda: tf.keras.Sequential([
        tf.keras.Input((12, 2)), L.Conv1D(4, 5, strides=2, activation='relu'),
        L.Flatten(), L.Dense(3)]), (12, 2)),
    'conv2d': (lambda: tf.keras.Sequential([
        tf.keras.Input((8, 6, 2)),
        L.Conv2D(4, 3, strides=(2, 1), padding='same', activation='relu'),
        L.Flatten(), L.Dense(3)]), (8, 6, 2)),
}
NOISE_STEPS = ('gaussian', 'dpdr', 'sparsified(gaussian)', 'd2p2_srht_mode_o',
               'gep', 'geodp_sound')


@pytest.mark.parametrize('privatizer', NOISE_STEPS)
@pytest.mark.parametrize('name', sorted(STRIDED))
def test_strided_convolutions_train_from_a_dataset_of_unknown_batch_size(
    name, privatizer):
  build, shape = STRIDED[name]
  tf.keras.utils.set_random_seed(0)
  case = cases.case_named(privatizer)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(10, *shape)).astype('float32')
  y = rng.integers(0, 3, size=10)
  public = (x[:4], y[:4]) if case.needs_public else None
  model = tfdpx.keras.make_private(build(), public_data=public)
  model.compile(
      tfdpx.keras.DPSGD(privatizer=case.make(1.0, 1.0), expected_batch_size=4,
                        learning_rate=0.1),
      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                    reduction='none'))
  before = [v.numpy() for v in model.trainable_variables]
  # Batches of 4, 4 and 2 rows, traced with batch dimension None.
  history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4),
                      epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history['loss']))
  assert model.optimizer.dp_steps.numpy() == 6
  # Some: GeoDP's noisy sines put its release on the first coordinates.
  assert any(np.any(b != v.numpy())
             for b, v in zip(before, model.trainable_variables))


@pytest.mark.parametrize('name', sorted(STRIDED))
def test_strided_convolution_statistics_equal_single_example_tapes(name):
  build, shape = STRIDED[name]
  tf.keras.utils.set_random_seed(1)
  model = build()
  rng = np.random.default_rng(1)
  x = rng.normal(size=(6, *shape)).astype('float32')
  y = rng.integers(0, 3, size=6)
  loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction='none')
  weights = rng.normal(size=6).astype('float32')

  @tf.function(input_signature=[tf.TensorSpec([None, *shape])])
  def statistics(x):  # As `fit` traces a `.batch(B)` dataset.
    grads = recorder.model_gradients(
        model, x, lambda outputs: loss(y, outputs),
        model.trainable_variables, chunk_size=4).grads
    return (grads.sq_norms(), grads.weighted_sum(tf.constant(weights)),
            grads.materialized())

  sq_norms, weighted_sum, materialized = statistics(x)
  rows = []
  for i in range(6):
    with tf.GradientTape() as tape:
      example_loss = loss(y[i:i + 1], model(x[i:i + 1]))
    rows.append(tape.gradient(example_loss, model.trainable_variables))
  tapes = [np.stack([r[v].numpy() for r in rows])
           for v in range(len(model.trainable_variables))]
  assert stats.relative_error(materialized, tapes) <= 1e-5
  assert stats.relative_error(
      sq_norms, [np.sum(t.reshape(6, -1)**2, axis=1) for t in tapes]) <= 1e-5
  assert stats.relative_error(
      weighted_sum, [np.tensordot(weights, t, 1) for t in tapes]) <= 1e-5
