"""What train.py tells its user at start-up and when a save fails, through its command line.

- A model whose num_layers is not whole periods of its layer pattern is refused in one
  line naming both flags that fix it.
- A run that starts from train.init_from logs, once, where its weights came from.
- A failed checkpoint save whose clean-up failed too says so (not "was removed"), and the
  next start removes the leftover.
"""

import os
import subprocess
import sys

import errors
from test_train import REPO, config_flags, token_files  # noqa: F401  (a fixture)


def train_py(workdir, token_files, *flags, prelude: str = '') -> subprocess.CompletedProcess:
  """train.py's own command line (train.run()), after `prelude` (hooks a test plants)."""
  script = f'import sys\nsys.path.insert(0, {str(REPO)!r})\n{prelude}\nimport train\ntrain.run()\n'
  return subprocess.run(
      [sys.executable, '-c', script, f'--workdir={workdir}', '--sample_tokens=0',
       *config_flags(token_files), *flags],
      cwd=REPO, capture_output=True, text=True, timeout=600)


def error_lines(run: subprocess.CompletedProcess) -> list[str]:
  assert 'Traceback' not in run.stderr, run.stderr[-3000:]
  return [line for line in run.stderr.splitlines() if line.startswith('error: ')]


def test_a_layer_count_off_the_pattern_names_the_pattern_flag(token_files, tmp_path):
  run = train_py(tmp_path / 'run', token_files, '--config.model.layer_pattern=SSSF')
  [line] = error_lines(run)
  assert run.returncode == errors.EXIT_USAGE
  assert 'model.num_layers=2' in line and "'SSSF'" in line and 'period' in line
  assert '--config.model.layer_pattern=SF' in line and '--config.model.num_layers' in line


# Step 1's save (and only it) fails writing its arrays, and removing its staging folder
# fails too.
FAILING_SAVE = '''
from store import chunk_store, storage
def write_local(*args, **kw):
  raise OSError(28, 'No space left on device')
chunk_store.write_local = write_local
def delete_tree(location, *args, **kw):
  raise PermissionError(13, 'Permission denied', location)
storage.delete_tree = delete_tree
'''


def test_init_from_is_logged_and_a_failed_clean_up_is_told(token_files, tmp_path):
  source = tmp_path / 'source'
  first = train_py(source, token_files, '--config.train.steps=2', '--config.train.eval_every=0')
  assert first.returncode == 0, first.stderr[-3000:]

  workdir = tmp_path / 'run'
  run = train_py(workdir, token_files, '--config.train.steps=1', '--config.train.eval_every=0',
                 f'--config.train.init_from={source}/checkpoints', prelude=FAILING_SAVE)
  said = [line for line in run.stderr.splitlines() if 'Step-0 weights from train.init_from=' in line]
  assert len(said) == 1 and f'{source}/checkpoints, its step 2; fresh optimizer' in said[0]

  [line] = error_lines(run)
  assert run.returncode == errors.EXIT_CRASH
  assert 'Checkpoint save of step 1' in line and 'No space left on device' in line
  assert 'removing its temporary directory failed too' in line and 'Permission denied' in line
  assert 'was removed' not in line
  [left] = [n for n in os.listdir(workdir / 'checkpoints') if n.startswith('tmp.step_1')]
  assert left in line

  again = train_py(workdir, token_files, '--config.train.steps=1',
                   '--config.train.eval_every=0', f'--config.train.init_from={source}/checkpoints')
  assert again.returncode == 0, again.stderr[-3000:]
  assert not [n for n in os.listdir(workdir / 'checkpoints') if n.startswith('tmp.')]
