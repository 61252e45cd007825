r"""Audits every noise step at several printed epsilons: `python -m tfdpx.audit`.

For each privatizer and target epsilon the noise multiplier is calibrated
(RDP, Poisson sampling), one run trains the digits MLP with canaries
(`tfdpx.audit.settings`), and the one-run lower bound is printed next to the
printed epsilon; `--flaws` adds deliberately broken DP-SGD runs, which the
audit must catch, and `--two_run_trials` the classic bound for DP-SGD.

  python -m tfdpx.audit --epsilons=1,4,16 --out=audit.jsonl
"""

import json
import time

from absl import app
from absl import flags

from tfdpx import accounting
from tfdpx.audit import canaries as canaries_lib
from tfdpx.audit import flaws
from tfdpx.audit import run
from tfdpx.audit import settings

FLAGS = flags.FLAGS
flags.DEFINE_list('privatizers', list(settings.PRIVATIZERS),
                  'Noise steps to audit (tfdpx.audit.settings.PRIVATIZERS).')
flags.DEFINE_list('epsilons', ['1', '4', '16'], 'Printed epsilons to audit.')
flags.DEFINE_list('flaws', list(flaws.FLAWS),
                  'Broken DP-SGD configurations to audit (may be empty).')
flags.DEFINE_float('flaw_epsilon', 1.0,
                   'The epsilon the broken configurations claim.')
flags.DEFINE_enum('canaries', 'gradient', ['gradient', 'input'],
                  'Dirac gradient canaries (white box) or random input '
                  'canaries scored by their loss (black box).')
flags.DEFINE_integer('num_canaries', 1000, 'Canaries per run.')
flags.DEFINE_float('canary_gradient_norm', 100.0,
                   'Gradient canaries: norm of each canary\'s gradient.')
flags.DEFINE_float('sampling_probability', 0.5, 'Poisson sampling rate q.')
flags.DEFINE_integer('steps', 20, 'Training steps per run.')
flags.DEFINE_float('learning_rate', 0.1, 'SGD learning rate.')
flags.DEFINE_float('delta', 1e-5, 'Delta of the printed epsilon and bound.')
flags.DEFINE_float('confidence', 0.95, 'Confidence of each lower bound.')
flags.DEFINE_integer('repetitions', 1, 'One-run audits per setting.')
flags.DEFINE_integer('two_run_trials', 0,
                     'If > 0, also the classic bound for DP-SGD at each '
                     'epsilon, from this many runs with and as many without '
                     'one gradient canary.')
flags.DEFINE_string('out', None, 'Append one JSON line per audit here.')


def _canaries(x, y):
  if FLAGS.canaries == 'gradient':
    return canaries_lib.GradientCanaries(FLAGS.num_canaries,
                                         FLAGS.canary_gradient_norm)
  return canaries_lib.InputCanaries(FLAGS.num_canaries, x.shape[1:],
                                    int(y.max()) + 1)


def calibrated(build, epsilon, expected_batch_size):
  """`build`'s privatizer at the noise multiplier that prints `epsilon`."""
  steps, q = FLAGS.steps, FLAGS.sampling_probability
  z = accounting.calibrate_noise_multiplier(
      epsilon, build(1.0, steps, expected_batch_size), steps=steps,
      delta=FLAGS.delta, sampling_probability=q)
  return build(z, steps, expected_batch_size)


def _report(row, rows):
  rows.append(row)
  print(f"| {row['privatizer']} | {row['target_epsilon']:g} | "
        f"{row['printed_epsilon']:.2f} | {row['epsilon_lower_bound']:.2f} | "
        f"{row.get('num_correct', '-')}/{row.get('num_guesses', '-')} | "
        f"{row['seconds']:.0f} |", flush=True)
  if FLAGS.out:
    with open(FLAGS.out, 'a') as f:
      f.write(json.dumps(row) + '\n')


def _settings(**extra):
  return {'canaries': FLAGS.canaries, 'num_canaries': FLAGS.num_canaries,
          'sampling_probability': FLAGS.sampling_probability,
          'steps': FLAGS.steps, **extra}


def main(argv):
  del argv
  x, y, public_data = settings.digits()
  q = FLAGS.sampling_probability
  expected_batch_size = q * (len(y) + FLAGS.num_canaries / 2)
  common = dict(sampling_probability=q, steps=FLAGS.steps, delta=FLAGS.delta,
                confidence=FLAGS.confidence,
                learning_rate=FLAGS.learning_rate, public_data=public_data)
  audits = [(name, settings.PRIVATIZERS[name], float(e))
            for name in FLAGS.privatizers for e in FLAGS.epsilons]
  audits += [(f'flawed_gaussian({flaw})',
              lambda *a, flaw=flaw: settings.flawed(flaw, *a),
              FLAGS.flaw_epsilon) for flaw in FLAGS.flaws]
  print('| privatizer | target eps | printed eps | lower bound | '
        'correct/guesses | seconds |\n|---|---|---|---|---|---|')
  rows = []
  for name, build, epsilon in audits:
    privatizer = calibrated(build, epsilon, expected_batch_size)
    for _ in range(FLAGS.repetitions):
      start = time.time()
      found = run.one_run(privatizer, settings.mlp, x, y,
                          canaries=_canaries(x, y), **common)
      _report({'privatizer': name, 'target_epsilon': epsilon,
               'audit': 'one_run', **found,
               'noise_multiplier': privatizer.noise_multiplier,
               'seconds': time.time() - start, **_settings()}, rows)
  if FLAGS.two_run_trials:
    for epsilon in map(float, FLAGS.epsilons):
      privatizer = calibrated(settings.PRIVATIZERS['gaussian'], epsilon,
                              expected_batch_size)
      start = time.time()
      found = run.two_run(privatizer, settings.mlp, x, y,
                          trials=FLAGS.two_run_trials,
                          gradient_norm=FLAGS.canary_gradient_norm, **common)
      _report({'privatizer': 'gaussian (two runs)',
               'target_epsilon': epsilon, 'audit': 'two_run', **found,
               'noise_multiplier': privatizer.noise_multiplier,
               'seconds': time.time() - start,
               **_settings(canaries='gradient', num_canaries=1)}, rows)
  _summary(rows)


def _summary(rows):
  """One line per setting: every run's lower bound, and the largest."""
  print('\n| privatizer | printed eps | lower bounds | largest |\n'
        '|---|---|---|---|')
  by_setting = {}
  for row in rows:
    by_setting.setdefault((row['privatizer'], row['target_epsilon']),
                          []).append(row)
  for (name, _), runs in by_setting.items():
    found = [r['epsilon_lower_bound'] for r in runs]
    print(f"| {name} | {runs[0]['printed_epsilon']:.2f} | "
          f"{', '.join(f'{e:.2f}' for e in found)} | {max(found):.2f} |")


if __name__ == '__main__':
  app.run(main)
