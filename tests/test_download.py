"""store/download.py against a real local HTTP server that misbehaves on purpose.

FaultyServer (also used by test_fetch_data.py) serves files from memory with
Range support and, per path, a script of faults for successive GETs: drop the
connection after k body bytes (a clean close or a reset), answer with an HTTP
error, stall past the client's timeout, or ignore Range. The reference is the
bytes the server holds: every fetched file must equal them exactly.
"""

import hashlib
import http.server
import os
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

from store import download


class FaultyServer:
  """A threaded HTTP server on 127.0.0.1; `faults[path]` is consumed one GET at a time.

  A fault is ('drop', k), ('reset', k), ('status', code), ('stall', seconds)
  or ('ignore_range',). `log` records (method, path, Range header).
  """

  def __init__(self, files: dict[str, bytes] | None = None):
    self.files = dict(files or {})
    self.faults: dict[str, list[tuple]] = {}
    self.log: list[tuple[str, str, str | None]] = []
    self.no_head = False  # answer HEAD with 405, as some servers do
    self.lock = threading.Lock()
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def log_message(self, *args):
        pass

      def do_HEAD(self):
        if server.no_head:
          self.send_error(405)
          return
        self._serve(body=False)

      def do_GET(self):
        self._serve(body=True)

      def _serve(self, body: bool):
        path, rng = self.path, self.headers.get('Range')
        with server.lock:
          server.log.append((self.command, path, rng))
          queue = server.faults.get(path, [])
          fault = queue.pop(0) if body and queue else None
        if fault and fault[0] == 'status':
          self.send_error(fault[1])
          return
        if fault and fault[0] == 'stall':
          time.sleep(fault[1])
        if path not in server.files:
          self.send_error(404)
          return
        data, start = server.files[path], 0
        if rng and not (fault and fault[0] == 'ignore_range'):
          start = int(rng.removeprefix('bytes=').split('-')[0])
          if start >= len(data) and data:
            self.send_response(416)
            self.send_header('Content-Range', f'bytes */{len(data)}')
            self.send_header('Content-Length', '0')
            self.end_headers()
            return
          self.send_response(206)
          self.send_header('Content-Range', f'bytes {start}-{len(data) - 1}/{len(data)}')
        else:
          self.send_response(200)
        self.send_header('Content-Length', str(len(data) - start))
        self.send_header('Accept-Ranges', 'bytes')
        self.end_headers()
        if not body:
          return
        payload = data[start:]
        if fault and fault[0] in ('drop', 'reset'):
          self.wfile.write(payload[:fault[1]])
          self.wfile.flush()
          if fault[0] == 'reset':  # RST instead of FIN: the client sees ConnectionResetError
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack('ii', 1, 0))
          self.close_connection = True
          return
        self.wfile.write(payload)

    self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    self.httpd.daemon_threads = True
    self.url = f'http://127.0.0.1:{self.httpd.server_address[1]}'
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  def gets(self, path: str | None = None) -> list[tuple[str, str, str | None]]:
    return [e for e in self.log if e[0] == 'GET' and (path is None or e[1] == path)]

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


@pytest.fixture
def server():
  s = FaultyServer()
  yield s
  s.close()


def _payload(n: int, seed: int) -> bytes:
  return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


FAST = dict(backoff=0.01, timeout=5.0, progress=False)


def _no_leftovers(directory) -> list[str]:
  return [n for n in os.listdir(directory) if n.endswith('.part') or '.tmp' in n]


def test_faulty_server_ends_byte_identical_and_second_run_fetches_nothing(server, tmp_path):
  sizes = {'/a.npy': 3_000_001, '/b/c.npy': 1_234_567, '/d.npy': 10, '/empty.npy': 0}
  for i, (path, n) in enumerate(sizes.items()):
    server.files[path] = _payload(n, i)
  server.faults = {'/a.npy': [('drop', 700_000), ('status', 500), ('reset', 100_000),
                              ('drop', 0)],
                   '/b/c.npy': [('status', 503), ('drop', 999_999)],
                   '/d.npy': [('reset', 3)]}
  items = [download.Item(server.url + p, str(tmp_path / p.lstrip('/')),
                         size=n if p != '/b/c.npy' else None) for p, n in sizes.items()]
  report = download.fetch(items, workers=3, **FAST)
  for item, (path, n) in zip(items, sizes.items()):
    assert open(item.dest, 'rb').read() == server.files[path]
  # Every byte crossed the network exactly once: resumed attempts asked only for the rest.
  assert report == download.Report(downloaded=4, skipped=0, bytes=sum(sizes.values()),
                                   total_bytes=sum(sizes.values()))
  ranges = [r for _, _, r in server.gets('/a.npy')]
  assert ranges == [None, 'bytes=700000-', 'bytes=700000-', 'bytes=800000-', 'bytes=800000-']
  assert not _no_leftovers(tmp_path) and not _no_leftovers(tmp_path / 'b')

  server.log.clear()
  again = download.fetch(items, workers=3, **FAST)
  assert again == download.Report(downloaded=0, skipped=4, bytes=0,
                                  total_bytes=sum(sizes.values()))
  assert not server.gets()


def test_404_names_the_url_after_the_others_finish_and_leaves_nothing(server, tmp_path):
  server.files['/ok.npy'] = _payload(5000, 1)
  server.faults['/ok.npy'] = [('stall', 0.3)]  # still running when the 404 comes back
  items = [download.Item(server.url + '/missing.npy', str(tmp_path / 'missing.npy')),
           download.Item(server.url + '/ok.npy', str(tmp_path / 'ok.npy'))]
  with pytest.raises(download.DownloadError, match='missing.npy: HTTP 404') as e:
    download.fetch(items, **FAST)
  assert e.value.status == 404 and e.value.url == server.url + '/missing.npy'
  assert len(server.gets('/missing.npy')) == 1  # a 404 is not retried
  assert open(tmp_path / 'ok.npy', 'rb').read() == server.files['/ok.npy']
  assert sorted(os.listdir(tmp_path)) == ['ok.npy']


def test_resumes_an_existing_part_and_restarts_when_range_is_ignored(server, tmp_path):
  data = _payload(100_000, 2)
  server.files['/f.npy'] = data
  dest = tmp_path / 'f.npy'
  (tmp_path / 'f.npy.part').write_bytes(data[:40_000])
  report = download.fetch([download.Item(server.url + '/f.npy', str(dest), size=len(data))],
                          **FAST)
  assert dest.read_bytes() == data and report.bytes == 60_000 and report.downloaded == 1
  assert server.gets()[-1][2] == 'bytes=40000-'

  dest.unlink()
  (tmp_path / 'f.npy.part').write_bytes(data[:40_000])
  server.faults['/f.npy'] = [('ignore_range',)]  # a 200 with the whole file
  report = download.fetch([download.Item(server.url + '/f.npy', str(dest))], **FAST)
  assert dest.read_bytes() == data and report.bytes == 100_000

  dest.unlink()
  (tmp_path / 'f.npy.part').write_bytes(_payload(120_000, 9))  # longer than the file: 416
  report = download.fetch([download.Item(server.url + '/f.npy', str(dest))], **FAST)
  assert dest.read_bytes() == data
  assert not _no_leftovers(tmp_path)


def test_size_and_checksum_are_verified_before_the_rename(server, tmp_path):
  data = _payload(4096, 3)
  server.files['/f.npy'] = data
  url, dest = server.url + '/f.npy', str(tmp_path / 'f.npy')
  with pytest.raises(download.DownloadError, match='server has 4096 bytes, the listing expects '
                     '4097'):
    download.fetch([download.Item(url, dest, size=4097)], **FAST)
  with pytest.raises(download.DownloadError, match='sha256'):
    download.fetch([download.Item(url, dest, sha256='0' * 64)], **FAST)
  assert os.listdir(tmp_path) == []
  good = hashlib.sha256(data).hexdigest()
  assert download.fetch([download.Item(url, dest, 4096, good)], **FAST).downloaded == 1
  # A complete file is checked, not trusted: a wrong one at dest is refused and kept.
  with open(dest, 'r+b') as f:
    f.write(b'\0')
  with pytest.raises(download.DownloadError, match='already exists but its sha256'):
    download.fetch([download.Item(url, dest, 4096, good)], **FAST)
  assert open(dest, 'rb').read(1) == b'\0'


def test_retries_give_up_with_the_partial_file_kept(server, tmp_path):
  data = _payload(10_000, 4)
  server.files['/f.npy'] = data
  server.faults['/f.npy'] = [('drop', 1000)] + [('status', 500)] * 10
  dest = tmp_path / 'f.npy'
  with pytest.raises(download.DownloadError, match=r'failed after 3 attempts \(HTTP 500.*rerun'):
    download.fetch([download.Item(server.url + '/f.npy', str(dest))], retries=2, **FAST)
  assert not dest.exists() and (tmp_path / 'f.npy.part').read_bytes() == data[:1000]
  server.faults.clear()
  report = download.fetch([download.Item(server.url + '/f.npy', str(dest))], **FAST)
  assert dest.read_bytes() == data and report.bytes == 9000


def test_a_stalled_server_times_out_and_is_retried(server, tmp_path):
  server.files['/f.npy'] = _payload(2000, 5)
  server.faults['/f.npy'] = [('stall', 2.0)]
  dest = tmp_path / 'f.npy'
  download.fetch([download.Item(server.url + '/f.npy', str(dest))], backoff=0.01, timeout=0.5,
                 progress=False)
  assert dest.read_bytes() == server.files['/f.npy'] and len(server.gets()) == 2


def test_local_sources_and_schemes(tmp_path):
  src = tmp_path / 'src.npy'
  src.write_bytes(_payload(3000, 6))
  out = tmp_path / 'out'
  items = [download.Item(str(src), str(out / 'a.npy'), size=3000),
           download.Item('file://' + str(src), str(out / 'b.npy'))]
  assert download.fetch(items, **FAST) == download.Report(2, 0, 6000, 6000)
  assert (out / 'a.npy').read_bytes() == (out / 'b.npy').read_bytes() == src.read_bytes()
  assert download.remote_size(str(src)) == 3000
  with pytest.raises(download.DownloadError, match='no such file'):
    download.fetch([download.Item(str(tmp_path / 'nope.npy'), str(out / 'c.npy'))], **FAST)
  with pytest.raises(download.DownloadError, match='ftp:// is not supported'):
    download.fetch([download.Item('ftp://host/x', str(out / 'd.npy'))], **FAST)
  with pytest.raises(ValueError, match='share the destination'):
    download.fetch([download.Item(str(src), str(out / 'a.npy'))] * 2, **FAST)
  assert download.http_url('gs://bucket/dir/f 1.npy') == \
      'https://storage.googleapis.com/bucket/dir/f%201.npy'
  assert download.http_url('s3://ai2-llm/x.npy') == 'https://ai2-llm.s3.amazonaws.com/x.npy'


def test_remote_size_and_the_progress_bar(server, tmp_path, capsys):
  server.files['/f.npy'] = _payload(2_500_000, 7)
  assert download.remote_size(server.url + '/f.npy') == 2_500_000
  with pytest.raises(download.DownloadError, match='404') as e:
    download.remote_size(server.url + '/nope.npy')
  assert e.value.status == 404
  download.fetch([download.Item(server.url + '/f.npy', str(tmp_path / 'f.npy'))], backoff=0.01)
  err = capsys.readouterr().err
  assert 'MiB/s' in err and 'ETA' in err and '2.4/2.4 MiB' in err
  server.no_head = True
  assert download.remote_size(server.url + '/f.npy') is None


@pytest.fixture
def no_proxy(monkeypatch):
  """No proxy from the environment: the requests below must meet the real resolver and port."""
  for name in ('http_proxy', 'https_proxy', 'HTTP_PROXY', 'HTTPS_PROXY', 'all_proxy', 'ALL_PROXY'):
    monkeypatch.delenv(name, raising=False)


def test_a_host_that_does_not_resolve_fails_at_once_and_stops_the_fetch(tmp_path, no_proxy):
  # RFC 6761: .invalid never resolves. The default retries and backoff (1+2+4+8+16 s
  # per file) would take minutes; a failed lookup is not retried.
  url = 'http://does-not-resolve.invalid/root'
  start = time.time()
  with pytest.raises(download.HostUnreachable, match='does not resolve') as e:
    download.remote_size(url + '/f.npy')
  assert e.value.host == 'does-not-resolve.invalid' and not e.value.resolved
  items = [download.Item(f'{url}/{i}.npy', str(tmp_path / f'{i}.npy')) for i in range(40)]
  with pytest.raises(download.HostUnreachable) as e:
    download.fetch(items, workers=4, progress=False)
  assert time.time() - start < 10
  message = str(e.value)
  assert 'the host does-not-resolve.invalid does not resolve' in message and '\n' not in message
  assert 'no network, or the host name is wrong' in message
  assert int(re.search(r'\((\d+) more files not attempted\)', message)[1]) >= 40 - 4
  assert os.listdir(tmp_path) == []


def test_a_host_that_refuses_every_connection_stops_after_the_first_file(tmp_path, no_proxy):
  # A port bound but not listening answers every connection with a reset (ECONNREFUSED).
  sock = socket.socket()
  sock.bind(('127.0.0.1', 0))
  try:
    url = f'http://127.0.0.1:{sock.getsockname()[1]}'
    with pytest.raises(download.HostUnreachable, match='HEAD failed 3 times') as e:
      download.remote_size(url + '/f.npy')
    assert e.value.resolved and e.value.host == '127.0.0.1'
    items = [download.Item(f'{url}/{i}.npy', str(tmp_path / f'{i}.npy')) for i in range(40)]
    with pytest.raises(download.HostUnreachable, match='failed after 2 attempts.*nothing '
                       'answers at 127.0.0.1') as e:
      download.fetch(items, workers=2, retries=1, **FAST)
    assert int(re.search(r'\((\d+) more files not attempted\)', str(e.value))[1]) >= 40 - 2
  finally:
    sock.close()
