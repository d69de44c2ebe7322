"""Stage 3 (long context): YaRN + document masking against HF transformers, RoPE
positions against OLMo-core's RotaryEmbedding, and the stage-2 -> stage-3 start.

References: HF `Olmo3ForCausalLM` run on each document separately (float32,
eager attention); OLMo-core 3.0's `RotaryEmbedding` on packed documents
(`cu_doc_lens`) and on the RoPE tables its llama3 context-parallel load
balancer shards; the stage-2 checkpoint's own arrays.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Olmo3Config, Olmo3ForCausalLM

import checkpoint
import config_checks
from formats import hf_ckpt
from formats import init_from
import model
import optim
import sharding
import train
from configs import long_context_small, olmo3_7b_stage3

ORIGINAL = 16  # YaRN's original context in the tiny HF model; documents reach 3x beyond it


@pytest.fixture(scope='module')
def hf_yarn(tmp_path_factory):
  """A tiny Olmo 3 with YaRN (full layers only), GQA, window 5, random norm weights."""
  torch.manual_seed(0)
  hf = Olmo3ForCausalLM(Olmo3Config(
      vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
      num_attention_heads=4, num_key_value_heads=2, sliding_window=5, rms_norm_eps=1e-6,
      rope_theta=500_000.0, max_position_embeddings=8 * ORIGINAL, pad_token_id=1,
      eos_token_id=0, rope_scaling={'rope_type': 'yarn', 'factor': 8.0, 'beta_fast': 32.0,
                                    'beta_slow': 1.0,
                                    'original_max_position_embeddings': ORIGINAL}))
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if 'norm' in name:
        p.copy_(1 + 0.5 * torch.randn_like(p))
  path = str(tmp_path_factory.mktemp('hf') / 'yarn')
  hf.save_pretrained(path)
  return Olmo3ForCausalLM.from_pretrained(path, attn_implementation='eager').eval(), path


def _packed(seed: int, doc_lens: list[int]):
  rng = np.random.default_rng(seed)
  t = sum(doc_lens)
  tokens = rng.integers(2, 250, size=(1, t))
  segment_ids = np.repeat(np.arange(len(doc_lens)), doc_lens)[None].astype(np.int32)
  return tokens, segment_ids


@pytest.mark.parametrize('document_positions', [False, True])
@pytest.mark.parametrize('seed,doc_lens', [(0, [7, 30, 1, 26]), (1, [48, 16])])
def test_yarn_with_documents_matches_hf(hf_yarn, document_positions, seed, doc_lens):
  """Packed forward with segment ids == HF on each document alone (float32, < 1e-4)."""
  hf, path = hf_yarn
  tokens, segment_ids = _packed(seed, doc_lens)
  params, cfg = hf_ckpt.load_hf(path)
  cfg.dtype, cfg.rope_document_positions = 'float32', document_positions
  ours = np.asarray(model.logits(params, jnp.asarray(tokens), cfg,
                                 jnp.asarray(segment_ids)))[0, :, :250]
  refs, start = [], 0
  with torch.no_grad():
    for n in doc_lens:
      # Positions: 0.. per document, or the document's place in the packed row.
      pos = torch.arange(n)[None] + (0 if document_positions else start)
      refs.append(hf(torch.as_tensor(tokens[:, start:start + n]), position_ids=pos
                     ).logits[0].numpy())
      start += n
  assert np.abs(ours - np.concatenate(refs)).max() < 1e-4


def _olmo_core_rope(head_dim: int):
  from olmo_core.nn.rope import RotaryEmbedding
  return RotaryEmbedding(head_size=head_dim, theta=500_000)


def _ours_rope(x_BTHK: np.ndarray, positions_BT) -> np.ndarray:
  cfg = config_checks.complete(long_context_small.get_config()).model
  cfg.head_dim, cfg.yarn.enabled = x_BTHK.shape[-1], False
  cos, sin = model.rope_tables(jnp.asarray(positions_BT), *model.rope_frequencies(cfg, True))
  return np.asarray(model.apply_rope(jnp.asarray(x_BTHK), cos, sin))


@pytest.mark.parametrize('doc_lens', [[5, 11, 1, 15], [32]])
def test_document_positions_are_olmo_core_cu_doc_lens_rope(doc_lens):
  """OLMo-core 3.0 without CP: RoPE restarts at each document (cu_doc_lens)."""
  t, k = sum(doc_lens), 16
  rng = np.random.default_rng(len(doc_lens))
  q = rng.normal(size=(1, t, 2, k)).astype(np.float32)
  cu = torch.as_tensor(np.cumsum([0] + doc_lens), dtype=torch.int32)
  ref, _ = _olmo_core_rope(k)(torch.as_tensor(q), torch.as_tensor(q), head_first=False,
                              cu_doc_lens=cu)
  cfg = config_checks.complete(long_context_small.get_config()).model
  cfg.rope_document_positions = True
  segment_ids = jnp.asarray(np.repeat(np.arange(len(doc_lens)), doc_lens)[None])
  positions = model.positions(cfg, 1, t, segment_ids)
  np.testing.assert_array_equal(positions[0], np.concatenate([np.arange(n) for n in doc_lens]))
  np.testing.assert_allclose(_ours_rope(q, positions), ref.numpy(), atol=2e-6)
  cfg.rope_document_positions = False  # the knob off: 0..T-1 whatever the documents
  np.testing.assert_array_equal(model.positions(cfg, 1, t, segment_ids)[0], np.arange(t))


def test_document_positions_equal_olmo_core_per_document_forwards():
  """OLMo-core's own model (torch, CPU) run on each document alone, which its
  cu_doc_lens RoPE is defined to reproduce, equals our packed forward with
  rope_document_positions. With positions 0..T-1 it does too, up to rounding:
  RoPE logits depend on position differences only, and documents never
  attend across boundaries (docs/long_context.md)."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'scripts'))
  import reproduce_olmo_core as repro
  cfg = repro.repro_config(repro.run_overrides(4, 1, repro.shape_overrides(
      d_model=64, mlp_hidden=192, window=16, seq_len=64, batch_size=4)))
  net = repro.olmo_core_model(cfg, init_seed=3)
  params = repro.olmo_core_to_params(net.state_dict(), cfg.model.num_layers)
  doc_lens = [9, 30, 25]
  tokens, segment_ids = _packed(2, doc_lens)
  starts = np.cumsum([0] + doc_lens)
  reference = np.concatenate([repro.olmo_core_logits(net, tokens[:, a:b])[0]
                              for a, b in zip(starts[:-1], starts[1:])])
  m = cfg.model
  m.dtype = 'float32'
  diffs = {}
  for restart in (True, False):
    m.rope_document_positions = restart
    ours = np.asarray(model.logits(params, jnp.asarray(tokens), m, jnp.asarray(segment_ids)))[0]
    diffs[restart] = np.abs(ours - reference[:, :ours.shape[-1]]).max(axis=-1)
  assert diffs[True].max() < 1e-4 and diffs[False].max() < 1e-4, diffs


@pytest.mark.parametrize('cp,rank', [(2, 1), (4, 3)])
def test_cp_positions_are_olmo_core_sharded_tables(cp, rank):
  """OLMo-core 3.0 under llama3 CP (how Ai2 ran stage 3): each rank's RoPE tables are its
  contiguous slice of the 0..T-1 tables and cu_doc_lens never reaches RoPE, so
  positions do not restart at documents."""
  t, k = 32, 16
  rope = _olmo_core_rope(k)
  sin, cos = rope.get_buffers(t, torch.device('cpu')).pos_sin, rope.get_buffers(
      t, torch.device('cpu')).pos_cos
  local = slice(rank * t // cp, (rank + 1) * t // cp)  # RingAttentionLlama3LoadBalancer
  q = np.random.default_rng(cp).normal(size=(1, t // cp, 2, k)).astype(np.float32)
  ref, _ = rope(torch.as_tensor(q), torch.as_tensor(q), head_first=False,
                pos_sin=sin[local], pos_cos=cos[local])
  # The stage-3 default: rope_document_positions off.
  cfg = config_checks.complete(long_context_small.get_config()).model
  assert not olmo3_7b_stage3.get_config().model.rope_document_positions
  positions = model.positions(cfg, 1, t, jnp.asarray(np.repeat([0, 1, 2], [5, 20, 7])[None]))
  np.testing.assert_allclose(_ours_rope(q, positions[:, local]), ref.numpy(), atol=2e-6)


# --- Stage 2 -> stage 3 -------------------------------------------------------------


def test_stage3_config_numbers():
  c = olmo3_7b_stage3.get_config()
  assert (c.data.seq_len, c.data.global_batch_size, c.data.seed) == (65_536, 64, 34521)
  assert (c.opt.schedule, c.opt.warmup_steps, c.opt.final_lr) == ('linear', 200, 0.0)
  assert c.opt.t_max == c.train.steps == -(-50_000_000_000 // (65_536 * 64))
  assert c.model.yarn.enabled and c.train.mesh_context == 8 and c.train.reset_step_on_init
  assert (c.data.source_group_size, c.data.source_permutation_seed) == (8, 123)
  lr = np.asarray(optim.lr_schedule(c.opt)(np.arange(1, c.train.steps + 1)))
  # Warmup to the peak at step 200, then linear to exactly 0 at the last published checkpoint.
  np.testing.assert_allclose(lr[[0, 199]], [c.opt.lr / 200, c.opt.lr], rtol=1e-12)
  assert lr[-1] == 0.0 and np.all(np.diff(lr[199:]) < 0)


def test_stage3_starts_from_stage2_with_moments_kept(tmp_path):
  """init_from a stage-2 train checkpoint: weights and Adam moments/count taken,
  step, schedule, skip history and data order restarted; YaRN and CP switched on."""
  cfg2 = config_checks.complete(long_context_small.get_config())
  m = cfg2.model
  m.num_layers, m.d_model, m.mlp_hidden, m.yarn.enabled = 4, 64, 128, False
  cfg2.train.mesh_context, cfg2.train.mesh_fsdp = 1, -1
  mesh2 = sharding.make_mesh(cfg2.train, jax.devices()[:2])
  state, _ = train.create_state(cfg2, optim.make_optimizer(cfg2.opt), mesh2, jax.random.key(0))
  rng = np.random.default_rng(0)
  fake = lambda x: jnp.asarray(rng.normal(size=x.shape).astype(x.dtype))
  opt = state.opt_state._replace(mu=jax.tree.map(fake, state.opt_state.mu),
                                 nu=jax.tree.map(lambda x: jnp.abs(fake(x)), state.opt_state.nu),
                                 count=jnp.asarray(47_684, state.opt_state.count.dtype),
                                 step=jnp.asarray(47_684, state.opt_state.step.dtype))
  stage2 = state._replace(opt_state=opt)
  ckpt_dir = str(tmp_path / 'stage2')
  saver = checkpoint.Checkpointer(ckpt_dir, fsync=False)
  saver.save(47_684, stage2, {'step': 47_684, 'config': cfg2.to_dict(), 'data': {}})
  saver.close()

  cfg3 = config_checks.complete(long_context_small.get_config())
  cfg3.model.update(num_layers=4, d_model=64, mlp_hidden=128)
  cfg3.train.update(init_from=ckpt_dir, reset_step_on_init=True, mesh_fsdp=1, mesh_context=2)
  mesh3 = sharding.make_mesh(cfg3.train, jax.devices()[:2])
  fresh, shardings = train.create_state(cfg3, optim.make_optimizer(cfg3.opt), mesh3,
                                        jax.random.key(1))
  tx3 = optim.make_optimizer(cfg3.opt)
  started = init_from.load(cfg3, train.abstract_state(cfg3, tx3, mesh3), fresh, shardings)
  got, want = jax.device_get(started), jax.device_get(stage2)
  for a, b in zip(jax.tree.leaves((got.params, got.opt_state.mu, got.opt_state.nu)),
                  jax.tree.leaves((want.params, want.opt_state.mu, want.opt_state.nu))):
    np.testing.assert_array_equal(a, b)
  assert int(got.opt_state.count) == 47_684 and int(got.opt_state.step) == 0
  assert int(got.opt_state.history_len) == 0
  # Nothing in the new workdir: the loader starts stage 3's own order at step 0.
  ckpt3 = checkpoint.Checkpointer(str(tmp_path / 'stage3'), fsync=False)
  state3, data_state = train.restore_or_init(cfg3, optim.make_optimizer(cfg3.opt), mesh3, ckpt3)
  ckpt3.close()
  assert data_state is None and int(state3.opt_state.step) == 0
  assert int(state3.opt_state.count) == 47_684
  # Its first update uses step 1 of stage 3's schedule (warmup from 0), Adam's count goes on.
  _, after = jax.jit(optim.make_optimizer(cfg3.opt).update)(
      started.params, started.opt_state, started.params, loss=jnp.float32(3.0))
  np.testing.assert_allclose(after.lr, cfg3.opt.lr / cfg3.opt.warmup_steps, rtol=1e-6)
  assert int(after.count) == 47_685 and int(after.step) == 1
