"""OLMo-core step directories <-> our checkpoints: weights, AdamW moments, step, data position.

    python convert.py --from_olmo_core=STEP_DIR_OR_URL --to=CKPT   # OLMo-core -> ours
    python convert.py --from_ckpt=CKPT --to_olmo_core=STEP_DIR      # ours -> OLMo-core

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
window, as OLMo-core's own resume does.

Both directions stream one layer of one tensor at a time (checkpoint.save_streamed,
checkpoint.read_array), and the vocabulary-sized arrays in row blocks, so host memory
stays near the largest single tensor (bench/bench_convert_memory.py measures it).
Reading needs torch (the blobs are torch.save archives) but not olmo_core: the
storage-info record OLMo-core pickles into `.metadata` is read as a plain record.
torch comes with the optional extra: pip install '.[olmo-core]'.

Shapes: L layers, D d_model, F MLP hidden, V vocab.
"""

import io
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
import convert
import data
from configs import olmo3_7b
import model

OLMO_CORE_VERSION = '3.0.0'  # the version whose format this module reads and writes
EXTRA = "pip install '.[olmo-core]'"

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


class OlmoCoreCheckpointError(ValueError):
  """An OLMo-core step directory that is incomplete, damaged or not an Olmo 3."""


def _torch():
  """torch, imported only on this path (the optional extra provides it)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError('Reading or writing OLMo-core checkpoints needs torch (CPU is enough): '
                      f'{EXTRA}') from e
  return torch


def tensor_names(num_layers: int) -> Iterator[tuple[str, tuple[str, str], int | None]]:
  """(OLMo-core parameter fqn, our (module, name), layer or None), in our array order."""
  for fqn, key in GLOBAL.items():
    yield fqn, key, None
  for fqn, key in BLOCK.items():
    for i in range(num_layers):
      yield f'blocks.{i}.{fqn}', key, i


def _to_ours(fqn: str, value: np.ndarray) -> np.ndarray:
  return value.T if value.ndim == 2 and fqn != 'embeddings.weight' else value


# --- Reading a step directory --------------------------------------------------------------


class _StorageInfo:
  """Stand-in for the per-chunk record OLMo-core (or torch) pickles: file, offset, length."""

  def __setstate__(self, state):
    self.__dict__.update(state)


class _Unpickler(pickle.Unpickler):
  def find_class(self, module, name):
    if name == '_StorageInfo':  # olmo_core's or torch's: same fields, no import of olmo_core
      return _StorageInfo
    return super().find_class(module, name)


class _Window(io.RawIOBase):
  """Bytes [offset, offset + length) of an open file, as a seekable file of their own."""

  def __init__(self, f, offset: int, length: int):
    super().__init__()
    self.f, self.offset, self.length, self.pos = f, offset, length, 0

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self.pos

  def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
    self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
    return self.pos

  def readinto(self, buffer) -> int:
    n = max(0, min(len(buffer), self.length - self.pos))
    self.f.seek(self.offset + self.pos)
    got = self.f.readinto(memoryview(buffer)[:n])
    self.pos += got
    return got


class Reader:
  """The tensors and pickled values of a `model_and_optim/` distributed checkpoint."""

  def __init__(self, directory: str):
    _torch()  # the metadata pickle names torch classes
    self.directory = directory
    path = os.path.join(directory, '.metadata')
    try:
      with open(path, 'rb') as f:
        meta = _Unpickler(f).load()
    except FileNotFoundError as e:
      raise OlmoCoreCheckpointError(f'{path} is missing: {directory} is not an OLMo-core '
                                    'model_and_optim/ directory (is the step directory '
                                    'complete?).') from e
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
      raise OlmoCoreCheckpointError(f'{path} is unreadable ({e}); download it again.') from e
    self.entries = meta.state_dict_metadata
    self.chunks: dict[str, list] = {}
    for index, info in meta.storage_data.items():
      self.chunks.setdefault(index.fqn, []).append((index, info))

  def files(self) -> list[str]:
    """The .distcp files the metadata names (some writer threads leave none)."""
    return sorted({info.relative_path for chunks in self.chunks.values() for _, info in chunks})

  def __contains__(self, fqn: str) -> bool:
    return fqn in self.entries

  def _check_extent(self, fqn: str, info) -> None:
    path = os.path.join(self.directory, info.relative_path)
    if not os.path.exists(path):
      raise OlmoCoreCheckpointError(f'{path} is missing (it holds {fqn}); download the step '
                                    'directory again.')
    if os.path.getsize(path) < info.offset + info.length:
      raise OlmoCoreCheckpointError(f'{path} is truncated: {fqn} needs bytes {info.offset}..'
                                    f'{info.offset + info.length}, the file has fewer. '
                                    'Download it again.')

  def _blob(self, fqn: str, info) -> bytes:
    path = os.path.join(self.directory, info.relative_path)
    try:
      with open(path, 'rb') as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    except FileNotFoundError as e:
      raise OlmoCoreCheckpointError(f'{path} is missing (it holds {fqn}); download the step '
                                    'directory again.') from e
    if len(blob) != info.length:
      raise OlmoCoreCheckpointError(f'{path} is truncated: {fqn} needs bytes {info.offset}..'
                                    f'{info.offset + info.length}, the file has fewer. '
                                    'Download it again.')
    return blob

  def _load(self, fqn: str, info) -> Any:
    self._check_extent(fqn, info)
    try:  # torch reads the blob straight from the file: no bytes copy beside the tensor
      with open(os.path.join(self.directory, info.relative_path), 'rb') as f:
        return _torch().load(_Window(f, info.offset, info.length), map_location='cpu',
                             weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
      raise OlmoCoreCheckpointError(f'{self.directory}/{info.relative_path}: {fqn} is '
                                    f'damaged ({e}); download the file again.') from e

  def tensor(self, fqn: str) -> np.ndarray:
    """The whole tensor `fqn`, reassembled from its chunks, as float32/int numpy."""
    if fqn not in self.entries or not hasattr(self.entries[fqn], 'chunks'):
      raise OlmoCoreCheckpointError(f'{self.directory} has no tensor {fqn}.')
    meta = self.entries[fqn]
    shape = tuple(meta.size)
    chunks = self.chunks.get(fqn, [])
    if len(chunks) == 1 and tuple(chunks[0][0].offset or ()) == (0,) * len(shape):
      value = self._load(fqn, chunks[0][1])
      if tuple(value.shape) == shape:  # unsharded: no copy
        return value.numpy()
    out, covered = None, 0
    for index, info in chunks:
      value = self._load(fqn, info).numpy()
      if out is None:
        out = np.empty(shape, value.dtype)
      at = tuple(slice(o, o + n) for o, n in zip(index.offset, value.shape))
      out[at] = value
      covered += value.size
    if out is None or covered != math.prod(shape):
      raise OlmoCoreCheckpointError(f'{self.directory}: the chunks of {fqn} cover {covered} of '
                                    f'{math.prod(shape)} elements; the metadata is damaged.')
    return out

  def value(self, fqn: str) -> Any:
    """A pickled (bytes) entry, e.g. a param group's weight_decay."""
    if fqn not in self.chunks:
      raise OlmoCoreCheckpointError(f'{self.directory} has no entry {fqn}.')
    blob = self._blob(fqn, self.chunks[fqn][0][1])
    return _torch().load(io.BytesIO(blob), weights_only=False)


def _read_json(path: str) -> dict:
  return convert.read_json(path, OlmoCoreCheckpointError, 'download it again')


def read_trainer_state(step_dir: str) -> dict | None:
  """train/rank0.pt as a dict, or None for a weights-only directory."""
  path = os.path.join(step_dir, 'train', 'rank0.pt')
  if not os.path.exists(path):
    return None
  try:
    return _torch().load(path, map_location='cpu', weights_only=False)
  except Exception as e:  # pylint: disable=broad-except  # torch raises many kinds here
    raise OlmoCoreCheckpointError(f'{path} is unreadable ({type(e).__name__}: {e}); download '
                                  'it again.') from e


# --- Config translation ----------------------------------------------------------------------


def _get(d: dict, *path, default=None):
  for key in path:
    if not isinstance(d, dict) or key not in d:
      return default
    d = d[key]
  return d


def config_from_olmo_core(oc: dict, data_paths: list[str], base: ml_collections.ConfigDict
                          | None = None) -> ml_collections.ConfigDict:
  """Our run config from OLMo-core's config.json, on top of `base` (default: the 7B's).

  What config.json does not say keeps base's value: the data files' location,
  checkpoint cadence, mesh, kernels.
  """
  cfg = base if base is not None else olmo3_7b.get_config()
  mc = oc.get('model')
  if not isinstance(mc, dict) or 'd_model' not in mc:
    raise OlmoCoreCheckpointError("config.json has no 'model' section with d_model; it is not "
                                  'an OLMo-core experiment config.')
  m, mixer = cfg.model, _mixer(mc.get('block') or {})
  if not mixer:
    raise OlmoCoreCheckpointError("config.json's model.block has no attention settings "
                                  "('sequence_mixer', or 'attention' in older OLMo-core).")
  if _get(mc, 'block', 'name', default='reordered_norm') != 'reordered_norm':
    raise OlmoCoreCheckpointError(f"block {mc['block']['name']!r} is not Olmo 3's reordered_norm.")
  m.num_layers, m.d_model, m.vocab_size = mc['n_layers'], mc['d_model'], mc['vocab_size']
  m.num_heads = mixer.get('n_heads', m.num_heads)
  m.num_kv_heads = mixer.get('n_kv_heads') or m.num_heads
  m.head_dim = m.d_model // m.num_heads
  m.mlp_hidden = _get(mc, 'block', 'feed_forward', 'hidden_size', default=m.mlp_hidden)
  m.norm_eps = _get(mc, 'block', 'layer_norm', 'eps', default=m.norm_eps)
  window = mixer.get('sliding_window') or {}
  pattern = window.get('pattern') or [-1]
  per_layer = [pattern[i % len(pattern)] for i in range(m.num_layers)]
  if window.get('force_full_attention_on_first_layer'):
    per_layer[0] = -1
  if window.get('force_full_attention_on_last_layer'):
    per_layer[-1] = -1
  widths = {w for w in per_layer if w != -1}
  if len(widths) > 1:
    raise OlmoCoreCheckpointError(f'sliding windows {sorted(widths)}: one width is supported.')
  m.layer_pattern = convert._periodic_pattern(  # pylint: disable=protected-access
      ['full_attention' if w == -1 else 'sliding_attention' for w in per_layer])
  m.sliding_window = widths.pop() if widths else m.sliding_window
  m.sliding_window_plus_one = False  # OLMo-core 3.0.0: window W is (i-W, i]
  _translate_rope(mc, m, [i for i, w in enumerate(per_layer) if w == -1])

  d, ds, dl = cfg.data, oc.get('dataset') or {}, oc.get('data_loader') or {}
  d.seq_len = ds.get('sequence_length', d.seq_len)
  tok = ds.get('tokenizer') or {}
  d.vocab_size = tok.get('vocab_size', d.vocab_size)
  d.eos_token_id = tok.get('eos_token_id', d.eos_token_id)
  d.pad_token_id = tok.get('pad_token_id', d.pad_token_id)
  if 'global_batch_size' in dl:
    d.global_batch_size = dl['global_batch_size'] // d.seq_len  # OLMo-core counts tokens
  d.seed = dl.get('seed', d.seed)
  if data_paths:
    d.paths, d.mix_file, d.base_dir = tuple(data_paths), '', ''

  o, tm = cfg.opt, oc.get('train_module') or {}
  optim = tm.get('optim') or {}
  if optim and 'skipstepadamw' not in str(optim.get('_CLASS_', '')).lower():
    raise OlmoCoreCheckpointError(f"optimizer {optim.get('_CLASS_')} is not SkipStepAdamW.")
  if optim.get('step_increment_bugfix') is False:
    raise OlmoCoreCheckpointError('step_increment_bugfix=False: OLMo-core never advanced the '
                                  'Adam count, which our optimizer cannot express.')
  o.lr = optim.get('lr', o.lr)
  o.b1, o.b2 = optim.get('betas', (o.b1, o.b2))
  o.eps = optim.get('eps', o.eps)
  o.weight_decay = optim.get('weight_decay', o.weight_decay)
  o.skip_window = optim.get('rolling_interval_length', o.skip_window)
  o.skip_sigma = float(optim.get('sigma_factor', o.skip_sigma))
  o.clip_grad_norm = tm.get('max_grad_norm') or 0.0
  o.z_loss = tm.get('z_loss_multiplier') or 0.0
  steps = _get(oc, 'trainer', 'max_duration')
  if isinstance(steps, dict) and steps.get('unit') == 'steps':
    cfg.train.steps = int(steps['value'])
  elif isinstance(steps, dict) and steps.get('unit') == 'tokens':
    cfg.train.steps = int(steps['value']) // (d.global_batch_size * d.seq_len)
  _translate_schedule(tm.get('scheduler') or {}, o, cfg.train.steps)
  return cfg


def _mixer(block: dict) -> dict:
  """A block's attention settings: `sequence_mixer`, or `attention` in configs written by
  older OLMo-core (3.0.0's TransformerBlockConfig still reads both)."""
  return block.get('sequence_mixer') or block.get('attention') or {}


def _without_scaling(block: dict) -> str:
  block = json.loads(json.dumps(block))
  (_mixer(block).get('rope') or {}).pop('scaling', None)
  return json.dumps(block, sort_keys=True)


def _translate_rope(mc: dict, m: ml_collections.ConfigDict, full_layers: list[int]) -> None:
  """m.rope_theta and m.yarn from the block's RoPE and its per-layer overrides.

  Stage 3 (OLMo-core `TransformerConfig.with_rope_scaling(YaRN)`, full-attention
  layers only) keeps the block and adds `block_overrides`: a copy of the block per
  full-attention layer whose RoPE has `scaling`. model.py applies cfg.model.yarn to
  exactly those layers, so only that form translates.
  """
  block = mc.get('block') or {}
  m.rope_theta = float((_mixer(block).get('rope') or {}).get('theta', m.rope_theta))
  overrides = {int(i): b for i, b in (mc.get('block_overrides') or {}).items()}
  scaled = {}
  for i in range(m.num_layers):
    if i in overrides and _without_scaling(overrides[i]) != _without_scaling(block):
      raise OlmoCoreCheckpointError(f'block_overrides[{i}] changes more than the RoPE scaling; '
                                    'layers that differ otherwise cannot be translated.')
    scaling = (_mixer(overrides.get(i, block)).get('rope') or {}).get('scaling')
    if scaling:
      scaled[i] = scaling
  m.yarn.enabled = bool(scaled)
  if not scaled:
    return
  if sorted(scaled) != full_layers:
    raise OlmoCoreCheckpointError(
        f'RoPE scaling on layers {sorted(scaled)}; ours applies YaRN to exactly the '
        f'full-attention layers {full_layers} (OLMo-core with_rope_scaling(..., '
        'full_attn_layers_only=True), as Olmo 3 stage 3 does).')
  kinds = {json.dumps(v, sort_keys=True) for v in scaled.values()}
  y, s = m.yarn, next(iter(scaled.values()))
  if len(kinds) > 1 or not str(s.get('_CLASS_', '')).endswith('YaRNRoPEScalingConfig'):
    raise OlmoCoreCheckpointError(f'RoPE scaling {sorted(kinds)[:2]}: only one YaRN setting '
                                  '(YaRNRoPEScalingConfig) translates to model.yarn.')
  # OLMo-core YaRNRoPEScalingConfig's defaults, for a config.json that leaves them out.
  y.factor = float(s.get('factor', 8.0))
  y.beta_fast, y.beta_slow = float(s.get('beta_fast', 32)), float(s.get('beta_slow', 1))
  y.original_max_position = int(s.get('old_context_len', 8192))
  # OLMo-core's attention factor is always 0.1 ln(factor) + 1; model.py's default is that for
  # factor > 1 and 1 otherwise, so only a factor <= 1 needs it spelled out.
  y.attention_factor = None if y.factor > 1 else 0.1 * math.log(y.factor) + 1.0
  # The ramp's top: OLMo-core clamps it at head_dim/2 - 1, HF and model.py at head_dim - 1.
  k = m.head_dim
  top = math.ceil(k * math.log(y.original_max_position / (y.beta_slow * 2 * math.pi))
                  / (2 * math.log(m.rope_theta)))
  if top > k // 2 - 1:
    raise OlmoCoreCheckpointError(f'YaRN with head_dim {k}, theta {m.rope_theta:g}, '
                                  f'beta_slow {y.beta_slow:g}: OLMo-core and HF clamp the ramp '
                                  'differently here, so model.yarn cannot match it.')


def _translate_schedule(sched: dict, o: ml_collections.ConfigDict, steps: int) -> None:
  kind = str(sched.get('_CLASS_', '')).rsplit('.', 1)[-1]
  if not kind:
    return
  warmup = sched.get('warmup') if sched.get('warmup') is not None else sched.get('warmup_steps')
  t_max = sched.get('t_max') or steps
  if sched.get('units', 'steps') != 'steps' or warmup is None:
    raise OlmoCoreCheckpointError(f'scheduler {sched}: only step-based warmups translate.')
  o.final_lr = o.lr * sched.get('alpha_f', 0.1)
  if kind == 'CosWithWarmup':
    o.schedule, o.warmup_steps, o.t_max = 'cosine', warmup, t_max
  elif kind == 'LinearWithWarmup':
    o.schedule, o.warmup_steps, o.t_max = 'linear', warmup, t_max
  elif kind == 'HalfCosWithWarmup':  # Ai2's stage-1 part 2; part 1 keeps the 7B recipe's
    o.schedule, o.part2_warmup, o.part2_t_max = 'olmo3_stitched', warmup, t_max
  else:
    raise OlmoCoreCheckpointError(f'scheduler {kind} has no equivalent in optim.SCHEDULES; '
                                  'pass --config with the schedule to use.')


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
           'fingerprint_version': dl.get('dataset_fingerprint_version', data.FINGERPRINT_VERSION),
           'tokens_processed': int(dl.get('tokens_processed', 0))}
  if dl.get('tokens_processed') and state['step'] and (
      dl['tokens_processed'] != state['step'] * cfg.data.global_batch_size * seq_len):
    raise OlmoCoreCheckpointError(
        f"the trainer state has {dl['tokens_processed']} tokens in {state['step']} batches, not "
        f'{cfg.data.global_batch_size} x {seq_len} per batch; set data.global_batch_size to '
        "the run's.")
  return state


# --- OLMo-core -> ours ------------------------------------------------------------------------


def _decay_settings(reader: Reader, cfg: ml_collections.ConfigDict) -> None:
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


def adam_count(reader: Reader, num_layers: int) -> int | None:
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


def _stacked(reader: Reader, num_layers: int, source: str | None, key: tuple[str, str],
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
  convert.check_destination(out_dir, overwrite)
  config_path = os.path.join(step_dir, 'config.json')
  if not os.path.exists(config_path):
    raise OlmoCoreCheckpointError(f'{config_path} is missing: the model shape is read from it.')
  paths_file = os.path.join(step_dir, 'data_paths.txt')
  data_paths = (open(paths_file).read().split() if os.path.exists(paths_file) else [])
  translated = config_from_olmo_core(_read_json(config_path), data_paths)
  inner = os.path.join(step_dir, 'model_and_optim')
  reader = Reader(inner if os.path.isdir(inner) else step_dir)  # weights-only: top level
  trainer = read_trainer_state(step_dir)
  m = translated.model
  missing = [f'model.{f}' for f, _, _ in tensor_names(m.num_layers) if f'model.{f}' not in reader]
  if missing:
    raise OlmoCoreCheckpointError(f'{reader.directory} lacks {len(missing)} weights, e.g. '
                                  f'{missing[:3]}; it is not an Olmo 3 of this config.json.')
  count = adam_count(reader, m.num_layers)
  _decay_settings(reader, translated)
  cfg = translated if base is None else _checked_base(base, translated)
  step = int(trainer['global_step']) if trainer else 0
  if count is None:
    logging.warning('%s has no optimizer state (weights only): the AdamW moments and count '
                    'start at zero.', step_dir)
  logging.info('OLMo-core trainer step %d, Adam count %s; the skip-step history starts empty '
               '(OLMo-core does not save it either).', step, count)
  meta = {'config': cfg.to_dict(), 'olmo_core_source': {
      'path': os.path.abspath(step_dir), 'global_step': step, 'adam_count': count,
      'config': _read_json(config_path)}}
  if trainer:
    meta['data'] = loader_state(trainer, cfg)
    meta['data']['global_train_tokens_seen'] = int(trainer.get('global_train_tokens_seen', 0))
  _write(reader, cfg, out_dir, step, count, meta, overwrite)
  return {'step': step, 'adam_count': count, 'config': cfg, 'moments': count is not None}


# What must agree between --config and the OLMo-core run for train.py to continue that run:
# the weights' shapes and function, and the data order (batch, length, seed). Not
# model.sliding_window_plus_one: config.json cannot say it (it is the OLMo-core version's
# window semantics, docs/architecture.md), so --config's is taken, and logged.
RUN_FIELDS = (*(('model', f) for f in model.ARCHITECTURE_FIELDS),
              ('data', 'global_batch_size'), ('data', 'seq_len'), ('data', 'seed'))


def _checked_base(base: ml_collections.ConfigDict, translated: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """The user's --config (stored as the run's), refused where it is not the OLMo-core run.

  The data files are the user's to name (a mix file and base_dir rather than the
  step's data_paths.txt); the dataset fingerprint in the data position still
  refuses other files or another order when train.py resumes.
  """
  wrong = [f'{g}.{f}={base[g][f]!r} (the checkpoint\'s config.json says {translated[g][f]!r})'
           for g, f in RUN_FIELDS if base[g][f] != translated[g][f]]
  if base.model.yarn.to_dict() != translated.model.yarn.to_dict():
    wrong.append(f'model.yarn={base.model.yarn.to_dict()} (config.json: '
                 f'{translated.model.yarn.to_dict()})')
  if wrong:
    raise OlmoCoreCheckpointError(
        f'--config does not describe the OLMo-core run: {"; ".join(wrong)}. Set those '
        '--config.* values to the checkpoint\'s, or use the config convert.py writes without '
        '--config.')
  if base.model.sliding_window_plus_one:
    logging.warning('--config has model.sliding_window_plus_one=True: the windows see W + 1 '
                    'keys, as OLMo-core before August 2025 (config.json cannot say which).')
  for group in ('opt', 'train'):
    for key, value in translated[group].items():
      plain = lambda v: v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v
      if key in base[group] and json.dumps(plain(base[group][key])) != json.dumps(plain(value)):
        logging.warning('--config has %s.%s=%r, the OLMo-core run %r; the run continues with '
                        '--config\'s.', group, key, base[group][key], value)
  return base


def _write(reader: Reader, cfg, out_dir: str, step: int, count: int | None, meta: dict,
           overwrite: bool) -> None:
  m = cfg.model
  shapes = convert._shapes(m)  # pylint: disable=protected-access
  arrays = []
  moments = count is not None
  for prefix, source in (('params', 'model.{}'),
                         ('opt_state/mu', 'optim.state.{}.exp_avg' if moments else None),
                         ('opt_state/nu', 'optim.state.{}.exp_avg_sq' if moments else None)):
    for key in sorted(shapes):
      shape = shapes[key] if key in GLOBAL.values() else (m.num_layers, *shapes[key])
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
  out_dir = os.path.abspath(out_dir)
  staging = os.path.join(os.path.dirname(out_dir),
                         f'.{os.path.basename(out_dir)}.convert-{secrets.token_hex(4)}')
  try:
    checkpoint.save_streamed(staging, step, arrays, meta)
    convert._install(staging, out_dir, step)  # pylint: disable=protected-access
  finally:
    shutil.rmtree(staging, ignore_errors=True)


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
  import download  # pylint: disable=import-outside-toplevel  # only the URL path needs it
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
    _checked_base(base, config_from_olmo_core(_read_json(os.path.join(local, 'config.json')),
                                              []))
  files = Reader(os.path.join(local, 'model_and_optim')).files()
  download.fetch([item(f'model_and_optim/{f}') for f in files], **kwargs)
  return local


# --- Ours -> OLMo-core ------------------------------------------------------------------------


def export_step(ckpt_dir: str, out_dir: str, *, step: int | None = None) -> int:
  """Writes our checkpoint as an OLMo-core step directory that its Trainer loads (load_path).

  Returns the step written. Built beside `out_dir` and renamed into place.
  """
  torch = _torch()
  from torch.distributed.checkpoint import metadata as dcp  # pylint: disable=import-outside-toplevel
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
  decayed = {f'{k[0]}/{k[1]}': not any(re.fullmatch(p, f'{k[0]}/{k[1]}')
                                        for p in cfg.opt.no_decay)
             for k in convert._shapes(m)}  # pylint: disable=protected-access

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
          shape = convert._shapes(m)[key]  # pylint: disable=protected-access
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
      json.dump(olmo_core_config(cfg), f)
    with open(os.path.join(tmp, 'data_paths.txt'), 'w') as f:
      f.write('\n'.join(p for p, _ in meta['data'].get('files', [])))
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
  state = {
      'global_step': step,
      'global_train_tokens_seen': loader.get('global_train_tokens_seen', tokens),
      'max_steps': int(cfg.train.steps), 'epoch': loader['epoch'],
      # No RNG state: Olmo 3 training draws no random numbers (no dropout), and a world
      # size no run has makes OLMo-core skip restoring it.
      'world_size': 0, 'rng': {}, 'callbacks': {},
      'data_loader': {
          'dataset_fingerprint_version': loader.get('fingerprint_version',
                                                    data.FINGERPRINT_VERSION),
          'dataset_fingerprint': loader['fingerprint'],
          'batches_processed': loader['step'],
          'tokens_processed': loader['step'] * cfg.data.global_batch_size * cfg.data.seq_len,
          'seed': loader['seed'], 'epoch': loader['epoch'], 'dataset_type': 'fsl',
          'sequence_length': cfg.data.seq_len,
          'max_target_sequence_length': cfg.data.get('max_target_sequence_length', -1)
          if cfg.data.get('max_target_sequence_length', -1) != -1 else cfg.data.seq_len}}
  os.makedirs(os.path.join(step_dir, 'train'))
  torch.save(state, os.path.join(step_dir, 'train', 'rank0.pt'))


def olmo_core_config(cfg) -> dict:
  """The parts of an OLMo-core experiment config that config_from_olmo_core reads back."""
  m, d, o = cfg.model, cfg.data, cfg.opt
  pattern = [m.sliding_window + int(m.sliding_window_plus_one) if c == 'S' else -1
             for c in m.layer_pattern]
  sched = {'cosine': 'CosWithWarmup', 'linear': 'LinearWithWarmup',
           'olmo3_stitched': 'HalfCosWithWarmup'}.get(o.schedule)
  block = {'name': 'reordered_norm',
           'sequence_mixer': {'n_heads': m.num_heads, 'n_kv_heads': m.num_kv_heads,
                              'rope': {'theta': m.rope_theta},
                              'sliding_window': {'pattern': pattern,
                                                 'force_full_attention_on_first_layer': False,
                                                 'force_full_attention_on_last_layer': False}},
           'feed_forward': {'hidden_size': m.mlp_hidden}, 'layer_norm': {'eps': m.norm_eps}}
  overrides = None
  if m.yarn.enabled:  # as with_rope_scaling(YaRN) writes it: full-attention layers only
    scaled = json.loads(json.dumps(block))
    scaled['sequence_mixer']['rope']['scaling'] = {
        '_CLASS_': 'olmo_core.nn.rope.YaRNRoPEScalingConfig', 'factor': m.yarn.factor,
        'beta_fast': m.yarn.beta_fast, 'beta_slow': m.yarn.beta_slow,
        'old_context_len': m.yarn.original_max_position}
    overrides = {str(i): scaled for i in range(m.num_layers)
                 if m.layer_pattern[i % len(m.layer_pattern)] == 'F'}
  return {
      'model': {'d_model': m.d_model, 'n_layers': m.num_layers, 'vocab_size': m.vocab_size,
                'block': block, 'block_overrides': overrides},
      'dataset': {'sequence_length': d.seq_len,
                  'tokenizer': {'vocab_size': d.vocab_size, 'eos_token_id': d.eos_token_id,
                                'pad_token_id': d.pad_token_id}},
      'data_loader': {'global_batch_size': d.global_batch_size * d.seq_len, 'seed': d.seed},
      'train_module': {
          'optim': {'_CLASS_': 'olmo_core.optim.adamw.SkipStepAdamWConfig', 'lr': o.lr,
                    'betas': [o.b1, o.b2], 'eps': o.eps, 'weight_decay': o.weight_decay,
                    'rolling_interval_length': o.skip_window, 'sigma_factor': o.skip_sigma},
          'max_grad_norm': o.clip_grad_norm, 'z_loss_multiplier': o.z_loss,
          'scheduler': sched and {
              '_CLASS_': f'olmo_core.optim.scheduler.{sched}', 'units': 'steps',
              'warmup': o.part2_warmup if sched == 'HalfCosWithWarmup' else o.warmup_steps,
              'alpha_f': o.final_lr / o.lr,
              't_max': o.part2_t_max if sched == 'HalfCosWithWarmup' else o.t_max}},
      'trainer': {'max_duration': {'value': int(cfg.train.steps), 'unit': 'steps'}},
  }
