"""OLMo-core's experiment config.json <-> our run config (formats/olmo_core_ckpt.py's translation).

`translate` reads the sections OLMo-core's experiment launcher saves with every
step directory (docs/olmo_core_checkpoints.md):

  model         TransformerConfig: widths, block (attention, window pattern,
                RoPE), block_overrides (stage 3's YaRN layers), the param dtype
  dataset       sequence length, tokenizer ids
  data_loader   global batch (in tokens), data seed
  train_module  optim (SkipStepAdamW), scheduler, max_grad_norm, z-loss,
                rank_microbatch_size, dp_config and autocast_precision (the
                compute dtype)
  trainer       max_duration

and records, per field it sets, where in config.json the value came from, so
that every message comparing a value with the OLMo-core run can say where the
run's value was read. A field config.json does not set keeps the base config's
value (the 7B's by default) and is never attributed to the run.
`olmo_core_config` writes what `translate` reads back (the exporter's config.json).
"""

import json
import logging
import math
import re
from typing import Any

import ml_collections

from formats.ckpt_files import ConversionError, layer_pattern
from configs import olmo3_7b
import model

# The dtypes both sides name alike (OLMo-core DType values, our model.dtype/param_dtype).
DTYPES = ('float32', 'bfloat16', 'float16')

# What must agree between --config and the OLMo-core run for train.py to continue that run:
# the weights' shapes and function, and the data order (batch, length, seed). Not
# model.sliding_window_plus_one: config.json cannot say it (it is the OLMo-core version's
# window semantics, docs/architecture.md), so --config's is taken, and logged.
RUN_FIELDS = (*(('model', f) for f in model.ARCHITECTURE_FIELDS),
              ('data', 'global_batch_size'), ('data', 'seq_len'), ('data', 'seed'))
# Fields the user names their own way with --config (a mix file rather than data_paths.txt).
_USERS_OWN = ('data.paths', 'data.mix_file', 'data.base_dir')


class OlmoCoreCheckpointError(ConversionError):
  """An OLMo-core step directory that is incomplete, damaged or not an Olmo 3."""


def _get(d: dict, *path, default=None):
  for key in path:
    if not isinstance(d, dict) or key not in d:
      return default
    d = d[key]
  return d


def _mixer(block: dict) -> dict:
  """A block's attention settings: `sequence_mixer`, or `attention` in configs written by
  older OLMo-core (3.0.0's TransformerBlockConfig still reads both)."""
  return block.get('sequence_mixer') or block.get('attention') or {}


def _mixer_name(block: dict) -> str:
  return 'sequence_mixer' if block.get('sequence_mixer') else 'attention'


class _Translation:
  """Our config being filled from config.json, with the config.json path of each value set."""

  def __init__(self, cfg: ml_collections.ConfigDict):
    self.cfg = cfg
    self.sources: dict[str, str] = {}

  def set(self, field: str, value, where: str, file: str = 'config.json') -> None:
    """cfg.<field> = value, read from `file` at `where`."""
    *parents, leaf = field.split('.')
    node = self.cfg
    for p in parents:
      node = node[p]
    node[leaf] = value
    self.sources[field] = f'{file} {where}'.strip()

  def take(self, field: str, section, key: str, where: str, convert=lambda v: v) -> bool:
    """cfg.<field> from section[key] when config.json sets it; False (base's value kept) if not."""
    if not isinstance(section, dict) or section.get(key) is None:
      return False
    self.set(field, convert(section[key]), f'{where}.{key}')
    return True


def config_from_olmo_core(oc: dict, data_paths: list[str], base: ml_collections.ConfigDict
                          | None = None) -> ml_collections.ConfigDict:
  """Our run config from OLMo-core's config.json, on top of `base` (default: the 7B's)."""
  return translate(oc, data_paths, base)[0]


def translate(oc: dict, data_paths: list[str], base: ml_collections.ConfigDict | None = None
              ) -> tuple[ml_collections.ConfigDict, dict[str, str]]:
  """(our run config, {dotted field: where config.json set it}) on top of `base`.

  What config.json does not say keeps base's value (the 7B's by default): the
  data files' location, checkpoint cadence, mesh, kernels.
  """
  t = _Translation(base if base is not None else olmo3_7b.get_config())
  mc = oc.get('model')
  if not isinstance(mc, dict) or 'd_model' not in mc:
    raise OlmoCoreCheckpointError("config.json has no 'model' section with d_model; it is not "
                                  'an OLMo-core experiment config.')
  block = mc.get('block') or {}
  m, mixer = t.cfg.model, _mixer(block)
  at = f'model.block.{_mixer_name(block)}'
  if not mixer:
    raise OlmoCoreCheckpointError("config.json's model.block has no attention settings "
                                  "('sequence_mixer', or 'attention' in older OLMo-core).")
  if _get(mc, 'block', 'name', default='reordered_norm') != 'reordered_norm':
    raise OlmoCoreCheckpointError(f"block {mc['block']['name']!r} is not Olmo 3's reordered_norm.")
  for field, key in (('num_layers', 'n_layers'), ('d_model', 'd_model'),
                     ('vocab_size', 'vocab_size')):
    t.set(f'model.{field}', mc[key], f'model.{key}')
  t.take('model.num_heads', mixer, 'n_heads', at)
  if not t.take('model.num_kv_heads', mixer, 'n_kv_heads', at):  # None: one per query head
    t.set('model.num_kv_heads', m.num_heads, f'{at}.n_heads (n_kv_heads unset)')
  t.set('model.head_dim', m.d_model // m.num_heads, f'model.d_model / {at}.n_heads')
  t.take('model.mlp_hidden', block.get('feed_forward'), 'hidden_size', 'model.block.feed_forward')
  t.take('model.norm_eps', block.get('layer_norm'), 'eps', 'model.block.layer_norm')
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
  types = ['full_attention' if w == -1 else 'sliding_attention' for w in per_layer]
  t.set('model.layer_pattern', layer_pattern(types), f'{at}.sliding_window')
  if widths:
    t.set('model.sliding_window', widths.pop(), f'{at}.sliding_window.pattern')
  m.sliding_window_plus_one = False  # OLMo-core 3.0.0: window W is (i-W, i]
  _translate_rope(mc, t, at, [i for i, w in enumerate(per_layer) if w == -1])

  d, ds, dl = t.cfg.data, oc.get('dataset') or {}, oc.get('data_loader') or {}
  t.take('data.seq_len', ds, 'sequence_length', 'dataset')
  tok = ds.get('tokenizer') or {}
  for field in ('vocab_size', 'eos_token_id', 'pad_token_id'):
    t.take(f'data.{field}', tok, field, 'dataset.tokenizer')
  if 'global_batch_size' in dl:  # OLMo-core counts tokens
    t.set('data.global_batch_size', dl['global_batch_size'] // d.seq_len,
          'data_loader.global_batch_size (tokens) / dataset.sequence_length')
  t.take('data.seed', dl, 'seed', 'data_loader')
  if data_paths:
    t.set('data.paths', tuple(data_paths), '', file='data_paths.txt')
    d.mix_file, d.base_dir = '', ''

  tm = oc.get('train_module') or {}
  optim = tm.get('optim') or {}
  if optim and 'skipstepadamw' not in str(optim.get('_CLASS_', '')).lower():
    raise OlmoCoreCheckpointError(f"optimizer {optim.get('_CLASS_')} is not SkipStepAdamW.")
  if optim.get('step_increment_bugfix') is False:
    raise OlmoCoreCheckpointError('step_increment_bugfix=False: OLMo-core never advanced the '
                                  'Adam count, which our optimizer cannot express.')
  at = 'train_module.optim'
  t.take('opt.lr', optim, 'lr', at)
  if optim.get('betas') is not None:
    t.set('opt.b1', optim['betas'][0], f'{at}.betas[0]')
    t.set('opt.b2', optim['betas'][1], f'{at}.betas[1]')
  t.take('opt.eps', optim, 'eps', at)
  t.take('opt.weight_decay', optim, 'weight_decay', at)
  t.take('opt.skip_window', optim, 'rolling_interval_length', at)
  t.take('opt.skip_sigma', optim, 'sigma_factor', at, float)
  # None (or absent) is OLMo-core's default for both: no clipping, no z-loss.
  t.set('opt.clip_grad_norm', tm.get('max_grad_norm') or 0.0, 'train_module.max_grad_norm')
  t.set('opt.z_loss', tm.get('z_loss_multiplier') or 0.0, 'train_module.z_loss_multiplier')
  micro = tm.get('rank_microbatch_size')
  if micro and micro % d.seq_len == 0:  # OLMo-core counts tokens per rank (one device)
    t.set('train.micro_batch_size', micro // d.seq_len,
          'train_module.rank_microbatch_size (tokens) / dataset.sequence_length')
  _translate_dtypes(mc, tm, t)
  steps = _get(oc, 'trainer', 'max_duration')
  if isinstance(steps, dict) and steps.get('unit') == 'steps':
    t.set('train.steps', int(steps['value']), 'trainer.max_duration')
  elif isinstance(steps, dict) and steps.get('unit') == 'tokens':
    t.set('train.steps', int(steps['value']) // (d.global_batch_size * d.seq_len),
          'trainer.max_duration (tokens) / data_loader.global_batch_size')
  _translate_schedule(tm.get('scheduler') or {}, t)
  return t.cfg, t.sources


def _translate_dtypes(mc: dict, tm: dict, t: _Translation) -> None:
  """model.param_dtype and model.dtype (compute) from the model's dtype and the train module.

  OLMo-core builds the parameters in model.dtype (default float32). FSDP/HSDP
  with dp_config.param_dtype computes in that dtype over the parameters as
  master weights; DDP casts the model itself to it; autocast_precision runs the
  matmuls in its dtype. Without any of them the run computes in the parameters'.
  """
  def checked(value: str, where: str) -> str:
    if value not in DTYPES:
      raise OlmoCoreCheckpointError(f'{where}={value!r}: only {DTYPES} translate to '
                                    'model.dtype and model.param_dtype.')
    return value

  where = ('model.dtype' if mc.get('dtype') else
           'model.dtype (unset: OLMo-core builds float32 parameters)')
  t.set('model.param_dtype', checked(mc.get('dtype') or 'float32', 'model.dtype'), where)
  compute = t.cfg.model.param_dtype
  dp = tm.get('dp_config') or {}
  if dp.get('param_dtype'):
    where = 'train_module.dp_config.param_dtype'
    compute = checked(dp['param_dtype'], where)
    if dp.get('name') == 'ddp':  # no master copy: the parameters themselves are cast
      t.set('model.param_dtype', compute, f"{where} (dp_config.name 'ddp' casts the model)")
  if tm.get('autocast_precision'):
    where = 'train_module.autocast_precision'
    compute = checked(tm['autocast_precision'], where)
  t.set('model.dtype', compute, where)
  if (dp.get('reduce_dtype') or 'float32') != 'float32':
    logging.warning('The OLMo-core run reduced gradients in %s (config.json train_module.'
                    'dp_config.reduce_dtype); train.py reduces them in float32.',
                    dp['reduce_dtype'])


def _without_scaling(block: dict) -> str:
  block = json.loads(json.dumps(block))
  (_mixer(block).get('rope') or {}).pop('scaling', None)
  return json.dumps(block, sort_keys=True)


def _translate_rope(mc: dict, t: _Translation, at: str, full_layers: list[int]) -> None:
  """model.rope_theta and model.yarn from the block's RoPE and its per-layer overrides.

  Stage 3 (OLMo-core `TransformerConfig.with_rope_scaling(YaRN)`, full-attention
  layers only) keeps the block and adds `block_overrides`: a copy of the block per
  full-attention layer whose RoPE has `scaling`. model.py applies cfg.model.yarn to
  exactly those layers, so only that form translates.
  """
  m = t.cfg.model
  block = mc.get('block') or {}
  t.take('model.rope_theta', _mixer(block).get('rope'), 'theta', f'{at}.rope', float)
  overrides = {int(i): b for i, b in (mc.get('block_overrides') or {}).items()}
  scaled = {}
  for i in range(m.num_layers):
    if i in overrides and _without_scaling(overrides[i]) != _without_scaling(block):
      raise OlmoCoreCheckpointError(f'block_overrides[{i}] changes more than the RoPE scaling; '
                                    'layers that differ otherwise cannot be translated.')
    scaling = (_mixer(overrides.get(i, block)).get('rope') or {}).get('scaling')
    if scaling:
      scaled[i] = scaling
  y = m.yarn
  y.enabled = bool(scaled)
  t.sources['model.yarn'] = (f'config.json model.block_overrides[*].{_mixer_name(block)}.'
                             'rope.scaling' if scaled else f'config.json {at}.rope (no scaling)')
  if not scaled:
    return
  if sorted(scaled) != full_layers:
    raise OlmoCoreCheckpointError(
        f'RoPE scaling on layers {sorted(scaled)}; ours applies YaRN to exactly the '
        f'full-attention layers {full_layers} (OLMo-core with_rope_scaling(..., '
        'full_attn_layers_only=True), as Olmo 3 stage 3 does).')
  kinds = {json.dumps(v, sort_keys=True) for v in scaled.values()}
  s = next(iter(scaled.values()))
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


def _translate_schedule(sched: dict, t: _Translation) -> None:
  kind = str(sched.get('_CLASS_', '')).rsplit('.', 1)[-1]
  if not kind:
    return
  o, at = t.cfg.opt, 'train_module.scheduler'
  warmup = sched.get('warmup') if sched.get('warmup') is not None else sched.get('warmup_steps')
  t_max = sched.get('t_max') or t.cfg.train.steps
  t_max_at = f'{at}.t_max' if sched.get('t_max') else f'{at}.t_max unset: train.steps'
  if sched.get('units', 'steps') != 'steps' or warmup is None:
    raise OlmoCoreCheckpointError(f'scheduler {sched}: only step-based warmups translate.')
  t.set('opt.final_lr', o.lr * sched.get('alpha_f', 0.1), f'{at}.alpha_f x lr')
  if kind in ('CosWithWarmup', 'LinearWithWarmup'):
    t.set('opt.schedule', 'cosine' if kind == 'CosWithWarmup' else 'linear', f'{at}._CLASS_')
    t.set('opt.warmup_steps', warmup, f'{at}.warmup')
    t.set('opt.t_max', t_max, t_max_at)
  elif kind == 'HalfCosWithWarmup':  # Ai2's stage-1 part 2; part 1 keeps the 7B recipe's
    t.set('opt.schedule', 'olmo3_stitched', f'{at}._CLASS_')
    t.set('opt.part2_warmup', warmup, f'{at}.warmup')
    t.set('opt.part2_t_max', t_max, t_max_at)
  else:
    raise OlmoCoreCheckpointError(f'scheduler {kind} has no equivalent in optim.SCHEDULES; '
                                  'pass --config with the schedule to use.')


def _plain(v):
  return v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v


def checked_base(base: ml_collections.ConfigDict, translated: ml_collections.ConfigDict,
                 sources: dict[str, str]) -> ml_collections.ConfigDict:
  """The user's --config (stored as the run's), refused where it is not the OLMo-core run.

  The data files are the user's to name (a mix file and base_dir rather than the
  step's data_paths.txt); the dataset fingerprint in the data position still
  refuses other files or another order when train.py resumes. Every other value
  config.json set and --config changes is logged with where config.json set it.
  """
  def said(field: str, value) -> str:
    where = sources.get(field)
    return (f'the OLMo-core run has {value!r}: {where}' if where else
            f'config.json does not set it; the translation has {value!r}')
  wrong = [f'{g}.{f}={base[g][f]!r} ({said(f"{g}.{f}", translated[g][f])})'
           for g, f in RUN_FIELDS if base[g][f] != translated[g][f]]
  if base.model.yarn.to_dict() != translated.model.yarn.to_dict():
    wrong.append(f'model.yarn={base.model.yarn.to_dict()} '
                 f'({said("model.yarn", translated.model.yarn.to_dict())})')
  if wrong:
    raise OlmoCoreCheckpointError(
        f'--config does not describe the OLMo-core run: {"; ".join(wrong)}. Set those '
        "--config.* values to the checkpoint's, or drop --config: convert.py then stores the "
        "translated config, which train.py loads with --config=configs/from_checkpoint.py:DIR.")
  if base.model.sliding_window_plus_one:
    logging.warning('--config has model.sliding_window_plus_one=True: the windows see W + 1 '
                    'keys, as OLMo-core before August 2025 (config.json cannot say which).')
  checked = {f'{g}.{f}' for g, f in RUN_FIELDS} | {'model.yarn', *_USERS_OWN}
  for field, where in sorted(sources.items()):
    if field in checked:
      continue
    group, name = field.split('.', 1)
    ours, theirs = _plain(base[group][name]), _plain(translated[group][name])
    if not same_setting(field, ours, theirs, base.model):
      logging.warning("--config has %s=%r; the OLMo-core run has %r (%s). The run "
                      "continues with --config's.", field, ours, theirs, where)
  return base


FLOAT_RTOL = 1e-9  # config.json's lr x alpha_f and a config's literal differ in the last bits


def same_setting(field: str, ours: Any, theirs: Any, model_cfg: ml_collections.ConfigDict
                 ) -> bool:
  """Whether --config's value of `field` is the OLMo-core run's, as the run would use it.

  Numbers agree to a relative FLOAT_RTOL (0.0003 is 0.003 x 0.1 =
  0.00030000000000000003); opt.no_decay patterns agree when they select the
  same parameters of the model ('embed/.*' and 'embed/embedding'); anything
  else must be equal.
  """
  if field == 'opt.no_decay':
    return decay_excluded(ours, model_cfg) == decay_excluded(theirs, model_cfg)
  return _close(ours, theirs)


def decay_excluded(patterns: Any, model_cfg: ml_collections.ConfigDict) -> frozenset[str] | None:
  """The parameter paths ('module/name', as optim.decay_mask names them) that `patterns`
  exclude from weight decay; None for a pattern that is not a regex."""
  names = [f'{module}/{name}' for module, params in model.param_shapes(model_cfg).items()
           for name in params]
  try:
    compiled = [re.compile(p) for p in patterns or ()]
  except (re.error, TypeError):
    return None
  return frozenset(n for n in names if any(p.fullmatch(n) for p in compiled))


def _close(a: Any, b: Any) -> bool:
  numbers = (int, float)
  if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) and (
      not isinstance(b, bool)):
    return a == b or math.isclose(a, b, rel_tol=FLOAT_RTOL)
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
  if isinstance(a, dict) and isinstance(b, dict):
    return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
  return json.dumps(a) == json.dumps(b)


def olmo_core_config(cfg) -> dict:
  """The parts of an OLMo-core experiment config that `translate` reads back."""
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
  param_dtype = m.get('param_dtype', 'float32')
  compute = m.get('dtype', param_dtype)
  # FSDP mixed precision: float32 master weights, compute in model.dtype (translate's rule).
  dp_config = ({'name': 'fsdp', 'param_dtype': compute, 'reduce_dtype': 'float32'}
               if compute != param_dtype else None)
  micro = cfg.get('train', {}).get('micro_batch_size')
  return {
      'model': {'d_model': m.d_model, 'n_layers': m.num_layers, 'vocab_size': m.vocab_size,
                'block': block, 'block_overrides': overrides, 'dtype': param_dtype},
      'dataset': {'sequence_length': d.seq_len,
                  'tokenizer': {'vocab_size': d.vocab_size, 'eos_token_id': d.eos_token_id,
                                'pad_token_id': d.pad_token_id}},
      'data_loader': {'global_batch_size': d.global_batch_size * d.seq_len, 'seed': d.seed},
      'train_module': {
          'optim': {'_CLASS_': 'olmo_core.optim.adamw.SkipStepAdamWConfig', 'lr': o.lr,
                    'betas': [o.b1, o.b2], 'eps': o.eps, 'weight_decay': o.weight_decay,
                    'rolling_interval_length': o.skip_window, 'sigma_factor': o.skip_sigma},
          'max_grad_norm': o.clip_grad_norm, 'z_loss_multiplier': o.z_loss,
          'rank_microbatch_size': micro * d.seq_len if micro else None,
          'dp_config': dp_config,
          'scheduler': sched and {
              '_CLASS_': f'olmo_core.optim.scheduler.{sched}', 'units': 'steps',
              'warmup': o.part2_warmup if sched == 'HalfCosWithWarmup' else o.warmup_steps,
              'alpha_f': o.final_lr / o.lr,
              't_max': o.part2_t_max if sched == 'HalfCosWithWarmup' else o.t_max}},
      'trainer': {'max_duration': {'value': int(cfg.train.steps), 'unit': 'steps'}},
  }
