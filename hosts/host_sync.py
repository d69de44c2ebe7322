"""Host-side agreement between the processes of a run, through jax.distributed's key-value store.

Device collectives (multihost_utils.sync_global_devices) would run on a
checkpoint's save thread concurrently with the train step's own collectives
and can deadlock; the coordination service's key-value store is host-only and
thread-safe (orbax's multihost utilities use it the same way). Every key is
unique per operation (callers number their operations in SPMD call order), so
a slow process never reads a stale value. With one process every call returns
at once.

`check_shared` is the start-up test that every process sees the same workdir
(a pod's hosts each have their own disk: a local path there would split the run).
"""

import itertools
import secrets
import socket

import jax
# For the coordination service's key-value store. jax 0.10.2 has no public accessor for
# its client: jax.distributed offers only initialize, is_initialized and shutdown, and
# jax.experimental.multihost_utils only device collectives. orbax and jax's own
# array_serialization read the client here too. A JAX that moved it still runs one
# process; a multi-process run then stops at start naming the version (Sync).
try:
  from jax._src import distributed as jax_distributed
except ImportError:
  jax_distributed = None

import errors
from store import storage

TIMEOUT_MS = 30 * 60 * 1000  # cross-process waits: a slow writer, not a hang
SHARED_CHECK = 'SHARED_STORAGE_CHECK'
_OPS = itertools.count()  # same sequence on every process (SPMD call order)


class Sync:
  """gather / broadcast of strings between the processes of a run."""

  def __init__(self):
    self.index = jax.process_index()
    self.count = jax.process_count()
    self.client = None
    if self.count > 1:
      if jax_distributed is None:
        raise RuntimeError(f'JAX {jax.__version__} has no jax._src.distributed, where this '
                           'code finds the coordination service\'s key-value store for '
                           'multi-process runs; use the JAX version pyproject.toml pins.')
      self.client = jax_distributed.global_state.client  # see the import
      if self.client is None:
        raise RuntimeError('Multi-process coordination needs jax.distributed.initialize() '
                           'to have been called.')

  def gather(self, key: str, value: str) -> list[str]:
    """Every process's `value`, in process order; returns once all have sent."""
    if self.client is None:
      return [value]
    self.client.key_value_set(f'{key}/{self.index}', value)
    return [self.client.blocking_key_value_get(f'{key}/{i}', TIMEOUT_MS)
            for i in range(self.count)]

  def broadcast(self, key: str, value: str) -> str:
    """Process 0's `value`, on every process."""
    if self.client is None:
      return value
    if self.index == 0:
      self.client.key_value_set(key, value)
      return value
    return self.client.blocking_key_value_get(key, TIMEOUT_MS)


def one_process() -> bool:
  """Whether this run is one process, known before a backend starts (after
  sharding.init_distributed; jax.process_count() would start the backend)."""
  if jax_distributed is None:
    return not jax.distributed.is_initialized()
  state = jax_distributed.global_state  # see the import
  return state.client is None or state.num_processes == 1


def barrier(name: str) -> None:
  """Returns once every process has called it (a no-op for one process). Before a
  collective whose device group is new, after work whose time differs between hosts (a
  compile): jaxlib's gloo gives that group's first collective a fixed 30 s to meet, and
  a loaded host that compiles longer would otherwise fail both processes."""
  sync = Sync()
  if sync.client is not None:
    sync.client.wait_at_barrier(f'olmo3_{name}/{next(_OPS)}', TIMEOUT_MS)


def check_shared(workdir: str) -> None:
  """Refuses, on every process and before anything else is written, a workdir the
  processes do not all see: process 0 writes a nonce there, every process reads it
  back, and any host that reads something else fails the whole run in one line.

  Object stores are one namespace by construction, but checked the same way (a
  wrong endpoint or emulator on one host splits them too). One process: nothing
  to compare, nothing written.
  """
  sync = Sync()
  if sync.count == 1:
    return
  path, key = storage.join(workdir, SHARED_CHECK), f'olmo3_storage/{next(_OPS)}'
  nonce = sync.broadcast(f'{key}/nonce', secrets.token_hex(8))
  problem = ''
  if sync.index == 0:
    try:
      storage.makedirs(workdir)
      storage.write_atomic(path, nonce, fsync=True)
    except OSError as e:
      problem = f'process 0 cannot write {path}: {e}'
  problem = sync.broadcast(f'{key}/written', problem)
  if problem:
    raise errors.ConfigError(f'{problem}. Make --workdir writable, or choose another.')
  try:
    seen = storage.read_text(path)
  except OSError as e:
    seen = f'unreadable ({e})'
  if seen != nonce:
    problem = (f'process {sync.index} on host {socket.gethostname()} reads '
               f'{"nothing" if seen is None else repr(seen)[:40]} at {path}, where process 0 '
               'wrote its check')
  failures = [p for p in sync.gather(f'{key}/read', problem) if p]
  if failures:
    raise errors.ConfigError(
        f'--workdir={workdir} is not one storage shared by every process: '
        f'{"; ".join(failures[:3])}. On a pod each host has its own disk; the workdir must be '
        'a gs:// or s3:// URL or a filesystem every host shares (NFS, Filestore, Lustre).')
