"""Stopping as a scheduler stops a trainer: SIGTERM to a container's PID 1 during start-up,
and a grace period (OLMO_STOP_GRACE_SECONDS) that may not hold a checkpoint.

The kernel drops a signal PID 1 has no handler for, so a trainer that installed its
handler only after start-up (distributed init, the lock, the restore) waited out the whole
grace period before the SIGKILL. Exit 3 is what the schedulers restart uncounted
(deploy/jobset-v5e.yaml); 137, a SIGKILL at the grace's end, counts as a crash.
"""

import os
import pathlib
import signal
import subprocess
import time

import pytest

import errors
from store import step_dirs
from test_multihost import train_args, trainer_env
from test_storage_e2e import CONTAINER, committed_in

REPO = pathlib.Path(__file__).resolve().parents[1]


def container_pid(unshare: subprocess.Popen) -> int:
  """The host PID of the process unshare --fork runs as PID 1 of its namespace."""
  children = pathlib.Path(f'/proc/{unshare.pid}/task/{unshare.pid}/children')
  deadline = time.time() + 30
  while not children.read_text().split():
    assert unshare.poll() is None and time.time() < deadline
    time.sleep(0.01)
  return int(children.read_text().split()[0])


def wait_for(log: pathlib.Path, text: str, proc: subprocess.Popen, timeout: float = 300):
  deadline = time.time() + timeout
  while text not in log.read_text():
    assert proc.poll() is None, log.read_text()[-4000:]
    assert time.time() < deadline, log.read_text()[-4000:]
    time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.fresh_interpreter  # the imports themselves are the first window
@pytest.mark.parametrize('when', ['importing', 'starting up'])
def test_sigterm_during_start_up_ends_pid_1_at_once_with_exit_3(tmp_path, when):
  if os.geteuid() != 0 or subprocess.run(CONTAINER + ['true'], capture_output=True).returncode:
    pytest.skip('needs root and unshare(1) for a PID namespace')
  log = tmp_path / 'out.log'
  with open(log, 'w') as out:
    proc = subprocess.Popen(CONTAINER + train_args(tmp_path / 'w', 100000, 2), cwd=REPO,
                            env=trainer_env(2), stdout=out, stderr=subprocess.STDOUT)
  try:
    pid = container_pid(proc)
    if when == 'importing':  # train.py's first lines have run (its shim), JAX's import not
      cmdline = pathlib.Path(f'/proc/{pid}/cmdline')
      while b'train.py' not in cmdline.read_bytes():  # sh has exec'd the interpreter
        time.sleep(0.01)
      time.sleep(0.3)
    else:
      wait_for(log, 'attention_impl=', proc)  # then the state check, the lock, the restore
    sent = time.time()
    os.kill(pid, signal.SIGTERM)
    code = proc.wait(timeout=60)
    took = time.time() - sent
  finally:
    proc.kill()
  text = log.read_text()
  assert code == errors.EXIT_PREEMPTED, text[-4000:]
  assert took < 15, took  # not the grace period: at once, or after UNWIND_S at most
  assert 'Signal 15 during start-up' in text and 'Traceback' not in text, text[-4000:]
  assert not committed_in(str(tmp_path / 'w' / 'checkpoints'))


def committed(workdir: pathlib.Path) -> list[int]:
  return committed_in(str(workdir / 'checkpoints'))


@pytest.mark.slow
def test_the_grace_decides_between_a_save_and_an_exit_at_once(tmp_path):
  """With time for a save, SIGTERM checkpoints and exits 3. With a grace shorter than the
  saves this run has timed, it exits 3 at once, naming the committed step the run
  resumes from, and nothing later is committed."""
  workdir = tmp_path / 'w'
  # The first from the manifests' variable; the second from the flag, which wins over it.
  for grace, flag, saves in (('600', (), True), ('600', ('--stop_grace_seconds=1',), False)):
    log = tmp_path / f'grace_{saves}.log'
    with open(log, 'w') as out:
      proc = subprocess.Popen(train_args(workdir, 100000, 2, *flag), cwd=REPO, stdout=out,
                              stderr=subprocess.STDOUT,
                              env=trainer_env(2, OLMO_STOP_GRACE_SECONDS=grace))
    try:
      before = committed(workdir)
      deadline = time.time() + 300
      while len(committed(workdir)) < len(before) + 1:  # a save timed by this process
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(0.2)
      proc.send_signal(signal.SIGTERM)
      code = proc.wait(timeout=120)
    finally:
      proc.kill()
    text = log.read_text()
    assert code == errors.EXIT_PREEMPTED and 'Traceback' not in text, text[-4000:]
    if saves:
      assert 'checkpoint written' in text and 'exiting now' not in text, text[-4000:]
      continue
    line = next(l for l in text.splitlines() if 'exiting now without a checkpoint' in l)
    # The reason names the save's time where the save thread has recorded it by the signal,
    # else the grace alone (1 s is below the stop margin either way): both exit at once.
    assert 'grace period (1 s)' in line, line
    assert 'a checkpoint takes up to' in line or 'ends before the checkpoint' in line, line
    step = int(line.split('resumes from committed step ')[1].split('.')[0])
    assert committed(workdir)[-1] == step, (committed(workdir), line)
    assert step_dirs.latest_step(str(workdir / 'checkpoints')) == step


@pytest.mark.parametrize('env,flag,named', [
    ('15s', (), "OLMO_STOP_GRACE_SECONDS='15s'"),
    ('', ('--stop_grace_seconds=-5',), "--stop_grace_seconds='-5'")])
def test_a_malformed_grace_is_one_line_and_exit_2(tmp_path, env, flag, named):
  proc = subprocess.run(train_args(tmp_path / 'w', 2, 2, *flag), cwd=REPO, capture_output=True,
                        text=True, env=trainer_env(1, OLMO_STOP_GRACE_SECONDS=env),
                        timeout=300)
  assert proc.returncode == errors.EXIT_USAGE, proc.stderr[-3000:]
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and named in lines[0], proc.stderr[-3000:]
  assert not (tmp_path / 'w').exists()
