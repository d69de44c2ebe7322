"""Tests for scripts/launch.py and the faults a weeks-long run meets.

The restart loop is checked with stand-in trainers (tiny Python commands that
crash, make progress or trap signals); the acceptance runs the real train.py
under the launcher, kills it with SIGKILL at random steps and with SIGTERM
during an asynchronous checkpoint save, and compares the final params bit for
bit with an uninterrupted run. Fault tests (disk full during a save, a data
file that vanishes mid-run, a NaN loss) end the same way: the latest committed
checkpoint restores and the run reaches the undisturbed run's params.

One file of about 600 lines: its fault tests share one module-scoped uninterrupted
run (`reference`), which a split would train twice.
"""

import os
import pathlib
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import checkpoint  # noqa: E402
import config_checks  # noqa: E402
from configs import small  # noqa: E402
import data  # noqa: E402
import errors  # noqa: E402
import loss  # noqa: E402
from monitor import health  # noqa: E402
import optim  # noqa: E402
from scripts import launch  # noqa: E402
import servers  # noqa: E402
import sharding  # noqa: E402
import train  # noqa: E402
from test_multihost import (REPO, TRAIN_FILE, assert_bitwise_equal,  # noqa: E402
                            copy_checkpoints, final_params, poll_until, run_train, spawn_train,
                            train_args, trainer_env, wait_for_step)

STEPS = 10


def committed(workdir) -> list[int]:
  return checkpoint.committed_steps(os.path.join(workdir, 'checkpoints'))


def fake_trainer(tmp_path, body: str) -> list[str]:
  """A stand-in trainer command: `body` runs with `ckpt` = <workdir>/checkpoints."""
  script = tmp_path / 'fake_trainer.py'
  script.write_text('import os, signal, sys, time\n'
                    f'ckpt = {str(tmp_path / "w" / "checkpoints")!r}\n' + body)
  return [sys.executable, str(script), f'--workdir={tmp_path / "w"}']


# A stand-in trainer that exits EXIT_PREEMPTED on SIGTERM (as train.py does after its
# checkpoint). It sleeps in short slices: a signal that lands just before a sleep starts
# marks its handler due without waking the sleep (launch.SIGNAL_CHECK_SECONDS says why), and
# one long sleep outlasted the test's timeout so under load.
EXITS_3_ON_SIGTERM = ('signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n'
                      'print("ready", flush=True)\n'
                      'for _ in range(1200):\n  time.sleep(0.1)\n')


def test_exit_codes_match_train():
  assert not hasattr(train, 'EXIT_PREEMPTED')  # train.py exits with errors.py's codes
  assert not hasattr(launch, 'EXIT_PREEMPTED')  # one copy of the codes: errors.py


def test_diverged_run_is_not_restarted_but_a_crash_is(tmp_path):
  # First attempt crashes (exit 1): restarted. Second exits EXIT_DIVERGED: the
  # launcher stops there with that code, though max_failures allows more.
  body = ('marker = os.path.join(os.path.dirname(ckpt), "crashed")\n'
          'if not os.path.exists(marker):\n'
          '  os.makedirs(os.path.dirname(marker), exist_ok=True)\n'
          '  open(marker, "w").close()\n'
          '  sys.exit(1)\n'
          f'sys.exit({errors.EXIT_DIVERGED})\n')
  rc = launch.main(['--max_failures=5', '--backoff=0', '--', *fake_trainer(tmp_path, body)])
  assert rc == errors.EXIT_DIVERGED
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('started pid') == 2 and 'crashed with exit code 1' in log, log
  assert 'divergence guard' in log and 'not restarting' in log, log


@pytest.mark.parametrize('code', [errors.EXIT_USAGE, errors.EXIT_DATA, 7])
def test_an_exit_a_restart_cannot_fix_stops_at_once(tmp_path, code):
  # A typo in a config flag must not cost max_failures attempts and their backoff.
  start = time.time()
  rc = launch.main(['--max_failures=5', '--backoff=30', '--',
                    *fake_trainer(tmp_path, f'sys.exit({code})\n')])
  assert rc == code and time.time() - start < 20  # the backoff alone would be 30 s
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('started pid') == 1 and 'not restarting' in log, log
  assert errors.MEANING.get(code, 'does not know') in log, log


@pytest.mark.parametrize('body, rc', [('sys.exit(1)\n', 1),
                                      ('os.kill(os.getpid(), signal.SIGKILL)\n', 128 + 9),
                                      ('sys.exit(128 + 9)\n', 128 + 9)],  # as a shell reports it
                         ids=['crash', 'sigkill', 'sigkill_via_shell'])
def test_crashes_and_signal_deaths_are_restarted(tmp_path, body, rc):
  got = launch.main(['--max_failures=2', '--backoff=0.01', '--', *fake_trainer(tmp_path, body)])
  assert got == rc
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('started pid') == 2 and 'restarting in 0.02 s' in log, log
  assert 'Giving up' in log


def test_gives_up_after_failures_without_progress_with_backoff(tmp_path):
  command = fake_trainer(tmp_path, f'sys.exit({errors.EXIT_PREEMPTED})\n')
  rc = launch.main(['--max_failures=3', '--backoff=0.01', '--', *command])
  assert rc == errors.EXIT_PREEMPTED
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('started pid') == 3
  assert re.findall(r'restarting in ([0-9.]+) s', log) == ['0.02', '0.04']  # doubles
  assert 'Giving up' in log


def test_every_line_names_the_host_and_the_launchers_pid(tmp_path):
  # Two launchers append to one shared log (as every host of a pod does): each
  # line says which launcher wrote it, by the pid the OS gave the process.
  command = fake_trainer(tmp_path, 'sys.exit(1)\n')
  procs = [subprocess.run([sys.executable, str(REPO / 'scripts' / 'launch.py'),
                           '--max_failures=2', '--backoff=0', '--', *command], cwd=REPO,
                          capture_output=True, text=True, timeout=60) for _ in range(2)]
  log = (tmp_path / 'w' / 'launcher.log').read_text().splitlines()
  assert len(log) == 2 * 4, log  # per launcher: 2 starts, 1 restart, 1 giving up
  pids = set()
  for proc in procs:
    err = [l for l in proc.stderr.splitlines() if l.startswith('[launch')]
    assert len(err) == 4, proc.stderr
    tags = {re.search(r' host=(\S+) pid=(\d+)\]', l).groups() for l in err}
    assert len(tags) == 1, err
    host, pid = tags.pop()
    assert host == socket.gethostname()
    pids.add(pid)
    assert sorted(l for l in log if f'host={host} pid={pid}]' in l) == sorted(err)
  assert len(pids) == 2


def _gone(pid: int, timeout: float = 10) -> bool:
  """Whether `pid` has exited (or is a zombie waiting to be reaped) within `timeout` s."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    try:
      if pathlib.Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] == 'Z':
        return True
    except FileNotFoundError:
      return True
    time.sleep(0.05)
  return False


def test_stall_watchdog_kills_the_process_group_and_restarts(tmp_path):
  # Attempt 1 beats, then stops itself (SIGSTOP); attempt 2 beats, forks a
  # child and hangs; attempt 3 finishes. The watchdog arms at the first beat.
  body = ('n_file = os.path.join(os.path.dirname(ckpt), "attempts")\n'
          'n = int(open(n_file).read()) + 1 if os.path.exists(n_file) else 1\n'
          'os.makedirs(os.path.dirname(ckpt), exist_ok=True)\n'
          'open(n_file, "w").write(str(n))\n'
          'beat = os.environ["OLMO_HEARTBEAT_FILE"]\n'
          'open(n_file + f".{n}.heartbeat", "w").write(beat)\n'
          'if n == 3: sys.exit(0)\n'
          'for _ in range(3):\n'
          '  os.utime(beat)\n'
          '  time.sleep(0.1)\n'
          'if n == 1: os.kill(os.getpid(), signal.SIGSTOP)\n'
          'import subprocess\n'
          'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])\n'
          'open(n_file + ".child", "w").write(str(child.pid))\n'
          'time.sleep(600)\n')
  start = time.time()
  rc = launch.main(['--stall_timeout=1', '--backoff=0', '--max_failures=5', '--',
                    *fake_trainer(tmp_path, body)])
  elapsed = time.time() - start
  assert rc == 0
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('started pid') == 3 and log.count('no heartbeat from the trainer') == 2, log
  assert log.count('stalled, killed by the watchdog') == 2, log
  assert 2 * 1.0 < elapsed < 30  # each stall: over 1 s of silence after the last beat
  # The trainer's own child died with it, and each attempt had its own heartbeat file,
  # removed when the attempt ended.
  assert _gone(int((tmp_path / 'w' / 'attempts.child').read_text()))
  beats = [(tmp_path / 'w' / f'attempts.{n}.heartbeat').read_text() for n in (1, 2, 3)]
  assert len(set(beats)) == 3 and not any(os.path.exists(b) for b in beats)


def test_stall_watchdog_waits_for_the_first_heartbeat(tmp_path):
  # Compiling or restoring can take longer than --stall_timeout before the
  # first step: a trainer that never beats is not killed.
  rc = launch.main(['--stall_timeout=0.4', '--backoff=0', '--',
                    *fake_trainer(tmp_path, 'time.sleep(2)\nsys.exit(0)\n')])
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert rc == 0 and log.count('started pid') == 1 and 'no heartbeat' not in log, log
  rc = launch.main(['--stall_timeout=0', '--backoff=0', '--', *fake_trainer(
      tmp_path, 'sys.exit(0 if "OLMO_HEARTBEAT_FILE" not in os.environ else 1)\n')])
  assert rc == 0  # 0 disables the watchdog: no heartbeat file at all


def test_a_compiling_trainer_is_not_killed_but_one_stalled_after_its_first_beat_is(tmp_path):
  # Each attempt "compiles" (health.Heartbeat.paused, as train.py around its first step)
  # 4x longer than --stall_timeout; attempt 1 then stalls after its first beat and must be
  # killed, attempt 2 compiles as long again and finishes.
  body = (f'sys.path.insert(0, {str(REPO)!r})\n'
          'from monitor import health\n'
          'n_file = os.path.join(os.path.dirname(ckpt), "attempts")\n'
          'n = int(open(n_file).read()) + 1 if os.path.exists(n_file) else 1\n'
          'os.makedirs(os.path.dirname(ckpt), exist_ok=True)\n'
          'open(n_file, "w").write(str(n))\n'
          'heartbeat = health.Heartbeat()\n'
          'with heartbeat.compiling("train step"):\n'
          '  time.sleep(2)\n'
          'with heartbeat.compiling("train step"):\n'  # compiled: no pause the second time
          '  pass\n'
          'heartbeat.beat()\n'
          'if n == 2: sys.exit(0)\n'
          'time.sleep(600)\n')
  start = time.time()
  rc = launch.main(['--stall_timeout=0.5', '--backoff=0', '--max_failures=3', '--',
                    *fake_trainer(tmp_path, body)])
  elapsed = time.time() - start
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert rc == 0, log
  assert log.count('started pid') == 2 and log.count('no heartbeat from the trainer') == 1, log
  assert 4 < elapsed < 60  # both compiles waited out in full, one stall of > 0.5 s
  assert launch.PAUSED == health.PAUSED  # the launcher reads what the trainer writes


def test_a_pause_left_while_the_watchdog_reads_is_not_a_stall(tmp_path, monkeypatch):
  # A compile longer than --stall_timeout ends (the trainer empties the file) just as the
  # watchdog looks: it must see a fresh beat, never the pause's old time without the pause.
  path = tmp_path / 'heartbeat'
  monkeypatch.setenv(health.HEARTBEAT_ENV, str(path))
  pause = health.Heartbeat().paused()
  pause.__enter__()  # pylint: disable=unnecessary-dunder-call  # left inside open(), below
  os.utime(path, (time.time() - 60,) * 2)  # paused for a minute: 30x the timeout
  left = []

  def open_as_the_pause_ends(file, *args, **kwargs):
    if not left and os.fspath(file) == str(path):
      left.append(path.read_bytes().startswith(health.PAUSED))
      pause.__exit__(None, None, None)  # the trainer's own write: empty, touched
    return open(file, *args, **kwargs)
  monkeypatch.setattr(launch, 'open', open_as_the_pause_ends, raising=False)
  watcher = launch.Launcher([sys.executable, '-c', 'import time; time.sleep(1.5)'],
                            str(tmp_path / 'w'), stall_timeout=2)  # polls every 0.5 s
  watcher.child = subprocess.Popen(watcher.command, start_new_session=True)
  try:
    stalled = watcher._wait(1, str(path))  # pylint: disable=protected-access
  finally:
    watcher.child.kill()
  assert left == [True] and not stalled


def test_a_trainer_descheduled_as_it_enters_a_pause_is_never_stalled(tmp_path, monkeypatch):
  # The launcher's file, not touched yet; the trainer enters a compile's pause. Were it
  # descheduled for a minute at any line of that write, the watchdog must still wait: an
  # open that truncates the file sets its time before the bytes land.
  path = tmp_path / 'heartbeat'
  path.write_bytes(b'')
  os.utime(path, (0, 0))
  monkeypatch.setenv(health.HEARTBEAT_ENV, str(path))
  seen = []

  def trace(frame, event, arg):  # a watchdog's look, a minute later, at each line
    if frame.f_code is not health.Heartbeat._write.__code__:  # pylint: disable=protected-access
      return None
    if event == 'line':
      seen.append(launch.silence(str(path), now=time.time() + 60))
    return trace
  trainer = health.Heartbeat()
  sys.settrace(trace)
  try:
    with trainer.paused():
      sys.settrace(None)
      inside = launch.silence(str(path), now=time.time() + 60)
  finally:
    sys.settrace(None)
  assert len(seen) >= 3 and seen == [None] * len(seen) and inside is None, seen
  assert launch.silence(str(path), now=time.time() + 60) > 59  # left: a beat, timed again


def test_progress_resets_the_failure_count_and_success_stops(tmp_path):
  # Each attempt commits one more step and crashes; the sixth finishes. With
  # max_failures=2 only the progress keeps the launcher going.
  body = ('n = len(os.listdir(ckpt)) if os.path.isdir(ckpt) else 0\n'
          'if n == 5: sys.exit(0)\n'
          'os.makedirs(os.path.join(ckpt, f"step_{n + 1}"))\n'
          'open(os.path.join(ckpt, f"step_{n + 1}", "COMMIT"), "w").close()\n'
          'sys.exit(1)\n')
  handlers = [signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)]
  rc = launch.main(['--max_failures=2', '--backoff=0', '--', *fake_trainer(tmp_path, body)])
  assert rc == 0
  # Used as a library, the launcher puts the caller's signal handlers back.
  assert [signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)] == handlers
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('started pid') == 6 and log.count('(progress)') == 5
  assert 'finished (exit 0)' in log


def test_preempted_exit_restarts_and_sigterm_to_launcher_is_forwarded(tmp_path):
  # A signalled launcher passes the signal on and does not restart.
  proc = subprocess.Popen([sys.executable, str(REPO / 'scripts' / 'launch.py'), '--backoff=0',
                           '--', *fake_trainer(tmp_path, EXITS_3_ON_SIGTERM)], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  assert proc.stdout.readline().strip() == 'ready'
  proc.send_signal(signal.SIGTERM)
  _, err = communicate_or_explain(proc, timeout=60)
  assert proc.returncode == 3, err
  assert 'not restarting' in err and err.count('started pid') == 1


def communicate_or_explain(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
  """proc.communicate(); past `timeout`, fails with what the launcher's threads were doing
  (its SIGUSR1 stack dump) and the state of its trainer (alive? which signals pending,
  blocked, caught?), then kills both."""
  try:
    return proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired as e:
    seen = e.stderr.decode(errors='replace') if isinstance(e.stderr, bytes) else e.stderr or ''
    trainer = re.findall(r'started pid (\d+)', seen)
    states = []
    for pid in trainer:
      try:
        status = pathlib.Path(f'/proc/{pid}/status').read_text().splitlines()
        states.append(f'trainer {pid}: ' + '; '.join(
            l for l in status if l.split(':')[0] in ('State', 'SigPnd', 'ShdPnd', 'SigBlk',
                                                     'SigIgn', 'SigCgt')))
      except OSError:
        states.append(f'trainer {pid}: gone')
    proc.send_signal(signal.SIGUSR1)
    time.sleep(1)
    for pid in trainer:
      try:
        os.killpg(int(pid), signal.SIGKILL)
      except OSError:
        pass
    proc.kill()
    _, err = proc.communicate()
    pytest.fail(f'no exit within {timeout} s. {" | ".join(states)}\nlauncher stderr:\n'
                f'{seen}{err}')


def test_sigterm_while_the_trainer_starts_reaches_it(tmp_path, monkeypatch):
  """The signal lands after the trainer's fork but before the launcher knows its pid (a
  loaded host: the test above once waited out the trainer's whole sleep): the start
  passes it on, once."""
  started = []

  class SignalledWhileStarting(subprocess.Popen):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, stdout=ready_w, **kwargs)
      started.append(self)
      # Once the trainer's handler is in, signal the launcher before Popen returns.
      line = b''
      while not line.endswith(b'ready\n'):
        line += os.read(ready_r, 1)
      os.kill(os.getpid(), signal.SIGTERM)

  ready_r, ready_w = os.pipe()
  monkeypatch.setattr(launch.subprocess, 'Popen', SignalledWhileStarting)
  began = time.monotonic()
  try:
    rc = launch.Launcher(fake_trainer(tmp_path, EXITS_3_ON_SIGTERM), str(tmp_path / 'w'),
                         backoff=0).run()
  finally:
    os.close(ready_r)
    os.close(ready_w)
  assert time.monotonic() - began < 30  # not the trainer's 120 s
  assert rc == 3 and len(started) == 1 and started[0].returncode == 3
  log = (tmp_path / 'w' / 'launcher.log').read_text()
  assert log.count('passing it to the trainer') == 1, log
  assert 'launcher was signalled, not restarting' in log, log


@pytest.mark.parametrize('when', ['trainer_running', 'backing_off'])
def test_a_signal_whose_handler_is_due_but_not_run_is_acted_on_soon(tmp_path, when):
  """A signal that lands just before a blocking call starts marks its handler due without
  waking the call (CPython runs handlers between bytecodes). A signal sent to another
  thread has the same effect, reliably: the launcher must act on it within
  SIGNAL_CHECK_SECONDS, not when the trainer exits (no watchdog: it would wait on the
  trainer alone) or when its backoff ends."""
  ready = tmp_path / 'ready'
  body = {'trainer_running': f'open({str(ready)!r}, "w").close()\n' + EXITS_3_ON_SIGTERM,
          'backing_off': 'sys.exit(1)\n'}[when]
  log = tmp_path / 'w' / 'launcher.log'

  def signal_this_thread():
    while not (ready.exists() if when == 'trainer_running' else
               log.exists() and 'restarting in' in log.read_text()):
      time.sleep(0.02)
    time.sleep(0.3)  # the launcher is inside its wait or its sleep by now
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

  signaller = threading.Thread(target=signal_this_thread, daemon=True)
  signaller.start()
  began = time.monotonic()
  rc = launch.Launcher(fake_trainer(tmp_path, body), str(tmp_path / 'w'), backoff=60,
                       max_backoff=60, stall_timeout=0).run()
  assert time.monotonic() - began < 15  # not the trainer's 120 s, nor the 60 s backoff
  text = log.read_text()
  if when == 'trainer_running':
    assert rc == 3 and 'passing it to the trainer' in text, text
  else:
    assert rc == 128 + signal.SIGTERM and 'not starting attempt 2' in text, text


def test_sigterm_before_the_first_attempt_starts_no_trainer(tmp_path, monkeypatch):
  started = []
  monkeypatch.setattr(launch.subprocess, 'Popen', lambda *a, **k: started.append(a))
  monkeypatch.setattr(launch.Launcher, 'latest_step',
                      lambda self: os.kill(os.getpid(), signal.SIGTERM))
  rc = launch.Launcher(fake_trainer(tmp_path, ''), str(tmp_path / 'w'), backoff=0).run()
  assert rc == 128 + signal.SIGTERM and not started
  assert 'not starting attempt 1' in (tmp_path / 'w' / 'launcher.log').read_text()


def test_usage_errors_name_the_fix(tmp_path, capsys):
  with pytest.raises(SystemExit):
    launch.main(['python', 'train.py'])
  assert 'after `--`' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    launch.main(['--', 'python', 'train.py', '--workdir', str(tmp_path)])
  assert 'no --workdir' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    launch.main(['--', str(tmp_path / 'no-such-python'), f'--workdir={tmp_path}'])
  assert 'no-such-python' in capsys.readouterr().err and not (tmp_path / 'launcher.log').exists()


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The undisturbed run: 2 devices, STEPS steps, a checkpoint every 2."""
  workdir = tmp_path_factory.mktemp('reference')
  run_train(workdir, STEPS, 2)
  return workdir


def _attempt_started(log: pathlib.Path, attempt: int, launcher: subprocess.Popen
                     ) -> tuple[int, int]:
  """(pid, the checkpoint it resumes from: 0 for none) of the launcher's `attempt`."""
  def started():
    found = re.findall(r'attempt (\d+): started pid (\d+) \(latest checkpoint: (None|\d+)\)',
                       log.read_text() if log.exists() else '')
    return found[-1] if found and int(found[-1][0]) == attempt else None
  try:
    _, pid, resumed = poll_until(started, launcher, f'attempt {attempt} started', timeout=120)
  except AssertionError as e:
    raise AssertionError(f'{e}:\n' + (log.read_text() if log.exists() else '')) from None
  return int(pid), 0 if resumed == 'None' else int(resumed)


class _Checkpoints:
  """The committed checkpoints of a workdir as this test sees them, polled every 5 ms.

  A checkpoint past the one an attempt resumed from is that attempt's own (a
  metrics.jsonl record need not be: a killed attempt may have logged steps past its
  last checkpoint, which the next attempt drops), and a kill that follows one is
  progress for the launcher (--max_failures counts attempts without)."""

  POLL = 0.005

  def __init__(self, workdir: pathlib.Path, launcher: subprocess.Popen):
    self.dir, self.launcher = workdir / 'checkpoints', launcher
    self.seen: dict[int, tuple[float, int]] = {}  # step: (time first seen, attempt)
    self.attempt = 0  # the attempt running now (set by the test)
    self.period: float | None = None  # the latest time between two one attempt wrote

  def latest(self) -> int:
    steps = checkpoint.committed_steps(str(self.dir)) if self.dir.is_dir() else []
    now = time.monotonic()
    for step in steps:
      if step not in self.seen:
        self.seen[step] = (now, self.attempt)
        before = self.seen.get(step - 1)
        if before is not None and before[1] == self.attempt:
          self.period = now - before[0]
    return steps[-1] if steps else 0

  def wait_for(self, step: int) -> int:
    return poll_until(lambda: (latest := self.latest()) >= step and latest, self.launcher,
                  f'checkpoint {step}', poll=self.POLL)

  def saving(self, step: int) -> bool:
    return any(self.dir.glob(f'tmp.step_{step}.*'))


def _send(pid: int, sig: int) -> None:
  try:
    os.kill(pid, sig)
  except ProcessLookupError:  # it finished first: the plan left it too few steps
    raise AssertionError(f'the trainer (pid {pid}) exited before signal {sig}') from None


def _handles_sigterm(pid: int) -> bool:
  """Whether `pid` has a SIGTERM handler (train.py installs one as its loop starts)."""
  status = pathlib.Path(f'/proc/{pid}/status').read_text()
  caught = int(re.search(r'^SigCgt:\s*([0-9a-f]+)$', status, re.M).group(1), 16)
  return bool(caught >> (signal.SIGTERM - 1) & 1)


# Where the signals go (ckpt_every=1: a step and its save take ~0.1 s on an idle machine,
# so a wait of a fixed time is several steps). The trainer acts on SIGTERM at the end of
# the step it lands in, and one that lands after the last step's check ends the run with
# exit 0: the SIGTERM goes as the save after a checkpoint at most TERM_BY starts, so it
# lands in step TERM_BY + 2 at the latest, with the steps after it as the test's slack.
# Each attempt's checkpoints are chosen relative to the one it resumed from (however far
# the kills before it went past their plan), each SIGKILL goes before the next checkpoint
# commits, and the kills' planned checkpoints end by KILLS_BY: a kill that goes a
# checkpoint late still leaves the SIGTERM one to follow. Two or more late (a test
# process descheduled for a step), and the SIGTERM goes as attempt 4's loop starts.
TERM_BY = STEPS - 4
KILLS_BY = TERM_BY - 2


@pytest.mark.slow
def test_sigkills_and_sigterm_under_the_launcher_end_bit_exact(reference, tmp_path):
  seed = int(time.time())
  rng = np.random.default_rng(seed)
  workdir = tmp_path / 'run'
  launcher = subprocess.Popen(
      [sys.executable, str(REPO / 'scripts' / 'launch.py'), '--backoff=0', '--max_failures=3',
       '--', *train_args(workdir, STEPS, 1)], cwd=REPO, env=trainer_env(2),
      stdout=subprocess.DEVNULL, stderr=open(tmp_path / 'launcher.err', 'w'))
  log = workdir / 'launcher.log'
  ckpts = _Checkpoints(workdir, launcher)
  for attempt in (1, 2, 3):
    pid, resumed = _attempt_started(log, attempt, launcher)
    ckpts.attempt = attempt
    assert ckpts.latest() == resumed, (resumed, ckpts.seen)
    # 1 or more checkpoints past the resume point, leaving each later kill at least one.
    planned = resumed + int(rng.integers(1, max(1, KILLS_BY - resumed - (3 - attempt)) + 1))
    ckpts.wait_for(planned)
    # Anywhere in the next step or its save: a random part of the time between two
    # checkpoints (0.2 s before one was timed), and at once if the next one commits.
    delay = rng.uniform(0, ckpts.period or 0.2)
    end = time.monotonic() + delay
    while time.monotonic() < end and ckpts.latest() == planned:
      time.sleep(ckpts.POLL)
    _send(pid, signal.SIGKILL)
    print(f'seed {seed}: attempt {attempt} resumed from {resumed}; SIGKILL up to {delay:.3f} '
          f's after checkpoint {planned} (latest as sent: {ckpts.latest()})', flush=True)
  pid, resumed = _attempt_started(log, 4, launcher)
  ckpts.attempt = 4
  assert ckpts.latest() == resumed < STEPS, (resumed, ckpts.seen)
  if resumed < TERM_BY:  # preemption: SIGTERM as the save after a checkpoint starts
    after = int(rng.integers(resumed + 1, TERM_BY + 1))
    ckpts.wait_for(after)
    poll_until(lambda: ckpts.saving(after + 1) or ckpts.latest() > after, launcher,
           f'the save of step {after + 1}', poll=ckpts.POLL)
    _send(pid, signal.SIGTERM)
    where = (f'after checkpoint {after} '
             f'({"during" if ckpts.saving(after + 1) else "after"} the next save)')
  else:  # the kills went 2 or more checkpoints late
    poll_until(lambda: _handles_sigterm(pid), launcher, 'a SIGTERM handler', poll=ckpts.POLL)
    _send(pid, signal.SIGTERM)
    where = 'as its loop started (the kills went late)'
  print(f'seed {seed}: attempt 4 resumed from {resumed}; SIGTERM {where}', flush=True)
  preempted_at = _attempt_started(log, 5, launcher)[1]  # the preemption's checkpoint
  assert launcher.wait(timeout=600) == 0, (tmp_path / 'launcher.err').read_text()[-3000:]
  text = log.read_text()
  assert text.count('started pid') == 5, text
  assert text.count('killed by signal 9') == 3 and 'preempted, checkpoint written' in text, text
  assert resumed < preempted_at <= STEPS, text
  assert_bitwise_equal(final_params(workdir), final_params(reference))


def _limit_file_size(limit: int):
  def set_limit():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG, as ENOSPC on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
  return set_limit


@pytest.mark.slow
def test_disk_full_during_save_keeps_last_checkpoint_and_resumes_exact(reference, tmp_path):
  copy_checkpoints(reference, tmp_path, upto=4)
  # Each embedding shard is 1 MB: the step-6 save cannot finish.
  proc = subprocess.run(train_args(tmp_path, STEPS, 2), cwd=REPO, env=trainer_env(2),
                        capture_output=True, text=True, timeout=300,
                        preexec_fn=_limit_file_size(512 << 10))
  out = proc.stdout + proc.stderr
  assert proc.returncode != 0, out[-3000:]
  assert 'Checkpoint save of step 6' in out and 'earlier checkpoints are intact' in out, out[-3000:]
  assert committed(tmp_path) == [2, 4]
  assert not list((tmp_path / 'checkpoints').glob('tmp.step_*'))
  run_train(tmp_path, STEPS, 2)
  assert_bitwise_equal(final_params(tmp_path), final_params(reference))


@pytest.mark.slow
def test_data_file_vanishing_mid_run(reference, tmp_path):
  data_dir = tmp_path / 'data'
  data_dir.mkdir()
  copy = data_dir / TRAIN_FILE.name
  shutil.copy(TRAIN_FILE, copy)
  # Explicit files instead of small.py's mix: then the tokenizer's ids are stated too.
  paths = (f'--config.data.paths=("{copy}",)', '--config.data.mix_file=',
           '--config.data.vocab_size=8192', '--config.data.eos_token_id=0',
           '--config.data.pad_token_id=1')
  proc = spawn_train(tmp_path, 6, 2, *paths, log=tmp_path / 'log')
  wait_for_step(tmp_path, 2, proc)
  copy.unlink()
  # The file is memory mapped from the first batch on: the run does not notice.
  assert proc.wait(timeout=300) == 0, (tmp_path / 'log').read_text()[-3000:]
  # A restart does notice, and says which file and where to look.
  out = run_train(tmp_path, STEPS, 2, *paths, expect_rc=errors.EXIT_DATA)
  assert f'{copy}: token file does not exist' in out
  assert committed(tmp_path) == [2, 4, 6]
  shutil.copy(TRAIN_FILE, copy)
  run_train(tmp_path, STEPS, 2, *paths)
  assert_bitwise_equal(final_params(tmp_path), final_params(reference))


def _tiny_config():
  """The dimensions of test_multihost.TINY as a ConfigDict, for in-process steps."""
  cfg = config_checks.complete(small.get_config())
  m = cfg.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 4, 64, 2, 2
  m.head_dim, m.mlp_hidden, m.sliding_window = 32, 128, 16
  cfg.data.seq_len, cfg.data.global_batch_size, cfg.train.micro_batch_size = 64, 8, 1
  return cfg


def test_nan_loss_is_skipped_and_the_run_continues(tmp_path, monkeypatch):
  """A poisoned batch (label -7) turns its loss and gradients into NaN inside the jitted step."""
  poison = -7
  original = loss.sums

  def poisoned_loss_sums(h_BTD, w_DV, labels_BT, mask_B, **kw):
    bad = jnp.any(labels_BT == poison)
    ce, z = original(h_BTD, w_DV, jnp.where(labels_BT == poison, loss.IGNORE_INDEX, labels_BT),
                     mask_B, **kw)
    return ce * jnp.where(bad, jnp.nan, 1.0), z
  monkeypatch.setattr(loss, 'sums', poisoned_loss_sums)

  cfg = _tiny_config()
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:2])  # 2 devices compile faster than 8
  state, shardings = train.create_state(cfg, optim.make_optimizer(cfg.opt), mesh, jax.random.key(0))
  ds = data.Dataset.from_config(cfg.data)
  loader = data.Loader(ds, seed=cfg.data.seed, global_batch_size=8)
  step = jax.jit(train.make_train_step(cfg, optim.make_optimizer(cfg.opt), mesh, accum=4),
                 out_shardings=(shardings, None))
  put = lambda b: {k: jax.device_put(v, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(*sharding.batch_sharding(mesh).spec[:np.ndim(v)])))
      for k, v in b.items()}
  host = lambda t: jax.tree.map(np.asarray, t)
  with loader:
    batches = [next(loader) for _ in range(5)]
  batches[3]['labels'][0, 0] = poison
  for b in batches[:3]:
    state, m = step(state, put(b))
    assert float(m['optim/step skipped']) == 0
  before = host(state)
  state, m = step(state, put(batches[3]))
  after = host(state)
  assert np.isnan(float(m['train/CE loss'])) and float(m['optim/step skipped']) == 1
  for name in ('params', 'mu', 'nu'):  # bit for bit untouched
    a = before.params if name == 'params' else getattr(before.opt_state, name)
    b = after.params if name == 'params' else getattr(after.opt_state, name)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
  assert after.opt_state.count == before.opt_state.count == 3
  assert after.opt_state.step == 4 and after.opt_state.history_len == 3  # NaN kept out
  # The checkpoint written after the NaN restores and the next step is a normal one.
  with checkpoint.Checkpointer(tmp_path, fsync=False) as ckpt:
    ckpt.save(4, state)
    ckpt.wait()
    target = train.abstract_state(cfg, optim.make_optimizer(cfg.opt), mesh)
    restored, _ = ckpt.restore(target)
  state, m = step(state, put(batches[4]))
  restored, m2 = step(restored, put(batches[4]))
  assert np.isfinite(float(m['train/CE loss'])) and float(m['optim/step skipped']) == 0
  assert_bitwise_equal({str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))},
                       {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(restored))})


@pytest.mark.slow
def test_a_lost_peer_process_is_one_line_naming_it_and_the_run_restarts(tmp_path):
  """Two jax.distributed processes on localhost; process 1 dies (SIGKILL) once both are up.
  Process 0 aborts when the coordination service misses process 1's heartbeats (SIGABRT,
  its own C++ log): the launcher says which process was lost, in one line per attempt, and
  restarts the run (a signal death), here until --max_failures=2."""
  address = f'127.0.0.1:{servers.free_port()}'
  body = ('import subprocess\n'
          'index = int(os.environ.get("PEER_INDEX", "0"))\n'
          'if index == 0:\n'
          '  peer = subprocess.Popen([sys.executable, *sys.argv], '
          'env=dict(os.environ, PEER_INDEX="1"))\n'
          'import jax\n'
          f'jax.distributed.initialize({address!r}, 2, index, heartbeat_timeout_seconds=4)\n'
          'if index == 1:\n'
          '  time.sleep(1)\n'
          '  os.kill(os.getpid(), signal.SIGKILL)\n'
          'time.sleep(120)\n'
          'sys.exit(0)\n')
  proc = subprocess.run([sys.executable, str(REPO / 'scripts' / 'launch.py'), '--backoff=0',
                         '--max_failures=2', '--stall_timeout=0', '--',
                         *fake_trainer(tmp_path, body)], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 128 + signal.SIGABRT, proc.stderr[-4000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(lines) == 2 and all('process 1 of this multi-process run was lost' in line
                                 for line in lines), proc.stderr[-4000:]
  assert proc.stderr.count('started pid') == 2 and 'restarting in 0 s' in proc.stderr
  assert 'process 1 of the run was lost' in (tmp_path / 'w' / 'launcher.log').read_text()
