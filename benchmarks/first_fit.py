"""The first `fit` of a model made private: seconds, and traces of its step.

A model made private creates its optimizer's variables and noise key before
Keras traces the step (`make_train_function`); created in the first trace
instead, they make tf.function trace the step a second time.
`--variables_in_trace` takes that away, as before it. Each configuration in a
fresh process, since TensorFlow caches what it traced:

  python -m benchmarks.first_fit --model=cnn
  python -m benchmarks.first_fit --model=cnn --variables_in_trace
"""

import time

from absl import app
from absl import flags
import tensorflow as tf

from benchmarks import models
from benchmarks import speed

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'cnn', 'A model of benchmarks/models.py.')
flags.DEFINE_integer('batch', 32, 'Batch size.')
flags.DEFINE_bool('variables_in_trace', False,
                  'Leave the optimizer\'s variables to the first trace.')


def main(argv):
  del argv
  tf.keras.utils.set_random_seed(0)
  model = speed.build(FLAGS.model, FLAGS.batch, 'tfdpx gaussian')
  if FLAGS.variables_in_trace:
    model.optimizer.create_variables = lambda var_list: None
  traces = []
  step = model.train_step
  model.train_step = lambda data: traces.append(1) or step(data)
  x, y = models.data(FLAGS.model, 2 * FLAGS.batch)
  data = tf.data.Dataset.from_tensor_slices((x, y)).batch(FLAGS.batch)
  start = time.perf_counter()
  model.fit(data, epochs=1, verbose=0)
  seconds = time.perf_counter() - start
  where = 'in the first trace' if FLAGS.variables_in_trace else 'before'
  print(f'{FLAGS.model}: first fit (2 steps) {seconds:.2f} s, {len(traces)} '
        f'trace(s) of the step (optimizer variables created {where}; '
        f'TensorFlow {tf.__version__})')


if __name__ == '__main__':
  app.run(main)
