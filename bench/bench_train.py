"""CPU train-step speed: our jitted step vs PyTorch + transformers, same model, same run.

The peer (docs/results/cpu_speed.md): a 4-layer / d512 / 8-head /
MLP-1408 / vocab-32k Olmo 3 at seq 512 x batch 8 in float32. Measures, in one
process on one CPU device:
  peak     XLA's float32 matmul FLOP/s (the MFU denominator for both)
  ours     train.make_train_step (forward, backward, skip-step AdamW), jitted
           with the state donated, exactly as train.py runs it
  torch    transformers Olmo3ForCausalLM + torch.optim.AdamW (fused CE loss
           inside the model, z-loss off since HF has none), same shapes
The two are timed interleaved, `--rounds` rounds of `--steps` steps each, and
each reports its best round (the machine may be shared with other work).
Tokens/s counts B*T tokens per step; MFU = tokens/s * model.flops_per_token
(OLMo-core's FLOP definition) / peak.

  python bench/bench_train.py [--rounds=3] [--steps=3] [--skip_torch]

Shapes: B batch, T time, V vocab.
"""

import argparse
import os
import pathlib
import sys
import time

os.environ.pop('XLA_FLAGS', None)  # one real CPU device, not simulated ones
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kernels import xla  # pylint: disable=g-import-not-at-top,wrong-import-position
xla.set_cpu_flags()  # as train.py runs

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

from configs import small  # pylint: disable=g-import-not-at-top,wrong-import-position
import model  # pylint: disable=g-import-not-at-top,wrong-import-position
from monitor import metrics  # pylint: disable=g-import-not-at-top,wrong-import-position
import optim  # pylint: disable=g-import-not-at-top,wrong-import-position
import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokens import batches  # pylint: disable=g-import-not-at-top,wrong-import-position
import train  # pylint: disable=g-import-not-at-top,wrong-import-position


def bench_config(vocab: int, seq_len: int, batch: int):
  """configs/small.py reshaped to the §9 peer model; float32, no remat."""
  cfg = small.get_config()
  m = cfg.model
  m.vocab_size, m.num_layers, m.d_model = vocab, 4, 512
  m.num_heads = m.num_kv_heads = 8
  m.head_dim, m.mlp_hidden = 64, 1408
  m.sliding_window = 4096  # the 7B's window: every layer sees all 512 keys, like HF's
  cfg.data.vocab_size = vocab
  cfg.data.seq_len, cfg.data.global_batch_size = seq_len, batch
  cfg.train.micro_batch_size = batch
  return cfg


def random_batch(cfg, rng: np.random.Generator) -> dict[str, np.ndarray]:
  tokens_BT = rng.integers(2, cfg.data.vocab_size, (cfg.data.global_batch_size,
                                                     cfg.data.seq_len), dtype=np.int32)
  labels_BT = np.concatenate([tokens_BT[:, 1:], np.full_like(tokens_BT[:, :1], -100)], 1)
  return {'tokens': tokens_BT, 'labels': labels_BT,
          'instance_mask': np.ones(tokens_BT.shape[0], bool)}


class Ours:
  """Our train step on a one-device mesh, state donated step to step."""

  def __init__(self, cfg, batch):
    self.mesh = sharding.make_mesh(cfg.train)
    tx = optim.make_optimizer(cfg.opt)
    self.state, shardings = train.create_state(cfg, tx, self.mesh, jax.random.key(0))
    self.step = jax.jit(train.make_train_step(cfg, tx, self.mesh, 1), donate_argnums=0,
                        out_shardings=(shardings, None))
    rows = sharding.batch_sharding(self.mesh)
    self.batch = batches.make_global_batch(batch, rows, np.arange(len(batch['tokens'])),
                                           len(batch['tokens']))
    start = time.perf_counter()
    self.run(1)
    self.first = time.perf_counter() - start  # compile + one step

  def run(self, steps: int) -> float:
    """Seconds per step over `steps` steps (host synced once, at the end)."""
    start = time.perf_counter()
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready(metrics)
    self.loss = float(metrics['train/CE loss'])
    return (time.perf_counter() - start) / steps


class Torch:
  """transformers Olmo3ForCausalLM + AdamW, float32, the same shapes."""

  def __init__(self, cfg, batch):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    self.torch = torch
    torch.manual_seed(0)
    m = cfg.model
    hf_cfg = transformers.Olmo3Config(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_hidden,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, max_position_embeddings=cfg.data.seq_len,
        sliding_window=m.sliding_window, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=False, eos_token_id=0, pad_token_id=1, bos_token_id=None)
    self.model = transformers.Olmo3ForCausalLM(hf_cfg).float().train()
    self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                 eps=1e-8, weight_decay=0.1)
    self.tokens = torch.from_numpy(batch['tokens']).long()
    self.labels = self.tokens.clone()  # HF shifts labels inside its loss
    self.attn = self.model.config._attn_implementation  # pylint: disable=protected-access
    start = time.perf_counter()
    self.run(1)
    self.first = time.perf_counter() - start

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      loss = self.model(input_ids=self.tokens, labels=self.labels).loss
      loss.backward()
      self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
      self.opt.step()
      self.opt.zero_grad(set_to_none=True)
    self.loss = float(loss.detach())
    return (time.perf_counter() - start) / steps


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=3, help='steps per timed round')
  parser.add_argument('--vocab', type=int, default=32000)
  parser.add_argument('--seq_len', type=int, default=512)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--skip_torch', action='store_true')
  args = parser.parse_args()
  print('load average before (1, 5, 15 min): %.2f %.2f %.2f' % os.getloadavg(), flush=True)

  cfg = bench_config(args.vocab, args.seq_len, args.batch)
  tokens = args.batch * args.seq_len
  flops_per_token = model.flops_per_token(cfg.model, args.seq_len)
  print(f'jax {jax.__version__}, {os.cpu_count()} CPUs, XLA_FLAGS={os.environ.get("XLA_FLAGS")!r}, '
        f'model {model.param_count(cfg.model):,} params, {flops_per_token / 1e6:.1f} MFLOP/token, '
        f'batch {args.batch} x {args.seq_len}', flush=True)
  peak = max(metrics.measured_matmul_flops(n) for n in (1024, 2048))
  print(f'peak   float32 matmul (XLA): {peak / 1e9:.1f} GFLOP/s', flush=True)

  batch = random_batch(cfg, np.random.default_rng(0))
  runners = {'ours': Ours(cfg, batch)}
  if not args.skip_torch:
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count() or 1)
    runners['torch'] = Torch(cfg, batch)
  for name, r in runners.items():
    print(f'{name:6s} first step (incl. compile): {r.first:.1f} s', flush=True)
  best = {name: float('inf') for name in runners}
  for i in range(args.rounds):  # interleaved, so load changes hit both alike
    for name, r in runners.items():
      t = r.run(args.steps)
      best[name] = min(best[name], t)
      print(f'round {i}: {name:6s} {t * 1e3:7.0f} ms/step  {tokens / t:7.0f} tok/s  '
            f'loss {r.loss:.3f}', flush=True)
  for name, t in best.items():
    extra = f' (attn {runners[name].attn})' if name == 'torch' else ''
    print(f'{name:6s} best {tokens / t:7.0f} tok/s  {flops_per_token * tokens / t / 1e9:6.1f} '
          f'GFLOP/s  MFU {flops_per_token * tokens / t / peak:.1%}{extra}')
  if 'torch' in best:
    print(f'ours / torch tokens/s: {best["torch"] / best["ours"]:.2f}')
  # The run itself loads the cores (~2 on this machine); a higher figure means
  # something else competed and the ratio should not be trusted.
  print('load average after (1, 5, 15 min): %.2f %.2f %.2f' % os.getloadavg())


if __name__ == '__main__':
  main()
