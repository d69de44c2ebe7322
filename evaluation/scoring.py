"""Loading a model for evaluation, lm-eval tokenization, and packed log-likelihood scoring.

`load_model` reads an HF directory (convert.py) or the params of one of our
checkpoints (checkpoint.py); `Scorer` turns (context, continuation) requests
into summed log-probabilities many at a time, with lm-eval-harness's
conventions (`TemplateLM._encode_pair`, left truncation to max_length, the
EOS token as the context of a document start, disjoint rolling windows).

Every score is a log-probability over the tokenizer's vocabulary: the padded
rows of the head are sliced off before the softmax, so a converted HF model and
its original agree, and two checkpoints are compared on the same distribution.
(train.py's in-loop held-out loss keeps the padded rows.)

Shapes: B rows, R row length (packed), T time, D d_model, V vocab (real rows),
Q scored (position, token) queries, C queries per head chunk.
"""

import dataclasses
import heapq
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tokenizers import Tokenizer

import checkpoint
import errors
from formats import hf_ckpt
import model
from store import storage
from tokens import run_tokenizer

_QUERY_CHUNK = 256  # C: head rows per lax.map step; bounds the [C, V] logits block


# --- Models and tokenizers -------------------------------------------------------------


@dataclasses.dataclass
class LoadedModel:
  """Params and what evaluation needs to know about them."""
  params: model.Params
  cfg: ml_collections.ConfigDict  # the model group
  vocab_size: int  # real (tokenizer) rows of the head; the rest is padding
  eos_token_id: int
  max_length: int  # longest input scored at once (lm-eval `max_length`)
  source: str
  step: int | None = None
  data_cfg: ml_collections.ConfigDict | None = None  # our checkpoints: cfg.data
  tokenizer_path: str | None = None


class ModelPathError(errors.UserError, FileNotFoundError):
  """A model path that is not an HF directory or a checkpoint (step) that exists (EXIT_USAGE)."""


def locate(path: str, step: int | None = None) -> tuple[str, int | None]:
  """(model directory, step): an HF directory, or a checkpoint directory and a committed step.

  A step_N path stands for its checkpoint directory and step N. Raises
  ModelPathError naming what is there instead and the path to give.
  """
  path = storage.absolute(storage.canonical(path, '--checkpoint', writes=False))
  m = re.fullmatch(r'step_(\d+)', storage.basename(path))
  if m and step is None and not storage.exists(storage.join(path, 'config.json')):
    path, step = storage.parent(path), int(m.group(1))
  if not storage.isdir(path):
    raise ModelPathError(
        f'{path} {"is a file, not a directory" if storage.exists(path) else "does not exist"}; '
        'give an HF model directory (config.json + *.safetensors) or a checkpoint directory '
        'of committed step_N/ (train.py writes WORKDIR/checkpoints).')
  if storage.exists(storage.join(path, 'config.json')):
    storage.canonical(path, '--checkpoint (an HF directory)', local_only=True)
    return path, step
  steps = checkpoint.committed_steps(path)
  if steps:
    if step is not None and step not in steps:
      raise ModelPathError(f'{path} has no committed step {step}; its committed steps are '
                           f'{_some(steps)}: pick one with --step, or drop --step for the latest.')
    return path, step
  inner = storage.join(path, 'checkpoints')
  if checkpoint.committed_steps(inner):
    raise ModelPathError(f'{path} is a train.py workdir, not a checkpoint directory; its '
                         f'checkpoints are in {inner}: give that path.')
  raise ModelPathError(f'{path} is neither an HF model directory (config.json) nor a checkpoint '
                       'directory with committed step_N/ checkpoints; give one of those (train.py '
                       'writes WORKDIR/checkpoints, convert.py --to_hf an HF directory).')


def _some(steps: list[int]) -> str:
  return str(steps) if len(steps) <= 8 else f'[{steps[0]}, {steps[1]}, ..., {steps[-1]}]'


def load_model(path: str, *, step: int | None = None, dtype: str = 'float32',
               max_length: int | None = None) -> LoadedModel:
  """Loads an HF Olmo 3 directory or (the params of) one of our checkpoints (see locate)."""
  path, step = locate(path, step)
  if os.path.exists(os.path.join(path, 'config.json')):
    params, cfg = hf_ckpt.load_hf(path)
    with open(os.path.join(path, 'config.json')) as f:
      hf = json.load(f)
    eos = hf.get('eos_token_id')
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
      raise ValueError(f'{path}/config.json has no eos_token_id; evaluation needs it as the '
                       'document separator (dolma2: 100257). Add it to config.json.')
    tok = os.path.join(path, 'tokenizer.json')
    lm = LoadedModel(params, cfg, hf['vocab_size'], eos,
                     hf.get('max_position_embeddings') or 2048, path,
                     tokenizer_path=tok if os.path.exists(tok) else None)
  else:  # locate() found committed steps
    step = checkpoint.latest_step(path) if step is None else step
    params, meta = _restore_params(path, step)
    full = ml_collections.ConfigDict(meta['config'])
    if 'data' in full:  # written by train.py
      d = full.data  # its tokenizer: run_tokenizer.find(d), when a suite needs it
      lm = LoadedModel(params, full.model, d.vocab_size, d.eos_token_id, d.seq_len, path,
                       step=step, data_cfg=d)
    else:  # written by convert.py --from_hf: its HF source says what the run's data would
      lm = _from_hf_source(params, full.model, meta, path, step)
  lm.cfg = ml_collections.ConfigDict(lm.cfg.to_dict())  # unlocked copy we may edit
  lm.cfg.dtype = dtype
  if lm.cfg.attention_impl == 'cudnn':  # packed scoring needs segment ids, which cuDNN lacks:
    lm.cfg.attention_impl = 'auto'  # the GPU's flash kernel for them (kernels.resolve)
  lm.max_length = max_length or lm.max_length
  lm.params = jax.device_put(jax.tree.map(np.asarray, lm.params))
  return lm


def _from_hf_source(params: model.Params, cfg: ml_collections.ConfigDict, meta: dict,
                    path: str, step: int) -> LoadedModel:
  """A convert.py checkpoint: vocab, EOS and context length from its recorded HF source."""
  source = meta.get('hf_source')
  eos = source and source['eos_token_id']
  eos = eos[0] if isinstance(eos, list) else eos
  if eos is None:
    raise ValueError(f'{path}: the checkpoint has neither a data config (train.py) nor an HF '
                     'source with eos_token_id (convert.py --from_hf); evaluate the HF '
                     'directory it came from instead, or convert it again.')
  tok = storage.join(path, f'step_{step}', hf_ckpt.HF_FILES, 'tokenizer.json')
  return LoadedModel(params, cfg, source['vocab_size'], eos,
                     source['max_position_embeddings'] or 2048, path, step=step,
                     tokenizer_path=tok if storage.exists(tok) else None)


def _restore_params(directory: str, step: int) -> tuple[model.Params, dict]:
  """Params (host numpy) and caller metadata of a committed checkpoint; reads only the params."""
  params, cfg = hf_ckpt.load_checkpoint_params(directory, step)
  return params, dict(checkpoint.read_metadata(directory, step), config=cfg.to_dict())


def load_tokenizer(explicit: str | None, lm: LoadedModel) -> Tokenizer:
  """The model's tokenizer, as a `tokenizers.Tokenizer` whose ids fit it: `explicit`
  (--tokenizer), else the run's own (run_tokenizer.find on its data config), else the
  one an HF directory or source carries. Never another model's: none found is a
  TokenizerError asking for --tokenizer."""
  if explicit or lm.data_cfg is not None:
    path = run_tokenizer.find(lm.data_cfg, explicit)
  else:
    path = lm.tokenizer_path and run_tokenizer.find(None, lm.tokenizer_path, what='its tokenizer')
  if not path:
    raise run_tokenizer.TokenizerError(
        f'{lm.source} names no tokenizer; pass --tokenizer=PATH (or a gs:// / s3:// URL) to '
        'the tokenizer.json its data was made with (the 7B: dolma2, allenai_dolma2.json).')
  tok = run_tokenizer.load(path)
  if tok.get_vocab_size() > lm.vocab_size:
    raise run_tokenizer.TokenizerError(
        f'Tokenizer {explicit or path} has {tok.get_vocab_size()} tokens but the model only '
        f'{lm.vocab_size}; it belongs to another model: pass the run\'s with --tokenizer.')
  return tok


def encode_requests(tokenizer, pairs: Sequence[tuple[str, str]], prefix_token: int
                    ) -> list[tuple[list[int], list[int]]]:
  """(context, continuation) strings -> token ids, as lm-eval's TemplateLM does.

  Trailing whitespace of the context moves to the continuation; the whole
  string is encoded and split at the context's token count, so the
  continuation's tokens are the ones the model would produce in running text.
  An empty context becomes the prefix (EOS) token.
  """
  split = []
  for context, continuation in pairs:
    if not continuation:
      raise ValueError(f'Empty continuation after context {context[-60:]!r}.')
    n = len(context) - len(context.rstrip())
    if n:
      context, continuation = context[:-n], context[-n:] + continuation
    split.append((context, continuation))
  texts = sorted({t for c, k in split for t in ((c, c + k) if c else (k,))})
  ids = dict(zip(texts, (e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False))))
  out = []
  for context, continuation in split:
    if context:
      ctx = ids[context]
      out.append((ctx, ids[context + continuation][len(ctx):]))
    else:
      cont = ids[continuation]
      out.append(([prefix_token], cont) if cont[0] != prefix_token else (cont[:1], cont[1:]))
  return out


def windows(context: Sequence[int], continuation: Sequence[int], max_length: int
            ) -> list[tuple[list[int], list[int]]]:
  """Pieces of a request that each fit max_length inputs and together score every token.

  A continuation of at most max_length tokens stays one piece whose context is
  left-truncated (lm-eval `_loglikelihood_tokens`); a longer one is cut into
  max_length-token pieces, each given as much preceding context as still fits.
  For a document after EOS, ([eos], doc), these are exactly lm-eval's disjoint
  rolling windows (`get_rolling_token_windows`, context_len=1).
  """
  whole = list(context) + list(continuation)
  out = []
  for a in range(len(context), len(whole), max_length):
    b = min(a + max_length, len(whole))
    out.append((whole[max(0, b - 1 - max_length):a], whole[a:b]))
  return out


# --- Batched, packed scoring -------------------------------------------------------------


def prefix_hosts(inputs) -> tuple[dict[tuple, tuple], list[tuple]]:
  """({input: the input it rides on}, the hosts, sorted): an input that is a prefix of
  another is scored inside it (sorted, a prefix comes right before its extensions, so
  walking back each takes the host of the next when it extends it)."""
  unique = sorted(set(inputs))
  host: dict[tuple, tuple] = {}
  for j in range(len(unique) - 1, -1, -1):
    s = unique[j]
    nxt = unique[j + 1] if j + 1 < len(unique) else ()
    host[s] = host[nxt] if nxt[:len(s)] == s else s
  return host, sorted(set(host.values()))


def place_rows(hosts: list[tuple], row_len: int
               ) -> tuple[list[list[int]], dict[tuple, tuple[int, int]]]:
  """(rows of host indices, {host: (row, offset)}): the hosts packed into rows of row_len."""
  rows = pack_rows([len(h) for h in hosts], row_len)
  place = {}
  for r, members in enumerate(rows):
    offset = 0
    for k in members:
      place[hosts[k]] = (r, offset)
      offset += len(hosts[k])
  return rows, place


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
  """Indices per row: longest first into the row with most room (worst-fit decreasing)."""
  rows: list[list[int]] = []
  room: list[tuple[int, int]] = []  # (-free, row)
  for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
    if room and -room[0][0] >= lengths[i]:
      free, r = heapq.heappop(room)
      rows[r].append(i)
      heapq.heappush(room, (free + lengths[i], r))
    else:
      rows.append([i])
      heapq.heappush(room, (lengths[i] - row_len, len(rows) - 1))
  return rows


class Scorer:
  """Log-likelihoods of continuations, many requests per forward pass.

  Each request needs the logits at the positions of its continuation, which
  only depend on its input (context + continuation minus the last token).
  Inputs that are a prefix of another input are served by that one (all
  choices of an MMLU question share one forward pass), and the remaining
  inputs are packed into fixed [B, R] rows with per-sequence segment ids and
  positions (document masking), so the model compiles once per row length.
  """

  def __init__(self, lm: LoadedModel, *, batch_tokens: int = 16384, row_len: int = 0):
    self.lm = lm
    self.batch_tokens = batch_tokens
    self.row_len = row_len or min(lm.max_length, 2048)
    self.seconds = 0.0
    self.tokens = 0
    forward = model.build(lm.cfg)
    vocab = lm.vocab_size

    def head(params, h_QD, tok_Q):
      def chunk(args):
        h_CD, tok_C = args
        logits_CV = model.head(params, h_CD, vocab)
        target_C = jnp.take_along_axis(logits_CV, tok_C[:, None], axis=1)[:, 0]
        return (target_C - jax.nn.logsumexp(logits_CV, axis=-1),
                jnp.argmax(logits_CV, axis=-1) == tok_C)
      q, d = h_QD.shape
      logp, greedy = jax.lax.map(chunk, (h_QD.reshape(q // _QUERY_CHUNK, _QUERY_CHUNK, d),
                                         tok_Q.reshape(q // _QUERY_CHUNK, _QUERY_CHUNK)))
      return logp.reshape(q), greedy.reshape(q)

    @jax.jit
    def score(params, tokens_BR, segment_ids_BR, positions_BR, row_Q, pos_Q, tok_Q):
      h_BRD = forward.apply(params, tokens_BR, segment_ids_BR, positions_BR)
      return head(params, h_BRD[row_Q, pos_Q], tok_Q)

    @jax.jit
    def next_token(params, tokens_BT, last_B):
      h_BTD = forward.apply(params, tokens_BT)
      h_BD = h_BTD[jnp.arange(tokens_BT.shape[0]), last_B]
      return jnp.argmax(model.head(params, h_BD, vocab), axis=-1)

    self._score, self._next_token = score, next_token

  def loglikelihood(self, tokenizer, pairs: Sequence[tuple[str, str]]
                    ) -> list[tuple[float, bool]]:
    """(sum log p(continuation | context), is greedy) per (context, continuation) string."""
    return self.loglikelihood_tokens(encode_requests(tokenizer, pairs, self.lm.eos_token_id))

  def loglikelihood_tokens(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]]
                           ) -> list[tuple[float, bool]]:
    """Token-level lm-eval `_loglikelihood_tokens`, long continuations split by `windows`."""
    start = time.time()
    inputs, targets, owner = [], [], []
    for i, (context, continuation) in enumerate(requests):
      if not context or not continuation:
        raise ValueError(f'Request {i}: context and continuation must both be non-empty '
                         '(use the EOS token as the context of a document start).')
      for ctx, cont in windows(context, continuation, self.lm.max_length):
        inputs.append(tuple(ctx + cont[:-1]))
        targets.append(cont)
        owner.append(i)
    owner = np.asarray(owner, np.int64)

    host, hosts = prefix_hosts(inputs)
    row_len = max([self.row_len] + [-(-len(h) // 128) * 128 for h in hosts])
    rows, place = place_rows(hosts, row_len)

    b = max(1, self.batch_tokens // row_len)
    queries = [[] for _ in range(-(-len(rows) // b))]  # per batch: (request, row, pos, token)
    for i, (inp, tgt) in enumerate(zip(inputs, targets)):
      r, offset = place[host[inp]]
      first = offset + len(inp) - len(tgt)
      queries[r // b].extend((i, r % b, first + t, tok) for t, tok in enumerate(tgt))

    logp = np.zeros(len(requests), np.float64)
    greedy = np.ones(len(requests), bool)
    pending = []
    for n, batch_queries in enumerate(queries):
      tokens = np.zeros((b, row_len), np.int32)
      segments = np.zeros((b, row_len), np.int32)
      positions = np.zeros((b, row_len), np.int32)
      for r, members in enumerate(rows[n * b:(n + 1) * b]):
        offset = 0
        for s, k in enumerate(members, 1):
          h = hosts[k]
          tokens[r, offset:offset + len(h)] = h
          segments[r, offset:offset + len(h)] = s
          positions[r, offset:offset + len(h)] = np.arange(len(h))
          offset += len(h)
      q = np.asarray(batch_queries, np.int64).reshape(-1, 4)
      size = _QUERY_CHUNK * 2 ** math.ceil(math.log2(max(1, -(-len(q) // _QUERY_CHUNK))))
      pad = size - len(q)
      cols = [np.pad(q[:, c], (0, pad)).astype(np.int32) for c in (1, 2, 3)]
      # Dispatch is asynchronous: the next batch is packed while this one runs.
      pending.append((q, self._score(self.lm.params, tokens, segments, positions, *cols)))
      self.tokens += int((segments > 0).sum())
    for q, (lp, gr) in pending:
      np.add.at(logp, owner[q[:, 0]], np.asarray(lp, np.float64)[:len(q)])
      np.logical_and.at(greedy, owner[q[:, 0]], np.asarray(gr)[:len(q)])
    self.seconds += time.time() - start
    return [(float(a), bool(g)) for a, g in zip(logp, greedy)]

  def rolling_nll(self, documents: Sequence[Sequence[int]]) -> list[float]:
    """Summed NLL of every token of each document, EOS as its first context (lm-eval rolling)."""
    eos = [self.lm.eos_token_id]
    return [-ll for ll, _ in self.loglikelihood_tokens([(eos, doc) for doc in documents])]

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               stop: Callable[[list[int]], bool] | None = None) -> list[list[int]]:
    """Greedy continuations (new tokens only); a row ends at EOS or when `stop` says so.

    No KV cache: each step reruns the right-padded rows (causal, so padding is
    invisible) and reads the logits at each row's last real token.
    """
    out: list[list[int]] = []
    b = max(1, self.batch_tokens // self.row_len)
    for n in range(0, len(prompts), b):
      rows = [list(p) for p in prompts[n:n + b]]
      if min(len(r) for r in rows) == 0:
        raise ValueError('generate: every prompt needs at least one token.')
      length = -(-(max(len(r) for r in rows) + max_new_tokens) // 64) * 64
      tokens = np.zeros((b, length), np.int32)
      for r, p in enumerate(rows):
        tokens[r, :len(p)] = p
      ends = np.array([len(p) for p in rows] + [1] * (b - len(rows)), np.int32)
      new = [[] for _ in rows]
      active = [True] * len(rows)
      for _ in range(max_new_tokens):
        nxt = np.asarray(self._next_token(self.lm.params, tokens, ends - 1))
        for r in range(len(rows)):
          if active[r]:
            new[r].append(int(nxt[r]))
            tokens[r, ends[r]] = nxt[r]
            ends[r] += 1
            active[r] = nxt[r] != self.lm.eos_token_id and not (stop and stop(new[r]))
        if not any(active):
          break
      out += [t[:-1] if t and t[-1] == self.lm.eos_token_id else t for t in new]
    return out
