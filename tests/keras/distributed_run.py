"""Runs DP training under MirroredStrategy on two logical CPUs; prints JSON.

Logical devices must be configured before TensorFlow initializes its devices,
so tests run this module in a fresh process:
`python -m tests.keras.distributed_run`.
"""

import json

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import tfdpx  # pylint: disable=g-import-not-at-top
from tests.privatizers.cases import case_named  # pylint: disable=g-import-not-at-top
from tfdpx.privatizers import gaussian  # pylint: disable=g-import-not-at-top

NONE = 'none'
GLOBAL_BATCH = 8


class ZeroLoss(tf.keras.losses.Loss):
  """A per-example loss whose gradient is exactly zero."""

  def call(self, y_true, y_pred):
    return tf.reduce_sum(0.0 * y_pred, axis=-1)


def _data(n):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 5)).astype('float32')
  return x, (x[:, 0] > 0).astype('int32')


# One strategy for every run: separate MirroredStrategy objects in one process
# can reuse collective instance keys.
MIRRORED = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                     reduction=NONE)


def _fit(strategy, privatizer, loss, x, y, units, lr=0.1, private=False,
         physical_batch_size=None, vocabulary=None):
  """Fits a model of `units` hidden units (`tanh`; with `vocabulary`, an
  Embedding of that many rows, pooled) for one epoch."""
  with strategy.scope():
    tf.keras.utils.set_random_seed(0)
    hidden = (
        [tf.keras.layers.Embedding(vocabulary, units),
         tf.keras.layers.GlobalAveragePooling1D()] if vocabulary else
        [tf.keras.layers.Dense(units, activation='tanh',
                               input_shape=(x.shape[1],))])
    model = tf.keras.Sequential(hidden + [tf.keras.layers.Dense(2)])
    if private:
      model = tfdpx.keras.make_private(
          model, physical_batch_size=physical_batch_size)
    optimizer = tfdpx.keras.DPSGD(privatizer=privatizer,
                                  expected_batch_size=GLOBAL_BATCH,
                                  learning_rate=lr, noise_seed=5)
    model.compile(optimizer, loss)
  before = [w.numpy() for w in model.weights]
  model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
  replicas_agree = all(
      all(np.array_equal(r[0].numpy(), other.numpy()) for other in r[1:])
      for r in (strategy.experimental_local_results(v)
                for v in model.weights + optimizer.weights))
  return model, before, replicas_agree, int(optimizer.dp_steps.numpy())


def noise(units=1000, private=False, physical_batch_size=None):
  """Weight change of one step with zero per-example gradients."""
  x = np.ones((GLOBAL_BATCH, 100), 'float32')
  model, before, agree, steps = _fit(MIRRORED, gaussian(0.8, 1.3),
                                     ZeroLoss(reduction=NONE), x,
                                     np.zeros(GLOBAL_BATCH), units,
                                     private=private,
                                     physical_batch_size=physical_batch_size)
  delta = np.concatenate([(w.numpy() - b).ravel()
                          for w, b in zip(model.weights, before)])
  return {'delta': delta.tolist(), 'replicas_agree': agree, 'dp_steps': steps}


def noiseless():
  """Distributed vs single-device weights at zero noise, same global batch."""
  x, y = _data(4 * GLOBAL_BATCH)
  privatizer = gaussian(0.1, 0.0)  # Clipping active, no noise.
  results = {}
  for name, strategy, private, physical_batch_size in [
      ('mirrored', MIRRORED, False, None),
      ('mirrored_make_private', MIRRORED, True, None),
      # Each replica's 4 examples in physical batches of 3 (one padded).
      ('mirrored_virtual', MIRRORED, True, 3),
      ('single', tf.distribute.OneDeviceStrategy('/cpu:0'), False, None)]:
    model, _, agree, _ = _fit(strategy, privatizer, LOSS, x, y, units=4,
                              private=private,
                              physical_batch_size=physical_batch_size)
    results[name] = [w.numpy().tolist() for w in model.weights]
    results[name + '_replicas_agree'] = agree
  return results


def d2p2_noiseless():
  """D2P2's projected modes: distributed vs single-device weights, no noise.

  Modes O (SRHT) and C (Gaussian, project first) project the summed batch;
  the sum must cover the global batch, not each replica's share. Through
  make_private: the projection is the privatizer's, whichever engine gave
  the per-example gradients (make_private's is the faster to trace).
  """
  x, y = _data(4 * GLOBAL_BATCH)
  results = {}
  for mode, projection, order in [('O', 'srht', 'project_first'),
                                  ('C', 'gaussian', 'project_first'),
                                  ('N', 'gaussian', 'noise_first')]:
    privatizer = tfdpx.privatizers.d2p2(0.0, projection=projection,
                                        projection_order=order,
                                        projection_ratio=0.5)
    for name, strategy in [
        ('mirrored', MIRRORED),
        ('single', tf.distribute.OneDeviceStrategy('/cpu:0'))]:
      model, _, agree, _ = _fit(strategy, privatizer, LOSS, x, y, units=4,
                                private=True)
      results[f'{mode}_{name}'] = [w.numpy().tolist() for w in model.weights]
      results[f'{mode}_{name}_replicas_agree'] = agree
  return results


# Every privatizer class once, each wrapper around a stateful step: the
# replicas' agreement depends on the class's own state and draws, not on its
# settings (DPDR's granularity, GeoDP's mode) or on which inner step a
# stateless wrapper holds. GEP needs public data, which the compile path has
# no place for; sparse_embeddings has its own run below.
AGREE_CASES = ('gaussian', 'dpdr', 'geodp_sound', 'd2p2_srht_mode_o',
               'sparsified(dpdr)', 'adaptive(dpdr)', 'per_layer(gaussian)',
               'correlated(adaptive(gaussian))')


def agree():
  """For every privatizer: do replicas hold identical weights and state?

  Through make_private (about half the compile path's time here):
  the state and draws are the privatizer's, whichever engine gave the
  per-example gradients; `noise` and `noiseless` run the compile path.
  """
  x, y = _data(3 * GLOBAL_BATCH)
  return {name: _fit(MIRRORED, case_named(name).make(1.0, 1.0), LOSS, x, y,
                     4, private=True)[2] for name in AGREE_CASES}


def sparse():
  """sparse_embeddings with noise: two replicas against one device, the same
  noise key (each row's count about 1.2 against a threshold of 1.0, and
  false positives: the selection is the noise's to decide), with and
  without virtual batches."""
  rng = np.random.default_rng(1)
  ids = rng.integers(0, 12, size=(2 * GLOBAL_BATCH, 3)).astype('int32')
  privatizer = tfdpx.privatizers.sparse_embeddings(
      gaussian(1.0, 0.3), false_positive_rate=0.05)
  results = {}
  for name, strategy, physical_batch_size in [
      ('mirrored', MIRRORED, None), ('mirrored_virtual', MIRRORED, 3),
      ('single', tf.distribute.OneDeviceStrategy('/cpu:0'), None)]:
    model, before, agree, _ = _fit(
        strategy, privatizer, LOSS, ids, ids[:, 0] % 2, units=2,
        private=True, physical_batch_size=physical_batch_size, vocabulary=50)
    results[name] = [w.numpy().tolist() for w in model.weights]
    results[name + '_replicas_agree'] = agree
    results[name + '_changed_rows'] = np.flatnonzero(np.any(
        model.weights[0].numpy() != before[0], axis=1)).tolist()
  return results


if __name__ == '__main__':
  print(json.dumps({'noise': noise(), 'noise_make_private': noise(private=True),
                    'noise_virtual': noise(private=True,
                                           physical_batch_size=3),
                    'noiseless': noiseless(), 'd2p2': d2p2_noiseless(),
                    'agree': agree(), 'sparse': sparse()}))
