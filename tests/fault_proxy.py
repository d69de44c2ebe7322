"""An HTTP proxy in front of a storage server that fails on demand and counts requests.

The storage tests put it between tensorstore and the GCS emulator or the S3
server (TENSORSTORE_GCS_HTTP_URL / AWS_ENDPOINT_URL point at the proxy) to
make the service answer 503s, stall, or drop connections, as a real bucket does
under load or during an outage, and to count the requests a save or a step of
data costs (bench/bench_storage.py).
"""

import http.client
import http.server
import threading
import time
import urllib.parse


class ThreadingServer(http.server.ThreadingHTTPServer):
  """http.server's threading server with room for a burst of connections.

  tensorstore opens up to 32 connections at once; past socketserver's backlog of 5 the
  kernel dropped the other connects, which the client resent after 1, 3 and 7 s: a tiny
  model's checkpoint through this proxy took 3-8 s instead of 0.05.
  """
  request_queue_size = 256
  daemon_threads = True


class FaultProxy:
  """`with FaultProxy(upstream_url) as proxy:` proxy.url forwards to upstream.

  proxy.fail(n, status, after): after `after` more requests pass, the next n are
  answered `status` without reaching the upstream. proxy.stall(seconds): requests wait that long before
  being forwarded (a hung server; 0 ends it). proxy.lose(n, method, contains):
  the next n requests of `method` whose path contains `contains` reach the upstream, which
  acts on them, but their answer is dropped (the connection closed unanswered), as when a
  reply is lost on the way back. proxy.shorten(n, by): the next n answers to a ranged GET
  (206) lose their last `by` bytes, with headers that agree (a transfer cut short).
  proxy.outage(method, contains, skip, n, status, only): an outage that starts at one
  operation: from the first request of `method` whose (unquoted) path contains `contains`,
  after `skip` such requests passed, the next n requests whose path contains `only` ('':
  any) are answered `status`; several outages run in the order they were set (the second
  is armed once the first has ended). proxy.counts: requests seen per method,
  proxy.requests: (when, method, path) of each, proxy.bytes_in / bytes_out: bodies
  forwarded up / answered down.
  """

  def __init__(self, upstream: str):
    parsed = urllib.parse.urlparse(upstream)
    self.upstream = (parsed.hostname, parsed.port)
    self.lock = threading.Lock()
    self.failing, self.fail_status, self.stall_seconds, self.passing = 0, 503, 0.0, 0
    self.losing, self.lose_method, self.lose_contains = 0, 'PUT', ''
    self.shortening, self.shorten_by = 0, 1
    self.outages: list[dict] = []  # outage()'s, in order; each {'armed', 'n', ...}
    self.counts: dict[str, int] = {}
    self.requests: list[tuple[float, str, str]] = []  # (time.monotonic(), method, path)
    self.bytes_in = self.bytes_out = 0
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = 'HTTP/1.1'
      # The headers and the body are two writes: without TCP_NODELAY the second could wait
      # for the client's (delayed) acknowledgement of the first.
      disable_nagle_algorithm = True

      def log_message(self, *args):  # quiet
        pass

      def _any(self):
        length = int(self.headers.get('Content-Length') or 0)
        body = self.rfile.read(length) if length else b''
        with proxy.lock:
          proxy.counts[self.command] = proxy.counts.get(self.command, 0) + 1
          proxy.requests.append((time.monotonic(), self.command, self.path))
          proxy.bytes_in += len(body)
          failing = proxy.failing > 0 and proxy.passing == 0
          proxy.passing = max(0, proxy.passing - 1)
          if failing:
            proxy.failing -= 1
          status = proxy.fail_status if failing else proxy._outage(self.command, self.path)
        if failing or status:
          payload = b'injected failure'
          self.send_response(status)
          self.send_header('Content-Length', str(len(payload)))
          self.end_headers()
          self.wfile.write(payload)
          return
        deadline = time.monotonic() + proxy.stall_seconds
        while time.monotonic() < deadline and proxy.stall_seconds:
          time.sleep(0.05)
        conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != 'host'}
        headers['Host'] = f'{proxy.upstream[0]}:{proxy.upstream[1]}'
        conn.request(self.command, self.path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        headers_out = response.getheaders()
        with proxy.lock:
          proxy.bytes_out += len(data)
          lose = (proxy.losing > 0 and self.command == proxy.lose_method
                  and proxy.lose_contains in self.path)
          proxy.losing -= lose
          shorten = (proxy.shortening > 0 and response.status == 206
                     and len(data) > proxy.shorten_by)
          proxy.shortening -= shorten
        if lose:  # the upstream acted on it; the client never hears
          conn.close()
          self.close_connection = True
          self.connection.shutdown(2)
          return
        if shorten:
          data = data[:max(1, len(data) - proxy.shorten_by)]
          headers_out = [(k, v) for k, v in headers_out if k.lower() != 'content-range']
          first = int(dict((k.lower(), v) for k, v in response.getheaders())
                      ['content-range'].split()[1].split('-')[0])
          total = dict((k.lower(), v) for k, v in response.getheaders())[
              'content-range'].split('/')[1]
          headers_out.append(('Content-Range', f'bytes {first}-{first + len(data) - 1}/{total}'))
        self.send_response(response.status, response.reason)
        for k, v in headers_out:
          if k.lower() not in ('transfer-encoding', 'connection', 'content-length'):
            self.send_header(k, v)
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        if self.command != 'HEAD':
          self.wfile.write(data)
        conn.close()

      do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any

    self.server = ThreadingServer(('127.0.0.1', 0), Handler)
    self.url = f'http://127.0.0.1:{self.server.server_address[1]}'
    self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

  def fail(self, n: int, status: int = 503, after: int = 0) -> None:
    with self.lock:
      self.failing, self.fail_status, self.passing = n, status, after

  def outage(self, method: str, contains: str, skip: int = 0, n: int = 10 ** 6,
             status: int = 503, only: str = '') -> dict:
    """Sets an outage (see the class); returns its state: 'armed' is when it began (0: not
    yet), 'n' the failures it has left to answer."""
    rule = {'method': method, 'contains': contains, 'skip': skip, 'n': n, 'status': status,
            'only': only, 'armed': 0.0}
    with self.lock:
      self.outages.append(rule)
    return rule

  def _outage(self, method: str, path: str) -> int:
    """The status the current outage answers this request (0: none); under self.lock."""
    while self.outages and self.outages[0]['n'] <= 0:
      self.outages.pop(0)
    if not self.outages:
      return 0
    rule, path = self.outages[0], urllib.parse.unquote(path)
    if not rule['armed']:
      if method != rule['method'] or rule['contains'] not in path:
        return 0
      if rule['skip'] > 0:
        rule['skip'] -= 1
        return 0
      rule['armed'] = time.monotonic()  # when it began
    if rule['only'] not in path:
      return 0
    rule['n'] -= 1
    return rule['status']

  def lose(self, n: int, method: str = 'PUT', contains: str = '') -> None:
    with self.lock:
      self.losing, self.lose_method, self.lose_contains = n, method, contains

  def shorten(self, n: int, by: int = 1) -> None:
    with self.lock:
      self.shortening, self.shorten_by = n, by

  def stall(self, seconds: float) -> None:
    self.stall_seconds = seconds

  def reset_counts(self) -> None:
    with self.lock:
      self.counts, self.bytes_in, self.bytes_out = {}, 0, 0

  def __enter__(self) -> 'FaultProxy':
    self.thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self.stall_seconds = 0
    self.server.shutdown()
    self.server.server_close()
