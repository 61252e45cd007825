"""The one-run audit's power on the exact mechanisms, without training.

`python -m benchmarks.audit_simulation` draws each gradient canary's
per-step values as DP-SGD (or a broken DP-SGD) makes them, `b_t + z N(0, 1)`
with `b_t = 1` when the canary is included and in step t's Poisson batch,
and audits them with `tfdpx.audit.bounds.one_run_audit` as
`python -m tfdpx.audit` does (scores `final` and `spread`, the accountant's
claimed curve): what the best score can show with that many canaries,
whatever the model. The setting is the audit's (q = 0.5, 20 steps, delta
1e-5, noise calibrated by RDP).
"""

import argparse

import numpy as np

from tfdpx import accounting
from tfdpx import privatizers
from tfdpx.audit import bounds
from tfdpx.audit import fdp_bounds
from tfdpx.audit import scores

Q, STEPS, DELTA = 0.5, 20, 1e-5
# name: (printed epsilon, share of the accounted noise, real sampling rate)
CASES = {'dp_sgd': (None, 1.0, Q), 'noise_fraction': (2.0, 0.5, Q),
         'no_sampling': (2.0, 1.0, 1.0)}


def audit_once(rng, num_canaries, z, noise_share, rate, claim):
  included = rng.random(num_canaries) < 0.5
  sampled = (rng.random((STEPS, num_canaries)) < rate) & included
  values = sampled + noise_share * z * rng.standard_normal(sampled.shape)
  return bounds.one_run_audit(
      {'final': scores.total(values), 'spread': scores.spread(values)},
      included, delta=DELTA, claim=claim)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cases', default='dp_sgd:4,dp_sgd:16,noise_fraction,'
                      'no_sampling', help='name[:printed epsilon], ...')
  parser.add_argument('--num_canaries', type=int, default=1000)
  parser.add_argument('--runs', type=int, default=40)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  rng = np.random.default_rng(args.seed)
  print(f'{args.num_canaries} canaries, {args.runs} simulated runs a case\n\n'
        '| case | printed eps | bound: median, max | Gaussian eps: median, '
        'max | runs above printed (Gaussian) | claim rejected |\n'
        '|---|---|---|---|---|---|')
  for case in args.cases.split(','):
    name, _, epsilon = case.partition(':')
    default_epsilon, noise_share, rate = CASES[name]
    epsilon = float(epsilon or default_epsilon)
    z = accounting.calibrate_noise_multiplier(
        epsilon, privatizers.gaussian(1.0, 1.0), steps=STEPS, delta=DELTA,
        sampling_probability=Q)
    claim = fdp_bounds.claimed_profile(accounting.training_event(
        privatizers.gaussian(1.0, z), steps=STEPS, sampling_probability=Q))
    found = [audit_once(rng, args.num_canaries, z, noise_share, rate, claim)
             for _ in range(args.runs)]
    bound = np.array([f['epsilon_lower_bound'] for f in found])
    gaussian = np.array([f['gaussian_epsilon'] for f in found])
    print(f'| {name} | {epsilon:g} | {np.median(bound):.2f}, '
          f'{bound.max():.2f} | {np.median(gaussian):.2f}, '
          f'{gaussian.max():.2f} | {np.sum(gaussian > epsilon)} | '
          f'{sum(f["claim_rejected"] for f in found)} |', flush=True)


if __name__ == '__main__':
  main()
