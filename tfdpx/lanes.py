"""Independent computations built in a few lanes, to bound peak memory.

TensorFlow's executor starts every op whose inputs are ready. Independent
per-layer computations (each layer's per-example statistics) then run side
by side, and the step's peak holds the temporaries of all of them at once.
Built in lanes, computation `n` starts after computation `n - lanes` has
finished: at most `lanes` of them are alive together, and with two lanes both
cores of a small machine stay busy (measured against one lane on the encoder
benchmark). Eager execution and XLA, which order ops themselves, are
unaffected.
"""

from typing import Callable, Iterable, List, TypeVar

import tensorflow as tf

LANES = 2

T = TypeVar('T')


def in_lanes(computations: Iterable[Callable[[], T]],
             lanes: int = LANES) -> List[T]:
  """The results of `computations`, each built after the one `lanes` before.

  Args:
    computations: callables that build ops and return a tensor, a list of
      tensors (None entries allowed) or None.
    lanes: how many computations may run at once.

  Returns:
    Each computation's result, in order.
  """
  last = [[] for _ in range(lanes)]
  results = []
  for n, compute in enumerate(computations):
    with tf.control_dependencies(last[n % lanes]):
      result = compute()
    last[n % lanes] = [t for t in tf.nest.flatten(result) if t is not None]
    results.append(result)
  return results
