"""Skipped global batches: the windows a rollback (monitor/rollback.py) or train.skip_batches
passes over, and where optimizer steps land around them. data.Loader and the
resume checks use it (as data.Skips)."""

from typing import Sequence

from errors import DataError


class Skips:
  """A set of skipped global batches: the union of [start, stop) windows.

  A global batch index counts batches across epochs: (epoch - 1) * n + step
  for n batches per epoch. Optimizer step k + 1 reads the k-th (0-based)
  index outside the windows, `nth(k)`; without windows, k itself.
  """

  def __init__(self, windows: Sequence[Sequence[int]] = ()):
    merged: list[list[int]] = []
    for start, stop in sorted((int(a), int(b)) for a, b, *_ in windows):
      if not 0 <= start < stop:
        raise DataError(f'skip window [{start}, {stop}) must have 0 <= start < stop.')
      if merged and start <= merged[-1][1]:  # overlapping or adjacent: one window
        merged[-1][1] = max(merged[-1][1], stop)
      else:
        merged.append([start, stop])
    self.windows = merged

  def __bool__(self) -> bool:
    return bool(self.windows)

  def __str__(self) -> str:
    return ', '.join(f'[{a}, {b})' for a, b in self.windows) or 'none'

  def advance(self, index: int) -> int:
    """The first global batch >= `index` outside every window."""
    for start, stop in self.windows:
      if start <= index < stop:
        return stop
    return index

  def nth(self, k: int) -> int:
    """The global batch optimizer step k + 1 reads: the k-th (0-based) one outside the windows."""
    for start, stop in self.windows:
      if k < start:
        break
      k += stop - start  # every window that starts at or before it pushes it on
    return k

  def skipped_before(self, index: int) -> int:
    """How many skipped global batches lie below `index`."""
    return sum(max(0, min(stop, index) - start) for start, stop in self.windows)

  def count_before(self, index: int) -> int:
    """Optimizer steps done when the run reaches global batch `index`: those read below it."""
    return index - self.skipped_before(index)
