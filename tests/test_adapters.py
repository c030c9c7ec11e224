"""Dataset adapters (data/adapters.py) on small files in each dataset's own schema, read through
the real sources (data/sources.py)."""

import json

import pytest

from grpo_jax.data.adapters import FORMATS, adapt, gsm8k_answer
from grpo_jax.data.sources import load_records
from grpo_jax.errors import UserError


def write_jsonl(path, records):
  path.write_text(''.join(json.dumps(record) + '\n' for record in records))
  return str(path)


def read(path, format, **fields):
  return adapt(load_records(path), format, path, **fields)


def test_gsm8k_answers_after_the_last_marker(tmp_path):
  records = [
      {'question': 'Natalia sold 48 clips in April and half as many in May. How many in all?',
       'answer': 'In May she sold 48/2 = <<48/2=24>>24.\nIn all 48+24 = <<48+24=72>>72.\n#### 72'},
      {'question': 'A house costs $1,250,000 and loses $2,500. What is it worth?',
       'answer': 'It is worth 1,250,000 - 2,500 = 1,247,500 dollars.\n#### $1,247,500.'},
      {'question': 'The temperature drops 1,000.5 degrees below zero. What is it?', 'answer': '#### -1,000.5'},
      {'question': 'Betty has #### in her notes and ends at 3.', 'answer': 'marker #### 4 then #### 3'},
      {'question': 'No final answer here?', 'answer': 'She works it out but never says.'},
      {'question': 'An empty marker?', 'answer': 'Work.\n####   '},
  ]
  adapted = read(write_jsonl(tmp_path / 'gsm8k.jsonl', records), 'gsm8k')
  assert [p.answer for p in adapted.problems] == ['72', '1247500', '-1000.5', '3']
  assert [p.prompt for p in adapted.problems] == [r['question'] for r in records[:4]]
  assert {p.data_source for p in adapted.problems} == {'gsm8k'} and adapted.skipped_no_answer == 2
  # Commas that are not thousands separators stay (a tuple answer).
  assert gsm8k_answer('#### 3,4') == '3,4' and gsm8k_answer('#### 12,345,678') == '12345678'


def test_math_and_math500(tmp_path):
  records = [
      {'problem': 'Simplify $\\frac{2}{4}$.', 'solution': 'Halve it: $\\boxed{\\frac{1}{2}}$.', 'type': 'Algebra'},
      {'problem': 'Compute $1+1$.', 'solution': 'First \\boxed{3}, no: $\\fbox{2}$.'},
      {'problem': 'Find $x$.', 'solution': 'It is $\\boxed{{x}^{2}}$ say.', 'answer': '5'},  # answer wins
      {'problem': 'Which interval?', 'solution': 'so $\\boxed{(1, 2]}$'},
      {'problem': 'Unboxed.', 'solution': 'The answer is 4.'},
      {'problem': 'Unclosed.', 'solution': '\\boxed{4'},
      {'problem': 'Empty answer field.', 'solution': 'no box', 'answer': '  '},
  ]
  adapted = read(write_jsonl(tmp_path / 'math.jsonl', records), 'math')
  assert [p.answer for p in adapted.problems] == ['\\frac{1}{2}', '2', '5', '(1, 2]']
  assert adapted.skipped_no_answer == 3
  assert adapted.problems[0].data_source == str(tmp_path / 'math.jsonl')


def test_dapo_in_verls_schema_from_parquet(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq
  records = [
      {'data_source': 'math_dapo', 'prompt': [{'role': 'user', 'content': 'Solve: 3 + 4 = ? Answer: $Answer'}],
       'ability': 'MATH', 'reward_model': {'ground_truth': '7', 'style': 'rule-lighteval/MATH_v2'}},
      {'data_source': 'math_dapo', 'prompt': [{'role': 'system', 'content': 'Think.'},
                                              {'role': 'user', 'content': 'Find n if 2n = 34.'}],
       'ability': 'MATH', 'reward_model': {'ground_truth': '17', 'style': 'rule-lighteval/MATH_v2'}},
      {'data_source': 'math_dapo', 'prompt': [{'role': 'user', 'content': 'No ground truth.'}],
       'ability': 'MATH', 'reward_model': {'ground_truth': '', 'style': 'rule'}},
  ]
  path = str(tmp_path / 'dapo.parquet')
  pq.write_table(pa.Table.from_pylist(records), path)
  adapted = read(path, 'dapo')
  assert [p.answer for p in adapted.problems] == ['7', '17'] and adapted.skipped_no_answer == 1
  assert adapted.problems[1].prompt == ({'role': 'system', 'content': 'Think.'},
                                        {'role': 'user', 'content': 'Find n if 2n = 34.'})
  assert {p.data_source for p in adapted.problems} == {'math_dapo'}


def test_dapo_processed_and_aime(tmp_path):
  processed = [{'prompt': 'Let $a$ be the least integer with 12 divisors. Find $a$.', 'solution': '60',
                'data_source': 'math_dapo'},
               {'prompt': 'Compute the sum.', 'solution': 34.0}]
  adapted = read(write_jsonl(tmp_path / 'p.jsonl', processed), 'dapo_processed')
  assert [(p.prompt, p.answer) for p in adapted.problems] == [(processed[0]['prompt'], '60'), ('Compute the sum.', '34')]
  assert adapted.problems[0].data_source == 'math_dapo'
  aime = [{'id': 60, 'problem': 'Every morning Aya walks 9 km. Find the minutes.', 'answer': 204, 'year': 2024},
          {'ID': '2024-II-4', 'Problem': 'Let x, y, z be positive reals. Find m + n.', 'Answer': 33}]
  adapted = read(write_jsonl(tmp_path / 'aime.jsonl', aime), 'aime')
  assert [p.answer for p in adapted.problems] == ['204', '33']
  assert [p.data_source for p in adapted.problems] == ['aime', 'aime']


def test_custom_fields_and_nested_answers(tmp_path):
  records = [{'q': 'What is 6 times 7?', 'meta': {'gold': 42}}, {'q': 'What is 2 + 2?', 'meta': {'gold': None}}]
  adapted = read(write_jsonl(tmp_path / 'c.jsonl', records), 'custom', prompt_field='q', answer_field='meta.gold')
  assert [(p.prompt, p.answer) for p in adapted.problems] == [('What is 6 times 7?', '42')]
  assert adapted.skipped_no_answer == 1


@pytest.mark.parametrize('format, records, fields, message', [
    ('gsm8k', [{'problem': 'x', 'answer': '#### 1'}], {}, "record 0 has no question in field 'question'"),
    ('aime', [{'question': 'x', 'answer': 1}], {}, "'problem' or 'Problem'"),
    ('dapo', [{'prompt': [{'role': 'user'}], 'reward_model': {'ground_truth': '1'}}], {}, 'chat messages'),
    ('custom', [{'prompt': 'x', 'solution': '1'}], {}, "usable reference answer (field 'answer')"),
    ('math', [{'problem': 'x', 'solution': 'none'}], {}, 'usable reference answer (the math answer)'),
    ('csv', [{'prompt': 'x'}], {}, 'is not one of custom, gsm8k'),
])
def test_errors_name_the_field_and_source(tmp_path, format, records, fields, message):
  path = write_jsonl(tmp_path / 'bad.jsonl', records)
  with pytest.raises(UserError, match='bad.jsonl' if format != 'csv' else 'csv') as error:
    read(path, format, **fields)
  assert message in str(error.value)
  assert set(FORMATS) == {'custom', 'gsm8k', 'math', 'dapo', 'dapo_processed', 'aime'}
