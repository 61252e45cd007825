"""Every privatizer releases the same through the engine as from materialized
per-example gradients, with the same noise key, over several steps.

The engine answers each statistic per layer (direct Dense forms, ghost or
chunked forms for sequences and convolutions, segment sums for embeddings,
materialized reductions for normalizations and the fallback); the reference
hands the privatizer the explicitly materialized `[B, *var.shape]` tensors.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tests.privatizers import cases
from tests.privatizers.cases import CASES
from tfdpx import gradients
from tfdpx import per_example
from tfdpx.forms import dense as dense_forms
from tfdpx.keras import recorder

L = tf.keras.layers
BATCH = 5
STEPS_PAST_THE_LAST_CHECK = 1


def _model():
  """One model with every per-layer form of the engine."""
  sequence = tf.keras.Input((6, 7))
  short = tf.keras.Input((3, 16))
  image = tf.keras.Input((6, 6, 3))
  ids = tf.keras.Input((6,), dtype='int32')
  s = L.Dense(8, activation='tanh')(sequence)  # Dense over positions.
  s = L.Conv1D(4, 3, strides=2)(s)  # TF's depthwise kernel: equal strides.
  s = L.LayerNormalization()(s)
  s = L.Dense(4)(L.GlobalAveragePooling1D()(s))  # Dense on vectors.
  t = L.Flatten()(L.Dense(16)(short))  # Few positions: the ghost form.
  i = L.Conv2D(4, 3, strides=(2, 1), activation='relu')(image)  # Patches.
  i = L.GroupNormalization(2)(i)
  i = L.Flatten()(i)
  e = L.Embedding(3, 4)(ids)  # Three ids over six positions: repeats.
  e = L.SimpleRNN(3)(e)  # No rule: the vectorized fallback.
  out = L.Dense(2)(L.Concatenate()([s, t, i, e]))
  return tf.keras.Model([sequence, short, image, ids], out)


def _batch(rng):
  return [rng.normal(size=(BATCH, 6, 7)).astype('float32'),
          rng.normal(size=(BATCH, 3, 16)).astype('float32'),
          rng.normal(size=(BATCH, 6, 6, 3)).astype('float32'),
          rng.integers(0, 3, size=(BATCH, 6)).astype('int32')]


def _grads(model, x, y):
  return recorder.model_gradients(
      model, x, lambda outputs: tf.reduce_sum(tf.square(outputs - y), axis=1),
      model.trainable_variables, chunk_size=2).grads


@pytest.fixture(scope='module')
def problem():
  tf.keras.utils.set_random_seed(3)
  model = _model()
  rng = np.random.default_rng(0)
  x, x_public = _batch(rng), _batch(rng)
  y = rng.normal(size=(BATCH, 2)).astype('float32')
  engine = _grads(model, x, y)
  public = _grads(model, x_public, y)  # GEP's anchors: the engine's value too.
  # GEP works in the anchors' coordinates for the groups whose variables all
  # have cross Gram forms: the reference takes the same forms.
  materialized = gradients.MaterializedGradients(
      engine.materialized(), cross_gram_forms=engine.cross_gram_forms(public))
  norms = np.sqrt(gradients.global_sq_norms(materialized).numpy())
  return model, engine, materialized, public, float(np.median(norms))


@pytest.mark.parametrize('case', CASES, ids=[c.name for c in CASES])
def test_the_engine_releases_what_materialized_gradients_release(problem,
                                                                 case):
  model, engine, materialized, public, clip = problem
  assert engine is not materialized
  privatizer = case.make(0.1, clip)  # About half the examples clipped.
  publics = [public, gradients.MaterializedGradients(
      public.materialized(), cross_gram_forms=public.cross_gram_forms(public))]
  states = [privatizer.init(model.trainable_variables)] * 2
  for step in range(max(case.steps) + 1 + STEPS_PAST_THE_LAST_CHECK):
    key = tf.constant([5, step], tf.int64)
    outs = []
    for i, grads in enumerate((engine, materialized)):
      out, states[i] = privatizer.update(
          grads, states[i], key,
          public_grads=publics[i] if case.needs_public else None)
      outs.append([o.numpy() for o in out])
    assert stats.relative_error(*outs) <= 1e-5, step


@pytest.mark.parametrize('name', ['gaussian', 'dpdr', 'sparsified(gaussian)',
                                  'd2p2_srht_mode_o', 'geodp_sound'])
def test_training_never_forms_per_example_gradients_of_dense_layers(
    name, monkeypatch):
  # Before, the optimizer handed every privatizer the materialized gradients.
  case = cases.case_named(name)

  def refuse(self):
    raise AssertionError('a Dense layer formed its per-example gradients')

  monkeypatch.setattr(dense_forms.ProductUnit, 'materialized', refuse)
  model = tfdpx.keras.make_private(tf.keras.Sequential([
      tf.keras.Input((7,)), L.Dense(8, activation='relu'), L.Dense(2)]))
  model.compile(
      tfdpx.keras.DPSGD(privatizer=case.make(1.0, 1.0), expected_batch_size=4,
                        learning_rate=0.1),
      tf.keras.losses.MeanSquaredError(reduction='none'))
  rng = np.random.default_rng(0)
  model.fit(rng.normal(size=(8, 7)), rng.normal(size=(8, 2)), batch_size=4,
            verbose=0)


def _dense_problem():
  """A Dense-only model: every GEP group works in the anchors' coordinates."""
  tf.keras.utils.set_random_seed(4)
  model = tf.keras.Sequential([tf.keras.Input((7,)),
                               L.Dense(6, activation='tanh'), L.Dense(2)])
  rng = np.random.default_rng(1)
  x, x_public = [rng.normal(size=(BATCH, 7)).astype('float32')
                 for _ in range(2)]
  y = rng.normal(size=(BATCH, 2)).astype('float32')
  return model, _grads(model, x, y), _grads(model, x_public, y)


@pytest.mark.parametrize('biased', [False, True], ids=['gep', 'b-gep'])
def test_gep_in_the_anchors_coordinates_releases_what_materialized_gradients_release(
    biased):
  model, engine, public = _dense_problem()
  assert all(engine.cross_gram_forms(public))
  assert all(public.cross_gram_forms(public))
  materialized = gradients.MaterializedGradients(engine.materialized())
  public_materialized = gradients.MaterializedGradients(public.materialized())
  clip = float(np.median(np.sqrt(gradients.global_sq_norms(engine).numpy())))
  privatizer = tfdpx.privatizers.gep(3, clip, clip / 2, 0.1, num_groups=2,
                                     biased=biased)
  for step in range(3):
    key = tf.constant([5, step], tf.int64)
    outs = [[o.numpy() for o in privatizer.update(
        grads, {}, key, public_grads=anchors)[0]]
            for grads, anchors in ((engine, public),
                                   (materialized, public_materialized))]
    assert stats.relative_error(*outs) <= 1e-5, step


def test_gep_on_dense_layers_forms_neither_gradients_nor_a_basis(monkeypatch):
  def refuse(self, *args, **kwargs):
    raise AssertionError('a Dense layer formed per-example gradients or dots '
                         'with a basis')

  monkeypatch.setattr(dense_forms.ProductUnit, 'materialized', refuse)
  monkeypatch.setattr(dense_forms.ProductUnit, 'dots', refuse)
  # As for a layer of a real size: its sums are not contractions of its
  # materialized gradients.
  monkeypatch.setattr(per_example, 'SMALL_UNIT_SIZE', 0)
  rng = np.random.default_rng(0)
  public = rng.normal(size=(6, 7)), rng.normal(size=(6, 2))
  model = tfdpx.keras.make_private(tf.keras.Sequential([
      tf.keras.Input((7,)), L.Dense(8, activation='relu'), L.Dense(2)]),
                                   public_data=public)
  model.compile(
      tfdpx.keras.DPSGD(privatizer=tfdpx.privatizers.gep(4, 1.0, 0.5, 1.0),
                        expected_batch_size=4, learning_rate=0.1),
      tf.keras.losses.MeanSquaredError(reduction='none'))
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(rng.normal(size=(8, 7)), rng.normal(size=(8, 2)), batch_size=4,
            verbose=0)
  assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
  assert any((b != v.numpy()).any()
             for b, v in zip(before, model.trainable_variables))
