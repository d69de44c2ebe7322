"""What a run reports: metrics.jsonl and TensorBoard, the progress line, MFU.

Metric names are Ai2's W&B names ('train/CE loss', 'optim/LR',
'throughput/device/TPS', ...), so a run's curves line up with OLMo-core's.
MFU is model FLOPs per token (model.flops_per_token, OLMo-core's definition)
times tokens per second over the device's dense bf16 peak: the vendor's
figure from PEAK_FLOPS / GPU_PEAK_FLOPS (device_peak), or on CPU a matmul measured at start-up.
"""

import json
import os
import re
import subprocess
import time
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import model
from monitor import events
from store import storage

# Keys whose values are wall-clock measurements: two runs of the same steps differ in
# them, and in nothing else (docs/monitoring.md, "Wall-clock keys"), so a comparison of
# two runs' records skips them.
WALL_CLOCK_PREFIXES = ('time/', 'goodput/')  # monitor/goodput.py's account: seconds and shares
WALL_CLOCK_KEYS = ('throughput/device/TPS', 'throughput/device/MFU')


def wall_clock(key: str) -> bool:
  """Whether a record's `key` is a wall-clock measurement ('... (s)' ones included)."""
  return key.startswith(WALL_CLOCK_PREFIXES) or key in WALL_CLOCK_KEYS or key.endswith('(s)')


# --- Peak FLOP/s and MFU ----------------------------------------------------------------

# Dense bf16 peak FLOP/s per TPU device as JAX names the device kind (Google's TPU
# spec pages). TPU7x counts one of the two devices per chip.
PEAK_FLOPS = {
    'TPU v4': 275e12, 'TPU v5 lite': 197e12, 'TPU v5e': 197e12, 'TPU v5p': 459e12,
    'TPU v5': 459e12, 'TPU v6 lite': 918e12, 'TPU v6e': 918e12, 'TPU7x': 2307e12 / 2,
}

# NVIDIA GPUs: JAX's device_kind is CUDA's device name ('NVIDIA H100 80GB HBM3', 'NVIDIA
# H100 PCIe', 'NVIDIA H200 NVL', 'NVIDIA GH200 480GB', ...), which names the form factor
# in words that vary by SKU, so families are matched by pattern, most specific first.
# Dense bf16 Tensor Core peaks: NVIDIA's datasheets print them with 2:4 sparsity, so each
# is half the printed figure. H100 SXM 1,979 -> 989 TFLOP/s, PCIe 1,513 -> 756, NVL 1,671
# -> 835 (H100 datasheet); H200 SXM 1,979 -> 989, H200 NVL 1,671 -> 835 (H200 datasheet);
# GH200 1,979 -> 989 (GH200 datasheet); B200 4.5 PF -> 2,250 (HGX B200 / DGX B200 spec:
# 72 PF FP8 sparse for 8 GPUs); GB200 5 PF -> 2,500 (GB200 NVL72 datasheet, per GPU);
# A100 SXM and PCIe, 40 and 80 GB: 312 (A100 datasheet, dense). Anything else (an
# 'NVIDIA H100' naming no form factor, an H800, an L40S...) has no peak here: MFU is
# then not reported rather than guessed (set train.peak_flops).
GPU_PEAK_FLOPS = (
    (r'GH200', 989e12, 'GH200'),
    (r'GB200', 2500e12, 'GB200'),
    (r'\bB200\b', 2250e12, 'B200'),
    (r'H200.*\bNVL\b', 835e12, 'H200 NVL'),
    (r'H200', 989e12, 'H200 SXM'),
    (r'H100.*\bNVL\b', 835e12, 'H100 NVL'),
    (r'H100.*\bPCIE\b', 756e12, 'H100 PCIe'),
    (r'H100.*(\bSXM|HBM3)', 989e12, 'H100 SXM'),
    (r'A100', 312e12, 'A100'),
)


def device_peak(kind: str) -> tuple[float, str] | None:
  """(dense bf16 peak FLOP/s, family) for a device_kind string; None where unknown."""
  if kind in PEAK_FLOPS:
    return PEAK_FLOPS[kind], kind
  upper = kind.upper()
  for pattern, peak, family in GPU_PEAK_FLOPS:
    if re.search(pattern, upper):
      return peak, family
  return None


def peak_flops(cfg_train: ml_collections.ConfigDict) -> float | None:
  """Per-device peak for MFU: the config override, the tables, or a CPU matmul measurement."""
  if cfg_train.peak_flops:
    return float(cfg_train.peak_flops)
  kind = jax.devices()[0].device_kind
  known = device_peak(kind)
  if known:
    return known[0]
  if jax.devices()[0].platform == 'cpu':
    return measured_matmul_flops()
  logging.warning('The peak FLOP/s of %r is unknown: MFU is not reported. Set '
                  'train.peak_flops to its dense bf16 peak.', kind)
  return None


def measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
  """Best float32 matmul FLOP/s of one device; the CPU's practical peak.

  On simulated multi-device CPUs all devices share the same cores, so this is
  divided among them by the caller's per-device accounting only if they run
  concurrently; we report against one device's measured rate.
  """
  x = jax.device_put(jnp.ones((n, n), jnp.float32), jax.devices()[0])
  f = jax.jit(lambda a: a @ a)
  f(x).block_until_ready()
  best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(repeats))
  return 2 * n ** 3 / best


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


# --- The metric log ---------------------------------------------------------------------


class MetricWriter:
  """metrics.jsonl and TensorBoard event files under Ai2's W&B names, process 0 only.

  Starting at step `start` (0 too) drops what a run killed after its last
  checkpoint (or before its first) logged past it: JSONL records with step >
  start (and a line cut by the kill) are removed, TensorBoard is told to purge
  them (a SessionLog START at start + 1), and W&B, which loses what its
  service had buffered when a process is killed, gets the records up to
  `start` again (tracking.Tracker.resume), so all three hold one history.

  In a gs:// or s3:// workdir, which cannot append, metrics.jsonl is a folder
  `metrics.jsonl.d/` of segments, one object per flush named by its first step
  and time (read_records puts them back together), and TensorBoard gets one event file
  per flush. flush() runs every `flush_seconds`, and train.py calls it before
  each checkpoint save, so a SIGKILL loses only records past the last
  checkpoint, which a resume drops anyway; nothing is ever written twice.
  """

  def __init__(self, workdir: str, start: int = 0, flush_seconds: float = 60.0,
               tracker: Any = None):
    self.enabled = jax.process_index() == 0
    self.tracker = tracker  # tracking.Tracker: each record goes to W&B too (a no-op when off)
    if not self.enabled:
      return
    self.remote = not storage.appends(workdir)  # a bucket: one segment object per flush
    self.path = storage.join(workdir, METRICS)
    self.flush_seconds, self.last_flush = flush_seconds, time.monotonic()
    self.pending: list[str] = []
    if self.remote:
      _truncate_segments(self.path + SEGMENTS, start)
    else:
      _truncate_file(self.path, start)
      self.jsonl = open(self.path, 'a')
    if self.tracker is not None:  # W&B may have lost records up to `start`: they go again
      self.tracker.resume(start)
    # Tags are written as they are ('train/CE loss'); TensorBoard accepts any tag.
    self.tb = events.Writer(storage.join(workdir, 'tensorboard'))
    # At every start, 0 included: a run killed before its first checkpoint logged steps
    # that this one logs again.
    self.tb.start_session(start + 1)

  def write(self, step: int, metrics: dict[str, float | str]) -> None:
    """One record; numbers become TensorBoard scalars, strings its text summaries."""
    if not self.enabled:
      return
    line = json.dumps({'step': step, **metrics}) + '\n'
    if self.remote:
      self.pending.append(line)
    else:
      self.jsonl.write(line)
      self.jsonl.flush()
    self.tb.summary(step, [events.text_value(name, value) if isinstance(value, str)
                           else events.scalar_value(name, value)
                           for name, value in metrics.items()])
    if self.tracker is not None:
      self.tracker.log(step, metrics)  # queued; returns at once
    if self.remote and time.monotonic() - self.last_flush > self.flush_seconds:
      self.flush()

  def flush(self) -> None:
    """Makes every record written so far durable (a no-op locally, where each line is)."""
    if not self.enabled or not self.remote:
      return
    if self.pending:
      first = json.loads(self.pending[0])['step']
      name = f'{first:012d}.{time.time_ns():020d}.jsonl'  # sorts by step, then write time
      storage.write(storage.join(self.path + SEGMENTS, name),
                    ''.join(self.pending).encode())
      self.pending = []
    self.tb.flush()
    self.last_flush = time.monotonic()

  def close(self) -> None:
    if self.enabled:
      self.flush()
      if not self.remote:
        self.jsonl.close()
      self.tb.close()


METRICS = 'metrics.jsonl'
SEGMENTS = '.d'  # <workdir>/metrics.jsonl.d/<first step>.<time>.jsonl in a bucket


def _records_to(lines: list[str], start: int) -> list[str]:
  kept = []
  for line in lines:
    try:
      if json.loads(line)['step'] <= start:
        kept.append(line.rstrip('\n') + '\n')
    except (json.JSONDecodeError, KeyError, TypeError):
      continue  # a record cut short by a hard kill
  return kept


def _truncate_file(path: str, start: int) -> None:
  if os.path.exists(path):
    with open(path) as f:
      kept = _records_to(f.readlines(), start)
    with open(path + '.tmp', 'w') as f:
      f.writelines(kept)
    os.replace(path + '.tmp', path)


def _truncate_segments(folder: str, start: int) -> None:
  """Drops records past `start`: whole segments after it, and the tail of the one across
  it (rewritten in place under the same name, so a kill never leaves a duplicate)."""
  for name in storage.listdir(folder):
    path = storage.join(folder, name)
    first = int(name.split('.')[0])
    if first > start:
      storage.delete(path)
      continue
    lines = (storage.read_text(path) or '').splitlines(keepends=True)
    kept = _records_to(lines, start)
    if kept != lines:
      storage.write(path, ''.join(kept).encode())


def read_records(location: str) -> list[dict[str, Any]]:
  """Every record of a run's metrics.jsonl (a workdir, the file, or a bucket's segments)."""
  if not location.rstrip('/').endswith(METRICS):
    location = storage.join(location, METRICS)
  folder = location + SEGMENTS  # a bucket run's segments (a filesystem run has none)
  segments = storage.listdir(folder)
  if segments:
    text = ''.join(storage.read_text(storage.join(folder, n)) or '' for n in segments)
  else:
    text = storage.read_text(location)
    if text is None:
      raise FileNotFoundError(f'{location} does not exist.')
  records = []
  for line in text.splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue  # a record cut short by a hard kill
  return records


# --- The progress line ------------------------------------------------------------------


class Progress:
  """Each step's metrics: to the divergence guard, metrics.jsonl + TensorBoard, the console.

  Metrics stay on device until flush() (log and save steps), so the loop
  never waits on the host in between; flush() hands every step to the guard,
  in order, before anything else sees it.
  """

  def __init__(self, cfg: ml_collections.ConfigDict, writer: MetricWriter,
               guard: Any, devices: int, start: int):
    self.writer, self.guard, self.devices, self.steps = writer, guard, devices, cfg.train.steps
    self.tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    self.flops_per_token = model.flops_per_token(cfg.model, cfg.data.seq_len)
    self.peak = peak_flops(cfg.train)
    self.pending: list[tuple[int, dict[str, jax.Array]]] = []
    self.window_start, self.window_step, self.data_wait = time.perf_counter(), start, 0.0

  def add(self, step: int, metrics: dict[str, jax.Array], data_wait: float) -> None:
    self.pending.append((step, metrics))
    self.data_wait += data_wait

  def flush(self, log: bool) -> dict[str, float]:
    """Judges and writes the pending steps; with `log`, prints the last with its speed."""
    records = [(s, self._record(s, m)) for s, m in jax.device_get(self.pending)]
    self.pending = []
    for step, record in records:
      self.guard.observe(step, record)
    step, last = records[-1]
    if log:
      last.update(self._throughput(step))
      last.update(device_memory())
      print(f"step {step:>7d}/{self.steps}  loss {last['train/CE loss']:.4f}  "
            f"lr {last['optim/LR']:.3g}  gnorm {last['optim/total grad norm']:.3f}  "
            f"{last['throughput/device/TPS']:,.0f} tok/s/dev  {last['time/step'] * 1e3:.0f} "
            f"ms/step  eta {_duration((self.steps - step) * last['time/step'])}"
            + ('  [skipped]' if last['optim/step skipped'] else ''), flush=True)
    for s, record in records:
      self.writer.write(s, record)
    return last

  def _record(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
    record = {k: float(v) for k, v in metrics.items()}
    record['train/PPL'] = float(np.exp(min(record['train/CE loss'], 80.0)))
    record['throughput/total tokens'] = step * self.tokens_per_step
    return record

  def _throughput(self, step: int) -> dict[str, float]:
    """Per-device speed over the steps since the last log line; starts the next window."""
    n, seconds = step - self.window_step, time.perf_counter() - self.window_start
    tps = n * self.tokens_per_step / seconds / self.devices
    out = {'throughput/device/TPS': tps, 'time/step': seconds / n,
           'time/data wait': self.data_wait / n}
    if self.peak:
      out['throughput/device/MFU'] = tps * self.flops_per_token / self.peak
    self.window_start, self.window_step, self.data_wait = time.perf_counter(), step, 0.0
    return out


def device_memory() -> dict[str, float]:
  """This process's device memory at a log step (the largest over its devices), in GiB.

  `in use`: what the allocator holds now; `peak`: the most it held since the
  process started (JAX has no reset, unlike OLMo-core's GPUMemoryMonitorCallback,
  whose 'gpu_memory/GPU active mem (GiB)' is the peak since the last step).
  {} where the platform reports nothing (CPU).
  """
  stats = [s for s in (d.memory_stats() for d in jax.local_devices()) if s]
  if not stats:
    return {}
  largest = lambda key: max(s.get(key, 0) for s in stats)
  peak, limit = largest('peak_bytes_in_use'), min(s.get('bytes_limit', 0) for s in stats)
  out = {'system/device memory in use (GiB)': largest('bytes_in_use') / 2**30,
         'system/device memory peak (GiB)': peak / 2**30}
  if limit:
    out['system/device memory peak (%)'] = 100 * peak / limit
  return out


def _duration(seconds: float) -> str:
  """'1h02m', '3m05s' or '42s': the ETA of the steps left at the last window's speed."""
  s = int(round(seconds))
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  return f'{s // 60}m{s % 60:02d}s' if s >= 60 else f'{s}s'


def checkpoint_meta(cfg: ml_collections.ConfigDict, step: int, loader: Any, version: str,
                    recovery: Any = None) -> dict[str, Any]:
  """What train.py records in a checkpoint besides the state: the config, the data position
  (data.Loader.state, with its skipped windows), the code, and the rollbacks so far
  (rollback.Recovery.meta)."""
  return {'step': step, 'config': cfg.to_dict(), 'data': loader.state(),
          'code_version': version, 'rng_seed': cfg.train.seed,
          **(recovery.meta() if recovery else {})}


def code_version() -> str:
  try:
    return subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), check=True
                          ).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return 'unknown'
