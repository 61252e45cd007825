"""Which Keras tfdpx runs on: Keras 2 (TensorFlow 2.15) or Keras 3.

The public API is the same on both. The modules that differ are chosen here
once: `keras_version` (`tfdpx.keras.keras2` or `keras3`) and `optimizers`
(`tfdpx.keras.optimizers`, over tensorflow-privacy, or `optimizers_keras3`).
The flag itself is `tfdpx.keras.version.KERAS_3`.
"""

from tfdpx.keras.version import KERAS_3

# pylint: disable=g-import-not-at-top,unused-import
if KERAS_3:
  from tfdpx.keras import keras3 as keras_version
  from tfdpx.keras import optimizers_keras3 as optimizers
else:
  from tfdpx.keras import keras2 as keras_version
  from tfdpx.keras import optimizers
