"""The Olmo 3 transformer as one pure Haiku function.

Architecture facts: docs/architecture.md (HF `modeling_olmo3.py`, OLMo-core
`ReorderedNormTransformerBlock`). Reading order: norms, RoPE, one block, the
scanned stack, then parameter and FLOP counts. The block's matmuls and its one
attention call run on the implementation `cfg.attention_impl` selects
(kernels/__init__.py: Pallas on TPU, cuDNN on GPU, CPU-tuned XLA on CPU). Remat
policies (`remat_plan`: what a layer group's backward keeps, by the activations
`_block` names) are explained in docs/remat.md.

Shapes: B batch, T time (queries), S time (keys), D d_model, H query heads,
G kv heads, R = H // G queries per kv head, K head_dim, F mlp hidden, V vocab,
L layers, P layers per pattern period, N = L // P scan groups.

Parameters (the checkpoint format; layer i is row i of every [L, ...] array):
  embed/embedding      [V, D]
  attention/w_q        [L, D, H*K]     attention/q_norm  [L, H*K]
  attention/w_k        [L, D, G*K]     attention/k_norm  [L, G*K]
  attention/w_v        [L, D, G*K]
  attention/w_o        [L, H*K, D]
  attention_norm/scale [L, D]          (applied to the attention output)
  mlp/w_gate           [L, D, F]       mlp/w_up [L, D, F]   mlp/w_down [L, F, D]
  mlp_norm/scale       [L, D]          (applied to the MLP output)
  final_norm/scale     [D]
  lm_head/w            [D, V]
Weights are stored [in, out] (HF stores [out, in]; formats/hf_ckpt.py transposes).
`param_shapes` is this table in code.
"""

import math
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import kernels

Params = dict[str, dict[str, jax.Array]]
BATCH_AXES = ('data', 'fsdp')  # mesh axes the batch is split over (sharding.make_mesh)
# The config fields that fix the weights' shapes and the function they compute.
ARCHITECTURE_FIELDS = ('num_layers', 'd_model', 'num_heads', 'num_kv_heads', 'head_dim',
                      'mlp_hidden', 'vocab_size', 'layer_pattern', 'sliding_window',
                      'rope_theta', 'norm_eps')

# --- Remat: which activations the backward keeps ------------------------------
# Under remat a scan group (one layer-pattern period) keeps its input and what the
# policy saves; the backward recomputes the rest. `_block` names these activations of
# each layer (checkpoint_name). Saving a projection *before* its RMSNorm is what spares
# the matmul: the norm's backward needs its input, so a saved normed q or k (or the
# block's normed outputs) would leave the matmul to be recomputed all the same.
ACTIVATIONS = {
    'q_proj': 'x @ w_q, before QK-norm [B, T, H*K]',
    'k_proj': 'x @ w_k, before QK-norm [B, T, G*K]',
    'v_proj': 'x @ w_v [B, T, G*K]',
    'attn_out': "attention's output [B, T, H, K] (every impl names it)",
    'attn_lse': "the Pallas kernels' (TPU, GPU) float32 log-sum-exp [B, H, T] (with "
                'attn_out, no attention forward is recomputed)',
    'attn_proj': 'attention output @ w_o, before its norm [B, T, D]',
    'mlp_gate': 'h @ w_gate [B, T, F]',
    'mlp_up': 'h @ w_up [B, T, F]',
    'mlp_out': 'silu(gate) * up @ w_down, before its norm [B, T, D]',
}
ACTIVATION_GROUPS = {
    'qkv': ('q_proj', 'k_proj', 'v_proj'),
    'attn': ('attn_out', 'attn_lse'),
    'outs': ('attn_proj', 'mlp_out'),  # with both, the residual stream recomputes without a matmul
    'gate_up': ('mlp_gate', 'mlp_up'),
    'all': tuple(ACTIVATIONS),
}
# Named policies; any other value of cfg.remat is a save list (`remat_plan`).
REMAT_PRESETS = {
    'none': None,  # no remat: every activation stays live for the backward
    'full': '',  # save nothing but each group's input
    'save_dots': None,  # every matmul output without a batch dimension (jax's policy)
    'save_qkv': 'qkv',
    'save_attn': 'attn',
    'save_outs': 'outs',
    'save_qkv_attn': 'qkv,attn',
    'save_proj': 'all',
}
REMAT_SYNTAX = ("a preset or a comma-separated save list of [LAYERS:]NAME[@host] items: "
                "NAME an activation or group (" + ', '.join([*ACTIVATION_GROUPS, *ACTIVATIONS])
                + "); LAYERS 'S' (sliding layers), 'F' (full layers) or positions in the "
                "layer pattern (e.g. '03'); '@host' offloads to host memory instead of "
                "keeping it on the device (e.g. 'outs,attn,F:qkv@host')")


def activation_name(position: int, name: str) -> str:
  """The checkpoint name of activation `name` of the block at `position` in the pattern."""
  return f'block{position}.{name}'


def remat_plan(cfg: ml_collections.ConfigDict) -> dict[str, tuple[str, ...]] | None:
  """{'device': names, 'host': names} that cfg.remat saves (qualified by layer position).

  None for 'none' and 'save_dots' (no save list); a ValueError naming the item for a
  spec that `REMAT_SYNTAX` does not describe.
  """
  if not isinstance(cfg.remat, str):
    raise ValueError(f'{cfg.remat!r} is not a string')
  spec = REMAT_PRESETS.get(cfg.remat, cfg.remat)
  if spec is None:
    return None
  period = len(cfg.layer_pattern)
  where: dict[str, str] = {}
  for item in filter(None, (s.strip() for s in spec.split(','))):
    layers, _, rest = item.rpartition(':')
    name, _, place = rest.partition('@')
    if name not in ACTIVATION_GROUPS and name not in ACTIVATIONS:
      raise ValueError(f'{item!r} names no activation')
    if place not in ('', 'host'):
      raise ValueError(f"{item!r}: the place after '@' can only be 'host'")
    if layers in ('S', 'F'):
      positions = [j for j, kind in enumerate(cfg.layer_pattern) if kind == layers]
      if not positions:
        raise ValueError(f'{item!r}: layer_pattern {cfg.layer_pattern!r} has no {layers!r} layer')
    elif layers == '':
      positions = list(range(period))
    elif layers.isdigit() and all(int(c) < period for c in layers):
      positions = sorted({int(c) for c in layers})
    else:
      raise ValueError(f'{item!r}: {layers!r} is neither S, F nor positions below the '
                       f'layer pattern period {period}')
    for j in positions:
      for one in ACTIVATION_GROUPS.get(name, (name,)):
        key = activation_name(j, one)
        if where.setdefault(key, place or 'device') != (place or 'device'):
          raise ValueError(f'{item!r}: {key} is both kept on the device and offloaded')
  return {place: tuple(sorted(k for k, v in where.items() if v == place))
          for place in ('device', 'host')}


def remat_policy(cfg: ml_collections.ConfigDict) -> Any:
  """The jax.checkpoint policy of cfg.remat (None for 'none': no checkpoint at all)."""
  if cfg.remat == 'none':
    return None
  if cfg.remat == 'save_dots':
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  names = remat_plan(cfg)
  if not names['host']:  # no host memory kinds: the policy every backend compiles
    return jax.checkpoint_policies.save_only_these_names(*names['device'])
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=names['device'], names_which_can_be_offloaded=names['host'],
      offload_src='device', offload_dst='pinned_host')


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field when the model config is inconsistent."""
  problems = []
  if cfg.num_heads % cfg.num_kv_heads:
    problems.append(f'num_heads={cfg.num_heads} is not a multiple of '
                    f'num_kv_heads={cfg.num_kv_heads}')
  if not cfg.layer_pattern or set(cfg.layer_pattern) - {'S', 'F'}:
    problems.append(f"layer_pattern={cfg.layer_pattern!r} must be a non-empty "
                    "string of 'S' (sliding) and 'F' (full)")
  elif cfg.num_layers % len(cfg.layer_pattern):
    problems.append(f'num_layers={cfg.num_layers} is not a multiple of the '
                    f'layer_pattern period {len(cfg.layer_pattern)}')
  if cfg.head_dim % 2:
    problems.append(f'head_dim={cfg.head_dim} must be even for RoPE')
  if 'S' in cfg.layer_pattern and cfg.sliding_window < 1:
    problems.append(f'sliding_window={cfg.sliding_window} must be >= 1')
  try:
    remat_plan(cfg)
  except ValueError as e:
    problems.append(f'remat={cfg.remat!r} is not one of {sorted(REMAT_PRESETS)} nor a save '
                    f'list ({e}): {REMAT_SYNTAX}')
  if cfg.attention_impl not in kernels.IMPLS:
    problems.append(f'attention_impl={cfg.attention_impl!r} is not one of {kernels.IMPLS}')
  elif cfg.attention_impl == 'pallas' and (reason := kernels.pallas_unsupported(cfg)):
    problems.append(f"attention_impl='pallas' does not support {reason}; use 'auto' or 'xla'")
  for field in ('vocab_size', 'num_layers', 'd_model', 'num_heads',
                'num_kv_heads', 'head_dim', 'mlp_hidden'):
    if cfg[field] < 1:
      problems.append(f'{field}={cfg[field]} must be >= 1')
  if problems:
    raise ValueError('Invalid model config: ' + '; '.join(problems) +
                     '. Fix the config (or the --config.model.* overrides).')


def layer_window(cfg: ml_collections.ConfigDict, layer: int) -> int | None:
  """Keys a query of `layer` may see (itself included); None means all earlier."""
  if cfg.layer_pattern[layer % len(cfg.layer_pattern)] == 'F':
    return None
  # Olmo 3 (HF, OLMo-core after Aug 2025): query i sees (i-W, i]. The knob
  # reproduces OLMo-core's earlier (i-W-1, i], which most of stage 1 used.
  return cfg.sliding_window + int(cfg.sliding_window_plus_one)


def constrain_batch(x: jax.Array) -> jax.Array:
  """Keeps an activation split over the batch axes when traced under a mesh.

  Without it, XLA may follow the FSDP-sharded weights and hold the whole
  batch on every device (N-fold redundant compute and memory). Outside a
  mesh context (tests, eval, CPU) it does nothing.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
  if not axes:
    return x
  # Context parallelism splits time too (kernels/context_parallel.py).
  time = 'context' if kernels.context_parallel.degree(mesh) > 1 else None
  return jax.lax.with_sharding_constraint(x, P(axes, time, *([None] * (x.ndim - 2))))


# --- Norms and rotary embeddings -------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32 with HF/OLMo-core's order: scale the normalised value, then cast."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  # The weight is in compute dtype in the reference (bf16 params under FSDP
  # mixed precision), so round it the same way before the float32 product.
  scale = scale.astype(x.dtype).astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
  return (scale * normed).astype(x.dtype)


def rope_frequencies(cfg: ml_collections.ConfigDict, full_layer: bool
                     ) -> tuple[np.ndarray, float]:
  """Inverse frequencies [K/2] (float32) and the cos/sin multiplier.

  YaRN applies to full-attention layers only (HF Olmo3 `rope_parameters`
  per layer type; transformers 5.0-5.12 wrongly applied it to all layers).
  """
  k = cfg.head_dim
  pos_freqs = cfg.rope_theta ** (np.arange(0, k, 2, dtype=np.float32) / k)
  inv_freq = (1.0 / pos_freqs).astype(np.float32)
  if not (full_layer and cfg.yarn.enabled):
    return inv_freq, 1.0
  y = cfg.yarn
  factor = y.factor
  attention_factor = y.attention_factor
  if attention_factor is None:
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

  def correction_dim(rotations: float) -> float:
    return (k * math.log(y.original_max_position / (rotations * 2 * math.pi))
            ) / (2 * math.log(cfg.rope_theta))

  # HF `_compute_yarn_parameters` with truncate=True: integer ramp bounds.
  low = max(math.floor(correction_dim(y.beta_fast)), 0)
  high = min(math.ceil(correction_dim(y.beta_slow)), k - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(k // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = (1 - ramp).astype(np.float32)
  interpolation_freq = (1.0 / (factor * pos_freqs)).astype(np.float32)
  inv_freq = interpolation_freq * (1 - extrapolation) + inv_freq * extrapolation
  return inv_freq.astype(np.float32), float(attention_factor)


def positions(cfg: ml_collections.ConfigDict, b: int, t: int,
              segment_ids_BT: jax.Array | None) -> jax.Array:
  """RoPE positions [B, T]: 0..T-1, or restarting at 0 in each document.

  `rope_document_positions` is OLMo-core 3.0's non-context-parallel rule for
  packed documents; the code Ai2 ran stage 3 with kept 0..T-1 (docs/long_context.md).
  """
  position_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
  if not (cfg.rope_document_positions and segment_ids_BT is not None):
    return position_BT
  starts_BT = jnp.pad(segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1], ((0, 0), (1, 0)),
                      constant_values=True)
  return position_BT - jax.lax.cummax(jnp.where(starts_BT, position_BT, 0), axis=1)


def rope_tables(positions_BT: jax.Array, inv_freq: np.ndarray, scale: float
                ) -> tuple[jax.Array, jax.Array]:
  """cos, sin tables [B, T, K/2] in float32 (both halves of a head share them)."""
  angles_BTk = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None]
  return jnp.cos(angles_BTk) * scale, jnp.sin(angles_BTk) * scale


def apply_rope(x_BTHK: jax.Array, cos_BTk: jax.Array, sin_BTk: jax.Array) -> jax.Array:
  """Half-split ("rotate_half") RoPE computed in float32, cast back.

  HF's x * cos + rotate_half(x) * sin with rotate_half as a flip of the two
  halves times (-1, +1): the same float32 results, and forward and backward
  are each one elementwise pass (slicing the halves costs padded copies in
  the backward). Tried on a v5e: rotate_half as a signed permutation matmul,
  which keeps q and k [B, T, H, K], saved 1.3 ms without remat but cost 2.3 ms
  under it (docs/results/tpu_v5e.md; bench/device_check.py --rope_matmul).
  """
  b, t, h, k = x_BTHK.shape
  x_BTH2k = x_BTHK.astype(jnp.float32).reshape(b, t, h, 2, k // 2)
  sign_11121 = jnp.array([-1.0, 1.0], jnp.float32).reshape(1, 1, 1, 2, 1)
  rotated_BTH2k = jnp.flip(x_BTH2k, axis=3) * sign_11121
  cos, sin = cos_BTk[:, :, None, None, :], sin_BTk[:, :, None, None, :]
  return (x_BTH2k * cos + rotated_BTH2k * sin).reshape(b, t, h, k).astype(x_BTHK.dtype)


# --- Attention, the equation ------------------------------------------------


def reference_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, *,
                        window: int | None = None, segment_ids_BT: jax.Array | None = None
                        ) -> jax.Array:
  """softmax(q k^T / sqrt(K) + mask) v per kv-head group: what every kernel computes.

  The mask lets query i see key j when j <= i (causal), i - j < window (a
  sliding layer), and both lie in the same document (segment ids). Softmax in
  float32 (float64 if given float64), output in q's dtype. It materialises
  the [B, G, R, T, T] logits, so it is the definition the kernels/ paths are
  tested against (and a baseline in bench/), not what training runs: `_block`
  calls `ops.attention`, the implementation cfg.attention_impl selects.
  """
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  dtype = jnp.promote_types(q_BTHK.dtype, jnp.float32)
  q_BTGRK = q_BTHK.astype(dtype).reshape(b, t, g, h // g, k)
  logits_BGRTS = jnp.einsum('btgrk,bsgk->bgrts', q_BTGRK, k_BTGK.astype(dtype)) * k**-0.5
  qpos_T1, kpos_1S = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  mask_TS = kpos_1S <= qpos_T1
  if window is not None:
    mask_TS &= qpos_T1 - kpos_1S < window
  mask_BTS = jnp.broadcast_to(mask_TS, (b, t, t))
  if segment_ids_BT is not None:
    mask_BTS &= segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  logits_BGRTS = jnp.where(mask_BTS[:, None, None], logits_BGRTS, jnp.finfo(dtype).min)
  probs_BGRTS = jax.nn.softmax(logits_BGRTS, axis=-1)
  o_BTGRK = jnp.einsum('bgrts,bsgk->btgrk', probs_BGRTS, v_BTGK.astype(dtype))
  return o_BTGRK.reshape(b, t, h, k).astype(q_BTHK.dtype)


# --- The block and the stack ------------------------------------------------


def _block(x_BTD: jax.Array, p: dict[str, jax.Array], *, position: int, window: int | None,
           rope: tuple[jax.Array, jax.Array], segment_ids_BT: jax.Array | None,
           cfg: ml_collections.ConfigDict, ops: kernels.Ops) -> jax.Array:
  """One reordered-norm block: h = x + norm(attn(x)); y = h + norm(mlp(h)).

  `mm` is x @ w (ops.matmul: the same product, with a backward tuned per platform).
  `position` (in the layer pattern) qualifies the names a remat policy saves by.
  """
  dtype, mm = x_BTD.dtype, ops.matmul
  b, t, _ = x_BTD.shape
  w = {name: value.astype(dtype) for name, value in p.items()}
  name = lambda x, what: checkpoint_name(x, activation_name(position, what))

  # QK-norm over the whole projection, before splitting into heads and RoPE.
  q = rms_norm(name(mm(x_BTD, w['w_q']), 'q_proj'), p['q_norm'], cfg.norm_eps)
  k = rms_norm(name(mm(x_BTD, w['w_k']), 'k_proj'), p['k_norm'], cfg.norm_eps)
  v = name(mm(x_BTD, w['w_v']), 'v_proj')
  q_BTHK = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), *rope)
  k_BTGK = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), *rope)
  v_BTGK = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
  # reference_attention's equation, on the implementation cfg.attention_impl selects;
  # it names its output (and the Pallas kernel its log-sum-exp) for the remat policy.
  o_BTHK = ops.attention(q_BTHK, k_BTGK, v_BTGK, window=window, segment_ids_BT=segment_ids_BT,
                         names=(activation_name(position, 'attn_out'),
                                activation_name(position, 'attn_lse')))
  attn_BTD = name(mm(o_BTHK.reshape(b, t, -1), w['w_o']), 'attn_proj')
  h_BTD = x_BTD + rms_norm(attn_BTD, p['attention_norm'], cfg.norm_eps)

  gate_BTF = name(mm(h_BTD, w['w_gate']), 'mlp_gate')
  up_BTF = name(mm(h_BTD, w['w_up']), 'mlp_up')
  mlp_BTD = name(mm(jax.nn.silu(gate_BTF) * up_BTF, w['w_down']), 'mlp_out')
  return h_BTD + rms_norm(mlp_BTD, p['mlp_norm'], cfg.norm_eps)


def _trunc_normal(cfg: ml_collections.ConfigDict) -> hk.initializers.Initializer:
  """OLMo-core init: normal(0, std) truncated at +-cutoff, no depth scaling."""
  bound = cfg.init_cutoff / cfg.init_std

  def init(shape, dtype):
    return cfg.init_std * jax.random.truncated_normal(
        hk.next_rng_key(), -bound, bound, shape, dtype)
  return init


def param_shapes(cfg: ml_collections.ConfigDict) -> dict[str, dict[str, tuple[int, ...]]]:
  """{module: {name: shape}} of every parameter: the one table of the checkpoint format.

  `_forward` creates its parameters from it, `param_count` counts it, and the
  converters (formats/hf_ckpt.py, formats/olmo_core_ckpt.py) check and place tensors by it.
  """
  L, D, F, V = cfg.num_layers, cfg.d_model, cfg.mlp_hidden, cfg.vocab_size
  HK, GK = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  return {
      'embed': {'embedding': (V, D)},
      'attention': {'w_q': (L, D, HK), 'w_k': (L, D, GK), 'w_v': (L, D, GK),
                    'w_o': (L, HK, D), 'q_norm': (L, HK), 'k_norm': (L, GK)},
      'attention_norm': {'scale': (L, D)},
      'mlp': {'w_gate': (L, D, F), 'w_up': (L, D, F), 'w_down': (L, F, D)},
      'mlp_norm': {'scale': (L, D)},
      'final_norm': {'scale': (D,)},
      'lm_head': {'w': (D, V)},
  }


LAYER_MODULES = ('attention', 'attention_norm', 'mlp', 'mlp_norm')  # the [L, ...] stacked ones


def _params(cfg: ml_collections.ConfigDict, module: str) -> dict[str, jax.Array]:
  """Creates (init) or fetches (apply) the parameters of one `param_shapes` module.

  Norm scales start at one, every weight at the truncated normal.
  """
  out = {}
  with hk.name_scope(module):  # once per module: a second scope would be 'module_1'
    for name, shape in param_shapes(cfg)[module].items():
      ones = name == 'scale' or name.endswith('_norm')
      out[name] = hk.get_parameter(name, shape, jnp.dtype(cfg.param_dtype),
                                   init=jnp.ones if ones else _trunc_normal(cfg))
  return out


def _layer_params(cfg: ml_collections.ConfigDict) -> dict[str, jax.Array]:
  """The [L, ...] stacked layer weights, keyed by name (a block norm by its module)."""
  layer = {}
  for module in LAYER_MODULES:
    for name, value in _params(cfg, module).items():
      layer[module if name == 'scale' else name] = value
  return layer


def _forward(tokens_BT: jax.Array, segment_ids_BT: jax.Array | None,
             positions_BT: jax.Array | None, cfg: ml_collections.ConfigDict
             ) -> jax.Array:
  dtype = jnp.dtype(cfg.dtype)
  embedding_VD = _params(cfg, 'embed')['embedding']
  x_BTD = constrain_batch(jnp.take(embedding_VD, tokens_BT, axis=0).astype(dtype))
  layer = _layer_params(cfg)

  b, t = tokens_BT.shape
  if positions_BT is None:
    positions_BT = positions(cfg, b, t, segment_ids_BT)
  period = len(cfg.layer_pattern)
  # Sorted: a set's order follows the hash seed, and another order traces another program,
  # which the persistent compilation cache would miss on every other restart.
  ropes = {kind: rope_tables(positions_BT, *rope_frequencies(cfg, kind == 'F'))
           for kind in sorted(set(cfg.layer_pattern))}
  ops = kernels.select(cfg, segments=segment_ids_BT is not None)

  def group(x_BTD, group_params):
    """One period of the layer pattern (e.g. 3 sliding + 1 full)."""
    for j, kind in enumerate(cfg.layer_pattern):
      p = {name: value[j] for name, value in group_params.items()}
      x_BTD = _block(x_BTD, p, position=j, window=layer_window(cfg, j), rope=ropes[kind],
                     segment_ids_BT=segment_ids_BT, cfg=cfg, ops=ops)
    return constrain_batch(x_BTD), None

  scanned = cfg.num_layers != period
  if cfg.remat != 'none':
    # Inside scan XLA cannot merge the backward's recomputation with the forward, so the
    # barrier that prevent_cse adds is only cost there. A lone group needs it: without
    # it XLA merged the two and saved every activation (a 2-layer slice on a TPU v5e
    # compiled to the same memory and time under every policy, with one forward kernel
    # per layer).
    group = jax.checkpoint(group, policy=remat_policy(cfg),
                           prevent_cse=not scanned)
  # Scan over groups of one pattern period, so compile time does not grow with depth. A
  # single group ([L, ...] is already one period) is called directly: a one-step scan
  # computes the same, but tracing and lowering its loop (and, under grad, its partial
  # evaluation) took the small config's train step from 0.46 to 0.84 s at every start.
  if not scanned:
    x_BTD, _ = group(x_BTD, layer)
  else:
    grouped = {name: value.reshape(-1, period, *value.shape[1:])
               for name, value in layer.items()}
    x_BTD, _ = jax.lax.scan(group, x_BTD, grouped)

  scale_D = _params(cfg, 'final_norm')['scale']
  _params(cfg, 'lm_head')  # created here, applied by `head` (or inside loss.sums)
  return rms_norm(x_BTD, scale_D, cfg.norm_eps)


def build(cfg: ml_collections.ConfigDict) -> hk.Transformed:
  """init(rng, tokens_BT) -> params; apply(params, tokens_BT, ...) -> final-normed h_BTD.

  The output head is applied by the caller (`head`, or the chunked loss in
  loss.py) so that no [B, T, V] float32 array has to exist. The config is
  checked once, by the entry point (`validate`).
  """
  def fn(tokens_BT, segment_ids_BT=None, positions_BT=None):
    return _forward(tokens_BT, segment_ids_BT, positions_BT, cfg)
  return hk.without_apply_rng(hk.transform(fn))


def init_params(cfg: ml_collections.ConfigDict, rng: jax.Array) -> Params:
  return build(cfg).init(rng, jnp.zeros((1, 1), jnp.int32))


def head_weight(params: Params, dtype: Any, vocab_size: int | None = None) -> jax.Array:
  """The output head's [D, V] weight in compute dtype, its first `vocab_size` columns if given.

  The tokenizer's vocab can be smaller than the padded embedding (Olmo 3:
  100,278 of 100,352); scoring and sampling drop the padding columns.
  """
  w_DV = params['lm_head']['w']
  return (w_DV if vocab_size is None else w_DV[:, :vocab_size]).astype(dtype)


def head(params: Params, h_BTD: jax.Array, vocab_size: int | None = None) -> jax.Array:
  """Float32 logits [..., V] of final-normed hiddens; the matmul runs in their dtype,
  like HF and OLMo-core. (The training loss applies the same weight a chunk at a
  time inside loss.sums.)"""
  return (h_BTD @ head_weight(params, h_BTD.dtype, vocab_size)).astype(jnp.float32)


def logits(params: Params, tokens_BT: jax.Array, cfg: ml_collections.ConfigDict,
           segment_ids_BT: jax.Array | None = None) -> jax.Array:
  """Float32 logits [B, T, V] of a token batch."""
  return head(params, build(cfg).apply(params, tokens_BT, segment_ids_BT))


# --- Counting -----------------------------------------------------------------


def param_count(cfg: ml_collections.ConfigDict) -> int:
  """Exact number of parameters (the size of `init_params`' tree)."""
  return sum(math.prod(shape) for module in param_shapes(cfg).values()
             for shape in module.values())


def attended_pairs(seq_len: int, window: int | None) -> int:
  """(query, key) pairs a causal (optionally windowed) layer computes per sequence."""
  if window is None or window >= seq_len:
    return seq_len * (seq_len + 1) // 2
  return window * (window + 1) // 2 + (seq_len - window) * window


def flops_per_token(cfg: ml_collections.ConfigDict, seq_len: int) -> int:
  """Training FLOPs per token, OLMo-core's definition (`num_flops_per_token`).

  6 per weight of every matmul (attention incl. QK-norm weights, MLP, head
  incl. final norm; not the embedding lookup or block norms), plus 12*H*K per
  attended (query, key) pair: QK^T and PV, 2 FLOPs each, times 3 for the
  backward. Sliding layers count only the keys inside their window, so MFU
  reported here lines up with Ai2's dashboards.
  """
  D, F = cfg.d_model, cfg.mlp_hidden
  HK, GK = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  attn_weights = D * HK + 2 * D * GK + HK * D + HK + GK
  total = 6 * (cfg.vocab_size * D + D)  # lm_head incl. its norm
  for layer in range(cfg.num_layers):
    pairs = attended_pairs(seq_len, layer_window(cfg, layer))
    total += 6 * (attn_weights + 3 * D * F)
    total += 12 * HK * pairs // seq_len
  return total

