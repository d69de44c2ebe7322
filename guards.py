"""What stops a bad run before it costs anything, apart from the training itself.

- Resuming: every config field changed since the checkpoint is logged, and a
  change that makes it another run (shapes, data, seeds) is refused.
- The divergence guard: judges each step (loss bound, skipped steps in a
  row) and whether the state is healthy enough for retention to protect.
- The command line: a misspelled --config.* field or a missing config file
  becomes one line naming the fix, for train.py and plan.py.
train.py acts on their verdicts (exit codes, checkpoints, messages).
"""

import contextlib
import difflib
import importlib.util
import json
import os
import sys
from typing import Any

from absl import app, flags, logging
import ml_collections

import model

# --- Resuming: the config must still describe the same run ------------------------------------


class RunError(ValueError):
  """A run refused before it trains (a changed config, steps behind the checkpoint).

  main() prints it as one line and exits 1; nothing on disk was changed.
  """


# Changing one of these on resume starts a different run, not a continuation
# of the checkpoint's: the weights' shapes and the function they compute,
# which tokens each step reads, and the init. Everything else (LR, logging,
# mesh, ...) may change and is only logged.
RUN_DEFINING_FIELDS = (*(f'model.{f}' for f in model.ARCHITECTURE_FIELDS),
                       'model.sliding_window_plus_one', 'model.yarn', 'data.paths',
                       'data.mix_file', 'data.base_dir', 'data.seq_len',
                       'data.global_batch_size', 'data.seed', 'train.seed')
ABSENT = '(absent)'  # a field one side's code did not have


def _flat(tree: dict[str, Any], prefix: str = '') -> dict[str, Any]:
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f'{prefix}{key}.'))
    else:
      out[prefix + key] = value
  return out


def config_changes(saved: dict[str, Any], cfg: ml_collections.ConfigDict
                   ) -> dict[str, tuple[Any, Any]]:
  """{dotted field: (saved value, current value)} for every field that differs.

  The current config goes through JSON first, as the saved one did (tuples
  become lists), so only real differences show.
  """
  old, new = _flat(saved), _flat(json.loads(json.dumps(cfg.to_dict())))
  pairs = {k: (old.get(k, ABSENT), new.get(k, ABSENT)) for k in sorted(old.keys() | new.keys())}
  return {k: (a, b) for k, (a, b) in pairs.items() if a != b}


def check_resume(cfg: ml_collections.ConfigDict, meta: dict[str, Any]) -> None:
  """Logs every config field changed since the checkpoint; refuses a different run.

  Refused unless train.allow_config_change: a change to RUN_DEFINING_FIELDS.
  Always refused: train.steps below the checkpoint's step, which the run has
  passed (and equal is a finished run: train() says so and exits 0).
  """
  step = meta['step']
  changes = config_changes(meta['config'], cfg) if 'config' in meta else {}
  for field, (old, new) in changes.items():
    logging.warning('Config changed since checkpoint step %d: %s: %r -> %r.', step, field, old,
                    new)
  defining = [f for f in changes if any(f == d or f.startswith(d + '.')
                                        for d in RUN_DEFINING_FIELDS)]
  if defining and not cfg.train.allow_config_change:
    listed = '; '.join(f'{f}: {changes[f][0]!r} -> {changes[f][1]!r}' for f in defining)
    raise RunError(
        f'The checkpoint at step {step} was trained with other settings that define the run '
        f'(the weights\' shapes, the data order or the init): {listed}. Resuming would not '
        'continue that run. Rerun with the checkpoint\'s values, use another --workdir for a '
        'new run, or pass --config.train.allow_config_change=True to resume anyway (to read '
        'the same files from a new place, set --config.data.path_remap instead).')
  if cfg.train.steps < step:
    raise RunError(f'train.steps={cfg.train.steps} is below the checkpoint\'s step {step}: the '
                   f'run is past it. Set --config.train.steps above {step} to train on, or use '
                   'another --workdir for a new run.')


class DivergenceGuard:
  """Judges each step: has the run diverged, and is its state healthy?

  It trips at the first step whose CE loss exceeds train.max_loss, or at the
  train.max_consecutive_skips-th skipped step in a row. The skip rule alone
  cannot stop a divergence: it skips only non-finite values and > 6 sigma
  spikes, so a large finite LR keeps applying destructive updates whose
  losses soon fill the spike history; the loss bound catches those, and the
  skip count catches a run that only produces NaNs.

  Healthy, the flag each checkpoint is saved with, means: the guard has not
  tripped at or before the saved step, and that step was not skipped. A skip
  means the step's loss or gradient was non-finite or a spike, evidence
  against the params it measured, so its state must not become the one that
  retention protects over older ones. The loss of step s measures the params
  before step s's update: a destructive update shows one step later, so the
  newest healthy checkpoint can hold that one update.
  """

  def __init__(self, cfg_train: ml_collections.ConfigDict):
    self.max_loss, self.max_skips = cfg_train.max_loss, cfg_train.max_consecutive_skips
    self.skips = 0  # skipped steps in a row up to the last observed one
    self.reason: str | None = None  # why it tripped; None while it has not

  def observe(self, step: int, record: dict[str, float]) -> None:
    if self.reason:
      return
    self.skips = self.skips + 1 if record['optim/step skipped'] else 0
    loss = record['train/CE loss']
    if loss > self.max_loss:  # False for NaN: a NaN step is skipped and counted instead
      self.reason = (f'the CE loss of step {step} is {loss:.4g}, above '
                     f'train.max_loss={self.max_loss:g}')
    elif self.skips >= self.max_skips:
      self.reason = (f'steps {step - self.skips + 1}-{step} were all skipped (non-finite or '
                     f'spiking loss or gradient norm; train.max_consecutive_skips='
                     f'{self.max_skips})')

  @property
  def healthy(self) -> bool:
    return self.reason is None and self.skips == 0


# --- The command line -------------------------------------------------------------------

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs')


@contextlib.contextmanager
def config_mistakes_in_one_line(argv: list[str], default_config: str | None):
  """Exits with one line naming the fix where ml_collections raises for a bad --config.

  It raises an unknown --config.* field as three chained tracebacks, and a
  missing --config file only once the config is first read (as
  'config_config'); both come from parsing argv, which is only read here.
  """
  try:
    yield
  except (AttributeError, KeyError, OSError):
    mistake = config_mistake(*_config_args(argv, default_config))
    if mistake:
      sys.exit(f'error: {mistake}')
    raise


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flag parser for train.py and plan.py: config mistakes in one line."""
  default = getattr(flags.FLAGS['config'], 'default_unparsed', None)  # set when argv has no --config
  with config_mistakes_in_one_line(argv, default):
    rest = app.parse_flags_with_usage(argv)
    flags.FLAGS.config.keys()  # a config file that failed to load raises on this first read
  return rest


def _config_args(argv: list[str], default_config: str | None) -> tuple[str | None, list[str]]:
  """The --config file and the --config.* override paths, as argv spells them."""
  path, overrides = default_config, []
  for arg, following in zip(argv[1:], [*argv[2:], None]):
    name, equals, value = arg.lstrip('-').partition('=')
    if name == 'config':
      path = value if equals else following
    elif name.startswith(('config.', 'noconfig.')):
      overrides.append(name.split('.', 1)[1])
  return path, overrides


def config_mistake(path: str | None, overrides: list[str]) -> str | None:
  """What is wrong with --config=`path` or one of its overrides, and the fix; None if neither."""
  if not path:
    return None
  if not os.path.isfile(path.split(':', 1)[0]):
    return _missing_config(path)
  cfg = _load_config(path)
  if not isinstance(cfg, ml_collections.ConfigDict):
    return None
  for override in overrides:
    problem = _unknown_field(cfg, override)
    if problem:
      return f'--config.{override}: {problem}'
  return None


def _load_config(path: str) -> Any:
  """get_config() of a config file, as --config=FILE[:ARG] runs it."""
  file, _, arg = path.partition(':')
  spec = importlib.util.spec_from_file_location('config_being_checked', file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(*[arg] if arg else [])


def _missing_config(path: str) -> str:
  names = sorted(n for n in os.listdir(CONFIG_DIR) if n.endswith('.py') and n != '__init__.py')
  here = os.path.relpath(CONFIG_DIR)
  close = difflib.get_close_matches(os.path.basename(path.split(':', 1)[0]), names, n=1)
  hint = (f'did you mean --config={os.path.join(here, close[0])}?' if close else
          'the configs are ' + ', '.join(os.path.join(here, n) for n in names))
  return f'--config={path}: no such file (relative paths start at {os.getcwd()}); {hint}'


def _unknown_field(cfg: ml_collections.ConfigDict, override: str) -> str | None:
  """Why `override` (e.g. 'train.stpes') names no field of `cfg`, with the closest one."""
  node, seen = cfg, []
  for key in override.split('.'):
    if not isinstance(node, ml_collections.ConfigDict):
      return f'{".".join(seen)} is a value of type {type(node).__name__}, not a group of fields'
    if key not in node:
      close = difflib.get_close_matches(key, list(node.keys()), n=1)
      hint = (f'did you mean --config.{".".join([*seen, close[0]])}?' if close else
              f'its fields are {", ".join(sorted(node.keys()))}')
      return f'{".".join(seen) or "the config"} has no field {key!r}; {hint}'
    node, seen = node[key], [*seen, key]
  return None
