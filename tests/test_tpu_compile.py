"""The TPU's own compiler, on this CPU machine: libtpu (the test extra installs it)
compiles for a TPU slice that libtpu describes (plan.tpu_devices), no chip needed.

What the Pallas-lowering tests in test_kernels.py cannot check, this does: Mosaic's
compile inside libtpu (layouts, the kernels' VMEM fit at the block table's sizes),
and XLA's TPU memory assignment of the whole train step. References: the state's
bytes from sharding.state_bytes (tested against really allocated arrays in
test_plan.py), a float formula for the batch, and libtpu's own HBM limit.

libtpu guards the chips with /tmp/libtpu_lockfile, taken whenever the library loads:
two xdist workers (or a worker and a plan.py child) loading it at once made one fail
("Internal error when accessing libtpu multi-process lockfile"). plan.tpu_devices
sets ALLOW_MULTIPLE_LIBTPU_LOAD, safe because a compile for a described slice never
opens a chip; test_parallel_loads_share_the_lock runs that race on purpose.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pytest

import config_checks
import kernels
import model
from kernels import xla
import optim
import plan
import sharding
import train
from configs import small

REPO = pathlib.Path(__file__).resolve().parents[1]
# A small model the TPU kernel takes (head_dim 128), bf16 like the 7B, on a v5e:2x2. Its
# 512 tokens, not 1,024: libtpu compiles the step in 19 s instead of 25 (one run each).
SMALL_TPU = ['--config=configs/small.py', '--config.model.head_dim=128',
             '--config.model.num_heads=2', '--config.model.num_kv_heads=2',
             '--config.model.dtype=bfloat16', '--config.data.seq_len=512',
             '--config.model.sliding_window=256', '--config.train.micro_batch_size=1']


def _small_tpu_config():
  """SMALL_TPU's config, as plan.py completes it from those flags."""
  cfg = config_checks.complete(small.get_config())
  cfg.model.update(head_dim=128, num_heads=2, num_kv_heads=2, dtype='bfloat16')
  cfg.data.seq_len, cfg.model.sliding_window, cfg.train.micro_batch_size = 512, 256, 1
  return cfg


def _plan(*args, env=None, timeout=600):
  return subprocess.run([sys.executable, 'plan.py', *args], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env=env)


def test_libtpu_is_installed_for_the_tests():
  assert plan.libtpu_version(), "the test extra installs libtpu: pip install '.[test]'"


def _attention_grad(topology, head_dim, window, segments, block=None, t=8192, fuse=None,
                    backward=True):
  """libtpu's compile of the flash kernel's forward and backward (T = 8,192: the 7B's); of
  the forward alone without `backward`."""
  mesh = Mesh(plan.tpu_devices(topology)[:1], ('x',))
  replicated = NamedSharding(mesh, P())
  q = jax.ShapeDtypeStruct((1, t, 4, head_dim), jnp.bfloat16, sharding=replicated)
  kv = jax.ShapeDtypeStruct((1, t, 2, head_dim), jnp.bfloat16, sharding=replicated)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32, sharding=replicated) if segments else None

  def loss(q, k, v, seg):
    o = kernels.flash_attention(q, k, v, window=window, segment_ids_BT=seg, block_q=block,
                                block_kv=block, fuse_backward=fuse)
    return jnp.sum(o.astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # the kernels see the chip
    f = jax.grad(loss, argnums=(0, 1, 2)) if backward else loss
    lowered = jax.jit(f).lower(q, kv, kv, seg)
    return lowered.as_text(), lowered.compile()


# Every case on the v5e, the backward fused (dq summed in VMEM) and in two kernels; the
# largest tiles (head_dim 256, window and segment ids) on every other chip of the block
# table, with the backward each chip's VMEM picks (None).
CASES = ([('v5e:1x1', k, w, s, f) for k in (128, 256) for w, s in ((None, False), (4096, True))
          for f in (True, False)]
         + [(t, 256, 4096, True, None)
            for t in ('v4:1x1x1', 'v5p:1x1x1', 'v6e:1x1', 'tpu7x:1x1x1')])


@pytest.mark.parametrize('topology,head_dim,window,segments,fuse', CASES)
def test_mosaic_compiles_the_kernels_at_the_block_tables_sizes(topology, head_dim, window,
                                                               segments, fuse):
  text, compiled = _attention_grad(topology, head_dim, window, segments, fuse=fuse)
  assert 'flash_attention_fwd' in text and 'flash_attention_dkv' in text
  # None: at K = 256 with two query heads per kv head, the fused backward's [2, 8192, 256]
  # float32 dq buffer and its output block (34 MB) pass a third of every chip's VMEM limit.
  assert ('flash_attention_dq' in text) == (fuse is not True)
  assert 'tpu_custom_call' in compiled.as_text()  # Mosaic kernels in the TPU executable


def test_a_block_too_big_for_vmem_fails_the_mosaic_compile():
  # 2048 x 2048 f32 logits tiles are 16 MiB each: more than a v4 core's VMEM limit.
  # What the lowering in test_kernels.py accepts, libtpu's compile refuses. The forward
  # kernel alone, at head_dim 128: the gradient's compile is refused for the same kernel,
  # in over twice the time (53 s against 20 s, one run), and head_dim 256 took 13.6 s
  # against 8.0 s to be refused ("31.84M" and "25.84M of 16.00M vmem").
  with pytest.raises(jax.errors.JaxRuntimeError, match='memory space vmem'):
    _attention_grad('v4:1x1x1', 128, None, False, block=2048, t=2048, backward=False)


# plan.py as it is, whose tpu_plan's Plans also go to the JSON file argv[1]: absl's app.run
# is handed plan.py's main, through whose globals tpu_plan is wrapped before it runs.
PLAN_RECORDER = '''
import dataclasses, json, os, runpy, sys
from absl import app
out, sys.argv = sys.argv[1], [os.path.join({repo!r}, 'plan.py'), *sys.argv[2:]]
sys.path.insert(0, {repo!r})
run = app.run
def recording_run(main, **kwargs):
  names = main.__globals__
  tpu_plan = names['tpu_plan']
  def recorded(*args, **kw):
    p = tpu_plan(*args, **kw)
    with open(out, 'a') as f:
      f.write(json.dumps(dataclasses.asdict(p)) + '\\n')
    return p
  names['tpu_plan'] = recorded
  run(main, **kwargs)
app.run = recording_run
runpy.run_path(sys.argv[0], run_name='__main__')
'''


@pytest.fixture(scope='module')
def small_step(tmp_path_factory):
  """plan.py's libtpu compile of the small step for a v5e:2x2, its attention output
  offloaded to host memory: (the process, its Plan). One compile (~20-40 s) for the command
  line's report, the Plan's numbers and the policy sweep's row."""
  scratch = tmp_path_factory.mktemp('small_step')
  recorder, out = scratch / 'record_plan.py', scratch / 'plans.jsonl'
  recorder.write_text(PLAN_RECORDER.format(repo=str(REPO)))
  proc = subprocess.run([sys.executable, str(recorder), str(out), *SMALL_TPU,
                         '--config.model.remat=attn@host', '--topology=v5e:2x2'], cwd=REPO,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (recorded,) = [json.loads(line) for line in out.read_text().splitlines()]
  compiles = [plan.Compiled(**c) for c in recorded.pop('compiles')]
  return proc, plan.Plan(**recorded, compiles=compiles)


def test_plan_compiles_the_small_step_with_the_tpu_compiler(small_step):
  proc, _ = small_step
  out = proc.stdout
  assert 'planning for v5e:2x2 with the TPU compiler (libtpu ' in out
  assert 'compiler    TPU: libtpu' in out and 'no extrapolation' in out
  assert "compiled    4 devices, mesh {'data': 1, 'fsdp': 4, 'tensor': 1}, 2 micro-batches" in out
  assert 'compiled by libtpu: flash_attention_fwd, flash_attention_dkv' in out  # fused
  assert 'stand-in' not in out and 'TPU v5e    16 GB: fits' in out
  assert 'remat attn@host' in out and 'offloaded activations 0.000 ' not in out
  assert 'Failed to find host bounds' not in proc.stderr  # libtpu kept off the metadata server


def test_tpu_arguments_are_the_sharded_state_and_batch(small_step):
  # The Plan plan.tpu_plan made for the command above (SMALL_TPU), against this config.
  cfg = _small_tpu_config()
  _, p = small_step
  (c,) = p.compiles
  shape = {'data': 1, 'fsdp': 4, 'tensor': 1}
  assert c.mesh_shape == shape and p.topology == 'v5e:2x2'
  params, opt = sharding.state_bytes(train.abstract_state(cfg, optim.make_optimizer(cfg.opt)),
                                     shape)
  batch = 8 // 4 * (512 * 4 * 2 + 1)  # tokens and labels int32, the bool mask: 2 rows
  # Less what the step never reads (last step's lr, grad_norm, skipped: pruned as on
  # CPU), plus the TPU's tile padding of small arrays (norm scales, scalars): a few KB.
  assert abs(c.argument - (params + opt + batch)) < 1e-3 * c.argument
  assert c.alias > 0.99 * (params + opt)  # the donated state is updated in place
  assert 0 < c.temp < 2e9 and p.peak_bytes == c.argument + c.output - c.alias + c.temp
  assert not p.temp_extrapolated and p.compiler == 'tpu' and p.tpu_kernels


def test_a_step_too_big_for_the_chip_is_reported_not_raised():
  # 64 layers of d_model 2048 in fp32 with Adam: ~48 GB of state on one 16 GB v5e chip.
  proc = _plan(*SMALL_TPU, '--config.model.num_layers=64', '--config.model.d_model=2048',
               '--config.model.mlp_hidden=8192', '--config.data.global_batch_size=1',
               '--topology=v5e:1x1')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'DOES NOT FIT the chip' in proc.stdout and 'RESOURCE_EXHAUSTED' in proc.stdout
  assert 'TPU v5e    16 GB: does NOT fit' in proc.stdout
  assert 'GB/device at least (the state + what libtpu asked for)' in proc.stdout
  assert 'Traceback' not in proc.stderr


def test_without_libtpu_the_cpu_compile_plans_the_slice_and_says_so(tmp_path):
  # A sitecustomize that makes libtpu look absent, as on a machine without it.
  (tmp_path / 'sitecustomize.py').write_text(
      'import importlib.metadata as m\n_version = m.version\n'
      'def version(name):\n'
      '  if name == "libtpu":\n    raise m.PackageNotFoundError(name)\n'
      '  return _version(name)\nm.version = version\n')
  env = dict(os.environ, PYTHONPATH=f'{tmp_path}{os.pathsep}{os.environ.get("PYTHONPATH", "")}')
  proc = _plan(*SMALL_TPU, '--config.data.global_batch_size=16', '--devices=2',
               '--topology=v5e:2x4', env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert 'libtpu is not installed: planning v5e:2x4 from a CPU compile on simulated' in out
  assert 'compiler    CPU: simulated devices, temp extrapolated' in out
  assert 'target      8 devices' in out and 'lowered for the TPU:' in out


@pytest.mark.parametrize('args,message', [
    (['--topology=v5x:2x2'], 'is not a TPU slice name'),
    (['--topology=v5e:2'], 'is not a TPU slice name'),
    (['--topology=v5e:3x3'], 'libtpu cannot describe'),
    (['--topology=v5e:2x2', '--target_devices=8'], 'drop --target_devices'),
    (['--topology=v5e:2x2', '--devices=4'], 'drop --devices'),
])
def test_bad_topologies_name_the_fix(args, message):
  proc = _plan('--config=configs/small.py', *args, timeout=120)
  assert proc.returncode == 2 and 'Traceback' not in proc.stderr
  (line,) = proc.stderr.strip().splitlines()
  assert line.startswith('error: ') and message in line


@pytest.mark.fresh_interpreter  # the children must set libtpu's variables themselves
def test_parallel_loads_share_the_lock():
  # Without ALLOW_MULTIPLE_LIBTPU_LOAD, 2 of 3 such loads failed in each of 4 trials here.
  code = ('import plan; print(len(plan.tpu_devices("v5e:2x2")))')
  env = {k: v for k, v in os.environ.items() if k not in xla.LIBTPU_PLACEHOLDERS}
  procs = [subprocess.Popen([sys.executable, '-c', code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(env, JAX_PLATFORMS='cpu')) for _ in range(3)]
  for proc in procs:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == '4', err[-2000:]


@pytest.mark.fresh_interpreter  # a forked child would inherit the zygote's imports
def test_libtpu_stays_quiet_on_a_host_without_tpu_chips():
  # Without the placeholders (conftest.py sets them for the whole run), as a user's shell;
  # the entry points (train.py, plan.py, bench/) call set_cpu_flags before a backend starts
  # (importing the model sets nothing: tests/test_kernels_gpu.py).
  env = {k: v for k, v in os.environ.items()
         if k not in xla.LIBTPU_PLACEHOLDERS and k != 'JAX_PLATFORMS'}
  code = ('from kernels import xla; xla.set_cpu_flags(); import model, jax; '
          'print(jax.devices()[0].platform)')
  proc = subprocess.run([sys.executable, '-c', code],
                        cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
  assert proc.returncode == 0 and proc.stdout.strip() == 'cpu', proc.stderr[-2000:]
  assert not xla.has_tpu_chips()
  assert 'TPU' not in proc.stderr and 'E0000' not in proc.stderr, proc.stderr[-2000:]


def test_device_check_plans_the_chips_fit_with_libtpu():
  """bench/device_check.py --fit's planning half (the chip runs the other): libtpu's compile
  of the slice for the chip's one-chip topology, one more sequence per step each time."""
  proc = subprocess.run([sys.executable, 'bench/device_check.py', '--predict_fit', '--tiny',
                         '--device_kind=TPU v5 lite', '--limit_gb=15', '--fit_max=2'],
                        cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r['planned by'] == 'libtpu for v5e:1x1' and r['most sequences'] == 2
  one, two = r['planned peaks (GB)']['1'], r['planned peaks (GB)']['2']
  assert 0 < one < two < 15  # a second sequence's activations and batch


# bench/bench_attention.py's peer, JAX's splash attention: it must compute what the kernel
# computes (scale, window, documents), and compile for the chip it is timed on.

def _bench_attention():
  from absl import flags  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, str(REPO / 'bench'))
  import bench_attention  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS(['bench_attention'])
  return bench_attention


@pytest.mark.parametrize('window,documents', [(None, False), (200, False), (200, True)])
def test_splash_peer_computes_the_models_attention(window, documents):
  rng = np.random.default_rng(window or 0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 512, 2, 128)), jnp.float32) for _ in range(3))
  seg = jnp.asarray(np.cumsum(np.isin(np.arange(512), [100, 300]))[None], jnp.int32)
  seg = seg if documents else None
  want = model.reference_attention(q, k, v, window=window, segment_ids_BT=seg)
  got = _bench_attention().splash(q, k, v, window=window, segment_ids_BT=seg, block=128,
                                  interpret=True)
  np.testing.assert_allclose(got, want, atol=2e-5)


def test_splash_peer_compiles_for_the_v5e():
  mesh = Mesh(plan.tpu_devices('v5e:1x1'), ('x',))
  replicated = NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct((1, 8192, 32, 128), jnp.bfloat16, sharding=replicated)
  seg = jax.ShapeDtypeStruct((1, 8192), jnp.int32, sharding=replicated)
  splash = _bench_attention().splash

  def loss(q, k, v, s):
    return jnp.sum(splash(q, k, v, segment_ids_BT=s, block=1024).astype(jnp.float32))

  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg).compile()
  assert 'tpu_custom_call' in compiled.as_text()


def test_full_remat_recomputes_the_forward_also_unscanned():
  """A model of one layer-pattern period is not scanned; its remat must still happen.

  Without an optimisation barrier libtpu merged the lone group's recomputation with its
  forward: every policy compiled to the flops (and, on a v5e, the time) of 'none'. A
  recomputed forward adds about half of the backward's matmul flops. (The scanned model's
  remat: test_each_named_policy_saves_what_it_names, whose bounds have two groups.)
  """
  mesh = Mesh(plan.tpu_devices('v5e:1x1')[:1], ('x',))
  replicated = NamedSharding(mesh, P())
  tokens = jnp.zeros((1, 256), jnp.int32)  # one row: a third of (4, 256)'s compile time
  flops = {}
  for policy in ('none', 'full'):
    cfg = config_checks.complete(small.get_config()).model
    cfg.update(vocab_size=256, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32,
               mlp_hidden=512, num_layers=2, layer_pattern='SF', sliding_window=64,
               remat=policy, attention_impl='xla')
    shapes = jax.eval_shape(lambda cfg=cfg: model.init_params(cfg, jax.random.key(0)))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                          shapes)
    loss = lambda p, cfg=cfg: jnp.mean(model.logits(p, tokens, cfg).astype(jnp.float32) ** 2)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    flops[policy] = compiled.cost_analysis()['flops']
  assert flops['full'] > 1.2 * flops['none'], flops


# 512 tokens: libtpu compiles each policy in 5-6 s, against 8-10 s at 1,024 (and at 256
# 'none' keeps no temporaries to compare the save lists' with).
REMAT_T = 512


def _remat_compile(policy: str, mesh: Mesh) -> tuple[float, int, int, int]:
  """(XLA flops, temp bytes, host temp bytes, forward kernels) of a 2-group bf16 model's
  gradient under `policy`, compiled by libtpu with the Pallas kernel."""
  replicated = NamedSharding(mesh, P())
  cfg = config_checks.complete(small.get_config()).model
  cfg.update(vocab_size=512, d_model=256, num_heads=2, num_kv_heads=2, head_dim=128,
             mlp_hidden=768, num_layers=4, layer_pattern='SF', sliding_window=256,
             remat=policy, attention_impl='pallas', dtype='bfloat16')
  model.validate(cfg)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
                        shapes)
  tokens = jnp.zeros((1, REMAT_T), jnp.int32)
  loss = lambda p: jnp.mean(model.logits(p, tokens, cfg).astype(jnp.float32) ** 2)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  memory = compiled.memory_analysis()
  forward_kernels = sum('custom-call(' in line and 'flash_attention_fwd' in line
                        for line in compiled.as_text().splitlines())
  return (compiled.cost_analysis()['flops'], memory.temp_size_in_bytes,
          memory.host_temp_size_in_bytes, forward_kernels)


@pytest.fixture(scope='module')
def remat_bounds():
  mesh = Mesh(plan.tpu_devices('v5e:1x1')[:1], ('x',))
  return mesh, {policy: _remat_compile(policy, mesh) for policy in ('none', 'full')}


@pytest.mark.slow  # a libtpu compile with the Pallas kernels per policy: ~15-40 s each
@pytest.mark.parametrize('policy', ['save_qkv', 'outs,attn@host'])
def test_each_named_policy_saves_what_it_names(remat_bounds, policy):
  """Between full and none: fewer flops than full (what it keeps is not recomputed) and
  less memory than none; a saved attention output and log-sum-exp spare the forward
  kernel; an offloaded activation lives in host memory."""
  mesh, bounds = remat_bounds
  flops, temp, host, forward = _remat_compile(policy, mesh)
  (none_flops, none_temp, _, none_forward), (full_flops, _, _, full_forward) = (
      bounds['none'], bounds['full'])
  assert none_flops < flops < full_flops, (flops, none_flops, full_flops)
  assert full_flops > 1.2 * none_flops  # the scanned groups' forward recomputed in full
  assert temp < none_temp
  # Two layers: the forward kernel runs twice, and twice more where it is recomputed.
  assert (none_forward, full_forward) == (2, 4)
  assert forward == (2 if 'attn' in policy else 4)
  assert (host > 0) == ('@host' in policy)
  if policy == 'save_qkv':  # the q, k and v matmuls of the group's 2 layers
    d, t = 256, REMAT_T  # (XLA counts a scan's body once, whatever its trip count)
    assert full_flops - flops == pytest.approx(2 * (2 * t * d * 3 * d), rel=0.02)


def test_plan_sweeps_remat_policies_with_host_memory_per_host(small_step, monkeypatch,
                                                             capsys):
  """The sweep's row from libtpu's plan of the same step (the fixture's compile of
  attn@host: the sweep would compile exactly that program again)."""
  _, compiled = small_step
  cfg = _small_tpu_config()
  planned = []

  def tpu_plan(one, topology):
    planned.append((one.model.remat, topology))
    return compiled
  monkeypatch.setattr(plan, 'tpu_plan', tpu_plan)
  plans = plan.sweep(cfg, 'v5e:2x2', ['attn@host'], budget_gb=15)
  out = capsys.readouterr().out
  assert [policy for policy, _ in plans] == ['attn@host']
  assert planned == [('attn@host', 'v5e:2x2')] and cfg.model.remat == 'none'
  row = next(line.split() for line in out.splitlines()
             if line.split() and line.split()[0] == 'attn@host')
  params, opt = sharding.state_bytes(train.abstract_state(cfg, optim.make_optimizer(cfg.opt)),
                                     {'data': 1, 'fsdp': 4, 'tensor': 1})
  # host GB per host: 4 devices' state copies, plus the offloaded attention output.
  assert float(row[2]) > 4 * (params + opt) / 1e9 and row[-1] == 'yes'
  assert "least recomputation that fits: --config.model.remat='attn@host'" in out
  # The same Plan over the per-device budget: no policy fits.
  plan.sweep(cfg, 'v5e:2x2', ['attn@host'], budget_gb=compiled.peak_bytes / 2 / plan.GB)
  out = capsys.readouterr().out
  assert out.splitlines()[-2].split()[-1] == 'no' and 'no policy fits' in out


def test_a_policy_whose_offload_outgrows_the_host_is_refused():
  """The host's need by hand: 4 devices' offload and state copies, against 4 x 48 GB."""
  p = plan.Plan(param_count=1, flops_per_token=1, flops_per_step=1, target_devices=16,
                target_mesh={'data': 1, 'fsdp': 16, 'tensor': 1}, params_bytes=int(2e9),
                opt_state_bytes=int(4e9), batch_bytes=0, temp_bytes=0, peak_bytes=int(9e9),
                temp_extrapolated=False, compiles=[], platform='tpu', attention='pallas',
                compiler='tpu', topology='v5e:4x4', host_bytes=int(43e9), devices_per_host=4)
  assert plan.devices_per_host('v5e:4x4') == 4 and plan.host_budget_gb(p) == 192
  assert p.host_need_bytes == 4 * int(49e9) and not plan.fits_host(p)  # 196 GB
  p.host_bytes = int(41e9)  # 4 x 47 GB: fits
  assert plan.fits_host(p)
  assert 'fits' in plan.format_plan(config_checks.complete(small.get_config()), p)
  p.host_bytes = int(43e9)
  assert 'DOES NOT FIT' in plan.format_plan(config_checks.complete(small.get_config()), p)


def test_policies_need_a_named_slice():
  proc = _plan('--config=configs/small.py', '--policies=candidates')
  assert proc.returncode == 2 and '--topology' in proc.stderr and 'Traceback' not in proc.stderr
