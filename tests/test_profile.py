"""train.profile_steps: a jax.profiler trace of chosen steps that leaves the losses alone.

The tiny model of tests/test_train.py trains 8 steps twice in this process,
with profile_steps=(5, 7) and without; every logged number but the wall-clock
ones must be equal bit for bit, and the trace (the .xplane.pb TensorBoard's
profile plugin reads, the Chrome-trace .trace.json.gz Perfetto opens) must
parse and hold exactly steps 5, 6 and 7 of the jitted train step. Also here:
the per-device memory metrics (metrics.device_memory), which CPUs skip.
"""

import collections
import gzip
import json

import jax
from jax.profiler import ProfileData
import pytest

import config_checks
import errors
from monitor import metrics
import train
from test_train import timed, tiny_config, token_files  # noqa: F401  (a fixture)

TRACED = (5, 7)
# What jax 0.10.2 names one execution of the jitted train step on a CPU device's host thread
# (the function is train.make_train_step's `train_step`, so its module is jit_train_step).
EXECUTE = 'CommonPjRtLoadedExecutable::Execute (jit_train_step)'


def _losses(workdir) -> list[dict]:
  untimed = [{k: v for k, v in r.items() if not timed(k)}
             for r in metrics.read_records(str(workdir))]
  return [r for r in untimed if set(r) != {'step'}]  # records of goodput alone: none


def test_profiled_steps_leave_the_losses_bit_exact_and_the_trace_parses(token_files, tmp_path):
  plain, profiled = tmp_path / 'plain', tmp_path / 'profiled'
  train.train(tiny_config(token_files), str(plain))
  cfg = tiny_config(token_files)
  cfg.train.profile_steps = TRACED
  train.train(cfg, str(profiled))

  assert _losses(profiled) == _losses(plain)  # floats from JSON: equal means bit for bit
  assert [r['step'] for r in _losses(plain) if 'train/CE loss' in r] == list(range(1, 9))

  folder = profiled / 'profile' / 'plugins' / 'profile' / 'steps_5-7'
  xplanes = list(folder.glob('process0.*.xplane.pb'))
  traces = list(folder.glob('process0.*.trace.json.gz'))
  assert len(xplanes) == 1 and len(traces) == 1, sorted(p.name for p in folder.iterdir())
  data = ProfileData.from_file(str(xplanes[0]))
  names = collections.Counter(e.name for plane in data.planes for line in plane.lines
                              for e in line.events)
  assert names[EXECUTE] == TRACED[1] - TRACED[0] + 1, [n for n in names if 'train_step' in n]
  with gzip.open(traces[0]) as f:
    events = json.load(f)['traceEvents']
  assert sum(e.get('name') == EXECUTE for e in events) == 3
  assert not (plain / 'profile').exists()


@pytest.mark.parametrize('field, value, match', [
    ('profile_steps', (7, 5), r'profile_steps=\(7, 5\) must be'),
    ('profile_steps', (0, 3), r'1 <= START <= STOP'),
    ('profile_steps', (5,), r'must be \(\) \(off\)'),
    ('profile_hosts', (), r'profile_hosts=\(\) must be a non-empty tuple'),
    ('profile_hosts', (-1,), r'profile_hosts=\(-1,\)'),
])
def test_bad_profile_settings_are_one_line_config_errors(token_files, field, value, match):
  cfg = tiny_config(token_files)
  cfg.train[field] = value
  with pytest.raises(errors.ConfigError, match=match):
    config_checks.validate(cfg)


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_device_memory_is_the_largest_per_device_and_absent_on_cpu(monkeypatch):
  assert metrics.device_memory() == {}  # CPU devices report None
  gib = 2**30
  monkeypatch.setattr(jax, 'local_devices', lambda: [
      _Device({'bytes_in_use': 3 * gib, 'peak_bytes_in_use': 5 * gib, 'bytes_limit': 80 * gib}),
      _Device({'bytes_in_use': 4 * gib, 'peak_bytes_in_use': 6 * gib, 'bytes_limit': 80 * gib})])
  assert metrics.device_memory() == {'system/device memory in use (GiB)': 4.0,
                                     'system/device memory peak (GiB)': 6.0,
                                     'system/device memory peak (%)': 7.5}


@pytest.mark.parametrize('window', ['(3, 4)', '(1, 3)'])
def test_a_window_past_the_last_step_is_refused_in_one_line(token_files, tmp_path, window):
  """train.py --config.train.steps=2 with steps 3..4 (none would run) or 1..3 (step 3 never
  runs): exit 2 and one `error:` line naming both fields, before anything is written.
  Before, (3, 4) trained, exited 0 and traced nothing, without a word."""
  import os
  import subprocess
  import sys

  from test_train import REPO, config_flags
  workdir = tmp_path / 'run'
  run = subprocess.run(
      [sys.executable, os.path.join(REPO, 'train.py'), f'--workdir={workdir}',
       *config_flags(token_files), '--config.train.steps=2',
       f'--config.train.profile_steps={window}'],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  lines = [line for line in run.stderr.splitlines() if line.startswith('error: ')]
  assert run.returncode == errors.EXIT_USAGE and len(lines) == 1, run.stderr[-3000:]
  assert 'Traceback' not in run.stderr
  assert 'train.profile_steps=' in lines[0] and 'train.steps=2' in lines[0]
  assert '--config.train.profile_steps' in lines[0]
  assert not (workdir / 'checkpoints').exists()
