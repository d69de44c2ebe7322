"""Text or JSONL documents -> uint32 token files that data.py (and OLMo-core) read.

Each document is tokenized with a HuggingFace tokenizer.json and followed by
EOS (the dolma convention: EOS between documents, none at the start). Tokens
are written as raw little-endian uint32 in files of at most --max_shard_mb,
named {prefix}-00000.npy, ..., plus a mix file {prefix}.txt of
`label,file,bytes` lines for cfg.data.mix_file (base_dir = --output_dir).

  python scripts/prepare_data.py --tokenizer=dolma2.json \
      --input='corpus/*.jsonl' --output_dir=/data/tokens --prefix=corpus

With --train_vocab_size=N a byte-level BPE with EOS and PAD special tokens is
first trained on the same inputs and saved to --tokenizer.
A text file is one document; a JSONL line is one document (its --text_field).
"""

import glob
import json
import os
import sys
import time
from typing import Iterator

from absl import app
from absl import flags
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

_INPUT = flags.DEFINE_multi_string('input', None, 'Glob(s) of text or .jsonl files.')
_EXCLUDE = flags.DEFINE_multi_string('exclude', [], 'Glob(s) of files to leave out.')
_FORMAT = flags.DEFINE_enum('format', 'auto', ['auto', 'text', 'jsonl'],
                            'auto: .jsonl/.json files are JSONL, anything else is text.')
_TEXT_FIELD = flags.DEFINE_string('text_field', 'text', 'JSONL field holding the document.')
_TOKENIZER = flags.DEFINE_string('tokenizer', None, 'HuggingFace tokenizer.json path.')
_TRAIN_VOCAB = flags.DEFINE_integer(
    'train_vocab_size', 0, 'If > 0, first train a byte-level BPE of this size on the inputs.')
_EOS = flags.DEFINE_string('eos_token', '<|endoftext|>', 'EOS token (dolma2: id 100257).')
_PAD = flags.DEFINE_string('pad_token', '<|pad|>', 'PAD token added when training a tokenizer.')
_VOCAB = flags.DEFINE_integer(
    'vocab_size', 0, 'Token ids must be below this (cfg.data.vocab_size); 0: the tokenizer size.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None, 'Where the token files go.')
_PREFIX = flags.DEFINE_string('prefix', 'tokens', 'File name prefix (and the mix label).')
_MAX_SHARD_MB = flags.DEFINE_float('max_shard_mb', 1024.0, 'Upper bound on each token file, MiB.')
_BATCH_DOCS = flags.DEFINE_integer('batch_docs', 256, 'Documents per tokenizer call.')


def list_inputs(patterns: list[str], exclude: list[str]) -> list[str]:
  """Sorted files matching `patterns` and not `exclude` (an empty match is an error)."""
  files = []
  for pattern in patterns:
    matches = sorted(glob.glob(pattern))
    if not matches:
      raise FileNotFoundError(f'--input {pattern!r} matches no files.')
    files += matches
  excluded = {os.path.abspath(m) for pattern in exclude for m in glob.glob(pattern)}
  files = [f for f in dict.fromkeys(files) if os.path.abspath(f) not in excluded]
  if not files:
    raise ValueError('every --input file is excluded by --exclude; nothing to tokenize.')
  return files


def iter_documents(files: list[str], fmt: str = 'auto',
                   text_field: str = 'text') -> Iterator[tuple[str, int]]:
  """Yields (document, input bytes it came from): a text file, or a JSONL line's field."""
  for path in files:
    is_jsonl = fmt == 'jsonl' or (fmt == 'auto' and path.endswith(('.jsonl', '.json')))
    with open(path, 'rt', encoding='utf-8') as f:
      if not is_jsonl:
        yield f.read(), os.path.getsize(path)
      else:
        for line_no, line in enumerate(f, 1):
          if not line.strip():
            continue
          try:
            record = json.loads(line)
          except json.JSONDecodeError as e:
            raise ValueError(f'{path}:{line_no}: not valid JSON ({e}).') from e
          if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ValueError(f'{path}:{line_no}: no string field {text_field!r} '
                             '(set --text_field).')
          yield record[text_field], len(line.encode('utf-8'))


class Progress:
  """A one-line progress bar on stderr, by input bytes."""

  def __init__(self, total: int, what: str):
    self.total, self.what, self.done, self.start = max(total, 1), what, 0, time.time()
    self.shown = 0.0

  def advance(self, n: int) -> None:
    self.done += n
    if time.time() - self.shown >= 0.5:
      self._show()

  def finish(self) -> None:
    self.done = self.total
    self._show()
    sys.stderr.write('\n')

  def _show(self) -> None:
    self.shown = time.time()
    frac = min(self.done / self.total, 1.0)
    rate = self.done / max(time.time() - self.start, 1e-9) / 2**20
    bar = '#' * int(30 * frac) + '.' * (30 - int(30 * frac))
    sys.stderr.write(f'\r{self.what} [{bar}] {100 * frac:5.1f}% {rate:6.1f} MiB/s')
    sys.stderr.flush()


def train_tokenizer(files: list[str], path: str, vocab_size: int, eos: str, pad: str,
                    fmt: str = 'auto', text_field: str = 'text') -> Tokenizer:
  """Trains a byte-level BPE (GPT-2 pre-tokenizer) with EOS and PAD and saves it."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos, pad],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tok.train_from_iterator((doc for doc, _ in iter_documents(files, fmt, text_field)), trainer)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tok.save(path)
  return tok


class ShardWriter:
  """Appends uint32 tokens to {prefix}-NNNNN.npy files of at most max_bytes each."""

  def __init__(self, output_dir: str, prefix: str, max_bytes: int):
    if max_bytes < 4:
      raise ValueError(f'--max_shard_mb gives {max_bytes} bytes per file; need at least 4.')
    self.output_dir, self.prefix = output_dir, prefix
    self.max_tokens = max_bytes // 4
    self.files: list[tuple[str, int]] = []  # (file name, bytes)
    self._f = None
    self._in_file = 0
    os.makedirs(output_dir, exist_ok=True)

  def write(self, tokens: np.ndarray) -> None:
    tokens = np.ascontiguousarray(tokens, dtype='<u4')
    while tokens.size:
      if self._f is None:
        name = f'{self.prefix}-{len(self.files):05d}.npy'
        self._f = open(os.path.join(self.output_dir, name), 'wb')
        self.files.append((name, 0))
        self._in_file = 0
      take = min(tokens.size, self.max_tokens - self._in_file)
      self._f.write(tokens[:take].tobytes())
      self._in_file += take
      self.files[-1] = (self.files[-1][0], 4 * self._in_file)
      tokens = tokens[take:]
      if self._in_file == self.max_tokens:
        self._f.close()
        self._f = None

  def close(self) -> None:
    if self._f is not None:
      self._f.close()
      self._f = None


def prepare(files: list[str], tokenizer: Tokenizer, *, output_dir: str, prefix: str,
            eos_token: str = '<|endoftext|>', vocab_size: int = 0, max_shard_bytes: int = 2**30,
            fmt: str = 'auto', text_field: str = 'text', batch_docs: int = 256) -> dict:
  """Tokenizes `files` into token files; returns a summary (and writes {prefix}.txt)."""
  eos_id = tokenizer.token_to_id(eos_token)
  if eos_id is None:
    raise ValueError(f'EOS token {eos_token!r} is not in the tokenizer; set --eos_token.')
  vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
  if eos_id >= vocab_size:
    raise ValueError(f'EOS id {eos_id} is >= --vocab_size {vocab_size}.')
  writer = ShardWriter(output_dir, prefix, max_shard_bytes)
  progress = Progress(sum(os.path.getsize(f) for f in files), f'tokenizing {prefix}')
  num_docs = num_tokens = 0

  def flush(docs: list[tuple[str, int]]) -> None:
    nonlocal num_docs, num_tokens
    encodings = tokenizer.encode_batch([doc for doc, _ in docs], add_special_tokens=False)
    for enc, (_, num_bytes) in zip(encodings, docs):
      ids = np.array(enc.ids + [eos_id], np.int64)
      if ids.max() >= vocab_size:
        raise ValueError(f'document {num_docs}: token id {ids.max()} is >= vocab_size '
                         f'{vocab_size}; the tokenizer does not match cfg.data.vocab_size.')
      writer.write(ids)
      num_docs += 1
      num_tokens += ids.size
      progress.advance(num_bytes)

  docs: list[tuple[str, int]] = []
  try:
    for doc in iter_documents(files, fmt, text_field):
      docs.append(doc)
      if len(docs) == batch_docs:
        flush(docs)
        docs = []
    if docs:
      flush(docs)
    progress.finish()
  finally:
    writer.close()
  with open(os.path.join(output_dir, f'{prefix}.txt'), 'w') as f:
    f.write(f'# {num_docs} documents, {num_tokens} tokens, EOS id {eos_id}; written by '
            'scripts/prepare_data.py\n')
    for name, size in writer.files:
      f.write(f'{prefix},{name},{size}\n')
  return {'documents': num_docs, 'tokens': num_tokens, 'eos_id': eos_id,
          'files': [name for name, _ in writer.files]}


def main(argv):
  del argv
  if not _INPUT.value or not _TOKENIZER.value or not _OUTPUT_DIR.value:
    raise app.UsageError('--input, --tokenizer and --output_dir are required.')
  files = list_inputs(_INPUT.value, _EXCLUDE.value)
  if _TRAIN_VOCAB.value > 0:
    tokenizer = train_tokenizer(files, _TOKENIZER.value, _TRAIN_VOCAB.value, _EOS.value, _PAD.value,
                                _FORMAT.value, _TEXT_FIELD.value)
    print(f'trained a {tokenizer.get_vocab_size()}-token BPE on {len(files)} files -> '
          f'{_TOKENIZER.value}')
  elif not os.path.isfile(_TOKENIZER.value):
    raise FileNotFoundError(f'--tokenizer {_TOKENIZER.value!r} does not exist (a HuggingFace '
                            'tokenizer.json; or pass --train_vocab_size to train one).')
  else:
    tokenizer = Tokenizer.from_file(_TOKENIZER.value)
  summary = prepare(files, tokenizer, output_dir=_OUTPUT_DIR.value, prefix=_PREFIX.value,
                    eos_token=_EOS.value, vocab_size=_VOCAB.value,
                    max_shard_bytes=int(_MAX_SHARD_MB.value * 2**20), fmt=_FORMAT.value,
                    text_field=_TEXT_FIELD.value, batch_docs=_BATCH_DOCS.value)
  print(f'{summary["documents"]} documents, {summary["tokens"]} tokens '
        f'(EOS id {summary["eos_id"]}) -> {len(summary["files"])} files in {_OUTPUT_DIR.value}, '
        f'mix {_PREFIX.value}.txt')


if __name__ == '__main__':
  app.run(main)
