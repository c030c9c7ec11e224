"""Run configuration: typed, frozen dataclasses loaded from YAML with `--set a.b=c` overrides.

Every field has a default and a one-line comment. Loading checks every key and type and reports the
first mistake in one sentence naming the key, e.g. `config key 'mesh.tensor' expects int, got 'two'`.
"""

import dataclasses
import datetime
import os
import types
import typing
from typing import Literal

import yaml

from grpo_jax.errors import UserError
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.sharding import MeshConfig

DType = Literal['float32', 'bfloat16']


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Which model to load and how to run it."""

  path: str | None = None  # Hugging Face dir or grpo_jax checkpoint; None: random init from `architecture`
  architecture: Qwen2Config = Qwen2Config()  # used only when `path` is None
  dtype: DType = 'float32'  # compute dtype of activations and matmuls
  param_dtype: DType = 'float32'  # storage dtype of parameters (fp32 master weights with bf16 compute)
  remat: Literal['none', 'full', 'dots', 'dots_no_batch'] = 'none'  # per-layer rematerialisation
  scan_layers: bool = True  # one lax.scan over layers: compile time independent of depth


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Identity and reproducibility of a run."""

  name: str = 'run'  # used in the default workdir runs/<name>-<timestamp>
  seed: int = 0  # seeds parameter init, sampling and data order
  workdir: str | None = None  # output directory; None: runs/<name>-<timestamp>


@dataclasses.dataclass(frozen=True)
class Config:
  run: RunConfig = RunConfig()
  model: ModelConfig = ModelConfig()
  mesh: MeshConfig = MeshConfig()


# ---- loading ----

def _type_name(kind) -> str:
  if typing.get_origin(kind) is Literal:
    return ' | '.join(repr(v) for v in typing.get_args(kind))
  if isinstance(kind, type):
    return kind.__name__
  return str(kind).replace('typing.', '')


def _coerce(kind, value, key: str):
  """Checks `value` against the annotation `kind`; returns it converted (lists -> tuples, ...)."""
  origin = typing.get_origin(kind)
  if origin in (typing.Union, types.UnionType):
    options = typing.get_args(kind)
    if value is None and type(None) in options:
      return None
    errors = []
    for option in options:
      if option is type(None):
        continue
      try:
        return _coerce(option, value, key)
      except UserError as error:
        errors.append(error)
    raise UserError(f'config key {key!r} expects {_type_name(kind)}, got {value!r}')
  if origin is Literal:
    if value not in typing.get_args(kind):
      raise UserError(f'config key {key!r} must be one of {_type_name(kind)}, got {value!r}')
    return value
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise UserError(f'config key {key!r} expects a list, got {value!r}')
    (item,) = typing.get_args(kind)[:1]
    return tuple(_coerce(item, v, f'{key}[{i}]') for i, v in enumerate(value))
  if dataclasses.is_dataclass(kind):
    if not isinstance(value, dict):
      raise UserError(f'config key {key!r} expects a mapping of fields, got {value!r}')
    return _build(kind, value, key + '.')
  if kind is bool:
    if not isinstance(value, bool):
      raise UserError(f'config key {key!r} expects true or false, got {value!r}')
    return value
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise UserError(f'config key {key!r} expects int, got {value!r}')
    return value
  if kind is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise UserError(f'config key {key!r} expects float, got {value!r}')
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise UserError(f'config key {key!r} expects a string, got {value!r}')
    return value
  raise TypeError(f'unsupported annotation {kind} for config key {key!r}')


def _build(cls, data: dict, prefix: str = ''):
  hints = typing.get_type_hints(cls)
  names = [field.name for field in dataclasses.fields(cls)]
  for key in data:
    if key not in names:
      raise UserError(f'unknown config key {prefix + str(key)!r} (valid keys here: {", ".join(names)})')
  values = {name: _coerce(hints[name], data[name], prefix + name) for name in names if name in data}
  try:
    return cls(**values)
  except UserError as error:
    raise UserError(f'config section {prefix.rstrip(".") or "top level"}: {error}') from None


def _apply_override(data: dict, assignment: str) -> None:
  if '=' not in assignment:
    raise UserError(f'--set {assignment!r} is not of the form key.path=value')
  key, raw = assignment.split('=', 1)
  parts = key.strip().split('.')
  node = data
  for part in parts[:-1]:
    child = node.setdefault(part, {})
    if not isinstance(child, dict):
      raise UserError(f'--set {key}: {part!r} is a value, not a section')
    node = child
  node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ''


def load_config(path: str | None, overrides: typing.Sequence[str] = ()) -> Config:
  """Reads a YAML file (or only defaults when `path` is None) and applies `--set` overrides."""
  data = {}
  if path is not None:
    if not os.path.isfile(path):
      raise UserError(f'config file {path} not found')
    try:
      with open(path) as f:
        data = yaml.safe_load(f) or {}
    except yaml.YAMLError as error:
      raise UserError(f'config file {path} is not valid YAML: {str(error).splitlines()[0]}') from None
    if not isinstance(data, dict):
      raise UserError(f'config file {path} must hold a mapping of sections, got {type(data).__name__}')
  for assignment in overrides:
    _apply_override(data, assignment)
  return _build(Config, data)


def to_dict(config) -> dict:
  """Plain nested dict (tuples as lists), the form written to config.yaml."""
  def plain(value):
    if isinstance(value, (tuple, list)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return value
  return plain(dataclasses.asdict(config))


def to_yaml(config) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False)


def resolve_workdir(config: Config, config_path: str | None, workdir: str | None) -> str:
  """--workdir, else run.workdir, else runs/<name>-<timestamp> (name defaults to the file's stem)."""
  chosen = workdir or config.run.workdir
  if chosen:
    return chosen
  name = config.run.name
  if name == RunConfig.name and config_path:
    name = os.path.splitext(os.path.basename(config_path))[0]
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return os.path.join('runs', f'{name}-{stamp}')
