"""tfdpx.lanes: computations built in lanes wait for the one `lanes` before."""

import tensorflow as tf

from tfdpx import lanes


def _control_inputs_in_graph(num, lanes_):
  """For each computation's op, the indices of the ops it waits for."""
  graph = tf.Graph()
  with graph.as_default():
    outputs = lanes.in_lanes(
        [lambda n=n: tf.constant(float(n), name=f'c{n}') * 2.0
         for n in range(num)], lanes_)
  index = {out.op.name: n for n, out in enumerate(outputs)}
  waits = []
  for out in outputs:
    # The product's constant operand is created inside the dependency scope.
    ops = [out.op] + [t.op for t in out.op.inputs]
    waits.append(sorted({index[c.name] for op in ops
                         for c in op.control_inputs if c.name in index}))
  return waits


def test_each_computation_waits_for_the_one_a_lane_before():
  assert _control_inputs_in_graph(5, 2) == [[], [], [0], [1], [2]]
  assert _control_inputs_in_graph(4, 1) == [[], [0], [1], [2]]


def test_results_are_those_of_the_computations_in_order():
  results = lanes.in_lanes([lambda: None, lambda: [tf.constant(1), None],
                            lambda: tf.constant(2)])
  assert results[0] is None
  assert int(results[1][0]) == 1 and results[1][1] is None
  assert int(results[2]) == 2
