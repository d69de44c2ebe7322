"""Ahead-of-time planning: will this config's train step fit, and how much work is it?

    python plan.py --config=configs/olmo3_7b.py --topology=v5e:16x16   # the TPU's compiler
    python plan.py --config=configs/olmo3_7b.py --devices=8 [--target_devices=512]
        [--platform=tpu|gpu|cpu] [--chip=v5p]
    python plan.py --config=configs/small.py     # the defaults below: 1 device, cpu

--topology names a TPU slice as libtpu does (v4:2x2x2, v5e:16x16, v5p:4x4x8,
v6e:8x8, tpu7x:2x2x1). Where libtpu is installed (`pip install
'libtpu==0.0.42.*'`, part of the test extra; no TPU needed) the real train
step, Pallas kernels included, is compiled by the TPU's own compiler for that
slice's devices, and its `memory_analysis()` is the report: per-device memory
as the pod will allocate it, no stand-in and no extrapolation. A step that
does not fit the chip's HBM fails that compile; the report says so and by how
much. Without libtpu --topology falls back to the CPU compile below,
extrapolated to the slice's device count, and says so.

Without --devices it compiles for the most devices up to 8 that the config's
batch splits over (data.global_batch_size into train.micro_batch_size rows
per device, on a mesh train.mesh_* allows): 8 for the 7B, 1 for
configs/small.py (8 instances, micro-batch 8). Without --platform it plans
for the TPU, unless the TPU's flash kernel cannot take the model (head_dim
not a multiple of 128 with attention_impl 'auto' or 'pallas', as
configs/small.py, a CPU config, has): then for the CPU. The report says which.

compiles the real train step (train.make_train_step on sharding.py's shardings) for
--devices simulated CPU devices without allocating a single weight: the state
is `jax.eval_shape`d, the batch is abstract, and XLA's `memory_analysis()` of
the compiled step gives the per-device argument, output and temporary bytes.
The report prints parameter count, FLOPs per token and per step, parameter /
optimizer-state / temporary memory per device, and whether the step fits the
per-device memory of the accelerators in `BUDGETS_GB`.

It plans what the target platform runs: `attention_impl='auto'` is resolved
for --platform (kernels.resolve). A TPU or GPU flash kernel does not compile
for CPU, so the CPU compile swaps it, through the config, for
attention_impl='flash_stand_in': a function with the kernel's shapes and O(T)
memory (no [T, S] scores), so the temporaries are a flash kernel's; FLOPs come
from model.flops_per_token, not from the compile. For a TPU target the whole
train step is also lowered for --chip with the real Pallas kernel, and the
report names the kernels found in it.

Target meshes bigger than the CPU can compile quickly (the 7B on 512 chips)
are reached by extrapolation (--target_devices): parameter and optimizer
bytes per device are exact for any mesh (shard shapes on an AbstractMesh); the
temporaries are measured on two compiled meshes whose FSDP axis differs by 2x
and fitted as a + b / fsdp (a: activations and one gathered layer group, fixed
per micro-batch; b: gradient accumulators and optimizer temporaries, sharded
like the state), then evaluated at the target's FSDP size.

--policies (with --topology and libtpu) plans the step under each remat policy
(';'-separated, or 'candidates': REMAT_CANDIDATES) and prints one row each:
device memory per device, host memory per host (the activations the policy
offloads, and the state's host copy a checkpoint stages, against the host's RAM
in HOST_GB_PER_CHIP), XLA's flops and whether it fits --budget_gb; then names
the fitting policy with the least recomputation (docs/remat.md). A single
--topology plan whose host memory does not fit the host is refused (exit 2).

One module of ~740 lines: the CPU and TPU compiles, the GPU and HSDP targets,
the report and the sweep all build and read the same Plan from the same
compile; split apart, each part would reach into the others' internals.

Shapes: B global batch, T sequence.
"""

import contextlib
import dataclasses
import importlib.metadata
import os
import re
import time
from typing import Any

from absl import app, flags
import jax
from jax.sharding import AbstractDevice
from jax.sharding import AbstractMesh, AxisType, Mesh
import ml_collections
from ml_collections import config_flags
import numpy as np

import config_checks
import errors
import kernels
from kernels import flash_kernels
from kernels import gpu_flags
import model
import optim
import sharding
from tokens import batches
import train

# Per-device memory (decimal GB, vendor spec sheets): TPU v4 32 GB HBM2, v5e 16 GB,
# v5p 95 GB HBM2e, v6e (Trillium) 32 GB, TPU7x (Ironwood) 192 GB per chip = 96 per
# device (two TensorCores, two jax devices), H100 SXM 80 GB, H200 141 GB.
BUDGETS_GB = {'TPU v4': 32, 'TPU v5e': 16, 'TPU v5p': 95, 'TPU v6e': 32, 'TPU7x': 96,
              'H100': 80, 'H200': 141}
GPU_NODE_DEVICES = 8  # GPUs of one H100 / H200 node (HGX / DGX boards; GKE A3, A3 Ultra)
GB = 1e9
# Host RAM per TPU chip (decimal GB), from the TPU VM machine types GKE and Cloud TPU
# list: v4 ct4p-hightpu-4t 407 GB for 4 chips, v5e ct5lp-hightpu-4t 192 GB for 4
# (1t: 48 for 1, 8t: 384 for 8), v5p ct5p-hightpu-4t 448 GB for 4, v6e ct6e-standard-4t
# 720 GB for 4. A remat policy's host offload is held against it (TPU7x: not listed).
HOST_GB_PER_CHIP = {'TPU v4': 407 / 4, 'TPU v5e': 48, 'TPU v5p': 112, 'TPU v6e': 180}

# --topology generations: libtpu's name -> (chip config, the chip in kernels' block
# table, BUDGETS_GB entry). v4 and v5p run 'megacore': one jax device per chip.
TPU_GENERATIONS = {
    'v4': ('megacore', 'v4', 'TPU v4'),
    'v5e': ('default', 'v5e', 'TPU v5e'),
    'v5p': ('megacore', 'v5p', 'TPU v5p'),
    'v5': ('megacore', 'v5p', 'TPU v5p'),  # libtpu's older name for v5p
    'v6e': ('default', 'v6e', 'TPU v6e'),
    'tpu7x': ('default', '7x', 'TPU7x'),
}


@dataclasses.dataclass
class Compiled:
  """What one AOT compile on `devices` simulated devices measured (bytes per device)."""
  devices: int
  mesh_shape: dict[str, int]
  accum: int
  argument: int
  output: int
  alias: int
  temp: int
  seconds: float
  out_of_memory: str = ''  # the TPU compiler's refusal, when the step does not fit its HBM
  kernels: tuple[str, ...] = ()  # Pallas kernels in the step compiled for TPU devices
  host_temp: int = 0  # host memory of activations a remat policy offloads, per device
  flops: float = 0.0  # XLA's count per device, recomputation included, each loop body once


@dataclasses.dataclass
class Plan:
  """The planner's numbers for the target mesh (bytes per device)."""
  param_count: int
  flops_per_token: int
  flops_per_step: int
  target_devices: int
  target_mesh: dict[str, int]
  params_bytes: int
  opt_state_bytes: int
  batch_bytes: int
  temp_bytes: int
  peak_bytes: int
  temp_extrapolated: bool
  compiles: list[Compiled]
  platform: str
  attention: str  # the impl the target platform runs, and why
  tpu_kernels: tuple[str, ...] = ()  # Pallas kernels found in the step lowered for the TPU
  warning: str = ''
  compiler: str = 'cpu'  # 'cpu' (simulated devices) or 'tpu' (libtpu, a named topology)
  topology: str = ''
  host_bytes: int = 0  # offloaded activations per device (the remat policy's '@host' items)
  devices_per_host: int = 1
  layout: str = 'fsdp'  # sharding.layout_for: 'hsdp' shards within a node, replicates across
  node_devices: int = 0  # devices of one node (8 GPUs; a TPU slice is one interconnect)
  traffic: dict[str, float] | None = None  # bytes per device per step, within/across nodes

  @property
  def host_need_bytes(self) -> int:
    """Per host: the offloaded activations, and the state's host copy a checkpoint stages."""
    return self.devices_per_host * (self.host_bytes + self.params_bytes + self.opt_state_bytes)

  @property
  def out_of_memory(self) -> str:
    return next((c.out_of_memory for c in self.compiles if c.out_of_memory), '')

  def fits(self, budget_gb: float) -> bool:
    return self.peak_bytes <= budget_gb * GB


def compile_config(cfg: ml_collections.ConfigDict, platform: str
                   ) -> tuple[ml_collections.ConfigDict, str]:
  """(the config the CPU compile uses, 'impl (why)' of what `platform` runs).

  A flash kernel of the target (pallas, pallas_gpu, cudnn) becomes the O(T)-memory stand-in.
  """
  impl, why = kernels.resolve(cfg.model, platform, segments=cfg.data.document_masking,
                              context_parallel=cfg.train.mesh_context != 1)
  compiled = cfg.copy_and_resolve_references()
  flash = ('pallas', 'pallas_gpu', 'cudnn')
  compiled.model.attention_impl = 'flash_stand_in' if impl in flash else impl
  return compiled, f'{impl} ({why})'


def compile_step(cfg: ml_collections.ConfigDict, devices: list[Any]) -> Compiled:
  """AOT-compiles the real train step on `devices` and reads its memory analysis.

  On a named topology's TPU devices libtpu compiles it, and a step too big for
  the chip's HBM comes back with `out_of_memory` set instead of raising.
  """
  start = time.perf_counter()
  mesh = sharding.make_mesh(cfg.train, devices)
  on_tpu = devices[0].platform == 'tpu'
  # On the TPU's devices the kernels must see the chip they are compiled for
  # (pltpu.is_tpu_device, block sizes), not this machine's CPU backend.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if on_tpu else contextlib.nullcontext():
    step, state, batch, accum = _abstract_step(cfg, mesh)
    lowered = step.lower(state, batch)
  found = _pallas_kernels(lowered.as_text()) if on_tpu else ()
  cache = jax.config.jax_enable_compilation_cache
  try:
    # An executable for a described slice cannot be loaded back without its chips: keep
    # it out of the persistent compilation cache (which would warn on every later read).
    # jax decides once per process, at its first compile: plan.py's is this one.
    jax.config.update('jax_enable_compilation_cache', cache and not on_tpu)
    compiled = lowered.compile()
    memory = compiled.memory_analysis()
  except jax.errors.JaxRuntimeError as e:
    if not (on_tpu and 'RESOURCE_EXHAUSTED' in str(e)):
      raise
    need = re.search(r'\(([\d.]+)G\) exceeds available HBM', str(e))
    peak = int(float(need.group(1)) * 2**30) if need else 0
    return Compiled(len(devices), dict(mesh.shape), accum, 0, 0, 0, peak,
                    time.perf_counter() - start, str(e).splitlines()[0], found)
  finally:
    jax.config.update('jax_enable_compilation_cache', cache)
  return Compiled(len(devices), dict(mesh.shape), accum, memory.argument_size_in_bytes,
                  memory.output_size_in_bytes, memory.alias_size_in_bytes,
                  memory.temp_size_in_bytes, time.perf_counter() - start, '', found,
                  memory.host_temp_size_in_bytes,
                  float((compiled.cost_analysis() or {}).get('flops', 0.0)))


def _pallas_kernels(hlo_text: str) -> tuple[str, ...]:
  names = ('flash_attention_fwd', 'flash_attention_dq', 'flash_attention_dkv')
  return tuple(n for n in names if n in hlo_text)


def libtpu_version() -> str | None:
  """The installed libtpu's version, or None (then --topology falls back to the CPU)."""
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return None


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
  """('v5e', (16, 16)) from 'v5e:16x16'; a ValueError naming the fix otherwise."""
  gen, _, dims = name.partition(':')
  if gen not in TPU_GENERATIONS or not re.fullmatch(r'\d+(x\d+){1,2}', dims):
    raise ValueError(f'--topology={name!r} is not a TPU slice name: write GENERATION:AxB or '
                     f'AxBxC, with GENERATION one of {sorted(TPU_GENERATIONS)} (e.g. '
                     'v5e:16x16, v5p:4x4x8).')
  shape = tuple(int(d) for d in dims.split('x'))
  if min(shape) < 1:
    raise ValueError(f'--topology={name!r} has an empty dimension.')
  return gen, shape


def devices_per_host(name: str) -> int:
  """Jax devices on one host of slice `name`: hosts hold 2x2 chips (one of a 1x1 slice)."""
  gen, shape = parse_topology(name)
  return int(np.prod([min(d, 2) for d in shape[:2]])) * (2 if gen == 'tpu7x' else 1)


def tpu_devices(name: str) -> list[Any]:
  """The devices of TPU slice `name`, as libtpu describes them (no TPU needed)."""
  gen, shape = parse_topology(name)
  # kernels.xla's placeholders, also on a TPU host: a compile for a described slice opens
  # no chip, so it needs neither the metadata server nor the chips' lock.
  for key, value in kernels.xla.LIBTPU_PLACEHOLDERS.items():
    os.environ.setdefault(key, value)
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  # Hosts hold 2x2 chips (one chip for a 1x1 slice); the layout only names the hosts.
  per_host = tuple(min(d, 2) for d in shape[:2]) + (1,)
  try:
    return topologies.get_topology_desc(
        platform='tpu', topology_name=name, chip_config_name=TPU_GENERATIONS[gen][0],
        chips_per_host_bounds=per_host, num_slices=1).devices
  except jax.errors.JaxRuntimeError as e:
    raise ValueError(f'libtpu cannot describe --topology={name!r}: '
                     f'{str(e).splitlines()[0]}') from None


def _abstract_step(cfg: ml_collections.ConfigDict, mesh: Mesh | AbstractMesh):
  """(jitted train step, abstract state, abstract batch, micro-batches) on `mesh`."""
  tx = optim.make_optimizer(cfg.opt)
  state = train.abstract_state(cfg, tx, mesh)
  batch = sharding.abstract_batch(cfg.data, mesh)
  shards = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))
  accum = batches.grad_accum_steps(cfg.data.global_batch_size, shards, cfg.train.micro_batch_size)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  step = jax.jit(train.make_train_step(cfg, tx, mesh, accum), donate_argnums=0,
                 out_shardings=(shardings, None))
  return step, state, batch, accum


def default_devices(cfg: ml_collections.ConfigDict, most: int = 8) -> int:
  """The most devices, up to `most`, whose mesh and micro-batches the config's batch fills."""
  for n in range(most, 0, -1):
    try:
      shape = sharding.mesh_shape(cfg.train, n)
      shards = int(np.prod([shape[a] for a in sharding.BATCH_AXES]))
      batches.grad_accum_steps(cfg.data.global_batch_size, shards, cfg.train.micro_batch_size)
    except errors.ConfigError:
      continue
    return n
  raise errors.ConfigError(
      f'no device count up to {most} splits data.global_batch_size='
      f'{cfg.data.global_batch_size} into train.micro_batch_size={cfg.train.micro_batch_size} '
      'rows per device on the configured mesh; fix them or pass --devices=N.')


def default_platform(cfg: ml_collections.ConfigDict) -> tuple[str, str]:
  """('tpu' or 'cpu', why): the TPU unless its flash kernel cannot take the model."""
  if cfg.model.attention_impl in ('auto', 'pallas') and kernels.pallas_unsupported(cfg.model):
    return 'cpu', (f'default: the TPU flash kernel needs head_dim a multiple of '
                   f'{flash_kernels.LANES}, not '
                   f'{cfg.model.head_dim}; --platform=tpu plans it for a TPU with XLA '
                   'attention')
  return 'tpu', 'default'


def tpu_kernels_in_step(cfg: ml_collections.ConfigDict, chip: str, shape: dict[str, int]
                        ) -> tuple[str, ...]:
  """Lowers the whole train step for a TPU `chip` on a mesh of `shape`; the Pallas kernels in it.

  An abstract mesh naming the TPU makes Pallas run its Mosaic lowering here
  (block shapes, tiling) without a TPU; what it cannot check is libtpu's own
  compile (layouts, VMEM fit).
  """
  if chip not in kernels.TPU_DEVICE_KINDS:
    raise ValueError(f'--chip={chip!r} is not one of {sorted(kernels.TPU_DEVICE_KINDS)}.')
  kind, cores = kernels.TPU_DEVICE_KINDS[chip]
  mesh = AbstractMesh(tuple(shape.values()), tuple(shape), (AxisType.Auto,) * len(shape),
                      abstract_device=AbstractDevice(kind, cores, 'tpu'))
  cfg = cfg.copy_and_resolve_references()
  cfg.model.attention_impl, _ = kernels.resolve(cfg.model, 'tpu',
                                                segments=cfg.data.document_masking)
  with jax.sharding.use_abstract_mesh(mesh):
    step, state, batch, _ = _abstract_step(cfg, mesh)
    text = step.trace(state, batch).lower(lowering_platforms=('tpu',)).as_text()
  return _pallas_kernels(text)


def _scaling_axis(cfg_train: ml_collections.ConfigDict) -> str:
  """The mesh axis that follows the device count (the one set to -1)."""
  axes = [a for a in ('data', 'fsdp', 'tensor') if cfg_train[f'mesh_{a}'] == -1]
  if not axes:
    raise ValueError('--target_devices needs one of train.mesh_data/fsdp/tensor set to -1, '
                     'so the mesh can grow from the compiled device count to the target.')
  return axes[0]


def extrapolate_temp(a: Compiled, b: Compiled, fsdp: int) -> int:
  """Temp bytes at FSDP size `fsdp` from the fit temp = c0 + c1 / fsdp through a and b."""
  x_a, x_b = 1 / a.mesh_shape['fsdp'], 1 / b.mesh_shape['fsdp']
  if x_a == x_b:
    raise ValueError('the two compiles have the same FSDP size; nothing to fit.')
  c1 = (a.temp - b.temp) / (x_a - x_b)
  c0 = a.temp - c1 * x_a
  return int(round(c0 + c1 / fsdp))


def batch_bytes(cfg: ml_collections.ConfigDict, shape: dict[str, int]) -> int:
  """Per-device bytes of one step's batch on a mesh of `shape`."""
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  int32_rows = 3 if cfg.data.document_masking else 2  # tokens, labels (, segment ids)
  return (int32_rows * 4 * T + 1) * B // (shape['data'] * shape['fsdp'])  # + the bool mask


def tpu_plan(cfg: ml_collections.ConfigDict, topology: str) -> Plan:
  """The plan from libtpu's own compile of the train step for `topology`'s devices."""
  config_checks.validate(config_checks.complete(cfg))
  devices = tpu_devices(topology)
  shape = sharding.mesh_shape(cfg.train, len(devices))
  impl, why = kernels.resolve(cfg.model, 'tpu', segments=cfg.data.document_masking)
  compiled_cfg = cfg.copy_and_resolve_references()
  compiled_cfg.model.attention_impl = impl
  c = compile_step(compiled_cfg, devices)
  params_bytes, opt_bytes = sharding.state_bytes(
      train.abstract_state(cfg, optim.make_optimizer(cfg.opt)), shape)
  # Outputs alias the donated state: the peak is the arguments, the outputs that
  # alias nothing (the step's metrics) and the temporaries, as libtpu counts them. A
  # refused step has only the temporaries libtpu asked for: the state comes on top.
  batch = batch_bytes(cfg, shape)
  peak = (params_bytes + opt_bytes + batch + c.temp if c.out_of_memory
          else c.argument + c.output - c.alias + c.temp)
  flops_token = model.flops_per_token(cfg.model, cfg.data.seq_len)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  return Plan(model.param_count(cfg.model), flops_token, flops_token * tokens, len(devices),
              shape, params_bytes, opt_bytes, batch, c.temp, peak, False,
              [c], 'tpu', f'{impl} ({why})', c.kernels, compiler='tpu', topology=topology,
              host_bytes=c.host_temp, devices_per_host=devices_per_host(topology))


def host_budget_gb(p: Plan) -> float | None:
  """RAM of one host of the plan's TPU slice (None: not a named slice, or not listed)."""
  if not p.topology:
    return None
  per_chip = HOST_GB_PER_CHIP.get(TPU_GENERATIONS[parse_topology(p.topology)[0]][2])
  chips = p.devices_per_host // (2 if p.topology.startswith('tpu7x') else 1)
  return None if per_chip is None else per_chip * chips


def fits_host(p: Plan) -> bool:
  budget = host_budget_gb(p)
  return budget is None or p.host_need_bytes <= budget * GB


def make_plan(cfg: ml_collections.ConfigDict, target_devices: int | None = None, *,
              platform: str = 'tpu', chip: str = 'v5p', devices: list[Any] | None = None,
              node_devices: int = 0) -> Plan:
  """Compiles on the simulated CPU `devices` (twice when extrapolating) and returns the Plan.

  The target is laid out as train.mesh_layout says for `platform` on nodes of
  `node_devices` (default: GPU_NODE_DEVICES on a GPU, else the whole target). An HSDP
  target compiles one node's flat FSDP mesh: the shard group is what a device holds
  and computes; the replicas only add the all-reduce that step_traffic counts.
  """
  config_checks.validate(config_checks.complete(cfg))
  devices = devices or jax.devices()
  if devices[0].platform != 'cpu':
    raise ValueError(f'the planner compiles on simulated CPU devices, got {devices[0].platform}; '
                     'run it with JAX_PLATFORMS=cpu.')
  target = target_devices or len(devices)
  layout = sharding.layout_for(cfg.train, platform)
  node = min(node_devices or (GPU_NODE_DEVICES if platform == 'gpu' else target), target)
  target_shape = sharding.mesh_shape(cfg.train, target, layout, node)
  compiled_cfg, attention = compile_config(cfg, platform)
  if layout == 'hsdp':  # compiled as a flat FSDP mesh, extrapolated to the shard group
    t = compiled_cfg.train
    t.mesh_layout, t.mesh_data, t.mesh_fsdp = 'fsdp', 1, -1
  exact = (target == len(devices)
           and sharding.mesh_shape(compiled_cfg.train, len(devices)) == target_shape)
  warning = ''
  if exact:
    compiles = [compile_step(compiled_cfg, devices)]
    temp = compiles[0].temp
  else:
    axis = _scaling_axis(compiled_cfg.train)
    if axis != 'fsdp':
      raise ValueError(f'extrapolation follows the FSDP axis; train.mesh_{axis}=-1 scales '
                       f'{axis} instead. Set train.mesh_fsdp=-1 and fix the others.')
    half = len(devices) // 2
    pair = (devices[:half], devices)
    fixed = len(devices) // sharding.mesh_shape(compiled_cfg.train, len(devices))['fsdp']
    if half % fixed:  # e.g. context parallelism at full degree: compile on --devices and 2x
      pool = jax.devices()
      if len(pool) < 2 * len(devices):
        raise ValueError(f'half of {len(devices)} devices cannot hold the mesh\'s fixed axes '
                         f'({fixed} devices) and only {len(pool)} simulated devices exist; '
                         f'raise --devices to a multiple of {2 * fixed}.')
      pair = (devices, pool[:2 * len(devices)])
    compiles = [compile_step(compiled_cfg, d) for d in pair]
    temp = extrapolate_temp(*compiles, target_shape['fsdp'])
    if compiles[1].temp > compiles[0].temp:
      warning = (f'temp grows from {compiles[0].temp / GB:.2f} to {compiles[1].temp / GB:.2f} '
                 'GB/device with twice the devices: activations are not sharded over the '
                 'batch (every device computes the whole micro-batch), so a + b/fsdp does '
                 'not describe this step and the target temp is not meaningful.')
  tpu_kernels = ()
  if platform == 'tpu':
    tpu_kernels = tpu_kernels_in_step(cfg, chip, sharding.mesh_shape(cfg.train, len(devices)))
  abstract = train.abstract_state(cfg, optim.make_optimizer(cfg.opt))
  params_bytes, opt_bytes = sharding.state_bytes(abstract, target_shape)
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  batch = batch_bytes(cfg, target_shape)
  flops_token = model.flops_per_token(cfg.model, T)
  try:  # a target whose batch does not split has no step to count (its own run refuses it)
    micro = batches.grad_accum_steps(B, target_shape['data'] * target_shape['fsdp'],
                                     cfg.train.micro_batch_size)
    traffic = sharding.step_traffic(abstract.params, target_shape, layout, node, micro)
  except errors.ConfigError:
    traffic = None
  # Outputs alias the donated state, so the peak is arguments plus temporaries.
  return Plan(model.param_count(cfg.model), flops_token, flops_token * B * T, target,
              target_shape, params_bytes, opt_bytes, batch, temp,
              params_bytes + opt_bytes + batch + temp, not exact, compiles,
              platform, attention, tpu_kernels, warning, layout=layout, node_devices=node,
              traffic=traffic)


def format_plan(cfg: ml_collections.ConfigDict, p: Plan) -> str:
  """The human-readable report."""
  m, d = cfg.model, cfg.data
  lines = [
      f'model       {m.num_layers} layers, d_model {m.d_model}, {m.num_heads}x{m.head_dim} heads '
      f'({m.num_kv_heads} kv), mlp {m.mlp_hidden}, vocab {m.vocab_size}, '
      f'remat {m.remat}, {m.dtype} compute',
      f'parameters  {p.param_count:,}',
      f'batch       {d.global_batch_size} x {d.seq_len} = {d.global_batch_size * d.seq_len:,} '
      f'tokens/step, micro-batch {cfg.train.micro_batch_size}/device',
      f'FLOPs       {p.flops_per_token / 1e9:.2f} GFLOP/token, {p.flops_per_step / 1e15:.1f} '
      f'PFLOP/step, {p.flops_per_step / p.target_devices / 1e12:.1f} TFLOP/step/device',
  ]
  if p.compiler == 'tpu':
    lines.append(f'compiler    TPU: libtpu {libtpu_version()} compiled the step for {p.topology}, '
                 'kernels included; memory as the pod allocates it, no extrapolation')
  else:
    lines.append('compiler    CPU: simulated devices' + (
        ', temp extrapolated' if p.temp_extrapolated else '') + ' (--topology with libtpu '
        "installed plans with the TPU's own compiler)")
  for c in p.compiles:
    if c.out_of_memory:
      lines.append(f'compiled    {c.devices} devices, mesh {c.mesh_shape}, {c.accum} '
                   f'micro-batches: DOES NOT FIT the chip ({c.seconds:.0f} s): {c.out_of_memory}')
      continue
    lines.append(f'compiled    {c.devices} devices, mesh {c.mesh_shape}, {c.accum} micro-batches: '
                 f'arguments {c.argument / GB:.2f} GB, temp {c.temp / GB:.2f} GB/device '
                 f'({c.seconds:.0f} s)')
  how = ('fit a + b/fsdp through the two compiles' if p.temp_extrapolated else
         "the TPU compiler's" if p.compiler == 'tpu' else 'compiled')
  if p.out_of_memory:
    how = 'what the TPU compiler asked for, refusing it'
  lines += [
      f'target      {p.target_devices} devices, mesh {p.target_mesh}',
      f'  params     {p.params_bytes / GB:8.2f} GB/device (float32, exact)',
      f'  opt state  {p.opt_state_bytes / GB:8.2f} GB/device (Adam mu, nu + scalars, exact)',
      f'  batch      {p.batch_bytes / 1e6:8.2f} MB/device (tokens, labels, mask)',
      f'  temp       {p.temp_bytes / GB:8.2f} GB/device (activations, gathered weights, grads; '
      f'{how})',
      *([f'  traffic    {p.traffic["within"] / GB:8.2f} GB/device/step within a node, '
         f'{p.traffic["across"] / GB:.2f} GB across nodes (layout {p.layout}, nodes of '
         f'{p.node_devices} devices; gathers, reduce-scatters, all-reduces: '
         'sharding.step_traffic)'] if p.traffic else []),
      f'  peak       {p.peak_bytes / GB:8.2f} GB/device' + (
          '' if p.compiler != 'tpu' else ' at least (the state + what libtpu asked for)'
          if p.out_of_memory else ' (arguments + unaliased outputs + temp, from libtpu)'),
  ]
  if p.compiler == 'tpu':
    budget = host_budget_gb(p)
    verdict = ('no RAM figure for this chip' if budget is None else
               f"the host has {budget:.0f} GB: {'fits' if fits_host(p) else 'DOES NOT FIT'}")
    lines.append(
        f'  host       {p.host_need_bytes / GB:8.2f} GB/host ({p.devices_per_host} devices: '
        f'offloaded activations {p.host_bytes / GB:.3f} + the state\'s checkpoint copy '
        f'{(p.params_bytes + p.opt_state_bytes) / GB:.2f} GB/device); {verdict}')
  lines.append(f'attention   {p.platform}: {p.attention}')
  if p.compiler == 'cpu' and p.attention.split()[0] in ('pallas', 'pallas_gpu', 'cudnn'):
    lines.append('  the CPU compile used an O(T)-memory stand-in for that kernel '
                 "(attention_impl='flash_stand_in')")
  if p.platform == 'tpu' and p.attention.startswith('pallas'):
    how = 'compiled by libtpu' if p.compiler == 'tpu' else 'lowered for the TPU'
    lines.append(f"  {how}: {', '.join(p.tpu_kernels) or 'NO Pallas kernel'} in the train step")
  if p.warning:
    lines.append(f'  WARNING: {p.warning}')
  for name, total in BUDGETS_GB.items():
    budget = usable_gb(name)
    verdict = 'fits' if p.fits(budget) else 'does NOT fit'
    share = '' if budget == total else f' of the {budget:.0f} GB JAX\'s allocator takes'
    lines.append(f'  {name:8s} {total:4d} GB: {verdict} ({p.peak_bytes / GB / budget:.0%} used'
                 f'{share})')
  return '\n'.join(lines)


def usable_gb(name: str) -> float:
  """What a step may use of BUDGETS_GB[name]: a TPU's HBM, or on a GPU the share JAX's
  allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION: JAX's 0.75 unless set, train.py's
  gpu_flags.TRAINER_MEM_FRACTION on a GPU host; cuDNN, cuBLAS and NCCL use the rest)."""
  if name.startswith('TPU'):
    return BUDGETS_GB[name]
  return BUDGETS_GB[name] * gpu_flags.trainer_memory_fraction()


# `--policies=candidates`: remat policies from full to none, ordered by what they keep.
# Per layer of the 7B at 8,192 tokens, each projection and the attention output is 64 MB,
# gate and up 180 MB each; mlp_out and attn spare the most recomputation per byte (the
# w_down matmul; the attention forward kernel), the projections about a third of that.
REMAT_CANDIDATES = ('full', 'save_attn', 'mlp_out', 'save_outs', 'mlp_out,attn', 'outs,attn',
                    'outs,attn@host', 'mlp_out,attn,qkv@host', 'outs,attn,F:qkv',
                    'outs,attn,qkv@host', 'save_qkv', 'save_qkv_attn', 'none')


def policy_list(text: str) -> list[str]:
  """--policies' value: ';'-separated remat policies, or 'candidates' (REMAT_CANDIDATES)."""
  if text == 'candidates':
    return list(REMAT_CANDIDATES)
  return [x.strip() for x in text.split(';') if x.strip()]


def sweep(cfg: ml_collections.ConfigDict, topology: str, policies: list[str],
          budget_gb: float) -> list[tuple[str, Plan]]:
  """Plans `cfg` under each remat policy for `topology` with libtpu; prints one row each.

  A policy fits when libtpu compiles it within `budget_gb` per device and its host
  memory (offloaded activations and the checkpoint's copy of the state) fits the host.
  """
  # XLA's cost analysis counts a loop's body once (the layer scan, the micro-batches):
  # comparable between policies, not the step's total.
  print(f"{'remat policy':28s} {'device GB':>10s} {'host GB/host':>13s} "
        f"{'XLA TFLOP/dev*':>14s}  fits {budget_gb:g} GB + host   (* each loop body once)",
        flush=True)
  plans, fitting = [], []
  for policy in policies:
    one = cfg.copy_and_resolve_references()
    one.model.remat = policy
    p = tpu_plan(one, topology)
    flops = p.compiles[0].flops
    fits = not p.out_of_memory and p.fits(budget_gb) and fits_host(p)
    device = f"{'>' if p.out_of_memory else ''}{p.peak_bytes / GB:.2f}"
    print(f'{policy:28s} {device:>10s} {p.host_need_bytes / GB:13.2f} '
          f"{flops / 1e12 if flops else float('nan'):14.2f}  {'yes' if fits else 'no'}",
          flush=True)
    plans.append((policy, p))
    if fits and flops:
      fitting.append((flops, policy))
  if fitting:
    print(f'least recomputation that fits: --config.model.remat={min(fitting)[1]!r} '
          '(the fewest XLA flops; a policy with host offload also pays its transfers: time '
          'the candidates on a chip with bench/device_check.py --policies)', flush=True)
  else:
    print(f'no policy fits {budget_gb:g} GB per device on {topology}', flush=True)
  return plans


def report(cfg: ml_collections.ConfigDict, target_devices: int | None = None, *,
           topology: str = '', **kwargs) -> Plan:
  """Plans (with libtpu for a `topology`), prints the report and returns the Plan."""
  p = tpu_plan(cfg, topology) if topology else make_plan(cfg, target_devices, **kwargs)
  print(format_plan(cfg, p), flush=True)
  return p


def topology_devices(name: str) -> int:
  """How many jax devices slice `name` has (two per TPU7x chip, one per other chip)."""
  gen, shape = parse_topology(name)
  return int(np.prod(shape)) * (2 if gen == 'tpu7x' else 1)


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    errors.report(f'unexpected arguments {argv[1:]}; flags take the form --name=value.',
                  errors.EXIT_USAGE)
  if (FLAGS.devices is not None and FLAGS.devices < 1) or FLAGS.target_devices < 0:
    errors.report('--devices must be >= 1 and --target_devices >= 0.', errors.EXIT_USAGE)
  with errors.one_line(also=(ValueError,)):  # the config and mesh checks: one line, exit 2
    cfg = FLAGS.config
    if FLAGS.policies:
      return _sweep(cfg)
    if FLAGS.topology and _plan_topology(cfg):
      return
    devices = FLAGS.devices or default_devices(cfg)
    platform, why = (FLAGS.platform, '') if FLAGS.platform else default_platform(cfg)
    chosen = '' if FLAGS.devices else ' (default: the most, up to 8, the batch splits over)'
    print(f'planning for {devices} devices{chosen}, platform {platform}'
          f'{f" ({why})" if why else ""}', flush=True)
    # Simulated CPU devices; set before anything touches a backend.
    kernels.xla.set_cpu_flags()
    jax.config.update('jax_platforms', 'cpu')
    # Twice --devices exist so that a mesh whose fixed axes fill --devices (context
    # parallelism) can still be compiled at two FSDP sizes; the plan uses --devices.
    jax.config.update('jax_num_cpu_devices', 2 * devices)
    report(cfg, FLAGS.target_devices or None, platform=platform, chip=FLAGS.chip,
           node_devices=FLAGS.node_devices,
           devices=jax.devices()[:devices])


def _sweep(cfg: ml_collections.ConfigDict) -> None:
  """--policies: each remat policy planned by libtpu for --topology, one row each."""
  if not FLAGS.topology or not libtpu_version():
    raise ValueError("--policies plans with the TPU's compiler: name a slice with "
                     "--topology=v5e:16x16 and install libtpu (pip install 'libtpu==0.0.42.*').")
  if FLAGS.devices is not None or FLAGS.target_devices or FLAGS.platform not in (None, 'tpu'):
    raise ValueError('--policies with --topology names the devices and the platform; drop '
                     '--devices, --target_devices and --platform.')
  policies = policy_list(FLAGS.policies)
  cfg = config_checks.complete(cfg)  # once: the data's description fills in the same fields
  for policy in policies:  # every mistake before the first compile (minutes each)
    one = cfg.copy_and_resolve_references()
    one.model.remat = policy
    config_checks.validate(config_checks.complete(one))
  gen, _ = parse_topology(FLAGS.topology)
  budget = FLAGS.budget_gb or BUDGETS_GB[TPU_GENERATIONS[gen][2]]
  print(f'planning {len(policies)} remat policies for {FLAGS.topology} with the TPU compiler '
        f'(libtpu {libtpu_version()})', flush=True)
  jax.config.update('jax_platforms', 'cpu')  # libtpu compiles; no TPU is opened
  sweep(cfg, FLAGS.topology, policies, budget)


def _plan_topology(cfg: ml_collections.ConfigDict) -> bool:
  """--topology: plans with libtpu (True), or sets the CPU fallback's flags (False)."""
  gen, _ = parse_topology(FLAGS.topology)
  if FLAGS.target_devices or FLAGS.platform not in (None, 'tpu'):
    raise ValueError('--topology names the devices and the platform; drop --target_devices '
                     'and --platform.')
  version = libtpu_version()
  if version and FLAGS.devices is not None:
    raise ValueError(f'--topology={FLAGS.topology} is compiled for its own devices by libtpu; '
                     'drop --devices (it sets the CPU compile\'s devices where libtpu is absent).')
  if version:
    print(f'planning for {FLAGS.topology} with the TPU compiler (libtpu {version})', flush=True)
    jax.config.update('jax_platforms', 'cpu')  # libtpu compiles; no TPU is opened
    p = report(cfg, topology=FLAGS.topology)
    if not fits_host(p):
      errors.report(f'remat={cfg.model.remat!r} offloads more than the host holds '
                    f'({p.host_need_bytes / GB:.1f} GB per host against '
                    f'{host_budget_gb(p):.0f} GB): offload less (fewer @host items) or keep '
                    'more on the device.', errors.EXIT_USAGE)
    return True
  print(f'libtpu is not installed: planning {FLAGS.topology} from a CPU compile on simulated '
        "devices (pip install 'libtpu==0.0.42.*' for the TPU compiler)", flush=True)
  target = topology_devices(FLAGS.topology)
  if FLAGS.devices is None and target <= 8:  # small enough to compile as it is
    FLAGS.devices = target
  FLAGS.target_devices = 0 if FLAGS.devices == target else target
  FLAGS.platform, FLAGS.chip = 'tpu', TPU_GENERATIONS[gen][1]
  return False




if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'Training config file.', lock_config=True)
  flags.DEFINE_integer('devices', None, 'Simulated CPU devices the step is compiled for '
                       '(default: the most, up to 8, the config\'s batch splits over).')
  flags.DEFINE_integer('target_devices', 0, 'Devices the report is for (0: --devices); another '
                       'count is extrapolated from compiles on --devices and half of them (twice '
                       'as many when half cannot hold the context axis).')
  flags.DEFINE_enum('platform', None, ['tpu', 'gpu', 'cpu'], "The platform the run targets: "
                    "attention_impl='auto' is resolved for it (default: tpu, or cpu for a model "
                    "the TPU flash kernel cannot take).")
  flags.DEFINE_enum('chip', 'v5p', sorted(kernels.TPU_DEVICE_KINDS), 'TPU generation the step '
                    'is lowered for (with --platform=tpu).')
  flags.DEFINE_integer('node_devices', 0, 'Devices per node of the target (default: 8 with '
                       '--platform=gpu, else the whole target): train.mesh_layout=hsdp shards '
                       'within one, and the traffic line splits bytes within and across them.')
  flags.DEFINE_string('topology', '', 'A TPU slice, as libtpu names it (v5e:16x16, v5p:4x4x8, '
                      'v6e:8x8, v4:2x2x2, tpu7x:2x2x1): the step is compiled for its devices by '
                      'the TPU compiler where libtpu is installed, else planned by the CPU '
                      'compile, extrapolated to its device count.')
  flags.DEFINE_string('policies', '', "With --topology: plan each of these remat policies, "
                      "';'-separated (presets or save lists: model.REMAT_SYNTAX), or "
                      "'candidates' (plan.REMAT_CANDIDATES), one row each.")
  flags.DEFINE_float('budget_gb', 0.0, "--policies' per-device budget in GB (default: the "
                     "chip's HBM in BUDGETS_GB)")
  FLAGS = flags.FLAGS
  app.run(main, flags_parser=config_checks.parser_requiring_config(  # mistakes in one line
      'the training config to plan, e.g. --config=configs/olmo3_7b.py (with any '
      '--config.* overrides)'))
