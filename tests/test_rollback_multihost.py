"""Automatic rollback on two processes (monitor/rollback.py, issue 33), for real on this machine.

Two train.py processes x 2 simulated CPU devices, joined by jax.distributed on
localhost (as tests/test_multihost.py runs them), train tests/test_rollback.py's
poisoned files with its planted NaN and spike: step 5 is skipped (so state 4,
which it judges, is unhealthy), step 6 trips the divergence guard, both
processes roll back to step 3 and skip global batches [3, 7). Process 0 writes
the log and renames; the other waits at the barriers, and both restore from
the shared checkpoint directory.

The references: two processes told from their start to skip the same window
(train.skip_batches), which never read a poisoned batch: the recovery ends
bit-identical to it; one process with the same 4 devices, which recovers the
same way (the same log, the same checkpoints) to the same state up to the
reduction order of the two processes' collectives (the tolerance of
tests/test_multihost.py: runs on one and on two processes are never bitwise
equal, rollback or not); and, for a process SIGKILLed in a phase of the
recovery (rollback.phase_done, as tests/test_rollback.py hooks it), the
uninterrupted two-process recovery: the same command rerun ends bit-identical.
"""

import os
import signal
import subprocess
import sys

import pytest

import jax

from servers import free_port
from test_multihost import RETRIED_STARTS, REPO, assert_params_close, communicate_all
from test_rollback import (INSTALL_POISON, LR, POISON_CODE, RUN, STEPS, WINDOW,  # noqa: F401
                           poisoned_files, read_log, run_config)
from test_train import assert_states_equal, committed, config_flags, host_state
from xla_flags import with_devices

DEVICES = 4  # in all: one process x 4, or two x 2
HEARTBEAT_TIMEOUT = 5  # s: how soon the survivor of a killed peer gives up

# train.py with the poison; SIGKILLs itself after rollback phase $KILL_AT on process
# $KILL_PROCESS.
TRAINER = (f'import os, signal, sys\nsys.path.insert(0, {str(REPO)!r})\n' + POISON_CODE +
           INSTALL_POISON +
           'import jax; from monitor import rollback; import train\n'
           'done = rollback.phase_done\n'
           'def hooked(phase, attempt):\n'
           '  done(phase, attempt)\n'
           '  if (phase == os.environ.get("KILL_AT")\n'
           '      and str(jax.process_index()) == os.environ.get("KILL_PROCESS")):\n'
           '    os.kill(os.getpid(), signal.SIGKILL)\n'
           'rollback.phase_done = hooked\n'
           'train.run()\n')


def argv(workdir, files, *extra: str) -> list[str]:
  flags = [f'--config.{k}={v}' for k, v in {**RUN, **LR, 'train.rollback_attempts': 3}.items()]
  return [sys.executable, '-c', TRAINER, f'--workdir={workdir}', '--sample_tokens=0',
          *config_flags(files), *flags, *extra]


def env(devices: int, kill: tuple[int, str] | None = None) -> dict[str, str]:
  out = dict(os.environ, XLA_FLAGS=with_devices(devices), JAX_PLATFORMS='cpu',
             PYTHONUNBUFFERED='1')
  for name in ('KILL_AT', 'KILL_PROCESS'):
    out.pop(name, None)
  if kill:
    out['KILL_PROCESS'], out['KILL_AT'] = str(kill[0]), kill[1]
  return out


def run_two(workdir, files, *extra: str, kill: tuple[int, str] | None = None,
            timeout: float = 600) -> list[tuple[int, str]]:
  """Both processes to their end: [(exit code, output)] by process id.

  Gloo gives the processes 30 s to meet at their first collective; on a loaded
  2-core machine one may still be compiling, so that one failure is retried once.
  """
  for attempt in range(3):
    port = free_port()
    procs = [subprocess.Popen(
        argv(workdir, files, *extra, f'--coordinator_address=127.0.0.1:{port}',
             f'--process_id={i}',
             '--num_processes=2',
             # Short only where a peer is killed: a run with no kill keeps the default, so
             # two compiling processes on a loaded machine are not taken for dead ones.
             *([f'--heartbeat_timeout={HEARTBEAT_TIMEOUT}'] if kill else [])),
        cwd=REPO, env=env(DEVICES // 2, kill), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT) for i in range(2)]
    outs = [out for out, _ in communicate_all(procs, timeout)]
    if attempt < 2 and any(m in out for out in outs for m in RETRIED_STARTS):
      continue
    return [(p.returncode, out) for p, out in zip(procs, outs)]


@pytest.fixture(scope='module')
def one_process(poisoned_files, tmp_path_factory):
  """The reference: one process with all 4 devices recovers: (workdir, final host state)."""
  workdir = tmp_path_factory.mktemp('one_process')
  proc = subprocess.run(argv(workdir, poisoned_files), cwd=REPO, env=env(DEVICES),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-5000:]
  assert 'ROLLBACK 1/3' in proc.stderr
  return workdir, host_state(run_config(poisoned_files), workdir, STEPS)


@pytest.fixture(scope='module')
def two_processes(poisoned_files, tmp_path_factory):
  """The same run on two processes x 2 devices, uninterrupted: (workdir, final host state)."""
  workdir = tmp_path_factory.mktemp('two_processes')
  for rc, out in run_two(workdir, poisoned_files):
    assert rc == 0, out[-5000:]
    assert 'ROLLBACK 1/3' in out  # both processes recovered
  return workdir, host_state(run_config(poisoned_files), workdir, STEPS)


def flat(state) -> dict[str, object]:
  return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_leaves_with_path(state)}


@pytest.mark.slow
def test_two_processes_recover_as_one_and_bit_identical_to_a_run_told_to_skip(
    one_process, two_processes, poisoned_files, tmp_path):
  (one, one_state), (two, two_state) = one_process, two_processes
  log = read_log(two)
  assert len(log) == 1 and (log[0]['trigger_step'], log[0]['restored_step'],
                            log[0]['skip']) == (6, 3, WINDOW)
  assert log == read_log(one)  # one entry, written once (by process 0)
  assert committed(two) == committed(one) == list(range(1, STEPS + 1))
  aside = sorted(p.name for p in (two / 'checkpoints').iterdir() if p.name.startswith('rolled'))
  assert aside == ['rolledback.step_4.1', 'rolledback.step_5.1']
  assert_params_close(flat(one_state.params), flat(two_state.params))
  told = tmp_path / 'told'
  skip = (*WINDOW, LR['train.rollback_lr_factor'], LR['train.rollback_lr_steps'])
  for rc, out in run_two(told, poisoned_files, f'--config.train.skip_batches=({skip},)'):
    assert rc == 0, out[-5000:]
  assert not read_log(told)  # it never tripped
  assert_states_equal(two_state, host_state(run_config(poisoned_files), told, STEPS))


@pytest.mark.slow
def test_sigkill_of_either_process_in_the_recovery_then_rerun_is_bit_identical(
    two_processes, poisoned_files, tmp_path):
  """Process 0 killed as the recovery is decided (before it writes the log: the rerun
  trips again and recovers anew), then, in that rerun, process 1 killed once process 0
  has logged the window and set the newer checkpoints aside; then the same command once
  more. (Process 1 killed at 'decided' would leave process 0 free to log the window
  before the barrier: either outcome recovers the same, but not a known one to assert.)"""
  workdir = tmp_path / 'run'
  for (process, phase), logged in (((0, 'decided'), 0), ((1, 'set aside'), 1)):
    killed = run_two(workdir, poisoned_files, kill=(process, phase))
    assert killed[process][0] == -signal.SIGKILL, killed[process][1][-5000:]
    assert killed[1 - process][0] != 0, 'the survivor finished a run its peer never did'
    assert len(read_log(workdir)) == logged, (process, phase)
  for rc, out in run_two(workdir, poisoned_files):  # the same command again
    assert rc == 0, out[-5000:]
  assert read_log(workdir) == read_log(two_processes[0])
  assert committed(workdir) == list(range(1, STEPS + 1))
  assert_states_equal(host_state(run_config(poisoned_files), workdir, STEPS), two_processes[1])
