"""TensorBoard event files without TensorFlow: write scalars and text, read scalars back.

An event file is a sequence of TFRecords, each
    uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
(little-endian), whose data is one serialized `tensorflow.Event` proto
(tensorflow/core/util/event.proto; TensorBoard ships the same protos). Only
the handful of proto fields below are written or read, so they are encoded by
hand here instead of importing a protobuf package: tensorboardX, the usual
writer, imports torch wherever torch is installed, which cost every
`train.py` start 1.8 s. tests/test_events.py checks both directions against
tensorboardX's own protos and CRC.

Field numbers used (wire type in brackets):
  Event:        wall_time 1 (fixed64 double), step 2 (varint), file_version 3,
                summary 5, session_log 7
  SessionLog:   status 1 (varint; START = 1)
  Summary:      value 1 (repeated)
  Value:        tag 1, simple_value 2 (fixed32 float), tensor 8, metadata 9
  SummaryMetadata: plugin_data 1 -> PluginData: plugin_name 1
  TensorProto:  dtype 1 (varint; DT_STRING = 7), tensor_shape 2 (-> dim 2 -> size 1),
                float_val 5 (packed or not), string_val 8
"""

import os
import socket
import struct
import time

import numpy as np

from store import storage

# --- CRC-32C (Castagnoli), as TFRecord masks it ------------------------------------


def _crc32c_table() -> list[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    table.append(crc)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c_python(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


try:  # C speed where google-crc32c is installed (~5 MB/s in pure Python; writes are tiny)
  from google_crc32c import value as crc32c  # pylint: disable=g-import-not-at-top
except ImportError:
  crc32c = crc32c_python


def masked_crc32c(data: bytes) -> int:
  """TFRecord's mask: rotate right by 15 and add a constant (CRCs of CRCs stay useful)."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
  """One TFRecord: the length and its masked CRC, the data and its masked CRC."""
  length = struct.pack('<Q', len(data))
  return (length + struct.pack('<I', masked_crc32c(length)) + data
          + struct.pack('<I', masked_crc32c(data)))


# --- Protobuf wire format, the few fields used ------------------------------------

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _varint(n: int) -> bytes:
  if n < 0:
    raise ValueError(f'events: {n} is negative; steps and enum values must be >= 0.')
  out = bytearray()
  while n > 0x7F:
    out.append(n & 0x7F | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def _tag(field: int, wire: int) -> bytes:
  return _varint(field << 3 | wire)


def _int_field(field: int, n: int) -> bytes:
  return _tag(field, _VARINT) + _varint(n)


def _bytes_field(field: int, data: bytes) -> bytes:
  return _tag(field, _BYTES) + _varint(len(data)) + data


def _event(step: int, **what: bytes) -> bytes:
  """An Event with the wall time now and one of file_version / summary / session_log."""
  field = {'file_version': 3, 'summary': 5, 'session_log': 7}
  (name, payload), = what.items()
  return (_tag(1, _FIXED64) + struct.pack('<d', time.time()) + _int_field(2, step)
          + _bytes_field(field[name], payload))


def scalar_value(tag: str, value: float) -> bytes:
  """A Summary.Value holding a float32 simple_value (out-of-range values become +-inf)."""
  with np.errstate(over='ignore'):
    number = np.array(value, '<f4').tobytes()
  return _bytes_field(1, tag.encode()) + _tag(2, _FIXED32) + number


def text_value(tag: str, text: str) -> bytes:
  """A Summary.Value for TensorBoard's text plugin: a [1] DT_STRING tensor."""
  shape = _bytes_field(2, _int_field(1, 1))  # one dim of size 1
  tensor = _int_field(1, 7) + _bytes_field(2, shape) + _bytes_field(8, text.encode())
  metadata = _bytes_field(1, _bytes_field(1, b'text'))
  return _bytes_field(1, tag.encode()) + _bytes_field(8, tensor) + _bytes_field(9, metadata)


class Writer:
  """Appends Events to a new file `events.out.tfevents.<seconds>.<host>[.NNN]` in `logdir`.

  Names sort in the order the files were started (TensorBoard and
  read_scalars read them in name order): a second file started within the
  same second gets the suffix .001, and so on. In a bucket (`logdir` a gs:// or
  s3:// URL), where objects cannot be appended to, events are held in memory
  and each flush() writes them as one more event file, which TensorBoard reads
  after the earlier ones like a continuation.
  """

  def __init__(self, logdir: str):
    self.logdir, self.remote = logdir, not storage.appends(logdir)  # one object per flush
    self._pending = bytearray()
    if self.remote:
      self._file = None
      return
    os.makedirs(logdir, exist_ok=True)
    self.path = self._new_name()
    self._file = open(self.path, 'xb')
    self._file.write(record(_event(0, file_version=b'brain.Event:2')))
    self._file.flush()

  def _new_name(self) -> str:
    path = storage.join(self.logdir, f'events.out.tfevents.{int(time.time()):010d}.'
                                     f'{socket.gethostname()}')
    name, n = path, 0
    while storage.exists(name):
      n += 1
      name = f'{path}.{n:03d}'
    return name

  def _add(self, event: bytes) -> None:
    if self.remote:
      self._pending += record(event)
    else:
      self._file.write(record(event))
      self._file.flush()

  def summary(self, step: int, values: list[bytes]) -> None:
    """One Event holding `values` (from scalar_value / text_value), flushed to disk."""
    self._add(_event(step, summary=b''.join(_bytes_field(1, v) for v in values)))

  def start_session(self, step: int) -> None:
    """SessionLog START at `step`: TensorBoard drops earlier-written events at steps >= it."""
    self._add(_event(step, session_log=_int_field(1, 1)))

  def flush(self) -> None:
    """In a bucket: writes the events held since the last flush as one event file."""
    if self.remote and self._pending:
      storage.write(self._new_name(),
                    record(_event(0, file_version=b'brain.Event:2')) + bytes(self._pending))
      self._pending = bytearray()

  def close(self) -> None:
    if self.remote:
      self.flush()
    else:
      self._file.close()


# --- Reading scalars back ----------------------------------------------------------


def _fields(buf: bytes):
  """(field number, wire type, value) of one serialized message, in order."""
  pos = 0
  while pos < len(buf):
    key, pos = _read_varint(buf, pos)
    field, wire = key >> 3, key & 7
    if wire == _VARINT:
      value, pos = _read_varint(buf, pos)
    elif wire == _FIXED64:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire == _FIXED32:
      value, pos = buf[pos:pos + 4], pos + 4
    elif wire == _BYTES:
      length, pos = _read_varint(buf, pos)
      value, pos = buf[pos:pos + length], pos + length
    else:
      raise ValueError(f'unsupported protobuf wire type {wire}')
    if pos > len(buf):
      raise ValueError('protobuf message cut short')
    yield field, wire, value


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
  n = shift = 0
  while True:
    if pos >= len(buf):
      raise ValueError('protobuf varint cut short')
    byte = buf[pos]
    n |= (byte & 0x7F) << shift
    pos, shift = pos + 1, shift + 7
    if not byte & 0x80:
      return n, pos


def _scalar(value_msg: bytes) -> tuple[str, float | None]:
  """(tag, value) of a Summary.Value: simple_value, or a tensor's first float_val."""
  tag, number = '', None
  for field, wire, value in _fields(value_msg):
    if field == 1:
      tag = value.decode()
    elif field == 2 and wire == _FIXED32:
      number = struct.unpack('<f', value)[0]
    elif field == 8 and number is None:
      for t_field, t_wire, t_value in _fields(value):
        if t_field == 5 and t_wire == _BYTES and t_value:  # packed float_val
          number = struct.unpack('<f', t_value[:4])[0]
        elif t_field == 5 and t_wire == _FIXED32:
          number = struct.unpack('<f', t_value)[0]
  return tag, number


def read_file(path: str):
  """Yields (step, session START?, [(tag, float value)]) per Event of one event file.

  Raises ValueError naming the file on a damaged record; a record cut short at
  the end (the writer was killed mid-write) ends the file quietly.
  """
  buf = storage.read(path)
  if buf is None:
    raise FileNotFoundError(f'{path}: no such event file.')
  pos = 0
  while pos + 12 <= len(buf):
    header = buf[pos:pos + 8]
    if struct.unpack('<I', buf[pos + 8:pos + 12])[0] != masked_crc32c(header):
      raise ValueError(f'{path}: record at byte {pos} has a bad length checksum; the file is '
                       'damaged (delete it or cut it at that byte).')
    end = pos + 12 + struct.unpack('<Q', header)[0] + 4
    if end > len(buf):
      return  # the last record was cut short
    data = buf[pos + 12:end - 4]
    if struct.unpack('<I', buf[end - 4:end])[0] != masked_crc32c(data):
      raise ValueError(f'{path}: record at byte {pos} has a bad data checksum; the file is '
                       'damaged (delete it or cut it at that byte).')
    pos = end
    step, start, scalars = 0, False, []
    for field, _, value in _fields(data):
      if field == 2:
        step = value - (1 << 64) if value >= 1 << 63 else value
      elif field == 7:
        start = any(f == 1 and v == 1 for f, _, v in _fields(value))
      elif field == 5:
        for f, _, v in _fields(value):
          if f == 1:
            tag, number = _scalar(v)
            if number is not None:
              scalars.append((tag, number))
    yield step, start, scalars


def read_scalars(path: str, tags: set[str]) -> tuple[list[int], list[float]]:
  """(steps, values) of `tags` from an event file or every one under a folder, in write order.

  A SessionLog START at step s drops values written before it at steps >= s,
  as TensorBoard does when a resumed run rewrites steps it had logged.
  """
  files = [storage.join(path, k) for k in storage.list_keys(path)
           if k.rpartition('/')[2].startswith('events.out.tfevents')]
  if not files and storage.isfile(path):
    files = [path]
  if not files:
    raise FileNotFoundError(f'{path}: no events.out.tfevents* files.')
  points: list[tuple[int, float]] = []
  for file in files:
    for step, start, scalars in read_file(file):
      if start:
        points = [(s, v) for s, v in points if s < step]
      points.extend((step, v) for tag, v in scalars if tag in tags)
  return [s for s, _ in points], [v for _, v in points]
