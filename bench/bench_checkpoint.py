"""Checkpoint save/restore throughput against the disk's own sequential speed.

Measures, in one run on the same filesystem:
  disk write  a state-sized file written in 64 MiB blocks, then fsync
  disk read   that file read back after evicting it from the page cache
  save        Checkpointer.save() + wait() of a ~1 GB FSDP-sharded fp32 state
              (also the blocking part: save() returning, i.e. device-to-host)
  restore     restore() of that checkpoint, cold (files evicted from the page
              cache with posix_fadvise, as after a restart) and warm
  memory      filling fresh host memory of the state's size (a restore ceiling)
and prints each speed in GB/s and the checkpoint/disk ratios, best of
--repeats rounds (the machine may be shared).

  python bench/bench_checkpoint.py [--size_gb=1] [--dir=/tmp] [--use_ocdbt]

Shapes: W_RC is one [rows, cols] fp32 parameter-like matrix.
"""

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             ' --xla_force_host_platform_device_count=8')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import checkpoint  # pylint: disable=g-import-not-at-top,wrong-import-position

_BLOCK = 64 << 20


def _evict(path: pathlib.Path) -> None:
  """Drops a file's (clean, fsynced) pages from the page cache; no root needed."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)


def _evict_tree(root: pathlib.Path) -> None:
  for p in root.rglob('*'):
    if p.is_file():
      _evict(p)


def disk_speed(directory: pathlib.Path, nbytes: int) -> tuple[float, float]:
  """(sequential write GB/s incl. fsync, cold sequential read GB/s) of one file."""
  block = np.random.default_rng(0).integers(0, 255, _BLOCK, dtype=np.uint8).tobytes()
  path = directory / 'disk_probe.bin'
  t0 = time.perf_counter()
  with open(path, 'wb', buffering=0) as f:
    for _ in range(nbytes // _BLOCK):
      f.write(block)
    os.fsync(f.fileno())
  write = nbytes / (time.perf_counter() - t0) / 1e9
  _evict(path)
  t0 = time.perf_counter()
  with open(path, 'rb', buffering=0) as f:
    while f.read(_BLOCK):
      pass
  read = nbytes / (time.perf_counter() - t0) / 1e9
  path.unlink()
  return write, read


def make_state(size_gb: float) -> dict:
  """A params-like dict of [2048, 8192] fp32 matrices, FSDP-sharded over all devices."""
  mesh = jax.make_mesh((jax.device_count(),), ('fsdp',))
  sharding = NamedSharding(mesh, P('fsdp'))
  rows, cols = 2048, 8192
  n = max(1, round(size_gb * 1e9 / (rows * cols * 4)))
  init = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32),
                 out_shardings=sharding)
  return {'params': {f'layer_{i}': {'W_RC': init(jax.random.key(i))} for i in range(n)}}


def fresh_memory_speed(nbytes: int) -> float:
  """GB/s of filling never-touched host memory: a ceiling for any restore, which
  must materialize the state in fresh pages (page faults cost a lot in VMs)."""
  t0 = time.perf_counter()
  blocks = [np.ones(_BLOCK // 4, np.float32) for _ in range(nbytes // _BLOCK)]
  speed = len(blocks) * _BLOCK / (time.perf_counter() - t0) / 1e9
  del blocks
  return speed


def measure(root: pathlib.Path, state: dict, step: int, use_ocdbt: bool) -> dict:
  """One round of every measurement, in GB/s (and save()'s blocking seconds)."""
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  out = {}
  out['disk_write'], out['disk_read_cold'] = disk_speed(root, nbytes)
  out['fresh_memory'] = fresh_memory_speed(nbytes)
  ckpt = checkpoint.Checkpointer(str(root / 'ckpt'), keep_last=1, use_ocdbt=use_ocdbt)
  t0 = time.perf_counter()
  ckpt.save(step, state)
  out['save_blocking_s'] = time.perf_counter() - t0
  ckpt.wait()
  out['save'] = nbytes / (time.perf_counter() - t0) / 1e9
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  for mode in ('cold', 'warm'):
    if mode == 'cold':
      _evict_tree(root / 'ckpt')
    t0 = time.perf_counter()
    restored, _ = ckpt.restore(target)
    jax.block_until_ready(restored)
    out[f'restore_{mode}'] = nbytes / (time.perf_counter() - t0) / 1e9
  ckpt.close()
  out['bit_exact'] = all(bool(jnp.array_equal(a, b)) for a, b in
                         zip(jax.tree.leaves(state), jax.tree.leaves(restored)))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size_gb', type=float, default=1.0)
  parser.add_argument('--dir', default=None, help='filesystem to test (default: $TMPDIR)')
  parser.add_argument('--use_ocdbt', action='store_true')
  parser.add_argument('--repeats', type=int, default=2,
                      help='rounds; the best of each figure is reported (shared machines)')
  args = parser.parse_args()

  state = jax.block_until_ready(make_state(args.size_gb))
  gb = sum(x.nbytes for x in jax.tree.leaves(state)) / 1e9
  with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
    rounds = [measure(pathlib.Path(tmp), state, r + 1, args.use_ocdbt)
              for r in range(args.repeats)]
  best = {k: max(r[k] for r in rounds) for k in rounds[0] if k != 'save_blocking_s'}
  best['save_blocking_s'] = min(r['save_blocking_s'] for r in rounds)
  best['bit_exact'] = all(r['bit_exact'] for r in rounds)
  best['save_vs_disk_write'] = best['save'] / best['disk_write']
  best['restore_cold_vs_disk_read'] = best['restore_cold'] / best['disk_read_cold']
  print(f'state {gb:.2f} GB on {jax.device_count()} devices, {os.cpu_count()} CPUs, '
        f'best of {args.repeats} rounds (GB/s)')
  print(f'disk    write {best["disk_write"]:6.2f} (1 stream + fsync)   '
        f'read {best["disk_read_cold"]:6.2f} (cold)   fresh-memory fill '
        f'{best["fresh_memory"]:6.2f}')
  print(f'save    {best["save"]:6.2f} = {best["save_vs_disk_write"]:.2f} x disk write '
        f'(save() blocked {best["save_blocking_s"]:.3f} s)')
  print(f'restore {best["restore_cold"]:6.2f} cold = {best["restore_cold_vs_disk_read"]:.2f} '
        f'x disk read; {best["restore_warm"]:6.2f} warm; bit-exact: {best["bit_exact"]}')
  print(json.dumps({'state_gb': round(gb, 3), 'devices': jax.device_count(),
                    'cpus': os.cpu_count(), 'use_ocdbt': args.use_ocdbt, 'rounds': rounds,
                    **{k: round(v, 3) if isinstance(v, float) else v
                       for k, v in best.items()}}))


if __name__ == '__main__':
  main()
