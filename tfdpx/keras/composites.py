"""Composite layers: which layer calls the engine opens, and why not others.

A composite layer computes with its trainable weights only through the
sublayers that hold them: keras.io's `TransformerBlock` (a MultiHeadAttention,
a nested Sequential, two LayerNormalizations), keras-hub's transformer
layers, a subclassed model. The engine (`tfdpx.keras.recorder`) records each
call of such a sublayer as a layer call of its own, with its rule or as a
fallback unit, and runs the composite's own code between those calls as
written (its residual additions, softmax, dropout, masks).

A layer that is not opened is one fallback unit, exact for any computation and
slower (docs/models.md): `closed_reason` says why, and the engine's report
(`tfdpx.keras.describe`) shows it.
"""

from typing import List, Optional

import tensorflow as tf

from tfdpx import per_example
from tfdpx.keras.stack import keras_version

_key = per_example.variable_key


def trainable_sublayers(layer) -> List[tf.keras.layers.Layer]:
  """`layer`'s direct sublayers that hold trainable weights."""
  return [sub for sub in layer._flatten_layers(  # pylint: disable=protected-access
      include_self=False, recursive=False) if sub.trainable_weights]


def closed_reason(layer: tf.keras.layers.Layer) -> Optional[str]:
  """None if the engine opens `layer`'s calls, else why it does not.

  Opened: a built layer whose trainable weights all belong to direct
  sublayers, other than a recurrent loop over its cell or a TimeDistributed
  wrapper (their sublayers run inside a loop, or on time steps folded into
  the batch axis, where a sublayer call's rows are not examples).
  """
  if isinstance(layer, tf.keras.layers.RNN):
    return 'runs its cell in a loop over time steps'
  if isinstance(layer, tf.keras.layers.TimeDistributed):
    return 'calls its layer on time steps folded into the batch axis'
  if not layer.built:
    return 'is not built'
  subs = trainable_sublayers(layer)
  held = {_key(v) for sub in subs
          for v in keras_version.tf_variables(sub.trainable_weights)}
  own = [v for v in keras_version.tf_variables(layer.trainable_weights)
         if _key(v) not in held]
  if own:
    names = ', '.join(sorted({v.name.split('/')[-1].split(':')[0]
                              for v in own}))
    return f'computes with trainable weights it owns directly ({names})'
  if not subs:
    return 'has no sublayers with trainable weights'
  replaced = [sub.name for sub in subs if 'call' in vars(sub)]
  if replaced:
    return (f'its sublayer(s) {replaced} have a `call` attribute of their '
            'own, which the engine would replace to record their calls')
  return None
