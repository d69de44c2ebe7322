"""A run's goodput account: where its wall time went, across every start so far.

    python scripts/goodput.py --workdir=W [--json]

Reads <workdir>/goodput/ (a path or a gs:// / s3:// URL), which train.py's
process 0 keeps up to date at every log and save step (monitor/goodput.py; the
categories are in docs/goodput.md). Prints the one line train.py prints when a
process ends, then seconds and % per category; --json prints the account as
one JSON object. Works while the run is going: the running process counts up
to its last record.
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import errors  # noqa: E402
from monitor import goodput  # noqa: E402
from store import storage  # noqa: E402

FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    errors.report(f'unexpected arguments {argv[1:]}; flags take the form --name=value.',
                  errors.EXIT_USAGE)
  if not FLAGS.workdir:
    errors.report('--workdir is required: the run\'s workdir (train.py --workdir).',
                  errors.EXIT_USAGE)
  with errors.one_line():
    workdir = storage.canonical(FLAGS.workdir, '--workdir', writes=False)
    account = goodput.summary(workdir)
    if not account['starts']:
      raise errors.ConfigError(f'{workdir} has no goodput records ({goodput.FOLDER}/): point '
                               '--workdir at a train.py workdir (runs record from their start).')
  if FLAGS.json:
    print(json.dumps(account, indent=1))
    return
  print(goodput.line(account))
  if account['time to first step (s)'] is not None:
    print(f"time to first step (last start): {account['time to first step (s)']:.1f}s")
  for name, seconds in sorted(account['seconds'].items(), key=lambda kv: -kv[1]):
    print(f"  {name:<28s} {seconds:>12.1f}s  {account['percent'][name]:6.2f}%")


if __name__ == '__main__':
  flags.DEFINE_string('workdir', None, 'The run\'s workdir (a path or a gs:// / s3:// URL).')
  flags.DEFINE_bool('json', False, 'Print the account as one JSON object.')
  app.run(main)
