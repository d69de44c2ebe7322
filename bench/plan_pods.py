"""The 7B on TPU pods, planned by the TPU's own compiler (libtpu, no chip needed).

    python bench/plan_pods.py                      # every row below (about an hour on 2 cores)
    python bench/plan_pods.py --rows=stage1_v5e    # one group: stage1_v5e, remat,
                                                   # stage3, cpu_vs_tpu, slice
    python bench/plan_pods.py --breakdown          # + the temporaries term by term

Each row compiles the real train step (plan.tpu_plan: Pallas kernels, the
config's mesh and micro-batches) for a named slice and prints libtpu's
per-device memory: arguments (the sharded fp32 state and the batch) and the
temporaries, the peak, and whether it stays under --limit_gb (15 GB: a v5e's
16 GB less headroom for the runtime). A step too big for the chip fails
libtpu's compile; the row says so with the compiler's own figure.

cpu_vs_tpu puts the CPU planner (a compile on simulated CPU devices, temp
extrapolated as a + b/fsdp) beside libtpu's compile of the same step at two pod
sizes; slice does the same for bench/device_check.py's one-chip slice.

--breakdown reads XLA's live ranges of the compile (XLA_FLAGS --xla_dump_to):
every buffer live at the step's peak, sorted by name and shape into the state
(parameters, Adam moments), saved activations, gathered layer weights, logits
and the loss, and sharded fp32 buffers (the gradient accumulator, the update's
temporaries). The live buffers sum to less than arguments + temp: the temp
allocation also holds what is live at other moments, and fragmentation.
"""

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

GB = 1e9


def config(name: str, **overrides):
  """A row's config by name ('stage1', 'hd256', 'stage3', 'slice'), fields overridden."""
  import config_checks  # pylint: disable=import-outside-toplevel
  from configs import olmo3_7b, olmo3_7b_hd256, olmo3_7b_stage3  # pylint: disable=import-outside-toplevel
  if name == 'slice':  # bench/device_check.py's one-chip slice, as it builds it
    import device_check  # pylint: disable=import-outside-toplevel
    return config_checks.complete(device_check.slice_config(
        device_check.parser().parse_args(['--layers=2', '--vocab=8192'])))
  module = {'stage1': olmo3_7b, 'hd256': olmo3_7b_hd256, 'stage3': olmo3_7b_stage3}[name]
  cfg = module.get_config()
  for key, value in overrides.items():
    section, field = key.split('.')
    cfg[section][field] = value
  return config_checks.complete(cfg)


# name -> [(label, config, topology, overrides)]
ROWS = {
    'stage1_v5e': [(f'stage 1, v5e:{t}', 'stage1', f'v5e:{t}', {})
                   for t in ('4x4', '4x8', '8x8', '16x16')],
    'remat': [(f'stage 1, v5e:16x16, micro-batch {mb}, remat {remat}', 'stage1', 'v5e:16x16',
               {'train.micro_batch_size': mb, 'model.remat': remat})
              for mb, remat in ((2, 'full'), (1, 'save_qkv_attn'), (2, 'save_qkv_attn'),
                                (1, 'save_proj'), (2, 'save_proj'), (1, 'save_dots'),
                                (1, 'none'))],
    'stage3': [(f'stage 3, {t}', 'stage3', t, {})
               for t in ('v5e:4x4', 'v5e:4x8', 'v5e:8x8', 'v5p:2x2x2', 'v6e:2x4', 'v6e:4x4')],
    'cpu_vs_tpu': [(f'stage 1, v5e:{t}', 'stage1', f'v5e:{t}', {}) for t in ('4x8', '16x16')],
    'slice': [('one-chip slice (2 layers, vocab 8192), v5e:1x1', 'slice', 'v5e:1x1', {})],
}


def _dtype(shape: str) -> str:
  """'bf16' of 'bf16[2,8192,4096]{...}' (the first array of a tuple)."""
  match = re.search(r'([a-z]+[0-9]*)\[', shape)
  return match.group(1) if match else '?'


def _dims(shape: str) -> list[tuple[int, ...]]:
  return [tuple(int(x) for x in s.split(',') if x) for s in re.findall(r'\[([\d,]*)\]', shape)]


def classify(name: str, shape: str, cfg, shards: int) -> str:
  """The term a buffer live at the peak belongs to, from its name and shape (`shards`:
  how many ways the state is split, fsdp x context)."""
  m, d = cfg.model, cfg.data
  if name.startswith('state_params'):
    return 'arguments: parameters (fp32, sharded)'
  if name.startswith('state_opt_state'):
    return 'arguments: Adam moments mu, nu (fp32, sharded)'
  if name.startswith('batch'):
    return 'arguments: batch'
  dims = (_dims(shape) or [()])[0]
  dtype = _dtype(shape)
  qkv = m.num_heads * m.head_dim
  full = {(m.d_model, m.mlp_hidden), (m.mlp_hidden, m.d_model), (m.d_model, qkv),
          (qkv, m.d_model), (m.d_model, m.num_kv_heads * m.head_dim),
          (m.vocab_size, m.d_model), (m.d_model, m.vocab_size)}
  tokens = {d.seq_len // cfg.train.mesh_context, d.seq_len}
  if m.vocab_size in dims[-1:] and tokens & set(dims[:-1]):
    return f'logits and loss ({dtype})'
  if len(dims) >= 3 and tokens & set(dims[:-1]):  # [micro-batch, T, ...]
    return f'activations ({dtype})'
  if tuple(dims[-2:]) in full:
    return f'weight-shaped, whole layer: gathered weights, their gradients ({dtype})'
  if tokens & set(dims):
    return f'activations ({dtype})'
  if shards > 1 and len(dims) >= 2 and any(
      np.prod(dims[-2:]) * shards == a * b for a, b in full):
    return f'weight-shaped, sharded: gradient accumulator, updated state, gather inputs ({dtype})'
  return f'other ({dtype})'


def _element(shape: str, index: str) -> str:
  """Element `index` of a tuple shape '(a, b, ...)'; the shape itself when not a tuple."""
  shape = re.sub(r'/\*.*?\*/', '', shape)  # XLA's /*index=N*/ comments
  if not index or not shape.startswith('('):
    return shape
  parts, depth, current = [], 0, ''
  for ch in shape[1:-1]:
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      depth -= 1
    if ch == ',' and depth == 0:
      parts.append(current)
      current = ''
    else:
      current += ch
  parts.append(current)
  return parts[int(index)].strip()


def breakdown(dump_dir: str, cfg, shards: int) -> tuple[dict[str, float], dict[str, float]]:
  """(GB per term, GB per dtype) of the buffers live at the peak of the last train step
  compiled into `dump_dir`, from XLA's live ranges and the optimized HLO's shapes."""
  def last(suffix):  # the newest: module numbers are not in compile order
    return max(glob.glob(os.path.join(dump_dir, f'*jit_train_step*{suffix}')),
               key=os.path.getmtime)
  live, hlo = last('after_optimizations-live-range.txt'), last('after_optimizations.txt')
  shapes = {}
  for line in open(hlo):
    match = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) [\w\-]+\(', line)
    if match:
      shapes[match.group(1)] = match.group(2)
  terms: dict[str, float] = {}
  dtypes: dict[str, float] = {}
  at_peak = False
  for line in open(live):
    if '(peak):' in line:
      at_peak = True
      continue
    match = re.match(r'\s+([\w.\-]+)\{([\d,]*)\}: (\d+) bytes', line)
    if at_peak and not match:
      break
    if at_peak:
      name, index, size = match.groups()
      shape = _element(shapes.get(name, ''), index.split(',')[0])
      term, dtype = classify(name, shape, cfg, shards), _dtype(shape)
      terms[term] = terms.get(term, 0.0) + int(size) / GB
      dtypes[dtype] = dtypes.get(dtype, 0.0) + int(size) / GB
  return terms, dtypes


def print_breakdown(dump_dir: str, cfg, shards: int) -> None:
  terms, dtypes = breakdown(dump_dir, cfg, shards)
  by_dtype = ', '.join(f'{d} {gb:.2f}' for d, gb in sorted(dtypes.items(), key=lambda kv: -kv[1])
                       if gb >= 0.005)
  print(f'    live at the peak: {sum(terms.values()):.2f} GB ({by_dtype})', flush=True)
  for term, gb in sorted(terms.items(), key=lambda kv: -kv[1]):
    if gb >= 0.005:
      print(f'      {term:86s} {gb:6.2f} GB', flush=True)


def cpu_plan(cfg, target: int, devices: int = 8):
  import plan  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  return plan.make_plan(cfg, target if target != devices else None, platform='tpu',
                        chip='v5e', devices=jax.devices()[:devices])


def run_row(label, name, topology, overrides, args) -> None:
  import plan  # pylint: disable=import-outside-toplevel
  cfg = config(name, **overrides)
  start = time.perf_counter()
  p = plan.tpu_plan(cfg, topology)
  (c,) = p.compiles
  head = f'{label}: {c.devices} devices, mesh {c.mesh_shape}, {c.accum} micro-batches'
  seconds = time.perf_counter() - start
  if c.out_of_memory:
    print(f'{head}; DOES NOT FIT the chip: {c.out_of_memory} ({seconds:.0f} s)', flush=True)
    return
  verdict = f"{'fits' if p.peak_bytes <= args.limit_gb * GB else 'over'} {args.limit_gb:g} GB"
  print(f'{head}, arguments {c.argument / GB:.2f} GB, temp {c.temp / GB:.2f} GB, peak '
        f'{p.peak_bytes / GB:.2f} GB/device; {verdict} ({seconds:.0f} s)', flush=True)
  if args.breakdown:
    print_breakdown(args.dump, cfg, c.mesh_shape['fsdp'] * c.mesh_shape.get('context', 1))
  if args.group in ('cpu_vs_tpu', 'slice'):
    devices = 1 if args.group == 'slice' else 8
    cpu = cpu_plan(cfg, c.devices, devices)
    print(f'    CPU planner ({devices} simulated devices'
          f"{', extrapolated' if cpu.temp_extrapolated else ''}): temp "
          f'{cpu.temp_bytes / GB:.2f} GB, peak {cpu.peak_bytes / GB:.2f} GB/device = '
          f'{cpu.peak_bytes / p.peak_bytes:.2f}x the TPU compile', flush=True)
    if args.breakdown:  # the CPU compile on the most devices
      shape = cpu.compiles[-1].mesh_shape
      print_breakdown(args.dump, cfg, shape['fsdp'] * shape.get('context', 1))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--rows', default=','.join(ROWS), help=f'groups, of {sorted(ROWS)}')
  p.add_argument('--limit_gb', type=float, default=15.0)
  p.add_argument('--breakdown', action='store_true')
  args = p.parse_args()
  groups = args.rows.split(',')
  unknown = set(groups) - set(ROWS)
  if unknown:
    p.error(f'--rows: unknown {sorted(unknown)}; choose from {sorted(ROWS)}')
  import plan  # pylint: disable=import-outside-toplevel
  if not plan.libtpu_version():
    p.error("the TPU's compiler is not installed: pip install 'libtpu==0.0.42.*' (no TPU "
            'needed)')
  args.dump = tempfile.mkdtemp(prefix='xla_dump_')
  os.environ['XLA_FLAGS'] = (f'{os.environ.get("XLA_FLAGS", "")} --xla_dump_to={args.dump} '
                             '--xla_dump_hlo_module_re=.*train_step.* --xla_dump_hlo_pass_re=NONE').strip()
  if 'cpu_vs_tpu' in groups:  # the CPU planner's 8 simulated devices (2 x 8 for its pair)
    os.environ['XLA_FLAGS'] += ' --xla_force_host_platform_device_count=16'
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update('jax_platforms', 'cpu')
  print(f'libtpu {plan.libtpu_version()}; load {os.getloadavg()[0]:.2f}', flush=True)
  for group in groups:
    args.group = group
    for row in ROWS[group]:
      shutil.rmtree(args.dump, ignore_errors=True)  # one compile's dump at a time
      run_row(*row, args)
  shutil.rmtree(args.dump, ignore_errors=True)
  print(f'load {os.getloadavg()[0]:.2f}', flush=True)


if __name__ == '__main__':
  main()
