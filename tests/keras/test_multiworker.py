"""Two worker processes under MultiWorkerMirroredStrategy: noise once per step.

Every worker must add the same noise to the same all-reduced sum (one draw per
global step for the whole cluster, from a secret key the chief broadcasts), so
that the update's noise has the std the event claims and the workers' weights
stay identical.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests import stats
from tests.keras import multiworker_run as run

pytestmark = pytest.mark.keras2_only(
    'tf.distribute with several workers, refused on Keras 3 (tests/keras/test_keras3.py)')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _free_ports(count):
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(('localhost', 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


@pytest.fixture(scope='module')
def workers(tmp_path_factory):
  out = tmp_path_factory.mktemp('multiworker')
  cluster = {'worker': [f'localhost:{p}' for p in _free_ports(2)]}
  processes = []
  for index in range(2):
    config = {'cluster': cluster, 'task': {'type': 'worker', 'index': index}}
    env = {**os.environ, 'TF_CONFIG': json.dumps(config),
           'TF_CPP_MIN_LOG_LEVEL': '2', 'CUDA_VISIBLE_DEVICES': ''}
    processes.append(subprocess.Popen(
        [sys.executable, '-m', 'tests.keras.multiworker_run',
         str(out / f'{index}.json')], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  for p in processes:
    log, _ = p.communicate(timeout=600)
    assert p.returncode == 0, log[-3000:]
  return [json.loads((out / f'{i}.json').read_text()) for i in range(2)]


@pytest.mark.parametrize('engine', ['compile', 'make_private'])
def test_two_workers_add_the_noise_of_one_step_once(workers, engine):
  assert [w['workers'] for w in workers] == [2, 2]
  deltas = [np.asarray(w[engine]['delta']) for w in workers]
  # Identical weights on both workers, so identical noise.
  np.testing.assert_array_equal(deltas[0], deltas[1])
  assert [w[engine]['dp_steps'] for w in workers] == [1, 1]
  expected = (run.LEARNING_RATE * run.NOISE_MULTIPLIER * run.L2_NORM_CLIP /
              run.GLOBAL_BATCH)
  assert stats.relative_tolerance(deltas[0].size) < 0.012
  assert stats.std_matches(deltas[0], expected)
  # Independent noise per worker, summed and divided by two, has std
  # expected / sqrt(2); noise added on each worker without division has
  # expected * sqrt(2). Both must be rejected.
  for wrong in (1 / np.sqrt(2), np.sqrt(2)):
    assert not stats.std_matches(deltas[0], expected * wrong)
