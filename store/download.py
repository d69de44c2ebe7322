"""One downloader for data files and checkpoints: parallel, resumable, verified.

  report = download.fetch([download.Item(url, dest, size=..., sha256=...), ...])

Each item is written to `dest + '.part'` and renamed to `dest` only once it is
complete and verified (the size, and the sha256 when given), so a file under
its final name is always whole. An interrupted transfer resumes from the
`.part` with an HTTP Range request; dropped connections, timeouts and 5xx/429
answers are retried with exponential backoff; 4xx answers (404: the URL is
wrong or the file was removed) fail at once. Items download in parallel and
one progress bar on stderr shows bytes/s and the ETA. A `dest` that is
already complete is skipped, so rerunning a fetch downloads nothing.

A host that cannot be reached at all is not retried like a dropped
connection: a name that does not resolve (no network, or a wrong name) fails
at once, and a host that refuses every connection fails after the retries.
Both raise HostUnreachable, and fetch() then starts no further item: every
other file on that host would fail the same way, one timeout at a time.

URLs: http(s)://, file:// or a local path (copied, also via `.part`), and
public gs:// / s3:// buckets through their HTTPS endpoints (a private bucket
answers 403: copy it with gsutil / aws s3 and fetch from the local copy).
"""

import concurrent.futures
import errno
import hashlib
import http.client
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import NamedTuple, Sequence

_CHUNK = 1 << 20  # bytes per read: large enough that Python overhead is noise
_RETRIED_STATUS = (408, 425, 429, 500, 502, 503, 504)  # transient; anything else 4xx/5xx fails
_PUBLIC_ENDPOINTS = {  # public buckets answer anonymous HTTPS GETs with Range support
    'gs': 'https://storage.googleapis.com/{bucket}/{key}',
    's3': 'https://{bucket}.s3.amazonaws.com/{key}',
}
_USER_AGENT = 'olmo3-jax-download/1'
# getaddrinfo's failures as the C library words them, for errors that arrive as text.
_UNRESOLVED = ('Name or service not known', 'Temporary failure in name resolution',
               'nodename nor servname', 'No address associated with hostname')
_NO_ROUTE = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH)


class DownloadError(RuntimeError):
  """A download that failed: names the URL, what went wrong, and the fix.

  `url` and `status` (the HTTP status, or None) describe the first failure;
  `failures` lists (url, message) for every item that failed in one fetch().
  """

  def __init__(self, message: str, url: str = '', status: int | None = None,
               failures: Sequence[tuple[str, str]] = ()):
    super().__init__(message)
    self.url, self.status = url, status
    self.failures = list(failures) or [(url, message)]


class HostUnreachable(DownloadError):
  """No connection to the URL's host at all: its name does not resolve, or it refuses.

  `host` is the host name; `resolved` is False when the name did not resolve.
  """

  def __init__(self, message: str, url: str = '', host: str = '', resolved: bool = True,
               failures: Sequence[tuple[str, str]] = ()):
    super().__init__(message, url, None, failures)
    self.host, self.resolved = host, resolved


class Item(NamedTuple):
  url: str  # http(s)://, file:// or a local path, or a public gs:// / s3:// object
  dest: str  # final local path; written as dest + '.part' and renamed when complete and verified
  size: int | None = None  # expected bytes if known (a mismatch is an error)
  sha256: str | None = None  # expected hex checksum if the source publishes one


class Report(NamedTuple):
  downloaded: int  # files fetched (fully or resumed) in this call
  skipped: int  # files already complete at dest: nothing fetched
  bytes: int  # bytes transferred in this call (network, or copied for local sources)
  total_bytes: int  # final bytes of all items


class _Transient(Exception):
  """A failure worth retrying: a dropped connection, a timeout, a 5xx answer.

  `unreachable`: no connection could be made (refused, no route); when the
  retries run out this becomes HostUnreachable, not a plain DownloadError.
  """

  def __init__(self, message: str, unreachable: bool = False):
    super().__init__(message)
    self.unreachable = unreachable


def _host(url: str) -> str:
  return urllib.parse.urlparse(http_url(url)).hostname or url


def _unresolved(reason) -> bool:
  """Whether a connection failed because the host name does not resolve."""
  return isinstance(reason, socket.gaierror) or any(m in str(reason) for m in _UNRESOLVED)


def _gave_up(url: str, message: str, last: _Transient) -> DownloadError:
  """The error for an item whose retries ran out on `last`."""
  if last.unreachable:
    return HostUnreachable(f'{message}; nothing answers at {_host(url)}: check that the server '
                           'is up and the host and port in the URL.', url, _host(url))
  return DownloadError(message + '.', url)


def http_url(url: str) -> str:
  """The URL to request: gs:// and s3:// become their public HTTPS endpoints."""
  scheme, _, rest = url.partition('://')
  if scheme in _PUBLIC_ENDPOINTS:
    bucket, _, key = rest.partition('/')
    if not bucket or not key:
      raise DownloadError(f'{url}: expected {scheme}://BUCKET/KEY.', url)
    return _PUBLIC_ENDPOINTS[scheme].format(bucket=bucket, key=urllib.parse.quote(key))
  return url


def _local_path(url: str) -> str | None:
  """The file a file:// URL or a plain path names; None for a remote URL."""
  if url.startswith('file://'):
    return urllib.request.url2pathname(urllib.parse.urlparse(url).path)
  if '://' not in url:
    return url
  scheme = url.partition('://')[0]
  if scheme not in ('http', 'https', *_PUBLIC_ENDPOINTS):
    raise DownloadError(f'{url}: the scheme {scheme}:// is not supported; use http(s)://, '
                        'file://, a local path, or a public gs:// / s3:// object.', url)
  return None


def _request(url: str, timeout: float, method: str = 'GET', start: int = 0):
  """Opens `url`; an HTTP error becomes DownloadError (permanent) or _Transient."""
  headers = {'User-Agent': _USER_AGENT}
  if start:
    headers['Range'] = f'bytes={start}-'
  req = urllib.request.Request(http_url(url), headers=headers, method=method)
  try:
    return urllib.request.urlopen(req, timeout=timeout)
  except urllib.error.HTTPError as e:
    e.close()
    if e.code == 416:  # Range past the end: the caller checks the .part it already has
      raise
    if e.code in _RETRIED_STATUS or e.code >= 500:
      raise _Transient(f'HTTP {e.code} {e.reason}') from e
    fix = {404: 'the file is not there: check the base URL / bucket prefix and the mix file',
           403: 'access denied: the bucket is private or the URL needs credentials; copy the '
                'file with your cloud CLI and fetch it from the local copy',
           401: 'the server wants credentials; download it yourself and pass a local path'}
    raise DownloadError(f'{url}: HTTP {e.code} {e.reason}; '
                        f'{fix.get(e.code, "the server refused the request")}.', url,
                        e.code) from e
  except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
    reason = getattr(e, 'reason', e)
    if _unresolved(reason):  # retrying a lookup that failed only repeats it
      host = _host(url)
      raise HostUnreachable(f'{url}: the host {host} does not resolve ({reason}): there is no '
                            'network, or the host name is wrong.', url, host, False) from e
    raise _Transient(f'{type(e).__name__}: {reason}',
                     getattr(reason, 'errno', None) in _NO_ROUTE) from e


def remote_size(url: str, *, timeout: float = 60.0) -> int | None:
  """Bytes at `url` (HEAD's Content-Length, or the local file's size); None if unknown.

  Raises DownloadError for a missing file (404) or one the server refuses.
  """
  path = _local_path(url)
  if path is not None:
    if not os.path.isfile(path):
      raise DownloadError(f'{url}: no such file; check the path.', url, 404)
    return os.path.getsize(path)
  for attempt in range(3):
    try:
      with _request(url, timeout, 'HEAD') as resp:
        length = resp.headers.get('Content-Length')
        return int(length) if length and length.isdigit() else None
    except _Transient as e:
      if attempt == 2:
        raise _gave_up(url, f'{url}: HEAD failed 3 times ({e}); check the network and the URL, '
                       'then retry', e) from e
      time.sleep(0.5 * 2**attempt)
    except urllib.error.HTTPError:  # 416 on a HEAD: size unknown
      return None
    except DownloadError as e:
      if e.status == 405:  # the server does not answer HEAD: the GET will tell the size
        return None
      raise
  return None


def sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      h.update(chunk)
  return h.hexdigest()


class _Progress:
  """One progress bar for all items: bytes done of the known total, bytes/s, ETA."""

  def __init__(self, enabled: bool, total: int):
    self.enabled, self.total, self.done, self.moved = enabled, total, 0, 0
    self.start = self.shown = time.time()
    self.lock = threading.Lock()

  def add(self, done: int = 0, moved: int = 0, total: int = 0) -> None:
    """`done`: bytes now on disk; `moved`: of those, transferred now; `total`: newly known."""
    with self.lock:
      self.done, self.moved, self.total = self.done + done, self.moved + moved, self.total + total
      if self.enabled and time.time() - self.shown >= 0.25:
        self._show()

  def _show(self) -> None:
    self.shown = now = time.time()
    rate = self.moved / max(now - self.start, 1e-9)
    left = max(self.total - self.done, 0)
    eta = f'{left / rate:,.0f}s' if rate > 0 and self.total else '?'
    frac = min(self.done / self.total, 1.0) if self.total else 0.0
    bar = '#' * int(30 * frac) + '.' * (30 - int(30 * frac))
    sys.stderr.write(f'\rdownload [{bar}] {self.done / 2**20:,.1f}/{self.total / 2**20:,.1f} MiB '
                     f'{rate / 2**20:6.1f} MiB/s ETA {eta}   ')
    sys.stderr.flush()

  def finish(self) -> None:
    if self.enabled:
      with self.lock:
        self._show()
      sys.stderr.write('\n')


def _copy_local(item: Item, part: str, timeout: float, progress: _Progress,
                moved: list[int]) -> None:
  """Copies a local source into `part`, resuming it; counts the bytes in moved[0].

  `timeout` is unused: a local read does not hang on a peer.
  """
  src = _local_path(item.url)
  if not os.path.isfile(src):
    raise DownloadError(f'{item.url}: no such file; check the path (or the base directory the '
                        'mix is joined to).', item.url, 404)
  size = os.path.getsize(src)
  have = os.path.getsize(part) if os.path.exists(part) else 0
  if item.size is None and not moved[1]:
    moved[1] = 1
    progress.add(total=size)
  if have > size:  # not a prefix of this file: start over
    progress.add(done=-have)
    have = 0
  with open(src, 'rb') as fin, open(part, 'r+b' if have else 'wb') as fout:
    fin.seek(have)
    fout.seek(have)
    fout.truncate()
    while chunk := fin.read(_CHUNK):
      fout.write(chunk)
      moved[0] += len(chunk)
      progress.add(done=len(chunk), moved=len(chunk))
    fout.flush()
    os.fsync(fout.fileno())


def _total_size(resp) -> int | None:
  """The whole file's size from an answer: Content-Range's total (206), else Content-Length."""
  content_range = resp.headers.get('Content-Range', '')
  if content_range:
    total = content_range.rpartition('/')[2]
    return int(total) if total.isdigit() else None
  length = resp.headers.get('Content-Length')
  return int(length) if length and length.isdigit() else None


def _get_once(item: Item, part: str, timeout: float, progress: _Progress,
              moved: list[int]) -> None:
  """One HTTP attempt: appends to `part` from its current size; counts bytes in moved[0].

  Raises _Transient when the connection drops before the expected end (the
  bytes so far stay in `part` for the next attempt to resume from).
  """
  have = os.path.getsize(part) if os.path.exists(part) else 0
  try:
    resp = _request(item.url, timeout, start=have)
  except urllib.error.HTTPError as e:  # 416: nothing lies past `have`
    total = _total_size(e)
    if total == have:
      return  # the .part already holds the whole file
    os.remove(part)  # longer than the file: not a prefix of it
    progress.add(done=-have)
    raise _Transient(f'the partial file ({have} bytes) is not a prefix of the {total}-byte '
                     'source; starting over') from e
  with resp:
    total = _total_size(resp)
    if item.size is not None and total is not None and total != item.size:
      raise DownloadError(f'{item.url}: the server has {total} bytes, the listing expects '
                          f'{item.size}; the source changed or the listing is stale: check the '
                          'mix file / manifest against the source.', item.url)
    if item.size is None and total is not None and not moved[1]:
      moved[1] = 1  # the bar's total learns unlisted sizes as answers arrive
      progress.add(total=total)
    if have and resp.status != 206:  # the server ignored Range: take the whole file again
      progress.add(done=-have)
      have = 0
    _receive(resp, part, have, total, progress, moved)


def _receive(resp, part: str, have: int, total: int | None, progress: _Progress,
             moved: list[int]) -> None:
  """Streams the body of `resp` into `part` after its first `have` bytes."""
  with open(part, 'r+b' if have else 'wb') as f:
    f.seek(have)
    f.truncate()
    received = 0
    try:
      while chunk := resp.read(_CHUNK):
        f.write(chunk)
        received += len(chunk)
        moved[0] += len(chunk)
        progress.add(done=len(chunk), moved=len(chunk))
    except (OSError, http.client.HTTPException) as e:  # reset, timeout, IncompleteRead
      raise _Transient(f'connection dropped after {have + received} bytes '
                       f'({type(e).__name__})') from e
    finally:
      f.flush()
      os.fsync(f.fileno())
    if total is not None and have + received < total:  # http.client ends short reads silently
      raise _Transient(f'connection closed after {have + received} of {total} bytes')


def _verify(item: Item, path: str) -> str | None:
  """What is wrong with the file at `path` for `item`; None if it matches."""
  size = os.path.getsize(path)
  if item.size is not None and size != item.size:
    return f'it has {size} bytes, expected {item.size}'
  if item.sha256 and sha256_file(path) != item.sha256.lower():
    return f'its sha256 is not the expected {item.sha256}'
  return None


def _fetch_one(item: Item, retries: int, backoff: float, timeout: float,
               progress: _Progress) -> tuple[bool, int]:
  """Brings one item to `dest`; returns (downloaded, bytes transferred)."""
  if os.path.exists(item.dest):
    problem = _verify(item, item.dest)
    if problem is None:
      progress.add(done=os.path.getsize(item.dest),
                   total=os.path.getsize(item.dest) if item.size is None else 0)
      return False, 0
    # Never overwrite a file someone put there: it may be the only copy.
    raise DownloadError(f'{item.dest} already exists but {problem} ({item.url}); move it aside '
                        'or delete it, then rerun to download it again.', item.url)
  os.makedirs(os.path.dirname(os.path.abspath(item.dest)), exist_ok=True)
  part = item.dest + '.part'
  if os.path.exists(part):
    progress.add(done=os.path.getsize(part))
  get = _copy_local if _local_path(item.url) is not None else _get_once
  moved = [0, 0]  # bytes transferred; whether the bar has this item's size
  verify_retried, attempt = False, 0
  while True:
    try:
      get(item, part, timeout, progress, moved)
    except _Transient as e:
      attempt += 1
      if attempt > retries:
        kept = (f'; the partial file {part} is kept: rerun to resume it'
                if os.path.exists(part) else '')
        raise _gave_up(item.url, f'{item.url}: failed after {retries + 1} attempts ({e}){kept}',
                       e) from e
      time.sleep(backoff * 2**(attempt - 1))
      continue
    problem = _verify(item, part)
    if problem is None:
      break
    size = os.path.getsize(part)
    os.remove(part)  # wrong bytes: resuming from them could never verify
    progress.add(done=-size)
    if verify_retried:
      raise DownloadError(f'{item.url}: the downloaded file failed verification twice ({problem}); '
                          'the source does not match the expected size/checksum: check the '
                          'listing (mix file or manifest) against the source.', item.url)
    verify_retried = True
  os.replace(part, item.dest)
  return True, moved[0]


def fetch(items: Sequence[Item], *, workers: int = 8, retries: int = 5, backoff: float = 1.0,
          timeout: float = 60.0, progress: bool = True) -> Report:
  """Downloads `items` in parallel, resuming, retrying and verifying; returns a Report.

  Raises DownloadError once every item has finished or failed, listing each
  failure; completed items stay in place, partial ones as `.part` to resume.
  A HostUnreachable failure starts no further item and is the one raised.
  """
  dests = [os.path.abspath(i.dest) for i in items]
  if len(set(dests)) != len(dests):
    dup = next(d for d in dests if dests.count(d) > 1)
    raise ValueError(f'two items share the destination {dup}; give each file its own path.')
  if workers < 1 or retries < 0 or backoff < 0 or timeout <= 0:
    raise ValueError(f'need workers >= 1, retries >= 0, backoff >= 0 and timeout > 0; got '
                     f'workers={workers}, retries={retries}, backoff={backoff}, '
                     f'timeout={timeout}.')
  for item in items:
    _local_path(item.url)  # an unsupported scheme fails before anything starts
  bar = _Progress(progress, sum(i.size or 0 for i in items))
  downloaded = skipped = moved = 0
  failures: list[tuple[str, str, int | None]] = []
  unreachable: list[HostUnreachable] = []
  stop = threading.Event()

  def one(item: Item) -> tuple[bool, int] | None:
    if stop.is_set():
      return None  # not attempted: its host is unreachable
    try:
      return _fetch_one(item, retries, backoff, timeout, bar)
    except HostUnreachable:
      stop.set()  # here, before this worker takes the next item
      raise

  with concurrent.futures.ThreadPoolExecutor(max(1, min(workers, len(items)))) as pool:
    futures = {pool.submit(one, item): item for item in items}
    for future in concurrent.futures.as_completed(futures):
      try:
        result = future.result()
      except HostUnreachable as e:
        unreachable.append(e)
        continue
      except DownloadError as e:
        failures.append((futures[future].url, str(e), e.status))
        continue
      except OSError as e:  # local disk: full, permissions
        failures.append((futures[future].url, f'{futures[future].dest}: {e}; free space or fix '
                         'permissions, then rerun to resume.', None))
        continue
      if result is not None:
        got, n = result
        downloaded, skipped, moved = downloaded + got, skipped + (not got), moved + n
  bar.finish()
  if unreachable:
    first = min(unreachable, key=lambda e: e.url)
    left = len(items) - downloaded - skipped - len(failures) - len(unreachable)
    more = f' ({left} more files not attempted).' if left else '.'
    raise HostUnreachable(str(first).removesuffix('.') + more, first.url, first.host,
                          first.resolved, [(e.url, str(e)) for e in unreachable] +
                          [(u, m) for u, m, _ in failures])
  if failures:
    failures.sort()
    more = f' (and {len(failures) - 1} more failed: {[f[0] for f in failures[1:6]]})' \
        if len(failures) > 1 else ''
    raise DownloadError(failures[0][1] + more, failures[0][0], failures[0][2],
                        [(u, m) for u, m, _ in failures])
  total = sum(os.path.getsize(i.dest) for i in items)
  return Report(downloaded=downloaded, skipped=skipped, bytes=moved, total_bytes=total)
