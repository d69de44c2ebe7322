"""BUILD.md's fault table, the user-mistake rows, driven through the command line.

Each row: `python train.py ...` as a user types it, one `error: ` line on
stderr and no traceback, the documented exit code (errors.py), and nothing
written that should not be. The data is a mix prepare_data.py wrote with the
embedded tokenizer, so train.py fills the tokenizer settings in from it.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

import errors
from script_module import load_script
from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ['--config.model.num_layers=2', '--config.model.layer_pattern=SF',
        '--config.model.d_model=64', '--config.model.num_heads=2', '--config.model.num_kv_heads=1',
        '--config.model.head_dim=32', '--config.model.mlp_hidden=128',
        '--config.model.sliding_window=16', '--config.data.seq_len=64',
        '--config.data.global_batch_size=8', '--config.data.validation_batches=1',
        '--config.train.steps=2', '--config.train.ckpt_every=2', '--config.train.eval_every=2',
        '--config.train.peak_flops=1e11', '--config.train.downstream_eval_every=0',
        '--sample_tokens=0']

prepare_data = load_script('prepare_data')


@pytest.fixture(scope='module')
def mix(tmp_path_factory) -> pathlib.Path:
  """A 120-document mix (1 held out) tokenized with data/tokenizer.json."""
  root = tmp_path_factory.mktemp('own_text')
  rng = np.random.default_rng(0)
  words = ['thou', 'art', 'the', 'king', 'and', 'I', 'shall', 'speak', 'of', 'love', 'night']
  docs = [' '.join(rng.choice(words, 150)) for _ in range(120)]
  (root / 'in.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  tokenizer = Tokenizer.from_file(str(REPO / 'data' / 'tokenizer.json'))
  prepare_data.prepare([str(root / 'in.jsonl')], tokenizer, output_dir=str(root / 'tokens'),
                       prefix='corpus', validation_every=100, progress=False)
  return root / 'tokens' / 'corpus.txt'


def train_cli(workdir, *flags, config='configs/small.py', devices=1):
  argv = [sys.executable, 'train.py', f'--config={config}', f'--workdir={workdir}', *flags]
  env = dict(os.environ, XLA_FLAGS=with_devices(devices))
  return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def refused(proc, code: int, *named: str) -> str:
  """The one `error:` line of a refused run, checked: exit code, no traceback, named texts."""
  assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith('error: ')]
  assert len(lines) == 1, proc.stderr[-3000:]
  for text in named:
    assert text in lines[0], lines[0]
  return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize('flags, config, code, named', [
    ([], 'configs/olmo3_7b.py', errors.EXIT_DATA, ['No training data configured',
                                                   'data.mix_file', 'data.paths']),
    (['--config.data.paths=("x.npy",)'], 'configs/small.py', errors.EXIT_DATA,
     ['both set', '--config.data.mix_file=']),
    (['--config.data.mix_file=/nonexistent/mix.txt'], 'configs/small.py', errors.EXIT_DATA,
     ['/nonexistent/mix.txt']),
    (['--config.train.stpes=3'], 'configs/small.py', errors.EXIT_USAGE,
     ['did you mean --config.train.steps?']),
    (['--config.opt.lr=inf'], 'configs/small.py', errors.EXIT_USAGE, ['cfg.opt.lr=inf']),
    (['--config.train.mesh_data=3'], 'configs/small.py', errors.EXIT_USAGE,
     ['does not fit 8 devices']),
    (['--config.train.init_from=/nonexistent/ckpt'], 'configs/small.py', errors.EXIT_USAGE,
     ['train.init_from', '/nonexistent/ckpt']),
    (['--config.model.attention_impl=pallas'], 'configs/small.py', errors.EXIT_USAGE,
     ["attention_impl='pallas' does not support head_dim 64", "use 'auto' or 'xla'"]),
    (['--config.model.attention_impl=cudnn'], 'configs/small.py', errors.EXIT_USAGE,
     ["attention_impl='cudnn' cannot run", 'the cpu backend', 'attention_impl=auto']),
])
def test_a_mistake_is_one_line_with_its_exit_code_and_writes_nothing(tmp_path, flags, config,
                                                                     code, named):
  proc = train_cli(tmp_path / 'run', *flags, config=config, devices=8)
  refused(proc, code, *named)
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_stage3_checks_init_from_then_the_devices_before_any_packing(tmp_path, mix):
  missing = train_cli(tmp_path / 'w', '--config.train.init_from=/nonexistent/stage2',
                      config='configs/long_context_small.py')
  refused(missing, errors.EXIT_USAGE, 'train.init_from')
  few = train_cli(tmp_path / 'w', config='configs/long_context_small.py')  # context 4, 1 device
  refused(few, errors.EXIT_USAGE, 'context=4', 'does not fit 1 devices',
          'it needs a multiple of 4 devices')
  assert not (tmp_path / 'w').exists()


@pytest.mark.slow
def test_a_tokenizer_setting_that_contradicts_the_mix_is_refused(tmp_path, mix):
  proc = train_cli(tmp_path / 'run', f'--config.data.mix_file={mix}',
                   '--config.data.eos_token_id=5', *TINY)
  refused(proc, errors.EXIT_USAGE, 'data.eos_token_id=5 contradicts the mix file',
          'eos_token_id=0')
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_workdir_that_is_a_file_is_one_line(tmp_path, mix):
  (tmp_path / 'run').write_text('not a directory')
  proc = train_cli(tmp_path / 'run', f'--config.data.mix_file={mix}', *TINY)
  refused(proc, errors.EXIT_USAGE, 'is a file, not a directory')
  assert (tmp_path / 'run').read_text() == 'not a directory'


@pytest.mark.slow
def test_resume_mistakes_keep_every_checkpoint(tmp_path, mix):
  """A real 2-step run on the prepared mix, then the resume rows of the table."""
  work = tmp_path / 'run'
  first = train_cli(work, f'--config.data.mix_file={mix}', *TINY)
  assert first.returncode == 0, first.stderr[-3000:]
  assert 'validation loss' in first.stdout  # the mix's held-out document, filled in
  kept = sorted(os.listdir(work / 'checkpoints'))
  assert kept == ['step_2']

  changed = train_cli(work, f'--config.data.mix_file={mix}', *TINY, '--config.data.seed=7')
  refused(changed, errors.EXIT_USAGE, 'data.seed', 'allow_config_change')
  behind = train_cli(work, f'--config.data.mix_file={mix}', *TINY, '--config.train.steps=1')
  refused(behind, errors.EXIT_USAGE, 'train.steps=1 is below')

  shard = mix.parent / 'corpus-00000.npy'
  backup = tmp_path / 'backup.npy'
  shutil.copy(shard, backup)
  try:
    with open(shard, 'ab') as f:  # the data changed since the checkpoint
      f.write(np.zeros(64, '<u4').tobytes())
    rewritten = train_cli(work, f'--config.data.mix_file={mix}', *TINY,
                          '--config.train.steps=4')
    refused(rewritten, errors.EXIT_DATA, 'corpus-00000.npy')
  finally:
    shutil.copy(backup, shard)
  assert sorted(os.listdir(work / 'checkpoints')) == kept
  assert os.path.isfile(work / 'error.log')  # the stacks went to the log

  # A checkpoint one level too high (converted with --to=WORKDIR/.. style paths) is named.
  misplaced = tmp_path / 'other'
  misplaced.mkdir()
  shutil.copytree(work / 'checkpoints' / 'step_2', misplaced / 'step_2')
  fresh = train_cli(misplaced, f'--config.data.mix_file={mix}', *TINY)
  assert fresh.returncode == 0, fresh.stderr[-3000:]
  assert f'{misplaced} holds steps [2] (move its step_* directories into' in fresh.stderr


# --- Issue 33: mistakes that went through without a word ----------------------------------


def _dolma2_mix(mix: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
  """The fixture's token files under a `# tokenizer` line naming dolma2 (its file absent)."""
  dolma2 = {'name': 'allenai/dolma2-tokenizer', 'file': str(root / 'dolma2.json'),
            'vocab_size': 100278, 'eos_token_id': 100257, 'pad_token_id': 100277,
            'bos_token_id': None}
  lines = [f'# tokenizer {json.dumps(dolma2)}']
  for line in mix.read_text().splitlines():
    if line and not line.startswith('#'):
      label, path, size = line.split(',')
      lines.append(f'{label},{mix.parent / path},{size}')
  out = root / 'dolma2.txt'
  out.write_text('\n'.join(lines) + '\n')
  return out


@pytest.mark.slow
def test_a_tokenizer_or_validation_file_that_contradicts_the_mix_is_one_line(tmp_path, mix):
  proc = train_cli(tmp_path / 'run', f'--config.data.mix_file={_dolma2_mix(mix, tmp_path)}',
                   '--config.data.tokenizer=data/tokenizer.json', *TINY)
  refused(proc, errors.EXIT_USAGE, 'data.tokenizer=data/tokenizer.json contradicts the mix file',
          'dolma2', 'without eos_token_id=100257')
  shard = mix.parent / 'corpus-00000.npy'  # a training file of the mix, as "held out"
  proc = train_cli(tmp_path / 'run', f'--config.data.mix_file={mix}',
                   f'--config.data.validation_paths=("{shard}",)', *TINY)
  refused(proc, errors.EXIT_USAGE, 'data.validation_paths holds', 'also a training file')
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_the_same_mix_spelled_otherwise_resumes_and_the_fill_in_is_said(tmp_path, mix):
  relative = os.path.relpath(mix, REPO)  # train_cli runs in REPO: `runs/x/corpus.txt` style
  work = tmp_path / 'run'
  first = train_cli(work, f'--config.data.mix_file={relative}', *TINY)
  assert first.returncode == 0, first.stderr[-3000:]
  said = [line for line in first.stdout.splitlines() if line.startswith('Filled in from')]
  assert len(said) == 1 and 'data.eos_token_id=0' in said[0] and 'data.tokenizer=' in said[0]
  assert 'Filled in from' not in first.stderr  # said once on the terminal, not logged again
  assert 'corpus-validation' in said[0], said  # the held-out file, and where it came from
  resumed = train_cli(work, f'--config.data.mix_file={mix}', *TINY, '--config.train.steps=4')
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'data.mix_file' not in resumed.stderr


def test_the_data_change_message_names_the_flag(tmp_path):
  import data  # pylint: disable=import-outside-toplevel
  ds = data.Dataset([str(REPO / 'data' / 'shakespeare-validation-00000.npy')], seq_len=64,
                    vocab_size=8192, eos_token_id=0, pad_token_id=1)
  state = {'fingerprint': 'other', 'seq_len': 64, 'files': [['x.npy', 4]]}
  with pytest.raises(errors.DataError, match=r'pass --config.data.allow_data_change=True to '
                     'resume anyway'):
    data.check_same_data(state, ds)


@pytest.mark.slow
def test_a_checkpoint_converted_one_level_too_deep_is_named(mix, tmp_path):
  """convert.py --to=W/checkpoint, then train.py --workdir=W: the fresh start names where
  the steps are and which --workdir they were written for, once."""
  work = tmp_path / 'W'
  deep = work / 'checkpoint' / 'checkpoints' / 'step_2'
  deep.mkdir(parents=True)
  (deep / 'COMMIT').touch()
  run = train_cli(work, f'--config.data.mix_file={mix}', *TINY, '--config.train.steps=1')
  assert run.returncode == 0, run.stderr[-2000:]
  warnings = [l for l in run.stderr.splitlines() if f'{work}/checkpoint/checkpoints holds' in l]
  assert len(warnings) == 1 and f'--workdir={work}/checkpoint' in warnings[0]


# --- Issue 33: prepare_data.py, plan.py, inspect_batch.py and eval.py mistakes, by the CLI --------

EMBEDDED = str(REPO / 'data' / 'tokenizer.json')


def script_cli(script: str, *flags: str, timeout: int = 300) -> subprocess.CompletedProcess:
  """`python SCRIPT FLAGS...` in the repository, as a user types it."""
  return subprocess.run([sys.executable, script, *flags], cwd=REPO, capture_output=True,
                        text=True, timeout=timeout, env=dict(os.environ, XLA_FLAGS=with_devices(1)))


def _prepare_inputs(root: pathlib.Path) -> None:
  """Good and bad inputs for prepare_data.py under `root`."""
  import gzip  # pylint: disable=import-outside-toplevel
  root.mkdir()
  good = ''.join(json.dumps({'text': f'document {i} says hello'}) + '\n' for i in range(5))
  (root / 'good.jsonl').write_text(good)
  (root / 'good.jsonl.gz').write_bytes(gzip.compress(good.encode()))
  (root / 'nofield.jsonl').write_text('{"body": "the text is elsewhere"}\n')
  np.arange(1, 50, dtype='<u4').tofile(root / 'tokens.npy')  # token ids, not text
  (root / 'empty').mkdir()
  (root / 'empty' / 'a.txt').write_text('')
  (root / 'empty' / 'b.txt').write_text('\n\n')
  (root / 'blank.jsonl').write_text('\n\n\n')
  (root / 'afile').write_text('not a directory')


@pytest.mark.parametrize('flags, code, named', [
    (['--input={in}'], errors.EXIT_USAGE, ['is a directory', "--input='{in}/*.txt'"]),
    (['--input={in}/good.jsonl', '--output_dir={in}/afile'], errors.EXIT_USAGE,
     ['--output_dir=', 'is a file, not a directory']),
    (['--input={in}/none*.jsonl'], errors.EXIT_DATA, ['matches no files']),
    (['--input={in}/good.jsonl.gz'], errors.EXIT_DATA, ['gzip-compressed', 'gzip -dc']),
    (['--input={in}/tokens.npy'], errors.EXIT_DATA, ['tokens.npy is binary']),
    (['--input={in}/nofield.jsonl'], errors.EXIT_DATA, ["no string field 'text'", "['body']",
                                                         '--text_field']),
    (['--input={in}/good.jsonl', '--tokenizer={in}/none.json'], errors.EXIT_DATA,
     ['none.json', 'does not exist']),
    (['--input={in}/good.jsonl', '--vocab_size=100'], errors.EXIT_USAGE,
     ['is >= vocab_size 100', 'raise --vocab_size to at least 8192']),
    (['--input={in}/empty/*.txt'], errors.EXIT_DATA, ['holds no document']),
    (['--input={in}/blank.jsonl'], errors.EXIT_DATA, ['holds no document']),
    (['--input={in}/good.jsonl', '--validation_every=-3'], errors.EXIT_USAGE,
     ['--validation_every=-3']),
], ids=['input_dir', 'output_file', 'no_match', 'gzip', 'binary', 'no_field', 'no_tokenizer',
        'vocab_small', 'empty_text', 'blank_jsonl', 'validation_every'])
def test_prepare_data_mistakes_are_one_line_with_their_code_and_write_nothing(
    tmp_path, flags, code, named):
  _prepare_inputs(tmp_path / 'in')
  argv = [f.format(**{'in': tmp_path / 'in'}) for f in flags]
  if not any(f.startswith('--output_dir') for f in argv):
    argv.append(f'--output_dir={tmp_path / "out"}')
  if not any(f.startswith('--tokenizer') for f in argv):
    argv.append(f'--tokenizer={EMBEDDED}')
  proc = script_cli('scripts/prepare_data.py', *argv, '--workers=2')
  refused(proc, code, *(n.format(**{'in': tmp_path / 'in'}) for n in named))
  # On a line of its own: not after the progress bar's `\r...` line.
  assert all(line.startswith('error: ') for line in proc.stderr.split('\n') if 'error: ' in line)
  assert not (tmp_path / 'out').exists()
  assert (tmp_path / 'in' / 'afile').read_text() == 'not a directory'


def test_prepare_data_without_input_is_one_line_not_the_usage(tmp_path):
  proc = script_cli('scripts/prepare_data.py', f'--output_dir={tmp_path / "out"}')
  refused(proc, errors.EXIT_USAGE, '--input is required', "--input='corpus/*.jsonl'")
  assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
  assert not (tmp_path / 'out').exists()


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() if p.is_file() else b'<dir>' for p in directory.iterdir()}


def test_prepare_data_interrupted_is_one_line_and_leaves_the_earlier_mix(tmp_path):
  """Ctrl-C while the workers tokenize: one line, errors.py's stop code (3, as train.py's),
  no traceback, and the earlier run's mix and files exactly as they were (no staging left)."""
  import select  # pylint: disable=import-outside-toplevel
  import signal  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'small.jsonl').write_text(
      ''.join(json.dumps({'text': f'earlier document {i}'}) + '\n' for i in range(30)))
  out = tmp_path / 'out'
  first = script_cli('scripts/prepare_data.py', f'--input={tmp_path}/in/small.jsonl',
                     f'--output_dir={out}', f'--tokenizer={EMBEDDED}', '--workers=1')
  assert first.returncode == 0, first.stderr
  before = _snapshot(out)
  line = json.dumps({'text': 'thou art the king and I shall speak of love at night ' * 3}) + '\n'
  (tmp_path / 'in' / 'big.jsonl').write_text(line * ((24 << 20) // len(line)))  # ~24 MB
  proc = subprocess.Popen(
      [sys.executable, 'scripts/prepare_data.py', f'--input={tmp_path}/in/big.jsonl',
       f'--output_dir={out}', f'--tokenizer={EMBEDDED}', '--workers=2', '--chunk_mb=0.5'],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  seen, deadline = b'', time.time() + 120
  while b'tokenizing' not in seen and time.time() < deadline and proc.poll() is None:
    if select.select([proc.stderr], [], [], 1.0)[0]:
      seen += os.read(proc.stderr.fileno(), 4096)
  assert b'tokenizing' in seen, seen  # the bar: the workers are at it
  proc.send_signal(signal.SIGINT)
  stdout, stderr = proc.communicate(timeout=120)
  done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout.decode(),
                                     (seen + stderr).decode())
  refused(done, errors.EXIT_PREEMPTED, 'interrupted', 'nothing was written',
          'rerun the same command')
  assert _snapshot(out) == before  # the earlier mix, its files; no staging folder


def test_plan_and_inspect_batch_without_config_are_one_line():
  for script, named in (('plan.py', 'training config to plan'),
                        ('scripts/inspect_batch.py', "the run's training config")):
    proc = script_cli(script, *(['--step=3'] if 'inspect' in script else []))
    refused(proc, errors.EXIT_USAGE, '--config is required', named)


@pytest.mark.slow
def test_a_mix_file_that_is_a_folder_is_one_line_in_plan_and_audit(tmp_path):
  for script in ('plan.py', 'scripts/audit_data.py'):
    proc = script_cli(script, '--config=configs/small.py',
                      f'--config.data.mix_file={tmp_path}')
    refused(proc, errors.EXIT_DATA, f"mix file '{tmp_path}' is a folder")


@pytest.mark.slow
def test_a_token_file_given_as_the_mix_is_one_line(tmp_path, mix):
  # token_files.read_mix (another owner) refuses a binary mix; this drives it through train.py.
  shard = mix.parent / 'corpus-00000.npy'
  proc = train_cli(tmp_path / 'run', f'--config.data.mix_file={shard}', *TINY)
  refused(proc, errors.EXIT_DATA, 'corpus-00000.npy', 'is binary',
          '--config.data.paths=')
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_a_micro_batch_that_does_not_divide_is_a_config_mistake(tmp_path, mix):
  proc = train_cli(tmp_path / 'run', f'--config.data.mix_file={mix}', *TINY,
                   '--config.train.micro_batch_size=3')
  refused(proc, errors.EXIT_USAGE, 'micro_batch_size 3', 'data.global_batch_size=8',
          '--config.train.micro_batch_size to one of [1, 2, 4, 8]')
  assert not (tmp_path / 'run').exists()


def _checkpoint(workdir: pathlib.Path, mix_file: pathlib.Path) -> pathlib.Path:
  """A committed step 3 of a tiny model trained (nominally) on `mix_file`, as train.py saves."""
  import jax  # pylint: disable=import-outside-toplevel
  import checkpoint  # pylint: disable=import-outside-toplevel
  import config_checks  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  import optim  # pylint: disable=import-outside-toplevel
  from configs import small  # pylint: disable=import-outside-toplevel
  cfg = small.get_config()
  cfg.data.mix_file = str(mix_file)
  cfg = config_checks.complete(cfg)
  m = cfg.model
  m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_hidden = 64, 4, 4, 16, 128
  m.sliding_window, cfg.data.seq_len = 16, 64
  params = model.init_params(m, jax.random.key(0))
  with checkpoint.Checkpointer(str(workdir / 'checkpoints')) as ckpt:
    ckpt.save(3, {'params': params, 'opt_state': optim.make_optimizer(cfg.opt).init(params)},
              {'config': cfg.to_dict()})
  return workdir / 'checkpoints'


@pytest.mark.slow
def test_heldout_eval_of_a_run_without_a_held_out_set_says_why_and_how(tmp_path):
  """17 plain-text documents, every 100th held out: none. eval.py says so (not 'HF models
  have no data config'), names the mix and both fixes, and writes nothing."""
  (tmp_path / 'in').mkdir()
  for i in range(17):
    (tmp_path / 'in' / f'd{i}.txt').write_text(f'document {i}: ' + 'words and words ' * 20)
  tokenizer = Tokenizer.from_file(EMBEDDED)
  files = prepare_data.list_inputs([str(tmp_path / 'in' / '*.txt')], [])
  prepare_data.prepare(files, tokenizer, output_dir=str(tmp_path / 'tokens'), prefix='corpus',
                       validation_every=100, progress=False)
  ckpt = _checkpoint(tmp_path / 'run', tmp_path / 'tokens' / 'corpus.txt')
  proc = script_cli('eval.py', f'--checkpoint={ckpt}', '--suite=heldout')
  line = refused(proc, errors.EXIT_USAGE, 'this run has no held-out set',
                 str(tmp_path / 'tokens' / 'corpus.txt'), '--validation_every=N',
                 '--heldout_paths=', '--config.data.validation_paths')
  assert 'HF models' not in line
  assert not (tmp_path / 'run' / 'eval_results').exists()


def test_inspect_batch_shows_the_documents_of_a_packed_instance(tmp_path):
  """packed.PackedDataset.instance_documents (public now) is what inspect_batch reports: each
  instance's tokens are its listed documents' tokens, in order, then padding."""
  import config_checks  # pylint: disable=import-outside-toplevel
  from configs import small  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  docs = [np.append(rng.integers(2, 500, n), 0) for n in rng.integers(3, 40, 60)]
  path = tmp_path / 'docs.npy'
  np.concatenate(docs).astype('<u4').tofile(path)
  cfg = small.get_config()
  cfg.data.update(mix_file='', paths=(str(path),), dataset='packed', vocab_size=512,
                  eos_token_id=0, pad_token_id=1, seq_len=32, global_batch_size=8,
                  document_masking=True, source_group_size=1, long_doc_strategy='truncate')
  config_checks.complete(cfg)
  inspect = load_script('inspect_batch')
  report = inspect.describe(cfg, step=1, workdir=str(tmp_path / 'w'))
  tokens = np.fromfile(path, '<u4')
  for row in report['instances']:
    assert row['sources'], row
    read = np.concatenate([tokens[s['token_offset']:s['token_offset'] + s['length']]
                           for s in row['sources']])
    assert all(s['file'] == str(path) for s in row['sources'])
    assert row['tokens'][:read.size] == read.tolist()
    assert set(row['tokens'][read.size:]) <= {1}  # padding


def test_the_missing_held_out_set_warning_names_the_cause_and_the_fix(caplog):
  """train.py's warning when the mix held nothing out: not 'run prepare_data' (just done), but
  why (every 100th document, too few documents) and both fixes."""
  import logging  # pylint: disable=import-outside-toplevel
  import config_checks  # pylint: disable=import-outside-toplevel
  import data  # pylint: disable=import-outside-toplevel
  from configs import small  # pylint: disable=import-outside-toplevel
  cfg = config_checks.complete(small.get_config())
  cfg.data.validation_paths = ()
  with caplog.at_level(logging.WARNING):
    assert data.held_out_batches(cfg.data, lambda size: 1) is None
  assert 'every --validation_every-th document' in caplog.text
  assert '--validation_every=N' in caplog.text and '--config.data.validation_paths' in caplog.text
