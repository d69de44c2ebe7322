"""bench/device_check.py, the first GPU's check, run in its CPU miniature so it cannot rot.

On CPU the attention check compares JAX's XLA attention with
model.reference_attention (cuDNN needs a GPU); the restart check must show the
second child served by JAX's persistent compilation cache (its own events).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # three processes compile the tiny slice: ~1-4 min on 2 cores
def test_tiny_device_check_runs_and_reports_every_number(tmp_path):
  out = tmp_path / 'result.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, str(REPO / 'bench' / 'device_check.py'), '--tiny',
                         f'--out={out}', '--steps=2', '--fit', '--compare_hd256'], cwd=REPO,
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert 'device check passed' in proc.stdout
  r = json.loads(out.read_text())
  assert r['platform'] == 'cpu' and r['tiny']
  assert all(a['ok'] for a in r['attention'].values())
  assert r['step']['step (s)'] > 0 and r['step']['MFU'] > 0
  # The step alone, in its own process, against plan.py's CPU compile of the same program.
  memory = r['memory']
  assert memory['ok'] and memory['planned by'] == 'the CPU compile'
  assert abs(memory['compiled / predicted'] - 1) <= 0.03
  assert memory['step']['compiled peak (GB)'] > 0 and memory['step']['device'] == 'cpu'
  assert 'skipped' in r['fit']  # a CPU has no memory limit to fit
  assert r['hd256']['step']['step (s)'] > 0 and r['hd256']['16x256 / 32x128 time'] > 0
  assert r['restart']['cold']['cache hits'] == 0 < r['restart']['warm']['cache hits']


def test_plan_pods_builds_the_chips_slice_from_device_checks_defaults():
  """bench/plan_pods.py's one-chip row plans what `device_check.py --layers=2 --vocab=8192`
  runs: the 7B's shapes cut to 'SF', one sequence, the recipe's full remat."""
  sys.path.insert(0, str(REPO / 'bench'))
  import plan_pods  # pylint: disable=import-outside-toplevel
  cfg = plan_pods.config('slice')
  m = cfg.model
  assert (m.num_layers, m.layer_pattern, m.vocab_size, m.d_model, m.num_heads) == (
      2, 'SF', 8192, 4096, 32)
  assert m.remat == 'full' and cfg.data.global_batch_size == 1 and cfg.data.seq_len == 8192


def test_the_policy_sweep_times_each_policy_with_full_and_none(tmp_path):
  """--policies in miniature: every policy's step, beside full and none, and the flops
  XLA counts for it: recomputation adds flops, a save list removes some of them."""
  out = tmp_path / 'sweep.json'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.run([sys.executable, str(REPO / 'bench' / 'device_check.py'), '--tiny',
                         '--steps=3', '--policies=mlp_out,attn;outs@host', f'--out={out}'],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())['policies']
  rows = r['policies']
  assert list(rows) == ['full', 'none', 'mlp_out,attn', 'outs@host']
  assert r['optimizer update (s)'] > 0
  flops = {p: rows[p]['XLA flops'] for p in rows}
  assert flops['none'] < flops['mlp_out,attn'] < flops['full'], flops
  for row in rows.values():
    assert row['step (s)'] > 0 and row['pod-equivalent MFU'] > row['MFU'] > 0


def test_a_bad_policy_is_one_line():
  proc = subprocess.run([sys.executable, str(REPO / 'bench' / 'device_check.py'), '--tiny',
                         '--remat=qkv@disk'], cwd=REPO, capture_output=True, text=True,
                        timeout=300, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 2 and "the place after '@' can only be 'host'" in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_the_rope_lever_computes_the_models_rope():
  """--rope_matmul changes how RoPE runs, not what it computes: bit-equal in float32 and
  in bf16 (each output is one input times +-1), also at YaRN-scaled tables."""
  sys.path.insert(0, str(REPO / 'bench'))
  import device_check  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  positions = jnp.broadcast_to(jnp.arange(32), (2, 32))
  inv_freq = 1.0 / 500000.0 ** (np.arange(0, 256, 2, dtype=np.float32) / 256)
  cos, sin = model.rope_tables(positions, inv_freq, 1.2)
  x = jax.random.normal(jax.random.key(0), (2, 32, 3, 256), jnp.float32)
  for dtype in (jnp.float32, jnp.bfloat16):
    want = model.apply_rope(x.astype(dtype), cos, sin)
    got = device_check.rope_matmul(x.astype(dtype), cos, sin)
    assert got.dtype == want.dtype and bool(jnp.all(got == want))


def _gpu_check(tmp_path, *flags, timeout=600):
  out = tmp_path / 'gpu.json'
  proc = subprocess.run([sys.executable, str(REPO / 'bench' / 'device_check.py'), '--gpu',
                         '--tiny', f'--out={out}', *flags], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env=dict(os.environ, JAX_PLATFORMS='cpu'))
  last = json.loads(proc.stdout.strip().splitlines()[-1])  # ONE JSON line, last
  assert last == json.loads(out.read_text())
  return proc, last


def test_the_gpu_check_records_what_its_budget_left_out(tmp_path):
  """Past the budget no section starts; each is recorded as skipped, not dropped."""
  proc, r = _gpu_check(tmp_path, '--budget_s=1', timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert list(r['sections']) == ['versions', 'numerics', 'speed', 'step', 'memory', 'flags',
                                 'stage3', 'whole_7b']
  assert all('time budget' in s['skipped'] for s in r['sections'].values())


@pytest.mark.slow  # two children compile attention in Pallas' interpreter: ~50 s on 2 cores
def test_the_gpu_checks_cpu_stand_in_reports_versions_and_gradient_errors(tmp_path):
  proc, r = _gpu_check(tmp_path, '--sections=versions,numerics')
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  v = r['sections']['versions']
  assert v['platform'] == 'cpu' and v['jax'] and v['tiny step loss'] > 0
  assert v['peak FLOP/s'].startswith('unknown')  # a CPU is in no datasheet table
  n = r['sections']['numerics']
  rows = [*n['kernel cases'].values(), *n['7B shapes'].values()]
  assert {'ours causal', 'xla causal', 'xla window 48'} <= set(n['7B shapes'])
  for row in rows:  # forward and every gradient, relative to the float32 reference
    assert {'out', 'dq', 'dk', 'dv'} <= set(row) and row['ok']
    assert max(row[k] for k in ('out', 'dq', 'dk', 'dv')) < 1e-4  # float32 on CPU
