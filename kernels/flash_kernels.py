"""Pallas TPU kernels of flash attention: forward, dq, and dk/dv (with dq fused in).

Called by kernels/flash_attention.py, which picks block sizes, builds the
block schedule, and decides whether the backward is one kernel (dk/dv with dq
fused in, where dq's [R, T, K] float32 buffer fits VMEM) or two (dq apart).

Every kernel walks a flattened list of visited (q block, kv block) pairs
(`schedule`, int32 [4, P]: q block, kv block, flags, and the key position of
the q block's first row; its rows are scalar-prefetched into SMEM and steer
the BlockSpec index maps and the mask): the grid has
exactly P steps per (head, batch), so kv blocks outside the causal/window band
cost neither a DMA nor an empty grid step. Heads lead the grid because they
are the 'parallel' axis that is always large enough to split across the two
TensorCores of a megacore chip (v5p); the per-device batch is often 1.

Shape glossary:
  B batch, T query time and N key time (padded to whole blocks; the queries
  may be a slice or chunks of the keys' sequence, placed by the schedule's
  position row), H query heads, G kv heads,
  R = H // G, K head_dim, X = H*K, Y = G*K (heads merged into the last axis;
  head h is the K-wide column block h), Q = block_q, C = block_kv,
  P schedule length, L = 128 lanes, S = 8 sublanes.

Layout notes (Mosaic): refs' last two dims are (multiple of 8, multiple of 128).
Per-row softmax statistics live lane-replicated as [Q, L] (the layout Mosaic
broadcasts along lanes cheaply); per-query rows read in the dk/dv kernel,
where queries run along lanes, come in as [S, Q] tiles.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
SUBLANES = 8

# Schedule flag bits (row 2 of the schedule).
FIRST = 1  # first pair of its outer block: reset the accumulators
LAST = 2  # last pair of its outer block: write the outputs
MASKED = 4  # the pair straddles the band's edge: apply the element mask
SKIP = 8  # padding at the end of a schedule shorter than its grid: do nothing

# Finite stand-in for -inf: a fully masked row inside one block then gives
# exp(0) terms that the next block's rescale exp(MASK - m) wipes to exactly 0,
# instead of the NaN of (-inf) - (-inf). Every query sees itself, so each row
# meets a real key eventually.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _dot(a: jax.Array, b: jax.Array, dims) -> jax.Array:
  """a . b accumulated in float32. bf16 operands take the MXU's native pass even under
  jax_default_matmul_precision='highest' (Mosaic refuses an fp32 contract precision on
  bf16 operands: "Bad lhs type", seen on a TPU v5e); float32 operands follow that
  setting, as XLA's own dots do (default: one bf16 pass on a TPU)."""
  precision = jax.lax.Precision.DEFAULT if a.dtype == jnp.bfloat16 else None
  return jax.lax.dot_general(a, b, dims, precision=precision,
                             preferred_element_type=jnp.float32)


def _lanes(x_QL, width: int):
  """Widens a lane-replicated [Q, L] statistic to [Q, width]."""
  return x_QL if width == LANES else jnp.tile(x_QL, (1, width // LANES))


def _visible(q_pos, k_pos, window: int | None):
  """Causal and window mask from broadcast query/key positions."""
  vis = k_pos <= q_pos
  if window is not None:
    vis = jnp.logical_and(vis, q_pos - k_pos < window)
  return vis


def _mask(s_RC, row_start, col_start, window: int | None, segments=None,
          keys_on_rows: bool = False):
  """Logits of one block with invisible (query, key) entries set to _MASK_VALUE.

  Rows are queries and columns keys, or the reverse with keys_on_rows (the
  dk/dv kernel's transposed logits). `segments` is (row ids as a [R, LANES]
  block, column ids as a [SUBLANES, C] block) or None.
  """
  shape = s_RC.shape
  row_pos = row_start + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  col_pos = col_start + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  q_pos, k_pos = (col_pos, row_pos) if keys_on_rows else (row_pos, col_pos)
  vis = _visible(q_pos, k_pos, window)
  if segments is not None:
    rows_ref, cols_ref = segments
    vis = jnp.logical_and(vis, _lanes(rows_ref[...], shape[1]) == cols_ref[:1, :])
  return jnp.where(vis, s_RC, _MASK_VALUE)


def _compiler_params(dims, vmem_limit_bytes):
  return pltpu.CompilerParams(dimension_semantics=dims,
                              vmem_limit_bytes=vmem_limit_bytes)


def _run_masked_or_not(flags, has_segments: bool, step):
  """Runs step(masked) once, taking the mask-free path on interior blocks (not at all on SKIP)."""
  live = (flags & SKIP) == 0
  if has_segments:  # document boundaries can fall inside any block
    pl.when(live)(lambda: step(True))
    return
  masked = (flags & MASKED) != 0
  pl.when(jnp.logical_and(live, masked))(lambda: step(True))
  pl.when(jnp.logical_and(live, jnp.logical_not(masked)))(lambda: step(False))


# ----------------------------------------------------------------------------
# Forward: grid (H, B, P), pairs ordered by q block.

def _fwd_kernel(qblk_ref, kblk_ref, flags_ref, qpos_ref, q_ref, k_ref, v_ref, *refs,
                scale, window,
                block_q, block_kv, head_dim, has_segments):
  if has_segments:
    segq_ref, segk_ref, o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  else:
    o_ref, lse_ref, m_scr, l_scr, acc_scr = refs
  p = pl.program_id(2)
  qpos, kj, flags = qpos_ref[p], kblk_ref[p], flags_ref[p]

  @pl.when((flags & FIRST) != 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, _MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def step(masked: bool):
    s_QC = _dot(q_ref[...], k_ref[...], _NT) * scale
    if masked:
      s_QC = _mask(s_QC, qpos, kj * block_kv, window,
                   (segq_ref, segk_ref) if has_segments else None)
    m_prev = m_scr[...]
    m_next = jnp.maximum(m_prev, jnp.max(s_QC, axis=1, keepdims=True))
    p_QC = jnp.exp(s_QC - _lanes(m_next, block_kv))
    alpha = jnp.exp(m_prev - m_next)  # rescales what earlier blocks summed
    l_scr[...] = alpha * l_scr[...] + jnp.sum(p_QC, axis=1, keepdims=True)
    m_scr[...] = m_next
    pv_QK = _dot(p_QC.astype(v_ref.dtype), v_ref[...], _NN)
    acc_scr[...] = acc_scr[...] * _lanes(alpha, head_dim) + pv_QK

  _run_masked_or_not(flags, has_segments, step)

  @pl.when((flags & LAST) != 0)
  def _finish():
    l = l_scr[...]
    o_ref[...] = (acc_scr[...] * _lanes(1.0 / l, head_dim)).astype(o_ref.dtype)
    lse_ref[...] = m_scr[...] + jnp.log(l)


def forward(q_BTX, k_BTY, v_BTY, segments, *, schedule, num_heads, num_kv_heads,
            head_dim, window, block_q, block_kv, vmem_limit_bytes,
            interpret: Any):
  """Returns o [B, T, X] (q's dtype) and the softmax logsumexp [B, H, T] (f32).

  k, v are [B, N, Y]; `segments` is (query ids [B, T, L], key ids [B, S, N]) or None.
  """
  b, t, _ = q_BTX.shape
  h, r, k = num_heads, num_heads // num_kv_heads, head_dim
  num_pairs = schedule.shape[1]
  has_segments = segments is not None

  def q_map(hi, bi, p, qblk, kblk, flags, qpos):
    return bi, qblk[p], hi

  def kv_map(hi, bi, p, qblk, kblk, flags, qpos):
    return bi, kblk[p], hi // r

  in_specs = [
      pl.BlockSpec((None, block_q, k), q_map),
      pl.BlockSpec((None, block_kv, k), kv_map),
      pl.BlockSpec((None, block_kv, k), kv_map),
  ]
  inputs = [q_BTX, k_BTY, v_BTY]
  if has_segments:
    in_specs += [
        pl.BlockSpec((None, block_q, LANES),
                     lambda hi, bi, p, qblk, kblk, fl, qpos: (bi, qblk[p], 0)),
        pl.BlockSpec((None, SUBLANES, block_kv),
                     lambda hi, bi, p, qblk, kblk, fl, qpos: (bi, 0, kblk[p])),
    ]
    inputs += list(segments)
  out_specs = [
      pl.BlockSpec((None, block_q, k), q_map),
      pl.BlockSpec((None, None, block_q, LANES),
                   lambda hi, bi, p, qblk, kblk, fl, qpos: (bi, hi, qblk[p], 0)),
  ]
  out_shape = [
      jax.ShapeDtypeStruct(q_BTX.shape, q_BTX.dtype),
      jax.ShapeDtypeStruct((b, h, t, LANES), jnp.float32),
  ]
  scratch = [pltpu.VMEM((block_q, LANES), jnp.float32),
             pltpu.VMEM((block_q, LANES), jnp.float32),
             pltpu.VMEM((block_q, k), jnp.float32)]
  steps = b * h * num_pairs
  itemsize = q_BTX.dtype.itemsize
  cost = pl.CostEstimate(
      flops=4 * steps * block_q * block_kv * k,
      transcendentals=steps * block_q * block_kv,
      bytes_accessed=steps * 2 * block_kv * k * itemsize + 2 * q_BTX.size * itemsize)
  kernel = functools.partial(
      _fwd_kernel, scale=k**-0.5, window=window, block_q=block_q,
      block_kv=block_kv, head_dim=k, has_segments=has_segments)
  o_BTX, lse_BHTL = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(h, b, num_pairs), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=_compiler_params(
          ('parallel', 'parallel', 'arbitrary'), vmem_limit_bytes),
      cost_estimate=cost,
      interpret=interpret,
      name='flash_attention_fwd',
  )(schedule[0], schedule[1], schedule[2], schedule[3], *inputs)
  return o_BTX, lse_BHTL[..., 0]


# ----------------------------------------------------------------------------
# dq: grid (H, B, P), pairs ordered by q block. Queries run along sublanes, so
# the per-query logsumexp and D arrive as [1, Q] rows and turn into columns.

def _dq_kernel(qblk_ref, kblk_ref, flags_ref, qpos_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, di_ref, *refs, scale, window, block_q, block_kv, has_segments):
  if has_segments:
    segq_ref, segk_ref, dq_ref, dq_scr = refs
  else:
    dq_ref, dq_scr = refs
  p = pl.program_id(2)
  qpos, kj, flags = qpos_ref[p], kblk_ref[p], flags_ref[p]

  @pl.when((flags & FIRST) != 0)
  def _init():
    dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  def step(masked: bool):
    k = k_ref[...]
    s_QC = _dot(q_ref[...], k, _NT) * scale
    if masked:
      s_QC = _mask(s_QC, qpos, kj * block_kv, window,
                   (segq_ref, segk_ref) if has_segments else None)
    p_QC = jnp.exp(s_QC - jnp.expand_dims(lse_ref[0], -1))
    dp_QC = _dot(do_ref[...], v_ref[...], _NT)
    ds_QC = p_QC * (dp_QC - jnp.expand_dims(di_ref[0], -1))
    dq_scr[...] += _dot(ds_QC.astype(k.dtype), k, _NN)

  _run_masked_or_not(flags, has_segments, step)

  @pl.when((flags & LAST) != 0)
  def _finish():
    dq_ref[...] = (dq_scr[...] * scale).astype(dq_ref.dtype)


def backward_dq(q_BTX, k_BTY, v_BTY, do_BTX, lse_BHT, di_BHT, segments, *,
                schedule, num_heads, num_kv_heads, head_dim, window, block_q,
                block_kv, vmem_limit_bytes, interpret: Any):
  """Returns dq [B, T, X] in q's dtype."""
  b = q_BTX.shape[0]
  h, r, k = num_heads, num_heads // num_kv_heads, head_dim
  num_pairs = schedule.shape[1]
  has_segments = segments is not None

  def q_map(hi, bi, p, qblk, kblk, flags, qpos):
    return bi, qblk[p], hi

  def kv_map(hi, bi, p, qblk, kblk, flags, qpos):
    return bi, kblk[p], hi // r

  def stat_map(hi, bi, p, qblk, kblk, flags, qpos):
    return bi, hi, 0, qblk[p]

  in_specs = [
      pl.BlockSpec((None, block_q, k), q_map),
      pl.BlockSpec((None, block_kv, k), kv_map),
      pl.BlockSpec((None, block_kv, k), kv_map),
      pl.BlockSpec((None, block_q, k), q_map),
      pl.BlockSpec((None, None, 1, block_q), stat_map),
      pl.BlockSpec((None, None, 1, block_q), stat_map),
  ]
  inputs = [q_BTX, k_BTY, v_BTY, do_BTX, lse_BHT[:, :, None], di_BHT[:, :, None]]
  if has_segments:
    in_specs += [
        pl.BlockSpec((None, block_q, LANES),
                     lambda hi, bi, p, qblk, kblk, fl, qpos: (bi, qblk[p], 0)),
        pl.BlockSpec((None, SUBLANES, block_kv),
                     lambda hi, bi, p, qblk, kblk, fl, qpos: (bi, 0, kblk[p])),
    ]
    inputs += list(segments)
  steps = b * h * num_pairs
  itemsize = q_BTX.dtype.itemsize
  cost = pl.CostEstimate(
      flops=6 * steps * block_q * block_kv * k,
      transcendentals=steps * block_q * block_kv,
      bytes_accessed=steps * 2 * block_kv * k * itemsize + 3 * q_BTX.size * itemsize)
  kernel = functools.partial(
      _dq_kernel, scale=k**-0.5, window=window, block_q=block_q,
      block_kv=block_kv, has_segments=has_segments)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(h, b, num_pairs), in_specs=in_specs,
          out_specs=pl.BlockSpec((None, block_q, k), q_map),
          scratch_shapes=[pltpu.VMEM((block_q, k), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q_BTX.shape, q_BTX.dtype),
      compiler_params=_compiler_params(
          ('parallel', 'parallel', 'arbitrary'), vmem_limit_bytes),
      cost_estimate=cost,
      interpret=interpret,
      name='flash_attention_dq',
  )(schedule[0], schedule[1], schedule[2], schedule[3], *inputs)


# ----------------------------------------------------------------------------
# dk/dv: grid (G, B, P, R), pairs ordered by kv block, the R query heads that
# share kv head g innermost, so one kv block's accumulators stay in VMEM while
# every (q head, q block) that sees it is summed in. The kernel works on
# transposed logits s^T [C, Q] (keys along sublanes): per-query statistics are
# then [1, Q] rows and every matmul is a plain a @ b or a @ b.T (the fused dq's
# ds^T @ k transposes ds in VMEM first, as splash attention's fused kernel does).

def _dkv_kernel(qblk_ref, kblk_ref, flags_ref, qpos_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, di_ref, *refs, scale, window, block_q, block_kv,
                heads_per_kv, has_segments, with_dq):
  refs = list(refs)
  segk_ref, segq_ref = (refs.pop(0), refs.pop(0)) if has_segments else (None, None)
  if with_dq:
    dk_ref, dv_ref, dq_ref, dk_scr, dv_scr, dq_scr = refs
  else:
    dk_ref, dv_ref, dk_scr, dv_scr = refs
  p, rep = pl.program_id(2), pl.program_id(3)
  qpos, qi, kj, flags = qpos_ref[p], qblk_ref[p], kblk_ref[p], flags_ref[p]

  @pl.when(jnp.logical_and((flags & FIRST) != 0, rep == 0))
  def _init():
    dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
    dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

  if with_dq:  # dq of every query row of this (kv head, sequence) stays in VMEM
    @pl.when(jnp.logical_and(p == 0, rep == 0))
    def _init_dq():
      dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

  def step(masked: bool):
    q, do, k = q_ref[...], do_ref[...], k_ref[...]
    s_CQ = _dot(k, q, _NT) * scale
    if masked:
      s_CQ = _mask(s_CQ, kj * block_kv, qpos, window,
                   (segk_ref, segq_ref) if has_segments else None, keys_on_rows=True)
    p_CQ = jnp.exp(s_CQ - lse_ref[:1, :])
    dv_scr[...] += _dot(p_CQ.astype(do.dtype), do, _NN)
    dp_CQ = _dot(v_ref[...], do, _NT)
    ds_CQ = p_CQ * (dp_CQ - di_ref[:1, :])
    dk_scr[...] += _dot(ds_CQ.astype(q.dtype), q, _NN)
    if with_dq:  # the same ds, transposed: dq needs no second pass over s and p
      rows = pl.ds(pl.multiple_of(qi * block_q, block_q), block_q)
      dq_scr[rep, rows, :] += _dot(ds_CQ.astype(k.dtype).T, k, _NN)

  _run_masked_or_not(flags, has_segments, step)

  @pl.when(jnp.logical_and((flags & LAST) != 0, rep == heads_per_kv - 1))
  def _finish():
    dk_ref[...] = (dk_scr[...] * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)

  if with_dq:
    @pl.when(jnp.logical_and(p == pl.num_programs(2) - 1, rep == heads_per_kv - 1))
    def _finish_dq():
      head_dim = dq_scr.shape[-1]
      for r in range(heads_per_kv):
        dq_ref[:, r * head_dim:(r + 1) * head_dim] = (dq_scr[r] * scale).astype(dq_ref.dtype)


def backward_dkv(q_BTX, k_BTY, v_BTY, do_BTX, lse_BHT, di_BHT, segments, *,
                 schedule, num_heads, num_kv_heads, head_dim, window, block_q,
                 block_kv, vmem_limit_bytes, interpret: Any, with_dq: bool = False):
  """Returns dk, dv [B, N, Y] in k's dtype (and dq [B, T, X], with_dq); schedule kv-major.

  `segments` is (key ids [B, N, L], query ids [B, S, T]) or None. kv blocks
  that no schedule pair visits are not written (the caller zeroes them).
  with_dq fuses backward_dq in: each pair's ds also gives its q block's dq
  share, summed in a float32 [R, T, K] VMEM buffer per (kv head, sequence)
  and written once at the end, so s and p are computed once per pair, not
  twice (5 matmuls and one exp instead of 7 and two). The caller checks that
  the buffer fits VMEM (fused_dq_vmem_bytes).
  """
  b, t, _ = q_BTX.shape
  g, r, k = num_kv_heads, num_heads // num_kv_heads, head_dim
  num_pairs = schedule.shape[1]
  has_segments = segments is not None

  def q_map(gi, bi, p, ri, qblk, kblk, flags, qpos):
    return bi, qblk[p], gi * r + ri

  def kv_map(gi, bi, p, ri, qblk, kblk, flags, qpos):
    return bi, kblk[p], gi

  def stat_map(gi, bi, p, ri, qblk, kblk, flags, qpos):
    return bi, gi * r + ri, 0, qblk[p]

  # Per-query statistics as [B, H, S, T]: sublane-replicated rows.
  stat_shape = (b, num_heads, SUBLANES, t)
  lse_BHST = jax.lax.broadcast_in_dim(lse_BHT, stat_shape, (0, 1, 3))
  di_BHST = jax.lax.broadcast_in_dim(di_BHT, stat_shape, (0, 1, 3))
  in_specs = [
      pl.BlockSpec((None, block_q, k), q_map),
      pl.BlockSpec((None, block_kv, k), kv_map),
      pl.BlockSpec((None, block_kv, k), kv_map),
      pl.BlockSpec((None, block_q, k), q_map),
      pl.BlockSpec((None, None, SUBLANES, block_q), stat_map),
      pl.BlockSpec((None, None, SUBLANES, block_q), stat_map),
  ]
  inputs = [q_BTX, k_BTY, v_BTY, do_BTX, lse_BHST, di_BHST]
  if has_segments:
    seg_col, seg_row = segments
    in_specs += [
        pl.BlockSpec((None, block_kv, LANES),
                     lambda gi, bi, p, ri, qblk, kblk, fl, qpos: (bi, kblk[p], 0)),
        pl.BlockSpec((None, SUBLANES, block_q),
                     lambda gi, bi, p, ri, qblk, kblk, fl, qpos: (bi, 0, qblk[p])),
    ]
    inputs += [seg_col, seg_row]
  steps = b * num_heads * num_pairs
  itemsize = q_BTX.dtype.itemsize
  cost = pl.CostEstimate(
      flops=(10 if with_dq else 8) * steps * block_q * block_kv * k,
      transcendentals=steps * block_q * block_kv,
      bytes_accessed=steps * 2 * block_q * k * itemsize + 4 * k_BTY.size * itemsize
      + (q_BTX.size * itemsize if with_dq else 0))
  kernel = functools.partial(
      _dkv_kernel, scale=k**-0.5, window=window, block_q=block_q,
      block_kv=block_kv, heads_per_kv=r, has_segments=has_segments, with_dq=with_dq)
  dkv_shape = jax.ShapeDtypeStruct(k_BTY.shape, k_BTY.dtype)
  out_specs = [pl.BlockSpec((None, block_kv, k), kv_map),
               pl.BlockSpec((None, block_kv, k), kv_map)]
  out_shape = [dkv_shape, dkv_shape]
  scratch = [pltpu.VMEM((block_kv, k), jnp.float32), pltpu.VMEM((block_kv, k), jnp.float32)]
  if with_dq:  # the R query heads of kv head g are X's columns [g*R*K, (g+1)*R*K)
    out_specs.append(pl.BlockSpec((None, t, r * k),
                                  lambda gi, bi, p, ri, qblk, kblk, fl, qpos: (bi, 0, gi)))
    out_shape.append(jax.ShapeDtypeStruct(q_BTX.shape, q_BTX.dtype))
    scratch.append(pltpu.VMEM((r, t, k), jnp.float32))
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4, grid=(g, b, num_pairs, r), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=_compiler_params(
          ('parallel', 'parallel', 'arbitrary', 'arbitrary'), vmem_limit_bytes),
      cost_estimate=cost,
      interpret=interpret,
      name='flash_attention_dkv',
  )(schedule[0], schedule[1], schedule[2], schedule[3], *inputs)


def fused_dq_vmem_bytes(q_len: int, heads_per_kv: int, head_dim: int, itemsize: int) -> int:
  """VMEM that backward_dkv(with_dq=True) adds: the f32 dq buffer and its double-buffered
  output block, both [R, T, K]."""
  return heads_per_kv * q_len * head_dim * (4 + 2 * itemsize)
