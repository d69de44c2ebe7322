"""Is this config one that can run, is it still the same run, and was it typed right?

- `complete`: fills in what the config leaves to the data (the tokenizer's
  vocab size and ids, its file, the held-out set, the padded model vocab)
  from the mix's own description, says in one line what it filled in and
  from where, and refuses a stated value that contradicts it (a tokenizer
  file with another vocabulary too) and a held-out file that is also a
  training file. Entry points run it first, then `validate`.
- `validate`: every field's rule (model, optimizer, train loop, data
  settings), checked once, by the entry point, before anything is built or
  written. A broken rule is an errors.ConfigError naming the field and the fix.
- Resuming: every config field changed since the checkpoint is logged (a path
  spelled differently but naming the same file is no change), and a change
  that makes it another run (shapes, data, seeds) is refused.
- The command line: a misspelled --config.* field or a missing config file
  becomes one line naming the fix, for train.py, plan.py and the scripts.
"""

import contextlib
import difflib
import filecmp
import importlib.util
import json
import os
from typing import Any

from absl import app, flags, logging
import ml_collections

import errors
import kernels
import model
from monitor import profiler
from monitor import tracking
import optim
import sharding
from store import storage
from tokens import run_tokenizer
from tokens import token_files

# --- What the data says about itself ---------------------------------------------------

TOKENIZER_FIELDS = ('vocab_size', 'eos_token_id', 'pad_token_id', 'bos_token_id')
VOCAB_MULTIPLE = 128  # OLMo-core pads the embedding to a multiple of 128 (dolma2: 100,352)


def complete(cfg: ml_collections.ConfigDict, announce: bool = True
             ) -> ml_collections.ConfigDict:
  """Fills cfg.data's tokenizer settings, tokenizer file and held-out set in from its mix file.

  A mix written by scripts/prepare_data.py says which tokenizer made it (its
  `# tokenizer` line) and which files it held out (`# validation`); Ai2's
  mixes say neither, and their configs state the values. For each of
  data.vocab_size, eos_token_id, pad_token_id and bos_token_id: an unset
  (None) field takes the mix's value; a set one must equal it. Then an unset
  data.tokenizer takes the mix's tokenizer file (a stated one must be that
  tokenizer: the same file, a copy, or the same vocabulary), empty
  data.validation_paths the mix's held-out files (no held-out file may be a
  training file), and an unset model.vocab_size data.vocab_size padded to a
  multiple of 128. With `announce`, what it filled in and from where is one
  line on stdout and in the log. Idempotent (a second call fills nothing in
  and says nothing); returns `cfg`, changed in place. Raises
  errors.ConfigError (a contradiction, or a value nothing states) or
  errors.DataError (a mix that cannot be read).
  """
  d = cfg.data
  if tuple(d.paths) in (('',), ()):  # `--config.data.paths=` on the command line clears it
    d.paths = ()
  canonical_locations(cfg)
  header = {'tokenizer': None, 'validation': []}
  if d.mix_file:
    try:
      header = token_files.read_mix_header(d.mix_file, base_dir=d.base_dir)
    except FileNotFoundError as e:
      raise errors.DataError(f'data.mix_file={d.mix_file!r} does not exist; set '
                             '--config.data.mix_file to a mix file (label,path lines).') from e
    except ValueError as e:
      raise errors.DataError(str(e)) from e
  described = header['tokenizer'] or {}
  where = (f'the mix file {d.mix_file} (tokenizer {described.get("name")!r})' if described else
           f'the mix file {d.mix_file}' if d.mix_file else 'data.paths')
  filled = []  # 'field=value' for each field filled in here
  for field in TOKENIZER_FIELDS:
    stated, theirs = d[field], described.get(field)
    if field in described and stated is None:
      d[field] = theirs
      if theirs is not None:
        filled.append(f'data.{field}={theirs}')
    elif field in described and stated != theirs:
      raise errors.ConfigError(
          f'data.{field}={stated} contradicts {where}, whose tokens were made with '
          f'{field}={theirs}. Drop the override (the mix fills it in), or use a mix tokenized '
          f'with {field}={stated}.')
    elif stated is None and field != 'bos_token_id':
      raise errors.ConfigError(
          f'data.{field} is unset and {where} does not say which tokenizer made the data. Set '
          f'--config.data.{field}, or tokenize the data with scripts/prepare_data.py, whose mix '
          'file records it.')
  if not d.tokenizer and described.get('file'):
    d.tokenizer = described['file']
    filled.append(f'data.tokenizer={d.tokenizer}')
  elif d.tokenizer and described:
    why = tokenizer_mismatch(d.tokenizer, described)
    if why:
      raise errors.ConfigError(
          f'data.tokenizer={d.tokenizer} contradicts {where}: {why}. Drop the override (the '
          f'mix fills in {described.get("file") or "its tokenizer"}), or use a mix tokenized '
          f'with {d.tokenizer} (scripts/prepare_data.py --tokenizer={d.tokenizer}).')
  if not d.validation_paths and header['validation']:
    d.validation_paths = tuple(path for path, _ in header['validation'])
    shown = ', '.join(os.path.basename(p) for p in d.validation_paths[:3])
    more = f', ... ({len(d.validation_paths)} files)' if len(d.validation_paths) > 3 else ''
    filled.append(f'data.validation_paths=({shown}{more}, in '
                  f'{os.path.dirname(d.validation_paths[0])})')
  check_held_out(d)
  padded = ''
  if cfg.model.vocab_size is None:
    cfg.model.vocab_size = -(-d.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    padded = (f'model.vocab_size={cfg.model.vocab_size} (data.vocab_size padded to a multiple '
              f'of {VOCAB_MULTIPLE})')
  if announce and (filled or padded):
    message = f'Filled in from {where}: {", ".join(filled)}' if filled else ''
    if padded:
      message = (message + '; ' if message else 'Filled in: ') + padded
    print(f'{message}.', flush=True)  # once: absl's INFO lines reach the same terminal
    logging.debug('%s.', message)
  return cfg


# Config fields that name a file or folder, and how the run uses each (storage.canonical's
# keywords): read through the seam once, in `complete`, so every later use, every cache
# key and every resume comparison sees one spelling. docs/storage.md lists them.
LOCATION_FIELDS = {
    'data.mix_file': {'writes': False}, 'data.base_dir': {'writes': False},
    'data.paths': {'writes': False}, 'data.validation_paths': {'writes': False},
    'data.tokenizer': {'writes': False}, 'train.init_from': {'writes': False},
    # Memory-mapped caches: local files on every host.
    'data.cache_dir': {'local_only': True}, 'data.remote_cache_dir': {'local_only': True},
}


def check_attention(cfg_model: ml_collections.ConfigDict, *, segments: bool) -> None:
  """An explicit model.attention_impl this process's backend cannot run is refused before
  anything compiles (kernels.explicit_unsupported); 'auto' picks what can."""
  if reason := kernels.explicit_unsupported(cfg_model, segments=segments):
    raise errors.ConfigError(
        f'model.attention_impl={cfg_model.attention_impl!r} cannot run this model here: '
        f'{reason}. Set --config.model.attention_impl=auto (picks what can).')


def check_sources(cfg: ml_collections.ConfigDict) -> None:
  """What the run reads before step 1 is there now, not after hours of training: the
  tokenizer file it names (its sample, in-loop evaluation and export) and train.init_from."""
  if cfg.data.tokenizer:
    run_tokenizer.find(cfg.data)
  init_from = cfg.train.init_from
  if init_from and not storage.exists(init_from) and not storage.isdir(init_from):
    raise errors.ConfigError(f'train.init_from={init_from!r} does not exist; point '
                             '--config.train.init_from at a checkpoint or HF directory.')


def canonical_locations(cfg: ml_collections.ConfigDict) -> None:
  """Rewrites every LOCATION_FIELDS value (and data.validation_sets' files) in its
  canonical form (storage.canonical); a malformed one is a ConfigError naming the field."""
  def one(field: str, value: str, **how: bool) -> str:
    return storage.canonical(value, f'--config.{field}', **how) if value else value
  for field, how in LOCATION_FIELDS.items():
    section, name = field.split('.')
    if name not in cfg[section]:
      continue
    value = cfg[section][name]
    if isinstance(value, (tuple, list)):
      cfg[section][name] = tuple(one(field, v, **how) for v in value)
    elif isinstance(value, str):
      cfg[section][name] = one(field, value, **how)
  sets = cfg.data.get('validation_sets') or {}
  for name, paths in list(sets.items()):
    if isinstance(paths, (tuple, list)) and all(isinstance(p, str) for p in paths):
      sets[name] = tuple(one(f'data.validation_sets[{name!r}]', p, writes=False) for p in paths)


def _vocabulary(path: str, what: str = 'data.tokenizer') -> dict[str, int]:
  """{token: id} of a HuggingFace tokenizer.json, added tokens included."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel  # only for a check
  try:
    return Tokenizer.from_file(path).get_vocab(with_added_tokens=True)
  except Exception as e:  # tokenizers raises a bare Exception for a malformed file
    fix = ('point --config.data.tokenizer at one, or drop it (a mix written by '
           'scripts/prepare_data.py fills it in)' if what == 'data.tokenizer' else
           'restore it, or rewrite the mix with scripts/prepare_data.py')
    raise errors.ConfigError(f'{what}={path} is not a HuggingFace tokenizer.json ({e}); '
                             f'{fix}.') from e


def tokenizer_mismatch(stated: str, described: dict[str, Any]) -> str | None:
  """Why the tokenizer file `stated` is not the one a mix's `# tokenizer` line describes.

  None when it is: the same file (after resolving the paths), a byte-identical
  copy, or a file with the same vocabulary (token -> id, added tokens
  included). Where the mix's own file is not on this machine, its recorded ids
  must at least name tokens of `stated` and fit its vocab_size. A `stated` file that
  cannot be read is refused (run_tokenizer.TokenizerError): the run names it.
  """
  theirs = described.get('file') or ''
  if storage.identity(stated) == storage.identity(theirs or stated + '\0'):
    return None
  # A local view of it (a bucket's object too); one that cannot be read is refused.
  stated = run_tokenizer.find(None, stated, what='data.tokenizer')
  try:
    theirs = theirs and run_tokenizer.find(None, theirs, what="the mix's tokenizer file")
  except errors.UserError:  # not on this machine: its recorded ids are checked below
    theirs = ''
  if theirs:
    if filecmp.cmp(stated, theirs, shallow=False):
      return None
    ours, mix = _vocabulary(stated), _vocabulary(theirs, "the mix's tokenizer file")
    if ours == mix:
      return None
    return (f'the mix\'s tokens were made with {theirs} ({len(mix):,} tokens), and '
            f'{stated} has another vocabulary ({len(ours):,} tokens)')
  vocab = _vocabulary(stated)
  ids = set(vocab.values())
  size = described.get('vocab_size')
  missing = [f'{f}={described[f]}' for f in ('eos_token_id', 'pad_token_id')
             if described.get(f) is not None and described[f] not in ids]
  if missing or (size is not None and len(vocab) > size):
    return (f'the mix\'s tokens were made with {described.get("name")!r} (vocab_size={size}'
            f'{", " + ", ".join(missing) if missing else ""}), and {stated} has '
            f'{len(vocab):,} tokens{" without " + " or ".join(missing) if missing else ""}')
  return None


def check_held_out(cfg_data: ml_collections.ConfigDict) -> None:
  """Refuses data.validation_paths naming a training file: its loss is not held out.

  Files are compared after resolving their paths (as the datasets resolve them:
  base_dir, path_remap), URLs as spelled. Raises errors.ConfigError.
  """
  if not cfg_data.validation_paths or bool(cfg_data.mix_file) == bool(cfg_data.paths):
    return  # no training files to compare with, or both kinds: the dataset refuses that
  training, _, _, source = token_files.config_sources(cfg_data)
  held, *_ = token_files.config_sources(cfg_data, paths=list(cfg_data.validation_paths))
  trained = {storage.identity(p) for p in training}
  both = [p for p in held if storage.identity(p) in trained]
  if both:
    more = f' (and {len(both) - 1} more)' if len(both) > 1 else ''
    raise errors.ConfigError(
        f'data.validation_paths holds {both[0]}{more}, which is also a training file of '
        f'{source}: its "validation loss" would be measured on data the model trains on. Set '
        '--config.data.validation_paths to held-out files only (for a scripts/prepare_data.py '
        'mix, drop the override: its own held-out files are filled in).')


# --- Validation -------------------------------------------------------------------------


def check_layer_pattern(cfg_model: ml_collections.ConfigDict) -> None:
  """num_layers must be whole periods of layer_pattern; the error names both flags, since
  a shallow model (2 layers of configs/small.py's 'SSSF') is fixed by either."""
  pattern, layers = cfg_model.layer_pattern, cfg_model.num_layers
  if pattern and not set(pattern) - {'S', 'F'} and layers >= 1 and layers % len(pattern):
    period = max(k for k in range(1, len(pattern) + 1) if layers % k == 0)
    raise errors.ConfigError(
        f'model.num_layers={layers} is not a multiple of {len(pattern)}, the period of '
        f'model.layer_pattern={pattern!r}: set --config.model.layer_pattern to a pattern '
        f'whose length divides {layers} (e.g. --config.model.layer_pattern={pattern[-period:]}, its last '
        f'{period}) or --config.model.num_layers to a multiple of {len(pattern)}.')


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Refuses a config that cannot run, naming the field and the fix; touches nothing.

  Raises errors.ConfigError. The model's and optimizer's own rules live beside
  what they describe (model.validate, optim.check_config); this runs them all.
  """
  check_layer_pattern(cfg.model)
  try:
    model.validate(cfg.model)
    optim.check_config(cfg.opt)
    kernels.context_parallel.check_seq_len(cfg.data.seq_len, cfg.train.mesh_context)
    profiler.check_config(cfg.train)  # train.profile_steps, profile_hosts
    tracking.check_config(cfg.train)  # train.wandb
  except ValueError as e:
    raise errors.ConfigError(str(e)) from e
  check_validation_sets(cfg.data)
  if cfg.data.vocab_size > cfg.model.vocab_size:
    raise errors.ConfigError(
        f'data.vocab_size={cfg.data.vocab_size} exceeds model.vocab_size='
        f'{cfg.model.vocab_size}: token ids would index past the embedding. Set '
        '--config.model.vocab_size to at least data.vocab_size (padded to a multiple of 128).')
  t = cfg.train
  rules = (  # field, holds, what it must be
      ('steps', t.steps >= 1, 'an integer >= 1'),
      ('log_every', t.log_every >= 1, 'an integer >= 1'),
      ('ckpt_every', t.ckpt_every >= 1, 'an integer >= 1'),
      ('keep_last', t.keep_last >= 1, 'an integer >= 1 (the newest checkpoints kept)'),
      ('keep_every', t.keep_every >= 0, 'an integer >= 0 (0: keep none permanently)'),
      ('eval_every', t.eval_every >= 0, 'an integer >= 0 (0: never)'),
      ('micro_batch_size', t.micro_batch_size >= 1, 'an integer >= 1'),
      ('max_loss', t.max_loss > 0, 'a number > 0, or inf to turn the loss bound off'),
      ('max_consecutive_skips', t.max_consecutive_skips >= 1, 'an integer >= 1'),
      ('memorization_threshold', t.memorization_threshold > 0, 'a number of nats > 0'),
      ('memorization_evals', t.memorization_evals >= 2, 'an integer >= 2'),
      ('rollback_attempts', t.rollback_attempts >= 0, 'an integer >= 0 (0: stop at a trip)'),
      ('rollback_margin', t.rollback_margin >= 0, 'an integer >= 0 (batches after the trip)'),
      ('keep_rolledback', t.keep_rolledback >= 0,
       'an integer >= 0 (rollback attempts whose set-aside states are kept)'),
      ('rollback_lr_factor', 0 < t.rollback_lr_factor <= 1,
       'a number in (0, 1] (1: the schedule\'s LR)'),
      ('rollback_lr_steps', t.rollback_lr_steps >= 0, 'an integer >= 0'),
      ('skip_batches', all(_skip_window_ok(w) for w in t.skip_batches),
       'a tuple of (start, stop) or (start, stop, lr_factor, lr_steps) with 0 <= start < stop, '
       '0 < lr_factor <= 1 and lr_steps >= 0, e.g. ((8, 12),)'),
  )
  for field, holds, rule in rules:
    if not holds:
      raise errors.ConfigError(f'cfg.train.{field}={t[field]!r} must be {rule}; set '
                               f'--config.train.{field} to such a value.')
  check_mesh_layout(t)
  from evaluation import olmo_eval_requests  # pylint: disable=import-outside-toplevel
  olmo_eval_requests.check_config(cfg)  # train.eval_tasks and the downstream_eval_* fields


def check_mesh_layout(cfg_train: ml_collections.ConfigDict) -> None:
  """train.mesh_layout is a known layout; under 'hsdp' the replicas follow the devices."""
  layout = cfg_train.get('mesh_layout', 'fsdp')
  sharding.layout_for(cfg_train, 'cpu')  # refuses an unknown name
  if layout == 'hsdp':
    sharding.check_hsdp_fields(cfg_train)


def check_validation_sets(cfg_data: ml_collections.ConfigDict) -> None:
  """data.validation_sets: {name: (token files, ...)}, each name a metric path segment
  (eval/lm/<name>/CE loss). Raises errors.ConfigError."""
  for name, paths in cfg_data.validation_sets.items():
    paths = tuple(paths) if isinstance(paths, (tuple, list)) else paths
    why = ('its name is empty' if not name else
           'its name holds a "/" (it becomes eval/lm/<name>/CE loss)' if '/' in name else
           "'validation' names data.validation_paths" if name == 'validation' else
           'it names no token files' if not isinstance(paths, tuple) or not paths else
           'its paths must be non-empty strings'
           if not all(isinstance(p, str) and p for p in paths) else None)
    if why:
      raise errors.ConfigError(
          f'data.validation_sets[{name!r}]={paths!r}: {why}; give each set a name without "/" '
          "and a tuple of token files, e.g. --config.data.validation_sets=\"{'c4_en-validation':"
          " ('/data/c4_en_val.npy',)}\".")


def _skip_window_ok(window: Any) -> bool:
  """A train.skip_batches entry: (start, stop[, lr_factor, lr_steps]), integers but the factor."""
  if not isinstance(window, (tuple, list)) or len(window) not in (2, 4):
    return False
  start, stop, factor, steps = (*window, 1.0, 0) if len(window) == 2 else window
  ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (start, stop, steps))
  return (ints and isinstance(factor, (int, float)) and 0 <= start < stop and 0 < factor <= 1
          and steps >= 0)


# --- Resuming: the config must still describe the same run ------------------------------


# Changing one of these on resume starts a different run, not a continuation
# of the checkpoint's: the weights' shapes and the function they compute,
# which tokens each step reads, and the init. Everything else (LR, logging,
# mesh, ...) may change and is only logged.
RUN_DEFINING_FIELDS = (*(f'model.{f}' for f in model.ARCHITECTURE_FIELDS),
                       'model.sliding_window_plus_one', 'model.yarn', 'data.paths',
                       'data.mix_file', 'data.base_dir', 'data.seq_len',
                       'data.global_batch_size', 'data.seed', 'train.seed')
ABSENT = '(absent)'  # a field one side's code did not have
# Fields holding file paths: `runs/x/corpus.txt` and `$PWD/runs/x/corpus.txt` are one file.
PATH_FIELDS = ('data.mix_file', 'data.base_dir', 'data.paths', 'data.validation_paths',
               'data.tokenizer', 'data.cache_dir', 'train.init_from')


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
  return {k: (a, b) for k, (a, b) in pairs.items()
          if a != b and not (k in PATH_FIELDS and _same_paths(a, b))}


def _same_paths(a: Any, b: Any) -> bool:
  """Whether two spellings of a path (or of a list of paths) name the same files, resolved
  against this working directory ('' names no file: it equals only '')."""
  if isinstance(a, str) and isinstance(b, str):
    return bool(a) and bool(b) and storage.identity(a) == storage.identity(b)
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return all(x == y or _same_paths(x, y) for x, y in zip(a, b))
  return False


def check_same_run(cfg: ml_collections.ConfigDict, meta: dict[str, Any]) -> None:
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
    raise errors.ConfigError(
        f'The checkpoint at step {step} was trained with other settings that define the run '
        f'(the weights\' shapes, the data order or the init): {listed}. Resuming would not '
        'continue that run. Rerun with the checkpoint\'s values, use another --workdir for a '
        'new run, or pass --config.train.allow_config_change=True to resume anyway (to read '
        'the same files from a new place, set --config.data.path_remap instead).')
  if cfg.train.steps < step:
    raise errors.ConfigError(
        f'train.steps={cfg.train.steps} is below the checkpoint\'s step {step}: the run is '
        f'past it. Set --config.train.steps above {step} to train on, or use another --workdir '
        'for a new run.')


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
      errors.report(mistake, errors.EXIT_USAGE)
    raise


def parse_flags(argv: list[str]) -> list[str]:
  """app.run's flag parser for train.py and plan.py: config mistakes in one line."""
  # default_unparsed is set when argv has no --config.
  default = getattr(flags.FLAGS['config'], 'default_unparsed', None)
  with config_mistakes_in_one_line(argv, default):
    rest = app.parse_flags_with_usage(argv)
    flags.FLAGS.config.keys()  # a config file that failed to load raises on this first read
  return rest


def parser_requiring_config(example: str):
  """parse_flags for an entry point with no default config (plan.py, inspect_batch.py): a
  missing --config is one line (exit 2) naming `example`, not absl's two lines."""
  def parse(argv: list[str]) -> list[str]:
    named = {arg.lstrip('-').split('=', 1)[0] for arg in argv[1:]}
    if 'config' not in named and not named & {'help', 'helpshort', 'helpfull', 'h', '?'}:
      errors.report(f'--config is required: {example}.', errors.EXIT_USAGE)
    return parse_flags(argv)
  return parse


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
