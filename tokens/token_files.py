"""Token files and mixes: what both datasets (data.Dataset, packed.PackedDataset) read.

Reading order:

  mixes        read_mix, read_mix_header, remap_path, source_order, config_sources:
               which files, in which order (OLMo-core DataMix.build, source
               permutation), and what a mix says about itself (its tokenizer, its
               held-out files).
  files        TokenFile, inspect_files, inspect_file, check_sample: a file's
               layout (raw little-endian uint32, or a true .npy of uint32) and a
               bounded plausibility check of its ids, for local files and, through
               tokens/remote_tokens.py, gs://, s3:// and http(s):// ones (inspected
               concurrently); vocab_error, the one message for an id past the
               vocabulary.
  maps         TokenMaps: the read-only memory maps the datasets read through;
               open_tokens: those, or remote_tokens.RemoteTokens for a mix with
               remote files (the same interface); check_tokens, the full scan.
  fingerprint  fingerprint, FINGERPRINT_VERSION: OLMo-core's dataset fingerprint.
  caches       write_atomic, checksum, write_checksummed, checksum_problem: the
               on-disk caches (the global order, the packings) and their xxh3
               sidecar files.

Glossary: n tokens in a file, V vocab size; a file's tokens are uint32 [n].
"""

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import mmap
import os
import random
import threading
import time
import uuid
from typing import Any, Sequence

from absl import logging
import numpy as np
import xxhash

from errors import DataError, MissingDataError
from store import storage
from tokens import remote_tokens

FINGERPRINT_VERSION = 'v2.0'  # OLMo-core NumpyDatasetBase.fingerprint_version
TOKEN_DTYPE = np.dtype('<u4')  # OLMo-core NumpyDatasetDType.uint32, little-endian on disk
CHECKSUM_SUFFIX = '.xxh3'  # beside each cache file: its xxh3-64 hex digest
_NPY_MAGIC = b'\x93NUMPY'  # as a uint32 token this is 1.3e9, far above any vocab
_MAX_OPEN_MAPS = 128  # each map holds a file descriptor; 951 stage-1 files exceed ulimit 1024
_SAMPLE_HEAD = 1 << 16  # tokens check_sample reads from the start of each file,
_SAMPLE_CHUNKS, _SAMPLE_CHUNK = 4, 1 << 12  # and chunks of tokens spread over the rest
_INT64_EVIDENCE = 16  # nonzero low words before a file with zero high words is called int64
_STRAY_IDS_TOLERATED = 1  # out-of-vocabulary ids in a sample left for Dataset.read to report
_HEAD_BYTES = 4096  # read to find a .npy header (numpy writes 128 bytes or a few times that)
_INSPECT_THREADS = 32  # remote files inspected at once


# ----------------------------------------------------------------------------
# Mixes.


def read_mix(mix_file: str, *, base_dir: str = '', tokenizer_id: str = '',
             path_remap: Sequence[str] = ()) -> tuple[list[str], list[str], list[int | None]]:
  """Parses an OLMo-core mix file into (paths, labels, listed sizes).

  Lines are `label,path` (OLMo-core `DataMix.build`), or `label,path,bytes` where
  our own manifests (scripts/prepare_data.py) list each file's size; `#` starts
  a comment (read_mix_header reads the structured ones). `{TOKENIZER}` becomes
  `tokenizer_id`; relative paths are joined to `base_dir` (left relative
  without one: fetch_data.py joins them to a URL); then `path_remap`
  ('PREFIX=REPLACEMENT' strings) rewrites URL-like prefixes to local mirrors.
  A config's mix (config_sources) defaults base_dir to the mix's own folder.
  """
  paths, labels, sizes = [], [], []
  for line_no, line in enumerate(mix_text(mix_file).splitlines(), 1):
    line = line.strip()
    if not line or line.startswith('#'):
      continue
    fields = line.split(',')
    if len(fields) not in (2, 3) or not fields[1]:
      raise DataError(f'{mix_file}:{line_no}: expected `label,path` or `label,path,bytes`, '
                      f'got {line!r}')
    if len(fields) == 3 and not fields[2].isdigit():
      raise DataError(f'{mix_file}:{line_no}: size {fields[2]!r} is not a byte count')
    path = fields[1].replace('{TOKENIZER}', tokenizer_id)
    path = storage.resolve(base_dir, path)  # OLMo-core DataMix.build: f'{base_dir}/{path}'
    paths.append(remap_path(path, path_remap))
    labels.append(fields[0])
    sizes.append(int(fields[2]) if len(fields) == 3 else None)
  if not paths:
    raise DataError(f'mix file {mix_file!r} lists no token files (only blanks or comments).')
  return paths, labels, sizes


def mix_text(mix_file: str) -> str:
  """A mix file's text (a local path or a URL); one line naming the fix when it is none."""
  mix_file = storage.canonical(mix_file, 'cfg.data.mix_file', writes=False)
  try:
    raw = storage.read(mix_file)
  except IsADirectoryError:
    raw = None
  except storage.StorageError as e:
    raise remote_tokens.error(mix_file, e, 'the mix file') from e
  if raw is None and storage.isdir(mix_file):
    mixes = [n for n in storage.listdir(mix_file) if n.endswith('.txt')]
    hint = f' (here: {storage.join(mix_file, mixes[0])})' if mixes else ''
    raise DataError(f'mix file {mix_file!r} is a folder; set cfg.data.mix_file to the mix file '
                    f'in it{hint}, a text file of `label,path` lines (scripts/prepare_data.py '
                    'writes one beside its token files), or name the token files instead: '
                    '--config.data.mix_file= --config.data.paths=\'("FILE", ...)\'.')
  if raw is None:
    raise MissingDataError(f'mix file {mix_file!r} does not exist; set cfg.data.mix_file to a '
                           'file of `label,path` lines (like olmo_core/data/mixes/*.txt).')
  try:
    if b'\0' in raw[:1 << 16]:
      raise UnicodeError('NUL bytes')
    return raw.decode()
  except UnicodeError:
    raise DataError(f'mix file {mix_file!r} is binary (a token file?); a mix is a text file of '
                    '`label,path` lines. Point cfg.data.mix_file at the mix (.txt) written with '
                    'the token files, or train on the file itself: --config.data.mix_file= '
                    f'--config.data.paths=\'("{mix_file}",)\'.') from None


def mix_base_dir(mix_file: str, base_dir: str = '') -> str:
  """The folder a config's mix entries are relative to: data.base_dir, else the mix's own
  (so a prepare_data.py mix works from any working directory; a URL's parent for a remote
  mix)."""
  return base_dir or storage.parent(mix_file)


def _join(base_dir: str, mix_file: str, path: str) -> str:
  """A header's path: URLs and absolute paths as they are, else under mix_base_dir."""
  return storage.resolve(mix_base_dir(mix_file, base_dir), path)


MIX_HEADER_KEYS = ('tokenizer', 'validation')  # `# KEY {json}` lines of a mix file


def read_mix_header(mix_file: str, *, base_dir: str = '') -> dict[str, Any]:
  """What a mix file says about itself, from its `# tokenizer {...}` and `# validation {...}`.

  scripts/prepare_data.py writes both:
    # tokenizer {"name": ..., "file": ..., "vocab_size": V, "eos_token_id": E,
    #            "pad_token_id": P, "bos_token_id": B or null}
    # validation {"files": [[path, bytes], ...], "documents": n}
  Returns {'tokenizer': dict or None, 'validation': [(path, bytes), ...]}, paths
  resolved as read_mix resolves its entries (the tokenizer's `file` too). A
  mix without them (OLMo-core's own) gives None and [].
  """
  header: dict[str, Any] = {}
  for line_no, line in enumerate(mix_text(mix_file).splitlines(), 1):
    key, _, rest = line.lstrip('#').strip().partition(' ')
    if not line.startswith('#') or key not in MIX_HEADER_KEYS:
      continue
    try:
      header[key] = json.loads(rest)
    except json.JSONDecodeError as e:
      raise DataError(f'{mix_file}:{line_no}: the `# {key}` line is not JSON ({e}); '
                      'rewrite the mix with scripts/prepare_data.py.') from e
  tokenizer = header.get('tokenizer')
  if tokenizer is not None and tokenizer.get('file'):
    tokenizer = dict(tokenizer, file=_join(base_dir, mix_file, tokenizer['file']))
  validation = [(_join(base_dir, mix_file, p), int(size))
                for p, size in header.get('validation', {}).get('files', [])]
  return {'tokenizer': tokenizer, 'validation': validation}


def remap_path(path: str, path_remap: Sequence[str]) -> str:
  """Rewrites the first matching 'PREFIX=REPLACEMENT' prefix of `path`."""
  for rule in path_remap:
    prefix, sep, replacement = rule.partition('=')
    if not sep or not prefix:
      raise DataError(f'path_remap entry {rule!r} must look like PREFIX=REPLACEMENT, '
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
  remap = tuple(cfg_data.path_remap)
  labels = sizes = None
  training = paths is None
  if training and cfg_data.mix_file:
    if cfg_data.paths:
      raise DataError(f'cfg.data.mix_file ({cfg_data.mix_file}) and cfg.data.paths are both set; '
                      'keep one: --config.data.mix_file= trains on data.paths, '
                      '--config.data.paths= on the mix.')
    paths, labels, sizes = read_mix(cfg_data.mix_file,
                                    base_dir=mix_base_dir(cfg_data.mix_file, base_dir),
                                    tokenizer_id=cfg_data.tokenizer_id, path_remap=remap)
    source = f'mix file {cfg_data.mix_file}'
  else:
    if training and not cfg_data.paths:
      raise DataError('No training data configured: cfg.data.mix_file and cfg.data.paths are '
                      'both empty. Set --config.data.mix_file=MIX_FILE (label,path lines; '
                      'relative paths resolve against --config.data.base_dir=ROOT) or '
                      '--config.data.paths=FILE[,FILE...] (uint32 token files); see '
                      'docs/data.md.')
    source = 'cfg.data.paths' if training else 'paths'
    paths = [remap_path(storage.resolve(base_dir, p), remap)
             for p in (cfg_data.paths if training else paths)]
  seed = cfg_data.source_permutation_seed
  if training and seed is not None:
    order = source_order(len(paths), seed)
    paths = [paths[i] for i in order]
    labels = labels and [labels[i] for i in order]
    sizes = sizes and [sizes[i] for i in order]
  return paths, labels, sizes, source


# ----------------------------------------------------------------------------
# Files.


def memory_mapped(path: str) -> bool:
  """Whether a token file is memory-mapped (a local or shared path) rather than read by byte
  range (a gs://, s3:// or http(s):// URL): the data path's one question about where
  bytes live; every other access goes through store/storage.py."""
  return storage.maps(path)


@dataclasses.dataclass(frozen=True)
class TokenFile:
  """One token file: its path, size in bytes, header bytes and token count."""
  path: str
  size: int  # bytes on disk: what OLMo-core's fingerprint hashes
  header: int  # 0 for OLMo-core's raw files; the .npy header length otherwise
  num_tokens: int
  label: str = ''


def inspect_files(paths: Sequence[str], labels: Sequence[str] | None = None,
                  listed_sizes: Sequence[int | None] | None = None,
                  vocab_size: int | None = None, *, cache_dir: str = '',
                  sample: bool = True) -> tuple[TokenFile, ...]:
  """inspect_file for each path, in order; remote files concurrently.

  The first remote file is inspected alone, so a wrong URL, missing credentials
  or a server without range requests fails once, not once per file; the rest
  run _INSPECT_THREADS at a time (each issuing its sample reads at once), so a
  mix of ~950 remote files is inspected in seconds. An error is the first
  failing file's in mix order. `cache_dir`: data.remote_cache_dir.
  """
  labels = labels or [''] * len(paths)
  listed_sizes = listed_sizes or [None] * len(paths)

  def one(i: int) -> TokenFile:
    return inspect_file(paths[i], labels[i], listed_sizes[i], vocab_size, cache_dir=cache_dir,
                        sample=sample)

  remote = [i for i, p in enumerate(paths) if not memory_mapped(p)]
  if not remote:
    return tuple(one(i) for i in range(len(paths)))
  start = time.time()
  done = {remote[0]: one(remote[0])}
  pool = concurrent.futures.ThreadPoolExecutor(min(_INSPECT_THREADS, len(remote)),
                                               thread_name_prefix='inspect')
  try:
    futures = {i: pool.submit(one, i) for i in remote[1:]}
    files = tuple(done[i] if i in done else futures[i].result() if i in futures else one(i)
                  for i in range(len(paths)))
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
  logging.info('Inspected %d remote token files (%s) in %.1f s.', len(remote),
               storage.describe(paths[remote[0]]), time.time() - start)
  return files


def inspect_file(path: str, label: str = '', listed_size: int | None = None,
                 vocab_size: int | None = None, *, cache_dir: str = '',
                 sample: bool = True) -> TokenFile:
  """Stats and validates one token file (raw uint32, or a true .npy of uint32).

  Beyond its size and header, a bounded sample of its tokens must look like
  uint32 ids (and, given `vocab_size`, lie in the vocabulary): see check_sample
  (skipped with sample=False). A gs://, s3:// or http(s):// path is read by byte
  range (tokens/remote_tokens.py; `cache_dir` keeps what it reads).
  """
  if memory_mapped(path):
    file = _layout(path, label, listed_size)
    if sample:
      check_sample(file, vocab_size)
    return file
  storage.canonical(path, 'a token file', writes=False)
  size = remote_tokens.probe(path, listed_size)
  if size is None:
    raise remote_tokens.missing_error(path)
  reader = remote_tokens.RangeReader(cache_dir)
  file = parse_layout(path, size, reader.read([(path, size, 0, min(size, _HEAD_BYTES))])[0],
                      label, listed_size)
  if sample:
    pieces = sample_pieces(file)
    raw = reader.read([(path, size, file.header + TOKEN_DTYPE.itemsize * start,
                        file.header + TOKEN_DTYPE.itemsize * (start + count))
                       for start, count in pieces])
    check_sample(file, vocab_size, [(start, np.frombuffer(r, TOKEN_DTYPE))
                                    for (start, _), r in zip(pieces, raw)])
  return file


def _layout(path: str, label: str, listed_size: int | None) -> TokenFile:
  """A local file's size, header and token count, from its stat and first bytes."""
  if not os.path.isfile(path):
    raise MissingDataError(f'{path}: token file does not exist (check cfg.data.base_dir, '
                           'cfg.data.path_remap and the {TOKENIZER} id).')
  with open(path, 'rb') as f:
    head = f.read(_HEAD_BYTES)
  return parse_layout(path, os.path.getsize(path), head, label, listed_size)


def parse_layout(path: str, size: int, head: bytes, label: str = '',
                 listed_size: int | None = None) -> TokenFile:
  """The TokenFile of a file of `size` bytes that starts with `head` (its first bytes)."""
  if listed_size is not None and size != listed_size:
    what = 'shorter' if size < listed_size else 'longer'
    raise DataError(f'{path}: file is {size} bytes, {what} than the {listed_size} bytes its mix '
                    'lists; it was truncated or replaced. Re-copy it or regenerate the mix.')
  if head[:len(_NPY_MAGIC)] != _NPY_MAGIC:
    if size % TOKEN_DTYPE.itemsize:
      raise DataError(f'{path}: size {size} bytes is not a multiple of 4, so it is not a uint32 '
                      'token file (truncated copy, or a uint16/uint8 file?).')
    return TokenFile(path, size, 0, size // TOKEN_DTYPE.itemsize, label)
  f = io.BytesIO(head)
  try:
    version = np.lib.format.read_magic(f)
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, _, dtype = read_header(f)
  except ValueError as e:
    raise DataError(f'{path}: starts like a .npy file but its header does not parse ({e}).') from e
  header = f.tell()
  if dtype != TOKEN_DTYPE or len(shape) != 1:
    raise DataError(f'{path}: .npy holds {dtype} of shape {shape}; expected 1-D little-endian '
                    'uint32 tokens. Re-tokenize with scripts/prepare_data.py, or save the ids '
                    'with np.save(path, ids.astype(np.uint32)).')
  if size - header != shape[0] * TOKEN_DTYPE.itemsize:
    raise DataError(f'{path}: .npy header says {shape[0]} tokens but the file holds '
                    f'{(size - header) // 4}; the file is truncated.')
  return TokenFile(path, size, header, shape[0], label)


def check_sample(file: TokenFile, vocab_size: int | None = None,
                 chunks: list[tuple[int, np.ndarray]] | None = None) -> None:
  """Refuses a file whose sampled tokens are not plausible uint32 ids.

  An int64 file read as uint32 has a zero in every second word (ids < 2^32,
  little-endian); real text never does once a few dozen ids are nonzero, so
  a tiny file is judged too. Other misreadings (uint16, big-endian, another
  tokenizer) put ids past the vocabulary everywhere. One stray id is left to
  Dataset.read, which names it if its instance is ever read. `chunks`: the
  (token offset, tokens) of sample_pieces, already read (a remote file's);
  by default read here from the local file.
  """
  chunks = _sample(file) if chunks is None else chunks
  tokens = np.concatenate([c for _, c in chunks])
  words = tokens[:tokens.size // 2 * 2].reshape(-1, 2)  # chunks start at even offsets
  if np.count_nonzero(words[:, 0]) >= _INT64_EVIDENCE and not words[:, 1].any():
    raise DataError(f'{file.path}: every second 32-bit word of the {tokens.size} sampled tokens '
                    'is 0: this looks like int64 little-endian ids, not uint32 tokens. '
                    'Re-tokenize to uint32 with scripts/prepare_data.py, or convert it with '
                    'np.fromfile(path, np.int64).astype(np.uint32).tofile(new_path).')
  if vocab_size is None:
    return
  stray = [(start + i, int(c[i])) for start, c in chunks for i in np.flatnonzero(c >= vocab_size)]
  if len(stray) > _STRAY_IDS_TOLERATED:
    (offset, token), hint = stray[0], _misreading(tokens, vocab_size)
    raise vocab_error(file.path, token, offset, vocab_size,
                      f'so are {len(stray) - 1} more of the {tokens.size} tokens sampled: {hint}')


def sample_pieces(file: TokenFile) -> list[tuple[int, int]]:
  """(token offset, count) of what check_sample reads: the head and a few spread chunks.

  A bounded read (~320 KiB): stage 1 has ~950 files of several GB each. Offsets
  and lengths are even, so 32-bit words pair up as an int64 file's would.
  """
  if file.num_tokens <= _SAMPLE_HEAD + _SAMPLE_CHUNKS * _SAMPLE_CHUNK:
    return [(0, file.num_tokens)]
  stride = (file.num_tokens - _SAMPLE_HEAD) // _SAMPLE_CHUNKS // 2 * 2  # >= _SAMPLE_CHUNK
  return [(0, _SAMPLE_HEAD)] + [(_SAMPLE_HEAD + k * stride, _SAMPLE_CHUNK)
                                for k in range(_SAMPLE_CHUNKS)]


def _sample(file: TokenFile) -> list[tuple[int, np.ndarray]]:
  """(token offset, tokens) of each of sample_pieces, read from the local file."""
  with open(file.path, 'rb') as f:

    def read(start: int, count: int) -> tuple[int, np.ndarray]:
      f.seek(file.header + TOKEN_DTYPE.itemsize * start)
      return start, np.fromfile(f, TOKEN_DTYPE, count)

    return [read(start, count) for start, count in sample_pieces(file)]


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


def vocab_error(path: str, token: int, offset: int, vocab_size: int,
                why: str = 'the file was made with another tokenizer or is corrupt') -> DataError:
  """The error for token id `token` >= vocab_size at token `offset` of `path`: a data
  mistake (EXIT_DATA, one line), whether the file is local or remote."""
  return DataError(f'{path}: token id {token} at token offset {offset} is >= vocab_size '
                    f'{vocab_size}; {why}. Check cfg.data.vocab_size, or re-tokenize to uint32 '
                    'with scripts/prepare_data.py.')


# ----------------------------------------------------------------------------
# Memory maps.


class TokenMaps:
  """Read-only memory maps of token files, the most recently used _MAX_OPEN_MAPS kept open.

  Thread-safe: the loader's prefetch thread reads through them.
  """

  def __init__(self, files: Sequence[TokenFile]):
    self.files = files
    self._maps: collections.OrderedDict[int, tuple[mmap.mmap, np.ndarray]]
    self._maps = collections.OrderedDict()
    self._lock = threading.Lock()

  def get(self, f: int) -> tuple[mmap.mmap, np.ndarray]:
    """File f's mmap and its tokens as a uint32 array view (least-recently-used cache)."""
    with self._lock:
      if f in self._maps:
        self._maps.move_to_end(f)
        return self._maps[f]
      file = self.files[f]
      with open(file.path, 'rb') as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
      # Instances are read at random: no fault read-around (which costs ~5 ms per instance on
      # sparse or cold files here); will_need asks for each instance's bytes instead.
      mm.madvise(mmap.MADV_RANDOM)
      self._maps[f] = (mm, np.frombuffer(mm, TOKEN_DTYPE, file.num_tokens, file.header))
      if len(self._maps) > _MAX_OPEN_MAPS:
        self._maps.popitem(last=False)  # unmapped once no batch still views it
      return self._maps[f]

  def tokens(self, f: int) -> np.ndarray:
    """File f's tokens, uint32 [n], memory mapped."""
    return self.get(f)[1]

  def will_need(self, f: int, start: int, count: int) -> None:
    """Queues the read of tokens [start, start + count) of file f (MADV_WILLNEED).

    Called for every piece of a batch before any is copied, so the kernel has
    all of its reads in flight at once.
    """
    mm, _ = self.get(f)
    header, page = self.files[f].header, mmap.PAGESIZE
    begin = (header + 4 * start) // page * page
    mm.madvise(mmap.MADV_WILLNEED, begin, min(len(mm), header + 4 * (start + count)) - begin)

  def read_many(self, pieces: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
    """Tokens [start, start + count) of file f for each (f, start, count): uint32 views of
    the maps, in order. Every piece's read is queued (will_need) before any is returned."""
    for f, start, count in sorted(pieces):
      self.will_need(f, start, count)
    return [self.tokens(f)[start:start + count] for f, start, count in pieces]

  def sequential(self, f: int) -> np.ndarray:
    """File f's tokens for one pass from start to end: a map of its own, with the kernel's
    read-ahead (the shared maps read at random)."""
    file = self.files[f]
    if not file.num_tokens:
      return np.zeros(0, TOKEN_DTYPE)
    return np.memmap(file.path, TOKEN_DTYPE, 'r', file.header, (file.num_tokens,))


def open_tokens(files: Sequence[TokenFile], cache_dir: str = '') -> Any:
  """What the datasets read tokens through: TokenMaps for local files, else a
  remote_tokens.RemoteTokens (the same interface; local files in it stay mapped) reading
  by byte range, caching in `cache_dir` (data.remote_cache_dir) when given."""
  maps = TokenMaps(files)
  mapped = [memory_mapped(f.path) for f in files]
  if all(mapped):
    return maps
  return remote_tokens.RemoteTokens(files, maps, cache_dir, remote=[not m for m in mapped])


def check_tokens(maps: Any, vocab_size: int, chunk_tokens: int = 1 << 24) -> None:
  """Scans every token of every file of `maps` (open_tokens) against vocab_size (a full read;
  use offline)."""
  for f, file in enumerate(maps.files):
    if file.num_tokens == 0:
      continue
    tokens = maps.sequential(f)
    for start in range(0, file.num_tokens, chunk_tokens):
      chunk = np.asarray(tokens[start:start + chunk_tokens])
      if chunk.size and chunk.max() >= vocab_size:
        t = int(np.argmax(chunk >= vocab_size))
        raise vocab_error(file.path, chunk[t], start + t, vocab_size)


# ----------------------------------------------------------------------------
# The fingerprint.


def fingerprint(class_name: str, fields: dict[str, Any], files: Sequence[TokenFile]) -> str:
  """OLMo-core `NumpyDatasetBase.fingerprint`: sha256 of the class, fields, base names and sizes."""
  h = hashlib.sha256(f'class={class_name}'.encode())
  for name, value in fields.items():
    h.update(f'{name}={value},'.encode())
  for f in files:
    h.update(f'path={os.path.basename(f.path)},size={f.size},'.encode())
  return h.hexdigest()


# ----------------------------------------------------------------------------
# Cache files: written whole or not at all, each verified by an xxh3 sidecar.


def write_atomic(path: str, content: bytes | np.ndarray) -> None:
  """Writes `content` (an array's bytes, uncopied) to a temporary file, then renames it."""
  tmp = f'{path}.{uuid.uuid4().hex}.tmp'
  try:
    with open(tmp, 'wb') as f:
      f.write(content)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def checksum(array: np.ndarray) -> str:
  """xxh3-64 hex digest of an array's bytes (~30 GB/s)."""
  return xxhash.xxh3_64_hexdigest(array)


def write_checksummed(path: str, array: np.ndarray) -> None:
  """Writes `array` to `path` and its checksum to `path` + CHECKSUM_SUFFIX, each atomically."""
  write_atomic(path, array)  # the array first: a reader never pairs a new sum with an old file
  write_atomic(path + CHECKSUM_SUFFIX, checksum(array).encode())


def checksum_problem(path: str, array: np.ndarray) -> str | None:
  """Why `array` (read from `path`) fails its sidecar checksum, or None when it verifies."""
  try:
    with open(path + CHECKSUM_SUFFIX) as f:
      expected = f.read().strip()
  except FileNotFoundError:
    return f'it has no checksum file {path + CHECKSUM_SUFFIX} to verify it by'
  if expected != checksum(array):
    return f'its contents fail the checksum in {path}{CHECKSUM_SUFFIX}'
  return None
