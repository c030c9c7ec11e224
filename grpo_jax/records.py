"""Row operations declared on a record's fields (STYLE.md principle 15).

A record that crosses a boundary inside the step (the decode slots, the decoded requests, the pool,
packed rows) says once, where it declares a field, which axis the field's arrays lead with:
`along('request')`, `along('token')`, ... The record's row operations then map over every field of
that kind, the optional ones (None: absent) included, so a field added later with its kind travels
through each of them without anyone listing it again.

  along(kind)                   a dataclass field whose arrays lead with `kind`'s axis
  fields_along(record, kind)    {name: value} of those fields
  map_along(record, kind, fn)   the record with fn applied to each of their leaves
"""

import dataclasses

import jax


def along(kind: str, **kwargs) -> dataclasses.Field:
  """A dataclass field (dataclasses.field's keywords) whose arrays lead with `kind`'s axis."""
  return dataclasses.field(metadata={**kwargs.pop('metadata', {}), 'along': kind}, **kwargs)


def names_along(record_or_class, kind: str) -> tuple[str, ...]:
  """The names of the fields along `kind`, in declaration order."""
  return tuple(field.name for field in dataclasses.fields(record_or_class) if field.metadata.get('along') == kind)


def fields_along(record, kind: str) -> dict:
  """{name: value} of the record's fields along `kind` (None where an optional one is absent)."""
  return {name: getattr(record, name) for name in names_along(record, kind)}


def map_along(record, kind: str, fn, *others):
  """`record` with fn applied to every leaf of its fields along `kind` (jax.tree.map: an absent
  field stays None); `others`: records (or dicts, holding at least those names) whose same fields
  fn takes as further arguments, read only where the record's field is present."""
  fields = fields_along(record, kind)
  value = lambda other, name: other[name] if isinstance(other, dict) else getattr(other, name)  # noqa: E731
  rest = [{name: None if fields[name] is None else value(other, name) for name in fields} for other in others]
  return dataclasses.replace(record, **jax.tree.map(fn, fields, *rest))
