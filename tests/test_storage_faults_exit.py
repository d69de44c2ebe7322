"""Storage faults through the command line: each one line, its exit class, a bounded time.

docs/storage.md's fault table, row by row: `python train.py --workdir=gs://... / s3://...`
(and scripts/launch.py where the restart is decided) against the suite's servers
(tests/servers.py: fake-gcs-server, moto) with tests/fault_proxy.py in between to deny,
fail, drop or cut short what the store answers. The references are the servers' own
answers (a bucket that is not there, a 403) and the proxy's record of every request.
"""

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import checkpoint
import errors
from fault_proxy import FaultProxy
from hosts import workdir_lock
import servers
from store import chunk_store
from store import kvstores
from store import storage
from servers import gcs_server, s3_server, upload  # noqa: F401  (fixtures)
from test_multihost import REPO, train_args, trainer_env

pytestmark = pytest.mark.slow  # each test starts train.py (JAX) at least once

DATA = REPO / 'data'
TRAIN = 'shakespeare-train-00000.npy'


def start(workdir: str, *extra: str, steps: int = 2, launcher: bool = False,
          **env: str) -> subprocess.Popen:
  """train.py (under scripts/launch.py with `launcher`) on `workdir`, its output piped."""
  argv = train_args(workdir, steps, 2, *extra)
  if launcher:
    argv = [sys.executable, str(REPO / 'scripts' / 'launch.py'), '--backoff=0',
            '--max_failures=3', '--stall_timeout=0', '--', *argv]
  return subprocess.Popen(argv, cwd=REPO, env=trainer_env(1, **env), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out + err


def one_line(output: str, code: int, rc: int, *named: str) -> str:
  """The run's one `error:` line, checked: its exit code, no traceback, the named texts."""
  assert rc == code, (rc, output[-4000:])
  assert 'Traceback' not in output, output[-4000:]
  lines = [line for line in output.splitlines() if line.startswith('error: ')]
  assert len(lines) == 1, output[-4000:]
  for text in named:
    assert text in lines[0], lines[0]
  return lines[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """A scratch XDG_CACHE_HOME for the children (a bucket workdir keeps its caches there)."""
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))


# --- Configuration faults: one line, exit 2, never restarted ---------------------------------


def test_a_bucket_that_does_not_exist_is_one_line_and_the_launcher_does_not_retry(
    gcs_server, s3_server, cache):
  missing = {'gs': f'gs://{servers.new_bucket_name("absent")}/run',
             's3': f's3://{servers.new_bucket_name("absent")}/run'}
  procs = {s: start(w, launcher=True) for s, w in missing.items()}
  for scheme, proc in procs.items():
    rc, output = finish(proc)
    bucket = storage.bucket_and_key(missing[scheme])[0]
    one_line(output, errors.EXIT_USAGE, rc, f'the bucket {bucket!r} does not exist')
    assert output.count('started pid') == 1, output[-4000:]
    assert 'not restarting' in output


@pytest.mark.parametrize('workdir, bucket', [('gs://Olmo3-Ckpts/run', 'Olmo3-Ckpts'),
                                             ('s3://ab/run', 'ab')])
def test_a_bucket_name_the_store_rejects_is_one_line_exit_2(gcs_server, s3_server, cache,
                                                          workdir, bucket):
  rc, output = finish(start(workdir))
  line = one_line(output, errors.EXIT_USAGE, rc)
  assert bucket in line and 'bucket' in line, line


@pytest.mark.parametrize('scheme, status', [('gs', 401), ('s3', 403)])
def test_denied_credentials_are_one_line_exit_2(gcs_server, s3_server, cache, scheme, status):
  endpoint, bucket = gcs_server if scheme == 'gs' else s3_server
  variable = 'TENSORSTORE_GCS_HTTP_URL' if scheme == 'gs' else 'AWS_ENDPOINT_URL'
  with FaultProxy(endpoint) as proxy:
    proxy.fail(10 ** 6, status=status)
    rc, output = finish(start(f'{scheme}://{bucket}/run', **{variable: proxy.url}))
  line = one_line(output, errors.EXIT_USAGE, rc, 'denied', f'http_response_code=\'{status}\'')
  assert ('GOOGLE_APPLICATION_CREDENTIALS' if scheme == 'gs' else 'AWS_ACCESS_KEY_ID') in line


# --- Unreachable storage: within one request's retry budget, said while it waits ------------

RETRIES = '3'  # 0.5 + 1 + 2 = 3.5 s of backoff: past the first "Still" line (NOTICE)
BUDGET = 3.5
NOTICE = '1'  # OLMO_STORAGE_NOTICE_SECONDS: the first "Still" line after 1 s, not 10


def test_a_failing_store_ends_within_one_retry_budget_and_keeps_no_log_there(s3_server, cache):
  """503s on every request: the run says what it retries while it waits, stops after one
  request's retries (the error's stack is not appended to error.log in the same store,
  which would wait them out again), and exits 1, which the launcher restarts."""
  endpoint, bucket = s3_server
  with FaultProxy(endpoint) as proxy:
    proxy.fail(10 ** 6, status=503)
    proc = start(f's3://{bucket}/run', AWS_ENDPOINT_URL=proxy.url,
                 OLMO_STORAGE_RETRIES=RETRIES, OLMO_STORAGE_NOTICE_SECONDS=NOTICE)
    rc, output = finish(proc)
    ended = time.monotonic()
    seen = list(proxy.requests)
  assert seen and not [r for r in seen if 'error.log' in r[2]], seen
  assert len(seen) == int(RETRIES) + 1, seen  # one request and its retries, nothing after
  assert ended - seen[0][0] < BUDGET + 10, (ended - seen[0][0], seen)
  one_line(output, errors.EXIT_CRASH, rc, f's3://{bucket}/run', "after the client's retries",
           proxy.url)
  still = [line for line in output.splitlines() if 'Still ' in line]
  assert still and 'OLMO_STORAGE_RETRIES' in still[0], output[-4000:]
  assert errors.EXIT_CRASH in errors.RESTARTABLE


def test_an_endpoint_that_refuses_or_a_missing_gcs_endpoint_variable_is_named(
    gcs_server, s3_server, cache, monkeypatch):
  with socket.socket() as s:  # a port nothing listens on: every connection refused
    s.bind(('127.0.0.1', 0))
    refused = f'http://127.0.0.1:{s.getsockname()[1]}'
  s3 = start(f's3://{s3_server[1]}/run', AWS_ENDPOINT_URL=refused, OLMO_STORAGE_RETRIES=RETRIES,
             OLMO_STORAGE_NOTICE_SECONDS=NOTICE)
  monkeypatch.delenv('TENSORSTORE_GCS_HTTP_URL')  # the real service, unreachable from here
  gs = start(f'gs://{gcs_server[1]}/run', OLMO_STORAGE_RETRIES=RETRIES,
             OLMO_STORAGE_NOTICE_SECONDS=NOTICE)
  for proc, named in ((s3, refused), (gs, 'TENSORSTORE_GCS_HTTP_URL')):
    began = time.monotonic()
    rc, output = finish(proc)
    one_line(output, errors.EXIT_CRASH, rc, named)
    assert any('Still ' in line for line in output.splitlines()), output[-4000:]
    assert time.monotonic() - began < 120, output[-4000:]


# --- An outage longer than the retries, whichever operation meets it first ----------------

OUTAGE_RETRIES = 2  # 0.5 + 1 s of backoff: a request gives up within ~2 s
# Where the store goes down (FaultProxy.outage's arguments) in a run of 8 steps that saves
# every 2, so steps 2 and 4 are committed before it.
OUTAGES = {
    # step 6's save, from its first request (an array's zarr.json, read before it is made)
    'save': [dict(method='GET', contains='/checkpoints/step_6/arrays/')],
    # the marker that commits step 6, written after its chunks and metadata.json
    'commit': [dict(method='POST', contains='/checkpoints/step_6/COMMIT')],
    # step 6's save fails on its own (COMMIT refused once with a 400: no outage yet); the
    # store goes down as the clean-up deletes what it wrote
    'cleanup': [dict(method='POST', contains='/checkpoints/step_6/COMMIT', n=1, status=400),
                dict(method='DELETE', contains='/checkpoints/step_6/')],
    # once step 4 is committed, every attempt of the next renewal of LOCK; nothing else fails
    'lease renewal': [dict(method='POST', contains='/checkpoints/step_4/COMMIT',
                           n=OUTAGE_RETRIES + 1, only='/LOCK')],
}


@pytest.fixture(scope='module')
def outage_runs(tmp_path_factory):
  """{operation: (workdir, its outages, exit code, output, when it ended)}: the four runs
  at once, each behind its own proxy in its own workdir of one bucket. Each is mostly
  start-up, saves to the emulator and retry backoff (sleeping), so together they take
  about as long as the slowest alone (~35 s each, one after another)."""
  try:
    bucket = contextlib.ExitStack()
    endpoint, name = bucket.enter_context(servers.gcs_bucket())
  except servers.ServerUnavailable as e:
    pytest.skip(str(e))
  with bucket, contextlib.ExitStack() as proxies, pytest.MonkeyPatch.context() as env:
    env.setenv('XDG_CACHE_HOME', str(tmp_path_factory.mktemp('xdg')))  # as `cache` does
    runs = {}
    for i, operation in enumerate(OUTAGES):
      proxy = proxies.enter_context(FaultProxy(endpoint))
      outages = [proxy.outage(**outage) for outage in OUTAGES[operation]]
      workdir = f'gs://{name}/run{i}'
      runs[operation] = (workdir, outages, start(
          workdir, steps=8, TENSORSTORE_GCS_HTTP_URL=proxy.url,
          OLMO_STORAGE_RETRIES=str(OUTAGE_RETRIES),
          OLMO_LOCK_LEASE_SECONDS='1'))  # renewed every 0.25 s
    ended = {}

    def wait(operation):  # each run's own end, for its time bound
      proc = runs[operation][2]
      try:
        rc, output = finish(proc)
      except subprocess.TimeoutExpired:  # its test fails on the exit code, with the output
        proc.kill()
        rc, output = 'timed out', ''.join(proc.communicate())
      ended[operation] = (rc, output, time.monotonic())
    waiters = [threading.Thread(target=wait, args=(op,)) for op in runs]
    for w in waiters:
      w.start()
    for w in waiters:
      w.join()
    yield {op: (workdir, outages, *ended[op]) for op, (workdir, outages, _) in runs.items()}


@pytest.mark.parametrize('operation', list(OUTAGES))
def test_an_outage_longer_than_the_retries_is_one_line_and_loses_no_checkpoint(
    outage_runs, operation):
  """The store goes down as `operation` begins, for longer than OLMO_STORAGE_RETRIES: one
  `error:` line, exit 1 (the launcher restarts it), no traceback, within a bounded time;
  the steps committed before it stay committed and restore in full (every chunk read back
  against its checksum)."""
  workdir, outages, rc, output, ended = outage_runs[operation]
  assert all(o['armed'] for o in outages), outages  # the store went down where meant
  line = one_line(output, errors.EXIT_CRASH, rc, workdir)
  if operation == 'lease renewal':  # the only request that failed
    assert 'Cannot renew the workdir lease' in line, line
  # Not one retry budget per array of the save, as when each array's open was waited for
  # in turn (~125 s for this model's ~50 arrays; ~15-25 s now).
  assert ended - outages[-1]['armed'] < 90, ended - outages[-1]['armed']
  directory = f'{workdir}/checkpoints'
  steps = checkpoint.committed_steps(directory)
  assert steps[:2] == [2, 4] and (operation == 'lease renewal' or steps == [2, 4]), steps
  for step in steps:
    for name in chunk_store.read_info(f'{directory}/step_{step}')['paths']:
      checkpoint.read_array(directory, name, step=step)


# --- The lease -----------------------------------------------------------------------------


def test_a_lost_answer_to_the_lock_create_does_not_refuse_its_own_trainer(s3_server, cache):
  """The create of LOCK lands but its answer is lost; the client's retry meets the object
  (412, as real GCS and moto answer If-None-Match): the trainer finds its own entry."""
  endpoint, bucket = s3_server
  workdir = f's3://{bucket}/run'
  with FaultProxy(endpoint) as proxy:
    proxy.lose(1, 'PUT', '/LOCK')
    rc, output = finish(start(workdir, AWS_ENDPOINT_URL=proxy.url))
    puts = [r for r in proxy.requests if r[1] == 'PUT' and r[2].split('?')[0].endswith('/LOCK')]
  assert rc == 0, output[-4000:]
  assert proxy.losing == 0 and len(puts) >= 3, puts  # lost create, its retry, ..., release
  assert 'in use by another training run' not in output
  assert storage.read(f'{workdir}/{workdir_lock.LOCK}') == b''  # released at the end
  # Keys in the environment (servers.s3_bucket sets them): no error line about ~/.aws files.
  assert '.aws/config' not in output and '.aws/credentials' not in output, output[-4000:]


def _lock_of(host: str, renewed: float) -> bytes:
  return json.dumps({'host': host, 'pid': 4242, 'started': '2026-01-01T00:00:00+00:00',
                     'renewed': renewed}).encode()


def test_a_lease_left_by_a_replaced_host_is_waited_out_and_a_renewed_one_refused(
    gcs_server, cache):
  """A host lost in a preemption leaves a LOCK naming it, renewed moments ago: its
  replacement waits for the lease to expire (saying so) and takes it over. A LOCK its
  holder keeps renewing is refused once the renewal is seen."""
  lease = 6  # seconds: long enough to see the live holder renew (every 1 s)
  lost, live = f'gs://{gcs_server[1]}/lost', f'gs://{gcs_server[1]}/live'
  storage.write(f'{lost}/LOCK', _lock_of('preempted-host', time.time()))
  storage.write(f'{live}/LOCK', _lock_of('other-host', time.time()))
  stop = threading.Event()

  def renew():  # the live holder, renewing every second
    while not stop.wait(1):
      storage.write(f'{live}/LOCK', _lock_of('other-host', time.time()))
  renewer = threading.Thread(target=renew, daemon=True)
  renewer.start()
  try:
    began = time.time()
    waited = start(lost, OLMO_LOCK_LEASE_SECONDS=str(lease))
    refused = start(live, OLMO_LOCK_LEASE_SECONDS=str(lease))
    rc, output = finish(refused)
    one_line(output, errors.EXIT_USAGE, rc, 'in use by another training run (host other-host')
    assert 'waiting up to' in output
  finally:
    stop.set()
    renewer.join()
  rc, output = finish(waited)
  assert rc == 0, output[-4000:]
  assert 'waiting up to' in output and 'preempted-host' in output
  assert 'Taking over the stale workdir lock' in output and 'not renewed for' in output
  assert time.time() - began >= lease


# --- Token files ---------------------------------------------------------------------------

TOKEN_FLAGS = ('--config.data.mix_file=', '--config.data.vocab_size=8192',
               '--config.data.eos_token_id=0', '--config.data.pad_token_id=1',
               '--config.train.ckpt_every=100')


def test_a_short_reply_to_a_range_request_is_retried_not_called_a_replaced_file(
    s3_server, cache, tmp_path):
  endpoint, bucket = s3_server
  root = f's3://{bucket}/corpus'
  upload(root, {TRAIN: (DATA / TRAIN).read_bytes()})
  with FaultProxy(endpoint) as proxy:
    proxy.shorten(2, by=64)  # two answers of more than 64 bytes lose their last 64
    rc, output = finish(start(str(tmp_path / 'run'), *TOKEN_FLAGS,
                              f'--config.data.paths=("{root}/{TRAIN}",)',
                              AWS_ENDPOINT_URL=proxy.url))
  assert rc == 0, output[-4000:]
  assert proxy.shortening == 0  # both cut short, and read again
  assert 'replaced while the run read it' not in output


def test_corrupt_bytes_in_a_remote_token_file_are_a_data_error_line(gcs_server, cache, tmp_path):
  root = f'gs://{gcs_server[1]}/corpus'
  tokens = np.fromfile(DATA / TRAIN, '<u4')
  tokens[::97] = 70000  # past vocab_size 8192, too often to be a stray id
  upload(root, {TRAIN: tokens.tobytes()})
  rc, output = finish(start(str(tmp_path / 'run'), *TOKEN_FLAGS,
                            f'--config.data.paths=("{root}/{TRAIN}",)'))
  one_line(output, errors.EXIT_DATA, rc, f'{root}/{TRAIN}', 'token id 70000', 'vocab_size 8192')


class _LateFuture:
  """A future whose wait times out just as it ends (the race a loaded machine makes): the
  first `result(timeout)` raises the wait's TimeoutError, after which it is done."""

  def __init__(self, outcome):
    self.outcome, self.waited = outcome, False

  def result(self, timeout=None):
    if timeout is not None and not self.waited:
      self.waited = True
      raise TimeoutError  # the wait's, not the operation's
    if isinstance(self.outcome, Exception):
      raise self.outcome
    return self.outcome

  def done(self):
    return self.waited


def test_an_operation_ending_as_the_wait_times_out_gives_its_own_outcome():
  assert kvstores.result(_LateFuture('value'), 'deleting', 'gs://b/x') == 'value'
  with pytest.raises(ValueError, match='its own'):
    kvstores.result(_LateFuture(ValueError('its own')), 'deleting', 'gs://b/x')


@pytest.mark.parametrize('value', ['0', '-5', 'soon'])
def test_a_notice_interval_below_one_second_or_not_a_number_is_refused(monkeypatch, value):
  monkeypatch.setenv('OLMO_STORAGE_NOTICE_SECONDS', value)
  with pytest.raises(errors.ConfigError, match='OLMO_STORAGE_NOTICE_SECONDS'):
    kvstores.notice_seconds()
