"""tensorflow-privacy's own Keras tests, run against tfdpx's classes.

The installed test modules of tensorflow-privacy 0.9.0
(`optimizers/dp_optimizer_keras_test.py`, `keras_models/dp_keras_model_test.py`)
are imported, not copied. Each of their test cases runs as written, every
assertion kept, with tfdpx's class in place of tensorflow-privacy's: the
optimizer cases parameterized with a `VectorizedDPKeras*Optimizer` get
`tfdpx.keras.DPSGD` / `DPAdam` / `DPAdagrad` in its place (with a known noise
key, see `_known_noise`), and so do the cases of the non-vectorized
`DPKeras*Optimizer` (the tutorial's classes), which take the same arguments;
the model cases run with `dp_keras_model.DPModel` / `DPSequential` resolving
to tfdpx's. The DP-FTRL cases test another algorithm and are not run.

`EXPECTED_DIFFERENCES` lists the cases where tfdpx differs on purpose, each
with its reason; each must still fail, for that reason, so the list cannot
rot.
"""

import functools
import inspect
import types
import unittest

import pytest

import tfdpx

opt_test = pytest.importorskip(
    'tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_test')
model_test = pytest.importorskip(
    'tensorflow_privacy.privacy.keras_models.dp_keras_model_test')
# pylint: disable=g-import-not-at-top,g-bad-import-order
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras as tfp_keras
from tensorflow_privacy.privacy.optimizers import dp_optimizer_keras_vectorized as tfp_vectorized


def _known_noise(cls):
  """`cls` with a known noise key.

  tf.test.TestCase fixes TensorFlow's global seed, which makes the noise of
  tensorflow-privacy's classes the same in every run, and their noise tests
  (std within 2.8 standard errors) deterministic. tfdpx's noise ignores that
  seed (its key is secret); `noise_seed` plays its part here. tfdpx's own
  tests check the noise two-sided, with tolerances from the sample size.
  """
  return functools.partial(cls, noise_seed=0)


TFDPX_OPTIMIZERS = {
    # Not classes: functions that build tensorflow-privacy's classes.
    tfp_keras.DPKerasSGDOptimizer: _known_noise(tfdpx.keras.DPSGD),
    tfp_keras.DPKerasAdamOptimizer: _known_noise(tfdpx.keras.DPAdam),
    tfp_keras.DPKerasAdagradOptimizer: _known_noise(tfdpx.keras.DPAdagrad),
    tfp_vectorized.VectorizedDPKerasSGDOptimizer:
        _known_noise(tfdpx.keras.DPSGD),
    tfp_vectorized.VectorizedDPKerasAdamOptimizer:
        _known_noise(tfdpx.keras.DPAdam),
    tfp_vectorized.VectorizedDPKerasAdagradOptimizer:
        _known_noise(tfdpx.keras.DPAdagrad),
}

# What the model tests find under `dp_keras_model.`: tfdpx's models.
TFDPX_MODELS = types.SimpleNamespace(DPModel=tfdpx.keras.DPModel,
                                     DPSequential=tfdpx.keras.DPSequential)

_DATA_DEPENDENT_ADD_LOSS = (
    'The test adds model.add_loss(tf.reduce_sum(inputs)), a loss term that '
    'depends on the data, and checks that it gives no gradient. tensorflow-'
    'privacy adds the gradient of model.losses outside the clipped sum and '
    'warns that such terms must not depend on the data; tfdpx refuses them at '
    'the first step, naming the layer: outside every clip, one example could '
    'move the update without bound.',
    'a loss added with add_loss in layer(s)')

_GRADIENT_ACCUMULATION = (
    'The test passes gradient_accumulation_steps, the large-batch emulation '
    'of the non-vectorized DPKeras*Optimizer (privatize once every k calls). '
    'tfdpx, like tensorflow-privacy\'s vectorized optimizers, has no such '
    'argument and refuses it; its virtual batches are make_private\'s '
    'physical_batch_size.',
    'gradient_accumulation_steps')

# Case id -> (why tfdpx differs, text its failure must contain).
EXPECTED_DIFFERENCES = {
    **{f'DPOptimizerGetGradientsTest.testLargeBatchEmulation{case}':
           _GRADIENT_ACCUMULATION
       for case in ('DPKerasSGDOptimizer_1', 'DPKerasSGDOptimizer_2',
                    'DPKerasSGDOptimizer_4', 'DPKerasAdamOptimizer_2',
                    'DPKerasAdagradOptimizer_2')},
    'DPKerasModelTest.testCustomRegularizationZeroGradientfast_clipping':
        _DATA_DEPENDENT_ADD_LOSS,
    'DPKerasModelTest.testCustomRegularizationZeroGradientno_fast_clipping':
        _DATA_DEPENDENT_ADD_LOSS,
}


def _parameters(method):
  """The (args, kwargs) an absl-parameterized test method was bound to."""
  params = inspect.getclosurevars(method).nonlocals.get('testcase_params')
  if params is None:
    return (), {}
  if isinstance(params, dict):
    return (), dict(params)
  if isinstance(params, (tuple, list)):
    return tuple(params), {}
  return (params,), {}


def _cases(module, substitute):
  """(id, TestCase class, method name, args, kwargs) of each case to run.

  `substitute(args, kwargs)` returns the arguments with tfdpx's classes in
  place of tensorflow-privacy's, or None if the case does not test one.
  """
  for cls in vars(module).values():
    if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)):
      continue
    for name in vars(cls):  # In definition order.
      if not name.startswith('test') or name == 'test_session':
        continue
      args, kwargs = _parameters(getattr(cls, name))
      substituted = substitute(args, kwargs)
      if substituted is not None:
        yield (f'{cls.__name__}.{name}', cls, name) + substituted


def _tfdpx_optimizer(argument):
  """tfdpx's class for a tensorflow-privacy optimizer class, else None."""
  return TFDPX_OPTIMIZERS.get(argument) if callable(argument) else None


def _optimizer_arguments(args, kwargs):
  if not any(map(_tfdpx_optimizer, (*args, *kwargs.values()))):
    return None
  swap = lambda a: _tfdpx_optimizer(a) or a
  return (tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()})


def _model_arguments(args, kwargs):
  return args, kwargs  # Every model case uses `dp_keras_model`.


def _with_tfdpx_models(function):
  """`function` with `dp_keras_model` in its globals resolving to tfdpx's."""
  assert 'dp_keras_model' in function.__code__.co_names, function
  return types.FunctionType(
      function.__code__,
      {**function.__globals__, 'dp_keras_model': TFDPX_MODELS},
      function.__name__, function.__defaults__, function.__closure__)


def _params(cases, models):
  """pytest params; a test function's cases beyond a few are mostly slow.

  `make test` runs every case of a test function with at most 4 cases and
  the first and the last of the others; `make test-all` runs all of them.
  """
  cases = list(cases)
  params = []
  for case_id, cls, name, args, kwargs in cases:
    function = inspect.unwrap(getattr(cls, name))
    same = [c for c in cases if inspect.unwrap(getattr(c[1], c[2])) is function]
    slow = len(same) > 4 and same[0][0] != case_id and same[-1][0] != case_id
    params.append(pytest.param(
        case_id, cls, name, args, kwargs, models, id=case_id,
        marks=[pytest.mark.slow] if slow else []))
  return params


CASES = (_params(_cases(opt_test, _optimizer_arguments), models=False) +
         _params(_cases(model_test, _model_arguments), models=True))


def _run(cls, name, args, kwargs, models):
  """Runs one case as unittest would; returns the failure text or None."""
  function = inspect.unwrap(getattr(cls, name))
  if models:
    function = _with_tfdpx_models(function)
  case = cls(name)
  # The bound test method of this instance: the original test function with
  # tfdpx's classes in its arguments (and globals).
  setattr(case, name,
          types.MethodType(lambda self: function(self, *args, **kwargs), case))
  result = unittest.TestResult()
  case.run(result)
  problems = result.errors + result.failures
  return '\n'.join(text for _, text in problems) if problems else None


def test_every_expected_difference_names_a_case_that_runs():
  assert set(EXPECTED_DIFFERENCES) <= {case.values[0] for case in CASES}


@pytest.mark.parametrize('case_id, cls, name, args, kwargs, models', CASES)
def test_tensorflow_privacy_case(case_id, cls, name, args, kwargs, models):
  failure = _run(cls, name, args, kwargs, models)
  if case_id in EXPECTED_DIFFERENCES:
    reason, pattern = EXPECTED_DIFFERENCES[case_id]
    assert failure is not None, (
        f'{case_id} now passes: remove it from EXPECTED_DIFFERENCES ({reason})')
    assert pattern in failure, failure
  else:
    assert failure is None, failure
