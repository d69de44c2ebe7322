"""One training run per workdir: an flock on <workdir>/LOCK naming its holder.

checkpoint.py's clean-up of a crashed save (tmp.step_* directories, a step
without COMMIT) would take another live run's in-flight save in the same
directory for such leftovers; this lock keeps that second run out.
checkpoint.WorkdirLock and checkpoint.WorkdirLockedError are these names.
"""

import datetime
import fcntl
import json
import os
import socket

from absl import logging

import errors

LOCK = 'LOCK'


class WorkdirLockedError(errors.UserError, RuntimeError):
  """Another live process holds the workdir's LOCK."""


class WorkdirLock:
  """Exclusive use of a workdir by one training run: `with WorkdirLock(workdir): ...`.

  An advisory fcntl.flock on <workdir>/LOCK, whose text names the holder as
  JSON {host, pid, started}. A second run gets WorkdirLockedError naming the
  holder. The kernel drops the lock when its holder dies however it dies, so a
  LOCK whose lock is free was left by a dead run: it is taken over with a
  warning naming that run. Released on exit, exceptions included; a clean
  release empties LOCK, so only a dead holder is ever reported as stale.

  flock rather than POSIX record locks (fcntl.lockf): those belong to the
  process, do not conflict within it, and vanish when it closes any
  descriptor of the file (e.g. after reading the holder's JSON). Linux runs
  flock on NFS as a POSIX lock, so it holds across hosts there too.

  Multi-process runs share one workdir, so only process 0 takes the lock; the
  caller decides, e.g. `WorkdirLock(w) if jax.process_index() == 0 else
  contextlib.nullcontext()`. The lock is the main protection of Checkpointer's
  clean-up, which would otherwise take another run's in-flight save for the
  leftovers of a crashed one.
  """

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK)
    self._fd: int | None = None

  def __enter__(self) -> 'WorkdirLock':
    if self._fd is not None:
      raise RuntimeError(f'{self.path} is already held by this WorkdirLock.')
    fd = self._open()
    try:
      self._lock(fd)
      previous = _describe_holder(fd)
      if previous:
        logging.warning('Taking over the stale workdir lock %s: its holder (%s) is no '
                        'longer running.', self.path, previous)
      holder = {'host': socket.gethostname(), 'pid': os.getpid(),
                'started': datetime.datetime.now(datetime.timezone.utc).isoformat()}
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(holder).encode(), 0)
      os.fsync(fd)
    except BaseException:
      os.close(fd)  # also releases the lock if it was taken
      raise
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)  # no holder left to be reported as stale
    finally:
      os.close(fd)  # releases the flock

  def _open(self) -> int:
    if os.path.exists(self.workdir) and not os.path.isdir(self.workdir):
      raise errors.ConfigError(f'--workdir={self.workdir} is a file, not a directory; pass a '
                               'directory (it is created if missing).')
    try:
      os.makedirs(self.workdir, exist_ok=True)
      return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise errors.ConfigError(f'cannot write the workdir lock {self.path}: {e.strerror}. Make '
                               '--workdir writable (and LOCK a regular file), or choose another '
                               '--workdir.') from e

  def _lock(self, fd: int) -> None:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe_holder(fd) or 'a run that is still writing its details'
      raise WorkdirLockedError(
          f'Workdir {self.workdir} is in use by another training run ({holder}; lock '
          f'file {self.path}). Two runs in one workdir would overwrite each other\'s '
          'checkpoints. Wait for that run to end or stop it, or use another '
          '--workdir.') from None
    except OSError as e:
      raise OSError(e.errno, f'Cannot lock {self.path}: {e.strerror}. Its filesystem '
                    'may not support file locks; put the workdir on one that does.') from e


def _describe_holder(fd: int) -> str:
  """The holder recorded in an open LOCK file, in words ('' when it is empty)."""
  text = os.pread(fd, 4096, 0).decode(errors='replace').strip()
  if not text:
    return ''
  try:
    holder = json.loads(text)
    return f"host {holder['host']}, PID {holder['pid']}, started {holder['started']}"
  except (ValueError, TypeError, KeyError):
    return f'unrecognised LOCK contents {text[:200]!r}'
