"""Flash attention for TPU (Pallas/Mosaic): causal, sliding window, GQA, segments.

The public entry point is `flash_attention`; the Pallas kernels live in
`kernels/flash_kernels.py`. This file holds what decides *which* work the
kernels do: the per-chip block-size table, the block schedule that skips kv
blocks outside the causal/window band, the `custom_vjp` that ties the forward
and backward kernels together, and a pure-jnp `reference_attention` for tests.

Shape glossary:
  B batch, T time (queries and keys: self-attention), H query heads,
  G kv heads (H % G == 0), R = H // G query heads per kv head, K head_dim,
  X = H*K and Y = G*K (heads merged into the last axis for the kernels),
  P visited (q block, kv block) pairs of the schedule, S key time (reference).

Mask: query i sees key j iff j <= i, and i - j < window when a window is given
(W keys including itself; docs/architecture.md), and segment_ids[i] == segment_ids[j]
when segment ids are given (document masking).
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from kernels import flash_kernels


class BlockSizes(NamedTuple):
  """Kernel tiling for one (chip, head_dim): rows per q block, rows per kv block."""
  block_q: int
  block_kv: int


# Block sizes per (chip generation, head_dim). Chip names are jax's
# `pltpu.ChipVersion` strings. Why these numbers (details: docs/kernels.md):
# - Q (block_q): each q block streams the k/v blocks of its band from HBM, so
#   a forward step does 4*Q*C*K flops per 4*C*K bytes: Q flops per byte. Q
#   should reach the chip's bf16 flops per HBM byte (pltpu.get_tpu_info_for_chip:
#   v5e ~240, v5p ~190, 7x ~310, v6e ~560) to stay MXU-bound, hence 1024 on
#   v6e and 512 elsewhere. Q also sets the window band's waste: a q block of
#   Q rows spans W + Q keys for W keys of work per row, so at W=4096 Q=512
#   visits ~11% masked-out entries and Q=1024 ~20%; 512 wherever it suffices.
# - C (block_kv) = 512 amortises the ~0.35us fixed cost of a grid step over
#   0.27-1 GFLOP and divides T=8192 and W=4096 evenly.
# - head_dim 256 doubles the q/k/v/accumulator tiles but not the f32 [Q, C]
#   logits tiles, so the same blocks fit: the largest entry (Q=1024, C=512,
#   K=256) needs about 16 MiB of VMEM in the backward (four f32 [Q, C]
#   temporaries 8 MiB, double-buffered q/do/k/v 3 MiB, accumulators and
#   outputs 2 MiB, segment-id tiles 1 MiB), under _VMEM_LIMIT_BYTES below.
# - 'interpret' is used off-TPU (CPU tests in interpret mode): the smallest
#   legal blocks, so short test sequences still span several blocks.
_BLOCK_TABLE: dict[tuple[str, int], BlockSizes] = {
    ('v5e', 128): BlockSizes(512, 512),
    ('v5e', 256): BlockSizes(512, 512),
    ('v5p', 128): BlockSizes(512, 512),
    ('v5p', 256): BlockSizes(512, 512),
    ('v6e', 128): BlockSizes(1024, 512),
    ('v6e', 256): BlockSizes(1024, 512),
    ('7x', 128): BlockSizes(512, 512),
    ('7x', 256): BlockSizes(512, 512),
    ('interpret', 128): BlockSizes(128, 128),
    ('interpret', 256): BlockSizes(128, 128),
}

# Scoped VMEM the kernels may use, per chip: about half of each TensorCore's
# VMEM (pltpu.get_tpu_info_for_chip: v5e/v6e 128 MiB, v5p/7x 64 MiB), above
# what the table's entries need, leaving room for larger blocks from config.
_VMEM_LIMIT_BYTES: dict[str, int] = {
    'v5e': 64 << 20,
    'v5p': 32 << 20,
    'v6e': 64 << 20,
    '7x': 32 << 20,
}

# Abstract-device descriptions of the table's chips (device_kind, TensorCores
# per jax device), used to lower the kernels for a chip without having one.
TPU_DEVICE_KINDS: dict[str, tuple[str, int]] = {
    'v5e': ('TPU v5 lite', 1),
    'v5p': ('TPU v5p', 2),  # megacore: one jax device spans both TensorCores
    'v6e': ('TPU v6 lite', 1),
    '7x': ('TPU7x', 1),  # two TensorCores per chip, exposed as two devices
}


def default_block_sizes(chip: str, head_dim: int) -> BlockSizes:
  """Returns the table's (block_q, block_kv) for a chip ('v5p', 'v6e', '7x', ...)."""
  if (chip, head_dim) not in _BLOCK_TABLE:
    known = sorted(_BLOCK_TABLE)
    raise ValueError(
        f'No flash-attention block sizes for chip={chip!r}, head_dim={head_dim}'
        f' (table in kernels/flash_attention.py has {known}); set'
        ' cfg.model.attention_block_q / attention_block_kv explicitly.')
  return _BLOCK_TABLE[(chip, head_dim)]


def _current_chip() -> str:
  """The TPU generation being compiled for (honours jax's abstract mesh)."""
  if not pltpu.is_tpu_device():
    return 'interpret'
  return str(pltpu.get_tpu_info().chip_version)


# ----------------------------------------------------------------------------
# Block schedule: which (q block, kv block) pairs hold visible entries.

def _pair_is_visible(i, j, bq: int, bk: int, window: int | None):
  """Whether q block i and kv block j share any (query, key) inside the band."""
  first_q, last_q = i * bq, (i + 1) * bq - 1
  first_k, last_k = j * bk, (j + 1) * bk - 1
  vis = first_k <= last_q  # else the kv block is in every query's future
  if window is not None:  # the oldest query's band starts at first_q - window + 1
    vis &= last_k > first_q - window
  return vis


def _pair_is_full(i, j, bq: int, bk: int, window: int | None):
  """Whether every (query, key) of the pair is visible, so no mask is needed."""
  first_q, last_q = i * bq, (i + 1) * bq - 1
  first_k, last_k = j * bk, (j + 1) * bk - 1
  full = last_k <= first_q
  if window is not None:
    full &= last_q - first_k < window
  return full


def block_schedule(seq_len: int, block_q: int, block_kv: int, window: int | None,
                   *, kv_major: bool = False) -> np.ndarray:
  """The visited (q block, kv block) pairs and their flags, as int32 [3, P].

  Rows: q block index, kv block index, flags (flash_kernels.FIRST/LAST/MASKED).
  Pairs are ordered by q block then kv block (forward, dq), or by kv block then
  q block when kv_major (dk/dv); FIRST/LAST mark where a run sharing the outer
  block starts and ends, i.e. where an accumulator is reset and written out.
  """
  qblk, kvblk = np.meshgrid(np.arange(seq_len // block_q),
                            np.arange(seq_len // block_kv), indexing='ij')
  if kv_major:
    qblk, kvblk = qblk.T, kvblk.T
  keep = _pair_is_visible(qblk, kvblk, block_q, block_kv, window)
  i_P, j_P = qblk[keep], kvblk[keep]  # row-major: outer block, then inner
  outer_P = j_P if kv_major else i_P
  starts = np.r_[True, outer_P[1:] != outer_P[:-1]]
  ends = np.r_[outer_P[1:] != outer_P[:-1], True]
  flags_P = (flash_kernels.FIRST * starts + flash_kernels.LAST * ends +
             flash_kernels.MASKED * ~_pair_is_full(i_P, j_P, block_q, block_kv, window))
  return np.stack([i_P, j_P, flags_P]).astype(np.int32)


def kv_block_visits(seq_len: int, block_q: int, block_kv: int,
                    window: int | None) -> int:
  """Kernel grid steps per (batch, head) for one attention layer's forward."""
  return block_schedule(seq_len, block_q, block_kv, window).shape[1]


# ----------------------------------------------------------------------------
# custom_vjp around the kernels. Arrays here are [B, T, H*K] / [B, T, G*K]:
# the model's [B, T, H, K] with the last two axes merged (a free reshape), so
# a head is a K-wide column block and no transpose to [B, H, T, K] is needed.

@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything the kernels need besides arrays (hashable, for custom_vjp)."""
  num_heads: int
  num_kv_heads: int
  head_dim: int
  window: int | None
  block_q: int
  block_kv: int
  vmem_limit_bytes: int | None
  interpret: Any

  def kernel_args(self, seq_len: int, kv_major: bool = False) -> dict[str, Any]:
    sched = block_schedule(seq_len, self.block_q, self.block_kv, self.window,
                           kv_major=kv_major)
    return dict(schedule=jnp.asarray(sched), num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                window=self.window, block_q=self.block_q, block_kv=self.block_kv,
                vmem_limit_bytes=self.vmem_limit_bytes, interpret=self.interpret)


def _segment_layouts(segment_ids_BT):
  """Segment ids as a lane-broadcast column [B, T, 128] and a row [B, 8, T]."""
  if segment_ids_BT is None:
    return None
  b, t = segment_ids_BT.shape
  col = jax.lax.broadcast_in_dim(segment_ids_BT, (b, t, flash_kernels.LANES), (0, 1))
  row = jax.lax.broadcast_in_dim(segment_ids_BT, (b, flash_kernels.SUBLANES, t), (0, 2))
  return col, row


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_BTX, k_BTY, v_BTY, segment_ids_BT, st: _Static):
  return _flash_fwd(q_BTX, k_BTY, v_BTY, segment_ids_BT, st)[0]


def _flash_fwd(q_BTX, k_BTY, v_BTY, segment_ids_BT, st: _Static):
  t = q_BTX.shape[1]
  o_BTX, lse_BHT = flash_kernels.forward(
      q_BTX, k_BTY, v_BTY, _segment_layouts(segment_ids_BT), **st.kernel_args(t))
  return o_BTX, (q_BTX, k_BTY, v_BTY, segment_ids_BT, o_BTX, lse_BHT)


def _flash_bwd(st: _Static, residuals, do_BTX):
  q_BTX, k_BTY, v_BTY, segment_ids_BT, o_BTX, lse_BHT = residuals
  b, t, _ = q_BTX.shape
  h, k = st.num_heads, st.head_dim
  # D_i = sum_k dO_ik O_ik = sum_j P_ij dP_ij: the softmax-backward row term,
  # computed once here in f32 rather than per kv block inside the kernels.
  di_BTH = jnp.einsum('bthk,bthk->bth',
                      o_BTX.reshape(b, t, h, k).astype(jnp.float32),
                      do_BTX.reshape(b, t, h, k).astype(jnp.float32))
  di_BHT = di_BTH.transpose(0, 2, 1)
  segments = _segment_layouts(segment_ids_BT)
  dq_BTX = flash_kernels.backward_dq(
      q_BTX, k_BTY, v_BTY, do_BTX, lse_BHT, di_BHT, segments, **st.kernel_args(t))
  dk_BTY, dv_BTY = flash_kernels.backward_dkv(
      q_BTX, k_BTY, v_BTY, do_BTX, lse_BHT, di_BHT, segments,
      **st.kernel_args(t, kv_major=True))
  return dq_BTX, dk_BTY, dv_BTY, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _check_inputs(q_BTHK, k_BTGK, v_BTGK, window, segment_ids_BT, block_q,
                  block_kv) -> None:
  if q_BTHK.ndim != 4 or k_BTGK.ndim != 4 or v_BTGK.ndim != 4:
    raise ValueError(
        'flash_attention expects q [B, T, H, K] and k, v [B, T, G, K]; got'
        f' q {q_BTHK.shape}, k {k_BTGK.shape}, v {v_BTGK.shape}.')
  b, t, h, k = q_BTHK.shape
  if k_BTGK.shape != v_BTGK.shape or k_BTGK.shape[:2] != (b, t) or k_BTGK.shape[3] != k:
    raise ValueError(
        'flash_attention: k and v must both be [B, T, G, K] with q\'s B, T and K;'
        f' got q {q_BTHK.shape}, k {k_BTGK.shape}, v {v_BTGK.shape}.')
  g = k_BTGK.shape[2]
  if h % g:
    raise ValueError(f'flash_attention: query heads H={h} must be a multiple of'
                     f' kv heads G={g} (GQA).')
  if k % flash_kernels.LANES:
    raise ValueError(
        f'flash_attention: head_dim={k} must be a multiple of'
        f' {flash_kernels.LANES} (TPU lane width); use attention_impl=xla.')
  if not q_BTHK.dtype == k_BTGK.dtype == v_BTGK.dtype:
    raise ValueError('flash_attention: q, k, v must share a dtype; got'
                     f' {q_BTHK.dtype}, {k_BTGK.dtype}, {v_BTGK.dtype}.')
  if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
    raise ValueError(f'flash_attention: window must be a positive int or None,'
                     f' got {window!r}.')
  if segment_ids_BT is not None and (
      segment_ids_BT.shape != (b, t) or
      not jnp.issubdtype(segment_ids_BT.dtype, jnp.integer)):
    raise ValueError(
        f'flash_attention: segment_ids_BT must be an integer [B, T] = [{b}, {t}]'
        f' array; got {segment_ids_BT.shape} {segment_ids_BT.dtype}.')
  for name, blk in (('block_q', block_q), ('block_kv', block_kv)):
    if blk is not None and (blk < flash_kernels.LANES or blk % flash_kernels.LANES):
      raise ValueError(
          f'flash_attention: {name}={blk} must be a positive multiple of'
          f' {flash_kernels.LANES} (Mosaic tiling); fix'
          f' cfg.model.attention_{name}.')


def flash_attention(q_BTHK, k_BTGK, v_BTGK, *, window: int | None = None,
                    segment_ids_BT=None, block_q: int | None = None,
                    block_kv: int | None = None, interpret: Any = False):
  """Causal (optionally windowed, segmented) GQA attention via Pallas TPU kernels.

  Args:
    q_BTHK: queries [B, T, H, K]; K a multiple of 128.
    k_BTGK: keys [B, T, G, K]; query head h reads kv head h // (H // G).
    v_BTGK: values [B, T, G, K].
    window: query i sees keys j with i - window < j <= i; None: all j <= i.
    segment_ids_BT: optional int [B, T]; attend only within equal ids.
    block_q: rows per q block (multiple of 128); None: the chip's table entry.
    block_kv: rows per kv block (multiple of 128); None: the table entry.
    interpret: False on TPU; True or pltpu.InterpretParams() to run on CPU.

  Returns:
    [B, T, H, K] in q's dtype; softmax scale K**-0.5, f32 softmax statistics
    and f32 matmul accumulation.
  """
  _check_inputs(q_BTHK, k_BTGK, v_BTGK, window, segment_ids_BT, block_q, block_kv)
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  chip = _current_chip()
  if block_q is None or block_kv is None:
    table = default_block_sizes(chip, k)
    block_q = block_q or table.block_q
    block_kv = block_kv or table.block_kv
  # Short sequences shrink the blocks; ragged ones are padded at the end.
  # Padded keys lie in every real query's future, so causality hides them; the
  # padded query rows are sliced away and get zero cotangent.
  block_q = min(block_q, _round_up(t, flash_kernels.LANES))
  block_kv = min(block_kv, _round_up(t, flash_kernels.LANES))
  t_pad = _round_up(t, math.lcm(block_q, block_kv))
  st = _Static(num_heads=h, num_kv_heads=g, head_dim=k,
               window=None if window is None else int(window),
               block_q=block_q, block_kv=block_kv,
               vmem_limit_bytes=_VMEM_LIMIT_BYTES.get(chip), interpret=interpret)
  pad = ((0, 0), (0, t_pad - t), (0, 0))
  q_BTX = jnp.pad(q_BTHK.reshape(b, t, h * k), pad)
  k_BTY = jnp.pad(k_BTGK.reshape(b, t, g * k), pad)
  v_BTY = jnp.pad(v_BTGK.reshape(b, t, g * k), pad)
  if segment_ids_BT is not None:
    segment_ids_BT = jnp.pad(segment_ids_BT.astype(jnp.int32),
                             ((0, 0), (0, t_pad - t)), constant_values=-1)
  o_BTX = _flash(q_BTX, k_BTY, v_BTY, segment_ids_BT, st)
  return o_BTX[:, :t].reshape(b, t, h, k)


def reference_attention(q_BTHK, k_BTGK, v_BTGK, *, window: int | None = None,
                        segment_ids_BT=None):
  """Plain-jnp attention with flash_attention's semantics (the XLA baseline).

  Softmax in float32 (float64 if given float64 inputs); output in q's dtype.
  Materialises the [B, G, R, T, T] logits: for tests and benchmarks only.
  """
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  dtype = jnp.promote_types(q_BTHK.dtype, jnp.float32)
  q_BTGRK = q_BTHK.astype(dtype).reshape(b, t, g, h // g, k)
  logits_BGRTS = jnp.einsum('btgrk,bsgk->bgrts', q_BTGRK,
                            k_BTGK.astype(dtype)) * k**-0.5
  qpos_T1 = jnp.arange(t)[:, None]
  kpos_1S = jnp.arange(t)[None, :]
  mask_TS = kpos_1S <= qpos_T1
  if window is not None:
    mask_TS &= qpos_T1 - kpos_1S < window
  mask_BTS = jnp.broadcast_to(mask_TS, (b, t, t))
  if segment_ids_BT is not None:
    mask_BTS &= segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  logits_BGRTS = jnp.where(mask_BTS[:, None, None], logits_BGRTS,
                           jnp.finfo(dtype).min)
  probs_BGRTS = jax.nn.softmax(logits_BGRTS, axis=-1)
  o_BTGRK = jnp.einsum('bgrts,bsgk->btgrk', probs_BGRTS, v_BTGK.astype(dtype))
  return o_BTGRK.reshape(b, t, h, k).astype(q_BTHK.dtype)
