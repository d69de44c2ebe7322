"""The implementations behind model.py's two primitives: a matmul and attention.

model.py writes a block as matmuls and one attention call; `select(cfg)`
returns the functions that run them for `cfg.attention_impl`:

  impl              attention                                  matmul
  'xla'             kernels/xla.py: query-blocked, causal      kernels/xla.py (CPU-tuned backward)
  'pallas'          kernels/flash_attention.py (TPU; CPU tests  x @ w
                    run it in Pallas' interpreter)
  'cudnn'           jax.nn.dot_product_attention on cuDNN (GPU) x @ w
  'flash_stand_in'  plan.py's CPU compile of a TPU/GPU step:   x @ w
                    a flash kernel's shapes and O(T) memory,
                    not its math (never for training)
  'auto'            `resolve`: 'pallas' on TPU, 'cudnn' on GPU where cuDNN
                    supports the step, else 'xla' (CPU included)

kernels/chunked_ce.py is the third speed path: the output head's logits and
cross-entropy sums for a chunk of positions, with a backward that writes the
logits' gradient over them in place (loss.py calls it).

Shapes: B batch, T queries, S keys, H query heads, G kv heads, K head_dim.

kernels/ imports nothing of the project outside itself: model.py, loss.py and every
layer above may call it (tests/test_layout.py).
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
from kernels import flash_kernels
from kernels import xla
from kernels.flash_attention import BlockSizes
from kernels.flash_attention import block_schedule
from kernels.flash_attention import default_block_sizes
from kernels.flash_attention import flash_attention
from kernels.flash_attention import kv_block_visits
from kernels.flash_attention import TPU_DEVICE_KINDS

IMPLS = ('auto', 'xla', 'pallas', 'cudnn', 'flash_stand_in')

# Every entry point that starts a backend imports this package (through model.py) first:
# where libtpu is installed on a host without TPU chips, its warnings are kept quiet.
xla.quiet_libtpu()


class Ops(NamedTuple):
  """What one block calls: matmul(x, w) and attention(q, k, v, *, window, segment_ids_BT,
  names=None). `names`, (output, log-sum-exp), are the checkpoint names a remat policy
  saves the attention's residuals by: every impl names its output; the Pallas kernel
  names its log-sum-exp too, which lets a policy skip the forward's recomputation."""
  impl: str
  matmul: Callable[[jax.Array, jax.Array], jax.Array]
  attention: Callable[..., jax.Array]


def cudnn_unsupported(cfg: ml_collections.ConfigDict, segments: bool) -> str:
  """Why cuDNN's fused attention cannot run this model's step ('' if it can)."""
  if segments:
    return 'document masking (segment ids)'
  if cfg.dtype not in ('bfloat16', 'float16'):
    return f'{cfg.dtype} compute (cuDNN flash attention takes bf16/fp16)'
  if cfg.head_dim > 128 or cfg.head_dim % 8:
    return f'head_dim {cfg.head_dim} (cuDNN flash attention: a multiple of 8, at most 128)'
  return ''


def pallas_unsupported(cfg: ml_collections.ConfigDict) -> str:
  """Why the Pallas kernel cannot run this model's attention ('' if it can)."""
  if cfg.head_dim % flash_kernels.LANES:
    return f'head_dim {cfg.head_dim} (the kernel takes multiples of {flash_kernels.LANES})'
  return ''


def resolve(cfg: ml_collections.ConfigDict, platform: str | None = None, *,
            segments: bool) -> tuple[str, str]:
  """(impl, why) for cfg.attention_impl on `platform` (default: JAX's backend).

  An explicit impl is kept as it is; 'auto' picks the platform's flash kernel
  where it supports the step.
  """
  if cfg.attention_impl != 'auto':
    return cfg.attention_impl, 'set in the config'
  platform = platform or jax.default_backend()
  if platform == 'tpu':
    reason = pallas_unsupported(cfg)
    if not reason:
      return 'pallas', 'auto on TPU: the Pallas flash kernel'
    return 'xla', f'auto on TPU: the Pallas kernel does not support {reason}'
  if platform in ('gpu', 'cuda', 'rocm'):
    reason = cudnn_unsupported(cfg, segments)
    if not reason:
      return 'cudnn', 'auto on GPU: cuDNN flash attention'
    return 'xla', f'auto on GPU: cuDNN does not support {reason}'
  return 'xla', f'auto on {platform}: blocked XLA attention'


def select(cfg: ml_collections.ConfigDict, *, segments: bool) -> Ops:
  """The Ops a model with `cfg` runs on JAX's current backend.

  Traced under a mesh whose 'context' axis is > 1 (context parallelism),
  attention runs through kernels/context_parallel.py with the impl's local
  attention; otherwise the impl's attention is returned as it is.
  """
  ops = _select(cfg, segments=segments)
  if context_parallel.degree() == 1:
    return ops
  if ops.impl == 'pallas':
    local = context_parallel.pallas_local(cfg.attention_block_q, cfg.attention_block_kv,
                                          interpret=not pltpu.is_tpu_device())
  elif ops.impl == 'flash_stand_in':
    local = context_parallel.stand_in_local
  else:  # 'xla', and 'cudnn' (whose kernel has no query offset)
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


def _select(cfg: ml_collections.ConfigDict, *, segments: bool) -> Ops:
  impl, _ = resolve(cfg, segments=segments)
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
  if impl == 'cudnn':
    reason = cudnn_unsupported(cfg, segments)
    if reason:
      raise NotImplementedError(f"attention_impl='cudnn' does not support {reason}; use "
                                "'auto' (falls back to 'xla') or 'xla'.")
    return Ops(impl, jnp.matmul, _named(_cudnn))
  if impl == 'flash_stand_in':
    return Ops(impl, jnp.matmul, _named(_flash_stand_in))
  raise ValueError(f'attention_impl={impl!r} is not one of {IMPLS}.')


def _per_shard(attention: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """Runs `attention` on each device's shard under a mesh (Mosaic kernels are not partitioned).

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


def _cudnn(q_BTHK, k_BSGK, v_BSGK, *, window, segment_ids_BT):
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
    'BlockSizes', 'IMPLS', 'Ops', 'block_schedule', 'context_parallel', 'cudnn_unsupported',
    'default_block_sizes',
    'flash_attention', 'kv_block_visits', 'resolve', 'select',
    'TPU_DEVICE_KINDS', 'xla',
]
