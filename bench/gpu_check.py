"""The GPU device check's sections: `python bench/device_check.py` on a GPU host runs them.

    python bench/device_check.py [--out=check.json]             # one GPU, under 9.5 min
    JAX_PLATFORMS=cpu python bench/device_check.py --gpu --tiny  # the CPU stand-in (tests)

Each section runs in a process of its own (a crash or a hang costs that section, and a
GPU is never held by two of our processes at once), in this order, within a time
budget (--budget_s, default 570 s): a section that cannot start in time is recorded as
skipped, and a section's process is killed at the budget's end (recorded as timed out).

  versions   JAX, jaxlib, the CUDA plugin and NVIDIA wheels, driver, GPU name, device
             kind and its MFU peak (monitor/metrics.device_peak), XLA_FLAGS; a tiny step
             of train.py's step, so a version break costs seconds, not the call
  numerics   attention forward + backward against model.reference_attention (float32
             from the same bf16 inputs), max |got - want| / max |want| per output and
             gradient: the Pallas GPU kernel's own cases (kernels/flash_gpu.check_cases:
             window edges, segment boundaries, GQA, query offsets, head_dim 256), and at
             the 7B's shapes (T 8192, 4 heads of 128, causal and window 4096) ours,
             cuDNN through JAX, and the XLA path
  speed      attention TFLOP/s, forward + backward (3.5 x the forward's 4 H K pairs
             FLOPs), T 8192, 32 x 128 heads: causal and window 4096 (ours, cuDNN, XLA),
             document-masked and queries at an offset (ours), head_dim 256 (16 heads)
  step       bench/bench_gpu_step.py: our step beside OLMo-core's (8 layers)
  memory     device_check.check_memory: the step alone vs plan.py's prediction
  flags      the step (2 layers) compiled with XLA's defaults, with DEFAULT_ON, with every
             listed flag, and with each flag toggled from DEFAULT_ON (compiler_options
             per compile, one process)
  stage3     a 2-layer slice of configs/olmo3_7b_stage3.py: 65,536 tokens, document
             masking, one device: the step, its peak memory, the attention impl
  whole_7b   plan.py's prediction for the whole 7B on this device; if it fits the
             allocator's share, the step of all 32 layers

The parent prints one line per section and, last, ONE JSON line with every number.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, REPO)
sys.path.insert(0, BENCH)

SECTIONS = ('versions', 'numerics', 'speed', 'step', 'memory', 'flags', 'stage3', 'whole_7b')
# The least time worth starting each section with (s): a cold H200's compiles.
MIN_SECONDS = {'versions': 20, 'numerics': 40, 'speed': 40, 'step': 120, 'memory': 60,
               'flags': 60, 'stage3': 60, 'whole_7b': 90}
RELATIVE_BOUND = 2e-2  # a few bf16 steps: both sides round bf16 inputs and outputs


def run_process(cmd: list[str], timeout: float, env=None) -> dict:
  """Runs `cmd` in a session of its own; its last stdout line as JSON. At the timeout the
  whole session (grandchildren included) is killed, so nothing keeps the GPU."""
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=REPO, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=max(timeout, 1))
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    return {'timed out': f'killed after {timeout:.0f} s'}
  if proc.returncode:
    tail = (err or out).strip().splitlines()[-4:]
    return {'error': ' | '.join(tail)[-800:] or f'exit {proc.returncode}'}
  try:
    return json.loads(out.strip().splitlines()[-1])
  except (IndexError, json.JSONDecodeError):
    return {'error': f'no JSON line: {out[-300:]}'}


def section_cmd(name: str, args, left: float) -> list[str]:
  return [sys.executable, os.path.abspath(__file__), f'--section={name}',
          f'--section_budget_s={max(left - 15, 5):.0f}'] + (['--tiny'] if args.tiny else [])


def run_all(args) -> dict:
  began = time.monotonic()
  deadline = began + args.budget_s
  result = {'budget (s)': args.budget_s, 'sections': {}}
  only = [s for s in (args.sections.split(',') if args.sections else SECTIONS)]
  for name in SECTIONS:
    if name not in only:
      continue
    left = deadline - time.monotonic()
    if left < MIN_SECONDS[name] * (0.1 if args.tiny else 1):
      result['sections'][name] = {'skipped': f'time budget: {left:.0f} s left'}
    else:
      start = time.monotonic()
      result['sections'][name] = r = (run_step_bench(args, left) if name == 'step' else
                                      run_process(section_cmd(name, args, left), left))
      r['seconds'] = time.monotonic() - start
    print(f'{name}: {json.dumps(result["sections"][name])[:2000]}', flush=True)
  result['seconds'] = time.monotonic() - began
  result['ok'] = all(s.get('ok', True) and 'error' not in s and 'timed out' not in s
                     for s in result['sections'].values())
  return result


def run_step_bench(args, left: float) -> dict:
  flags = (['--tiny', '--layers=4', '--steps=2', '--warmup=1'] if args.tiny else
           ['--layers=8', '--steps=5', '--warmup=2'])
  return run_process([sys.executable, os.path.join(BENCH, 'bench_gpu_step.py'), *flags,
                      f'--budget_s={left - 5:.0f}'], left)


# --- Sections (each in its own process) ------------------------------------------------


def versions(args) -> dict:
  import importlib.metadata  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  import kernels  # pylint: disable=import-outside-toplevel
  from monitor import metrics  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  device = jax.devices()[0]
  wheels = {d.metadata['Name']: d.version for d in importlib.metadata.distributions()
            if d.metadata['Name'] and d.metadata['Name'].lower().startswith(
                ('nvidia-', 'jax-cuda', 'jax_cuda', 'torch', 'triton', 'ai2-olmo-core',
                 'dm-haiku', 'ml-collections'))}
  known = metrics.device_peak(device.device_kind)
  out = {'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'platform': device.platform,
         'device kind': device.device_kind, 'devices': jax.device_count(),
         'peak FLOP/s': known[0] if known else 'unknown: MFU not reported',
         'wheels': dict(sorted(wheels.items())), 'cudnn': kernels.cudnn_version(),
         'XLA_FLAGS': os.environ.get('XLA_FLAGS', ''),
         'memory fraction': os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', 'JAX default')}
  try:
    out['nvidia-smi'] = subprocess.run(
        ['nvidia-smi', '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'],
        capture_output=True, text=True, timeout=20).stdout.strip()
  except (OSError, subprocess.TimeoutExpired):
    out['nvidia-smi'] = None
  import device_check  # pylint: disable=import-outside-toplevel
  tiny = device_check.parser().parse_args(['--tiny', '--layers=2'])
  step, state, batch = device_check.step_setup(device_check.slice_config(tiny))
  state, metrics_out = step(state, batch)
  out['tiny step loss'] = float(metrics_out['train/CE loss'])
  out['seconds to a tiny step'] = time.perf_counter() - start
  return out


def _impls(platform: str):
  """name -> attention(q, k, v, window, seg): ours (Pallas GPU), cuDNN, the XLA path."""
  import kernels  # pylint: disable=import-outside-toplevel
  from kernels import flash_gpu  # pylint: disable=import-outside-toplevel
  from kernels import xla  # pylint: disable=import-outside-toplevel
  impls = {'ours': lambda q, k, v, window, seg, **kw: flash_gpu.flash_attention_gpu(
      q, k, v, window=window, segment_ids_BT=seg, interpret=platform != 'gpu', **kw)}
  if platform == 'gpu':  # the model's own cuDNN path, window mapping included
    def cudnn(q, k, v, window, seg):
      if seg is not None:
        raise NotImplementedError('cuDNN through JAX takes no segment ids here')
      return kernels.cudnn_attention(q, k, v, window=window, segment_ids_BT=None)
    impls['cudnn'] = cudnn
  impls['xla'] = lambda q, k, v, window, seg: xla.attention(q, k, v, window=window,
                                                            segment_ids_BT=seg)
  return impls


def relative_errors(attn, q, k, v, do, window, seg) -> dict[str, float]:
  """Forward + backward of `attn` against model.reference_attention in float32."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  ref = lambda q, k, v, window, seg: model.reference_attention(q, k, v, window=window,
                                                               segment_ids_BT=seg)
  results = []
  for fn, dtype, precision in ((attn, q.dtype, None), (ref, jnp.float32, 'highest')):
    def loss(q, k, v, fn=fn):
      return jnp.sum(fn(q, k, v, window, seg).astype(jnp.float32) * do.astype(jnp.float32))
    args = [x.astype(dtype) for x in (q, k, v)]
    # The reference at full float32: a GPU's XLA would otherwise multiply in TF32.
    with jax.default_matmul_precision(precision):
      out = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, window, seg))(*args)
      results.append((out, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)))
  errors = {}
  for name, got, want in zip(('out', 'dq', 'dk', 'dv'), *results):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    errors[name] = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
  return errors


def qkv(t: int, h: int, g: int, k: int, seed: int = 0, dtype=None):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(seed), 4)
  shapes = ((1, t, h, k), (1, t, g, k), (1, t, g, k), (1, t, h, k))
  return [jax.random.normal(key, s, jnp.float32).astype(dtype or jnp.bfloat16)
          for key, s in zip(keys, shapes)]


def numerics(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  from kernels import flash_gpu  # pylint: disable=import-outside-toplevel
  platform = jax.devices()[0].platform
  out = {'bound': RELATIVE_BOUND, 'kernel cases': {}, '7B shapes': {}}
  cases = flash_gpu.check_cases()
  dtype = jnp.bfloat16 if platform == 'gpu' else jnp.float32
  for name, case in cases if platform == 'gpu' else cases[:1]:  # CPU: interpret, slow
    errors = flash_gpu.case_errors(case, model.reference_attention, dtype=dtype,
                                   interpret=platform != 'gpu')
    out['kernel cases'][name] = {**errors, 'ok': max(errors.values()) < RELATIVE_BOUND}
  t, window = (8192, 4096) if not args.tiny else (128, 48)
  k = 128 if not args.tiny else 64
  q, kk, v, do = qkv(t, 4, 4, k, dtype=dtype)
  for impl, attn in _impls(platform).items():
    for label, w in (('causal', None), (f'window {window}', window)):
      errors = relative_errors(attn, q, kk, v, do, w, None)
      out['7B shapes'][f'{impl} {label}'] = {**errors, 'ok': max(errors.values()) < RELATIVE_BOUND}
  rows = [*out['kernel cases'].values(), *out['7B shapes'].values()]
  out['ok'] = all(r['ok'] for r in rows)
  return out


def pairs(positions, keys: int, window, docs=None) -> int:
  """(query, key) pairs a causal, windowed, document-masked attention computes."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  doc = np.zeros(keys, int) if docs is None else np.repeat(np.arange(len(docs)), docs)
  start = np.searchsorted(doc, doc, side='left')  # each position's document start
  pos = np.asarray(positions)
  first = start[pos] if window is None else np.maximum(start[pos], pos - window + 1)
  return int(np.sum(pos - first + 1))


def timed_tflops(attn, q, k, v, do, window, seg, n_pairs: int, repeats: int = 5, **kw) -> float:
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  loss = lambda q, k, v: jnp.sum(attn(q, k, v, window, seg, **kw).astype(jnp.float32) * do)
  f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  jax.block_until_ready(f(q, k, v))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(q, k, v))
    times.append(time.perf_counter() - start)
  h, kd = q.shape[2], q.shape[3]
  return 3.5 * 4 * h * kd * n_pairs * q.shape[0] / float(np.median(times)) / 1e12


def speed(args) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  platform = jax.devices()[0].platform
  impls = _impls(platform)
  if platform != 'gpu':  # interpret mode times nothing real: the XLA path stands in
    impls = {'xla': impls['xla']}
  t, w, heads = (8192, 4096, 32) if not args.tiny else (256, 96, 4)
  rows = {}

  def row(label, fn):
    try:
      rows[label] = float(f'{fn():.4g}')
    except Exception as e:  # pylint: disable=broad-except
      rows[label] = f'failed: {str(e).splitlines()[0][:200]}'

  q, k, v, do = qkv(t, heads, heads, 128 if not args.tiny else 64)
  for impl, attn in impls.items():
    for label, window in (('causal', None), (f'window {w}', w)):
      row(f'{impl} {label}', lambda attn=attn, window=window: timed_tflops(
          attn, q, k, v, do, window, None, pairs(range(t), t, window)))
  docs = np.diff(np.r_[0, np.sort(np.random.default_rng(0).choice(
      np.arange(1, t), 7, replace=False)), t])  # 8 documents of random lengths
  seg = jax.numpy.asarray(np.repeat(np.arange(8), docs)[None], jax.numpy.int32)
  for impl in [i for i in ('ours', 'xla') if i in impls]:
    row(f'{impl} documents x8 window {w}', lambda impl=impl: timed_tflops(
        impls[impl], q, k, v, do, w, seg, pairs(range(t), t, w, docs)))
  if 'ours' in impls:  # context parallelism's second half: queries at offset T/2
    half = t // 2
    row(f'ours q_offset {half} window {w}', lambda: timed_tflops(
        impls['ours'], q[:, half:], k, v, do[:, half:], w, None,
        pairs(range(half, t), t, w), q_offset=half))
  q2, k2, v2, do2 = qkv(t, heads // 2, heads // 2, 256 if not args.tiny else 128)
  for impl in [i for i in ('ours', 'cudnn') if i in impls]:
    row(f'{impl} head_dim 256 causal', lambda impl=impl: timed_tflops(
        impls[impl], q2, k2, v2, do2, None, None, pairs(range(t), t, None)))
  return {'T': t, 'heads': heads, 'TFLOP/s (fwd+bwd)': rows}


def memory(args) -> dict:
  """device_check.check_memory: the 4-layer step in a child vs plan.py's CPU compile."""
  import device_check  # pylint: disable=import-outside-toplevel
  ns = device_check.parser().parse_args(['--layers=4', '--steps=3']
                                        + (['--tiny'] if args.tiny else []))
  try:
    return device_check.check_memory(ns)
  except SystemExit as e:  # a child's failure, in one line
    return {'error': str(e)[-800:]}


def flags(args) -> dict:
  """One step (2 layers) compiled under XLA flag sets: compiler_options per compile."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import device_check  # pylint: disable=import-outside-toplevel
  from kernels import gpu_flags  # pylint: disable=import-outside-toplevel
  ns = device_check.parser().parse_args(['--layers=2'] + (['--tiny'] if args.tiny else []))
  cfg = device_check.slice_config(ns)
  listed = {f.name: f.setting for f in gpu_flags.XLA_GPU_FLAGS}
  defaults = [listed[n] for n in gpu_flags.DEFAULT_ON]
  variants = {'XLA defaults': [], 'DEFAULT_ON': defaults, 'all listed': list(listed.values())}
  for name, setting in listed.items():
    if name in gpu_flags.DEFAULT_ON:
      variants[f'DEFAULT_ON without {name}'] = [s for s in defaults if s != setting]
    else:
      variants[f'DEFAULT_ON + {name}'] = defaults + [setting]
  if args.tiny:  # the stand-in runs the machinery, not every variant
    variants = dict(list(variants.items())[:4])
  deadline = time.monotonic() + args.section_budget_s
  rows = {}
  step, state, batch = device_check.step_setup(cfg)  # one state, carried variant to variant
  for label, settings in variants.items():
    if time.monotonic() > deadline:
      rows[label] = 'skipped: time budget'
      continue
    options = {k: _typed(v) for k, v in (s[2:].split('=', 1) for s in settings)}
    try:
      compiled = step.lower(state, batch).compile(compiler_options=options)
      state, out = compiled(state, batch)
      times = []
      for _ in range(3):
        start = time.perf_counter()
        state, out = compiled(state, batch)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
      rows[label] = round(float(np.median(times)) * 1e3, 2)
    except Exception as e:  # pylint: disable=broad-except
      rows[label] = f'failed: {str(e).splitlines()[0][:200]}'
  return {'step ms (2 layers)': rows}


def _typed(value: str):
  """An XLA_FLAGS value as compile(compiler_options=...) wants it: bools and ints typed."""
  if value in ('true', 'false'):
    return value == 'true'
  return int(value) if value.isdigit() else value


def stage3(args) -> dict:
  """configs/olmo3_7b_stage3.py cut to 2 layers ('SF'), one device, document-masked."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from configs import olmo3_7b_stage3  # pylint: disable=import-outside-toplevel
  import config_checks  # pylint: disable=import-outside-toplevel
  import kernels  # pylint: disable=import-outside-toplevel
  import optim  # pylint: disable=import-outside-toplevel
  import sharding  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  cfg = olmo3_7b_stage3.get_config()
  m, d, t = cfg.model, cfg.data, cfg.train
  m.num_layers, m.layer_pattern = 2, 'SF'
  d.global_batch_size = t.micro_batch_size = 1
  t.mesh_context, t.eval_tasks = 1, ()
  if args.tiny:
    m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 128, 2, 2, 64, 256
    m.sliding_window, m.vocab_size, m.dtype = 64, 512, 'float32'
    d.seq_len, d.vocab_size, d.eos_token_id, d.pad_token_id = 512, 500, 0, 1
  config_checks.validate(cfg)
  T = d.seq_len
  mesh = sharding.make_mesh(t, jax.devices()[:1])
  tx = optim.make_optimizer(cfg.opt)
  state, shardings = train.create_state(cfg, tx, mesh, jax.random.key(0))
  rng = np.random.default_rng(0)
  docs = np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, T), 15, replace=False)), T])
  tokens = rng.integers(2, d.vocab_size, (1, T + 1), np.int32)
  rows = sharding.batch_sharding(mesh)
  batch = {'tokens': jax.device_put(tokens[:, :-1], rows),
           'labels': jax.device_put(tokens[:, 1:], rows),
           'segment_ids': jax.device_put(np.repeat(np.arange(16), docs)[None].astype(np.int32),
                                         rows),
           'instance_mask': jax.device_put(np.ones(1, bool), jax.sharding.NamedSharding(
               mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES)))}
  step = jax.jit(train.make_train_step(cfg, tx, mesh, 1), donate_argnums=0,
                 out_shardings=(shardings, None))
  compiled = step.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  state, out = compiled(state, batch)
  jax.block_until_ready(out)
  start = time.perf_counter()
  state, out = compiled(state, batch)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  stats = jax.devices()[0].memory_stats() or {}
  quadratic = m.num_heads * T * T * 4  # one layer's float32 [H, T, T] probabilities
  return {'seq_len': T, 'documents': 16, 'attention': ' '.join(
              kernels.resolve(m, segments=True)),
          'step (s)': seconds, 'tokens/s': T / seconds, 'loss': float(out['train/CE loss']),
          'compiled temp (GB)': memory.temp_size_in_bytes / 1e9,
          'measured peak (GB)': stats.get('peak_bytes_in_use', 0) / 1e9 or None,
          'O(T^2) probabilities of one layer (GB)': quadratic / 1e9,
          # At 65,536 tokens one layer's probabilities alone (550 GB) exceed the device:
          # a step whose temporaries stay under them holds no [T, T] array. (The tiny
          # stand-in's T is too short for the comparison to mean anything.)
          **({} if args.tiny else {'ok': memory.temp_size_in_bytes < quadratic})}


def whole_7b(args) -> dict:
  """plan.py's peak for the whole 7B (one sequence, one device) against the allocator's
  share of this device; the 32-layer step if it fits."""
  import jax  # pylint: disable=import-outside-toplevel
  layers = 32 if not args.tiny else 4
  flags = [f'--layers={layers}', '--steps=2'] + (['--tiny'] if args.tiny else [])
  stats = jax.devices()[0].memory_stats() or {}
  kind = jax.devices()[0].device_kind
  limit = stats.get('bytes_limit')
  plan_env = dict(os.environ, JAX_PLATFORMS='cpu')
  predicted = run_process([sys.executable, os.path.join(BENCH, 'device_check.py'), '--predict',
                           *flags, f'--device_kind={kind}'], args.section_budget_s / 2,
                          env=plan_env)
  out = {'layers': layers, 'plan': predicted,
         'allocator limit (GB)': limit / 1e9 if limit else None}
  if 'predicted peak (GB)' not in predicted:
    return out
  fits = limit is None or predicted['predicted peak (GB)'] * 1e9 <= limit
  out['plan says it fits'] = fits
  if fits:
    del device_check  # the step runs in a child: this process holds the device
    out['step'] = 'run by the parent after this process exits'
  return out


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tiny', action='store_true')
  p.add_argument('--section', choices=SECTIONS)
  p.add_argument('--sections', default='', help='comma-separated subset of ' + ','.join(SECTIONS))
  p.add_argument('--budget_s', type=float, default=570.0)
  p.add_argument('--section_budget_s', type=float, default=150.0, help=argparse.SUPPRESS)
  p.add_argument('--out', default='')
  return p


def run_section(args) -> None:
  if args.section != 'versions':  # versions reports the environment as it was given
    from kernels import gpu_flags  # pylint: disable=import-outside-toplevel
    gpu_flags.apply()  # as train.py starts
  fn = globals()[args.section]
  print(json.dumps(fn(args)), flush=True)


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  if args.section:
    run_section(args)
    return 0
  result = run_all(args)
  fit = result['sections'].get('whole_7b', {})
  if fit.get('plan says it fits'):
    left = args.budget_s - result['seconds']
    fit['step'] = (run_process([sys.executable, os.path.join(BENCH, 'device_check.py'),
                                '--step_child', f"--layers={fit['layers']}", '--steps=2']
                               + (['--tiny'] if args.tiny else []), left - 5)
                   if left > 30 else {'skipped': f'time budget: {left:.0f} s left'})
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result), flush=True)
  return 0 if result['ok'] else 1


if __name__ == '__main__':
  sys.exit(main())
