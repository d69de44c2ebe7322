"""Files and directories the converters share (formats/hf_ckpt.py, formats/olmo_core_ckpt.py).

A converted checkpoint is built in a staging directory beside its destination
and moved in whole (`install`): a crash leaves the old checkpoint or the new,
never a mix. Both converters refuse a destination that already holds one
unless asked to replace it (`check_destination`), and read and write the JSON
files around the weights here. `layer_pattern` turns per-layer attention types
(HF layer_types, OLMo-core's window pattern) into model.py's scan group, and
`per_layer_shapes` gives model.param_shapes one layer at a time, as both
formats store the layers.
"""

import ctypes
import errno
import json
import logging
import os
import re
import secrets
import shutil

import checkpoint
import model
from store import step_dirs
from store import storage

# What a checkpoint directory may hold (checkpoint.py and train.py names); --overwrite
# replaces the whole directory, so anything else in it is refused rather than deleted.
CHECKPOINT_ENTRY = re.compile(r'^(step_\d+|tmp\.step_.+|corrupt\.step_.+)$')
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


class ConversionError(ValueError):
  """A source the converters cannot convert: config and weights that are not one Olmo 3,
  or files that are damaged or incomplete. The message names the file and the fix."""


def layer_pattern(layer_types: list[str]) -> str:
  """Shortest period of the layer types as an 'S'/'F' string (the scan group)."""
  codes = {'sliding_attention': 'S', 'full_attention': 'F'}
  unknown = set(layer_types) - set(codes)
  if unknown:
    raise ConversionError(f'unknown layer_types {sorted(unknown)}')
  s = ''.join(codes[t] for t in layer_types)
  for period in range(1, len(s) + 1):
    if len(s) % period == 0 and s[:period] * (len(s) // period) == s:
      return s[:period]
  raise AssertionError('unreachable: the whole string is a period')


def per_layer_shapes(cfg) -> dict[tuple[str, str], tuple[int, ...]]:
  """model.param_shapes by (module, name), without the leading L of the layer arrays."""
  return {(module, name): shape[1:] if module in model.LAYER_MODULES else shape
          for module, names in model.param_shapes(cfg).items() for name, shape in names.items()}


# --- JSON and plain files ----------------------------------------------------------------


def read_json(path: str, error: type[Exception] = ConversionError,
              fix: str = 'restore the original file') -> dict:
  """A JSON file's content; malformed JSON raises `error` naming the file and the fix."""
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise error(f'{path} is not valid JSON ({e}); {fix}.') from e


def write_json(path: str, content: dict) -> None:
  with open(path, 'w') as f:
    json.dump(content, f, indent=2)
    f.write('\n')


def copy_files(source: str, names: list[str], destination: str) -> None:
  """Copies `names` from `source` into `destination` (created if needed; either may be a
  bucket)."""
  storage.makedirs(destination)
  for name in names:
    try:
      storage.copy_file(storage.join(source, name), storage.join(destination, name))
    except FileNotFoundError:
      raise FileNotFoundError(f'{source}/{name} is gone: it was listed when the checkpoint was '
                              'made. Restore it, or pass --tokenizer=PATH.') from None


# --- Destination checkpoint directories ----------------------------------------------------


def check_destination(directory: str, overwrite: bool) -> None:
  """Refuses a --to that holds a checkpoint (unless overwrite) or that overwrite would harm."""
  if storage.isfile(directory):
    raise FileExistsError(f'{directory} is a file, not a checkpoint directory; choose another '
                          '--to.')
  steps = checkpoint.committed_steps(directory)
  if steps and not overwrite:
    raise FileExistsError(f'{directory} already holds a checkpoint (steps {steps}); converting '
                          'into it would leave that one in place. Pass --overwrite to replace it '
                          '(it is kept until the new one is complete), or choose another --to.')
  foreign = steps and [n for n in storage.listdir(directory) if not CHECKPOINT_ENTRY.match(n)]
  if foreign:
    raise FileExistsError(f'{directory} holds {foreign[:5]} besides its checkpoints, and '
                          '--overwrite replaces the whole directory; move them out, or choose '
                          'another --to.')


def staging_dir(directory: str) -> str:
  """A fresh sibling of `directory` to build its replacement in (same filesystem: renames)."""
  directory = storage.absolute(directory)
  return storage.join(storage.parent(directory),
                      f'.{storage.basename(directory)}.convert-{secrets.token_hex(4)}')


def install(staging: str, directory: str, step: int = 0) -> None:
  """Moves the checkpoint built in `staging` to `directory`; `staging` then holds the old one.

  In a bucket (no rename) the old steps are deleted, COMMIT first, and the new step is
  copied in with its COMMIT last; the staging prefix is removed by the caller.
  """
  if not storage.renames(directory):  # no directory exchange: step by step, COMMIT last
    for old in checkpoint.committed_steps(directory):
      step_dirs.delete_step(directory, old)
    step_dirs.discard(step_dirs.step_dir(directory, step))  # a copy cut short before
    storage.rename_tree(step_dirs.step_dir(staging, step), step_dirs.step_dir(directory, step),
                        last=(step_dirs.COMMIT,))
    return
  if not checkpoint.committed_steps(directory):  # nothing to replace: move step_<step> in
    os.makedirs(directory, exist_ok=True)
    leftover = os.path.join(directory, f'step_{step}')
    if os.path.isdir(leftover):  # a save that never committed
      shutil.rmtree(leftover)
    os.rename(os.path.join(staging, f'step_{step}'), leftover)
    return
  if exchange(staging, directory):
    return
  logging.warning('%s cannot exchange directories atomically; replacing %s by two renames.',
                  os.path.dirname(directory), directory)
  aside = staging + '.old'
  os.rename(directory, aside)
  try:
    os.rename(staging, directory)
  except BaseException:
    os.rename(aside, directory)
    raise
  os.rename(aside, staging)


def exchange(a: str, b: str) -> bool:
  """Swaps two directories atomically (Linux renameat2); False where the OS or filesystem can't."""
  renameat2 = getattr(ctypes.CDLL(None, use_errno=True), 'renameat2', None)
  if renameat2 is None:
    return False
  if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  code = ctypes.get_errno()
  if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
    return False
  raise OSError(code, os.strerror(code), b)
