"""Tests for train.py: bit-exact resume, resharded resume, corrupt checkpoints, accumulation.

A tiny Olmo 3 (configs/small.py shrunk: 2 layers, one sliding and one full,
d_model 64, seq 64, global batch 16, vocab 256) trains on the embedded corpus
folded into 256 ids. The reference for every resume test is one uninterrupted
run (module fixture `reference`); stops are made by real signals: SIGTERM
delivered to the trainer, and SIGKILL to a train.py subprocess. The loss and
z-loss are checked against a float64 numpy formula over the model's own
logits. Runs on the 8 simulated CPU devices of tests/conftest.py;
subprocesses get their device count through XLA_FLAGS.

Shapes: B batch, T time, V vocab.
"""

import json
import logging
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
from configs import small
import data
import errors
import model
from monitor.metrics import wall_clock
import optim
import sharding
from tokens import batches
import train
from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
STEPS, STOP = 8, 3  # the run; the step SIGTERM stops it at (not a ckpt_every multiple)
CKPT_EVERY = 2
VOCAB = 256
# Ai2's W&B names every logged step must carry.
WANDB_NAMES = ('train/CE loss', 'train/Z loss', 'train/PPL', 'optim/LR', 'optim/total grad norm',
               'optim/step skipped', 'throughput/total tokens', 'throughput/device/TPS',
               'throughput/device/MFU')
# Wall-clock fields (the goodput account among them): everything else in a record must
# replay bit for bit.
timed = wall_clock

OVERRIDES = {  # configs/small.py -> tiny; also passed to subprocesses as --config.* flags
    'model.vocab_size': VOCAB, 'model.num_layers': 2, 'model.layer_pattern': 'SF',
    'model.d_model': 64, 'model.num_heads': 2, 'model.num_kv_heads': 1, 'model.head_dim': 32,
    'model.mlp_hidden': 128,
    'model.sliding_window': 16, 'data.vocab_size': VOCAB, 'data.seq_len': 64,
    'data.mix_file': '', 'data.eos_token_id': 0, 'data.pad_token_id': 1,  # data.paths below
    'data.global_batch_size': 16, 'data.validation_batches': 1, 'opt.warmup_steps': 4,
    'train.steps': STEPS, 'train.micro_batch_size': 2, 'train.log_every': 1,
    'train.ckpt_every': CKPT_EVERY, 'train.keep_last': 5, 'train.eval_every': 4,
    'train.peak_flops': 1e11,  # skip measuring the matmul peak in every run
    'train.downstream_eval_every': 0,  # tested in test_in_loop_eval.py; here only a cost
}


@pytest.fixture(scope='module')
def token_files(tmp_path_factory) -> tuple[str, str]:
  """Train / validation uint32 .npy token files: the embedded corpus folded into VOCAB ids."""
  tokens = np.fromfile(REPO / 'data' / 'shakespeare-train-00000.npy', '<u4', 64 * 16 * 12)
  folded = (tokens % VOCAB).astype(np.uint32)
  root = tmp_path_factory.mktemp('tokens')
  paths = str(root / 'train.npy'), str(root / 'validation.npy')
  np.save(paths[0], folded[:64 * 16 * 10])
  np.save(paths[1], folded[64 * 16 * 10:])
  return paths


def tiny_config(token_files, **changes):
  cfg = small.get_config()
  for key, value in {**OVERRIDES, **changes}.items():
    group, field = key.split('.')
    cfg[group][field] = value
  cfg.data.paths, cfg.data.validation_paths = (token_files[0],), (token_files[1],)
  return cfg


def config_flags(token_files) -> list[str]:
  flags = [f'--config.{k}={v}' for k, v in OVERRIDES.items()]
  return flags + [f'--config.data.paths=("{token_files[0]}",)',
                  f'--config.data.validation_paths=("{token_files[1]}",)']


def read_metrics(workdir) -> dict[int, dict[str, float]]:
  """metrics.jsonl as {step: all fields logged at that step}; duplicates are an error."""
  out: dict[int, dict[str, float]] = {}
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    for line in f:
      record = json.loads(line)
      step = record.pop('step')
      assert not set(record) & set(out.get(step, {})), f'step {step} logged twice'
      out.setdefault(step, {}).update(record)
  return out


def replayed(metrics: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
  untimed = {s: {k: v for k, v in r.items() if not timed(k)} for s, r in metrics.items()}
  return {s: r for s, r in untimed.items() if r}  # a step that logged only goodput: none


def host_state(cfg, workdir, step: int):
  """The checkpointed TrainState of `step` as numpy arrays (no devices involved)."""
  tx = optim.make_optimizer(cfg.opt)

  def init():
    params = model.init_params(cfg.model, jax.random.key(0))
    return train.TrainState(params, tx.init(params))
  target = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), jax.eval_shape(init))
  state, _ = checkpoint.restore(os.path.join(workdir, 'checkpoints'), target, step)
  return state


def assert_states_equal(a, b) -> None:
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert np.array_equal(x, y), jax.tree_util.keystr(path)


def child_command(workdir, token_files, *flags: str, devices: int, steps: int = STEPS,
                  hang_at: int | None = None, release: pathlib.Path | None = None,
                  settle_saves_at: int | None = None, max_file_bytes: int | None = None
                  ) -> tuple[list[str], dict[str, str]]:
  """train.py's own CLI in a fresh process, with hooks into fetching batch i and its files.

  `hang_at`: block fetching that batch until `release` exists (forever without).
  `settle_saves_at`: before returning that batch, wait until no checkpoint save
  is in flight, so the step it feeds is the first to see how the save ended.
  `max_file_bytes`: the largest file the process may write (writes beyond fail
  with EFBIG, as they would with ENOSPC on a full disk).
  """
  limit = ('signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n'  # EFBIG, not a kill
           f'resource.setrlimit(resource.RLIMIT_FSIZE, ({max_file_bytes}, {max_file_bytes}))\n'
           if max_file_bytes else '')
  script = ('import os, resource, signal, sys, threading, time\n' + limit +
            f'sys.path.insert(0, {str(REPO)!r})\n'
            'import data, train\n'
            f'hang_at, release, settle_at = {hang_at!r}, {release and str(release)!r}, '
            f'{settle_saves_at!r}\n'
            'fetch = data.Loader.__next__\n'
            'def hooked_next(self):\n'
            '  while self.step == hang_at and not (release and os.path.exists(release)):\n'
            '    time.sleep(0.1)\n'
            '  while self.step == settle_at and any(t.name.startswith("checkpoint-save") '
            'and t.is_alive() for t in threading.enumerate()):\n'
            '    time.sleep(0.01)\n'
            '  return fetch(self)\n'
            'data.Loader.__next__ = hooked_next\n'
            'train.run()\n')
  argv = [sys.executable, '-c', script, f'--workdir={workdir}', '--sample_tokens=0',
          *config_flags(token_files), f'--config.train.steps={steps}', *flags]
  env = dict(os.environ, XLA_FLAGS=with_devices(devices))
  return argv, env


@pytest.fixture(scope='module')
def reference(token_files, tmp_path_factory):
  """One uninterrupted 8-device run of STEPS steps: (workdir, metrics, final state)."""
  workdir = tmp_path_factory.mktemp('reference')
  cfg = tiny_config(token_files)
  train.train(cfg, str(workdir))
  return workdir, read_metrics(workdir), host_state(cfg, workdir, STEPS)


@pytest.mark.parametrize('document_masking', [False, True])
def test_the_train_step_is_traced_once(token_files, tmp_path, document_masking):
  """Compiled ahead on a thread from sharding.abstract_batch (goodput.compile_ahead): the
  loop's first call must find that executable, not trace the step again for the real
  batch (whose keys, dtypes or shardings would then differ from the abstract one). The
  held-out evaluation's step likewise (batches.abstract_global_batch), at the last step."""
  traces = {'train_step': [], 'eval_step': []}

  def listen(event, duration, fun_name='', **kwargs):
    if event.endswith('jaxpr_trace_duration') and fun_name in traces:
      traces[fun_name].append(threading.current_thread().name)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    train.train(tiny_config(token_files, **{'train.steps': 2, 'data.document_masking':
                                            document_masking}), str(tmp_path))
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  metrics = read_metrics(tmp_path)
  assert metrics.keys() >= {1, 2} and 'eval/lm/validation/CE loss' in metrics[2]
  assert traces == {'train_step': ['compile ahead'], 'eval_step': ['compile ahead']}


def test_the_init_compiled_without_constant_folding_is_the_plain_init(token_files):
  """create_state compiles the init with train.INIT_COMPILE (XLA's constant folding off: most
  of its compile on a TPU); the state must equal a plain jit of model.init_params."""
  cfg = tiny_config(token_files)
  tx = optim.make_optimizer(cfg.opt)
  state, _ = train.create_state(cfg, tx, sharding.make_mesh(cfg.train), jax.random.key(3))
  plain = jax.jit(lambda rng: model.init_params(cfg.model, rng))(jax.random.key(3))
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain), strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert all(not np.asarray(m).any() for m in jax.tree.leaves(state.opt_state.mu))


def test_logged_names_and_files(reference):
  workdir, metrics, _ = reference
  assert sorted(metrics) == list(range(1, STEPS + 1))
  for step, record in metrics.items():
    assert set(WANDB_NAMES) <= set(record), step
    assert record['throughput/total tokens'] == step * 16 * 64
    assert record['train/PPL'] == pytest.approx(np.exp(record['train/CE loss']), rel=1e-6)
  assert 'eval/lm/validation/CE loss' in metrics[4] and 'eval/lm/validation/CE loss' in metrics[8]
  assert metrics[STEPS]['train/CE loss'] < metrics[1]['train/CE loss']  # it learns
  assert committed(workdir) == [2, 4, 6, 8]

  events = read_events(workdir / 'tensorboard')
  for step, record in metrics.items():  # same names and (float32-rounded) values
    for name, value in record.items():
      assert events[step][name] == pytest.approx(value, rel=1e-6, abs=1e-30), (step, name)


def committed(workdir) -> list[int]:
  return checkpoint.committed_steps(os.path.join(workdir, 'checkpoints'))


def read_events(logdir) -> dict[int, dict[str, float | str]]:
  """Scalars and texts of every TensorBoard event file, read with tensorboardX's protos.

  test_events.parse checks each record's framing and both CRCs. A SessionLog
  START at step s discards earlier-written events with step >= s, as
  TensorBoard does on load.
  """
  from tensorboardX.proto import event_pb2
  from test_events import parse
  scalars: dict[int, dict[str, float | str]] = {}
  files = sorted(pathlib.Path(logdir).glob('events.out.tfevents.*'))
  assert files, f'no event file in {logdir}'
  for event in (e for path in files for e in parse(path)):
    if event.session_log.status == event_pb2.SessionLog.START:
      scalars = {s: v for s, v in scalars.items() if s < event.step}
    for value in event.summary.value:  # a text summary's value is its string
      scalars.setdefault(event.step, {})[value.tag] = (
          value.tensor.string_val[0].decode() if value.tensor.string_val
          else value.simple_value)
  return scalars


def test_sigterm_finishes_step_checkpoints_and_resumes_bit_exact(reference, token_files,
                                                                 tmp_path, monkeypatch):
  ref_dir, ref_metrics, ref_state = reference
  cfg = tiny_config(token_files)
  fetch, handler = data.Loader.__next__, signal.getsignal(signal.SIGTERM)

  def next_then_term(loader):
    batch = fetch(loader)
    if loader.step == STOP:  # the batch of step STOP was just taken
      os.kill(os.getpid(), signal.SIGTERM)
    return batch
  monkeypatch.setattr(data.Loader, '__next__', next_then_term)
  with pytest.raises(SystemExit) as exit_info:
    train.train(cfg, str(tmp_path))
  assert exit_info.value.code == errors.EXIT_PREEMPTED
  assert signal.getsignal(signal.SIGTERM) is handler  # put back
  assert committed(tmp_path) == [2, STOP]  # the step in flight finished and was saved
  monkeypatch.undo()

  train.train(cfg, str(tmp_path))
  assert replayed(read_metrics(tmp_path)) == replayed(ref_metrics)
  assert_states_equal(host_state(cfg, tmp_path, STEPS), ref_state)
  events = read_events(tmp_path / 'tensorboard')
  assert sorted(events) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_sigkill_after_checkpoint_resumes_bit_exact(reference, token_files, tmp_path):
  """train.py killed with SIGKILL in step 6 (checkpoint 4 committed, step 5 logged)."""
  _, ref_metrics, ref_state = reference
  argv, env = child_command(tmp_path, token_files, devices=8, hang_at=5)
  proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 300
    while not (os.path.exists(tmp_path / 'checkpoints' / 'step_4' / 'COMMIT')
               and logged_steps(tmp_path) >= 5):
      assert proc.poll() is None, proc.stdout.read()
      assert time.time() < deadline, 'the child never reached step 5'
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert committed(tmp_path) == [2, 4]

  cfg = tiny_config(token_files)
  train.train(cfg, str(tmp_path))  # step 5's first record is replaced, not duplicated
  assert replayed(read_metrics(tmp_path)) == replayed(ref_metrics)
  assert_states_equal(host_state(cfg, tmp_path, STEPS), ref_state)
  assert sorted(read_events(tmp_path / 'tensorboard')) == list(range(1, STEPS + 1))


def logged_steps(workdir) -> int:
  try:
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      return max([json.loads(line)['step'] for line in f if line.endswith('\n')], default=0)
  except FileNotFoundError:
    return 0


@pytest.mark.slow
def test_resume_on_fewer_devices_same_global_batch(reference, token_files, tmp_path):
  """Checkpoint 4 of the 8-device run resumed on 2 and on 1 device (new processes).

  The global batch stays 16 (2 -> 8 and 16 instances per device, so 4 and 8
  micro-batches instead of 1); only the float32 reduction order changes
  (FSDP partial sums, micro-batch accumulation), each a relative rounding of
  ~6e-8 (one ulp). Measured over steps 5-8: at most 1.0e-7 apart. AdamW can
  amplify such noise where a gradient is near zero, so rel=1e-5 (~100 ulps)
  leaves headroom while any real difference (another batch, a lost or doubled
  micro-batch) moves these by 1e-3 or more.
  """
  ref_dir, ref_metrics, _ = reference
  procs = {}
  for devices in (2, 1):
    workdir = tmp_path / f'devices{devices}'
    shutil.copytree(ref_dir / 'checkpoints' / 'step_4', workdir / 'checkpoints' / 'step_4')
    argv, env = child_command(workdir, token_files, devices=devices)
    procs[devices] = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
  for devices, proc in procs.items():
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert f'on {devices} devices' in out and f'{8 // devices} micro-batches/step' in out
    metrics = read_metrics(tmp_path / f'devices{devices}')
    assert sorted(metrics) == list(range(5, STEPS + 1))
    for step in range(5, STEPS + 1):
      got, want = metrics[step], ref_metrics[step]
      assert got['throughput/total tokens'] == want['throughput/total tokens']
      for name in ('train/CE loss', 'train/Z loss', 'optim/total grad norm'):
        assert got[name] == pytest.approx(want[name], rel=1e-5), (devices, step, name)
      assert got['optim/LR'] == want['optim/LR']


def test_corrupt_and_truncated_checkpoints_fall_back_with_a_warning(
    reference, token_files, tmp_path, caplog):
  ref_dir, ref_metrics, ref_state = reference
  shutil.copytree(ref_dir / 'checkpoints', tmp_path / 'checkpoints')
  ckpts = tmp_path / 'checkpoints'
  flipped = chunk_files(ckpts / 'step_8' / 'arrays' / 'params' / 'embed' / 'embedding')[0]
  raw = bytearray(flipped.read_bytes())
  raw[len(raw) // 2] ^= 0x01  # one bit of one weight
  flipped.write_bytes(bytes(raw))
  cut = chunk_files(ckpts / 'step_6' / 'arrays' / 'opt_state' / 'mu' / 'mlp' / 'w_up')[0]
  cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])

  cfg = tiny_config(token_files)
  with caplog.at_level(logging.WARNING):
    train.train(cfg, str(tmp_path))
  warned = [r.getMessage() for r in caplog.records if 'corrupt' in r.getMessage()]
  assert any('step 8' in w for w in warned) and any('step 6' in w for w in warned), warned
  assert sorted(p.name.split('.')[1] for p in ckpts.glob('corrupt.*')) == ['step_6', 'step_8']
  metrics = replayed(read_metrics(tmp_path))  # resumed from step 4 and replayed 5..8
  assert metrics == {s: r for s, r in replayed(ref_metrics).items() if s > 4}
  assert_states_equal(host_state(cfg, tmp_path, STEPS), ref_state)


def chunk_files(array_dir: pathlib.Path) -> list[pathlib.Path]:
  """The zarr3 chunk files (c/i/j) under an array's directory."""
  return sorted(p for p in array_dir.rglob('*')
                if p.is_file() and 'c' in p.relative_to(array_dir).parts)


def test_only_corrupt_checkpoints_stop_the_run(reference, token_files, tmp_path):
  ref_dir, _, _ = reference
  ckpts = tmp_path / 'checkpoints'
  shutil.copytree(ref_dir / 'checkpoints' / 'step_2', ckpts / 'step_2')
  for chunk in chunk_files(ckpts / 'step_2' / 'arrays' / 'params'):
    chunk.write_bytes(b'')
  cfg = tiny_config(token_files)
  with pytest.raises(checkpoint.CorruptCheckpointError, match='No intact checkpoint'):
    train.train(cfg, str(tmp_path))
  with pytest.raises(errors.UserError, match='only corrupt checkpoints'):  # the relaunch
    train.train(cfg, str(tmp_path))
  assert not (tmp_path / 'metrics.jsonl').exists() or not read_metrics(tmp_path)


def float64_losses(cfg, params, batch) -> tuple[float, float]:
  """(CE, z-loss) of the global batch by the §5 formula, in float64 numpy."""
  logits_BTV = np.asarray(model.logits(params, jnp.asarray(batch['tokens']), cfg.model),
                          np.float64)
  lse_BT = np.log(np.sum(np.exp(logits_BTV - logits_BTV.max(-1, keepdims=True)), -1)) + \
      logits_BTV.max(-1)
  labels_BT = batch['labels']
  valid_BT = (labels_BT != -100) & batch['instance_mask'][:, None]
  target_BT = np.take_along_axis(logits_BTV, np.maximum(labels_BT, 0)[..., None], -1)[..., 0]
  # OLMo-core's train module: kept instances' labels, plus T per rejected instance.
  mask_B = batch['instance_mask']
  denominator = np.sum((labels_BT != -100) & mask_B[:, None]) + np.sum(~mask_B) * labels_BT.shape[1]
  ce = np.sum(np.where(valid_BT, lse_BT - target_BT, 0)) / denominator
  z = cfg.opt.z_loss * np.sum(np.where(valid_BT, lse_BT ** 2, 0)) / denominator
  return ce, z


def test_grad_accumulation_matches_one_big_batch(token_files):
  """1, 2 and 4 micro-batches per device (2 devices, global batch 16) give one update."""
  cfg = tiny_config(token_files)
  mesh = sharding.make_mesh(cfg.train, jax.devices()[:2])
  state, shardings = train.create_state(cfg, optim.make_optimizer(cfg.opt), mesh,
                                        jax.random.key(1))
  rng = np.random.default_rng(0)
  batch = batches.make_batch(rng.integers(0, VOCAB, (16, 64), dtype=np.int32), eos_token_id=0)
  batch['instance_mask'][5] = False  # a rejected instance: out of the sums, T in the count
  batch['labels'][3, 10:20] = -100
  rows = sharding.batch_sharding(mesh)
  on_mesh = batches.make_global_batch(batch, rows, np.arange(16), 16)

  results = {}
  tx = optim.make_optimizer(cfg.opt)
  for micro in (8, 4, 2):
    accum = batches.grad_accum_steps(16, batches.num_batch_shards(rows, 16, 64), micro)
    step = jax.jit(train.make_train_step(cfg, tx, mesh, accum), out_shardings=(shardings, None))
    results[accum] = jax.device_get(step(state, on_mesh))
  assert sorted(results) == [1, 2, 4]

  ce, z = float64_losses(cfg, jax.device_get(state.params), batch)
  (new1, m1) = results[1]
  assert m1['train/CE loss'] == pytest.approx(ce, rel=2e-6)
  assert m1['train/Z loss'] == pytest.approx(z, rel=2e-5)
  for accum in (2, 4):
    new, m = results[accum]
    for name in ('train/CE loss', 'train/Z loss', 'optim/total grad norm'):
      assert m[name] == pytest.approx(m1[name], rel=2e-6), (accum, name)
    # mu = (1 - b1) * clipped grad: the accumulated gradient itself. Summing 4
    # partial gradients instead of one matmul is float32 rounding, ~1e-7 of
    # the largest entry.
    for (path, g), g1 in zip(jax.tree_util.tree_leaves_with_path(new.opt_state.mu),
                             jax.tree.leaves(new1.opt_state.mu)):
      np.testing.assert_allclose(g, g1, rtol=1e-5, atol=1e-6 * np.abs(g1).max(),
                                 err_msg=jax.tree_util.keystr(path))
    # Adam's first step moves each weight by lr * g / (|g| + eps) ~ lr * sign(g),
    # so rounding shows only where |g| is within ~100 eps of zero: a handful of
    # weights may move differently (by < 2 lr); all others agree to 1e-2 lr
    # (the rest is the last bit of p + update).
    lr = float(m1['optim/LR'])
    for (path, p), p1 in zip(jax.tree_util.tree_leaves_with_path(new.params),
                             jax.tree.leaves(new1.params)):
      diff = np.abs(p - p1)
      assert diff.max() <= 2 * lr and np.mean(diff > 1e-2 * lr) < 1e-3, \
          jax.tree_util.keystr(path)


@pytest.mark.parametrize('changes, error, match', [
    ({'train.mesh_data': 3}, ValueError, 'does not fit 8 devices'),
    ({'train.mesh_tensor': 16}, ValueError, 'does not fit 8 devices'),
    ({'data.global_batch_size': 12}, ValueError, 'not divisible by the 8 devices'),
    ({'train.micro_batch_size': 3}, ValueError, 'not a multiple of micro_batch_size 3'),
    ({'model.remat': 'most'}, ValueError, "remat='most' is not one of"),
    ({'train.steps': 0}, ValueError, 'train.steps'),
    ({'data.vocab_size': VOCAB + 1}, ValueError, 'exceeds model.vocab_size'),
])
def test_bad_config_is_a_clear_error(token_files, tmp_path, changes, error, match):
  with pytest.raises(error, match=match):
    train.train(tiny_config(token_files, **changes), str(tmp_path))


def _run_7b(tmp_path, *flags, devices=1):
  """train.py on the 7B config as a user types it; (returncode, stderr, seconds, peak RSS GiB)."""
  env = {**os.environ, 'XLA_FLAGS': with_devices(devices)}
  script = ('import resource, subprocess, sys, time; t = time.time(); '
            'p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=240); '
            'rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20; '
            'print(p.returncode, time.time() - t, rss); sys.stderr.write(p.stderr)')
  proc = subprocess.run([sys.executable, '-c', script, sys.executable, 'train.py',
                         '--config=configs/olmo3_7b.py', f'--workdir={tmp_path / "run"}',
                         *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  rc, seconds, rss_gib = proc.stdout.split()
  return int(rc), proc.stderr, float(seconds), float(rss_gib)


def test_7b_without_data_fails_in_seconds_naming_the_setting(tmp_path):
  rc, err, seconds, rss = _run_7b(tmp_path)
  assert rc != 0
  assert 'data.mix_file' in err and 'data.paths' in err and 'data.base_dir' in err
  assert seconds < 30 and rss < 2, (seconds, rss)
  assert not (tmp_path / 'run').exists()  # nothing written


def test_7b_that_cannot_fit_fails_before_allocating(tmp_path):
  # Real data, 2 simulated CPU devices: 87.6 GB of params + moments over fsdp 2
  # is 43.8 GB per device, more than this machine's memory (or any laptop's).
  train_file = REPO / 'data' / 'shakespeare-train-00000.npy'
  rc, err, seconds, rss = _run_7b(tmp_path, f'--config.data.paths={train_file}', devices=2)
  assert rc == errors.EXIT_USAGE
  line = error_line(err)
  assert '43.79 GB per device' in line and 'plan.py' in line, err[-2000:]
  assert seconds < 60 and rss < 2, (seconds, rss)


def test_dry_run_points_to_the_planner(tmp_path):
  proc = subprocess.run([sys.executable, 'train.py', '--config=configs/small.py', '--dry_run',
                         f'--workdir={tmp_path}'], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode != 0 and 'python plan.py' in proc.stderr


def test_state_fit_check_uses_the_sharded_bytes(token_files, monkeypatch):
  cfg = tiny_config(token_files)
  mesh = sharding.make_mesh(cfg.train)
  abstract = train.abstract_state(cfg, optim.make_optimizer(cfg.opt))
  params, opt = sharding.state_bytes(abstract, dict(mesh.shape))
  monkeypatch.setattr(sharding, 'device_memory_bytes', lambda: (params + opt, 'test'))
  sharding.check_state_fits(abstract, mesh)  # exactly fits
  monkeypatch.setattr(sharding, 'device_memory_bytes', lambda: (params + opt - 1, 'test'))
  with pytest.raises(errors.ConfigError, match='per device'):
    sharding.check_state_fits(abstract, mesh)


# --- Bad input through the CLI: one line naming the fix, nothing lost -------------------


def run_cli(workdir, token_files, *flags: str, config: str = 'configs/small.py',
            script: str = 'train.py', devices: int = 8) -> subprocess.CompletedProcess:
  """`python train.py --config=... --workdir=...` with the tiny config's overrides."""
  argv = [sys.executable, script, f'--config={config}', *config_flags(token_files), *flags]
  if script == 'train.py':
    argv += [f'--workdir={workdir}', '--sample_tokens=0']
  env = dict(os.environ, XLA_FLAGS=with_devices(devices))
  return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def error_line(stderr: str) -> str:
  """The one `error: ...` line a refused command prints; no traceback."""
  assert 'Traceback' not in stderr, stderr[-3000:]
  lines = [line for line in stderr.splitlines() if line.startswith('error: ')]
  assert len(lines) == 1, stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize('flags, config, script, named', [
    (['--config.train.stpes=5'], 'configs/small.py', 'train.py',
     ["--config.train.stpes: train has no field 'stpes'", 'did you mean --config.train.steps?']),
    (['--config.trian.steps=5'], 'configs/small.py', 'train.py',
     ["no field 'trian'", 'did you mean --config.train?']),
    ([], 'configs/smal.py', 'train.py',
     ['--config=configs/smal.py: no such file', 'did you mean --config=configs/small.py?']),
    (['--config.model.num_layrs=2'], 'configs/small.py', 'plan.py',
     ["model has no field 'num_layrs'", 'did you mean --config.model.num_layers?']),
    ([], 'configs/nothing.py', 'plan.py', ['--config=configs/nothing.py: no such file']),
    (['--config.opt.lr=inf'], 'configs/small.py', 'train.py',
     ['cfg.opt.lr=inf must be a finite number > 0', 'set --config.opt.lr']),
    (['--config.opt.b2=1.0'], 'configs/small.py', 'train.py', ['cfg.opt.b2=1.0 must be in [0, 1)']),
    (['--config.train.max_loss=nan'], 'configs/small.py', 'train.py',
     ['cfg.train.max_loss=nan must be a number > 0', 'set --config.train.max_loss']),
])
def test_cli_mistakes_are_one_line_and_write_nothing(token_files, tmp_path, flags, config,
                                                      script, named):
  proc = run_cli(tmp_path / 'run', token_files, *flags, config=config, script=script)
  assert proc.returncode == errors.EXIT_USAGE
  assert proc.stderr.strip() == error_line(proc.stderr)  # the only output
  for text in named:
    assert text in proc.stderr
  assert not (tmp_path / 'run').exists()


@pytest.fixture
def resumable(reference, tmp_path) -> pathlib.Path:
  """A workdir holding only the reference run's final checkpoint (step STEPS)."""
  ckpts = tmp_path / 'run' / 'checkpoints'
  shutil.copytree(reference[0] / 'checkpoints' / f'step_{STEPS}', ckpts / f'step_{STEPS}')
  return tmp_path / 'run'


@pytest.mark.slow
@pytest.mark.parametrize('flags, rc, named', [
    (['--config.data.seed=1', '--config.model.mlp_hidden=96', '--config.opt.lr=1e-3'],
     errors.EXIT_USAGE, ['error: The checkpoint at step 8 was trained with other settings',
      'data.seed: 34521 -> 1; model.mlp_hidden: 128 -> 96.',
      '--config.train.allow_config_change=True', 'opt.lr: 0.003 -> 0.001']),
    (['--config.train.steps=4'], errors.EXIT_USAGE,
     ["error: train.steps=4 is below the checkpoint's step 8", 'Set --config.train.steps above 8']),
    (['--config.data.seed=1', '--config.train.allow_config_change=True'], 0,
     ['data.seed: 34521 -> 1', 'this run is complete']),
])
def test_resume_with_a_changed_config(resumable, token_files, flags, rc, named):
  """Every changed field is logged; run-defining ones and steps behind the checkpoint refused."""
  ckpts = resumable / 'checkpoints'
  before = {p: p.read_bytes() for p in ckpts.rglob('*') if p.is_file()}
  proc = run_cli(resumable, token_files, *flags)
  assert proc.returncode == rc, proc.stderr[-3000:]
  for text in named:
    assert text in proc.stdout + proc.stderr, proc.stderr[-3000:]
  if rc:
    error_line(proc.stderr)
    assert not (resumable / 'metrics.jsonl').exists()
  assert {p: p.read_bytes() for p in ckpts.rglob('*') if p.is_file()} == before


@pytest.mark.slow
@pytest.mark.parametrize('lr, flags, trip, reason', [
    # The first step at LR 1e10 turns the params into NaN factories: every
    # later step is skipped (max_consecutive_skips, lowered to fit the test).
    (1e10, ['--config.train.max_consecutive_skips=3'], 12,
     'steps 10-12 were all skipped'),
    # LR 30 leaves the loss finite but ~8000 at the next step: caught by the
    # default max_loss alone (the skip rule needs 64 steps of history first).
    (30.0, [], 10, 'the CE loss of step 10 is'),
])
def test_divergence_stops_and_keeps_the_last_healthy_checkpoint(
    reference, resumable, token_files, lr, flags, trip, reason):
  """The healthy reference run resumed at step 8 with a destructive LR, keep_last=2.

  Without the guard the run goes on to step 14, exits 0, and retention keeps
  only steps 12 and 14: the healthy step 8 is gone.
  """
  proc = run_cli(resumable, token_files, f'--config.opt.lr={lr}', '--config.train.steps=14',
                 '--config.train.keep_last=2', '--config.train.rollback_attempts=0', *flags)
  assert proc.returncode == errors.EXIT_DIVERGED, proc.stderr[-3000:]
  message = [line for line in proc.stderr.splitlines() if line.startswith('DIVERGED: ')]
  assert len(message) == 1 and reason in message[0], proc.stderr[-3000:]
  assert f'Stopped at step {trip}' in message[0]
  assert 'The last healthy checkpoint is step 8' in message[0]
  assert f'--config.opt.lr, now {lr:g}' in message[0]

  ckpts = str(resumable / 'checkpoints')
  assert checkpoint.latest_healthy_step(ckpts) == STEPS and committed(resumable)[-1] == trip
  assert STEPS in committed(resumable)
  assert reason in checkpoint.read_metadata(ckpts, trip)['diverged']
  assert_states_equal(host_state(tiny_config(token_files), resumable, STEPS), reference[2])
  final = read_metrics(resumable)[trip]
  assert final['guard/diverged'] == 1.0 and reason in final['guard/reason']
  events = read_events(resumable / 'tensorboard')[trip]
  assert events['guard/diverged'] == 1.0 and reason in events['guard/reason']


@pytest.mark.slow
def test_second_run_on_a_workdir_fails_fast_and_the_first_finishes(reference, token_files,
                                                                   tmp_path):
  _, ref_metrics, ref_state = reference
  workdir, release = tmp_path / 'run', tmp_path / 'release'
  argv, env = child_command(workdir, token_files, devices=8, hang_at=3, release=release)
  first = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.time() + 300
    while logged_steps(workdir) < 3:  # the first run is training, its lock held
      assert first.poll() is None, first.stdout.read()
      assert time.time() < deadline, 'the first run never reached step 3'
      time.sleep(0.2)
    start = time.time()
    second = run_cli(workdir, token_files)
    seconds = time.time() - start
    release.touch()
    out, _ = first.communicate(timeout=300)
  finally:
    first.kill()
  assert second.returncode == errors.EXIT_USAGE and seconds < 60, (seconds, second.stderr[-3000:])
  line = error_line(second.stderr)
  assert f'in use by another training run (host {socket.gethostname()}, PID {first.pid}' in line
  assert 'step' not in second.stdout  # it trained nothing
  assert first.returncode == 0, out[-3000:]
  assert committed(workdir) == [2, 4, 6, 8]
  assert replayed(read_metrics(workdir)) == replayed(ref_metrics)
  assert_states_equal(host_state(tiny_config(token_files), workdir, STEPS), ref_state)


@pytest.mark.slow
def test_failed_background_save_stops_the_next_step(token_files, tmp_path):
  """A 32 KB file-size limit fails the step-2 save (a 64 KB embedding) in the background.

  The hook holds batch 2 until that save has ended, so step 3 is the first to
  poll: the run stops there, where without polling it trained on to step 4
  and learned of the failure only from the next save.
  """
  argv, env = child_command(tmp_path, token_files, '--config.train.eval_every=0', devices=1,
                            settle_saves_at=2, max_file_bytes=32 << 10)
  for name in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'):
    env.pop(name)  # its entries would exceed the limit too
  proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 1, proc.stderr[-3000:]  # restartable: the launcher reruns it
  errors_ = [l for l in proc.stderr.splitlines() if l.startswith('error: ')]  # one line, no stack
  assert len(errors_) == 1 and 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert errors_[0].startswith('error: Checkpoint save of step 2') and 'File too large' in errors_[0]
  assert 'CheckpointSaveError' in (tmp_path / 'error.log').read_text()  # the stack went here
  assert logged_steps(tmp_path) == 2 and committed(tmp_path) == []
