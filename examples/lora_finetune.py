"""DP fine-tuning with LoRA (Keras 3): a public pretrain, a private adaptation.

A small transformer encoder reads each 8x8 scikit-learn digit as a sequence
of 8 rows. It is pretrained without privacy on the digits 0-4 (standing in for
public data), then adapted to the digits 5-9 (the private data) with Keras 3's
`enable_lora(rank)` on the attention's query and value projections: the
pretrained weights stay frozen, only the adapters and a new classifier head
are trained, through `make_private` on Poisson-sampled batches with DP-SGD.
Prints the epsilon of the private phase (the pretrain saw no private example)
and the test accuracy, saves the adapted model as `.keras`, reloads it and
checks that it predicts the same, and exports a serving SavedModel.

  python -m examples.lora_finetune --lora_out_dir=out/lora
"""

import os
import sys

if __package__ in (None, ''):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import numpy as np
from sklearn import datasets
import tensorflow as tf

import tfdpx
from tfdpx import sampling
from tfdpx.keras.version import KERAS_3
# pylint: enable=g-import-not-at-top,wrong-import-position

L = tf.keras.layers
FLAGS = flags.FLAGS
flags.DEFINE_integer('lora_rank', 4, 'LoRA rank.')
flags.DEFINE_integer('lora_pretrain_epochs', 30, 'Non-private epochs on 0-4.')
flags.DEFINE_integer('lora_epochs', 15, 'Private epochs on 5-9.')
flags.DEFINE_float('lora_batch_size', 64, 'Expected Poisson batch size.')
flags.DEFINE_float('lora_clip', 1.0, 'Clip norm of each example.')
flags.DEFINE_float('lora_noise_multiplier', 1.5, 'DP-SGD noise multiplier.')
flags.DEFINE_float('lora_learning_rate', 1.0, 'Private learning rate.')
flags.DEFINE_float('lora_delta', 1e-5, 'Delta of the reported epsilon.')
flags.DEFINE_string('lora_out_dir', 'out/lora', 'Where the models go.')


def encoder(num_classes: int) -> tf.keras.Model:
  """Rows of a digit as 8 tokens: projection, one attention block, pooling."""
  rows = tf.keras.Input((8, 8))
  x = L.Dense(32, name='embed')(rows)
  x = L.LayerNormalization()(x + L.MultiHeadAttention(
      4, 8, name='attention')(x, x))
  x = L.LayerNormalization()(x + L.Dense(32, name='mlp_out')(
      L.Dense(64, activation='gelu', name='mlp_in')(x)))
  outputs = L.Dense(num_classes, name='head')(L.GlobalAveragePooling1D()(x))
  return tf.keras.Model(rows, outputs)


def adapt_with_lora(model: tf.keras.Model, rank: int) -> None:
  """Freezes the model but a new head; LoRA on attention's query and value."""
  for layer in model.layers:
    layer.trainable = layer.name == 'head'
  attention = model.get_layer('attention')
  attention.trainable = True
  attention.key_dense.trainable = False
  attention.output_dense.trainable = False
  for projection in (attention.query_dense, attention.value_dense):
    projection.enable_lora(rank)  # Freezes its kernel, adds a and b.


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction='none')


def run(argv=None):
  """Pretrains, adapts privately, saves (`argv` parses the flags first).

  Returns:
    A dict: `epsilon`, `delta`, `steps`, `test_accuracy`, `trainable` and
    `total` weights, `saved` (the `.keras` path), `served` (the SavedModel).
  """
  if argv is not None:
    FLAGS.unparse_flags()
    FLAGS(argv)
  if not KERAS_3:
    raise SystemExit('LoRA (enable_lora) needs Keras 3: run with Stack B '
                     '(.venv-keras3, `make venv-keras3`).')
  digits = datasets.load_digits()
  x = (digits.images / 16.0).astype('float32')
  y = digits.target.astype('int32')
  public, private = y < 5, y >= 5
  order = np.random.default_rng(0).permutation(np.flatnonzero(private))
  test, train = order[:300], order[300:]

  tf.keras.utils.set_random_seed(0)
  pretrained = encoder(5)
  pretrained.compile(tf.keras.optimizers.Adam(3e-3), _loss())
  pretrained.fit(x[public], y[public], batch_size=64,
                 epochs=FLAGS.lora_pretrain_epochs, verbose=0)

  # A new head for the private task; the body's weights come pretrained.
  model = encoder(5)
  for layer, source in zip(model.layers, pretrained.layers):
    if layer.name != 'head':
      layer.set_weights(source.get_weights())
  adapt_with_lora(model, FLAGS.lora_rank)

  n = len(train)
  q = FLAGS.lora_batch_size / n
  steps = sampling.steps_per_epoch(n, FLAGS.lora_batch_size)
  private_model = tfdpx.keras.make_private(model)
  private_model.compile(
      tfdpx.keras.DPSGD(l2_norm_clip=FLAGS.lora_clip,
                        noise_multiplier=FLAGS.lora_noise_multiplier,
                        expected_batch_size=FLAGS.lora_batch_size,
                        learning_rate=FLAGS.lora_learning_rate),
      _loss(), metrics=['accuracy'])
  private_model.fit(
      sampling.poisson_batches(x[train], y[train] - 5,
                               sampling_probability=q, steps=steps),
      epochs=FLAGS.lora_epochs, verbose=0)
  _, accuracy = private_model.evaluate(x[test], y[test] - 5, verbose=0)

  os.makedirs(FLAGS.lora_out_dir, exist_ok=True)
  saved = os.path.join(FLAGS.lora_out_dir, 'lora.keras')
  private_model.save(saved)
  loaded = tf.keras.models.load_model(saved)
  np.testing.assert_allclose(loaded.predict(x[test], verbose=0),
                             private_model.predict(x[test], verbose=0),
                             rtol=1e-5, atol=1e-5)
  served = os.path.join(FLAGS.lora_out_dir, 'served')
  private_model.export(served, verbose=False)
  return {
      'epsilon': tfdpx.accounting.epsilon(
          private_model.optimizer, sampling_probability=q,
          delta=FLAGS.lora_delta),
      'delta': FLAGS.lora_delta,
      'steps': FLAGS.lora_epochs * steps,
      'sampling_probability': q,
      'test_accuracy': accuracy,
      'trainable': sum(int(np.prod(v.shape))
                       for v in model.trainable_weights),
      'total': sum(int(np.prod(v.shape)) for v in model.weights),
      'saved': saved,
      'served': served,
  }


def main(argv):
  del argv
  r = run()
  print(f"LoRA rank {FLAGS.lora_rank}: {r['trainable']} of {r['total']} "
        f"weights trained privately; epsilon {r['epsilon']:.2f} at delta "
        f"{r['delta']:g} (Poisson q={r['sampling_probability']:.3f}, "
        f"{r['steps']} steps); test accuracy {r['test_accuracy']:.3f} on "
        f"digits 5-9\nsaved {r['saved']} (reloads with the same "
        f"predictions) and {r['served']}")


if __name__ == '__main__':
  app.run(main)
