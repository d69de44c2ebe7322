"""Flash attention for TPU (Pallas/Mosaic): causal, sliding window, GQA, segments.

The public entry point is `flash_attention`; the Pallas kernels live in
`kernels/flash_kernels.py`. This file holds what decides *which* work the
kernels do: the per-chip block-size table, the block schedule that skips kv
blocks outside the causal/window band, the `custom_vjp` that ties the forward
and backward kernels together (model.reference_attention is the equation they compute).

Shape glossary:
  B batch, T query time, S key time (T == S in self-attention; otherwise the
  queries are a slice or chunks of the keys' sequence), H query heads,
  G kv heads (H % G == 0), R = H // G query heads per kv head, K head_dim,
  X = H*K and Y = G*K (heads merged into the last axis for the kernels),
  N key time padded to whole blocks, P visited (q block, kv block) pairs of
  the schedule, V rows of a query-chunk table (one per context-parallel device).

Mask: a query at position i sees the key at position j iff j <= i, and
i - j < window when a window is given (W keys including itself;
docs/architecture.md), and segment_ids[i] == segment_ids[j] when segment ids
are given (document masking).
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from kernels import attention_args
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
#   v6e and 512 elsewhere (v5e measured fastest at 1024 all the same). Q also
#   sets the window band's waste: a q block of Q rows spans W + Q keys for W
#   keys of work per row, so at W=4096 Q=512 visits ~11% masked-out entries
#   and Q=1024 ~20%.
# - C (block_kv) = 512 amortises the ~0.35us fixed cost of a grid step over
#   0.27-1 GFLOP and divides T=8192 and W=4096 evenly.
# - head_dim 256 doubles the q/k/v/accumulator tiles but not the f32 [Q, C]
#   logits tiles, so the same blocks fit: the largest entry (Q=1024, C=512,
#   K=256) needs about 16 MiB of VMEM in the backward (four f32 [Q, C]
#   temporaries 8 MiB, double-buffered q/do/k/v 3 MiB, accumulators and
#   outputs 2 MiB, segment-id tiles 1 MiB), under _VMEM_LIMIT_BYTES below;
#   v5e's Q=C=1024 about 28 MiB.
# - v5e's entries are measured (forward + backward on the chip, where training
#   spends its time; 1024 x 1024 beat 512 x 512 with the two-kernel backward,
#   and with the fused one it leads splash attention 1.19-1.24x); the other
#   chips' are reasoned from the figures above and checked to compile by Mosaic
#   (tests/test_tpu_compile.py), not timed.
# - 'interpret' is used off-TPU (CPU tests in interpret mode): the smallest
#   legal blocks, so short test sequences still span several blocks.
_BLOCK_TABLE: dict[tuple[str, int], BlockSizes] = {
    ('v4', 128): BlockSizes(512, 512),
    ('v4', 256): BlockSizes(512, 512),
    ('v5e', 128): BlockSizes(1024, 1024),  # measured on a v5e: docs/results/kernels.md
    ('v5e', 256): BlockSizes(1024, 1024),
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
    'v4': 14 << 20,  # 16 MiB per core: Q=C=512 at K=256 needs about 10 MiB (see above)
    'v5e': 64 << 20,
    'v5p': 32 << 20,
    'v6e': 64 << 20,
    '7x': 32 << 20,
}

# What the interpreter (CPU tests) plays by when deciding whether the backward fuses.
_INTERPRET_VMEM_BYTES = 64 << 20

# Abstract-device descriptions of the table's chips (device_kind, TensorCores
# per jax device), used to lower the kernels for a chip without having one.
TPU_DEVICE_KINDS: dict[str, tuple[str, int]] = {
    'v4': ('TPU v4', 2),  # megacore, as v5p
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
#
# Keys sit at positions 0, 1, ... of one sequence. Queries are that sequence's
# rows too, but not necessarily all of them from 0: a query offset (the last
# rows of a key buffer), or several chunks at given starts (context
# parallelism's zig-zag: a device's two chunks against the whole sequence's
# keys). Each chunk is padded to whole q blocks; q block i of chunk c covers
# positions starts[c] + i*Q ..., and only its real rows decide what it visits.

def _q_block_positions(block_q: int, q_starts, q_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(first, last real) key position of every q block, chunk after chunk."""
  starts_C1 = np.asarray(q_starts, np.int64).reshape(-1, 1)
  first_CN = starts_C1 + np.arange(-(-q_len // block_q))[None] * block_q
  last_CN = np.minimum(first_CN + block_q, starts_C1 + q_len) - 1
  return first_CN.reshape(-1), last_CN.reshape(-1)


def _pair_is_visible(first_q, last_q, first_k, last_k, window: int | None):
  """Whether a q block and a kv block share any (query, key) inside the band."""
  vis = first_k <= last_q  # else the kv block is in every query's future
  if window is not None:  # the oldest query's band starts at first_q - window + 1
    vis &= last_k > first_q - window
  return vis


def _pair_is_full(first_q, last_q, first_k, last_k, window: int | None):
  """Whether every (query, key) of the pair is visible, so no mask is needed."""
  full = last_k <= first_q
  if window is not None:
    full &= last_q - first_k < window
  return full


def block_schedule(seq_len: int, block_q: int, block_kv: int, window: int | None,
                   *, kv_major: bool = False, q_offset=0, q_len: int | None = None
                   ) -> np.ndarray:
  """The visited (q block, kv block) pairs and their flags, as int32 [3, P].

  Rows: q block index, kv block index, flags (flash_kernels.FIRST/LAST/MASKED).
  Pairs are ordered by q block then kv block (forward, dq), or by kv block then
  q block when kv_major (dk/dv); FIRST/LAST mark where a run sharing the outer
  block starts and ends, i.e. where an accumulator is reset and written out.

  seq_len keys (a multiple of block_kv) at positions 0..seq_len-1. The queries
  are, by default, the same rows (self-attention). With `q_offset` an int, they
  are the q_len rows (default seq_len - q_offset) at positions q_offset, ...;
  with `q_offset` a sequence of chunk starts, they are len(q_offset) chunks of
  q_len rows, chunk c at positions q_offset[c], ..., each padded to whole q
  blocks (q block c * ceil(q_len / block_q) + i is chunk c's block i).
  """
  starts = np.atleast_1d(np.asarray(q_offset, np.int64))
  if q_len is None:
    if starts.size != 1:
      raise ValueError('block_schedule: q_len is required with several query chunks.')
    q_len = seq_len - int(starts[0])
  first_q, last_q = _q_block_positions(block_q, starts, q_len)
  qblk, kvblk = np.meshgrid(np.arange(first_q.size), np.arange(seq_len // block_kv),
                            indexing='ij')
  if kv_major:
    qblk, kvblk = qblk.T, kvblk.T
  first_k = kvblk * block_kv
  keep = _pair_is_visible(first_q[qblk], last_q[qblk], first_k, first_k + block_kv - 1, window)
  i_P, j_P = qblk[keep], kvblk[keep]  # row-major: outer block, then inner
  outer_P = j_P if kv_major else i_P
  starts_P = np.r_[True, outer_P[1:] != outer_P[:-1]]
  ends_P = np.r_[outer_P[1:] != outer_P[:-1], True]
  full_P = _pair_is_full(first_q[i_P], last_q[i_P], j_P * block_kv,
                         (j_P + 1) * block_kv - 1, window)
  flags_P = (flash_kernels.FIRST * starts_P + flash_kernels.LAST * ends_P +
             flash_kernels.MASKED * ~full_P)
  return np.stack([i_P, j_P, flags_P]).astype(np.int32)


def kv_block_visits(seq_len: int, block_q: int, block_kv: int,
                    window: int | None, *, q_offset=0, q_len: int | None = None) -> int:
  """Kernel grid steps per (batch, head) for one attention layer's forward.

  `q_offset` / `q_len` place the queries as in `block_schedule`.
  """
  return block_schedule(seq_len, block_q, block_kv, window, q_offset=q_offset,
                        q_len=q_len).shape[1]


@functools.lru_cache(maxsize=256)
def _schedule_tables(seq_len: int, block_q: int, block_kv: int, window: int | None,
                     starts_VC: tuple[tuple[int, ...], ...], q_len: int):
  """The kernels' schedules for every row v of starts_VC (one per device), padded alike.

  Returns (q-major [V, 4, P], kv-major [V, 4, P'], kv blocks visited [V, N] bool).
  Row 3 is the key position of the pair's q block's first row (the mask's
  origin). A row with fewer pairs than the longest repeats its last pair
  flagged SKIP: the grid is static, so it takes a step that does nothing and,
  with unchanged block indices, moves no data.
  """
  tables = ([], [])
  visited = []
  for starts in starts_VC:
    first_q, _ = _q_block_positions(block_q, starts, q_len)
    for kv_major, table in zip((False, True), tables):
      sched = block_schedule(seq_len, block_q, block_kv, window, kv_major=kv_major,
                             q_offset=starts, q_len=q_len)
      table.append(np.concatenate([sched, first_q[sched[0]][None].astype(np.int32)]))
    visited.append(np.isin(np.arange(seq_len // block_kv), tables[1][-1][1]))

  def pad(table):
    longest = max(x.shape[1] for x in table)
    out = np.repeat(np.stack([x[:, -1:] for x in table]), longest, axis=2)
    out[:, 2] = flash_kernels.SKIP
    for v, x in enumerate(table):
      out[v, :, :x.shape[1]] = x
    return out
  return pad(tables[0]), pad(tables[1]), np.stack(visited)


# ----------------------------------------------------------------------------
# custom_vjp around the kernels. Arrays here are [B, T, H*K] / [B, N, G*K]:
# the model's [B, T, H, K] with the last two axes merged (a free reshape), so
# a head is a K-wide column block and no transpose to [B, H, T, K] is needed.
# T counts query rows (chunks padded to whole blocks), N key rows.

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
  fuse_backward: bool  # one backward kernel for dq, dk, dv (flash_kernels.backward_dkv)
  residual_names: tuple[str, str] | None = None  # checkpoint names of (o, lse)

  def kernel_args(self) -> dict[str, Any]:
    return dict(num_heads=self.num_heads,
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q_BTX, k_BNY, v_BNY, segments, plan, st: _Static):
  return _flash_fwd(q_BTX, k_BNY, v_BNY, segments, plan, st)[0]


def _flash_fwd(q_BTX, k_BNY, v_BNY, segments, plan, st: _Static):
  """segments: (query ids [B, T], key ids [B, N]) or None; plan: (q-major schedule,
  kv-major schedule, kv rows any pair visits [N] bool or None)."""
  seg_q, seg_k = (None, None) if segments is None else map(_segment_layouts, segments)
  o_BTX, lse_BHT = flash_kernels.forward(
      q_BTX, k_BNY, v_BNY, None if segments is None else (seg_q[0], seg_k[1]),
      schedule=plan[0], **st.kernel_args())
  if st.residual_names:  # a remat policy may keep these and skip this kernel's recomputation
    o_BTX = checkpoint_name(o_BTX, st.residual_names[0])
    lse_BHT = checkpoint_name(lse_BHT, st.residual_names[1])
  return o_BTX, (q_BTX, k_BNY, v_BNY, segments, plan, o_BTX, lse_BHT)


def _flash_bwd(st: _Static, residuals, do_BTX):
  q_BTX, k_BNY, v_BNY, segments, plan, o_BTX, lse_BHT = residuals
  b, t, _ = q_BTX.shape
  h, k = st.num_heads, st.head_dim
  # D_i = sum_k dO_ik O_ik = sum_j P_ij dP_ij: the softmax-backward row term,
  # computed once here in f32 rather than per kv block inside the kernels.
  di_BTH = jnp.einsum('bthk,bthk->bth',
                      o_BTX.reshape(b, t, h, k).astype(jnp.float32),
                      do_BTX.reshape(b, t, h, k).astype(jnp.float32))
  di_BHT = di_BTH.transpose(0, 2, 1)
  seg_q, seg_k = (None, None) if segments is None else map(_segment_layouts, segments)
  dkv_segments = None if segments is None else (seg_k[0], seg_q[1])
  if st.fuse_backward:
    dk_BNY, dv_BNY, dq_BTX = flash_kernels.backward_dkv(
        q_BTX, k_BNY, v_BNY, do_BTX, lse_BHT, di_BHT, dkv_segments, schedule=plan[1],
        with_dq=True, **st.kernel_args())
  else:
    dq_BTX = flash_kernels.backward_dq(
        q_BTX, k_BNY, v_BNY, do_BTX, lse_BHT, di_BHT,
        None if segments is None else (seg_q[0], seg_k[1]), schedule=plan[0],
        **st.kernel_args())
    dk_BNY, dv_BNY = flash_kernels.backward_dkv(
        q_BTX, k_BNY, v_BNY, do_BTX, lse_BHT, di_BHT, dkv_segments, schedule=plan[1],
        **st.kernel_args())
  if plan[2] is not None:  # keys no query sees: their kv blocks were never written
    keep_N1 = plan[2][:, None]
    dk_BNY, dv_BNY = (jnp.where(keep_N1, x, jnp.zeros((), x.dtype)) for x in (dk_BNY, dv_BNY))
  return dq_BTX, dk_BNY, dv_BNY, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _check_inputs(q_BTHK, k_BSGK, v_BSGK, window, segment_ids_BS, block_q,
                  block_kv) -> None:
  attention_args.check_inputs('flash_attention', q_BTHK, k_BSGK, v_BSGK, window,
                              segment_ids_BS)
  k = q_BTHK.shape[3]
  if k % flash_kernels.LANES:
    raise ValueError(
        f'flash_attention: head_dim={k} must be a multiple of'
        f' {flash_kernels.LANES} (TPU lane width); use attention_impl=xla.')
  for name, blk in (('block_q', block_q), ('block_kv', block_kv)):
    if blk is not None and (blk < flash_kernels.LANES or blk % flash_kernels.LANES):
      raise ValueError(
          f'flash_attention: {name}={blk} must be a positive multiple of'
          f' {flash_kernels.LANES} (Mosaic tiling); fix'
          f' cfg.model.attention_{name}.')


def flash_attention(q_BTHK, k_BSGK, v_BSGK, *, window: int | None = None,
                    segment_ids_BT=None, block_q: int | None = None,
                    block_kv: int | None = None, interpret: Any = False,
                    q_offset: int = 0, q_chunk_starts=None, q_chunk_row=0,
                    fuse_backward: bool | None = None,
                    residual_names: tuple[str, str] | None = None):
  """Causal (optionally windowed, segmented) GQA attention via Pallas TPU kernels.

  Keys sit at positions 0..S-1 of a sequence; each query has a position in
  it too: by default query i is position i (self-attention, T == S).

  Args:
    q_BTHK: queries [B, T, H, K]; K a multiple of 128.
    k_BSGK: keys [B, S, G, K]; query head h reads kv head h // (H // G).
    v_BSGK: values [B, S, G, K].
    window: a query at position i sees keys j with i - window < j <= i;
      None: all j <= i.
    segment_ids_BT: optional int [B, S], one id per key position; a query
      reads the id of its own position and attends only within equal ids.
    block_q: rows per q block (multiple of 128); None: the chip's table entry.
    block_kv: rows per kv block (multiple of 128); None: the table entry.
    interpret: False on TPU; True or pltpu.InterpretParams() to run on CPU.
    q_offset: query i is position q_offset + i (e.g. the last T of S keys).
    q_chunk_starts: a static [V][C] table of ints instead of q_offset: the T
      queries are C equal chunks, chunk c at positions q_chunk_starts[v][c] +
      0, 1, ... with v = q_chunk_row (context parallelism's zig-zag: one row
      per device).
    q_chunk_row: an int or a traced int32 scalar picking the row (e.g. the
      device's index on a mesh axis).
    fuse_backward: one backward kernel computes dq, dk and dv (s and p once
      per block pair) with dq summed in VMEM; False: separate dq and dk/dv
      kernels; None: fused where its [R, T, K] dq buffer fits a third of the
      chip's scoped VMEM (every 7B shape at T = 8,192; not the long-context
      stage's 65,536).
    residual_names: checkpoint names for the output and the float32
      log-sum-exp [B, H, T] the backward reads: a remat policy that saves
      both keeps the forward kernel out of the recomputation.

  Only the (q block, kv block) pairs inside the causal/window band of the
  queries' positions are visited, so a query chunk costs what its own band
  costs. Keys no query sees get zero gradients.

  Returns:
    [B, T, H, K] in q's dtype; softmax scale K**-0.5, f32 softmax statistics
    and f32 matmul accumulation.
  """
  _check_inputs(q_BTHK, k_BSGK, v_BSGK, window, segment_ids_BT, block_q, block_kv)
  b, t, h, k = q_BTHK.shape
  s, g = k_BSGK.shape[1:3]
  starts_VC = tuple(tuple(int(x) for x in row) for row in attention_args.query_starts(
      'flash_attention', t, s, q_offset, q_chunk_starts))
  chunks, chunk_len = len(starts_VC[0]), t // len(starts_VC[0])
  chip = _current_chip()
  if block_q is None or block_kv is None:
    table = default_block_sizes(chip, k)
    block_q = block_q or table.block_q
    block_kv = block_kv or table.block_kv
  # Short sequences shrink the blocks; ragged ones are padded at the end (each
  # query chunk to whole q blocks, the keys to whole kv blocks). Padded keys
  # lie in every real query's future, so causality hides them; padded query
  # rows visit nothing of their own and are cut off (zero cotangent).
  block_q = min(block_q, _round_up(chunk_len, flash_kernels.LANES))
  block_kv = min(block_kv, _round_up(s, flash_kernels.LANES))
  chunk_pad, s_pad = _round_up(chunk_len, block_q), _round_up(s, block_kv)
  vmem_limit = _VMEM_LIMIT_BYTES.get(chip)
  if fuse_backward is None:
    fuse_backward = flash_kernels.fused_dq_vmem_bytes(
        chunks * chunk_pad, h // g, k, q_BTHK.dtype.itemsize) <= (
            vmem_limit or _INTERPRET_VMEM_BYTES) // 3
  st = _Static(num_heads=h, num_kv_heads=g, head_dim=k,
               window=None if window is None else int(window),
               block_q=block_q, block_kv=block_kv, vmem_limit_bytes=vmem_limit,
               interpret=interpret, fuse_backward=bool(fuse_backward),
               residual_names=None if residual_names is None else tuple(residual_names))
  fwd_VSP, dkv_VSP, visited_VN = _schedule_tables(s_pad, block_q, block_kv, st.window,
                                                  starts_VC, chunk_len)
  pick = lambda x: jnp.asarray(x[0]) if len(x) == 1 else jnp.asarray(x)[q_chunk_row]
  self_attention = starts_VC == ((0,),) and t == s
  visited_N = None
  if not self_attention:  # keys after every query's position are never visited
    visited_N = jnp.repeat(pick(visited_VN), block_kv)
  plan = (pick(fwd_VSP), pick(dkv_VSP), visited_N)

  def chunked(x_BT, fill=0):  # [B, T, ...] -> chunks padded to chunk_pad rows, concatenated
    x = x_BT.reshape(b, chunks, chunk_len, *x_BT.shape[2:])
    x = jnp.pad(x, [(0, 0), (0, 0), (0, chunk_pad - chunk_len)] + [(0, 0)] * (x.ndim - 3),
                constant_values=fill)
    return x.reshape(b, chunks * chunk_pad, *x.shape[3:])
  pad_keys = ((0, 0), (0, s_pad - s), (0, 0))
  q_BTX = chunked(q_BTHK.reshape(b, t, h * k))
  k_BNY = jnp.pad(k_BSGK.reshape(b, s, g * k), pad_keys)
  v_BNY = jnp.pad(v_BSGK.reshape(b, s, g * k), pad_keys)
  segments = None
  if segment_ids_BT is not None:
    seg_BS = segment_ids_BT.astype(jnp.int32)
    if self_attention:
      seg_q_BT = seg_BS
    else:  # each query reads the id of its position
      row_C = pick(np.asarray(starts_VC, np.int32))
      seg_q_BT = jnp.concatenate(
          [jax.lax.dynamic_slice_in_dim(seg_BS, row_C[c], chunk_len, axis=1)
           for c in range(chunks)], axis=1)
    segments = (chunked(seg_q_BT, -1), jnp.pad(seg_BS, ((0, 0), (0, s_pad - s)),
                                              constant_values=-1))
  o_BTX = _flash(q_BTX, k_BNY, v_BNY, segments, plan, st)
  o = o_BTX.reshape(b, chunks, chunk_pad, h, k)[:, :, :chunk_len]
  return o.reshape(b, t, h, k)
