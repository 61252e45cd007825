"""AutoGraph calls tfdpx's own functions as they are written.

tfdpx builds its graphs with explicit control flow (`tf.cond`,
`tf.while_loop`, Python loops over static structure), so converting it buys
nothing. It costs seconds, though: a `tf.function` of the user's that calls
tfdpx (a loop over a private model's `train_step`, the engine, a
privatizer's `update`) converts every tfdpx function it reaches at its first
trace in the process: about 10 s for a private CNN's step
(benchmarks/custom_loop_trace.py), for the same graph. TensorFlow keeps its
own modules and Keras on the list of modules it does not convert; this puts
tfdpx's there too.

Unlike `tf.autograph.experimental.do_not_convert`, a module rule leaves
AutoGraph's status on for what tfdpx calls: Keras 2 still converts a
subclassed layer's `call` and a loss's where tfdpx calls the model, as plain
Keras does under `fit`.

The list lives in a TensorFlow module outside its public API. Where it is
missing, tfdpx is converted as before: slower to trace, the same graph.
"""

try:
  from tensorflow.python.autograph.core import config as _config  # pylint: disable=g-direct-tensorflow-import
  from tensorflow.python.autograph.core import config_lib as _config_lib  # pylint: disable=g-direct-tensorflow-import
except ImportError:  # pragma: no cover - a TensorFlow without the list.
  _config = None

MODULE = 'tfdpx'


def _rule_is_set() -> bool:
  return any(isinstance(rule, _config_lib.DoNotConvert) and
             rule.matches(MODULE) for rule in _config.CONVERSION_RULES)


def leave_unconverted() -> None:
  """Adds tfdpx to AutoGraph's modules it does not convert, once."""
  if _config is None or not hasattr(_config, 'CONVERSION_RULES'):
    return
  if not _rule_is_set():
    _config.CONVERSION_RULES = (
        _config_lib.DoNotConvert(MODULE),) + tuple(_config.CONVERSION_RULES)
