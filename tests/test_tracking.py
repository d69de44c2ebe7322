"""monitor/tracking.py: Weights & Biases through the real client, offline, read back from its files.

The tiny model of tests/test_train.py trains with train.wandb.project set and
WANDB_MODE=offline (WANDB_DIR in tmp). W&B's offline run file
(wandb/offline-run-*/run-<id>.wandb) is a LevelDB-style log of protobuf
records (wandb.proto.wandb_internal_pb2.Record); the installed wandb 0.31 has
no reader for it, so `wandb_runs` below reads it (every chunk's CRC-32 is
checked). Asserted: W&B holds every metrics.jsonl record at the same step
(the named held-out sets' among them), the config and the code version; a run
killed with SIGKILL and resumed continues the same W&B run id; with the
service unreachable, training is not slower than with W&B off and nothing
raises; an init that hangs costs log() nothing and close() a bounded wait.
"""

import glob
import json
import os
import signal
import struct
import subprocess
import threading
import time
import zlib

import pytest

wandb = pytest.importorskip('wandb')  # pip install '.[wandb]'
from wandb.proto import wandb_internal_pb2  # noqa: E402

import config_checks  # noqa: E402
import errors  # noqa: E402
from monitor import metrics  # noqa: E402
from monitor import tracking  # noqa: E402
from servers import free_port  # noqa: E402
from store import storage  # noqa: E402
import train  # noqa: E402
from test_train import (REPO, STEPS, child_command, logged_steps,  # noqa: E402,F401
                        tiny_config, token_files)

PROJECT = 'olmo3-jax-tests'
SET = 'shakespeare-validation'  # a named held-out set: the validation file under another name


# --- Reading what W&B wrote --------------------------------------------------------------


def _chunks(path: str) -> list[bytes]:
  """The records of a .wandb file: a 7-byte header (':W&B', 0xBEE1, version), then LevelDB
  log blocks of 32 KiB holding [crc32 u32, length u16, type u8] + payload chunks
  (type 1 whole, 2/3/4 first/middle/last); a block's tail shorter than a header is padding."""
  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B', path
  out, pending, pos = [], b'', 7
  while pos + 7 <= len(data):
    left = 32768 - pos % 32768
    if left < 7:
      pos += left
      continue
    crc, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    if kind == 0:  # zero padding to the block's end
      pos += left
      continue
    chunk = data[pos + 7:pos + 7 + length]
    if len(chunk) < length:
      break  # the last record, cut by a kill
    assert crc == zlib.crc32(bytes([kind]) + chunk), f'{path}: bad CRC at {pos}'
    pos += 7 + length
    if kind == 1:
      out.append(chunk)
    elif kind == 2:
      pending = chunk
    elif kind == 3:
      pending += chunk
    elif kind == 4:
      out.append(pending + chunk)
  return out


def wandb_runs(root) -> list[dict]:
  """Each offline run under `root`/wandb, oldest first: {'id', 'config', 'history'}, history
  {step: {name: value}} without W&B's own `_step`, `_runtime`, `_timestamp`."""
  runs = []
  for path in sorted(glob.glob(os.path.join(root, 'wandb', 'offline-run-*', 'run-*.wandb'))):
    run = {'id': None, 'config': {}, 'history': {}}
    for chunk in _chunks(path):
      record = wandb_internal_pb2.Record.FromString(chunk)
      kind = record.WhichOneof('record_type')
      if kind == 'run':
        run['id'] = record.run.run_id
        run['config'].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
      elif kind == 'config':
        run['config'].update({i.key: json.loads(i.value_json) for i in record.config.update})
      elif kind == 'history':
        items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json)
                 for i in record.history.item}
        run['history'].setdefault(record.history.step.num, {}).update(
            {k: v for k, v in items.items() if not k.startswith('_')})
    runs.append(run)
  return runs


def jsonl_by_step(workdir) -> dict[int, dict]:
  out: dict[int, dict] = {}
  for record in metrics.read_records(str(workdir)):
    out.setdefault(record.pop('step'), {}).update(record)
  return out


def fresh_wandb(monkeypatch) -> None:
  """A new W&B session for this test: wandb keeps one per process (its settings read from the
  environment once, its service named in WANDB_SERVICE), and an earlier test's would win."""
  wandb.teardown()
  monkeypatch.delenv('WANDB_SERVICE', raising=False)


@pytest.fixture
def offline(tmp_path, monkeypatch):
  fresh_wandb(monkeypatch)
  root = tmp_path / 'wandb_dir'
  root.mkdir()
  for name, value in {'WANDB_MODE': 'offline', 'WANDB_DIR': str(root), 'WANDB_SILENT': 'true',
                      'WANDB_DISABLE_GIT': 'true'}.items():
    monkeypatch.setenv(name, value)
  return root


def wandb_config(token_files, named_set: bool = True, init_timeout: float = 60.0,
                 **train_changes):
  cfg = tiny_config(token_files, **{f'train.{k}': v for k, v in train_changes.items()})
  cfg.train.wandb.project = PROJECT
  cfg.train.wandb.init_timeout = init_timeout
  if named_set:
    cfg.data.validation_sets = {SET: (token_files[1],)}
  return cfg


# --- Tests -------------------------------------------------------------------------------


def test_offline_run_holds_the_metrics_the_config_and_the_version(token_files, offline,
                                                                    tmp_path):
  workdir = tmp_path / 'run'
  cfg = wandb_config(token_files)
  train.train(cfg, str(workdir))

  [run] = wandb_runs(offline)
  assert run['id'] == (workdir / tracking.RUN_ID_FILE).read_text().strip()
  logged = jsonl_by_step(workdir)
  assert sorted(run['history']) == sorted(logged) == list(range(1, STEPS + 1))
  for step, record in logged.items():
    assert run['history'][step] == record, step  # the same names, the same floats
  for step in (4, 8):  # eval_every=4: each named set is scored on the same machinery
    assert logged[step][f'eval/lm/{SET}/CE loss'] == logged[step]['eval/lm/validation/CE loss']
    assert logged[step][f'eval/lm/{SET}/PPL'] == logged[step]['eval/lm/validation/PPL']
    assert logged[step]['eval/lm/time (s)'] > 0
  saved = json.loads(json.dumps(cfg.to_dict()))  # tuples -> lists, as W&B stores them
  for group in ('model', 'data', 'opt', 'train'):
    assert run['config'][group] == saved[group], group
  assert run['config']['data']['validation_sets'] == {SET: [token_files[1]]}
  assert run['config']['code_version'] == metrics.code_version()


def held_by_wandb(runs: list[dict]) -> dict[int, dict]:
  """What the W&B server holds once the offline runs are synced in order: a row is taken
  only at a step above every step it holds (wandb's rule for a resumed run's steps)."""
  held: dict[int, dict] = {}
  for run in runs:
    for step in sorted(run['history']):
      if not held or step > max(held):
        held[step] = run['history'][step]
  return held


def test_sigkilled_run_loses_no_record_up_to_its_checkpoint(token_files, offline, tmp_path,
                                                            monkeypatch):
  """train.py with only $WANDB_PROJECT set (honoured as the project), SIGKILLed while it
  waits for batch 5 (checkpoint 4 committed, step 5 logged) without waiting for W&B to write
  anything, then run again to the end: W&B holds every metrics.jsonl record, steps 1-4
  included, in one W&B run. Before, the resumed run logged only steps 5-8, and the killed
  service had written none of 1-4 (its file goes out in 32 KiB blocks)."""
  monkeypatch.setenv('WANDB_PROJECT', PROJECT)
  workdir = tmp_path / 'run'
  argv, env = child_command(workdir, token_files, devices=1, hang_at=5)
  env.pop('WANDB_SERVICE', None)  # the child starts its own W&B service, as train.py would
  proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 300
    while not (os.path.exists(workdir / 'checkpoints' / 'step_4' / 'COMMIT')
               and logged_steps(workdir) >= 5):
      assert proc.poll() is None, proc.stdout.read()
      assert time.time() < deadline, 'the child never reached step 5'
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  run_id = (workdir / tracking.RUN_ID_FILE).read_text().strip()
  killed = _history_steps(offline)
  print(f'steps the killed run\'s W&B file holds: {sorted(killed)}')

  argv, env = child_command(workdir, token_files, devices=1)
  env.pop('WANDB_SERVICE', None)
  resumed = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Resumed from step 4' in resumed.stderr
  runs = wandb_runs(offline)
  # The killed run's file may hold nothing at all (W&B's buffer died with it): no id then;
  # killed early enough, its W&B service never made the file: the resumed run's alone.
  assert len(runs) in (1, 2) and runs[-1]['id'] == run_id
  assert {r['id'] for r in runs} - {None} == {run_id}
  assert runs[-1]['config']['train']['wandb']['project'] == ''  # the project came from the env
  logged = jsonl_by_step(workdir)
  assert sorted(logged) == list(range(1, STEPS + 1))
  assert held_by_wandb(runs) == logged
  assert (workdir / tracking.FINISHED_FILE).read_text().split() == [run_id, str(STEPS)]


def _history_steps(root) -> set[int]:
  try:
    return {s for run in wandb_runs(root) for s in run['history']}
  except (AssertionError, Exception):  # pylint: disable=broad-except  # a file mid-write
    return set()


def test_unreachable_service_neither_slows_nor_stops_training(token_files, tmp_path,
                                                              monkeypatch):
  """W&B online against a closed local port: wandb.init retries on the tracker's own thread
  until it gives up, every record is dropped (counted), the losses are those of W&B off,
  and no call the training loop makes waits on W&B. (Step-time ratios belong to bench/,
  not to a test on a shared CI machine: they are asserted here through where the time
  goes, not through a ratio of two noisy runs.)"""
  steps = dict(steps=10, ckpt_every=10, eval_every=0, log_every=1, track_repeats=False)
  off = tmp_path / 'off'
  train.train(tiny_config(token_files, **{f'train.{k}': v for k, v in steps.items()}),
              str(off))

  fresh_wandb(monkeypatch)
  for name, value in {'WANDB_MODE': 'online', 'WANDB_BASE_URL': f'http://127.0.0.1:{free_port()}',
                      'WANDB_API_KEY': 'x' * 40, 'WANDB_DIR': str(tmp_path),
                      'WANDB_SILENT': 'true'}.items():
    monkeypatch.setenv(name, value)
  made, inits, calls = [], [], []
  for_run = tracking.Tracker.for_run
  monkeypatch.setattr(tracking.Tracker, 'for_run',
                      classmethod(lambda cls, *a: made.append(for_run(*a)) or made[-1]))
  real_init = wandb.init

  def timed_init(**kwargs):
    start = time.perf_counter()
    try:
      return real_init(**kwargs)
    finally:
      inits.append((threading.current_thread().name, time.perf_counter() - start))
  monkeypatch.setattr(wandb, 'init', timed_init)
  for name in ('log', 'resume'):  # every call the training side makes into the tracker
    real = getattr(tracking.Tracker, name)

    def timed(self, *a, _real=real, _name=name):
      start = time.perf_counter()
      _real(self, *a)
      calls.append((_name, time.perf_counter() - start))
    monkeypatch.setattr(tracking.Tracker, name, timed)
  on = tmp_path / 'on'
  train.train(wandb_config(token_files, named_set=False, init_timeout=5.0, **steps), str(on))

  [tracker] = made
  assert 'wandb.init failed' in tracker.failed
  assert tracker.dropped == len(metrics.read_records(str(on)))  # every record, none raised
  losses = lambda w: [r['train/CE loss'] for r in metrics.read_records(str(w))
                      if 'train/CE loss' in r]
  assert losses(on) == losses(off)
  [(thread, waited)] = inits
  assert thread == 'wandb-tracker' and waited > 1.0, inits  # it retried, off the loop
  assert len([c for c in calls if c[0] == 'log']) == len(metrics.read_records(str(on)))
  slowest = max(t for _, t in calls)
  print(f'wandb.init retried {waited:.1f} s on its thread; slowest tracker call {slowest:.4f} s')
  assert slowest < waited / 10, calls  # an enqueue, never a wait on the retrying init


def test_hanging_init_costs_log_nothing_and_close_a_bounded_wait(monkeypatch):
  release = threading.Event()

  def hanging_init(**kwargs):
    release.wait()
    raise RuntimeError('released')
  monkeypatch.setattr(wandb, 'init', hanging_init)
  tracker = tracking.Tracker({'id': 'hangs', 'settings': {}}, queue_size=4)
  start = time.perf_counter()
  for step in range(1, 11):
    tracker.log(step, {'train/CE loss': 1.0 / step})
  assert time.perf_counter() - start < 1.0  # enqueues; the init hangs until released
  assert tracker.dropped == 6  # 4 wait in the queue behind the init
  start = time.perf_counter()
  tracker.close(timeout=0.5)  # gives up on the init, does not raise
  assert 0.4 < time.perf_counter() - start < 5
  release.set()
  tracker._thread.join(10)  # pylint: disable=protected-access
  assert not tracker._thread.is_alive()  # pylint: disable=protected-access
  assert tracker.dropped == 10 and 'RuntimeError: released' in tracker.failed


def test_off_unless_a_project_is_named(token_files, tmp_path):
  tracker = tracking.Tracker.for_run(tiny_config(token_files), str(tmp_path))
  assert not tracker.enabled
  tracker.log(1, {'x': 1.0})
  tracker.close()
  assert not (tmp_path / tracking.RUN_ID_FILE).exists()


@pytest.mark.parametrize('change, match', [
    ({'train.wandb.mode': 'sometimes'}, r"train.wandb.mode='sometimes' must be one of"),
    ({'train.wandb.init_timeout': 0.0}, r'init_timeout=0.0 must be a number of seconds > 0'),
    ({'train.wandb.project': 'team/project'}, r'put the team in --config.train.wandb.entity'),
    ({'data.validation_sets': {'a/b': ('x.npy',)}}, r"\['a/b'\].*its name holds a \"/\""),
    ({'data.validation_sets': {'c4': ()}}, r"\['c4'\]=\(\): it names no token files"),
    ({'data.validation_sets': {'validation': ('x.npy',)}},
     r"'validation' names data.validation_paths"),
])
def test_bad_monitoring_settings_are_one_line_config_errors(token_files, change, match):
  cfg = tiny_config(token_files)
  [(key, value)] = change.items()
  *groups, field = key.split('.')
  node = cfg
  for group in groups:
    node = node[group]
  node[field] = value
  with pytest.raises(errors.ConfigError, match=match) as raised:
    config_checks.validate(cfg)
  assert '\n' not in str(raised.value)


def test_a_bucket_workdirs_offline_run_is_copied_into_the_bucket(token_files, tmp_path,
                                                                  monkeypatch):
  """wandb writes local files only: a gs:// workdir's run is kept on this host while it
  runs, and copied to <workdir>/wandb when it ends, where `wandb sync` can take it."""
  import servers  # pylint: disable=import-outside-toplevel  # the GCS emulator, started here
  fresh_wandb(monkeypatch)
  for name, value in {'WANDB_MODE': 'offline', 'WANDB_SILENT': 'true',
                      'WANDB_DISABLE_GIT': 'true', 'XDG_CACHE_HOME': str(tmp_path / 'xdg')
                      }.items():
    monkeypatch.setenv(name, value)
  monkeypatch.delenv('WANDB_DIR', raising=False)
  try:
    stack = servers.gcs_bucket()
    _, bucket = stack.__enter__()
  except servers.ServerUnavailable as e:
    pytest.skip(str(e))
  try:
    workdir = f'gs://{bucket}/run'
    tracker = tracking.Tracker.for_run(wandb_config(token_files, named_set=False), workdir)
    for step in (1, 2):
      tracker.log(step, {'train/CE loss': 5.0 - step})
    tracker.close()
    keys = storage.list_keys(f'{workdir}/wandb')
    assert any(k.startswith('offline-run-') and k.endswith('.wandb') for k in keys), keys
    local = glob.glob(str(tmp_path / 'xdg' / 'olmo3_jax' / '*' / 'wandb' / 'offline-run-*'))
    assert local and not glob.glob(str(tmp_path / 'xdg' / '**' / 'wandb' / 'wandb'),
                                   recursive=True)  # one `wandb/`, not two
  finally:
    stack.__exit__(None, None, None)
