"""store/storage.py and the checkpoint, lock and log layers on it, against real servers.

The references are the servers themselves: moto's S3 server and the
fake-gcs-server GCS emulator (tests/servers.py), read back through their own
listings, and the same operations on local disk. Faults (503s, an outage, a
stalled server) come from tests/fault_proxy.py, a proxy between tensorstore
and the server. train.py runs in buckets are in tests/test_storage_e2e.py.
"""

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import errors
from fault_proxy import FaultProxy
from hosts import workdir_lock
from monitor import metrics
from store import step_dirs
from store import storage
from servers import gcs_server, s3_server  # noqa: F401  (fixtures)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=['local', 'gs', 's3'])
def root(request, tmp_path):
  """A fresh location of each kind: a local folder, a GCS bucket, an S3 bucket."""
  if request.param == 'local':
    return str(tmp_path / 'root')
  _, bucket = request.getfixturevalue('gcs_server' if request.param == 'gs' else 's3_server')
  return f'{request.param}://{bucket}/root'


def small_state():
  return {'params': {'w': jnp.arange(24, dtype=jnp.float32).reshape(4, 6),
                     'b': jnp.linspace(-1, 1, 7, dtype=jnp.bfloat16)},
          'count': np.int32(5)}


def host(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize('location', ['gcs://b/run', 'gs:/b/run', 'gs:b/run', 'hdfs://nn/x',
                                      's3://', 'file:///tmp/x', 'http://host/run'])
def test_unknown_or_malformed_urls_are_refused_in_one_line(location):
  with pytest.raises(errors.ConfigError, match='gs://BUCKET/PATH or s3://BUCKET/PATH'):
    storage.canonical(location)


def test_http_is_a_data_source_only():
  assert storage.canonical('https://host/data/x.npy', writes=False) == 'https://host/data/x.npy'
  assert storage.canonical('runs/a:b') == 'runs/a:b'  # a colon later in a path is no scheme


def test_workdir_typo_never_becomes_a_local_folder(tmp_path):
  out = subprocess.run([sys.executable, os.path.join(REPO, 'train.py'), '--workdir=gcs://b/run',
                        f'--config={REPO}/configs/small.py'],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
  assert out.returncode == errors.EXIT_USAGE
  assert out.stderr.strip().splitlines()[-1].startswith('error: --workdir=')
  assert os.listdir(tmp_path) == []


def test_files_and_objects_behave_alike(root):
  path = storage.join(root, 'dir', 'a.bin')
  storage.makedirs(storage.parent(path))
  payload = bytes(range(256)) * 40
  storage.write_atomic(path, payload)
  assert storage.read(path) == payload
  assert storage.size(path) == len(payload)
  assert storage.read_range(path, 1000, 1300) == payload[1000:1300]
  assert storage.read(storage.join(root, 'missing')) is None
  assert storage.size(storage.join(root, 'missing')) is None
  storage.append(storage.join(root, 'log'), 'one\n')
  storage.append(storage.join(root, 'log'), 'two\n')
  assert storage.read_text(storage.join(root, 'log')) == 'one\ntwo\n'
  assert storage.listdir(root) == ['dir', 'log']
  storage.rename_tree(storage.join(root, 'dir'), storage.join(root, 'moved'))
  assert storage.listdir(root) == ['log', 'moved']
  assert storage.read(storage.join(root, 'moved', 'a.bin')) == payload
  storage.delete_tree(storage.join(root, 'moved'))
  assert storage.listdir(root) == ['log']


@pytest.mark.parametrize('size', [1, 2, 3, 1000, 4096, 65537])
def test_remote_size_matches_the_object(s3_server, size):
  url = f's3://{s3_server[1]}/obj'
  storage.write(url, b'x' * size)
  assert storage.size(url) == size


def test_concurrent_appends_all_land(s3_server):
  """Conditional writes make a bucket append lossless under contention (moto honours
  If-Match; the GCS emulator does not, so this runs on S3)."""
  log = f's3://{s3_server[1]}/launcher.log'
  lines = [[f'{t}-{i}\n' for i in range(8)] for t in range(4)]
  threads = [threading.Thread(target=lambda ls=ls: [storage.append(log, x) for x in ls])
             for ls in lines]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(storage.read_text(log).splitlines()) == sorted(x.strip() for ls in lines for x in ls)


def test_checkpoint_in_a_bucket_restores_bit_identical(root):
  directory = storage.join(root, 'checkpoints')
  state = small_state()
  with checkpoint.Checkpointer(directory, keep_last=2, fsync=False) as ckpt:
    for step in (1, 2, 3):
      ckpt.save(step, state, {'data': {'step': step}})
      ckpt.wait()
    assert ckpt.committed_steps() == [2, 3]
    restored, meta = ckpt.restore_latest_good(host(state))
  assert meta == {'data': {'step': 3}, 'step': 3}
  for a, b in zip(jax.tree.leaves(host(state)), jax.tree.leaves(restored)):
    assert a.dtype == b.dtype and np.array_equal(a, b)
  assert storage.listdir(directory) == ['step_2', 'step_3']  # no staging left behind
  if storage.is_url(root):  # committed in place: COMMIT is one of the step's objects
    assert 'COMMIT' in storage.list_keys(storage.join(directory, 'step_3'))


@pytest.mark.parametrize('cut', ['before_metadata', 'before_commit'])
def test_an_uncommitted_prefix_is_ignored_then_tidied(gcs_server, cut, monkeypatch):
  """A save killed before COMMIT: not listed; the next Checkpointer removes it (chunks
  without metadata.json) or re-commits it (complete but for the marker)."""
  directory = f'gs://{gcs_server[1]}/run/checkpoints'
  with checkpoint.Checkpointer(directory, fsync=False) as ckpt:
    ckpt.save(1, small_state())
  real_write = storage.write_atomic  # metadata.json and COMMIT are written whole through it

  def killed(path, data, fsync=True):
    if cut == 'before_commit' and path.endswith('/COMMIT'):
      raise KeyboardInterrupt('killed')
    if cut == 'before_metadata' and path.endswith('metadata.json'):
      raise KeyboardInterrupt('killed')
    real_write(path, data, fsync)
  monkeypatch.setattr(storage, 'write_atomic', killed)
  ckpt = checkpoint.Checkpointer(directory, fsync=False)
  ckpt.save(2, small_state())
  with pytest.raises(checkpoint.CheckpointSaveError):
    ckpt.wait()
  monkeypatch.setattr(storage, 'write_atomic', real_write)
  # A kill leaves the prefix as it was; the failed save above removed its own. Re-create
  # what a kill leaves: the chunks (and metadata.json) without COMMIT.
  assert storage.listdir(directory) == ['step_1']
  staged, source = step_dirs.step_dir(directory, 2), step_dirs.step_dir(directory, 1)
  left = {'before_metadata': ('COMMIT', 'metadata.json'), 'before_commit': ('COMMIT',)}[cut]
  for key in storage.list_keys(source):
    if key not in left:
      storage.write(storage.join(staged, key), storage.read(storage.join(source, key)))
  assert step_dirs.committed_steps(directory) == [1]  # ignored while uncommitted
  with checkpoint.Checkpointer(directory, fsync=False):
    pass
  assert storage.listdir(directory) == (['step_1'] if cut == 'before_metadata'
                                        else ['step_1', 'step_2'])
  assert step_dirs.committed_steps(directory) == ([1] if cut == 'before_metadata' else [1, 2])


def test_a_corrupt_step_in_a_bucket_is_set_aside(s3_server):
  directory = f's3://{s3_server[1]}/run/checkpoints'
  with checkpoint.Checkpointer(directory, fsync=False) as ckpt:
    for step in (1, 2):
      ckpt.save(step, small_state())
      ckpt.wait()
  storage.write(storage.join(directory, 'step_2', 'arrays', 'params', 'w', 'c', '0', '0'), b'bad')
  _, meta = checkpoint.restore_latest_good(directory, host(small_state()))
  assert meta['step'] == 1
  aside, kept = storage.listdir(directory)
  assert aside.startswith('corrupt.step_2.') and kept == 'step_1'
  assert step_dirs.committed_steps(directory) == [1]


def test_bucket_lock_refuses_a_live_holder_and_takes_over_a_dead_one(s3_server):
  workdir = f's3://{s3_server[1]}/run'
  with workdir_lock.WorkdirLock(workdir):
    with pytest.raises(workdir_lock.WorkdirLockedError, match='in use by another training run'):
      with workdir_lock.WorkdirLock(workdir):
        pass
  assert storage.read(storage.join(workdir, 'LOCK')) == b''  # released: free, not stale
  for holder in ({'host': 'elsewhere', 'pid': 1, 'started': 'then', 'renewed': 0.0},
                 {'host': os.uname().nodename, 'pid': 2 ** 22 + 17, 'started': 'then',
                  'renewed': time.time()}):  # lease expired; a dead pid on this host
    storage.write(storage.join(workdir, 'LOCK'), json.dumps(holder).encode())
    with workdir_lock.WorkdirLock(workdir):
      assert json.loads(storage.read(storage.join(workdir, 'LOCK')))['pid'] == os.getpid()


def proc_identity(pid) -> dict:
  """A process's boot, PID namespace and start tick, read from procfs (proc(5)) here."""
  stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  return {'boot': pathlib.Path('/proc/sys/kernel/random/boot_id').read_text().strip(),
          'pidns': os.stat(f'/proc/{pid}/ns/pid').st_ino,
          'start': int(stat[stat.rindex(')') + 2:].split()[19])}


def test_bucket_lock_tells_a_reused_pid_from_a_live_holder(s3_server, caplog):
  """In a container the trainer is PID 1 after every restart, on the same hostname: the
  dead holder's PID is alive (the new trainer itself). Its start time tells them apart;
  a live holder on this host, with its own start time, is still refused."""
  workdir, here = f's3://{s3_server[1]}/pids', os.uname().nodename
  lock = storage.join(workdir, 'LOCK')
  own = proc_identity(os.getpid())
  dead = [  # each a holder renewed just now, so only its identity can make it stale
      {**own, 'pid': os.getpid(), 'start': own['start'] - 1},  # this PID, an earlier process
      {**own, 'pid': os.getpid(), 'pidns': own['pidns'] + 1},  # an earlier container's ns
  ]
  for holder in dead:
    storage.write(lock, json.dumps({'host': here, 'started': 'then', **holder,
                                    'renewed': time.time()}).encode())
    caplog.clear()
    with workdir_lock.WorkdirLock(workdir):
      assert json.loads(storage.read(lock))['start'] == own['start']
    assert 'Taking over the stale workdir lock' in caplog.text
  with subprocess.Popen(['sleep', '60']) as live:
    try:
      holder = {'host': here, 'pid': live.pid, 'started': 'then', **proc_identity(live.pid),
                'renewed': time.time()}
      storage.write(lock, json.dumps(holder).encode())
      with pytest.raises(workdir_lock.WorkdirLockedError) as refused:
        workdir_lock.WorkdirLock(workdir).__enter__()
      assert f'in use by another training run (host {here}, PID {live.pid}' in str(refused.value)
      assert '\n' not in str(refused.value)
      holder['start'] += 1  # the same PID, but not the process that took the lock
      storage.write(lock, json.dumps(holder).encode())
      with workdir_lock.WorkdirLock(workdir):
        assert json.loads(storage.read(lock))['pid'] == os.getpid()
    finally:
      live.kill()


def test_bucket_lock_create_is_conditional(s3_server):
  """Two runs that both read LOCK as absent: only one conditional create wins."""
  path = f's3://{s3_server[1]}/run/LOCK'
  _, generation = storage.read_versioned(path)
  assert generation == storage.MISSING
  assert storage.write(path, b'first', if_generation=generation) is not None
  assert storage.write(path, b'second', if_generation=generation) is None
  assert storage.read(path) == b'first'


def test_metrics_in_a_bucket_drop_what_a_resume_rewinds(gcs_server):
  workdir = f'gs://{gcs_server[1]}/run'
  writer = metrics.MetricWriter(workdir, 0, flush_seconds=0)  # every record its own object
  for step in range(1, 7):
    writer.write(step, {'train/CE loss': float(step)})
  writer.close()
  writer = metrics.MetricWriter(workdir, 4)  # resumed from a step-4 checkpoint
  writer.write(5, {'train/CE loss': 50.0})
  writer.close()
  records = metrics.read_records(workdir)
  assert [(r['step'], r['train/CE loss']) for r in records] == [
      (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]
  tensorboard = storage.join(workdir, 'tensorboard')
  steps, values = metrics.events.read_scalars(tensorboard, {'train/CE loss'})
  assert list(zip(steps, values)) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]


# --- Server faults: a proxy between tensorstore and the S3 server ------------------------

SAVE_SCRIPT = '''
import sys
sys.path.insert(0, {repo!r})
import jax.numpy as jnp, checkpoint
state = {{'w': jnp.arange(64 * 1024, dtype=jnp.float32).reshape(64, 1024)}}
ckpt = checkpoint.Checkpointer({directory!r}, fsync=False, chunk_bytes=16 << 10)
print('ready', flush=True)
sys.stdin.readline()  # the test starts its fault now
try:
  ckpt.save({step}, state)
  ckpt.wait()
  print('saved')
except (checkpoint.CheckpointSaveError, checkpoint.CheckpointReadError, OSError) as e:
  print('failed:', type(e).__name__, str(e)[:300])
'''


def save_through(proxy: FaultProxy, bucket: str, step: int, fault=None, **env: str):
  """Runs one checkpoint save in a child (its own retry settings) against `proxy`;
  `fault(proxy)` starts a fault once the child's Checkpointer is open, before the save.
  Returns (the child's last line, seconds the save took)."""
  script = SAVE_SCRIPT.format(repo=REPO, directory=f's3://{bucket}/run/checkpoints', step=step)
  child_env = dict(os.environ, AWS_ENDPOINT_URL=proxy.url, JAX_PLATFORMS='cpu', **env)
  child = subprocess.Popen([sys.executable, '-c', script], env=child_env, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  assert child.stdout.readline().strip() == 'ready', child.stderr.read()[-2000:]
  if fault:
    fault(proxy)
  start = time.monotonic()
  out, err = child.communicate('go\n', timeout=300)
  assert child.returncode == 0, err[-2000:]
  return out.strip().splitlines()[-1], time.monotonic() - start


def test_503s_are_retried_and_the_save_commits(s3_server):
  with FaultProxy(s3_server[0]) as proxy:
    result, _ = save_through(proxy, s3_server[1], 1, fault=lambda p: p.fail(3, status=503))
    assert result == 'saved'
    assert proxy.failing == 0  # the 503s were met and retried past
  directory = f's3://{s3_server[1]}/run/checkpoints'
  state, _ = checkpoint.restore(directory, {'w': np.zeros((64, 1024), np.float32)})
  assert np.array_equal(state['w'], np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024))


@pytest.mark.parametrize('when', ['start', 'middle'])
def test_an_outage_fails_the_save_and_commits_nothing(s3_server, when):
  """The service goes down before the save or halfway through its chunks: a clear error
  after the retries, nothing committed, and the next save (service back) commits."""
  directory = f's3://{s3_server[1]}/run/checkpoints'
  with FaultProxy(s3_server[0]) as proxy:
    proxy.reset_counts()
    result, _ = save_through(proxy, s3_server[1], 1)
    assert result == 'saved'
    after = sum(proxy.counts.values()) // 2 if when == 'middle' else 0
    result, _ = save_through(proxy, s3_server[1], 2, OLMO_STORAGE_RETRIES='1',
                             fault=lambda p: p.fail(10 ** 6, status=503, after=after))
    assert result.startswith('failed:')
    proxy.fail(0)
    assert step_dirs.committed_steps(directory) == [1]
    result, _ = save_through(proxy, s3_server[1], 3)
    assert result == 'saved'
  assert step_dirs.committed_steps(directory) == [1, 3]


@pytest.mark.slow
def test_a_stalled_server_is_abandoned_not_waited_on(s3_server):
  """Requests that hang: the stall limit aborts them, the retries run out, the save fails
  in bounded time with nothing committed."""
  directory = f's3://{s3_server[1]}/run/checkpoints'
  with FaultProxy(s3_server[0]) as proxy:
    result, seconds = save_through(proxy, s3_server[1], 1, fault=lambda p: p.stall(120),
                                   OLMO_STORAGE_STALL_SECONDS='2', OLMO_STORAGE_RETRIES='1')
  assert result.startswith('failed:')
  assert seconds < 60  # the stall lasts 120 s: only aborting it ends the save sooner
  assert step_dirs.committed_steps(directory) == []


@pytest.mark.parametrize('server', ['s3', 'gcs'])
def test_local_view_follows_the_object(server, request, tmp_path, monkeypatch):
  """Libraries that open only local files (tokenizers) get a local copy of a bucket object,
  checked against the object on every use: a replaced object is fetched again, a deleted
  one is an error, never the stale copy."""
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  bucket = request.getfixturevalue(f'{server}_server')[1]
  url = f'{"s3" if server == "s3" else "gs"}://{bucket}/mix/tokenizer.json'
  storage.write(url, b'{"tokenizer": 1}')
  path = storage.local_view(url)
  assert path.startswith(str(tmp_path / 'cache')) and open(path, 'rb').read() == b'{"tokenizer": 1}'
  assert storage.local_view(url + '/') == path  # one copy per object, whatever the spelling
  storage.write(url, b'{"tokenizer": 2, "another": "corpus"}')  # prepared again, same path
  assert open(storage.local_view(url), 'rb').read() == b'{"tokenizer": 2, "another": "corpus"}'
  storage.delete(url)
  with pytest.raises(FileNotFoundError):
    storage.local_view(url)
  with pytest.raises(FileNotFoundError):
    storage.local_view(str(tmp_path / 'missing.json'))
  assert storage.local_view('data/tokenizer.json') == 'data/tokenizer.json'
