"""The latest committed checkpoint read into host memory on a thread, while the process
does other work.

train.py starts one before it opens the accelerator: on a TPU host that takes 8-10 s,
about as long as reading the 7B slice's 5.66 GB state from the host's disk, which is
most of a resume's restore. The restore then only checks that the step is the one read
and places its arrays on the devices (1.0 s instead of 9.3 s on a TPU v5e). The two
overlap only where the host's memory is cheap: on the sandboxed host measured, opening
the chip beside the read took twice as long, and the start-up as long as before
(docs/results/goodput.md).

Every chunk is checked against its checksum as the restore does. Nothing met here is
raised: a step that is unreadable, damaged, too large for the host's free memory, or
changed since it was read is left to the restore, which reads it again and reports or
walks back as it always does (checkpoint.restore_latest_good). One process only: each
process of a multi-process run reads just the chunks of its own devices, which are known
once the devices are. A local or shared filesystem only: in a bucket the read would make
a store that is down cost its retries twice.
"""

import atexit
import concurrent.futures
import os
import threading
import time
from typing import Any

from absl import logging
import numpy as np
import tensorstore as ts

from store import chunk_store
from store import step_dirs
from store import storage

# The state may take at most this share of the host memory free at the start: the
# restore's device copies, the loader and the compile still need room.
MAX_SHARE_OF_FREE_MEMORY = 0.5


def free_host_bytes() -> int | None:
  """Bytes of host memory available now (Linux: MemAvailable), or None if unknown."""
  try:
    with open('/proc/meminfo', encoding='ascii') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return None


def read_step(path: str, info: dict[str, Any], reads: list[Any] | None = None,
              stop: threading.Event | None = None) -> dict[str, np.ndarray]:
  """{array name: the whole array} of the committed step directory `path` (`info`: its
  metadata.json, chunk_store.read_info's), every chunk verified against it; raises what
  the restore would. Each array's tensorstore read is appended to `reads` as it is issued
  (to be cancelled); none is issued once `stop` is set."""
  arrays, use_ocdbt = info['arrays'], info['use_ocdbt']
  context = ts.Context()
  opening = {name: ts.open(chunk_store.spec(path, name, use_ocdbt), open=True,
                           context=context) for name in arrays}
  reads = [] if reads is None else reads
  with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
    loads = {}
    for name, future in opening.items():
      store = chunk_store.opened(path, name, arrays[name], use_ocdbt, future)
      box = tuple((0, n) for n in arrays[name]['shape'])
      if stop is not None and stop.is_set():
        raise RuntimeError('cancelled')
      reads.append(store.read())
      loads[name] = pool.submit(chunk_store.load_box, path, name, store, box, arrays[name],
                                reads[-1], True, use_ocdbt)
    return {name: load.result() for name, load in loads.items()}


class Prefetch:
  """Reads the latest committed step of `directory` on a thread; `take` hands it over."""

  def __init__(self, directory: str):
    self.step: int | None = None
    self.why_not = ''  # why nothing is (or will be) prefetched
    self._info: dict[str, Any] | None = None
    self._arrays: dict[str, np.ndarray] | None = None
    self._seconds = 0.0
    self._thread: threading.Thread | None = None
    self._reads: list[Any] = []  # the read's tensorstore futures (cancel)
    self._stop = threading.Event()
    if storage.is_url(directory):  # a store that is down must cost one retry budget, not two
      self.why_not = 'a bucket: the restore reads it'
      return
    try:
      steps = step_dirs.committed_steps(directory)
      if not steps:
        self.why_not = 'no committed step'
        return
      path = step_dirs.committed_dir(directory, steps[-1])
      info = chunk_store.read_info(path)
      nbytes = sum(int(np.prod(a['shape'])) * ts.dtype(a['dtype']).numpy_dtype.itemsize
                   for a in info['arrays'].values())
    except Exception as e:  # pylint: disable=broad-except  # the restore meets it again
      self.why_not = f'its metadata could not be read ({e})'
      return
    free = free_host_bytes()
    if free is not None and nbytes > MAX_SHARE_OF_FREE_MEMORY * free:
      self.why_not = (f'the state ({nbytes / 1e9:.2f} GB) is over {MAX_SHARE_OF_FREE_MEMORY:.0%} '
                      f'of the host memory free ({free / 1e9:.2f} GB)')
      return
    self.step = steps[-1]
    self._info = info  # what the read is checked against, and `take` compares
    self._thread = threading.Thread(target=self._read, args=(path,), daemon=True,
                                    name='checkpoint prefetch')
    self._thread.start()
    # A process that ends early (a refused resume, a workdir in use) stops the read rather
    # than wait for it, but not before the thread has let go of tensorstore.
    atexit.register(self.cancel)

  def _read(self, path: str) -> None:
    began = time.perf_counter()
    try:
      self._arrays = read_step(path, self._info, self._reads, self._stop)
    except Exception as e:  # pylint: disable=broad-except  # the restore meets it again
      self.why_not = f'step {self.step} could not be read ahead ({e})'
    self._seconds = time.perf_counter() - began

  def wait(self) -> None:
    """Until the read has ended (at once when nothing is read)."""
    if self._thread is not None:
      self._thread.join()

  def cancel(self) -> None:
    """Stops the read (what it read is dropped) and waits for its thread to end."""
    self._stop.set()
    for read in list(self._reads):
      read.cancel()
    self.wait()
    self._arrays = None

  def take(self, step: int, info: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The arrays of `step` if they were read and its metadata (`info`, as the restore
    read it) is still what was read with them; None otherwise. Waits for the read; hands
    the arrays over once (the host memory goes with them)."""
    self.wait()
    arrays, self._arrays = self._arrays, None
    if arrays is None or step != self.step:
      return None
    if info.get('arrays') != self._info.get('arrays'):
      logging.warning('Checkpoint step %d changed after it was read ahead; reading it again.',
                      step)
      return None
    logging.info('Checkpoint step %d: %.2f GB read to host in %.1f s, beside the start-up.',
                 step, sum(a.nbytes for a in arrays.values()) / 1e9, self._seconds)
    return arrays
