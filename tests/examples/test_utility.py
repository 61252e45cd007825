"""The utility harness: tuned on the validation split only, reported over seeds."""

import json
import os

import pytest

from benchmarks import utility
from examples import train

CONFIGS = os.path.join(os.path.dirname(utility.__file__), 'configs')


def _config(**overrides):
  config = {'title': 't', 'flags': ['--dataset=mnist5k'],
            'validation_examples': 50, 'epsilons': [3.0], 'seeds': [0, 1, 2],
            'tune': {'learning_rate': [0.5, 1.0, 2.0]},
            'methods': {'A': {'flags': ['--privatizer=gaussian']},
                        'plain': {'flags': ['--privatizer=none'], 'tune': {}}}}
  return config | overrides


def _fake_run(calls):
  """`train.run` whose validation accuracy peaks at learning rate 1.0 and
  whose test accuracy peaks at 2.0: a harness that looks at the test set
  picks the wrong one."""

  def run(argv):
    calls.append(argv)
    lr = next((float(a.split('=')[1]) for a in argv
               if a.startswith('--learning_rate=')), 1.0)
    seed = int(next(a for a in argv if a.startswith('--seed='))[7:])
    private = '--privatizer=none' not in argv
    return {'epsilon': 2.99 if private else float('inf'),
            'noise_multiplier': 1.0 if private else None,
            'validation_accuracy': {0.5: 0.7, 1.0: 0.9, 2.0: 0.8}[lr],
            'test_accuracy': {0.5: 0.6, 1.0: 0.7, 2.0: 0.95}[lr] + seed / 100,
            'noise_bands': 4 if '--noise_bands=auto' in argv else 1,
            'seconds': 1.0}

  return run


def test_the_setting_is_chosen_on_validation_data_and_reported_over_seeds(
    monkeypatch):
  calls = []
  monkeypatch.setattr(train, 'run', _fake_run(calls))
  records = utility.run(_config(), log=lambda *_: None)
  report = [r for r in records if r['phase'] == 'report' and r['method'] == 'A']
  assert [r['setting'] for r in report] == [['--learning_rate=1.0']] * 3
  assert [r['seed'] for r in report] == [0, 1, 2]
  assert [r['test_accuracy'] for r in report] == pytest.approx([0.7, 0.71, 0.72])
  # Every private run is calibrated to the target and holds out validation.
  for argv in calls:
    assert '--validation_examples=50' in argv
    assert ('--target_epsilon=3.0' in argv) == ('--privatizer=none' not in argv)
  table = utility.table(_config(), records, 'cmd')
  assert '| A | 3 | 2.990 | --learning_rate=1.0 | 0.9000 | 0.7100 ± 0.0100 | 3 |' in table
  assert '| plain | - | none | - |' in table


def test_the_bands_a_method_chose_are_in_its_note(monkeypatch):
  monkeypatch.setattr(train, 'run', _fake_run([]))
  config = _config(methods={'banded': {'flags': [
      '--privatizer=gaussian', '--noise_bands=auto'], 'note': 'n'}})
  table = utility.table(config, utility.run(config, log=lambda *_: None),
                        'cmd')
  assert '| n; 4 bands chosen |' in table


@pytest.mark.parametrize('bad', [{'seeds': [0, 1]}, {'validation_examples': 0},
                                 {'flags': ['--seed=1']}])
def test_a_config_that_cannot_give_an_honest_table_is_refused(bad, tmp_path):
  path = tmp_path / 'bad.json'
  path.write_text(json.dumps(_config(**bad)))
  with pytest.raises(ValueError, match='bad.json'):
    utility.load(str(path))


@pytest.mark.parametrize('name', sorted(os.listdir(CONFIGS)))
def test_every_shipped_config_loads(name):
  config = utility.load(os.path.join(CONFIGS, name))
  assert os.path.exists(os.path.join(os.path.dirname(CONFIGS), '..',
                                     config['doc']))


def test_records_are_kept_as_runs_end_and_epsilons_can_be_chosen(
    monkeypatch, tmp_path):
  """`--epsilons` runs those epsilons in that order; every record is in the
  jsonl as soon as its run ends, so `--table_only` tables a run cut short."""
  config = _config(epsilons=[1.0, 3.0, 8.0],
                   methods={'A': {'flags': ['--privatizer=gaussian']}})
  path = tmp_path / 'c.json'
  path.write_text(json.dumps(config))
  calls = []
  fake = _fake_run(calls)

  def cut_short(argv):
    if len(calls) == 5:  # 3 tuning runs and 2 seeds of epsilon 8.
      raise KeyboardInterrupt
    return fake(argv)

  monkeypatch.setattr(train, 'run', cut_short)
  with pytest.raises(KeyboardInterrupt):
    utility.main([str(path), f'--out_dir={tmp_path}', '--epsilons=8,3'])
  assert all('--target_epsilon=8.0' in argv for argv in calls)
  lines = (tmp_path / 'c.jsonl').read_text().splitlines()
  assert len(lines) == 5
  utility.main([str(path), f'--out_dir={tmp_path}', '--table_only'])
  table = (tmp_path / 'c.md').read_text()
  assert '| A | 8 | 2.990 | --learning_rate=1.0 | 0.9000 | 0.7050 ± 0.0071 | 2 |' in table
  with pytest.raises(ValueError, match='--epsilons'):
    utility.main([str(path), f'--out_dir={tmp_path}', '--epsilons=2'])
