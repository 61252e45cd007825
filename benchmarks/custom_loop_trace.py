"""The first trace of a private step in a `tf.function` of the user's.

A user's own loop over a private model's `train_step` (or over the engine, or
a privatizer's `update`) traces tfdpx under AutoGraph. tfdpx keeps its code
out of AutoGraph's conversion (tfdpx/autograph.py); `--converted` takes that
rule away, as before it. Each configuration in a fresh process, since
AutoGraph caches what it converted:

  python -m benchmarks.custom_loop_trace --model=cnn
  python -m benchmarks.custom_loop_trace --model=cnn --converted
"""

import time

from absl import app
from absl import flags
import tensorflow as tf
from tensorflow.python.autograph.core import config as autograph_config  # pylint: disable=g-direct-tensorflow-import

import tfdpx
from benchmarks import models
from benchmarks import speed

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'cnn', 'A model of benchmarks/models.py.')
flags.DEFINE_integer('batch', 256, 'Expected batch size.')
flags.DEFINE_bool('converted', False,
                  'Let AutoGraph convert tfdpx, as before tfdpx/autograph.py.')


def main(argv):
  del argv
  if FLAGS.converted:
    autograph_config.CONVERSION_RULES = tuple(
        rule for rule in autograph_config.CONVERSION_RULES
        if not rule.matches(tfdpx.autograph.MODULE))
  tf.keras.utils.set_random_seed(0)
  model = speed.build(FLAGS.model, FLAGS.batch, 'tfdpx gaussian')
  x, y = models.data(FLAGS.model, 2)
  model.train_on_batch(x, y)  # Builds the variables; `fit`'s own trace.
  spec = (tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype)),
          tf.TensorSpec([None], tf.as_dtype(y.dtype)))
  start = time.perf_counter()
  graph = tf.function(model.train_step).get_concrete_function(spec).graph
  seconds = time.perf_counter() - start
  how = 'converted' if FLAGS.converted else 'as written'
  print(f'{FLAGS.model}: first trace of tf.function(train_step) '
        f'{seconds:.2f} s, {len(graph.as_graph_def().node)} nodes (tfdpx {how}; '
        f'TensorFlow {tf.__version__})')


if __name__ == '__main__':
  app.run(main)
