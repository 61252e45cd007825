"""The contract every privatizer satisfies (DESIGN.md, house rule 5)."""

import json
import math

import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tests.privatizers.cases import CASES
from tfdpx import gradients
from tfdpx import virtual_batches

SHAPES = [(6, 5), (5,), (3, 3, 2, 4)]
BATCH = 7


def _grads(seed, batch=BATCH, shapes=SHAPES, scale=1.0):
  rng = np.random.default_rng(seed)
  return [tf.constant(scale * rng.normal(size=(batch,) + s), tf.float32)
          for s in shapes]


def _variables(shapes=SHAPES):
  return [tf.Variable(tf.zeros(s)) for s in shapes]


def _public(case, shapes=SHAPES):
  return _grads(99, batch=16, shapes=shapes) if case.needs_public else None


def _update(privatizer, grads, state, key, public, physical_batch_size=None):
  """`privatizer.update`, or with `physical_batch_size` the same step over
  physical batches of that many rows (virtual batches; the last one padded
  with zero rows)."""
  if physical_batch_size is None:
    return privatizer.update(grads, state, key, public_grads=public)
  chunks, num_chunks = virtual_batches.split(grads, physical_batch_size)

  def chunk(i):
    return gradients.MaterializedGradients([g[i] for g in chunks]), tuple
  out, state, _ = virtual_batches.update(privatizer, state, key, num_chunks,
                                         chunk, public)
  return out, state


# Virtual batches (`physical_batch_size`) must release what one whole batch
# releases: the checks of noise and sensitivity run both ways.
PHYSICAL_BATCH_SIZES = [None, 3]


def _run(case, privatizer, grads, steps, shapes=SHAPES, seed=(3, 0),
         physical_batch_size=None):
  """Runs `update` through steps 0..max(steps); returns {step: (out, state)}."""
  public = _public(case, shapes)
  state = privatizer.init(_variables(shapes))
  outputs = {}
  for step in range(max(steps) + 1):
    key = tf.constant([seed[0], seed[1] + step], tf.int64)
    out, state = _update(privatizer, grads, state, key, public,
                         physical_batch_size)
    if step in steps:
      outputs[step] = ([o.numpy() for o in out], state)
  return outputs


@pytest.fixture(params=CASES, ids=lambda c: c.name)
def case(request):
  return request.param


def test_config_round_trips_through_json(case):
  privatizer = case.make(1.1, 0.7)
  description = json.loads(json.dumps(tfdpx.serialize(privatizer)))
  rebuilt = tfdpx.deserialize(description)
  assert rebuilt == privatizer
  assert rebuilt.config == privatizer.config


def test_update_is_pure(case):
  privatizer = case.make(1.0, 1.0)
  grads = _grads(0)
  first = _run(case, privatizer, grads, case.steps)
  second = _run(case, privatizer, grads, case.steps)
  other_seed = _run(case, privatizer, grads, case.steps, seed=(4, 0))
  for step in case.steps:
    for a, b, c in zip(first[step][0], second[step][0], other_seed[step][0]):
      np.testing.assert_array_equal(a, b)
      assert not np.array_equal(a, c)


def test_state_keeps_its_structure(case):
  privatizer = case.make(1.0, 1.0)
  initial = privatizer.init(_variables())
  final = _run(case, privatizer, _grads(0), case.steps)[max(case.steps)][1]
  tf.nest.assert_same_structure(initial, final)
  for a, b in zip(tf.nest.flatten(initial), tf.nest.flatten(final)):
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    assert a.dtype == b.dtype and a.shape == b.shape


def _jit_cases():
  """Every case; of the sparsified ones, around DP-SGD and DPDR (a stateful
  inner) only but in `make test-all`: the wrapper's ops are the same around
  every inner, and each inner is compiled alone."""
  kept = ('sparsified(gaussian)', 'sparsified(dpdr)')
  return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if (
      c.name.startswith('sparsified(') and c.name not in kept) else [])
          for c in CASES]


@pytest.mark.parametrize('case', _jit_cases())
def test_jit_compile_matches_eager(case):
  privatizer = case.make(1.0, 1.0)
  grads = _grads(1)
  public = _public(case)
  state = privatizer.init(_variables())
  compiled = tf.function(
      lambda g, s, k, p: privatizer.update(g, s, k, public_grads=p),
      jit_compile=True)
  for step in range(max(case.steps) + 1):
    key = tf.constant([5, step], tf.int64)
    eager_out, eager_state = privatizer.update(grads, state, key,
                                               public_grads=public)
    xla_out, _ = compiled(grads, state, key, public)
    if step in case.steps:
      for a, b in zip(eager_out, xla_out):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-5)
    state = eager_state


def test_zero_noise_infinite_clip_gives_the_noiseless_result(case):
  privatizer = case.make(0.0, math.inf)
  grads = _grads(2)
  expected = case.noiseless_expected(grads, _public(case))
  for step, (out, _) in _run(case, privatizer, grads, case.steps).items():
    for a, b in zip(out, expected):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5,
                                 err_msg=f'step {step}')


@pytest.mark.parametrize('physical_batch_size', PHYSICAL_BATCH_SIZES)
def test_removing_one_example_moves_the_sum_by_at_most_the_sensitivity(
    case, physical_batch_size):
  """Each step is compared from the same incoming state.

  A step's sensitivity is conditional on the released history: a privatizer
  whose state follows its outputs (DPDR's direction) is adaptive composition,
  so the neighbouring batch must see the state the full batch's history left.
  """
  l2_norm_clip = 0.5
  privatizer = case.make(0.0, l2_norm_clip)
  grads = _grads(3, scale=100.0)  # Far above the clip norm.
  public = _public(case)
  bound = case.sensitivity(l2_norm_clip) * (1 + 1e-5)
  state = privatizer.init(_variables())
  for step in range(max(case.steps) + 1):
    key = tf.constant([3, step], tf.int64)
    full, next_state = _update(privatizer, grads, state, key, public,
                               physical_batch_size)
    if step in case.steps:
      for i in range(BATCH):
        fewer = [tf.concat([g[:i], g[i + 1:]], axis=0) for g in grads]
        out, _ = _update(privatizer, fewer, state, key, public,
                         physical_batch_size)
        diff = math.sqrt(sum(np.sum(np.square(a.numpy() - b.numpy()))
                             for a, b in zip(out, full)))
        assert diff <= bound, (step, i, diff, bound)
    state = next_state


@pytest.mark.parametrize('physical_batch_size', PHYSICAL_BATCH_SIZES)
def test_noise_std_is_what_the_event_claims(case, physical_batch_size):
  """Two-sided: measured std equals the claim, and 3% more or less fails.

  Through virtual batches the noise is drawn once per logical batch: once
  per physical batch would show as a larger std.
  """
  noise_multiplier, l2_norm_clip = 1.3, 0.8
  privatizer = case.make(noise_multiplier, l2_norm_clip)
  shapes = [(300, 300), (100,)]
  zeros = [tf.zeros((4,) + s) for s in shapes]
  outputs = _run(case, privatizer, zeros, case.steps, shapes=shapes,
                 physical_batch_size=physical_batch_size)
  checked = 0
  for step, (out, _) in outputs.items():
    expected = case.noise_std(privatizer, step, l2_norm_clip)
    if expected is None:
      continue
    samples = np.concatenate([o.ravel() for o in out])
    assert stats.relative_tolerance(samples.size) < 0.012
    assert stats.std_matches(samples, expected), (step, samples.std(), expected)
    assert not stats.std_matches(samples, expected * 1.03)
    assert not stats.std_matches(samples, expected / 1.03)
    checked += 1
  if not checked and case.noise_std(privatizer, case.steps[0], None) is None:
    pytest.skip(f'{case.name}: the output noise is not per-coordinate '
                'Gaussian; its own tests check it against dp_event')
  assert checked, 'no step of this case has a noise check'


def test_virtual_batches_release_what_the_whole_batch_releases(case):
  """Same noise key: equal outputs and states up to float summation order,
  at every checked step (DPDR's later steps follow its released history)."""
  privatizer = case.make(1.0, 0.5)
  grads = _grads(4)
  whole = _run(case, privatizer, grads, case.steps)
  for physical_batch_size in (1, 3, BATCH):
    parts = _run(case, privatizer, grads, case.steps,
                 physical_batch_size=physical_batch_size)
    for step in case.steps:
      for a, b in zip(whole[step][0], parts[step][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                   err_msg=f'step {step}')
      for a, b in zip(tf.nest.flatten(whole[step][1]),
                      tf.nest.flatten(parts[step][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                   atol=1e-6, err_msg=f'step {step}')


def test_accountant_accepts_the_events(case):
  privatizer = case.make(1.0, 1.0)
  sampling = {'sampling': 'poisson', 'sampling_probability': 0.01}
  strategy = privatizer.correlation
  if strategy is not None:  # Banded: amplified by cyclic sampling only.
    sampling = ({'sampling': 'shuffle', 'steps_per_epoch': 10}
                if strategy.bands is None else
                {'sampling': 'cyclic_poisson', 'groups': strategy.bands,
                 'sampling_probability': 0.01})
  eps = tfdpx.accounting.epsilon_for_sampling(
      privatizer, steps=max(case.steps) + 20, delta=1e-5, **sampling)
  assert 0 < eps < math.inf
