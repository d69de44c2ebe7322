"""Where the test suite's CPU goes: per Python process, summed by command and by test file.

    python bench/suite_cpu.py [pytest arguments]    # default: -q -n 2 --dist loadfile tests

Runs pytest with a `sitecustomize` on PYTHONPATH that appends, when each Python
process exits, its CPU time (user + sys, from getrusage), its argv, whether
it is pytest itself, and the test that was running (PYTEST_CURRENT_TEST, which subprocesses
inherit) to a JSON-lines file; then prints the sums. A process killed by a
signal runs no exit hook, and non-Python servers (the GCS emulator) have none:
compare the total with the pytest run's own user + sys (`time`), printed by
the shell around this command, to see how much that leaves out.
"""

import collections
import json
import os
import subprocess
import sys
import tempfile

HOOK = '''
import atexit, json, os, resource, sys
def _record():
  usage = resource.getrusage(resource.RUSAGE_SELF)
  record = dict(argv=sys.argv[:2], cpu=usage.ru_utime + usage.ru_stime,
                test=os.environ.get('PYTEST_CURRENT_TEST', ''), pytest='_pytest' in sys.modules)
  try:
    with open(os.environ['SUITE_CPU_LOG'], 'a') as f:
      f.write(json.dumps(record) + '\\n')
  except OSError:  # a test's own limits (a file-size cap, a full disk) must not fail it
    pass
atexit.register(_record)
'''
PYTEST = 'pytest (workers and main)'


def command(record: dict) -> str:
  if record['pytest']:  # the main process and the xdist workers (started through -c)
    return PYTEST
  argv = record['argv']
  return 'python -c (scripts)' if argv[:1] == ['-c'] else os.path.basename(argv[0])


def main() -> None:
  args = sys.argv[1:] or ['-q', '-n', '2', '--dist', 'loadfile', 'tests']
  with tempfile.TemporaryDirectory() as hook_dir:
    with open(os.path.join(hook_dir, 'sitecustomize.py'), 'w') as f:
      f.write(HOOK)
    log = os.path.join(hook_dir, 'processes.jsonl')
    env = dict(os.environ, SUITE_CPU_LOG=log,
               PYTHONPATH=os.pathsep.join(filter(None, [hook_dir, os.environ.get('PYTHONPATH')])))
    code = subprocess.call([sys.executable, '-m', 'pytest', *args], env=env)
    records = []
    if os.path.exists(log):
      with open(log) as f:
        records = [json.loads(line) for line in f]
  by_command, by_file = collections.defaultdict(list), collections.defaultdict(list)
  for r in records:
    by_command[kind := command(r)].append(r['cpu'])
    if kind != PYTEST:
      by_file[r['test'].split('::')[0] or '(no test)'].append(r['cpu'])
  print(f'\n{len(records)} Python processes, {sum(r["cpu"] for r in records):.0f} s of CPU')
  for title, table in (('by command', by_command), ('subprocesses by test file', by_file)):
    print(f'\n{title}:  CPU s  processes')
    for name, cpus in sorted(table.items(), key=lambda kv: -sum(kv[1]))[:25]:
      print(f'  {sum(cpus):8.1f} {len(cpus):5d}  {name}')
  sys.exit(code)


if __name__ == '__main__':
  main()
