"""The argument checks both flash kernels share (kernels/flash_attention.py on a TPU,
kernels/flash_gpu.py on a GPU): shapes, GQA, dtypes, the window, segment ids and
where the queries sit. Each kernel adds its own head_dim and block rules. `name` is
the calling kernel's, so a message names the function the user called.

Shapes: B batch, T queries, S keys, H query heads, G kv heads, K head_dim.
"""

import jax.numpy as jnp
import numpy as np


def check_inputs(name: str, q_BTHK, k_BSGK, v_BSGK, window, segment_ids_BS) -> None:
  """Raises ValueError naming the first argument `name` cannot take."""
  if q_BTHK.ndim != 4 or k_BSGK.ndim != 4 or v_BSGK.ndim != 4:
    raise ValueError(
        f'{name} expects q [B, T, H, K] and k, v [B, S, G, K]; got'
        f' q {q_BTHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}.')
  b, _, h, k = q_BTHK.shape
  if k_BSGK.shape != v_BSGK.shape or k_BSGK.shape[0] != b or k_BSGK.shape[3] != k:
    raise ValueError(
        f'{name}: k and v must both be [B, S, G, K] with q\'s B and K;'
        f' got q {q_BTHK.shape}, k {k_BSGK.shape}, v {v_BSGK.shape}.')
  s, g = k_BSGK.shape[1:3]
  if h % g:
    raise ValueError(f'{name}: query heads H={h} must be a multiple of'
                     f' kv heads G={g} (GQA).')
  if not q_BTHK.dtype == k_BSGK.dtype == v_BSGK.dtype:
    raise ValueError(f'{name}: q, k, v must share a dtype; got'
                     f' {q_BTHK.dtype}, {k_BSGK.dtype}, {v_BSGK.dtype}.')
  if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
    raise ValueError(f'{name}: window must be a positive int or None,'
                     f' got {window!r}.')
  if segment_ids_BS is not None and (
      segment_ids_BS.shape != (b, s) or
      not jnp.issubdtype(segment_ids_BS.dtype, jnp.integer)):
    raise ValueError(
        f'{name}: segment_ids_BT must be an integer [B, S] = [{b}, {s}]'
        f' array (one id per key position); got {segment_ids_BS.shape}'
        f' {segment_ids_BS.dtype}.')


def query_starts(name: str, t: int, s: int, q_offset, q_chunk_starts) -> np.ndarray:
  """The validated static [V, C] key positions of the query chunks' first rows: one chunk
  at q_offset, or the q_chunk_starts table (V rows of C equal chunks of the T queries)."""
  if q_chunk_starts is None:
    if not isinstance(q_offset, (int, np.integer)) or q_offset < 0:
      raise ValueError(f'{name}: q_offset must be an int >= 0, got {q_offset!r}.')
    starts_VC = np.asarray([[q_offset]], np.int64)
  else:
    if q_offset:
      raise ValueError(f'{name}: give q_offset or q_chunk_starts, not both.')
    starts_VC = np.asarray(q_chunk_starts)
    if (starts_VC.ndim != 2 or not starts_VC.size or
        not np.issubdtype(starts_VC.dtype, np.integer)):
      raise ValueError(f'{name}: q_chunk_starts must be a non-empty [rows][chunks]'
                       f' table of ints; got {q_chunk_starts!r}.')
  chunks = starts_VC.shape[1]
  if t % chunks:
    raise ValueError(f'{name}: {t} query rows do not split into {chunks} equal'
                     ' chunks (q_chunk_starts).')
  if starts_VC.min() < 0 or starts_VC.max() + t // chunks > s:
    raise ValueError(
        f'{name}: query chunks of {t // chunks} rows starting at key positions'
        f' {starts_VC.tolist()} must lie inside the {s} keys; fix q_offset /'
        ' q_chunk_starts or pass the keys they attend to.')
  return starts_VC
