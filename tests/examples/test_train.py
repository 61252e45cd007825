"""examples/train.py end to end on tiny settings."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

import tfdpx
from examples import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
TINY = ['train.py', '--dataset=digits', '--train_examples=96',
        '--batch_size=32', '--epochs=1', '--seed=3', '--verbose=0',
        '--learning_rate=0.5']
PRIVATIZERS = [name for name in train.FLAGS['privatizer'].parser.enum_values
               if name != 'none']

# Keras 3 logs the (public) step count where Keras 2 logs nothing
# (docs/keras3.md).
PUBLIC = {'dp_steps'}


@pytest.mark.parametrize('name', PRIVATIZERS)
def test_every_privatizer_trains_end_to_end(name):
  public = 32 if name == 'gep' else 0  # Taken out of the 96 examples.
  results = train.run(TINY + [f'--privatizer={name}', '--target_epsilon=8',
                              f'--public_examples={public}',
                              '--gep_num_bases=4'])
  assert results['steps'] == (96 - public) // 32
  assert 0 < results['epsilon'] <= 8
  assert 0 <= results['test_accuracy'] <= 1
  assert 'epsilon' in results['history'][0]


@pytest.mark.parametrize('dataset, extra', [
    ('zipf_recommendation', []), ('zipf_text', []),
    ('zipf_text', ['--sparsify', '--physical_batch_size=12'])])
def test_sparse_embeddings_train_on_the_synthetic_ids(dataset, extra):
  results = train.run([
      'train.py', f'--dataset={dataset}', f'--model={dataset[5:]}',
      '--train_examples=96', '--batch_size=32', '--epochs=1', '--seed=3',
      '--verbose=0', '--optimizer=adam', '--learning_rate=0.01',
      '--sparse_embeddings', '--false_positive_rate=0.01',
      '--target_epsilon=8'] + extra)
  assert 0 < results['epsilon'] <= 8
  assert 'sparse_embeddings' in results['statement']
  assert ('sparsified' in results['statement']) == ('--sparsify' in extra)
  # The rows selected a step: released indices, logged with epsilon.
  assert results['history'][0]['selected_rows'] > 0


def test_sparsified_poisson_run_reports_its_assumption():
  results = train.run(TINY + ['--sparsify', '--sampling=poisson',
                              '--noise_multiplier=1.0', '--epochs=2'])
  assert 'Poisson, as the accountant assumes' in results['statement']
  assert 'sparsified' in results['statement']
  assert results['steps'] == 2 * 3


def test_default_run_is_poisson_sampled_and_releases_held_out_metrics_only():
  results = train.run(TINY + ['--noise_multiplier=1.0', '--epochs=2'])
  assert results['sampling'] == 'poisson' and results['private']
  assert 'Poisson, as the accountant assumes' in results['statement']
  assert results['epsilon'] == tfdpx.accounting.epsilon(
      tfdpx.privatizers.gaussian(1.0, 1.0), steps=6,
      sampling_probability=32 / 96, delta=1e-5)
  # No loss or metric of a private training batch: epsilon and held-out
  # accuracy only.
  assert all(set(h) - PUBLIC == {'epsilon', 'test_accuracy'}
             for h in results['history'])


def test_shuffled_run_reports_the_once_per_epoch_bound():
  results = train.run(TINY + ['--sampling=shuffle', '--noise_multiplier=1.0',
                              '--epochs=2'])
  once_per_epoch = tfdpx.accounting.epsilon_once_per_epoch(
      tfdpx.privatizers.gaussian(1.0, 1.0), steps=6, steps_per_epoch=3,
      delta=1e-5)
  assert results['epsilon'] == once_per_epoch
  assert results['history'][-1]['epsilon'] == once_per_epoch
  poisson = tfdpx.accounting.epsilon(
      tfdpx.privatizers.gaussian(1.0, 1.0), steps=6,
      sampling_probability=32 / 96, delta=1e-5)
  assert once_per_epoch > poisson
  assert f'{once_per_epoch:.4g}' in results['statement']
  assert 'which this run did not use: not a guarantee' in results['statement']


def test_correlated_run_samples_cyclically_and_says_so():
  """Noise correlated over 3 steps, 3 groups of 32 examples, the expected
  batch still 32 (each member of the step's group sampled): 2 epochs of 3
  steps, each example in at most 2 of them."""
  results = train.run(TINY + ['--sampling=cyclic_poisson', '--noise_bands=3',
                              '--noise_multiplier=1.0', '--epochs=2'])
  correlated = tfdpx.privatizers.correlated(
      tfdpx.privatizers.gaussian(1.0, 1.0),
      tfdpx.correlation.banded_toeplitz(3, 6))
  expected = tfdpx.accounting.epsilon_cyclic_poisson(
      correlated, steps=6, sampling_probability=1.0, groups=3, delta=1e-5)
  assert results['steps'] == 6
  assert results['epsilon'] == pytest.approx(expected, rel=1e-12)
  assert 'cyclic Poisson: 3 groups' in results['statement']
  assert 'correlated across steps' in results['statement']


def test_auto_bands_are_the_least_noisy_at_the_target(caplog):
  """96 examples in one pass at epsilon 8: two bands have less trajectory
  noise than one; the run samples 2 groups and is accounted so. Under Adam
  the choice (made for SGD's trajectory) comes with a warning."""
  results = train.run(TINY + ['--sampling=cyclic_poisson', '--noise_bands=auto',
                              '--target_epsilon=8', '--optimizer=adam'])
  assert "least noise in SGD's trajectory; under --optimizer=adam" in (
      caplog.text)
  assert results['noise_bands'] == tfdpx.band_selection.least_noise_bands(
      tfdpx.privatizers.gaussian(1.0, 1.0), target_epsilon=8.0, examples=96,
      batch_size=32, epochs=1, delta=1e-5) == 2
  assert results['epsilon'] == pytest.approx(
      tfdpx.accounting.epsilon_cyclic_poisson(
          tfdpx.privatizers.correlated(
              tfdpx.privatizers.gaussian(1.0, results['noise_multiplier']),
              tfdpx.correlation.banded_toeplitz(2, 3)),
          steps=results['steps'], sampling_probability=64 / 96, groups=2,
          delta=1e-5), rel=1e-12)
  assert 'cyclic Poisson: 2 groups' in results['statement']
  with pytest.raises(ValueError, match='needs --sampling=cyclic_poisson'):
    train.run(TINY + ['--noise_bands=auto', '--target_epsilon=8'])
  with pytest.raises(ValueError, match='pass no --noise_multiplier'):
    train.run(TINY + ['--sampling=cyclic_poisson', '--noise_bands=auto',
                      '--target_epsilon=8', '--noise_multiplier=1.0'])
  with pytest.raises(ValueError, match='positive integer or "auto"'):
    train.run(TINY + ['--noise_bands=two', '--noise_multiplier=1.0'])
  # Adam would ignore the momentum the strategy would be optimized for.
  with pytest.raises(ValueError, match="--momentum is SGD's; --optimizer=adam"):
    train.run(TINY + ['--noise_bands=2', '--noise_multiplier=1.0',
                      '--optimizer=adam', '--momentum=0.9'])


def test_the_noise_variance_correction_reaches_adam_only():
  results = train.run(TINY + ['--sampling=cyclic_poisson', '--noise_bands=2',
                              '--noise_multiplier=1.0', '--optimizer=adam',
                              '--noise_variance_correction=0.5'])
  assert results['optimizer'].get_config()['noise_variance_correction'] == 0.5
  with pytest.raises(ValueError, match="correction is Adam's"):
    train.run(TINY + ['--noise_multiplier=1.0',
                      '--noise_variance_correction=0.5'])


def test_a_cyclic_run_is_not_resumed_with_new_groups(tmp_path):
  """The groups are drawn from a secret no checkpoint keeps: a resume would
  draw new ones, so it is refused, naming the run."""
  args = TINY + ['--sampling=cyclic_poisson', '--noise_bands=3',
                 '--noise_multiplier=1.0', f'--checkpoint_dir={tmp_path}']
  train.run(args)
  with pytest.raises(ValueError, match='cannot be resumed'):
    train.run(args + ['--epochs=2'])


def _history(results):
  return [v.numpy() for v in
          results['optimizer'].secret_checkpoint().secret_state]


def test_a_resume_continues_the_secrets_kept_in_the_secret_dir(tmp_path):
  """With --secret_dir a resumed run restores the noise history (which no
  model checkpoint holds) and the cyclic groups' seed, kept only there."""
  args = TINY + ['--sampling=cyclic_poisson', '--noise_bands=3',
                 '--noise_multiplier=1.0',
                 f'--checkpoint_dir={tmp_path / "model"}',
                 f'--secret_dir={tmp_path / "secret"}']
  first = _history(train.run(args))
  assert all(np.any(h != 0) for h in first)
  assert oct(os.stat(tmp_path / 'secret' / 'sampling_seed').st_mode)[-3:] == (
      '600')
  # Resumed after its last epoch: nothing to train, the history restored.
  restored = _history(train.run(args))
  for a, b in zip(first, restored):
    np.testing.assert_array_equal(a, b)
  resumed = train.run(args + ['--epochs=2'])
  assert resumed['steps'] == 6
  names = [name for name, _ in tf.train.list_variables(
      str(tmp_path / 'model'))]
  assert not any('secret' in name for name in names), names


def test_blt_run_is_accounted_on_shuffled_batches():
  """Two buffers over 2 epochs of 3 shuffled steps, optimized for that
  participation: one Gaussian mechanism of the BLT's once-per-epoch bound."""
  results = train.run(TINY + ['--sampling=shuffle', '--noise_buffers=2',
                              '--noise_multiplier=1.0', '--epochs=2'])
  correlated = tfdpx.privatizers.correlated(
      tfdpx.privatizers.gaussian(1.0, 1.0),
      tfdpx.correlation.blt(2, 6, steps_per_epoch=3))
  assert results['steps'] == 6
  assert results['epsilon'] == pytest.approx(
      tfdpx.accounting.epsilon_for_sampling(
          correlated, sampling='shuffle', steps=6, steps_per_epoch=3,
          delta=1e-5), rel=1e-12)
  assert 'blt(buffers=2)' in results['statement']
  with pytest.raises(ValueError, match='pass one'):
    train.run(TINY + ['--noise_bands=2', '--noise_buffers=2',
                      '--noise_multiplier=1.0'])


def test_shuffled_run_calibrates_to_its_own_bound():
  results = train.run(TINY + ['--sampling=shuffle', '--target_epsilon=8',
                              '--epochs=2'])
  assert results['steps'] == 6  # The budget lets every planned step run.
  assert 0.99 * 8 <= results['epsilon'] <= 8


@pytest.mark.parametrize('extra, private', [
    (['--seed=4'], True), (['--insecure_noise_seed=4'], False)])
def test_only_a_known_noise_seed_makes_a_run_not_private(extra, private):
  results = train.run(TINY + ['--noise_multiplier=1.0'] + extra)
  assert results['private'] == private
  assert ('NOT PRIVATE: the noise seed is known' in
          results['statement']) == (not private)


def test_the_script_runs_by_path():
  out = subprocess.run(
      [sys.executable, 'examples/train.py'] + TINY[1:] +
      ['--noise_multiplier=1.0'], cwd=ROOT, capture_output=True, text=True,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'tfdpx privacy statement' in out.stdout
  assert '(poisson sampling)' in out.stdout


def test_tfds_path_with_mock_data():
  with tfds.testing.mock_data(num_examples=64):
    results = train.run(['train.py', '--dataset=mnist', '--batch_size=32',
                         '--epochs=1', '--seed=0', '--verbose=0',
                         '--noise_multiplier=1.0'])
  assert results['steps'] == 2


SPARSE = ['train.py', '--dataset=zipf_recommendation',
          '--model=recommendation', '--train_examples=96', '--batch_size=32',
          '--seed=3', '--verbose=0', '--sparse_embeddings']


@pytest.mark.parametrize('args', [TINY, SPARSE + ['--privatizer=dpdr']],
                         ids=['cnn', 'sparse_dpdr'])
def test_resumed_run_equals_uninterrupted_run(args, tmp_path):
  # Without noise, so that the weights must be equal: a resumed run keeps the
  # optimizer (Adam's lazy rows too), privatizer state (sparse_embeddings'
  # and DPDR's, whose base lies on the rows the last step released) and
  # ledger, but draws fresh noise by design.
  args = args + ['--noise_multiplier=0.0', '--sampling=shuffle',
                 '--optimizer=adam', '--learning_rate=0.01']
  whole = train.run(args + ['--epochs=2',
                            f'--checkpoint_dir={tmp_path / "whole"}'])
  train.run(args + ['--epochs=1', f'--checkpoint_dir={tmp_path / "split"}'])
  resumed = train.run(args + ['--epochs=2',
                              f'--checkpoint_dir={tmp_path / "split"}'])
  assert resumed['steps'] == whole['steps'] == 6
  for a, b in zip(whole['model'].get_weights(),
                  resumed['model'].get_weights()):
    np.testing.assert_array_equal(a, b)


def test_epsilon_budget_stops_training_before_the_target():
  # At noise 3 and q = 1/3, epsilon passes 2 after about 13 of 90 steps.
  results = train.run(TINY + ['--noise_multiplier=3', '--epochs=30',
                              '--target_epsilon=2'])
  assert 3 < results['steps'] < 90
  assert results['epsilon'] <= 2
  one_more = tfdpx.accounting.epsilon(
      tfdpx.privatizers.gaussian(1.0, 3.0), steps=results['steps'] + 1,
      sampling_probability=32 / 96, delta=1e-5)
  assert one_more > 2


def test_saved_model_loads_and_predicts_without_tfdpx(tmp_path):
  export = tmp_path / 'export'
  results = train.run(TINY + ['--noise_multiplier=1.0',
                              f'--export_dir={export}'])
  x = np.random.default_rng(0).random((4, 28, 28, 1)).astype('float32')
  expected = results['model'](x).numpy()
  np.save(tmp_path / 'x.npy', x)
  code = (
      'import json, sys, numpy as np, tensorflow as tf\n'
      f'loaded = tf.saved_model.load({str(export)!r})\n'
      f'x = np.load({str(tmp_path / "x.npy")!r})\n'
      'out = loaded.signatures["serving_default"](tf.constant(x))\n'
      'assert not any(m.startswith("tfdpx") for m in sys.modules)\n'
      'print(json.dumps(list(out.values())[0].numpy().tolist()))\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=str(tmp_path),
                       capture_output=True, text=True, check=True,
                       env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  got = np.array(json.loads(out.stdout.strip().splitlines()[-1]))
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_the_non_private_reference_trains_the_same_model_without_privacy():
  results = train.run(TINY + ['--privatizer=none', '--epochs=2'])
  assert results['epsilon'] == float('inf') and not results['private']
  assert results['steps'] == 2 * 3
  assert 'no privacy guarantee' in results['statement']
  assert len(results['history']) == 2
  with pytest.raises(ValueError, match='--privatizer=none'):
    train.run(TINY + ['--privatizer=none', '--target_epsilon=3'])


def test_validation_examples_are_held_out_of_training(capsys):
  results = train.run(TINY + ['--noise_multiplier=1.0', '--epochs=2',
                              '--validation_examples=32', '--progress'])
  # 64 examples left to train on: q = 32 / 64, two steps per epoch.
  assert results['steps'] == 2 * 2
  assert results['epsilon'] == tfdpx.accounting.epsilon(
      tfdpx.privatizers.gaussian(1.0, 1.0), steps=4,
      sampling_probability=32 / 64, delta=1e-5)
  assert 0 <= results['validation_accuracy'] <= 1
  assert all(set(h) - PUBLIC == {'epsilon', 'test_accuracy',
                                 'validation_accuracy'}
             for h in results['history'])
  lines = [l for l in capsys.readouterr().out.splitlines() if 'epoch' in l]
  assert len(lines) == 2 and 'epsilon so far' in lines[1]


def test_d2p2_back_projection_flag_reaches_the_privatizer():
  train.FLAGS.unparse_flags()
  train.FLAGS(['train.py', '--privatizer=d2p2',
               '--d2p2_back_projection=paper'])  # Not the default.
  privatizer = train.build_privatizer(1.0, steps_per_epoch=10)
  assert privatizer.config['back_projection'] == 'paper'


def test_a_run_without_seed_draws_one_that_keras_accepts():
  """A 64-bit seed made set_random_seed fail in every run without --seed."""
  results = train.run([a for a in TINY if not a.startswith('--seed')] +
                      ['--noise_multiplier=1.0'])
  assert results['steps'] == 3


def test_adaptive_clipping_and_virtual_batches_from_flags():
  """--adaptive_clipping adapts the clip norm (logged per epoch) at the
  calibrated effective noise multiplier; --physical_batch_size keeps one
  step per logical batch."""
  results = train.run(TINY + ['--adaptive_clipping', '--target_epsilon=8',
                              '--l2_norm_clip=0.01', '--epochs=2',
                              '--physical_batch_size=8'])
  assert results['steps'] == 6
  assert 0 < results['epsilon'] <= 8
  clips = [epoch['l2_norm_clip'] for epoch in results['history']]
  assert clips[0] > 0.01 and clips[1] > clips[0]  # Far too small: it grows.


def test_user_level_run_samples_users_and_says_so():
  results = train.run(TINY + ['--num_users=12', '--examples_per_user=8',
                              '--batch_size=4', '--target_epsilon=8'])
  assert results['steps'] == 3  # ceil(12 users / 4 expected per batch).
  assert 0 < results['epsilon'] <= 8
  assert 'user-level' in results['statement']
  assert '12 users (96 examples)' in results['statement']
