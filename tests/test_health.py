"""monitor/health.py: the divergence guard, the repeat bitmap, the memorization watch, preemption
and the launcher heartbeat.

References: numpy's np.unique (repeat counts), hand-computed step sequences
(the guard), synthetic and recorded loss curves (the watch), real signals and
file modification times.
"""

import os
import pathlib
import signal
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import errors
from monitor import health


def test_mark_seen_counts_every_repeat_like_np_unique():
  rng = np.random.default_rng(0)
  bitmap = np.zeros(1001 // 8 + 1, np.uint8)
  seen = np.zeros(0, np.int64)
  for _ in range(20):
    ids = rng.integers(0, 1001, 300)
    again = health.mark_seen(bitmap, ids)
    everything = np.concatenate([seen, ids])
    _, counts = np.unique(everything, return_counts=True)
    _, before = np.unique(seen, return_counts=True)
    assert again.size == (counts - 1).sum() - (before - 1).sum()
    seen = everything
  assert np.unpackbits(bitmap, bitorder='little').sum() == np.unique(seen).size
  with pytest.raises(IndexError, match='outside the'):
    health.mark_seen(bitmap, np.array([8 * bitmap.size]))


def _watch(train_fn, heldout_fn, evals=20, eval_every=50, log_every=10, noise=0.03, seed=0):
  """Feeds MemorizationWatch a synthetic run; returns the steps at which it warned."""
  rng = np.random.default_rng(seed)
  watch = health.MemorizationWatch(threshold=0.1, evals=3)
  fired = []
  for step in range(log_every, evals * eval_every + 1, log_every):
    watch.observe_train(step, train_fn(step) + noise * rng.standard_normal())
    if step % eval_every == 0 and watch.observe_eval(step, heldout_fn(step)):
      fired.append(step)
  return fired


def test_memorization_watch_on_synthetic_loss_curves(capsys):
  fast_fall = lambda s: 5.0 + 2.0 * np.exp(-s / 60)  # most of the fall before the first eval
  for seed in range(5):  # healthy: both curves fall together, noisy train CE, early fast fall
    assert _watch(fast_fall, lambda s: fast_fall(s) + 0.04, seed=seed) == []
  assert _watch(lambda s: 5 - s / 1000, lambda s: 5.03 - s / 1000) == []
  # The README main job's logged curves (train.py --config=configs/small.py): train CE every
  # 10 steps, validation every 50. Both were silent, with 0 repeated instances.
  readme_runs = [  # 16 x 256 for 150 steps (gap 0.074, 0.164, 0.044), then 8 x 256 for 300
      ([6.7091, 6.2192, 5.9972, 5.8573, 5.7892, 5.6545, 5.5116, 5.3471, 5.3098, 5.3492,
        5.2449, 5.4286, 5.2425, 5.1959, 5.2168], {50: 5.7477, 100: 5.4355, 150: 5.2520}),
      ([7.5003, 6.0944, 6.0586, 6.1216, 6.2755, 5.9098, 5.7601, 5.7059, 5.6601, 5.7224,
        5.447, 5.7472, 5.2894, 5.1641, 4.8876, 5.1262, 5.2798, 5.1024, 5.1382, 5.2077, 5.2345,
        5.2179, 5.3874, 5.5394, 4.9512, 5.1856, 5.1759, 4.949, 5.1511, 5.1453],
       {50: 5.9868, 100: 5.5957, 150: 5.3904, 200: 5.2027, 250: 5.1398, 300: 5.074})]
  for readme_train, readme_heldout in readme_runs:
    watch = health.MemorizationWatch(threshold=0.1, evals=3)
    for i, ce in enumerate(readme_train):
      watch.observe_train(10 * (i + 1), ce)
      if 10 * (i + 1) in readme_heldout:
        assert watch.observe_eval(10 * (i + 1), readme_heldout[10 * (i + 1)]) == {}
  # Memorizing: train CE keeps falling 0.06 per eval while held-out CE stalls.
  fired = _watch(lambda s: 5.0 - 0.06 * s / 50, lambda s: 5.0)
  assert fired and fired[0] <= 250
  assert 'possible memorization' in capsys.readouterr().err
  # A slow drift, 0.02 nats per eval, never widening at every eval (noise 0.03): caught late.
  slow = _watch(lambda s: 5.0 - 0.02 * s / 50, lambda s: 5.0, evals=30, seed=1)
  assert slow and 300 <= slow[0] <= 1000
  with pytest.raises(ValueError, match='memorization_threshold'):
    health.MemorizationWatch(threshold=0, evals=3)


def _guard(max_loss=10.0, max_skips=3):
  return health.DivergenceGuard(ml_collections.ConfigDict(
      dict(max_loss=max_loss, max_consecutive_skips=max_skips)))


def _record(loss, skipped=False):
  return {'train/CE loss': loss, 'optim/step skipped': float(skipped)}


def test_guard_trips_on_the_loss_bound_and_stays_tripped():
  guard = _guard(max_loss=10.0)
  for step, loss in enumerate([9.0, 9.9, 10.0], 1):  # equal to the bound is still fine
    guard.observe(step, _record(loss))
    assert guard.reason is None and guard.healthy
  guard.observe(4, _record(10.5))
  assert 'step 4 is 10.5' in guard.reason and 'train.max_loss=10' in guard.reason
  assert not guard.healthy
  guard.observe(5, _record(1.0))  # a later good step does not clear it
  assert 'step 4' in guard.reason and not guard.healthy


def test_guard_counts_skips_in_a_row_and_a_nan_is_a_skip_not_a_loss():
  guard = _guard(max_skips=3)
  steps = [(1, 5.0, False), (2, float('nan'), True), (3, 5.0, True), (4, 5.0, False),
           (5, 5.0, True), (6, float('nan'), True)]
  for step, loss, skipped in steps:
    guard.observe(step, _record(loss, skipped))
    assert guard.reason is None  # never 3 in a row; NaN > max_loss is False
  assert not guard.healthy  # the last step was skipped: its state is not protected
  guard.observe(7, _record(5.0, True))
  assert guard.reason and 'steps 5-7 were all skipped' in guard.reason


def test_preemption_flag_and_handlers_restored():
  before = signal.getsignal(signal.SIGTERM)
  preempt = health.Preemption()
  try:
    assert not preempt.agreed()
    os.kill(os.getpid(), signal.SIGTERM)
    assert preempt.agreed()
  finally:
    preempt.close()
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_stops_at_once(capfd):
  """After the first SIGINT the default action is back: a second one ends the process even
  inside a long XLA call, where no Python handler runs."""
  before = signal.getsignal(signal.SIGINT)
  preempt = health.Preemption()
  try:
    os.kill(os.getpid(), signal.SIGINT)
    assert preempt.requested
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    assert 'Ctrl-C again stops at once' in capfd.readouterr().err
  finally:
    preempt.close()
  assert signal.getsignal(signal.SIGINT) is before


def test_heartbeat_touches_the_launcher_file(tmp_path, monkeypatch):
  path = tmp_path / 'beat'
  monkeypatch.delenv(health.HEARTBEAT_ENV, raising=False)
  health.Heartbeat().beat()  # without the variable: nothing, no error
  assert not path.exists()
  monkeypatch.setenv(health.HEARTBEAT_ENV, str(path))
  beat = health.Heartbeat()
  beat.beat()
  first = path.stat().st_mtime_ns
  os.utime(path, ns=(first - 10**9, first - 10**9))  # pretend it is a second old
  beat.beat()
  assert path.stat().st_mtime_ns > first - 10**9
  monkeypatch.setenv(health.HEARTBEAT_ENV, str(tmp_path / 'missing' / 'beat'))
  health.Heartbeat().beat()  # an unwritable path warns once and never stops training


def test_heartbeat_pause_says_paused_and_leaving_it_is_a_beat(tmp_path, monkeypatch):
  path = tmp_path / 'beat'
  path.write_bytes(b'')
  os.utime(path, (0, 0))  # as the launcher makes it: not touched yet
  monkeypatch.setenv(health.HEARTBEAT_ENV, str(path))
  beat = health.Heartbeat()
  with beat.compiling('train step'):
    assert path.read_bytes().startswith(health.PAUSED) and path.stat().st_mtime > 0
    with beat.paused():  # nested: still paused, and after it too
      pass
    assert path.read_bytes().startswith(health.PAUSED)
    beat.beat()  # a beat inside a pause keeps the pause
    assert path.read_bytes().startswith(health.PAUSED)
    os.utime(path, (0, 0))
  assert path.read_bytes() == b'' and path.stat().st_mtime > 0  # left: a beat
  os.utime(path, (0, 0))
  with beat.compiling('train step'):  # compiled already: no pause, no touch
    assert path.read_bytes() == b'' and path.stat().st_mtime == 0
  with beat.compiling('evaluation'):  # another program's first run pauses
    assert path.read_bytes().startswith(health.PAUSED)


# A process as train.py runs it: absl's app.run (its log on stderr, or in a file), a SIGINT.
CTRL_C = f'''
import os, signal, sys
sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parents[1])!r})
from absl import app, logging
from monitor import health
def main(argv):
  if os.environ.get('LOG_DIR'):
    logging.get_absl_handler().use_absl_log_file(log_dir=os.environ['LOG_DIR'])
  preempt = health.Preemption()
  os.kill(os.getpid(), signal.SIGINT)
  assert preempt.requested
  logging.flush()
app.run(main)
'''


@pytest.mark.parametrize('flags, log_file', [([], False), (['--alsologtostderr'], True),
                                             ([], True), (['--logtostderr'], False)])
def test_ctrl_c_says_so_once(tmp_path, flags, log_file):
  """Once on stderr whether absl logs there (its default) or to a file, and once in that."""
  env = dict(os.environ, JAX_PLATFORMS='cpu', LOG_DIR=str(tmp_path) if log_file else '')
  proc = subprocess.run([sys.executable, '-c', CTRL_C, *flags], capture_output=True,
                        text=True, timeout=120, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stderr.count('stopping after the current step') == 1, proc.stderr
  if log_file:
    logs = ''.join(p.read_text() for p in tmp_path.iterdir() if '.INFO.' in p.name)
    assert logs.count('stopping after the current step') == 1, logs


def test_memorization_settings_are_a_config_error():
  with pytest.raises(errors.ConfigError, match='memorization_threshold'):
    health.MemorizationWatch(threshold=0.1, evals=1)
