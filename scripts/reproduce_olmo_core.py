"""The reproduction in miniature: one tiny Olmo 3 trained by OLMo-core and by train.py.

    .venv/bin/python scripts/reproduce_olmo_core.py --workdir=/tmp/repro [--steps=200]

1. OLMo-core (ai2-olmo-core 3.0.0, CPU torch, float32) builds the model of
   configs/tiny_repro.py with its own init; the step-0 weights are saved.
2. They are converted to our params and written as an HF directory, which
   train.py loads through `train.init_from`; step-0 logits are compared.
3. OLMo-core trains with its NumpyFSLDataset + data loader, SkipStepAdamW,
   LM-head loss and CosWithWarmup, driven by a loop that does what its
   TransformerTrainModule + Trainer do; train.py trains on the same token
   file with the same seed (the same batches) on one CPU device.
4. OLMo-core trains a second time from the step-0 weights moved by one
   float32 ulp (torch.nextafter towards +inf): the run-to-run noise floor.
5. Both final models are compared (held-out loss, token KL, parameters) and
   the loss curves plotted: <workdir>/loss.png, <workdir>/results.json.

Acceptance (issue 9): |CE(ours) - CE(OLMo-core)| stays within 2x the noise
floor at every step; the floor is the envelope of the noise run's delta, and
never below the float32 rounding of a mean over the batch's tokens (see
`acceptance`). The pointwise ratio to the raw noise delta is reported too.
Finished runs are reused: train.py resumes a completed workdir as a no-op,
and each OLMo-core run is saved to <workdir>/<name>.pt with its config.

Shapes: B batch, T time, V vocab, D d_model, L layers, N tokens.
"""

import json
import os
import subprocess
import sys
import time
import types
from typing import Any, NamedTuple

from absl import app, flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import convert  # noqa: E402  (after the repository root is importable)
import data  # noqa: E402
from configs import tiny_repro  # noqa: E402
from evaluation.compare import compare_logits  # noqa: E402

IGNORE_INDEX = -100


# --- Config -------------------------------------------------------------------------------


def run_overrides(steps: int, warmup: int, extra: dict | None = None) -> dict:
  """Dotted config overrides of both sides: the run length (the cosine ends at the last step)."""
  return {'train.steps': steps, 'train.ckpt_every': steps, 'opt.t_max': steps,
          'opt.warmup_steps': warmup, **(extra or {})}


def repro_config(overrides: dict):
  """configs/tiny_repro.py with dotted overrides (scalars), as train.py's --config.X=Y does."""
  cfg = tiny_repro.get_config()
  for dotted, value in overrides.items():
    *groups, field = dotted.split('.')
    node = cfg
    for g in groups:
      node = node[g]
    if field not in node:
      raise ValueError(f'override {dotted}: configs/tiny_repro.py has no such field.')
    node[field] = value
  return cfg


def olmo_core_model(cfg, init_seed: int):
  """OLMo-core's Olmo 3 (`TransformerConfig.olmo3_7B`) shrunk to cfg.model, its own init."""
  import torch
  from olmo_core.nn.attention import SlidingWindowAttentionConfig
  from olmo_core.nn.transformer import TransformerConfig

  m = cfg.model
  if m.num_kv_heads != m.num_heads or m.head_dim * m.num_heads != m.d_model:
    raise ValueError('olmo3_7B is MHA with head_dim = d_model / heads; set '
                     'cfg.model.num_kv_heads = num_heads and head_dim = d_model // num_heads.')
  oc = TransformerConfig.olmo3_7B(vocab_size=m.vocab_size)
  oc.d_model, oc.n_layers, oc.init_seed = m.d_model, m.num_layers, init_seed
  oc.block.sequence_mixer.n_heads = m.num_heads
  oc.block.sequence_mixer.backend = 'torch'
  # OLMo-core window W -> flash-attn (W-1, 0): W keys (i-W, i], ours without the plus-one.
  window = m.sliding_window + int(m.sliding_window_plus_one)
  oc.block.sequence_mixer.sliding_window = SlidingWindowAttentionConfig(
      pattern=[window if c == 'S' else -1 for c in m.layer_pattern],
      force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False)
  oc.block.feed_forward.hidden_size = m.mlp_hidden
  model = oc.build(init_device='cpu')
  model.init_weights(max_seq_len=cfg.data.seq_len, device=torch.device('cpu'))
  return model


# --- Weights ------------------------------------------------------------------------------

# OLMo-core name in block i -> (our module, our name); torch Linear weights are [out, in].
_BLOCK = {
    'attention.w_q.weight': ('attention', 'w_q'), 'attention.w_k.weight': ('attention', 'w_k'),
    'attention.w_v.weight': ('attention', 'w_v'), 'attention.w_out.weight': ('attention', 'w_o'),
    'attention.q_norm.weight': ('attention', 'q_norm'),
    'attention.k_norm.weight': ('attention', 'k_norm'),
    'attention_norm.weight': ('attention_norm', 'scale'),
    'feed_forward.w1.weight': ('mlp', 'w_gate'), 'feed_forward.w3.weight': ('mlp', 'w_up'),
    'feed_forward.w2.weight': ('mlp', 'w_down'),
    'feed_forward_norm.weight': ('mlp_norm', 'scale'),
}


def olmo_core_to_params(state: dict, num_layers: int) -> dict:
  """OLMo-core state dict (torch tensors or numpy) -> our params tree as float32 numpy."""
  arr = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, 'detach') else v, np.float32)
         for k, v in state.items()}
  expected = {'embeddings.weight', 'lm_head.norm.weight', 'lm_head.w_out.weight'} | {
      f'blocks.{i}.{name}' for i in range(num_layers) for name in _BLOCK}
  if set(arr) != expected:
    raise ValueError(f'OLMo-core state dict does not match a {num_layers}-layer Olmo 3: '
                     f'missing {sorted(expected - set(arr))[:3]}, '
                     f'unexpected {sorted(set(arr) - expected)[:3]}.')
  params = {'embed': {'embedding': arr['embeddings.weight']},
            'final_norm': {'scale': arr['lm_head.norm.weight']},
            'lm_head': {'w': arr['lm_head.w_out.weight'].T.copy()}}
  for name, (module, key) in _BLOCK.items():
    stacked = np.stack([arr[f'blocks.{i}.{name}'] for i in range(num_layers)])
    params.setdefault(module, {})[key] = (np.ascontiguousarray(stacked.swapaxes(1, 2))
                                          if stacked.ndim == 3 else stacked)
  return params


def relative_difference(a: dict, b: dict) -> float:
  """||a - b|| / ||b|| over all parameters together (float64)."""
  import jax
  num = sum(float(np.sum((np.float64(x) - np.float64(y)) ** 2))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  den = sum(float(np.sum(np.float64(y) ** 2)) for y in jax.tree.leaves(b))
  return float(np.sqrt(num / den))


# --- OLMo-core side ------------------------------------------------------------------------


def olmo_core_logits(model, tokens_BT: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(torch.as_tensor(tokens_BT, dtype=torch.long)).float().numpy()


def total_grad_norm(grads: list, how: str):
  """The pre-clip global norm: torch's (OLMo-core's), or with float64 accumulation.

  On CPU, torch's float32 norm of one large gradient (the [V, D] head) is off
  by up to ~1e-3 relative, which moves OLMo-core's clipping coefficient by
  ~1e-4 every step; 'float64' removes that rounding and nothing else.
  """
  import torch
  if how == 'torch':
    return torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False)
  if how == 'float64':
    return torch.sqrt(sum(torch.sum(g.double() ** 2) for g in grads)).float()
  raise ValueError(f"grad norm {how!r} is not 'torch' or 'float64' (--olmo_core_norm).")


def train_olmo_core(model, cfg, workdir: str, log_name: str, norm: str = 'torch'
                    ) -> tuple[list[dict], list[np.ndarray]]:
  """Trains `model` in place for cfg.train.steps; (one record per step, the input ids [B, T]).

  The loop is OLMo-core's Trainer + TransformerTrainModule on one rank with
  one micro-batch: global_step += 1, labels from get_labels, the LM head's
  summed CE + z-loss divided by the batch's label count, backward, then
  optim_step (total norm and clip_grads_with_norm_, SkipStepAdamW's latest
  loss / grad norm, scheduler.set_lr per group at the global step, step).
  """
  import torch
  from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDataset
  from olmo_core.data.utils import get_labels
  from olmo_core.optim import CosWithWarmup, OptimGroupOverride, SkipStepAdamWConfig

  d, o = cfg.data, cfg.opt
  T, B = d.seq_len, d.global_batch_size
  dataset = NumpyFSLDataset(*d.paths, sequence_length=T, pad_token_id=d.pad_token_id,
                            eos_token_id=d.eos_token_id, vocab_size=d.vocab_size,
                            dtype=np.uint32, max_target_sequence_length=T)
  loader = NumpyDataLoaderConfig(global_batch_size=B * T, seed=d.seed, num_workers=0,
                                 work_dir=os.path.join(workdir, 'olmo_core_data')).build(dataset)
  loader.reshuffle(epoch=1)
  batches = iter(loader)
  optim = SkipStepAdamWConfig(
      lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay,
      rolling_interval_length=o.skip_window, sigma_factor=int(o.skip_sigma),
      # Only the input embedding is excluded from weight decay (OLMo-core pretrain-1).
      group_overrides=[OptimGroupOverride(params=['embeddings.weight'],
                                          opts=dict(weight_decay=0.0))]).build(model)
  scheduler = CosWithWarmup(warmup=o.warmup_steps, alpha_f=o.final_lr / o.lr, t_max=o.t_max)
  trainer = types.SimpleNamespace(global_step=0, max_steps=cfg.train.steps)
  params = list(model.parameters())
  records, inputs = [], []
  model.train()
  start = time.perf_counter()
  for step in range(1, cfg.train.steps + 1):
    trainer.global_step = step
    batch = next(batches)
    inputs.append(batch['input_ids'].numpy().astype(np.int32))
    labels = get_labels(batch, label_ignore_index=IGNORE_INDEX)
    count = (labels != IGNORE_INDEX).sum()
    out = model(batch['input_ids'], labels=labels, ignore_index=IGNORE_INDEX,
                loss_reduction='sum', z_loss_multiplier=o.z_loss, loss_div_factor=count,
                return_logits=False)
    out.loss.backward()
    optim.latest_loss = out.ce_loss.detach()
    total_norm = total_grad_norm([p.grad for p in params], norm)
    torch.nn.utils.clip_grads_with_norm_(params, o.clip_grad_norm, total_norm)
    optim.latest_grad_norm = total_norm
    lrs = [float(scheduler.set_lr(group, trainer)) for group in optim.param_groups]
    optim.step()
    optim.zero_grad(set_to_none=True)
    records.append({'step': step, 'train/CE loss': float(out.ce_loss),
                    'train/Z loss': float(out.z_loss), 'optim/LR': lrs[0],
                    'optim/total grad norm': float(total_norm),
                    'optim/step skipped': float(optim.step_skipped)})
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
      print(f'[{log_name}] step {step}/{cfg.train.steps}  loss {out.ce_loss.item():.4f}  '
            f'{(time.perf_counter() - start) / step:.2f} s/step', flush=True)
  return records, inputs


def cached_olmo_core_run(cfg, key: dict, init_state: dict, workdir: str, name: str) -> dict:
  """train_olmo_core from `init_state`, or its saved result when `key` (the config) matches.

  Returns {'records', 'inputs', 'final' (state dict)}; saved to <workdir>/<name>.pt.
  """
  import torch
  path = os.path.join(workdir, f'{name}.pt')
  if os.path.exists(path):
    saved = torch.load(path, weights_only=False)
    if saved['key'] == key:
      print(f'[{name}] reusing {path}', flush=True)
      return saved
  model = olmo_core_model(cfg, key['init_seed'])
  model.load_state_dict(init_state)
  records, inputs = train_olmo_core(model, cfg, workdir, name, key['norm'])
  run = {'key': key, 'records': records, 'inputs': inputs,
         'final': {k: v.detach().clone() for k, v in model.state_dict().items()}}
  torch.save(run, path)
  return run


class _TrainState(NamedTuple):
  params: Any
  opt_state: Any


# --- Our side -----------------------------------------------------------------------------


def train_ours(cfg, overrides: dict, hf_dir: str, run_dir: str) -> list[dict]:
  """train.py as a subprocess on one CPU device from `hf_dir`; its per-step metrics."""
  overrides = {**overrides, 'train.init_from': hf_dir}
  cmd = [sys.executable, os.path.join(REPO, 'train.py'),
         f'--config={os.path.join(REPO, "configs", "tiny_repro.py")}', f'--workdir={run_dir}',
         '--sample_tokens=0'] + [f'--config.{k}={v}' for k, v in overrides.items()]
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=1',
             JAX_PLATFORMS='cpu')
  print('[ours] ' + ' '.join(cmd), flush=True)
  subprocess.run(cmd, cwd=REPO, env=env, check=True)
  records = {}
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    for line in f:
      r = json.loads(line)
      if 'train/CE loss' in r:
        records[r['step']] = r  # a resumed run rewrites steps; the last record wins
  missing = sorted(set(range(1, cfg.train.steps + 1)) - set(records))
  if missing:
    raise RuntimeError(f'{run_dir}/metrics.jsonl lacks steps {missing[:5]}...')
  return [records[s] for s in range(1, cfg.train.steps + 1)]


def load_our_params(cfg, run_dir: str) -> dict:
  """Our final params (numpy) from train.py's last checkpoint."""
  import jax
  import checkpoint
  import model
  import optim

  def state():  # train.TrainState's fields (importing train.py would redefine its flags)
    params = model.init_params(cfg.model, jax.random.key(0))
    return _TrainState(params, optim.make_optimizer(cfg.opt).init(params))
  target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(state))
  restored, _ = checkpoint.restore(os.path.join(run_dir, 'checkpoints'), target,
                                   step=cfg.train.steps)
  return restored.params


def our_logits(cfg, params: dict, tokens_BT: np.ndarray) -> np.ndarray:
  import jax
  import model
  fn = jax.jit(lambda p, t: model.logits(p, t, cfg.model))
  return np.asarray(fn(params, tokens_BT))


# --- Comparisons --------------------------------------------------------------------------


def held_out_loss(logits_fn, batches: list[dict]) -> float:
  """CE summed over the held-out labels / their count, float64 log-softmax of float32 logits."""
  total, count = 0.0, 0
  for b in batches:
    logits_BTV = np.float64(logits_fn(b['tokens']))
    labels_BT = b['labels']
    valid_BT = labels_BT != IGNORE_INDEX
    m = logits_BTV.max(-1, keepdims=True)
    lse_BT = (m + np.log(np.exp(logits_BTV - m).sum(-1, keepdims=True)))[..., 0]
    target_BT = np.take_along_axis(logits_BTV, np.where(valid_BT, labels_BT, 0)[..., None],
                                   -1)[..., 0]
    total += float(np.sum(np.where(valid_BT, lse_BT - target_BT, 0.0)))
    count += int(valid_BT.sum())
  return total / count


def envelope(x: np.ndarray, half_width: int) -> np.ndarray:
  """max |x| over the steps k-W..k+W (clipped at the ends)."""
  a = np.abs(x)
  return np.array([a[max(0, k - half_width):k + half_width + 1].max() for k in range(len(a))])


def noise_floor(noise: np.ndarray, reference: np.ndarray, tokens: int,
                half_width: int) -> np.ndarray:
  """Per-step noise floor (see `acceptance`)."""
  rounding = np.log2(tokens) * 2.0 ** -24 * np.abs(reference)
  return np.maximum(envelope(noise - reference, half_width), rounding)


def acceptance(ours: np.ndarray, noise: np.ndarray, reference: np.ndarray, tokens: int,
               half_width: int) -> dict:
  """Is |ours - reference| within 2x the noise floor at every step?

  The floor at step k is the larger of
  - the envelope max |noise - reference| over steps k-W..k+W: one noise run
    crosses zero now and then, which says nothing about the spread, and
  - the rounding bound of a float32 mean of `tokens` per-token losses summed
    in another order, log2(tokens) * 2^-24 * loss (pairwise summation): below
    it two correct implementations cannot be told apart, and a one-ulp init
    perturbation stays below it for the first steps.
  The pointwise comparison against the raw noise delta is reported too.
  """
  d_ours, d_noise = np.abs(ours - reference), np.abs(noise - reference)
  rounding = np.log2(tokens) * 2.0 ** -24 * np.abs(reference)
  floor = noise_floor(noise, reference, tokens, half_width)
  ratio = d_ours / floor
  return {'envelope_half_width': half_width,
          'max_ratio_to_floor': float(ratio.max()),
          'worst_step': int(np.argmax(ratio)) + 1,
          'steps_over_2x_floor': [int(k) + 1 for k in np.flatnonzero(ratio > 2)],
          'steps_floor_is_rounding_bound': int(np.sum(rounding >= envelope(d_noise, half_width))),
          'pointwise_steps_over_2x_noise': int(np.sum(d_ours > 2 * d_noise)),
          'max_abs_delta_ours': float(d_ours.max()),
          'max_abs_delta_noise': float(d_noise.max()),
          'passed': bool(ratio.max() <= 2.0)}


def plot(path: str, steps: np.ndarray, curves: dict[str, np.ndarray],
         deltas: dict[str, np.ndarray], limit: np.ndarray | None = None) -> None:
  """Loss curves over a log-scale |delta| panel; `limit` (dashed) is the acceptance bound."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                    gridspec_kw={'height_ratios': [2, 1]})
  for label, values in curves.items():
    top.plot(steps, values, label=label, linewidth=1.0)
  top.set_ylabel('training CE loss')
  top.legend()
  top.grid(alpha=0.3)
  for label, values in deltas.items():
    bottom.semilogy(steps, np.maximum(np.abs(values), 1e-9), label=label, linewidth=0.8)
  if limit is not None:
    bottom.semilogy(steps, limit, 'k--', label='2 x noise floor', linewidth=0.8)
  bottom.set_ylabel('|delta CE loss|')
  bottom.set_xlabel('step')
  bottom.legend()
  bottom.grid(alpha=0.3, which='both')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def compare(cfg, records: dict[str, list[dict]], finals: dict[str, dict], logits_fns: dict,
            val_batches: list[dict], kl_instances: int, half_width: int) -> dict:
  """The results table (a dict) from the three runs' records and final models."""
  ce = {k: np.array([r['train/CE loss'] for r in v]) for k, v in records.items()}
  lr = {k: np.array([r['optim/LR'] for r in v]) for k, v in records.items()}
  result = {'steps': len(ce['olmo_core']),
            'max_lr_rel_diff_ours': float(np.max(np.abs(lr['ours'] / lr['olmo_core'] - 1))),
            'skipped_steps': {k: [r['step'] for r in v if r['optim/step skipped']]
                              for k, v in records.items()}}
  gn = {k: np.array([r['optim/total grad norm'] for r in v]) for k, v in records.items()}
  # Step 1 computes loss and gradient on identical weights and batch: framework rounding only.
  result['step1'] = {'ce_delta_ours': float(ce['ours'][0] - ce['olmo_core'][0]),
                     'grad_norm_rel_diff_ours': float(gn['ours'][0] / gn['olmo_core'][0] - 1)}
  val = {k: held_out_loss(fn, val_batches) for k, fn in logits_fns.items()}
  kl_tokens = np.concatenate([b['tokens'] for b in val_batches])[:kl_instances]
  kl_logits = {k: fn(kl_tokens) for k, fn in logits_fns.items()}
  for name in [k for k in records if k != 'olmo_core']:
    delta = ce[name] - ce['olmo_core']
    kl = compare_logits(kl_logits['olmo_core'], kl_logits[name])
    result[name] = {
        'max_abs_delta_ce': float(np.abs(delta).max()),
        'mean_abs_delta_ce': float(np.abs(delta).mean()),
        'final_abs_delta_ce': float(abs(delta[-1])),
        'held_out_loss': val[name], 'held_out_delta': val[name] - val['olmo_core'],
        'final_kl_mean': kl['kl_mean'], 'final_kl_max': kl['kl_max'],
        'final_top1_agreement': kl['top1_agreement'],
        'param_rel_diff': relative_difference(finals[name], finals['olmo_core']),
        'max_grad_norm_rel_diff': float(np.max(np.abs(gn[name] / gn['olmo_core'] - 1)))}
  result['olmo_core'] = {'held_out_loss': val['olmo_core'],
                         'final_ce': float(ce['olmo_core'][-1])}
  if 'noise' in records:
    result['acceptance'] = acceptance(ce['ours'], ce['noise'], ce['olmo_core'],
                                      cfg.data.global_batch_size * cfg.data.seq_len, half_width)
  return result


def table(result: dict) -> str:
  """Markdown table of the result dict."""
  rows = [('per-step max abs delta CE', 'max_abs_delta_ce', '.3e'),
          ('per-step mean abs delta CE', 'mean_abs_delta_ce', '.3e'),
          ('final-step abs delta CE', 'final_abs_delta_ce', '.3e'),
          ('held-out loss', 'held_out_loss', '.5f'),
          ('held-out loss delta', 'held_out_delta', '+.3e'),
          ('final-model KL mean (nats/token)', 'final_kl_mean', '.3e'),
          ('final-model KL max', 'final_kl_max', '.3e'),
          ('final-model top-1 agreement', 'final_top1_agreement', '.4f'),
          ('relative parameter difference', 'param_rel_diff', '.3e')]
  names = [k for k in ('ours', 'noise') if k in result]
  titles = {'ours': 'ours vs OLMo-core', 'noise': 'noise floor (OLMo-core vs OLMo-core+1ulp)'}
  lines = ['| quantity | ' + ' | '.join(titles[n] for n in names) + ' |',
           '|---' * (len(names) + 1) + '|']
  for label, key, fmt in rows:
    lines.append(f'| {label} | ' + ' | '.join(format(result[n][key], fmt) for n in names) + ' |')
  lines.append(f"| OLMo-core held-out loss | {result['olmo_core']['held_out_loss']:.5f} |"
               + ' |' * (len(names) - 1))
  return '\n'.join(lines)


# --- Main ---------------------------------------------------------------------------------


def run(workdir: str, steps: int, warmup: int = 20, init_seed: int = 0, val_batches: int = 8,
        kl_instances: int = 4, half_width: int = 5, noise: bool = True,
        torch_threads: int = 0, config_overrides: dict | None = None,
        olmo_core_norm: str = 'torch') -> dict:
  """The whole reproduction; returns the results dict (also written to workdir).

  config_overrides: extra dotted scalar fields of configs/tiny_repro.py (e.g. a
  smaller model for the test), applied to both sides. olmo_core_norm: 'torch'
  is OLMo-core as it is; 'float64' accumulates its clipping norm in float64
  (see `total_grad_norm`). Outputs carry the suffix '_f64norm' then.
  """
  import torch
  if torch_threads:
    torch.set_num_threads(torch_threads)
  os.makedirs(workdir, exist_ok=True)
  overrides = run_overrides(steps, warmup, config_overrides)
  cfg = repro_config(overrides)
  L = cfg.model.num_layers

  # 1. OLMo-core's init, saved.
  model = olmo_core_model(cfg, init_seed)
  init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
  torch.save(init_state, os.path.join(workdir, 'olmo_core_step0.pt'))

  # 2. Converted to our params and an HF directory for train.init_from; step-0 logits.
  params0 = olmo_core_to_params(init_state, L)
  hf_dir = os.path.join(workdir, 'step0_hf')
  convert.save_hf(params0, cfg.model, hf_dir, vocab_size=cfg.data.vocab_size,
                  eos_token_id=cfg.data.eos_token_id, pad_token_id=cfg.data.pad_token_id)
  reloaded, _ = convert.load_hf(hf_dir)
  if relative_difference(reloaded, params0) != 0.0:
    raise RuntimeError(f'{hf_dir} does not reload to the converted weights bit for bit.')
  val_ds = data.Dataset.from_config(cfg.data, paths=list(cfg.data.validation_paths))
  batches = data.validation_batches(val_ds, cfg.data.global_batch_size, val_batches)
  probe = batches[0]['tokens'][:kl_instances]
  step0 = compare_logits(olmo_core_logits(model, probe), our_logits(cfg, params0, probe))
  print(f'step-0 logits: max |diff| {step0["max_abs_logit_diff"]:.3e}, '
        f'KL mean {step0["kl_mean"]:.3e}, max {step0["kl_max"]:.3e}', flush=True)

  # 3. Both trainings (then 4. the noise floor: the same OLMo-core run from weights one ulp
  # away). train.py resumes a finished run as a no-op; OLMo-core runs are cached likewise.
  records = {'ours': train_ours(cfg, overrides, hf_dir, os.path.join(workdir, 'ours'))}
  key = {'overrides': overrides, 'init_seed': init_seed, 'norm': olmo_core_norm}
  suffix = {'torch': '', 'float64': '_f64norm'}[olmo_core_norm]
  runs = {'olmo_core': cached_olmo_core_run(cfg, key, init_state, workdir,
                                            'olmo_core' + suffix)}
  if noise:
    ulp = {k: torch.nextafter(v, torch.tensor(float('inf'))) for k, v in init_state.items()}
    runs['noise'] = cached_olmo_core_run(cfg, key, ulp, workdir, 'olmo_core+1ulp' + suffix)
  # The batches train.py saw: data.Loader from the same config (tests/test_data.py checks
  # it against OLMo-core in general; this checks these files, seed and batch size).
  with data.Loader.from_config(cfg.data, data.Dataset.from_config(cfg.data),
                               cache_dir=os.path.join(workdir, 'ours', 'data_cache')) as loader:
    same_batches = all(np.array_equal(next(loader)['tokens'], x)
                       for x in runs['olmo_core']['inputs'])
  finals = {'ours': load_our_params(cfg, os.path.join(workdir, 'ours'))}
  logits_fns = {'ours': lambda t: our_logits(cfg, finals['ours'], t)}
  for name, r in runs.items():
    records[name] = r['records']
    finals[name] = olmo_core_to_params(r['final'], L)
    final_model = olmo_core_model(cfg, init_seed)
    final_model.load_state_dict(r['final'])
    logits_fns[name] = lambda t, m=final_model: olmo_core_logits(m, t)

  # 5. Table, plot, files.
  result = compare(cfg, records, finals, logits_fns, batches, kl_instances, half_width)
  result['step0_logits'] = {k: step0[k] for k in ('max_abs_logit_diff', 'kl_mean', 'kl_max')}
  result['identical_batches'] = bool(same_batches)
  steps_k = np.arange(1, steps + 1)
  ce = {k: np.array([r['train/CE loss'] for r in v]) for k, v in records.items()}
  labels = {'ours': 'ours (JAX, train.py)', 'olmo_core': 'OLMo-core',
            'noise': 'OLMo-core, init + 1 ulp'}
  deltas = {'ours - OLMo-core': ce['ours'] - ce['olmo_core']}
  if noise:
    deltas['noise floor: OLMo-core+1ulp - OLMo-core'] = ce['noise'] - ce['olmo_core']
  limit = (2 * noise_floor(ce['noise'], ce['olmo_core'], cfg.data.global_batch_size
                           * cfg.data.seq_len, half_width) if noise else None)
  plot(os.path.join(workdir, f'loss{suffix}.png'), steps_k,
       {labels[k]: ce[k] for k in ('olmo_core', 'ours')}, deltas, limit)
  with open(os.path.join(workdir, f'curves{suffix}.json'), 'w') as f:
    json.dump({k: v.tolist() for k, v in ce.items()}, f)
  with open(os.path.join(workdir, f'results{suffix}.json'), 'w') as f:
    json.dump(result, f, indent=2)
  print(table(result))
  print(json.dumps({k: result[k] for k in ('step0_logits', 'acceptance') if k in result},
                   indent=2))
  return result


def main(argv) -> None:
  del argv
  F = flags.FLAGS
  if not F.workdir:
    raise app.UsageError('--workdir is required.')
  run(F.workdir, F.steps, F.warmup, F.init_seed, F.val_batches, F.kl_instances, F.envelope,
      not F.skip_noise, F.torch_threads, olmo_core_norm=F.olmo_core_norm)


if __name__ == '__main__':
  # Flags are defined here, not at import, so tests can import this module next to train.py.
  flags.DEFINE_string('workdir', None, 'Outputs go here: weights, both runs, plot, results.')
  flags.DEFINE_integer('steps', 200, 'Optimizer steps of every run (the cosine ends there).')
  flags.DEFINE_integer('warmup', 20, 'Linear warmup steps.')
  flags.DEFINE_integer('init_seed', 0, "OLMo-core TransformerConfig.init_seed (its own init).")
  flags.DEFINE_integer('val_batches', 8, 'Held-out batches (of the global batch size) evaluated.')
  flags.DEFINE_integer('kl_instances', 4, 'Held-out instances whose logits give the final-model KL.')
  flags.DEFINE_integer('envelope', 5, 'Half-width W (steps) of the noise-floor envelope.')
  flags.DEFINE_integer('torch_threads', 0, 'torch intra-op threads (0: torch default).')
  flags.DEFINE_bool('skip_noise', False, 'Do not run the ulp-perturbed OLMo-core run.')
  flags.DEFINE_enum('olmo_core_norm', 'torch', ['torch', 'float64'],
                    "OLMo-core's clipping norm: torch's float32 (as is) or float64-accumulated.")
  app.run(main)
