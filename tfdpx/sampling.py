"""Poisson sampling for `tf.data` with fixed-shape, masked batches.

Each step, every example joins the batch independently with probability q,
which is what the RDP accountant assumes. To keep one shape (so XLA compiles
once), a batch is padded to `max_batch_size` rows; padded rows are zeros with
sample weight 0, so their per-example loss and gradient are exactly 0 and they
add nothing to the clipped sum. The privatized sum is divided by the public
expected batch size `q * n`, never by the realized size.
"""

import itertools
import math
from typing import Optional

import numpy as np
from scipy import stats
import tensorflow as tf

from tfdpx import core

# Per-step probability that a Poisson batch has more examples than the padded
# shape holds (those extra examples would be dropped).
OVERFLOW_PROBABILITY = 1e-12


def max_batch_size(num_examples: int, sampling_probability: float) -> int:
  """The smallest size a Poisson batch exceeds with probability <= 1e-12."""
  return int(stats.binom.isf(OVERFLOW_PROBABILITY, num_examples,
                             sampling_probability)) + 1


def secret_entropy() -> int:
  """A fresh 128-bit secret from the operating system's entropy source."""
  return np.random.SeedSequence().entropy


def _root(sampling_probability: float, seed: Optional[int]) -> int:
  """The root of a dataset's generators: `seed`, or a fresh secret.

  Raises:
    ValueError: for a bad `sampling_probability` or `seed`, naming it.
  """
  if not 0 < sampling_probability <= 1:
    raise ValueError(f'sampling_probability must be in (0, 1], got '
                     f'{sampling_probability!r}')
  if seed is not None and (int(seed) != seed or seed < 0):
    raise ValueError(f'seed must be a non-negative integer or None, got '
                     f'{seed!r}')
  return secret_entropy() if seed is None else int(seed)


def poisson_batches(x, y, *, sampling_probability: float, steps: int,
                    seed: Optional[int] = None,
                    batch_size: Optional[int] = None) -> tf.data.Dataset:
  """`steps` Poisson-sampled batches `(x, y, sample_weight)` of one shape.

  Every iteration over the dataset (Keras `fit` iterates it once per epoch)
  draws new, independent batches.

  Args:
    x: array of examples, `[n, ...]`, or a tuple or dict of such arrays (a
      model with several inputs).
    y: array of labels, `[n, ...]`.
    sampling_probability: q in (0, 1], each example's probability to be in a
      batch.
    steps: number of batches per iteration.
    seed: `None` (the default and the only private choice) draws a 128-bit
      secret from the operating system. An integer makes the sampling
      reproducible, for experiments only: iteration `i` of the dataset then
      depends only on `(seed, i)` (it differs between iterations). Whoever
      knows the seed knows which steps hold each example, which removes the
      amplification by subsampling that the Poisson epsilon relies on.
    batch_size: padded batch size; default `max_batch_size(n, q)`.

  Returns:
    A dataset of `steps` tuples whose `sample_weight` is 1 for sampled
    examples and 0 for padding rows, which are all zeros in `x` and `y`.

  Raises:
    ValueError: for a bad `sampling_probability` or `seed`.

  Privacy:
    A batch larger than `batch_size` would drop examples, which the
    accountant does not model; with the default size this happens with
    probability at most 1e-12 per step, and the statement's delta should be
    read as `delta + steps * 1e-12`.
  """
  x, y, n = _arrays(x, y)
  root = _root(sampling_probability, seed)
  size = batch_size or max_batch_size(n, sampling_probability)

  def choose(rng, step):
    del step  # Every step samples from all examples.
    return np.flatnonzero(rng.random(n) < sampling_probability)
  return _padded_batches(x, y, choose, root, size, steps)


def example_groups(num_examples: int, groups: int, seed: int) -> np.ndarray:
  """The group of each example in `cyclic_poisson_batches(..., seed=seed)`.

  Each example's group is drawn independently and uniformly at random from
  the run's secret root, on a stream of its own (not the batches'). As
  secret as the seed: it says which steps each example can be in.

  Returns:
    int `[num_examples]`, values in `[0, groups)`.
  """
  rng = np.random.default_rng(np.random.SeedSequence(
      int(seed), spawn_key=_GROUPS_STREAM))
  return rng.integers(groups, size=num_examples)


# The spawn key of the groups' stream; the batches' streams have one-word keys
# (the iteration of the dataset).
_GROUPS_STREAM = (0, 1)


def cyclic_poisson_batches(x, y, *, sampling_probability: float, groups: int,
                           steps: int, first_step: int = 0,
                           seed: Optional[int] = None,
                           batch_size: Optional[int] = None
                           ) -> tf.data.Dataset:
  """`steps` cyclic Poisson batches `(x, y, sample_weight)` of one shape.

  Each example belongs to one of `groups` groups, drawn independently and
  uniformly at random (`example_groups`). The batch of training step t
  samples each example of group `t mod groups` independently with
  probability q, so an example's steps are at least `groups` apart: the
  participation that amplifies noise correlated over at most `groups` steps
  (`tfdpx.privatizers.correlated`; account with
  `sampling='cyclic_poisson'`). Each iteration of the dataset continues the
  cycle where the previous one stopped (Keras `fit` iterates it once per
  epoch); batches are padded as in `poisson_batches`.

  Args:
    x, y: as `poisson_batches`.
    sampling_probability: q in (0, 1], each example's probability to be in
      a batch of its group's steps; the expected batch size is `q * n /
      groups`.
    groups: the number of groups, >= the bands of the noise correlation.
    steps: number of batches per iteration.
    first_step: the training step of the first batch: pass the optimizer's
      `dp_steps` when resuming, with the run's `seed`, so that the cycle
      continues where training stopped with the same groups (new groups, or
      the cycle restarted at 0, could put an example in two steps less than
      `groups` apart).
    seed: as `poisson_batches`: None (the private choice) draws a secret. A
      run that will be resumed draws its seed once (`secret_entropy()`) and
      keeps it as secret as the noise key: it decides the groups.
    batch_size: padded batch size; default `max_batch_size(n, q / groups)`
      (each example is in a given step's batch with probability q / groups,
      independently of the others).

  Returns:
    A dataset of `steps` tuples, as `poisson_batches`.

  Raises:
    ValueError: naming a bad argument, or `first_step > 0` without a seed.

  Privacy:
    Add/remove-one-example adjacency, as the accountant's events. Each
    example's group is drawn independently of the others' and of the data,
    so adding or removing an example changes no other example's group (in
    distribution): the two runs differ in that example alone, in the steps
    of its group. Groups fixed by position (example i in group i mod
    groups, or a shuffle split into equal groups) would be sound only for
    replace-one adjacency: removing an example would move every later one
    to another group. As in `poisson_batches`, an overflowing batch would
    drop examples, with probability at most 1e-12 per step at the default
    size.
  """
  x, y, n = _arrays(x, y)
  if isinstance(first_step, bool) or int(first_step) != first_step or (
      first_step < 0):
    raise ValueError(
        f'first_step must be a non-negative integer, got {first_step!r}')
  if first_step and seed is None:
    raise ValueError(
        f'first_step={first_step} resumes a run, which needs its seed: the '
        'groups are drawn from it, and new groups could put an example in two '
        'steps less than `groups` apart (draw the seed once with '
        'secret_entropy() and keep it secret)')
  root = _root(sampling_probability, seed)
  groups = core.check_positive_int('groups', groups)
  group_of = example_groups(n, groups, root)
  members = [np.flatnonzero(group_of == g) for g in range(groups)]
  size = batch_size or max_batch_size(n, sampling_probability / groups)

  def choose(rng, step):
    group = members[(int(first_step) + step) % groups]
    return group[rng.random(len(group)) < sampling_probability]
  return _padded_batches(x, y, choose, root, size, steps)


def _arrays(x, y):
  """`x` (an array, tuple or dict of arrays) and `y` as numpy, and n.

  Raises:
    ValueError: if their numbers of examples differ.
  """
  if not isinstance(x, (tuple, dict)):
    x = np.asarray(x)
  x = tf.nest.map_structure(np.asarray, x)
  y = np.asarray(y)
  n = len(y)
  if any(len(a) != n for a in tf.nest.flatten(x)):
    raise ValueError(f'x and y must have the same number of examples ({n})')
  return x, y, n


def _padded_batches(x, y, choose, root: int, size: int,
                    steps: int) -> tf.data.Dataset:
  """`steps` batches of `size` rows, `choose(rng, step)` -> the indices of
  the examples of the `step`-th batch (counted over all iterations), zero
  rows with sample weight 0 after them."""
  iterations = itertools.count()

  def padded(a, chosen):
    batch = np.zeros((size,) + a.shape[1:], a.dtype)
    batch[:len(chosen)] = a[chosen]
    return batch

  def generate():
    # A new generator per iteration of the dataset, keyed by its index.
    iteration = next(iterations)
    rng = np.random.default_rng(
        np.random.SeedSequence(root, spawn_key=(iteration,)))
    for step in range(steps):
      chosen = choose(rng, iteration * steps + step)[:size]
      weight = np.zeros(size, np.float32)
      weight[:len(chosen)] = 1
      yield (tf.nest.map_structure(lambda a: padded(a, chosen), x),  # pylint: disable=cell-var-from-loop
             padded(y, chosen), weight)

  def spec(a):
    return tf.TensorSpec((size,) + a.shape[1:], tf.as_dtype(a.dtype))

  signature = (tf.nest.map_structure(spec, x), spec(y),
               tf.TensorSpec((size,), tf.float32))
  dataset = tf.data.Dataset.from_generator(generate,
                                           output_signature=signature)
  return dataset.apply(tf.data.experimental.assert_cardinality(steps))


def poisson_user_batches(x, y, user_ids, *, sampling_probability: float,
                         steps: int, examples_per_user: int,
                         seed: Optional[int] = None,
                         max_users: Optional[int] = None) -> tf.data.Dataset:
  """`steps` Poisson-sampled batches of users, for user-level privacy.

  Each step every user joins the batch independently with probability q,
  with all of their examples (at most `examples_per_user`: a user with more
  contributes a random subset of that many, drawn anew each step). The
  batch has a fixed shape: `max_users` slots of `examples_per_user` rows
  each, slot `j` holding rows `j * examples_per_user` to `(j + 1) *
  examples_per_user - 1`, unused rows zeros with sample weight 0. A model made
  private with the same `examples_per_user` sums each slot's gradients into
  one record (`make_private(model, examples_per_user=...)`).

  Args:
    x, y: arrays of examples and labels, `[n, ...]`.
    user_ids: `[n]` array, the user of each example (any hashable values).
    sampling_probability: q in (0, 1], each user's probability to be in a
      batch.
    steps: number of batches per iteration of the dataset.
    examples_per_user: the most examples one user contributes to a batch,
      a public bound (not read from the data: the largest count would be a
      statistic of it).
    seed: as `poisson_batches`: None (the private choice) draws a secret.
    max_users: user slots per batch; default `max_batch_size(num_users, q)`
      (a Poisson batch of users overflows it with probability <= 1e-12).

  Returns:
    A dataset of `steps` tuples `(x, y, sample_weight)` with
    `max_users * examples_per_user` rows.

  Raises:
    ValueError: naming the bad argument.

  Privacy:
    Adjacency is adding or removing one user with all of their examples.
    Subsampling a user's examples is a transformation of that user's data
    alone. As in `poisson_batches`, an overflowing batch would drop users,
    with probability at most 1e-12 per step at the default `max_users`.
  """
  user_ids = np.asarray(user_ids)
  if len(user_ids) != len(x):
    raise ValueError(f'user_ids has {len(user_ids)} entries for {len(x)} '
                     'examples')
  root = _root(sampling_probability, seed)
  k = core.check_positive_int('examples_per_user', examples_per_user)
  _, inverse = np.unique(user_ids, return_inverse=True)
  rows_of_user = np.split(np.argsort(inverse, kind='stable'),
                          np.cumsum(np.bincount(inverse))[:-1])
  num_users = len(rows_of_user)
  slots = max_users or max_batch_size(num_users, sampling_probability)
  x, y = np.asarray(x), np.asarray(y)
  iterations = itertools.count()

  def generate():
    rng = np.random.default_rng(
        np.random.SeedSequence(root, spawn_key=(next(iterations),)))
    for _ in range(steps):
      chosen = np.flatnonzero(
          rng.random(num_users) < sampling_probability)[:slots]
      xb = np.zeros((slots * k,) + x.shape[1:], x.dtype)
      yb = np.zeros((slots * k,) + y.shape[1:], y.dtype)
      weight = np.zeros(slots * k, np.float32)
      for slot, user in enumerate(chosen):
        rows = rows_of_user[user]
        if len(rows) > k:
          rows = rng.choice(rows, k, replace=False)
        start = slot * k
        xb[start:start + len(rows)] = x[rows]
        yb[start:start + len(rows)] = y[rows]
        weight[start:start + len(rows)] = 1
      yield xb, yb, weight

  signature = (
      tf.TensorSpec((slots * k,) + x.shape[1:], tf.as_dtype(x.dtype)),
      tf.TensorSpec((slots * k,) + y.shape[1:], tf.as_dtype(y.dtype)),
      tf.TensorSpec((slots * k,), tf.float32),
  )
  dataset = tf.data.Dataset.from_generator(generate,
                                           output_signature=signature)
  return dataset.apply(tf.data.experimental.assert_cardinality(steps))


def steps_per_epoch(num_examples: int, expected_batch_size: float) -> int:
  """Steps of one expected pass over the data, `ceil(n / expected batch)`."""
  return int(math.ceil(num_examples / expected_batch_size))
