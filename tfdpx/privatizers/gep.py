"""GEP: gradient embedding perturbation with public anchor gradients.

Each step finds a low-dimensional subspace from per-example gradients of
public data (the anchors), splits every private per-example gradient into its
embedding in that subspace and the residual, and releases both parts, each
clipped and noised, from the same sampled batch. Spec: shared/specs/gep.md.
"""

import contextlib
import math
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import dp_accounting
import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import gradients
from tfdpx import noise
from tfdpx import projections
from tfdpx import xla

DEFAULT_NUM_GROUPS = 3  # The official code's `--num_groups` (spec §5.1 D1).

NO_PUBLIC_DATA_HELP = (
    'GEP needs per-example gradients of public data (`public_grads`) to find '
    'its subspace, and none were given. Train a model made private with '
    'public data (tfdpx.keras.make_private(model, public_data=...)) or pass '
    'public_grads to optimizer.privatize. The public examples must be '
    'non-sensitive and disjoint from the private training set: data-'
    'independent synthetic inputs, or a held-out part of the private data '
    'that you give up protecting, both work. Never build the subspace from '
    'the private gradients themselves; without public data use DP-SGD '
    '(tfdpx.privatizers.gaussian). See spec gep.md §3.6.')

# A segment is (variable index, start, stop) in that variable's flat layout.
Segment = Tuple[int, int, int]


def allocate_bases(group_sizes: Sequence[int], num_bases: int,
                   num_public: Optional[int] = None) -> List[int]:
  """Basis sizes per group: `k_j = floor(k sqrt(p_j) / sum_l sqrt(p_l))`.

  Each `k_j` is then clamped to `min(p_j, m)`: the anchor matrix has rank at
  most `m`, so more basis vectors would only carry noise (spec §1.5, §5.2 A6).

  Args:
    group_sizes: parameter count `p_j` of each group, all >= 1.
    num_bases: total basis size `k` before rounding and clamping.
    num_public: number `m` of anchor gradients, or `None` if unknown.

  Returns:
    The list of `k_j`; their sum is at most `num_bases`.
  """
  roots = [math.sqrt(p) for p in group_sizes]
  total = sum(roots)
  sizes = []
  for p, root in zip(group_sizes, roots):
    k = int(math.floor(num_bases * root / total))
    k = min(k, p)
    if num_public is not None:
      k = min(k, num_public)
    sizes.append(k)
  return sizes


def _group_segments(var_sizes: Sequence[int], num_groups: Optional[int],
                    groups: Optional[Sequence[Sequence[int]]]
                   ) -> List[List[Segment]]:
  """The flat segments of each parameter group (spec §1.5)."""
  if groups is not None:
    indices = sorted(i for group in groups for i in group)
    if indices != list(range(len(var_sizes))):
      raise ValueError(
          f'groups must partition the variable indices 0..{len(var_sizes) - 1}'
          f' (each exactly once), got {groups!r}')
    return [[(v, 0, var_sizes[v]) for v in group] for group in groups]
  total = sum(var_sizes)
  if num_groups > total:
    raise ValueError(
        f'num_groups={num_groups} is larger than the number of parameters '
        f'({total})')
  bounds = [(i * total) // num_groups for i in range(num_groups + 1)]
  offsets = [0]
  for size in var_sizes:
    offsets.append(offsets[-1] + size)
  segments = []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    group = []
    for v, size in enumerate(var_sizes):
      start, stop = max(lo, offsets[v]), min(hi, offsets[v] + size)
      if start < stop:
        group.append((v, start - offsets[v], stop - offsets[v]))
    segments.append(group)
  return segments


def _group_sizes(segments: Sequence[Sequence[Segment]]) -> List[int]:
  """The parameter count `p_j` of each group."""
  return [sum(stop - start for _, start, stop in group) for group in segments]


def _window(shape: tf.TensorShape, start: int, stop: int
           ) -> Tuple[Optional[Tuple[int, int]], int, List[int]]:
  """The slices of a variable's first axis that hold its flat `[start, stop)`.

  Returns `(rows, first, window_shape)`: the range of the first axis (None
  for a scalar variable), the flat index where it begins, and its shape. The
  engine then works on those slices only (`PerExampleGradients.dots` and
  `weighted_sums` with `rows`), not on the whole variable for every group.
  """
  if shape.rank == 0:
    return None, 0, []
  per_row = int(shape.num_elements()) // shape[0]
  first, last = start // per_row, -(-stop // per_row)
  return (first, last), first * per_row, [last - first] + shape.as_list()[1:]


# Explicit bases whose `[p_j, k_j]` entries, over all groups, take at most
# this many float32 bytes run side by side: chaining them (`_after`) cost
# the tutorial CNN's step 10% (its groups' bases are 0.6 MiB each).
SIDE_BY_SIDE_BYTES = 16 * 2**20


def _after(tensors: Sequence[tf.Tensor], basis_entries: int):
  """Runs what is built in the context after `tensors` (in a graph), unless
  the explicit bases have at most `SIDE_BY_SIDE_BYTES` of entries in all.

  The groups are independent, so a graph would run them side by side with
  all their `[p_j, k_j]` temporaries alive at once (measured: 3x the memory
  of one group on the text model); chained, one group's are alive at a time.
  """
  if 4 * basis_entries <= SIDE_BY_SIDE_BYTES:
    return contextlib.nullcontext()
  return tf.control_dependencies([t for t in tensors if t is not None])


def _directions(basis: tf.Tensor, group: Sequence[Segment],
                shapes: Sequence[tf.TensorShape]) -> List[tf.Tensor]:
  """A group's basis as directions: per segment, `[k_j, *window]`.

  The basis columns restricted to the segment, on the slices of the
  variable's first axis that hold it (`_window`; zero elsewhere in them):
  the layout `PerExampleGradients.dots` takes with `rows`.
  """
  directions, offset = [], 0
  for v, start, stop in group:
    columns = tf.transpose(basis[offset:offset + stop - start])
    _, first, window = _window(shapes[v], start, stop)
    size = math.prod(window)
    directions.append(tf.reshape(
        tf.pad(columns, [[0, 0], [start - first, first + size - stop]]),
        [-1, *window]))
    offset += stop - start
  return directions


def _embeddings(grads: gradients.PerExampleGradients,
                directions: Sequence[tf.Tensor],
                group: Sequence[Segment]) -> tf.Tensor:
  """`B_j^T g_j` of one group, float32 `[B, k_j]`, from per-variable dots
  with its `_directions`."""
  shapes = grads.shapes
  if directions[0].shape[0] == 0:  # A group given no basis vector.
    return tf.zeros([grads.batch_size(), 0])
  per_variable, rows = [None] * len(shapes), [None] * len(shapes)
  for (v, start, stop), d in zip(group, directions):
    rows[v] = _window(shapes[v], start, stop)[0]
    per_variable[v] = d
  return tf.add_n([d for d in grads.dots(per_variable, rows)
                   if d is not None])


def _anchor_sums(public: gradients.PerExampleGradients, weights: tf.Tensor,
                 group: Sequence[Segment]) -> tf.Tensor:
  """`A_j^T Y_j` (`[p_j, k_j]`) of one group for its `Y_j` (`[m, k_j]`).

  Weighted sums of the slices of the variables that hold the group's
  segments only.
  """
  rows, firsts = [None] * len(public.shapes), {}
  for v, start, stop in group:
    rows[v], firsts[v], _ = _window(public.shapes[v], start, stop)
  sums = public.weighted_sums(weights, rows)
  dtype = sums[group[0][0]].dtype
  return tf.concat(
      [tf.transpose(tf.cast(
          tf.reshape(sums[v], [weights.shape[1], -1])[:, a - firsts[v]:
                                                      b - firsts[v]], dtype))
       for v, a, b in group], axis=0)


def _spans(group: Sequence[Segment], count: int) -> gradients.Spans:
  """Per variable (of `count`), the flat range the group holds, or None."""
  spans = [None] * count
  for v, start, stop in group:
    spans[v] = (start, stop)
  return spans


def _cross_gram(grads: gradients.PerExampleGradients,
                anchors: gradients.PerExampleGradients,
                group: Sequence[Segment], dtype: tf.DType) -> tf.Tensor:
  """`G_j A_j^T` of one group: `[B, m]` inner products with the anchors."""
  return grads.cross_gram(anchors, _spans(group, len(grads.shapes)), dtype)


class _Subspace(NamedTuple):
  """One group's basis `B_j` (`[p_j, k_j]`, orthonormal columns).

  Or, as `basis_refresh_steps` > 1 keeps it in the state, `directions`
  (`_directions` of the basis) with `gram`, its `B_j^T B_j` (float32
  `[k_j, k_j]`) as computed with the basis.

  Either `basis` itself, or `B_j = A_j^T W_j` in the anchors' coordinates:
  `coordinates` `W_j` (float64 `[m, k_j]`) and `anchor_gram` `K_j = A_j
  A_j^T` (float64 `[m, m]`), when the engine has cross Gram forms for every
  variable of the group (Dense layers on vectors, embeddings). The basis is
  then never formed: `B_j^T g = W_j^T (A_j g)`, `B_j^T B_j = W_j^T K_j W_j`,
  and `B_j v` is one weighted sum of the anchors.
  """
  basis: Optional[tf.Tensor] = None
  coordinates: Optional[tf.Tensor] = None
  anchor_gram: Optional[tf.Tensor] = None
  directions: Optional[List[tf.Tensor]] = None
  gram: Optional[tf.Tensor] = None


class _Plan(NamedTuple):
  """What a step fixes from public data before it reads private data.

  `public`: the anchors' gradients, where a subspace is in their
  coordinates (None when every basis is explicit).
  """
  shapes: List[tf.TensorShape]
  public: Optional[gradients.PerExampleGradients]
  segments: List[List[Segment]]
  subspaces: List[_Subspace]


def _gather(flat: Sequence[tf.Tensor], segments: Sequence[Segment]
           ) -> tf.Tensor:
  """`[rows, p_j]`: the columns of one group from per-variable `[rows, p_v]`."""
  pieces = [flat[v][:, start:stop] for v, start, stop in segments]
  return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=1)


def _scatter(group_vectors: Sequence[tf.Tensor],
             segments: Sequence[Sequence[Segment]],
             shapes: Sequence[tf.TensorShape]) -> List[tf.Tensor]:
  """Inverse of `_gather` for one vector per group: one tensor per variable."""
  pieces = [[] for _ in shapes]
  for vector, group in zip(group_vectors, segments):
    offset = 0
    for v, start, stop in group:
      pieces[v].append((start, vector[offset:offset + stop - start]))
      offset += stop - start
  out = []
  for parts, shape in zip(pieces, shapes):
    parts = [p for _, p in sorted(parts, key=lambda item: item[0])]
    flat = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
    out.append(tf.reshape(flat, shape))
  return out


# Passes of shifted Cholesky QR (`_orthonormalize`): the first brings any
# basis close to orthonormal, the next two make it orthonormal to float32
# rounding (Fukaya et al., "Shifted Cholesky QR", SIAM J. Sci. Comput. 2020).
CHOLESKY_QR_PASSES = 3


# Smallest eigenvalue of a pass's Gram matrix `X^T X` that the pass
# resolves, relative to its trace: the shift `s` of both forms of a pass.
GRAM_SHIFT = 1e-13


def _gram_shift(gram: tf.Tensor) -> tf.Tensor:
  """`s` (`[..., 1, 1]`) for `gram + s I`: far above float64 rounding of the
  Gram matrix; its floor keeps an all-zero matrix at zero (the inverse
  factors stay finite in float32)."""
  return (GRAM_SHIFT * tf.linalg.trace(gram) + 1e-30)[..., tf.newaxis,
                                                      tf.newaxis]


def _inverse_factor(gram: tf.Tensor) -> tf.Tensor:
  """`L^-1` (float64 `[..., k, k]`) for `L L^T = gram + s I`, `R = L^T`."""
  eye = tf.eye(gram.shape[-1], dtype=tf.float64)
  lower = tf.linalg.cholesky(gram + _gram_shift(gram) * eye)
  return tf.linalg.triangular_solve(lower, tf.broadcast_to(eye, tf.shape(gram)),
                                    lower=True)


def newton_schulz_steps(k: int) -> int:
  """Steps of `_inverse_sqrt` that converge for every eigenvalue of a
  `[k, k]` shifted Gram matrix. Each step maps an eigenvalue `x` of
  `Z Y` to `x (3 - x)^2 / 4`; scaled by its largest row sum (at most `sqrt(k)`
  times its largest eigenvalue), the smallest is at least
  `GRAM_SHIFT / sqrt(k)`: counted from there to 1 within float64 rounding."""
  x, steps = GRAM_SHIFT / (math.sqrt(k) * (1 + GRAM_SHIFT)), 0
  while 1 - x > 1e-15:
    x, steps = x * (3 - x)**2 / 4, steps + 1
  return steps


# Steps of the loop-free form's third pass: its Gram matrix is the identity
# to float32 rounding of the basis, where each step squares the error.
POLISH_STEPS = 6


def _inverse_sqrt(gram: tf.Tensor, steps: int) -> tf.Tensor:
  """`(gram + s I)^-1/2` (float64 `[..., k, k]`) by matrix products only.

  The coupled Newton-Schulz iteration (Higham, "Functions of Matrices",
  2008, §6.7): `T = (3I - Z Y) / 2`, `Y <- Y T`, `Z <- T Z` from `Y = S / c`,
  `Z = I` gives `Z -> (S / c)^-1/2` for the symmetric positive definite
  `S = gram + s I` with eigenvalues in `(0, c]` (`c` its largest row sum), and
  is stable in floating point. XLA lowers a Cholesky factorization to loops
  over columns (on a GPU a few kernel launches per column); this is a fixed
  sequence of `[k, k]` products.
  """
  eye = tf.eye(gram.shape[-1], dtype=tf.float64)
  shifted = gram + _gram_shift(gram) * eye
  scale = tf.reduce_max(tf.reduce_sum(tf.abs(shifted), -1), -1)[
      ..., tf.newaxis, tf.newaxis]
  y, z = shifted / scale, tf.broadcast_to(eye, tf.shape(gram))
  for _ in range(steps):
    t = 1.5 * eye - 0.5 * tf.matmul(z, y)
    y, z = tf.matmul(y, t), tf.matmul(t, z)
  return z / tf.sqrt(scale)


def _orthonormalize(matrix: tf.Tensor, loop_free: bool = False) -> tf.Tensor:
  """Orthonormal columns spanning `matrix`'s columns, as in its QR factor.

  `Q = X R^-1` with `R^T R = X^T X + s I` (Cholesky of the float64 Gram
  matrix, a small shift `s` keeping it positive definite), three times. For a
  full-rank `X` this is the QR factor whose `R` has a positive diagonal,
  unique, so eager and XLA kernels give the same basis; it costs two
  `[p, k] x [k, k]` products per pass, where TensorFlow's Householder QR of a
  tall matrix is about five times slower. A rank-deficient `X` (dependent
  anchors) can leave columns that are not orthonormal: `update` never relies
  on orthonormality for privacy (the residual norm uses `B^T B`).

  `loop_free`: `Q = X (X^T X + s I)^-1/2` (`_inverse_sqrt`) instead, from
  matrix products only: the polar factor, another orthonormal basis of the
  same span (the projector `Q Q^T`, and so every release, is the same).
  Three passes: the first makes the directions that `X^T X` resolves
  orthonormal, the second also those it left shrunk near the shift (as
  Cholesky QR's later passes do), the third polishes rounding.
  Each product with the `[k, k]` factor is summed in float64: unlike the
  triangular factor, the polar one mixes every column, and its entries for
  dependent columns (up to `1 / sqrt(s)`) would spread their float32
  rounding over the directions the anchors span.
  """
  q = matrix
  if loop_free:
    steps = newton_schulz_steps(matrix.shape[-1])
    for pass_steps in (steps, steps, POLISH_STEPS):
      q = _times64(q, _inverse_sqrt(_gram64(q), pass_steps))
    return q
  for _ in range(CHOLESKY_QR_PASSES):
    q = tf.matmul(q, tf.cast(_inverse_factor(_gram64(q)), q.dtype),
                  transpose_b=True)
  return q


# Rows of the diagonal blocks `_cholesky` factors one at a time.
CHOLESKY_BLOCK = 64


def _cholesky(matrix: tf.Tensor) -> tf.Tensor:
  """`tf.linalg.cholesky` of `[..., m, m]` matrices, under XLA by blocks of
  64 rows.

  The same factor (right-looking blocked Cholesky: each diagonal block, then
  a triangular solve for the panel below it). XLA's CPU kernel takes 45 ms
  for m = 256 against 1.3 ms for m = 64 (2-core machine). Without XLA the
  blocks only add ops: TensorFlow's kernel factors the whole matrix.
  """
  m = matrix.shape[-1]
  if m is None or m <= CHOLESKY_BLOCK or not xla.in_xla():
    return tf.linalg.cholesky(matrix)
  transpose = tf.linalg.matrix_transpose
  columns = []  # Each block column of the factor, rows j*b onwards.
  for start in range(0, m, CHOLESKY_BLOCK):
    stop = min(m, start + CHOLESKY_BLOCK)
    panel = matrix[..., start:, start:stop]
    for column in columns:  # Minus the blocks to the left: L_i L_j^T.
      done = m - column.shape[-2]
      panel -= tf.matmul(column[..., start - done:, :],
                         column[..., start - done:stop - done, :],
                         transpose_b=True)
    diagonal = tf.linalg.cholesky(panel[..., :stop - start, :])
    below = transpose(tf.linalg.triangular_solve(
        diagonal, transpose(panel[..., stop - start:, :]), lower=True))
    columns.append(tf.concat([diagonal, below], axis=-2))
  batch = [[0, 0]] * (matrix.shape.rank - 2)
  return tf.concat([tf.pad(c, batch + [[m - c.shape[-2], 0], [0, 0]])
                    for c in columns], axis=-1)


# Relative shift of the anchors' Gram matrix `K` in their coordinates: far
# above float64 rounding of `K` (so that `K + s I` is positive definite
# whatever the anchors), far below any direction the basis keeps.
ANCHOR_GRAM_SHIFT = 1e-12
# Largest `|A|_F |w_c|` of a basis column kept in the anchors' coordinates.
MAX_AMPLIFICATION = 2.0**10


def _orthonormalize_coordinates(factor: tf.Tensor,
                                coordinates: tf.Tensor) -> tf.Tensor:
  """`_orthonormalize(A^T W)` as `A^T W'`: returns `W'` (float64 `[..., m,
  k]`, a batch of groups' factors and `W` at once).

  `factor` is `L` (`[..., m, m]`, lower triangular), `L L^T = K + s I` for
  `K = A A^T`. An `A` with that Gram matrix is `L Q_A^T` with orthonormal
  `Q_A` (`[p, m]`), so `A^T W = Q_A (L^T W)`: the QR factor of `A^T W` is
  `Q_A` times that of the small `L^T W = Q R`, and `W' = L^-T Q`. The same
  basis as shifted Cholesky QR's passes on `W^T (K + s I) W` give (the `R`
  with a positive diagonal is unique), from one Householder QR of an `[m,
  k]` matrix and one triangular solve, at a cost in `m` (anchors), not in
  `p_j` (parameters).
  """
  q, r = tf.linalg.qr(tf.matmul(factor, coordinates, transpose_a=True))
  # Householder QR leaves the signs of R's diagonal free: made positive.
  signs = tf.where(tf.linalg.diag_part(r) < 0, -1.0, 1.0)
  return tf.linalg.triangular_solve(
      factor, q * tf.cast(signs, q.dtype)[..., tf.newaxis, :], lower=True,
      adjoint=True)


# Rows of a `[p, k]` matrix cast to float64 at a time for its Gram matrix:
# a whole float64 copy of a group's basis is twice the basis (55 MiB per
# group on the text model's embedding table).
GRAM_BLOCK_ROWS = 2**16


def _blocks64(matrix: tf.Tensor) -> List[tf.Tensor]:
  """A `[p, k]` matrix's blocks of rows, each cast to float64."""
  return [tf.cast(matrix[start:start + GRAM_BLOCK_ROWS], tf.float64)
          for start in range(0, matrix.shape[0], GRAM_BLOCK_ROWS)]


def _gram64(matrix: tf.Tensor) -> tf.Tensor:
  """`X^T X` (`[k, k]`, float64) of a `[p, k]` matrix, block by block."""
  return tf.add_n([tf.matmul(block, block, transpose_a=True)
                   for block in _blocks64(matrix)])


def _times64(matrix: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
  """`X F` (`X`'s dtype) of a `[p, k]` matrix and a float64 `[k, k]` one,
  summed in float64 block by block."""
  return tf.concat([tf.cast(tf.matmul(block, factor), matrix.dtype)
                    for block in _blocks64(matrix)], axis=0)


def gpu_visible() -> bool:
  """Whether TensorFlow sees a GPU: GEP's form when `loop_free` is None."""
  return bool(tf.config.list_logical_devices('GPU'))


def _entries(sub: _Subspace) -> int:
  """Entries of a group's explicit basis (0 in the anchors' coordinates)."""
  if sub.coordinates is not None:
    return 0
  if sub.basis is not None:
    return sub.basis.shape.num_elements()
  return sum(d.shape.num_elements() for d in sub.directions)


def _flat(per_example: Sequence[tf.Tensor]) -> List[tf.Tensor]:
  return [tf.reshape(g, [tf.shape(g)[0], -1]) for g in per_example]


def _basis_gram(sub: _Subspace) -> tf.Tensor:
  """`B^T B` (`[k, k]`, float32) of a group's basis, summed in float64."""
  if sub.gram is not None:
    return sub.gram
  if sub.basis is not None:
    return tf.cast(_gram64(sub.basis), tf.float32)
  return tf.cast(tf.matmul(sub.coordinates,
                           tf.matmul(sub.anchor_gram, sub.coordinates),
                           transpose_a=True), tf.float32)


def _explicit_basis(public: gradients.PerExampleGradients, sub: _Subspace,
                    group: Sequence[Segment]) -> tf.Tensor:
  """`B_j` itself (`[p_j, k_j]`), formed from the anchors if need be."""
  if sub.basis is not None:
    return sub.basis
  return _anchor_sums(public, tf.cast(sub.coordinates,
                                      public.dtypes[group[0][0]]), group)


def _lift(public: Optional[gradients.PerExampleGradients], sub: _Subspace,
          group: Sequence[Segment], shapes: Sequence[tf.TensorShape],
          vector: tf.Tensor) -> tf.Tensor:
  """`B_j v` (`[p_j]`) for `v` (`[k_j]`): of the basis, of its directions or
  of the anchors."""
  if sub.directions is not None:
    pieces = []
    for (v, start, stop), d in zip(group, sub.directions):
      first = _window(shapes[v], start, stop)[1]
      window = tf.reshape(tf.tensordot(tf.cast(vector, d.dtype), d, 1), [-1])
      pieces.append(window[start - first:stop - first])
    return tf.concat(pieces, axis=0)
  if sub.basis is not None:
    return tf.linalg.matvec(sub.basis, tf.cast(vector, sub.basis.dtype))
  weights = tf.linalg.matvec(sub.coordinates, tf.cast(vector, tf.float64))
  dtype = public.dtypes[group[0][0]]
  return _anchor_sums(public, tf.cast(weights, dtype)[:, tf.newaxis],
                      group)[:, 0]


@core.register
class GEP(core.Privatizer):
  """Gradient embedding perturbation (GEP) and its biased variant (B-GEP).

  Per step (spec §1.3): for each parameter group `j`, one power-method step (or
  `power_iterations`) on the public anchor gradients `A_j` (`[m, p_j]`) from a
  fresh Gaussian start gives an orthonormal basis `B_j` of `k_j` directions
  (shifted Cholesky QR, `_orthonormalize`). Where the engine has cross Gram
  forms for every variable of the group (Dense layers on vectors,
  embeddings), the group works in the anchors' coordinates instead
  (`_Subspace`, docs/gep.md): `B_j = A_j^T W_j`, never formed; unless
  `loop_free` (the default on a GPU), where every basis is explicit and
  orthonormalized by matrix products only. Each private per-example gradient
  `G_i` is split into its embedding `W_i = [G_i B_j^T]_j` (length
  `K = sum_j k_j`) and the residual `R_i = G_i - W_i B` (from the unclipped
  embedding). `W_i` is clipped to `embedding_l2_norm_clip` (S1) and `R_i` to
  `residual_l2_norm_clip` (S2), each as one vector over all groups; both sums
  get Gaussian noise, and the output is `w~ B + r~` (GEP) or `w~ B` (B-GEP,
  `biased=True`; the residual is then neither computed nor released).

  The public gradients arrive as `public_grads` in `update`: a
  `tfdpx.gradients.PerExampleGradients` with the private ones' layout (or one
  `[m, *var.shape]` tensor per variable), asked only for dots and weighted
  sums. The basis depends only on them and on a public random stream of the
  step's seed.

  Privacy:
    Each example's embedding is clipped to global L2 norm S1 and its residual
    to S2. The embedding sum gets N(0, (sigma_1 S1)^2) noise per coordinate and
    the residual sum N(0, (sigma_2 S2)^2), both on the same sampled batch: one
    step is one Gaussian mechanism with effective noise multiplier
    `sigma_eff = (sigma_1^-2 + sigma_2^-2)^-1/2` (spec §3.2), so `dp_event` is
    `GaussianDpEvent(sigma_eff)`; B-GEP releases only the embedding, so its
    event is `GaussianDpEvent(sigma_1)`. By default `noise_multiplier` is
    `sigma_eff` (GEP: `sigma_1 = sigma_2 = sqrt(2) noise_multiplier`; B-GEP:
    `sigma_1 = noise_multiplier`), so a step costs what a DP-SGD step with
    `noise_multiplier` costs. Adjacency: add or remove one example (the
    sensitivities are S1 and S2). The basis costs nothing only because the
    anchors are public and disjoint from the private data (spec §3.6); one
    kept for several steps (`basis_refresh_steps`) is a function of the
    anchors and of the weights of its refresh step, earlier releases, so
    the event is the same. The
    official code's accountant doubles the subsampled RDP, which understates
    epsilon (spec §3.3); tfdpx does not offer that accounting. The residual
    sum is formed as a weighted sum of whole gradients minus their part in the
    subspace; an example whose whole gradient exceeds 1024 S2 is also scaled
    to that norm, so that float rounding of the subtraction stays far below
    S2 (`clipping.bound_for_subtraction`; a scaling by at most 1, so the
    sensitivities are unchanged). The residual's norm, a difference of
    squared norms rounded at the scale of |g|^2, is rounded up by
    `2^-16 |g|^2` (`clipping.part_norms`), so its clip holds in float32; in
    the anchors' coordinates `|g|` is replaced by `|g| + |A_j|_F |W_j w|`
    in both bounds, the scale of the terms there.

  References:
    Yu, Zhang, Chen, Liu, "Do Not Let Privacy Overbill Utility: Gradient
    Embedding Perturbation for Private Learning", ICLR 2021.
  """

  name = 'gep'
  requires_public_grads = True

  def __init__(self,
               num_bases: int,
               embedding_l2_norm_clip: float,
               residual_l2_norm_clip: float,
               noise_multiplier: Optional[float] = None,
               *,
               embedding_noise_multiplier: Optional[float] = None,
               residual_noise_multiplier: Optional[float] = None,
               num_groups: Optional[int] = None,
               groups: Optional[Sequence[Sequence[int]]] = None,
               power_iterations: int = 1,
               basis_refresh_steps: int = 1,
               biased: bool = False,
               loop_free: Optional[bool] = None):
    """Args:
      num_bases: total basis size k, split over the groups in proportion to
        `sqrt(p_j)` and clamped to `min(p_j, m)` per group; an integer >= 1.
      embedding_l2_norm_clip: S1, clip norm of each example's embedding, > 0
        (`inf` allowed). The paper's code uses 5 (the paper's text 10).
      residual_l2_norm_clip: S2, clip norm of each example's residual, > 0
        (`inf` allowed); the paper uses 2. Ignored by B-GEP.
      noise_multiplier: effective noise multiplier of the whole step, >= 0.
        Required unless the per-part multipliers are given.
      embedding_noise_multiplier: sigma_1, noise std of the embedding sum over
        S1. Give it (and for GEP `residual_noise_multiplier`) to override the
        default split; `dp_event` then reports their `sigma_eff`.
      residual_noise_multiplier: sigma_2, noise std of the residual sum over
        S2 (GEP only).
      num_groups: split the concatenated parameters into this many equal
        contiguous flat ranges (cutting variables where needed), as the
        official code does. Default 3 unless `groups` is given.
      groups: layer-aligned groups instead: a list of lists of variable
        indices (in `var_list` order) that partitions all variables.
      power_iterations: power-method steps per update, >= 1 (the paper: 1).
      basis_refresh_steps: compute the bases on every this many steps (the
        first included) and keep them in the state for the steps in
        between, which then form no anchor gradients; >= 1 (the paper: 1,
        a new basis every step). Whichever step computed it, a basis is a
        function of public data, a public random stream and the weights
        (earlier releases), so the event per step is the same.
      biased: B-GEP: release only the embedding.
      loop_free: build every basis from matrix products only, which XLA runs
        on a GPU without loops: every group's basis explicitly (`p_j x k_j`,
        no anchors' coordinates, whose Gaussian start needs a Cholesky
        factor of `K`) and orthonormalized by Newton-Schulz passes instead of
        Cholesky QR (`_orthonormalize`). Same distribution of the basis, same
        releases for a given basis span; more work on a CPU. Default (None):
        when TensorFlow sees a GPU as the step is traced.

    Raises:
      ValueError: naming the argument that is out of range or inconsistent.
    """
    if int(num_bases) != num_bases or num_bases < 1:
      raise ValueError(f'num_bases must be an integer >= 1, got {num_bases!r}')
    if (int(power_iterations) != power_iterations or
        power_iterations < 1):
      raise ValueError(
          f'power_iterations must be an integer >= 1, got {power_iterations!r}')
    if (int(basis_refresh_steps) != basis_refresh_steps or
        basis_refresh_steps < 1):
      raise ValueError('basis_refresh_steps must be an integer >= 1, got '
                       f'{basis_refresh_steps!r}')
    if groups is not None and num_groups is not None:
      raise ValueError('pass num_groups or groups, not both')
    if groups is not None:
      try:
        groups = [[int(v) for v in group] for group in groups]
      except (TypeError, ValueError):
        raise ValueError(
            f'groups must be a list of lists of variable indices, got '
            f'{groups!r}') from None
      flat = [v for group in groups for v in group]
      if (not groups or any(not group for group in groups) or
          min(flat) < 0 or len(set(flat)) != len(flat)):
        raise ValueError(
            'groups must be non-empty lists of distinct non-negative variable '
            f'indices, got {groups!r}')
    else:
      num_groups = DEFAULT_NUM_GROUPS if num_groups is None else num_groups
      if int(num_groups) != num_groups or num_groups < 1:
        raise ValueError(
            f'num_groups must be an integer >= 1, got {num_groups!r}')
      num_groups = int(num_groups)
    self._num_bases = int(num_bases)
    self._s1 = core.check_positive('embedding_l2_norm_clip',
                                   embedding_l2_norm_clip)
    self._s2 = core.check_positive('residual_l2_norm_clip',
                                   residual_l2_norm_clip)
    self._num_groups = num_groups
    self._groups = groups
    self._power_iterations = int(power_iterations)
    self._refresh_steps = int(basis_refresh_steps)
    self._biased = bool(biased)
    if loop_free not in (None, True, False):
      raise ValueError(f'loop_free must be None, True or False, got '
                       f'{loop_free!r}')
    self._loop_free = None if loop_free is None else bool(loop_free)
    self._sigma1, self._sigma2, self._explicit = self._split(
        noise_multiplier, embedding_noise_multiplier,
        residual_noise_multiplier)

  def _split(self, noise_multiplier, sigma1, sigma2):
    """(sigma_1, sigma_2, explicit) from the constructor's multipliers."""
    if self._biased:
      if sigma2 is not None:
        raise ValueError(
            'residual_noise_multiplier must be None with biased=True: B-GEP '
            'releases no residual')
      if sigma1 is None:
        if noise_multiplier is None:
          raise ValueError(
              'pass noise_multiplier or embedding_noise_multiplier')
        return core.check_positive('noise_multiplier', noise_multiplier,
                                   allow_zero=True), None, False
      sigma1 = core.check_positive('embedding_noise_multiplier', sigma1,
                                   allow_zero=True)
      effective = sigma1
    else:
      if (sigma1 is None) != (sigma2 is None):
        raise ValueError(
            'pass both embedding_noise_multiplier and '
            'residual_noise_multiplier, or neither')
      if sigma1 is None:
        if noise_multiplier is None:
          raise ValueError(
              'pass noise_multiplier, or embedding_noise_multiplier and '
              'residual_noise_multiplier')
        z = core.check_positive('noise_multiplier', noise_multiplier,
                                allow_zero=True)
        # Equal multipliers whose sigma_eff is z (spec §3.2, §5.2 A14).
        return math.sqrt(2.0) * z, math.sqrt(2.0) * z, False
      sigma1 = core.check_positive('embedding_noise_multiplier', sigma1,
                                   allow_zero=True)
      sigma2 = core.check_positive('residual_noise_multiplier', sigma2,
                                   allow_zero=True)
      effective = effective_noise_multiplier(sigma1, sigma2)
    if noise_multiplier is not None:
      z = core.check_positive('noise_multiplier', noise_multiplier,
                              allow_zero=True)
      if not math.isclose(z, effective, rel_tol=1e-9, abs_tol=1e-12):
        raise ValueError(
            f'noise_multiplier={noise_multiplier!r} contradicts the per-part '
            f'multipliers, whose effective multiplier is {effective!r}; pass '
            'one or the other')
    return sigma1, sigma2, True

  # --- hyperparameters -------------------------------------------------------

  @property
  def config(self) -> Dict[str, Any]:
    return {
        'num_bases': self._num_bases,
        'embedding_l2_norm_clip': self._s1,
        'residual_l2_norm_clip': self._s2,
        'noise_multiplier': self.noise_multiplier,
        'embedding_noise_multiplier':
            self._sigma1 if self._explicit else None,
        'residual_noise_multiplier':
            self._sigma2 if self._explicit else None,
        'num_groups': self._num_groups,
        'groups': self._groups,
        'power_iterations': self._power_iterations,
        'basis_refresh_steps': self._refresh_steps,
        'biased': self._biased,
        'loop_free': self._loop_free,
    }

  @property
  def noise_multiplier(self) -> float:
    """Effective noise multiplier of one step (`sigma_eff`)."""
    if self._biased:
      return self._sigma1
    return effective_noise_multiplier(self._sigma1, self._sigma2)

  @property
  def embedding_noise_multiplier(self) -> float:
    """sigma_1: noise std of the embedding sum in units of S1."""
    return self._sigma1

  @property
  def residual_noise_multiplier(self) -> Optional[float]:
    """sigma_2: residual noise std in units of S2 (None for B-GEP)."""
    return self._sigma2

  def with_noise_multiplier(self, noise_multiplier: float) -> 'GEP':
    """An equal privatizer with effective multiplier `noise_multiplier`.

    Explicit per-part multipliers keep their ratio and are scaled together.

    Raises:
      ValueError: if explicit multipliers include a zero (no ratio to keep).
    """
    config = {**self.config, 'noise_multiplier': float(noise_multiplier)}
    if self._explicit:
      current = self.noise_multiplier
      if current == 0:
        raise ValueError(
            'cannot rescale explicit noise multipliers that include a zero')
      scale = float(noise_multiplier) / current
      config['embedding_noise_multiplier'] = self._sigma1 * scale
      if not self._biased:
        config['residual_noise_multiplier'] = self._sigma2 * scale
      config['noise_multiplier'] = None
    return type(self).from_config(config)

  # --- the mechanism ---------------------------------------------------------

  def _segments(self, shapes):
    sizes = [int(s.num_elements()) for s in shapes]
    return _group_segments(sizes, self._num_groups, self._groups)

  def _gram_groups(self, segments, grads, public) -> List[bool]:
    """Per group, whether it can work in the anchors' coordinates
    (`_Subspace`): when the private and the anchor gradients have cross Gram
    forms for all its variables."""
    private, anchors = (grads.cross_gram_forms(public),
                        public.cross_gram_forms(public))
    return [all(private[v] and anchors[v] for v, _, _ in group)
            for group in segments]

  def _subspaces(self, public, seed, segments, grads) -> List[_Subspace]:
    """Each group's basis from public data only (see `bases`); `grads`, the
    private per-example gradients, decide which groups work in the anchors'
    coordinates (none in the loop-free form: its bases are all explicit)."""
    # Decided once per trace: every group's basis takes the same form.
    loop_free = gpu_visible() if self._loop_free is None else self._loop_free
    gram_groups = ([False] * len(segments) if loop_free else
                   self._gram_groups(segments, grads, public))
    num_public = tf.get_static_value(public.batch_size())
    sizes = _group_sizes(segments)
    ks = allocate_bases(sizes, self._num_bases, num_public)
    requested = allocate_bases(sizes, self._num_bases)
    if num_public is not None and max(requested) > num_public:
      warnings.warn(
          f'GEP: {num_public} anchor gradients cannot span more than '
          f'{num_public} directions per group; basis sizes {requested} are '
          f'clamped to {ks} (spec §5.2 A6)')
    subspaces = [None] * len(segments)
    in_coordinates = [j for j, k in enumerate(ks) if k and gram_groups[j]]
    if in_coordinates:
      for j, w, gram in zip(in_coordinates, *self._coordinates(
          public, seed, segments, in_coordinates,
          [ks[j] for j in in_coordinates])):
        subspaces[j] = _Subspace(coordinates=w, anchor_gram=gram)
    explicit = []  # The explicit bases built so far.
    entries = sum(size * k for j, (size, k) in enumerate(zip(sizes, ks))
                  if j not in in_coordinates)
    for j, (group, size, k) in enumerate(zip(segments, sizes, ks)):
      if subspaces[j] is not None:
        continue
      if k == 0:
        # Rounded down to no basis vector: the group is residual-only.
        subspaces[j] = _Subspace(basis=tf.zeros(
            [size, 0], public.dtypes[group[0][0]]))
        continue
      with _after(explicit[-1:], entries):
        # One power-method step (or more) from a Gaussian start, then
        # orthonormal columns (spec §1.4). All-zero anchors give an all-zero
        # basis, no subspace (spec §5.2 A5). Public randomness: float32
        # Box-Muller suffices (no privacy rests on its tails).
        basis = tf.cast(projections.standard_normal_f32(
            [size, k], noise.substream(seed, f'gep/basis/{j}')),
                        public.dtypes[group[0][0]])
        for _ in range(self._power_iterations):
          # (A^T A) Omega: A Omega are the anchors' dots with Omega's columns
          # and A^T Y weighted sums of the anchors: no [m, p_j] anchor
          # matrix is formed.
          basis = _orthonormalize(_anchor_sums(
              public, _embeddings(public, _directions(
                  basis, group, public.shapes), group), group),
                                  loop_free)
      explicit.append(basis)
      subspaces[j] = _Subspace(basis=basis)
    return subspaces

  def _coordinates(self, public, seed, segments, indices, ks
                  ) -> Tuple[List[tf.Tensor], List[tf.Tensor]]:
    """The bases of groups `indices` (of `segments`, with `ks` directions)
    in the anchors' coordinates, all at once.

    Returns per group `W_j` (float64 `[m, k_j]`) and `K_j = A_j A_j^T`
    (float64 `[m, m]`). The groups share their `m` anchors, so their
    factorizations run as one batch `[G, m, k_max]`, each group's columns
    past its `k_j` zero: a zero column stays exactly zero through every
    pass (its rows of the factors are those of `s I`) and leaves the other
    columns as they are alone.
    """
    grams = [_cross_gram(public, public, segments[j], tf.float64)
             for j in indices]
    gram = tf.stack(grams)
    m, k_max = tf.shape(gram)[1], max(ks)
    # A Omega (Omega Gaussian, [p_j, k_j]) has independent N(0, K) columns,
    # K = A A^T: drawn as L Z with L L^T = K, Z Gaussian [m, k_j] from the
    # group's public substream, neither Omega nor A Omega formed. Then A^T Y
    # is A^T W. K + s I: positive definite, so that directions K does not
    # resolve (dependent anchors) come out as near-zero columns of the basis
    # instead of a failed factorization.
    shifted = gram + (ANCHOR_GRAM_SHIFT * tf.linalg.trace(gram) + 1e-30
                     )[:, tf.newaxis, tf.newaxis] * tf.eye(m, dtype=tf.float64)
    start = tf.stack([
        tf.pad(projections.standard_normal_f32(
            tf.stack([m, k]), noise.substream(seed, f'gep/basis/{j}')),
               [[0, 0], [0, k_max - k]]) for j, k in zip(indices, ks)])
    factor = _cholesky(shifted)
    w = tf.matmul(factor, tf.cast(start, tf.float64))
    for step in range(self._power_iterations):
      if step:
        w = tf.matmul(gram, w)  # A B = A A^T W.
      w = _orthonormalize_coordinates(factor, w)
    # A column of B = A^T W is one of |A|_F |w_c| times the anchors' scale;
    # past MAX_AMPLIFICATION it is a direction the anchors do not span (below
    # 2^-20 of their energy, or not at all) and would only carry rounding of
    # that size: it is dropped (zero).
    resolved = (tf.linalg.trace(gram)[:, tf.newaxis] *
                tf.reduce_sum(tf.square(w), 1) <= MAX_AMPLIFICATION**2)
    w *= tf.cast(resolved, tf.float64)[:, tf.newaxis]
    return [w[i, :, :k] for i, k in enumerate(ks)], grams

  def bases(self, public_grads, seed: tf.Tensor,
            per_example_grads=None) -> List[tf.Tensor]:
    """The orthonormal basis of each group, from public data only.

    Args:
      public_grads: the anchors' per-example gradients: a
        `tfdpx.gradients.PerExampleGradients` (a model made private hands its
        engine's) or one `[m, *var.shape]` tensor per variable.
      seed: the step's int64 `[2]` seed; the power method's Gaussian start of
        group j comes from its public substream "gep/basis/j", never from a
        noise stream (`[p_j, k_j]` draws, or `[m, k_j]` in the anchors'
        coordinates).
      per_example_grads: the private gradients `update` gets with them
        (default: gradients of the anchors' kind). Only their cross Gram forms
        matter: they decide which groups work in the anchors' coordinates,
        which draws a different (equally distributed) Gaussian start.

    Returns:
      One `[p_j, k_j]` tensor per group with orthonormal columns (`B_j^T`),
      or all zeros for a group whose anchor gradients are all zero (that group
      is then residual-only). Formed here for inspection; `update` forms no
      basis of a group that works in the anchors' coordinates.
    """
    public = gradients.as_per_example_gradients(public_grads)
    grads = (public if per_example_grads is None else
             gradients.as_per_example_gradients(per_example_grads))
    segments = self._segments(public.shapes)
    subspaces = self._subspaces(public, seed, segments, grads)
    return [_explicit_basis(public, sub, group)
            for sub, group in zip(subspaces, segments)]

  def decompose(self, per_example_grads: Sequence[tf.Tensor],
                bases: Sequence[tf.Tensor], *, residuals: bool = True
               ) -> Tuple[List[tf.Tensor], Optional[List[tf.Tensor]]]:
    """Unclipped embeddings and residuals of each example, per group.

    Args:
      per_example_grads: one `[n, *var.shape]` tensor per variable.
      bases: the output of `bases`.
      residuals: also return the residuals.

    Returns:
      `(embeddings, residuals)`: per group, `[n, k_j]` and `[n, p_j]` tensors
      (residuals `None` if not asked for).
    """
    shapes = [g.shape[1:] for g in per_example_grads]
    segments = self._segments(shapes)
    flat = _flat(per_example_grads)
    embeddings, rests = [], []
    for group, basis in zip(segments, bases):
      grads = _gather(flat, group)
      embedding = tf.matmul(grads, basis)
      embeddings.append(embedding)
      if residuals:
        # From the unclipped embedding (spec §5.2 A4).
        rests.append(grads - tf.matmul(embedding, basis, transpose_b=True))
    return embeddings, (rests if residuals else None)

  @property
  def reference_l2_norm_clip(self):
    # The largest norm of a clipped record (embedding part only for B-GEP).
    if self._biased:
      return self._s1
    return math.hypot(self._s1, self._s2)

  def init(self, params):
    """Nothing, or with `basis_refresh_steps` > 1 the step count and each
    group's basis and its Gram matrix (zero until the first step), at the
    unclamped `k_j` (a clamped basis is padded with zero columns, which
    carry nothing: no embedding, no lifted noise)."""
    if self._refresh_steps == 1:
      return {}
    shapes = [tf.TensorShape(p.shape) for p in params]
    segments = self._segments(shapes)
    ks = allocate_bases(_group_sizes(segments), self._num_bases)
    return {
        'step': tf.constant(0, tf.int64),
        'directions': [
            [tf.zeros([k, *_window(shapes[v], start, stop)[2]],
                      params[v].dtype) for v, start, stop in group]
            for group, k in zip(segments, ks)],
        'grams': [tf.zeros([k, k]) for k in ks]}

  @property
  def has_gaussian_releases(self) -> bool:
    return True

  def gaussian_release_shapes(self, params):
    """The embedding sums, one `[k_j]` per group at the unclamped `k_j` (an
    embedding clamped to fewer anchors is released padded with zeros, which
    its basis's missing columns lift to nothing), then for GEP the residual
    sums, one flat `[p_j]` per group."""
    sizes = _group_sizes(self._segments([tf.TensorShape(p.shape)
                                         for p in params]))
    releases = [[tf.TensorShape([k])
                 for k in allocate_bases(sizes, self._num_bases)]]
    if not self._biased:
      releases.append([tf.TensorShape([size]) for size in sizes])
    return releases

  def prepare(self, state, seed, per_example_grads, public_grads):
    """The groups and each group's subspace, from public data only: this
    step's, or on steps between refreshes the state's."""
    if public_grads is None:
      raise ValueError(NO_PUBLIC_DATA_HELP)
    shapes = per_example_grads.shapes
    segments = self._segments(shapes)

    def anchors():
      # A model made private defers them (`gradients.Deferred`): built
      # here, inside the refreshing branch when the basis is kept; the
      # engine's value itself, for its cross Gram forms with the private one.
      public = (public_grads.get()
                if isinstance(public_grads, gradients.Deferred) else
                public_grads)
      if public.shapes != shapes:
        raise ValueError(
            'public_grads must have the layout of the private per-example '
            'gradients: one [m, *var.shape] tensor per variable')
      return public

    def subspaces(public):
      return self._subspaces(public, seed, segments, per_example_grads)

    if self._refresh_steps == 1:
      public = anchors()
      return _Plan(shapes, public, segments, subspaces(public))

    def refreshed():
      public = anchors()
      directions, grams = [], []
      entries = sum(sum(b - a for _, a, b in group) * kept.shape[0]
                    for group, kept in zip(segments, state['grams']))
      for sub, group, kept in zip(subspaces(public), segments,
                                  state['grams']):
        with _after(tf.nest.flatten(directions[-1:]), entries):
          basis = _explicit_basis(public, sub, group)
          # The Gram matrix of the float32 basis kept, not of the one in
          # the anchors' coordinates it came from: the residual's norm is
          # exact for the basis its embedding and release use.
          gram = _basis_gram(_Subspace(basis=basis))
          padding = kept.shape[0] - gram.shape[0]
          directions.append(_directions(
              tf.pad(basis, [[0, 0], [0, padding]]), group, shapes))
          grams.append(tf.pad(gram, [[0, padding], [0, padding]]))
      return directions, grams

    # Between refreshes no anchor gradient is formed: every group keeps its
    # basis, explicit (a basis in the anchors' coordinates needs the
    # anchors' gradients at the weights that made it).
    directions, grams = tf.cond(
        tf.equal(state['step'] % self._refresh_steps, 0), refreshed,
        lambda: (state['directions'], state['grams']))
    return _Plan(shapes, None, segments, [
        _Subspace(directions=d, gram=g) for d, g in zip(directions, grams)])

  def clipped_sums(self, per_example_grads, state, plan):
    grads = gradients.as_per_example_gradients(per_example_grads)
    _, public, segments, subspaces = plan
    embeddings = []
    # The embeddings on explicit bases ([B, p_j] temporaries) one after the
    # other, after every basis is built (for bases of more than
    # SIDE_BY_SIDE_BYTES).
    before = tf.nest.flatten(subspaces)
    entries = sum(_entries(sub) for sub in subspaces)
    for group, sub in zip(segments, subspaces):
      if sub.coordinates is not None:  # B^T g = W^T (A g).
        embeddings.append(tf.cast(tf.matmul(
            tf.cast(_cross_gram(grads, public, group, tf.float32),
                    tf.float64), sub.coordinates), tf.float32))
        continue
      with _after(before, entries):
        directions = (sub.directions if sub.directions is not None else
                      _directions(sub.basis, group, grads.shapes))
        embeddings.append(_embeddings(grads, directions, group))
      before = embeddings[-1:]
    # One global clip per part, over all groups (spec §5.2 A3).
    embedding_factors, embedding_norms = clipping.clip_factors(embeddings,
                                                               self._s1)
    sums = {'embedding': noise.batch_sum(embeddings, embedding_factors)}
    if self._biased:
      return sums
    # The residual r = g - B w (w = B^T g, the unclipped embedding, spec
    # §5.2 A4) is never formed: |r|^2 = |g|^2 - 2 |w|^2 + w^T (B^T B) w,
    # exact whether or not B's columns came out orthonormal, and the clipped
    # sum of r is the weighted sum of g minus B times the weighted sum of the
    # embeddings. Those terms round at the scale of |g| for an explicit
    # (orthonormal) basis, and of |g| + |A|_F |W w| for a basis in the
    # anchors' coordinates (w^T W^T C_i and w^T W^T K W w are sums over the
    # anchors of terms up to that size): the residual norm is rounded up, and
    # the subtraction bounded, at that scale.
    sq_norms = gradients.global_sq_norms(grads)
    residual_sq = sq_norms - 2.0 * tf.square(embedding_norms) + tf.add_n([
        tf.reduce_sum(w * tf.matmul(w, _basis_gram(sub)), axis=1)
        for w, sub in zip(embeddings, subspaces)])
    scale = tf.sqrt(sq_norms)
    for w, sub in zip(embeddings, subspaces):
      if sub.coordinates is not None:
        scale += tf.cast(
            tf.sqrt(tf.linalg.trace(sub.anchor_gram)) *
            tf.norm(tf.matmul(tf.cast(w, tf.float64), sub.coordinates,
                              transpose_b=True), axis=1), tf.float32)
    factors = clipping.bound_for_subtraction(
        clipping.clip_factor(
            clipping.part_norms(residual_sq, tf.square(scale)), self._s2),
        scale, self._s2)
    sums['residual'] = noise.batch_sum(grads, factors)
    # The clipped residuals' weighted sum of their embeddings.
    sums['residual_embedding'] = noise.batch_sum(embeddings, factors)
    return sums

  def release(self, sums, state, plan, seed):
    shapes, public, segments, subspaces = plan
    if self._refresh_steps > 1:
      state = {'step': state['step'] + 1,
               'directions': [sub.directions for sub in subspaces],
               'grams': [sub.gram for sub in subspaces]}
    # At the unclamped basis sizes (`gaussian_release_shapes`): with as many
    # anchors as basis vectors this pads nothing and draws the same noise.
    requested = allocate_bases(_group_sizes(segments), self._num_bases)
    noisy_embedding = [
        e[:w.shape[0]] for e, w in zip(noise.add_gaussian(
            [tf.pad(w, [[0, k - w.shape[0]]])
             for w, k in zip(sums['embedding'], requested)],
            self._s1, self._sigma1, noise.substream(seed, 'gep/embedding')),
                                       sums['embedding'])]
    if self._biased:
      return _scatter([_lift(public, sub, group, shapes, w)
                       for sub, group, w in
                       zip(subspaces, segments, noisy_embedding)],
                      segments, shapes), state
    flat_sum = _flat([s[tf.newaxis] for s in sums['residual']])
    noisy_sums = noise.add_gaussian(
        [_gather(flat_sum, group)[0] for group in segments], self._s2,
        self._sigma2, noise.substream(seed, 'gep/residual'))
    # Released: noisy sum of g + B (noisy embedding sum - clipped-residual
    # weighted sum of w), the embedding release plus the residual release.
    out = [s + _lift(public, sub, group, shapes, e - w)
           for s, sub, group, e, w in zip(
               noisy_sums, subspaces, segments, noisy_embedding,
               sums['residual_embedding'])]
    return _scatter(out, segments, shapes), state

  def dp_event(self, step):
    del step  # Every step costs the same.
    return dp_accounting.GaussianDpEvent(float(self.noise_multiplier))


def effective_noise_multiplier(sigma1: float, sigma2: float) -> float:
  """`(sigma1^-2 + sigma2^-2)^-1/2`: two Gaussian releases of one sample.

  Zero if either multiplier is zero (that release is not private).
  """
  if sigma1 == 0 or sigma2 == 0:
    return 0.0
  return float((sigma1**-2 + sigma2**-2)**-0.5)


def gep(num_bases: int,
        embedding_l2_norm_clip: float,
        residual_l2_norm_clip: float,
        noise_multiplier: Optional[float] = None,
        **kwargs) -> GEP:
  """The GEP privatizer (B-GEP with `biased=True`); see `GEP`."""
  return GEP(num_bases, embedding_l2_norm_clip, residual_l2_norm_clip,
             noise_multiplier, **kwargs)
