"""The privatizers (and wrapped combinations) that join the contract suite.

Every privatizer adds a `Case` here. `make(noise_multiplier, l2_norm_clip)`
builds it with the given effective noise multiplier and clip norm (a
privatizer without a clip norm ignores it and states its own sensitivity).
"""

import dataclasses
import math
from typing import Callable, Optional, Sequence

import numpy as np

import tfdpx
from tfdpx import privatizers


def plain_sum(per_example_grads, public_grads=None):
  del public_grads
  return [g.numpy().sum(axis=0) for g in per_example_grads]


def gaussian_std(privatizer, step, l2_norm_clip):
  """Per-coordinate noise std for a single Gaussian release of norm C."""
  return privatizer.dp_event(step).noise_multiplier * l2_norm_clip


@dataclasses.dataclass
class Case:
  """How the contract suite runs one privatizer.

  Attributes:
    name: test id.
    make: `(noise_multiplier, l2_norm_clip) -> Privatizer`.
    steps: steps at which the checks run (the state is advanced through all
      earlier steps with the same inputs).
    noiseless_expected: what `update` returns at zero noise and infinite clip,
      `(per_example_grads, public_grads) -> list of arrays`.
    sensitivity: `(l2_norm_clip) -> bound` on the L2 change of the noiseless
      output when one example is removed.
    noise_std: `(privatizer, step, l2_norm_clip) -> std` of every output
      coordinate when all per-example gradients are zero, derived from
      `dp_event(step)`; `None` skips that step.
    needs_public: pass public gradients to `update`.
    wrapped: also run the case wrapped in random sparsification.
  """
  name: str
  make: Callable[[float, float], tfdpx.Privatizer]
  steps: Sequence[int] = (0,)
  noiseless_expected: Callable = plain_sum
  sensitivity: Callable[[float], float] = lambda c: c
  noise_std: Callable[..., Optional[float]] = gaussian_std
  needs_public: bool = False
  wrapped: bool = True


CASES = [
    Case('gaussian', lambda z, c: privatizers.gaussian(c, z)),
]


def case_named(name: str) -> Case:
  """The case of `CASES` called `name` (of those defined so far)."""
  return next(c for c in CASES if c.name == name)


def dpdr_std(privatizer, step, l2_norm_clip):
  """DPDR's DP-SGD steps are isotropic; its decomposition steps are not."""
  if privatizer.decomposes(step):
    return None  # Tested along and across b in tests/privatizers/test_dpdr.py.
  return gaussian_std(privatizer, step, l2_norm_clip)


# Decomposition steps release sum(alpha_i) b + sum(g_perp_i): one example
# moves them by at most sqrt(C_alpha^2 + C_perp^2) = sqrt(2) C.
CASES += [
    Case('dpdr', lambda z, c: privatizers.dpdr(c, z, decomposition_steps=3),
         steps=(0, 2, 3), sensitivity=lambda c: 2**0.5 * c,
         noise_std=dpdr_std),
    Case('dpdr_global', lambda z, c: privatizers.dpdr(
        c, z, decomposition_steps=3, granularity='global'), steps=(0, 1, 4),
         sensitivity=lambda c: 2**0.5 * c, noise_std=dpdr_std),
]
CASES.append(Case('geodp_sound', lambda z, c: privatizers.geodp(c, z),
                  noise_std=lambda p, step, c: None))
CASES.append(Case('geodp_paper', lambda z, c: privatizers.geodp(
    c, z, mode='paper', beta=0.5, expected_batch_size=4.0),
                  noise_std=lambda p, step, c: None))


def gep_noise_std(privatizer, step, l2_norm_clip):
  """GEP's residual noise std at zero gradients, from `dp_event(step)`.

  The default split gives each part multiplier sqrt(2) * sigma_eff; the case
  below uses S2 = l2_norm_clip / 2. The embedding noise adds K (sigma_1 S1)^2
  of energy inside the K <= 4 dimensional subspace, which moves the pooled std
  of the contract's > 60,000 coordinates by < 2e-4 relative (the check's
  tolerance is about 1%); tests/privatizers/test_gep.py checks both parts
  exactly.
  """
  sigma_eff = privatizer.dp_event(step).noise_multiplier
  return 2**0.5 * sigma_eff * l2_norm_clip / 2


def _gep_case(name, steps=(0,), wrapped=True, **kwargs) -> Case:
  """GEP with 4 bases in two groups, clips `c` and `c / 2`, and `kwargs`."""
  return Case(
      name, lambda z, c: privatizers.gep(4, c, c / 2, z, num_groups=2,
                                         **kwargs),
      steps=steps, noiseless_expected=plain_sum,
      sensitivity=lambda c: (c**2 + (c / 2)**2)**0.5,
      noise_std=gep_noise_std, needs_public=True, wrapped=wrapped)


CASES.append(_gep_case('gep'))
# GEP's form on a GPU: explicit bases from matrix products only. Not wrapped:
# the wrapper sees its release as any GEP's, and its XLA step alone takes
# 40 s to compile here.
CASES.append(_gep_case('gep_loop_free', loop_free=True, wrapped=False))
# A basis every 3 steps: step 2 releases with the basis kept from step 0,
# step 3 with a new one.
CASES.append(_gep_case('gep_refresh', steps=(0, 2, 3), basis_refresh_steps=3))


def sparsified_case(case: Case, final_sparsity: float = 0.5) -> Case:
  """`case` wrapped in random sparsification, checked inside a masked window.

  The schedule has two epochs of `max(case.steps) + 1` steps, so epoch 0 is
  mask-free and the wrapped case checks the inner case's steps shifted into
  epoch 1, all in one window whose mask zeros `final_sparsity` of the
  coordinates. At zero noise and infinite clip the result is the inner case's
  result on the masked gradients, masked; the RMS of the noise over all
  coordinates is the inner std times sqrt(kept fraction), which equals
  sqrt(1 - final_sparsity) up to the floor, i.e. 1 / d (tests/stats.py's
  tolerance is about 1 / sqrt(d)).
  """
  period = max(case.steps) + 1

  def make(noise_multiplier, l2_norm_clip):
    return privatizers.sparsified(
        case.make(noise_multiplier, l2_norm_clip), final_sparsity, epochs=2,
        steps_per_epoch=period, mask_seed=11)

  def noiseless_expected(per_example_grads, public_grads=None):
    wrapper = make(0.0, float('inf'))
    masks = wrapper.masks(wrapper.window(period),
                          [g.shape[1:] for g in per_example_grads])
    masked = [g * m for g, m in zip(per_example_grads, masks)]
    masked_public = (None if public_grads is None else
                     [g * m for g, m in zip(public_grads, masks)])
    expected = case.noiseless_expected(masked, masked_public)
    return [np.asarray(e) * m.numpy() for e, m in zip(expected, masks)]

  def noise_std(privatizer, step, l2_norm_clip):
    std = case.noise_std(privatizer.inner, step, l2_norm_clip)
    if std is None:
      return None
    return std * math.sqrt(1.0 - privatizer.sparsity(privatizer.window(step)))

  return Case(f'sparsified({case.name})', make,
              steps=tuple(period + s for s in case.steps),
              noiseless_expected=noiseless_expected,
              sensitivity=case.sensitivity, noise_std=noise_std,
              needs_public=case.needs_public)


def correlated_case(case: Case, strategy=None, wrapped: bool = True) -> Case:
  """`case` with its noise correlated by `strategy` (3 bands by default):
  per step the same sensitivity and noiseless result; the noise of step t
  has the inner std times the norm of row t of `C^-1`
  (tests/privatizers/test_correlated.py checks the covariance across
  steps)."""
  strategy = strategy or tfdpx.correlation.banded_toeplitz(3, 20)
  kind = '' if strategy.name == 'banded_toeplitz' else f'_{strategy.name}'

  def make(noise_multiplier, l2_norm_clip):
    return privatizers.correlated(case.make(noise_multiplier, l2_norm_clip),
                                  strategy)

  def noise_std(privatizer, step, l2_norm_clip):
    std = case.noise_std(privatizer.inner, step, l2_norm_clip)
    if std is None:
      return None
    row = strategy.inverse_coefficients(step + 1)
    return std * float(np.linalg.norm(row))

  return Case(f'correlated{kind}({case.name})', make, steps=case.steps,
              noiseless_expected=case.noiseless_expected,
              sensitivity=case.sensitivity, noise_std=noise_std,
              needs_public=case.needs_public, wrapped=wrapped)


CASES += [correlated_case(CASES[0]),
          correlated_case(CASES[0], tfdpx.correlation.blt(2, 20),
                          wrapped=False),
          correlated_case(case_named('dpdr'), wrapped=False),
          # Both releases correlated, step 2 on the basis kept from step 0.
          correlated_case(case_named('gep_refresh'), wrapped=False)]

from tests.privatizers.d2p2_cases import D2P2_CASES  # pylint: disable=g-import-not-at-top
CASES += D2P2_CASES

# Keep last: every case above is also run wrapped in random sparsification
# (those marked `wrapped`).
CASES += [sparsified_case(c) for c in list(CASES) if c.wrapped]


def _wrapped_case(case: Case, name: str, wrap) -> Case:
  """`case` inside `wrap(inner)`, a wrapper that keeps the inner case's
  sensitivity, noise and noiseless result."""
  def make(noise_multiplier, l2_norm_clip):
    return wrap(case.make(noise_multiplier, l2_norm_clip))

  def noise_std(privatizer, step, l2_norm_clip):
    return case.noise_std(privatizer.inner, step, l2_norm_clip)

  return Case(f'{name}({case.name})', make, steps=case.steps,
              noiseless_expected=case.noiseless_expected,
              sensitivity=case.sensitivity, noise_std=noise_std,
              needs_public=case.needs_public)


def adaptive_case(case: Case) -> Case:
  """`case` inside adaptive clipping whose clip norm stays put.

  Learning rate 0 keeps the scale at 1, so the inner case's noise,
  sensitivity and noiseless result hold unchanged (the count's noise, 1e6,
  moves the effective noise multiplier by 1e-12 relative): the suite checks
  the plumbing (scaled gradients, the count as a clipped sum, the state).
  The adaptation itself: tests/privatizers/test_adaptive.py.
  """
  return _wrapped_case(case, 'adaptive', lambda inner:
                       privatizers.adaptive_clipping(
                           inner, expected_batch_size=4, learning_rate=0.0,
                           count_noise_multiplier=1e6))


_ADAPTIVE = [adaptive_case(c) for c in CASES
             if c.name in ('gaussian', 'dpdr', 'gep', 'geodp_sound')]
CASES += _ADAPTIVE + [sparsified_case(_ADAPTIVE[0])]
# The count's noise stays independent; the gradient's is correlated.
CASES.append(correlated_case(_ADAPTIVE[0], wrapped=False))


def per_layer_case(case: Case) -> Case:
  """`case` after per-variable clipping at `C / sqrt(3)` each (the
  contract's three variables): the sensitivity and noise stay the inner
  case's, and at an infinite clip norm nothing changes."""
  return _wrapped_case(case, 'per_layer', privatizers.per_layer_clipping)


_PER_LAYER = [per_layer_case(c) for c in CASES
              if c.name in ('gaussian', 'dpdr', 'gep')]
# Adaptive clipping scales every group's norm: it wraps per-layer clipping.
CASES += _PER_LAYER + [adaptive_case(_PER_LAYER[0])]

