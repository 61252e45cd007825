"""Random sparsification (RS): a wrapper that masks any other noise step.

Each window (by default one epoch) draws one data-independent random mask over
all trainable coordinates together and zeros exactly `floor(r * d)` of them;
the rate `r` rises linearly from 0 to `final_sparsity` ("gradual cooling").
The mask multiplies every example's gradient before the inner privatizer clips
it, and multiplies the inner privatizer's noisy output, so masked coordinates
carry neither signal nor noise. See `/shared/specs/random_sparsification.md`.
"""

import math
import warnings
from typing import Any, Dict, List, Sequence

import tensorflow as tf

from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx import philox

_MASK_STREAM = 'sparsification_mask'


# Radix selection reads 8 bits a pass: a histogram of 256 bins, whose prefix
# sum XLA's CPU backend (quadratic in the length) still does at once.
_DIGIT_BITS = 8


def _radix_passes(words, passes, chosen, tied, remaining):
  """Radix selection over the digits `passes` (`(word, shift)`, most
  significant first) of the keys `words`.

  `chosen` holds the entries already chosen, `tied` those still equal to the
  boundary (the `remaining`-th smallest of them is the last to choose);
  returns the three after the passes.
  """
  bins = 1 << _DIGIT_BITS
  for word, shift in passes:
    # One pass at a time: the executor would otherwise form every pass's
    # digits at once.
    with tf.control_dependencies([tied]):
      digit = tf.cast(tf.bitwise.bitwise_and(
          tf.bitwise.right_shift(words[word], shift), bins - 1), tf.int32)
    up_to = tf.cumsum(tf.math.unsorted_segment_sum(
        tf.cast(tied, tf.int32), digit, bins))
    # Digits below `boundary` are chosen whole; the boundary's digit is
    # `boundary` (`bins` when every tied entry is chosen).
    boundary = tf.reduce_sum(tf.cast(up_to <= remaining, tf.int32))
    chosen = tf.logical_or(chosen, tf.logical_and(tied, digit < boundary))
    tied = tf.logical_and(tied, tf.equal(digit, boundary))
    remaining -= tf.gather(tf.concat([[0], up_to], axis=0), boundary)
  return chosen, tied, remaining


# The digits of a key `high * 2^31 + low` extended by its index (which breaks
# ties as a stable sort does): word 0 the high word, 1 the low, 2 the index.
_PASSES = [(word, shift) for word in range(3)
           for shift in range(32 - _DIGIT_BITS, -1, -_DIGIT_BITS)]
# Passes over all the keys before the entries still tied are gathered.
_WIDE_PASSES = 2


def smallest_keys(bits: tf.Tensor, count, candidates: int = None) -> tf.Tensor:
  """Which of the keys `bits[:, 0] * 2^31 + bits[:, 1] / 2` are the `count`
  smallest.

  Exactly the entries an ascending stable argsort of the 63-bit keys puts
  first (ties to the lower index), by radix selection instead of a sort: over
  the encoder's 5.2M weights the stable argsort of int64 keys took 1.5 s and
  216 MiB at its peak, this 0.4 s and 155 MiB. Two passes read the top 16
  bits of every key; the entries still tied with the boundary (about n /
  65536 of them for random keys) are gathered, at most `candidates` of them,
  and the remaining passes run on those alone. More tied entries than that
  (keys far from uniform) take every pass over all the keys: slower, the
  same result.

  Args:
    bits: uint32 `[n, 2]`, `n` static.
    count: how many to select (integer scalar, 0 to n).
    candidates: how many tied entries are gathered (default `4096 + n /
      4096`, about 64 times as many as random keys leave).

  Returns:
    bool `[n]`, True for the selected keys.
  """
  n = int(bits.shape[0])
  # As int32 (a uint32 gather has no GPU kernel); a digit masks off the sign.
  keys = (tf.bitcast(bits[:, 0], tf.int32),
          tf.bitcast(tf.bitwise.right_shift(bits[:, 1], 1), tf.int32),
          tf.range(n))
  chosen, tied, remaining = _radix_passes(
      keys, _PASSES[:_WIDE_PASSES], tf.zeros([n], tf.bool),
      tf.ones([n], tf.bool), tf.cast(count, tf.int32))
  cap = min(n, candidates or 4096 + n // 4096)

  def gathered():
    # `top_k` gathers the tied entries, in a static shape; their order does
    # not matter, the index being a digit.
    where = tf.math.top_k(tf.cast(tied, tf.int32), k=cap).indices
    picked, _, _ = _radix_passes(
        [tf.gather(w, where) for w in keys], _PASSES[_WIDE_PASSES:],
        tf.zeros([cap], tf.bool), tf.gather(tied, where), remaining)
    return tf.logical_or(chosen, tf.scatter_nd(  # No GPU kernel for bool.
        where[:, tf.newaxis], tf.cast(picked, tf.int32), [n]) > 0)

  def every_pass():
    return _radix_passes(keys, _PASSES[_WIDE_PASSES:],
                         chosen, tied, remaining)[0]

  return tf.cond(tf.reduce_sum(tf.cast(tied, tf.int32)) <= cap, gathered,
                 every_pass)


def _masked(release, mask):
  """`release * mask`; for the selected rows of a table (`tf.IndexedSlices`,
  `sparse_embeddings`) the mask's rows."""
  if isinstance(release, tf.IndexedSlices):
    values = release.values
    return tf.IndexedSlices(
        values * tf.cast(tf.gather(mask, release.indices), values.dtype),
        release.indices, release.dense_shape)
  return release * tf.cast(mask, release.dtype)


def _check_int(name: str, value, minimum: int) -> int:
  """Validates an integer argument >= `minimum`; raises ValueError naming it."""
  try:
    ok = (not isinstance(value, bool) and int(value) == value and
          minimum <= value < 2**63)
  except (TypeError, ValueError, OverflowError):
    ok = False
  if not ok:
    raise ValueError(
        f'{name} must be an integer >= {minimum} (64-bit), got {value!r}')
  return int(value)


@core.register
class Sparsified(core.Wrapper):
  """DP-SGD with random sparsification around any privatizer (Zhu & Blaschko).

  Window `k` (one epoch by default, or `1 / refreshes_per_epoch` of one) has
  sparsity `r(k) = final_sparsity * k / max(refreshes_per_epoch * epochs - 1,
  1)`, capped at `final_sparsity` (spec §1.4; `r = 0` in the first window and
  for a single window). Its mask zeros `floor(r(k) * d)` coordinates drawn
  uniformly without replacement from all `d` coordinates of all variables
  together (not per variable). One step:

  1. multiply every example's gradient (and every public gradient) by the mask
     of the current window, the same mask for every example;
  2. run the inner privatizer on the masked gradients (it clips the masked
     gradients, so the clip norm is that of the masked vector: spec §1.5);
  3. multiply the inner privatizer's noisy sum by the mask, so masked
     coordinates get no noise. Nothing is rescaled (no `1 / (1 - r)`).

  The mask depends only on `mask_seed` and the window index (a stateless draw
  in its own stream, `noise.substream(..., "sparsification_mask")`), never on
  data, gradients or the noise seed. `mask_seed` is a public hyperparameter in
  `config`: the privacy argument conditions on the mask, so publishing it costs
  nothing, while the noise keeps its secret per-step `seed`. A per-step seed
  could not key the mask anyway, since one mask must serve every step of a
  window.

  With plain SGD (no momentum, no weight decay) masked coordinates do not move
  in that step. Optimizer slots are not touched: with momentum a masked
  coordinate keeps moving by its decaying velocity, and with Adam the moments
  decay while the parameter may still move (spec §1.6).

  Privacy:
    The mask is data-independent, so condition on it. Masking each example's
    gradient is a per-example transformation applied before the inner
    privatizer clips, so the inner privatizer's guarantee holds unchanged for
    the masked gradients (for `gaussian`: each masked gradient is clipped to
    global L2 norm `l2_norm_clip`, and the sum gets
    N(0, (noise_multiplier * l2_norm_clip)^2) noise); masking the output is
    post-processing. One step is therefore exactly the inner privatizer's
    event, `inner.dp_event(step)`, under the inner privatizer's adjacency
    (add/remove one example). RS neither costs nor saves privacy. Around
    `sparse_embeddings` the same holds: it clips and counts the masked
    gradients (an example's row counts where its unmasked gradient is not
    zero: still its own contribution), and the mask multiplies the
    selected rows it releases.

  References:
    Zhu & Blaschko, "Improving Differentially Private SGD via Randomly
    Sparsified Gradients", TMLR 2023.
  """

  name = 'sparsified'
  wraps_row_releases = True  # Its mask is gathered on the released rows.

  def __init__(self,
               inner: core.Privatizer,
               final_sparsity: float,
               epochs: int,
               steps_per_epoch: int,
               refreshes_per_epoch: int = 1,
               mask_seed: int = 0):
    """Args:
      inner: the privatizer to wrap, or its `tfdpx.serialize`d form.
      final_sparsity: `r*`, the fraction of coordinates zeroed in the last
        window, in [0, 1). The paper's runs use 0.5, 0.7 or 0.9.
      epochs: `E`, the number of epochs the schedule spans; training longer
        keeps `r = final_sparsity` with a new mask every window.
      steps_per_epoch: `S`, optimizer steps per epoch (`round(1 / q)` under
        Poisson sampling with probability `q`).
      refreshes_per_epoch: `R`, masks per epoch (spec §1.8(e)); each window
        has `S // R` steps and the last window of an epoch also takes the
        remaining `S % R` steps. The paper uses 1.
      mask_seed: public non-negative integer that keys the masks.

    Raises:
      ValueError: naming the argument that is out of range.
    """
    self._set_inner(inner)
    try:
      final_sparsity = float(final_sparsity)
    except (TypeError, ValueError):
      raise ValueError(
          f'final_sparsity must be a number, got {final_sparsity!r}') from None
    if not 0 <= final_sparsity < 1:
      raise ValueError(
          f'final_sparsity must be in [0, 1), got {final_sparsity!r}')
    epochs = _check_int('epochs', epochs, 1)
    steps_per_epoch = _check_int('steps_per_epoch', steps_per_epoch, 1)
    refreshes_per_epoch = _check_int('refreshes_per_epoch',
                                     refreshes_per_epoch, 1)
    if refreshes_per_epoch > steps_per_epoch:
      raise ValueError(
          f'refreshes_per_epoch must be at most steps_per_epoch '
          f'({steps_per_epoch}), got {refreshes_per_epoch!r}')
    mask_seed = _check_int('mask_seed', mask_seed, 0)
    if final_sparsity > 0 and epochs * refreshes_per_epoch == 1:
      warnings.warn(
          'sparsified: a single window (epochs * refreshes_per_epoch == 1) '
          'has sparsity 0, so nothing is sparsified (spec §1.4)')
    self._final_sparsity = final_sparsity
    self._epochs = epochs
    self._steps_per_epoch = steps_per_epoch
    self._refreshes = refreshes_per_epoch
    self._mask_seed = mask_seed
    # The rate the ramp reaches; a single window means no sparsification at
    # all, also when training runs past it (spec §1.4, P7).
    self._top = 0.0 if epochs * refreshes_per_epoch == 1 else final_sparsity

  @property
  def config(self) -> Dict[str, Any]:
    return {'inner': core.serialize(self._inner),
            'final_sparsity': self._final_sparsity,
            'epochs': self._epochs,
            'steps_per_epoch': self._steps_per_epoch,
            'refreshes_per_epoch': self._refreshes,
            'mask_seed': self._mask_seed}

  # --- schedule (the same arithmetic in Python and in the graph) -------------

  @property
  def _steps_per_window(self) -> int:
    return self._steps_per_epoch // self._refreshes

  @property
  def _denominator(self) -> float:
    return float(max(self._refreshes * self._epochs - 1, 1))

  def window(self, step: int) -> int:
    """The mask window of step `step` (0-based optimizer steps)."""
    epoch, within = divmod(int(step), self._steps_per_epoch)
    part = min(within // self._steps_per_window, self._refreshes - 1)
    return epoch * self._refreshes + part

  def sparsity(self, window: int) -> float:
    """`r(window)`: the fraction of coordinates zeroed in that window."""
    return min(self._top * float(window) / self._denominator, self._top)

  def num_zeroed(self, window: int, num_coordinates: int) -> int:
    """`floor(r(window) * d)` for `d = num_coordinates`."""
    return math.floor(self.sparsity(window) * float(num_coordinates))

  def _window_tensor(self, step: tf.Tensor) -> tf.Tensor:
    step = tf.cast(step, tf.int64)
    epoch = step // self._steps_per_epoch
    within = step % self._steps_per_epoch
    part = tf.minimum(within // self._steps_per_window, self._refreshes - 1)
    return epoch * self._refreshes + part

  def _num_zeroed_tensor(self, window: tf.Tensor, num_coordinates: int):
    top = tf.constant(self._top, tf.float64)
    rate = tf.minimum(
        top * tf.cast(window, tf.float64) /
        tf.constant(self._denominator, tf.float64), top)
    return tf.cast(
        tf.floor(rate * tf.constant(float(num_coordinates), tf.float64)),
        tf.int64)

  # --- masks -----------------------------------------------------------------

  def masks(self, window, shapes: Sequence[Sequence[int]],
            dtype=tf.float32) -> List[tf.Tensor]:
    """The 0/1 masks of window `window`, one per variable shape.

    Args:
      window: window index (Python int or int64 scalar tensor).
      shapes: the variable shapes, in `var_list` order (fully defined).
      dtype: dtype of the masks.

    Returns:
      One tensor of each shape; `1` keeps a coordinate, `0` zeros it. Over
      all of them together exactly `floor(r(window) * d)` entries are 0.
    """
    shapes = [tf.TensorShape(s) for s in shapes]
    for shape in shapes:
      if not shape.is_fully_defined():
        raise ValueError(f'sparsified needs static variable shapes, got {shape}')
    sizes = [shape.num_elements() for shape in shapes]
    flat = self._flat_mask(tf.cast(window, tf.int64), sum(sizes))
    return [tf.cast(tf.reshape(part, shape), dtype)
            for part, shape in zip(tf.split(flat, sizes), shapes)]

  def _flat_mask(self, window: tf.Tensor, size: int) -> tf.Tensor:
    """A float32 `[size]` mask zeroing a uniform subset of `num_zeroed` entries."""
    key = noise.substream(
        tf.stack([tf.constant(self._mask_seed, tf.int64), window]),
        _MASK_STREAM)
    # The zeroed entries are the first `num_zeroed` of a uniform random
    # permutation: the stable argsort of 63-bit random keys (spec §1.3
    # advises against float32 keys, which tie). The raw Philox bits are the
    # same with and without XLA.
    bits = philox.bits([size, 2], key)
    zeroed = smallest_keys(bits, self._num_zeroed_tensor(window, size))
    return tf.cast(tf.logical_not(zeroed), tf.float32)

  # --- privatizer ------------------------------------------------------------

  def init(self, params):
    return {'inner': self._inner.init(params),
            'step': tf.constant(0, tf.int64),
            # The masks of window `window`, kept for the window's steps
            # (drawing them sorts all d coordinates); -1: none drawn yet.
            'window': tf.constant(-1, tf.int64),
            'masks': [tf.zeros(p.shape, tf.float32) for p in params]}

  def prepare(self, state, seed, per_example_grads, public_grads):
    step = tf.convert_to_tensor(state['step'], tf.int64)
    window = self._window_tensor(step)
    masks = tf.cond(
        tf.equal(window, state['window']), lambda: list(state['masks']),
        lambda: self.masks(window, per_example_grads.shapes))
    if public_grads is not None:
      # The inner step then works inside the kept coordinates throughout
      # (e.g. GEP's public subspace). Public data costs no privacy.
      public_grads = public_grads.masked(masks)
    return {'window': window, 'masks': masks,
            'inner': self._inner.prepare(state['inner'], seed,
                                         per_example_grads.masked(masks),
                                         public_grads)}

  def clipped_sums(self, per_example_grads, state, plan):
    grads = gradients.as_per_example_gradients(per_example_grads)
    return self._inner.clipped_sums(grads.masked(plan['masks']),
                                    state['inner'], plan['inner'])

  # Its sums are the inner step's (of the masked gradients), and add up as
  # the inner step's do (by row, around `sparse_embeddings`).
  def add_sums(self, sums, more):
    return self._inner.add_sums(sums, more)

  def global_sums(self, sums):
    return self._inner.global_sums(sums)

  def sums_shapes(self, sums):
    return self._inner.sums_shapes(sums)

  def release(self, sums, state, plan, seed):
    noisy_sum, inner_state = self._inner.release(sums, state['inner'],
                                                 plan['inner'], seed)
    # The mask broadcasts over any leading axis: one mask for all.
    masks = plan['masks']
    return [_masked(t, m) for t, m in zip(noisy_sum, masks)], {
        'inner': inner_state,
        'step': tf.convert_to_tensor(state['step'], tf.int64) + 1,
        'window': plan['window'], 'masks': masks}

  def dp_event(self, step):
    # The mask is data-independent: exactly the inner step's cost.
    return self._inner.dp_event(step)


def sparsified(inner: core.Privatizer,
               final_sparsity: float,
               epochs: int,
               steps_per_epoch: int,
               *,
               refreshes_per_epoch: int = 1,
               mask_seed: int = 0) -> Sparsified:
  """Random sparsification with gradual cooling around `inner`; see `Sparsified`."""
  return Sparsified(inner, final_sparsity, epochs, steps_per_epoch,
                    refreshes_per_epoch=refreshes_per_epoch,
                    mask_seed=mask_seed)
