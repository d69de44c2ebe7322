"""packed.PackedDataset against OLMo-core's NumpyPackedFSLDataset and NumpyFSLDataLoader."""

import concurrent.futures
import json
import os
import tracemalloc

import jax
import numpy as np
import pytest
from olmo_core.data import (DataCollator, InstanceFilterConfig, NumpyDataLoaderConfig,
                            NumpyFSLDataLoader, NumpyFSLDatasetConfig,
                            NumpyPackedFSLDatasetConfig, TokenizerConfig)
from olmo_core.data import numpy_dataset as olmo_numpy_dataset
from olmo_core.data.utils import InstancePacker, get_labels, iter_document_indices

from configs import olmo3_7b
import data
from test_data import olmo_resumed
from tokens import batches
from tokens import packed

VOCAB, EOS, PAD, BOS = 100278, 100257, 100277, 100256  # dolma2 ids; BOS only for the BOS cases


@pytest.fixture(autouse=True)
def _olmo_packs_in_threads(monkeypatch):
  # OLMo-core packs each group in a process pool; forking a process that runs JAX can hang.
  monkeypatch.setattr(olmo_numpy_dataset.concurrent.futures, 'ProcessPoolExecutor',
                      concurrent.futures.ThreadPoolExecutor)


def doc_lengths(rng, n, T):
  """Document lengths with many ties: longer than T, exactly T, a few repeated small values."""
  kind = rng.integers(0, 4, n)
  return np.select([kind == 0, kind == 1, kind == 2],
                   [rng.integers(T + 1, 3 * T, n), rng.choice([3, 8, T // 2], n), np.full(n, T)],
                   rng.integers(1, T + 1, n))


def write_docs(directory, docs_per_file, T, seed, bos=None):
  """Token files of whole documents (body, EOS; BOS first when given), then a tail with no EOS."""
  rng = np.random.default_rng(seed)
  os.makedirs(directory, exist_ok=True)
  paths = []
  for i, n in enumerate(docs_per_file):
    docs = []
    for length in doc_lengths(rng, n, T):
      body = rng.integers(0, 1000, length)
      body[-1] = EOS
      if bos is not None:
        body[0] = bos
        body[rng.integers(0, length, 2)[0]] = EOS  # an EOS inside a document: not a boundary
        body[-1] = EOS
      docs.append(body)
    tokens = np.concatenate(docs + [rng.integers(0, 1000, int(rng.integers(0, 9)))])
    path = os.path.join(directory, f'part-{i:02d}.npy')
    tokens.astype(np.uint32).tofile(path)
    paths.append(path)
  return paths


def data_cfg(paths, T, **kw):
  """The 7B config's cfg.data (every declared field), packed, with this file's settings."""
  cfg = olmo3_7b.get_config().data
  cfg.update({**dict(mix_file='', base_dir='', paths=tuple(paths), tokenizer_id='',
                     vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD, seq_len=T,
                     dataset='packed', seed=5, global_batch_size=8, document_masking=True,
                     source_group_size=1, long_doc_strategy='truncate'), **kw})
  return cfg


def olmo_ds(cfg, work_dir):
  """OLMo-core's own dataset for the same settings, built as Ai2's stage-3 script builds it."""
  tok = TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD,
                        bos_token_id=cfg.bos_token_id)
  ods = NumpyPackedFSLDatasetConfig(
      paths=list(cfg.paths), tokenizer=tok, sequence_length=cfg.seq_len,
      generate_doc_lengths=True, source_group_size=cfg.source_group_size,
      source_permutation_seed=cfg.source_permutation_seed, long_doc_strategy=cfg.long_doc_strategy,
      work_dir=str(work_dir)).build()
  ods.prepare()
  return ods


def olmo_loader(ods, B, T, seed, work_dir, world=1, rank=0):
  if world == 1:
    return NumpyDataLoaderConfig(global_batch_size=B * T, seed=seed, work_dir=str(work_dir),
                                 num_workers=0).build(ods)
  return NumpyFSLDataLoader.wrap_numpy_dataset(
      ods, global_batch_size=B * T, seed=seed, work_dir=work_dir, dp_world_size=world,
      dp_rank=rank, collator=DataCollator(pad_token_id=PAD, vocab_size=VOCAB))


def assert_same_batch(ours, theirs):
  """Our batch rows against OLMo-core's collated batch: tokens, labels and document lengths."""
  np.testing.assert_array_equal(ours['tokens'], theirs['input_ids'].numpy())
  np.testing.assert_array_equal(ours['labels'], get_labels(theirs).numpy())
  for seg, doc_lens in zip(ours['segment_ids'], theirs['doc_lens'].numpy()):
    np.testing.assert_array_equal(np.bincount(seg), doc_lens[doc_lens > 0])


# docs per file (several sources, a file of one document), T, source_group_size, permutation
# seed, long-document strategy, BOS
CASES = {
    'one_per_group': ([30, 1, 25, 40], 64, 1, None, 'truncate', None),
    'groups_of_3_permuted': ([30, 12, 25, 40, 8, 33, 19], 64, 3, 123, 'truncate', None),
    'fragment_pairs': ([40, 35, 20, 5], 128, 2, 7, 'fragment', None),
    'bos_groups_of_8': ([10, 14, 9, 11, 13, 8, 12, 10, 9], 32, 8, 11, 'truncate', BOS),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_instances_fingerprint_and_doc_lengths_match_olmo_core(tmp_path, case):
  docs, T, group, perm, strategy, bos = CASES[case]
  paths = write_docs(tmp_path / 'files', docs, T, seed=len(case), bos=bos)
  cfg = data_cfg(paths, T, source_group_size=group, source_permutation_seed=perm,
                 long_doc_strategy=strategy, bos_token_id=bos)
  ds = data.dataset_from_config(cfg)
  ods = olmo_ds(cfg, tmp_path / 'olmo')
  assert isinstance(ds, packed.PackedDataset)
  assert [f.path for f in ds.files] == [str(p) for p in ods.paths]  # the permuted order
  assert ds.fingerprint == ods.fingerprint
  assert ds.num_instances == len(ods)
  direct = packed.PackedDataset(paths, seq_len=T, vocab_size=VOCAB, eos_token_id=EOS,
                                pad_token_id=PAD, bos_token_id=bos, long_doc_strategy=strategy,
                                source_group_size=group, source_permutation_seed=perm)
  assert direct.fingerprint == ods.fingerprint
  tokens, real = ds.read_with_lengths(np.arange(ds.num_instances))
  np.testing.assert_array_equal(direct.read(np.arange(ds.num_instances)), tokens)
  segments = batches.segment_ids(tokens, EOS, bos)
  rejected = batches.repetition_rejected(tokens)  # the filter sees the padding, as OLMo-core's does
  ods.instance_filter_config = InstanceFilterConfig()
  for i in range(len(ods)):
    item = ods[i]
    np.testing.assert_array_equal(tokens[i], item['input_ids'].numpy())
    assert rejected[i] == (not item['instance_mask'])
    np.testing.assert_array_equal(np.arange(T) < real[i], item['label_mask'].numpy())
    np.testing.assert_array_equal(np.bincount(segments[i]), item['doc_lens'].numpy())
  assert (real < T).any() and (real == T).any()  # padded instances and full ones were compared


def test_pack_documents_matches_olmo_core_packer_with_ties(monkeypatch):
  """The packer alone, on many random length sets full of ties, both sort modes."""
  rng = np.random.default_rng(0)
  argsort = np.argsort
  for trial in range(30):
    T = int(2 ** rng.integers(3, 11))
    n = int(rng.integers(1, 3000))
    lengths = np.minimum(doc_lengths(rng, n, T), T) if trial % 2 else rng.integers(1, T + 1, n)
    ends = np.cumsum(lengths)
    indices = np.stack([ends - lengths, ends], axis=1).astype(np.uint64)
    for stable in (False, True):
      kind = 'stable' if stable else None
      monkeypatch.setattr(np, 'argsort', lambda a, *args, kind=kind, **kw: argsort(a, kind=kind))
      instances, sorted_indices, total = InstancePacker(T).pack_documents(indices)
      monkeypatch.setattr(np, 'argsort', argsort)
      docs, offsets = packed.pack_documents(lengths, T, stable=stable)
      # OLMo-core's instances list positions in its length-sorted table; ours original ids.
      theirs = [sorted_indices[inst, 0].tolist() for inst in instances]
      ours = [(ends - lengths)[docs[a:b]].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
      assert ours == theirs, (trial, stable)
      assert total == lengths.sum()


def test_stable_packing_is_olmo_core_with_a_stable_sort(tmp_path, monkeypatch):
  T = 64
  paths = write_docs(tmp_path / 'files', [200, 150], T, seed=3)
  cfg = data_cfg(paths, T, source_group_size=2, stable_packing=True)
  stable = data.dataset_from_config(cfg)
  default = data.dataset_from_config(data_cfg(paths, T, source_group_size=2))
  assert default.fingerprint == stable.fingerprint  # OLMo-core's fingerprint ignores the sort
  argsort = np.argsort
  monkeypatch.setattr(np, 'argsort', lambda a, *args, **kw: argsort(a, kind='stable'))
  ods = olmo_ds(cfg, tmp_path / 'olmo')  # OLMo-core as it packs on a machine that sorts stably
  monkeypatch.setattr(np, 'argsort', argsort)
  ours = stable.read(np.arange(stable.num_instances))
  np.testing.assert_array_equal(ours, np.stack([ods[i]['input_ids'].numpy()
                                                for i in range(len(ods))]))
  # Ties are many here; on a CPU whose default sort reorders them (AVX-512 here), the
  # packings differ, with the same instance count and the same multiset of tokens.
  other = default.read(np.arange(default.num_instances))
  assert other.shape == ours.shape
  np.testing.assert_array_equal(np.sort(other.ravel()), np.sort(ours.ravel()))


@pytest.mark.parametrize('seed', [34521, 9])
def test_loader_order_ranks_and_resume_match_olmo_core(tmp_path, seed):
  T, B, k = 64, 8, 3
  paths = write_docs(tmp_path / 'files', [30, 12, 25, 40, 8, 33], T, seed=seed)
  cfg = data_cfg(paths, T, source_group_size=2, source_permutation_seed=123, seed=seed,
                 global_batch_size=B)
  ds = data.dataset_from_config(cfg, cache_dir=str(tmp_path / 'pack'))
  ods = olmo_ds(cfg, tmp_path / 'olmo')
  n = data.batches_per_epoch(ds, B)
  cache = str(tmp_path / 'order')
  for world in (1, 2, 4):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:world]), ('data',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', None))
    with data.Loader.from_config(cfg, ds, cache_dir=cache, sharding=sharding) as loader:
      ours = [{key: np.asarray(v) for key, v in next(loader).items()} for _ in range(n + 1)]
    for rank in range(world):
      dl = olmo_loader(ods, B, T, seed, tmp_path / 'olmo', world, rank)
      for epoch, ours_epoch in ((1, ours[:n]), (2, ours[n:])):
        dl.reshuffle(epoch=epoch)
        theirs = list(dl)
        dl.reset()
        assert len(theirs) == n if epoch == 1 else len(theirs) >= 1
        for step, (batch, their) in enumerate(zip(ours_epoch, theirs)):
          rows = slice(rank * B // world, (rank + 1) * B // world)  # device shard `rank`
          assert_same_batch({key: v[rows] for key, v in batch.items()}, their)
          ids = data.global_batch_ids(ds, seed, epoch, step, B, cache)
          np.testing.assert_array_equal(ids[batches.batch_positions(B, world)][rows],
                                        their['index'].numpy())
  # Stateless resume after k batches equals OLMo-core resumed from its own state.
  with data.Loader.from_config(cfg, ds, cache_dir=cache) as loader:
    for _ in range(k):
      next(loader)
    state = json.loads(json.dumps(loader.state()))
  again = data.dataset_from_config(cfg, cache_dir=str(tmp_path / 'pack'))  # from the cache
  with data.Loader.from_config(cfg, again, state=state, step=k, cache_dir=cache) as loader:
    resumed = [next(loader) for _ in range(n - k)]
  dl2, olmo_state = olmo_resumed(lambda: olmo_loader(ods, B, T, seed, tmp_path / 'olmo'), k)
  theirs = list(dl2)
  assert len(theirs) == len(resumed) == n - k
  for batch, their in zip(resumed, theirs):
    assert_same_batch(batch, their)
  assert state['fingerprint'] == olmo_state['dataset_fingerprint']


def test_resume_refuses_other_packing_or_files(tmp_path):
  paths = write_docs(tmp_path / 'files', [30, 20], 32, seed=1)
  cfg = data_cfg(paths, 32, global_batch_size=4)
  ds = data.dataset_from_config(cfg)
  state = data.Loader.from_config(cfg, ds).state()
  with pytest.raises(ValueError, match='stable_packing False -> True'):
    data.Loader.from_config(cfg, data.dataset_from_config(data_cfg(paths, 32, stable_packing=True,
                                                                   global_batch_size=4)),
                            state=state)
  with pytest.raises(ValueError, match='source_group_size None -> 2|differs from the checkpoint'):
    data.Loader.from_config(cfg, data.dataset_from_config(data_cfg(paths, 32, source_group_size=2,
                                                                   global_batch_size=4)),
                            state=state)
  fsl = data.Dataset(paths, seq_len=32, vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD)
  with pytest.raises(ValueError, match='differs from the checkpoint'):
    data.check_same_data(state, fsl)


def test_packing_cache_is_reused_verified_and_never_stale(tmp_path, caplog):
  T = 64
  paths = write_docs(tmp_path / 'files', [30, 25, 20], T, seed=2)
  cfg = data_cfg(paths, T, source_group_size=2)
  cache = tmp_path / 'pack'
  first = data.dataset_from_config(cfg, cache_dir=str(cache))
  want = first.read(np.arange(first.num_instances))
  files = sorted(p for p in os.listdir(cache) if p.endswith('.bin'))
  assert len(files) == 2 and len(os.listdir(cache)) == 4  # a packing and its checksum per group
  stamps = {p: os.stat(cache / p).st_mtime_ns for p in files}
  again = data.dataset_from_config(cfg, cache_dir=str(cache))
  assert {p: os.stat(cache / p).st_mtime_ns for p in files} == stamps  # reused
  np.testing.assert_array_equal(again.read(np.arange(again.num_instances)), want)
  # A damaged cache is packed again, with a warning, and repaired.
  raw = np.fromfile(cache / files[0], np.int64)
  raw[-1] += 1
  raw.tofile(cache / files[0])
  with caplog.at_level('WARNING'):
    repaired = data.dataset_from_config(cfg, cache_dir=str(cache))
  assert 'fail the checksum' in caplog.text
  np.testing.assert_array_equal(repaired.read(np.arange(repaired.num_instances)), want)
  # A file rewritten with other documents of the same size is packed anew, never from the cache.
  tokens = np.fromfile(paths[0], np.uint32)
  tokens[:] = np.roll(tokens, 7)
  tokens.tofile(paths[0])
  os.utime(paths[0], ns=(1, 1))
  changed = data.dataset_from_config(cfg, cache_dir=str(cache))
  fresh = data.dataset_from_config(cfg)  # no cache at all
  np.testing.assert_array_equal(changed.read(np.arange(changed.num_instances)),
                                fresh.read(np.arange(fresh.num_instances)))


def test_document_ends_in_chunks_match_olmo_core(tmp_path):
  rng = np.random.default_rng(4)
  for bos in (None, BOS):
    tokens = rng.choice(np.array([1, 2, EOS, BOS], np.uint32), 997, p=[0.4, 0.3, 0.2, 0.1])
    tokens[-1] = EOS
    path = tmp_path / f'ends{bos}.npy'
    tokens.tofile(path)
    theirs = [end for _, end in iter_document_indices(path, eos_token_id=EOS, bos_token_id=bos,
                                                      dtype=np.uint32)]
    for chunk in (1, 2, 7, 64, 1 << 20):  # documents and EOS-BOS pairs across chunk edges
      np.testing.assert_array_equal(packed.document_ends(tokens, EOS, bos, chunk=chunk), theirs)


def test_packing_memory_is_bounded_by_the_chunk_not_the_file(tmp_path, monkeypatch):
  n, docs = 1 << 22, 64  # a 16 MiB file of 64 documents
  tokens = np.random.default_rng(8).integers(0, 1000, n).astype(np.uint32)
  tokens[np.linspace(n // docs, n, docs).astype(np.int64) - 1] = EOS
  path = tmp_path / 'big.npy'
  tokens.tofile(path)
  del tokens
  monkeypatch.setattr(packed.document_ends, '__defaults__', (None, 1 << 16))
  tracemalloc.start()  # numpy reports its buffers to tracemalloc
  try:
    ds = packed.PackedDataset([str(path)], seq_len=1 << 20, vocab_size=VOCAB,
                              eos_token_id=EOS, pad_token_id=PAD)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert ds.num_instances == 4 and ds.packings[0].length.sum() == n
  assert peak < 2 << 20, peak  # < 2 MiB of arrays for a 16 MiB file: one chunk at a time


def test_source_permutation_matches_olmo_core_for_the_fsl_dataset_too(tmp_path):
  paths = write_docs(tmp_path, [5, 9, 7, 3, 8], 16, seed=5)
  cfg = data_cfg(paths, 16, dataset='fsl', source_permutation_seed=123)
  ds = data.dataset_from_config(cfg)
  ods = NumpyFSLDatasetConfig(paths=list(paths), sequence_length=16, source_permutation_seed=123,
                              max_target_sequence_length=16,
                              tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS,
                                                        pad_token_id=PAD)).build()
  assert [f.path for f in ds.files] == list(ods.paths) != list(paths)
  assert ds.fingerprint == ods.fingerprint
  # Held-out sets passed as paths keep their order.
  assert [f.path for f in data.Dataset.from_config(cfg, paths=paths).files] == paths


def test_stage1_config_keeps_the_fsl_dataset():
  cfg = olmo3_7b.get_config()
  assert cfg.data.dataset == 'fsl' and not data.wants_segments(cfg.data)
  assert cfg.data.source_permutation_seed is None and cfg.data.source_group_size == 1


def test_bad_packed_settings_and_files_are_refused(tmp_path):
  paths = write_docs(tmp_path, [4, 4], 16, seed=6)
  with pytest.raises(ValueError, match="cfg.data.dataset='vsl' is not 'fsl'"):
    data.dataset_from_config(data_cfg(paths, 16, dataset='vsl'))
  with pytest.raises(ValueError, match="long_doc_strategy 'split' is not one of"):
    data.dataset_from_config(data_cfg(paths, 16, long_doc_strategy='split'))
  with pytest.raises(ValueError, match='source_group_size must be an integer >= 1'):
    data.dataset_from_config(data_cfg(paths, 16, source_group_size=0))
  no_eos = tmp_path / 'no_eos.npy'
  np.arange(100, dtype=np.uint32).tofile(no_eos)
  with pytest.raises(ValueError, match=r'holds no document: no file has an EOS \(id 100257\)'):
    data.dataset_from_config(data_cfg([str(no_eos)], 16))
  with pytest.raises(FileNotFoundError, match='missing.npy: token file does not exist'):
    data.dataset_from_config(data_cfg(paths + [str(tmp_path / 'missing.npy')], 16))
  with pytest.raises(ValueError, match='cfg.data.paths is empty|No training data configured'):
    data.dataset_from_config(data_cfg([], 16))
  bad = tmp_path / 'bad.npy'
  np.array([5, 6, VOCAB + 3, EOS], np.uint32).tofile(bad)
  ds = data.dataset_from_config(data_cfg([str(bad)], 16, vocab_size=VOCAB + 10))
  ds.vocab_size = VOCAB
  with pytest.raises(ValueError, match=f'{bad}: token id {VOCAB + 3} at token offset 2'):
    ds.read([0])


def write_eosless(path, n=300, seed=0):
  """A token file with no EOS at all (as with a wrong eos_token_id): n random ids < 1000."""
  np.random.default_rng(seed).integers(0, 1000, n).astype(np.uint32).tofile(path)
  return str(path)


# (documents per file, source_group_size, where the EOS-less file goes): alone in its group;
# after a file of one document in a group of 2 (which packed a phantom second instance from
# the EOS-less file's first tokens); in the middle of a group of 3.
EOSLESS_LAYOUTS = {'alone': ([20, 15, 10], 1, 1), 'after_one_document': ([1], 2, 1),
                   'mid_group': ([20, 15, 10], 3, 1)}


@pytest.mark.parametrize('strategy', packed.LONG_DOC_STRATEGIES)
@pytest.mark.parametrize('layout', sorted(EOSLESS_LAYOUTS))
def test_a_file_without_eos_adds_no_document_as_in_olmo_core(tmp_path, caplog, strategy, layout):
  docs, group, at = EOSLESS_LAYOUTS[layout]
  T = 64
  paths = write_docs(tmp_path / 'files', docs, T, seed=3)
  no_eos = write_eosless(tmp_path / 'files' / 'no_eos.npy')
  paths.insert(at, no_eos)
  cfg = data_cfg(paths, T, source_group_size=group, long_doc_strategy=strategy)
  ods = olmo_ds(cfg, tmp_path / 'olmo')
  for attempt in ('packed', 'from the cache'):
    caplog.clear()
    with caplog.at_level('WARNING'):
      ds = data.dataset_from_config(cfg, cache_dir=str(tmp_path / 'pack'))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
    assert warnings == [f'{no_eos}: its 300 tokens hold no EOS (id {EOS}), so they form no '
                        'document and are never trained on (as in OLMo-core). Check '
                        'cfg.data.eos_token_id, or the file.'], attempt
    assert ds.num_instances == len(ods), attempt
    tokens, real = ds.read_with_lengths(np.arange(ds.num_instances))
    segments = batches.segment_ids(tokens, EOS)
    for i in range(len(ods)):
      item = ods[i]
      np.testing.assert_array_equal(tokens[i], item['input_ids'].numpy())
      np.testing.assert_array_equal(np.arange(T) < real[i], item['label_mask'].numpy())
      np.testing.assert_array_equal(np.bincount(segments[i]), item['doc_lens'].numpy())


@pytest.mark.parametrize('strategy', packed.LONG_DOC_STRATEGIES)
def test_no_file_with_an_eos_is_one_error_naming_the_eos_id(tmp_path, caplog, strategy):
  paths = [write_eosless(tmp_path / f'no_eos{i}.npy', seed=i) for i in range(3)]
  with caplog.at_level('WARNING'), pytest.raises(
      ValueError, match=r'cfg.data.paths holds no document: no file has an EOS \(id 100257\), so '
                        r'nothing can be packed. Check cfg.data.eos_token_id \(the tokenizer'):
    data.dataset_from_config(data_cfg(paths, 64, source_group_size=2, long_doc_strategy=strategy))
  assert not [r for r in caplog.records if r.levelname == 'WARNING']  # the error alone
