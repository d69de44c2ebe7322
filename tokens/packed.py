"""The packed dataset (stage 3): OLMo-core's NumpyPackedFSLDataset and its packer.

Whole documents are packed best-fit-decreasing into instances of T tokens and
padded (docs/data.md, packed long-context dataset). data.py builds it
(dataset_from_config) and reads it (Loader): its global order, batches and
ranks apply unchanged to these instance ids. This module never imports data.py.

Reading order: the packing steps, one file group at a time (document_ends,
cap_documents, then pack_documents, best-fit-decreasing via best_fit_bins),
then PackedDataset, which runs them per group, caches the result on disk and
reads instances back (read_with_lengths).

Glossary: T sequence length, I instances of a group, D documents of a group,
n instances read.
"""

import collections
import hashlib
import os
from typing import Any, NamedTuple, Sequence

from absl import logging
import numpy as np

from errors import DataError
from store import storage
from tokens import token_files

LONG_DOC_STRATEGIES = ('truncate', 'fragment')  # OLMo-core LongDocStrategy values
_SCAN_CHUNK = 1 << 24  # tokens read at a time while finding document ends (64 MiB)
_PACK_VERSION = 'v2'  # part of every packing cache name: tick if the packing or layout changes


def document_ends(tokens: np.ndarray, eos_token_id: int, bos_token_id: int | None = None,
                  chunk: int = _SCAN_CHUNK) -> np.ndarray:
  """int64 exclusive end offsets of the documents in a token array, read `chunk` at a time.

  OLMo-core iter_document_indices on a local array: a document ends at each EOS
  or, with a BOS id, at each EOS followed by a BOS and at a final EOS. Tokens
  after the last end belong to no document and are never trained on. Reading
  in chunks keeps memory bounded on multi-GB files (a memmap in, ~1.25 bytes
  per token of the chunk out).
  """
  n, ends = tokens.shape[0], []
  for a in range(0, n, chunk):
    x = np.asarray(tokens[a:a + chunk + 1])  # one token past the chunk: a BOS after its last EOS
    if bos_token_id is None:
      hit = x[:chunk] == eos_token_id
    else:
      hit = (x[:-1] == eos_token_id) & (x[1:] == bos_token_id)
    ends.append(np.flatnonzero(hit) + (a + 1))
  if bos_token_id is not None and n and tokens[n - 1] == eos_token_id:
    ends.append(np.array([n]))
  return np.concatenate(ends).astype(np.int64) if ends else np.zeros(0, np.int64)


def cap_documents(starts: np.ndarray, ends: np.ndarray, seq_len: int,
                  strategy: str = 'truncate') -> tuple[np.ndarray, np.ndarray]:
  """Documents longer than seq_len, cut as OLMo-core's long_doc_strategy says.

  'truncate' keeps the first seq_len tokens (the rest is never trained on);
  'fragment' splits the document into seq_len pieces and a remainder, kept in
  place as separate documents (only the last one ends with EOS).
  """
  if strategy == 'truncate':
    return starts, np.minimum(ends, starts + seq_len)
  pieces = np.maximum(1, -(-(ends - starts) // seq_len))
  k = np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece number
  new_starts = np.repeat(starts, pieces) + k * seq_len
  return new_starts, np.minimum(np.repeat(ends, pieces), new_starts + seq_len)


class _Capacities:
  """The set of free capacities in [1, T) of open bins, with next-at-least queries.

  A two-level bitmap of 64-bit words: O(1) Python operations per query and
  update, where OLMo-core walks a segment tree of 2T node objects.
  """

  def __init__(self, seq_len: int):
    self.words = [0] * ((seq_len >> 6) + 1)
    self.summary = 0  # bit w set iff words[w] != 0

  def add(self, c: int) -> None:
    w = c >> 6
    if not self.words[w]:
      self.summary |= 1 << w
    self.words[w] |= 1 << (c & 63)

  def remove(self, c: int) -> None:
    w = c >> 6
    self.words[w] &= ~(1 << (c & 63))
    if not self.words[w]:
      self.summary &= ~(1 << w)

  def at_least(self, length: int) -> int | None:
    """The smallest capacity >= length in the set, or None."""
    w = length >> 6
    bits = self.words[w] >> (length & 63)
    if bits:
      return length + (bits & -bits).bit_length() - 1
    rest = self.summary >> (w + 1)
    if not rest:
      return None
    w += (rest & -rest).bit_length()
    bits = self.words[w]
    return (w << 6) + (bits & -bits).bit_length() - 1


def best_fit_bins(lengths: Sequence[int], seq_len: int) -> np.ndarray:
  """int64 bin of each document, packed in the given order (OLMo-core InstancePacker).

  Each document goes to the open bin with the least free space that still
  fits it; among bins with that space, the one that reached it first (FIFO);
  with none, to a new bin. Bins are numbered in order of opening.
  """
  free, queues, bins, opened = _Capacities(seq_len), {}, [], 0
  for length in lengths:
    c = free.at_least(length)
    if c is None:
      b, space = opened, seq_len - length
      opened += 1
    else:
      q = queues[c]
      b, space = q.popleft(), c - length
      if not q:
        free.remove(c)
    if space:
      q = queues.setdefault(space, collections.deque())
      if not q:
        free.add(space)
      q.append(b)
    bins.append(b)
  return np.array(bins, np.int64)


def pack_documents(lengths: np.ndarray, seq_len: int, stable: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
  """Best-fit-decreasing packing: (document ids instance by instance, offsets [I + 1]).

  OLMo-core InstancePacker.pack_documents sorts by decreasing length with
  numpy's default argsort, which is not stable: equal lengths come out in an
  order that depends on the CPU's sort kernel (AVX-512 or not), so the same
  files can pack differently on two machines. The default reproduces
  OLMo-core on this machine; `stable` keeps equal lengths in file order, the
  same everywhere.
  """
  if lengths.size and (lengths.min() < 1 or lengths.max() > seq_len):
    raise DataError(f'document lengths must lie in [1, {seq_len}]; got [{lengths.min()}, '
                    f'{lengths.max()}] (cap them with cap_documents first).')
  order = np.argsort(-lengths.astype(np.int64), kind='stable' if stable else None)
  bins = best_fit_bins(lengths[order].tolist(), seq_len)
  by_bin = np.argsort(bins, kind='stable')  # documents of bin 0, then bin 1, ...: in packing order
  counts = np.bincount(bins, minlength=int(bins.max(initial=-1)) + 1)
  return order[by_bin], np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


class _Packing(NamedTuple):
  """One source group's packing: instance i holds documents offsets[i]:offsets[i+1]."""
  offsets: np.ndarray  # int64 [I + 1]
  file: np.ndarray  # int64 [D]: file of each document, 0-based within the group
  start: np.ndarray  # int64 [D]: its first token's offset in that file
  length: np.ndarray  # int64 [D]

  @classmethod
  def from_flat(cls, flat: np.ndarray) -> '_Packing':
    """Views into the cache layout [I, offsets (I + 1), file (D), start (D), length (D)]."""
    i = int(flat[0])
    d = (flat.size - i - 2) // 3
    return cls(flat[1:i + 2], *flat[i + 2:].reshape(3, d))

  def flat(self) -> np.ndarray:
    return np.concatenate([[self.offsets.size - 1], self.offsets, self.file, self.start,
                           self.length]).astype(np.int64)


class PackedDataset:
  """OLMo-core's `NumpyPackedFSLDataset` over uint32 token files: instance i as int32 [T].

  Files are packed in groups of `source_group_size` consecutive files (after
  the source permutation, which config_sources applies); documents never
  cross groups, and group g owns the instance ids after those of groups < g,
  in packing order. Instance i is its documents' tokens back to back, then
  pad_token_id up to T. Packing reads only document ends, one file at a time,
  and is cached on disk per group (docs/data.md).
  """

  def __init__(self, paths: Sequence[str], *, seq_len: int, vocab_size: int, eos_token_id: int,
               pad_token_id: int, bos_token_id: int | None = None,
               long_doc_strategy: str = 'truncate', source_group_size: int = 1,
               stable_packing: bool = False, source_permutation_seed: int | None = None,
               labels: Sequence[str] | None = None,
               listed_sizes: Sequence[int | None] | None = None, cache_dir: str | None = None,
               source: str = 'cfg.data.paths', remote_cache_dir: str = ''):
    """Packs (or loads the cached packing of) every group.

    `paths` are in mix order and shuffled by `source_permutation_seed` as
    OLMo-core's config does (from_config has done that already). Remote files
    (gs://, s3://, http(s)://) are read by byte range (tokens/remote_tokens.py), their
    ranges kept in `remote_cache_dir` when given.
    """
    if not paths:
      raise DataError(f'{source} is empty: the packed dataset needs at least one token file.')
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
      raise DataError(f'seq_len must be a positive integer, got {seq_len!r}.')
    if long_doc_strategy not in LONG_DOC_STRATEGIES:
      raise DataError(f'long_doc_strategy {long_doc_strategy!r} is not one of '
                      f'{LONG_DOC_STRATEGIES} (OLMo-core LongDocStrategy); set '
                      "cfg.data.long_doc_strategy='truncate' (Ai2's stage 3) or 'fragment'.")
    if (isinstance(source_group_size, bool) or not isinstance(source_group_size, int)
        or source_group_size < 1):
      raise DataError(f'source_group_size must be an integer >= 1 (files packed together), got '
                      f'{source_group_size!r}; Ai2 stage 3 uses 8.')
    labels = labels or [''] * len(paths)
    listed_sizes = listed_sizes or [None] * len(paths)
    order = token_files.source_order(len(paths), source_permutation_seed)
    self.files = token_files.inspect_files([paths[i] for i in order], [labels[i] for i in order],
                                           [listed_sizes[i] for i in order], vocab_size,
                                           cache_dir=remote_cache_dir)
    self.seq_len, self.vocab_size = seq_len, vocab_size
    self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
    self.bos_token_id = bos_token_id
    self.long_doc_strategy, self.source_group_size = long_doc_strategy, source_group_size
    self.stable_packing, self.cache_dir = bool(stable_packing), cache_dir or None
    self.groups = [list(range(g, min(g + source_group_size, len(paths))))
                   for g in range(0, len(paths), source_group_size)]
    self.maps = token_files.open_tokens(self.files, remote_cache_dir)
    self.packings = [self._packing(g) for g in range(len(self.groups))]
    counts = [p.offsets.size - 1 for p in self.packings]
    self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # group g's first id
    self.num_instances = int(self.starts[-1])
    if self.num_instances == 0:
      raise DataError(f'{source} holds no document: no file has an {self._eos_name()}, so '
                      'nothing can be packed. Check cfg.data.eos_token_id (the tokenizer\'s '
                      'EOS id) and the files.')
    self._warn_files_without_documents()
    if self.num_instances >= np.iinfo(np.uint32).max:
      raise DataError(f'{self.num_instances} instances do not fit OLMo-core\'s uint32 order.')

  def _eos_name(self) -> str:
    """What ends a document, as the messages name it."""
    bos = '' if self.bos_token_id is None else f' followed by BOS {self.bos_token_id}'
    return f'EOS (id {self.eos_token_id}{bos})'

  def _warn_files_without_documents(self) -> None:
    """One warning per non-empty file that adds no document: it holds no EOS.

    Read from the packings (cached or not), so the warning comes at every start.
    """
    for group, p in zip(self.groups, self.packings):
      docs_per_file = np.bincount(np.asarray(p.file), minlength=len(group))
      for k in np.flatnonzero(docs_per_file == 0):
        file = self.files[group[k]]
        if file.num_tokens:
          logging.warning('%s: its %d tokens hold no %s, so they form no document and are '
                          'never trained on (as in OLMo-core). Check cfg.data.eos_token_id, or '
                          'the file.', file.path, file.num_tokens, self._eos_name())

  @classmethod
  def from_config(cls, cfg_data: Any, cache_dir: str | None = None) -> 'PackedDataset':
    """The training set of cfg.data as OLMo-core's NumpyPackedFSLDatasetConfig builds it."""
    paths, labels, sizes, source = token_files.config_sources(cfg_data)
    return cls(paths, seq_len=cfg_data.seq_len, vocab_size=cfg_data.vocab_size,
               eos_token_id=cfg_data.eos_token_id, pad_token_id=cfg_data.pad_token_id,
               bos_token_id=cfg_data.bos_token_id,
               long_doc_strategy=cfg_data.long_doc_strategy,
               source_group_size=cfg_data.source_group_size,
               stable_packing=cfg_data.stable_packing, labels=labels,
               listed_sizes=sizes, cache_dir=cache_dir, source=source,
               remote_cache_dir=cfg_data.get('remote_cache_dir', ''))

  @property
  def fingerprint_fields(self) -> dict[str, Any]:
    """OLMo-core NumpyPackedFSLDataset.fingerprint_fields, in its order.

    source_group_size enters only when > 1 (OLMo-core's backwards compatibility);
    use_array_if_local is never set here (document ends come from the arrays).
    """
    fields = {'vocab_size': self.vocab_size, 'pad_token_id': self.pad_token_id,
              'eos_token_id': self.eos_token_id, 'dtype': str(np.uint32),
              'long_doc_strategy': self.long_doc_strategy, 'bos_token_id': self.bos_token_id,
              'sequence_length': self.seq_len}
    if self.source_group_size > 1:
      fields['source_group_size'] = self.source_group_size
    return fields

  @property
  def fingerprint(self) -> str:
    """OLMo-core `NumpyDatasetBase.fingerprint` for a `NumpyPackedFSLDataset` (sha256 hex).

    stable_packing is not in it: Ai2's own packing already varies by machine
    while its fingerprint does not; the loader state records it instead.
    """
    return token_files.fingerprint('NumpyPackedFSLDataset', self.fingerprint_fields, self.files)

  def _cache_path(self, g: int) -> str | None:
    """Group g's cache file: named by everything that decides its packing."""
    if not self.cache_dir:
      return None
    h = hashlib.sha256(f'{_PACK_VERSION},{self.seq_len},{self.long_doc_strategy},'
                       f'{self.eos_token_id},{self.bos_token_id},{self.stable_packing},'.encode())
    for f in self.groups[g]:
      file = self.files[f]
      # A rewritten file changes its size or fingerprint (mtime): a new name.
      h.update(f'{storage.fingerprint(file.path)},{file.size},{file.header},'.encode())
    return os.path.join(self.cache_dir, f'packed_T{self.seq_len}_{h.hexdigest()[:40]}.bin')

  def _packing(self, g: int) -> _Packing:
    """Group g's packing: from its verified cache file, else packed now (and cached)."""
    path = self._cache_path(g)
    if path and os.path.exists(path):
      cached = self._verified_packing(path, g)
      if cached is not None:
        return cached
    packing = self._pack(g)
    if not path:
      return packing
    os.makedirs(self.cache_dir, exist_ok=True)
    token_files.write_checksummed(path, packing.flat())
    return _Packing.from_flat(np.memmap(path, dtype=np.int64, mode='r'))

  def _pack(self, g: int) -> _Packing:
    """Finds every document of group g's files and packs them (OLMo-core
    pack_documents_into_instances: the group's files read as one stream)."""
    files, starts, ends = [], [], []
    for k, f in enumerate(self.groups[g]):
      tokens = self.maps.sequential(f)  # a map of its own (read-ahead), or remote chunks
      e = document_ends(tokens, self.eos_token_id, self.bos_token_id)
      del tokens
      # Each document starts where the previous one ended; a file with no end has none, as in
      # OLMo-core: its tokens are never trained on (__init__ warns).
      s = np.concatenate([[0], e])[:-1].astype(np.int64)
      s, e = cap_documents(s, e, self.seq_len, self.long_doc_strategy)
      files.append(np.full(s.size, k, np.int64))
      starts.append(s)
      ends.append(e)
    file, start = np.concatenate(files), np.concatenate(starts)
    length = np.concatenate(ends) - start
    docs, offsets = pack_documents(length, self.seq_len, self.stable_packing)
    logging.info('Packed %d documents of %s into %d instances of %d tokens (%.1f%% padding).',
                 length.size, [self.files[f].path for f in self.groups[g]], offsets.size - 1,
                 self.seq_len, 100 * (1 - length.sum() / max(1, self.seq_len * (offsets.size - 1))))
    return _Packing(offsets, file[docs], start[docs], length[docs])

  def _verified_packing(self, path: str, g: int) -> _Packing | None:
    """The cached packing if its checksum and shape hold; else None, with a warning."""
    flat = np.memmap(path, dtype=np.int64, mode='r') if os.path.getsize(path) % 8 == 0 else None
    if flat is None or flat.size < 2:
      problem = 'it is not a whole number of int64 entries'
    else:
      problem = token_files.checksum_problem(path, flat)
    if problem is None:
      p = _Packing.from_flat(flat)
      sizes = np.array([self.files[f].num_tokens for f in self.groups[g]], np.int64)
      ok = (p.offsets.size >= 1 and p.offsets[0] == 0 and p.offsets[-1] == p.length.size
            and (np.diff(p.offsets) > 0).all() and 3 * p.length.size + p.offsets.size + 1
            == flat.size)
      if ok and p.length.size:
        ok = ((p.length >= 1).all() and (p.length <= self.seq_len).all()
              and (p.file >= 0).all() and (p.file < sizes.size).all() and (p.start >= 0).all()
              and (p.start + p.length <= sizes[p.file]).all()
              and (np.add.reduceat(p.length, p.offsets[:-1]) <= self.seq_len).all())
      if ok:
        return p
      problem = 'its index does not describe instances of these files'
    logging.warning('Packing cache %s is unusable (%s); packing again.', path, problem)
    return None

  def instance_documents(self, i: int) -> list[tuple[int, int, int]]:
    """(file, start, length) of each document of instance i, in order."""
    g = int(np.searchsorted(self.starts, i, side='right')) - 1
    p, first = self.packings[g], self.groups[g][0]
    a, b = p.offsets[i - self.starts[g]], p.offsets[i - self.starts[g] + 1]
    return [(first + f, s, n) for f, s, n in zip(p.file[a:b].tolist(), p.start[a:b].tolist(),
                                                  p.length[a:b].tolist())]

  def read_with_lengths(self, ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n, T] of instances `ids`, real tokens [n]): the rest is padding."""
    ids = np.asarray(ids, np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
      raise IndexError(f'instance ids must lie in [0, {self.num_instances}); got '
                       f'[{ids.min()}, {ids.max()}].')
    docs = [self.instance_documents(int(i)) for i in ids]
    # Every document's read is in flight before any is copied (page faults, or remote requests).
    pieces = iter(self.maps.read_many([d for row in docs for d in row]))
    tokens_nT = np.full((ids.size, self.seq_len), self.pad_token_id, np.int32)
    raw_nT = tokens_nT.view(np.uint32)
    real_n = np.zeros(ids.size, np.int64)
    for k, row in enumerate(docs):
      at = 0
      for f, s, n in row:
        piece = next(pieces)
        if piece.max() >= self.vocab_size:
          t = int(np.argmax(piece >= self.vocab_size))
          raise token_files.vocab_error(self.files[f].path, piece[t], s + t, self.vocab_size)
        raw_nT[k, at:at + n] = piece
        at += n
      real_n[k] = at
    return tokens_nT, real_n

  def read(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens of instances `ids` as int32 [n, T], padded with pad_token_id."""
    return self.read_with_lengths(ids)[0]

  def check_tokens(self, chunk_tokens: int = 1 << 24) -> None:
    """Scans every token of every file against vocab_size (a full read; use offline)."""
    token_files.check_tokens(self.maps, self.vocab_size, chunk_tokens)
