"""Attention and LoRA made private: records within the clip, noise of the event.

The engine's statistics for EinsumDense, MultiHeadAttention and LoRA equal
single-example tapes (tests/test_per_example.py); these tests train such
models through `make_private` as a user would, with a `tf.data` pipeline of
unknown batch size.
"""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import privatizers
from tfdpx.keras.version import KERAS_3

L = tf.keras.layers
TOKENS, VOCAB = 6, 20

PRIVATIZERS = {
    'gaussian': lambda: privatizers.gaussian(1.0, 1.1),
    'dpdr': lambda: privatizers.dpdr(1.0, 1.1, decomposition_steps=2),
    'rs': lambda: privatizers.sparsified(privatizers.gaussian(1.0, 1.1), 0.5,
                                         epochs=2, steps_per_epoch=2),
    'd2p2': lambda: privatizers.d2p2(1.1),
    'gep': lambda: privatizers.gep(4, 1.0, 0.2, 1.1),
    'geodp': lambda: privatizers.geodp(1.0, 1.1),
}


def _encoder(lora_rank=None):
  """A small padded-token encoder block and a classifier head; with
  `lora_rank` (Keras 3), LoRA on the attention's query and value projections,
  everything else frozen but the head."""
  tf.keras.utils.set_random_seed(1)
  ids = tf.keras.Input((TOKENS,), dtype='int32')
  x = L.Embedding(VOCAB, 8, mask_zero=True)(ids)
  attention = L.MultiHeadAttention(2, 4, dropout=0.1)
  x = L.LayerNormalization()(x + attention(x, x))
  x = L.Dense(8, activation='relu')(x)
  head = [L.Dense(256, activation='tanh'), L.Dense(3)]
  outputs = head[1](head[0](L.GlobalAveragePooling1D()(x)))
  model = tf.keras.Model(ids, outputs)
  if lora_rank:
    for layer in model.layers:
      layer.trainable = any(layer is h for h in head)
    attention.trainable = True  # Then the projections but query and value:
    attention._key_dense.trainable = False  # pylint: disable=protected-access
    attention._output_dense.trainable = False  # pylint: disable=protected-access
    for projection in (attention._query_dense, attention._value_dense):  # pylint: disable=protected-access
      projection.enable_lora(lora_rank)  # Freezes the projection's kernel.
      projection.lora_kernel_b.assign(  # Not zero: a's gradient is nonzero.
          tf.random.normal(projection.lora_kernel_b.shape))
  return model


MODELS = {'encoder': _encoder}
if KERAS_3:
  MODELS['lora'] = lambda: _encoder(lora_rank=2)


def _ids(n, seed=0):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, VOCAB, size=(n, TOKENS))
  ids[:, TOKENS - 2:] = 0  # Padding.
  return ids, rng.integers(0, 3, n).astype('int32')


def _loss():
  return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                       reduction='none')


def _fit(model, x, y, privatizer, *, batch, learning_rate=1.0, loss=None,
         epochs=1, public_data=None):
  """One `fit` through `.batch(batch)`; the change of every weight."""
  private = tfdpx.keras.make_private(model, public_data=public_data)
  optimizer = tfdpx.keras.DPSGD(privatizer=privatizer, noise_seed=3,
                                expected_batch_size=batch,
                                learning_rate=learning_rate)
  private.compile(optimizer, loss or _loss())
  before = [v.numpy() for v in model.weights]
  private.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch),
              epochs=epochs, verbose=0)
  return [v.numpy() - b for v, b in zip(model.weights, before)], optimizer


def _trainable(model):
  ids = {id(v) for v in model.trainable_weights}
  return [id(v) in ids for v in model.weights]


@pytest.mark.parametrize('name', sorted(MODELS))
def test_a_record_is_released_within_the_clip_norm(name):
  """Batch of one, negligible noise, dropout on: the release has norm at
  most C and about C; frozen weights do not move."""
  model = MODELS[name]()
  x, y = _ids(1)
  c = 0.05
  change, _ = _fit(model, x, y, privatizers.gaussian(c, 1e-9), batch=1,
                   loss=lambda t, p: 1e3 * _loss()(t, p))
  trainable = _trainable(model)
  norm = math.sqrt(sum(np.sum(np.square(d, dtype=np.float64))
                       for d, t in zip(change, trainable) if t))
  assert 0.99 * c <= norm <= c * (1 + 1e-5)
  assert all(not np.any(d) for d, t in zip(change, trainable) if not t)


class _ZeroLoss(tf.keras.losses.Loss):

  def call(self, y_true, y_pred):
    return tf.reduce_sum(0.0 * y_pred, axis=-1)


@pytest.mark.parametrize('name', sorted(MODELS))
def test_noise_is_that_of_the_event_on_the_trainable_weights_only(name):
  """Two-sided: zero gradients, the update's std is lr z C / B on every
  trainable coordinate (the adapters alone under LoRA), zero elsewhere; the
  epsilon is dp_accounting's of the same event."""
  z, c, lr, batch = 1.3, 0.8, 0.5, 4
  model = MODELS[name]()
  x, y = _ids(batch)
  change, optimizer = _fit(model, x, y, privatizers.gaussian(c, z),
                           batch=batch, learning_rate=lr,
                           loss=_ZeroLoss(reduction='none'), epochs=30)
  trainable = _trainable(model)
  samples = np.concatenate([d.ravel() for d, t in zip(change, trainable)
                            if t])
  # 30 steps of independent noise: the std of the sum is sqrt(30) times one.
  expected = math.sqrt(30) * lr * z * c / batch
  assert stats.relative_tolerance(samples.size) < 0.07
  assert stats.std_matches(samples, expected)
  assert not stats.std_matches(samples, expected * 1.1)
  assert not stats.std_matches(samples, expected / 1.1)
  assert all(not np.any(d) for d, t in zip(change, trainable) if not t)
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      0.01, dp_accounting.GaussianDpEvent(z)), 30)
  assert tfdpx.accounting.epsilon(
      optimizer, sampling_probability=0.01, delta=1e-5) == pytest.approx(
          accountant.get_epsilon(1e-5), rel=1e-9)


# DP-SGD in the default run; the other steps ask the same per-layer
# statistics (`make test-all` runs them: CI's 25 minutes).
@pytest.mark.parametrize('privatizer', [
    p if p == 'gaussian' else pytest.param(p, marks=pytest.mark.slow)
    for p in sorted(PRIVATIZERS)])
@pytest.mark.parametrize('name', sorted(MODELS))
def test_every_privatizer_trains_attention_and_lora(name, privatizer):
  model = MODELS[name]()
  x, y = _ids(16)
  public = _ids(8, seed=1) if privatizer == 'gep' else None
  change, _ = _fit(model, x, y, PRIVATIZERS[privatizer](), batch=8,
                   learning_rate=0.1, public_data=public)
  trainable = _trainable(model)
  assert all(np.all(np.isfinite(d)) for d in change)
  # (GeoDP's release may leave whole variables at zero: docs/geodp.md.)
  assert any(np.any(d) for d, t in zip(change, trainable) if t)
  assert all(not np.any(d) for d, t in zip(change, trainable) if not t)
