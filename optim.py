"""AdamW with OLMo-core's skip-step rule, clipping and the LR schedules.

Reference facts: docs/optimizer.md (AdamW, clipping, skip step) and
docs/recipe.md (schedules). tests/test_optim.py checks every number here against
OLMo-core itself (`SkipStepAdamW`, its schedulers, its train module's clipping)
or a float64 numpy formula.

Reading order: LR schedules, the optimizer (state, skip rule, update). The
loss it minimises is loss.py's.

Shapes: W skip-step history window.
"""

import math
import re
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

SCHEDULES = ('cosine', 'olmo3_stitched', 'single_cosine', 'linear')


# --- LR schedules ---------------------------------------------------------------
#
# Each schedule is written once against an array namespace `xp`: numpy in
# float64 (host-side logging, plots, the 1e-12 tests) or jax.numpy in float32
# (inside the jitted step). The jnp path is float32 because the train step runs
# without jax_enable_x64 and the LR only ever multiplies float32 master weights.
# To keep float32 within a few ulps of the float64 value everywhere, nothing
# is subtracted in float32: step offsets are integers, and each decay is
# final_lr plus a positive tail that shrinks to 0 with the steps *remaining*
# (OLMo-core's `lr - (lr - final) * x` cancels as x -> 1: 2.2e-3 relative
# error at the last stage-2 step in float32). Measured: < 3.2e-7 over every
# step of every schedule (tests/test_optim.py).


def _ratio(xp, ft, num, den: int):
  """num / den with integer num (exact below 2^24 in float32) and a Python int den."""
  return xp.asarray(num).astype(ft) / ft(den)


def _remaining(xp, ft, s, start: int, end: int):
  """(end - s) / (end - start) for s clipped to [start, end]: 1 at start, 0 at end."""
  return _ratio(xp, ft, end - xp.clip(s, start, end), end - start)


def _cos_tail(xp, ft, remaining):
  """(1 + cos(pi * (1 - r))) / 2 as sin^2(pi/2 * r): no 1 + cos cancellation near r = 0."""
  return xp.square(xp.sin(ft(np.pi / 2) * remaining))


def _warmup(xp, ft, s, peak: float, warmup: int):
  return peak * _ratio(xp, ft, xp.minimum(s, warmup), max(warmup, 1))


def _cos_with_warmup(xp, ft, s, *, lr: float, final_lr: float, warmup: int,
                     t_max: int):
  """OLMo-core CosWithWarmup: linear from 0 over `warmup`, cosine to final_lr at t_max."""
  down = final_lr + (lr - final_lr) * _cos_tail(xp, ft, _remaining(xp, ft, s, warmup, t_max))
  return xp.where(s < warmup, _warmup(xp, ft, s, lr, warmup), down)


def _half_cos_with_warmup(xp, ft, s, *, lr: float, final_lr: float, warmup: int,
                          t_max: int):
  """OLMo-core HalfCosWithWarmup: warm up to the cosine's midpoint, then its second half.

  Its cosine argument runs over x = (t_max + s - 2 warmup) / (2 (t_max - warmup))
  from 1/2 to 1, so 1 - x is half of _remaining's fraction.
  """
  peak = final_lr + (lr - final_lr) / 2
  tail = _cos_tail(xp, ft, _remaining(xp, ft, s, warmup, t_max) / 2)
  return xp.where(s < warmup, _warmup(xp, ft, s, peak, warmup),
                  final_lr + (lr - final_lr) * tail)


def _linear_with_warmup(xp, ft, s, *, lr: float, final_lr: float, warmup: int,
                        t_max: int):
  """OLMo-core LinearWithWarmup: linear warmup, then linear to final_lr at t_max."""
  down = final_lr + (lr - final_lr) * _remaining(xp, ft, s, warmup, t_max)
  return xp.where(s < warmup, _warmup(xp, ft, s, lr, warmup), down)


def _finite(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def check_config(cfg_opt: ml_collections.ConfigDict) -> None:
  """Refuses settings that cannot train, naming the field, the rule and the fix.

  Runs before anything is built (config_checks.validate), so `--config.opt.lr=inf`
  fails in a second instead of training NaNs. NaN fails every rule, since
  every comparison with it is false.
  """
  o = cfg_opt
  rules = (  # field, holds, what it must be (with the 7B recipe's value as the usual fix)
      ('schedule', o.schedule in SCHEDULES, f'one of {SCHEDULES}'),
      ('lr', _finite(o.lr) and o.lr > 0, 'a finite number > 0 (Olmo 3 7B: 3e-4)'),
      ('final_lr', _finite(o.final_lr) and 0 <= o.final_lr <= o.lr,
       f'a finite number in [0, opt.lr={o.lr}] (Olmo 3 7B: 3e-5)'),
      ('warmup_steps', o.warmup_steps >= 0, 'an integer >= 0 (Olmo 3 7B: 2000)'),
      ('b1', 0 <= o.b1 < 1, 'in [0, 1) (Olmo 3 7B: 0.9)'),
      ('b2', 0 <= o.b2 < 1, 'in [0, 1) (Olmo 3 7B: 0.95)'),
      ('eps', _finite(o.eps) and o.eps > 0, 'a finite number > 0 (Olmo 3 7B: 1e-8)'),
      ('weight_decay', _finite(o.weight_decay) and o.weight_decay >= 0,
       'a finite number >= 0 (Olmo 3 7B: 0.1)'),
      ('clip_grad_norm', _finite(o.clip_grad_norm) and o.clip_grad_norm >= 0,
       'a finite number > 0, or 0 for no clipping (Olmo 3 7B: 1.0)'),
      ('z_loss', _finite(o.z_loss) and o.z_loss >= 0, 'a finite number >= 0 (Olmo 3 7B: 1e-5)'),
      ('loss_chunk', o.loss_chunk >= 1, 'an integer >= 1 (tokens per logits chunk: 1024)'),
      # With W < 6 the first check would see one previous value, whose Bessel
      # std is undefined (torch gives NaN there and skips every step).
      ('skip_window', o.skip_window >= 6, 'an integer >= 6 (Olmo 3 7B: 128)'),
      ('skip_sigma', _finite(o.skip_sigma) and o.skip_sigma > 0,
       'a finite number > 0 (Olmo 3 7B: 6.0)'),
  )
  for field, holds, rule in rules:
    if not holds:
      raise ValueError(f'cfg.opt.{field}={o[field]!r} must be {rule}; set '
                       f'--config.opt.{field} to such a value.')
  _check_horizons(o)


def _check_horizons(cfg_opt: ml_collections.ConfigDict) -> None:
  horizons = {'cosine': ('t_max',), 'linear': ('t_max',),
              'single_cosine': ('single_cosine_t_max',),
              'olmo3_stitched': ('t_max', 'part2_t_max')}[cfg_opt.schedule]
  for name in horizons:
    if cfg_opt[name] <= cfg_opt.warmup_steps:
      raise ValueError(f'cfg.opt.{name}={cfg_opt[name]} must exceed cfg.opt.warmup_steps='
                       f'{cfg_opt.warmup_steps}; raise --config.opt.{name} or lower '
                       '--config.opt.warmup_steps.')
  if cfg_opt.schedule == 'olmo3_stitched' and not (
      cfg_opt.part2_start < cfg_opt.part2_warmup < cfg_opt.part2_t_max):
    raise ValueError('cfg.opt needs part2_start < part2_warmup < part2_t_max, got '
                     f'{cfg_opt.part2_start}, {cfg_opt.part2_warmup}, {cfg_opt.part2_t_max}; '
                     'set --config.opt.part2_* in that order (Olmo 3 7B: 596047, 597046, '
                     '1668931).')


def lr_schedule(cfg_opt: ml_collections.ConfigDict) -> Callable[[Any], Any]:
  """Returns lr(step) for the trainer's global step (the first optimizer step is 1).

  A jax array (or tracer) step gives a float32 jax scalar; a Python/numpy step
  gives a float64 numpy value. The config is checked by the entry point
  (check_config, through config_checks.validate), once.
  """
  lr, final_lr, warmup = float(cfg_opt.lr), float(cfg_opt.final_lr), int(cfg_opt.warmup_steps)
  name = cfg_opt.schedule

  def fn(xp, ft, s):
    if name == 'cosine':
      return _cos_with_warmup(xp, ft, s, lr=lr, final_lr=final_lr, warmup=warmup,
                              t_max=int(cfg_opt.t_max))
    if name == 'single_cosine':  # MaxText: one cosine over the whole run
      return _cos_with_warmup(xp, ft, s, lr=lr, final_lr=final_lr, warmup=warmup,
                              t_max=int(cfg_opt.single_cosine_t_max))
    if name == 'linear':  # OLMo-core midtrain: LinearWithWarmup(warmup=0, alpha_f=0)
      return _linear_with_warmup(xp, ft, s, lr=lr, final_lr=final_lr, warmup=warmup,
                                 t_max=int(cfg_opt.t_max))
    # Ai2's stage 1 ran as two jobs: pretrain-1 (CosWithWarmup) up to the
    # checkpoint at part2_start, then pretrain-2 resumed from it with
    # HalfCosWithWarmup, whose own warmup starts below part 1's LR (the dip).
    part1 = _cos_with_warmup(xp, ft, s, lr=lr, final_lr=final_lr, warmup=warmup,
                             t_max=int(cfg_opt.t_max))
    part2 = _half_cos_with_warmup(xp, ft, s, lr=lr, final_lr=final_lr,
                                  warmup=int(cfg_opt.part2_warmup),
                                  t_max=int(cfg_opt.part2_t_max))
    return xp.where(s <= int(cfg_opt.part2_start), part1, part2)

  def schedule(step):
    if isinstance(step, jax.Array):
      return fn(jnp, jnp.float32, step.astype(jnp.int32))
    return fn(np, np.float64, np.asarray(step, np.int64))[()]
  return schedule


# --- Optimizer ------------------------------------------------------------------


class SkipStepAdamWState(NamedTuple):
  """Everything the optimizer carries; all arrays, so checkpoints keep all of it."""
  step: jax.Array  # int32 []: global step of the last update (always advances; LR uses it)
  count: jax.Array  # int32 []: applied Adam updates (bias correction; frozen by skips)
  mu: optax.Params  # first moments, float32, like params
  nu: optax.Params  # second moments, float32, like params
  loss_history_W: jax.Array  # float32 ring buffer of previous CE losses
  norm_history_W: jax.Array  # float32 ring buffer of previous pre-clip grad norms
  history_len: jax.Array  # int32 []: valid entries in the ring buffers (<= W)
  history_next: jax.Array  # int32 []: ring position the next value goes to
  lr: jax.Array  # float32 []: LR of the last update
  grad_norm: jax.Array  # float32 []: pre-clip global grad norm of the last update
  skipped: jax.Array  # bool []: whether the last update was skipped


def param_path(key_path) -> str:
  return jax.tree_util.keystr(key_path, simple=True, separator='/')


def decay_mask(params: optax.Params, no_decay: tuple[str, ...]) -> Any:
  """True where weight decay applies: paths ('module/param') matching no `no_decay` regex."""
  patterns = [re.compile(p) for p in no_decay]
  paths = [param_path(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  for pattern in patterns:
    if not any(pattern.fullmatch(p) for p in paths):
      raise ValueError(f'cfg.opt.no_decay pattern {pattern.pattern!r} matches no parameter '
                       f'path; the paths are {paths}. Fix the regex (full match).')
  return jax.tree_util.tree_map_with_path(
      lambda kp, _: not any(p.fullmatch(param_path(kp)) for p in patterns), params)


def global_norm(tree: Any) -> jax.Array:
  """Float32 L2 norm over all leaves (OLMo-core's total grad norm)."""
  leaves = jax.tree_util.tree_leaves(tree)
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def _is_spike(history_W: jax.Array, n: jax.Array, value: jax.Array,
              sigma: float) -> jax.Array:
  """value - mean > sigma * std over the n valid entries (Bessel std, like torch.std_mean).

  Written as not(<=) so a NaN anywhere counts as a spike, as in OLMo-core.
  """
  valid_W = jnp.arange(history_W.shape[0]) < n
  n_f = n.astype(jnp.float32)
  mean = jnp.sum(jnp.where(valid_W, history_W, 0.0)) / jnp.maximum(n_f, 1.0)
  sq_W = jnp.where(valid_W, jnp.square(history_W - mean), 0.0)
  std = jnp.sqrt(jnp.sum(sq_W) / jnp.maximum(n_f - 1.0, 1.0))
  return jnp.logical_not(value - mean <= sigma * std)


def make_optimizer(cfg_opt: ml_collections.ConfigDict
                   ) -> optax.GradientTransformationExtraArgs:
  """AdamW + clipping + skip step, OLMo-core's `SkipStepAdamW` as its train module drives it.

  `update(grads, state, params, *, loss)`: grads are the unclipped float32
  gradients of the whole global batch, `loss` its CE-only mean loss. Apply the
  result with `apply_updates` below. Updates are -0.0 on a skipped step
  (x + -0.0 == x for signed zeros too, where + 0.0 would turn -0.0 into +0.0).
  """
  schedule = lr_schedule(cfg_opt)
  b1, b2, eps = float(cfg_opt.b1), float(cfg_opt.b2), float(cfg_opt.eps)
  wd, clip = float(cfg_opt.weight_decay), float(cfg_opt.clip_grad_norm)
  window, sigma = int(cfg_opt.skip_window), float(cfg_opt.skip_sigma)
  min_values = max(2, window // 2)  # OLMo-core: values incl. the current one before any skip
  no_decay = tuple(cfg_opt.no_decay)

  def init(params: optax.Params) -> SkipStepAdamWState:
    decay_mask(params, no_decay)  # a typo in no_decay fails here, not mid-run
    zeros = lambda p: jnp.zeros_like(p, jnp.float32)
    f32 = lambda: jnp.zeros([], jnp.float32)
    i32 = lambda: jnp.zeros([], jnp.int32)
    return SkipStepAdamWState(
        step=i32(), count=i32(), mu=jax.tree.map(zeros, params),
        nu=jax.tree.map(zeros, params), loss_history_W=jnp.zeros([window], jnp.float32),
        norm_history_W=jnp.zeros([window], jnp.float32), history_len=i32(),
        history_next=i32(), lr=f32(), grad_norm=f32(), skipped=jnp.zeros([], bool))

  def update(grads: optax.Updates, state: SkipStepAdamWState,
             params: optax.Params | None = None, *, loss: jax.Array | None = None,
             **extra_args) -> tuple[optax.Updates, SkipStepAdamWState]:
    del extra_args
    if params is None or loss is None:
      raise ValueError('make_optimizer(...).update needs params= (weight decay) and '
                       'loss= (the CE-only mean loss of the global batch).')
    step = state.step + 1
    lr = schedule(step)
    loss = jnp.asarray(loss, jnp.float32)
    grad_norm = global_norm(grads)

    # Skip rule (OLMo-core SkipStepOptimizer.get_step_factor), on the history
    # before this step's values are added.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    n = state.history_len
    spike = (n + 1 >= min_values) & (
        _is_spike(state.loss_history_W, n, loss, sigma)
        | _is_spike(state.norm_history_W, n, grad_norm, sigma))
    skip = jnp.zeros([], bool)
    if cfg_opt.skip_step:
      skip |= spike
    if cfg_opt.skip_nonfinite:
      skip |= ~finite

    # OLMo-core keeps every value, skipped or not; ours keeps non-finite ones
    # out so one NaN does not force the next W steps to be skipped.
    push = finite if cfg_opt.skip_nonfinite else jnp.ones([], bool)
    pos = state.history_next
    loss_history_W = jnp.where(push, state.loss_history_W.at[pos].set(loss),
                               state.loss_history_W)
    norm_history_W = jnp.where(push, state.norm_history_W.at[pos].set(grad_norm),
                               state.norm_history_W)

    # Clipping as OLMo-core's train module does before optim.step()
    # (torch.nn.utils.clip_grads_with_norm_: coef max_norm/(norm+1e-6), capped at 1).
    scale = jnp.minimum(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0

    # AdamW in the operation order of OLMo-core's foreach_adamw_step, float32.
    w1, w2 = jnp.float32(1 - b1), jnp.float32(1 - b2)
    count_f = (state.count + 1).astype(jnp.float32)
    step_size = lr / (1 - jnp.float32(b1) ** count_f)
    sqrt_bc2 = jnp.sqrt(1 - jnp.float32(b2) ** count_f)
    keep = 1 - lr * wd  # decoupled decay, applied before the Adam step

    def leaf(p, g, m, v, decayed):
      g = g.astype(jnp.float32) * scale
      m_new = m * (1 - w1) + g * w1
      v_new = v * (1 - w2) + (g * g) * w2
      p_new = (p * keep if decayed else p) + (m_new / (jnp.sqrt(v_new) / sqrt_bc2 + eps)
                                              * -step_size)
      return (jnp.where(skip, -0.0, p_new - p), jnp.where(skip, m, m_new),
              jnp.where(skip, v, v_new))

    out = jax.tree.map(leaf, params, grads, state.mu, state.nu,
                       decay_mask(params, no_decay))
    updates, mu, nu = jax.tree.transpose(
        jax.tree.structure(params), jax.tree.structure((0, 0, 0)), out)
    new_state = SkipStepAdamWState(
        step=step, count=state.count + jnp.where(skip, 0, 1).astype(jnp.int32),
        mu=mu, nu=nu, loss_history_W=loss_history_W, norm_history_W=norm_history_W,
        history_len=jnp.where(push, jnp.minimum(n + 1, window), n),
        history_next=jnp.where(push, (pos + 1) % window, pos),
        lr=lr, grad_norm=grad_norm, skipped=skip)
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init, update)


def apply_updates(params: optax.Params, updates: optax.Updates,
                  opt_state: SkipStepAdamWState) -> optax.Params:
  """params + updates, or params untouched (bit for bit) when the step was skipped.

  The select matters only for subnormal weights: XLA flushes them to zero in
  any arithmetic on CPU and GPU, so even p + -0.0 would change them.
  """
  return jax.tree.map(lambda p, u: jnp.where(opt_state.skipped, p, p + u), params, updates)


def opt_metrics(opt_state: SkipStepAdamWState) -> dict[str, jax.Array]:
  """The last update's metrics under OLMo-core's names."""
  return {'optim/LR': opt_state.lr,
          'optim/total grad norm': opt_state.grad_norm,
          'optim/step skipped': opt_state.skipped.astype(jnp.float32)}


def stage2_reset(opt_state: SkipStepAdamWState) -> SkipStepAdamWState:
  """Stage-2 start: keep moments and Adam count, restart the global step and history.

  Moments and count carry over as in OLMo-core's midtrain (it loads the stage-1
  optimizer state). The skip history is cleared: OLMo-core never saves it, so
  its stage 2 started empty, and stage-1 statistics would not describe the new
  batch size and data mix anyway.
  """
  zero = lambda x: jnp.zeros_like(x)
  return opt_state._replace(
      step=zero(opt_state.step), loss_history_W=zero(opt_state.loss_history_W),
      norm_history_W=zero(opt_state.norm_history_W),
      history_len=zero(opt_state.history_len), history_next=zero(opt_state.history_next),
      lr=zero(opt_state.lr), grad_norm=zero(opt_state.grad_norm),
      skipped=zero(opt_state.skipped))
