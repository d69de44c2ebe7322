"""config_checks.py: validation once at the entry point, the resume rule, config typos.

References: the configs' own declared fields (every field a check names must
exist), and hand-built saved/current config pairs.
"""

import json
import pathlib

import pytest

import config_checks
import errors
from store import step_dirs
from configs import olmo3_7b, small

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_shipped_configs_validate():
  for module in (small, olmo3_7b):
    config_checks.validate(config_checks.complete(module.get_config()))


@pytest.mark.parametrize('section, field, value, named', [
    ('model', 'num_kv_heads', 3, 'num_heads=4 is not a multiple of num_kv_heads=3'),
    ('opt', 'lr', float('nan'), 'cfg.opt.lr=nan must be'),
    ('train', 'steps', 0, 'cfg.train.steps=0 must be an integer >= 1'),
    ('train', 'memorization_evals', 1, 'cfg.train.memorization_evals=1 must be'),
    ('data', 'vocab_size', 9000, 'data.vocab_size=9000 exceeds model.vocab_size=8192'),
])
def test_each_broken_rule_is_a_config_error_naming_the_field(section, field, value, named):
  cfg = config_checks.complete(small.get_config())
  cfg[section][field] = value
  with pytest.raises(errors.ConfigError, match=named.replace('[', r'\[').replace('(', r'\(')):
    config_checks.validate(cfg)


def test_complete_fills_in_what_the_mix_says_and_refuses_a_contradiction(tmp_path):
  cfg = config_checks.complete(small.get_config())  # the embedded mix's `# tokenizer` line
  assert (cfg.data.vocab_size, cfg.data.eos_token_id, cfg.data.pad_token_id) == (8192, 0, 1)
  assert cfg.data.bos_token_id is None and cfg.model.vocab_size == 8192
  assert cfg.data.tokenizer.endswith('data/tokenizer.json')
  assert [p.rsplit('/', 1)[1] for p in cfg.data.validation_paths] == [
      'shakespeare-validation-00000.npy']
  assert config_checks.complete(cfg) is cfg  # idempotent
  mix = tmp_path / 'm.txt'
  mix.write_text('# tokenizer {"name": "t", "vocab_size": 1000, "eos_token_id": 7, '
                 '"pad_token_id": 8, "bos_token_id": null}\nm,m-00000.npy,64\n')
  other = small.get_config()
  other.data.mix_file = str(mix)
  config_checks.complete(other)
  assert (other.data.vocab_size, other.data.eos_token_id, other.model.vocab_size) == (7 + 993, 7,
                                                                                      1024)
  assert other.data.validation_paths == () and other.data.tokenizer == ''
  stated = small.get_config()
  stated.data.mix_file, stated.data.eos_token_id = str(mix), 0
  with pytest.raises(errors.ConfigError, match='data.eos_token_id=0 contradicts the mix file'):
    config_checks.complete(stated)
  bare = small.get_config()
  bare.data.mix_file, bare.data.paths = '', ('a.npy',)
  with pytest.raises(errors.ConfigError, match='data.vocab_size is unset'):
    config_checks.complete(bare)


def _saved(cfg):
  return json.loads(json.dumps(cfg.to_dict()))  # as a checkpoint's metadata holds it


def test_same_run_allows_harmless_changes_and_refuses_run_defining_ones(caplog):
  cfg = config_checks.complete(small.get_config())
  meta = {'step': 10, 'config': _saved(cfg)}
  changed = config_checks.complete(small.get_config())
  changed.opt.lr, changed.train.log_every = 1e-4, 5  # may change: only logged
  config_checks.check_same_run(changed, meta)
  assert 'opt.lr' in caplog.text and 'train.log_every' in caplog.text
  changed.data.seed += 1
  with pytest.raises(errors.ConfigError, match=r'data.seed: 34521 -> 34522'):
    config_checks.check_same_run(changed, meta)
  changed.train.allow_config_change = True
  config_checks.check_same_run(changed, meta)
  changed.train.steps = 5  # behind the checkpoint: always refused
  with pytest.raises(errors.ConfigError, match='train.steps=5 is below'):
    config_checks.check_same_run(changed, meta)


def test_config_changes_sees_only_real_differences():
  cfg = small.get_config()
  saved = _saved(cfg)
  assert config_checks.config_changes(saved, cfg) == {}  # tuples vs lists are not a change
  del saved['train']['max_loss']
  assert config_checks.config_changes(saved, cfg) == {
      'train.max_loss': (config_checks.ABSENT, cfg.train.max_loss)}


def test_a_typo_names_the_closest_field():
  assert 'did you mean --config.train.steps?' in config_checks.config_mistake(
      'configs/small.py', ['train.stpes'])
  assert config_checks.config_mistake('configs/small.py', ['train.steps']) is None
  assert 'no such file' in config_checks.config_mistake('configs/smal.py', [])


# --- Issue 33: what complete fills in, and what it refuses ---------------------------------


def _word_tokenizer(path, words) -> str:
  """A tokenizer.json whose vocabulary is `words` (ids in order)."""
  from tokenizers import Tokenizer, models
  Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0])).save(
      str(path))
  return str(path)


def _mix(tmp_path, tokenizer: dict, name='m.txt') -> str:
  mix = tmp_path / name
  mix.write_text(f'# tokenizer {json.dumps(tokenizer)}\nm,m-00000.npy,64\n')
  return str(mix)


def test_a_tokenizer_file_that_is_not_the_mixs_is_refused_and_a_copy_is_not(tmp_path):
  """The issue's case: --config.data.tokenizer=data/tokenizer.json (8,192 tokens) on a mix
  made with another tokenizer; the mix's own file, a copy of it, or the same vocabulary
  saved elsewhere are its tokenizer."""
  words = ['<eos>', '<pad>', 'thou', 'art']
  theirs = _word_tokenizer(tmp_path / 'dolma.json', words)
  header = {'name': 'dolma-like', 'file': 'dolma.json', 'vocab_size': 4, 'eos_token_id': 0,
            'pad_token_id': 1, 'bos_token_id': None}
  mix = _mix(tmp_path, header)

  def run(tokenizer):
    cfg = small.get_config()
    cfg.data.mix_file, cfg.data.tokenizer = mix, tokenizer
    return config_checks.complete(cfg, announce=False)
  with pytest.raises(errors.ConfigError, match=r'data.tokenizer=data/tokenizer.json contradicts '
                     r'the mix file .*8,192 tokens'):
    run('data/tokenizer.json')
  assert run(theirs).data.tokenizer == theirs  # the mix's own file
  (tmp_path / 'elsewhere').mkdir()
  copy = tmp_path / 'elsewhere' / 'tok.json'
  copy.write_bytes(pathlib.Path(theirs).read_bytes())
  assert run(str(copy)).data.tokenizer == str(copy)  # a byte-identical copy
  resaved = _word_tokenizer(tmp_path / 'elsewhere' / 'same.json', words)
  assert run(resaved).data.tokenizer == resaved  # the same vocabulary
  assert run(f'{tmp_path}/./dolma.json').data.tokenizer  # the same file, spelled otherwise
  other = _word_tokenizer(tmp_path / 'other.json', ['<eos>', '<pad>', 'king', 'art'])
  with pytest.raises(errors.ConfigError, match='another vocabulary'):
    run(other)
  # A dolma2 mix whose tokenizer file is not on this machine: its EOS/PAD ids must at
  # least be tokens of the stated file.
  dolma2 = {'name': 'allenai/dolma2-tokenizer', 'file': 'absent.json', 'vocab_size': 100278,
            'eos_token_id': 100257, 'pad_token_id': 100277, 'bos_token_id': None}
  cfg = small.get_config()
  cfg.data.mix_file, cfg.data.tokenizer = _mix(tmp_path, dolma2, 'd.txt'), 'data/tokenizer.json'
  with pytest.raises(errors.ConfigError, match='without eos_token_id=100257 or '
                     'pad_token_id=100277'):
    config_checks.complete(cfg, announce=False)


def test_a_validation_file_that_is_a_training_file_is_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  for spelled in ('data/shakespeare-train-00000.npy', str(REPO / 'data' / '.' /
                                                          'shakespeare-train-00000.npy')):
    cfg = small.get_config()
    cfg.data.validation_paths = ('data/shakespeare-validation-00000.npy', spelled)
    with pytest.raises(errors.ConfigError, match='data.validation_paths holds .*also a '
                       'training file of mix file'):
      config_checks.complete(cfg, announce=False)
  cfg = small.get_config()  # URLs compare as spelled
  cfg.data.mix_file, cfg.data.paths = '', ('s3://bkt/train.npy',)
  cfg.data.vocab_size, cfg.data.eos_token_id, cfg.data.pad_token_id = 8192, 0, 1
  cfg.data.validation_paths = ('s3://bkt/val.npy',)
  config_checks.complete(cfg, announce=False)
  cfg.data.validation_paths = ('s3://bkt/train.npy',)
  with pytest.raises(errors.ConfigError, match='s3://bkt/train.npy, which is also a training'):
    config_checks.complete(cfg, announce=False)


def test_complete_says_what_it_filled_in_and_from_where(capsys, caplog):
  caplog.set_level('DEBUG')
  cfg = config_checks.complete(small.get_config())
  line = capsys.readouterr().out.strip()
  assert len(line.splitlines()) == 1 and line.startswith('Filled in from the mix file ')
  assert 'shakespeare-train.txt' in line
  for part in ('data.vocab_size=8192', 'data.eos_token_id=0', 'data.pad_token_id=1',
               f'data.tokenizer={cfg.data.tokenizer}', 'shakespeare-validation-00000.npy',
               'model.vocab_size=8192 (data.vocab_size padded'):
    assert part in line, part
  assert line in caplog.text  # the absl log too (at debug level: the terminal shows it once)
  config_checks.complete(cfg)  # nothing left to fill in: nothing said
  config_checks.complete(small.get_config(), announce=False)
  assert capsys.readouterr().out == ''


def test_the_same_files_spelled_otherwise_are_the_same_run(monkeypatch, caplog):
  monkeypatch.chdir(REPO)
  saved = small.get_config()
  saved.data.mix_file = 'data/shakespeare-train.txt'
  meta = {'step': 10, 'config': _saved(config_checks.complete(saved, announce=False))}
  again = small.get_config()
  again.data.mix_file = str(REPO / 'data' / 'shakespeare-train.txt')  # $PWD/...
  config_checks.check_same_run(config_checks.complete(again, announce=False), meta)
  assert 'data.mix_file' not in caplog.text
  again.data.mix_file = 'data/shakespeare-validation.txt'  # another file is still refused
  with pytest.raises(errors.ConfigError, match='data.mix_file'):
    config_checks.check_same_run(again, meta)


def test_misplaced_checkpoints_are_named(tmp_path):
  work = tmp_path / 'W'
  reads = work / 'checkpoints'
  assert step_dirs.check_fresh_start(str(reads), str(work)) is None
  (work / 'checkpoint' / 'checkpoints' / 'step_5').mkdir(parents=True)  # convert --to=W/checkpoint
  (work / 'checkpoint' / 'checkpoints' / 'step_5' / 'COMMIT').touch()
  (work / 'copied' / 'step_7').mkdir(parents=True)
  (work / 'copied' / 'step_7' / 'COMMIT').touch()
  (work / 'crashed' / 'step_9').mkdir(parents=True)  # no COMMIT: not a checkpoint
  reads.mkdir()
  message = step_dirs.check_fresh_start(str(reads), str(work))
  assert f'{work}/checkpoint/checkpoints holds steps [5] (pass --workdir={work}/checkpoint' in (
      message)
  assert f'{work}/copied holds steps [7] (move its step_* directories into {reads})' in message
  assert 'crashed' not in message and 'starts from step 0' in message
