"""The compile-path engine: per-example gradients equal single-example tapes."""

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import per_example

LOSS = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction='none')


def _models():
  return {
      'dense': (tf.keras.Sequential([
          tf.keras.layers.Dense(6, activation='relu', input_shape=(5,)),
          tf.keras.layers.Dense(3)]), lambda r: r.normal(size=(4, 5))),
      'conv2d': (tf.keras.Sequential([
          tf.keras.layers.Conv2D(3, 3, strides=2, padding='same',
                                 activation='tanh', input_shape=(7, 7, 2)),
          tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)]),
                 lambda r: r.normal(size=(4, 7, 7, 2))),
      'embedding': (tf.keras.Sequential([
          tf.keras.layers.Embedding(11, 4, input_length=5),
          tf.keras.layers.GlobalAveragePooling1D(), tf.keras.layers.Dense(3)]),
                    lambda r: r.integers(0, 11, size=(4, 5))),
  }


@pytest.mark.parametrize('name', ['dense', 'conv2d', 'embedding'])
def test_jacobian_equals_a_loop_of_single_example_tapes(name):
  tf.keras.utils.set_random_seed(0)
  model, make_x = _models()[name]
  rng = np.random.default_rng(0)
  x, y = make_x(rng), rng.integers(0, 3, size=(4,))
  with tf.GradientTape() as tape:
    records = per_example.record_losses(LOSS(y, model(x)))
  batched = per_example.jacobian(tape, records, model.trainable_variables)
  for i in range(len(y)):
    with tf.GradientTape() as single:
      loss = LOSS(y[i:i + 1], model(x[i:i + 1]))[0]
    expected = single.gradient(loss, model.trainable_variables)
    for got, want in zip(batched, expected):
      want = tf.convert_to_tensor(want)  # Embedding gives IndexedSlices.
      np.testing.assert_allclose(got[i].numpy(), want.numpy(), rtol=1e-5,
                                 atol=1e-6)


def test_microbatch_records_average_their_examples():
  losses = tf.constant([1.0, 3.0, 5.0, 7.0])
  np.testing.assert_allclose(per_example.record_losses(losses, 2), [2.0, 6.0])
  np.testing.assert_allclose(per_example.record_losses(losses), losses)


def test_scalar_loss_is_refused():
  with pytest.raises(ValueError, match='Reduction.NONE'):
    per_example.record_losses(tf.constant(1.0))
