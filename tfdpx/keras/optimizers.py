"""Keras 2 optimizers that privatize gradients with a tfdpx privatizer.

`tfdpx.keras.dp_optimizer.DPOptimizerMixin` over tensorflow-privacy's
vectorized DP Keras optimizers: the privatizer is a constructor argument, the
optimizer owns the variables holding the privatizer's state and its step
counter (so checkpoints restore them), and the noisy sum is divided by a
public denominator. A plain model compiled with one gets its per-record
gradients from the Jacobian of its loss vector (tensorflow-privacy's way).
"""

import inspect
import logging
from typing import Optional

import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized as tfp_vectorized

from tfdpx import clipping
from tfdpx import per_example
from tfdpx.keras import lazy_updates
from tfdpx.keras import validation
from tfdpx.keras.dp_optimizer import DPOptimizerMixin
from tfdpx.keras.dp_optimizer import secret_seed
from tfdpx.keras.noise_variance_correction import NoiseVarianceCorrection

_LOG = logging.getLogger(__name__)

JACOBIAN_WARNING = (
    'tfdpx: per-example gradients by tape.jacobian (the compile path) cost '
    'the square of the batch size: at batch 250 a step of the tensorflow-'
    'privacy tutorial CNN measured 350 times a non-private step. Train '
    'tfdpx.keras.make_private(model) instead: the same optimizer, per-layer '
    'per-example statistics in linear time (about 2 times a non-private step '
    'on that CNN at batch 256; see benchmarks/README.md).')

NO_MODEL_WARNING = (
    'tfdpx: this optimizer was not called from the train step of the Keras '
    'model it is compiled with (a custom training loop?), so tfdpx cannot '
    'check the model: layers that mix examples, stateful layers or layers '
    'writing variables from the data make the training not private. Call '
    'tfdpx.keras.check_private_compatible(model, inputs, compile_path=True) '
    'on a batch of inputs before training.')



def _secret_variable(name: str, initial: tf.Tensor) -> tf.Variable:
  """A variable that no checkpoint, saved model or weight list holds.

  For the noise key and secret privatizer state (`core.secret_leaves`): a
  plain variable, not an optimizer weight, so that no checkpoint tracks it.
  In TF1 graph mode (`get_updates`: Estimator, Keras without eager
  execution) it is a local variable, which savers leave out, initialized by
  Keras's session too.
  """
  aggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA
  if tf.executing_eagerly():
    return tf.Variable(initial, trainable=False, name=name,
                       aggregation=aggregation)
  variable = tf.compat.v1.Variable(
      initial, trainable=False, name=name, use_resource=True,
      aggregation=aggregation,
      collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])
  keras_backend.track_variable(variable)  # Keras's session initializes it.
  return variable


def _key_variable(name: str, value: Optional[int]) -> tf.Variable:
  """A variable of the noise key that no checkpoint or graph holds.

  `value` None draws a secret from the operating system; in TF1 graph mode
  by its initializer when a session runs it, not written into the graph as
  a constant (Estimator saves the graph).

  Args:
    name: the variable's name.
    value: its initial value, or None for a fresh secret.
  """
  if tf.executing_eagerly():
    initial = secret_seed() if value is None else value
    return _secret_variable(name, tf.constant(initial, tf.int64))
  if value is None:
    initial = tf.reshape(tf.numpy_function(
        lambda: np.int64(secret_seed()), [], tf.int64, stateful=True), [])
  else:
    initial = tf.constant(value, tf.int64)
  return _secret_variable(name, initial)


def _check_connected(grads, var_list):
  """Refuses gradients that are None (variables the loss does not reach)."""
  unconnected = [v.name for g, v in zip(grads, var_list) if g is None]
  if unconnected:
    raise ValueError(
        'None values not supported: the loss does not depend on the '
        f'trainable variables {unconnected}, so their per-example gradients '
        'are None (unconnected_gradients_to_zero=False, as in tensorflow-'
        'privacy). Pass unconnected_gradients_to_zero=True to give them zero '
        'gradients, or make them non-trainable.')


class _Keras2DPOptimizer(DPOptimizerMixin):
  """The Keras 2 (OptimizerV2) side: weights, the Jacobian compile path."""

  def _init_base(self, privatizer, num_microbatches,
                 unconnected_gradients_to_zero, args, kwargs):
    config = privatizer.config
    super(DPOptimizerMixin, self).__init__(  # tensorflow-privacy's
        float(config.get('l2_norm_clip', float('nan'))),
        float(config.get('noise_multiplier', float('nan'))),
        num_microbatches, unconnected_gradients_to_zero, *args, **kwargs)
    self._warned_jacobian = False
    self._warned_no_model = False
    self._eagerly_checked = None  # id() of the model checked in eager mode.

  def _new_key_variable(self, name, value):
    return _key_variable(name, value)

  def _new_secret_variable(self, name, value):
    return _secret_variable(name, value)

  def _read_int(self, variable) -> int:
    with tf.init_scope():  # TF1 graph mode too.
      return int(tf.keras.backend.get_value(variable))

  def _before_release(self, var_list):
    self._create_weights(var_list)
    self._was_dp_gradients_called = True  # tensorflow-privacy's check.

  def _create_weights(self, var_list):
    with tf.init_scope():
      self._create_all_weights(var_list)

  @property
  def _examples_per_record_seen(self) -> tf.Variable:
    """The variable behind `examples_per_record` (with `num_microbatches`).

    Created on first use, so that a checkpoint restores it even before the
    first step; it joins `weights` (the order `.h5` files keep) only with
    the other DP weights, in `_create_dp_weights`.
    """
    if self._examples_per_record is None:
      with tf.init_scope():
        self._examples_per_record = self.add_weight(
            'dp_examples_per_record', shape=[], dtype=tf.int64,
            trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    return self._examples_per_record

  @property
  def dp_steps(self) -> tf.Variable:
    """Number of privatized steps so far (a variable; checkpoints restore it)."""
    if self._dp_steps is None:
      with tf.init_scope():
        self._dp_steps = self.add_weight(
            'dp_steps', shape=[], dtype=tf.int64, trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._weights.append(self._dp_steps)
    return self._dp_steps

  def _create_all_weights(self, var_list):
    """Keras's weights, then the privatizer state and `dp_steps`.

    Keras calls this before setting saved optimizer weights (`.h5`), so the
    DP weights are created in the same order as in training and restored
    with the others.
    """
    super()._create_all_weights(var_list)
    self._create_dp_weights(var_list)

  def _create_dp_weights(self, var_list):
    if self._dp_state_vars is not None:
      return
    def weight(name, value):
      variable = self.add_weight(
          name, shape=value.shape, dtype=value.dtype, trainable=False,
          initializer=lambda shape, dtype=None: value,
          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._weights.append(variable)
      return variable

    with tf.init_scope():
      self._dp_state_vars = self._create_state_variables(
          self._privatizer.init(var_list), weight)
    _ = self.dp_steps
    if self._num_microbatches is not None:
      self._weights.append(self._examples_per_record_seen)
    if self.denominator is None:
      with tf.init_scope():
        self._first_batch_size = self.add_weight(
            'dp_first_batch_size', shape=[], dtype=tf.int64, trainable=False,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
      self._weights.append(self._first_batch_size)


  def _calling_model(self) -> Optional[tf.keras.Model]:
    """The Keras model whose train step is calling this optimizer, or None.

    Keras's `Model.train_step` hands the optimizer only the loss, the
    variables and the tape; the model is the one among the callers' local
    variables (`self` of `train_step`) that is compiled with this optimizer.
    """
    frame = inspect.currentframe()
    try:
      while frame is not None:
        for value in frame.f_locals.values():
          if isinstance(value, tf.keras.Model):
            optimizer = getattr(value, 'optimizer', None)
            if (optimizer is self or
                getattr(optimizer, 'inner_optimizer', None) is self):
              return value
        frame = frame.f_back
      return None
    finally:
      del frame

  def _check_model(self):
    """Runs the model validation of every DP path on the compile path."""
    model = self._calling_model()
    if model is None:
      if not self._warned_no_model:
        self._warned_no_model = True
        _LOG.warning(NO_MODEL_WARNING)
      return
    if tf.executing_eagerly() and self._eagerly_checked == id(model):
      return  # Eager steps: once per model. Traced steps: at every trace.
    spec = model.save_spec()  # Set by the forward pass of this step.
    validation.check_private_compatible(
        model, spec[0][0] if spec and spec[0] else None, compile_path=True)
    self._eagerly_checked = id(model) if tf.executing_eagerly() else None

  def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
    """Per-record gradients by the Jacobian, then `privatize`.

    Raises:
      ValueError: if the calling Keras model fails
        `tfdpx.keras.check_private_compatible(model, compile_path=True)`, or
        for a variable the loss does not depend on, unless
        `unconnected_gradients_to_zero`.
    """
    del grad_loss  # A per-example loss has no upstream gradient.
    self._check_model()
    if not callable(loss) and tape is None:
      raise ValueError('`tape` is required when a `Tensor` loss is passed.')
    tape = tape if tape is not None else tf.GradientTape()
    with tape:
      if callable(loss):
        if not callable(var_list):
          tape.watch(var_list)
        loss = loss()
      if callable(var_list):
        var_list = var_list()
      records = per_example.record_losses(loss, self._num_microbatches)
    var_list = tf.nest.flatten(var_list)
    if not self._warned_jacobian:
      self._warned_jacobian = True
      _LOG.warning(JACOBIAN_WARNING)
    with tf.name_scope(self._name + '/gradients'):
      grads = tape.jacobian(records, var_list,
                            unconnected_gradients=self._unconnected_gradients)
      _check_connected(grads, var_list)
      final = self._privatized_records(grads, var_list, loss)
    return list(zip(final, var_list))

  def get_gradients(self, loss, params):
    """Privatized gradients in TF1 graph mode (`get_updates`, Estimator).

    tensorflow-privacy's graph-mode path: the per-record gradients of the
    loss vector, through `privatize`, as `_compute_gradients` does.

    Args:
      loss: the per-example loss, `[B, ...]` (not reduced over the batch).
      params: the variables.

    Returns:
      One privatized gradient per variable.

    Raises:
      ValueError: for a loss reduced over the batch, or a variable the loss
        does not depend on unless `unconnected_gradients_to_zero`.
    """
    self._check_model()
    params = tf.nest.flatten(params)
    records = per_example.record_losses(loss, self._num_microbatches)
    with tf.name_scope(self._name + '/gradients'):
      _check_connected(tf.gradients(tf.reduce_sum(records), params,
                                    unconnected_gradients=(
                                        self._unconnected_gradients)),
                       params)
      grads = tf.vectorized_map(
          lambda record: tf.gradients(
              record, params,
              unconnected_gradients=tf.UnconnectedGradients.ZERO), records)
      return self._privatized_records(grads, params, loss)

  @property
  def _unconnected_gradients(self) -> tf.UnconnectedGradients:
    if self._unconnected_gradients_to_zero:
      return tf.UnconnectedGradients.ZERO
    return tf.UnconnectedGradients.NONE

  def _privatized_records(self, grads, var_list, loss):
    """`privatize` of the per-record gradients of the per-example `loss`."""
    grads, _ = clipping.drop_nonfinite(grads)  # Before any privatizer.
    return self.privatize(grads, var_list, num_examples=tf.shape(loss)[0])


  def restore_state_from(self, restored, var_list) -> None:
    """Takes the step counts and privatizer state of a `restored` optimizer.

    Keras 2 loads a SavedModel's optimizer as a `RestoredOptimizer` that
    holds the saved variables and cannot train; a model made private hands
    it here when it is compiled with a fresh DP optimizer.

    Args:
      restored: the trackable with the saved variables (by name: `iter`,
        `dp_steps`, `dp_state_<i>`, ...).
      var_list: the model's trainable variables.
    """
    self._create_all_weights(var_list)
    saved = restored._trackable_children()  # pylint: disable=protected-access
    for variable in self.weights:
      name = variable.name.split('/')[-1].split(':')[0]
      if name in saved:
        variable.assign(saved[name])


@tf.keras.utils.register_keras_serializable(package='tfdpx')
class DPSGD(_Keras2DPOptimizer, tfp_vectorized.VectorizedDPKerasSGDOptimizer):
  """SGD on privatized gradients. See `DPOptimizerMixin` for the DP arguments."""


@tf.keras.utils.register_keras_serializable(package='tfdpx')
class DPAdam(_Keras2DPOptimizer, tfp_vectorized.VectorizedDPKerasAdamOptimizer):
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
        self, noise_variance_correction, self._hyper['beta_2'])

  def get_config(self):
    config = super().get_config()
    config['noise_variance_correction'] = (
        self._noise_correction and self._noise_correction.correction)
    return config

  def _resource_apply_dense(self, grad, var, apply_state=None):
    if self._noise_correction is None:
      return super()._resource_apply_dense(grad, var, apply_state)
    coefficients = (apply_state or {}).get(
        (var.device, var.dtype.base_dtype)) or self._fallback_apply_state(
            var.device, var.dtype.base_dtype)
    beta_1, beta_2 = coefficients['beta_1_t'], coefficients['beta_2_t']
    m = self.get_slot(var, 'm').assign(
        beta_1 * self.get_slot(var, 'm') + (1 - beta_1) * grad)
    v = self.get_slot(var, 'v').assign(
        beta_2 * self.get_slot(var, 'v') + (1 - beta_2) * tf.square(grad))
    denominator = self._noise_correction.denominator(
        v / (1 - coefficients['beta_2_power']), self.iterations)
    return var.assign_sub(
        coefficients['lr_t'] * m / (1 - coefficients['beta_1_power']) /
        (denominator + coefficients['epsilon']))

  def _resource_apply_sparse(self, grad, var, indices, apply_state=None):
    coefficients = (apply_state or {}).get(
        (var.device, var.dtype.base_dtype)) or self._fallback_apply_state(
            var.device, var.dtype.base_dtype)
    v_hat = self.get_slot(var, 'vhat') if self.amsgrad else None

    def assign(variable, rows):
      return variable.scatter_update(rows)

    def assign_sub(variable, rows):
      return variable.scatter_sub(rows)

    return tf.group(*lazy_updates.adam_rows(
        tf.IndexedSlices(grad, indices),
        (var, self.get_slot(var, 'm'), self.get_slot(var, 'v'), v_hat),
        coefficients['lr'], coefficients['beta_1_t'],
        coefficients['beta_2_t'], coefficients['epsilon'], assign,
        assign_sub))


@tf.keras.utils.register_keras_serializable(package='tfdpx')
class DPAdagrad(_Keras2DPOptimizer,
                tfp_vectorized.VectorizedDPKerasAdagradOptimizer):
  """Adagrad on privatized gradients. See `DPOptimizerMixin` for the DP arguments."""

