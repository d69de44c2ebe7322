"""The held-out evaluator on two JAX processes: the same losses, each host reading its rows.

train.py runs in two processes x 2 devices (tests/test_multihost.py's harness),
wrapped to log every held-out instance id each process reads. The reference
for the values is one process on 4 devices; the reference for the reads is
the layout itself: the batch's rows are split in contiguous blocks over the 4
devices, process p holds devices 2p and 2p+1, so of each batch of 8 instances
(b*8 .. b*8+7) process 0 must read the first 4 and process 1 the last 4, and
never the other's.
"""

import json
import os

import numpy as np
import pytest

from test_multihost import LOSS_RTOL, REPO, metrics, run_train, run_two_processes

EVAL = ['--config.train.eval_every=2', '--config.data.validation_batches=2']
BATCH = 8

VALIDATION_RECORDER = '''
import json, os, sys
sys.path.insert(0, {repo!r})
sys.argv[0] = os.path.join({repo!r}, 'train.py')
import data, train
original = data.Dataset.read
def read(self, ids):
  if 'validation' in self.files[0].path:
    with open(os.environ['ROWS_LOG'] + str(train.jax.process_index()), 'a') as f:
      f.write(json.dumps([int(i) for i in ids]) + '\\n')
  return original(self, ids)
data.Dataset.read = read
train.run()
'''


@pytest.mark.slow  # three train.py processes: ~3 min on a loaded 2-core machine
def test_two_processes_read_only_their_rows_and_match_one(tmp_path):
  one = tmp_path / 'one'
  run_train(one, 4, 2, *EVAL, devices=4)
  two = tmp_path / 'two'
  two.mkdir()
  wrapper = two / 'record_rows.py'
  wrapper.write_text(VALIDATION_RECORDER.format(repo=str(REPO)))
  os.environ['ROWS_LOG'] = str(two / 'rows')
  try:
    run_two_processes(two, 4, 2, *EVAL, wrapper=str(wrapper))
  finally:
    del os.environ['ROWS_LOG']

  a, b = metrics(one), metrics(two)
  for step in (2, 4):
    np.testing.assert_allclose(b[step]['eval/lm/validation/CE loss'],
                               a[step]['eval/lm/validation/CE loss'], rtol=LOSS_RTOL)
  reads = [sorted(i for line in (two / f'rows{p}').read_text().splitlines()
                  for i in json.loads(line)) for p in range(2)]
  for p in range(2):
    want = sorted(b * BATCH + r for b in range(2) for r in range(4 * p, 4 * p + 4))
    assert reads[p] == want, p  # once, at the start: the batches are fixed
