"""Step time and peak memory of private training, as a ratio to plain Keras.

`make bench` (`python -m benchmarks.speed`) measures, for each model, batch
size and input pipeline, the seconds per training step of a plain Keras
`fit` (the non-private baseline) and of each private configuration of the
same model on the same input pipeline: tfdpx's `make_private` with every
privatizer (without and, for `--xla_models`, with `jit_compile`) and, for
Sequential models, tensorflow-privacy's `DPSequential`.

The input pipelines (`--pipeline`) are those users write:

- `numpy`: `fit(x, y, batch_size=B)` (Keras's array adapter);
- `tfdata`: `tf.data.Dataset.from_tensor_slices((x, y)).batch(B)`, whose
  batch dimension is unknown (`None`) when `fit` traces the step;
- `tfdata_drop`: the same with `drop_remainder=True` (a static batch);
- `poisson`: `tfdpx.sampling.poisson_batches` at `q = B / n` (padded to one
  static shape, with sample weights).

The non-private baseline is the fastest plain Keras set-up of the model: on
Keras 2 the faster of `tf.keras.optimizers.SGD` and `legacy.SGD` (the new
optimizer's sparse Embedding update is up to 2 times slower), on Keras 3
`SGD`. The protocol:

- every configuration is built and warmed up by one whole `fit` call first
  (tracing and compilation are not timed);
- then `--repetitions` rounds, each timing one whole `fit` call of
  `--steps` steps per configuration and pipeline, round-robin over all the
  pipelines of the model, so that load on the machine hits every
  configuration and pipeline alike; no callbacks, `verbose=0`, the same data
  and pipeline for every configuration (see `pipeline_feed`);
- a configuration's figure is its fastest round divided by the number of
  steps, and its ratio is that over the baseline of the same model, batch
  and pipeline from the same run.

A dense release draws a Gaussian for every trainable coordinate; after the
speed table, each model's row gives the time of that many draws by tfdpx's
sampler (`tfdpx.noise.standard_normal`, tails to 8.6 standard deviations)
and by TensorFlow's `stateless_normal` (float32: none past 5.7), and
DP-SGD's step net of its draws over the plain step (`draws_rows`).

GEP is also measured against the work it must do (issue 56): its step at
batch B (`--gep_rule_batch`, 32) with its A = 256 anchors over DP-SGD's step
at B plus DP-SGD's step at A, the three interleaved in one process
(`gep_rule_row`, models `--gep_rule_models`); with `--memory`, GEP's peak at
batch B over DP-SGD's at B + A (`gep_memory_row`, `--gep_memory`).

The encoder (BERT-mini-like, 5.2M weights) has a protocol of its own
(issue 56): at batch 32 (`--encoder_batch`) a step takes 0.3 to 1.3 s on
the 2-core machines, and 3 steps x 3 rounds swung its ratios by half between
runs. Its table (`encoder_rows`) times `--encoder_steps` (12) steps a fit
call over `--encoder_repetitions` (6) rounds, fed by
`tf.data.Dataset.from_tensor_slices((x, y)).batch(32)` (`--encoder_pipeline`,
autotuning off as for every feed of `pipeline_feed`), and gives beside each
figure its spread: the range of the configuration's per-round ratios, each
round over the baseline's same round (adjacent in time, so that load on the
machine cancels), and every round's step. Not `fit(x, y, batch_size=32)`:
Keras builds that feed's dataset itself with autotuning on, out of reach of
`_without_autotuning`, and two runs on 2026-12-03 disagreed through its
fixed-time fit endings (benchmarks/README.md).

Every results file starts with the machine it ran on (`machine_record`):
figures from different machines are never compared.

Peak memory (`--memory`) is the maximum resident set (VmHWM) of a fresh
process that trains one configuration for a few steps at batch 1024
(`--memory_batch`).
"""

import os
import platform
import subprocess
import sys
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from benchmarks.models import data
from benchmarks.models import MODELS
import tfdpx
from tfdpx import noise
from tfdpx import privatizers
from tfdpx import sampling
from tfdpx.keras.version import KERAS_3

# pylint: disable=g-import-not-at-top
if not KERAS_3:  # tensorflow-privacy exists on the Keras 2 stack only.
  from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
  from tensorflow_privacy.privacy.keras_models import dp_keras_model
# pylint: enable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['cnn', 'mlp', 'text', 'transformer', 'cifar_cnn'],
                  'Models to time.')
flags.DEFINE_list('batches', ['256'], 'Batch sizes.')
PIPELINES = ('numpy', 'tfdata', 'tfdata_drop', 'poisson')
flags.DEFINE_list('pipeline', ['tfdata', 'poisson'],
                  f'Input pipelines, of {", ".join(PIPELINES)}.')
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
                  'Models whose peak memory at --memory_batch is measured.')
flags.DEFINE_integer('memory_batch', 1024,
                     'Batch size of the memory measurements (the encoder: 64).')
flags.DEFINE_bool('memory', True, 'Measure peak memory.')
flags.DEFINE_list(
    'gep_rule_models', ['cnn', 'mlp', 'text', 'encoder', 'cifar_cnn'],
    'Models timed for GEP against its own work (issue 56): GEP at '
    '--gep_rule_batch with its anchors, DP-SGD at that batch and at the '
    'anchors\' count. Empty: none.')
flags.DEFINE_integer('gep_rule_batch', 32, 'Batch B of the GEP rule.')
flags.DEFINE_list(
    'gep_memory', ['cifar_cnn:1024', 'encoder:64'],
    '"model:batch" pairs: GEP\'s peak memory at the batch against DP-SGD\'s '
    'at the batch plus the anchors\' count (with --memory).')
flags.DEFINE_list(
    'encoder_privatizers', ['gaussian', 'dpdr', 'sparsified', 'd2p2', 'geodp'],
    'Privatizers of the encoder\'s table (its protocol, issue 56). Empty: no '
    'such table. GEP is in the GEP rule\'s.')
flags.DEFINE_integer('encoder_batch', 32, 'Batch size of the encoder\'s table.')
flags.DEFINE_integer('encoder_steps', 12,
                     'Steps per timed fit call in the encoder\'s table.')
flags.DEFINE_integer('encoder_repetitions', 6,
                     'Timed rounds of the encoder\'s table.')
flags.DEFINE_string(
    'encoder_pipeline', 'tfdata',
    'Input pipeline of the encoder\'s table. Not numpy: Keras builds that '
    'feed\'s dataset with tf.data\'s autotuning on, whose fixed-time fit '
    'endings made two runs disagree (benchmarks/README.md).')
flags.DEFINE_string('out', None, 'Also write the tables to this file.')
flags.DEFINE_string(
    'virtual_batches', None,
    '"model,logical,physical" (e.g. "cnn,4096,256"): instead of the tables '
    'above, peak memory and time per example of virtual batches: each '
    'privatizer of --privatizers at batch `physical`, at batch `logical` '
    'whole, and at `logical` in physical batches of `physical`.')
flags.DEFINE_string('memory_probe', None,
                    'Internal: "model,batch,config,pipeline": train a few '
                    'steps in this process and print its peak resident set '
                    'in MiB.')

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
    # DP-SGD's noise correlated over 8 steps (banded MF): 7 noise vectors
    # of the model's size kept and read every step.
    'correlated': lambda: privatizers.correlated(
        privatizers.gaussian(1.0, 1.0),
        tfdpx.correlation.banded_toeplitz(8, 1000)),
    # DP-SGD's noise correlated by a BLT of 2 buffers: 2 noise-sized sums
    # kept, read and rewritten every step.
    'blt': lambda: privatizers.correlated(
        privatizers.gaussian(1.0, 1.0), tfdpx.correlation.blt(2, 1000)),
    'd2p2': lambda: privatizers.d2p2(1.0),
    'gep': lambda: privatizers.gep(50, 1.0, 1.0, 1.0),
    # GEP keeping its basis for 10 steps (loses accuracy: docs/gep.md).
    # Timed on request only, with --steps a multiple of 10: every timed fit
    # call then holds one refresh.
    'gep_keep10': lambda: privatizers.gep(50, 1.0, 1.0, 1.0,
                                          basis_refresh_steps=10),
    'geodp': lambda: privatizers.geodp(1.0, 1.0),
    # Noise and updates on the embedding rows selected (its defaults).
    'sparse': lambda: privatizers.sparse_embeddings(
        privatizers.gaussian(1.0, 1.0)),
    # DPDR's decomposition on the rows selected (its defaults: 50 steps).
    'sparse_dpdr': lambda: privatizers.sparse_embeddings(
        privatizers.dpdr(1.0, 1.0)),
    # RS's mask on the rows selected (its mask as `sparsified`'s above).
    'sparse_sparsified': lambda: privatizers.sparsified(
        privatizers.sparse_embeddings(privatizers.gaussian(1.0, 1.0)), 0.9,
        epochs=2, steps_per_epoch=1000),
}
# Those selecting embedding rows: for models with an Embedding, not under XLA.
ROW_PRIVATIZERS = ('sparse', 'sparse_dpdr', 'sparse_sparsified')


# --- configurations ------------------------------------------------------------


def privatizer_names():
  """--privatizers, or every privatizer but gep_keep10."""
  names = FLAGS.privatizers or [n for n in PRIVATIZERS if n != 'gep_keep10']
  if 'gep_keep10' in names and FLAGS.steps % 10:
    raise ValueError('gep_keep10 needs --steps a multiple of 10, so that '
                     'every timed fit call holds one refresh of its basis')
  return names


def _loss(reduction='none'):
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=reduction)


# Plain Keras set-ups; the baseline is the fastest of them.
BASELINES = ('non-private',) if KERAS_3 else ('non-private',
                                              'non-private legacy')


def _has_embedding(model_name):
  return any(isinstance(layer, tf.keras.layers.Embedding)
             for layer in MODELS[model_name][0]()._flatten_layers())  # pylint: disable=protected-access


def configs(model_name):
  names = list(BASELINES)
  for name in privatizer_names():
    if name in ROW_PRIVATIZERS and not _has_embedding(model_name):
      continue
    names.append(f'tfdpx {name}')
    if model_name in FLAGS.xla_models and name not in ROW_PRIVATIZERS:
      names.append(f'tfdpx {name} xla')
  if not KERAS_3 and isinstance(MODELS[model_name][0](), tf.keras.Sequential):
    names.append('tf-privacy DPSequential')
  return names


def build(model_name, batch, config):
  """The compiled model of one configuration."""
  make = MODELS[model_name][0]
  if config in BASELINES:
    model = make()
    sgd = (tf.keras.optimizers.legacy.SGD if config.endswith('legacy') else
           tf.keras.optimizers.SGD)
    model.compile(sgd(0.1), _loss('sum_over_batch_size'))
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


def _without_autotuning(dataset):
  """tf.data's autotuning off.

  With it on, the iterator that ends each `fit` call sometimes waits for the
  autotuning thread's next timed wake-up (its period doubles from 10 ms)
  instead of being woken at once: the call then ends at a fixed time, e.g.
  5.1 s after it started, whatever the steps cost. This was the "slow mode"
  of earlier runs (about 645 ms per step for 8 steps of any configuration
  that took 2.6 to 5.1 s); it is not part of a training step.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.prefetch(2).with_options(options)


def pipeline_feed(model_name, batch, steps, pipeline, seed=0):
  """The `fit` arguments of `steps` batches of `batch` through `pipeline`.

  Every configuration of a model, batch and pipeline gets the same feed:
  the same examples (random: speed does not depend on the values).
  """
  x, y = data(model_name, batch * steps, seed)
  if pipeline == 'numpy':
    return dict(x=x, y=y, batch_size=batch)
  if pipeline in ('tfdata', 'tfdata_drop'):
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=pipeline == 'tfdata_drop')
  elif pipeline == 'poisson':
    dataset = sampling.poisson_batches(x, y, sampling_probability=1 / steps,
                                       steps=steps, seed=seed)
  else:
    raise ValueError(f'unknown pipeline {pipeline!r}, not one of {PIPELINES}')
  return dict(x=_without_autotuning(dataset))


def _fit_seconds(model, feed):
  start = time.perf_counter()
  model.fit(**feed, epochs=1, verbose=0)
  return time.perf_counter() - start


def _warmed_up(model_name, pipeline, runs, steps=None):
  """{(batch, config): (model, feed)} of `runs` ((batch, config) pairs),
  each built and warmed up by one whole `fit` call of `steps` (`--steps`)."""
  built, feeds = {}, {}
  for batch, config in runs:
    if batch not in feeds:  # One feed per batch size, as `time_model`.
      feeds[batch] = pipeline_feed(model_name, batch, steps or FLAGS.steps,
                                   pipeline)
    built[batch, config] = (build(model_name, batch, config), feeds[batch])
    _fit_seconds(*built[batch, config])  # Traces and compiles.
  return built


def time_model(model_name, batch, pipelines):
  """{(pipeline, config): seconds per step}, interleaved round-robin over
  every pipeline and configuration in this process."""
  runs = {}
  for pipeline in pipelines:
    feed = pipeline_feed(model_name, batch, FLAGS.steps, pipeline)
    for config in configs(model_name):
      runs[pipeline, config] = (build(model_name, batch, config), feed)
      _fit_seconds(*runs[pipeline, config])  # Traces and compiles.
  return _fastest_steps(runs)


def _round_steps(runs, steps, repetitions):
  """{run: seconds per step of each round} of `runs` ({run: (model, feed)},
  warmed up, `steps` a feed): `repetitions` rounds, round-robin."""
  rounds = {run: [] for run in runs}
  for _ in range(repetitions):
    for run, (model, feed) in runs.items():
      rounds[run].append(_fit_seconds(model, feed) / steps)
  return rounds


def _fastest_steps(runs):
  """{run: seconds per step} of `runs` ({run: (model, feed)}, warmed up):
  `--repetitions` rounds round-robin, each run's fastest whole `fit` call
  over `--steps`."""
  return {run: min(seconds) for run, seconds in _round_steps(
      runs, FLAGS.steps, FLAGS.repetitions).items()}


def encoder_rows():
  """The encoder's table (its protocol, see the module docstring): per
  configuration ms a step (fastest round), the ratio to the fastest
  baseline, the range of the per-round ratios to that baseline, and each
  round's ms a step."""
  batch, steps = FLAGS.encoder_batch, FLAGS.encoder_steps
  runs = [(batch, config) for config in BASELINES] + [
      (batch, f'tfdpx {name}') for name in FLAGS.encoder_privatizers]
  rounds = _round_steps(
      _warmed_up('encoder', FLAGS.encoder_pipeline, runs, steps), steps,
      FLAGS.encoder_repetitions)
  baseline = min(runs[:len(BASELINES)], key=lambda run: min(rounds[run]))
  rows = []
  for run in runs:
    paired = [t / b for t, b in zip(rounds[run], rounds[baseline])]
    rows.append(f'| {run[1]} | {1000 * min(rounds[run]):.1f} | '
                f'{min(rounds[run]) / min(rounds[baseline]):.2f} | '
                f'{min(paired):.2f}-{max(paired):.2f} | '
                f'{", ".join(f"{1000 * t:.0f}" for t in rounds[run])} |')
  return rows


def gep_rule_row(model_name, batch):
  """GEP at batch B with its A anchors against the work it must do: DP-SGD
  at B plus DP-SGD at A (issue 56), interleaved in this process."""
  runs = [(batch, 'tfdpx gaussian'), (NUM_PUBLIC, 'tfdpx gaussian'),
          (batch, 'tfdpx gep')]
  step = _fastest_steps(_warmed_up(model_name, FLAGS.pipeline[0], runs))
  at_b, at_a, gep = (1000 * step[run] for run in runs)
  return (f'| {model_name} | {batch} | {NUM_PUBLIC} | {at_b:.1f} | '
          f'{at_a:.1f} | {gep:.1f} | {gep / (at_b + at_a):.2f} |')


def gep_memory_row(model_name, batch):
  """GEP's peak at batch B against DP-SGD's at B + A (issue 56)."""
  pipeline = FLAGS.pipeline[0]
  dp_sgd = peak_rss_mib(model_name, batch + NUM_PUBLIC, 'tfdpx gaussian',
                        pipeline)
  gep = peak_rss_mib(model_name, batch, 'tfdpx gep', pipeline)
  return (f'| {model_name} | {batch} | {NUM_PUBLIC} | {dp_sgd:.0f} | '
          f'{gep:.0f} | {gep / dp_sgd:.2f} |')


def machine_record() -> str:
  """The machine and software a results file comes from."""
  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as info:
      cpu = next(line.split(':', 1)[1].strip() for line in info
                 if line.startswith('model name'))
  except (OSError, StopIteration):
    pass
  # pylint: disable=g-import-not-at-top
  import keras
  from tensorflow.python.util import _pywrap_util_port
  # pylint: enable=g-import-not-at-top
  # What TensorFlow decided at start-up: the variable, else its CPU check.
  onednn = 'on' if _pywrap_util_port.IsMklEnabled() else 'off'
  return (f'Machine: {cpu}, {os.cpu_count()} cores, oneDNN {onednn} '
          f'(TF_ENABLE_ONEDNN_OPTS={os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset")}), '
          f'Python {platform.python_version()}, TensorFlow {tf.__version__}, '
          f'Keras {keras.__version__}, numpy {np.__version__}')


# --- memory --------------------------------------------------------------------


def peak_rss_mib(model_name, batch, config, pipeline):
  """Peak resident set of a fresh process training `config`, in MiB."""
  result = subprocess.run(
      [sys.executable, '-m', 'benchmarks.speed',
       f'--memory_probe={model_name},{batch},{config},{pipeline}'],
      capture_output=True, text=True, check=True)
  return float(result.stdout.strip().splitlines()[-1])


def _probe():
  model_name, batch, config, pipeline = FLAGS.memory_probe.split(',')
  batch = int(batch)
  _fit_seconds(build(model_name, batch, config),
               pipeline_feed(model_name, batch, 3, pipeline))
  # VmHWM: this process image's own high-water mark.
  with open('/proc/self/status') as status:
    kib = next(int(line.split()[1]) for line in status
               if line.startswith('VmHWM:'))
  print(kib / 1024)


def virtual_batch_rows(model_name, logical, physical):
  """Table rows of `--virtual_batches`: peak memory and ms per example."""
  rows = []
  pipeline = FLAGS.pipeline[0]
  for name in privatizer_names():
    runs = [(physical, f'tfdpx {name}'), (logical, f'tfdpx {name}'),
            (logical, f'tfdpx {name} physical={physical}')]
    mib = [peak_rss_mib(model_name, batch, config, pipeline)
           for batch, config in runs]
    # Timed interleaved in this process, as `time_model`.
    step = _fastest_steps(_warmed_up(model_name, pipeline, runs))
    for (batch, config), peak in zip(runs, mib):
      per_example = 1000 * step[batch, config] / batch
      rows.append(f'| {model_name} | {batch} | {config} | {peak:.0f} | '
                  f'{peak / mib[0]:.2f} | {per_example:.3f} | '
                  f'{per_example / (1000 * step[runs[0]] / physical):.2f} |')
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
         f'pipeline {FLAGS.pipeline[0]}, steps {FLAGS.steps}, repetitions '
         f'{FLAGS.repetitions}')
    emit()
    emit(machine_record())
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


def _draw_milliseconds(draw, size):
  """The fastest of 20 draws of `size` normals by `draw(shape, seed)`, ms.

  The seed is a variable, read each call: a constant seed would let
  grappler fold the draw away.
  """
  seed = tf.Variable([1, 2], dtype=tf.int64)

  @tf.function
  def once():
    seed.assign_add([0, 1])
    return tf.reduce_sum(draw([size], seed.read_value()))

  once()
  best = float('inf')
  for _ in range(20):
    start = time.perf_counter()
    once().numpy()
    best = min(best, time.perf_counter() - start)
  return 1000 * best


def draws_rows(model_name, seconds):
  """The dense-release floor of one model: the time of as many Gaussian draws
  as it has trainable coordinates, by tfdpx's sampler and by TensorFlow's
  `stateless_normal`, and DP-SGD's step net of the draws over the plain
  step (both pipelines' first, as the speed table's)."""
  size = sum(int(np.prod(v.shape))
             for v in MODELS[model_name][0]().trainable_variables)
  ours = _draw_milliseconds(
      lambda shape, seed: noise.standard_normal(shape, seed,
                                                      dtype=tf.float32), size)
  theirs = _draw_milliseconds(
      lambda shape, seed: tf.random.stateless_normal(shape, seed), size)
  pipeline = FLAGS.pipeline[0]
  plain = min(seconds[pipeline, config] for config in BASELINES)
  dp_sgd = seconds.get((pipeline, 'tfdpx gaussian'))
  net = ('-' if dp_sgd is None else
         f'{(1000 * dp_sgd - ours) / (1000 * plain):.1f}')
  return (f'| {model_name} | {size:,} | {ours:.1f} | {theirs:.1f} | '
          f'{ours / theirs:.2f} | {net} |')


def speed_and_memory_tables(emit):
  """The tables of `make bench`."""
  emit(f'# tfdpx speed benchmark, {time.strftime("%Y-%m-%d %H:%M UTC")}, '
       f'steps {FLAGS.steps}, repetitions {FLAGS.repetitions}')
  emit()
  emit(machine_record())
  emit()
  emit('Ratios are to the fastest non-private row of the same model, batch '
       'and pipeline.')
  emit()
  emit('| model | batch | pipeline | configuration | ms/step | '
       'x non-private |')
  emit('|---|---:|---|---|---:|---:|')
  draws = []
  for model_name in FLAGS.models:
    for batch in map(int, FLAGS.batches):
      seconds = time_model(model_name, batch, FLAGS.pipeline)
      for pipeline in FLAGS.pipeline:
        baseline = min(seconds[pipeline, config] for config in BASELINES)
        for config in configs(model_name):
          value = seconds[pipeline, config]
          emit(f'| {model_name} | {batch} | {pipeline} | {config} | '
               f'{1000 * value:.1f} | {value / baseline:.1f} |')
      if batch == int(FLAGS.batches[0]):
        draws.append(draws_rows(model_name, seconds))
      tf.keras.backend.clear_session()
  emit()
  emit(f'Dense releases: the draws of every trainable coordinate (ms, the '
       f'fastest of 20), and DP-SGD\'s step net of them over the plain step '
       f'(batch {FLAGS.batches[0]}, pipeline {FLAGS.pipeline[0]}).')
  emit()
  emit('| model | coordinates | tfdpx sampler | tf.random.stateless_normal | '
       'x | DP-SGD net of the draws, x plain |')
  emit('|---|---:|---:|---:|---:|---:|')
  for row in draws:
    emit(row)
  if FLAGS.gep_rule_models:
    emit()
    emit(f'GEP against its own work (issue 56): GEP\'s step at batch B with '
         f'A anchors over DP-SGD\'s at B plus DP-SGD\'s at A, interleaved, '
         f'pipeline {FLAGS.pipeline[0]}; the rule is <= 1.3.')
    emit()
    emit('| model | B | A | DP-SGD at B ms | DP-SGD at A ms | GEP ms | '
         'GEP / (B + A) |')
    emit('|---|---:|---:|---:|---:|---:|---:|')
    for model_name in FLAGS.gep_rule_models:
      emit(gep_rule_row(model_name, FLAGS.gep_rule_batch))
      tf.keras.backend.clear_session()
  if FLAGS.encoder_privatizers:
    emit()
    emit(f'The encoder at batch {FLAGS.encoder_batch}, pipeline '
         f'{FLAGS.encoder_pipeline}, {FLAGS.encoder_steps} steps a fit call, '
         f'{FLAGS.encoder_repetitions} rounds: the fastest round\'s step and '
         f'its ratio to the fastest baseline\'s, and the range of the '
         f'per-round ratios (each round over the baseline\'s same round).')
    emit()
    emit('| configuration | ms/step | x non-private | per-round x | '
         'ms/step of each round |')
    emit('|---|---:|---:|---:|---|')
    for row in encoder_rows():
      emit(row)
    tf.keras.backend.clear_session()
  if FLAGS.memory and FLAGS.gep_memory:
    emit()
    emit(f'GEP\'s peak at batch B against DP-SGD\'s at B + A (fresh '
         f'processes, pipeline {FLAGS.pipeline[0]}); the rule is <= 1.3.')
    emit()
    emit('| model | B | A | DP-SGD peak MiB at B + A | GEP peak MiB at B | '
         'x |')
    emit('|---|---:|---:|---:|---:|---:|')
    for entry in FLAGS.gep_memory:
      model_name, batch = entry.split(':')
      emit(gep_memory_row(model_name, int(batch)))
  if FLAGS.memory:
    pipeline = FLAGS.pipeline[0]
    emit()
    emit(f'| model | configuration | peak MiB, batch {FLAGS.memory_batch}, '
         f'{pipeline} | x non-private |')
    emit('|---|---|---:|---:|')
    for model_name in FLAGS.memory_models:
      peaks = {config: peak_rss_mib(model_name, FLAGS.memory_batch, config,
                                    pipeline)
               for config in configs(model_name)
               if not config.endswith(' xla')}
      baseline = min(peaks[config] for config in BASELINES)
      for config, mib in peaks.items():
        emit(f'| {model_name} | {config} | {mib:.0f} | {mib / baseline:.2f} |')


if __name__ == '__main__':
  app.run(main)
