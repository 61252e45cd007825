"""The audited configurations of docs/auditing.md: data, model, noise steps.

scikit-learn's 1,797 digits (8x8, offline): 1,000 private training examples,
200 public ones (GEP's anchor gradients); a 64-32-10 MLP; clip norm 1.
"""

import numpy as np
import tensorflow as tf

from tfdpx import accounting
from tfdpx import correlation
from tfdpx import privatizers
from tfdpx.audit import flaws

L2_NORM_CLIP = 1.0
TRAIN_EXAMPLES = 1000
PUBLIC_EXAMPLES = 200
# Bands of the audited correlated noise, and the groups of its cyclic
# Poisson batches.
CORRELATION_BANDS = 4


def digits():
  """`(x_train, y_train, public_data)` from scikit-learn's digits."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  x, y = datasets.load_digits(return_X_y=True)
  x = (x / 16).astype(np.float32)
  n, k = TRAIN_EXAMPLES, PUBLIC_EXAMPLES
  return x[:n], y[:n], (x[n:n + k], y[n:n + k])


def mlp(input_shape=(64,), num_classes=10) -> tf.keras.Model:
  """The small audited model: one hidden layer of 32 ReLUs."""
  return tf.keras.Sequential([
      tf.keras.Input(input_shape),
      tf.keras.layers.Dense(32, activation='relu'),
      tf.keras.layers.Dense(num_classes)])


def _gaussian(z, steps, expected_batch_size):
  del steps, expected_batch_size
  return privatizers.gaussian(L2_NORM_CLIP, z)


def _dpdr(z, steps, expected_batch_size):
  del expected_batch_size
  # Decompose every step but the first (DP-SGD) one.
  return privatizers.dpdr(L2_NORM_CLIP, z, decomposition_steps=steps)


def _sparsified(z, steps, expected_batch_size):
  del expected_batch_size
  return privatizers.sparsified(privatizers.gaussian(L2_NORM_CLIP, z),
                                final_sparsity=0.5, epochs=1,
                                steps_per_epoch=steps)


def _d2p2(z, steps, expected_batch_size):
  del steps, expected_batch_size
  return privatizers.d2p2(z)


def _gep(z, steps, expected_batch_size):
  del steps, expected_batch_size
  return privatizers.gep(20, L2_NORM_CLIP, L2_NORM_CLIP / 5, z)


def _geodp(z, steps, expected_batch_size):
  del steps, expected_batch_size
  return privatizers.geodp(L2_NORM_CLIP, z)


def _adaptive(z, steps, expected_batch_size):
  del steps
  return privatizers.adaptive_clipping(
      privatizers.gaussian(L2_NORM_CLIP, z),
      expected_batch_size).with_noise_multiplier(z)


def _per_layer(z, steps, expected_batch_size):
  del steps, expected_batch_size
  return privatizers.per_layer_clipping(
      privatizers.gaussian(L2_NORM_CLIP, z), groups='variable')


def _sparse(z, steps, expected_batch_size):
  del steps, expected_batch_size
  # Each gradient canary is the only user of its row of the canary table.
  return privatizers.sparse_embeddings(privatizers.gaussian(L2_NORM_CLIP, z))


def _sparse_loose(z, steps, expected_batch_size):
  del steps, expected_batch_size
  # A threshold below one count: an included canary's row is often
  # selected, so its gradient release is audited too.
  return privatizers.sparse_embeddings(privatizers.gaussian(L2_NORM_CLIP, z),
                                       selection_share=0.75,
                                       false_positive_rate=0.2)


def _sparse_dpdr_loose(z, steps, expected_batch_size):
  del expected_batch_size
  # DPDR on the selected rows, decomposing every step but the first, with
  # the loose threshold above: its reconstruction on the canaries' rows.
  return privatizers.sparse_embeddings(
      privatizers.dpdr(L2_NORM_CLIP, z, decomposition_steps=steps),
      selection_share=0.75, false_positive_rate=0.2)


def _correlated(z, steps, expected_batch_size):
  del expected_batch_size
  return privatizers.correlated(
      privatizers.gaussian(L2_NORM_CLIP, z),
      correlation.banded_toeplitz(CORRELATION_BANDS, steps))


# Each builder takes (noise_multiplier, steps, expected_batch_size).
PRIVATIZERS = {
    'gaussian': _gaussian,
    'dpdr': _dpdr,
    'sparsified': _sparsified,
    'd2p2': _d2p2,
    'gep': _gep,
    'geodp': _geodp,
    'adaptive_clipping': _adaptive,
    'per_layer_clipping': _per_layer,
    'sparse_embeddings': _sparse,
    'sparse_embeddings_loose': _sparse_loose,
    'sparse_embeddings_dpdr_loose': _sparse_dpdr_loose,
    'correlated': _correlated,
}


def groups(name: str):
  """The cyclic Poisson groups the run of privatizer or flaw `name` is
  accounted with (its noise is correlated across steps), else None
  (Poisson sampling)."""
  if name == 'correlated' or name in flaws.CORRELATED_FLAWS:
    return CORRELATION_BANDS
  return None


def flawed(flaw: str, z, steps, expected_batch_size):
  """DP-SGD with `flaw` (`flaws.FLAWS`), accounted as DP-SGD at `z`;
  `sparse_embeddings` selecting on exact counts (`flaws.SELECTION_FLAWS`),
  accounted as at `z`; for a pipeline flaw (`flaws.PIPELINE_FLAWS`) DP-SGD
  itself, or for `flaws.CORRELATED_FLAWS` DP-SGD with correlated noise (the
  run is flawed: `batch_sampling_probability`, `batch_groups`)."""
  if flaw in flaws.CORRELATED_FLAWS:
    return _correlated(z, steps, expected_batch_size)
  del steps, expected_batch_size
  if flaw in flaws.PIPELINE_FLAWS:
    return privatizers.gaussian(L2_NORM_CLIP, z)
  if flaw in flaws.SELECTION_FLAWS:
    return flaws.ExactSelection(privatizers.gaussian(L2_NORM_CLIP, z))
  return flaws.FlawedGaussian(L2_NORM_CLIP, z, flaw)


def batch_sampling_probability(flaw: str):
  """The rate a run with `flaw` really draws its batches at: 1 for
  `'no_sampling'` (every record in every batch), else None (the rate the
  accountant is told)."""
  return 1.0 if flaw == 'no_sampling' else None


def batch_groups(flaw: str):
  """The groups a run with `flaw` really draws its batches with: 1 for
  `'no_cycle'` (plain Poisson batches, every record eligible at every step,
  while the accountant is told cyclic Poisson sampling), else None (the
  accountant's)."""
  return 1 if flaw == 'no_cycle' else None


def calibrated(build, target_epsilon: float, *, steps: int, delta: float,
               sampling_probability: float, expected_batch_size: float,
               groups=None):
  """`build`'s privatizer at the noise multiplier that prints
  `target_epsilon` (RDP, Poisson sampling, or cyclic Poisson sampling over
  `groups` groups)."""
  z = accounting.calibrate_noise_multiplier(
      target_epsilon, build(1.0, steps, expected_batch_size), steps=steps,
      delta=delta, sampling_probability=sampling_probability, groups=groups)
  return build(z, steps, expected_batch_size)
