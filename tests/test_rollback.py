"""Tests for automatic rollback (monitor/rollback.py, issue 28): a run that heals itself.

The tiny model of tests/test_train.py trains on the embedded corpus folded
into 250 ids; the token files are poisoned with two ids the corpus never
holds, planted in chosen global batches. A wrapper around loss.sums (as
tests/test_launch.py plants its NaN) makes a micro-batch whose labels hold
NAN_ID score NaN (the step is skipped: an unhealthy checkpoint) and one with
SPIKE_ID score 100x its CE (far past train.max_loss: the guard trips), with
the gradient of the real loss. Batch 4 holds NAN_ID and batch 5 SPIKE_ID:
step 5 is skipped, step 6 trips. A state is judged by the step after it (the
first loss computed from its params): state 4 by the skipped step 5, state 5
by the tripping step 6, so the last healthy checkpoint is step 3, and with
rollback_margin=1 the window is global batches [3, 7): those steps 4-6 read,
plus one.

The independent facts: a run told from its start to skip [4, 7)
(train.skip_batches), which never reads a poisoned batch; the LR schedule
itself; and data.Loader without skips.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import checkpoint
import data
import errors
import loss
from monitor import rollback
import optim
from script_module import load_script
from servers import gcs_server, server_log  # noqa: F401  (a fixture)
from store import storage
import train
from test_train import (assert_states_equal, committed, config_flags, host_state,
                        read_metrics, tiny_config)
from xla_flags import with_devices

REPO = pathlib.Path(__file__).resolve().parents[1]
NAN_ID, SPIKE_ID = 254, 255
STEPS = 10
POISON = {4: NAN_ID, 5: SPIKE_ID}  # global batch -> the id planted in its first instance
WINDOW = [3, 7]
RUN = {'train.steps': STEPS, 'train.ckpt_every': 1, 'train.keep_last': 20,
       'train.eval_every': 0, 'train.rollback_margin': 1}
LR = {'train.rollback_lr_factor': 0.5, 'train.rollback_lr_steps': 2}

POISON_CODE = f'''
import jax
import jax.numpy as jnp
import loss
_sums = loss.sums
def poisoned_sums(h_BTD, w_DV, labels_BT, mask_B, **kw):
  nan, spike = jnp.any(labels_BT == {NAN_ID}), jnp.any(labels_BT == {SPIKE_ID})
  clean = jnp.where(labels_BT >= {NAN_ID}, loss.IGNORE_INDEX, labels_BT)
  ce, z = _sums(h_BTD, w_DV, clean, mask_B, **kw)
  # 100x the CE, with the gradient of 1x: a destructive step the guard sees.
  ce = jnp.where(spike, ce + jax.lax.stop_gradient(99 * ce), ce)
  return jnp.where(nan, jnp.nan, ce), z
'''
INSTALL_POISON = 'loss.sums = poisoned_sums\n'  # the children's; in-process: monkeypatch


@pytest.fixture(scope='module')
def poisoned_files(tmp_path_factory) -> tuple[str, str]:
  """20 batches of 16 x 64 tokens (ids < 250), batches 4 and 5 poisoned; a validation file."""
  tokens = np.fromfile(REPO / 'data' / 'shakespeare-train-00000.npy', '<u4', 64 * 16 * 22)
  folded = (tokens % 250).astype(np.uint32)
  root = tmp_path_factory.mktemp('poisoned')
  paths = str(root / 'train.npy'), str(root / 'validation.npy')
  train_tokens = folded[:64 * 16 * 20].copy()
  np.save(paths[0], train_tokens)
  ds = data.Dataset([paths[0]], seq_len=64, vocab_size=256, eos_token_id=0, pad_token_id=1)
  header = os.path.getsize(paths[0]) - train_tokens.nbytes  # .npy header before the tokens
  for batch, poison in POISON.items():
    instance = int(data.global_batch_ids(ds, 34521, 1, batch, 16)[0])
    train_tokens[instance * 64 + 5] = poison
  np.save(paths[0], train_tokens)
  assert os.path.getsize(paths[0]) - train_tokens.nbytes == header
  np.save(paths[1], folded[64 * 16 * 20:])
  return paths


@pytest.fixture
def poisoned_loss(monkeypatch):
  namespace: dict = {}
  exec(POISON_CODE, namespace)  # pylint: disable=exec-used  # the children run the same code
  monkeypatch.setattr(loss, 'sums', namespace['poisoned_sums'])


def run_config(files, **changes):
  return tiny_config(files, **{**RUN, **changes})


def read_log(workdir) -> list[dict]:
  return [{k: v for k, v in e.items() if k != 'time'} for e in rollback.read_log(str(workdir))]


# --- The skip map ----------------------------------------------------------------------


def test_skips_map_steps_to_the_batches_outside_the_windows():
  skips = data.Skips([(5, 6), (2, 4), (3, 5), (9, 10)])
  assert skips.windows == [[2, 6], [9, 10]]  # overlapping and adjacent windows merge
  outside = [b for b in range(20) if not any(a <= b < c for a, c in [(2, 6), (9, 10)])]
  assert [skips.nth(k) for k in range(len(outside))] == outside
  assert [skips.advance(b) for b in (0, 2, 5, 6, 9)] == [0, 6, 6, 6, 10]
  assert skips.skipped_before(9) == 4 and skips.count_before(6) == 2


def test_loader_passes_over_skips_and_a_resume_lands_where_the_steps_lead(poisoned_files):
  """Against a loader without skips (the independent order): the same batches, less the
  skipped ones, across an epoch end; a state saved at a window's start resumes past it."""
  cfg = tiny_config(poisoned_files)
  ds = data.Dataset.from_config(cfg.data)
  n = data.batches_per_epoch(ds, 16)
  skips = data.Skips([(4, 7), (n - 1, n + 2)])
  with data.Loader(ds, seed=cfg.data.seed, global_batch_size=16, prefetch=1) as plain:
    every = [next(plain)['tokens'] for _ in range(n + 6)]
  wanted = [every[b] for b in range(n + 6) if skips.advance(b) == b]
  with data.Loader(ds, seed=cfg.data.seed, global_batch_size=16, prefetch=1,
                   skips=skips) as loader:
    got = [next(loader)['tokens'] for _ in range(len(wanted))]
    for k in range(len(wanted)):
      assert np.array_equal(got[k], wanted[k]), k
  # A checkpoint of 4 steps saved before the window existed is at batch 4: it resumes at 7.
  state = {**loader.state(), 'epoch': 1, 'step': 4}
  data.check_position(state, ds, 4, skips=skips)
  with data.Loader.from_config(cfg.data, ds, state=state, step=4, skips=skips) as resumed:
    assert (resumed.epoch, resumed.step) == (1, 7)
    assert np.array_equal(next(resumed)['tokens'], every[7])
  with pytest.raises(errors.DataError, match='skips global batches'):
    data.check_position({**state, 'step': 7}, ds, 5, skips=skips)  # 5 steps lead to batch 8
  data.check_position({**state, 'step': 7}, ds, 7)  # without skips, as before


# --- Recovery ---------------------------------------------------------------------------


@pytest.fixture(scope='module')
def recovered(poisoned_files, tmp_path_factory):
  """The uninterrupted recovery (LR x0.5 for 2 steps): (workdir, final host state)."""
  workdir = tmp_path_factory.mktemp('recovered')
  namespace: dict = {}
  exec(POISON_CODE, namespace)  # pylint: disable=exec-used
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(loss, 'sums', namespace['poisoned_sums'])
    cfg = run_config(poisoned_files, **{'train.rollback_attempts': 3, **LR})
    train.train(cfg, str(workdir))
  return workdir, host_state(cfg, workdir, STEPS)


def test_spike_recovers_bit_identical_to_a_run_told_to_skip(recovered, poisoned_files,
                                                            poisoned_loss, tmp_path, capfd):
  workdir, state = recovered
  assert read_log(workdir) == [{
      'attempt': 1, 'trigger_step': 6, 'detected_step': 6, 'restored_step': 3, 'skip': WINDOW,
      'reason': read_log(workdir)[0]['reason'], 'lr_factor': 0.5, 'lr_steps': 2}]
  assert 'the CE loss of step 6' in read_log(workdir)[0]['reason']
  ckpts = workdir / 'checkpoints'
  assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith('rolledback.')) == [
      'rolledback.step_4.1', 'rolledback.step_5.1']  # the states steps 5 and 6 judged
  assert committed(workdir) == list(range(1, STEPS + 1))
  meta = checkpoint.read_metadata(str(ckpts), STEPS)
  assert meta['data']['skips'] == [WINDOW] and len(meta['rollbacks']) == 1

  clean = tmp_path / 'clean'
  cfg = run_config(poisoned_files, **{'train.skip_batches': ((*WINDOW, 0.5, 2),)})
  train.train(cfg, str(clean))
  assert not (clean / rollback.LOG).exists()
  assert_states_equal(state, host_state(cfg, clean, STEPS))

  # The effective LR against the schedule (an independent fact), and the counters.
  schedule = optim.lr_schedule(cfg.opt)
  metrics = read_metrics(workdir)
  assert sorted(metrics) == list(range(1, STEPS + 1))  # the rolled-back steps 4-6 replaced
  for step in range(1, STEPS + 1):
    factor = 0.5 if step in (4, 5) else 1.0
    assert metrics[step]['optim/LR factor'] == factor
    assert metrics[step]['optim/LR'] == pytest.approx(factor * float(schedule(step)), rel=1e-6)
    assert metrics[step]['train/rollbacks'] == (1.0 if step > 3 else 0.0)
    assert metrics[step]['data/skipped batches'] == (4.0 if step > 3 else 0.0)
  assert read_metrics(clean)[5]['optim/LR'] == metrics[5]['optim/LR']


def test_a_trip_seen_at_a_later_log_step_names_the_spike_step(poisoned_files, poisoned_loss,
                                                             tmp_path, monkeypatch):
  """Steps are judged at log steps: the spike of step 6 is seen at step 8 (log_every 4), and
  the log names both; the window still covers every batch read through step 8. Batch 4's
  NaN is cleaned, so step 5 judges state 4 healthy."""
  read = data.Dataset.read

  def read_without_nan(self, ids):
    tokens = read(self, ids)
    tokens[tokens == NAN_ID] = 2
    return tokens
  monkeypatch.setattr(data.Dataset, 'read', read_without_nan)
  cfg = run_config(poisoned_files, **{'train.rollback_attempts': 3, 'train.log_every': 4,
                                      'train.ckpt_every': 4})
  train.train(cfg, str(tmp_path))
  entry = read_log(tmp_path)[0]
  assert (entry['trigger_step'], entry['detected_step'], entry['restored_step']) == (6, 8, 4)
  assert 'the CE loss of step 6' in entry['reason']
  assert entry['skip'] == [4, 9]  # batches of steps 5-8, plus rollback_margin=1


def test_rolled_back_states_past_keep_rolledback_are_deleted(poisoned_files, tmp_path):
  """Two logged rollbacks to step 1; keep_rolledback=1 keeps the newest attempt's states."""
  directory = str(tmp_path / 'checkpoints')
  entries = [{'attempt': a, 'trigger_step': 9, 'detected_step': 9, 'reason': 'r',
              'restored_step': 1, 'skip': [1, 3], 'lr_factor': 1.0, 'lr_steps': 0, 'time': 0.0}
             for a in (1, 2)]
  state = {'w': np.arange(4, dtype=np.float32)}
  with checkpoint.Checkpointer(directory, keep_last=10, fsync=False) as ckpt:
    for step, known in ((1, []), (2, []), (3, []), (4, entries[:1])):
      ckpt.save(step, state, {'rollbacks': known})
      ckpt.wait()
    (tmp_path / rollback.LOG).write_text(''.join(json.dumps(e) + '\n' for e in entries))
    cfg = run_config(poisoned_files, **{'train.rollback_attempts': 3,
                                        'train.keep_rolledback': 1})
    rollback.Recovery(cfg, str(tmp_path), ckpt)
  assert sorted(os.listdir(directory)) == ['rolledback.step_4.2', 'step_1']
  cfg.train.keep_rolledback = 0
  with checkpoint.Checkpointer(directory, fsync=False) as ckpt:
    rollback.Recovery(cfg, str(tmp_path), ckpt)
  assert sorted(os.listdir(directory)) == ['step_1']


def test_recovery_off_stops_as_before(poisoned_files, poisoned_loss, tmp_path, capfd):
  cfg = run_config(poisoned_files, **{'train.rollback_attempts': 0})  # the one switch
  with pytest.raises(SystemExit) as stop:
    train.train(cfg, str(tmp_path))
  assert stop.value.code == errors.EXIT_DIVERGED
  message = [l for l in capfd.readouterr().err.splitlines() if l.startswith('DIVERGED: ')]
  assert len(message) == 1 and 'Stopped at step 6' in message[0]
  assert 'The last healthy checkpoint is step 3' in message[0] and 'Rollback' not in message[0]
  assert not (tmp_path / rollback.LOG).exists()
  assert committed(tmp_path) == [1, 2, 3, 4, 5, 6]
  assert checkpoint.latest_healthy_step(str(tmp_path / 'checkpoints')) == 3


def test_attempts_exhausted_stop_naming_the_skipped_windows(poisoned_files, poisoned_loss,
                                                            tmp_path, capfd, monkeypatch):
  """One attempt allowed, and the batch right after the window spikes too (batch 7 is
  planted by treating its first instance's label like SPIKE_ID): step 4 after the rollback
  trips, and judges the restored state 3 unhealthy in turn."""
  ds = data.Dataset.from_config(run_config(poisoned_files).data)
  marked = int(data.global_batch_ids(ds, 34521, 1, 7, 16)[0])
  read = data.Dataset.read

  def read_with_spike(self, ids):
    tokens = read(self, ids)
    tokens[np.asarray(ids).reshape(-1) == marked, 5] = SPIKE_ID
    return tokens
  monkeypatch.setattr(data.Dataset, 'read', read_with_spike)
  cfg = run_config(poisoned_files, **{'train.rollback_attempts': 1})
  with pytest.raises(SystemExit) as stop:
    train.train(cfg, str(tmp_path))
  assert stop.value.code == errors.EXIT_DIVERGED
  err = capfd.readouterr().err
  assert 'ROLLBACK 1/1' in err
  message = [l for l in err.splitlines() if l.startswith('DIVERGED: ')]
  assert len(message) == 1 and 'Stopped at step 4' in message[0]
  assert 'all 1 attempts of train.rollback_attempts were made' in message[0]
  assert f'[{WINDOW[0]}, {WINDOW[1]}) (attempt 1: trip at step 6, restored step 3)' in message[0]
  assert 'scripts/inspect_batch.py' in message[0] and f'--batch={WINDOW[0]}' in message[0]
  assert 'The last healthy checkpoint is step 2' in message[0]
  assert checkpoint.latest_healthy_step(str(tmp_path / 'checkpoints')) == 2
  assert len(read_log(tmp_path)) == 1


# --- SIGKILL during a recovery ----------------------------------------------------------


def child(workdir, files, kill_at: str | None) -> tuple[list[str], dict[str, str]]:
  """train.py's CLI with the poison, SIGKILLing itself after rollback phase `kill_at`."""
  script = (f'import os, signal, sys\nsys.path.insert(0, {str(REPO)!r})\n' + POISON_CODE +
            INSTALL_POISON +
            'from monitor import rollback; import train\n'
            'done = rollback.phase_done\n'
            'def hooked(phase, attempt):\n'
            '  done(phase, attempt)\n'
            '  if phase == os.environ.get("KILL_AT"):\n'
            '    os.kill(os.getpid(), signal.SIGKILL)\n'
            'rollback.phase_done = hooked\n'
            'train.run()\n')
  flags = [f'--config.{k}={v}' for k, v in {**RUN, **LR, 'train.rollback_attempts': 3}.items()]
  argv = [sys.executable, '-c', script, f'--workdir={workdir}', '--sample_tokens=0',
          *config_flags(files), *flags]
  env = dict(os.environ, XLA_FLAGS=with_devices(8))
  env.pop('KILL_AT', None)
  if kill_at:
    env['KILL_AT'] = kill_at
  return argv, env


@pytest.mark.slow
@pytest.mark.parametrize('phase', ['decided', 'logged', 'set aside', 'restored'])
def test_sigkill_in_each_phase_then_rerun_is_bit_identical(recovered, poisoned_files, tmp_path,
                                                           phase):
  workdir = tmp_path / 'run'
  argv, env = child(workdir, poisoned_files, phase)
  killed = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
  assert len(read_log(workdir)) == (0 if phase == 'decided' else 1)
  argv, env = child(workdir, poisoned_files, None)  # the same command
  rerun = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  assert read_log(workdir) == read_log(recovered[0])
  cfg = run_config(poisoned_files)
  assert_states_equal(host_state(cfg, workdir, STEPS), recovered[1])
  assert not any(n.startswith('step_') and int(n[5:]) > STEPS
                 for n in os.listdir(workdir / 'checkpoints'))


# --- Which state is healthy, and what a rollback keeps (issue 38) ----------------------


def cli(workdir, files, settings: dict, code: str = '') -> subprocess.CompletedProcess:
  """train.py's command line with `settings` as --config flags, `code` (what the test plants
  in the trainer) run first."""
  script = f'import sys\nsys.path.insert(0, {str(REPO)!r})\n' + code + 'import train\ntrain.run()\n'
  argv = [sys.executable, '-c', script, f'--workdir={workdir}', '--sample_tokens=0',
          *config_flags(files), *[f'--config.{k}={v}' for k, v in settings.items()]]
  return subprocess.run(argv, env=dict(os.environ, XLA_FLAGS=with_devices(8)), cwd=REPO,
                        capture_output=True, text=True, timeout=600)


DESTROYED = 2  # the global batch whose step applies a destructive update
# The update of the step that reads global batch DESTROYED is scaled 1e4 (LR 30 instead of
# 0.003): that step's own loss, computed before the update, is normal; the next one's is not.
DESTROY_CODE = f'''
from monitor import rollback
_lr_factor = rollback.Recovery.lr_factor
def destructive(self, step):
  return _lr_factor(self, step) * (1e4 if self.skips.nth(step - 1) == {DESTROYED} else 1.0)
rollback.Recovery.lr_factor = destructive
'''


def test_rollback_restores_the_state_before_a_destructive_update(poisoned_files, tmp_path):
  """Step 3 reads batch 2 and breaks the weights; its loss (of state 2's params) is normal,
  step 4's (state 3's) is far past max_loss. State 3 must not count as healthy: restored, it
  trips again on any batch, and until now step 3 was restored until the attempts ran out
  (exit 4). The state to restore is 2, the last one a step found healthy; the recovery
  then ends bit-identical to a run told from its start to skip the window."""
  workdir = tmp_path / 'run'
  run = cli(workdir, poisoned_files, {**RUN, 'train.rollback_attempts': 3}, DESTROY_CODE)
  assert run.returncode == 0, run.stderr[-3000:]
  log = read_log(workdir)
  assert [e['restored_step'] for e in log] == [DESTROYED]  # the state before the update
  assert log[0]['skip'][0] == DESTROYED and 'the CE loss of step 4' in log[0]['reason']
  ckpts = str(workdir / 'checkpoints')
  assert json.loads((workdir / 'checkpoints' / 'step_2' / 'HEALTH').read_text()) == {
      'healthy': True, 'judged_by_step': 3}
  assert checkpoint.latest_healthy_step(ckpts) == STEPS - 1  # the last step awaits its next
  clean = tmp_path / 'clean'
  cfg = run_config(poisoned_files, **{'train.skip_batches': (tuple(log[0]['skip']),)})
  train.train(cfg, str(clean))
  assert_states_equal(host_state(cfg, workdir, STEPS), host_state(cfg, clean, STEPS))


def test_keep_rolledback_zero_in_a_bucket_deletes_without_copying(gcs_server, recovered,
                                                                  poisoned_files):
  """train.keep_rolledback=0 with the checkpoints in a bucket: the rolled-back steps are
  deleted where they are; no object is ever written under a rolledback.* name (setting a
  state aside in a bucket copies every object of it). The recovery is the one on disk."""
  workdir = f'gs://{gcs_server[1]}/run'
  run = cli(workdir, poisoned_files, {**RUN, **LR, 'train.rollback_attempts': 3,
                                      'train.keep_rolledback': 0}, POISON_CODE + INSTALL_POISON)
  assert run.returncode == 0, run.stderr[-3000:]
  assert read_log(workdir) == read_log(recovered[0])
  ckpts = storage.join(workdir, 'checkpoints')
  assert not [n for n in storage.listdir(ckpts) if 'rolledback' in n]
  assert checkpoint.committed_steps(ckpts) == list(range(1, STEPS + 1))
  writes = [line for line in server_log('gcs').splitlines()
            if gcs_server[1] in line and 'rolledback' in line]
  assert not writes, writes[:3]
  target = jax.tree.map(np.zeros_like, recovered[1])
  state, _ = checkpoint.restore(ckpts, target, STEPS)
  assert_states_equal(state, recovered[1])


def test_keep_rolledback_keeps_the_newest_attempt_that_set_a_state_aside(poisoned_files,
                                                                         tmp_path):
  """ckpt_every=2, keep_rolledback=1, and a second spike in batch 10. Attempt 1 (trip at
  step 6) restores step 2 (state 4 was judged by the skipped step 5) and sets step 4
  aside. After it step 6 reads batch 10 and trips before its save: attempt 2 restores
  step 4, and nothing newer exists to set aside. Attempt 1's state is then the newest set
  aside: it is kept (it used to be deleted as one attempt too old)."""
  ds = data.Dataset.from_config(run_config(poisoned_files).data)
  marked = int(data.global_batch_ids(ds, 34521, 1, 10, 16)[0])
  spike = (f'import data, numpy as np\n_read = data.Dataset.read\n'
           f'def read_with_spike(self, ids):\n'
           f'  tokens = _read(self, ids)\n'
           f'  tokens[np.asarray(ids).reshape(-1) == {marked}, 5] = {SPIKE_ID}\n'
           f'  return tokens\n'
           f'data.Dataset.read = read_with_spike\n')
  run = cli(tmp_path, poisoned_files, {**RUN, 'train.ckpt_every': 2, 'train.rollback_attempts': 3,
                                       'train.keep_rolledback': 1},
            POISON_CODE + INSTALL_POISON + spike)
  assert run.returncode == 0, run.stderr[-3000:]
  log = read_log(tmp_path)
  assert [(e['trigger_step'], e['restored_step'], e['skip']) for e in log] == [
      (6, 2, [2, 7]), (6, 4, [9, 12])]
  ckpts = tmp_path / 'checkpoints'
  assert sorted(p.name for p in ckpts.iterdir() if 'rolledback' in p.name) == [
      'rolledback.step_4.1']
  assert 'rollbacks' not in json.loads(
      (ckpts / 'rolledback.step_4.1' / 'metadata.json').read_text())['metadata']


# --- Batch forensics --------------------------------------------------------------------


def test_inspect_batch_shows_what_each_rank_read(recovered, poisoned_files):
  """Step 4 after the rollback read global batch 7: the script's tokens per OLMo-core rank
  are the loader's rows on each of the 8 devices, and batch 5 shows the planted spike."""
  workdir, _ = recovered
  inspect = load_script('inspect_batch')
  cfg = run_config(poisoned_files, **{'train.rollback_attempts': 3})
  import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh(cfg.train)
  ds = data.Dataset.from_config(cfg.data)
  skips = rollback.run_skips(cfg.train, str(workdir))
  with data.Loader(ds, seed=cfg.data.seed, global_batch_size=16, prefetch=1, skips=skips,
                   sharding=sharding.batch_sharding(mesh)) as loader:
    for _ in range(4):
      batch = next(loader)
  assert loader.last_position == (1, 7)
  shards = sorted(batch['tokens'].addressable_shards, key=lambda s: s.index[0].start or 0)
  W = len(shards)
  for rank, shard in enumerate(shards):
    report = inspect.describe(run_config(poisoned_files), step=4, rank=rank, num_ranks=W,
                              workdir=str(workdir))
    assert report['global_batch'] == 7 and not report['skipped']
    assert [r['rank'] for r in report['instances']] == [rank] * (16 // W)
    assert np.array_equal(np.array([r['tokens'] for r in report['instances']]),
                          np.asarray(shard.data))
  spike = inspect.describe(run_config(poisoned_files), batch=5, workdir=str(workdir),
                           checkpoint_dir=str(workdir / 'checkpoints'), checkpoint_step=3)
  assert spike['skipped'] and SPIKE_ID in spike['instances'][0]['tokens']
  first = spike['instances'][0]
  assert first['token_offset'] == first['instance_id'] * 64 and first['documents'][0][0] == 0
  assert all(np.isfinite(r['loss']) for r in spike['instances'])
