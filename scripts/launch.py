"""Runs the trainer until it finishes, restarting it after crashes and preemptions.

  python scripts/launch.py -- python train.py --config=configs/olmo3_7b.py --workdir=/ckpt/run

Everything after `--` is the trainer command. It is restarted, unchanged, after
any exit other than 0 and train.EXIT_DIVERGED (train.py exits 0 only once
cfg.train.steps is reached; EXIT_PREEMPTED after a SIGTERM checkpoint;
EXIT_DIVERGED when its divergence guard stopped it, which a rerun of the
same command would only repeat, so the launcher exits with it; anything else
is a crash).
Each restart resumes from the latest committed checkpoint in --workdir. A
restart that followed progress (a newer committed checkpoint step than before
the attempt) waits --backoff seconds; attempts without progress wait twice as
long each time, up to --max_backoff, and after --max_failures of them in a row
the launcher gives up with the trainer's exit code. SIGTERM/SIGINT to the
launcher are passed to the trainer (which checkpoints and exits), and then the
launcher exits too. Every start, exit and restart is logged to stderr and to
<workdir>/launcher.log. See BUILD.md for TPU pods (one launcher per host, same
command) and SLURM (one launcher around `srun`).
"""

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checkpoint  # noqa: E402  (repo root on the path first)

# train.py's exit codes, repeated rather than importing the whole trainer (the model,
# kernels, data); tests/test_launch.py checks that they match.
EXIT_PREEMPTED = 3  # train.EXIT_PREEMPTED
EXIT_DIVERGED = 4  # train.EXIT_DIVERGED


def parse_args(argv: list[str]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n')[0],
      usage='launch.py [options] -- TRAINER COMMAND (e.g. python train.py --workdir=DIR ...)')
  parser.add_argument('--workdir', default=None,
                      help="the trainer's workdir (default: its --workdir= argument)")
  parser.add_argument('--max_failures', type=int, default=5,
                      help='give up after this many attempts in a row without progress')
  parser.add_argument('--backoff', type=float, default=10.0,
                      help='seconds before a restart; doubles per attempt without progress')
  parser.add_argument('--max_backoff', type=float, default=600.0,
                      help='the longest wait between attempts, in seconds')
  if '--' not in argv:
    parser.error('put the trainer command after `--`.')
  split = argv.index('--')
  args = parser.parse_args(argv[:split])
  args.command = argv[split + 1:]
  if not args.command:
    parser.error('the trainer command after `--` is empty.')
  if args.workdir is None:
    found = [a.split('=', 1)[1] for a in args.command if a.startswith('--workdir=')]
    if not found:
      parser.error('no --workdir: pass --workdir=DIR to the launcher or --workdir=DIR '
                   '(with "=") in the trainer command.')
    args.workdir = found[-1]
  if args.max_failures < 1 or args.backoff < 0 or args.max_backoff < args.backoff:
    parser.error('need --max_failures >= 1 and 0 <= --backoff <= --max_backoff.')
  return args


class Launcher:
  """The restart loop; `run()` returns the exit code for the launcher itself."""

  def __init__(self, command: list[str], workdir: str, max_failures: int = 5,
               backoff: float = 10.0, max_backoff: float = 600.0):
    self.command, self.workdir = command, workdir
    self.max_failures, self.backoff, self.max_backoff = max_failures, backoff, max_backoff
    self.ckpt_dir = os.path.join(workdir, 'checkpoints')
    self.child: subprocess.Popen | None = None
    self.stopping = False
    os.makedirs(workdir, exist_ok=True)
    self.log_file = open(os.path.join(workdir, 'launcher.log'), 'a')

  def log(self, message: str) -> None:
    line = f'[launch {datetime.datetime.now().isoformat(timespec="seconds")}] {message}'
    print(line, file=sys.stderr, flush=True)
    self.log_file.write(line + '\n')
    self.log_file.flush()

  def _forward(self, signum, frame) -> None:
    del frame
    self.stopping = True
    if self.child is not None and self.child.poll() is None:
      self.log(f'signal {signum}: passing it to the trainer (pid {self.child.pid}), then exiting.')
      self.child.send_signal(signum)

  def run(self) -> int:
    # The handlers are put back on return: a caller in the same process (or a
    # child it forks later) must not inherit a SIGTERM that only sets a flag.
    previous = {sig: signal.signal(sig, self._forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
      return self._supervise()
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)

  def _supervise(self) -> int:
    failures, attempt = 0, 0
    best = checkpoint.latest_step(self.ckpt_dir)
    while True:
      attempt += 1
      self.child = subprocess.Popen(self.command)
      self.log(f'attempt {attempt}: started pid {self.child.pid} (latest checkpoint: '
               f'{best}): {" ".join(self.command)}')
      rc = self.child.wait()
      if rc == 0:
        self.log(f'attempt {attempt}: trainer finished (exit 0).')
        return 0
      if rc == EXIT_DIVERGED:
        self.log(f'attempt {attempt}: trainer stopped by its divergence guard (exit {rc}); '
                 'not restarting: fix the cause its message names, then relaunch.')
        return rc
      what = ('preempted, checkpoint written' if rc == EXIT_PREEMPTED else
              f'killed by signal {-rc}' if rc < 0 else f'crashed with exit code {rc}')
      if self.stopping:
        self.log(f'attempt {attempt}: trainer {what}; launcher was signalled, not restarting.')
        return rc if rc > 0 else 128 - rc
      latest = checkpoint.latest_step(self.ckpt_dir)
      progressed = latest is not None and (best is None or latest > best)
      failures = 0 if progressed else failures + 1
      best = latest if progressed else best
      if failures >= self.max_failures:
        self.log(f'attempt {attempt}: trainer {what}; {failures} attempts in a row without a '
                 f'new checkpoint (latest: {best}). Giving up.')
        return rc if rc > 0 else 128 - rc
      delay = min(self.max_backoff, self.backoff * 2 ** failures)
      self.log(f'attempt {attempt}: trainer {what}; latest checkpoint {latest} '
               f'({"progress" if progressed else f"no progress, {failures} in a row"}); '
               f'restarting in {delay:g} s.')
      time.sleep(delay)
      if self.stopping:
        return 128 + signal.SIGTERM


def main(argv: list[str]) -> int:
  args = parse_args(argv)
  return Launcher(args.command, args.workdir, args.max_failures, args.backoff,
                  args.max_backoff).run()


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
