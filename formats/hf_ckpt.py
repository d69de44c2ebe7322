"""Olmo 3 weights between HF safetensors directories and our params (no command line).

convert.py is the command line over this module. train.py (`train.init_from`)
and evaluation/ read HF directories with `load_hf`.

Tensors are streamed one at a time from memory-mapped safetensors into the
stacked [L, ...] arrays of model.py (and back, one output shard at a time), so
converting a 7B model needs about one copy of the weights in host memory.

A checkpoint converted from HF keeps its source: the metadata's `hf_source`
holds the config.json and generation_config.json as read (vocabulary, token
ids, dtype, context length), and step_0/hf_files/ the tokenizer files. The
export writes them back, so HF -> checkpoint -> HF gives the same model. A
train.py checkpoint exports its data config's vocabulary, token ids and
sequence length (YaRN's settings for a long-context run), and the run's own
tokenizer (run_tokenizer.find, or --tokenizer) with a tokenizer_config.json
naming EOS and PAD; an export with no tokenizer to carry is refused before
anything is written.

HF config dialects read (docs/architecture.md):
  hub:    top-level `rope_theta`, `rope_scaling`, `layer_types`, `sliding_window`
  nested: `rope_parameters` = {'full_attention': {...}, 'sliding_attention': {...}}
          (what transformers >= 5.13 `save_pretrained` writes)
  flat:   `rope_parameters` = {'rope_type': ..., 'rope_theta': ...} (5.0-5.12);
          its YaRN is read as full-layers-only, Olmo 3's real semantics.
We write the hub dialect, which transformers 4.57 and >= 5.13 both read right.

Shapes: L layers, D d_model, V vocab.
"""

import json
import logging
import math
import os
import shutil
from collections.abc import Iterator

import jax
import ml_collections
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import checkpoint
from configs import olmo3_7b
from formats import ckpt_files
from formats.ckpt_files import ConversionError
import model
from store import storage
from tokens import run_tokenizer

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
DEFAULT_POSITIONS = 8192  # stages 1-2's sequence length: for a config that names none


def _transposed(key: tuple[str, str], value: np.ndarray) -> np.ndarray:
  """HF layout <-> ours: transpose every 2-D weight except the embedding table."""
  return value.T if value.ndim == 2 and key != ('embed', 'embedding') else value


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
  m.layer_pattern = ckpt_files.layer_pattern(layer_types)
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


def hf_config(cfg: ml_collections.ConfigDict, vocab_size: int, *,
              eos_token_id: int | None = None, pad_token_id: int | None = None,
              dtype: str = 'float32', max_positions: int | None = None) -> dict:
  """An HF config.json dict in the hub dialect.

  max_positions: the context length to claim (max_position_embeddings), the
  run's sequence length; default YaRN's extended length with YaRN, else 8192.
  """
  pattern = cfg.layer_pattern * (cfg.num_layers // len(cfg.layer_pattern))
  names = {'S': 'sliding_attention', 'F': 'full_attention'}
  if cfg.sliding_window_plus_one:
    raise ConversionError('HF Olmo 3 has no W+1 sliding window; export with '
                          'sliding_window_plus_one=False (or sliding_window+1)')
  rope_scaling = None
  default_positions = DEFAULT_POSITIONS
  if cfg.yarn.enabled:
    y = cfg.yarn
    # HF YaRN: `factor` scales the frequencies; original_max_position_embeddings places
    # the ramp. max_position_embeddings is only the context length then.
    rope_scaling = {'rope_type': 'yarn', 'factor': y.factor,
                    'original_max_position_embeddings': y.original_max_position,
                    'beta_fast': y.beta_fast, 'beta_slow': y.beta_slow}
    if y.attention_factor is not None:
      rope_scaling['attention_factor'] = y.attention_factor
    default_positions = int(y.original_max_position * y.factor)
  return {
      'architectures': ['Olmo3ForCausalLM'], 'model_type': 'olmo3',
      'vocab_size': vocab_size, 'hidden_size': cfg.d_model,
      'intermediate_size': cfg.mlp_hidden, 'num_hidden_layers': cfg.num_layers,
      'num_attention_heads': cfg.num_heads, 'num_key_value_heads': cfg.num_kv_heads,
      'head_dim': cfg.head_dim, 'hidden_act': 'silu', 'rms_norm_eps': cfg.norm_eps,
      'max_position_embeddings': int(max_positions or default_positions),
      'rope_theta': cfg.rope_theta, 'rope_scaling': rope_scaling,
      'layer_types': [names[c] for c in pattern],
      'sliding_window': cfg.sliding_window, 'attention_bias': False,
      'attention_dropout': 0.0, 'tie_word_embeddings': False, 'use_cache': True,
      'bos_token_id': None, 'eos_token_id': eos_token_id, 'pad_token_id': pad_token_id,
      'initializer_range': cfg.init_std, 'dtype': dtype,
  }


# --- Weights -----------------------------------------------------------------------


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
  cfg = model_config_from_hf(ckpt_files.read_json(config_path), pad_vocab_to)
  files = _weight_files(directory)
  expected = set(GLOBAL_TENSORS) | {f'model.layers.{i}.{name}'
                                    for i in range(cfg.num_layers) for name in LAYER_TENSORS}
  missing = sorted(expected - set(files))
  if missing:
    raise ConversionError(f'{directory}: {len(missing)} tensors missing, e.g. {missing[:3]}')
  unknown = sorted(set(files) - expected)
  if unknown:
    raise ConversionError(f'{directory}: unexpected tensors {unknown[:3]}; not an Olmo 3 '
                          'checkpoint with this config.json')

  # Pad vocab rows are zero: they never appear as inputs, and their logits are
  # sliced off wherever HF numbers are compared.
  params = {module: {name: np.zeros(shape, dtype) for name, shape in names.items()}
            for module, names in model.param_shapes(cfg).items()}
  shapes = ckpt_files.per_layer_shapes(cfg)
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


def _new_file_mode() -> int:
  """The mode open() gives a new file: 0o666 less the umask (Linux reports it read-only)."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith('Umask:'):
          return 0o666 & ~int(line.split()[1], 8)
  except OSError:
    pass
  mask = os.umask(0o022)  # no /proc: the only way to read it is to set it and put it back
  os.umask(mask)
  return 0o666 & ~mask


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

  weight_map, total, mode = {}, 0, _new_file_mode()
  for i, shard in enumerate(shards):
    file = (f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' if len(shards) > 1
            else 'model.safetensors')
    tensors = {name: tensor(key, layer) for name, key, layer in shard}
    total += sum(t.nbytes for t in tensors.values())
    save_file(tensors, os.path.join(directory, file), metadata={'format': 'pt'})
    # safetensors writes through a private temporary file (mode 0600) renamed into
    # place; the export is shared like every other file the user writes.
    os.chmod(os.path.join(directory, file), mode)
    weight_map.update({name: file for name in tensors})
    del tensors
  if len(shards) > 1:
    ckpt_files.write_json(os.path.join(directory, 'model.safetensors.index.json'),
                          {'metadata': {'total_size': total}, 'weight_map': weight_map})
  if config is None:
    config = hf_config(cfg, vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                       dtype=dtype)
  ckpt_files.write_json(os.path.join(directory, 'config.json'), config)


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
  config = ckpt_files.read_json(os.path.join(directory, 'config.json'))
  generation = os.path.join(directory, 'generation_config.json')
  return {'path': os.path.abspath(directory), 'config': config,
          'generation_config': (ckpt_files.read_json(generation)
                                if os.path.exists(generation) else None),
          'vocab_size': config['vocab_size'], 'eos_token_id': config.get('eos_token_id'),
          'pad_token_id': config.get('pad_token_id'), 'bos_token_id': config.get('bos_token_id'),
          'dtype': config.get('dtype') or config.get('torch_dtype'),
          'max_position_embeddings': config.get('max_position_embeddings'),
          'files': [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]}


def save_checkpoint_params(params: dict, cfg: ml_collections.ConfigDict, directory: str, *,
                           hf_source: dict | None = None, overwrite: bool = False) -> None:
  """Writes params as step_0 of a checkpoint directory (usable as train.init_from).

  The checkpoint is built in a sibling directory and moved in whole, so a crash
  leaves no partial one. A directory that already holds a checkpoint is
  refused, or with `overwrite` exchanged for the new one in one rename.
  `hf_source` (read_hf_source) goes into the metadata, its tokenizer files into
  step_0/hf_files/.
  """
  ckpt_files.check_destination(directory, overwrite)
  directory = storage.absolute(directory)
  staging = ckpt_files.staging_dir(directory)
  metadata = {'config': {'model': cfg.to_dict()}}
  if hf_source is not None:
    metadata['hf_source'] = hf_source
  try:
    with checkpoint.Checkpointer(staging) as ckpt:
      ckpt.save(0, {'params': params}, metadata)
    if hf_source and hf_source['files']:
      ckpt_files.copy_files(hf_source['path'], hf_source['files'],
                            storage.join(staging, 'step_0', HF_FILES))
    ckpt_files.install(staging, directory)
  finally:
    storage.delete_tree(staging)  # after an exchange: the old checkpoint


# --- Export ------------------------------------------------------------------------


def export_hf(ckpt_dir: str, out: str, *, step: int | None = None, dtype: str | None = None,
              vocab_size: int | None = None, tokenizer: str | None = None) -> str:
  """Writes a checkpoint as an HF directory with its config, generation config and tokenizer.

  dtype defaults to the HF source's when the checkpoint has one, else float32;
  vocab_size to the source's or the run's data config. Returns the dtype used.
  """
  step = checkpoint.latest_step(ckpt_dir) if step is None else step
  source = checkpoint.read_metadata(ckpt_dir, step).get('hf_source')
  hf_files = tokenizer is None and source and source['files']
  if not hf_files:  # the run's own tokenizer, found before anything is written
    metadata = checkpoint.read_metadata(ckpt_dir, step)
    tokenizer = run_tokenizer.find(metadata.get('config', {}).get('data'), tokenizer)
    if tokenizer is None:
      raise ConversionError(f'{ckpt_dir} step {step} names no tokenizer (its config has no '
                            'data.tokenizer); an HF export without one is unusable: pass '
                            '--tokenizer=PATH (or a URL) to the tokenizer.json its data was '
                            'made with.')
  params, full = load_checkpoint_params(ckpt_dir, step)
  dtype = dtype or _source_dtype(source)
  config = export_config(full, source, vocab_size=vocab_size, dtype=dtype)
  if not hf_files:
    check_tokenizer(tokenizer, config)
  save_hf(params, full.model, out, vocab_size=config['vocab_size'], dtype=dtype, config=config)
  ckpt_files.write_json(os.path.join(out, 'generation_config.json'),
                        (source or {}).get('generation_config') or _generation_config(config))
  if hf_files:
    step_dir = storage.join(ckpt_dir, f'step_{step}', HF_FILES)
    ckpt_files.copy_files(step_dir, source['files'], out)
  else:
    _write_tokenizer(tokenizer, config, out)
  return dtype


def export_config(full: ml_collections.ConfigDict, source: dict | None, *,
                  vocab_size: int | None = None, dtype: str = 'float32') -> dict:
  """config.json for an export: the HF source's own, else built from the run's config.

  A run's context length is its data.seq_len, the length it trained on and
  eval.py truncates at; with YaRN the rope_scaling names the pre-YaRN length.
  """
  if source:  # checksummed with the weights it describes (checkpoint metadata)
    config = dict(source['config'])
  else:
    data_cfg = full.get('data', {})
    config = hf_config(full.model, data_cfg.get('vocab_size') or full.model.vocab_size,
                       eos_token_id=data_cfg.get('eos_token_id'),
                       pad_token_id=data_cfg.get('pad_token_id'),
                       max_positions=data_cfg.get('seq_len'))
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


def check_tokenizer(path: str, config: dict) -> dict[str, str]:
  """{'eos_token': ..., ...}: the special tokens of the local tokenizer.json `path` for the
  config's ids; a ConversionError when it lacks one or is larger than the vocabulary (it is
  not the run's tokenizer)."""
  tok = run_tokenizer.load(path)
  if tok.get_vocab_size() > config['vocab_size']:
    raise ConversionError(f'{path} has {tok.get_vocab_size()} tokens, the model '
                          f'{config["vocab_size"]}; it is not the run\'s tokenizer. Pass the '
                          'right one with --tokenizer=PATH.')
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
  return special


def _write_tokenizer(path: str, config: dict, out: str) -> None:
  """tokenizer.json plus a tokenizer_config.json naming its special tokens by the config's ids."""
  special = check_tokenizer(path, config)
  shutil.copyfile(path, os.path.join(out, 'tokenizer.json'))
  ckpt_files.write_json(os.path.join(out, 'tokenizer_config.json'), {
      'tokenizer_class': 'PreTrainedTokenizerFast', **special,
      'model_max_length': config['max_position_embeddings'],
      'clean_up_tokenization_spaces': False})
