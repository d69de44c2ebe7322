"""The first accelerator check: the 7B's layer shapes on one GPU or TPU, in under 8 minutes.

    python bench/device_check.py [--out=result.json]     # one GPU (e.g. H200)
    python bench/device_check.py --layers=2 --vocab=8192   # one TPU v5e (15.7 GiB)
    JAX_PLATFORMS=cpu python bench/device_check.py --tiny  # the same script in miniature

A slice of the 7B (configs/olmo3_7b.py: d_model 4096, 32 heads, seq 8192, bf16
compute, fp32 master weights and Adam, the full vocabulary head) with
--layers=4 layers (one SSSF period), one sequence per step, on one device.
--vocab shrinks the vocabulary (embedding and head) where the full one's fp32
state does not fit the chip (a 16 GiB TPU v5e); MFU counts the shrunk head.

  step        train.make_train_step's time per step (median of --steps after
              the compile) and MFU against metrics.PEAK_FLOPS for the chip
  memory      device.memory_stats() peak against plan.py's prediction for the
              same config (computed in a CPU child process, as plan.py does)
  attention   on a GPU jax.nn.dot_product_attention implementation='cudnn'
              against 'xla'; on a TPU the compiled Pallas kernel (kernels/)
              against model.reference_attention under XLA, outputs and
              gradients, at head_dim 128 and 256; causal and with the
              4,096-token sliding window, T = seq_len (on CPU: 'xla' against
              model.reference_attention)
  restart     a child process compiles and runs one step, twice, on one
              persistent compilation cache (goodput.compilation_cache): the
              second is a warm restart. It runs first: a TPU is held by one
              process at a time, so the parent opens the device after it.

Prints one line per check and, with --out, writes every number as JSON.
--tiny shrinks everything (d_model 64, seq 128) so the test suite runs it on
CPU (tests/test_device_check.py) and the script cannot rot.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def slice_config(args):
  from configs import olmo3_7b  # pylint: disable=import-outside-toplevel
  import config_checks  # pylint: disable=import-outside-toplevel
  cfg = olmo3_7b.get_config()
  cfg.model.num_layers = args.layers
  if args.layers % len(cfg.model.layer_pattern):  # 2 layers: 'SF', one sliding and the full
    cfg.model.layer_pattern = cfg.model.layer_pattern[-args.layers:]
  cfg.data.global_batch_size = jax.device_count() if not args.predict else 1
  cfg.train.micro_batch_size = 1
  cfg.train.eval_tasks = ()
  if args.tiny:
    m = cfg.model
    m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 64, 4, 4, 16, 128
    m.sliding_window, m.vocab_size, m.dtype, m.remat = 32, 512, 'float32', 'none'
    cfg.data.seq_len, cfg.data.vocab_size = 128, 500
    cfg.data.eos_token_id, cfg.data.pad_token_id = 0, 1
  if args.vocab:
    cfg.model.vocab_size = cfg.data.vocab_size = args.vocab
    cfg.data.eos_token_id, cfg.data.pad_token_id = 0, 1
  return config_checks.validate(cfg) or cfg


def step_setup(cfg):
  """(jitted train step, state, batch): the real train.py step on one device's mesh."""
  import optim  # pylint: disable=import-outside-toplevel
  import sharding  # pylint: disable=import-outside-toplevel
  import train  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:1])
  tx = optim.make_optimizer(cfg.opt)
  state, shardings = train.create_state(cfg, tx, mesh, jax.random.key(0))
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  tokens = np.random.default_rng(0).integers(2, cfg.data.vocab_size, (B, T + 1), np.int32)
  rows = sharding.batch_sharding(mesh)
  batch = {'tokens': jax.device_put(tokens[:, :-1], rows),
           'labels': jax.device_put(tokens[:, 1:], rows),
           'instance_mask': jax.device_put(np.ones(B, bool), jax.sharding.NamedSharding(
               mesh, jax.sharding.PartitionSpec(sharding.BATCH_AXES)))}
  step = jax.jit(train.make_train_step(cfg, tx, mesh, 1), donate_argnums=0,
                 out_shardings=(shardings, None))
  return step, state, batch


def check_step(cfg, args) -> dict:
  import metrics  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  step, state, batch = step_setup(cfg)
  start = time.perf_counter()
  state, out = step(state, batch)
  jax.block_until_ready(out)
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state, out = step(state, batch)
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
          'measured peak (GB)': stats.get('peak_bytes_in_use', 0) / 1e9 or None}


def check_attention(cfg) -> dict:
  platform = jax.devices()[0].platform
  if platform == 'tpu':
    return {f'{name} K={k}': pallas_vs_xla(cfg.data.seq_len, k, window)
            for k in (128, 256) for name, window in (('causal', None),
                                                    ('sliding', cfg.model.sliding_window))}
  import model  # pylint: disable=import-outside-toplevel
  T, H, K = cfg.data.seq_len, cfg.model.num_heads, cfg.model.head_dim
  keys = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(key, (1, T, H, K), jnp.bfloat16) for key in keys)
  out = {}
  for name, window in (('causal', None), ('sliding', cfg.model.sliding_window)):
    local = None if window is None else (window - 1, 0)  # query i sees keys (i-W, i]
    xla = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                       implementation='xla')
    if platform == 'gpu':
      other = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                           implementation='cudnn')
      label = 'cudnn vs xla'
    else:  # no cuDNN here: the XLA path against the model's own reference equations
      other = model.reference_attention(q, k, v, window=window)
      label = 'xla vs model.reference_attention'
    diff = float(jnp.max(jnp.abs(xla.astype(jnp.float32) - other.astype(jnp.float32))))
    out[name] = {'compared': label, 'max abs diff': diff, 'ok': diff < 3e-2}
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


def slice_flags(args) -> list[str]:
  return [f'--layers={args.layers}', f'--vocab={args.vocab}'] + (['--tiny'] if args.tiny else [])


def predicted_peak(args, device) -> float | None:
  """plan.py's per-device peak (GB) for the slice on `device`, computed in a CPU child."""
  import kernels  # pylint: disable=import-outside-toplevel
  chips = {kind: chip for chip, (kind, _) in kernels.TPU_DEVICE_KINDS.items()}
  cmd = [sys.executable, os.path.abspath(__file__), '--predict', *slice_flags(args),
         f'--platform={device.platform}', f'--chip={chips.get(device.device_kind, "v5p")}']
  env = dict(os.environ, JAX_PLATFORMS='cpu')  # keeps the child off the parent's chip
  out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
  if out.returncode:
    print(f'plan prediction failed: {out.stderr[-2000:]}', flush=True)
    return None
  return json.loads(out.stdout.strip().splitlines()[-1])['predicted peak (GB)']


def check_restart(args) -> dict:
  """A child compiles and runs one step, twice, on one fresh persistent cache."""
  with tempfile.TemporaryDirectory() as cache:
    cmd = [sys.executable, os.path.abspath(__file__), '--child', f'--cache={cache}',
           *slice_flags(args)]
    env = dict(os.environ)
    env.pop('JAX_COMPILATION_CACHE_DIR', None)
    runs = []
    for _ in range(2):
      start = time.perf_counter()
      out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
      if out.returncode and 'lockfile' in out.stderr:  # a TPU not yet freed by the last holder
        time.sleep(5)
        start = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
      if out.returncode:
        raise SystemExit(f'restart child failed: {out.stderr[-3000:]}')
      runs.append({'process (s)': time.perf_counter() - start,
                   **json.loads(out.stdout.strip().splitlines()[-1])})
  return {'cold': runs[0], 'warm': runs[1],
          'warm/cold first step': runs[1]['first step (s)'] / runs[0]['first step (s)']}


def child(args) -> None:
  import goodput  # pylint: disable=import-outside-toplevel
  hits = []
  jax.monitoring.register_event_listener(
      lambda event, **kw: hits.append(event) if 'compilation_cache/cache_hits' in event else None)
  goodput.compilation_cache(args.cache, '/unused')
  start = time.perf_counter()
  step, state, batch = step_setup(slice_config(args))
  _, out = step(state, batch)
  jax.block_until_ready(out)
  print(json.dumps({'first step (s)': time.perf_counter() - start, 'cache hits': len(hits)}))


def predict(args) -> None:
  import plan  # pylint: disable=import-outside-toplevel
  cfg = slice_config(args)
  p = plan.make_plan(cfg, platform=args.platform, chip=args.chip, devices=jax.devices()[:1])
  print(json.dumps({'predicted peak (GB)': p.peak_bytes / 1e9}))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tiny', action='store_true', help='CPU miniature (the test suite)')
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--vocab', type=int, default=0,
                 help="vocabulary size of the slice (0: the 7B's); a multiple of 128")
  p.add_argument('--steps', type=int, default=5)
  p.add_argument('--out', default='', help='write every number here as JSON')
  p.add_argument('--child', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--predict', action='store_true', help=argparse.SUPPRESS)
  p.add_argument('--platform', default='gpu', help=argparse.SUPPRESS)
  p.add_argument('--chip', default='v5p', help=argparse.SUPPRESS)
  p.add_argument('--cache', default='', help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.layers < 1 or args.steps < 1 or args.vocab < 0 or args.vocab % 128:
    p.error('--layers and --steps must be at least 1, --vocab 0 or a multiple of 128')
  if args.child:
    return child(args)
  if args.predict:
    return predict(args)
  began = time.perf_counter()
  restart = check_restart(args)  # first: its children need the device to themselves
  print(f"restart: first step cold {restart['cold']['first step (s)']:.1f}s, warm "
        f"{restart['warm']['first step (s)']:.1f}s ({restart['warm']['cache hits']} cache hits)",
        flush=True)
  device = jax.devices()[0]
  result = {'platform': device.platform, 'tiny': args.tiny, 'layers': args.layers,
            'vocab': args.vocab, 'restart': restart}
  cfg = slice_config(args)
  result['attention'] = check_attention(cfg)
  for name, a in result['attention'].items():
    print(f"attention {name}: {json.dumps(a)}", flush=True)
  result['step'] = check_step(cfg, args)
  s = result['step']
  print(f"step: {s['step (s)'] * 1e3:.1f} ms, {s['tokens/s']:,.0f} tok/s, MFU "
        f"{s['MFU'] if s['MFU'] is None else round(s['MFU'], 3)} on {s['device']} "
        f"(compile + first step {s['compile+first step (s)']:.1f}s)", flush=True)
  result['predicted peak (GB)'] = predicted_peak(args, device)
  print(f"memory: measured peak {s['measured peak (GB)']} GB, plan.py predicts "
        f"{result['predicted peak (GB)']} GB", flush=True)
  result['seconds'] = time.perf_counter() - began
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  ok = all(a['ok'] for a in result['attention'].values())
  print(f"device check {'passed' if ok else 'FAILED'} in {result['seconds']:.0f}s", flush=True)
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
