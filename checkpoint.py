"""Atomic, asynchronous tensorstore checkpoints of pytrees of jax.Arrays.

One directory per step:

  <directory>/step_<N>/
    metadata.json   the caller's metadata, the tree's key paths, whether the
                    run was healthy, per array its shape, dtype, chunk shape and
                    one checksum per chunk, and a checksum of all of that
    arrays/<path>/  one zarr3 array per leaf; <path> is its key path joined by
                    '/' (with use_ocdbt: one OCDBT database in ocdbt/ instead)
    COMMIT          written last; a step directory without it is incomplete
    HEALTH          the step's health verdict, when it was saved pending one
                    (healthy=None) and the next step judged it (judge())

On a filesystem a save writes into <directory>/tmp.step_<N>.<nonce>/; process 0
then renames it to step_<N> and writes COMMIT. In a gs:// or s3:// bucket (no
rename; store/storage.py) it writes straight under step_<N>/ and COMMIT, written last
by process 0 after every process has written and metadata.json is in place, is
the commit. A crash at any point leaves earlier steps intact, and the next
Checkpointer (or its save or restore) removes tmp.* directories; a step_<N>
without COMMIT is re-committed if it verifies in full and removed otherwise
(step_dirs.tidy). WorkdirLock (hosts/workdir_lock.py) keeps a second run out of the same
workdir, whose in-flight save would otherwise look like such leftovers.

The bytes of a step (chunked zarr3 arrays, checksums, metadata.json) are
store/chunk_store.py's: each array's chunk grid follows the saving sharding's shards,
so every process writes whole chunks of the shards it owns (replica_id == 0)
and no two processes touch one file; restore reads the chunks that cover each
target device's slice, verifies them, and cuts the slice out, so a checkpoint
restores onto any mesh and device count. This module decides what is saved,
when a step is committed, which steps are kept, and which one is restored.

Read failures fall in two kinds: damage raises CorruptCheckpointError, and
restore_latest_good falls back past it; the storage refusing a read raises
CheckpointReadError and nothing is moved, so fixing access brings the run back.

It is a little longer than the house's ~600 lines: saving, committing, keeping and
choosing the step to restore share one set of invariants (what COMMIT and HEALTH
promise), and splitting them would put one protocol in two files.
"""

import concurrent.futures
import itertools
import json
import os
import re
import secrets
import sys
import threading
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

import errors
from store import chunk_store
from store.chunk_store import (CHECKSUM, FORMAT_VERSION, METADATA, Box, CheckpointReadError,
                         CorruptCheckpointError)
from hosts.host_sync import Sync
from store import offload
from store import step_dirs
from store import storage
from store.step_dirs import COMMIT, committed_steps, latest_healthy_step, latest_step, read_metadata
from hosts import workdir_lock
from hosts.workdir_lock import LOCK, WorkdirLock, WorkdirLockedError

# What other modules use, as checkpoint.<name> (some defined in store/chunk_store.py,
# hosts/workdir_lock.py).
__all__ = ['Checkpointer', 'restore', 'restore_latest_good', 'read_metadata', 'read_array',
           'committed_steps', 'latest_step', 'latest_healthy_step', 'save_streamed',
           'WorkdirLock', 'WorkdirLockedError', 'CorruptCheckpointError', 'CheckpointReadError',
           'CheckpointSaveError', 'COMMIT', 'METADATA', 'LOCK', 'CHECKSUM', 'FORMAT_VERSION']

_KEY_RE = re.compile(r'^[A-Za-z0-9_.\-]+$')
_OP_IDS = itertools.count()  # same sequence on every process (SPMD call order)


class CheckpointSaveError(RuntimeError):
  """A background save failed; earlier checkpoints are intact. `failed_store`: the store
  that failed, if one did, as on storage.StorageError (errors.one_line then appends no
  stack to an error.log there, which would wait out the same retries again)."""

  def __init__(self, message: str, failed_store: str = ''):
    super().__init__(message)
    self.failed_store = failed_store


_SPEC_RE = re.compile(r" ?\[tensorstore_spec='.*?'\]", re.DOTALL)  # kilobytes of JSON


def _background() -> None:
  """Lowers the calling thread's CPU priority (Linux: per thread): the save's transfer,
  hashing and writes run beside the loop, whose dispatch must not wait for a core."""
  try:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
  except (AttributeError, OSError):  # not Linux, or not allowed: the save is only slower
    pass


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


class Checkpointer:
  """Saves (asynchronously, atomically) and restores train states in `directory`.

  At most one save is in flight: save() first waits for the previous one.
  An error in the background save is raised as CheckpointSaveError by the
  next poll(), save(), wait() or close(). Retention, run by process 0 right
  after each commit: the newest `keep_last` committed steps, every step
  divisible by `keep_every` (0: none), and the newest healthy step (saved
  healthy=True, or judged so: judge()) are kept; so saves made while the run
  is diverging can never evict its last healthy state. Creating a Checkpointer
  tidies what crashed saves left (step_dirs.tidy). Use one Checkpointer per directory at a time (see
  WorkdirLock). fsync=False skips fsync (tests, scratch runs): a power cut may
  then leave a committed step with lost data, which restore's checksums still
  catch. device_copy: how save() captures the state (store/offload.py): 'auto', an
  on-device copy moved to host behind the loop where the device has room for it; False,
  the whole state to host before save() returns; True, an on-device copy regardless.
  `last_save`: the latest save's costs (seconds save() blocked, bytes copied on device
  and to host, and once committed the seconds from the call to the commit);
  `recent_saves`: the latest 8 saves' (a save waits for the one before it, so a step's
  cost is complete before the step after next is saved).
  """

  def __init__(self, directory: str, keep_last: int = 3, keep_every: int = 0,
               use_ocdbt: bool = False, chunk_bytes: int = 64 << 20, fsync: bool = True,
               device_copy: bool | str = 'auto'):
    if keep_last < 1:
      raise ValueError(f'keep_last={keep_last}: must be >= 1 (the newest '
                       'checkpoint is never deleted).')
    if keep_every < 0:
      raise ValueError(f'keep_every={keep_every}: must be >= 0 (0 = none).')
    self.directory = storage.absolute(storage.canonical(directory, 'checkpoint directory'))
    self.keep_last, self.keep_every = keep_last, keep_every
    self.use_ocdbt, self.chunk_bytes, self.fsync = use_ocdbt, chunk_bytes, fsync
    if device_copy not in (True, False, 'auto'):
      raise ValueError(f'device_copy={device_copy!r}: must be True, False or "auto".')
    self.device_copy = device_copy
    self.last_save: dict[str, Any] = {}
    self.recent_saves: list[dict[str, Any]] = []  # the last_save of the latest 8 saves
    self._sync = Sync()
    if use_ocdbt and self._sync.count > 1:
      raise ValueError('use_ocdbt=True supports one process only (concurrent '
                       'OCDBT writers need a tensorstore coordinator); use the '
                       'default zarr3 files for multi-process runs.')
    storage.makedirs(self.directory)
    self._thread: threading.Thread | None = None
    self._verdicts: dict[int, tuple[bool, int]] = {}  # judge()'s, until no save is in flight
    self._error: tuple[int, BaseException] | None = None
    self._not_removed: tuple[str, Exception] | None = None  # a failed save's leftover, and why
    self._pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1,
                                                       initializer=_background)
    self._tidy()  # before the caller lists committed steps

  def latest_step(self) -> int | None:
    steps = self.committed_steps()
    return steps[-1] if steps else None

  def latest_healthy_step(self) -> int | None:
    """Module latest_healthy_step() of this directory, as process 0 finds it."""
    key = f'olmo3_checkpoint/{next(_OP_IDS)}/healthy'
    found = latest_healthy_step(self.directory) if self._sync.index == 0 else None
    return json.loads(self._sync.broadcast(key, json.dumps(found)))

  def committed_steps(self) -> list[int]:
    """The committed steps as process 0 lists them, on every process: all processes
    decide the same (a host that lists another disk must not choose another step)."""
    key = f'olmo3_checkpoint/{next(_OP_IDS)}/steps'
    steps = committed_steps(self.directory) if self._sync.index == 0 else []
    return json.loads(self._sync.broadcast(key, json.dumps(steps)))

  def save(self, step: int, state: Any, metadata: dict[str, Any] | None = None, *,
           healthy: bool | None = True) -> None:
    """Captures `state` now (an on-device copy, or a host copy: device_copy) and moves it
    to host and writes it in the background.

    `metadata` (JSON-serializable: config, data state, RNG, ...) is stored with
    'step' added. `healthy` says whether the run was healthy at this step (the
    caller's judgement, e.g. no loss spike or NaN); it is recorded in
    metadata.json, and retention keeps the newest healthy step until a newer
    healthy one is committed. None: the verdict is not known yet (train.py judges
    a state by the loss of the next step, the first computed from its params),
    and judge() records it; until then the step does not count as healthy.
    Saving an already committed step is skipped with a warning (e.g. a
    preemption save right after a resume).
    """
    began = time.perf_counter()
    self.wait()
    workdir_lock.check_lease(self.directory)  # no save from a run whose lease may lapse
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f'step={step!r}: must be an integer >= 0.')
    if healthy is not None and not isinstance(healthy, (bool, np.bool_)):
      raise TypeError(f'healthy={healthy!r}: must be a bool (was the run healthy '
                      'when this state was reached?) or None (judged later).')
    step = int(step)
    metadata = dict(metadata or {})
    if metadata.setdefault('step', step) != step:
      raise ValueError(f"metadata['step']={metadata['step']} differs from step={step}.")
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as e:
      raise ValueError(f'Checkpoint metadata must be JSON-serializable: {e}') from e
    self._tidy()  # first: it may re-commit this very step
    if step in self.committed_steps():
      logging.warning('Checkpoint step %d already committed in %s; not saving it again.',
                      step, self.directory)
      return
    names, leaves, treedef = _flatten(state)
    key = f'olmo3_checkpoint/{next(_OP_IDS)}'
    taken = offload.take(names, leaves, self._sync.index, self.chunk_bytes, self.device_copy,
                         lambda chosen: self._agreed(f'{key}/copies', chosen))
    # Broadcast after the clean-up, so no process creates the new tmp dir early.
    tmp = self._sync.broadcast(f'{key}/staging', step_dirs.staging(self.directory, step))
    storage.makedirs(tmp)
    info = {'format_version': FORMAT_VERSION, 'step': step, 'metadata': metadata,
            'paths': names, 'tree': str(treedef), 'checksum': CHECKSUM,
            'use_ocdbt': self.use_ocdbt, 'process_count': self._sync.count,
            'jax_version': jax.__version__,
            'healthy': None if healthy is None else bool(healthy)}
    # Daemon: a process that is failing must not hang at exit on a save that
    # waits for peers (train.py abandons it then; the partial save is ignored).
    stats = {'step': step, 'device_copy_bytes': taken.copied_bytes,
             'blocking_bytes': taken.blocking_bytes, 'mode': taken.why}
    self.last_save = stats
    self.recent_saves = self.recent_saves[-7:] + [stats]
    self._thread = threading.Thread(
        target=self._run, args=(step, began, stats, tmp, taken, info, key),
        name=f'checkpoint-save-{step}', daemon=True)
    self._thread.start()
    stats['blocking_s'] = time.perf_counter() - began
    logging.info('Checkpoint step %d: %s; save() blocked %.3f s.', step, taken.why,
                 stats['blocking_s'])

  def _agreed(self, key: str, chosen: list[bool]) -> list[bool]:
    """An array is copied on device where every process has room for it."""
    if self._sync.count == 1:
      return chosen
    masks = [json.loads(m) for m in self._sync.gather(key, json.dumps(chosen))]
    return [all(m[i] for m in masks) for i in range(len(chosen))]

  def _run(self, step: int, began: float, stats: dict[str, Any], *args) -> None:
    _background()
    try:
      self._save_and_commit(step, *args)
      stats['durable_s'] = time.perf_counter() - began  # committed: COMMIT written
    except BaseException as e:  # pylint: disable=broad-except
      self._error = (step, e)

  def _save_and_commit(self, step: int, tmp: str, taken: offload.Taken,
                       info: dict[str, Any], key: str) -> None:
    error, status, sums, arrays = None, 'ok', {}, []
    try:
      arrays = offload.to_host(taken, self._sync.index, self.chunk_bytes)
      sums = chunk_store.write_local(tmp, arrays, self.use_ocdbt, self.fsync, self._pool)
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
        info['arrays'] = chunk_store.verify_and_describe(
            tmp, arrays, [p['sums'] for p in parts], self.use_ocdbt)
        info['time'] = time.time()
        step_dirs.commit(self.directory, tmp, step, chunk_store.sealed(info), self.fsync)
      except BaseException as e:  # pylint: disable=broad-except
        error = error or e
        outcome = f'{type(e).__name__}: {e}'
        try:
          step_dirs.discard(tmp)
        except Exception as left:  # pylint: disable=broad-except  # the save's error comes first
          self._not_removed = (tmp, left)
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
    steps = committed_steps(self.directory)  # process 0 only
    keep = set(steps[-self.keep_last:])
    if self.keep_every:
      keep |= {s for s in steps if s % self.keep_every == 0}
    newest_healthy = latest_healthy_step(self.directory)
    if newest_healthy is not None:
      keep.add(newest_healthy)
    for s in steps:
      if s not in keep:
        step_dirs.delete_step(self.directory, s)

  def judge(self, step: int, healthy: bool, judged_by: int) -> None:
    """Records the health verdict of step `step` (saved, or being saved, with any flag),
    judged by step `judged_by`: process 0 writes it into the step's directory
    (step_dirs.write_verdict) once no save is in flight, i.e. now, or at the
    next poll(), save() or wait(), so the step is committed when it is written
    and the background retention never reads a half-written verdict. A step
    that was never committed (a failed save) or is gone gets none.
    """
    self._verdicts[int(step)] = (bool(healthy), int(judged_by))
    self.poll()

  def _write_verdicts(self) -> None:
    verdicts, self._verdicts = self._verdicts, {}
    if self._sync.index != 0 or not verdicts:
      return
    steps = committed_steps(self.directory)
    for step, (healthy, judged_by) in sorted(verdicts.items()):
      if step in steps:
        step_dirs.write_verdict(self.directory, step, healthy, judged_by, self.fsync)

  def poll(self) -> None:
    """Raises CheckpointSaveError now if the last background save has failed, and the
    lease's error if the workdir's lease could not be renewed (workdir_lock.check_lease).

    Non-blocking (a thread liveness check), so cheap enough to call every
    step. In multi-process runs every process learns of a failure, but each
    on its own schedule (possibly a step apart).
    """
    workdir_lock.check_lease(self.directory)
    if self._thread is None or not self._thread.is_alive():
      self.wait()

  def wait(self) -> None:
    """Blocks until the in-flight save is committed; raises CheckpointSaveError if it
    failed. Then writes the verdicts judge() holds."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._error is None:
      self._write_verdicts()
    if self._error is not None:
      (step, error), self._error = self._error, None
      (tmp, left), self._not_removed = self._not_removed or ('', None), None
      tmp = (f'removing its temporary directory failed too, {tmp} ({type(left).__name__}: '
             f'{left}); the next start removes it' if tmp else
             'its temporary directory was removed')
      message = (f'Checkpoint save of step {step} in {self.directory} failed; {tmp}, and '
                 f'earlier checkpoints are intact: {type(error).__name__}: {error}. Fix the '
                 'cause (disk space, permissions, the mount or the store), then rerun the '
                 'same command to resume from the latest checkpoint.')
      failed = getattr(error, 'failed_store', '') or getattr(left, 'failed_store', '')
      raise CheckpointSaveError(_SPEC_RE.sub('', message), failed) from error

  def restore(self, target: Any, step: int | None = None,
              verify: bool = True) -> tuple[Any, dict[str, Any]]:
    """Module restore() of `step` (default: latest), after tidying (step_dirs.tidy)."""
    self._before_restore()
    if step is None:
      step = self.latest_step()  # process 0's, on every process
      if step is None:
        raise FileNotFoundError(f'No committed checkpoint in {self.directory}.')
    key = f'olmo3_checkpoint/{next(_OP_IDS)}/restore'
    result, corrupt = _restore_agreed(self._sync, key, self.directory, target, step, verify)
    if corrupt:
      raise CorruptCheckpointError(corrupt[0])
    return result

  def restore_latest_good(self, target: Any, verify: bool = True,
                          prefetched: Any = None) -> tuple[Any, dict[str, Any]]:
    """Module restore_latest_good(), after tidying (step_dirs.tidy)."""
    self._before_restore()
    return restore_latest_good(self.directory, target, verify=verify, prefetched=prefetched)

  def _before_restore(self) -> None:
    self.wait()
    self._tidy()

  def _tidy(self) -> None:
    """Process 0 runs step_dirs.tidy; if it fails, every process raises (none waits forever)."""
    key = f'olmo3_checkpoint/{next(_OP_IDS)}/tidy'
    error = None
    if self._sync.index == 0:
      try:
        step_dirs.tidy(self.directory, self.fsync)
      except OSError as e:
        error = e
    failure = self._sync.broadcast(key, '' if error is None else str(error))
    if error is not None:
      raise error
    if failure:
      raise CheckpointReadError(f'Process 0 could not tidy {self.directory}: {failure}')

  def close(self) -> None:
    """Waits for the in-flight save (raising its error) and frees the hash threads.

    Closed while another error is handled (train.py's loop, failing), its own is logged in
    one line, not raised: an outage fails the save and what the run did next, and the run's
    one `error:` line names the first; a second error's traceback would bury it.
    """
    ending = sys.exc_info()[1]
    try:
      self.wait()
    except Exception as e:  # pylint: disable=broad-except  # raised unless another is
      if ending is None:
        raise
      logging.error('The in-flight checkpoint save of %s failed too: %s', self.directory,
                    _SPEC_RE.sub('', ' '.join(str(e).split())))
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
  directory = storage.absolute(storage.canonical(directory, 'checkpoint directory'))
  storage.makedirs(directory)
  step_dirs.tidy(directory, fsync)
  final = step_dirs.step_dir(directory, step)
  if storage.isdir(final):
    raise FileExistsError(f'{final} already exists; remove it or choose another directory.')
  tmp = step_dirs.staging(directory, step)
  storage.makedirs(tmp)
  pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1)
  try:
    written, sums = [], {}
    for name, shape, dtype, piece_shape, pieces in arrays:
      dtype = np.dtype(dtype)
      chunk = chunk_store.chunk_shape(tuple(piece_shape), dtype.itemsize, chunk_bytes)
      snap = chunk_store.Snapshot(name, tuple(shape), dtype, chunk, [])
      for box, data in pieces():
        snap.pieces = [(tuple(box), np.asarray(data, dtype, order='C'))]
        for key, part in chunk_store.write_local(tmp, [snap], False, fsync, pool).items():
          sums.setdefault(key, {}).update(part)
      snap.pieces = []
      written.append(snap)
    info = {'format_version': FORMAT_VERSION, 'step': step,
            'metadata': dict(metadata, step=step), 'paths': [a.name for a in written],
            'tree': 'save_streamed', 'checksum': CHECKSUM, 'use_ocdbt': False,
            'process_count': 1, 'jax_version': jax.__version__, 'healthy': True,
            'arrays': chunk_store.verify_and_describe(tmp, written, [sums], False),
            'time': time.time()}
    step_dirs.commit(directory, tmp, step, chunk_store.sealed(info), fsync)
  except BaseException:
    step_dirs.discard(tmp)
    raise
  finally:
    pool.shutdown()


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


_SHAPE_FIX = ('Check the model config: a changed shape (vocab, widths, layers) cannot be '
              'resumed, even with train.allow_config_change; start a new workdir, with '
              '--config.train.init_from=<this checkpoint> to take the weights that still fit.')


def _check_match(path: str, names: list[str], specs: list[tuple], stored: dict) -> None:
  """A target that does not fit the checkpoint: a config mistake (errors.ConfigError, a
  ValueError), raised before any chunk is read."""
  missing = [n for n in names if n not in stored]
  extra = sorted(set(stored) - set(names))
  if missing or extra:
    raise errors.ConfigError(f'Checkpoint {path} does not match the target tree: arrays '
                             f'missing from the checkpoint {missing}, arrays in the checkpoint '
                             f'but not in the target {extra}. {_SHAPE_FIX}')
  for name, (shape, dtype, _) in zip(names, specs):
    saved_shape = tuple(stored[name]['shape'])
    saved_dtype = ts.dtype(stored[name]['dtype']).numpy_dtype
    if shape != saved_shape:
      raise errors.ConfigError(f'Array {name}: checkpoint {path} has shape {saved_shape}, '
                               f'the target has {shape}. {_SHAPE_FIX}')
    floats = all(jnp.issubdtype(d, jnp.floating) for d in (saved_dtype, dtype))
    if dtype is not None and dtype != saved_dtype and not floats:
      raise ValueError(f'Array {name}: checkpoint dtype {saved_dtype} cannot be '
                       f'restored as {dtype} (only float <-> float casts).')


def restore(directory: str, target: Any, step: int | None = None,
            verify: bool = True, subtree: str = '', prefetched: Any = None
            ) -> tuple[Any, dict[str, Any]]:
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
  CheckpointReadError when the storage refuses a read. `prefetched` (a
  store.prefetch.Prefetch of this directory): the arrays it read of `step`, if its
  metadata is unchanged, are placed instead of read again.
  """
  path = step_dirs.committed_dir(directory, step)
  info = chunk_store.read_info(path)
  ahead = prefetched.take(step, info) if prefetched is not None and step is not None else None
  ahead = ahead or {}
  stored, use_ocdbt = info['arrays'], info['use_ocdbt']
  names, leaves, treedef = _flatten(target)
  if subtree:  # e.g. 'params': restore only the arrays under that key
    names = [f'{subtree}/{n}' for n in names]
    stored = {n: v for n, v in stored.items() if n.startswith(subtree + '/')}
  specs = [_target_spec(n, leaf) for n, leaf in zip(names, leaves)]
  ctx = ts.Context()
  opening = {n: ts.open(chunk_store.spec(path, n, use_ocdbt), open=True, context=ctx)
             for n in names if n in stored and n not in ahead}  # ahead's: checked when read
  stores = {n: chunk_store.opened(path, n, stored[n], use_ocdbt, f) for n, f in opening.items()}
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
          boxes.setdefault(chunk_store.index_box(index, shape), []).append(device)
      # A box of whole chunks (a restore onto the saving layout, or a coarser one) is one
      # read, verified in place: no per-chunk buffers to assemble, and tensorstore reads
      # its chunks in parallel. Other boxes read the chunks they cut and assemble them.
      if name in ahead:  # read ahead, verified: each box is a view of it
        plans.append((shape, chunk, boxes, {}, {}))
        continue
      whole = {box: pool.submit(chunk_store.load_box, path, name, stores[name], box,
                                stored[name], stores[name][chunk_store.slices(box)].read(),
                                verify, use_ocdbt)
               for box in boxes if chunk_store.aligned(box, chunk, shape)}
      loads = {}
      for cid in sorted({c for box in boxes if box not in whole
                         for c in chunk_store.chunk_ids(box, chunk)}):
        read = stores[name][chunk_store.slices(chunk_store.chunk_box(cid, chunk, shape))].read()
        expected = stored[name]['checksums'].get(chunk_store.chunk_key(cid), '') if verify else None
        loads[cid] = pool.submit(chunk_store.load_chunk, path, name, cid, read, expected, use_ocdbt)
      plans.append((shape, chunk, boxes, whole, loads))
    out = []
    for name, leaf, (_, dtype, sharding), (shape, chunk, boxes, whole, loads) in zip(
        names, leaves, specs, plans):
      chunks = {cid: f.result() for cid, f in loads.items()}
      saved_dtype = ts.dtype(stored[name]['dtype']).numpy_dtype
      hosts = {box: ahead[name][chunk_store.slices(box)] if name in ahead else
               whole[box].result() if box in whole else
               chunk_store.assemble(box, chunks, chunk, shape, saved_dtype) for box in boxes}
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
  path = step_dirs.committed_dir(directory, step)
  info = chunk_store.read_info(path)
  if name not in info['arrays']:
    raise ValueError(f'Checkpoint {path} has no array {name}; it has '
                     f'{sorted(info["arrays"])[:8]}...')
  desc, use_ocdbt = info['arrays'][name], info['use_ocdbt']
  store = chunk_store.opened(path, name, desc, use_ocdbt,
                             ts.open(chunk_store.spec(path, name, use_ocdbt), open=True))
  shape, chunk = tuple(desc['shape']), tuple(desc['chunk_shape'])
  box = tuple((0, n) for n in shape) if box is None else tuple(box)
  chunks = {}
  for cid in chunk_store.chunk_ids(box, chunk):
    read = store[chunk_store.slices(chunk_store.chunk_box(cid, chunk, shape))].read()
    chunks[cid] = chunk_store.load_chunk(path, name, cid, read,
                                         desc['checksums'].get(chunk_store.chunk_key(cid), ''),
                                         use_ocdbt)
  return chunk_store.assemble(box, chunks, chunk, shape, ts.dtype(desc['dtype']).numpy_dtype)


def restore_latest_good(directory: str, target: Any, verify: bool = True,
                        prefetched: Any = None) -> tuple[Any, dict[str, Any]]:
  """Restores the newest committed checkpoint that passes its checksums (`prefetched`:
  restore's).

  A damaged one (CorruptCheckpointError: chunks, metadata.json, zarr.json) is
  logged as a warning and renamed to corrupt.step_<N>.<nonce> (kept for
  inspection, out of the way of new saves and of later resumes); the previous
  one is tried next. A storage failure (CheckpointReadError: permissions, a
  lost mount, EIO) is raised at once and nothing is renamed: the checkpoint
  may be fine, and fixing access must bring the run back. Every process must
  agree a checkpoint is intact, since each reads different chunks. A mismatch
  with `target` is a config error and is raised, not skipped.
  """
  directory = storage.absolute(directory)
  sync = Sync()
  key = f'olmo3_checkpoint/{next(_OP_IDS)}'
  steps = committed_steps(directory) if sync.index == 0 else []  # process 0 decides
  steps = json.loads(sync.broadcast(f'{key}/steps', json.dumps(steps)))
  if not steps:
    raise FileNotFoundError(f'No committed checkpoint in {directory}.')
  failures = []
  for step in reversed(steps):
    result, reports = _restore_agreed(sync, f'{key}/{step}', directory, target, step, verify,
                                      prefetched)
    if not reports:
      return result
    failures.append(f'step {step}: {reports[0]}')
    logging.warning('Checkpoint step %d in %s is corrupt (%s); falling back to the '
                    'previous committed checkpoint.', step, directory, reports[0])
    if sync.index == 0:
      step_dirs.set_aside(directory, f'step_{step}', f'corrupt.step_{step}.{secrets.token_hex(4)}')
  raise CorruptCheckpointError(
      f'No intact checkpoint in {directory}: ' + '; '.join(failures) + '. Each was moved '
      'to corrupt.step_<N>.*. Put an intact copy back as step_<N> (with its COMMIT) to '
      'resume, or delete the corrupt.step_* directories to start the run afresh.')


def _restore_agreed(sync: Sync, key: str, directory: str, target: Any, step: int,
                    verify: bool, prefetched: Any = None) -> tuple[Any, list[str]]:
  """(state, []) when every process restored `step`; (None, messages) when some found it
  corrupt. Anything else any process met (the storage refusing a read, a missing file
  on one host, a mismatch) is raised on every process, so none is left waiting in a
  collective for a peer that failed."""
  result, error, report = None, None, ''
  try:
    result = restore(directory, target, step, verify=verify, prefetched=prefetched)
  except Exception as e:  # pylint: disable=broad-except  # reported to every process below
    error = e
    kind = 'corrupt' if isinstance(e, CorruptCheckpointError) else 'other'
    report = json.dumps([kind, f'{e}' if sync.count == 1 else f'process {sync.index}: {e}'])
  reports = [json.loads(r) for r in sync.gather(key, report) if r]
  fatal = [message for kind, message in reports if kind != 'corrupt']
  if fatal:
    if error is not None and not isinstance(error, CorruptCheckpointError):
      raise error
    raise CheckpointReadError(f'Another process could not restore step {step} of {directory}: '
                              f'{fatal[0]}. Nothing was moved; fix that host\'s access to the '
                              'checkpoint and rerun the same command.')
  return result, [message for _, message in reports]
