"""A fork server for the tests' Python children: `python train.py ...` without the imports.

Importing JAX and the project is about a third of a tiny trainer's CPU (1.1 of
3.4 CPU-seconds; docs/results/tests.md), and the suite starts some 400 Python
children. A zygote imports the project's libraries once, starts no JAX backend
(so it has one thread and may fork), and forks one child per command. The child
is the command as `python SCRIPT ARGS` or `python -c CODE ARGS` would run it: a
process of its own, adopted by the test process (which is a child subreaper only
while it asks), so `subprocess` waits for it, signals it and reads its exit code
as usual; the caller's stdin, stdout, stderr, cwd and environment; a fresh
`__main__`; and the interpreter's exit (non-daemon threads joined, atexit run).

Where a forked child could differ from a new interpreter, the command starts
afresh instead:
  * The environment a zygote imported under: a zygote serves only children that
    agree with it on every variable Python code read while it imported (it
    records them: JAX's options, workdir_lock's lease, TMPDIR, ...) and on every
    variable native code may read as it loads (NATIVE_PREFIXES, less the few
    read only when first used: READ_AT_FIRST_USE). Another
    environment gets a zygote of its own (at most MAX_ZYGOTES, the oldest stopped);
    one whose zygote could not start (an import started a thread) gets none.
  * Only `python FILE` with FILE in the repository root, and `python -c` run from
    it: there a new interpreter's sys.path[0] is the root too, so whatever the
    zygote had imported from it, the child would also find.
  * Interpreter options, preexec_fn, pass_fds, users, groups, umask and process
    groups; and every child of a test marked `fresh_interpreter`.
Left different, and tested nowhere: the child's start time (/proc/PID/stat) is
the fork, after the imports, and `sys.orig_argv` and /proc/PID/cmdline are the
zygote's.

OLMO_TESTS_FORK=0 starts every child afresh. The session's summary says how many
children were forked, by how many zygotes, and how many started afresh.
"""

import atexit
import builtins
import ctypes
import gc
import importlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a zygote imports: everything train.py, convert.py and plan.py import (none of them
# defines flags at import) and eval.py's scorer. eval.py's task suites load a library that
# starts a thread (jemalloc's), so they are left to the child.
PRELOAD = ('train', 'convert', 'plan', 'evaluation.scoring')
# Variables native code may read as it loads (Python's own, the allocator's, BLAS, XLA's
# and TensorFlow's logging, JAX's); a zygote and its children agree on all of these, and on
# each variable Python code read while the zygote imported (it records them).
NATIVE_PREFIXES = ('PYTHON', 'LD_', 'MALLOC', 'GLIBC', 'OPENBLAS', 'OMP_', 'MKL', 'TF_',
                   'TSL_', 'JAX_', 'TENSORSTORE', 'GRPC_', 'TPU_', 'CUDA', 'NCCL')
# Native variables read only when first used, never while importing: a zygote (which only
# imports) has not read them, so its children may differ in them. tensorstore reads the GCS
# endpoint when its GCS driver first forms a URL (kvstore/gcs: GetGcsBaseUrl) and the curl
# timeouts when it makes its first HTTP transport (internal/curl: DefaultConfig). Each
# storage test's fault proxy is an endpoint of its own: matched on, every proxy's trainers
# needed a zygote of their own (16 zygotes for the storage files' 73 forked children).
READ_AT_FIRST_USE = frozenset({'TENSORSTORE_GCS_HTTP_URL',
                               'TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS',
                               'TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES'})
MAX_ZYGOTES = 3  # per test process; each holds ~250 MB, mostly shared with its children
STATS = {'forked': 0, 'afresh': 0, 'zygotes': 0}
PAUSED = [False]  # set while a test marked `fresh_interpreter` runs (conftest.py)
INSTALLED = [False]
_ZYGOTES: list['Zygote'] = []  # the most recently used last
_FAILED: set[tuple] = set()  # the native variables of zygotes that failed to start
_LOCK = threading.Lock()
_ORIGINAL = subprocess.Popen._execute_child  # pylint: disable=protected-access


# --- The test process's side -------------------------------------------------------------


def install() -> None:
  """Routes forkable children through a zygote, for this process, unless OLMO_TESTS_FORK=0."""
  if (os.environ.get('OLMO_TESTS_FORK', '1') == '0' or not sys.platform.startswith('linux')
      or not _adopting(False)):
    return
  subprocess.Popen._execute_child = _execute_child  # pylint: disable=protected-access
  atexit.register(stop_all)
  INSTALLED[0] = True


def stop_all() -> None:
  while _ZYGOTES:
    _ZYGOTES.pop().stop()


def _request(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, shell, gid, gids,
             uid, umask, start_new_session, process_group) -> dict | None:
  """The request a zygote can serve, or None: start it afresh."""
  if (PAUSED[0] or shell or executable or preexec_fn or pass_fds or not close_fds
      or gid is not None or gids is not None or uid is not None or umask != -1
      or process_group not in (None, -1) or isinstance(args, (str, bytes)) or not args):
    return None
  argv = [os.fsdecode(a) for a in args]
  if argv[0] != sys.executable or len(argv) < 2:
    return None
  cwd = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
  if argv[1] == '-c':
    if len(argv) < 3 or cwd != REPO:
      return None
    script = None
  elif argv[1].startswith('-'):
    return None
  else:
    script = os.path.join(cwd, argv[1])
    if os.path.dirname(os.path.abspath(script)) != REPO or not os.path.isfile(script):
      return None
  env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
  return dict(argv=argv[1:], script=script, cwd=cwd, env=env,
              new_session=bool(start_new_session))


def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                   startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                   errread, errwrite, restore_signals, gid, gids, uid, umask,
                   start_new_session, process_group):
  """subprocess.Popen's own, but a forkable command is forked by a zygote."""
  request = _request(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, shell, gid,
                     gids, uid, umask, start_new_session, process_group)
  pid = None
  if request is not None:
    fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
           errwrite if errwrite != -1 else 2]
    with _LOCK:
      zygote = _zygote_for(request['env'])
      pid = zygote.fork(request, fds) if zygote else None
  if pid is None:
    STATS['afresh'] += 1
    return _ORIGINAL(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                     startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                     errread, errwrite, restore_signals, gid, gids, uid, umask,
                     start_new_session, process_group)
  STATS['forked'] += 1
  self.pid, self._child_created = pid, True
  self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
  return None


def _is_native(name: str) -> bool:
  return name.startswith(NATIVE_PREFIXES) and name not in READ_AT_FIRST_USE


def _native(env: dict[str, str]) -> tuple:
  return tuple(sorted((k, v) for k, v in env.items() if _is_native(k)))


def _zygote_for(env: dict[str, str]) -> 'Zygote | None':
  """A running zygote that agrees with `env` on what it read at import, else a new one;
  None where one failed to start before (e.g. BLAS threads at import: not forkable)."""
  for dead in [z for z in _ZYGOTES if z.proc.poll() is not None]:  # its slot is free again
    _ZYGOTES.remove(dead)
    dead.stop()
  for zygote in reversed(_ZYGOTES):
    if zygote.serves(env):
      _ZYGOTES.remove(zygote)
      break
  else:
    if _native(env) in _FAILED:
      return None
    zygote = Zygote(env)
    while len(_ZYGOTES) >= MAX_ZYGOTES:
      _ZYGOTES.pop(0).stop()
  _ZYGOTES.append(zygote)
  return zygote


class Zygote:
  """One server process (a real child of the test process) and its socket."""

  def __init__(self, env: dict[str, str]):
    STATS['zygotes'] += 1
    self.env = env
    self.dir = tempfile.mkdtemp(prefix='zygote-')
    self.address = os.path.join(self.dir, 'socket')
    self.proc = _start_afresh([sys.executable, os.path.abspath(__file__), self.address], env)
    self.read: set[str] | None = None  # what its imports read; None until it is ready

  def serves(self, env: dict[str, str]) -> bool:
    if not self._ready():
      return False
    names = self.read | {k for k in (*env, *self.env) if _is_native(k)}
    return all(env.get(k) == self.env.get(k) for k in names)

  def _ready(self, timeout: float = 120) -> bool:
    deadline = time.time() + timeout
    while self.read is None:
      try:
        with open(self.address + '.read') as f:
          self.read = set(json.load(f))
      except (OSError, ValueError):  # not written yet, or half written
        if self.proc.poll() is not None or time.time() > deadline:
          return False
        time.sleep(0.02)
    return self.proc.poll() is None

  def fork(self, request: dict, fds: list[int]) -> int | None:
    """The child's pid, or None when this zygote cannot serve (it failed to start)."""
    if not self._ready():
      _FAILED.add(_native(self.env))
      return None
    try:
      _adopting(True)  # for this child only: other orphans still go to init, which reaps
      with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:  # one message each
        conn.connect(self.address)
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        answer = conn.recv(64)  # sent once the child's first parent has exited
      return int(answer) if answer.isdigit() else None
    except OSError:
      return None
    finally:
      _adopting(False)

  def stop(self) -> None:
    self.proc.kill()
    self.proc.wait()
    for name in os.listdir(self.dir):
      os.unlink(os.path.join(self.dir, name))
    os.rmdir(self.dir)


def _adopting(on: bool) -> bool:
  """Makes this process the child subreaper (an orphan below it becomes its child), or not."""
  PR_SET_CHILD_SUBREAPER = 36
  return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


def _start_afresh(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
  saved = subprocess.Popen._execute_child  # pylint: disable=protected-access
  subprocess.Popen._execute_child = _ORIGINAL  # pylint: disable=protected-access
  try:
    return subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
  finally:
    subprocess.Popen._execute_child = saved  # pylint: disable=protected-access


class _RecordingEnviron(os._Environ):  # pylint: disable=protected-access
  """os.environ that notes each variable read (os.getenv, `in`, .get all come here)."""
  READ: set[str] = set()

  def __getitem__(self, key):
    _RecordingEnviron.READ.add(key)
    return super().__getitem__(key)


# --- The zygote's side -------------------------------------------------------------------


def serve(address: str) -> None:
  """Imports PRELOAD, then forks a child per request until the test process is gone."""
  PR_SET_PDEATHSIG = 1
  ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  base_path = sys.path[1:]  # the interpreter's own, without this file's folder
  sys.path.insert(0, REPO)
  os.environ.__class__ = _RecordingEnviron
  for name in PRELOAD:
    importlib.import_module(name)
  os.environ.__class__ = os._Environ  # pylint: disable=protected-access
  if len(os.listdir('/proc/self/task')) != 1:  # a thread would not survive a fork
    sys.exit('zygote: an import started a thread; not forking')
  gc.collect()
  with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
    server.bind(address)
    server.listen(8)
    with open(address + '.tmp', 'w') as f:  # renamed: the client never reads half of it
      json.dump(sorted(_RecordingEnviron.READ), f)
    os.rename(address + '.tmp', address + '.read')
    while True:
      conn, _ = server.accept()
      with conn:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        request = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:  # exits at once, so the child is adopted by the test process
          pid = os.fork()
          if pid == 0:
            os.close(read)
            conn.close()
            server.close()
            _run_child(request, fds, base_path)
          os.write(write, str(pid).encode())
          os._exit(0)
        os.close(write)
        pid = os.read(read, 32)
        os.close(read)
        os.waitpid(middle, 0)
        for fd in fds:
          os.close(fd)
        conn.sendall(pid)


def _run_child(request: dict, fds: list[int], base_path: list[str]) -> None:
  """Becomes `python ARGV...` and exits as the interpreter would; never returns."""
  code = 1
  try:
    if request['new_session']:
      os.setsid()
    for target, fd in enumerate(fds):
      os.dup2(fd, target)
    os.closerange(3, os.sysconf('SC_OPEN_MAX'))
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    if 'numpy' in sys.modules:  # a fresh interpreter seeds its global generator afresh
      sys.modules['numpy'].random.seed()
    script = request['script']
    sys.argv = list(request['argv'])
    main = types.ModuleType('__main__')
    main.__builtins__ = builtins
    if script is None:  # python -c CODE: sys.argv[0] is '-c', sys.path[0] the cwd ('')
      sys.path[:] = ['', *base_path]
      source, filename = sys.argv.pop(1), '<string>'
    else:
      sys.path[:] = [os.path.dirname(script), *base_path]  # absolute, as since Python 3.9
      with io.open_code(script) as f:
        source, filename = f.read(), script
      main.__file__ = script
    sys.modules['__main__'] = main
    code = _exit_code(lambda: exec(compile(source, filename, 'exec'), main.__dict__))
  finally:
    os._exit(code)  # pylint: disable=protected-access


def _exit_code(run) -> int:
  """Runs `run` and finishes like the interpreter: the exit code it would return."""
  try:
    run()
    code = 0
  except SystemExit as e:
    code = _system_exit_code(e)
  except BaseException as e:  # pylint: disable=broad-except
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
      tb = tb.tb_next  # the traceback starts where the command's own code does
    sys.excepthook(type(e), e.with_traceback(tb), tb)
    code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
  try:
    threading._shutdown()  # pylint: disable=protected-access  # joins non-daemon threads
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  except SystemExit as e:
    code = _system_exit_code(e)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  if code < 0:  # as Python does for an uncaught Ctrl-C: end by the signal itself
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  return code & 0xFF


def _system_exit_code(e: SystemExit) -> int:
  if e.code is None:
    return 0
  if isinstance(e.code, int):
    return e.code
  print(e.code, file=sys.stderr)
  return 1


if __name__ == '__main__':
  serve(sys.argv[1])
