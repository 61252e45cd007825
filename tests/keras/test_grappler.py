"""Grappler optimizes every noise step's training step.

When one of grappler's passes leaves a cycle, TensorFlow logs "Ignoring
multi-device function optimization failure" and runs the whole step
unoptimized: no constant folding, no fused kernels, no pruning. The steps
of D2P2, random sparsification and adaptive clipping ran so until the
optimizer's denominator, a constant made under the state updates' control
dependencies, was pushed by constant folding into the noisy sum that the
updates wait for.
"""

import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.grappler import tf_optimizer  # pylint: disable=g-direct-tensorflow-import

from tests.keras import traced_steps

# The steps that failed; the other noise steps in `make test-all`.
DEFAULT_RUN = ('sparsified(gaussian)', 'd2p2_srht_mode_o')


def _optimized(graph: tf.Graph):
  """`graph` through grappler's default passes (two rounds), as TensorFlow
  runs a `tf.function`; raises where a pass leaves a cycle."""
  meta_graph = tf.compat.v1.train.export_meta_graph(
      graph_def=graph.as_graph_def(), graph=graph)
  fetch = meta_graph_pb2.CollectionDef()
  fetch.node_list.value.extend(
      [op.name for op in graph.get_operations()
       if op.type.startswith(('Assign', 'ResourceApply'))] +
      [t.op.name for t in graph.outputs])
  meta_graph.collection_def['train_op'].CopyFrom(fetch)
  config = config_pb2.ConfigProto()
  config.graph_options.rewrite_options.min_graph_nodes = -1
  return tf_optimizer.OptimizeGraph(config, meta_graph)


@pytest.mark.parametrize('privatizer', [
    pytest.param(p, marks=[] if p in DEFAULT_RUN else [pytest.mark.slow])
    for p in traced_steps.PRIVATIZERS])
def test_grappler_optimizes_the_step(privatizer):
  model = traced_steps.built(
      traced_steps.private_model('mlp', privatizer, 64), 'mlp')
  graph = traced_steps.train_step_graph(
      model, traced_steps.batch_spec('mlp', None))
  optimized = _optimized(graph)
  # Constant folding and pruning did their work. Function bodies count:
  # lowering a `tf.cond` moves its branches into the graph.
  assert _nodes(optimized) < _nodes(graph.as_graph_def())


def _nodes(graph_def) -> int:
  """The nodes of `graph_def` and of its functions' bodies."""
  return len(graph_def.node) + sum(
      len(f.node_def) for f in graph_def.library.function)
