"""DP training under tf.distribute: noise once per global step, replicas agree."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import stats
from tests.privatizers.cases import case_named
from tfdpx import core
from tfdpx import privatizers

pytestmark = pytest.mark.keras2_only(
    'tf.distribute with several replicas, refused on Keras 3 (tests/keras/test_keras3.py)')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture(scope='module')
def runs():
  out = subprocess.run(
      [sys.executable, '-m', 'tests.keras.distributed_run'], cwd=ROOT,
      capture_output=True, text=True, check=True,
      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'})
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('engine',
                         ['noise', 'noise_make_private', 'noise_virtual'])
def test_noise_is_added_once_per_global_step(runs, engine):
  result = runs[engine]
  delta = np.asarray(result['delta'])
  lr, z, c, global_batch = 0.1, 1.3, 0.8, 8
  expected = lr * z * c / global_batch
  assert stats.relative_tolerance(delta.size) < 0.012
  assert stats.std_matches(delta, expected)
  # Noise per replica (summed: sqrt(2) or 2 times) or averaged away (1/sqrt(2)
  # or 1/2) is rejected.
  for wrong in (np.sqrt(2), 2.0, 1 / np.sqrt(2), 0.5):
    assert not stats.std_matches(delta, expected * wrong)
  assert result['replicas_agree']
  assert result['dp_steps'] == 1


def test_distributed_update_equals_single_device_update_without_noise(runs):
  result = runs['noiseless']
  for engine in ('mirrored', 'mirrored_make_private', 'mirrored_virtual'):
    for a, b in zip(result[engine], result['single']):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert result[engine + '_replicas_agree']


@pytest.mark.parametrize('mode', ['O', 'C', 'N'])
def test_d2p2_projected_update_under_two_replicas_equals_single_device(runs,
                                                                     mode):
  result = runs['d2p2']
  for a, b in zip(result[f'{mode}_mirrored'], result[f'{mode}_single']):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert result[f'{mode}_mirrored_replicas_agree']


def test_replicas_agree_for_every_privatizer(runs):
  classes = {type(case_named(name).make(1.0, 1.0)) for name in runs['agree']}
  classes |= {type(case_named(name).make(1.0, 1.0).inner)
              for name in runs['agree'] if '(' in name}
  every = {value for value in vars(privatizers).values()
           if isinstance(value, type) and issubclass(value, core.Privatizer)}
  assert classes >= every - {privatizers.GEP, privatizers.SparseEmbeddings}
  assert all(runs['agree'].values()), runs['agree']


@pytest.mark.parametrize('engine', ['mirrored', 'mirrored_virtual'])
def test_sparse_embeddings_under_two_replicas_equals_single_device(runs,
                                                                   engine):
  # The selection drawn once per global step, on the rows of both replicas.
  result = runs['sparse']
  for a, b in zip(result[engine], result['single']):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert result[engine + '_replicas_agree']
  changed = set(result['single_changed_rows'])
  assert changed - set(range(12)), 'no false positive was selected'
  assert set(range(12)) - changed, 'every touched row was selected'
