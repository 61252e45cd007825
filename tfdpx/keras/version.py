"""Which Keras tfdpx runs on; imports nothing of tfdpx, so anything may read it."""

import tensorflow as tf

# tf.keras is Keras 3 from TensorFlow 2.16 on; Keras 2 has no `version()`.
KERAS_3 = hasattr(tf.keras, 'version') and tf.keras.version().startswith('3')
