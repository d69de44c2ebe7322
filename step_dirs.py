"""The step directories of a checkpoint directory: committed, crashed, deleted.

A step is committed when step_<N>/COMMIT exists (checkpoint.py writes it last,
after the rename from tmp.step_<N>.<nonce>). `tidy` removes what crashed saves
left and re-commits a complete step that lost only its marker; `delete_step`
renames before deleting, so a crash mid-delete leaves a tmp.* leftover rather
than a committed step with missing chunks. checkpoint.committed_steps,
latest_step, latest_healthy_step and read_metadata are these functions.
"""

import os
import re
import secrets
import shutil
import sys
from typing import Any

from absl import logging

import chunk_store
import errors
from chunk_store import CorruptCheckpointError
COMMIT = 'COMMIT'
STEP_RE = re.compile(r'^step_(\d+)$')


def step_dir(directory: str, step: int) -> str:
  return os.path.join(directory, f'step_{step}')


def has_commit(step_dir: str) -> bool:
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
    raise chunk_store.read_error(marker, step_dir, e) from e
  return True


def committed_steps(directory: str) -> list[int]:
  """Steps with a committed (COMMIT-marked) checkpoint in `directory`, ascending."""
  try:
    names = os.listdir(directory)
  except FileNotFoundError:
    return []
  steps = []
  for name in names:
    m = STEP_RE.match(name)
    if m and has_commit(os.path.join(directory, name)):
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
      info = chunk_store.read_info(step_dir(directory, step))
    except CorruptCheckpointError:
      continue
    if info.get('healthy', True):
      return step
  return None


def tidy(directory: str, fsync: bool) -> None:
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
    elif STEP_RE.match(name) and not has_commit(path):
      _recommit_or_remove(path, fsync)


def _recommit_or_remove(path: str, fsync: bool) -> None:
  try:
    chunk_store.verify_in_full(path)
  except CorruptCheckpointError as e:
    logging.warning('Removing partial checkpoint %s (left by a crashed save: %s).', path, e)
    shutil.rmtree(path, ignore_errors=True)
    return
  logging.warning('Checkpoint %s has no %s marker but every file verifies against its '
                  'checksums (only the marker was lost); re-committing it.', path, COMMIT)
  chunk_store.write_durable(os.path.join(path, COMMIT), '', fsync)
  chunk_store.fsync_dir(path, fsync)


def delete_step(directory: str, step: int) -> None:
  # Rename first, so a crash mid-delete leaves a tmp.* leftover rather than a
  # COMMIT-marked step with missing chunks.
  doomed = os.path.join(directory,
                        f'tmp.step_{step}.deleted.{secrets.token_hex(4)}')
  os.rename(step_dir(directory, step), doomed)
  shutil.rmtree(doomed)


def committed_dir(directory: str, step: int | None) -> str:
  directory = os.path.abspath(directory)
  if step is None:
    step = latest_step(directory)
    if step is None:
      raise FileNotFoundError(f'No committed checkpoint in {directory}.')
  path = step_dir(directory, step)
  if not os.path.isdir(path):
    raise FileNotFoundError(f'No checkpoint for step {step} in {directory}; committed '
                            f'steps: {committed_steps(directory)}.')
  if not has_commit(path):
    raise FileNotFoundError(f'Checkpoint {path} is incomplete (no {COMMIT} marker: its '
                            'save never finished); restore an earlier step.')
  return path


def read_metadata(directory: str, step: int | None = None) -> dict[str, Any]:
  """The caller's metadata of a committed checkpoint (default: the latest)."""
  return chunk_store.read_info(committed_dir(directory, step))['metadata']


def check_fresh_start(directory: str, workdir: str) -> None:
  """Before a run in `workdir` starts from step 0 because `directory` has no committed step.

  Refuses a directory holding only corrupt checkpoints (restore_latest_good set
  them aside; starting over would silently replace the run), and warns about
  committed steps in `workdir` itself, one level above where train.py reads
  them (a checkpoint converted or copied to the wrong place).
  """
  if any(n.startswith('corrupt.step_') for n in os.listdir(directory)):
    raise errors.ConfigError(f'{directory} holds only corrupt checkpoints (corrupt.step_*); '
                             'restore a good copy there, or remove them to start afresh.')
  misplaced = committed_steps(workdir)
  if misplaced:
    message = (f'{workdir} holds checkpoint steps {misplaced} directly, but train.py reads '
               f'{directory}; this run starts from step 0. To continue from them, move the '
               f'step_* directories into {directory} (convert.py --to=WORKDIR writes there).')
    logging.warning(message)
    print(f'WARNING: {message}', file=sys.stderr, flush=True)
