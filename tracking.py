"""Weights & Biases for a run, off the training thread (train.wandb.*; docs/monitoring.md).

    tracker = tracking.Tracker.for_run(cfg, workdir)  # a no-op unless train.wandb.project
    writer = metrics.MetricWriter(workdir, start, tracker=tracker)  # each record goes to W&B too
    tracker.close(exit_code)

What goes to W&B: every metrics.jsonl record, under the same names and step
(MetricWriter.write hands each one over), the full config and the code
version (metrics.code_version) as the run's config. Only process 0 logs, as
only it writes metrics.jsonl. Install it with `pip install '.[wandb]'`.

Resuming: the run's W&B id is kept in <workdir>/wandb_run_id (storage.py, so
a bucket workdir keeps it too) and passed with resume='allow', so a resumed
run continues the same W&B run. W&B keeps what the killed process logged past
the last checkpoint, and ignores the resumed run's re-logging of those steps
(a step below its latest); a resume is bit-exact, so they held the same values.

Never in the way of training: wandb is imported, wandb.init runs (bounded by
train.wandb.init_timeout) and every record is logged in a background thread,
fed through a bounded queue. A full queue drops records (counted, reported at
the end); a failed init or log warns once and the run goes on; close() waits
at most FINISH_TIMEOUT seconds for W&B to finish. Nothing here raises into
the loop. Local files go to <workdir>/wandb (WANDB_DIR wins; a bucket
workdir's go under storage.local_cache_dir), so an offline run can be synced
later with `wandb sync`.

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

import health
import metrics
import storage

RUN_ID_FILE = 'wandb_run_id'  # <workdir>/wandb_run_id: the W&B run a resume continues
QUEUE_SIZE = 10_000  # records waiting for W&B; past it they are dropped (and counted)
FINISH_TIMEOUT = 60.0  # seconds close() waits for wandb.finish (and an init still running)
MODES = ('', 'online', 'offline', 'disabled')  # '' = WANDB_MODE, else W&B's default (online)
_STOP = object()


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


def run_id(workdir: str) -> str:
  """The W&B run id of this workdir: read from <workdir>/wandb_run_id, else made and saved."""
  path = storage.join(workdir, RUN_ID_FILE)
  saved = (storage.read_text(path) or '').strip()
  if saved:
    return saved
  new = uuid.uuid4().hex[:16]
  storage.write_atomic(path, new + '\n')
  return new


class Tracker:
  """Hands metric records to W&B from a background thread; every method returns at once.

  `init` (the keyword arguments of wandb.init) None: a tracker that does nothing.
  """

  def __init__(self, init: dict[str, Any] | None = None, queue_size: int = QUEUE_SIZE):
    self.enabled = init is not None
    self.dropped = 0  # records not logged: the queue was full, or W&B was not running
    self.failed = ''  # why W&B stopped logging, once it did
    self.run_id = init and init.get('id')
    if not self.enabled:
      return
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
    w = cfg.train.wandb
    if not w.project or jax.process_index() != 0:
      return cls(None)
    if importlib.util.find_spec('wandb') is None:
      logging.warning("train.wandb.project=%r but wandb is not installed (pip install "
                      "'.[wandb]'); the run is not logged to W&B.", w.project)
      return cls(None)
    local = os.environ.get('WANDB_DIR') or (
        workdir if not storage.is_url(workdir) else storage.local_cache_dir(workdir, 'wandb'))
    try:
      os.makedirs(local, exist_ok=True)
      saved_id = run_id(workdir)
    except Exception as e:  # pylint: disable=broad-except  # W&B never stops a run
      logging.warning('W&B is off for this run: its run id could not be read or saved in %s '
                      '(%s).', workdir, e)
      return cls(None)
    init = dict(
        project=w.project, entity=w.entity or None, group=w.group or None,
        name=w.run_name or storage.basename(workdir.rstrip('/')) or None,
        tags=list(w.tags) or None, mode=w.mode or None, id=saved_id, resume='allow',
        dir=local, config={**cfg.to_dict(), 'code_version': metrics.code_version(),
                           'workdir': workdir},
        settings=dict(init_timeout=float(w.init_timeout), finish_timeout=FINISH_TIMEOUT,
                      console='off', silent=True))
    logging.info('Logging to W&B project %r, run id %s (local files in %s).', w.project,
                 init['id'], local)
    return cls(init)

  def log(self, step: int, record: dict[str, Any]) -> None:
    """Queues one record for W&B; drops it (counted) when the queue is full."""
    if not self.enabled:
      return
    try:
      self._queue.put_nowait((step, dict(record)))
    except queue.Full:
      self.dropped += 1
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
    if self.dropped:
      logging.warning('%d metric records did not reach W&B%s; metrics.jsonl has them all.',
                      self.dropped, f' ({self.failed})' if self.failed else '')

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
      if run is None:
        self.dropped += 1
        continue
      step, record = item
      try:
        run.log(record, step=step)
      except BaseException as e:  # pylint: disable=broad-except
        self.dropped += 1
        self._fail(f'W&B failed to log step {step} ({type(e).__name__}: {str(e)[:300]})')
    if run is not None:
      try:
        run.finish(exit_code=self._exit_code)
      except BaseException as e:  # pylint: disable=broad-except
        self._fail(f'wandb.finish failed ({type(e).__name__}: {str(e)[:300]})')
