"""keras-hub models (Keras 3) through `make_private`: small configs, no weights.

A BERT classifier, a GPT-2 causal language model (a loss per token: each
sequence is one record, its mean per-token loss clipped) and a ViT image
classifier. Their transformer layers are composites the engine opens; their
per-example statistics equal single-example tapes.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx.keras import recorder
from tfdpx.keras.version import KERAS_3

if not KERAS_3:
  pytest.skip('keras-hub needs Keras 3 (Stack B)', allow_module_level=True)

keras_hub = pytest.importorskip('keras_hub')

VOCAB, LENGTH, BATCH = 200, 8, 3
SMALL = dict(num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
             dropout=0.0)


def _bert():
  backbone = keras_hub.models.BertBackbone(
      vocabulary_size=VOCAB, max_sequence_length=LENGTH, **SMALL)
  return keras_hub.models.BertTextClassifier(
      backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)


def _gpt2():
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=VOCAB, max_sequence_length=LENGTH, **SMALL)
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _vit():
  backbone = keras_hub.models.ViTBackbone(
      image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2,
      hidden_dim=16, mlp_dim=32, dropout_rate=0.0, attention_dropout=0.0)
  return keras_hub.models.ViTImageClassifier(
      backbone=backbone, num_classes=2, preprocessor=None)


def _tokens(rng, segments=True):
  padding = np.ones((BATCH, LENGTH), 'int32')
  padding[0, 5:] = 0  # A shorter sequence.
  x = {'token_ids': rng.integers(1, VOCAB, size=(BATCH, LENGTH)) * padding,
       'padding_mask': padding}
  if segments:
    x['segment_ids'] = np.zeros((BATCH, LENGTH), 'int32')
  return x


MODELS = {
    'bert': (_bert, lambda rng: _tokens(rng), {'PositionEmbedding'}),
    'gpt2': (_gpt2, lambda rng: _tokens(rng, segments=False),
             {'PositionEmbedding'}),
    'vit': (_vit, lambda rng: rng.normal(size=(BATCH, 8, 8, 3)).astype(
        'float32'), {'ViTPatchingAndEmbedding'}),
}


def _problem(name):
  tf.keras.utils.set_random_seed(1)
  build, inputs, fallback = MODELS[name]
  return build(), inputs(np.random.default_rng(0)), fallback


def _per_token_loss(y, logits):
  """Each example's mean per-token loss (Keras's default reduction)."""
  losses = tf.keras.losses.sparse_categorical_crossentropy(
      y, logits, from_logits=True)
  return tf.reduce_mean(tf.reshape(losses, [tf.shape(losses)[0], -1]), 1)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_the_transformer_layers_are_opened(name):
  model, x, fallback = _problem(name)
  report = tfdpx.keras.describe(model, x)
  assert {row.kind for row in report.rows if row.fallback} == fallback
  kinds = {row.kind for row in report.rows if not row.fallback}
  assert {'EinsumDense', 'Dense', 'LayerNormalization'} <= kinds


@pytest.mark.parametrize('name', sorted(MODELS))
def test_statistics_equal_single_example_tapes(name):
  model, x, _ = _problem(name)
  outputs = model(x)
  rng = np.random.default_rng(2)
  y = rng.integers(0, outputs.shape[-1], size=outputs.shape[:-1])
  variables = model.trainable_variables
  expected = []
  for i in range(BATCH):
    xi = tf.nest.map_structure(lambda t: t[i:i + 1], x)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_per_token_loss(y[i:i + 1], model(xi,
                                                              training=True)))
    expected.append([tf.convert_to_tensor(g).numpy() for g in tape.gradient(
        loss, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO)])
  expected = [np.stack(column) for column in zip(*expected)]

  @tf.function
  def sq_norms(x):
    return recorder.model_gradients(
        model, x, lambda out: _per_token_loss(y, out), variables,
        chunk_size=2).grads.sq_norms()

  got = sq_norms(x)
  want = [np.sum(g.reshape(BATCH, -1).astype('float64')**2, axis=1)
          for g in expected]
  floor = 1e-3 * np.sqrt(sum(np.sum(w**2) for w in want))
  for v, g, w in zip(variables, got, want):
    error = np.linalg.norm(g.numpy() - w) / max(np.linalg.norm(w), floor)
    assert error <= 1e-5, v.path


@pytest.mark.parametrize('name', sorted(MODELS))
def test_trains_through_make_private(name):
  model, x, _ = _problem(name)
  rng = np.random.default_rng(3)
  outputs = model(x)
  y = rng.integers(0, outputs.shape[-1], size=outputs.shape[:-1])
  private = tfdpx.keras.make_private(model)
  private.compile(
      tfdpx.keras.DPSGD(privatizer=tfdpx.privatizers.gaussian(1.0, 0.5),
                        expected_batch_size=BATCH, learning_rate=0.1),
      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
  before = [v.numpy().copy() for v in model.trainable_variables]
  weights = x['padding_mask'] if name == 'gpt2' else None  # Per token.
  private.fit(x, y, sample_weight=weights, batch_size=2, epochs=1, verbose=0)
  after = model.trainable_variables
  assert all(np.all(np.isfinite(v.numpy())) for v in after)
  assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, after))
