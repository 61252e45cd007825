"""Models written the way the Keras guides and keras.io examples write them.

Our own small versions of what new users bring: subclassed layers around
known layers, nested models, preprocessing layers inside the model, dict
inputs, several outputs, RNNs, a frozen backbone, augmentation. Each entry
builds a model (seeded) and a batch; `test_zoo.py` trains it through
`make_private` and checks its per-example statistics and its report.
"""

from typing import Callable, Dict, FrozenSet, NamedTuple

import numpy as np
import tensorflow as tf

from benchmarks.models import TokenAndPositionEmbedding
from benchmarks.models import TransformerBlock

L = tf.keras.layers
BATCH = 5


class Case(NamedTuple):
  """One zoo model.

  Attributes:
    build: `build(dropout) -> model`, `dropout` the rate of its Dropout
      layers (0 for the comparison with single-example tapes).
    inputs: `inputs(rng) -> x`, a batch of `BATCH` examples.
    fallback: the classes of the layers whose calls take the fallback (the
      report must list exactly these): layers without a rule.
    random: whether its training pass draws random numbers other than its
      Dropout layers' (augmentation): then no tape comparison.
  """
  build: Callable[[float], tf.keras.Model]
  inputs: Callable[[np.random.Generator], object]
  fallback: FrozenSet[str] = frozenset()
  random: bool = False


def _ids(length, vocab):
  return lambda rng: rng.integers(1, vocab, size=(BATCH, length))


def _floats(*shape):
  return lambda rng: rng.normal(size=(BATCH,) + shape).astype('float32')


# --- keras.io "Text classification with Transformer" ------------------------
# (its layers in benchmarks/models.py, which times the example at its size)


def text_transformer(dropout, maxlen=8, vocab=50):
  inputs = L.Input(shape=(maxlen,))
  x = TokenAndPositionEmbedding(maxlen, vocab, 8)(inputs)
  x = TransformerBlock(8, 2, 8, rate=dropout)(x)
  x = L.GlobalAveragePooling1D()(x)
  x = L.Dropout(dropout)(x)
  x = L.Dense(6, activation='relu')(x)
  return tf.keras.Model(inputs, L.Dense(2, activation='softmax')(x))


# --- The guide "Making new layers and models via subclassing" ---------------


class Linear(L.Layer):
  """A layer with weights of its own: the fallback."""

  def __init__(self, units=4):
    super().__init__()
    self.units = units

  def build(self, input_shape):
    self.w = self.add_weight(shape=(input_shape[-1], self.units),
                             initializer='random_normal', trainable=True)
    self.b = self.add_weight(shape=(self.units,), initializer='random_normal',
                             trainable=True)

  def call(self, inputs):
    return tf.matmul(inputs, self.w) + self.b


class MLPBlock(L.Layer):

  def __init__(self):
    super().__init__()
    self.linear_1 = Linear(6)
    self.linear_2 = Linear(3)

  def call(self, inputs):
    return self.linear_2(tf.nn.relu(self.linear_1(inputs)))


def mlp_block(dropout):
  del dropout
  inputs = L.Input((5,))
  return tf.keras.Model(inputs, MLPBlock()(inputs))


class Classifier(tf.keras.Model):
  """A subclassed model: Dense layers with a dropout between them."""

  def __init__(self, dropout):
    super().__init__()
    self.hidden = L.Dense(6, activation='relu')
    self.drop = L.Dropout(dropout)
    self.out = L.Dense(3)

  def call(self, inputs, training=None):
    return self.out(self.drop(self.hidden(inputs), training=training))


def subclassed_model(dropout):
  model = Classifier(dropout)
  model(tf.zeros([1, 5]))
  return model


class DictModel(tf.keras.Model):
  """A subclassed model taking a dict of inputs."""

  def __init__(self):
    super().__init__()
    self.embed = L.Embedding(20, 4)
    self.dense = L.Dense(4, activation='tanh')
    self.head = L.Dense(2)

  def call(self, inputs):
    words = tf.reduce_mean(self.embed(inputs['words']), axis=1)
    return self.head(tf.concat([words, self.dense(inputs['numbers'])], -1))


def subclassed_dict_model(dropout):
  del dropout
  model = DictModel()
  model({'words': tf.zeros([1, 4], 'int32'), 'numbers': tf.zeros([1, 3])})
  return model


def _words_and_numbers(rng):
  return {'words': rng.integers(0, 20, size=(BATCH, 4)),
          'numbers': rng.normal(size=(BATCH, 3)).astype('float32')}


# --- Composites the engine must not open ------------------------------------


class TiedProjection(L.Layer):
  """Calls its Dense layer, then reads the layer's kernel itself (a tied
  output projection): one fallback unit."""

  def __init__(self):
    super().__init__()
    self.dense = L.Dense(4, activation='tanh')

  def call(self, inputs):
    return tf.matmul(self.dense(inputs), self.dense.kernel, transpose_b=True)


class ReZeroBlock(TransformerBlock):
  """keras.io's block with a learned residual scale of its own (ReZero): the
  whole block is one fallback unit, and it draws random numbers."""

  def build(self, input_shape):
    self.alpha = self.add_weight(shape=(), initializer='zeros', name='alpha')

  def call(self, inputs, training=None):
    return inputs + self.alpha * super().call(inputs, training=training)


def rezero_block(dropout):
  inputs = L.Input(shape=(8,))
  x = TokenAndPositionEmbedding(8, 50, 8)(inputs)
  x = ReZeroBlock(8, 2, 8, rate=dropout)(x)
  return tf.keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling1D()(x)))


def tied_projection(dropout):
  del dropout
  inputs = L.Input((5,))
  return tf.keras.Model(inputs, L.Dense(2)(TiedProjection()(inputs)))


class Repeated(L.Layer):
  """Calls one Dense layer three times in a Python loop (shared weights)."""

  def __init__(self):
    super().__init__()
    self.dense = L.Dense(5, activation='tanh')

  def call(self, inputs):
    for _ in range(3):
      inputs = self.dense(inputs) + inputs
    return inputs


def repeated_calls(dropout):
  del dropout
  inputs = L.Input((5,))
  return tf.keras.Model(inputs, L.Dense(2)(Repeated()(inputs)))


class Siamese(L.Layer):
  """A shared encoder called on two inputs."""

  def __init__(self):
    super().__init__()
    self.encoder = tf.keras.Sequential([L.Dense(6, activation='relu'),
                                        L.LayerNormalization()])

  def call(self, inputs):
    left, right = inputs
    return tf.abs(self.encoder(left) - self.encoder(right))


def siamese(dropout):
  del dropout
  left, right = L.Input((4,)), L.Input((4,))
  return tf.keras.Model([left, right], L.Dense(1)(Siamese()([left, right])))


def _pair(rng):
  return (_floats(4)(rng), _floats(4)(rng))


def nested_models(dropout):
  """A functional model around a subclassed model and a Sequential."""
  inner = Classifier(dropout)
  tower = tf.keras.Sequential([L.Dense(4, activation='relu'), L.Dense(3)])
  inputs = L.Input((5,))
  return tf.keras.Model(inputs, L.Add()([inner(inputs), tower(inputs)]))


# --- keras.io vision examples -----------------------------------------------


def mnist_convnet(dropout):
  """keras.io "Simple MNIST convnet", on 12 x 12 digits."""
  return tf.keras.Sequential([
      tf.keras.Input(shape=(12, 12, 1)),
      L.Conv2D(4, kernel_size=(3, 3), activation='relu'),
      L.MaxPooling2D(pool_size=(2, 2)),
      L.Conv2D(6, kernel_size=(3, 3), activation='relu'),
      L.MaxPooling2D(pool_size=(2, 2)),
      L.Flatten(),
      L.Dropout(dropout),
      L.Dense(3, activation='softmax'),
  ])


def strided_and_depthwise(dropout):
  """A mobile-style stack: strided, depthwise and separable convolutions."""
  del dropout
  inputs = L.Input((9, 9, 3))
  x = L.Conv2D(4, 3, strides=2, padding='same', activation='relu')(inputs)
  x = L.DepthwiseConv2D(3, padding='same')(x)
  # Equal strides: TensorFlow's own depthwise kernel (no oneDNN) takes no
  # others, in plain Keras too.
  x = L.SeparableConv2D(4, 3, strides=2, activation='relu')(x)
  return tf.keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling2D()(x)))


def augmentation(dropout):
  """Rescaling and random augmentation layers inside the model."""
  inputs = L.Input((8, 8, 3))
  x = L.Rescaling(1.0 / 255)(inputs)
  x = L.RandomFlip('horizontal')(x)
  x = L.RandomTranslation(0.1, 0.1)(x)
  x = L.Conv2D(4, 3, activation='relu')(x)
  x = L.Dropout(dropout)(L.GlobalAveragePooling2D()(x))
  return tf.keras.Model(inputs, L.Dense(2)(x))


def _pixels(rng):
  return rng.uniform(0, 255, size=(BATCH, 8, 8, 3)).astype('float32')


def frozen_backbone(dropout):
  """keras.io transfer learning: a frozen backbone called in inference mode
  (its BatchNormalization frozen), a new head."""
  backbone_inputs = L.Input((8, 8, 3))
  x = L.Conv2D(4, 3, activation='relu')(backbone_inputs)
  x = L.BatchNormalization()(x)
  x = L.Conv2D(4, 3, activation='relu')(x)
  backbone = tf.keras.Model(backbone_inputs, x, name='backbone')
  backbone.trainable = False
  inputs = L.Input((8, 8, 3))
  x = backbone(L.Rescaling(1.0 / 255)(inputs), training=False)
  x = L.Dropout(dropout)(L.GlobalAveragePooling2D()(x))
  return tf.keras.Model(inputs, L.Dense(2)(x))


# --- Text and sequences -----------------------------------------------------


def conv1d_text(dropout):
  """keras.io "Text classification from scratch", small."""
  inputs = L.Input(shape=(12,), dtype='int64')
  x = L.Embedding(30, 6)(inputs)
  x = L.Dropout(dropout)(x)
  x = L.Conv1D(4, 3, padding='valid', activation='relu', strides=3)(x)
  x = L.GlobalMaxPooling1D()(x)
  return tf.keras.Model(inputs, L.Dense(1, activation='sigmoid')(x))


def timeseries_transformer(dropout):
  """keras.io "Timeseries classification with a Transformer model"."""
  inputs = L.Input((6, 5))
  x = L.MultiHeadAttention(key_dim=4, num_heads=2, dropout=dropout)(inputs,
                                                                    inputs)
  x = L.Dropout(dropout)(x)
  x = L.LayerNormalization(epsilon=1e-6)(x)
  res = x + inputs
  x = L.Conv1D(filters=4, kernel_size=1, activation='relu')(res)
  x = L.Conv1D(filters=5, kernel_size=1)(x)
  x = L.LayerNormalization(epsilon=1e-6)(x) + res
  # keras.io pools over the channels of its one-channel series; over time
  # here, or the layers before the normalization get no gradient.
  x = L.GlobalAveragePooling1D()(x)
  return tf.keras.Model(inputs, L.Dense(2, activation='softmax')(x))


class MaskedAttention(L.Layer):
  """Self-attention over padded tokens: Keras passes the padding mask on."""

  def __init__(self):
    super().__init__()
    self.supports_masking = True
    self.att = L.MultiHeadAttention(num_heads=2, key_dim=4)
    self.norm = L.LayerNormalization()

  def call(self, inputs, mask=None):
    del mask  # The attention reads the inputs' mask itself.
    return self.norm(inputs + self.att(inputs, inputs))


def masked_attention(dropout):
  del dropout
  inputs = L.Input((6,), dtype='int32')
  x = L.Embedding(10, 4, mask_zero=True)(inputs)
  x = MaskedAttention()(x)
  return tf.keras.Model(inputs, L.Dense(2)(L.GlobalAveragePooling1D()(x)))


def _padded(rng):
  ids = rng.integers(1, 10, size=(BATCH, 6))
  ids[:, 4:] = 0
  ids[0, 2:] = 0
  return ids


def bidirectional_lstm(dropout):
  """keras.io "Bidirectional LSTM on IMDB", small."""
  del dropout
  inputs = tf.keras.Input(shape=(None,), dtype='int32')
  x = L.Embedding(30, 4)(inputs)
  x = L.Bidirectional(L.LSTM(3, return_sequences=True))(x)
  x = L.Bidirectional(L.LSTM(3))(x)
  return tf.keras.Model(inputs, L.Dense(1, activation='sigmoid')(x))


def gru_time_distributed(dropout):
  del dropout
  inputs = L.Input((5, 3))
  x = L.GRU(4, return_sequences=True)(inputs)
  x = L.TimeDistributed(L.Dense(2))(x)
  return tf.keras.Model(inputs, L.Flatten()(x))


def masked_simple_rnn(dropout):
  del dropout
  inputs = L.Input((6,), dtype='int32')
  x = L.Embedding(10, 4, mask_zero=True)(inputs)
  x = L.SimpleRNN(3)(x)
  return tf.keras.Model(inputs, L.Dense(2)(x))


def text_vectorization(dropout):
  """Raw strings in, a TextVectorization layer inside the model."""
  vectorize = L.TextVectorization(max_tokens=20, output_sequence_length=5)
  vectorize.adapt(['the cat sat', 'a dog ran far', 'the dog sat on a mat'])
  inputs = L.Input((1,), dtype='string')
  x = L.Embedding(20, 4)(vectorize(inputs))
  x = L.Dropout(dropout)(L.GlobalAveragePooling1D()(x))
  return tf.keras.Model(inputs, L.Dense(2)(x))


def _sentences(rng):
  words = np.array(['the', 'cat', 'dog', 'sat', 'ran', 'on', 'mat', 'far'])
  return np.array([[' '.join(rng.choice(words, size=4))]
                   for _ in range(BATCH)])


# --- Structured data --------------------------------------------------------


def structured_data(dropout):
  """keras.io "Structured data classification": dict inputs, preprocessing
  layers inside the model."""
  rng = np.random.default_rng(5)
  age = L.Normalization()
  age.adapt(rng.normal(40, 10, size=(50, 1)))
  thal = L.IntegerLookup(output_mode='one_hot')
  thal.adapt(rng.integers(0, 4, size=(50, 1)))
  city = L.StringLookup(output_mode='one_hot')
  city.adapt(np.array([['a'], ['b'], ['c']]))
  bins = L.Discretization(bin_boundaries=[0.0, 1.0])
  inputs = {'age': L.Input((1,), name='age'),
            'thal': L.Input((1,), name='thal', dtype='int64'),
            'city': L.Input((1,), name='city', dtype='string'),
            'score': L.Input((1,), name='score'),
            'zip': L.Input((1,), name='zip', dtype='int64')}
  features = L.Concatenate()([
      age(inputs['age']), thal(inputs['thal']), city(inputs['city']),
      L.CategoryEncoding(3, output_mode='one_hot')(bins(inputs['score'])),
      L.CategoryEncoding(8, output_mode='one_hot')(
          L.Hashing(8)(inputs['zip']))])
  x = L.Dropout(dropout)(L.Dense(6, activation='relu')(features))
  return tf.keras.Model(inputs, L.Dense(1)(x))


def _records(rng):
  return {'age': rng.normal(40, 10, size=(BATCH, 1)).astype('float32'),
          'thal': rng.integers(0, 4, size=(BATCH, 1)),
          'city': rng.choice(['a', 'b', 'c', 'd'], size=(BATCH, 1)),
          'score': rng.normal(size=(BATCH, 1)).astype('float32'),
          'zip': rng.integers(10000, 99999, size=(BATCH, 1))}


def two_outputs(dropout):
  """Two named outputs, each with its loss (`test_zoo` compiles them)."""
  inputs = L.Input((5,))
  x = L.Dropout(dropout)(L.Dense(6, activation='relu')(inputs))
  return tf.keras.Model(inputs, {'score': L.Dense(1, name='score')(x),
                                 'label': L.Dense(3, name='label')(x)})


ZOO: Dict[str, Case] = {
    'text_transformer': Case(text_transformer, _ids(8, 50),
                             frozenset({'TokenAndPositionEmbedding'})),
    'mlp_block': Case(mlp_block, _floats(5), frozenset({'Linear'})),
    'subclassed_model': Case(subclassed_model, _floats(5)),
    'subclassed_dict_model': Case(subclassed_dict_model, _words_and_numbers),
    'rezero_block': Case(rezero_block, _ids(8, 50),
                         frozenset({'TokenAndPositionEmbedding',
                                    'ReZeroBlock'})),
    'tied_projection': Case(tied_projection, _floats(5),
                            frozenset({'TiedProjection'})),
    'repeated_calls': Case(repeated_calls, _floats(5)),
    'siamese': Case(siamese, _pair),
    'nested_models': Case(nested_models, _floats(5)),
    'mnist_convnet': Case(mnist_convnet, _floats(12, 12, 1)),
    'strided_and_depthwise': Case(
        strided_and_depthwise, _floats(9, 9, 3),
        frozenset({'DepthwiseConv2D', 'SeparableConv2D'})),
    'augmentation': Case(augmentation, _pixels, random=True),
    'frozen_backbone': Case(frozen_backbone, _pixels),
    'conv1d_text': Case(conv1d_text, _ids(12, 30)),
    'timeseries_transformer': Case(timeseries_transformer, _floats(6, 5)),
    'masked_attention': Case(masked_attention, _padded),
    'bidirectional_lstm': Case(bidirectional_lstm, _ids(6, 30)),
    'gru_time_distributed': Case(gru_time_distributed, _floats(5, 3),
                                 frozenset({'TimeDistributed'})),
    'masked_simple_rnn': Case(masked_simple_rnn, _padded),
    'text_vectorization': Case(text_vectorization, _sentences),
    'structured_data': Case(structured_data, _records),
    'two_outputs': Case(two_outputs, _floats(5)),
}
