"""Context parallelism: attention over a sequence split across the mesh's 'context' axis.

Everything in a block but attention is per token, so splitting the sequence
over devices only needs attention to see other devices' keys. This is
OLMo-core's `llama3` strategy (all-gather K/V, `head_stride` kv heads at a
time, then local attention of each device's queries against the keys they
need) with a zig-zag placement of the queries (docs/long_context.md says why):

  the sequence is cut into 2C chunks of L = T / (2C) tokens; device r of the
  C context devices holds chunks r and 2C-1-r, so every device has one early
  and one late chunk and the same causal work, whatever the documents.

`to_layout` puts a [B, T] batch into that order (train.py does it before the
model, so activations are sharded as P(rows, 'context')); RoPE positions
travel with the tokens, so the model never sees the reordering.

Per device and per (query chunk c, head group), the xla path and the
planner's stand-in take a buffer of S keys ending at the chunk's last token:
[(c+1)L - S, (c+1)L), front-padded where it starts before 0 (padding keys
carry a segment id no query has). S is static: the chunk's largest possible
causal reach, or L + W - 1 under a window W. The queries are then the
buffer's last L rows:

  'xla'     query blocks against only the keys their band reaches (xla.attend_block)
  stand-in  plan.py's O(S)-memory stand-in with the shapes above

The flash kernels instead take both of a device's chunks at once against the
whole gathered sequence, told where they sit (`PallasLocal.zigzag` on a TPU,
`PallasGpuLocal.zigzag` on a GPU, whose loop bounds come from the same
starts): the TPU kernel's block
schedule, one per device built ahead of time, visits only the kv blocks inside
each chunk's causal/window band, so no padding or earlier rows are computed and
a device's work is 1/C of the unsplit layer's (plus the diagonal blocks).

Shapes: B batch, T sequence, L chunk, S key buffer, H/G query/kv heads, K head_dim.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kernels import xla
from kernels.flash_attention import flash_attention
from kernels.flash_gpu import flash_attention_gpu
from kernels.flash_attention import kv_block_visits

AXIS = 'context'
# Segment id of front padding: no document has it, so no query attends to it.
PAD_SEGMENT = int(np.iinfo(np.int32).min)
LocalAttention = Callable[..., jax.Array]  # (q_BLHK, k_BSGK, v_BSGK, seg_BS, window) -> o_BLHK


def degree(mesh=None) -> int:
  """The context-parallel degree of `mesh` (default: the abstract mesh being traced under)."""
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  if mesh.empty or AXIS not in mesh.axis_names:
    return 1
  return int(mesh.shape[AXIS])


def check_seq_len(seq_len: int, cp: int) -> None:
  if cp > 1 and seq_len % (2 * cp):
    raise ValueError(f'seq_len={seq_len} must be a multiple of 2 x mesh_context = {2 * cp} '
                     '(context parallelism cuts it into that many equal chunks); change '
                     'data.seq_len or train.mesh_context.')


def zigzag_order(seq_len: int, cp: int) -> np.ndarray:
  """Natural positions in layout order: device r's rows are chunks r, then 2cp-1-r."""
  check_seq_len(seq_len, cp)
  chunks = np.arange(seq_len).reshape(2 * cp, -1)
  return chunks[[c for r in range(cp) for c in (r, 2 * cp - 1 - r)]].reshape(-1)


def zigzag_starts(seq_len: int, cp: int) -> tuple[tuple[int, int], ...]:
  """Each device's two chunk starts in natural positions (zigzag_order's table): the
  query-chunk table the flash kernels take (q_chunk_starts)."""
  chunk_len = seq_len // (2 * cp)
  return tuple((r * chunk_len, (2 * cp - 1 - r) * chunk_len) for r in range(cp))


def to_layout(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
  """Reorders the sequence axis of `x` into the zig-zag layout (identity for cp == 1)."""
  return x if cp == 1 else jnp.take(x, zigzag_order(x.shape[axis], cp), axis=axis)


def from_layout(x: jax.Array, cp: int, axis: int = 1) -> jax.Array:
  """Inverse of `to_layout`: back to natural order."""
  return x if cp == 1 else jnp.take(x, np.argsort(zigzag_order(x.shape[axis], cp)), axis=axis)


# --- Local attention: the last L rows of an S-row buffer attend to its keys -------


def xla_local(q_BLHK, k_BSGK, v_BSGK, seg_BS, window: int | None, block_q: int | None = None):
  """Blocked XLA attention of the buffer's last L rows (xla.attention's math and backward)."""
  b, l, h, kd = q_BLHK.shape
  s, g = k_BSGK.shape[1], k_BSGK.shape[2]
  if block_q is None:
    block_q = 128 if window is None else min(128, max(32, window))
  q_BGRLK = q_BLHK.reshape(b, l, g, h // g, kd).transpose(0, 2, 3, 1, 4)
  k_BGSK, v_BGSK = k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3)
  outs = []
  for q_lo in range(0, l, block_q):
    q_hi = min(l, q_lo + block_q)
    k_hi = q_hi + s - l  # causal: no key after the block's last query
    k_lo = 0 if window is None else max(0, q_lo + s - l - window + 1)
    rows_T1 = jnp.arange(q_lo + s - l, q_hi + s - l)[:, None]
    cols_1S = jnp.arange(k_lo, k_hi)[None, :]
    mask_TS = cols_1S <= rows_T1
    if window is not None:
      mask_TS &= cols_1S > rows_T1 - window
    seg_q_BT = seg_BS[:, q_lo + s - l:q_hi + s - l]
    mask_BTS = mask_TS[None] & (seg_q_BT[:, :, None] == seg_BS[:, None, k_lo:k_hi])
    outs.append(xla.attend_block(q_BGRLK[:, :, :, q_lo:q_hi], k_BGSK[:, :, k_lo:k_hi],
                                 v_BGSK[:, :, k_lo:k_hi], mask_BTS))
  return jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(b, l, h, kd)


@dataclasses.dataclass(frozen=True)
class PallasLocal:
  """The flash kernel as the local attention (interpret: see flash_attention)."""
  block_q: int | None
  block_kv: int | None
  interpret: Any

  def __call__(self, q_BLHK, k_BSGK, v_BSGK, seg_BS, window):
    """The buffer form: the L queries are the S-row buffer's last rows (a query offset)."""
    s, l = k_BSGK.shape[1], q_BLHK.shape[1]
    return flash_attention(q_BLHK, k_BSGK, v_BSGK, window=window, segment_ids_BT=seg_BS,
                           block_q=self.block_q, block_kv=self.block_kv,
                           interpret=self.interpret, q_offset=s - l)

  def zigzag(self, q_B2LHK, k_BTGK, v_BTGK, seg_BT, window, device, cp: int):
    """Device `device`'s two chunks (layout order) against the natural-order sequence."""
    return flash_attention(q_B2LHK, k_BTGK, v_BTGK, window=window, segment_ids_BT=seg_BT,
                           block_q=self.block_q, block_kv=self.block_kv,
                           interpret=self.interpret,
                           q_chunk_starts=zigzag_starts(k_BTGK.shape[1], cp), q_chunk_row=device)


@dataclasses.dataclass(frozen=True)
class PallasGpuLocal:
  """The GPU flash kernel (kernels/flash_gpu.py) as the local attention, in both forms:
  it takes the same query offsets and chunk tables as the TPU kernel."""
  interpret: bool

  def __call__(self, q_BLHK, k_BSGK, v_BSGK, seg_BS, window):
    s, l = k_BSGK.shape[1], q_BLHK.shape[1]
    return flash_attention_gpu(q_BLHK, k_BSGK, v_BSGK, window=window, segment_ids_BT=seg_BS,
                               interpret=self.interpret, q_offset=s - l)

  def zigzag(self, q_B2LHK, k_BTGK, v_BTGK, seg_BT, window, device, cp: int):
    return flash_attention_gpu(q_B2LHK, k_BTGK, v_BTGK, window=window, segment_ids_BT=seg_BT,
                               interpret=self.interpret,
                               q_chunk_starts=zigzag_starts(k_BTGK.shape[1], cp),
                               q_chunk_row=device)


def pallas_local(block_q: int | None, block_kv: int | None, interpret) -> PallasLocal:
  """The flash kernel as the local attention (kept as the constructor kernels.select calls)."""
  return PallasLocal(block_q, block_kv, interpret)


def pallas_block_visits(seq_len: int, cp: int, block_q: int, block_kv: int,
                        window: int | None) -> list[int]:
  """Flash-kernel grid steps per (batch, head) of one layer's forward on each context device."""
  check_seq_len(seq_len, cp)
  chunk_len = seq_len // (2 * cp)
  starts = list(zigzag_starts(seq_len, cp))
  if cp == 1:  # the unsplit layer: self-attention over the whole sequence
    chunk_len, starts = seq_len, [0]
  # The block sizes flash_attention runs with (shrunk to short chunks, keys padded).
  block_q = min(block_q, -(-chunk_len // 128) * 128)
  block_kv = min(block_kv, -(-seq_len // 128) * 128)
  seq_pad = -(-seq_len // block_kv) * block_kv
  return [kv_block_visits(seq_pad, block_q, block_kv, window, q_offset=s, q_len=chunk_len)
          for s in starts]


def stand_in_local(q_BLHK, k_BSGK, v_BSGK, seg_BS, window):
  """For plan.py's CPU compiles only: the shapes and O(S) memory, not attention's math."""
  del seg_BS, window
  kv_B1GK = jnp.sum(k_BSGK * v_BSGK, axis=1, keepdims=True)
  return q_BLHK * jnp.repeat(kv_B1GK, q_BLHK.shape[2] // k_BSGK.shape[2], axis=2)


# --- The sharded attention -----------------------------------------------------------


def _natural(x_BT, cp: int):
  """An all-gathered [B, T, ...] array from layout order to natural order (static reshapes)."""
  b, t = x_BT.shape[:2]
  x = x_BT.reshape(b, cp, 2, t // (2 * cp), *x_BT.shape[2:])
  return jnp.concatenate([x[:, :, 0], x[:, ::-1, 1]], axis=1).reshape(x_BT.shape)


def _key_buffer(x_BT, chunk, length: int, chunk_len: int, pad_value):
  """Rows [(chunk+1)L - length, (chunk+1)L) of x (natural order); rows before 0 are padding."""
  pad = [(0, 0), (length - chunk_len, 0)] + [(0, 0)] * (x_BT.ndim - 2)
  padded = jnp.pad(x_BT, pad, constant_values=pad_value)
  # Natural position p sits at row p + length - L of `padded`: the buffer starts at chunk * L.
  return jax.lax.dynamic_slice_in_dim(padded, chunk * chunk_len, length, axis=1)


def attention(q_BTHK, k_BTGK, v_BTGK, *, window: int | None, segment_ids_BT,
              local: LocalAttention, head_stride: int = 1) -> jax.Array:
  """Causal (windowed, document-masked) GQA attention with T split over the 'context' axis.

  Called under a mesh whose 'context' axis has size C > 1, on arrays in the
  zig-zag layout (`to_layout`); returns the output in the same layout.
  """
  mesh = jax.sharding.get_abstract_mesh()
  cp = degree(mesh)
  b, t, h, _ = q_BTHK.shape
  g = k_BTGK.shape[2]
  check_seq_len(t, cp)
  rows = tuple(a for a in ('data', 'fsdp') if a in mesh.axis_names)
  if b % int(np.prod([mesh.shape[a] for a in rows])):
    rows = ()
  tp = mesh.shape.get('tensor', 1)
  heads = 'tensor' if tp > 1 and not (h % tp or g % tp) else None
  qkv = P(rows or None, AXIS, heads, None)
  seg_spec = P(rows or None, AXIS)
  segments = segment_ids_BT is not None
  if not segments:  # the buffers still need ids: their front padding is masked by them
    segment_ids_BT = jnp.zeros((b, t), jnp.int32)

  def per_device(q_BLHK, k_BLGK, v_BLGK, seg_BL):
    chunk_len = t // (2 * cp)
    r = jax.lax.axis_index(AXIS)
    seg_BT = _natural(jax.lax.all_gather(seg_BL.astype(jnp.int32), AXIS, axis=1, tiled=True), cp)
    g_local = k_BLGK.shape[2]
    reps = q_BLHK.shape[2] // g_local
    stride = max(1, min(head_stride, g_local))
    outs = []
    # OLMo-core's head_stride: gather (and hold) the keys of `stride` kv heads at a time.
    for g0 in range(0, g_local, stride):
      g1 = min(g_local, g0 + stride)
      k_BTGK = _natural(jax.lax.all_gather(k_BLGK[:, :, g0:g1], AXIS, axis=1, tiled=True), cp)
      v_BTGK = _natural(jax.lax.all_gather(v_BLGK[:, :, g0:g1], AXIS, axis=1, tiled=True), cp)
      if hasattr(local, 'zigzag'):  # both chunks in one call, placed by the device index
        q = q_BLHK[:, :, g0 * reps:g1 * reps]
        outs.append(local.zigzag(q, k_BTGK, v_BTGK, seg_BT if segments else None, window, r, cp))
        continue
      slots = []
      for slot, (chunk, last_chunk) in enumerate(((r, cp - 1), (2 * cp - 1 - r, 2 * cp - 1))):
        length = (last_chunk + 1) * chunk_len  # the farthest this slot's chunk can reach
        if window is not None:
          length = min(length, chunk_len + window - 1)
        q = q_BLHK[:, slot * chunk_len:(slot + 1) * chunk_len, g0 * reps:g1 * reps]
        buffers = [_key_buffer(x, chunk, length, chunk_len, 0) for x in (k_BTGK, v_BTGK)]
        seg = _key_buffer(seg_BT, chunk, length, chunk_len, PAD_SEGMENT)
        slots.append(local(q, *buffers, seg, window))
      outs.append(jnp.concatenate(slots, axis=1))
    return jnp.concatenate(outs, axis=2)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(qkv, qkv, qkv, seg_spec),
                       out_specs=qkv, check_vma=False)(q_BTHK, k_BTGK, v_BTGK, segment_ids_BT)
