"""A user's first epoch, tracing included: DP-SGD against plain Keras.

What a new user waits for on the first `fit`: building the model,
`make_private`, compiling and one epoch (every trace and compilation in it),
interleaved with the plain model in one process, then a second epoch (steady
state). `fit(x, y, batch_size=B)`, numpy input.

  python -m benchmarks.first_epoch --model=bilstm --examples=256 --batch=32
"""

import time

from absl import app
from absl import flags
import tensorflow as tf

import tfdpx
from benchmarks import models

FLAGS = flags.FLAGS
flags.DEFINE_string('model', 'bilstm', 'A model of benchmarks/models.py.')
flags.DEFINE_integer('examples', 256, 'Examples in the epoch.')
flags.DEFINE_integer('batch', 32, 'Batch size.')
flags.DEFINE_integer('repetitions', 2, 'Rounds; the fastest counts.')


def _epochs(private):
  """Seconds of (set-up and first epoch, second epoch)."""
  tf.keras.backend.clear_session()
  x, y = models.data(FLAGS.model, FLAGS.examples)
  start = time.perf_counter()
  model = models.MODELS[FLAGS.model][0]()
  loss = tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction='none' if private else 'sum_over_batch_size')
  if private:
    model = tfdpx.keras.make_private(model)
    optimizer = tfdpx.keras.DPSGD(
        privatizer=tfdpx.privatizers.gaussian(1.0, 1.0),
        expected_batch_size=FLAGS.batch, learning_rate=0.1)
  else:
    optimizer = tf.keras.optimizers.SGD(0.1)
  model.compile(optimizer, loss)
  model.fit(x, y, batch_size=FLAGS.batch, epochs=1, verbose=0)
  first = time.perf_counter() - start
  start = time.perf_counter()
  model.fit(x, y, batch_size=FLAGS.batch, epochs=1, verbose=0)
  return first, time.perf_counter() - start


def main(argv):
  del argv
  times = {False: [], True: []}
  for _ in range(FLAGS.repetitions):
    for private in (False, True):
      times[private].append(_epochs(private))
  plain, dp = (min(times[p]) for p in (False, True))
  second_plain, second_dp = (min(t[1] for t in times[p]) for p in (False, True))
  print(f'{FLAGS.model}, {FLAGS.examples} examples, batch {FLAGS.batch}, '
        f'TensorFlow {tf.__version__}')
  print(f'first epoch (set-up and tracing included): plain {plain[0]:.1f} s, '
        f'DP-SGD {dp[0]:.1f} s, {dp[0] / plain[0]:.1f}x')
  print(f'second epoch: plain {second_plain:.2f} s, DP-SGD {second_dp:.2f} s, '
        f'{second_dp / second_plain:.1f}x')


if __name__ == '__main__':
  app.run(main)
