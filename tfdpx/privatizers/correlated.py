"""Correlated noise across steps around a noise step (the matrix mechanism)."""

from typing import Any, Dict, Union

import tensorflow as tf

from tfdpx import core
from tfdpx import correlation
from tfdpx import noise


@core.register
class Correlated(core.Wrapper):
  """`inner` with its Gaussian noise correlated across steps by a strategy.

  Every Gaussian release of `inner`'s step (its `gaussian_release_shapes`:
  DP-SGD's sum, DPDR's and GEP's two parts, under random sparsification,
  adaptive or per-layer clipping) gets row t of `C^-1 Z` in place of fresh noise, `C` the
  `strategy` (`tfdpx.correlation`: banded Toeplitz or BLT) and `Z`
  independent draws with the release's own std. The noise is computed online
  from a history of each release kept in the state (`noise_history`): the
  last `bands - 1` noises (banded) or `buffers` decaying sums of them (BLT),
  that many copies of the noised coordinates (`strategy.history_length`).
  The history is as secret as the noise key (whoever reads it can remove
  part of the noise of earlier steps): a tfdpx optimizer keeps it in
  variables that no
  checkpoint, saved model or log holds, and saves it only where asked to
  (`secret_checkpoint()`, for a resume that continues the correlation). A
  run resumed without it restarts the correlation, which is as private:
  the strategy becomes block diagonal, its columns no longer than before and
  of norm at most 1.

  Privacy:
    What is clipped, to which norm, is `inner`'s. Each step's releases are
    post-processing of `C X + Z` (X: the clipped sums of every step, each in
    units of its step's noise std): one participation moves it by at most
    `inner`'s sensitivity over its column, whose norm is 1. The event of one
    participation at step t is `inner.dp_event(t)`. How the run composes
    depends on when an example can participate (`tfdpx.accounting`):
    `sampling='cyclic_poisson'` with `groups >= bands` is amplified banded
    matrix factorization (Choquette-Choo et al. 2023): each example's steps
    are `groups` apart and Poisson-sampled within its group, so the run costs
    the group's Poisson-sampled events (banded strategies only: a BLT's
    columns never end); `sampling='shuffle'` (one step per epoch at any
    position) is one Gaussian mechanism whose sensitivity is
    `strategy.once_per_epoch_sensitivity`; plain Poisson sampling, where one
    example can be in consecutive steps, is refused. Add/remove-one-example
    adjacency.

  References:
    Choquette-Choo et al., "(Amplified) Banded Matrix Factorization: A unified
    approach to private training", NeurIPS 2023.
    Dvijotham et al., "Efficient and Near-Optimal Noise Generation for
    Streaming Differential Privacy", FOCS 2024 (BLT).
  """

  name = 'correlated'

  def __init__(self, inner: Union[core.Privatizer, Dict[str, Any]],
               strategy: Union[correlation.ToeplitzStrategy, Dict[str, Any]]):
    """Args:
      inner: the noise step whose Gaussian noise is correlated (or its
        serialized form).
      strategy: a `tfdpx.correlation` strategy (or its serialized form),
        e.g. `tfdpx.correlation.banded_toeplitz(bands, steps)` or
        `tfdpx.correlation.blt(buffers, steps)`.

    Raises:
      ValueError: naming the argument, for a strategy that is not one, an
        inner step whose noise is not a fixed set of Gaussian releases
        (D2P2's projection per step, GeoDP's noise on angles, selected rows
        of embedding tables), or one already correlated.
    """
    self._set_inner(inner)
    if isinstance(strategy, dict):
      strategy = correlation.deserialize(strategy)
    if not isinstance(strategy, correlation.ToeplitzStrategy):
      raise ValueError(
          f'strategy must be a tfdpx.correlation strategy, got {strategy!r}')
    if self.inner.correlation is not None:
      raise ValueError(f'inner: {self.inner!r} is already correlated')
    if not self.inner.has_gaussian_releases:
      raise ValueError(
          f'inner: {self.inner.name} does not release the clipped sum plus '
          'Gaussian noise of a fixed shape at every step, so its noise cannot '
          'be correlated across steps (supported: gaussian, dpdr, gep, and '
          'sparsified, adaptive or per-layer clipping around them)')
    self._strategy = strategy

  @property
  def config(self):
    return {'inner': core.serialize(self.inner),
            'strategy': correlation.serialize(self._strategy)}

  @property
  def correlation(self) -> correlation.ToeplitzStrategy:
    return self._strategy

  @property
  def coordinate_noise_variance(self):
    # Each draw's; step t's noise combines them by row t of C^-1.
    return self.inner.coordinate_noise_variance

  def init(self, params):
    history = self._strategy.history_length
    return {
        'inner': self.inner.init(params),
        core.SECRET_STATE_KEY: [
            [[tf.zeros(shape, tf.float32) for _ in range(history)]
             for shape in release]
            for release in self.inner.gaussian_release_shapes(params)],
    }

  def prepare(self, state, seed, per_example_grads, public_grads):
    return self.inner.prepare(state['inner'], seed, per_example_grads,
                              public_grads)

  def clipped_sums(self, per_example_grads, state, plan):
    return self.inner.clipped_sums(per_example_grads, state['inner'], plan)

  def add_sums(self, sums, more):
    return self.inner.add_sums(sums, more)

  def global_sums(self, sums):
    return self.inner.global_sums(sums)

  def sums_shapes(self, sums):
    return self.inner.sums_shapes(sums)

  def release(self, sums, state, plan, seed):
    releases = noise.CorrelatedReleases(self._strategy.correlate,
                                        state[core.SECRET_STATE_KEY])
    with noise.correlated_releases(releases):
      noisy_sum, inner_state = self.inner.release(sums, state['inner'], plan,
                                                  seed)
    releases.check_complete()
    return noisy_sum, {'inner': inner_state,
                       core.SECRET_STATE_KEY: releases.new_histories}

  def __repr__(self):
    return f'correlated({self.inner!r}, {self._strategy!r})'

  def dp_event(self, step):
    # One participation; the accountant composes by the sampling.
    return self.inner.dp_event(step)


def correlated(inner: core.Privatizer,
               strategy: correlation.ToeplitzStrategy) -> Correlated:
  """`inner` with noise correlated across steps by `strategy`; see
  `Correlated`."""
  return Correlated(inner, strategy)
