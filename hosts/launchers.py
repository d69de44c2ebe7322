"""Which launcher started this process, and which of the node's GPUs it trains on.

A multi-process run is started one of three ways, read in this order:

- flags: --coordinator_address, --process_id, --num_processes (they always win);
- SLURM: `srun` sets SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID and the tasks on
  each node (SLURM_STEP_TASKS_PER_NODE, e.g. '8(x64)');
- torchrun-style variables: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
  LOCAL_RANK, LOCAL_WORLD_SIZE (torchrun, Kubeflow's PyTorchJob, most GPU
  launchers). Under torchrun itself its agent already holds MASTER_PORT, so the
  JAX coordinator takes the next port; JAX_COORDINATOR_PORT overrides either, and
  JAX_COORDINATOR_ADDRESS the whole address.

A launcher may give a node one process with all its GPUs or one process per
GPU (or per few GPUs); either way every GPU the node has for the job must be
trained on. JAX's own SLURM detection gives each task the one GPU numbered
SLURM_LOCALID, so one task per node would train on one GPU of eight; here the
local device ids are passed explicitly instead: all the GPUs this process sees
when it is its node's only process, otherwise its own share of them. A node
whose processes would leave GPUs idle is refused in one line naming the srun
options that use them all. CPU processes (the tests) have no GPUs to choose:
each trains on its simulated CPU devices.

Pure functions of the environment (no JAX), so the tests can call them with
any launcher's variables. May import: errors.py.
"""

import dataclasses
import glob
import re

import errors


@dataclasses.dataclass(frozen=True)
class Launch:
  """This process's place in a run, as its launcher described it."""
  source: str  # 'flags', 'SLURM', 'torchrun', 'JAX_COORDINATOR_ADDRESS' or 'Cloud TPU'
  coordinator_address: str | None  # None: JAX derives it (SLURM's first node, a TPU pod)
  num_processes: int | None
  process_id: int | None
  local_rank: int = 0  # this process among its node's processes
  processes_on_node: int = 1  # 0: unknown (the flags do not say)
  nodes: int = 0  # 0: unknown

  def describe(self) -> str:
    """e.g. 'SLURM: 2 nodes x 8 processes' for the start-up line."""
    if self.nodes and self.processes_on_node:
      return f'{self.source}: {self.nodes} nodes x {self.processes_on_node} processes'
    return self.source


def _int(env: dict[str, str], name: str, default: int | None = None) -> int | None:
  value = env.get(name, '')
  if not value.strip():
    return default
  try:
    return int(value)
  except ValueError:
    raise errors.ConfigError(f'{name}={value!r} is not an integer; the launcher sets it, '
                             'so unset it or fix the launch.') from None


def slurm_tasks_on_node(text: str, node: int) -> int:
  """Tasks on node `node` from SLURM's compressed list: '8(x2),4' -> 8, 8, 4."""
  counts = []
  for part in filter(None, text.split(',')):
    m = re.fullmatch(r'(\d+)(?:\(x(\d+)\))?', part.strip())
    if not m:
      raise errors.ConfigError(f'cannot read the tasks per node {text!r} SLURM set; '
                               'launch with srun --ntasks-per-node=N.')
    counts += [int(m.group(1))] * int(m.group(2) or 1)
  if not 0 <= node < len(counts):
    raise errors.ConfigError(f'SLURM_NODEID={node} is outside the tasks per node {text!r}.')
  return counts[node]


def detect(env: dict[str, str], coordinator_address: str | None = None,
           process_id: int | None = None, num_processes: int | None = None) -> Launch | None:
  """The launch this process is part of, or None for a single process (no launcher seen).

  The flags win; then SLURM, then torchrun-style variables. JAX_COORDINATOR_ADDRESS
  and Cloud TPU pods are left to JAX's own detection (the caller names them).
  """
  if coordinator_address is not None:
    return Launch('flags', coordinator_address, num_processes, process_id,
                  processes_on_node=0)
  if (_int(env, 'SLURM_NTASKS', 1) or 1) > 1 and 'SLURM_PROCID' in env:
    node = _int(env, 'SLURM_NODEID', 0)
    per_node = env.get('SLURM_STEP_TASKS_PER_NODE') or env.get('SLURM_TASKS_PER_NODE') or ''
    on_node = (slurm_tasks_on_node(per_node, node) if per_node else
               _int(env, 'SLURM_NTASKS_PER_NODE', 1))
    nodes = _int(env, 'SLURM_STEP_NUM_NODES') or _int(env, 'SLURM_NNODES', 0)
    # The coordinator: JAX's SLURM detection (the step's first node, a port from the job
    # id, JAX_COORDINATOR_PORT if set), the same on every task.
    return Launch('SLURM', None, _int(env, 'SLURM_NTASKS'), _int(env, 'SLURM_PROCID'),
                  _int(env, 'SLURM_LOCALID', 0), on_node, nodes)
  if (_int(env, 'WORLD_SIZE', 1) or 1) > 1 and 'RANK' in env:
    missing = [v for v in ('MASTER_ADDR', 'MASTER_PORT') if not env.get(v)]
    if missing:
      raise errors.ConfigError(f'WORLD_SIZE and RANK are set but {" and ".join(missing)} '
                               'not: a torchrun-style launch needs all four (or pass '
                               '--coordinator_address, --process_id, --num_processes).')
    port = _int(env, 'MASTER_PORT')
    if 'TORCHELASTIC_RUN_ID' in env:
      port += 1  # torchrun's agent serves its own store on MASTER_PORT
    port = _int(env, 'JAX_COORDINATOR_PORT', port)
    world = _int(env, 'WORLD_SIZE')
    on_node = _int(env, 'LOCAL_WORLD_SIZE', 1)
    address = env.get('JAX_COORDINATOR_ADDRESS') or f'{env["MASTER_ADDR"]}:{port}'
    return Launch('torchrun', address, world, _int(env, 'RANK'),
                  _int(env, 'LOCAL_RANK', 0), on_node,
                  world // on_node if on_node and world % on_node == 0 else 0)
  return None


def _listed_gpus(env: dict[str, str]) -> int | None:
  """CUDA_VISIBLE_DEVICES' entries, where it is set."""
  listed = env.get('CUDA_VISIBLE_DEVICES')
  if listed is None:
    return None
  return len([x for x in listed.split(',') if x.strip() and x.strip() != '-1'])


def _device_files() -> int:
  """The NVIDIA GPUs this host shows (a container or cgroup shows only the job's)."""
  return len([p for p in glob.glob('/dev/nvidia*') if re.fullmatch(r'/dev/nvidia\d+', p)])


def visible_gpus(env: dict[str, str]) -> int:
  """GPUs this process may open: CUDA_VISIBLE_DEVICES' entries, else the node's."""
  listed = _listed_gpus(env)
  return node_gpus(env) if listed is None else listed


def node_gpus(env: dict[str, str]) -> int:
  """GPUs the node has for this job: SLURM_GPUS_ON_NODE where SLURM allocated them; else
  CUDA_VISIBLE_DEVICES where the user or launcher set it (GPUs it hides are not the
  job's); else the NVIDIA device files."""
  allocated = _int(env, 'SLURM_GPUS_ON_NODE')
  if allocated:
    return allocated
  listed = _listed_gpus(env)
  return _device_files() if listed is None else listed


def gpus_per_task(env: dict[str, str]) -> int | None:
  """srun --gpus-per-task (SLURM_GPUS_PER_TASK, e.g. '1' or 'h100:1'), if given."""
  value = env.get('SLURM_GPUS_PER_TASK', '').rpartition(':')[2]
  return int(value) if value.isdigit() else None


def local_device_ids(launch: Launch, env: dict[str, str]) -> list[int] | None:
  """The CUDA device ordinals (among the visible ones) this process trains on; None off GPU
  or where the launcher did not say how many processes share the node (the flags: every
  visible GPU, JAX's default).

  Refuses (ConfigError, exit 2) a node whose processes would leave some of its GPUs
  idle, naming the launch options that use them all.
  """
  if launch.processes_on_node == 0:
    return None
  have = node_gpus(env)
  if not have:
    return None  # no GPU here: CPU processes (the tests) train on their CPU devices
  seen, tasks, rank = visible_gpus(env), launch.processes_on_node, launch.local_rank
  per_task = gpus_per_task(env) or (seen // tasks if seen >= tasks else seen)
  if per_task and seen == per_task:
    ids = list(range(seen))  # the launcher bound this task's own GPUs (or it is alone)
  elif per_task and seen == per_task * tasks:
    ids = list(range(rank * per_task, (rank + 1) * per_task))  # its share of the node's
  else:
    raise errors.ConfigError(
        f'{launch.source}: {tasks} processes on this node each see {seen} GPUs, which do '
        'not split evenly between them; launch one process per GPU (srun '
        f'--ntasks-per-node={have} --gpus-per-task=1) or one per node (srun '
        f'--ntasks-per-node=1 --gpus-per-node={have}).')
  used = len(ids) * tasks
  if used < have:
    raise errors.ConfigError(
        f'{launch.source}: this node has {have} GPUs but its {tasks} process'
        f'{"es" * (tasks > 1)} would train on {used} ({len(ids)} each), leaving '
        f'{have - used} idle; launch one process per GPU (srun --ntasks-per-node={have} '
        f'--gpus-per-task=1; torchrun --nproc-per-node={have}) or one per node with every '
        f'GPU (srun --ntasks-per-node=1 --gpus-per-node={have}).')
  return ids
