"""float64 attention oracle shared by the kernel and model tests.

Forward and the textbook softmax backward written out in numpy, independent
of kernels/ and model.py. Shapes: B batch, T time, H query heads, G kv heads.
"""

import numpy as np


def mask_np(t, window, segment_ids):
  """[B, T, T] bool: query i sees key j."""
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  m = j <= i
  if window is not None:
    m &= i - j < window
  m = np.broadcast_to(m, (segment_ids.shape[0] if segment_ids is not None else 1, t, t))
  if segment_ids is not None:
    m = m & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return m


def attention_np(q, k, v, do, window, segment_ids):
  """float64 outputs and (dq, dk, dv) for a given output cotangent do."""
  # Products as stacked matmuls over [B, H, T, D]: numpy's BLAS, where einsum's own loops
  # took ~10 s of the kernel tests' CPU on these shapes (same float64 sums, other order).
  q, k, v, do = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, do))
  b, h, t, d = q.shape
  r = h // k.shape[1]
  k_h, v_h = np.repeat(k, r, axis=1), np.repeat(v, r, axis=1)  # head h -> h // r
  scale = d**-0.5
  s = q @ k_h.swapaxes(-1, -2) * scale  # [B, H, Tq, Tk]
  mask = mask_np(t, window, None if segment_ids is None else np.asarray(segment_ids))
  s = np.where(mask[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  o = p @ v_h
  dp = do @ v_h.swapaxes(-1, -2)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  dq = ds @ k_h * scale
  dk_h = ds.swapaxes(-1, -2) @ q * scale
  dv_h = p.swapaxes(-1, -2) @ do
  bthd = lambda x: x.transpose(0, 2, 1, 3)
  group = lambda x: bthd(x).reshape(b, t, -1, r, d).sum(3)  # sum the R heads per kv head
  return bthd(o), (bthd(dq), group(dk_h), group(dv_h))
