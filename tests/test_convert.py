"""convert.py's command line and formats/hf_ckpt.py's checkpoint handling against HF transformers
(CPU torch).

The weight mapping itself is tested in test_model.py; here: HF -> checkpoint ->
HF round trips with no flags, train.py checkpoints exported with their
tokenizer, context length and file modes, and a --to that already holds a checkpoint.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Olmo3Config, Olmo3ForCausalLM

import checkpoint
import config_checks
import errors
from formats import ckpt_files
from formats import hf_ckpt
import model
from configs import olmo3_7b_stage3, small

REPO = pathlib.Path(__file__).resolve().parents[1]


def make_hf(path, seed=0, dtype=torch.float32, **changes):
  """A tiny random Olmo 3 saved with save_pretrained: an unpadded vocabulary, a long context,
  a customised generation config and tokenizer files beside the weights."""
  kwargs = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                max_position_embeddings=65536, eos_token_id=0, pad_token_id=1, bos_token_id=None)
  torch.manual_seed(seed)
  hf = Olmo3ForCausalLM(Olmo3Config(**{**kwargs, **changes})).to(dtype)
  hf.generation_config.max_length = 77
  hf.save_pretrained(str(path))
  shutil.copyfile(REPO / 'data' / 'tokenizer.json', path / 'tokenizer.json')
  (path / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<|endoftext|>'}))
  return path


def run_convert(*flags):
  return subprocess.run([sys.executable, 'convert.py', *map(str, flags)], cwd=REPO,
                        capture_output=True, text=True, timeout=300)


def logits(path, tokens):
  hf = Olmo3ForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                        attn_implementation='eager')
  with torch.no_grad():
    return hf(torch.as_tensor(tokens)).logits.numpy()


def read_json(path):
  return json.loads(pathlib.Path(path).read_text())


def from_hf(src, ckpt, **kw):
  """What `convert.py --from_hf=src --to=ckpt` does, through the public API."""
  params, cfg = hf_ckpt.load_hf(str(src))
  hf_ckpt.save_checkpoint_params(params, cfg, str(ckpt), hf_source=hf_ckpt.read_hf_source(str(src)),
                                 **kw)
  return params


@pytest.mark.slow
def test_hf_round_trip_with_no_flags_gives_the_same_model(tmp_path):
  src, ckpt, out = make_hf(tmp_path / 'src'), tmp_path / 'ckpt', tmp_path / 'out'
  for flags in ([f'--from_hf={src}', f'--to={ckpt}'], [f'--from_ckpt={ckpt}', f'--to_hf={out}']):
    proc = run_convert(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert read_json(out / 'config.json') == read_json(src / 'config.json')  # vocab 1000, ids, ...
  assert read_json(out / 'generation_config.json') == read_json(src / 'generation_config.json')
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    assert (out / name).read_bytes() == (src / name).read_bytes()
  tokens = np.random.default_rng(0).integers(0, 1000, (2, 24))
  ours, theirs = logits(out, tokens), logits(src, tokens)
  assert ours.shape == theirs.shape == (2, 24, 1000)
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
  weights = Olmo3ForCausalLM.from_pretrained(str(out)).model.embed_tokens.weight
  assert weights.dtype == torch.float32


def test_bfloat16_source_exports_bfloat16_bit_for_bit(tmp_path):
  src = make_hf(tmp_path / 'src', dtype=torch.bfloat16)
  from_hf(src, tmp_path / 'ckpt')
  assert hf_ckpt.export_hf(str(tmp_path / 'ckpt'), str(tmp_path / 'out')) == 'bfloat16'
  a = Olmo3ForCausalLM.from_pretrained(str(src)).state_dict()
  b = Olmo3ForCausalLM.from_pretrained(str(tmp_path / 'out')).state_dict()
  assert b['lm_head.weight'].dtype == torch.bfloat16
  assert all(torch.equal(a[k], b[k]) for k in a)


def test_malformed_sources_are_refused_naming_the_file(tmp_path):
  src = make_hf(tmp_path / 'src')
  (src / 'generation_config.json').write_text('{"eos_token_id": ')
  with pytest.raises(hf_ckpt.ConversionError, match='generation_config.json is not valid JSON'):
    hf_ckpt.read_hf_source(str(src))
  config = read_json(src / 'config.json')
  del config['hidden_size']
  (src / 'config.json').write_text(json.dumps(config))
  with pytest.raises(hf_ckpt.ConversionError, match="config.json lacks \\['hidden_size'\\]"):
    hf_ckpt.load_hf(str(src))


def params_of(ckpt):
  return hf_ckpt.load_checkpoint_params(str(ckpt))[0]


@pytest.mark.slow
def test_converting_into_an_existing_checkpoint_needs_overwrite(tmp_path):
  old, new = make_hf(tmp_path / 'old', seed=0), make_hf(tmp_path / 'new', seed=1)
  ckpt = tmp_path / 'ckpt'
  assert run_convert(f'--from_hf={old}', f'--to={ckpt}').returncode == 0
  old_params = params_of(ckpt)
  proc = run_convert(f'--from_hf={new}', f'--to={ckpt}')
  assert proc.returncode == errors.EXIT_USAGE
  assert f'{ckpt} already holds a checkpoint (steps [0])' in proc.stderr
  assert 'Pass --overwrite to replace it' in proc.stderr
  chex.assert_trees_all_equal(params_of(ckpt), old_params)

  (ckpt / 'notes.txt').write_text('mine')  # --overwrite would delete it with the directory
  proc = run_convert(f'--from_hf={new}', f'--to={ckpt}', '--overwrite')
  assert proc.returncode == errors.EXIT_USAGE
  assert "holds ['notes.txt'] besides its checkpoints" in proc.stderr
  chex.assert_trees_all_equal(params_of(ckpt), old_params)
  (ckpt / 'notes.txt').unlink()

  proc = run_convert(f'--from_hf={new}', f'--to={ckpt}', '--overwrite')
  assert proc.returncode == 0, proc.stderr[-3000:]
  chex.assert_trees_all_equal(params_of(ckpt), hf_ckpt.load_hf(str(new))[0])
  assert sorted(os.listdir(tmp_path)) == ['ckpt', 'new', 'old']  # no staging left behind

  proc = run_convert(f'--from_hf={new}', f'--to_hf={tmp_path / "x"}')
  assert proc.returncode != 0 and 'Give --from_hf=DIR --to=CKPT_DIR' in proc.stderr


def test_a_failed_overwrite_keeps_the_old_checkpoint(tmp_path, monkeypatch):
  old, new = make_hf(tmp_path / 'old', seed=0), make_hf(tmp_path / 'new', seed=1)
  old_params = from_hf(old, tmp_path / 'ckpt')

  def disk_full(*args):
    raise OSError(28, 'No space left on device')

  with monkeypatch.context() as patch:
    patch.setattr(ckpt_files.shutil, 'copyfile', disk_full)  # while copying the tokenizer files
    with pytest.raises(OSError, match='No space left'):
      from_hf(new, tmp_path / 'ckpt', overwrite=True)
  chex.assert_trees_all_equal(params_of(tmp_path / 'ckpt'), old_params)
  assert sorted(os.listdir(tmp_path)) == ['ckpt', 'new', 'old']


@pytest.mark.parametrize('atomic', [True, False])
def test_overwrite_replaces_the_whole_checkpoint(tmp_path, monkeypatch, atomic):
  old, new = make_hf(tmp_path / 'old', seed=0), make_hf(tmp_path / 'new', seed=1)
  params, cfg = hf_ckpt.load_hf(str(old))
  with checkpoint.Checkpointer(str(tmp_path / 'ckpt')) as ckpt:  # a later step than step_0
    ckpt.save(7, {'params': params}, {'config': {'model': cfg.to_dict()}})
  if not atomic:  # a filesystem without renameat2(RENAME_EXCHANGE), e.g. NFS
    monkeypatch.setattr(ckpt_files, 'exchange', lambda a, b: False)
  new_params = from_hf(new, tmp_path / 'ckpt', overwrite=True)
  assert checkpoint.committed_steps(str(tmp_path / 'ckpt')) == [0]
  chex.assert_trees_all_equal(params_of(tmp_path / 'ckpt'), new_params)
  assert sorted(os.listdir(tmp_path)) == ['ckpt', 'new', 'old']


def train_checkpoint(path, **data_changes):
  """A checkpoint as train.py writes it (full config with data, params under 'params')."""
  cfg = config_checks.complete(small.get_config())
  cfg.model.update(num_layers=4, d_model=64, num_heads=2, num_kv_heads=1, head_dim=32,
                   mlp_hidden=128)
  cfg.data.update(data_changes)
  params = jax.tree.map(np.asarray, model.init_params(cfg.model, jax.random.key(0)))
  with checkpoint.Checkpointer(str(path)) as ckpt:
    ckpt.save(3, {'params': params}, {'config': cfg.to_dict(), 'data': {}})
  return params, cfg


@pytest.mark.slow
def test_train_checkpoint_exports_its_tokenizer_and_float32(tmp_path):
  params, cfg = train_checkpoint(tmp_path / 'ckpt')
  proc = run_convert(f'--from_ckpt={tmp_path / "ckpt"}', f'--to_hf={tmp_path / "out"}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  tok = AutoTokenizer.from_pretrained(str(tmp_path / 'out'))
  assert (tok.eos_token, tok.eos_token_id) == ('<|endoftext|>', cfg.data.eos_token_id)
  assert (tok.pad_token, tok.pad_token_id) == ('<|pad|>', cfg.data.pad_token_id)
  config = read_json(tmp_path / 'out' / 'config.json')
  assert (config['vocab_size'], config['eos_token_id'], config['dtype']) == (8192, 0, 'float32')
  generation = read_json(tmp_path / 'out' / 'generation_config.json')
  assert (generation['eos_token_id'], generation['pad_token_id']) == (0, 1)
  tokens = np.array([tok('ROMEO: What light').input_ids])
  ours = np.asarray(model.logits(params, tokens, cfg.model))
  np.testing.assert_allclose(logits(tmp_path / 'out', tokens), ours, rtol=0, atol=1e-5)


def test_a_tokenizer_without_the_runs_ids_is_refused(tmp_path):
  train_checkpoint(tmp_path / 'ckpt', eos_token_id=9000)
  with pytest.raises(hf_ckpt.ConversionError, match='tokenizer.json has no token 9000 '
                                                    '\\(eos_token_id\\).*--tokenizer=PATH'):
    hf_ckpt.export_hf(str(tmp_path / 'ckpt'), str(tmp_path / 'out'),
                      tokenizer=str(REPO / 'data' / 'tokenizer.json'))


def test_export_claims_the_runs_context_length(tmp_path):
  """max_position_embeddings (and the tokenizer's model_max_length) is the run's seq_len, as
  transformers' Olmo3Config and AutoTokenizer read the export; a YaRN run's rope settings
  are what HF's YaRN expects: its factor is the extended length over the original."""
  _, cfg = train_checkpoint(tmp_path / 'ckpt')
  hf_ckpt.export_hf(str(tmp_path / 'ckpt'), str(tmp_path / 'out'))
  assert Olmo3Config.from_pretrained(str(tmp_path / 'out')).max_position_embeddings == \
      cfg.data.seq_len == 256
  assert AutoTokenizer.from_pretrained(str(tmp_path / 'out')).model_max_length == 256

  stage3 = olmo3_7b_stage3.get_config()  # YaRN x8 from 8192 to a 65,536-token sequence
  (tmp_path / 'yarn').mkdir()
  (tmp_path / 'yarn' / 'config.json').write_text(json.dumps(hf_ckpt.export_config(stage3, None)))
  theirs = Olmo3Config.from_pretrained(str(tmp_path / 'yarn'))
  full = theirs.rope_parameters['full_attention']
  assert theirs.max_position_embeddings == stage3.data.seq_len == 65_536
  assert (full['rope_type'], full['factor'], full['original_max_position_embeddings']) == (
      'yarn', 8.0, 8192)
  assert theirs.max_position_embeddings / full['original_max_position_embeddings'] == \
      full['factor']  # HF's consistency check on YaRN configs
  assert theirs.rope_parameters['sliding_attention']['rope_type'] == 'default'


def test_exported_weights_are_readable_like_every_file_written(tmp_path):
  """safetensors writes through a private (0600) temporary file; the export is shared."""
  train_checkpoint(tmp_path / 'ckpt')
  hf_ckpt.export_hf(str(tmp_path / 'ckpt'), str(tmp_path / 'out'))
  (tmp_path / 'probe').write_text('')  # what a plain open() gives under this umask
  mode = (tmp_path / 'probe').stat().st_mode & 0o777
  modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / 'out').iterdir()}
  assert 'model.safetensors' in modes and set(modes.values()) == {mode}, (modes, oct(mode))


def test_equal_settings_are_not_reported_as_differences(caplog):
  """checked_base (convert.py --from_olmo_core --config): 0.0003 and config.json's
  lr x alpha_f = 0.00030000000000000003 are one LR, and no_decay patterns that select the
  same parameters are one setting; a real difference is still logged."""
  from formats import olmo_core_config  # pylint: disable=import-outside-toplevel
  from configs import olmo3_7b  # pylint: disable=import-outside-toplevel
  base = olmo3_7b.get_config()
  base.opt.lr, base.opt.final_lr, base.opt.no_decay = 0.003, 0.0003, ('embed/.*',)
  translated = olmo3_7b.get_config()
  translated.opt.lr, translated.opt.final_lr = 0.003, 0.003 * 0.1
  translated.opt.no_decay = ('embed/embedding',)  # as _decay_settings writes it
  assert translated.opt.final_lr != base.opt.final_lr  # the last bits differ
  sources = {'opt.lr': 'config.json train_module.optim.lr',
             'opt.final_lr': 'config.json train_module.scheduler.alpha_f x lr',
             'opt.no_decay': 'model_and_optim/: optim.param_groups.*.weight_decay'}
  with caplog.at_level('WARNING'):
    olmo_core_config.checked_base(base, translated, sources)
  assert '--config has' not in caplog.text
  base.opt.final_lr, base.opt.no_decay = 0.0003 * (1 + 1e-6), ('embed/.*', 'final_norm/.*')
  with caplog.at_level('WARNING'):
    olmo_core_config.checked_base(base, translated, sources)
  assert '--config has opt.final_lr=' in caplog.text and '--config has opt.no_decay=' in caplog.text
