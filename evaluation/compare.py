"""Token-level agreement between two models' logits on identical inputs.

    python eval.py --checkpoint=HF_DIR --suite=compare [--dtype=bfloat16]

runs the HF transformers model in HF_DIR (torch, CPU, eager attention) and our
conversion of it on the same token ids and reports mean/max KL(HF || ours),
top-1 agreement, top-10 overlap and the KL per position bucket. Ai2's noise
floor for a converted checkpoint in bf16: KL ~1.5e-3, top-1 98.75%
(docs/evaluation.md). `--compare_to=DIR` compares with another model instead.

Shapes: N tokens, B rows, T time, V vocab (real rows).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import data
from evaluation import deps
from evaluation import scoring
import model

LogitsFn = Callable[[np.ndarray], np.ndarray]  # tokens [B, T] -> float32 logits [B, T, V]


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


def compare_models(logits_a: LogitsFn, logits_b: LogitsFn, tokens_BT: np.ndarray, *,
                   buckets: int = 4, rows_per_call: int = 1) -> dict:
  """compare_logits of two models on `tokens_BT`, pooled over all rows.

  Rows go through both models `rows_per_call` at a time so no [B, T, V]
  float64 array of the whole set exists at once; means are token-weighted,
  maxima taken over the parts. Only the vocabulary both models have is compared.
  """
  parts = []
  for i in range(0, len(tokens_BT), rows_per_call):
    rows = tokens_BT[i:i + rows_per_call]
    a, b = logits_a(rows), logits_b(rows)
    v = min(a.shape[-1], b.shape[-1])
    parts.append(compare_logits(a[..., :v], b[..., :v], buckets=buckets))
  weights = np.array([p['tokens'] for p in parts], np.float64)
  out = {}
  for key in parts[0]:
    values = np.array([p[key] for p in parts], np.float64)
    if key in ('kl_max', 'max_abs_logit_diff'):
      out[key] = float(values.max())
    elif key == 'tokens':
      out[key] = int(values.sum())
    else:
      out[key] = float(np.sum(values * weights) / weights.sum())
  return out


def jax_logits_fn(lm: scoring.LoadedModel) -> LogitsFn:
  """tokens [B, T] -> float32 logits [B, T, V] of our model (padded rows sliced off)."""
  fn = jax.jit(lambda params, tokens_BT:
               model.logits(params, tokens_BT, lm.cfg)[..., :lm.vocab_size])
  return lambda tokens_BT: np.asarray(fn(lm.params, jnp.asarray(tokens_BT, jnp.int32)))


def torch_logits_fn(hf_dir: str, dtype: str = 'float32') -> LogitsFn:
  """tokens [B, T] -> float32 logits of the HF transformers model in `hf_dir` (torch, eager)."""
  torch = deps.require('torch')
  transformers = deps.require('transformers')
  torch_dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16,
                 'float64': torch.float64}[dtype]
  hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype,
                                                         attn_implementation='eager')

  def fn(tokens_BT):
    with torch.no_grad():
      return hf(torch.as_tensor(np.asarray(tokens_BT, np.int64))).logits.float().numpy()
  return fn


def hf_vs_ours(hf_dir: str, tokens_BT: np.ndarray, dtype: str = 'float32') -> dict:
  """KL(HF || ours) and agreement of the HF model in `hf_dir` and our conversion of it."""
  ours = scoring.load_model(hf_dir, dtype=dtype)
  return compare_models(torch_logits_fn(hf_dir, dtype), jax_logits_fn(ours), tokens_BT)


def probe_tokens(lm: scoring.LoadedModel, paths: list[str], rows: int, seq_len: int
                 ) -> np.ndarray:
  """[rows, seq_len] ids to compare on: the first rows of held-out files, else random ids."""
  if not paths:  # seed 0, as every earlier parity figure was measured
    return np.random.default_rng(0).integers(0, lm.vocab_size, (rows, seq_len))
  return data.Dataset(paths, seq_len=seq_len, vocab_size=lm.vocab_size,
                      eos_token_id=lm.eos_token_id, pad_token_id=lm.eos_token_id
                      ).read(np.arange(rows))
