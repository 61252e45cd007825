"""Bazel ignores every directory the Makefile creates in the checkout.

`make test` then `make bazel-test` failed when `.venv-keras3` was missing
from `.bazelignore`: Bazel walked into TensorFlow's headers in it.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_virtualenv_of_the_makefile_is_ignored_by_bazel():
  if not (ROOT / 'Makefile').exists():
    pytest.skip('not in a checkout (Bazel runs the tests from its runfiles)')
  makefile = (ROOT / 'Makefile').read_text()
  created = re.findall(r'^VENV\d* := (\S+)$', makefile, flags=re.MULTILINE)
  assert {'.venv', '.venv-keras3'} <= set(created)
  ignored = set((ROOT / '.bazelignore').read_text().split())
  assert set(created) <= ignored
