"""Peak host memory of convert.py on OLMo-core checkpoints of the 7B's width, vs the full state.

For each --layers count, a subprocess writes an OLMo-core step directory with
OLMo-core's own writer (`olmo_core.distributed.checkpoint.save_state_dict`,
the storage layer its Checkpointer uses): Olmo 3 7B's tensor shapes (d_model
4096, 32 heads, MLP 11008, vocabulary 100,352 = dolma2's 100,278 padded) with
fewer layers, model + AdamW state keyed as OLMo-core's trainer keys it
(`model.<fqn>`, `optim.state.<fqn>.{step,exp_avg,exp_avg_sq}`,
`optim.param_groups.<fqn>.<field>`), plus config.json and train/rank0.pt. Then
it runs, each in a fresh process, and reads the process's peak RSS (ru_maxrss
from os.wait4):

  import  python convert.py --from_olmo_core=SRC --to=CKPT
  export  python convert.py --from_ckpt=CKPT --to_olmo_core=DIR
  base    python -c 'import convert, olmo_core_ckpt, torch' (the imports alone)

A streaming converter's peak does not grow with the layer count; the fit
peak(L) = a + b L over the measured counts is extrapolated to the 7B's 32
layers (an extrapolation, printed as one) and divided by the 7B's full state:
params + both moments in float32 = 12 bytes x 7,298,617,344. A few values are
checked against the written ones, so a fast wrong conversion does not pass.

  python bench/bench_convert_memory.py [--layers=1,2] [--dir=/tmp]

Disk: about 2 x (3 x 3.3 GB + 3 x 2.4 GB per layer) for the largest count, at once.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_LAYERS = flags.DEFINE_list('layers', ['1', '2'], 'Layer counts to convert (at least two '
                            'for the per-layer fit).')
_DIR = flags.DEFINE_string('dir', '', 'Scratch directory (default: a fresh temp dir).')
_D_MODEL = flags.DEFINE_integer('d_model', 4096, 'Olmo 3 7B: d_model (OLMo-core olmo3_7B).')
_HEADS = flags.DEFINE_integer('num_heads', 32, 'Olmo 3 7B: n_heads (MHA).')
_MLP = flags.DEFINE_integer('mlp_hidden', 11008, 'Olmo 3 7B: feed_forward hidden_size.')
_VOCAB = flags.DEFINE_integer('vocab_size', 100352, "dolma2's 100,278 padded to 128 "
                              '(OLMo-core TokenizerConfig.padded_vocab_size).')
_WRITE = flags.DEFINE_string('write_source', '', 'Internal: write the OLMo-core step directory '
                             'here (the writer subprocess).')
_CHECK = flags.DEFINE_list('check', [], 'Internal: CKPT,EXPORT to check against the written '
                           'values (a subprocess too).')
_NUM_LAYERS = flags.DEFINE_integer('num_layers', 1, 'Internal: layers of --write_source, --check.')

STEP, COUNT = 1000, 1001  # the written step and Adam count (count = step + 1, as OLMo-core's)
GB = 1e9


def _value(start: int, n: int) -> np.ndarray:
  """Tensor k of the source holds _value(k, numel): cheap to write and to check again."""
  return ((np.arange(start, start + n) % 65521).astype(np.float32) * 1e-3 - 32.0)


def _tensors(num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
  """(OLMo-core key, shape) of every tensor of model + AdamW, in a fixed order."""
  from formats import olmo_core_ckpt as occ  # pylint: disable=import-outside-toplevel
  d, f, v = _D_MODEL.value, _MLP.value, _VOCAB.value
  shapes = {'embeddings.weight': (v, d), 'lm_head.norm.weight': (d,),
            'lm_head.w_out.weight': (v, d), 'feed_forward.w1.weight': (f, d),
            'feed_forward.w3.weight': (f, d), 'feed_forward.w2.weight': (d, f)}
  out = []
  for fqn, _, _ in occ.tensor_names(num_layers):
    short = fqn.split('.', 2)[-1] if fqn.startswith('blocks.') else fqn
    shape = shapes.get(short, (d, d) if short.endswith(('w_q.weight', 'w_k.weight',
                                                         'w_v.weight', 'w_out.weight'))
                       else (d,))
    out += [(f'model.{fqn}', shape), (f'optim.state.{fqn}.exp_avg', shape),
            (f'optim.state.{fqn}.exp_avg_sq', shape)]
  return out


def write_source(step_dir: str, num_layers: int) -> None:
  """The writer subprocess: an OLMo-core step directory written by OLMo-core's writer."""
  import torch  # pylint: disable=import-outside-toplevel
  from olmo_core.distributed.checkpoint import save_state_dict  # pylint: disable=import-outside-toplevel
  from olmo_core.nn.transformer import TransformerConfig  # pylint: disable=import-outside-toplevel
  tensors = _tensors(num_layers)
  # One buffer, every tensor a view of it at its own offset: the writer's memory stays
  # near one embedding (OLMo-core clones each tensor before torch.save).
  buffer = torch.from_numpy(_value(0, max(np.prod(s) for _, s in tensors) + len(tensors)))
  state = {key: buffer[k:k + int(np.prod(shape))].view(shape)
           for k, (key, shape) in enumerate(tensors)}
  for key, _ in tensors:
    if key.startswith('model.'):
      fqn = key[len('model.'):]
      state[f'optim.state.{fqn}.step'] = torch.tensor(float(COUNT))
      decay = 0.0 if fqn == 'embeddings.weight' else 0.1
      for field, value in (('lr', 3e-4), ('betas', (0.9, 0.95)), ('eps', 1e-8),
                           ('weight_decay', decay), ('initial_lr', 3e-4)):
        state[f'optim.param_groups.{fqn}.{field}'] = value
  save_state_dict(os.path.join(step_dir, 'model_and_optim'), state, thread_count=1)
  model_cfg = TransformerConfig.olmo3_7B(vocab_size=_VOCAB.value)
  model_cfg.d_model, model_cfg.n_layers = _D_MODEL.value, num_layers
  model_cfg.block.sequence_mixer.n_heads = _HEADS.value
  model_cfg.block.feed_forward.hidden_size = _MLP.value
  seq, batch = 8192, 512
  with open(os.path.join(step_dir, 'config.json'), 'w') as f:
    json.dump({'model': model_cfg.as_config_dict(),
               'dataset': {'sequence_length': seq},
               'data_loader': {'global_batch_size': batch * seq, 'seed': 34521}}, f)
  os.makedirs(os.path.join(step_dir, 'train'))
  torch.save({'global_step': STEP, 'global_train_tokens_seen': STEP * batch * seq, 'epoch': 1,
              'world_size': 1, 'rng': {},
              'data_loader': {'dataset_fingerprint_version': 'v2.0',
                              'dataset_fingerprint': '0' * 64, 'batches_processed': STEP,
                              'tokens_processed': STEP * batch * seq, 'seed': 34521,
                              'epoch': 1, 'dataset_type': 'fsl', 'sequence_length': seq,
                              'max_target_sequence_length': seq}},
             os.path.join(step_dir, 'train', 'rank0.pt'))


def peak_rss(cmd: list[str]) -> float:
  """Peak resident memory (bytes) of a fresh process running cmd; fails if it fails."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    raise SystemExit(f'{cmd[:3]}... failed with exit code {proc.returncode}')
  return usage.ru_maxrss * 1024.0  # kilobytes on Linux


def _check(tensors, ckpt: str, export: str) -> None:
  """A few converted values equal the written ones (layer 0's w1, the lm_head), both ways."""
  import checkpoint  # pylint: disable=import-outside-toplevel
  from formats import olmo_core_reader  # pylint: disable=import-outside-toplevel
  index = {key: (k, shape) for k, (key, shape) in enumerate(tensors)}
  reader = olmo_core_reader.Reader(os.path.join(export, 'model_and_optim'))
  for key, ours, box in (
      ('model.blocks.0.feed_forward.w1.weight', 'params/mlp/w_gate', None),
      ('optim.state.lm_head.w_out.weight.exp_avg_sq', 'opt_state/nu/lm_head/w', None)):
    k, shape = index[key]
    want = _value(k, int(np.prod(shape))).reshape(shape)
    got = checkpoint.read_array(ckpt, ours, box)
    got = got[0] if 'blocks' in key else got
    if not np.array_equal(got, want.T) or not np.array_equal(reader.tensor(key), want):
      raise SystemExit(f'{key}: the conversion changed its values')


def main(argv):
  del argv
  if _WRITE.value:
    write_source(_WRITE.value, _NUM_LAYERS.value)
    return
  if _CHECK.value:
    _check(_tensors(_NUM_LAYERS.value), *_CHECK.value)
    return
  full = 12 * 7_298_617_344  # params + mu + nu, float32 (model.param_count of the 7B)
  largest = 4 * _VOCAB.value * _D_MODEL.value  # the embedding (and the lm_head)
  root = _DIR.value or tempfile.mkdtemp(prefix='bench_convert_memory_')
  os.makedirs(root, exist_ok=True)
  py = sys.executable
  base = peak_rss([py, '-c', 'import convert; from formats import olmo_core_ckpt; import torch'])
  rows = []
  try:
    for layers in map(int, _LAYERS.value):
      src, ckpt = os.path.join(root, f'step{STEP}_L{layers}'), os.path.join(root, f'ours_L{layers}')
      ckpt = os.path.join(ckpt, 'checkpoints')  # convert.py --from_olmo_core writes a workdir's
      export = os.path.join(root, f'export_L{layers}')
      os.makedirs(src)
      shape = [f'--num_layers={layers}', f'--d_model={_D_MODEL.value}',
               f'--num_heads={_HEADS.value}', f'--mlp_hidden={_MLP.value}',
               f'--vocab_size={_VOCAB.value}']
      # Writer and checker are subprocesses too: a child's ru_maxrss starts at its parent's
      # resident size when it forks, so this process must stay small.
      subprocess.run([py, os.path.abspath(__file__), f'--write_source={src}', *shape],
                     check=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'),
                     stdout=subprocess.DEVNULL)
      size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(src) for n in ns)
      imp = peak_rss([py, 'convert.py', f'--from_olmo_core={src}', f'--to={ckpt}'])
      shutil.rmtree(src)  # the checks need only our checkpoint and the export
      exp = peak_rss([py, 'convert.py', f'--from_ckpt={ckpt}', f'--to_olmo_core={export}'])
      subprocess.run([py, os.path.abspath(__file__), f'--check={ckpt},{export}', *shape],
                     check=True, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'))
      rows.append((layers, size, imp, exp))
      print(f'{layers} layer(s): source {size / GB:.2f} GB; peak RSS import {imp / GB:.2f} GB, '
            f'export {exp / GB:.2f} GB', flush=True)
      for path in (ckpt, export):
        shutil.rmtree(path)
  finally:
    if not _DIR.value:
      shutil.rmtree(root, ignore_errors=True)
  layers = np.array([r[0] for r in rows], float)
  print(f'imports alone: {base / GB:.2f} GB; largest tensor {largest / GB:.2f} GB; full 7B '
        f'state (params + 2 moments, float32) {full / GB:.1f} GB')
  for name, col in (('import', 2), ('export', 3)):
    peaks = np.array([r[col] for r in rows])
    slope, intercept = np.polyfit(layers, peaks, 1) if len(rows) > 1 else (0.0, peaks[0])
    at32 = intercept + 32 * max(slope, 0.0)
    print(f'{name}: peak RSS {peaks.max() / GB:.2f} GB measured ({slope / GB:+.3f} GB per '
          f'layer); extrapolated to 32 layers {at32 / GB:.2f} GB = {at32 / full:.3f} of the '
          f'full state, {at32 / largest:.2f}x the largest tensor')


if __name__ == '__main__':
  app.run(main)
