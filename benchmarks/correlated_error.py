"""Where correlated noise can gain: the trajectory's noise at equal epsilon.

For each setting (examples n, expected batch B, epochs, target epsilon) this
calibrates, with tfdpx's accountant, DP-SGD's noise multiplier under Poisson
sampling and the multiplier of banded matrix factorization with `b` bands
under cyclic Poisson sampling over `b` groups (the group's sampling
probability is `b` times DP-SGD's, each example in a `b`-th of the steps),
and prints the root mean squared noise of the prefix sums (SGD's trajectory)
relative to DP-SGD's: `z_b * error_b / (z_1 * error_1)`
(`band_selection.trajectory_noise`), below 1 where the strategy's
cancellation outweighs the weaker amplification. The last
column is a BLT of 2 buffers on shuffled batches (`ceil(n / B)` steps an
epoch), which no sampling amplifies: one Gaussian mechanism of its
once-per-epoch sensitivity. The settings include those of the utility table
(docs/correlated_noise.md) and, for comparison, settings like the papers'
(many steps, larger epsilon, a single epoch).

Usage: python -m benchmarks.correlated_error [--out=FILE]
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from tfdpx import accounting  # pylint: disable=g-import-not-at-top
from tfdpx import band_selection  # pylint: disable=g-import-not-at-top
from tfdpx import correlation  # pylint: disable=g-import-not-at-top
from tfdpx import privatizers  # pylint: disable=g-import-not-at-top

flags.DEFINE_string('out', None, 'Also write the table to this file.')
FLAGS = flags.FLAGS

DELTA = 1e-5
BANDS = (2, 4, 8, 16, 32)
# n, expected batch, epochs, target epsilon.
SETTINGS = [
    (3200, 500, 30, 3.0),
    (3200, 64, 30, 1.0),
    (3200, 64, 30, 3.0),
    (3200, 64, 30, 8.0),
    (50000, 256, 20, 1.0),
    (50000, 500, 100, 8.0),
    (50000, 256, 1, 3.0),
    (50000, 256, 1, 8.0),
    (3200, 32, 1, 1.0),
    (3200, 32, 1, 3.0),
    (3200, 32, 1, 8.0),
]
BUFFERS = 2


def row(n, batch, epochs, epsilon):
  """The table row of one setting."""
  steps = epochs * math.ceil(n / batch)
  gaussian = privatizers.gaussian(1.0, 1.0)
  setting = dict(target_epsilon=epsilon, examples=n, batch_size=batch,
                 epochs=epochs, delta=DELTA)
  noise = band_selection.trajectory_noise_by_bands(
      gaussian, max_bands=max(BANDS), **setting)
  z = noise[1] / correlation.banded_toeplitz(1, steps).prefix_sum_error(steps)
  cells = []
  for bands in BANDS:
    if bands not in noise:  # A group smaller than the batch.
      cells.append('')
      continue
    z_b = noise[bands] / correlation.banded_toeplitz(
        bands, steps).prefix_sum_error(steps)
    cells.append(f'{noise[bands] / noise[1]:.3f} (z {z_b:.2f})')
  blt = privatizers.correlated(gaussian, correlation.blt(
      BUFFERS, steps, steps_per_epoch=math.ceil(n / batch)))
  z_blt = accounting.calibrate_noise_multiplier(
      epsilon, blt, steps=steps, delta=DELTA,
      steps_per_epoch=math.ceil(n / batch))
  error = z_blt * blt.correlation.prefix_sum_error(steps) / noise[1]
  cells.append(f'{error:.3f} (z {z_blt:.2f})')
  return (f'| {n} | {batch} | {epochs} | {steps} | {epsilon:g} | {z:.2f} | ' +
          ' | '.join(cells) + ' |')


def main(argv):
  del argv
  lines = [
      '| n | B | epochs | steps | ε | DP-SGD z | ' +
      ' | '.join(f'b = {b}' for b in BANDS) + f' | BLT, {BUFFERS} buffers |',
      '|' + '---:|' * (7 + len(BANDS)),
  ]
  for setting in SETTINGS:
    lines.append(row(*setting))
    print(lines[-1], flush=True)
  table = '\n'.join(lines)
  print(table)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      f.write(f'`python -m benchmarks.correlated_error` (delta {DELTA:g}; '
              'relative trajectory noise, and the noise multiplier)\n\n')
      f.write(table + '\n')


if __name__ == '__main__':
  app.run(main)
