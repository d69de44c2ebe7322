"""A GPU cluster's path, on this CPU machine: launchers, the HSDP mesh, its plan, the sbatch.

- hosts/launchers.py read against SLURM's and torchrun's documented variables: every
  GPU of a node trained on, whichever process model the launcher gives; a node that
  would leave GPUs idle refused in one line.
- The HSDP mesh placed on stand-in GPU devices (nodes as XLA numbers them, a
  `slice_index` per host): every shard group inside one node, the replicas across.
- Checkpoints restore across the HSDP and FSDP layouts bit for bit (the arrays
  saved, kept on the host, are the reference).
- plan.py's 7B on 64 nodes of 8 H100s fits, and its per-step bytes equal a float64
  formula written here from the parameter shapes.
- deploy/slurm-olmo3-7b.sbatch: its requeue rule against errors.py, with a fake
  `srun`/`scontrol` on PATH; then its srun line in miniature (2 nodes x 4 CPU
  devices) and a torchrun-style start, both bit-equal to the explicit flags' run.
"""

import dataclasses
import os
import pathlib
import re
import signal
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest

import checkpoint
import errors
from hosts import launchers
import model
import optim
import sharding
import train
from configs import small
from servers import free_port
from test_multihost import (RETRIED_STARTS, assert_bitwise_equal, communicate_all,
                            final_params, metrics, train_args, trainer_env)

REPO = pathlib.Path(__file__).resolve().parents[1]
SBATCH = REPO / 'deploy' / 'slurm-olmo3-7b.sbatch'
H100_GB = 80  # NVIDIA H100 SXM spec sheet
JAX_DEFAULT_FRACTION = 0.75  # JAX's GPU memory docs: XLA_PYTHON_CLIENT_MEM_FRACTION default


# --- Launchers ---------------------------------------------------------------------------

def slurm_env(nodes: int, per_node: int, rank: int, **extra: str) -> dict[str, str]:
  """What srun sets for task `rank` (SLURM's srun man page, OUTPUT ENVIRONMENT VARIABLES)."""
  return {'SLURM_JOB_ID': '4242', 'SLURM_NTASKS': str(nodes * per_node),
          'SLURM_PROCID': str(rank), 'SLURM_LOCALID': str(rank % per_node),
          'SLURM_NODEID': str(rank // per_node), 'SLURM_STEP_NUM_NODES': str(nodes),
          'SLURM_STEP_TASKS_PER_NODE': f'{per_node}(x{nodes})',
          'SLURM_STEP_NODELIST': 'gpu[001-064]', **extra}


def test_slurm_one_task_per_node_trains_on_all_eight_gpus():
  """JAX's own SLURM detection gives a task the one GPU numbered SLURM_LOCALID: 1 of 8."""
  env = slurm_env(64, 1, 5, SLURM_GPUS_ON_NODE='8')
  launch = launchers.detect(env)
  assert (launch.source, launch.num_processes, launch.process_id) == ('SLURM', 64, 5)
  assert launch.describe() == 'SLURM: 64 nodes x 1 processes'
  assert launchers.local_device_ids(launch, env) == list(range(8))


@pytest.mark.parametrize('bound', [False, True])
def test_slurm_one_task_per_gpu_takes_its_own(bound):
  """Unbound, each task sees the node's 8 and takes the one of its local rank; bound by
  --gpus-per-task=1, SLURM's CUDA_VISIBLE_DEVICES shows it one, its ordinal 0."""
  extra = ({'CUDA_VISIBLE_DEVICES': '3', 'SLURM_GPUS_PER_TASK': '1'} if bound else
           {'CUDA_VISIBLE_DEVICES': '0,1,2,3,4,5,6,7'})
  env = slurm_env(2, 8, 11, SLURM_GPUS_ON_NODE='8', **extra)
  launch = launchers.detect(env)
  assert (launch.local_rank, launch.processes_on_node, launch.nodes) == (3, 8, 2)
  assert launchers.local_device_ids(launch, env) == ([0] if bound else [3])


def test_four_tasks_seeing_eight_gpus_take_two_each():
  env = slurm_env(2, 4, 6, SLURM_GPUS_ON_NODE='8', CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7')
  assert launchers.local_device_ids(launchers.detect(env), env) == [4, 5]


@pytest.mark.parametrize('per_node, visible', [(2, '0'), (4, '5'), (3, '0,1,2,3,4,5,6,7')])
def test_a_node_that_would_idle_gpus_is_one_line_naming_the_fix(per_node, visible):
  """Two or four tasks bound to a GPU each on a node of 8; three that cannot split 8."""
  env = slurm_env(2, per_node, 0, SLURM_GPUS_ON_NODE='8', CUDA_VISIBLE_DEVICES=visible,
                  **({'SLURM_GPUS_PER_TASK': 'h100:1'} if per_node == 4 else {}))
  with pytest.raises(errors.ConfigError, match=r'--ntasks-per-node=8 --gpus-per-task=1') as e:
    launchers.local_device_ids(launchers.detect(env), env)
  assert e.value.exit_code == errors.EXIT_USAGE and '\n' not in str(e.value)


def test_torchrun_under_a_users_cuda_visible_devices_trains_on_those():
  """Outside SLURM the GPUs CUDA_VISIBLE_DEVICES hides are not the job's: no refusal."""
  env = {'MASTER_ADDR': '10.0.0.1', 'MASTER_PORT': '29500', 'WORLD_SIZE': '4', 'RANK': '2',
         'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1', 'CUDA_VISIBLE_DEVICES': '4,5,6,7'}
  assert launchers.local_device_ids(launchers.detect(env), env) == [0, 1, 2, 3]
  two = {**env, 'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '2'}
  assert launchers.local_device_ids(launchers.detect(two), two) == [2, 3]


def test_slurm_task_lists_expand_as_slurm_writes_them():
  assert [launchers.slurm_tasks_on_node('8(x2),4', n) for n in range(3)] == [8, 8, 4]


def test_torchrun_variables_and_flags_winning():
  env = {'MASTER_ADDR': '10.0.0.1', 'MASTER_PORT': '29500', 'WORLD_SIZE': '16', 'RANK': '9',
         'LOCAL_RANK': '1', 'LOCAL_WORLD_SIZE': '8'}
  launch = launchers.detect(env)
  assert (launch.source, launch.coordinator_address, launch.process_id) == (
      'torchrun', '10.0.0.1:29500', 9)
  assert (launch.nodes, launch.processes_on_node, launch.local_rank) == (2, 8, 1)
  # torchrun's agent serves its store on MASTER_PORT: the coordinator takes the next one.
  assert launchers.detect({**env, 'TORCHELASTIC_RUN_ID': 'x'}).coordinator_address.endswith(
      ':29501')
  flags = launchers.detect({**env, **slurm_env(2, 1, 0)}, '127.0.0.1:1234', 1, 2)
  assert (flags.source, flags.process_id, flags.num_processes) == ('flags', 1, 2)
  assert launchers.local_device_ids(flags, env) is None  # JAX's default: every visible GPU
  with pytest.raises(errors.ConfigError, match='MASTER_ADDR'):
    launchers.detect({'WORLD_SIZE': '2', 'RANK': '0', 'MASTER_PORT': '1'})


# --- The HSDP mesh ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Gpu:
  """What the mesh reads of a GPU: XLA gives every host its own slice_index."""
  id: int
  process_index: int
  slice_index: int
  platform: str = 'gpu'
  device_kind: str = 'NVIDIA H100 80GB HBM3'


def hsdp_cfg(fsdp: int) -> 'ml_collections.ConfigDict':
  t = small.get_config().train
  t.mesh_layout, t.mesh_data, t.mesh_fsdp = 'hsdp', -1, fsdp
  return t


def groups_nodes(grid: np.ndarray, axis: int) -> list[set[int]]:
  moved = np.moveaxis(np.vectorize(lambda d: d.slice_index)(grid), axis, -1)
  return [set(g) for g in moved.reshape(-1, moved.shape[-1])]


@pytest.mark.parametrize('processes_per_node', [1, 8])
def test_hsdp_keeps_each_shard_group_in_a_node(processes_per_node):
  """4 nodes x 8 GPUs, one process per node or per GPU: fsdp=-1 is a node's 8."""
  gpus = [Gpu(i, i // (8 // processes_per_node), i // 8) for i in range(32)]
  shape = sharding.mesh_shape(hsdp_cfg(-1), 32, 'hsdp', 8)
  assert shape == {'data': 4, 'fsdp': 8, 'tensor': 1}
  grid = sharding.hsdp_devices(shape, gpus)
  assert all(len(g) == 1 for g in groups_nodes(grid, 1))  # a shard group: one node
  assert all(g == {0, 1, 2, 3} for g in groups_nodes(grid, 0))  # replicas: every node
  assert sorted(d.id for d in grid.flat) == list(range(32))


def test_hsdp_shard_groups_may_span_whole_nodes_or_part_of_one():
  gpus = [Gpu(i, i // 8, i // 8) for i in range(32)]
  grid = sharding.hsdp_devices(sharding.mesh_shape(hsdp_cfg(16), 32, 'hsdp', 8), gpus)
  assert groups_nodes(grid, 1) == [{0, 1}, {2, 3}]  # 16 shards: two whole nodes each
  grid = sharding.hsdp_devices(sharding.mesh_shape(hsdp_cfg(4), 32, 'hsdp', 8), gpus)
  assert grid.shape[:2] == (8, 4) and all(len(g) == 1 for g in groups_nodes(grid, 1))
  with pytest.raises(errors.ConfigError, match='divisor or a multiple of 8'):
    sharding.hsdp_devices(sharding.mesh_shape(hsdp_cfg(12), 48, 'hsdp', 8),
                          [Gpu(i, i // 8, i // 8) for i in range(48)])


def test_the_layout_field_is_checked_and_auto_means_hsdp_on_gpus_only():
  t = small.get_config().train
  assert t.mesh_layout == 'auto'
  assert [sharding.layout_for(t, p) for p in ('gpu', 'tpu', 'cpu')] == ['hsdp', 'fsdp', 'fsdp']
  t.mesh_layout = 'zero3'
  with pytest.raises(errors.ConfigError, match='train.mesh_layout'):
    sharding.layout_for(t, 'gpu')
  t.mesh_layout, t.mesh_data = 'hsdp', 2
  with pytest.raises(errors.ConfigError, match='mesh_data=-1'):
    sharding.check_hsdp_fields(t)


def tiny_cfg():
  cfg = small.get_config()
  m = cfg.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim = 4, 64, 2, 2, 32
  m.mlp_hidden, m.vocab_size, m.sliding_window = 128, 256, 16
  return cfg


def test_checkpoints_restore_across_hsdp_and_fsdp_bit_exact(tmp_path):
  """Save under HSDP (2 replicas x 2 shards of 4 devices), restore under plain FSDP over
  4, and back: the same bits as the arrays saved."""
  cfg = tiny_cfg()
  tx = optim.make_optimizer(cfg.opt)
  devices = jax.devices()[:4]
  hsdp = hsdp_cfg(2)
  flat = cfg.train.copy_and_resolve_references()
  flat.mesh_layout, flat.mesh_data, flat.mesh_fsdp = 'fsdp', 1, -1
  meshes = {'hsdp': sharding.make_mesh(hsdp, devices), 'fsdp': sharding.make_mesh(flat, devices)}
  assert dict(meshes['hsdp'].shape) == {'data': 2, 'fsdp': 2, 'tensor': 1}
  for saved_on, restored_on in (('hsdp', 'fsdp'), ('fsdp', 'hsdp')):
    state, _ = train.create_state(cfg, tx, meshes[saved_on], jax.random.key(7))
    saved = [np.asarray(x) for x in jax.tree.leaves(state)]
    directory = tmp_path / saved_on
    with checkpoint.Checkpointer(str(directory), fsync=False) as ckpt:
      ckpt.save(1, state, {'data': {}})
      ckpt.wait()
      restored, _ = ckpt.restore(train.abstract_state(cfg, tx, meshes[restored_on]))
    leaves = jax.tree.leaves(restored)
    assert len(leaves) == len(saved)
    for a, b in zip(leaves, saved):
      assert a.sharding.mesh.shape == meshes[restored_on].shape
      assert a.dtype == b.dtype and np.asarray(a).tobytes() == b.tobytes()


# --- The plan -----------------------------------------------------------------------------

# The model's weight matrices (docs/architecture.md): the embedding, attention and MLP
# projections, the output head. Norm scales, stacked per layer or not, stay whole.
WEIGHT_MATRICES = {'embedding', 'w_q', 'w_k', 'w_v', 'w_o', 'w_gate', 'w_up', 'w_down', 'w'}


def traffic_formula(cfg, replicas: int, shards: int) -> tuple[float, float]:
  """(within, across) bytes per device per step, float64: every matrix sharded `shards`
  ways inside a node (two gathers and a reduce-scatter) and its shard all-reduced over the
  replicas across nodes; norm scales replicated, all-reduced over every device."""
  shapes = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
  leaves = jax.tree_util.tree_flatten_with_path(shapes)[0]
  weight = lambda path: getattr(path[-1], 'key', None) in WEIGHT_MATRICES
  matrix = sum(np.prod(x.shape, dtype=np.float64) * 4 for p, x in leaves if weight(p))
  vector = sum(np.prod(x.shape, dtype=np.float64) * 4 for p, x in leaves if not weight(p))
  n = replicas * shards
  within = 3 * (shards - 1) / shards * matrix
  across = 2 * (replicas - 1) / replicas * matrix / shards + 2 * (n - 1) / n * vector
  return within, across


@pytest.mark.slow
def test_the_7b_hsdp_plan_fits_64_nodes_of_8_h100s_with_its_traffic():
  """Two compiles of the 7B on 4 and 8 simulated devices (~25 s on a quiet machine)."""
  import plan  # pylint: disable=g-import-not-at-top
  from configs import olmo3_7b  # pylint: disable=g-import-not-at-top
  cfg = olmo3_7b.get_config()
  p = plan.make_plan(cfg, 512, platform='gpu', devices=jax.devices()[:8])
  assert (p.layout, p.node_devices, p.target_mesh) == (
      'hsdp', 8, {'data': 64, 'fsdp': 8, 'tensor': 1})
  assert p.peak_bytes < JAX_DEFAULT_FRACTION * H100_GB * 1e9  # even at JAX's default share
  within, across = traffic_formula(cfg, 64, 8)
  assert p.traffic['within'] == pytest.approx(within, rel=1e-9)
  assert p.traffic['across'] == pytest.approx(across, rel=1e-9)
  text = plan.format_plan(cfg, p)
  assert re.search(r'traffic +76\.\d\d GB/device/step within a node, 7\.\d\d GB across', text)


def test_flat_fsdp_across_nodes_sends_everything_across():
  cfg = tiny_cfg()
  params = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
  shape = {'data': 1, 'fsdp': 16, 'tensor': 1}
  flat = sharding.step_traffic(params, shape, 'fsdp', 8, 1)
  assert flat['within'] == 0 and flat['across'] > 0
  hsdp = sharding.step_traffic(params, {'data': 2, 'fsdp': 8, 'tensor': 1}, 'hsdp', 8, 3)
  within, across = traffic_formula(cfg, 2, 8)
  assert hsdp['within'] == pytest.approx(3 * within) and hsdp['across'] == pytest.approx(
      3 * across)


# --- The sbatch script --------------------------------------------------------------------

FAKE_SRUN = '''#!{python}
"""srun in miniature: SLURM_JOB_NUM_NODES nodes x --ntasks-per-node tasks on this host."""
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith('--'):
  key, _, value = args.pop(0)[2:].partition('=')
  opts[key] = value
with open(os.environ['FAKE_LOG'], 'a') as f:
  f.write('srun ' + ' '.join(sys.argv[1:]) + '\\n')
if os.environ.get('FAKE_SRUN_RC'):
  sys.exit(int(os.environ['FAKE_SRUN_RC']))
nodes, per = int(os.environ['SLURM_JOB_NUM_NODES']), int(opts.get('ntasks-per-node', 1))
procs = []
for rank in range(nodes * per):
  env = dict(os.environ, SLURM_NTASKS=str(nodes * per), SLURM_PROCID=str(rank),
             SLURM_LOCALID=str(rank % per), SLURM_NODEID=str(rank // per),
             SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_TASKS_PER_NODE=f'{{per}}(x{{nodes}})',
             SLURM_STEP_NODELIST='localhost')
  out = open(os.path.join(os.environ['FAKE_OUT'], f'task{{rank}}'), 'w')
  procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT))
sys.exit(max(p.wait() for p in procs))
'''
FAKE_SCONTROL = '#!/bin/sh\necho "scontrol $*" >> "$FAKE_LOG"\n'


def fake_slurm(tmp_path) -> dict[str, str]:
  """A bin folder with srun and scontrol stand-ins, and the environment sbatch gives."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir(exist_ok=True)
  for name, text in (('srun', FAKE_SRUN.format(python=sys.executable)),
                     ('scontrol', FAKE_SCONTROL)):
    (bin_dir / name).write_text(text)
    (bin_dir / name).chmod(stat.S_IRWXU)
  (tmp_path / 'out').mkdir(exist_ok=True)
  return {'PATH': f'{bin_dir}:{os.environ["PATH"]}', 'FAKE_LOG': str(tmp_path / 'log'),
          'FAKE_OUT': str(tmp_path / 'out'), 'SLURM_JOB_ID': '4242',
          'SLURM_JOB_NUM_NODES': '2', 'SLURM_SUBMIT_DIR': str(REPO),
          'WORKDIR': str(tmp_path / 'run'), 'MIX': str(REPO / 'data' / 'shakespeare-train.txt'),
          'PYTHON': sys.executable}


def run_sbatch(tmp_path, env_extra: dict[str, str], timeout: float = 60):
  env = dict(os.environ, **fake_slurm(tmp_path), **env_extra)
  return subprocess.run(['bash', str(SBATCH)], env=env, capture_output=True, text=True,
                        timeout=timeout, cwd=tmp_path)


def requeue_rule(code: int) -> bool:
  """errors.py's: a crash or a preemption restarts, and so does death by a signal."""
  return code in errors.RESTARTABLE or code > 128


@pytest.mark.parametrize('code', [0, 1, 2, 3, 4, 5, 137, 143])
def test_the_sbatch_requeues_exactly_what_errors_py_restarts(tmp_path, code):
  proc = run_sbatch(tmp_path, {'FAKE_SRUN_RC': str(code)})
  assert proc.returncode == code, proc.stdout + proc.stderr
  log = (tmp_path / 'log').read_text()
  assert ('scontrol requeue 4242' in log) == requeue_rule(code), log
  if code in (errors.EXIT_USAGE, errors.EXIT_DIVERGED, errors.EXIT_DATA):
    assert 'scontrol' not in log


def test_the_sbatch_stops_requeueing_at_its_bound(tmp_path):
  proc = run_sbatch(tmp_path, {'FAKE_SRUN_RC': '1', 'SLURM_RESTART_COUNT': '20'})
  assert proc.returncode == 1 and 'not requeued' in proc.stdout
  assert 'scontrol' not in (tmp_path / 'log').read_text()


def test_the_sbatch_signal_is_one_the_trainer_checkpoints_on():
  """--signal=TERM@N (no B:, so it reaches the trainer, not only the batch shell)."""
  text = SBATCH.read_text()
  m = re.search(r'^#SBATCH --signal=(\w+)@(\d+)$', text, re.M)
  assert m and int(m.group(2)) >= 60
  from monitor import health  # pylint: disable=g-import-not-at-top
  before = signal.getsignal(signal.SIGTERM)
  stop = health.Preemption()
  try:
    assert signal.getsignal(getattr(signal, f'SIG{m.group(1)}')) not in (before, signal.SIG_DFL)
  finally:
    stop.close()
  assert '#SBATCH --requeue' in text and re.search(r'^#SBATCH --gpus-per-node=8$', text, re.M)


# --- Real runs: SLURM and torchrun-style, bit-equal to the flags' -------------------------

STEPS = 2
DEVICES = 4  # per process: 2 processes are 2 nodes x 4 devices


def run_procs(make, timeout: float = 400) -> list[str]:
  """Starts the processes `make()` returns and their outputs; one retry on a gloo or port
  start-up failure (a loaded 2-core machine: tests/test_multihost.py)."""
  for attempt in range(2):
    procs = make()
    outs = [(o or '') + (e or '') for o, e in communicate_all(procs, timeout)]
    if attempt == 0 and any(m in out for out in outs for m in RETRIED_STARTS):
      continue
    for p, out in zip(procs, outs):
      assert p.returncode == 0, out[-4000:]
    return outs


@pytest.fixture(scope='module')
def flags_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('flags') / 'run'
  port = free_port

  def make():
    p = port()
    return [subprocess.Popen(
        train_args(workdir, STEPS, STEPS, f'--coordinator_address=127.0.0.1:{p}',
                   f'--process_id={i}', '--num_processes=2'),
        cwd=REPO, env=trainer_env(DEVICES), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for i in range(2)]
  outs = run_procs(make)
  return workdir, outs


def assert_same_run(workdir, outs, reference, source: str) -> None:
  ref_dir, _ = reference
  for i, out in enumerate(outs):
    assert re.search(rf'Process {i} of 2 \({re.escape(source)}\), {DEVICES} cpu devices per '
                     r'process, 8 devices in all', out), out[-3000:]
    assert re.search(r'on 8 devices \(mesh', out), out[-3000:]  # every device trains
  mine, theirs = metrics(workdir), metrics(ref_dir)
  assert sorted(mine) == list(range(1, STEPS + 1))
  assert [mine[s]['train/CE loss'] for s in mine] == [theirs[s]['train/CE loss'] for s in mine]
  assert_bitwise_equal(final_params(workdir), final_params(ref_dir))


@pytest.mark.slow
def test_the_sbatch_srun_line_in_miniature_matches_the_flags_run(tmp_path, flags_run):
  """deploy/slurm-olmo3-7b.sbatch under a fake srun: 2 nodes x 1 task x 4 CPU devices."""
  extra = {'CONFIG': 'configs/small.py', 'XLA_FLAGS': trainer_env(DEVICES)['XLA_FLAGS'],
           'JAX_PLATFORMS': 'cpu',
           'EXTRA_ARGS': ' '.join(train_args('W', STEPS, STEPS)[3:-1])}
  for attempt in range(2):
    extra['JAX_COORDINATOR_PORT'] = str(free_port())
    proc = run_sbatch(tmp_path, extra, timeout=400)
    outs = [(tmp_path / 'out' / f'task{i}').read_text() for i in range(2)]
    if attempt == 0 and any(m in out for out in outs for m in RETRIED_STARTS):
      continue
    break
  assert proc.returncode == 0, proc.stdout + proc.stderr + outs[0][-3000:]
  assert 'scontrol' not in (tmp_path / 'log').read_text()
  assert_same_run(tmp_path / 'run', outs, flags_run, 'SLURM: 2 nodes x 1 processes')


@pytest.mark.slow
def test_torchrun_variables_match_the_flags_run(tmp_path, flags_run):
  workdir = tmp_path / 'run'

  def make():
    env = dict(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()), WORLD_SIZE='2',
               LOCAL_RANK='0', LOCAL_WORLD_SIZE='1')
    return [subprocess.Popen(train_args(workdir, STEPS, STEPS), cwd=REPO,
                             env=trainer_env(DEVICES, **env, RANK=str(i)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
  assert_same_run(workdir, run_procs(make), flags_run, 'torchrun: 2 nodes x 1 processes')
