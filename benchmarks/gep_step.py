"""Memory and time of one GEP step vs one DP-SGD step (tutorial CNN).

Setup (issue #7): tensorflow-privacy's MNIST tutorial CNN (26,010 parameters),
private batch 256, 500 public anchors with random labels, 100 bases in 3
groups. Per-example gradients come from `tf.vectorized_map` in this script
(`tfdpx.keras.make_private` was not on `main` when it was written), and the
privatizers' `update` is called directly, so two things are measured:

* `update`: the privatizer step alone, on precomputed per-example gradients
  (DP-SGD: clip + noise; GEP: power method + QR + projection + two clips and
  two noises);
* `step`: per-example gradients (GEP also of the 500 anchors) + `update` +
  SGD `apply_gradients`, one `tf.function`.

Each (method, part) runs in its own subprocess, one after the other, so the
ratios come from one run of this script on the same machine state. Time is
the median wall time of `--steps` calls after two warm-up calls (tracing);
memory is the peak resident set size sampled every 2 ms during those calls,
minus the resident size just before them (CPU allocators report no peak).

Usage: python -m benchmarks.gep_step [--steps 10]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BATCH, ANCHORS, BASES = 256, 500, 100


def _rss_mib():
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith('VmRSS:'):
        return int(line.split()[1]) / 1024
  raise RuntimeError('no VmRSS')


class _PeakRss:
  """Samples the resident set size in a thread; `peak` after `stop`."""

  def __init__(self):
    self.start = _rss_mib()
    self.peak = self.start
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      self.peak = max(self.peak, _rss_mib())
      time.sleep(0.002)

  def stop(self):
    self._stop.set()
    self._thread.join()
    self.peak = max(self.peak, _rss_mib())
    return self.peak - self.start


def child(method, part, steps):
  """Measures one (method, part); prints one JSON line."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from examples import datasets  # pylint: disable=g-import-not-at-top
  from examples import models  # pylint: disable=g-import-not-at-top
  from tfdpx import privatizers  # pylint: disable=g-import-not-at-top

  x, y, _, _, num_classes = datasets.load('mnist5k')
  rng = np.random.default_rng(0)
  x_priv, y_priv = tf.constant(x[:BATCH]), tf.constant(y[:BATCH])
  x_pub = tf.constant(x[BATCH:BATCH + ANCHORS])
  y_pub = tf.constant(rng.integers(0, num_classes, ANCHORS),
                      tf.int32)  # Random labels (spec §1.6).
  tf.keras.utils.set_random_seed(0)
  model = models.tutorial_cnn((28, 28, 1), num_classes)
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def per_example_gradients(x, y):
    """One `[batch, *var.shape]` tensor per variable (`tf.vectorized_map`)."""
    def one(example):
      xi, yi = example
      with tf.GradientTape() as tape:
        loss = loss_fn(yi[tf.newaxis], model(xi[tf.newaxis], training=True))
      return tape.gradient(loss, model.trainable_variables)
    return tf.vectorized_map(one, (x, y))

  variables = model.trainable_variables
  optimizer = tf.keras.optimizers.SGD(0.1)
  if method == 'gep':
    privatizer = privatizers.gep(BASES, 5.0, 2.0, 1.0)
  else:
    privatizer = privatizers.gaussian(1.0, 1.0)

  def private_and_public():
    grads = per_example_gradients(x_priv, y_priv)
    public = (per_example_gradients(x_pub, y_pub)
              if method == 'gep' else None)
    return grads, public

  @tf.function
  def step(seed):
    grads, public = private_and_public()
    noisy, _ = privatizer.update(grads, {}, seed, public_grads=public)
    optimizer.apply_gradients(
        zip([g / BATCH for g in noisy], variables))

  @tf.function
  def update(grads, public, seed):
    return privatizer.update(grads, {}, seed, public_grads=public)[0]

  if part == 'step':
    run = lambda seed: step(seed)
  else:
    grads, public = tf.function(private_and_public)()
    run = lambda seed: update(grads, public, seed)
  for i in range(2):
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, 'numpy') else t,
                          run(tf.constant([0, i], tf.int64)))
  times = []
  peak = _PeakRss()
  for i in range(steps):
    start = time.perf_counter()
    out = run(tf.constant([1, i], tf.int64))
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, 'numpy') else t,
                          out)
    times.append(time.perf_counter() - start)
  extra = peak.stop()
  print(json.dumps({
      'method': method, 'part': part, 'seconds': float(np.median(times)),
      'extra_mib': extra, 'rss_mib': peak.peak,
      'parameters': int(sum(np.prod(v.shape) for v in variables)),
  }))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--child', nargs=2, metavar=('METHOD', 'PART'))
  args = parser.parse_args()
  if args.child:
    child(*args.child, args.steps)
    return
  results = {}
  for part in ('update', 'step'):
    for method in ('dpsgd', 'gep'):
      out = subprocess.run(
          [sys.executable, __file__, '--child', method, part,
           '--steps', str(args.steps)],
          check=True, capture_output=True, text=True).stdout
      results[method, part] = json.loads(out.strip().splitlines()[-1])
  p = results['gep', 'step']['parameters']
  print(f'tutorial CNN, p = {p}, private batch {BATCH}, {ANCHORS} anchors, '
        f'{BASES} bases (3 groups), median of {args.steps} calls, '
        f'{os.cpu_count()} CPU cores')
  print('| part | DP-SGD time | GEP time | time ratio | DP-SGD extra memory '
        '| GEP extra memory | memory ratio |')
  print('|---|---|---|---|---|---|---|')
  for part in ('update', 'step'):
    d, g = results['dpsgd', part], results['gep', part]
    print(f"| {part} | {d['seconds'] * 1e3:.0f} ms | {g['seconds'] * 1e3:.0f} "
          f"ms | {g['seconds'] / d['seconds']:.2f} | {d['extra_mib']:.0f} MiB"
          f" | {g['extra_mib']:.0f} MiB | "
          f"{g['extra_mib'] / max(d['extra_mib'], 1.0):.2f} |")
  print('peak resident set sizes (MiB): ' + ', '.join(
      f'{m}/{part} {r["rss_mib"]:.0f}' for (m, part), r in results.items()))


if __name__ == '__main__':
  main()
