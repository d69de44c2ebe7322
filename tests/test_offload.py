"""Tests for store/offload.py and the Checkpointer's on-device copy (device_copy).

References: the numpy arrays a state is built from, kept on host; the room arithmetic
against numbers worked out by hand from fake allocator statistics. Runs on the 8
simulated CPU devices of tests/conftest.py, where 'auto' copies nothing (the device is
the host), so the copy path runs with device_copy=True or with the CPU counted as an
accelerator (offload.HOST_PLATFORMS emptied).
"""

import logging
import os
import signal
import subprocess
import sys
import threading

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import checkpoint
from store import chunk_store
from store import offload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed=0):
  mesh = jax.make_mesh((8,), ('fsdp',))
  rng = np.random.default_rng(seed)
  ref = {'w': rng.standard_normal((64, 32), dtype=np.float32),       # 8 KiB, sharded
         'b': rng.standard_normal((16,), dtype=np.float32),          # replicated
         'n': np.arange(6, dtype=np.int32)}                          # a host leaf
  state = {'w': jax.device_put(ref['w'], NamedSharding(mesh, P('fsdp'))),
           'b': jax.device_put(ref['b'], NamedSharding(mesh, P())), 'n': ref['n'].copy()}
  return state, ref


def _target(state):
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
          if isinstance(v, jax.Array) else np.zeros_like(v) for k, v in state.items()}


@pytest.fixture
def no_reserve():
  """No program's temporaries reserved (a train step compiled by another test in this
  process, goodput.compile_ahead, would have reserved its own)."""
  before = offload.reserve(0, replace=True)
  yield
  offload.reserve(before, replace=True)


class _Device:
  """Stands in for a jax Device where only memory_stats() is read."""

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_room_is_the_limit_less_margin_less_the_peak(no_reserve):
  devices = [_Device({'bytes_limit': 1000, 'peak_bytes_in_use': 600, 'bytes_in_use': 500}),
             _Device({'bytes_limit': 1000, 'peak_bytes_in_use': 100, 'bytes_in_use': 300}),
             _Device({'bytes_limit': 1000, 'peak_bytes_in_use': 990})]
  # 1000 * 0.95 = 950: 950 - 600, 950 - 300 (in use above the peak: the larger counts), 0
  assert offload.room(devices) == {devices[0]: 350, devices[1]: 650, devices[2]: 0}
  assert offload.room([_Device(None)]) is None  # CPU: no allocator to ask
  # A program's temporaries (its plan), which a TPU's peak counter does not show.
  offload.reserve(200)
  offload.reserve(100)  # the largest program's plan counts
  assert offload.room(devices[:2]) == {devices[0]: 150, devices[1]: 450}
  assert offload.room(jax.devices()[:1]) is None


def test_room_leaves_out_what_an_earlier_copy_added_to_the_peak(no_reserve):
  dev = _Device({'bytes_limit': 10_000, 'peak_bytes_in_use': 6_000, 'bytes_in_use': 5_000})
  assert offload.room([dev]) == {dev: 3_500}  # 9_500 - 6_000: the steps' peak
  # A copy of 3_000 bytes lived beside the steps: the allocator's peak now counts it.
  copy = jax.device_put(np.zeros(4, np.float32))
  taken = offload.Taken(['x'], [copy], [True], 3_000, 0, '', {dev: 3_000}, {dev: 6_000})
  dev.stats = {'bytes_limit': 10_000, 'peak_bytes_in_use': 9_000, 'bytes_in_use': 5_000}
  offload.to_host(taken, 0, 1 << 20)
  assert copy.is_deleted()
  assert offload.room([dev]) == {dev: 3_500}  # the same room for the next save's copy
  # A higher peak reached after the copy was freed is the loop's own (an evaluation).
  dev.stats = {'bytes_limit': 10_000, 'peak_bytes_in_use': 9_200, 'bytes_in_use': 5_000}
  assert offload.room([dev]) == {dev: 300}


def test_plan_copies_the_largest_arrays_that_fit_every_device():
  d0 = jax.devices()[0]
  arrays = [jax.device_put(np.zeros(n, np.uint8), d0) for n in (1000, 4000, 2000, 500)]
  # 5000 free: 4000 first, then 2000 does not fit, 1000 does, then 500 does not (0 left)
  assert offload.plan(arrays + ['host'], {d0: 5000}) == [True, True, False, False, False]
  assert offload.plan(arrays, {d0: 0}) == [False] * 4
  assert offload.plan(arrays, None) == [True] * 4
  # A sharded array needs its shard on each of its devices; one full device stops it.
  mesh = jax.make_mesh((8,), ('fsdp',))
  sharded = jax.device_put(np.zeros(8000, np.uint8), NamedSharding(mesh, P('fsdp')))
  free = {d: 1000 for d in jax.devices()}
  assert offload.plan([sharded], free) == [True]
  free[jax.devices()[5]] = 999
  assert offload.plan([sharded], free) == [False]


def test_copies_survive_donation_and_are_freed_after_the_transfer():
  state, ref = _state()
  names = list(state)
  taken = offload.take(names, list(state.values()), 0, 64 << 20, device_copy=True)
  assert taken.copied == [True, True, False] and taken.blocking_bytes == ref['n'].nbytes
  # 8 KiB sharded over 8 devices is 1 KiB each, plus the replicated 64 B on each device
  assert taken.copied_bytes == ref['w'].nbytes // 8 + ref['b'].nbytes
  copies = [taken.leaves[0], taken.leaves[1]]
  for copy, name in zip(copies, ('w', 'b')):  # the same layout: the same chunks on disk
    assert copy.sharding.is_equivalent_to(state[name].sharding, copy.ndim), name
  step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
  jax.block_until_ready(step({'w': state['w'], 'b': state['b']}))
  assert state['w'].is_deleted()  # the originals are gone: only the copies hold the save
  state['n'][:] = -1
  snaps = offload.to_host(taken, 0, 64 << 20)
  assert all(c.is_deleted() for c in copies)
  for snap in snaps:
    whole = np.empty(snap.shape, snap.dtype)
    for box, data in snap.pieces:
      whole[chunk_store.slices(box)] = data
    np.testing.assert_array_equal(whole, ref[snap.name], err_msg=snap.name)


def test_auto_copies_what_fits_and_logs_the_fallback(tmp_path, monkeypatch, caplog):
  state, ref = _state(1)
  monkeypatch.setattr(offload, 'HOST_PLATFORMS', ())  # as on an accelerator
  per_device_w = ref['w'].nbytes // 8
  # Room for the sharded matrix's shard but not for the replicated vector beside it.
  monkeypatch.setattr(offload, 'room', lambda devices: {d: per_device_w for d in devices})
  caplog.set_level(logging.INFO)
  with checkpoint.Checkpointer(str(tmp_path), fsync=False) as ckpt:
    ckpt.save(1, state)
    assert ckpt.last_save['device_copy_bytes'] == per_device_w
    assert ckpt.last_save['blocking_bytes'] == ref['b'].nbytes + ref['n'].nbytes
    ckpt.wait()
    assert ckpt.last_save['durable_s'] >= ckpt.last_save['blocking_s'] > 0
    monkeypatch.setattr(offload, 'room', lambda devices: {d: 1 << 30 for d in devices})
    ckpt.save(2, state)
    assert ckpt.last_save['blocking_bytes'] == ref['n'].nbytes
    ckpt.wait()
    restored, _ = ckpt.restore(_target(state), step=1)
  for k in ref:
    np.testing.assert_array_equal(np.asarray(restored[k]), ref[k], err_msg=k)
  text = caplog.text
  assert 'GB to host at once' in text and 'free HBM' in text  # step 1: the fallback, why
  assert 'Checkpoint step 2: copied on device' in text


def test_auto_on_cpu_and_false_copy_nothing(tmp_path):
  state, _ = _state(2)
  for mode in ('auto', False):
    taken = offload.take(list(state), list(state.values()), 0, 64 << 20, device_copy=mode)
    assert taken.copied == [False] * 3 and taken.copied_bytes == 0
  assert 'CPU' in offload.take(['w'], [state['w']], 0, 1 << 20).why
  with pytest.raises(ValueError, match='device_copy'):
    checkpoint.Checkpointer(str(tmp_path), device_copy='sometimes')


def test_a_failed_transfer_fails_only_that_save(tmp_path, monkeypatch):
  state, ref = _state(3)
  with checkpoint.Checkpointer(str(tmp_path), fsync=False, device_copy=True) as ckpt:
    ckpt.save(1, state)
    ckpt.wait()
    real = offload.to_host
    monkeypatch.setattr(offload, 'to_host', lambda *a: (_ for _ in ()).throw(
        RuntimeError('injected: the device-to-host transfer failed')))
    ckpt.save(2, state)
    with pytest.raises(checkpoint.CheckpointSaveError, match='step 2 .*injected'):
      ckpt.wait()
    monkeypatch.setattr(offload, 'to_host', real)
    assert ckpt.committed_steps() == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['step_1']


_KILLED = r'''
import os, sys, threading
import jax, numpy as np
import checkpoint
from store import offload
directory = sys.argv[1]
state = {'w': jax.device_put(np.full((64, 32), 1.0, np.float32))}
ckpt = checkpoint.Checkpointer(directory, device_copy=True)
ckpt.save(1, state)
ckpt.wait()
moving = threading.Event()
real = offload.to_host
def slow(*args):
  moving.set()
  threading.Event().wait()  # the transfer never ends: killed during it
offload.to_host = slow
ckpt.save(2, {'w': state['w'] + 1})
moving.wait()
print('transferring', flush=True)
threading.Event().wait()
'''


def test_sigkill_during_the_transfer_loses_only_that_save(tmp_path):
  ckpt_dir = tmp_path / 'ckpt'
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  proc = subprocess.Popen([sys.executable, '-c', _KILLED, str(ckpt_dir)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines = []
  timer = threading.Timer(240, proc.kill)
  timer.start()
  for line in proc.stdout:
    lines.append(line)
    if line.startswith('transferring'):
      break
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  timer.cancel()
  assert lines and lines[-1].startswith('transferring'), ''.join(lines)[-3000:]
  assert any(p.name.startswith('tmp.step_2') for p in ckpt_dir.iterdir())
  assert checkpoint.committed_steps(str(ckpt_dir)) == [1]
  with checkpoint.Checkpointer(str(ckpt_dir)) as ckpt:  # tidies the killed save away
    restored, meta = ckpt.restore({'w': np.zeros((64, 32), np.float32)})
  assert meta['step'] == 1 and sorted(p.name for p in ckpt_dir.iterdir()) == ['step_1']
  np.testing.assert_array_equal(restored['w'], np.full((64, 32), 1.0, np.float32))
