"""The GPU flash-attention kernel (kernels/flash_gpu.py) on a CPU, and the GPU choice.

Numerics run the Triton kernels in Pallas' interpreter against
model.reference_attention (float32, full-precision matmuls) and the float64
oracle of tests/attention_oracle.py, with relative bounds: the kernel in
float32 measures ~1e-6, a window off by one 4e-2 or more. The cases are
kernels.flash_gpu.check_cases(), which bench/device_check.py runs on a GPU.
CUDA lowering (Triton IR, no PTX) runs without a GPU.
"""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle
import kernels
import model
from kernels import context_parallel
from kernels import flash_gpu
from kernels import xla

REPO = pathlib.Path(__file__).resolve().parents[1]
F32_BOUND = 1e-4  # max |err| / max |ref|: measured <= 1e-6 in float32
BF16_BOUND = 3e-2  # bf16 inputs, probabilities cast to bf16 for the P V product


@pytest.mark.parametrize('name,case', flash_gpu.check_cases(), ids=lambda x: x
                         if isinstance(x, str) else '')
def test_case_matches_reference(name, case):
  errors = flash_gpu.case_errors(case, model.reference_attention, interpret=True)
  assert max(errors.values()) < F32_BOUND, (name, errors)


def test_bf16_inputs_within_bf16_bound():
  case = dict(flash_gpu.check_cases())['window_block_plus_1_segments']
  errors = flash_gpu.case_errors(case, model.reference_attention, dtype=jnp.bfloat16,
                                 interpret=True)
  assert max(errors.values()) < BF16_BOUND, errors


def test_self_attention_matches_float64_oracle():
  """Independent of case_errors: output and grads against tests/attention_oracle.py."""
  b, t, h, g, k, window = 2, 112, 4, 2, 64, 37
  rng = np.random.default_rng(3)
  q, dout = (rng.standard_normal((b, t, h, k), np.float32) for _ in range(2))
  kk, v = (rng.standard_normal((b, t, g, k), np.float32) for _ in range(2))
  seg = np.cumsum(rng.random((b, t)) < 0.05, axis=1).astype(np.int32)

  def loss(q, kk, v):
    o = flash_gpu.flash_attention_gpu(q, kk, v, window=window, segment_ids_BT=jnp.asarray(seg),
                                      interpret=True)
    return jnp.sum(o * dout), o
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, kk, v)
  want_out, want_grads = attention_oracle.attention_np(q, kk, v, dout, window, seg)
  for got, want in zip((out, *grads), (want_out, *want_grads)):
    assert np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)) < F32_BOUND


def test_residuals_are_named_for_remat():
  """Output and log-sum-exp carry the names a remat policy saves (as the TPU kernel's)."""
  q, k, v, do, _, _, _ = flash_gpu.case_inputs(dict(flash_gpu.check_cases())['window_block'])
  ops = kernels.select(_cfg(attention_impl='pallas_gpu'), segments=False)

  def loss(q, k, v):
    o = ops.attention(q, k, v, window=32, segment_ids_BT=None, names=('my_out', 'my_lse'))
    return jnp.sum(o * do)
  text = str(jax.make_jaxpr(jax.grad(loss))(q, k, v))
  assert 'name=my_out' in text and 'name=my_lse' in text


def test_context_parallel_runs_the_gpu_kernel():
  """select under a 'context' mesh: each device's zig-zag chunks through the GPU kernel."""
  cfg = _cfg(attention_impl='pallas_gpu')
  b, t, h, g, k, window, cp = 2, 128, 4, 2, 64, 40, 2
  rng = np.random.default_rng(5)
  q = rng.standard_normal((b, t, h, k), np.float32)
  kk, v = (rng.standard_normal((b, t, g, k), np.float32) for _ in range(2))
  seg = np.cumsum(rng.random((b, t)) < 0.04, axis=1).astype(np.int32)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:cp]).reshape(1, cp), ('data', 'context'))

  def run(q, kk, v, seg):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      ops = kernels.select(cfg, segments=True)
      lay = lambda x: context_parallel.to_layout(x, cp)
      o = ops.attention(lay(q), lay(kk), lay(v), window=window, segment_ids_BT=lay(seg))
    return context_parallel.from_layout(o, cp)
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  out = jax.jit(run)(*(jax.device_put(x, on_mesh) for x in (q, kk, v, seg)))
  want = model.reference_attention(q, kk, v, window=window, segment_ids_BT=seg)
  assert np.max(np.abs(out - want)) / np.max(np.abs(want)) < F32_BOUND


# --- The choice (kernels.resolve) -------------------------------------------------------


def _cfg(**overrides):
  from configs import olmo3_7b  # pylint: disable=g-import-not-at-top
  cfg = olmo3_7b.model_config()
  cfg.update(overrides)
  return cfg


@pytest.mark.parametrize('overrides,segments,split,want', [
    ({}, False, False, 'cudnn'),  # stages 1-2
    (dict(head_dim=256, num_heads=16, num_kv_heads=16), False, False, 'cudnn'),  # Hopper assumed
    ({}, True, False, 'pallas_gpu'),  # document masking
    ({}, False, True, 'pallas_gpu'),  # context parallelism
    (dict(dtype='float32'), False, False, 'pallas_gpu'),
    (dict(head_dim=96), True, False, 'xla'),  # neither flash kernel takes it
])
def test_auto_on_gpu(overrides, segments, split, want):
  impl, why = kernels.resolve(_cfg(**overrides), 'gpu', segments=segments,
                              context_parallel=split)
  assert impl == want and why.startswith('auto on GPU')


def test_cudnn_head_dim_rule_without_a_gpu_says_it_assumes_hopper():
  limit, why = kernels.cudnn_max_head_dim()
  assert limit == 256 and 'Hopper' in why


def test_explicit_cudnn_with_segments_names_the_gpu_kernel():
  with pytest.raises(NotImplementedError, match="'pallas_gpu'"):
    kernels.select(_cfg(attention_impl='cudnn'), segments=True)


# --- CUDA lowering without a GPU --------------------------------------------------------


@pytest.mark.parametrize('head_dim,window,segments', [(64, None, False), (128, 300, True),
                                                     (256, 300, False)])
def test_gpu_kernel_lowers_for_cuda(head_dim, window, segments):
  """Forward and backward lower to Triton (block shapes, power-of-two tiles, the Hopper
  table) for CUDA on this CPU host; PTX is compiled by XLA on a GPU only."""
  b, s, h, g = 1, 1024, 8, 2
  q = jax.ShapeDtypeStruct((b, s // 2, h, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((b, s, g, head_dim), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((b, s), jnp.int32)
  starts = ((0, 768), (256, 512))

  def loss(q, k, v, seg, row):
    o = flash_gpu.flash_attention_gpu(q, k, v, window=window,
                                      segment_ids_BT=seg if segments else None,
                                      q_chunk_starts=starts, q_chunk_row=row)
    return jnp.sum(o.astype(jnp.float32))
  lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
      q, kv, kv, seg, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=('cuda',))
  assert lowered.as_text().count('triton') >= 3  # forward, dq, dk/dv


def test_cudnn_path_lowers_for_cuda_where_jaxlib_has_cudnn():
  q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
  ops = kernels.select(_cfg(attention_impl='cudnn'), segments=False)
  fn = lambda q, k, v: ops.attention(q, k, v, window=64, segment_ids_BT=None)
  try:
    lowered = jax.jit(fn).trace(q, q, q).lower(lowering_platforms=('cuda',))
  except RuntimeError as e:  # a CPU-only jaxlib has no cuDNN to ask for its version
    if 'cuDNN is not detected' in str(e):
      pytest.skip('this jaxlib has no cuDNN: the cuDNN path lowers on a GPU host only')
    raise
  assert 'cudnn' in lowered.as_text()


# --- Importing the model changes no environment -------------------------------------------


@pytest.mark.fresh_interpreter  # a zygote's fork would have imported the model already
def test_importing_the_model_sets_no_libtpu_placeholders():
  """kernels.xla.quiet_libtpu runs where a backend starts, never on `import model`.

  `import jax` itself sets TF_CPP_MIN_LOG_LEVEL (and, with libtpu installed,
  TPU_LIBRARY_PATH and TPU_SKIP_MDS_QUERY), so the environment is taken after it.
  The placeholders conftest.py set for this process are removed from the child's.
  """
  env = {k: v for k, v in os.environ.items() if k not in xla.LIBTPU_PLACEHOLDERS}
  code = 'import os, jax; a = dict(os.environ); import model; assert a == dict(os.environ), ' \
         'set(os.environ.items()) ^ set(a.items())'
  proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, capture_output=True,
                        text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-1500:]


# --- A JAX without Pallas' Triton backend (deprecated in 0.11.0) --------------------------


@pytest.mark.fresh_interpreter  # a zygote's fork would have imported the kernels already
def test_a_jax_without_the_triton_backend_imports_and_resolves_past_the_kernel():
  """With `jax.experimental.pallas.triton` gone (an ImportError, as once JAX removes it),
  the model still imports and 'auto' on a GPU leaves the GPU kernel out, saying why."""
  code = '''if True:
    import sys
    sys.modules['jax.experimental.pallas.triton'] = None  # `import` of it raises ImportError
    import kernels, model
    from configs import olmo3_7b
    assert kernels.flash_gpu.TRITON is None
    impl, why = kernels.resolve(olmo3_7b.model_config(), 'gpu', segments=True)
    print(impl, why)'''
  proc = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True,
                        text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-1500:]
  assert proc.stdout.startswith('xla auto on GPU: cuDNN does not support document masking')
  assert 'no Pallas Triton backend' in proc.stdout


def test_an_explicit_gpu_impl_that_cannot_run_here_is_named(monkeypatch):
  segs = dict(segments=True)
  assert 'cpu backend' in kernels.explicit_unsupported(_cfg(attention_impl='cudnn'), **segs)
  for interpreted in ('pallas_gpu', 'pallas'):  # on a CPU, as the tests run them
    assert kernels.explicit_unsupported(_cfg(attention_impl=interpreted), **segs) == ''
  assert kernels.explicit_unsupported(_cfg(attention_impl='auto'), **segs) == ''
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert 'document masking' in kernels.explicit_unsupported(_cfg(attention_impl='cudnn'), **segs)
  assert kernels.explicit_unsupported(_cfg(attention_impl='cudnn'), segments=False) == ''
  assert kernels.explicit_unsupported(_cfg(attention_impl='pallas_gpu'), **segs) == ''
  assert 'interpreter' in kernels.explicit_unsupported(_cfg(attention_impl='pallas'), **segs)
  monkeypatch.setattr(kernels.flash_gpu, 'TRITON', None)
  assert 'no Pallas Triton backend' in kernels.explicit_unsupported(
      _cfg(attention_impl='pallas_gpu'), **segs)
  monkeypatch.setattr(jax, 'default_backend', lambda: 'tpu')
  assert 'a TPU' in kernels.explicit_unsupported(_cfg(attention_impl='pallas_gpu'), **segs)
  assert kernels.explicit_unsupported(_cfg(attention_impl='pallas'), **segs) == ''
