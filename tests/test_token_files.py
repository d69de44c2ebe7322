"""tokens/token_files.py: mixes, token-file layout and checks, against OLMo-core where it has an
answer."""

import os
import subprocess
import sys

import numpy as np
import pytest

import data
import errors
from test_data import VOCAB, fsl_cfg, make_ds, olmo_ds, write_files
from tokens import token_files


def test_bad_files_and_mixes_name_the_file(tmp_path):
  good = write_files(tmp_path, [100, 200])
  odd = tmp_path / 'odd.npy'
  odd.write_bytes(b'\0' * 10)
  with pytest.raises(ValueError, match=f'{odd}: size 10 bytes is not a multiple of 4'):
    make_ds(good + [str(odd)], 8)
  with pytest.raises(FileNotFoundError, match='missing.npy: token file does not exist'):
    make_ds(good + [str(tmp_path / 'missing.npy')], 8)
  mix = tmp_path / 'mix.txt'
  mix.write_text(f'a,{good[0]},400\nb,{good[1]},900\n')
  mix_paths, _, listed = token_files.read_mix(str(mix))
  with pytest.raises(ValueError, match=f'{good[1]}: file is 800 bytes, shorter than the 900 bytes'):
    make_ds(mix_paths, 8, listed_sizes=listed)
  mix.write_text('# nothing here\n\n')
  with pytest.raises(ValueError, match=f'mix file {str(mix)!r} lists no token files'):
    token_files.read_mix(str(mix))
  with pytest.raises(FileNotFoundError, match='no-such-mix.txt'):
    token_files.read_mix(str(tmp_path / 'no-such-mix.txt'))


def _small_vocab_ds(path):
  return data.Dataset([str(path)], seq_len=8, vocab_size=8192, eos_token_id=0, pad_token_id=1)


def test_implausible_token_files_are_refused_naming_the_file_and_fix(tmp_path):
  ids = np.random.default_rng(0).integers(1, 8192, 6000)
  for n in (20, 6000):  # a tiny file is judged too
    (path := tmp_path / f'int{n}.bin').write_bytes(ids[:n].astype('<i8').tobytes())
    with pytest.raises(ValueError, match=f'{path}: every second 32-bit word of the {2 * n} '
                                         'sampled tokens is 0: this looks like int64 little-'
                                         'endian ids.*Re-tokenize to uint32 with scripts/prepare'):
      _small_vocab_ds(path)
  others = np.random.default_rng(1).integers(0, VOCAB, 6000)  # dolma2 ids, vocab 8192 configured
  for name, array, hint in [('be.bin', ids.astype('>u4'), 'they look like big-endian uint32'),
                            ('be64.bin', ids.astype('>i8'), 'they look like int64 big-endian'),
                            ('u16.bin', ids.astype('<u2'), 'they look like uint16'),
                            ('dolma.bin', others.astype('<u4'), 'the file was made with another '
                                                                'tokenizer')]:
    (path := tmp_path / name).write_bytes(array.tobytes())
    words = np.frombuffer(array.tobytes(), '<u4')
    bad = np.flatnonzero(words >= 8192)
    with pytest.raises(ValueError, match=f'{path}: token id {words[bad[0]]} at token offset '
                                         f'{bad[0]} is >= vocab_size 8192; so are {bad.size - 1} '
                                         f'more of the {words.size} tokens sampled: {hint}.*Check '
                                         'cfg.data.vocab_size, or re-tokenize to uint32'):
      _small_vocab_ds(path)


def test_token_file_check_reads_a_bounded_sample(tmp_path):
  n = 1 << 22  # 16 MiB of token 0, far more than the ~80K tokens sampled
  head, chunks = token_files._SAMPLE_HEAD, token_files._SAMPLE_CHUNKS
  stride = (n - head) // chunks // 2 * 2
  for name, offset in [('in_sample.bin', head + 2 * stride + 100), ('end.bin', n - 9)]:
    with open(tmp_path / name, 'wb') as f:
      f.truncate(4 * n)
      f.seek(4 * offset)
      f.write(np.array([9000, 9001], '<u4').tobytes())
  with pytest.raises(ValueError, match=f'in_sample.bin: token id 9000 at token offset '
                                       f'{head + 2 * stride + 100} .* so are 1 more'):
    _small_vocab_ds(tmp_path / 'in_sample.bin')  # found in a chunk spread past the head
  ds = _small_vocab_ds(tmp_path / 'end.bin')  # no full scan: the end was not read
  with pytest.raises(ValueError, match=f'end.bin: token id 9000 at token offset {n - 9} '):
    ds.check_tokens()  # the offline full scan finds it


def test_mix_file_tokenizer_base_dir_and_remap(tmp_path):
  local = tmp_path / 'mirror' / 'preprocessed' / 'allenai' / 'dolma2-tokenizer'
  local.mkdir(parents=True)
  paths = write_files(local, [100, 50, 300])
  mix = tmp_path / 'mix.txt'
  mix.write_text('# a comment\n' + ''.join(
      f'src{i},preprocessed/{{TOKENIZER}}/{os.path.basename(p)}\n' for i, p in enumerate(paths)))
  cfg = fsl_cfg(mix_file=str(mix), base_dir='s3://ai2-llm',
                path_remap=(f's3://ai2-llm/={tmp_path}/mirror/',))
  ds = data.Dataset.from_config(cfg)
  assert [f.path for f in ds.files] == paths
  assert [f.label for f in ds.files] == ['src0', 'src1', 'src2']
  assert ds.fingerprint == olmo_ds(paths, 8, tmp_path).fingerprint
  remote = token_files.config_sources(fsl_cfg(mix_file=str(mix), base_dir='s3://ai2-llm'))[0]
  assert remote == [f's3://ai2-llm/preprocessed/allenai/dolma2-tokenizer/{os.path.basename(p)}'
                    for p in paths]  # read from the bucket (tests/test_remote_data.py)
  relative = data.Dataset.from_config(fsl_cfg(paths=(os.path.basename(paths[2]),),
                                              base_dir=str(local)))
  assert relative.files[0].path == paths[2]


def test_npy_with_header_reads_like_raw(tmp_path):
  raw = write_files(tmp_path, [1000])[0]
  tokens = np.fromfile(raw, np.uint32)
  with_header = str(tmp_path / 'with_header.npy')
  np.save(with_header, tokens)
  a, b = make_ds([raw], 16), make_ds([with_header], 16)
  assert a.num_instances == b.num_instances == 62
  np.testing.assert_array_equal(a.read(np.arange(62)), b.read(np.arange(62)))
  np.save(with_header, tokens.astype(np.int64))
  with pytest.raises(ValueError, match='with_header.npy: .npy holds int64'):
    make_ds([with_header], 16)


def test_a_folder_or_a_token_file_given_as_the_mix_is_one_line(tmp_path):
  (tmp_path / 'corpus.txt').write_text('a,part-000.npy\n')
  with pytest.raises(errors.DataError, match=f"mix file '{tmp_path}' is a folder; set "
                                             'cfg.data.mix_file to the mix file in it \\(here: '
                                             f'{tmp_path}/corpus.txt\\)'):
    token_files.read_mix(str(tmp_path))
  tokens = write_files(tmp_path, [100])[0]
  for read in (token_files.read_mix, token_files.read_mix_header):
    with pytest.raises(errors.DataError, match=f"mix file '{tokens}' is binary \\(a token file"
                                               '\\?\\); a mix is a text file of `label,path` '
                                               'lines'):
      read(tokens)


@pytest.mark.parametrize('script', ['train.py', 'plan.py', 'scripts/audit_data.py'])
def test_entry_points_name_a_mix_that_is_a_folder_or_binary(script, tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  extra = {'train.py': [f'--workdir={tmp_path / "run"}'], 'plan.py': ['--devices=1']}
  for mix, what in ((tmp_path, 'is a folder'), (os.path.join(repo, 'data', 'shakespeare-train-'
                                                             '00000.npy'), 'is binary')):
    proc = subprocess.run([sys.executable, os.path.join(repo, script), '--config=configs/small.py',
                           f'--config.data.mix_file={mix}', *extra.get(script, [])], cwd=repo,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS='cpu'))
    assert proc.returncode == errors.EXIT_DATA, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: mix file '{mix}' {what}")
    assert 'Traceback' not in proc.stderr
