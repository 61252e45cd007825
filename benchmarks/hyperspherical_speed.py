"""Time and accuracy of the hyperspherical round trip (GeoDP's conversions).

Cartesian -> spherical -> Cartesian on a float64 Gaussian vector of length
`--d`, eager, in a `tf.function` and under XLA; prints the best of `--repeats`
wall-clock times after one warm-up call, the process CPU time of that call
(all threads; less sensitive to other load on a shared machine), and the
normwise relative error.

Usage:
  python -m benchmarks.hyperspherical_speed --d=1000000 --repeats=5
"""

import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from tfdpx import hyperspherical

FLAGS = flags.FLAGS
flags.DEFINE_integer('d', 1_000_000, 'Vector length.')
flags.DEFINE_integer('repeats', 5, 'Timed calls per variant (best is shown).')


def round_trip(x):
  return hyperspherical.to_cartesian(*hyperspherical.to_spherical(x))


def main(argv):
  del argv
  x = tf.constant(np.random.default_rng(0).normal(size=FLAGS.d))
  variants = {
      'eager': round_trip,
      'tf.function': tf.function(round_trip),
      'tf.function(jit_compile=True)': tf.function(round_trip,
                                                   jit_compile=True),
  }
  print(f'd = {FLAGS.d:,}, float64, best of {FLAGS.repeats}')
  for name, fn in variants.items():
    fn(x)  # Warm-up (tracing, compilation).
    times = []
    for _ in range(FLAGS.repeats):
      start, cpu = time.perf_counter(), time.process_time()
      y = fn(x).numpy()
      times.append((time.perf_counter() - start, time.process_time() - cpu))
    wall, cpu = min(times)
    error = np.linalg.norm(y - x.numpy()) / np.linalg.norm(x.numpy())
    print(f'  {name:30s} wall {wall:.3f} s, CPU {cpu:.3f} s, '
          f'relative error {error:.2e}')


if __name__ == '__main__':
  app.run(main)
