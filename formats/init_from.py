"""A run's step-0 state from `train.init_from`: an HF directory or one of our checkpoints.

Only the weights are taken (a fresh optimizer), except with `train.reset_step_on_init`
(stage 2), which also takes the Adam moments and count from a full train checkpoint and
restarts the step and the schedule. The weights must have the config's architecture.
"""

from typing import Any

from absl import logging
import jax
import ml_collections

import checkpoint
import errors
from formats import hf_ckpt
import model
import optim
from store import storage


def load(cfg: ml_collections.ConfigDict, target: Any, state: Any, shardings: Any) -> Any:
  """`state` (a fresh step-0 TrainState, `shardings` its shardings) with the weights of
  cfg.train.init_from; `target`: the whole state's shapes and shardings, restored into."""
  path = cfg.train.init_from
  if storage.exists(storage.join(path, 'config.json')):
    storage.canonical(path, 'train.init_from (an HF directory; or convert it once with '
                      'convert.py --from_hf=LOCAL_DIR --to=gs://...)', local_only=True)
    params, source = hf_ckpt.load_hf(path, pad_vocab_to=128)
    logging.info('Step-0 weights from train.init_from=%s, an HF directory; fresh optimizer '
                 'state.', path)
  elif checkpoint.committed_steps(path):
    source = ml_collections.ConfigDict(checkpoint.read_metadata(path)['config']).model
    if cfg.train.reset_step_on_init:
      restored, meta = checkpoint.restore_latest_good(path, target)
      logging.info('Step-0 weights and Adam moments from train.init_from=%s, its step %d '
                   '(train.reset_step_on_init: step and schedule restart at 0).', path,
                   meta['step'])
      return restored._replace(opt_state=optim.stage2_reset(restored.opt_state))
    params, meta = checkpoint.restore(path, target.params, subtree='params')
    logging.info('Step-0 weights from train.init_from=%s, its step %d; fresh optimizer state.',
                 path, meta.get('step'))
  else:
    raise errors.ConfigError(f'train.init_from={path!r} is neither an HF directory '
                             '(config.json) nor a checkpoint directory with a committed step_N.')
  for field in model.ARCHITECTURE_FIELDS:
    if source[field] != cfg.model[field]:
      raise errors.ConfigError(f'init_from={path}: the weights have {field}={source[field]!r}, '
                               f'the config {cfg.model[field]!r}; set --config.model.{field} '
                               'to match.')
  return state._replace(params=jax.tree.map(jax.device_put, params, shardings.params))
