"""The traced training step of a benchmark model made private, as a graph.

Shared by the pipeline test (the forms chosen with a static and an unknown
batch size) and the GPU-readiness test (every op has a GPU kernel).
"""

import tensorflow as tf

import tfdpx
from benchmarks import models
from tests.privatizers import cases

# The noise steps, and the wrappers that add ops of their own.
PRIVATIZERS = ('gaussian', 'dpdr', 'sparsified(gaussian)', 'd2p2_srht_mode_o',
               'gep', 'geodp_sound', 'adaptive(gaussian)',
               'per_layer(gaussian)')
# Steps that ask the engine for DP-SGD's statistics alone (norms and one
# weighted sum): their model-dependent ops are DP-SGD's, checked on every
# model, and their own the same on any.
NORMS_ONLY = ('d2p2_srht_mode_o', 'geodp_sound')
NUM_PUBLIC = 16


def private_model(model_name: str, privatizer: str, expected_batch_size: int,
                  jit_compile: bool = False) -> tf.keras.Model:
  """Benchmark model `model_name` made private and compiled with `privatizer`
  (a name of `tests.privatizers.cases.CASES`), noise multiplier 1, clip 1."""
  tf.keras.utils.set_random_seed(0)
  case = cases.case_named(privatizer)
  public = (models.data(model_name, NUM_PUBLIC, seed=1)
            if case.needs_public else None)
  model = tfdpx.keras.make_private(models.MODELS[model_name][0](),
                                   public_data=public)
  model.compile(
      tfdpx.keras.DPSGD(privatizer=case.make(1.0, 1.0),
                        expected_batch_size=expected_batch_size,
                        learning_rate=0.1),
      tf.keras.losses.SparseCategoricalCrossentropy(
          from_logits=True, reduction='none'),
      jit_compile=jit_compile)
  return model


def batch_spec(model_name: str, batch):
  """`(x, y)` TensorSpecs of a batch of `batch` rows (None: unknown)."""
  x, y = models.data(model_name, 1)
  return (tf.TensorSpec([batch, *x.shape[1:]], tf.as_dtype(x.dtype)),
          tf.TensorSpec([batch], tf.as_dtype(y.dtype)))


def built(model: tf.keras.Model, model_name: str) -> tf.keras.Model:
  """`model` with its variables and its optimizer's created, outside any
  trace (a step traced to create them took as long as the test's own)."""
  model(models.data(model_name, 2)[0])
  model.optimizer.create_variables(model.trainable_variables)
  return model


def train_step_graph(model: tf.keras.Model, spec) -> tf.Graph:
  """The graph of `model.train_step` traced for batches of `spec`."""
  return tf.function(model.train_step).get_concrete_function(spec).graph
