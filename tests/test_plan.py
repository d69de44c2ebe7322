"""Tests for plan.py (the AOT dry run) on the 8 simulated CPU devices of conftest.py.

References: per-device bytes measured from really allocated, sharded train
states (train.create_state) and from real compiles; the 7B numbers from
model.param_count's tested constants.
"""

import pathlib
import subprocess
import sys
import time

import jax
import pytest

import model
import plan
import train
from configs import small

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(**train_fields):
  cfg = small.get_config()
  cfg.model.num_layers, cfg.model.d_model, cfg.model.mlp_hidden = 4, 128, 256
  cfg.data.seq_len, cfg.data.global_batch_size, cfg.train.micro_batch_size = 64, 16, 1
  cfg.train.update(train_fields)
  return cfg


def _allocated_bytes(tree, device) -> int:
  """Bytes of `tree`'s shards that live on `device`."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


@pytest.mark.parametrize('mesh', [dict(mesh_data=1, mesh_fsdp=-1),
                                  dict(mesh_data=2, mesh_fsdp=-1),
                                  dict(mesh_data=1, mesh_fsdp=4, mesh_tensor=2)])
def test_state_bytes_equal_a_real_sharded_state(mesh):
  cfg = _config(**mesh)
  state, _ = train.create_state(cfg, train.make_mesh(cfg.train), jax.random.key(0))
  shape = plan.target_mesh_shape(cfg.train, 8)
  params, opt = plan.state_bytes(plan.abstract_state(cfg), shape)
  for device in jax.devices():
    assert params == _allocated_bytes(state.params, device)
    assert opt == _allocated_bytes(state.opt_state, device)


def test_compiled_arguments_are_state_plus_batch():
  cfg = _config()
  compiled = plan.compile_step(cfg, jax.devices()[:4])
  state, _ = train.create_state(cfg, train.make_mesh(cfg.train, jax.devices()[:4]),
                                jax.random.key(0))
  batch = 16 // 4 * (64 * 4 * 2 + 1)  # tokens and labels int32, the bool mask: 4 rows each
  # XLA prunes the arguments the step never reads: last step's lr, grad_norm, skipped.
  assert compiled.argument == _allocated_bytes(state, jax.devices()[0]) + batch - 4 - 4 - 1
  assert compiled.mesh_shape == {'data': 1, 'fsdp': 4, 'tensor': 1}
  assert compiled.accum == 4 and compiled.temp > 0


def test_extrapolation_recovers_a_plus_b_over_fsdp():
  # temp = 5 GB + 40 GB / fsdp, "measured" at fsdp 8 and 16; the 512-way value follows.
  compiled = [plan.Compiled(n, {'data': 1, 'fsdp': n, 'tensor': 1}, 1, 0, 0, 0,
                            int(5e9 + 40e9 / n), 0.0) for n in (8, 16)]
  assert abs(plan.extrapolate_temp(*compiled, 512) - (5e9 + 40e9 / 512)) <= 2
  with pytest.raises(ValueError, match='same FSDP size'):
    plan.extrapolate_temp(compiled[0], compiled[0], 512)


@pytest.mark.parametrize('grows', [True, False])
def test_warns_when_temp_grows_with_the_device_count(monkeypatch, grows):
  # Growing temp means replicated activations: a + b/fsdp cannot describe it.
  def fake_compile(cfg, devices):
    n = len(devices)
    return plan.Compiled(n, {'data': 1, 'fsdp': n, 'tensor': 1}, 1, 0, 0, 0,
                         int(1e9 * n if grows else 1e9 / n), 0.0)
  monkeypatch.setattr(plan, 'compile_step', fake_compile)
  p = plan.make_plan(_config(), target_devices=64)
  assert ('not sharded over the batch' in p.warning) == grows


def test_plan_report_for_a_bigger_target(capsys):
  cfg = _config()
  p = plan.report(cfg, target_devices=32)
  out = capsys.readouterr().out
  assert p.temp_extrapolated and [c.devices for c in p.compiles] == [4, 8]
  assert p.target_mesh == {'data': 1, 'fsdp': 32, 'tensor': 1}
  assert p.param_count == model.param_count(cfg.model)
  assert p.flops_per_step == model.flops_per_token(cfg.model, 64) * 16 * 64
  assert p.peak_bytes == p.params_bytes + p.opt_state_bytes + p.batch_bytes + p.temp_bytes
  assert f'parameters  {p.param_count:,}' in out and 'target      32 devices' in out
  for name in plan.BUDGETS_GB:
    assert name in out
  assert p.fits(p.peak_bytes / plan.GB) and not p.fits(p.peak_bytes / plan.GB * 0.99)


def test_bad_meshes_name_the_fix():
  cfg = _config(mesh_data=3)
  with pytest.raises(ValueError, match='train.mesh_'):
    plan.target_mesh_shape(cfg.train, 8)
  cfg = _config(mesh_fsdp=8)
  with pytest.raises(ValueError, match='set to -1|set one of'):
    plan.make_plan(cfg, target_devices=64)


@pytest.mark.slow
def test_7b_dry_run_on_this_machine_in_under_two_minutes():
  start = time.time()
  proc = subprocess.run([sys.executable, 'train.py', '--config=configs/olmo3_7b.py', '--dry_run',
                         '--dry_run_devices=8', '--config.model.attention_impl=pallas'],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  elapsed = time.time() - start
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'parameters  7,298,617,344' in proc.stdout
  assert 'target      8 devices' in proc.stdout and 'params         3.65 GB/device' in proc.stdout
  assert elapsed < 120, f'{elapsed:.0f} s'
