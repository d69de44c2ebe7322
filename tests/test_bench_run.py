"""bench/bench_run.py (the run as a benchmark) in its CPU miniature, so it cannot rot.

The references: the two train.py processes' own wall clocks (the bench's windows must
fit inside them), the step numbers the flags ask for, and the time to first step, which
the account times apart from the stages the bench reads back.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two train.py processes of the tiny model: ~30-60 s on 2 cores
def test_tiny_run_reports_throughput_saves_and_start_up(tmp_path):
  out = tmp_path / 'run.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=with_devices(1))  # train.py's one CPU
  proc = subprocess.run(
      [sys.executable, str(REPO / 'bench' / 'bench_run.py'), '--tiny', '--steps=20',
       '--every=10', '--log_every=2', '--resume_steps=6', f'--workdir={tmp_path / "w"}',
       f'--out={out}'], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())
  run, resume = r['run'], r['resume']
  assert run['steps'] == 18 and run['tokens_per_step'] == 4 * 64  # windows after steps 0-2
  assert 0 < run['wall_s'] < run['process_wall_s']
  assert 0 < run['throughput_vs_step'] <= run['throughput_vs_step_without_eval'] < 1.5
  # One save inside the run (the last is the exit's), with what save() held the loop, the
  # device copy (none on CPU) and its time to commit, read back from metrics.jsonl.
  assert [s['step'] for s in run['saves']] == [10]
  save = run['saves'][0]
  assert 0 <= save['blocked_s'] < 60 and save['copied_on_device_gb'] == 0
  assert 0 < save['durable_s'] < 60 and 0 < run['final_save_durable_s'] < 60
  for start in (run, resume):  # the stages the line lists add up to the time it names
    assert abs(sum(start['stages'].values()) - start['time_to_first_step_s']) < 0.5, start
  assert 0 < resume['restore_s'] < resume['time_to_first_step_s']
  # The line lists each stage of 0.05 s or more: the restore's, unless the checkpoint read
  # ahead (store/prefetch.py) left it less.
  assert (resume['restore_s'] < 0.05
          or "checkpoint restore, or the state's init" in resume['stages']), resume
  assert r['goodput']['starts'] == 2 and r['run']['goodput']['starts'] == 1
  assert 'run throughput' in proc.stdout and 'save at step 10' in proc.stdout
