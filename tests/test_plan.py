"""Tests for plan.py (the AOT planner) on the 8 simulated CPU devices of conftest.py.

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

import config_checks
import errors
import model
import optim
import plan
import sharding
import train
from configs import small

REPO = pathlib.Path(__file__).resolve().parents[1]


def _config(**train_fields):
  cfg = config_checks.complete(small.get_config())
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
  tx = optim.make_optimizer(cfg.opt)
  state, _ = train.create_state(cfg, tx, sharding.make_mesh(cfg.train), jax.random.key(0))
  params, opt = sharding.state_bytes(train.abstract_state(cfg, tx),
                                     sharding.mesh_shape(cfg.train, 8))
  for device in jax.devices():
    assert params == _allocated_bytes(state.params, device)
    assert opt == _allocated_bytes(state.opt_state, device)


def test_compiled_arguments_are_state_plus_batch():
  cfg = _config()
  compiled = plan.compile_step(cfg, jax.devices()[:4])
  state, _ = train.create_state(cfg, optim.make_optimizer(cfg.opt),
                                sharding.make_mesh(cfg.train, jax.devices()[:4]),
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
  p = plan.make_plan(_config(), target_devices=64, platform='cpu')
  assert ('not sharded over the batch' in p.warning) == grows


def test_context_parallel_plan_compiles_at_two_fsdp_sizes(monkeypatch):
  # CP 4 fills --devices=4 (fsdp 1), so the second compile is on twice the devices (fsdp 2).
  seen = []

  def fake_compile(cfg, devices):
    shape = sharding.mesh_shape(cfg.train, len(devices))
    seen.append(shape)
    return plan.Compiled(len(devices), shape, 1, 0, 0, 0, int(1e9 + 4e9 / shape['fsdp']), 0.0)
  monkeypatch.setattr(plan, 'compile_step', fake_compile)
  p = plan.make_plan(_config(mesh_context=4), target_devices=32, platform='cpu',
                     devices=jax.devices()[:4])
  assert [s['fsdp'] for s in seen] == [1, 2] and all(s['context'] == 4 for s in seen)
  assert p.target_mesh == {'data': 1, 'fsdp': 8, 'context': 4, 'tensor': 1}
  assert p.temp_bytes == int(1e9 + 4e9 / 8)
  with pytest.raises(ValueError, match='raise --devices'):  # 8 of 8 devices: no 16 to compile on
    plan.make_plan(_config(mesh_context=8), target_devices=32, platform='cpu')


def test_plan_report_for_a_bigger_target(capsys):
  cfg = _config()
  p = plan.report(cfg, target_devices=32, platform='cpu')
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
    sharding.mesh_shape(cfg.train, 8)
  cfg = _config(mesh_fsdp=8)
  with pytest.raises(ValueError, match='set to -1|set one of'):
    plan.make_plan(cfg, target_devices=64, platform='cpu')


@pytest.mark.parametrize('platform,want', [
    ('tpu', 'pallas'), ('gpu', 'cudnn'), ('cpu', 'xla')])
def test_auto_attention_is_planned_as_the_target_runs_it(platform, want):
  cfg = _config()
  cfg.model.dtype = 'bfloat16'  # cuDNN takes bf16
  cfg.model.update(head_dim=128, num_heads=2, num_kv_heads=2)  # the TPU kernel's head_dim
  compiled, attention = plan.compile_config(cfg, platform)
  assert attention.startswith(want)
  assert compiled.model.attention_impl == ('xla' if want == 'xla' else 'flash_stand_in')
  assert cfg.model.attention_impl == 'auto'  # the caller's config is left alone


def test_flash_stand_in_has_flash_memory_not_xla_memory():
  # At T=1024 the XLA path's [T, S] probabilities dominate the temporaries; the
  # stand-in, like a flash kernel, has none of them.
  cfg = _config()
  cfg.data.seq_len, cfg.model.sliding_window = 1024, 1024
  cfg.model.update(head_dim=128, num_heads=2, num_kv_heads=2)  # the TPU kernel's head_dim
  xla = plan.compile_step(plan.compile_config(cfg, 'cpu')[0], jax.devices()[:4])
  flash = plan.compile_step(plan.compile_config(cfg, 'tpu')[0], jax.devices()[:4])
  probs = 4 * cfg.model.num_heads * 1024 * 128  # one [H, T, 128-key block] f32 tile, at least
  assert flash.temp + probs < xla.temp


@pytest.mark.slow
def test_7b_plan_in_seconds_with_the_pallas_kernel_in_the_tpu_step():
  start = time.time()
  proc = subprocess.run([sys.executable, 'plan.py', '--config=configs/olmo3_7b.py',
                         '--devices=8', '--platform=tpu', '--chip=v5p'],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  elapsed = time.time() - start
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert 'parameters  7,298,617,344' in out
  assert 'target      8 devices' in out and 'params         3.65 GB/device' in out
  assert 'tpu: pallas' in out
  # One query head per kv head at T 8,192: dq's buffer fits v5p's VMEM, the backward fuses.
  assert 'lowered for the TPU: flash_attention_fwd, flash_attention_dkv' in out
  assert elapsed < 120, f'{elapsed:.0f} s'


def test_plan_cli_rejects_bad_flags():
  proc = subprocess.run([sys.executable, 'plan.py', '--config=configs/small.py', '--devices=0'],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and '--devices must be >= 1' in proc.stderr


@pytest.mark.parametrize('chip', ['v5p', '7x'])
def test_step_lowered_for_a_tpu_contains_the_pallas_kernels(chip):
  # The train step on an 8-way FSDP mesh of TPUs: Mosaic kernels are not
  # auto-partitioned, so this lowering fails unless each device runs its shard.
  cfg = _config()
  cfg.model.update(num_heads=2, num_kv_heads=1, head_dim=128)
  cfg.data.seq_len = 256
  kernels = plan.tpu_kernels_in_step(cfg, chip, {'data': 1, 'fsdp': 8, 'tensor': 1})
  assert kernels == ('flash_attention_fwd', 'flash_attention_dkv')  # the backward fused
  with pytest.raises(ValueError, match='--chip'):
    plan.tpu_kernels_in_step(cfg, 'v2', {'data': 1, 'fsdp': 8, 'tensor': 1})


def test_defaults_fit_the_config_devices_and_platform():
  """Without --devices/--platform: the most devices (up to 8) the batch and micro-batch split
  over, and the TPU unless its flash kernel cannot take the model (head_dim % 128)."""
  from configs import long_context_small, olmo3_7b  # pylint: disable=import-outside-toplevel
  assert plan.default_devices(small.get_config()) == 1  # 8 instances, micro-batch 8
  assert plan.default_devices(olmo3_7b.get_config()) == 8
  assert plan.default_devices(long_context_small.get_config()) == 4  # context 4, micro-batch 4
  cfg = small.get_config()
  cfg.train.micro_batch_size = 3  # divides no per-device count of a batch of 8
  with pytest.raises(errors.ConfigError, match='--devices=N'):
    plan.default_devices(cfg)
  platform, why = plan.default_platform(small.get_config())
  assert platform == 'cpu' and 'head_dim a multiple of 128, not 64' in why
  assert plan.default_platform(olmo3_7b.get_config())[0] == 'tpu'
  xla = small.get_config()
  xla.model.attention_impl = 'xla'  # no flash kernel asked for: the TPU runs it
  assert plan.default_platform(xla)[0] == 'tpu'


def test_plan_of_the_small_config_works_as_written():
  """`python plan.py --config=configs/small.py`, the README's line, with nothing else."""
  proc = subprocess.run([sys.executable, 'plan.py', '--config=configs/small.py'], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'planning for 1 devices' in proc.stdout and 'platform cpu' in proc.stdout
  assert 'compiled    1 devices' in proc.stdout and 'cpu: xla' in proc.stdout
  bare = subprocess.run([sys.executable, 'plan.py'], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert bare.returncode == errors.EXIT_USAGE
  assert bare.stderr.strip().splitlines() == [
      'error: --config is required: the training config to plan, e.g. '
      '--config=configs/olmo3_7b.py (with any --config.* overrides).']
