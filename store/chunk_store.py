"""The storage layer of checkpoint.py: chunked zarr3 arrays, their checksums, metadata.json.

checkpoint.py decides what is saved and when a step counts as committed; this
module writes and reads the bytes of one step directory:

  arrays/<path>/  one zarr3 array per leaf (with use_ocdbt: one OCDBT database
                  in ocdbt/ instead), whose chunk grid follows the saving
                  sharding's shards, split further to at most `chunk_bytes`
  metadata.json   per array its shape, dtype, chunk shape and one xxh3 checksum
                  per chunk, and a checksum of all of it (`sealed`, `read_info`)

Every process writes whole chunks of the shards it owns (`snapshot`,
`write_local`) and no two processes touch one file. The chunk is also the unit
of checksumming and of reading: a reader loads the chunks that cover the slice
it needs, verifies each (`load_chunk`) and cuts the slice out (`assemble`).

Read failures fall in two kinds: damage (a checksum mismatch, a missing or
truncated file, undecodable bytes, metadata that contradicts itself) raises
CorruptCheckpointError; the storage refusing a read (permissions, a lost
mount, EIO) raises CheckpointReadError, and nothing should be moved.

Shapes: the code is rank-agnostic; a "box" is a tuple of (start, stop) per
dimension of an array.
"""

import concurrent.futures
import dataclasses
import itertools
import json
import math
import re
from typing import Any

import jax
import numpy as np
import tensorstore as ts
import xxhash

from store import storage

FORMAT_VERSION = 1
# xxh3-64 hashes ~30 GB/s on one core of the dev machine (google-crc32c 13,
# zlib.crc32 3.3, memcpy 9), so verifying never bounds save or restore speed;
# 64 bits leave ~2^-64 odds of missing a random corruption. Not cryptographic:
# it guards against bad disks and truncation, not against an adversary.
CHECKSUM = 'xxh3_64'
METADATA = 'metadata.json'

Box = tuple[tuple[int, int], ...]


# tensorstore raises ValueError('<absl status code>: ...') for damage and for the
# storage failing alike. Its file driver maps errno to a code (EACCES, EPERM ->
# PERMISSION_DENIED; ENOENT -> NOT_FOUND; ENOSPC -> RESOURCE_EXHAUSTED; EIO and
# the rest -> FAILED_PRECONDITION) and tags the message with the errno, while a
# truncated chunk is FAILED_PRECONDITION without one. Observed for a chmod-000
# chunk read by another user: "PERMISSION_DENIED: Error reading local file
# ".../c/0/0": Failed to open: ...: Permission denied [os_error_code='13']".
_IO_CODES = ('PERMISSION_DENIED', 'UNAVAILABLE', 'DEADLINE_EXCEEDED',
             'RESOURCE_EXHAUSTED', 'ABORTED', 'CANCELLED', 'UNAUTHENTICATED')
_ERRNO_TAG = re.compile(r"os_error_code='?\d|\[OS error: ")


class CorruptCheckpointError(ValueError):
  """A checkpoint whose files are damaged: failed checksums, missing or bad bytes."""


class CheckpointReadError(OSError):
  """The storage refused a read (permissions, mount, I/O); the checkpoint may be fine."""


def read_error(file: str, checkpoint_dir: str, cause: Exception) -> CheckpointReadError:
  return CheckpointReadError(
      f'Cannot read {file}: {cause}. The storage refused the read (permissions, a '
      f'lost mount or a disk error), which is not damage: checkpoint {checkpoint_dir} '
      'was left in place. Check the permissions of the checkpoint directory and that '
      'its filesystem is mounted and healthy, then rerun the same command.')


def is_io_error(message: str) -> bool:
  """Whether a tensorstore error message reports the storage failing, not bad bytes."""
  code = message.split(':', 1)[0]
  if code == 'NOT_FOUND':  # a missing file in a checkpoint is damage
    return False
  return code in _IO_CODES or _ERRNO_TAG.search(message) is not None


def tensorstore_failure(file: str, what: str, checkpoint_dir: str,
                        cause: ValueError) -> CheckpointReadError | CorruptCheckpointError:
  """The error to raise for a failed tensorstore open or read of `file`."""
  if is_io_error(str(cause)):
    return read_error(file, checkpoint_dir, cause)
  return CorruptCheckpointError(f'Checkpoint {checkpoint_dir}: {what} is unreadable: {cause}')


def write_durable(path: str, text: str, fsync: bool) -> None:
  """Writes a small file whole (a step's metadata.json), on disk or in a bucket."""
  storage.write_atomic(path, text, fsync)


fsync_dir = storage.fsync_dir


# --- Chunks -----------------------------------------------------------------------------


def chunk_shape(shard_shape: tuple[int, ...], itemsize: int,
                chunk_bytes: int) -> tuple[int, ...]:
  """Splits a shard into chunks of at most `chunk_bytes` where divisors allow.

  Leading axes are split first, each by its smallest divisor that suffices, so
  chunk edges stay on shard edges and every chunk is one contiguous run of its
  shard's bytes (hashable without a copy).
  """
  chunk = [max(1, n) for n in shard_shape]
  for ax, n in enumerate(chunk):
    need = math.ceil(math.prod(chunk) * itemsize / chunk_bytes)
    if need <= 1:
      break
    chunk[ax] = n // next((d for d in range(need, n + 1) if n % d == 0), n)
  return tuple(chunk)


def index_box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def slices(box: Box) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in box)


def chunk_ids(box: Box, chunk: tuple[int, ...]):
  return itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(box, chunk)))


def chunk_box(cid: tuple[int, ...], chunk: tuple[int, ...],
              shape: tuple[int, ...]) -> Box:
  return tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(cid, chunk, shape))


def chunk_key(cid: tuple[int, ...]) -> str:
  # Mirrors zarr3's default chunk file path (c/<i>/<j>), so errors point at files.
  return '/'.join(['c', *map(str, cid)])


def relative(inner: Box, outer: Box) -> tuple[slice, ...]:
  return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer))


def checksum(a: np.ndarray) -> str:
  return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def _kvstore(location: str, fsync: bool) -> dict[str, Any]:
  kvstore = storage.kvstore_spec(location + '/')
  if kvstore['driver'] == 'file':
    kvstore['file_io_sync'] = fsync
  else:  # a bucket's writes share storage.context()'s retries and concurrency bound
    kvstore['context'] = storage.context().spec.to_json()
  return kvstore


def spec(root: str, name: str, use_ocdbt: bool, fsync: bool = True) -> dict[str, Any]:
  if use_ocdbt:
    kvstore = {'driver': 'ocdbt', 'base': _kvstore(storage.join(root, 'ocdbt'), fsync),
               'path': f'{name}/'}
  else:
    kvstore = _kvstore(storage.join(root, 'arrays', name), fsync)
  # Every chunk gets a file (even all-zero ones) and a missing file is a read
  # error, not silent zeros: a lost chunk must never look like a fresh state.
  return {'driver': 'zarr3', 'kvstore': kvstore,
          'store_data_equal_to_fill_value': True, 'fill_missing_data_reads': False}


# --- Writing ----------------------------------------------------------------------------


@dataclasses.dataclass
class Snapshot:
  """Host copy of the shards of one array that this process writes."""
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]
  pieces: list[tuple[Box, np.ndarray]]


def host_copy(x: jax.Array) -> np.ndarray:
  # On accelerators a fresh host buffer. On CPU a zero-copy view, which PJRT
  # keeps alive (donation is skipped, delete deferred) while it exists; tested
  # by test_async_save_survives_donation_and_deletion.
  return np.asarray(x)


def snapshot(names: list[str], leaves: list[Any], process_index: int,
             chunk_bytes: int) -> list[Snapshot]:
  """Copies this process's shards to host (the synchronous part of a save)."""
  owned = []
  for name, leaf in zip(names, leaves):
    if isinstance(leaf, jax.Array):
      if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise ValueError(f'Leaf {name} is a typed PRNG key; checkpoint '
                         'jax.random.key_data(key) instead.')
      shards = [s for s in leaf.addressable_shards if s.replica_id == 0]
      for s in shards:  # start every device-to-host copy before waiting on one
        s.data.copy_to_host_async()
      owned.append(shards)
    else:
      owned.append(None)
  out = []
  for name, leaf, shards in zip(names, leaves, owned):
    if shards is not None:
      shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
      shard_shape = leaf.sharding.shard_shape(leaf.shape)
      pieces = [(index_box(s.index, shape), host_copy(s.data)) for s in shards]
    else:
      host = np.array(leaf)  # a copy: the caller may mutate it after save returns
      if host.dtype == object:
        raise ValueError(f'Leaf {name} of type {type(leaf).__name__} is not an '
                         'array or a scalar.')
      shape, dtype, shard_shape = host.shape, host.dtype, host.shape
      pieces = [(tuple((0, n) for n in shape), host)] if process_index == 0 else []
    out.append(Snapshot(name, shape, dtype,
                        chunk_shape(shard_shape, dtype.itemsize, chunk_bytes),
                         pieces))
  return out


def write_local(root: str, arrays: list[Snapshot], use_ocdbt: bool, fsync: bool,
                pool: concurrent.futures.Executor) -> dict[str, dict[str, str]]:
  """Writes this process's pieces; returns {array: {chunk key: checksum}}."""
  errors = []

  def settle(future):  # wait for everything, so nothing writes into a removed dir
    try:
      return future.result()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  ctx = ts.Context()
  mine = [a for a in arrays if a.pieces]
  # Every open is issued before any is waited for: each is a request or two, and waited for
  # one by one, a store that is down would cost one whole retry budget per array.
  opening = [ts.open(dict(spec(root, a.name, use_ocdbt, fsync), metadata={
      'shape': list(a.shape), 'data_type': a.dtype.name,
      'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': list(a.chunk)}}}),
                     create=True, open=True, context=ctx) for a in mine]
  stores = [settle(future) for future in opening]
  if errors:  # the store failed: writing the rest would only wait out more retries
    raise errors[0]
  writes = [store[slices(box)].write(data) for a, store in zip(mine, stores)
            if store is not None for box, data in a.pieces]
  # Hash while tensorstore writes (both release the GIL).
  jobs = [(a.name, chunk_key(cid), pool.submit(
      checksum, data[relative(chunk_box(cid, a.chunk, a.shape), box)]))
          for a in mine for box, data in a.pieces for cid in chunk_ids(box, a.chunk)]
  for w in writes:
    settle(w)
  sums: dict[str, dict[str, str]] = {}
  for name, key, digest in jobs:
    sums.setdefault(name, {})[key] = settle(digest)
  if errors:
    raise errors[0]
  return sums


def verify_and_describe(root: str, arrays: list[Snapshot],
                        parts: list[dict[str, dict[str, str]]],
                         use_ocdbt: bool) -> dict[str, Any]:
  """Checks that every chunk was written exactly once and every array exists."""
  described = {}
  for a in arrays:
    sums: dict[str, str] = {}
    for part in parts:
      for key, digest in part.get(a.name, {}).items():
        if sums.setdefault(key, digest) != digest:
          raise IOError(f'Array {a.name} chunk {key}: processes wrote different data.')
    expected = {chunk_key(c) for c in chunk_ids(tuple((0, n) for n in a.shape), a.chunk)}
    if set(sums) != expected:
      raise IOError(f'Array {a.name}: chunks {sorted(expected - set(sums))[:4]} '
                    'were written by no process.')
    store = ts.open(spec(root, a.name, use_ocdbt), open=True).result()
    if tuple(store.shape) != a.shape or store.dtype.numpy_dtype != a.dtype:
      raise IOError(f'Array {a.name}: stored as {store.shape} {store.dtype}, '
                    f'expected {a.shape} {a.dtype}.')
    described[a.name] = {'shape': list(a.shape), 'dtype': a.dtype.name,
                         'chunk_shape': list(a.chunk), 'checksums': sums}
  return described


# --- metadata.json ----------------------------------------------------------------------


def _info_checksum(info: dict[str, Any]) -> str:
  # Over a canonical serialization, so the checksum can live in the file it covers.
  return xxhash.xxh3_64_hexdigest(json.dumps(info, sort_keys=True).encode())


def sealed(info: dict[str, Any]) -> str:
  """metadata.json's text: `info` as a reader will parse it, plus its checksum."""
  info = json.loads(json.dumps(info))  # e.g. int dict keys become the strings read back
  return json.dumps(info | {'metadata_checksum': _info_checksum(info)})


def read_info(path: str) -> dict[str, Any]:
  """A step directory's metadata.json, verified against its own checksum."""
  file = storage.join(path, METADATA)
  try:
    text = storage.read(file)
  except IsADirectoryError as e:
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} is missing: {e}') from e
  except OSError as e:
    raise read_error(file, path, e) from e
  if text is None:
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} is missing.')
  try:
    info = json.loads(text)
  except ValueError as e:  # bad JSON, or bytes that are not UTF-8
    raise CorruptCheckpointError(f'Checkpoint {path}: unreadable {METADATA}: {e}') from e
  if not isinstance(info, dict):
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} holds a '
                                 f'{type(info).__name__}, not an object.')
  if (info.get('format_version') != FORMAT_VERSION or info.get('checksum') != CHECKSUM
      or not {'arrays', 'metadata', 'use_ocdbt'} <= info.keys()):
    raise CorruptCheckpointError(
        f'Checkpoint {path}: {METADATA} is not format {FORMAT_VERSION} with {CHECKSUM} '
        f'checksums (format {info.get("format_version")}, keys {sorted(info)}).')
  # Checkpoints saved before the checksum existed have none and are read as
  # before; the format version stays, so older code still reads new ones
  # (rather than set them all aside as corrupt). Damage that leaves valid JSON
  # minus exactly this key is not a realistic failure.
  claimed = info.pop('metadata_checksum', None)
  if claimed is not None and claimed != _info_checksum(info):
    raise CorruptCheckpointError(
        f'Checkpoint {path}: {file} fails its {CHECKSUM} checksum: it was damaged or '
        'edited after the save, so nothing in it (data position, array shapes) can '
        'be trusted.')
  return info


# --- Reading ----------------------------------------------------------------------------


def _array_file(path: str, name: str, use_ocdbt: bool, key: str = 'zarr.json') -> str:
  """The file holding `key` of array `name` (with OCDBT: the database holding it)."""
  if use_ocdbt:
    return storage.join(path, 'ocdbt')
  return storage.join(path, 'arrays', name, key)


def opened(path: str, name: str, desc: Any, use_ocdbt: bool, future: Any) -> Any:
  """The opened array `name`, checked against what metadata.json declares for it."""
  try:
    store = future.result()
  except ValueError as e:
    raise tensorstore_failure(_array_file(path, name, use_ocdbt), f'array {name}',
                              path, e) from e
  try:
    declared = (tuple(desc['shape']), ts.dtype(desc['dtype']), tuple(desc['chunk_shape']))
  except (KeyError, TypeError, ValueError) as e:
    raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} describes array '
                                 f'{name} badly: {e!r}') from e
  # The chunk grid (write chunks): tensorstore may split a large chunk into
  # smaller read chunks inside it (its sharding codec), which is not damage.
  chunk = store.chunk_layout.write_chunk.shape or ()  # None for a scalar
  actual = (tuple(store.shape), store.dtype, tuple(chunk))
  if declared != actual:
    raise CorruptCheckpointError(
        f"Checkpoint {path}: array {name}'s zarr.json says (shape, dtype, chunk shape) "
        f'{actual}, but {METADATA} declares {declared}: one of the two was damaged or '
        'edited.')
  return store


def load_chunk(path: str, name: str, cid: tuple[int, ...], read: Any,
               expected: str | None, use_ocdbt: bool) -> np.ndarray:
  key = chunk_key(cid)
  try:
    data = read.result()
  except ValueError as e:
    raise tensorstore_failure(_array_file(path, name, use_ocdbt, key),
                              f'array {name} {key}', path, e) from e
  if expected is not None and checksum(data) != expected:
    raise CorruptCheckpointError(f'Checkpoint {path}: array {name} {key} '
                                 f'fails its {CHECKSUM} checksum.')
  return data


def aligned(box: Box, chunk: tuple[int, ...], shape: tuple[int, ...]) -> bool:
  """Whether `box` is a union of whole chunks (then one read of it verifies each)."""
  return all(a % c == 0 and (b % c == 0 or b == n) for (a, b), c, n in zip(box, chunk, shape))


def load_box(path: str, name: str, store: Any, box: Box, desc: dict[str, Any], read: Any,
             verify: bool, use_ocdbt: bool) -> np.ndarray:
  """The `box` of array `name` (aligned to its chunks) from one tensorstore read, which
  reads its chunks in parallel into one buffer; each chunk is then checked in place.
  A failed read is read again chunk by chunk, so the error names the file."""
  shape, chunk = tuple(desc['shape']), tuple(desc['chunk_shape'])
  ids = list(chunk_ids(box, chunk))
  try:
    data = read.result()
  except ValueError as e:
    for cid in ids:  # the chunk to blame: its own read raises naming its file
      load_chunk(path, name, cid, store[slices(chunk_box(cid, chunk, shape))].read(),
                 None, use_ocdbt)
    raise tensorstore_failure(_array_file(path, name, use_ocdbt), f'array {name}',
                              path, e) from e
  if verify:
    for cid in ids:
      view = data[relative(chunk_box(cid, chunk, shape), box)]
      if checksum(view) != desc['checksums'].get(chunk_key(cid), ''):
        raise CorruptCheckpointError(f'Checkpoint {path}: array {name} {chunk_key(cid)} '
                                     f'fails its {CHECKSUM} checksum.')
  return data


def verify_in_full(path: str) -> None:
  """Reads every chunk of the checkpoint in `path` against its checksum.

  Raises CorruptCheckpointError or CheckpointReadError as restore does. One
  chunk at a time: this is a rare recovery path, and memory stays bounded.
  """
  info = read_info(path)
  use_ocdbt, ctx = info['use_ocdbt'], ts.Context()
  for name, desc in info['arrays'].items():
    store = opened(path, name, desc, use_ocdbt,
                   ts.open(spec(path, name, use_ocdbt), open=True, context=ctx))
    shape, chunk = tuple(desc['shape']), tuple(desc['chunk_shape'])
    ids = list(chunk_ids(tuple((0, n) for n in shape), chunk))
    if set(desc['checksums']) != {chunk_key(c) for c in ids}:
      raise CorruptCheckpointError(f'Checkpoint {path}: {METADATA} lists checksums '
                                   f'for other chunks than array {name} has.')
    for cid in ids:
      read = store[slices(chunk_box(cid, chunk, shape))].read()
      load_chunk(path, name, cid, read, desc['checksums'][chunk_key(cid)], use_ocdbt)


def assemble(box: Box, chunks: dict, chunk: tuple[int, ...], shape: tuple[int, ...],
             dtype: np.dtype) -> np.ndarray:
  """The `box` slice of an array, cut from the chunks that cover it."""
  ids = list(chunk_ids(box, chunk))
  if len(ids) == 1 and chunk_box(ids[0], chunk, shape) == box:
    return chunks[ids[0]]
  out = np.empty([b - a for a, b in box], dtype)
  for cid in ids:
    cbox = chunk_box(cid, chunk, shape)
    inter = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, cbox))
    out[relative(inter, box)] = chunks[cid][relative(inter, cbox)]
  return out
