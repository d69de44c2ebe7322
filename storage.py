"""Where a run keeps its state: a local or shared path, or a gs:// or s3:// bucket.

Every file a run writes or a checkpoint reader opens goes through these
functions, given a *location*: a POSIX path ('runs/x', '/mnt/nfs/run') or a URL
('gs://bucket/run', 's3://bucket/run'; 'http(s)://host/dir' for reading data).
Object stores are reached through tensorstore's key-value stores (its `gcs`,
`s3` and `http` drivers), the same library that writes the checkpoint arrays,
so no cloud SDK is needed. A scheme the project does not know ('gcs://',
'gs:/x', 'hdfs://', 'file://') is refused in one line (`check`) and never
becomes a local folder.

What object stores guarantee, and where this code relies on it:

  * Whole-object writes are atomic and read-after-write consistent (GCS and S3
    both are, for new objects, overwrites and deletes). `write_atomic`,
    checkpoint COMMIT markers, metadata.json and every log object rely on it: a
    reader sees the old object or the new one, never a torn one.
  * Conditional writes (GCS ifGenerationMatch, S3 If-Match/If-None-Match):
    `write(..., if_generation=...)` writes only when the object is still at the
    generation read before (MISSING: does not exist yet). The lock's create and
    takeover (workdir_lock.py) and `append` rely on it, so two writers never both
    win. (The fake-gcs-server emulator ignores the precondition on the uploads
    tensorstore makes; moto's S3 server honours it.)
  * No rename, no fsync, no directory order. A checkpoint is committed by writing
    COMMIT last under its final prefix instead of renaming (checkpoint.py); a
    listing is sorted here; `rename_tree` copies then deletes (rare paths only:
    setting aside a corrupt or rolled-back step).
  * Listing is consistent with completed writes (both stores), so a committed
    step is always found by `listdir`.

Retries: each store's client retries 5xx answers and dropped connections with
exponential backoff (tensorstore's `*_request_retries`), and a transfer that
stalls (under 1 byte/s for OLMO_STORAGE_STALL_SECONDS, default 60) is aborted
and retried, so a stalled server cannot hang a save. Concurrency per store is
bounded (`*_request_concurrency`, OLMO_STORAGE_CONCURRENCY, default 32).

Credentials come from each store's standard environment: Google application
default credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud, the metadata
server) and the AWS chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...); without any, the
request is anonymous, which public buckets answer. Endpoints for other S3
services and emulators: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; GCS emulators:
TENSORSTORE_GCS_HTTP_URL.
"""

import concurrent.futures
import functools
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from typing import Any

import tensorstore as ts

import errors

OBJECT_SCHEMES = ('gs', 's3')  # writable object stores
READ_SCHEMES = ('http', 'https')  # read-only (token files)
MISSING = b'\x02'  # tensorstore's generation of a key that does not exist (NoValue)
_URL_RE = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*):(//)?(.*)$')
_SIZE_RE = re.compile(r'(?:total size|value of size) (\d+)')
_COPY_THREADS = 16  # rename_tree's parallel object copies (one chunk in memory each)


def scheme(location: str) -> str:
  """'gs', 's3', 'http', 'https', or '' for a local path (a str or os.PathLike)."""
  m = _URL_RE.match(os.fspath(location))
  if not m or (len(m.group(1)) == 1 and os.name == 'nt'):  # C:\ on Windows
    return ''
  return m.group(1).lower()


def is_url(location: str) -> bool:
  return bool(scheme(location))


def is_object_store(location: str) -> bool:
  return scheme(location) in OBJECT_SCHEMES


def check(location: str, what: str = '--workdir', writable: bool = True) -> str:
  """`location` if this project can use it (a path, or a URL of a known scheme), else a
  ConfigError in one line. Local paths are returned as given (absolute paths resolve later)."""
  location = os.fspath(location)
  if not location:
    raise errors.ConfigError(f'{what} is empty; give a directory or a gs:// or s3:// URL.')
  s = scheme(location)
  if not s:
    if ':' in location.split('/', 1)[0]:  # 'gs:' as a folder name is a URL gone wrong
      raise errors.ConfigError(
          f'{what}={location!r} looks like a URL with a malformed scheme; write '
          'gs://BUCKET/PATH or s3://BUCKET/PATH (two slashes), or a local path.')
    return location
  known = OBJECT_SCHEMES + (READ_SCHEMES if not writable else ())
  m = _URL_RE.match(location)
  if s not in known or not m.group(2) or not m.group(3).split('/')[0]:
    kinds = 'gs://BUCKET/PATH or s3://BUCKET/PATH' + (
        '' if writable else ' (or http(s)://HOST/PATH to read)')
    raise errors.ConfigError(
        f'{what}={location!r}: unknown or malformed URL; this project reads and '
        f'writes {kinds}, or a local or shared filesystem path.')
  return location


def join(location: str, *parts: str) -> str:
  if not is_url(location):
    return os.path.join(location, *parts)
  return '/'.join([location.rstrip('/'), *(p.strip('/') for p in parts if p)])


def parent(location: str) -> str:
  if not is_url(location):
    return os.path.dirname(os.path.abspath(location))
  head, _, _ = location.rstrip('/').rpartition('/')
  return head


def basename(location: str) -> str:
  return location.rstrip('/').rpartition('/')[2] if is_url(location) else os.path.basename(
      location.rstrip('/'))


def absolute(location: str) -> str:
  """A URL as it is; a path made absolute (so two spellings of one place compare equal)."""
  return location.rstrip('/') if is_url(location) else os.path.abspath(location)


def local_cache_dir(location: str, name: str) -> str:
  """A local folder for `location`'s caches: `location`/`name` on a filesystem; for a
  bucket, one per URL under $XDG_CACHE_HOME (~/.cache)/olmo3_jax (memory-mapped caches
  must be local files, and every host keeps its own)."""
  if not is_url(location):
    return os.path.join(location, name)
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  tag = re.sub(r'[^A-Za-z0-9_.-]+', '_', location.rstrip('/'))[-80:]
  digest = hashlib.sha256(location.encode()).hexdigest()[:8]
  return os.path.join(root, 'olmo3_jax', f'{tag}.{digest}', name)


def local_file(location: str) -> str:
  """A local path holding `location`'s bytes: a path as it is; a URL downloaded once into
  the local cache (a tokenizer file named by a mix in a bucket, for libraries that open
  only local files). Raises FileNotFoundError when it does not exist."""
  location = os.fspath(location)
  if not is_url(location):
    return location
  path = os.path.join(local_cache_dir(parent(location), 'files'), basename(location))
  if not os.path.isfile(path):
    data = read(location)
    if data is None:
      raise FileNotFoundError(f'{location} does not exist.')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data, fsync=False)
  return path


def describe(location: str) -> str:
  """What kind of storage, in words, for log lines."""
  return {'gs': 'Google Cloud Storage', 's3': 'S3', 'http': 'HTTP',
          'https': 'HTTPS'}.get(scheme(location), 'a local or shared filesystem')


# --- tensorstore key-value stores -------------------------------------------------------


def _env_int(name: str, default: int) -> int:
  try:
    return int(os.environ.get(name, default))
  except ValueError:
    raise errors.ConfigError(f'${name}={os.environ[name]!r} is not an integer.') from None


@functools.cache
def context() -> ts.Context:
  """The one tensorstore Context for remote stores: bounded concurrency, retries, stalls.

  Created on first use, before tensorstore starts its HTTP transport, which
  reads the curl low-speed settings from the environment then.
  """
  # tensorstore's own variables stand unless ours is set (a parent process that used
  # storage passes its defaults on to its children, which must not mask their setting).
  stall = str(_env_int('OLMO_STORAGE_STALL_SECONDS', 60))
  set_value = os.environ.__setitem__ if 'OLMO_STORAGE_STALL_SECONDS' in os.environ else (
      os.environ.setdefault)
  set_value('TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS', stall)
  set_value('TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES', '1')
  limit = _env_int('OLMO_STORAGE_CONCURRENCY', 32)
  retries = {'max_retries': _env_int('OLMO_STORAGE_RETRIES', 8), 'initial_delay': '0.5s',
             'max_delay': '32s'}
  spec = {}
  for driver in ('gcs', 's3', 'http'):
    spec[f'{driver}_request_retries'] = retries
    spec[f'{driver}_request_concurrency'] = {'limit': limit}
  return ts.Context(spec)


def bucket_and_key(location: str) -> tuple[str, str]:
  rest = _URL_RE.match(location).group(3)
  bucket, _, key = rest.partition('/')
  return bucket, key


def kvstore_spec(location: str) -> dict[str, Any]:
  """A tensorstore kvstore spec whose path is `location` (a 'directory': end it with '/')."""
  s = scheme(location)
  if not s:
    return {'driver': 'file', 'path': os.path.abspath(location) + (
        '/' if location.endswith('/') else '')}
  if s in READ_SCHEMES:
    base, _, key = location.rpartition('/')
    return {'driver': 'http', 'base_url': base + '/', 'path': key}
  bucket, key = bucket_and_key(location)
  if s == 'gs':
    return {'driver': 'gcs', 'bucket': bucket, 'path': key}
  spec = {'driver': 's3', 'bucket': bucket, 'path': key}
  endpoint = os.environ.get('AWS_ENDPOINT_URL_S3') or os.environ.get('AWS_ENDPOINT_URL')
  if endpoint:
    spec['endpoint'] = endpoint
  region = os.environ.get('AWS_REGION') or os.environ.get('AWS_DEFAULT_REGION')
  if region:
    spec['aws_region'] = region
  return spec


@functools.lru_cache(maxsize=64)
def _open(root: str, gcs_url: str | None) -> ts.KvStore:
  del gcs_url  # part of the cache key: tensorstore reads it when a gcs store opens
  spec = json.loads(root)
  ctx = context() if spec['driver'] != 'file' else None
  return ts.KvStore.open(spec, context=ctx).result()


def kvstore(location: str) -> tuple[ts.KvStore, str]:
  """(the opened store holding `location` at its root, the key of `location` in it). Stores
  are opened once and shared; callers may issue many reads at once as futures
  (remote_tokens.py reads a batch's byte ranges this way)."""
  spec = kvstore_spec(location)
  key = spec.pop('path')
  return _open(json.dumps(spec, sort_keys=True), os.environ.get('TENSORSTORE_GCS_HTTP_URL')), key


class StorageError(OSError):
  """The storage refused or failed an operation (after the client's retries)."""


def _failed(op: str, location: str, e: Exception) -> StorageError:
  return StorageError(f'{op} {location} failed on {describe(location)}: {e}')


# --- Whole objects ----------------------------------------------------------------------


def read(location: str) -> bytes | None:
  """The whole object or file, or None when it does not exist."""
  if not is_url(location):
    try:
      with open(location, 'rb') as f:
        return f.read()
    except (FileNotFoundError, NotADirectoryError):
      return None
  return read_versioned(location)[0]


def read_versioned(location: str) -> tuple[bytes | None, bytes]:
  """(contents or None, generation): the generation to pass to write(if_generation=)."""
  store, key = kvstore(location)
  try:
    r = store.read(key).result()
  except ValueError as e:
    raise _failed('reading', location, e) from e
  return (r.value if r.state == 'value' else None), r.stamp.generation


def read_text(location: str) -> str | None:
  data = read(location)
  return None if data is None else data.decode()


def read_range(location: str, start: int, stop: int) -> bytes:
  """Bytes [start, stop) of a file or object (one ranged request; the client retries)."""
  if not is_url(location):
    with open(location, 'rb') as f:
      f.seek(start)
      return f.read(stop - start)
  store, key = kvstore(location)
  try:
    r = store.read(key, byte_range=slice(start, stop)).result()
  except ValueError as e:
    raise _failed(f'reading bytes [{start}, {stop}) of', location, e) from e
  if r.state != 'value':
    raise FileNotFoundError(f'{location} does not exist.')
  return r.value


def size(location: str) -> int | None:
  """The size in bytes of a file or object, or None when it does not exist.

  tensorstore's Python API has no stat: a remote size is found with one-byte
  ranged reads (doubling, then bisecting; 2 log2(size) requests at most), taking
  the size from the server's answer where it states it.
  """
  if not is_url(location):
    try:
      return os.path.getsize(location) if os.path.isfile(location) else None
    except OSError:
      return None
  store, key = kvstore(location)

  def probe(offset: int) -> bool | int:  # True: byte exists; False: past the end; int: size
    try:
      r = store.read(key, byte_range=slice(offset, offset + 1)).result()
    except ValueError as e:
      if not str(e).startswith('OUT_OF_RANGE'):
        raise _failed('finding the size of', location, e) from e
      m = _SIZE_RE.search(str(e))
      return int(m.group(1)) if m else False
    if r.state != 'value':
      raise FileNotFoundError
    return True

  try:
    r = store.read(key, byte_range=slice(0, 0)).result()
  except ValueError as e:
    raise _failed('finding the size of', location, e) from e
  if r.state != 'value':
    return None
  low, high = 0, 1  # byte `low - 1` exists (or low == 0); byte `high` may not
  try:
    while (found := probe(high)) is True:
      low, high = high + 1, high * 2
    if found is not False:
      return found
    while low < high:  # the size is in [low, high]
      mid = (low + high) // 2
      found = probe(mid)
      if found is not True and found is not False:
        return found
      low, high = (mid + 1, high) if found else (low, mid)
  except FileNotFoundError:
    return None
  return low


def exists(location: str) -> bool:
  if not is_url(location):
    return os.path.exists(location)
  return read_versioned(location)[0] is not None


def write(location: str, data: bytes, if_generation: bytes | None = None) -> bytes | None:
  """Writes an object (whole, atomically); with `if_generation`, only if it is still at
  that generation (MISSING: absent). Returns the new generation, or None when the
  condition failed. Object stores only."""
  store, key = kvstore(location)
  try:
    stamp = store.write(key, data, if_equal=if_generation).result()
  except ValueError as e:
    if 'FAILED_PRECONDITION' in str(e) and if_generation is not None:
      return None
    raise _failed('writing', location, e) from e
  return stamp.generation or None  # tensorstore answers an empty generation on a failed condition


def write_atomic(location: str, data: bytes | str, fsync: bool = True) -> None:
  """Replaces the file or object with `data`, all or nothing.

  Local: a temporary file beside it, fsynced, renamed over it, and the folder
  fsynced. Object stores: one PUT, which is atomic.
  """
  if isinstance(data, str):
    data = data.encode()
  if is_url(location):
    write(location, data)
    return
  tmp = f'{location}.{uuid.uuid4().hex[:8]}.tmp'
  try:
    with open(tmp, 'wb') as f:
      f.write(data)
      f.flush()
      if fsync:
        os.fsync(f.fileno())
    os.replace(tmp, location)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  fsync_dir(os.path.dirname(os.path.abspath(location)), fsync)


def append(location: str, data: bytes | str, fsync: bool = False) -> None:
  """Appends `data`: locally O_APPEND (+ fsync); on object stores read, extend and write
  back only if nobody wrote in between (a conditional write, retried), so concurrent
  appends from several hosts all land. For small logs (error.log, launcher.log)."""
  if isinstance(data, str):
    data = data.encode()
  if not is_url(location):
    with open(location, 'ab') as f:
      f.write(data)
      f.flush()
      if fsync:
        os.fsync(f.fileno())
    return
  for attempt in range(20):
    old, generation = read_versioned(location)
    if write(location, (old or b'') + data, if_generation=generation) is not None:
      return
    time.sleep(0.05 * (attempt + 1))
  raise StorageError(f'appending to {location}: 20 conflicting writers in a row.')


def fsync_dir(path: str, fsync: bool = True) -> None:
  if fsync and not is_url(path):
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)


# --- Directories (prefixes) -------------------------------------------------------------


def makedirs(location: str) -> None:
  """Creates a local directory; object stores have none to create."""
  if not is_url(location):
    os.makedirs(location, exist_ok=True)


def _prefix(location: str) -> str:
  return location.rstrip('/') + '/'


def list_keys(location: str) -> list[str]:
  """Every key under the prefix `location`/, relative to it, sorted (object stores)."""
  store, key = kvstore(_prefix(location))
  try:
    keys = store.list(ts.KvStore.KeyRange(key, key[:-1] + '0'),
                      strip_prefix_length=len(key)).result()
  except ValueError as e:
    raise _failed('listing', location, e) from e
  return sorted(k.decode() for k in keys)


def listdir(location: str) -> list[str]:
  """The names directly inside a directory or prefix, sorted; [] when it does not exist."""
  if not is_url(location):
    try:
      return sorted(os.listdir(location))
    except FileNotFoundError:
      return []
  return sorted({k.split('/', 1)[0] for k in list_keys(location)})


def isdir(location: str) -> bool:
  """A local directory, or a prefix holding at least one object."""
  if not is_url(location):
    return os.path.isdir(location)
  return bool(list_keys(location))


def isfile(location: str) -> bool:
  return os.path.isfile(location) if not is_url(location) else exists(location)


def delete(location: str) -> None:
  """Removes one file or object (absent is fine)."""
  if not is_url(location):
    try:
      os.remove(location)
    except FileNotFoundError:
      pass
    return
  store, key = kvstore(location)
  try:
    store.write(key, None).result()
  except ValueError as e:
    raise _failed('deleting', location, e) from e


def delete_tree(location: str, first: tuple[str, ...] = ()) -> None:
  """Removes a directory or prefix and everything under it.

  `first` names files deleted before the rest, in order (a checkpoint's COMMIT
  and metadata.json): an object store deletes the rest in no order, and a crash
  must never leave what still looks like a complete step.
  """
  if not is_url(location):
    shutil.rmtree(location, ignore_errors=True)
    return
  for name in first:
    delete(join(location, name))
  store, key = kvstore(_prefix(location))
  try:
    store.delete_range(ts.KvStore.KeyRange(key, key[:-1] + '0')).result()
  except ValueError as e:
    raise _failed('deleting', location, e) from e


def rename_tree(src: str, dst: str, last: tuple[str, ...] = (),
                first_deleted: tuple[str, ...] = ()) -> None:
  """Moves a directory or prefix. Local: os.rename (atomic). Object stores have no
  rename: every object is copied (`last` after the others), then the source deleted
  (`first_deleted` first), so a crash leaves both copies or a complete destination."""
  if not is_url(src):
    os.rename(src, dst)
    return
  keys = list_keys(src)

  def copy(k: str) -> None:
    data = read(join(src, k))
    if data is not None:
      write(join(dst, k), data)
  # The objects in parallel (the store's concurrency bound still applies), `last` after.
  with concurrent.futures.ThreadPoolExecutor(_COPY_THREADS) as pool:
    list(pool.map(copy, [k for k in keys if k not in last]))
  for k in last:
    if k in keys:
      copy(k)
  delete_tree(src, first=first_deleted)
