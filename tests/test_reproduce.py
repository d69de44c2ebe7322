"""scripts/reproduce_olmo_core.py: OLMo-core (CPU torch) is the reference throughout.

The fast tests check the weight conversion and the sliding-window mapping on
OLMo-core's own tiny Olmo 3 (MHA and GQA), the ulp moves and the criterion on
made-up curves; the slow one runs the whole reproduction at a smaller shape
(train.py and an ensemble of OLMo-core runs in two processes) and asserts that
ours passes the criterion, that every ensemble run passes it against the
others, and that a planted bug fails it.
"""

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'scripts'))

import data  # noqa: E402
from tokens import batches  # noqa: E402
import reproduce_olmo_core as repro  # noqa: E402
from evaluation import compare  # noqa: E402

# A smaller model than configs/tiny_repro.py so the test runs in about a minute.
SMALL = repro.shape_overrides(d_model=64, mlp_hidden=192, window=16, seq_len=64, batch_size=4)


def _tokens(cfg, n=2):
  val = data.Dataset.from_config(cfg.data, paths=list(cfg.data.validation_paths))
  return val.read(np.arange(n))


@pytest.mark.parametrize('kv_heads', [4, 2])
def test_converted_olmo_core_init_gives_olmo_core_logits(kv_heads):
  cfg = repro.repro_config(repro.run_overrides(4, 1, {**SMALL, 'model.num_kv_heads': kv_heads}))
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

  import loss
  import model

  cfg = repro.repro_config(repro.run_overrides(4, 1, SMALL))
  net = repro.olmo_core_model(cfg, init_seed=5)
  params = repro.olmo_core_to_params(net.state_dict(), cfg.model.num_layers)
  batch = batches.make_batch(_tokens(cfg, 4), eos_token_id=cfg.data.eos_token_id)
  labels = get_labels({'input_ids': torch.as_tensor(batch['tokens'], dtype=torch.long)})
  out = net(torch.as_tensor(batch['tokens'], dtype=torch.long), labels=labels,
            loss_reduction='sum', z_loss_multiplier=cfg.opt.z_loss,
            loss_div_factor=(labels != -100).sum(), return_logits=False)
  out.loss.backward()
  reference = repro.olmo_core_to_params(
      {name: p.grad for name, p in net.named_parameters()}, cfg.model.num_layers)

  def objective(p):
    h_BTD = model.build(cfg.model).apply(p, batch['tokens'])
    ce, z = loss.sums(h_BTD, p['lm_head']['w'], batch['labels'], batch['instance_mask'],
                      z_loss=cfg.opt.z_loss, chunk=cfg.opt.loss_chunk)
    return (ce + z) / loss.denominator(batch['labels']), ce
  (total, _), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(
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
  with pytest.raises(ValueError, match='Member.norm'):
    repro.total_grad_norm([], 'float16')


def test_move_ulps_moves_every_weight_by_that_many_ulps():
  import torch
  w = {'a': torch.tensor([1.0, -3.5, 0.0])}
  up, down = repro.move_ulps(w, 2)['a'].numpy(), repro.move_ulps(w, -1)['a'].numpy()
  x = w['a'].numpy()
  np.testing.assert_array_equal(up, np.nextafter(np.nextafter(x, np.inf), np.inf))
  np.testing.assert_array_equal(down, np.nextafter(x, -np.inf))


def test_the_criterion_on_made_up_curves():
  """Runs whose per-step deltas grow and then stay the size of batch-to-batch noise (as
  decorrelated trainings do): a fresh run drawn like the others passes, one shifted by
  three times the ensemble's largest spread fails."""
  rng = np.random.default_rng(0)
  steps, runs = 60, 8
  scale_S = 1e-3 * np.minimum(1.0, np.exp((np.arange(steps) - 30) / 3))
  curves = 5 - np.arange(steps) / 100 + rng.normal(0, 1, (runs, steps)) * scale_S
  ensemble, fresh = curves[:-1], curves[-1]
  member = repro.judge_ce(fresh, ensemble, tokens=2048, half_width=5)
  assert member['fraction_in_envelope'] >= repro.IN_ENVELOPE and member['max_ratio'] <= 2
  spread = (ensemble.max(0) - ensemble.min(0)).max()
  bug = repro.judge_ce(fresh + 3 * spread, ensemble, tokens=2048, half_width=5)
  assert bug['fraction_in_envelope'] < repro.IN_ENVELOPE and bug['max_ratio'] > 2, bug
  assert repro.compact([3, 4, 5, 9, 11, 12]) == '3-5, 9, 11-12'


def test_config_errors():
  cfg = repro.repro_config(repro.run_overrides(4, 1, SMALL))
  state = repro.olmo_core_model(cfg, init_seed=0).state_dict()
  with pytest.raises(ValueError, match='missing .*blocks.4'):
    repro.olmo_core_to_params(state, cfg.model.num_layers + 1)
  with pytest.raises(ValueError, match='no such field'):
    repro.repro_config({'model.d_modle': 64})
  with pytest.raises(ValueError, match='--ensemble=9'):
    repro.run('/nonexistent', 4, ensemble_size=9)


@pytest.mark.slow
def test_ours_passes_the_ensemble_criterion_and_a_planted_bug_fails(tmp_path):
  """30 steps, K = 3 (both norm families twice): about a minute and a half on 2 idle cores."""
  args = dict(steps=30, warmup=5, init_seed=11, ensemble_size=3, shape=SMALL, val_batches=2)
  result = repro.run(str(tmp_path), **args)
  assert result['checks']['step0_logits']['kl_max'] < 1e-9
  assert result['checks']['identical_batches']
  assert result['checks']['max_lr_rel_diff'] < 1e-6  # both follow CosWithWarmup
  # Same weights and batch: the CE differs by the rounding of a mean over the tokens only.
  first_ce = result['curves']['olmo_core'][0]
  assert abs(result['checks']['step1_ce_delta']) <= repro.rounding_bound(first_ce, 4 * 64)
  assert result['verdict']['passed'], result['verdict']['failures']
  assert all(v['passed'] for v in result['leave_one_out'].values()), result['leave_one_out']
  assert (tmp_path / 'loss.png').stat().st_size > 0
  # The ensemble is reused; only our side is retrained, with a query seeing W + 1 keys.
  bug = repro.run(str(tmp_path), **args, plant='window_plus_one')
  assert not bug['verdict']['passed']
  assert bug['verdict']['training_ce']['steps_over_max_ratio'][0] == 1, bug['verdict']
