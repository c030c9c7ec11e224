"""What a config section needs where it is defined (next to the code it configures; config.py
assembles the sections into a run's Config and loads it from YAML)."""

import contextlib
import dataclasses

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
