"""Shared pytest setup: quiet TensorFlow logs, CPU only; the two stacks.

The suite runs on Stack A (Keras 2, tensorflow-privacy) and on Stack B
(Keras 3). A test of something only Keras 2 has (the compile path, where a
plain model compiled with a tfdpx optimizer gets per-example gradients from
the Jacobian of its loss; TF1 graph mode; tensorflow-privacy's classes; the
.h5 and SavedModel training formats) is marked `keras2_only` with the reason,
and is skipped on Stack B with that reason.
"""

import os

import pytest

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ.setdefault('CUDA_VISIBLE_DEVICES', '')

from tfdpx.keras.version import KERAS_3  # pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_configure(config):
  config.addinivalue_line(
      'markers', 'keras2_only(reason): tests Keras 2 behaviour that Keras 3 '
      'does not have; skipped on Stack B with the reason')


def pytest_collection_modifyitems(config, items):
  del config
  if not KERAS_3:
    return
  for item in items:
    marker = item.get_closest_marker('keras2_only')
    if marker is not None:
      reason = marker.kwargs.get('reason') or (marker.args or ['Keras 2'])[0]
      item.add_marker(pytest.mark.skip(reason=f'Keras 2 only: {reason}'))
