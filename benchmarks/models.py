"""The models the benchmarks and the pipeline tests train, and their data.

Sizes follow the models users train with DP: tensorflow-privacy's MNIST
tutorial CNN, an MLP, a text classifier over a large embedding, one
transformer block, a CIFAR-10 CNN, and a BERT-mini-like encoder trained
whole or (Keras 3) fine-tuned with LoRA.
"""

import numpy as np
import tensorflow as tf

from tfdpx.keras.version import KERAS_3

L = tf.keras.layers
VOCAB, TOKENS = 20000, 128

# --- models --------------------------------------------------------------------


def tutorial_cnn():
  """tensorflow-privacy's MNIST tutorial CNN (26k parameters)."""
  return tf.keras.Sequential([
      tf.keras.Input((28, 28, 1)),
      L.Conv2D(16, 8, strides=2, padding='same', activation='relu'),
      L.MaxPool2D(2, 1),
      L.Conv2D(32, 4, strides=2, padding='valid', activation='relu'),
      L.MaxPool2D(2, 1),
      L.Flatten(),
      L.Dense(32, activation='relu'),
      L.Dense(10),
  ])


def mlp():
  """784-128-128-10 (118k parameters)."""
  return tf.keras.Sequential([
      tf.keras.Input((784,)),
      L.Dense(128, activation='relu'),
      L.Dense(128, activation='relu'),
      L.Dense(10),
  ])


def text():
  """Embedding(20000, 64) over 128 tokens, pooled, two Dense (1.3M)."""
  return tf.keras.Sequential([
      tf.keras.Input((TOKENS,), dtype='int32'),
      L.Embedding(VOCAB, 64),
      L.GlobalAveragePooling1D(),
      L.Dense(64, activation='relu'),
      L.Dense(2),
  ])


class _Positions(L.Layer):
  """Adds a learned embedding of each position to the token embeddings."""

  def build(self, input_shape):
    self.positions = L.Embedding(input_shape[1], input_shape[2])
    super().build(input_shape)

  def call(self, inputs):
    return inputs + self.positions(tf.range(tf.shape(inputs)[1]))


def transformer():
  """One transformer block over 128 tokens (Embedding(20000, 64))."""
  tokens = tf.keras.Input((TOKENS,), dtype='int32')
  x = _Positions()(L.Embedding(VOCAB, 64)(tokens))
  x = L.LayerNormalization()(x + L.MultiHeadAttention(4, 16)(x, x))
  feed_forward = L.Dense(64)(L.Dense(128, activation='relu')(x))
  x = L.LayerNormalization()(x + feed_forward)
  return tf.keras.Model(tokens, L.Dense(2)(L.GlobalAveragePooling1D()(x)))


ENCODER_VOCAB = 8000


def encoder(tokens=128, lora_rank=None):
  """A BERT-mini-like encoder (5.2M): Embedding(8000, 256), four blocks of
  MultiHeadAttention(4 heads, key_dim 64), LayerNormalization, Dense(1024,
  gelu) and Dense(256), mean pooling, Dense(2).

  With `lora_rank` (Keras 3): a LoRA fine-tune, every weight frozen but the
  adapters of rank `lora_rank` on each attention's query and value
  projections and the classifier.
  """
  ids = tf.keras.Input((tokens,), dtype='int32')
  x = L.Embedding(ENCODER_VOCAB, 256)(ids)
  attentions = []
  for _ in range(4):
    attentions.append(L.MultiHeadAttention(4, 64))
    x = L.LayerNormalization()(x + attentions[-1](x, x))
    feed_forward = L.Dense(256)(L.Dense(1024, activation='gelu')(x))
    x = L.LayerNormalization()(x + feed_forward)
  head = L.Dense(2)
  model = tf.keras.Model(ids, head(L.GlobalAveragePooling1D()(x)))
  if lora_rank:
    for layer in model.layers:
      layer.trainable = layer is head
    for attention in attentions:
      attention.trainable = True
      for projection in (attention._key_dense, attention._output_dense):  # pylint: disable=protected-access
        projection.trainable = False
      for projection in (attention._query_dense, attention._value_dense):  # pylint: disable=protected-access
        projection.enable_lora(lora_rank)  # Freezes the kernel, not the bias.
  return model


def cifar_cnn():
  """A CIFAR-10 CNN: four 3x3 convolutions, two Dense (0.36M parameters)."""
  return tf.keras.Sequential([
      tf.keras.Input((32, 32, 3)),
      L.Conv2D(32, 3, padding='same', activation='relu'),
      L.Conv2D(32, 3, activation='relu'),
      L.MaxPool2D(),
      L.Conv2D(64, 3, padding='same', activation='relu'),
      L.Conv2D(64, 3, activation='relu'),
      L.MaxPool2D(),
      L.Flatten(),
      L.Dense(128, activation='relu'),
      L.Dense(10),
  ])


# name -> (builder, one random input batch of n rows, number of classes).
MODELS = {
    'cnn': (tutorial_cnn,
            lambda rng, n: rng.uniform(size=(n, 28, 28, 1)), 10),
    'mlp': (mlp, lambda rng, n: rng.uniform(size=(n, 784)), 10),
    'text': (text, lambda rng, n: rng.integers(0, VOCAB, (n, TOKENS)), 2),
    'transformer': (transformer,
                    lambda rng, n: rng.integers(0, VOCAB, (n, TOKENS)), 2),
    'cifar_cnn': (cifar_cnn,
                  lambda rng, n: rng.uniform(size=(n, 32, 32, 3)), 10),
    # Batch 32 (`--batches=32`); the 512-token one at batch 8.
    'encoder': (encoder, lambda rng, n: rng.integers(0, ENCODER_VOCAB,
                                                     (n, 128)), 2),
    'encoder_512': (lambda: encoder(512), lambda rng, n: rng.integers(
        0, ENCODER_VOCAB, (n, 512)), 2),
}
if KERAS_3:  # Keras 3's enable_lora.
  MODELS['encoder_lora'] = (lambda: encoder(lora_rank=8),
                            MODELS['encoder'][1], 2)


def data(model_name, rows, seed=0):
  """Random inputs and labels: speed does not depend on the values."""
  _, inputs, classes = MODELS[model_name]
  rng = np.random.default_rng(seed)
  x = inputs(rng, rows)
  x = x.astype('int32' if x.dtype.kind == 'i' else 'float32')
  return x, rng.integers(0, classes, size=(rows,))
