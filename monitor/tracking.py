"""Weights & Biases for a run, off the training thread (train.wandb.*; docs/monitoring.md).

    tracker = tracking.Tracker.for_run(cfg, workdir)  # a no-op unless train.wandb.project
    writer = metrics.MetricWriter(workdir, start, tracker=tracker)  # each record goes to W&B too
    tracker.close(exit_code)

What goes to W&B: every metrics.jsonl record, under the same names and step
(MetricWriter.write hands each one over), the full config and the code
version (metrics.code_version) as the run's config. Only process 0 logs, as
only it writes metrics.jsonl. Install it with `pip install '.[wandb]'`.

Resuming: the run's W&B id is kept in <workdir>/wandb_run_id (store/storage.py, so
a bucket workdir keeps it too) and passed with resume='allow', so a resumed
run continues the same W&B run. W&B's service buffers what it logs (its local
file is written in 32 KiB blocks) and dies with a killed process, so only a
W&B run that finished holds all it was given. A finished run's last step goes
into <workdir>/wandb_finished_step (with the run id); a resume at step S logs
again, from metrics.jsonl, every record after that step up to S (replay, via
metrics.MetricWriter), so W&B holds every record up to a committed checkpoint
whatever killed the process. W&B keeps the first value it got for a step and
ignores a later one (a step below its latest); a resume is bit-exact, so the
two held the same values.

Never in the way of training: wandb is imported, wandb.init runs (bounded by
train.wandb.init_timeout) and every record is logged in a background thread,
fed through a bounded queue. A full queue drops records (counted, reported at
the end); a failed init or log warns once and the run goes on; close() waits
at most FINISH_TIMEOUT seconds for W&B to finish. Nothing here raises into
the loop. Local files go to <workdir>/wandb (WANDB_DIR/wandb if set; a bucket
workdir's to <storage.local_cache_dir(workdir, '')>/wandb on process 0's host),
so an offline run can be synced later with `wandb sync`.

On when: train.wandb.project, else $WANDB_PROJECT (as W&B reads it). $WANDB_MODE
without either turns nothing on, and the run says so.

Comet is not wired in; docs/monitoring.md says how to add it beside W&B.
"""

import importlib.util
import os
import queue
import threading
import time
from typing import Any
import uuid

from absl import logging
import jax
import ml_collections

from monitor import health
from monitor import metrics
from store import storage

RUN_ID_FILE = 'wandb_run_id'  # <workdir>/wandb_run_id: the W&B run a resume continues
FINISHED_FILE = 'wandb_finished_step'  # '<run id> <step>': W&B holds every record to step
QUEUE_SIZE = 10_000  # records waiting for W&B; past it they are dropped (and counted)
FINISH_TIMEOUT = 60.0  # seconds close() waits for wandb.finish (and an init still running)
MODES = ('', 'online', 'offline', 'disabled')  # '' = WANDB_MODE, else W&B's default (online)
_STOP = object()
_REPLAY = object()  # a queue item (_REPLAY, start): log metrics.jsonl's records again


def check_config(cfg_train: ml_collections.ConfigDict) -> None:
  """train.wandb's rules; raises ValueError naming the field and the fix."""
  w = cfg_train.wandb
  if w.mode not in MODES:
    raise ValueError(f'train.wandb.mode={w.mode!r} must be one of {MODES[1:]} or \'\' '
                     '(WANDB_MODE, else online); set --config.train.wandb.mode.')
  if not w.init_timeout > 0:
    raise ValueError(f'train.wandb.init_timeout={w.init_timeout!r} must be a number of seconds '
                     '> 0; set --config.train.wandb.init_timeout.')
  if w.project and '/' in w.project:
    raise ValueError(f'train.wandb.project={w.project!r} holds a "/"; put the team in '
                     '--config.train.wandb.entity and the project name alone in .project.')
  if not w.project and '/' in os.environ.get('WANDB_PROJECT', ''):
    raise ValueError(f"WANDB_PROJECT={os.environ['WANDB_PROJECT']!r} holds a \"/\"; put the "
                     'team in WANDB_ENTITY (or --config.train.wandb.entity) and the project '
                     'name alone in WANDB_PROJECT.')


def project(cfg_train: ml_collections.ConfigDict) -> str:
  """The W&B project this run logs to: train.wandb.project, else $WANDB_PROJECT; '' = off."""
  return cfg_train.wandb.project or os.environ.get('WANDB_PROJECT', '')


def run_id(workdir: str) -> str:
  """The W&B run id of this workdir: read from <workdir>/wandb_run_id, else made and saved."""
  path = storage.join(workdir, RUN_ID_FILE)
  saved = (storage.read_text(path) or '').strip()
  if saved:
    return saved
  new = uuid.uuid4().hex[:16]
  storage.write_atomic(path, new + '\n')
  return new


def finished_step(workdir: str, run: str) -> int:
  """The last step W&B run `run` of this workdir finished with (0: none): it holds every
  record up to that step. A marker left by another run id (wandb_run_id deleted) counts 0."""
  try:
    saved = (storage.read_text(storage.join(workdir, FINISHED_FILE)) or '').split()
    return int(saved[1]) if len(saved) == 2 and saved[0] == run else 0
  except (ValueError, storage.StorageError):
    return 0


class Tracker:
  """Hands metric records to W&B from a background thread; every method returns at once.

  `init` (the keyword arguments of wandb.init) None: a tracker that does nothing.
  """

  def __init__(self, init: dict[str, Any] | None = None, queue_size: int = QUEUE_SIZE,
               workdir: str | None = None):
    self.enabled = init is not None
    self.dropped = 0  # records not logged: the queue was full, or W&B was not running
    self.failed = ''  # why W&B stopped logging, once it did
    self.run_id = init and init.get('id')
    self.workdir = workdir  # where metrics.jsonl and the finished-step marker live
    self._local_dir = (init or {}).get('dir') or ''  # wandb's files: <dir>/wandb
    self.replayed = 0  # records logged again from metrics.jsonl at a resume
    if not self.enabled:
      return
    self._resumed = False
    self._logged = 0  # the highest step W&B was handed
    self._gap: int | None = None  # the first step with a record W&B did not get
    self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
    self._closing = threading.Event()
    self._exit_code = 0
    self._warned = False
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._work, args=(init,), name='wandb-tracker',
                                    daemon=True)
    self._thread.start()

  @classmethod
  def for_run(cls, cfg: ml_collections.ConfigDict, workdir: str) -> 'Tracker':
    """The run's tracker: W&B when train.wandb.project is set and this is process 0."""
    w, name = cfg.train.wandb, project(cfg.train)
    if jax.process_index() != 0:
      return cls(None)
    if not name:
      mode = os.environ.get('WANDB_MODE', '')
      if mode and mode != 'disabled':
        health.warn(f'WARNING: WANDB_MODE={mode} is set but no W&B project is: the run is not '
                    'logged to W&B. Set --config.train.wandb.project=NAME (or WANDB_PROJECT).')
      return cls(None)
    if importlib.util.find_spec('wandb') is None:
      health.warn(f"WARNING: the W&B project is {name!r} but wandb is not installed (pip "
                  "install '.[wandb]'); the run is not logged to W&B. metrics.jsonl has "
                  'every record, and TensorBoard too.')
      return cls(None)
    # W&B puts its files in <dir>/wandb/: <workdir>/wandb/ for a local workdir, the same
    # layout under a local cache folder for a bucket's (wandb writes local files only).
    local = os.environ.get('WANDB_DIR') or storage.local_cache_dir(workdir, '')
    try:
      os.makedirs(local, exist_ok=True)
      saved_id = run_id(workdir)
    except Exception as e:  # pylint: disable=broad-except  # W&B never stops a run
      logging.warning('W&B is off for this run: its run id could not be read or saved in %s '
                      '(%s).', workdir, e)
      return cls(None)
    init = dict(
        project=name, entity=w.entity or None, group=w.group or None,
        name=w.run_name or storage.basename(workdir.rstrip('/')) or None,
        tags=list(w.tags) or None, mode=w.mode or None, id=saved_id, resume='allow',
        dir=local, config={**cfg.to_dict(), 'code_version': metrics.code_version(),
                           'workdir': workdir},
        settings=dict(init_timeout=float(w.init_timeout), finish_timeout=FINISH_TIMEOUT,
                      console='off', silent=True))
    logging.info('Logging to W&B project %r, run id %s (local files in %s).', name,
                 init['id'], os.path.join(local, 'wandb'))
    return cls(init, workdir=workdir)

  def resume(self, start: int) -> None:
    """Called once the run knows it starts at step `start` (its metrics.jsonl then holds
    exactly the records up to it): W&B gets again, before anything newer, every record
    after the step the W&B run last finished with. Only the first call counts (a rollback
    restarts the metric writer, not the W&B run)."""
    if not self.enabled or self._resumed:
      return
    self._resumed = True
    if start > 0 and self.workdir is not None:
      self._queue.put((_REPLAY, start))  # the queue is empty: nothing was logged yet

  def log(self, step: int, record: dict[str, Any]) -> None:
    """Queues one record for W&B; drops it (counted) when the queue is full."""
    if not self.enabled:
      return
    try:
      self._queue.put_nowait((step, dict(record)))
    except queue.Full:
      self.dropped += 1
      self._gap = step if self._gap is None else min(self._gap, step)
      self._warn(f'W&B is behind by {self._queue.maxsize} records; dropping records '
                 '(metrics.jsonl keeps them all)')

  def close(self, exit_code: int = 0, timeout: float = FINISH_TIMEOUT) -> None:
    """Logs what is queued, finishes the W&B run; waits at most `timeout` seconds."""
    if not self.enabled or self._closing.is_set():
      return
    self._exit_code = exit_code
    self._closing.set()
    self._thread.join(timeout)
    if self._thread.is_alive():
      logging.warning('W&B did not finish within %.0f s; leaving it. The run\'s local files '
                      'can be uploaded later with `wandb sync`.', timeout)
    else:
      self._copy_to_workdir()
    if self.dropped:
      logging.warning('%d metric records did not reach W&B%s; metrics.jsonl has them all.',
                      self.dropped, f' ({self.failed})' if self.failed else '')

  def _copy_to_workdir(self) -> None:
    """A bucket workdir's W&B files (kept on this host: wandb writes local files only)
    copied to <workdir>/wandb, so `wandb sync` works from any machine after a download."""
    local = os.path.join(self._local_dir, 'wandb')
    target = storage.join(self.workdir, 'wandb')
    if storage.identity(local) == storage.identity(target) or not os.path.isdir(local):
      return
    try:
      storage.upload_tree(local, target)
      logging.info('W&B files copied to %s.', target)
    except Exception as e:  # pylint: disable=broad-except  # W&B never stops a run
      logging.warning('W&B files stay in %s: copying them to %s failed (%s).', local, target, e)

  # --- The background thread ------------------------------------------------------------

  def _warn(self, message: str) -> None:
    with self._lock:
      if self._warned:
        return
      self._warned = True
    health.warn(f"WARNING: {' '.join(message.split())}. Training goes on.")  # once, one line

  def _fail(self, why: str) -> None:
    self.failed = self.failed or why
    self._warn(why)

  def _next(self) -> Any:
    """The next queued item; _STOP once close() was called and the queue is empty."""
    while True:
      try:
        return self._queue.get(timeout=0.2)
      except queue.Empty:
        if self._closing.is_set():
          return _STOP

  def _work(self, init: dict[str, Any]) -> None:
    run = None
    try:
      import wandb  # pylint: disable=import-outside-toplevel  # an optional extra, ~1 s to import
      start = time.perf_counter()
      run = wandb.init(**{**init, 'settings': wandb.Settings(**init['settings'])})
      logging.info('W&B run %s started in %.1f s.', run.id, time.perf_counter() - start)
    except BaseException as e:  # pylint: disable=broad-except  # never into the loop
      self._fail(f'W&B is not logging this run: wandb.init failed ({type(e).__name__}: '
                 f'{str(e)[:300]})')
    while (item := self._next()) is not _STOP:
      step, record = item
      if step is _REPLAY:
        self._replay(run, record)
      elif run is None:
        self._missed(step)
      else:
        self._log(run, step, record)
    if run is not None:
      try:
        run.finish(exit_code=self._exit_code)
      except BaseException as e:  # pylint: disable=broad-except
        self._fail(f'wandb.finish failed ({type(e).__name__}: {str(e)[:300]})')
        return
      self._mark_finished()

  def _missed(self, step: int) -> None:
    self.dropped += 1
    self._gap = step if self._gap is None else min(self._gap, step)

  def _log(self, run: Any, step: int, record: dict[str, Any]) -> None:
    try:
      run.log(record, step=step)
      self._logged = max(self._logged, step)
    except BaseException as e:  # pylint: disable=broad-except
      self._missed(step)
      self._fail(f'W&B failed to log step {step} ({type(e).__name__}: {str(e)[:300]})')

  def _replay(self, run: Any, start: int) -> None:
    """Logs again metrics.jsonl's records after the W&B run's finished step, up to `start`."""
    try:
      done = finished_step(self.workdir, self.run_id)
      records = [r for r in metrics.read_records(self.workdir) if done < r['step'] <= start]
    except Exception as e:  # pylint: disable=broad-except
      self._gap = 1  # unknown: W&B may miss records from the start
      self._fail(f'metrics.jsonl could not be read to log its records to W&B again ({e})')
      return
    for record in records:
      step = record.pop('step')
      if run is None:
        self._missed(step)
      else:
        self._log(run, step, record)
        self.replayed += 1
    if records:
      logging.info('W&B: logged %d records of steps %d..%d again from metrics.jsonl.',
                   len(records), done + 1, start)

  def _mark_finished(self) -> None:
    """After a clean finish: W&B holds every record it was handed up to the first gap."""
    through = self._logged if self._gap is None else min(self._logged, self._gap - 1)
    if self.workdir is None or through <= finished_step(self.workdir, self.run_id):
      return
    try:
      storage.write_atomic(storage.join(self.workdir, FINISHED_FILE),
                           f'{self.run_id} {through}\n')
    except Exception as e:  # pylint: disable=broad-except  # the next resume logs more again
      logging.warning('W&B finished, but %s could not be written (%s).', FINISHED_FILE, e)
