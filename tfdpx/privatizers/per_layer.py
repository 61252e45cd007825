"""Per-layer (per-group) clipping around any noise step.

Each example's gradient is clipped group by group, group `g` to its own norm
`C_g`, before the inner step sees it: the example's whole gradient then has
norm at most `sqrt(sum_g C_g^2)`, the inner step's clip norm. Opacus calls
this per-layer clipping; with one group it is the inner step itself.
"""

import math
from typing import List, Optional, Sequence, Union

import tensorflow as tf

from tfdpx import clipping
from tfdpx import core
from tfdpx import gradients


def layer_groups(variables: Sequence[tf.Variable]) -> List[int]:
  """One group per layer: the group id of each variable, 0.. in order.

  A TensorFlow variable of a Keras layer is named '<layer scope>/<name>:0';
  a Keras 3 variable's `path` is '<layer path>/<name>'. Pass
  `model.trainable_variables`, in that order.
  """
  scopes = {}
  return [scopes.setdefault(getattr(v, 'path', v.name).rpartition('/')[0],
                            len(scopes))
          for v in variables]


class GroupClippedGradients(gradients.GradientsView):
  """`f_ig * g_iv` with `f_ig = min(1, C_g / |g_ig|)` for the group g of v.

  Answered from `g`'s statistics: the group norms from its per-variable
  squared norms, dots and squared norms scaled per row, and each group's
  weighted sums asked for that group's variables only.
  """

  def __init__(self, grads: gradients.PerExampleGradients,
               group_ids: Sequence[int], group_l2_norm_clips: Sequence[float]):
    super().__init__(grads)
    self._ids = list(group_ids)
    self._clips = list(group_l2_norm_clips)
    self._factors = None

  def factors(self) -> List[tf.Tensor]:
    """Per variable, the `[B]` clip factor of its group."""
    if self._factors is None:
      sq_norms = self._grads.sq_norms()
      by_group = [
          clipping.clip_factor(tf.sqrt(tf.add_n(
              [n for n, i in zip(sq_norms, self._ids) if i == g])), clip)
          for g, clip in enumerate(self._clips)]
      self._factors = [by_group[i] for i in self._ids]
    return self._factors

  def _members(self, group: int, rows: gradients.Rows = None):
    """`rows` for `weighted_sums`: the group's variables, the others skipped
    (a scalar variable, which has no rows, as `()`)."""
    rows = rows or [None] * len(self._ids)
    return [None if i != group else r if r is not None else
            (0, shape[0]) if shape.rank else ()
            for i, r, shape in zip(self._ids, rows, self.shapes)]

  def sq_norms(self):
    return [n * tf.square(f)
            for n, f in zip(self._grads.sq_norms(), self.factors())]

  def dots(self, directions, rows=None):
    return [None if d is None else d * f[:, tf.newaxis]
            for d, f in zip(self._grads.dots(directions, rows),
                            self.factors())]

  def masked_sq_norms(self, masks):
    return [n * tf.square(f)
            for n, f in zip(self._grads.masked_sq_norms(masks),
                            self.factors())]

  def weighted_sum(self, weights):
    sums = self.weighted_sums(tf.convert_to_tensor(weights)[:, tf.newaxis])
    return [s[0] for s in sums]

  def weighted_sums(self, weights, rows=None):
    wanted = [True] * len(self._ids) if rows is None else [
        r is not None for r in rows]
    by_group = {i: f for i, f in zip(self._ids, self.factors())}
    out = [None] * len(self._ids)
    for group, factor in by_group.items():
      members = [r if w else None
                 for r, w in zip(self._members(group, rows), wanted)]
      if all(m is None for m in members):
        continue
      group_weights = weights * factor[:, tf.newaxis]
      if () in members:  # A scalar variable has no rows: sum all, slice.
        sums = [None if m is None else s if m == () else
                gradients.slice_rows(s, m)
                for s, m in zip(self._grads.weighted_sums(group_weights),
                                members)]
      else:
        sums = self._grads.weighted_sums(group_weights, members)
      for v, s in enumerate(sums):
        if members[v] is not None:
          out[v] = s
    return out

  def cross_gram_forms(self, other):
    return self._grads.cross_gram_forms(other)

  def cross_grams(self, other, spans, dtype=tf.float32):
    return [None if g is None else g * tf.cast(f, g.dtype)[:, tf.newaxis]
            for g, f in zip(self._grads.cross_grams(other, spans, dtype),
                            self.factors())]

  def materialized(self):
    return [g * tf.cast(tf.reshape(f, [-1] + [1] * (g.shape.rank - 1)),
                        g.dtype)
            for g, f in zip(self._grads.materialized(), self.factors())]


@core.register
class PerLayerClipping(core.Wrapper):
  """Per-layer (per-group) clipping before `inner` (Opacus's per-layer mode).

  Privacy:
    Each example's gradient restricted to the variables of group `g` is
    clipped to L2 norm `C_g`, so the example's whole gradient has norm at most
    `sqrt(sum_g C_g^2)`, which is `inner`'s reference clip norm `C` (its
    `l2_norm_clip`; GEP: `sqrt(s1^2 + s2^2)`): the global sensitivity. This
    is a transformation of each example's gradient alone before `inner`
    clips, so `inner`'s guarantee holds unchanged and one step is
    `inner.dp_event(step)` (for DP-SGD: noise `noise_multiplier * C` on every
    coordinate, `C = sqrt(sum_g C_g^2)`).
  """

  name = 'per_layer_clipping'

  def __init__(self, inner: core.Privatizer,
               groups: Union[str, Sequence[int]] = 'variable',
               group_l2_norm_clips: Optional[Sequence[float]] = None):
    """Args:
      inner: the noise step (`gaussian`, `geodp`, `dpdr`, `gep`), or its
        `tfdpx.serialize`d form. `adaptive_clipping(per_layer_clipping(...))`
        adapts all group norms together.
      groups: 'variable' (each variable its own group) or the group id of
        each trainable variable, 0..G-1, e.g. `layer_groups(
        model.trainable_variables)` for one group per layer, or any mapping.
      group_l2_norm_clips: the G clip norms, with `sqrt(sum C_g^2)` equal to
        `inner`'s clip norm `C`. Default: `C / sqrt(G)` each.

    Raises:
      ValueError: naming the argument, for bad groups or norms, or an
        `inner` without a clip norm.
    """
    self._set_inner(inner)
    inner = self.inner
    if inner.reference_l2_norm_clip is None:
      raise ValueError(
          f'inner: {inner.name} has no clip norm for the groups to share '
          '(it takes gaussian, geodp, dpdr or gep; for adaptive per-layer '
          'clipping, wrap it: adaptive_clipping(per_layer_clipping(...)))')
    if groups != 'variable':
      if isinstance(groups, str) or not all(
          isinstance(g, int) and not isinstance(g, bool) and g >= 0
          for g in groups):
        raise ValueError("groups must be 'variable' or a list of group ids "
                         f'>= 0, got {groups!r}')
      groups = [int(g) for g in groups]
      if sorted(set(groups)) != list(range(len(set(groups)))):
        raise ValueError(f'groups must number the groups 0..G-1, got {groups}')
    if group_l2_norm_clips is not None:
      group_l2_norm_clips = [core.check_positive('group_l2_norm_clips', c)
                             for c in group_l2_norm_clips]
      total = math.sqrt(math.fsum(c * c for c in group_l2_norm_clips))
      if not math.isclose(total, inner.reference_l2_norm_clip, rel_tol=1e-9):
        raise ValueError(
            f'group_l2_norm_clips: sqrt(sum C_g^2) = {total!r} must equal the '
            f"inner step's clip norm {inner.reference_l2_norm_clip!r}, the "
            'sensitivity it is accounted with')
      if groups != 'variable' and len(group_l2_norm_clips) != len(set(groups)):
        raise ValueError(
            f'group_l2_norm_clips has {len(group_l2_norm_clips)} norms for '
            f'{len(set(groups))} groups')
    self._groups = groups
    self._clips = group_l2_norm_clips

  @property
  def config(self):
    return {'inner': core.serialize(self._inner), 'groups': self._groups,
            'group_l2_norm_clips': self._clips}

  @property
  def reference_l2_norm_clip(self):
    return self._inner.reference_l2_norm_clip

  def dp_event(self, step):
    return self._inner.dp_event(step)

  def group_ids(self, num_variables: int) -> List[int]:
    """The group of each of `num_variables` variables.

    Raises:
      ValueError: if `groups` has another length.
    """
    if self._groups == 'variable':
      return list(range(num_variables))
    if len(self._groups) != num_variables:
      raise ValueError(f'groups has {len(self._groups)} entries for '
                       f'{num_variables} trainable variables')
    return self._groups

  def group_l2_norm_clips(self, num_variables: int) -> List[float]:
    """The clip norm of each group."""
    num_groups = len(set(self.group_ids(num_variables)))
    if self._clips is not None:
      if len(self._clips) != num_groups:
        raise ValueError(f'group_l2_norm_clips has {len(self._clips)} norms '
                         f'for {num_groups} groups')
      return self._clips
    return [self._inner.reference_l2_norm_clip / math.sqrt(num_groups)
            ] * num_groups

  def clipped(self, per_example_grads) -> GroupClippedGradients:
    """The per-example gradients clipped group by group (what `inner` sees)."""
    grads = gradients.as_per_example_gradients(per_example_grads)
    count = len(grads.shapes)
    return GroupClippedGradients(grads, self.group_ids(count),
                                 self.group_l2_norm_clips(count))

  # --- the step ----------------------------------------------------------------

  def init(self, params):
    self.group_l2_norm_clips(len(params))  # Checks the groups now.
    return {'inner': self._inner.init(params)}

  def prepare(self, state, seed, per_example_grads, public_grads):
    return self._inner.prepare(state['inner'], seed,
                               self.clipped(per_example_grads), public_grads)

  def clipped_sums(self, per_example_grads, state, plan):
    return self._inner.clipped_sums(self.clipped(per_example_grads),
                                    state['inner'], plan)

  def release(self, sums, state, plan, seed):
    noisy_sum, inner_state = self._inner.release(sums, state['inner'], plan,
                                                 seed)
    return noisy_sum, {'inner': inner_state}


def per_layer_clipping(inner: core.Privatizer,
                       groups: Union[str, Sequence[int]] = 'variable',
                       group_l2_norm_clips: Optional[Sequence[float]] = None
                      ) -> PerLayerClipping:
  """Per-layer (per-group) clipping before `inner`; see `PerLayerClipping`."""
  return PerLayerClipping(inner, groups, group_l2_norm_clips)
