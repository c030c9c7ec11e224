"""Dataset adapters (data/adapters.py) on small files written in each dataset's own schema and read
back through data/sources.py, as training reads them."""

import json

import pytest

from grpo_jax.data.adapters import FORMATS, NO_REFERENCE, Problem, adapt
from grpo_jax.data.sources import load_records
from grpo_jax.errors import UserError


def write_jsonl(path, records) -> str:
  path.write_text(''.join(json.dumps(record) + '\n' for record in records))
  return str(path)


def write_parquet(path, records) -> str:
  import pyarrow as pa
  import pyarrow.parquet as pq
  pq.write_table(pa.Table.from_pylist(records), str(path))
  return str(path)


def read(path: str, format: str, **fields):
  return adapt(load_records(path), format, path, **fields)


def test_gsm8k_final_answers(tmp_path):
  records = [
      {'question': 'Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. '
                   'How many clips did Natalia sell altogether in April and May?',
       'answer': 'Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n'
                 'Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72'},
      {'question': 'A house bought for $1,200,000 gains $47,500 in value. What is it worth now?',
       'answer': 'It is worth 1,200,000 + 47,500 = <<1200000+47500=1247500>>1,247,500 dollars.\n#### $1,247,500.'},
      {'question': 'A diver starts at sea level and descends 1,000.5 meters. What is her elevation?',
       'answer': 'Below sea level is negative, so her elevation is -1,000.5 meters.\n#### -1,000.5'},
      {'question': 'Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?',
       'answer': 'Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n'
                 'She earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10.00'},
      {'question': 'Tom writes "#### 5" on the board, then erases it and writes the true total of 2 + 1.',
       'answer': 'He first wrote #### 5 by mistake.\nThe total is 2+1 = <<2+1=3>>3.\n#### 3'},
      {'question': 'Betty needs $100 for a wallet and has half. How much more does she need?',
       'answer': 'Betty has 100 / 2 = $<<100/2=50>>50, so she needs 50 more dollars.'},
      {'question': 'James runs 3 sprints 3 times a week, 60 meters each. How many meters a week?',
       'answer': 'He runs 3 * 3 = 9 sprints, so 9 * 60 = 540 meters.\n####   '},
  ]
  path = write_jsonl(tmp_path / 'gsm8k_train.jsonl', records)
  adapted = read(path, 'gsm8k')
  assert [problem.answer for problem in adapted.problems] == ['72', '1247500', '-1000.5', '10.00', '3']
  assert [problem.prompt for problem in adapted.problems] == [record['question'] for record in records[:5]]
  assert {problem.data_source for problem in adapted.problems} == {path}
  assert adapted.skipped_no_answer == 2  # no '####', and nothing after it


def test_gsm8k_keeps_commas_that_do_not_group_thousands(tmp_path):
  records = [{'question': 'Give the point where the lines cross.', 'answer': 'They cross at x = 3, y = 4.\n#### 3,4'},
             {'question': 'How many grains of sand in the jar?', 'answer': 'About 12,345,678.\n#### 12,345,678'}]
  adapted = read(write_jsonl(tmp_path / 'gsm8k.jsonl', records), 'gsm8k')
  assert [problem.answer for problem in adapted.problems] == ['3,4', '12345678']


def test_math_and_math500(tmp_path):
  records = [
      {'problem': 'Simplify $\\frac{2}{4}$.', 'level': 'Level 1', 'type': 'Prealgebra',
       'solution': 'Divide top and bottom by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$.'},
      {'problem': 'What is $\\sqrt{16}$?', 'level': 'Level 1', 'type': 'Algebra',
       'solution': 'One might guess $\\boxed{8}$, but $4^2 = 16$, so the answer is $\\fbox{4}$.'},
      {'problem': 'Find the interval where $x^2 - 3x + 2 \\le 0$.', 'solution': 'It factors, giving $\\boxed{[1, 2]}$.',
       'answer': '[1,2]', 'subject': 'Algebra', 'level': 2, 'unique_id': 'test/algebra/1.json'},  # MATH-500
      {'problem': 'Compute $\\binom{5}{2}$.', 'solution': 'It is $\\boxed{10}$.', 'answer': '',
       'data_source': 'math500'},  # an empty answer field falls back to the solution
      {'problem': 'Evaluate $2 + 2$.', 'solution': 'Adding, the result is 4.'},
      {'problem': 'Evaluate $3 + 3$.', 'solution': 'So it is $\\boxed{6$ and the box never closes.'},
  ]
  path = write_jsonl(tmp_path / 'math.jsonl', records)
  adapted = read(path, 'math')
  assert adapted.problems == [
      Problem('Simplify $\\frac{2}{4}$.', '\\frac{1}{2}', path),
      Problem('What is $\\sqrt{16}$?', '4', path),
      Problem('Find the interval where $x^2 - 3x + 2 \\le 0$.', '[1,2]', path),
      Problem('Compute $\\binom{5}{2}$.', '10', 'math500'),
  ]
  assert adapted.skipped_no_answer == 2


def test_dapo_chat_messages_from_parquet(tmp_path):
  instruction = 'Solve the following math problem step by step. The last line of your response should be ' \
                'of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n'
  records = [
      {'data_source': 'math_dapo', 'ability': 'MATH',
       'prompt': [{'role': 'user', 'content': instruction + 'Find the sum of all integers $n$ with $n^2 < 10$.'}],
       'reward_model': {'ground_truth': '0', 'style': 'rule-lighteval/MATH_v2'},
       'extra_info': {'index': 'a1b2c3'}},
      {'data_source': 'math_dapo', 'ability': 'MATH',
       'prompt': [{'role': 'system', 'content': 'Think carefully.', 'name': 'tutor'},
                  {'role': 'user', 'content': instruction + 'If $2n + 1 = 35$, what is $n$?'}],
       'reward_model': {'ground_truth': '17', 'style': 'rule-lighteval/MATH_v2'},
       'extra_info': {'index': 'd4e5f6'}},
      {'data_source': 'math_dapo', 'ability': 'MATH',
       'prompt': [{'role': 'user', 'content': instruction + 'A problem whose answer was lost.'}],
       'reward_model': {'ground_truth': ' ', 'style': 'rule-lighteval/MATH_v2'},
       'extra_info': {'index': 'g7h8i9'}},
  ]
  path = write_parquet(tmp_path / 'dapo-math-17k.parquet', records)
  assert load_records(path)[0]['prompt'][0]['name'] is None  # parquet fills keys the message lacks
  adapted = read(path, 'dapo')
  assert [problem.answer for problem in adapted.problems] == ['0', '17']
  assert adapted.skipped_no_answer == 1
  assert {problem.data_source for problem in adapted.problems} == {'math_dapo'}
  # The prompt keeps only role and content, not the parquet struct's other keys.
  assert adapted.problems[0].prompt == ({'role': 'user', 'content': records[0]['prompt'][0]['content']},)
  assert adapted.problems[1].prompt == ({'role': 'system', 'content': 'Think carefully.'},
                                        {'role': 'user', 'content': instruction + 'If $2n + 1 = 35$, what is $n$?'})
  assert all(type(message) is dict for message in adapted.problems[1].prompt)


def test_dapo_processed(tmp_path):
  records = [{'prompt': 'Let $a$ be the least positive integer with exactly 12 divisors. Find $a$.', 'solution': '60',
              'data_source': 'math_dapo', 'ability': 'MATH'},
             {'prompt': 'What is $\\frac{3}{4}$ of 100?', 'solution': 75.0},
             {'prompt': 'What is half of 1?', 'solution': 0.5},
             {'prompt': 'A problem published without its solution.', 'solution': None}]
  path = write_jsonl(tmp_path / 'dapo_processed.jsonl', records)
  adapted = read(path, 'dapo_processed')
  assert adapted.problems == [Problem(records[0]['prompt'], '60', 'math_dapo'),
                              Problem(records[1]['prompt'], '75', path),
                              Problem(records[2]['prompt'], '0.5', path)]
  assert adapted.skipped_no_answer == 1


def test_aime_both_schemas_and_integer_answers(tmp_path):
  h4 = [{'id': 60, 'problem': 'Every morning Aya goes for a 9-kilometer-long walk. Find the number of minutes.',
         'solution': 'She walks at 3 km/h ...', 'answer': '204', 'url': 'https://artofproblemsolving.com',
         'year': 2024}]
  maxwell = [{'ID': '2024-II-4', 'Problem': 'Let x, y and z be positive reals satisfying the system. Find m + n.',
              'Solution': 'Adding the equations ...', 'Answer': 33, 'data_source': None},
             {'ID': '2024-I-2', 'Problem': 'There exist real numbers x and y, both greater than 1. Find xy.',
              'Solution': 'By the change of base ...', 'Answer': 25, 'data_source': 'aime_2024_i'}]
  adapted = read(write_jsonl(tmp_path / 'aime_h4.jsonl', h4), 'aime')
  assert adapted.problems == [Problem(h4[0]['problem'], '204', 'aime')]
  adapted = read(write_parquet(tmp_path / 'aime_2024.parquet', maxwell), 'aime')  # Answer: an int64 column
  assert adapted.problems == [Problem(maxwell[0]['Problem'], '33', 'aime'),
                              Problem(maxwell[1]['Problem'], '25', 'aime_2024_i')]
  assert adapted.skipped_no_answer == 0


def test_custom_fields(tmp_path):
  records = [
      {'query': 'What is 6 times 7?', 'reward_model': {'ground_truth': 42}, 'data_source': 'times_tables'},
      {'query': [{'role': 'user', 'content': 'What is 15% of 80?'}], 'reward_model': {'ground_truth': '12'}},
      {'query': 'What is the square root of -1?', 'reward_model': {'ground_truth': None}},
      {'query': 'What is 2 + 2?', 'reward_model': {'style': 'rule'}},
  ]
  path = write_jsonl(tmp_path / 'custom.jsonl', records)
  adapted = read(path, 'custom', prompt_field='query', answer_field='reward_model.ground_truth')
  assert adapted.problems == [Problem('What is 6 times 7?', '42', 'times_tables'),
                              Problem(({'role': 'user', 'content': 'What is 15% of 80?'},), '12', path)]
  assert adapted.skipped_no_answer == 2


def test_custom_float_answers_from_parquet(tmp_path):
  # pandas writes a numeric answer column as float64, with NaN where an answer is missing.
  records = [{'prompt': 'How many eggs are in 4 dozen?', 'answer': 48.0},
             {'prompt': 'How far is the horizon?', 'answer': float('nan')},
             {'prompt': 'What is 5 divided by 2?', 'answer': 2.5}]
  adapted = read(write_parquet(tmp_path / 'eggs.parquet', records), 'custom')
  assert [(problem.prompt, problem.answer) for problem in adapted.problems] == [
      ('How many eggs are in 4 dozen?', '48'), ('What is 5 divided by 2?', '2.5')]
  assert adapted.skipped_no_answer == 1


def test_custom_defaults_read_prompt_and_answer(tmp_path):
  records = [{'prompt': 'How many sides has a hexagon?', 'answer': '6'}]
  adapted = read(write_jsonl(tmp_path / 'shapes.jsonl', records), 'custom')
  assert [(problem.prompt, problem.answer) for problem in adapted.problems] == [('How many sides has a hexagon?', '6')]


GOOD_DAPO = {'data_source': 'math_dapo', 'prompt': [{'role': 'user', 'content': 'What is 7 * 8?'}],
             'reward_model': {'ground_truth': '56'}}


@pytest.mark.parametrize('format, records, fields, expected', [
    ('gsm8k', [{'question': 'What is 9 + 10?', 'answer': '#### 19'}, {'problem': 'What is 3 * 3?', 'answer': '#### 9'}],
     {}, ["record 1 of", "(format gsm8k)", "'question'", 'its fields: problem, answer']),
    ('aime', [{'id': 1, 'answer': 204}], {},
     ["record 0 of", "(format aime)", "'problem' or 'Problem'", 'its fields: id, answer']),
    ('custom', [{'prompt': 'What is 1 + 1?', 'answer': '2'}, {'text': 'What is 2 + 2?', 'answer': '4'}],
     {}, ["record 1 of", "(format custom)", "'prompt'", 'its fields: text, answer']),
    ('math', [{'problem': 17, 'solution': '\\boxed{17}'}], {}, ["record 0 of", "'problem' is a int"]),
    ('dapo', [GOOD_DAPO, GOOD_DAPO, {**GOOD_DAPO, 'prompt': [{'role': 'user'}]}], {},
     ['record 2 of', "'prompt'", 'chat message', "{'role': 'user'}"]),
    ('dapo', [{**GOOD_DAPO, 'prompt': [{'role': 'user', 'content': ['What is', '7 * 8?']}]}], {},
     ['record 0 of', 'chat message']),
    ('dapo', [{**GOOD_DAPO, 'prompt': ['What is 7 * 8?']}], {}, ['record 0 of', 'chat message']),
    ('dapo', [{**GOOD_DAPO, 'prompt': []}], {}, ['record 0 of', 'empty list of chat messages']),
    ('custom', [{'prompt': 'What is 1 + 1?', 'solution': '2'}], {}, ["none of the 1 records", "field 'answer'"]),
    ('custom', [{'q': 'What is 1 + 1?', 'meta': {'gold': None}}], {'prompt_field': 'q', 'answer_field': 'meta.gold'},
     ["field 'meta.gold'"]),
    ('math', [{'problem': 'What is 1 + 1?', 'solution': 'Clearly 2.'}], {}, ["none of the 1", "'solution'"]),
    ('gsm8k', [{'question': 'What is 1 + 1?', 'answer': 'It is 2.'}], {}, ["'answer'", '####']),
    ('dapo', [{**GOOD_DAPO, 'reward_model': {'ground_truth': ''}}], {}, ["'reward_model.ground_truth'"]),
    ('hendrycks_math', [{'problem': 'What is 1 + 1?'}], {}, ['hendrycks_math', ', '.join(FORMATS)]),
])
def test_bad_records_name_the_field_and_source(tmp_path, format, records, fields, expected):
  path = write_jsonl(tmp_path / 'bad.jsonl', records)
  with pytest.raises(UserError) as error:
    read(path, format, **fields)
  message = str(error.value)
  assert path in message
  for part in expected:
    assert part in message, f'{part!r} not in {message!r}'


def test_formats():
  assert FORMATS == ('custom', 'gsm8k', 'math', 'dapo', 'dapo_processed', 'aime', 'prompts')


def test_prompts_alone_keep_every_record_with_no_reference(tmp_path):
  """A dataset of prompts for a run scored by models: text and chat messages, no answer field
  asked for, every record kept."""
  records = [{'text': 'Write a poem about rain.'}, {'text': [{'role': 'user', 'content': 'Hi!', 'name': None}]},
             {'text': 'Summarise: the cat sat.', 'answer': 'ignored'}]
  adapted = read(write_jsonl(tmp_path / 'prompts.jsonl', records), 'prompts', prompt_field='text')
  assert [problem.prompt for problem in adapted.problems] == [
      'Write a poem about rain.', ({'role': 'user', 'content': 'Hi!'},), 'Summarise: the cat sat.']
  assert [problem.answer for problem in adapted.problems] == [NO_REFERENCE] * 3 and adapted.skipped_no_answer == 0
  with pytest.raises(UserError, match=r"record 1 of .* has no question in field 'text'"):
    read(write_jsonl(tmp_path / 'bad.jsonl', [{'text': 'a'}, {'prompt': 'b'}]), 'prompts', prompt_field='text')
