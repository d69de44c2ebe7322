"""Trains Olmo 3: python train.py --config=configs/small.py --workdir=/tmp/run.

The same command starts a fresh run or resumes the latest good checkpoint in
--workdir. Before anything is allocated it checks the config, the data
settings and that params + Adam moments fit the devices; `python plan.py`
answers the fuller question (temporaries, FLOPs, other meshes) ahead of time.
One run at a time may use a workdir (hosts/workdir_lock.py).

Exit codes (errors.py): 0 done; 1 a crash; 2 a usage or config mistake and 5
a data mistake (one line names the fix; the stack goes to <workdir>/error.log);
3 preempted (a checkpoint written); 4 diverged, after monitor/rollback.py's attempts
to restore the last healthy checkpoint and skip the spike's data. Earlier
checkpoints stay intact in every case.

Reading order: the train state, the step (one loss for training and
held-out evaluation), the loop, the command line. Around it: sharding.py
(mesh, shardings, memory, hosts), loss.py, optim.py, data.py, checkpoint.py,
monitor/metrics.py (what a run reports), monitor/health.py (what stops it), monitor/rollback.py
(what restarts it from a healthy state instead).
Shapes: B global batch, A micro-batches per step, T sequence, D d_model.
"""

import gc
import os
import signal
COLLECTOR_PAUSED = __name__ == '__main__'  # the command line starts without the cyclic
if COLLECTOR_PAUSED:  # collector, on again after the first step (goodput.Account): that
  gc.disable()  # step comes ~0.3 s sooner (docs/goodput.md)
  # A container's trainer is PID 1, whose signals without a handler the kernel drops: a
  # SIGTERM during the imports below ends the process at once, with exit 3 (preempted;
  # nothing to save yet: errors.EXIT_PREEMPTED, not imported yet). run() puts
  # monitor/health.py's Preemption in its place.
  for _sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_sig, lambda signum, _: (print(
        f'Signal {signum} during start-up: stopping now (exit 3).', flush=True), os._exit(3)))

import contextlib  # noqa: E402  (after the pause: imports run without the collector)
import sys
from typing import Any, NamedTuple

from absl import app, flags, logging
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
from ml_collections import config_flags
import numpy as np

import checkpoint
import config_checks
import data
import errors
from evaluation import held_out
from evaluation import sample
from formats import init_from
from hosts import host_sync
from hosts import peers
from hosts import workdir_lock
import kernels
from kernels import gpu_flags
import loss
import model
from monitor import goodput
from monitor import health
from monitor import metrics
from monitor import profiler
from monitor import rollback
from monitor import tracking
import optim
import sharding
from store import prefetch
from store import step_dirs
from store import storage
from tokens import batches

FLAGS = flags.FLAGS  # defined by run(): importing this module defines no flags
BATCH_AXES = sharding.BATCH_AXES


class TrainState(NamedTuple):
  params: model.Params
  opt_state: optim.SkipStepAdamWState


# --- The train state --------------------------------------------------------------------

_INIT: dict[str, Any] = {}  # _init_fn's last answer and its key
# XLA's constant folding of the random-number code's iotas took most of the init's compile,
# and grows with the arrays: the 7B slice's 26.0 s on a TPU v5e host (libtpu here: 50.8 s
# -> 9.3 s without the pass). The values are the same (tests/test_train.py).
INIT_COMPILE = {'xla_disable_hlo_passes': 'constant_folding'}


def _init_fn(cfg: ml_collections.ConfigDict, tx: Any) -> tuple[Any, TrainState]:
  """(rng -> the step-0 TrainState, its abstract state), traced once per model config and
  optimizer (~0.2 s a trace): a start asks several times, and create_state's jit of the
  same function object is served from jit's trace cache."""
  key = (cfg.model.to_json_best_effort(sort_keys=True), tx)
  if _INIT.get('key') != key:  # tx held in the key: its identity cannot be reused
    def init(rng):
      params = model.init_params(cfg.model, rng)
      return TrainState(params, tx.init(params))
    _INIT.update(key=key, answer=(init, jax.eval_shape(init, jax.random.key(0))))
  return _INIT['answer']


def abstract_state(cfg: ml_collections.ConfigDict, tx: Any, mesh: Mesh | None = None
                   ) -> TrainState:
  """ShapeDtypeStructs of the train state (sharded on `mesh` if given); nothing is allocated."""
  abstract = _init_fn(cfg, tx)[1]
  if mesh is None:
    return abstract
  return sharding.placed(abstract, mesh)


def create_state(cfg: ml_collections.ConfigDict, tx: Any, mesh: Mesh, rng: jax.Array,
                 stage: Any = lambda name: None) -> tuple[TrainState, TrainState]:
  """(state, shardings): built already sharded, so no full-size array ever exists.
  `stage(name)` is told when the init's compile ends (goodput.Account.stage)."""
  init, abstract = _init_fn(cfg, tx)
  shardings = sharding.state_shardings(abstract, mesh)
  compiled = jax.jit(init, out_shardings=shardings).lower(rng).compile(INIT_COMPILE)
  stage("the state's init: compile")
  return jax.block_until_ready(compiled(rng)), shardings  # its run: the caller's stage


def restore_or_init(cfg: ml_collections.ConfigDict, tx: Any, mesh: Mesh,
                    ckpt: checkpoint.Checkpointer, ahead: prefetch.Prefetch | None = None,
                    stage: Any = lambda name: None
                    ) -> tuple[TrainState, dict[str, Any] | None]:
  """(state, loader state): the latest good checkpoint's (`ahead`: as far as it read it
  already), else step 0's (`stage`: create_state's)."""
  if not ckpt.committed_steps():
    state, shardings = create_state(cfg, tx, mesh, jax.random.key(cfg.train.seed), stage)
    if cfg.train.init_from:
      state = init_from.load(cfg, abstract_state(cfg, tx, mesh), state, shardings)
    return state, None
  latest = ckpt.latest_step()
  with contextlib.suppress(checkpoint.CorruptCheckpointError):  # refused early; corrupt: below
    config_checks.check_same_run(cfg, checkpoint.read_metadata(ckpt.directory, latest))
  target = abstract_state(cfg, tx, mesh)
  state, meta = ckpt.restore_latest_good(target, prefetched=ahead)  # straight into its shards
  if meta['step'] != latest:
    config_checks.check_same_run(cfg, meta)
  if 'diverged' in meta:
    logging.warning('Resuming from step %d, saved when the divergence guard stopped the run '
                    '(%s); the last healthy checkpoint is step %s.', meta['step'],
                    meta['diverged'], ckpt.latest_healthy_step())
  logging.info('Resumed from step %d in %s.', meta['step'], ckpt.directory)
  return state, meta['data']


# --- The step ---------------------------------------------------------------------------


def loss_sums(cfg: ml_collections.ConfigDict, mesh: Mesh, params: model.Params,
              batch: dict[str, jax.Array], z_loss: float) -> tuple[jax.Array, jax.Array]:
  """(CE sum, z-loss sum) of a (micro-)batch: the model, then loss.sums. Training and
  held-out evaluation share it, so both measure the same thing."""
  batch = sharding.sequence_layout(cfg.model, mesh, batch)
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # model.constrain_batch needs it
    h_BTD = model.build(cfg.model).apply(params, batch['tokens'], batch.get('segment_ids'),
                                         batch.get('positions'))
  return loss.sums(h_BTD, model.head_weight(params, h_BTD.dtype), batch['labels'],
                   batch['instance_mask'], z_loss=z_loss, chunk=cfg.opt.loss_chunk)


def make_train_step(cfg: ml_collections.ConfigDict, tx: Any, mesh: Mesh, accum: int):
  """One optimizer step over the global batch, in `accum` micro-batches.

  Every micro-batch loss is a sum divided by the label count of the *global*
  batch (loss.denominator), so the accumulated gradient equals one big
  batch's whatever `accum` and the device count are.
  """
  def train_step(state: TrainState, batch: dict[str, jax.Array], lr_factor=1.0):
    # lr_factor (a traced scalar: a new value does not recompile) scales the update: for
    # AdamW with decoupled decay multiplied by the LR, exactly scaling the LR (monitor/rollback.py).
    denominator = loss.denominator(batch['labels'], batch['instance_mask'])
    denominator = jnp.maximum(denominator, 1).astype(jnp.float32)

    def mean_loss(params, mb):
      ce, z = loss_sums(cfg, mesh, params, mb, cfg.opt.z_loss)
      return (ce + z) / denominator, (ce, z)
    grad_fn = jax.grad(mean_loss, has_aux=True)
    if accum == 1:  # no accumulator to zero and add into
      grads, (ce_sum, z_sum) = grad_fn(state.params, batch)
    else:
      # [B, ...] -> [A, B/A, ...] keeping each device's rows on that device:
      # micro batch a takes rows a, a+A, ... of every device's contiguous block.
      micro = jax.tree.map(
          lambda x: jax.lax.with_sharding_constraint(
              x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1),
              NamedSharding(mesh, P(None, BATCH_AXES, *([None] * (x.ndim - 1))))), batch)

      def body(carry, mb):
        grads, ce, z = carry
        g, (c, zz) = grad_fn(state.params, mb)
        return (jax.tree.map(jnp.add, grads, g), ce + c, z + zz), None
      zeros = jax.tree.map(jnp.zeros_like, state.params)
      zero = jnp.zeros([], jnp.float32)
      (grads, ce_sum, z_sum), _ = jax.lax.scan(body, (zeros, zero, zero), micro)

    ce_loss = ce_sum / denominator
    updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=ce_loss)
    updates = jax.tree.map(lambda u: u * lr_factor, updates)  # x * 1.0 == x: bit-exact when off
    params = optim.apply_updates(state.params, updates, opt_state)  # exact no-op on a skip
    step_metrics = {'train/CE loss': ce_loss, 'train/Z loss': z_sum / denominator,
                    **optim.opt_metrics(opt_state), 'optim/LR factor': lr_factor}
    step_metrics['optim/LR'] = step_metrics['optim/LR'] * lr_factor  # the effective LR
    return TrainState(params, opt_state), step_metrics
  return train_step


def make_eval_step(cfg: ml_collections.ConfigDict, mesh: Mesh):
  """(CE sum, label count) of one held-out batch: the training loss without z-loss."""
  def eval_step(params, batch):
    ce, _ = loss_sums(cfg, mesh, params, batch, z_loss=0.0)
    return ce, loss.denominator(batch['labels'], batch['instance_mask'])
  return eval_step


# --- The loop ---------------------------------------------------------------------------


def train(cfg: ml_collections.ConfigDict, workdir: str, sample_tokens: int = 0
          ) -> dict[str, float]:
  """Runs (or resumes) training to cfg.train.steps; returns the last logged metrics.

  Cheap checks first, so a bad setting fails in seconds with nothing allocated
  or written: the config (completed from its data, validated: the one place),
  what it reads, the mesh, the data, micro-batching, whether the state fits.
  Then process 0 locks the workdir: another run's clean-up would take this
  one's in-flight save for a crashed one's leftovers.
  """
  account = goodput.Account(workdir := storage.canonical(workdir),  # timed from the process start
                            collector_paused=COLLECTOR_PAUSED, then='training prep')
  config_checks.validate(config_checks.complete(cfg))
  config_checks.check_sources(cfg)
  # One process reads its latest checkpoint while the accelerator opens (seconds on a TPU).
  ahead = (prefetch.Prefetch(storage.join(workdir, 'checkpoints'))
           if host_sync.one_process() else None)
  mesh = account.timed('tpu initialization', sharding.make_mesh, cfg.train)  # before packing
  config_checks.check_attention(cfg.model, segments=data.wants_segments(cfg.data))
  goodput.compilation_cache(cfg.train.compilation_cache_dir, workdir)  # before any compile
  cache_dir = cfg.data.cache_dir or storage.local_cache_dir(workdir, 'data_cache')
  ds = account.timed('training prep', data.dataset_from_config, cfg.data, cache_dir,
                     stage='data set')  # 'packed' packs here, once; stages: Account.stage
  accum = batches.grad_accum_steps(cfg.data.global_batch_size,
                                   int(np.prod([mesh.shape[a] for a in BATCH_AXES])),
                                   cfg.train.micro_batch_size)
  impl, why = kernels.resolve(cfg.model, segments=data.wants_segments(cfg.data),
                             context_parallel=mesh.shape.get('context', 1) > 1)
  logging.info('attention_impl=%s (%s).', impl, why)
  tx = optim.make_optimizer(cfg.opt)
  sharding.check_state_fits(abstract_state(cfg, tx), mesh)
  host_sync.check_shared(workdir)  # every process sees one workdir, before anything is written
  lock = (workdir_lock.WorkdirLock(workdir) if jax.process_index() == 0
          else contextlib.nullcontext())
  with lock, account:
    ckpt = account.watch(checkpoint.Checkpointer(storage.join(workdir, 'checkpoints'),  # costs
        keep_last=cfg.train.keep_last, keep_every=cfg.train.keep_every))
    committed = ckpt.committed_steps()
    if not committed and (misplaced := step_dirs.check_fresh_start(ckpt.directory, workdir)):
      health.warn(f'WARNING: {misplaced}')
    target = abstract_state(cfg, tx, mesh)
    train_step = jax.jit(make_train_step(cfg, tx, mesh, accum), donate_argnums=0,
                         out_shardings=(jax.tree.map(lambda x: x.sharding, target), None))
    if not committed or committed[-1] < cfg.train.steps:  # compiled while restoring, below;
      train_step = goodput.compile_ahead(  # the processes meet after it (host_sync.barrier)
          train_step, target, sharding.abstract_batch(cfg.data, mesh), jax.ShapeDtypeStruct(
              (), np.float32), then=lambda: host_sync.barrier('first step'))
    recovery = rollback.Recovery(cfg, workdir, ckpt)  # first: a killed rollback's leftovers
    state, data_state = account.timed('checkpoint restore' if ckpt.committed_steps() else
                                      'training prep', restore_or_init, cfg, tx, mesh, ckpt,
                                      ahead, account.stage,
                                      stage='checkpoint restore, or the state\'s init')
    start = int(jax.device_get(state.opt_state.step))

    def make_loader(data_state, step):  # again after a rollback, with its window skipped
      return data.Loader.from_config(cfg.data, ds, state=data_state, step=step,
                                     sharding=sharding.batch_sharding(mesh), cache_dir=cache_dir,
                                     skips=recovery.skips)
    recovery.target = target
    logging.info('Training %s params on %d devices (mesh %s), %d micro-batches/step, '
                 'steps %d -> %d.', f'{model.param_count(cfg.model):,}', mesh.size,
                 dict(mesh.shape), accum, start, cfg.train.steps)
    state, last = loop(cfg, workdir, state, start, train_step, make_loader(data_state, start),
                       ckpt, ds, mesh, recovery, make_loader, account)
    if sample_tokens:  # inside the account: its goodput line is the process's last
      account.timed('custom/sample', sample.print_sample, cfg, state.params, sample_tokens)
  return last


def loop(cfg: ml_collections.ConfigDict, workdir: str, state: TrainState, start: int,
         train_step: Any, loader: data.Loader, ckpt: checkpoint.Checkpointer, ds: Any, mesh: Mesh,
         recovery: rollback.Recovery, make_loader: Any, account: goodput.Account
         ) -> tuple[TrainState, dict[str, float]]:
  """Steps from `start` to cfg.train.steps: log, judge, evaluate, checkpoint; stops on a
  signal (EXIT_PREEMPTED) or a divergence (EXIT_DIVERGED) that monitor/rollback.py may not
  recover."""
  step = start
  if start == cfg.train.steps:
    print(f'The checkpoint is at step {start} = train.steps: this run is complete. Raise '
          '--config.train.steps to train further.', flush=True)
  # Held-out loss and OLMo-core's in-loop olmo_eval tasks (their plan cached on each host).
  evals = held_out.InLoop(cfg, mesh, make_eval_step(cfg, mesh),  # compiled from here on
                          storage.local_cache_dir(workdir, 'eval_cache'), state.params)
  tracker = tracking.Tracker.for_run(cfg, workdir)  # W&B (train.wandb), off this thread
  profile = profiler.StepProfiler(cfg.train, workdir)  # train.profile_steps

  def watchers(start):  # what judges and records the steps after `start`; anew at a rollback
    writer = metrics.MetricWriter(workdir, start, tracker=tracker)  # drops records past `start`
    guard = health.DivergenceGuard(cfg.train)
    guard.await_verdict(start)  # the resumed or restored state: judged by the step after it
    return (health.RepeatTracker.for_run(ds, loader) if cfg.train.track_repeats else None,
            health.MemorizationWatch(cfg.train.memorization_threshold,
                                     cfg.train.memorization_evals),
            writer, guard, metrics.Progress(cfg, writer, guard, mesh.size, start))
  repeats, memorization, writer, guard, progress = watchers(start)
  preempt, heartbeat = health.Preemption.for_loop(ckpt, start), health.Heartbeat()
  version = metrics.code_version()
  last, exit_code = {}, 0
  account.begin_segment(start)  # the loop's time is productive, but for what is timed apart
  try:  # the first beat follows the first step: its compile is paused (health.Heartbeat)
    while step < cfg.train.steps:
      batch = account.timed('data loading', next, loader)
      ckpt.poll()  # a failed background save stops the run now, not at the next save
      profile.before_step(step + 1)
      with heartbeat.compiling('train step'):  # the first: start-up (goodput.Account)
        state, step_metrics = account.take_step(step + 1, writer, train_step, state, batch,
                                                np.float32(recovery.lr_factor(step + 1)))
      step += 1
      profile.after_step(step, state)
      step_metrics = {**step_metrics, **recovery.counters(step)}
      if repeats is not None:  # host-side: the ids of the batch just taken
        step_metrics = {**step_metrics, 'data/repeated instances': repeats.observe(
            loader.last_position[0], loader.ids_at(*loader.last_position))}
      progress.add(step, step_metrics, account.latest['data loading'])
      preempted = preempt.agreed()
      finished = step == cfg.train.steps
      save = step % cfg.train.ckpt_every == 0 or finished or preempted
      log = step % cfg.train.log_every == 0 or finished or preempted
      if log or save:  # the guard sees the steps here, and judges the states before them
        last = progress.flush(log)
        memorization.observe_train(step, last['train/CE loss'])
        account.record(step, writer=writer)  # and the latest save's costs
        for judged, healthy in guard.verdicts():  # before a rollback picks a state
          ckpt.judge(judged, healthy, judged + 1)
      if guard.reason:  # roll back to the last healthy state, or stop (EXIT_DIVERGED)
        state, step, data_state = account.timed(
            'custom/rollback', recovery.roll_back, guard.reason, step, state, recovery.target,
            metrics.checkpoint_meta(cfg, step, loader, version, recovery), writer, guard.trip_step)
        account.begin_segment(step)  # the steps after `step` are computed again
        loader.close()
        writer.close()
        loader = make_loader(data_state, step)
        repeats, memorization, writer, guard, progress = watchers(step)
        continue
      if not preempted:  # the grace period is for the checkpoint
        last.update(evals.run(step, state.params, finished, writer, memorization, heartbeat,
                              account))
      if save:  # its blocking part; the write goes on behind
        with account.saving(step, writer, final=finished or preempted):
          writer.flush()  # in a bucket: the records through this step, before it commits
          # Pending: the next step's loss, the first from these params, judges this state
          # (health.DivergenceGuard). The last step of a run, or one preempted, stays
          # pending until a run continuing from it takes that step.
          ckpt.save(step, state, metrics.checkpoint_meta(cfg, step, loader, version,
                                                         recovery), healthy=None)
          guard.await_verdict(step)
      if preempted:
        account.timed('checkpoint save', ckpt.wait)
        logging.warning('Preempted at step %d; checkpoint written.', step)
        raise SystemExit(errors.EXIT_PREEMPTED)
      heartbeat.beat()
  except BaseException as e:
    exit_code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    # Waiting for an in-flight save would block on peers that may wait on us
    # (multi-process); abandon it: uncommitted saves are ignored on resume.
    if jax.process_count() == 1 or isinstance(e, SystemExit):
      try:
        ckpt.close()
      except Exception:  # pylint: disable=broad-except  # keep the original error
        logging.exception('The in-flight checkpoint save failed too.')
    raise
  else:
    account.timed('checkpoint save', ckpt.close)
  finally:
    preempt.close()
    profile.close()  # a trace cut short by the end of the loop is still saved
    loader.close()
    account.write(step, writer, at_exit=True)  # the process's last account
    writer.close()
    tracker.close(exit_code)  # after the writer's last record; waits a bounded time
  return state, last


# --- The command line -------------------------------------------------------------------

DEFAULT_CONFIG = 'configs/small.py'  # relative to the working directory, as ml_collections reads it


def main(argv: list[str]) -> None:
  if len(argv) > 1:
    errors.report(f'unexpected arguments {argv[1:]}; flags take the form --name=value.',
                  errors.EXIT_USAGE)
  if FLAGS.dry_run:
    errors.report('--dry_run moved to its own entry point: python plan.py --config=CONFIG '
                  '--devices=N [--target_devices=M].', errors.EXIT_USAGE)
  if not FLAGS.workdir:
    errors.report('--workdir is required (checkpoints and metrics go there).', errors.EXIT_USAGE)
  with errors.one_line():  # one spelling per place; a mistyped URL never becomes a folder
    workdir = storage.canonical(FLAGS.workdir, '--workdir')
    if FLAGS.stop_grace_seconds is not None:
      health.Preemption.set_grace(FLAGS.stop_grace_seconds)
  with peers.exits(), errors.one_line(  # peers: a lost process is one line too
      storage.join(workdir, 'error.log'), append=storage.append, restartable=(
      storage.StorageError, checkpoint.CheckpointReadError, checkpoint.CheckpointSaveError)):
    sharding.init_distributed_from_flags()
    train(FLAGS.config, workdir, FLAGS.sample_tokens)


def run() -> None:
  """The command line: defines the flags (here, not at import: plan.py, tests and scripts
  import this module as a library) and runs main (`python train.py` calls it)."""
  global COLLECTOR_PAUSED  # pylint: disable=global-statement  # a script calling run()
  with errors.one_line():  # first: a signal during start-up stops it at once (exit 3)
    health.Preemption.install()
  COLLECTOR_PAUSED = goodput.pause_collector() or COLLECTOR_PAUSED  # starts like train.py
  kernels.xla.set_cpu_flags()  # before anything starts a JAX backend
  # On a GPU host: the XLA GPU flags that pay, and the allocator's share of memory that
  # plan.py budgets (kernels/gpu_flags.py); anything the user set wins.
  gpu_flags.apply()
  # Without --config in argv this already parses the default file and the overrides.
  with config_checks.config_mistakes_in_one_line(sys.argv, DEFAULT_CONFIG):
    config_flags.DEFINE_config_file('config', DEFAULT_CONFIG, 'Training config file.')
  flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and logs go here.')
  flags.DEFINE_integer('sample_tokens', 96, 'Length of the sample printed at the end (0: none).')
  flags.DEFINE_string('stop_grace_seconds', None, 'Seconds the scheduler leaves between '
                      'SIGTERM and SIGKILL (default $OLMO_STOP_GRACE_SECONDS; unset: '
                      'unbounded): a checkpoint is written only when the saves so far fit.')
  flags.DEFINE_bool('dry_run', False, 'Moved: run python plan.py --config=... --devices=N.')
  sharding.define_host_flags()
  app.run(main, flags_parser=config_checks.parse_flags)


if __name__ == '__main__':
  run()
