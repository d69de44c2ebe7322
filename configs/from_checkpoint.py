"""The run config a checkpoint stores, as train.py's --config: `configs/from_checkpoint.py:PATH`.

PATH is a train.py workdir (its checkpoints/) or a checkpoint directory
(step_N/); the config is the newest committed step's, as saved in its
checksummed metadata. It is how a checkpoint that convert.py translated
from OLMo-core (no --config) is continued:

    python convert.py --from_olmo_core=STEP_DIR_OR_URL --to=W
    python train.py --workdir=W --config=configs/from_checkpoint.py:W [--config.X=Y ...]

The stored values go onto configs/olmo3_7b.py's fields, so every field keeps
its type (a placeholder stays overridable from the command line, a tuple a
tuple) and a field the checkpoint predates keeps the 7B default.
"""


import ml_collections

import checkpoint
from configs import olmo3_7b
import errors
from store import storage


def _stored(path: str) -> dict:
  """The full run config saved with the checkpoint at `path`."""
  workdir_checkpoints = storage.join(path, 'checkpoints')
  if not checkpoint.committed_steps(path) and checkpoint.committed_steps(workdir_checkpoints):
    path = workdir_checkpoints
  if not checkpoint.committed_steps(path):
    errors.report(f'--config=configs/from_checkpoint.py:{path} names no checkpoint: give a '
                  'train.py workdir or a checkpoint directory with a committed step_N.',
                  errors.EXIT_USAGE)
  config = checkpoint.read_metadata(path).get('config') or {}
  if set(config) <= {'model'}:
    errors.report(f'{path} stores only a model config (a convert.py --from_hf checkpoint): '
                  'start from it with train.init_from and a full --config, e.g. '
                  f'--config=configs/olmo3_7b.py --config.train.init_from={path}.',
                  errors.EXIT_USAGE)
  return config


def _merged(base: ml_collections.ConfigDict, stored: dict) -> ml_collections.ConfigDict:
  for key, value in stored.items():
    if key in base and isinstance(base[key], ml_collections.ConfigDict) and \
        isinstance(value, dict):
      _merged(base[key], value)
    elif key in base and isinstance(base[key], tuple) and isinstance(value, list):
      base[key] = tuple(value)  # JSON has no tuples
    else:
      base[key] = value
  return base


def get_config(path: str = '') -> ml_collections.ConfigDict:
  if not path:
    errors.report('configs/from_checkpoint.py needs the checkpoint: '
                  '--config=configs/from_checkpoint.py:WORKDIR_OR_CHECKPOINT_DIR.',
                  errors.EXIT_USAGE)
  with errors.one_line():  # a malformed location is one line, before ml_collections wraps it
    path = storage.canonical(path, '--config=configs/from_checkpoint.py:PATH', writes=False)
  return _merged(olmo3_7b.get_config(), _stored(path))
