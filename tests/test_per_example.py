"""The engine: every statistic, rules and fallback, equals single-example tapes."""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import per_example
from tfdpx.forms import chunks
from tfdpx.forms import dense as dense_forms
from tfdpx.forms import embedding as embedding_forms
from tfdpx.keras import layer_rules
from tfdpx.keras import recorder
from tfdpx.keras.version import KERAS_3

L = tf.keras.layers
BATCH = 5


def _squared_error(targets, outputs):
  axes = list(range(1, outputs.shape.rank))
  return tf.reduce_sum(tf.square(outputs - targets), axis=axes)


def _floats(*shape):
  return lambda rng: rng.normal(size=(BATCH,) + shape).astype('float32')


def _ids(length, vocab):
  return lambda rng: rng.integers(0, vocab, size=(BATCH, length))


def _mixed():
  """A functional model mixing every ruled layer with a fallback (LSTM)."""
  ids = tf.keras.Input((6,), dtype='int32')
  signal = tf.keras.Input((6, 3))
  embedded = L.Embedding(7, 3)(ids)
  x = L.Concatenate()([embedded, signal])
  x = L.Conv1D(4, 3, padding='causal', dilation_rate=2, activation='relu')(x)
  x = L.LayerNormalization()(x)
  recurrent = L.LSTM(3, return_sequences=True)(x)
  image = L.Reshape((6, 4, 1))(x)
  image = L.Conv2D(4, 2, strides=(2, 1), padding='same')(image)
  image = L.GroupNormalization(2)(image)
  x = L.Concatenate()([L.Flatten()(image), L.Flatten()(recurrent)])
  outputs = L.Dense(2)(L.Dense(5, activation='tanh')(x))
  return tf.keras.Model([ids, signal], outputs)


def _shared():
  """A model calling one Dense layer twice: its per-example norms don't add."""
  inputs = tf.keras.Input((4,))
  shared = L.Dense(4, activation='tanh')
  return tf.keras.Model(inputs, L.Dense(2)(shared(shared(inputs))))


def _tied_before():
  """A Dense layer whose input is computed from its own kernel (a raw op)."""
  inputs = tf.keras.Input((4,))
  dense = L.Dense(4, activation='tanh')
  dense.build((None, 4))
  x = L.Lambda(lambda t: tf.matmul(t, dense.kernel, transpose_b=True))(inputs)
  return tf.keras.Model(inputs, L.Dense(2)(dense(x)))


class TiedOutput(L.Layer):
  """Multiplies by another layer's weight matrix, transposed."""

  def __init__(self, weight, **kwargs):
    super().__init__(**kwargs)
    self.weight = weight  # Not its own: trainable_weights stays empty.

  def call(self, inputs):
    return tf.matmul(inputs, self.weight(), transpose_b=True)


def _tied_embedding():
  """Tied input and output embeddings, the output through a custom layer."""
  ids = tf.keras.Input((6,), dtype='int32')
  embedding = L.Embedding(10, 4)
  x = L.Dense(4, activation='tanh')(embedding(ids))
  return tf.keras.Model(ids, TiedOutput(lambda: embedding.embeddings)(x))


class Scaled(L.Layer):
  """A layer with its own weight that also reads another layer's kernel."""

  def __init__(self, owner, **kwargs):
    super().__init__(**kwargs)
    self.owner = owner

  def build(self, input_shape):
    self.scale = self.add_weight(name='scale', shape=[input_shape[-1]],
                                 initializer='ones')

  def call(self, inputs):
    return tf.matmul(inputs * self.scale, self.owner.kernel, transpose_b=True)


def _tied_fallback():
  inputs = tf.keras.Input((4,))
  dense = L.Dense(3, activation='tanh')
  x = Scaled(dense)(dense(inputs))
  return tf.keras.Model(inputs, L.Dense(2)(x))


def _einsum_dense():
  """Attention-style projections, a transposed output, '...' and vectors."""
  inputs = tf.keras.Input((6, 7))
  heads = L.EinsumDense('abc,cde->abde', (6, 2, 3), bias_axes='de',
                        activation='tanh')(inputs)
  x = L.EinsumDense('abcd,cde->abe', (6, 4), bias_axes='e')(heads)
  x = L.EinsumDense('abc,cd->adb', (3, 6))(x)  # Output positions last.
  x = L.EinsumDense('...b,bc->...c', 2, bias_axes='c')(x)
  x = L.Flatten()(x)
  return tf.keras.Model(inputs, L.EinsumDense('ab,bc->ac', 2)(x))


def _attention(mask):
  """Self-attention over padded tokens, causal, or cross-attention."""
  ids = tf.keras.Input((6,), dtype='int32')
  # mask_zero: Keras passes the padding mask on to the attention.
  x = L.Embedding(5, 4, mask_zero=mask == 'padding')(ids)
  if mask == 'cross':
    context = L.Dense(4, activation='tanh')(x[:, :3])
    x = L.MultiHeadAttention(2, 3, dropout=0.0)(x, context)
  else:
    x = L.MultiHeadAttention(2, 3, value_dim=2, output_shape=5)(
        x, x, use_causal_mask=mask == 'causal')
  return tf.keras.Model(ids, L.Dense(2)(L.Flatten()(x)))


def _recurrent():
  """Every recurrent rule: masks, both directions, states, GRU's gates."""
  ids = tf.keras.Input((6,), dtype='int32')
  x = L.Embedding(5, 3, mask_zero=True)(ids)
  x = L.GRU(4, return_sequences=True, go_backwards=True)(x)
  x = L.SimpleRNN(3, return_sequences=True, activation='relu')(x)
  x, h, c = L.LSTM(3, return_state=True)(x)
  return tf.keras.Model(ids, L.Dense(2)(L.Concatenate()([x, h, c])))


def _padded_ids(rng):
  ids = rng.integers(1, 5, size=(BATCH, 6))
  ids[:, 4:] = 0  # The last two positions of every example are padding.
  ids[0, 2:] = 0
  return ids


MODELS = {
    'dense': (lambda: tf.keras.Sequential([
        tf.keras.Input((7,)), L.Dense(4, activation='tanh'), L.Dense(3)]),
              _floats(7)),
    'dense_on_sequences': (lambda: tf.keras.Sequential([
        tf.keras.Input((6, 7)), L.Dense(4, activation='relu'), L.Dense(3)]),
                           _floats(6, 7)),
    # Few steps (3^2 <= 7 * 8): fast clipping's Gram-matrix norms.
    'dense_on_short_sequences': (lambda: tf.keras.Sequential([
        tf.keras.Input((3, 7)), L.Dense(8), L.Dense(2)]), _floats(3, 7)),
    'conv1d': (lambda: tf.keras.Sequential([
        tf.keras.Input((9, 3)),
        L.Conv1D(4, 3, strides=2, padding='same', activation='relu'),
        L.Conv1D(2, 2, padding='causal', dilation_rate=2),
        L.Conv1D(2, 2, padding='valid', use_bias=False)]), _floats(9, 3)),
    # Strides > 1: TensorFlow's own depthwise kernel (no oneDNN, GPU) takes
    # a Conv1D's patches only with equal strides.
    'conv1d_strided': (lambda: tf.keras.Sequential([
        tf.keras.Input((11, 3)), L.Conv1D(4, 3, strides=2, padding='same'),
        L.Conv1D(2, 2, strides=3, padding='valid')]), _floats(11, 3)),
    # Few positions, many channels: the ghost (Gram) form of a convolution.
    'conv2d_ghost': (lambda: tf.keras.Sequential([
        tf.keras.Input((4, 4, 8)), L.Conv2D(16, 3), L.Flatten(),
        L.Dense(2)]), _floats(4, 4, 8)),
    'conv2d': (lambda: tf.keras.Sequential([
        tf.keras.Input((9, 8, 3)),
        L.Conv2D(4, 3, strides=(2, 1), padding='same', activation='relu'),
        L.Conv2D(3, 2, padding='valid', dilation_rate=2),
        L.Conv2D(2, (3, 2), strides=2, padding='valid')]), _floats(9, 8, 3)),
    'embedding': (lambda: tf.keras.Sequential([
        tf.keras.Input((6,), dtype='int32'), L.Embedding(10, 4),
        L.Flatten(), L.Dense(2)]), _ids(6, 10)),
    # Three ids over six positions: every example repeats tokens.
    'embedding_repeats': (lambda: tf.keras.Sequential([
        tf.keras.Input((6,), dtype='int32'), L.Embedding(3, 4),
        L.GlobalAveragePooling1D(), L.Dense(2)]), _ids(6, 3)),
    'lstm': (lambda: tf.keras.Sequential([
        tf.keras.Input((6,), dtype='int32'), L.Embedding(10, 4), L.LSTM(3),
        L.Dense(2)]), _ids(6, 10)),
    'layer_norm': (lambda: tf.keras.Sequential([
        tf.keras.Input((6, 7)), L.Dense(6), L.LayerNormalization(),
        L.LayerNormalization(axis=[1, 2]), L.Dense(2)]), _floats(6, 7)),
    'group_norm': (lambda: tf.keras.Sequential([
        tf.keras.Input((9, 8, 3)), L.Conv2D(4, 3), L.GroupNormalization(2),
        L.Flatten(), L.Dense(2)]), _floats(9, 8, 3)),
    'mixed': (_mixed, lambda rng: [_ids(6, 7)(rng), _floats(6, 3)(rng)]),
    # Variables read by several layer calls: each call adds its share.
    'shared': (_shared, _floats(4)),
    'tied_before': (_tied_before, _floats(4)),
    'tied_embedding': (_tied_embedding, _ids(6, 10)),
    'tied_fallback': (_tied_fallback, _floats(4)),
    'einsum_dense': (_einsum_dense, _floats(6, 7)),
    'attention_padding': (lambda: _attention('padding'), _padded_ids),
    'recurrent': (_recurrent, _padded_ids),
    'attention_causal': (lambda: _attention('causal'), _ids(6, 5)),
    'attention_cross': (lambda: _attention('cross'), _ids(6, 5)),
}


def _lora():
  """Keras 3's LoRA on a Dense layer and on an attention-style EinsumDense,
  frozen kernels, trainable biases; b is random (it starts at zero, where a's
  gradient is zero too)."""
  inputs = tf.keras.Input((6, 7))
  heads = L.EinsumDense('abc,cde->abde', (6, 2, 3), bias_axes='de',
                        activation='tanh')
  dense = L.Dense(4)
  x = dense(L.Flatten()(heads(inputs)))
  model = tf.keras.Model(inputs, L.Dense(2)(x))
  rng = np.random.default_rng(3)
  for layer, rank in ((heads, 2), (dense, 3)):
    layer.enable_lora(rank)
    layer.lora_kernel_b.assign(
        rng.normal(size=layer.lora_kernel_b.shape).astype('float32'))
  return model


if KERAS_3:
  MODELS['lora'] = (_lora, _floats(6, 7))


def _loop_reference(model, x, y):
  """Per-example gradients from a Python loop of single-example tapes."""
  rows = []
  for i in range(BATCH):
    xi = tf.nest.map_structure(lambda t: t[i:i + 1], x)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(_squared_error(y[i:i + 1], model(xi)))
    grads = tape.gradient(loss, model.trainable_variables,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    rows.append([tf.convert_to_tensor(g).numpy() for g in grads])
  return [np.stack(column) for column in zip(*rows)]


def _check_statistics(grads, expected, seed=0):
  """Asserts every statistic of `grads` (an `_InGraph`) against materialized
  `expected`."""
  checks = _statistic_checks(expected, np.random.default_rng(seed))
  results = grads.statistics([(name, args) for name, args, _ in checks])
  for (_, _, check), got in zip(checks, results):
    check(got)


def _statistic_checks(expected, rng):
  """`(statistic, args, check)` triples: `check` asserts the statistic's
  result, one tensor per variable, against materialized `expected`."""
  flat = [g.reshape(BATCH, -1) for g in expected]
  directions = [rng.normal(size=(3,) + g.shape[1:]).astype('float32')
                for g in expected]
  masks = [(rng.uniform(size=g.shape[1:]) < 0.5).astype('float32')
           for g in expected]
  weights = rng.normal(size=BATCH).astype('float32')
  columns = rng.normal(size=(BATCH, 2)).astype('float32')
  return [
      ('sq_norms', (), _each([np.sum(w**2, axis=1) for w in flat])),
      ('dots', (directions,),
       _each([w @ d.reshape(3, -1).T for w, d in zip(flat, directions)])),
      ('masked_sq_norms', (masks,),
       _each([np.sum((w * m.reshape(1, -1))**2, axis=1)
              for w, m in zip(flat, masks)])),
      ('weighted_sum', (tf.constant(weights),),
       _each([np.tensordot(weights, w, 1) for w in expected])),
      ('weighted_sums', (tf.constant(columns),),
       _each([np.tensordot(columns, w, [[0], [0]]) for w in expected])),
      *_row_statistic_checks(expected, rng),
      ('materialized', (), _each(expected)),
  ]


def _each(wants):
  """A check that a result holds one tensor close to each of `wants` (None:
  the result is None there)."""
  def check(got):
    assert len(got) == len(wants)
    for g, want in zip(got, wants):
      if want is None:
        assert g is None
      else:
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-4, atol=1e-5)
  return check


def _row_statistic_checks(expected, rng):
  """Dots and weighted sums on slices of the variables' first axes."""
  # The last slices of the first axis (all of it where it has one slice).
  rows = [None if g.ndim < 2 else (min(1, g.shape[1] - 1), g.shape[1])
          for g in expected]
  directions = [rng.normal(size=(3,) + (g.shape[1:] if r is None else
                                        (r[1] - r[0],) + g.shape[2:]))
                .astype('float32') for g, r in zip(expected, rows)]
  sliced = [g if r is None else g[:, r[0]:r[1]]
            for g, r in zip(expected, rows)]
  # Every other variable skipped.
  wanted = [None if i % 2 or r is None else r for i, r in enumerate(rows)]
  columns = rng.normal(size=(BATCH, 2)).astype('float32')
  return [
      ('dots', (directions, rows),
       _each([w.reshape(BATCH, -1) @ d.reshape(3, -1).T
              for w, d in zip(sliced, directions)])),
      ('weighted_sums', (tf.constant(columns), wanted),
       _each([None if r is None else np.tensordot(columns, w, [[0], [0]])
              for w, r in zip(sliced, wanted)])),
  ]


class _InGraph:
  """The engine's statistics of `model` on `x`, all in one `tf.function`:
  as in training, one traced forward and every statistic of it.

  With `unknown_batch`, traced with batch dimension None, as `fit` traces
  `tf.data ... .batch(B)`.
  """

  def __init__(self, model, x, loss, unknown_batch=False, **kwargs):
    self._args = model, x, loss, kwargs
    self._unknown_batch = unknown_batch

  def statistics(self, calls):
    """`[grads.<name>(*args) for name, args in calls]` of the engine's
    per-example gradients."""
    model, x, loss, kwargs = self._args

    def run(x):
      grads = recorder.model_gradients(
          model, x, loss, model.trainable_variables, **kwargs).grads
      return [getattr(grads, name)(*args) for name, args in calls]

    spec = None
    if self._unknown_batch:
      spec = [tf.nest.map_structure(
          lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), x)]
    return tf.function(run, input_signature=spec)(x)


def _slow_mixed(names, slow=('mixed',)):
  """`names` with the slow ones marked (`make test-all` runs them): the
  mixed model (every layer family in one model) takes 20-30 s a test, and
  each family is also checked alone; Conv1D and LSTM 11-16 s, and Conv2D
  and GRU go through the same forms."""
  return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n
          for n in names]


@pytest.mark.parametrize('use_rules', [True, False], ids=['rules', 'fallback'])
@pytest.mark.parametrize('name', _slow_mixed(sorted(MODELS),
                                             ('mixed', 'conv1d', 'lstm')))
def test_every_statistic_equals_a_loop_of_single_example_tapes(name,
                                                               use_rules):
  _check_against_the_loop(name, use_rules=use_rules)


def _problem(name):
  """Model `name` (seeded), a batch of its inputs, random targets, the rng."""
  tf.keras.utils.set_random_seed(1)
  build, make_x = MODELS[name]
  model = build()
  rng = np.random.default_rng(0)
  x = make_x(rng)
  y = rng.normal(size=model(x).shape).astype('float32')
  return model, x, y, rng


def _check_against_the_loop(name, unknown_batch=False, chunk_size=2,
                            **kwargs):
  """Every statistic of model `name`'s engine against single-example tapes."""
  model, x, _, _ = _problem(name)
  _check_against_the_loop_of(model, x, unknown_batch, chunk_size, **kwargs)


def _check_against_the_loop_of(model, x, unknown_batch=False, chunk_size=2,
                               **kwargs):
  """Every statistic of `model`'s engine on `x` against single-example tapes
  (random targets)."""
  y = np.random.default_rng(2).normal(size=model(x).shape).astype('float32')
  expected = _loop_reference(model, x, y)
  # Chunks of 2 examples by default: 3 chunks, the last one padded.
  grads = _InGraph(model, x, lambda outputs: _squared_error(y, outputs),
                   unknown_batch, chunk_size=chunk_size, **kwargs)
  _check_statistics(grads, expected)


# The LSTM in chunks (a loop over the cell's loop) takes 20 s to trace: slow;
# the LSTM in one chunk and the other layers in chunks stay in the default run.
@pytest.mark.parametrize('name,chunk_size', [
    pytest.param(name, size, id=f'{name}-{size_id}', marks=(
        [pytest.mark.slow] if (name, size) == ('lstm', 2) else []))
    for name in ['dense', 'dense_on_sequences', 'conv1d_strided', 'conv2d',
                 'embedding', 'layer_norm', 'lstm']
    for size, size_id in [(2, 'chunks'), (128, 'one_chunk')]])
def test_statistics_with_an_unknown_batch_size_equal_the_loop(name,
                                                              chunk_size):
  # `fit` traces `tf.data ... .batch(B)` and numpy input with batch
  # dimension None: the forms see fewer static shapes, not other values.
  _check_against_the_loop(name, unknown_batch=True, chunk_size=chunk_size)


def test_a_convolution_on_one_position_equals_the_loop():
  # One output position takes the forms on vectors, which read the patches
  # of the whole batch in the kernel's order (with oneDNN, the depthwise
  # extraction lays them out channel by channel).
  tf.keras.utils.set_random_seed(1)
  model = tf.keras.Sequential([tf.keras.Input((3, 3, 2)), L.Conv2D(3, 3),
                               L.Flatten(), L.Dense(2)])
  _check_against_the_loop_of(model, _floats(3, 3, 2)(
      np.random.default_rng(0)))


@pytest.mark.parametrize('name', sorted(MODELS))
def test_weighted_sums_keep_the_variables_static_shapes(name):
  # Privatizers read sizes from the released sums (D2P2's projection), and
  # the batch size is unknown when `fit` traces the step.
  model, x, y, _ = _problem(name)
  loss = lambda outputs: _squared_error(y[:1], outputs)

  @tf.function(input_signature=[tf.nest.map_structure(
      lambda t: tf.TensorSpec([None] + list(t.shape[1:]), t.dtype), x)])
  def sums(x):
    grads = recorder.model_gradients(
        model, x, loss, model.trainable_variables).grads
    got = grads.weighted_sum(tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]]))
    for g, v in zip(got, model.trainable_variables):
      assert g.shape == v.shape, (v.name, g.shape, v.shape)
    return got

  sums.get_concrete_function()


@pytest.mark.parametrize('name', ['dense', 'dense_on_sequences', 'conv2d',
                                  'embedding', 'tied_before'])
def test_weighted_sums_of_large_units_equal_the_loop(name, monkeypatch):
  # Layers above SMALL_UNIT_SIZE take their unit's own `weighted_sums` (one
  # matmul for Dense on vectors, else a pass per column), not a contraction
  # of their materialized gradients; these models' layers are all small.
  monkeypatch.setattr(per_example, 'SMALL_UNIT_SIZE', 0)
  _check_against_the_loop(name)


def _keep_no_kernel(monkeypatch):
  monkeypatch.setattr(dense_forms, 'CACHED_KERNEL_SIZE', 0)
  monkeypatch.setattr(dense_forms, 'CACHED_CONV_KERNEL_SIZE', 0)


def _chunk_sizes(monkeypatch, function):
  """The chunk sizes the forms call `chunks.<function>` with, from now on."""
  sizes = []
  original = getattr(chunks, function)

  def recording(fn, elems, chunk_size, signature):
    sizes.append(chunk_size)
    return original(fn, elems, chunk_size, signature)

  monkeypatch.setattr(dense_forms.chunks, function, recording)
  return sizes


@pytest.mark.parametrize('unknown_batch', [False, True])
@pytest.mark.parametrize('name', ['dense_on_sequences', 'conv2d',
                                  'einsum_dense'])
def test_weighted_sums_on_positions_contracted_in_chunks_equal_the_loop(
    name, unknown_batch, monkeypatch):
  # Several weighted sums of a kernel on positions, neither small nor
  # cached, are contracted from its per-example gradients formed chunk by
  # chunk (a few examples a chunk here), not one pass per column.
  monkeypatch.setattr(per_example, 'SMALL_UNIT_SIZE', 0)
  _keep_no_kernel(monkeypatch)
  monkeypatch.setattr(dense_forms, 'CHUNK_ENTRIES', 56)
  sizes = _chunk_sizes(monkeypatch, 'sum_rows')
  _check_against_the_loop(name, unknown_batch, chunk_size=128)
  assert sizes and min(sizes) < BATCH, sizes  # Several chunks.


@pytest.mark.parametrize('name', ['dense_on_sequences', 'conv2d',
                                  'einsum_dense'])
def test_statistics_in_chunks_of_a_memory_budget_equal_the_loop(
    name, monkeypatch):
  # A large kernel's statistics are reduced from its per-example gradients
  # in chunks of at most CHUNK_ENTRIES entries, however large chunk_size:
  # here every kernel is "large" and the budget is two examples of 28.
  _keep_no_kernel(monkeypatch)
  monkeypatch.setattr(dense_forms, 'CHUNK_ENTRIES', 56)
  sizes = _chunk_sizes(monkeypatch, 'map_rows')
  _check_against_the_loop(name, chunk_size=128)
  assert min(sizes) <= 4, sizes  # Not chunk_size: the budget.


def test_kept_convolution_kernels_are_formed_in_chunks_of_patches_in_budget(
    monkeypatch):
  # A convolution's input patches (T p entries an example) are extracted
  # at most CHUNK_ENTRIES at once, also where its kernels are formed once to
  # be kept (the CIFAR CNN's second convolution: 127 MiB of patches a chunk
  # of 128). conv2d's T p: 40 x 27, 18 x 16 and 3 x 18 entries, so a budget
  # of 600 takes 1, 2 and 11 examples a chunk, not chunk_size.
  monkeypatch.setattr(per_example, 'SMALL_UNIT_SIZE', 0)
  monkeypatch.setattr(dense_forms, 'CACHED_KERNEL_SIZE', 10**6)
  monkeypatch.setattr(dense_forms, 'CHUNK_ENTRIES', 600)
  sizes = _chunk_sizes(monkeypatch, 'map_rows')
  _check_against_the_loop('conv2d', unknown_batch=True, chunk_size=128)
  assert sorted(set(sizes)) == [1, 2, 11], sizes


def test_rules_cover_the_ruled_layers_and_skip_what_they_cannot_do():
  x2 = tf.zeros([2, 5, 5, 3])
  ruled = [L.Dense(2), L.Conv2D(2, 2), L.LayerNormalization(),
           L.GroupNormalization(1)]
  for layer in ruled:
    layer(x2)
    assert layer_rules.lookup(layer, x2) is not None, layer.name
  grouped = L.Conv2D(3, 2, groups=3)
  transposed = L.Conv2DTranspose(2, 2)  # A Conv2D subclass: no rule.
  for layer in (grouped, transposed):
    layer.build(x2.shape)
    assert layer_rules.lookup(layer, x2) is None, layer.name


def _recorded(model, x):
  """The layers of the rule calls and of the fallback calls of one pass."""
  with tf.GradientTape(persistent=True) as tape:
    record = recorder.Recorder(tape, True, model.trainable_variables)
    record.run(model, tf.convert_to_tensor(x))
  return ([call.layer for call in record.rule_calls],
          [call.layer for call in record.fallback_calls])


@pytest.mark.parametrize('mask', ['padding', 'causal', 'cross'])
def test_attention_is_recorded_as_its_four_projections(mask):
  model, x, _, _ = _problem(f'attention_{mask}')
  attention = next(layer for layer in model.layers
                   if isinstance(layer, L.MultiHeadAttention))
  ruled, fallback = _recorded(model, x)
  assert not fallback
  projections = [layer for layer in ruled
                 if isinstance(layer, L.EinsumDense)]
  assert len(projections) == 4
  assert {id(p) for p in projections} == {
      id(layer) for layer in attention._flatten_layers(include_self=False)  # pylint: disable=protected-access
      if layer.trainable_weights}
  # The projections' `call` is the class's again after the pass.
  assert all('call' not in vars(p) for p in projections)


def test_frozen_layers_and_projections_are_not_recorded():
  model, x, _, _ = _problem('attention_causal')
  attention = next(layer for layer in model.layers
                   if isinstance(layer, L.MultiHeadAttention))
  next(layer for layer in model.layers
       if isinstance(layer, L.Embedding)).trainable = False
  for name in ('_key_dense', '_output_dense'):
    getattr(attention, name).trainable = False
  ruled, fallback = _recorded(model, x)
  assert not fallback
  assert [layer.name for layer in ruled] == [
      attention._query_dense.name, attention._value_dense.name,  # pylint: disable=protected-access
      model.layers[-1].name]
  _check_against_the_loop_of(model, x)


def test_einsum_dense_equations_outside_the_form_take_the_fallback():
  x = tf.zeros([2, 5, 3])
  supported = L.EinsumDense('abc,cd->abd', (5, 4), bias_axes='d')
  summed = L.EinsumDense('abc,cd->ad', 4)  # Positions summed away.
  shared = L.EinsumDense('abc,bcd->abd', (5, 4))  # Per-position kernels.
  kernel_free_first = L.EinsumDense('abc,dc->abd', (5, 4))
  bias_on_positions = L.EinsumDense('abc,cd->abd', (5, 4), bias_axes='b')
  unsupported = (summed, shared, kernel_free_first, bias_on_positions)
  for layer in (supported,) + unsupported:
    layer(x)
  assert layer_rules.lookup(supported, x) is not None
  for layer in unsupported:
    assert layer_rules.lookup(layer, x) is None, layer.equation


def test_a_registered_rule_is_used_for_a_custom_layer():

  class Scale(L.Layer):

    def build(self, input_shape):
      self.scale = self.add_weight(name='scale', shape=[input_shape[-1]])

    def call(self, inputs):
      return inputs * self.scale

  calls = []

  def grads(layer, inputs, tap_grad):
    calls.append(layer.name)
    return [(layer.scale, inputs * tap_grad)]

  layer_rules.register(
      Scale, layer_rules.LayerRule(layer_rules._called_normally, grads))  # pylint: disable=protected-access
  model = tf.keras.Sequential([tf.keras.Input((3,)), Scale()])
  x = np.arange(6, dtype='float32').reshape(2, 3)
  result = recorder.model_gradients(
      model, x, lambda outputs: tf.reduce_sum(outputs, axis=1),
      model.trainable_variables)
  np.testing.assert_allclose(result.grads.materialized()[0].numpy(), x)
  assert calls


def test_regularization_is_returned_apart_from_the_per_example_gradients():
  tf.keras.utils.set_random_seed(0)
  model = tf.keras.Sequential([
      tf.keras.Input((3,)),
      L.Dense(2, kernel_regularizer=tf.keras.regularizers.L2(0.5))])
  x = np.ones((4, 3), 'float32')
  result = recorder.model_gradients(
      model, x, lambda outputs: tf.reduce_sum(outputs, axis=1),
      model.trainable_variables)
  kernel = model.layers[0].kernel
  # d/dW of sum(xW + b) is x outer 1 for each example, no regularizer in it.
  np.testing.assert_allclose(result.grads.materialized()[0].numpy(),
                             np.ones((4, 3, 2)))
  np.testing.assert_allclose(result.regularization_grads[0].numpy(),
                             2 * 0.5 * kernel.numpy(), rtol=1e-6)


class DataLoss(L.Layer):
  """Adds a loss computed from its inputs by `term`."""

  def __init__(self, term, **kwargs):
    super().__init__(**kwargs)
    self.term = term

  def call(self, inputs):
    self.add_loss(self.term(inputs))
    return inputs


DATA_TERMS = {
    'float': tf.reduce_sum,
    'stop_gradient': lambda x: tf.reduce_sum(tf.stop_gradient(x)),
    'rounded': lambda x: tf.reduce_sum(tf.round(x)),
    'argmax': lambda x: tf.cast(tf.reduce_sum(tf.argmax(x, axis=1)),
                                tf.float32),
    'integer': lambda x: tf.reduce_mean(tf.cast(tf.cast(x, tf.int32),
                                                tf.float32)),
}


@pytest.mark.parametrize('graph', [False, True], ids=['eager', 'graph'])
@pytest.mark.parametrize('term', sorted(DATA_TERMS))
def test_a_data_dependent_add_loss_is_refused(term, graph):
  # Before, only terms with a gradient to a float input or activation were.
  model = tf.keras.Sequential([
      tf.keras.Input((3,)), L.Dense(2),
      DataLoss(DATA_TERMS[term], name='data_loss'), L.Dense(1)])

  def run(x):
    return recorder.model_gradients(
        model, x, lambda outputs: tf.reduce_sum(outputs, axis=1),
        model.trainable_variables).grads.materialized()

  with pytest.raises(ValueError, match='data_loss.*depends on the data'):
    (tf.function(run) if graph else run)(np.ones((4, 3), 'float32'))


def test_a_variable_read_by_the_loss_is_refused():
  model = tf.keras.Sequential([tf.keras.Input((3,)), L.Dense(2)])
  kernel = model.layers[0].kernel
  with pytest.raises(ValueError, match='read outside the layer calls'):
    recorder.model_gradients(
        model, np.ones((4, 3), 'float32'),
        lambda outputs: tf.reduce_sum(outputs, axis=1) + tf.reduce_sum(kernel),
        model.trainable_variables)


def _poisoned(x, row):
  """`x` with an infinite entry in example `row` of its first float input."""
  x = [np.array(t) for t in tf.nest.flatten(x)]
  target = next(t for t in x if t.dtype.kind == 'f')
  target.reshape(BATCH, -1)[row, 0] = np.inf
  return x if len(x) > 1 else x[0]


# Which variables have cross Gram forms (Dense layers on vectors and
# embeddings, read once).
CROSS_GRAM_FORMS = {
    'dense': [True] * 4,
    'dense_on_sequences': [False] * 4,
    'embedding': [True] * 3,
    'embedding_repeats': [True] * 3,
    'shared': [False, False, True, True],
    'mixed': [True] + [False] * 11 + [True] * 4,
}


@pytest.mark.parametrize('join_chunk', [2**15, 3], ids=['one', 'chunks'])
@pytest.mark.parametrize('name', _slow_mixed(sorted(CROSS_GRAM_FORMS)))
def test_cross_grams_equal_those_of_the_loop(name, join_chunk, monkeypatch):
  # An embedding joins the two batches' (example, id) pairs on their ids,
  # a chunk of joined pairs at a time (3: many chunks, one cut mid-id).
  monkeypatch.setattr(embedding_forms, 'JOIN_CHUNK', join_chunk)
  model, x, y, rng = _problem(name)
  x_other = MODELS[name][1](rng)
  y_other = rng.normal(size=y.shape).astype('float32')
  flat, flat_other = [
      [g.reshape(BATCH, -1) for g in _loop_reference(model, inputs, targets)]
      for inputs, targets in ((x, y), (x_other, y_other))]
  sizes = [f.shape[1] for f in flat]
  forms = []

  @tf.function
  def cross_grams(x, x_other, lo, hi):
    grads, other = [recorder.model_gradients(
        model, inputs, lambda outputs, t=targets: _squared_error(t, outputs),
        model.trainable_variables, chunk_size=2).grads
                    for inputs, targets in ((x, y), (x_other, y_other))]
    forms[:] = grads.cross_gram_forms(other)
    spans = [(lo, n - hi if hi is not None else min(3, n)) if form else None
             for form, n in zip(forms, sizes)]
    return (grads.cross_grams(other, spans, tf.float64),
            grads.cross_gram(other, spans, tf.float64) if any(forms) else 0.0)

  # Whole variables, cut inside their first and last rows, or inside the
  # first row.
  for lo, hi in ((0, 0), (1, 1), (1, None)):
    got, summed = cross_grams(x, x_other, lo, hi)
    assert forms == CROSS_GRAM_FORMS[name]
    want, scale = 0.0, 0.0  # Their sum, the largest term's entry.
    for g, f, f_other, n, form in zip(got, flat, flat_other, sizes, forms):
      if not form:
        assert g is None
        continue
      a, b = lo, n - hi if hi is not None else min(3, n)
      np.testing.assert_allclose(g.numpy(), f[:, a:b] @ f_other[:, a:b].T,
                                 rtol=1e-5, atol=1e-6)
      term = f[:, a:b].astype(np.float64) @ f_other[:, a:b].T
      want, scale = want + term, max(scale, np.abs(term).max())
    # The terms cancel: each is as close as above, at their scale.
    np.testing.assert_allclose(summed, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize('jit_compile', [False, True], ids=['graph', 'xla'])
@pytest.mark.parametrize('name', ['embedding', 'embedding_repeats'])
def test_embedding_weighted_sums_on_windows_of_the_table(name, jit_compile,
                                                        monkeypatch):
  # Outside XLA a window's pairs are summed as the run of slots on its rows
  # (pairs sorted by id), under XLA by masking all pairs: both are the
  # window of the whole sum, a dropped example (NaN loss) left out.
  monkeypatch.setattr(per_example, 'SMALL_UNIT_SIZE', 0)  # The unit's forms.
  model, x, y, _ = _problem(name)
  bad = 2
  y_bad = y.copy()
  y_bad[bad] = np.nan
  table = _loop_reference(model, x, y)[0]
  table[bad] = 0.0
  vocab = table.shape[1]
  windows = [(0, vocab), (1, vocab - 1), (vocab // 2, vocab), (1, 2)]
  weights = np.random.default_rng(4).normal(size=(BATCH, 2)).astype('float32')

  @tf.function(jit_compile=jit_compile)
  def sums(x):
    grads = recorder.model_gradients(
        model, x, lambda outputs: _squared_error(y_bad, outputs),
        model.trainable_variables).grads
    return [grads.weighted_sums(tf.constant(weights),
                                [w] + [None] * (len(grads.shapes) - 1))[0]
            for w in windows]

  for got, (start, stop) in zip(sums(x), windows):
    np.testing.assert_allclose(
        got.numpy(), np.tensordot(weights, table[:, start:stop], [[0], [0]]),
        rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('name', ['dense', 'embedding'])
def test_a_non_finite_example_has_no_share_in_cross_grams(name):
  model, x, y, _ = _problem(name)
  bad = 2
  flat = [g.reshape(BATCH, -1) for g in _loop_reference(model, x, y)]
  for f in flat:
    f[bad] = 0.0
  y_bad = y.copy()
  y_bad[bad] = np.nan  # A NaN loss: every gradient of that example is NaN.

  @tf.function
  def self_grams(x):
    grads = recorder.model_gradients(
        model, x, lambda outputs: _squared_error(y_bad, outputs),
        model.trainable_variables).grads
    spans = [(0, f.shape[1]) for f in flat]
    return (grads.cross_grams(grads, spans, tf.float64),
            grads.cross_gram(grads, spans, tf.float64))

  grams, summed = self_grams(x)
  for got, f in zip(grams, flat):
    np.testing.assert_allclose(got.numpy(), f @ f.T, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(summed.numpy(), sum(f @ f.T for f in flat),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('use_rules', [True, False], ids=['rules', 'fallback'])
# Every family drops a NaN loss's record in the default run; an infinite
# input, which reaches the same drop, on Dense (the others: `make test-all`).
@pytest.mark.parametrize('cause,name', [
    pytest.param(cause, name, marks=[pytest.mark.slow] * (
        name == 'mixed' or (cause == 'inf_input' and name != 'dense')))
    for cause in ('inf_input', 'nan_loss')
    for name in ('dense', 'dense_on_short_sequences', 'conv2d', 'layer_norm',
                 'mixed')] + [('nan_loss', 'embedding')])  # Ids: no inf.
def test_a_non_finite_example_is_dropped_and_the_others_are_untouched(
    cause, name, use_rules):
  model, x, y, _ = _problem(name)
  expected = _loop_reference(model, x, y)
  bad = 2
  if cause == 'inf_input':
    x = _poisoned(x, bad)
  weights = np.ones(BATCH, 'float32')
  weights[bad] = 0.0  # For nan_loss: sqrt at 0, whose gradient is NaN.

  def loss(outputs):
    if cause == 'inf_input':
      return _squared_error(y, outputs)
    return tf.sqrt(weights * _squared_error(y, outputs))

  if cause == 'nan_loss':  # The reference of the sqrt loss, where finite.
    factors = 0.5 / np.sqrt(_squared_error(y, model(x)).numpy())
    expected = [g * factors.reshape([-1] + [1] * (g.ndim - 1))
                for g in expected]
  for g in expected:
    g[bad] = 0.0

  dropped = tf.function(lambda x: recorder.model_gradients(
      model, x, loss, model.trainable_variables, chunk_size=2,
      use_rules=use_rules).grads.dropped_records())(x)
  assert dropped.numpy() == 1
  _check_statistics(_InGraph(model, x, loss, chunk_size=2, use_rules=use_rules),
                    expected)


class WithDropout(tf.keras.Model):
  """A subclassed model with a Keras Dropout between its Dense layers: the
  engine opens it, the dropout acts in the batched pass."""

  def __init__(self):
    super().__init__()
    self.first, self.drop, self.last = L.Dense(4), L.Dropout(0.5), L.Dense(2)

  def call(self, inputs, training=None):
    return self.last(self.drop(self.first(inputs), training=training))


class DroppedLinear(L.Layer):
  """A layer computing with its own kernel and a dropout: one fallback unit
  that draws random numbers."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.drop = L.Dropout(0.5)

  def build(self, input_shape):
    self.kernel = self.add_weight(name='kernel', shape=(input_shape[-1], 2))

  def call(self, inputs, training=None):
    return self.drop(inputs, training=training) @ self.kernel


def _random_models():
  signal = tf.keras.Input((5, 3))
  attention = L.MultiHeadAttention(2, 3, dropout=0.5)(signal, signal)
  subclassed = WithDropout()
  subclassed(tf.zeros([1, 5, 3]))
  return {
      'own_weights': tf.keras.Sequential([tf.keras.Input((5, 3)),
                                          DroppedLinear()]),
      'lstm': tf.keras.Sequential([
          tf.keras.Input((5, 3)),
          L.LSTM(4, dropout=0.5, recurrent_dropout=0.3), L.Dense(2)]),
      'gru': tf.keras.Sequential([
          tf.keras.Input((5, 3)), L.GRU(4, dropout=0.5), L.Dense(2)]),
      'attention': tf.keras.Model(
          signal, L.Dense(2)(L.Flatten()(attention))),
      'subclassed': subclassed,
  }


def _random_cases():
  """Each model eager and in a graph; the LSTM, and the GRU in a graph (20 s:
  the Jacobian's loop; the graph's random fallback is own_weights'), in
  `make test-all`."""
  for name in ['lstm', 'gru', 'attention', 'subclassed', 'own_weights']:
    for graph in (False, True):
      slow = name == 'lstm' or (name == 'gru' and graph)
      yield pytest.param(name, graph,
                         id=f'{name}-{"graph" if graph else "eager"}',
                         marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize('name, graph', _random_cases())
def test_a_random_fallback_call_gets_the_gradients_of_the_forward_that_ran(
    name, graph, caplog):
  # Before, the fallback recomputed each example with new dropout masks.
  tf.keras.utils.set_random_seed(1)
  model = _random_models()[name]
  x = np.random.default_rng(0).normal(size=(BATCH, 5, 3)).astype('float32')

  def run(x):
    # The outer tape's Jacobian of the losses is the compile path's
    # per-example gradient of the very forward pass the engine ran.
    with tf.GradientTape(persistent=True) as tape:
      result = recorder.model_gradients(
          model, x, lambda outputs: _squared_error(0.0, outputs),
          model.trainable_variables, chunk_size=2)
    jacobian = tape.jacobian(result.losses, model.trainable_variables,
                             experimental_use_pfor=False)
    return result.grads.materialized(), jacobian

  with caplog.at_level('WARNING', logger=recorder.__name__):
    got, want = (tf.function(run) if graph else run)(x)
  assert np.abs(want[0].numpy()).max() > 0
  for g, w in zip(got, want):
    np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-4, atol=1e-5)
  # The cost is not silent; the dropout of attention and of the subclassed
  # model acts between their ruled sublayers, in the batched pass: no
  # fallback, nothing to warn about.
  assert ('draws random numbers' in caplog.text) == (
      name not in ('attention', 'subclassed'))


def test_a_deterministic_fallback_call_stays_linear(caplog):
  tf.keras.utils.set_random_seed(1)
  model = MODELS['lstm'][0]()
  with caplog.at_level('WARNING', logger=recorder.__name__):
    tf.function(lambda x: recorder.model_gradients(
        model, x, lambda outputs: tf.reduce_sum(outputs, axis=1),
        model.trainable_variables).grads.materialized())(_ids(6, 10)(
            np.random.default_rng(0)))
  assert 'draws random numbers' not in caplog.text


@pytest.mark.parametrize('name', ['dense_on_sequences', 'embedding'])
def test_fallback_calls_on_two_row_batches_equal_the_loop(name, monkeypatch):
  # Where a vectorized call on one-example batches crashes TensorFlow, each
  # example runs as two copies, the second with a zero output gradient.
  padded = []
  monkeypatch.setattr(recorder, '_one_row_batches_crash',
                      lambda: padded.append(1) or True)
  _check_against_the_loop(name, use_rules=False)
  assert padded


_ATTENTION_SCRIPT = """
import numpy as np, tensorflow as tf
from tfdpx.keras import recorder
L = tf.keras.layers
tf.keras.utils.set_random_seed(1)
tokens = tf.keras.Input((128, 64))
attention = L.MultiHeadAttention(4, 16)(tokens, tokens)
model = tf.keras.Model(tokens, L.Dense(2)(L.GlobalAveragePooling1D()(attention)))
x = np.random.default_rng(0).normal(size=(4, 128, 64)).astype('float32')
loss = lambda outputs: tf.reduce_sum(tf.square(outputs), axis=1)
got = tf.function(lambda x: recorder.model_gradients(
    model, x, loss, model.trainable_variables).grads.materialized())(x)
for i in range(4):
  with tf.GradientTape() as tape:
    want = tape.gradient(loss(model(x[i:i + 1])), model.trainable_variables)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g[i].numpy(), w.numpy(), rtol=1e-4, atol=1e-6)
print('equal')
"""


def test_attention_at_transformer_sizes_runs_and_equals_the_loop():
  # TensorFlow 2.21.0 with oneDNN crashed (segfault) on the vectorized
  # one-example call of Keras 3's MultiHeadAttention at these sizes: run it
  # in a process of its own.
  result = subprocess.run([sys.executable, '-c', _ATTENTION_SCRIPT],
                          capture_output=True, text=True, timeout=600,
                          check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split()[-1] == 'equal'


def test_map_rows_pads_and_trims_to_the_batch():
  x = tf.reshape(tf.range(7.0), [7, 1])
  out = chunks.map_rows(lambda c: [c[0] * 2.0], [x], 3,
                        [tf.TensorSpec([1], tf.float32)])
  np.testing.assert_allclose(out[0].numpy(), x.numpy() * 2.0)


def test_chunks_run_one_after_the_other():
  # Side by side (a graph's default for a map), every chunk's per-example
  # tensors would be alive at once: memory bounded by the batch, not the chunk.
  x = tf.reshape(tf.range(7.0), [7, 1])
  spec = [tf.TensorSpec([1], tf.float32)]
  graph = tf.function(lambda x: (
      chunks.map_rows(lambda c: [c[0] * 2.0], [x], 3, spec),
      chunks.sum_rows(lambda c, valid: [tf.reduce_sum(c[0], 0)], [x], 3,
                      spec))).get_concrete_function(x).graph
  loops = [op for op in graph.get_operations()
           if op.type in ('While', 'StatelessWhile')]
  assert len(loops) == 2
  assert all(op.get_attr('parallel_iterations') == 1 for op in loops)


def _path(variable) -> str:
  """A variable's unique name (Keras 3's `name` is the last part only)."""
  return variable.path if hasattr(variable, 'path') else variable.name


def _kernels_formed(monkeypatch, name):
  """The kernels (paths) model `name`'s engine forms whole in one step of
  the norms, then two rounds of dots and weighted sums, then the norms:
  `(model, those formed for the first norms, all)`; each at most once."""
  formed = []
  all_kernels = dense_forms.ProductUnit._all_kernels  # pylint: disable=protected-access

  def recording(unit):
    formed.append(_path(unit.variables[0]))
    return all_kernels(unit)

  monkeypatch.setattr(dense_forms.ProductUnit, '_all_kernels', recording)
  model, x, y, rng = _problem(name)
  directions = [rng.normal(size=(3, *v.shape)).astype('float32')
                for v in model.trainable_variables]
  weights = rng.normal(size=(x.shape[0], 2)).astype('float32')
  after_norms = []

  @tf.function
  def statistics(x):
    grads = recorder.model_gradients(
        model, x, lambda outputs: _squared_error(y, outputs),
        model.trainable_variables, chunk_size=2).grads
    grads.sq_norms()
    after_norms.extend(formed)
    for _ in range(2):
      grads.dots(directions)
      grads.weighted_sums(weights)
    return grads.sq_norms()

  statistics(x)
  assert len(set(formed)) == len(formed), formed
  return model, after_norms, formed


def test_a_kernel_is_formed_once_and_only_when_read_beyond_ghost_norms(
    monkeypatch):
  # Norms alone (DP-SGD) need no [B, *kernel.shape] tensor where the kernel
  # has the ghost form; once another statistic forms it, every later
  # statistic of the step reuses it. A kernel without the ghost form is
  # formed for its norms too, once.
  # The first layer's kernel: ghost norms in one model, none in the other.
  for name, after_norms in (('conv2d_ghost', 0), ('conv2d', 1)):
    model, norms_formed, formed = _kernels_formed(monkeypatch, name)
    first = _path(model.layers[0].kernel)
    assert [norms_formed.count(first), formed.count(first)] == [
        after_norms, 1], (name, formed)


@pytest.mark.parametrize('unknown_batch', [False, True])
def test_convolution_kernels_no_larger_than_their_patches_are_kept(
    unknown_batch, monkeypatch):
  # A convolution extracts its input patches again for every statistic
  # of a kernel it does not keep: one of at most CACHED_CONV_KERNEL_SIZE
  # entries and no more outputs than positions (o <= T) is formed once for
  # the step, above CACHED_KERNEL_SIZE; a Dense kernel is not. (No unit is
  # small enough to be materialized whole for its dots.)
  monkeypatch.setattr(per_example, 'SMALL_UNIT_SIZE', 0)
  monkeypatch.setattr(dense_forms, 'CACHED_KERNEL_SIZE', 0)
  monkeypatch.setattr(dense_forms, 'CACHED_CONV_KERNEL_SIZE', 10**6)
  # conv2d: T = 40, 18 and 3 positions, o = 4, 3, 2. conv2d_ghost: T = 4,
  # o = 16, then a Dense layer.
  model, _, formed = _kernels_formed(monkeypatch, 'conv2d')
  assert sorted(formed) == sorted(_path(layer.kernel)
                                  for layer in model.layers), formed
  assert _kernels_formed(monkeypatch, 'conv2d_ghost')[2] == []
  _check_against_the_loop('conv2d', unknown_batch=unknown_batch)
  monkeypatch.setattr(dense_forms, 'CACHED_CONV_KERNEL_SIZE', 0)
  assert _kernels_formed(monkeypatch, 'conv2d')[2] == []


def test_microbatch_means_average_the_examples_of_each_microbatch():
  grads = [tf.reshape(tf.range(8.0), [4, 2])]
  means = per_example.microbatch_means(grads, 2)
  np.testing.assert_allclose(means[0].numpy(), [[1.0, 2.0], [5.0, 6.0]])
  assert per_example.microbatch_means(grads, None)[0] is grads[0]


class Folded(L.Layer):
  """Folds positions into the first axis before its Dense layer: the Dense
  call's rows are (example, position) pairs, not examples."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = L.Dense(3)

  def call(self, inputs):
    rows = self.dense(tf.reshape(inputs, [-1, 2]))
    return tf.reshape(rows, [tf.shape(inputs)[0], 12])


def _folded():
  inputs = tf.keras.Input((4, 2))
  return tf.keras.Model(inputs, L.Dense(2)(Folded(name='folded')(inputs)))


def test_a_composite_folding_the_batch_axis_is_one_unit_or_stops():
  tf.keras.utils.set_random_seed(1)
  model = _folded()
  x = np.random.default_rng(0).normal(size=(BATCH, 4, 2)).astype('float32')
  # A static batch: the folded call's rows are seen not to be the examples;
  # the whole layer is one (exact) fallback unit.
  _check_against_the_loop_of(model, x)
  # The batch size unknown when traced: the step stops, naming the layer,
  # rather than clip (example, position) pairs one by one.
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match='tfdpx_rows_of_dense.*_are_not_the_examples'):
    _check_against_the_loop_of(model, x, unknown_batch=True)
