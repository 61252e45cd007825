"""Lazy updates of a table's selected rows, for both Keras versions.

`tfdpx.privatizers.sparse_embeddings` releases a table's gradient as a
`tf.IndexedSlices` of the rows it selected. Keras's Adam (and Keras 3's SGD
with momentum) would still decay every row's moments and move every row
along them: a write of the whole table each step. The DP optimizers update
the selected rows only (TensorFlow Addons' LazyAdam, tensorflow-privacy's
sparse Keras layers): a row's moments change when it is selected, and the
row moves only then. A row's update then differs from dense Adam's: its
moments skip the decay of the steps it was not selected in, and the bias
correction is the step's, as in LazyAdam. Each update reads and writes the
given rows only (the indices are distinct).
"""

import tensorflow as tf


def adam_rows(gradient: tf.IndexedSlices, rows, alpha, beta_1, beta_2,
              epsilon, assign, assign_sub):
  """The lazy Adam update of `gradient`'s rows.

  Args:
    gradient: the rows' gradients.
    rows: `(variable, m, v, v_hat)` as tf.Variables (`v_hat` None without
      AMSGrad).
    alpha: the step size with the bias correction,
      `lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)`.
    beta_1, beta_2, epsilon: Adam's hyperparameters.
    assign: `assign(variable, tf.IndexedSlices)` writes those rows.
    assign_sub: `assign_sub(variable, tf.IndexedSlices)` subtracts from them.

  Returns:
    The update ops.
  """
  variable, m, v, v_hat = rows
  indices = gradient.indices
  values = tf.cast(gradient.values, variable.dtype)
  m_rows = beta_1 * tf.gather(m, indices) + (1 - beta_1) * values
  v_rows = beta_2 * tf.gather(v, indices) + (1 - beta_2) * tf.square(values)
  updates = [assign(m, tf.IndexedSlices(m_rows, indices)),
             assign(v, tf.IndexedSlices(v_rows, indices))]
  if v_hat is not None:
    v_rows = tf.maximum(tf.gather(v_hat, indices), v_rows)
    updates.append(assign(v_hat, tf.IndexedSlices(v_rows, indices)))
  with tf.control_dependencies([u for u in updates if u is not None]):
    step = alpha * m_rows / (tf.sqrt(v_rows) + epsilon)
    updates.append(assign_sub(variable, tf.IndexedSlices(step, indices)))
  return updates


def momentum_rows(gradient: tf.IndexedSlices, variable, velocity,
                  learning_rate, momentum, nesterov, assign, assign_sub):
  """The lazy SGD-with-momentum update of `gradient`'s rows (Keras's form:
  `u = momentum * u - lr * g`, `w += u`, Nesterov `w += momentum * u - lr *
  g`); `assign` and `assign_sub` as in `adam_rows`."""
  indices = gradient.indices
  values = tf.cast(gradient.values, variable.dtype)
  velocity_rows = (momentum * tf.gather(velocity, indices) -
                   learning_rate * values)
  update = assign(velocity, tf.IndexedSlices(velocity_rows, indices))
  step = (momentum * velocity_rows - learning_rate * values if nesterov
          else velocity_rows)
  with tf.control_dependencies([update] if update is not None else []):
    return [update, assign_sub(variable, tf.IndexedSlices(-step, indices))]
