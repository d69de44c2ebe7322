"""Our train step beside OLMo-core's on one device: same shapes, same tokens, one invocation.

    python bench/bench_gpu_step.py [--layers=8] [--steps=5] [--out=step.json]   # one GPU
    python bench/bench_gpu_step.py --tiny                                      # CPU miniature

Each side runs in a process of its own on the same device, one after the other, on
the same token array (written once by this process; each side reports its SHA-256):

  ours       train.py's step (train.make_train_step: forward, backward, skip-step AdamW,
             the state donated) on a slice of configs/olmo3_7b.py (device_check's
             slice_config: d 4096, 32 x 128 heads, the SSSF windows, seq 8192, the
             padded 100,352 vocabulary) with --layers layers and --remat (default
             'none': OLMo-core's side runs without activation checkpointing too)
  olmo_core  ai2-olmo-core's own TransformerConfig.olmo3_7B with n_layers cut to the
             same, its SkipStepAdamW, its fused CE + z-loss, bf16 autocast over fp32
             weights, torch.compile per block (OLMo-core's apply_compile; on CUDA only),
             and the fastest attention backend that imports on the machine (flash_3,
             flash_4, flash_2, te, then PyTorch SDPA: named in the output)

Per side: median seconds per step after --warmup steps, tokens/s, MFU, peak device
memory, the first step's loss. MFU counts model.flops_per_token (6 x the matmul
parameters + attention with causal masking halved, sliding layers counting the keys
they see; OLMo-core's and Ai2's count); 'MFU (full S^2)' beside it counts every
layer's full T x T attention (NeMo's count). The peak is monitor/metrics.device_peak's
datasheet figure (on CPU: a measured float32 matmul, as train.py's MFU).

Pod-equivalent: on an FSDP pod each device pays 1/N of the optimizer update over the
whole state (N = --pod_devices), so the step less (1 - 1/N) of the update timed alone
(device_check.update_seconds for ours, OLMo-core's optim.step() for theirs) is the
step a pod device would take: the TPU results' convention (docs/results/tpu_v5e.md).

Shapes: B batch, T time.
"""

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

SIDES = ('ours', 'olmo_core')
# OLMo-core's attention backends, fastest first on the hardware each supports.
OLMO_CORE_BACKENDS = ('flash_3', 'flash_4', 'flash_2', 'te', 'torch')


def slice_cfg(args):
  """The 7B's shapes cut to --layers (device_check.slice_config), one sequence."""
  import device_check  # pylint: disable=import-outside-toplevel
  ns = argparse.Namespace(layers=args.layers, sequences=args.batch, tiny=args.tiny,
                          hd256=False, remat=args.remat, vocab=0)
  return device_check.slice_config(ns)


def flop_counts(cfg) -> dict[str, float]:
  """FLOPs per token under the two conventions, from model.py's own counting."""
  import model  # pylint: disable=import-outside-toplevel
  m, T = cfg.model, cfg.data.seq_len
  stated = model.flops_per_token(m, T)
  hk = m.num_heads * m.head_dim
  attention = sum(12 * hk * model.attended_pairs(T, model.layer_window(m, i)) // T
                  for i in range(m.num_layers))
  return {'stated': float(stated), 'full S^2': float(stated - attention
                                                     + 12 * hk * T * m.num_layers)}


def digest(*arrays: np.ndarray) -> str:
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
  return h.hexdigest()[:16]


# --- The two sides, each in its own process ----------------------------------------------


def run_ours(args, tokens_BT1: np.ndarray) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import device_check  # pylint: disable=import-outside-toplevel
  import kernels  # pylint: disable=import-outside-toplevel
  from monitor import metrics  # pylint: disable=import-outside-toplevel
  cfg = slice_cfg(args)
  step, state, batch = device_check.step_setup(cfg, tokens_BT1=tokens_BT1)
  inputs, labels = tokens_BT1[:, :-1], tokens_BT1[:, 1:]
  start = time.perf_counter()
  state, out = step(state, batch)
  loss = float(out['train/CE loss'])
  first = time.perf_counter() - start
  times = []
  for i in range(args.warmup + args.steps):
    start = time.perf_counter()
    state, out = step(state, batch)
    jax.block_until_ready(out)
    if i >= args.warmup:
      times.append(time.perf_counter() - start)
  del state
  update = device_check.update_seconds(cfg, args.steps)
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  known = metrics.device_peak(device.device_kind)
  peak = known[0] if known else (metrics.measured_matmul_flops()
                                 if device.platform == 'cpu' else None)
  return {'device': device.device_kind, 'platform': device.platform,
          'attention': ' '.join(kernels.resolve(cfg.model, segments=False)),
          'remat': cfg.model.remat, 'dtype': cfg.model.dtype,
          'first step (s)': first, 'step (s)': float(np.median(times)),
          'optimizer update (s)': update, 'loss': loss,
          'peak memory (GB)': stats.get('peak_bytes_in_use', 0) / 1e9 or None,
          'peak FLOP/s': peak, 'tokens sha256': digest(inputs, labels)}


def olmo_core_backend(device_type: str) -> str:
  """The first of OLMO_CORE_BACKENDS that OLMo-core says runs here (imports and all)."""
  from olmo_core.nn.attention import AttentionBackendName  # pylint: disable=import-outside-toplevel
  for name in OLMO_CORE_BACKENDS if device_type == 'cuda' else ('torch',):
    try:
      AttentionBackendName(name).assert_supported()
      return name
    except (RuntimeError, ImportError, ValueError):
      continue
  return 'torch'


def olmo_core_model(cfg, backend: str, device):
  """OLMo-core's Olmo 3 7B config with our slice's shapes (scripts/reproduce_olmo_core.py's
  mapping: OLMo-core window W -> ours W, plus one where the config says so)."""
  from olmo_core.nn.attention import SlidingWindowAttentionConfig  # pylint: disable=import-outside-toplevel
  from olmo_core.nn.transformer import TransformerConfig  # pylint: disable=import-outside-toplevel
  m = cfg.model
  oc = TransformerConfig.olmo3_7B(vocab_size=m.vocab_size)
  oc.d_model, oc.n_layers, oc.init_seed = m.d_model, m.num_layers, 0
  oc.block.sequence_mixer.n_heads = m.num_heads
  oc.block.sequence_mixer.n_kv_heads = m.num_kv_heads
  oc.block.sequence_mixer.backend = backend
  window = m.sliding_window + int(m.sliding_window_plus_one)
  oc.block.sequence_mixer.sliding_window = SlidingWindowAttentionConfig(
      pattern=[window if c == 'S' else -1 for c in m.layer_pattern],
      force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False)
  oc.block.feed_forward.hidden_size = m.mlp_hidden
  model = oc.build(init_device=device.type)
  model.init_weights(max_seq_len=cfg.data.seq_len, device=device)
  return model


def run_olmo_core(args, tokens_BT1: np.ndarray) -> dict:
  import contextlib  # pylint: disable=import-outside-toplevel
  import olmo_core_stubs  # pylint: disable=import-outside-toplevel
  olmo_core_stubs.install()  # the H200 image has no cached_path (bench/gpu_wheels.sh)
  import torch  # pylint: disable=import-outside-toplevel
  from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig  # pylint: disable=import-outside-toplevel
  cfg = slice_cfg(args)
  o = cfg.opt
  device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  backend = olmo_core_backend(device.type)
  model = olmo_core_model(cfg, backend, device).train()
  compiled = device.type == 'cuda' and not args.no_compile
  if compiled:
    model.apply_compile()
  optim = SkipStepAdamWConfig(
      lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay,
      rolling_interval_length=o.skip_window, sigma_factor=int(o.skip_sigma),
      group_overrides=[OptimGroupOverride(params=['embeddings.weight'],
                                          opts=dict(weight_decay=0.0))]).build(model)
  params = list(model.parameters())
  inputs = torch.from_numpy(tokens_BT1[:, :-1].astype(np.int64)).to(device)
  labels = torch.from_numpy(tokens_BT1[:, 1:].astype(np.int64)).to(device)
  # Ours computes in cfg.model.dtype over float32 weights; autocast is PyTorch's same.
  bf16 = cfg.model.dtype == 'bfloat16'
  autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if bf16 else (
      contextlib.nullcontext)
  sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)

  def step() -> tuple[float, float]:
    with autocast():
      out = model(inputs, labels=labels, loss_reduction='sum', z_loss_multiplier=o.z_loss,
                  loss_div_factor=labels.numel(), return_logits=False)
    out.loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    torch.nn.utils.clip_grads_with_norm_(params, o.clip_grad_norm, norm)
    optim.latest_loss, optim.latest_grad_norm = out.ce_loss.detach(), norm
    sync()
    start = time.perf_counter()
    optim.step()
    optim.zero_grad(set_to_none=True)
    sync()
    return float(out.ce_loss.detach()), time.perf_counter() - start

  start = time.perf_counter()
  loss, _ = step()
  first = time.perf_counter() - start
  times, updates = [], []
  for i in range(args.warmup + args.steps):
    start = time.perf_counter()
    _, update = step()
    if i >= args.warmup:
      times.append(time.perf_counter() - start)
      updates.append(update)
  peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == 'cuda' else None
  return {'device': torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu',
          'attention': f'OLMo-core backend {backend!r}', 'torch.compile': compiled,
          'torch': torch.__version__, 'dtype': 'bf16 autocast' if bf16 else 'float32',
          'first step (s)': first, 'step (s)': float(np.median(times)),
          'optimizer update (s)': float(np.median(updates)), 'loss': loss,
          'peak memory (GB)': peak,
          'tokens sha256': digest(tokens_BT1[:, :-1], tokens_BT1[:, 1:])}


# --- The comparison -----------------------------------------------------------------------


def summarize(cfg, sides: dict, pod_devices: int) -> dict:
  """Per side tokens/s, both MFUs, pod-equivalent; ours / OLMo-core's ratios."""
  import device_check  # pylint: disable=import-outside-toplevel
  flops = flop_counts(cfg)
  tokens = cfg.data.global_batch_size * cfg.data.seq_len
  peak = sides.get('ours', {}).get('peak FLOP/s')
  rows = {}
  for name, s in sides.items():
    if 'step (s)' not in s:
      rows[name] = s
      continue
    pod_step = device_check.pod_step_seconds(s['step (s)'], s['optimizer update (s)'],
                                             pod_devices)
    row = dict(s)
    row['tokens/s'] = tokens / s['step (s)']
    row['pod-equivalent tokens/s'] = tokens / pod_step if pod_step else None
    for label, per_token in (('MFU', flops['stated']), ('MFU (full S^2)', flops['full S^2'])):
      row[label] = row['tokens/s'] * per_token / peak if peak else None
    row['pod-equivalent MFU'] = (row['pod-equivalent tokens/s'] * flops['stated'] / peak
                                 if peak and pod_step else None)
    rows[name] = row
  out = {'layers': cfg.model.num_layers, 'seq_len': cfg.data.seq_len, 'tokens/step': tokens,
         'vocab': cfg.model.vocab_size, 'FLOPs/token': flops, 'peak FLOP/s': peak,
         'pod devices': pod_devices, 'sides': rows}
  ours, theirs = rows.get('ours', {}), rows.get('olmo_core', {})
  if 'tokens/s' in ours and 'tokens/s' in theirs:
    out['ours / OLMo-core tokens/s'] = ours['tokens/s'] / theirs['tokens/s']
    pods = ours['pod-equivalent tokens/s'], theirs['pod-equivalent tokens/s']
    out['ours / OLMo-core pod-equivalent'] = pods[0] / pods[1] if all(pods) else None
    out['same tokens'] = ours['tokens sha256'] == theirs['tokens sha256']
  return out


def side_flags(args) -> list[str]:
  return ([f'--layers={args.layers}', f'--steps={args.steps}', f'--warmup={args.warmup}',
           f'--batch={args.batch}', f'--remat={args.remat}']
          + ['--tiny'] * args.tiny + ['--no_compile'] * args.no_compile)


def run_side(side: str, args, tokens_path: str, timeout: float) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), f'--side={side}', f'--tokens={tokens_path}',
         *side_flags(args)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  if proc.returncode:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {'error': ' | '.join(tail)[-600:] or f'exit {proc.returncode}'}
  return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(args) -> dict:
  cfg = slice_cfg(args)
  rng = np.random.default_rng(args.seed)
  tokens = rng.integers(2, cfg.data.vocab_size, (cfg.data.global_batch_size,
                                                  cfg.data.seq_len + 1), dtype=np.int32)
  deadline = time.monotonic() + args.budget_s
  sides = {}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'tokens.npy')
    np.save(path, tokens)
    for side in SIDES:
      left = deadline - time.monotonic()
      sides[side] = (run_side(side, args, path, left) if left > 10 else
                     {'skipped': 'out of time budget'})
      print(f'{side}: {json.dumps(sides[side])}', flush=True)
  result = summarize(cfg, sides, args.pod_devices)
  result['expected first loss'] = math.log(cfg.model.vocab_size)
  return result


def report(r: dict) -> None:
  print(f"{r['layers']} layers x {r['seq_len']} tokens, vocab {r['vocab']}: "
        f"{r['FLOPs/token']['stated'] / 1e9:.2f} GFLOP/token (causal halved, windows as "
        f"seen; full S^2: {r['FLOPs/token']['full S^2'] / 1e9:.2f})", flush=True)
  for name, s in r['sides'].items():
    if 'tokens/s' not in s:
      print(f'{name:10s} {s}', flush=True)
      continue
    mfu = lambda k: 'n/a (peak unknown)' if s[k] is None else f'{s[k]:.3f}'
    mem = 'n/a' if s['peak memory (GB)'] is None else f"{s['peak memory (GB)']:.1f} GB"
    pod = ('n/a (update alone >= step: timing noise)' if s['pod-equivalent tokens/s'] is None
           else f"{s['pod-equivalent tokens/s']:,.0f} tok/s MFU {mfu('pod-equivalent MFU')}")
    print(f"{name:10s} {s['tokens/s']:9,.0f} tok/s  MFU {mfu('MFU')} (full S^2 "
          f"{mfu('MFU (full S^2)')})  pod-equivalent {pod}  peak {mem}  loss {s['loss']:.3f}  "
          f"[{s['attention']}]", flush=True)
  if 'ours / OLMo-core tokens/s' in r:
    pod = r['ours / OLMo-core pod-equivalent']
    print(f"ours / OLMo-core: {r['ours / OLMo-core tokens/s']:.2f}x tokens/s, "
          f"{'n/a' if pod is None else f'{pod:.2f}x'} pod-equivalent; same tokens: "
          f"{r['same tokens']}", flush=True)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--layers', type=int, default=8,
                 help='layers of the 7B on both sides (8: two SSSF periods)')
  p.add_argument('--batch', type=int, default=1, help='sequences per step')
  p.add_argument('--steps', type=int, default=5, help='timed steps (the median is reported)')
  p.add_argument('--warmup', type=int, default=2, help='untimed steps after the first')
  p.add_argument('--remat', default='none', help="our side's remat policy")
  p.add_argument('--pod_devices', type=int, default=256)
  p.add_argument('--seed', type=int, default=0, help='the token array')
  p.add_argument('--tiny', action='store_true', help='CPU miniature (d 64, seq 128)')
  p.add_argument('--no_compile', action='store_true', help='OLMo-core without torch.compile')
  p.add_argument('--budget_s', type=float, default=480.0, help='both sides within this')
  p.add_argument('--out', default='')
  p.add_argument('--side', choices=SIDES, help=argparse.SUPPRESS)
  p.add_argument('--tokens', default='', help=argparse.SUPPRESS)
  return p


def main() -> None:
  p = parser()
  args = p.parse_args()
  if args.layers < 1 or args.steps < 1 or args.batch < 1 or args.warmup < 0:
    p.error('--layers, --steps and --batch must be at least 1, --warmup at least 0')
  if args.side:
    if args.side == 'ours':  # as train.py starts: its XLA flags before the backend does
      from kernels import gpu_flags, xla  # pylint: disable=import-outside-toplevel
      xla.set_cpu_flags()
      gpu_flags.apply()
    tokens = np.load(args.tokens)
    run = run_ours if args.side == 'ours' else run_olmo_core
    print(json.dumps(run(args, tokens)), flush=True)
    return
  result = compare(args)
  report(result)
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result), flush=True)


if __name__ == '__main__':
  main()
