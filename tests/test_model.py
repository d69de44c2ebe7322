"""model.py and formats/hf_ckpt.py against HF transformers' Olmo3ForCausalLM (CPU torch)."""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Olmo3Config, Olmo3ForCausalLM

import config_checks
from evaluation import compare
from formats import hf_ckpt
import model
from configs import olmo3_7b, olmo3_7b_hd256, olmo3_32b, small

HF_CASES = {
    # name: HF config overrides (hidden 64, 4 layers unless said)
    'mha': dict(num_attention_heads=4, num_key_value_heads=4),
    'gqa': dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    'yarn': dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=8,
                 rope_scaling={'rope_type': 'yarn', 'factor': 8.0, 'beta_fast': 32.0,
                               'beta_slow': 1.0, 'original_max_position_embeddings': 16},
                 max_position_embeddings=128),
}


def make_hf(tmp_path, case: str, seed: int = 0) -> str:
  """A tiny random Olmo 3 with random norm weights, saved with save_pretrained."""
  kwargs = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                sliding_window=5, rms_norm_eps=1e-6, rope_theta=500_000.0,
                pad_token_id=1, eos_token_id=0)
  kwargs.update(HF_CASES[case])
  torch.manual_seed(seed)
  hf = Olmo3ForCausalLM(Olmo3Config(**kwargs))
  with torch.no_grad():  # so a misplaced or mis-cast norm shows in the logits
    for name, p in hf.named_parameters():
      if 'norm' in name:
        p.copy_(1 + 0.5 * torch.randn_like(p))
  path = str(tmp_path / case)
  hf.save_pretrained(path)
  return path


def hf_logits(path: str, tokens: np.ndarray) -> np.ndarray:
  hf = Olmo3ForCausalLM.from_pretrained(path, attn_implementation='eager')
  with torch.no_grad():
    return hf(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.parametrize('case', sorted(HF_CASES))
@pytest.mark.parametrize('seq_len', [13, 24])
def test_logits_match_hf(tmp_path, case, seq_len):
  path = make_hf(tmp_path, case)
  tokens = np.random.default_rng(seq_len).integers(0, 250, size=(2, seq_len))
  params, cfg = hf_ckpt.load_hf(path)
  cfg.dtype = 'float32'
  ours = np.asarray(model.logits(params, jnp.asarray(tokens), cfg))[..., :250]
  ref = hf_logits(path, tokens)
  assert np.abs(ours - ref).max() < 1e-4
  stats = compare.compare_logits(ref, ours)
  assert stats['kl_mean'] < 1e-6 and stats['top1_agreement'] == 1.0


def test_config_dialects_agree(tmp_path):
  path = make_hf(tmp_path, 'yarn')
  with open(os.path.join(path, 'config.json')) as f:
    nested = json.load(f)  # transformers 5.23 writes the nested dialect
  assert 'full_attention' in nested['rope_parameters']
  hub = hf_ckpt.hf_config(hf_ckpt.model_config_from_hf(nested), nested['vocab_size'])
  flat = dict(hub, rope_parameters=dict(hub['rope_scaling'], rope_theta=hub['rope_theta']))
  del flat['rope_scaling'], flat['rope_theta']
  configs = [hf_ckpt.model_config_from_hf(d) for d in (nested, hub, flat)]
  assert configs[0].to_dict() == configs[1].to_dict() == configs[2].to_dict()
  assert configs[0].yarn.enabled and configs[0].layer_pattern == 'SSSF'


def test_round_trips_are_exact(tmp_path):
  src = make_hf(tmp_path, 'gqa')
  params, cfg = hf_ckpt.load_hf(src)
  # Nonzero pad rows: exporting all rows (vocab_size=None) keeps them.
  params['lm_head']['w'][:, 250:] = np.random.default_rng(1).normal(size=(64, 6))
  hf_ckpt.save_hf(params, cfg, str(tmp_path / 'all'), max_shard_bytes=20_000)
  again, cfg2 = hf_ckpt.load_hf(str(tmp_path / 'all'))
  assert cfg2.to_dict() == cfg.to_dict()
  chex.assert_trees_all_equal(params, again)

  # HF -> ours -> HF (tokenizer vocab) gives back the same tensors and logits.
  hf_ckpt.save_hf(params, cfg, str(tmp_path / 'hf'), vocab_size=250)
  tokens = np.arange(22).reshape(2, 11)
  np.testing.assert_array_equal(hf_logits(src, tokens), hf_logits(str(tmp_path / 'hf'), tokens))


def test_bf16_export_loads_in_hf(tmp_path):
  params, cfg = hf_ckpt.load_hf(make_hf(tmp_path, 'mha'))
  hf_ckpt.save_hf(params, cfg, str(tmp_path / 'bf16'), vocab_size=250, dtype='bfloat16')
  hf = Olmo3ForCausalLM.from_pretrained(str(tmp_path / 'bf16'))
  assert hf.model.embed_tokens.weight.dtype == torch.bfloat16


def test_conversion_errors(tmp_path):
  path = make_hf(tmp_path, 'mha')
  with open(os.path.join(path, 'config.json')) as f:
    good = json.load(f)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(dict(good, intermediate_size=128), f)
  with pytest.raises(hf_ckpt.ConversionError, match='mlp.down_proj'):
    hf_ckpt.load_hf(path)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(dict(good, num_hidden_layers=8, layer_types=good['layer_types'] * 2), f)
  with pytest.raises(hf_ckpt.ConversionError, match='missing'):
    hf_ckpt.load_hf(path)
  with pytest.raises(hf_ckpt.ConversionError, match='layer_types'):
    hf_ckpt.model_config_from_hf(dict(good, num_hidden_layers=8))
  with pytest.raises(hf_ckpt.ConversionError, match='llama'):
    hf_ckpt.model_config_from_hf(dict(good, model_type='llama'))
  with pytest.raises(FileNotFoundError, match='config.json'):
    hf_ckpt.load_hf(str(tmp_path / 'nowhere'))


def test_published_parameter_counts():
  c7 = olmo3_7b.get_config().model
  assert model.param_count(c7) == 7_298_617_344
  c7.vocab_size = 100278
  assert model.param_count(c7) == 7_298_011_136
  assert model.param_count(olmo3_7b_hd256.get_config().model) == 7_298_617_344
  c32 = olmo3_32b.get_config().model
  c32.vocab_size = 100278
  assert model.param_count(c32) == 32_233_522_176


def test_param_count_equals_tree_size():
  cfg = config_checks.complete(small.get_config()).model
  shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == model.param_count(cfg)


def test_flops_match_olmo_core():
  from olmo_core.nn.attention import SlidingWindowAttentionConfig
  from olmo_core.nn.transformer import TransformerConfig
  oc = TransformerConfig.olmo3_7B(vocab_size=512)
  oc.d_model, oc.n_layers = 64, 8
  oc.block.sequence_mixer.n_heads = 4
  oc.block.sequence_mixer.backend = 'torch'
  oc.block.sequence_mixer.sliding_window = SlidingWindowAttentionConfig(
      pattern=[16, 16, 16, -1], force_full_attention_on_first_layer=False,
      force_full_attention_on_last_layer=False)
  oc.block.feed_forward.hidden_size = 96
  reference = oc.build(init_device='cpu').num_flops_per_token(100)
  cfg = config_checks.complete(small.get_config()).model
  cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads = 512, 64, 8, 4
  cfg.num_kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.sliding_window = 4, 16, 96, 16
  assert model.flops_per_token(cfg, 100) == reference


def _tiny_cfg(**overrides):
  cfg = config_checks.complete(small.get_config()).model
  cfg.vocab_size, cfg.d_model, cfg.num_heads, cfg.num_kv_heads = 64, 32, 4, 2
  cfg.head_dim, cfg.mlp_hidden, cfg.sliding_window, cfg.num_layers = 8, 48, 4, 8
  cfg.update(overrides)
  return cfg


def _token_loss(params, tokens, cfg, t):
  return jax.nn.log_softmax(model.logits(params, tokens, cfg))[0, t, 3]


def test_causality():
  cfg = _tiny_cfg()
  params = model.init_params(cfg, jax.random.key(0))
  embed = params['embed']['embedding']
  tokens = jnp.arange(12)[None] % 64

  def loss_from_inputs(x_TD, t):
    p = dict(params, embed={'embedding': embed.at[tokens[0]].set(x_TD)})
    return _token_loss(p, tokens, cfg, t)
  grad = jax.jit(jax.grad(loss_from_inputs))  # t traced: one compile for every position
  for t in (0, 5, 11):
    g_TD = grad(embed[tokens[0]], jnp.int32(t))
    assert np.all(np.asarray(g_TD[t + 1:]) == 0)
    assert np.any(np.asarray(g_TD[:t + 1]) != 0)


@pytest.mark.parametrize('plus_one', [False, True])
def test_sliding_window_edge(plus_one):
  """With every layer sliding, a key just outside the window has no influence."""
  cfg = _tiny_cfg(layer_pattern='S', num_layers=1, sliding_window_plus_one=plus_one)
  params = model.init_params(cfg, jax.random.key(1))
  t, w = 9, cfg.sliding_window + int(plus_one)
  embed = params['embed']['embedding']
  tokens = (jnp.arange(12)[None] * 7) % 64

  def out(x_TD):
    p = dict(params, embed={'embedding': embed.at[tokens[0]].set(x_TD)})
    return _token_loss(p, tokens, cfg, t)
  g_TD = np.asarray(jax.jit(jax.grad(out))(embed[tokens[0]]))  # jit: 1 compile, not 100s
  assert np.all(g_TD[t - w] == 0)  # just outside: query t sees (t-w, t]
  assert np.any(g_TD[t - w + 1] != 0)  # just inside


def test_segment_ids_isolate_documents():
  """A packed second document (positions restarted) equals that document alone."""
  cfg = _tiny_cfg()
  params = model.init_params(cfg, jax.random.key(2))
  tokens = jax.random.randint(jax.random.key(3), (1, 10), 0, 64)
  segments = jnp.array([[0] * 4 + [1] * 6])
  positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
  w = params['lm_head']['w']
  alone = np.asarray(model.logits(params, tokens[:, 4:], cfg))
  packed = model.build(cfg).apply(params, tokens, segments, positions) @ w
  np.testing.assert_allclose(np.asarray(packed[:, 4:]), alone, atol=1e-5)
  unmasked = model.build(cfg).apply(params, tokens, None, positions) @ w
  assert not np.allclose(np.asarray(unmasked[:, 4:]), alone, atol=1e-3)


def _remat_loss(p, tokens, cfg):
  return -jnp.mean(jax.nn.log_softmax(model.logits(p, tokens, cfg))[:, :-1, :].max(-1))


@pytest.fixture(scope='module')
def no_remat():
  """(params, tokens, loss, grads) without remat: compiled once for the three policies."""
  base = _tiny_cfg(remat='none')
  params = model.init_params(base, jax.random.key(4))
  tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 64)
  loss, grads = jax.jit(jax.value_and_grad(lambda p: _remat_loss(p, tokens, base)))(params)
  return params, tokens, loss, grads


@pytest.mark.parametrize('policy', ['full', 'save_dots', 'save_proj', 'outs,attn',
                                    'F:qkv,03:gate_up@host,mlp_out'])
def test_remat_changes_nothing(policy, no_remat):
  params, tokens, ref_loss, ref_grad = no_remat
  cfg = _tiny_cfg(remat=policy)
  got_loss, got_grad = jax.jit(jax.value_and_grad(lambda p: _remat_loss(p, tokens, cfg)))(params)
  # Recomputation changes XLA's fusion and so float32 summation order: equal
  # to rounding (grads are ~1e-2; observed differences <= 6e-7), not bitwise.
  np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
  chex.assert_trees_all_close(got_grad, ref_grad, rtol=1e-4, atol=2e-6)


def test_a_save_list_names_each_layers_activations():
  cfg = _tiny_cfg(layer_pattern='SSSF', remat='outs, F:qkv@host, 01:mlp_up')
  got = model.remat_plan(cfg)
  want_device = {f'block{j}.{n}' for j in range(4) for n in ('attn_proj', 'mlp_out')}
  want_device |= {'block0.mlp_up', 'block1.mlp_up'}
  assert set(got['device']) == want_device
  assert set(got['host']) == {'block3.q_proj', 'block3.k_proj', 'block3.v_proj'}
  assert model.remat_plan(_tiny_cfg(remat='full')) == {'device': (), 'host': ()}
  assert model.remat_plan(_tiny_cfg(remat='none')) is None
  presets = {p: model.remat_plan(_tiny_cfg(remat=p)) for p in ('save_qkv_attn', 'save_proj')}
  assert {n.split('.')[1] for n in presets['save_qkv_attn']['device']} == {
      'q_proj', 'k_proj', 'v_proj', 'attn_out', 'attn_lse'}
  assert {n.split('.')[1] for n in presets['save_proj']['device']} == set(model.ACTIVATIONS)


def test_the_backward_keeps_what_the_policy_names(capsys):
  """jax's own account of the residuals: each named save, on the device or the host."""
  cfg = _tiny_cfg(num_layers=4, layer_pattern='SSSF', remat='mlp_out,F:qkv,1:attn@host')
  params = model.init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((1, 16), jnp.int32)
  jax.ad_checkpoint.print_saved_residuals(lambda p: _remat_loss(p, tokens, cfg), params)
  lines = capsys.readouterr().out.splitlines()
  named = {line.split("named '")[1].split("'")[0] for line in lines if "named '" in line}
  assert named == {f'block{j}.mlp_out' for j in range(4)} | {
      'block3.q_proj', 'block3.k_proj', 'block3.v_proj'}
  # The XLA path's attention output of layer 1 ([B, T, H, K]) goes to host memory.
  assert [line.split()[0] for line in lines if '<host>' in line] == ['f32<host>[1,16,4,8]']


@pytest.mark.parametrize('spec, match', [
    ('qkv@disk', "only be 'host'"), ('X:qkv', 'neither S, F nor positions'),
    ('4:qkv', 'neither S, F nor positions'), ('mlp', 'names no activation'),
    ('qkv,F:q_proj@host', 'both kept on the device and offloaded')])
def test_a_bad_save_list_is_named(spec, match):
  with pytest.raises(ValueError, match=match):
    model.validate(_tiny_cfg(layer_pattern='SSSF', remat=spec))
  with pytest.raises(ValueError, match="has no 'S' layer"):
    model.validate(_tiny_cfg(layer_pattern='F', num_layers=2, remat='S:qkv'))


def test_bad_config_is_named():
  with pytest.raises(ValueError, match='num_kv_heads'):
    model.validate(_tiny_cfg(num_kv_heads=3))
  with pytest.raises(ValueError, match='layer_pattern'):
    model.validate(_tiny_cfg(num_layers=6))
  with pytest.raises(ValueError, match='remat'):
    model.validate(_tiny_cfg(remat='sometimes'))


def test_importing_the_model_changes_no_environment():
  """No import-time side effects: XLA's CPU flags are the entry points' to set
  (kernels.xla.set_cpu_flags), not a consequence of `import model`."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('import os, jax; before = dict(os.environ); import model, train, data, eval, plan; '
          'assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert proc.returncode == 0, proc.stderr[-2000:]
