"""Dataset records from local files, the Hugging Face datasets cache or TensorFlow Datasets.

`load_records(source, split)` returns a list of plain dicts. `source` is one of
  path/to/data.jsonl | .json | .parquet   a local file (`split` picks a key of a {split: [...]} .json)
  hf:<name>[:<config>]                     `datasets.load_dataset`, from the local cache only
  tfds:<name>                              `tensorflow_datasets.load(download=False)`, prepared data only
Nothing is downloaded: a dataset that is not on this machine is a one-line error saying so.
`datasets` and `tensorflow-datasets` come with requirements-extras.txt and are imported only when
a source needs them.
"""

import dataclasses
import json
import os

from grpo_jax.data.adapters import DatasetFormat
from grpo_jax.errors import UserError, quiet_native_stderr, read_text

FILE_FORMATS = ('.jsonl', '.json', '.parquet')


@dataclasses.dataclass(frozen=True)
class DatasetSource:
  """One dataset of problems: written in the task and eval sections themselves (`task.source`,
  `eval.split`, ...) and as each entry of `task.mix`."""

  source: str | None = None  # .jsonl/.json/.parquet file, hf:<name>[:<config>] or tfds:<name>
  split: str = 'train'
  format: DatasetFormat = 'custom'  # dataset schema (data/adapters.py; geo3k, verl, vision: with images)
  prompt_field: str = 'prompt'  # formats custom and vision: field holding the question (or chat messages)
  answer_field: str = 'answer'  # formats custom and vision: field holding the reference answer
  images_field: str = 'images'  # format vision: field holding the images (a list, or one image)


def load_records(source: str, split: str = 'train') -> list[dict]:
  """The records of `split` of `source` (see the module docstring), each a dict of its fields."""
  if source.startswith('hf:'):
    records = _load_hf(source, split)
  elif source.startswith('tfds:'):
    records = _load_tfds(source, split)
  else:
    records = _load_file(source, split)
  if not records:
    raise UserError(f'task.source {source} (split {split!r}) has no records')
  return records


def column(records: list[dict], field: str, key: str, source: str) -> list:
  """record[field] for every record; a dotted field ('reward_model.ground_truth') reads nested
  dicts. A record without it is an error naming the config `key`, the field and the source."""
  values = []
  for index, record in enumerate(records):
    value = record
    for part in field.split('.'):
      if not isinstance(value, dict) or part not in value:
        raise UserError(f'{key} {field!r} is not a field of record {index} of {source} '
                        f'(its fields: {", ".join(map(str, record))})')
      value = value[part]
    if value is None:
      raise UserError(f'{key} {field!r} is empty (null) in record {index} of {source}')
    values.append(value)
  return values


# ---- local files ----

def _load_file(path: str, split: str) -> list[dict]:
  extension = os.path.splitext(path)[1].lower()
  if extension not in FILE_FORMATS:
    raise UserError(f'task.source {path!r} is not a {"/".join(FILE_FORMATS)} file, hf:<name>[:<config>] '
                    f'or tfds:<name>')
  if not os.path.isfile(path):
    raise UserError(f'task.source {path} not found')
  if extension == '.parquet':
    return _read_parquet(path)
  text = read_text(path, 'task.source')
  if extension == '.jsonl':
    return _read_json_lines(text, path)
  try:
    data = json.loads(text)
  except json.JSONDecodeError as error:
    if error.msg != 'Extra data':
      raise UserError(f'{path} is not valid JSON: {error}') from None
    return _read_json_lines(text, path)  # datasets' to_json writes JSON lines under a .json name
  if isinstance(data, dict) and isinstance(data.get(split), list):
    data = data[split]
  if not isinstance(data, list):
    raise UserError(f'{path} must hold a list of records or a {{"{split}": [...]}} mapping, '
                    f'got {type(data).__name__}' + (f' with keys {", ".join(data)}' if isinstance(data, dict) else ''))
  return _check_dicts(data, path)


def _read_json_lines(text: str, path: str) -> list[dict]:
  records = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError as error:
      raise UserError(f'{path} line {number} is not valid JSON: {error.msg}') from None
  return _check_dicts(records, path)


def _read_parquet(path: str) -> list[dict]:
  try:
    import pyarrow.parquet as parquet
  except ImportError:
    raise UserError(f'reading {path} needs the pyarrow package (pip install pyarrow)') from None
  try:
    return parquet.read_table(path).to_pylist()
  except Exception as error:  # pyarrow's errors have no common base beyond ArrowException/OSError
    raise UserError(f'{path} is not a readable parquet file: {str(error).splitlines()[0]}') from None


def _check_dicts(records: list, path: str) -> list[dict]:
  for index, record in enumerate(records):
    if not isinstance(record, dict):
      raise UserError(f'record {index} of {path} is a {type(record).__name__}, not an object of fields')
  return records


# ---- Hugging Face datasets (local cache only) ----

def _load_hf(source: str, split: str) -> list[dict]:
  name, _, config = source[len('hf:'):].partition(':')
  if not name:
    raise UserError(f'task.source {source!r} names no dataset (expected hf:<name>[:<config>])')
  # Read at import time by datasets and huggingface_hub, and set again in case they are imported.
  os.environ['HF_DATASETS_OFFLINE'] = '1'
  os.environ['HF_HUB_OFFLINE'] = '1'
  try:
    import datasets
  except ImportError:
    raise UserError(f'task.source {source} needs the datasets package '
                    f'(pip install -r requirements-extras.txt)') from None
  import huggingface_hub.constants
  datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
  huggingface_hub.constants.HF_HUB_OFFLINE = True
  datasets.logging.set_verbosity_error()
  try:
    dataset = datasets.load_dataset(name, config or None, split=split)
  except Exception as error:  # offline misses raise ConnectionError, FileNotFoundError, DatasetNotFoundError, ...
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise UserError(f'task.source {source} (split {split!r}) could not be loaded from the local Hugging Face '
                    f'cache ({datasets.config.HF_DATASETS_CACHE}) and nothing is downloaded at run time: '
                    f'load it once with network access, or point task.source at a local file ({reason})') from None
  return dataset.to_list()


# ---- TensorFlow Datasets (prepared data only) ----

def _load_tfds(source: str, split: str) -> list[dict]:
  name = source[len('tfds:'):]
  if not name:
    raise UserError(f'task.source {source!r} names no dataset (expected tfds:<name>)')
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  try:
    with quiet_native_stderr():  # TensorFlow's native start-up notices (cuInit, oneDNN)
      import tensorflow as tf
      import tensorflow_datasets as tfds
      try:
        tf.config.set_visible_devices([], 'GPU')  # TensorFlow must not reserve accelerator memory
      except RuntimeError:
        pass  # TensorFlow's devices are already initialised
  except ImportError:
    raise UserError(f'task.source {source} needs the tensorflow-datasets package '
                    f'(pip install -r requirements-extras.txt)') from None
  try:
    dataset = tfds.load(name, split=split, download=False, try_gcs=False)
  except Exception as error:  # unknown names, unprepared data and bad splits raise different types
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise UserError(f'task.source {source} (split {split!r}) is not prepared under the TFDS data dir and '
                    f'nothing is downloaded at run time ({reason})') from None
  return [_plain(example) for example in tfds.as_numpy(dataset)]


def _plain(value):
  """TFDS numpy values as Python ones: bytes -> str, numpy scalars -> numbers, nested dicts kept."""
  if isinstance(value, dict):
    return {key: _plain(item) for key, item in value.items()}
  if isinstance(value, bytes):
    return value.decode('utf-8')
  if hasattr(value, 'tolist'):
    plain = value.tolist()
    if isinstance(plain, list):
      return [_plain(item) for item in plain]
    return plain.decode('utf-8') if isinstance(plain, bytes) else plain
  return value
