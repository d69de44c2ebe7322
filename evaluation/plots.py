r"""The headline comparison: two training-loss curves and per-landmark eval deltas.

    python eval.py --plot_ours=WORKDIR/metrics.jsonl --plot_reference=wandb_export.csv \
        --plot_bin=2000 --output=loss.png
    python eval.py --landmarks_ours='ours/step_*.json' --landmarks_ref='ref/step_*.json'

Curves (docs/evaluation.md): both runs are cut into the same step bins
([k*bin, (k+1)*bin)), each bin is the mean of the logged values in it, and
the lower panel is ours minus the reference on the bins both have.
Ours comes from train.py's metrics.jsonl or its TensorBoard event files; the
reference from a W&B CSV/TSV export (a 'Step' column and one
'<run> - <metric>' column, its __MIN/__MAX companions ignored).

Landmark tables pair eval.py reports by step: held-out loss and each
downstream task's primary metric, ours - reference, with the combined
standard error sqrt(se_ours^2 + se_ref^2) of two independent estimates.
"""

import csv
import io
import json
import math
import os
from collections.abc import Sequence

import numpy as np

import errors
from monitor import events
from monitor import metrics
from store import storage

STEP_COLUMNS = ('Step', 'step', '_step', 'global_step', 'trainer/global_step')


def read_curve(path: str, metric: str = 'train/CE loss') -> tuple[np.ndarray, np.ndarray]:
  """(steps, values) sorted by step, from JSONL, TensorBoard events, or a W&B CSV/TSV."""
  if storage.isdir(path) or storage.basename(path).startswith('events.out.tfevents'):
    # tensorboardX's SummaryWriter writes spaces in tags as '_'.
    steps, values = events.read_scalars(path, {metric, metric.replace(' ', '_')})
  elif path.endswith('.jsonl'):  # a file, or a bucket run's segments (metrics.read_records)
    records = [r for r in metrics.read_records(path) if metric in r and 'step' in r]
    steps, values = [r['step'] for r in records], [r[metric] for r in records]
  elif path.endswith(('.csv', '.tsv')):
    steps, values = _read_wandb(path, metric)
  else:
    raise errors.DataError(f'{path}: not a .jsonl, .csv, .tsv, TensorBoard event file or '
                           'folder.')
  if not steps:
    raise errors.DataError(f'{path}: no values of {metric!r} found; check --metric.')
  order = np.argsort(steps, kind='stable')
  return np.asarray(steps, np.int64)[order], np.asarray(values, np.float64)[order]


def _read_wandb(path: str, metric: str) -> tuple[list[int], list[float]]:
  with open(storage.local_view(path), newline='') as f:  # a path, or a bucket's object
    rows = list(csv.DictReader(f, delimiter='\t' if path.endswith('.tsv') else ','))
  if not rows:
    raise errors.DataError(f'{path}: empty export.')
  header = list(rows[0])
  step_col = next((c for c in STEP_COLUMNS if c in header), None)
  columns = [c for c in header if (c == metric or c.endswith(' - ' + metric))]
  if step_col is None or len(columns) != 1:
    raise errors.DataError(f'{path}: need one step column (one of {STEP_COLUMNS}) and exactly one '
                           f'column named {metric!r} or "<run> - {metric}"; header: {header}.')
  steps, values = [], []
  for row in rows:
    if row[columns[0]] not in ('', 'NaN', 'nan'):  # W&B leaves steps without the metric empty
      steps.append(int(float(row[step_col])))
      values.append(float(row[columns[0]]))
  return steps, values


def bin_curve(steps: np.ndarray, values: np.ndarray, bin_size: int
              ) -> tuple[np.ndarray, np.ndarray]:
  """(bin start steps, mean value per bin) over bins [k*bin, (k+1)*bin) that hold values."""
  if bin_size < 1:
    raise errors.ConfigError(f'bin size {bin_size} must be >= 1 step.')
  keys = np.asarray(steps) // bin_size
  starts, inverse = np.unique(keys, return_inverse=True)
  means = np.bincount(inverse, weights=values) / np.bincount(inverse)
  return starts * bin_size, means


def plot_curves(ours: tuple[np.ndarray, np.ndarray], reference: tuple[np.ndarray, np.ndarray], *,
                bin_size: int, out: str, labels: Sequence[str] = ('ours', 'reference'),
                metric: str = 'train/CE loss') -> dict:
  """Two binned curves above, their difference on shared bins below; writes a PNG.

  A bare `Figure` renders with Agg and touches no pyplot state, so this works
  without a display.
  """
  # Imported here: matplotlib takes ~0.5 s to import, and every eval.py start (most of
  # which plot nothing) would pay it.
  from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
  a_steps, a = bin_curve(*ours, bin_size)
  b_steps, b = bin_curve(*reference, bin_size)
  shared, ia, ib = np.intersect1d(a_steps, b_steps, return_indices=True)
  delta = a[ia] - b[ib]
  fig = Figure(figsize=(9, 6))
  top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={'height_ratios': [3, 1]})
  centre = bin_size / 2
  top.plot(a_steps + centre, a, label=labels[0])
  top.plot(b_steps + centre, b, label=labels[1])
  top.set_ylabel(metric)
  top.set_title(f'{metric}, mean per {bin_size}-step bin')
  top.legend()
  bottom.axhline(0.0, color='grey', linewidth=0.8)
  bottom.plot(shared + centre, delta, color='black')
  bottom.set_ylabel(f'{labels[0]} - {labels[1]}')
  bottom.set_xlabel('step')
  fig.tight_layout()
  image = io.BytesIO()  # rendered here, then written whole: `out` may be a bucket object
  fig.savefig(image, dpi=120, format=os.path.splitext(out)[1][1:].lower() or 'png')
  storage.write_atomic(out, image.getvalue(), fsync=False)
  return {'bins': shared.tolist(), 'delta': delta.tolist(),
          'mean_delta': float(delta.mean()) if delta.size else math.nan}


def landmark_rows(ours: Sequence[dict], reference: Sequence[dict]) -> list[dict]:
  """Per step in both lists of eval.py reports: (metric, ours, ref, delta, combined stderr)."""
  by_step = {r['step']: r for r in reference}
  rows = []
  for report in sorted(ours, key=lambda r: r['step']):
    ref = by_step.get(report['step'])
    if ref is None:
      continue
    pairs = []
    if 'heldout' in report and 'heldout' in ref:
      if report['heldout']['fingerprint'] != ref['heldout']['fingerprint']:
        raise errors.DataError(f"step {report['step']}: the two held-out losses were computed "
                               'on different batches (fingerprints differ); rerun with the same '
                               'files.')
      pairs.append(('heldout loss', report['heldout']['loss'], report['heldout']['stderr'],
                    ref['heldout']['loss'], ref['heldout']['stderr']))
    tasks_a = report.get('downstream', {}).get('tasks', {})
    tasks_b = ref.get('downstream', {}).get('tasks', {})
    for task in [t for t in tasks_a if t in tasks_b]:
      metric = tasks_a[task]['primary']
      pairs.append((f'{task} {metric}', tasks_a[task][metric], tasks_a[task][metric + '_stderr'],
                    tasks_b[task][metric], tasks_b[task][metric + '_stderr']))
    if tasks_a and tasks_b and set(tasks_a) == set(tasks_b):
      ma, mb = report['downstream']['macro'], ref['downstream']['macro']
      pairs.append(('macro primary', ma['primary'], ma['primary_stderr'],
                    mb['primary'], mb['primary_stderr']))
    for name, va, sa, vb, sb in pairs:
      rows.append({'step': report['step'], 'metric': name, 'ours': va, 'reference': vb,
                   'delta': va - vb, 'stderr': math.sqrt(sa * sa + sb * sb)})
  return rows


def format_landmarks(rows: Sequence[dict]) -> str:
  lines = [f"{'step':>8s}  {'metric':<26s} {'ours':>9s} {'reference':>9s} {'delta':>9s} "
           f"{'± stderr':>9s}"]
  for r in rows:
    lines.append(f"{r['step']:>8d}  {r['metric']:<26s} {r['ours']:>9.4f} {r['reference']:>9.4f} "
                 f"{r['delta']:>+9.4f} {r['stderr']:>9.4f}")
  return '\n'.join(lines)


def read_reports(pattern: str) -> list[dict]:
  """The eval.py report JSONs matching a glob pattern (a path or a URL), in file-name order."""
  files = storage.glob(pattern)  # a path or a bucket's keys
  if not files:
    raise errors.DataError(f'{pattern!r} matches no eval.py report files.')
  return [json.loads(storage.read_text(file)) for file in files]
