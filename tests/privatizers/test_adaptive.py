"""Adaptive (quantile) clipping: the adaptation, its noise and its events."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import privatizers

SHAPES = [(20, 10), (10,)]


def _variables():
  return [tf.Variable(tf.zeros(s)) for s in SHAPES]


def _grads_with_norms(norms, seed=0):
  """Per-example gradients whose global norms are `norms`."""
  rng = np.random.default_rng(seed)
  flat = rng.normal(size=(len(norms), 210))
  flat *= (np.asarray(norms) / np.linalg.norm(flat, axis=1))[:, None]
  return [tf.constant(flat[:, :200].reshape(-1, 20, 10), tf.float32),
          tf.constant(flat[:, 200:], tf.float32)]


def _key(step, secret=3):
  return tf.constant([secret, step], tf.int64)


def test_the_clip_norm_moves_to_the_target_quantile():
  """Noiseless count, norms 1..100: the clip norm ends near the chosen
  quantile of the norms (the rule's fixed point), from far below and far
  above."""
  norms = np.arange(1, 101, dtype=float)
  grads = _grads_with_norms(norms)
  for quantile, start in [(0.5, 0.01), (0.5, 1000.0), (0.9, 1.0)]:
    privatizer = privatizers.adaptive_clipping(
        privatizers.gaussian(start, 0.0), expected_batch_size=100,
        target_unclipped_quantile=quantile, learning_rate=0.2,
        count_noise_multiplier=1e-9)
    state = privatizer.init(_variables())
    step = tf.function(lambda s, k: privatizer.update(grads, s, k))
    for t in range(400):
      _, state = step(state, _key(t))
    clip = float(privatizer.clip_norm(state))
    assert abs(clip - np.quantile(norms, quantile)) < 3.0, (quantile, clip)


def _scale_after_one_step(privatizer):
  """The scale after a step on zero gradients (none clipped, no count noise)."""
  return math.exp(-privatizer.config['learning_rate'] *
                  (1.0 - privatizer.config['target_unclipped_quantile']))


def test_noise_follows_the_adapted_clip_norm():
  """Two-sided: at step 1, after the clip norm moved, the noise std is
  noise_multiplier times the adapted norm, not times the initial one."""
  l2_norm_clip, z = 0.8, 1.3
  privatizer = privatizers.adaptive_clipping(
      privatizers.gaussian(l2_norm_clip, z), expected_batch_size=4,
      learning_rate=1.0, count_noise_multiplier=1e-9)
  zeros = [tf.zeros((4, 300, 300)), tf.zeros((4, 100))]
  state = privatizer.init([tf.Variable(tf.zeros((300, 300))),
                           tf.Variable(tf.zeros((100,)))])
  _, state = privatizer.update(zeros, state, _key(0))
  scale = _scale_after_one_step(privatizer)
  assert float(privatizer.clip_norm(state)) == pytest.approx(
      l2_norm_clip * scale, rel=1e-6)
  out, _ = privatizer.update(zeros, state, _key(1))
  samples = np.concatenate([o.numpy().ravel() for o in out])
  expected = z * l2_norm_clip * scale
  assert stats.std_matches(samples, expected)
  assert not stats.std_matches(samples, expected * 1.03)
  assert not stats.std_matches(samples, z * l2_norm_clip)


@pytest.mark.parametrize('inner', ['gaussian', 'dpdr', 'gep'])
def test_one_record_moves_the_release_by_at_most_the_adapted_clip(inner):
  """Batch of one huge example, negligible noise, at step 1 (adapted
  norm): the release has the inner step's sensitivity times the scale, and
  reaches it (the clip is active)."""
  l2_norm_clip = 0.5
  make = {'gaussian': lambda: privatizers.gaussian(l2_norm_clip, 1e-9),
          'dpdr': lambda: privatizers.dpdr(l2_norm_clip, 1e-9,
                                           decomposition_steps=1),
          'gep': lambda: privatizers.gep(4, l2_norm_clip, l2_norm_clip,
                                         1e-9)}[inner]
  privatizer = privatizers.adaptive_clipping(
      make(), expected_batch_size=1, learning_rate=1.0,
      count_noise_multiplier=1e-9)
  public = _grads_with_norms(np.ones(8), seed=5) if inner == 'gep' else None
  state = privatizer.init(_variables())
  zeros = [tf.zeros((1,) + s) for s in SHAPES]
  _, state = privatizer.update(zeros, state, _key(0), public_grads=public)
  scale = _scale_after_one_step(privatizer)
  out, _ = privatizer.update(_grads_with_norms([1e4], seed=1), state,
                             _key(1), public_grads=public)
  norm = math.sqrt(sum(float(tf.reduce_sum(tf.square(o))) for o in out))
  bound = privatizer.inner.reference_l2_norm_clip * scale
  assert 0.99 * l2_norm_clip * scale <= norm <= bound * (1 + 1e-5)


def test_the_count_noise_is_what_the_event_claims():
  """Two-sided: the count's noise, recovered from the scale update over
  4000 keys, has std count_noise_multiplier."""
  z_c, n, lr, quantile = 3.0, 10.0, 0.1, 0.5
  privatizer = privatizers.adaptive_clipping(
      privatizers.gaussian(1.0, 1.0), expected_batch_size=n,
      target_unclipped_quantile=quantile, learning_rate=lr,
      count_noise_multiplier=z_c)
  state = privatizer.init(_variables())
  grads = _grads_with_norms([0.5, 2.0, 3.0])  # Two above the clip norm.
  step = tf.function(lambda k: privatizer.update(grads, state, k)[1]['scale'])
  scales = np.array([float(step(_key(i, secret=9))) for i in range(4000)])
  unclipped = quantile - np.log(scales) / lr
  count_noise = n * (1.0 - unclipped) - 2.0
  assert stats.std_matches(count_noise, z_c)
  assert not stats.std_matches(count_noise, z_c * 1.2)
  assert not stats.std_matches(count_noise, z_c / 1.2)


def _independent_epsilon(event, q, steps, delta):
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(q, event), steps)
  return accountant.get_epsilon(delta)


def test_epsilon_composes_the_gradient_and_the_count():
  z, z_c, q, steps, delta = 1.1, 12.8, 0.01, 1000, 1e-5
  privatizer = privatizers.adaptive_clipping(
      privatizers.gaussian(1.0, z), expected_batch_size=256,
      count_noise_multiplier=z_c)
  eps = tfdpx.accounting.epsilon(privatizer, steps=steps,
                                 sampling_probability=q, delta=delta)
  both = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(z),
                                        dp_accounting.GaussianDpEvent(z_c)])
  assert eps == pytest.approx(_independent_epsilon(both, q, steps, delta),
                              rel=1e-9)
  z_eff = (z**-2 + z_c**-2)**-0.5
  assert privatizer.noise_multiplier == pytest.approx(z_eff)
  assert eps > _independent_epsilon(dp_accounting.GaussianDpEvent(z), q,
                                    steps, delta)


def test_with_noise_multiplier_keeps_the_count_and_sets_the_effective_one():
  privatizer = privatizers.adaptive_clipping(
      privatizers.gaussian(1.0, 1.0), expected_batch_size=256)
  calibrated = privatizer.with_noise_multiplier(1.5)
  assert calibrated.noise_multiplier == pytest.approx(1.5)
  assert calibrated.config['count_noise_multiplier'] == 12.8
  with pytest.raises(ValueError, match='count_noise_multiplier'):
    privatizer.with_noise_multiplier(20.0)


@pytest.mark.parametrize('kwargs, name', [
    ({'expected_batch_size': 0}, 'expected_batch_size'),
    ({'target_unclipped_quantile': 1.5}, 'target_unclipped_quantile'),
    ({'target_unclipped_quantile': -0.1}, 'target_unclipped_quantile'),
    ({'learning_rate': -1.0}, 'learning_rate'),
    ({'count_noise_multiplier': 0.0}, 'count_noise_multiplier'),
])
def test_bad_arguments_are_refused_by_name(kwargs, name):
  args = {'inner': privatizers.gaussian(1.0, 1.0), 'expected_batch_size': 64,
          **kwargs}
  with pytest.raises(ValueError, match=name):
    privatizers.adaptive_clipping(**args)


@pytest.mark.parametrize('inner', [
    privatizers.d2p2(1.0),
    privatizers.sparsified(privatizers.gaussian(1.0, 1.0), 0.5, 2, 10)])
def test_a_step_without_a_clip_norm_to_scale_is_refused(inner):
  with pytest.raises(ValueError, match='inner'):
    privatizers.adaptive_clipping(inner, expected_batch_size=64)
