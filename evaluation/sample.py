"""A sampled continuation from a trained model: what the README's run prints at the end.

The prompt is the start of the run's held-out set (else of its training set),
and the text is decoded with the run's own tokenizer (cfg.data.tokenizer).

Sampled at `temperature` from the `top_k` likeliest tokens with a fixed seed
(so a rerun prints the same text), as nanoGPT does: greedy decoding of a
small model loops on its likeliest phrase ("and I have the king, and I have
the king"), which shows what it learned less well than a sample does.
"""


from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import data
import errors
import model
from tokens import run_tokenizer


def generate(cfg_model: ml_collections.ConfigDict, params: model.Params, prompt_ids: list[int],
             length: int, *, vocab_size: int, max_len: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0) -> list[int]:
  """prompt_ids followed by up to `length` sampled ids (at most `max_len` in all).

  Ids of the padded vocabulary rows past `vocab_size` are never sampled.
  """
  total = min(len(prompt_ids) + length, max_len)
  # The head's weight cut to the vocabulary and cast once, not at every token: at dolma2's
  # 100k ids that copy was most of a token's time on a CPU. (model.head reads only
  # params['lm_head']['w'], so it takes this one-entry tree as it is.)
  head = {'lm_head': {'w': model.head_weight(params, jnp.dtype(cfg_model.dtype), vocab_size)}}

  @jax.jit
  def next_token(p, head, tokens_1T, t, key):
    h_1TD = model.build(cfg_model).apply(p, tokens_1T)
    logits_V = model.head(head, h_1TD[0, t - 1])
    top_logits_k, top_ids_k = jax.lax.top_k(logits_V / temperature, top_k)
    return top_ids_k[jax.random.categorical(key, top_logits_k)]

  tokens = np.zeros((1, total), np.int32)
  tokens[0, :len(prompt_ids)] = prompt_ids
  key = jax.random.key(seed)
  for t in range(len(prompt_ids), total):  # causal, so the zero padding after t is never seen
    tokens[0, t] = int(next_token(params, head, jnp.asarray(tokens), t,
                                  jax.random.fold_in(key, t)))
  return tokens[0].tolist()


def print_sample(cfg: ml_collections.ConfigDict, params: model.Params, length: int,
                 prompt_tokens: int = 16) -> None:
  """A sampled continuation of the held-out set's first `prompt_tokens` tokens (else the
  training set's), decoded with the run's own tokenizer (data.tokenizer)."""
  try:  # wherever it lives (a bucket too), checked against its source on every use
    path = run_tokenizer.find(cfg.data)
  except errors.UserError as e:  # train.py checked it at start-up: it went away since
    logging.warning('No sample: %s', e)
    return
  if path is None:
    logging.warning('No sample: the run names no tokenizer (data.tokenizer) to decode it with.')
    return
  tok = run_tokenizer.load(path)
  ds = data.Dataset.from_config(cfg.data, paths=list(cfg.data.validation_paths) or None)
  prompt = ds.read([0])[0, :prompt_tokens].tolist()
  ids = generate(cfg.model, params, prompt, length, vocab_size=cfg.data.vocab_size,
                 max_len=cfg.data.seq_len)
  print('--- sample ---\n' + tok.decode(ids) + '\n--------------', flush=True)
