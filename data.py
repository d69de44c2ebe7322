"""Token data: OLMo-core's numpy fixed-sequence-length dataset and loader.

Given the same token files, mix and seed, the batch for step k is the one
OLMo-core's `NumpyFSLDataset` + `NumpyFSLDataLoader` produced at that step,
instance for instance (docs/data.md):

  files   raw little-endian uint32 tokens, read by memory map (gs://, s3://,
          http(s):// files by byte range: tokens/remote_tokens.py); file f gives
          n_f = tokens_f // T instances (remainder dropped) and owns the global
          ids [sum_{g<f} n_g, sum_{g<=f} n_g), files in mix order.
  order   epoch e (from 1): PCG64(seed + e) shuffle of arange(N, uint32), cached
          on disk under OLMo-core's file name and memory mapped.
  batch   step b of an epoch (0-based) is order[b*B:(b+1)*B]; the tail is dropped.
  ranks   OLMo-core data-parallel rank r of W takes batch positions r, r+W, ...

The batch for a step is a pure function of (dataset, seed, epoch, step), so
resuming needs only that tuple (plus the fingerprint, to refuse changed data).

Stage 3 swaps the instances for OLMo-core's `NumpyPackedFSLDataset`
(packed.PackedDataset, cfg.data.dataset='packed'): whole documents packed
best-fit-decreasing into instances of T, padded; the order, batches and ranks
above apply unchanged to its instance ids.

Reading order (tokens/token_files.py holds mixes, file checks and the fingerprint;
tokens/packed.py the packed dataset; tokens/batches.py a batch from instances and the
data-parallel and host split of the global batch):

  dataset_from_config, wants_segments   which dataset cfg.data asks for.
  Loader                                the prefetching iterator train.py runs.
  held_out_batches, validation_batches  the fixed held-out batches.
  check_same_data, check_position       what a resume refuses.
  Skips (tokens/skips.py)               global batches a run skips (monitor/rollback.py).
  permutation, global_batch_ids         the global order.
  Dataset                               the FSL dataset (stages 1-2).

Glossary: N instances in the dataset, B global batch (instances), T sequence
length, n instances read, W data-parallel batch shards (devices that split the
batch).
"""

from __future__ import annotations  # the reading order puts users before what they name

import functools
import os
import queue
import threading
from typing import Any, Iterator, Sequence

from absl import logging
import jax
import numpy as np

from errors import DataError
from tokens import batches
from tokens import packed
from tokens.skips import Skips  # data.Skips: the skipped global batches (monitor/rollback.py)
from tokens import token_files


# ----------------------------------------------------------------------------
# Choosing the dataset.


def dataset_from_config(cfg_data: Any, cache_dir: str | None = None
                        ) -> Dataset | packed.PackedDataset:
  """The training set cfg.data.dataset names: 'fsl' (stages 1-2) or 'packed' (stage 3).

  `cache_dir` holds the packed dataset's packing cache (the FSL dataset needs none).
  """
  kind = cfg_data.dataset
  if kind == 'fsl':
    return Dataset.from_config(cfg_data)
  if kind == 'packed':
    return packed.PackedDataset.from_config(cfg_data, cache_dir=cache_dir)
  raise DataError(f"cfg.data.dataset={kind!r} is not 'fsl' (OLMo-core NumpyFSLDataset, stages "
                  "1-2) or 'packed' (NumpyPackedFSLDataset, stage 3).")


def wants_segments(cfg_data: Any) -> bool:
  """Whether batches carry segment_ids: data.document_masking (OLMo-core's
  generate_doc_lengths), attention within documents."""
  return bool(cfg_data.document_masking)


# ----------------------------------------------------------------------------
# The prefetching loader.


class Loader:
  """Iterator over global batches for (epoch, step), (epoch, step + 1), ...

  A background thread reads ahead `prefetch` batches. Each process reads only
  the rows its devices hold when a `sharding` (for [B, T]) is given and then
  yields global jax.Arrays; without one it yields the whole batch as numpy.
  After an epoch's last batch it continues with epoch + 1, step 0 (OLMo-core
  trainer behaviour), unless stop_at_epoch_end, which ends the iteration. A
  start at step = batches_per_epoch (the end of the epoch, as OLMo-core records
  a checkpoint at an epoch's last step) is the next epoch's step 0.

  `skips` (a Skips) names global batches never yielded: the iteration passes
  over them (a start inside one begins after it). Without skips the order is
  exactly OLMo-core's.
  """

  def __init__(self, ds: Dataset, *, seed: int, global_batch_size: int, epoch: int = 1,
               step: int = 0, cache_dir: str | None = None,
               sharding: jax.sharding.NamedSharding | None = None,
               repetition_filter: batches.RepetitionFilter | None = None,
               document_masking: bool = False,
               prefetch: int = 2, stop_at_epoch_end: bool = False, skips: Skips | None = None):
    self.ds, self.seed, self.global_batch_size = ds, seed, global_batch_size
    n = self.batches_per_epoch = batches_per_epoch(ds, global_batch_size)
    if epoch < 1 or not 0 <= step <= n:
      raise DataError(f'start (epoch {epoch}, step {step}) is outside epochs >= 1 and steps '
                      f'[0, {n}] ({n} batches of {global_batch_size} per epoch of this data); '
                      'start inside them, or resume from a state saved with this data.')
    self.skips = skips or Skips()
    # Epoch done: OLMo-core saves (e, n) at an epoch's last step, and e + 1 follows; the
    # global index (e - 1) * n + n is that position too.
    epoch, step = divmod(self.skips.advance((epoch - 1) * n + step), n)
    self.epoch, self.step = epoch + 1, step  # the next batch to be yielded
    self.last_position: tuple[int, int] | None = None  # the last yielded batch's (epoch, step)
    self.cache_dir, self.sharding = cache_dir, sharding
    self.repetition_filter, self.document_masking = repetition_filter, document_masking
    self.stop_at_epoch_end = stop_at_epoch_end
    B, T = global_batch_size, ds.seq_len
    if sharding is None:
      self.rows = np.arange(B)
      self.positions = self.rows
    else:
      self.rows = batches.local_rows(sharding, B, T)
      shards = batches.num_batch_shards(sharding, B, T)
      self.positions = batches.batch_positions(B, shards)[self.rows]
    self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  @classmethod
  def from_config(cls, cfg_data: Any, ds: Dataset, *, state: dict[str, Any] | None = None,
                  step: int | None = None, cache_dir: str | None = None,
                  sharding=None, skips: Skips | None = None) -> 'Loader':
    """A loader for cfg.data, resuming from a saved `state` when given.

    `step` is the number of optimizer steps the checkpoint holding `state` had
    done; the state's position must be where that many global batches lead,
    passing over `skips` (the run's skipped global batches).
    """
    start = dict(epoch=1, step=0, seed=cfg_data.seed)
    if state is not None:
      allow_changed = cfg_data.allow_data_change
      check_state_fields(state)
      check_same_data(state, ds, allow_changed=allow_changed)
      if state['global_batch_size'] != cfg_data.global_batch_size:
        raise DataError(f'the checkpoint was trained with global batch '
                        f'{state["global_batch_size"]}, cfg.data.global_batch_size is '
                        f'{cfg_data.global_batch_size}; steps would index different batches. '
                        'Keep the batch size when resuming.')
      if step is not None:
        check_position(state, ds, step, allow_changed=allow_changed, skips=skips)
      start = dict(epoch=state['epoch'], step=state['step'], seed=state['seed'])
    return cls(ds, global_batch_size=cfg_data.global_batch_size, cache_dir=cache_dir,
               sharding=sharding, document_masking=wants_segments(cfg_data), skips=skips,
               repetition_filter=batches.RepetitionFilter() if cfg_data.repetition_filter else None,
               prefetch=cfg_data.prefetch, **start)

  def state(self) -> dict[str, Any]:
    """JSON-able position of the next batch plus what identifies the data."""
    return {'seed': self.seed, 'epoch': self.epoch, 'step': self.step,
            'global_batch_size': self.global_batch_size, 'seq_len': self.ds.seq_len,
            'num_instances': self.ds.num_instances, 'fingerprint': self.ds.fingerprint,
            'fingerprint_version': token_files.FINGERPRINT_VERSION,
            'fields': self.ds.fingerprint_fields,
            'files': [[f.path, f.size] for f in self.ds.files],
            **({'stable_packing': self.ds.stable_packing}
               if isinstance(self.ds, packed.PackedDataset) else {}),
            **({'skips': self.skips.windows} if self.skips else {})}

  def _next_position(self, epoch: int, step: int) -> tuple[int, int] | None:
    n = self.batches_per_epoch
    nxt_epoch, nxt_step = divmod(self.skips.advance((epoch - 1) * n + step + 1), n)
    if nxt_epoch + 1 == epoch or not self.stop_at_epoch_end:
      return nxt_epoch + 1, nxt_step
    return None

  def position(self, steps_done: int) -> tuple[int, int]:
    """(epoch, step) of the batch that optimizer step `steps_done` + 1 reads."""
    epoch, step = divmod(self.skips.nth(steps_done), self.batches_per_epoch)
    return epoch + 1, step

  def ids_at(self, epoch: int, step: int) -> np.ndarray:
    """Global instance ids of this process's rows for (epoch, step): what batch_at reads."""
    ids = global_batch_ids(self.ds, self.seed, epoch, step, self.global_batch_size, self.cache_dir)
    return ids[self.positions]

  def batch_at(self, epoch: int, step: int) -> dict[str, Any]:
    """This process's part of the batch for (epoch, step); global arrays if sharded."""
    ids = self.ids_at(epoch, step)
    if isinstance(self.ds, packed.PackedDataset):  # padded: labels, segments of the padding
      tokens_BT, real_B = self.ds.read_with_lengths(ids)
      padding = dict(real_B=real_B, bos_token_id=self.ds.bos_token_id)
    else:
      tokens_BT, padding = self.ds.read(ids), {}
    batch = batches.make_batch(tokens_BT, eos_token_id=self.ds.eos_token_id,
                               repetition_filter=self.repetition_filter,
                               document_masking=self.document_masking, **padding)
    if self.sharding is not None:
      batch = batches.make_global_batch(batch, self.sharding, self.rows, self.global_batch_size)
    return batch

  def _produce(self) -> None:
    position: tuple[int, int] | None = (self.epoch, self.step)
    try:
      while position is not None and not self._stop.is_set():
        self._queue.put((position, self.batch_at(*position)))  # blocks while `prefetch` wait
        position = self._next_position(*position)
      self._queue.put((None, StopIteration()))
    except BaseException as e:  # pylint: disable=broad-except  # re-raised in the consumer
      self._queue.put((None, e))

  def __iter__(self) -> Iterator[dict[str, Any]]:
    return self

  def __next__(self) -> dict[str, Any]:
    if self._stop.is_set():
      raise StopIteration('the loader was closed')
    if self._thread is None:  # started lazily; again after an epoch end with stop_at_epoch_end
      self._thread = threading.Thread(target=self._produce, daemon=True, name='data-prefetch')
      self._thread.start()
    position, batch = self._queue.get()
    if position is None:
      self._thread = None
      raise batch
    nxt = self._next_position(*position)
    self.epoch, self.step = nxt if nxt is not None else (position[0] + 1, 0)
    self.last_position = position  # (epoch, step) of this batch: ids_at(*it) gives its ids
    return batch

  def close(self) -> None:
    """Stops the prefetch thread; the loader then yields nothing more."""
    self._stop.set()
    while self._thread is not None and self._thread.is_alive():
      try:
        self._queue.get(timeout=0.1)  # unblocks a producer waiting on a full queue
      except queue.Empty:
        pass
    self._thread = None

  def __enter__(self) -> 'Loader':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ----------------------------------------------------------------------------
# Held-out batches (tokens/batches.py builds a batch from instances).


def held_out_batches(cfg_data: Any, divisor: Any, rows: Any = None) -> list | None:
  """train.py's fixed held-out batches from cfg.data.validation_paths, or None with a warning.

  At most cfg.data.global_batch_size instances per batch, cut to a multiple of
  divisor(batch size) (the devices that split it); a set shorter than one
  seq_len, or than one such batch, is skipped with a warning, never an error.
  With rows (batch size -> the sorted rows this process holds, batches.local_rows),
  only those rows are read: a list of (rows of each batch, batch size).
  """
  paths = list(cfg_data.validation_paths)
  longest = max([f.num_tokens for f in token_files.inspect_files(paths, sample=False)], default=0)
  if longest < cfg_data.seq_len:
    logging.warning('No held-out set of seq_len=%d tokens (%s): validation loss is not '
                    'measured. prepare_data.py holds out every --validation_every-th document '
                    '(100 by default; a text file is one document), so a corpus of fewer '
                    'documents holds none out: rerun it with --validation_every=N (e.g. 10), '
                    'or set --config.data.validation_paths.',
                    cfg_data.seq_len, paths or 'data.validation_paths is empty')
    return None
  ds = Dataset.from_config(cfg_data, paths=paths)
  size = min(cfg_data.global_batch_size, ds.num_instances)
  size -= size % divisor(size) if size else 0
  if size < 1:
    logging.warning('The held-out set %s holds %d instances, too few for one batch on this '
                    'mesh: validation loss is not measured.', paths, ds.num_instances)
    return None
  local = None if rows is None else np.asarray(rows(size))
  held = validation_batches(ds, size, cfg_data.validation_batches,
                            document_masking=wants_segments(cfg_data), rows=local)
  return held if rows is None else [(b, size) for b in held]


def validation_batches(ds: Dataset, batch_size: int, num_batches: int, *,
                       document_masking: bool = False, rows: np.ndarray | None = None
                       ) -> list[dict[str, np.ndarray]]:
  """Fixed held-out batches: instances 0, 1, ... in file order (no shuffle, no filter);
  only rows `rows` of each (in that order) when given. Every row stands alone (labels,
  segment ids), so a batch's rows read apart equal the same rows of the whole batch."""
  n = min(num_batches, ds.num_instances // batch_size)
  if n == 0:
    raise DataError(f'the validation set has {ds.num_instances} instances of length {ds.seq_len}, '
                    f'fewer than one batch of {batch_size}.')
  rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
  return [batches.make_batch(ds.read(b * batch_size + rows), eos_token_id=ds.eos_token_id,
                             document_masking=document_masking)
          for b in range(n)]


# ----------------------------------------------------------------------------
# Resume checks.


def check_same_data(state: dict[str, Any], ds: Dataset, allow_changed: bool = False) -> None:
  """Refuses to resume on data that differs from the checkpoint's, naming the change.

  Files are compared in mix order by basename and size (what OLMo-core's
  fingerprint hashes), so moving the data to another directory is allowed.
  """
  same_len = state.get('seq_len', ds.seq_len) == ds.seq_len
  # Not in OLMo-core's fingerprint, but it changes which documents share an instance.
  packing = (state.get('stable_packing'), getattr(ds, 'stable_packing', None))
  if state.get('fingerprint') == ds.fingerprint and same_len and packing[0] == packing[1]:
    return
  problems = [] if same_len else [f'seq_len {state["seq_len"]} -> {ds.seq_len}']
  if packing[0] != packing[1]:
    problems.append(f'stable_packing {packing[0]} -> {packing[1]}')
  fields = ds.fingerprint_fields
  problems += [f'{k} {v} -> {fields.get(k)}' for k, v in state.get('fields', {}).items()
               if fields.get(k) != v]
  old = [(str(p), int(s)) for p, s in state.get('files', [])]
  new = [(f.path, f.size) for f in ds.files]
  for i, (o, n) in enumerate(zip(old, new)):
    if (os.path.basename(o[0]), o[1]) != (os.path.basename(n[0]), n[1]):
      problems.append(f'file #{i} was {o[0]} ({o[1]} bytes), is {n[0]} ({n[1]} bytes)')
  problems += [f'file #{i} {p} ({s} bytes) was removed' for i, (p, s) in enumerate(old[len(new):],
                                                                                   len(new))]
  problems += [f'file #{i} {p} ({s} bytes) was added' for i, (p, s) in enumerate(new[len(old):],
                                                                                 len(old))]
  if not problems:
    problems.append('the fingerprint fields differ')
  more = f'; and {len(problems) - 10} more' if len(problems) > 10 else ''
  message = (f"the data differs from the checkpoint's (fingerprint {state.get('fingerprint')} -> "
             f'{ds.fingerprint}): ' + '; '.join(problems[:10]) + more
             + '. Resuming would change the data order. Restore the original files, or pass '
             '--config.data.allow_data_change=True to resume anyway.')
  if not allow_changed:
    raise DataError(message)


_STATE_FIELDS = ('seed', 'epoch', 'step', 'global_batch_size')  # what a resume reads


def check_state_fields(state: Any) -> None:
  """Refuses a saved loader state that is not a dict with integer position fields."""
  fields = state if isinstance(state, dict) else {}
  bad = {k: fields.get(k) for k in _STATE_FIELDS
         if isinstance(fields.get(k), bool) or not isinstance(fields.get(k), (int, np.integer))}
  if bad:
    raise DataError(f"the checkpoint's data state {state!r:.200} has no integer "
                    f"{', '.join(bad)}; its metadata was altered or was not "
                    'written by train.py. Restore the original metadata.json, or move that '
                    'step_N directory aside to resume from an earlier checkpoint.')


def check_position(state: dict[str, Any], ds: Dataset, steps_done: int, *,
                   allow_changed: bool = False, skips: Skips | None = None) -> None:
  """Refuses a loader state that is not where `steps_done` optimizer steps lead.

  Each step takes one global batch and epochs have batches_per_epoch batches,
  so after k steps the loader is at epoch 1 + k // n, step k % n, whatever the
  device count (or, where k ends an epoch, at epoch k // n, step n: OLMo-core's
  record of it, which the Loader starts as the next epoch). With `skips` (the
  run's skipped global batches) the k steps read the first k batches outside
  them, and the state's position, passing over skips, must be the next one
  outside: a checkpoint saved just before a window was added (the one a
  rollback restores) is at the window's start. With allow_changed the data,
  and so n, may have changed at an earlier resume; past epoch 1 only
  `step < steps_done` is then certain.
  """
  skips = skips or Skips()
  n = batches_per_epoch(ds, state['global_batch_size'])
  epoch, step = state['epoch'], state['step']
  batches = (epoch - 1) * n + step
  if skips.advance(batches) == skips.nth(steps_done) or (
      allow_changed and epoch > 1 and step < steps_done):
    return
  skipped = (f' and the run skips global batches {skips}, so {steps_done} steps lead to global '
             f'batch {skips.nth(steps_done)}' if skips else '')
  raise DataError(f"the checkpoint's data state is at epoch {epoch}, step {step} ({batches} "
                  f'global batches of {state["global_batch_size"]} at {n} per epoch), but the '
                  f'checkpoint records {steps_done} optimizer steps, one batch each{skipped}; '
                  'its metadata was altered, its data state belongs to another run, or a skip '
                  'window was added behind it. Restore the original metadata.json (or '
                  'train.skip_batches), or move that step_N directory aside to resume from '
                  'an earlier checkpoint.')


# ----------------------------------------------------------------------------
# The global order.


def indices_file_name(num_instances: int, seed: int, epoch: int) -> str:
  # OLMo-core NumpyFSLDataLoader._global_indices_file (fields sorted, chunk omitted, v=1), so an
  # OLMo-core work_dir and this cache can share files: both are raw uint32 memmaps.
  return f'global_indices_dataset_size{num_instances}_epoch{epoch}_seed{seed}_v1.npy'


@functools.lru_cache(maxsize=4)
def permutation(num_instances: int, seed: int, epoch: int,
                cache_dir: str | None = None) -> np.ndarray:
  """Epoch `epoch`'s global instance order (uint32 [N]), memory mapped from cache_dir.

  OLMo-core NumpyFSLDataLoader._build_global_indices: PCG64(seed + epoch)
  shuffles arange(N, uint32). The first call builds it in RAM (4N bytes: 2.7 GiB
  for stage 1) and writes it under OLMo-core's file name, renaming it into place
  when complete (concurrent builders write identical files), with its xxh3-64
  checksum in a sidecar `<file>.xxh3` (the cache file stays byte-identical to
  OLMo-core's). Every later call, in any process, verifies the checksum (one
  read of the file; hashing runs at ~30 GB/s) and memory maps the file
  read-only; a damaged or unverifiable file is rebuilt with a warning.
  Shuffling the memory-mapped file in place gives the same order but took
  about twice the CPU time (BUILD.md). With cache_dir=None the order is kept
  in memory (small datasets, tests).
  """
  if epoch < 1:
    raise DataError(f'epochs count from 1 (OLMo-core reshuffle); got epoch={epoch}.')
  path = cache_dir and os.path.join(cache_dir, indices_file_name(num_instances, seed, epoch))
  if path and os.path.exists(path):
    cached = _verified_cache(path, num_instances)
    if cached is not None:
      return cached
  order = np.arange(num_instances, dtype=np.uint32)
  np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(order)
  if not path:
    return order
  os.makedirs(cache_dir, exist_ok=True)
  token_files.write_checksummed(path, order)
  del order
  return np.memmap(path, dtype=np.uint32, mode='r', shape=(num_instances,))


def _verified_cache(path: str, num_instances: int) -> np.ndarray | None:
  """The cached order, memory mapped, if its size and checksum hold; else None, with a warning."""
  size = os.path.getsize(path)
  if size != 4 * num_instances:
    problem = f'it is {size} bytes, not the {4 * num_instances} of {num_instances} uint32 ids'
  else:
    order = np.memmap(path, dtype=np.uint32, mode='r', shape=(num_instances,))
    problem = token_files.checksum_problem(path, order)
    if problem is None:
      return order
  logging.warning('Permutation cache %s is unusable (%s); rebuilding it.', path, problem)
  return None


def batches_per_epoch(ds: Dataset, global_batch_size: int) -> int:
  """Full global batches in one epoch (OLMo-core NumpyFSLDataLoader.total_batches)."""
  if global_batch_size <= 0:
    raise DataError(f'global_batch_size must be positive, got {global_batch_size}.')
  n = ds.num_instances // global_batch_size
  if n == 0:
    raise DataError(f'global_batch_size {global_batch_size} exceeds the {ds.num_instances} '
                    f'instances of length {ds.seq_len} in the dataset.')
  return n


def global_batch_ids(ds: Dataset, seed: int, epoch: int, step: int, global_batch_size: int,
                     cache_dir: str | None = None) -> np.ndarray:
  """Instance ids (uint32 [B]) of global batch `step` (0-based within `epoch`)."""
  n = batches_per_epoch(ds, global_batch_size)
  if not 0 <= step < n:
    raise IndexError(f'epoch {epoch} has {n} batches of {global_batch_size}; step {step} is '
                     'outside it.')
  order = permutation(ds.num_instances, seed, epoch, cache_dir)
  return np.array(order[step * global_batch_size:(step + 1) * global_batch_size])



# ----------------------------------------------------------------------------
# The FSL dataset (stages 1-2).


class Dataset:
  """OLMo-core's `NumpyFSLDataset` over uint32 token files: instance i as int32 [T]."""

  def __init__(self, paths: Sequence[str], *, seq_len: int, vocab_size: int, eos_token_id: int,
               pad_token_id: int, bos_token_id: int | None = None,
               max_target_sequence_length: int | None = -1, labels: Sequence[str] | None = None,
               listed_sizes: Sequence[int | None] | None = None, source: str = 'cfg.data.paths',
               remote_cache_dir: str = ''):
    """Builds the dataset; `max_target_sequence_length=-1` means seq_len (Ai2's setting).
    Remote files (gs://, s3://, http(s)://) are read by byte range, kept in
    `remote_cache_dir` when given (docs/data.md, remote data)."""
    if not paths:
      raise DataError(f'{source} is empty: the dataset needs at least one token file.')
    if seq_len <= 0:
      raise DataError(f'seq_len must be positive, got {seq_len}.')
    if max_target_sequence_length == -1:
      max_target_sequence_length = seq_len  # pretrain-1 sets it to seq_len (in the fingerprint)
    if max_target_sequence_length not in (None, seq_len):
      raise DataError(f'max_target_sequence_length={max_target_sequence_length} != seq_len='
                      f"{seq_len}: OLMo-core's sequence-length warm-up chunking is not supported; "
                      'use None or seq_len.')
    self.files = token_files.inspect_files(paths, labels, listed_sizes, vocab_size,
                                           cache_dir=remote_cache_dir)
    self.seq_len = seq_len
    self.vocab_size = vocab_size
    self.eos_token_id = eos_token_id
    self.pad_token_id = pad_token_id
    self.bos_token_id = bos_token_id
    self.max_target_sequence_length = max_target_sequence_length
    counts = np.array([f.num_tokens // seq_len for f in self.files], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(counts)])  # file f owns [starts[f], starts[f+1])
    self.num_instances = int(self.starts[-1])
    if self.num_instances == 0:
      longest = max(self.files, key=lambda f: f.num_tokens)
      raise DataError(f'seq_len {seq_len} is larger than every file in {source}; the longest, '
                      f'{longest.path}, has {longest.num_tokens} tokens. Lower seq_len or add '
                      'data.')
    if self.num_instances >= np.iinfo(np.uint32).max:
      raise DataError(f'{self.num_instances} instances do not fit OLMo-core\'s uint32 order.')
    self.maps = token_files.open_tokens(self.files, remote_cache_dir)

  @classmethod
  def from_config(cls, cfg_data: Any, paths: Sequence[str] | None = None) -> 'Dataset':
    """Builds the training set from cfg.data (mix_file or paths); `paths` overrides both."""
    paths, labels, sizes, source = token_files.config_sources(cfg_data, paths)
    return cls(paths, seq_len=cfg_data.seq_len, vocab_size=cfg_data.vocab_size,
               eos_token_id=cfg_data.eos_token_id, pad_token_id=cfg_data.pad_token_id,
               bos_token_id=cfg_data.bos_token_id,
               max_target_sequence_length=cfg_data.max_target_sequence_length,
               labels=labels, listed_sizes=sizes, source=source,
               remote_cache_dir=cfg_data.get('remote_cache_dir', ''))

  @property
  def fingerprint_fields(self) -> dict[str, Any]:
    """OLMo-core NumpyFSLDataset.fingerprint_fields, in its order (dtype is always uint32)."""
    return {'vocab_size': self.vocab_size, 'pad_token_id': self.pad_token_id,
            'eos_token_id': self.eos_token_id, 'dtype': str(np.uint32),
            'max_target_sequence_length': self.max_target_sequence_length,
            'bos_token_id': self.bos_token_id}

  @property
  def fingerprint(self) -> str:
    """OLMo-core `NumpyDatasetBase.fingerprint` for a `NumpyFSLDataset` (sha256 hex)."""
    return token_files.fingerprint('NumpyFSLDataset', self.fingerprint_fields, self.files)

  def read(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens of instances `ids` as int32 [n, T], checked against vocab_size."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
      raise IndexError(f'instance ids must lie in [0, {self.num_instances}); got '
                       f'[{ids.min()}, {ids.max()}].')
    T = self.seq_len
    tokens_nT = np.empty((ids.size, T), np.int32)
    raw_nT = tokens_nT.view(np.uint32)  # same-width copy (memcpy); ids >= 2^31 fail the check below
    file_of = np.searchsorted(self.starts, ids, side='right') - 1
    start_n = (ids - self.starts[file_of]) * T
    # Every instance's read is in flight before any is copied (page faults, or remote requests).
    for k, tokens in enumerate(self.maps.read_many(list(zip(file_of.tolist(), start_n.tolist(),
                                                            [T] * ids.size)))):
      raw_nT[k] = tokens
    if raw_nT.size and raw_nT.max() >= self.vocab_size:
      k, t = np.argwhere(raw_nT >= self.vocab_size)[0]
      raise token_files.vocab_error(self.files[file_of[k]].path, raw_nT[k, t], start_n[k] + t,
                                    self.vocab_size)
    return tokens_nT

  def check_tokens(self, chunk_tokens: int = 1 << 24) -> None:
    """Scans every token of every file against vocab_size (a full read; use offline)."""
    token_files.check_tokens(self.maps, self.vocab_size, chunk_tokens)
