"""deploy/jobset-gpu.yaml and deploy/Dockerfile.cuda against the code they drive: the restart
rules (the TPU manifest's, word for word, so the two cannot drift), the command line
through train.py's own parser, one process per node with every GPU, the image's install.
tests/test_deploy.py holds the controllers' rules these reuse."""

import pathlib
import re
import tomllib

import errors
from test_deploy import (FAIL, RESTART, UNCOUNTED, container, k8s_expand, load_manifest,
                         mismatches, outcome, parse, slice_job)

REPO = pathlib.Path(__file__).resolve().parents[1]
GPU_MANIFEST = REPO / 'deploy' / 'jobset-gpu.yaml'


def gpu() -> dict:
  return load_manifest(GPU_MANIFEST)


def test_the_restart_rules_are_the_tpu_manifests():
  js, tpu = gpu(), load_manifest()
  assert js['spec']['failurePolicy'] == tpu['spec']['failurePolicy']
  job, tpu_job = slice_job(js)['template']['spec'], slice_job(tpu)['template']['spec']
  assert job['podFailurePolicy'] == tpu_job['podFailurePolicy']
  assert job['backoffLimit'] == 0 and job['template']['spec']['restartPolicy'] == 'Never'
  assert mismatches(js) == []
  assert [outcome(js, c) for c in (1, 2, 3, 4, 5, 137)] == [
      RESTART, FAIL, UNCOUNTED, FAIL, FAIL, RESTART]
  assert outcome(js, errors.EXIT_USAGE, ('DisruptionTarget',)) == UNCOUNTED


def test_each_node_runs_one_process_with_all_its_gpus_and_train_py_accepts_it():
  js = gpu()
  job = slice_job(js)['template']['spec']
  c = container(js)
  resources = c['resources']
  assert resources['limits']['nvidia.com/gpu'] == resources['requests']['nvidia.com/gpu'] == 8
  env = {e['name']: e.get('value') for e in c['env']}
  assert int(env['NUM_NODES']) == job['parallelism'] == job['completions']
  assert job['completionMode'] == 'Indexed'
  (index,) = [e for e in c['env'] if e['name'] == 'PROCESS_ID']
  assert index['valueFrom']['fieldRef']['fieldPath'] == (
      "metadata.annotations['batch.kubernetes.io/job-completion-index']")
  env['PROCESS_ID'] = '3'  # what the Job controller gives the fourth pod
  command = [k8s_expand(a, env) for a in c['command'] + c['args']]
  assert command[:2] == ['python', 'train.py']
  got = parse(command[1:])
  assert got['rest'] == [] and got['workdir'] == env['WORKDIR']
  assert got['config']['model']['num_layers'] == 32
  assert (got['process_id'], got['num_processes']) == (3, job['parallelism'])
  # Pod 0's stable name: <jobset>-<replicated job>-<job index 0>-<pod index 0>.<subdomain>.
  host, port = got['coordinator_address'].rsplit(':', 1)
  name, rjob = js['metadata']['name'], slice_job(js)['name']
  assert host == f"{name}-{rjob}-0-0.{js['spec']['network']['subdomain']}" and port.isdigit()
  assert got['config']['train']['mesh_layout'] in ('auto', 'hsdp')  # shards within a node


def test_the_image_installs_the_cuda_extra_at_the_projects_jax():
  dockerfile = (REPO / 'deploy' / 'Dockerfile.cuda').read_text()
  assert "pip install --no-cache-dir '.[cuda,wandb]'" in dockerfile
  data_packages = r'pip install --no-cache-dir --no-deps (.+)'  # the TPU image's, at its pins
  assert re.findall(data_packages, dockerfile) == re.findall(
      data_packages, (REPO / 'deploy' / 'Dockerfile').read_text())
  project = tomllib.loads((REPO / 'pyproject.toml').read_text())['project']
  jax_pin = next(d for d in project['dependencies'] if d.startswith('jax=='))
  (cuda,) = project['optional-dependencies']['cuda']
  assert cuda.startswith('jax[cuda') and cuda.endswith(jax_pin[len('jax'):])
  assert (REPO / 'deploy' / 'Dockerfile.cuda.dockerignore').read_text() == (
      REPO / 'deploy' / 'Dockerfile.dockerignore').read_text().replace(
          'deploy/Dockerfile:', 'deploy/Dockerfile.cuda:')
