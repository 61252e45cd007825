"""Step time and peak memory of private training, as a ratio to plain Keras.

`make bench` (`python -m benchmarks.speed`) measures, for each model and
batch size, the seconds per training step of a plain Keras `fit` (the
non-private baseline) and of each private configuration of the same model on
the same data: tfdpx's `make_private` with every privatizer (without and,
for `--xla_models`, with `jit_compile`) and, for Sequential models,
tensorflow-privacy's `DPSequential`. The protocol:

- every configuration is built and warmed up by one whole `fit` call first
  (tracing and compilation are not timed);
- then `--repetitions` rounds, each timing one whole `fit` call of
  `--steps` steps per configuration, round-robin, so that load on the machine
  hits every configuration alike; no callbacks, `verbose=0`, the same
  pre-made batches for every configuration (see `batches`);
- a configuration's figure is its fastest round divided by the number of
  steps, and its ratio is that over the non-private figure of the same model
  and batch from the same run.

Peak memory (`--memory`) is the maximum resident set (VmHWM) of a fresh
process that trains one configuration for a few steps at batch 1024.
"""

import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

import tfdpx
from tfdpx import privatizers
from tfdpx.keras.stack import KERAS_3

# pylint: disable=g-import-not-at-top
if not KERAS_3:  # tensorflow-privacy exists on the Keras 2 stack only.
  from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
  from tensorflow_privacy.privacy.keras_models import dp_keras_model
# pylint: enable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['cnn', 'mlp', 'text', 'transformer', 'cifar_cnn'],
                  'Models to time.')
flags.DEFINE_list('batches', ['256'], 'Batch sizes.')
flags.DEFINE_integer('steps', 8, 'Steps per timed fit call.')
flags.DEFINE_integer('repetitions', 5, 'Timed rounds; the fastest counts.')
flags.DEFINE_list('privatizers', None,
                  'Privatizers run via make_private (default: all).')
flags.DEFINE_list(
    'xla_models', ['cnn', 'mlp', 'text', 'transformer'],
    'Models whose privatizers are also timed with jit_compile. Not the CIFAR '
    'CNN by default: under XLA on a CPU its steps take seconds (7 s at batch '
    '256 on the 2-core machine), so its rounds alone would take half an hour.')
flags.DEFINE_list('memory_models', ['cnn', 'text'],
                  'Models whose peak memory at batch 1024 is measured.')
flags.DEFINE_bool('memory', True, 'Measure peak memory.')
flags.DEFINE_string('out', None, 'Also write the tables to this file.')
flags.DEFINE_string(
    'virtual_batches', None,
    '"model,logical,physical" (e.g. "cnn,4096,256"): instead of the tables '
    'above, peak memory and time per example of virtual batches: each '
    'privatizer of --privatizers at batch `physical`, at batch `logical` '
    'whole, and at `logical` in physical batches of `physical`.')
flags.DEFINE_string('memory_probe', None,
                    'Internal: "model,batch,config": train a few steps in '
                    'this process and print its peak resident set in MiB.')

L = tf.keras.layers
VOCAB, TOKENS = 20000, 128
NUM_PUBLIC = 256  # GEP's public examples, whose gradients every step forms.

# Clip norm 1 and noise multiplier 1 for all (D2P2: automatic clipping, its
# default SRHT projection). `sparsified` draws one mask per window (here
# 1000 steps, as for an epoch of 1000 steps); a step's work does not depend
# on how many coordinates the mask keeps.
PRIVATIZERS = {
    'gaussian': lambda: privatizers.gaussian(1.0, 1.0),
    'dpdr': lambda: privatizers.dpdr(1.0, 1.0),
    'sparsified': lambda: privatizers.sparsified(
        privatizers.gaussian(1.0, 1.0), 0.9, epochs=2, steps_per_epoch=1000),
    'd2p2': lambda: privatizers.d2p2(1.0),
    'gep': lambda: privatizers.gep(50, 1.0, 1.0, 1.0),
    'geodp': lambda: privatizers.geodp(1.0, 1.0),
}


# --- models --------------------------------------------------------------------


def tutorial_cnn():
  """tensorflow-privacy's MNIST tutorial CNN (26k parameters)."""
  return tf.keras.Sequential([
      tf.keras.Input((28, 28, 1)),
      L.Conv2D(16, 8, strides=2, padding='same', activation='relu'),
      L.MaxPool2D(2, 1),
      L.Conv2D(32, 4, strides=2, padding='valid', activation='relu'),
      L.MaxPool2D(2, 1),
      L.Flatten(),
      L.Dense(32, activation='relu'),
      L.Dense(10),
  ])


def mlp():
  """784-128-128-10 (118k parameters)."""
  return tf.keras.Sequential([
      tf.keras.Input((784,)),
      L.Dense(128, activation='relu'),
      L.Dense(128, activation='relu'),
      L.Dense(10),
  ])


def text():
  """Embedding(20000, 64) over 128 tokens, pooled, two Dense (1.3M)."""
  return tf.keras.Sequential([
      tf.keras.Input((TOKENS,), dtype='int32'),
      L.Embedding(VOCAB, 64),
      L.GlobalAveragePooling1D(),
      L.Dense(64, activation='relu'),
      L.Dense(2),
  ])


class _Positions(L.Layer):
  """Adds a learned embedding of each position to the token embeddings."""

  def build(self, input_shape):
    self.positions = L.Embedding(input_shape[1], input_shape[2])
    super().build(input_shape)

  def call(self, inputs):
    return inputs + self.positions(tf.range(tf.shape(inputs)[1]))


def transformer():
  """One transformer block over 128 tokens (Embedding(20000, 64))."""
  tokens = tf.keras.Input((TOKENS,), dtype='int32')
  x = _Positions()(L.Embedding(VOCAB, 64)(tokens))
  x = L.LayerNormalization()(x + L.MultiHeadAttention(4, 16)(x, x))
  feed_forward = L.Dense(64)(L.Dense(128, activation='relu')(x))
  x = L.LayerNormalization()(x + feed_forward)
  return tf.keras.Model(tokens, L.Dense(2)(L.GlobalAveragePooling1D()(x)))


def cifar_cnn():
  """A CIFAR-10 CNN: four 3x3 convolutions, two Dense (0.36M parameters)."""
  return tf.keras.Sequential([
      tf.keras.Input((32, 32, 3)),
      L.Conv2D(32, 3, padding='same', activation='relu'),
      L.Conv2D(32, 3, activation='relu'),
      L.MaxPool2D(),
      L.Conv2D(64, 3, padding='same', activation='relu'),
      L.Conv2D(64, 3, activation='relu'),
      L.MaxPool2D(),
      L.Flatten(),
      L.Dense(128, activation='relu'),
      L.Dense(10),
  ])


# name -> (builder, one random input batch of n rows, number of classes).
MODELS = {
    'cnn': (tutorial_cnn,
            lambda rng, n: rng.uniform(size=(n, 28, 28, 1)), 10),
    'mlp': (mlp, lambda rng, n: rng.uniform(size=(n, 784)), 10),
    'text': (text, lambda rng, n: rng.integers(0, VOCAB, (n, TOKENS)), 2),
    'transformer': (transformer,
                    lambda rng, n: rng.integers(0, VOCAB, (n, TOKENS)), 2),
    'cifar_cnn': (cifar_cnn,
                  lambda rng, n: rng.uniform(size=(n, 32, 32, 3)), 10),
}


def data(model_name, rows, seed=0):
  """Random inputs and labels: speed does not depend on the values."""
  _, inputs, classes = MODELS[model_name]
  rng = np.random.default_rng(seed)
  x = inputs(rng, rows)
  x = x.astype('int32' if x.dtype.kind == 'i' else 'float32')
  return x, rng.integers(0, classes, size=(rows,))


# --- configurations ------------------------------------------------------------


def _loss(reduction='none'):
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=reduction)


def configs(model_name):
  names = ['non-private']
  for name in FLAGS.privatizers or PRIVATIZERS:
    names.append(f'tfdpx {name}')
    if model_name in FLAGS.xla_models:
      names.append(f'tfdpx {name} xla')
  if not KERAS_3 and isinstance(MODELS[model_name][0](), tf.keras.Sequential):
    names.append('tf-privacy DPSequential')
  return names


def build(model_name, batch, config):
  """The compiled model of one configuration."""
  make = MODELS[model_name][0]
  if config == 'non-private':
    model = make()
    model.compile(tf.keras.optimizers.SGD(0.1), _loss('sum_over_batch_size'))
  elif config == 'tf-privacy DPSequential':
    model = dp_keras_model.DPSequential(
        l2_norm_clip=1.0, noise_multiplier=1.0,
        layer_registry=layer_registry.make_default_layer_registry(),
        layers=make().layers)
    model.compile(tf.keras.optimizers.SGD(0.1), _loss('sum_over_batch_size'))
  else:
    _, name, *options = config.split()
    privatizer = PRIVATIZERS[name]()
    public_data = (data(model_name, NUM_PUBLIC, seed=1)
                   if privatizer.requires_public_grads else None)
    physical = [int(o.partition('=')[2]) for o in options
                if o.startswith('physical=')]
    model = tfdpx.keras.make_private(
        make(), public_data=public_data,
        physical_batch_size=physical[0] if physical else None)
    model.compile(
        tfdpx.keras.DPSGD(privatizer=privatizer, expected_batch_size=batch,
                          learning_rate=0.1),
        _loss(), jit_compile='xla' in options)
  return model


def batches(model_name, batch, steps):
  """`steps` batches of random data, the same input for every configuration.

  The batches are made up front and tf.data's autotuning is off. With it on,
  the iterator that ends each `fit` call sometimes waits for the autotuning
  thread's next timed wake-up (its period doubles from 10 ms) instead of being
  woken at once: the call then ends at a fixed time, e.g. 5.1 s after it
  started, whatever the steps cost. This was the "slow mode" of earlier runs
  (about 645 ms per step for 8 steps of any configuration that took 2.6 to
  5.1 s); it is not part of a training step.
  """
  x, y = data(model_name, batch * steps)
  dataset = tf.data.Dataset.from_tensor_slices(
      (x.reshape((steps, batch) + x.shape[1:]), y.reshape((steps, batch))))
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.prefetch(2).with_options(options)


def _fit_seconds(model, dataset):
  start = time.perf_counter()
  model.fit(dataset, epochs=1, verbose=0)
  return time.perf_counter() - start


def time_model(model_name, batch):
  """{config: seconds per step}, interleaved round-robin in this process."""
  dataset = batches(model_name, batch, FLAGS.steps)
  models = {}
  for config in configs(model_name):
    models[config] = build(model_name, batch, config)
    _fit_seconds(models[config], dataset)  # Traces and compiles.
  best = {config: float('inf') for config in models}
  for _ in range(FLAGS.repetitions):
    for config, model in models.items():
      best[config] = min(best[config], _fit_seconds(model, dataset))
  return {config: seconds / FLAGS.steps for config, seconds in best.items()}


# --- memory --------------------------------------------------------------------


def peak_rss_mib(model_name, batch, config):
  """Peak resident set of a fresh process training `config`, in MiB."""
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.speed',
       f'--memory_probe={model_name},{batch},{config}'],
      capture_output=True, text=True, check=True)
  return float(result.stdout.strip().splitlines()[-1])


def _probe():
  model_name, batch, config = FLAGS.memory_probe.split(',')
  batch = int(batch)
  _fit_seconds(build(model_name, batch, config), batches(model_name, batch, 3))
  # VmHWM: this process image's own high-water mark.
  with open('/proc/self/status') as status:
    kib = next(int(line.split()[1]) for line in status
               if line.startswith('VmHWM:'))
  print(kib / 1024)


def virtual_batch_rows(model_name, logical, physical):
  """Table rows of `--virtual_batches`: peak memory and ms per example."""
  rows = []
  for name in FLAGS.privatizers or PRIVATIZERS:
    runs = [(physical, f'tfdpx {name}'), (logical, f'tfdpx {name}'),
            (logical, f'tfdpx {name} physical={physical}')]
    mib = [peak_rss_mib(model_name, batch, config) for batch, config in runs]
    # Timed interleaved in this process, as `time_model`.
    models = [build(model_name, batch, config) for batch, config in runs]
    datasets = [batches(model_name, batch, FLAGS.steps) for batch, _ in runs]
    for model, dataset in zip(models, datasets):
      _fit_seconds(model, dataset)
    best = [float('inf')] * len(runs)
    for _ in range(FLAGS.repetitions):
      for i, (model, dataset) in enumerate(zip(models, datasets)):
        best[i] = min(best[i], _fit_seconds(model, dataset))
    for (batch, config), peak, seconds in zip(runs, mib, best):
      per_example = 1000 * seconds / (FLAGS.steps * batch)
      rows.append(f'| {model_name} | {batch} | {config} | {peak:.0f} | '
                  f'{peak / mib[0]:.2f} | {per_example:.3f} | '
                  f'{per_example / (1000 * best[0] / (FLAGS.steps * physical)):.2f} |')
    tf.keras.backend.clear_session()
  return rows


def main(argv):
  del argv
  tf.get_logger().setLevel('ERROR')
  if FLAGS.memory_probe:
    _probe()
    return
  lines = []

  def emit(line=''):
    print(line, flush=True)
    lines.append(line)

  if FLAGS.virtual_batches:
    model_name, logical, physical = FLAGS.virtual_batches.split(',')
    emit(f'# tfdpx virtual batches, {time.strftime("%Y-%m-%d %H:%M UTC")}, '
         f'TensorFlow {tf.__version__}, steps {FLAGS.steps}, repetitions '
         f'{FLAGS.repetitions}')
    emit()
    emit('| model | batch | configuration | peak MiB | x first row | '
         'ms/example | x first row |')
    emit('|---|---:|---|---:|---:|---:|---:|')
    for row in virtual_batch_rows(model_name, int(logical), int(physical)):
      emit(row)
  else:
    speed_and_memory_tables(emit)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as out:
      out.write('\n'.join(lines) + '\n')


def speed_and_memory_tables(emit):
  """The tables of `make bench`."""
  emit(f'# tfdpx speed benchmark, {time.strftime("%Y-%m-%d %H:%M UTC")}, '
       f'TensorFlow {tf.__version__}, Keras {tf.keras.version() if KERAS_3 else 2}, '
       f'steps {FLAGS.steps}, repetitions {FLAGS.repetitions}')
  emit()
  emit('| model | batch | configuration | ms/step | x non-private |')
  emit('|---|---:|---|---:|---:|')
  for model_name in FLAGS.models:
    for batch in map(int, FLAGS.batches):
      seconds = time_model(model_name, batch)
      baseline = seconds['non-private']
      for config, value in seconds.items():
        emit(f'| {model_name} | {batch} | {config} | {1000 * value:.1f} | '
             f'{value / baseline:.1f} |')
      tf.keras.backend.clear_session()
  if FLAGS.memory:
    emit()
    emit('| model | configuration | peak MiB, batch 1024 | x non-private |')
    emit('|---|---|---:|---:|')
    for model_name in FLAGS.memory_models:
      baseline = None
      for config in configs(model_name):
        if config.endswith(' xla'):
          continue
        mib = peak_rss_mib(model_name, 1024, config)
        baseline = baseline or mib
        emit(f'| {model_name} | {config} | {mib:.0f} | {mib / baseline:.2f} |')


if __name__ == '__main__':
  app.run(main)
