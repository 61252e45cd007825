"""Is `sparse_embeddings`' loss with Adam its lazy moments? An experiment.

`python -m benchmarks.sparse_adam_moments` runs the recommendation utility
config (`benchmarks/configs/sparse_embeddings_recommendation.json`: dense
DP-SGD and `sparse_embeddings` at its defaults, Adam, epsilon 3, the
learning rate tuned on one grid, 3 seeds) twice for `sparse_embeddings`:
as released (`tf.IndexedSlices`: the DP optimizer's lazy update of the
selected rows) and with the release made dense before the optimizer (the
same rows, noise and values; Keras's Adam then decays every row's moments
and moves every row along them each step, as dense DP-SGD's Adam does). It
prints the three tables. Not a way to train: the dense update writes every
row of every table each step.
"""

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

# pylint: disable=wrong-import-position
import tensorflow as tf

from benchmarks import utility

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs',
                      'sparse_embeddings_recommendation.json')
DENSE, SPARSE = 'DP-SGD (dense)', 'sparse_embeddings, defaults'


def _dense_releases():
  """`SparseEmbeddings.release` with its tables' slices made dense."""
  module = importlib.import_module('tfdpx.privatizers.sparse_embeddings')
  release = module.SparseEmbeddings.release

  def dense_release(self, *args, **kwargs):
    noisy_sum, state = release(self, *args, **kwargs)
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
            for g in noisy_sum], state

  module.SparseEmbeddings.release = dense_release


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.parse_args(argv)
  config = utility.load(CONFIG)
  methods = config['methods']
  command = '`python -m benchmarks.sparse_adam_moments`'
  for title, kept in (('dense DP-SGD', DENSE), ('lazy moments', SPARSE)):
    config['methods'] = {kept: methods[kept]}
    print(f'{title}:\n{utility.table(config, utility.run(config), command)}\n')
  _dense_releases()
  config['methods'] = {f'{SPARSE}, dense moments': methods[SPARSE]}
  print('dense moments (the release made dense before Adam):\n'
        f'{utility.table(config, utility.run(config), command)}')


if __name__ == '__main__':
  main()
