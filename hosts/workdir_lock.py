"""One training run per workdir: <workdir>/LOCK, naming its holder.

checkpoint.py's clean-up of a crashed save (tmp.step_* directories, a step
without COMMIT) would take another live run's in-flight save in the same
directory for such leftovers; this lock keeps that second run out.
checkpoint.WorkdirLock and checkpoint.WorkdirLockedError are these names.

On a filesystem it is an flock, which the kernel drops when its holder dies.
In a gs:// or s3:// bucket there is no such thing, so it is a lease: LOCK is
created only if it does not exist (a conditional write), and its holder
rewrites it every quarter of its lease (conditional on its own last write). A
LOCK not renewed for a lease (lease_seconds()), or naming a process of this host that is
no longer running (a killed trainer restarted by the launcher, or by its container
runtime), is stale and taken over, again by a conditional write, so two runs never
both win.

A holder is more than host + PID: in a container both repeat across a restart (an
Indexed Job's pod keeps its hostname, the trainer is PID 1 each time), and the dead
holder's PID is then the new trainer itself. So the record also names the kernel's
boot, the PID namespace and the process's start time (`_identity`); a holder of this
host is judged live only when a process with its PID, namespace and start time runs.
A renewal the store fails after the client's retries (or one that finds LOCK
taken over) ends the lease's hold: `check_lease`, which Checkpointer.poll calls
every step, raises it, so the run stops in one line before it writes again,
as it would had any other request met the outage first.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
import threading
import time

from absl import logging

import errors
from store import storage

LOCK = 'LOCK'


def lease_seconds() -> float:
  """A bucket lease's length: 300 s, or OLMO_LOCK_LEASE_SECONDS (read when used)."""
  return float(os.environ.get('OLMO_LOCK_LEASE_SECONDS', 300))

_HELD: dict[str, '_Lease'] = {}  # this process's bucket leases, by workdir


class WorkdirLockedError(errors.UserError, RuntimeError):
  """Another live process holds the workdir's LOCK."""


def check_lease(location: str) -> None:
  """Raises why this process's lease on the workdir holding `location` ended, if it did:
  the store failed its renewal after the client's retries (storage.StorageError, EXIT_CRASH:
  a rerun takes the lease back), or another run took LOCK over (WorkdirLockedError). A run
  whose lease may have lapsed must not write on as if it still held the workdir."""
  for workdir, lease in list(_HELD.items()):
    if lease.failure is not None and (location == workdir or
                                      location.startswith(workdir.rstrip('/') + '/')):
      raise lease.failure


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
    self.workdir = storage.absolute(storage.canonical(workdir))
    self.path = storage.join(self.workdir, LOCK)
    self._fd: int | None = None
    self._lease: _Lease | None = None

  def __enter__(self) -> 'WorkdirLock':
    if not storage.locks(self.workdir):  # a bucket: a lease
      self._lease = _HELD[self.workdir] = _Lease(self.workdir, self.path)
      return self
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
    if self._lease is not None:
      lease, self._lease = self._lease, None
      _HELD.pop(self.workdir, None)
      lease.release()
      if exc[0] is None and lease.failure is not None:  # the run ended before it checked
        raise lease.failure
      return
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


def _read(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:  # no procfs (not Linux), or the process is gone
    return None


def _start_ticks(pid: int | str) -> int | None:
  """When process `pid` (of this PID namespace) started, in clock ticks since boot.

  Field 22 of /proc/PID/stat (proc(5)); the command name before it, in parentheses,
  may hold spaces, so the fields are counted after its closing parenthesis."""
  stat = _read(f'/proc/{pid}/stat')
  try:
    return int(stat.rsplit(')', 1)[1].split()[19])
  except (AttributeError, IndexError, ValueError):
    return None


def _identity() -> dict:
  """What tells this process apart from any other that had its host name and PID:
  the kernel's boot id, the PID namespace's inode (a new container has its own) and
  the start time. Namespace inodes are reused once freed, and a restarted container's
  trainer is PID 1 again: the start time is what differs then."""
  ns = None
  with contextlib.suppress(OSError):
    ns = os.stat('/proc/self/ns/pid').st_ino
  return {'boot': _read('/proc/sys/kernel/random/boot_id'), 'pidns': ns,
          'start': _start_ticks('self')}


def _holder() -> dict:
  return {'host': socket.gethostname(), 'pid': os.getpid(),
          'started': datetime.datetime.now(datetime.timezone.utc).isoformat(),
          **_identity(), 'renewed': time.time()}


def _parsed(text: bytes) -> dict | None:
  """A bucket LOCK's holder, or None when its contents are not one."""
  try:
    holder = json.loads(text)
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def _local(holder: dict) -> bool:
  """Whether the holder's process, if it runs, is one this process can see: same host
  name, same boot and PID namespace (records without them: same host name)."""
  if holder.get('host') != socket.gethostname():
    return False
  own = _identity()
  return all(holder.get(k) == own[k] for k in ('boot', 'pidns') if k in holder)


def _stale_because(holder: dict) -> str:
  """Why a bucket LOCK's holder is gone ('' while it holds the lease, or may)."""
  age, lease = time.time() - float(holder.get('renewed', 0)), lease_seconds()
  if age > lease:
    return f'not renewed for {age:.0f} s (lease {lease:.0f} s)'
  if holder.get('host') != socket.gethostname():
    return ''  # another host: only its lease tells
  own = _identity()
  if 'boot' in holder and holder['boot'] != own['boot']:
    # The same host name under another boot: this host since rebooted, or another
    # machine of that name. Its process cannot be looked up here; the lease decides.
    return ''
  if 'pidns' in holder and holder['pidns'] != own['pidns']:
    # This host's kernel, another PID namespace: an earlier container of this pod
    # (Kubernetes reuses an Indexed Job pod's hostname), now restarted as this one.
    return (f"from an earlier container on this host (PID namespace {holder['pidns']}, "
            f"this one {own['pidns']}), restarted as this one")
  try:
    os.kill(int(holder['pid']), 0)
  except ProcessLookupError:
    return 'its process is no longer running'
  except (OSError, ValueError, KeyError):
    return ''
  if holder.get('start') is not None and _start_ticks(holder['pid']) not in (
      None, holder['start']):
    # PID reused: e.g. a container's trainer is PID 1 after every restart.
    return (f"its process is no longer running (PID {holder['pid']} now belongs to a "
            'process started later)')
  return ''


class _Lease:
  """LOCK in a bucket: taken by a conditional create, kept by a renewing thread."""

  def __init__(self, workdir: str, path: str):
    self.workdir, self.path = workdir, path
    self.holder = _holder()
    self.failure: Exception | None = None  # why the lease ended early (check_lease)
    for _ in range(3):  # lost races re-read the winner, who is then refused below
      text, generation = storage.read_versioned(path)
      if text and _parsed(text) == self.holder:
        # This run's own create: its answer was lost and the client's retry met the object
        # it had made (GCS answers 412). The lease is taken, at the generation read.
        self.generation = generation
        break
      if text:
        generation = self._wait_unless_stale(text, generation)
      self.generation = storage.write(path, json.dumps(self.holder).encode(),
                                      if_generation=generation)
      if self.generation is not None:
        break
    else:
      raise WorkdirLockedError(f'Workdir {workdir}: another run keeps taking {path}; stop '
                               'the other run or use another --workdir.')
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._renew, name='workdir-lock-lease', daemon=True)
    self._thread.start()

  def _wait_unless_stale(self, text: bytes, generation: bytes) -> bytes:
    """The generation to take LOCK over at, once its holder is stale; refuses a live one.

    A holder on another host that still looks live may be a host lost in a preemption
    (its replacement has another name): the lease is waited out, checking every few
    seconds whether it is renewed (a live run: refused) or released.
    """
    holder, announced, lease = _parsed(text), False, lease_seconds()
    while True:
      if not isinstance(holder, dict) or not {'host', 'pid', 'started'} <= holder.keys():
        logging.warning('Taking over %s: unrecognised contents %r.', self.path, text[:200])
        return generation
      who = f"host {holder['host']}, PID {holder['pid']}, started {holder['started']}"
      why = _stale_because(holder)
      if why:
        logging.warning('Taking over the stale workdir lock %s: its holder (%s) is %s.',
                        self.path, who, why.replace('its process', 'a process that'))
        return generation
      age = time.time() - float(holder.get('renewed', 0))
      if _local(holder) or announced == 'renewed':
        raise WorkdirLockedError(
            f'Workdir {self.workdir} is in use by another training run ({who}; lock '
            f'{self.path}, renewed {age:.0f} s ago). Two runs in one workdir would overwrite '
            "each other's checkpoints. Wait for that run to end or stop it, or use another "
            f'--workdir (a lock not renewed for {lease:.0f} s is taken over).')
      if not announced:
        logging.warning(
            'Workdir %s is held by %s (lock %s, renewed %.0f s ago), a process this host cannot '
            'look up (another host, or this one before a reboot): waiting up '
            'to %.0f s for the lease to expire (a host replaced after a preemption leaves its '
            'lease behind), and refusing to start if its holder renews it.', self.workdir,
            who, self.path, age, max(0.0, lease - age))
        announced = True
      time.sleep(min(5.0, lease / 20, max(0.1, lease - age + 0.1)))
      new_text, new_generation = storage.read_versioned(self.path)
      if new_generation == generation:
        continue
      if not new_text:  # released meanwhile: free to take
        return new_generation
      text, generation, holder = new_text, new_generation, _parsed(new_text)
      announced = 'renewed'  # renewed or taken by a live run: refused above

  def _renew(self) -> None:
    lease = lease_seconds()
    while not self._stop.wait(lease / 4):
      self.holder['renewed'] = time.time()
      try:
        generation = storage.write(self.path, json.dumps(self.holder).encode(),
                                   if_generation=self.generation)
      except OSError as e:
        # Failed after the client's retries, like any request that ends the run; and one
        # more missed renewal could let the lease lapse while this run still writes.
        logging.warning('Cannot renew the workdir lock %s: %s', self.path, e)
        failure = e if isinstance(e, storage.StorageError) else storage.StorageError(str(e))
        self.failure = type(failure)(
            f'Cannot renew the workdir lease {self.path}, so this run stops before it writes '
            f'again (its lease would lapse, and another run could take the workdir): '
            f'{failure}', failure.failed_store)
        return
      if generation is None:
        self.failure = WorkdirLockedError(
            f'Lost the workdir lock {self.path}: another run took it over after this one '
            f'failed to renew it for {lease:.0f} s, so this one stops before the two '
            "write over each other's checkpoints.")
        logging.error('%s', self.failure)
        return
      self.generation = generation

  def release(self) -> None:
    self._stop.set()
    self._thread.join()
    try:  # empty: the next run finds it free, with no stale holder to report
      storage.write(self.path, b'', if_generation=self.generation)
    except OSError as e:
      logging.warning('Cannot release the workdir lock %s: %s', self.path, e)
