"""Keras 3 optimizers that privatize gradients with a tfdpx privatizer.

`tfdpx.keras.dp_optimizer.DPOptimizerMixin` over Keras 3's SGD, Adam and
Adagrad. Keras 3 optimizers never see a loss, let alone per-example losses:
the gradients reach `apply` already averaged over the batch. So a model made
private (`tfdpx.keras.make_private`) privatizes in its train step, through
`privatize`, and `apply` refuses gradients that did not come out of
`privatize` (a plain model compiled with a tfdpx optimizer), at the first
step, instead of training without privacy.
"""

import threading

import keras
import tensorflow as tf
from keras.src.utils import tracking

from tfdpx.keras import keras3
from tfdpx.keras import lazy_updates
from tfdpx.keras.dp_optimizer import DPOptimizerMixin
from tfdpx.keras.dp_optimizer import secret_seed
from tfdpx.keras.noise_variance_correction import NoiseVarianceCorrection

NOT_PRIVATIZED = (
    'tfdpx: {name} was asked to apply gradients it did not privatize. Keras 3 '
    'optimizers never see per-example losses, so a plain Keras model '
    'compiled with a tfdpx optimizer would train without privacy. Train '
    'tfdpx.keras.make_private(model) (or a tfdpx.keras.DPModel or '
    'DPSequential) compiled with this optimizer: its train step hands the '
    "per-example gradients to the optimizer's privatize.")

_ONLY_FIRST_REPLICA = 'only_first_replica'


class _Keras3DPOptimizer(DPOptimizerMixin):
  """The Keras 3 side: variables made in `build`, `apply` guarded."""

  def _init_base(self, privatizer, num_microbatches,
                 unconnected_gradients_to_zero, args, kwargs):
    del privatizer, num_microbatches, unconnected_gradients_to_zero
    if kwargs.get('loss_scale_factor') is not None:
      raise ValueError(
          'loss_scale_factor is not supported by tfdpx optimizers: the '
          'privatized gradient is not a gradient of the scaled loss, so '
          'dividing it by the scale would shrink the update and its noise.')
    super(DPOptimizerMixin, self).__init__(*args, **kwargs)
    # Set by `privatize` and taken by `apply`, in the same (traced) step;
    # per thread, as tf.distribute traces its replicas in threads.
    self._released = threading.local()

  def _new_key_variable(self, name, value):
    initial = secret_seed() if value is None else value
    return self._new_secret_variable(name, tf.constant(initial, tf.int64))

  def _new_secret_variable(self, name, initial):
    with tf.init_scope():
      return tf.Variable(initial, trainable=False, name=name,
                         aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

  def _before_release(self, var_list):
    if tf.distribute.get_strategy().num_replicas_in_sync > 1:
      raise NotImplementedError(
          'tfdpx on Keras 3 does not support tf.distribute with several '
          'replicas yet (how Keras 3 reduces the replicas\' gradients and '
          'where it creates the noise key are not verified); train on one '
          'device, or on the Keras 2 stack (docs/keras3.md)')
    self._create_weights(var_list)
    self._released.pending = True

  def _create_weights(self, var_list):
    if not self.built:
      with tf.init_scope():
        self.build(var_list)

  @tracking.no_automatic_dependency_tracking
  def build(self, variables):
    """Keras's variables, then the privatizer state and the step counts.

    Always in this order and all at once, so that a saved optimizer's
    variables (`.keras`, matched by position) load into the same ones.
    """
    super().build(variables)
    self._dp_state_vars = self._create_state_variables(
        self._privatizer.init(keras3.tf_variables(variables)),
        self._dp_variable)
    self._dp_steps = self._dp_variable('dp_steps', 0)
    if self._num_microbatches is not None:
      self._examples_per_record = self._dp_variable(
          'dp_examples_per_record', 0)
    if self.denominator is None:
      self._first_batch_size = self._dp_variable('dp_first_batch_size', 0)

  def _dp_variable(self, name, value):
    value = tf.convert_to_tensor(
        value, tf.int64 if isinstance(value, int) else None)
    return self.add_variable(
        value.shape, initializer=lambda shape, dtype=None: value,
        dtype=value.dtype.name, aggregation=_ONLY_FIRST_REPLICA, name=name)

  @property
  def dp_steps(self):
    """Number of privatized steps so far (a variable once built; 0 before)."""
    if self._dp_steps is None:
      return tf.constant(0, tf.int64)
    return self._dp_steps

  @property
  def _examples_per_record_seen(self):
    if self._examples_per_record is None:
      return tf.constant(0, tf.int64)
    return self._examples_per_record

  def apply(self, grads, trainable_variables=None):
    """Keras's `apply`, for gradients that `privatize` returned only.

    Raises:
      ValueError: for gradients of a step that did not call `privatize`.
    """
    if not getattr(self._released, 'pending', False):
      raise ValueError(NOT_PRIVATIZED.format(name=type(self).__name__))
    self._released.pending = False
    return super().apply(grads, trainable_variables)


def _value(variable):
  """The tf.Variable of a Keras variable (a tf.Variable as it is)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


@keras.saving.register_keras_serializable(package='tfdpx')
class DPSGD(_Keras3DPOptimizer, keras.optimizers.SGD):
  """SGD on privatized gradients. See `DPOptimizerMixin` for the DP arguments.

  With momentum, a table's selected rows (`tf.IndexedSlices`,
  `sparse_embeddings`) take lazy updates: `tfdpx.keras.lazy_updates`.
  """

  def update_step(self, gradient, variable, learning_rate):
    if not isinstance(gradient, tf.IndexedSlices) or self.momentum == 0:
      return super().update_step(gradient, variable, learning_rate)
    velocity = self.momentums[self._get_variable_index(variable)]
    dtype = variable.dtype
    lazy_updates.momentum_rows(
        gradient, _value(variable), _value(velocity),
        tf.cast(learning_rate, dtype), tf.cast(self.momentum, dtype),
        self.nesterov, self.assign, self.assign_sub)


@keras.saving.register_keras_serializable(package='tfdpx')
class DPAdam(_Keras3DPOptimizer, keras.optimizers.Adam):
  """Adam on privatized gradients. See `DPOptimizerMixin` for the DP arguments.

  Keyword-only `noise_variance_correction=f` takes the noise's variance
  out of the second moment (DP-AdamBC):
  `tfdpx.keras.noise_variance_correction`.
  A table's selected rows (`tf.IndexedSlices`, `sparse_embeddings`) take
  lazy updates: `tfdpx.keras.lazy_updates`.
  """

  def __init__(self, *args, noise_variance_correction=None, **kwargs):
    super().__init__(*args, **kwargs)
    self._noise_correction = NoiseVarianceCorrection.of(
        self, noise_variance_correction, self.beta_2)

  def get_config(self):
    config = super().get_config()
    config['noise_variance_correction'] = (
        self._noise_correction and self._noise_correction.correction)
    return config

  def update_step(self, gradient, variable, learning_rate):
    if self._noise_correction is not None:
      return self._corrected_step(gradient, variable, learning_rate)
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable, learning_rate)
    dtype = variable.dtype
    step = tf.cast(self.iterations + 1, dtype)
    beta_1 = tf.cast(self.beta_1, dtype)
    beta_2 = tf.cast(self.beta_2, dtype)
    alpha = (tf.cast(learning_rate, dtype) * tf.sqrt(1 - beta_2**step) /
             (1 - beta_1**step))
    index = self._get_variable_index(variable)
    v_hat = _value(self._velocity_hats[index]) if self.amsgrad else None
    lazy_updates.adam_rows(
        gradient, (_value(variable), _value(self._momentums[index]),
                   _value(self._velocities[index]), v_hat),
        alpha, beta_1, beta_2, tf.cast(self.epsilon, dtype), self.assign,
        self.assign_sub)

  def _corrected_step(self, gradient, variable, learning_rate):
    dtype = variable.dtype
    gradient = tf.cast(gradient, dtype)
    step = tf.cast(self.iterations + 1, dtype)
    beta_1 = tf.cast(self.beta_1, dtype)
    beta_2 = tf.cast(self.beta_2, dtype)
    index = self._get_variable_index(variable)
    m, v = self._momentums[index], self._velocities[index]
    self.assign(m, beta_1 * _value(m) + (1 - beta_1) * gradient)
    self.assign(v, beta_2 * _value(v) + (1 - beta_2) * tf.square(gradient))
    denominator = self._noise_correction.denominator(
        _value(v) / (1 - beta_2**step), self.iterations)
    self.assign_sub(variable, tf.cast(learning_rate, dtype) * _value(m) /
                    (1 - beta_1**step) / (denominator + self.epsilon))


@keras.saving.register_keras_serializable(package='tfdpx')
class DPAdagrad(_Keras3DPOptimizer, keras.optimizers.Adagrad):
  """Adagrad on privatized gradients. See `DPOptimizerMixin` for the DP arguments."""
