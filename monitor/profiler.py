"""A jax.profiler trace of chosen train steps, on demand (docs/monitoring.md).

    --config.train.profile_steps='(START, STOP)'  # the steps logged as START..STOP, inclusive
    --config.train.profile_hosts='(0, 3)'          # the processes that trace (default: 0)

On each chosen process the trace starts before step START and stops once
step STOP's results are ready; the files land in
<workdir>/profile/plugins/profile/steps_START-STOP/, TensorBoard's layout:

- process<i>.<host>.xplane.pb: `tensorboard --logdir <workdir>/profile` (with
  the tensorboard-plugin-profile package) shows it in the Profile tab (trace
  viewer, op profile, memory viewer);
- process<i>.<host>.trace.json.gz: the same timeline as a Chrome trace, which
  ui.perfetto.dev or chrome://tracing opens as it is.

The trace is written to a local temporary folder and then copied with
store/storage.py, so a gs:// or s3:// workdir gets the files too. A resume inside
the window traces the steps left. Tracing only watches: the compiled step
and its inputs are the same, so the losses are bit for bit those of a run
without it (tests/test_profile.py). A profiler that fails to start or stop
warns and training goes on.
"""

import os
import shutil
import tempfile
from typing import Any

from absl import logging
import jax
import ml_collections

from store import storage

FOLDER = 'profile'  # <workdir>/profile: tensorboard --logdir points here


def check_config(cfg_train: ml_collections.ConfigDict) -> None:
  """train.profile_steps (within 1..train.steps) and profile_hosts; raises ValueError naming
  the field and the fix."""
  steps, hosts = tuple(cfg_train.profile_steps), tuple(cfg_train.profile_hosts)
  ints = lambda xs: all(isinstance(x, int) and not isinstance(x, bool) for x in xs)
  if steps and not (len(steps) == 2 and ints(steps) and 1 <= steps[0] <= steps[1]):
    raise ValueError(f'train.profile_steps={steps!r} must be () (off) or (START, STOP) with '
                     '1 <= START <= STOP, the steps traced (inclusive); e.g. '
                     "--config.train.profile_steps='(5, 7)'.")
  if steps and steps[1] > cfg_train.steps:
    raise ValueError(f'train.profile_steps={steps!r} reaches past the last step, '
                     f'train.steps={cfg_train.steps}: steps past it are never traced. Choose '
                     f'steps within 1..{cfg_train.steps} with --config.train.profile_steps, '
                     'or raise --config.train.steps.')
  if not (hosts and ints(hosts) and min(hosts) >= 0):
    raise ValueError(f'train.profile_hosts={hosts!r} must be a non-empty tuple of process '
                     "indices; e.g. --config.train.profile_hosts='(0,)'.")


class StepProfiler:
  """Starts and stops jax.profiler around the steps of train.profile_steps; the loop calls
  before_step / after_step around each step and close() at the end."""

  def __init__(self, cfg_train: ml_collections.ConfigDict, workdir: str):
    steps = tuple(cfg_train.profile_steps)
    chosen = jax.process_index() in set(cfg_train.profile_hosts)
    self.window = steps if steps and chosen else None
    self.workdir, self.local = workdir, None

  def before_step(self, step: int) -> None:
    """`step`: the number the step about to run is logged as."""
    if self.window and self.local is None and self.window[0] <= step <= self.window[1]:
      try:
        self.local = tempfile.mkdtemp(prefix='olmo3-profile-')
        jax.profiler.start_trace(self.local)
      except Exception as e:  # pylint: disable=broad-except  # profiling never stops training
        logging.warning('The profiler did not start (%s); steps %s are not traced.', e,
                        self.window)
        self._done()
        return
      logging.info('Profiling steps %d..%d.', step, self.window[1])

  def after_step(self, step: int, state: Any) -> None:
    """Stops the trace once step STOP's results (`state`) are computed."""
    if self.local is not None and self.window and step >= self.window[1]:
      jax.block_until_ready(state)
      self.close()

  def close(self) -> None:
    """Stops a running trace and copies its files to the workdir (a loop ending early too)."""
    if self.local is None or not self.window:
      return
    try:
      jax.profiler.stop_trace()
      dest = storage.join(self.workdir, FOLDER, 'plugins', 'profile',
                          f'steps_{self.window[0]}-{self.window[1]}')
      storage.makedirs(dest)
      for root, _, names in os.walk(self.local):
        for name in names:
          with open(os.path.join(root, name), 'rb') as f:
            storage.write_atomic(storage.join(dest, f'process{jax.process_index()}.{name}'),
                                 f.read(), fsync=False)
      print(f'Profile of steps {self.window[0]}..{self.window[1]}: {dest} (tensorboard '
            f'--logdir {storage.join(self.workdir, FOLDER)}, or open the .trace.json.gz in '
            'ui.perfetto.dev)', flush=True)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('The profile of steps %s was not saved: %s', self.window, e)
    self._done()

  def _done(self) -> None:
    if self.local:
      shutil.rmtree(self.local, ignore_errors=True)
    self.local, self.window = None, None
