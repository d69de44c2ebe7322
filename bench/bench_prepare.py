"""Tokenization throughput of scripts/prepare_data.py against the tokenizers library.

  python bench/bench_prepare.py [--input='corpus/*.jsonl'] [--workers=1,2] [--tokenizer=PATH]

The peer, measured in the same run on the same documents: the HF `tokenizers`
library's encode_batch on one core (TOKENIZERS_PARALLELISM=false), the
tokenize-only floor of a single-process pipeline. prepare_data.py then runs
end to end (read, parse JSON, tokenize, write uint32 files) with each worker
count; it prints MB/s and tokens/s, the ratio to the peer, and the scaling
against one worker, and checks that every run wrote the same bytes. Without
--input it builds a JSONL corpus from the embedded Shakespeare tokens
(--corpus_mb of text). Timings need a quiet machine.
"""

import glob
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np
from tokenizers import Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = flags.FLAGS


def _prepare_module():
  spec = importlib.util.spec_from_file_location('prepare_data',
                                                os.path.join(REPO, 'scripts', 'prepare_data.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def make_corpus(directory: str, megabytes: float) -> list[str]:
  """JSONL documents of embedded Shakespeare text, ~`megabytes` of it in 4 files."""
  tok = Tokenizer.from_file(os.path.join(REPO, 'data', 'tokenizer.json'))
  ids = np.fromfile(os.path.join(REPO, 'data', 'shakespeare-train-00000.npy'), '<u4')
  text = tok.decode(ids[:400_000].tolist())
  lines = [l for l in text.split('\n') if l.strip()]
  rng = np.random.default_rng(0)
  paths, written, target = [], 0, int(megabytes * 2**20)
  for i in range(4):
    path = os.path.join(directory, f'corpus-{i}.jsonl')
    with open(path, 'w') as f:
      while written < (i + 1) * target // 4:
        start = int(rng.integers(0, len(lines) - 60))
        doc = '\n'.join(lines[start:start + int(rng.integers(5, 60))])
        written += f.write(json.dumps({'text': doc}) + '\n')
    paths.append(path)
  return paths


def main(argv):
  del argv
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'  # the peer on one core
  prepare_data = _prepare_module()
  tokenizer = prepare_data.load_tokenizer(FLAGS.tokenizer)
  with tempfile.TemporaryDirectory() as work:
    files = (sorted(f for p in FLAGS.input for f in glob.glob(p)) if FLAGS.input
             else make_corpus(work, FLAGS.corpus_mb))
    if not files:
      sys.exit(f'error: --input {FLAGS.input} matches no files.')
    in_bytes = sum(os.path.getsize(f) for f in files)
    docs = [doc for doc, _ in prepare_data.iter_documents(files)]
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) + 1 for i in range(0, len(docs), 256)
                 for e in tokenizer.encode_batch(docs[i:i + 256], add_special_tokens=False))
    peer = time.perf_counter() - t0
    print(f'{len(files)} files, {in_bytes / 2**20:.1f} MiB, {len(docs):,} documents, '
          f'{tokens:,} tokens; {os.cpu_count()} cores')
    print(f'tokenizers encode_batch, 1 core (tokenize only): {in_bytes / peer / 2**20:7.2f} MiB/s '
          f'{tokens / peer / 1e6:6.2f} M tokens/s')
    digests, base = set(), None
    for workers in [int(w) for w in FLAGS.workers]:
      out = os.path.join(work, f'out{workers}')
      t0 = time.perf_counter()
      summary = prepare_data.prepare(files, tokenizer, output_dir=out, prefix='bench',
                                     workers=workers, progress=False)
      seconds = time.perf_counter() - t0
      base = base or seconds
      h = hashlib.sha256()
      for name in summary['files']:
        with open(os.path.join(out, name), 'rb') as f:
          h.update(f.read())
      digests.add(h.hexdigest())
      print(f'prepare_data.py --workers={workers} (end to end): {in_bytes / seconds / 2**20:7.2f} '
            f'MiB/s {summary["tokens"] / seconds / 1e6:6.2f} M tokens/s  = {peer / seconds:.2f}x '
            f'the 1-core peer, {base / seconds:.2f}x 1 worker')
    print('outputs identical across worker counts: ' + ('yes' if len(digests) == 1 else 'NO'))
    return 0 if len(digests) == 1 else 1


if __name__ == '__main__':
  flags.DEFINE_multi_string('input', [], 'Glob(s) of JSONL/text files (default: a built corpus).')
  flags.DEFINE_list('workers', ['1', '2'], 'Worker counts to time.')
  flags.DEFINE_float('corpus_mb', 64.0, 'Size of the built corpus without --input, MiB.')
  flags.DEFINE_string('tokenizer', '', "tokenizer.json; '' -> dolma2 (as prepare_data.py).")
  flags.register_validator('workers', lambda v: all(str(x).isdigit() and int(x) > 0 for x in v),
                           '--workers takes positive integers.')
  app.run(main)
