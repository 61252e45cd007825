"""Runs one pytest file as a Bazel `py_test` (see the top-level BUILD).

Bazel starts this with the runfiles copy of the repository root as the working
directory, so `tests/...` paths, `pyproject.toml` (markers, warning filters) and
`tests/conftest.py` are found as under `make test`. Tests marked `slow` are left out,
as in `make test`; `bazel test --test_arg=-m --test_arg=slow //...` (the last `-m`
wins) selects them instead. Each test case lands in Bazel's test.xml.
"""

import os
import sys

import pytest


class _Deselected:
  """Counts tests the `-m` expression leaves out, and files skipped whole
  (`pytest.skip(..., allow_module_level=True)`: Keras 3's keras-hub tests on
  Stack A)."""

  def __init__(self):
    self.count = 0

  def pytest_deselected(self, items):
    self.count += len(items)

  def pytest_collectreport(self, report):
    if report.skipped:
      self.count += 1


def main(argv):
  args = ['-q', '-p', 'no:cacheprovider', '--rootdir=.', '-c', 'pyproject.toml',
          '-m', 'not slow']
  if 'XML_OUTPUT_FILE' in os.environ:
    args.append('--junitxml=' + os.environ['XML_OUTPUT_FILE'])
  deselected = _Deselected()
  code = pytest.main(args + argv[1:], plugins=[deselected])
  if code == pytest.ExitCode.NO_TESTS_COLLECTED and deselected.count:
    # Every test in the file was deselected (all slow) or the file was
    # skipped whole: nothing failed.
    print(f'pytest: no test to run ({deselected.count} deselected by -m or '
          'skipped whole)')
    return 0
  return int(code)


if __name__ == '__main__':
  sys.exit(main(sys.argv))
