"""GEP's orthonormalizations and factorizations: each form against the obvious
computation, at the conditions power-method outputs have, and the forms'
bases against each other (tests that take no part in test_gep.py's forms).
"""

import math
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.privatizers.test_gep import _flat, _grads, KEY, M, N
from tfdpx import gradients
from tfdpx import privatizers
from tfdpx.privatizers.gep import allocate_bases

GEP_MODULE = sys.modules[privatizers.GEP.__module__]


def test_the_gram_matrix_summed_block_by_block_is_the_whole_one(monkeypatch):
  matrix = np.random.default_rng(0).normal(size=(50, 4)).astype('float32')
  monkeypatch.setattr(GEP_MODULE, 'GRAM_BLOCK_ROWS', 7)  # 8 blocks, one short.
  got = GEP_MODULE._gram64(tf.constant(matrix)).numpy()
  want = matrix.astype(np.float64).T @ matrix.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize('batch', [(), (3,)])
@pytest.mark.parametrize('m', [64, 100, 256])
def test_the_blocked_cholesky_factor_is_tf_linalg_cholesky(m, batch):
  # Blocked under XLA only; a batch of groups' matrices at once.
  rng = np.random.default_rng(m)
  root = rng.normal(size=batch + (m, m + 10))
  matrix = tf.constant(root @ np.swapaxes(root, -1, -2))
  got = tf.function(GEP_MODULE._cholesky, jit_compile=True)(matrix).numpy()  # pylint: disable=protected-access
  np.testing.assert_allclose(got, tf.linalg.cholesky(matrix).numpy(),
                             rtol=0, atol=1e-12 * np.abs(got).max())


@pytest.mark.parametrize('condition', [1e2, 1e6, 1e10])
def test_coordinates_give_the_basis_of_shifted_cholesky_qr_from_k(condition):
  # The QR form in the anchors' coordinates (`L^-T Q` from `L^T W = Q R`)
  # against the obvious passes in numpy, shifted Cholesky QR on `W^T (K +
  # s I) W`, on anchors whose singular values span `condition`, from a start
  # whose directions are as badly scaled. Compared as bases `A^T W`, the
  # release's, within the first-order perturbation bound of a QR factor
  # computed in float64, `eps cond(L^T W)` relative: 6e-12, 4e-9 and 1e-3
  # at the three conditions. At 1e10 the difference is well inside it but
  # depends on the machine's rounding: 5e-6 to 1e-4 on AMD EPYC without
  # oneDNN (2026-12-07), where the earlier fixed bound of 1e-5 failed; the
  # passes in numpy are within 7e-7 of a 40-digit computation, the form is
  # the less accurate one.
  rng = np.random.default_rng(int(math.log10(condition)))
  m, p, k = 64, 300, 12

  def scaled(rows, columns):
    u, _ = np.linalg.qr(rng.normal(size=(rows, columns)))
    return u * np.geomspace(1.0, 1.0 / condition, columns)

  anchors = scaled(m, m) @ rng.normal(size=(m, p))
  gram = anchors @ anchors.T
  shifted = gram + (1e-12 * np.trace(gram)) * np.eye(m)
  start = scaled(m, k) @ rng.normal(size=(k, k))
  want = start
  for _ in range(3):
    basis_gram = want.T @ shifted @ want
    factor = np.linalg.cholesky(
        basis_gram + (1e-13 * np.trace(basis_gram) + 1e-30) * np.eye(k))
    want = want @ np.linalg.inv(factor).T
  got = GEP_MODULE._orthonormalize_coordinates(  # pylint: disable=protected-access
      tf.constant(np.linalg.cholesky(shifted)), tf.constant(start)).numpy()
  basis, want_basis = anchors.T @ got, anchors.T @ want
  bound = np.finfo(np.float64).eps * np.linalg.cond(
      np.linalg.cholesky(shifted).T @ start)
  assert (np.linalg.norm(basis - want_basis) <=
          bound * np.linalg.norm(want_basis))
  np.testing.assert_allclose(basis.T @ basis, np.eye(k), atol=1e-6)


def _power_step(condition, m=80, p=1000, k=30):
  """`A^T A Omega` (float64 `[p, k]`) for anchors `A` whose singular values
  span `condition`."""
  rng = np.random.default_rng(int(math.log10(condition)))
  u, _ = np.linalg.qr(rng.normal(size=(m, m)))
  anchors = (u * np.geomspace(1.0, 1.0 / condition, m)) @ rng.normal(
      size=(m, p))
  return anchors.T @ (anchors @ rng.normal(size=(p, k)))


@pytest.mark.parametrize('condition', [1e2, 1e5, 1e8])
def test_loop_free_passes_span_what_cholesky_qr_spans(condition):
  # Newton-Schulz passes against Cholesky QR's on the same power-method
  # output, in float64 (in float32 the rounding of the output moves any two
  # orthonormalizations' projectors apart by up to 1e-2 at 1e8): orthonormal
  # columns with the same projector, eager and under XLA.
  matrix = tf.constant(_power_step(condition))
  want = GEP_MODULE._orthonormalize(matrix).numpy()  # pylint: disable=protected-access
  projector = want @ want.T
  loop_free = lambda x: GEP_MODULE._orthonormalize(x, loop_free=True)  # pylint: disable=protected-access
  for got in (loop_free(matrix).numpy(),
              tf.function(loop_free, jit_compile=True)(matrix).numpy()):
    np.testing.assert_allclose(got.T @ got, np.eye(got.shape[1]), atol=1e-10)
    assert (np.linalg.norm(got @ got.T - projector) <=
            1e-5 * np.linalg.norm(projector))


def test_loop_free_passes_normalize_dependent_columns_as_cholesky_qr_does():
  # Rank 3 in float32: the 57 other columns are rounding, which both forms
  # turn into orthonormal directions (the second pass into unit ones) without
  # losing the anchors' row space (the polar factor's products in float32
  # lost 3% of it), and all-zero columns stay zero.
  rng = np.random.default_rng(4)
  low_rank = rng.normal(size=(80, 3)) @ rng.normal(size=(3, 1000))
  matrix = tf.constant(low_rank.T @ (low_rank @ rng.normal(size=(1000, 60))),
                       tf.float32)
  for loop_free in (False, True):
    q = GEP_MODULE._orthonormalize(matrix, loop_free).numpy()  # pylint: disable=protected-access
    np.testing.assert_allclose(q.T.astype(np.float64) @ q, np.eye(60),
                               atol=1e-5)
    residual = low_rank - (low_rank @ q) @ q.T
    assert np.linalg.norm(residual) < 1e-4 * np.linalg.norm(low_rank)
    zero = GEP_MODULE._orthonormalize(tf.zeros([50, 7]), loop_free).numpy()  # pylint: disable=protected-access
    np.testing.assert_array_equal(zero, np.zeros([50, 7]))


@pytest.mark.parametrize('k', [1, 2, 30, 256])
def test_newton_schulz_steps_converge_at_the_shift(k):
  # A Gram matrix of rank one: k - 1 eigenvalues are the shift alone, the
  # slowest to converge. Diagonal, so that rounding of the large eigenvalue
  # does not move the small ones (in a rotated basis it does, by about
  # 1e-16 / GRAM_SHIFT relative, in any factorization). Two steps fewer
  # leave 1e-9 at k = 2.
  gram = np.zeros((k, k))
  gram[0, 0] = 1.0
  got = GEP_MODULE._inverse_sqrt(  # pylint: disable=protected-access
      tf.constant(gram), GEP_MODULE.newton_schulz_steps(k)).numpy()
  shift = GEP_MODULE.GRAM_SHIFT + 1e-30
  np.testing.assert_allclose(np.diag(got), np.diag(gram + shift)**-0.5,
                             rtol=1e-12)
  np.testing.assert_array_equal(got, np.diag(np.diag(got)))


def test_groups_in_coordinates_batched_get_the_bases_they_get_alone():
  # The groups in the anchors' coordinates are factored as one batch, each
  # padded to the largest basis with zero columns: each group's coordinates
  # are those of the same passes on that group alone.
  privatizer = privatizers.gep(60, 1.0, 1.0, 1.0, groups=[[0], [1], [2]])
  public = gradients.as_per_example_gradients(_grads(5, M))
  segments = privatizer._segments(public.shapes)  # pylint: disable=protected-access
  ks = allocate_bases([600, 30, 370], 60, M)
  assert len(set(ks)) == 3  # Padded by different numbers of columns.
  together, grams = privatizer._coordinates(  # pylint: disable=protected-access
      public, KEY, segments, [0, 1, 2], ks)
  for j, (w, gram) in enumerate(zip(together, grams)):
    (alone,), (gram_alone,) = privatizer._coordinates(  # pylint: disable=protected-access
        public, KEY, segments, [j], [ks[j]])
    np.testing.assert_array_equal(gram.numpy(), gram_alone.numpy())
    assert w.shape == (M, ks[j])
    np.testing.assert_allclose(w.numpy(), alone.numpy(), rtol=0,
                               atol=1e-9 * np.abs(alone.numpy()).max())


def test_loop_free_bases_release_what_cholesky_qr_bases_release(monkeypatch):
  # The same Gaussian start as the explicit form's (its public substream) and
  # an orthonormal basis of the same span: at zero noise the same release,
  # with both parts clipped.
  monkeypatch.setattr(gradients.MaterializedGradients, 'cross_gram_forms',
                      lambda self, other: [False] * len(self.shapes))
  grads, public = _grads(20, N, tf.float64), _grads(21, M, tf.float64)
  releases = []
  for loop_free in (False, True):
    privatizer = privatizers.gep(60, 0.5, 0.3, 0.0, num_groups=3,
                                 loop_free=loop_free)
    out, _ = privatizer.update(grads, {}, KEY, public_grads=public)
    releases.append(_flat([o[np.newaxis] for o in out]))
  cholesky_qr, loop_free = releases
  assert (np.linalg.norm(loop_free - cholesky_qr) <=
          1e-5 * np.linalg.norm(cholesky_qr))
  assert np.linalg.norm(cholesky_qr) > 1.0  # The clips hold the release.
