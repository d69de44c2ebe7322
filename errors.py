"""What a run's exit code means, and the errors a user can fix.

Every entry point (train.py, plan.py, eval.py, convert.py, the scripts) exits
with one of these codes, and scripts/launch.py restarts only the ones a
restart can fix: a crash, a preemption, or a trainer killed by a signal (or
by the launcher's stall watchdog). A mistake the user must fix (a config
field, a flag, a path, the data, the workdir, memory, the mesh, a resume that
would not continue the run) is raised as a `UserError`: the entry point prints
its message as one line on stderr, logs the stack, and exits with its code.
This module imports nothing from the project, so the launcher can read it
without loading JAX.
"""

import contextlib
import os
import sys
import time
import traceback
from typing import Callable, NoReturn

from absl import logging

EXIT_OK = 0  # done (train.py: cfg.train.steps reached, now or by an earlier run)
EXIT_CRASH = 1  # an unexpected error (a traceback): a restart may fix it
EXIT_USAGE = 2  # a config, flag, path, workdir, memory, mesh or resume mistake
EXIT_PREEMPTED = 3  # SIGTERM/SIGINT: checkpointed where the grace allowed; rerun the command
EXIT_DIVERGED = 4  # the divergence guard stopped the run: rerunning it unchanged repeats that
EXIT_DATA = 5  # a data mistake: missing, malformed or mismatched token files or tokenizer

# What scripts/launch.py restarts (a negative code, death by a signal, is restarted too).
RESTARTABLE = (EXIT_CRASH, EXIT_PREEMPTED)

MEANING = {
    EXIT_OK: 'done',
    EXIT_CRASH: 'crashed',
    EXIT_USAGE: 'a usage or config error (fix the command, config or workdir)',
    EXIT_PREEMPTED: 'preempted, checkpoint written',
    EXIT_DIVERGED: 'diverged (the divergence guard stopped it)',
    EXIT_DATA: 'a data error (fix the data or its settings)',
}


class UserError(Exception):
  """A mistake the user can fix; the message names the problem and the fix."""
  exit_code = EXIT_USAGE


class ConfigError(UserError, ValueError):
  """A config field, flag or setting that cannot run (EXIT_USAGE)."""


class DataError(UserError, ValueError):
  """Token files, a mix or a tokenizer that do not match the run (EXIT_DATA)."""
  exit_code = EXIT_DATA


def report(message: str, code: int) -> NoReturn:
  """Prints `error: message` as one line on stderr and exits with `code`."""
  print(f'error: {" ".join(str(message).split())}', file=sys.stderr, flush=True)
  raise SystemExit(code)


@contextlib.contextmanager
def one_line(log_file: str | None = None, also: tuple[type[BaseException], ...] = (),
             append: Callable[[str, str], None] | None = None,
             restartable: tuple[type[BaseException], ...] = ()):
  """Turns a UserError (and the `also` types, as EXIT_USAGE) into one line and an exit code.

  The stack goes to `log_file` (appended, when given and writable, by `append`:
  storage.append for a workdir that may be a bucket; a local file by default) and to
  absl's log at verbosity 1 (`-v 1`), not to the terminal: the message names
  the problem and the fix, and a traceback above it only hides it. Anything
  else propagates as it is: a crash, with its traceback (EXIT_CRASH), except the
  `restartable` types (the storage failing: a rerun may succeed), which are one
  line too, with EXIT_CRASH.
  """
  try:
    yield
  except UserError as e:
    _log_stack(_log_file_for(e, log_file), append)
    report(str(e), e.exit_code)
  except also as e:  # pylint: disable=catching-non-exception  # () catches nothing
    _log_stack(_log_file_for(e, log_file), append)
    report(str(e), EXIT_USAGE)
  except restartable as e:  # pylint: disable=catching-non-exception
    _log_stack(_log_file_for(e, log_file), append)
    report(str(e), EXIT_CRASH)


def _log_file_for(error: BaseException, log_file: str | None) -> str | None:
  """`log_file`, unless it is kept in the store `error` reports failing (its
  `failed_store`, e.g. 's3://BUCKET', on it or on an error it was raised from): appending
  there would wait out the same retries again before the line is printed."""
  seen = error
  while seen is not None and log_file:
    failed = getattr(seen, 'failed_store', '')
    if failed and (log_file == failed or log_file.startswith(failed.rstrip('/') + '/')):
      return None
    seen = seen.__cause__ or seen.__context__
  return log_file


def _append_local(path: str, text: str) -> None:
  with open(path, 'a') as f:
    f.write(text)


def _log_stack(log_file: str | None, append: Callable[[str, str], None] | None) -> None:
  stack = traceback.format_exc()
  logging.vlog(1, '%s', stack)
  if log_file:
    try:
      (append or _append_local)(
          log_file, f'--- {time.strftime("%Y-%m-%d %H:%M:%S")} pid {os.getpid()}\n{stack}')
    except OSError:
      pass  # an unwritable workdir is often the error being reported


class MissingDataError(DataError, FileNotFoundError):
  """A token file, mix or tokenizer that is not there (EXIT_DATA)."""
