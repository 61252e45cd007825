"""Mixed precision: statistics, clipping, noise and sums in float32."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import privatizers

L = tf.keras.layers
NONE = 'none'
POLICIES = ['mixed_bfloat16', 'mixed_float16']


class Scale(L.Layer):
  """A layer without a rule: the engine's vectorized fallback."""

  def build(self, input_shape):
    self.w = self.add_weight(name='w', shape=input_shape[-1:],
                             initializer='ones')

  def call(self, inputs):
    return inputs * tf.cast(self.w, inputs.dtype)


def _image_model(policy='mixed_bfloat16'):
  """Every kind of unit in 16 bits: convolution, Dense, LayerNormalization
  (materialized rule) and the fallback."""
  tf.keras.utils.set_random_seed(1)
  return tf.keras.Sequential([
      tf.keras.Input((6, 6, 1)),
      L.Conv2D(3, 3, activation='tanh', dtype=policy),
      L.Flatten(),
      L.Dense(8, dtype=policy),
      L.LayerNormalization(dtype=policy),
      Scale(dtype=policy),
      L.Dense(4, dtype=policy)])


def _text_model(policy='mixed_bfloat16'):
  tf.keras.utils.set_random_seed(1)
  return tf.keras.Sequential([
      tf.keras.Input((5,), dtype='int32'),
      L.Embedding(50, 8, dtype=policy),
      L.GlobalAveragePooling1D(dtype=policy),
      L.Dense(4, dtype=policy)])


MODELS = {
    'image': (_image_model,
              lambda rng, n: rng.normal(size=(n, 6, 6, 1)).astype('float32')),
    'text': (_text_model, lambda rng, n: rng.integers(0, 50, (n, 5))),
}


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction=NONE)


def _fit(model, x, y, privatizer, *, expected_batch_size, learning_rate=1.0,
         fast_clipping=True, loss=None, loss_scale=None):
  model = tfdpx.keras.make_private(model, fast_clipping=fast_clipping,
                                   loss_scale=loss_scale)
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer, noise_seed=3,
                                expected_batch_size=expected_batch_size,
                                learning_rate=learning_rate)
  model.compile(optimizer, loss or _loss())
  before = [v.numpy() for v in model.trainable_variables]
  model.fit(x, y, batch_size=len(x), verbose=0)
  return [v.numpy() - b for v, b in zip(model.trainable_variables, before)
          ], optimizer


@pytest.mark.parametrize('policy', POLICIES)
@pytest.mark.parametrize('name', sorted(MODELS))
def test_a_record_is_released_within_the_clip_norm(name, policy):
  """Batch of one, a gradient far above the clip, negligible noise: the
  release (learning rate 1, denominator 1) has norm at most C, and about C.
  With 16-bit sums a record came out at 1.002 C."""
  make, inputs = MODELS[name]
  rng = np.random.default_rng(0)
  l2_norm_clip = 0.5
  model = make(policy)
  assert model.layers[-1].compute_dtype == policy.partition('_')[2]
  change, _ = _fit(model, inputs(rng, 1), np.array([3]),
                   privatizers.gaussian(l2_norm_clip, 1e-9),
                   expected_batch_size=1, learning_rate=1.0)
  norm = math.sqrt(sum(np.sum(np.square(c, dtype=np.float64))
                       for c in change))
  assert 0.99 * l2_norm_clip <= norm <= l2_norm_clip * (1 + 1e-5)


@pytest.mark.parametrize('policy', POLICIES)
@pytest.mark.parametrize('name', sorted(MODELS))
def test_the_engine_releases_what_its_per_example_gradients_give(name,
                                                                 policy):
  """Same noise key: the layer forms (ghost norms, patch sums, segment
  sums) equal every per-example gradient formed, in float32."""
  make, inputs = MODELS[name]
  rng = np.random.default_rng(1)
  x, y = inputs(rng, 12), rng.integers(0, 4, 12)
  fast, _ = _fit(make(policy), x, y, privatizers.gaussian(0.3, 1.0),
                 expected_batch_size=12)
  slow, _ = _fit(make(policy), x, y, privatizers.gaussian(0.3, 1.0),
                 expected_batch_size=12, fast_clipping=False)
  for a, b in zip(fast, slow):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize('policy', POLICIES)
def test_the_loss_scale_does_not_change_the_release(policy):
  """Same noise key: scaling the losses by 1024 (a power of two: exact
  without overflow or underflow) and unscaling in float32 releases what
  no scaling releases; the default under float16 is 1024."""
  make, inputs = MODELS['image']
  rng = np.random.default_rng(2)
  x, y = inputs(rng, 8), rng.integers(0, 4, 8)
  plain, _ = _fit(make(policy), x, y, privatizers.gaussian(0.3, 1.0),
                  expected_batch_size=8, loss_scale=1.0)
  scaled, _ = _fit(make(policy), x, y, privatizers.gaussian(0.3, 1.0),
                   expected_batch_size=8, loss_scale=1024.0)
  for a, b in zip(plain, scaled):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert tfdpx.keras.make_private(make(policy))._loss_scale() == (
      1024.0 if policy == 'mixed_float16' else 1.0)


def test_keras_loss_scale_optimizer_is_not_used():
  """Under the mixed_float16 global policy Keras wraps the optimizer in a
  dynamic LossScaleOptimizer at compile; a model made private keeps the
  tfdpx optimizer (its fixed loss scale instead)."""
  policy = tf.keras.mixed_precision.global_policy()
  tf.keras.mixed_precision.set_global_policy('mixed_float16')
  try:
    model = tfdpx.keras.make_private(_image_model('mixed_float16'))
    optimizer = tfdpx.keras.DPSGD(1.0, 1.0, expected_batch_size=4,
                                  learning_rate=0.1)
    model.compile(optimizer, _loss())
    assert model.optimizer is optimizer
    x = MODELS['image'][1](np.random.default_rng(0), 4)
    model.fit(x, np.zeros(4), batch_size=4, verbose=0)
    assert int(optimizer.dp_steps.numpy()) == 1
  finally:
    tf.keras.mixed_precision.set_global_policy(policy)

class _ZeroLoss(tf.keras.losses.Loss):

  def call(self, y_true, y_pred):
    return tf.reduce_sum(0.0 * tf.cast(y_pred, tf.float32), axis=-1)


def test_noise_is_float32_noise_of_the_event():
  """Two-sided: zero gradients, the update's std is lr z C / B (float32
  variables, float32 noise), and the epsilon is the float32 run's."""
  z, c, lr, batch = 1.3, 0.8, 0.5, 4.0
  tf.keras.utils.set_random_seed(1)
  model = tf.keras.Sequential([tf.keras.Input((5,)),
                               L.Dense(20000, dtype='mixed_float16'),
                               L.Dense(3, dtype='mixed_float16')])
  change, optimizer = _fit(model, np.ones((4, 5), 'float32'), np.zeros(4),
                           privatizers.gaussian(c, z),
                           expected_batch_size=batch, learning_rate=lr,
                           loss=_ZeroLoss(reduction=NONE))
  samples = np.concatenate([d.ravel() for d in change])
  expected = lr * z * c / batch
  assert stats.relative_tolerance(samples.size) < 0.012
  assert stats.std_matches(samples, expected)
  assert not stats.std_matches(samples, expected * 1.03)
  assert not stats.std_matches(samples, expected / 1.03)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      0.01, dp_accounting.GaussianDpEvent(z)), 1)
  assert tfdpx.accounting.epsilon(
      optimizer, sampling_probability=0.01, delta=1e-5) == pytest.approx(
          accountant.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.skipif(tfdpx.keras.version.KERAS_3,
                    reason='the compile path is Keras 2 only')
def test_the_compile_path_clips_its_jacobian_rows_within_the_norm():
  """Stack A's compile path: per-record gradients from the Jacobian of the
  bfloat16 model's losses, norms and sum from those same float32 rows."""
  l2_norm_clip = 0.5
  model = _image_model()
  model.compile(tfdpx.keras.DPSGD(l2_norm_clip, 1e-9, expected_batch_size=1,
                                  learning_rate=1.0), _loss())
  before = [v.numpy() for v in model.trainable_variables]
  x = MODELS['image'][1](np.random.default_rng(0), 1)
  model.fit(x, np.array([3]), batch_size=1, verbose=0)
  norm = math.sqrt(sum(np.sum(np.square(v.numpy() - b, dtype=np.float64))
                       for v, b in zip(model.trainable_variables, before)))
  assert 0.99 * l2_norm_clip <= norm <= l2_norm_clip * (1 + 1e-5)
