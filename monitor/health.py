"""Run health: what watches a training run while it trains, and how it stops.

- The divergence guard judges each step (loss bound, skipped steps in a row)
  and whether the state is healthy enough for retention to protect;
  monitor/rollback.py restores the last healthy state and skips the spike's data
  while train.rollback_attempts allows; else `stop_diverged` saves the
  state as unhealthy and exits EXIT_DIVERGED.
- The data: instance ids seen twice in an epoch (a bitmap of N bits), and
  training CE falling away from held-out CE (memorization).
- Preemption: SIGTERM/SIGINT stop the loop after the current step, with a
  checkpoint, on every process at the same step; during start-up, or when the
  scheduler's grace cannot hold a save, at once (exit 3 either way).
- The heartbeat scripts/launch.py's stall watchdog reads, and its pause
  while the trainer compiles.
- `warn`: a warning in the log and once on stderr.
train.py calls them from its loop.
"""

import contextlib
import hashlib
import logging as std_logging
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn, Sequence

from absl import flags, logging
from absl.logging import converter
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

import checkpoint
import errors
from monitor import metrics
from store import storage
from tokens import token_files

# --- Divergence -------------------------------------------------------------------------


class DivergenceGuard:
  """Judges each step: has the run diverged, and is its state healthy?

  It trips at the first step whose CE loss exceeds train.max_loss, or at the
  train.max_consecutive_skips-th skipped step in a row. The skip rule alone
  cannot stop a divergence: it skips only non-finite values and > 6 sigma
  spikes, so a large finite LR keeps applying destructive updates whose
  losses soon fill the spike history; the loss bound catches those, and the
  skip count catches a run that only produces NaNs.

  A state is judged by the step after it: the loss of step s measures the
  params before step s's update, so the state saved at step N is healthy when
  step N+1, the first step computed from its params, neither tripped the
  guard nor was skipped (a skip means that loss or gradient was non-finite
  or a spike: evidence against those params). Judged by its own step's loss,
  a state holding a destructive update passed for healthy, and rollback
  restored it again and again. train.py saves each checkpoint pending
  (await_verdict) and records the verdicts() in its directory; `healthy`
  after observing step N+1 is that verdict. A state rollback restores is
  judged again by the new step after it, so one that only passed on other
  data is not restored twice.
  """

  def __init__(self, cfg_train: ml_collections.ConfigDict):
    self.max_loss, self.max_skips = cfg_train.max_loss, cfg_train.max_consecutive_skips
    self.skips = 0  # skipped steps in a row up to the last observed one
    self.reason: str | None = None  # why it tripped; None while it has not
    self.trip_step: int | None = None  # the step it tripped at (<= the step that saw it)
    self.pending: set[int] = set()  # saved steps whose verdict waits for the next step
    self.judged: list[tuple[int, bool]] = []  # (step, healthy) not yet taken by verdicts()

  def observe(self, step: int, record: dict[str, float]) -> None:
    if self.reason:
      return
    self.skips = self.skips + 1 if record['optim/step skipped'] else 0
    loss = record['train/CE loss']
    if loss > self.max_loss:  # False for NaN: a NaN step is skipped and counted instead
      self.trip_step = step
      self.reason = (f'the CE loss of step {step} is {loss:.4g}, above '
                     f'train.max_loss={self.max_loss:g}')
    elif self.skips >= self.max_skips:
      self.trip_step = step
      self.reason = (f'steps {step - self.skips + 1}-{step} were all skipped (non-finite or '
                     f'spiking loss or gradient norm; train.max_consecutive_skips='
                     f'{self.max_skips})')
    if step - 1 in self.pending:
      self.pending.discard(step - 1)
      self.judged.append((step - 1, self.healthy))

  def await_verdict(self, step: int) -> None:
    """The state of step `step` (saved, or restored) is judged when step+1 is observed."""
    self.pending.add(step)

  def verdicts(self) -> list[tuple[int, bool]]:
    """(step, healthy) of the pending states judged since the last call."""
    out, self.judged = self.judged, []
    return out

  @property
  def healthy(self) -> bool:
    """Not tripped, and the last observed step was not skipped: the verdict on the params
    that step measured, i.e. the state before it."""
    return self.reason is None and self.skips == 0


def stop_diverged(reason: str, step: int, cfg: ml_collections.ConfigDict,
                  ckpt: checkpoint.Checkpointer, state: Any, meta: dict[str, Any],
                  writer: metrics.MetricWriter, note: str = '') -> NoReturn:
  """Records why, saves the state as unhealthy, says what to do, exits EXIT_DIVERGED.

  `note` (monitor/rollback.py: why it did not roll back, the windows it skipped) ends the message.
  """
  writer.write(step, {'guard/diverged': 1.0, 'guard/reason': reason})
  ckpt.save(step, state, {**meta, 'diverged': reason}, healthy=False)
  ckpt.wait()
  healthy = ckpt.latest_healthy_step()
  back = (f'The last healthy checkpoint is step {healthy}: to resume from it, move the newer '
          f'step_* directories out of {ckpt.directory}, then rerun with the cause fixed'
          if healthy is not None else
          'No healthy checkpoint exists yet: start again in a new --workdir with the cause fixed')
  print(f'DIVERGED: {reason}. Stopped at step {step}; its state is saved for inspection as '
        f'checkpoint step {step}, marked unhealthy. {back} (e.g. a lower --config.opt.lr, now '
        f'{cfg.opt.lr:g}), or, if the run was in fact healthy, raise --config.train.max_loss '
        f'or --config.train.max_consecutive_skips.{note}', file=sys.stderr, flush=True)
  raise SystemExit(errors.EXIT_DIVERGED)


# --- The data: repeated instances, memorization ---------------------------------------------


def mark_seen(bitmap: np.ndarray, ids: np.ndarray) -> np.ndarray:
  """Sets the bits of `ids` in `bitmap` (uint8 [ceil(N / 8)]); returns the ids already set.

  An id repeated within `ids` counts once per repeat, like one seen before.
  Vectorized: a sort finds the repeats within `ids`, and the distinct ids of
  each byte sum to their OR (one add.reduceat), so a batch of millions of ids
  costs one sort. scripts/audit_data.py and RepeatTracker share it.
  """
  ids = np.sort(np.asarray(ids, np.int64).reshape(-1))
  if not ids.size:
    return ids
  if ids[0] < 0 or ids[-1] >= 8 * bitmap.size:
    raise IndexError(f'instance ids [{ids[0]}, {ids[-1]}] fall outside the {8 * bitmap.size}-bit '
                     'bitmap; it was sized for another dataset.')
  again = np.zeros(ids.size, bool)
  again[1:] = ids[1:] == ids[:-1]
  distinct = ids[~again]
  byte, bit = distinct >> 3, (1 << (distinct & 7)).astype(np.uint8)
  again[np.flatnonzero(~again)[(bitmap[byte] & bit) != 0]] = True
  starts = np.flatnonzero(np.diff(byte, prepend=-1))
  bitmap[byte[starts]] |= np.add.reduceat(bit, starts).astype(np.uint8)
  return ids[again]


def duplicate_files(paths: Sequence[str], sample: int = 1 << 20) -> dict[int, int]:
  """{j: i} for each file j that repeats an earlier file i (same real path, or same size and
  the same `sample` bytes at its start, middle and end: a byte-exact check would read every
  file, and token files that agree there are copies)."""
  seen: dict[Any, int] = {}
  out = {}
  for j, path in enumerate(paths):
    keys = [('path', storage.identity(path))]
    if token_files.memory_mapped(path):  # sampling every remote file's bytes at each start
      size = storage.size(path)            # would download gigabytes: the same URL twice only
      parts = [storage.read_range(path, offset, offset + sample)
               for offset in (0, max(0, size // 2 - sample // 2), max(0, size - sample))]
      keys.append(('content', size, hashlib.sha256(b''.join(parts)).digest()))
    first = next((seen[k] for k in keys if k in seen), None)
    if first is None:
      seen.update(dict.fromkeys(keys, j))
    else:
      out[j] = first
  return out


class RepeatTracker:
  """The `data/repeated instances` metric: instance ids already seen this epoch.

  One bit per instance of the dataset (N bits: 90 MB for the 724M instances
  of stage 1), cleared when the epoch changes. OLMo-core's order shows each
  instance once per epoch, so any nonzero count is a loader bug: the one the
  seed's run had, which repeated sequences and let the model memorize them.
  It counts the rows this process loads (all of them on one host).
  """

  def __init__(self, num_instances: int, aliases: Sequence[tuple[int, int, int]] = ()):
    """`aliases`: (start, stop, offset): ids in [start, stop) are instance id + offset's twins."""
    self.bitmap = np.zeros((num_instances + 7) // 8, np.uint8)
    self.aliases = tuple(aliases)
    self.epoch: int | None = None
    self.total = self.steps_with_repeats = 0  # repeats this epoch, and steps that had any

  @classmethod
  def for_dataset(cls, ds: Any) -> 'RepeatTracker':
    """A tracker for a data.Dataset that also counts a file listed twice as repeats.

    The instances of a file that duplicates an earlier one (same real path,
    or same size and same bytes at its start, middle and end) are counted as
    that file's instances, so reading both copies in an epoch shows up here.
    """
    aliases = []
    if not hasattr(ds, 'starts'):  # a packed dataset's instances do not map to files
      return cls(ds.num_instances)
    for j, i in duplicate_files([f.path for f in ds.files]).items():
      logging.warning('data: %s (mix entry %d) duplicates %s (entry %d); its %d instances repeat '
                      'that file\'s and count in data/repeated instances.', ds.files[j].path, j,
                      ds.files[i].path, i, int(ds.starts[j + 1] - ds.starts[j]))
      aliases.append((int(ds.starts[j]), int(ds.starts[j + 1]), int(ds.starts[i] - ds.starts[j])))
    return cls(ds.num_instances, aliases)

  @classmethod
  def for_run(cls, ds: Any, loader: Any) -> 'RepeatTracker':
    """for_dataset, with a resumed epoch's earlier batches (data.Loader `loader`) marked seen."""
    tracker = cls.for_dataset(ds)
    if loader.step:
      base = (loader.epoch - 1) * loader.batches_per_epoch  # skipped batches were never read
      tracker.replay(loader.epoch, (loader.ids_at(loader.epoch, s) for s in range(loader.step)
                                    if loader.skips.advance(base + s) == base + s))
    return tracker

  def observe(self, epoch: int, ids: np.ndarray) -> int:
    """Marks one step's ids; returns how many were already seen this epoch (and warns)."""
    if epoch != self.epoch:
      self.bitmap[:] = 0
      self.epoch, self.total, self.steps_with_repeats = epoch, 0, 0
    ids = np.array(ids, np.int64).reshape(-1)
    for start, stop, offset in self.aliases:
      ids[(ids >= start) & (ids < stop)] += offset
    repeated = mark_seen(self.bitmap, ids)
    self.total += repeated.size
    if repeated.size:
      self.steps_with_repeats += 1
      if self.steps_with_repeats & (self.steps_with_repeats - 1) == 0:  # 1st, 2nd, 4th, ...
        logging.warning('data/repeated instances: %d instance ids of this step (e.g. %s) were '
                        'already seen in epoch %d (%d repeats in %d steps so far). The loader '
                        'repeats data: the model will memorize it. Run scripts/audit_data.py '
                        'on this config.', repeated.size, repeated[:5].tolist(), epoch,
                        self.total, self.steps_with_repeats)
    return int(repeated.size)

  def replay(self, epoch: int, steps_ids) -> None:
    """Marks the ids of a resumed epoch's earlier steps (an iterable of arrays) as seen."""
    chunk: list[np.ndarray] = []
    for ids in steps_ids:
      chunk.append(ids)
      if len(chunk) == 1024:  # one vectorized mark per 1024 steps
        self.observe(epoch, np.concatenate(chunk))
        chunk = []
    self.observe(epoch, np.concatenate(chunk) if chunk else np.zeros(0, np.int64))


class MemorizationWatch:
  """Warns when training CE falls faster than held-out CE over several evaluations.

  The signature of memorization (the seed's run: training loss up to 0.22
  below Ai2's while held-out C4 loss stayed tied): the gap held-out minus
  train widens. At each evaluation the train CE is a least-squares line
  through the (step, CE) values logged since the previous evaluation, read at
  the evaluation's step: less noisy than one step's CE, and, unlike a mean, it
  does not lag a falling loss (a lag would read as a widening gap early in
  every run). The warning fires when the gap grew by more than `threshold`
  nats across the last `evals` evaluations, widening at each (fast
  memorization), or when the mean gap of the last `evals` evaluations is more
  than `threshold` above the mean of the first `evals` (a slow drift). Either
  widening must also exceed 4 standard errors of the train-CE estimates (from
  the line fits' residuals), so a small batch's jitter does not fire it. In a healthy first
  epoch the gap
  stays near constant: each train CE is measured before the update, on data
  the model has not seen, just as held-out CE is.
  """

  def __init__(self, threshold: float, evals: int):
    if not threshold > 0 or evals < 2:  # one line from train.py, EXIT_USAGE
      raise errors.ConfigError(
          'train.memorization_threshold must be > 0 and train.memorization_evals >= 2; got '
          f'{threshold} and {evals}. Set --config.train.memorization_*.')
    self.threshold, self.evals = threshold, evals
    self.train: list[tuple[int, float]] = []  # (step, train CE) logged since the last eval
    self.gaps: list[tuple[int, float, float, float]] = []  # (step, train, held-out, gap)
    self.noise: list[float] = []  # standard error of each train CE estimate

  def observe_train(self, step: int, ce: float) -> None:
    if np.isfinite(ce):
      self.train.append((step, ce))

  def observe_eval(self, step: int, heldout_ce: float) -> dict[str, str]:
    """Records one evaluation; returns {'guard/memorization': text} when the warning fires.

    The warning also goes to the log and stderr: it is never silent. The
    history lives in memory: after a resume it needs `evals` new evaluations.
    """
    if not self.train or not np.isfinite(heldout_ce):
      return {}
    x, ces = np.array(self.train, np.float64).T
    x -= step
    self.train = []
    train, noise = float(ces[-1]), 0.0
    if x.size > 2 and np.ptp(x) > 0:  # the trend line at this step, and its standard error
      (slope, train), residual = np.polyfit(x, ces, 1, full=True)[:2]
      sxx = float(((x - x.mean())**2).sum())
      sigma2 = float(residual[0]) / (x.size - 2) if residual.size else 0.0
      noise = (sigma2 * (1 / x.size + x.mean()**2 / sxx))**0.5
    self.gaps.append((step, float(train), heldout_ce, heldout_ce - float(train)))
    self.noise.append(noise)
    if len(self.gaps) < self.evals:
      return {}
    k = self.evals
    last = self.gaps[-k:]
    gaps = np.array([g for *_, g in self.gaps])
    means = np.convolve(gaps, np.ones(k) / k, 'valid')  # mean gap of every k evaluations
    # A widening must also stand out of the train-CE noise (4 standard errors), so a small
    # batch's jitter does not read as memorization; at 7B scale the noise is far below it.
    pooled = float(np.mean(np.square(self.noise)))  # one estimate per eval is itself noisy
    fast_bar = max(self.threshold, 4 * (2 * pooled)**0.5)
    slow_bar = max(self.threshold, 4 * (2 * pooled / k)**0.5)
    rising = all(b[3] > a[3] for a, b in zip(last, last[1:]))
    if rising and last[-1][3] - last[0][3] > fast_bar:  # fast: widening at every eval
      (s0, t0, h0, g0), (s1, t1, h1, g1) = last[0], last[-1]
    elif means[-1] - means[0] > slow_bar:  # slow: the k-eval mean drifted up
      (s0, t0, h0, _), (s1, t1, h1, _) = self.gaps[0], self.gaps[-1]
      g0, g1 = means[0], means[-1]
    else:
      return {}
    warning = (f'possible memorization: from step {s0} to {s1} training CE fell {t0 - t1:.3f} '
               f'(to {t1:.3f}) but held-out CE {h0 - h1:.3f} (to {h1:.3f}); the gap widened by '
               f'{g1 - g0:.3f} nats > train.memorization_threshold={self.threshold:g}. Check '
               'data/repeated instances and run scripts/audit_data.py on this config.')
    warn(f'WARNING: {warning}')
    return {'guard/memorization': warning}


# --- Stopping: preemption, the launcher's heartbeat -------------------------------------


def warning_reaches_stderr() -> bool:
  """Whether a logging.warning already shows on stderr: absl's handler writing there (its
  default, before flags are parsed, with --logtostderr or --alsologtostderr, or at
  --stderrthreshold), or a plain stream handler on stderr (Python's last resort when
  nothing is configured)."""
  handlers, logger = [], std_logging.getLogger('absl')
  while logger:
    handlers += logger.handlers
    logger = logger.parent if logger.propagate else None
  if not handlers:
    return std_logging.WARNING >= std_logging.lastResort.level
  absl_handler = logging.get_absl_handler()
  for handler in handlers:
    if handler is absl_handler:
      if not flags.FLAGS.is_parsed() or flags.FLAGS['logtostderr'].value:
        return True
      threshold = converter.string_to_standard(flags.FLAGS['stderrthreshold'].value)
      if (handler.python_handler.stream in (sys.stderr, sys.__stderr__)
          or flags.FLAGS['alsologtostderr'].value or std_logging.WARNING >= threshold):
        return True
    elif (type(handler) is std_logging.StreamHandler  # pylint: disable=unidiomatic-typecheck
          and handler.stream in (sys.stderr, sys.__stderr__)
          and handler.level <= std_logging.WARNING):
      return True
  return False


def warn(message: str) -> None:
  """Logs `message` as a warning and shows it on stderr exactly once.

  absl writes a warning to stderr itself unless its log goes to a file; a print
  beside the log call then showed every such message twice (Ctrl-C's did).
  """
  logging.warning('%s', message)
  if not warning_reaches_stderr():
    print(message, file=sys.stderr, flush=True)



STOP_GRACE_ENV = 'OLMO_STOP_GRACE_SECONDS'  # seconds a SIGTERM leaves before the SIGKILL
STOP_MARGIN_S = 3.0  # exit this long before the grace ends: exit 3 must beat the SIGKILL
UNWIND_S = 5.0  # at start-up, the main thread's time to unwind (the lock released) first


def stop_grace_seconds(text: str | None = None, name: str = STOP_GRACE_ENV) -> float | None:
  """The time a SIGTERM leaves this process: `text` (a flag's value) or
  $OLMO_STOP_GRACE_SECONDS; None: unbounded."""
  text = (os.environ.get(STOP_GRACE_ENV, '') if text is None else str(text)).strip()
  if not text:
    return None
  try:
    value = float(text)
  except ValueError:
    value = float('nan')
  if not value > 0 or value == float('inf'):
    raise errors.ConfigError(
        f'{name}={text!r} is not a positive number of seconds: set it to the time '
        'the scheduler leaves between SIGTERM and SIGKILL (the pod\'s '
        'terminationGracePeriodSeconds; about 15 on a GKE Spot node), or unset it.')
  return value


class Preemption:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, checkpoints and exits 3.

  The step in flight cannot be cut short (a signal reaches Python only
  between XLA calls, and the first step includes its compile), so a second
  Ctrl-C stops the process at once, without a checkpoint: the first one puts
  SIGINT's default action back. close() puts the previous handlers back
  (train() may run inside a larger program).

  train.py's command line installs one first thing (`install`), for two reasons:
  - A container's trainer is PID 1, and the kernel drops any signal PID 1 has no
    handler for: a slice deleted during start-up would wait out its whole grace
    period. Until the loop begins (`for_loop`), a signal stops the process at once,
    exit 3: nothing new could be saved, and the run resumes from its last checkpoint.
  - The scheduler's grace ($OLMO_STOP_GRACE_SECONDS) may not hold a checkpoint (a
    GKE Spot node gives about 15 s). When the time left after SIGTERM is shorter than
    the longest save this run has timed, the process exits 3 at once, naming the
    committed step the run resumes from; otherwise it saves, and exits 3 before the
    grace ends in any case, so the scheduler sees a preemption, never a SIGKILL (137).
  Both need a signal to act while the main thread is inside a long XLA call, where no
  Python handler runs, so a watcher thread reads each signal from a wakeup fd.
  """

  _installed: 'Preemption | None' = None

  def __init__(self, grace_seconds: float | None = None, *, owns_process: bool = False):
    self.requested = False
    self.grace = grace_seconds
    self._owns_process = owns_process  # may end the process itself (os._exit)
    self._ckpt, self._start = None, None  # set by for_loop(): the loop has begun
    self._exiting = threading.Lock()
    self._previous = {sig: signal.signal(sig, self._handle)
                      for sig in (signal.SIGTERM, signal.SIGINT)}
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    self._previous_fd = signal.set_wakeup_fd(self._write)
    self._watcher = threading.Thread(target=self._watch, name='preemption-watch', daemon=True)
    self._watcher.start()

  @classmethod
  def install(cls) -> 'Preemption':
    """The command line's handler, before anything slow (train.run)."""
    cls._installed = cls(stop_grace_seconds(), owns_process=True)
    return cls._installed

  @classmethod
  def set_grace(cls, text: str) -> None:
    """train.py's --stop_grace_seconds, over the variable, once the flags are parsed."""
    if cls._installed is not None:
      cls._installed.grace = stop_grace_seconds(text, '--stop_grace_seconds')

  @classmethod
  def for_loop(cls, ckpt: Any, start: int) -> 'Preemption':
    """The installed handler, or a new one (train() as a library), told the loop began."""
    preempt, cls._installed = cls._installed or cls(), None
    preempt._ckpt, preempt._start = ckpt, start
    return preempt

  def _handle(self, signum, frame):
    del frame
    if self._ckpt is None and self._owns_process:
      warn(f'Signal {signum} during start-up, before the first step: stopping now (exit 3); '
           'nothing new to save, the run resumes from its last committed checkpoint.')
      raise SystemExit(errors.EXIT_PREEMPTED)
    again = ' (Ctrl-C again stops at once, without one)' if signum == signal.SIGINT else ''
    warn(f'Signal {signum}: stopping after the current step with a checkpoint{again}.')
    if signum == signal.SIGINT:
      signal.signal(signal.SIGINT, signal.SIG_DFL)
    self.requested = True

  def _watch(self) -> None:
    timing = False
    while data := os.read(self._read, 64):  # b'': close() closed the other end
      signals = [s for s in data if s in (signal.SIGTERM, signal.SIGINT)]
      if signals and self._owns_process and not timing:
        timing = True  # the first signal starts the clock; later ones change nothing
        threading.Thread(target=self._deadline, args=(signals[0], time.monotonic()),
                         name='preemption-deadline', daemon=True).start()
    os.close(self._read)

  def _deadline(self, signum: int, at: float) -> None:
    """Ends the process with exit 3 when waiting for the main thread would outlast the grace."""
    if self._ckpt is None:  # start-up: the handler's SystemExit unwinds, unless stuck
      time.sleep(UNWIND_S)
      self._exit_now(signum, 'during start-up, inside a call no signal interrupts')
    if self.grace is None or signum != signal.SIGTERM:
      return
    left = self.grace - (time.monotonic() - at) - STOP_MARGIN_S
    durations = [s['durable_s'] for s in self._ckpt.recent_saves if 'durable_s' in s]
    if durations and max(durations) > left:
      self._exit_now(signum, f'a checkpoint takes up to {max(durations):.0f} s here and the '
                     f'grace period ({self.grace:.0f} s) leaves {max(left, 0):.0f} s')
    time.sleep(max(left, 0))
    self._exit_now(signum, f'the grace period ({self.grace:.0f} s) ends before the checkpoint '
                   'is written')

  def _exit_now(self, signum: int, why: str) -> NoReturn:
    with self._exiting:
      if self._ckpt is None:
        resume = 'its last committed checkpoint'
      else:
        steps = [s['step'] for s in self._ckpt.recent_saves if 'durable_s' in s]
        step = max(steps + [self._start])
        resume = f'committed step {step}' if step else 'step 0 (nothing committed yet)'
      warn(f'Signal {signum} {why}: exiting now without a checkpoint (exit 3); the run '
           f'resumes from {resume}.')
      logging.flush()
      os._exit(errors.EXIT_PREEMPTED)  # the main thread may be in a call that never returns

  def agreed(self) -> bool:
    """Whether any process was signalled; every process must stop at the same step.

    Multi-process runs pay one tiny host collective per step for this: a
    process that stopped alone would leave the others hanging in the next step.
    """
    if jax.process_count() == 1:
      return self.requested
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.requested))))

  def close(self) -> None:
    """The previous handlers back. A deadline already running still ends the process in
    time: it was signalled, and exit 3 must reach the scheduler before its SIGKILL."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    signal.set_wakeup_fd(self._previous_fd)
    os.close(self._write)  # the watcher reads EOF and ends, unless it is timing a deadline


HEARTBEAT_ENV = 'OLMO_HEARTBEAT_FILE'  # set by scripts/launch.py for its stall watchdog
# The heartbeat file's first bytes while the trainer compiles: the watchdog does not count
# that time (scripts/launch.py PAUSED, the same bytes: the launcher does not import JAX).
PAUSED = b'paused'


class Heartbeat:
  """Touches the file scripts/launch.py names in $OLMO_HEARTBEAT_FILE, once per step.

  The launcher kills and restarts a trainer whose heartbeat is older than its
  --stall_timeout (a process stopped, or deadlocked outside a collective that
  its peers' heartbeat timeout would end). A compile takes as long as it takes,
  so `paused()` writes PAUSED into the file, and the launcher does not count
  the time while the file says it; leaving the pause is a beat. train.py runs
  its first step and its first evaluation inside `compiling(...)`, and beats
  only after its first step, so no --stall_timeout shorter than a compile
  kills a healthy trainer. Without the variable it does nothing.
  """

  def __init__(self):
    self.path = os.environ.get(HEARTBEAT_ENV)
    self.depth = 0  # pauses entered and not left
    self.compiled: set[str] = set()

  def _write(self, content: bytes | None) -> None:
    """Touches the file (content None) or replaces it (which touches it too). A new
    content is a new file renamed over the old: an open that truncates sets the time
    before the bytes land, and a trainer descheduled in between looked to the watchdog
    like one that had left its pause long ago."""
    if not self.path:
      return
    try:
      if content is None:
        with open(self.path, 'ab'):  # made again if a tmp cleaner removed it
          os.utime(self.path)
      else:
        with open(self.path + '.tmp', 'wb') as f:
          f.write(content)
        os.replace(self.path + '.tmp', self.path)
    except OSError as e:  # the watchdog is a helper: never stop training for it
      logging.warning('Cannot touch the heartbeat file %s (%s); the launcher may take this '
                      'trainer for stalled.', self.path, e)
      self.path = None

  def beat(self) -> None:
    self._write(None)

  @contextlib.contextmanager
  def paused(self):
    """The launcher's watchdog does not count the time inside (a compile); nests."""
    self.depth += 1
    if self.depth == 1:
      self._write(PAUSED + f' pid {os.getpid()}\n'.encode())
    try:
      yield
    finally:
      self.depth -= 1
      if self.depth == 0:
        self._write(b'')  # empty and touched: a beat, from which the watchdog counts again

  def compiling(self, what: str):
    """`paused()` the first time `what` (e.g. 'train step') runs in this process: its
    compile; a no-op context after that."""
    if what in self.compiled:
      return contextlib.nullcontext()
    self.compiled.add(what)
    return self.paused()
