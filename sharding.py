"""How a run is laid out on devices: the mesh, the sharding of state and batch, memory, hosts.

- The mesh: ('data', 'fsdp'[, 'context'], 'tensor') axes from cfg.train.mesh_*.
- One partition spec per parameter name (FSDP, tensor parallelism), fitted to
  the mesh; Adam moments share their parameter's sharding.
- The batch: rows over ('data', 'fsdp'); under context parallelism, the
  sequence over 'context' in the zig-zag layout.
- Memory: the exact per-device bytes of params + moments, checked against a
  device before anything is allocated (plan.py answers the fuller question).
- Hosts: joining a multi-process run (TPU pods, SLURM, explicit flags).

Shapes: B global batch, T sequence.
"""

import errno
import glob
import os
import socket
from typing import Any

from absl import flags, logging
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np

import errors
from hosts import peers
import kernels
import model

BATCH_AXES = model.BATCH_AXES  # the global batch is split over ('data', 'fsdp')
MESH_AXES = ('data', 'fsdp', 'context', 'tensor')  # 'context' only when train.mesh_context > 1

# --- The mesh ---------------------------------------------------------------------------


def mesh_shape(cfg_train: ml_collections.ConfigDict, devices: int) -> dict[str, int]:
  """The ('data', 'fsdp'[, 'context'], 'tensor') sizes for `devices`; a -1 takes the rest.

  The 'context' axis (context parallelism, kernels/context_parallel.py) is
  there only when train.mesh_context > 1, so other meshes keep three axes.
  """
  context = cfg_train.mesh_context
  if context < 1:
    raise errors.ConfigError(f'train.mesh_context={context} must be an integer >= 1 (1: no '
                             'context parallelism); set --config.train.mesh_context.')
  shape = [cfg_train.mesh_data, cfg_train.mesh_fsdp, context, cfg_train.mesh_tensor]
  known = int(np.prod([s for s in shape if s != -1]))
  if shape.count(-1) > 1 or devices % known:
    needs = (f'it needs a multiple of {known} devices' if shape.count(-1) <= 1 else
             'at most one of them may be -1')
    raise errors.ConfigError(
        f'mesh (data={shape[0]}, fsdp={shape[1]}, context={shape[2]}, tensor={shape[3]}) does '
        f'not fit {devices} devices: {needs}. Run on such a device count, or set train.mesh_* '
        'so their product is the device count (one of them may be -1).')
  shape = [devices // known if s == -1 else s for s in shape]
  if int(np.prod(shape)) != devices:
    raise errors.ConfigError(f'mesh {shape} has {int(np.prod(shape))} slots for {devices} '
                             'devices; set one of train.mesh_* to -1 to let it follow the '
                             'device count.')
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
PARAM_SPECS = {
    'embedding': P(None, 'fsdp'),  # [V, D]
    'w_q': P(None, _FSDP, 'tensor'), 'w_k': P(None, _FSDP, 'tensor'),
    'w_v': P(None, _FSDP, 'tensor'), 'w_o': P(None, 'tensor', _FSDP),
    'w_gate': P(None, _FSDP, 'tensor'), 'w_up': P(None, _FSDP, 'tensor'),
    'w_down': P(None, 'tensor', _FSDP), 'w': P(_FSDP, 'tensor'),  # lm_head [D, V]
}


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
  """Keeps the axes the mesh has and that divide their dimension (small configs on many
  devices): ('fsdp', 'context') falls back to 'fsdp' alone, then to replication."""
  def fit(axes, n: int):
    axes = [a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a in mesh.shape]
    while axes and n % int(np.prod([mesh.shape[a] for a in axes])):
      axes.pop()
    return tuple(axes) if len(axes) > 1 else (axes[0] if axes else None)
  return P(*[fit(a, shape[i])
             for i, a in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec)))])


def state_shardings(abstract: Any, mesh: Mesh) -> Any:
  """NamedShardings for every leaf: weights and both Adam moments alike, scalars replicated."""
  def leaf(path, x):
    spec = PARAM_SPECS.get(getattr(path[-1], 'key', None), P()) if x.ndim > 1 else P()
    return NamedSharding(mesh, fit_spec(spec, x.shape, mesh))
  return jax.tree_util.tree_map_with_path(leaf, abstract)


def placed(abstract: Any, mesh: Mesh | AbstractMesh) -> Any:
  """The train state's ShapeDtypeStructs with their shardings on `mesh` (state_shardings)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, state_shardings(abstract, mesh))


def batch_sharding(mesh: Mesh | AbstractMesh) -> NamedSharding:
  return NamedSharding(mesh, P(BATCH_AXES, None))


def abstract_batch(cfg_data: ml_collections.ConfigDict, mesh: Mesh | AbstractMesh
                   ) -> dict[str, jax.ShapeDtypeStruct]:
  """The global batch data.Loader yields (batches.make_batch's keys), as ShapeDtypeStructs
  with their shardings: what an ahead-of-time compile of the train step takes."""
  B, T = cfg_data.global_batch_size, cfg_data.seq_len
  rows = batch_sharding(mesh)
  batch = {'tokens': jax.ShapeDtypeStruct((B, T), np.int32, sharding=rows),
           'labels': jax.ShapeDtypeStruct((B, T), np.int32, sharding=rows),
           'instance_mask': jax.ShapeDtypeStruct((B,), np.bool_,
                                                 sharding=NamedSharding(mesh, P(BATCH_AXES)))}
  if cfg_data.document_masking:
    batch['segment_ids'] = jax.ShapeDtypeStruct((B, T), np.int32, sharding=rows)
  return batch


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


# --- Memory -----------------------------------------------------------------------------


def state_bytes(abstract: Any, shape: dict[str, int]) -> tuple[int, int]:
  """(params, optimizer state) bytes per device of a train state on a mesh of `shape`, exactly.

  `abstract`: the unsharded ShapeDtypeStructs of the state (train.abstract_state).

  Every device holds one equally shaped shard of each leaf (fit_spec keeps only
  axes that divide), so the shard shape is the per-device footprint.
  """
  abstract = placed(abstract, AbstractMesh(tuple(shape.values()), tuple(shape)))
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


def check_state_fits(abstract: Any, mesh: Mesh) -> None:
  """Refuses, before allocating, a state whose params + moments exceed a device's memory."""
  params, opt = state_bytes(abstract, dict(mesh.shape))
  memory = device_memory_bytes()
  if memory is None or params + opt <= memory[0]:
    return
  gb = lambda b: f'{b / 1e9:.2f} GB'
  raise errors.ConfigError(
      f'params + Adam moments need {gb(params + opt)} per device (params {gb(params)}, '
      f'optimizer state {gb(opt)}) on mesh {dict(mesh.shape)} of {mesh.size} '
      f'{mesh.devices.flat[0].platform} devices, but a device has {gb(memory[0])} '
      f'({memory[1]}); activations need more on top. Run on more devices (the state is '
      'sharded over train.mesh_fsdp x train.mesh_context), and size the run first with: '
      'python plan.py --config=CONFIG --devices=N.')


# --- Hosts ------------------------------------------------------------------------------


def cluster_detected() -> str | None:
  """Names the multi-process environment JAX can configure itself from, if any."""
  if os.environ.get('JAX_COORDINATOR_ADDRESS'):
    return 'JAX_COORDINATOR_ADDRESS'
  if int(os.environ.get('SLURM_NTASKS', '1')) > 1 and 'SLURM_PROCID' in os.environ:
    return 'SLURM'  # srun: one task per host (or per accelerator)
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES')
  if hosts == kernels.xla.LIBTPU_PLACEHOLDERS['TPU_WORKER_HOSTNAMES'] and not (
      kernels.xla.has_tpu_chips()):
    hosts = None  # kernels.xla's stand-in for libtpu on a host without chips: no pod
  if (hosts or os.environ.get('MEGASCALE_COORDINATOR_ADDRESS')
      or glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*')):
    # A Cloud TPU VM (its chips, or GKE's host list): JAX reads the slice's hosts
    # from the metadata server; a single-host slice becomes one process.
    return 'Cloud TPU'
  return None


def init_distributed(coordinator_address: str | None = None, process_id: int | None = None,
                     num_processes: int | None = None, heartbeat_timeout: int = 100) -> None:
  """Joins a multi-process run before any device is touched; a no-op for one process.

  Explicit coordinator_address/process_id/num_processes win; otherwise JAX's
  own detection runs on TPU pods and under SLURM. num_processes=1 alone is one
  process with no detection (a lone TPU host whose metadata server is out of
  reach). CPU processes talk through gloo collectives (local multi-process tests).
  """
  explicit = {'coordinator_address': coordinator_address, 'process_id': process_id,
              'num_processes': num_processes}
  given = [k for k, v in explicit.items() if v is not None]
  if given == ['num_processes'] and num_processes == 1:
    return
  if given and len(given) < 3:
    raise errors.ConfigError(f'--{", --".join(given)} given without '
                             f'--{", --".join(sorted(set(explicit) - set(given)))}; a '
                             'multi-process run needs all three (or none, on a TPU pod or '
                             'SLURM).')
  source = 'flags' if given else cluster_detected()
  if source is None:
    return
  if given and process_id == 0:
    check_coordinator_port(coordinator_address)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # A dead peer is noticed by its missing heartbeats: the survivors end (hosts/peers.py)
  # instead of hanging in a collective, so the run can be restarted.
  try:
    client, address = initialize_with_callback(
        peers.on_lost, **(explicit if given else {}), heartbeat_timeout_seconds=heartbeat_timeout)
  except Exception as e:  # pylint: disable=broad-except
    if source != 'Cloud TPU' or 'metadata' not in f'{e!r} {e.__context__!r}':
      raise
    raise errors.ConfigError(  # seen on a single-chip TPU host without a metadata server
        'this host has TPU chips, so JAX asked the Cloud TPU metadata server for the '
        f'slice\'s hosts, and it could not be reached ({type(e).__name__}); on a single '
        'host pass --num_processes=1, on a pod --coordinator_address, --process_id and '
        '--num_processes.') from e
  logging.info('Process %d of %d (%s), %d local of %d devices.', jax.process_index(),
               jax.process_count(), source, jax.local_device_count(), jax.device_count())
  if client is not None:
    peers.watch(client, jax.process_index(), jax.process_count(), address, heartbeat_timeout)


def initialize_with_callback(on_lost: Any, **kwargs: Any) -> tuple[Any, str | None]:
  """jax.distributed.initialize(**kwargs), its client built with `on_lost` as the
  missed_heartbeat_callback; returns (the client, the coordinator's address).

  The one use of jaxlib's private API: jax.distributed.initialize does not pass the
  callback through, and without one the client aborts the process (hosts/peers.py).
  initialize calls _jax.get_distributed_runtime_client(address, process_id, ...), swapped
  here for the call's length (tests/test_multihost.py checks both signatures). A JAX
  that no longer calls it gets (None, None): the abort stays, nothing else changes.
  """
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  original, made = _jax.get_distributed_runtime_client, []

  def client(address, node_id, *args, **kw):
    made.append((original(address, node_id, *args, **kw, missed_heartbeat_callback=on_lost),
                 address))
    return made[-1][0]
  _jax.get_distributed_runtime_client = client
  try:
    jax.distributed.initialize(**kwargs)
  finally:
    _jax.get_distributed_runtime_client = original
  if not made:
    logging.warning('jax.distributed.initialize no longer builds its client through '
                    '_jax.get_distributed_runtime_client: a lost peer aborts this process.')
  return made[0] if made else (None, None)


def check_coordinator_port(address: str) -> None:
  """Refuses a coordinator port another program holds, in one line.

  Process 0 serves jax.distributed's coordination service on every interface at
  `address`'s port; when the port is taken, gRPC's failure is a segmentation fault
  with no word of the port. The check binds the way gRPC does (SO_REUSEADDR, so a
  socket of the previous attempt in TIME_WAIT does not count as taken).
  """
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise errors.ConfigError(f'--coordinator_address={address!r} is not host:port '
                             '(e.g. 10.0.0.2:8476).')
  family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
  try:
    s = socket.socket(family, socket.SOCK_STREAM)
  except OSError:  # no IPv6 stack on this host
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(('', int(port)))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # not ours to judge (permissions, no such interface): gRPC says
      raise errors.ConfigError(
          f'--coordinator_address={address}: port {port} on this host is in use by another '
          'program, so process 0 cannot serve the coordination service there; choose a free '
          'port (the same --coordinator_address on every process).') from e


def define_host_flags() -> None:
  """The multi-process flags of train.py; `init_distributed_from_flags` reads them."""
  flags.DEFINE_string('coordinator_address', None, 'host:port of process 0 in a multi-process '
                      'run (default: detected on TPU pods and under SLURM).')
  flags.DEFINE_integer('process_id', None, 'This process (with --coordinator_address).')
  flags.DEFINE_integer('num_processes', None, 'Processes (with --coordinator_address); 1 '
                       'alone: one process, no detection.')
  flags.DEFINE_integer('heartbeat_timeout', 100, 'Seconds without a heartbeat after which the '
                       'other processes of a multi-process run stop, one line naming the lost '
                       'process, exit 1 (JAX default 100).')


def init_distributed_from_flags() -> None:
  f = flags.FLAGS
  init_distributed(f.coordinator_address, f.process_id, f.num_processes, f.heartbeat_timeout)
