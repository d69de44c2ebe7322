"""Shows what a run read at one step: instances, sources, documents, text, and their loss.

  python scripts/inspect_batch.py --config=configs/olmo3_7b.py --step=N [--workdir=W]
      [--rank=R --num_ranks=W_DP] [--checkpoint=DIR] [--json]
  python scripts/inspect_batch.py --config=configs/from_checkpoint.py:W/checkpoints \
      --workdir=W --batch=G          # a global batch by index, e.g. one a rollback skipped

Step N is the logged step N: it read the (N-1)-th global batch outside the
run's skipped windows (train.skip_batches plus <workdir>/rollbacks.jsonl, as
data.Loader maps them), so pass --workdir for a run that rolled back. For each
instance of that batch (or of OLMo-core data-parallel rank R's share of it:
positions R, R + W_DP, ...): its position and rank, instance id, source file
and token offset (each document's, for a packed dataset), the documents'
[start, end) within the instance (ends at EOS, as the loss's segment ids
count them), and a decoded preview with the run's tokenizer (cfg.data.tokenizer,
after config_checks.complete). With --checkpoint (a checkpoints directory; its
latest step, or --checkpoint_step) it adds each instance's mean CE loss under
those params, computed on one device.
"""

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config_checks  # noqa: E402
import data  # noqa: E402
import errors  # noqa: E402
from kernels import xla  # noqa: E402
from monitor import rollback  # noqa: E402
from store import storage  # noqa: E402
from tokens import batches  # noqa: E402
from tokens import packed  # noqa: E402
from tokens import run_tokenizer  # noqa: E402


def describe(cfg, *, step: int | None = None, batch: int | None = None, rank: int | None = None,
             num_ranks: int = 1, workdir: str = '', checkpoint_dir: str = '',
             checkpoint_step: int | None = None, preview_tokens: int = 48) -> dict:
  """{'step', 'global_batch', 'epoch', 'epoch_step', 'instances': [...]} for one step or batch."""
  config_checks.complete(cfg, announce=False)  # stdout is the report (--json: one object)
  skips = rollback.run_skips(cfg.train, workdir)
  cache_dir = cfg.data.cache_dir or (storage.local_cache_dir(workdir, 'data_cache') if workdir
                                      else None)  # as train.py: local for a bucket workdir
  ds = data.dataset_from_config(cfg.data, cache_dir=cache_dir)  # the run's, as train.py sets it
  B, T = cfg.data.global_batch_size, cfg.data.seq_len
  n = data.batches_per_epoch(ds, B)
  if (step is None) == (batch is None):
    raise errors.ConfigError('give exactly one of --step (a logged step, from 1) and --batch '
                             '(a global batch index, from 0).')
  if step is not None and step < 1:
    raise errors.ConfigError(f'--step={step}: logged steps count from 1.')
  index = skips.nth(step - 1) if step is not None else batch
  epoch, epoch_step = index // n + 1, index % n
  ids = data.global_batch_ids(ds, cfg.data.seed, epoch, epoch_step, B, cache_dir)
  positions = np.arange(B)
  if rank is not None:
    if not 0 <= rank < num_ranks:
      raise errors.ConfigError(f'--rank={rank} must lie in [0, --num_ranks={num_ranks}).')
    positions = positions[batches.batch_positions(B, num_ranks).reshape(num_ranks, -1)[rank]]
  if isinstance(ds, packed.PackedDataset):
    tokens, real = ds.read_with_lengths(ids[positions])
  else:
    tokens, real = ds.read(ids[positions]), None
  batch_dict = batches.make_batch(tokens, eos_token_id=ds.eos_token_id, document_masking=True,
                                  real_B=real, bos_token_id=getattr(ds, 'bos_token_id', None))
  losses = (instance_losses(cfg, batch_dict, checkpoint_dir, checkpoint_step)
            if checkpoint_dir else None)
  decode = _decoder(cfg.data)
  out = []
  for k, (position, instance) in enumerate(zip(positions.tolist(), ids[positions].tolist())):
    seg = batch_dict['segment_ids'][k]
    bounds = np.flatnonzero(np.diff(seg)) + 1
    docs = [[int(a), int(b)] for a, b in zip([0, *bounds], [*bounds, T])]
    row = {'position': position, 'rank': position % num_ranks, 'instance_id': instance,
           **_source(ds, instance, T), 'documents': docs, 'tokens': tokens[k].tolist(),
           'preview': decode(tokens[k][:preview_tokens]) if decode else None}
    if losses is not None:
      row['loss'] = float(losses[k])
    out.append(row)
  return {'step': step, 'global_batch': int(index), 'epoch': int(epoch),
          'epoch_step': int(epoch_step), 'skipped': index != skips.advance(index),
          'skips': skips.windows, 'instances': out}


def _source(ds, instance: int, T: int) -> dict:
  if isinstance(ds, packed.PackedDataset):
    docs = ds.instance_documents(instance)
    return {'sources': [{'file': ds.files[f].path, 'token_offset': s, 'length': length}
                        for f, s, length in docs]}
  f = int(np.searchsorted(ds.starts, instance, side='right')) - 1
  return {'file': ds.files[f].path, 'token_offset': int((instance - ds.starts[f]) * T)}


def _decoder(cfg_data):
  """Decodes with the run's tokenizer (run_tokenizer.find); None when the run names none."""
  path = run_tokenizer.find(cfg_data)
  if path is None:
    return None
  tokenizer = run_tokenizer.load(path)
  return lambda ids: tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def instance_losses(cfg, batch: dict, checkpoint_dir: str, step: int | None) -> np.ndarray:
  """Mean CE of each row of `batch` under the checkpoint's params, one row at a time on host."""
  import jax  # pylint: disable=import-outside-toplevel
  import checkpoint  # pylint: disable=import-outside-toplevel
  import loss  # pylint: disable=import-outside-toplevel
  import model  # pylint: disable=import-outside-toplevel
  shapes = jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))
  target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
  params, _ = checkpoint.restore(checkpoint_dir, target, step, subtree='params')

  @jax.jit
  def row_loss(params, tokens_1T, labels_1T):
    h = model.build(cfg.model).apply(params, tokens_1T)
    ce, _ = loss.sums(h, model.head_weight(params, h.dtype), labels_1T, np.ones(1, bool),
                      z_loss=0.0, chunk=cfg.opt.loss_chunk)
    return ce / jax.numpy.maximum(loss.denominator(labels_1T, np.ones(1, bool)), 1)
  return np.array([float(row_loss(params, batch['tokens'][k:k + 1], batch['labels'][k:k + 1]))
                   for k in range(batch['tokens'].shape[0])])


def print_report(report: dict) -> None:
  where = (f"step {report['step']} read global batch {report['global_batch']}"
           if report['step'] else f"global batch {report['global_batch']}")
  print(f"{where} (epoch {report['epoch']}, step {report['epoch_step']} of it)"
        + (' -- skipped by the run' if report['skipped'] else '')
        + f"; skipped windows: {data.Skips(report['skips'])}")
  for row in report['instances']:
    source = (f"{row['file']} @ token {row['token_offset']}" if 'file' in row else
              '; '.join(f"{s['file']} @ {s['token_offset']} (+{s['length']})"
                        for s in row['sources']))
    loss = f"  loss {row['loss']:.4f}" if 'loss' in row else ''
    print(f"#{row['position']:<5d} rank {row['rank']:<4d} id {row['instance_id']:<10d} {source}"
          f"  documents {row['documents']}{loss}")
    if row['preview'] is not None:
      print(f"       {row['preview']!r}")


FLAGS = flags.FLAGS




def main(argv):
  xla.quiet_libtpu()  # libtpu without TPU chips: quiet, before a backend starts
  if len(argv) > 1:
    errors.report(f'unexpected arguments {argv[1:]}; flags take the form --name=value.',
                  errors.EXIT_USAGE)
  with errors.one_line():
    # Read, never written: a path or a bucket, in one canonical form (`W/` and `W` are one
    # run, so one data cache), or one line before any work.
    workdir, ckpt = (storage.canonical(FLAGS[f].value, f'--{f}', writes=False)
                     if FLAGS[f].value else '' for f in ('workdir', 'checkpoint'))
    report = describe(FLAGS.config, step=FLAGS.step, batch=FLAGS.batch, rank=FLAGS.rank,
                      num_ranks=FLAGS.num_ranks, workdir=workdir,
                      checkpoint_dir=ckpt, checkpoint_step=FLAGS.checkpoint_step,
                      preview_tokens=FLAGS.preview_tokens)
  if FLAGS.json:
    print(json.dumps(report))
  else:
    print_report(report)


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', None, 'The run\'s training config.')
  flags.DEFINE_integer('step', None, 'A logged step (from 1): the batch it read.')
  flags.DEFINE_integer('batch', None, 'A global batch index (from 0), skipped or not.')
  flags.DEFINE_integer('rank', None, 'Only this OLMo-core data-parallel rank\'s instances.')
  flags.DEFINE_integer('num_ranks', 1, 'Data-parallel ranks (devices that split the batch).')
  flags.DEFINE_string('workdir', '', 'Reads the run\'s workdir (a path or URL): its '
                      'rollbacks.jsonl skips count.')
  flags.DEFINE_string('checkpoint', '', 'Reads a checkpoints directory (a path or URL): adds '
                      'per-instance loss.')
  flags.DEFINE_integer('checkpoint_step', None, 'Its step (default: the latest).')
  flags.DEFINE_integer('preview_tokens', 48, 'Tokens decoded per instance.')
  flags.DEFINE_bool('json', False, 'Print one JSON object instead of text.')
  app.run(main, flags_parser=config_checks.parser_requiring_config(
      "the run's training config, as train.py was given it (e.g. --config=configs/small.py "
      'with the same --config.* overrides)'))
