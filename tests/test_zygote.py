"""tests/zygote.py's children against new interpreters running the same command.

Each command runs twice, forked by a zygote and started afresh (a new `python`),
and everything a test could observe of it must be the same: exit code or
signal, stdout and stderr (a traceback included), argv, sys.path[0], __name__,
cwd, environment, session, atexit handlers and non-daemon threads at exit.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

import zygote
from test_multihost import REPO

PROBE = r'''
import atexit, json, os, sys, threading, time
atexit.register(lambda: print('atexit ran', flush=True))
def late():
  time.sleep(0.2)
  print('thread done', flush=True)
threading.Thread(target=late).start()  # not a daemon: the exit waits for it
print(json.dumps(dict(argv=sys.argv, path0=sys.path[0], name=__name__, cwd=os.getcwd(),
                      var=os.environ.get('ZYGOTE_PROBE'), leader=os.getsid(0) == os.getpid(),
                      main=sys.modules['__main__'].__dict__ is globals())), flush=True)
print('to stderr', file=sys.stderr, flush=True)
how = sys.argv[1]
if how == 'raise':
  raise ValueError('raised on purpose')
if how == 'message':
  sys.exit('a message instead of a code')
if how == 'kill':
  os.kill(os.getpid(), 9)
if how == 'ctrl-c':
  raise KeyboardInterrupt
sys.exit(int(how))
'''


def run(how: str, new_session: bool, forked: bool) -> tuple[int, list[str], list[str], bool]:
  """(exit code, stdout lines, stderr lines, whether a zygote forked it)."""
  before = zygote.STATS['forked']
  zygote.PAUSED[0] = not forked
  try:
    proc = subprocess.run([sys.executable, '-c', PROBE, how], cwd=REPO, capture_output=True,
                          text=True, timeout=120, start_new_session=new_session,
                          env=dict(os.environ, ZYGOTE_PROBE=how))
  finally:
    zygote.PAUSED[0] = False
  return (proc.returncode, proc.stdout.splitlines(), proc.stderr.splitlines(),
          zygote.STATS['forked'] == before + 1)


@pytest.mark.parametrize('how, new_session', [
    ('0', False), ('3', True), ('raise', False), ('message', False), ('kill', True),
    ('ctrl-c', False)])
def test_a_forked_child_is_what_a_new_interpreter_would_be(how, new_session):
  if not zygote.INSTALLED[0]:
    pytest.skip('the fork server is off (OLMO_TESTS_FORK=0, or not Linux)')
  fresh, forked = run(how, new_session, False), run(how, new_session, True)
  assert forked[3] and not fresh[3]  # the second really was forked, the first was not
  assert forked[:3] == fresh[:3]
  code, out, err, _ = forked
  probe = json.loads(out[0])
  assert probe == dict(argv=['-c', how], path0='', name='__main__', cwd=str(REPO), var=how,
                       leader=new_session, main=True)
  assert code == {'0': 0, '3': 3, 'raise': 1, 'message': 1, 'kill': -signal.SIGKILL,
                  'ctrl-c': -signal.SIGINT}[how]
  if how != 'kill':  # a SIGKILL leaves no exit to run
    assert out[1:] == ['thread done', 'atexit ran'], out
  assert err[0] == 'to stderr'
  assert ('ValueError: raised on purpose' in err) == (how == 'raise')
  assert ('a message instead of a code' in err) == (how == 'message')
