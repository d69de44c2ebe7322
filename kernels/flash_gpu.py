"""Flash attention for NVIDIA GPUs (Pallas, Triton lowering): causal, window, GQA, segments.

The GPU counterpart of kernels/flash_attention.py (which is TPU-only, Mosaic).
kernels.resolve picks this kernel on a GPU where cuDNN cannot run the step:
document masking (segment ids) and context parallelism's query offsets. It
computes model.reference_attention's equation; the mask is the TPU kernel's
(kernels/flash_attention.py docstring): a query at position i sees key j iff
j <= i, i - j < window (W keys including itself) and, with segment ids, both
positions hold the same id.

Three kernels, each a Pallas call whose grid the Triton lowering turns into
one CUDA program per block:
  forward  grid (q blocks, B, H): one q block against the kv blocks of its
           band, online softmax in float32, writes o and the log-sum-exp.
  dq       grid (q blocks, B, H): the same band walk, dq += dS K.
  dk/dv    grid (kv blocks, B, G): one kv block against the q blocks that see
           it, for each of the R query heads sharing its kv head (GQA needs no
           repeated k/v and no reduction afterwards).
Each kernel's loop bounds come from the block's positions, so kv blocks
outside the causal/window band are never loaded: work O(T * W), memory O(T).
Block pairs strictly inside the band skip the element mask.

Queries: T rows in C equal chunks, chunk c at key positions starts[c] +
0, 1, ... (default one chunk at q_offset; context parallelism's zig-zag
passes each device's two chunk starts, a traced row of a static table).

Shapes: B batch, T query rows, S keys, H query heads, G kv heads, R = H // G,
K head_dim, Q rows per q block, C rows per kv block (in kernels, a block's
rows), M chunks of queries, L rows per chunk, N = L padded to whole q blocks.

JAX versions: the kernels lower through Pallas' Triton backend, the one the
project's JAX (0.10.2) has for GPUs. JAX 0.11.0 deprecated that backend (its
Pallas changelog: use Mosaic GPU, or Triton itself through jax_triton) and
warns at each lowering; a JAX that has removed it imports this module all the
same (TRITON is then None), and kernels.resolve no longer picks this kernel,
naming why. The port that keeps a flash path past that JAX is a Mosaic GPU
kernel (Hopper's TMA and wgmma) or a library's: docs/kernels.md.
"""

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

try:  # deprecated in JAX 0.11.0 (module docstring); None once a JAX removes it
  from jax.experimental.pallas import triton as TRITON
except ImportError:
  TRITON = None

from kernels import attention_args

# Finite stand-in for -inf (as the TPU kernel): a row with no visible key yet
# gets exp2(0) terms that the first real key's rescale exp2(MASK - m) wipes
# to exactly 0, instead of the NaN of (-inf) - (-inf).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
HEAD_DIMS = (64, 128, 256)  # Triton tiles are powers of two; these are the shipped configs'


class Tiling(NamedTuple):
  """One kernel's launch: rows per q block, rows per kv block, warps, pipeline stages."""
  block_q: int
  block_kv: int
  num_warps: int
  num_stages: int


class GpuBlockSizes(NamedTuple):
  forward: Tiling
  dq: Tiling
  dkv: Tiling


# Hopper (H100/H200: 228 KiB shared memory and 64K 32-bit registers per SM).
# Reasoned, not measured (no GPU was available when they were set; the device
# check times them). Why:
# - The forward keeps a [Q, K] float32 accumulator and a [Q, C] logits tile in
#   registers; Q = 128 with 8 warps (4 at K = 64) holds 64 accumulator
#   registers per thread at K = 128. Each kv step streams a [C, K] k and v
#   tile through shared memory: C = 64 at 3 stages is 96 KiB at K = 128.
# - K = 256 doubles the accumulator and the k/v tiles, so Q and the stages
#   halve (Q = 64, 2 stages: 128 KiB of k/v plus a 32 KiB q tile).
# - The dk/dv kernel holds two [C, K] float32 accumulators (dk, dv); 64 x 128
#   is 64 registers per thread over 8 warps, and K = 256 halves C to 32.
# - dq mirrors the forward with a [Q, K] dq accumulator and do/lse/delta loads.
# - Q divides the window band's ragged edge into at most Q masked rows per
#   block and the 7B's T = 8,192 and W = 4,096 evenly.
_HOPPER: dict[int, GpuBlockSizes] = {
    64: GpuBlockSizes(Tiling(128, 64, 4, 3), Tiling(64, 64, 4, 3), Tiling(64, 64, 4, 3)),
    128: GpuBlockSizes(Tiling(128, 64, 8, 3), Tiling(64, 64, 8, 2), Tiling(64, 64, 8, 2)),
    256: GpuBlockSizes(Tiling(64, 64, 8, 2), Tiling(64, 32, 8, 2), Tiling(64, 32, 8, 2)),
}
# Off-GPU (Pallas interpret mode on a CPU) and for check_cases on a GPU: small
# blocks, so that test sequences of 64-256 tokens span several of them (Triton's
# dot needs 16 rows at least).
TEST_BLOCKS = GpuBlockSizes(*(Tiling(32, 32, 4, 2),) * 3)


def default_block_sizes(head_dim: int, interpret: bool = False) -> GpuBlockSizes:
  if interpret:
    return TEST_BLOCKS
  if head_dim not in _HOPPER:
    raise ValueError(f'flash_attention_gpu: no block sizes for head_dim={head_dim} '
                     f'(kernels/flash_gpu.py has {sorted(_HOPPER)}); use attention_impl=xla.')
  return _HOPPER[head_dim]


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything but arrays (hashable: custom_vjp's nondiff argument)."""
  window: int | None
  chunk_len: int  # L: real query rows per chunk
  chunk_pad: int  # N: rows per chunk in the kernels' layout
  blocks: GpuBlockSizes
  segments: bool
  interpret: bool
  residual_names: tuple[str, str] | None


def _dot(a, b, contract=(1, 0)):
  """a . b over a's axis contract[0] and b's axis contract[1], accumulated in float32."""
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _visible(qpos_Q1, kpos_1C, window, segq_Q1=None, segk_1C=None):
  """The mask from broadcast query/key positions (and segment ids)."""
  vis = kpos_1C <= qpos_Q1
  if window is not None:
    vis &= qpos_Q1 - kpos_1C < window
  if segq_Q1 is not None:
    vis &= segq_Q1 == segk_1C
  return vis


def _q_block(st: _Static, starts_ref, q_block_index, block_q: int):
  """(key position of q block q_block_index's first row, of its last real row)."""
  per_chunk = st.chunk_pad // block_q
  chunk = lax.div(q_block_index, per_chunk)
  in_chunk = (q_block_index - chunk * per_chunk) * block_q
  start = starts_ref[chunk]
  last = start + jnp.minimum(in_chunk + block_q, st.chunk_len) - 1
  return start + in_chunk, last


def _kv_ranges(st: _Static, first_q, last_q, block_kv: int):
  """[(lo, hi, masked)] kv block ranges of a q block's band, in ascending order."""
  window = st.window
  lo = 0 if window is None else lax.div(jnp.maximum(first_q - window + 1, 0), block_kv)
  hi = lax.div(last_q, block_kv) + 1
  if st.segments:
    return [(lo, hi, True)]
  # Blocks every row sees whole: at or before the first row's key, and (window) not
  # before the last row's band start.
  full_lo = 0 if window is None else lax.div(
      jnp.maximum(last_q - window + 1, 0) + block_kv - 1, block_kv)
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(lax.div(first_q + 1, block_kv), full_lo, hi)
  return [(lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True)]


def _forward_kernel(starts_ref, q_ref, k_ref, v_ref, *refs, st: _Static, scale: float):
  """One q block [Q, K] against k/v [S, K]: o [Q, K] and lse [Q] (natural log)."""
  if st.segments:
    segq_ref, segk_ref, o_ref, lse_ref = refs
  else:
    (o_ref, lse_ref), segq_ref, segk_ref = refs, None, None
  block_q, block_kv = st.blocks.forward.block_q, st.blocks.forward.block_kv
  # Late q blocks have the longest causal band: launched first, they do not straggle.
  first_q, last_q = _q_block(st, starts_ref, pl.num_programs(0) - 1 - pl.program_id(0), block_q)
  q = q_ref[...]
  qpos_Q1 = (first_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0))
  segq_Q1 = None if segq_ref is None else segq_ref[...][:, None]
  qk_scale = scale * _LOG2E  # exp2 of log2(e)-scaled logits: the GPU's native exponential

  def step(j, carry, masked):
    acc, m_prev, l_prev = carry
    rows = pl.ds(j * block_kv, block_kv)
    s = _dot(q, k_ref[rows, :], (1, 1)) * qk_scale  # [Q, C]
    if masked:
      kpos_1C = j * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
      segk_1C = None if segk_ref is None else segk_ref[rows][None, :]
      s = jnp.where(_visible(qpos_Q1, kpos_1C, st.window, segq_Q1, segk_1C), s, _MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    v = v_ref[rows, :]
    acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_next, l_next

  carry = (jnp.zeros(q.shape, jnp.float32), jnp.full((block_q,), _MASK_VALUE, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  for lo, hi, masked in _kv_ranges(st, first_q, last_q, block_kv):
    carry = lax.fori_loop(lo, hi, functools.partial(step, masked=masked), carry)
  acc, m, l = carry
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = (m + jnp.log2(l)) / _LOG2E


def _dq_kernel(starts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
               st: _Static, scale: float):
  """dq [Q, K] of one q block: the forward's band walk with dS K summed."""
  if st.segments:
    segq_ref, segk_ref, dq_ref = refs
  else:
    (dq_ref,), segq_ref, segk_ref = refs, None, None
  block_q, block_kv = st.blocks.dq.block_q, st.blocks.dq.block_kv
  first_q, last_q = _q_block(st, starts_ref, pl.num_programs(0) - 1 - pl.program_id(0), block_q)
  q, do = q_ref[...], do_ref[...]
  lse_Q1 = (lse_ref[...] * _LOG2E)[:, None]
  delta_Q1 = delta_ref[...][:, None]
  qpos_Q1 = first_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
  segq_Q1 = None if segq_ref is None else segq_ref[...][:, None]

  def step(j, dq, masked):
    rows = pl.ds(j * block_kv, block_kv)
    k, v = k_ref[rows, :], v_ref[rows, :]
    p = jnp.exp2(_dot(q, k, (1, 1)) * (scale * _LOG2E) - lse_Q1)
    if masked:
      kpos_1C = j * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
      segk_1C = None if segk_ref is None else segk_ref[rows][None, :]
      p = jnp.where(_visible(qpos_Q1, kpos_1C, st.window, segq_Q1, segk_1C), p, 0.0)
    ds = p * (_dot(do, v, (1, 1)) - delta_Q1)
    return dq + _dot(ds.astype(k.dtype), k)

  dq = jnp.zeros(q.shape, jnp.float32)
  for lo, hi, masked in _kv_ranges(st, first_q, last_q, block_kv):
    dq = lax.fori_loop(lo, hi, functools.partial(step, masked=masked), dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _q_ranges(st: _Static, start, first_k, last_k, block_q: int):
  """[(lo, hi, masked)] ranges of one query chunk's q blocks that see a kv block.

  A q block is visited when its last real row is at or after the kv block's
  first key and (window) its first row is at most W - 1 after the block's
  last key; it needs no mask when every row is at or after the last key and
  (window) its last row at most W - 1 after the first key. Padding rows may
  count as visible: their probabilities are 0 (+inf log-sum-exp).
  """
  real_blocks = -(-st.chunk_len // block_q)  # q blocks holding real rows
  window = st.window
  lo = jnp.minimum(lax.div(jnp.maximum(first_k - start, 0), block_q), real_blocks)
  hi = real_blocks
  if window is not None:
    reach = last_k + window - 1 - start
    hi = jnp.where(reach < 0, 0, jnp.minimum(lax.div(jnp.maximum(reach, 0), block_q) + 1,
                                             real_blocks))
  hi = jnp.maximum(hi, lo)
  if st.segments:
    return [(lo, hi, True)]
  full_lo = jnp.clip(lax.div(jnp.maximum(last_k - start, 0) + block_q - 1, block_q), lo, hi)
  full_hi = hi
  if window is not None:
    room = window + first_k - start - block_q  # the last row's band must reach first_k
    full_hi = jnp.where(room < 0, 0, lax.div(jnp.maximum(room, 0), block_q) + 1)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return [(lo, full_lo, True), (full_lo, full_hi, False), (full_hi, hi, True)]


def _dkv_kernel(starts_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs,
                st: _Static, scale: float, num_chunks: int, group: int):
  """dk, dv [C, K] of one kv block: every q block (of each of the R heads) that sees it.

  q_ref/do_ref: [T, R, K] (the R query heads of this kv head); lse/delta: [R, T].
  """
  if st.segments:
    segq_ref, segk_ref, dk_ref, dv_ref = refs
  else:
    (dk_ref, dv_ref), segq_ref, segk_ref = refs, None, None
  block_q, block_kv = st.blocks.dkv.block_q, st.blocks.dkv.block_kv
  first_k = pl.program_id(0) * block_kv
  last_k = first_k + block_kv - 1
  k, v = k_ref[...], v_ref[...]
  kpos_1C = first_k + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
  segk_1C = None if segk_ref is None else segk_ref[...][None, :]

  def step(i, carry, r, c, start, masked):
    dk, dv = carry
    rows = pl.ds(c * st.chunk_pad + i * block_q, block_q)
    q, do = q_ref[rows, r, :], do_ref[rows, r, :]
    lse_Q1 = (lse_ref[r, rows] * _LOG2E)[:, None]
    p = jnp.exp2(_dot(q, k, (1, 1)) * (scale * _LOG2E) - lse_Q1)
    if masked:
      qpos_Q1 = start + i * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
      segq_Q1 = None if segq_ref is None else segq_ref[rows][:, None]
      p = jnp.where(_visible(qpos_Q1, kpos_1C, st.window, segq_Q1, segk_1C), p, 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    ds = p * (_dot(do, v, (1, 1)) - delta_ref[r, rows][:, None])
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv

  def head(r, carry):
    for c in range(num_chunks):
      start = starts_ref[c]
      for lo, hi, masked in _q_ranges(st, start, first_k, last_k, block_q):
        carry = lax.fori_loop(lo, hi, functools.partial(step, r=r, c=c, start=start,
                                                        masked=masked), carry)
    return carry

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(t: Tiling):
  if TRITON is None:  # interpreted (the CPU tests) it needs none; lowered, resolve says why
    return None
  return TRITON.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


def _q_major(kernel, tile: Tiling, name: str, st: _Static, starts_M, q, k, v, rows_in, stats_in,
             segs, out_shape):
  """A pallas_call over grid (q blocks, B, H): q and `rows_in` [B, T, H, K] by q block (late
  blocks first, as the kernels count them), k/v whole per kv head, `stats_in` [B, H, T]."""
  b, t, h, kd = q.shape
  s, g = k.shape[1:3]
  rep, nq = h // g, t // tile.block_q
  rows = lambda: pl.BlockSpec((None, tile.block_q, None, kd),
                              lambda i, bi, hi: (bi, nq - 1 - i, hi, 0))
  full = lambda: pl.BlockSpec((None, s, None, kd), lambda i, bi, hi: (bi, 0, hi // rep, 0))
  stat = lambda: pl.BlockSpec((None, None, tile.block_q), lambda i, bi, hi: (bi, hi, nq - 1 - i))
  in_specs = [pl.BlockSpec(starts_M.shape, lambda *_: (0,)), rows(), full(), full(),
              *(rows() for _ in rows_in), *(stat() for _ in stats_in)]
  args = [starts_M, q, k, v, *rows_in, *stats_in]
  if st.segments:
    in_specs += [pl.BlockSpec((None, tile.block_q), lambda i, bi, hi: (bi, nq - 1 - i)),
                 pl.BlockSpec((None, s), lambda i, bi, hi: (bi, 0))]
    args += list(segs)
  out_specs = [rows(), stat()] if isinstance(out_shape, list) else rows()
  return pl.pallas_call(
      functools.partial(kernel, st=st, scale=kd ** -0.5), grid=(nq, b, h), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, compiler_params=_params(tile),
      interpret=st.interpret, name=name)(*args)


def _forward(q, k, v, starts_M, segs, st: _Static):
  b, t, h, _ = q.shape
  return _q_major(_forward_kernel, st.blocks.forward, 'flash_gpu_forward', st, starts_M, q, k,
                  v, (), (), segs, [jax.ShapeDtypeStruct(q.shape, q.dtype),
                                    jax.ShapeDtypeStruct((b, h, t), jnp.float32)])


def _dq(q, k, v, do, lse_BHT, delta_BHT, starts_M, segs, st: _Static):
  return _q_major(_dq_kernel, st.blocks.dq, 'flash_gpu_dq', st, starts_M, q, k, v, (do,),
                  (lse_BHT, delta_BHT), segs, jax.ShapeDtypeStruct(q.shape, q.dtype))


def _dkv(q, k, v, do, lse_BHT, delta_BHT, starts_M, segs, st: _Static):
  b, t, h, kd = q.shape
  s, g = k.shape[1:3]
  tile = st.blocks.dkv
  rep = h // g
  # The R query heads of kv head gi, as one [T, R, K] block (a free reshape).
  q5, do5 = (x.reshape(b, t, g, rep, kd) for x in (q, do))
  lse4, delta4 = (x.reshape(b, g, rep, t) for x in (lse_BHT, delta_BHT))
  heads = lambda: pl.BlockSpec((None, t, None, rep, kd), lambda j, bi, gi: (bi, 0, gi, 0, 0))
  stat = lambda: pl.BlockSpec((None, None, rep, t), lambda j, bi, gi: (bi, gi, 0, 0))
  kv = lambda: pl.BlockSpec((None, tile.block_kv, None, kd), lambda j, bi, gi: (bi, j, gi, 0))
  in_specs = [pl.BlockSpec(starts_M.shape, lambda *_: (0,)), heads(), kv(), kv(), heads(),
              stat(), stat()]
  args = [starts_M, q5, k, v, do5, lse4, delta4]
  if st.segments:
    in_specs += [pl.BlockSpec((None, t), lambda j, bi, gi: (bi, 0)),
                 pl.BlockSpec((None, tile.block_kv), lambda j, bi, gi: (bi, j))]
    args += list(segs)
  return pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, scale=kd ** -0.5, num_chunks=starts_M.shape[0],
                        group=rep),
      grid=(s // tile.block_kv, b, g), in_specs=in_specs, out_specs=[kv(), kv()],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_params(tile), interpret=st.interpret, name='flash_gpu_dkv',
  )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, starts_M, segs, st: _Static):
  return _flash_fwd(q, k, v, starts_M, segs, st)[0]


def _flash_fwd(q, k, v, starts_M, segs, st: _Static):
  o, lse_BHT = _forward(q, k, v, starts_M, segs, st)
  if st.residual_names:  # a remat policy that keeps both skips this kernel's recomputation
    o = checkpoint_name(o, st.residual_names[0])
    lse_BHT = checkpoint_name(lse_BHT, st.residual_names[1])
  return o, (q, k, v, starts_M, segs, o, lse_BHT)


def _flash_bwd(st: _Static, residuals, do):
  q, k, v, starts_M, segs, o, lse_BHT = residuals
  # D_i = sum_k dO_ik O_ik (= sum_j P_ij dP_ij), once here in float32.
  delta_BHT = jnp.einsum('bthk,bthk->bht', o.astype(jnp.float32), do.astype(jnp.float32))
  # Padding rows: +inf log-sum-exp makes their probabilities exactly 0 in both kernels.
  real_T = np.tile(np.arange(st.chunk_pad) < st.chunk_len, q.shape[1] // st.chunk_pad)
  lse_BHT = jnp.where(real_T[None, None], lse_BHT, jnp.inf)
  dq = _dq(q, k, v, do, lse_BHT, delta_BHT, starts_M, segs, st)
  dk, dv = _dkv(q, k, v, do, lse_BHT, delta_BHT, starts_M, segs, st)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _shrink(blocks: GpuBlockSizes, rows: int, keys: int) -> GpuBlockSizes:
  """Blocks no larger than the (power-of-two rounded) rows and keys, at least 16."""
  cap = lambda x, n: max(16, min(x, 1 << max(0, n - 1).bit_length()))
  return GpuBlockSizes(*(t._replace(block_q=cap(t.block_q, rows), block_kv=cap(t.block_kv, keys))
                         for t in blocks))


def _check(q, k, v, window, segment_ids_BS) -> None:
  attention_args.check_inputs('flash_attention_gpu', q, k, v, window, segment_ids_BS)
  kd = q.shape[3]
  if kd not in HEAD_DIMS:
    raise ValueError(f'flash_attention_gpu: head_dim={kd} is not one of {HEAD_DIMS}; use '
                     'attention_impl=xla.')


def flash_attention_gpu(q_BTHK, k_BSGK, v_BSGK, *, window: int | None = None,
                        segment_ids_BT=None, q_offset: int = 0, q_chunk_starts=None,
                        q_chunk_row=0, block_sizes: GpuBlockSizes | None = None,
                        interpret: bool = False,
                        residual_names: tuple[str, str] | None = None):
  """Causal (windowed, segmented) GQA attention on a GPU, or in Pallas' interpreter.

  The arguments are kernels.flash_attention's (the TPU kernel), so the two are
  interchangeable: queries [B, T, H, K], keys/values [B, S, G, K], head_dim
  in HEAD_DIMS; segment ids [B, S], one per key position (a query reads the
  id of its own position); q_offset places the queries at positions
  q_offset, ...; q_chunk_starts ([rows][chunks], static) with q_chunk_row (an
  int or a traced scalar) places M equal chunks instead. block_sizes: None for
  the Hopper table (TEST_BLOCKS when interpreting). residual_names:
  checkpoint names of the output and the float32 log-sum-exp [B, H, T].

  Returns [B, T, H, K] in q's dtype: float32 softmax and accumulation, scale
  K ** -0.5. Keys no query sees get zero gradients.
  """
  _check(q_BTHK, k_BSGK, v_BSGK, window, segment_ids_BT)
  b, t, h, kd = q_BTHK.shape
  s = k_BSGK.shape[1]
  table = attention_args.query_starts('flash_attention_gpu', t, s, q_offset,
                                      q_chunk_starts).astype(np.int32)
  chunks, chunk_len = table.shape[1], t // table.shape[1]
  blocks = _shrink(block_sizes or default_block_sizes(kd, bool(interpret)), chunk_len, s)
  # Pad each chunk to whole q blocks and the keys to whole kv blocks (the largest of the
  # three kernels': all powers of two, so each kernel's blocks divide them too). Padded
  # keys lie after every real query's position; padded rows are cut off below.
  chunk_pad = _round_up(chunk_len, max(x.block_q for x in blocks))
  s_pad = _round_up(s, max(x.block_kv for x in blocks))
  st = _Static(window=None if window is None else int(window), chunk_len=chunk_len,
               chunk_pad=chunk_pad, blocks=blocks, segments=segment_ids_BT is not None,
               interpret=bool(interpret),
               residual_names=None if residual_names is None else tuple(residual_names))
  starts_M = jnp.asarray(table[0]) if len(table) == 1 else jnp.asarray(table)[q_chunk_row]

  def chunked(x):  # [B, T, ...] -> [B, M * N, ...]
    x = x.reshape(b, chunks, chunk_len, *x.shape[2:])
    x = jnp.pad(x, [(0, 0), (0, 0), (0, chunk_pad - chunk_len)] + [(0, 0)] * (x.ndim - 3))
    return x.reshape(b, chunks * chunk_pad, *x.shape[3:])
  pad_keys = [(0, 0), (0, s_pad - s), (0, 0), (0, 0)]
  q = chunked(q_BTHK)
  k, v = jnp.pad(k_BSGK, pad_keys), jnp.pad(v_BSGK, pad_keys)
  segs = None
  if segment_ids_BT is not None:
    seg_BS = segment_ids_BT.astype(jnp.int32)
    pos_MN = starts_M[:, None] + jnp.arange(chunk_pad, dtype=jnp.int32)[None]
    seg_q = jnp.take(seg_BS, jnp.minimum(pos_MN.reshape(-1), s - 1), axis=1)
    segs = (seg_q, jnp.pad(seg_BS, [(0, 0), (0, s_pad - s)], constant_values=-1))
  o = _flash(q, k, v, starts_M, segs, st)
  return o.reshape(b, chunks, chunk_pad, h, kd)[:, :, :chunk_len].reshape(b, t, h, kd)


# --- The cases the CPU tests and the GPU device check share ----------------------------


def check_cases() -> list[tuple[str, dict[str, Any]]]:
  """(name, case) pairs: each case's keys are case_inputs' keyword arguments.

  Window edges against TEST_BLOCKS' 32 rows (window = block +- 1, 1),
  segment boundaries (mid-block starts, a one-token document), GQA 4:2 and
  4:1, queries at an offset and in zig-zag chunks, head_dim 64/128/256, and
  sequences that are not a multiple of the block.
  """
  base = dict(batch=1, seq_len=128, heads=2, kv_heads=1, head_dim=64, window=None,
              docs=None, q_offset=0, q_len=None, chunk_starts=None)
  cases = [
      ('causal_gqa_4_1', dict(heads=4, kv_heads=1)),
      ('window_1', dict(window=1)),
      ('window_block_minus_1_gqa_4_2', dict(heads=4, kv_heads=2, window=31)),
      ('window_block', dict(window=32)),
      ('window_block_plus_1_segments', dict(window=33, docs=((45, 1, 82),))),
      ('segments_mid_block', dict(batch=2, docs=((20, 1, 50, 57), (77, 51)))),
      ('head_dim_128_ragged_window', dict(head_dim=128, seq_len=100, window=45)),
      ('q_offset', dict(seq_len=160, q_offset=70, window=48, docs=((60, 100),))),
      ('q_offset_causal_ragged', dict(seq_len=150, q_offset=37)),
      ('zigzag_chunks', dict(chunk_starts=((0, 96), (32, 64)), window=40, docs=((50, 78),))),
      ('head_dim_256_segments', dict(head_dim=256, seq_len=96, docs=((31, 65),))),
  ]
  return [(name, {**base, **over}) for name, over in cases]


def case_inputs(case: dict[str, Any], dtype=jnp.float32, seed: int = 0):
  """(q, k, v, cotangent, segment_ids or None, kernel kwargs, query positions [T]) of a case.

  Keys are all seq_len positions; the queries are q_len rows at q_offset (or,
  with chunk_starts, row 1 of that table: the second device's chunks).
  """
  b, s, h, g, kd = (case[x] for x in ('batch', 'seq_len', 'heads', 'kv_heads', 'head_dim'))
  kwargs: dict[str, Any] = dict(window=case['window'])
  if case['chunk_starts'] is not None:
    starts = case['chunk_starts']
    chunk = s // (2 * len(starts))
    positions = np.concatenate([np.arange(x, x + chunk) for x in starts[1]])
    kwargs.update(q_chunk_starts=starts, q_chunk_row=jnp.int32(1))
  else:
    t = case['q_len'] or s - case['q_offset']
    positions = case['q_offset'] + np.arange(t)
    kwargs.update(q_offset=case['q_offset'])
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, len(positions), h, kd), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, s, g, kd), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, g, kd), jnp.float32).astype(dtype)
  do = jax.random.normal(kc, q.shape, jnp.float32).astype(dtype)
  seg = None
  if case['docs'] is not None:
    seg = jnp.asarray([np.repeat(np.arange(len(d)), d) for d in case['docs']], jnp.int32)
    seg = jnp.broadcast_to(seg, (b, s)) if seg.shape[0] == 1 else seg
  return q, k, v, do, seg, kwargs, positions


def case_errors(case: dict[str, Any], reference, dtype=jnp.float32, interpret: bool = False,
                block_sizes: GpuBlockSizes | None = TEST_BLOCKS, seed: int = 0
                ) -> dict[str, float]:
  """max |kernel - reference| / max(max |reference|, 1) of the output and dq, dk, dv.

  `reference(q, k, v, window=, segment_ids_BT=)` is self-attention over all
  seq_len positions (model.reference_attention; kernels/ imports nothing of the
  model): its queries are the case's queries placed at their positions, zeros
  elsewhere, computed in float32 (matmuls at full precision, not TF32) from
  the same dtype-rounded inputs. block_sizes: the kernel's (default the blocks
  the cases' edges are placed against; None: the Hopper table).
  """
  q, k, v, do, seg, kwargs, pos = case_inputs(case, dtype, seed)
  s = k.shape[1]

  def ours(q, k, v):
    return flash_attention_gpu(q, k, v, segment_ids_BT=seg, interpret=interpret,
                               block_sizes=block_sizes, **kwargs)

  def theirs(q, k, v):
    q_full = jnp.zeros((q.shape[0], s, *q.shape[2:]), jnp.float32).at[:, pos].set(q)
    return reference(q_full, k, v, window=case['window'], segment_ids_BT=seg)[:, pos]

  def run(fn, *args):  # output and (dq, dk, dv) for the cotangent `do`, in one program
    out, vjp = jax.vjp(fn, *args)
    return (out, *vjp(do.astype(out.dtype)))

  got_all = jax.jit(functools.partial(run, ours))(q, k, v)
  with jax.default_matmul_precision('highest'):  # a GPU's XLA would otherwise use TF32
    want_all = jax.jit(functools.partial(run, theirs))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
  errors = {}
  for name, got, want in zip(('out', 'dq', 'dk', 'dv'), got_all, want_all):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # Relative to the reference's largest entry, or to 1 where that is smaller (window 1's
    # dq and dk are exactly 0: a query that sees one key has a constant softmax).
    errors[name] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1.0))
  return errors
