"""GEP's paper settings: the official code's epsilon vs tfdpx's honest one.

For each setting of the paper (spec gep.md §2.1, §3.4) this prints, as a
markdown table:

* the noise multiplier the official code's `get_sigma` picks for GEP (both
  parts) and for B-GEP (from the spec; the repo was run for the spec);
* the epsilon the official accountant claims for it: subsampled-Gaussian RDP
  doubled ("sensitivity sqrt(2)"), orders 2..32 step 0.1, the classic RDP to
  (epsilon, delta) conversion. It is reproduced here only to show the claim;
  tfdpx has no such accounting mode;
* tfdpx's epsilon of the same noise (`tfdpx.privatizers.gep` with explicit
  per-part multipliers, whose `dp_event` is one Gaussian with
  `sigma_eff = sigma / sqrt(2)`, RDP accountant with dp_accounting's orders);
* the per-part multiplier tfdpx calibrates for the paper's target epsilon;
* the same for B-GEP (one Gaussian; the official accounting is right there).

Usage: python -m benchmarks.gep_accounting_table
"""

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dp_accounting  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

import tfdpx  # pylint: disable=g-import-not-at-top
from tfdpx import privatizers  # pylint: disable=g-import-not-at-top

# dataset, target epsilon, delta, epochs, q, official sigma GEP, B-GEP.
SETTINGS = [
    ('MNIST', 2, 1e-5, 50, 1 / 60, 3.33, 2.43),
    ('MNIST', 5, 1e-5, 100, 1 / 60, 2.07, 1.55),
    ('MNIST', 8, 1e-5, 200, 1 / 60, 1.93, 1.45),
    ('CIFAR-10', 2, 1e-5, 50, 0.02, 3.64, 2.64),
    ('CIFAR-10', 5, 1e-5, 100, 0.02, 2.24, 1.67),
    ('CIFAR-10', 8, 1e-5, 200, 0.02, 2.09, 1.56),
    ('SVHN', 2, 1e-6, 5, 1000 / 604388, 0.87, 0.85),
    ('SVHN', 5, 1e-6, 10, 1000 / 604388, 0.65, 0.62),
    ('SVHN', 8, 1e-6, 20, 1000 / 604388, 0.60, 0.57),
]


def official_epsilon(q, sigma, steps, delta, doubled):
  """The official `get_sigma` accounting (spec §3.3), for the record."""
  orders = list(np.arange(2, 32, 0.1))
  accountant = dp_accounting.rdp.RdpAccountant(orders)
  accountant.compose(dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          q, dp_accounting.GaussianDpEvent(sigma)), steps))
  rdp = np.asarray(accountant.rdp) * (2 if doubled else 1)
  return float(np.min(rdp - math.log(delta) / (np.asarray(orders) - 1)))


def main():
  print('| dataset | target ε | δ | T | official σ GEP | official-code ε '
        '| tfdpx ε (same σ) | tfdpx σ GEP for target | official σ B-GEP '
        '| tfdpx ε B-GEP (same σ) | tfdpx σ B-GEP for target |')
  print('|---|---|---|---|---|---|---|---|---|---|---|')
  for name, target, delta, epochs, q, sigma, sigma_b in SETTINGS:
    steps = int(epochs / q + 1e-9)  # As the official code: int(epochs / q).
    kwargs = {'steps': steps, 'sampling_probability': q, 'delta': delta}
    gep = privatizers.gep(1000, 5.0, 2.0, embedding_noise_multiplier=sigma,
                          residual_noise_multiplier=sigma)
    bgep = privatizers.gep(1000, 5.0, 2.0, biased=True,
                           embedding_noise_multiplier=sigma_b)
    eps = tfdpx.accounting.epsilon(gep, **kwargs)
    eps_b = tfdpx.accounting.epsilon(bgep, **kwargs)
    z = tfdpx.accounting.calibrate_noise_multiplier(target, gep, **kwargs)
    z_b = tfdpx.accounting.calibrate_noise_multiplier(target, bgep, **kwargs)
    claimed = official_epsilon(q, sigma, steps, delta, doubled=True)
    print(f'| {name} | {target} | {delta:g} | {steps} | {sigma:.2f} | '
          f'{claimed:.2f} | {eps:.2f} | '
          f'{gep.with_noise_multiplier(z).embedding_noise_multiplier:.2f} | '
          f'{sigma_b:.2f} | {eps_b:.2f} | {z_b:.2f} |', flush=True)


if __name__ == '__main__':
  main()
