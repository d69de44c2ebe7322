"""The cross-entropy sums of one chunk of positions, with a backward tuned for CPU.

loss.py builds the loss from `chunk_sums`: the output head's logits for M
positions, their logsumexp, and the (CE, lse^2) sums over the valid ones. The
math is plain; what this file changes is the memory traffic of the backward
pass XLA is given (measured in docs/results/cpu_speed.md).

Shapes: M positions (rows, flat), D d_model, V vocab.
"""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def chunk_sums(w_DV: jax.Array, h_MD: jax.Array, y_M: jax.Array, m_M: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
  """(sum of lse - logit[y], sum of lse^2) over the positions where m is set, float32.

  logits = h @ w in the operands' dtype, upcast to float32 (OLMo-core's LM
  head under bf16 mixed precision, then its `cross_entropy_loss`).
  """
  return _fwd(w_DV, h_MD, y_M, m_M)[0]


def _fwd(w_DV, h_MD, y_M, m_M):
  # The target logit is taken as h . w[:, y] rather than read from the
  # logits: then the backward's single elementwise pass is the logits' last
  # reader, and XLA writes their gradient over them in place (the step's
  # largest buffer once instead of twice; on a CPU every fresh page costs a
  # fault, every step).
  logits_MV = (h_MD @ w_DV).astype(jnp.float32)
  lse_M = jax.nn.logsumexp(logits_MV, axis=-1)
  target_M = jnp.einsum('md,dm->m', h_MD, jnp.take(w_DV, y_M, axis=1)).astype(jnp.float32)
  sums = (jnp.sum(jnp.where(m_M, lse_M - target_M, 0.0)),
          jnp.sum(jnp.where(m_M, jnp.square(lse_M), 0.0)))
  return sums, (w_DV, h_MD, y_M, m_M, logits_MV, lse_M)


def _bwd(residuals, cotangents):
  """d/dlogits = m * (softmax * (g_ce + 2 g_z lse) - g_ce * onehot(y)), built in one pass.

  Hand-written because autodiff's version, on CPU, also writes a transposed
  copy of the [M, V] gradient for the head's weight gradient (a second full
  pass over the step's largest array); here both matmuls read the one copy.
  """
  w_DV, h_MD, y_M, m_M, logits_MV, lse_M = residuals
  g_ce, g_z = cotangents
  scale_M = jnp.where(m_M, g_ce + 2 * g_z * lse_M, 0.0)
  target_M = jnp.where(m_M, g_ce, 0.0)
  onehot_MV = y_M[:, None] == jnp.arange(logits_MV.shape[-1], dtype=y_M.dtype)[None]
  dlogits_MV = (jnp.exp(logits_MV - lse_M[:, None]) * scale_M[:, None]
                - jnp.where(onehot_MV, target_M[:, None], 0.0)).astype(h_MD.dtype)
  dh_MD = jnp.einsum('mv,dv->md', dlogits_MV, w_DV)
  dw_DV = jnp.einsum('md,mv->dv', h_MD, dlogits_MV)
  return dw_DV, dh_MD, None, None


chunk_sums.defvjp(_fwd, _bwd)
