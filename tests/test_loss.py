"""loss.py (and kernels/chunked_ce.py under it) against a float64 numpy formula.

The sums, their gradients (the hand-written backward included) and the
denominator, chunked or not, with rejected instances and ignored labels.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import loss


def _np_loss_and_grads(h, w, labels, mask, z):
  """Float64 reference: (ce_sum, z_sum) and d[(ce+z)/denominator]/d(h, w)."""
  h, w = h.astype(np.float64), w.astype(np.float64)
  logits = h @ w
  top = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
  valid = (labels != -100) & mask[:, None]
  y = np.where(valid, labels, 0)
  target = np.take_along_axis(logits, y[..., None], -1)[..., 0]
  ce, zs = (lse - target)[valid].sum(), z * (lse[valid] ** 2).sum()
  p = np.exp(logits - lse[..., None])
  d = p - np.eye(w.shape[1])[y] + 2 * z * lse[..., None] * p
  d *= valid[..., None] / (labels != -100).sum()
  return ce, zs, d @ w.T, np.einsum('btd,btv->dv', h, d)


def _loss_batch(b=4, t=10, d=8, v=32, seed=0):
  rng = np.random.default_rng(seed)
  h = rng.normal(0, 1, (b, t, d)).astype(np.float32)
  w = rng.normal(0, 0.7, (d, v)).astype(np.float32)
  labels = rng.integers(0, v, (b, t)).astype(np.int32)
  labels[:, -1] = -100  # last position has no next token
  labels[1, 2:5] = -100
  mask = np.array([True, False, True, True])[:b]  # instance 1 rejected
  return h, w, labels, mask


class LossTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(3, 4, 10, 64)  # 3 and 4 pad T=10; 64 > T
  def test_sums_match_float64(self, chunk):
    h, w, labels, mask = _loss_batch()
    fn = self.variant(lambda *a: loss.sums(*a, z_loss=0.1, chunk=chunk))
    ce, zs = fn(h, w, labels, mask)
    want_ce, want_z, _, _ = _np_loss_and_grads(h, w, labels, mask, 0.1)
    np.testing.assert_allclose(ce, want_ce, rtol=1e-5)
    np.testing.assert_allclose(zs, want_z, rtol=1e-5)
    self.assertEqual(int(loss.denominator(labels)), int((labels != -100).sum()))

  def test_denominator_counts_rejected_instances_as_full_length(self):
    """OLMo-core TransformerTrainModule: rejected rows' labels become -100, then T is added back."""
    _, _, labels, mask = _loss_batch()
    olmo_core_labels = np.where(np.asarray(mask)[:, None], labels, -100)
    want = (olmo_core_labels != -100).sum() + (~np.asarray(mask)).sum() * labels.shape[1]
    self.assertGreater((~np.asarray(mask)).sum(), 0)
    self.assertEqual(int(loss.denominator(labels, mask)), int(want))

  @chex.variants(with_jit=True, without_jit=True)
  def test_bf16_hidden_upcasts_logits(self):
    h, w, labels, mask = _loss_batch()
    ce, zs = self.variant(lambda *a: loss.sums(*a, z_loss=1e-5, chunk=4))(
        jnp.asarray(h, jnp.bfloat16), w, labels, mask)
    self.assertEqual((ce.dtype, zs.dtype), (jnp.float32, jnp.float32))
    want_ce, want_z, _, _ = _np_loss_and_grads(h, w, labels, mask, 1e-5)
    np.testing.assert_allclose(ce, want_ce, rtol=2e-2)  # bf16 inputs and logits
    np.testing.assert_allclose(zs, want_z, rtol=2e-2)

  # jit only: each un-jitted call re-traces the rematerialised scan (~2 s).
  @chex.variants(with_jit=True)
  @parameterized.parameters((1, 4), (2, 4), (4, 4), (1, 64), (2, 64))  # 64 > T: no chunking
  def test_micro_batch_accumulation(self, micro_batches, chunk):
    """Sum over micro-batches of grad((ce+z)/global denominator) = the float64 gradient."""
    h, w, labels, mask = _loss_batch()
    denom = loss.denominator(labels)

    def mb_loss(h, w, labels, mask):
      ce, zs = loss.sums(h, w, labels, mask, z_loss=0.1, chunk=chunk)
      return (ce + zs) / denom
    grad = self.variant(jax.grad(mb_loss, argnums=(0, 1)))
    dh, dw = [], 0.0
    for idx in np.split(np.arange(4), micro_batches):
      gh, gw = grad(h[idx], w, labels[idx], mask[idx])
      dh.append(gh)
      dw = dw + gw
    _, _, want_dh, want_dw = _np_loss_and_grads(h, w, labels, mask, 0.1)
    np.testing.assert_allclose(np.concatenate(dh), want_dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.concatenate(dh)[1], 0.0)  # rejected: no gradient

  def test_one_logits_block_at_a_time(self):
    """Compiled forward+backward at V=100352 holds ~one [C, V] float32 block, not [T, V]."""
    t, d, v, chunk = 256, 16, 100_352, 32
    args = (jnp.zeros((1, t, d)), jnp.zeros((d, v)), jnp.zeros((1, t), jnp.int32),
            jnp.ones((1,), bool))

    def temp_bytes(chunk):
      total = lambda h, w, y, m: sum(loss.sums(h, w, y, m, z_loss=1e-5, chunk=chunk))
      compiled = jax.jit(jax.grad(total, argnums=(0, 1))).lower(*args).compile()
      return compiled.memory_analysis().temp_size_in_bytes
    block = chunk * v * 4
    self.assertLess(temp_bytes(chunk), 4 * block)  # logits, their gradient, slack
    # Unchunked, the whole [T, V] exists, once: the gradient is written over the logits.
    self.assertGreaterEqual(temp_bytes(t), t * v * 4)
    self.assertLess(temp_bytes(t), 2 * t * v * 4)

  def test_bad_shapes(self):
    h, w, labels, mask = _loss_batch()
    with pytest.raises(ValueError, match='instance_mask'):
      loss.sums(h, w, labels, mask.astype(np.int32), z_loss=0.0, chunk=4)
    with pytest.raises(ValueError, match='head'):
      loss.sums(h, w.T, labels, mask, z_loss=0.0, chunk=4)


# --- One held-out loss for train.py and eval.py ------------------------------------------


def test_eval_heldout_equals_the_runs_own_validation_loss_with_a_padded_vocab(tmp_path):
  """train.py logs eval/lm/validation/CE loss at step 2; eval.py --suite=heldout on that
  checkpoint reads the same batches and must report the same number. The model's head has
  128 padding columns past the data's 256 ids (random at step 2, as at init), so a CE that
  leaves them out of the softmax differs by ~log(384/256) nats; float32 rounding of the
  two summation orders is ~1e-7 relative."""
  import json
  import os
  import subprocess
  import sys

  from test_train import REPO, config_flags
  tokens = np.fromfile(os.path.join(REPO, 'data', 'shakespeare-train-00000.npy'), '<u4',
                       64 * 16 * 6) % 256
  paths = str(tmp_path / 'train.npy'), str(tmp_path / 'validation.npy')
  np.save(paths[0], tokens[:64 * 16 * 4].astype(np.uint32))
  np.save(paths[1], tokens[64 * 16 * 4:].astype(np.uint32))
  workdir = tmp_path / 'run'
  run = subprocess.run(
      [sys.executable, os.path.join(REPO, 'train.py'), f'--workdir={workdir}',
       '--sample_tokens=0', *config_flags(paths), '--config.model.vocab_size=384',
       '--config.train.steps=2', '--config.train.eval_every=2', '--config.train.ckpt_every=2'],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  records = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  [in_loop] = [r['eval/lm/validation/CE loss'] for r in records
               if 'eval/lm/validation/CE loss' in r]
  report = tmp_path / 'report.json'
  run = subprocess.run(
      [sys.executable, os.path.join(REPO, 'eval.py'), f'--checkpoint={workdir}/checkpoints',
       '--suite=heldout', f'--output={report}'],
      cwd=REPO, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  heldout = json.loads(report.read_text())['heldout']
  assert heldout['tokens'] == 16 * 63  # one batch of 16 instances, as train.py's evaluator
  assert heldout['loss'] == pytest.approx(in_loop, rel=2e-6, abs=0)
