"""safetensors files, read and written one tensor at a time (model/weights.py maps their tensors
to grpo_jax parameters).

  SafetensorsFile(path)        a file's header checked as strictly as the format's reference reader,
                               `tensor(name)` read with a positioned read
  write_safetensors(path, entries)   TensorEntry thunks written one at a time, atomically
"""

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable

import numpy as np

from grpo_jax.errors import UserError
_DTYPES = {'F32': np.float32, 'F16': np.float16, 'F64': np.float64}


def _numpy_dtype(code: str, path: str, name: str):
  if code in ('BF16', 'F8_E4M3'):
    import ml_dtypes
    return ml_dtypes.bfloat16 if code == 'BF16' else ml_dtypes.float8_e4m3fn
  if code not in _DTYPES:
    raise UserError(f'{path}: tensor {name} has unsupported dtype {code}')
  return _DTYPES[code]


# Bytes per element of every safetensors dtype code (the format's own list), so that headers of
# tensors this reader does not convert are still checked.
_ITEM_SIZES = {'BOOL': 1, 'U8': 1, 'I8': 1, 'F8_E5M2': 1, 'F8_E4M3': 1, 'I16': 2, 'U16': 2, 'F16': 2,
               'BF16': 2, 'I32': 4, 'U32': 4, 'F32': 4, 'I64': 8, 'U64': 8, 'F64': 8}


def _checked_header(header, path: str, data_size: int) -> dict:
  """The tensor entries of a safetensors header, checked as strictly as the format's reference
  reader: every entry has a known dtype, a shape of non-negative ints and two data offsets whose
  span is exactly dtype size x elements, and the spans tile the data section in order with no gap,
  overlap or byte past its end. A header that fails names the file and the tensor, so a corrupt
  file never converts into another tensor's bytes."""
  if not isinstance(header, dict):
    raise UserError(f'{path}: the safetensors header is not a JSON object')
  entries = {name: entry for name, entry in header.items() if name != '__metadata__'}
  spans = []
  for name, entry in entries.items():
    def bad(problem, name=name):
      return UserError(f'{path}: tensor {name} has {problem} in the safetensors header')
    if not isinstance(entry, dict) or not {'dtype', 'shape', 'data_offsets'} <= set(entry):
      raise bad('an entry without dtype, shape and data_offsets')
    dtype, shape, offsets = entry['dtype'], entry['shape'], entry['data_offsets']
    if dtype not in _ITEM_SIZES:
      raise bad(f'unknown dtype {dtype!r}')
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
      raise bad(f'shape {shape!r} (not a list of non-negative integers)')
    if (not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
      raise bad(f'data_offsets {offsets!r} (not [begin, end] with 0 <= begin <= end)')
    expected = math.prod(shape) * _ITEM_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
      raise bad(f'data_offsets {offsets} spanning {offsets[1] - offsets[0]} bytes, but {dtype} {shape} needs {expected}')
    spans.append((offsets[0], offsets[1], name))
  position = 0
  for begin, end, name in sorted(spans):
    if begin != position:
      problem = 'overlaps the tensor before it' if begin < position else f'leaves a gap of {begin - position} bytes'
      raise UserError(f'{path}: tensor {name} {problem} in the safetensors data (offsets {begin}..{end})')
    position = end
  if position > data_size:
    raise UserError(f'{path} is truncated: its tensors need {position} bytes of data, the file holds {data_size}')
  if position < data_size:
    raise UserError(f'{path}: {data_size - position} bytes after the last tensor are not described by the header')
  return entries


class SafetensorsFile:
  """A safetensors file; `tensor(name)` reads that one tensor with a positioned read.

  Reads go through `os.pread` rather than a memory map so the pages of tensors already converted
  do not stay resident: converting a model then needs about one copy of it in host memory. The
  header is validated up front so a truncated or corrupt file fails with its name.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
      with open(path, 'rb') as f:
        prefix = f.read(8)
        if len(prefix) < 8:
          raise ValueError('shorter than its 8-byte header length')
        (header_length,) = struct.unpack('<Q', prefix)
        if header_length > size - 8:
          raise ValueError('header length points past the end of the file')
        header = json.loads(f.read(header_length))
    except (OSError, ValueError, UnicodeDecodeError) as error:
      raise UserError(f'{path} is not a readable safetensors file ({error})') from None
    self._data_start = 8 + header_length
    self._entries = _checked_header(header, path, size - self._data_start)

  def names(self) -> list[str]:
    return list(self._entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entries[name]['shape'])

  def dtype_code(self, name: str) -> str:
    return self._entries[name]['dtype']

  def tensor(self, name: str) -> np.ndarray:
    entry = self._entries[name]
    begin, end = entry['data_offsets']
    dtype = _numpy_dtype(entry['dtype'], self.path, name)
    out = np.empty(entry['shape'], dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(self.path, 'rb', buffering=0) as f:
      done = 0
      while done < end - begin:
        count = os.preadv(f.fileno(), [view[done:]], self._data_start + begin + done)
        if count == 0:
          raise UserError(f'{self.path} is truncated: tensor {name} ends past the end of the file')
        done += count
    return out


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """A tensor to be written: its name, shape and dtype, and a thunk that produces it."""

  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  produce: Callable[[], np.ndarray]

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize

  @classmethod
  def of(cls, name: str, array: np.ndarray) -> 'TensorEntry':
    return cls(name, tuple(array.shape), array.dtype, lambda: array)


_CODES = {'float32': 'F32', 'float16': 'F16', 'float64': 'F64', 'bfloat16': 'BF16'}


def write_safetensors(path: str, entries: list[TensorEntry], metadata: dict | None = None) -> None:
  """Writes a safetensors file one tensor at a time, atomically (temporary file + rename)."""
  header, offset = {}, 0
  for entry in entries:
    header[entry.name] = {'dtype': _CODES[entry.dtype.name], 'shape': list(entry.shape),
                          'data_offsets': [offset, offset + entry.nbytes]}
    offset += entry.nbytes
  if metadata:
    header['__metadata__'] = metadata
  encoded = json.dumps(header, separators=(',', ':')).encode()
  encoded += b' ' * (-len(encoded) % 8)  # keep tensor data 8-byte aligned
  temporary = path + '.partial'
  with open(temporary, 'wb') as f:
    f.write(struct.pack('<Q', len(encoded)))
    f.write(encoded)
    for entry in entries:
      tensor = np.ascontiguousarray(entry.produce(), dtype=entry.dtype)
      if tensor.shape != entry.shape:
        raise ValueError(f'tensor {entry.name} has shape {tensor.shape}, planned {entry.shape}')
      f.write(tensor.tobytes())
  os.replace(temporary, path)
