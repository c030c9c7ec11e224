"""The YAML form of a run's configuration, for any top-level config of sections (config.Config,
train_reward's RewardModelConfig): a file and `--set a.b=c` overrides read into the frozen section
dataclasses with every key and type checked (the first mistake one sentence naming the key), and
a config written back as plain dicts and YAML. Inline sections' keys are read and written in their
parent; tagged sections (`variants()`, `variant(name)`) take the class their `name` picks."""

import copy
import dataclasses
import math
import os
import types
import typing
from typing import Literal

import yaml

from grpo_jax.errors import FieldError, UserError, read_text
from grpo_jax.sections import Arguments, is_inline, section


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
    present = [option for option in options if option is not type(None)]
    if len(present) == 1:  # an optional field: its own error, which names the key inside it
      return _coerce(present[0], value, key)
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
  if origin is dict:  # free keys, values as written (task.environment_args)
    if not isinstance(value, dict):
      raise UserError(f'config key {key!r} expects a mapping, got {value!r}')
    for name in value:
      if not isinstance(name, str):
        raise UserError(f'config key {key!r}: its keys are names, got {name!r}')
    return Arguments(copy.deepcopy(value))
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise UserError(f'config key {key!r} expects a list, got {value!r}')
    (item,) = typing.get_args(kind)[:1]
    return tuple(_coerce(item, v, f'{key}[{i}]') for i, v in enumerate(value))
  if dataclasses.is_dataclass(kind):
    if not isinstance(value, dict):
      raise UserError(f'config key {key!r} expects a mapping of fields, got {value!r}')
    if hasattr(kind, 'variants'):
      kind, value = _variant(kind, value, key)
    return build(kind, value, key + '.')
  if kind is bool:
    if not isinstance(value, bool):
      raise UserError(f'config key {key!r} expects true or false, got {value!r}')
    return value
  if kind is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise UserError(f'config key {key!r} expects int, got {value!r}')
    return value
  if kind is float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise UserError(f'config key {key!r} expects float, got {value!r}')
    if not math.isfinite(value):
      raise UserError(f'config key {key!r} must be a finite number, got {value!r}')
    return float(value)
  if kind is str:
    if not isinstance(value, str):
      raise UserError(f'config key {key!r} expects a string, got {value!r}')
    return value
  raise TypeError(f'unsupported annotation {kind} for config key {key!r}')


def _keys(cls) -> dict:
  """{key as written: (field name, its inline field or None)} for a section class."""
  keys = {}
  for field in dataclasses.fields(cls):
    if is_inline(field):
      keys.update({inner.name: (inner.name, field) for inner in dataclasses.fields(field.default)})
    else:
      keys[field.name] = (field.name, None)
  return keys


def _default(cls, key: str):
  """The default of key `key` as written in section `cls` (an inline section's keys included)."""
  name, holder = _keys(cls)[key]
  if holder is not None:
    return getattr(holder.default, name)
  field = next(field for field in dataclasses.fields(cls) if field.name == name)
  return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _variant(tagged, data: dict, key: str, stored: bool = False):
  """The class of tagged section `tagged` that `data`'s `name` picks (`tagged.variant`, which names
  the known kinds for an unknown name), and `data` without the keys that belong to another of its
  classes. Those keys are accepted at their defaults: configs written before the section became a
  tagged union hold every kind's keys; any other value is an error naming the kind it applies to
  (`stored`: a checkpoint's config, whose other kinds' keys are dropped whatever they hold)."""
  variants = tagged.variants()
  tag = _coerce(typing.get_type_hints(tagged)['name'], data.get('name', tagged.name), f'{key}.name')
  with section(key):
    chosen = tagged.variant(tag)
  own = _keys(chosen)
  kept = {}
  for name, value in data.items():
    owners = [other for other, cls in variants.items() if other != tag and name in _keys(cls)]
    if name in own or not owners:  # its own key, or unknown to every kind (_build names it)
      kept[name] = value
      continue
    cls = variants[owners[0]]
    field_name, holder = _keys(cls)[name]
    hint = typing.get_type_hints(type(holder.default) if holder is not None else cls)[field_name]
    try:
      is_default = _coerce(hint, value, f'{key}.{name}') == _default(cls, name)
    except UserError:
      is_default = False
    if not (stored or is_default):
      raise UserError(f'config key {key + "." + name!r} applies to {key}.name: {" or ".join(owners)}, not {tag!r}')
  return chosen, kept


def build(cls, data: dict, prefix: str = ''):
  """Section class `cls` from its plain dict, every key and type checked (`prefix`: where it sits)."""
  hints = typing.get_type_hints(cls)
  keys = _keys(cls)
  for key in data:
    if key not in keys:
      raise UserError(f'unknown config key {prefix + str(key)!r} (valid keys here: {", ".join(keys)})')
  values, inlined = {}, {}
  for key, value in data.items():
    name, holder = keys[key]
    if holder is None:
      values[name] = _coerce(hints[name], value, prefix + name)
    else:
      inlined.setdefault(holder, {})[name] = _coerce(typing.get_type_hints(type(holder.default))[name], value,
                                                     prefix + name)
  try:
    for holder, fields in inlined.items():  # the inline section's own checks, its keys named as written
      values[holder.name] = dataclasses.replace(holder.default, **fields)
    return cls(**values)
  except FieldError as error:  # a section's own check: name the field as the user writes it
    if prefix and not error.field.startswith(prefix.split('.')[0]):
      raise error.renamed(prefix + error.field) from None
    raise
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


def read_sections(path: str | None, overrides: typing.Sequence[str], cls):
  """The top-level config `cls` (a frozen dataclass of sections: Config, or another entry point's)
  read from a YAML file (or only defaults when `path` is None) with `--set` overrides applied, every
  key and type checked."""
  data = {}
  if path is not None:
    if not os.path.isfile(path):
      raise UserError(f'config file {path} not found')
    text = read_text(path, 'config file')
    try:
      data = yaml.safe_load(text)
    except yaml.YAMLError as error:
      raise UserError(f'config file {path} is not valid YAML: {str(error).splitlines()[0]}') from None
    if data is None and not overrides:  # an empty file and no --set: not a silent default run
      raise UserError(f'config file {path} is empty (write at least one section, e.g. from configs/)')
    data = data or {}
    if not isinstance(data, dict):
      raise UserError(f'config file {path} must hold a mapping of sections, got {type(data).__name__}')
  switched = {assignment.split('=', 1)[0].strip().split('.')[0] for assignment in overrides
              if assignment.split('=', 1)[0].strip().endswith('.name')}
  if switched:  # --set task.name=... switches the file's kind: the file's keys of its other kinds go
    probe = copy.deepcopy(data)
    for assignment in overrides:
      _apply_override(probe, assignment)
    data = without_other_kinds(data, switched, probe, cls)
  for assignment in overrides:
    _apply_override(data, assignment)
  return build(cls, data)


def without_other_kinds(data: dict, sections, final: dict, cls) -> dict:
  """`data` without the keys of tagged `sections` that belong to another kind than the one `final`
  (the same data, overrides applied) picks: a stored config's, or a file's whose kind the command
  line changes. `cls`: the top-level config."""
  data = dict(data)
  hints = typing.get_type_hints(cls)
  for name in sections:
    kind = hints.get(name)
    if hasattr(kind, 'variants') and isinstance(data.get(name), dict) and isinstance(final.get(name), dict):
      tag = final[name].get('name', kind.name)
      data[name] = _variant(kind, dict(data[name], name=tag), name, stored=True)[1]
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None
    if hasattr(item, 'variants') and isinstance(data.get(name), list):  # a list of tagged sections (rewards)
      data[name] = [_variant(item, entry, f'{name}[{index}]', stored=True)[1] if isinstance(entry, dict) else entry
                    for index, entry in enumerate(data[name])]
  return data


def to_dict(config) -> dict:
  """Plain nested dict (tuples as lists, inline sections' keys in their parent), the form written
  to config.yaml."""
  def plain(value):
    if dataclasses.is_dataclass(value):
      out = {}
      for field in dataclasses.fields(value):
        inner = plain(getattr(value, field.name))
        if is_inline(field):
          out.update(inner)
        else:
          out[field.name] = inner
      return out
    if isinstance(value, (tuple, list)):
      return [plain(v) for v in value]
    if isinstance(value, dict):
      return {k: plain(v) for k, v in value.items()}
    return value
  return plain(config)


def to_yaml(config) -> str:
  return yaml.safe_dump(to_dict(config), sort_keys=False)
