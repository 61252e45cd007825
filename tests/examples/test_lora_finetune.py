"""examples/lora_finetune.py end to end on tiny settings (Keras 3)."""

import numpy as np
import pytest
import tensorflow as tf

from tfdpx.keras.version import KERAS_3

pytestmark = pytest.mark.skipif(not KERAS_3, reason='LoRA is Keras 3 only')


def test_lora_fine_tune_trains_the_adapters_privately_and_saves(tmp_path):
  from examples import lora_finetune  # pylint: disable=g-import-not-at-top
  results = lora_finetune.run([
      'lora_finetune.py', '--lora_pretrain_epochs=2', '--lora_epochs=1',
      '--lora_rank=2', f'--lora_out_dir={tmp_path}'])
  assert 0 < results['epsilon'] < 10
  assert 0 < results['trainable'] < results['total'] / 5
  assert 0 <= results['test_accuracy'] <= 1
  served = tf.saved_model.load(results['served'])
  logits = served.serve(tf.zeros([2, 8, 8]))
  assert np.all(np.isfinite(logits.numpy()))
