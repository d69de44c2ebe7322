"""scripts/fetch_data.py: a mix fetched from a faulty local server, as documented.

References: the bytes the server holds (files must be identical), OLMo-core's
own DataMix.build (the URLs of a shipped mix), and data.Dataset reading the
local mix (its instances must be the served tokens).
"""

import hashlib
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import data
import errors
from script_module import load_script
from test_download import FaultyServer
from tokens import token_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'scripts', 'fetch_data.py')


def _run(*args):
  # No proxy from the environment: requests must meet the real resolver and ports.
  env = {k: v for k, v in os.environ.items() if not k.lower().endswith('_proxy')}
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        cwd=REPO, timeout=120, env=env)


@pytest.fixture(scope='module')
def served(tmp_path_factory):
  """A mix of 3 sources / 5 token files behind a server, and the tokens of each file."""
  server = FaultyServer()
  rng = np.random.default_rng(0)
  tokens = {}
  lines = ['# a test mix', '']
  for i, (label, n) in enumerate([('web', 70_000), ('web', 33_333), ('code', 200_001),
                                  ('math', 5), ('math', 16_384)]):
    rel = f'preprocessed/{label}/{{TOKENIZER}}/part-{i:03d}.npy'
    toks = rng.integers(0, 100_278, n, dtype=np.uint32)
    path = rel.replace('{TOKENIZER}', 'allenai/dolma2-tokenizer')
    server.files['/root/' + path] = toks.astype('<u4').tobytes()
    tokens[path] = toks
    lines.append(f'{label},{rel}')
  mix = tmp_path_factory.mktemp('mix') / 'test-mix.txt'
  mix.write_text('\n'.join(lines) + '\n')
  yield server, str(mix), tokens
  server.close()


def test_fetch_from_faulty_server_then_nothing_on_the_second_run(served, tmp_path):
  server, mix, tokens = served
  paths = sorted(tokens)
  server.faults = {'/root/' + paths[0]: [('drop', 1000), ('status', 500)],
                   '/root/' + paths[2]: [('reset', 300_000), ('drop', 1)],
                   '/root/' + paths[4]: [('status', 502)]}
  out = tmp_path / 'out'
  args = [f'--mix={mix}', f'--base_url={server.url}/root', f'--output_dir={out}',
          '--workers=3', '--retries=3']
  result = _run(*args)
  assert result.returncode == 0, result.stderr
  total = sum(4 * t.size for t in tokens.values())
  assert f'5 downloaded, 0 already complete; {total:,} bytes transferred, {total:,} bytes in ' \
         '5 files' in result.stdout
  assert 'MiB/s' in result.stderr and 'ETA' in result.stderr
  for path, toks in tokens.items():
    assert (out / path).read_bytes() == toks.astype('<u4').tobytes()
  assert not [f for _, _, fs in os.walk(out) for f in fs if f.endswith(('.part', '.tmp'))]

  # The local mix is what cfg.data.mix_file reads: same files, mix order, sizes listed.
  local = out / 'test-mix.txt'
  paths_read, labels, sizes = token_files.read_mix(str(local))
  assert labels == ['web', 'web', 'code', 'math', 'math']
  assert sizes == [os.path.getsize(p) for p in paths_read]
  ds = data.Dataset(paths_read, seq_len=64, vocab_size=100_278, eos_token_id=100_257,
                    pad_token_id=100_277, labels=labels, listed_sizes=sizes)
  order = [p.split('/out/')[1] for p in paths_read]
  expected = np.concatenate([tokens[p][:tokens[p].size // 64 * 64].reshape(-1, 64)
                             for p in order])
  np.testing.assert_array_equal(ds.read(np.arange(ds.num_instances)), expected)

  server.log.clear()
  again = _run(*args)
  assert again.returncode == 0, again.stderr
  assert f'0 downloaded, 5 already complete; 0 bytes transferred, {total:,} bytes' in again.stdout
  assert not server.gets()


def test_list_counts_bytes_and_tokens_per_source(served):
  server, mix, tokens = served
  result = _run(f'--mix={mix}', f'--base_url={server.url}/root', '--list', '--seq_len=1000')
  assert result.returncode == 0, result.stderr
  rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()[1:]}
  for label in ('web', 'code', 'math'):
    sizes = [t.size for p, t in tokens.items() if f'/{label}/' in p]
    assert rows[label] == [f'{len(sizes):,}', f'{4 * sum(sizes):,}', f'{sum(sizes):,}',
                           f'{sum(n // 1000 for n in sizes):,}', '0']
  assert rows['TOTAL'][2] == f'{sum(t.size for t in tokens.values()):,}'
  assert not server.gets()


def test_missing_files_stop_the_fetch_unless_skipped(served, tmp_path):
  server, mix, tokens = served
  bad_mix = tmp_path / 'bad.txt'
  bad_mix.write_text(open(mix).read() + 'web,preprocessed/web/{TOKENIZER}/gone.npy\n')
  out = tmp_path / 'out'
  args = [f'--mix={bad_mix}', f'--base_url={server.url}/root', f'--output_dir={out}']
  result = _run(*args)
  assert result.returncode == 1
  assert f'{server.url}/root/preprocessed/web/allenai/dolma2-tokenizer/gone.npy: HTTP 404' \
      in result.stderr and 'Nothing was downloaded' in result.stderr
  assert not out.exists()
  listed = _run(*args, '--list')
  assert listed.returncode == 1 and 'unavailable: ' in listed.stderr
  skipped = _run(*args, '--skip_missing', '--labels=web')
  assert skipped.returncode == 0, skipped.stderr
  assert 'data order differs' in skipped.stderr
  assert len(token_files.read_mix(str(out / 'bad.txt'))[0]) == 2


def test_checksums_are_enforced(served, tmp_path):
  server, mix, tokens = served
  math = sorted(p for p in tokens if '/math/' in p)
  path = math[0]
  sums = tmp_path / 'SHA256SUMS'
  sums.write_text(''.join(f'{"0" * 64}  {p}\n' for p in math))
  out = tmp_path / 'out'
  result = _run(f'--mix={mix}', f'--base_url={server.url}/root', f'--output_dir={out}',
                '--labels=math', f'--checksums={sums}')
  assert result.returncode == 1 and 'sha256' in result.stderr
  assert not (out / path).exists() and not (out / 'test-mix.txt').exists()


def test_shipped_mixes_resolve_to_olmo_core_urls():
  """Our URLs for Ai2's mixes are the paths OLMo-core's DataMix.build makes."""
  from olmo_core.data import DataMix, TokenizerName
  fetch_data = load_script('fetch_data')
  for mix in (DataMix.OLMo_mix_0925_official, DataMix.OLMo_midtraining_mix_0925_ingredient1_100B,
              DataMix.OLMo_longmino_mix_0925, DataMix.c4_ppl_validation, DataMix.dolma17):
    want, want_labels = mix.build('https://olmo-data.org', TokenizerName.dolma2)
    got = fetch_data.entries(str(mix))
    assert [l for l, _ in got] == want_labels
    assert [fetch_data.url_of('https://olmo-data.org/', p) for _, p in got] == want
  with pytest.raises(FileNotFoundError, match='OLMo-mix-0925-official'):
    fetch_data.mix_file('OLMo-mix-0925-oficial')


def _big_mix(tmp_path, n: int = 950):
  """A mix the size of Ai2's stage 1 listing: n files under one label."""
  mix = tmp_path / 'big.txt'
  mix.write_text(''.join(f'web,preprocessed/web/{{TOKENIZER}}/part-{i:04d}.npy\n'
                         for i in range(n)))
  return mix


def test_no_network_stops_at_the_first_file_with_one_line(tmp_path):
  # .invalid never resolves (RFC 6761): as a machine without network, or a typo in --base_url.
  base = 'http://does-not-resolve.invalid/root'
  mix = _big_mix(tmp_path)
  for args in (['--list'], [f'--output_dir={tmp_path / "out"}']):
    start = time.time()
    result = _run(f'--mix={mix}', f'--base_url={base}', *args)
    assert time.time() - start < 10, result.stderr
    assert result.returncode == errors.EXIT_USAGE, result.stderr
    assert result.stdout == ''  # no table of zeros
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert 'the host does-not-resolve.invalid does not resolve' in lines[0]
    assert 'no network, or the host name is wrong' in lines[0]
  assert not (tmp_path / 'out').exists()


def test_a_refusing_server_stops_the_listing_after_the_first_file(tmp_path):
  sock = socket.socket()  # bound, not listening: every connection is refused
  sock.bind(('127.0.0.1', 0))
  try:
    start = time.time()
    result = _run(f'--mix={_big_mix(tmp_path)}', '--list',
                  f'--base_url=http://127.0.0.1:{sock.getsockname()[1]}/root')
  finally:
    sock.close()
  assert time.time() - start < 10, result.stderr
  assert result.returncode == errors.EXIT_CRASH and result.stdout == ''
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and 'nothing answers at 127.0.0.1' in lines[0], result.stderr


def test_checksum_paths_are_normalised_and_every_file_needs_one(served, tmp_path):
  server, mix, tokens = served
  math = sorted(p for p in tokens if '/math/' in p)
  digest = {p: hashlib.sha256(tokens[p].astype('<u4').tobytes()).hexdigest() for p in math}
  out = tmp_path / 'out'
  args = [f'--mix={mix}', f'--base_url={server.url}/root', f'--output_dir={out}',
          '--labels=math']
  # `find . | xargs sha256sum` writes ./path; sha256sum -b writes *path. A wrong
  # digest under those names must still be found, and so fail the fetch.
  sums = tmp_path / 'SHA256SUMS'
  sums.write_text(f'{"0" * 64}  ./{math[0]}\n{digest[math[1]]} *./{math[1]}\n')
  result = _run(*args, f'--checksums={sums}')
  assert result.returncode == 1 and 'sha256' in result.stderr, result.stderr
  assert not (out / math[0]).exists() and not (out / 'test-mix.txt').exists()
  # A file the checksum file does not list is an error before anything is fetched.
  sums.write_text(f'{digest[math[1]]}  /{math[1]}\n')
  result = _run(*args, f'--checksums={sums}')
  assert result.returncode == 1, result.stderr
  assert result.stderr.strip() == (f'error: {math[0]}: no entry in --checksums {sums}; add it, '
                                   'or fetch without --checksums.')
  assert not (out / math[0]).exists()
  # Right digests in every spelling: fetched and verified.
  sums.write_text(f'{digest[math[0]]}  ./{math[0]}\n{digest[math[1]]} *{math[1]}\n')
  result = _run(*args, f'--checksums={sums}')
  assert result.returncode == 0, result.stderr
  for p in math:
    assert (out / p).read_bytes() == tokens[p].astype('<u4').tobytes()
