"""Olmo 3 weights between HF safetensors directories and our params.

    python convert.py --from_hf=HF_DIR --to=CKPT_DIR [--overwrite]   # HF -> our checkpoint
    python convert.py --from_ckpt=CKPT_DIR --to_hf=HF_DIR             # our checkpoint -> HF
    python convert.py --from_olmo_core=STEP_DIR_OR_URL --to=CKPT_DIR   # OLMo-core -> ours
        [--config=configs/olmo3_7b.py --config.data.mix_file=MIX ...]  # the run's config
    python convert.py --from_ckpt=CKPT_DIR --to_olmo_core=STEP_DIR     # ours -> OLMo-core

The OLMo-core formats (weights, AdamW moments, step, data position) live in
olmo_core_ckpt.py; they need torch: pip install '.[olmo-core]'. With --config the
converted checkpoint stores that config (checked against the step's config.json:
architecture, batch, sequence length, data seed), so train.py with the same
--config resumes it; without, it stores config.json translated.

Tensors are streamed one at a time from memory-mapped safetensors into the
stacked [L, ...] arrays of model.py (and back, one output shard at a time), so
converting a 7B model needs about one copy of the weights in host memory.

A checkpoint converted from HF keeps its source: the metadata's `hf_source`
holds the config.json and generation_config.json as read (vocabulary, token
ids, dtype, context length), and step_0/hf_files/ the tokenizer files. The
export writes them back, so HF -> checkpoint -> HF gives the same model. A
train.py checkpoint exports its data config's vocabulary and token ids, and
the run's tokenizer (--tokenizer, default the embedded one when its
vocabulary is the run's) with a tokenizer_config.json naming EOS and PAD.

The checkpoint is built beside CKPT_DIR and moved in whole; one that is
already there is replaced only with --overwrite, by an atomic exchange of the
two directories, so a crash leaves the old checkpoint or the new, never a mix.

HF config dialects read (docs/architecture.md):
  hub:    top-level `rope_theta`, `rope_scaling`, `layer_types`, `sliding_window`
  nested: `rope_parameters` = {'full_attention': {...}, 'sliding_attention': {...}}
          (what transformers >= 5.13 `save_pretrained` writes)
  flat:   `rope_parameters` = {'rope_type': ..., 'rope_theta': ...} (5.0-5.12);
          its YaRN is read as full-layers-only, Olmo 3's real semantics.
We write the hub dialect, which transformers 4.57 and >= 5.13 both read right.
"""

import ctypes
import errno
import json
import logging
import math
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator

from absl import app, flags
import jax
import ml_collections
from ml_collections import config_flags
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

import checkpoint
from configs import olmo3_7b
import guards
import model

# HF tensor name for layer i -> (our module, our name); HF Linear weights are
# [out, in] and ours [in, out]; the embedding is [V, D] on both sides.
LAYER_TENSORS = {
    'self_attn.q_proj.weight': ('attention', 'w_q'),
    'self_attn.k_proj.weight': ('attention', 'w_k'),
    'self_attn.v_proj.weight': ('attention', 'w_v'),
    'self_attn.o_proj.weight': ('attention', 'w_o'),
    'self_attn.q_norm.weight': ('attention', 'q_norm'),
    'self_attn.k_norm.weight': ('attention', 'k_norm'),
    'post_attention_layernorm.weight': ('attention_norm', 'scale'),
    'mlp.gate_proj.weight': ('mlp', 'w_gate'),
    'mlp.up_proj.weight': ('mlp', 'w_up'),
    'mlp.down_proj.weight': ('mlp', 'w_down'),
    'post_feedforward_layernorm.weight': ('mlp_norm', 'scale'),
}
GLOBAL_TENSORS = {
    'model.embed_tokens.weight': ('embed', 'embedding'),
    'model.norm.weight': ('final_norm', 'scale'),
    'lm_head.weight': ('lm_head', 'w'),
}
_VOCAB_ROWS = {('embed', 'embedding'): 0, ('lm_head', 'w'): 1}  # axis of the vocab, ours
_REQUIRED_CONFIG = ('num_hidden_layers', 'hidden_size', 'num_attention_heads',
                    'intermediate_size', 'vocab_size')
DTYPES = {'float32': np.float32, 'bfloat16': ml_dtypes.bfloat16, 'float16': np.float16}
# Files beside HF weights that describe the tokenizer; kept in step_0/HF_FILES.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'vocab.json', 'merges.txt', 'added_tokens.json', 'tokenizer.model',
                   'chat_template.jinja', 'chat_template.json')
HF_FILES = 'hf_files'
EMBEDDED_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data',
                                  'tokenizer.json')
# What a checkpoint directory may hold (checkpoint.py and train.py names); --overwrite
# replaces the whole directory, so anything else in it is refused rather than deleted.
_CHECKPOINT_ENTRY = re.compile(r'^(step_\d+|tmp\.step_.+|corrupt\.step_.+)$')
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _transposed(key: tuple[str, str], value: np.ndarray) -> np.ndarray:
  """HF layout <-> ours: transpose every 2-D weight except the embedding table."""
  return value.T if value.ndim == 2 and key != ('embed', 'embedding') else value


class ConversionError(ValueError):
  """Config and weights do not describe the same Olmo 3 model."""


# --- Config --------------------------------------------------------------------


def _rope_settings(hf: dict) -> tuple[float, dict | None]:
  """(rope_theta, yarn dict or None) from any of the three dialects."""
  params = hf.get('rope_parameters')
  if params is None:  # hub dialect
    return float(hf.get('rope_theta', 500_000.0)), hf.get('rope_scaling')
  if 'full_attention' in params or 'sliding_attention' in params:  # nested
    full = params.get('full_attention') or {}
    sliding = params.get('sliding_attention') or {}
    thetas = {float(p['rope_theta']) for p in (full, sliding) if 'rope_theta' in p}
    if len(thetas) > 1:
      raise ConversionError(f'rope_theta differs between layer types ({thetas}); '
                            'this model uses one theta for all layers')
    if sliding.get('rope_type', 'default') != 'default':
      raise ConversionError(f"sliding layers use rope_type {sliding['rope_type']!r}; "
                            'Olmo 3 keeps plain RoPE on sliding layers')
    return (thetas.pop() if thetas else 500_000.0), full
  logging.warning('Flat rope_parameters (transformers 5.0-5.12 dialect): reading '
                  'any YaRN as full-attention-layers only, as Olmo 3 defines it.')
  return float(params.get('rope_theta', 500_000.0)), params


def model_config_from_hf(hf: dict, pad_vocab_to: int = 128) -> ml_collections.ConfigDict:
  """Our model config (7B defaults for what HF does not say) from an HF config dict."""
  if hf.get('model_type') != 'olmo3':
    raise ConversionError(f"model_type is {hf.get('model_type')!r}, expected 'olmo3'")
  missing = [k for k in _REQUIRED_CONFIG if k not in hf]
  if missing:
    raise ConversionError(f'config.json lacks {missing}; restore the HF original.')
  m = olmo3_7b.model_config()
  m.num_layers = hf['num_hidden_layers']
  m.d_model = hf['hidden_size']
  m.num_heads = hf['num_attention_heads']
  m.num_kv_heads = hf.get('num_key_value_heads') or m.num_heads
  m.head_dim = hf.get('head_dim') or m.d_model // m.num_heads
  m.mlp_hidden = hf['intermediate_size']
  m.norm_eps = hf.get('rms_norm_eps', 1e-6)
  m.vocab_size = -(-hf['vocab_size'] // pad_vocab_to) * pad_vocab_to
  if hf.get('tie_word_embeddings'):
    raise ConversionError('tie_word_embeddings=true, but Olmo 3 has an untied head')
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ConversionError(f"hidden_act={hf['hidden_act']!r}; Olmo 3 uses silu")

  layer_types = hf.get('layer_types') or [
      'full_attention' if (i + 1) % 4 == 0 else 'sliding_attention'
      for i in range(m.num_layers)]
  if len(layer_types) != m.num_layers:
    raise ConversionError(f'layer_types has {len(layer_types)} entries but '
                          f'num_hidden_layers={m.num_layers}')
  m.layer_pattern = _periodic_pattern(layer_types)
  m.sliding_window = hf.get('sliding_window') or m.sliding_window
  m.sliding_window_plus_one = False  # HF: query i sees (i-W, i]

  m.rope_theta, scaling = _rope_settings(hf)
  rope_type = (scaling or {}).get('rope_type', (scaling or {}).get('type', 'default'))
  m.yarn.enabled = rope_type == 'yarn'
  if m.yarn.enabled:
    m.yarn.factor = float(scaling['factor'])
    m.yarn.original_max_position = int(scaling['original_max_position_embeddings'])
    m.yarn.beta_fast = float(scaling.get('beta_fast') or 32.0)
    m.yarn.beta_slow = float(scaling.get('beta_slow') or 1.0)
    if scaling.get('attention_factor') is not None:
      m.yarn.attention_factor = float(scaling['attention_factor'])
  elif rope_type != 'default':
    raise ConversionError(f'rope_type {rope_type!r} is not supported (default or yarn)')
  return m


def _periodic_pattern(layer_types: list[str]) -> str:
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


def hf_config(cfg: ml_collections.ConfigDict, vocab_size: int, *,
              eos_token_id: int | None = None, pad_token_id: int | None = None,
              dtype: str = 'float32') -> dict:
  """An HF config.json dict in the hub dialect."""
  pattern = cfg.layer_pattern * (cfg.num_layers // len(cfg.layer_pattern))
  names = {'S': 'sliding_attention', 'F': 'full_attention'}
  if cfg.sliding_window_plus_one:
    raise ConversionError('HF Olmo 3 has no W+1 sliding window; export with '
                          'sliding_window_plus_one=False (or sliding_window+1)')
  rope_scaling = None
  max_positions = 8192  # stage-1/2 sequence length
  if cfg.yarn.enabled:
    y = cfg.yarn
    rope_scaling = {'rope_type': 'yarn', 'factor': y.factor,
                    'original_max_position_embeddings': y.original_max_position,
                    'beta_fast': y.beta_fast, 'beta_slow': y.beta_slow}
    if y.attention_factor is not None:
      rope_scaling['attention_factor'] = y.attention_factor
    max_positions = int(y.original_max_position * y.factor)
  return {
      'architectures': ['Olmo3ForCausalLM'], 'model_type': 'olmo3',
      'vocab_size': vocab_size, 'hidden_size': cfg.d_model,
      'intermediate_size': cfg.mlp_hidden, 'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads, 'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim, 'hidden_act': 'silu', 'rms_norm_eps': cfg.norm_eps,
      'max_position_embeddings': max_positions, 'rope_theta': cfg.rope_theta,
      'rope_scaling': rope_scaling, 'layer_types': [names[c] for c in pattern],
      'sliding_window': cfg.sliding_window, 'attention_bias': False,
      'attention_dropout': 0.0, 'tie_word_embeddings': False, 'use_cache': True,
      'bos_token_id': None, 'eos_token_id': eos_token_id, 'pad_token_id': pad_token_id,
      'initializer_range': cfg.init_std, 'dtype': dtype,
  }


# --- Weights -----------------------------------------------------------------------


def _shapes(cfg: ml_collections.ConfigDict) -> dict[tuple[str, str], tuple[int, ...]]:
  """Our per-layer (without L) and global shapes."""
  D, F = cfg.d_model, cfg.mlp_hidden
  HK, GK = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {
      ('attention', 'w_q'): (D, HK), ('attention', 'w_k'): (D, GK),
      ('attention', 'w_v'): (D, GK), ('attention', 'w_o'): (HK, D),
      ('attention', 'q_norm'): (HK,), ('attention', 'k_norm'): (GK,),
      ('attention_norm', 'scale'): (D,), ('mlp', 'w_gate'): (D, F),
      ('mlp', 'w_up'): (D, F), ('mlp', 'w_down'): (F, D), ('mlp_norm', 'scale'): (D,),
      ('embed', 'embedding'): (cfg.vocab_size, D), ('final_norm', 'scale'): (D,),
      ('lm_head', 'w'): (D, cfg.vocab_size),
  }


def _weight_files(directory: str) -> dict[str, str]:
  """HF tensor name -> safetensors file, for a single file or a sharded index."""
  index = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  single = os.path.join(directory, 'model.safetensors')
  if not os.path.exists(single):
    raise FileNotFoundError(f'No model.safetensors or model.safetensors.index.json in '
                            f'{directory}; is it an HF model directory?')
  with safe_open(single, framework='np') as f:
    return {name: single for name in f.keys()}


def load_hf(directory: str, *, pad_vocab_to: int = 128, dtype=np.float32
            ) -> tuple[dict, ml_collections.ConfigDict]:
  """Reads an HF Olmo 3 directory into (params as numpy, model config)."""
  config_path = os.path.join(directory, 'config.json')
  if not os.path.exists(config_path):
    raise FileNotFoundError(f'{config_path} not found; is {directory} an HF model directory?')
  cfg = model_config_from_hf(read_json(config_path), pad_vocab_to)
  files = _weight_files(directory)
  shapes = _shapes(cfg)
  expected = set(GLOBAL_TENSORS) | {f'model.layers.{i}.{name}'
                                    for i in range(cfg.num_layers) for name in LAYER_TENSORS}
  missing = sorted(expected - set(files))
  if missing:
    raise ConversionError(f'{directory}: {len(missing)} tensors missing, e.g. {missing[:3]}')
  unknown = sorted(set(files) - expected)
  if unknown:
    raise ConversionError(f'{directory}: unexpected tensors {unknown[:3]}; not an Olmo 3 '
                          'checkpoint with this config.json')

  params: dict[str, dict[str, np.ndarray]] = {}
  for (module, name), shape in shapes.items():
    full = shape if (module, name) in GLOBAL_TENSORS.values() else (cfg.num_layers, *shape)
    # Pad vocab rows are zero: they never appear as inputs, and their logits
    # are sliced off wherever HF numbers are compared.
    params.setdefault(module, {})[name] = np.zeros(full, dtype)

  for file, names in _by_file(files):
    with safe_open(file, framework='np') as f:
      for name in names:
        _place(params, shapes, name, f.get_tensor(name))
  return params, cfg


def _by_file(files: dict[str, str]) -> Iterator[tuple[str, list[str]]]:
  """Groups tensor names by file so each file is opened once."""
  grouped: dict[str, list[str]] = {}
  for name, file in files.items():
    grouped.setdefault(file, []).append(name)
  for file, names in sorted(grouped.items()):
    yield file, sorted(names)


def _place(params: dict, shapes: dict, hf_name: str, tensor: np.ndarray) -> None:
  """Writes one HF tensor (transposed to [in, out]) into our stacked arrays."""
  if hf_name in GLOBAL_TENSORS:
    key, layer = GLOBAL_TENSORS[hf_name], None
  else:
    _, _, index, rest = hf_name.split('.', 3)
    key, layer = LAYER_TENSORS[rest], int(index)
  value = _transposed(key, tensor)
  target = params[key[0]][key[1]]
  want = shapes[key]
  if key in _VOCAB_ROWS:
    axis = _VOCAB_ROWS[key]
    if value.shape[1 - axis] != want[1 - axis] or value.shape[axis] > want[axis]:
      raise ConversionError(f'{hf_name}: shape {tensor.shape} does not fit our {want}')
    index = (slice(0, value.shape[0]), slice(0, value.shape[1]))
    target[index] = value
    return
  if value.shape != want:
    raise ConversionError(f'{hf_name}: shape {tensor.shape} (HF) but config.json implies '
                          f'{want[::-1] if len(want) == 2 else want}')
  if layer is None:
    target[...] = value
  else:
    target[layer] = value


def save_hf(params: dict, cfg: ml_collections.ConfigDict, directory: str, *,
            vocab_size: int | None = None, dtype: str = 'float32',
            max_shard_bytes: int = 5 << 30, eos_token_id: int | None = None,
            pad_token_id: int | None = None, config: dict | None = None) -> None:
  """Writes params as an HF directory: sharded safetensors, index, config.json.

  vocab_size: HF rows to keep (e.g. 100278 for the dolma2 tokenizer); None
  keeps all rows, which makes params -> HF -> params exact. config: the
  config.json to write (default: hf_config of cfg with the given ids).
  """
  np_dtype = DTYPES[dtype]
  vocab_size = vocab_size or cfg.vocab_size
  if vocab_size > cfg.vocab_size:
    raise ConversionError(f'vocab_size={vocab_size} exceeds the model vocab {cfg.vocab_size}')
  os.makedirs(directory, exist_ok=True)
  names = [(name, key, None) for name, key in GLOBAL_TENSORS.items()]
  names += [(f'model.layers.{i}.{name}', key, i)
            for i in range(cfg.num_layers) for name, key in LAYER_TENSORS.items()]

  def tensor(key, layer):
    value = np.asarray(params[key[0]][key[1]] if layer is None
                       else params[key[0]][key[1]][layer])
    if key in _VOCAB_ROWS:
      value = np.take(value, np.arange(vocab_size), axis=_VOCAB_ROWS[key])
    return np.ascontiguousarray(_transposed(key, value).astype(np_dtype))

  shards, current, size = [], [], 0
  for entry in names:
    nbytes = math.prod(np.shape(params[entry[1][0]][entry[1][1]])) * np.dtype(np_dtype).itemsize
    nbytes //= 1 if entry[2] is None else cfg.num_layers
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(entry)
    size += nbytes
  shards.append(current)

  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    file = (f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' if len(shards) > 1
            else 'model.safetensors')
    tensors = {name: tensor(key, layer) for name, key, layer in shard}
    total += sum(t.nbytes for t in tensors.values())
    save_file(tensors, os.path.join(directory, file), metadata={'format': 'pt'})
    weight_map.update({name: file for name in tensors})
    del tensors
  if len(shards) > 1:
    _write_json(os.path.join(directory, 'model.safetensors.index.json'),
                {'metadata': {'total_size': total}, 'weight_map': weight_map})
  if config is None:
    config = hf_config(cfg, vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                       dtype=dtype)
  _write_json(os.path.join(directory, 'config.json'), config)


# --- Our checkpoints ---------------------------------------------------------------


def params_target(cfg: ml_collections.ConfigDict) -> dict:
  """Host zero arrays shaped like model.init_params (a restore target; no memory touched)."""
  shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)


def load_checkpoint_params(directory: str, step: int | None = None
                           ) -> tuple[dict, ml_collections.ConfigDict]:
  """(params as numpy, full config) of a committed checkpoint; reads only the params."""
  meta = checkpoint.read_metadata(directory, step)
  if 'config' not in meta:
    raise ConversionError(f'{directory}: checkpoint metadata has no "config"; '
                          'was it written by train.py or convert.py?')
  cfg = ml_collections.ConfigDict(meta['config'])
  params, _ = checkpoint.restore(directory, params_target(cfg.model), step, subtree='params')
  return params, cfg


def read_hf_source(directory: str) -> dict:
  """What a checkpoint keeps of its HF source, so that the export can write it back."""
  config = read_json(os.path.join(directory, 'config.json'))
  generation = os.path.join(directory, 'generation_config.json')
  return {'path': os.path.abspath(directory), 'config': config,
          'generation_config': read_json(generation) if os.path.exists(generation) else None,
          'vocab_size': config['vocab_size'], 'eos_token_id': config.get('eos_token_id'),
          'pad_token_id': config.get('pad_token_id'), 'bos_token_id': config.get('bos_token_id'),
          'dtype': config.get('dtype') or config.get('torch_dtype'),
          'max_position_embeddings': config.get('max_position_embeddings'),
          'files': [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]}


def check_destination(directory: str, overwrite: bool) -> None:
  """Refuses a --to that holds a checkpoint (unless overwrite) or that overwrite would harm."""
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise FileExistsError(f'{directory} is a file, not a checkpoint directory; choose another '
                          '--to.')
  steps = checkpoint.committed_steps(directory)
  if steps and not overwrite:
    raise FileExistsError(f'{directory} already holds a checkpoint (steps {steps}); converting '
                          'into it would leave that one in place. Pass --overwrite to replace it '
                          '(it is kept until the new one is complete), or choose another --to.')
  foreign = steps and sorted(n for n in os.listdir(directory) if not _CHECKPOINT_ENTRY.match(n))
  if foreign:
    raise FileExistsError(f'{directory} holds {foreign[:5]} besides its checkpoints, and '
                          '--overwrite replaces the whole directory; move them out, or choose '
                          'another --to.')


def save_checkpoint_params(params: dict, cfg: ml_collections.ConfigDict, directory: str, *,
                           hf_source: dict | None = None, overwrite: bool = False) -> None:
  """Writes params as step_0 of a checkpoint directory (usable as train.init_from).

  The checkpoint is built in a sibling directory and moved in whole, so a crash
  leaves no partial one. A directory that already holds a checkpoint is
  refused, or with `overwrite` exchanged for the new one in one rename.
  `hf_source` (read_hf_source) goes into the metadata, its tokenizer files into
  step_0/hf_files/.
  """
  check_destination(directory, overwrite)
  directory = os.path.abspath(directory)
  staging = os.path.join(os.path.dirname(directory),
                         f'.{os.path.basename(directory)}.convert-{secrets.token_hex(4)}')
  metadata = {'config': {'model': cfg.to_dict()}}
  if hf_source is not None:
    metadata['hf_source'] = hf_source
  try:
    with checkpoint.Checkpointer(staging) as ckpt:
      ckpt.save(0, {'params': params}, metadata)
    if hf_source and hf_source['files']:
      _copy_files(hf_source['path'], hf_source['files'], os.path.join(staging, 'step_0', HF_FILES))
    _install(staging, directory)
  finally:
    shutil.rmtree(staging, ignore_errors=True)  # after an exchange: the old checkpoint


def _install(staging: str, directory: str, step: int = 0) -> None:
  """Moves the checkpoint built in `staging` to `directory`; `staging` then holds the old one."""
  if not checkpoint.committed_steps(directory):  # nothing to replace: move step_<step> in
    os.makedirs(directory, exist_ok=True)
    leftover = os.path.join(directory, f'step_{step}')
    if os.path.isdir(leftover):  # a save that never committed
      shutil.rmtree(leftover)
    os.rename(os.path.join(staging, f'step_{step}'), leftover)
    return
  if _exchange(staging, directory):
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


def _exchange(a: str, b: str) -> bool:
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


# --- Export ------------------------------------------------------------------------


def export_hf(ckpt_dir: str, out: str, *, step: int | None = None, dtype: str | None = None,
              vocab_size: int | None = None, tokenizer: str | None = None) -> str:
  """Writes a checkpoint as an HF directory with its config, generation config and tokenizer.

  dtype defaults to the HF source's when the checkpoint has one, else float32;
  vocab_size to the source's or the run's data config. Returns the dtype used.
  """
  step = checkpoint.latest_step(ckpt_dir) if step is None else step
  params, full = load_checkpoint_params(ckpt_dir, step)
  source = checkpoint.read_metadata(ckpt_dir, step).get('hf_source')
  dtype = dtype or _source_dtype(source)
  config = export_config(full, source, vocab_size=vocab_size, dtype=dtype)
  save_hf(params, full.model, out, vocab_size=config['vocab_size'], dtype=dtype, config=config)
  _write_json(os.path.join(out, 'generation_config.json'),
              (source or {}).get('generation_config') or _generation_config(config))
  if tokenizer is None and source and source['files']:
    step_dir = os.path.join(ckpt_dir, f'step_{step}', HF_FILES)
    _copy_files(step_dir, source['files'], out)
  else:
    tokenizer = tokenizer or _run_tokenizer(config['vocab_size'])
    if tokenizer:
      _write_tokenizer(tokenizer, config, out)
    else:
      logging.warning('No tokenizer written to %s: pass --tokenizer=PATH/tokenizer.json.', out)
  return dtype


def export_config(full: ml_collections.ConfigDict, source: dict | None, *,
                  vocab_size: int | None = None, dtype: str = 'float32') -> dict:
  """config.json for an export: the HF source's own, else built from the run's config."""
  if source:  # checksummed with the weights it describes (checkpoint metadata)
    config = dict(source['config'])
  else:
    data_cfg = full.get('data', {})
    config = hf_config(full.model, data_cfg.get('vocab_size') or full.model.vocab_size,
                       eos_token_id=data_cfg.get('eos_token_id'),
                       pad_token_id=data_cfg.get('pad_token_id'))
  config['vocab_size'] = vocab_size or config['vocab_size']
  config['dtype'] = dtype
  if 'torch_dtype' in config:  # transformers 4.x's name for it
    config['torch_dtype'] = dtype
  return config


def _source_dtype(source: dict | None) -> str:
  """The HF source's dtype where it is one we write, else float32 (never silently less)."""
  dtype = (source or {}).get('dtype')
  if dtype in DTYPES:
    return dtype
  if dtype:
    logging.warning('The HF source was %s; exporting float32 (pass --dtype to choose).', dtype)
  return 'float32'


def _generation_config(config: dict) -> dict:
  ids = {k: config.get(k) for k in ('bos_token_id', 'eos_token_id', 'pad_token_id')}
  return {'_from_model_config': True, **{k: v for k, v in ids.items() if v is not None}}


def _run_tokenizer(vocab_size: int) -> str | None:
  """The embedded tokenizer when the run's vocabulary is its (the small configs)."""
  if Tokenizer.from_file(EMBEDDED_TOKENIZER).get_vocab_size() == vocab_size:
    return EMBEDDED_TOKENIZER
  return None


def _write_tokenizer(path: str, config: dict, out: str) -> None:
  """tokenizer.json plus a tokenizer_config.json naming its special tokens by the config's ids."""
  tok = Tokenizer.from_file(path)
  special = {}
  for name in ('bos', 'eos', 'pad'):
    token_id = config.get(f'{name}_token_id')
    token_id = token_id[0] if isinstance(token_id, list) else token_id
    if token_id is None:
      continue
    special[f'{name}_token'] = tok.id_to_token(token_id)
    if special[f'{name}_token'] is None:
      raise ConversionError(f'{path} has no token {token_id} ({name}_token_id); it is not the '
                            "run's tokenizer. Pass the right one with --tokenizer=PATH.")
  shutil.copyfile(path, os.path.join(out, 'tokenizer.json'))
  _write_json(os.path.join(out, 'tokenizer_config.json'), {
      'tokenizer_class': 'PreTrainedTokenizerFast', **special,
      'model_max_length': config['max_position_embeddings'],
      'clean_up_tokenization_spaces': False})


# --- Files ---------------------------------------------------------------------------


def read_json(path: str, error: type[Exception] = ConversionError,
              fix: str = 'restore the original file') -> dict:
  """A JSON file's content; malformed JSON raises `error` naming the file and the fix."""
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as e:
    raise error(f'{path} is not valid JSON ({e}); {fix}.') from e


def _write_json(path: str, content: dict) -> None:
  with open(path, 'w') as f:
    json.dump(content, f, indent=2)
    f.write('\n')


def _copy_files(source: str, names: list[str], destination: str) -> None:
  os.makedirs(destination, exist_ok=True)
  for name in names:
    if not os.path.isfile(os.path.join(source, name)):
      raise FileNotFoundError(f'{source}/{name} is gone: it was listed when the checkpoint was '
                              'made. Restore it, or pass --tokenizer=PATH.')
    shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))


# --- Command line --------------------------------------------------------------------


def _parse_flags(argv: list[str]) -> list[str]:
  """train.py's one-line config mistakes when --config is given; plain parsing without."""
  if any(a.lstrip('-').startswith(('config', 'noconfig.')) for a in argv[1:]):
    return guards.parse_flags(argv)
  return app.parse_flags_with_usage(argv)


def main(argv):
  del argv
  modes = {'from_hf': {'from_hf', 'to'}, 'to_hf': {'from_ckpt', 'to_hf'},
           'from_olmo_core': {'from_olmo_core', 'to'},
           'to_olmo_core': {'from_ckpt', 'to_olmo_core'}}
  given = {f for f in set().union(*modes.values()) if getattr(FLAGS, f)}
  chosen = [mode for mode, pair in modes.items() if given == pair]
  if len(chosen) != 1:
    raise app.UsageError('Give --from_hf=DIR --to=CKPT_DIR, --from_ckpt=CKPT_DIR --to_hf=DIR, '
                         '--from_olmo_core=STEP_DIR_OR_URL --to=CKPT_DIR, or '
                         '--from_ckpt=CKPT_DIR --to_olmo_core=STEP_DIR.')
  mode = chosen[0]
  if FLAGS.config is not None and mode != 'from_olmo_core':
    raise app.UsageError('--config goes with --from_olmo_core (the run config the converted '
                         'checkpoint continues with).')
  try:
    if mode == 'from_hf':
      check_destination(FLAGS.to, FLAGS.overwrite)  # before minutes of reading weights
      params, cfg = load_hf(FLAGS.from_hf)
      save_checkpoint_params(params, cfg, FLAGS.to, hf_source=read_hf_source(FLAGS.from_hf),
                             overwrite=FLAGS.overwrite)
      print(f'{FLAGS.from_hf} -> {FLAGS.to}/step_0 ({cfg.num_layers} layers, vocab '
            f'{cfg.vocab_size})')
    elif mode == 'to_hf':
      dtype = export_hf(FLAGS.from_ckpt, FLAGS.to_hf, step=FLAGS.step, dtype=FLAGS.dtype,
                        vocab_size=FLAGS.vocab_size, tokenizer=FLAGS.tokenizer)
      print(f'{FLAGS.from_ckpt} -> {FLAGS.to_hf} ({dtype})')
    elif mode == 'from_olmo_core':
      import olmo_core_ckpt  # pylint: disable=import-outside-toplevel  # needs the olmo-core extra
      check_destination(FLAGS.to, FLAGS.overwrite)  # before a download
      src = FLAGS.from_olmo_core
      if re.match(r'^(https?|gs|s3)://', src):
        src = olmo_core_ckpt.fetch(src, FLAGS.cache_dir, base=FLAGS.config)
      out = olmo_core_ckpt.import_step(src, FLAGS.to, base=FLAGS.config,
                                       overwrite=FLAGS.overwrite)
      moments = (f"Adam count {out['adam_count']}" if out['moments']
                 else 'no optimizer state: moments start at zero')
      print(f"{FLAGS.from_olmo_core} -> {FLAGS.to}/step_{out['step']} ({moments})")
    else:
      import olmo_core_ckpt  # pylint: disable=import-outside-toplevel  # needs the olmo-core extra
      step = olmo_core_ckpt.export_step(FLAGS.from_ckpt, FLAGS.to_olmo_core, step=FLAGS.step)
      print(f'{FLAGS.from_ckpt}/step_{step} -> {FLAGS.to_olmo_core} (OLMo-core load_path)')
  except (ConversionError, FileNotFoundError, FileExistsError, ImportError,
          checkpoint.CorruptCheckpointError) as e:
    raise SystemExit(f'convert.py: error: {e}') from e
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ in ('OlmoCoreCheckpointError', 'DownloadError'):
      raise SystemExit(f'convert.py: error: {e}') from e
    raise


if __name__ == '__main__':
  flags.DEFINE_string('from_hf', None, 'HF Olmo 3 directory to read')
  flags.DEFINE_string('to', None, 'checkpoint directory to write (step_0, params only)')
  flags.DEFINE_bool('overwrite', False, 'replace the checkpoint --to already holds (the whole '
                    'directory, atomically)')
  flags.DEFINE_string('from_ckpt', None, 'our checkpoint directory to read')
  flags.DEFINE_integer('step', None, 'checkpoint step (default: latest)')
  flags.DEFINE_string('to_hf', None, 'HF directory to write')
  flags.DEFINE_enum('dtype', None, sorted(DTYPES), 'HF weight dtype (default: the HF '
                    "source's when the checkpoint came from HF, else float32)")
  flags.DEFINE_integer('vocab_size', None, "HF vocab rows (default: the HF source's, else the "
                       'config data.vocab_size)')
  flags.DEFINE_string('from_olmo_core', None, 'OLMo-core step directory (stepN/) or its '
                      'http(s) URL: weights, AdamW moments, step, data position, config')
  flags.DEFINE_string('to_olmo_core', None, 'OLMo-core step directory to write (for its '
                      "trainer's load_path)")
  flags.DEFINE_string('cache_dir', None, 'where a --from_olmo_core URL is downloaded '
                      '(default ~/.cache/olmo3_jax/olmo_core)')
  flags.DEFINE_string('tokenizer', None, "tokenizer.json to export (default: the HF source's "
                      "tokenizer files, else data/tokenizer.json when its vocabulary is the run's)")
  # --from_olmo_core only: the run config to store (with --config.* overrides, as train.py
  # takes them), checked against the step's config.json; default: config.json translated.
  with guards.config_mistakes_in_one_line(sys.argv, None):
    config_flags.DEFINE_config_file('config', None, 'with --from_olmo_core: the train.py '
                                    'config the checkpoint continues with (e.g. '
                                    'configs/olmo3_7b.py and --config.data.* overrides)')
  FLAGS = flags.FLAGS
  app.run(main, flags_parser=_parse_flags)
