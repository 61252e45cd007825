"""Per-layer (per-group) clipping: statistics, clip bounds, noise, events."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import gradients
from tfdpx import privatizers
from tfdpx.privatizers.per_layer import GroupClippedGradients

SHAPES = [(4, 3), (3,), (5, 2), ()]
GROUPS = [0, 0, 1, 2]
CLIPS = [0.3, 0.4, 0.2]


def _grads(seed, batch=6, scale=1.0):
  rng = np.random.default_rng(seed)
  return [tf.constant(scale * rng.normal(size=(batch,) + s), tf.float32)
          for s in SHAPES]


def _explicit(grads):
  """Each example clipped group by group, in NumPy."""
  arrays = [g.numpy() for g in grads]
  out = [a.copy() for a in arrays]
  for group, clip in enumerate(CLIPS):
    members = [v for v, g in enumerate(GROUPS) if g == group]
    norms = np.sqrt(sum(np.sum(np.square(arrays[v]).reshape(len(arrays[v]), -1),
                               axis=1) for v in members))
    factors = np.minimum(1.0, clip / np.maximum(norms, 1e-30))
    for v in members:
      out[v] = arrays[v] * factors.reshape((-1,) + (1,) * (arrays[v].ndim - 1))
  return out


def test_statistics_are_those_of_the_gradients_clipped_group_by_group():
  grads = _grads(0, scale=1.0)
  clipped = GroupClippedGradients(gradients.MaterializedGradients(grads),
                                  GROUPS, CLIPS)
  expected = _explicit(grads)
  flat = [e.reshape(len(e), -1) for e in expected]
  for a, e in zip(clipped.materialized(), expected):
    np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)
  for a, e in zip(clipped.sq_norms(), flat):
    np.testing.assert_allclose(a.numpy(), np.sum(e**2, axis=1), rtol=1e-5)
  rng = np.random.default_rng(1)
  directions = [tf.constant(rng.normal(size=(2,) + s), tf.float32)
                for s in SHAPES]
  for a, e, d in zip(clipped.dots(directions), flat, directions):
    np.testing.assert_allclose(a.numpy(), e @ d.numpy().reshape(2, -1).T,
                               rtol=1e-4, atol=1e-6)
  weights = rng.uniform(size=(6, 3)).astype('float32')
  sums = clipped.weighted_sums(tf.constant(weights), [(1, 3), (0, 3), None,
                                                      None])
  np.testing.assert_allclose(
      sums[0].numpy(), np.einsum('bk,bij->kij', weights, expected[0])[:, 1:3],
      rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(sums[1].numpy(), weights.T @ expected[1],
                             rtol=1e-5, atol=1e-6)
  assert sums[2] is None and sums[3] is None
  for a, e in zip(clipped.weighted_sum(tf.constant(weights[:, 0])), expected):
    np.testing.assert_allclose(a.numpy(), np.tensordot(weights[:, 0], e, 1),
                               rtol=1e-5, atol=1e-6)
  other = _grads(2, batch=3)
  spans = [(0, 12), (0, 3), (2, 9), (0, 1)]
  grams = clipped.cross_grams(gradients.MaterializedGradients(other), spans)
  for a, e, o, (start, stop) in zip(grams, flat, other, spans):
    o = o.numpy().reshape(3, -1)
    np.testing.assert_allclose(a.numpy(), e[:, start:stop] @ o[:, start:stop].T,
                               rtol=1e-4, atol=1e-6)


def test_each_group_is_released_within_its_own_clip_norm():
  """One huge example, negligible noise: each group's release has norm at
  most its C_g, and reaches it; the whole at most sqrt(sum C_g^2)."""
  total = math.sqrt(sum(c * c for c in CLIPS))
  privatizer = privatizers.per_layer_clipping(
      privatizers.gaussian(total, 1e-9), GROUPS, CLIPS)
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES])
  out, _ = privatizer.update(_grads(3, batch=1, scale=1e3), state,
                             tf.constant([1, 0], tf.int64))
  for group, clip in enumerate(CLIPS):
    norm = math.sqrt(sum(float(tf.reduce_sum(tf.square(o)))
                         for o, g in zip(out, GROUPS) if g == group))
    assert 0.999 * clip <= norm <= clip * (1 + 1e-5), (group, norm)


def test_noise_is_that_of_the_global_sensitivity():
  """Two-sided: std noise_multiplier * sqrt(sum C_g^2) on every coordinate."""
  privatizer = privatizers.per_layer_clipping(privatizers.gaussian(0.8, 1.3))
  shapes = [(300, 300), (100,)]
  zeros = [tf.zeros((4,) + s) for s in shapes]
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in shapes])
  out, _ = privatizer.update(zeros, state, tf.constant([2, 0], tf.int64))
  samples = np.concatenate([o.numpy().ravel() for o in out])
  assert stats.std_matches(samples, 1.3 * 0.8)
  assert not stats.std_matches(samples, 1.3 * 0.8 * 1.03)
  assert not stats.std_matches(samples, 1.3 * 0.8 / 1.03)
  # The default splits C equally: C / sqrt(2) per variable here.
  assert privatizer.group_l2_norm_clips(2) == pytest.approx(
      [0.8 / math.sqrt(2)] * 2)


def test_epsilon_is_the_inner_steps():
  z, q, steps, delta = 1.1, 0.01, 500, 1e-5
  privatizer = privatizers.per_layer_clipping(privatizers.gaussian(1.0, z),
                                              [0, 1, 1], [0.6, 0.8])
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      q, dp_accounting.GaussianDpEvent(z)), steps)
  assert tfdpx.accounting.epsilon(
      privatizer, steps=steps, sampling_probability=q,
      delta=delta) == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)


@pytest.mark.parametrize('kwargs, name', [
    ({'groups': 'layer'}, 'groups'),
    ({'groups': [0, 2]}, 'groups'),
    ({'groups': [0, -1]}, 'groups'),
    ({'groups': [0, 1], 'group_l2_norm_clips': [0.6, 0.6]},
     'group_l2_norm_clips'),
    ({'groups': [0, 1], 'group_l2_norm_clips': [1.0]},
     'group_l2_norm_clips'),
    ({'group_l2_norm_clips': [0.6, -0.8]}, 'group_l2_norm_clips'),
])
def test_bad_arguments_are_refused_by_name(kwargs, name):
  with pytest.raises(ValueError, match=name):
    privatizers.per_layer_clipping(privatizers.gaussian(1.0, 1.0), **kwargs)


def test_groups_of_another_length_than_the_variables_are_refused_at_init():
  privatizer = privatizers.per_layer_clipping(privatizers.gaussian(1.0, 1.0),
                                              [0, 1, 1])
  with pytest.raises(ValueError, match='groups has 3 entries for 2'):
    privatizer.init([tf.Variable(tf.zeros(3)), tf.Variable(tf.zeros(2))])


def test_d2p2_has_no_clip_norm_to_share():
  with pytest.raises(ValueError, match='inner'):
    privatizers.per_layer_clipping(privatizers.d2p2(1.0))


def test_layer_groups_of_a_keras_model():
  model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4),
                               tf.keras.layers.Dense(2)])
  assert privatizers.layer_groups(model.trainable_variables) == [0, 0, 1, 1]
