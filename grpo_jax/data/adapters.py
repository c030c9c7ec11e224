"""Dataset adapters: the records of a math dataset as (prompt, reference answer, data source).

`adapt(records, format, source, prompt_field, answer_field)` maps the plain dict records of
data/sources.py with one of these schemas (`task.format` / `eval.format`):

  custom          the question in `prompt_field`, the answer in `answer_field` (dotted paths such as
                  reward_model.ground_truth read nested fields); data_source from the record's
                  `data_source` field when it has one
  gsm8k           GSM8K (openai/gsm8k, tfds gsm8k): `question`; `answer` is a worked solution ending
                  in `#### N`: the reference is N without thousands separators, `$` or a final period
  math            MATH / MATH-500: `problem`; the `answer` field when present, else the content of
                  the last \\boxed{} (or \\fbox{}) of `solution`
  dapo            DAPO-Math-17k in verl's schema: `prompt` is a list of chat messages,
                  `reward_model.ground_truth` the answer, `data_source` the source
  dapo_processed  open-r1/DAPO-Math-17k-Processed: `prompt` (the problem text), `solution` (the answer)
  aime            AIME 2024: `problem` (or `Problem`), `answer` (or `Answer`, often an integer)

A prompt is question text (rendered later through task.prompt_template and the chat template) or a
tuple of chat messages (rendered through the chat template only). Records without a usable answer
are dropped and counted; a record without its question is an error naming the field, the record
and the source.
"""

import dataclasses
import re
from typing import Literal, get_args

from grpo_jax.data.rewards import last_boxed
from grpo_jax.errors import UserError

DatasetFormat = Literal['custom', 'gsm8k', 'math', 'dapo', 'dapo_processed', 'aime']
FORMATS = get_args(DatasetFormat)
_THOUSANDS = re.compile(r'(?<=\d),(?=\d{3}(?:\D|$))')


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: `prompt` (question text, or chat messages as a tuple of {'role', 'content'}
  dicts), `answer` (the reference, a bare expression), `data_source` (for per-source metrics)."""

  prompt: str | tuple[dict, ...]
  answer: str
  data_source: str


@dataclasses.dataclass(frozen=True)
class Adapted:
  problems: list[Problem]
  skipped_no_answer: int  # records dropped for want of a usable reference answer


def _field(record: dict, path: str):
  """record[a][b] for path 'a.b'; None when any part is missing."""
  value = record
  for part in path.split('.'):
    if not isinstance(value, dict) or part not in value:
      return None
    value = value[part]
  return value


def _first(record: dict, *paths: str):
  return next((value for value in (_field(record, path) for path in paths) if value is not None), None)


def _text(value) -> str | None:
  """An answer as a string: numbers without a spurious '.0', blanks as None."""
  if value is None or isinstance(value, bool):
    return None
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  text = str(value).strip()
  return text or None


def gsm8k_answer(solution) -> str | None:
  """The number after the last '####' of a GSM8K solution, as a bare number ('1,234.' -> '1234')."""
  if not isinstance(solution, str) or '####' not in solution:
    return None
  answer = solution.rsplit('####', 1)[1].strip()
  answer = _THOUSANDS.sub('', answer).removeprefix('$').strip().rstrip('.').strip()
  return answer or None


def _math_answer(record: dict) -> str | None:
  answer = _text(record.get('answer'))
  if answer is not None:
    return answer
  solution = record.get('solution')
  return _text(last_boxed(solution)) if isinstance(solution, str) else None


# format -> (question fields, answer function, default data source or None for the config's source)
_SCHEMAS = {
    'gsm8k': (('question',), lambda record: gsm8k_answer(record.get('answer')), 'gsm8k'),
    'math': (('problem',), _math_answer, None),
    'dapo': (('prompt',), lambda record: _text(_field(record, 'reward_model.ground_truth')), None),
    'dapo_processed': (('prompt',), lambda record: _text(record.get('solution')), None),
    'aime': (('problem', 'Problem'), lambda record: _text(_first(record, 'answer', 'Answer')), 'aime'),
}


def _messages(value, index: int, where: str) -> tuple[dict, ...]:
  if not value or not all(isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)
                          for m in value):
    raise UserError(f'{where}: record {index} holds chat messages that are not all {{"role": str, "content": str}}')
  return tuple({'role': m['role'], 'content': m['content']} for m in value)


def adapt(records: list[dict], format: str, source: str, prompt_field: str = 'prompt',
          answer_field: str = 'answer') -> Adapted:
  """The problems of `records` read with `format` (see the module docstring); `source` (the
  config's source string) names them in messages and is the default data source."""
  if format not in FORMATS:
    raise UserError(f'dataset format {format!r} is not one of {", ".join(FORMATS)}')
  if format == 'custom':
    question_fields, answer_of, default_source = (prompt_field,), (lambda r: _text(_field(r, answer_field))), None
  else:
    question_fields, answer_of, default_source = _SCHEMAS[format]
  where = f'{source} (format {format})'
  problems, skipped = [], 0
  for index, record in enumerate(records):
    question = _first(record, *question_fields)
    if isinstance(question, (list, tuple)):
      question = _messages(question, index, where)
    elif not isinstance(question, str) or not question.strip():
      raise UserError(f'{where}: record {index} has no question in field {" or ".join(map(repr, question_fields))} '
                      f'(its fields: {", ".join(map(str, record))})')
    answer = answer_of(record)
    if answer is None:
      skipped += 1
      continue
    data_source = _text(record.get('data_source')) or default_source or source
    problems.append(Problem(prompt=question, answer=answer, data_source=data_source))
  if not problems:
    what = f'field {answer_field!r}' if format == 'custom' else f'the {format} answer'
    raise UserError(f'{where}: none of its {len(records)} records has a usable reference answer ({what})')
  return Adapted(problems=problems, skipped_no_answer=skipped)
