"""DPAdam's noise variance correction (DP-AdamBC): its update against the
formula on the released gradients, its noise moments against the strategy's
covariance, and its refusals."""

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tfdpx import correlation
from tfdpx import privatizers

D, BATCH, STEPS, CLIP, NOISE, SEED = 6, 4, 5, 1.0, 3.0, 11
BETA_1, BETA_2, RATE, EPSILON = 0.9, 0.99, 0.1, 1e-7


# (correlated noise, num_microbatches): the update's cases.
CASES = [(False, None), (True, None), (False, 2)]


def _privatizer(correlated):
  privatizer = privatizers.gaussian(CLIP, NOISE)
  if correlated:
    privatizer = privatizers.correlated(
        privatizer, correlation.banded_toeplitz(3, STEPS))
  return privatizer


def _weights_per_step(optimizer):
  """The kernel after each step of a linear model whose per-example loss
  is `w . x`: its gradient is `x` at any weights, so every optimizer gets the
  same released gradients from the same noise key."""
  x = np.random.default_rng(0).uniform(-0.1, 0.1, (BATCH * STEPS, D))
  model = tfdpx.keras.make_private(tf.keras.Sequential([
      tf.keras.Input((D,)),
      tf.keras.layers.Dense(1, use_bias=False, kernel_initializer='zeros')]))
  model.compile(optimizer, lambda y, p: tf.reduce_sum(p, axis=-1))
  kernels = []
  model.fit(x.astype('float32'), np.zeros(len(x), 'float32'),
            batch_size=BATCH, shuffle=False, verbose=0, callbacks=[
                tf.keras.callbacks.LambdaCallback(
                    on_train_batch_end=lambda *_, **__: kernels.append(
                        model.layers[-1].kernel.numpy()[:, 0].copy()))])
  return np.array(kernels)


def _denominators(microbatches):
  # Microbatch records: the noisy sum over num_microbatches.
  if microbatches:
    return dict(num_microbatches=microbatches)
  return dict(expected_batch_size=BATCH)


def _released(correlated, microbatches):
  # SGD at rate 1 from zero: minus each step's noisy mean gradient.
  kernels = _weights_per_step(tfdpx.keras.DPSGD(
      privatizer=_privatizer(correlated), learning_rate=1.0,
      noise_seed=SEED, **_denominators(microbatches)))
  return -np.diff(np.concatenate([np.zeros((1, D)), kernels]), axis=0)


def _adam(released, variances, floor):
  """Adam with `max(v_hat - phi_hat, floor)` on `released`, step by step."""
  w, m, v, phi = (np.zeros(D),) * 3 + (0.0,)
  for t, g in enumerate(released, start=1):
    m = BETA_1 * m + (1 - BETA_1) * g
    v = BETA_2 * v + (1 - BETA_2) * g**2
    phi = BETA_2 * phi + (1 - BETA_2) * variances[t - 1]
    denominator = np.sqrt(np.maximum(v / (1 - BETA_2**t) -
                                     phi / (1 - BETA_2**t), floor))
    w = w - RATE * m / (1 - BETA_1**t) / (denominator + EPSILON)
  return w


@pytest.mark.parametrize('correlated, microbatches', CASES)
def test_the_update_is_adams_with_the_noise_variance_taken_out(
    correlated, microbatches):
  released = _released(correlated, microbatches)
  draw = (NOISE * CLIP / (microbatches or BATCH))**2
  # Step t's noise variance from the strategy's covariance across steps.
  variances = draw * (np.diag(_privatizer(True).correlation.noise_covariance(
      STEPS)) if correlated else np.ones(STEPS))
  correction = 0.05
  trained = _weights_per_step(tfdpx.keras.DPAdam(
      privatizer=_privatizer(correlated), learning_rate=RATE, beta_1=BETA_1,
      beta_2=BETA_2, epsilon=EPSILON, noise_seed=SEED,
      noise_variance_correction=correction,
      **_denominators(microbatches)))[-1]
  expected = _adam(released, variances, correction * draw)
  np.testing.assert_allclose(trained, expected, rtol=2e-4, atol=1e-6)
  # Keras's Adam, the same formula without the correction, ends elsewhere.
  assert np.abs(expected - _adam(released, np.zeros(STEPS), 0.0)).max() > 0.1


def test_noise_moments_average_the_strategys_variances():
  strategy = correlation.banded_toeplitz(4, 30)
  privatizer = privatizers.correlated(privatizers.gaussian(2.0, 1.5), strategy)
  optimizer = tfdpx.keras.DPAdam(privatizer=privatizer, expected_batch_size=8,
                                 beta_2=0.9, noise_variance_correction=1.0)
  correction = optimizer._noise_correction  # pylint: disable=protected-access
  moments = correction.noise_moments(30)
  variances = (1.5 * 2.0 / 8)**2 * np.diag(strategy.noise_covariance(30))
  average = [np.average(variances[:t + 1], weights=0.9**np.arange(t, -1, -1))
             for t in range(30)]
  np.testing.assert_allclose(moments, average, rtol=1e-10)
  assert correction.floor == pytest.approx((1.5 * 2.0 / 8)**2)


@pytest.mark.parametrize('kwargs, match', [
    (dict(privatizer=privatizers.dpdr(1.0, 1.0)), 'dpdr'),
    (dict(expected_batch_size=None), 'expected_batch_size'),
    (dict(amsgrad=True), 'amsgrad'),
    (dict(noise_variance_correction=0.0), 'positive'),
    (dict(noise_variance_correction=True), 'positive'),
])
def test_the_correction_is_refused_where_the_variance_is_not_public(
    kwargs, match):
  arguments = dict(privatizer=privatizers.gaussian(1.0, 1.0),
                   expected_batch_size=8, noise_variance_correction=1.0)
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=match):
    tfdpx.keras.DPAdam(**arguments)


def test_the_correction_survives_the_config():
  optimizer = tfdpx.keras.DPAdam(privatizer=privatizers.gaussian(1.0, 1.0),
                                 expected_batch_size=8,
                                 noise_variance_correction=0.5)
  restored = tfdpx.keras.DPAdam.from_config(optimizer.get_config())
  assert restored.get_config()['noise_variance_correction'] == 0.5
  plain = tfdpx.keras.DPAdam(privatizer=privatizers.gaussian(1.0, 1.0),
                             expected_batch_size=8)
  assert plain.get_config()['noise_variance_correction'] is None
