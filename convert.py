"""Olmo 3 checkpoints between HF, OLMo-core and ours: the command line.

    python convert.py --from_hf=HF_DIR --to=CKPT_DIR [--overwrite]     # HF -> train.init_from
    python convert.py --from_ckpt=CKPT_DIR --to_hf=HF_DIR               # our checkpoint -> HF
    python convert.py --from_olmo_core=STEP_DIR_OR_URL --to=WORKDIR      # OLMo-core -> a run
        [--config=configs/olmo3_7b.py --config.data.mix_file=MIX ...]    # the run's config
    python convert.py --from_ckpt=CKPT_DIR --to_olmo_core=STEP_DIR       # ours -> OLMo-core

The formats live in formats/hf_ckpt.py (HF safetensors and config dialects) and
formats/olmo_core_ckpt.py (weights, AdamW moments, step, data position; needs torch:
pip install '.[olmo-core]'); this file only parses flags.

Where --to puts the checkpoint:
  --from_hf: HF weights are a start, not a run: --to is a checkpoint directory
    holding step_0 (params only), for `train.init_from=CKPT_DIR`.
  --from_olmo_core: an OLMo-core step is a run to continue: --to is a train.py
    workdir W and the checkpoint goes to W/checkpoints/step_N, where
    `train.py --workdir=W` resumes it (and stage 2's `train.init_from=W/checkpoints`
    starts from it). A --to named `checkpoints` is taken as a workdir's
    checkpoint directory itself. A --to of another name that already holds
    step_N directories is a checkpoint directory, not a workdir: refused.

With --config the converted checkpoint stores that config (checked against the
step's config.json: architecture, batch, sequence length, data seed, YaRN;
other differences are logged, naming where config.json set the run's value),
so train.py with the same --config resumes it. Without --config it stores
config.json translated, which train.py loads from the checkpoint:

    python train.py --workdir=W --config=configs/from_checkpoint.py:W [--config.X=Y ...]

The checkpoint is built beside its directory and moved in whole; one that is
already there is replaced only with --overwrite, by an atomic exchange of the
two directories, so a crash leaves the old checkpoint or the new, never a mix.
"""

import re
import sys

from absl import app, flags
from ml_collections import config_flags

import checkpoint
import config_checks
import errors
from formats import ckpt_files
from formats import hf_ckpt
from formats import olmo_core_ckpt
from kernels import xla
from store import download
from store import storage

WORKDIR_CHECKPOINTS = 'checkpoints'  # train.py's <workdir>/checkpoints


def run_checkpoint_dir(to: str) -> str:
  """Where --from_olmo_core writes for --to=`to`: the workdir's checkpoint directory."""
  to = storage.canonical(to, '--to')
  if storage.basename(to) == WORKDIR_CHECKPOINTS:
    return to
  steps = checkpoint.committed_steps(to) if storage.isdir(to) else []
  if steps:
    raise FileExistsError(
        f'--to={to} holds checkpoints itself (steps {steps}), but --from_olmo_core writes a '
        f'train.py workdir (into {storage.join(to, WORKDIR_CHECKPOINTS)}, where train.py '
        f'--workdir={to} resumes); pass a new or existing workdir as --to, or '
        f'--to={storage.join(to, WORKDIR_CHECKPOINTS)} for that directory itself.')
  return storage.join(to, WORKDIR_CHECKPOINTS)


def _parse_flags(argv: list[str]) -> list[str]:
  """train.py's one-line config mistakes when --config is given; plain parsing without."""
  if any(a.lstrip('-').startswith(('config', 'noconfig.')) for a in argv[1:]):
    return config_checks.parse_flags(argv)
  return app.parse_flags_with_usage(argv)


def _from_olmo_core() -> None:
  to = run_checkpoint_dir(FLAGS.to)
  ckpt_files.check_destination(to, FLAGS.overwrite)  # before a download
  # As train.py reads it: tokenizer settings a mix file states about itself filled in.
  base = None if FLAGS.config is None else config_checks.complete(FLAGS.config)
  src = FLAGS.from_olmo_core
  if re.match(r'^(https?|gs|s3)://', src):
    src = olmo_core_ckpt.fetch(src, FLAGS.cache_dir, base=base)
  out = olmo_core_ckpt.import_step(src, to, base=base, overwrite=FLAGS.overwrite)
  moments = (f"Adam count {out['adam_count']}" if out['moments']
             else 'no optimizer state: moments start at zero')
  print(f"{FLAGS.from_olmo_core} -> {to}/step_{out['step']} ({moments})")
  workdir = storage.parent(to)
  config = (f'--config=configs/from_checkpoint.py:{workdir}' if FLAGS.config is None
            else '--config=<the same --config and overrides>')
  print(f'Continue it: python train.py --workdir={workdir} {config}')


def main(argv):
  xla.quiet_libtpu()  # libtpu without TPU chips: quiet, before a backend starts
  del argv
  modes = {'from_hf': {'from_hf', 'to'}, 'to_hf': {'from_ckpt', 'to_hf'},
           'from_olmo_core': {'from_olmo_core', 'to'},
           'to_olmo_core': {'from_ckpt', 'to_olmo_core'}}
  given = {f for f in set().union(*modes.values()) if getattr(FLAGS, f)}
  chosen = [mode for mode, pair in modes.items() if given == pair]
  if len(chosen) != 1:
    raise app.UsageError('Give --from_hf=DIR --to=CKPT_DIR, --from_ckpt=CKPT_DIR --to_hf=DIR, '
                         '--from_olmo_core=STEP_DIR_OR_URL --to=WORKDIR, or '
                         '--from_ckpt=CKPT_DIR --to_olmo_core=STEP_DIR.')
  mode = chosen[0]
  if FLAGS.config is not None and mode != 'from_olmo_core':
    raise app.UsageError('--config goes with --from_olmo_core (the run config the converted '
                         'checkpoint continues with).')
  try:
    # Every location flag in storage.canonical's one form, before any work. Our checkpoints:
    # a path or a gs:// or s3:// URL; --from_olmo_core also http(s)://; HF and OLMo-core
    # directories and the download cache: local paths (a URL: one line, the copy command).
    for flag, writes, local_only in (('from_ckpt', False, False), ('to', True, False),
                                     ('from_olmo_core', False, False),
                                     ('from_hf', False, True), ('to_hf', True, True),
                                     ('to_olmo_core', True, True), ('cache_dir', True, True)):
      if FLAGS[flag].value:
        FLAGS[flag].value = storage.canonical(FLAGS[flag].value, f'--{flag}', writes=writes,
                                              local_only=local_only)
    if mode == 'from_hf':
      ckpt_files.check_destination(FLAGS.to, FLAGS.overwrite)  # before minutes of reading
      params, cfg = hf_ckpt.load_hf(FLAGS.from_hf)
      hf_ckpt.save_checkpoint_params(params, cfg, FLAGS.to,
                                     hf_source=hf_ckpt.read_hf_source(FLAGS.from_hf),
                                     overwrite=FLAGS.overwrite)
      print(f'{FLAGS.from_hf} -> {FLAGS.to}/step_0 ({cfg.num_layers} layers, vocab '
            f'{cfg.vocab_size})')
    elif mode == 'to_hf':
      dtype = hf_ckpt.export_hf(FLAGS.from_ckpt, FLAGS.to_hf, step=FLAGS.step, dtype=FLAGS.dtype,
                                vocab_size=FLAGS.vocab_size, tokenizer=FLAGS.tokenizer)
      print(f'{FLAGS.from_ckpt} -> {FLAGS.to_hf} ({dtype})')
    elif mode == 'from_olmo_core':
      _from_olmo_core()
    else:
      step = olmo_core_ckpt.export_step(FLAGS.from_ckpt, FLAGS.to_olmo_core, step=FLAGS.step)
      print(f'{FLAGS.from_ckpt}/step_{step} -> {FLAGS.to_olmo_core} (OLMo-core load_path)')
  except (ckpt_files.ConversionError, download.DownloadError, errors.UserError,
          FileNotFoundError, FileExistsError, ImportError,
          checkpoint.CorruptCheckpointError) as e:
    print(f'convert.py: error: {" ".join(str(e).split())}', file=sys.stderr, flush=True)
    raise SystemExit(errors.EXIT_DATA if isinstance(e, errors.DataError)
                     else errors.EXIT_USAGE) from e
  except (storage.StorageError, checkpoint.CheckpointReadError) as e:  # a rerun may succeed
    print(f'convert.py: error: {" ".join(str(e).split())}', file=sys.stderr, flush=True)
    raise SystemExit(errors.EXIT_CRASH) from e


if __name__ == '__main__':
  flags.DEFINE_string('from_hf', None, 'reads an HF Olmo 3 directory (a local path)')
  flags.DEFINE_string('to', None, 'writes (a path, gs:// or s3://) with --from_hf: the '
                      'checkpoint directory (step_0, '
                      'params only; for train.init_from). With --from_olmo_core: the train.py '
                      'workdir to write (step_N into DIR/checkpoints/, or into DIR itself when '
                      'it is named checkpoints), which train.py --workdir=DIR resumes')
  flags.DEFINE_bool('overwrite', False, 'replace the checkpoint --to already holds (the whole '
                    'checkpoint directory, atomically)')
  flags.DEFINE_string('from_ckpt', None, 'reads our checkpoint directory (a path, gs:// or s3://)')
  flags.DEFINE_integer('step', None, 'checkpoint step (default: latest)')
  flags.DEFINE_string('to_hf', None, 'writes an HF directory (a local path)')
  flags.DEFINE_enum('dtype', None, sorted(hf_ckpt.DTYPES), 'HF weight dtype (default: the HF '
                    "source's when the checkpoint came from HF, else float32)")
  flags.DEFINE_integer('vocab_size', None, "HF vocab rows (default: the HF source's, else the "
                       'config data.vocab_size)')
  flags.DEFINE_string('from_olmo_core', None, 'reads an OLMo-core step directory (stepN/) or its '
                      'gs/s3/http(s) URL: weights, AdamW moments, step, data position, config')
  flags.DEFINE_string('to_olmo_core', None, 'writes an OLMo-core step directory (a local '
                      "path; for its trainer's load_path)")
  flags.DEFINE_string('cache_dir', None, 'local folder a --from_olmo_core URL is downloaded to '
                      '(default ~/.cache/olmo3_jax/olmo_core)')
  flags.DEFINE_string('tokenizer', None, "tokenizer.json to export (default: the HF source's "
                      "tokenizer files, else data/tokenizer.json when its vocabulary is the run's)")
  # --from_olmo_core only: the run config to store (with --config.* overrides, as train.py
  # takes them), checked against the step's config.json; default: config.json translated.
  with config_checks.config_mistakes_in_one_line(sys.argv, None):
    config_flags.DEFINE_config_file('config', None, 'with --from_olmo_core: the train.py '
                                    'config the checkpoint continues with (e.g. '
                                    'configs/olmo3_7b.py and --config.data.* overrides)')
  FLAGS = flags.FLAGS
  app.run(main, flags_parser=_parse_flags)
