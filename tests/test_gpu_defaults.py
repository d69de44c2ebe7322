"""GPU defaults without a GPU: the MFU peak table, the XLA GPU flags, the `cuda` extra.

The peaks are checked against the device_kind strings CUDA/JAX report for each SKU
and NVIDIA's datasheet figures (dense = the printed sparse figure / 2); the flags
against the installed jaxlib, which aborts on a flag it does not know.
"""

import importlib.metadata
import pathlib
import re
import tomllib

import pytest

from kernels import gpu_flags
from monitor import metrics

REPO = pathlib.Path(__file__).resolve().parents[1]

# device_kind as CUDA names each device (cudaDeviceProp.name), and the datasheet's
# dense bf16 TFLOP/s: the sparse figure NVIDIA prints, halved.
KINDS = {
    'NVIDIA H100 80GB HBM3': 1979 / 2,  # SXM5
    'NVIDIA H100 PCIe': 1513 / 2,
    'NVIDIA H100 NVL': 1671 / 2,
    'NVIDIA H200': 1979 / 2,  # SXM
    'NVIDIA H200 NVL': 1671 / 2,
    'NVIDIA GH200 480GB': 1979 / 2,
    'NVIDIA GH200 144G HBM3e': 1979 / 2,
    'NVIDIA B200': 4500 / 2,
    'NVIDIA A100-SXM4-80GB': 312,  # the A100 datasheet prints dense 312 beside sparse 624
    'NVIDIA A100-SXM4-40GB': 312,
    'NVIDIA A100-PCIE-40GB': 312,
    'NVIDIA A100 80GB PCIe': 312,
}


@pytest.mark.parametrize('kind', sorted(KINDS))
def test_each_gpu_family_gets_its_datasheet_peak(kind):
  peak, _ = metrics.device_peak(kind)
  assert peak == pytest.approx(KINDS[kind] * 1e12, rel=0.002), kind


@pytest.mark.parametrize('kind', ['NVIDIA H100', 'NVIDIA H800', 'NVIDIA L40S', 'NVIDIA H20',
                                  'Tesla V100-SXM2-16GB', 'NVIDIA RTX 6000 Ada Generation',
                                  'cpu'])
def test_a_device_it_does_not_know_has_no_peak(kind):
  """Never a wrong MFU: an H100 naming no form factor (SXM 989 vs PCIe 756) or an
  H20 (a 148 TFLOP/s part whose name is a prefix of H200's) gets none."""
  assert metrics.device_peak(kind) is None


def test_tpu_kinds_keep_their_peaks():
  assert metrics.device_peak('TPU v5 lite') == (197e12, 'TPU v5 lite')
  assert metrics.device_peak('TPU v6 lite')[0] == 918e12


def test_flags_merge_without_overriding_the_users_own():
  user = '--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/d'
  merged = gpu_flags.merge(user, [f.setting for f in gpu_flags.default_flags()])
  assert merged.split() == [*user.split(), '--xla_gpu_enable_latency_hiding_scheduler=true']
  assert gpu_flags.without(merged, ['--xla_dump_to']).split() == [
      '--xla_gpu_enable_triton_gemm=true', '--xla_gpu_enable_latency_hiding_scheduler=true']


def test_apply_sets_flags_nccl_and_memory_fraction_only_where_unset():
  env = {'XLA_FLAGS': '--xla_gpu_enable_triton_gemm=true', 'NCCL_NVLS_ENABLE': '1'}
  changed = gpu_flags.apply(env, gpu=True, probe=False)
  assert env['XLA_FLAGS'] == ('--xla_gpu_enable_triton_gemm=true '
                              '--xla_gpu_enable_latency_hiding_scheduler=true')
  assert env['NCCL_NVLS_ENABLE'] == '1' and 'NCCL_NVLS_ENABLE' not in changed
  assert env[gpu_flags.MEM_FRACTION_ENV] == '0.9' and gpu_flags.memory_fraction(env) == 0.9
  mine = {gpu_flags.MEM_FRACTION_ENV: '0.6'}
  gpu_flags.apply(mine, gpu=True, probe=False)
  assert gpu_flags.memory_fraction(mine) == 0.6
  assert gpu_flags.memory_fraction({}) == 0.75  # JAX's own default
  assert gpu_flags.apply({}, gpu=False) == {}


def test_every_listed_flag_exists_in_this_jaxlib_and_an_unknown_one_is_dropped():
  """XLA aborts on an unknown flag; `known` asks a child and drops what it names."""
  settings = [f.setting for f in gpu_flags.XLA_GPU_FLAGS]
  bogus = ['--xla_gpu_graph_level=0', '--xla_no_such_flag_at_all=1']  # gone / never was
  assert gpu_flags.known(settings[:3] + bogus + settings[3:]) == settings
  assert all(f.why and f.source for f in gpu_flags.XLA_GPU_FLAGS)
  assert set(gpu_flags.DEFAULT_ON) <= {f.name for f in gpu_flags.XLA_GPU_FLAGS}


def test_the_cuda_extras_pin_jaxs_own_extras_at_the_projects_jax():
  project = tomllib.loads((REPO / 'pyproject.toml').read_text())['project']
  pin = next(d for d in project['dependencies'] if d.startswith('jax=='))
  version = pin.split('==')[1]
  jax_extras = importlib.metadata.metadata('jax').get_all('Provides-Extra')
  extras = project['optional-dependencies']
  for name in ('cuda', 'cuda13'):
    (req,) = extras[name]
    extra, at = re.fullmatch(r'jax\[(\w+)\]==(\S+)', req).groups()
    assert at == version == importlib.metadata.version('jax') and extra in jax_extras
  assert extras['cuda'] == [f'jax[cuda12]=={version}']
