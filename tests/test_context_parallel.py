"""Context parallelism (kernels/context_parallel.py) on the 8 simulated CPU devices of conftest.py.

The reference is the same model without a 'context' axis (the path
tests/test_model.py holds against HF transformers), and for the local
attention the float64 oracle of tests/attention_oracle.py: with CP = 2, 4 and
8 a train step's loss and gradients equal the CP = 1 step's within float32
reduction noise, with sliding windows, documents, GQA, and both the xla and
the Pallas (interpret mode) attention paths.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attention_oracle
import config_checks
import kernels
import loss
import model
import optim
import sharding
import train
from configs import small
from kernels import context_parallel

# Gradients of a few-layer model in float32, summed in another order by the
# reduce-scatter of the key gradients: measured ~1e-6 relative; 2e-5 is noise.
RTOL = 2e-5


def _config(impl='xla', seq_len=64, window=12, head_dim=16):
  cfg = config_checks.complete(small.get_config())
  m = cfg.model
  m.num_layers, m.layer_pattern, m.d_model, m.mlp_hidden, m.vocab_size = 2, 'SF', 64, 128, 256
  m.num_heads, m.num_kv_heads, m.head_dim = 4, 2, head_dim  # GQA 2:1
  m.sliding_window, m.attention_impl = window, impl
  m.yarn.enabled, m.yarn.original_max_position = True, seq_len // 4  # YaRN on full layers
  cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.vocab_size = seq_len, 8, 256
  return cfg


def _batch(cfg, seed=0, docs=True):
  rng = np.random.default_rng(seed)
  b, t = cfg.data.global_batch_size, cfg.data.seq_len
  tokens = rng.integers(0, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
  batch = {'tokens': tokens[:, :-1], 'labels': tokens[:, 1:],
           'instance_mask': np.ones(b, bool)}
  if docs:  # documents of random lengths, some spanning several CP chunks
    starts = rng.random((b, t)) < 4 / t
    starts[:, 0] = True
    batch['segment_ids'] = np.cumsum(starts, axis=1, dtype=np.int32) - 1
  return batch


def _mesh(cfg, cp, fsdp=-1):
  """(data 1, fsdp, context cp): all 8 devices, or fsdp * cp of them."""
  cfg = cfg.copy_and_resolve_references()
  cfg.train.mesh_data, cfg.train.mesh_fsdp, cfg.train.mesh_context = 1, fsdp, cp
  return sharding.make_mesh(cfg.train, None if fsdp == -1 else jax.devices()[:fsdp * cp])


def _put(batch, mesh):
  """The batch as train.py's loader places it: rows split over the batch axes."""
  spec = sharding.batch_sharding(mesh).spec
  return {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      *spec[:np.ndim(v)]))) for k, v in batch.items()}


def _loss_and_grads(cfg, cp, params, batch, fsdp=-1, run=True):
  """The train step's loss (train.sequence_layout + model + loss.sums), its gradient
  (None unless `run`) and the compiled function."""
  mesh = _mesh(cfg, cp, fsdp)
  net = model.build(cfg.model)

  def objective(p, batch):
    mb = sharding.sequence_layout(cfg.model, mesh, batch)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      h = net.apply(p, mb['tokens'], mb.get('segment_ids'), mb.get('positions'))
    ce, z = loss.sums(h, p['lm_head']['w'], mb['labels'], mb['instance_mask'],
                      z_loss=1e-4, chunk=cfg.opt.loss_chunk)
    return ce + z

  abstract = train.abstract_state(cfg, optim.make_optimizer(cfg.opt))
  shardings = sharding.state_shardings(abstract, mesh).params
  params = jax.device_put(params, shardings)
  batch = _put(batch, mesh)
  compiled = jax.jit(jax.value_and_grad(objective)).lower(params, batch).compile()
  return (jax.device_get(compiled(params, batch)) if run else None), compiled


def _assert_close(got, want, rtol=RTOL):
  (loss_got, g_got), (loss_want, g_want) = got, want
  np.testing.assert_allclose(loss_got, loss_want, rtol=rtol)
  for path, a in jax.tree_util.tree_leaves_with_path(g_got):
    b = functools.reduce(lambda t, k: t[k.key], path, g_want)
    scale = np.abs(b).max() + 1e-30
    np.testing.assert_array_less(np.abs(a - b).max() / scale, rtol * 10,
                                 err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope='module')
def xla_setup():
  """Window 12 against chunks of 16 (CP 2), 8 and 4 (CP 8): narrower and wider than a chunk."""
  cfg = _config()
  params = model.init_params(cfg.model, jax.random.key(1))
  batch = _batch(cfg)
  reference, _ = _loss_and_grads(cfg, 1, params, batch)
  return cfg, params, batch, reference


@pytest.mark.parametrize('cp', [2, 4, 8])
def test_xla_loss_and_grads_equal_cp1(xla_setup, cp):
  cfg, params, batch, reference = xla_setup
  got, _ = _loss_and_grads(cfg, cp, params, batch)
  _assert_close(got, reference)


def test_document_positions_under_cp_equal_cp1():
  """RoPE positions restarting per document travel with their tokens through the layout."""
  cfg = _config(window=24)
  cfg.model.rope_document_positions = True
  params = model.init_params(cfg.model, jax.random.key(2))
  batch = _batch(cfg, seed=3)
  _assert_close(_loss_and_grads(cfg, 8, params, batch)[0],
                _loss_and_grads(cfg, 1, params, batch)[0])


@pytest.mark.slow
@pytest.mark.parametrize('cp,docs', [(2, False), (8, True)])
def test_pallas_loss_and_grads_equal_cp1(cp, docs):
  """The Pallas kernel (interpret mode) under CP against the same kernel without CP."""
  cfg = _config('pallas', seq_len=256, window=48, head_dim=128)
  cfg.data.global_batch_size = 2
  cfg.model.context_head_stride = 1  # one kv head per gather: exercises the head loop
  params = model.init_params(cfg.model, jax.random.key(6))
  batch = _batch(cfg, seed=7, docs=docs)
  _assert_close(_loss_and_grads(cfg, cp, params, batch, fsdp=1)[0],
                _loss_and_grads(cfg, 1, params, batch, fsdp=1)[0])


@pytest.mark.slow
def test_train_step_metrics_equal_cp1(xla_setup):
  """The real train step (train.make_train_step) with CP 4 vs without: loss and grad norm."""
  cfg, params, batch, _ = xla_setup
  out = {}
  for cp in (1, 4):
    mesh = _mesh(cfg, cp)
    tx = optim.make_optimizer(cfg.opt)
    state, shardings = train.create_state(cfg, tx, mesh, jax.random.key(1))
    state = state._replace(params=jax.device_put(params, shardings.params))
    step = jax.jit(train.make_train_step(cfg, optim.make_optimizer(cfg.opt), mesh, accum=1))
    _, metrics = step(state, _put(batch, mesh))
    out[cp] = jax.device_get(metrics)
  for name in ('train/CE loss', 'train/Z loss', 'optim/total grad norm'):
    np.testing.assert_allclose(out[4][name], out[1][name], rtol=RTOL, err_msg=name)


def test_activation_memory_falls_with_the_cp_degree():
  cfg = _config(seq_len=512, window=128)
  cfg.data.global_batch_size = 1
  params = model.init_params(cfg.model, jax.random.key(0))
  batch = _batch(cfg, docs=True)
  batch = {k: v[:1] for k, v in batch.items()}
  temps = {}
  for cp in (1, 2, 4, 8):
    _, compiled = _loss_and_grads(cfg, cp, params, batch, fsdp=1, run=False)
    temps[cp] = compiled.memory_analysis().temp_size_in_bytes
  # Measured 17.6, 11.3, 5.3, 3.1 MB: each doubling removes at least a fifth.
  assert temps[2] < 0.8 * temps[1] and temps[4] < 0.8 * temps[2] and temps[8] < 0.8 * temps[4], temps


# --- The train state over the context axis ---------------------------------------


def _allocated_bytes(tree, device) -> int:
  return sum(x.data.nbytes for leaf in jax.tree.leaves(tree) for x in leaf.addressable_shards
             if x.device == device)


def test_state_is_sharded_over_the_context_axis_and_restores_onto_any_mesh(tmp_path):
  """Weights and Adam moments shard over ('fsdp', 'context'): per-device state falls by the
  CP degree (sharding.state_bytes equals what a real state allocates), and a checkpoint saved
  on a CP mesh restores bit-exactly onto meshes with and without a context axis."""
  import checkpoint
  cfg = _config()
  cfg.model.d_model, cfg.model.mlp_hidden = 64, 128  # d_model splits 8 ways
  tx = optim.make_optimizer(cfg.opt)
  sizes = {}
  for fsdp, cp in ((2, 1), (2, 2), (2, 4)):
    shape = {'data': 1, 'fsdp': fsdp, 'tensor': 1} | ({'context': cp} if cp > 1 else {})
    sizes[fsdp, cp] = sharding.state_bytes(train.abstract_state(cfg, tx), shape)
  # Independently: every projection and the lm_head hold 1 / (fsdp * cp) of themselves; the
  # embedding table (kept on 'fsdp', see sharding.PARAM_SPECS) and the norms what they held.
  names = ('w_q', 'w_k', 'w_v', 'w_o', 'w_gate', 'w_up', 'w_down', 'w')
  matrices = sum(x.size * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(
      train.abstract_state(cfg, tx).params) if path[-1].key in names)
  for cp in (2, 4):
    saved = sizes[2, 1][0] - sizes[2, cp][0]
    assert saved == matrices // 2 - matrices // (2 * cp), (cp, sizes)
    assert sizes[2, 1][1] - sizes[2, cp][1] == 2 * saved  # Adam mu and nu alike
  mesh = _mesh(cfg, 4, fsdp=2)
  state, shardings = train.create_state(cfg, tx, mesh, jax.random.key(3))
  assert shardings.params['attention']['w_q'].spec[1] == ('fsdp', 'context')
  params, opt = sharding.state_bytes(train.abstract_state(cfg, tx), dict(mesh.shape))
  for device in mesh.devices.flat:
    assert _allocated_bytes(state.params, device) == params
    assert _allocated_bytes(state.opt_state, device) == opt
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  ckpt.save(1, state)
  ckpt.wait()
  want = jax.device_get(state)
  for fsdp, cp in ((8, 1), (1, 8), (4, 2)):
    restored, _ = checkpoint.restore_latest_good(
        str(tmp_path), train.abstract_state(cfg, tx, _mesh(cfg, cp, fsdp=fsdp)))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), want)


# --- The pieces -----------------------------------------------------------------


@pytest.mark.parametrize('cp,window,head_stride,docs,impl', [
    (4, None, 1, True, 'xla'), (8, 5, 2, True, 'xla'), (2, 40, 4, False, 'xla'),
    (4, 12, 1, True, 'pallas'), (8, None, 2, False, 'pallas'), (2, 20, 1, True, 'pallas-k256'),
    (2, None, 2, True, 'pallas-buffers')])
def test_attention_and_its_gradients_equal_the_float64_oracle(cp, window, head_stride, docs,
                                                              impl):
  """context_parallel.attention alone, in the zig-zag layout, vs attention_np.

  'pallas' runs both chunks of a device in one kernel call placed by its
  device index (PallasLocal.zigzag); 'pallas-buffers' the kernel's buffer form
  (a static query offset), as any other local attention is called.
  """
  b, t, h, g = 2, 64, 4, 2
  d = {'xla': 8, 'pallas-k256': 256}.get(impl, 128)
  local = (context_parallel.xla_local if impl == 'xla' else
           context_parallel.pallas_local(None, None, interpret=True))
  if impl == 'pallas-buffers':
    local = lambda *args: context_parallel.pallas_local(None, None, interpret=True)(*args)
  rng = np.random.default_rng(cp)
  q, do = (rng.normal(size=(b, t, h, d)).astype(np.float32) for _ in range(2))
  k, v = (rng.normal(size=(b, t, g, d)).astype(np.float32) for _ in range(2))
  seg = np.cumsum(rng.random((b, t)) < 0.1, axis=1).astype(np.int32) if docs else None
  want_o, want_grads = attention_oracle.attention_np(q, k, v, do, window, seg)
  # All 8 devices: fsdp 8 // cp (2 rows do not split over fsdp 4: rows stay whole).
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(8 // cp, cp), ('fsdp', 'context'))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  lay = lambda x: None if x is None else jax.device_put(
      context_parallel.to_layout(jnp.asarray(x), cp), on_mesh)

  @jax.jit
  def run(q, k, v, seg, do):
    def attend(q, k, v):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return context_parallel.attention(q, k, v, window=window, segment_ids_BT=seg,
                                          local=local, head_stride=head_stride)
    o, vjp = jax.vjp(attend, q, k, v)
    return o, vjp(do)
  o, grads = run(lay(q), lay(k), lay(v), lay(seg), lay(do))
  back = lambda x: np.asarray(context_parallel.from_layout(x, cp))
  np.testing.assert_allclose(back(o), want_o, atol=2e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(back(got), want, atol=5e-5)


@pytest.mark.parametrize('seq_len,block', [(65536, 512), (8192, 256), (4096, 128)])
def test_pallas_work_per_device_falls_with_the_cp_degree(seq_len, block):
  """The flash kernel's grid steps per device (its block-visit count) under CP: 1/C of the
  unsplit layer's on full-attention layers, the same on every device, and near 1/C under a
  window (the grid is the busiest device's)."""
  full = context_parallel.pallas_block_visits(seq_len, 1, block, block, None)[0]
  window = seq_len // 16
  sliding = context_parallel.pallas_block_visits(seq_len, 1, block, block, window)[0]
  for cp in (2, 4, 8):
    per_device = context_parallel.pallas_block_visits(seq_len, cp, block, block, None)
    assert per_device == [full // cp] * cp  # zig-zag: equal, and no pair computed twice
    busiest = max(context_parallel.pallas_block_visits(seq_len, cp, block, block, window))
    assert busiest * cp <= 1.1 * sliding, (cp, busiest, sliding)
  # Against the kernel's own schedule of the unsplit layer: the same pairs, split over devices.
  assert full == kernels.kv_block_visits(seq_len, block, block, None)


@pytest.mark.parametrize('seq_len,cp', [(16, 2), (48, 3), (64, 8)])
def test_layout_round_trip_and_balance(seq_len, cp):
  order = context_parallel.zigzag_order(seq_len, cp)
  assert sorted(order) == list(range(seq_len))
  x = jnp.arange(seq_len)[None]
  np.testing.assert_array_equal(context_parallel.from_layout(context_parallel.to_layout(x, cp), cp), x)
  # Causal work per device (keys each query sees) is the same on every device.
  work = (order + 1).reshape(cp, -1).sum(axis=1)
  assert len(set(work.tolist())) == 1


def test_seq_len_not_divisible_is_a_clear_error():
  with pytest.raises(ValueError, match='multiple of 2 x mesh_context'):
    context_parallel.zigzag_order(60, 4)
  cfg = _config()
  cfg.data.seq_len, cfg.train.mesh_context = 60, 4
  with pytest.raises(ValueError, match='data.seq_len or train.mesh_context'):
    config_checks.validate(cfg)
