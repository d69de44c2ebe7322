"""In-loop held-out loss: OLMo-core's LMEvaluator sets on the run's mesh.

    evaluate = held_out.evaluator(cfg, mesh, eval_step)  # None when train.eval_every=0
    val = evaluate(state.params)  # {'eval/lm/<set>/CE loss': ..., 'eval/lm/<set>/PPL': ...}

Each set is a few fixed batches of data.global_batch_size instances (or fewer
for a small set), instances 0, 1, ... in file order. Every process reads only
the rows its own devices hold and builds the global arrays from them
(batches.make_global_batch), as the training loader does: no host reads the
whole batch, and JAX has no host values to compare across processes (placing
one numpy batch on a multi-process mesh makes it check that every process
passed the same values, a collective per batch).
"""

from collections.abc import Callable
import time
from typing import Any

import jax
from jax.sharding import Mesh
import ml_collections
import numpy as np

import data
from evaluation import in_loop
from monitor import goodput
import sharding
from tokens import batches


def sets(cfg_data: ml_collections.ConfigDict) -> dict[str, tuple[str, ...]]:
  """{name: token files}: data.validation_paths as 'validation' (unless only named sets are
  given), then each data.validation_sets entry."""
  named = {name: tuple(paths) for name, paths in cfg_data.validation_sets.items()}
  if cfg_data.validation_paths or not named:
    return {'validation': tuple(cfg_data.validation_paths), **named}
  return named


def evaluator(cfg: ml_collections.ConfigDict, mesh: Mesh, eval_step: Callable,
              params_like: Any = None) -> Callable[..., dict[str, float]] | None:
  """params -> {'eval/lm/<set>/CE loss', PPL for each held-out set}, or None.

  eval_step(params, batch) -> (CE sum, label count) (train.make_eval_step); it is
  jitted here. Sets are named as OLMo-core's LMEvaluator labels them (sets). Given
  `params_like` (the params, or their shapes with shardings), it is also compiled now, on
  a thread, for each batch shape the sets have (goodput.compile_ahead): the first
  evaluation then waits for nothing the train loop could have run beside."""
  if not cfg.train.eval_every:
    return None
  rows = sharding.batch_sharding(mesh)
  held_out = {}
  for name, paths in sets(cfg.data).items():
    cfg_data = cfg.data.copy_and_resolve_references()
    cfg_data.validation_paths = paths
    held_out[name] = data.held_out_batches(cfg_data, lambda b: batches.num_batch_shards(rows, b),
                                           rows=lambda b: batches.local_rows(rows, b))
  held_out = {name: b for name, b in held_out.items() if b}
  if not held_out:
    return None
  step = jax.jit(eval_step)
  steps = {}  # a batch's shapes -> its step, compiled ahead where params_like is given
  if params_like is not None:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), params_like)
    for held in held_out.values():
      for local, size in held:
        if (key := _shapes(local, size)) not in steps:
          steps[key] = goodput.compile_ahead(
              step, abstract, batches.abstract_global_batch(local, rows, size))

  def evaluate(params):
    out = {}
    for name, held in held_out.items():
      ce, count = 0.0, 0
      for local, size in held:
        placed = batches.make_global_batch(local, rows, batches.local_rows(rows, size), size)
        c, n = steps.get(_shapes(local, size), step)(params, placed)
        ce, count = ce + float(c), count + int(n)
      mean = ce / max(count, 1)
      out[f'eval/lm/{name}/CE loss'] = mean
      out[f'eval/lm/{name}/PPL'] = float(np.exp(min(mean, 80.0)))
    return out
  return evaluate


def _shapes(local: dict[str, np.ndarray], size: int) -> tuple:
  return size, tuple((k, v.shape[1:], v.dtype.str) for k, v in sorted(local.items()))


def line(val: dict[str, float]) -> str:
  """'validation loss 5.0712  c4_en-validation loss 4.2  (1.3s)': each set, and the time."""
  losses = [f'{k.split("/")[2]} loss {v:.4f}' for k, v in val.items() if k.endswith('/CE loss')]
  return '  '.join(losses) + f"  ({val['eval/lm/time (s)']:.1f}s)"


class InLoop:
  """The run's in-loop evaluations at their cadences: held-out loss (train.eval_every) and
  the downstream tasks (train.downstream_eval_every; evaluation/in_loop.py), each also at
  the last step. cache_dir: this host's cache of the downstream plan."""

  def __init__(self, cfg: ml_collections.ConfigDict, mesh: Mesh, eval_step: Callable,
               cache_dir: str | None = None, params_like: Any = None):
    self.train = cfg.train
    self.held_out = evaluator(cfg, mesh, eval_step, params_like)
    self.downstream = in_loop.downstream_evaluator(cfg, mesh, cache_dir)

  def run(self, step: int, params: Any, finished: bool, writer: Any, memorization: Any,
          heartbeat: Any, account: Any) -> dict[str, float]:
    """Those due at `step`: written (metrics.MetricWriter), printed and returned. Their time
    is the account's (goodput.Account) `custom/held-out eval` and `custom/downstream eval`."""
    out = {}
    if self.held_out and (step % self.train.eval_every == 0 or finished):
      start = time.perf_counter()
      with heartbeat.compiling('evaluation'), account.phase('custom/held-out eval'):
        val = self.held_out(params)
      val['eval/lm/time (s)'] = time.perf_counter() - start
      held = val.get('eval/lm/validation/CE loss')  # the memorization watch's held-out set
      writer.write(step, {**val, **(memorization.observe_eval(step, held)
                                    if held is not None else {})})
      out.update(val)
      print(f'step {step:>7d}  {line(val)}', flush=True)
    if self.downstream and (step % self.train.downstream_eval_every == 0 or finished):
      start = time.perf_counter()
      with heartbeat.paused(), account.phase('custom/downstream eval'):  # minutes at 7B
        down = self.downstream(params)
      down['eval/downstream/time (s)'] = time.perf_counter() - start
      writer.write(step, down)
      out.update(down)
      print(f"step {step:>7d}  downstream {in_loop.headline(down)} "
            f"({down['eval/downstream/time (s)']:.1f}s)", flush=True)
    return out
