"""Canaries: records an auditor plants in the training data, and their scores.

A canary kind builds the model that is trained (`model`), its loss (`loss`),
the training records with the included canaries appended (`records`), public
data in the same layout (`public`) and, after training, one score per canary
(`scores`: higher means "more likely included").
"""

import abc
from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

CANARY_LAYER = 'canaries'


class Canaries(abc.ABC):
  """`num_canaries` canaries of one kind."""

  def __init__(self, num_canaries: int):
    if int(num_canaries) != num_canaries or num_canaries < 1:
      raise ValueError(f'num_canaries must be an integer >= 1, got '
                       f'{num_canaries!r}')
    self.num_canaries = int(num_canaries)

  @abc.abstractmethod
  def model(self, model: tf.keras.Model) -> tf.keras.Model:
    """The model to train around `model` (which outputs logits)."""

  @abc.abstractmethod
  def loss(self) -> tf.keras.losses.Loss:
    """The unreduced loss to compile the trained model with."""

  @abc.abstractmethod
  def records(self, x, y, included: np.ndarray) -> Tuple[Any, np.ndarray]:
    """`(x, y)`: the examples, then the canaries `included` marks."""

  @abc.abstractmethod
  def public(self, x, y) -> Tuple[Any, np.ndarray]:
    """Public examples `(x, y)` in the trained model's input layout."""

  @abc.abstractmethod
  def scores(self, trained: tf.keras.Model, model: tf.keras.Model
            ) -> np.ndarray:
    """One score per canary, from the trained model (and `model` in it)."""

  def trace(self) -> Optional['StepTrace']:
    """A callback recording what every step released on the canaries, for
    a new run; None where the attacker sees the final model only."""
    return None


class StepTrace(tf.keras.callbacks.Callback):
  """Each canary's coordinate before the first step and after every step
  (`GradientCanaries`): the releases an attacker who sees every step has."""

  def __init__(self):
    super().__init__()
    self._values = []

  def _record(self):
    table = self.model.get_layer(CANARY_LAYER).embeddings
    self._values.append(np.array(table, np.float64)[:, 0])

  def on_train_begin(self, logs=None):
    self._values = []
    self._record()

  def on_train_batch_end(self, batch, logs=None):
    self._record()

  def updates(self) -> np.ndarray:
    """`[steps, num_canaries]`: each step's change of each coordinate."""
    return np.diff(np.stack(self._values), axis=0)


class _CanaryLoss(tf.keras.losses.Loss):
  """Cross-entropy of the logits for examples (label >= 0); for a canary
  (label -1), `-gradient_norm` times the canary output, whose gradient is
  `-gradient_norm` on that canary's own coordinate and zero elsewhere."""

  def __init__(self, gradient_norm: float):
    super().__init__(reduction='none', name='canary_loss')
    self._gradient_norm = gradient_norm

  def call(self, y_true, y_pred):
    labels = tf.reshape(tf.cast(y_true, tf.int32), [-1])
    logits, value = y_pred[:, :-1], y_pred[:, -1]
    cross_entropy = tf.keras.losses.sparse_categorical_crossentropy(
        tf.maximum(labels, 0), logits, from_logits=True)
    return tf.where(labels < 0, -self._gradient_norm * value, cross_entropy)


class GradientCanaries(Canaries):
  """Dirac gradient canaries, the strongest white-box test.

  The trained model gets a second input, a canary index, and a private
  coordinate per canary: an `Embedding(num_canaries, 1)` table, zero at the
  start, whose output is appended to the logits. Canary j is a record whose
  gradient is `-gradient_norm * e_j` on that table (its features are zeros and
  its loss is linear in its coordinate), exactly zero on every other weight;
  an example's gradient is exactly zero on the table. Whatever the noise step
  does to a record of that norm is what the audit measures. The score is the
  final value of the canary's coordinate: with SGD, the sum of every step's
  release on it; `trace` records every step's (the attacker sees every
  release), for the scores of `tfdpx.audit.scores`.
  """

  def __init__(self, num_canaries: int, gradient_norm: float = 100.0):
    super().__init__(num_canaries)
    if not gradient_norm > 0:
      raise ValueError(f'gradient_norm must be > 0, got {gradient_norm!r}')
    self.gradient_norm = float(gradient_norm)

  def model(self, model):
    features = tf.keras.Input(model.input_shape[1:], name='features')
    index = tf.keras.Input((1,), dtype='int32', name='canary_index')
    table = tf.keras.layers.Embedding(
        self.num_canaries, 1, embeddings_initializer='zeros',
        name=CANARY_LAYER)
    value = tf.keras.layers.Flatten()(table(index))
    outputs = tf.keras.layers.Concatenate()([model(features), value])
    return tf.keras.Model([features, index], outputs)

  def loss(self):
    return _CanaryLoss(self.gradient_norm)

  def records(self, x, y, included):
    chosen = np.flatnonzero(included)
    x = np.asarray(x)
    features = np.concatenate(
        [x, np.zeros((len(chosen),) + x.shape[1:], x.dtype)])
    index = np.concatenate([np.zeros(len(x), np.int32),
                            chosen.astype(np.int32)])[:, None]
    labels = np.concatenate([np.asarray(y, np.int64),
                             -np.ones(len(chosen), np.int64)])
    return (features, index), labels

  def public(self, x, y):
    x = np.asarray(x)
    return (x, np.zeros((len(x), 1), np.int32)), np.asarray(y, np.int64)

  def scores(self, trained, model):
    del model
    table = trained.get_layer(CANARY_LAYER).embeddings
    return np.asarray(table)[:, 0].astype(np.float64)

  def trace(self):
    return StepTrace()


class InputCanaries(Canaries):
  """Input-space canaries: random inputs with random labels (black box).

  Each canary is an example of uniform random features in [0, 1] and a
  uniformly random label, drawn once from `seed`; the model and loss are the
  user's (cross-entropy of the logits). The score is minus the canary's loss
  under the final model: only the released model is used.
  """

  def __init__(self, num_canaries: int, input_shape, num_classes: int,
               seed: int = 0):
    super().__init__(num_canaries)
    rng = np.random.default_rng(seed)
    self.x = rng.random((self.num_canaries,) + tuple(input_shape),
                        np.float32)
    self.y = rng.integers(0, num_classes, self.num_canaries)

  def model(self, model):
    return model

  def loss(self):
    return tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction='none')

  def records(self, x, y, included):
    x = np.asarray(x)
    return (np.concatenate([x, self.x[included].astype(x.dtype)]),
            np.concatenate([np.asarray(y, np.int64), self.y[included]]))

  def public(self, x, y):
    return np.asarray(x), np.asarray(y, np.int64)

  def scores(self, trained, model):
    del trained
    logits = model.predict(self.x, verbose=0, batch_size=1024)
    return -tf.keras.losses.sparse_categorical_crossentropy(
        self.y, logits, from_logits=True).numpy().astype(np.float64)
