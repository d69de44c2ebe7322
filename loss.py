"""The training loss: cross-entropy plus z-loss, summed over tokens, over the global label count.

Reference facts: docs/optimizer.md (the loss). OLMo-core's train module
computes, per micro-batch, the sum of token CE losses (and of z-loss) over
the valid labels, and divides by the label count of the whole global batch,
so gradient accumulation and data parallelism change nothing. This module
holds all three parts: which labels count (IGNORE_INDEX, the instance mask),
the sums, and the denominator. train.py divides one by the other.

The softmax runs over every column of the head it is given, and training
gives the whole head (model.head_weight without vocab_size): the padding
columns past the tokenizer's vocabulary (Olmo 3: 100,278 real of 100,352)
count too, as in OLMo-core's loss over the padded embedding. Held-out loss is
the same CE without z-loss (held_out_sums) over the same whole head, for
train.py's in-loop `eval/lm/<set>/CE loss` and eval.py's --suite=heldout on
a train.py checkpoint alike, so the two report one number on the same
batches (eval.py gives an HF model's head its own width, as HF scores it).

The output head (model.head_weight) is applied inside the sums, a chunk of
positions at a time, so that no [B, T, V] float32 logits array has to exist
(kernels/chunked_ce.py: the per-chunk sums and their CPU-tuned backward).

Shapes: B batch, T time, D d_model, V vocab, C positions per logits chunk,
N chunks per sequence.
"""

import jax
import jax.numpy as jnp

from kernels.chunked_ce import chunk_sums

IGNORE_INDEX = -100  # OLMo-core label_ignore_index: a label that counts nowhere


@jax.named_scope('loss')  # names its ops in profiles (bench/profile_breakdown.py)
def sums(hidden_BTD: jax.Array, w_head_DV: jax.Array, labels_BT: jax.Array,
         instance_mask_B: jax.Array, *, z_loss: float, chunk: int
         ) -> tuple[jax.Array, jax.Array]:
  """(CE sum, z_loss * sum(logsumexp^2)) over valid labels, float32.

  Valid: label != IGNORE_INDEX and the instance not rejected. The head runs
  in the hidden's dtype and its logits are upcast to float32 (OLMo-core's LM
  head under bf16 mixed precision, then `cross_entropy_loss`). With chunk >= T
  the [B, T, V] float32 logits are kept for the backward (three head matmuls,
  the fastest). Otherwise they are built C positions at a time inside a scan
  whose body is rematerialised, so neither pass holds more than one chunk's
  [B, C, V] logits (and their gradient) at a time, for one extra head matmul.
  """
  if hidden_BTD.ndim != 3 or labels_BT.shape != hidden_BTD.shape[:2]:
    raise ValueError(f'loss.sums: hidden {hidden_BTD.shape} must be [B, T, D] and labels '
                     f'{labels_BT.shape} [B, T].')
  b, t, d = hidden_BTD.shape
  if w_head_DV.ndim != 2 or w_head_DV.shape[0] != d:
    raise ValueError(f'loss.sums: head {w_head_DV.shape} must be [D={d}, V].')
  if instance_mask_B.shape != (b,) or instance_mask_B.dtype != jnp.bool_:
    raise ValueError(f'loss.sums: instance_mask {instance_mask_B.shape} '
                     f'{instance_mask_B.dtype} must be bool [B={b}].')
  if chunk < 1:
    raise ValueError(f'loss.sums: chunk={chunk} must be >= 1 (cfg.opt.loss_chunk).')
  valid_BT = (labels_BT != IGNORE_INDEX) & instance_mask_B[:, None]
  targets_BT = jnp.where(valid_BT, labels_BT, 0)
  w_DV = w_head_DV.astype(hidden_BTD.dtype)
  if chunk >= t:
    ce_sum, z_sq_sum = chunk_sums(w_DV, hidden_BTD.reshape(b * t, d), targets_BT.reshape(-1),
                                  valid_BT.reshape(-1))
    return ce_sum, z_loss * z_sq_sum

  pad = -t % chunk  # padded positions are invalid and so count nowhere
  if pad:
    hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
    targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    valid_BT = jnp.pad(valid_BT, ((0, 0), (0, pad)))
  n = (t + pad) // chunk
  h_NBCD = hidden_BTD.reshape(b, n, chunk, d).swapaxes(0, 1)
  y_NBC = targets_BT.reshape(b, n, chunk).swapaxes(0, 1)
  m_NBC = valid_BT.reshape(b, n, chunk).swapaxes(0, 1)

  def one_chunk(w_DV, h_BCD, y_BC, m_BC):
    return chunk_sums(w_DV, h_BCD.reshape(-1, d), y_BC.reshape(-1), m_BC.reshape(-1))
  rematted = jax.checkpoint(one_chunk, prevent_cse=False)  # scan already blocks CSE

  def body(carry, xs):
    ce, zz = rematted(w_DV, *xs)
    return (carry[0] + ce, carry[1] + zz), None

  zero = jnp.zeros([], jnp.float32)
  (ce_sum, z_sq_sum), _ = jax.lax.scan(body, (zero, zero), (h_NBCD, y_NBC, m_NBC))
  return ce_sum, z_loss * z_sq_sum


def denominator(labels_BT: jax.Array, instance_mask_B: jax.Array | None = None) -> jax.Array:
  """Label count of the whole global batch that the summed losses are divided by.

  Labels != IGNORE_INDEX of kept instances, plus all T positions of each
  instance the repetition filter rejected: OLMo-core's train module adds
  `(~instance_mask).sum() * tokens_per_instance` back, so a rejected instance
  counts as T zero-loss tokens.
  """
  valid_BT = labels_BT != IGNORE_INDEX
  if instance_mask_B is None:
    return jnp.sum(valid_BT, dtype=jnp.int32)
  kept = jnp.sum(valid_BT & instance_mask_B[:, None], dtype=jnp.int32)
  return kept + jnp.sum(~instance_mask_B, dtype=jnp.int32) * labels_BT.shape[1]


def held_out_sums(hidden_BTD: jax.Array, w_head_DV: jax.Array, labels_BT: jax.Array,
                  instance_mask_B: jax.Array, *, chunk: int) -> tuple[jax.Array, jax.Array]:
  """(CE sum, label count) of held-out tokens: sums() without z-loss, over denominator()'s
  labels. `w_head_DV`: the head the model trained with (for our runs the whole head,
  padding columns included)."""
  ce_sum, _ = sums(hidden_BTD, w_head_DV, labels_BT, instance_mask_B, z_loss=0.0, chunk=chunk)
  return ce_sum, denominator(labels_BT, instance_mask_B)
