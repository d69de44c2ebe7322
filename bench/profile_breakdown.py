"""Where a TPU step's time goes: a jax.profiler trace, op by op, read against the step's HLO.

    python bench/profile_breakdown.py --trace=DIR_OR.xplane.pb --hlo=step.hlo.txt[.gz]

bench/device_check.py --profile=DIR writes both on a TPU (the trace under
DIR/plugins/profile/, the compiled step's HLO as DIR/step.hlo.txt). Each op
that ran on the TPU's main timeline (the trace's 'XLA Ops' line) is looked up
in the HLO by its instruction name and sorted two ways:

  phase  where jax put it, by the op_name metadata that JAX writes into the HLO:
         'remat recompute' (under a checkpoint's rematted_computation), 'backward'
         (transpose(...)), 'forward' (jvp(...)), and 'update and metrics'
         (outside the differentiated loss: the optimizer, the norms, the logs)
  kind   what it computes: 'attention kernels' (the Pallas flash_attention_*
         custom calls), 'matmuls' (convolutions and dots, alone or fused with
         their neighbours), 'loss' (ops under a named scope matching --loss_scope:
         loss.py's output head and chunked cross-entropy, its matmul included),
         'other' (norms, elementwise work, copies)

'idle' is the step's time on the TPU that no op covers. Times are per step:
the sum over the trace divided by the number of steps in it.
"""

import argparse
import collections
import glob
import gzip
import os
import re
import sys

_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?(%[\w.\-]+) = (.*)$')
_COMPUTATION = re.compile(r'^(?:ENTRY )?(%[\w.\-]+) .*\{$')
# loss.py's named scope as JAX writes it into op_name: jvp(loss)/..., transpose(jvp(loss))/...
LOSS_SCOPE = r'[(/]loss[)/]'
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r'calls=(%[\w.\-]+)')
# Control flow: the trace shows a loop as one event spanning the events of its body's ops.
_CONTAINER = re.compile(r'(?<![\w-])(?:while|conditional|call)\(')  # not custom-call


def read_hlo(text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
  """(instruction name -> its line, computation name -> its instruction lines)."""
  instructions, computations, current = {}, {}, None
  for line in text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = computations.setdefault(m.group(1), [])
      continue
    m = _INSTRUCTION.match(line)
    if m:
      instructions[m.group(1)] = m.group(2)
      if current is not None:
        current.append(m.group(2))
  return instructions, computations


def _body(line: str, computations: dict[str, list[str]]) -> list[str]:
  """The instruction and, for a fusion, the instructions of the computation it calls."""
  m = _CALLS.search(line)
  return [line] + (computations.get(m.group(1), []) if m else [])


def classify(line: str, computations: dict[str, list[str]], loss_scope: re.Pattern
             ) -> tuple[str, str]:
  """(phase, kind) of one HLO instruction (see the module docstring)."""
  body = _body(line, computations)
  names = [n for part in body for n in _OP_NAME.findall(part)]
  op_name = names[0] if names else ''
  if 'rematted_computation' in op_name:
    phase = 'remat recompute'
  elif 'transpose(' in op_name:
    phase = 'backward'
  elif 'jvp(' in op_name:
    phase = 'forward'
  else:
    phase = 'update and metrics'
  if any('flash_attention' in n for n in names) and 'custom-call(' in line:
    kind = 'attention kernels'
  elif op_name and loss_scope.search(op_name):  # the output head's matmul included
    kind = 'loss'
  elif any(' convolution(' in part or ' dot(' in part for part in body):
    kind = 'matmuls'
  else:
    kind = 'other'
  return phase, kind


def _trace_file(path: str) -> str:
  if os.path.isfile(path):
    return path
  found = sorted(glob.glob(os.path.join(path, '**', '*.xplane.pb'), recursive=True))
  if not found:
    raise SystemExit(f'{path}: no *.xplane.pb trace under it; run bench/device_check.py '
                     '--profile=DIR on a TPU first')
  return found[-1]


def breakdown(trace_path: str, hlo_text: str, loss_scope: str = LOSS_SCOPE) -> dict:
  """Milliseconds per step by (phase, kind), plus 'idle' and the step time."""
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  profile = ProfileData.from_file(_trace_file(trace_path))
  tpu = next((p for p in profile.planes if p.name.startswith('/device:TPU:')), None)
  if tpu is None:
    raise SystemExit(f'{trace_path}: the trace holds no TPU timeline (planes: '
                     f'{[p.name for p in profile.planes]}); profile a step on a TPU')
  lines = {line.name: list(line.events) for line in tpu.lines}
  steps = lines.get('XLA Modules', [])
  if not steps:
    raise SystemExit(f'{trace_path}: no XLA module ran on the TPU while it was traced')
  instructions, computations = read_hlo(hlo_text)
  scope = re.compile(loss_scope)
  totals, unknown = collections.Counter(), collections.Counter()
  for event in lines.get('XLA Ops', []):
    name = event.name.split(' ', 1)[0]
    line = instructions.get(name)
    if line is None:  # an op of another module (the trace covers every launch)
      unknown[name] += event.duration_ns
      continue
    if _CONTAINER.search(line):
      continue
    totals[classify(line, computations, scope)] += event.duration_ns
  n = len(steps)
  step_ns = sum(e.duration_ns for e in steps)
  busy_ns = sum(totals.values())
  ms = lambda ns: ns / n / 1e6
  return {'steps': n, 'step (ms)': ms(step_ns), 'idle (ms)': ms(step_ns - busy_ns),
          'ops (ms)': {f'{p} / {k}': ms(v) for (p, k), v in totals.most_common()},
          'not in the HLO (ms)': ms(sum(unknown.values()))}


def print_table(result: dict) -> None:
  step = result['step (ms)']
  print(f"{result['steps']} steps, {step:.1f} ms per step on the TPU")
  by_phase, by_kind = collections.Counter(), collections.Counter()
  for key, value in result['ops (ms)'].items():
    phase, kind = key.split(' / ')
    by_phase[phase] += value
    by_kind[kind] += value
  for title, table in (('phase', by_phase), ('kind', by_kind)):
    print(f'\n{"by " + title:<28} {"ms":>8} {"share":>7}')
    for name, value in [*table.most_common(), ('idle', result['idle (ms)'])]:
      print(f'{name:<28} {value:>8.2f} {value / step:>7.1%}')
  print(f'\n{"phase / kind":<40} {"ms":>8} {"share":>7}')
  for key, value in result['ops (ms)'].items():
    print(f'{key:<40} {value:>8.2f} {value / step:>7.1%}')
  if result['not in the HLO (ms)']:
    print(f"(ops of other programs: {result['not in the HLO (ms)']:.2f} ms per step)")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--trace', required=True, help='an .xplane.pb or the --profile directory')
  p.add_argument('--hlo', required=True, help="the step's compiled HLO text (.txt or .txt.gz)")
  p.add_argument('--loss_scope', default=LOSS_SCOPE,
                 help="regex on an op's op_name marking the loss (loss.py's named scope)")
  args = p.parse_args()
  if not os.path.exists(args.hlo):
    p.error(f'--hlo={args.hlo} does not exist')
  if not os.path.exists(args.trace):
    p.error(f'--trace={args.trace} does not exist')
  opener = gzip.open if args.hlo.endswith('.gz') else open
  with opener(args.hlo, 'rt') as f:
    hlo = f.read()
  print_table(breakdown(args.trace, hlo, args.loss_scope))


if __name__ == '__main__':
  sys.exit(main())
