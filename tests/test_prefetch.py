"""Tests for store/prefetch.py: a checkpoint read to host ahead of its restore.

References: the numpy arrays each state is built from, kept on host. A restore that
used the read-ahead arrays must read no file again (tensorstore's open is made to
fail after the read); one that must not use them (a changed, damaged or oversized
step) must restore exactly what the plain restore does.
"""

import logging
import shutil

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
import tensorstore

import checkpoint
from store import prefetch
from test_train import read_metrics, tiny_config, token_files  # noqa: F401  (a fixture)
import train


def _state(seed):
  mesh = jax.make_mesh((8,), ('fsdp',))
  rng = np.random.default_rng(seed)
  ref = {'w': rng.standard_normal((64, 32), dtype=np.float32),
         'b': rng.standard_normal((16,), dtype=np.float32),
         'n': np.arange(6, dtype=np.int32) + seed}
  state = {'w': jax.device_put(ref['w'], NamedSharding(mesh, P('fsdp'))),
           'b': jax.device_put(ref['b'], NamedSharding(mesh, P())), 'n': ref['n'].copy()}
  return state, ref


def _save(directory, *steps_and_seeds):
  with checkpoint.Checkpointer(str(directory), fsync=False) as ckpt:
    for step, seed in steps_and_seeds:
      ckpt.save(step, _state(seed)[0])
      ckpt.wait()


def _target(mesh_shape=(2, 4), spec=P(None, 'y')):
  """Another mesh and layout than the save's: the read-ahead arrays are cut per device."""
  mesh = jax.make_mesh(mesh_shape, ('x', 'y'))
  return {'w': jax.ShapeDtypeStruct((64, 32), np.float32, sharding=NamedSharding(mesh, spec)),
          'b': jax.ShapeDtypeStruct((16,), np.float32, sharding=NamedSharding(mesh, P())),
          'n': np.zeros(6, np.int32)}


def _equal(restored, ref):
  for key, want in ref.items():
    np.testing.assert_array_equal(np.asarray(restored[key]), want, err_msg=key)


def test_the_latest_step_is_read_once_and_restores_onto_another_mesh(tmp_path, monkeypatch,
                                                                     caplog):
  _save(tmp_path, (2, 0), (4, 1))
  ahead = prefetch.Prefetch(str(tmp_path))
  assert ahead.step == 4 and not ahead.why_not
  ahead.wait()

  def no_reads(*args, **kwargs):
    raise AssertionError('a file was opened again after the read-ahead')
  monkeypatch.setattr(tensorstore, 'open', no_reads)
  with caplog.at_level(logging.INFO):
    restored, meta = checkpoint.restore_latest_good(str(tmp_path), _target(),
                                                    prefetched=ahead)
  assert meta['step'] == 4
  _equal(restored, _state(1)[1])
  assert restored['w'].sharding.spec == P(None, 'y')
  assert 'Checkpoint step 4: 0.00 GB read to host' in caplog.text
  assert ahead.take(4, {}) is None  # handed over once


def test_a_step_saved_again_after_the_read_is_read_again(tmp_path, caplog):
  _save(tmp_path, (2, 0))
  ahead = prefetch.Prefetch(str(tmp_path))
  ahead.wait()
  shutil.rmtree(tmp_path / 'step_2')
  _save(tmp_path, (2, 7))  # the same step number, other values
  with caplog.at_level(logging.WARNING):
    restored, _ = checkpoint.restore_latest_good(str(tmp_path), _target(), prefetched=ahead)
  _equal(restored, _state(7)[1])
  assert 'changed after it was read ahead' in caplog.text


def test_a_damaged_latest_step_is_left_to_the_restore_which_walks_back(tmp_path, caplog):
  _save(tmp_path, (2, 0), (4, 1))
  chunk = next(p for p in (tmp_path / 'step_4' / 'arrays' / 'w').rglob('*')
               if p.is_file() and p.name != 'zarr.json')
  data = bytearray(chunk.read_bytes())
  data[10] ^= 0xFF
  chunk.write_bytes(bytes(data))
  ahead = prefetch.Prefetch(str(tmp_path))
  ahead.wait()
  assert 'step 4 could not be read ahead' in ahead.why_not and 'checksum' in ahead.why_not
  with caplog.at_level(logging.WARNING):
    restored, meta = checkpoint.restore_latest_good(str(tmp_path), _target(),
                                                    prefetched=ahead)
  assert meta['step'] == 2
  _equal(restored, _state(0)[1])
  assert 'Checkpoint step 4' in caplog.text and 'is corrupt' in caplog.text
  assert not (tmp_path / 'step_4').exists()  # set aside, as without the read-ahead


@pytest.mark.parametrize('free', [100, None])
def test_too_little_free_memory_or_none_to_read_reads_nothing(tmp_path, monkeypatch, free):
  if free is not None:
    _save(tmp_path, (2, 0))
  monkeypatch.setattr(prefetch, 'free_host_bytes', lambda: free)
  ahead = prefetch.Prefetch(str(tmp_path))
  assert ahead.step is None
  assert ('over 50% of the host memory free' if free else 'no committed step') in ahead.why_not
  if free is not None:
    restored, _ = checkpoint.restore_latest_good(str(tmp_path), _target(), prefetched=ahead)
    _equal(restored, _state(0)[1])


def test_free_host_bytes_reads_the_kernels_figure():
  free = prefetch.free_host_bytes()
  with open('/proc/meminfo', encoding='ascii') as f:
    want = next(int(line.split()[1]) for line in f if line.startswith('MemAvailable:'))
  assert free is not None and abs(free - want * 1024) < 0.2 * want * 1024



def test_train_resumes_from_the_read_ahead_state(tmp_path, caplog, token_files):
  """train.py reads its latest checkpoint while it opens the devices, and resumes from
  those arrays exactly: the resumed run's losses equal an uninterrupted run's."""
  whole, parts = tmp_path / 'whole', tmp_path / 'parts'
  train.train(tiny_config(token_files, **{'train.steps': 4}), str(whole))
  train.train(tiny_config(token_files, **{'train.steps': 2}), str(parts))
  with caplog.at_level(logging.INFO):
    train.train(tiny_config(token_files, **{'train.steps': 4}), str(parts))
  assert 'Checkpoint step 2: ' in caplog.text and 'read to host' in caplog.text
  a, b = read_metrics(whole), read_metrics(parts)
  for step in (3, 4):
    assert b[step]['train/CE loss'] == a[step]['train/CE loss'], step


def test_a_cancelled_read_hands_nothing_over_and_the_restore_reads(tmp_path):
  """A process that ends before its restore (a refused resume) cancels the read at exit."""
  _save(tmp_path, (2, 0))
  ahead = prefetch.Prefetch(str(tmp_path))
  ahead.cancel()
  assert ahead.take(2, {}) is None
  restored, _ = checkpoint.restore_latest_good(str(tmp_path), _target(), prefetched=ahead)
  _equal(restored, _state(0)[1])


def test_a_bucket_is_left_to_the_restore():
  ahead = prefetch.Prefetch('gs://bucket/run/checkpoints')  # no request is made
  assert ahead.step is None and 'bucket' in ahead.why_not
