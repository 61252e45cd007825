"""Whether the ops being built are compiled by XLA."""

import tensorflow as tf
from tensorflow.python.ops import control_flow_util  # pylint: disable=g-direct-tensorflow-import


def in_xla() -> bool:
  """Whether the ops built now are compiled by XLA: static shapes only, no
  op whose output size depends on the data.

  TensorFlow's own test (`control_flow_util`, not public API; present in
  TensorFlow 2.15 and 2.21, where the XLA tests run).
  """
  return control_flow_util.GraphOrParentsInXlaContext(
      tf.compat.v1.get_default_graph())
