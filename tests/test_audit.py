"""scripts/audit_data.py and the in-loop repeat metric (health.RepeatTracker) vs planted repeats.

References: numpy's np.unique on the same ids (repeat counts), OLMo-core's own
find_periodic_sequences / InstanceFilterConfig (n-gram statistics), and byte
comparisons of the token files (identical instances, repeated documents).
"""

import json
import os
import re
import subprocess
import sys
import time

import ml_collections
import numpy as np
from olmo_core.data.utils import find_periodic_sequences
import pytest

import data
from monitor import health
from script_module import load_script
from tokens import batches

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


@pytest.mark.parametrize('devices,micro,resume_every', [(1, 8, 0), (2, 2, 3), (4, 1, 5)])
def test_clean_order_reads_every_instance_once_per_epoch(files, devices, micro, resume_every):
  ds = _ds(files)
  per_epoch = ds.num_instances // 8
  steps = 2 * per_epoch + 3  # two full epochs and part of a third, across resumes
  report = audit.audit_order(ds, _cfg(), steps=steps, devices=devices, micro_batch_size=micro,
                             resume_every=resume_every)
  assert report['repeated_ids'] == 0 and report['ids_read'] == report['ids_audited'] == steps * 8
  assert report['all_epochs'] and report['audited_epochs'] == [1, 2, 3]
  assert report['complete_epochs'] == 2 and report['complete_epochs_audited'] == [1, 2]
  assert report['dropped_tail_per_epoch'] == ds.num_instances % 8
  assert report['micro_batches'] == 8 // devices // micro
  assert report['resumes'] == report['resumes_planned'] == ((steps - 1) // resume_every
                                                            if resume_every else 0)


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
  assert report['loader_errors'] == [  # one batch late: it read batch 4 twice
      'after 10 steps the loader is at epoch 1, step 9, not where 10 batches of 8 lead '
      '(30 per epoch).']


def test_the_in_loop_metric_catches_the_same_planted_bug(files, monkeypatch):
  ds = _ds(files)
  real = data.global_batch_ids
  monkeypatch.setattr(data, 'global_batch_ids', lambda d, s, e, k, B, c=None: real(
      d, s, e, min(k, 2), B, c))  # from step 2 on, the same batch again and again
  tracker = health.RepeatTracker(ds.num_instances)
  with data.Loader(ds, seed=7, global_batch_size=8) as loader:
    counts = []
    for _ in range(5):
      next(loader)
      counts.append(tracker.observe(loader.last_position[0],
                                    loader.ids_at(*loader.last_position)))
  assert counts == [0, 0, 0, 8, 8] and tracker.total == 16
  monkeypatch.setattr(data, 'global_batch_ids', real)
  clean = health.RepeatTracker(ds.num_instances)
  per_epoch = ds.num_instances // 8
  with data.Loader(ds, seed=7, global_batch_size=8) as loader:
    for _ in range(per_epoch + 2):  # into epoch 2: the bitmap starts afresh
      next(loader)
      assert clean.observe(loader.last_position[0], loader.ids_at(*loader.last_position)) == 0
  # A resume rebuilds the epoch's bitmap from the ids of its earlier steps.
  resumed = health.RepeatTracker(ds.num_instances)
  resumed.replay(1, (loader.ids_at(1, s) for s in range(3)))
  assert resumed.total == 0 and resumed.observe(1, loader.ids_at(1, 2)) == 8


def test_same_file_twice_is_caught_by_the_in_loop_metric(files, tmp_path):
  copy = tmp_path / 'copy.npy'
  copy.write_bytes(open(files[2], 'rb').read())  # another path, the same bytes
  assert health.duplicate_files(files) == {}
  assert health.duplicate_files(files + [files[2], str(copy)]) == {4: 2, 5: 2}
  ds = _ds(files + [str(copy)])
  tracker = health.RepeatTracker.for_dataset(ds)
  with data.Loader(ds, seed=7, global_batch_size=8) as loader:
    for _ in range(ds.num_instances // 8):
      next(loader)
      tracker.observe(loader.last_position[0], loader.ids_at(*loader.last_position))
  # A repeat for each instance of f2 read along with its twin in the copy (the tail is dropped).
  tail = set(data.permutation(ds.num_instances, 7, 1)[ds.num_instances // 8 * 8:].tolist())
  pairs = sum(ds.starts[2] + k not in tail and ds.starts[4] + k not in tail
              for k in range(777 // T))
  assert tracker.total == pairs > 0
  assert health.RepeatTracker.for_dataset(_ds(files)).aliases == ()


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
  np.testing.assert_array_equal(ours >= 32, batches.repetition_rejected(tokens))
  report = audit.audit_content(_ds(files), ngrams=True)
  assert report['ngrams']['rejected_instances'] == 0
  assert sum(report['ngrams']['max_repeats_histogram'].values()) == _ds(files).num_instances


def _run(*args):
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        cwd=REPO, timeout=300)


def test_cli_passes_a_clean_config_and_fails_a_mix_listing_a_file_twice(files, tmp_path):
  common = ['--config=configs/small.py', '--config.data.global_batch_size=8',
            f'--config.data.seq_len={T}', f'--config.data.vocab_size={VOCAB}',
            f'--config.data.eos_token_id={EOS}', '--config.data.pad_token_id=1',
            '--config.train.ckpt_every=4',
            '--devices=2', '--config.train.micro_batch_size=2', '--config.data.paths=()']
  mix = tmp_path / 'mix.txt'
  mix.write_text(''.join(f'src,{p}\n' for p in files))
  ok = _run(*common, f'--config.data.mix_file={mix}', '--steps=30', '--content', '--ngrams',
            f'--json={tmp_path / "r.json"}')
  assert ok.returncode == 0, ok.stderr
  assert 'PASS' in ok.stdout and ', 0 repeated within an epoch;' in ok.stdout
  assert 'resumes: 7 of the 7 planned' in ok.stdout and 'WARNING' not in ok.stderr
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


# --- Runs that read their data many times over -------------------------------------------------


def test_a_many_epoch_plan_is_summarised_and_audited_where_the_paths_differ(files):
  ds = _ds(files)
  N, B = ds.num_instances, 8
  n = N // B
  assert (N, n) == (240, 30)  # the fixture's 4 files: 62 + 2 + 48 + 128 instances of 16
  steps, resume_every = 1000 * n + 7, 70  # 1,001 epochs, the last one partial
  report = audit.audit_order(ds, _cfg(B), steps=steps, devices=2, micro_batch_size=2,
                             resume_every=resume_every)
  assert (report['epochs'], report['complete_epochs']) == (1001, 1000)
  assert report['ids_read'] == steps * B and report['repetition'] == steps * B / N
  assert report['resumes_planned'] == (steps - 1) // resume_every
  # The first two and the last two, the middle, the epoch of the first resume inside an epoch
  # (step 70: epoch 3) and the two around the first resume at an epoch end (lcm(70, 30) = 210).
  assert report['audited_epochs'] == [1, 2, 3, 7, 8, 501, 1000, 1001]
  assert not report['all_epochs'] and report['repeated_ids'] == 0
  assert report['audited_steps'] == 7 * n + 7 and report['ids_audited'] == (7 * n + 7) * B
  assert report['complete_epochs_audited'] == [1, 2, 3, 7, 8, 501, 1000]
  assert report['resumes'] == 2  # steps 70 and 210; none falls inside epochs 501, 1000-1001
  summary = '\n'.join(audit.order_summary(report))
  assert len(summary) < 2000 and '1,001 epochs' in summary and 'not read: the other 993' in summary


def test_the_sampled_audit_catches_bugs_where_it_reads_and_says_where_it_does_not(files,
                                                                                    monkeypatch):
  ds = _ds(files)
  real = data.global_batch_ids

  def plant(epoch_with_bug):
    def repeat(ds_, seed, epoch, step, B, cache_dir=None):
      ids = real(ds_, seed, epoch, step, B, cache_dir)
      if epoch == epoch_with_bug and step == 3:
        ids[0] = real(ds_, seed, epoch, 1, B, cache_dir)[0]
      return ids
    monkeypatch.setattr(data, 'global_batch_ids', repeat)

  steps = 50 * 30  # 50 epochs
  plant(50)  # the last epoch: always audited
  assert audit.audit_order(ds, _cfg(), steps=steps)['repeated_ids'] == 1
  plant(40)  # an epoch the sampled audit does not read: only --all_epochs finds it
  sampled = audit.audit_order(ds, _cfg(), steps=steps)
  assert 40 not in sampled['audited_epochs'] and sampled['repeated_ids'] == 0
  assert 'not read: the other' in '\n'.join(audit.order_summary(sampled))
  full = audit.audit_order(ds, _cfg(), steps=steps, all_epochs=True)
  assert full['audited_epochs'] == list(range(1, 51)) and full['repeated_ids'] == 1
  assert 'not read' not in '\n'.join(audit.order_summary(full))
  monkeypatch.setattr(data, 'global_batch_ids', real)
  # A loader that loses its place at a resume on an epoch end (step 60 = epoch 3, step 0).
  state = data.Loader.state
  monkeypatch.setattr(data.Loader, 'state', lambda self: {
      **state(self), 'step': state(self)['step'] + (state(self)['step'] == 0)})
  lost = audit.audit_order(ds, _cfg(), steps=steps, resume_every=60)['loader_errors']
  # Audited: epochs 1-3 (a resume at step 60), 25 and 49-50 (each stretch's end is checked).
  assert len(lost) == 3 and re.match('resuming at step 60 .* optimizer steps', lost[0])
  assert [s.split(' the loader')[0] for s in lost[1:]] == ['after 750 steps', 'after 1,500 steps']


def test_the_repetition_warning_names_steps_data_and_the_fix(files):
  ds = _ds(files)
  once = audit.plan(ds.num_instances, 8, ds.num_instances // 8)
  assert once['repetition'] == 1 and audit.repetition_warning(once, T) is None
  four = audit.plan(ds.num_instances, 8, 4 * (ds.num_instances // 8))
  assert audit.repetition_warning(four, T) is None  # exactly 4 times: not more than 4
  many = audit.plan(ds.num_instances, 8, 100_000)
  warning = audit.repetition_warning(many, T)
  assert warning.startswith('WARNING:') and '\n' not in warning
  for part in (f'{100_000 * 8 / ds.num_instances:,.0f} times', 'cfg.train.steps=100,000',
               f'{ds.num_instances:,} instances of {T} tokens', 'at most 120 (4 epochs)',
               'cfg.data.mix_file'):
    assert part in warning, part


def test_cli_a_1200_instance_mix_under_the_7b_config_is_fast_and_warns(tmp_path):
  """The README's audit line on a small mix: 1,413,814 steps of 512 over 1,200 instances.

  seq_len is lowered to 64 to keep the files small; the order does not depend on it.
  """
  rng = np.random.default_rng(11)
  mix = tmp_path / 'mix.txt'
  lines = []
  for i, n in enumerate([500, 400, 300]):  # instances per file: 1,200
    path = tmp_path / f's{i}.npy'
    rng.integers(1, 50_000, n * 64 + 5).astype('<u4').tofile(path)
    lines.append(f'src{i},{path}\n')
  mix.write_text(''.join(lines))
  start = time.time()
  run = _run('--config=configs/olmo3_7b.py', f'--config.data.mix_file={mix}',
             '--config.data.seq_len=64', '--devices=512', f'--json={tmp_path / "r.json"}')
  seconds = time.time() - start
  assert run.returncode == 0, run.stderr
  assert seconds < 60, seconds
  steps, B = 1_413_814, 512
  report = json.loads((tmp_path / 'r.json').read_text())['order']
  assert (report['steps'], report['instances'], report['batches_per_epoch']) == (steps, 1200, 2)
  assert report['epochs'] == report['complete_epochs'] == steps // 2 == 706_907
  assert report['ids_read'] == steps * B and report['repeated_ids'] == 0
  assert len(report['audited_epochs']) <= 10 and 706_907 in report['audited_epochs']
  assert len(run.stdout) < 3000  # a summary, not every epoch number
  assert f'{steps * B / 1200:,.0f} times' in run.stderr
  warnings = [line for line in run.stderr.splitlines() if line.startswith('WARNING:')]
  assert len(warnings) == 1 and 'cfg.train.steps=1,413,814' in warnings[0]
  assert '706,907 epochs' in run.stdout and 'PASS' in run.stdout and 'not read' in run.stdout


# --- The memorization warning ------------------------------------------------------------------


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


def test_skipped_windows_push_the_run_into_the_next_epoch_sooner(files, tmp_path):
  """A run with skipped global batches (train.skip_batches, and a rollback's window in
  <workdir>/rollbacks.jsonl) reads past them: 30 steps of a 30-batch epoch reach epoch 2.
  The reference: the batch indices outside the windows, counted by hand, and
  data.global_batch_ids of each (no Loader)."""
  ds = _ds(files)
  n, B, steps = 30, 8, 30
  windows = [(3, 8), (40, 42)]  # the rollback's, then train.skip_batches'
  read = [b for b in range(100) if not any(a <= b < c for a, c in windows)][:steps]
  skips = data.Skips(windows)
  report = audit.audit_order(ds, _cfg(), steps=steps, devices=2, micro_batch_size=2,
                             resume_every=4, skips=skips)
  assert report['epochs'] == 2 and report['complete_epochs'] == 1  # without skips: 1 and 1
  assert audit.plan(ds.num_instances, B, steps)['epochs'] == 1
  assert report['repeated_ids'] == 0 and not report['loader_errors'], report
  assert report['ids_audited'] == steps * B and report['skipped_batches'] == 5
  assert report['complete_epochs_audited'] == [1]  # its 25 unskipped batches, each once
  epoch2 = [b - n for b in read if b >= n]
  assert epoch2 == [0, 1, 2, 3, 4]
  ids = np.concatenate([data.global_batch_ids(ds, 7, 1 + b // n, b % n, B) for b in read])
  assert np.unique(ids[:25 * B]).size == 25 * B  # the reference reads epoch 1 once, less 5
  # The command line: --workdir adds the run's logged rollback windows to train.skip_batches.
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'rollbacks.jsonl').write_text(json.dumps({'attempt': 1, 'skip': [3, 8]}) + '\n')
  mix = tmp_path / 'mix.txt'
  mix.write_text(''.join(f'src,{p}\n' for p in files))
  run = _run('--config=configs/small.py', f'--config.data.mix_file={mix}',
             '--config.data.global_batch_size=8', f'--config.data.seq_len={T}',
             f'--config.data.vocab_size={VOCAB}', f'--config.data.eos_token_id={EOS}',
             '--config.data.pad_token_id=1', '--config.data.seed=7', '--devices=2',
             '--config.train.micro_batch_size=2', '--config.train.skip_batches=((40, 42),)',
             f'--steps={steps}', f'--workdir={workdir}', f'--json={tmp_path / "r.json"}')
  assert run.returncode == 0, run.stderr
  order = json.loads((tmp_path / 'r.json').read_text())['order']
  assert order['skips'] == [[3, 8], [40, 42]] and order['epochs'] == 2
  assert 'skips global batches [3, 8), [40, 42)' in run.stdout and 'PASS' in run.stdout


def test_held_out_documents_with_exact_copies_in_training_are_reported(files, tmp_path):
  """Two documents of the training file f0 copied into a held-out file (and one that is
  not): the copies are counted across the split, and only there."""
  toks = np.fromfile(files[0], '<u4')
  ends = np.flatnonzero(toks == EOS) + 1
  spans = [(a, b) for a, b in zip(ends[:-1], ends[1:]) if b - a >= 8]
  copied = [toks[a:b] for a, b in spans[:2]]
  rng = np.random.default_rng(9)
  fresh = np.append(rng.integers(1, VOCAB, 20), EOS)  # held out and nowhere in training
  val = tmp_path / 'validation.npy'
  np.concatenate([copied[0], fresh, copied[1]]).astype('<u4').tofile(val)
  report = audit.audit_content(_ds(files), min_doc_tokens=8, validation=_ds([str(val)]))
  assert report['validation_documents_hashed'] == 3
  assert report['validation_documents_in_training'] == 2
  examples = report['validation_copy_examples']
  assert {e['validation']['file'] for e in examples} == {str(val)}
  assert sorted((e['training']['file'], e['training']['token_offset']) for e in examples) == [
      (files[0], int(a)) for a, _ in spans[:2]]
  clean = audit.audit_content(_ds(files), min_doc_tokens=8)
  assert 'validation_documents_in_training' not in clean  # no held-out set, nothing said
  for key in ('documents_repeated_across_entries', 'documents_repeated_within_an_entry'):
    assert report[key] == clean[key]  # the held-out copies are not training repeats


def test_cli_content_audit_of_a_prepared_mix_reports_held_out_copies(tmp_path):
  """A prepare_data.py mix (every 5th document held out) whose held-out documents 4 and 9
  repeat training documents word for word: `audit_data.py --content` names the count."""
  import json as json_  # pylint: disable=import-outside-toplevel,reimport
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  prepare_data = load_script('prepare_data')
  words = np.random.default_rng(4).choice(['thou', 'art', 'king', 'love', 'night', 'speak',
                                            'shall', 'of', 'the', 'I'], (40, 60))
  docs = [f'document {i}: ' + ' '.join(w) for i, w in enumerate(words)]
  docs[4], docs[9] = docs[0], docs[30]  # held out (every 5th: 4, 9, ...), copies of training
  (tmp_path / 'in.jsonl').write_text(''.join(json_.dumps({'text': d}) + '\n' for d in docs))
  summary = prepare_data.prepare(
      [str(tmp_path / 'in.jsonl')], Tokenizer.from_file(os.path.join(REPO, 'data',
                                                                     'tokenizer.json')),
      output_dir=str(tmp_path / 'tok'), prefix='c', validation_every=5, progress=False)
  assert summary['validation_in_training'] == 2
  run = _run('--config=configs/small.py', f'--config.data.mix_file={tmp_path}/tok/c.txt',
             f'--config.data.seq_len={T}', '--config.data.global_batch_size=8',
             '--config.train.micro_batch_size=8', '--steps=2', '--content', '--min_doc_tokens=8')
  assert run.returncode == 0, run.stderr
  assert ('held-out documents (>= 8 tokens) with an exact copy in training: 2 of 8'
          in run.stdout), run.stdout
