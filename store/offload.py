"""A save's snapshot, off the training loop's path: an on-device copy, then host, behind.

A save must capture the state before the next train step donates (overwrites)
its buffers. Copying it to host does that, but on an accelerator the loop
waits for the transfer: 5.66 GB at ~1.9 GB/s is ~3 s on a TPU v5e, against a
~0.26 s step. A copy on the device itself (HBM to HBM, ~300 GB/s there) takes
~20 ms and is dispatched like a step, so `take` returns at once; the
save's thread then moves the copy to host (`to_host`) while the steps run,
and frees it. The copy needs HBM room for the arrays copied, on every device
at once: `room` reads each device's allocator (its limit less its peak so
far, an earlier copy's share of that peak taken out, less the temporaries
the train step's compiled plan needs, which a TPU's peak counter does not
show), and `take` copies only the
arrays that fit (largest first); the rest are copied to host before it
returns, as every save did before (`Taken.blocking_bytes` and `why` say how
much, and why, for the log).

On a CPU the device is the host: the host view is a zero-copy view of the
buffer, which PJRT keeps alive through donation, so `take` copies nothing
there unless asked to (`device_copy=True`, which the tests use to run this
path on CPU).

Reading order: reserve, room, plan, take, to_host. Shapes: none (any pytree leaves).
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from store import chunk_store

# Platforms whose device memory is the host's: nothing to take off the loop's path.
HOST_PLATFORMS = ('cpu',)
# Left free beside the copy: the allocator rounds and fragments, and a peak measured
# over the steps so far can move (an evaluation's first batch, a longer document).
MARGIN = 0.05


@dataclasses.dataclass
class Taken:
  """What `take` captured: every leaf, or its on-device copy, in the caller's order."""
  names: list[str]
  leaves: list[Any]          # host snapshots where blocking, device copies where copied
  copied: list[bool]         # per leaf: an on-device copy, still to be moved to host
  copied_bytes: int          # per device, the largest
  blocking_bytes: int        # per process: what went to host before `take` returned
  why: str                   # one line for the log: the mode and, for a fallback, why
  per_device: dict[Any, int]  # the copies' bytes on each device
  peak_before: dict[Any, int]  # each device's allocator peak before the copy


def _device_bytes(leaf: Any) -> dict[Any, int]:
  """Bytes a copy of `leaf` needs on each of this process's devices."""
  out: dict[Any, int] = {}
  for shard in leaf.addressable_shards:
    out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


# Per device: the peak of everything but this module's copies, and the allocator's peak
# when the last copy was freed. The allocator's own peak never falls, and once a copy has
# lived beside the steps it counts the copy too: read raw, the second save would find
# no room left for the same copy the first one made.
_LOOP_PEAK: dict[Any, int] = {}
_PEAK_AFTER_COPY: dict[Any, int] = {}
# Per device, the most temporary memory a program of the loop's needs while it runs. The
# TPU runtime's peak counter does not show it (it reads barely above the arguments,
# whatever the step: docs/results/tpu_v5e.md), so the programs' own plans are added.
_RESERVED = {'bytes': 0}


def reserve(nbytes: int, replace: bool = False) -> int:
  """A program of the loop needs `nbytes` of temporaries per device while it runs (its
  compiled memory_analysis(); goodput.compile_ahead reports the train step's): the
  largest such is kept (`replace`: set as given). Returns what was reserved before."""
  before = _RESERVED['bytes']
  _RESERVED['bytes'] = int(nbytes) if replace else max(before, int(nbytes))
  return before


def _peak(stats: dict[str, int]) -> int:
  return max(stats.get('peak_bytes_in_use', 0), stats.get('bytes_in_use', 0))


def room(devices: list[Any]) -> dict[Any, int] | None:
  """Free bytes per device for a copy beside the train step: the limit (less MARGIN) less
  the peak of what the loop itself allocated (its steps, evaluations) so far, less the
  temporaries its programs' plans need (`reserve`); None where the platform reports no
  allocator (CPU)."""
  out = {}
  for d in devices:
    stats = d.memory_stats()
    if not stats or 'bytes_limit' not in stats:
      return None
    peak = _peak(stats)
    if peak > _PEAK_AFTER_COPY.get(d, -1):  # reached with no copy of ours alive: the loop's
      _LOOP_PEAK[d] = max(_LOOP_PEAK.get(d, 0), peak)
    used = max(_LOOP_PEAK[d], stats.get('bytes_in_use', 0)) + _RESERVED['bytes']
    out[d] = max(0, int(stats['bytes_limit'] * (1 - MARGIN)) - used)
  return out


def _copies_freed(copied: dict[Any, int], peak_before: dict[Any, int]) -> None:
  """After the copies (bytes per device) were freed: a peak reached while they lived was
  the loop's own less the copy."""
  for d, nbytes in copied.items():
    stats = d.memory_stats()
    if not stats:
      continue
    peak = _peak(stats)
    if peak > peak_before.get(d, peak):
      _LOOP_PEAK[d] = max(_LOOP_PEAK.get(d, 0), peak - nbytes)
    _PEAK_AFTER_COPY[d] = peak


def plan(leaves: list[Any], free: dict[Any, int] | None) -> list[bool]:
  """Which jax.Array leaves to copy on device: the largest first while every device they
  touch keeps room (free None: every jax.Array leaf)."""
  chosen = [False] * len(leaves)
  order = sorted((i for i, x in enumerate(leaves) if isinstance(x, jax.Array)),
                 key=lambda i: -leaves[i].nbytes)
  left = None if free is None else dict(free)
  for i in order:
    need = _device_bytes(leaves[i])
    if left is not None and any(n > left.get(d, 0) for d, n in need.items()):
      continue
    chosen[i] = True
    if left is not None:
      for d, n in need.items():
        left[d] -= n
  return chosen


@jax.jit
def _copy(xs: list[jax.Array]) -> list[jax.Array]:
  # copy_p, not an identity: jit may hand an input buffer back as its output.
  return [jnp.copy(x) for x in xs]


def take(names: list[str], leaves: list[Any], process_index: int, chunk_bytes: int,
         device_copy: bool | str = 'auto',
         agree: Callable[[list[bool]], list[bool]] = lambda chosen: chosen) -> Taken:
  """Captures `leaves` before the caller may donate or change them.

  device_copy: 'auto' copies on device where the platform's arrays are not host memory,
  as far as `room` allows; True copies every jax.Array on device (room is not asked);
  False copies nothing there (every array to host now). agree: every process's choice
  made one where it rests on its own devices' room ('auto' off CPU; the copy of a global
  array is one program, which every process must run alike): checkpoint.py ANDs them.
  """
  arrays = [x for x in leaves if isinstance(x, jax.Array)]
  devices = sorted({d for x in arrays for d in x.sharding.addressable_devices}, key=id)
  platform = devices[0].platform if devices else 'cpu'
  if device_copy is True:
    free, chosen = None, plan(leaves, None)
    why = 'copied on device (device_copy=True)'
  elif (device_copy is False or not arrays
        or (device_copy == 'auto' and platform in HOST_PLATFORMS)):
    free, chosen = None, [False] * len(leaves)
    why = ('to host at once (device_copy=False)' if device_copy is False else
           'to host at once (a zero-copy view: on CPU the device is the host)')
  elif device_copy == 'auto':  # the only choice that can differ between processes
    free = room(devices)
    chosen = agree(plan(leaves, free) if free is not None else [False] * len(leaves))
    why = ''
  else:
    raise ValueError(f'device_copy={device_copy!r}: must be True, False or "auto".')
  copy_idx = [i for i, c in enumerate(chosen) if c]
  out = list(leaves)
  peak_before = {d: _peak(stats) for d in devices if copy_idx and (stats := d.memory_stats())}
  if copy_idx:  # dispatched before any host copy below, and before the next step
    for i, y in zip(copy_idx, _copy([leaves[i] for i in copy_idx])):
      out[i] = y
  rest = [i for i, c in enumerate(chosen) if not c]
  host = chunk_store.snapshot([names[i] for i in rest], [leaves[i] for i in rest],
                              process_index, chunk_bytes)
  blocking = stayed = 0  # all to host now; of it, from jax.Arrays (a transfer to wait for)
  for i, snap in zip(rest, host):
    out[i] = snap
    blocking += sum(p.nbytes for _, p in snap.pieces)
    stayed += sum(p.nbytes for _, p in snap.pieces) if isinstance(leaves[i], jax.Array) else 0
  per_device: dict[Any, int] = {}
  for i in copy_idx:
    for d, n in _device_bytes(leaves[i]).items():
      per_device[d] = per_device.get(d, 0) + n
  copied = max(per_device.values(), default=0)
  if not why:
    worst = min(free.values()) / 1e9 if free else 0.0
    if free is None:
      why = f'to host at once ({platform} reports no device memory limit)'
    elif stayed:
      why = (f'{copied / 1e9:.2f} GB copied on device, {stayed / 1e9:.2f} GB to host at '
             f'once: the device has {worst:.2f} GB free beside the step\'s peak (less '
             f'{MARGIN:.0%}); free HBM (a smaller train.micro_batch_size, more remat) to '
             'take the whole save off the loop')
    else:
      why = f'copied on device ({copied / 1e9:.2f} GB of {worst:.2f} GB free)'
  return Taken(list(names), out, chosen, copied, blocking, why, per_device, peak_before)


def to_host(taken: Taken, process_index: int, chunk_bytes: int
            ) -> list[chunk_store.Snapshot]:
  """The save's thread: every leaf as a host Snapshot; the device copies are freed.

  One array at a time, each freed once on host: the loop's own small transfers (a
  step's metrics, read at log steps) then wait behind one array's transfer at most,
  not behind the whole state's (seconds), and the HBM goes back as the copy drains."""
  idx = [i for i, c in enumerate(taken.copied) if c]
  out = list(taken.leaves)
  for i in idx:
    out[i], = chunk_store.snapshot([taken.names[i]], [taken.leaves[i]], process_index,
                                   chunk_bytes)
    taken.leaves[i].delete()  # its bytes are on host now; the HBM goes back at once
  if idx:
    _copies_freed(taken.per_device, taken.peak_before)
  taken.leaves = out
  taken.copied = [False] * len(out)
  return out
