"""monitor/goodput.py: the run's account across restarts, against hand arithmetic and a real kill.

The end-to-end test SIGKILLs train.py between two checkpoints and resumes it:
the steps the killed process took past its last committed checkpoint are
computed again, so their time must land in `wasted progress`, not in goodput.
The reference for that time is the killed process's own `time/step` records
(monitor/metrics.py's throughput window, a separate clock), and the reference for the
wall time is this test's clock around the two processes.
"""

import gc
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from monitor import goodput

REPO = pathlib.Path(__file__).resolve().parents[1]


def session(start, end, seconds, segments):
  return {'start': start, 'end': end, 'seconds': seconds, 'segments': segments,
          'time to first step (s)': 5.0}


def test_wasted_progress_and_recovery_by_hand():
  # Process A: steps 0..16 at 5 s a step, a save at step 10 (40 s of steps), killed after its
  # record at 16 (80 s). Process B starts 10 s later, resumes at 10 and takes steps 10..20.
  a = session(0.0, 100.0, {'tpu initialization': 10.0, goodput.PRODUCTIVE: 80.0,
                           'other': 10.0},
              [{'from': 0, 'marks': [[0, 0.0, True], [10, 40.0, True], [16, 80.0, False]]}])
  b = session(110.0, 200.0, {'training prep': 30.0, goodput.PRODUCTIVE: 60.0},
              [{'from': 10, 'marks': [[10, 0.0, True], [20, 60.0, False]]}])
  account = goodput.summarize([b, a])  # any order: sorted by start
  s = account['seconds']
  assert account['wall (s)'] == 200.0 and account['starts'] == 2
  assert s[goodput.WASTED] == 80.0 - 40.0  # steps 11..16 of A, computed again by B
  assert s[goodput.PRODUCTIVE] == 80.0 + 60.0 - 40.0
  assert s[goodput.RECOVERY] == 110.0 - 100.0
  assert sum(s.values()) == pytest.approx(account['wall (s)'])
  assert account['percent'][goodput.PRODUCTIVE] == pytest.approx(50.0)

  # A resume between marks is interpolated (step 13: 40 + 3/6 * 40 = 60 s kept).
  b['segments'][0]['from'] = 13
  assert goodput.summarize([a, b])['seconds'][goodput.WASTED] == pytest.approx(20.0)
  # A rollback inside one process: its second segment restarts at step 10.
  c = session(0.0, 100.0, {goodput.PRODUCTIVE: 100.0},
              [{'from': 0, 'marks': [[0, 0.0, True], [10, 30.0, True], [14, 50.0, False]]},
               {'from': 10, 'marks': [[10, 50.0, True], [20, 100.0, False]]}])
  assert goodput.summarize([c])['seconds'][goodput.WASTED] == pytest.approx(20.0)
  line = goodput.line(goodput.summarize([a, b]))
  assert line.startswith('goodput ') and 'wasted progress' in line and 'over 2 starts' in line


def test_the_phase_clock_adds_up_to_the_process_time(tmp_path):
  account = goodput.Account(str(tmp_path))
  with account:
    account.switch('training prep')
    time.sleep(0.05)
    account.begin_segment(0)
    with account.phase('data loading'):
      time.sleep(0.05)
    account.record(3)
  record = json.loads(next((tmp_path / 'goodput').glob('*.json')).read_text())
  assert sum(record['seconds'].values()) == pytest.approx(record['end'] - record['start'],
                                                          abs=1e-6)
  assert record['seconds']['data loading'] >= 0.05
  assert record['start'] <= account.since
  assert record['exit_code'] == 0


@pytest.mark.fresh_interpreter  # the imports must come after the process start
def test_only_a_process_first_account_is_timed_from_the_process_start(tmp_path):
  """In a fresh process the first account starts at the OS's record of the process start
  (before the imports); a second one (train.train called again in a notebook) starts at its
  own creation, so the time between the calls is not start-up, and it gets its own record."""
  code = (f'import json, time; from monitor import goodput\n'
          f'before = time.time()\n'
          f'a = goodput.Account({str(tmp_path)!r}); time.sleep(0.2)\n'
          f'b = goodput.Account({str(tmp_path)!r})\n'
          f'print(json.dumps([before, a.start, a.start_name, a.name, b.start, b.since,'
          f' b.start_name, b.name]))')
  out = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True,
                       timeout=120, check=True).stdout
  before, a_start, a_from, a_name, b_start, b_since, b_from, b_name = json.loads(out)
  assert a_start < before - 0.05 and a_from == 'process start'  # imports took longer
  assert b_start >= before + 0.2 and b_since - b_start < 0.05 and b_from == 'train() call'
  assert a_name != b_name


def test_a_process_that_takes_no_step_turns_the_collector_on_at_its_end(tmp_path):
  try:
    gc.disable()
    with goodput.Account(str(tmp_path)):  # not paused by this process: left as it is
      pass
    assert not gc.isenabled()
    with goodput.Account(str(tmp_path), collector_paused=True):  # `python train.py`
      assert not gc.isenabled()
      cycle = Cycle()  # start-up garbage the collector must free before the freeze
      cycle.me, dead = cycle, weakref.ref(cycle)
      del cycle
    assert gc.isenabled()
    assert dead() is None and gc.get_freeze_count() > 0  # collected, then the rest frozen
  finally:
    gc.enable()
    gc.unfreeze()


class Cycle:
  me: 'Cycle'


def test_a_closed_loader_is_freed_without_the_collector(tmp_path):
  """What the loop replaces at a rollback must not need the collector: the start-up's
  objects are frozen (never collected), so a loader left in a cycle would keep its
  prefetched batches on the devices for the rest of the run."""
  import config_checks, data, sharding  # pylint: disable=import-outside-toplevel,multiple-imports
  from configs import small  # pylint: disable=import-outside-toplevel
  cfg = config_checks.complete(small.get_config())
  mesh = sharding.make_mesh(cfg.train)
  ds = data.dataset_from_config(cfg.data, cache_dir=str(tmp_path))
  try:
    gc.disable()
    loader = data.Loader.from_config(cfg.data, ds, sharding=sharding.batch_sharding(mesh),
                                     cache_dir=str(tmp_path))
    batch = next(iter(loader))
    del batch
    loader.close()
    freed = weakref.ref(loader)
    del loader
    assert freed() is None  # reference counting alone
  finally:
    gc.enable()


def test_compilation_cache_setting(tmp_path, monkeypatch):
  saved = jax.config.jax_compilation_cache_dir
  try:
    assert goodput.compilation_cache('', str(tmp_path)) == ''
    assert jax.config.jax_compilation_cache_dir == saved  # '' leaves JAX as it is
    jax.config.update('jax_compilation_cache_dir', None)
    assert goodput.compilation_cache('auto', str(tmp_path)) == str(tmp_path / 'xla_cache')
    assert goodput.compilation_cache(str(tmp_path / 'x'), 'gs://b/run') == str(tmp_path / 'x')
    jax.config.update('jax_compilation_cache_dir', None)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'home'))
    bucket = goodput.compilation_cache('auto', 'gs://bucket/run')
    assert bucket.startswith(str(tmp_path / 'home' / 'olmo3_jax')) and bucket.endswith('xla_cache')
  finally:
    jax.config.update('jax_compilation_cache_dir', saved)


CACHE_CHILD = '''
import sys, time
sys.path.insert(0, {repo!r})
import jax, jax.numpy as jnp
from monitor import goodput
jax.monitoring.register_event_listener(lambda event, **kw: print(event))
goodput.compilation_cache({folder!r}, '/unused')
def f(x):
  for i in range(20):
    x = jnp.tanh(x @ x.T) + i
  return x
jax.jit(f)(jnp.ones((32, 32))).block_until_ready()
'''


def test_a_second_process_hits_jax_persistent_cache(tmp_path):
  """JAX's own cache, on this jaxlib and CPU: the second process compiles nothing."""
  script = tmp_path / 'child.py'
  script.write_text(CACHE_CHILD.format(repo=str(REPO), folder=str(tmp_path / 'cache')))
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  logs = [subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout for _ in range(2)]
  hit = '/jax/compilation_cache/cache_hits'  # JAX's own monitoring event
  assert hit not in logs[0] and hit in logs[1], logs
  assert any(p.name.startswith('jit_f-') for p in (tmp_path / 'cache').iterdir())


@pytest.mark.slow  # two train.py processes: ~2 min on a loaded 2-core machine
def test_a_step_compiled_ahead_is_not_traced_again():
  traces = []

  def f(x, lr):
    traces.append(1)  # runs once per trace
    return x * lr + 1
  step = goodput.compile_ahead(jax.jit(f), jax.ShapeDtypeStruct((8,), jnp.float32),
                               jax.ShapeDtypeStruct((), jnp.float32))
  out = step(jnp.arange(8, dtype=jnp.float32), np.float32(2))
  assert len(traces) == 1  # the thread's; the call found its executable
  np.testing.assert_array_equal(out, np.arange(8) * 2 + 1)
  step(jnp.zeros(8, jnp.float32), np.float32(3))
  assert len(traces) == 1


EXIT_WHILE_COMPILING = """
import sys, threading, time
sys.path.insert(0, {repo!r})
import jax, jax.numpy as jnp
from monitor import goodput
lowered = threading.Event()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: lowered.set()
    if event.endswith('jaxpr_to_mlir_module_duration') else None)
def f(x):
  for i in range(3000):
    x = jnp.sin(x) * 1.01 + i
  return x
goodput.compile_ahead(jax.jit(f), jax.ShapeDtypeStruct((128,), jnp.float32))
lowered.wait()
time.sleep(0.1)  # well inside XLA's compile (~0.4 s here)
alive = [t for t in threading.enumerate() if t.name == 'compile ahead' and t.is_alive()]
print(f'compiling: {{bool(alive)}}', flush=True)
print('error: refused', flush=True)
sys.exit(2)
"""


def test_an_exit_while_compiling_ahead_keeps_its_exit_code():
  """Without the wait, 5 runs of 5 aborted: 'terminate called after throwing an instance
  of ...', SIGABRT, instead of the process's own exit 2."""
  proc = subprocess.run([sys.executable, '-c', EXIT_WHILE_COMPILING.format(repo=str(REPO))],
                        capture_output=True, text=True, timeout=120,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stdout.split() == ['compiling:', 'True', 'error:', 'refused'], proc.stdout
  assert 'terminate' not in proc.stderr


def test_sigkill_and_resume_counts_the_redone_steps_as_wasted(tmp_path):
  # pylint: disable-next=import-outside-toplevel
  from test_multihost import metrics, spawn_train, train_args, trainer_env, wait_for_step
  ckpt_every = 4
  began = time.time()
  proc = spawn_train(tmp_path, 100_000, ckpt_every, log=tmp_path / 'log1')
  try:
    wait_for_step(tmp_path, 2 * ckpt_every + 2, proc, timeout=600)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    proc.kill()
  committed = max(int(p.name[5:]) for p in (tmp_path / 'checkpoints').glob('step_*')
                  if (p / 'COMMIT').exists())
  killed = json.loads(next((tmp_path / 'goodput').glob('*.json')).read_text())
  recorded = killed['segments'][-1]['marks'][-1][0]  # the last step its record holds
  assert recorded > committed
  logged = metrics(tmp_path)  # the killed process's own clock, before the resume drops them
  redone = [logged[s]['time/step'] for s in range(committed + 1, recorded + 1)]
  redone_no_save = [logged[s]['time/step'] for s in range(committed + 1, recorded + 1)
                    if s % ckpt_every]

  # The account ends at the resumed process's last record, when it prints its line; the
  # interpreter's own shutdown after that is no part of it.
  resumed = subprocess.Popen(train_args(tmp_path, committed + 2, ckpt_every), cwd=REPO,
                             env=trainer_env(2), stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
  lines, ended = [], None
  for text in resumed.stdout:
    lines.append(text.rstrip('\n'))
    if text.startswith('goodput '):
      ended = time.time()
  assert resumed.wait(timeout=600) == 0, '\n'.join(lines[-30:])
  account = goodput.summary(str(tmp_path))
  s = account['seconds']
  assert account['starts'] == 2
  assert 0.5 * sum(redone_no_save) <= s[goodput.WASTED] <= 1.1 * sum(redone) + 0.1
  assert sum(s.values()) == pytest.approx(account['wall (s)'], rel=1e-9)
  # Within 1%, and half a second for reading the line off a pipe on a loaded machine.
  assert abs(account['wall (s)'] - (ended - began)) <= 0.01 * (ended - began) + 0.5
  # The line, at the end of the resumed process; time to first step, logged and printed.
  assert lines[-1].startswith('goodput ') and 'wasted progress' in lines[-1]
  assert f'(process start to step {committed + 1})' in '\n'.join(lines)
  records = [json.loads(l) for l in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert any('goodput/time to first step (s)' in r for r in records)
  assert records[-1]['goodput/badput/wasted progress (%)'] > 0


# Runs train.py as `python train.py` runs it (or as a script calling train.run() does),
# noting each cyclic collection made while train.py runs (not this script's own imports;
# for a script, from its call on) and the moment its first step is reported.
GC_CHILD = '''
import gc, json, runpy, sys
sys.path.insert(0, {repo!r})
runs, seen, started = [], [], [{main}]
def note(phase, info):
  frame = sys._getframe()
  while frame is not None and frame.f_code.co_filename != {train!r}:
    frame = frame.f_back
  if phase == 'start' and frame is not None and started[0]:
    runs.append(info['generation'])
gc.callbacks.append(note)
class Watch:
  def __init__(self, out): self.out = out
  def write(self, text):
    if 'time to first step' in text: seen.append(len(runs))
    return self.out.write(text)
  def __getattr__(self, name): return getattr(self.out, name)
sys.stdout = Watch(sys.stdout)
sys.argv[0] = {train!r}
try:
  if started[0]:
    runpy.run_path(sys.argv[0], run_name='__main__')
  else:
    import train
    started[0] = True
    train.run()
finally:
  print('GC', json.dumps([seen, len(runs), gc.isenabled(), gc.get_freeze_count()]),
        file=sys.stderr)
'''


@pytest.mark.slow  # a train.py process
@pytest.mark.parametrize('main', [True, False], ids=['python train.py', 'train.run()'])
def test_the_collector_waits_for_the_first_step(tmp_path, main):
  """train.py's start-up runs without the cyclic collector (~0.3 s less), which is on again
  from its first step: no collection before it, the collector enabled after it."""
  # pylint: disable-next=import-outside-toplevel
  from test_multihost import train_args, trainer_env
  script = tmp_path / 'child.py'
  script.write_text(GC_CHILD.format(repo=str(REPO), train=str(REPO / 'train.py'), main=main))
  args = train_args(tmp_path / 'run', 3, 3, '--sample_tokens=0')
  out = subprocess.run([sys.executable, str(script), *args[2:]], cwd=REPO, env=trainer_env(1),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  before, total, enabled, frozen = json.loads(out.stderr.strip().splitlines()[-1][3:])
  assert before == [0], out.stderr[-2000:]  # not one collection before the first step
  assert enabled and total > 0  # on again, and collecting, for the rest of the run
  assert frozen > 100_000  # the start-up's survivors out of the collector's sight


@pytest.mark.slow  # two train.py processes
def test_two_runs_differ_only_in_wall_clock_keys_which_the_docs_name(tmp_path):
  """Two runs of the same steps replay every value of metrics.jsonl bit for bit but the
  wall-clock ones: metrics.wall_clock (what the project's equality checks skip) must name
  every key that differs, `goodput/time to first step (s)` at step 1 among them, and
  docs/monitoring.md list each (or its `goodput/` family) with the timing keys."""
  from monitor import metrics  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from test_multihost import metrics as per_step, run_train
  runs = []
  for name in ('a', 'b'):
    run_train(tmp_path / name, 3, 3, devices=1)
    runs.append(per_step(tmp_path / name))  # each step's records, merged
  assert 'goodput/time to first step (s)' in runs[0][1]
  differ = {k for step in runs[0] for k in runs[0][step].keys() | runs[1][step].keys()
            if runs[0][step].get(k) != runs[1][step].get(k)}
  assert 'train/CE loss' not in differ and 'goodput/time to first step (s)' in differ, differ
  assert all(metrics.wall_clock(k) for k in differ), differ
  assert not metrics.wall_clock('train/CE loss') and not metrics.wall_clock('optim/LR')
  doc = (REPO / 'docs' / 'monitoring.md').read_text()
  timing = doc[doc.index('## Wall-clock keys'):].split('\n## ')[0]
  for key in differ:
    assert f'`{key}`' in timing or f'`{key.split("/")[0]}/`' in timing, key


@pytest.mark.slow  # a train.py process
def test_the_spine_stays_short_and_the_phases_it_hands_to_the_account_are_timed(tmp_path):
  """train.py hands its phases to goodput.Account (timed, take_step, saving, write) rather
  than timing them itself, and stays within the ~450 lines its readers are promised. A run
  through the command line still times every phase, marks each save, logs the account at
  a save and at the end, and the loader's wait."""
  # pylint: disable-next=import-outside-toplevel
  from test_multihost import metrics as per_step, run_train
  spine = len((REPO / 'train.py').read_text().splitlines())
  assert spine <= 450, f'train.py has {spine} lines'
  out = run_train(tmp_path, 4, 2, '--sample_tokens=4', devices=1)
  assert '--- sample ---' in out
  record = json.loads(next((tmp_path / 'goodput').glob('*.json')).read_text())
  for category in ('tpu initialization', 'training prep', 'program startup', 'data loading',
                   'checkpoint save', goodput.PRODUCTIVE, 'custom/sample'):
    assert record['seconds'].get(category, 0.0) > 0, (category, record['seconds'])
  assert [m[0] for m in record['segments'][0]['marks'] if m[2]] == [0, 2, 4]  # the saves
  assert record['time to first step (s)'] > 0 and record['exit_code'] == 0
  logged = per_step(tmp_path)
  assert 'goodput/goodput (%)' in logged[2] and 'goodput/goodput (%)' in logged[4]
  assert logged[1]['goodput/time to first step (s)'] == record['time to first step (s)']
  assert all(0 <= logged[s]['time/data wait'] < 60 for s in range(1, 5))
  # The start-up's stages add up to the time to first step, which is timed apart (from the
  # process's start to the first step's end), and name the compile and the first step.
  stages = dict(record['start-up (s)'])
  assert abs(sum(stages.values()) - record['time to first step (s)']) < 0.01, stages
  assert {'compile (waited for)', 'first step (trace, dispatch, run)',
          "checkpoint restore, or the state's init"} <= stages.keys(), stages
  # Each save's costs, once each: what save() held the loop, then the time to its commit.
  records = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  blocked = [r['step'] for r in records if 'goodput/checkpoint save blocked (s)' in r]
  durable = [r[k] for r in records for k in ('goodput/checkpoint durable step',
                                              'goodput/checkpoint durable at exit step') if k in r]
  assert blocked == [2, 4] and durable == [2, 4], (blocked, durable)
  assert 'goodput/checkpoint durable at exit (s)' in logged[4]  # what the exit waited for
