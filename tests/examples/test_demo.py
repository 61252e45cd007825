"""`make demo` (examples/demo.py) end to end on a few examples."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


# About a minute per stack (every method of the demo in a subprocess):
# `make test-all` runs it, and `make demo` is the demo itself.
@pytest.mark.slow
def test_demo_writes_one_row_per_method_with_its_epsilon(tmp_path):
  result = subprocess.run(
      [sys.executable, 'examples/demo.py', f'--out_dir={tmp_path}',
       '--demo_epochs=1', '--demo_train_examples=800'],
      cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  with open(tmp_path / 'results.json') as f:
    rows = json.load(f)
  methods = [r['method'] for r in rows]
  assert methods[0] == 'non-private (reference)' and 'DP-SGD' in methods
  assert len(rows) == 7
  for row in rows:
    assert set(row) == {'method', 'epsilon', 'delta', 'sampling',
                        'test_accuracy', 'seconds', 'note'}
    assert 0 <= row['test_accuracy'] <= 1
    if row['method'] == 'non-private (reference)':
      assert row['epsilon'] is None
    else:
      # Calibrated to 3 under Poisson sampling (EpsilonBudget stops before).
      assert 2.5 < row['epsilon'] <= 3.0 and row['sampling'] == 'poisson'
  geodp = next(r for r in rows if r['method'].startswith('GeoDP'))
  assert 'not expected to learn' in geodp['note']
  # One progress line per method and epoch.
  assert result.stdout.count('epoch 1/1') == 7
  for name in ('results.md', 'accuracy.png', 'best_model'):
    assert os.path.exists(tmp_path / name)
