"""monitor/events.py against tensorboardX: its copy of TensorBoard's protos, its CRC, its writer."""

import struct

import numpy as np
import pytest
from tensorboardX import SummaryWriter
from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import masked_crc32c

from monitor import events
from test_train import token_files  # noqa: F401  # the fixture, for the train.py test


def parse(path) -> list[event_pb2.Event]:
  """Every record of an event file, its framing and both CRCs checked with tensorboardX's."""
  buf = open(path, 'rb').read()
  out, pos = [], 0
  while pos < len(buf):
    header = buf[pos:pos + 8]
    (length,) = struct.unpack('<Q', header)
    assert struct.unpack('<I', buf[pos + 8:pos + 12])[0] == masked_crc32c(header)
    data = buf[pos + 12:pos + 12 + length]
    assert struct.unpack('<I', buf[pos + 12 + length:pos + 16 + length])[0] == masked_crc32c(data)
    out.append(event_pb2.Event.FromString(data))
    pos += 16 + length
  return out


@pytest.mark.parametrize('data', [b'', b'a', b'123456789', bytes(range(256)) * 5])
def test_masked_crc_equals_tensorboardx(data, monkeypatch):
  assert events.masked_crc32c(data) == masked_crc32c(data)
  monkeypatch.setattr(events, 'crc32c', events.crc32c_python)  # without google-crc32c
  assert events.masked_crc32c(data) == masked_crc32c(data)
  assert events.crc32c(b'123456789') == 0xE3069283  # the CRC-32C check value


def test_written_events_parse_as_tensorboard_protos(tmp_path):
  writer = events.Writer(str(tmp_path / 'tb'))
  writer.summary(7, [events.scalar_value('train/CE loss', 2.5),
                     events.scalar_value('optim/LR', 1e-39),  # float32 subnormal
                     events.scalar_value('big', 1e39),  # beyond float32: inf
                     events.text_value('guard/reason', 'loss 1e9 > max_loss ü')])
  writer.summary(2 ** 40, [events.scalar_value('x', -0.0)])
  writer.start_session(8)
  writer.close()
  first, scalars, big_step, session = parse(writer.path)
  assert first.file_version == 'brain.Event:2' and first.wall_time > 1.6e9
  assert scalars.step == 7
  values = {v.tag: v for v in scalars.summary.value}
  assert values['train/CE loss'].simple_value == 2.5
  assert values['optim/LR'].simple_value == np.float32(1e-39)
  assert values['big'].simple_value == np.inf
  text = values['guard/reason']
  assert text.metadata.plugin_data.plugin_name == 'text'
  assert text.tensor.dtype == 7 and [d.size for d in text.tensor.tensor_shape.dim] == [1]
  assert text.tensor.string_val == ['loss 1e9 > max_loss ü'.encode()]
  assert big_step.step == 2 ** 40 and big_step.summary.value[0].simple_value == 0.0
  assert session.step == 8 and session.session_log.status == event_pb2.SessionLog.START


def test_reads_tensorboardx_files_scalars_and_tensor_scalars(tmp_path):
  w = SummaryWriter(str(tmp_path))
  for step in range(5):
    w.add_scalar('loss', 10.0 - step, step)
    w.add_text('note', f'step {step}', step)
  w.close()
  # A TF2-style scalar: a float tensor instead of simple_value, in a second file.
  tensor_value = summary_pb2.Summary.Value(tag='loss')
  tensor_value.tensor.dtype = 1
  tensor_value.tensor.float_val.append(0.25)
  ev = event_pb2.Event(step=9, summary=summary_pb2.Summary(value=[tensor_value]))
  with open(tmp_path / 'events.out.tfevents.9999999999.host', 'wb') as f:
    f.write(events.record(ev.SerializeToString()))
  steps, values = events.read_scalars(str(tmp_path), {'loss'})
  assert steps == [0, 1, 2, 3, 4, 9]
  assert values == [10.0, 9.0, 8.0, 7.0, 6.0, 0.25]


def test_resume_purges_rewritten_steps_and_a_cut_record_ends_the_file(tmp_path):
  first = events.Writer(str(tmp_path))
  for step in range(1, 6):
    first.summary(step, [events.scalar_value('loss', step)])
  first.close()
  second = events.Writer(str(tmp_path))  # a resume from step 3: steps 4 and 5 are redone
  second.start_session(4)
  for step in (4, 5, 6):
    second.summary(step, [events.scalar_value('loss', 10 * step)])
  second.close()
  with open(second.path, 'ab') as f:  # a kill mid-write leaves half a record
    f.write(events.record(b'\x10\x07')[:14])
  assert first.path != second.path
  assert events.read_scalars(str(tmp_path), {'loss'}) == ([1, 2, 3, 4, 5, 6],
                                                         [1, 2, 3, 40, 50, 60])


def test_damaged_records_and_missing_files_are_named(tmp_path):
  writer = events.Writer(str(tmp_path))
  writer.summary(1, [events.scalar_value('loss', 1.0)])
  writer.close()
  buf = bytearray(open(writer.path, 'rb').read())
  buf[-6] ^= 0xFF  # a byte of the last record's data
  open(writer.path, 'wb').write(bytes(buf))
  with pytest.raises(ValueError, match='bad data checksum'):
    events.read_scalars(writer.path, {'loss'})
  with pytest.raises(FileNotFoundError, match='no events.out.tfevents'):
    events.read_scalars(str(tmp_path / 'empty'), {'loss'})
  with pytest.raises(ValueError, match='negative'):
    events.Writer(str(tmp_path)).summary(-1, [])


def test_run_killed_before_its_first_checkpoint_logs_each_step_once(token_files, tmp_path,  # noqa: F811
                                                                    monkeypatch):
  """train.py SIGKILLed while it waits for batch 3 (steps 1-2 logged, no checkpoint yet),
  then run again from step 0: TensorBoard shows each step once, because the second start
  tells it (SessionLog START at step 1) to drop what the killed one logged. Before, a start
  at step 0 wrote no marker and read_scalars gave [1, 2, 1, 2, 3, ...]. The run has
  $WANDB_MODE set and no W&B project: it says W&B is off, in one line."""
  import glob
  import os
  import signal
  import subprocess
  import time

  from test_train import REPO, STEPS, child_command, logged_steps
  paths = token_files
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.delenv('WANDB_PROJECT', raising=False)
  workdir = tmp_path / 'run'
  argv, env = child_command(workdir, paths, '--config.train.ckpt_every=4', devices=1,
                            hang_at=3)
  proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while logged_steps(workdir) < 2:
      assert proc.poll() is None and time.time() < deadline, 'the child never logged step 2'
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert not os.path.exists(workdir / 'checkpoints' / 'step_4')
  argv, env = child_command(workdir, paths, '--config.train.ckpt_every=4', devices=1)
  again = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  assert sum('WANDB_MODE=offline is set but no W&B project' in line
             for line in again.stderr.splitlines()) == 1
  assert not os.path.exists(workdir / 'wandb')

  steps, _ = events.read_scalars(str(workdir / 'tensorboard'), {'train/CE loss'})
  assert steps == list(range(1, STEPS + 1))
  files = sorted(glob.glob(str(workdir / 'tensorboard' / 'events.out.tfevents*')))
  assert len(files) == 2
  starts = [(e.step, e.session_log.status) for e in parse(files[1]) if e.HasField('session_log')]
  assert starts == [(1, event_pb2.SessionLog.START)]  # tensorboardX's own protos

