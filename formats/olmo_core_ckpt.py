"""OLMo-core step directories <-> our checkpoints: weights, AdamW moments, step, data position.

    python convert.py --from_olmo_core=STEP_DIR_OR_URL --to=WORKDIR   # OLMo-core -> ours
    python convert.py --from_ckpt=CKPT --to_olmo_core=STEP_DIR         # ours -> OLMo-core

An OLMo-core step directory (docs/olmo_core_checkpoints.md has the details):

  config.json                 the experiment config: model, dataset, data_loader,
                              train_module (optimizer, scheduler), trainer
  data_paths.txt              the token files, one per line
  .metadata.json              {"ephemeral": ..., "version": ...}
  model_and_optim/.metadata   a pickled torch distributed-checkpoint Metadata: per
                              key its size, dtype and chunks, per chunk a file,
                              byte offset and length
  model_and_optim/__R_I.distcp  every chunk a separate torch.save blob at its offset
  train/rank0.pt              trainer state: global_step, the data loader position, RNG

Keys: `model.<fqn>` for the weights, `optim.state.<fqn>.{step,exp_avg,exp_avg_sq}`
for AdamW (flattened by parameter name), `optim.param_groups.<fqn>.<field>` as
pickled bytes. The Adam count is the optimizer state's `step`, which can be the
trainer step + 1 (OLMo-core's step-0 checkpoint runs one zero-gradient, lr=0
optimizer step); it is read from the state, never from global_step. OLMo-core
does not save the skip-step history, so a converted run starts with an empty
window, as OLMo-core's own resume does. config.json is translated by
formats/olmo_core_config.py; the data position by `loader_state`, `past_epoch_end` and
`olmo_core_position` (an epoch's last step is written the way each side reads it).

Both directions stream one layer of one tensor at a time (checkpoint.save_streamed,
checkpoint.read_array), and the vocabulary-sized arrays in row blocks, so host memory
stays near the largest single tensor (bench/bench_convert_memory.py measures it).
formats/olmo_core_reader.py reads the torch distributed checkpoint: it needs torch (the
blobs are torch.save archives; the optional extra, pip install '.[olmo-core]')
but not olmo_core.

Shapes: L layers, D d_model, F MLP hidden, V vocab.
"""

import json
import logging
import math
import os
import pickle
import re
import secrets
import shutil
import urllib.parse
from typing import Any, Callable, Iterator

import ml_collections
import numpy as np

import checkpoint
import data
from formats import ckpt_files
from formats import olmo_core_config
from formats.olmo_core_config import OlmoCoreCheckpointError
from formats import olmo_core_reader
import model
from store import storage
from tokens import token_files

OLMO_CORE_VERSION = '3.0.0'  # the version whose format this module reads and writes

# OLMo-core name in block i -> (our module, our name); torch Linear weights are [out, in],
# ours [in, out] (transposed both ways); norms are vectors on both sides.
BLOCK = {
    'attention.w_q.weight': ('attention', 'w_q'), 'attention.w_k.weight': ('attention', 'w_k'),
    'attention.w_v.weight': ('attention', 'w_v'), 'attention.w_out.weight': ('attention', 'w_o'),
    'attention.q_norm.weight': ('attention', 'q_norm'),
    'attention.k_norm.weight': ('attention', 'k_norm'),
    'attention_norm.weight': ('attention_norm', 'scale'),
    'feed_forward.w1.weight': ('mlp', 'w_gate'), 'feed_forward.w3.weight': ('mlp', 'w_up'),
    'feed_forward.w2.weight': ('mlp', 'w_down'),
    'feed_forward_norm.weight': ('mlp_norm', 'scale'),
}
GLOBAL = {'embeddings.weight': ('embed', 'embedding'),  # [V, D] on both sides
          'lm_head.norm.weight': ('final_norm', 'scale'),
          'lm_head.w_out.weight': ('lm_head', 'w')}  # [V, D] there, [D, V] here
GROUP_FIELDS = ('lr', 'betas', 'eps', 'weight_decay', 'initial_lr')  # OLMo-core 3.0.0's groups


def tensor_names(num_layers: int) -> Iterator[tuple[str, tuple[str, str], int | None]]:
  """(OLMo-core parameter fqn, our (module, name), layer or None), in our array order."""
  for fqn, key in GLOBAL.items():
    yield fqn, key, None
  for fqn, key in BLOCK.items():
    for i in range(num_layers):
      yield f'blocks.{i}.{fqn}', key, i


def _to_ours(fqn: str, value: np.ndarray) -> np.ndarray:
  return value.T if value.ndim == 2 and fqn != 'embeddings.weight' else value


# --- The data position ----------------------------------------------------------------------


def loader_state(trainer: dict, cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """Our data.Loader state from OLMo-core's trainer state (same order: docs/data.md)."""
  dl = trainer.get('data_loader') or {}
  missing = [k for k in ('batches_processed', 'seed', 'dataset_fingerprint') if k not in dl]
  if missing or 'global_step' not in trainer:
    raise OlmoCoreCheckpointError(f'train/rank0.pt lacks {missing or ["global_step"]}; it is '
                                  'not an OLMo-core trainer state.')
  if dl.get('dataset_type', 'fsl') != 'fsl':
    raise OlmoCoreCheckpointError(f"data loader type {dl['dataset_type']!r}: only the "
                                  'fixed-sequence-length (fsl) dataset is supported.')
  seq_len = dl.get('sequence_length', cfg.data.seq_len)
  if seq_len != cfg.data.seq_len:
    raise OlmoCoreCheckpointError(f'the trainer state has sequence_length {seq_len}, the '
                                  f'config {cfg.data.seq_len}.')
  state = {'seed': int(dl['seed']), 'epoch': int(dl.get('epoch') or trainer.get('epoch') or 1),
           'step': int(dl['batches_processed']),
           'global_batch_size': int(cfg.data.global_batch_size), 'seq_len': int(seq_len),
           'fingerprint': dl['dataset_fingerprint'],
           'fingerprint_version': dl.get('dataset_fingerprint_version',
                                         token_files.FINGERPRINT_VERSION),
           'tokens_processed': int(dl.get('tokens_processed', 0))}
  if dl.get('tokens_processed') and state['step'] and (
      dl['tokens_processed'] != state['step'] * cfg.data.global_batch_size * seq_len):
    raise OlmoCoreCheckpointError(
        f"the trainer state has {dl['tokens_processed']} tokens in {state['step']} batches, not "
        f'{cfg.data.global_batch_size} x {seq_len} per batch; set data.global_batch_size to '
        "the run's.")
  return state


def past_epoch_end(state: dict[str, Any], cfg: ml_collections.ConfigDict) -> dict[str, Any]:
  """`state` at (epoch + 1, step 0) when it is OLMo-core's record of a finished epoch.

  OLMo-core saves an epoch's last step as (epoch, batches_processed = batches in
  the epoch), and its trainer opens the next epoch on resume; ours names the next
  batch: (epoch + 1, 0). The batches in an epoch follow from the token files, so
  the position is normalised when they are here and are the run's (the dataset
  fingerprint), and kept otherwise: data.Loader reads such a position as the
  next epoch's step 0 too. The dataset's instance count is recorded with it,
  which lets the export write OLMo-core's own form back.
  """
  if not state['step'] or cfg.data.dataset != 'fsl':
    return state
  try:
    ds = data.Dataset.from_config(cfg.data)
  except (OSError, ValueError) as e:  # the files are elsewhere: nothing to count here
    logging.info('Data position kept as OLMo-core wrote it (epoch %d, step %d): the token files '
                 'are not readable here (%s).', state['epoch'], state['step'], e)
    return state
  if ds.fingerprint != state['fingerprint']:
    return state  # other files: train.py refuses them when it resumes
  state = dict(state, num_instances=ds.num_instances)
  if state['step'] == ds.num_instances // state['global_batch_size']:
    state.update(epoch=state['epoch'] + 1, step=0, tokens_processed=0)
  return state


def olmo_core_position(loader: dict[str, Any]) -> tuple[int, int]:
  """(epoch, batches_processed) as OLMo-core records our loader position `loader`.

  Ours at (epoch e > 1, step 0) is OLMo-core's (e - 1, batches in an epoch), the
  form its checkpointer saves at an epoch's last step (its trainer then opens
  epoch e); known when the state records the dataset's instance count.
  """
  epoch, step = int(loader['epoch']), int(loader['step'])
  if epoch > 1 and step == 0 and loader.get('num_instances'):
    return epoch - 1, int(loader['num_instances']) // int(loader['global_batch_size'])
  return epoch, step


# --- OLMo-core -> ours ------------------------------------------------------------------------


def _decay_settings(reader: olmo_core_reader.Reader, cfg: ml_collections.ConfigDict,
                    sources: dict[str, str]) -> None:
  """cfg.opt.no_decay and weight_decay from the param groups (the only group marker)."""
  decays: dict[str, set] = {}
  for fqn, (module, name), _ in tensor_names(cfg.model.num_layers):
    key = f'optim.param_groups.{fqn}.weight_decay'
    if key in reader.chunks:
      decays.setdefault(f'{module}/{name}', set()).add(float(reader.value(key)))
  if not decays:
    return
  mixed = [p for p, v in decays.items() if len(v) > 1]
  nonzero = {w for v in decays.values() for w in v if w}
  if mixed or len(nonzero) > 1:
    raise OlmoCoreCheckpointError(f'per-layer weight decay ({mixed or sorted(nonzero)}) cannot '
                                  'be expressed by cfg.opt.no_decay.')
  cfg.opt.weight_decay = nonzero.pop() if nonzero else 0.0
  cfg.opt.no_decay = tuple(re.escape(p) for p, v in sorted(decays.items()) if v == {0.0})
  for field in ('opt.weight_decay', 'opt.no_decay'):
    sources[field] = 'model_and_optim/: optim.param_groups.*.weight_decay'


def adam_count(reader: olmo_core_reader.Reader, num_layers: int) -> int | None:
  """OLMo-core's Adam step (bias-correction count), the same for every parameter; None if absent."""
  counts = {}
  for fqn, _, _ in tensor_names(num_layers):
    key = f'optim.state.{fqn}.step'
    if key in reader:
      counts[fqn] = float(reader.tensor(key))
  if not counts:
    return None
  if len(set(counts.values())) > 1 or len(counts) != sum(1 for _ in tensor_names(num_layers)):
    raise OlmoCoreCheckpointError(f'Adam steps differ between parameters or are missing for '
                                  f'some ({sorted(set(counts.values()))[:4]}); one count per '
                                  'run is all our optimizer keeps.')
  return int(next(iter(counts.values())))


BLOCK_BYTES = 256 << 20  # a vocabulary-sized array moves in row blocks of about this size


def _block_rows(rows: int, row_bytes: int) -> int:
  """Rows per block: the fewest equal blocks (a divisor of `rows`) of at most BLOCK_BYTES.

  The 7B's embedding and lm_head are 1.6 GB each; whole, their transposed copy and
  tensorstore's copy of what it writes would double the converter's peak memory.
  """
  return rows // next((d for d in range(1, rows + 1)
                       if rows % d == 0 and rows // d * row_bytes <= BLOCK_BYTES), rows)


def _stacked(reader: olmo_core_reader.Reader, num_layers: int, source: str | None, key: tuple[str, str],
             shape: tuple[int, ...]) -> tuple[tuple[int, ...], Callable[[], Iterator]]:
  """(piece shape, pieces()) for save_streamed: our array `key` from OLMo-core's tensors.

  Per-layer arrays go one layer at a time, the others in row blocks (_block_rows).
  source formats an fqn into the checkpoint key ('model.{}', 'optim.state.{}.exp_avg');
  None gives zeros (a weights-only source has no moments).
  """
  fqns = [f for f, k, _ in tensor_names(num_layers) if k == key]
  stacked = key not in GLOBAL.values()  # per-layer arrays are [L, ...], even at L = 1
  per = shape[1:] if stacked else shape
  rows = per[0] if stacked else _block_rows(per[0], 4 * math.prod(per[1:]))
  piece = (1, *per) if stacked else (rows, *per[1:])

  def pieces():
    for i, fqn in enumerate(fqns):
      value = (np.zeros(per, np.float32) if source is None
               else _to_ours(fqn, reader.tensor(source.format(fqn))))
      if value.shape != per:
        raise OlmoCoreCheckpointError(f'{source.format(fqn)}: shape {value.T.shape} does not '
                                      f'fit the config ({per} ours); config.json does not '
                                      'describe these weights.')
      value = value.astype(np.float32, copy=False)
      if stacked:
        yield ((i, i + 1),) + tuple((0, n) for n in per), value[None]
      else:  # save_streamed copies each block C-ordered (the lm_head's is a transposed view)
        for a in range(0, per[0], rows):
          yield ((a, a + rows),) + tuple((0, n) for n in per[1:]), value[a:a + rows]
  return piece, pieces


def import_step(step_dir: str, out_dir: str, *, base: ml_collections.ConfigDict | None = None,
                overwrite: bool = False) -> dict[str, Any]:
  """Converts a local OLMo-core step directory into our checkpoint `out_dir`/step_K.

  Returns a summary (step, Adam count, config, whether moments were present).
  """
  if not os.path.isdir(step_dir):
    raise FileNotFoundError(f'{step_dir} is not a directory; give an OLMo-core stepN/ '
                            'directory or its URL.')
  ckpt_files.check_destination(out_dir, overwrite)
  config_path = os.path.join(step_dir, 'config.json')
  if not os.path.exists(config_path):
    raise OlmoCoreCheckpointError(f'{config_path} is missing: the model shape is read from it.')
  paths_file = os.path.join(step_dir, 'data_paths.txt')
  data_paths = (open(paths_file).read().split() if os.path.exists(paths_file) else [])
  translated, sources = olmo_core_config.translate(olmo_core_reader.read_json(config_path), data_paths)
  inner = os.path.join(step_dir, 'model_and_optim')
  reader = olmo_core_reader.Reader(inner if os.path.isdir(inner) else step_dir)  # weights-only: top level
  trainer = olmo_core_reader.read_trainer_state(step_dir)
  m = translated.model
  missing = [f'model.{f}' for f, _, _ in tensor_names(m.num_layers) if f'model.{f}' not in reader]
  if missing:
    raise OlmoCoreCheckpointError(f'{reader.directory} lacks {len(missing)} weights, e.g. '
                                  f'{missing[:3]}; it is not an Olmo 3 of this config.json.')
  count = adam_count(reader, m.num_layers)
  _decay_settings(reader, translated, sources)
  cfg = translated if base is None else olmo_core_config.checked_base(base, translated, sources)
  step = int(trainer['global_step']) if trainer else 0
  if count is None:
    logging.warning('%s has no optimizer state (weights only): the AdamW moments and count '
                    'start at zero.', step_dir)
  logging.info('OLMo-core trainer step %d, Adam count %s; the skip-step history starts empty '
               '(OLMo-core does not save it either).', step, count)
  meta = {'config': cfg.to_dict(), 'olmo_core_source': {
      'path': os.path.abspath(step_dir), 'global_step': step, 'adam_count': count,
      'config': olmo_core_reader.read_json(config_path)}}
  if trainer:
    meta['data'] = past_epoch_end(loader_state(trainer, cfg), cfg)
    meta['data']['global_train_tokens_seen'] = int(trainer.get('global_train_tokens_seen', 0))
  _write(reader, cfg, out_dir, step, count, meta, overwrite)
  return {'step': step, 'adam_count': count, 'config': cfg, 'moments': count is not None}


def _write(reader: olmo_core_reader.Reader, cfg, out_dir: str, step: int, count: int | None, meta: dict,
           overwrite: bool) -> None:
  m = cfg.model
  shapes = {(module, name): shape for module, names in model.param_shapes(m).items()
            for name, shape in names.items()}
  arrays = []
  moments = count is not None
  for prefix, source in (('params', 'model.{}'),
                         ('opt_state/mu', 'optim.state.{}.exp_avg' if moments else None),
                         ('opt_state/nu', 'optim.state.{}.exp_avg_sq' if moments else None)):
    for key, shape in sorted(shapes.items()):
      arrays.append((f'{prefix}/{key[0]}/{key[1]}', shape, np.float32,
                     *_stacked(reader, m.num_layers, source, key, shape)))
  window = int(cfg.opt.skip_window)
  scalars = {'step': (step, np.int32), 'count': (count or 0, np.int32),
             'loss_history_W': (np.zeros(window), np.float32),
             'norm_history_W': (np.zeros(window), np.float32),
             'history_len': (0, np.int32), 'history_next': (0, np.int32),
             'lr': (0, np.float32), 'grad_norm': (0, np.float32), 'skipped': (False, np.bool_)}
  for name, (value, dtype) in scalars.items():
    value = np.asarray(value, dtype)
    arrays.append((f'opt_state/{name}', value.shape, dtype, value.shape,
                   lambda value=value: iter([(tuple((0, n) for n in value.shape), value)])))
  out_dir = storage.absolute(out_dir)
  staging = ckpt_files.staging_dir(out_dir)
  try:
    checkpoint.save_streamed(staging, step, arrays, meta)
    ckpt_files.install(staging, out_dir, step)
  finally:
    storage.delete_tree(staging)


# --- Fetching a step directory over HTTP ------------------------------------------------------


def fetch(url: str, cache_dir: str | None = None, *,
          base: ml_collections.ConfigDict | None = None, **kwargs) -> str:
  """Downloads an OLMo-core step directory (listed by its .metadata) into a cache; its path.

  Directory listings are not available over HTTP, so .metadata comes first and
  names the .distcp files. Everything goes through download.fetch: parallel,
  resumable, retried, verified, one progress bar; a rerun fetches nothing. A
  `base` (convert.py --config) is checked against config.json before the tensors
  (tens of GB) are fetched.
  """
  # Only the URL path needs it.
  from store import download  # pylint: disable=import-outside-toplevel
  root = url.rstrip('/')
  parsed = urllib.parse.urlparse(root)
  cache_dir = cache_dir or os.path.join(os.path.expanduser('~'), '.cache', 'olmo3_jax',
                                        'olmo_core')
  local = os.path.join(cache_dir, parsed.netloc, parsed.path.strip('/'))
  item = lambda rel: download.Item(f'{root}/{rel}', os.path.join(local, rel))
  download.fetch([item('model_and_optim/.metadata'), item('config.json')], **kwargs)
  for optional in ('train/rank0.pt', 'data_paths.txt', '.metadata.json'):
    try:  # a weights-only directory has no trainer state
      download.fetch([item(optional)], **kwargs)
    except download.DownloadError as e:
      if e.status != 404:
        raise
      logging.warning('%s/%s is not there (404); continuing without it.', root, optional)
  if base is not None:
    olmo_core_config.checked_base(
        base, *olmo_core_config.translate(olmo_core_reader.read_json(os.path.join(local, 'config.json')), []))
  files = olmo_core_reader.Reader(os.path.join(local, 'model_and_optim')).files()
  download.fetch([item(f'model_and_optim/{f}') for f in files], **kwargs)
  return local


# --- Ours -> OLMo-core ------------------------------------------------------------------------


def export_step(ckpt_dir: str, out_dir: str, *, step: int | None = None) -> int:
  """Writes our checkpoint as an OLMo-core step directory that its Trainer loads (load_path).

  Returns the step written. Built beside `out_dir` and renamed into place.
  """
  torch = olmo_core_reader.torch_module()
  from torch.distributed.checkpoint import metadata as dcp  # pylint: disable=import-outside-toplevel
  # The per-chunk record torch's FileSystemReader (and so OLMo-core's) unpickles: torch
  # exports no public name for it, and a class of ours would not unpickle there.
  from torch.distributed.checkpoint.filesystem import _StorageInfo as TorchStorageInfo  # pylint: disable=import-outside-toplevel
  if os.path.exists(out_dir):
    raise FileExistsError(f'{out_dir} exists; choose a new --to_olmo_core directory.')
  step = checkpoint.latest_step(ckpt_dir) if step is None else step
  meta = checkpoint.read_metadata(ckpt_dir, step)
  if 'config' not in meta or 'data' not in meta:
    raise OlmoCoreCheckpointError(f'{ckpt_dir} step {step} has no config or data position; '
                                  'export a train.py checkpoint (or one converted from '
                                  'OLMo-core).')
  cfg = ml_collections.ConfigDict(meta['config'])
  m = cfg.model
  read = lambda name, box=None: checkpoint.read_array(ckpt_dir, name, box, step)
  count = int(read('opt_state/count'))
  lr = float(read('opt_state/lr'))
  shapes = ckpt_files.per_layer_shapes(m)
  decayed = {f'{k[0]}/{k[1]}': not any(re.fullmatch(p, f'{k[0]}/{k[1]}')
                                        for p in cfg.opt.no_decay) for k in shapes}

  tmp = f'{out_dir}.tmp-{secrets.token_hex(4)}'
  inner = os.path.join(tmp, 'model_and_optim')
  os.makedirs(inner)
  entries, storage, planner = {}, {}, {}
  try:
    with open(os.path.join(inner, '__0_0.distcp'), 'wb') as f:
      def put(fqn: str, obj: Any) -> None:
        offset = f.tell()
        if isinstance(obj, np.ndarray):
          t = torch.from_numpy(np.asarray(obj, order='C'))  # keeps 0-d as 0-d
          torch.save(t, f)
          props = dcp.TensorProperties(dtype=t.dtype)
          entries[fqn] = dcp.TensorStorageMetadata(
              props, t.size(), [dcp.ChunkStorageMetadata(torch.Size([0] * t.ndim), t.size())])
          index = dcp.MetadataIndex(fqn, torch.Size([0] * t.ndim), 0)
        else:
          torch.save(obj, f)
          entries[fqn] = dcp.BytesStorageMetadata()
          index = dcp.MetadataIndex(fqn)
        storage[index] = TorchStorageInfo('__0_0.distcp', offset, f.tell() - offset)
        top, rest = fqn.split('.', 1)
        planner[fqn] = (top, rest)

      for what, prefix in (('model', 'params'), ('exp_avg', 'opt_state/mu'),
                           ('exp_avg_sq', 'opt_state/nu')):
        for fqn, key, layer in tensor_names(m.num_layers):
          name = f'{prefix}/{key[0]}/{key[1]}'
          shape = shapes[key]
          if layer is None:
            value = _read_global(read, name, fqn, shape)
          else:
            value = read(name, ((layer, layer + 1),) + tuple((0, n) for n in shape))[0]
            # _to_ours is its own inverse: OLMo-core's layout from ours.
            value = np.ascontiguousarray(_to_ours(fqn, value), np.float32)
          put(f'model.{fqn}' if what == 'model' else f'optim.state.{fqn}.{what}', value)
          if what == 'model':  # Adam's count as OLMo-core keeps it: a float32 per parameter
            put(f'optim.state.{fqn}.step', np.asarray(count, np.float32))
      for fqn, key, _ in tensor_names(m.num_layers):
        group = {'lr': lr, 'betas': (cfg.opt.b1, cfg.opt.b2), 'eps': cfg.opt.eps,
                 'weight_decay': cfg.opt.weight_decay if decayed[f'{key[0]}/{key[1]}'] else 0.0,
                 'initial_lr': cfg.opt.lr}
        for field in GROUP_FIELDS:
          put(f'optim.param_groups.{fqn}.{field}', group[field])
      f.flush()
      os.fsync(f.fileno())
    md = dcp.Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage)
    with open(os.path.join(inner, '.metadata'), 'wb') as f:
      pickle.dump(md, f)
    _write_trainer_state(tmp, step, cfg, meta['data'], torch)
    with open(os.path.join(tmp, 'config.json'), 'w') as f:
      json.dump(olmo_core_config.olmo_core_config(cfg), f)
    with open(os.path.join(tmp, 'data_paths.txt'), 'w') as f:
      f.writelines(f'{p}\n' for p, _ in meta['data'].get('files', []))  # read-loop safe
    with open(os.path.join(tmp, '.metadata.json'), 'w') as f:
      json.dump({'ephemeral': False, 'version': OLMO_CORE_VERSION}, f)
    os.rename(tmp, out_dir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return step


def _read_global(read: Callable, name: str, fqn: str, shape: tuple[int, ...]) -> np.ndarray:
  """A non-layer array of ours in OLMo-core's layout, read in row blocks (bounded memory)."""
  transposed = len(shape) == 2 and fqn != 'embeddings.weight'  # as _to_ours
  out = np.empty(shape[::-1] if transposed else shape, np.float32)
  rows = _block_rows(shape[0], 4 * math.prod(shape[1:]))
  for a in range(0, shape[0], rows):
    block = read(name, ((a, min(a + rows, shape[0])),) + tuple((0, n) for n in shape[1:]))
    if transposed:
      out[:, a:a + rows] = block.T
    else:
      out[a:a + rows] = block
  return out


def _write_trainer_state(step_dir: str, step: int, cfg, loader: dict, torch) -> None:
  """train/rank0.pt: what OLMo-core's Trainer.load_state_dict reads."""
  tokens = step * cfg.data.global_batch_size * cfg.data.seq_len
  epoch, batches = olmo_core_position(loader)
  state = {
      'global_step': step,
      'global_train_tokens_seen': loader.get('global_train_tokens_seen', tokens),
      'max_steps': int(cfg.train.steps), 'epoch': epoch,
      # No RNG state: Olmo 3 training draws no random numbers (no dropout), and a world
      # size no run has makes OLMo-core skip restoring it.
      'world_size': 0, 'rng': {}, 'callbacks': {},
      'data_loader': {
          'dataset_fingerprint_version': loader.get('fingerprint_version',
                                                    token_files.FINGERPRINT_VERSION),
          'dataset_fingerprint': loader['fingerprint'],
          'batches_processed': batches,
          'tokens_processed': batches * cfg.data.global_batch_size * cfg.data.seq_len,
          'seed': loader['seed'], 'epoch': epoch, 'dataset_type': 'fsl',
          'sequence_length': cfg.data.seq_len,
          'max_target_sequence_length': cfg.data.max_target_sequence_length
          if cfg.data.max_target_sequence_length != -1 else cfg.data.seq_len}}
  os.makedirs(os.path.join(step_dir, 'train'))
  torch.save(state, os.path.join(step_dir, 'train', 'rank0.pt'))
