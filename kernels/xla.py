"""XLA paths tuned for CPU: a matmul and a query-blocked causal attention.

Both compute exactly what model.py's equations say; what they change is the
backward pass XLA is given, because autodiff's version wrote large transposed
copies on XLA:CPU (measured in docs/results/cpu_speed.md):

- `matmul(x, w)` forms the weight gradient straight into [in, out].
- `attention(q, k, v, ...)` runs `block_q` queries at a time against only the
  keys their causal window reaches, with a flash-style hand-written backward
  that keeps the float32 probabilities and no other [.., T, S] array.

They run on any backend (they are plain XLA) and are the 'xla'
attention_impl; TPU and GPU normally pick their flash kernels instead (see
kernels/__init__.py).

Shapes: B batch, T queries, S keys, H query heads, G kv heads, R = H // G,
K head_dim, I/O a matmul's input/output features.
"""

import glob
import importlib.util
import os

import jax
import jax.numpy as jnp

# XLA:CPU's concurrency-optimized scheduler orders a program so that
# independent ops run at the same time. On a CPU each matmul already uses
# every core, so overlapped matmuls only contend for them and their caches:
# without it the bench_train step is ~6% faster, with identical results
# (docs/results/cpu_speed.md).
CPU_FLAGS = ('--xla_cpu_enable_concurrency_optimized_scheduler=false',)


# libtpu installed on a machine without TPU chips (a CPU machine with the test extra, a
# host that plans pods with plan.py --topology) asks a TPU VM's metadata server for the
# slice it is on when it loads, and prints three lines of warnings when none answers.
# The first two placeholders answer for it (sharding.cluster_detected knows the host
# name for no pod). ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu takes /tmp/libtpu_lockfile at every
# load, chips or not, and a second process loading it at the same moment (parallel test
# workers, two planners) failed on it; the lock guards chips, which such a process never
# opens (tests/test_tpu_compile.py). A TPU VM's own values win.
LIBTPU_PLACEHOLDERS = {'TPU_ACCELERATOR_TYPE': 'v5litepod-4', 'TPU_WORKER_HOSTNAMES': 'localhost',
                       'ALLOW_MULTIPLE_LIBTPU_LOAD': '1'}
_GOOGLE_PCI_VENDOR = '0x1ae0'  # TPU chips are PCI devices of their host


def set_cpu_flags() -> None:
  """Adds CPU_FLAGS to XLA_FLAGS where it does not set them already (an XLA_FLAGS that
  does wins), and quiets libtpu where it is installed on a machine without TPU chips.
  Both are read when a backend starts, so the entry points (train.py, plan.py, bench/)
  call this first; importing changes nothing."""
  current = os.environ.get('XLA_FLAGS', '')
  missing = [f for f in CPU_FLAGS if f.split('=')[0] not in current]
  if missing:
    os.environ['XLA_FLAGS'] = ' '.join([current, *missing]).strip()
  quiet_libtpu()


def quiet_libtpu() -> None:
  """Sets LIBTPU_PLACEHOLDERS where libtpu is installed and this host has no TPU chips.

  Called where a backend is about to start (set_cpu_flags for train.py, plan.py and
  bench/; tests/conftest.py), never at import: importing the model changes no
  environment variable."""
  if importlib.util.find_spec('libtpu') and not has_tpu_chips():
    for key, value in LIBTPU_PLACEHOLDERS.items():
      os.environ.setdefault(key, value)


def has_tpu_chips() -> bool:
  """Whether this host has TPU chips (Google's PCI vendor id among its devices)."""
  for path in glob.glob('/sys/bus/pci/devices/*/vendor'):
    try:
      with open(path) as f:
        if f.read().strip() == _GOOGLE_PCI_VENDOR:
          return True
    except OSError:
      continue
  return False


@jax.custom_vjp
def matmul(x_BTI: jax.Array, w_IO: jax.Array) -> jax.Array:
  """x @ w, with a backward that forms the weight gradient straight into [I, O].

  One contraction over every leading axis. Autodiff's [O, I] product plus a
  transpose made XLA:CPU first write a transposed (and recomputed) copy of
  each activation gradient, about a third of an MLP's backward time.
  """
  return x_BTI @ w_IO


def _matmul_fwd(x_BTI, w_IO):
  return x_BTI @ w_IO, (x_BTI, w_IO)


def _matmul_bwd(residuals, dy_BTO):
  x_BTI, w_IO = residuals
  return (jnp.einsum('...o,io->...i', dy_BTO, w_IO),
          jnp.einsum('...i,...o->io', x_BTI, dy_BTO))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def attention_mask(t: int, s: int, window: int | None, segment_ids_BT: jax.Array | None,
                   rows: tuple[int, int], cols: tuple[int, int]) -> jax.Array:
  """Boolean [B|1, rows, cols] block of the mask: causal, banded by `window`, within documents.

  The T queries are the last T of the S keys' positions; `rows` and `cols`
  are the [start, stop) of the block's queries and keys.
  """
  q_T1 = jnp.arange(*rows)[:, None] + (s - t)
  k_1S = jnp.arange(*cols)[None, :]
  mask_TS = k_1S <= q_T1
  if window is not None:
    mask_TS &= k_1S > q_T1 - window
  mask_BTS = mask_TS[None]
  if segment_ids_BT is not None:
    seg_q_BT, seg_k_BS = segment_ids_BT[:, slice(*rows)], segment_ids_BT[:, slice(*cols)]
    mask_BTS = mask_BTS & (seg_q_BT[:, :, None] == seg_k_BS[:, None, :])
  return mask_BTS


def attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, *,
              window: int | None, segment_ids_BT: jax.Array | None = None,
              block_q: int | None = None) -> jax.Array:
  """Float32 softmax, probabilities cast to the input dtype (HF eager), by query blocks.

  Masked-out blocks cost nothing (on the 3:1 pattern's sliding layers, most
  of them). Default block: 128 queries, or the window if smaller (at least 32).
  """
  b, t, h, k = q_BTHK.shape
  s, g = k_BSGK.shape[1], k_BSGK.shape[2]
  if block_q is None:
    block_q = 128 if window is None else min(128, max(32, window))
  # Head-major operands, so every product is a plain batched matmul over
  # (b, g) and the [.., T, S] probabilities feed the next one in the layout
  # they were written in (on CPU XLA otherwise copies them to transpose).
  q_BGRTK = q_BTHK.reshape(b, t, g, h // g, k).transpose(0, 2, 3, 1, 4)
  k_BGSK = k_BSGK.transpose(0, 2, 1, 3)
  v_BGSK = v_BSGK.transpose(0, 2, 1, 3)
  outs = []
  for q_lo in range(0, t, block_q):
    q_hi = min(t, q_lo + block_q)
    k_hi = q_hi + s - t  # causal: nothing after the block's last query
    k_lo = 0 if window is None else max(0, q_lo + s - t - window + 1)
    mask_BTS = attention_mask(t, s, window, segment_ids_BT, (q_lo, q_hi), (k_lo, k_hi))
    outs.append(attend_block(q_BGRTK[:, :, :, q_lo:q_hi], k_BGSK[:, :, k_lo:k_hi],
                             v_BGSK[:, :, k_lo:k_hi], mask_BTS))
  out_BGRTK = jnp.concatenate(outs, axis=3)
  return out_BGRTK.transpose(0, 3, 1, 2, 4).reshape(b, t, h, k)


@jax.custom_vjp
def attend_block(q_BGRTK: jax.Array, k_BGSK: jax.Array, v_BGSK: jax.Array, mask_BTS: jax.Array
                 ) -> jax.Array:
  """softmax(q k^T / sqrt(K), masked) v for one query block; every row sees >= 1 key.

  Public: context_parallel.py's xla path runs its query blocks through it too.
  """
  return _attend_fwd(q_BGRTK, k_BGSK, v_BGSK, mask_BTS)[0]


def _attend_fwd(q_BGRTK, k_BGSK, v_BGSK, mask_BTS):
  logits_BGRTS = jnp.einsum('bgrtk,bgsk->bgrts', q_BGRTK, k_BGSK,
                            preferred_element_type=jnp.float32) * q_BGRTK.shape[-1] ** -0.5
  logits_BGRTS = jnp.where(mask_BTS[:, None, None], logits_BGRTS, -jnp.inf)
  exp_BGRTS = jnp.exp(logits_BGRTS - jnp.max(logits_BGRTS, axis=-1, keepdims=True))
  probs_BGRTS = exp_BGRTS / jnp.sum(exp_BGRTS, axis=-1, keepdims=True)
  out_BGRTK = jnp.einsum('bgrts,bgsk->bgrtk', probs_BGRTS.astype(q_BGRTK.dtype), v_BGSK)
  return out_BGRTK, (q_BGRTK, k_BGSK, v_BGSK, probs_BGRTS, out_BGRTK)


def _attend_bwd(residuals, dout_BGRTK):
  """The softmax backward as flash attention does it: rowsum(P * dP) = rowsum(dO * O)."""
  q_BGRTK, k_BGSK, v_BGSK, probs_BGRTS, out_BGRTK = residuals
  dtype = q_BGRTK.dtype
  dv_BGSK = jnp.einsum('bgrts,bgrtk->bgsk', probs_BGRTS.astype(dtype), dout_BGRTK)
  dprobs_BGRTS = jnp.einsum('bgrtk,bgsk->bgrts', dout_BGRTK, v_BGSK,
                            preferred_element_type=jnp.float32)
  delta_BGRT1 = jnp.sum(dout_BGRTK.astype(jnp.float32) * out_BGRTK.astype(jnp.float32),
                        axis=-1, keepdims=True)
  dlogits_BGRTS = (probs_BGRTS * (dprobs_BGRTS - delta_BGRT1)
                   * q_BGRTK.shape[-1] ** -0.5).astype(dtype)
  dq_BGRTK = jnp.einsum('bgrts,bgsk->bgrtk', dlogits_BGRTS, k_BGSK)
  dk_BGSK = jnp.einsum('bgrts,bgrtk->bgsk', dlogits_BGRTS, q_BGRTK)
  return dq_BGRTK, dk_BGSK, dv_BGSK, None


attend_block.defvjp(_attend_fwd, _attend_bwd)
