"""tfdpx.philox gives tf.random's Philox bits and folded seeds, bit for bit."""

import numpy as np
import pytest
import tensorflow as tf

from tfdpx import philox

_RNG = np.random.default_rng(0)
# Edge and random seeds of both seed dtypes, and 64-bit ones past int32.
SEEDS32 = np.array([[0, 0], [1, 2], [-1, -1], [2**31 - 1, -2**31]] +
                   list(_RNG.integers(-2**31, 2**31, (8, 2))), np.int32)
SEEDS64 = np.concatenate([SEEDS32.astype(np.int64), np.array(
    [[2**62, -2**63], [2**40 + 3, 7]] +
    list(_RNG.integers(-2**63, 2**63, (8, 2), dtype=np.int64)), np.int64)])


def _run(mode, fn, seeds):
  """`fn` of each row of `seeds`, stacked: eager, traced or under XLA (one
  trace and compilation for all the seeds)."""
  if mode != 'eager':
    fn = tf.function(fn, jit_compile=mode == 'xla', autograph=False)
  return np.stack([fn(tf.constant(seed)).numpy() for seed in seeds])


@pytest.mark.parametrize('mode', ['eager', 'graph', 'xla'])
@pytest.mark.parametrize('dtype', [tf.uint32, tf.int32, tf.uint64, tf.int64])
@pytest.mark.parametrize('seeds', [SEEDS32, SEEDS64], ids=['int32', 'int64'])
def test_bits_are_tf_randoms(mode, dtype, seeds):
  ours = _run(mode, lambda s: philox.bits([3, 5], s, dtype), seeds)
  theirs = _run(mode, lambda s: tf.random.stateless_uniform(
      [3, 5], s, minval=None, maxval=None, dtype=dtype, alg='philox'), seeds)
  np.testing.assert_array_equal(ours, theirs)
  assert len(np.unique(ours)) > ours.size // 2  # Not a constant.


@pytest.mark.parametrize('mode', ['eager', 'graph', 'xla'])
@pytest.mark.parametrize('data', [7, 2**33 + 5], ids=['int32', 'int64'])
@pytest.mark.parametrize('seeds', [SEEDS32, SEEDS64], ids=['int32', 'int64'])
def test_folded_seeds_are_tf_randoms(mode, data, seeds):
  ours = _run(mode, lambda s: philox.fold_in(s, data), seeds)
  theirs = _run(mode, lambda s: tf.random.experimental.stateless_fold_in(
      s, data, alg='philox'), seeds)
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize('mode', ['eager', 'graph', 'xla'])
@pytest.mark.parametrize('seeds', [SEEDS32, SEEDS64], ids=['int32', 'int64'])
def test_folded_seeds_of_many_data_and_from_a_draw(mode, seeds):
  data = tf.constant([0, 5, -3, 2**31 - 1], tf.int32)
  many = _run(mode, lambda s: philox.fold_in(s, data), seeds)
  from_draw = _run(mode, lambda s: philox.fold_in_from(
      philox.bits([3, 2], s), 7), seeds)
  theirs = [_run(mode, lambda s, d=d: tf.random.experimental.stateless_fold_in(
      s, d, alg='philox'), seeds) for d in [0, 5, -3, 2**31 - 1, 7]]
  np.testing.assert_array_equal(many, np.stack(theirs[:4], axis=1))
  np.testing.assert_array_equal(from_draw, theirs[4])


def _ops(fn):
  graph = tf.function(fn, autograph=False).get_concrete_function(
      tf.TensorSpec([2], tf.int64)).graph
  return len(graph.get_operations())


def test_a_third_of_the_graph_ops():
  assert 3 * _ops(lambda s: philox.bits([4], s)) <= _ops(
      lambda s: tf.random.stateless_uniform(
          [4], s, minval=None, maxval=None, dtype=tf.uint32, alg='philox'))
  assert 2.5 * _ops(lambda s: philox.fold_in(s, 3)) <= _ops(
      lambda s: tf.random.experimental.stateless_fold_in(s, 3, alg='philox'))
