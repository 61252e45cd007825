"""The models the benchmarks and the pipeline tests train, and their data.

Sizes follow the models users train with DP: tensorflow-privacy's MNIST
tutorial CNN, an MLP, a text classifier over a large embedding, one
transformer block, a CIFAR-10 CNN, and a BERT-mini-like encoder trained
whole or (Keras 3) fine-tuned with LoRA. And models as users bring them:
keras.io's "Text classification with Transformer" with its custom layers, a
keras.io bidirectional LSTM classifier and (Keras 3) keras-hub's BERT
classifier and GPT-2 causal language model from small configurations.
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


class TransformerBlock(L.Layer):
  """keras.io's block, as written there: attention, a nested Sequential
  feed-forward block, two normalizations, two dropouts."""

  def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
    super().__init__()
    self.att = L.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
    self.ffn = tf.keras.Sequential(
        [L.Dense(ff_dim, activation='relu'), L.Dense(embed_dim)])
    self.layernorm1 = L.LayerNormalization(epsilon=1e-6)
    self.layernorm2 = L.LayerNormalization(epsilon=1e-6)
    self.dropout1 = L.Dropout(rate)
    self.dropout2 = L.Dropout(rate)

  def call(self, inputs, training=None):
    attn_output = self.dropout1(self.att(inputs, inputs), training=training)
    out1 = self.layernorm1(inputs + attn_output)
    ffn_output = self.dropout2(self.ffn(out1), training=training)
    return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(L.Layer):
  """keras.io's embedding: tokens plus a position table on `range(maxlen)`."""

  def __init__(self, maxlen, vocab_size, embed_dim):
    super().__init__()
    self.token_emb = L.Embedding(input_dim=vocab_size, output_dim=embed_dim)
    self.pos_emb = L.Embedding(input_dim=maxlen, output_dim=embed_dim)

  def call(self, x):
    positions = self.pos_emb(tf.range(start=0, limit=tf.shape(x)[-1]))
    return self.token_emb(x) + positions


KERAS_IO_TOKENS = 200


def keras_io_transformer(maxlen=KERAS_IO_TOKENS, vocab=VOCAB, embed_dim=32,
                         dropout=0.1):
  """keras.io "Text classification with Transformer" (its sizes: 200
  tokens, Embedding(20000, 32), 2 heads, feed-forward 32)."""
  inputs = L.Input(shape=(maxlen,))
  x = TokenAndPositionEmbedding(maxlen, vocab, embed_dim)(inputs)
  x = TransformerBlock(embed_dim, 2, 32, rate=dropout)(x)
  x = L.GlobalAveragePooling1D()(x)
  x = L.Dropout(dropout)(x)
  x = L.Dense(20, activation='relu')(x)
  x = L.Dropout(dropout)(x)
  return tf.keras.Model(inputs, L.Dense(2)(x))  # Logits: the harness's loss.


def bidirectional_lstm():
  """keras.io "Bidirectional LSTM on IMDB": Embedding(20000, 128), two
  Bidirectional(LSTM(64)); sequences of any length (200 tokens here)."""
  inputs = tf.keras.Input(shape=(None,), dtype='int32')
  x = L.Embedding(VOCAB, 128)(inputs)
  x = L.Bidirectional(L.LSTM(64, return_sequences=True))(x)
  x = L.Bidirectional(L.LSTM(64))(x)
  return tf.keras.Model(inputs, L.Dense(2)(x))


HUB_VOCAB = 30522


def _hub_config():
  return dict(vocabulary_size=HUB_VOCAB, num_layers=2, num_heads=2,
              hidden_dim=128, intermediate_dim=512,
              max_sequence_length=TOKENS)


def hub_bert():
  """keras-hub's BertTextClassifier from a small config, no weights."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.BertBackbone(**_hub_config())
  return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                             preprocessor=None)


def hub_gpt2():
  """keras-hub's GPT2CausalLM from a small config, no weights: a loss per
  token."""
  import keras_hub  # pylint: disable=g-import-not-at-top
  backbone = keras_hub.models.GPT2Backbone(**_hub_config())
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def _hub_tokens(rng, n, segments=True):
  x = {'token_ids': rng.integers(1, HUB_VOCAB, (n, TOKENS)),
       'padding_mask': np.ones((n, TOKENS), 'int32')}
  if segments:
    x['segment_ids'] = np.zeros((n, TOKENS), 'int32')
  return x


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


# The recommendation model's tables, ids per example and Zipf exponent.
RECOMMENDATION_TABLES = {'user_ids': 1_000_000, 'item_ids': 100_000}
RECOMMENDATION_IDS, ZIPF = 10, 1.2


def recommendation():
  """Two tables (1,000,000 x 32 and 100,000 x 32), 10 ids each, pooled, a
  small MLP tower (36M parameters, nearly all in the tables)."""
  inputs = {name: tf.keras.Input((RECOMMENDATION_IDS,), dtype='int32',
                                 name=name)
            for name in RECOMMENDATION_TABLES}
  pooled = [L.GlobalAveragePooling1D()(L.Embedding(rows, 32)(inputs[name]))
            for name, rows in RECOMMENDATION_TABLES.items()]
  hidden = L.Dense(64, activation='relu')(L.Concatenate()(pooled))
  return tf.keras.Model(inputs, L.Dense(2)(L.Dense(32, activation='relu')(
      hidden)))


def zipf_ids(rng, n, rows, exponent=ZIPF):
  """`[n, RECOMMENDATION_IDS]` ids drawn from a Zipf law over `rows` ids
  (rank 1 is id 0; the tail past `rows` folds back)."""
  return (rng.zipf(exponent, (n, RECOMMENDATION_IDS)) - 1) % rows


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
    # keras.io's examples as written there: batch 32 (`--batches=32`).
    'keras_io_transformer': (keras_io_transformer, lambda rng, n: rng.integers(
        0, VOCAB, (n, KERAS_IO_TOKENS)), 2),
    'bilstm': (bidirectional_lstm, lambda rng, n: rng.integers(
        0, VOCAB, (n, KERAS_IO_TOKENS)), 2),
    'recommendation': (recommendation, lambda rng, n: {
        name: zipf_ids(rng, n, rows)
        for name, rows in RECOMMENDATION_TABLES.items()}, 2),
}
if KERAS_3:  # Keras 3's enable_lora; keras-hub.
  MODELS['encoder_lora'] = (lambda: encoder(lora_rank=8),
                            MODELS['encoder'][1], 2)
  MODELS['hub_bert'] = (hub_bert, _hub_tokens, 2)
  MODELS['hub_gpt2'] = (hub_gpt2, lambda rng, n: _hub_tokens(rng, n, False),
                        HUB_VOCAB)

# Labels of more than one entry an example: a loss per token.
LABEL_SHAPES = {'hub_gpt2': (TOKENS,)}


def data(model_name, rows, seed=0):
  """Random inputs and labels: speed does not depend on the values."""
  _, inputs, classes = MODELS[model_name]
  rng = np.random.default_rng(seed)
  x = tf.nest.map_structure(
      lambda t: t.astype('int32' if t.dtype.kind == 'i' else 'float32'),
      inputs(rng, rows))
  return x, rng.integers(0, classes,
                         size=(rows,) + LABEL_SHAPES.get(model_name, ()))
