"""Seconds per training step and peak memory: tfdpx against the alternatives.

`make bench` (`python -m benchmarks.speed`) times, in one process, for the
tensorflow-privacy MNIST tutorial CNN and an MLP at several batch sizes:
non-private Keras `fit`; tfdpx via `make_private` (each privatizer, with and
without `jit_compile`; DP-SGD also with fast clipping off, `materialized`, and
with the vectorized fallback only); tfdpx through
the compile path (`tape.jacobian`); tensorflow-privacy's `DPSequential` and its
`VectorizedDPKerasSGDOptimizer` through `fit`. The quadratic paths are timed
for a few steps only and skipped above `--max_quadratic_batch`. Each figure is
the median wall time of a training step after warm-up, and the ratio to the
non-private step of the same model and batch.

Peak memory is the maximum resident set of a fresh process that trains a few
steps of one configuration (`--memory`), so one figure does not hide another.
"""

import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf
from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
from tensorflow_privacy.privacy.keras_models import dp_keras_model
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized as tfp_vectorized

import tfdpx
from tfdpx import privatizers
from tfdpx.privatizers import gaussian

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['cnn', 'mlp'], 'Models to time.')
flags.DEFINE_list('batches', ['64', '256', '1024'], 'Batch sizes.')
flags.DEFINE_integer('steps', 8, 'Timed steps per configuration.')
flags.DEFINE_integer('quadratic_steps', 2,
                     'Timed steps for the O(batch^2) jacobian paths.')
flags.DEFINE_integer('max_quadratic_batch', 256,
                     'Largest batch for the O(batch^2) jacobian paths.')
flags.DEFINE_integer('chunk_size', 128, 'make_private chunk_size.')
flags.DEFINE_list('privatizers', None,
                  'Privatizers timed via make_private (default: all).')
flags.DEFINE_bool('memory', True, 'Also measure peak memory per process.')
flags.DEFINE_string('memory_probe', None,
                    'Internal: "model,batch,config": train a few steps and '
                    'print the peak resident set in MiB.')

L = tf.keras.layers
NUM_CLASSES = 10
NUM_PUBLIC = 256  # GEP's public examples, whose gradients each step computes.
# Every privatizer at clip norm 1 and noise multiplier 1 (D2P2: automatic
# clipping, SRHT projection; its default Gaussian projection draws O(d p)
# normals per step, see docs/d2p2.md).
PRIVATIZERS = {
    'gaussian': lambda: gaussian(1.0, 1.0),
    # Two one-step epochs: every step after the first keeps 10% of the
    # coordinates.
    'sparsified': lambda: privatizers.sparsified(gaussian(1.0, 1.0), 0.9, 2, 1),
    'dpdr': lambda: privatizers.dpdr(1.0, 1.0),
    'd2p2_srht': lambda: privatizers.d2p2(1.0, projection='srht'),
    'gep': lambda: privatizers.gep(50, 1.0, 1.0, 1.0),
    'geodp': lambda: privatizers.geodp(1.0, 1.0),
}


def tutorial_cnn():
  """tensorflow-privacy's MNIST tutorial CNN (26k parameters)."""
  return [
      tf.keras.Input((28, 28, 1)),
      L.Conv2D(16, 8, strides=2, padding='same', activation='relu'),
      L.MaxPool2D(2, 1),
      L.Conv2D(32, 4, strides=2, padding='valid', activation='relu'),
      L.MaxPool2D(2, 1),
      L.Flatten(),
      L.Dense(32, activation='relu'),
      L.Dense(NUM_CLASSES),
  ]


def mlp():
  return [
      tf.keras.Input((28, 28, 1)),
      L.Flatten(),
      L.Dense(128, activation='relu'),
      L.Dense(128, activation='relu'),
      L.Dense(NUM_CLASSES),
  ]


MODELS = {'cnn': tutorial_cnn, 'mlp': mlp}


def _loss(reduction=tf.keras.losses.Reduction.NONE):
  return tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction=reduction)


def _data(batch, steps):
  rng = np.random.default_rng(0)
  n = batch * steps
  x = rng.uniform(size=(n, 28, 28, 1)).astype('float32')
  y = rng.integers(0, NUM_CLASSES, size=(n,))
  return x, y


def _dp_sgd(batch, privatizer):
  return tfdpx.keras.DPSGD(privatizer=privatizer, expected_batch_size=batch,
                           learning_rate=0.1)


def build(model_name, batch, config):
  """A compiled model for one configuration of the table."""
  layers = MODELS[model_name]
  sgd = tf.keras.optimizers.legacy.SGD(0.1)
  if config == 'non-private':
    model = tf.keras.Sequential(layers())
    model.compile(sgd, _loss('sum_over_batch_size'))
  elif config == 'tfdpx compile path':
    model = tf.keras.Sequential(layers())
    model.compile(_dp_sgd(batch, gaussian(1.0, 1.0)), _loss())
  elif config.startswith('tfdpx '):
    _, name, *options = config.split()
    privatizer = PRIVATIZERS[name]()
    public_data = None
    if privatizer.requires_public_grads:
      public_data = _data(NUM_PUBLIC, 1)
    model = tfdpx.keras.make_private(
        tf.keras.Sequential(layers()), chunk_size=FLAGS.chunk_size,
        public_data=public_data, use_layer_rules='fallback' not in options,
        fast_clipping='materialized' not in options)
    model.compile(_dp_sgd(batch, privatizer), _loss(),
                  jit_compile='xla' in options)
  elif config == 'tf-privacy DPSequential':
    model = dp_keras_model.DPSequential(
        l2_norm_clip=1.0, noise_multiplier=1.0,
        layer_registry=layer_registry.make_default_layer_registry(),
        layers=layers())
    model.compile(sgd, _loss('sum_over_batch_size'))
  elif config == 'tf-privacy vectorized':
    model = tf.keras.Sequential(layers())
    model.compile(
        tfp_vectorized.VectorizedDPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
        _loss())
  else:
    raise ValueError(f'unknown configuration {config!r}')
  return model


def configs():
  names = ['non-private']
  for name in FLAGS.privatizers or PRIVATIZERS:
    names += [f'tfdpx {name}', f'tfdpx {name} xla']
  names += ['tfdpx gaussian materialized', 'tfdpx gaussian fallback',
            'tfdpx compile path', 'tf-privacy DPSequential',
            'tf-privacy vectorized']
  return names


def quadratic(config):
  return config in ('tfdpx compile path', 'tf-privacy vectorized')


class _StepTimer(tf.keras.callbacks.Callback):

  def __init__(self):
    super().__init__()
    self.ends = []

  def on_train_batch_end(self, batch, logs=None):
    float(logs['loss'])  # Waits for the step to finish.
    self.ends.append(time.perf_counter())


def seconds_per_step(model, batch, steps):
  """Median seconds of the steps after the first (which traces)."""
  x, y = _data(batch, steps + 2)
  timer = _StepTimer()
  model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
            callbacks=[timer])
  return statistics.median(np.diff(timer.ends[1:]))


def peak_rss_mib(model_name, batch, config):
  """Peak resident set of a fresh process training `config`, in MiB."""
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.speed',
       f'--memory_probe={model_name},{batch},{config}',
       f'--chunk_size={FLAGS.chunk_size}'],
      capture_output=True, text=True, check=True)
  return float(result.stdout.strip().splitlines()[-1])


def _probe():
  model_name, batch, config = FLAGS.memory_probe.split(',')
  batch = int(batch)
  seconds_per_step(build(model_name, batch, config), batch, 3)
  # VmHWM, not getrusage: after fork and exec, ru_maxrss keeps the parent's
  # high-water mark; VmHWM belongs to this process image only.
  with open('/proc/self/status') as status:
    kib = next(int(line.split()[1]) for line in status
               if line.startswith('VmHWM:'))
  print(kib / 1024)


def main(argv):
  del argv
  tf.get_logger().setLevel('ERROR')
  if FLAGS.memory_probe:
    _probe()
    return
  print(f'# tfdpx speed benchmark, {time.strftime("%Y-%m-%d %H:%M")}, '
        f'TensorFlow {tf.__version__}, {len(tf.config.list_logical_devices("CPU"))} '
        f'CPU device(s), chunk_size {FLAGS.chunk_size}')
  print('| model | batch | configuration | s/step | x non-private |')
  print('|---|---:|---|---:|---:|')
  for model_name in FLAGS.models:
    for batch in map(int, FLAGS.batches):
      baseline = None
      for config in configs():
        if quadratic(config) and batch > FLAGS.max_quadratic_batch:
          continue
        steps = FLAGS.quadratic_steps if quadratic(config) else FLAGS.steps
        seconds = seconds_per_step(build(model_name, batch, config), batch,
                                   steps)
        baseline = baseline or seconds
        print(f'| {model_name} | {batch} | {config} | {seconds:.4f} | '
              f'{seconds / baseline:.1f} |', flush=True)
        tf.keras.backend.clear_session()
  if FLAGS.memory:
    print('\n| model | configuration | batch 128 MiB | batch 1024 MiB | '
          'ratio |')
    print('|---|---|---:|---:|---:|')
    for config in ('non-private', 'tfdpx gaussian',
                   'tfdpx gaussian materialized', 'tfdpx dpdr'):
      small, large = (peak_rss_mib('cnn', b, config) for b in (128, 1024))
      print(f'| cnn | {config} | {small:.0f} | {large:.0f} | '
            f'{large / small:.2f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
