"""XLA flags, NCCL settings and JAX's memory fraction for NVIDIA GPUs, set before a backend starts.

XLA reads XLA_FLAGS, and JAX's GPU client reads XLA_PYTHON_CLIENT_MEM_FRACTION, once,
when the first backend starts; `apply()` sets them first (train.py calls it before
anything touches a device). Every setting already in the environment wins: a user's
own XLA_FLAGS entry for a flag, or their own memory fraction, is never overridden.

The flags are the ones MaxText's GPU recipes and NVIDIA's JAX-Toolbox set for LLM
training (sources beside each). On one GPU most of them do nothing (they tune
collectives); the device check (bench/device_check.py, section 'flags') times the
step with each one off in turn, and with all of them off. Until that has run on a
GPU they are **unmeasured**: `DEFAULT_ON` keeps on only the two that change a
single GPU's step and that both upstreams set (the latency-hiding scheduler and
cuBLAS instead of Triton for GEMMs); the rest are listed, measured by the check,
and off (docs/results/gpu_h200.md, "XLA flags").

XLA aborts the process on a flag its version does not know ('Unknown flag in
XLA_FLAGS'), and flags come and go between versions (`--xla_gpu_graph_level` and
`--xla_gpu_enable_triton_softmax_fusion` are gone by jaxlib 0.10.2). `known()` asks
the installed jaxlib in a child process which of ours it accepts: every XLA flag is
parsed by the same code whatever the backend, so a CPU child answers for the GPU's
flags too; only their effect needs a GPU.

kernels/ imports nothing of the project outside itself.
"""

import importlib.util
import os
import re
import subprocess
import sys
from typing import NamedTuple


class Flag(NamedTuple):
  setting: str  # '--name=value'
  why: str
  source: str

  @property
  def name(self) -> str:
    return self.setting.split('=', 1)[0]


MAXTEXT = 'MaxText end_to_end/gpu/a3/test_llama2_7b.sh (Llama 2 7B on 8 x H100)'
TOOLBOX = 'NVIDIA JAX-Toolbox rosetta/docs/GPU_performance.md'

XLA_GPU_FLAGS = (
    Flag('--xla_gpu_enable_latency_hiding_scheduler=true',
         'schedules async work (collectives, copies) to overlap compute', f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_triton_gemm=false',
         "matmuls go to cuBLAS/cuBLASLt, not XLA's Triton GEMM emitter", f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_command_buffer=',
         'no CUDA graphs (MaxText\'s older --xla_gpu_graph_level=0): fewer surprises with '
         'custom calls such as cuDNN attention', MAXTEXT),
    Flag('--xla_gpu_enable_highest_priority_async_stream=true',
         'collectives on the highest-priority stream, so they are not starved by compute',
         f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_all_reduce_combine_threshold_bytes=134217728',
         'combines small all-reduces into 128 MiB ones (fewer NCCL launches)', MAXTEXT),
    Flag('--xla_gpu_all_gather_combine_threshold_bytes=134217728',
         "combines FSDP's per-weight all-gathers into 128 MiB ones", MAXTEXT),
    Flag('--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864',
         "combines FSDP's gradient reduce-scatters into 64 MiB ones", MAXTEXT),
    Flag('--xla_gpu_enable_pipelined_all_gather=true',
         "issues the next layer's all-gather inside the current layer's loop iteration",
         f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_pipelined_reduce_scatter=true',
         "overlaps a layer's gradient reduce-scatter with the next layer's backward",
         f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_pipelined_all_reduce=true',
         'the same pipelining for all-reduces (data parallelism)', f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_while_loop_double_buffering=true',
         "double-buffers the scanned layers' loop so the pipelined collectives have room",
         f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_all_gather_combine_by_dim=false',
         'lets all-gathers of different dimensions combine', f'{MAXTEXT}; {TOOLBOX}'),
    Flag('--xla_gpu_enable_reduce_scatter_combine_by_dim=false',
         'lets reduce-scatters of different dimensions combine', f'{MAXTEXT}; {TOOLBOX}'),
)

# On until the device check says otherwise: both upstreams set them, and on one GPU they
# are the two that change the step's own kernels and their order.
DEFAULT_ON = ('--xla_gpu_enable_latency_hiding_scheduler', '--xla_gpu_enable_triton_gemm')

# NCCL, multi-GPU only (a single GPU runs no collective, so the check cannot time them):
# set only where the user has not, and only where a pod recipe needs them.
NCCL_ENV = {
    # NVLink SHARP needs the fabric manager's multicast objects; containers without them
    # fail NCCL's init with CUDA error 401/802 (the NCCL warning names this variable).
    'NCCL_NVLS_ENABLE': ('0', 'NVLS off: NCCL init fails in containers without multicast '
                         'support; NVLink P2P remains', 'NCCL docs; NCCL init warning text'),
}

JAX_DEFAULT_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION when unset (JAX's GPU docs)
# What train.py gives JAX's allocator on a GPU: JAX-Toolbox "typically 0.9 or 0.8"; 0.9
# leaves 10% (14 GB of an H200) to cuDNN/cuBLAS workspaces, NCCL and the CUDA context.
TRAINER_MEM_FRACTION = 0.9
MEM_FRACTION_ENV = 'XLA_PYTHON_CLIENT_MEM_FRACTION'


def memory_fraction(environ: dict | None = None) -> float:
  """The share of a GPU's memory JAX's allocator takes in a process with `environ`."""
  env = os.environ if environ is None else environ
  try:
    return float(env.get(MEM_FRACTION_ENV, JAX_DEFAULT_MEM_FRACTION))
  except ValueError:
    return JAX_DEFAULT_MEM_FRACTION


def trainer_memory_fraction(environ: dict | None = None) -> float:
  """The share train.py's process gets on a GPU host: the variable where set, else
  TRAINER_MEM_FRACTION (which `apply` sets)."""
  env = os.environ if environ is None else environ
  return memory_fraction(env) if MEM_FRACTION_ENV in env else TRAINER_MEM_FRACTION


def default_flags() -> tuple[Flag, ...]:
  return tuple(f for f in XLA_GPU_FLAGS if f.name in DEFAULT_ON)


def merge(current: str, flags: tuple[str, ...] | list[str]) -> str:
  """`current` XLA_FLAGS plus those of `flags` whose name it does not set already."""
  present = {token.split('=', 1)[0] for token in current.split()}
  added = [f for f in flags if f.split('=', 1)[0] not in present]
  return ' '.join([current.strip(), *added]).strip()


def without(current: str, names: tuple[str, ...] | list[str]) -> str:
  """`current` XLA_FLAGS less every flag named in `names`."""
  return ' '.join(t for t in current.split() if t.split('=', 1)[0] not in names)


def known(settings: list[str], python: str = sys.executable, timeout: float = 120.0) -> list[str]:
  """The settings the installed jaxlib accepts (a CPU backend started with them in a child).

  XLA names the unknown ones in its abort message; they are dropped and the rest tried
  again, so one call costs one child (~1 s) when every flag is known.
  """
  left = list(settings)
  for _ in range(len(settings) + 1):
    if not left:
      return left
    env = dict(os.environ, XLA_FLAGS=' '.join(left), JAX_PLATFORMS='cpu')
    env.pop(MEM_FRACTION_ENV, None)
    proc = subprocess.run([python, '-c', "import jax; jax.devices('cpu')"], env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 0:
      return left
    match = re.search(r'Unknown flags? in XLA_FLAGS:(.*)', proc.stderr)
    if not match:
      raise RuntimeError(f'a JAX child with XLA_FLAGS={" ".join(left)!r} failed: '
                         f'{proc.stderr[-500:]}')
    unknown = set(re.findall(r'--[A-Za-z0-9_]+', match.group(1)))
    kept = [s for s in left if s.split('=', 1)[0] not in unknown]
    if len(kept) == len(left):
      raise RuntimeError(f'XLA refused flags not among ours: {sorted(unknown)}')
    left = kept
  return left


def has_gpu() -> bool:
  """Whether this host can start JAX's CUDA backend (its plugin and an NVIDIA device),
  decided without starting a backend."""
  return os.path.exists('/dev/nvidiactl') and any(
      _installed(p) for p in ('jax_cuda12_plugin', 'jax_cuda13_plugin',
                              'jax_plugins.xla_cuda12', 'jax_plugins.xla_cuda13'))


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # a dotted name whose parent package is absent
    return False


def apply(environ: dict | None = None, *, gpu: bool | None = None, probe: bool = True
          ) -> dict[str, str]:
  """On a GPU host, sets DEFAULT_ON's flags (those this jaxlib knows), NCCL_ENV and the
  trainer's memory fraction in `environ` (default os.environ) where unset; returns what it
  set. A no-op elsewhere, and where the platform is pinned to something else."""
  env = os.environ if environ is None else environ
  platforms = env.get('JAX_PLATFORMS', '')
  if gpu is None:
    gpu = has_gpu() and (not platforms or 'cuda' in platforms or 'gpu' in platforms)
  if not gpu:
    return {}
  wanted = [f.setting for f in default_flags()]
  current = env.get('XLA_FLAGS', '')
  present = {token.split('=', 1)[0] for token in current.split()}
  missing = [s for s in wanted if s.split('=', 1)[0] not in present]
  if probe and missing:
    missing = known(missing)
  changed = {}
  merged = merge(current, missing)
  if merged != current.strip():
    env['XLA_FLAGS'] = changed['XLA_FLAGS'] = merged
  for key, (value, _, _) in NCCL_ENV.items():
    if key not in env:
      env[key] = changed[key] = value
  if MEM_FRACTION_ENV not in env:
    env[MEM_FRACTION_ENV] = changed[MEM_FRACTION_ENV] = str(TRAINER_MEM_FRACTION)
  return changed
