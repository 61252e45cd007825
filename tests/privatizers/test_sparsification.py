"""Random sparsification (spec random_sparsification.md §6)."""

import json
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tfdpx
from tests import stats
from tfdpx import core
from tfdpx import privatizers
from tfdpx.privatizers import sparsification
from tests.compile_path import trainable

SHAPES = [(6, 5), (5,), (3, 2, 4)]
D = 30 + 5 + 24


class _Echo(core.Privatizer):
  """Test double: returns the (masked) per-example gradients it receives."""

  def clipped_sums(self, per_example_grads, state, plan):
    return per_example_grads.materialized()

  def release(self, sums, state, plan, seed):
    return sums, state

  def dp_event(self, step):
    return dp_accounting.NoOpDpEvent()

  @property
  def config(self):
    return {}


def _grads(seed, batch=4, shapes=SHAPES, scale=1.0):
  rng = np.random.default_rng(seed)
  # Bounded away from zero, so a zero after masking is the mask's doing.
  return [tf.constant(scale * rng.choice([-1, 1], size=(batch,) + s) *
                      rng.uniform(0.5, 1.5, size=(batch,) + s), tf.float32)
          for s in shapes]


def _variables(shapes=SHAPES):
  return [tf.Variable(tf.zeros(s)) for s in shapes]


def _flat(tensors):
  return np.concatenate([np.asarray(t).ravel() for t in tensors])


def _expected_num_zeroed(final_sparsity, windows, window, d):
  """The spec's formula, written out independently: floor(r* k / (K-1) d)."""
  rate = (final_sparsity * window) / max(windows - 1, 1)
  return math.floor(min(rate, final_sparsity) * d)


def _echo_steps(wrapper, num_steps, grads=None, seed0=0):
  """Per-example masked gradients at steps 0..num_steps-1, flattened per example."""
  grads = grads if grads is not None else _grads(0)
  state = wrapper.init(_variables())
  out = []
  for step in range(num_steps):
    echo, state = wrapper.update(
        grads, state, tf.constant([seed0, step], tf.int64))
    batch = echo[0].shape[0]
    out.append(np.stack([_flat([e[i] for e in echo]) for i in range(batch)]))
  return out


# --- schedule ----------------------------------------------------------------


@pytest.mark.parametrize('final_sparsity, epochs, expected', [
    (0.9, 48, {0: 0, 1: 10_542, 24: 253_027, 46: 484_970, 47: 495_513}),
    (0.5, 40, {0: 0, 1: 7_058, 20: 141_171, 38: 268_226, 39: 275_285}),
    (0.7, 60, {0: 0, 1: 6_532, 30: 195_965, 58: 378_866, 59: 385_399}),
])
def test_schedule_matches_the_spec_test_vectors(final_sparsity, epochs,
                                                expected):
  wrapper = privatizers.sparsified(privatizers.gaussian(1.0, 1.0),
                                   final_sparsity, epochs, 50)
  for epoch, zeros in expected.items():
    assert wrapper.window(epoch * 50) == epoch
    assert wrapper.window(epoch * 50 + 49) == epoch
    assert wrapper.num_zeroed(epoch, 550_570) == zeros
  assert wrapper.sparsity(epochs - 1) == final_sparsity
  assert wrapper.sparsity(epochs + 5) == final_sparsity  # Capped after E.


def test_refresh_schedule_matches_the_spec_test_vectors():
  wrapper = privatizers.sparsified(privatizers.gaussian(1.0, 1.0), 0.9, 40,
                                   50, refreshes_per_epoch=5)
  expected = {0: 0, 1: 2_490, 4: 9_960, 5: 12_450, 199: 495_513}
  for window, zeros in expected.items():
    assert wrapper.num_zeroed(window, 550_570) == zeros


def test_the_graph_schedule_equals_the_python_schedule():
  wrapper = privatizers.sparsified(privatizers.gaussian(1.0, 1.0), 0.9, 48,
                                   50)
  windows = tf.range(60, dtype=tf.int64)
  python = [wrapper.num_zeroed(k, 550_570) for k in range(60)]
  eager = wrapper._num_zeroed_tensor(windows, 550_570)
  xla = tf.function(lambda k: wrapper._num_zeroed_tensor(k, 550_570),
                    jit_compile=True)(windows)
  np.testing.assert_array_equal(eager.numpy(), python)
  np.testing.assert_array_equal(xla.numpy(), python)
  for k in (1, 47):  # The mask itself has exactly that many zeros.
    mask = wrapper.masks(k, [(550_570,)])[0].numpy()
    assert np.sum(mask == 0) == python[k]
    assert set(np.unique(mask)) == {0.0, 1.0}


@pytest.mark.parametrize('high_range,low_range', [
    (2**32, 2**31), (3, 2**31), (2**32, 4), (2, 2), (1, 1), (70_000, 3)],
    ids=['distinct', 'high-ties', 'low-ties', 'few-keys', 'all-equal',
         'both'])
def test_smallest_keys_are_those_a_stable_argsort_puts_first(high_range,
                                                             low_range):
  rng = np.random.default_rng(high_range + low_range)
  n = 3000
  high = rng.integers(0, high_range, n, dtype=np.uint64).astype(np.uint32)
  low = rng.integers(0, low_range, n, dtype=np.uint64).astype(np.uint32)
  order = np.argsort(high.astype(np.int64) * 2**31 + low, kind='stable')
  # The default gathers every tied entry of these keys; 8 candidates take
  # every pass over all of them where more than 8 stay tied.
  bits = np.stack([high, 2 * low + (low % 2)], axis=1)  # The low bit unread.
  select = [tf.function(lambda b, c, k=k: sparsification.smallest_keys(
      b, c, k), jit_compile=xla) for k in (None, 8) for xla in (False, True)]
  for count in (0, 1, 1234, n - 1, n):
    expected = np.zeros(n, bool)
    expected[order[:count]] = True
    for fn in select:
      np.testing.assert_array_equal(
          fn(bits, tf.constant(count, tf.int64)).numpy(), expected)


def test_kept_fraction_follows_the_schedule_in_every_epoch():
  epochs = 7
  wrapper = privatizers.sparsified(_Echo(), 0.9, epochs, steps_per_epoch=3)
  outputs = _echo_steps(wrapper, epochs * 3)
  zero_counts = []
  for step, per_example in enumerate(outputs):
    epoch = step // 3
    zeros = int(np.sum(per_example[0] == 0))
    assert zeros == _expected_num_zeroed(0.9, epochs, epoch, D), step
    zero_counts.append(zeros)
  assert zero_counts[0] == 0  # Epoch 0 is plain DP-SGD.
  assert zero_counts[-1] == math.floor(0.9 * D)
  # Linear cooling: the mean rate over epochs is r*/2 up to the floor.
  assert abs(np.mean(zero_counts) / D - 0.45) <= 1 / D


def test_a_single_window_warns_and_never_masks():
  with pytest.warns(UserWarning, match='single window'):
    wrapper = privatizers.sparsified(_Echo(), 0.9, epochs=1, steps_per_epoch=4)
  for per_example in _echo_steps(wrapper, 6):
    assert np.all(per_example != 0)


def test_refreshes_give_that_many_masks_per_epoch():
  wrapper = privatizers.sparsified(_Echo(), 0.6, epochs=2, steps_per_epoch=7,
                                   refreshes_per_epoch=3)
  # Windows of 7 // 3 = 2 steps; the last window of an epoch takes the rest.
  assert [wrapper.window(s) for s in range(14)] == [
      0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4, 5, 5, 5]
  outputs = _echo_steps(wrapper, 14)
  zero_sets = [frozenset(np.flatnonzero(o[0] == 0)) for o in outputs]
  assert len(set(zero_sets[7:])) == 3
  for step, zeros in enumerate(zero_sets):
    assert len(zeros) == _expected_num_zeroed(0.6, 6, wrapper.window(step), D)


# --- the mask ----------------------------------------------------------------


def test_mask_is_shared_by_examples_and_steps_and_changes_between_windows():
  wrapper = privatizers.sparsified(_Echo(), 0.8, epochs=4, steps_per_epoch=3)
  outputs = _echo_steps(wrapper, 12)
  windows = []
  for step, per_example in enumerate(outputs):
    zero = per_example == 0
    assert np.all(zero == zero[0]), f'examples disagree at step {step}'
    if step % 3:
      np.testing.assert_array_equal(zero[0], windows[-1])
    else:
      windows.append(zero[0])
  for a, b in zip(windows[1:], windows[2:]):
    assert not np.array_equal(a, b)


def test_same_mask_seed_same_masks_whatever_the_data_and_noise_seed():
  def zero_pattern(mask_seed, grads_seed, noise_seed):
    wrapper = privatizers.sparsified(_Echo(), 0.7, epochs=3,
                                     steps_per_epoch=2, mask_seed=mask_seed)
    return [o == 0 for o in _echo_steps(wrapper, 6, _grads(grads_seed),
                                        seed0=noise_seed)]

  reference = zero_pattern(4, 0, 0)
  for other in (zero_pattern(4, 0, 0), zero_pattern(4, 1, 9)):
    for a, b in zip(reference, other):
      np.testing.assert_array_equal(a, b)
  different = zero_pattern(5, 0, 0)
  assert not np.array_equal(reference[-1], different[-1])


def test_mask_is_recomputed_from_the_restored_state():
  wrapper = privatizers.sparsified(_Echo(), 0.7, epochs=3, steps_per_epoch=4)
  grads = _grads(0)
  state = wrapper.init(_variables())
  for step in range(5):
    _, state = wrapper.update(grads, state, tf.constant([0, step], tf.int64))
  before, _ = wrapper.update(grads, state, tf.constant([0, 5], tf.int64))
  config = {k: v for k, v in wrapper.config.items() if k != 'inner'}
  rebuilt = privatizers.Sparsified(_Echo(), **config)
  # A fresh state at the same step: no masks kept, so they are drawn again
  # from the window alone (`before` used the masks kept since step 4).
  restored = rebuilt.init(_variables())
  restored['step'] = tf.constant(int(state['step']), tf.int64)
  after, _ = rebuilt.update(grads, restored, tf.constant([0, 5], tf.int64))
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_masked_coordinates_are_uniform_over_windows():
  """Each coordinate is masked in a Binomial(windows, r) number of windows."""
  windows = 300
  wrapper = privatizers.sparsified(_Echo(), 0.5, epochs=2, steps_per_epoch=1)
  shapes = [(10,), (4, 5)]
  counts = np.zeros(30)
  per_variable = set()
  draw = tf.function(lambda k: wrapper.masks(k, shapes))
  for k in range(1, windows + 1):  # r = 0.5 from window 1 on: 15 zeros.
    masks = [m.numpy() for m in draw(tf.constant(k, tf.int64))]
    counts += _flat(masks) == 0
    per_variable.add(int(np.sum(masks[0] == 0)))
  tolerance = stats.Z * math.sqrt(windows * 0.25)
  assert np.all(np.abs(counts - windows * 0.5) < tolerance), counts
  # Global sampling: the zeros per variable vary (hypergeometric).
  assert len(per_variable) > 3


# --- the step ----------------------------------------------------------------


def test_masks_before_clipping_and_does_not_rescale():
  """An example above C whose masked norm is below C keeps its masked values."""
  wrapper = privatizers.sparsified(privatizers.gaussian(1.0, 0.0), 0.5,
                                   epochs=2, steps_per_epoch=1)
  masks = wrapper.masks(1, [(40,)])
  mask = masks[0].numpy()
  rng = np.random.default_rng(0)
  grad = np.where(mask == 1, rng.uniform(-0.1, 0.1, 40), 5.0)
  assert np.linalg.norm(grad) > 1.0 >= np.linalg.norm(grad * mask)
  state = wrapper.init(_variables([(40,)]))
  _, state = wrapper.update([tf.zeros((1, 40))], state,
                            tf.constant([0, 0], tf.int64))
  out, _ = wrapper.update([tf.constant(grad[None], tf.float32)], state,
                          tf.constant([0, 1], tf.int64))
  np.testing.assert_allclose(out[0].numpy(), grad * mask, rtol=1e-6)


def test_no_rescaling_with_infinite_clip():
  wrapper = privatizers.sparsified(privatizers.gaussian(math.inf, 0.0), 0.9,
                                   epochs=3, steps_per_epoch=1)
  grads = _grads(3)
  state = wrapper.init(_variables())
  for step in range(3):
    out, state = wrapper.update(grads, state, tf.constant([0, step], tf.int64))
  masks = wrapper.masks(2, SHAPES)
  for o, g, m in zip(out, grads, masks):
    np.testing.assert_array_equal(o.numpy(), (tf.reduce_sum(g, 0) * m).numpy())


def test_noise_only_on_kept_coordinates():
  noise_multiplier, l2_norm_clip = 1.3, 0.8
  wrapper = privatizers.sparsified(
      privatizers.gaussian(l2_norm_clip, noise_multiplier), 0.5, epochs=2,
      steps_per_epoch=1)
  shapes = [(400, 250), (50,)]
  state = wrapper.init(_variables(shapes))
  grads = _grads(4, shapes=shapes, scale=10.0)  # Non-zero everywhere.
  for step in range(2):
    out, state = wrapper.update(grads, state, tf.constant([1, step], tf.int64))
  mask = _flat(wrapper.masks(1, shapes))
  assert np.all(_flat(out)[mask == 0] == 0)  # Bitwise zero, noise included.
  zeros = [tf.zeros((4,) + s) for s in shapes]
  state = wrapper.init(_variables(shapes))
  for step in range(2):
    out, state = wrapper.update(zeros, state, tf.constant([1, step], tf.int64))
  kept = _flat(out)[mask == 1]
  assert stats.relative_tolerance(kept.size) < 0.02
  expected = noise_multiplier * l2_norm_clip
  assert stats.std_matches(kept, expected)
  assert not stats.std_matches(kept, expected * 1.03)
  assert not stats.std_matches(kept, expected / 1.03)


def test_zero_sparsity_is_the_inner_privatizer_bitwise():
  inner = privatizers.gaussian(1.0, 1.1)
  wrapper = privatizers.sparsified(inner, 0.0, epochs=3, steps_per_epoch=2)
  grads = _grads(5)
  state = wrapper.init(_variables())
  for step in range(6):
    seed = tf.constant([2, step], tf.int64)
    out, state = wrapper.update(grads, state, seed)
    plain, _ = inner.update(grads, {}, seed)
    for a, b in zip(out, plain):
      np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_wraps_public_gradients_with_the_same_mask():
  class _PublicEcho(_Echo):
    requires_public_grads = True

    def prepare(self, state, seed, per_example_grads, public_grads):
      return public_grads.materialized()

    def clipped_sums(self, per_example_grads, state, plan):
      return []

    def release(self, sums, state, plan, seed):
      return plan, state

  wrapper = privatizers.sparsified(_PublicEcho(), 0.5, 2, 1)
  assert wrapper.requires_public_grads
  state = wrapper.init(_variables())
  for step in range(2):
    out, state = wrapper.update(_grads(0), state,
                                tf.constant([0, step], tf.int64),
                                public_grads=_grads(1, batch=3))
  mask = _flat(wrapper.masks(1, SHAPES))
  for i in range(3):
    np.testing.assert_array_equal(_flat([o[i] for o in out]) == 0, mask == 0)


# --- privacy -----------------------------------------------------------------


@pytest.mark.parametrize('final_sparsity', [0.0, 0.5, 0.9])
def test_epsilon_equals_the_inner_privatizers(final_sparsity):
  inner = privatizers.gaussian(1.0, 1.5409)
  wrapper = privatizers.sparsified(inner, final_sparsity, epochs=40,
                                   steps_per_epoch=50)
  assert wrapper.dp_event(7) == inner.dp_event(7)
  kwargs = dict(steps=2000, sampling_probability=0.02, delta=1e-5)
  eps = tfdpx.accounting.epsilon(wrapper, **kwargs)
  assert eps == tfdpx.accounting.epsilon(inner, **kwargs)
  assert eps == pytest.approx(3.0, abs=0.01)  # Spec §3.2 regression value.


def test_calibration_works_through_the_wrapper():
  inner = privatizers.gaussian(1.0, 1.0)
  wrapper = privatizers.sparsified(inner, 0.9, epochs=48, steps_per_epoch=50,
                                   mask_seed=3)
  assert wrapper.noise_multiplier == 1.0
  moved = wrapper.with_noise_multiplier(2.5)
  assert moved.inner == privatizers.gaussian(1.0, 2.5)
  assert moved.noise_multiplier == 2.5
  assert {k: v for k, v in moved.config.items() if k != 'inner'} == {
      k: v for k, v in wrapper.config.items() if k != 'inner'}
  kwargs = dict(steps=2400, sampling_probability=0.02, delta=1e-5)
  sigma = tfdpx.accounting.calibrate_noise_multiplier(3.0, wrapper, **kwargs)
  assert sigma == tfdpx.accounting.calibrate_noise_multiplier(3.0, inner,
                                                              **kwargs)
  assert sigma == pytest.approx(1.6531, abs=0.01)  # Spec §2.3.
  assert tfdpx.accounting.epsilon(wrapper.with_noise_multiplier(sigma),
                                  **kwargs) <= 3.0


def test_config_nests_the_inner_privatizer():
  wrapper = privatizers.sparsified(privatizers.gaussian(0.5, 1.2), 0.7, 10,
                                   25, refreshes_per_epoch=5, mask_seed=8)
  assert wrapper.config['inner'] == tfdpx.serialize(
      privatizers.gaussian(0.5, 1.2))
  rebuilt = tfdpx.deserialize(tfdpx.serialize(wrapper))
  assert rebuilt == wrapper and rebuilt.inner == wrapper.inner
  assert rebuilt != privatizers.sparsified(privatizers.gaussian(0.5, 1.2),
                                           0.7, 10, 25, refreshes_per_epoch=5,
                                           mask_seed=9)


@pytest.mark.parametrize('kwargs, name', [
    (dict(final_sparsity=1.0), 'final_sparsity'),
    (dict(final_sparsity=-0.1), 'final_sparsity'),
    (dict(final_sparsity='x'), 'final_sparsity'),
    (dict(epochs=0), 'epochs'),
    (dict(epochs=2.5), 'epochs'),
    (dict(steps_per_epoch=0), 'steps_per_epoch'),
    (dict(refreshes_per_epoch=11), 'refreshes_per_epoch'),
    (dict(steps_per_epoch='x'), 'steps_per_epoch'),
    (dict(mask_seed=-1), 'mask_seed'),
    (dict(mask_seed=None), 'mask_seed'),
    (dict(inner='gaussian'), 'inner'),
])
def test_bad_arguments_are_rejected_by_name(kwargs, name):
  arguments = dict(inner=privatizers.gaussian(1.0, 1.0), final_sparsity=0.5,
                   epochs=3, steps_per_epoch=10)
  arguments.update(kwargs)
  with pytest.raises(ValueError, match=name):
    privatizers.Sparsified(**arguments)


def test_a_single_coordinate_works():
  wrapper = privatizers.sparsified(_Echo(), 0.9, epochs=2, steps_per_epoch=1)
  out = _echo_steps(wrapper, 2, [tf.ones((2, 1))])
  assert np.all(out[0] == 1) and np.all(out[1] == 1)  # floor(0.9 * 1) = 0.


# --- through a Keras optimizer -----------------------------------------------

_EPOCHS, _STEPS, _BATCH = 3, 4, 8


def _fit_and_trace(make_optimizer, final_sparsity=0.8, epochs=_EPOCHS,
                   slot_names=()):
  """Fits a tiny model; returns the privatizer and per-step snapshots.

  Each snapshot holds the flattened trainable weights and the flattened
  optimizer slots `slot_names` (`None` before the first step).
  """
  tf.keras.utils.set_random_seed(0)
  model = trainable(tf.keras.Sequential([
      tf.keras.layers.Dense(6, activation='tanh', input_shape=(5,)),
      tf.keras.layers.Dense(3)]))
  wrapper = privatizers.sparsified(
      privatizers.gaussian(1.0, 1.0), final_sparsity, epochs=_EPOCHS,
      steps_per_epoch=_STEPS, mask_seed=5)
  optimizer = make_optimizer(wrapper)
  model.compile(optimizer=optimizer,
                loss=tf.keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True,
                    reduction='none'))
  snapshots = []

  def weights():
    return _flat([v.numpy() for v in model.trainable_variables])

  def snapshot():
    slots = [optimizer.get_slot(v, name).numpy().ravel()
             for name in slot_names for v in model.trainable_variables]
    return weights(), np.concatenate(slots) if slots else None

  class Trace(tf.keras.callbacks.Callback):

    def on_train_begin(self, logs=None):
      snapshots.append((weights(), None))

    def on_train_batch_end(self, batch, logs=None):
      snapshots.append(snapshot())

  rng = np.random.default_rng(1)
  x = rng.normal(size=(_STEPS * _BATCH, 5)).astype(np.float32)
  y = rng.integers(0, 3, size=_STEPS * _BATCH)
  model.fit(x, y, batch_size=_BATCH, epochs=epochs, shuffle=True, verbose=0,
            callbacks=[Trace()])
  shapes = [v.shape for v in model.trainable_variables]
  masks = [_flat(wrapper.masks(wrapper.window(step), shapes))
           for step in range(len(snapshots) - 1)]
  assert int(optimizer.dp_steps.numpy()) == len(masks)
  return masks, snapshots


def test_plain_sgd_leaves_masked_coordinates_exactly_unchanged():
  masks, snapshots = _fit_and_trace(
      lambda p: tfdpx.keras.DPSGD(privatizer=p, expected_batch_size=_BATCH,
                                  learning_rate=0.5, momentum=0.0, noise_seed=1))
  d = masks[0].size
  for step, mask in enumerate(masks):
    before, after = snapshots[step][0], snapshots[step + 1][0]
    moved = after != before
    # Exactly the kept coordinates move (noise included), in every step.
    np.testing.assert_array_equal(moved, mask == 1, err_msg=f'step {step}')
    epoch = step // _STEPS
    assert np.sum(~moved) == _expected_num_zeroed(0.8, _EPOCHS, epoch, d)


@pytest.mark.keras2_only('reads optimizer slots (get_slot), a Keras 2 API')
def test_momentum_is_not_reset_on_masked_coordinates():
  """Keras momentum: v <- mu v - lr g; w <- w + v. With g = 0, v decays by mu."""
  momentum = 0.9
  masks, snapshots = _fit_and_trace(
      lambda p: tfdpx.keras.DPSGD(privatizer=p, expected_batch_size=_BATCH,
                                  learning_rate=0.5, momentum=momentum,
                                  noise_seed=1),
      slot_names=('momentum',))
  checked = 0
  for step in range(1, len(masks)):
    masked = masks[step] == 0
    velocity_before = snapshots[step][1]
    velocity_after = snapshots[step + 1][1]
    np.testing.assert_allclose(velocity_after[masked],
                               momentum * velocity_before[masked], rtol=1e-6)
    np.testing.assert_allclose(
        (snapshots[step + 1][0] - snapshots[step][0])[masked],
        velocity_after[masked], rtol=1e-4, atol=1e-7)
    checked += np.sum(masked & (velocity_before != 0))
  assert checked > 0  # Masked coordinates with momentum did move.


@pytest.mark.keras2_only('reads optimizer slots (get_slot), a Keras 2 API')
def test_adam_moments_decay_on_masked_coordinates():
  """Masked coordinates get g = 0: m <- b1 m, v <- b2 v, and w may move."""
  masks, snapshots = _fit_and_trace(
      lambda p: tfdpx.keras.DPAdam(privatizer=p, expected_batch_size=_BATCH,
                                   learning_rate=0.05, noise_seed=1),
      slot_names=('m', 'v'))
  moved_while_masked = 0
  for step in range(1, len(masks)):
    masked = masks[step] == 0
    d = masked.size
    m0, v0 = snapshots[step][1][:d], snapshots[step][1][d:]
    m1, v1 = snapshots[step + 1][1][:d], snapshots[step + 1][1][d:]
    np.testing.assert_allclose(m1[masked], 0.9 * m0[masked], rtol=1e-6)
    np.testing.assert_allclose(v1[masked], 0.999 * v0[masked], rtol=1e-6)
    moved = snapshots[step + 1][0] != snapshots[step][0]
    moved_while_masked += np.sum(moved & masked)
  assert moved_while_masked > 0


def test_optimizer_config_round_trips_the_wrapper_through_json():
  wrapper = privatizers.sparsified(privatizers.gaussian(0.5, 1.2), 0.7, 10,
                                   25, mask_seed=8)
  optimizer = tfdpx.keras.DPSGD(privatizer=wrapper, expected_batch_size=32,
                                learning_rate=0.1)
  config = json.loads(json.dumps(optimizer.get_config()))
  rebuilt = tfdpx.keras.DPSGD.from_config(config)
  assert rebuilt.privatizer == wrapper
