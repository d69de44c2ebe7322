"""scripts/audit_data.py and the in-loop data guards (guards.py) against planted repeats.

References: numpy's np.unique on the same ids (repeat counts), OLMo-core's own
find_periodic_sequences / InstanceFilterConfig (n-gram statistics), and byte
comparisons of the token files (identical instances, repeated documents).
"""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
from olmo_core.data.utils import find_periodic_sequences
import pytest

import data
from script_module import load_script
import guards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'scripts', 'audit_data.py')
EOS, VOCAB, T = 0, 1000, 16


audit = load_script('audit_data')


def _cfg(B=8, seed=7):
  return ml_collections.ConfigDict(dict(global_batch_size=B, seed=seed, seq_len=T,
                                        vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=1,
                                        allow_data_change=False, document_masking=False,
                                        repetition_filter=False, prefetch=2))


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """Random token files (documents end at EOS = 0) of uneven sizes, with remainders."""
  root = tmp_path_factory.mktemp('tokens')
  rng = np.random.default_rng(3)
  paths = []
  for i, n in enumerate([1000, 37, 777, 2048]):
    toks = rng.integers(1, VOCAB, n).astype('<u4')
    toks[rng.random(n) < 0.02] = EOS
    path = root / f'f{i}.npy'
    toks.tofile(path)
    paths.append(str(path))
  return paths


def _ds(paths):
  return data.Dataset(paths, seq_len=T, vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=1)


def test_mark_seen_counts_every_repeat_like_np_unique():
  rng = np.random.default_rng(0)
  bitmap = np.zeros(1001 // 8 + 1, np.uint8)
  seen = np.zeros(0, np.int64)
  for _ in range(20):
    ids = rng.integers(0, 1001, 300)
    again = guards.mark_seen(bitmap, ids)
    everything = np.concatenate([seen, ids])
    _, counts = np.unique(everything, return_counts=True)
    _, before = np.unique(seen, return_counts=True)
    assert again.size == (counts - 1).sum() - (before - 1).sum()
    seen = everything
  assert np.unpackbits(bitmap, bitorder='little').sum() == np.unique(seen).size
  with pytest.raises(IndexError, match='outside the'):
    guards.mark_seen(bitmap, np.array([8 * bitmap.size]))


@pytest.mark.parametrize('devices,micro,resume_every', [(1, 8, 0), (2, 2, 3), (4, 1, 5)])
def test_clean_order_reads_every_instance_once_per_epoch(files, devices, micro, resume_every):
  ds = _ds(files)
  per_epoch = ds.num_instances // 8
  steps = 2 * per_epoch + 3  # two full epochs and part of a third, across resumes
  report = audit.audit_order(ds, _cfg(), steps=steps, devices=devices, micro_batch_size=micro,
                             resume_every=resume_every)
  assert report['repeated_ids'] == 0 and report['ids_read'] == steps * 8
  assert report['complete_epochs'] == [1, 2]
  assert report['dropped_tail_per_epoch'] == ds.num_instances % 8
  assert report['micro_batches'] == 8 // devices // micro
  assert report['resumes'] == ((steps - 1) // resume_every if resume_every else 0)


def test_planted_loader_bugs_are_caught_with_their_place(files, monkeypatch):
  ds = _ds(files)
  real = data.global_batch_ids

  def repeat_first(ds_, seed, epoch, step, B, cache_dir=None):
    ids = real(ds_, seed, epoch, step, B, cache_dir)
    if step == 5:
      ids[3] = real(ds_, seed, epoch, 1, B, cache_dir)[6]  # an id of step 1 again
    return ids

  monkeypatch.setattr(data, 'global_batch_ids', repeat_first)
  report = audit.audit_order(ds, _cfg(), steps=10, devices=2, micro_batch_size=2)
  assert report['repeated_ids'] == 1
  sightings = {(s['step'], s['rank'], s['micro_batch']) for s in report['repeat_sightings']}
  # Position 3 is rank 1's second instance (micro-batch 0); position 6 is rank 0's 4th (mb 1).
  assert sightings == {(1, 0, 1), (5, 1, 0)}
  monkeypatch.setattr(data, 'global_batch_ids', real)

  # A position bug: the loader yields one batch twice (the seed's kind of repeat).
  next_position = data.Loader._next_position
  monkeypatch.setattr(data.Loader, '_next_position',
                      lambda self, e, s: (e, s) if s == 4 and not hasattr(self, '_x') and
                      not setattr(self, '_x', 1) else next_position(self, e, s))
  report = audit.audit_order(ds, _cfg(), steps=10)
  assert report['repeated_ids'] == 8


def test_the_in_loop_metric_catches_the_same_planted_bug(files, monkeypatch):
  ds = _ds(files)
  real = data.global_batch_ids
  monkeypatch.setattr(data, 'global_batch_ids', lambda d, s, e, k, B, c=None: real(
      d, s, e, min(k, 2), B, c))  # from step 2 on, the same batch again and again
  tracker = guards.RepeatTracker(ds.num_instances)
  with data.Loader(ds, seed=7, global_batch_size=8) as loader:
    counts = []
    for _ in range(5):
      next(loader)
      counts.append(tracker.observe(loader.last_position[0],
                                    loader.ids_at(*loader.last_position)))
  assert counts == [0, 0, 0, 8, 8] and tracker.total == 16
  monkeypatch.setattr(data, 'global_batch_ids', real)
  clean = guards.RepeatTracker(ds.num_instances)
  per_epoch = ds.num_instances // 8
  with data.Loader(ds, seed=7, global_batch_size=8) as loader:
    for _ in range(per_epoch + 2):  # into epoch 2: the bitmap starts afresh
      next(loader)
      assert clean.observe(loader.last_position[0], loader.ids_at(*loader.last_position)) == 0
  # A resume rebuilds the epoch's bitmap from the ids of its earlier steps.
  resumed = guards.RepeatTracker(ds.num_instances)
  resumed.replay(1, (loader.ids_at(1, s) for s in range(3)))
  assert resumed.total == 0 and resumed.observe(1, loader.ids_at(1, 2)) == 8


def test_same_file_twice_is_caught_by_the_in_loop_metric(files, tmp_path):
  copy = tmp_path / 'copy.npy'
  copy.write_bytes(open(files[2], 'rb').read())  # another path, the same bytes
  assert guards.duplicate_files(files) == {}
  assert guards.duplicate_files(files + [files[2], str(copy)]) == {4: 2, 5: 2}
  ds = _ds(files + [str(copy)])
  tracker = guards.RepeatTracker.for_dataset(ds)
  with data.Loader(ds, seed=7, global_batch_size=8) as loader:
    for _ in range(ds.num_instances // 8):
      next(loader)
      tracker.observe(loader.last_position[0], loader.ids_at(*loader.last_position))
  # A repeat for each instance of f2 read along with its twin in the copy (the tail is dropped).
  tail = set(data.permutation(ds.num_instances, 7, 1)[ds.num_instances // 8 * 8:].tolist())
  pairs = sum(ds.starts[2] + k not in tail and ds.starts[4] + k not in tail
              for k in range(777 // T))
  assert tracker.total == pairs > 0
  assert guards.RepeatTracker.for_dataset(_ds(files)).aliases == ()


def test_same_file_twice_is_caught_by_content_and_a_clean_mix_reports_zero(files, tmp_path):
  clean = audit.audit_content(_ds(files), min_doc_tokens=8)
  assert clean['identical_instances'] == 0
  assert clean['documents_repeated_across_entries'] == 0
  twice = _ds(files + [files[2]])
  report = audit.audit_content(twice, min_doc_tokens=8)
  n2 = 777 // T
  assert report['identical_instances'] == n2
  # Documents of f2 (>= 8 tokens, whole ones and its cut-off ends) again in the 5th entry.
  toks = np.fromfile(files[2], '<u4')
  ends = np.flatnonzero(toks == EOS) + 1
  lengths = np.diff(np.concatenate([[0], ends, [toks.size]] if ends[-1] < toks.size
                                   else [[0], ends]))
  assert report['documents_repeated_across_entries'] == int((lengths >= 8).sum())
  group = report['identical_instance_groups'][0]
  assert {g['file'] for g in group} == {files[2]}
  # Bounded memory: a tiny budget spills to many buckets and finds the same.
  spilled = audit.audit_content(twice, min_doc_tokens=8, memory_mb=0.001)
  assert spilled['hash_buckets'] > 8
  for key in ('identical_instances', 'documents_repeated_across_entries',
              'documents_repeated_within_an_entry'):
    assert spilled[key] == report[key]


def test_ngram_statistics_match_olmo_core(files):
  rng = np.random.default_rng(5)
  tokens = rng.integers(1, VOCAB, (40, 96)).astype(np.uint32)
  for row, (p, times) in enumerate([(1, 40), (2, 31), (3, 32), (13, 5), (5, 3), (7, 2)]):
    pattern = rng.integers(1, VOCAB, p)
    run = np.tile(pattern, times)[:96]
    tokens[row, 96 - run.size:] = run
  ours = audit.max_repeat_times(tokens)
  for row in range(40):
    theirs = [r.times for r in find_periodic_sequences(tokens[row].astype(np.int64),
                                                       max_period=13)]
    assert ours[row] == max(theirs, default=0), row
  np.testing.assert_array_equal(ours >= 32, data.repetition_rejected(tokens))
  report = audit.audit_content(_ds(files), ngrams=True)
  assert report['ngrams']['rejected_instances'] == 0
  assert sum(report['ngrams']['max_repeats_histogram'].values()) == _ds(files).num_instances


def _run(*args):
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        cwd=REPO, timeout=300)


def test_cli_passes_a_clean_config_and_fails_a_mix_listing_a_file_twice(files, tmp_path):
  common = ['--config=configs/small.py', '--config.data.global_batch_size=8',
            f'--config.data.seq_len={T}', f'--config.data.vocab_size={VOCAB}',
            f'--config.data.eos_token_id={EOS}', '--config.train.ckpt_every=4',
            '--devices=2', '--config.train.micro_batch_size=2', '--config.data.paths=()']
  mix = tmp_path / 'mix.txt'
  mix.write_text(''.join(f'src,{p}\n' for p in files))
  ok = _run(*common, f'--config.data.mix_file={mix}', '--steps=30', '--content', '--ngrams',
            f'--json={tmp_path / "r.json"}')
  assert ok.returncode == 0, ok.stderr
  assert 'PASS' in ok.stdout and ', 0 repeated;' in ok.stdout and '7 resumes' in ok.stdout
  report = json.loads((tmp_path / 'r.json').read_text())
  assert report['order']['ids_read'] == 240 and report['content']['identical_instances'] == 0
  mix.write_text(''.join(f'src,{p}\n' for p in files + [files[0]]))
  bad = _run(*common, f'--config.data.mix_file={mix}', '--steps=5', '--content')
  assert bad.returncode == 1 and 'FAIL' in bad.stdout
  assert f'{1000 // T} identical instances' in bad.stdout
  # Order only, from sizes: the files are gone but the mix lists their bytes.
  sized = tmp_path / 'sized.txt'
  sized.write_text(''.join(f'src,{tmp_path}/gone{i}.npy,{os.path.getsize(p)}\n'
                           for i, p in enumerate(files)))
  order_only = _run(*common, f'--config.data.mix_file={sized}', '--steps=20')
  assert order_only.returncode == 0 and 'from the sizes' in order_only.stderr
  assert '160 ids read, 0 repeated' in order_only.stdout


# --- The memorization warning ------------------------------------------------------------------


def _watch(train_fn, heldout_fn, evals=20, eval_every=50, log_every=10, noise=0.03, seed=0):
  """Feeds MemorizationWatch a synthetic run; returns the steps at which it warned."""
  rng = np.random.default_rng(seed)
  watch = guards.MemorizationWatch(threshold=0.1, evals=3)
  fired = []
  for step in range(log_every, evals * eval_every + 1, log_every):
    watch.observe_train(step, train_fn(step) + noise * rng.standard_normal())
    if step % eval_every == 0 and watch.observe_eval(step, heldout_fn(step)):
      fired.append(step)
  return fired


def test_memorization_watch_on_synthetic_loss_curves(capsys):
  fast_fall = lambda s: 5.0 + 2.0 * np.exp(-s / 60)  # most of the fall before the first eval
  for seed in range(5):  # healthy: both curves fall together, noisy train CE, early fast fall
    assert _watch(fast_fall, lambda s: fast_fall(s) + 0.04, seed=seed) == []
  assert _watch(lambda s: 5 - s / 1000, lambda s: 5.03 - s / 1000) == []
  # The README main job's logged curves (train.py --config=configs/small.py): train CE every
  # 10 steps, validation every 50. Both were silent, with 0 repeated instances.
  readme_runs = [  # 16 x 256 for 150 steps (gap 0.074, 0.164, 0.044), then 8 x 256 for 300
      ([6.7091, 6.2192, 5.9972, 5.8573, 5.7892, 5.6545, 5.5116, 5.3471, 5.3098, 5.3492,
        5.2449, 5.4286, 5.2425, 5.1959, 5.2168], {50: 5.7477, 100: 5.4355, 150: 5.2520}),
      ([7.5003, 6.0944, 6.0586, 6.1216, 6.2755, 5.9098, 5.7601, 5.7059, 5.6601, 5.7224,
        5.447, 5.7472, 5.2894, 5.1641, 4.8876, 5.1262, 5.2798, 5.1024, 5.1382, 5.2077, 5.2345,
        5.2179, 5.3874, 5.5394, 4.9512, 5.1856, 5.1759, 4.949, 5.1511, 5.1453],
       {50: 5.9868, 100: 5.5957, 150: 5.3904, 200: 5.2027, 250: 5.1398, 300: 5.074})]
  for readme_train, readme_heldout in readme_runs:
    watch = guards.MemorizationWatch(threshold=0.1, evals=3)
    for i, ce in enumerate(readme_train):
      watch.observe_train(10 * (i + 1), ce)
      if 10 * (i + 1) in readme_heldout:
        assert watch.observe_eval(10 * (i + 1), readme_heldout[10 * (i + 1)]) == {}
  # Memorizing: train CE keeps falling 0.06 per eval while held-out CE stalls.
  fired = _watch(lambda s: 5.0 - 0.06 * s / 50, lambda s: 5.0)
  assert fired and fired[0] <= 250
  assert 'possible memorization' in capsys.readouterr().err
  # A slow drift, 0.02 nats per eval, never widening at every eval (noise 0.03): caught late.
  slow = _watch(lambda s: 5.0 - 0.02 * s / 50, lambda s: 5.0, evals=30, seed=1)
  assert slow and 300 <= slow[0] <= 1000
  with pytest.raises(ValueError, match='memorization_threshold'):
    guards.MemorizationWatch(threshold=0, evals=3)


def test_a_run_repeating_a_few_batches_warns_and_counts_repeats(tmp_path, monkeypatch, capfd,
                                                                caplog):
  """A real train.py run with a planted loader bug: two batches, again and again."""
  import train
  from test_train import tiny_config, token_files as _  # noqa: F401  (the same tiny setup)
  tokens = np.fromfile(os.path.join(REPO, 'data', 'shakespeare-train-00000.npy'), '<u4',
                       64 * 16 * 12) % 256
  paths = str(tmp_path / 'train.npy'), str(tmp_path / 'validation.npy')
  tokens[:64 * 16 * 10].astype('<u4').tofile(paths[0])
  tokens[64 * 16 * 10:].astype('<u4').tofile(paths[1])
  cfg = tiny_config(paths, **{'train.steps': 30, 'train.eval_every': 10, 'train.log_every': 2,
                              'train.ckpt_every': 30, 'opt.lr': 1e-2})
  real = data.global_batch_ids
  monkeypatch.setattr(data, 'global_batch_ids',
                      lambda d, s, e, k, B, c=None: real(d, s, e, k % 2, B, c))
  train.train(cfg, str(tmp_path / 'run'), 0)
  records = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
  repeats = {r['step']: r['data/repeated instances'] for r in records
             if 'data/repeated instances' in r}
  # 10 batches per epoch; in each, batches 0 and 1 are new and the 8 after them repeats.
  assert repeats == {s: 0 if (s - 1) % 10 < 2 else 16 for s in range(1, 31)}
  warnings = [r for r in records if 'guard/memorization' in r]
  assert warnings and 'possible memorization' in warnings[0]['guard/memorization']
  assert 'WARNING: possible memorization' in capfd.readouterr().err
  assert 'already seen in epoch 1' in caplog.text and 'possible memorization' in caplog.text
