"""The example scripts run by path from the repository root, not only with -m."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))


@pytest.mark.parametrize('script, flag', [
    ('examples/train.py', '--privatizer'), ('examples/demo.py', '--demo_epsilon')])
def test_help_runs_by_path(script, flag):
  result = subprocess.run([sys.executable, script, '--help'], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          check=False)
  # absl's --help prints the flags and exits with status 1.
  assert 'Traceback' not in result.stderr, result.stderr[-2000:]
  assert flag in result.stdout
