"""The DP training step of the utility benchmarks (`utility_*.py`).

Per-example gradients come from a plain `tf.vectorized_map` over examples, the
loop these runs were made with before `tfdpx.keras.make_private` existed; it
is kept so that their published numbers reproduce.
"""

import tensorflow as tf


def private_step(model, optimizer, loss_fn):
  """A `step(x, y)` on an MNIST-shaped batch: per-example gradients,
  `optimizer.privatize`, `optimizer.apply_gradients`.

  Args:
    model: the Keras model.
    optimizer: a tfdpx optimizer.
    loss_fn: `loss_fn(y, logits)` for one example's batch of one.
  """
  variables = model.trainable_variables

  def example_grads(example):
    x, y = example
    with tf.GradientTape() as tape:
      loss = loss_fn(y[None], model(x[None], training=True))
    return tape.gradient(loss, variables)

  @tf.function(input_signature=[
      tf.TensorSpec([None, 28, 28, 1], tf.float32),
      tf.TensorSpec([None], tf.int64)])
  def step(x, y):
    grads = tf.vectorized_map(example_grads, (x, y))
    update = optimizer.privatize(grads, variables)
    optimizer.apply_gradients(zip(update, variables))

  return step
