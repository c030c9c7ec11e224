"""Dataset adapters: the records of a math dataset as (prompt, reference answer, data source).

`adapt(records, format, source, prompt_field, answer_field)` reads the plain dict records of
data/sources.py in one of these schemas (`task.format`, `eval.format`):

  custom          the question in `prompt_field`, the answer in `answer_field`; dotted names such as
                  reward_model.ground_truth read nested fields
  gsm8k           GSM8K (openai/gsm8k, tfds gsm8k): `question`; `answer` is a worked solution that
                  ends in `#### N`, and the reference is N without `$`, thousands separators or a
                  final period
  math            MATH (hendrycks competition_math) and MATH-500: `problem`; the reference is the
                  `answer` field when it is filled (MATH-500), else the content of the last
                  \\boxed{} or \\fbox{} of `solution`
  dapo            DAPO-Math-17k in verl's schema: `prompt` is a list of chat messages,
                  `reward_model.ground_truth` the reference
  dapo_processed  open-r1/DAPO-Math-17k-Processed: `prompt` (problem text), `solution` (the reference)
  aime            AIME 2024 (HuggingFaceH4/aime_2024, Maxwell-Jia/AIME_2024): `problem` or `Problem`,
                  `answer` or `Answer` (often an integer); data source 'aime'
  prompts         prompts without reference answers, for runs scored by models (a reward model,
                  data/reward_terms.py): the question (text or chat messages) in `prompt_field`;
                  every record is kept, its reference empty (NO_REFERENCE)

The formats geo3k, verl and vision are the schemas of problems with images, which
data/multimodal.py reads (task.name: math with a vision-language model); adapt() reads the others.

Every format takes the data source (the key of per-source eval metrics) from the record's
`data_source` field when it has one, else from the format's default, else from `source`.
A record without its question is an error; one without a usable reference answer is dropped and
counted in `Adapted.skipped_no_answer`.
"""

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Literal, get_args

from grpo_jax.data.rewards import last_boxed
from grpo_jax.errors import UserError

TextFormat = Literal['custom', 'gsm8k', 'math', 'dapo', 'dapo_processed', 'aime', 'prompts']
FORMATS: tuple[str, ...] = get_args(TextFormat)  # the schemas adapt() reads
NO_REFERENCE = ''  # the reference answer of a problem from a dataset of prompts alone (format prompts)
UNREFERENCED_FORMATS = ('prompts',)  # formats whose problems have no reference answer
# Schemas whose records carry images: data/multimodal.py reads them, with their images.
VisionFormat = Literal['geo3k', 'verl', 'vision']
DatasetFormat = Literal[TextFormat, VisionFormat]  # task.format, eval.format

# Only a whole number with comma groups loses its commas: '1,234' is a number, '3,4' a pair.
_GROUPED_NUMBER = re.compile(r'[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?')


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem of a dataset.

  prompt: question text (rendered later through task.prompt_template and the chat template) or
    chat messages, a tuple of {'role': str, 'content': str} dicts (rendered by the chat template only).
  answer: the reference answer, a bare expression such as '42', '\\frac{1}{2}' or '(1, 2)'.
  data_source: the dataset the problem came from, for per-source evaluation metrics.
  """

  prompt: str | tuple[dict, ...]
  answer: str
  data_source: str


@dataclasses.dataclass(frozen=True)
class Adapted:
  """The problems of a dataset, in record order, and how many records had no usable answer."""

  problems: list[Problem]
  skipped_no_answer: int  # records dropped because their reference answer is missing or empty


@dataclasses.dataclass(frozen=True)
class _Schema:
  """Where one format keeps its fields. prompt_fields: the first one a record has holds the
  question; answer: record -> reference or None; answer_fields: where `answer` looks, for messages;
  data_source: used when a record has no `data_source` field (None: the config's source)."""

  prompt_fields: tuple[str, ...]
  answer: Callable[[dict], str | None]
  answer_fields: str
  data_source: str | None = None


def lookup(record: dict, path: str):
  """record['a']['b'] for path 'a.b'; None when a part is missing."""
  value = record
  for part in path.split('.'):
    if not isinstance(value, dict) or part not in value:
      return None
    value = value[part]
  return value


def scalar_text(value) -> str | None:
  """A scalar field as stripped text: integral floats without '.0' (parquet and JSON store 204 as
  204.0 in float columns); None for null, NaN (pandas' missing value), booleans, lists and blanks."""
  if isinstance(value, float):
    if not math.isfinite(value):
      return None
    value = int(value) if value.is_integer() else value
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    return None
  return str(value).strip() or None


def _gsm8k_answer(record: dict) -> str | None:
  solution = record.get('answer')
  if not isinstance(solution, str) or '####' not in solution:
    return None
  answer = solution.rpartition('####')[2].strip().removeprefix('$').strip().rstrip('.').strip()
  if _GROUPED_NUMBER.fullmatch(answer):
    answer = answer.replace(',', '')
  return answer or None


def _math_answer(record: dict) -> str | None:
  answer = scalar_text(record.get('answer'))
  solution = record.get('solution')
  if answer is None and isinstance(solution, str):
    answer = scalar_text(last_boxed(solution))
  return answer


def _first_answer(*paths: str) -> Callable[[dict], str | None]:
  return lambda record: next((text for text in (scalar_text(lookup(record, path)) for path in paths) if text), None)


_SCHEMAS = {
    'gsm8k': _Schema(('question',), _gsm8k_answer, "field 'answer' (a solution ending in '#### N')"),
    'math': _Schema(('problem',), _math_answer, "field 'answer' or a \\boxed{} in field 'solution'"),
    'dapo': _Schema(('prompt',), _first_answer('reward_model.ground_truth'), "field 'reward_model.ground_truth'"),
    'dapo_processed': _Schema(('prompt',), _first_answer('solution'), "field 'solution'"),
    'aime': _Schema(('problem', 'Problem'), _first_answer('answer', 'Answer'), "field 'answer' or 'Answer'", 'aime'),
}


def _prompt(record: dict, fields: tuple[str, ...], where: str) -> str | tuple[dict, ...]:
  """The question of `record`: text, or its chat messages as a tuple of plain dicts."""
  field = next((field for field in fields if lookup(record, field) is not None), None)
  if field is None:
    raise UserError(f'{where} has no question in field {" or ".join(map(repr, fields))} '
                    f'(missing or null; its fields: {", ".join(map(str, record))})')
  value = lookup(record, field)
  if isinstance(value, str):
    if not value.strip():
      raise UserError(f'{where} has an empty question in field {field!r}')
    return value
  if not isinstance(value, (list, tuple)):
    raise UserError(f'{where} field {field!r} is a {type(value).__name__}, not question text or chat messages')
  bad = not_a_message(value)
  if bad is not None:
    raise UserError(f'{where} field {field!r} holds a chat message that is not a {{"role": str, "content": str}} '
                    f'dict: {str(bad)[:80]}')
  if not value:
    raise UserError(f'{where} field {field!r} is an empty list of chat messages')
  return plain_messages(value)


def not_a_message(messages) -> object | None:
  """The first of `messages` that is not a chat message ({"role": str, "content": str}), or None."""
  def is_message(message) -> bool:
    return isinstance(message, dict) and isinstance(message.get('role'), str) and isinstance(message.get('content'), str)
  return next((message for message in messages if not is_message(message)), None)


def plain_messages(messages) -> tuple[dict, ...]:
  """Chat messages with their role and content only: parquet gives every message each key any message
  has, filled with None."""
  return tuple({'role': message['role'], 'content': message['content']} for message in messages)


def adapt(records: list[dict], format: str, source: str, prompt_field: str = 'prompt',
          answer_field: str = 'answer') -> Adapted:
  """The problems of `records` read in `format` (see the module docstring). `source` (the config's
  source string) names the dataset in messages and is the default data source; `prompt_field` and
  `answer_field` (dotted names allowed) are read by the custom format only."""
  if format not in FORMATS:
    raise UserError(f'dataset format {format!r} of {source} is not one of {", ".join(FORMATS)}')
  if format == 'prompts':
    schema = _Schema((prompt_field,), lambda record: NO_REFERENCE, 'no field: prompts alone')
  else:
    schema = _SCHEMAS.get(format) or _Schema((prompt_field,), _first_answer(answer_field), f'field {answer_field!r}')
  problems, skipped = [], 0
  for index, record in enumerate(records):
    prompt = _prompt(record, schema.prompt_fields, f'record {index} of {source} (format {format})')
    answer = schema.answer(record)
    if answer is None:
      skipped += 1
      continue
    data_source = scalar_text(record.get('data_source')) or schema.data_source or source
    problems.append(Problem(prompt=prompt, answer=answer, data_source=data_source))
  if not problems:
    raise UserError(f'none of the {len(records)} records of {source} (format {format}) has a usable reference '
                    f'answer in {schema.answer_fields}')
  return Adapted(problems=problems, skipped_no_answer=skipped)
