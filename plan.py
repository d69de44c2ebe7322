"""Ahead-of-time planning: will this config's train step fit, and how much work is it?

`python train.py --config=configs/olmo3_7b.py --dry_run --dry_run_devices=8`
compiles the real train step (train.make_train_step, train.state_shardings)
for simulated CPU devices without allocating a single weight: the state is
`jax.eval_shape`d, the batch is abstract, and XLA's `memory_analysis()` of the
compiled step gives the per-device argument, output and temporary bytes. The
report prints parameter count, FLOPs per token and per step, parameter /
optimizer-state / temporary memory per device, and whether the step fits the
per-device memory of the accelerators in `BUDGETS_GB`.

Target meshes bigger than the CPU can compile quickly (the 7B on 512 chips)
are reached by extrapolation (`--dry_run_target=512`): parameter and optimizer
bytes per device are exact for any mesh (shard shapes on an AbstractMesh); the
temporaries are measured on two compiled meshes whose FSDP axis differs by 2x
and fitted as a + b / fsdp (a: activations and one gathered layer group, fixed
per micro-batch; b: gradient accumulators and optimizer temporaries, sharded
like the state), then evaluated at the target's FSDP size.

Attention: with cfg.model.attention_impl 'pallas' or 'cudnn' (the TPU and GPU
kernels, which do not compile for CPU) the compile uses `_flash_stand_in`, an
O(T)-memory function of q, k, v with the kernel's shapes, so the temporaries
are those of a flash kernel (no [T, S] scores in memory); its FLOPs are not
the kernel's, which is why FLOPs come from model.flops_per_token.

Shapes: B global batch, T sequence, H heads, G kv heads, K head_dim, S keys.
"""

import contextlib
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np

import data
import model
import optim
import train

# Per-device memory (decimal GB, vendor spec sheets): TPU v5p 95 GB HBM2e,
# v6e (Trillium) 32 GB, TPU7x (Ironwood) 192 GB, H100 SXM 80 GB, H200 141 GB.
BUDGETS_GB = {'TPU v5p': 95, 'TPU v6e': 32, 'TPU7x': 192, 'H100': 80, 'H200': 141}
GB = 1e9


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


@dataclasses.dataclass
class Plan:
  """The dry run's numbers for the target mesh (bytes per device)."""
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
  warning: str = ''

  def fits(self, budget_gb: float) -> bool:
    return self.peak_bytes <= budget_gb * GB


def _flash_stand_in(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, *,
                    window, segment_ids_BT, cfg) -> jax.Array:
  """Shapes and O(T) memory of a flash-attention kernel, for CPU compiles only."""
  del window, segment_ids_BT
  r = cfg.num_heads // cfg.num_kv_heads
  kv_BTHK = jnp.repeat(k_BSGK * v_BSGK, r, axis=2)
  return q_BTHK * kv_BTHK


@contextlib.contextmanager
def _attention_for_cpu(cfg_model: ml_collections.ConfigDict):
  """Swaps in the stand-in while tracing when the config names a TPU/GPU kernel."""
  if cfg_model.attention_impl == 'xla':
    yield
    return
  original = model.attention
  model.attention = _flash_stand_in
  try:
    yield
  finally:
    model.attention = original


def target_mesh_shape(cfg_train: ml_collections.ConfigDict, devices: int) -> dict[str, int]:
  """The ('data', 'fsdp', 'tensor') sizes train.make_mesh would pick for `devices`."""
  shape = [cfg_train.mesh_data, cfg_train.mesh_fsdp, cfg_train.mesh_tensor]
  known = int(np.prod([s for s in shape if s != -1]))
  if shape.count(-1) > 1 or devices % known:
    raise ValueError(f'mesh (data={shape[0]}, fsdp={shape[1]}, tensor={shape[2]}) does not fit '
                     f'{devices} devices; set train.mesh_* so their product is the device count '
                     '(one of them may be -1).')
  shape = [devices // known if s == -1 else s for s in shape]
  if int(np.prod(shape)) != devices:
    raise ValueError(f'mesh {shape} has {int(np.prod(shape))} slots for {devices} devices; '
                     'set one of train.mesh_* to -1 to let it follow the device count.')
  return dict(zip(('data', 'fsdp', 'tensor'), shape))


def abstract_state(cfg: ml_collections.ConfigDict) -> train.TrainState:
  """ShapeDtypeStructs of params and optimizer state (nothing is allocated)."""
  tx = optim.make_optimizer(cfg.opt)

  def init(rng):
    params = model.init_params(cfg.model, rng)
    return train.TrainState(params, tx.init(params))
  return jax.eval_shape(init, jax.random.key(0))


def _shard_bytes(tree: Any, shardings: Any) -> int:
  return sum(int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
             for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def state_bytes(abstract: train.TrainState, mesh_shape: dict[str, int]) -> tuple[int, int]:
  """(params, optimizer state) bytes per device on a mesh of `mesh_shape`, exactly.

  Every device holds one equally shaped shard of each leaf (train._fit keeps
  only axes that divide), so the shard shape is the per-device footprint.
  """
  mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape))
  shardings = train.state_shardings(abstract, mesh)
  return (_shard_bytes(abstract.params, shardings.params),
          _shard_bytes(abstract.opt_state, shardings.opt_state))


def abstract_batch(cfg: ml_collections.ConfigDict, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  rows = train.batch_sharding(mesh)
  batch = {'tokens': jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows),
           'labels': jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows),
           'instance_mask': jax.ShapeDtypeStruct(
               (B,), jnp.bool_, sharding=NamedSharding(mesh, P(train.BATCH_AXES)))}
  if cfg.data.document_masking:
    batch['segment_ids'] = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rows)
  return batch


def compile_step(cfg: ml_collections.ConfigDict, devices: list[Any]) -> Compiled:
  """AOT-compiles the real train step on `devices` and reads its memory analysis."""
  start = time.perf_counter()
  mesh = train.make_mesh(cfg.train, devices)
  abstract = abstract_state(cfg)
  shardings = train.state_shardings(abstract, mesh)
  batch = abstract_batch(cfg, mesh)
  shards = data.num_batch_shards(batch['tokens'].sharding, cfg.data.global_batch_size,
                                 cfg.data.seq_len)
  accum = data.grad_accum_steps(cfg.data.global_batch_size, shards, cfg.train.micro_batch_size)
  step = jax.jit(train.make_train_step(cfg, mesh, accum), donate_argnums=0,
                 out_shardings=(shardings, None))
  target = train._abstract(abstract, shardings)  # pylint: disable=protected-access
  with _attention_for_cpu(cfg.model):
    lowered = step.lower(target, batch)
  memory = lowered.compile().memory_analysis()
  return Compiled(len(devices), dict(mesh.shape), accum, memory.argument_size_in_bytes,
                  memory.output_size_in_bytes, memory.alias_size_in_bytes,
                  memory.temp_size_in_bytes, time.perf_counter() - start)


def _scaling_axis(cfg_train: ml_collections.ConfigDict) -> str:
  """The mesh axis that follows the device count (the one set to -1)."""
  axes = [a for a in ('data', 'fsdp', 'tensor') if cfg_train[f'mesh_{a}'] == -1]
  if not axes:
    raise ValueError('--dry_run_target needs one of train.mesh_data/fsdp/tensor set to -1, '
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


def make_plan(cfg: ml_collections.ConfigDict, target_devices: int | None = None) -> Plan:
  """Compiles on the simulated devices (twice when extrapolating) and returns the Plan."""
  train.validate(cfg)
  devices = jax.devices()
  if devices[0].platform != 'cpu':
    raise ValueError(f'the dry run plans on simulated CPU devices, got {devices[0].platform}; '
                     'run it with JAX_PLATFORMS=cpu.')
  target = target_devices or len(devices)
  target_shape = target_mesh_shape(cfg.train, target)
  warning = ''
  if target == len(devices):
    compiles = [compile_step(cfg, devices)]
    temp = compiles[0].temp
  else:
    axis = _scaling_axis(cfg.train)
    if axis != 'fsdp':
      raise ValueError(f'extrapolation follows the FSDP axis; train.mesh_{axis}=-1 scales '
                       f'{axis} instead. Set train.mesh_fsdp=-1 and fix the others.')
    half = len(devices) // 2
    compiles = [compile_step(cfg, devices[:half]), compile_step(cfg, devices)]
    temp = extrapolate_temp(*compiles, target_shape['fsdp'])
    if compiles[1].temp > compiles[0].temp:
      warning = (f'temp grows from {compiles[0].temp / GB:.2f} to {compiles[1].temp / GB:.2f} '
                 'GB/device with twice the devices: activations are not sharded over the '
                 'batch (every device computes the whole micro-batch), so a + b/fsdp does '
                 'not describe this step and the target temp is not meaningful.')
  abstract = abstract_state(cfg)
  params_bytes, opt_bytes = state_bytes(abstract, target_shape)
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  batch_shards = target_shape['data'] * target_shape['fsdp']
  int32_rows = 3 if cfg.data.document_masking else 2  # tokens, labels (, segment ids)
  batch_bytes = (int32_rows * 4 * T + 1) * B // batch_shards  # + the bool mask
  flops_token = model.flops_per_token(cfg.model, T)
  # Outputs alias the donated state, so the peak is arguments plus temporaries.
  return Plan(model.param_count(cfg.model), flops_token, flops_token * B * T, target,
              target_shape, params_bytes, opt_bytes, batch_bytes, temp,
              params_bytes + opt_bytes + batch_bytes + temp, target != len(devices), compiles,
              warning)


def format_plan(cfg: ml_collections.ConfigDict, p: Plan) -> str:
  """The human-readable report."""
  m, d = cfg.model, cfg.data
  lines = [
      f'model       {m.num_layers} layers, d_model {m.d_model}, {m.num_heads}x{m.head_dim} heads '
      f'({m.num_kv_heads} kv), mlp {m.mlp_hidden}, vocab {m.vocab_size}, '
      f'attention {m.attention_impl}, remat {m.remat}, {m.dtype} compute',
      f'parameters  {p.param_count:,}',
      f'batch       {d.global_batch_size} x {d.seq_len} = {d.global_batch_size * d.seq_len:,} '
      f'tokens/step, micro-batch {cfg.train.micro_batch_size}/device',
      f'FLOPs       {p.flops_per_token / 1e9:.2f} GFLOP/token, {p.flops_per_step / 1e15:.1f} '
      f'PFLOP/step, {p.flops_per_step / p.target_devices / 1e12:.1f} TFLOP/step/device',
  ]
  for c in p.compiles:
    lines.append(f'compiled    {c.devices} devices, mesh {c.mesh_shape}, {c.accum} micro-batches: '
                 f'arguments {c.argument / GB:.2f} GB, temp {c.temp / GB:.2f} GB/device '
                 f'({c.seconds:.0f} s)')
  how = ('fit a + b/fsdp through the two compiles' if p.temp_extrapolated else 'compiled')
  lines += [
      f'target      {p.target_devices} devices, mesh {p.target_mesh}',
      f'  params     {p.params_bytes / GB:8.2f} GB/device (float32, exact)',
      f'  opt state  {p.opt_state_bytes / GB:8.2f} GB/device (Adam mu, nu + scalars, exact)',
      f'  batch      {p.batch_bytes / 1e6:8.2f} MB/device (tokens, labels, mask)',
      f'  temp       {p.temp_bytes / GB:8.2f} GB/device (activations, gathered weights, grads; '
      f'{how})',
      f'  peak       {p.peak_bytes / GB:8.2f} GB/device',
  ]
  if m.attention_impl != 'xla':
    lines.append(f'  note: {m.attention_impl} kernel replaced by an O(T)-memory stand-in '
                 'for the CPU compile')
  if p.warning:
    lines.append(f'  WARNING: {p.warning}')
  for name, budget in BUDGETS_GB.items():
    verdict = 'fits' if p.fits(budget) else 'does NOT fit'
    lines.append(f'  {name:8s} {budget:4d} GB: {verdict} ({p.peak_bytes / GB / budget:.0%} used)')
  return '\n'.join(lines)


def report(cfg: ml_collections.ConfigDict, target_devices: int | None = None) -> Plan:
  """Plans, prints the report and returns the Plan (train.py --dry_run)."""
  p = make_plan(cfg, target_devices)
  print(format_plan(cfg, p), flush=True)
  return p
