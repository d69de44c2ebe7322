"""Tests for kernels/: Pallas flash attention (TPU interpret mode on CPU), the
CPU-tuned XLA paths (kernels/xla.py) and the choice between them.

Oracle: tests/attention_oracle.py, a float64 numpy attention (forward and the
textbook softmax backward), independent of the kernels and of reference_attention.

Shape glossary: B batch, T time, H query heads, G kv heads, K head_dim.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_oracle import attention_np, mask_np
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

import config_checks
import kernels
import model

fa = importlib.import_module('kernels.flash_attention')  # the module, not the function

# Tolerances, as max |kernel - oracle| / max |oracle| per output array.
# f32: the kernel differs from float64 only by f32 rounding in dots, exp and the
#   online-softmax rescaling, a few ulps (6e-8) amplified by sums over <= T=512
#   terms; observed <= 2e-6, so 1e-5 leaves margin but catches any masking or
#   indexing bug (those give errors of order 1).
# bf16: the oracle sees the same bf16 inputs; the kernel rounds the
#   probabilities, dS and the outputs to bf16 (relative step 2^-8 = 3.9e-3), so
#   1e-2 is about two bf16 steps; observed <= 4.2e-3 (the f32 XLA reference
#   on the same inputs: <= 3.5e-3).
# On a TPU (the kernels compiled by Mosaic, not interpreted: docs/results/kernels.md
#   says how to run this file there), f32 dots run at 'highest' (the fixture below;
#   the default is one bf16 pass, ~3e-3), and the chip's f32 exp and division are
#   a few ulps coarser: gradients were seen within 7e-5 of float64 on a v5e.
ON_TPU = jax.default_backend() == 'tpu'
INTERPRET = False if ON_TPU else pltpu.InterpretParams()
TOLERANCE = {jnp.float32: 2e-4 if ON_TPU else 1e-5, jnp.bfloat16: 1e-2}
F32_TOL = TOLERANCE[jnp.float32]


@pytest.fixture(autouse=True)
def _f32_dots_in_full():
  if not ON_TPU:
    yield
    return
  with jax.default_matmul_precision('highest'):
    yield


def _inputs(seed, b, t, h, g, d, dtype, with_segments):
  rng = np.random.default_rng(seed)
  q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype)
                 for s in ((b, t, h, d), (b, t, g, d), (b, t, g, d), (b, t, h, d)))
  seg = None
  if with_segments:  # three documents of uneven length, boundaries inside blocks
    cuts = np.sort(rng.choice(np.arange(1, t), size=2, replace=False))
    seg = jnp.asarray(np.searchsorted(cuts, np.arange(t), side='right')[None]
                      .repeat(b, 0), jnp.int32)
  return q, k, v, do, seg


def _rel_err(x, ref):
  # Floor 1: inputs are unit normal, so dS = P * (dP - D) cancels O(1) terms
  # even where the true gradient is exactly 0 (dq when window=1: a softmax
  # over a single key); the f32 error there is relative to those terms.
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  return np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1.0)


# (T, H, G, K, window, segments, dtype, block_q, block_kv); the id says what a
# row adds. Blocks of 128-256 keep interpret mode cheap while T spans 2-4 blocks.
F32, BF16 = jnp.float32, jnp.bfloat16
CASES = [
    pytest.param(512, 2, 2, 128, None, False, F32, 128, 128, id='causal-mha-4blocks'),
    pytest.param(512, 4, 1, 128, 64, False, F32, 128, 128, id='window<block-gqa4'),
    pytest.param(384, 8, 1, 256, 128, False, F32, 128, 128, id='window=block-gqa8-k256'),
    pytest.param(512, 2, 1, 128, 300, True, F32, 128, 128, id='window>block-segments'),
    pytest.param(512, 2, 2, 256, None, True, BF16, 128, 128, id='causal-segments-bf16-k256'),
    pytest.param(512, 8, 2, 128, 200, False, BF16, 256, 128, id='bq>bkv-gqa4-bf16'),
    pytest.param(300, 4, 1, 128, 100, False, F32, 128, 256, id='ragged-T-bkv>bq'),
]


# fused: dq comes from the dk/dv kernel (the default at these shapes); two: its own kernel.
@pytest.mark.parametrize('fuse', [True, False], ids=['fused', 'two'])
@pytest.mark.parametrize('t,h,g,d,window,segments,dtype,block_q,block_kv', CASES)
def test_matches_float64_oracle(t, h, g, d, window, segments, dtype, block_q, block_kv, fuse):
  q, k, v, do, seg = _inputs(0, 1, t, h, g, d, dtype, segments)
  f = lambda q, k, v: kernels.flash_attention(
      q, k, v, window=window, segment_ids_BT=seg, block_q=block_q,
      block_kv=block_kv, interpret=INTERPRET, fuse_backward=fuse)
  o, vjp = jax.vjp(jax.jit(f), q, k, v)  # one program, not op-by-op dispatch
  grads = vjp(do)
  o_ref, grads_ref = attention_np(q, k, v, do, window, seg)
  assert o.dtype == dtype and o.shape == q.shape
  tol = TOLERANCE[dtype]
  assert _rel_err(o, o_ref) < tol
  for name, x, ref in zip(('dq', 'dk', 'dv'), grads, grads_ref):
    assert x.dtype == dtype, name
    assert _rel_err(x, ref) < tol, name


@pytest.mark.slow
@pytest.mark.parametrize('window', [None, 1, 129])
def test_two_cores_and_random_grid_order(window):
  """Megacore-style split and shuffled 'parallel' axes change nothing."""
  q, k, v, do, seg = _inputs(1, 2, 512, 2, 1, 128, jnp.float32, True)
  params = pltpu.InterpretParams(num_cores_or_threads=2, random_seed=3)
  f = lambda q, k, v: kernels.flash_attention(
      q, k, v, window=window, segment_ids_BT=seg, interpret=params)
  o, vjp = jax.vjp(jax.jit(f), q, k, v)  # one program, not op-by-op dispatch
  o_ref, grads_ref = attention_np(q, k, v, do, window, seg)
  assert _rel_err(o, o_ref) < 1e-5
  for x, ref in zip(vjp(do), grads_ref):
    assert _rel_err(x, ref) < 1e-5


def test_window_at_least_seq_len_is_causal():
  q, k, v, do, _ = _inputs(2, 1, 256, 2, 1, 128, jnp.float32, False)
  o = kernels.flash_attention(q, k, v, window=10_000, interpret=not ON_TPU)
  o_ref, _ = attention_np(q, k, v, do, None, None)
  assert _rel_err(o, o_ref) < F32_TOL


def _inner_dots(jaxpr):
  """Every dot_general in the jaxprs nested in `jaxpr` (the kernels' bodies), at any depth."""
  for eqn in jaxpr.eqns:
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, 'jaxpr', sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from (e for e in sub.eqns if e.primitive.name == 'dot_general')
          yield from _inner_dots(sub)


def test_bf16_dots_keep_the_native_pass_under_highest_precision():
  """Under jax_default_matmul_precision='highest', a bf16 dot in a kernel must not ask
  for fp32 contract precision: Mosaic refuses it ("Bad lhs type", seen on a v5e)."""
  q, k, v, do, _ = _inputs(6, 1, 256, 2, 1, 128, jnp.bfloat16, False)
  f = lambda q, k, v: kernels.flash_attention(q, k, v, window=100, interpret=True)
  with jax.default_matmul_precision('highest'):
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(f, *a)[1](do))(q, k, v)
    f32_jaxpr = jax.make_jaxpr(f)(*(x.astype(jnp.float32) for x in (q, k, v)))
  dots = list(_inner_dots(jaxpr.jaxpr))
  assert len(dots) >= 5  # the backward kernels' own: dp, dq, dv, dp, dk (and the forward's)
  for eqn in dots:
    assert eqn.params['precision'] in (None, (jax.lax.Precision.DEFAULT,) * 2), eqn
  f32_dots = list(_inner_dots(f32_jaxpr.jaxpr))
  assert f32_dots and all(e.params['precision'] == (jax.lax.Precision.HIGHEST,) * 2
                          for e in f32_dots)  # f32 follows the setting, as XLA's dots do


def test_reference_attention_matches_oracle():
  q, k, v, do, seg = _inputs(3, 2, 96, 4, 2, 16, jnp.float32, True)
  o_ref, grads_ref = attention_np(q, k, v, do, 40, seg)
  f = jax.jit(lambda q, k, v: model.reference_attention(
      q, k, v, window=40, segment_ids_BT=seg))
  o, vjp = jax.vjp(f, q, k, v)
  assert _rel_err(o, o_ref) < 1e-5
  for x, ref in zip(vjp(do), grads_ref):
    assert _rel_err(x, ref) < 1e-5


def test_remat_scan_gradients_match_reference():
  """Usable inside jax.checkpoint and lax.scan (as model.py's layer scan)."""
  q, k, v, _, seg = _inputs(4, 1, 256, 2, 1, 128, jnp.float32, True)
  w_L = jnp.asarray([0.5, -1.5], jnp.float32)

  def loss(w_L, q, attn):
    def layer(x, w):
      o = attn(x * w, k, v, window=100, segment_ids_BT=seg)
      return x + o, None
    x, _ = jax.lax.scan(jax.checkpoint(layer), q, w_L)
    return jnp.sum(x**2)

  pallas = lambda *a, **kw: kernels.flash_attention(
      *a, **kw, block_q=128, block_kv=128, interpret=not ON_TPU)  # (InterpretParams' callbacks
      # cannot be rematerialised)
  g = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(w_L, q, pallas)
  g_ref = jax.grad(loss, argnums=(0, 1))(w_L, q, model.reference_attention)
  for x, ref in zip(g, g_ref):
    assert _rel_err(x, np.asarray(ref, np.float64)) < F32_TOL


# ---------------------------------------------------------------------------
# Block schedule: checked against the element mask, block by block.

@pytest.mark.parametrize('t,bq,bk,window', [
    (1024, 128, 128, None), (1024, 128, 128, 1), (1024, 256, 128, 200),
    (1024, 128, 256, 129), (1024, 256, 512, 300), (1024, 512, 256, 2000),
])
def test_schedule_visits_exactly_the_blocks_with_visible_entries(t, bq, bk, window):
  mask = mask_np(t, window, None)[0]
  blocks = mask.reshape(t // bq, bq, t // bk, bk)
  any_QC, all_QC = blocks.any((1, 3)), blocks.all((1, 3))
  for kv_major in (False, True):
    qb, kb, flags = fa.block_schedule(t, bq, bk, window, kv_major=kv_major)
    pairs = list(zip(qb.tolist(), kb.tolist()))
    expected = sorted(zip(*np.nonzero(any_QC)),
                      key=(lambda ij: (ij[1], ij[0])) if kv_major else None)
    assert pairs == [tuple(int(x) for x in ij) for ij in expected]
    masked = (flags & fa.flash_kernels.MASKED) != 0
    np.testing.assert_array_equal(masked, ~all_QC[qb, kb])
    outer = kb if kv_major else qb
    first = (flags & fa.flash_kernels.FIRST) != 0
    last = (flags & fa.flash_kernels.LAST) != 0
    np.testing.assert_array_equal(first, np.r_[True, outer[1:] != outer[:-1]])
    np.testing.assert_array_equal(last, np.r_[outer[1:] != outer[:-1], True])


@pytest.mark.parametrize('chip', sorted(kernels.TPU_DEVICE_KINDS))
@pytest.mark.parametrize('head_dim', [128, 256])
def test_window_layer_visits_at_most_three_quarters_plus_diagonal(chip, head_dim):
  """Olmo 3 at T=8192, W=4096 (docs/architecture.md): the band covers 3/4 of the triangle."""
  bq, bk = kernels.default_block_sizes(chip, head_dim)
  causal = fa.block_schedule(8192, bq, bk, None)
  diagonal = np.count_nonzero(causal[2] & fa.flash_kernels.MASKED)
  window = kernels.kv_block_visits(8192, bq, bk, 4096)
  assert window <= 0.75 * causal.shape[1] + diagonal
  assert window < causal.shape[1]


# Queries at an offset or in chunks (context parallelism): the schedule follows
# their positions, so a chunk visits only its own band's kv blocks.

def _chunk_mask(seq_len, window, starts, q_len, block_q):
  """[T', S] element mask of the kernel's padded query rows (chunk c's row i at starts[c] + i;
  padding rows see nothing), from attention_oracle's mask on the whole sequence."""
  full = mask_np(seq_len, window, None)[0]
  rows = []
  for start in starts:
    chunk = full[start:start + q_len]
    pad = -(-q_len // block_q) * block_q - q_len
    rows.append(np.concatenate([chunk, np.zeros((pad, seq_len), bool)]))
  return np.concatenate(rows)


@pytest.mark.parametrize('seq_len,bq,bk,window,starts,q_len', [
    (1024, 128, 128, None, (384,), 640), (1024, 128, 256, 200, (300,), 500),
    (1024, 256, 128, 129, (0, 896), 128), (2048, 128, 128, None, (128, 1792), 128),
    (2048, 128, 256, 300, (512, 1024, 1536), 64), (1024, 128, 128, 1, (5, 700), 100),
])
def test_offset_schedule_visits_exactly_the_blocks_with_visible_entries(
    seq_len, bq, bk, window, starts, q_len):
  mask = _chunk_mask(seq_len, window, starts, q_len, bq)
  blocks = mask.reshape(mask.shape[0] // bq, bq, seq_len // bk, bk)
  any_QC = blocks.any((1, 3))
  # MASKED is needed unless every real row sees every key of the pair (padding rows are free).
  real = _chunk_mask(seq_len, None, starts, q_len, bq).any(1).reshape(-1, bq)
  all_QC = (blocks | ~real[:, :, None, None]).all((1, 3))
  for kv_major in (False, True):
    qb, kb, flags = fa.block_schedule(seq_len, bq, bk, window, kv_major=kv_major,
                                      q_offset=starts if len(starts) > 1 else starts[0],
                                      q_len=q_len)
    expected = sorted(zip(*np.nonzero(any_QC)),
                      key=(lambda ij: (ij[1], ij[0])) if kv_major else None)
    assert list(zip(qb.tolist(), kb.tolist())) == [tuple(int(x) for x in ij) for ij in expected]
    np.testing.assert_array_equal((flags & fa.flash_kernels.MASKED) != 0, ~all_QC[qb, kb])
  assert fa.kv_block_visits(seq_len, bq, bk, window, q_offset=starts, q_len=q_len) == \
      np.count_nonzero(any_QC)


def test_schedule_tables_pad_shorter_rows_with_skips():
  """One schedule per device row, padded to the longest with SKIP steps repeating the last pair."""
  starts_VC = ((0, 896), (128, 768), (256, 640))
  fwd, dkv, visited = fa._schedule_tables(1024, 128, 128, 200, starts_VC, 128)
  for v, starts in enumerate(starts_VC):
    for table, kv_major in ((fwd, False), (dkv, True)):
      want = fa.block_schedule(1024, 128, 128, 200, kv_major=kv_major, q_offset=starts, q_len=128)
      n = want.shape[1]
      np.testing.assert_array_equal(table[v, :3, :n], want)
      np.testing.assert_array_equal(table[v, 2, n:], fa.flash_kernels.SKIP)
      np.testing.assert_array_equal(table[v, :2, n:],
                                    np.broadcast_to(want[:2, -1:], (2, table.shape[2] - n)))
      # Row 3: the key position of the q block's first row.
      np.testing.assert_array_equal(table[v, 3, :n], np.asarray(starts)[want[0]])
    np.testing.assert_array_equal(np.nonzero(visited[v])[0], np.unique(want[1]))


def _embedded_oracle(q_pos, q, k, v, do, window, seg):
  """attention_np for queries at positions q_pos of the keys' sequence: the whole sequence's
  oracle with zero cotangent on the other rows (they then add nothing to dk, dv)."""
  b, s = k.shape[:2]
  q_full = np.zeros((b, s) + q.shape[2:], np.float64)
  do_full = np.zeros_like(q_full)
  q_full[:, q_pos], do_full[:, q_pos] = np.asarray(q), np.asarray(do)
  o, (dq, dk, dv) = attention_np(q_full, k, v, do_full, window,
                                 None if seg is None else np.asarray(seg))
  return o[:, q_pos], (dq[:, q_pos], dk, dv)


# (S, H, G, K, window, segments, layout): layout is an int q_offset or a [V][C] chunk table
# whose every row is run through one jitted function with the row traced.
OFFSET_CASES = [
    pytest.param(512, 2, 1, 128, None, False, 200, id='offset-unaligned-causal'),
    pytest.param(512, 4, 1, 256, 100, True, 256, id='offset-window-segments-gqa4-k256'),
    pytest.param(512, 4, 2, 128, None, True, ((0, 384), (128, 256)), id='zigzag2-causal-docs'),
    pytest.param(512, 4, 2, 128, 48, False, ((0, 448), (64, 384), (128, 320), (192, 256)),
                 id='zigzag4-chunk<block-window'),
    pytest.param(512, 2, 1, 256, 300, True, ((64, 320), (192, 384)), id='chunks-window>block-k256'),
]


@pytest.mark.parametrize('fuse', [True, False], ids=['fused', 'two'])
@pytest.mark.parametrize('s,h,g,d,window,segments,layout', OFFSET_CASES)
def test_query_offset_and_chunks_match_float64_oracle(s, h, g, d, window, segments, layout,
                                                      fuse):
  q_full, k, v, do_full, seg = _inputs(5, 1, s, h, g, d, jnp.float32, segments)
  table = ((layout,),) if isinstance(layout, int) else layout
  chunk = s - layout if isinstance(layout, int) else s // (2 * len(table))
  kwargs = (dict(q_offset=layout) if isinstance(layout, int) else dict(q_chunk_starts=layout))

  @jax.jit
  def run(q, k, v, do, row):
    f = lambda q, k, v: kernels.flash_attention(
        q, k, v, window=window, segment_ids_BT=seg, block_q=128, block_kv=128,
        interpret=INTERPRET, q_chunk_row=row, fuse_backward=fuse, **kwargs)
    o, vjp = jax.vjp(f, q, k, v)
    return o, vjp(do)

  for row, starts in enumerate(table):
    q_pos = np.concatenate([np.arange(x, x + chunk) for x in starts])
    q, do = q_full[:, q_pos], do_full[:, q_pos]
    o, grads = run(q, k, v, do, jnp.int32(row))
    o_ref, grads_ref = _embedded_oracle(q_pos, q, k, v, do, window, seg)
    assert o.shape == q.shape and _rel_err(o, o_ref) < F32_TOL, row
    for name, x, ref in zip(('dq', 'dk', 'dv'), grads, grads_ref):
      assert _rel_err(x, ref) < F32_TOL, (row, name)


def test_query_layout_errors_are_clear():
  q = jnp.zeros((1, 256, 2, 128))
  kv = jnp.zeros((1, 384, 1, 128))
  with pytest.raises(ValueError, match='inside the 384 keys'):
    kernels.flash_attention(q, kv, kv, q_offset=200, interpret=True)
  with pytest.raises(ValueError, match='equal chunks'):
    kernels.flash_attention(q, kv, kv, q_chunk_starts=((0, 1, 2),), interpret=True)
  with pytest.raises(ValueError, match='not both'):
    kernels.flash_attention(q, kv, kv, q_offset=1, q_chunk_starts=((0, 128),), interpret=True)
  with pytest.raises(ValueError, match=r'\[B, S\] = \[1, 384\]'):
    kernels.flash_attention(q, kv, kv, q_offset=128, interpret=True,
                            segment_ids_BT=jnp.zeros((1, 256), jnp.int32))


def test_block_table():
  for (chip, head_dim), (bq, bk) in fa._BLOCK_TABLE.items():
    assert bq % 128 == 0 and bk % 128 == 0 and 8192 % bq == 0 and 8192 % bk == 0
    assert kernels.default_block_sizes(chip, head_dim) == (bq, bk)
  with pytest.raises(ValueError, match='attention_block_q'):
    kernels.default_block_sizes('v2', 128)


# ---------------------------------------------------------------------------
# Lowering for each chip of the table, on this CPU machine: jax's abstract mesh
# names the TPU generation, so Pallas runs its Mosaic lowering (block-shape
# and tiling checks, chip-specific choices) without a TPU. What it cannot
# check is Mosaic's own compilation inside libtpu (layouts, VMEM fit).

@pytest.mark.parametrize('chip', sorted(kernels.TPU_DEVICE_KINDS))
@pytest.mark.parametrize('head_dim', [128, 256])
@pytest.mark.parametrize('window,segments', [(None, False), (4096, True)])
def test_lowers_for_tpu(chip, head_dim, window, segments):
  kind, cores = kernels.TPU_DEVICE_KINDS[chip]
  device = AbstractDevice(device_kind=kind, num_cores=cores, platform='tpu')
  mesh = AbstractMesh((1,), ('x',), (AxisType.Explicit,), abstract_device=device)
  t, h, g = 8192, 4, 1
  q = jax.ShapeDtypeStruct((1, t, h, head_dim), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, t, g, head_dim), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, t), jnp.int32) if segments else None

  def loss(q, k, v, seg):
    o = kernels.flash_attention(q, k, v, window=window, segment_ids_BT=seg)
    return jnp.sum(o.astype(jnp.float32))

  with use_abstract_mesh(mesh):
    assert fa._current_chip() == chip
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        q, kv, kv, seg).lower(lowering_platforms=('tpu',))
  text = lowered.as_text()
  for name in ('flash_attention_fwd', 'flash_attention_dq', 'flash_attention_dkv'):
    assert name in text


def test_bad_inputs_raise_clear_errors():
  q = jnp.zeros((1, 256, 4, 128))
  kv = jnp.zeros((1, 256, 3, 128))
  with pytest.raises(ValueError, match='multiple of kv heads'):
    kernels.flash_attention(q, kv, kv, interpret=True)
  small = jnp.zeros((1, 256, 2, 64))
  with pytest.raises(ValueError, match='head_dim=64'):
    kernels.flash_attention(small, small, small, interpret=True)
  kv = jnp.zeros((1, 256, 2, 128))
  with pytest.raises(ValueError, match='block_q=100'):
    kernels.flash_attention(q, kv, kv, block_q=100, interpret=True)
  with pytest.raises(ValueError, match='window'):
    kernels.flash_attention(q, kv, kv, window=0, interpret=True)
  with pytest.raises(ValueError, match='segment_ids_BT'):
    kernels.flash_attention(q, kv, kv, segment_ids_BT=jnp.zeros((1, 255), jnp.int32),
                            interpret=True)


def test_whole_model_gradients_match_xla_path():
  """The model with attention_impl='pallas' (interpret mode) and remat on vs the XLA path."""
  import model
  from configs import small
  cfg = config_checks.complete(small.get_config()).model
  cfg.update(vocab_size=128, d_model=256, num_heads=2, num_kv_heads=1, head_dim=128,
             mlp_hidden=256, num_layers=4, sliding_window=100, remat='full')
  params = model.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (1, 256), 0, 128)

  def loss(p, impl):
    c = cfg.copy_and_resolve_references()
    c.attention_impl = impl
    logp = jax.nn.log_softmax(model.logits(p, tokens, c))
    return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1))
  want_loss, want = jax.jit(jax.value_and_grad(lambda p: loss(p, 'xla')))(params)
  got_loss, got = jax.jit(jax.value_and_grad(lambda p: loss(p, 'pallas')))(params)
  # f32 throughout; the kernel's online softmax reorders sums (see TOLERANCE).
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.max(np.abs(g - w)) <= 1e-4 * np.max(np.abs(w)) + 1e-8


# ---------------------------------------------------------------------------
# kernels/xla.py: the CPU-tuned paths.

@pytest.mark.parametrize('window', [None, 1, 5])
def test_cudnn_path_window_mapping(window):
  """The GPU path's local_window_size=(W-1, 0) equals our (i-W, i] mask (XLA backend on CPU)."""
  q = jax.random.normal(jax.random.key(0), (2, 12, 4, 8))
  k, v = jax.random.normal(jax.random.key(1), (2, 2, 12, 2, 8))
  local = None if window is None else (window - 1, 0)
  got = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                     implementation='xla')
  want = jax.jit(lambda q, k, v: kernels.xla.attention(q, k, v, window=window))(q, k, v)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize('t,window,block_q,segmented', [
    (20, None, 8, False),  # uneven last block
    (20, 5, 8, True),  # window inside a block, documents
    (33, 12, None, False),  # default block
    (16, None, 64, True),  # one block
])
def test_xla_attention_blocks_match_float64(t, window, block_q, segmented):
  """Blocked forward and hand-written backward equal the float64 formulas (GQA 4:2)."""
  keys = jax.random.split(jax.random.key(7), 4)
  q = jax.random.normal(keys[0], (2, t, 4, 8))
  k, v = jax.random.normal(keys[1], (2, 2, t, 2, 8))
  dout = jax.random.normal(keys[2], (2, t, 4, 8))
  segments = np.sort(np.asarray(jax.random.randint(keys[3], (2, t), 0, 3)), axis=1)
  segments = jnp.asarray(segments) if segmented else None
  attend = lambda q, k, v: kernels.xla.attention(q, k, v, window=window,
                                                segment_ids_BT=segments, block_q=block_q)
  out, vjp = jax.vjp(jax.jit(attend), q, k, v)
  want_out, want_grads = attention_np(q, k, v, dout, window, segments)
  np.testing.assert_allclose(np.asarray(out), want_out, atol=2e-6)
  for got, want in zip(vjp(dout), want_grads):
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_matmul_gradients_match_float64():
  """matmul's hand-written backward: dx = dy w^T, dw = sum over batch and time of x^T dy."""
  keys = jax.random.split(jax.random.key(8), 3)
  x, w = jax.random.normal(keys[0], (3, 5, 7)), jax.random.normal(keys[1], (7, 4))
  dy = jax.random.normal(keys[2], (3, 5, 4))
  y, vjp = jax.vjp(kernels.xla.matmul, x, w)
  dx, dw = vjp(dy)
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  np.testing.assert_allclose(np.asarray(y), x64 @ w64, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dx), dy64 @ w64.T, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dw), np.einsum('bti,bto->io', x64, dy64),
                             rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# The choice: attention_impl 'auto' and the per-device wrapping of Pallas.

def _model_cfg(**overrides):
  from configs import olmo3_7b
  cfg = olmo3_7b.model_config()
  cfg.update(overrides)
  return cfg


@pytest.mark.parametrize('platform,overrides,segments,want', [
    ('tpu', {}, True, 'pallas'),
    ('tpu', dict(head_dim=64, num_heads=8, num_kv_heads=8), False, 'xla'),  # small.py's
    ('gpu', {}, False, 'cudnn'),
    ('gpu', {}, True, 'pallas_gpu'),  # cuDNN takes no segment ids: the Pallas GPU kernel
    ('gpu', dict(dtype='float32'), False, 'pallas_gpu'),
    ('gpu', dict(head_dim=256, num_heads=16, num_kv_heads=16), False, 'cudnn'),  # Hopper
    ('cpu', {}, False, 'xla'),
    ('cpu', dict(attention_impl='pallas'), False, 'pallas'),  # explicit wins
])
def test_auto_resolves_per_platform(platform, overrides, segments, want):
  impl, why = kernels.resolve(_model_cfg(**overrides), platform, segments=segments)
  assert impl == want and why


def test_select_on_cpu_is_the_tuned_xla_path():
  ops = kernels.select(_model_cfg(), segments=False)
  assert ops.impl == 'xla' and ops.matmul is kernels.xla.matmul
  assert ops.attention.__wrapped__ is kernels.xla.attention  # with the residuals' names
  with pytest.raises(NotImplementedError, match='segment ids'):
    kernels.select(_model_cfg(attention_impl='cudnn'), segments=True)


@pytest.mark.parametrize('mesh_shape,segments', [((1, 4, 2), True), ((2, 2, 2), False)])
def test_pallas_runs_per_shard_under_a_mesh(mesh_shape, segments):
  """Mosaic kernels are not auto-partitioned: under a mesh each device runs its shard."""
  b, t, h, g, d = 4, 256, 4, 2, 128
  q, k, v, do, seg = _inputs(3, b, t, h, g, d, jnp.float32, segments)
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(mesh_shape),
                           ('data', 'fsdp', 'tensor'))
  attention = kernels.select(_model_cfg(attention_impl='pallas'), segments=segments).attention
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('data', 'fsdp')))

  def loss(q, k, v, seg):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      o = attention(q, k, v, window=100, segment_ids_BT=seg)
    return jnp.sum(o * do), o
  args = [jax.device_put(x, spec) for x in (q, k, v)] + [seg]
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
  want_out, want_grads = attention_np(q, k, v, do, 100, seg)
  assert _rel_err(out, want_out) <= TOLERANCE[jnp.float32]
  for got, want in zip(grads, want_grads):
    assert _rel_err(got, want) <= TOLERANCE[jnp.float32]
