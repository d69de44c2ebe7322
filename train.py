"""Trains Olmo 3: python train.py --config=configs/small.py --workdir=/tmp/run.

The same command starts a fresh run or resumes the latest good checkpoint in
--workdir. Before anything is allocated it checks the config, the data
settings and that params + Adam moments fit the devices; `python plan.py`
answers the fuller question (temporaries, FLOPs, other meshes) ahead of time.
One run at a time may use a workdir (checkpoint.WorkdirLock).

Exit codes (scripts/launch.py restarts every one but 0 and 4):
  0  done: cfg.train.steps reached, now or by an earlier run.
  1  an error. A bad flag, config or resume (a changed config, train.steps
     behind the checkpoint) or a workdir in use is one line naming the fix;
     anything else is a traceback. Earlier checkpoints stay intact.
  3  EXIT_PREEMPTED: SIGTERM/SIGINT; a checkpoint was written, rerun the same command.
  4  EXIT_DIVERGED: the divergence guard (train.max_loss,
     train.max_consecutive_skips) stopped the run; its state was saved as an
     unhealthy checkpoint and retention keeps the last healthy one.

Reading order: mesh and shardings, state init, the jitted step, metrics,
stopping a diverged run, the loop, the command line. guards.py holds the
checks that judge a resume, each step's health and the command line.
Shapes: B global batch, A micro-batches per step, T sequence, D d_model.
"""

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, NamedTuple, NoReturn

from absl import app, flags, logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
import ml_collections
from ml_collections import config_flags
import numpy as np
from tokenizers import Tokenizer

import checkpoint
import convert
import data
import events
import guards
import kernels
import model
import optim

FLAGS = flags.FLAGS  # defined by run(): importing this module defines no flags
EXIT_PREEMPTED = 3  # a distinct exit code: checkpoint written, resume with the same command
EXIT_DIVERGED = 4  # the divergence guard stopped the run: do not restart it unchanged
BATCH_AXES = model.BATCH_AXES  # the global batch is split over ('data', 'fsdp')
MESH_AXES = ('data', 'fsdp', 'context', 'tensor')  # 'context' only when train.mesh_context > 1


class TrainState(NamedTuple):
  params: model.Params
  opt_state: optim.SkipStepAdamWState


# --- Mesh and shardings -----------------------------------------------------------------


def mesh_shape(cfg_train: ml_collections.ConfigDict, devices: int) -> dict[str, int]:
  """The ('data', 'fsdp'[, 'context'], 'tensor') sizes for `devices`; a -1 takes the rest.

  The 'context' axis (context parallelism, kernels/context_parallel.py) is
  there only when train.mesh_context > 1, so other meshes keep three axes.
  """
  context = cfg_train.get('mesh_context', 1)
  if context < 1:
    raise ValueError(f'train.mesh_context={context} must be an integer >= 1 (1: no context '
                     'parallelism); set --config.train.mesh_context.')
  shape = [cfg_train.mesh_data, cfg_train.mesh_fsdp, context, cfg_train.mesh_tensor]
  known = int(np.prod([s for s in shape if s != -1]))
  if shape.count(-1) > 1 or devices % known:
    raise ValueError(f'mesh (data={shape[0]}, fsdp={shape[1]}, context={shape[2]}, '
                     f'tensor={shape[3]}) does not fit '
                     f'{devices} devices; set train.mesh_* so their product is the device count '
                     '(one of them may be -1).')
  shape = [devices // known if s == -1 else s for s in shape]
  if int(np.prod(shape)) != devices:
    raise ValueError(f'mesh {shape} has {int(np.prod(shape))} slots for {devices} devices; '
                     'set one of train.mesh_* to -1 to let it follow the device count.')
  return {axis: n for axis, n in zip(MESH_AXES, shape) if axis != 'context' or n > 1}


def make_mesh(cfg_train: ml_collections.ConfigDict, devices=None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all)."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  shape = mesh_shape(cfg_train, devices.size)
  # Plain Mesh = Auto axes: jax.make_mesh's Explicit axes break hk-style gathers.
  return Mesh(devices.reshape(tuple(shape.values())), tuple(shape))


# Partition spec per parameter name: FSDP shards d_model, tensor-parallel
# shards heads / MLP hidden / vocab. The leading L axis of layer weights stays
# whole so the layer scan slices it locally. FSDP shards over the context axis
# too (where the mesh has one): the context devices hold different shards of
# the weights and Adam moments rather than copies, as torchtitan and
# OLMo-core shard FSDP over the flattened dp_shard x cp mesh. The embedding
# table is the exception: XLA's partitioner cannot turn a lookup split on D
# over both axes into activations split on (batch, time) without replicating
# the whole [B, T, D] lookup (measured: plan.py's temporaries then grow with
# the device count), so it stays on 'fsdp' (1.6 GB of weights in all).
_FSDP = ('fsdp', 'context')
_PARAM_SPECS = {
    'embedding': P(None, 'fsdp'),  # [V, D]
    'w_q': P(None, _FSDP, 'tensor'), 'w_k': P(None, _FSDP, 'tensor'),
    'w_v': P(None, _FSDP, 'tensor'), 'w_o': P(None, 'tensor', _FSDP),
    'w_gate': P(None, _FSDP, 'tensor'), 'w_up': P(None, _FSDP, 'tensor'),
    'w_down': P(None, 'tensor', _FSDP), 'w': P(_FSDP, 'tensor'),  # lm_head [D, V]
}


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """Keeps the axes the mesh has and that divide their dimension (small configs on many
  devices): ('fsdp', 'context') falls back to 'fsdp' alone, then to replication."""
  def fit(axes, n: int):
    axes = [a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in mesh.shape]
    while axes and n % int(np.prod([mesh.shape[a] for a in axes])):
      axes.pop()
    return tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)
  return P(*[fit(a, shape[i])
             for i, a in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec)))])


def state_shardings(abstract: TrainState, mesh: Mesh) -> TrainState:
  """NamedShardings for every leaf: weights and both Adam moments alike, scalars replicated."""
  def leaf(path, x):
    spec = _PARAM_SPECS.get(getattr(path[-1], 'key', None), P()) if x.ndim > 1 else P()
    return NamedSharding(mesh, _fit(spec, x.shape, mesh))
  return jax.tree_util.tree_map_with_path(leaf, abstract)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES, None))


# --- State ------------------------------------------------------------------------------


def _init_fn(cfg: ml_collections.ConfigDict):
  tx = optim.make_optimizer(cfg.opt)

  def init(rng):
    params = model.init_params(cfg.model, rng)
    return TrainState(params, tx.init(params))
  return init


def abstract_state(cfg: ml_collections.ConfigDict, mesh: Mesh | AbstractMesh | None = None
                   ) -> TrainState:
  """ShapeDtypeStructs of the train state (sharded on `mesh` if given); nothing is allocated."""
  abstract = jax.eval_shape(_init_fn(cfg), jax.random.key(0))
  if mesh is None:
    return abstract
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, state_shardings(abstract, mesh))


def create_state(cfg: ml_collections.ConfigDict, mesh: Mesh, rng: jax.Array
                 ) -> tuple[TrainState, TrainState]:
  """(state, shardings): built already sharded, so no full-size array ever exists."""
  shardings = state_shardings(abstract_state(cfg), mesh)
  return jax.jit(_init_fn(cfg), out_shardings=shardings)(rng), shardings


def state_bytes(cfg: ml_collections.ConfigDict, shape: dict[str, int]) -> tuple[int, int]:
  """(params, optimizer state) bytes per device on a mesh of `shape`, exactly.

  Every device holds one equally shaped shard of each leaf (_fit keeps only
  axes that divide), so the shard shape is the per-device footprint.
  """
  abstract = abstract_state(cfg, AbstractMesh(tuple(shape.values()), tuple(shape)))
  per_device = lambda tree: sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                                for x in jax.tree.leaves(tree))
  return per_device(abstract.params), per_device(abstract.opt_state)


def device_memory_bytes() -> tuple[int, str] | None:
  """(bytes one local device may use, where the figure comes from), or None if unknown.

  Accelerators report their limit; simulated CPU devices share the host's
  available memory equally.
  """
  device = jax.local_devices()[0]
  stats = device.memory_stats() if device.platform != 'cpu' else None
  if stats and stats.get('bytes_limit'):
    return int(stats['bytes_limit']), f'{device.device_kind} memory limit'
  try:
    with open('/proc/meminfo') as f:
      fields = dict(line.split(':', 1) for line in f)
    available = int(fields['MemAvailable'].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return None
  n = jax.local_device_count()
  return available // n, f'host MemAvailable / {n} local device{"s" * (n > 1)}'


def check_state_fits(cfg: ml_collections.ConfigDict, mesh: Mesh) -> None:
  """Refuses, before allocating, a state whose params + moments exceed a device's memory."""
  params, opt = state_bytes(cfg, dict(mesh.shape))
  memory = device_memory_bytes()
  if memory is None or params + opt <= memory[0]:
    return
  gb = lambda b: f'{b / 1e9:.2f} GB'
  raise MemoryError(
      f'params + Adam moments need {gb(params + opt)} per device (params {gb(params)}, '
      f'optimizer state {gb(opt)}) on mesh {dict(mesh.shape)} of {mesh.size} '
      f'{mesh.devices.flat[0].platform} devices, but a device has {gb(memory[0])} '
      f'({memory[1]}); activations need more on top. Run on more devices (the state is '
      'sharded over train.mesh_fsdp x train.mesh_context), and size the run first with: '
      'python plan.py --config=CONFIG --devices=N.')


def load_init(cfg: ml_collections.ConfigDict, mesh: Mesh, state: TrainState,
              shardings: TrainState) -> TrainState:
  """Step-0 state from cfg.train.init_from: an HF directory or one of our checkpoints.

  Only the weights are taken (fresh optimizer), except with
  train.reset_step_on_init (stage 2), which also takes the Adam moments and
  count from a full train checkpoint and restarts the step and schedule.
  """
  path = cfg.train.init_from
  if os.path.exists(os.path.join(path, 'config.json')):
    params, source = convert.load_hf(path, pad_vocab_to=128)
  elif checkpoint.committed_steps(path):
    source = ml_collections.ConfigDict(checkpoint.read_metadata(path)['config']).model
    if cfg.train.reset_step_on_init:
      restored, _ = checkpoint.restore_latest_good(path, abstract_state(cfg, mesh))
      return restored._replace(opt_state=optim.stage2_reset(restored.opt_state))
    params, _ = checkpoint.restore(path, abstract_state(cfg, mesh).params, subtree='params')
  else:
    raise FileNotFoundError(f'init_from={path!r} is neither an HF directory (config.json) '
                            'nor a checkpoint directory with a committed step_N.')
  for field in model.ARCHITECTURE_FIELDS:
    if source[field] != cfg.model[field]:
      raise ValueError(f'init_from={path}: the weights have {field}={source[field]!r}, the '
                       f'config {cfg.model[field]!r}; set --config.model.{field} to match.')
  params = jax.tree.map(jax.device_put, params, shardings.params)
  return state._replace(params=params)


# --- The step ---------------------------------------------------------------------------


def sequence_layout(cfg_model: ml_collections.ConfigDict, mesh: Mesh,
                    batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Under context parallelism, the batch's [B, T] arrays in the zig-zag layout, split over T.

  RoPE positions are computed in natural order first and travel with their
  tokens; the loss is a sum over tokens, so reordering them changes nothing.
  Without a 'context' axis the batch is returned as it is.
  """
  cp = kernels.context_parallel.degree(mesh)
  if cp == 1:
    return batch
  b, t = batch['tokens'].shape
  batch = dict(batch, positions=model.positions(cfg_model, b, t, batch.get('segment_ids')))
  split = NamedSharding(mesh, P(BATCH_AXES, 'context'))
  return {k: jax.lax.with_sharding_constraint(kernels.context_parallel.to_layout(v, cp), split)
          if v.ndim == 2 and v.shape[1] == t else v for k, v in batch.items()}


def make_train_step(cfg: ml_collections.ConfigDict, mesh: Mesh, accum: int):
  """One optimizer step over the global batch, in `accum` micro-batches.

  Every micro-batch loss is a sum divided by the label count of the *global*
  batch, so the accumulated gradient equals one big batch's whatever `accum`
  and the device count are.
  """
  net, tx = model.build(cfg.model), optim.make_optimizer(cfg.opt)

  def sums(params, mb):
    mb = sequence_layout(cfg.model, mesh, mb)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # model.constrain_batch needs it
      h_BTD = net.apply(params, mb['tokens'], mb.get('segment_ids'), mb.get('positions'))
    return optim.loss_sums(h_BTD, params['lm_head']['w'], mb['labels'], mb['instance_mask'],
                           z_loss=cfg.opt.z_loss, chunk=cfg.opt.loss_chunk)

  def step(state: TrainState, batch: dict[str, jax.Array]):
    denominator = optim.loss_denominator(batch['labels'], batch['instance_mask'])
    denominator = jnp.maximum(denominator, 1).astype(jnp.float32)

    def loss(params, mb):
      ce, z = sums(params, mb)
      return (ce + z) / denominator, (ce, z)
    grad_fn = jax.grad(loss, has_aux=True)
    if accum == 1:  # no accumulator to zero and add into
      grads, (ce_sum, z_sum) = grad_fn(state.params, batch)
    else:
      # [B, ...] -> [A, B/A, ...] keeping each device's rows on that device:
      # micro batch a takes rows a, a+A, ... of every device's contiguous block.
      micro = jax.tree.map(
          lambda x: jax.lax.with_sharding_constraint(
              x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1),
              NamedSharding(mesh, P(None, BATCH_AXES, *([None] * (x.ndim - 1))))), batch)

      def body(carry, mb):
        grads, ce, z = carry
        g, (c, zz) = grad_fn(state.params, mb)
        return (jax.tree.map(jnp.add, grads, g), ce + c, z + zz), None
      zeros = jax.tree.map(jnp.zeros_like, state.params)
      zero = jnp.zeros([], jnp.float32)
      (grads, ce_sum, z_sum), _ = jax.lax.scan(body, (zeros, zero, zero), micro)

    ce_loss = ce_sum / denominator
    updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=ce_loss)
    params = optim.apply_updates(state.params, updates, opt_state)  # exact no-op on a skip
    metrics = {'train/CE loss': ce_loss, 'train/Z loss': z_sum / denominator,
               **optim.opt_metrics(opt_state)}
    return TrainState(params, opt_state), metrics
  return step


def make_eval_step(cfg: ml_collections.ConfigDict, mesh: Mesh):
  """(CE sum, label count) of one held-out batch."""
  net = model.build(cfg.model)

  def step(params, batch):
    batch = sequence_layout(cfg.model, mesh, batch)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      h_BTD = net.apply(params, batch['tokens'], batch.get('segment_ids'), batch.get('positions'))
    ce, _ = optim.loss_sums(h_BTD, params['lm_head']['w'], batch['labels'],
                            batch['instance_mask'], z_loss=0.0, chunk=cfg.opt.loss_chunk)
    return ce, optim.loss_denominator(batch['labels'], batch['instance_mask'])
  return step


# --- Metrics ----------------------------------------------------------------------------

# Dense bf16 peak FLOP/s per device as JAX names the device kind (vendor spec
# sheets). TPU7x counts one of the two devices per chip.
PEAK_FLOPS = {
    'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12, 'TPU v5p': 459e12,
    'TPU v5': 459e12, 'TPU v6 lite': 918e12, 'TPU v6e': 918e12, 'TPU7x': 2307e12 / 2,
    'NVIDIA H100 80GB HBM3': 989e12, 'NVIDIA H200': 989e12, 'NVIDIA A100-SXM4-80GB': 312e12,
}


def peak_flops(cfg_train: ml_collections.ConfigDict) -> float | None:
  """Per-device peak for MFU: the config override, the table, or a CPU matmul measurement."""
  if cfg_train.peak_flops:
    return float(cfg_train.peak_flops)
  kind = jax.devices()[0].device_kind
  if kind in PEAK_FLOPS:
    return PEAK_FLOPS[kind]
  if jax.devices()[0].platform == 'cpu':
    return measured_matmul_flops()
  logging.warning('No peak FLOP/s known for %r; MFU is not reported. Set train.peak_flops.', kind)
  return None


def measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
  """Best float32 matmul FLOP/s of one device; the CPU's practical peak.

  On simulated multi-device CPUs all devices share the same cores, so this is
  divided among them by the caller's per-device accounting only if they run
  concurrently; we report against one device's measured rate.
  """
  x = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
  return 2 * n ** 3 / best


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


class MetricWriter:
  """metrics.jsonl and TensorBoard event files under Ai2's W&B names, process 0 only.

  Resuming at step `start` drops what a run killed after its last checkpoint
  logged past it: JSONL records with step > start (and a line cut by the
  kill) are removed, and TensorBoard is told to purge them (a SessionLog
  START at start + 1), so both hold exactly one history of the run.
  """

  def __init__(self, workdir: str, start: int = 0):
    self.enabled = jax.process_index() == 0
    if not self.enabled:
      return
    path = os.path.join(workdir, 'metrics.jsonl')
    if os.path.exists(path):
      kept = []
      with open(path) as f:
        for line in f:
          try:
            if json.loads(line)['step'] <= start:
              kept.append(line.rstrip('\n') + '\n')
          except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a record cut short by a hard kill
      with open(path + '.tmp', 'w') as f:
        f.writelines(kept)
      os.replace(path + '.tmp', path)
    self.jsonl = open(path, 'a')
    # Tags are written as they are ('train/CE loss'); TensorBoard accepts any tag.
    self.tb = events.Writer(os.path.join(workdir, 'tensorboard'))
    if start:
      self.tb.start_session(start + 1)

  def write(self, step: int, metrics: dict[str, float | str]) -> None:
    """One record; numbers become TensorBoard scalars, strings its text summaries."""
    if not self.enabled:
      return
    self.jsonl.write(json.dumps({'step': step, **metrics}) + '\n')
    self.jsonl.flush()
    self.tb.summary(step, [events.text_value(name, value) if isinstance(value, str)
                           else events.scalar_value(name, value)
                           for name, value in metrics.items()])

  def close(self) -> None:
    if self.enabled:
      self.jsonl.close()
      self.tb.close()


# --- Stopping a diverged run ----------------------------------------------------------


def stop_diverged(reason: str, step: int, cfg: ml_collections.ConfigDict,
                  ckpt: checkpoint.Checkpointer, state: TrainState, meta: dict[str, Any],
                  writer: MetricWriter) -> NoReturn:
  """Records why, saves the state as unhealthy, says what to do, exits EXIT_DIVERGED."""
  writer.write(step, {'guard/diverged': 1.0, 'guard/reason': reason})
  ckpt.save(step, state, {**meta, 'diverged': reason}, healthy=False)
  ckpt.wait()
  healthy = ckpt.latest_healthy_step()
  back = (f'The last healthy checkpoint is step {healthy}: to resume from it, move the newer '
          f'step_* directories out of {ckpt.directory}, then rerun with the cause fixed'
          if healthy is not None else
          'No healthy checkpoint exists yet: start again in a new --workdir with the cause fixed')
  print(f'DIVERGED: {reason}. Stopped at step {step}; its state is saved for inspection as '
        f'checkpoint step {step}, marked unhealthy. {back} (e.g. a lower --config.opt.lr, now '
        f'{cfg.opt.lr:g}), or, if the run was in fact healthy, raise --config.train.max_loss '
        f'or --config.train.max_consecutive_skips.', file=sys.stderr, flush=True)
  raise SystemExit(EXIT_DIVERGED)


# --- The loop ---------------------------------------------------------------------------


class Progress:
  """Each step's metrics: to the divergence guard, metrics.jsonl + TensorBoard, the console.

  Metrics stay on device until flush() (log and save steps), so the loop
  never waits on the host in between; flush() hands every step to the guard,
  in order, before anything else sees it.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, writer: MetricWriter,
               guard: guards.DivergenceGuard, devices: int, start: int):
    self.writer, self.guard, self.devices, self.steps = writer, guard, devices, cfg.train.steps
    self.tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    self.flops_per_token = model.flops_per_token(cfg.model, cfg.data.seq_len)
    self.peak = peak_flops(cfg.train)
    self.pending: list[tuple[int, dict[str, jax.Array]]] = []
    self.window_start, self.window_step, self.data_wait = time.perf_counter(), start, 0.0

  def add(self, step: int, metrics: dict[str, jax.Array], data_wait: float) -> None:
    self.pending.append((step, metrics))
    self.data_wait += data_wait

  def flush(self, log: bool) -> dict[str, float]:
    """Judges and writes the pending steps; with `log`, prints the last with its speed."""
    records = [(s, self._record(s, m)) for s, m in jax.device_get(self.pending)]
    self.pending = []
    for step, record in records:
      self.guard.observe(step, record)
    step, last = records[-1]
    if log:
      last.update(self._throughput(step))
      print(f"step {step:>7d}/{self.steps}  loss {last['train/CE loss']:.4f}  "
            f"lr {last['optim/LR']:.3g}  gnorm {last['optim/total grad norm']:.3f}  "
            f"{last['throughput/device/TPS']:,.0f} tok/s/dev  {last['time/step'] * 1e3:.0f} "
            f"ms/step  eta {_duration((self.steps - step) * last['time/step'])}"
            + ('  [skipped]' if last['optim/step skipped'] else ''), flush=True)
    for s, record in records:
      self.writer.write(s, record)
    return last

  def _record(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
    record = {k: float(v) for k, v in metrics.items()}
    record['train/PPL'] = float(np.exp(min(record['train/CE loss'], 80.0)))
    record['throughput/total tokens'] = step * self.tokens_per_step
    return record

  def _throughput(self, step: int) -> dict[str, float]:
    """Per-device speed over the steps since the last log line; starts the next window."""
    n, seconds = step - self.window_step, time.perf_counter() - self.window_start
    tps = n * self.tokens_per_step / seconds / self.devices
    out = {'throughput/device/TPS': tps, 'time/step': seconds / n,
           'time/data wait': self.data_wait / n}
    if self.peak:
      out['throughput/device/MFU'] = tps * self.flops_per_token / self.peak
    self.window_start, self.window_step, self.data_wait = time.perf_counter(), step, 0.0
    return out


def _duration(seconds: float) -> str:
  """'1h02m', '3m05s' or '42s': the ETA of the steps left at the last window's speed."""
  s = int(round(seconds))
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  return f'{s // 60}m{s % 60:02d}s' if s >= 60 else f'{s}s'


class Preemption:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, checkpoints and exits.

  close() puts the previous handlers back (train() may run inside a larger program).
  """

  def __init__(self):
    self.requested = False
    self._previous = {sig: signal.signal(sig, self._handle)
                      for sig in (signal.SIGTERM, signal.SIGINT)}

  def _handle(self, signum, frame):
    del frame
    logging.warning('Signal %d: will checkpoint after this step and exit.', signum)
    self.requested = True

  def agreed(self) -> bool:
    """Whether any process was signalled; every process must stop at the same step.

    Multi-process runs pay one tiny host collective per step for this: a
    process that stopped alone would leave the others hanging in the next step.
    """
    if jax.process_count() == 1:
      return self.requested
    return bool(np.max(multihost_utils.process_allgather(np.int32(self.requested))))

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def code_version() -> str:
  try:
    return subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), check=True
                          ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, naming the field and the fix; touches nothing."""
  model.validate(cfg.model)
  optim.check_config(cfg.opt)
  if cfg.data.vocab_size > cfg.model.vocab_size:
    raise ValueError(f'data.vocab_size={cfg.data.vocab_size} exceeds model.vocab_size='
                     f'{cfg.model.vocab_size}: token ids would index past the embedding.')
  kernels.context_parallel.check_seq_len(cfg.data.seq_len, cfg.train.get('mesh_context', 1))
  t = cfg.train
  rules = (  # field, holds, what it must be
      ('steps', t.steps >= 1, 'an integer >= 1'),
      ('log_every', t.log_every >= 1, 'an integer >= 1'),
      ('ckpt_every', t.ckpt_every >= 1, 'an integer >= 1'),
      ('keep_last', t.keep_last >= 1, 'an integer >= 1 (the newest checkpoints kept)'),
      ('keep_every', t.keep_every >= 0, 'an integer >= 0 (0: keep none permanently)'),
      ('eval_every', t.eval_every >= 0, 'an integer >= 0 (0: never)'),
      ('micro_batch_size', t.micro_batch_size >= 1, 'an integer >= 1'),
      ('max_loss', t.max_loss > 0, 'a number > 0, or inf to turn the loss bound off'),
      ('max_consecutive_skips', t.max_consecutive_skips >= 1, 'an integer >= 1'),
  )
  for field, holds, rule in rules:
    if not holds:
      raise ValueError(f'cfg.train.{field}={t[field]!r} must be {rule}; set '
                       f'--config.train.{field} to such a value.')


def train(cfg: ml_collections.ConfigDict, workdir: str, sample_tokens: int = 0
          ) -> dict[str, float]:
  """Runs (or resumes) training to cfg.train.steps; returns the last logged metrics.

  Cheap checks come first, so a bad setting fails in seconds with nothing
  allocated or written: the config, the data files, the mesh and
  micro-batching, and whether params + moments fit a device. Then the
  workdir is locked (by process 0, for all processes of the run): a second
  run's checkpoint clean-up would take this one's in-flight save for the
  leftovers of a crashed one.
  """
  validate(cfg)
  ds = data.dataset_from_config(  # 'packed' packs here once, then reads its verified cache
      cfg.data, cache_dir=cfg.data.cache_dir or os.path.join(workdir, 'data_cache'))
  mesh = make_mesh(cfg.train)
  accum = data.grad_accum_steps(cfg.data.global_batch_size,
                                int(np.prod([mesh.shape[a] for a in BATCH_AXES])),
                                cfg.train.micro_batch_size)
  impl, why = kernels.resolve(cfg.model, segments=data.wants_segments(cfg.data))
  logging.info('attention_impl=%s (%s).', impl, why)
  check_state_fits(cfg, mesh)
  lock = (checkpoint.WorkdirLock(workdir) if jax.process_index() == 0
          else contextlib.nullcontext())
  with lock:
    return _train_locked(cfg, workdir, ds, mesh, accum, sample_tokens)


def restore_or_init(cfg: ml_collections.ConfigDict, mesh: Mesh, ckpt: checkpoint.Checkpointer
                    ) -> tuple[TrainState, TrainState, dict[str, Any] | None]:
  """(state, shardings, loader state): the latest good checkpoint's, else step 0's."""
  if not ckpt.committed_steps():
    state, shardings = create_state(cfg, mesh, jax.random.key(cfg.train.seed))
    if cfg.train.init_from:
      state = load_init(cfg, mesh, state, shardings)
    return state, shardings, None
  latest = ckpt.latest_step()
  try:  # refuse a changed config before spending a restore on it
    guards.check_resume(cfg, checkpoint.read_metadata(ckpt.directory, latest))
  except checkpoint.CorruptCheckpointError:
    pass  # restore_latest_good sets it aside and falls back; checked below
  target = abstract_state(cfg, mesh)
  state, meta = ckpt.restore_latest_good(target)  # straight into its shards
  if meta['step'] != latest:
    guards.check_resume(cfg, meta)
  if 'diverged' in meta:
    logging.warning('Resuming from step %d, saved when the divergence guard stopped the run '
                    '(%s); the last healthy checkpoint is step %s.', meta['step'],
                    meta['diverged'], ckpt.latest_healthy_step())
  logging.info('Resumed from step %d in %s.', meta['step'], ckpt.directory)
  return state, jax.tree.map(lambda x: x.sharding, target), meta['data']


def _train_locked(cfg: ml_collections.ConfigDict, workdir: str, ds: data.Dataset, mesh: Mesh,
                  accum: int, sample_tokens: int) -> dict[str, float]:
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  ckpt = checkpoint.Checkpointer(ckpt_dir, keep_last=cfg.train.keep_last,
                                 keep_every=cfg.train.keep_every)
  if not ckpt.committed_steps() and any(
      n.startswith('corrupt.step_') for n in os.listdir(ckpt_dir)):
    # restore_latest_good set them all aside earlier; starting over from step 0
    # here would silently replace the run.
    raise FileNotFoundError(f'{ckpt_dir} holds only corrupt checkpoints (corrupt.step_*); '
                            'restore a good copy there, or remove them to start afresh.')
  state, shardings, data_state = restore_or_init(cfg, mesh, ckpt)
  start = int(jax.device_get(state.opt_state.step))
  if start == cfg.train.steps:
    print(f'The checkpoint is at step {start} = train.steps: this run is complete. Raise '
          '--config.train.steps to train further.', flush=True)

  sharding = batch_sharding(mesh)
  loader = data.Loader.from_config(
      cfg.data, ds, state=data_state, step=start, sharding=sharding,
      cache_dir=cfg.data.cache_dir or os.path.join(workdir, 'data_cache'))
  train_step = jax.jit(make_train_step(cfg, mesh, accum), donate_argnums=0,
                       out_shardings=(shardings, None))
  evaluate = held_out_evaluator(cfg, mesh)
  repeats = guards.RepeatTracker.for_dataset(ds) if cfg.train.track_repeats else None
  if repeats is not None and loader.step:  # a resumed epoch: its earlier batches were seen
    repeats.replay(loader.epoch, (loader.ids_at(loader.epoch, s) for s in range(loader.step)))
  memorization = guards.MemorizationWatch(cfg.train.memorization_threshold,
                                          cfg.train.memorization_evals)

  writer = MetricWriter(workdir, start)
  guard = guards.DivergenceGuard(cfg.train)
  progress = Progress(cfg, writer, guard, mesh.size, start)
  preempt = Preemption()
  version = code_version()
  logging.info('Training %s params on %d devices (mesh %s), %d micro-batches/step, '
               'steps %d -> %d.', f'{model.param_count(cfg.model):,}', mesh.size,
               dict(mesh.shape), accum, start, cfg.train.steps)

  last, step = {}, start
  try:
    while step < cfg.train.steps:
      t0 = time.perf_counter()
      batch = next(loader)
      wait = time.perf_counter() - t0
      ckpt.poll()  # a failed background save stops the run now, not at the next save
      state, metrics = train_step(state, batch)
      step += 1
      if repeats is not None:  # host-side: the ids of the batch just taken
        metrics = {**metrics, 'data/repeated instances': repeats.observe(
            loader.last_position[0], loader.ids_at(*loader.last_position))}
      progress.add(step, metrics, wait)
      preempted = preempt.agreed()
      finished = step == cfg.train.steps
      save = step % cfg.train.ckpt_every == 0 or finished or preempted
      log = step % cfg.train.log_every == 0 or finished or preempted
      if log or save:  # a save is judged healthy only after the guard saw its step
        last = progress.flush(log)
        memorization.observe_train(step, last['train/CE loss'])
      if guard.reason:
        stop_diverged(guard.reason, step, cfg, ckpt, state,
                      checkpoint_meta(cfg, step, loader, version), writer)
      # Not on preemption: the grace period is for the checkpoint.
      if evaluate and cfg.train.eval_every and (step % cfg.train.eval_every == 0 or finished):
        val = evaluate(state.params)
        writer.write(step, {**val, **memorization.observe_eval(
            step, val['eval/lm/validation/CE loss'])})
        last.update(val)
        print(f"step {step:>7d}  validation loss {val['eval/lm/validation/CE loss']:.4f}",
              flush=True)
      if save:
        ckpt.save(step, state, checkpoint_meta(cfg, step, loader, version),
                  healthy=guard.healthy)
      if preempted:
        ckpt.wait()
        logging.warning('Preempted at step %d; checkpoint written.', step)
        raise SystemExit(EXIT_PREEMPTED)
  except BaseException as e:
    # Waiting for an in-flight save would block on peers that may wait on us
    # (multi-process); abandon it: uncommitted saves are ignored on resume.
    if jax.process_count() == 1 or isinstance(e, SystemExit):
      try:
        ckpt.close()
      except Exception:  # pylint: disable=broad-except  # keep the original error
        logging.exception('The in-flight checkpoint save failed too.')
    raise
  else:
    ckpt.close()
  finally:
    preempt.close()
    loader.close()
    writer.close()
  if sample_tokens:
    print_sample(cfg, state.params, sample_tokens)
  return last


def checkpoint_meta(cfg: ml_collections.ConfigDict, step: int, loader: data.Loader,
                    version: str) -> dict[str, Any]:
  """What a checkpoint records besides the state: the config, the data position, the code."""
  return {'step': step, 'config': cfg.to_dict(), 'data': loader.state(),
          'code_version': version, 'rng_seed': cfg.train.seed}


def held_out_evaluator(cfg: ml_collections.ConfigDict, mesh: Mesh):
  """A function params -> {'eval/lm/validation/CE loss', PPL} over fixed batches, or None."""
  if not cfg.data.validation_paths:
    return None
  val_ds = data.Dataset.from_config(cfg.data, paths=list(cfg.data.validation_paths))
  batch_size = min(cfg.data.global_batch_size, val_ds.num_instances)
  batch_size -= batch_size % data.num_batch_shards(batch_sharding(mesh), batch_size) or 0
  batches = data.validation_batches(val_ds, batch_size, cfg.data.validation_batches,
                                    document_masking=data.wants_segments(cfg.data))
  step = jax.jit(make_eval_step(cfg, mesh))
  sharding = batch_sharding(mesh)

  def evaluate(params):
    ce, count = 0.0, 0
    for b in batches:
      c, n = step(params, {k: jax.device_put(v, NamedSharding(
          mesh, P(*sharding.spec[:np.ndim(v)]))) for k, v in b.items()})
      ce, count = ce + float(c), count + int(n)
    loss = ce / max(count, 1)
    return {'eval/lm/validation/CE loss': loss,
            'eval/lm/validation/PPL': float(np.exp(min(loss, 80.0)))}
  return evaluate


def print_sample(cfg: ml_collections.ConfigDict, params: model.Params, length: int,
                 prompt: str = 'ROMEO:\n', temperature: float = 0.8, top_k: int = 40,
                 seed: int = 0) -> None:
  """A continuation of `prompt` with the embedded tokenizer (small configs only).

  Sampled at `temperature` from the `top_k` likeliest tokens with a fixed seed
  (so a rerun prints the same text), as nanoGPT does: greedy decoding of a
  small model loops on its likeliest phrase ("and I have the king, and I
  have the king"), which shows what it learned less well than a sample does.
  """
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'tokenizer.json')
  if cfg.data.vocab_size > 65536 or not os.path.exists(path):
    return
  tok = Tokenizer.from_file(path)
  ids = tok.encode(prompt).ids
  total = min(len(ids) + length, cfg.data.seq_len)

  @jax.jit
  def next_token(p, tokens_1T, t, key):
    logits_V = model.logits(p, tokens_1T, cfg.model)[0, t - 1, :cfg.data.vocab_size]
    top_logits_k, top_ids_k = jax.lax.top_k(logits_V.astype(jnp.float32) / temperature, top_k)
    return top_ids_k[jax.random.categorical(key, top_logits_k)]

  tokens = np.zeros((1, total), np.int32)
  tokens[0, :len(ids)] = ids
  key = jax.random.key(seed)
  for t in range(len(ids), total):  # causal, so the zero padding after t is never seen
    tokens[0, t] = int(next_token(params, jnp.asarray(tokens), t, jax.random.fold_in(key, t)))
  logging.info('Sample: temperature %g, top-%d, seed %d.', temperature, top_k, seed)
  print('--- sample ---\n' + tok.decode(tokens[0].tolist()) + '\n--------------', flush=True)


def _cluster_detected() -> str | None:
  """Names the multi-process environment JAX can configure itself from, if any."""
  if os.environ.get('JAX_COORDINATOR_ADDRESS'):
    return 'JAX_COORDINATOR_ADDRESS'
  if int(os.environ.get('SLURM_NTASKS', '1')) > 1 and 'SLURM_PROCID' in os.environ:
    return 'SLURM'  # srun: one task per host (or per accelerator)
  if (os.environ.get('TPU_WORKER_HOSTNAMES') or os.environ.get('MEGASCALE_COORDINATOR_ADDRESS')
      or glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*')):
    # A Cloud TPU VM (its chips, or GKE's host list): JAX reads the slice's hosts
    # from the metadata server; a single-host slice becomes one process.
    return 'Cloud TPU'
  return None


def init_distributed(coordinator_address: str | None = None, process_id: int | None = None,
                     num_processes: int | None = None, heartbeat_timeout: int = 100) -> None:
  """Joins a multi-process run before any device is touched; a no-op for one process.

  Explicit coordinator_address/process_id/num_processes win; otherwise JAX's
  own detection runs on TPU pods and under SLURM. CPU processes talk through
  gloo collectives (local multi-process tests).
  """
  explicit = {'coordinator_address': coordinator_address, 'process_id': process_id,
              'num_processes': num_processes}
  given = [k for k, v in explicit.items() if v is not None]
  if given and len(given) < 3:
    raise app.UsageError(f'--{", --".join(given)} given without '
                         f'--{", --".join(sorted(set(explicit) - set(given)))}; a '
                         'multi-process run needs all three (or none, on a TPU pod or SLURM).')
  source = 'flags' if given else _cluster_detected()
  if source is None:
    return
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # A dead peer is noticed by its missing heartbeats: the survivors abort
  # instead of hanging in a collective, so the launcher can restart them all.
  jax.distributed.initialize(**(explicit if given else {}),
                             heartbeat_timeout_seconds=heartbeat_timeout)
  logging.info('Process %d of %d (%s), %d local of %d devices.', jax.process_index(),
               jax.process_count(), source, jax.local_device_count(), jax.device_count())


# --- The command line -------------------------------------------------------------------

DEFAULT_CONFIG = 'configs/small.py'  # relative to the working directory, as ml_collections reads it


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if FLAGS.dry_run:
    raise app.UsageError('--dry_run moved to its own entry point: python plan.py '
                         '--config=CONFIG --devices=N [--target_devices=M].')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required (checkpoints and metrics go there).')
  try:
    validate(FLAGS.config)  # before anything is built or written
  except ValueError as e:
    sys.exit(f'error: {e}')
  init_distributed(FLAGS.coordinator_address, FLAGS.process_id, FLAGS.num_processes,
                   FLAGS.heartbeat_timeout)
  try:
    train(FLAGS.config, FLAGS.workdir, FLAGS.sample_tokens)
  except (guards.RunError, checkpoint.WorkdirLockedError) as e:
    sys.exit(f'error: {e}')


def run() -> None:
  """The command line: defines the flags and runs main (`python train.py` calls it).

  Flags are defined here rather than at import, so plan.py, tests and scripts
  can import this module as a library.
  """
  # Without --config in argv this already parses the default file and the overrides.
  with guards.config_mistakes_in_one_line(sys.argv, DEFAULT_CONFIG):
    config_flags.DEFINE_config_file('config', DEFAULT_CONFIG, 'Training config file.')
  flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and logs go here.')
  flags.DEFINE_integer('sample_tokens', 96, 'Length of the sample printed at the end (0: none).')
  flags.DEFINE_bool('dry_run', False, 'Moved: run python plan.py --config=... --devices=N.')
  flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 in a multi-process '
                      'run (default: detected on TPU pods and under SLURM; see init_distributed).')
  flags.DEFINE_integer('process_id', None, 'This process in a multi-process run (with '
                       '--coordinator_address).')
  flags.DEFINE_integer('num_processes', None, 'Processes in a multi-process run (with '
                       '--coordinator_address).')
  flags.DEFINE_integer('heartbeat_timeout', 100, 'Seconds without a heartbeat after which the '
                       'other processes of a multi-process run abort (JAX default 100).')
  app.run(main, flags_parser=guards.parse_flags)


if __name__ == '__main__':
  run()
