"""The documentation's links resolve, and every raw results file is cited.

`benchmarks/results/` keeps the raw files that README.md, docs/ and
benchmarks/README.md cite, in one folder per date; a figure's file is found
from its date, and an uncited file is removed (git keeps it).
"""

import itertools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
LINK = re.compile(r'\]\(([^)#\s]+)(?:#[^)]*)?\)')
RESULTS_PATH = re.compile(r'results/([A-Za-z0-9_.{},/-]+[A-Za-z0-9}])')


def _documents():
  if not (ROOT / 'README.md').exists():
    pytest.skip('not in a checkout (Bazel runs the tests from its runfiles)')
  return [ROOT / 'README.md', ROOT / 'benchmarks' / 'README.md',
          *sorted((ROOT / 'docs').glob('*.md'))]


def _expanded(pattern):
  """`a_keras{2,3}.md` -> `a_keras2.md`, `a_keras3.md` (shell braces)."""
  parts = re.split(r'\{([^}]*)\}', pattern)
  choices = [[p] if i % 2 == 0 else p.split(',')
             for i, p in enumerate(parts)]
  return [''.join(c) for c in itertools.product(*choices)]


def _cited_results():
  """Each results path the documents name, with the document naming it."""
  for document in _documents():
    for match in RESULTS_PATH.finditer(document.read_text()):
      for name in _expanded(match.group(1)):
        yield document, name


def test_relative_links_resolve():
  broken = []
  for document in _documents():
    for target in LINK.findall(document.read_text()):
      if re.match(r'[a-z]+:', target):
        continue  # https:, mailto:
      if not (document.parent / target).exists():
        broken.append(f'{document.relative_to(ROOT)}: {target}')
  assert not broken, broken


def test_every_results_path_named_exists():
  missing = sorted({f'{d.relative_to(ROOT)}: results/{name}'
                    for d, name in _cited_results()
                    if '<' not in name and not (RESULTS / name).exists()})
  assert not missing, missing


def test_every_results_file_is_cited_and_filed_under_its_date():
  cited = {name for _, name in _cited_results()}
  stored = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob('*')
            if p.is_file()}
  assert not stored - cited, sorted(stored - cited)
  for name in stored:
    folder = name.split('/')[0]
    assert re.fullmatch(r'\d{4}-\d\d-\d\d', folder), name


def test_the_readme_example_trains_and_prints_its_epsilon(capsys):
  """README's first Python block, on 600 random digits for 2 epochs."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  readme = _documents()[0].read_text()
  code = re.search(r'```python\n(.*?)```', readme, flags=re.DOTALL).group(1)
  assert 'epochs=15' in code
  rng = np.random.default_rng(0)
  namespace = {'x_train': rng.random((600, 28, 28), dtype=np.float32),
               'y_train': rng.integers(0, 10, 600)}
  exec(code.replace('epochs=15', 'epochs=2'), namespace)  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert 'epsilon (RDP accountant, Poisson sampling)' in printed
  assert namespace['optimizer'].iterations.numpy() > 0
