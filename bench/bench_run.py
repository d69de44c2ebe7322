"""The run as a benchmark: train.py for a few hundred steps with saves and evaluation, then
resumed; run throughput against the step's own, the goodput account, each save's cost.

    python bench/bench_run.py --slice [--steps=200 --every=50 --resume_steps=50]
    JAX_PLATFORMS=cpu python bench/bench_run.py --tiny         # the CPU miniature
    python bench/bench_run.py -- --config.X=Y ...               # more train.py overrides

What a pod user runs before committing a pod. Two processes of `python train.py`,
as a user starts them (--num_processes=1 on a one-chip TPU host), in one fresh
workdir (its compilation cache too, train.compilation_cache_dir='auto'):
  run     --steps steps, a checkpoint and held-out evaluation every --every steps
          (downstream tasks off), the log every --log_every;
  resume  the same command with train.steps raised by --resume_steps: it restores
          the last checkpoint, with the compilation cache the first left (warm).
--slice is the 7B's 2-layer slice as issue 59 ran it on a TPU v5e: configs/small.py
with d_model 4096, 32 x 128 heads, MLP 11008, layers 'SF', window 4096, bf16,
full remat, one sequence of 8,192 tokens per step, lr 3e-4 (the embedded
Shakespeare mix: its 8,192-token vocabulary). Read from the run's own records
(metrics.jsonl: one `time/step` per log window, the evaluation times, each
save's `goodput/checkpoint ...` costs; goodput/: the account):
  step          the step's own time: the median log window that holds no save,
                no evaluation and no start-up
  throughput    tokens per second of wall time from the first window's end to
                the last step, over the step's own (evaluation included, and
                with the evaluations' own seconds taken out)
  saves         per save: what save() held the loop, the window after it less
                the steady steps and the evaluation in it, and the seconds
                from save() to its commit
  start-up      time to first step of each process and where it went (the
                `time to first step` line), the restore's seconds
  goodput       the account of both processes (monitor/goodput.py)
Prints every number, then one JSON line (--out: also to a file).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from monitor import goodput  # noqa: E402  pylint: disable=wrong-import-position

SLICE = ['--config.model.d_model=4096', '--config.model.num_heads=32',
         '--config.model.num_kv_heads=32', '--config.model.head_dim=128',
         '--config.model.mlp_hidden=11008', '--config.model.num_layers=2',
         '--config.model.layer_pattern=SF', '--config.model.sliding_window=4096',
         '--config.model.dtype=bfloat16', '--config.model.remat=full',
         '--config.data.seq_len=8192', '--config.data.global_batch_size=1',
         '--config.train.micro_batch_size=1', '--config.opt.lr=3e-4', '--num_processes=1']
TINY = ['--config.model.num_layers=2', '--config.model.layer_pattern=SF',
        '--config.model.d_model=64', '--config.model.num_heads=2',
        '--config.model.num_kv_heads=2', '--config.model.head_dim=32',
        '--config.model.mlp_hidden=128', '--config.data.seq_len=64',
        '--config.data.global_batch_size=4', '--config.train.micro_batch_size=4',
        '--config.model.sliding_window=16', '--config.data.validation_batches=2']


def run_train(workdir: str, steps: int, args, extra: list[str]) -> tuple[str, float]:
  cmd = [sys.executable, os.path.join(REPO, 'train.py'), '--config=configs/small.py',
         f'--workdir={workdir}', f'--config.train.steps={steps}',
         f'--config.train.ckpt_every={args.every}', f'--config.train.eval_every={args.every}',
         f'--config.train.log_every={args.log_every}', '--config.train.eval_tasks=()',
         '--sample_tokens=0', *extra]
  print('$', ' '.join(cmd[1:]), flush=True)
  began = time.time()
  proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                        text=True, check=False)
  seconds = time.time() - began
  lines = [l for l in proc.stdout.splitlines()
           if l.startswith(('step ', 'time to first step', 'goodput ', 'error'))
           or 'Checkpoint step' in l or 'Resumed' in l]
  print('\n'.join(lines), flush=True)
  if proc.returncode:
    print(proc.stdout[-5000:])
    raise SystemExit(f'train.py exited with {proc.returncode}')
  return proc.stdout, seconds


def records(workdir: str) -> tuple[dict[int, dict], list[dict]]:
  """metrics.jsonl: the records of each step merged (the resumed run's replace the first's
  past its checkpoint, as MetricWriter drops them), and every record as written."""
  out: dict[int, dict] = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    raw = [json.loads(line) for line in f]
  for r in raw:
    out.setdefault(r['step'], {}).update({k: v for k, v in r.items() if k != 'step'})
  return out, raw


def analyse(recs: dict[int, dict], raw: list[dict], first: int, last: int, every: int,
            log_every: int) -> dict:
  """The windows of one process's steps (first, last]: the step's own time, throughput,
  each save's cost."""
  logs = [s for s in sorted(recs) if first < s <= last and 'time/step' in recs[s]]
  tokens_per_step = recs[logs[0]]['throughput/total tokens'] / logs[0]
  windows = []  # (start, end, seconds)
  prev = first
  for s in logs:
    windows.append((prev, s, recs[s]['time/step'] * (s - prev)))
    prev = s
  quiet = [sec / (b - a) for a, b, sec in windows[1:] if a % every and b - a == log_every]
  step_s = statistics.median(quiet)
  timed = windows[1:]  # the first holds the start-up: from its end to the last step
  wall = sum(sec for _, _, sec in timed)
  steps = sum(b - a for a, b, _ in timed)
  evals = sum(recs.get(a, {}).get('eval/lm/time (s)', 0.0) for a, _, _ in timed)
  saves = []
  for a, b, sec in timed:
    if a % every == 0 and a != last:
      r = recs.get(a, {})
      ev = r.get('eval/lm/time (s)', 0.0)
      saves.append({'step': a, 'blocked_s': r.get('goodput/checkpoint save blocked (s)'),
                    'copied_on_device_gb': r.get('goodput/checkpoint copied on device (GB)'),
                    'window_extra_s': sec - (b - a) * step_s, 'eval_s': ev,
                    'cost_s': sec - (b - a) * step_s - ev})
  durable = {int(r[f'{key} step']): r[f'{key} (s)'] for r in raw
             for key in ('goodput/checkpoint durable', 'goodput/checkpoint durable at exit')
             if f'{key} step' in r}
  for s in saves:
    s['durable_s'] = durable.get(s['step'])
  return {'step_s': step_s, 'tokens_per_step': tokens_per_step,
          'throughput_tok_s': steps * tokens_per_step / wall,
          'step_tok_s': tokens_per_step / step_s,
          'throughput_vs_step': steps * step_s / wall,
          'throughput_vs_step_without_eval': steps * step_s / (wall - evals),
          'eval_s': evals, 'wall_s': wall, 'steps': steps, 'saves': saves,
          'final_save_durable_s': durable.get(last)}


def startup(stdout: str) -> dict:
  m = re.search(r'time to first step ([\d.]+)s \(.*?\): (.*?)(?:; beside them, the train '
                r'step compiled in ([\d.]+)s)?$', stdout, re.MULTILINE)
  if not m:
    return {}
  stages = {k: float(v) for k, v in re.findall(r'(?:^|, )(.+?) ([\d.]+)s(?=, |$)', m.group(2))}
  return {'time_to_first_step_s': float(m.group(1)), 'stages': stages,
          'train_step_compile_beside_s': float(m.group(3)) if m.group(3) else None}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--slice', action='store_true', help="issue 59's 7B slice (a TPU)")
  p.add_argument('--tiny', action='store_true', help='a CPU miniature')
  p.add_argument('--steps', type=int, default=200)
  p.add_argument('--every', type=int, default=50, help='checkpoint and evaluation interval')
  p.add_argument('--log_every', type=int, default=10)
  p.add_argument('--resume_steps', type=int, default=50)
  p.add_argument('--workdir', default='', help='default: a fresh temporary directory')
  p.add_argument('--out', default='', help='also write the JSON here')
  args, extra = p.parse_known_args()
  extra = [e for e in extra if e != '--']
  extra = (SLICE if args.slice else TINY if args.tiny else []) + extra
  workdir = args.workdir or tempfile.mkdtemp(prefix='bench_run_')
  load = os.getloadavg()
  out1, wall1 = run_train(workdir, args.steps, args, extra)
  out2, wall2 = run_train(workdir, args.steps + args.resume_steps, args, extra)
  recs, raw = records(workdir)
  sessions = goodput.read_sessions(workdir)
  account = goodput.summary(workdir)
  result = {
      'workdir': workdir, 'train.py flags': extra, 'load_before': load,
      'load_after': os.getloadavg(),
      'run': {**analyse(recs, raw, 0, args.steps, args.every, args.log_every),
              **startup(out1), 'process_wall_s': wall1,
              'goodput': goodput.summarize(sessions[:1])},
      'resume': {**startup(out2), 'process_wall_s': wall2,
                 'restore_s': sessions[-1]['seconds'].get('checkpoint restore', 0.0),
                 **({} if args.resume_steps < 3 * args.log_every else
                    {'step_s': analyse(recs, raw, args.steps, args.steps + args.resume_steps,
                                       args.every, args.log_every)['step_s']})},
      'goodput': account}
  r = result['run']
  print(f"\nstep {r['step_s'] * 1e3:.1f} ms ({r['step_tok_s']:,.0f} tok/s); run throughput "
        f"{r['throughput_tok_s']:,.0f} tok/s over {r['steps']} steps = "
        f"{r['throughput_vs_step']:.3f} of the step's (evaluation's {r['eval_s']:.1f} s taken "
        f"out: {r['throughput_vs_step_without_eval']:.3f})")
  for s in r['saves']:
    print(f"save at step {s['step']}: save() held the loop {s['blocked_s']:.3f} s "
          f"({s['copied_on_device_gb']:.2f} GB copied on device); the window after it "
          f"{s['window_extra_s']:+.2f} s over the steady steps, {s['eval_s']:.2f} s of it "
          f"evaluation: the save cost {s['cost_s']:+.2f} s; durable after "
          f"{s['durable_s'] if s['durable_s'] is None else round(s['durable_s'], 2)} s")
  print(f"final save durable after {r['final_save_durable_s']} s")
  for name in ('run', 'resume'):
    st = result[name]
    print(f"{name}: time to first step {st.get('time_to_first_step_s')} s: {st.get('stages')}; "
          f"the train step's compile, beside them: {st.get('train_step_compile_beside_s')} s")
  print(f"resume: checkpoint restore {result['resume']['restore_s']:.2f} s")
  print(goodput.line(account))
  print(f"load average before {load[0]:.2f}, after {result['load_after'][0]:.2f}")
  print(json.dumps(result))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)


if __name__ == '__main__':
  main()
