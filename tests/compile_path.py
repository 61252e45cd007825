"""The model a test compiles with a tfdpx optimizer, on either stack."""

import tfdpx
from tfdpx.keras.version import KERAS_3


def trainable(model):
  """`model` itself on Keras 2 (the compile path: per-record gradients from
  the Jacobian of its loss); made private on Keras 3, which has no compile
  path (its optimizers never see a loss)."""
  return tfdpx.keras.make_private(model) if KERAS_3 else model
