"""The implementations behind model.py's two primitives: a matmul and attention.

model.py writes a block as matmuls and one attention call; `select(cfg)`
returns the functions that run them for `cfg.attention_impl`:

  impl              runs on  attention                                matmul
  'xla'             any      kernels/xla.py: query-blocked, causal    kernels/xla.py (CPU-tuned
                                                                      backward)
  'pallas'          TPU      kernels/flash_attention.py +             x @ w
                             kernels/flash_kernels.py (Mosaic; CPU
                             tests run it in Pallas' interpreter)
  'pallas_gpu'      GPU      kernels/flash_gpu.py (Triton; CPU tests  x @ w
                             run it in Pallas' interpreter)
  'cudnn'           GPU      jax.nn.dot_product_attention on cuDNN    x @ w
  'flash_stand_in'  CPU      plan.py's CPU compile of a TPU/GPU step: x @ w
                             a flash kernel's shapes and O(T) memory,
                             not its math (never for training)
  'auto'            `resolve` picks, and says why: 'pallas' on TPU; on GPU 'cudnn'
                    where cuDNN takes the step, else 'pallas_gpu' (document masking,
                    context parallelism, float32, head_dim cuDNN refuses); 'xla' on
                    CPU, or where no flash kernel takes the head_dim.

kernels/attention_args.py holds the argument checks both flash kernels share.
kernels/context_parallel.py splits attention over the mesh's 'context' axis
with the impl's kernel as the local attention (TPU or GPU flash, or XLA).
kernels/chunked_ce.py is the third speed path: the output head's logits and
cross-entropy sums for a chunk of positions, with a backward that writes the
logits' gradient over them in place (loss.py calls it).

Shapes: B batch, T queries, S keys, H query heads, G kv heads, K head_dim.

kernels/ imports nothing of the project outside itself: model.py, loss.py and every
layer above may call it (tests/test_layout.py). Importing it changes nothing in the
environment (the libtpu placeholders are set by the entry points: xla.quiet_libtpu).
"""

from collections.abc import Callable
import functools
import math
from typing import NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P
import ml_collections

from kernels import context_parallel
from kernels import flash_gpu
from kernels import flash_kernels
from kernels import xla
from kernels.flash_attention import BlockSizes
from kernels.flash_attention import block_schedule
from kernels.flash_attention import default_block_sizes
from kernels.flash_attention import flash_attention
from kernels.flash_attention import kv_block_visits
from kernels.flash_attention import TPU_DEVICE_KINDS

IMPLS = ('auto', 'xla', 'pallas', 'pallas_gpu', 'cudnn', 'flash_stand_in')
GPU_PLATFORMS = ('gpu', 'cuda', 'rocm')


class Ops(NamedTuple):
  """What one block calls: matmul(x, w) and attention(q, k, v, *, window, segment_ids_BT,
  names=None).

  `names` is (output name, log-sum-exp name), the checkpoint names a remat
  policy saves attention's residuals by (model.py passes `attn_out` and
  `attn_lse` qualified by the layer's position). Every impl names its output.
  The flash kernels ('pallas' on TPU, 'pallas_gpu' on GPU) also name their
  float32 log-sum-exp [B, H, T], so a policy that saves both skips the
  forward's recomputation in the backward. 'cudnn' cannot: JAX's cuDNN path
  keeps its softmax statistics inside its own custom_vjp, so a policy saving
  `attn` keeps the output but the backward recomputes cuDNN's forward for the
  statistics. 'xla' has no log-sum-exp (it keeps float32 probabilities).
  """
  impl: str
  matmul: Callable[[jax.Array, jax.Array], jax.Array]
  attention: Callable[..., jax.Array]


_CUDNN_HOPPER = (9, 0)  # compute capability from which cuDNN takes head_dim 256
_CUDNN_HD256_VERSION = 90500  # ... with cuDNN 9.5 or newer


def _gpu_facts() -> tuple[tuple[int, int] | None, int | None]:
  """(compute capability, cuDNN version as 90500 for 9.5.0) of this process's first GPU;
  None for what cannot be read (no GPU backend, or no cuDNN version exposed)."""
  try:
    if jax.default_backend() != 'gpu':
      return None, None
    cc_text = getattr(jax.devices()[0], 'compute_capability', None)  # '9.0' on CUDA
    cc = tuple(int(x) for x in str(cc_text).split('.')[:2]) if cc_text else None
  except (RuntimeError, ValueError):
    return None, None
  return cc, cudnn_version()


def cudnn_version() -> int | None:
  """cuDNN's version as JAX's CUDA plugin loaded it (90500 for 9.5.0); None where it
  cannot be read. Private: JAX has no public call for it, so a JAX that moves
  jax._src.lib.cuda_versions reads as unknown."""
  try:
    from jax._src.lib import cuda_versions  # pylint: disable=g-import-not-at-top
    return int(cuda_versions.cudnn_get_version()) if cuda_versions else None
  except Exception:  # pylint: disable=broad-except
    return None


def cudnn_max_head_dim(this_process: bool = True) -> tuple[int, str]:
  """The largest head_dim cuDNN attention takes, and why.

  this_process: the GPU this process runs on (its backend is started, if it
  is not yet); False: a GPU elsewhere (plan.py --platform=gpu), nothing asked.

  256 on Hopper or newer (compute capability >= 9.0) with cuDNN >= 9.5, else
  128 (JAX's own check: jax/_src/cudnn/fused_attention_stablehlo.py). Where
  the process has no GPU (plan.py planning a GPU step on a CPU), the target is
  taken to be Hopper; where JAX exposes no cuDNN version, JAX's gate (compute
  capability alone) is trusted.
  """
  cc, version = _gpu_facts() if this_process else (None, None)
  if cc is None:
    where = 'no GPU in this process' if this_process else 'a GPU planned for from elsewhere'
    return 256, f'{where}: a Hopper GPU assumed'
  if cc < _CUDNN_HOPPER:
    return 128, f'compute capability {cc[0]}.{cc[1]} (< 9.0)'
  if version is not None and version < _CUDNN_HD256_VERSION:
    return 128, f'cuDNN {version} (< 9.5)'
  return 256, f'compute capability {cc[0]}.{cc[1]}, cuDNN {version or "version unknown"}'


def cudnn_unsupported(cfg: ml_collections.ConfigDict, segments: bool,
                      this_process: bool = True) -> str:
  """Why cuDNN's fused attention cannot run this model's step ('' if it can);
  this_process: as cudnn_max_head_dim's."""
  if segments:
    return 'document masking (segment ids)'
  if cfg.dtype not in ('bfloat16', 'float16'):
    return f'{cfg.dtype} compute (cuDNN flash attention takes bf16/fp16)'
  limit, why = cudnn_max_head_dim(this_process)
  if cfg.head_dim > limit or cfg.head_dim % 8:
    return (f'head_dim {cfg.head_dim} (cuDNN flash attention: a multiple of 8, at most '
            f'{limit}: {why})')
  return ''


def pallas_gpu_unsupported(cfg: ml_collections.ConfigDict) -> str:
  """Why the Pallas GPU kernel cannot run this model's attention ('' if it can)."""
  if flash_gpu.TRITON is None:
    return (f'JAX {jax.__version__} has no Pallas Triton backend, which the GPU kernel '
            'lowers through (deprecated in JAX 0.11.0; docs/kernels.md)')
  if cfg.head_dim not in flash_gpu.HEAD_DIMS:
    return f'head_dim {cfg.head_dim} (the GPU kernel takes {flash_gpu.HEAD_DIMS})'
  return ''


def pallas_unsupported(cfg: ml_collections.ConfigDict) -> str:
  """Why the Pallas kernel cannot run this model's attention ('' if it can)."""
  if cfg.head_dim % flash_kernels.LANES:
    return f'head_dim {cfg.head_dim} (the kernel takes multiples of {flash_kernels.LANES})'
  return ''


def explicit_unsupported(cfg: ml_collections.ConfigDict, *, segments: bool) -> str:
  """Why an explicitly set attention_impl cannot run this model's step on this process's
  backend ('' if it can; 'auto' always can: resolve picks what does). model.validate checks
  what holds anywhere ('pallas' at a head_dim it cannot take). On a CPU the flash kernels
  run in Pallas' interpreter (the tests); on the other accelerator they would too, slowly
  and without a word, so they are refused there, and cuDNN needs an NVIDIA GPU."""
  impl, platform = cfg.attention_impl, jax.default_backend()
  if impl == 'cudnn':
    if platform not in GPU_PLATFORMS:
      return f'the {platform} backend (cuDNN runs on NVIDIA GPUs)'
    return cudnn_unsupported(cfg, segments)
  if impl == 'pallas_gpu' and platform in GPU_PLATFORMS:
    return pallas_gpu_unsupported(cfg)
  if impl == 'pallas_gpu' and platform == 'tpu':
    return "a TPU (the GPU kernel would run in Pallas' interpreter; the TPU's is 'pallas')"
  if impl == 'pallas' and platform in GPU_PLATFORMS:
    return "a GPU (the TPU kernel would run in Pallas' interpreter; the GPU's is 'pallas_gpu')"
  return ''


def resolve(cfg: ml_collections.ConfigDict, platform: str | None = None, *,
            segments: bool, context_parallel: bool = False) -> tuple[str, str]:
  """(impl, why) for cfg.attention_impl on `platform` (default: JAX's backend).

  An explicit impl is kept as it is; 'auto' picks the platform's flash kernel
  where it supports the step. context_parallel: the sequence is split over a
  'context' mesh axis (the local attention then needs a query offset).
  """
  if cfg.attention_impl != 'auto':
    return cfg.attention_impl, 'set in the config'
  here = platform is None  # this process's backend, not a platform planned for from elsewhere
  platform = platform or jax.default_backend()
  if platform == 'tpu':
    reason = pallas_unsupported(cfg)
    if not reason:
      return 'pallas', 'auto on TPU: the Pallas flash kernel'
    return 'xla', f'auto on TPU: the Pallas kernel does not support {reason}'
  if platform in GPU_PLATFORMS:
    reason = cudnn_unsupported(cfg, segments, this_process=here)
    if context_parallel and not reason:
      reason = 'context parallelism (query offsets)'
    if not reason:
      return 'cudnn', 'auto on GPU: cuDNN flash attention'
    if not pallas_gpu_unsupported(cfg):
      return 'pallas_gpu', ('auto on GPU: the Pallas GPU flash kernel (cuDNN does not support '
                            f'{reason})')
    return 'xla', (f'auto on GPU: cuDNN does not support {reason}, and the Pallas GPU kernel '
                   f'cannot run it: {pallas_gpu_unsupported(cfg)}')
  return 'xla', f'auto on {platform}: blocked XLA attention'


def select(cfg: ml_collections.ConfigDict, *, segments: bool) -> Ops:
  """The Ops a model with `cfg` runs on JAX's current backend.

  Traced under a mesh whose 'context' axis is > 1 (context parallelism),
  attention runs through kernels/context_parallel.py with the impl's local
  attention; otherwise the impl's attention is returned as it is.
  """
  split = context_parallel.degree() > 1
  ops = _select(cfg, segments=segments, split=split)
  if not split:
    return ops
  if ops.impl == 'pallas':
    local = context_parallel.pallas_local(cfg.attention_block_q, cfg.attention_block_kv,
                                          interpret=not pltpu.is_tpu_device())
  elif ops.impl == 'pallas_gpu' or (ops.impl == 'cudnn' and not pallas_gpu_unsupported(cfg)):
    # cuDNN's kernel takes no query offset: an explicit 'cudnn' splits on the GPU kernel.
    local = context_parallel.PallasGpuLocal(interpret=_gpu_interpret())
  elif ops.impl == 'flash_stand_in':
    local = context_parallel.stand_in_local
  else:  # 'xla', and 'cudnn' at a head_dim the GPU kernel does not take
    local = context_parallel.xla_local
  head_stride = cfg.context_head_stride

  def attention(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT, names=None):
    # (train.validate makes seq_len split; the 1-token init trace runs unsplit.)
    if q_BTHK.shape[1] > 1:
      return _name_output(context_parallel.attention(
          q_BTHK, k_BSGK, v_BSGK, window=window, segment_ids_BT=segment_ids_BT, local=local,
          head_stride=head_stride), names)
    return ops.attention(q_BTHK, k_BSGK, v_BSGK, window=window, segment_ids_BT=segment_ids_BT,
                         names=names)
  return ops._replace(attention=attention)


def _name_output(o_BTHK: jax.Array, names: tuple[str, str] | None) -> jax.Array:
  return o_BTHK if names is None else checkpoint_name(o_BTHK, names[0])


def _named(attention: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """`attention` with the `names` argument: its output named (it has no log-sum-exp)."""
  @functools.wraps(attention)
  def run(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT, names=None):
    return _name_output(attention(q_BTHK, k_BSGK, v_BSGK, window=window,
                                  segment_ids_BT=segment_ids_BT), names)
  return run


def _gpu_interpret() -> bool:
  """The GPU kernel runs in Pallas' interpreter off a GPU (CPU tests)."""
  return jax.default_backend() != 'gpu'


def _select(cfg: ml_collections.ConfigDict, *, segments: bool, split: bool = False) -> Ops:
  impl, _ = resolve(cfg, segments=segments, context_parallel=split)
  if impl == 'xla':
    return Ops(impl, xla.matmul, _named(xla.attention))
  if impl == 'pallas':
    def pallas(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT, names=None):
      return flash_attention(q_BTHK, k_BSGK, v_BSGK, window=window,
                             segment_ids_BT=segment_ids_BT, block_q=cfg.attention_block_q,
                             block_kv=cfg.attention_block_kv,
                             interpret=not pltpu.is_tpu_device(),  # CPU tests interpret
                             residual_names=names)
    return Ops(impl, jnp.matmul, _per_shard(pallas))
  if impl == 'pallas_gpu':
    def pallas_gpu(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT, names=None):
      return flash_gpu.flash_attention_gpu(q_BTHK, k_BSGK, v_BSGK, window=window,
                                           segment_ids_BT=segment_ids_BT,
                                           interpret=_gpu_interpret(), residual_names=names)
    return Ops(impl, jnp.matmul, _per_shard(pallas_gpu))  # a Triton call is not partitioned
  if impl == 'cudnn':
    reason = cudnn_unsupported(cfg, segments)
    if reason:
      raise NotImplementedError(f"attention_impl='cudnn' does not support {reason}; use "
                                "'auto' (picks 'pallas_gpu' for it) or 'pallas_gpu'.")
    return Ops(impl, jnp.matmul, _named(cudnn_attention))
  if impl == 'flash_stand_in':
    return Ops(impl, jnp.matmul, _named(_flash_stand_in))
  raise ValueError(f'attention_impl={impl!r} is not one of {IMPLS}.')


def _per_shard(attention: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """Runs `attention` on each device's shard under a mesh (Pallas calls are not partitioned).

  Rows split over the batch axes and heads over 'tensor', as far as they
  divide; outside a mesh (tests, single device) it is `attention` itself.
  """
  def run(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT, names=None):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
      return attention(q_BTHK, k_BSGK, v_BSGK, window=window, segment_ids_BT=segment_ids_BT,
                       names=names)
    rows = tuple(a for a in ('data', 'fsdp') if a in mesh.axis_names)
    if q_BTHK.shape[0] % math.prod(mesh.shape[a] for a in rows):
      rows = ()
    tp = mesh.shape.get('tensor', 1)
    heads = 'tensor' if tp > 1 and not (q_BTHK.shape[2] % tp or k_BSGK.shape[2] % tp) else None
    qkv = P(rows or None, None, heads, None)
    seg = P(rows or None, None)
    fn = lambda q, k, v, s: attention(q, k, v, window=window, segment_ids_BT=s, names=names)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, None if segment_ids_BT is None
                                                  else seg),
                         out_specs=qkv, check_vma=False)(q_BTHK, k_BSGK, v_BSGK, segment_ids_BT)
  return run


def cudnn_attention(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT):
  """cuDNN's fused attention through JAX (GPU). Its softmax statistics stay inside
  JAX's custom_vjp: only the output can be named (see Ops)."""
  del segment_ids_BT  # None: cudnn_unsupported refuses segments
  # local_window_size=(left, right) keys; ours is W keys including the query.
  local = None if window is None else (window - 1, 0)
  return jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, is_causal=True,
                                      local_window_size=local, implementation='cudnn')


def _flash_stand_in(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT):
  """A flash kernel's output shape and O(T) memory, for CPU compiles of TPU/GPU steps."""
  del window, segment_ids_BT
  kv_BSHK = jnp.repeat(k_BSGK * v_BSGK, q_BTHK.shape[2] // k_BSGK.shape[2], axis=2)
  return q_BTHK * kv_BSHK


__all__ = [
    'BlockSizes', 'GPU_PLATFORMS', 'IMPLS', 'Ops', 'block_schedule', 'context_parallel',
    'cudnn_attention', 'cudnn_max_head_dim', 'cudnn_unsupported', 'cudnn_version',
    'default_block_sizes', 'explicit_unsupported', 'flash_attention', 'flash_gpu',
    'kv_block_visits', 'pallas_gpu_unsupported', 'resolve', 'select',
    'TPU_DEVICE_KINDS', 'xla',
]
