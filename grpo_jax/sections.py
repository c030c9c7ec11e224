"""What a config section needs where it is defined (next to the code it configures; config.py
assembles the sections into a run's Config and loads it from YAML)."""

import contextlib
import dataclasses
import json

from grpo_jax.errors import FieldError


@contextlib.contextmanager
def section(name: str):
  """Names the fields of a section's own checks as the user writes them: `algo.group_size`."""
  try:
    yield
  except FieldError as error:
    raise error.renamed(f'{name}.{error.field}') from None


def inline(default):
  """A field holding a smaller section whose keys are written in this section itself: the rollout
  section's `sampling` (a SamplingConfig) is written `rollout.temperature`, not
  `rollout.sampling.temperature`. config.py reads and writes it so."""
  return dataclasses.field(default=default, metadata={'inline': True})


def is_inline(field: dataclasses.Field) -> bool:
  return bool(field.metadata.get('inline'))


class Arguments(dict):
  """A section's mapping of free keys, as written (`task.environment_args`): read-only and hashable
  like the frozen sections that hold it; its values are YAML's (numbers, strings, lists, mappings)."""

  def __hash__(self):
    return hash(json.dumps(self, sort_keys=True, default=repr))

  def _read_only(self, *args, **kwargs):
    raise TypeError('a config section\'s arguments are read-only')

  __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only
