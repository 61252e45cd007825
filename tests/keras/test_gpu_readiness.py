"""GPU readiness without a GPU: every op of the training step has a kernel.

The installed TensorFlow wheels are CUDA builds, so their kernel registry
lists the ops (and dtypes) with GPU kernels even where no GPU is present. The
training step of each benchmark model made private is traced for every noise
step (XLA off) and each op of it, function bodies included, is looked up. An
op without a GPU kernel for its dtypes would run on the host, with a copy
each way every step, or fail under soft placement off. The same steps lower
to XLA (`jit_compile=True`), which places the whole step on the device.

GEP takes its GPU form (`loop_free`) here, as where TensorFlow sees a GPU;
its exported XLA step holds at most two loops more than DP-SGD's.

docs/performance.md lists what this does and does not say about GPU speed.
"""

import functools
import re
import sys
from unittest import mock

import pytest
import tensorflow as tf
from tensorflow.python.framework import kernels  # pylint: disable=g-direct-tensorflow-import

from tests.keras import traced_steps
from tfdpx import privatizers

GEP_MODULE = sys.modules[privatizers.GEP.__module__]

# Ops TensorFlow runs on the host by design, with the reason. None is found
# in the steps today; an op added here must say why it is harmless.
HOST_BY_DESIGN = {}

MODELS = ('cnn', 'mlp', 'text', 'transformer')
BATCH = 32


def _type_values(attr):
  if attr.HasField('list'):
    return list(attr.list.type)
  return [attr.type] if attr.type else []


def _has_gpu_kernel(node) -> bool:
  """Whether a GPU kernel's type constraints admit `node`'s attributes."""
  for kernel in kernels.get_registered_kernels_for_op(node.op).kernel:
    if kernel.device_type not in ('GPU', 'DEFAULT'):  # DEFAULT: any device.
      continue
    if all(set(_type_values(node.attr[c.name])) <=
           set(c.allowed_values.list.type)
           for c in kernel.constraint if c.name in node.attr):
      return True
  return False


def ops_without_gpu_kernels(graph: tf.Graph):
  """`{(op, dtypes)}` of the nodes of `graph` (and its functions) that no
  GPU kernel takes; calls of the graph's own functions are skipped."""
  graph_def = graph.as_graph_def()
  functions = {f.signature.name for f in graph_def.library.function}
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  missing = set()
  for node in nodes:
    if node.op in functions or node.op in HOST_BY_DESIGN:
      continue
    if not _has_gpu_kernel(node):
      dtypes = sorted({tf.as_dtype(t).name for a in node.attr.values()
                       for t in _type_values(a)})
      missing.add((node.op, tuple(dtypes)))
  return missing


def _slow_cases():
  """The transformer's steps (10-30 s each) but DP-SGD's, the wrappers' but
  on the CNN and `traced_steps.NORMS_ONLY`'s but on the MLP, in `make
  test-all`."""
  for model_name in MODELS:
    for privatizer in traced_steps.PRIVATIZERS:
      wrapper = privatizer.startswith(('adaptive', 'per_layer'))
      slow = ((model_name == 'transformer' and privatizer != 'gaussian') or
              (wrapper and model_name != 'cnn') or
              (privatizer in traced_steps.NORMS_ONLY and model_name != 'mlp'))
      yield pytest.param(model_name, privatizer,
                         marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize('model_name,privatizer', _slow_cases())
def test_every_op_of_the_step_has_a_gpu_kernel_and_the_step_lowers_to_xla(
    model_name, privatizer, monkeypatch):
  monkeypatch.setattr(GEP_MODULE, 'gpu_visible', lambda: True)
  model = traced_steps.built(
      traced_steps.private_model(model_name, privatizer, BATCH), model_name)
  spec = traced_steps.batch_spec(model_name, None)
  assert not ops_without_gpu_kernels(
      traced_steps.train_step_graph(model, spec))
  # XLA: the same step with a static batch (as XLA compiles it) lowers to HLO.
  x, y = [tf.zeros([BATCH, *s.shape[1:]], s.dtype) for s in spec]
  step = tf.function(model.train_step, jit_compile=True)
  assert 'HloModule' in step.experimental_get_compiler_ir((x, y))(stage='hlo')


def test_an_op_without_a_gpu_kernel_is_found():
  # The check can fail: string conversion and formatting have host kernels
  # only; a float32 matmul has a GPU kernel.
  @tf.function
  def host_only(x):
    return tf.strings.as_string(x), tf.strings.format('{}', x)

  graph = host_only.get_concrete_function(tf.TensorSpec([3])).graph
  found = {op for op, _ in ops_without_gpu_kernels(graph)}
  assert {'AsString', 'StringFormat'} <= found
  matmul = tf.function(tf.matmul).get_concrete_function(
      tf.TensorSpec([2, 2], tf.float32), tf.TensorSpec([2, 2], tf.float32))
  assert not ops_without_gpu_kernels(matmul.graph)


# HLO instructions XLA runs as loops: `while`, and Cholesky factorizations,
# which XLA expands into loops over columns (on a GPU a few kernel launches
# per column; the H200 profile in docs/performance.md).
LOOPS = re.compile(r'[\s)}](while|cholesky)\(')


@functools.lru_cache(maxsize=None)
def _loops(model_name: str, privatizer: str, gpu: bool) -> int:
  """Loops in the HLO of `model_name`'s XLA step with `privatizer`, traced
  as where TensorFlow sees a GPU (`gpu`) or not; each count traced once."""
  with mock.patch.object(GEP_MODULE, 'gpu_visible', lambda: gpu):
    model = traced_steps.built(
        traced_steps.private_model(model_name, privatizer, BATCH), model_name)
    x, y = [tf.zeros([BATCH, *s.shape[1:]], s.dtype)
            for s in traced_steps.batch_spec(model_name, None)]
    step = tf.function(model.train_step, jit_compile=True)
    return len(LOOPS.findall(
        step.experimental_get_compiler_ir((x, y))(stage='hlo')))


@pytest.mark.parametrize('model_name', ['cnn', 'mlp'])
def test_gep_on_a_gpu_runs_at_most_two_loops_more_than_dp_sgd(model_name):
  assert (_loops(model_name, 'gep', True) <=
          _loops(model_name, 'gaussian', True) + 2)


def test_the_loop_count_sees_gep_cholesky_factors():
  # GEP's CPU form on the tutorial CNN (explicit bases, Cholesky QR) has one
  # factor a pass: the count above can fail.
  assert _loops('cnn', 'gep', False) > _loops('cnn', 'gaussian', True) + 2
