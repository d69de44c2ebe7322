"""Checkpoint save and restore in a bucket, as a ratio to local disk, and requests per save.

Measures, in one run, the same FSDP-sharded fp32 train-state-like tree
(--size_mb, sharded over 8 simulated CPU devices) saved and restored by
checkpoint.Checkpointer:
  local   a temporary directory on local disk (fsync on, as train.py saves)
  gcs     the fake-gcs-server emulator (tests/servers.py), through a counting proxy
  s3      moto's S3 server, through the same kind of proxy
and prints, best of --repeats rounds: MB/s of save (save() + wait()) and of
restore, their ratios to local disk, and the HTTP requests and bytes per save
and per restore (counted by tests/fault_proxy.py between tensorstore and the
server). The emulators run on this machine, so the ratios measure the client's
protocol and request overheads (and the emulators' own speed), not a real
bucket's network; the request counts carry over to a real bucket unchanged.

  python bench/bench_storage.py [--size_mb=256] [--repeats=3] [--chunk_mb=64]

Needs the `test` extra (the emulators). Shapes: W_RC one [rows, cols] matrix.
"""

import argparse
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'tests'))
import checkpoint  # pylint: disable=g-import-not-at-top,wrong-import-position
from fault_proxy import FaultProxy  # pylint: disable=g-import-not-at-top,wrong-import-position
import servers  # pylint: disable=g-import-not-at-top,wrong-import-position
from store import storage  # pylint: disable=g-import-not-at-top,wrong-import-position


def make_state(size_mb: int) -> dict:
  """Eight [rows, 4096] fp32 matrices, row-sharded over the devices (FSDP-like)."""
  mesh = jax.make_mesh((jax.device_count(),), ('fsdp',))
  rows = max(8, size_mb * (1 << 20) // 8 // 4096 // 4 // 8 * 8)
  sharding = NamedSharding(mesh, P('fsdp', None))
  make = jax.jit(lambda k: jax.random.normal(k, (rows, 4096), jnp.float32),
                 out_shardings=sharding)
  return {f'w{i}': make(jax.random.key(i)) for i in range(8)}


def timed_cycle(directory: str, state: dict, step: int, chunk_bytes: int,
                proxy: FaultProxy | None) -> dict[str, float]:
  """Seconds, requests and bytes of one save + wait and one restore of `state`."""
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  with checkpoint.Checkpointer(directory, keep_last=1, chunk_bytes=chunk_bytes) as ckpt:
    if proxy:
      proxy.reset_counts()
    start = time.perf_counter()
    ckpt.save(step, state)
    ckpt.wait()
    save = time.perf_counter() - start
    save_requests = sum(proxy.counts.values()) if proxy else 0
    save_bytes = proxy.bytes_in if proxy else 0
    if proxy:
      proxy.reset_counts()
    start = time.perf_counter()
    restored, _ = ckpt.restore(target, step)
    jax.block_until_ready(restored)
    restore = time.perf_counter() - start
  out = {'save': save, 'restore': restore, 'save_requests': save_requests,
         'save_bytes': save_bytes}
  if proxy:
    out.update(restore_requests=sum(proxy.counts.values()), restore_bytes=proxy.bytes_out)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--size_mb', type=int, default=256)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--chunk_mb', type=int, default=64, help='Checkpointer chunk_bytes')
  args = parser.parse_args()
  print(f'load average before: {os.getloadavg()}')
  state = make_state(args.size_mb)
  nbytes = sum(x.nbytes for x in state.values())
  chunk = args.chunk_mb << 20
  results: dict[str, list[dict[str, float]]] = {}
  with tempfile.TemporaryDirectory() as tmp:
    results['local'] = [timed_cycle(os.path.join(tmp, 'ck'), state, r + 1, chunk, None)
                        for r in range(args.repeats)]
  for kind, bucket_of, variable in (('gcs', servers.gcs_bucket, 'TENSORSTORE_GCS_HTTP_URL'),
                                    ('s3', servers.s3_bucket, 'AWS_ENDPOINT_URL')):
    with bucket_of() as (endpoint, bucket), FaultProxy(endpoint) as proxy:
      os.environ[variable] = proxy.url
      url = f'{"gs" if kind == "gcs" else "s3"}://{bucket}/bench/checkpoints'
      results[kind] = [timed_cycle(url, state, r + 1, chunk, proxy) for r in range(args.repeats)]
      storage.delete_tree(url)
  mb = nbytes / 1e6
  best = {k: {'save': min(r['save'] for r in v), 'restore': min(r['restore'] for r in v),
              **{f: v[-1][f] for f in v[-1] if f not in ('save', 'restore')}}
          for k, v in results.items()}
  print(f'state: {mb:.0f} MB in 8 arrays over {jax.device_count()} devices, chunks of '
        f'{args.chunk_mb} MiB, best of {args.repeats}')
  print(f'{"store":6} {"save MB/s":>10} {"x local":>8} {"restore MB/s":>13} {"x local":>8} '
        f'{"requests/save":>14} {"requests/restore":>17} {"MB up/save":>11}')
  for kind, b in best.items():
    print(f'{kind:6} {mb / b["save"]:10.1f} {best["local"]["save"] / b["save"]:8.2f} '
          f'{mb / b["restore"]:13.1f} {best["local"]["restore"] / b["restore"]:8.2f} '
          f'{b.get("save_requests", 0):14.0f} {b.get("restore_requests", 0):17.0f} '
          f'{b.get("save_bytes", 0) / 1e6:11.1f}')
  print(f'load average after: {os.getloadavg()}')


if __name__ == '__main__':
  main()
