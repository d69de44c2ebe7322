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
        '--config.train.peak_flops=1e11', '--sample_tokens=0']

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
