"""One worker of a two-process MultiWorkerMirroredStrategy run; writes JSON.

`python -m tests.keras.multiworker_run OUT_PATH` with `TF_CONFIG` naming the
cluster and this worker's index (tests/keras/test_multiworker.py starts both
workers). Each worker trains one step with zero per-example gradients, so the
weight change is the noise alone, and writes its weight change.
"""

import json
import sys

import numpy as np
import tensorflow as tf

import tfdpx
from tfdpx.privatizers import gaussian

NONE = 'none'
GLOBAL_BATCH = 8
LEARNING_RATE, L2_NORM_CLIP, NOISE_MULTIPLIER = 0.1, 0.8, 1.3


class ZeroLoss(tf.keras.losses.Loss):
  """A per-example loss whose gradient is exactly zero."""

  def call(self, y_true, y_pred):
    return tf.reduce_sum(0.0 * y_pred, axis=-1)


def noise_step(strategy, private):
  """The weight change of one step whose per-example gradients are zero."""
  with strategy.scope():
    tf.keras.utils.set_random_seed(0)  # Equal initial weights on both.
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(1000, input_shape=(100,))])
    if private:
      model = tfdpx.keras.make_private(model)
    optimizer = tfdpx.keras.DPSGD(
        privatizer=gaussian(L2_NORM_CLIP, NOISE_MULTIPLIER),
        expected_batch_size=GLOBAL_BATCH, learning_rate=LEARNING_RATE)
    model.compile(optimizer, ZeroLoss(reduction=NONE))
  before = [w.numpy() for w in model.weights]
  data = tf.data.Dataset.from_tensor_slices(
      (np.ones((GLOBAL_BATCH, 100), 'float32'), np.zeros(GLOBAL_BATCH))
  ).batch(GLOBAL_BATCH)
  model.fit(data, epochs=1, verbose=0)
  delta = np.concatenate([(w.numpy() - b).ravel()
                          for w, b in zip(model.weights, before)])
  return {'delta': delta.tolist(), 'dp_steps': int(optimizer.dp_steps.numpy())}


def main(out_path):
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  result = {'workers': strategy.cluster_resolver.cluster_spec().num_tasks(
      'worker')}
  for name, private in [('compile', False), ('make_private', True)]:
    result[name] = noise_step(strategy, private)
  with open(out_path, 'w') as f:
    json.dump(result, f)


if __name__ == '__main__':
  main(sys.argv[1])
