"""config_checks.py: validation once at the entry point, the resume rule, config typos.

References: the configs' own declared fields (every field a check names must
exist), and hand-built saved/current config pairs.
"""

import json

import pytest

import config_checks
import errors
from configs import olmo3_7b, small


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
