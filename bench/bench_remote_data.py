"""Reading batches from object storage and HTTP vs local disk: time and requests per step.

  python bench/bench_remote_data.py [--steps=20 --global_batch_size=64 --seq_len=8192]
      [--num_files=8 --file_tokens=4194304 --delay_ms=0]

Writes random uint32 token files, serves the same bytes from the GCS emulator
(fake-gcs-server, gs://) and from a range-capable HTTP server (tests/servers.py,
http://), then reads the batches of `--steps` steps of data.Loader's order from
each, and from local disk (memory maps, page cache warm). For each store: the
inspection time at start-up, seconds per step, the ratio to local disk, and
requests per step: counted by the HTTP server itself, and for GCS from the
emulator's request log. A second pass with data.remote_cache_dir set shows the
cached read (no requests). `--delay_ms` makes the HTTP server wait that long
per answer, a stand-in for a distant store's latency. Both servers run on this
machine, so the times measure the client (request handling, concurrency), not
a network; the lead takes the real numbers on a cloud machine.
"""

import os
import shutil
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, 'tests')]
import data  # noqa: E402  pylint: disable=wrong-import-position
import servers  # noqa: E402  pylint: disable=wrong-import-position  (tests/servers.py)

_STEPS = flags.DEFINE_integer('steps', 20, 'Global batches read per store.')
_BATCH = flags.DEFINE_integer('global_batch_size', 64, 'Instances per batch.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 8192, 'Tokens per instance (32 KiB each at 8192).')
_NUM_FILES = flags.DEFINE_integer('num_files', 8, 'Token files.')
_FILE_TOKENS = flags.DEFINE_integer('file_tokens', 1 << 22, 'Tokens per file.')
_DELAY_MS = flags.DEFINE_integer('delay_ms', 0, 'HTTP server: milliseconds per answer.')

VOCAB, EOS, PAD, SEED = 100278, 100257, 100277, 34521  # dolma2, pretrain-1 seed


def make_files(directory: str) -> dict[str, bytes]:
  rng = np.random.default_rng(0)
  files = {}
  for i in range(_NUM_FILES.value):
    content = rng.integers(0, VOCAB, _FILE_TOKENS.value, dtype=np.uint32).tobytes()
    with open(os.path.join(directory, f'part-{i:05d}.npy'), 'wb') as f:
      f.write(content)
    files[f'part-{i:05d}.npy'] = content
  return files


def open_dataset(paths: list[str], cache_dir: str = '') -> tuple[data.Dataset, float]:
  """The dataset and the seconds its start-up inspection took."""
  start = time.time()
  ds = data.Dataset(paths, seq_len=_SEQ_LEN.value, vocab_size=VOCAB, eos_token_id=EOS,
                    pad_token_id=PAD, remote_cache_dir=cache_dir)
  return ds, time.time() - start


def read_steps(ds: data.Dataset) -> tuple[float, list[np.ndarray]]:
  """(seconds per step, the batches) for `--steps` steps of epoch 1's order."""
  start = time.time()
  out = [ds.read(data.global_batch_ids(ds, SEED, 1, step, _BATCH.value))
         for step in range(_STEPS.value)]
  return (time.time() - start) / _STEPS.value, out


def main(argv):
  del argv
  work = tempfile.mkdtemp(prefix='bench_remote_data-')
  try:
    www = os.path.join(work, 'www')
    os.makedirs(www)
    files = make_files(www)
    names = sorted(files)
    needed = _STEPS.value * _BATCH.value
    available = _NUM_FILES.value * (_FILE_TOKENS.value // _SEQ_LEN.value)
    if needed > available:
      raise app.UsageError(f'{_STEPS.value} steps of {_BATCH.value} need {needed} instances; the '
                           f'files hold {available}: raise --num_files or --file_tokens.')
    print(f'{_NUM_FILES.value} files x {_FILE_TOKENS.value:,} tokens; {_STEPS.value} steps of '
          f'{_BATCH.value} x {_SEQ_LEN.value} tokens ({_BATCH.value * _SEQ_LEN.value * 4 / 2**20:.1f} '
          'MiB per step)')
    local, _ = open_dataset([os.path.join(www, n) for n in names])
    read_steps(local)  # warms the page cache
    local_step, want = read_steps(local)
    print(f'{"local disk":<24} inspect      -   {local_step * 1e3:8.1f} ms/step   1.00x')
    rows = []
    with servers.http_server(www) as (url, stats):
      stats.delay = _DELAY_MS.value / 1000
      for cached in (False, True):
        cache = os.path.join(work, 'cache') if cached else ''
        for _ in range(1 + cached):  # cached: the first pass fills the cache, the second reads it
          ds, inspected = open_dataset([f'{url}/{n}' for n in names], cache)
          stats.requests.clear()
          per_step, got = read_steps(ds)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), 'HTTP batches differ'
        rows.append(('http' + (' (cached)' if cached else ''), inspected, per_step,
                     len(stats.requests) / _STEPS.value))
    try:
      with servers.gcs_bucket() as (_, bucket):
        root = f'gs://{bucket}/tokens'
        servers.upload(root, files)
        ds, inspected = open_dataset([f'{root}/{n}' for n in names])
        time.sleep(0.2)  # the emulator's log of the inspection
        before = servers.count_gcs_reads(bucket)
        per_step, got = read_steps(ds)
        time.sleep(0.2)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), 'GCS batches differ'
        rows.append(('gs (fake-gcs-server)', inspected, per_step,
                     (servers.count_gcs_reads(bucket) - before) / _STEPS.value))
    except servers.ServerUnavailable as e:
      print(f'gs: skipped ({e})')
    for name, inspected, per_step, requests in rows:
      print(f'{name:<24} inspect {inspected:6.2f} s {per_step * 1e3:8.1f} ms/step '
            f'{per_step / local_step:6.2f}x   {requests:6.1f} requests/step')
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  app.run(main)
