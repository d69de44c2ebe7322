"""Token data read from object storage and HTTP: the same batches as from local disk.

Against real servers this file starts itself (tests/servers.py): fake-gcs-server
(gs://), moto's S3 server (s3://) and a range-capable HTTP server, holding the
embedded Shakespeare corpus (data/, the mix configs/small.py trains on).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import config_checks
from configs import small
import data
import errors
from script_module import load_script
from tokens import packed
from tokens import remote_tokens
from servers import gcs_server, http_server, s3_server, upload  # noqa: F401  (fixtures)
from store import storage
from tokens import token_files

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / 'data'
MIX = 'shakespeare-train.txt'
TRAIN = 'shakespeare-train-00000.npy'
T, B, STEPS = 64, 8, 4
FILES = (MIX, TRAIN, 'shakespeare-validation-00000.npy', 'tokenizer.json')


def _cfg(mix_file: str, **data_fields):
  """configs/small.py at T=64, B=8, on the mix `mix_file`, completed from the mix."""
  cfg = small.get_config()
  cfg.data.mix_file = mix_file
  cfg.data.update(dict(seq_len=T, global_batch_size=B, **data_fields))
  return config_checks.complete(cfg, announce=False)


def _batches(cfg, steps=STEPS, state=None, step=None):
  """(fingerprint, [tokens of each step's batch], loader state after them)."""
  ds = data.Dataset.from_config(cfg.data)
  with data.Loader.from_config(cfg.data, ds, state=state, step=step) as loader:
    tokens = [next(loader)['tokens'] for _ in range(steps)]
    return ds.fingerprint, tokens, loader.state()


@pytest.fixture(scope='module')
def local():
  """The local run's fingerprint, batches and held-out batches: what every store must give."""
  cfg = _cfg(str(DATA / MIX))
  fingerprint, tokens, _ = _batches(cfg)
  held_out = data.held_out_batches(cfg.data, lambda n: 1)
  return fingerprint, tokens, held_out


@pytest.fixture(params=['gcs', 's3', 'http'])
def remote_dir(request, tmp_path):
  """A URL holding data/'s mix, token files and tokenizer, on each kind of store."""
  if request.param == 'http':
    for name in FILES:
      shutil.copy(DATA / name, tmp_path / name)
    with http_server(str(tmp_path)) as (url, stats):
      yield url, stats
    return
  fixture = request.getfixturevalue('gcs_server' if request.param == 'gcs' else 's3_server')
  scheme = 'gs' if request.param == 'gcs' else 's3'
  root = f'{scheme}://{fixture[1]}/corpus'
  upload(root, {name: (DATA / name).read_bytes() for name in FILES})
  yield root, None


def test_remote_mix_gives_the_local_batches_fingerprint_and_resume(remote_dir, local):
  root, _ = remote_dir
  cfg = _cfg(f'{root}/{MIX}')
  assert cfg.data.validation_paths == (f'{root}/shakespeare-validation-00000.npy',)
  fingerprint, tokens, state = _batches(cfg)
  assert fingerprint == local[0]
  for got, want in zip(tokens, local[1]):
    assert np.array_equal(got, want)
  # A resume in the middle: the state after 2 steps gives steps 3 and 4 again.
  _, first, mid = _batches(cfg, steps=2)
  _, resumed, _ = _batches(cfg, steps=2, state=json.loads(json.dumps(mid)), step=2)
  assert all(np.array_equal(a, b) for a, b in zip(first + resumed, tokens))
  # The held-out batches, from the mix's `# validation` line, on the same store.
  held_out = data.held_out_batches(cfg.data, lambda n: 1)
  assert len(held_out) == len(local[2])
  for got, want in zip(held_out, local[2]):
    assert np.array_equal(got['tokens'], want['tokens'])
  # The local mix with its folder mapped to the store (how a run moves), then data.paths and
  # data.base_dir as URLs: the same file list and fingerprint.
  remapped = _cfg(str(DATA / MIX), path_remap=(f'{DATA}/={root}/',))
  assert token_files.config_sources(remapped.data)[0] == [f'{root}/{TRAIN}']
  got_fingerprint, got, _ = _batches(remapped, steps=1)
  assert got_fingerprint == fingerprint and np.array_equal(got[0], tokens[0])
  by_paths = _cfg('', paths=(TRAIN,), base_dir=root, vocab_size=8192, eos_token_id=0,
                  pad_token_id=1)
  assert data.Dataset.from_config(by_paths.data).fingerprint == fingerprint


def test_packed_dataset_reads_remote_files_like_local(gcs_server, tmp_path):
  root = f'gs://{gcs_server[1]}/corpus'
  upload(root, {TRAIN: (DATA / TRAIN).read_bytes()})
  kw = dict(seq_len=512, vocab_size=8192, eos_token_id=0, pad_token_id=1)
  here = packed.PackedDataset([str(DATA / TRAIN)], cache_dir=str(tmp_path / 'a'), **kw)
  there = packed.PackedDataset([f'{root}/{TRAIN}'], cache_dir=str(tmp_path / 'b'), **kw)
  assert here.fingerprint == there.fingerprint and here.num_instances == there.num_instances
  ids = np.random.default_rng(0).choice(here.num_instances, 16, replace=False)
  assert np.array_equal(here.read(ids), there.read(ids))
  again = packed.PackedDataset([f'{root}/{TRAIN}'], cache_dir=str(tmp_path / 'b'), **kw)
  assert np.array_equal(again.read(ids), there.read(ids))  # from its packing cache


def test_listed_sizes_are_verified_with_one_request(tmp_path):
  shutil.copy(DATA / TRAIN, tmp_path / TRAIN)
  size = (DATA / TRAIN).stat().st_size
  with http_server(str(tmp_path)) as (url, stats):
    assert remote_tokens.probe(f'{url}/{TRAIN}', size) == size
    assert stats.requests == [('GET', f'/{TRAIN}', 'bytes=0-0')]
    with pytest.raises(errors.DataError, match=f'{TRAIN}: file is {size} bytes, longer than the '
                                               f'{size - 4} bytes its mix lists'):
      token_files.inspect_file(f'{url}/{TRAIN}', listed_size=size - 4)


def test_listed_sizes_on_object_stores(s3_server):
  root = f's3://{s3_server[1]}'
  upload(root, {TRAIN: (DATA / TRAIN).read_bytes()})
  size = (DATA / TRAIN).stat().st_size
  before = remote_tokens.requests_issued()
  assert remote_tokens.probe(f'{root}/{TRAIN}', size) == size
  assert remote_tokens.requests_issued() - before == 1
  assert remote_tokens.probe(f'{root}/{TRAIN}') == size  # S3 states the size past the end
  for listed in (size - 4, size + 4):
    assert remote_tokens.probe(f'{root}/{TRAIN}', listed) == size
  assert remote_tokens.probe(f'{root}/absent.npy', size) is None


def test_a_flaky_server_is_retried(tmp_path):
  shutil.copy(DATA / TRAIN, tmp_path / TRAIN)
  with http_server(str(tmp_path), fail_first=2) as (url, stats):  # the size probe
    ds = data.Dataset([f'{url}/{TRAIN}'], seq_len=T, vocab_size=8192, eos_token_id=0,
                      pad_token_id=1)
    assert [r[2] for r in stats.requests[:3]] == ['bytes=0-0'] * 3
    stats.fail_first = 2  # then two of a batch's ranged reads: the client retries them
    stats.requests.clear()
    got = ds.read(np.arange(4))
    assert len(stats.requests) == 4 + 2
  want = data.Dataset([str(DATA / TRAIN)], seq_len=T, vocab_size=8192, eos_token_id=0,
                      pad_token_id=1).read(np.arange(4))
  assert np.array_equal(got, want)


def test_a_batch_reads_its_instances_concurrently(tmp_path):
  shutil.copy(DATA / TRAIN, tmp_path / TRAIN)
  with http_server(str(tmp_path)) as (url, stats):
    ds = data.Dataset([f'{url}/{TRAIN}'], seq_len=T, vocab_size=8192, eos_token_id=0,
                      pad_token_id=1)
    stats.delay = 0.5
    start = time.time()
    ds.read(np.arange(0, 320, 10))
    elapsed = time.time() - start
  assert elapsed < 8 * stats.delay  # one after another would take 32 x 0.5 s


def test_missing_refused_and_rangeless_remote_files_are_one_line_data_errors(gcs_server,
                                                                            tmp_path):
  kw = dict(seq_len=T, vocab_size=8192, eos_token_id=0, pad_token_id=1)
  missing = f'gs://{gcs_server[1]}/corpus/absent.npy'
  with pytest.raises(errors.MissingDataError, match=f'{missing}: token file does not exist'):
    data.Dataset([missing], **kw)
  with pytest.raises(errors.MissingDataError, match=f"mix file '{missing}' does not exist"):
    token_files.read_mix(missing)
  shutil.copy(DATA / TRAIN, tmp_path / TRAIN)
  with http_server(str(tmp_path), fail_first=1, fail_status=403) as (url, stats):
    with pytest.raises(errors.DataError, match=f'{url}/{TRAIN}: access denied'):
      data.Dataset([f'{url}/{TRAIN}'], **kw)
    ds = data.Dataset([f'{url}/{TRAIN}'], **kw)
    stats.fail_first = 1  # refused while reading a batch too
    with pytest.raises(errors.DataError, match=f'{url}/{TRAIN}.*: access denied'):
      ds.read(np.arange(2))
    with pytest.raises(errors.MissingDataError, match=f'{url}/absent.npy: token file does not'):
      data.Dataset([f'{url}/absent.npy'], **kw)
  with http_server(str(tmp_path), ranges=False) as (url, stats):
    with pytest.raises(errors.DataError, match=f'{url}/{TRAIN}: the server does not honour HTTP '
                                               'range requests'):
      data.Dataset([f'{url}/{TRAIN}'], **kw)
    assert stats.count() == 1  # one probe, whose whole-file answer was not read
  # The command line: one line, exit code 5.
  proc = subprocess.run([sys.executable, str(REPO / 'train.py'), '--config=configs/small.py',
                         f'--config.data.mix_file={missing}', f'--workdir={tmp_path / "run"}'],
                        cwd=REPO, capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == errors.EXIT_DATA, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1].startswith(f"error: data.mix_file='{missing}' "
                                                         'does not exist')
  assert 'Traceback' not in proc.stderr


def test_fetch_data_writes_a_remote_mix_with_sizes(tmp_path, local):
  shutil.copy(DATA / TRAIN, tmp_path / TRAIN)
  with http_server(str(tmp_path)) as (url, stats):
    proc = subprocess.run([sys.executable, str(REPO / 'scripts' / 'fetch_data.py'),
                           f'--mix={DATA / MIX}', f'--base_url={url}',
                           f'--remote_mix={tmp_path / "remote.txt"}'], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    paths, _, sizes = token_files.read_mix(str(tmp_path / 'remote.txt'))
    assert (paths, sizes) == ([f'{url}/{TRAIN}'], [(DATA / TRAIN).stat().st_size])
    cfg = _cfg(str(tmp_path / 'remote.txt'), vocab_size=8192, eos_token_id=0, pad_token_id=1)
    stats.requests.clear()
    assert _batches(cfg, steps=1)[0] == local[0]
    assert stats.requests[0] == ('GET', f'/{TRAIN}', 'bytes=0-0')  # the listed size, checked


def test_the_cache_makes_a_second_read_issue_no_requests(tmp_path):
  (tmp_path / 'www').mkdir()
  for name in FILES:
    shutil.copy(DATA / name, tmp_path / 'www' / name)
  cache = str(tmp_path / 'cache')
  with http_server(str(tmp_path / 'www')) as (url, stats):
    cfg = _cfg(f'{url}/{MIX}', remote_cache_dir=cache)
    ds = data.Dataset.from_config(cfg.data)
    ids = data.global_batch_ids(ds, cfg.data.seed, 1, 0, B)
    first = ds.read(ids)
    stats.requests.clear()
    assert np.array_equal(ds.read(ids), first) and stats.requests == []  # a second epoch
    restarted = data.Dataset.from_config(cfg.data)  # a restart: the mix, and one size probe
    assert np.array_equal(restarted.read(ids), first)
    assert [r for r in stats.requests if r[1] != f'/{MIX}'] == [('GET', f'/{TRAIN}', 'bytes=0-0')]
  assert np.array_equal(first, data.Dataset.from_config(_cfg(str(DATA / MIX)).data).read(ids))
  with pytest.raises(errors.ConfigError, match='remote_cache_dir=.* is a URL.*local path'):
    remote_tokens.RangeReader('gs://bucket/cache')


def test_scripts_read_remote_mixes(gcs_server, local):
  root = f'gs://{gcs_server[1]}/corpus'
  upload(root, {name: (DATA / name).read_bytes() for name in FILES})
  inspect = load_script('inspect_batch')
  report = inspect.describe(_cfg(f'{root}/{MIX}'), step=1)
  assert np.array_equal(np.array([r['tokens'] for r in report['instances']]), local[1][0])
  assert report['instances'][0]['file'].startswith(root)
  audit = load_script('audit_data')
  cfg = _cfg(f'{root}/{MIX}')
  ds = audit.build_dataset(cfg.data)
  order = audit.audit_order(ds, cfg.data, steps=3, devices=2, micro_batch_size=2,
                            resume_every=2)
  assert order['repeated_ids'] == 0 and not order['loader_errors']
  content = audit.audit_content(ds, min_doc_tokens=8)
  here = audit.audit_content(audit.build_dataset(_cfg(str(DATA / MIX)).data), min_doc_tokens=8)
  assert content == here


def _losses(workdir) -> list[float]:
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return [r['train/CE loss'] for r in records if 'train/CE loss' in r]


@pytest.mark.slow
def test_train_on_gcs_paths_matches_local_losses(gcs_server, tmp_path):
  from test_multihost import TINY, trainer_env  # pylint: disable=import-outside-toplevel
  root = f'gs://{gcs_server[1]}/corpus'
  upload(root, {TRAIN: (DATA / TRAIN).read_bytes()})
  ids = ['--config.data.mix_file=', '--config.data.vocab_size=8192',
         '--config.data.eos_token_id=0', '--config.data.pad_token_id=1', '--config.train.steps=3',
         '--config.train.ckpt_every=100']
  losses = []
  for name, path in (('local', DATA / TRAIN), ('gcs', f'{root}/{TRAIN}')):
    workdir = tmp_path / name
    proc = subprocess.run([sys.executable, str(REPO / 'train.py'), *TINY, *ids,
                           f'--config.data.paths=("{path}",)', f'--workdir={workdir}'], cwd=REPO,
                          env=trainer_env(1), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses.append(_losses(workdir))
  assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_mixed_local_and_remote_files_read_as_one_dataset(gcs_server, tmp_path):
  other = tmp_path / 'other.npy'
  np.arange(1000, dtype='<u4').tofile(other)
  root = f'gs://{gcs_server[1]}'
  upload(root, {TRAIN: (DATA / TRAIN).read_bytes()})
  kw = dict(seq_len=T, vocab_size=8192, eos_token_id=0, pad_token_id=1)
  local_ds = data.Dataset([str(other), str(DATA / TRAIN)], **kw)
  mixed = data.Dataset([str(other), f'{root}/{TRAIN}'], **kw)
  assert isinstance(mixed.maps, remote_tokens.RemoteTokens)
  assert mixed.fingerprint == local_ds.fingerprint
  ids = np.array([0, 3, 15, 16, 200, 17])
  assert np.array_equal(mixed.read(ids), local_ds.read(ids))
  mixed.check_tokens()
  assert storage.is_url(mixed.files[1].path)
