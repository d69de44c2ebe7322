"""Token data: OLMo-core's numpy fixed-sequence-length dataset and loader.

Given the same token files, mix and seed, the batch for step k is the one
OLMo-core's `NumpyFSLDataset` + `NumpyFSLDataLoader` produced at that step,
instance for instance (docs/data.md):

  files   raw little-endian uint32 tokens, read by memory map; file f gives
          n_f = tokens_f // T instances (remainder dropped) and owns the global
          ids [sum_{g<f} n_g, sum_{g<=f} n_g), files in mix order.
  order   epoch e (from 1): PCG64(seed + e) shuffle of arange(N, uint32), cached
          on disk under OLMo-core's file name and memory mapped.
  batch   step b of an epoch (0-based) is order[b*B:(b+1)*B]; the tail is dropped.
  ranks   OLMo-core data-parallel rank r of W takes batch positions r, r+W, ...

The batch for a step is a pure function of (dataset, seed, epoch, step), so
resuming needs only that tuple (plus the fingerprint, to refuse changed data).

Stage 3 swaps the instances for OLMo-core's `NumpyPackedFSLDataset`
(PackedDataset, cfg.data.dataset='packed'): whole documents packed
best-fit-decreasing into instances of T, padded; the order, batches and ranks
above apply unchanged to its instance ids.

Glossary: N instances in the dataset, B global batch (instances), T sequence
length, n instances read, W data-parallel batch shards (devices that split the
batch); in the repetition filter L = T - p for period p, R rows left to check.
"""

import collections
import dataclasses
import functools
import hashlib
import mmap
import os
import queue
import random
import threading
import uuid
from typing import Any, Iterator, NamedTuple, Sequence

from absl import logging
import jax
import numpy as np
import xxhash

IGNORE_INDEX = -100  # OLMo-core get_labels: label_ignore_index
FINGERPRINT_VERSION = 'v2.0'  # OLMo-core NumpyDatasetBase.fingerprint_version
_TOKEN_DTYPE = np.dtype('<u4')  # OLMo-core NumpyDatasetDType.uint32, little-endian on disk
_NPY_MAGIC = b'\x93NUMPY'  # as a uint32 token this is 1.3e9, far above any vocab
_MAX_OPEN_MAPS = 128  # each map holds a file descriptor; 951 stage-1 files exceed ulimit 1024
_SAMPLE_HEAD = 1 << 16  # tokens check_sample reads from the start of each file,
_SAMPLE_CHUNKS, _SAMPLE_CHUNK = 4, 1 << 12  # and chunks of tokens spread over the rest
_INT64_EVIDENCE = 16  # nonzero low words before a file with zero high words is called int64
_STRAY_IDS_TOLERATED = 1  # out-of-vocabulary ids in a sample left for Dataset.read to report
_CHECKSUM_SUFFIX = '.xxh3'  # beside each cached permutation: its xxh3-64 hex digest


# ----------------------------------------------------------------------------
# Files and mixes.


def read_mix(mix_file: str, *, base_dir: str = '', tokenizer_id: str = '',
             path_remap: Sequence[str] = ()) -> tuple[list[str], list[str], list[int | None]]:
  """Parses an OLMo-core mix file into (paths, labels, listed sizes).

  Lines are `label,path` (OLMo-core `DataMix.build`), or `label,path,bytes` where
  our own manifests (scripts/prepare_data.py) list each file's size; `#` starts
  a comment. `{TOKENIZER}` becomes `tokenizer_id`; relative paths are joined to
  `base_dir`; then `path_remap` ('PREFIX=REPLACEMENT' strings) rewrites
  URL-like prefixes to local mirrors.
  """
  if not os.path.isfile(mix_file):
    raise FileNotFoundError(f'mix file {mix_file!r} does not exist; set cfg.data.mix_file to a '
                            'file of `label,path` lines (like olmo_core/data/mixes/*.txt).')
  paths, labels, sizes = [], [], []
  with open(mix_file) as f:
    for line_no, line in enumerate(f, 1):
      line = line.strip()
      if not line or line.startswith('#'):
        continue
      fields = line.split(',')
      if len(fields) not in (2, 3) or not fields[1]:
        raise ValueError(f'{mix_file}:{line_no}: expected `label,path` or `label,path,bytes`, '
                         f'got {line!r}')
      if len(fields) == 3 and not fields[2].isdigit():
        raise ValueError(f'{mix_file}:{line_no}: size {fields[2]!r} is not a byte count')
      path = fields[1].replace('{TOKENIZER}', tokenizer_id)
      if base_dir and '://' not in path and not os.path.isabs(path):
        path = base_dir.rstrip('/') + '/' + path  # OLMo-core DataMix.build: f'{base_dir}/{path}'
      paths.append(remap_path(path, path_remap))
      labels.append(fields[0])
      sizes.append(int(fields[2]) if len(fields) == 3 else None)
  if not paths:
    raise ValueError(f'mix file {mix_file!r} lists no token files (only blanks or comments).')
  return paths, labels, sizes


def remap_path(path: str, path_remap: Sequence[str]) -> str:
  """Rewrites the first matching 'PREFIX=REPLACEMENT' prefix of `path`."""
  for rule in path_remap:
    prefix, sep, replacement = rule.partition('=')
    if not sep or not prefix:
      raise ValueError(f'path_remap entry {rule!r} must look like PREFIX=REPLACEMENT, '
                       "e.g. 's3://ai2-llm/=/data/ai2-llm/'.")
    if path.startswith(prefix):
      return replacement + path[len(prefix):]
  return path


def source_order(num_files: int, seed: int | None) -> list[int]:
  """The file order OLMo-core trains on for `source_permutation_seed` (None: mix order).

  OLMo-core NumpyDatasetConfig._resolve_paths_metadata shuffles the file list
  (and its labels) with Python's `random.Random(seed).shuffle` before building
  the dataset, so groups and instance ids follow the shuffled order.
  """
  order = list(range(num_files))
  if seed is not None:
    random.Random(seed).shuffle(order)
  return order


def config_sources(cfg_data: Any, paths: Sequence[str] | None = None
                   ) -> tuple[list[str], list[str] | None, list[int | None] | None, str]:
  """(paths, labels, listed sizes, what to call them) for cfg.data; `paths` overrides it.

  The training set (no `paths`) is put in cfg.data.source_permutation_seed's
  order; explicit `paths` (held-out sets) keep theirs.
  """
  base_dir = cfg_data.base_dir
  remap = tuple(cfg_data.get('path_remap', ()))
  labels = sizes = None
  training = paths is None
  if training and cfg_data.mix_file:
    if cfg_data.paths:
      raise ValueError('cfg.data.mix_file and cfg.data.paths are both set; keep one.')
    paths, labels, sizes = read_mix(cfg_data.mix_file, base_dir=base_dir,
                                    tokenizer_id=cfg_data.tokenizer_id, path_remap=remap)
    source = f'mix file {cfg_data.mix_file}'
  else:
    if training and not cfg_data.paths:
      raise ValueError('No training data configured: cfg.data.mix_file and cfg.data.paths are '
                       'both empty. Set --config.data.mix_file=MIX_FILE (label,path lines; '
                       'relative paths resolve against --config.data.base_dir=ROOT) or '
                       '--config.data.paths=FILE[,FILE...] (uint32 token files); see '
                       'docs/data.md.')
    source = 'cfg.data.paths' if training else 'paths'
    paths = [remap_path(p if ('://' in p or os.path.isabs(p) or not base_dir)
                        else os.path.join(base_dir, p), remap)
             for p in (cfg_data.paths if training else paths)]
  seed = cfg_data.get('source_permutation_seed', None)
  if training and seed is not None:
    order = source_order(len(paths), seed)
    paths = [paths[i] for i in order]
    labels = labels and [labels[i] for i in order]
    sizes = sizes and [sizes[i] for i in order]
  return paths, labels, sizes, source


@dataclasses.dataclass(frozen=True)
class TokenFile:
  """One token file: its path, size in bytes, header bytes and token count."""
  path: str
  size: int  # bytes on disk: what OLMo-core's fingerprint hashes
  header: int  # 0 for OLMo-core's raw files; the .npy header length otherwise
  num_tokens: int
  label: str = ''


def inspect_file(path: str, label: str = '', listed_size: int | None = None,
                 vocab_size: int | None = None) -> TokenFile:
  """Stats and validates one token file (raw uint32, or a true .npy of uint32).

  Beyond its size and header, a bounded sample of its tokens must look like
  uint32 ids (and, given `vocab_size`, lie in the vocabulary): see check_sample.
  """
  file = _layout(path, label, listed_size)
  check_sample(file, vocab_size)
  return file


def _layout(path: str, label: str, listed_size: int | None) -> TokenFile:
  """The file's size, header and token count, from its stat and .npy header."""
  if '://' in path:
    raise FileNotFoundError(f'{path}: remote paths are not read directly; mirror the files locally '
                            "and map the prefix with cfg.data.path_remap ('s3://bucket/=/local/').")
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: token file does not exist (check cfg.data.base_dir, '
                            'cfg.data.path_remap and the {TOKENIZER} id).')
  size = os.path.getsize(path)
  if listed_size is not None and size != listed_size:
    what = 'shorter' if size < listed_size else 'longer'
    raise ValueError(f'{path}: file is {size} bytes, {what} than the {listed_size} bytes its mix '
                     'lists; it was truncated or replaced. Re-copy it or regenerate the mix.')
  with open(path, 'rb') as f:
    is_npy = f.read(len(_NPY_MAGIC)) == _NPY_MAGIC
    if is_npy:
      f.seek(0)
      version = np.lib.format.read_magic(f)
      read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                     else np.lib.format.read_array_header_2_0)
      shape, _, dtype = read_header(f)
      header = f.tell()
  if not is_npy:
    if size % _TOKEN_DTYPE.itemsize:
      raise ValueError(f'{path}: size {size} bytes is not a multiple of 4, so it is not a uint32 '
                       'token file (truncated copy, or a uint16/uint8 file?).')
    return TokenFile(path, size, 0, size // _TOKEN_DTYPE.itemsize, label)
  if dtype != _TOKEN_DTYPE or len(shape) != 1:
    raise ValueError(f'{path}: .npy holds {dtype} of shape {shape}; expected 1-D little-endian '
                     'uint32 tokens. Re-tokenize with scripts/prepare_data.py, or save the ids '
                     'with np.save(path, ids.astype(np.uint32)).')
  if size - header != shape[0] * _TOKEN_DTYPE.itemsize:
    raise ValueError(f'{path}: .npy header says {shape[0]} tokens but the file holds '
                     f'{(size - header) // 4}; the file is truncated.')
  return TokenFile(path, size, header, shape[0], label)


def check_sample(file: TokenFile, vocab_size: int | None = None) -> None:
  """Refuses a file whose sampled tokens are not plausible uint32 ids.

  An int64 file read as uint32 has a zero in every second word (ids < 2^32,
  little-endian); real text never does once a few dozen ids are nonzero, so
  a tiny file is judged too. Other misreadings (uint16, big-endian, another
  tokenizer) put ids past the vocabulary everywhere. One stray id is left to
  Dataset.read, which names it if its instance is ever read.
  """
  chunks = _sample(file)
  tokens = np.concatenate([c for _, c in chunks])
  words = tokens[:tokens.size // 2 * 2].reshape(-1, 2)  # chunks start at even offsets
  if np.count_nonzero(words[:, 0]) >= _INT64_EVIDENCE and not words[:, 1].any():
    raise ValueError(f'{file.path}: every second 32-bit word of the {tokens.size} sampled tokens '
                     'is 0: this looks like int64 little-endian ids, not uint32 tokens. '
                     'Re-tokenize to uint32 with scripts/prepare_data.py, or convert it with '
                     'np.fromfile(path, np.int64).astype(np.uint32).tofile(new_path).')
  if vocab_size is None:
    return
  stray = [(start + i, int(c[i])) for start, c in chunks for i in np.flatnonzero(c >= vocab_size)]
  if len(stray) > _STRAY_IDS_TOLERATED:
    (offset, token), hint = stray[0], _misreading(tokens, vocab_size)
    raise _vocab_error(file.path, token, offset, vocab_size,
                       f'so are {len(stray) - 1} more of the {tokens.size} tokens sampled: {hint}')


def _sample(file: TokenFile) -> list[tuple[int, np.ndarray]]:
  """(token offset, tokens) of the file's head and of a few chunks spread over the rest.

  A bounded read (~320 KiB): stage 1 has ~950 files of several GB each. Offsets
  and lengths are even, so 32-bit words pair up as an int64 file's would.
  """
  with open(file.path, 'rb') as f:

    def read(start: int, count: int) -> tuple[int, np.ndarray]:
      f.seek(file.header + _TOKEN_DTYPE.itemsize * start)
      return start, np.fromfile(f, _TOKEN_DTYPE, count)

    if file.num_tokens <= _SAMPLE_HEAD + _SAMPLE_CHUNKS * _SAMPLE_CHUNK:
      return [read(0, file.num_tokens)]
    stride = (file.num_tokens - _SAMPLE_HEAD) // _SAMPLE_CHUNKS // 2 * 2  # >= _SAMPLE_CHUNK
    return [read(0, _SAMPLE_HEAD)] + [read(_SAMPLE_HEAD + k * stride, _SAMPLE_CHUNK)
                                      for k in range(_SAMPLE_CHUNKS)]


def _misreading(tokens: np.ndarray, vocab_size: int) -> str:
  """What out-of-vocabulary uint32 tokens most likely are, read another way."""
  swapped = tokens.byteswap()
  if not tokens[::2].any() and (swapped < vocab_size).all():
    return 'they look like int64 big-endian ids'
  if (swapped < vocab_size).all():
    return 'they look like big-endian uint32 ids'
  if (tokens.view('<u2') < vocab_size).all():
    return 'they look like uint16 ids'
  return 'the file was made with another tokenizer (a larger vocabulary) or is corrupt'


def _vocab_error(path: str, token: int, offset: int, vocab_size: int, why: str) -> ValueError:
  return ValueError(f'{path}: token id {token} at token offset {offset} is >= vocab_size '
                    f'{vocab_size}; {why}. Check cfg.data.vocab_size, or re-tokenize to uint32 '
                    'with scripts/prepare_data.py.')


# ----------------------------------------------------------------------------
# The dataset.


def _fingerprint(class_name: str, fields: dict[str, Any], files: Sequence[TokenFile]) -> str:
  """OLMo-core `NumpyDatasetBase.fingerprint`: sha256 of the class, fields, base names and sizes."""
  h = hashlib.sha256(f'class={class_name}'.encode())
  for name, value in fields.items():
    h.update(f'{name}={value},'.encode())
  for f in files:
    h.update(f'path={os.path.basename(f.path)},size={f.size},'.encode())
  return h.hexdigest()


class Dataset:
  """OLMo-core's `NumpyFSLDataset` over uint32 token files: instance i as int32 [T]."""

  def __init__(self, paths: Sequence[str], *, seq_len: int, vocab_size: int, eos_token_id: int,
               pad_token_id: int, bos_token_id: int | None = None,
               max_target_sequence_length: int | None = -1, labels: Sequence[str] | None = None,
               listed_sizes: Sequence[int | None] | None = None, source: str = 'cfg.data.paths'):
    """Builds the dataset; `max_target_sequence_length=-1` means seq_len (Ai2's setting)."""
    if not paths:
      raise ValueError(f'{source} is empty: the dataset needs at least one token file.')
    if seq_len <= 0:
      raise ValueError(f'seq_len must be positive, got {seq_len}.')
    if max_target_sequence_length == -1:
      max_target_sequence_length = seq_len  # pretrain-1 sets it to seq_len (in the fingerprint)
    if max_target_sequence_length not in (None, seq_len):
      raise ValueError(f'max_target_sequence_length={max_target_sequence_length} != seq_len='
                       f"{seq_len}: OLMo-core's sequence-length warm-up chunking is not supported; "
                       'use None or seq_len.')
    labels = labels or [''] * len(paths)
    listed_sizes = listed_sizes or [None] * len(paths)
    self.files = tuple(inspect_file(p, l, s, vocab_size)
                       for p, l, s in zip(paths, labels, listed_sizes))
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
      raise ValueError(f'seq_len {seq_len} is larger than every file in {source}; the longest, '
                       f'{longest.path}, has {longest.num_tokens} tokens. Lower seq_len or add '
                       'data.')
    if self.num_instances >= np.iinfo(np.uint32).max:
      raise ValueError(f'{self.num_instances} instances do not fit OLMo-core\'s uint32 order.')
    self._maps: collections.OrderedDict[int, tuple[mmap.mmap, np.ndarray]]
    self._maps = collections.OrderedDict()
    self._lock = threading.Lock()

  @classmethod
  def from_config(cls, cfg_data: Any, paths: Sequence[str] | None = None) -> 'Dataset':
    """Builds the training set from cfg.data (mix_file or paths); `paths` overrides both."""
    paths, labels, sizes, source = config_sources(cfg_data, paths)
    return cls(paths, seq_len=cfg_data.seq_len, vocab_size=cfg_data.vocab_size,
               eos_token_id=cfg_data.eos_token_id, pad_token_id=cfg_data.pad_token_id,
               bos_token_id=cfg_data.get('bos_token_id', None),
               max_target_sequence_length=cfg_data.get('max_target_sequence_length', -1),
               labels=labels, listed_sizes=sizes, source=source)

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
    return _fingerprint('NumpyFSLDataset', self.fingerprint_fields, self.files)

  def _map(self, f: int) -> tuple[mmap.mmap, np.ndarray]:
    """File f's mmap and its tokens as a uint32 array view (least-recently-used cache)."""
    with self._lock:
      if f in self._maps:
        self._maps.move_to_end(f)
        return self._maps[f]
      file = self.files[f]
      with open(file.path, 'rb') as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
      # Instances are read at random: no fault read-around (which costs ~5 ms per instance on
      # sparse or cold files here); read() asks for each instance's bytes with MADV_WILLNEED.
      mm.madvise(mmap.MADV_RANDOM)
      self._maps[f] = (mm, np.frombuffer(mm, _TOKEN_DTYPE, file.num_tokens, file.header))
      if len(self._maps) > _MAX_OPEN_MAPS:
        self._maps.popitem(last=False)  # unmapped once no batch still views it
      return self._maps[f]

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
    order = np.argsort(file_of, kind='stable')  # file by file
    page = mmap.PAGESIZE
    for k in order:  # first queue every instance's read, so the kernel has them all in flight
      mm, _ = self._map(int(file_of[k]))
      begin = (self.files[file_of[k]].header + 4 * int(start_n[k])) // page * page
      mm.madvise(mmap.MADV_WILLNEED, begin, min(len(mm), self.files[file_of[k]].header
                                                + 4 * (int(start_n[k]) + T)) - begin)
    for k in order:
      raw_nT[k] = self._map(int(file_of[k]))[1][start_n[k]:start_n[k] + T]
    if raw_nT.size and raw_nT.max() >= self.vocab_size:
      k, t = np.argwhere(raw_nT >= self.vocab_size)[0]
      raise _vocab_error(self.files[file_of[k]].path, raw_nT[k, t], start_n[k] + t,
                         self.vocab_size, 'the file was made with another tokenizer or is corrupt')
    return tokens_nT

  def check_tokens(self, chunk_tokens: int = 1 << 24) -> None:
    """Scans every token of every file against vocab_size (a full read; use offline)."""
    for f, file in enumerate(self.files):
      if file.num_tokens == 0:
        continue
      _, mm = self._map(f)
      for start in range(0, file.num_tokens, chunk_tokens):
        chunk = mm[start:start + chunk_tokens]
        if chunk.size and chunk.max() >= self.vocab_size:
          t = int(np.argmax(chunk >= self.vocab_size))
          raise _vocab_error(file.path, chunk[t], start + t, self.vocab_size,
                             'the file was made with another tokenizer or is corrupt')


# ----------------------------------------------------------------------------
# The packed dataset (stage 3): OLMo-core's NumpyPackedFSLDataset.

LONG_DOC_STRATEGIES = ('truncate', 'fragment')  # OLMo-core LongDocStrategy values
_SCAN_CHUNK = 1 << 24  # tokens read at a time while finding document ends (64 MiB)
_PACK_VERSION = 'v1'  # part of every packing cache name: tick if the packing or layout changes


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
    raise ValueError(f'document lengths must lie in [1, {seq_len}]; got [{lengths.min()}, '
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

  _map = Dataset._map  # the same LRU of read-only file maps (uses files, _maps, _lock)
  check_tokens = Dataset.check_tokens

  def __init__(self, paths: Sequence[str], *, seq_len: int, vocab_size: int, eos_token_id: int,
               pad_token_id: int, bos_token_id: int | None = None,
               long_doc_strategy: str = 'truncate', source_group_size: int = 1,
               stable_packing: bool = False, source_permutation_seed: int | None = None,
               labels: Sequence[str] | None = None,
               listed_sizes: Sequence[int | None] | None = None, cache_dir: str | None = None,
               source: str = 'cfg.data.paths'):
    """Packs (or loads the cached packing of) every group.

    `paths` are in mix order and shuffled by `source_permutation_seed` as
    OLMo-core's config does (from_config has done that already).
    """
    if not paths:
      raise ValueError(f'{source} is empty: the packed dataset needs at least one token file.')
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
      raise ValueError(f'seq_len must be a positive integer, got {seq_len!r}.')
    if long_doc_strategy not in LONG_DOC_STRATEGIES:
      raise ValueError(f'long_doc_strategy {long_doc_strategy!r} is not one of '
                       f'{LONG_DOC_STRATEGIES} (OLMo-core LongDocStrategy); set '
                       "cfg.data.long_doc_strategy='truncate' (Ai2's stage 3) or 'fragment'.")
    if (isinstance(source_group_size, bool) or not isinstance(source_group_size, int)
        or source_group_size < 1):
      raise ValueError(f'source_group_size must be an integer >= 1 (files packed together), got '
                       f'{source_group_size!r}; Ai2 stage 3 uses 8.')
    labels = labels or [''] * len(paths)
    listed_sizes = listed_sizes or [None] * len(paths)
    self.files = tuple(inspect_file(paths[i], labels[i], listed_sizes[i], vocab_size)
                       for i in source_order(len(paths), source_permutation_seed))
    self.seq_len, self.vocab_size = seq_len, vocab_size
    self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
    self.bos_token_id = bos_token_id
    self.long_doc_strategy, self.source_group_size = long_doc_strategy, source_group_size
    self.stable_packing, self.cache_dir = bool(stable_packing), cache_dir or None
    self.groups = [list(range(g, min(g + source_group_size, len(paths))))
                   for g in range(0, len(paths), source_group_size)]
    self._maps: collections.OrderedDict[int, tuple[mmap.mmap, np.ndarray]]
    self._maps = collections.OrderedDict()
    self._lock = threading.Lock()
    self.packings = [self._packing(g) for g in range(len(self.groups))]
    counts = [p.offsets.size - 1 for p in self.packings]
    self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # group g's first id
    self.num_instances = int(self.starts[-1])
    if self.num_instances == 0:
      raise ValueError(f'{source} holds no document: no file has an EOS (id {eos_token_id}'
                       + ('' if bos_token_id is None else f' followed by BOS {bos_token_id}')
                       + '), so nothing can be packed. Check cfg.data.eos_token_id and the files.')
    if self.num_instances >= np.iinfo(np.uint32).max:
      raise ValueError(f'{self.num_instances} instances do not fit OLMo-core\'s uint32 order.')

  @classmethod
  def from_config(cls, cfg_data: Any, cache_dir: str | None = None) -> 'PackedDataset':
    """The training set of cfg.data as OLMo-core's NumpyPackedFSLDatasetConfig builds it."""
    paths, labels, sizes, source = config_sources(cfg_data)
    return cls(paths, seq_len=cfg_data.seq_len, vocab_size=cfg_data.vocab_size,
               eos_token_id=cfg_data.eos_token_id, pad_token_id=cfg_data.pad_token_id,
               bos_token_id=cfg_data.get('bos_token_id', None),
               long_doc_strategy=cfg_data.get('long_doc_strategy', 'truncate'),
               source_group_size=cfg_data.get('source_group_size', 1),
               stable_packing=cfg_data.get('stable_packing', False), labels=labels,
               listed_sizes=sizes, cache_dir=cache_dir, source=source)

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
    return _fingerprint('NumpyPackedFSLDataset', self.fingerprint_fields, self.files)

  def _cache_path(self, g: int) -> str | None:
    """Group g's cache file: named by everything that decides its packing."""
    if not self.cache_dir:
      return None
    h = hashlib.sha256(f'{_PACK_VERSION},{self.seq_len},{self.long_doc_strategy},'
                       f'{self.eos_token_id},{self.bos_token_id},{self.stable_packing},'.encode())
    for f in self.groups[g]:
      file = self.files[f]
      stat = os.stat(file.path)  # a rewritten file changes its size or mtime: a new name
      h.update(f'{os.path.realpath(file.path)},{file.size},{stat.st_mtime_ns},'
               f'{file.header},'.encode())
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
    flat = packing.flat()
    _write_atomic(path, flat)  # the packing first: a reader never pairs a new sum with an old file
    _write_atomic(path + _CHECKSUM_SUFFIX, _checksum(flat).encode())
    return _Packing.from_flat(np.memmap(path, dtype=np.int64, mode='r'))

  def _pack(self, g: int) -> _Packing:
    """Finds every document of group g's files and packs them (OLMo-core
    pack_documents_into_instances: the group's files read as one stream)."""
    files, starts, ends = [], [], []
    for k, f in enumerate(self.groups[g]):
      file = self.files[f]
      tokens = (np.memmap(file.path, _TOKEN_DTYPE, 'r', file.header, (file.num_tokens,))
                if file.num_tokens else np.zeros(0, _TOKEN_DTYPE))
      e = document_ends(tokens, self.eos_token_id, self.bos_token_id)
      del tokens
      s, e = cap_documents(np.concatenate([[0], e[:-1]]).astype(np.int64), e, self.seq_len,
                           self.long_doc_strategy)
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
    try:
      with open(path + _CHECKSUM_SUFFIX) as f:
        expected = f.read().strip()
    except FileNotFoundError:
      expected = None
    problem = None
    if flat is None or flat.size < 2:
      problem = 'it is not a whole number of int64 entries'
    elif expected is None:
      problem = f'it has no checksum file {path + _CHECKSUM_SUFFIX} to verify it by'
    elif expected != _checksum(flat):
      problem = f'its contents fail the checksum in {path}{_CHECKSUM_SUFFIX}'
    else:
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

  def _instance_documents(self, i: int) -> list[tuple[int, int, int]]:
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
    docs = [self._instance_documents(int(i)) for i in ids]
    page = mmap.PAGESIZE
    for f, s, n in (d for row in docs for d in row):  # queue every read first (as Dataset.read)
      mm, _ = self._map(f)
      begin = (self.files[f].header + 4 * s) // page * page
      end = min(len(mm), self.files[f].header + 4 * (s + n))
      mm.madvise(mmap.MADV_WILLNEED, begin, end - begin)
    tokens_nT = np.full((ids.size, self.seq_len), self.pad_token_id, np.int32)
    raw_nT = tokens_nT.view(np.uint32)
    real_n = np.zeros(ids.size, np.int64)
    for k, row in enumerate(docs):
      at = 0
      for f, s, n in row:
        piece = self._map(f)[1][s:s + n]
        if piece.max() >= self.vocab_size:
          t = int(np.argmax(piece >= self.vocab_size))
          raise _vocab_error(self.files[f].path, piece[t], s + t, self.vocab_size,
                             'the file was made with another tokenizer or is corrupt')
        raw_nT[k, at:at + n] = piece
        at += n
      real_n[k] = at
    return tokens_nT, real_n

  def read(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens of instances `ids` as int32 [n, T], padded with pad_token_id."""
    return self.read_with_lengths(ids)[0]


def dataset_from_config(cfg_data: Any, cache_dir: str | None = None) -> Dataset | PackedDataset:
  """The training set cfg.data.dataset names: 'fsl' (stages 1-2) or 'packed' (stage 3).

  `cache_dir` holds the packed dataset's packing cache (the FSL dataset needs none).
  """
  kind = cfg_data.get('dataset', 'fsl')
  if kind == 'fsl':
    return Dataset.from_config(cfg_data)
  if kind == 'packed':
    return PackedDataset.from_config(cfg_data, cache_dir=cache_dir)
  raise ValueError(f"cfg.data.dataset={kind!r} is not 'fsl' (OLMo-core NumpyFSLDataset, stages "
                   "1-2) or 'packed' (NumpyPackedFSLDataset, stage 3).")


def wants_segments(cfg_data: Any) -> bool:
  """Whether batches carry segment_ids: data.document_masking, or OLMo-core's name for it,
  data.generate_doc_lengths (either turns intra-document attention masking on)."""
  return bool(cfg_data.get('document_masking', False)
              or cfg_data.get('generate_doc_lengths', False))


# ----------------------------------------------------------------------------
# Global order.


def _indices_file_name(num_instances: int, seed: int, epoch: int) -> str:
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
    raise ValueError(f'epochs count from 1 (OLMo-core reshuffle); got epoch={epoch}.')
  path = cache_dir and os.path.join(cache_dir, _indices_file_name(num_instances, seed, epoch))
  if path and os.path.exists(path):
    cached = _verified_cache(path, num_instances)
    if cached is not None:
      return cached
  order = np.arange(num_instances, dtype=np.uint32)
  np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(order)
  if not path:
    return order
  os.makedirs(cache_dir, exist_ok=True)
  _write_atomic(path, order)  # the order first: a reader never pairs a new sum with an old file
  _write_atomic(path + _CHECKSUM_SUFFIX, _checksum(order).encode())
  del order
  return np.memmap(path, dtype=np.uint32, mode='r', shape=(num_instances,))


def _checksum(order: np.ndarray) -> str:
  return xxhash.xxh3_64_hexdigest(order)


def _verified_cache(path: str, num_instances: int) -> np.ndarray | None:
  """The cached order, memory mapped, if its size and checksum hold; else None, with a warning."""
  size = os.path.getsize(path)
  if size != 4 * num_instances:
    problem = f'it is {size} bytes, not the {4 * num_instances} of {num_instances} uint32 ids'
  else:
    order = np.memmap(path, dtype=np.uint32, mode='r', shape=(num_instances,))
    try:
      with open(path + _CHECKSUM_SUFFIX) as f:
        expected = f.read().strip()
    except FileNotFoundError:
      expected = None
    if expected is None:
      problem = f'it has no checksum file {path + _CHECKSUM_SUFFIX} to verify it by'
    elif expected != _checksum(order):
      problem = f'its contents fail the checksum in {path}{_CHECKSUM_SUFFIX}'
    else:
      return order
  logging.warning('Permutation cache %s is unusable (%s); rebuilding it.', path, problem)
  return None


def _write_atomic(path: str, content: bytes | np.ndarray) -> None:
  """Writes `content` (an array's bytes, uncopied) to a temporary file, then renames it."""
  tmp = f'{path}.{uuid.uuid4().hex}.tmp'
  try:
    with open(tmp, 'wb') as f:
      f.write(content)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def batches_per_epoch(ds: Dataset, global_batch_size: int) -> int:
  """Full global batches in one epoch (OLMo-core NumpyFSLDataLoader.total_batches)."""
  if global_batch_size <= 0:
    raise ValueError(f'global_batch_size must be positive, got {global_batch_size}.')
  n = ds.num_instances // global_batch_size
  if n == 0:
    raise ValueError(f'global_batch_size {global_batch_size} exceeds the {ds.num_instances} '
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
# Data-parallel split and host sharding.


def batch_positions(global_batch_size: int, num_shards: int) -> np.ndarray:
  """Global-batch position held by each row of the batch array, for W batch shards.

  Contiguous row block s of the array (what JAX puts on batch shard s) holds
  positions s, s+W, s+2W, ...: exactly OLMo-core data-parallel rank s's
  instances, in its order (NumpyFSLDataLoader._get_local_instance_indices). The
  set of instances in a step never depends on W; only which device gets which.
  """
  if global_batch_size % num_shards:
    raise ValueError(f'global_batch_size {global_batch_size} is not divisible by the {num_shards} '
                     'devices that split the batch; use a multiple of the data-parallel size.')
  return np.arange(global_batch_size).reshape(-1, num_shards).T.reshape(-1)


def _row_slices(index_map: dict, global_batch_size: int) -> set[tuple[int, int]]:
  return {(s[0].start or 0, global_batch_size if s[0].stop is None else s[0].stop)
          for s in index_map.values()}


def num_batch_shards(sharding: jax.sharding.Sharding, global_batch_size: int,
                     seq_len: int = 1) -> int:
  """How many distinct row blocks the sharding splits a [B, T] batch into (W)."""
  return len(_row_slices(sharding.devices_indices_map((global_batch_size, seq_len)),
                         global_batch_size))


def local_rows(sharding: jax.sharding.Sharding, global_batch_size: int,
               seq_len: int = 1) -> np.ndarray:
  """Sorted rows of the [B, T] batch array that this process's devices hold."""
  blocks = _row_slices(sharding.addressable_devices_indices_map((global_batch_size, seq_len)),
                       global_batch_size)
  return np.unique(np.concatenate([np.arange(a, b) for a, b in blocks]))


def grad_accum_steps(global_batch_size: int, num_shards: int, micro_batch_size: int) -> int:
  """Micro-batches per step: B / W / micro_batch_size, with an error if it does not divide."""
  per_shard = global_batch_size // num_shards
  batch_positions(global_batch_size, num_shards)  # raises if W does not divide B
  if micro_batch_size <= 0 or per_shard % micro_batch_size:
    raise ValueError(f'{per_shard} instances per device (global batch {global_batch_size} / '
                     f'{num_shards} devices) is not a multiple of micro_batch_size '
                     f'{micro_batch_size}; pick cfg.train.micro_batch_size dividing it.')
  return per_shard // micro_batch_size


def make_global_batch(local_batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding,
                      rows: np.ndarray, global_batch_size: int) -> dict[str, jax.Array]:
  """Global jax.Arrays from only this process's rows (`rows` = local_rows(...), in order).

  `sharding` is the [B, T] batch sharding; [B] arrays use its first axis.
  """
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise ValueError(f'make_global_batch needs a NamedSharding, got {type(sharding).__name__}.')
  rows = np.asarray(rows)
  out = {}
  for key, local in local_batch.items():
    shape = (global_batch_size,) + local.shape[1:]
    spec = (tuple(sharding.spec) + (None,) * len(shape))[:len(shape)]
    arr_sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))

    def callback(index, local=local, key=key):
      want = np.arange(global_batch_size)[index[0]]
      pos = np.searchsorted(rows, want)
      if pos.size and (pos.max() >= rows.size or not np.array_equal(rows[pos], want)):
        raise ValueError(f'batch[{key!r}]: a local device needs rows this process did not load; '
                         'build `rows` with local_rows() from the same sharding.')
      return local[(pos,) + tuple(index[1:])]

    out[key] = jax.make_array_from_callback(shape, arr_sharding, callback)
  return out


# ----------------------------------------------------------------------------
# Labels, repetition filter, document boundaries.


class RepetitionFilter(NamedTuple):
  """OLMo-core InstanceFilterConfig defaults (the MaxText reproduction's setting)."""
  max_period: int = 13
  min_period: int = 1
  max_count: int = 32


def repetition_rejected(tokens_BT: np.ndarray,
                        rf: RepetitionFilter = RepetitionFilter()) -> np.ndarray:
  """bool [B]: True where OLMo-core's repetition filter rejects the instance.

  OLMo-core (`_validate_instance` over `find_periodic_sequences`) rejects when a
  run it reports for some period p in [min_period, min(max_period, T // 3)]
  repeats `times` >= max_count; it reports only runs with times > 2, where
  times = (L + p) // p for a maximal run of L positions t with x[t] == x[t-p].
  Its row-reshaping scan finds exactly those runs (every run with times > 2
  spans a whole aligned row; its padding keeps the wrap-around row from ever
  matching), so an instance is rejected iff for some p the matches x[t] ==
  x[t-p] hold on (max(max_count, 3) - 1) * p consecutive positions.
  """
  if rf.min_period < 1:
    raise ValueError(f'repetition filter min_period must be >= 1, got {rf.min_period}.')
  B, T = tokens_BT.shape
  rejected_B = np.zeros(B, bool)
  threshold = max(rf.max_count, 3)  # reported (times > 2) and times >= max_count
  for p in range(rf.min_period, min(rf.max_period, T // 3) + 1):
    need = (threshold - 1) * p  # (L + p) // p >= threshold  <=>  L >= need
    if need > T - p:
      continue
    eq_BL = tokens_BT[:, p:] == tokens_BT[:, :-p]
    rows = np.flatnonzero(np.count_nonzero(eq_BL, axis=1) >= need)  # cheap pre-check
    if rows.size:
      count_RL = np.zeros((rows.size, T - p + 1), np.int32)
      np.cumsum(eq_BL[rows], axis=1, out=count_RL[:, 1:])
      rejected_B[rows] |= (count_RL[:, need:] - count_RL[:, :-need] == need).any(axis=1)
  return rejected_B


def segment_ids(tokens_BT: np.ndarray, eos_token_id: int,
                bos_token_id: int | None = None) -> np.ndarray:
  """int32 [B, T] document index per token; the token that ends a document belongs to it.

  Matches OLMo-core get_document_lengths: documents end at each EOS, or with a
  BOS id at each EOS followed by a BOS. Padding after the last end is one more
  document (or, when PAD is EOS, one per pad token), as OLMo-core counts it.
  """
  if bos_token_id is None:
    end_BT = tokens_BT == eos_token_id
  else:
    end_BT = np.zeros(tokens_BT.shape, bool)
    end_BT[:, :-1] = (tokens_BT[:, :-1] == eos_token_id) & (tokens_BT[:, 1:] == bos_token_id)
  return (np.cumsum(end_BT, axis=1, dtype=np.int32) - end_BT).astype(np.int32)


def make_batch(tokens_BT: np.ndarray, *, eos_token_id: int,
               repetition_filter: RepetitionFilter | None = None,
               document_masking: bool = False, real_B: np.ndarray | None = None,
               bos_token_id: int | None = None) -> dict[str, np.ndarray]:
  """The batch dict (docs/data.md): tokens, labels, instance_mask[, segment_ids].

  Labels are the inputs shifted left with the last position ignored (OLMo-core
  get_labels). A rejected instance keeps its labels; `instance_mask` tells the
  loss to drop its terms while still counting them in the denominator. For
  packed instances, `real_B` counts each one's real tokens: labels that would
  predict padding are ignored (OLMo-core's label_mask).
  """
  labels_BT = np.empty_like(tokens_BT)
  labels_BT[:, :-1] = tokens_BT[:, 1:]
  labels_BT[:, -1] = IGNORE_INDEX
  if real_B is not None:
    labels_BT[np.arange(1, tokens_BT.shape[1] + 1)[None, :] >= np.asarray(real_B)[:, None]] = (
        IGNORE_INDEX)
  if repetition_filter is None:
    mask_B = np.ones(tokens_BT.shape[0], bool)
  else:
    mask_B = ~repetition_rejected(tokens_BT, repetition_filter)
  batch = {'tokens': tokens_BT, 'labels': labels_BT, 'instance_mask': mask_B}
  if document_masking:
    batch['segment_ids'] = segment_ids(tokens_BT, eos_token_id, bos_token_id)
  return batch


def validation_batches(ds: Dataset, batch_size: int, num_batches: int, *,
                       document_masking: bool = False) -> list[dict[str, np.ndarray]]:
  """Fixed held-out batches: instances 0, 1, ... in file order (no shuffle, no filter)."""
  n = min(num_batches, ds.num_instances // batch_size)
  if n == 0:
    raise ValueError(f'the validation set has {ds.num_instances} instances of length {ds.seq_len}, '
                     f'fewer than one batch of {batch_size}.')
  return [make_batch(ds.read(np.arange(b * batch_size, (b + 1) * batch_size)),
                     eos_token_id=ds.eos_token_id, document_masking=document_masking)
          for b in range(n)]


# ----------------------------------------------------------------------------
# Resume checks and the prefetching loader.


def check_resume(state: dict[str, Any], ds: Dataset, allow_changed: bool = False) -> None:
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
             'allow_changed=True (cfg.data.allow_data_change) to resume anyway.')
  if not allow_changed:
    raise ValueError(message)


_STATE_FIELDS = ('seed', 'epoch', 'step', 'global_batch_size')  # what a resume reads


def check_state_fields(state: Any) -> None:
  """Refuses a saved loader state that is not a dict with integer position fields."""
  fields = state if isinstance(state, dict) else {}
  bad = {k: fields.get(k) for k in _STATE_FIELDS
         if isinstance(fields.get(k), bool) or not isinstance(fields.get(k), (int, np.integer))}
  if bad:
    raise ValueError(f"the checkpoint's data state {state!r:.200} has no integer "
                     f"{', '.join(bad)}; its metadata was altered or was not "
                     'written by train.py. Restore the original metadata.json, or move that '
                     'step_N directory aside to resume from an earlier checkpoint.')


def check_position(state: dict[str, Any], ds: Dataset, steps_done: int, *,
                   allow_changed: bool = False) -> None:
  """Refuses a loader state that is not where `steps_done` optimizer steps lead.

  Each step takes one global batch and epochs have batches_per_epoch batches,
  so after k steps the loader is at epoch 1 + k // n, step k % n, whatever the
  device count. With allow_changed the data, and so n, may have changed at an
  earlier resume; past epoch 1 only `step < steps_done` is then certain.
  """
  n = batches_per_epoch(ds, state['global_batch_size'])
  epoch, step = state['epoch'], state['step']
  batches = (epoch - 1) * n + step
  if batches == steps_done or (allow_changed and epoch > 1 and step < steps_done):
    return
  raise ValueError(f"the checkpoint's data state is at epoch {epoch}, step {step} ({batches} "
                   f'global batches of {state["global_batch_size"]} at {n} per epoch), but the '
                   f'checkpoint records {steps_done} optimizer steps, one batch each; its '
                   'metadata was altered or its data state belongs to another run. Restore the '
                   'original metadata.json, or move that step_N directory aside to resume from '
                   'an earlier checkpoint.')


class Loader:
  """Iterator over global batches for (epoch, step), (epoch, step + 1), ...

  A background thread reads ahead `prefetch` batches. Each process reads only
  the rows its devices hold when a `sharding` (for [B, T]) is given and then
  yields global jax.Arrays; without one it yields the whole batch as numpy.
  After an epoch's last batch it continues with epoch + 1, step 0 (OLMo-core
  trainer behaviour), unless stop_at_epoch_end, which ends the iteration.
  """

  def __init__(self, ds: Dataset, *, seed: int, global_batch_size: int, epoch: int = 1,
               step: int = 0, cache_dir: str | None = None,
               sharding: jax.sharding.NamedSharding | None = None,
               repetition_filter: RepetitionFilter | None = None, document_masking: bool = False,
               prefetch: int = 2, stop_at_epoch_end: bool = False):
    self.ds, self.seed, self.global_batch_size = ds, seed, global_batch_size
    self.batches_per_epoch = batches_per_epoch(ds, global_batch_size)
    if epoch < 1 or not 0 <= step < self.batches_per_epoch:
      raise ValueError(f'start (epoch {epoch}, step {step}) is outside epochs >= 1 and steps '
                       f'[0, {self.batches_per_epoch}).')
    self.epoch, self.step = epoch, step  # the next batch to be yielded
    self.last_position: tuple[int, int] | None = None  # the last yielded batch's (epoch, step)
    self.cache_dir, self.sharding = cache_dir, sharding
    self.repetition_filter, self.document_masking = repetition_filter, document_masking
    self.stop_at_epoch_end = stop_at_epoch_end
    B, T = global_batch_size, ds.seq_len
    if sharding is None:
      self.rows = np.arange(B)
      self.positions = self.rows
    else:
      self.rows = local_rows(sharding, B, T)
      self.positions = batch_positions(B, num_batch_shards(sharding, B, T))[self.rows]
    self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  @classmethod
  def from_config(cls, cfg_data: Any, ds: Dataset, *, state: dict[str, Any] | None = None,
                  step: int | None = None, cache_dir: str | None = None,
                  sharding=None) -> 'Loader':
    """A loader for cfg.data, resuming from a saved `state` when given.

    `step` is the number of optimizer steps the checkpoint holding `state` had
    done; the state's position must be where that many global batches lead.
    """
    start = dict(epoch=1, step=0, seed=cfg_data.seed)
    if state is not None:
      allow_changed = cfg_data.get('allow_data_change', False)
      check_state_fields(state)
      check_resume(state, ds, allow_changed=allow_changed)
      if state['global_batch_size'] != cfg_data.global_batch_size:
        raise ValueError(f'the checkpoint was trained with global batch '
                         f'{state["global_batch_size"]}, cfg.data.global_batch_size is '
                         f'{cfg_data.global_batch_size}; steps would index different batches. '
                         'Keep the batch size when resuming.')
      if step is not None:
        check_position(state, ds, step, allow_changed=allow_changed)
      start = dict(epoch=state['epoch'], step=state['step'], seed=state['seed'])
    return cls(ds, global_batch_size=cfg_data.global_batch_size, cache_dir=cache_dir,
               sharding=sharding, document_masking=wants_segments(cfg_data),
               repetition_filter=RepetitionFilter() if cfg_data.repetition_filter else None,
               prefetch=cfg_data.prefetch, **start)

  def state(self) -> dict[str, Any]:
    """JSON-able position of the next batch plus what identifies the data."""
    return {'seed': self.seed, 'epoch': self.epoch, 'step': self.step,
            'global_batch_size': self.global_batch_size, 'seq_len': self.ds.seq_len,
            'num_instances': self.ds.num_instances, 'fingerprint': self.ds.fingerprint,
            'fingerprint_version': FINGERPRINT_VERSION, 'fields': self.ds.fingerprint_fields,
            'files': [[f.path, f.size] for f in self.ds.files],
            **({'stable_packing': self.ds.stable_packing}
               if isinstance(self.ds, PackedDataset) else {})}

  def _next_position(self, epoch: int, step: int) -> tuple[int, int] | None:
    if step + 1 < self.batches_per_epoch:
      return epoch, step + 1
    return None if self.stop_at_epoch_end else (epoch + 1, 0)

  def ids_at(self, epoch: int, step: int) -> np.ndarray:
    """Global instance ids of this process's rows for (epoch, step): what batch_at reads."""
    ids = global_batch_ids(self.ds, self.seed, epoch, step, self.global_batch_size, self.cache_dir)
    return ids[self.positions]

  def batch_at(self, epoch: int, step: int) -> dict[str, Any]:
    """This process's part of the batch for (epoch, step); global arrays if sharded."""
    ids = self.ids_at(epoch, step)
    if isinstance(self.ds, PackedDataset):  # padded instances: labels and segments of the padding
      tokens_BT, real_B = self.ds.read_with_lengths(ids)
      packed = dict(real_B=real_B, bos_token_id=self.ds.bos_token_id)
    else:
      tokens_BT, packed = self.ds.read(ids), {}
    batch = make_batch(tokens_BT, eos_token_id=self.ds.eos_token_id,
                       repetition_filter=self.repetition_filter,
                       document_masking=self.document_masking, **packed)
    if self.sharding is not None:
      batch = make_global_batch(batch, self.sharding, self.rows, self.global_batch_size)
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
