"""A train.py child that SIGKILLs itself at a chosen point of a checkpoint save (tests).

`trainer_script(kill)` is the source of a `python -c` program: train.py's own
command line (train.run()), with tests/test_rollback.py's planted loss spike
(`poison`) and, with `kill`, a wrapper around one function of the save path
that kills the process (SIGKILL: no clean-up, no atexit, no flush) while it
saves the step named by $KILL_STEP:

  'mid-chunks'       chunk_store.write_local writes the first half of this
                     process's arrays, then the process dies: a partial step
                     with some chunks and no metadata.json.
  'before-metadata'  step_dirs.commit is entered (every chunk written and
                     verified) and the process dies before metadata.json.
  'before-commit'    metadata.json is written and the process dies just before
                     COMMIT (storage.write_atomic of the marker, in storage.commit).
"""

import sys

KILLS = ('mid-chunks', 'before-metadata', 'before-commit')

_HOOKS = {
    'mid-chunks': '''
from store import chunk_store
_write_local = chunk_store.write_local
def write_local(root, arrays, *args, **kw):
  if root.rstrip('/').endswith('step_' + os.environ['KILL_STEP']):
    _write_local(root, arrays[:len(arrays) // 2], *args, **kw)
    die()
  return _write_local(root, arrays, *args, **kw)
chunk_store.write_local = write_local
''',
    'before-metadata': '''
from store import step_dirs
_commit = step_dirs.commit
def commit(directory, staged, step, *args, **kw):
  if step == int(os.environ['KILL_STEP']):
    die()
  return _commit(directory, staged, step, *args, **kw)
step_dirs.commit = commit
''',
    'before-commit': '''
from store import storage
_write_atomic = storage.write_atomic
def write_atomic(path, data, fsync=True):
  if path.endswith('/step_' + os.environ['KILL_STEP'] + '/COMMIT'):
    die()
  return _write_atomic(path, data, fsync)
storage.write_atomic = write_atomic
''',
}


def trainer_script(repo: str, poison: str = '', kill: str | None = None) -> str:
  """Source of a train.py child: `poison` (POISON_CODE + INSTALL_POISON) and the `kill` hook."""
  if kill is not None and kill not in _HOOKS:
    raise ValueError(f'kill={kill!r}: one of {KILLS}')
  return ('import os, signal, sys\n'
          f'sys.path.insert(0, {repo!r})\n'
          'def die():\n'
          '  sys.stdout.flush(); sys.stderr.flush()\n'
          '  os.kill(os.getpid(), signal.SIGKILL)\n'
          + poison + (_HOOKS[kill] if kill else '') +
          'import train\n'
          'train.run()\n')


if __name__ == '__main__':
  print(trainer_script('.', kill=sys.argv[1] if len(sys.argv) > 1 else None))
