"""The storage layer end to end: whole runs in gs:// and s3:// buckets, against local disk.

Every run is train.py's own command line in a subprocess, on the GCS emulator
(fake-gcs-server) or moto's S3 server (tests/servers.py), and the reference
is the same command on a local directory: the two must end bit for bit equal
(every array of a checkpoint, params and optimizer state, read back with
tensorstore through checkpoint.read_array, which verifies each chunk against
its checksum), and their metrics records equal except wall-clock fields.

  * A full cycle (`cycles`): 4 steps, then a second invocation that continues
    with --config=configs/from_checkpoint.py:WORKDIR to 10 steps, meets
    tests/test_rollback.py's planted spike at step 6 and rolls back to step 3,
    the last state its next step judged healthy (rollbacks.jsonl and
    rolledback.step_4.1, rolledback.step_5.1 in the bucket); then
    convert.py --from_ckpt=URL --to_hf=LOCAL and eval.py --checkpoint=URL.
  * SIGKILL inside a save on gs:// (tests/storage_faults.py: mid-chunks,
    before metadata.json, before COMMIT), then a rerun of the same command.
  * Two processes (jax.distributed on localhost) writing one gs:// checkpoint.
  * Two "hosts" at one local path on different disks (one process under
    `unshare --mount` with a bind mount over the workdir): refused on both.
  * The bucket lease lock: a second trainer refused while the first runs, a
    killed holder taken over; on S3 (which honours If-None-Match) two
    conditional creates racing.
  * Malformed workdir URLs: one line, exit 2, no local folder.
  * eval.py on a bucket checkpoint (evaluation.scoring.locate, eval.default_output).
"""

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import checkpoint
from store import chunk_store
from monitor import metrics as metrics_lib
from hosts import workdir_lock
from monitor import rollback
import servers
from servers import free_port
import storage_faults
from store import step_dirs
from store import storage
from test_multihost import (RETRIED_STARTS, communicate_all, process_args, spawn_train,
                            train_args, trainer_env)
from test_rollback import INSTALL_POISON, LR, POISON_CODE, RUN, STEPS, WINDOW
from test_rollback import poisoned_files  # noqa: F401  (a module fixture used here)
from test_train import VOCAB, config_flags, timed
from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
FIRST = 4  # the first invocation's steps; the second continues to STEPS (10)
FLAGS = {**RUN, **LR, 'train.rollback_attempts': 3}
KILL_STEP = 3  # the step whose save the SIGKILL tests cut short
SCHEMES = ('gs', 's3')


# --- Servers, children, readers ---------------------------------------------------------


@pytest.fixture(scope='module')
def buckets(tmp_path_factory):
  """{'gs': 'gs://BUCKET', 's3': 's3://BUCKET'} for the module, and XDG_CACHE_HOME set to a
  scratch folder (a bucket workdir keeps its data caches there) for every child."""
  found, skipped = {}, {}
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv('XDG_CACHE_HOME', str(tmp_path_factory.mktemp('xdg_cache')))
    with contextlib.ExitStack() as stack:
      for scheme, bucket in (('gs', servers.gcs_bucket), ('s3', servers.s3_bucket)):
        try:
          _, name = stack.enter_context(bucket())
          found[scheme] = f'{scheme}://{name}'
        except servers.ServerUnavailable as e:
          skipped[scheme] = str(e)
      yield Buckets(found, skipped)


class Buckets:

  def __init__(self, found: dict[str, str], skipped: dict[str, str]):
    self.found, self.skipped = found, skipped

  def __getitem__(self, scheme: str) -> str:
    if scheme not in self.found:
      pytest.skip(self.skipped[scheme])
    return self.found[scheme]


def child(workdir: str, files, steps: int, *extra: str, kill: str | None = None,
          resume_config: bool = False) -> tuple[list[str], dict[str, str]]:
  """(argv, env) of train.py's command line with the planted spike (and a `kill` hook), on
  2 devices: each writes its own chunks, as on a pod, and every chunk is an object in the
  bucket, so 8 would only multiply the objects (and the emulators' work) by 4. With
  `resume_config` the run config is --config=configs/from_checkpoint.py:WORKDIR (what the
  checkpoint stores) instead of the flags, and only train.steps changes.
  """
  script = storage_faults.trainer_script(str(REPO), POISON_CODE + INSTALL_POISON, kill)
  argv = [sys.executable, '-c', script, f'--workdir={workdir}', '--sample_tokens=0']
  if resume_config:
    argv.append(f'--config=configs/from_checkpoint.py:{workdir}')
  else:
    argv += [*config_flags(files), *[f'--config.{k}={v}' for k, v in FLAGS.items()]]
  argv += [*extra, f'--config.train.steps={steps}']
  return argv, dict(os.environ, XLA_FLAGS=with_devices(2), KILL_STEP=str(KILL_STEP))


def run_all(commands: list[tuple[list[str], dict[str, str]]], logs: pathlib.Path,
            timeout: float = 600) -> list[subprocess.CompletedProcess]:
  """Runs the commands at the same time (each is mostly start-up and compile); their
  output goes to files under `logs`, so no pipe fills up while another is waited on."""
  logs.mkdir(parents=True, exist_ok=True)
  started = []
  for argv, env in commands:
    n = len(list(logs.iterdir()))
    out, err = logs / f'{n}.out', logs / f'{n}.err'
    with open(out, 'w') as o, open(err, 'w') as e:
      started.append((argv, subprocess.Popen(argv, cwd=REPO, env=env, stdout=o, stderr=e,
                                             text=True), out, err))
  deadline = time.time() + timeout
  done = []
  for argv, proc, out, err in started:
    try:
      proc.wait(max(1, deadline - time.time()))
    finally:
      proc.kill()
    done.append(subprocess.CompletedProcess(argv, proc.wait(), out.read_text(), err.read_text()))
  return done


def ok(proc: subprocess.CompletedProcess) -> str:
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  return proc.stdout + proc.stderr


def error_lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if line.startswith('error:')]


def arrays(ckpt_dir: str, step: int) -> dict[str, np.ndarray]:
  """Every array of a committed step (params and optimizer state), chunks verified."""
  info = chunk_store.read_info(step_dirs.step_dir(ckpt_dir, step))
  return {name: checkpoint.read_array(ckpt_dir, name, step=step) for name in info['paths']}


def assert_arrays_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert sorted(a) == sorted(b)
  assert any(n.startswith('params/') for n in a) and any(n.startswith('opt_state/') for n in a)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def untimed(records: list[dict]) -> list[dict]:
  """Records without their wall-clock fields (metrics.wall_clock: 'time/...', '... (s)',
  'goodput/...'); a record of goodput alone is dropped whole."""
  untimed = [{k: v for k, v in r.items() if not timed(k)} for r in records]
  return [r for r in untimed if set(r) != {'step'}]


def step_keys(ckpt_dir: str, step: int | str) -> list[str]:
  """The files or objects of one step directory (or of a named one), relative to it."""
  path = (step_dirs.step_dir(ckpt_dir, step) if isinstance(step, int)
          else storage.join(ckpt_dir, step))
  if storage.is_url(path):
    return storage.list_keys(path)
  return sorted(str(p.relative_to(path)) for p in pathlib.Path(path).rglob('*') if p.is_file())


def without_time(entries: list[dict]) -> list[dict]:
  return [{k: v for k, v in e.items() if k != 'time'} for e in entries]


def assert_common_equal(a: dict, b: dict, where: str = 'config') -> None:
  """Equal values at every key both have. (Others edit this working tree while the runs
  go on: a config field added between two runs is not a difference between the stores.)"""
  for key in sorted(set(a) & set(b)):
    if isinstance(a[key], dict) and isinstance(b[key], dict):
      assert_common_equal(a[key], b[key], f'{where}.{key}')
    else:
      assert a[key] == b[key], f'{where}.{key}'
  assert len(set(a) & set(b)) >= min(len(a), len(b)) - 3, (where, set(a) ^ set(b))


def stray_url_folders(directory) -> list[str]:
  """Entries of `directory` a URL gone wrong would make ('gs:', 'gcs:', 's3:', 'hdfs:')."""
  return sorted(n for n in os.listdir(directory) if n.endswith(':'))


# --- 1. The full cycle ------------------------------------------------------------------


class Cycle:
  """One workdir's cycle: train, continue with a rollback, export to HF, evaluate."""

  def __init__(self, workdir: str, scratch: pathlib.Path):
    self.workdir, self.scratch = workdir, scratch
    self.ckpt = storage.join(workdir, 'checkpoints')
    self.outputs: list[str] = []
    self.hf = scratch / 'hf'
    self.eval: subprocess.CompletedProcess | None = None
    self.eval_cwd = scratch / 'eval_cwd'


@pytest.fixture(scope='module')
def cycles(buckets, poisoned_files, tmp_path_factory):  # noqa: F811  (the imported fixture)
  """cycles(scheme) -> that scheme's Cycle ('' = local disk). The first call runs the cycle
  on local disk and in every bucket at once (two invocations each)."""
  done: dict[str, Cycle] = {}

  def get(scheme: str) -> Cycle:
    if not done:
      for s in ('', *buckets.found):
        scratch = tmp_path_factory.mktemp(f'cycle_{s or "local"}')
        done[s] = Cycle(f'{buckets.found[s]}/cycle' if s else str(scratch / 'run'), scratch)
      logs = tmp_path_factory.mktemp('cycle_logs')
      for steps, resume_config in ((FIRST, False), (STEPS, True)):
        procs = run_all([child(c.workdir, poisoned_files, steps, resume_config=resume_config)
                         for c in done.values()], logs)
        for cycle, proc in zip(done.values(), procs):
          cycle.outputs.append(ok(proc))
    if scheme:
      buckets[scheme]  # pylint: disable=pointless-statement  # skips if it has no server
    return done[scheme]
  return get


@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
def test_cycle_in_a_bucket_is_bit_identical_to_local_disk(cycles, scheme):
  local, remote = cycles(''), cycles(scheme)
  assert f'Resumed from step {FIRST} in {remote.ckpt}' in remote.outputs[1]
  assert 'ROLLBACK 1/3' in remote.outputs[1] and 'Restored step 3' in remote.outputs[1]
  for cycle in (local, remote):
    assert checkpoint.committed_steps(cycle.ckpt) == list(range(1, STEPS + 1))
  # The rollback's decision and set-aside, in the bucket as on disk.
  entries = without_time(rollback.read_log(remote.workdir))
  assert entries == without_time(rollback.read_log(local.workdir))
  assert len(entries) == 1 and entries[0]['skip'] == WINDOW and entries[0]['restored_step'] == 3
  names = storage.listdir(remote.ckpt)
  assert names == sorted(os.listdir(local.ckpt)) == sorted(
      ['rolledback.step_4.1', 'rolledback.step_5.1',
       *(f'step_{s}' for s in range(1, STEPS + 1))])
  aside = storage.join(remote.ckpt, 'rolledback.step_5.1')  # copied whole, COMMIT included
  assert storage.list_keys(aside) == step_keys(local.ckpt, 'rolledback.step_5.1')
  assert step_dirs.COMMIT in storage.list_keys(aside)
  assert chunk_store.read_info(aside)['metadata']['step'] == 5
  # No staging or crash leftovers, and the lease released (emptied) at the end.
  assert not [k for k in storage.list_keys(remote.workdir) if 'tmp.' in k]
  assert storage.read(storage.join(remote.workdir, workdir_lock.LOCK)) == b''
  # Params and optimizer state bit for bit, at the restored step and at the end.
  for step in (FIRST, STEPS):
    assert_arrays_equal(arrays(remote.ckpt, step), arrays(local.ckpt, step))
    assert step_keys(remote.ckpt, step) == step_keys(local.ckpt, step)
  meta, local_meta = (checkpoint.read_metadata(c.ckpt, STEPS) for c in (remote, local))
  assert without_time(meta.pop('rollbacks')) == without_time(local_meta.pop('rollbacks'))
  assert_common_equal(meta.pop('config'), local_meta.pop('config'))
  assert meta == local_meta
  # No local folder named after the URL.
  assert not stray_url_folders(REPO)


@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
def test_cycle_metrics_in_segments_equal_the_local_file(cycles, scheme):
  local, remote = cycles(''), cycles(scheme)
  segments = storage.listdir(storage.join(remote.workdir, metrics_lib.METRICS + '.d'))
  assert segments and all(s.endswith('.jsonl') for s in segments)
  assert not storage.exists(storage.join(remote.workdir, metrics_lib.METRICS))
  got, want = (untimed(metrics_lib.read_records(c.workdir)) for c in (remote, local))
  assert [r['step'] for r in want] == list(range(1, STEPS + 1))  # steps 5-6 replaced once
  assert got == want
  # TensorBoard event files in the bucket too (one per flush).
  assert storage.listdir(storage.join(remote.workdir, 'tensorboard'))


@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
def test_cycle_config_from_checkpoint_resolves_a_url(cycles, scheme):
  """The second invocation ran on --config=configs/from_checkpoint.py:URL (above); the config
  it resolves is the local run's, field for field."""
  from configs import from_checkpoint  # pylint: disable=import-outside-toplevel
  local, remote = cycles(''), cycles(scheme)
  got = from_checkpoint.get_config(remote.workdir).to_dict()
  assert_common_equal(got, from_checkpoint.get_config(local.workdir).to_dict())
  assert got['train']['steps'] == STEPS and got['data']['paths']
  assert from_checkpoint.get_config(remote.ckpt).to_dict() == got


def convert_to_hf(cycle: Cycle) -> None:
  """The run's HF export. Its token files name no tokenizer (synthetic ids), so it is given
  one (convert.py refuses an export without): a word-level vocabulary of the ids."""
  from tokenizers import Tokenizer, models  # pylint: disable=import-outside-toplevel
  if not cycle.hf.exists():
    vocab = cycle.scratch / 'tokenizer.json'
    Tokenizer(models.WordLevel({f't{i}': i for i in range(VOCAB)}, unk_token='t2')).save(
        str(vocab))
    ok(subprocess.run([sys.executable, 'convert.py', f'--from_ckpt={cycle.ckpt}',
                       f'--to_hf={cycle.hf}', f'--tokenizer={vocab}'], cwd=REPO,
                      env=dict(os.environ), capture_output=True, text=True, timeout=600))


@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
def test_cycle_hf_export_from_a_bucket_equals_the_local_export(cycles, scheme):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  local, remote = cycles(''), cycles(scheme)
  for cycle in (local, remote):
    convert_to_hf(cycle)
  files = sorted(os.listdir(local.hf))
  assert sorted(os.listdir(remote.hf)) == files and 'config.json' in files
  tensors = [f for f in files if f.endswith('.safetensors')]
  assert tensors
  for name in files:
    if name in tensors:
      a, b = load_file(remote.hf / name), load_file(local.hf / name)
      assert sorted(a) == sorted(b)
      for key in a:
        assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key
    else:
      assert (remote.hf / name).read_bytes() == (local.hf / name).read_bytes(), name


def evaluate(cycle: Cycle) -> subprocess.CompletedProcess:
  """eval.py --suite=heldout on the cycle's checkpoints, from a scratch working directory (a
  URL taken for a path would become a folder there)."""
  if cycle.eval is None:
    cycle.eval_cwd.mkdir(exist_ok=True)
    cycle.eval = subprocess.run(
        [sys.executable, str(REPO / 'eval.py'), f'--checkpoint={cycle.ckpt}', '--suite=heldout'],
        cwd=cycle.eval_cwd, env=dict(os.environ), capture_output=True, text=True, timeout=600)
  return cycle.eval


def eval_report(cycle: Cycle) -> tuple[str, dict]:
  """(where the report went, the report), from eval.py's 'wrote PATH' line."""
  line = [l for l in cycle.eval.stdout.splitlines() if l.startswith('wrote ')][-1]
  path = line.split()[1]
  text = storage.read_text(path)
  assert text is not None, f'eval.py announced {path}, which does not exist'
  return path, json.loads(text)


@pytest.mark.slow
@pytest.mark.parametrize('scheme', SCHEMES)
def test_cycle_eval_of_a_bucket_checkpoint_equals_local(cycles, scheme):
  local, remote = cycles(''), cycles(scheme)
  ok(evaluate(local))
  local_path, local_report = eval_report(local)
  assert local_path == os.path.join(local.workdir, 'eval_results', f'run_step{STEPS}.json')
  proc = evaluate(remote)
  # Whatever happens, a URL must never become a folder named 'gs:' / 's3:' locally.
  assert not stray_url_folders(remote.eval_cwd), (
      f'eval.py made {stray_url_folders(remote.eval_cwd)} in its working directory')
  assert not stray_url_folders(REPO)
  ok(proc)
  path, report = eval_report(remote)
  assert not path.startswith(str(remote.eval_cwd)), path
  assert report['step'] == STEPS
  assert report['heldout'] == {**local_report['heldout'],
                               'seconds': report['heldout']['seconds']}


def test_eval_locates_a_checkpoint_in_a_bucket(buckets):
  """evaluation.scoring.locate (eval.py --checkpoint) takes a gs:// checkpoint directory as
  it is, like a local one, instead of os.path.abspath-ing the URL into a local path."""
  from evaluation import scoring  # pylint: disable=import-outside-toplevel
  ckpt = f'{buckets["gs"]}/locate/checkpoints'
  with checkpoint.Checkpointer(ckpt, fsync=False) as saver:
    saver.save(3, {'params': {'w': np.arange(4, dtype=np.float32)}})
  assert checkpoint.committed_steps(ckpt) == [3]
  assert scoring.locate(ckpt) == (ckpt, None)
  assert scoring.locate(storage.join(ckpt, 'step_3')) == (ckpt, 3)


def test_eval_default_output_of_a_url_is_not_a_folder_in_the_working_directory(tmp_path):
  """Without --output, eval.py's report for a bucket checkpoint must not go to
  ./gs:/BUCKET/.../eval_results/ (os.path.abspath of the URL)."""
  code = ('import sys; sys.path.insert(0, %r); import eval; '
          'print(eval.default_output("gs://b/run/checkpoints", 10))' % str(REPO))
  out = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-3000:]
  path = out.stdout.strip().splitlines()[-1]
  assert not path.startswith(str(tmp_path)) and '/gs:/' not in path, path


# --- 2. SIGKILL inside a save -----------------------------------------------------------


@pytest.fixture(scope='module')
def killed(buckets, poisoned_files, tmp_path_factory):  # noqa: F811
  """Per kill point: the same 4-step command in its own gs:// workdir, SIGKILLed in the save
  of step 3, then run again; all three at once. {kill: (workdir, what the bucket held after
  the kill, the killed run, the rerun)}."""
  workdirs = {kill: f'{buckets["gs"]}/killed-{kill}' for kill in storage_faults.KILLS}
  logs = tmp_path_factory.mktemp('kill_logs')
  kills = run_all([child(workdirs[k], poisoned_files, FIRST, kill=k) for k in workdirs], logs)
  after = {}
  for kill, workdir in workdirs.items():
    ckpt = storage.join(workdir, 'checkpoints')
    after[kill] = {'names': storage.listdir(ckpt), 'committed': step_dirs.committed_steps(ckpt),
                   'partial': storage.list_keys(step_dirs.step_dir(ckpt, KILL_STEP))}
  reruns = run_all([child(workdirs[k], poisoned_files, FIRST) for k in workdirs], logs)
  return {k: (workdirs[k], after[k], p, r) for k, p, r in zip(workdirs, kills, reruns)}


@pytest.mark.slow
@pytest.mark.parametrize('kill', storage_faults.KILLS)
def test_sigkill_mid_save_in_a_bucket_then_resume_is_bit_identical(cycles, killed, kill):
  local = cycles('')  # its step 4 is the uninterrupted run of the same command
  workdir, after, proc, rerun = killed[kill]
  ckpt = storage.join(workdir, 'checkpoints')
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
  # The cut-short save of step 3 is in the listing but never counts as committed.
  assert after['names'] == ['step_1', 'step_2', f'step_{KILL_STEP}']
  assert after['committed'] == [1, 2]
  keys = after['partial']
  assert keys and step_dirs.COMMIT not in keys
  assert (chunk_store.METADATA in keys) == (kill == 'before-commit')
  if kill == 'mid-chunks':
    assert len(keys) < len(step_keys(local.ckpt, KILL_STEP)) - 2

  out = ok(rerun)  # the same command again
  partial = step_dirs.step_dir(ckpt, KILL_STEP)
  if kill == 'before-commit':  # complete but for its marker: verified, re-committed
    assert 're-committing it' in out and f'Resumed from step {KILL_STEP} in' in out
  else:  # partial: removed, and step 3 computed and saved again
    assert f'Removing partial checkpoint {partial}' in out
    assert f'Resumed from step {KILL_STEP - 1} in' in out
  assert step_dirs.committed_steps(ckpt) == list(range(1, FIRST + 1))
  # The local cycle's second invocation rolled back to step 3 and trained step 4 again; its
  # first step 4 is the set-aside copy. The local run judged that state (HEALTH); this run
  # ended there, and a run's last step stays pending (docs/rollback.md).
  reference = {KILL_STEP: f'step_{KILL_STEP}', FIRST: f'rolledback.step_{FIRST}.1'}
  for step, name in reference.items():  # no leftover object; the same chunks and checksums
    assert step_keys(ckpt, step) == [k for k in step_keys(local.ckpt, name)
                                     if k != step_dirs.HEALTH or step != FIRST]
    assert (chunk_store.read_info(step_dirs.step_dir(ckpt, step))['arrays'] ==
            chunk_store.read_info(storage.join(local.ckpt, name))['arrays'])
  assert_arrays_equal(arrays(ckpt, KILL_STEP), arrays(local.ckpt, KILL_STEP))  # every bit
  assert untimed(metrics_lib.read_records(workdir))[:KILL_STEP] == [
      r for r in untimed(metrics_lib.read_records(local.workdir)) if r['step'] <= KILL_STEP]


# --- 3. Two processes, one bucket -------------------------------------------------------


def two_processes(workdir: str, steps: int, ckpt_every: int, timeout: float = 300,
                  wrap=lambda i, args: args, expect_rc: int = 0,
                  heartbeat_timeout: int | None = None) -> list[tuple[int, str, str]]:
  """train.py as two processes x 2 devices on localhost (jax.distributed); returns
  [(exit code, stdout, stderr)] per process. `wrap(i, argv)` may change process i's command;
  `heartbeat_timeout` as in test_multihost.spawn_two_processes. Gloo's 30 s rendezvous can
  fail on an overloaded machine: retried once."""
  for attempt in range(3):
    port = free_port()
    procs = []
    for i in range(2):
      args = process_args(workdir, steps, ckpt_every, i, port, heartbeat_timeout)
      procs.append(subprocess.Popen(wrap(i, args), cwd=REPO, env=trainer_env(2), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = communicate_all(procs, timeout)
    results = [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
    if attempt < 2 and any(m in out + err for _, out, err in results for m in RETRIED_STARTS):
      continue
    for rc, out, err in results:
      assert rc == expect_rc, (out + err)[-5000:]
    return [(rc, out, err) for rc, out, err in results]


@pytest.fixture(scope='module')
def two_process_local(tmp_path_factory):
  """Two processes sharing one local directory (one disk: the shared-storage check passes)."""
  workdir = tmp_path_factory.mktemp('two_local') / 'run'
  two_processes(str(workdir), 4, 2)
  return str(workdir)


@pytest.mark.slow
def test_two_processes_write_one_bucket_checkpoint_bit_identical_to_shared_disk(
    buckets, two_process_local):
  workdir = f'{buckets["gs"]}/two-process'
  two_processes(workdir, 4, 2)
  ckpt, local_ckpt = storage.join(workdir, 'checkpoints'), storage.join(two_process_local,
                                                                         'checkpoints')
  assert checkpoint.committed_steps(ckpt) == checkpoint.committed_steps(local_ckpt) == [2, 4]
  info = chunk_store.read_info(step_dirs.step_dir(ckpt, 4))
  assert info['process_count'] == 2
  for step in (2, 4):
    assert step_keys(ckpt, step) == step_keys(local_ckpt, step)
    assert_arrays_equal(arrays(ckpt, step), arrays(local_ckpt, step))
  assert untimed(metrics_lib.read_records(workdir)) == untimed(
      metrics_lib.read_records(two_process_local))
  # Both ran the shared-storage check, and it passed on the bucket and on the one disk.
  for w in (workdir, two_process_local):
    assert storage.exists(storage.join(w, 'SHARED_STORAGE_CHECK'))


# --- 4. Two hosts, two disks, one path ---------------------------------------------------


def _unshare_works(tmp: pathlib.Path) -> str:
  """'' if this process may make a private mount namespace with a bind mount, else why not."""
  (tmp / 'a').mkdir(parents=True)
  (tmp / 'b').mkdir()
  probe = subprocess.run(['unshare', '--mount', '--propagation', 'private', 'sh', '-c',
                          f'mount --bind {tmp / "b"} {tmp / "a"} && touch {tmp / "a" / "x"}'],
                         capture_output=True, text=True)
  if probe.returncode or not (tmp / 'b' / 'x').exists() or (tmp / 'a' / 'x').exists():
    return f'unshare --mount with a bind mount is not available: {probe.stderr.strip()}'
  return ''


@pytest.mark.slow
def test_two_hosts_with_their_own_disks_at_one_path_are_refused(tmp_path, two_process_local):
  why = _unshare_works(tmp_path / 'probe')
  if why:
    pytest.skip(why)
  disk_a, disk_b = tmp_path / 'disk_a', tmp_path / 'disk_b'
  workdir = disk_a / 'run'  # process 1 sees disk_b here
  workdir.mkdir(parents=True)
  disk_b.mkdir()

  def split(i, args):
    if i == 0:
      return args
    return ['unshare', '--mount', '--propagation', 'private', 'sh', '-c',
            f'mount --bind {disk_b} {workdir} && exec "$@"', 'sh', *args]
  # Both refuse; a short heartbeat timeout bounds the wait should one refuse first.
  results = two_processes(str(workdir), 4, 2, wrap=split, expect_rc=2, timeout=200,
                          heartbeat_timeout=10)
  host = __import__('socket').gethostname()
  for i, (_, out, err) in enumerate(results):
    lines = error_lines(err)
    assert len(lines) == 1, (i, err[-3000:])
    assert f'--workdir={workdir} is not one storage shared by every process' in lines[0]
    assert f'process 1 on host {host} reads nothing at {workdir}/SHARED_STORAGE_CHECK' in lines[0]
    assert 'must be a gs:// or s3:// URL or a filesystem every host shares' in lines[0]
    assert 'Traceback' not in out + err
  # Nothing written beyond process 0's check file (error.log: the stack of the refusal).
  written_a = sorted(os.listdir(workdir))
  written_b = sorted(os.listdir(disk_b))
  assert set(written_a) <= {'SHARED_STORAGE_CHECK', 'error.log'}, written_a
  assert 'SHARED_STORAGE_CHECK' in written_a
  assert set(written_b) <= {'error.log'}, written_b
  for disk in (workdir, disk_b):  # each process logs the refusal's stack on its own disk
    log = disk / 'error.log'
    assert not log.exists() or 'is not one storage shared' in log.read_text()
  # And the same two processes on one disk pass the check (two_process_local trained).
  assert checkpoint.committed_steps(os.path.join(two_process_local, 'checkpoints')) == [2, 4]


# --- 5. The lease lock ------------------------------------------------------------------


def committed_in(ckpt: str) -> list[int]:
  try:
    return step_dirs.committed_steps(ckpt)
  except OSError:
    return []


@pytest.mark.slow
def test_second_trainer_refused_by_the_lease_then_a_killed_holder_is_taken_over(buckets,
                                                                                tmp_path):
  workdir = f'{buckets["gs"]}/locked'
  ckpt, lock = storage.join(workdir, 'checkpoints'), storage.join(workdir, workdir_lock.LOCK)
  log = tmp_path / 'first.log'
  first = spawn_train(workdir, 100000, 2, log=log)
  try:
    deadline = time.time() + 300
    while not committed_in(ckpt):  # the LOCK is taken before the first checkpoint
      assert first.poll() is None, log.read_text()[-4000:]
      assert time.time() < deadline
      time.sleep(0.5)
    holder = json.loads(storage.read(lock))
    assert holder['pid'] == first.pid

    second = subprocess.run(train_args(workdir, 100000, 2), cwd=REPO, env=trainer_env(2),
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr[-4000:]
    lines = error_lines(second.stderr)
    assert len(lines) == 1, second.stderr[-4000:]
    assert f'is in use by another training run (host {holder["host"]}, PID {first.pid}' in lines[0]
    # The first is unaffected: still running, still the holder, still saving.
    seen = committed_in(ckpt)[-1]
    while committed_in(ckpt)[-1] < seen + 4:
      assert first.poll() is None, log.read_text()[-4000:]
      assert time.time() < deadline
      time.sleep(0.5)
    assert json.loads(storage.read(lock))['pid'] == first.pid
    first.send_signal(signal.SIGKILL)
    first.wait(60)
  finally:
    first.kill()
  latest = committed_in(ckpt)[-1]
  assert json.loads(storage.read(lock))['pid'] == first.pid  # a SIGKILL releases nothing
  rerun = subprocess.run(train_args(workdir, latest + 4, 2), cwd=REPO, env=trainer_env(2),
                         capture_output=True, text=True, timeout=300)
  out = ok(rerun)
  assert 'Taking over the stale workdir lock' in out and f'PID {first.pid}' in out
  assert 'a process that is no longer running' in out
  resumed = [int(l.split('Resumed from step ')[1].split()[0]) for l in out.splitlines()
             if 'Resumed from step ' in l]
  assert resumed and resumed[0] in (latest, latest + 2), (latest, resumed)
  assert committed_in(ckpt)[-1] == latest + 4
  assert storage.read(lock) == b''  # released at the end


# A pod's container as Kubernetes runs it: PID 1 in PID and UTS namespaces of its own,
# the hostname an Indexed Job gives its pod (the same after a restart). --kill-child: a
# SIGKILL to unshare kills the trainer too, as a container's end does.
CONTAINER = ['unshare', '--pid', '--uts', '--mount', '--fork', '--kill-child', '--mount-proc',
             'sh', '-c', 'hostname slice-0-0 && exec "$@"', 'sh']


@pytest.mark.slow
def test_a_restarted_container_resumes_its_own_workdir_at_once(buckets, tmp_path):
  """The holder's host name and PID repeat across a container's restart (slice-0-0, PID
  1), and PID 1 is then alive: the new trainer. It must take its own dead container's
  lease over and resume, not refuse with exit 2 (which fails a JobSet) nor wait out the
  lease (here 600 s)."""
  if os.geteuid() != 0 or subprocess.run(CONTAINER + ['true'], capture_output=True).returncode:
    pytest.skip('needs root and unshare(1) for PID and UTS namespaces')
  workdir = f'{buckets["gs"]}/container'
  ckpt, lock = storage.join(workdir, 'checkpoints'), storage.join(workdir, workdir_lock.LOCK)
  env = {'OLMO_LOCK_LEASE_SECONDS': '600'}
  log = tmp_path / 'first.log'
  first = spawn_train(workdir, 100000, 2, log=log, env_extra=env,
                      command=CONTAINER + train_args(workdir, 100000, 2))
  try:
    deadline = time.time() + 300
    while not committed_in(ckpt):
      assert first.poll() is None, log.read_text()[-4000:]
      assert time.time() < deadline
      time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.wait(60)
  finally:
    first.kill()
  holder = json.loads(storage.read(lock))
  assert (holder['host'], holder['pid']) == ('slice-0-0', 1)  # a SIGKILL releases nothing
  latest = committed_in(ckpt)[-1]
  start = time.time()
  rerun = subprocess.run(CONTAINER + train_args(workdir, latest + 2, 2), cwd=REPO,
                         env=trainer_env(2, **env), capture_output=True, text=True, timeout=300)
  out = ok(rerun)
  assert time.time() - start < 300, 'waited out the lease'
  assert 'Taking over the stale workdir lock' in out and 'host slice-0-0, PID 1' in out
  resumed = [int(l.split('Resumed from step ')[1].split()[0]) for l in out.splitlines()
             if 'Resumed from step ' in l]
  assert resumed and resumed[0] == latest, (latest, resumed)
  assert committed_in(ckpt)[-1] == latest + 2
  assert storage.read(lock) == b''


def test_racing_conditional_creates_of_the_s3_lease_leave_one_holder(buckets, monkeypatch):
  """moto honours If-None-Match: two runs that both read 'no LOCK' cannot both create it.
  The loser re-reads, finds a live holder and is refused."""
  workdir = f'{buckets["s3"]}/race'
  lock_path = storage.join(workdir, workdir_lock.LOCK)
  winner = workdir_lock.WorkdirLock(workdir).__enter__()
  try:
    generation = storage.read_versioned(lock_path)[1]
    real = storage.read_versioned
    stale = iter([(None, storage.MISSING)])  # the loser's first read: from before the create

    def read_versioned(location):
      return next(stale, None) or real(location)
    monkeypatch.setattr(storage, 'read_versioned', read_versioned)
    assert storage.write(lock_path, b'x', if_generation=storage.MISSING) is None
    with pytest.raises(workdir_lock.WorkdirLockedError, match='in use by another training run'):
      workdir_lock.WorkdirLock(workdir).__enter__()
    monkeypatch.setattr(storage, 'read_versioned', real)
    assert storage.read_versioned(lock_path)[1] == generation  # the winner's object, untouched
  finally:
    winner.__exit__(None, None, None)
  assert storage.read(lock_path) == b''


# --- 6. Malformed workdir URLs ----------------------------------------------------------


@pytest.mark.slow
def test_malformed_workdir_urls_exit_2_in_one_line_and_make_no_folder(tmp_path):
  bad = ['gcs://b/x', 'gs:/x', 'hdfs://x/y', 'file:///tmp/x', 'gs://']
  procs = [subprocess.Popen([sys.executable, str(REPO / 'train.py'),
                             f'--config={REPO / "configs" / "small.py"}', f'--workdir={w}'],
                            cwd=tmp_path, env=trainer_env(1), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for w in bad]
  for workdir, proc in zip(bad, procs):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (workdir, err[-3000:])
    lines = error_lines(err)
    assert len(lines) == 1 and repr(workdir) in lines[0], (workdir, err[-3000:])
    assert 'gs://BUCKET/PATH' in lines[0] and 'Traceback' not in err
  assert os.listdir(tmp_path) == []
  assert not stray_url_folders(REPO)
