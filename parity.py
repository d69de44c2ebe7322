"""Token-level agreement between two models' logits on identical inputs.

    python parity.py --hf_dir=DIR [--dtype=bfloat16] [--tokens=8192]

runs the HF (torch, CPU) model in DIR and our conversion of it on the same
token ids and prints mean/max KL(HF || ours), top-1 agreement and top-10
overlap. Ai2's reported noise floor for a converted checkpoint in bf16:
KL ~1.5e-3, top-1 98.75% (../shared/reference/OLMO3.md §6).

Shapes: N tokens, V vocab.
"""

import numpy as np


def compare_logits(logits_a_NV: np.ndarray, logits_b_NV: np.ndarray, *,
                   top_k: int = 10, buckets: int = 0) -> dict[str, float]:
  """KL(a || b) per token (float64), top-1 agreement, top-k overlap.

  Both arrays must cover the same vocabulary (slice off padded rows first).
  `buckets` > 0 adds the mean KL over that many equal position ranges
  (`kl_bucket_i`), to show drift with position.
  """
  a = np.asarray(logits_a_NV, np.float64).reshape(-1, logits_a_NV.shape[-1])
  b = np.asarray(logits_b_NV, np.float64).reshape(-1, logits_b_NV.shape[-1])
  if a.shape != b.shape:
    raise ValueError(f'logits shapes differ: {logits_a_NV.shape} vs {logits_b_NV.shape}; '
                     'slice both to the tokenizer vocabulary')
  logp_a = a - _logsumexp(a)
  logp_b = b - _logsumexp(b)
  kl_N = np.sum(np.exp(logp_a) * (logp_a - logp_b), axis=-1)
  top_a = np.argsort(-a, axis=-1)[:, :top_k]
  top_b = np.argsort(-b, axis=-1)[:, :top_k]
  overlap = [len(np.intersect1d(x, y)) / top_k for x, y in zip(top_a, top_b)]
  result = {
      'kl_mean': float(kl_N.mean()), 'kl_max': float(kl_N.max()),
      'top1_agreement': float(np.mean(top_a[:, 0] == top_b[:, 0])),
      f'top{top_k}_overlap': float(np.mean(overlap)),
      'max_abs_logit_diff': float(np.abs(a - b).max()), 'tokens': int(a.shape[0]),
  }
  if buckets:  # positions are the second-to-last axis of the inputs
    kl_BT = kl_N.reshape(-1, logits_a_NV.shape[-2] if logits_a_NV.ndim > 2 else kl_N.size)
    for i, chunk in enumerate(np.array_split(np.arange(kl_BT.shape[1]), buckets)):
      result[f'kl_bucket_{i}'] = float(kl_BT[:, chunk].mean())
  return result


def _logsumexp(x: np.ndarray) -> np.ndarray:
  m = x.max(axis=-1, keepdims=True)
  return m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def hf_vs_ours(hf_dir: str, tokens_BT: np.ndarray, dtype: str = 'float32') -> dict[str, float]:
  """Runs the HF model and our conversion of it on `tokens_BT`; compares logits."""
  import jax.numpy as jnp
  import torch
  from transformers import AutoModelForCausalLM

  import convert
  import model

  torch_dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
  hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype,
                                            attn_implementation='eager')
  with torch.no_grad():
    ref = hf(torch.as_tensor(tokens_BT)).logits.float().numpy()
  params, cfg = convert.load_hf(hf_dir)
  cfg.dtype = dtype
  ours = np.asarray(model.logits(params, jnp.asarray(tokens_BT), cfg))
  return compare_logits(ref, ours[..., :ref.shape[-1]], buckets=4)


def main(argv):
  del argv
  import json

  with open(f'{FLAGS.hf_dir}/config.json') as f:
    vocab = json.load(f)['vocab_size']
  rng = np.random.default_rng(FLAGS.seed)
  tokens = rng.integers(0, vocab, size=(FLAGS.batch, FLAGS.tokens // FLAGS.batch))
  for name, value in hf_vs_ours(FLAGS.hf_dir, tokens, FLAGS.dtype).items():
    print(f'{name:>20s}  {value:.6g}')


if __name__ == '__main__':
  from absl import app, flags
  flags.DEFINE_string('hf_dir', None, 'HF Olmo 3 directory', required=True)
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'compute dtype of both models')
  flags.DEFINE_integer('tokens', 8192, 'total tokens compared')
  flags.DEFINE_integer('batch', 4, 'sequences the tokens are split into')
  flags.DEFINE_integer('seed', 0, 'seed of the random token ids')
  FLAGS = flags.FLAGS
  app.run(main)
