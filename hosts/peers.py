"""A lost process of a multi-process run: one `error:` line and a restartable exit, not an abort.

When a process of a run dies, jax.distributed's coordination service notices
its missing heartbeats (--heartbeat_timeout) and tells every other process,
whose client then ends it: by default with a C++ fatal log, a check-failure
stack and SIGABRT, from a C++ thread no Python code runs on. The client takes
a `missed_heartbeat_callback` (sharding.py passes `on_lost`), but jaxlib 0.10.2
cannot hand it the status: calling it throws std::bad_cast on that thread, and
an uncaught C++ exception calls std::terminate. So this module also installs a
terminate handler (libstdc++'s std::set_terminate, through ctypes) that ends a
process whose terminate comes from that bad_cast in the same way as `on_lost`:
the line, then os._exit(EXIT_CRASH) (the thread must not return into the C++
that would abort). Any other uncaught C++ exception gets the default handler.

The status, with the lost process's number, never reaches Python, so a thread
names it: every process bumps its own counter in the coordination service's
key-value store every few seconds, and the process whose counter stopped is
the lost one. It only names; JAX's heartbeat timeout alone decides that a
process is lost, so a slow host is never judged dead here.

A peer killed on a live host closes its sockets, and a gloo collective fails at
once with a Python exception ('Connection closed by peer') before the service
decides; so does a key-value call (host_sync's broadcast in a checkpoint save)
when the killed peer is process 0, whose coordination service it asked
('UNAVAILABLE: Socket closed'). `exits` holds such an exception back, up to the
heartbeat timeout, for the service's verdict; without one it goes on as the
crash it is.
"""

import atexit
import contextlib
import ctypes
import os
import sys
import threading
import time
from typing import Any, Iterator

from absl import logging

import errors

KEY = 'olmo3_alive'  # key-value directory of the processes' counters
# A gloo collective whose peer's socket closed, or a key-value call to the coordination
# service whose process 0 closed it: that peer died (its host may live on).
PEER_GONE = ('Connection closed by peer', 'Connection reset by peer', 'Socket closed')
_TERMINATE = ctypes.CFUNCTYPE(None)


class _State:
  watch: '_Watch | None' = None
  handler: Any = None  # the ctypes terminate handler: kept alive while installed
  exiting: int | None = None  # the exit code a process already on its way out keeps
  waiting = False  # `exits` holds a collective's failure back for the verdict


_STATE = _State()


class _Watch(threading.Thread):
  """Bumps this process's counter and notes when each peer's last changed."""

  def __init__(self, client: Any, index: int, count: int, address: str, heartbeat_timeout: int):
    super().__init__(name='peer-watch', daemon=True)
    self.client, self.index, self.count, self.address = client, index, count, address
    self.heartbeat_timeout = heartbeat_timeout
    self.interval = max(0.25, min(5.0, heartbeat_timeout / 10))  # well inside the timeout
    self.beat = 0
    self.values: dict[int, str] = {}
    self.changed: dict[int, float] = {}  # when this process saw each counter change
    self.polled: float | None = None  # the last time the store answered
    self.stop = threading.Event()

  def run(self) -> None:
    while not self.stop.wait(self.interval if self.beat else 0):
      self.poll()

  def poll(self) -> None:
    """Bumps this process's counter and reads everyone's."""
    self.beat += 1
    try:
      self.client.key_value_set(f'{KEY}/{self.index}', str(self.beat), allow_overwrite=True)
      seen = dict(self.client.key_value_dir_get(f'{KEY}/'))
    except Exception:  # pylint: disable=broad-except  # the store unreachable: see message()
      return
    now = time.monotonic()
    for i in range(self.count):
      value = seen.get(f'{KEY}/{i}')
      if i not in self.changed or value != self.values.get(i):
        self.values[i], self.changed[i] = value, now
    self.polled = now

  def lost(self) -> list[int]:
    """The peers whose counters had stopped, by one more look at the store (this thread
    may have been starved for a while on a loaded host) that waits at most a few seconds:
    a lost peer's counter stopped about a heartbeat timeout ago, a live one's just moved."""
    look = threading.Thread(target=self.poll, name='peer-look', daemon=True)
    look.start()
    look.join(min(5.0, 4 * self.interval))
    if self.polled is None:
      return []
    stale = max(2 * self.interval, self.heartbeat_timeout / 2)
    return [i for i in range(self.count) if i != self.index
            and self.polled - self.changed[i] > stale]


def watch(client: Any, index: int, count: int, address: str, heartbeat_timeout: int) -> None:
  """Starts naming lost peers and installs the terminate handler (see the module doc)."""
  _STATE.watch = _Watch(client, index, count, address, heartbeat_timeout)
  _STATE.watch.start()
  atexit.register(_STATE.watch.stop.set)  # runs before jax's shutdown (registered earlier)
  _hook_terminate()


def on_lost(*status: Any) -> None:
  """The client's missed_heartbeat_callback: a JAX that can pass the status to Python."""
  _end(' '.join(str(s) for s in status))


def message(status: str = '') -> str:
  """The line's text: who was lost, as far as this process can tell."""
  w = _STATE.watch
  restart = ('this process stops with exit code 1; start every process of the run again '
             '(or run it under scripts/launch.py) and it resumes from the last committed '
             'checkpoint.')
  lost = w.lost() if w else []
  if lost:
    names = ', '.join(str(i) for i in lost)
    return (f'process {names} of this multi-process run was lost (jax.distributed\'s '
            'coordination service stopped hearing from it: its host died, was preempted or '
            f'was replaced); {restart}')
  if w and w.index != 0:
    return (f'process 0 of this multi-process run was lost, or this host lost the network '
            f'to it: jax.distributed\'s coordination service (process 0, at {w.address}) '
            f'stopped answering; {restart}')
  detail = f' ({" ".join(status.split())[:300]})' if status else ''
  return ('jax.distributed\'s coordination service reported a process of this multi-process '
          f'run lost{detail}, though no peer\'s counter had stopped (this process may have '
          f'been too slow to send its own heartbeats); {restart}')


def _end(status: str = '') -> None:
  """Ends the process without returning (the caller is a C++ thread about to abort)."""
  code = _STATE.exiting
  line = ''
  if code is None or _STATE.waiting:
    code, line = errors.EXIT_CRASH, f'error: {" ".join(message(status).split())}\n'
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except Exception:  # pylint: disable=broad-except  # a closed stream: nothing to lose
      pass
  if line:
    os.write(2, line.encode())
  os._exit(code)  # pylint: disable=protected-access  # no atexit: jax's would block on the dead


def _hook_terminate() -> None:
  """Installs the terminate handler; without libstdc++ (not Linux) the abort stays."""
  try:
    lib = ctypes.CDLL('libstdc++.so.6')
    set_terminate, current_type = lib._ZSt13set_terminatePFvvE, lib.__cxa_current_exception_type
  except (OSError, AttributeError):
    logging.info('No libstdc++ terminate hook: a lost peer aborts this process.')
    return
  set_terminate.restype, set_terminate.argtypes = ctypes.c_void_p, [_TERMINATE]
  current_type.restype = ctypes.c_void_p
  previous = None

  def on_terminate() -> None:
    info = current_type()  # a std::type_info*: its name follows its vtable pointer
    name = ctypes.cast(info + ctypes.sizeof(ctypes.c_void_p), ctypes.POINTER(ctypes.c_char_p)
                       )[0] if info else None
    if name == b'St8bad_cast':  # jaxlib's callback could not pass its status (module doc)
      _end()
    if previous:
      _TERMINATE(previous)()
    os.abort()
  if _STATE.handler is None:
    _STATE.handler = _TERMINATE(on_terminate)
    previous = set_terminate(_STATE.handler)


def _peer_gone(error: BaseException | None) -> bool:
  while error is not None:
    if any(marker in str(error) for marker in PEER_GONE):
      return True
    error = error.__cause__ or error.__context__
  return False


@contextlib.contextmanager
def exits() -> Iterator[None]:
  """Around a multi-process run: notes the code a process is exiting with (a verdict that
  comes after it, in jax's shutdown, keeps that code and adds no line), and holds a
  collective's failure from a vanished peer back until the service names the lost process."""
  try:
    yield
  except BaseException as e:
    if isinstance(e, SystemExit):
      code = e.code if isinstance(e.code, int) else int(e.code is not None)
    else:
      code = errors.EXIT_CRASH
    w = _STATE.watch
    if w is not None and not isinstance(e, SystemExit) and _peer_gone(e):
      wait = 1.5 * w.heartbeat_timeout + 2 * w.interval + 10
      logging.warning('A collective failed because a peer closed its connection; waiting up to '
                      '%.0f s for jax.distributed to name the lost process.', wait)
      _STATE.waiting = True
      time.sleep(wait)  # _end exits the process when the verdict comes
      _STATE.waiting = False
    _STATE.exiting = code
    raise
  _STATE.exiting = errors.EXIT_OK
