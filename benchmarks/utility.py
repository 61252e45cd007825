"""Utility of the noise steps at the same honest epsilon: one harness, one config per experiment.

`python -m benchmarks.utility benchmarks/configs/<name>.json` trains every
method of the config through `examples.train.run` (the examples' training
loop: `make_private`, Poisson sampling, secret noise, the noise multiplier
calibrated to each target epsilon by the accountant), then:

1. **tunes** the hyperparameters the config names (`tune`, e.g. the learning
   rate) for each method and epsilon on a validation split carved from the
   training set (`validation_examples`, the last examples of it), with the
   first seed; the test set plays no part in the choice;
2. **reports** test accuracy, mean and standard deviation over every seed
   of `seeds`, at the chosen setting, with the epsilon each run really has.

It writes `<out_dir>/<name>.jsonl` (one line per run as it ends, tuning runs
included) and `<out_dir>/<name>.md` (the table the docs page shows, with the
command). `--epsilons=8,3` runs only those epsilons of the config, in that
order; `--table_only` writes the table of the records a run cut short left.

A config is a JSON object:

- `title`: the table's title; `doc`: the page that shows it;
- `flags`: flags of `examples/train.py` common to every run;
- `validation_examples`, `epsilons` (list), `seeds` (list, at least 3);
- `tune`: `{flag: [values]}`, the grid every method is tuned over;
- `methods`: `{name: {"flags": [...], "tune": {...}, "note": "..."}}`; a
  method's own `tune` replaces the common one (`{}`: nothing to tune). A
  method with `--privatizer=none` runs without privacy and no epsilon.
"""

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys

if __package__ in (None, ''):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=wrong-import-position
from examples import train

MIN_SEEDS = 3


def load(path):
  """The config at `path`, checked."""
  with open(path) as f:
    config = json.load(f)
  for key in ('title', 'flags', 'validation_examples', 'epsilons', 'seeds',
              'methods'):
    if key not in config:
      raise ValueError(f'{path}: the config has no "{key}"')
  if len(config['seeds']) < MIN_SEEDS:
    raise ValueError(f'{path}: "seeds" has {len(config["seeds"])} seeds; a '
                     f'mean and spread need at least {MIN_SEEDS}')
  if not config['validation_examples'] > 0:
    raise ValueError(f'{path}: tuning needs "validation_examples" > 0')
  for name, method in config['methods'].items():
    if any(f.startswith(('--seed', '--validation_examples',
                         '--target_epsilon'))
           for f in method['flags'] + config['flags']):
      raise ValueError(f'{path}: method {name!r}: seeds, epsilons and the '
                       'validation split are the harness\'s to set')
  return config


def _private(flags):
  return '--privatizer=none' not in flags


def _grid(tune):
  """Every combination of the tuned flags' values, as lists of flags."""
  names = sorted(tune)
  return [[f'--{n}={v}' for n, v in zip(names, values)]
          for values in itertools.product(*(tune[n] for n in names))]


def _run(flags, seed, epsilon, validation_examples):
  """One `examples.train.run`; the record the harness keeps of it."""
  budget = [f'--target_epsilon={epsilon}'] if epsilon is not None else []
  result = train.run(['utility', *flags, *budget, f'--seed={seed}',
                      f'--validation_examples={validation_examples}',
                      '--verbose=0'])
  return {'epsilon': (None if math.isinf(result['epsilon'])
                      else float(result['epsilon'])),
          'noise_multiplier': result['noise_multiplier'],
          'noise_bands': result.get('noise_bands'),
          'validation_accuracy': float(result['validation_accuracy']),
          'test_accuracy': float(result['test_accuracy']),
          # sparse_embeddings: rows selected a step, over the whole run.
          'selected_rows': (result['history'][-1].get('selected_rows')
                            if result.get('history') else None),
          'seconds': result['seconds']}


def run(config, log=print, keep=lambda record: None):
  """Tunes and reports every (method, epsilon) of `config`: the records,
  each also passed to `keep` as soon as its run ends."""
  records = []

  def add(record):
    records.append(record)
    keep(record)

  for epsilon, (name, method) in itertools.product(
      config['epsilons'], config['methods'].items()):
    flags = config['flags'] + method['flags']
    target = epsilon if _private(flags) else None
    grid = _grid(method.get('tune', config.get('tune', {})))
    best, best_accuracy = grid[0], -1.0
    for setting in grid if len(grid) > 1 else []:
      # On the validation split, with the first seed.
      record = _run(flags + setting, config['seeds'][0], target,
                    config['validation_examples'])
      add({'phase': 'tune', 'method': name, 'target_epsilon': target,
           'setting': setting, 'seed': config['seeds'][0], **record})
      log(f'  tune {name} eps={target} {" ".join(setting)}: validation '
          f'{record["validation_accuracy"]:.4f}')
      if record['validation_accuracy'] > best_accuracy:
        best, best_accuracy = setting, record['validation_accuracy']
    for seed in config['seeds']:
      record = _run(flags + best, seed, target, config['validation_examples'])
      add({'phase': 'report', 'method': name, 'target_epsilon': target,
           'setting': best, 'seed': seed, **record})
      log(f'  {name} eps={target} seed {seed}: test '
          f'{record["test_accuracy"]:.4f}')
  return records


def _note(method, group):
  """A method's note, the bands it chose where it chooses them, and the rows
  it selected a step where it selects."""
  note = method.get('note', '')
  if '--noise_bands=auto' in method['flags']:
    bands = sorted({r['noise_bands'] for r in group})
    note += f'{"; " if note else ""}{"/".join(map(str, bands))} bands chosen'
  selected = [r['selected_rows'] for r in group
              if r.get('selected_rows') is not None]
  if selected:
    note += (f'{"; " if note else ""}{statistics.mean(selected):.0f} rows '
             'selected a step')
  return note


def _stdev(values):
  return f'{statistics.stdev(values):.4f}' if len(values) > 1 else '-'


def table(config, records, command):
  """The markdown table of the `report` records, with how it was made."""
  lines = [f'**{config["title"]}** ({command}, '
           f'{datetime.date.today().isoformat()})', '',
           '| method | target epsilon | epsilon | chosen setting | '
           'validation accuracy | test accuracy (mean ± std) | runs | note |',
           '|---|---|---|---|---|---|---|---|']
  reported = [r for r in records if r['phase'] == 'report']
  for (name, target), group in itertools.groupby(
      reported, key=lambda r: (r['method'], r['target_epsilon'])):
    group = list(group)
    test = [r['test_accuracy'] for r in group]
    validation = [r['validation_accuracy'] for r in group]
    epsilons = [r['epsilon'] for r in group]
    epsilon = ('none' if epsilons[0] is None else
               f'{max(epsilons):.3f}')
    lines.append(
        f'| {name} | {"-" if target is None else f"{target:g}"} | '
        f'{epsilon} | {" ".join(group[0]["setting"]) or "-"} | '
        f'{statistics.mean(validation):.4f} | '
        f'{statistics.mean(test):.4f} ± {_stdev(test)} | '
        f'{len(group)} | {_note(config["methods"][name], group)} |')
  return '\n'.join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('config', help='benchmarks/configs/<name>.json')
  parser.add_argument('--out_dir', default='out/utility')
  parser.add_argument('--epsilons', type=lambda v: [float(e) for e in
                                                    v.split(',')],
                      help='only these of the config\'s epsilons, in this '
                      'order, e.g. 8,3')
  parser.add_argument('--table_only', action='store_true',
                      help='the table of the records already in '
                      '<out_dir>/<name>.jsonl (of a run cut short), no run')
  args = parser.parse_args(argv)
  config = load(args.config)
  command = f'`python -m benchmarks.utility {args.config}`'
  if args.epsilons:
    unknown = set(args.epsilons) - set(config['epsilons'])
    if unknown:
      raise ValueError(f'--epsilons: {sorted(unknown)} not in the config\'s '
                       f'{config["epsilons"]}')
    config['epsilons'] = args.epsilons
    command = command[:-1] + f' --epsilons={",".join(map(str, args.epsilons))}`'
  name = os.path.splitext(os.path.basename(args.config))[0]
  os.makedirs(args.out_dir, exist_ok=True)
  path = os.path.join(args.out_dir, f'{name}.jsonl')
  if args.table_only:
    with open(path) as f:
      records = [json.loads(line) for line in f]
  else:
    with open(path, 'w') as f:  # Each record as its run ends.

      def keep(record):
        f.write(json.dumps({'config': name, **record}) + '\n')
        f.flush()

      records = run(config, keep=keep)
  markdown = table(config, records, command)
  with open(os.path.join(args.out_dir, f'{name}.md'), 'w') as f:
    f.write(markdown + '\n')
  print(markdown)


if __name__ == '__main__':
  main()
