"""Atomic, asynchronous tensorstore checkpoints of pytrees of jax.Arrays.

One directory per step:

  <directory>/step_<N>/
    metadata.json   the caller's metadata, the tree's key paths, whether the
                    run was healthy, per array its shape, dtype, chunk shape and
                    one checksum per chunk, and a checksum of all of that
    arrays/<path>/  one zarr3 array per leaf; <path> is its key path joined by
                    '/' (with use_ocdbt: one OCDBT database in ocdbt/ instead)
    COMMIT          written last; a step directory without it is incomplete

A save writes into <directory>/tmp.step_<N>.<nonce>/; process 0 then renames it
to step_<N> and writes COMMIT. A crash at any point leaves earlier steps intact,
and the next Checkpointer (or its save or restore) removes tmp.* directories;
a step_<N> that lost only its COMMIT is re-committed if it verifies in full
(see _tidy). WorkdirLock keeps a second run out of the same workdir, whose
in-flight save would otherwise look like such leftovers.

Each array's zarr chunk grid follows the saving sharding's shards (split
further to at most `chunk_bytes`), so every process writes whole chunks of the
shards it owns (replica_id == 0) and no two processes touch one file. The
chunk is also the unit of checksumming and of reading: restore reads the
chunks that cover each target device's slice, verifies them, and cuts the
slice out, so a checkpoint restores onto any mesh and device count.

Read failures fall in two kinds: damage (a checksum mismatch, a missing or
truncated file, undecodable bytes, metadata that contradicts itself) raises
CorruptCheckpointError, and restore_latest_good falls back past it; the
storage refusing a read (permissions, a lost mount, EIO) raises
CheckpointReadError and nothing is moved, so fixing access brings the run back.

Shapes: the code is rank-agnostic; a "box" is a tuple of (start, stop) per
dimension of an array.
"""

import concurrent.futures
import dataclasses
import datetime
import fcntl
import itertools
import json
import math
import os
import re
import secrets
import shutil
import socket
import threading
import time
from typing import Any

from absl import logging
import jax
from jax._src import distributed as jax_distributed
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
import xxhash

FORMAT_VERSION = 1
# xxh3-64 hashes ~30 GB/s on one core of the dev machine (google-crc32c 13,
# zlib.crc32 3.3, memcpy 9), so verifying never bounds save or restore speed;
# 64 bits leave ~2^-64 odds of missing a random corruption. Not cryptographic:
# it guards against bad disks and truncation, not against an adversary.
CHECKSUM = 'xxh3_64'
COMMIT = 'COMMIT'
METADATA = 'metadata.json'
LOCK = 'LOCK'
_STEP_RE = re.compile(r'^step_(\d+)$')
_KEY_RE = re.compile(r'^[A-Za-z0-9_.\-]+$')
_TIMEOUT_MS = 30 * 60 * 1000  # cross-process waits: a slow writer, not a hang
_OP_IDS = itertools.count()  # same sequence on every process (SPMD call order)

Box = tuple[tuple[int, int], ...]


# tensorstore raises ValueError('<absl status code>: ...') for damage and for the
# storage failing alike. Its file driver maps errno to a code (EACCES, EPERM ->
# PERMISSION_DENIED; ENOENT -> NOT_FOUND; ENOSPC -> RESOURCE_EXHAUSTED; EIO and
# the rest -> FAILED_PRECONDITION) and tags the message with the errno, while a
# truncated chunk is FAILED_PRECONDITION without one. Observed for a chmod-000
# chunk read by another user: "PERMISSION_DENIED: Error reading local file
# ".../c/0/0": Failed to open: ...: Permission denied [os_error_code='13']".
_IO_CODES = ('PERMISSION_DENIED', 'UNAVAILABLE', 'DEADLINE_EXCEEDED',
             'RESOURCE_EXHAUSTED', 'ABORTED', 'CANCELLED', 'UNAUTHENTICATED')
_ERRNO_TAG = re.compile(r"os_error_code='?\d|\[OS error: ")


class CorruptCheckpointError(ValueError):
  """A checkpoint whose files are damaged: failed checksums, missing or bad bytes."""


class CheckpointReadError(OSError):
  """The storage refused a read (permissions, mount, I/O); the checkpoint may be fine."""


class CheckpointSaveError(RuntimeError):
  """A background save failed; earlier checkpoints are intact."""


class WorkdirLockedError(RuntimeError):
  """Another live process holds the workdir's LOCK."""


def _read_error(file: str, checkpoint_dir: str, cause: Exception) -> CheckpointReadError:
  return CheckpointReadError(
      f'Cannot read {file}: {cause}. The storage refused the read (permissions, a '
      f'lost mount or a disk error), which is not damage: checkpoint {checkpoint_dir} '
      'was left in place. Check the permissions of the checkpoint directory and that '
      'its filesystem is mounted and healthy, then rerun the same command.')


def _is_io_error(message: str) -> bool:
  """Whether a tensorstore error message reports the storage failing, not bad bytes."""
  code = message.split(':', 1)[0]
  if code == 'NOT_FOUND':  # a missing file in a checkpoint is damage
    return False
  return code in _IO_CODES or _ERRNO_TAG.search(message) is not None


def _tensorstore_failure(file: str, what: str, checkpoint_dir: str,
                         cause: ValueError) -> CheckpointReadError | CorruptCheckpointError:
  """The error to raise for a failed tensorstore open or read of `file`."""
  if _is_io_error(str(cause)):
    return _read_error(file, checkpoint_dir, cause)
  return CorruptCheckpointError(f'Checkpoint {checkpoint_dir}: {what} is unreadable: {cause}')


def _step_dir(directory: str, step: int) -> str:
  return os.path.join(directory, f'step_{step}')


def _has_commit(step_dir: str) -> bool:
  """Whether `step_dir` holds COMMIT; raises if the storage cannot tell.

  os.path.exists would say False on EACCES too, and a committed step would
  then pass for a crashed save.
  """
  marker = os.path.join(step_dir, COMMIT)
  try:
    os.stat(marker)
  except (FileNotFoundError, NotADirectoryError):
    return False
  except OSError as e:
    raise _read_error(marker, step_dir, e) from e
  return True


def committed_steps(directory: str) -> list[int]:
  """Steps with a committed (COMMIT-marked) checkpoint in `directory`, ascending."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return []
  steps = []
  for name in names:
    m = _STEP_RE.match(name)
    if m and _has_commit(os.path.join(directory, name)):
      steps.append(int(m.group(1)))
  return sorted(steps)


def latest_step(directory: str) -> int | None:
  """The newest committed step in `directory`, or None when there is none."""
  steps = committed_steps(directory)
  return steps[-1] if steps else None


def latest_healthy_step(directory: str) -> int | None:
  """The newest committed step saved with healthy=True, or None when there is none.

  Checkpoints written before the flag existed count as healthy. One whose
  metadata is damaged is skipped: it cannot be resumed from.
  """
  directory = os.path.abspath(directory)
  for step in reversed(committed_steps(directory)):
    try:
      info = _read_info(_step_dir(directory, step))
    except CorruptCheckpointError:
      continue
    if info.get('healthy', True):
      return step
  return None


def _write_durable(path: str, text: str, fsync: bool) -> None:
  with open(path, 'w') as f:
    f.write(text)
    f.flush()
    if fsync:
      os.fsync(f.fileno())


def _fsync_dir(path: str, fsync: bool) -> None:
  if fsync:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


def _tidy(directory: str, fsync: bool) -> None:
  """Removes leftovers of crashed saves; re-commits a complete step that lost COMMIT.

  tmp.step_* directories are saves that never reached their rename: removed.
  A step_<N> without COMMIT was renamed into place only after its save had
  written and verified every file, so it normally lacks just the marker (a
  crash between rename and marker, or a lost file). It is verified in full
  (every chunk against its checksum, and metadata.json against its own); if it
  passes it is re-committed with a warning, not left in place: it may be the
  run's newest state, and a later save of step N could not rename onto it. One
  that fails verification is a partial save and is removed. A storage error
  raises CheckpointReadError with nothing removed. Another run's in-flight
  save in this directory would look like such leftovers: WorkdirLock keeps a
  second run out.
  """
  try:
    names = sorted(os.listdir(directory))
  except FileNotFoundError:
    return
  for name in names:
    path = os.path.join(directory, name)
    if not os.path.isdir(path):
      continue
    if name.startswith('tmp.step_'):
      logging.warning('Removing partial checkpoint %s (left by a crashed save).', path)
      shutil.rmtree(path, ignore_errors=True)
    elif _STEP_RE.match(name) and not _has_commit(path):
      _recommit_or_remove(path, fsync)


def _recommit_or_remove(path: str, fsync: bool) -> None:
  try:
    _verify_in_full(path)
  except CorruptCheckpointError as e:
    logging.warning('Removing partial checkpoint %s (left by a crashed save: %s).', path, e)
    shutil.rmtree(path, ignore_errors=True)
    return
  logging.warning('Checkpoint %s has no %s marker but every file verifies against its '
                  'checksums (only the marker was lost); re-committing it.', path, COMMIT)
  _write_durable(os.path.join(path, COMMIT), '', fsync)
  _fsync_dir(path, fsync)


def _delete_step(directory: str, step: int) -> None:
  # Rename first, so a crash mid-delete leaves a tmp.* leftover rather than a
  # COMMIT-marked step with missing chunks.
  doomed = os.path.join(directory,
                        f'tmp.step_{step}.deleted.{secrets.token_hex(4)}')
  os.rename(_step_dir(directory, step), doomed)
  shutil.rmtree(doomed)


def _key_str(key: Any) -> str:
  # DictKey.key, GetAttrKey.name (NamedTuples), SequenceKey.idx, FlattenedIndexKey.key.
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
  """Leaves of `tree` named by their key paths, e.g. 'opt_state/0/mu/embed/embedding'."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
  names = []
  for path, _ in pairs:
    parts = [_key_str(k) for k in path]
    bad = [p for p in parts if not _KEY_RE.match(p) or p in ('.', '..')]
    if not parts or bad:
      raise ValueError(
          f'Pytree leaf at {jax.tree_util.keystr(path) or "<root>"} cannot name '
          f'a checkpoint array: keys must match [A-Za-z0-9_.-]+ (bad: {bad}) '
          'and the state must be a container; rename the key.')
    names.append('/'.join(parts))
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:
    raise ValueError(f'Pytree keys collide after naming: {dupes} (e.g. dict keys '
                     '0 and "0"); rename one of them.')
  return names, [leaf for _, leaf in pairs], treedef


def _chunk_shape(shard_shape: tuple[int, ...], itemsize: int,
                 chunk_bytes: int) -> tuple[int, ...]:
  """Splits a shard into chunks of at most `chunk_bytes` where divisors allow.

  Leading axes are split first, each by its smallest divisor that suffices, so
  chunk edges stay on shard edges and every chunk is one contiguous run of its
  shard's bytes (hashable without a copy).
  """
  chunk = [max(1, n) for n in shard_shape]
  for ax, n in enumerate(chunk):
    need = math.ceil(math.prod(chunk) * itemsize / chunk_bytes)
    if need <= 1:
      break
    chunk[ax] = n // next((d for d in range(need, n + 1) if n % d == 0), n)
  return tuple(chunk)


def _index_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _slices(box: Box) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in box)


def _chunk_ids(box: Box, chunk: tuple[int, ...]):
  return itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(box, chunk)))


def _chunk_box(cid: tuple[int, ...], chunk: tuple[int, ...],
               shape: tuple[int, ...]) -> Box:
  return tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(cid, chunk, shape))


def _chunk_key(cid: tuple[int, ...]) -> str:
  # Mirrors zarr3's default chunk file path (c/<i>/<j>), so errors point at files.
  return '/'.join(['c', *map(str, cid)])


def _relative(inner: Box, outer: Box) -> tuple[slice, ...]:
  return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def _checksum(a: np.ndarray) -> str:
  return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _spec(root: str, name: str, use_ocdbt: bool, fsync: bool = True) -> dict[str, Any]:
  if use_ocdbt:
    base = {'driver': 'file', 'path': f'{root}/ocdbt/', 'file_io_sync': fsync}
    kvstore = {'driver': 'ocdbt', 'base': base, 'path': f'{name}/'}
  else:
    kvstore = {'driver': 'file', 'path': os.path.join(root, 'arrays', name),
               'file_io_sync': fsync}
  # Every chunk gets a file (even all-zero ones) and a missing file is a read
  # error, not silent zeros: a lost chunk must never look like a fresh state.
  return {'driver': 'zarr3', 'kvstore': kvstore,
          'store_data_equal_to_fill_value': True, 'fill_missing_data_reads': False}


class _Sync:
  """Host-side agreement between processes through jax.distributed's KV store.

  Device collectives (multihost_utils.sync_global_devices) would run on the
  save thread concurrently with the train step's own collectives and can
  deadlock; the coordination service's key-value store is host-only and
  thread-safe (orbax's multihost utilities use it the same way). All keys are
  unique per operation, so a slow process can never read a stale value.
  """

  def __init__(self):
    self.index = jax.process_index()
    self.count = jax.process_count()
    self.client = None
    if self.count > 1:
      # No public API exposes the coordination client (orbax reads it here too).
      self.client = jax_distributed.global_state.client
      if self.client is None:
        raise RuntimeError('Multi-process checkpointing needs '
                           'jax.distributed.initialize() to have been called.')

  def gather(self, key: str, value: str) -> list[str]:
    """Every process's `value`, in process order; returns once all have sent."""
    if self.client is None:
      return [value]
    self.client.key_value_set(f'{key}/{self.index}', value)
    return [self.client.blocking_key_value_get(f'{key}/{i}', _TIMEOUT_MS)
            for i in range(self.count)]

  def broadcast(self, key: str, value: str) -> str:
    """Process 0's `value`, on every process."""
    if self.client is None:
      return value
    if self.index == 0:
      self.client.key_value_set(key, value)
      return value
    return self.client.blocking_key_value_get(key, _TIMEOUT_MS)


@dataclasses.dataclass
class _Snapshot:
  """Host copy of the shards of one array that this process writes."""
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]
  pieces: list[tuple[Box, np.ndarray]]


def _host_copy(x: jax.Array) -> np.ndarray:
  # On accelerators a fresh host buffer. On CPU a zero-copy view, which PJRT
  # keeps alive (donation is skipped, delete deferred) while it exists; tested
  # by test_async_save_survives_donation_and_deletion.
  return np.asarray(x)


def _snapshot(names: list[str], leaves: list[Any], process_index: int,
              chunk_bytes: int) -> list[_Snapshot]:
  """Copies this process's shards to host (the synchronous part of a save)."""
  owned = []
  for name, leaf in zip(names, leaves):
    if isinstance(leaf, jax.Array):
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise ValueError(f'Leaf {name} is a typed PRNG key; checkpoint '
                         'jax.random.key_data(key) instead.')
      shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
      for s in shards:  # start every device-to-host copy before waiting on one
        s.data.copy_to_host_async()
      owned.append(shards)
    else:
      owned.append(None)
  out = []
  for name, leaf, shards in zip(names, leaves, owned):
    if shards is not None:
      shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
      shard_shape = leaf.sharding.shard_shape(leaf.shape)
      pieces = [(_index_box(s.index, shape), _host_copy(s.data)) for s in shards]
    else:
      host = np.array(leaf)  # a copy: the caller may mutate it after save returns
      if host.dtype == object:
        raise ValueError(f'Leaf {name} of type {type(leaf).__name__} is not an '
                         'array or a scalar.')
      shape, dtype, shard_shape = host.shape, host.dtype, host.shape
      pieces = [(tuple((0, n) for n in shape), host)] if process_index == 0 else []
    out.append(_Snapshot(name, shape, dtype,
                         _chunk_shape(shard_shape, dtype.itemsize, chunk_bytes),
                         pieces))
  return out


def _write_local(root: str, arrays: list[_Snapshot], use_ocdbt: bool, fsync: bool,
                 pool: concurrent.futures.Executor) -> dict[str, dict[str, str]]:
  """Writes this process's pieces; returns {array: {chunk key: checksum}}."""
  errors = []

  def settle(future):  # wait for everything, so nothing writes into a removed dir
    try:
      return future.result()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  ctx = ts.Context()
  mine = [a for a in arrays if a.pieces]
  stores = [settle(ts.open(dict(_spec(root, a.name, use_ocdbt, fsync), metadata={
      'shape': list(a.shape), 'data_type': a.dtype.name,
      'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': list(a.chunk)}}}),
                           create=True, open=True, context=ctx)) for a in mine]
  writes = [store[_slices(box)].write(data) for a, store in zip(mine, stores)
            if store is not None for box, data in a.pieces]
  # Hash while tensorstore writes (both release the GIL).
  jobs = [(a.name, _chunk_key(cid), pool.submit(
      _checksum, data[_relative(_chunk_box(cid, a.chunk, a.shape), box)]))
          for a in mine for box, data in a.pieces for cid in _chunk_ids(box, a.chunk)]
  for w in writes:
    settle(w)
  sums: dict[str, dict[str, str]] = {}
  for name, key, digest in jobs:
    sums.setdefault(name, {})[key] = settle(digest)
  if errors:
    raise errors[0]
  return sums


def _verify_and_describe(root: str, arrays: list[_Snapshot],
                         parts: list[dict[str, dict[str, str]]],
                         use_ocdbt: bool) -> dict[str, Any]:
  """Checks that every chunk was written exactly once and every array exists."""
  described = {}
  for a in arrays:
    sums: dict[str, str] = {}
    for part in parts:
      for key, digest in part.get(a.name, {}).items():
        if sums.setdefault(key, digest) != digest:
          raise IOError(f'Array {a.name} chunk {key}: processes wrote different data.')
    expected = {_chunk_key(c) for c in _chunk_ids(tuple((0, n) for n in a.shape), a.chunk)}
    if set(sums) != expected:
      raise IOError(f'Array {a.name}: chunks {sorted(expected - set(sums))[:4]} '
                    'were written by no process.')
    store = ts.open(_spec(root, a.name, use_ocdbt), open=True).result()
    if tuple(store.shape) != a.shape or store.dtype.numpy_dtype != a.dtype:
      raise IOError(f'Array {a.name}: stored as {store.shape} {store.dtype}, '
                    f'expected {a.shape} {a.dtype}.')
    described[a.name] = {'shape': list(a.shape), 'dtype': a.dtype.name,
                         'chunk_shape': list(a.chunk), 'checksums': sums}
  return described


class Checkpointer:
  """Saves (asynchronously, atomically) and restores train states in `directory`.

  At most one save is in flight: save() first waits for the previous one.
  An error in the background save is raised as CheckpointSaveError by the
  next poll(), save(), wait() or close(). Retention, run by process 0 right
  after each commit: the newest `keep_last` committed steps, every step
  divisible by `keep_every` (0: none), and the newest step saved with
  healthy=True are kept; so saves made while the run is diverging can never
  evict its last healthy state. Creating a Checkpointer tidies what crashed
  saves left (_tidy). Use one Checkpointer per directory at a time (see
  WorkdirLock). fsync=False skips fsync (tests, scratch runs): a power cut may
  then leave a committed step with lost data, which restore's checksums still
  catch.
  """

  def __init__(self, directory: str, keep_last: int = 3, keep_every: int = 0,
               use_ocdbt: bool = False, chunk_bytes: int = 64 << 20, fsync: bool = True):
    if keep_last < 1:
      raise ValueError(f'keep_last={keep_last}: must be >= 1 (the newest '
                       'checkpoint is never deleted).')
    if keep_every < 0:
      raise ValueError(f'keep_every={keep_every}: must be >= 0 (0 = none).')
    self.directory = os.path.abspath(directory)
    self.keep_last, self.keep_every = keep_last, keep_every
    self.use_ocdbt, self.chunk_bytes, self.fsync = use_ocdbt, chunk_bytes, fsync
    self._sync = _Sync()
    if use_ocdbt and self._sync.count > 1:
      raise ValueError('use_ocdbt=True supports one process only (concurrent '
                       'OCDBT writers need a tensorstore coordinator); use the '
                       'default zarr3 files for multi-process runs.')
    os.makedirs(self.directory, exist_ok=True)
    self._thread: threading.Thread | None = None
    self._error: tuple[int, BaseException] | None = None
    self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
    self._tidy()  # before the caller lists committed steps

  def latest_step(self) -> int | None:
    return latest_step(self.directory)

  def latest_healthy_step(self) -> int | None:
    """Module latest_healthy_step() of this directory."""
    return latest_healthy_step(self.directory)

  def committed_steps(self) -> list[int]:
    return committed_steps(self.directory)

  def save(self, step: int, state: Any, metadata: dict[str, Any] | None = None, *,
           healthy: bool = True) -> None:
    """Snapshots `state` to host now and writes it in the background.

    `metadata` (JSON-serializable: config, data state, RNG, ...) is stored with
    'step' added. `healthy` says whether the run was healthy at this step (the
    caller's judgement, e.g. no loss spike or NaN); it is recorded in
    metadata.json, and retention keeps the newest healthy step until a newer
    healthy one is committed. Saving an already committed step is skipped with
    a warning (e.g. a preemption save right after a resume).
    """
    self.wait()
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f'step={step!r}: must be an integer >= 0.')
    if not isinstance(healthy, (bool, np.bool_)):
      raise TypeError(f'healthy={healthy!r}: must be a bool (was the run healthy '
                      'when this state was reached?).')
    step = int(step)
    metadata = dict(metadata or {})
    if metadata.setdefault('step', step) != step:
      raise ValueError(f"metadata['step']={metadata['step']} differs from step={step}.")
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as e:
      raise ValueError(f'Checkpoint metadata must be JSON-serializable: {e}') from e
    self._tidy()  # first: it may re-commit this very step
    if os.path.exists(os.path.join(_step_dir(self.directory, step), COMMIT)):
      logging.warning('Checkpoint step %d already committed in %s; not saving it again.',
                      step, self.directory)
      return
    names, leaves, treedef = _flatten(state)
    arrays = _snapshot(names, leaves, self._sync.index, self.chunk_bytes)
    key = f'olmo3_checkpoint/{next(_OP_IDS)}'
    # Broadcast after the clean-up, so no process creates the new tmp dir early.
    nonce = self._sync.broadcast(f'{key}/nonce', secrets.token_hex(4))
    tmp = os.path.join(self.directory, f'tmp.step_{step}.{nonce}')
    os.makedirs(tmp, exist_ok=True)
    info = {'format_version': FORMAT_VERSION, 'step': step, 'metadata': metadata,
            'paths': names, 'tree': str(treedef), 'checksum': CHECKSUM,
            'use_ocdbt': self.use_ocdbt, 'process_count': self._sync.count,
            'jax_version': jax.__version__, 'healthy': bool(healthy)}
    # Daemon: a process that is failing must not hang at exit on a save that
    # waits for peers (train.py abandons it then; the partial save is ignored).
    self._thread = threading.Thread(
        target=self._run, args=(step, tmp, arrays, info, key),
        name=f'checkpoint-save-{step}', daemon=True)
    self._thread.start()

  def _run(self, step: int, *args) -> None:
    try:
      self._save_and_commit(step, *args)
    except BaseException as e:  # pylint: disable=broad-except
      self._error = (step, e)

  def _save_and_commit(self, step: int, tmp: str, arrays: list[_Snapshot],
                       info: dict[str, Any], key: str) -> None:
    error, status, sums = None, 'ok', {}
    try:
      sums = _write_local(tmp, arrays, self.use_ocdbt, self.fsync, self._pool)
    except BaseException as e:  # pylint: disable=broad-except
      error, status = e, f'process {self._sync.index}: {type(e).__name__}: {e}'
    # Gathering is the barrier: every process has finished writing.
    parts = [json.loads(p) for p in self._sync.gather(
        f'{key}/written', json.dumps({'status': status, 'sums': sums}))]
    outcome = 'ok'
    if self._sync.index == 0:
      try:
        failed = [p['status'] for p in parts if p['status'] != 'ok']
        if failed:
          raise IOError('; '.join(failed))
        info['arrays'] = _verify_and_describe(tmp, arrays, [p['sums'] for p in parts],
                                              self.use_ocdbt)
        info['time'] = time.time()
        _write_durable(os.path.join(tmp, METADATA), _sealed(info), self.fsync)
        final = _step_dir(self.directory, step)
        os.rename(tmp, final)
        _fsync_dir(self.directory, self.fsync)
        _write_durable(os.path.join(final, COMMIT), '', self.fsync)
        _fsync_dir(final, self.fsync)
      except BaseException as e:  # pylint: disable=broad-except
        shutil.rmtree(tmp, ignore_errors=True)
        error = error or e
        outcome = f'{type(e).__name__}: {e}'
      if outcome == 'ok':
        try:
          self._apply_retention()
        except OSError as e:  # step is safe; old ones linger until the next save
          logging.error('Checkpoint step %d committed, but deleting old ones in %s '
                        'failed: %s', step, self.directory, e)
    outcome = self._sync.broadcast(f'{key}/committed', outcome)
    if error is not None:
      raise error
    if outcome != 'ok':
      raise IOError(f'Process 0 did not commit step {step}: {outcome}')

  def _apply_retention(self) -> None:
    steps = committed_steps(self.directory)
    keep = set(steps[-self.keep_last:])
    if self.keep_every:
      keep |= {s for s in steps if s % self.keep_every == 0}
    newest_healthy = latest_healthy_step(self.directory)
    if newest_healthy is not None:
      keep.add(newest_healthy)
    for s in steps:
      if s not in keep:
        _delete_step(self.directory, s)

  def poll(self) -> None:
    """Raises CheckpointSaveError now if the last background save has failed.

    Non-blocking (a thread liveness check), so cheap enough to call every
    step. In multi-process runs every process learns of a failure, but each
    on its own schedule (possibly a step apart).
    """
    if self._thread is None or not self._thread.is_alive():
      self.wait()

  def wait(self) -> None:
    """Blocks until the in-flight save is committed; raises CheckpointSaveError if it failed."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is not None:
      (step, error), self._error = self._error, None
      raise CheckpointSaveError(
          f'Checkpoint save of step {step} in {self.directory} failed; its temporary '
          'directory was removed and earlier checkpoints are intact: '
          f'{type(error).__name__}: {error}. Fix the cause (disk space, permissions, '
          'the mount), then rerun the same command to resume from the latest '
          'checkpoint.') from error

  def restore(self, target: Any, step: int | None = None,
              verify: bool = True) -> tuple[Any, dict[str, Any]]:
    """Module restore() of `step` (default: latest), after tidying (_tidy)."""
    self._before_restore()
    return restore(self.directory, target, step, verify=verify)

  def restore_latest_good(self, target: Any,
                          verify: bool = True) -> tuple[Any, dict[str, Any]]:
    """Module restore_latest_good(), after tidying (_tidy)."""
    self._before_restore()
    return restore_latest_good(self.directory, target, verify=verify)

  def _before_restore(self) -> None:
    self.wait()
    self._tidy()

  def _tidy(self) -> None:
    """Process 0 runs _tidy; if it fails, every process raises (none waits forever)."""
    key = f'olmo3_checkpoint/{next(_OP_IDS)}/tidy'
    error = None
    if self._sync.index == 0:
      try:
        _tidy(self.directory, self.fsync)
      except OSError as e:
        error = e
    failure = self._sync.broadcast(key, '' if error is None else str(error))
    if error is not None:
      raise error
    if failure:
      raise CheckpointReadError(f'Process 0 could not tidy {self.directory}: {failure}')

  def close(self) -> None:
    """Waits for the in-flight save (raising its error) and frees the hash threads."""
    try:
      self.wait()
    finally:
      self._pool.shutdown()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def save_streamed(directory: str, step: int, arrays: list[tuple[str, tuple[int, ...], Any,
                                                                tuple[int, ...], Any]],
                  metadata: dict[str, Any], *, chunk_bytes: int = 64 << 20,
                  fsync: bool = True) -> None:
  """Writes and commits step `step` one piece at a time (converters: bounded host memory).

  Single process. Each entry of `arrays` is (key path as save() names it,
  shape, dtype, piece shape, pieces), where pieces() yields (box, data) that
  tile the array on the piece-shape grid, like a sharding's shards; only one
  piece is in memory at a time. The files, checksums, metadata.json and
  commit are Checkpointer.save's, so restore() reads the step like any other.
  A failure removes the temporary directory and leaves earlier steps intact.
  """
  directory = os.path.abspath(directory)
  os.makedirs(directory, exist_ok=True)
  _tidy(directory, fsync)
  final = _step_dir(directory, step)
  if os.path.exists(final):
    raise FileExistsError(f'{final} already exists; remove it or choose another directory.')
  tmp = os.path.join(directory, f'tmp.step_{step}.{secrets.token_hex(4)}')
  pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
  try:
    written, sums = [], {}
    for name, shape, dtype, piece_shape, pieces in arrays:
      dtype = np.dtype(dtype)
      snap = _Snapshot(name, tuple(shape), dtype,
                       _chunk_shape(tuple(piece_shape), dtype.itemsize, chunk_bytes), [])
      for box, data in pieces():
        snap.pieces = [(tuple(box), np.asarray(data, dtype, order='C'))]
        for key, part in _write_local(tmp, [snap], False, fsync, pool).items():
          sums.setdefault(key, {}).update(part)
      snap.pieces = []
      written.append(snap)
    info = {'format_version': FORMAT_VERSION, 'step': step,
            'metadata': dict(metadata, step=step), 'paths': [a.name for a in written],
            'tree': 'save_streamed', 'checksum': CHECKSUM, 'use_ocdbt': False,
            'process_count': 1, 'jax_version': jax.__version__, 'healthy': True,
            'arrays': _verify_and_describe(tmp, written, [sums], False), 'time': time.time()}
    _write_durable(os.path.join(tmp, METADATA), _sealed(info), fsync)
    os.rename(tmp, final)
    _fsync_dir(directory, fsync)
    _write_durable(os.path.join(final, COMMIT), '', fsync)
    _fsync_dir(final, fsync)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  finally:
    pool.shutdown()


def _info_checksum(info: dict[str, Any]) -> str:
  # Over a canonical serialization, so the checksum can live in the file it covers.
  return xxhash.xxh3_64_hexdigest(json.dumps(info, sort_keys=True).encode())


def _sealed(info: dict[str, Any]) -> str:
  """metadata.json's text: `info` as a reader will parse it, plus its checksum."""
  info = json.loads(json.dumps(info))  # e.g. int dict keys become the strings read back
  return json.dumps(info | {'metadata_checksum': _info_checksum(info)})


def _read_info(path: str) -> dict[str, Any]:
  """A step directory's metadata.json, verified against its own checksum."""
  file = os.path.join(path, METADATA)
  try:
    with open(file, 'rb') as f:
      text = f.read()
  except (FileNotFoundError, IsADirectoryError) as e:
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} is missing: {e}') from e
  except OSError as e:
    raise _read_error(file, path, e) from e
  try:
    info = json.loads(text)
  except ValueError as e:  # bad JSON, or bytes that are not UTF-8
    raise CorruptCheckpointError(f'Checkpoint {path}: unreadable {METADATA}: {e}') from e
  if not isinstance(info, dict):
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} holds a '
                                 f'{type(info).__name__}, not an object.')
  if (info.get('format_version') != FORMAT_VERSION or info.get('checksum') != CHECKSUM
      or not {'arrays', 'metadata', 'use_ocdbt'} <= info.keys()):
    raise CorruptCheckpointError(
        f'Checkpoint {path}: {METADATA} is not format {FORMAT_VERSION} with {CHECKSUM} '
        f'checksums (format {info.get("format_version")}, keys {sorted(info)}).')
  # Checkpoints saved before the checksum existed have none and are read as
  # before; the format version stays, so older code still reads new ones
  # (rather than set them all aside as corrupt). Damage that leaves valid JSON
  # minus exactly this key is not a realistic failure.
  claimed = info.pop('metadata_checksum', None)
  if claimed is not None and claimed != _info_checksum(info):
    raise CorruptCheckpointError(
        f'Checkpoint {path}: {file} fails its {CHECKSUM} checksum: it was damaged or '
        'edited after the save, so nothing in it (data position, array shapes) can '
        'be trusted.')
  return info


def _committed_dir(directory: str, step: int | None) -> str:
  directory = os.path.abspath(directory)
  if step is None:
    step = latest_step(directory)
    if step is None:
      raise FileNotFoundError(f'No committed checkpoint in {directory}.')
  path = _step_dir(directory, step)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'No checkpoint for step {step} in {directory}; committed '
                            f'steps: {committed_steps(directory)}.')
  if not _has_commit(path):
    raise FileNotFoundError(f'Checkpoint {path} is incomplete (no {COMMIT} marker: its '
                            'save never finished); restore an earlier step.')
  return path


def read_metadata(directory: str, step: int | None = None) -> dict[str, Any]:
  """The caller's metadata of a committed checkpoint (default: the latest)."""
  return _read_info(_committed_dir(directory, step))['metadata']


def _target_spec(name: str, leaf: Any) -> tuple[tuple[int, ...], Any, Any]:
  """(shape, dtype or None to keep the saved one, sharding or None for host)."""
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
    if not isinstance(leaf.sharding, jax.sharding.Sharding):
      raise ValueError(f'Target {name}: sharding {leaf.sharding!r} is not a '
                       'jax.sharding.Sharding; give it the sharding to restore onto.')
    return tuple(leaf.shape), np.dtype(leaf.dtype), leaf.sharding
  if isinstance(leaf, (np.ndarray, np.generic)):
    return leaf.shape, leaf.dtype, None
  if isinstance(leaf, (bool, int, float)):
    return (), None, None
  raise ValueError(f'Target {name}: {type(leaf).__name__} is not a jax.Array, '
                   'ShapeDtypeStruct, numpy array or Python scalar.')


def _check_match(path: str, names: list[str], specs: list[tuple], stored: dict) -> None:
  missing = [n for n in names if n not in stored]
  extra = sorted(set(stored) - set(names))
  if missing or extra:
    raise ValueError(f'Checkpoint {path} does not match the target tree: arrays '
                     f'missing from the checkpoint {missing}, arrays in the checkpoint '
                     f'but not in the target {extra}. Check the model config.')
  for name, (shape, dtype, _) in zip(names, specs):
    saved_shape = tuple(stored[name]['shape'])
    saved_dtype = ts.dtype(stored[name]['dtype']).numpy_dtype
    if shape != saved_shape:
      raise ValueError(f'Array {name}: checkpoint {path} has shape {saved_shape}, '
                       f'the target has {shape}. Check the model config.')
    floats = all(jnp.issubdtype(d, jnp.floating) for d in (saved_dtype, dtype))
    if dtype is not None and dtype != saved_dtype and not floats:
      raise ValueError(f'Array {name}: checkpoint dtype {saved_dtype} cannot be '
                       f'restored as {dtype} (only float <-> float casts).')


def _array_file(path: str, name: str, use_ocdbt: bool, key: str = 'zarr.json') -> str:
  """The file holding `key` of array `name` (with OCDBT: the database holding it)."""
  if use_ocdbt:
    return os.path.join(path, 'ocdbt')
  return os.path.join(path, 'arrays', name, key)


def _opened(path: str, name: str, desc: Any, use_ocdbt: bool, future: Any) -> Any:
  """The opened array `name`, checked against what metadata.json declares for it."""
  try:
    store = future.result()
  except ValueError as e:
    raise _tensorstore_failure(_array_file(path, name, use_ocdbt), f'array {name}',
                               path, e) from e
  try:
    declared = (tuple(desc['shape']), ts.dtype(desc['dtype']), tuple(desc['chunk_shape']))
  except (KeyError, TypeError, ValueError) as e:
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} describes array '
                                 f'{name} badly: {e!r}') from e
  # The chunk grid (write chunks): tensorstore may split a large chunk into
  # smaller read chunks inside it (its sharding codec), which is not damage.
  chunk = store.chunk_layout.write_chunk.shape or ()  # None for a scalar
  actual = (tuple(store.shape), store.dtype, tuple(chunk))
  if declared != actual:
    raise CorruptCheckpointError(
        f"Checkpoint {path}: array {name}'s zarr.json says (shape, dtype, chunk shape) "
        f'{actual}, but {METADATA} declares {declared}: one of the two was damaged or '
        'edited.')
  return store


def _load_chunk(path: str, name: str, cid: tuple[int, ...], read: Any,
                expected: str | None, use_ocdbt: bool) -> np.ndarray:
  key = _chunk_key(cid)
  try:
    data = read.result()
  except ValueError as e:
    raise _tensorstore_failure(_array_file(path, name, use_ocdbt, key),
                               f'array {name} {key}', path, e) from e
  if expected is not None and _checksum(data) != expected:
    raise CorruptCheckpointError(f'Checkpoint {path}: array {name} {key} '
                                 f'fails its {CHECKSUM} checksum.')
  return data


def _verify_in_full(path: str) -> None:
  """Reads every chunk of the checkpoint in `path` against its checksum.

  Raises CorruptCheckpointError or CheckpointReadError as restore does. One
  chunk at a time: this is a rare recovery path, and memory stays bounded.
  """
  info = _read_info(path)
  use_ocdbt, ctx = info['use_ocdbt'], ts.Context()
  for name, desc in info['arrays'].items():
    store = _opened(path, name, desc, use_ocdbt,
                    ts.open(_spec(path, name, use_ocdbt), open=True, context=ctx))
    shape, chunk = tuple(desc['shape']), tuple(desc['chunk_shape'])
    ids = list(_chunk_ids(tuple((0, n) for n in shape), chunk))
    if set(desc['checksums']) != {_chunk_key(c) for c in ids}:
      raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} lists checksums '
                                   f'for other chunks than array {name} has.')
    for cid in ids:
      read = store[_slices(_chunk_box(cid, chunk, shape))].read()
      _load_chunk(path, name, cid, read, desc['checksums'][_chunk_key(cid)], use_ocdbt)


def _assemble(box: Box, chunks: dict, chunk: tuple[int, ...], shape: tuple[int, ...],
              dtype: np.dtype) -> np.ndarray:
  """The `box` slice of an array, cut from the chunks that cover it."""
  ids = list(_chunk_ids(box, chunk))
  if len(ids) == 1 and _chunk_box(ids[0], chunk, shape) == box:
    return chunks[ids[0]]
  out = np.empty([b - a for a, b in box], dtype)
  for cid in ids:
    cbox = _chunk_box(cid, chunk, shape)
    inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, cbox))
    out[_relative(inter, box)] = chunks[cid][_relative(inter, cbox)]
  return out


def restore(directory: str, target: Any, step: int | None = None,
            verify: bool = True, subtree: str = '') -> tuple[Any, dict[str, Any]]:
  """Restores a committed checkpoint onto the structure, shardings and dtypes of `target`.

  `target` leaves: jax.Array or jax.ShapeDtypeStruct with a sharding (restored
  as jax.Arrays with that sharding, on any mesh and device count), or numpy
  arrays and Python scalars (restored on host). Floating arrays are cast to
  the target dtype. Each process reads only the chunks covering its devices'
  slices and checks their checksums (`verify`). `subtree` names a top-level
  key (e.g. 'params'): `target` then mirrors only that part, and only its
  arrays are read. Returns (state, metadata). metadata.json is verified
  against its own checksum even with verify=False. Raises FileNotFoundError
  for a missing or incomplete checkpoint, ValueError naming the array for a
  mismatch with `target`, CorruptCheckpointError for damaged files (checked
  before the mismatch, so damage is never blamed on the config), and
  CheckpointReadError when the storage refuses a read.
  """
  path = _committed_dir(directory, step)
  info = _read_info(path)
  stored, use_ocdbt = info['arrays'], info['use_ocdbt']
  names, leaves, treedef = _flatten(target)
  if subtree:  # e.g. 'params': restore only the arrays under that key
    names = [f'{subtree}/{n}' for n in names]
    stored = {n: v for n, v in stored.items() if n.startswith(subtree + '/')}
  specs = [_target_spec(n, leaf) for n, leaf in zip(names, leaves)]
  ctx = ts.Context()
  opening = {n: ts.open(_spec(path, n, use_ocdbt), open=True, context=ctx)
             for n in names if n in stored}
  stores = {n: _opened(path, n, stored[n], use_ocdbt, f) for n, f in opening.items()}
  _check_match(path, names, specs, stored)
  pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
  try:
    plans = []  # issue every read first, then finish array by array
    for name, (_, _, sharding) in zip(names, specs):
      shape, chunk = tuple(stored[name]['shape']), tuple(stored[name]['chunk_shape'])
      boxes = {tuple((0, n) for n in shape): []}
      if sharding is not None:
        boxes = {}
        for device, index in sharding.addressable_devices_indices_map(shape).items():
          boxes.setdefault(_index_box(index, shape), []).append(device)
      loads = {}
      for cid in sorted({c for box in boxes for c in _chunk_ids(box, chunk)}):
        read = stores[name][_slices(_chunk_box(cid, chunk, shape))].read()
        expected = stored[name]['checksums'].get(_chunk_key(cid), '') if verify else None
        loads[cid] = pool.submit(_load_chunk, path, name, cid, read, expected, use_ocdbt)
      plans.append((shape, chunk, boxes, loads))
    out = []
    for name, leaf, (_, dtype, sharding), (shape, chunk, boxes, loads) in zip(
        names, leaves, specs, plans):
      chunks = {cid: f.result() for cid, f in loads.items()}
      saved_dtype = ts.dtype(stored[name]['dtype']).numpy_dtype
      hosts = {box: _assemble(box, chunks, chunk, shape, saved_dtype) for box in boxes}
      if sharding is None:
        value = next(iter(hosts.values()))
        if dtype is None:
          out.append(value.item())
        else:
          value = value.astype(dtype, copy=False)
          out.append(value[()] if isinstance(leaf, np.generic) else value)
      else:
        arrays = []
        for box, host in hosts.items():
          host = host.astype(dtype, copy=False)
          arrays += [jax.device_put(host, device) for device in boxes[box]]
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
  finally:
    pool.shutdown(cancel_futures=True)
  return jax.tree_util.tree_unflatten(treedef, out), info['metadata']


def read_array(directory: str, name: str, box: Box | None = None, step: int | None = None
               ) -> np.ndarray:
  """The `box` slice (default: all) of one saved array, e.g. 'params/mlp/w_up', on host.

  Reads and verifies only the chunks covering the box, so a converter can
  stream a checkpoint larger than memory one slice at a time.
  """
  path = _committed_dir(directory, step)
  info = _read_info(path)
  if name not in info['arrays']:
    raise ValueError(f'Checkpoint {path} has no array {name}; it has '
                     f'{sorted(info["arrays"])[:8]}...')
  desc, use_ocdbt = info['arrays'][name], info['use_ocdbt']
  store = _opened(path, name, desc, use_ocdbt, ts.open(_spec(path, name, use_ocdbt), open=True))
  shape, chunk = tuple(desc['shape']), tuple(desc['chunk_shape'])
  box = tuple((0, n) for n in shape) if box is None else tuple(box)
  chunks = {cid: _load_chunk(path, name, cid,
                             store[_slices(_chunk_box(cid, chunk, shape))].read(),
                             desc['checksums'].get(_chunk_key(cid), ''), use_ocdbt)
            for cid in _chunk_ids(box, chunk)}
  return _assemble(box, chunks, chunk, shape, ts.dtype(desc['dtype']).numpy_dtype)


def restore_latest_good(directory: str, target: Any,
                        verify: bool = True) -> tuple[Any, dict[str, Any]]:
  """Restores the newest committed checkpoint that passes its checksums.

  A damaged one (CorruptCheckpointError: chunks, metadata.json, zarr.json) is
  logged as a warning and renamed to corrupt.step_<N>.<nonce> (kept for
  inspection, out of the way of new saves and of later resumes); the previous
  one is tried next. A storage failure (CheckpointReadError: permissions, a
  lost mount, EIO) is raised at once and nothing is renamed: the checkpoint
  may be fine, and fixing access must bring the run back. Every process must
  agree a checkpoint is intact, since each reads different chunks. A mismatch
  with `target` is a config error and is raised, not skipped.
  """
  directory = os.path.abspath(directory)
  sync = _Sync()
  key = f'olmo3_checkpoint/{next(_OP_IDS)}'
  steps = json.loads(sync.broadcast(f'{key}/steps', json.dumps(committed_steps(directory))))
  if not steps:
    raise FileNotFoundError(f'No committed checkpoint in {directory}.')
  failures = []
  for step in reversed(steps):
    result, error, report = None, None, ''
    try:
      result = restore(directory, target, step, verify=verify)
    except (CorruptCheckpointError, CheckpointReadError) as e:
      error = e
      report = json.dumps([isinstance(e, CheckpointReadError), str(e)])
    reports = [json.loads(r) for r in sync.gather(f'{key}/{step}', report) if r]
    unreadable = [message for is_read_error, message in reports if is_read_error]
    if unreadable:  # the storage, not the checkpoint: stop and move nothing
      if isinstance(error, CheckpointReadError):
        raise error
      raise CheckpointReadError(f'Another process could not read step {step}: {unreadable[0]}')
    if not reports:
      return result
    failures.append(f'step {step}: {reports[0][1]}')
    logging.warning('Checkpoint step %d in %s is corrupt (%s); falling back to the '
                    'previous committed checkpoint.', step, directory, reports[0][1])
    if sync.index == 0:
      os.rename(_step_dir(directory, step), os.path.join(
          directory, f'corrupt.step_{step}.{secrets.token_hex(4)}'))
  raise CorruptCheckpointError(
      f'No intact checkpoint in {directory}: ' + '; '.join(failures) + '. Each was moved '
      'to corrupt.step_<N>.*. Put an intact copy back as step_<N> (with its COMMIT) to '
      'resume, or delete the corrupt.step_* directories to start the run afresh.')


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
    try:
      os.makedirs(self.workdir, exist_ok=True)
      return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise OSError(e.errno, f'Cannot open the workdir lock {self.path}: {e.strerror}. '
                    'Make the workdir writable (and LOCK a regular file), or choose '
                    'another --workdir.') from e

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
