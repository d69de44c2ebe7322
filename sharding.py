"""How a run is laid out on devices: the mesh, the sharding of state and batch, memory, hosts.

- The mesh: ('data', 'fsdp'[, 'context'], 'tensor') axes from cfg.train.mesh_*, laid
  out by train.mesh_layout: in device order, or HSDP (shards within a node, replicas
  across nodes); step_traffic, the bytes a step sends within and across nodes.
- One partition spec per parameter name (FSDP, tensor parallelism), fitted to
  the mesh; Adam moments share their parameter's sharding.
- The batch: rows over ('data', 'fsdp'); under context parallelism, the
  sequence over 'context' in the zig-zag layout.
- Memory: the exact per-device bytes of params + moments, checked against a
  device before anything is allocated (plan.py answers the fuller question).
- Hosts: joining a multi-process run (TPU pods, SLURM, torchrun-style variables,
  explicit flags; hosts/launchers.py picks each process's GPUs).

Shapes: B global batch, T sequence.
"""

import dataclasses
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
from hosts import launchers
from hosts import peers
import kernels
import model

BATCH_AXES = model.BATCH_AXES  # the global batch is split over ('data', 'fsdp')
MESH_AXES = ('data', 'fsdp', 'context', 'tensor')  # 'context' only when train.mesh_context > 1

# --- The mesh ---------------------------------------------------------------------------


LAYOUTS = ('auto', 'fsdp', 'hsdp')  # train.mesh_layout


def layout_for(cfg_train: ml_collections.ConfigDict, platform: str) -> str:
  """'fsdp' or 'hsdp': train.mesh_layout, with 'auto' resolved for `platform`.

  'auto' is HSDP on GPUs (shards within a node over NVLink, replicas across
  nodes, as Ai2 trained Olmo 3 7B) and one flat FSDP mesh on TPUs and CPUs (a
  TPU slice's interconnect joins every chip of it).
  """
  layout = cfg_train.get('mesh_layout', 'fsdp')
  if layout not in LAYOUTS:
    raise errors.ConfigError(f'train.mesh_layout={layout!r} is not one of {list(LAYOUTS)}; set '
                             '--config.train.mesh_layout.')
  return ('hsdp' if platform == 'gpu' else 'fsdp') if layout == 'auto' else layout


def mesh_shape(cfg_train: ml_collections.ConfigDict, devices: int, layout: str = 'fsdp',
               node_devices: int | None = None) -> dict[str, int]:
  """The ('data', 'fsdp'[, 'context'], 'tensor') sizes for `devices`; a -1 takes the rest.

  The 'context' axis (context parallelism, kernels/context_parallel.py) is
  there only when train.mesh_context > 1, so other meshes keep three axes.
  Under layout 'hsdp' the data axis is always the replicas the devices leave
  (train.mesh_data must be -1, or its default 1), and mesh_fsdp=-1 is the
  devices of one node (`node_devices`, default all) over context x tensor.
  """
  context = cfg_train.mesh_context
  if context < 1:
    raise errors.ConfigError(f'train.mesh_context={context} must be an integer >= 1 (1: no '
                             'context parallelism); set --config.train.mesh_context.')
  shape = [cfg_train.mesh_data, cfg_train.mesh_fsdp, context, cfg_train.mesh_tensor]
  if layout == 'hsdp':
    check_hsdp_fields(cfg_train)
    node = node_devices or devices
    inner = context * cfg_train.mesh_tensor
    fsdp = cfg_train.mesh_fsdp
    if fsdp == -1 and (inner < 1 or node % inner):
      raise errors.ConfigError(
          f'train.mesh_layout=hsdp shards over one node of {node} devices, which '
          f'train.mesh_context x train.mesh_tensor = {inner} does not divide; set '
          '--config.train.mesh_fsdp to the shard count.')
    shape = [-1, node // inner if fsdp == -1 else fsdp, context, cfg_train.mesh_tensor]
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


def check_hsdp_fields(cfg_train: ml_collections.ConfigDict) -> None:
  """Under HSDP the replicas follow the device count; a fixed train.mesh_data is a mistake."""
  if cfg_train.mesh_data not in (-1, 1):
    raise errors.ConfigError(
        f'train.mesh_data={cfg_train.mesh_data} with train.mesh_layout=hsdp: the replicas '
        '(the data axis) are the devices over the shards, so set --config.train.mesh_data=-1 '
        'and choose the shards with --config.train.mesh_fsdp (-1: one node).')


def nodes_of(devices) -> list[list[Any]]:
  """The devices grouped by node, in device order within each.

  A node is what XLA calls a slice on GPUs and TPUs (GPUs of one host, or of
  one NVLink domain; the chips of one TPU slice: `slice_index`) and a process
  on CPUs (each test process stands for a node).
  """
  devices = list(devices)
  key = ('slice_index' if devices[0].platform != 'cpu' and hasattr(devices[0], 'slice_index')
         else 'process_index')
  groups: dict[int, list[Any]] = {}
  for d in devices:
    groups.setdefault(getattr(d, key), []).append(d)
  return [groups[k] for k in sorted(groups)]


def hsdp_devices(shape: dict[str, int], devices) -> np.ndarray:
  """`devices` as an array of `shape` whose shard axes (fsdp, context, tensor) stay
  inside a node where they fit, with the nodes along the data axis (then along fsdp,
  for a shard group that spans several whole nodes): mesh_utils'
  create_hybrid_device_mesh with a node as its granule."""
  from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
  nodes = nodes_of(devices)
  per_node = len(nodes[0])
  sizes = list(shape.values())
  group = int(np.prod(sizes[1:]))  # one copy of the state: fsdp x context x tensor
  if any(len(n) != per_node for n in nodes):
    raise errors.ConfigError(f'train.mesh_layout=hsdp needs the same devices on every node; '
                             f'they have {sorted({len(n) for n in nodes})}.')
  in_node = group // sizes[1]  # context x tensor: always inside a node
  inner_fsdp = sizes[1] if group <= per_node else per_node // in_node
  if (per_node % group if group <= per_node else group % per_node or per_node % in_node):
    raise errors.ConfigError(
        f'train.mesh_layout=hsdp: a shard group of {group} devices neither fits a node of '
        f'{per_node} evenly nor spans whole nodes; set --config.train.mesh_fsdp to a divisor '
        f'or a multiple of {per_node}.')
  inner = [per_node // group if group <= per_node else 1, inner_fsdp, *sizes[2:]]
  outer = [len(nodes) if group <= per_node else sizes[0], sizes[1] // inner_fsdp,
           *([1] * len(sizes[2:]))]
  ordered = [d for n in nodes for d in n]
  return mesh_utils.create_hybrid_device_mesh(
      inner, outer, ordered, process_is_granule=ordered[0].platform == 'cpu'
      or not hasattr(ordered[0], 'slice_index'))


def make_mesh(cfg_train: ml_collections.ConfigDict, devices=None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all), laid out by
  train.mesh_layout: in device order, or HSDP's shards within a node."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  layout = layout_for(cfg_train, devices.flat[0].platform)
  nodes = nodes_of(devices.flat) if layout == 'hsdp' else [devices]
  shape = mesh_shape(cfg_train, devices.size, layout, len(nodes[0]))
  grid = (hsdp_devices(shape, devices.flat) if len(nodes) > 1 else
          devices.reshape(tuple(shape.values())))
  # Plain Mesh = Auto axes: jax.make_mesh's Explicit axes break hk-style gathers.
  return Mesh(grid, tuple(shape))


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


@dataclasses.dataclass(frozen=True)
class _Slot:
  """A stand-in device for placing a planned mesh: `id // node` is its node."""
  id: int
  process_index: int
  slice_index: int
  platform: str = 'gpu'
  device_kind: str = 'planned'


def planned_devices(shape: dict[str, int], layout: str, node_devices: int) -> np.ndarray:
  """Device numbers laid out as make_mesh lays out a run of nodes of `node_devices`."""
  n = int(np.prod(list(shape.values())))
  if layout != 'hsdp' or n <= node_devices:
    return np.arange(n).reshape(tuple(shape.values()))
  slots = [_Slot(i, i // node_devices, i // node_devices) for i in range(n)]
  return np.vectorize(lambda d: d.id)(hsdp_devices(shape, slots))


def step_traffic(abstract_params: Any, shape: dict[str, int], layout: str, node_devices: int,
                 micro_batches: int) -> dict[str, float]:
  """Bytes one device sends per train step, {'within': ..., 'across': ...} nodes.

  Per micro-batch (the step's gradient accumulator is sharded like the state, so
  XLA reduces every micro-batch's gradients): each sharded weight is all-gathered
  over its shard group twice, for the forward and again for the backward, and its
  gradient reduce-scattered over it; the gradient shard is then all-reduced over the
  replicas (the batch axes the weight is not sharded over). Weights and gradients
  move in their float32 (as XLA's compiled step gathers them before the bf16 cast).
  A ring collective over n devices sends (n-1)/n of the whole per device, twice
  that for an all-reduce. A collective's group counts as 'within' when it lies in
  one node, else all its bytes count 'across'. Tensor and context parallelism's
  activation traffic is not counted.
  """
  grid = planned_devices(shape, layout, node_devices)
  axes = list(shape)

  def inside_a_node(group_axes: tuple[str, ...]) -> bool:
    if not group_axes:
      return True
    moved = np.moveaxis(grid, [axes.index(a) for a in group_axes],
                        range(grid.ndim - len(group_axes), grid.ndim))
    nodes = moved.reshape(-1, int(np.prod([shape[a] for a in group_axes]))) // node_devices
    return bool((nodes == nodes[:, :1]).all())

  sent = {'within': 0.0, 'across': 0.0}
  mesh = AbstractMesh(tuple(shape.values()), tuple(shape))
  for leaf in jax.tree.leaves(placed(abstract_params, mesh)):
    spec = leaf.sharding.spec
    sharded = tuple(a for part in spec if part
                    for a in ((part,) if isinstance(part, str) else part))
    whole = int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    g = int(np.prod([shape[a] for a in sharded])) if sharded else 1
    if g > 1:  # two gathers and one reduce-scatter over the shard group
      sent['within' if inside_a_node(sharded) else 'across'] += 3 * (g - 1) / g * whole
    replicas = tuple(a for a in BATCH_AXES + ('context',) if a in shape and a not in sharded)
    r = int(np.prod([shape[a] for a in replicas])) if replicas else 1
    if r > 1:  # the gradient shard's all-reduce over the replicas
      sent['within' if inside_a_node(replicas) else 'across'] += 2 * (r - 1) / r * whole / g
  return {k: v * micro_batches for k, v in sent.items()}


# --- Hosts ------------------------------------------------------------------------------


def cluster_detected() -> str | None:
  """Names the multi-process environment this process was started in, if any."""
  launch = launchers.detect(dict(os.environ))
  if launch is not None:
    return launch.source  # SLURM (srun) or torchrun-style variables
  if os.environ.get('JAX_COORDINATOR_ADDRESS'):
    return 'JAX_COORDINATOR_ADDRESS'
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

  Explicit coordinator_address/process_id/num_processes win; otherwise SLURM's
  srun and torchrun-style variables are read (hosts/launchers.py, which also
  picks the GPUs each process trains on: every GPU of every node), and JAX's
  own detection runs on TPU pods. num_processes=1 alone is one process with no
  detection (a lone TPU host whose metadata server is out of reach). CPU
  processes talk through gloo collectives (local multi-process tests).
  """
  explicit = {'coordinator_address': coordinator_address, 'process_id': process_id,
              'num_processes': num_processes}
  given = [k for k, v in explicit.items() if v is not None]
  if given == ['num_processes'] and num_processes == 1:
    return
  if given and len(given) < 3:
    raise errors.ConfigError(f'--{", --".join(given)} given without '
                             f'--{", --".join(sorted(set(explicit) - set(given)))}; a '
                             'multi-process run needs all three (or none, on a TPU pod, '
                             'under SLURM or torchrun-style variables).')
  env = dict(os.environ)
  launch = launchers.detect(env, coordinator_address, process_id, num_processes)
  source = launch.source if launch else cluster_detected()
  if source is None:
    return
  kwargs: dict[str, Any] = {}
  if launch is not None:
    kwargs = {k: v for k, v in (('coordinator_address', launch.coordinator_address),
                                ('num_processes', launch.num_processes),
                                ('process_id', launch.process_id)) if v is not None}
    cpu_only = os.environ.get('JAX_PLATFORMS', '').strip() == 'cpu'
    if not cpu_only and 'JAX_LOCAL_DEVICE_IDS' not in env:  # that variable: JAX reads it
      ids = launchers.local_device_ids(launch, env)
      if ids is not None:
        kwargs['local_device_ids'] = ids
    if launch.coordinator_address and launch.process_id == 0:
      check_coordinator_port(launch.coordinator_address)
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # A dead peer is noticed by its missing heartbeats: the survivors end (hosts/peers.py)
  # instead of hanging in a collective, so the run can be restarted.
  try:
    client, address = initialize_with_callback(
        peers.on_lost, **kwargs, heartbeat_timeout_seconds=heartbeat_timeout)
  except Exception as e:  # pylint: disable=broad-except
    if source != 'Cloud TPU' or 'metadata' not in f'{e!r} {e.__context__!r}':
      raise
    raise errors.ConfigError(  # seen on a single-chip TPU host without a metadata server
        'this host has TPU chips, so JAX asked the Cloud TPU metadata server for the '
        f'slice\'s hosts, and it could not be reached ({type(e).__name__}); on a single '
        'host pass --num_processes=1, on a pod --coordinator_address, --process_id and '
        '--num_processes.') from e
  local = jax.local_devices()
  logging.info('Process %d of %d (%s), %d %s devices per process%s, %d devices in all.',
               jax.process_index(), jax.process_count(),
               launch.describe() if launch else source, len(local), local[0].platform,
               f' (local ids {kwargs["local_device_ids"]})' if 'local_device_ids' in kwargs
               else '', jax.device_count())
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
