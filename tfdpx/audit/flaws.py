"""Deliberately broken noise steps, to show that an audit catches them.

Never train with it: it accounts for a guarantee its release does not have.
"""

import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import noise
from tfdpx.privatizers.gaussian import Gaussian
from tfdpx.privatizers.sparse_embeddings import SparseEmbeddings

# Flaws of the noise step (`FlawedGaussian`), of the selection of embedding
# rows (`ExactSelection`), and of the input pipeline.
FLAWS = ('no_noise', 'no_clip', 'noise_fraction', 'reused_noise')
SELECTION_FLAWS = ('exact_selection',)
PIPELINE_FLAWS = ('no_sampling',)
# Flaws of the input pipeline of noise correlated across steps: 'no_cycle',
# plain Poisson batches at the rate the accountant is told for each
# example's group's steps, so every example can be in every step.
CORRELATED_FLAWS = ('no_cycle',)
# The share of the accounted noise `'noise_fraction'` adds.
NOISE_FRACTION = 0.5
# The one noise key `'reused_noise'` draws every step's noise from.
REUSED_KEY = (1, 0)


@core.register
class FlawedGaussian(Gaussian):
  """DP-SGD with one flaw, accounted as if it had none.

  Privacy:
    None. `dp_event` is DP-SGD's at `noise_multiplier`, but `'no_noise'`
    releases the clipped sum without noise, `'no_clip'` sums the gradients
    unclipped (noise still `noise_multiplier * l2_norm_clip`),
    `'noise_fraction'` adds `NOISE_FRACTION` of the accounted noise and
    `'reused_noise'` adds the same noise at every step (one key). An audit of
    it must give a lower bound above the epsilon printed for it. (The
    pipeline flaw `'no_sampling'`, every record in every batch while the
    accountant is told Poisson sampling, is the audit run's:
    `run.one_run(batch_sampling_probability=1)`; so is `CORRELATED_FLAWS`'
    `'no_cycle'`: `run.one_run(groups=..., batch_groups=1)`.)
  """

  name = 'flawed_gaussian'

  def __init__(self, l2_norm_clip: float, noise_multiplier: float,
               flaw: str):
    super().__init__(l2_norm_clip, noise_multiplier)
    if flaw not in FLAWS:
      raise ValueError(f'flaw must be one of {FLAWS}, got {flaw!r}')
    self._flaw = flaw

  @property
  def config(self):
    return {**super().config, 'flaw': self._flaw}

  def clipped_sums(self, per_example_grads, state, plan):
    if self._flaw != 'no_clip':
      return super().clipped_sums(per_example_grads, state, plan)
    factors, _ = clipping.clip_factors(per_example_grads, float('inf'))
    return noise.batch_sum(per_example_grads, factors)

  def release(self, sums, state, plan, seed):
    multiplier = {'no_noise': 0.0,
                  'noise_fraction': NOISE_FRACTION * self._noise_multiplier
                 }.get(self._flaw, self._noise_multiplier)
    if self._flaw == 'reused_noise':
      seed = tf.constant(REUSED_KEY, tf.int64)
    return noise.add_gaussian(sums, self._l2_norm_clip, multiplier,
                              seed), state


@core.register
class ExactSelection(SparseEmbeddings):
  """`sparse_embeddings` selecting on exact counts, accounted as if noisy.

  Privacy:
    None. `dp_event` is `sparse_embeddings`' (the counts' noise `z_s` is
    accounted), but every row an example touches is selected and no other
    (no count noise, threshold 0, no false positives): the released row
    indices say which rows the batch touched. A canary that is the only
    user of its row is then seen whenever it is in the batch. An audit of it
    must give a lower bound above the epsilon printed for it, or reject its
    claimed curve.
  """

  name = 'exact_selection'

  @property
  def selection_noise_multiplier(self) -> float:
    # What the step draws; `dp_event` still names the honest `z_s`.
    return 0.0

  @property
  def threshold(self) -> float:
    return 0.0
