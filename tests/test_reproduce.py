"""scripts/reproduce_olmo_core.py: OLMo-core (CPU torch) is the reference throughout.

The fast tests check the weight conversion and the sliding-window mapping on
OLMo-core's own tiny Olmo 3; the slow one runs the whole reproduction at a
smaller shape for a few steps (train.py in a subprocess on one CPU device).
"""

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'scripts'))

import data  # noqa: E402
import reproduce_olmo_core as repro  # noqa: E402
from evaluation import compare  # noqa: E402

# A smaller model than configs/tiny_repro.py so the test runs in about a minute.
SMALL = {'model.d_model': 64, 'model.head_dim': 16, 'model.mlp_hidden': 192,
         'model.sliding_window': 16, 'data.seq_len': 64, 'data.global_batch_size': 4,
         'train.micro_batch_size': 4}


def _tokens(cfg, n=2):
  val = data.Dataset.from_config(cfg.data, paths=list(cfg.data.validation_paths))
  return val.read(np.arange(n))


def test_converted_olmo_core_init_gives_olmo_core_logits():
  cfg = repro.repro_config(repro.run_overrides(4, 1, SMALL))
  model = repro.olmo_core_model(cfg, init_seed=3)
  params = repro.olmo_core_to_params(model.state_dict(), cfg.model.num_layers)
  tokens = _tokens(cfg)
  reference = repro.olmo_core_logits(model, tokens)
  same = compare.compare_logits(reference, repro.our_logits(cfg, params, tokens))
  assert same['max_abs_logit_diff'] < 1e-4 and same['kl_max'] < 1e-9, same
  # The window mapping is what makes them equal: a W+1 window is visibly different.
  cfg.model.sliding_window_plus_one = True
  wider = compare.compare_logits(reference, repro.our_logits(cfg, params, tokens))
  assert wider['max_abs_logit_diff'] > 100 * same['max_abs_logit_diff'], (same, wider)


def test_loss_and_gradients_match_olmo_core_at_the_converted_init():
  """The train step's loss (CE + z-loss over the batch's labels) and every gradient."""
  import jax
  import jax.numpy as jnp
  import torch
  from olmo_core.data.utils import get_labels

  import model
  import optim

  cfg = repro.repro_config(repro.run_overrides(4, 1, SMALL))
  net = repro.olmo_core_model(cfg, init_seed=5)
  params = repro.olmo_core_to_params(net.state_dict(), cfg.model.num_layers)
  batch = data.make_batch(_tokens(cfg, 4), eos_token_id=cfg.data.eos_token_id)
  labels = get_labels({'input_ids': torch.as_tensor(batch['tokens'], dtype=torch.long)})
  out = net(torch.as_tensor(batch['tokens'], dtype=torch.long), labels=labels,
            loss_reduction='sum', z_loss_multiplier=cfg.opt.z_loss,
            loss_div_factor=(labels != -100).sum(), return_logits=False)
  out.loss.backward()
  reference = repro.olmo_core_to_params(
      {name: p.grad for name, p in net.named_parameters()}, cfg.model.num_layers)

  def loss(p):
    h_BTD = model.build(cfg.model).apply(p, batch['tokens'])
    ce, z = optim.loss_sums(h_BTD, p['lm_head']['w'], batch['labels'], batch['instance_mask'],
                            z_loss=cfg.opt.z_loss, chunk=cfg.opt.loss_chunk)
    return (ce + z) / optim.loss_denominator(batch['labels']), ce
  (total, _), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      jax.tree.map(jnp.asarray, params))
  np.testing.assert_allclose(float(total), float(out.loss.detach()), rtol=1e-6)
  for path, ours in jax.tree_util.tree_flatten_with_path(grads)[0]:
    theirs = reference[path[0].key][path[1].key]
    scale = np.abs(theirs).max()
    np.testing.assert_allclose(np.asarray(ours) / scale, theirs / scale, rtol=0, atol=1e-4,
                               err_msg=jax.tree_util.keystr(path))


def test_float64_grad_norm_is_the_exact_norm():
  import torch
  rng = np.random.default_rng(0)
  grads = [rng.standard_normal(n).astype(np.float32) * s for n, s in
           [(8192 * 256, 1e-4), (256 * 768, 1e-2), (256, 1.0)]]
  exact = np.sqrt(sum(np.sum(np.float64(g) ** 2) for g in grads))
  ours = repro.total_grad_norm([torch.from_numpy(g) for g in grads], 'float64')
  np.testing.assert_allclose(float(ours), exact, rtol=1e-7)
  with pytest.raises(ValueError, match='olmo_core_norm'):
    repro.total_grad_norm([], 'float16')


def test_conversion_rejects_a_state_dict_of_another_depth():
  cfg = repro.repro_config(repro.run_overrides(4, 1, SMALL))
  state = repro.olmo_core_model(cfg, init_seed=0).state_dict()
  with pytest.raises(ValueError, match='missing .*blocks.4'):
    repro.olmo_core_to_params(state, cfg.model.num_layers + 1)
  with pytest.raises(ValueError, match='no such field'):
    repro.repro_config({'model.d_modle': 64})


@pytest.mark.slow
def test_short_reproduction_tracks_olmo_core(tmp_path):
  steps = 12
  result = repro.run(str(tmp_path), steps, warmup=3, val_batches=2, kl_instances=2,
                     half_width=2, torch_threads=1, config_overrides=SMALL)
  assert result['step0_logits']['kl_max'] < 1e-9
  assert result['max_lr_rel_diff_ours'] < 1e-6  # both follow CosWithWarmup at the same step
  ours, noise = result['ours'], result['noise']
  # The losses moved (a real run), and ours stays at the noise floor's scale.
  curves = (tmp_path / 'curves.json').read_text()
  assert '"ours"' in curves and (tmp_path / 'loss.png').stat().st_size > 0
  assert ours['max_abs_delta_ce'] < 2e-3, ours
  assert result['acceptance']['passed'], result['acceptance']
  assert abs(ours['held_out_delta']) < 2e-3 and ours['final_kl_mean'] < 1e-4, ours
  assert noise['param_rel_diff'] > 0  # one ulp did perturb the reference run
