"""DPDR against its spec (shared/specs/dpdr.md §8)."""

import importlib.metadata
import math

import dp_accounting
from dp_accounting import rdp
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import accounting
from tfdpx import privatizers
from tfdpx.privatizers.dpdr import decompose
from tfdpx.privatizers.dpdr import effective_noise_multiplier
from tests.compile_path import trainable

SHAPES = [(4, 3), (3,), (2, 2, 2)]
BATCH = 6


def _grads(seed, batch=BATCH, shapes=SHAPES, scale=1.0):
  rng = np.random.default_rng(seed)
  return [tf.constant(scale * rng.normal(size=(batch,) + s), tf.float32)
          for s in shapes]


def _unit_base(seed, shapes=SHAPES, blocks=None):
  """A random base that is a unit vector over each block's variables."""
  rng = np.random.default_rng(seed)
  blocks = list(range(len(shapes))) if blocks is None else blocks
  raw = [rng.normal(size=s) for s in shapes]
  norms = {}
  for r, k in zip(raw, blocks):
    norms[k] = norms.get(k, 0.0) + np.sum(r**2)
  return [tf.constant(r / math.sqrt(norms[k]), tf.float32)
          for r, k in zip(raw, blocks)]


def _state(privatizer, base, step, shapes=SHAPES):
  """The state at `step` with base `base` (blocks as `init` assigns them)."""
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in shapes])
  return {'step': tf.constant(step, tf.int64), 'base': list(base),
          'blocks': state['blocks']}


def _key(i=0):
  return tf.constant([11, i], tf.int64)


def _norm(tensors):
  return math.sqrt(sum(float(np.sum(np.square(np.asarray(t))))
                       for t in tensors))


def _numpy_gdr(grads, base, blocks, alpha_clip, perp_clip):
  """Spec §3.2's noiseless decomposition step, example by example in numpy."""
  grads = [np.asarray(g, np.float64) for g in grads]
  base = [np.asarray(b, np.float64) for b in base]
  m = max(blocks) + 1
  out = [np.zeros(b.shape) for b in base]
  alpha_sum = np.zeros(m)
  for i in range(grads[0].shape[0]):
    alpha = np.zeros(m)
    for g, b, k in zip(grads, base, blocks):
      alpha[k] += np.sum(g[i] * b)
    perp = [g[i] - alpha[k] * b for g, b, k in zip(grads, base, blocks)]
    alpha_sum += alpha * min(1.0, alpha_clip / max(np.linalg.norm(alpha),
                                                    1e-300))
    perp_norm = math.sqrt(sum(np.sum(p**2) for p in perp))
    for o, p in zip(out, perp):
      o += p * min(1.0, perp_clip / max(perp_norm, 1e-300))
  return [o + alpha_sum[k] * b for o, b, k in zip(out, base, blocks)]


# --- construction ------------------------------------------------------------


@pytest.mark.parametrize('kwargs, name', [
    ({'l2_norm_clip': 0.0}, 'l2_norm_clip'),
    ({'noise_multiplier': -1.0}, 'noise_multiplier'),
    ({'decomposition_steps': -1}, 'decomposition_steps'),
    ({'decomposition_steps': 2.5}, 'decomposition_steps'),
    ({'alpha_share': 0.0}, 'alpha_share'),
    ({'alpha_share': 1.0}, 'alpha_share'),
    ({'granularity': 'neuron'}, 'granularity'),
    ({'perp_l2_norm_clip': 0.0}, 'perp_l2_norm_clip'),
    ({'alpha_l2_norm_clip': -2.0}, 'alpha_l2_norm_clip'),
    ({'perp_noise_multiplier': 1.0}, 'alpha_noise_multiplier'),
    ({'alpha_noise_multiplier': 1.0}, 'perp_noise_multiplier'),
    ({'perp_noise_multiplier': -1.0, 'alpha_noise_multiplier': 1.0},
     'perp_noise_multiplier'),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
  args = {'l2_norm_clip': 1.0, 'noise_multiplier': 1.0, **kwargs}
  with pytest.raises(ValueError, match=name):
    privatizers.dpdr(**args)


# --- U1-U3, U9, U10: the decomposition ---------------------------------------


@pytest.mark.parametrize('blocks', [[0, 1, 2], [0, 0, 1], [0, 0, 0]])
def test_decomposition_is_exact_orthogonal_and_pythagorean(blocks):
  grads = _grads(0)
  base = _unit_base(1, blocks=blocks)
  alpha, perp = decompose(grads, base, tf.constant(blocks))
  alpha = alpha.numpy()
  m = max(blocks) + 1
  np.testing.assert_array_equal(alpha[:, m:], 0.0)
  for i in range(BATCH):
    g_i = [g[i].numpy() for g in grads]
    p_i = [p[i].numpy() for p in perp]
    for k in range(m):  # U1 and U2, per block.
      members = [v for v, b in enumerate(blocks) if b == k]
      rebuilt = [alpha[i, k] * base[v].numpy() + p_i[v] for v in members]
      for v, r in zip(members, rebuilt):
        np.testing.assert_allclose(r, g_i[v], rtol=1e-6, atol=1e-6)
      dot = sum(np.sum(p_i[v] * base[v].numpy()) for v in members)
      assert abs(dot) <= 1e-6 * _norm([g_i[v] for v in members])
    # U3: ||g||^2 = ||alpha||^2 + ||g_perp||^2.
    np.testing.assert_allclose(
        _norm(g_i)**2, np.sum(alpha[i]**2) + _norm(p_i)**2, rtol=1e-5)


def test_finer_blocks_leave_a_smaller_orthogonal_part():
  """U9: per-variable g_perp is never longer than the global one."""
  grads = _grads(2)
  released = [tf.reduce_sum(g, axis=0) + 0.3 * n[0]
              for g, n in zip(grads, _grads(3, batch=1))]
  per_variable = [r / tf.norm(r) for r in released]
  everything = [r / _norm(released) for r in released]
  _, perp_v = decompose(grads, per_variable, tf.constant([0, 1, 2]))
  alpha_g, perp_g = decompose(grads, everything,
                                       tf.constant([0, 0, 0]))
  np.testing.assert_array_equal(alpha_g.numpy()[:, 1:], 0.0)  # m = 1.
  for i in range(BATCH):
    assert (_norm([p[i] for p in perp_v]) <=
            _norm([p[i] for p in perp_g]) * (1 + 1e-6))


def test_zero_base_leaves_gradients_whole_and_finite():
  """U10: b = 0 gives alpha = 0 and g_perp = g, also for zero gradients."""
  grads = _grads(4)
  grads = [tf.concat([g[:2], tf.zeros_like(g[2:3]), g[3:]], 0) for g in grads]
  base = [tf.zeros(s) for s in SHAPES]
  alpha, perp = decompose(grads, base, tf.constant([0, 1, 2]))
  np.testing.assert_array_equal(alpha.numpy(), 0.0)
  for p, g in zip(perp, grads):
    np.testing.assert_array_equal(p.numpy(), g.numpy())
  privatizer = privatizers.dpdr(0.5, 1.0, decomposition_steps=5)
  out, state = privatizer.update(grads, _state(privatizer, base, 1), _key())
  assert all(np.all(np.isfinite(t.numpy())) for t in out + state['base'])
  # With b = 0 the step is DP-SGD's clip of the whole gradient (C_perp = C).
  noiseless = privatizers.dpdr(0.5, 0.0, decomposition_steps=5)
  out, _ = noiseless.update(grads, _state(noiseless, base, 1), _key())
  expected, _ = privatizers.gaussian(0.5, 0.0).update(grads, {}, _key())
  for a, b in zip(out, expected):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


# --- U4, U5, U11: the noiseless step -----------------------------------------


@pytest.mark.parametrize('granularity, blocks', [
    ('variable', [0, 1, 2]), ('global', [0, 0, 0])])
def test_decomposition_step_matches_the_spec_pseudocode(granularity, blocks):
  privatizer = privatizers.dpdr(1.0, 0.0, decomposition_steps=4,
                                granularity=granularity,
                                perp_l2_norm_clip=0.7, alpha_l2_norm_clip=0.4)
  grads = _grads(5, scale=2.0)
  base = _unit_base(6, blocks=blocks)
  out, _ = privatizer.update(grads, _state(privatizer, base, 2), _key())
  expected = _numpy_gdr(grads, base, blocks, 0.4, 0.7)
  for a, b in zip(out, expected):
    np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-5)


def test_reconstruction_without_noise_or_clipping_is_the_plain_sum():
  """U4, with a base that is not orthogonal to the gradients."""
  privatizer = privatizers.dpdr(math.inf, 0.0, decomposition_steps=4)
  grads = _grads(7)
  base = _unit_base(8)
  out, _ = privatizer.update(grads, _state(privatizer, base, 1), _key())
  for a, g in zip(out, grads):
    np.testing.assert_allclose(a.numpy(), g.numpy().sum(0), rtol=1e-5,
                               atol=1e-5)


def test_large_negative_alpha_is_clipped():
  """U5 / spec §7 P1: the paper's alpha clip has no absolute value."""
  alpha_clip = 0.25
  privatizer = privatizers.dpdr(1.0, 0.0, decomposition_steps=4,
                                granularity='global',
                                alpha_l2_norm_clip=alpha_clip)
  base = _unit_base(9, blocks=[0, 0, 0])
  grads = [tf.stack([-100.0 * (i + 1) * b for i in range(BATCH)])
           for b in base]  # Every example is -k b: alpha = -k, g_perp = 0.
  out, _ = privatizer.update(grads, _state(privatizer, base, 1), _key())
  # The orthogonal parts' sum is the weighted sum of the gradients minus its
  # part along b: exact up to float32 rounding of sum_i |g_i| = 2100.
  for a, b in zip(out, base):
    np.testing.assert_allclose(a.numpy(), -BATCH * alpha_clip * b.numpy(),
                               rtol=1e-5, atol=2100 * 3e-8)


@pytest.mark.parametrize('seed', [0, 2])
def test_a_huge_gradient_along_the_base_moves_the_release_by_its_clips(seed):
  # The orthogonal parts' sum cancels the component along b in floating
  # point. Without the bound on the whole gradient, g = -1e8 b (g_perp = 0
  # exactly) released a sum of norm 7.3 and 7.7 for these bases, against the
  # clip norms 1 and 0.25.
  privatizer = privatizers.dpdr(1.0, 0.0, decomposition_steps=4,
                                granularity='global',
                                alpha_l2_norm_clip=0.25)
  base = _unit_base(seed, blocks=[0, 0, 0])
  grads = [(-1e8 * b)[tf.newaxis] for b in base]
  out, _ = privatizer.update(grads, _state(privatizer, base, 1), _key())
  assert _norm(out) <= 1.0 + 0.25


def test_each_part_moves_by_at_most_its_clip_norm():
  """U5: per-part sensitivities C_alpha and C_perp, and both are reached."""
  alpha_clip, perp_clip = 0.3, 0.8
  privatizer = privatizers.dpdr(1.0, 0.0, decomposition_steps=4,
                                perp_l2_norm_clip=perp_clip,
                                alpha_l2_norm_clip=alpha_clip)
  grads = _grads(10, scale=50.0)
  base = _unit_base(11)
  state = _state(privatizer, base, 1)

  def parts(out):
    alpha = np.array([np.sum(o.numpy() * b.numpy())
                      for o, b in zip(out, base)])
    perp = [o.numpy() - a * b.numpy() for o, a, b in zip(out, alpha, base)]
    return alpha, perp

  full_alpha, full_perp = parts(privatizer.update(grads, state, _key())[0])
  for i in range(BATCH):
    fewer = [tf.concat([g[:i], g[i + 1:]], axis=0) for g in grads]
    alpha, perp = parts(privatizer.update(fewer, state, _key())[0])
    # Examples far above both clip norms move each part by exactly its norm.
    np.testing.assert_allclose(np.linalg.norm(alpha - full_alpha), alpha_clip,
                               rtol=1e-4)
    np.testing.assert_allclose(
        _norm([a - b for a, b in zip(perp, full_perp)]), perp_clip, rtol=1e-4)


def test_output_does_not_depend_on_the_order_of_examples():
  """U11."""
  privatizer = privatizers.dpdr(0.6, 0.0, decomposition_steps=4)
  grads = _grads(12, scale=3.0)
  state = _state(privatizer, _unit_base(13), 1)
  order = np.random.default_rng(0).permutation(BATCH)
  shuffled = [tf.gather(g, order) for g in grads]
  out, _ = privatizer.update(grads, state, _key())
  again, _ = privatizer.update(shuffled, state, _key())
  for a, b in zip(out, again):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


# --- U6: noise of a decomposition step ---------------------------------------


def test_decomposition_noise_along_and_across_the_base():
  """U6, two-sided: std sqrt((s_a C_a)^2 + (s_p C_p)^2) along each b_l,
  s_p C_p across, and neither the alpha nor the perp part alone along b."""
  perp_sigma, perp_clip, alpha_sigma, alpha_clip = 1.0, 0.5, 2.0, 0.3
  privatizer = privatizers.dpdr(
      1.0, 1.0, decomposition_steps=4, perp_l2_norm_clip=perp_clip,
      alpha_l2_norm_clip=alpha_clip, perp_noise_multiplier=perp_sigma,
      alpha_noise_multiplier=alpha_sigma)
  shapes = [(30,)] * 10
  base = _unit_base(14, shapes=shapes)
  state = _state(privatizer, base, 1, shapes=shapes)
  zeros = [tf.zeros((3,) + s) for s in shapes]
  draws = tf.function(lambda keys: tf.map_fn(
      lambda key: privatizer.update(zeros, state, key)[0], keys,
      fn_output_signature=[tf.float32] * len(shapes)))
  keys = tf.stack([_key(i) for i in range(300)])
  along, across = [], []
  for out, b in zip(draws(keys), base):  # out: [draws, 30] per block.
    b = b.numpy().astype(np.float64)
    # An orthonormal basis of the complement of b.
    q, _ = np.linalg.qr(np.column_stack([b, np.eye(30)[:, :29]]))
    out = out.numpy().astype(np.float64)
    along.append(out @ b)
    across.append((out @ q[:, 1:]).ravel())
  along, across = np.concatenate(along), np.concatenate(across)
  along_std = math.hypot(alpha_sigma * alpha_clip, perp_sigma * perp_clip)
  assert stats.relative_tolerance(along.size) < 0.08
  assert stats.std_matches(along, along_std)
  for wrong in (along_std * 1.15, along_std / 1.15, alpha_sigma * alpha_clip,
                perp_sigma * perp_clip):
    assert not stats.std_matches(along, wrong)
  assert stats.std_matches(across, perp_sigma * perp_clip)
  for wrong in (perp_sigma * perp_clip * 1.03, perp_sigma * perp_clip / 1.03):
    assert not stats.std_matches(across, wrong)


@pytest.mark.parametrize('granularity', ['variable', 'global'])
def test_alpha_noise_has_one_coordinate_per_block(granularity):
  """U6: with no perp noise the output is alpha_l b_l: one scalar per block."""
  privatizer = privatizers.dpdr(1.0, 1.0, decomposition_steps=4,
                                granularity=granularity,
                                perp_noise_multiplier=0.0,
                                alpha_noise_multiplier=1.0)
  blocks = [0, 1, 2] if granularity == 'variable' else [0, 0, 0]
  base = _unit_base(15, blocks=blocks)
  zeros = [tf.zeros((2,) + s) for s in SHAPES]
  out, _ = privatizer.update(zeros, _state(privatizer, base, 1), _key())
  scalars = []
  for o, b in zip(out, base):
    ratio = o.numpy() / b.numpy()
    np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-4)
    scalars.append(ratio.flat[0])
  if granularity == 'global':
    np.testing.assert_allclose(scalars, scalars[0], rtol=1e-4)
  else:
    assert len(set(np.round(scalars, 4))) == 3


# --- U7, U8: schedule and base -----------------------------------------------


def _same(a, b):
  """Equal up to float32 rounding (the two compute their sums and noise
  scales in different orders)."""
  return all(np.allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-6)
             for x, y in zip(a, b))


def test_dp_sgd_steps_are_the_gaussian_privatizer_with_its_draws():
  """U7: step 0 and steps >= s equal DP-SGD's computation and draws."""
  privatizer = privatizers.dpdr(0.7, 1.1, decomposition_steps=3)
  gaussian = privatizers.gaussian(0.7, 1.1)
  grads = _grads(16, scale=2.0)
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES])
  for step in range(5):
    out, state = privatizer.update(grads, state, _key(step))
    expected, _ = gaussian.update(grads, {}, _key(step))
    assert _same(out, expected) == (step in (0, 3, 4)), step
    assert privatizer.decomposes(step) == (step in (1, 2))
    assert int(state['step']) == step + 1


@pytest.mark.parametrize('steps', [0, 1])
def test_one_or_no_decomposition_step_is_dp_sgd(steps):
  privatizer = privatizers.dpdr(0.7, 1.1, decomposition_steps=steps)
  gaussian = privatizers.gaussian(0.7, 1.1)
  grads = _grads(17)
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES])
  for step in range(3):
    out, state = privatizer.update(grads, state, _key(step))
    expected, _ = gaussian.update(grads, {}, _key(step))
    assert _same(out, expected), step
    assert privatizer.dp_event(step) == gaussian.dp_event(step)


@pytest.mark.parametrize('granularity', ['variable', 'layer', 'global'])
def test_base_is_the_released_sum_normalized_per_block(granularity):
  """U8: unit per block, zero for a zero block, invariant to scale."""
  model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,)),
                               tf.keras.layers.Dense(2),
                               tf.keras.layers.Dense(2, use_bias=False)])
  variables = model.trainable_variables  # k, b | k, b | k
  groups = {'variable': [[0], [1], [2], [3], [4]],
            'layer': [[0, 1], [2, 3], [4]],
            'global': [[0, 1, 2, 3, 4]]}[granularity]
  privatizer = privatizers.dpdr(math.inf, 0.0, decomposition_steps=3,
                                granularity=granularity)
  grads = _grads(18, shapes=[tuple(v.shape) for v in variables])
  grads[4] = tf.zeros_like(grads[4])  # A block whose released sum is 0.
  state = privatizer.init(variables)
  bases = []
  for scale in (1.0, 3.0):
    _, new_state = privatizer.update([scale * g for g in grads], state,
                                     _key())
    bases.append(new_state['base'])
  for group in groups:
    released = [np.sum(grads[v].numpy(), axis=0) for v in group]
    norm = _norm(released)
    for v, r in zip(group, released):
      expected = r / norm if norm > 0 else np.zeros_like(r)
      np.testing.assert_allclose(bases[0][v].numpy(), expected, rtol=1e-5,
                                 atol=1e-7)
      np.testing.assert_allclose(bases[1][v].numpy(), bases[0][v].numpy(),
                                 rtol=1e-5, atol=1e-7)
    if norm > 0:
      np.testing.assert_allclose(_norm([bases[0][v] for v in group]), 1.0,
                                 rtol=1e-5)


def test_base_comes_from_the_released_noisy_sum():
  """Spec §7 P7: the next b is the noisy output's direction."""
  privatizer = privatizers.dpdr(1.0, 1.0, decomposition_steps=3)
  grads = _grads(19)
  state = privatizer.init([tf.Variable(tf.zeros(s)) for s in SHAPES])
  for step in range(3):
    out, state = privatizer.update(grads, state, _key(step))
    for o, b in zip(out, state['base']):
      np.testing.assert_allclose(b.numpy(), o.numpy() / np.linalg.norm(o),
                                 rtol=1e-5, atol=1e-7)


# --- U12-U14: accounting -----------------------------------------------------


@pytest.mark.parametrize('alpha_share', [0.01, 0.1, 0.5, 0.9])
def test_default_split_costs_exactly_a_dp_sgd_step(alpha_share):
  """U14 and U12: sigma_eff == noise_multiplier, epsilon == DP-SGD's."""
  privatizer = privatizers.dpdr(1.0, 1.3, alpha_share=alpha_share,
                                decomposition_steps=30)
  assert math.isclose(privatizer.decomposition_noise_multiplier, 1.3,
                      rel_tol=1e-12)
  assert math.isclose(
      effective_noise_multiplier(privatizer.perp_noise_multiplier,
                                          privatizer.alpha_noise_multiplier),
      1.3, rel_tol=1e-12)
  eps = accounting.epsilon(privatizer, steps=100, sampling_probability=0.01,
                           delta=1e-5)
  dp_sgd = accounting.epsilon(privatizers.gaussian(1.0, 1.3), steps=100,
                              sampling_probability=0.01, delta=1e-5)
  assert abs(eps - dp_sgd) <= 1e-6


def test_explicit_parts_are_one_event_on_one_sample():
  """U12: the event is PoissonSampled(q, Composed[G(s_perp), G(s_alpha)]),
  not two separately sampled Gaussians, and dp_event reports sigma_eff."""
  privatizer = privatizers.dpdr(1.0, 0.9, decomposition_steps=11,
                                perp_noise_multiplier=1.0,
                                alpha_noise_multiplier=2.0)
  sigma_eff = (1.0**-2 + 2.0**-2)**-0.5
  assert privatizer.dp_event(0) == dp_accounting.GaussianDpEvent(0.9)
  assert privatizer.dp_event(5) == dp_accounting.GaussianDpEvent(sigma_eff)
  assert privatizer.dp_event(11) == dp_accounting.GaussianDpEvent(0.9)
  q, steps, delta = 0.02, 40, 1e-5
  joint = dp_accounting.ComposedDpEvent([
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(
              q, dp_accounting.GaussianDpEvent(0.9)), steps - 10),
      dp_accounting.SelfComposedDpEvent(
          dp_accounting.PoissonSampledDpEvent(q, dp_accounting.ComposedDpEvent(
              [dp_accounting.GaussianDpEvent(1.0),
               dp_accounting.GaussianDpEvent(2.0)])), 10)])
  separate = dp_accounting.ComposedDpEvent([
      joint.events[0],
      dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([
          dp_accounting.PoissonSampledDpEvent(
              q, dp_accounting.GaussianDpEvent(1.0)),
          dp_accounting.PoissonSampledDpEvent(
              q, dp_accounting.GaussianDpEvent(2.0))]), 10)])

  def eps_of(event):
    return rdp.RdpAccountant().compose(event).get_epsilon(delta)

  eps = accounting.epsilon(privatizer, steps=steps, sampling_probability=q,
                           delta=delta)
  assert math.isclose(eps, eps_of(joint), rel_tol=1e-9)
  assert eps > eps_of(separate) * 1.01  # The paper's accounting understates.


def test_epsilon_grows_with_the_decomposition_steps_when_they_cost_more():
  """U12: with sigma_eff < sigma_g, epsilon is non-decreasing in s; as
  sigma_alpha grows the step approaches DP-SGD with sigma_perp."""
  def eps(s, alpha_sigma=1.0):
    return accounting.epsilon(
        privatizers.dpdr(1.0, 1.0, decomposition_steps=s,
                         perp_noise_multiplier=1.0,
                         alpha_noise_multiplier=alpha_sigma),
        steps=60, sampling_probability=0.02, delta=1e-5)
  values = [eps(s) for s in (0, 1, 2, 10, 30, 61)]
  assert values[0] == values[1] < values[2] < values[3] < values[4] < values[5]
  dp_sgd = accounting.epsilon(privatizers.gaussian(1.0, 1.0), steps=60,
                              sampling_probability=0.02, delta=1e-5)
  assert math.isclose(eps(61, alpha_sigma=1e6), dp_sgd, rel_tol=1e-6)


_DP_ACCOUNTING_0_4 = importlib.metadata.version('dp-accounting').startswith(
    '0.4.')

# Spec §8 U13, paper Table 2 noise, q = 256 / N, s = 50, delta = 1e-5.
U13 = [
    ('cifar10_eps3', 50000, 3907, 0.835, 0.84, 3.0, 2.980),
    ('cifar10_eps8', 50000, 3907, 0.605, 0.61, 1.0, 8.139),
    pytest.param(
        'mnist_eps8', 60000, 4688, 0.59, 0.59, 0.8, 8.479,
        marks=pytest.mark.xfail(_DP_ACCOUNTING_0_4, strict=True, reason=(
            'dp-accounting 0.4.3 gives 8.4665 (spec: 8.479 from 0.6.0). '
            'The optimal order here is fractional (2.7); 0.6.0 bounds the '
            'fractional-order series by the sum of absolute terms, 0.4.3 '
            'sums the signed terms, which agree with numerical integration '
            'of the subsampled Gaussian to 1e-12. See docs/dpdr.md.'))),
]


@pytest.mark.parametrize('name, n, steps, sigma_g, sigma_perp, sigma_alpha, '
                         'expected', U13)
def test_paper_noise_epsilon_matches_the_spec(name, n, steps, sigma_g,
                                              sigma_perp, sigma_alpha,
                                              expected):
  """U13: tfdpx's epsilon for the paper's Table 2 noise, within 0.01."""
  del name
  privatizer = privatizers.dpdr(1.0, sigma_g, decomposition_steps=50,
                                perp_noise_multiplier=sigma_perp,
                                alpha_noise_multiplier=sigma_alpha)
  eps = accounting.epsilon(privatizer, steps=steps,
                           sampling_probability=256 / n, delta=1e-5)
  assert abs(eps - expected) <= 0.01, eps


def test_calibration_hits_the_target_with_explicit_parts():
  """Spec §5.3 helper 2: solve sigma_g given the paper's sigma_perp, alpha."""
  privatizer = privatizers.dpdr(1.0, 1.0, decomposition_steps=10,
                                perp_noise_multiplier=1.2,
                                alpha_noise_multiplier=3.0)
  sigma_g = accounting.calibrate_noise_multiplier(
      2.0, privatizer, steps=60, sampling_probability=0.05, delta=1e-5)
  calibrated = privatizer.with_noise_multiplier(sigma_g)
  assert calibrated.perp_noise_multiplier == 1.2
  eps = accounting.epsilon(calibrated, steps=60, sampling_probability=0.05,
                           delta=1e-5)
  assert 2.0 * (1 - 1e-3) <= eps <= 2.0


# --- U16: with the Keras optimizer -------------------------------------------


def test_noiseless_dpdr_training_is_plain_sgd():
  """U16: zero noise and no clipping follow SGD through every phase."""
  data = np.random.default_rng(20).normal(size=(8, 4)).astype(np.float32)
  labels = (data[:, 0] > 0).astype(np.int64)

  def model():
    tf.keras.utils.set_random_seed(1)
    return tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(4,)),
                                tf.keras.layers.Dense(2)])

  loss = tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True, reduction='none')
  private = trainable(model())
  optimizer = tfdpx.keras.DPSGD(
      privatizer=privatizers.dpdr(math.inf, 0.0, decomposition_steps=3),
      expected_batch_size=8, learning_rate=0.5, noise_seed=0)
  private.compile(optimizer=optimizer, loss=loss)
  private.fit(data, labels, batch_size=8, epochs=5, shuffle=False, verbose=0)
  public = model()
  public.compile(optimizer=tf.keras.optimizers.SGD(0.5),
                 loss=tf.keras.losses.SparseCategoricalCrossentropy(
                     from_logits=True))
  public.fit(data, labels, batch_size=8, epochs=5, shuffle=False, verbose=0)
  for a, b in zip(private.get_weights(), public.get_weights()):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert int(optimizer.dp_steps.numpy()) == 5


def test_a_small_orthogonal_part_of_a_large_gradient_stays_within_its_clip():
  # |g_perp|^2 is a difference of statistics of the whole gradient, rounded
  # at the scale of |g|^2: with 1000 along the base and 1.5 across it, the
  # norm came out too small and g_perp was released up to 5% above its
  # clip norm. The alpha part is clipped to almost nothing here.
  privatizer = privatizers.dpdr(1.0, 0.0, decomposition_steps=4,
                                granularity='global', alpha_l2_norm_clip=1e-9)
  worst = 0.0
  for seed in range(20):
    base = _unit_base(seed, blocks=[0, 0, 0])
    rng = np.random.default_rng(100 + seed)
    across = [rng.normal(size=b.shape) for b in base]
    along = sum(float(np.sum(a * b.numpy())) for a, b in zip(across, base))
    across = [a - along * b.numpy() for a, b in zip(across, base)]
    scale = 1.5 / _norm(across)
    grads = [tf.constant((1000 * b.numpy() + scale * a)[np.newaxis],
                         tf.float32) for a, b in zip(across, base)]
    out, _ = privatizer.update(grads, _state(privatizer, base, 1), _key())
    worst = max(worst, _norm(out))
  assert worst <= 1.0 + 1e-4
