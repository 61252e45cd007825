"""The papers' architectures, sized by the input shape, and two models over
embedding tables for the synthetic id datasets."""

import tensorflow as tf

from examples import datasets

layers = tf.keras.layers


def tutorial_cnn(input_shape, num_classes=10, activation='relu'):
  """tensorflow-privacy's MNIST tutorial CNN (26,010 parameters on 28x28x1).

  `activation='tanh'` gives the variant of Papernot et al. used by several
  papers' MNIST runs.
  """
  return tf.keras.Sequential([
      tf.keras.Input(input_shape),
      layers.Conv2D(16, 8, strides=2, padding='same', activation=activation),
      layers.MaxPool2D(2, 1),
      layers.Conv2D(32, 4, strides=2, padding='valid', activation=activation),
      layers.MaxPool2D(2, 1),
      layers.Flatten(),
      layers.Dense(32, activation=activation),
      layers.Dense(num_classes),
  ], name='tutorial_cnn')


def tanh_cnn(input_shape, num_classes=10, groups=8):
  """The tanh CNN of Papernot et al. / Tramer & Boneh used for CIFAR-10.

  Three blocks of two 3x3 convolutions (32, 64, 128 filters) with GroupNorm and
  tanh, max-pooling after each block, then Dense 128 and the classifier (the
  specs' reading of the papers' "5-layer CNN"; GroupNorm groups are a free
  choice).
  """
  model = tf.keras.Sequential(name='tanh_cnn')
  model.add(layers.InputLayer(input_shape=input_shape))
  for filters in (32, 64, 128):
    for _ in range(2):
      model.add(layers.Conv2D(filters, 3, padding='same'))
      model.add(layers.GroupNormalization(min(groups, filters)))
      model.add(layers.Activation('tanh'))
    model.add(layers.MaxPool2D(2))
  model.add(layers.Flatten())
  model.add(layers.Dense(128, activation='tanh'))
  model.add(layers.Dense(num_classes))
  return model


def resnet_gn(input_shape, num_classes=10, widths=(16, 32, 64), groups=8):
  """A small ResNet (one basic block per stage) with GroupNorm, no BatchNorm."""

  def norm_act(t, filters):
    t = layers.GroupNormalization(min(groups, filters))(t)
    return layers.Activation('relu')(t)

  inputs = tf.keras.Input(input_shape)
  t = norm_act(layers.Conv2D(widths[0], 3, padding='same')(inputs), widths[0])
  for i, filters in enumerate(widths):
    stride = 1 if i == 0 else 2
    shortcut = t
    t = norm_act(layers.Conv2D(filters, 3, stride, padding='same')(t), filters)
    t = layers.GroupNormalization(min(groups, filters))(
        layers.Conv2D(filters, 3, padding='same')(t))
    if stride != 1 or shortcut.shape[-1] != filters:
      shortcut = layers.Conv2D(filters, 1, stride)(shortcut)
    t = layers.Activation('relu')(layers.Add()([t, shortcut]))
  t = layers.GlobalAveragePooling2D()(t)
  return tf.keras.Model(inputs, layers.Dense(num_classes)(t), name='resnet_gn')


def recommendation(input_shape, num_classes=2):
  """Two embedding tables (100,000 x 16 and 10,000 x 16, the sizes of
  `datasets.RECOMMENDATION_ROWS`), each fed half of the ids, pooled, and a
  small MLP tower."""
  ids = tf.keras.Input(input_shape, dtype='int32')
  half = input_shape[0] // 2
  pooled = [layers.GlobalAveragePooling1D()(layers.Embedding(rows, 16)(part))
            for rows, part in zip(datasets.RECOMMENDATION_ROWS,
                                  (ids[:, :half], ids[:, half:]))]
  hidden = layers.Dense(32, activation='relu')(layers.Concatenate()(pooled))
  return tf.keras.Model(ids, layers.Dense(num_classes)(hidden),
                        name='recommendation')


def text(input_shape, num_classes=2):
  """The text benchmark's classifier: Embedding(20000, 64), pooled, two
  Dense layers."""
  ids = tf.keras.Input(input_shape, dtype='int32')
  rows = layers.Embedding(datasets.TEXT_VOCAB, 64)(ids)
  hidden = layers.Dense(64, activation='relu')(
      layers.GlobalAveragePooling1D()(rows))
  return tf.keras.Model(ids, layers.Dense(num_classes)(hidden), name='text')


MODELS = {'tutorial_cnn': tutorial_cnn, 'tanh_cnn': tanh_cnn,
          'resnet_gn': resnet_gn, 'recommendation': recommendation,
          'text': text}
