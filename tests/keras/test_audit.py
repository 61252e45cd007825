"""Audits through make_private + DPSGD: every noise step, a broken one, power."""

import json

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

from tests import stats
from tfdpx import sampling
from tfdpx.audit import __main__ as command
from tfdpx.audit import canaries as canaries_lib
from tfdpx.audit import flaws
from tfdpx.audit import run
from tfdpx.audit import settings

DELTA = 1e-5
Q = 0.5
STEPS = 10


@pytest.fixture(scope='module', name='digits')
def _digits():
  return settings.digits()


def _dp_sgd_epsilon(noise_multiplier):
  """dp_accounting's RDP epsilon of STEPS Poisson-sampled Gaussian steps."""
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(dp_accounting.PoissonSampledDpEvent(
      Q, dp_accounting.GaussianDpEvent(noise_multiplier)), STEPS)
  return accountant.get_epsilon(DELTA)


def _audit(build, epsilon, digits, *, num_canaries=500, canaries=None,
           jit_compile=False, physical_batch_size=None, groups=None,
           batch_groups=None):
  x, y, public_data = digits
  privatizer = settings.calibrated(
      build, epsilon, steps=STEPS, delta=DELTA, sampling_probability=Q,
      expected_batch_size=run.expected_batch_size(len(y), num_canaries, Q),
      groups=groups)
  return run.one_run(
      privatizer, settings.mlp, x, y,
      canaries=canaries or canaries_lib.GradientCanaries(num_canaries),
      sampling_probability=Q, steps=STEPS, delta=DELTA,
      public_data=public_data, jit_compile=jit_compile,
      physical_batch_size=physical_batch_size, groups=groups,
      batch_groups=batch_groups)


@pytest.mark.parametrize('name', sorted(settings.PRIVATIZERS))
def test_every_noise_steps_lower_bound_is_within_its_epsilon(name, digits):
  found = _audit(settings.PRIVATIZERS[name], 4.0, digits,
                 groups=settings.groups(name))
  assert found['printed_epsilon'] == pytest.approx(4.0, rel=1e-2)
  assert found['epsilon_lower_bound'] <= found['printed_epsilon']
  assert found['gaussian_epsilon'] <= found['printed_epsilon']
  assert found['claim_rejected'] is False  # The accountant's whole curve.


@pytest.mark.slow
@pytest.mark.parametrize('epsilon', [1.0, 16.0])
@pytest.mark.parametrize('name', sorted(settings.PRIVATIZERS))
def test_every_noise_steps_lower_bound_is_within_it_at_1_and_16(
    name, epsilon, digits):
  found = _audit(settings.PRIVATIZERS[name], epsilon, digits,
                 num_canaries=1000, groups=settings.groups(name))
  assert found['epsilon_lower_bound'] <= found['printed_epsilon']


# The flaws this audit catches; 'noise_fraction' and 'no_sampling' it does
# not yet (docs/auditing.md).
CAUGHT = ('no_noise', 'no_clip', 'reused_noise')


@pytest.mark.parametrize('flaw', CAUGHT)
def test_the_audit_catches_a_broken_dp_sgd(flaw, digits):
  found = _audit(lambda *a: settings.flawed(flaw, *a), 1.0, digits,
                 num_canaries=1000)
  assert found['printed_epsilon'] == pytest.approx(1.0, rel=1e-2)
  assert found['epsilon_lower_bound'] > 2 * found['printed_epsilon']
  assert found['claim_rejected']


@pytest.mark.parametrize('flaw', flaws.SELECTION_FLAWS)
def test_the_audit_catches_a_selection_on_exact_counts(flaw, digits):
  # Each gradient canary is the only user of its row: selected on exact
  # counts, its row moves exactly when it is in the batch.
  found = _audit(lambda *a: settings.flawed(flaw, *a), 1.0, digits,
                 num_canaries=1000)
  assert found['printed_epsilon'] == pytest.approx(1.0, rel=1e-2)
  assert found['epsilon_lower_bound'] > 2 * found['printed_epsilon']
  assert found['claim_rejected']


@pytest.mark.parametrize('flaw', flaws.CORRELATED_FLAWS)
def test_the_audit_catches_correlated_noise_on_batches_not_cycled(flaw,
                                                                  digits):
  """Correlated noise (4 bands) accounted as cyclic Poisson sampling over
  4 groups, on plain Poisson batches: every canary can be in every step,
  4 times the steps the accountant counts, in bands that overlap."""
  found = _audit(lambda *a: settings.flawed(flaw, *a), 1.0, digits,
                 num_canaries=10000, groups=settings.groups(flaw),
                 batch_groups=settings.batch_groups(flaw))
  assert found['printed_epsilon'] == pytest.approx(1.0, rel=1e-2)
  assert found['claim_rejected'] or (
      found['epsilon_lower_bound'] > found['printed_epsilon'])


def _release(privatizer, sums, key):
  out, _ = privatizer.release([tf.constant(s) for s in sums], {}, None,
                              tf.constant(key, tf.int64))
  return np.concatenate([o.numpy().ravel() for o in out])


def test_the_noise_fraction_flaw_adds_a_fraction_of_the_noise():
  z, clip = 2.0, 1.5
  flawed = flaws.FlawedGaussian(clip, z, 'noise_fraction')
  released = _release(flawed, [np.zeros((300, 400), np.float32)], [3, 1])
  assert stats.std_matches(released, flaws.NOISE_FRACTION * z * clip)
  assert flawed.dp_event(0) == dp_accounting.GaussianDpEvent(z)


def test_the_reused_noise_flaw_adds_one_draw_at_every_step():
  flawed = flaws.FlawedGaussian(1.0, 2.0, 'reused_noise')
  sums = [np.zeros((50,), np.float32)]
  first, second = (_release(flawed, sums, [3, step]) for step in (1, 2))
  np.testing.assert_array_equal(first, second)
  assert np.std(first) > 1.0
  correct = settings.PRIVATIZERS['gaussian'](2.0, STEPS, None)
  assert not np.array_equal(_release(correct, sums, [3, 1]),
                            _release(correct, sums, [3, 2]))


def _every_record_in_every_batch_without_noise(digits, **kwargs):
  """Canaries 0 and 2 of 4 included, the pipeline flaw's batches (rate 1),
  no noise: `(run, included, a canary's clipped share of an SGD step)`."""
  x, y, _ = digits
  included = np.array([True, False, True, False])
  found = run.train_with_canaries(
      flaws.FlawedGaussian(settings.L2_NORM_CLIP, 1.0, 'no_noise'),
      settings.mlp, x, y, canaries=canaries_lib.GradientCanaries(4),
      included=included, sampling_probability=Q, steps=STEPS, delta=DELTA,
      batch_sampling_probability=settings.batch_sampling_probability(
          'no_sampling'), **kwargs)
  return found, included, 0.1 * settings.L2_NORM_CLIP / found['denominator']


def test_the_no_sampling_flaw_puts_every_canary_in_every_batch(digits):
  """The pipeline flaw: batches drawn at rate 1 while the accountant is told
  q. Every step then moves every included canary's coordinate by the
  canary's clipped share and no excluded one's (no noise here)."""
  found, included, share = _every_record_in_every_batch_without_noise(digits)
  np.testing.assert_allclose(found['updates'][:, included], share, rtol=1e-5)
  np.testing.assert_array_equal(found['updates'][:, ~included], 0.0)
  assert found['printed_epsilon'] == pytest.approx(  # Told q, not 1.
      _dp_sgd_epsilon(1.0), rel=1e-6)


def test_momentum_is_undone_to_each_steps_release(digits):
  """With momentum a coordinate's moves pile up past releases; the scores
  undo it: with no noise and every record in every batch, each included
  canary releases its clipped share at every step, each excluded none."""
  found, included, share = _every_record_in_every_batch_without_noise(
      digits, momentum=0.9)
  assert found['updates'][-1, 0] > 5 * share  # Piled up.
  sets = run.score_sets(found, settings.PRIVATIZERS['gaussian'](0.0, STEPS,
                                                                None),
                        sampling_probability=Q,
                        learning_rate=0.1, momentum=0.9,
                        names=('final', 'spread'))
  np.testing.assert_allclose(sets['final'], share * STEPS * included,
                             rtol=1e-4, atol=1e-9)
  np.testing.assert_allclose(sets['spread'], 0.0, atol=1e-4 * share)


def test_the_scores_are_chosen_and_unknown_ones_named(digits):
  found = _audit(settings.PRIVATIZERS['gaussian'], 16.0, digits)
  alone = run.one_run(
      settings.PRIVATIZERS['gaussian'](0.5, STEPS, None), settings.mlp,
      *digits[:2], canaries=canaries_lib.GradientCanaries(500),
      sampling_probability=Q, steps=STEPS, delta=DELTA, scores=('final',))
  assert found['score'] in run.DEFAULT_SCORES and alone['score'] == 'final'
  assert alone['ceiling'] > found['ceiling']  # Fewer attacks share alpha.
  with pytest.raises(ValueError, match='scores'):
    run.score_sets({'scores': np.zeros(2), 'updates': None}, None,
                   sampling_probability=Q, learning_rate=0.1,
                   names=('total',))


def test_every_steps_release_on_the_canaries_is_recorded(digits):
  x, y, _ = digits
  found = run.train_with_canaries(
      settings.PRIVATIZERS['gaussian'](1.0, STEPS, None), settings.mlp, x, y,
      canaries=canaries_lib.GradientCanaries(6), included=np.ones(6, bool),
      sampling_probability=Q, steps=STEPS, delta=DELTA)
  assert found['updates'].shape == (STEPS, 6)
  np.testing.assert_allclose(found['updates'].sum(axis=0), found['scores'],
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('jit_compile', [False, True])
def test_white_box_audit_of_dp_sgd_has_power_at_epsilon_16(jit_compile,
                                                            digits):
  found = _audit(settings.PRIVATIZERS['gaussian'], 16.0, digits,
                 num_canaries=1000, jit_compile=jit_compile)
  assert 1.0 <= found['epsilon_lower_bound'] <= found['printed_epsilon']


def test_the_audit_runs_through_virtual_batches(digits):
  # A logical batch of about 1,000 rows in physical batches of 128.
  found = _audit(settings.PRIVATIZERS['gaussian'], 16.0, digits,
                 num_canaries=1000, physical_batch_size=128)
  assert 1.0 <= found['epsilon_lower_bound'] <= found['printed_epsilon']
  broken = _audit(lambda *a: settings.flawed('no_noise', *a), 1.0, digits,
                  num_canaries=1000, physical_batch_size=128)
  assert broken['epsilon_lower_bound'] > 2 * broken['printed_epsilon']


def test_input_canaries_audit_through_the_users_model(digits):
  # Random inputs, random labels, scored by their loss under the final model.
  found = _audit(settings.PRIVATIZERS['gaussian'], 16.0, digits,
                 canaries=canaries_lib.InputCanaries(200, (64,), 10))
  assert 0 <= found['epsilon_lower_bound'] <= found['printed_epsilon']
  assert found['num_canaries'] == 200


def test_printed_epsilon_is_the_accountants(digits):
  x, y, _ = digits
  included = np.zeros(4, bool)
  found = run.train_with_canaries(
      settings.PRIVATIZERS['gaussian'](1.3, STEPS, None), settings.mlp, x, y,
      canaries=canaries_lib.GradientCanaries(4), included=included,
      sampling_probability=Q, steps=STEPS, delta=DELTA)
  assert found['steps'] == STEPS
  assert found['printed_epsilon'] == pytest.approx(_dp_sgd_epsilon(1.3),
                                                   rel=1e-6)


def test_a_gradient_canary_is_a_dirac_record_and_examples_miss_the_table():
  canaries = canaries_lib.GradientCanaries(5, gradient_norm=7.0)
  model = canaries.model(settings.mlp())
  x = np.random.default_rng(0).random((3, 64)).astype(np.float32)
  (features, index), labels = canaries.records(
      x, np.array([1, 2, 3]), np.array([False, True, False, True, False]))
  loss = canaries.loss()
  table_variable = model.get_layer(canaries_lib.CANARY_LAYER).embeddings
  at_table = [v is table_variable for v in model.trainable_variables]
  for row in range(len(labels)):
    with tf.GradientTape() as tape:
      value = loss(labels[row:row + 1],
                   model([features[row:row + 1], index[row:row + 1]]))
    grads = [tf.convert_to_tensor(g).numpy() for g in
             tape.gradient(value, model.trainable_variables)]
    table = grads[at_table.index(True)][:, 0]
    others = [g for g, t in zip(grads, at_table) if not t]
    if row < 3:  # An example: no gradient on the table, some elsewhere.
      assert not np.any(table)
      assert any(np.any(g) for g in others)
    else:  # Canaries 1 and 3: -7 e_j on the table, nothing elsewhere.
      expected = np.zeros(5)
      expected[[1, 3][row - 3]] = -7.0
      np.testing.assert_array_equal(table, expected)
      assert not any(np.any(g) for g in others)


def test_two_run_audit_runs_with_and_without_the_canary(digits):
  x, y, _ = digits
  found = run.two_run(settings.PRIVATIZERS['gaussian'](0.5, 3, None),
                      settings.mlp, x[:200], y[:200], trials=4,
                      sampling_probability=Q, steps=3, delta=DELTA)
  assert found['trials'] == 4
  assert 0 <= found['epsilon_lower_bound'] <= found['printed_epsilon']


def test_the_command_writes_one_line_per_audit(tmp_path, capsys):
  out = tmp_path / 'audit.jsonl'
  command.main(['--privatizers=gaussian', '--epsilons=16', '--flaws=no_noise',
                '--num_canaries=100', '--steps=3', f'--out={out}'])
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r['privatizer'] for r in rows] == ['gaussian',
                                             'flawed_gaussian(no_noise)']
  assert rows[0]['target_epsilon'] == 16 and rows[1]['target_epsilon'] == 2
  assert rows[1]['claim_rejected'] in (True, False)
  printed = capsys.readouterr().out
  assert '| gaussian | 16 |' in printed and 'claim rejected' in printed
  assert '| caught |' in printed


def test_a_run_is_caught_by_its_rejected_claim_or_a_bound_above_its_epsilon():
  row = {'printed_epsilon': 2.0, 'epsilon_lower_bound': 1.9,
         'gaussian_epsilon': 2.5, 'claim_rejected': False}
  assert not command.caught(row)  # The Gaussian epsilon alone catches nothing.
  assert command.caught({**row, 'claim_rejected': True})
  assert command.caught({**row, 'epsilon_lower_bound': 2.1})
  assert not command.caught({**row, 'claim_rejected': None})


def test_the_command_audits_with_10000_canaries_by_default():
  assert command._parser().parse_args([]).num_canaries == 10000


def test_the_command_names_an_unknown_privatizer(capsys):
  with pytest.raises(SystemExit):
    command.main(['--privatizers=gaussian,dp_sgd'])
  assert "--privatizers: unknown ['dp_sgd']" in capsys.readouterr().err


def test_poisson_batches_take_a_model_with_two_inputs():
  x = (np.arange(10, dtype=np.float32)[:, None] + 1,
       np.arange(10, dtype=np.int32)[:, None] + 1)
  (first, second), labels, weight = next(iter(sampling.poisson_batches(
      x, np.arange(10) + 1, sampling_probability=0.5, steps=1, seed=3)))
  rows = weight.numpy() > 0
  np.testing.assert_array_equal(first.numpy()[rows, 0],
                                second.numpy()[rows, 0])
  np.testing.assert_array_equal(labels.numpy()[rows], second.numpy()[rows, 0])
  assert not np.any(first.numpy()[~rows])
  with pytest.raises(ValueError, match='same number of examples'):
    sampling.poisson_batches((x[0], x[1][:5]), np.arange(10),
                             sampling_probability=0.5, steps=1)


def test_included_must_mark_every_canary(digits):
  x, y, _ = digits
  with pytest.raises(ValueError, match='included must mark each of the 4'):
    run.train_with_canaries(
        settings.PRIVATIZERS['gaussian'](1.0, 1, None), settings.mlp, x, y,
        canaries=canaries_lib.GradientCanaries(4), included=np.ones(3, bool),
        sampling_probability=Q, steps=1, delta=DELTA)
