"""bench/bench_gpu_step.py in its CPU miniature: our step and OLMo-core's, same tokens.

The FLOP count is checked against a float formula written out here from the model's
shapes (not model.flops_per_token), the tokens against a SHA-256 of the array this
test draws itself, the first losses against ln V (an untrained model's uniform guess).
"""

import argparse
import hashlib
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'bench'))
import bench_gpu_step  # noqa: E402  pylint: disable=wrong-import-position


def float_flops_per_token(m, T: int) -> tuple[float, float]:
  """(causal halved with windows, full S^2) in float64 from the shapes alone."""
  D, F, V, L = m.d_model, m.mlp_hidden, m.vocab_size, m.num_layers
  HK, GK = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
  matmul = 6.0 * (V * D + D + L * (D * HK + 2 * D * GK + HK * D + HK + GK + 3 * D * F))
  causal = 0.0
  for layer in range(L):
    W = m.sliding_window if m.layer_pattern[layer % len(m.layer_pattern)] == 'S' else T
    W = min(W, T)  # query i sees min(i + 1, W) keys
    causal += 12.0 * HK * sum(min(i + 1, W) for i in range(T)) / T
  return matmul + causal, matmul + 12.0 * HK * T * L


def test_the_flop_conventions_match_a_float_formula():
  args = bench_gpu_step.parser().parse_args(['--tiny', '--layers=4'])
  cfg = bench_gpu_step.slice_cfg(args)
  stated, full = float_flops_per_token(cfg.model, cfg.data.seq_len)
  got = bench_gpu_step.flop_counts(cfg)
  assert got['stated'] == pytest.approx(stated, rel=1e-6)
  assert got['full S^2'] == pytest.approx(full, rel=1e-6)
  assert got['full S^2'] > got['stated']
  # The 7B's slice (8 layers, seq 8192, windows of 4096 on 3 of 4 layers) too.
  seven = bench_gpu_step.slice_cfg(bench_gpu_step.parser().parse_args([]))
  stated, full = float_flops_per_token(seven.model, seven.data.seq_len)
  assert bench_gpu_step.flop_counts(seven)['stated'] == pytest.approx(stated, rel=1e-6)


def test_pod_equivalent_removes_all_but_one_nth_of_the_update(capsys):
  cfg = bench_gpu_step.slice_cfg(argparse.Namespace(layers=4, batch=1, tiny=True,
                                                    remat='none'))
  side = {'step (s)': 1.0, 'optimizer update (s)': 0.256, 'peak FLOP/s': 1e12,
          'tokens sha256': 'x', 'peak memory (GB)': None, 'loss': 6.2, 'attention': 'xla'}
  r = bench_gpu_step.summarize(cfg, {'ours': side, 'olmo_core': dict(side, **{
      'step (s)': 2.0})}, pod_devices=256)
  ours = r['sides']['ours']
  assert ours['tokens/s'] == pytest.approx(128.0)
  assert ours['pod-equivalent tokens/s'] == pytest.approx(128.0 / (1 - 0.255))
  assert r['ours / OLMo-core tokens/s'] == pytest.approx(2.0) and r['same tokens']
  # An update timed alone at or past the whole step that holds it is noise: no figure.
  noisy = bench_gpu_step.summarize(cfg, {'ours': dict(side, **{'optimizer update (s)': 1.2}),
                                         'olmo_core': side}, pod_devices=256)
  assert noisy['sides']['ours']['pod-equivalent tokens/s'] is None
  assert noisy['sides']['ours']['pod-equivalent MFU'] is None
  assert noisy['ours / OLMo-core pod-equivalent'] is None
  bench_gpu_step.report(noisy)  # prints n/a, does not raise
  assert 'pod-equivalent n/a' in capsys.readouterr().out


@pytest.mark.slow  # two processes, JAX and torch each: ~20 s on 2 cores
def test_both_sides_train_the_same_tokens_and_report_sane_numbers(tmp_path):
  out = tmp_path / 'step.json'
  proc = subprocess.run([sys.executable, str(REPO / 'bench' / 'bench_gpu_step.py'), '--tiny',
                         '--layers=4', '--steps=2', '--warmup=1', '--seed=3', f'--out={out}'],
                        cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  r = json.loads(out.read_text())
  tokens = np.random.default_rng(3).integers(2, 500, (1, 129), dtype=np.int32)
  h = hashlib.sha256()
  for a in (tokens[:, :-1], tokens[:, 1:]):
    h.update(a.astype(np.int64).tobytes())
  ours, theirs = r['sides']['ours'], r['sides']['olmo_core']
  assert ours['tokens sha256'] == theirs['tokens sha256'] == h.hexdigest()[:16]
  for side in (ours, theirs):
    assert side['loss'] == pytest.approx(math.log(512), rel=0.05)  # untrained: ~ln V
    assert side['tokens/s'] > 0 and 0 < side['MFU'] < side['MFU (full S^2)'] < 1
    assert side['pod-equivalent tokens/s'] > side['tokens/s']
  assert theirs['attention'] == "OLMo-core backend 'torch'"  # CPU: PyTorch SDPA
  assert r['ours / OLMo-core tokens/s'] > 0
