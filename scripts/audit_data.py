"""Audits a config's data: no instance repeats in the planned run, and repeated content.

  python scripts/audit_data.py --config=configs/olmo3_7b.py --config.data.mix_file=MIX \
      [--devices=512] [--steps=N] [--resume_every=1000] [--all_epochs] [--content] [--ngrams]
      [--workdir=W]   # W's rollbacks.jsonl: the global batches its rollbacks skip
  python scripts/audit_data.py --config=configs/olmo3_7b.py --num_instances=723872768  # order only

1. Order (always). The planned steps are driven through data.Loader itself
   (its position bookkeeping, epoch rollover and resume checks; only the token
   read is skipped), restarted from its saved state at every resume point.
   Each step's ids are split as the run splits them (W data-parallel ranks,
   A micro-batches each: batches.batch_positions, batches.grad_accum_steps) and
   marked in a bitmap of N bits per epoch (health.mark_seen, shared with the
   in-loop `data/repeated instances` metric). For every epoch driven, it proves
   each instance id is read at most once, and exactly once in a complete epoch
   except the tail OLMo-core drops (N mod B). With --num_instances (or a mix
   whose files are absent but list their sizes) it needs no token files: the
   order depends only on N, the seed and the epoch. The global batches the run
   skips (train.skip_batches, and with --workdir the windows its rollbacks
   logged) are passed over as the run passes them, so its steps reach the next
   epoch as much sooner as the run's do.

   A run of at most 4 epochs is driven step by step, every epoch. A longer one
   reads the same N instances again each epoch, and driving all of them is
   slow for nothing new (1.4M steps of a 1,200-instance mix: 514 s); it is
   driven through a few epochs only (audited_epochs: the first two, the last
   two, the epochs around the first resume at an epoch end and the first
   resume inside one, the middle one), each stretch started where a resume at
   its first step must start, and its end position checked against the step
   count. What is NOT read is vouched for by construction, and the report says
   so: each epoch's order is a PCG64(seed + epoch) shuffle of the same arange(N)
   (data.permutation), cut into batches by the same Loader code the audited
   epochs ran, and train.py refuses a resume that does not land where its step
   count leads (data.check_position). --all_epochs drives every epoch.

   The report gives epochs as counts and the repetition factor (ids read /
   distinct ids; past one epoch the distinct ids are taken as all N, so the
   factor is a lower bound), and warns, on stderr and before the audit runs,
   when the run reads its data more than 4 times: it names the steps, the data
   size, and the step count or data that would stop it.
2. Content (--content): 128-bit hashes of every instance (T tokens) and of
   every document (tokens up to and including each EOS), spilled to --tmp_dir
   in hash buckets so memory stays under --memory_mb; reports identical
   instances and documents repeated across mix entries (a file listed twice is
   two entries) or within one.
3. N-grams (--ngrams): per instance, OLMo-core's InstanceFilterConfig
   statistic (the longest run of a period-p pattern, p in [1, 13], in repeats)
   as a histogram, and how many instances its filter (max_count 32) rejects.

Exit code 1 when an instance id repeats, identical instances exist, or the
loader's position disagrees with the step count; the report (also --json)
says where. A mistake (a missing file, a config that
cannot run) is one `error:` line with errors.py's code (EXIT_DATA, EXIT_USAGE).

Over 600 lines because it is two audits sharing one command line (the order
through data.Loader, the content through on-disk hash buckets); neither is
imported by the trainer.
"""

import collections
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config_checks  # noqa: E402
import data  # noqa: E402
import errors  # noqa: E402
from kernels import xla  # noqa: E402
from monitor import health  # noqa: E402
from monitor import rollback  # noqa: E402
from store import storage  # noqa: E402
from tokens import batches  # noqa: E402  (the repository root must be on the path first)
from tokens import token_files  # noqa: E402

FLAGS = flags.FLAGS  # defined by define_flags() when run as a script
_CHUNK_STEPS = 1024  # steps whose ids are marked in one vectorized call
_CHUNK_TOKENS = 1 << 22  # tokens hashed per vectorized call
_MAX_EXAMPLES = 10  # offending ids/files listed per finding
_MAX_BUCKETS = 256  # hash buckets on disk per kind (instances, documents)
_FULL_EPOCHS = 4  # runs of at most this many epochs are audited in full, step by step
_WARN_REPETITION = 4.0  # reading the data more often than this warns (memorisation)


# --- The order --------------------------------------------------------------------------------


class SizedDataset(data.Dataset):
  """A data.Dataset from file sizes alone (no file is opened): for auditing the order."""

  def __init__(self, sizes: list[int], *, seq_len: int, vocab_size: int, eos_token_id: int,
               pad_token_id: int, paths: list[str] | None = None,
               labels: list[str] | None = None):
    paths = paths or [f'file{i}' for i in range(len(sizes))]
    labels = labels or [''] * len(sizes)
    self.files = tuple(token_files.TokenFile(p, s, 0, s // 4, l)
                       for p, s, l in zip(paths, sizes, labels))
    self.seq_len, self.vocab_size = seq_len, vocab_size
    self.eos_token_id, self.pad_token_id, self.bos_token_id = eos_token_id, pad_token_id, None
    self.max_target_sequence_length = seq_len
    counts = np.array([f.num_tokens // seq_len for f in self.files], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(counts)])
    self.num_instances = int(self.starts[-1])
    if not self.num_instances:
      raise ValueError(f'the listed sizes give no instance of {seq_len} tokens.')

  def read(self, ids):
    raise RuntimeError('SizedDataset has sizes, not tokens: the content audit needs the files.')


class _IdLoader(data.Loader):
  """data.Loader yielding each step's instance ids (ids_at) instead of reading tokens."""

  def batch_at(self, epoch: int, step: int) -> np.ndarray:  # type: ignore[override]
    return self.ids_at(epoch, step)


def plan(num_instances: int, global_batch_size: int, steps: int,
         skips: data.Skips | None = None) -> dict[str, Any]:
  """How often `steps` global batches read the data: epochs and the repetition factor.

  The repetition factor is ids read / distinct ids read. Within one epoch the
  ids are distinct (steps x B of them); past one, the distinct ids are taken as
  all N (the dropped tail differs from epoch to epoch), an upper bound, so the
  factor is then a lower bound. `skips` (the run's skipped global batches:
  train.skip_batches and its rollbacks) push the steps on: the run reaches
  later epochs sooner.
  """
  B, N = global_batch_size, num_instances
  per_epoch = N // B
  if per_epoch == 0:
    raise ValueError(f'global_batch_size {B} exceeds the {N} instances in the dataset.')
  read = steps * B
  skips = skips or data.Skips()
  reach = skips.nth(steps - 1) + 1 if steps else 0  # global batches passed, skipped ones too
  return {'instances': N, 'global_batch': B, 'batches_per_epoch': per_epoch, 'steps': steps,
          'ids_read': read, 'epochs': -(-reach // per_epoch), 'complete_epochs': reach // per_epoch,
          'repetition': read / min(read, N), 'dropped_tail_per_epoch': N - per_epoch * B,
          'skipped_batches': skips.skipped_before(reach), 'skips': skips.windows}


def repetition_warning(p: dict[str, Any], seq_len: int, steps_name: str = 'cfg.train.steps',
                       limit: float = _WARN_REPETITION) -> str | None:
  """One line when the planned run reads its data more than `limit` times; else None."""
  if p['repetition'] <= limit:
    return None
  tokens = p['instances'] * seq_len
  most = int(limit * p['batches_per_epoch'])
  return (f"WARNING: the planned run reads its data {p['repetition']:,.0f} times over "
          f"({p['epochs']:,} epochs): {steps_name}={p['steps']:,} steps x {p['global_batch']} "
          f"instances = {p['ids_read']:,} instances read, but the data holds only "
          f"{p['instances']:,} instances of {seq_len:,} tokens ({_count(tokens)} tokens, "
          f"{p['batches_per_epoch']:,} batches per epoch); a model trained on data repeated this "
          f'often memorises it. Lower {steps_name} to at most {most:,} ({limit:g} epochs), or '
          f"train on more data (cfg.data.mix_file): one epoch of {p['steps']:,} steps is "
          f"{p['ids_read']:,} instances ({_count(p['ids_read'] * seq_len)} tokens).")


def _count(n: float) -> str:
  """1234567 -> '1.2M' (for token counts in one-line messages)."""
  for unit, size in (('T', 1e12), ('B', 1e9), ('M', 1e6), ('K', 1e3)):
    if n >= size:
      return f'{n / size:.1f}{unit}'
  return f'{n:,.0f}'


def audited_epochs(epochs: int, per_epoch: int, steps: int, resume_every: int) -> list[int]:
  """The epochs read in full when not all of them are: where the loader's paths differ.

  The first two and the last two (a start, a rollover, the run's end, possibly
  partial), the epochs around the first resume landing on an epoch end and the
  one holding the first resume inside an epoch (the two ways a restart meets
  an epoch), and the middle one.
  """
  chosen = {1, 2, epochs - 1, epochs, (epochs + 1) // 2}
  if resume_every:
    at_end = math.lcm(resume_every, per_epoch)
    if at_end < steps:
      chosen |= {at_end // per_epoch, at_end // per_epoch + 1}
    inside = next((k for k in range(resume_every, min(steps, resume_every * per_epoch + 1),
                                    resume_every) if k % per_epoch), None)
    if inside is not None:
      chosen.add(inside // per_epoch + 1)
  return sorted(e for e in chosen if 1 <= e <= epochs)


def audit_order(ds: data.Dataset, cfg_data: Any, *, steps: int, devices: int = 1,
                micro_batch_size: int | None = None, resume_every: int = 0,
                cache_dir: str | None = None, all_epochs: bool = False,
                progress: bool = False, skips: data.Skips | None = None) -> dict[str, Any]:
  """Drives the planned `steps` through data.Loader; every id once per epoch, or where not.

  With `skips` the loader passes over those global batches, as the run does: an
  epoch holding a window reads its other batches only.

  A run of at most _FULL_EPOCHS epochs (or any, with `all_epochs`) is driven
  step by step. A longer one, which reads the same N instances again each
  epoch, is driven through audited_epochs() only, each started where
  data.check_position requires a resume at its first step to be; the rest is
  vouched for by construction, not by reading (see the module docstring).
  """
  B, N = cfg_data.global_batch_size, ds.num_instances
  skips = skips or data.Skips()
  report = plan(N, B, steps, skips)
  per_epoch, epochs = report['batches_per_epoch'], report['epochs']
  positions = batches.batch_positions(B, devices)  # row -> global-batch position, rank-major
  mb = micro_batch_size or B // devices
  accum = batches.grad_accum_steps(B, devices, mb)
  full = all_epochs or epochs <= _FULL_EPOCHS
  audited = list(range(1, epochs + 1)) if full else audited_epochs(epochs, per_epoch, steps,
                                                                   resume_every)
  windows = []  # [first step, end step) of each run of consecutive audited epochs
  for e in audited:  # the steps that read epoch e's batches
    begin = skips.count_before((e - 1) * per_epoch)
    end = min(skips.count_before(e * per_epoch), steps)
    if windows and windows[-1][1] == begin:
      windows[-1][1] = end
    else:
      windows.append([begin, end])
  bitmap = np.zeros((N + 7) // 8, np.uint8)
  marked = collections.Counter()  # epoch -> ids marked
  repeats: list[dict[str, int]] = []  # examples: where repeated ids were read
  resumes = 0
  lost: list[str] = []  # where the loader's position disagreed with the step count
  chunk: list[tuple[int, int, np.ndarray]] = []  # (epoch, step index in run, ids in row order)
  to_drive = sum(end - begin for begin, end in windows)
  driven = 0
  start = time.time()

  def flush() -> None:
    for epoch in sorted({e for e, _, _ in chunk}):
      part = [(k, ids) for e, k, ids in chunk if e == epoch]
      ids = np.concatenate([ids for _, ids in part])
      if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= N):
        raise ValueError(f'epoch {epoch}: the loader produced ids outside [0, {N}).')
      if epoch != flush.epoch:
        bitmap[:] = 0
        flush.epoch = epoch
      again = health.mark_seen(bitmap, ids)
      marked[epoch] += ids.size
      flush.repeats += again.size
      if again.size and len(repeats) < _MAX_EXAMPLES:
        repeats.extend(_sightings(part, np.unique(again)[:_MAX_EXAMPLES], epoch, mb,
                                  B // devices))
    chunk.clear()
  flush.epoch, flush.repeats = None, 0

  def open_loader(k: int, state: dict[str, Any] | None = None) -> _IdLoader:
    if state is None:  # where a resume at step k must start (data.check_position)
      loader = _IdLoader(ds, seed=cfg_data.seed, global_batch_size=B,
                         epoch=1 + skips.nth(k) // per_epoch, step=skips.nth(k) % per_epoch,
                         cache_dir=cache_dir, skips=skips)
    else:  # as train.py resumes from a checkpoint, position checked against k
      loader = _IdLoader.from_config(cfg_data, ds, state=state, step=k, cache_dir=cache_dir,
                                     skips=skips)
    loader.positions = positions  # W ranks: row block r is rank r's instances, in its order
    loader.stop_at_epoch_end = True  # no read-ahead into an epoch the plan never reaches
    return loader

  for begin, end in windows:
    loader = open_loader(begin)
    try:
      for k in range(begin, end):
        if resume_every and k > begin and k % resume_every == 0:
          state = json.loads(json.dumps(loader.state()))
          loader.close()
          try:
            loader = open_loader(k, state)
          except ValueError as e:  # the rest of this stretch cannot be driven as the run would
            lost.append(f"resuming at step {k:,} from the loader's own saved state is refused: "
                        f'{e}')
            break
          resumes += 1
        try:
          ids = next(loader)
        except StopIteration:  # an epoch ended: the next call starts the next one, as the run does
          ids = next(loader)
        chunk.append((loader.last_position[0], k, np.asarray(ids)))
        driven += 1
        if len(chunk) == _CHUNK_STEPS:
          flush()
          if progress:
            rate = driven / max(time.time() - start, 1e-9)
            sys.stderr.write(f'\rorder: step {driven:,}/{to_drive:,}  {rate:,.0f} steps/s  '
                             f'ETA {(to_drive - driven) / rate:,.0f}s ')
      else:  # the stretch ran to its end: the next (unaudited) epoch starts where it should
        state = loader.state()
        try:
          data.check_position(state, ds, end, skips=skips)
        except ValueError:
          lost.append(f"after {end:,} steps the loader is at epoch {state['epoch']}, step "
                      f"{state['step']}, not where {end:,} batches of {B} lead ({per_epoch} per "
                      'epoch).')
      flush()
    finally:
      loader.close()
  if progress and to_drive >= _CHUNK_STEPS:
    sys.stderr.write('\n')
  def unskipped(e: int) -> int:  # the batches of epoch e the run reads
    return per_epoch - skips.skipped_before(e * per_epoch) + skips.skipped_before(
        (e - 1) * per_epoch)
  complete = sorted(e for e, n in marked.items() if n == unskipped(e) * B)
  report.update({
      'ranks': devices, 'micro_batches': accum, 'micro_batch_size': mb, 'all_epochs': full,
      'audited_epochs': audited, 'audited_steps': driven, 'ids_audited': int(sum(marked.values())),
      'complete_epochs_audited': complete, 'resumes': resumes,
      'resumes_planned': (steps - 1) // resume_every if resume_every else 0,
      'repeated_ids': int(flush.repeats), 'repeat_sightings': repeats[:3 * _MAX_EXAMPLES],
      'loader_errors': lost,
      'seconds': time.time() - start})
  return report


def order_summary(order: dict[str, Any]) -> list[str]:
  """The order report in a few lines: counts and a few example epochs, never a list of all."""
  audited = order['audited_epochs']
  shown = ', '.join(map(str, audited)) if len(audited) <= 6 else (
      ', '.join(map(str, audited[:3])) + ', ..., ' + ', '.join(map(str, audited[-2:])))
  complete = order['complete_epochs_audited']
  lines = [
      f"order: {order['steps']:,} steps x {order['global_batch']} instances "
      f"({order['ranks']} ranks x {order['micro_batches']} micro-batches of "
      f"{order['micro_batch_size']}) read {order['ids_read']:,} ids of {order['instances']:,} "
      f"instances: {order['epochs']:,} epochs of {order['batches_per_epoch']:,} batches "
      f"({order['complete_epochs']:,} complete), repetition {_times(order['repetition'])} (ids "
      f"read / distinct ids); each epoch drops the last {order['dropped_tail_per_epoch']:,} "
      'instances, as OLMo-core does.'
      + (f" The run skips global batches {data.Skips(order['skips'])} "
         '(train.skip_batches and the workdir\'s rollbacks.jsonl): '
         f"{order['skipped_batches']:,} batches never read, so its steps reach later epochs "
         'sooner.' if order.get('skips') else ''),
      f"audited {'every epoch' if order['all_epochs'] else f'{len(audited)} epochs'} "
      f"({shown}) step by step through data.Loader: {order['audited_steps']:,} steps, "
      f"resumes: {order['resumes']:,} of the {order['resumes_planned']:,} planned, "
      f"{order['ids_audited']:,} ids read, {order['repeated_ids']} repeated within an epoch; "
      + (f"{len(complete)} complete epochs read "
         f"{order['batches_per_epoch'] * order['global_batch']:,} ids each; " if complete else '')
      + f"{order['seconds']:.1f} s"]
  if not order['all_epochs']:
    lines.append(
        f"not read: the other {order['epochs'] - len(audited):,} epochs. Each is its own "
        f"PCG64(seed + epoch) shuffle of the same {order['instances']:,} ids (data.permutation), "
        'sliced into batches by the same Loader code the audited epochs ran, and a resume is '
        'refused unless it lands where its step count leads (data.check_position: checked here '
        'at every audited resume and after each audited stretch), so each epoch reads an id at '
        'most once by construction. --all_epochs reads them all.')
  return lines


def _times(factor: float) -> str:
  return f'{factor:.2f}x' if factor < 100 else f'{factor:,.0f}x'


def _sightings(part: list[tuple[int, np.ndarray]], wanted: np.ndarray, epoch: int, mb: int,
               per_rank: int) -> list[dict[str, int]]:
  """Every reading of the `wanted` ids in `part`: step, rank, micro-batch."""
  out = []
  for k, ids in part:
    for row in np.flatnonzero(np.isin(ids, wanted)):
      out.append({'id': int(ids[row]), 'epoch': epoch, 'step': k, 'rank': int(row // per_rank),
                  'micro_batch': int(row % per_rank // mb)})
  return out


# --- Content: identical instances and repeated documents ----------------------------------

# Fixed random odd weights per position: the same content always hashes alike, and two
# independent 64-bit hashes make a false match ~M^2 / 2^129 for M hashed items.
_WEIGHTS = np.random.default_rng(0x0157A0D17).integers(1, 2**63, (2, 1 << 16),
                                                      dtype=np.uint64) | np.uint64(1)
_RECORD = np.dtype([('h1', '<u8'), ('h2', '<u8'), ('ref', '<u8')])


def _mix(tokens: np.ndarray) -> np.ndarray:
  """A nonlinear per-token scramble, so the position-weighted sums are not plain linear."""
  y = (tokens.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
  return y ^ (y >> np.uint64(29))


def hash_spans(tokens: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Two 64-bit hashes of each span tokens[starts[i]:starts[i+1]] (the last runs to the end).

  Position-in-span weights make a span hash the same wherever the span lies.
  """
  span = np.repeat(np.arange(starts.size), np.diff(np.append(starts, tokens.size)))
  pos = (np.arange(tokens.size) - starts[span]) % _WEIGHTS.shape[1]
  y = _mix(tokens)
  lengths = np.diff(np.append(starts, tokens.size)).astype(np.uint64)
  return tuple(np.add.reduceat(y * _WEIGHTS[k][pos], starts)
               ^ (lengths * np.uint64(0xC2B2AE3D27D4EB4F + k)) for k in (0, 1))


class _Buckets:
  """(h1, h2, ref) records spilled to disk by the top bits of h1; grouped one bucket at a time."""

  def __init__(self, directory: str, count: int):
    self.bits = max(0, math.ceil(math.log2(max(count, 1))))
    self.paths = [os.path.join(directory, f'bucket{b:05d}') for b in range(1 << self.bits)]
    self.files = [open(p, 'wb') for p in self.paths]

  def add(self, h1: np.ndarray, h2: np.ndarray, ref: np.ndarray) -> None:
    rec = np.empty(h1.size, _RECORD)
    rec['h1'], rec['h2'], rec['ref'] = h1, h2, ref
    if not self.bits:
      rec.tofile(self.files[0])
      return
    bucket = (h1 >> np.uint64(64 - self.bits)).astype(np.int64)
    order = np.argsort(bucket, kind='stable')
    bounds = np.searchsorted(bucket[order], np.arange(len(self.files) + 1))
    for b, f in enumerate(self.files):
      if bounds[b + 1] > bounds[b]:
        rec[order[bounds[b]:bounds[b + 1]]].tofile(f)

  def groups(self):
    """Yields the refs of each set of >= 2 records with equal hashes."""
    for f in self.files:
      f.close()
    for path in self.paths:
      rec = np.fromfile(path, _RECORD)
      os.remove(path)
      if rec.size < 2:
        continue
      rec = rec[np.lexsort((rec['ref'], rec['h2'], rec['h1']))]
      same = (rec['h1'][1:] == rec['h1'][:-1]) & (rec['h2'][1:] == rec['h2'][:-1])
      if not same.any():
        continue
      edges = np.flatnonzero(np.diff(np.concatenate([[0], same.astype(np.int8), [0]])))
      for a, b in zip(edges[::2], edges[1::2]):
        yield rec['ref'][a:b + 1]


def audit_content(ds: data.Dataset, *, tmp_dir: str | None = None, memory_mb: int = 1024,
                  min_doc_tokens: int = 32, ngrams: bool = False,
                  rf: batches.RepetitionFilter = batches.RepetitionFilter(),
                  validation: data.Dataset | None = None) -> dict[str, Any]:
  """Identical instances, repeated documents and (with `ngrams`) repetition statistics; with
  `validation` (the held-out set), held-out documents with exact copies in training."""
  T, eos = ds.seq_len, ds.eos_token_id
  held = validation.files if validation else ()
  total_tokens = sum(f.num_tokens for f in (*ds.files, *held))
  buckets = max(1, math.ceil((ds.num_instances + total_tokens // 64) * _RECORD.itemsize * 3
                             / (memory_mb * 2**20)))  # sorting a bucket takes ~3x its size
  if buckets > _MAX_BUCKETS:  # two open files per bucket: stay well inside ulimit -n 1024
    print(f'note: --memory_mb={memory_mb} would need {buckets} hash buckets; using '
          f'{_MAX_BUCKETS}, so sorting one takes ~{buckets // _MAX_BUCKETS}x the budget.',
          file=sys.stderr)
    buckets = _MAX_BUCKETS
  times_hist = collections.Counter()
  rejected = 0
  docs = 0
  with tempfile.TemporaryDirectory(dir=tmp_dir) as work:
    for sub in ('i', 'd'):
      os.makedirs(os.path.join(work, sub))
    inst = _Buckets(os.path.join(work, 'i'), buckets)
    doc = _Buckets(os.path.join(work, 'd'), buckets)
    rows = max(1, _CHUNK_TOKENS // T)
    for f in range(len(ds.files)):
      tokens = ds.maps.sequential(f)  # a memory map, or a remote file read in chunks
      n = int(ds.starts[f + 1] - ds.starts[f])
      for r in range(0, n, rows):
        chunk_nT = np.asarray(tokens[r * T:min(n, r + rows) * T]).reshape(-1, T)
        h1, h2 = hash_spans(chunk_nT.reshape(-1), np.arange(0, chunk_nT.size, T))
        inst.add(h1, h2, np.arange(r, r + chunk_nT.shape[0], dtype=np.uint64) + ds.starts[f])
        if ngrams:
          times = max_repeat_times(chunk_nT, rf)
          rejected += int(np.count_nonzero(times >= max(rf.max_count, 3)))
          times_hist.update(np.minimum(times, 64).tolist())
      docs += _hash_documents(tokens, eos, f, min_doc_tokens, doc)
    n = len(ds.files)  # held-out documents are entries n, n + 1, ...: split from the rest below
    val_docs = sum(_hash_documents(validation.maps.sequential(j), eos, n + j, min_doc_tokens, doc)
                   for j in range(len(held)))
    instance_groups = [g.astype(np.int64) for g in inst.groups()]
    split = [(g[g >> np.uint64(40) < n], g[g >> np.uint64(40) >= n]) for g in doc.groups()]
    crossed = [(train, val) for train, val in split if train.size and val.size]
    doc_groups = [train for train, _ in split if train.size > 1]
  files = (*ds.files, *held)
  where = lambda r: {'file': files[int(r >> np.uint64(40))].path,  # noqa: E731
                     'token_offset': int(r & np.uint64((1 << 40) - 1))}
  dup_instances = sum(g.size - 1 for g in instance_groups)
  across = [g for g in doc_groups if np.unique(g >> np.uint64(40)).size > 1]
  report = {
      'instances_hashed': ds.num_instances, 'identical_instances': int(dup_instances),
      'identical_instance_groups': [
          [{'id': int(i), 'file': ds.files[int(np.searchsorted(ds.starts, i, 'right') - 1)].path}
           for i in g[:4]] for g in instance_groups[:_MAX_EXAMPLES]],
      'documents_hashed': docs, 'min_doc_tokens': min_doc_tokens,
      'documents_repeated_across_entries': int(sum(g.size - 1 for g in across)),
      'documents_repeated_within_an_entry': int(sum(g.size - 1 for g in doc_groups)
                                                - sum(g.size - 1 for g in across)),
      'repeated_document_examples': [[{**where(r), 'entry': int(r >> np.uint64(40))} for r in g[:4]]
                                     for g in (across or doc_groups)[:_MAX_EXAMPLES]],
      'hash_buckets': buckets}
  if held:  # exact copies across the split: held-out loss that measures memory
    report.update({'validation_documents_hashed': val_docs,
                   'validation_documents_in_training': int(sum(v.size for _, v in crossed)),
                   'validation_copy_examples': [{'validation': where(v[0]), 'training': where(t[0])}
                                                for t, v in crossed[:_MAX_EXAMPLES]]})
  if ngrams:
    report['ngrams'] = {
        'filter': rf._asdict(), 'rejected_instances': rejected,
        'rejected_fraction': rejected / max(ds.num_instances, 1),
        'max_repeats_histogram': {f'{lo}-{hi}': sum(v for t, v in times_hist.items()
                                                    if lo <= t <= hi)
                                  for lo, hi in ((0, 2), (3, 7), (8, 15), (16, 31), (32, 64))}}
  return report


def _hash_documents(tokens: np.ndarray, eos: int, entry: int, min_tokens: int,
                    out: _Buckets) -> int:
  """Hashes each document (up to and including its EOS) of at least min_tokens tokens."""
  count, begin = 0, 0
  while begin < tokens.size:
    end = min(tokens.size, begin + _CHUNK_TOKENS)
    chunk = np.asarray(tokens[begin:end])
    if end < tokens.size:  # cut after the chunk's last EOS; the rest starts the next chunk
      last = np.flatnonzero(chunk == eos)
      if last.size:
        chunk = chunk[:last[-1] + 1]
    ends = np.flatnonzero(chunk == eos) + 1
    starts = np.concatenate([[0], ends[ends < chunk.size]])
    lengths = np.diff(np.append(starts, chunk.size))
    keep = lengths >= min_tokens
    if keep.any():
      h1, h2 = hash_spans(chunk, starts)
      ref = (np.uint64(entry) << np.uint64(40)) | (starts[keep] + begin).astype(np.uint64)
      out.add(h1[keep], h2[keep], ref)
      count += int(keep.sum())
    begin += chunk.size
  return count


def max_repeat_times(tokens_nT: np.ndarray,
                     rf: batches.RepetitionFilter = batches.RepetitionFilter()) -> np.ndarray:
  """int [n]: per instance, the most repeats of a period-p pattern, p in OLMo-core's range.

  OLMo-core's find_periodic_sequences reports, for a maximal run of L
  positions t with x[t] == x[t - p], times = (L + p) // p, and only runs with
  times > 2; its InstanceFilterConfig rejects an instance with times >=
  max_count. Runs it does not report count as 0 here.
  """
  n, T = tokens_nT.shape
  best = np.zeros(n, np.int64)
  for p in range(rf.min_period, min(rf.max_period, T // 3) + 1):
    eq = np.zeros((n, T - p + 2), np.int8)
    eq[:, 1:-1] = tokens_nT[:, p:] == tokens_nT[:, :-p]
    edge = np.diff(eq, axis=1)
    row, begin = np.nonzero(edge == 1)
    _, end = np.nonzero(edge == -1)  # row-major: pairs with each begin
    times = (end - begin + p) // p
    np.maximum.at(best, row, np.where(times > 2, times, 0))
  return best


# --- The command line -------------------------------------------------------------------------


def build_dataset(cfg_data: Any, num_instances: int = 0) -> data.Dataset:
  """The config's dataset; from listed sizes (order only) when its files are absent."""
  common = dict(seq_len=cfg_data.seq_len, vocab_size=cfg_data.vocab_size,
                eos_token_id=cfg_data.eos_token_id, pad_token_id=cfg_data.pad_token_id)
  if num_instances:
    return SizedDataset([4 * cfg_data.seq_len * num_instances], **common)
  try:
    return data.Dataset.from_config(cfg_data)
  except FileNotFoundError:
    if not cfg_data.mix_file or not storage.isfile(cfg_data.mix_file):
      raise
    paths, labels, sizes = token_files.read_mix(
        cfg_data.mix_file, base_dir=token_files.mix_base_dir(cfg_data.mix_file, cfg_data.base_dir),
        tokenizer_id=cfg_data.tokenizer_id)
    if None in sizes:
      raise FileNotFoundError(f'{cfg_data.mix_file}: some files are absent and the mix lists no '
                              'sizes for them; fetch them (scripts/fetch_data.py writes a mix '
                              'with sizes) or pass --num_instances for the order alone.') from None
    print(f'note: token files absent; auditing the order from the sizes {cfg_data.mix_file} '
          'lists.', file=sys.stderr)
    return SizedDataset(sizes, paths=paths, labels=labels, **common)


def canonical_flags() -> None:
  """The location flags in storage.canonical's one form, or one line (exit 2) before any work:
  --workdir is read (a path or a bucket), --json written (a path or a bucket), --cache_dir
  and --tmp_dir are local (memory-mapped, and spill files)."""
  if FLAGS.workdir:
    FLAGS.workdir = storage.canonical(FLAGS.workdir, '--workdir', writes=False)
  if FLAGS.json:
    FLAGS.json = storage.canonical(FLAGS.json, '--json')
  for name in ('cache_dir', 'tmp_dir'):
    if FLAGS[name].value:
      FLAGS[name].value = storage.canonical(FLAGS[name].value, f'--{name}', local_only=True)


def main(argv):
  xla.quiet_libtpu()  # libtpu without TPU chips: quiet, before a backend starts
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  cfg = FLAGS.config
  try:
    canonical_flags()
    config_checks.complete(cfg)  # tokenizer settings a mix states about itself, as train.py
    ds = build_dataset(cfg.data, FLAGS.num_instances)
    steps = FLAGS.steps or cfg.train.steps
    skips = rollback.run_skips(cfg.train, FLAGS.workdir)  # skip_batches + the run's rollbacks
    warning = repetition_warning(plan(ds.num_instances, cfg.data.global_batch_size, steps, skips),
                                 cfg.data.seq_len,
                                 '--steps' if FLAGS.steps else 'cfg.train.steps')
    if warning:  # before the audit: it is the finding that matters most, and known already
      print(warning, file=sys.stderr, flush=True)
    resume_every = cfg.train.ckpt_every if FLAGS.resume_every < 0 else FLAGS.resume_every
    report = {'order': audit_order(
        ds, cfg.data, steps=steps, devices=FLAGS.devices,
        micro_batch_size=FLAGS.micro_batch_size or cfg.train.micro_batch_size,
        resume_every=resume_every, cache_dir=FLAGS.cache_dir or None,
        all_epochs=FLAGS.all_epochs, progress=True, skips=skips)}
    report['warnings'] = [warning] if warning else []
    if FLAGS.content or FLAGS.ngrams:
      if isinstance(ds, SizedDataset):
        raise FileNotFoundError('--content/--ngrams read the token files; they are absent.')
      held = (data.Dataset.from_config(cfg.data, paths=list(cfg.data.validation_paths))
              if FLAGS.content and cfg.data.validation_paths else None)
      report['content'] = audit_content(ds, tmp_dir=FLAGS.tmp_dir or None,
                                        memory_mb=FLAGS.memory_mb,
                                        min_doc_tokens=FLAGS.min_doc_tokens, ngrams=FLAGS.ngrams,
                                        validation=held)
  except errors.UserError as e:
    errors.report(str(e), e.exit_code)
  except FileNotFoundError as e:
    errors.report(str(e), errors.EXIT_DATA)
  except ValueError as e:
    errors.report(str(e), errors.EXIT_USAGE)
  order = report['order']
  for line in order_summary(order):
    print(line)
  for s in order['repeat_sightings']:
    print(f"  repeated id {s['id']}: epoch {s['epoch']} step {s['step']} rank {s['rank']} "
          f"micro-batch {s['micro_batch']}")
  for problem in order['loader_errors']:
    print(f'  the loader lost its place: {problem}')
  content = report.get('content', {})
  if content:
    print(f"content: {content['identical_instances']} identical instances of "
          f"{content['instances_hashed']:,}; documents (>= {content['min_doc_tokens']} tokens) "
          f"repeated across entries {content['documents_repeated_across_entries']}, within one "
          f"{content['documents_repeated_within_an_entry']} of {content['documents_hashed']:,}")
    for group in content['identical_instance_groups']:
      print('  identical: ' + ', '.join(f"id {g['id']} ({g['file']})" for g in group))
  if 'validation_documents_hashed' in content:
    ex = content['validation_copy_examples']
    print(f"held-out documents (>= {content['min_doc_tokens']} tokens) with an exact copy in "
          f"training: {content['validation_documents_in_training']} of "
          f"{content['validation_documents_hashed']:,}" + (
              f" (e.g. {ex[0]['validation']['file']} @ token "
              f"{ex[0]['validation']['token_offset']} = {ex[0]['training']['file']} @ token "
              f"{ex[0]['training']['token_offset']})" if ex else ''))
  if 'ngrams' in content:
    ng = content['ngrams']
    print(f"ngrams: OLMo-core's filter {ng['filter']} rejects {ng['rejected_instances']} "
          f"({100 * ng['rejected_fraction']:.3f}%); max repeats per instance "
          f"{ng['max_repeats_histogram']}")
  if FLAGS.json:  # a path or a bucket object, written whole
    storage.makedirs(storage.parent(FLAGS.json))
    storage.write_atomic(FLAGS.json, json.dumps(report, indent=1), fsync=False)
  bad = (order['repeated_ids'] or order['loader_errors']
         or content.get('identical_instances', 0))
  if bad:
    print('FAIL: ' + ('instances repeat' if order['repeated_ids'] or content else
                      'the loader lost its place'))
  else:
    print('PASS: every instance at most once per epoch' + (
        '' if order['all_epochs'] else
        f" of the {len(order['audited_epochs'])} audited (of {order['epochs']:,}; the rest by "
        'construction, as above)') + (
        f"; but the run reads its data {order['repetition']:,.0f} times over (the WARNING on "
        'stderr)' if report['warnings'] else ''))
  return 1 if bad else 0


def define_flags() -> None:
  """The command line; defined only when run as a script, so importing it defines no flags."""
  config_flags.DEFINE_config_file('config', 'configs/small.py', 'Training config file.')
  flags.DEFINE_integer('steps', 0, 'Planned steps to audit (0: cfg.train.steps).')
  flags.DEFINE_integer('devices', 1, 'Data-parallel ranks (devices splitting the batch).')
  flags.DEFINE_integer('micro_batch_size', 0, 'Instances per rank per micro-batch '
                       '(0: cfg.train.micro_batch_size).')
  flags.DEFINE_integer('resume_every', -1, 'Restart the loader from its saved state every N '
                       'steps (-1: cfg.train.ckpt_every; 0: never).')
  flags.DEFINE_integer('num_instances', 0, 'Audit the order of N instances without files '
                       '(stage 1: 723872768).')
  flags.DEFINE_bool('all_epochs', False, 'Drive every epoch step by step (default: all of a '
                    f'run of <= {_FULL_EPOCHS} epochs, else the epochs audited_epochs() picks).')
  flags.DEFINE_string('cache_dir', '', "Writes the permutation cache, a local folder ('': in "
                      'memory).')
  flags.DEFINE_bool('content', False, 'Hash instances and documents for repeated content.')
  flags.DEFINE_bool('ngrams', False, "OLMo-core's repetition-filter statistics per instance.")
  flags.DEFINE_integer('memory_mb', 1024, '--content: memory for hashes; more spills to disk.')
  flags.DEFINE_string('tmp_dir', '', '--content: local folder hash buckets spill to (TMPDIR).')
  flags.DEFINE_integer('min_doc_tokens', 32, '--content: shorter documents are not compared.')
  flags.DEFINE_string('json', '', 'Writes the full report here too (a path, gs:// or s3://).')
  flags.DEFINE_string('workdir', '', "Reads the run's workdir (a path or URL): the batches its "
                      'rollbacks (rollbacks.jsonl) skip are skipped here too, as '
                      'train.skip_batches is.')


if __name__ == '__main__':
  define_flags()
  app.run(main, flags_parser=config_checks.parse_flags)
