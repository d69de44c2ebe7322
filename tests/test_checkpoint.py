"""Tests for checkpoint.py (and its store/chunk_store.py, store/step_dirs.py,
hosts/workdir_lock.py): bit-exact round trips, resharding, atomicity, faults.

References are the numpy arrays the states are built from (kept on the host,
never read back from a checkpoint) and, for casts, XLA's own convert.
Shapes: W_RC is a [rows, cols] matrix, v_N a vector. Runs on the 8 simulated
CPU devices set up by tests/conftest.py.
"""

import contextlib
import json
import logging
import os
import pathlib
import pwd
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import checkpoint
import errors
from hosts import workdir_lock
import servers
from store import chunk_store
from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
# fsync dominates these tiny saves on a busy disk; the round-trip, IO-error and
# two-process tests keep it on, as in training.
FAST = {'fsync': False}


class AdamLike(typing.NamedTuple):
  count: typing.Any
  mu: typing.Any


def _mesh(shape, names, n=None):
  devices = np.array(jax.devices()[:n or int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, names)


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(f'u{a.dtype.itemsize}') if a.dtype.itemsize > 1 else a.view(np.uint8)


def _reference(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
      'W_RC': rng.standard_normal((16, 12), dtype=np.float32),
      'Wt_RC': rng.standard_normal((6, 16), dtype=np.float32),
      'v_N': rng.standard_normal(16, dtype=np.float32).astype(jnp.bfloat16),
      'i_RC': rng.integers(-2**31, 2**31 - 1, (8, 4), dtype=np.int32),
      'u_N': rng.integers(0, 2**32 - 1, 8, dtype=np.uint32),
      'count': np.int32(seed + 7),
  }


SAVE_SPECS = {'W_RC': P('fsdp'), 'Wt_RC': P(None, 'fsdp'), 'v_N': P('fsdp'),
              'i_RC': P('fsdp'), 'u_N': P(), 'count': P()}


def _state(ref: dict, mesh) -> dict:
  """A train-state-shaped pytree sharded FSDP-style (SAVE_SPECS) over `mesh`."""
  put = lambda name: jax.device_put(ref[name], NamedSharding(mesh, SAVE_SPECS[name]))
  return {
      'params': {'dense': {'W_RC': put('W_RC'), 'Wt_RC': put('Wt_RC')},
                 'norm': {'v_N': put('v_N')}},
      'opt_state': (AdamLike(count=put('count'), mu={'i_RC': put('i_RC'), 'u_N': put('u_N')}),),
      'python_scalar': 3,
      'host_array': np.arange(5, dtype=np.int64) + ref['count'],
  }


def _target(ref: dict, sharding_of, dtype=None) -> dict:
  """ShapeDtypeStructs with shardings from `sharding_of(name, ndim)`."""
  sds = lambda name: jax.ShapeDtypeStruct(
      ref[name].shape, dtype or ref[name].dtype, sharding=sharding_of(name, ref[name].ndim))
  return {
      'params': {'dense': {'W_RC': sds('W_RC'), 'Wt_RC': sds('Wt_RC')},
                 'norm': {'v_N': sds('v_N')}},
      'opt_state': (AdamLike(count=jax.ShapeDtypeStruct(
          (), np.int32, sharding=sharding_of('count', 0)),
                             mu={'i_RC': jax.ShapeDtypeStruct(
                                 ref['i_RC'].shape, np.int32,
                                 sharding=sharding_of('i_RC', 2)),
                                 'u_N': jax.ShapeDtypeStruct(
                                     ref['u_N'].shape, np.uint32,
                                     sharding=sharding_of('u_N', 1))}),),
      'python_scalar': 0,
      'host_array': np.zeros(5, np.int64),
  }


def _check_restored(state: dict, ref: dict) -> None:
  """Every leaf equals its reference bit for bit, shard by shard."""
  leaves = {
      'W_RC': state['params']['dense']['W_RC'], 'Wt_RC': state['params']['dense']['Wt_RC'],
      'v_N': state['params']['norm']['v_N'], 'count': state['opt_state'][0].count,
      'i_RC': state['opt_state'][0].mu['i_RC'], 'u_N': state['opt_state'][0].mu['u_N'],
  }
  for name, x in leaves.items():
    assert x.dtype == ref[name].dtype, name
    np.testing.assert_array_equal(_bits(x), _bits(ref[name]), err_msg=name)
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(_bits(shard.data), _bits(ref[name][shard.index]),
                                    err_msg=f'{name} shard {shard.index}')
  assert state['python_scalar'] == 3 and isinstance(state['python_scalar'], int)
  np.testing.assert_array_equal(state['host_array'], np.arange(5) + ref['count'])


def _save(directory, steps, **kwargs) -> None:
  """Saves _reference(step) at each step, FSDP-sharded over 8 devices."""
  mesh8 = _mesh((8,), ('fsdp',))
  with checkpoint.Checkpointer(str(directory), **(FAST | kwargs)) as ckpt:
    for step in steps:
      ckpt.save(step, _state(_reference(step), mesh8),
                {'data': {'epoch': 0, 'position': 4096 * step}})


def _replicated_on(n):
  mesh = _mesh((n,), ('fsdp',))
  return lambda name, ndim: NamedSharding(mesh, P())


def _chunk_file(directory, step, name='params/dense/W_RC', key='c/1/0'):
  return pathlib.Path(directory) / f'step_{step}' / 'arrays' / name / key


def test_round_trip_is_bit_exact_with_metadata(tmp_path):
  ref = _reference(1)
  mesh8 = _mesh((8,), ('fsdp',))
  with checkpoint.Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(5, _state(ref, mesh8), {'config': {'d_model': 4}, 'rng': [1, 2]})
    ckpt.wait()
    assert ckpt.committed_steps() == [5] and ckpt.latest_step() == 5
    state, meta = ckpt.restore(
        _target(ref, lambda name, ndim: NamedSharding(mesh8, SAVE_SPECS[name])))
  _check_restored(state, ref)
  assert meta == {'config': {'d_model': 4}, 'rng': [1, 2], 'step': 5}
  assert checkpoint.read_metadata(str(tmp_path)) == meta
  info = json.loads((tmp_path / 'step_5' / checkpoint.METADATA).read_text())
  assert info['arrays']['params/dense/W_RC']['shape'] == [16, 12]
  assert info['arrays']['params/norm/v_N']['dtype'] == 'bfloat16'
  assert len(info['arrays']['params/dense/W_RC']['checksums']) == 8  # one per FSDP shard
  assert 'opt_state/0/mu/u_N' in info['paths']


@pytest.mark.parametrize('layout', ['2 devices', '1 device', '2x4 mesh', '4x2 transposed'])
def test_restore_reshards_onto_other_meshes(tmp_path, layout):
  _save(tmp_path, [1])
  ref = _reference(1)
  if layout == '2 devices':
    mesh = _mesh((2,), ('fsdp',))
    sharding_of = lambda name, ndim: NamedSharding(mesh, P(*(['fsdp'] + [None] * ndim)[:ndim]))
  elif layout == '1 device':
    device = jax.devices()[0]
    sharding_of = lambda name, ndim: jax.sharding.SingleDeviceSharding(device)
  else:
    mesh = _mesh((2, 4) if layout == '2x4 mesh' else (4, 2), ('data', 'model'))
    # Rows over the size-2 axis, columns over the size-4 one: crosses the saved chunks.
    rows, cols = ('data', 'model') if layout == '2x4 mesh' else ('model', 'data')
    specs = {0: P(), 1: P('model'), 2: P(rows, cols)}
    sharding_of = lambda name, ndim: NamedSharding(mesh, specs[ndim])
  state, _ = checkpoint.restore(str(tmp_path), _target(ref, sharding_of))
  _check_restored(state, ref)
  assert state['params']['dense']['W_RC'].sharding == sharding_of('W_RC', 2)


def test_subdivided_chunks_and_empty_arrays(tmp_path):
  """Shards split into several chunks (chunk_bytes=64) still restore onto another mesh."""
  _save(tmp_path, [1], chunk_bytes=64)
  info = json.loads((tmp_path / 'step_1' / checkpoint.METADATA).read_text())
  w = info['arrays']['params/dense/W_RC']
  # A [2, 12] fp32 shard is 96 bytes: split its rows by 2 -> 16 chunks of 48 bytes.
  assert w['chunk_shape'] == [1, 12] and len(w['checksums']) == 16
  mesh = _mesh((2, 4), ('data', 'model'))
  sharding_of = lambda name, ndim: NamedSharding(mesh, {0: P(), 1: P('model'),
                                                        2: P('data', 'model')}[ndim])
  state, _ = checkpoint.restore(str(tmp_path), _target(_reference(1), sharding_of))
  _check_restored(state, _reference(1))
  empty = {'e_RC': jnp.zeros((0, 4)), 'h_RC': np.zeros((3, 0), np.int32)}
  with checkpoint.Checkpointer(str(tmp_path / 'empty'), **FAST) as ckpt:
    ckpt.save(1, empty)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  state, _ = checkpoint.restore(str(tmp_path / 'empty'), {
      'e_RC': jax.ShapeDtypeStruct((0, 4), jnp.float32, sharding=device),
      'h_RC': np.zeros((3, 0), np.int32)})
  assert state['e_RC'].shape == (0, 4) and state['h_RC'].shape == (3, 0)


def test_subtree_restore_reads_only_that_part(tmp_path):
  _save(tmp_path, [2])
  ref = _reference(2)
  params = _target(ref, _replicated_on(2))['params']
  state, meta = checkpoint.restore(str(tmp_path), params, subtree='params')
  assert meta['step'] == 2 and set(state) == {'dense', 'norm'}
  np.testing.assert_array_equal(_bits(state['dense']['W_RC']), _bits(ref['W_RC']))
  np.testing.assert_array_equal(_bits(state['norm']['v_N']), _bits(ref['v_N']))
  with pytest.raises(ValueError, match='opt_state'):
    checkpoint.restore(str(tmp_path), params, subtree='opt_state')


def test_restore_casts_float_dtypes(tmp_path):
  _save(tmp_path, [1])
  ref = _reference(1)
  state, _ = checkpoint.restore(
      str(tmp_path), _target(ref, _replicated_on(2)) | {
          'params': {'dense': {name: jax.ShapeDtypeStruct(
              ref[name].shape, jnp.bfloat16, sharding=_replicated_on(2)(name, 2))
                               for name in ('W_RC', 'Wt_RC')},
                     'norm': {'v_N': jax.ShapeDtypeStruct(
                         (16,), jnp.float32, sharding=_replicated_on(2)('v_N', 1))}}})
  w = state['params']['dense']['W_RC']
  assert w.dtype == jnp.bfloat16
  np.testing.assert_array_equal(_bits(w), _bits(jnp.asarray(ref['W_RC']).astype(jnp.bfloat16)))
  v = state['params']['norm']['v_N']
  assert v.dtype == jnp.float32  # bf16 -> fp32 widening is exact
  np.testing.assert_array_equal(np.asarray(v), ref['v_N'].astype(np.float64))
  bad = _target(ref, _replicated_on(1))
  bad['opt_state'][0].mu['i_RC'] = jax.ShapeDtypeStruct(
      (8, 4), np.float32, sharding=_replicated_on(1)('i_RC', 2))
  with pytest.raises(ValueError, match=r'opt_state/0/mu/i_RC.*int32 cannot be restored as float32'):
    checkpoint.restore(str(tmp_path), bad)


def test_mismatch_errors_name_the_array(tmp_path):
  _save(tmp_path, [1])
  ref = _reference(1)
  target = _target(ref, _replicated_on(1))
  target['params']['dense']['W_RC'] = jax.ShapeDtypeStruct(
      (16, 13), np.float32, sharding=_replicated_on(1)('W_RC', 2))
  # A config mistake (one line, exit 2 in train.py), which allow_config_change cannot waive.
  with pytest.raises(errors.ConfigError, match=r'params/dense/W_RC.*\(16, 12\).*\(16, 13\)'
                     r'.*even with train.allow_config_change'):
    checkpoint.restore(str(tmp_path), target)
  target['params']['dense']['W_RC'] = jax.ShapeDtypeStruct((16, 12), np.float32)
  with pytest.raises(ValueError, match=r'params/dense/W_RC: sharding None'):
    checkpoint.restore(str(tmp_path), target)
  target = _target(ref, _replicated_on(1))
  target['params']['extra'] = {'b': np.zeros(3, np.float32)}
  del target['params']['norm']
  with pytest.raises(ValueError, match=r"missing from the checkpoint \['params/extra/b'\].*"
                     r"not in the target \['params/norm/v_N'\]"):
    checkpoint.restore(str(tmp_path), target)
  with pytest.raises(FileNotFoundError, match='No checkpoint for step 9'):
    checkpoint.restore(str(tmp_path), _target(ref, _replicated_on(1)), step=9)
  with pytest.raises(FileNotFoundError, match='No committed checkpoint'):
    checkpoint.restore(str(tmp_path / 'empty'), target)


@pytest.mark.parametrize('damage', ['flipped byte', 'truncated chunk', 'missing chunk',
                                    'truncated metadata'])
def test_corruption_is_detected_and_falls_back(tmp_path, caplog, damage):
  _save(tmp_path, [1, 2])
  chunk = _chunk_file(tmp_path, 2)
  if damage == 'flipped byte':
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))
  elif damage == 'truncated chunk':
    chunk.write_bytes(chunk.read_bytes()[:7])
  elif damage == 'missing chunk':
    chunk.unlink()
  else:
    meta = tmp_path / 'step_2' / checkpoint.METADATA
    meta.write_text(meta.read_text()[:100])
  target = _target(_reference(0), _replicated_on(2))
  expected = 'metadata' if damage == 'truncated metadata' else 'params/dense/W_RC c/1/0'
  with pytest.raises(checkpoint.CorruptCheckpointError, match=expected):
    checkpoint.restore(str(tmp_path), target, step=2)
  with caplog.at_level(logging.WARNING):
    state, meta = checkpoint.restore_latest_good(str(tmp_path), target)
  assert meta['step'] == 1
  _check_restored(state, _reference(1))
  assert any('step 2' in r.getMessage() and 'corrupt' in r.getMessage() for r in caplog.records)
  # The corrupt one is moved aside: the next resume and the next save of step 2
  # never see it.
  assert checkpoint.committed_steps(str(tmp_path)) == [1]
  assert [p.name.split('.')[:2] for p in tmp_path.glob('corrupt.*')] == [['corrupt', 'step_2']]


def test_incomplete_and_partial_dirs_are_ignored_then_removed(tmp_path):
  _save(tmp_path, [1, 2])
  # A step that never got its marker and lost a chunk: a genuinely partial save
  # (an intact one is re-committed: test_lost_commit_on_an_intact_step_is_recommitted).
  (tmp_path / 'step_2' / checkpoint.COMMIT).unlink()
  _chunk_file(tmp_path, 2).unlink()
  (tmp_path / 'tmp.step_3.dead').mkdir()  # crash mid-write
  (tmp_path / 'tmp.step_3.dead' / 'junk').write_bytes(b'x')
  assert checkpoint.committed_steps(str(tmp_path)) == [1]
  assert checkpoint.latest_step(str(tmp_path)) == 1
  with pytest.raises(FileNotFoundError, match='incomplete'):
    checkpoint.restore(str(tmp_path), _target(_reference(), _replicated_on(1)), step=2)
  state, meta = checkpoint.restore(str(tmp_path), _target(_reference(), _replicated_on(1)))
  assert meta['step'] == 1
  _save(tmp_path, [4])
  assert sorted(p.name for p in tmp_path.iterdir()) == ['step_1', 'step_4']


def test_crash_mid_save_keeps_previous_and_surfaces_error(tmp_path, monkeypatch):
  _save(tmp_path, [1])
  real, calls = chunk_store.checksum, []

  def failing_checksum(a):
    calls.append(1)
    if len(calls) == 3:  # fail while the writer is mid-way through the arrays
      raise RuntimeError('injected writer fault')
    return real(a)

  monkeypatch.setattr(chunk_store, 'checksum', failing_checksum)
  ckpt = checkpoint.Checkpointer(str(tmp_path), **FAST)
  ckpt.save(2, _state(_reference(2), _mesh((8,), ('fsdp',))))
  with pytest.raises(RuntimeError, match='injected writer fault'):
    ckpt.wait()
  ckpt.wait()  # the error is reported once, then the checkpointer is usable again
  assert checkpoint.committed_steps(str(tmp_path)) == [1]
  assert [p.name for p in tmp_path.iterdir()] == ['step_1']
  state, _ = ckpt.restore(_target(_reference(1), _replicated_on(2)))
  _check_restored(state, _reference(1))
  # An error not collected by wait() is raised by the next save().
  calls.clear()
  ckpt.save(3, _state(_reference(3), _mesh((8,), ('fsdp',))))
  with pytest.raises(RuntimeError, match='injected writer fault'):
    ckpt.save(4, _state(_reference(4), _mesh((8,), ('fsdp',))))
  ckpt.save(4, _state(_reference(4), _mesh((8,), ('fsdp',))))
  ckpt.close()
  assert checkpoint.committed_steps(str(tmp_path)) == [1, 4]


def test_io_error_during_save_fails_loudly(tmp_path):
  """A real write error from the kernel (EFBIG from RLIMIT_FSIZE, like ENOSPC)."""
  _save(tmp_path, [1])
  big = {'w': jnp.ones((1024, 1024), jnp.float32)}  # one 4 MiB chunk
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
  try:
    ckpt.save(2, big)
    with pytest.raises(RuntimeError, match='save of step 2 .* failed.*File too large'):
      ckpt.wait()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, old_handler)
  assert [p.name for p in tmp_path.iterdir()] == ['step_1']
  state, _ = ckpt.restore(_target(_reference(1), _replicated_on(1)))
  _check_restored(state, _reference(1))
  ckpt.close()


def test_retention_keeps_last_n_and_every_m(tmp_path):
  with checkpoint.Checkpointer(str(tmp_path), keep_last=2, keep_every=4, **FAST) as ckpt:
    for step in range(1, 10):
      ckpt.save(step, {'x': jnp.full((2,), step)})
      if step == 6:
        ckpt.wait()
        assert ckpt.committed_steps() == [4, 5, 6]
  assert checkpoint.committed_steps(str(tmp_path)) == [4, 8, 9]
  with checkpoint.Checkpointer(str(tmp_path), keep_last=1, **FAST) as ckpt:
    ckpt.save(10, {'x': jnp.full((2,), 10)})
  assert checkpoint.committed_steps(str(tmp_path)) == [10]
  with pytest.raises(ValueError, match='keep_last'):
    checkpoint.Checkpointer(str(tmp_path), keep_last=0)


def test_async_save_survives_donation_and_deletion(tmp_path, monkeypatch):
  ref = _reference(3)
  state = _state(ref, _mesh((8,), ('fsdp',)))
  gate = threading.Event()  # holds the writer until the sources are gone
  write_local = chunk_store.write_local
  monkeypatch.setattr(chunk_store, 'write_local', lambda *a: gate.wait() and write_local(*a))
  ckpt = checkpoint.Checkpointer(str(tmp_path), **FAST)
  ckpt.save(1, state)
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
  arrays = {'params': state['params'], 'opt_state': state['opt_state']}
  new = jax.block_until_ready(step(arrays))
  for x in jax.tree.leaves(arrays):
    x.delete()
  state['host_array'][:] = -1  # host leaves are copied too
  # Fresh buffers of the same sizes would reuse any freed memory the writer still reads.
  jax.block_until_ready([x * 0 - 2 - i for x in jax.tree.leaves(new) for i in range(8)])
  gate.set()
  ckpt.save(2, state | new)  # waits for step 1 first: at most one save in flight
  ckpt.wait()
  restored, _ = ckpt.restore(_target(ref, _replicated_on(8)), step=1)
  _check_restored(restored, ref)
  ckpt.close()


def test_ocdbt_round_trip_and_reshard(tmp_path):
  _save(tmp_path, [1, 2], use_ocdbt=True)
  assert (tmp_path / 'step_2' / 'ocdbt').is_dir()
  mesh = _mesh((2, 2), ('data', 'model'))
  sharding_of = lambda name, ndim: NamedSharding(mesh, {0: P(), 1: P('model'),
                                                        2: P('data', 'model')}[ndim])
  state, meta = checkpoint.restore(str(tmp_path), _target(_reference(2), sharding_of))
  assert meta['step'] == 2
  _check_restored(state, _reference(2))


def _as_saved_before_checksums(step_dir: pathlib.Path) -> None:
  """Rewrites a step's metadata.json as this module wrote it before the checksum and flag."""
  meta = step_dir / checkpoint.METADATA
  info = json.loads(meta.read_text())
  del info['healthy'], info['metadata_checksum']
  meta.write_text(json.dumps(info))


def test_retention_keeps_the_newest_healthy_step(tmp_path):
  """Unhealthy saves never evict the last healthy one; a newer healthy one releases it."""
  x = lambda step: {'x': jnp.full((2,), step)}
  with checkpoint.Checkpointer(str(tmp_path), keep_last=2, **FAST) as ckpt:
    for step in (1, 2):
      ckpt.save(step, x(step))
    for step in (3, 4, 5):
      ckpt.save(step, x(step), healthy=False)
    ckpt.wait()
    assert ckpt.committed_steps() == [2, 4, 5]
    assert ckpt.latest_healthy_step() == checkpoint.latest_healthy_step(str(tmp_path)) == 2
    ckpt.save(6, x(6))
    ckpt.save(7, x(7), healthy=False)
    ckpt.wait()
    assert ckpt.committed_steps() == [6, 7] and ckpt.latest_healthy_step() == 6
    with pytest.raises(TypeError, match="healthy='yes': must be a bool"):
      ckpt.save(8, x(8), healthy='yes')
    with pytest.raises(ValueError, match='step=-1: must be an integer >= 0'):
      ckpt.save(-1, x(8))
  assert json.loads((tmp_path / 'step_7' / checkpoint.METADATA).read_text())['healthy'] is False
  _as_saved_before_checksums(tmp_path / 'step_7')  # no flag: counts as healthy
  assert checkpoint.latest_healthy_step(str(tmp_path)) == 7
  state, meta = checkpoint.restore(str(tmp_path), {'x': np.zeros(2, np.int32)})
  assert meta['step'] == 7 and state['x'].tolist() == [7, 7]
  assert checkpoint.latest_healthy_step(str(tmp_path / 'none')) is None


def test_poll_raises_a_failed_background_save_at_once(tmp_path, monkeypatch):
  gate = threading.Event()

  def failing_write(*args):
    gate.wait()
    raise OSError(28, 'No space left on device (injected)')

  monkeypatch.setattr(chunk_store, 'write_local', failing_write)
  ckpt = checkpoint.Checkpointer(str(tmp_path), **FAST)
  ckpt.save(7, {'x': jnp.ones(3)})
  safety = threading.Timer(30, gate.set)  # a blocking poll() fails below, not hangs
  safety.start()
  start = time.monotonic()
  ckpt.poll()  # in flight: returns at once
  assert time.monotonic() - start < 10
  gate.set()
  deadline = time.monotonic() + 60
  with pytest.raises(checkpoint.CheckpointSaveError,
                     match=rf'step 7 in {re.escape(str(tmp_path))} failed.*No space left'
                     ) as raised:
    while time.monotonic() < deadline:
      ckpt.poll()
      time.sleep(0.01)
  safety.cancel()
  assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == 28
  ckpt.poll()  # reported once
  ckpt.close()
  assert checkpoint.committed_steps(str(tmp_path)) == []
  assert not list(tmp_path.iterdir())


@pytest.fixture
def shared_dir():
  """A directory another user can reach (pytest's tmp_path is private to root)."""
  path = pathlib.Path(tempfile.mkdtemp(prefix='checkpoint_test_'))
  path.chmod(0o777)
  yield path
  shutil.rmtree(path)


@contextlib.contextmanager
def _unreadable(path: pathlib.Path):
  """A real EACCES on `path`: chmod 000, and as root (which reads it anyway) run as nobody.

  seteuid changes every thread's credentials (glibc), so tensorstore's own I/O
  threads get the kernel's real permission error, as on a cluster mount.
  """
  mode = path.stat().st_mode
  path.chmod(0)
  root = os.geteuid() == 0
  try:
    if root:
      os.seteuid(pwd.getpwnam('nobody').pw_uid)
    yield
  finally:
    if root:
      os.seteuid(0)
    path.chmod(mode)


@pytest.mark.parametrize('file', ['chunk', 'zarr.json', 'metadata.json'])
def test_unreadable_files_raise_and_rename_nothing(shared_dir, file):
  _save(shared_dir, [1, 2])
  path = {'chunk': _chunk_file(shared_dir, 2),
          'zarr.json': shared_dir / 'step_2/arrays/params/dense/W_RC/zarr.json',
          'metadata.json': shared_dir / 'step_2' / checkpoint.METADATA}[file]
  target = _target(_reference(0), _replicated_on(2))
  with _unreadable(path):
    with pytest.raises(checkpoint.CheckpointReadError,
                       match=rf'(?s)Cannot read {re.escape(str(path))}.*Permission denied.*'
                       'Check the permissions') as raised:
      checkpoint.restore_latest_good(str(shared_dir), target)
  if file != 'metadata.json':  # tensorstore's own report of EACCES
    assert 'PERMISSION_DENIED' in str(raised.value)
  assert sorted(p.name for p in shared_dir.iterdir()) == ['step_1', 'step_2']
  state, meta = checkpoint.restore_latest_good(str(shared_dir), target)  # access fixed
  assert meta['step'] == 2
  _check_restored(state, _reference(2))


@pytest.mark.parametrize('message, is_io', [
    ('PERMISSION_DENIED: Error reading local file "/c/0/0": Failed to open: "/c/0/0": '
     "Permission denied [os_error_code='13']", True),
    ('FAILED_PRECONDITION: Error reading local file "/c/0/0": Failed to read: '
     "Input/output error [os_error_code='5']", True),  # EIO: tensorstore's default code
    ('FAILED_PRECONDITION: Error reading "/c/0/0" [OS error: Input/output error]', True),
    ('UNAVAILABLE: Error reading gs://bucket/c/0/0', True),
    ('FAILED_PRECONDITION: Error reading local file "/c/0/0": Not enough data: expected '
     'at least 256 or 249 more; at byte 7', False),  # truncated
    ('NOT_FOUND: chunk {0, 0} stored at local file "/c/0/0" is missing', False),
    ('DATA_LOSS: Error opening "zarr3" driver: Error reading local file "/zarr.json": '
     'Invalid JSON', False),
])
def test_tensorstore_errors_are_sorted_into_io_and_damage(message, is_io):
  """The first message is tensorstore's for a real EACCES (as observed); the EIO ones follow
  its errno -> code mapping (EIO -> FAILED_PRECONDITION) in both of its message styles."""
  assert chunk_store.is_io_error(message) is is_io


def test_lost_commit_on_an_intact_step_is_recommitted(shared_dir, caplog):
  _save(shared_dir, [1, 2])
  (shared_dir / 'step_2' / checkpoint.COMMIT).unlink()
  with _unreadable(_chunk_file(shared_dir, 2)):  # cannot verify: keep it, say why
    with pytest.raises(checkpoint.CheckpointReadError, match='c/1/0.*Permission denied'):
      checkpoint.Checkpointer(str(shared_dir), **FAST)
  assert sorted(p.name for p in shared_dir.iterdir()) == ['step_1', 'step_2']
  with caplog.at_level(logging.WARNING):
    ckpt = checkpoint.Checkpointer(str(shared_dir), **FAST)
  assert ckpt.committed_steps() == [1, 2]
  assert any('step_2 has no COMMIT' in r.getMessage() and 're-committing' in r.getMessage()
             for r in caplog.records)
  state, meta = ckpt.restore_latest_good(_target(_reference(2), _replicated_on(2)))
  assert meta['step'] == 2
  _check_restored(state, _reference(2))
  ckpt.close()


def _tamper(directory: pathlib.Path, damage: str) -> None:
  step_dir = directory / 'step_2'
  if damage == 'zarr.json shape':
    zarr = step_dir / 'arrays/params/dense/W_RC/zarr.json'
    meta = json.loads(zarr.read_text())
    meta['shape'] = [16, 14]
    zarr.write_text(json.dumps(meta))
    return
  old, new = {'data position': ('"position": 8192', '"position": 8193'),
              'metadata.json shape': ('"shape": [16, 12]', '"shape": [16, 13]')}[damage]
  meta = step_dir / checkpoint.METADATA
  assert meta.read_text().count(old) == 1
  meta.write_text(meta.read_text().replace(old, new))


@pytest.mark.parametrize('damage, named', [
    ('data position', 'metadata.json fails its xxh3_64 checksum'),
    ('metadata.json shape', 'metadata.json fails its xxh3_64 checksum'),
    ('zarr.json shape', r"params/dense/W_RC's zarr.json says .*\(16, 14\).*metadata.json "
                        r'declares .*\(16, 12\)'),
])
def test_tampered_metadata_is_corruption(tmp_path, caplog, damage, named):
  _save(tmp_path, [1, 2])
  _tamper(tmp_path, damage)
  target = _target(_reference(0), _replicated_on(2))
  with pytest.raises(checkpoint.CorruptCheckpointError, match=named):
    checkpoint.restore(str(tmp_path), target, step=2)
  with caplog.at_level(logging.WARNING):
    state, meta = checkpoint.restore_latest_good(str(tmp_path), target)
  assert meta == {'data': {'epoch': 0, 'position': 4096}, 'step': 1}
  _check_restored(state, _reference(1))
  assert any('step 2' in r.getMessage() and 'corrupt' in r.getMessage() for r in caplog.records)
  alone = tmp_path / 'alone'  # with no intact one to fall back to: a clear error
  _save(alone, [2])
  _tamper(alone, damage)
  with pytest.raises(checkpoint.CorruptCheckpointError,
                     match=f'No intact checkpoint.*{named}.*Put an intact copy back'):
    checkpoint.restore_latest_good(str(alone), target)


_LOCK_HOLDER = r"""
import sys, time
from hosts import workdir_lock
with workdir_lock.WorkdirLock(sys.argv[1]):
  print('held', flush=True)
  time.sleep(600)
"""


def test_workdir_lock_excludes_a_second_run_and_takes_over_a_dead_ones(tmp_path, caplog):
  env = dict(os.environ, PYTHONPATH=str(REPO))
  holder = subprocess.Popen([sys.executable, '-c', _LOCK_HOLDER, str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == 'held\n'
    with pytest.raises(workdir_lock.WorkdirLockedError,
                       match=rf'in use by another training run \(host '
                       rf'{re.escape(socket.gethostname())}, PID {holder.pid},.*another '
                       '--workdir'):
      with workdir_lock.WorkdirLock(str(tmp_path)):
        pass
  finally:
    holder.kill()  # SIGKILL: no clean-up runs, LOCK keeps naming the dead holder
    holder.wait()
  assert json.loads((tmp_path / workdir_lock.LOCK).read_text())['pid'] == holder.pid
  with caplog.at_level(logging.WARNING):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      assert json.loads((tmp_path / workdir_lock.LOCK).read_text())['pid'] == os.getpid()
      with pytest.raises(workdir_lock.WorkdirLockedError, match=f'PID {os.getpid()}'):
        with workdir_lock.WorkdirLock(str(tmp_path)):  # flock: one holder per open file
          pass
  assert [r.getMessage() for r in caplog.records if 'stale' in r.getMessage()
          and f'PID {holder.pid}' in r.getMessage()]
  caplog.clear()
  with pytest.raises(KeyError):  # an exception inside releases it
    with workdir_lock.WorkdirLock(str(tmp_path)):
      raise KeyError('boom')
  with caplog.at_level(logging.WARNING):
    with workdir_lock.WorkdirLock(str(tmp_path)):
      pass
  assert not caplog.records  # a clean release leaves no stale holder behind
  (tmp_path / 'other' / workdir_lock.LOCK).mkdir(parents=True)
  with pytest.raises(errors.ConfigError,
                     match='cannot write the workdir lock .*LOCK a regular file'):
    with workdir_lock.WorkdirLock(str(tmp_path / 'other')):
      pass


_WORKER = r'''
import sys
import jax
jax.distributed.initialize(f'localhost:{sys.argv[2]}', num_processes=2,
                           process_id=int(sys.argv[1]))
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import checkpoint

directory = sys.argv[3]
mesh = jax.make_mesh((2, 4), ('data', 'fsdp'))
ref = np.random.default_rng(0).standard_normal((16, 12), dtype=np.float32)
target = {'w': jax.ShapeDtypeStruct((16, 12), np.float32,
                                    sharding=NamedSharding(mesh, P('fsdp', 'data'))),
          'r': jax.ShapeDtypeStruct((3,), np.float32, sharding=NamedSharding(mesh, P()))}
ckpt = checkpoint.Checkpointer(directory, keep_last=1)
state, meta = ckpt.restore_latest_good(target)
assert meta['step'] == 1, meta
for shard in state['w'].addressable_shards:
  np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
# The on-device copy (store/offload.py) as on an accelerator: process 1 has no room at
# step 2, so neither copies (one program); at step 3 both have room, and both copy.
from store import offload
offload.HOST_PLATFORMS = ()
offload.room = lambda devices: {d: 0 if jax.process_index() == 1 else 1 << 30 for d in devices}
ckpt.save(2, {'w': jax.jit(lambda x: x + 1)(state['w']), 'r': state['r'], 'n': 5},
          {'process_count': jax.process_count()})
assert ckpt.last_save['device_copy_bytes'] == 0, ckpt.last_save
ckpt.wait()
offload.room = lambda devices: {d: 1 << 30 for d in devices}
ckpt.save(3, {'w': jax.jit(lambda x: x + 2)(state['w']), 'r': state['r'], 'n': 5},
          {'process_count': jax.process_count()})
assert ckpt.last_save['device_copy_bytes'] > 0, ckpt.last_save
ckpt.close()
print('worker ok', jax.process_index())
'''


@pytest.mark.slow
def test_two_processes_restore_and_save_cooperatively(tmp_path):
  """Saved by 1 process on 8 devices, restored and re-saved by 2 processes x 4 (with
  and without the on-device copy, which the processes must agree on)."""
  ref = np.random.default_rng(0).standard_normal((16, 12), dtype=np.float32)
  mesh8 = _mesh((8,), ('fsdp',))
  with checkpoint.Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, {'w': jax.device_put(ref, NamedSharding(mesh8, P('fsdp'))),
                  'r': jax.device_put(np.arange(3.0, dtype=np.float32),
                                      NamedSharding(mesh8, P()))})
  (tmp_path / 'worker.py').write_text(_WORKER)
  port = servers.free_port()
  env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=with_devices(4))
  procs = [subprocess.Popen([sys.executable, str(tmp_path / 'worker.py'), str(i), str(port),
                             str(tmp_path)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outputs = [p.communicate(timeout=240)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f'worker ok {i}' in out, out[-3000:]
  assert checkpoint.committed_steps(str(tmp_path)) == [3]
  info = json.loads((tmp_path / 'step_3' / checkpoint.METADATA).read_text())
  assert info['process_count'] == 2 and info['metadata']['process_count'] == 2
  target = {'w': jax.ShapeDtypeStruct((16, 12), np.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
            'r': np.zeros(3, np.float32), 'n': 0}
  state, _ = checkpoint.restore(str(tmp_path), target)
  np.testing.assert_array_equal(np.asarray(state['w']), ref + 2)
  np.testing.assert_array_equal(state['r'], np.arange(3.0))
  assert state['n'] == 5


def test_large_chunks_split_by_tensorstore_restore(tmp_path):
  """An 8 MiB chunk is stored by tensorstore as smaller read chunks (its sharding codec).

  The restore check compares the chunk grid, not those inner read chunks: a
  healthy checkpoint of the README's small model must never look damaged.
  """
  x = {'embedding': np.random.default_rng(0).standard_normal((8192, 256), np.float32),
       'odd': np.random.default_rng(1).standard_normal((3000, 700), np.float32)}
  with checkpoint.Checkpointer(str(tmp_path)) as ckpt:
    ckpt.save(1, x)
  restored, _ = checkpoint.Checkpointer(str(tmp_path)).restore(
      {k: np.zeros_like(v) for k, v in x.items()})
  for k in x:
    np.testing.assert_array_equal(restored[k], x[k])
