"""Where bytes live: the one module that knows a local or shared path from a bucket.

Every file or folder a tool reads or writes is a *location*: a POSIX path
('runs/x', '/mnt/nfs/run') or a URL ('gs://bucket/run', 's3://bucket/run';
'http(s)://host/dir' to read data). What a user typed becomes one canonical
location here (`canonical`: one spelling per place; a malformed or unknown URL
is refused in one line and never becomes a local folder), and every operation
that differs between a filesystem and an object store is here with both its
implementations: whole-object reads and writes, appends, local views of
remote files (`local_view`), commits (a rename, or a marker written last),
listings and deletes, and the tools' inputs and outputs (globs, uploads).
Callers have one code path; the few that keep two implementations of their
own ask for a capability (`renames`, `appends`, `maps`, `locks`), listed with
reasons in tests/test_seam.py. The transport under it (tensorstore's stores,
retries, error classes) is store/kvstores.py, which only this module imports.

Why it is one module of ~720 lines, not two of ~360 (the house's bound is ~600):
it is the seam itself, and each seam tried would cut through it. Its sections
are naming (what a user typed -> one canonical location; pure, ~170 lines),
whole objects, commits, directories, and the tools' inputs and outputs.
  * Naming as a module of its own would parse URLs with the transport's
    grammar (kvstores' URL_RE, schemes, bucket rules), so either a second
    module imports the transport (tests/test_seam.py allows one, so that a
    branch on where bytes live cannot hide) or the grammar is written twice.
  * The tools' inputs and outputs (glob, upload_tree, staged_output) are built
    on the other sections; moved out, they could not be re-exported here
    without an import cycle (tests/test_layout.py), and every script, converter
    and data tool that writes an output would import a second storage module
    and learn which of the two holds which operation.
  * What stays is one table of operations with a filesystem and a bucket
    implementation side by side; a reader checking that a bucket honours what
    a rename promises on disk (atomicity, listing, deletes) reads one file.

What object stores guarantee, and where this code relies on it:

  * Whole-object writes are atomic and read-after-write consistent (GCS and S3
    both are, for new objects, overwrites and deletes). `write_atomic`,
    checkpoint COMMIT markers, metadata.json and every log object rely on it: a
    reader sees the old object or the new one, never a torn one.
  * Conditional writes (GCS ifGenerationMatch, S3 If-Match/If-None-Match):
    `write(..., if_generation=...)` writes only when the object is still at the
    generation read before (MISSING: does not exist yet). The lock's create and
    takeover (hosts/workdir_lock.py) and `append` rely on it, so two writers never both
    win. (The fake-gcs-server emulator ignores the precondition on the uploads
    tensorstore makes; moto's S3 server honours it.)
  * No rename, no fsync, no directory order. A checkpoint is committed by writing
    COMMIT last under its final prefix instead of renaming (`commit`); a
    listing is sorted here; `rename_tree` copies then deletes (rare paths only:
    setting aside a corrupt or rolled-back step).
  * Listing is consistent with completed writes (both stores), so a committed
    step is always found by `listdir`.
"""

import concurrent.futures
import hashlib
import os
import re
import shutil
import time
import uuid

import tensorstore as ts

import errors
from store import kvstores

# The transport's names that callers reach through this module, their one seam.
MISSING, OBJECT_SCHEMES, READ_SCHEMES = (kvstores.MISSING, kvstores.OBJECT_SCHEMES,
                                         kvstores.READ_SCHEMES)
StorageError, StorageConfigError = kvstores.StorageError, kvstores.StorageConfigError
scheme, describe, bucket_and_key = kvstores.scheme, kvstores.describe, kvstores.bucket_and_key
kvstore, kvstore_spec, context = kvstores.kvstore, kvstores.kvstore_spec, kvstores.context
credentials_hint = kvstores.credentials_hint

_SIZE_RE = re.compile(r'(?:total size|value of size) (\d+)')
_COPY_THREADS = 16  # rename_tree's parallel object copies (one chunk in memory each)


def is_url(location: str) -> bool:
  return bool(scheme(location))


def is_object_store(location: str) -> bool:
  return scheme(location) in OBJECT_SCHEMES


# --- What a user typed -> one canonical location -------------------------------------------

# Bucket names each store accepts (GCS: 3-63 characters, or up to 222 in dotted parts; S3:
# 3-63), lower case: a name the store would reject is refused here, in one line.
_BUCKET_RE = {'gs': re.compile(r'^[a-z0-9][a-z0-9_.-]{1,220}[a-z0-9]$'),
              's3': re.compile(r'^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$')}
# 'gs//b/x', 's3:/b', 'gs:b': a scheme the shell or a typo mangled; never a local folder.
_MANGLED_RE = re.compile(r'^(gs|s3|gcs|https?)(:/?(?!/)|//)', re.IGNORECASE)


def canonical(text: str, what: str = '--workdir', *, writes: bool = True,
              local_only: bool = False) -> str:
  """The one canonical form of a location a user typed (a flag or config field), or a
  ConfigError in one line (exit 2) before any work.

  A URL becomes scheme://bucket/key: the scheme lower-cased, no trailing slash, and a
  doubled slash or a '.'/'..' segment inside the key refused (an empty shell variable
  in `gs://b/$RUN/x` must not name another run). A path is expanded (~) and normalised
  (os.path.normpath: no doubled or trailing slash), so two spellings of one place are
  one run, one data cache and one lock. `writes`: the tool writes there (http(s)://
  is read-only). `local_only`: the tool needs a local path (HF and OLMo-core folders,
  memory-mapped caches); a URL is refused with the copy command to use.
  """
  text = os.fspath(text) if text is not None else ''
  if not text.strip():
    raise errors.ConfigError(f'{what} is empty; give a local path or a gs:// or s3:// URL.')
  s = scheme(text)
  if not s:
    if _MANGLED_RE.match(text) or ':' in text.split('/', 1)[0]:
      raise errors.ConfigError(
          f'{what}={text!r} looks like a URL with a malformed scheme; write gs://BUCKET/PATH '
          'or s3://BUCKET/PATH (a colon and two slashes), or a local path.')
    return os.path.normpath(os.path.expanduser(text))
  if local_only:
    raise errors.ConfigError(
        f'{what}={text!r} is a URL, but this is read and written on a local path; copy it '
        'down or up with `gcloud storage cp -r` / `aws s3 cp --recursive`.')
  known = OBJECT_SCHEMES + (() if writes else READ_SCHEMES)
  m = kvstores.URL_RE.match(text)
  kinds = 'gs://BUCKET/PATH or s3://BUCKET/PATH' + ('' if writes else ' (or http(s)://HOST/PATH)')
  if s not in known or not m.group(2) or not m.group(3).split('/')[0]:
    reads_only = s in READ_SCHEMES and writes
    raise errors.ConfigError(
        f'{what}={text!r}: ' + ('http(s):// is read-only; write to ' if reads_only else
                               'unknown or malformed URL; use ') + f'{kinds}, or a local path.')
  bucket, _, key = m.group(3).partition('/')
  key = key.rstrip('/')
  parts = key.split('/') if key else []
  if any(p in ('', '.', '..') for p in parts):
    raise errors.ConfigError(
        f'{what}={text!r} has an empty, "." or ".." part in its path (an unset shell '
        'variable?); a bucket has no such folders: write the full path, e.g. '
        f'{s}://{bucket}/{"/".join(p for p in parts if p not in ("", ".", ".."))}.')
  if s in _BUCKET_RE and not _BUCKET_RE[s].match(bucket):
    raise errors.ConfigError(
        f'{what}={text!r}: {bucket!r} is not a valid {describe(text)} bucket name (3-63 '
        'lower-case letters, digits, dots or dashes, starting and ending with a letter or '
        'digit).')
  return f'{s}://{bucket}' + (f'/{key}' if key else '')


def join(location: str, *parts: str) -> str:
  if not is_url(location):
    return os.path.join(location, *parts)
  return '/'.join([location.rstrip('/'), *(p.strip('/') for p in parts if p)])


def resolve(base: str, path: str) -> str:
  """`path` as it is when it is a URL or an absolute path (or `base` is empty), else under
  `base` (a folder or prefix): how a mix's relative entries are found (OLMo-core's
  f'{base_dir}/{path}')."""
  if is_url(path) or os.path.isabs(path) or not base:
    return path
  return join(base, path)


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


def identity(location: str) -> str:
  """What names one place whatever its spelling: a URL's canonical form, a path's real
  path (symlinks resolved). For cache keys and 'is this the same file' checks."""
  if not is_url(location):
    return os.path.realpath(location)
  try:
    return canonical(location, writes=False)
  except errors.ConfigError:  # not ours to refuse here: a caller checked what it accepts
    return location.rstrip('/')


def local_cache_dir(location: str, name: str) -> str:
  """A local folder for `location`'s caches: `location`/`name` on a filesystem; for a
  bucket, one per URL under $XDG_CACHE_HOME (~/.cache)/olmo3_jax (memory-mapped caches
  must be local files, and every host keeps its own). Spellings of one bucket location
  share one folder."""
  if not is_url(location):
    return os.path.join(location, name)
  return os.path.join(cache_root(), _cache_tag(identity(location)), name)


def cache_root() -> str:
  """$XDG_CACHE_HOME (~/.cache)/olmo3_jax: this host's caches of remote things."""
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(root, 'olmo3_jax')


def _cache_tag(url: str) -> str:
  tag = re.sub(r'[^A-Za-z0-9_.-]+', '_', url)[-80:]
  return f'{tag}.{hashlib.sha256(url.encode()).hexdigest()[:8]}'


def local_view(location: str) -> str:
  """A local path holding `location`'s current bytes, for libraries that open only local
  files (a tokenizer.json in a bucket). A path is returned as it is. A URL is copied
  into this host's cache with the object's generation (GCS) or ETag (S3) beside it, and
  every call asks the store whether the object changed since (one conditional read that
  transfers nothing when it did not): a replaced object is fetched again, and nothing
  stale is ever returned. A missing file or object raises FileNotFoundError.""" 
  location = os.fspath(location)
  if not is_url(location):
    if not os.path.isfile(location):
      raise (IsADirectoryError if os.path.isdir(location) else FileNotFoundError)(
          f'{location} is not a file.')
    return location
  url = identity(location)
  folder = os.path.join(cache_root(), 'files', _cache_tag(url))
  path, stamp_file = os.path.join(folder, basename(url)), os.path.join(folder, 'generation')
  cached = None
  if os.path.isfile(path) and os.path.isfile(stamp_file):
    with open(stamp_file, 'rb') as f:
      cached = f.read()
  store, key = kvstore(url)
  try:
    r = store.read(key, if_not_equal=cached).result() if cached else store.read(key).result()
  except ValueError as e:
    raise kvstores.failed('reading', url, e) from e
  if r.state == 'missing':
    raise FileNotFoundError(f'{url} does not exist.')
  if r.state == 'value':  # new, or changed since it was cached
    os.makedirs(folder, exist_ok=True)
    write_atomic(path, r.value, fsync=False)
    write_atomic(stamp_file, r.stamp.generation, fsync=False)
  return path


def unwritable(location: str) -> str | None:
  """Why a file cannot be written at `location`, checked before hours of work, or None. A
  path: its nearest existing folder must be a writable folder (the rest is created on
  write). A bucket: None (the write itself is the check; a dry write would cost a request
  and could not prove the later one)."""
  if is_url(location):
    return None
  existing = os.path.dirname(os.path.abspath(location))
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not (os.path.isdir(existing) and os.access(existing, os.W_OK)):
    return f'{existing} is not a writable folder'
  return None


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
    r = kvstores.result(store.read(key), 'reading', location)
  except ValueError as e:
    raise kvstores.failed('reading', location, e) from e
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
    r = kvstores.result(store.read(key, byte_range=slice(start, stop)), 'reading', location)
  except ValueError as e:
    raise kvstores.failed(f'reading bytes [{start}, {stop}) of', location, e) from e
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
        raise kvstores.failed('finding the size of', location, e) from e
      m = _SIZE_RE.search(str(e))
      return int(m.group(1)) if m else False
    if r.state != 'value':
      raise FileNotFoundError
    return True

  try:
    r = store.read(key, byte_range=slice(0, 0)).result()
  except ValueError as e:
    raise kvstores.failed('finding the size of', location, e) from e
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
  """Whether the file, directory or object exists. A filesystem that cannot tell (EACCES,
  EIO) raises: os.path.exists would say False, and a committed checkpoint would then pass
  for a crashed save."""
  if not is_url(location):
    try:
      os.stat(location)
    except (FileNotFoundError, NotADirectoryError):
      return False
    return True
  return read_versioned(location)[0] is not None


def write(location: str, data: bytes, if_generation: bytes | None = None) -> bytes | None:
  """Writes an object (whole, atomically); with `if_generation`, only if it is still at
  that generation (MISSING: absent). Returns the new generation, or None when the
  condition failed. Object stores only."""
  store, key = kvstore(location)
  try:
    stamp = kvstores.result(store.write(key, data, if_equal=if_generation), 'writing', location)
  except ValueError as e:
    if 'FAILED_PRECONDITION' in str(e) and if_generation is not None:
      return None
    raise kvstores.failed('writing', location, e) from e
  if not stamp.generation and if_generation == MISSING:
    _refused_create(store, key, location)
  return stamp.generation or None  # tensorstore answers an empty generation on a failed condition


def _refused_create(store: ts.KvStore, key: str, location: str) -> None:
  """Raises the store's own error when a create-if-absent was refused but nothing is there:
  tensorstore reports S3's answer to a PUT into a missing bucket (404 NoSuchBucket) as a
  failed condition, which would read as "another writer won" forever. A listing of the key
  asks the bucket itself."""
  if read_versioned(location)[0] is not None:
    return  # another writer's object: the condition did fail
  try:
    kvstores.result(store.list(ts.KvStore.KeyRange(key, key + '\0')), 'writing', location)
  except ValueError as e:
    raise kvstores.failed('writing', location, e) from e


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


# --- Commits: a rename on a filesystem, a marker in a bucket --------------------------------
#
# A directory that must appear whole (a checkpoint step) is built where `staging` says and
# made visible by `commit`: on a filesystem it is built under a temporary sibling name and
# renamed into place; an object store has no rename, so it is written under its final name
# and the caller's marker object, written last by `commit`, is what readers look for.
# Callers write one code path; the strategy is chosen here, by the location.


# What a store can do. A module that keeps two implementations of one operation (a
# metrics log, an event file, the workdir lock, token reads) asks for the capability, never
# for the scheme: tests/test_seam.py holds every such caller to a list with its reason.


def renames(location: str) -> bool:
  """Whether `location`'s store renames directories atomically (a filesystem does; a
  bucket does not)."""
  return not is_url(location)


def appends(location: str) -> bool:
  """Whether a file at `location` can be appended to in place (a filesystem; an object is
  written whole, so a bucket log is one object per flush)."""
  return not is_url(location)


def maps(location: str) -> bool:
  """Whether `location` can be memory-mapped (a local or shared file; a URL is read by
  byte range)."""
  return not is_url(location)


def locks(location: str) -> bool:
  """Whether the store has advisory file locks (flock on a filesystem; a bucket's lock is a
  lease: a conditional create, renewed)."""
  return not is_url(location)


def staging(final: str, tag: str) -> str:
  """Where to build the directory `final` before `commit`: the sibling tmp.<name>.<tag> on a
  filesystem, `final` itself in a bucket."""
  if not renames(final):
    return final
  return join(parent(final), f'tmp.{basename(final)}.{tag}')


def commit(staged: str, final: str, marker: str, fsync: bool = True) -> None:
  """Makes the directory built in `staged` visible as `final`: renamed into place (a
  filesystem), then the empty object `marker` written inside it, last."""
  if staged != final:
    os.rename(staged, final)
    fsync_dir(parent(final), fsync)
  write_atomic(join(final, marker), b'', fsync)
  fsync_dir(final, fsync)


def retire(location: str, tag: str, first: tuple[str, ...] = ()) -> None:
  """Deletes a committed directory so that a crash part-way never leaves what looks like a
  whole one: renamed to tmp.<name>.deleted.<tag> first on a filesystem; in a bucket the
  `first` objects (its marker) are deleted before the rest."""
  if renames(location):
    doomed = join(parent(location), f'tmp.{basename(location)}.deleted.{tag}')
    os.rename(location, doomed)
    location = doomed
  delete_tree(location, first=first)


def copy_file(src: str, dst: str) -> None:
  """Copies one file or object (either may be in a bucket); FileNotFoundError if `src` is
  gone."""
  if renames(src) and renames(dst):
    shutil.copyfile(src, dst)
    return
  data = read(src)
  if data is None:
    raise FileNotFoundError(f'{src} does not exist.')
  write_atomic(dst, data)


def fingerprint(location: str) -> str:
  """What names a file's current version, for cache keys: a path's real path and mtime; a
  URL's canonical form alone (no request per file at start-up: a token file is replaced
  under a new name, and a changed size is caught by the data-change check)."""
  if not is_url(location):
    return f'{os.path.realpath(location)},{os.stat(location).st_mtime_ns}'
  return identity(location)


# --- Directories (prefixes) -------------------------------------------------------------


def makedirs(location: str) -> None:
  """Creates a local directory; object stores have none to create."""
  if not is_url(location):
    os.makedirs(location, exist_ok=True)


def _prefix(location: str) -> str:
  return location.rstrip('/') + '/'


def _under(key: str) -> ts.KvStore.KeyRange:
  """Every key under the prefix `key` ('dir/'; '' is the bucket's root: everything)."""
  return ts.KvStore.KeyRange(key, key[:-1] + '0') if key else ts.KvStore.KeyRange('', '')


def list_keys(location: str) -> list[str]:
  """Every file or object under the directory or prefix `location`, at any depth, as a
  '/'-separated path relative to it, sorted ([] when there is none)."""
  if not is_url(location):
    found = []
    for root, _, names in os.walk(location):
      rel = os.path.relpath(root, location)
      found += [name if rel == '.' else f'{rel}/{name}'.replace(os.sep, '/') for name in names]
    return sorted(found)
  store, key = kvstore(_prefix(location))
  try:
    keys = store.list(_under(key),
                      strip_prefix_length=len(key))
    keys = kvstores.result(keys, 'listing', location)
  except ValueError as e:
    raise kvstores.failed('listing', location, e) from e
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
    kvstores.result(store.write(key, None), 'deleting', location)
  except ValueError as e:
    raise kvstores.failed('deleting', location, e) from e


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
    kvstores.result(store.delete_range(_under(key)), 'deleting', location)
  except ValueError as e:
    raise kvstores.failed('deleting', location, e) from e


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


# --- Tools' inputs and outputs ------------------------------------------------------------

_WILDCARD_RE = re.compile(r'[*?[]')
_UPLOAD_THREADS = 4  # upload_tree's parallel uploads: each holds one whole file in memory


def glob(pattern: str) -> list[str]:
  """The files a glob names, sorted. A path goes through the glob module (folders left
  out). A URL (`gs://b/dir/*.jsonl`) is matched segment by segment against the keys under
  its longest prefix without a wildcard, as the glob module matches a path: `*` stays
  within one segment, and a name starting with '.' matches only a segment that does. A
  URL without a wildcard names itself when that object exists. An http(s):// server
  cannot be listed, so a wildcard there is refused in one line."""
  import fnmatch  # pylint: disable=import-outside-toplevel  (this section's own needs)
  import glob as globlib  # pylint: disable=import-outside-toplevel  (this name hides it)
  if not is_url(pattern):
    return sorted(m for m in globlib.glob(pattern) if os.path.isfile(m))
  parts = pattern.rstrip('/').split('/')  # ['gs:', '', bucket, key parts...]
  first = next((i for i in range(3, len(parts)) if _WILDCARD_RE.search(parts[i])), None)
  if first is None:
    return [pattern] if exists(pattern) else []
  if not is_object_store(pattern):
    raise errors.ConfigError(f'{pattern!r}: an {describe(pattern)} server cannot be listed, '
                             'so it takes no wildcard; name each file.')
  root, wanted = '/'.join(parts[:first]), parts[first:]

  def matches(key: str) -> bool:
    names = key.split('/')
    return len(names) == len(wanted) and all(
        fnmatch.fnmatchcase(n, w) and (w.startswith('.') or not n.startswith('.'))
        for n, w in zip(names, wanted))
  return [join(root, k) for k in list_keys(root) if matches(k)]


def upload_tree(local_dir: str, location: str, last: tuple[str, ...] = (),
                replaces: tuple[str, ...] = ()) -> list[str]:
  """Copies every file under `local_dir` to `location`/<its relative path>; their names.

  `last`: files copied after all the others (an index naming them, such as a mix), and
  deleted at `location` before the copy starts, so no reader ever takes an old index for
  new files. `replaces`: glob patterns of names directly in `location` that this output
  supersedes; those it did not write are deleted at the end (an earlier, longer run's
  shards). Works on a path too (each file written atomically).
  """
  import fnmatch  # pylint: disable=import-outside-toplevel
  names = sorted(os.path.relpath(os.path.join(d, f), local_dir).replace(os.sep, '/')
                 for d, _, files in os.walk(local_dir) for f in files)
  for name in last:
    delete(join(location, name))

  def copy(name: str) -> None:
    makedirs(parent(join(location, name)))
    with open(os.path.join(local_dir, name), 'rb') as f:
      write_atomic(join(location, name), f.read(), fsync=False)
  with concurrent.futures.ThreadPoolExecutor(_UPLOAD_THREADS) as pool:
    list(pool.map(copy, [n for n in names if n not in last]))
  for name in last:
    if name in names:
      copy(name)
  for name in listdir(location) if replaces else []:
    if name not in names and any(fnmatch.fnmatchcase(name, p) for p in replaces):
      delete(join(location, name))
  return names


def staged_output(location: str, last: tuple[str, ...] = (), replaces: tuple[str, ...] = ()):
  """A context manager giving the local folder a tool writes its output files into.

  For a path: the path itself (the tool keeps its own atomic publish there). For a
  bucket URL: a fresh temporary folder, whose files are copied into the bucket with
  upload_tree(`last`, `replaces`) once the block ends without an error, and which is
  removed in every case: a failed run writes nothing into the bucket.
  """
  import contextlib  # pylint: disable=import-outside-toplevel
  import tempfile  # pylint: disable=import-outside-toplevel

  @contextlib.contextmanager
  def staged():
    if not is_url(location):
      yield location
      return
    with tempfile.TemporaryDirectory(prefix='olmo3_upload.') as tmp:
      yield tmp
      upload_tree(tmp, location, last, replaces)
  return staged()
