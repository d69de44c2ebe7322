"""Where a run's wall time went, across every restart: goodput and badput by category.

    account = goodput.Account(workdir)       # at process start (train.py)
    account.switch('training prep')          # everything from now on is prep ...
    with account.phase('data loading'): ...  # ... except this block
    account.record(step)                     # <workdir>/goodput/<start>.json, process 0
    goodput.summary(workdir)                 # the whole run: every process so far

Each process (a start of train.py) keeps a phase clock: at any moment exactly
one category is running, so its categories add up to its own wall time, from
the process's start as the OS records it (imports included) to its last
record. Process 0 rewrites its record at every log and save step and at exit,
so a SIGKILL loses only the time since the last log line; that time, and the
gap before the next start, count as `infrastructure recovery`.

Category names are ml-goodput-measurement's (MaxText's goodput reports), in
words: `productive` (goodput), and the badput buckets `tpu initialization`
(accelerator and distributed start-up, imports), `training prep` (config,
data, mesh, state, evaluators), `program startup` (the first step: trace and
compile), `data loading` (the loop waiting on its loader), `checkpoint save`
(the blocking part) and `checkpoint restore`, `wasted progress` (steps later
computed again: past the checkpoint a restart or rollback resumed from),
`infrastructure recovery` (between processes), `custom/...` (held-out and
downstream evaluation, rollbacks) and `other`.

Wasted progress: each process records, per stretch of consecutive steps (a
segment, a new one after each rollback), its productive seconds at the
segment's first step, at each checkpoint save and at its last record. When a
later segment starts at step R, every earlier segment's seconds past R move
from productive to wasted (exact at a save step, which is where a resume
starts; interpolated otherwise).
"""

import atexit
import contextlib
import gc
import itertools
import json
import os
import socket
import threading
import time
from typing import Any, Callable

from absl import logging
import jax

from store import offload
from store import storage

FOLDER = 'goodput'
PRODUCTIVE = 'productive'
RECOVERY = 'infrastructure recovery'
WASTED = 'wasted progress'
# ml-goodput-measurement's BadputType, in words, in its order; `custom/<event>` adds to these.
BADPUT = ('tpu initialization', 'training prep', 'program startup', 'data loading',
          'checkpoint save', 'checkpoint restore', WASTED, RECOVERY, 'other')


def process_start_time() -> float:
  """This process's start as Unix time: its age from /proc (10 ms), else this module's import."""
  try:
    with open('/proc/self/stat') as f:
      ticks = int(f.read().rpartition(')')[2].split()[19])  # field 22: starttime, clock ticks
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf('SC_CLK_TCK'))
  except (OSError, ValueError, IndexError):
    return _IMPORTED


_IMPORTED = time.time()
_ACCOUNTS = itertools.count()  # accounts made in this process (next() is atomic)


def session_start() -> tuple[float, str]:
  """When this train() call's clock starts, and from what: the process's start for its first
  call (imports count), the call itself for any later one in the same process (a notebook, a
  test), else the time between calls would count as start-up, and two calls would write
  the same record."""
  if next(_ACCOUNTS):
    return time.time(), 'train() call'
  return process_start_time(), 'process start'


class Account:
  """One process's phase clock and its record in <workdir>/goodput/ (process 0 writes)."""

  def __init__(self, workdir: str, start: float | None = None, collector_paused: bool = False,
               then: str | None = None):
    """collector_paused: the process turned Python's cyclic collector off for its start-up
    (`python train.py`); it is turned on at the first step, or at the end if none is taken.
    then: the category the time goes to from now on (see `switch`)."""
    self.workdir, self.folder = workdir, storage.join(workdir, FOLDER)
    self.collector_paused = collector_paused
    self.start, self.start_name = session_start() if start is None else (start, 'start')
    self.writes = False  # until __enter__: nothing goes to a workdir before train.py locks it
    self.previous: list[dict[str, Any]] = []  # the run's earlier processes
    self.name = f'{int(self.start * 1e6):020d}.json'  # sorts by start time
    self.seconds: dict[str, float] = {}
    self.current = 'tpu initialization'  # until the first switch: imports, backends
    self.since = time.time()
    self.seconds[self.current] = self.since - self.start
    self.latest: dict[str, float] = {}  # the seconds of each category's latest `phase`
    self.segments: list[dict[str, Any]] = []
    self.first_step_s: float | None = None
    self.beside: float | None = None  # seconds the train step's compile took on its thread
    # Where the time to first step goes, in order: [what, seconds] for each stretch of one
    # category (its name), or of a named stage within one (`stage`); the first is the
    # process's own start (interpreter, imports) up to this account.
    self.stages: list[list] = [[f'{self.start_name} to train() (imports)',
                                self.since - self.start]]
    self.stage_since = self.since
    self.saver: Any = None  # a Checkpointer whose saves' costs `record` writes (`watch`)
    self.costs_written: set[tuple[int, str]] = set()
    self.cost_keys: dict[int, set[str]] = {}  # the cost keys written at the latest step
    self.exit_code: int | None = None
    if then:
      self.switch(then)

  def __enter__(self) -> 'Account':
    """Reads the run's earlier records; process 0 writes this one's from now on."""
    self.previous = read_sessions(self.workdir)
    self.writes = jax.process_index() == 0
    if self.writes:
      storage.makedirs(self.folder)
    return self

  def __exit__(self, kind, error, traceback) -> None:
    """The final record, and the run's account in one line (every process prints it)."""
    code = 0 if error is None else getattr(error, 'exit_code', 1)
    if isinstance(error, SystemExit):
      code = error.code if isinstance(error.code, int) else 1
    self.resume_collector()
    self.switch('other')
    self.exit_code = code
    self.record()
    print(line(self.summary()), flush=True)

  # --- the clock ---

  def switch(self, category: str) -> str:
    """From now on the time goes to `category`; returns the one that was running."""
    now = time.time()
    self.stage(self.current)
    self.seconds[self.current] = self.seconds.get(self.current, 0.0) + now - self.since
    previous, self.current, self.since = self.current, category, now
    return previous

  @contextlib.contextmanager
  def phase(self, category: str, stage: str = ''):
    """The block's time goes to `category` (a start-up stage named `stage`, if given); its
    seconds are then latest[category]."""
    previous, began = self.switch(category), time.perf_counter()
    try:
      yield
    finally:
      if stage:
        self.stage(stage)
      self.switch(previous)
      self.latest[category] = time.perf_counter() - began

  def timed(self, category: str, fn: Callable[..., Any], *args: Any, stage: str = '') -> Any:
    """fn(*args), its time going to `category` (and to start-up stage `stage`)."""
    with self.phase(category, stage):
      return fn(*args)

  def stage(self, name: str) -> None:
    """Until the first step: the time since the last stage ended was start-up stage
    `name` (every switch of category ends one too, named by the category). They add up to
    the time to first step, printed with it."""
    if self.first_step_s is None:
      now = time.time()
      if now - self.stage_since >= 0.0005:
        self.stages.append([name, now - self.stage_since])
      self.stage_since = now

  def elapsed(self) -> float:
    return time.time() - self.start

  def now_seconds(self, now: float | None = None) -> dict[str, float]:
    """Seconds per category so far (to `now`), the running one included."""
    out = dict(self.seconds)
    out[self.current] = out.get(self.current, 0.0) + (now or time.time()) - self.since
    return out

  # --- steps ---

  def begin_segment(self, step: int) -> None:
    """Steps after `step` follow, productive from now (at the loop's start, and after a
    rollback restored `step`). At a start, what came since the state was ready (the
    loader, evaluators, writers) is its own start-up stage."""
    self.stage('loader, evaluators, writers')
    self.segments.append({'from': step, 'marks': [[step, self._productive(), True]]})
    self.switch(PRODUCTIVE)

  def mark(self, step: int, saved: bool = False) -> None:
    """Productive seconds through `step`: kept at a save (a resume there is exact); otherwise
    the segment's moving last mark."""
    if not self.segments:
      return
    marks = self.segments[-1]['marks']
    point = [step, self._productive(), saved]
    if not marks[-1][2]:
      marks[-1] = point
    elif marks[-1][0] != step:
      marks.append(point)

  def _productive(self) -> float:
    return self.now_seconds().get(PRODUCTIVE, 0.0)

  def first_step(self) -> float:
    """Called when this process's first step is done: the time to first step (s)."""
    self.first_step_s = self.elapsed()
    return self.first_step_s

  # --- the record ---

  def as_dict(self) -> dict[str, Any]:
    now = time.time()
    return {'start': self.start, 'end': now, 'host': socket.gethostname(),
            'pid': os.getpid(), 'processes': jax.process_count(),
            'seconds': self.now_seconds(now), 'segments': self.segments,
            'time to first step (s)': self.first_step_s, 'start-up (s)': self.stages,
            'train step compile, beside (s)': self.beside,
            'exit_code': self.exit_code}

  def watch(self, saver: Any) -> Any:
    """Returns `saver` (checkpoint.Checkpointer), whose saves' costs `costs` logs."""
    self.saver = saver
    return saver

  def costs(self, step: int, writer: Any, at_exit: bool = False) -> None:
    """The watched saver's recent saves, at `step`, each figure once: how long save()
    held the loop and what it copied on device, then (at the first call after its commit)
    the time from save() to the commit, with the step saved. One record per key and step:
    a save whose figures would repeat a key already written at `step` waits for the next
    call. At the process's end (`at_exit`) the time to commit is the one the exit waited
    for, under its own key (the save before it was just logged at this step)."""
    durable = 'goodput/checkpoint durable at exit' if at_exit else 'goodput/checkpoint durable'
    for save in getattr(self.saver, 'recent_saves', []):
      out = {}
      if 'blocking_s' in save and (save['step'], 'blocked') not in self.costs_written:
        out[(save['step'], 'blocked')] = {
            'goodput/checkpoint save blocked (s)': save['blocking_s'],
            'goodput/checkpoint copied on device (GB)': save['device_copy_bytes'] / 1e9}
      if 'durable_s' in save and (save['step'], 'durable') not in self.costs_written:
        out[(save['step'], 'durable')] = {f'{durable} (s)': save['durable_s'],
                                          f'{durable} step': float(save['step'])}
      for done, values in out.items():
        logged = self.cost_keys.setdefault(step, set())
        if not logged & values.keys():
          logged.update(values)
          self.costs_written.add(done)
          writer.write(step, values)
    self.cost_keys = {step: self.cost_keys.get(step, set())}  # only this step's can repeat

  def record(self, step: int | None = None, save: bool = False, writer: Any = None) -> None:
    """Writes this process's record (process 0), marking the progress through `step`;
    with `writer`, the watched saver's costs too (`costs`)."""
    if writer is not None and step is not None:
      self.costs(step, writer)
    if step is not None:
      self.mark(step, saved=save)
    if not self.writes:
      return
    try:
      storage.write_atomic(storage.join(self.folder, self.name), json.dumps(self.as_dict()),
                           fsync=False)
    except OSError as e:  # the account must never stop a run
      logging.warning('Could not write the goodput record: %s', e)

  def summary(self) -> dict[str, Any]:
    """The run's account: every earlier process and this one so far (summarize)."""
    return summarize(self.previous + [self.as_dict()])

  def take_step(self, step: int, writer: Any, train_step: Callable[..., Any], *args: Any
                ) -> Any:
    """train_step(*args), the loop's `step`: productive, except this process's first,
    which is `program startup` (its compile, and the wait for it) and whose end is the time
    to first step (first_step_done)."""
    first = self.first_step_s is None
    with self.phase('program startup' if first else PRODUCTIVE):
      out = train_step(*args)
      if first:
        waited = getattr(train_step, 'compile_wait_s', 0.0)  # compile_ahead's
        self.stages.append(['compile (waited for)', waited])
        self.stage_since += waited
        self.beside = getattr(train_step, 'compile_s', None)
        self.first_step_done(step, out[1], writer)
    return out

  @contextlib.contextmanager
  def saving(self, step: int, writer: Any, final: bool):
    """Around a checkpoint save's blocking part (the write goes on behind): `checkpoint
    save`, then a record marking `step` saved, and the run's `goodput/` metrics at `step`,
    but for the `final` save of a process (those come with its last account: `write`)."""
    self.switch('checkpoint save')
    yield
    self.switch(PRODUCTIVE)
    self.record(step, save=True, writer=writer)
    if not final:
      self.write(step, writer)

  def write(self, step: int, writer: Any, at_exit: bool = False) -> None:
    """The run's `goodput/` metrics (the account so far) at `step` (writer: MetricWriter),
    and the watched saver's costs not yet logged (`at_exit`: the process's last record)."""
    self.costs(step, writer, at_exit)
    writer.write(step, metrics(self.summary()))

  def first_step_done(self, step: int, step_metrics: Any, writer: Any) -> None:
    """After this process's first step (waited for): `time to first step (s)`, from the
    process's start (session_start), printed and logged (writer: metrics.MetricWriter)."""
    jax.block_until_ready(step_metrics)
    self.stage('first step (trace, dispatch, run)')
    seconds = self.first_step()
    print(f'time to first step {seconds:.1f}s ({self.start_name} to step {step}): '
          + ', '.join(f'{k} {v:.1f}s' for k, v in self.stages if v >= 0.05)
          + ('' if self.beside is None else
             f'; beside them, the train step compiled in {self.beside:.1f}s'), flush=True)
    writer.write(step, {'goodput/time to first step (s)': seconds})
    self.resume_collector()

  def resume_collector(self) -> None:
    """Ends the start-up's pause of the cyclic collector (collector_paused)."""
    if self.collector_paused:
      self.collector_paused = False
      # One pass over the start-up's cycles (it frees what they hold, device arrays too),
      # then the survivors (modules, traced functions, caches: they live as long as the
      # process) leave the collector's sight: walking them in every full pass cost a tiny
      # run 0.28 s of its 3.5 s after the first step (docs/goodput.md).
      gc.collect()
      gc.freeze()
      gc.enable()


# --- The run's account ----------------------------------------------------------------


def read_sessions(workdir: str) -> list[dict[str, Any]]:
  """Every process record in <workdir>/goodput, oldest first."""
  folder = storage.join(workdir, FOLDER)
  out = []
  for name in sorted(storage.listdir(folder)):
    if not name.endswith('.json'):
      continue
    try:
      out.append(json.loads(storage.read_text(storage.join(folder, name)) or ''))
    except json.JSONDecodeError:
      continue  # cannot happen with atomic writes; a stray file is no reason to fail
  return sorted(out, key=lambda s: s['start'])


def _seconds_at(marks: list[list], step: int) -> float:
  """Productive seconds of a segment through `step`, interpolated between its marks."""
  if step <= marks[0][0]:
    return marks[0][1]
  for (s0, t0, *_), (s1, t1, *_) in zip(marks, marks[1:]):
    if s0 <= step <= s1:
      return t0 + (t1 - t0) * (step - s0) / max(s1 - s0, 1)
  return marks[-1][1]


def summary(workdir: str) -> dict[str, Any]:
  """The account of the run in `workdir` from its records (scripts/goodput.py)."""
  return summarize(read_sessions(workdir))


def summarize(sessions: list[dict[str, Any]]) -> dict[str, Any]:
  """Seconds and % per category, wall time and goodput of processes' records (oldest
  first); see the module's docstring."""
  sessions = sorted(sessions, key=lambda s: s['start'])
  seconds: dict[str, float] = {}
  kept: list[list[list]] = []  # the marks of every segment whose steps still count
  wasted = 0.0
  for i, s in enumerate(sessions):
    for name, value in s['seconds'].items():
      seconds[name] = seconds.get(name, 0.0) + value
    for segment in s['segments']:
      resume = segment['from']
      for k, marks in enumerate(kept):
        if marks[-1][0] > resume:
          at = _seconds_at(marks, resume)
          wasted += marks[-1][1] - at
          kept[k] = [m for m in marks if m[0] < resume] + [[resume, at, True]]
      kept.append([list(m) for m in segment['marks']])
    if i + 1 < len(sessions):
      seconds[RECOVERY] = seconds.get(RECOVERY, 0.0) + max(
          0.0, sessions[i + 1]['start'] - s['end'])
  seconds[PRODUCTIVE] = seconds.get(PRODUCTIVE, 0.0) - wasted
  seconds[WASTED] = wasted
  wall = sessions[-1]['end'] - sessions[0]['start'] if sessions else 0.0
  first = [s['time to first step (s)'] for s in sessions if s.get('time to first step (s)')]
  return {'wall (s)': wall, 'seconds': seconds, 'starts': len(sessions),
          'percent': {k: 100 * v / wall for k, v in seconds.items()} if wall else {},
          'time to first step (s)': first[-1] if first else None}


def metrics(account: dict[str, Any]) -> dict[str, float]:
  """`goodput/...` records for metrics.jsonl, TensorBoard and W&B."""
  out = {'goodput/goodput (%)': account['percent'].get(PRODUCTIVE, 0.0),
         'goodput/wall time (s)': account['wall (s)'],
         'goodput/productive time (s)': account['seconds'].get(PRODUCTIVE, 0.0),
         'goodput/starts': float(account['starts'])}
  for name, value in account['percent'].items():
    if name != PRODUCTIVE:
      out[f'goodput/badput/{name} (%)'] = value
  return out


def line(account: dict[str, Any]) -> str:
  """'goodput 91.2% of 1h02m over 3 starts; badput: training prep 3.1%, ...' (largest first)."""
  pct = account['percent']
  bad = sorted(((v, k) for k, v in pct.items() if k != PRODUCTIVE and v >= 0.05), reverse=True)
  return (f"goodput {pct.get(PRODUCTIVE, 0.0):.1f}% of {_duration(account['wall (s)'])} over "
          f"{account['starts']} start{'s' * (account['starts'] != 1)}; badput: "
          + (', '.join(f'{k} {v:.1f}%' for v, k in bad) or 'none'))


def _duration(seconds: float) -> str:
  s = int(round(seconds))
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  return f'{s // 60}m{s % 60:02d}s' if s >= 60 else f'{seconds:.1f}s'


# --- The persistent compilation cache -----------------------------------------------------


def compilation_cache(setting: str, workdir: str) -> str:
  """Turns on JAX's persistent compilation cache (train.compilation_cache_dir); returns its
  folder ('' when off).

  JAX keys each entry by the program (HLO), the devices and the compiler flags,
  so a restart, or another host of the same kind, finds what an earlier
  process compiled. 'auto': JAX_COMPILATION_CACHE_DIR (or a folder already
  set) if any, else <workdir>/xla_cache for a local workdir, and for a bucket
  $XDG_CACHE_HOME (~/.cache)/olmo3_jax/<workdir's tag>/xla_cache on each host;
  '' is off. Every program is cached, however quick to compile: a restart
  pays for none of them.
  """
  if not setting:
    return ''
  folder = jax.config.jax_compilation_cache_dir if setting == 'auto' else setting
  if not folder:
    folder = storage.local_cache_dir(workdir, 'xla_cache')
  jax.config.update('jax_compilation_cache_dir', folder)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  return folder


def pause_collector() -> bool:
  """Turns Python's cyclic collector off for a start-up (Account(collector_paused=True)
  turns it on again at the first step); False if it was off already."""
  if not gc.isenabled():
    return False
  gc.disable()
  return True


def compile_ahead(step: Any, *abstract_args: Any, then: Callable[[], None] = lambda: None
                  ) -> Any:
  """`step` (a jitted function), traced, lowered and compiled for `abstract_args` on a
  thread while the caller goes on (train.py: the restore, the loader, the evaluators);
  returns a callable that waits for that compile at its first call, calls `then` (train.py:
  the processes meet there, host_sync.barrier) and then calls `step`. The compiled plan's
  temporaries are reserved beside a checkpoint's on-device copy (store/offload.py).

  jit keeps what an ahead-of-time compile made: the first call of `step` with values
  of those shapes and shardings runs at once. A compile that fails here is left to
  that first call, which compiles again and raises. A process that ends while the
  thread compiles aborts inside XLA (seen on XLA:CPU, exit 134), so its exit waits
  for the thread (atexit), after its error line is printed.
  """
  def compile_it():
    began = time.perf_counter()
    try:
      memory = step.trace(*abstract_args).lower().compile().memory_analysis()
    except Exception:  # pylint: disable=broad-except
      return  # the first call meets it
    call.compile_s = time.perf_counter() - began
    if memory is not None:  # the room a save's on-device copy must leave it
      offload.reserve(memory.temp_size_in_bytes)
  thread = threading.Thread(target=compile_it, name='compile ahead', daemon=True)
  thread.start()
  atexit.register(thread.join)

  waiting = [True]

  def call(*args):
    if waiting:
      began = time.perf_counter()
      thread.join()
      call.compile_wait_s = time.perf_counter() - began  # the start-up's stage
      then()
      waiting.clear()
    return step(*args)
  call.compile_wait_s = 0.0
  call.compile_s = None  # the compile's own seconds, once done: the start-up line's
  return call
