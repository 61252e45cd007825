r"""Audits every noise step at several printed epsilons: `python -m tfdpx.audit`.

For each privatizer and target epsilon the noise multiplier is calibrated
(RDP, Poisson sampling; cyclic Poisson sampling over `settings.groups` for
noise correlated across steps), one run trains the digits MLP with canaries
(`tfdpx.audit.settings`), and the one-run lower bound is printed next to the
printed epsilon; `--flaws` adds deliberately broken DP-SGD runs, which the
audit must catch, and `--two_run_trials` the classic bound for DP-SGD.

A run is *caught* when its accountant's claimed tradeoff curve is rejected
(the f-DP test at `--confidence`) or a valid lower bound exceeds its printed
epsilon. The Gaussian epsilon is printed beside them as what it is: a bound
only if the run's tradeoff curve is Gaussian-shaped; it catches nothing.

  python -m tfdpx.audit --epsilons=1,4,16 --out=audit.jsonl
"""

import argparse
import json
import sys
import time

from tfdpx.audit import canaries as canaries_lib
from tfdpx.audit import flaws
from tfdpx.audit import run
from tfdpx.audit import settings


_ALL_FLAWS = (flaws.FLAWS + flaws.SELECTION_FLAWS + flaws.PIPELINE_FLAWS +
              flaws.CORRELATED_FLAWS)


def _flawed_step(flaw):
  """The noise step a flaw breaks."""
  if flaw in flaws.SELECTION_FLAWS:
    return 'sparse_embeddings'
  return 'correlated' if flaw in flaws.CORRELATED_FLAWS else 'gaussian'


def _names(text):
  return [name for name in text.split(',') if name]


def _parser():
  parser = argparse.ArgumentParser(
      prog='python -m tfdpx.audit', description=__doc__.split('\n')[0])
  add = parser.add_argument
  add('--privatizers', type=_names, default=list(settings.PRIVATIZERS),
      help='noise steps to audit, comma-separated (default: all of '
      'tfdpx.audit.settings.PRIVATIZERS)')
  add('--epsilons', type=lambda t: [float(e) for e in _names(t)],
      default=[1.0, 4.0, 16.0], help='printed epsilons to audit')
  add('--flaws', type=_names,
      default=list(_ALL_FLAWS),
      help='broken configurations to audit (may be empty)')
  add('--flaw_epsilon', type=float, default=2.0,
      help='the epsilon the broken configurations claim')
  add('--canaries', choices=['gradient', 'input'], default='gradient',
      help='Dirac gradient canaries (white box) or random input canaries '
      'scored by their loss (black box)')
  add('--num_canaries', type=int, default=10000,
      help='canaries per run (10,000: the broken steps that 1,000 miss are '
      'caught; docs/auditing.md)')
  add('--scores', type=_names, default=list(run.DEFAULT_SCORES),
      help='the attacks\' scores, comma-separated, of '
      f'{", ".join(run.SCORES)} (tfdpx.audit.scores; they share the '
      'confidence)')
  add('--canary_gradient_norm', type=float, default=100.0,
      help="gradient canaries: norm of each canary's gradient")
  add('--sampling_probability', type=float, default=0.5,
      help='Poisson sampling rate q')
  add('--steps', type=int, default=20, help='training steps per run')
  add('--learning_rate', type=float, default=0.1, help='SGD learning rate')
  add('--momentum', type=float, default=0.0,
      help="SGD's momentum (the white-box scores undo it)")
  add('--physical_batch_size', type=int, default=None,
      help='run each batch as virtual batches of this size')
  add('--delta', type=float, default=1e-5,
      help='delta of the printed epsilon and of the bound')
  add('--confidence', type=float, default=0.95,
      help='confidence of each lower bound')
  add('--repetitions', type=int, default=1, help='one-run audits per setting')
  add('--two_run_trials', type=int, default=0,
      help='if > 0, also the classic bound for DP-SGD at each epsilon, from '
      'this many runs with and as many without one gradient canary')
  add('--out', help='append one JSON line per audit to this file')
  return parser


def _canaries(args, x, y):
  if args.canaries == 'gradient':
    return canaries_lib.GradientCanaries(args.num_canaries,
                                         args.canary_gradient_norm)
  return canaries_lib.InputCanaries(args.num_canaries, x.shape[1:],
                                    int(y.max()) + 1)


def caught(row) -> bool:
  """Whether a run shows its step broken: its claimed curve rejected, or a
  valid lower bound above its printed epsilon."""
  return bool(row.get('claim_rejected')) or (
      row['epsilon_lower_bound'] > row['printed_epsilon'])


def _report(args, row, rows):
  rows.append(row)
  gaussian = (f"{row['gaussian_epsilon']:.2f} | "
              f"{row['gaussian_ceiling']:.2f}" if 'gaussian_epsilon' in row
              else '- | -')
  rejected = {True: 'yes', False: 'no', None: '-'}[row.get('claim_rejected')]
  print(f"| {row['privatizer']} | {row['target_epsilon']:g} | "
        f"{row['printed_epsilon']:.2f} | {row['epsilon_lower_bound']:.2f} | "
        f"{row['ceiling']:.2f} | {rejected} | "
        f"{'**yes**' if caught(row) else 'no'} | {gaussian} | "
        f"{row.get('score') or '-'} {row.get('test', '')} | "
        f"{row.get('num_correct', '-')}/{row.get('num_guesses', '-')} | "
        f"{row['seconds']:.0f} |", flush=True)
  if args.out:
    with open(args.out, 'a') as f:
      f.write(json.dumps(row) + '\n')


def _settings(args, **extra):
  return {'canaries': args.canaries, 'num_canaries': args.num_canaries,
          'sampling_probability': args.sampling_probability,
          'steps': args.steps, 'scores': args.scores,
          'momentum': args.momentum, **extra}


def main(argv=None):
  """Runs the audits `argv` (default: the command line) asks for."""
  parser = _parser()
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  for flag, known in (('privatizers', settings.PRIVATIZERS),
                      ('flaws', _ALL_FLAWS),
                      ('scores', run.SCORES)):
    unknown = sorted(set(getattr(args, flag)) - set(known))
    if unknown:
      parser.error(f'--{flag}: unknown {unknown}; known: {sorted(known)}')
  if not args.scores:
    parser.error('--scores: name at least one')
  x, y, public_data = settings.digits()
  q = args.sampling_probability
  batch_size = run.expected_batch_size(len(y), args.num_canaries, q)

  def calibrated(build, epsilon, groups):
    return settings.calibrated(
        build, epsilon, steps=args.steps, delta=args.delta,
        sampling_probability=q, expected_batch_size=batch_size,
        groups=groups)

  common = dict(sampling_probability=q, steps=args.steps, delta=args.delta,
                confidence=args.confidence,
                learning_rate=args.learning_rate, public_data=public_data,
                physical_batch_size=args.physical_batch_size)
  # (name, builder, epsilon, groups, what the batches really are)
  audits = [(name, settings.PRIVATIZERS[name], e, settings.groups(name), {})
            for name in args.privatizers for e in args.epsilons]
  audits += [(f'flawed_{_flawed_step(flaw)}({flaw})',
              lambda *a, flaw=flaw: settings.flawed(flaw, *a),
              args.flaw_epsilon, settings.groups(flaw),
              {'batch_sampling_probability':
                   settings.batch_sampling_probability(flaw),
               'batch_groups': settings.batch_groups(flaw)})
             for flaw in args.flaws]
  print('| privatizer | target eps | printed eps | lower bound | ceiling | '
        'claim rejected | caught | Gaussian eps (if Gaussian-shaped) | '
        'its ceiling | attack | correct/guesses | seconds |\n'
        '|---|---|---|---|---|---|---|---|---|---|---|---|')
  rows = []
  for name, build, epsilon, groups, batches in audits:
    privatizer = calibrated(build, epsilon, groups)
    for _ in range(args.repetitions):
      start = time.time()
      found = run.one_run(privatizer, settings.mlp, x, y,
                          canaries=_canaries(args, x, y), groups=groups,
                          scores=args.scores, momentum=args.momentum,
                          **batches, **common)
      _report(args, {'privatizer': name, 'target_epsilon': epsilon,
               'audit': 'one_run', **found,
               'noise_multiplier': privatizer.noise_multiplier,
               'seconds': time.time() - start,
               **_settings(args, groups=groups)}, rows)
  if args.two_run_trials:
    for epsilon in args.epsilons:
      privatizer = calibrated(settings.PRIVATIZERS['gaussian'], epsilon, None)
      start = time.time()
      found = run.two_run(privatizer, settings.mlp, x, y,
                          trials=args.two_run_trials,
                          gradient_norm=args.canary_gradient_norm, **common)
      _report(args, {'privatizer': 'gaussian (two runs)',
               'target_epsilon': epsilon, 'audit': 'two_run', **found,
               'noise_multiplier': privatizer.noise_multiplier,
               'seconds': time.time() - start,
               **_settings(args, canaries='gradient', num_canaries=1)}, rows)
  _summary(rows)


def _summary(rows):
  """One line per setting: every run's bounds and claim tests, the largest."""
  print('\n| privatizer | printed eps | lower bounds | largest | '
        'claim rejected | caught | Gaussian eps (if Gaussian-shaped) | '
        'largest |\n'
        '|---|---|---|---|---|---|---|---|')
  by_setting = {}
  for row in rows:
    by_setting.setdefault((row['privatizer'], row['target_epsilon']),
                          []).append(row)
  for (name, _), runs in by_setting.items():
    found = [r['epsilon_lower_bound'] for r in runs]
    gaussian = [r.get('gaussian_epsilon', 0.0) for r in runs]
    tested = [r['claim_rejected'] for r in runs
              if r.get('claim_rejected') is not None]
    print(f"| {name} | {runs[0]['printed_epsilon']:.2f} | "
          f"{', '.join(f'{e:.2f}' for e in found)} | {max(found):.2f} | "
          f"{f'{sum(tested)} of {len(tested)}' if tested else '-'} | "
          f"{sum(map(caught, runs))} of {len(runs)} | "
          f"{', '.join(f'{e:.2f}' for e in gaussian)} | {max(gaussian):.2f} |")


if __name__ == '__main__':
  main()
