"""optim.py against OLMo-core (SkipStepAdamW, its schedulers, its train module's
clipping; CPU torch) and float64 numpy formulas."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from absl.testing import parameterized
from olmo_core.optim import SkipStepAdamW
from olmo_core.optim.scheduler import CosWithWarmup, HalfCosWithWarmup, LinearWithWarmup

import optim
from configs import olmo3_7b, olmo3_7b_stage2

STAGE1_STEPS = (1, 2000, 596_047, 596_048, 597_046, 1_413_814)  # docs/recipe.md boundaries


def _opt_cfg(**overrides):
  cfg = olmo3_7b.get_config().opt
  cfg.update(overrides)
  return cfg


# --- Schedules -------------------------------------------------------------------


def _olmo3_md_stitched(s: int) -> float:
  """docs/recipe.md, written out: part 1 up to the resumed checkpoint, then part 2."""
  if s <= 596_047:
    if s < 2000:
      return 3e-4 * s / 2000
    return 3e-5 + 2.7e-4 * (1 + math.cos(math.pi * (s - 2000) / (1_192_093 - 2000))) / 2
  w, t_max = 597_046, 1_668_931
  if s < w:
    return 1.65e-4 * s / w
  c, t = s - w, t_max - w
  return 3e-5 + 2.7e-4 * (1 + math.cos(math.pi * (c + t) / (2 * t))) / 2


def _olmo_core_lr(cfg, s: int) -> float:
  """The same schedules built from OLMo-core's own scheduler classes."""
  if cfg.schedule == 'linear':
    return LinearWithWarmup(warmup=cfg.warmup_steps, alpha_f=cfg.final_lr / cfg.lr,
                            t_max=cfg.t_max).get_lr(cfg.lr, s, cfg.t_max)
  alpha = cfg.final_lr / cfg.lr
  part1 = CosWithWarmup(warmup=cfg.warmup_steps, alpha_f=alpha, t_max=cfg.t_max)
  if cfg.schedule == 'single_cosine':
    part1 = CosWithWarmup(warmup=cfg.warmup_steps, alpha_f=alpha, t_max=cfg.single_cosine_t_max)
  if cfg.schedule != 'olmo3_stitched' or s <= cfg.part2_start:
    return part1.get_lr(cfg.lr, s, 1_413_814)
  part2 = HalfCosWithWarmup(warmup=cfg.part2_warmup, alpha_f=alpha, t_max=cfg.part2_t_max)
  return part2.get_lr(cfg.lr, s, 1_413_814)


@pytest.mark.parametrize('schedule', ['olmo3_stitched', 'cosine', 'single_cosine'])
def test_stage1_schedules_float64(schedule):
  cfg = _opt_cfg(schedule=schedule)
  lr = optim.lr_schedule(cfg)
  for s in STAGE1_STEPS:
    np.testing.assert_allclose(lr(s), _olmo_core_lr(cfg, s), rtol=1e-12, atol=0, err_msg=s)
    if schedule == 'olmo3_stitched':
      np.testing.assert_allclose(lr(s), _olmo3_md_stitched(s), rtol=1e-12, atol=0)
  np.testing.assert_allclose(lr(1), 3e-4 / 2000, rtol=1e-12)  # first step uses step 1
  np.testing.assert_allclose(lr(2000), 3e-4, rtol=1e-12)


def test_stitched_dip_and_end():
  lr = optim.lr_schedule(_opt_cfg())
  assert lr(596_048) < lr(596_047)  # part 2's warmup restarts below part 1's LR
  assert lr(596_048) < lr(597_046)
  np.testing.assert_allclose(lr(597_046), 1.65e-4, rtol=1e-12)
  np.testing.assert_allclose(lr(1_413_814), 3.9325e-5, rtol=1e-4)  # docs/recipe.md: ~3.93e-5


def test_stage2_schedule_float64():
  cfg = olmo3_7b_stage2.get_config().opt
  lr = optim.lr_schedule(cfg)
  peak = 2.0712352850360292e-4
  for s in (0, 1, 20_000, 47_684):
    want = peak * (1 - s / 47_684)
    np.testing.assert_allclose(lr(s), want, rtol=1e-12, atol=0, err_msg=s)
    np.testing.assert_allclose(lr(s), _olmo_core_lr(cfg, s), rtol=1e-12, atol=0)
  assert lr(0) == peak and lr(47_684) == 0.0


class ScheduleJnpTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters('olmo3_stitched', 'cosine', 'single_cosine', 'linear')
  def test_jnp_matches_float64(self, schedule):
    cfg = (olmo3_7b_stage2.get_config().opt if schedule == 'linear'
           else _opt_cfg(schedule=schedule))
    lr = optim.lr_schedule(cfg)
    steps = (0, 1, 2, 1999, 2000, 2001, 47_684, 596_047, 596_048, 597_045, 597_046,
             597_047, 1_192_093, 1_413_814, 1_700_000)
    got = self.variant(jax.vmap(lr))(jnp.asarray(steps, jnp.int32))
    assert got.dtype == jnp.float32
    want = np.array([_olmo_core_lr(cfg, s) for s in steps])
    # float32 rounding: a few ulp of each value (the cosine argument is rounded once).
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=0)


# Every schedule of optim.SCHEDULES, plus a cosine decaying to 0 (where nothing
# dilutes the tail's rounding), over its whole range.
WHOLE_RANGE = {
    'olmo3_stitched': lambda: _opt_cfg(),
    'cosine': lambda: _opt_cfg(schedule='cosine'),
    'cosine_to_zero': lambda: _opt_cfg(schedule='cosine', final_lr=0.0),
    'single_cosine': lambda: _opt_cfg(schedule='single_cosine'),
    'linear': lambda: olmo3_7b_stage2.get_config().opt,
}


@pytest.mark.parametrize('name', sorted(WHOLE_RANGE))
def test_float32_lr_within_1e6_of_float64_over_the_whole_range(name):
  """The jitted float32 LR against the float64 schedule and OLMo-core's, to the last step.

  Every step within 64 of a phase boundary (warmup ends, part 2 starts, each
  decay ends) and every 97th step in between; the linear stage 2 at every
  step. A decay written `lr - (lr - final) * x` cancels as x -> 1: at stage
  2's step 47,683 float32 gave 4.3533e-9 for OLMo-core's 4.3437e-9.
  """
  cfg = WHOLE_RANGE[name]()
  edges = [cfg.warmup_steps, cfg.t_max, cfg.single_cosine_t_max]
  if name == 'olmo3_stitched':
    edges += [cfg.part2_start, cfg.part2_warmup, cfg.part2_t_max]
  end = max(edges) + 64
  every = set(range(0, cfg.t_max + 64)) if name == 'linear' else set()  # the stage-2 decay
  steps = np.array(sorted(every | set(range(0, end, 97)) | {
      min(max(e + d, 0), end) for e in edges for d in range(-64, 65)}))
  lr = optim.lr_schedule(cfg)
  float64 = lr(steps)
  # OLMo-core's own float64 rounds `1 + cos(...)` and `lr - (lr - final) * x`
  # to ~2^-53 of lr, which near a zero floor is more than 1e-12 of the value.
  want = np.array([_olmo_core_lr(cfg, s) for s in steps])
  np.testing.assert_allclose(float64, want, rtol=1e-12, atol=2.0 ** -52 * cfg.lr)
  got = jax.jit(jax.vmap(lr))(jnp.asarray(steps, jnp.int32))
  assert got.dtype == jnp.float32
  got = np.asarray(got, np.float64)
  zero = float64 == 0  # the end of a decay to 0
  assert np.array_equal(zero, want == 0) and np.all(got[zero] == 0)
  rel = np.abs(got[~zero] - float64[~zero]) / float64[~zero]
  assert rel.max() < 1e-6, (rel.max(), steps[~zero][rel.argmax()])


@pytest.mark.parametrize('field, value', [
    ('lr', math.inf), ('lr', math.nan), ('lr', 0.0), ('lr', -3e-4),
    ('final_lr', -1e-5), ('final_lr', math.nan), ('final_lr', 1e-3),  # above lr
    ('warmup_steps', -1), ('b1', 1.0), ('b1', -0.1), ('b2', math.nan), ('eps', 0.0),
    ('eps', math.inf), ('weight_decay', -0.1), ('weight_decay', math.nan),
    ('clip_grad_norm', -1.0), ('clip_grad_norm', math.inf), ('z_loss', -1e-5),
    ('loss_chunk', 0), ('skip_window', 5), ('skip_sigma', 0.0),
])
def test_bad_values_are_refused_naming_the_field_and_the_fix(field, value):
  cfg = _opt_cfg(**{field: value})
  with pytest.raises(ValueError) as error:
    optim.check_config(cfg)
  assert f'cfg.opt.{field}={value!r} must be' in str(error.value)
  assert f'set --config.opt.{field}' in str(error.value)


def test_no_clipping_is_allowed():
  optim.check_config(_opt_cfg(clip_grad_norm=0.0))  # 0 means off (OLMo-core max_grad_norm=None)


def test_schedule_errors():
  with pytest.raises(ValueError, match='schedule'):
    optim.check_config(_opt_cfg(schedule='cosin'))
  with pytest.raises(ValueError, match='t_max'):
    optim.check_config(_opt_cfg(schedule='cosine', t_max=10))


# --- Optimizer against OLMo-core -------------------------------------------------

N_STEPS = 400
SHAPES = {'embed': {'embedding': (16, 8)}, 'attention': {'w_q': (8, 8)},
          'final_norm': {'scale': (8,)}, 'lm_head': {'w': (8, 16)}}


def _init_params(rng):
  return jax.tree.map(lambda s: rng.normal(0, 0.5, s).astype(np.float32), SHAPES,
                      is_leaf=lambda x: isinstance(x, tuple))


# Probes at 6 sigma * (1 -+ 1e-3) of the previous 128 finite values: OLMo-core's
# Bessel std keeps the first of each pair, a population std would skip both.
PROBES = {300: ('loss', 0.999), 310: ('loss', 1.001), 320: ('norm', 0.999),
          330: ('norm', 1.001)}


def _threshold(history, frac):
  window = np.array(history[-128:], np.float64)
  return window.mean() + 6 * window.std(ddof=1) * frac


def _stream(nan_loss_step=None):
  """Per-step (grads, CE loss): noise, planted spikes and probes, optional NaN loss."""
  rng = np.random.default_rng(0)
  params = _init_params(rng)
  steps, losses, norms = [], [], []
  for k in range(1, N_STEPS + 1):
    g = jax.tree.map(lambda p: rng.normal(0, 0.05, p.shape).astype(np.float64), params)
    loss = 3.0 - 1e-3 * k + 0.02 * rng.normal()
    if k in (63, 100, 170, 390):
      loss += 3.0  # loss spikes; 63 comes with only 63 values (incl. itself): kept
    if k in (64, 140, 141):
      g = jax.tree.map(lambda x: x * 40, g)  # grad-norm spikes; 64 is the first checked step
    if k == 170:
      g = jax.tree.map(lambda x: x * 10, g)  # below 6 sigma of a history holding 140, 141
    norm = math.sqrt(sum((x ** 2).sum() for x in jax.tree.leaves(g)))
    if k in PROBES:
      kind, frac = PROBES[k]
      if kind == 'loss':
        loss = _threshold(losses, frac)
      else:
        g = jax.tree.map(lambda x: x * _threshold(norms, frac) / norm, g)
        norm = _threshold(norms, frac)
    if k == nan_loss_step:
      loss = float('nan')
    else:
      losses.append(loss)
      norms.append(norm)
    steps.append((jax.tree.map(lambda x: x.astype(np.float32), g), np.float32(loss)))
  return params, steps


class OlmoCoreRun:
  """SkipStepAdamW as OLMo-core's TransformerTrainModule drives it (CPU torch)."""

  def __init__(self, params, cfg):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    self.paths = [optim.param_path(kp) for kp, _ in flat]
    self.params = [torch.nn.Parameter(torch.tensor(np.array(p))) for _, p in flat]
    no_decay = [p for path, p in zip(self.paths, self.params) if path.startswith('embed/')]
    decay = [p for path, p in zip(self.paths, self.params) if not path.startswith('embed/')]
    self.optim = SkipStepAdamW(
        [{'params': no_decay, 'weight_decay': 0.0}, {'params': decay}], lr=cfg.lr,
        betas=(cfg.b1, cfg.b2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        rolling_interval_length=cfg.skip_window, sigma_factor=int(cfg.skip_sigma),
        foreach=True)  # SkipStepAdamWConfig default
    self.max_grad_norm = cfg.clip_grad_norm

  def step(self, grads, loss, lr):
    for p, g in zip(self.params, jax.tree.leaves(grads)):
      p.grad = torch.tensor(np.array(g))
    self.optim.latest_loss = torch.tensor(loss)  # train_batch: CE batch loss
    # optim_step -> _clip_grad_norm (non-FSDP path), then the LR, then step().
    total = torch.nn.utils.get_total_norm([p.grad for p in self.params], 2.0,
                                          error_if_nonfinite=False)
    torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, total)
    self.optim.latest_grad_norm = total
    for group in self.optim.param_groups:
      group['lr'] = lr
    self.optim.step()
    return bool(self.optim.step_skipped.item())

  def numpy_params(self):
    return [p.detach().numpy().copy() for p in self.params]


_CFG = dict(lr=3e-3, final_lr=3e-4, schedule='cosine', warmup_steps=20, t_max=N_STEPS)


class OptimizerVsOlmoCoreTest(parameterized.TestCase):

  def _check_lockstep(self, cfg, nan_loss_step, drop_from_reference):
    params, stream = _stream(nan_loss_step)
    tx = optim.make_optimizer(cfg)
    update = self.variant(tx.update)
    state = tx.init(params)
    ref = OlmoCoreRun(params, cfg)
    ours_skipped, ref_skipped = [], []
    for k, (g, loss) in enumerate(stream, start=1):
      updates, state = update(g, state, params, loss=loss)
      params = optim.apply_updates(params, updates, state)
      ours_skipped.append(bool(state.skipped))
      assert int(state.step) == k
      np.testing.assert_allclose(state.lr, optim.lr_schedule(cfg)(k), rtol=1e-6)
      if k in drop_from_reference:
        continue
      if ref.step(g, loss, float(state.lr)):
        ref_skipped.append(k)
      for ours, theirs in zip(jax.tree.leaves(params), ref.numpy_params()):
        # <= 1 ulp per step (XLA fuses p * keep + update into an FMA, torch
        # rounds twice), drifting to ~2e-6 absolute over 400 steps.
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=5e-6, err_msg=f'step {k}')
    skipped = [k for k, s in enumerate(ours_skipped, start=1) if s]
    return skipped, ref_skipped, state

  # jit only: 2 x 400 op-by-op steps cost ~20 s on the shared CPUs; the
  # without-jit path of `update` is covered by SkipTest and PiecesTest.
  @chex.variants(with_jit=True)
  def test_faithful_mode_matches_olmo_core(self):
    """skip_nonfinite=False is OLMo-core exactly, NaN poisoning its history included."""
    cfg = _opt_cfg(skip_nonfinite=False, **_CFG)
    skipped, ref_skipped, state = self._check_lockstep(cfg, 250, drop_from_reference=())
    self.assertEqual(skipped, ref_skipped)
    # The NaN stays in the previous-128 window for steps 251..378: all skipped.
    self.assertEqual(skipped, [64, 100, 140, 141, 170] + list(range(250, 379)) + [390])
    self.assertEqual(int(state.count), N_STEPS - len(skipped))

  @chex.variants(with_jit=True)
  def test_default_mode_keeps_nan_out_of_history(self):
    """Ours: a NaN loss skips its step only; the rest is OLMo-core without that step."""
    cfg = _opt_cfg(**_CFG)
    skipped, ref_skipped, state = self._check_lockstep(cfg, 250, drop_from_reference=(250,))
    self.assertEqual(skipped, [64, 100, 140, 141, 170, 250, 310, 330, 390])
    self.assertEqual(ref_skipped, [64, 100, 140, 141, 170, 310, 330, 390])
    self.assertEqual(int(state.history_len), 128)
    self.assertTrue(np.isfinite(state.loss_history_W).all())


# --- Optimizer pieces ------------------------------------------------------------


def _bits(tree):
  return [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(tree)]


class SkipTest(parameterized.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_skipped_steps_are_bit_exact_no_ops(self):
    cfg = _opt_cfg(skip_window=16, **_CFG)  # checks start at 8 values
    tx = optim.make_optimizer(cfg)
    update = self.variant(tx.update)
    rng = np.random.default_rng(1)
    params = _init_params(rng)
    params['final_norm']['scale'][:3] = [0.0, -0.0, 1e-40]  # signed zeros, a subnormal
    state = tx.init(params)
    grads = lambda scale=1.0: jax.tree.map(
        lambda p: (rng.normal(0, 0.05, p.shape) * scale).astype(np.float32), params)
    cases = {3: (grads(), np.float32('nan')),  # non-finite skips even before 8 values
             12: (grads(), np.float32(50.0)),  # loss spike
             14: (jax.tree.map(lambda g: np.full_like(g, np.nan), params), np.float32(3)),
             16: (grads(), np.float32(np.inf))}
    for k in range(1, 20):
      g, loss = cases.get(k, (grads(), np.float32(3 + 0.01 * rng.normal())))
      updates, new_state = update(g, state, params, loss=loss)
      new_params = optim.apply_updates(params, updates, new_state)
      self.assertEqual(bool(new_state.skipped), k in cases, msg=k)
      self.assertEqual(int(new_state.step), k)
      if k in cases:
        for u in _bits(updates):
          np.testing.assert_array_equal(u, np.float32(-0.0).view(np.uint32))
        for a, b in zip(_bits(new_params), _bits(params)):
          np.testing.assert_array_equal(a, b)
        for a, b in zip(_bits((new_state.mu, new_state.nu)), _bits((state.mu, state.nu))):
          np.testing.assert_array_equal(a, b)
        self.assertEqual(int(new_state.count), int(state.count))
        # The LR keeps following the global step through a skip.
        np.testing.assert_allclose(new_state.lr, optim.lr_schedule(cfg)(k), rtol=1e-6)
        pushed = k == 12  # the finite spike enters the history, non-finite values do not
        self.assertEqual(int(new_state.history_len), int(state.history_len) + pushed)
      else:
        self.assertEqual(int(new_state.count), int(state.count) + 1)
      params, state = new_params, new_state

  def test_olmo_core_nan_grads_poison_a_skipped_step(self):
    """The deviation above, shown on OLMo-core: 0 * NaN leaves NaN in params and moments."""
    cfg = _opt_cfg(**_CFG)
    params = _init_params(np.random.default_rng(2))
    ref = OlmoCoreRun(params, cfg)
    rng = np.random.default_rng(3)
    for k in range(1, 70):
      g = jax.tree.map(lambda p: rng.normal(0, 0.05, p.shape).astype(np.float32), params)
      ref.step(g, np.float32(3 + 0.01 * rng.normal()), 1e-3)
    nan_grads = jax.tree.map(lambda p: np.full_like(p, np.nan), params)
    assert ref.step(nan_grads, np.float32(3.0), 1e-3)  # skipped ...
    assert np.isnan(ref.numpy_params()[0]).all()  # ... yet the params are NaN


class PiecesTest(parameterized.TestCase):

  def test_decay_mask(self):
    params = _init_params(np.random.default_rng(0))
    mask = optim.decay_mask(params, ('embed/.*',))
    self.assertEqual(mask, {'embed': {'embedding': False}, 'attention': {'w_q': True},
                            'final_norm': {'scale': True}, 'lm_head': {'w': True}})
    with pytest.raises(ValueError, match='embeddings'):
      optim.decay_mask(params, ('embeddings/.*',))

  @chex.variants(with_jit=True, without_jit=True)
  def test_first_update_is_adamw_formula(self):
    """Step 1 in float64: clip, decay (not the embedding), Adam with bias correction."""
    cfg = _opt_cfg(**_CFG)
    tx = optim.make_optimizer(cfg)
    params = _init_params(np.random.default_rng(4))
    grads = jax.tree.map(lambda p: np.full_like(p, 0.3), params)  # norm > 1: clipped
    updates, state = self.variant(tx.update)(grads, tx.init(params), params,
                                             loss=np.float32(3.0))
    norm = math.sqrt(sum(g.size * 0.09 for g in jax.tree.leaves(grads)))
    g = 0.3 * min(1.0, 1.0 / (norm + 1e-6))
    lr = 3e-3 / 20
    m, v = 0.1 * g, 0.05 * g * g
    adam = lr / 0.1 * m / (math.sqrt(v) / math.sqrt(0.05) + 1e-8)
    for path, p in [('embed', params['embed']['embedding']), ('lm_head', params['lm_head']['w'])]:
      keep = 1.0 if path == 'embed' else 1 - lr * 0.1
      want = p.astype(np.float64) * keep - adam
      got = p + updates[path]['embedding' if path == 'embed' else 'w']
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.grad_norm, norm, rtol=1e-6)
    metrics = optim.opt_metrics(state)
    self.assertEqual(set(metrics), {'optim/LR', 'optim/total grad norm', 'optim/step skipped'})
    np.testing.assert_allclose(metrics['optim/LR'], lr, rtol=1e-6)
    self.assertEqual(float(metrics['optim/step skipped']), 0.0)

  def test_update_needs_loss_and_params(self):
    tx = optim.make_optimizer(_opt_cfg(**_CFG))
    params = _init_params(np.random.default_rng(0))
    with pytest.raises(ValueError, match='loss='):
      tx.update(params, tx.init(params), params)

  def test_stage2_reset(self):
    cfg = _opt_cfg(**_CFG)
    tx = optim.make_optimizer(cfg)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(5)
    params = _init_params(rng)
    state = tx.init(params)
    for _ in range(80):
      g = jax.tree.map(lambda p: rng.normal(0, 0.05, p.shape).astype(np.float32), params)
      _, state = update(g, state, params, loss=np.float32(3 + 0.01 * rng.normal()))
    reset = optim.stage2_reset(state)
    self.assertEqual(int(reset.step), 0)
    self.assertEqual(int(reset.history_len), 0)
    self.assertEqual(int(reset.count), 80)
    for a, b in zip(_bits((reset.mu, reset.nu)), _bits((state.mu, state.nu))):
      np.testing.assert_array_equal(a, b)
    # Stage 2 resumes with step 1 of its own schedule; a spike right away is not
    # skipped since the history restarted (as a fresh OLMo-core process would).
    stage2 = optim.make_optimizer(olmo3_7b_stage2.get_config().opt)
    g = jax.tree.map(lambda p: rng.normal(0, 0.05, p.shape).astype(np.float32), params)
    _, after = jax.jit(stage2.update)(g, reset, params, loss=np.float32(50.0))
    self.assertFalse(bool(after.skipped))
    self.assertEqual(int(after.count), 81)
    np.testing.assert_allclose(after.lr, 2.0712352850360292e-4 * (1 - 1 / 47_684), rtol=1e-6)

  def test_stage2_config(self):
    c = olmo3_7b_stage2.get_config()
    self.assertEqual((c.data.global_batch_size, c.data.seed, c.train.steps), (256, 1337, 47_684))
    self.assertTrue(c.train.reset_step_on_init)
