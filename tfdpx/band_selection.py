"""The number of bands of least trajectory noise at a privacy target.

Under cyclic Poisson sampling more bands cancel more of the noise in the
model's trajectory (the prefix sums of the updates), but each example's group
is sampled `b` times as often, so the noise multiplier that reaches the same
epsilon grows with `b`. Choquette-Choo et al. (2023, amplified banded matrix
factorization) choose `b` by the product, the trajectory's noise at the
target: `z_b * error_b`. One band is DP-SGD with Poisson sampling, so the
choice never has more trajectory noise than DP-SGD. It depends on the number
of examples, the batch, the epochs and the privacy target only, none of them
secret here (as for `calibrate_noise_multiplier`): choosing releases nothing.
"""

from typing import Dict

from tfdpx import accounting
from tfdpx import core
from tfdpx import correlation
from tfdpx import privatizers
from tfdpx import sampling


def trajectory_noise(privatizer: core.Privatizer, bands: int, *,
                     target_epsilon: float, examples: int, batch_size: int,
                     epochs: int, delta: float, momentum: float = 0.0,
                     accountant: str = 'rdp') -> float:
  """The trajectory's noise of `bands` bands at the target, per unit clip.

  Args:
    privatizer: the noise step without correlation (e.g.
      `privatizers.gaussian(clip, 1.0)`); its multiplier is calibrated.
    bands: the number of bands `b`; the run samples group `t mod b` at step t
      with probability `b * batch_size / examples`, over
      `epochs * ceil(examples / batch_size)` steps.
    target_epsilon, delta, accountant: as in `calibrate_noise_multiplier`.
    examples, batch_size, epochs: the data's size, the expected batch and the
      passes over the data.
    momentum: SGD's momentum; the strategy is optimized for, and measured on,
      its trajectory (`correlation.workload`).

  Returns:
    `z_b * banded_toeplitz(b, steps).prefix_sum_error(steps, momentum)`: the
    root mean squared noise of the trajectory in units of the noise std of
    one unit of sensitivity.

  Raises:
    ValueError: if `b * batch_size > examples` (a group smaller than the
      batch), or as `calibrate_noise_multiplier`.
  """
  if bands * batch_size > examples:
    raise ValueError(
        f'bands={bands} groups of {examples} examples hold fewer than the '
        f'batch_size={batch_size}: at most {examples // batch_size} bands')
  steps = epochs * sampling.steps_per_epoch(examples, batch_size)
  strategy = correlation.banded_toeplitz(bands, steps, momentum=momentum)
  # One band is independent noise; cyclic Poisson sampling over one group is
  # Poisson sampling.
  if bands > 1:
    privatizer = privatizers.correlated(privatizer, strategy)
  z = accounting.calibrate_noise_multiplier(
      target_epsilon, privatizer, steps=steps, delta=delta,
      sampling_probability=bands * batch_size / examples,
      accountant=accountant, groups=bands)
  return z * strategy.prefix_sum_error(steps, momentum)


def trajectory_noise_by_bands(privatizer: core.Privatizer, *,
                              max_bands: int = 32,
                              **setting) -> Dict[int, float]:
  """`trajectory_noise` of 1, 2, 4, ... bands up to `max_bands`.

  Band counts whose groups would hold fewer examples than the batch are left
  out. `setting`: the keyword arguments of `trajectory_noise`.
  """
  result = {}
  bands = 1
  while bands <= max_bands and bands * setting['batch_size'] <= setting[
      'examples']:
    result[bands] = trajectory_noise(privatizer, bands, **setting)
    bands *= 2
  return result


def least_noise_bands(privatizer: core.Privatizer, *, max_bands: int = 32,
                      **setting) -> int:
  """The band count (a power of 2, 1 is DP-SGD) of least trajectory noise.

  Args:
    privatizer: the noise step without correlation, as in `trajectory_noise`.
    max_bands: the largest band count tried (each band keeps a copy of the
      noised coordinates).
    **setting: `target_epsilon`, `examples`, `batch_size`, `epochs`, `delta`,
      and optionally `momentum`, `accountant`: as in `trajectory_noise`.

  Returns:
    The number of bands, and so of cyclic Poisson groups, for the run.
  """
  noise = trajectory_noise_by_bands(privatizer, max_bands=max_bands,
                                    **setting)
  return min(noise, key=noise.get)
