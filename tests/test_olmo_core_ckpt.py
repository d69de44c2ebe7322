"""formats/olmo_core_ckpt.py against OLMo-core's own Trainer, checkpointer and reader (CPU, gloo).

One module-scoped fixture runs OLMo-core's real Trainer (stock CheckpointerCallback
and ConfigSaverCallback) on a tiny Olmo 3 for k steps and saves, then continues it
k -> 2k from that checkpoint (`load_path`), once as shipped and once with every
weight moved one ulp (the noise floor of scripts/reproduce_olmo_core.py, at two
runs). The tests convert that checkpoint and check it against OLMo-core reading
it (`olmo_core.distributed.checkpoint.load_keys`), continue it with train.py through
the documented CLI, start the shrunk stage-2 config from it against OLMo-core's own
midtrain start, export it back and let OLMo-core continue from the export; and
convert a checkpoint OLMo-core saved from 2 FSDP ranks. The fast tests check
`--config`, YaRN, row blocks and bad input on step directories written by the
exporter or by OLMo-core's config classes.

Run as a script, this file is the OLMo-core side: a fork server that imports torch and
OLMo-core once and forks one process per rank of each run (`serve`).
"""

import json
import os
import signal
import subprocess
import sys
import time
import traceback

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'scripts'))

import reproduce_olmo_core as repro  # noqa: E402
from servers import free_port  # noqa: E402
from xla_flags import with_devices  # noqa: E402

# The shape of tests/test_reproduce.py (a few seconds per OLMo-core step on two cores).
SMALL = repro.shape_overrides(d_model=64, mlp_hidden=192, window=16, seq_len=64, batch_size=4)
K = 3  # steps before the checkpoint; the runs continue to 2K


def repro_cfg(steps: int, overrides: dict | None = None):
  return repro.repro_config(repro.run_overrides(steps, 2, {**SMALL, **(overrides or {})}))


# --- The OLMo-core side (a subprocess: OLMo-core's trainer owns its process group) -----------


def olmo_core_main(spec: dict) -> None:
  """Trains with OLMo-core's Trainer per `spec`; writes <save_folder>/records_<name>.json.

  spec['stage2']: dotted overrides of configs/olmo3_7b_stage2.py (its recipe: seed,
  linear schedule) instead of tiny_repro's; spec['world']: ranks (FSDP over gloo).
  """
  world, rank = spec.get('world', 1), spec.get('rank', 0)
  os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR='127.0.0.1',
                    MASTER_PORT=str(spec['port']))
  import torch
  from olmo_core.data import (NumpyDataLoaderConfig, NumpyDatasetDType, NumpyFSLDatasetConfig,
                               TokenizerConfig)
  from olmo_core.distributed.parallel import DataParallelType
  from olmo_core.optim import (CosWithWarmup, LinearWithWarmup, OptimGroupOverride,
                               SkipStepAdamWConfig)
  from olmo_core.train import Duration, TrainerConfig, prepare_training_environment
  from olmo_core.train.callbacks import Callback, CheckpointerCallback, ConfigSaverCallback
  from olmo_core.train.train_module import (TransformerDataParallelConfig,
                                            TransformerTrainModuleConfig)

  prepare_training_environment(seed=0, backend='gloo')
  torch.set_num_threads(1)
  cfg = (stage2_cfg(spec['stage2']) if spec.get('stage2')
         else repro_cfg(spec['horizon'], spec.get('overrides')))
  d, o = cfg.data, cfg.opt
  T, B = d.seq_len, d.global_batch_size
  model = repro.olmo_core_model(cfg, init_seed=spec['init_seed'])
  dataset_cfg = NumpyFSLDatasetConfig(
      paths=spec.get('paths') or list(d.paths), sequence_length=T, max_target_sequence_length=T,
      dtype=NumpyDatasetDType.uint32,
      tokenizer=TokenizerConfig(vocab_size=d.vocab_size, eos_token_id=d.eos_token_id,
                                pad_token_id=d.pad_token_id))
  loader_cfg = NumpyDataLoaderConfig(global_batch_size=B * T, seed=d.seed, num_workers=0,
                                     work_dir=os.path.join(spec['save_folder'], 'data'))
  schedule = {'cosine': CosWithWarmup, 'linear': LinearWithWarmup}[o.schedule]
  module_cfg = TransformerTrainModuleConfig(
      rank_microbatch_size=B * T // world, max_sequence_length=T,
      dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp) if world > 1 else None,
      optim=SkipStepAdamWConfig(
          lr=o.lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay,
          rolling_interval_length=o.skip_window, sigma_factor=int(o.skip_sigma),
          group_overrides=[OptimGroupOverride(params=['embeddings.weight'],
                                              opts=dict(weight_decay=0.0))]),
      max_grad_norm=o.clip_grad_norm, z_loss_multiplier=o.z_loss,
      scheduler=schedule(warmup=o.warmup_steps, alpha_f=o.final_lr / o.lr, t_max=o.t_max))
  records = {'ce': {}, 'inputs': {}, 'lr': {}}

  class Record(Callback):
    def pre_step(self, batch):
      records['inputs'][self.step] = batch['input_ids'].numpy().astype(int).tolist()

    def log_metrics(self, step, metrics):
      if 'train/CE loss' in metrics:
        records['ce'][step] = float(metrics['train/CE loss'])
      lrs = [float(v) for k, v in metrics.items() if k.startswith('optim/LR')]
      if lrs:
        records['lr'][step] = lrs[0]

    def post_checkpoint_loaded(self, path):
      for p in self.trainer.train_module.model.parameters():  # the noise member
        for _ in range(spec.get('ulps', 0)):
          p.data = torch.nextafter(p.data, torch.tensor(float('inf')))

  trainer_cfg = TrainerConfig(
      save_folder=spec['save_folder'], work_dir=os.path.join(spec['save_folder'], 'work'),
      max_duration=Duration.steps(spec['horizon']), hard_stop=Duration.steps(spec['stop']),
      load_path=spec.get('load_path'), load_trainer_state=spec.get('load_trainer_state'),
      load_optim_state=True,
      metrics_collect_interval=1, save_overwrite=True,
      callbacks={'checkpointer': CheckpointerCallback(save_interval=spec['save_interval'],
                                                      save_async=False),
                 'config_saver': ConfigSaverCallback(), 'record': Record()})
  train_module = module_cfg.build(model, device=torch.device('cpu'))
  trainer = trainer_cfg.build(train_module, loader_cfg.build(dataset_cfg.build()))
  # config.json as OLMo-core's experiment launcher writes it (ExperimentConfig sections).
  model_cfg = repro_model_config(cfg, spec['init_seed'])
  trainer.callbacks['config_saver'].config = {
      'run_name': 'tiny', 'model': model_cfg.as_config_dict(),
      'dataset': dataset_cfg.as_config_dict(), 'data_loader': loader_cfg.as_config_dict(),
      'train_module': module_cfg.as_config_dict(),
      'trainer': {'max_duration': {'value': spec['horizon'], 'unit': 'steps'}}}
  trainer.fit()
  if rank == 0:
    with open(os.path.join(spec['save_folder'], f"records_{spec['name']}.json"), 'w') as f:
      json.dump(records, f)


def repro_model_config(cfg, init_seed: int):
  """The TransformerConfig that repro.olmo_core_model builds (for config.json)."""
  from olmo_core.nn.attention import SlidingWindowAttentionConfig
  from olmo_core.nn.transformer import TransformerConfig
  m = cfg.model
  oc = TransformerConfig.olmo3_7B(vocab_size=m.vocab_size)
  oc.d_model, oc.n_layers, oc.init_seed = m.d_model, m.num_layers, init_seed
  oc.block.sequence_mixer.n_heads = m.num_heads
  oc.block.sequence_mixer.n_kv_heads = m.num_kv_heads
  oc.block.sequence_mixer.sliding_window = SlidingWindowAttentionConfig(
      pattern=[m.sliding_window if c == 'S' else -1 for c in m.layer_pattern],
      force_full_attention_on_first_layer=False, force_full_attention_on_last_layer=False)
  oc.block.feed_forward.hidden_size = m.mlp_hidden
  return oc


def serve() -> None:
  """The OLMo-core side as a fork server: torch and OLMo-core are imported once (most of
  a tiny run's time: the file's tests went from 174 to 70 s), then each request read from
  stdin (a JSON list of rank specs) is one forked child per rank; the answer is their
  exit codes, None for one killed at the request's deadline, on a stdout of its own (a
  stray print goes to stderr). The server never runs a torch op: its children start
  with no thread pool to inherit."""
  answers = os.fdopen(os.dup(1), 'w')
  os.dup2(2, 1)
  import torch  # noqa: F401  (what olmo_core_main imports, loaded before the forks)
  import olmo_core.data, olmo_core.optim, olmo_core.train  # noqa: F401,E401
  import olmo_core.train.train_module  # noqa: F401
  for line in sys.stdin:
    request = json.loads(line)
    pids = [_fork_rank(spec) for spec in request['specs']]
    codes, deadline = {}, time.time() + request['timeout']
    while len(codes) < len(pids) and time.time() < deadline:
      for pid in set(pids) - set(codes):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
          codes[pid] = os.waitstatus_to_exitcode(status)
      time.sleep(0.05)
    for pid in set(pids) - set(codes):  # stuck in a collective its peer never joins
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
    print(json.dumps([codes.get(pid) for pid in pids]), file=answers, flush=True)


def _fork_rank(spec: dict) -> int:
  pid = os.fork()
  if pid:
    return pid
  code = 1  # the rank: its output to its log, then its own exit code
  try:
    log = os.open(spec['log'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    olmo_core_main(spec)
    code = 0
  except BaseException:  # pylint: disable=broad-except  (its stack goes to its log)
    traceback.print_exc()
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit handlers of the server's own


_SERVER: list[subprocess.Popen] = []  # the module's fork server, started on first use


def _server() -> subprocess.Popen:
  if not _SERVER or _SERVER[0].poll() is not None:
    env = dict(os.environ, JAX_PLATFORMS='cpu', GLOO_SOCKET_IFNAME='lo')
    _SERVER[:] = [subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                   env=env, cwd=REPO, text=True, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)]
  return _SERVER[0]


@pytest.fixture(scope='module', autouse=True)
def stop_server():
  yield
  for server in _SERVER:
    server.stdin.close()
    server.wait(timeout=60)


def run_olmo_core(name: str, save_folder: str, world: int = 1, timeout: float = 600,
                  **spec) -> dict:
  """OLMo-core's Trainer in `world` processes (one per rank, forked by the server);
  rank 0's records.

  The ranks meet on a free port; a run that outlives `timeout` (a rank stuck in a
  collective its peer never joins) is killed and fails the test with its log.
  """
  spec = dict(name=name, save_folder=save_folder, port=free_port(), world=world, **spec)
  os.makedirs(save_folder, exist_ok=True)
  logs = [os.path.join(save_folder, f'log_{name}_rank{r}.txt') for r in range(world)]
  server = _server()
  server.stdin.write(json.dumps({'timeout': timeout, 'specs': [
      dict(spec, rank=r, log=log) for r, log in enumerate(logs)]}) + '\n')
  server.stdin.flush()
  answer = server.stdout.readline()
  assert answer, f'the OLMo-core fork server exited ({server.wait()})'
  codes = json.loads(answer)
  tails = '\n'.join(open(log).read()[-2000:] for log in logs if os.path.exists(log))
  assert None not in codes, f'OLMo-core run {name} did not finish in {timeout:.0f} s:\n{tails}'
  assert codes == [0] * world, f'OLMo-core run {name} failed: exit codes {codes}\n{tails}'
  with open(os.path.join(save_folder, f'records_{name}.json')) as f:
    out = json.load(f)
  return {'ce': {int(k): v for k, v in out['ce'].items()},
          'lr': {int(k): v for k, v in out['lr'].items()},
          'inputs': {int(k): np.array(v) for k, v in out['inputs'].items()}}


# configs/olmo3_7b_stage2.py shrunk to the tiny run: every field where tiny_repro differs,
# except the stage-2 recipe itself, which is the point of the test.
STAGE2_RECIPE = ('data.seed', 'opt.lr', 'opt.schedule', 'opt.warmup_steps', 'opt.final_lr',
                 'train.reset_step_on_init')


def stage2_overrides(steps: int, mix_file: str, base_dir: str) -> dict:
  from configs import olmo3_7b_stage2
  tiny = repro_cfg(steps)
  changes = config_checks.config_changes(olmo3_7b_stage2.get_config().to_dict(), tiny)
  out = {k: new for k, (_, new) in changes.items()
         if k not in STAGE2_RECIPE and not k.startswith(('data.paths', 'data.validation_paths'))
         and not isinstance(new, (list, dict))}
  # The stage-2 config's in-loop tasks need 8,192-token sequences; the miniature has 64.
  return {**out, 'data.mix_file': mix_file, 'data.base_dir': base_dir, 'train.eval_tasks': ()}


def stage2_cfg(overrides: dict):
  from configs import olmo3_7b_stage2
  return repro.apply_overrides(olmo3_7b_stage2.get_config(), overrides,
                               'configs/olmo3_7b_stage2.py')


if __name__ == '__main__':
  serve()
  sys.exit(0)


# --- Tests -------------------------------------------------------------------------------------

import jax  # noqa: E402

import checkpoint  # noqa: E402
import config_checks  # noqa: E402
import data  # noqa: E402
import errors  # noqa: E402
from formats import init_from  # noqa: E402
from formats import olmo_core_ckpt as occ  # noqa: E402
from formats import olmo_core_config as ocfg  # noqa: E402
from formats import olmo_core_reader  # noqa: E402
import optim
import sharding
import train  # noqa: E402


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """OLMo-core: 0 -> K (saved), K -> 2K from its checkpoint, and the +1 ulp member."""
  root = tmp_path_factory.mktemp('olmo_core')
  first = str(root / 'first')
  common = dict(horizon=2 * K + 10, init_seed=7)
  run_olmo_core('first', first, stop=K, save_interval=K, **common)
  step_dir = os.path.join(first, f'step{K}')
  cont = run_olmo_core('cont', str(root / 'cont'), stop=2 * K, save_interval=100,
                       load_path=step_dir, **common)
  ulp = run_olmo_core('ulp', str(root / 'ulp'), stop=2 * K, save_interval=100,
                      load_path=step_dir, ulps=1, **common)
  ours = str(root / 'ours' / 'checkpoints')
  occ.import_step(step_dir, ours)
  return dict(root=root, step_dir=step_dir, cont=cont, ulp=ulp, ours=ours, common=common)


def _olmo_core_reads(step_dir: str, keys: list[str]) -> dict:
  """OLMo-core's own reader on its own checkpoint: the reference for the conversion."""
  from olmo_core.distributed.checkpoint import load_keys
  values = load_keys(os.path.join(step_dir, 'model_and_optim'), keys)
  return {k: np.asarray(v.numpy() if hasattr(v, 'numpy') else v) for k, v in zip(keys, values)}


def _ours(ckpt: str, cfg, step: int = K) -> train.TrainState:
  target = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                        train.abstract_state(cfg, optim.make_optimizer(cfg.opt)))
  state, _ = checkpoint.restore(ckpt, target, step)
  return state


def _assert_equals_olmo_core_reading(step_dir: str, ckpt: str, cfg, step: int):
  """Every weight and moment of our conversion equals OLMo-core's reader's, bit for bit."""
  state = _ours(ckpt, cfg, step)
  names = list(occ.tensor_names(cfg.model.num_layers))
  keys = [f'model.{f}' for f, _, _ in names] + [
      f'optim.state.{f}.{m}' for f, _, _ in names for m in ('exp_avg', 'exp_avg_sq', 'step')]
  ref = _olmo_core_reads(step_dir, keys)
  for fqn, (module, name), layer in names:
    for key, tree in ((f'model.{fqn}', state.params), (f'optim.state.{fqn}.exp_avg',
                                                       state.opt_state.mu),
                      (f'optim.state.{fqn}.exp_avg_sq', state.opt_state.nu)):
      ours = tree[module][name] if layer is None else tree[module][name][layer]
      theirs = ref[key].T if ref[key].ndim == 2 and fqn != 'embeddings.weight' else ref[key]
      np.testing.assert_array_equal(ours, theirs, err_msg=key)  # bit for bit, float32
  return state, ref


@pytest.mark.slow
def test_conversion_is_bit_exact_and_takes_the_adam_count_from_the_state(runs):
  meta = checkpoint.read_metadata(runs['ours'], K)
  cfg = repro_cfg(runs['common']['horizon'])
  saved = ocfg.config_from_olmo_core(meta['olmo_core_source']['config'], [])
  for group, field in [('model', f) for f in ('d_model', 'num_layers', 'num_heads',
                                              'num_kv_heads', 'mlp_hidden', 'layer_pattern',
                                              'sliding_window')] + [
      ('data', 'global_batch_size'), ('data', 'seq_len'), ('data', 'seed'), ('opt', 'lr'),
      ('opt', 'warmup_steps'), ('opt', 't_max'), ('opt', 'final_lr'), ('opt', 'z_loss')]:
    assert saved[group][field] == pytest.approx(cfg[group][field]), (group, field)
  state, ref = _assert_equals_olmo_core_reading(runs['step_dir'], runs['ours'], cfg, K)
  # OLMo-core's step-0 checkpoint ran one zero-gradient optimizer step: count = K + 1.
  assert int(state.opt_state.count) == int(ref['optim.state.embeddings.weight.step']) == K + 1
  assert int(state.opt_state.step) == meta['step'] == K
  assert int(state.opt_state.history_len) == 0  # OLMo-core does not save the window
  assert meta['data']['step'] == K and meta['data']['epoch'] == 1
  assert meta['data']['seed'] == cfg.data.seed
  assert meta['config']['opt']['no_decay'] == ['embed/embedding']


def _mix_file(root, cfg) -> tuple[str, str]:
  """A mix file (label,relative path) listing cfg.data.paths under their directory."""
  base = os.path.dirname(cfg.data.paths[0])
  mix = str(root / 'mix.txt')
  with open(mix, 'w') as f:
    f.writelines(f'tiny,{os.path.relpath(p, base)}\n' for p in cfg.data.paths)
  return mix, base


def _train_py(config: str, workdir, overrides: dict) -> dict[int, dict]:
  """train.py as documented; {step: metrics record}."""
  cmd = [sys.executable, os.path.join(REPO, 'train.py'), f'--config={config}',
         f'--workdir={workdir}', '--sample_tokens=0'] + [
             f'--config.{k}={v}' for k, v in overrides.items()]
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=with_devices(1))
  done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return {r['step']: r for r in map(json.loads, open(os.path.join(workdir, 'metrics.jsonl')))
          if 'train/CE loss' in r}


def _within_noise(ours: list[float], members: list[list[float]], cfg) -> np.ndarray:
  """|ours - median| / floor per step, the yardstick of scripts/reproduce_olmo_core.py."""
  ensemble = np.array(members)
  floor = repro.ce_floor(ensemble, tokens=cfg.data.global_batch_size * cfg.data.seq_len,
                         half_width=5)
  ratio = np.abs(np.array(ours) - np.median(ensemble, 0)) / floor
  assert ratio.max() <= repro.MAX_RATIO, (ours, ensemble, floor)
  return ratio


@pytest.mark.slow
def test_train_py_continues_olmo_core_run_on_the_same_batches_within_the_noise(runs):
  """BUILD.md's "continue Ai2's run" commands: convert.py --config (the data as a mix file,
  not the step's data_paths.txt), then train.py with the same --config on that workdir."""
  root, horizon = runs['root'], runs['common']['horizon']
  cfg = repro_cfg(horizon)
  mix, base = _mix_file(root, cfg)
  overrides = {**repro.run_overrides(horizon, 2, SMALL), 'data.paths': '()',
               'data.mix_file': mix, 'data.base_dir': base}
  config = os.path.join(REPO, 'configs', 'tiny_repro.py')
  workdir = root / 'cli'
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'convert.py'), f'--from_olmo_core={runs["step_dir"]}',
       f'--to={workdir}', f'--config={config}'] + [
           f'--config.{k}={v}' for k, v in overrides.items()],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  stored = checkpoint.read_metadata(str(workdir / 'checkpoints'), K)['config']['data']
  assert stored['mix_file'] == mix and not stored['paths']  # the run's config, as given
  records = _train_py(config, workdir, {**overrides, 'train.steps': 2 * K,
                                        'train.ckpt_every': 100})
  steps = list(range(K + 1, 2 * K + 1))
  assert sorted(records) == steps  # resumed at K, not restarted
  # The batches: our loader from the converted position vs what OLMo-core's trainer fed.
  ds = data.Dataset.from_config(cfg.data)
  loader = data.Loader(ds, seed=cfg.data.seed, global_batch_size=cfg.data.global_batch_size,
                       cache_dir=str(root / 'cache'))
  for s in steps:
    np.testing.assert_array_equal(loader.batch_at(1, s - 1)['tokens'], runs['cont']['inputs'][s])
  _within_noise([records[s]['train/CE loss'] for s in steps],
                [[runs[r]['ce'][s] for s in steps] for r in ('cont', 'ulp')], cfg)


@pytest.mark.slow
def test_stage2_from_converted_stage1_restarts_like_olmo_core_midtrain(runs):
  """configs/olmo3_7b_stage2.py (shrunk) with train.init_from=<converted OLMo-core
  checkpoint> vs OLMo-core's midtrain start from its own checkpoint (load_path,
  load_trainer_state=False, optimizer state loaded): moments and Adam count kept, step,
  schedule and data order (epoch 1, step 0, the stage-2 seed) restarted."""
  root, steps = runs['root'], K
  cfg1 = repro_cfg(runs['common']['horizon'])
  mix, base = _mix_file(root, cfg1)
  overrides = {**stage2_overrides(steps, mix, base), 'train.init_from': runs['ours']}
  cfg = stage2_cfg(overrides)
  assert cfg.data.seed != cfg1.data.seed and cfg.opt.schedule == 'linear'  # the stage-2 recipe
  # What train.init_from loads: the converted state, step and history reset.
  mesh = sharding.make_mesh(cfg.train)
  state, shardings = train.create_state(cfg, optim.make_optimizer(cfg.opt), mesh, jax.random.key(0))
  init = init_from.load(cfg, train.abstract_state(cfg, optim.make_optimizer(cfg.opt), mesh),
                        state, shardings)
  stage1 = _ours(runs['ours'], cfg1)
  for a, b in zip(jax.tree.leaves((init.params, init.opt_state.mu, init.opt_state.nu)),
                  jax.tree.leaves((stage1.params, stage1.opt_state.mu, stage1.opt_state.nu))):
    np.testing.assert_array_equal(a, b)
  assert int(init.opt_state.count) == K + 1 and int(init.opt_state.step) == 0
  assert int(init.opt_state.history_len) == 0
  # OLMo-core's midtrain start, and its +1 ulp noise member.
  spec = dict(horizon=steps, stop=steps, save_interval=100, load_path=runs['step_dir'],
              load_trainer_state=False, init_seed=7, paths=list(cfg1.data.paths),
              stage2={k: v for k, v in overrides.items() if k != 'train.init_from'})
  mid = run_olmo_core('mid', str(root / 'mid'), **spec)
  ulp = run_olmo_core('mid_ulp', str(root / 'mid_ulp'), ulps=1, **spec)
  workdir = root / 'stage2'
  records = _train_py(os.path.join(REPO, 'configs', 'olmo3_7b_stage2.py'), workdir,
                      {**overrides, 'train.ckpt_every': 100})
  assert sorted(records) == list(range(1, steps + 1))  # from step 0
  for s in records:  # the schedule restarted: stage 2's LR from its step 0, as OLMo-core's
    assert records[s]['optim/LR'] == pytest.approx(mid['lr'][s], rel=1e-6)
  # Stage 2's own LR decaying from its step 0 (not stage 1's 3e-3 schedule at step K + 1):
  # OLMo-core's midtrain takes the new LR, though the checkpoint's param groups hold stage 1's.
  assert mid['lr'][1] == pytest.approx(cfg.opt.lr * (1 - 1 / cfg.opt.t_max), rel=1e-6)
  ds = data.Dataset.from_config(cfg.data)
  loader = data.Loader(ds, seed=cfg.data.seed, global_batch_size=cfg.data.global_batch_size,
                       cache_dir=str(root / 'cache2'))
  for s in records:  # epoch 1 from step 0 with the stage-2 seed
    np.testing.assert_array_equal(loader.batch_at(1, s - 1)['tokens'], mid['inputs'][s])
  meta = checkpoint.read_metadata(str(workdir / 'checkpoints'))
  assert (meta['data']['epoch'], meta['data']['step'], meta['data']['seed']) == (
      1, steps, cfg.data.seed)
  _within_noise([records[s]['train/CE loss'] for s in records],
                [[r['ce'][s] for s in records] for r in (mid, ulp)], cfg)


@pytest.mark.slow
def test_round_trip_is_bit_exact_and_olmo_core_continues_from_the_export(runs):
  cfg = repro_cfg(runs['common']['horizon'])
  export = str(runs['root'] / 'export' / f'step{K}')
  os.makedirs(os.path.dirname(export))
  assert occ.export_step(runs['ours'], export, step=K) == K  # train.py may have added 2K
  back = str(runs['root'] / 'back')
  occ.import_step(export, back)
  a, b = _ours(runs['ours'], cfg), _ours(back, cfg)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  meta_a, meta_b = checkpoint.read_metadata(runs['ours'], K), checkpoint.read_metadata(back)
  for key in ('seed', 'epoch', 'step', 'fingerprint', 'global_batch_size'):
    assert meta_a['data'][key] == meta_b['data'][key], key
  # OLMo-core's trainer loads the export (load_path) and continues exactly as from its own.
  again = run_olmo_core('export', str(runs['root'] / 'from_export'), stop=2 * K,
                        save_interval=100, load_path=export, **runs['common'])
  assert again['ce'] == runs['cont']['ce']
  for s in again['inputs']:
    np.testing.assert_array_equal(again['inputs'][s], runs['cont']['inputs'][s])


@pytest.mark.slow
def test_fsdp_sharded_checkpoint_converts_bit_exactly(tmp_path):
  """OLMo-core trained with 2 ranks of FSDP (gloo): every tensor saved as two chunks."""
  shape = {'model.num_kv_heads': 2, 'model.num_layers': 2, 'model.layer_pattern': 'SF'}
  save, steps = str(tmp_path / 'fsdp'), 2
  run_olmo_core('fsdp', save, world=2, horizon=10, stop=steps, save_interval=steps,
                init_seed=11, overrides=shape)
  step_dir = os.path.join(save, f'step{steps}')
  reader = olmo_core_reader.Reader(os.path.join(step_dir, 'model_and_optim'))
  sharded = [k for k, c in reader.chunks.items() if k.startswith('model.') and len(c) > 1]
  assert len(sharded) == sum(1 for _ in occ.tensor_names(2))  # both ranks hold part of each
  assert {f.split('_')[2] for f in reader.files()} == {'0', '1'}
  occ.import_step(step_dir, str(tmp_path / 'ours'))
  state, _ = _assert_equals_olmo_core_reading(step_dir, str(tmp_path / 'ours'),
                                              repro_cfg(10, shape), steps)
  assert int(state.opt_state.count) == steps + 1


# --- Fast: a synthetic train state through the exporter, bad input, the URL fetch ---------------


@pytest.fixture(scope='module')
def synthetic(tmp_path_factory):
  """Our checkpoint of a random train state at step 5 (Adam count 4: one skipped step)."""
  root = tmp_path_factory.mktemp('synthetic')
  cfg = repro_cfg(20, {'model.num_kv_heads': 2, 'model.num_layers': 2,
                       'model.layer_pattern': 'SF'})
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype)
                       if s.dtype == np.float32 and s.ndim else np.zeros(s.shape, s.dtype),
                       train.abstract_state(cfg, optim.make_optimizer(cfg.opt)))
  state = state._replace(opt_state=state.opt_state._replace(step=np.int32(5), count=np.int32(4)))
  ds = data.Dataset.from_config(cfg.data)
  loader = data.Loader(ds, seed=cfg.data.seed, global_batch_size=cfg.data.global_batch_size,
                       step=5)
  ckpt = str(root / 'ours')
  with checkpoint.Checkpointer(ckpt, fsync=False) as c:
    c.save(5, state, {'config': cfg.to_dict(), 'data': loader.state()})
  export = str(root / 'step5')
  occ.export_step(ckpt, export)
  return dict(root=root, cfg=cfg, state=state, ckpt=ckpt, export=export)


def test_export_import_round_trip_on_another_shape(synthetic, tmp_path):
  back = str(tmp_path / 'back')
  out = occ.import_step(synthetic['export'], back)
  assert out['step'] == 5 and out['adam_count'] == 4
  got = _ours(back, synthetic['cfg'], 5)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(synthetic['state'])):
    if np.ndim(y) and y.shape[0] == synthetic['cfg'].opt.skip_window:
      continue  # the skip history: OLMo-core keeps none, so it comes back empty
    np.testing.assert_array_equal(x, y)
  assert int(got.opt_state.history_len) == 0
  meta = checkpoint.read_metadata(back)
  assert meta['data']['step'] == 5 and meta['config']['model']['num_kv_heads'] == 2


def test_vocabulary_arrays_move_in_row_blocks_bit_exactly(synthetic, tmp_path, monkeypatch):
  """The embedding and lm_head in 8 row blocks each way (as the 7B's 1.6 GB ones go)."""
  cfg = synthetic['cfg']
  monkeypatch.setattr(occ, 'BLOCK_BYTES', 4 * cfg.model.vocab_size * 8)  # 8 of D's 64 rows
  export = str(tmp_path / 'step5')
  occ.export_step(synthetic['ckpt'], export)
  reader = olmo_core_reader.Reader(os.path.join(export, 'model_and_optim'))
  np.testing.assert_array_equal(reader.tensor('model.lm_head.w_out.weight'),
                                synthetic['state'].params['lm_head']['w'].T)
  occ.import_step(export, str(tmp_path / 'back'))
  got = _ours(str(tmp_path / 'back'), cfg, 5)
  for tree in ('params', 'mu', 'nu'):
    ours = got.params if tree == 'params' else getattr(got.opt_state, tree)
    want = (synthetic['state'].params if tree == 'params'
            else getattr(synthetic['state'].opt_state, tree))
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
      np.testing.assert_array_equal(x, y)
  box = ((0, cfg.model.d_model), (100, 4000))  # across blocks
  np.testing.assert_array_equal(
      checkpoint.read_array(str(tmp_path / 'back'), 'opt_state/mu/lm_head/w', box),
      synthetic['state'].opt_state.mu['lm_head']['w'][:, 100:4000])


def test_weights_only_source_starts_the_moments_at_zero(synthetic, tmp_path, caplog):
  import pickle
  import shutil
  src = str(tmp_path / 'weights')
  shutil.copytree(synthetic['export'], src)
  shutil.rmtree(os.path.join(src, 'train'))
  path = os.path.join(src, 'model_and_optim', '.metadata')
  with open(path, 'rb') as f:
    md = pickle.load(f)
  md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items()
                            if k.startswith('model.')}
  md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn.startswith('model.')}
  with open(path, 'wb') as f:
    pickle.dump(md, f)
  with caplog.at_level('WARNING'):
    out = occ.import_step(src, str(tmp_path / 'ours'))
  assert not out['moments'] and 'moments and count start at zero' in caplog.text
  got = _ours(str(tmp_path / 'ours'), synthetic['cfg'], 0)
  assert int(got.opt_state.count) == 0 and int(got.opt_state.step) == 0
  assert all(not np.any(x) for x in jax.tree.leaves((got.opt_state.mu, got.opt_state.nu)))
  np.testing.assert_array_equal(got.params['mlp']['w_up'],
                                synthetic['state'].params['mlp']['w_up'])


def test_bad_input_names_the_problem_and_keeps_what_is_there(synthetic, tmp_path, monkeypatch):
  import shutil
  src = str(tmp_path / 'damaged')
  shutil.copytree(synthetic['export'], src)
  blob = os.path.join(src, 'model_and_optim', '__0_0.distcp')
  with open(blob, 'r+b') as f:
    f.truncate(os.path.getsize(blob) // 2)
  with pytest.raises(occ.OlmoCoreCheckpointError, match='__0_0.distcp is truncated'):
    occ.import_step(src, str(tmp_path / 'out'))
  assert not checkpoint.committed_steps(str(tmp_path / 'out'))
  assert not [n for n in os.listdir(tmp_path) if '.convert-' in n]  # staging removed
  os.remove(os.path.join(src, 'config.json'))
  with pytest.raises(occ.OlmoCoreCheckpointError, match='config.json is missing'):
    occ.import_step(src, str(tmp_path / 'out'))
  # An existing checkpoint is refused (and kept) without --overwrite.
  with pytest.raises(FileExistsError, match='--overwrite'):
    occ.import_step(synthetic['export'], synthetic['ckpt'])
  assert checkpoint.committed_steps(synthetic['ckpt']) == [5]
  with pytest.raises(FileExistsError, match='choose a new'):
    occ.export_step(synthetic['ckpt'], synthetic['export'])
  monkeypatch.setitem(sys.modules, 'torch', None)
  with pytest.raises(ImportError, match=r"pip install '\.\[olmo-core\]'"):
    occ.import_step(synthetic['export'], str(tmp_path / 'out'))


def test_url_fetch_resumes_an_interrupted_download_and_converts_the_same(synthetic, tmp_path):
  from test_download import FaultyServer
  files = {}
  for dirpath, _, names in os.walk(synthetic['export']):
    for n in names:
      full = os.path.join(dirpath, n)
      files['/ckpt/step5/' + os.path.relpath(full, synthetic['export'])] = open(full, 'rb').read()
  server = FaultyServer(files)
  blob = '/ckpt/step5/model_and_optim/__0_0.distcp'
  server.faults[blob] = [('drop', len(files[blob]) // 3)]  # the connection dies a third in
  try:
    cache = str(tmp_path / 'cache')
    wrong = repro_cfg(20, {'model.num_kv_heads': 2, 'model.num_layers': 3,
                           'model.layer_pattern': 'SF'})
    with pytest.raises(occ.OlmoCoreCheckpointError, match='num_layers=3'):
      occ.fetch(server.url + '/ckpt/step5/', cache, base=wrong, progress=False)
    assert not server.gets(blob)  # refused before the tensors were fetched
    local = occ.fetch(server.url + '/ckpt/step5/', cache, progress=False, backoff=0.01)
    gets = server.gets(blob)
    assert len(gets) == 2 and gets[1][2] == f'bytes={len(files[blob]) // 3}-'  # resumed
    assert open(os.path.join(local, 'model_and_optim', '__0_0.distcp'), 'rb').read() == \
        files[blob]
    occ.import_step(local, str(tmp_path / 'ours'))
    got = _ours(str(tmp_path / 'ours'), synthetic['cfg'], 5)
    np.testing.assert_array_equal(got.opt_state.nu['embed']['embedding'],
                                  synthetic['state'].opt_state.nu['embed']['embedding'])
    before = len(server.gets())
    occ.fetch(server.url + '/ckpt/step5', cache, progress=False)
    assert len(server.gets()) == before  # complete files are not fetched again
  finally:
    server.close()


@pytest.mark.slow
def test_config_flag_stores_the_run_config_and_refuses_another_run(synthetic, tmp_path):
  cfg = synthetic['cfg']
  mine = repro_cfg(20, {'model.num_kv_heads': 2, 'model.num_layers': 2,
                        'model.layer_pattern': 'SF', 'opt.lr': 1e-3})
  mine.data.paths, mine.data.mix_file, mine.data.base_dir = (), '/data/mix.txt', '/data'
  occ.import_step(synthetic['export'], str(tmp_path / 'ok'), base=mine)
  stored = checkpoint.read_metadata(str(tmp_path / 'ok'))['config']
  assert stored['data']['mix_file'] == '/data/mix.txt' and stored['opt']['lr'] == 1e-3
  got = _ours(str(tmp_path / 'ok'), cfg, 5)
  np.testing.assert_array_equal(got.opt_state.mu['mlp']['w_down'],
                                synthetic['state'].opt_state.mu['mlp']['w_down'])
  for field, value in (('data.global_batch_size', 2 * cfg.data.global_batch_size),
                       ('data.seq_len', 2 * cfg.data.seq_len), ('data.seed', 1),
                       ('model.d_model', 2 * cfg.model.d_model), ('model.yarn.enabled', True)):
    wrong = repro_cfg(20, {'model.num_kv_heads': 2, 'model.num_layers': 2,
                           'model.layer_pattern': 'SF', field: value})
    with pytest.raises(occ.OlmoCoreCheckpointError, match=rf'{field.rsplit(".", 1)[0]}'):
      occ.import_step(synthetic['export'], str(tmp_path / 'bad'), base=wrong)
    assert not os.path.exists(tmp_path / 'bad')
  # The command line: one line naming the field, exit 1, nothing written.
  done = subprocess.run(
      [sys.executable, 'convert.py', f'--from_olmo_core={synthetic["export"]}',
       f'--to={tmp_path / "cli"}', '--config=configs/tiny_repro.py', '--config.data.seed=5'],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=600)
  assert done.returncode == errors.EXIT_USAGE
  assert 'convert.py: error: --config does not describe' in done.stderr
  assert 'data.seed=5' in done.stderr and not os.path.exists(tmp_path / 'cli')


@pytest.fixture(scope='module')
def yarn_config():
  """OLMo-core's own config.json model section of a stage-3 model (YaRN, full layers only)."""
  from olmo_core.nn.rope import YaRNRoPEScalingConfig
  cfg = repro_cfg(20, {'model.num_layers': 8})  # SSSF SSSF: YaRN on layers 3 and 7
  scaling = YaRNRoPEScalingConfig(factor=4.0, beta_fast=16, beta_slow=2, old_context_len=32)
  oc = repro_model_config(cfg, 0).with_rope_scaling(scaling)
  return cfg, scaling, json.loads(json.dumps(oc.as_config_dict()))


def test_yarn_config_translates_and_matches_olmo_core_frequencies(yarn_config):
  import torch
  from olmo_core.nn.rope import compute_inv_freqs
  import model
  cfg, scaling, mc = yarn_config
  ours = ocfg.config_from_olmo_core({'model': mc}, []).model
  y = ours.yarn
  assert y.enabled and (y.factor, y.beta_fast, y.beta_slow, y.original_max_position) == (
      4.0, 16.0, 2.0, 32)
  assert ours.layer_pattern == 'SSSF'
  inv, factor = model.rope_frequencies(ours, full_layer=True)
  ref, ref_factor = scaling.compute_scaled_inv_freq(500_000, ours.head_dim, torch.device('cpu'))
  np.testing.assert_allclose(inv, ref.numpy(), rtol=1e-6)
  assert factor == pytest.approx(ref_factor)
  plain, one = model.rope_frequencies(ours, full_layer=False)  # sliding layers: no YaRN
  np.testing.assert_allclose(plain, compute_inv_freqs(500_000, ours.head_dim, 'cpu').numpy(),
                             rtol=1e-6)
  assert one == 1.0
  # Older OLMo-core named the block's sequence_mixer `attention`: the same model.
  old = json.loads(json.dumps(mc).replace('"sequence_mixer"', '"attention"'))
  assert ocfg.config_from_olmo_core({'model': old}, []).model.to_dict() == ours.to_dict()
  del old['block']['attention']
  with pytest.raises(occ.OlmoCoreCheckpointError, match='no attention settings'):
    ocfg.config_from_olmo_core({'model': old}, [])
  # The export writes it back the way with_rope_scaling does.
  cfg.model.yarn = ours.yarn
  again = ocfg.config_from_olmo_core(ocfg.olmo_core_config(cfg), []).model
  assert again.yarn.to_dict() == ours.yarn.to_dict()


def test_yarn_that_model_py_cannot_express_is_refused(yarn_config):
  _, _, mc = yarn_config
  everywhere = json.loads(json.dumps(mc))
  everywhere['block']['sequence_mixer']['rope']['scaling'] = \
      mc['block_overrides']['3']['sequence_mixer']['rope']['scaling']
  with pytest.raises(occ.OlmoCoreCheckpointError, match='full-attention layers'):
    ocfg.config_from_olmo_core({'model': everywhere}, [])
  other = json.loads(json.dumps(mc))
  for block in other['block_overrides'].values():
    block['sequence_mixer']['rope']['scaling'] = {
        '_CLASS_': 'olmo_core.nn.rope.PIRoPEScalingConfig', 'factor': 2.0}
  with pytest.raises(occ.OlmoCoreCheckpointError, match='only one YaRN'):
    ocfg.config_from_olmo_core({'model': other}, [])
  wider = json.loads(json.dumps(mc))
  wider['block_overrides']['3']['feed_forward']['hidden_size'] = 999
  with pytest.raises(occ.OlmoCoreCheckpointError, match=r'block_overrides\[3\]'):
    ocfg.config_from_olmo_core({'model': wider}, [])


# --- Interop: the workdir, the run's own config values, the data position at an epoch's end ---


def _convert_cli(*args) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, os.path.join(REPO, 'convert.py'), *map(str, args)],
                        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True,
                        text=True, timeout=600)


def _loaded_config(config_arg: str):
  """`--config=<config_arg>` parsed as train.py's flag parses it (ml_collections config_flags)."""
  from absl import flags
  from ml_collections import config_flags
  values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, flag_values=values)
  values(['train.py', f'--config={config_arg}'])
  return values.config


def test_to_is_a_train_py_workdir_and_the_translated_config_loads(synthetic, tmp_path):
  """convert.py --to=W puts the step where `train.py --workdir=W` looks (W/checkpoints), and
  the config it translated loads as train.py's --config=configs/from_checkpoint.py:W."""
  import convert
  work = tmp_path / 'run'
  done = _convert_cli(f'--from_olmo_core={synthetic["export"]}', f'--to={work}')
  assert done.returncode == 0, done.stderr[-3000:]
  assert os.listdir(work) == ['checkpoints']
  assert checkpoint.committed_steps(str(work / 'checkpoints')) == [5]
  assert f'python train.py --workdir={work} --config=configs/from_checkpoint.py:{work}' in \
      done.stdout
  stored = checkpoint.read_metadata(str(work / 'checkpoints'))['config']
  loaded = _loaded_config(f'{REPO}/configs/from_checkpoint.py:{work}')
  assert isinstance(loaded.data.paths, tuple) and loaded.data.paths  # types kept for overrides
  assert json.loads(json.dumps(loaded.to_dict())) == stored
  # A workdir's checkpoint directory named directly is that directory.
  assert convert.run_checkpoint_dir(str(work / 'checkpoints')) == str(work / 'checkpoints')
  # A --to that is itself a checkpoint directory is refused, in one line, nothing written.
  done = _convert_cli(f'--from_olmo_core={synthetic["export"]}', f'--to={synthetic["ckpt"]}')
  assert done.returncode == errors.EXIT_USAGE
  assert 'convert.py: error: --to=' in done.stderr and 'holds checkpoints itself' in done.stderr
  assert sorted(os.listdir(synthetic['ckpt'])) == ['step_5']


@pytest.mark.slow
def test_train_py_resumes_the_translated_config(synthetic, tmp_path):
  work = tmp_path / 'run'
  done = _convert_cli(f'--from_olmo_core={synthetic["export"]}', f'--to={work}')
  assert done.returncode == 0, done.stderr[-3000:]
  # The synthetic state is random (unit-variance weights): no loss bound stops it.
  records = _train_py(os.path.join(REPO, 'configs', f'from_checkpoint.py:{work}'), work,
                      {'train.steps': 6, 'train.max_loss': 1e9})
  assert sorted(records) == [6]  # resumed at step 5, not restarted


def _olmo_core_train_module(cfg, **changes) -> dict:
  """config.json's train_module section as OLMo-core's own config classes write it."""
  from olmo_core.optim import CosWithWarmup, SkipStepAdamWConfig
  from olmo_core.train.train_module import TransformerTrainModuleConfig
  o, T = cfg.opt, cfg.data.seq_len
  module = TransformerTrainModuleConfig(**{
      'rank_microbatch_size': cfg.data.global_batch_size * T, 'max_sequence_length': T,
      'optim': SkipStepAdamWConfig(lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                                   weight_decay=o.weight_decay,
                                   rolling_interval_length=o.skip_window,
                                   sigma_factor=int(o.skip_sigma)),
      'max_grad_norm': o.clip_grad_norm, 'z_loss_multiplier': o.z_loss,
      'scheduler': CosWithWarmup(warmup=o.warmup_steps, alpha_f=o.final_lr / o.lr,
                                 t_max=o.t_max), **changes})
  return json.loads(json.dumps(module.as_config_dict()))


@pytest.mark.parametrize('dp, autocast, want', [
    (None, None, ('float32', 'float32')),  # one GPU, no mixed precision
    (('fsdp', 'bfloat16'), None, ('float32', 'bfloat16')),  # float32 master weights
    (('hsdp', 'bfloat16'), None, ('float32', 'bfloat16')),  # Olmo 3 7B's
    (('ddp', 'bfloat16'), None, ('bfloat16', 'bfloat16')),  # DDP casts the model itself
    (None, 'bfloat16', ('float32', 'bfloat16')),  # torch autocast
])
def test_the_runs_compute_dtype_translates(synthetic, dp, autocast, want):
  from olmo_core.config import DType
  from olmo_core.distributed.parallel import DataParallelType
  from olmo_core.train.train_module import TransformerDataParallelConfig
  cfg = synthetic['cfg']
  changes = {}
  if dp:
    changes['dp_config'] = TransformerDataParallelConfig(name=DataParallelType(dp[0]),
                                                         param_dtype=DType(dp[1]))
  if autocast:
    changes['autocast_precision'] = DType(autocast)
  oc = {'model': json.loads(json.dumps(repro_model_config(cfg, 0).as_config_dict())),
        'train_module': _olmo_core_train_module(cfg, **changes)}
  ours = ocfg.config_from_olmo_core(oc, []).model
  assert (ours.param_dtype, ours.dtype) == want


def test_config_warnings_name_where_the_runs_value_was_read(synthetic, tmp_path, caplog):
  """A value config.json sets is compared with --config's and named with its place; one it
  does not set (train.log_every) is not the OLMo-core run's, so never reported as such."""
  import shutil
  cfg = synthetic['cfg']
  src = str(tmp_path / 'step5')
  shutil.copytree(synthetic['export'], src)
  with open(os.path.join(src, 'config.json')) as f:
    oc = json.load(f)
  oc['train_module'] = _olmo_core_train_module(cfg, rank_microbatch_size=2 * cfg.data.seq_len)
  with open(os.path.join(src, 'config.json'), 'w') as f:
    json.dump(oc, f)
  mine = repro_cfg(20, {'model.num_kv_heads': 2, 'model.num_layers': 2,
                        'model.layer_pattern': 'SF', 'train.micro_batch_size': 4,
                        'train.log_every': 3})
  with caplog.at_level('WARNING'):
    occ.import_step(src, str(tmp_path / 'ours'), base=mine)
  assert ('--config has train.micro_batch_size=4; the OLMo-core run has 2 (config.json '
          'train_module.rank_microbatch_size') in caplog.text
  assert 'log_every' not in caplog.text


def test_data_paths_txt_reads_whole_in_a_shell_loop(synthetic):
  files = [p for p, _ in checkpoint.read_metadata(synthetic['ckpt'])['data']['files']]
  done = subprocess.run(['bash', '-c', 'while read -r p; do echo "$p"; done < data_paths.txt'],
                        cwd=synthetic['export'], capture_output=True, text=True, check=True)
  assert done.stdout.splitlines() == files and files


@pytest.mark.slow
def test_epoch_end_position_continues_on_olmo_core_batches(tmp_path):
  """OLMo-core saves an epoch's last step as (epoch 1, 3 of 3 batches) and opens epoch 2 on
  resume. Converted, it is our (epoch 2, step 0): train.py's loader feeds OLMo-core's own
  continuation's batches, and the export is OLMo-core's record again (OLMo-core continues
  from it on the same batches)."""
  import torch
  cfg = repro_cfg(10)
  B = cfg.data.global_batch_size
  tokens = data.Dataset.from_config(cfg.data).read(np.arange(3 * B + 1))  # 3 batches and 1
  path = str(tmp_path / 'epoch.npy')
  tokens.astype(np.uint32).tofile(path)  # raw uint32, as OLMo-core reads token files
  common = dict(horizon=10, init_seed=7, paths=[path])
  run_olmo_core('first', str(tmp_path / 'first'), stop=3, save_interval=3, **common)
  step_dir = str(tmp_path / 'first' / 'step3')
  cont = run_olmo_core('cont', str(tmp_path / 'cont'), stop=5, save_interval=100,
                       load_path=step_dir, **common)
  theirs = torch.load(os.path.join(step_dir, 'train', 'rank0.pt'), weights_only=False)
  assert (theirs['epoch'], theirs['data_loader']['batches_processed']) == (1, 3)

  ours = str(tmp_path / 'ours')
  occ.import_step(step_dir, ours)
  meta = checkpoint.read_metadata(ours)
  assert (meta['data']['epoch'], meta['data']['step']) == (2, 0)
  import ml_collections
  run = ml_collections.ConfigDict(meta['config'])
  ds = data.Dataset.from_config(run.data)
  with data.Loader.from_config(run.data, ds, state=meta['data'], step=meta['step'],
                               cache_dir=str(tmp_path / 'cache')) as loader:
    for s in (4, 5):  # what train.py feeds after step 3
      np.testing.assert_array_equal(next(loader)['tokens'], cont['inputs'][s])

  export = str(tmp_path / 'export' / 'step3')
  os.makedirs(os.path.dirname(export))
  occ.export_step(ours, export)
  again = torch.load(os.path.join(export, 'train', 'rank0.pt'), weights_only=False)
  for key in ('epoch', 'batches_processed', 'tokens_processed', 'seed', 'dataset_fingerprint'):
    assert again['data_loader'][key] == theirs['data_loader'][key], key
  assert (again['epoch'], again['global_step']) == (theirs['epoch'], theirs['global_step'])
  resumed = run_olmo_core('from_export', str(tmp_path / 'from_export'), stop=5,
                          save_interval=100, load_path=export, **common)
  for s in (4, 5):
    np.testing.assert_array_equal(resumed['inputs'][s], cont['inputs'][s])
