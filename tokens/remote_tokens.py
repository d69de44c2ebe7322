"""Token files on object storage or HTTP(S): sizes, byte-range reads, a local range cache.

A mix entry, data.paths, data.base_dir, the mix file itself and its held-out
files may be gs://, s3:// or http(s):// URLs (docs/data.md, remote data).
tokens/token_files.py inspects such a file through `probe` (its size) and `RangeReader`
(its first bytes and a sample), and the datasets read instances through
`RemoteTokens`, which has the interface of token_files.TokenMaps (local files
in the same mix stay memory mapped). Everything here is bytes: what the bytes
mean (headers, token checks) is tokens/token_files.py's.

  probe         a remote file's size: the mix's listed size verified with one
                ranged read, else found with ranged probes (storage.size); HTTP(S)
                with one `Range: bytes=0-0` request, which also shows that the
                server honours ranges.
  RangeReader   many byte ranges read at once: every uncached range of a batch
                is issued as a tensorstore future before any is awaited; the
                storage Context bounds the requests in flight
                (OLMO_STORAGE_CONCURRENCY), retries 5xx answers and dropped
                connections with backoff (OLMO_STORAGE_RETRIES) and aborts stalled
                transfers (OLMO_STORAGE_STALL_SECONDS). With a cache folder each
                range fetched is kept there, keyed by (URL, file size, start, stop):
                a second epoch or a restart reads the same ranges again (an FSL
                instance, a packed document) and finds them on disk.
  RemoteTokens  TokenMaps' interface (read_many, tokens, sequential, will_need).
  error         one line naming the URL and the fix for what a store answered.

Credentials come from each store's standard environment (store/storage.py); a public
bucket is read anonymously.
"""

import hashlib
import os
import re
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Sequence

import numpy as np

from errors import DataError, MissingDataError
from store import storage

TOKEN_DTYPE = np.dtype('<u4')  # token_files.TOKEN_DTYPE
_FAR = 1 << 50  # an offset past the end of any token file
_SHORT_REPLY_RETRIES = 4  # a range answered short is asked again this often
_SHORT_REPLY = re.compile(r'not satisfied by response with byte range \[(\d+), (\d+)\)')
# A size the store states in an error: tensorstore's partial-range message, S3's InvalidRange.
_SIZE_RE = re.compile(r'(?:total size|value of size) (\d+)|ActualObjectSize>(\d+)<')
_CONTENT_RANGE = re.compile(r'bytes (?:\d+-\d+|\*)/(\d+)')
_requests = [0]  # ranged reads and probes issued to remote stores by this process
_count_lock = threading.Lock()


def requests_issued() -> int:
  """Requests this process has sent for token data, for benchmarks: ranged reads and size
  probes (not the one-byte probes of storage.size, which a GCS file without a listed size
  costs)."""
  return _requests[0]


def _count(n: int = 1) -> None:
  with _count_lock:
    _requests[0] += n


def _credentials_hint(url: str) -> str:
  return storage.credentials_hint(url)


def error(url: str, e: Exception, what: str = '') -> Exception:
  """The error to raise for a failed request about `url`: one line naming the URL and the fix.

  Missing -> MissingDataError, refused or not range-capable -> DataError (exit 5);
  anything else (the store failing after the client's retries) -> storage.StorageError,
  which train.py reports in one line as restartable.
  """
  message = str(e).split('\n')[0][:300]
  what = f' ({what})' if what else ''
  if isinstance(e, storage.StorageConfigError):  # no bucket, a bad name, access denied
    return DataError(f'{url}{what}: {e}')
  if 'ignored by server' in message:
    return ranges_error(url)
  if any(k in message for k in ('PERMISSION_DENIED', 'UNAUTHENTICATED', 'HTTP code 403',
                                'HTTP code 401', "http_response_code='403'")):
    return DataError(f'{url}: access denied{what} ({message}); {_credentials_hint(url)}.')
  if message.startswith('NOT_FOUND'):
    return missing_error(url)
  if message.startswith('OUT_OF_RANGE'):
    return DataError(f'{url}{what}: the object is shorter than when the run inspected it '
                     f'({message}); it was replaced while the run read it. Restore it, or '
                     'restart the run (with --config.data.allow_data_change if it must change).')
  return storage.StorageError(f'reading {url}{what} failed on {storage.describe(url)} after the '
                              f'client\'s retries: {message}')


def missing_error(url: str) -> MissingDataError:
  return MissingDataError(f'{url}: token file does not exist (check cfg.data.base_dir, '
                          'cfg.data.path_remap, the {TOKENIZER} id, and the bucket name).')


def ranges_error(url: str) -> DataError:
  return DataError(f'{url}: the server does not honour HTTP range requests (it answers a request '
                   'for some bytes with the whole file), so instances cannot be read from it. '
                   'Serve the files with a range-capable server (nginx, Apache, a bucket\'s HTTP '
                   'endpoint; not python -m http.server), or copy them locally '
                   '(scripts/fetch_data.py) and train on the copy.')


# ----------------------------------------------------------------------------
# Sizes.


def probe(url: str, listed_size: int | None = None) -> int | None:
  """The size in bytes of a remote file, or None when it does not exist.

  With the size its mix lists: one read of the two bytes straddling that end,
  whose answer states the real size (a mismatch is then measured exactly).
  Otherwise: HTTP(S) one `Range: bytes=0-0` request; S3 one read past the end
  (its error states the size); GCS ranged probes (storage.size, ~2 log2(size)).
  """
  if storage.scheme(url) in storage.READ_SCHEMES:
    return _probe_http(url)
  store, key = storage.kvstore(url)
  offset = _FAR if listed_size is None else max(0, listed_size - 1)
  if listed_size is not None or storage.scheme(url) == 's3':
    _count()
    try:
      r = store.read(key, byte_range=slice(offset, offset + 2)).result()
    except ValueError as e:
      m = _SIZE_RE.search(str(e))
      if m:
        return int(m.group(1) or m.group(2))
      if not str(e).startswith('OUT_OF_RANGE'):
        raise error(url, e, 'finding its size') from e
    else:
      if r.state != 'value':
        return None
  try:
    return storage.size(url)  # sizes differ, or no listed size: find it
  except storage.StorageError as e:
    raise error(url, e, 'finding its size') from e


def _probe_http(url: str) -> int | None:
  """Size of an HTTP(S) file from one `Range: bytes=0-0` request, retried like the client's."""
  retries = int(os.environ.get('OLMO_STORAGE_RETRIES', 8))
  timeout = int(os.environ.get('OLMO_STORAGE_STALL_SECONDS', 60))
  delay = 0.5
  for attempt in range(retries + 1):
    _count()
    request = urllib.request.Request(url, headers={'Range': 'bytes=0-0'})
    try:
      with urllib.request.urlopen(request, timeout=timeout) as response:  # body left unread
        status, content_range = response.status, response.headers.get('Content-Range', '')
    except urllib.error.HTTPError as e:
      if e.code in (404, 410):
        return None
      if e.code == 416:  # an empty file has no byte 0
        m = _CONTENT_RANGE.match(e.headers.get('Content-Range', ''))
        return int(m.group(1)) if m else 0
      if e.code in (401, 403):
        raise DataError(f'{url}: access denied (HTTP {e.code}); {_credentials_hint(url)}.') from e
      if e.code < 500 and e.code != 429:
        raise DataError(f'{url}: the server answered HTTP {e.code} {e.reason}; check the URL '
                        '(cfg.data.base_dir, the mix entry).') from e
      failure: Exception = e
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
      failure = e
    else:
      m = _CONTENT_RANGE.match(content_range)
      if status == 206 and m:
        return int(m.group(1))
      raise ranges_error(url)
    if attempt < retries:
      time.sleep(delay)
      delay = min(32.0, delay * 2)
  raise storage.StorageError(f'finding the size of {url} failed after {retries + 1} attempts: '
                             f'{failure}')


# ----------------------------------------------------------------------------
# Ranged reads and their cache.


class RangeReader:
  """Reads byte ranges of remote files, all of a call's at once, through an optional cache.

  Cache layout: `<cache_dir>/<sha256(url, size)[:24]>/<start>-<stop>`, each file
  written to a temporary name and renamed into place, beside a `url` file naming
  its source. A range is looked up by exactly these four values: a file rewritten
  in place at the same size is not noticed (delete the cache folder then).
  """

  def __init__(self, cache_dir: str = ''):
    # A local folder (it caches what is read from remote storage): a URL is refused.
    self.cache_dir = cache_dir and storage.canonical(cache_dir, 'data.remote_cache_dir',
                                                     local_only=True)

  def _path(self, url: str, size: int, start: int, stop: int) -> str:
    key = hashlib.sha256(f'{url}\n{size}'.encode()).hexdigest()[:24]
    return os.path.join(self.cache_dir, key, f'{start}-{stop}')

  def _cached(self, path: str, length: int) -> bytes | None:
    try:
      with open(path, 'rb') as f:
        value = f.read()
    except OSError:
      return None
    return value if len(value) == length else None

  def _keep(self, path: str, url: str, value: bytes) -> None:
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
      os.makedirs(folder, exist_ok=True)
      _write(os.path.join(folder, 'url'), url.encode())
    _write(path, value)

  def read(self, ranges: Sequence[tuple[str, int, int, int]], cache: bool = True) -> list[bytes]:
    """Bytes [start, stop) of each (url, file size, start, stop), in order.

    Every range not in the cache is requested before any answer is awaited.
    """
    out: list[Any] = [None] * len(ranges)
    pending = []
    for i, (url, size, start, stop) in enumerate(ranges):
      if stop <= start:
        out[i] = b''
        continue
      path = self.cache_dir and cache and self._path(url, size, start, stop)
      value = path and self._cached(path, stop - start)
      if value:
        out[i] = value
        continue
      store, key = storage.kvstore(url)
      pending.append((i, path, store.read(key, byte_range=slice(start, stop))))
    _count(len(pending))
    for i, path, future in pending:
      url, _, start, stop = ranges[i]
      try:
        r = future.result()
      except ValueError as e:
        m = _SHORT_REPLY.search(str(e))  # the client noticed the short answer itself
        if not m:
          raise error(url, e, f'bytes [{start}, {stop})') from e
        value = _reread_short(url, size, start, stop, int(m.group(2)) - int(m.group(1)))
      else:
        if r.state != 'value':
          raise missing_error(url)
        value = r.value if len(r.value) == stop - start else _reread_short(
            url, size, start, stop, len(r.value))
      out[i] = value
      if path:
        self._keep(path, url, value)
    return out


def _reread_short(url: str, size: int, start: int, stop: int, got: int) -> bytes:
  """Bytes [start, stop) of `url` after an answer of only `got` bytes. A reply cut short
  is a transport fault: the range is asked again (backing off as the client does), and
  only an object that is now shorter than the run measured is reported as replaced."""
  store, key = storage.kvstore(url)
  for attempt in range(_SHORT_REPLY_RETRIES):
    time.sleep(min(32.0, 0.5 * 2 ** attempt))
    _count()
    try:
      r = store.read(key, byte_range=slice(start, stop)).result()
    except ValueError as e:
      m = _SHORT_REPLY.search(str(e))
      if not m:
        raise error(url, e, f'bytes [{start}, {stop})') from e
      got = int(m.group(2)) - int(m.group(1))
      continue
    if r.state != 'value':
      raise missing_error(url)
    if len(r.value) == stop - start:
      return r.value
    got = len(r.value)
  now = probe(url)
  if now is None:
    raise missing_error(url)
  if now < stop:  # the object itself changed under the run
    raise error(url, ValueError(f'OUT_OF_RANGE: {got} bytes of {stop - start}; the object is '
                                f'{now} bytes, {size} when the run measured it'),
                f'bytes [{start}, {stop})')
  raise storage.StorageError(
      f'reading {url} (bytes [{start}, {stop})) failed on {storage.describe(url)}: '
      f'{_SHORT_REPLY_RETRIES + 1} answers in a row were cut short ({got} bytes of '
      f'{stop - start}) although the object still holds them; a rerun may succeed once '
      'the store or the network answers whole.')


def _write(path: str, value: bytes) -> None:
  tmp = f'{path}.{uuid.uuid4().hex[:8]}.tmp'
  with open(tmp, 'wb') as f:
    f.write(value)
  os.replace(tmp, path)


# ----------------------------------------------------------------------------
# The datasets' reader.


class RemoteArray:
  """A remote file's tokens as a read-only 1-D array, fetched slice by slice (uncached).

  Enough of numpy's interface for sequential scans (packing, full checks, the
  content audit): shape, size, len, and integer or step-1 slice indexing.
  """

  def __init__(self, file: Any, reader: RangeReader):
    self.file, self.reader = file, reader
    self.shape, self.size, self.dtype = (file.num_tokens,), file.num_tokens, TOKEN_DTYPE

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int | slice) -> Any:
    if isinstance(index, slice):
      start, stop, step = index.indices(self.size)
      if step != 1:
        raise IndexError('RemoteArray reads contiguous slices only.')
      return self._read(start, max(start, stop))
    i = index + self.size if index < 0 else index
    if not 0 <= i < self.size:
      raise IndexError(f'token {index} is outside the {self.size} of {self.file.path}')
    return self._read(i, i + 1)[0]

  def _read(self, start: int, stop: int) -> np.ndarray:
    f, a = self.file, self.file.header + TOKEN_DTYPE.itemsize * start
    raw = self.reader.read([(f.path, f.size, a, a + TOKEN_DTYPE.itemsize * (stop - start))],
                           cache=False)[0]
    return np.frombuffer(raw, TOKEN_DTYPE)


class RemoteTokens:
  """token_files.TokenMaps' interface over a mix with remote files.

  Remote pieces are read by byte range through a RangeReader (all of a call's
  at once, cached when data.remote_cache_dir is set); local files in the same
  mix go to `local`, a TokenMaps over the same files.
  """

  def __init__(self, files: Sequence[Any], local: Any, cache_dir: str = '', *,
               remote: Sequence[bool]):
    self.files, self.local = files, local
    self.remote = list(remote)  # per file: read by byte range (token_files.memory_mapped)
    self.reader = RangeReader(cache_dir)

  def read_many(self, pieces: Sequence[tuple[int, int, int]]) -> list[np.ndarray]:
    """Tokens [start, start + count) of file f for each (f, start, count), uint32, in order."""
    out: list[Any] = [None] * len(pieces)
    local = [k for k, (f, _, _) in enumerate(pieces) if not self.remote[f]]
    remote = [k for k, (f, _, _) in enumerate(pieces) if self.remote[f]]
    ranges = []
    for k in remote:
      f, start, count = pieces[k]
      file = self.files[f]
      a = file.header + TOKEN_DTYPE.itemsize * start
      ranges.append((file.path, file.size, a, a + TOKEN_DTYPE.itemsize * count))
    fetched = self.reader.read(ranges)
    for k, tokens in zip(local, self.local.read_many([pieces[k] for k in local])):
      out[k] = tokens
    for k, raw in zip(remote, fetched):
      out[k] = np.frombuffer(raw, TOKEN_DTYPE)
    return out

  def tokens(self, f: int) -> Any:
    """File f's tokens: a memory map (local) or a RemoteArray."""
    return RemoteArray(self.files[f], self.reader) if self.remote[f] else self.local.tokens(f)

  def sequential(self, f: int) -> Any:
    """File f's tokens for one pass from start to end."""
    return self.tokens(f) if self.remote[f] else self.local.sequential(f)

  def will_need(self, f: int, start: int, count: int) -> None:
    if not self.remote[f]:
      self.local.will_need(f, start, count)
