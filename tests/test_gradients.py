"""The per-example gradient value: materialized forms and the masked view."""

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import gradients

SHAPES = [(3, 4), (4,), (2, 2, 3)]


def _grads(batch=5, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(batch,) + s).astype('float32') for s in SHAPES]


def test_materialized_statistics_equal_the_obvious_numpy():
  grads = _grads()
  value = gradients.MaterializedGradients(grads)
  rng = np.random.default_rng(1)
  directions = [rng.normal(size=(2,) + s).astype('float32') for s in SHAPES]
  masks = [(rng.random(s) < 0.5).astype('float32') for s in SHAPES]
  weights = rng.random(5).astype('float32')
  for got, g in zip(value.sq_norms(), grads):
    np.testing.assert_allclose(got, (g**2).reshape(5, -1).sum(1), rtol=1e-5)
  np.testing.assert_allclose(
      gradients.global_sq_norms(value),
      sum((g**2).reshape(5, -1).sum(1) for g in grads), rtol=1e-5)
  for got, g, d in zip(value.dots(directions), grads, directions):
    np.testing.assert_allclose(got, g.reshape(5, -1) @ d.reshape(2, -1).T,
                               rtol=1e-5)
  assert value.dots([None, directions[1], None])[0] is None
  for got, g, m in zip(value.masked_sq_norms(masks), grads, masks):
    np.testing.assert_allclose(got, ((g * m)**2).reshape(5, -1).sum(1),
                               rtol=1e-5)
  for got, g in zip(value.weighted_sum(weights), grads):
    np.testing.assert_allclose(got, np.tensordot(weights, g, axes=1),
                               rtol=1e-5)
  assert int(value.batch_size()) == 5
  assert value.shapes == [tf.TensorShape(s) for s in SHAPES]


def test_masked_view_equals_materialized_masked_gradients():
  grads = _grads(seed=2)
  rng = np.random.default_rng(3)
  masks = [(rng.random(s) < 0.5).astype('float32') for s in SHAPES]
  other = [(rng.random(s) < 0.5).astype('float32') for s in SHAPES]
  directions = [rng.normal(size=(3,) + s).astype('float32') for s in SHAPES]
  weights = rng.random(5).astype('float32')
  view = gradients.MaterializedGradients(grads).masked(masks)
  reference = gradients.MaterializedGradients(
      [g * m for g, m in zip(grads, masks)])
  for a, b in [(view.sq_norms(), reference.sq_norms()),
               (view.dots(directions), reference.dots(directions)),
               (view.masked_sq_norms(other), reference.masked_sq_norms(other)),
               (view.weighted_sum(weights), reference.weighted_sum(weights)),
               (view.materialized(), reference.materialized())]:
    for x, y in zip(a, b):
      np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def test_lists_become_materialized_gradients_and_bad_layouts_are_refused():
  grads = _grads()
  value = gradients.as_per_example_gradients(grads)
  assert isinstance(value, gradients.MaterializedGradients)
  assert gradients.as_per_example_gradients(value) is value
  with pytest.raises(ValueError, match='directions has 1 entries'):
    value.dots([None])
  with pytest.raises(ValueError, match='masks has 1 entries'):
    value.masked([np.ones((3, 4))])
