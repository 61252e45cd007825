"""Contract-suite cases of the D2P2 privatizer (joined in `cases.py`).

Automatic clipping bounds every example's norm by 1, so `make` ignores
`l2_norm_clip` and the sensitivity is 1 (times the public back-projection gain
of mode O); the noise std is the schedule's `z_k` (mode O: derived from the
SRHT, exactly, in `D2P2.expected_output_noise_std`).
"""

import math

import numpy as np
import tensorflow as tf

from tests.privatizers.cases import Case
from tfdpx import privatizers
from tfdpx import projections

GAMMA = 0.01
RATIO = 0.9
# The shapes test_contract feeds: SHAPES, and those of its noise test.
SHAPES = [(6, 5), (5,), (3, 3, 2, 4)]
NOISE_SHAPES = [(300, 300), (100,)]


def normalized_sum(per_example_grads, public_grads=None):
  """Sum of `g / (||g|| + gamma)`, with the global norm, in float64."""
  del public_grads
  grads = [g.numpy().astype('float64') for g in per_example_grads]
  norms = sum(np.sum(np.reshape(g, (g.shape[0], -1))**2, axis=1)
              for g in grads) ** 0.5
  return [np.sum(g / np.reshape(norms + GAMMA, (-1,) + (1,) * (g.ndim - 1)),
                 axis=0) for g in grads]


def srht_round_trip(privatizer):
  """`(d'/p) R^T R S` per variable, with R built densely from the public key."""
  def expected(per_example_grads, public_grads=None):
    out = []
    for index, total in enumerate(normalized_sum(per_example_grads,
                                                 public_grads)):
      if not privatizer.projected(total.shape):
        out.append(total)
        continue
      d, p = total.size, privatizer.projected_dim(total.shape)
      key = privatizer.projection_key(index, 0)
      r = np.stack([
          projections.srht_forward(tf.constant(e, tf.float32), key, p).numpy()
          for e in np.eye(d)], axis=1)
      gain = projections.padded_dim(d) / p  # back_projection='unbiased'.
      out.append(np.reshape(gain * r.T @ (r @ total.ravel()), total.shape))
    return out
  return expected


def srht_output_sensitivity(shapes):
  """`max_l d'_l / p_l`: ||R_l|| <= 1, then each variable's public gain."""
  return max(projections.padded_dim(math.prod(s)) /
             projections.projected_dim(math.prod(s), RATIO)
             for s in shapes if math.prod(s) > 3)


def make_srht(z):
  return privatizers.d2p2(z, projection='srht', projection_ratio=RATIO,
                          back_projection='unbiased',
                          resample_projection='never', projection_seed=5)


D2P2_CASES = [
    Case('d2p2_none_epoch_schedule',
         lambda z, c: privatizers.d2p2(
             z, noise_schedule='inv_fourth_root_epoch', steps_per_epoch=2,
             min_noise_multiplier=z / 4, projection='none', gamma=GAMMA),
         steps=(0, 2, 5),
         noiseless_expected=normalized_sum,
         sensitivity=lambda c: 1.0,
         noise_std=lambda privatizer, step, c: (
             privatizer.dp_event(step).noise_multiplier)),
    Case('d2p2_srht_mode_o',
         lambda z, c: make_srht(z),
         steps=(0, 1),
         noiseless_expected=srht_round_trip(make_srht(0.0)),
         sensitivity=lambda c: srht_output_sensitivity(SHAPES),
         noise_std=lambda privatizer, step, c: (
             privatizer.expected_output_noise_std(step, NOISE_SHAPES))),
]
