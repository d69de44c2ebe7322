"""Multi-process training, elastic resize and a killed worker, for real on this machine.

Every run is `train.py` in subprocesses on simulated CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N per process), two-process
runs talk through jax.distributed on localhost with gloo collectives. The
references are independent of the code under test where it matters: the
instance ids each process must read come from numpy's PCG64 shuffle of the
raw token file (docs/data.md), and final parameters are read back straight from
the checkpoint's zarr arrays with tensorstore. Losses across different device
counts agree within reduction-order noise; runs with the same layout agree bit
for bit.

Shared with tests/test_launch.py: TINY, run_train, spawn_train, metrics,
final_params, wait_for_step.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorstore as ts

from servers import free_port
from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN_FILE = REPO / 'data' / 'shakespeare-train-00000.npy'
SEQ, BATCH, SEED = 64, 8, 34521
# configs/small.py shrunk so one step is milliseconds and a run is mostly start-up.
TINY = ['--config=configs/small.py', '--config.model.num_layers=4', '--config.model.d_model=64',
        '--config.model.num_heads=2', '--config.model.num_kv_heads=2',
        '--config.model.head_dim=32', '--config.model.mlp_hidden=128',
        '--config.model.sliding_window=16', f'--config.data.seq_len={SEQ}',
        f'--config.data.global_batch_size={BATCH}', '--config.train.micro_batch_size=1',
        '--config.train.log_every=1', '--config.train.eval_every=0',
        '--config.train.keep_last=100', '--config.train.peak_flops=1e12', '--sample_tokens=0',
        # The in-loop downstream tasks have their own tests (test_in_loop_eval.py); here they
        # would add a plan and a scoring pass to every run's end.
        '--config.train.downstream_eval_every=0']
LOSS_RTOL = 2e-5  # float32 sums over a different device split: reduction order only


def trainer_env(devices: int, **extra: str) -> dict[str, str]:
  return dict(os.environ, XLA_FLAGS=with_devices(devices),
              JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1', **extra)  # + conftest's cache


def train_args(workdir, steps: int, ckpt_every: int, *extra: str) -> list[str]:
  return [sys.executable, str(REPO / 'train.py'), *TINY, f'--config.train.steps={steps}',
          f'--config.train.ckpt_every={ckpt_every}', f'--workdir={workdir}', *extra]


def spawn_train(workdir, steps: int, ckpt_every: int, *extra: str, devices: int = 2,
                log=None, env_extra: dict[str, str] | None = None,
                command: list[str] | None = None) -> subprocess.Popen:
  """Starts train.py (or `command`) on `devices` simulated devices; output to `log`."""
  out = open(log, 'a') if log else subprocess.DEVNULL
  return subprocess.Popen(command or train_args(workdir, steps, ckpt_every, *extra), cwd=REPO,
                          env=trainer_env(devices, **(env_extra or {})), stdout=out,
                          stderr=subprocess.STDOUT, **({'text': True} if log else {}))


def run_train(workdir, steps: int, ckpt_every: int, *extra: str, devices: int = 2,
              expect_rc: int = 0, timeout: float = 300) -> str:
  """Runs train.py to completion and returns its output; asserts the exit code."""
  proc = subprocess.run(train_args(workdir, steps, ckpt_every, *extra), cwd=REPO,
                        env=trainer_env(devices), capture_output=True, text=True,
                        timeout=timeout)
  assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-5000:]
  return proc.stdout + proc.stderr


GLOO_RENDEZVOUS = 'Gloo context initialization failed'
PORT_TAKEN = 'is in use by another program'  # sharding.check_coordinator_port's refusal
# Start-up failures of a multi-process test run that a second try with a new port fixes.
RETRIED_STARTS = (GLOO_RENDEZVOUS, PORT_TAKEN)


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple]:
  """Every process's (stdout, stderr), read side by side so no pipe fills while another
  process is waited for. When process 0 refuses the coordinator's port, the others are
  killed at once: they would wait minutes for a coordinator that never comes."""
  outs: list = [None] * len(procs)
  readers = [threading.Thread(target=lambda i=i: outs.__setitem__(i, procs[i].communicate()),
                              daemon=True) for i in range(len(procs))]
  for reader in readers:
    reader.start()
  deadline = time.time() + timeout
  try:
    while any(reader.is_alive() for reader in readers):
      if time.time() > deadline:
        raise subprocess.TimeoutExpired(procs[0].args, timeout)
      if not readers[0].is_alive() and PORT_TAKEN in ''.join(filter(None, outs[0])):
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      p.kill()
    for reader in readers:
      reader.join()
  return outs


def run_two_processes(workdir, steps: int, ckpt_every: int, *extra: str,
                      wrapper: str | None = None, timeout: float = 300) -> list[str]:
  """Two train.py processes x 2 devices on localhost; returns both outputs.

  Gloo gives the processes 30 s (not configurable) to meet at their first
  collective; on an overloaded 2-core machine one may still be compiling, so
  that one failure is retried once.
  """
  for attempt in range(3):
    procs = spawn_two_processes(workdir, steps, ckpt_every, *extra, wrapper=wrapper)
    outs = [out for out, _ in communicate_all(procs, timeout)]
    if attempt < 2 and any(m in out for out in outs for m in RETRIED_STARTS):
      continue
    for p, out in zip(procs, outs):
      assert p.returncode == 0, out[-5000:]
    return outs


def process_args(workdir, steps: int, ckpt_every: int, i: int, port: int,
                 heartbeat_timeout: int | None, *extra: str) -> list[str]:
  """train.py's argv as process i of two meeting on localhost:`port`."""
  heartbeat = [f'--heartbeat_timeout={heartbeat_timeout}'] if heartbeat_timeout else []
  return train_args(workdir, steps, ckpt_every, *extra, f'--coordinator_address=127.0.0.1:{port}',
                    f'--process_id={i}', '--num_processes=2', *heartbeat)


def spawn_two_processes(workdir, steps: int, ckpt_every: int, *extra: str,
                        wrapper: str | None = None, log_dir=None,
                        heartbeat_timeout: int | None = None) -> list[subprocess.Popen]:
  """Two train.py processes x 2 devices. A short `heartbeat_timeout` only where a test
  kills a peer: two processes compiling on a loaded 2-core machine can miss a few seconds
  of heartbeats, and a run with no kill keeps train.py's default not to be taken for dead."""
  port = free_port()
  procs = []
  for i in range(2):
    args = process_args(workdir, steps, ckpt_every, i, port, heartbeat_timeout, *extra)
    if wrapper:
      args[1] = wrapper
    out = open(pathlib.Path(log_dir) / f'log{i}', 'w') if log_dir else subprocess.PIPE
    procs.append(subprocess.Popen(args, cwd=REPO, env=trainer_env(2), text=True,
                                  stdout=out, stderr=subprocess.STDOUT))
  return procs


def metrics(workdir) -> dict[int, dict[str, float]]:
  """Per step, the last record metrics.jsonl holds (a resumed run rewrites its steps)."""
  out = {}
  path = pathlib.Path(workdir) / 'metrics.jsonl'
  for line in path.read_text().splitlines():
    record = json.loads(line)
    out.setdefault(record['step'], {}).update(record)
  return out


def poll_until(done, proc: subprocess.Popen | None, what: str, timeout: float = 300,
               poll: float = 0.05):
  """Polls `done()` until it is true (returned); fails once `proc` has exited."""
  deadline = time.time() + timeout
  while True:
    exited = proc is not None and proc.poll() is not None  # first: `done` then sees the end
    if result := done():
      return result
    if exited:
      raise AssertionError(f'process {proc.pid} exited ({proc.returncode}) before {what}')
    if time.time() > deadline:
      raise AssertionError(f'no {what} within {timeout} s')
    time.sleep(poll)


def wait_for_step(workdir, step: int, proc: subprocess.Popen | None = None,
                  timeout: float = 300, since: int = 0) -> None:
  """Blocks until metrics.jsonl logs `step` after its first `since` lines (or proc exits)."""
  path = pathlib.Path(workdir) / 'metrics.jsonl'

  def logged():
    lines = path.read_text().splitlines()[since:] if path.exists() else []
    return any(json.loads(l)['step'] >= step for l in lines if l.endswith('}'))
  poll_until(logged, proc, f'step {step}', timeout)


def final_params(workdir, step: int | None = None) -> dict[str, np.ndarray]:
  """Params of a committed checkpoint, read directly from its zarr arrays."""
  ckpt = pathlib.Path(workdir) / 'checkpoints'
  if step is None:
    step = max(int(p.name[5:]) for p in ckpt.glob('step_*') if (p / 'COMMIT').exists())
  info = json.loads((ckpt / f'step_{step}' / 'metadata.json').read_text())
  out = {}
  for name in info['paths']:
    if name.startswith('params/'):
      spec = {'driver': 'zarr3', 'kvstore': {'driver': 'file',
                                              'path': str(ckpt / f'step_{step}' / 'arrays' / name)}}
      out[name] = ts.open(spec, open=True).result().read().result()
  return out


def assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert a.keys() == b.keys()
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def copy_checkpoints(src, dst, upto: int) -> None:
  """A workdir holding `src`'s committed checkpoints up to step `upto` (a resume point)."""
  for p in (pathlib.Path(src) / 'checkpoints').glob('step_*'):
    if int(p.name[5:]) <= upto:
      shutil.copytree(p, pathlib.Path(dst) / 'checkpoints' / p.name)


def expected_ids(step: int) -> np.ndarray:
  """Instance ids of global batch `step` (0-based), from numpy alone (docs/data.md)."""
  n = TRAIN_FILE.stat().st_size // 4 // SEQ
  order = np.arange(n, dtype=np.uint32)
  np.random.Generator(np.random.PCG64(SEED + 1)).shuffle(order)
  return order[step * BATCH:(step + 1) * BATCH]


# Wraps train.py to record which training instances this process reads.
ROW_RECORDER = '''
import json, os, sys
sys.path.insert(0, {repo!r})
sys.argv[0] = os.path.join({repo!r}, 'train.py')
import data, train
original = data.Dataset.read
def read(self, ids):
  if self.files[0].path.endswith('shakespeare-train-00000.npy'):
    with open(os.environ['ROWS_LOG'] + str(train.jax.process_index()), 'a') as f:
      f.write(json.dumps([int(i) for i in ids]) + '\\n')
  return original(self, ids)
data.Dataset.read = read
train.run()
'''


@pytest.fixture(scope='module')
def single4(tmp_path_factory):
  """The reference: one process, 4 devices, 6 steps, checkpoints every 2."""
  workdir = tmp_path_factory.mktemp('single4')
  run_train(workdir, 6, 2, devices=4)
  return workdir


@pytest.fixture(scope='module')
def two_process(tmp_path_factory):
  """Two processes x 2 devices, same config; each logs the instance ids it read."""
  workdir = tmp_path_factory.mktemp('two_process')
  wrapper = workdir / 'record_rows.py'
  wrapper.write_text(ROW_RECORDER.format(repo=str(REPO)))
  os.environ['ROWS_LOG'] = str(workdir / 'rows')
  try:
    run_two_processes(workdir, 6, 2, wrapper=str(wrapper))
  finally:
    del os.environ['ROWS_LOG']
  return workdir


def assert_params_close(a: dict, b: dict) -> None:
  """Params after a few steps on two device layouts: equal up to reduction order.

  Adam divides by sqrt(v): in embedding rows of tokens barely seen, gradients
  are ~0 and reduction-order noise becomes an O(lr) difference in the update
  (observed: 3-4 of 524,288 elements off by <= 5e-5). So nearly every element
  agrees to 1e-4 relative and none by more than one warmup LR step (1e-3).
  """
  for name in a:
    close = np.isclose(b[name], a[name], rtol=1e-4, atol=1e-6)
    assert close.mean() > 0.9999 and np.abs(b[name] - a[name]).max() < 1e-3, name


@pytest.mark.slow
def test_two_processes_match_one_and_read_only_their_rows(single4, two_process):
  one, two = metrics(single4), metrics(two_process)
  assert sorted(one) == sorted(two) == list(range(1, 7))
  for step in one:
    np.testing.assert_allclose(two[step]['train/CE loss'], one[step]['train/CE loss'],
                               rtol=LOSS_RTOL, err_msg=f'step {step}')
    assert two[step]['optim/LR'] == one[step]['optim/LR']
  # 4 batch shards of 8 rows: shard s holds positions s and s + 4; process p owns
  # devices 2p and 2p + 1 (jax orders devices by process).
  reads = [[json.loads(l) for l in (two_process / f'rows{p}').read_text().splitlines()]
           for p in range(2)]
  assert len(reads[0]) == len(reads[1]) >= 6  # prefetch may read ahead
  for step in range(6):
    ids = expected_ids(step)
    for p in range(2):
      mine = ids[[2 * p, 2 * p + 4, 2 * p + 1, 2 * p + 5]]
      assert sorted(reads[p][step]) == sorted(mine.tolist()), (step, p)
  # Written cooperatively: both processes' shards, one committed step.
  info = json.loads((two_process / 'checkpoints/step_6/metadata.json').read_text())
  assert info['process_count'] == 2
  a, b = final_params(single4), final_params(two_process)
  assert_params_close(a, b)


@pytest.mark.slow
def test_checkpoints_restore_in_either_layout(single4, two_process, tmp_path):
  # Two processes resume one process's step 4, and one process (2 devices) the
  # two processes' step 4; both must continue like the reference.
  to_two, to_one = tmp_path / 'to_two', tmp_path / 'to_one'
  copy_checkpoints(single4, to_two, upto=4)
  copy_checkpoints(two_process, to_one, upto=4)
  run_two_processes(to_two, 6, 2)
  run_train(to_one, 6, 2, devices=2)
  ref = metrics(single4)
  for workdir in (to_two, to_one):
    got = metrics(workdir)
    assert sorted(got) == [5, 6]
    for step in (5, 6):
      np.testing.assert_allclose(got[step]['train/CE loss'], ref[step]['train/CE loss'],
                                 rtol=LOSS_RTOL, err_msg=f'{workdir.name} step {step}')
      assert got[step]['optim/LR'] == ref[step]['optim/LR']


@pytest.mark.slow
def test_elastic_resize_8_2_8_keeps_batch_order_and_schedule(single4, tmp_path):
  # Lose 3/4 of the devices after step 2, get them back after step 4.
  for devices, steps in ((8, 2), (2, 4), (8, 6)):
    out = run_train(tmp_path, steps, 2, devices=devices)
    assert f'on {devices} devices' in out
  got, ref = metrics(tmp_path), metrics(single4)
  assert sorted(got) == list(range(1, 7))
  for step in got:
    np.testing.assert_allclose(got[step]['train/CE loss'], ref[step]['train/CE loss'],
                               rtol=LOSS_RTOL, err_msg=f'step {step}')
    assert got[step]['optim/LR'] == ref[step]['optim/LR']  # the schedule follows the step
    assert got[step]['throughput/total tokens'] == step * BATCH * SEQ
    assert got[step]['throughput/device/TPS'] > 0  # per-device, so scaling can be read off
  meta = json.loads((tmp_path / 'checkpoints/step_4/metadata.json').read_text())['metadata']
  assert (meta['data']['step'], meta['data']['global_batch_size']) == (4, BATCH)
  assert_params_close(final_params(single4), final_params(tmp_path))


def assert_one_line_naming(out: str, lost: int) -> None:
  """A survivor's output after a peer died: its one `error:` line names the lost process,
  and nothing of the abort it replaces (C++ fatal log and stack, faulthandler, traceback)."""
  lines = [line for line in out.splitlines() if line.startswith('error:')]
  assert len(lines) == 1 and f'process {lost} of this multi-process run was lost' in lines[0], (
      out[-5000:])
  for abort in ('Fatal Python error', 'Traceback', 'Check failure', 'std::bad_cast'):
    assert abort not in out, out[-5000:]
  assert not re.search(r'^F\d{4} ', out, re.M), out[-5000:]  # absl's FATAL lines: F1207 03:..


def kill_one(workdir, victim: int, steps: int, at: int) -> tuple[int, float]:
  """Two processes, heartbeat timeout 5 s; SIGKILLs process `victim` once step `at` is
  logged; (the survivor's exit code, seconds it took to exit)."""
  procs = spawn_two_processes(workdir, steps, 1, log_dir=workdir, heartbeat_timeout=5)
  try:
    wait_for_step(workdir, at, procs[0])
    procs[victim].send_signal(signal.SIGKILL)
    start = time.time()
    rc = procs[1 - victim].wait(timeout=120)  # the survivor must not hang in a collective
    return rc, time.time() - start
  finally:
    for p in procs:
      p.kill()


@pytest.mark.slow
def test_a_killed_worker_is_one_line_on_its_peer_and_resume_is_exact(two_process, tmp_path):
  # The survivor (process 0, the coordinator) is told by the coordination service once
  # process 1's heartbeats stop for heartbeat_timeout (hosts/peers.py).
  rc, took = kill_one(tmp_path, victim=1, steps=6, at=3)
  assert rc == 1 and took < 60, (rc, took)  # errors.EXIT_CRASH: restartable
  assert_one_line_naming((tmp_path / 'log0').read_text(), lost=1)
  committed = sorted(int(p.name[5:]) for p in (tmp_path / 'checkpoints').glob('step_*')
                     if (p / 'COMMIT').exists())
  assert committed and committed[-1] < 6
  run_two_processes(tmp_path, 6, 1)
  assert_bitwise_equal(final_params(tmp_path), final_params(two_process))


@pytest.mark.slow
def test_a_killed_coordinator_is_one_line_on_its_peer(tmp_path):
  rc, took = kill_one(tmp_path, victim=0, steps=30, at=12)
  assert rc == 1 and took < 60, (rc, took)
  assert_one_line_naming((tmp_path / 'log1').read_text(), lost=0)


def test_the_private_jax_call_peers_rely_on_is_still_there():
  """sharding.initialize_with_callback swaps jaxlib's client constructor while
  jax.distributed.initialize runs, to pass missed_heartbeat_callback (hosts/peers.py). A JAX
  that renames either, or stops calling it there, fails here rather than aborting again."""
  import inspect  # pylint: disable=g-import-not-at-top
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  doc = _jax.get_distributed_runtime_client.__doc__
  assert doc.startswith('get_distributed_runtime_client(address: str, node_id: int,'), doc
  assert 'missed_heartbeat_callback: collections.abc.Callable | None = None' in doc, doc
  assert 'self.client = _jax.get_distributed_runtime_client(\n        coordinator_address,' \
      '\n        process_id,' in inspect.getsource(distributed.State.initialize)


# Wraps train.py so that process 1 compiles its train step SLOW_COMPILE_S longer: a loaded
# host. (jaxlib's gloo gives a new device group's first collective a fixed 30 s to meet.)
SLOW_COMPILE_S = 45
SLOW_COMPILER = '''
import os, sys, time
sys.path.insert(0, {repo!r})
sys.argv[0] = os.path.join({repo!r}, 'train.py')
from monitor import goodput; import train
original = goodput.compile_ahead
class Slow:
  def __init__(self, step): self.step = step
  def trace(self, *args):
    if train.jax.process_index() == 1:
      time.sleep({seconds})
    return self.step.trace(*args)
  def __call__(self, *args): return self.step(*args)
goodput.compile_ahead = lambda step, *args, **kwargs: original(Slow(step), *args, **kwargs)
train.run()
'''


SLOW_HOST_TEST = 'test_a_host_that_compiles_longer_is_waited_for_not_failed'


@pytest.fixture(scope='module', autouse=True)
def slow_host(request, tmp_path_factory):
  """The slow-host run, started with the module's first test when its test is selected:
  its ~1 min is mostly process 1 sleeping (SLOW_COMPILE_S), which the other tests fill.
  Its output goes to files, read by its test once both processes end."""
  if not any(getattr(item, 'originalname', '') == SLOW_HOST_TEST
             for item in request.session.items):
    yield None
    return
  workdir = tmp_path_factory.mktemp('slow_host')
  wrapper = workdir / 'slow.py'
  wrapper.write_text(SLOW_COMPILER.format(repo=str(REPO), seconds=SLOW_COMPILE_S))
  procs = spawn_two_processes(workdir / 'run', 3, 3, wrapper=str(wrapper), log_dir=workdir)
  try:
    yield workdir, procs
  finally:
    for p in procs:
      p.kill()
      p.wait()


@pytest.mark.slow
def test_a_host_that_compiles_longer_is_waited_for_not_failed(slow_host):
  """A slow host is not a dead one: process 1 takes 45 s longer to compile its first step
  (as on a 2-core machine at load 8-10), and the run still finishes on both processes,
  without a gloo rendezvous failure (the processes meet after the compile)."""
  workdir, procs = slow_host
  deadline = time.time() + 400
  for p in procs:
    p.wait(timeout=max(1, deadline - time.time()))
  for i, p in enumerate(procs):
    out = (workdir / f'log{i}').read_text()
    assert p.returncode == 0 and GLOO_RENDEZVOUS not in out, out[-5000:]
  assert sorted(metrics(workdir / 'run')) == [1, 2, 3]


def test_cluster_detection_from_the_environment(monkeypatch):
  import sharding  # pylint: disable=g-import-not-at-top  (in-process: conftest's 8 devices)
  for var in ('JAX_COORDINATOR_ADDRESS', 'SLURM_NTASKS', 'SLURM_PROCID', 'TPU_WORKER_HOSTNAMES',
              'MEGASCALE_COORDINATOR_ADDRESS'):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setattr(sharding.glob, 'glob', lambda pattern: [])  # no TPU chips
  assert sharding.cluster_detected() is None  # one process: no jax.distributed
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'localhost')  # kernels.xla's libtpu stand-in
  assert sharding.cluster_detected() is None  # on a host without TPU chips: no pod
  monkeypatch.delenv('TPU_WORKER_HOSTNAMES')
  monkeypatch.setenv('SLURM_NTASKS', '1')
  monkeypatch.setenv('SLURM_PROCID', '0')
  assert sharding.cluster_detected() is None  # a one-task SLURM job is one process
  monkeypatch.setenv('SLURM_NTASKS', '16')
  assert sharding.cluster_detected() == 'SLURM'
  monkeypatch.delenv('SLURM_NTASKS')
  monkeypatch.setattr(sharding.glob, 'glob', lambda pattern: ['/dev/accel0'] * ('accel' in pattern))
  assert sharding.cluster_detected() == 'Cloud TPU'


def test_a_tpu_host_without_its_metadata_server_is_one_line_or_one_process(monkeypatch):
  """Seen on a single-chip TPU v5e host with no metadata server: JAX's slice detection
  ended in a requests traceback. The stand-in raises what JAX raised there."""
  import errors  # pylint: disable=g-import-not-at-top
  import sharding  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(sharding.glob, 'glob', lambda pattern: ['/dev/accel0'] * ('accel' in pattern))
  for var in ('JAX_COORDINATOR_ADDRESS', 'SLURM_NTASKS', 'TPU_WORKER_HOSTNAMES',
              'MEGASCALE_COORDINATOR_ADDRESS'):
    monkeypatch.delenv(var, raising=False)
  calls = []

  def unreachable(**kwargs):
    calls.append(kwargs)
    raise ConnectionError("HTTPConnectionPool(host='metadata.google.internal', port=80): Max "
                          'retries exceeded with url: /computeMetadata/v1/instance/attributes/'
                          'tpu-env')
  monkeypatch.setattr(sharding.jax.distributed, 'initialize', unreachable)
  monkeypatch.setattr(sharding.jax.config, 'update', lambda *a: None)  # keep this worker's
  with pytest.raises(errors.ConfigError, match='on a single host pass --num_processes=1'):
    sharding.init_distributed()
  assert len(calls) == 1
  sharding.init_distributed(num_processes=1)  # one process: nothing detected, nothing joined
  assert len(calls) == 1
  with pytest.raises(errors.ConfigError, match='given without'):
    sharding.init_distributed(num_processes=2)


@pytest.mark.parametrize('taken_on', ['127.0.0.1', ''])
def test_a_coordinator_port_in_use_is_one_line_naming_it(tmp_path, taken_on):
  """Process 0 serves the coordination service on every interface; a port another program
  holds (on loopback or everywhere) used to end in gRPC's segmentation fault."""
  with socket.socket() as holder:
    holder.bind((taken_on, 0))
    holder.listen()
    port = holder.getsockname()[1]
    proc = subprocess.run(
        train_args(tmp_path / 'run', 2, 1, f'--coordinator_address=127.0.0.1:{port}',
                   '--process_id=0', '--num_processes=2'),
        cwd=REPO, env=trainer_env(2), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
  assert len(lines) == 1 and f'port {port}' in lines[0] and PORT_TAKEN in lines[0], lines
  assert 'Segmentation fault' not in proc.stderr and not (tmp_path / 'run').exists()


def test_a_malformed_coordinator_address_is_one_line(tmp_path):
  proc = subprocess.run(
      train_args(tmp_path / 'run', 2, 1, '--coordinator_address=127.0.0.1', '--process_id=0',
                 '--num_processes=2'),
      cwd=REPO, env=trainer_env(2), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and 'is not host:port' in proc.stderr, proc.stderr[-3000:]
