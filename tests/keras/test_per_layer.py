"""Per-layer and adaptive clipping through models made private."""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import privatizers


def _model():
  tf.keras.utils.set_random_seed(1)
  return tf.keras.Sequential([
      tf.keras.Input((6, 6, 1)),
      tf.keras.layers.Conv2D(3, 3, activation='tanh'),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(8, activation='tanh'),
      tf.keras.layers.Dense(4)])


def _fit(make_privatizer, fast_clipping):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(32, 6, 6, 1)).astype('float32')
  y = rng.integers(0, 4, 32)
  plain = _model()
  model = tfdpx.keras.make_private(plain, fast_clipping=fast_clipping)
  optimizer = tfdpx.keras.DPSGD(
      privatizer=make_privatizer(plain.trainable_variables),
      learning_rate=0.5, noise_seed=4)
  model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction='none'))
  history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
  return [v.numpy() for v in model.trainable_variables], history.history


WRAPPED = {
    'per_layer': lambda variables: privatizers.per_layer_clipping(
        privatizers.gaussian(0.5, 1.0), privatizers.layer_groups(variables)),
    'adaptive(per_layer)': lambda variables: privatizers.adaptive_clipping(
        privatizers.per_layer_clipping(privatizers.gaussian(0.5, 1.0),
                                       privatizers.layer_groups(variables)),
        expected_batch_size=16, learning_rate=0.5),
}


@pytest.mark.parametrize('name', sorted(WRAPPED))
def test_the_engine_releases_what_materialized_gradients_release(name):
  """Same noise key: the per-layer statistics (group norms, each group's
  weighted sums) give the weights that every per-example gradient formed
  gives."""
  fast, fast_logs = _fit(WRAPPED[name], True)
  slow, slow_logs = _fit(WRAPPED[name], False)
  for a, b in zip(fast, slow):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  if name.startswith('adaptive'):
    # The clip norm of the next step, logged; it moved from 0.5.
    np.testing.assert_allclose(fast_logs['l2_norm_clip'],
                               slow_logs['l2_norm_clip'], rtol=1e-5)
    assert fast_logs['l2_norm_clip'][-1] != pytest.approx(0.5)
