"""Reading an OLMo-core step directory's torch distributed checkpoint without torch.distributed.

`model_and_optim/.metadata` is a pickled torch distributed-checkpoint Metadata
(per key its size, dtype and chunks; per chunk a file, offset and length), and
every chunk a torch.save blob at its offset in a `__R_I.distcp` file.
`Reader` reads one tensor (or one row block of one) at a time, so a 7B state
converts in a few GB of host memory. torch is needed for the blobs (the
optional extra); olmo_core is not: the storage-info record OLMo-core pickles
is read as a plain record. formats/olmo_core_ckpt.py converts what this reads.
"""

import io
import math
import os
import pickle
from typing import Any

import numpy as np

from formats import ckpt_files
from formats.olmo_core_config import OlmoCoreCheckpointError

EXTRA = "pip install '.[olmo-core]'"


def torch_module():
  """torch, imported only on this path (the optional extra provides it)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError('Reading or writing OLMo-core checkpoints needs torch (CPU is enough): '
                      f'{EXTRA}') from e
  return torch


class _StorageInfo:
  """Stand-in for the per-chunk record OLMo-core (or torch) pickles: file, offset, length."""

  def __setstate__(self, state):
    self.__dict__.update(state)


class _Unpickler(pickle.Unpickler):
  def find_class(self, module, name):
    if name == '_StorageInfo':  # olmo_core's or torch's: same fields, no import of olmo_core
      return _StorageInfo
    return super().find_class(module, name)


class _Window(io.RawIOBase):
  """Bytes [offset, offset + length) of an open file, as a seekable file of their own."""

  def __init__(self, f, offset: int, length: int):
    super().__init__()
    self.f, self.offset, self.length, self.pos = f, offset, length, 0

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self.pos

  def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
    self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos
    return self.pos

  def readinto(self, buffer) -> int:
    n = max(0, min(len(buffer), self.length - self.pos))
    self.f.seek(self.offset + self.pos)
    got = self.f.readinto(memoryview(buffer)[:n])
    self.pos += got
    return got


class Reader:
  """The tensors and pickled values of a `model_and_optim/` distributed checkpoint."""

  def __init__(self, directory: str):
    torch_module()  # the metadata pickle names torch classes
    self.directory = directory
    path = os.path.join(directory, '.metadata')
    try:
      with open(path, 'rb') as f:
        meta = _Unpickler(f).load()
    except FileNotFoundError as e:
      raise OlmoCoreCheckpointError(f'{path} is missing: {directory} is not an OLMo-core '
                                    'model_and_optim/ directory (is the step directory '
                                    'complete?).') from e
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
      raise OlmoCoreCheckpointError(f'{path} is unreadable ({e}); download it again.') from e
    self.entries = meta.state_dict_metadata
    self.chunks: dict[str, list] = {}
    for index, info in meta.storage_data.items():
      self.chunks.setdefault(index.fqn, []).append((index, info))

  def files(self) -> list[str]:
    """The .distcp files the metadata names (some writer threads leave none)."""
    return sorted({info.relative_path for chunks in self.chunks.values() for _, info in chunks})

  def __contains__(self, fqn: str) -> bool:
    return fqn in self.entries

  def _check_extent(self, fqn: str, info) -> None:
    path = os.path.join(self.directory, info.relative_path)
    if not os.path.exists(path):
      raise OlmoCoreCheckpointError(f'{path} is missing (it holds {fqn}); download the step '
                                    'directory again.')
    if os.path.getsize(path) < info.offset + info.length:
      raise OlmoCoreCheckpointError(f'{path} is truncated: {fqn} needs bytes {info.offset}..'
                                    f'{info.offset + info.length}, the file has fewer. '
                                    'Download it again.')

  def _blob(self, fqn: str, info) -> bytes:
    path = os.path.join(self.directory, info.relative_path)
    try:
      with open(path, 'rb') as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    except FileNotFoundError as e:
      raise OlmoCoreCheckpointError(f'{path} is missing (it holds {fqn}); download the step '
                                    'directory again.') from e
    if len(blob) != info.length:
      raise OlmoCoreCheckpointError(f'{path} is truncated: {fqn} needs bytes {info.offset}..'
                                    f'{info.offset + info.length}, the file has fewer. '
                                    'Download it again.')
    return blob

  def _load(self, fqn: str, info) -> Any:
    self._check_extent(fqn, info)
    try:  # torch reads the blob straight from the file: no bytes copy beside the tensor
      with open(os.path.join(self.directory, info.relative_path), 'rb') as f:
        return torch_module().load(_Window(f, info.offset, info.length), map_location='cpu',
                                   weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError) as e:
      raise OlmoCoreCheckpointError(f'{self.directory}/{info.relative_path}: {fqn} is '
                                    f'damaged ({e}); download the file again.') from e

  def tensor(self, fqn: str) -> np.ndarray:
    """The whole tensor `fqn`, reassembled from its chunks, as float32/int numpy."""
    if fqn not in self.entries or not hasattr(self.entries[fqn], 'chunks'):
      raise OlmoCoreCheckpointError(f'{self.directory} has no tensor {fqn}.')
    meta = self.entries[fqn]
    shape = tuple(meta.size)
    chunks = self.chunks.get(fqn, [])
    if len(chunks) == 1 and tuple(chunks[0][0].offset or ()) == (0,) * len(shape):
      value = self._load(fqn, chunks[0][1])
      if tuple(value.shape) == shape:  # unsharded: no copy
        return value.numpy()
    out, covered = None, 0
    for index, info in chunks:
      value = self._load(fqn, info).numpy()
      if out is None:
        out = np.empty(shape, value.dtype)
      at = tuple(slice(o, o + n) for o, n in zip(index.offset, value.shape))
      out[at] = value
      covered += value.size
    if out is None or covered != math.prod(shape):
      raise OlmoCoreCheckpointError(f'{self.directory}: the chunks of {fqn} cover {covered} of '
                                    f'{math.prod(shape)} elements; the metadata is damaged.')
    return out

  def value(self, fqn: str) -> Any:
    """A pickled (bytes) entry, e.g. a param group's weight_decay."""
    if fqn not in self.chunks:
      raise OlmoCoreCheckpointError(f'{self.directory} has no entry {fqn}.')
    blob = self._blob(fqn, self.chunks[fqn][0][1])
    return torch_module().load(io.BytesIO(blob), weights_only=False)


def read_json(path: str) -> dict:
  return ckpt_files.read_json(path, OlmoCoreCheckpointError, 'download it again')


def read_trainer_state(step_dir: str) -> dict | None:
  """train/rank0.pt as a dict, or None for a weights-only directory."""
  path = os.path.join(step_dir, 'train', 'rank0.pt')
  if not os.path.exists(path):
    return None
  try:
    return torch_module().load(path, map_location='cpu', weights_only=False)
  except Exception as e:  # pylint: disable=broad-except  # torch raises many kinds here
    raise OlmoCoreCheckpointError(f'{path} is unreadable ({type(e).__name__}: {e}); download '
                                  'it again.') from e
