"""Audits: train with canaries through `make_private`, score, bound epsilon."""

from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from tfdpx import accounting
from tfdpx import core
from tfdpx import keras as tfdpx_keras
from tfdpx import sampling
from tfdpx.audit import bounds
from tfdpx.audit import canaries as canaries_lib
from tfdpx.audit import fdp_bounds
from tfdpx.audit import scores as scores_lib


def expected_batch_size(num_examples: int, num_canaries: int,
                        sampling_probability: float,
                        groups: Optional[int] = None) -> float:
  """The public denominator `q * (num_examples + num_canaries / 2)`, over
  `groups` for cyclic Poisson sampling: the expected batch size, fixed
  before the canaries are drawn (a count of the canaries actually included
  would reveal how many are in)."""
  return sampling_probability * (num_examples + num_canaries / 2) / (
      groups or 1)


def train_with_canaries(privatizer: core.Privatizer,
                        model_fn: Callable[[], tf.keras.Model], x, y, *,
                        canaries: canaries_lib.Canaries,
                        included: np.ndarray, sampling_probability: float,
                        steps: int, delta: float, learning_rate: float = 0.1,
                        public_data=None, jit_compile: bool = False,
                        physical_batch_size: Optional[int] = None,
                        batch_sampling_probability: Optional[float] = None,
                        momentum: float = 0.0,
                        groups: Optional[int] = None,
                        batch_groups: Optional[int] = None) -> dict:
  """One private training run with the canaries `included` marks.

  The run is a user's: `make_private(model)`, `tfdpx.keras.DPSGD` around
  `privatizer`, Poisson batches with a secret sampling seed (with `groups`,
  cyclic Poisson batches over that many groups, each record's group a
  secret: `tfdpx.sampling.cyclic_poisson_batches`, for noise correlated
  across steps), a secret noise key, `fit`. The optimizer divides by
  `expected_batch_size`.
  `physical_batch_size` runs each batch as virtual batches of that size
  (`make_private`). `batch_sampling_probability` is the rate the batches are
  really drawn at (default `sampling_probability`, which the accountant is
  told): another only to audit a flawed pipeline (`flaws.PIPELINE_FLAWS`).
  `momentum` is SGD's (Keras', not Nesterov). `batch_groups` is the number
  of groups the batches are really drawn with (default `groups`; 1 for plain
  Poisson batches): another only to audit a flawed pipeline.

  Returns:
    A dict: `scores` (one per canary), `updates` (`[steps, canaries]`, each
    step's change of each canary's coordinate, or None: `canaries.trace`),
    `printed_epsilon` (the accountant's epsilon at `delta` for the steps
    taken), `event` (its DpEvent of those steps), `steps`, `denominator`
    (the optimizer's).
  """
  included = np.asarray(included, bool)
  if included.shape != (canaries.num_canaries,):
    raise ValueError(f'included must mark each of the '
                     f'{canaries.num_canaries} canaries, got shape '
                     f'{included.shape}')
  records_x, records_y = canaries.records(x, y, included)
  model = model_fn()
  trained = tfdpx_keras.make_private(
      canaries.model(model), release_training_metrics=False,
      public_data=(None if public_data is None else
                   canaries.public(*public_data)),
      physical_batch_size=physical_batch_size)
  optimizer = tfdpx_keras.DPSGD(privatizer=privatizer,
                                expected_batch_size=expected_batch_size(
                                    len(y), canaries.num_canaries,
                                    sampling_probability, groups),
                                learning_rate=learning_rate,
                                momentum=momentum)
  trained.compile(optimizer, canaries.loss(), jit_compile=jit_compile)
  rate = (sampling_probability if batch_sampling_probability is None else
          batch_sampling_probability)
  batch_groups = groups if batch_groups is None else batch_groups
  if batch_groups and batch_groups > 1:
    batches = sampling.cyclic_poisson_batches(
        records_x, records_y, sampling_probability=rate, groups=batch_groups,
        steps=steps)
  else:
    batches = sampling.poisson_batches(records_x, records_y,
                                       sampling_probability=rate, steps=steps)
  trace = canaries.trace()
  trained.fit(batches, epochs=1, verbose=0,
              callbacks=[] if trace is None else [trace])
  printed = accounting.epsilon_for_sampling(
      optimizer, sampling='cyclic_poisson' if groups else 'poisson',
      sampling_probability=sampling_probability, groups=groups, delta=delta)
  if groups:
    # The costliest group's steps: a claim that holds for every canary.
    event = accounting.cyclic_poisson_event(
        optimizer, sampling_probability=sampling_probability, groups=groups,
        delta=delta)
  else:
    event = accounting.training_event(
        optimizer, steps=None, sampling_probability=sampling_probability)
  return {'scores': canaries.scores(trained, model),
          'updates': None if trace is None else trace.updates(),
          'printed_epsilon': float(printed),
          'event': event,
          'steps': int(optimizer.dp_steps.numpy()),
          'denominator': optimizer.denominator}


# The attacks' scores (`score_sets`); each costs the others confidence.
SCORES = ('final', 'likelihood', 'spread')
# The default: at q = 0.5 the likelihood ratio did no better than the final
# coordinate (docs/auditing.md), and a third attack lowers every ceiling.
DEFAULT_SCORES = ('final', 'spread')


def score_sets(run: dict, privatizer: core.Privatizer, *,
               sampling_probability: float, learning_rate: float,
               momentum: float = 0.0,
               names: Sequence[str] = SCORES,
               groups: Optional[int] = None) -> dict:
  """The scores `names` of one run (`tfdpx.audit.scores`).

  With every step's release (gradient canaries; under momentum, undone
  with the optimizer known: `scores.releases`; under noise correlated
  across steps, each step's matched filter: `scores.matched`): `final`,
  their sum (with SGD the final coordinate); `likelihood`, the ratio for
  DP-SGD at the privatizer's noise multiplier and clip norm, each step
  holding a canary with probability q (under cyclic sampling, the steps of
  its group, a secret: a mixture over the groups); `spread`. Without (input
  canaries): `final`, the canary's score at the end.
  """
  unknown = sorted(set(names) - set(SCORES))
  if unknown or not names:
    raise ValueError(f'scores must be some of {SCORES}, got {names!r}')
  if run['updates'] is None:
    sets = {'final': run['scores']}
  else:
    released = scores_lib.releases(run['updates'], momentum)
    if privatizer.correlation is not None:
      released = scores_lib.matched(released, privatizer.correlation)
    sets = {'final': scores_lib.total(released),
            'spread': scores_lib.spread(released)}
    if 'likelihood' in names and privatizer.noise_multiplier > 0:
      z = privatizer.noise_multiplier
      clip = privatizer.reference_l2_norm_clip or 1.0
      noise_std = learning_rate * z * clip / run['denominator']
      sets['likelihood'] = scores_lib.likelihood_ratio(
          released / noise_std, 1 / z, sampling_probability, groups or 1)
  return {name: sets[name] for name in names if name in sets}


def one_run(privatizer: core.Privatizer,
            model_fn: Callable[[], tf.keras.Model], x, y, *,
            canaries: canaries_lib.Canaries, sampling_probability: float,
            steps: int, delta: float, confidence: float = 0.95,
            learning_rate: float = 0.1, public_data=None,
            jit_compile: bool = False,
            physical_batch_size: Optional[int] = None,
            batch_sampling_probability: Optional[float] = None,
            scores: Sequence[str] = DEFAULT_SCORES,
            momentum: float = 0.0,
            groups: Optional[int] = None,
            batch_groups: Optional[int] = None) -> dict:
  """The one-run audit of one training run.

  Each canary is included independently with probability 1/2 (a secret
  draw); the run's canary scores (`score_sets`: each one attack) give, at
  `confidence` each (`bounds.one_run_audit`): a lower bound on epsilon
  (Steinke, Nasr, Jagielski 2023, and the f-DP test of Mahloujifar, Melis,
  Chaudhuri 2024), a lower bound on mu-GDP, and whether the run breaks the
  tradeoff curve its accountant claims (`fdp_bounds.claimed_profile` of the
  run's event).

  Args:
    privatizer: the noise step, at the noise multiplier to audit.
    model_fn: builds a fresh Keras model, with a known input shape, that
      outputs logits.
    x, y: the training examples (not canaries) and integer labels.
    canaries: `GradientCanaries` or `InputCanaries`.
    sampling_probability, steps: Poisson sampling rate q and steps.
    delta: the delta of the printed epsilon and of the bound.
    confidence: of the lower bound.
    learning_rate: SGD's.
    public_data: `(x, y)` public examples, for GEP.
    jit_compile: XLA.
    physical_batch_size: virtual batches of this size.
    batch_sampling_probability: as in `train_with_canaries`.
    scores: the attacks' scores, some of `SCORES`. They share the
      confidence (Bonferroni), which lowers every attack's ceiling: with
      10,000 canaries `('final',)` alone reaches further (docs/auditing.md).
    momentum: SGD's; the scores undo it (`scores.releases`).
    groups: cyclic Poisson sampling over this many groups (noise
      correlated across steps: `groups` at least its bands), accounted with
      `epsilon_cyclic_poisson`; None for Poisson sampling.
    batch_groups: as in `train_with_canaries`.

  Returns:
    A dict: `bounds.one_run_audit`'s (`epsilon_lower_bound`, `ceiling`,
    `gaussian_mu_lower_bound`, `gaussian_epsilon`, `gaussian_ceiling`,
    `claim_rejected`, the attack), `printed_epsilon`, `delta`,
    `confidence`, `num_canaries`, `steps`.
  """
  included = np.random.default_rng(sampling.secret_entropy()).random(
      canaries.num_canaries) < 0.5
  run = train_with_canaries(
      privatizer, model_fn, x, y, canaries=canaries, included=included,
      sampling_probability=sampling_probability, steps=steps, delta=delta,
      learning_rate=learning_rate, public_data=public_data,
      jit_compile=jit_compile, physical_batch_size=physical_batch_size,
      batch_sampling_probability=batch_sampling_probability,
      momentum=momentum, groups=groups, batch_groups=batch_groups)
  found = bounds.one_run_audit(
      score_sets(run, privatizer, sampling_probability=sampling_probability,
                 learning_rate=learning_rate, momentum=momentum,
                 names=scores, groups=groups),
      included, delta=delta, confidence=confidence,
      claim=fdp_bounds.claimed_profile(run['event']))
  return {**found, 'printed_epsilon': run['printed_epsilon'], 'delta': delta,
          'confidence': confidence, 'num_canaries': canaries.num_canaries,
          'steps': run['steps']}


def two_run(privatizer: core.Privatizer,
            model_fn: Callable[[], tf.keras.Model], x, y, *, trials: int,
            sampling_probability: float, steps: int, delta: float,
            confidence: float = 0.95, gradient_norm: float = 100.0,
            learning_rate: float = 0.1, public_data=None,
            jit_compile: bool = False,
            physical_batch_size: Optional[int] = None) -> dict:
  """The classic audit: `trials` runs with one gradient canary, as many
  without, and `bounds.two_run_epsilon_lower_bound` on its scores.

  Args: as in `one_run`; `gradient_norm` is the canary's
  (`GradientCanaries`).

  Returns:
    A dict: `epsilon_lower_bound`, `printed_epsilon`, `delta`, `confidence`,
    `trials`, and the bound's threshold and rates.
  """
  canary = canaries_lib.GradientCanaries(1, gradient_norm)
  scores = {True: [], False: []}
  printed: Optional[float] = None
  for _ in range(trials):
    for inside in (True, False):
      run = train_with_canaries(
          privatizer, model_fn, x, y, canaries=canary,
          included=np.array([inside]),
          sampling_probability=sampling_probability, steps=steps,
          delta=delta, learning_rate=learning_rate, public_data=public_data,
          jit_compile=jit_compile, physical_batch_size=physical_batch_size)
      scores[inside].append(run['scores'][0])
      printed = run['printed_epsilon']
  found = bounds.two_run_epsilon_lower_bound(
      scores[True], scores[False], delta=delta, confidence=confidence)
  return {**found, 'printed_epsilon': printed, 'delta': delta,
          'confidence': confidence, 'trials': trials}
