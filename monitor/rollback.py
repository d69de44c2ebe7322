"""Automatic rollback: a diverging run restores its last healthy checkpoint and skips the spike.

When the divergence guard (health.DivergenceGuard) trips at step S and
train.rollback_attempts allows another attempt, the run does not stop: it

  1. waits for the in-flight save, takes R = the newest healthy checkpoint,
     and decides a window of global batches to skip: those steps R+1..S read,
     plus train.rollback_margin batches after them;
  2. appends that decision to <workdir>/rollbacks.jsonl, replacing the file
     whole and durably (storage.write_atomic: a rename on a filesystem, one
     atomic object in a bucket); the log is the source of truth: everything
     after is redone from it;
  3. renames the step_N directories newer than R to rolledback.step_N.<attempt>
     (step_dirs.set_aside; step_dirs' listing ignores that name, so no resume,
     retention or committed_steps sees them again), keeping those of the newest
     train.keep_rolledback attempts that set any aside; with keep_rolledback=0
     it deletes them instead (in a bucket a set-aside is a copy of the state);
  4. restores R and continues with the window skipped, and the LR scaled by
     train.rollback_lr_factor for train.rollback_lr_steps steps.

A SIGKILL anywhere in 1-4 and a rerun of the same command ends bit-identical
to the uninterrupted recovery: before 2 the rerun resumes and trips again at
the same step; after 2, `Recovery` (built before the resume) redoes 3 for
every logged attempt (a checkpoint is stale when it is newer than an
attempt's restored step and its metadata knows fewer attempts), and the
resume then restores R with the logged window skipped, as 4 does.

The skipped windows are a run's data state: train.skip_batches (windows a
run is told to skip from its start, in the same form) plus the log's. The
Loader maps optimizer steps to global batches past them (data.Skips), and a
window's LR factor applies to the steps that first read after it, so a run
told to skip a window from the start computes what the recovery computed.
Attempts are bounded per run: once the log holds train.rollback_attempts
entries the next trip stops the run as before (health.stop_diverged, exit 4),
naming the skipped windows. docs/rollback.md has the whole story.
"""

import json
import re
import time
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import ml_collections

import checkpoint
import data
from monitor import health
from monitor import metrics
from store import step_dirs
from store import storage

LOG = 'rollbacks.jsonl'
ASIDE_RE = re.compile(r'^rolledback\.step_(\d+)\.(\d+)$')


def _complete_lines(workdir: str) -> list[str]:
  """The log's lines that end in a newline. A last line cut short (by a kill, in logs an
  older version appended to) is not an entry: it was never written whole, so nothing
  acted on it."""
  text = storage.read_text(storage.join(workdir, LOG)) or ''
  return text.splitlines(keepends=True)[:text.count('\n')]


def read_log(workdir: str) -> list[dict[str, Any]]:
  """The rollbacks.jsonl entries, in order."""
  return [json.loads(line) for line in _complete_lines(workdir)]


def _append_durable(workdir: str, entry: dict[str, Any]) -> None:
  """Adds one line: the whole log rewritten atomically and durably before anything acts
  on it (a few lines per run; a bucket has no append)."""
  lines = _complete_lines(workdir) + [json.dumps(entry) + '\n']
  storage.write_atomic(storage.join(workdir, LOG), ''.join(lines), fsync=True)


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def phase_done(phase: str, attempt: int) -> None:
  """Logs each phase of a recovery. Tests wrap it to SIGKILL the trainer at a phase."""
  logging.info('Rollback %d: %s.', attempt, phase)


def config_windows(cfg_train: ml_collections.ConfigDict) -> list[tuple[int, int, float, int]]:
  """train.skip_batches as (start, stop, lr_factor, lr_steps) windows."""
  out = []
  for w in cfg_train.skip_batches:
    start, stop, factor, steps = (*w, 1.0, 0) if len(w) == 2 else w
    out.append((int(start), int(stop), float(factor), int(steps)))
  return out


def run_skips(cfg_train: ml_collections.ConfigDict, workdir: str = '') -> data.Skips:
  """The global batches a run skips: train.skip_batches plus `workdir`'s logged rollbacks."""
  logged = [e['skip'] for e in read_log(workdir)] if workdir else []
  return data.Skips([w[:2] for w in config_windows(cfg_train)] + logged)


class Recovery:
  """A run's skipped windows and rollbacks: what the loop asks of it each step and at a trip.

  Built before the resume: it sets aside checkpoints a killed recovery left
  behind (see the module docstring), so the resume restores the right one.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, workdir: str,
               ckpt: checkpoint.Checkpointer):
    self.cfg, self.workdir, self.ckpt = cfg, workdir, ckpt
    self.entries = read_log(workdir)
    if jax.process_index() == 0:
      for entry in self.entries:
        self._set_aside(entry)
    _barrier('rollback-tidy')
    self._update()

  def _update(self) -> None:
    logged = [(*e['skip'], e['lr_factor'], e['lr_steps']) for e in self.entries]
    self.windows = config_windows(self.cfg.train) + logged
    self.skips = data.Skips(self.windows)
    # A window's LR span: the steps that first read after it (R+1.. for a rollback to R).
    self.lr_spans = [(self.skips.count_before(start), steps, factor)
                     for start, _, factor, steps in self.windows if steps and factor != 1.0]

  def lr_factor(self, step: int) -> float:
    """The LR factor of optimizer step `step` (1-based): the product of the spans covering it."""
    factor = 1.0
    for first, steps, f in self.lr_spans:
      if first < step <= first + steps:
        factor *= f
    return factor

  def counters(self, step: int) -> dict[str, float]:
    """OLMo-core-style counters for step `step`'s record."""
    return {'train/rollbacks': float(len(self.entries)),
            'data/skipped batches': float(self.skips.skipped_before(self.skips.nth(step - 1)))}

  def meta(self) -> dict[str, Any]:
    """What a checkpoint records of the recovery: the log entries known when it was saved."""
    return {'rollbacks': list(self.entries)} if self.entries else {}

  def _set_aside(self, entry: dict[str, Any]) -> None:
    """Takes the step dirs newer than the entry's restored step that predate the entry out
    of the listing, then keeps the set-aside states of the newest keep_rolledback attempts
    that set any aside (an attempt that found nothing to set aside does not count).

    keep_rolledback=0 deletes them where they are (COMMIT first: step_dirs.delete_step):
    in a bucket setting a state aside copies every object of it, only to delete it.
    """
    directory, attempt = self.ckpt.directory, entry['attempt']
    keep = self.cfg.train.keep_rolledback
    for name in storage.listdir(directory):
      m = step_dirs.STEP_RE.match(name)
      if not m or int(m.group(1)) <= entry['restored_step']:
        continue
      try:
        known = len(checkpoint.read_metadata(directory, int(m.group(1))).get('rollbacks', []))
      except (checkpoint.CorruptCheckpointError, FileNotFoundError):
        known = 0  # unreadable or uncommitted: never a state saved after this attempt
      if known >= attempt:
        continue
      if keep:
        step_dirs.set_aside(directory, name, f'rolledback.{name}.{attempt}')
      else:
        logging.info('Deleting %s (rolled back; train.keep_rolledback=0).', name)
        step_dirs.delete_step(directory, int(m.group(1)))
    aside: dict[int, list[str]] = {}  # attempt -> its set-aside states
    for name in storage.listdir(directory):
      m = ASIDE_RE.match(name)
      if m:
        aside.setdefault(int(m.group(2)), []).append(name)
    attempts = sorted(aside)
    for old in attempts[:len(attempts) - keep]:
      for name in aside[old]:
        logging.info('Deleting %s (train.keep_rolledback=%d).', name, keep)
        storage.delete_tree(storage.join(directory, name),
                            first=(step_dirs.COMMIT, checkpoint.METADATA))

  def windows_text(self) -> str:
    lines = [f'[{e["skip"][0]}, {e["skip"][1]}) (attempt {e["attempt"]}: trip at step '
             f'{e["trigger_step"]}, restored step {e["restored_step"]})' for e in self.entries]
    return '; '.join(lines) or 'none'

  def inspect_command(self, batch: int) -> str:
    return (f'python scripts/inspect_batch.py --config=configs/from_checkpoint.py:'
            f'{self.ckpt.directory} --workdir={self.workdir} --batch={batch}')

  def roll_back(self, reason: str, step: int, state: Any, target: Any, meta: dict[str, Any],
                writer: metrics.MetricWriter, trip_step: int | None = None
                ) -> tuple[Any, int, dict[str, Any]]:
    """(restored state, its step, its loader state), or exits EXIT_DIVERGED if it may not."""
    t = self.cfg.train
    self.ckpt.wait()  # an in-flight healthy save may be the one to restore
    restored = self.ckpt.latest_healthy_step()
    attempt = len(self.entries) + 1
    if attempt > t.rollback_attempts or restored is None:
      note = ''
      if attempt > t.rollback_attempts > 0:
        note = (f' Rollback gave up: all {t.rollback_attempts} attempts of '
                'train.rollback_attempts were made')
      elif t.rollback_attempts:
        note = ' Rollback gave up: there is no healthy checkpoint to restore'
      if self.entries:
        note += (f'; skipped windows of global batches: {self.windows_text()} (see '
                 f'{storage.join(self.workdir, LOG)}; show one with '
                 f'{self.inspect_command(self.entries[-1]["skip"][0])})')
      health.stop_diverged(reason, step, self.cfg, self.ckpt, state, meta, writer,
                           note=note + '.' if note else '')
    phase_done('decided', attempt)
    start = self.skips.nth(restored)
    stop = self.skips.nth(step - 1) + 1 + t.rollback_margin
    # trigger_step: the step the guard tripped at; the loop saw it at `step` (a log step),
    # and the window covers every batch read through `step`.
    entry = {'attempt': attempt, 'trigger_step': trip_step or step, 'detected_step': step,
             'reason': reason,
             'restored_step': restored, 'skip': [start, stop],
             'lr_factor': float(t.rollback_lr_factor), 'lr_steps': int(t.rollback_lr_steps),
             'time': time.time()}
    if jax.process_index() == 0:
      _append_durable(self.workdir, entry)
    _barrier(f'rollback-{attempt}-logged')
    self.entries.append(entry)
    self._update()
    phase_done('logged', attempt)
    if jax.process_index() == 0:
      self._set_aside(entry)
    _barrier(f'rollback-{attempt}-set-aside')
    phase_done('set aside', attempt)
    state, restored_meta = self.ckpt.restore(target, restored)
    phase_done('restored', attempt)
    lr = (f'; LR x{t.rollback_lr_factor:g} for {t.rollback_lr_steps} steps'
          if t.rollback_lr_steps and t.rollback_lr_factor != 1.0 else '')
    message = (f'ROLLBACK {attempt}/{t.rollback_attempts}: {reason}. Restored step {restored} '
               f'(the last healthy checkpoint) and skipping global batches [{start}, {stop}): '
               f'those steps {restored + 1}-{step} read, plus train.rollback_margin='
               f'{t.rollback_margin}{lr}. Logged in {storage.join(self.workdir, LOG)}; show a '
               f'skipped batch with {self.inspect_command(start)}.')
    health.warn(message)
    return state, restored, restored_meta['data']
