"""Keras models whose training step computes per-example gradients fast.

`make_private(model)` returns a model sharing `model`'s layers and weights
whose `train_step` computes per-example statistics with the linear-time engine
(`tfdpx.keras.recorder.model_gradients`: per-layer forms, vectorized fallback)
instead of the optimizer's `tape.jacobian`, then hands them to the optimizer's
`privatize`, the same call the compile path makes. `DPModel` and
`DPSequential` are the classes behind it, for subclassing; built with
tensorflow-privacy's DP model arguments (`l2_norm_clip`, `noise_multiplier`,
...) they train with a plain Keras optimizer, as tensorflow-privacy's do
(docs/migration.md). See docs/per_example.md.
"""

import math
import numbers
from typing import Any, Optional, Tuple

import numpy as np
import tensorflow as tf

from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx import per_example
from tfdpx import virtual_batches
from tfdpx.keras import recorder
from tfdpx.keras import report
from tfdpx.keras import validation
from tfdpx.keras.stack import keras_version
from tfdpx.keras.stack import optimizers
from tfdpx.privatizers.gaussian import Gaussian

DEFAULT_CHUNK_SIZE = 128

# The loss scale of models with float16 layers (`loss_scale=None`): a fixed,
# public constant (a dynamic scale would follow the private batch's
# overflows). Per-example gradients up to 64 (65504 / 1024) do not overflow.
FLOAT16_LOSS_SCALE = 1024.0

# The hyperparameters the tfdpx version of each plain optimizer takes over.
_HYPERPARAMETERS = {
    'SGD': ('learning_rate', 'momentum', 'nesterov'),
    'Adam': ('learning_rate', 'beta_1', 'beta_2', 'epsilon', 'amsgrad'),
    'Adagrad': ('learning_rate', 'initial_accumulator_value', 'epsilon'),
}


def _refuse_positional_dp_arguments(cls, args):
  """Refuses tensorflow-privacy's DP arguments given by position."""
  if args and isinstance(args[0], numbers.Number):
    raise ValueError(
        f'{cls.__name__}({", ".join(map(repr, args))}, ...): tensorflow-'
        "privacy's DP arguments are keyword-only in tfdpx, e.g. "
        f'{cls.__name__}(l2_norm_clip=1.0, noise_multiplier=1.1, ...); the '
        "positional arguments are Keras's")


class _PrivateTraining(keras_version.ModelHooks):
  """The engine settings and training step shared by the model classes."""

  def _set_dp_arguments(self, l2_norm_clip, noise_multiplier, num_microbatches,
                        expected_batch_size, use_xla, layer_registry):
    """Keeps tensorflow-privacy's DP model arguments (see `DPModel`)."""
    del layer_registry  # tfdpx chooses its per-layer rules itself.
    if isinstance(num_microbatches, bool):
      raise ValueError('num_microbatches: a boolean value was supplied; did '
                       'you intend it for use_xla?')
    if (l2_norm_clip is None) != (noise_multiplier is None):
      raise ValueError('pass both l2_norm_clip and noise_multiplier, or '
                       'neither (and a tfdpx optimizer at compile)')
    if l2_norm_clip is None and (num_microbatches is not None or
                                 expected_batch_size is not None):
      raise ValueError(
          'num_microbatches and expected_batch_size go with l2_norm_clip and '
          'noise_multiplier; with a tfdpx optimizer, pass them to it')
    if l2_norm_clip is not None:
      # Refuses bad values now, as the optimizer built at compile would.
      optimizers.DPSGD(l2_norm_clip, noise_multiplier, num_microbatches,
                       expected_batch_size=expected_batch_size)
    self._l2_norm_clip = l2_norm_clip
    self._noise_multiplier = noise_multiplier
    self._num_microbatches = num_microbatches
    self._expected_batch_size = expected_batch_size
    self._use_xla = bool(use_xla)

  def _dp_optimizer(self, optimizer):
    """The tfdpx optimizer that trains with this model's DP arguments.

    Raises:
      ValueError: for an optimizer other than SGD, Adam and Adagrad (or their
        tfdpx versions with the same DP arguments), or with weight decay or
        an exponential moving average.
    """
    arguments = dict(privatizer=Gaussian(self._l2_norm_clip,
                                         self._noise_multiplier),
                     num_microbatches=self._num_microbatches,
                     expected_batch_size=self._expected_batch_size)
    optimizer = tf.keras.optimizers.get(optimizer)
    if isinstance(optimizer, optimizers.DPOptimizerMixin):
      # As a model saved with its converted optimizer is compiled on loading.
      config = optimizer.get_config()
      if (optimizer.privatizer != arguments['privatizer'] or
          config['num_microbatches'] != self._num_microbatches or
          config['expected_batch_size'] != self._expected_batch_size):
        raise ValueError(
            f'{type(self).__name__} has the DP arguments {arguments}, and '
            f'its tfdpx optimizer {type(optimizer).__name__} others; pass '
            'them to one of the two')
      return optimizer
    for bases, kind in keras_version.PLAIN_OPTIMIZERS:
      if isinstance(optimizer, bases):
        break
    else:
      raise ValueError(
          f'{type(self).__name__} with l2_norm_clip and noise_multiplier '
          'trains with a DP version of SGD, Adam or Adagrad, got '
          f'{type(optimizer).__name__}; or build the model without them and '
          'compile with a tfdpx optimizer')
    config = optimizer.get_config()
    for name in ('weight_decay', 'use_ema'):
      if config.get(name):
        raise ValueError(
            f'{type(optimizer).__name__}({name}={config[name]!r}) has no DP '
            'version in tfdpx: leave it out')
    hyperparameters = {k: config[k] for k in _HYPERPARAMETERS[kind]}
    if isinstance(hyperparameters['learning_rate'], dict):
      hyperparameters['learning_rate'] = (
          tf.keras.optimizers.schedules.deserialize(
              hyperparameters['learning_rate']))
    for name in ('decay', 'clipnorm', 'clipvalue', 'global_clipnorm'):
      if config.get(name):  # The DP optimizer refuses clipping by name.
        hyperparameters[name] = config[name]
    return getattr(optimizers, 'DP' + kind)(name=config['name'], **arguments,
                                            **hyperparameters)

  def _set_engine(self, chunk_size, public_data, public_chunk_size,
                  use_layer_rules, fast_clipping, release_training_metrics,
                  physical_batch_size, examples_per_user, loss_scale):
    if int(chunk_size) != chunk_size or chunk_size < 1:
      raise ValueError(
          f'chunk_size must be a positive integer, got {chunk_size!r}')
    if public_data is not None:
      if not isinstance(public_data, (tuple, list)) or len(public_data) != 2:
        raise ValueError('public_data must be a pair (x_public, y_public)')
      if (public_chunk_size is not None and
          (int(public_chunk_size) != public_chunk_size or
           public_chunk_size < 1)):
        raise ValueError(f'public_chunk_size must be a positive integer, got '
                         f'{public_chunk_size!r}')
      public_data = tf.nest.map_structure(np.asarray, tuple(public_data))
    elif public_chunk_size is not None:
      raise ValueError('public_chunk_size needs public_data')
    self._dp_chunk_size = int(chunk_size)
    self._dp_public_data = public_data
    self._dp_public_chunk_size = int(public_chunk_size or chunk_size)
    self._dp_use_layer_rules = bool(use_layer_rules)
    self._dp_fast_clipping = bool(fast_clipping)
    self._dp_release_training_metrics = bool(release_training_metrics)
    self._dp_physical_batch_size = (
        None if physical_batch_size is None else
        core.check_positive_int('physical_batch_size', physical_batch_size))
    if examples_per_user is not None:
      examples_per_user = core.check_positive_int('examples_per_user',
                                                  examples_per_user)
      if (self._dp_physical_batch_size is not None and
          self._dp_physical_batch_size % examples_per_user):
        raise ValueError(
            f'physical_batch_size={self._dp_physical_batch_size} must be a '
            f'multiple of examples_per_user={examples_per_user}: a user\'s '
            'examples must lie in one physical batch')
    self._dp_examples_per_user = examples_per_user
    self._dp_loss_scale = (None if loss_scale is None else
                           core.check_positive('loss_scale', loss_scale))
    self._dp_checked_eagerly = False

  @property
  def public_data(self) -> Optional[Tuple[Any, Any]]:
    return self._dp_public_data

  def set_public_data(self, public_data,
                      public_chunk_size: Optional[int] = None) -> None:
    """Sets the public data each step passes on (see `DPModel`).

    Public data is not part of the model's config or saved files: a loaded
    model whose privatizer needs public gradients (GEP) gets them back here.
    """
    self._set_engine(self._dp_chunk_size, public_data, public_chunk_size,
                     self._dp_use_layer_rules, self._dp_fast_clipping,
                     self._dp_release_training_metrics,
                     self._dp_physical_batch_size, self._dp_examples_per_user,
                     self._dp_loss_scale)
    self.train_function = None  # Traced without them.

  def make_train_function(self, force=False):
    # The optimizer's variables, created before Keras traces the step: one
    # created in the first trace makes tf.function trace it a second time.
    # Only where Keras is about to trace (it returns its cached function
    # otherwise, e.g. at every `train_on_batch`).
    if ((force or self.train_function is None) and self.built and
        isinstance(self.optimizer, optimizers.DPOptimizerMixin)):
      self.optimizer.create_variables(self.trainable_variables)
    return super().make_train_function(force)

  def train_step(self, data):
    """One DP step: per-example gradients, `privatize`, apply."""
    x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
    optimizer = self.optimizer
    if not isinstance(optimizer, optimizers.DPOptimizerMixin):
      raise ValueError(
          'a model made private trains with a tfdpx optimizer '
          f'(tfdpx.keras.DPSGD, DPAdam, DPAdagrad), got '
          f'{type(optimizer).__name__}; or build it with l2_norm_clip and '
          'noise_multiplier')
    if not self.built:  # Creates the variables without running the model.
      self.build(tf.nest.map_structure(lambda t: t.shape, x))
    # Before the forward pass, which in eager mode would already write. The
    # trace (once per traced step; eager steps: once) finds layers writing
    # variables from the data; the layer checks are cheap and always run.
    trace = not (tf.executing_eagerly() and self._dp_checked_eagerly)
    validation.check_private_compatible(self, x if trace else None)
    self._dp_checked_eagerly = tf.executing_eagerly()
    var_list = self.trainable_variables
    if self._dp_examples_per_user is not None:
      optimizer.use_user_records()
    public_grads = self._public_gradients(var_list)
    if self._dp_physical_batch_size is None:
      result = self._gradients(x, y, sample_weight, var_list)
      grads = optimizer.privatize(
          self._private_records(result.grads, optimizer), var_list,
          public_grads=public_grads, num_examples=result.grads.batch_size())
      dropped_records = result.grads.dropped_records
    else:
      grads, result, dropped_records = self._virtual_step(
          optimizer, x, y, sample_weight, var_list, public_grads)
    if result.regularization_grads is not None:
      # model.losses are data-independent (model_gradients checks): their
      # gradient is added after the noise, outside the clipped sum.
      # A regularized table's selected rows (tf.IndexedSlices) then take a
      # dense update.
      grads = [g if r is None else tf.convert_to_tensor(g) + r
               for g, r in zip(grads, result.regularization_grads)]
    optimizer.apply_gradients(zip(grads, var_list))
    if not self._dp_release_training_metrics:
      # Nothing computed from the private batch but what the privatizer
      # released (an adapted clip norm).
      return {**keras_version.logs_without_training_metrics(self, y,
                                                            result.outputs),
              **optimizer.privatizer_logs()}
    logs = {**keras_version.training_logs(self, x, y, sample_weight, result),
            **optimizer.privatizer_logs()}
    # Examples of this (global) batch whose gradient was not finite and was
    # left out: a training metric, not covered by epsilon.
    logs['dropped_records'] = noise.replica_sum([dropped_records()])[0]
    return logs

  def _gradients(self, x, y, sample_weight, var_list
                ) -> per_example.GradientResult:
    """The engine's pass over one (physical) batch.

    A batch of unknown static size plans its forms for the optimizer's
    expected batch size (physical batches are static).
    """
    expected = self.optimizer.expected_batch_size
    if expected is not None and self._dp_examples_per_user is not None:
      expected *= self._dp_examples_per_user  # A slot of rows per user.
    return recorder.model_gradients(
        self, x,
        lambda outputs: keras_version.per_example_loss(self, y, outputs,
                                                       sample_weight),
        var_list, self._dp_chunk_size, self._dp_use_layer_rules,
        self._loss_scale(),
        None if expected is None else int(math.ceil(expected)),
        self._report_paths)

  def _report_paths(self, paths, random):
    """Logs, once, which layers of this model take the fallback."""
    if not getattr(self, '_dp_reported', False):
      self._dp_reported = True
      report.warn_fallback(report.report_of(self, paths, random))

  def _loss_scale(self) -> float:
    """The fixed loss scale: `loss_scale`, or by default
    `FLOAT16_LOSS_SCALE` for a model with float16 layers and 1 otherwise."""
    if self._dp_loss_scale is not None:
      return self._dp_loss_scale
    return FLOAT16_LOSS_SCALE if validation.computes_in_float16(self) else 1.0

  def _records(self, grads):
    """The engine's lazy value, or with `fast_clipping=False` every
    per-example gradient formed (for comparisons)."""
    if self._dp_fast_clipping:
      return grads
    return gradients.MaterializedGradients(grads.materialized())

  def _private_records(self, grads, optimizer):
    """What the privatizer gets: each example's gradient, each microbatch's
    mean or each user's sum."""
    records = self._records(grads)
    if self._dp_examples_per_user is not None:
      return per_example.user_records(records, self._dp_examples_per_user)
    return per_example.microbatched(records, optimizer._num_microbatches)  # pylint: disable=protected-access

  def _public_gradients(self, var_list):
    """The public data's per-example gradients, deferred: the privatizer
    builds their passes where it needs them (GEP: on steps that refresh its
    basis only)."""
    if self._dp_public_data is None:
      return None
    x_public, y_public = self._dp_public_data

    def build():
      return self._records(recorder.public_gradients(
          self, x_public, y_public,
          lambda y_true, outputs: keras_version.per_example_loss(
              self, y_true, outputs),
          var_list, self._dp_public_chunk_size, self._dp_use_layer_rules,
          self._loss_scale()))

    return gradients.Deferred(build)

  def _virtual_step(self, optimizer, x, y, sample_weight, var_list,
                    public_grads):
    """The privatized gradient of a logical batch, physical batch by batch.

    Returns:
      `(grads, result, dropped_records)`: the optimizer's gradient, a
      `GradientResult` of the logical batch for the logs (outputs and losses
      of its rows, the data-independent regularization) and a function giving
      the number of examples dropped for a non-finite gradient.
    """
    rows = tf.shape(tf.nest.flatten(x)[0])[0]
    batch = (x, y, virtual_batches.sample_weights(sample_weight, rows))
    chunks, num_chunks = virtual_batches.split(batch,
                                               self._dp_physical_batch_size)
    first = []  # The first physical batch's result: its regularization.

    def chunk(i):
      xi, yi, wi = tf.nest.map_structure(lambda t: t[i], chunks)
      result = self._gradients(xi, yi, wi, var_list)
      if not first:
        first.append(result)
      return self._private_records(result.grads, optimizer), lambda: {
          'outputs': result.outputs, 'losses': result.losses,
          'dropped_records': result.grads.dropped_records()}

    grads, extras = optimizer.privatize_chunks(
        num_chunks, chunk, var_list, public_grads=public_grads,
        num_examples=rows)

    def rows_of(stacked):  # [k, p, ...] -> the batch's [n, ...]
      return tf.reshape(stacked, tf.concat([[-1], tf.shape(stacked)[2:]],
                                           0))[:rows]

    result = first[0]._replace(
        grads=None, outputs=tf.nest.map_structure(rows_of, extras['outputs']),
        losses=rows_of(extras['losses']))
    return grads, result, lambda: tf.reduce_sum(extras['dropped_records'])

  def get_config(self):
    config = {**super().get_config(), 'chunk_size': self._dp_chunk_size,
              'use_layer_rules': self._dp_use_layer_rules,
              'fast_clipping': self._dp_fast_clipping,
              'release_training_metrics': self._dp_release_training_metrics,
              'physical_batch_size': self._dp_physical_batch_size,
              'examples_per_user': self._dp_examples_per_user,
              'loss_scale': self._dp_loss_scale}
    if self._l2_norm_clip is not None:
      config.update(l2_norm_clip=self._l2_norm_clip,
                    noise_multiplier=self._noise_multiplier,
                    num_microbatches=self._num_microbatches,
                    expected_batch_size=self._expected_batch_size,
                    use_xla=self._use_xla)
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    engine = {k: config.pop(k)
              for k in ('chunk_size', 'use_layer_rules', 'fast_clipping',
                        'release_training_metrics', 'physical_batch_size',
                        'examples_per_user', 'loss_scale')
              if k in config}
    dp_arguments = {k: config.pop(k, None)
                    for k in ('l2_norm_clip', 'noise_multiplier',
                              'num_microbatches', 'expected_batch_size')}
    use_xla = config.pop('use_xla', False)
    model = super().from_config(config, custom_objects)
    # pylint: disable=protected-access
    model._set_engine(
        engine.get('chunk_size', DEFAULT_CHUNK_SIZE), None, None,
        engine.get('use_layer_rules', True), engine.get('fast_clipping', True),
        engine.get('release_training_metrics', True),
        engine.get('physical_batch_size'), engine.get('examples_per_user'),
        engine.get('loss_scale'))
    model._set_dp_arguments(use_xla=use_xla, layer_registry=None,
                            **dp_arguments)
    # pylint: enable=protected-access
    return model

  def compile(self, *args, **kwargs):  # pylint: disable=arguments-differ
    """As Keras's; with DP arguments, the optimizer becomes its tfdpx version.

    A model built with `l2_norm_clip` and `noise_multiplier` (tensorflow-
    privacy's DP model arguments) is compiled, as tensorflow-privacy's, with
    a plain SGD, Adam or Adagrad (instance, class name or config) and trains
    with `tfdpx.keras.DPSGD`, `DPAdam` or `DPAdagrad` built from the model's
    DP arguments and the optimizer's hyperparameters: `model.optimizer` is
    that tfdpx optimizer, the one to hand `tfdpx.accounting` and that
    `PrivacyCallback` reads. `use_xla` is the default of `jit_compile`
    (unless `run_eagerly`).

    Raises:
      ValueError: for an optimizer that has no tfdpx version (see
        `_dp_optimizer`).
    """
    restored = getattr(self, 'optimizer', None)
    if self._l2_norm_clip is not None:
      args = list(args)
      if args:
        args[0] = self._dp_optimizer(args[0])
      else:
        kwargs['optimizer'] = self._dp_optimizer(
            kwargs.get('optimizer', 'rmsprop'))
      if not kwargs.get('run_eagerly'):  # Keras refuses both.
        kwargs.setdefault('jit_compile', self._use_xla)
    super().compile(*args, **kwargs)
    # Under mixed_float16 Keras wraps the optimizer in a LossScaleOptimizer,
    # whose dynamic scale would follow the private batch's overflows and
    # which would unscale gradients it never scaled: the engine scales the
    # loss by its own fixed `loss_scale` instead.
    inner = getattr(self.optimizer, 'inner_optimizer', None)
    if isinstance(inner, optimizers.DPOptimizerMixin):
      self.optimizer = inner
    self._restore_optimizer_state(restored)


@tf.keras.utils.register_keras_serializable(package='tfdpx')
class DPModel(_PrivateTraining, tf.keras.Model):
  """A Keras Model whose `train_step` computes per-example gradients fast.

  Use it like `tf.keras.Model`: functional (`DPModel(inputs, outputs)`, which
  gives a `DPFunctional`) or subclassed (override `call`). Compile it with a
  tfdpx optimizer and an unreduced loss. Layers get their per-layer rules in
  functional and subclassed models alike: a subclassed model whose weights
  are in the layers it calls is opened (docs/models.md).
  """

  def __new__(cls, *args, **kwargs):
    # Keras would turn DPModel itself into a Functional subclass for good
    # (inject_functional_model_class); build the functional class instead.
    if cls is DPModel and keras_version.is_functional_init(args, kwargs):
      return super().__new__(DPFunctional, *args, **kwargs)
    return super().__new__(cls, *args, **kwargs)

  def __init__(self, *args, l2_norm_clip: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               num_microbatches: Optional[int] = None,
               expected_batch_size: Optional[float] = None,
               use_xla: bool = True, layer_registry=None,
               chunk_size: int = DEFAULT_CHUNK_SIZE,
               public_data=None, public_chunk_size: Optional[int] = None,
               use_layer_rules: bool = True, fast_clipping: bool = True,
               release_training_metrics: bool = True,
               physical_batch_size: Optional[int] = None,
               examples_per_user: Optional[int] = None,
               loss_scale: Optional[float] = None, **kwargs):
    """Args:
      *args: as `tf.keras.Model`.
      l2_norm_clip: tensorflow-privacy's DP model arguments, keyword-only:
        with `noise_multiplier`, the model trains DP-SGD itself and is
        compiled with a plain SGD, Adam or Adagrad (see `compile`), as
        tensorflow-privacy's `DPModel`; without them (the default), it is
        compiled with a tfdpx optimizer, which holds the privatizer.
      noise_multiplier: see `l2_norm_clip`.
      num_microbatches: with `l2_norm_clip`: as the tfdpx optimizer's.
      expected_batch_size: with `l2_norm_clip`: as the tfdpx optimizer's (the
        public denominator; required for Poisson sampling).
      use_xla: with `l2_norm_clip`: the default of `compile`'s `jit_compile`,
        as in tensorflow-privacy.
      layer_registry: accepted for tensorflow-privacy's signature and not
        used: tfdpx picks its per-layer rules itself (`fast_clipping`).
      chunk_size: examples per `tf.vectorized_map` call of the fallback (and
        per chunk where per-example gradients are formed); bounds memory for
        large batches.
      public_data: optional `(x_public, y_public)`; each step then also runs
        the engine over all public examples and passes its per-example
        gradients (the lazy value, asked for dots and weighted sums) to
        `privatize` as `public_grads`, for privatizers that need them (GEP).
        Public data is never clipped or noised and costs no privacy.
      public_chunk_size: the `chunk_size` of the public pass (default
        `chunk_size`).
      use_layer_rules: False sends every layer to the vectorized fallback (for
        comparisons; slower).
      fast_clipping: True (the default) hands the privatizer per-example
        statistics computed layer by layer (norms, dots, weighted sums by
        ghost forms, segment sums or chunks; `docs/per_example.md`) without
        forming per-example gradients where a cheaper exact form exists.
        False forms every per-example gradient first (for comparisons); the
        release is the same up to float rounding.
      release_training_metrics: False makes `train_step` return nothing
        computed from the private batch (no loss, no compiled metrics), so
        `fit`'s logs, progress bar and History hold only what callbacks add
        (e.g. `tfdpx.keras.PrivacyCallback`'s epsilon). True (Keras's
        behaviour) logs the loss and metrics of each private training batch,
        and `dropped_records` (how many of its examples had a non-finite
        gradient and were left out), which the reported epsilon does not
        cover.
      physical_batch_size: virtual batches: each batch `fit` gives (the
        logical batch: one Poisson draw, or one shuffled batch) is processed
        this many rows at a time (the last physical batch padded with rows of
        sample weight 0), its clipped sums added up, and released once: one
        noise draw and one privacy event per logical batch, with the memory
        of one physical batch. None (the default): the whole batch at once.
        See docs/virtual_batches.md.
      examples_per_user: user-level privacy: each batch is made of user
        slots of this many consecutive rows
        (`tfdpx.sampling.poisson_user_batches`), and each slot's gradients
        are summed into one record, clipped and noised as one: adjacency is
        one user with all of their examples. The optimizer needs a public
        denominator (`expected_batch_size`: the expected number of users per
        batch). See docs/user_level.md.
      loss_scale: a fixed, public factor the per-example losses are
        multiplied by for the backward pass (and every per-example gradient
        divided by in float32 before any statistic), so that small gradients
        of float16 layers do not underflow. Default: `FLOAT16_LOSS_SCALE`
        (1024) if a layer computes in float16 (`mixed_float16`), else 1.
        Keras's dynamic `LossScaleOptimizer` is not used: its scale would
        follow the private batch's overflows. See docs/mixed_precision.md.
      **kwargs: as `tf.keras.Model`.

    Raises:
      ValueError: naming the argument that is invalid.
    """
    _refuse_positional_dp_arguments(type(self), args)
    super().__init__(*args, **kwargs)
    self._set_engine(chunk_size, public_data, public_chunk_size,
                     use_layer_rules, fast_clipping, release_training_metrics,
                     physical_batch_size, examples_per_user, loss_scale)
    self._set_dp_arguments(l2_norm_clip, noise_multiplier, num_microbatches,
                           expected_batch_size, use_xla, layer_registry)


@tf.keras.utils.register_keras_serializable(package='tfdpx')
class DPFunctional(keras_version.FunctionalConstructor, DPModel,
                   keras_version.Functional):
  """A functional `DPModel`: `DPModel(inputs, outputs)` builds one.

  Its constructor is Keras's functional one, `(inputs, outputs, name, ...)`
  with `DPModel`'s engine arguments by keyword, so that Keras saves and
  revives the layer graph (`.keras`, `.h5`, SavedModel).
  """


@tf.keras.utils.register_keras_serializable(package='tfdpx')
class DPSequential(_PrivateTraining, tf.keras.Sequential):
  """A Sequential model whose `train_step` computes per-example gradients fast."""

  def __init__(self, *args, l2_norm_clip: Optional[float] = None,
               noise_multiplier: Optional[float] = None,
               num_microbatches: Optional[int] = None,
               expected_batch_size: Optional[float] = None,
               use_xla: bool = True, layer_registry=None,
               chunk_size: int = DEFAULT_CHUNK_SIZE, public_data=None,
               public_chunk_size: Optional[int] = None,
               use_layer_rules: bool = True, fast_clipping: bool = True,
               release_training_metrics: bool = True,
               physical_batch_size: Optional[int] = None,
               examples_per_user: Optional[int] = None,
               loss_scale: Optional[float] = None, **kwargs):
    """Args:
      *args: as `tf.keras.Sequential` (`layers`, `name`).
      l2_norm_clip, noise_multiplier, num_microbatches, expected_batch_size,
        use_xla, layer_registry: tensorflow-privacy's DP model arguments, as
        in `DPModel`.
      chunk_size, public_data, public_chunk_size, use_layer_rules,
        fast_clipping, release_training_metrics, physical_batch_size,
        examples_per_user, loss_scale: as `DPModel`.
      **kwargs: as `tf.keras.Sequential`.

    Raises:
      ValueError: naming the argument that is invalid.
    """
    _refuse_positional_dp_arguments(type(self), args)
    super().__init__(*args, **kwargs)
    self._set_engine(chunk_size, public_data, public_chunk_size,
                     use_layer_rules, fast_clipping, release_training_metrics,
                     physical_batch_size, examples_per_user, loss_scale)
    self._set_dp_arguments(l2_norm_clip, noise_multiplier, num_microbatches,
                           expected_batch_size, use_xla, layer_registry)



# The legacy .h5 format names a model's class by its bare `__name__`, not by
# the registered 'tfdpx>' name.
tf.keras.utils.get_custom_objects().update(
    {cls.__name__: cls for cls in (DPModel, DPFunctional, DPSequential)})

class _Wrapped(DPModel):
  """A subclassed model made private: opened as a composite layer is."""

  def __init__(self, model, **engine):
    super().__init__(name=model.name + '_private', **engine)
    self.wrapped = model

  def call(self, inputs, training=None):
    return self.wrapped(inputs, training=training)


def make_private(model: tf.keras.Model, *,
                 chunk_size: int = DEFAULT_CHUNK_SIZE,
                 public_data=None, public_chunk_size: Optional[int] = None,
                 use_layer_rules: bool = True,
                 fast_clipping: bool = True,
                 release_training_metrics: bool = True,
                 physical_batch_size: Optional[int] = None,
                 examples_per_user: Optional[int] = None,
                 loss_scale: Optional[float] = None) -> tf.keras.Model:
  """A model sharing `model`'s layers and weights, trained with fast DP steps.

  Compile the returned model with a tfdpx optimizer (`tfdpx.keras.DPSGD`, ...)
  and an unreduced loss, exactly as for the compile path, and call `fit`: each
  step runs one batched forward and backward pass and hands the optimizer's
  `privatize` the per-example gradients as statistics on demand, answered per
  layer (ghost norms and weighted sums for Dense and convolutions, segment
  sums over the tokens present for Embedding, small per-example gradients
  for LayerNormalization and GroupNormalization, a chunked
  `tf.vectorized_map` fallback for any other layer). `evaluate` and
  `predict` are Keras's own.

  Args:
    model: a Sequential, functional or subclassed Keras model. Each layer
      call gets its layer's rule; subclassed layers and models whose trainable
      weights belong to the layers they call are opened; any other layer call
      with trainable weights is a fallback unit. `tfdpx.keras.describe(model)`
      lists each layer's path; one warning line names the fallback layers.
    chunk_size, public_data, public_chunk_size, use_layer_rules,
      fast_clipping, release_training_metrics, physical_batch_size,
      examples_per_user, loss_scale: see `DPModel`.

  Returns:
    A `DPModel` or `DPSequential`.

  Raises:
    ValueError: for a layer that mixes the examples of a batch, a stateful
      layer, an activity regularizer or a layer that writes a variable from
      the data (`tfdpx.keras.check_private_compatible`; layers not built yet
      are checked at the first step), or a bad argument.

  Privacy:
    Each example's gradient is computed from that example alone as long as no
    layer mixes the examples of a batch (a trainable BatchNormalization and
    normalizations over the batch axis are refused; a custom layer that mixes
    examples is not detected). No layer may carry data from one step to the
    next or into the saved model: stateful layers and layers that write a
    variable from the data are refused. The gradient of
    `model.losses` (weight regularizers) is data-independent and added after
    the noise, outside the clipped sum; a loss added with `add_loss` that
    depends on the data is refused at the first step. Public data never
    enters the private sum.

    Epsilon bounds what the noisy updates release (the weights, the
    optimizer's state), not what Keras logs: by default `fit` reports the loss
    and metrics of every private training batch (progress bar, History,
    callbacks such as TensorBoard), functions of the batch that are neither
    clipped nor noised. With
    `release_training_metrics=False` the training step returns none of them;
    measure accuracy with `evaluate` on held-out data that is not part of the
    private training set.
  """
  functional = keras_version.is_graph_network(model)
  inputs = keras_version.graph_endpoints(model)[0] if functional else None
  validation.check_private_compatible(model, inputs)
  engine = dict(chunk_size=chunk_size, public_data=public_data,
                public_chunk_size=public_chunk_size,
                use_layer_rules=use_layer_rules, fast_clipping=fast_clipping,
                release_training_metrics=release_training_metrics,
                physical_batch_size=physical_batch_size,
                examples_per_user=examples_per_user, loss_scale=loss_scale)
  if isinstance(model, tf.keras.Sequential) and not model.built:
    return DPSequential(model.layers, name=model.name + '_private', **engine)
  if functional:
    return DPModel(*keras_version.graph_endpoints(model),
                   name=model.name + '_private', **engine)
  return _Wrapped(model, **engine)
