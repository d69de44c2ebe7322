"""The step directories of a checkpoint directory: committed, crashed, deleted.

A step is committed when step_<N>/COMMIT exists. checkpoint.py writes it last:
on a filesystem after renaming tmp.step_<N>.<nonce> to step_<N>; in a bucket
(no rename) directly under step_<N>/ (`staging`). `tidy` removes what crashed
saves left and re-commits a complete step that lost only its marker;
`delete_step` renames (filesystem) or deletes COMMIT and metadata.json first
(bucket), so a crash mid-delete leaves a leftover rather than a committed step
with missing chunks. Every path here is a store/storage.py location.
checkpoint.committed_steps, latest_step, latest_healthy_step and read_metadata
are these functions.
"""

import json
import re
import secrets
from typing import Any

from absl import logging

import errors
from store import chunk_store
from store.chunk_store import CorruptCheckpointError
from store import storage

COMMIT = 'COMMIT'
HEALTH = 'HEALTH'  # a step's verdict, written after its commit (write_verdict)
STEP_RE = re.compile(r'^step_(\d+)$')


def step_dir(directory: str, step: int) -> str:
  return storage.join(directory, f'step_{step}')


def staging(directory: str, step: int) -> str:
  """Where a save of `step` writes before its commit: a tmp.* directory renamed into
  place on a filesystem; the final prefix itself in a bucket, which has no rename."""
  return storage.staging(step_dir(directory, step), secrets.token_hex(4))


def commit(directory: str, staged: str, step: int, info_text: str, fsync: bool) -> None:
  """Writes metadata.json into a staged save, moves it into place, writes COMMIT last."""
  chunk_store.write_durable(storage.join(staged, chunk_store.METADATA), info_text, fsync)
  storage.commit(staged, step_dir(directory, step), COMMIT, fsync)


def discard(staged: str) -> None:
  """Removes a failed save's files, its markers first (see delete_step)."""
  storage.delete_tree(staged, first=(COMMIT, chunk_store.METADATA))


def has_commit(step_dir: str) -> bool:
  """Whether `step_dir` holds COMMIT; raises if the storage cannot tell.

  os.path.exists would say False on EACCES too, and a committed step would
  then pass for a crashed save.
  """
  marker = storage.join(step_dir, COMMIT)
  try:
    return storage.exists(marker)
  except OSError as e:
    raise chunk_store.read_error(marker, step_dir, e) from e


def committed_steps(directory: str) -> list[int]:
  """Steps with a committed (COMMIT-marked) checkpoint in `directory`, ascending."""
  try:
    names = storage.listdir(directory)
  except OSError as e:
    raise chunk_store.read_error(directory, directory, e) from e
  steps = []
  for name in names:
    m = STEP_RE.match(name)
    if m and has_commit(storage.join(directory, name)):
      steps.append(int(m.group(1)))
  return sorted(steps)


def latest_step(directory: str) -> int | None:
  """The newest committed step in `directory`, or None when there is none."""
  steps = committed_steps(directory)
  return steps[-1] if steps else None


def latest_healthy_step(directory: str) -> int | None:
  """The newest committed step judged healthy, or None when there is none.

  A step's HEALTH verdict (write_verdict) decides when it has one; else the
  flag it was saved with: True or False, or None for a save whose verdict waits
  for the next step (train.py), which does not count until it is judged.
  Checkpoints written before the flag existed count as healthy. One whose
  metadata is damaged is skipped: it cannot be resumed from.
  """
  directory = storage.absolute(directory)
  for step in reversed(committed_steps(directory)):
    try:
      info = chunk_store.read_info(step_dir(directory, step))
    except CorruptCheckpointError:
      continue
    verdict = read_verdict(directory, step)
    if info.get('healthy', True) if verdict is None else verdict:
      return step
  return None


def write_verdict(directory: str, step: int, healthy: bool, judged_by: int,
                  fsync: bool = True) -> None:
  """Records committed step `step`'s health, judged by the step after it (`judged_by`),
  whose loss is the first computed from its params: one small file, replaced whole."""
  storage.write_atomic(storage.join(step_dir(directory, step), HEALTH),
                       json.dumps({'healthy': bool(healthy), 'judged_by_step': judged_by}),
                       fsync=fsync)


def read_verdict(directory: str, step: int) -> bool | None:
  """Step `step`'s HEALTH verdict; None when it has none. One that does not parse (a
  hand-edited file) is not healthy: the verdict is only trusted when it says so."""
  text = storage.read_text(storage.join(step_dir(directory, step), HEALTH))
  if text is None:
    return None
  try:
    return json.loads(text)['healthy'] is True
  except (ValueError, KeyError, TypeError):
    return False


def tidy(directory: str, fsync: bool) -> None:
  """Removes leftovers of crashed saves; re-commits a complete step that lost COMMIT.

  tmp.step_* directories are saves that never reached their rename: removed.
  On a filesystem a step_<N> without COMMIT was renamed into place only after
  its save had written and verified every file, so it normally lacks just the
  marker (a crash between rename and marker, or a lost file); in a bucket it
  is usually a save cut short. Either way it is verified in full
  (every chunk against its checksum, and metadata.json against its own); if it
  passes it is re-committed with a warning, not left in place: it may be the
  run's newest state, and a later save of step N could not rename onto it. One
  that fails verification is a partial save and is removed. A storage error
  raises CheckpointReadError with nothing removed. Another run's in-flight
  save in this directory would look like such leftovers: WorkdirLock keeps a
  second run out.
  """
  for name in storage.listdir(directory):
    path = storage.join(directory, name)
    if not (name.startswith('tmp.step_') or STEP_RE.match(name)) or not storage.isdir(path):
      continue
    if name.startswith('tmp.step_'):
      logging.warning('Removing partial checkpoint %s (left by a crashed save).', path)
      storage.delete_tree(path)
    elif STEP_RE.match(name) and not has_commit(path):
      _recommit_or_remove(path, fsync)


def _recommit_or_remove(path: str, fsync: bool) -> None:
  try:
    chunk_store.verify_in_full(path)
  except CorruptCheckpointError as e:
    logging.warning('Removing partial checkpoint %s (left by a crashed save: %s).', path, e)
    discard(path)
    return
  logging.warning('Checkpoint %s has no %s marker but every file verifies against its '
                  'checksums (only the marker was lost); re-committing it.', path, COMMIT)
  storage.commit(path, path, COMMIT, fsync)


def delete_step(directory: str, step: int) -> None:
  # A filesystem renames first, so a crash mid-delete leaves a tmp.* leftover rather
  # than a COMMIT-marked step with missing chunks; a bucket deletes COMMIT first, then
  # metadata.json (so tidy cannot re-commit the rest), then the chunks.
  storage.retire(step_dir(directory, step), secrets.token_hex(4),
                 first=(COMMIT, chunk_store.METADATA))


def set_aside(directory: str, name: str, new_name: str) -> None:
  """Moves step directory `name` out of the listing (corrupt.*, rolledback.*): a rename
  on a filesystem; in a bucket a copy with COMMIT last, then a delete with COMMIT and
  metadata.json first, so a crash leaves the step committed or the copy complete."""
  storage.rename_tree(storage.join(directory, name), storage.join(directory, new_name),
                      last=(COMMIT,), first_deleted=(COMMIT, chunk_store.METADATA))
  storage.fsync_dir(directory)


def committed_dir(directory: str, step: int | None) -> str:
  directory = storage.absolute(directory)
  if step is None:
    step = latest_step(directory)
    if step is None:
      raise FileNotFoundError(f'No committed checkpoint in {directory}.')
  path = step_dir(directory, step)
  if not storage.isdir(path):
    raise FileNotFoundError(f'No checkpoint for step {step} in {directory}; committed '
                            f'steps: {committed_steps(directory)}.')
  if not has_commit(path):
    raise FileNotFoundError(f'Checkpoint {path} is incomplete (no {COMMIT} marker: its '
                            'save never finished); restore an earlier step.')
  return path


def read_metadata(directory: str, step: int | None = None) -> dict[str, Any]:
  """The caller's metadata of a committed checkpoint (default: the latest)."""
  return chunk_store.read_info(committed_dir(directory, step))['metadata']


def check_fresh_start(directory: str, workdir: str) -> str | None:
  """Before a run in `workdir` starts from step 0 because `directory` has no committed step.

  Refuses a directory holding only corrupt checkpoints (restore_latest_good set
  them aside; starting over would silently replace the run). Returns a warning
  (None when there is nothing to say) naming committed steps where train.py
  does not read them: in `workdir` itself, or one folder down (W/*/step_N, a
  copy into another folder; W/*/checkpoints/step_N, `convert.py --to=W/x`
  written one level too deep).
  """
  if any(n.startswith('corrupt.step_') for n in storage.listdir(directory)):
    raise errors.ConfigError(f'{directory} holds only corrupt checkpoints (corrupt.step_*); '
                             'restore a good copy there, or remove them to start afresh.')
  found = []  # (where, steps, the fix)
  steps = committed_steps(workdir)
  if steps:
    found.append((workdir, steps, f'move its step_* directories into {directory}'))
  inner_name = storage.basename(directory)
  for name in storage.listdir(workdir):
    entry = storage.join(workdir, name)
    if name == inner_name or not STEP_RE.match(name) and not storage.isdir(entry):
      continue
    steps = [] if STEP_RE.match(name) else committed_steps(entry)
    if steps:
      found.append((entry, steps, f'move its step_* directories into {directory}'))
    steps = committed_steps(storage.join(entry, inner_name))
    if steps:
      found.append((storage.join(entry, inner_name), steps,
                    f'pass --workdir={entry}, the workdir they were written for, or move them '
                    f'into {directory}'))
  if not found:
    return None
  listed = '; '.join(f'{where} holds steps {steps} ({fix})' for where, steps, fix in found)
  return (f'{directory} has no checkpoint, so this run starts from step 0, but committed '
          f'checkpoints lie where train.py does not read them: {listed}. To continue from '
          'them, stop this run and do that (convert.py --to=WORKDIR writes WORKDIR/checkpoints, '
          'where train.py --workdir=WORKDIR reads).')
