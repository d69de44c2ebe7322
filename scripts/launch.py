"""Runs the trainer until it finishes, restarting it when a restart can fix the exit.

  python scripts/launch.py -- python train.py --config=configs/olmo3_7b.py --workdir=/ckpt/run

Where: one host (a workstation, a single-host TPU VM such as a v5e-8, a GPU
machine), or one launcher around `srun` under SLURM. Not on a multi-host TPU
slice: there the slice restarts as one unit, by the engine that schedules it
(deploy/jobset-v5e.yaml, a GKE JobSet with these same exit-code rules), and a
launcher per host would restart each host on its own clock and could not bring
back a preempted slice (docs/pods.md).

Everything after `--` is the trainer command. Its exit code (errors.py) decides:

  0                          done: the launcher exits 0.
  1 crash, 3 preempted       restarted, unchanged (errors.RESTARTABLE).
  killed by a signal         restarted: a negative code (SIGKILL, the OOM killer),
                             or 128+N as a shell or srun reports signal N.
  2 usage, 4 diverged,       not restarted: a rerun of the same command repeats
  5 data, any other code     them. The launcher says what the code means and
                             exits with it at once.

Each restart resumes from the latest committed checkpoint in --workdir. A
restart that followed progress (a newer committed checkpoint step than before
the attempt) waits --backoff seconds; attempts without progress wait twice as
long each time, up to --max_backoff, and after --max_failures of them in a row
the launcher gives up with the trainer's exit code.

Stall watchdog: a trainer that stops without dying (SIGSTOPped, deadlocked in
a collective) would be waited on forever. Each attempt gets a fresh heartbeat
file on local disk, named in the environment variable OLMO_HEARTBEAT_FILE;
train.py touches it after every step, the first time once its first step has
run. While the file starts with `paused` (health.Heartbeat.paused: train.py
compiling its first step, or its first evaluation) the time is not counted;
leaving the pause touches it. Once it has been touched (packing data and
restoring may take long before that), a heartbeat older than --stall_timeout
seconds, not paused, makes the launcher kill the trainer's whole process group
(SIGKILL) and restart it like a crash. So a --stall_timeout shorter than a
compile does not kill a trainer that is compiling.

A process of a multi-process run that dies makes train.py's other processes
stop with one `error:` line naming it and exit 1 (hosts/peers.py), restarted like a
crash. A trainer that aborts instead (SIGABRT: a bare jax.distributed client) is
restarted like any signal death; its stderr passes through the launcher, which
reads the lost process's number from jax.distributed's own log lines and says
it in one `error:` line.

The trainer runs in its own session (process group), so the watchdog reaches
its children too, and whatever it leaves behind when it exits is killed
before the next attempt. SIGTERM/SIGINT to the launcher are passed to the
trainer (which checkpoints and exits) within SIGNAL_CHECK_SECONDS, and then the
launcher exits too; one that comes before a trainer is started (or between
attempts, which ends the backoff's wait) starts none. Every
start, exit and restart is logged to stderr and appended to
<workdir>/launcher.log, each line naming the host and the launcher's pid (when
several launchers share a workdir, each appends to the same file). SIGUSR1
prints every thread's stack to stderr (and the launcher goes on). SLURM: one
launcher around `srun` (docs/results/scale.md); pods: docs/pods.md.
"""

import argparse
import contextlib
import datetime
import faulthandler
import io
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402  (repo root on the path first)
import errors  # noqa: E402
from store import storage  # noqa: E402

HEARTBEAT_ENV = 'OLMO_HEARTBEAT_FILE'
PAUSED = b'paused'  # health.PAUSED: the trainer is compiling, the watchdog does not count
LOG_FLUSH_SECONDS = 15.0  # at exit, the longest wait for launcher.log's last lines
# CPython runs a signal's Python handler between bytecodes. A signal that lands after the
# interpreter's last look and before a blocking call (a sleep, a wait) starts only marks the
# handler due: the call blocks on to its end, and a SIGTERM would reach the trainer only
# when it exits. So no wait of the launcher blocks longer than this at a time.
SIGNAL_CHECK_SECONDS = 0.5
_TASK = re.compile(rb'^\s*(?:/job:[^/\s]+/replica:\d+/task:)?(\d+)\s*$')  # a listed lost task


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n')[0],
      usage='launch.py [options] -- TRAINER COMMAND (e.g. python train.py --workdir=DIR ...)')
  parser.add_argument('--workdir', default=None,
                      help="the trainer's workdir (default: its --workdir= argument)")
  parser.add_argument('--max_failures', type=int, default=5,
                      help='give up after this many attempts in a row without progress')
  parser.add_argument('--backoff', type=float, default=10.0,
                      help='seconds before a restart; doubles per attempt without progress')
  parser.add_argument('--max_backoff', type=float, default=600.0,
                      help='the longest wait between attempts, in seconds')
  parser.add_argument('--stall_timeout', type=float, default=1800.0,
                      help='kill and restart a trainer whose heartbeat file ($%s) is older than '
                           'this many seconds, once it was touched and while it is not paused '
                           '(compiling); 0 disables' % HEARTBEAT_ENV)
  if '--' not in argv:
    parser.error('put the trainer command after `--`.')
  split = argv.index('--')
  args = parser.parse_args(argv[:split])
  args.command = argv[split + 1:]
  if not args.command:
    parser.error('the trainer command after `--` is empty.')
  if args.workdir is None:
    found = [a.split('=', 1)[1] for a in args.command if a.startswith('--workdir=')]
    if not found:
      parser.error('no --workdir: pass --workdir=DIR to the launcher or --workdir=DIR '
                   '(with "=") in the trainer command.')
    args.workdir = found[-1]
  try:
    args.workdir = storage.canonical(args.workdir)  # the form train.py resolves too
  except errors.ConfigError as e:
    parser.error(str(e))
  if args.max_failures < 1 or args.backoff < 0 or args.max_backoff < args.backoff:
    parser.error('need --max_failures >= 1 and 0 <= --backoff <= --max_backoff.')
  if args.stall_timeout < 0:
    parser.error('need --stall_timeout >= 0 (seconds; 0 disables the watchdog).')
  if shutil.which(args.command[0]) is None:  # else every attempt fails the same way
    parser.error(f'the trainer command {args.command[0]!r} is not an executable file or on PATH; '
                 'fix the command after `--`.')
  return args


def signal_of(rc: int) -> int | None:
  """The signal that ended the trainer: a negative code, or 128+N from a shell or srun."""
  if rc < 0:
    return -rc
  if 128 < rc <= 128 + 64:
    return rc - 128
  return None


def describe(rc: int) -> str:
  """An exit code in words, for the log."""
  sig = signal_of(rc)
  if sig is not None:
    return f'killed by signal {sig}' + (f' (exit {rc})' if rc > 0 else '')
  if rc == errors.EXIT_CRASH:
    return f'crashed with exit code {rc}'
  return f'exited with {rc}: {errors.MEANING.get(rc, "an exit code the launcher does not know")}'


def _write_unbuffered(text: str) -> None:
  """Writes to stderr's file descriptor, past Python's buffer and its lock; a stderr
  without one (a test's capture) gets an ordinary write."""
  try:
    os.write(sys.stderr.fileno(), text.encode())
  except (AttributeError, OSError, ValueError):
    sys.stderr.write(text)


class _Relay:
  """Copies the trainer's stderr to the launcher's as it comes, noting the processes that
  jax.distributed's coordination service reports lost. When a process of a multi-process
  run dies, the others abort (SIGABRT) with the service's own log lines and a C++ stack,
  the only place that names the lost process; the launcher turns that into one line."""

  def __init__(self, stream):
    self.lost: list[int] = []
    self.said = False  # the trainer printed its own `error:` line (train.py names a lost peer)
    self.thread = threading.Thread(target=self._copy, args=(stream,), name='trainer-stderr',
                                   daemon=True)
    self.thread.start()

  def _copy(self, stream) -> None:
    listing = False
    out = getattr(sys.stderr, 'buffer', None)
    for line in iter(stream.readline, b''):
      if out is not None:
        out.write(line)
        out.flush()
      else:  # a text-only stderr (a test's capture)
        sys.stderr.write(line.decode(errors='replace'))
      self.said = self.said or line.startswith(b'error:')
      if b'tasks are unhealthy' in line:  # the task ids follow, one a line
        listing = True
        continue
      m = _TASK.match(line) if listing else None
      if m:
        if int(m.group(1)) not in self.lost:
          self.lost.append(int(m.group(1)))
      else:
        listing = False
    stream.close()


def silence(heartbeat: str, now: float | None = None) -> float | None:
  """Seconds since the trainer's last beat; None while it is paused (compiling), before
  its first beat, or when the file cannot be read (the watchdog cannot tell, so it waits).
  The content is read first and the time from the same open file: a pause left between
  the two reads is a fresh beat, never a stale one unpaused (health.Heartbeat renames
  each new content over the file, so content and time change together)."""
  try:
    with open(heartbeat, 'rb') as f:
      paused = f.read(len(PAUSED)) == PAUSED
      touched = os.fstat(f.fileno()).st_mtime
  except OSError:  # removed by a tmp cleaner, say
    return None
  if paused or touched <= 0:  # mtime 0: not touched yet, the watchdog is not armed
    return None
  return (time.time() if now is None else now) - touched


class Launcher:
  """The restart loop; `run()` returns the exit code for the launcher itself."""

  def __init__(self, command: list[str], workdir: str, max_failures: int = 5,
               backoff: float = 10.0, max_backoff: float = 600.0, stall_timeout: float = 1800.0):
    self.command, self.workdir = command, workdir
    self.max_failures, self.backoff, self.max_backoff = max_failures, backoff, max_backoff
    self.stall_timeout = stall_timeout
    self.ckpt_dir = storage.join(workdir, 'checkpoints')
    self.child: subprocess.Popen | None = None
    self.lost: list[int] = []  # processes the trainer's last attempt reported lost
    self.lost_said = False  # ... and whether the trainer said so in its own `error:` line
    self.stopping = 0  # the SIGTERM or SIGINT the launcher received, once it has one
    self._passed_to: subprocess.Popen | None = None  # the trainer that got it
    # Every host's launcher appends to the same shared log, and pids repeat across hosts.
    self.tag = f'host={socket.gethostname()} pid={os.getpid()}'
    storage.makedirs(workdir)
    # In a bucket each line is one conditional append (storage.append): lines are rare.
    # They are appended by a thread of their own: a store that does not answer takes the
    # client's whole retry budget per request, and supervising must not wait on a record.
    self.log_path = storage.join(workdir, 'launcher.log')
    # put() is safe in a signal handler; an Event in the queue marks a flush (flush_log).
    self._lines: queue.SimpleQueue = queue.SimpleQueue()
    self._appender = threading.Thread(target=self._append_lines, name='launcher-log',
                                      daemon=True)
    self._appender.start()

  def log(self, message: str, in_handler: bool = False) -> None:
    now = datetime.datetime.now().isoformat(timespec='seconds')
    line = f'[launch {now} {self.tag}] {message}\n'
    if in_handler:  # the handler may interrupt a print on this thread: its lock is held
      _write_unbuffered(line)
    else:
      print(line, end='', file=sys.stderr, flush=True)
    self._lines.put(line)

  def _append_lines(self) -> None:
    while True:
      line = self._lines.get()
      if isinstance(line, threading.Event):  # every line queued before it is written
        line.set()
        continue
      try:
        storage.append(self.log_path, line)
      except OSError as e:  # the log is a record; never stop supervising for it
        print(f'[launch] cannot append to {self.log_path}: {" ".join(str(e).split())}',
              file=sys.stderr, flush=True)

  def flush_log(self, timeout: float = LOG_FLUSH_SECONDS) -> None:
    """Waits up to `timeout` seconds for the lines queued so far to be appended."""
    flushed = threading.Event()
    self._lines.put(flushed)
    flushed.wait(timeout)

  def latest_step(self) -> int | None:
    """The latest committed step, or None when the storage cannot say (the trainer meets
    the same fault and reports it with its exit class, which decides the restart)."""
    try:
      return checkpoint.latest_step(self.ckpt_dir)
    except OSError as e:
      print(f'[launch] cannot list {self.ckpt_dir}: {" ".join(str(e).split())[:300]}',
            file=sys.stderr, flush=True)
      return None

  def _forward(self, signum, frame) -> None:
    del frame
    self.stopping = self.stopping or signum
    self._pass_on(in_handler=True)

  def _pass_on(self, in_handler: bool = False) -> None:
    """Passes the launcher's signal to the running trainer, once. The signal can come
    while the trainer is being started, before the launcher knows its pid: the start
    passes it on then (_attempt)."""
    child = self.child
    if not self.stopping or child is None or child is self._passed_to or child.poll() is not None:
      return
    self._passed_to = child
    self.log(f'signal {self.stopping}: passing it to the trainer (pid {child.pid}), then '
             'exiting.', in_handler)
    child.send_signal(self.stopping)

  def run(self) -> int:
    # The handlers are put back on return: a caller in the same process (or a
    # child it forks later) must not inherit a SIGTERM that only sets a flag.
    previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
      return self._supervise()
    finally:
      self.flush_log()
      for sig, handler in previous.items():
        signal.signal(sig, handler)
      if self.child is not None and self.child.poll() is None:  # the launcher itself failed
        self._kill_group()
        self.child.wait()

  def _kill_group(self) -> bool:
    """SIGKILLs the trainer's process group; False if nothing of it was left."""
    try:
      os.killpg(self.child.pid, signal.SIGKILL)
      return True
    except (ProcessLookupError, PermissionError):
      return False

  def _attempt(self, attempt: int, best: int | None) -> tuple[int, bool]:
    """Runs the trainer once; (its exit code, whether the stall watchdog killed it)."""
    env, heartbeat = os.environ.copy(), None
    if self.stall_timeout > 0:
      fd, heartbeat = tempfile.mkstemp(prefix=f'olmo-heartbeat-{os.getpid()}-{attempt}-')
      os.close(fd)
      os.utime(heartbeat, (0, 0))  # mtime 0: not touched yet, so the watchdog is not armed
      env[HEARTBEAT_ENV] = heartbeat
    try:
      # Its own session: the watchdog kills the trainer's children with it, and
      # a terminal's Ctrl-C reaches it once, through _forward.
      self.child = subprocess.Popen(self.command, env=env, start_new_session=True,
                                    stderr=subprocess.PIPE)
      relay = _Relay(self.child.stderr)
      self.log(f'attempt {attempt}: started pid {self.child.pid} (latest checkpoint: '
               f'{best}): {" ".join(self.command)}')
      self._pass_on()  # a signal that came while it started, before self.child was set
      stalled = self._wait(attempt, heartbeat)
      rc = self.child.wait()  # it has exited, or its process group was SIGKILLed
      relay.thread.join(10)
      self.lost, self.lost_said = relay.lost, relay.said
    finally:
      for path in (heartbeat, f'{heartbeat}.tmp') if heartbeat is not None else ():
        if os.path.exists(path):  # .tmp: the trainer's next content, if it died writing it
          os.remove(path)
    if not stalled and self._kill_group():  # e.g. a data worker it forked and never reaped
      self.log(f'attempt {attempt}: killed processes the trainer left in its process group.')
    return rc, stalled

  def _wait(self, attempt: int, heartbeat: str | None) -> bool:
    """Waits for the trainer, SIGNAL_CHECK_SECONDS at a time; True if the watchdog (with
    a heartbeat file) found it stalled and killed its process group."""
    look_every = min(5.0, self.stall_timeout / 4) if heartbeat is not None else float('inf')
    next_look = time.monotonic() + look_every
    while True:
      try:
        self.child.wait(timeout=min(SIGNAL_CHECK_SECONDS, look_every))
        return False
      except subprocess.TimeoutExpired:
        pass
      if time.monotonic() < next_look:
        continue
      next_look = time.monotonic() + look_every
      silent = silence(heartbeat)
      if silent is not None and silent > self.stall_timeout:
        self.log(f'attempt {attempt}: no heartbeat from the trainer (pid {self.child.pid}) for '
                 f'{silent:.0f} s (--stall_timeout={self.stall_timeout:g}); '
                 'killing its process group.')
        self._kill_group()
        return True

  def _supervise(self) -> int:
    failures, attempt = 0, 0
    best = self.latest_step()
    while True:
      attempt += 1
      if self.stopping:  # signalled before this attempt started (or while it backed off)
        self.log(f'signal {self.stopping}: not starting attempt {attempt}; exiting.')
        return 128 + self.stopping
      rc, stalled = self._attempt(attempt, best)
      if rc == 0:
        self.log(f'attempt {attempt}: trainer finished (exit 0).')
        return 0
      what = 'stalled, killed by the watchdog' if stalled else describe(rc)
      exit_code = rc if rc > 0 else 128 - rc
      if self.lost and not stalled:
        lost = ', '.join(str(i) for i in self.lost)
        if not self.lost_said:  # a trainer that aborted in jax (train.py says it itself)
          print(f'error: process {lost} of this multi-process run was lost (jax.distributed\'s '
                'coordination service stopped hearing from it: its host died, was preempted '
                f'or was replaced), so this process aborted ({describe(rc)}); every process of '
                'the run restarts from the last committed checkpoint.', file=sys.stderr,
                flush=True)
        what = f'{what}: process {lost} of the run was lost'
      if not stalled and rc not in errors.RESTARTABLE and signal_of(rc) is None:
        self.log(f'attempt {attempt}: trainer {what}; not restarting (a rerun of the same '
                 'command would repeat it): fix the cause its message names, then relaunch.')
        return exit_code
      if self.stopping:
        self.log(f'attempt {attempt}: trainer {what}; launcher was signalled, not restarting.')
        return exit_code
      latest = self.latest_step()
      progressed = latest is not None and (best is None or latest > best)
      failures = 0 if progressed else failures + 1
      best = latest if progressed else best
      if failures >= self.max_failures:
        self.log(f'attempt {attempt}: trainer {what}; {failures} attempts in a row without a '
                 f'new checkpoint (latest: {best}). Giving up.')
        return exit_code
      delay = min(self.max_backoff, self.backoff * 2 ** failures)
      self.log(f'attempt {attempt}: trainer {what}; latest checkpoint {latest} '
               f'({"progress" if progressed else f"no progress, {failures} in a row"}); '
               f'restarting in {delay:g} s.')
      self._back_off(delay)

  def _back_off(self, seconds: float) -> None:
    """Sleeps `seconds`, SIGNAL_CHECK_SECONDS at a time, and no longer once signalled (a
    sleep resumes after its handler has run)."""
    end = time.monotonic() + seconds
    while not self.stopping and (left := end - time.monotonic()) > 0:
      time.sleep(min(left, SIGNAL_CHECK_SECONDS))


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  return Launcher(args.command, args.workdir, args.max_failures, args.backoff,
                  args.max_backoff, args.stall_timeout).run()


if __name__ == '__main__':
  # `kill -USR1 <launcher pid>`: what a launcher that seems stuck is waiting on. Only where
  # stderr is a file descriptor (a caller may have swapped in a Python stream).
  with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
    faulthandler.register(signal.SIGUSR1, all_threads=True)
  sys.exit(main(sys.argv[1:]))
