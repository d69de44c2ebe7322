"""The accelerator check: the 7B's layer shapes on one GPU or TPU, in one call.

    python bench/device_check.py [--out=result.json]     # one GPU (e.g. H200): the GPU
                            # check's sections (bench/gpu_check.py), one JSON line, < 9.5 min
    JAX_PLATFORMS=cpu python bench/device_check.py --gpu --tiny   # its CPU stand-in
    python bench/device_check.py --layers=2 --vocab=8192 --fit --compare_hd256  # one TPU v5e
    python bench/device_check.py --layers=2 --vocab=8192 --profile=P  # + P/step.hlo.txt:
                                                  # bench/profile_breakdown.py reads both
    python bench/device_check.py --layers=2 --vocab=8192 --policies=candidates  # remat
                                                  # policies timed (docs/remat.md)
    JAX_PLATFORMS=cpu python bench/device_check.py --tiny  # the same script in miniature

A slice of the 7B (configs/olmo3_7b.py: d_model 4096, 32 heads, seq 8192, bf16
compute, fp32 master weights and Adam, the full vocabulary head) with
--layers=4 layers (one SSSF period), one sequence per step, on one device.
--vocab shrinks the vocabulary (embedding and head) where the full one's fp32
state does not fit the chip (a 16 GiB TPU v5e); MFU counts the shrunk head.
--remat picks the slice's remat policy (default: the 7B config's 'full').
--policies times the step under each of several policies in one process, beside
'full' and 'none', with a pod-equivalent MFU (check_policies), and runs nothing else.

  step        train.make_train_step's time per step (median of --steps after
              the compile) and MFU against metrics.PEAK_FLOPS for the chip,
              taken in the memory check's process
  memory      the step alone, in a process of its own: the executable's own
              memory_analysis() on the device and device.memory_stats()'s
              peak, against plan.py's prediction for the same slice, made in
              a CPU child: by libtpu's compile for the chip's one-chip
              topology where libtpu is installed (a TPU host), else by the CPU
              compile. The check fails when the device's compile and the plan
              differ by more than 3%.
  fit         (--fit, TPU) the most sequences per step that plan.py says fit
              the chip (libtpu compiles, peak under the chip's bytes_limit),
              n = 1, 2, ... up to --fit_max; then, each in a process of its
              own, a step of n sequences must run and one of n + 1 must fail
              with out-of-memory. Either surprise fails the check.
  hd256       (--hd256) the same step with configs/olmo3_7b_hd256.py's heads
              (16 x 256, same parameters and FLOPs) in a child, beside the
              32 x 128 step of this run: their time ratio
  attention   on a TPU the compiled Pallas kernel (kernels/) against
              model.reference_attention under XLA, outputs and gradients, at
              head_dim 128 and 256; causal and with the 4,096-token sliding
              window, T = seq_len (on CPU: the XLA path against
              model.reference_attention, outputs and gradients, relative errors)
  restart     a child process compiles and runs one step, twice, on one
              persistent compilation cache (goodput.compilation_cache): the
              second is a warm restart. The children run first (restart,
              memory, fit, hd256): a TPU is held by one process at a time, so
              the parent opens the device after them.

Prints one line per check and, with --out, writes every number as JSON.
--tiny shrinks everything (d_model 64, seq 128) so the test suite runs it on
CPU (tests/test_device_check.py) and the script cannot rot.
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels import gpu_flags  # noqa: E402
from kernels import xla  # noqa: E402


def rope_matmul(x_BTHK, cos_BTk, sin_BTk):
  """--rope_matmul, a lever: rotate_half(x) = [-x2, x1] as x times a signed permutation
  matrix (exact: one input times +-1 per output, float32 accumulation), so q and k stay
  [B, T, H, K] where model.apply_rope views them as [B, T, H, 2, K/2]."""
  k = x_BTHK.shape[-1]
  eye = np.eye(k // 2, dtype=np.float32)
  rotate_KK = np.block([[np.zeros_like(eye), eye], [-eye, np.zeros_like(eye)]])
  exact = jax.lax.Precision.HIGHEST if x_BTHK.dtype == jnp.float32 else None
  rotated_BTHK = jnp.einsum('bthk,kj->bthj', x_BTHK, rotate_KK.astype(x_BTHK.dtype),
                            precision=exact, preferred_element_type=jnp.float32)
  cos = jnp.concatenate([cos_BTk, cos_BTk], axis=-1)[:, :, None, :]
  sin = jnp.concatenate([sin_BTk, sin_BTk], axis=-1)[:, :, None, :]
  return (x_BTHK.astype(jnp.float32) * cos + rotated_BTHK * sin).astype(x_BTHK.dtype)


def slice_config(args):
  from configs import olmo3_7b  # pylint: disable=import-outside-toplevel
  import config_checks  # pylint: disable=import-outside-toplevel
  cfg = olmo3_7b.get_config()
  cfg.model.num_layers = args.layers
  if args.layers % len(cfg.model.layer_pattern):  # 2 layers: 'SF', one sliding and the full
    cfg.model.layer_pattern = cfg.model.layer_pattern[-args.layers:]
  cfg.data.global_batch_size = args.sequences  # one device: step_setup's mesh is devices[:1]
  cfg.train.micro_batch_size = args.sequences
  cfg.train.eval_tasks = ()
  if args.tiny:
    m = cfg.model
    m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 64, 4, 4, 16, 128
    m.sliding_window, m.vocab_size, m.dtype, m.remat = 32, 512, 'float32', 'none'
    cfg.data.seq_len, cfg.data.vocab_size = 128, 500
    cfg.data.eos_token_id, cfg.data.pad_token_id = 0, 1
  if args.hd256:  # configs/olmo3_7b_hd256.py's co-design: 16 x 256 = 32 x 128
    cfg.model.num_heads = cfg.model.num_kv_heads = cfg.model.num_heads // 2
    cfg.model.head_dim *= 2
  if args.remat:
    cfg.model.remat = args.remat
  if args.vocab:
    cfg.model.vocab_size = cfg.data.vocab_size = args.vocab
    cfg.data.eos_token_id, cfg.data.pad_token_id = 0, 1
  return config_checks.validate(cfg) or cfg


def step_setup(cfg, rope_matmul_lever: bool = False, tokens_BT1: np.ndarray | None = None):
  """(jitted train step, state, batch): the real train.py step on one device's mesh, on
  `tokens_BT1` ([B, T + 1]: inputs and their next tokens; default random ids)."""
  import model  # pylint: disable=import-outside-toplevel
  import optim  # pylint: disable=import-outside-toplevel
  import sharding  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:1])
  tx = optim.make_optimizer(cfg.opt)
  state, shardings = train.create_state(cfg, tx, mesh, jax.random.key(0))
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  tokens = (np.random.default_rng(0).integers(2, cfg.data.vocab_size, (B, T + 1), np.int32)
            if tokens_BT1 is None else tokens_BT1)
  rows = sharding.batch_sharding(mesh)
  batch = {'tokens': jax.device_put(tokens[:, :-1], rows),
           'labels': jax.device_put(tokens[:, 1:], rows),
           'instance_mask': jax.device_put(np.ones(B, bool), jax.sharding.NamedSharding(
               mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES)))}
  if rope_matmul_lever:
    model.apply_rope = rope_matmul
  step = jax.jit(train.make_train_step(cfg, tx, mesh, 1), donate_argnums=0,
                 out_shardings=(shardings, None))
  return step, state, batch


def check_step(cfg, args) -> dict:
  from monitor import metrics  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  step, state, batch = step_setup(cfg, args.rope_matmul)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  memory = compiled.memory_analysis()
  state, out = compiled(state, batch)
  jax.block_until_ready(out)
  compile_s = time.perf_counter() - start
  state, out = compiled(state, batch)  # a second untimed step: the timed ones are steady
  jax.block_until_ready(out)
  times = []
  # --profile: a jax.profiler trace of the timed steps (TensorBoard's profile plugin or
  # xprof read it: matmuls, the kernels, the loss, the update, idle time).
  if args.profile:  # the trace names XLA's ops; their HLO says what each one computes
    os.makedirs(args.profile, exist_ok=True)
    with open(os.path.join(args.profile, 'step.hlo.txt'), 'w') as f:
      f.write(compiled.as_text())
  with jax.profiler.trace(args.profile) if args.profile else contextlib.nullcontext():
    for _ in range(args.steps):
      start = time.perf_counter()
      state, out = compiled(state, batch)
      jax.block_until_ready(out)
      times.append(time.perf_counter() - start)
  seconds = float(np.median(times))
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  peak = metrics.peak_flops(cfg.train)
  flops = model.flops_per_token(cfg.model, cfg.data.seq_len) * tokens
  stats = jax.devices()[0].memory_stats() or {}
  return {'device': jax.devices()[0].device_kind, 'compile+first step (s)': compile_s,
          'step (s)': seconds, 'tokens/s': tokens / seconds,
          'MFU': flops / seconds / peak if peak else None, 'peak FLOP/s': peak,
          'loss': float(out['train/CE loss']),
          'measured peak (GB)': stats.get('peak_bytes_in_use', 0) / 1e9 or None,
          'bytes limit (GB)': stats.get('bytes_limit', 0) / 1e9 or None,
          'XLA flops': float((compiled.cost_analysis() or {}).get('flops', 0.0)),
          'host temp (GB)': memory.host_temp_size_in_bytes / 1e9,
          # What the device's own compile of this step allocates, as plan.py counts it.
          'compiled peak (GB)': (memory.argument_size_in_bytes + memory.output_size_in_bytes
                                 - memory.alias_size_in_bytes
                                 + memory.temp_size_in_bytes) / 1e9}


def update_seconds(cfg, steps: int) -> float:
  """The optimizer update alone on the slice's state (train_step's last lines), median s."""
  import optim  # pylint: disable=import-outside-toplevel
  import sharding  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  tx = optim.make_optimizer(cfg.opt)
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:1])
  state, shardings = train.create_state(cfg, tx, mesh, jax.random.key(0))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-4), state.params)

  def update(state, grads):
    updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=jnp.float32(3.0))
    return train.TrainState(optim.apply_updates(state.params, updates, opt_state), opt_state)
  run = jax.jit(update, donate_argnums=0, out_shardings=shardings)
  times = []
  for _ in range(steps + 2):  # two untimed
    start = time.perf_counter()
    state = jax.block_until_ready(run(state, grads))
    times.append(time.perf_counter() - start)
  return float(np.median(times[2:]))


def pod_step_seconds(step: float, update: float, pod_devices: int) -> float | None:
  """The step as one device of an FSDP pod pays it: less (1 - 1/pod_devices) of the
  update, which the pod shards over every device. None where the update measured alone
  took as long as the whole step, which holds it: that is timing noise (a tiny slice,
  too few --steps), and any figure taken from it would be made up."""
  if not 0 < update < step:
    return None
  return step - update * (1 - 1 / pod_devices)


def _policies(args) -> list[str]:
  if not args.policies:  # no planner import on every other run (and every child)
    return []
  import plan  # pylint: disable=import-outside-toplevel
  return plan.policy_list(args.policies)


def check_policies(args, pod_devices: int = 256) -> dict:
  """--policies: the slice's step under each remat policy, one after another, in this process.

  Beside each step's MFU, a pod-equivalent one: the step less (1 - 1/pod_devices) of the
  optimizer update's time (measured alone here), since a pod's FSDP shards the update
  over every device and each pays 1/pod_devices of the slice's whole-state update.
  """
  policies = _policies(args)
  policies = [p for p in ('full', 'none') if p not in policies] + policies
  update = update_seconds(slice_config(args), args.steps)
  print(f'optimizer update alone: {update * 1e3:.1f} ms', flush=True)
  rows = {}
  for policy in policies:
    args.remat = policy
    try:
      s = check_step(slice_config(args), args)
    except Exception as e:  # pylint: disable=broad-except
      if 'RESOURCE_EXHAUSTED' not in str(e) and 'out of memory' not in str(e).lower():
        raise
      rows[policy] = {'out of memory': str(e).splitlines()[0][:300]}
      print(f'{policy:28s} out of memory', flush=True)
      continue
    pod_step = pod_step_seconds(s['step (s)'], update, pod_devices)
    s['pod-equivalent MFU'] = (s['MFU'] * s['step (s)'] / pod_step
                               if s['MFU'] and pod_step else None)
    rows[policy] = s
    pod = ('n/a (update alone >= step: timing noise, raise --steps)' if pod_step is None
           else None if s['MFU'] is None else round(s['pod-equivalent MFU'], 3))
    print(f"{policy:28s} {s['step (s)'] * 1e3:7.1f} ms  MFU {_mfu(s)}  pod-equivalent "
          f"{pod}  XLA "
          f"{s['XLA flops'] / 1e12:.2f} TFLOP  device {s['compiled peak (GB)']:.2f} GB  host "
          f"{s['host temp (GB)']:.2f} GB", flush=True)
  return {'optimizer update (s)': update, 'pod devices': pod_devices, 'policies': rows}


def check_attention(cfg) -> dict:
  """TPU: the compiled Pallas kernel vs XLA (pallas_vs_xla). Elsewhere the XLA path
  (kernels/xla.py) vs model.reference_attention, forward and gradients, relative errors
  (a GPU host runs bench/gpu_check.py's numerics instead: ours, cuDNN and XLA)."""
  platform = jax.devices()[0].platform
  if platform == 'tpu':
    return {f'{name} K={k}': pallas_vs_xla(cfg.data.seq_len, k, window)
            for k in (128, 256) for name, window in (('causal', None),
                                                    ('sliding', cfg.model.sliding_window))}
  import gpu_check  # pylint: disable=import-outside-toplevel
  T, H, K = cfg.data.seq_len, cfg.model.num_heads, cfg.model.head_dim
  dtype = jnp.float32 if cfg.model.dtype == 'float32' else jnp.bfloat16
  q, k, v, do = gpu_check.qkv(T, H, H, K, dtype=dtype)
  attn = lambda q, k, v, window, seg: xla.attention(q, k, v, window=window, segment_ids_BT=seg)
  out = {}
  for name, window in (('causal', None), ('sliding', cfg.model.sliding_window)):
    errors = gpu_check.relative_errors(attn, q, k, v, do, window, None)
    out[name] = {'compared': 'xla vs model.reference_attention, out and grads',
                 'relative error': errors, 'ok': max(errors.values()) < 2e-2}
  return out


def pallas_vs_xla(t: int, head_dim: int, window: int | None, heads: int = 4) -> dict:
  """The compiled Pallas kernel against model.reference_attention, bf16, outputs and grads.

  Four heads (GQA 2:1): the XLA reference holds [heads, T, T] float32 logits and
  their gradient, which at all 32 heads and T = 8192 would not fit a 16 GiB chip.
  Errors are max |pallas - xla| / max |xla| per array; both round their bf16
  outputs, so 2e-2 is a few bf16 steps (the CPU tests bound each against float64).
  """
  import kernels  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.key(head_dim), 4)
  shapes = ((1, t, heads, head_dim), (1, t, heads // 2, head_dim),
            (1, t, heads // 2, head_dim), (1, t, heads, head_dim))
  q, k, v, do = (jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes))
  results = {}
  for name, attn in (('pallas', kernels.flash_attention), ('xla', model.reference_attention)):
    f = jax.jit(lambda q, k, v, attn=attn: jax.vjp(
        lambda q, k, v: attn(q, k, v, window=window), q, k, v))
    o, vjp = f(q, k, v)
    results[name] = (o, *vjp(do))
  errors = {}
  for i, label in enumerate(('out', 'dq', 'dk', 'dv')):
    got, want = (results[n][i].astype(jnp.float32) for n in ('pallas', 'xla'))
    errors[label] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  return {'compared': f'pallas vs xla, T={t}, {heads} heads', 'relative error': errors,
          'ok': max(errors.values()) < 2e-2}


def slice_flags(args, **changes) -> list[str]:
  """The flags that make a child's slice this run's (with `changes`)."""
  v = {**vars(args), **changes}
  return ([f"--layers={v['layers']}", f"--vocab={v['vocab']}", f"--steps={v['steps']}",
           f"--sequences={v['sequences']}"] + (['--tiny'] if v['tiny'] else [])
          + ([f"--remat={v['remat']}"] if v['remat'] else [])
          + (['--rope_matmul'] if v['rope_matmul'] else [])
          + (['--hd256'] if v['hd256'] else []))


def _child(flags: list[str], env=None, timeout=600) -> dict:
  """Runs this script with `flags` in a process of its own; its last line as JSON."""
  cmd = [sys.executable, os.path.abspath(__file__), *flags]
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  if out.returncode and 'lockfile' in out.stderr:  # a TPU not yet freed by the last holder
    time.sleep(5)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  if out.returncode:
    raise SystemExit(f'child {flags} failed: {out.stderr[-3000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def _plan_env() -> dict:
  """A child that plans on the CPU, off the parent's chip (libtpu compiles, opens none)."""
  return dict(os.environ, JAX_PLATFORMS='cpu')


def check_memory(args) -> dict:
  """The step alone in a child, against plan.py's peak for it (3% or the check fails)."""
  step = _child(['--step_child', *slice_flags(args)]
                + ([f'--profile={args.profile}'] if args.profile else []))
  if 'out of memory' in step:
    raise SystemExit(f"the slice's step does not fit the device ({step['out of memory']}); "
                     'shrink it with --layers=2 --vocab=8192 (a 16 GiB v5e)')
  predicted = _child(['--predict', *slice_flags(args), f"--device_kind={step['device']}"],
                     env=_plan_env())
  ratio = step['compiled peak (GB)'] / predicted['predicted peak (GB)']
  # The plan is held to 3% where it compiles what the device runs: libtpu for a TPU,
  # the CPU compile for a CPU. For a GPU it is the CPU compile's estimate (a stand-in
  # for cuDNN's kernel): the ratio is reported, not judged.
  judged = step['device'] == 'cpu' or predicted['planned by'].startswith('libtpu')
  return {'step': step, **predicted, 'compiled / predicted': ratio,
          'ok': abs(ratio - 1) <= 0.03 or not judged}


def check_fit(args, limit_gb: float, kind: str) -> dict:
  """The most sequences the plan fits under `limit_gb` runs on the chip; one more fails."""
  plans = _child(['--predict_fit', *slice_flags(args), f'--device_kind={kind}',
                  f'--limit_gb={limit_gb}'], env=_plan_env(), timeout=3000)
  n = plans['most sequences']
  if not n:
    return {**plans, 'ok': False, 'why': 'the plan fits not even one sequence'}
  runs = {k: _child(['--step_child', *slice_flags(args, sequences=k, steps=1)])
          for k in (n, n + 1)}
  fits, one_more = runs[n], runs[n + 1]
  ok = 'out of memory' not in fits and 'out of memory' in one_more
  return {**plans, 'runs': runs, 'ok': ok}


def _topology(kind: str) -> str:
  """The one-chip slice libtpu names for a device kind ('TPU v5 lite' -> 'v5e:1x1')."""
  import kernels  # pylint: disable=import-outside-toplevel
  import plan  # pylint: disable=import-outside-toplevel
  chips = {k: chip for chip, (k, _) in kernels.TPU_DEVICE_KINDS.items()}
  chips['TPU v5'] = 'v5p'
  chip = chips.get(kind)
  gen = next((g for g, (_, c, _) in plan.TPU_GENERATIONS.items() if c == chip), None)
  if gen is None:
    return ''
  return f'{gen}:1x1' if gen in ('v5e', 'v6e') else f'{gen}:1x1x1'


def _predict_one(args):
  import plan  # pylint: disable=import-outside-toplevel
  cfg = slice_config(args)
  topology = _topology(args.device_kind) if plan.libtpu_version() else ''
  if topology:
    return plan.tpu_plan(cfg, topology), f'libtpu for {topology}'
  platform = ('cpu' if args.device_kind == 'cpu' else 'tpu' if 'TPU' in args.device_kind
              else 'gpu')
  return (plan.make_plan(cfg, platform=platform, devices=jax.devices()[:1]),
          'the CPU compile')


def predict(args) -> None:
  p, how = _predict_one(args)
  print(json.dumps({'predicted peak (GB)': p.peak_bytes / 1e9, 'planned by': how}))


def predict_fit(args) -> None:
  """How many sequences per step the plan fits under --limit_gb, trying 1, 2, ..."""
  peaks = {}
  for n in range(1, args.fit_max + 1):
    args.sequences = n
    p, how = _predict_one(args)
    peaks[n] = None if p.out_of_memory else p.peak_bytes / 1e9
    if peaks[n] is None or peaks[n] > args.limit_gb:
      break
  fitting = [n for n, gb in peaks.items() if gb is not None and gb <= args.limit_gb]
  print(json.dumps({'planned peaks (GB)': peaks, 'limit (GB)': args.limit_gb,
                    'most sequences': max(fitting, default=0), 'planned by': how}))


def step_child(args) -> None:
  """One step check in this process; an out-of-memory step is reported, not raised."""
  try:
    print(json.dumps(check_step(slice_config(args), args)))
  except Exception as e:  # pylint: disable=broad-except
    if 'RESOURCE_EXHAUSTED' not in str(e) and 'out of memory' not in str(e).lower():
      raise
    print(json.dumps({'out of memory': str(e).splitlines()[0][:500]}))


def check_restart(args) -> dict:
  """A child compiles and runs one step, twice, on one fresh persistent cache."""
  with tempfile.TemporaryDirectory() as cache:
    env = dict(os.environ)
    env.pop('JAX_COMPILATION_CACHE_DIR', None)
    runs = []
    for _ in range(2):
      start = time.perf_counter()
      out = _child(['--child', f'--cache={cache}', *slice_flags(args)], env=env)
      runs.append({'process (s)': time.perf_counter() - start, **out})
  return {'cold': runs[0], 'warm': runs[1],
          'warm/cold first step': runs[1]['first step (s)'] / runs[0]['first step (s)']}


def child(args) -> None:
  from monitor import goodput  # pylint: disable=import-outside-toplevel
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kw: hits.append(event) if 'compilation_cache/cache_hits' in event else None)
  goodput.compilation_cache(args.cache, '/unused')
  start = time.perf_counter()
  step, state, batch = step_setup(slice_config(args))
  _, out = step(state, batch)
  jax.block_until_ready(out)
  print(json.dumps({'first step (s)': time.perf_counter() - start, 'cache hits': len(hits)}))


def _mfu(step: dict) -> float | None:
  return None if step['MFU'] is None else round(step['MFU'], 3)


def _run_children(args, result: dict) -> None:
  """Every check that needs the device to itself, before this process opens it."""
  result['restart'] = r = check_restart(args)
  print(f"restart: first step cold {r['cold']['first step (s)']:.1f}s, warm "
        f"{r['warm']['first step (s)']:.1f}s ({r['warm']['cache hits']} cache hits)",
        flush=True)
  result['memory'] = m = check_memory(args)
  step = m['step']
  print(f"memory: the step alone compiles to {step['compiled peak (GB)']:.2f} GB on "
        f"{step['device']} (runtime peak reading {step['measured peak (GB)']} GB), plan.py "
        f"({m['planned by']}) predicts {m['predicted peak (GB)']:.2f} GB: "
        f"{m['compiled / predicted']:.3f}x {'ok' if m['ok'] else 'FAILED'}", flush=True)
  if args.fit:
    if not step.get('bytes limit (GB)'):
      result['fit'] = {'ok': True, 'skipped': f"{step['device']} reports no memory limit"}
      print(f"fit: skipped, {result['fit']['skipped']}", flush=True)
    else:
      result['fit'] = f = check_fit(args, step['bytes limit (GB)'], step['device'])
      runs = {k: 'out of memory' if 'out of memory' in v else 'ran'
              for k, v in f.get('runs', {}).items()}
      print(f"fit: the plan fits {f['most sequences']} sequences in "
            f"{step['bytes limit (GB)']:.2f} GB; on the chip {runs}: "
            f"{'ok' if f['ok'] else 'FAILED'}", flush=True)
  if args.compare_hd256 and not args.hd256:
    wide = _child(['--step_child', *slice_flags(args, hd256=True)])
    result['hd256'] = {'step': wide, '16x256 / 32x128 time': wide['step (s)'] / step['step (s)']}
    print(f"hd256: half the heads at twice the head_dim {wide['step (s)'] * 1e3:.1f} ms vs "
          f"{step['step (s)'] * 1e3:.1f} ms: {result['hd256']['16x256 / 32x128 time']:.3f}x "
          f"the time, MFU {_mfu(wide)} vs {_mfu(step)}", flush=True)


def parser() -> argparse.ArgumentParser:
  """The command line (bench/plan_pods.py builds its one-chip slice from its defaults)."""
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tiny', action='store_true', help='CPU miniature (the test suite)')
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--vocab', type=int, default=0,
                 help="vocabulary size of the slice (0: the 7B's); a multiple of 128")
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--sequences', type=int, default=1, help='sequences per step and device')
  p.add_argument('--remat', default='',
                 help="the slice's remat policy, a preset or a save list (model.REMAT_SYNTAX; "
                 "default: the 7B config's 'full')")
  p.add_argument('--policies', default='',
                 help="the step under each of these remat policies, ';'-separated, or "
                 "'candidates' (plan.REMAT_CANDIDATES), with 'full' and 'none', in one run "
                 '(no other check runs)')
  p.add_argument('--rope_matmul', action='store_true',
                 help="a lever: RoPE's rotate_half as a permutation matmul (rope_matmul) "
                 "instead of model.apply_rope's [.., 2, K/2] view")
  p.add_argument('--fit', action='store_true',
                 help='the fit test: the most sequences the plan fits run, one more fails')
  p.add_argument('--fit_max', type=int, default=8, help='the fit test tries up to this many')
  p.add_argument('--hd256', action='store_true',
                 help="the whole check with configs/olmo3_7b_hd256.py's 16 x 256 heads")
  p.add_argument('--compare_hd256', action='store_true',
                 help='also time the 16 x 256 step in a child, beside the 32 x 128 one')
  p.add_argument('--out', default='', help='write every number here as JSON')
  p.add_argument('--gpu', action='store_true', help='the GPU check (bench/gpu_check.py; '
                 'the default on a host with an NVIDIA GPU; with --tiny its CPU stand-in)')
  p.add_argument('--budget_s', type=float, default=570.0,
                 help='the GPU check stops starting sections past this (s)')
  p.add_argument('--sections', default='', help='the GPU check: a comma-separated subset')
  p.add_argument('--profile', default='', help='a jax.profiler trace of the timed steps '
                 "(the memory check's process) into this directory")
  for hidden in ('--child', '--predict', '--predict_fit', '--step_child'):
    p.add_argument(hidden, action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--device_kind', default='cpu', help=argparse.SUPPRESS)
  p.add_argument('--limit_gb', type=float, default=0.0, help=argparse.SUPPRESS)
  p.add_argument('--cache', default='', help=argparse.SUPPRESS)
  return p


def main() -> None:
  xla.quiet_libtpu()  # libtpu without TPU chips: quiet, before a backend starts
  p = parser()
  args = p.parse_args()
  hidden = any(getattr(args, h) for h in ('child', 'predict', 'predict_fit', 'step_child'))
  if args.gpu or (not hidden and not args.policies and not args.tiny and gpu_flags.has_gpu()):
    import gpu_check  # pylint: disable=import-outside-toplevel
    sys.exit(gpu_check.main([f'--budget_s={args.budget_s}', f'--sections={args.sections}']
                            + ['--tiny'] * args.tiny + ([f'--out={args.out}'] if args.out else [])))
  if (args.layers < 1 or args.steps < 1 or args.sequences < 1 or args.fit_max < 1
      or args.vocab < 0 or args.vocab % 128):
    p.error('--layers, --steps, --sequences and --fit_max must be at least 1, --vocab 0 or a '
            'multiple of 128')
  for policy in [args.remat] + _policies(args):  # a mistake in one line, before device work
    try:
      slice_config(argparse.Namespace(**{**vars(args), 'remat': policy}))
    except ValueError as e:
      p.error(str(e))
  for hidden, run in (('child', child), ('predict', predict), ('predict_fit', predict_fit),
                      ('step_child', step_child)):
    if getattr(args, hidden):
      return run(args)
  if args.policies:
    result = {'policies': check_policies(args)}
    if args.out:
      with open(args.out, 'w') as f:
        json.dump(result, f, indent=1)
    return None
  began = time.perf_counter()
  result = {'tiny': args.tiny, 'layers': args.layers, 'vocab': args.vocab,
            'head_dim': 256 if args.hd256 else 128}
  _run_children(args, result)
  device = jax.devices()[0]
  result['platform'] = device.platform
  cfg = slice_config(args)
  result['attention'] = check_attention(cfg)
  for name, a in result['attention'].items():
    print(f"attention {name}: {json.dumps(a)}", flush=True)
  result['step'] = s = result['memory']['step']  # the step, timed in a process of its own
  print(f"step: {s['step (s)'] * 1e3:.1f} ms, {s['tokens/s']:,.0f} tok/s, MFU "
        f"{_mfu(s)} on {s['device']} "
        f"(compile + first step {s['compile+first step (s)']:.1f}s)", flush=True)
  result['seconds'] = time.perf_counter() - began
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  checks = [*result['attention'].values(), result['memory'], result.get('fit', {'ok': True})]
  ok = all(c['ok'] for c in checks)
  print(f"device check {'passed' if ok else 'FAILED'} in {result['seconds']:.0f}s", flush=True)
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
