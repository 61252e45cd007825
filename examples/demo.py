"""`make demo`: DP-SGD on an offline dataset, with an honest epsilon.

Trains a small MLP on scikit-learn's 8x8 digits (shipped with the package, no
download) at the noise multiplier calibrated to epsilon = 3, and prints the
privacy statement. The full demo (every privatizer on MNIST digits, a plot and
a SavedModel) comes with the examples issue.
"""

import numpy as np
from sklearn import datasets
import tensorflow as tf

import tfdpx

BATCH, EPOCHS, DELTA, TARGET_EPSILON = 64, 20, 1e-5, 3.0


def main():
  digits = datasets.load_digits()
  x = (digits.data / 16.0).astype('float32')
  y = digits.target.astype('int32')
  rng = np.random.default_rng(0)
  order = rng.permutation(len(x))
  x, y = x[order], y[order]
  n = (1500 // BATCH) * BATCH  # Whole batches only: steps * BATCH == n.
  x_train, y_train, x_test, y_test = x[:n], y[:n], x[1500:], y[1500:]
  steps = EPOCHS * (n // BATCH)
  q = BATCH / n

  noise_multiplier = tfdpx.accounting.calibrate_noise_multiplier(
      TARGET_EPSILON, tfdpx.privatizers.gaussian(1.0, 1.0), steps=steps,
      sampling_probability=q, delta=DELTA)
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([
      tf.keras.layers.Dense(64, activation='tanh', input_shape=(64,)),
      tf.keras.layers.Dense(10),
  ])
  optimizer = tfdpx.keras.DPSGD(
      l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
      expected_batch_size=BATCH, learning_rate=0.5)
  model.compile(
      optimizer,
      tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction=tf.keras.losses.Reduction.NONE),
      metrics=['accuracy'])
  model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS, verbose=2,
            callbacks=[tfdpx.keras.PrivacyCallback(sampling_probability=q,
                                                   delta=DELTA)])
  _, accuracy = model.evaluate(x_test, y_test, verbose=0)
  print(f'\nnoise_multiplier {noise_multiplier:.4f}, test accuracy '
        f'{accuracy:.4f}')
  print(tfdpx.accounting.privacy_statement(
      optimizer, num_examples=n, expected_batch_size=BATCH, delta=DELTA,
      sampling='shuffle'))


if __name__ == '__main__':
  main()
