"""Per-example gradient engines.

The compile-path engine (`jacobian`) is the one tensorflow-privacy's
vectorized optimizers use: the Jacobian of the per-example (or
per-microbatch) loss vector with respect to every trainable variable. It is
correct for any Keras model; its cost grows with the square of the batch.
"""

from typing import List, Optional, Sequence

import tensorflow as tf

SCALAR_LOSS_HELP = (
    'tfdpx optimizers need one loss per example, but the loss is a scalar. '
    'Compile with an unreduced loss, e.g. '
    'loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, '
    'reduction=tf.keras.losses.Reduction.NONE).')


def record_losses(losses: tf.Tensor,
                  num_microbatches: Optional[int] = None) -> tf.Tensor:
  """The loss of each record: each example, or the mean of each microbatch.

  Args:
    losses: per-example losses, shape `[B, ...]` (extra axes are averaged).
    num_microbatches: split the batch into this many equal microbatches;
      `None` means one record per example.

  Returns:
    A `[num_records]` tensor.

  Raises:
    ValueError: if `losses` is a scalar (the loss was reduced over the batch).
  """
  losses = tf.convert_to_tensor(losses)
  if losses.shape.rank == 0:
    raise ValueError(SCALAR_LOSS_HELP)
  records = num_microbatches if num_microbatches else tf.shape(losses)[0]
  return tf.reduce_mean(tf.reshape(losses, [records, -1]), axis=1)


def jacobian(tape: tf.GradientTape, record_loss: tf.Tensor,
             var_list: Sequence[tf.Variable]) -> List[tf.Tensor]:
  """Per-record gradients `[num_records, *var.shape]` for each variable.

  Variables the loss does not depend on get zero gradients.
  """
  return tape.jacobian(
      record_loss, list(var_list),
      unconnected_gradients=tf.UnconnectedGradients.ZERO)
