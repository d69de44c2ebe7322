"""In-loop downstream evaluation: OLMo-core's DownstreamEvaluatorCallback on the run's mesh.

    evaluate = downstream_evaluator(cfg, mesh)  # None when cfg.train.eval_tasks is off
    metrics = evaluate(state.params)  # {'eval/downstream/<task> (<metric>)': value}

OLMo-core's Olmo 3 runs score olmo_eval tasks every `eval_interval` steps:
each request's context + continuation goes through the model, ICLMetric turns
the continuation's log-probabilities into accuracy, BPB, soft scores, ...
(evaluation/olmo_eval_requests.py builds the same requests and computes the
same metrics; docs/evaluation.md). Here the requests are scored with the
training forward (model.build(cfg.model).apply, then model.head over every
row of the padded vocabulary, as OLMo-core's logits are), in the run's compute
dtype, batched and packed:

- inputs that are a prefix of another input are served by it (all choices of
  a fast-MC question, an RC context shared by one-token answers);
- the rest are packed into [B, data.seq_len] rows with per-input segment ids
  and positions from 0 (attention within each input: the logits are those of
  the input alone), B = train.downstream_eval_batch_size rows (default:
  train.micro_batch_size per batch shard, a training micro-batch's memory);
- each row has K query slots (position, token): the hidden states at those
  positions go through the head C at a time, so no [B, T, V] logits exist.

Every process builds the same rows (the plan is deterministic) and feeds only
those its devices hold (batches.make_global_batch), so each host scores its
share of the rows; each row's results are read by the lowest process that
holds it and summed across processes (process_allgather), so every process
computes the same metrics. The plan is built once and reused at every
evaluation; the score function compiles once.

Shapes: B rows per batch, R row length (data.seq_len), D d_model, V vocab
(padded), K query slots per row, C slots per head step, N = K / C.
"""

import dataclasses
import time
from collections.abc import Callable

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections
import numpy as np
from tokenizers import Tokenizer

import batches
import errors
import model
import sharding
from evaluation import olmo_eval_requests
from evaluation.scoring import place_rows, prefix_hosts

CHUNK = 128  # C: query slots per head step; bounds the [B, C, V] float32 logits block
DEVICE_KEYS = ('tokens', 'segment_ids', 'positions', 'query_positions', 'query_tokens')


@dataclasses.dataclass
class Plan:
  """The packed rows of every request, as this process feeds and reads them."""
  rows_per_batch: int  # B
  row_len: int  # R
  slots: int  # K
  local_rows: np.ndarray  # rows of each [B, ...] batch this process's devices hold (sorted)
  batches: list[dict[str, np.ndarray]]  # per batch: DEVICE_KEYS [len(local_rows), R or K],
  # and 'entry' [len(local_rows), K]: the entry each slot adds to (-1: none, or another
  # process reads that row)
  num_entries: int
  tokens: int  # real tokens fed per evaluation (all processes)


def rows_per_batch(cfg: ml_collections.ConfigDict, mesh: Mesh) -> int:
  """B: train.downstream_eval_batch_size, or micro_batch_size rows per batch shard."""
  shards = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES if a in mesh.shape]))
  b = cfg.train.downstream_eval_batch_size or cfg.train.micro_batch_size * shards
  if b % shards:
    raise errors.ConfigError(
        f'train.downstream_eval_batch_size={b} is not a multiple of the {shards} batch shards '
        f'of the mesh {dict(mesh.shape)}; set it to a multiple (or 0: micro_batch_size per shard).')
  return b


def plan(entries: list[olmo_eval_requests.Entry], mesh: Mesh, rows_per_batch_: int,
         row_len: int) -> Plan:
  """Packs every entry's input into rows and lays them out for this process."""
  # An input that is a prefix of another is served by it (scoring.prefix_hosts).
  host, hosts = prefix_hosts([e.query for e in entries])
  rows, place = place_rows(hosts, row_len)
  queries: list[list[tuple[int, int, int]]] = [[] for _ in rows]  # (position, token, entry)
  for i, e in enumerate(entries):
    r, offset = place[host[e.query]]
    first = offset + len(e.query) - len(e.targets)
    queries[r] += [(first + j, tok, i) for j, tok in enumerate(e.targets)]
  slots = CHUNK * max(1, -(-max(len(q) for q in queries) // CHUNK))

  b = rows_per_batch_
  row_sharding = sharding.batch_sharding(mesh)
  local = batches.local_rows(row_sharding, b)
  me = jax.process_index()
  owner = np.full(b, jax.process_count(), np.int64)  # the lowest process holding each row
  for device, index in row_sharding.devices_indices_map((b, row_len)).items():
    block = np.arange(b)[index[0]]
    owner[block] = np.minimum(owner[block], device.process_index)
  out = []
  for n in range(-(-len(rows) // b)):
    arrays = {k: np.zeros((len(local), slots if k.startswith('query') else row_len), np.int32)
              for k in DEVICE_KEYS}
    arrays['entry'] = np.full((len(local), slots), -1, np.int64)
    for li, r_in_batch in enumerate(local):
      r = n * b + int(r_in_batch)
      if r >= len(rows):
        continue
      offset = 0
      for s, k in enumerate(rows[r], 1):
        h = hosts[k]
        arrays['tokens'][li, offset:offset + len(h)] = h
        arrays['segment_ids'][li, offset:offset + len(h)] = s
        arrays['positions'][li, offset:offset + len(h)] = np.arange(len(h))
        offset += len(h)
      q = np.asarray(queries[r], np.int64).reshape(-1, 3)
      arrays['query_positions'][li, :len(q)] = q[:, 0]
      arrays['query_tokens'][li, :len(q)] = q[:, 1]
      if owner[r_in_batch] == me:
        arrays['entry'][li, :len(q)] = q[:, 2]
    out.append(arrays)
  return Plan(b, row_len, slots, local, out, len(entries), sum(len(h) for h in hosts))


def score_fn(cfg_model: ml_collections.ConfigDict, mesh: Mesh) -> Callable:
  """jit(params, tokens, segment_ids, positions [B, R], query positions, tokens [B, K])
  -> log p(token | its row's prefix) [B, K] float32, over all V head rows."""
  forward = model.build(cfg_model)

  def score(params, tokens_BR, segment_ids_BR, positions_BR, qpos_BK, qtok_BK):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # model.constrain_batch needs it
      h_BRD = forward.apply(params, tokens_BR, segment_ids_BR, positions_BR)
      h_BKD = model.constrain_batch(jnp.take_along_axis(h_BRD, qpos_BK[:, :, None], axis=1))
    b, k, d = h_BKD.shape

    def chunk(args):
      h_BCD, tok_BC = args
      logits_BCV = model.head(params, h_BCD)
      target_BC = jnp.take_along_axis(logits_BCV, tok_BC[:, :, None], axis=2)[:, :, 0]
      return target_BC - jax.nn.logsumexp(logits_BCV, axis=2)
    logp_NBC = jax.lax.map(chunk, (h_BKD.reshape(b, k // CHUNK, CHUNK, d).swapaxes(0, 1),
                                   qtok_BK.reshape(b, k // CHUNK, CHUNK).swapaxes(0, 1)))
    return logp_NBC.swapaxes(0, 1).reshape(b, k)
  return jax.jit(score, out_shardings=sharding.batch_sharding(mesh))


def _local_rows_of(out: jax.Array, local: np.ndarray) -> np.ndarray:
  """This process's rows of a [B, K] result, in `local` order."""
  where = {int(r): i for i, r in enumerate(local)}
  rows = np.zeros((len(local), out.shape[1]), np.float32)
  for shard in out.addressable_shards:
    block = np.arange(out.shape[0])[shard.index[0]]
    rows[[where[int(r)] for r in block]] = np.asarray(shard.data)
  return rows


def _sum_over_processes(x: np.ndarray) -> np.ndarray:
  """Per-entry sums that each process filled for its own rows, summed over processes.

  float64 travels as two float32s (hi + lo), so the sums arrive exactly enough."""
  if jax.process_count() == 1:
    return x
  hi = x.astype(np.float32)
  lo = (x - hi.astype(np.float64)).astype(np.float32)
  both = np.asarray(multihost_utils.process_allgather(np.stack([hi, lo])), np.float64)
  return both[:, 0].sum(axis=0) + both[:, 1].sum(axis=0)


def downstream_evaluator(cfg: ml_collections.ConfigDict, mesh: Mesh
                         ) -> Callable[[model.Params], dict[str, float]] | None:
  """params -> {'eval/downstream/<task> (<metric>)': value} for cfg.train.eval_tasks, or None.

  None when the evals are off (no tasks, or downstream_eval_every=0) or cannot
  run here (the wheel or the tokenizer missing, context parallelism), which is
  logged once. Builds every task's requests and the packed plan now.
  """
  t = cfg.train
  if not olmo_eval_requests.active(t):
    return None
  why = olmo_eval_requests.unavailable(cfg)
  if why:
    logging.warning('Downstream evals (train.eval_tasks) are off: %s.', why)
    return None
  start = time.perf_counter()
  path = olmo_eval_requests.tokenizer_path(cfg.data)
  tokenizer = Tokenizer.from_file(path)
  if tokenizer.get_vocab_size() > cfg.model.vocab_size:
    raise errors.ConfigError(f'train.eval_tasks: the tokenizer {path} has '
                             f'{tokenizer.get_vocab_size()} tokens, the model only '
                             f'{cfg.model.vocab_size}; set --config.data.tokenizer to the run\'s.')
  tasks = [olmo_eval_requests.build(label, tokenizer, seq_len=cfg.data.seq_len,
                                    bos_token_id=cfg.data.bos_token_id,
                                    limit=t.downstream_eval_limit)
           for label in sorted(set(t.eval_tasks))]  # OLMo-core runs them sorted
  entries = [e for task in tasks for e in task.entries]
  bounds = np.cumsum([0] + [len(task.entries) for task in tasks])
  the_plan = plan(entries, mesh, rows_per_batch(cfg, mesh), cfg.data.seq_len)
  cfg_model = ml_collections.ConfigDict(cfg.model.to_dict())
  if cfg_model.attention_impl == 'cudnn':  # packed rows need segment ids, which cuDNN lacks here
    cfg_model.attention_impl = 'xla'
  score = score_fn(cfg_model, mesh)
  row_sharding = sharding.batch_sharding(mesh)
  logging.info('Downstream evals: %d tasks, %d scored continuations, %d tokens in %d batches '
               'of %d x %d (built in %.1fs).', len(tasks), len(entries), the_plan.tokens,
               len(the_plan.batches), the_plan.rows_per_batch, the_plan.row_len,
               time.perf_counter() - start)

  def evaluate(params: model.Params) -> dict[str, float]:
    sums = np.zeros(the_plan.num_entries, np.float64)

    def add(arrays, out):
      logp = _local_rows_of(out, the_plan.local_rows)
      mask = arrays['entry'] >= 0
      np.add.at(sums, arrays['entry'][mask], logp[mask].astype(np.float64))
    pending = []
    for arrays in the_plan.batches:
      placed = batches.make_global_batch({k: arrays[k] for k in DEVICE_KEYS}, row_sharding,
                                         the_plan.local_rows, the_plan.rows_per_batch)
      pending.append((arrays, score(params, *(placed[k] for k in DEVICE_KEYS))))
      if len(pending) > 2:  # dispatch runs ahead; read back two batches behind
        add(*pending.pop(0))
    for p in pending:
      add(*p)
    logp = _sum_over_processes(sums)
    out = {}
    for task, a, z in zip(tasks, bounds[:-1], bounds[1:]):
      out.update(task.metrics(logp[a:z]))
    return out
  return evaluate


def headline(metrics: dict[str, float]) -> str:
  """One line: the mean accuracy of the accuracy tasks and the mean BPB of the BPB tasks
  (OLMo-core's names `accuracy` / `length-normalized accuracy`, and `BPB`)."""
  tasks: dict[str, dict[str, float]] = {}
  for name, value in metrics.items():
    task, _, label = name[len(olmo_eval_requests.PREFIX):].rpartition(' (')
    if name.startswith(olmo_eval_requests.PREFIX) and label[:-1] in \
        olmo_eval_requests.METRIC_LABELS.values():
      tasks.setdefault(task, {})[label[:-1]] = value
  acc = [m.get('accuracy', m.get('length-normalized accuracy')) for m in tasks.values()]
  acc = [a for a in acc if a is not None]
  bpb = [m['BPB'] for m in tasks.values()
         if 'BPB' in m and 'accuracy' not in m and 'length-normalized accuracy' not in m]
  parts = [f'{len(tasks)} tasks']
  if acc:
    parts.append(f'accuracy {np.mean(acc):.4f} ({len(acc)})')
  if bpb:
    parts.append(f'BPB {np.mean(bpb):.4f} ({len(bpb)})')
  return ', '.join(parts)
