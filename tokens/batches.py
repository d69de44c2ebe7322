"""A batch from instances: labels, the instance mask, document boundaries.

What data.Loader (and eval, the audit, the tests) turn token rows into: the
batch dict of docs/data.md, as OLMo-core's collator and train module build it;
and how a global batch is split: over data-parallel ranks in OLMo-core's
order, over hosts (each loads only its rows), into micro-batches.

Shapes: B instances (the global batch), T sequence length, W data-parallel batch
shards; in the repetition filter L = T - p for period p, R rows left to check.
"""

from typing import NamedTuple

import jax
import numpy as np

from errors import ConfigError, DataError
import loss


class RepetitionFilter(NamedTuple):
  """OLMo-core InstanceFilterConfig defaults (the MaxText reproduction's setting)."""
  max_period: int = 13
  min_period: int = 1
  max_count: int = 32


def make_batch(tokens_BT: np.ndarray, *, eos_token_id: int,
               repetition_filter: RepetitionFilter | None = None,
               document_masking: bool = False, real_B: np.ndarray | None = None,
               bos_token_id: int | None = None) -> dict[str, np.ndarray]:
  """The batch dict (docs/data.md): tokens, labels, instance_mask[, segment_ids].

  Labels are the inputs shifted left with the last position ignored (OLMo-core
  get_labels). A rejected instance keeps its labels; `instance_mask` tells the
  loss to drop its terms while still counting them in the denominator. For
  packed instances, `real_B` counts each one's real tokens: labels that would
  predict padding are ignored (OLMo-core's label_mask).
  """
  labels_BT = np.empty_like(tokens_BT)
  labels_BT[:, :-1] = tokens_BT[:, 1:]
  labels_BT[:, -1] = loss.IGNORE_INDEX
  if real_B is not None:
    labels_BT[np.arange(1, tokens_BT.shape[1] + 1)[None, :] >= np.asarray(real_B)[:, None]] = (
        loss.IGNORE_INDEX)
  if repetition_filter is None:
    mask_B = np.ones(tokens_BT.shape[0], bool)
  else:
    mask_B = ~repetition_rejected(tokens_BT, repetition_filter)
  batch = {'tokens': tokens_BT, 'labels': labels_BT, 'instance_mask': mask_B}
  if document_masking:
    batch['segment_ids'] = segment_ids(tokens_BT, eos_token_id, bos_token_id)
  return batch


def repetition_rejected(tokens_BT: np.ndarray,
                        rf: RepetitionFilter = RepetitionFilter()) -> np.ndarray:
  """bool [B]: True where OLMo-core's repetition filter rejects the instance.

  OLMo-core (`_validate_instance` over `find_periodic_sequences`) rejects when a
  run it reports for some period p in [min_period, min(max_period, T // 3)]
  repeats `times` >= max_count; it reports only runs with times > 2, where
  times = (L + p) // p for a maximal run of L positions t with x[t] == x[t-p].
  Its row-reshaping scan finds exactly those runs (every run with times > 2
  spans a whole aligned row; its padding keeps the wrap-around row from ever
  matching), so an instance is rejected iff for some p the matches x[t] ==
  x[t-p] hold on (max(max_count, 3) - 1) * p consecutive positions.
  """
  if rf.min_period < 1:
    raise DataError(f'repetition filter min_period must be >= 1, got {rf.min_period}.')
  B, T = tokens_BT.shape
  rejected_B = np.zeros(B, bool)
  threshold = max(rf.max_count, 3)  # reported (times > 2) and times >= max_count
  for p in range(rf.min_period, min(rf.max_period, T // 3) + 1):
    need = (threshold - 1) * p  # (L + p) // p >= threshold  <=>  L >= need
    if need > T - p:
      continue
    eq_BL = tokens_BT[:, p:] == tokens_BT[:, :-p]
    rows = np.flatnonzero(np.count_nonzero(eq_BL, axis=1) >= need)  # cheap pre-check
    if rows.size:
      count_RL = np.zeros((rows.size, T - p + 1), np.int32)
      np.cumsum(eq_BL[rows], axis=1, out=count_RL[:, 1:])
      rejected_B[rows] |= (count_RL[:, need:] - count_RL[:, :-need] == need).any(axis=1)
  return rejected_B


def segment_ids(tokens_BT: np.ndarray, eos_token_id: int,
                bos_token_id: int | None = None) -> np.ndarray:
  """int32 [B, T] document index per token; the token that ends a document belongs to it.

  Matches OLMo-core get_document_lengths: documents end at each EOS, or with a
  BOS id at each EOS followed by a BOS. Padding after the last end is one more
  document (or, when PAD is EOS, one per pad token), as OLMo-core counts it.
  """
  if bos_token_id is None:
    end_BT = tokens_BT == eos_token_id
  else:
    end_BT = np.zeros(tokens_BT.shape, bool)
    end_BT[:, :-1] = (tokens_BT[:, :-1] == eos_token_id) & (tokens_BT[:, 1:] == bos_token_id)
  return (np.cumsum(end_BT, axis=1, dtype=np.int32) - end_BT).astype(np.int32)


# ----------------------------------------------------------------------------
# Data-parallel split and host sharding.


def batch_positions(global_batch_size: int, num_shards: int) -> np.ndarray:
  """Global-batch position held by each row of the batch array, for W batch shards.

  Contiguous row block s of the array (what JAX puts on batch shard s) holds
  positions s, s+W, s+2W, ...: exactly OLMo-core data-parallel rank s's
  instances, in its order (NumpyFSLDataLoader._get_local_instance_indices). The
  set of instances in a step never depends on W; only which device gets which.
  """
  if global_batch_size % num_shards:  # a setting, not the data: EXIT_USAGE
    raise ConfigError(f'data.global_batch_size={global_batch_size} is not divisible by the '
                      f'{num_shards} devices that split the batch; set '
                      '--config.data.global_batch_size to a multiple of the data-parallel size '
                      '(or run on a device count that divides it).')
  return np.arange(global_batch_size).reshape(-1, num_shards).T.reshape(-1)


def _row_slices(index_map: dict, global_batch_size: int) -> set[tuple[int, int]]:
  return {(s[0].start or 0, global_batch_size if s[0].stop is None else s[0].stop)
          for s in index_map.values()}


def num_batch_shards(sharding: jax.sharding.Sharding, global_batch_size: int,
                     seq_len: int = 1) -> int:
  """How many distinct row blocks the sharding splits a [B, T] batch into (W)."""
  return len(_row_slices(sharding.devices_indices_map((global_batch_size, seq_len)),
                         global_batch_size))


def local_rows(sharding: jax.sharding.Sharding, global_batch_size: int,
               seq_len: int = 1) -> np.ndarray:
  """Sorted rows of the [B, T] batch array that this process's devices hold."""
  blocks = _row_slices(sharding.addressable_devices_indices_map((global_batch_size, seq_len)),
                       global_batch_size)
  return np.unique(np.concatenate([np.arange(a, b) for a, b in blocks]))


def grad_accum_steps(global_batch_size: int, num_shards: int, micro_batch_size: int) -> int:
  """Micro-batches per step: B / W / micro_batch_size; a ConfigError (EXIT_USAGE) naming the
  fields if it does not divide: the settings are wrong, not the data."""
  per_shard = global_batch_size // num_shards
  batch_positions(global_batch_size, num_shards)  # raises if W does not divide B
  if micro_batch_size <= 0 or per_shard % micro_batch_size:
    fits = [m for m in range(1, per_shard + 1) if per_shard % m == 0]
    raise ConfigError(f'{per_shard} instances per device (data.global_batch_size='
                      f'{global_batch_size} / {num_shards} devices) is not a multiple of '
                      f'micro_batch_size {micro_batch_size}; set '
                      f'--config.train.micro_batch_size to one of {fits} (or change '
                      'data.global_batch_size or the device count).')
  return per_shard // micro_batch_size


def _key_sharding(sharding: jax.sharding.NamedSharding, ndim: int
                  ) -> jax.sharding.NamedSharding:
  """The [B, T] batch sharding cut or padded to an array of `ndim` axes."""
  spec = (tuple(sharding.spec) + (None,) * ndim)[:ndim]
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def abstract_global_batch(local_batch: dict[str, np.ndarray],
                          sharding: jax.sharding.NamedSharding, global_batch_size: int
                          ) -> dict[str, jax.ShapeDtypeStruct]:
  """What make_global_batch would build from `local_batch`, without building it (for an
  ahead-of-time compile)."""
  return {key: jax.ShapeDtypeStruct((global_batch_size,) + local.shape[1:], local.dtype,
                                    sharding=_key_sharding(sharding, local.ndim))
          for key, local in local_batch.items()}


def make_global_batch(local_batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding,
                      rows: np.ndarray, global_batch_size: int) -> dict[str, jax.Array]:
  """Global jax.Arrays from only this process's rows (`rows` = local_rows(...), in order).

  `sharding` is the [B, T] batch sharding; [B] arrays use its first axis.
  """
  if not isinstance(sharding, jax.sharding.NamedSharding):
    raise DataError(f'make_global_batch needs a NamedSharding, got {type(sharding).__name__}.')
  rows = np.asarray(rows)
  out = {}
  for key, local in local_batch.items():
    shape = (global_batch_size,) + local.shape[1:]
    arr_sharding = _key_sharding(sharding, len(shape))

    def callback(index, local=local, key=key):
      want = np.arange(global_batch_size)[index[0]]
      pos = np.searchsorted(rows, want)
      if pos.size and (pos.max() >= rows.size or not np.array_equal(rows[pos], want)):
        raise DataError(f'batch[{key!r}]: a local device needs rows this process did not load; '
                        'build `rows` with local_rows() from the same sharding.')
      return local[(pos,) + tuple(index[1:])]

    out[key] = jax.make_array_from_callback(shape, arr_sharding, callback)
  return out
