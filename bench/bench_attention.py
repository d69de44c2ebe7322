"""Flash-attention benchmark: kv-block visit counts anywhere, timings on a TPU.

Part 1 (any machine, CPU included) prints, for every (chip, head_dim) of the
block table, how many (q block, kv block) grid steps one attention layer runs
per (batch, head) at --seq_len/--window, against the dense causal count, and
checks the window layers against the bound 3/4 * causal + diagonal blocks
(the band (i-W, i] covers 3/4 of the causal triangle when T = 2W).

Part 2 (only when jax's default backend is a TPU) times the Pallas kernel
against JAX's own splash attention (jax.experimental.pallas.ops.tpu.
splash_attention, the kernel MaxText runs on TPU; at the better of
--splash_blocks) and, with --reference, the XLA reference
(model.reference_attention): forward and forward + backward, for head_dim 128
and 256 at the same width H*K, on sliding, full and document-masked full
layers, on the same inputs in the same run. Each row prints splash's time over
ours: above 1 the kernel leads.

  .venv/bin/python bench/bench_attention.py
  .venv/bin/python bench/bench_attention.py --width=4096 --kv_ratio=1 --iters=20
  .venv/bin/python bench/bench_attention.py --block_q=512 --block_kv=1024 --noreference
  .venv/bin/python bench/bench_attention.py --two_kernels   # the unfused backward too

Shape glossary: B batch, T time, H query heads, G kv heads, K head_dim.
"""

import functools
import os
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # pylint: disable=g-import-not-at-top
import model  # pylint: disable=g-import-not-at-top
from kernels import flash_kernels  # pylint: disable=g-import-not-at-top

_SEQ_LEN = flags.DEFINE_integer('seq_len', 8192, 'T (OLMo-core pretrain-1: 8192).')
_WINDOW = flags.DEFINE_integer('window', 4096, 'Sliding window W (HF sliding_window).')
_WIDTH = flags.DEFINE_integer('width', 4096, 'H * K, the attention width (7B: 32 x 128).')
_KV_RATIO = flags.DEFINE_integer('kv_ratio', 1, 'H // G (7B: 1, MHA).')
_BATCH = flags.DEFINE_integer('batch', 1, 'B per device.')
_ITERS = flags.DEFINE_integer('iters', 10, 'Timed iterations (after one warm-up).')
_BLOCK_Q = flags.DEFINE_integer('block_q', None, 'Override the table (for tuning it).')
_BLOCK_KV = flags.DEFINE_integer('block_kv', None, 'Override the table (for tuning it).')
_SPLASH_BLOCKS = flags.DEFINE_list('splash_blocks', ['512', '1024'],
                                   'Splash block sizes to try; its best is compared.')
_TWO_KERNELS = flags.DEFINE_bool(
    'two_kernels', False, "Also time the kernel's backward as two kernels (dq apart from "
    'dk/dv) beside the fused one the chip picks.')
_REFERENCE = flags.DEFINE_bool(
    'reference', False, 'Also time the XLA reference; it materialises B*H*T*T f32 '
    'logits (8.6 GB per sequence at the 7B shape).')


def print_visit_counts(seq_len: int, window: int) -> bool:
  """Prints the count table; returns whether every window layer met the bound."""
  rows = [(chip, k, *kernels.default_block_sizes(chip, k))
          for chip in sorted(kernels.TPU_DEVICE_KINDS) for k in (128, 256)]
  if _BLOCK_Q.value or _BLOCK_KV.value:
    rows.append(('flags', '-', _BLOCK_Q.value or _BLOCK_KV.value,
                 _BLOCK_KV.value or _BLOCK_Q.value))
  print(f'kv-block visits per (batch, head) and layer, T={seq_len}, W={window}')
  print(f'{"chip":>6} {"K":>4} {"Q":>5} {"C":>5} {"grid":>6} {"full":>6} {"window":>7}'
        f' {"ratio":>6} {"bound":>7} {"SSSF/4":>7}  ok')
  all_ok = True
  for chip, head_dim, bq, bk in rows:
    causal = kernels.block_schedule(seq_len, bq, bk, None)
    full = causal.shape[1]
    diagonal = int(np.count_nonzero(causal[2] & flash_kernels.MASKED))
    win = kernels.kv_block_visits(seq_len, bq, bk, window)
    bound = 0.75 * full + diagonal
    period = (3 * win + full) / 4  # Olmo 3 layer pattern SSSF (docs/architecture.md)
    ok = win <= bound
    all_ok &= ok
    grid = (seq_len // bq) * (seq_len // bk)
    print(f'{chip:>6} {head_dim:>4} {bq:>5} {bk:>5} {grid:>6} {full:>6} {win:>7}'
          f' {win / full:>6.3f} {bound:>7.1f} {period:>7.1f}  {"yes" if ok else "NO"}')
  print('grid: all (q block, kv block) pairs; full: causal layer (the dense'
        ' causal count); window: sliding layer; bound: 3/4 * full + blocks on'
        ' the diagonal; SSSF/4: mean over the 3-sliding-1-full layer period.')
  return all_ok


def splash(q_BTHK, k_BSGK, v_BSGK, *, window=None, segment_ids_BT=None, block=512,
           interpret=False):
  """JAX's splash attention on our layout and semantics (the scale, the window (i-W, i]).

  Multi-head only (G = H, as the 7B); splash takes [H, T, K] per sequence and an
  unscaled query, so the batch is vmapped and q pre-scaled by 1/sqrt(K).
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as sk, splash_attention_mask as sm)
  _, t, h, k = q_BTHK.shape
  if k_BSGK.shape[2] != h:
    raise ValueError('the splash comparison is multi-head only: --kv_ratio=1')
  one = (sm.CausalMask((t, t)) if window is None
         else sm.LocalMask((t, t), window_size=(window - 1, 0), offset=0))
  blocks = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                         block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                         block_q_dq=block, block_kv_dq=block)
  kernel = sk.make_splash_mha(sm.MultiHeadMask([one] * h), block_sizes=blocks, head_shards=1,
                              q_seq_shards=1, interpret=interpret)
  to_bhtk = lambda x: jnp.swapaxes(x, 1, 2)
  q = to_bhtk(q_BTHK * (k ** -0.5)).astype(q_BTHK.dtype)
  if segment_ids_BT is None:
    out = jax.vmap(kernel)(q, to_bhtk(k_BSGK), to_bhtk(v_BSGK))
  else:
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sk.SegmentIds(s, s)))(
        q, to_bhtk(k_BSGK), to_bhtk(v_BSGK), segment_ids_BT)
  return to_bhtk(out)


def _useful_flops(b: int, h: int, k: int, t: int, window: int | None) -> float:
  """Forward matmul flops over visible (query, key) pairs: 2 matmuls x 2K each."""
  keys_per_query = np.minimum(np.arange(1, t + 1), t if window is None else window)
  return 4.0 * b * h * k * float(keys_per_query.sum())


def _time(fn, *args) -> float:
  """Median seconds per call of a jitted fn (compile and warm-up excluded)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_ITERS.value):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _documents(b: int, t: int, rng) -> jax.Array:
  """Segment ids of documents of random lengths (mean 1,024 tokens) packed into rows."""
  cuts = np.sort(rng.choice(np.arange(1, t), size=(b, t // 1024), replace=False), axis=1)
  ids = np.zeros((b, t), np.int32)
  for row, row_cuts in enumerate(cuts):
    ids[row, row_cuts] = 1
  return jnp.asarray(np.cumsum(ids, axis=1), jnp.int32)


def _timed(attn, q, kv, seg, w):
  """(fwd, fwd + bwd) median seconds of `attn` on one layer's inputs."""
  fwd = jax.jit(lambda q, k, v, s: attn(q, k, v, window=w, segment_ids_BT=s))
  loss = lambda q, k, v, s: jnp.sum(attn(q, k, v, window=w, segment_ids_BT=s).astype(
      jnp.float32))
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return _time(fwd, q, *kv, seg), _time(fwd_bwd, q, *kv, seg)


def time_on_tpu(seq_len: int, window: int) -> None:
  info = pltpu.get_tpu_info()
  peak = info.bf16_ops_per_second * info.num_cores
  print(f'\n{jax.devices()[0].device_kind}: peak {peak / 1e12:.0f} bf16 TFLOP/s per device')
  print(f'{"K":>4} {"H":>3} {"layer":>9} {"impl":>12} {"fwd ms":>8} {"fwd+bwd ms":>11}'
        f' {"fwd+bwd TFLOP/s":>16} {"splash/ours fwd":>16} {"fwd+bwd":>8}')
  b = _BATCH.value
  for k in (128, 256):
    h = _WIDTH.value // k
    g = h // _KV_RATIO.value
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, seq_len, h, k)), jnp.bfloat16)
    kv = [jnp.asarray(rng.standard_normal((b, seq_len, g, k)), jnp.bfloat16)
          for _ in range(2)]
    documents = _documents(b, seq_len, rng)
    for layer, w, seg in (('sliding', window, None), ('full', None, None),
                          ('documents', None, documents)):
      ours = functools.partial(kernels.flash_attention, block_q=_BLOCK_Q.value,
                               block_kv=_BLOCK_KV.value)
      results = {'pallas': _timed(ours, q, kv, seg, w)}
      if _TWO_KERNELS.value:
        results['pallas 2-kern'] = _timed(functools.partial(ours, fuse_backward=False), q, kv,
                                          seg, w)
      if g == h:  # splash's multi-head kernel; its best block size is the peer
        tried = {n: _timed(functools.partial(splash, block=int(n)), q, kv, seg, w)
                 for n in _SPLASH_BLOCKS.value}
        best = min(tried, key=lambda n: tried[n][1])
        results[f'splash {best}'] = tried[best]
      if _REFERENCE.value:
        try:
          results['xla'] = _timed(model.reference_attention, q, kv, seg, w)
        except jax.errors.JaxRuntimeError as e:  # the reference can run out of HBM
          print(f'{k:>4} {h:>3} {layer:>9} {"xla":>12}  failed: {str(e)[:80]}')
      flops = _useful_flops(b, h, k, seq_len, w)
      peer = next((v for n, v in results.items() if n.startswith('splash')), None)
      for name, (t_fwd, t_all) in results.items():
        # Backward counted as 2.5x forward (S once, dP, dV, dQ, dK), the usual
        # convention; the kernels run 7 matmuls (S and dP in both kernels).
        ratios = (f' {peer[0] / t_fwd:>16.3f} {peer[1] / t_all:>8.3f}'
                  if peer and name.startswith('pallas') else '')
        print(f'{k:>4} {h:>3} {layer:>9} {name:>12} {t_fwd * 1e3:>8.2f}'
              f' {t_all * 1e3:>11.2f} {3.5 * flops / t_all / 1e12:>16.1f}{ratios}', flush=True)


def main(argv):
  del argv
  ok = print_visit_counts(_SEQ_LEN.value, _WINDOW.value)
  if jax.default_backend() == 'tpu':
    time_on_tpu(_SEQ_LEN.value, _WINDOW.value)
  else:
    print(f'\nbackend is {jax.default_backend()}: timings need a TPU, skipped.')
  if not ok:
    raise SystemExit('a window layer visits more kv blocks than the bound')


if __name__ == '__main__':
  app.run(main)
