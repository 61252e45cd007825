"""Two-sided statistical checks with tolerances derived from the sample size."""

import math

import numpy as np

# Number of standard errors a statistic may deviate before a check fails:
# with 5 the false-alarm rate of one check is about 6e-7.
Z = 5.0


def std_matches(samples, expected_std, mean=0.0) -> bool:
  """Whether zero-mean Gaussian `samples` have standard deviation `expected_std`.

  The sample standard deviation of n draws has relative standard error about
  1 / sqrt(2n); the check accepts a relative deviation below Z times that, so
  it is two-sided: too much and too little noise both fail.
  """
  samples = np.asarray(samples, dtype=np.float64).ravel()
  n = samples.size
  measured = math.sqrt(np.mean(np.square(samples - mean)))
  return abs(measured / expected_std - 1.0) < Z / math.sqrt(2 * n)


def relative_error(got, want) -> float:
  """`|got - want| / |want|` in L2 over all entries of two lists of arrays."""
  got = np.concatenate([np.ravel(g) for g in got])
  want = np.concatenate([np.ravel(w) for w in want])
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def relative_tolerance(n: int) -> float:
  """The relative tolerance `std_matches` uses for n samples."""
  return Z / math.sqrt(2 * n)
