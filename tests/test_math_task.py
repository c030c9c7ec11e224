"""The math task: dataset sources, math-verify rewards in a worker pool, prompt order and padding,
and a short training run on a dataset file through the train CLI."""

import json
import os
import time

import jax
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import train
from grpo_jax.data import rewards
from grpo_jax.data.math_task import MathSection, MathTask
from grpo_jax.data.sources import DatasetSource, column, load_records
from grpo_jax.errors import UserError
from grpo_jax.sampler.rollout import Rollout
from test_api import write_tokenizer
from runs import alive

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 # Qwen3's switch: an empty thinking block when thinking is off.
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")

# (completion, reference answer, expected reward)
TABLE = [
    ('so the answer is \\boxed{1/2}', '0.5', 1.0),
    ('\\boxed{\\frac{1}{2}}', '0.5', 1.0),
    ('\\boxed{\\frac{1}{2}}', '\\frac{1}{2}', 1.0),
    ('first \\boxed{3}, no: \\boxed{0.5}', '1/2', 1.0),  # the last boxed answer counts
    ('first \\boxed{0.5}, no: \\boxed{3}', '1/2', 0.0),
    ('\\boxed{34}', '34', 1.0),
    ('\\boxed{35}', '34', 0.0),
    ('\\boxed{(1, 2)}', '(1,2)', 1.0),
    ('\\boxed{\\sqrt{2}}', '\\sqrt 2', 1.0),
    ('\\boxed{2}', '\\sqrt 2', 0.0),
    ('I do not know.', '0.5', 0.0),
    ('', '7', 0.0),
    ('}{ \\boxed{ ^^ $$ \\frac{', '0.5', 0.0),
    ('The answer is 12.', '12', 1.0),  # no box: whatever math-verify extracts from the text
]


def score_needing_a_missing_package(completion, answer):
  import grpo_jax_no_such_package  # noqa: F401


def score_with_failures(completion, answer):
  """A scorer for the pool tests: references 'hang' and 'crash' misbehave, others use math-verify."""
  if answer == 'hang':
    time.sleep(600)
  if answer == 'crash':
    os._exit(3)
  if answer == 'raise':
    raise RuntimeError('scorer failed')
  if answer == 'allocate':
    return len(bytearray(8 << 30))
  if answer == 'stamp':  # a value no other call gives: the process and the time of this call
    return os.getpid() + time.perf_counter_ns() % 10**9 / 10**9
  return rewards.math_reward(completion, answer)


# ---- rewards ----

def test_math_reward_table():
  got = [rewards.math_reward(completion, answer) for completion, answer, _ in TABLE]
  assert got == [expected for _, _, expected in TABLE]
  # math-verify's own alarm stops a comparison that would evaluate a 10^8-digit power.
  start = time.monotonic()
  assert rewards.math_reward('\\boxed{9^{9^{9^{9}}}}', '5', timeout_s=1) == 0.0
  assert time.monotonic() - start < 10


def test_each_reference_is_parsed_once_and_verdicts_stay_math_verifys(seed, monkeypatch):
  """math_verify_reward keeps each reference's parse: on fresh random pairs (fractions, decimals,
  tuples, roots, grouped digits; boxed or in words; right and wrong), every verdict with the references already
  parsed equals the verdict with them parsed afresh (the cache emptied before each pair), and a
  second pass parses no reference again. A reference that parses to nothing is not kept."""
  import math_verify

  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(24):
    p, q = (int(value) for value in rng.integers(1, 60, 2))
    kind = int(rng.integers(0, 5))
    if kind == 0:
      answer, right = f'\\frac{{{p}}}{{{q}}}', f'{p / q:.12g}'
    elif kind == 1:
      answer, right = f'({p}, {q})', f'({p},{q})'
    elif kind == 2:
      answer, right = f'\\sqrt{{{p}}}', f'\\sqrt {p}'
    elif kind == 3:
      answer, right = f'{p}\\,{q:03d}', f'{p * 1000 + q}'
    else:
      answer, right = f'{p}.{q}', f'{p}.{q}0'
    guess = right if rng.random() < 0.5 else f'{p + q}.5'
    pairs.append((rng.choice([f'\\boxed{{{guess}}}', f'so it is \\boxed{{{guess}}}.', f'The answer is {guess}.']), answer))
  pairs.append(('\\boxed{3}', ''))  # a reference that parses to nothing
  fresh = []
  for completion, answer in pairs:
    rewards._reference.cache_clear()
    fresh.append(rewards.math_verify_reward(completion, answer))
  assert 0.0 in fresh and 1.0 in fresh, fresh
  parsed = []
  real_parse = math_verify.parse
  monkeypatch.setattr(math_verify, 'parse', lambda text, **kwargs: parsed.append(text) or real_parse(text, **kwargs))
  rewards._reference.cache_clear()
  first = [rewards.math_verify_reward(completion, answer) for completion, answer in pairs]
  first_parses = len(parsed)
  assert [rewards.math_verify_reward(completion, answer) for completion, answer in pairs] == first == fresh
  # Again: each completion, and the empty reference (boxed, then bare); no other reference.
  assert len(parsed) - first_parses == len(pairs) + 2, parsed[first_parses:]
  assert rewards._reference.cache_info().currsize == len({answer for _, answer in pairs}) - 1


def test_last_boxed():
  assert rewards.last_boxed('a \\boxed{1} b \\boxed{\\frac{1}{2}} c') == '\\frac{1}{2}'
  assert rewards.last_boxed('\\boxed{2} then cut off \\boxed{3') == '2'
  assert rewards.last_boxed('\\boxed{5} then \\fbox{6}') == '6'
  assert rewards.last_boxed('no box here') is None
  assert rewards.last_boxed('\\boxed{a {b}') is None and rewards.last_boxed('} \\boxed{x}}') == 'x'
  # A right answer then 100,000 unclosed boxes: one linear pass (the per-opening depth count was
  # quadratic here and outlived the reward deadline).
  assert rewards.last_boxed('\\boxed{7}' + '\\boxed{' * 100_000) == '7'


def test_pool_keeps_order_and_gives_zero_for_hangs_and_crashes():
  completions = [completion for completion, _, _ in TABLE]
  answers = [answer for _, answer, _ in TABLE]
  expected = [reward for _, _, reward in TABLE]
  with rewards.RewardPool(2, score_fn=score_with_failures, timeout_s=2.0) as pool:
    assert pool.map(completions, answers) == expected
    # Misbehaving items get 0.0; the others keep their place and their reward.
    mixed = ['\\boxed{1}', 'x', '\\boxed{2}', 'x', '\\boxed{3}', 'x', '\\boxed{4}']
    references = ['1', 'hang', '2', 'crash', '5', 'raise', '4']
    start = time.monotonic()
    assert pool.map(mixed, references) == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert 2.0 <= time.monotonic() - start < 60
    assert pool.failures == 3  # the hang, the crash (both workers replaced) and the raise
    assert pool.map(completions[:4], answers[:4]) == expected[:4]
    # A pair that occurs several times in one call is scored once (each call stamps its result).
    stamped = pool.map(['7', '8', '7', '7', '8'], ['stamp'] * 5)
    assert stamped[0] == stamped[2] == stamped[3] != stamped[1] == stamped[4]
    assert pool.map(['7'], ['stamp']) != stamped[:1]


def test_integer_answers_are_settled_as_math_verify_settles_them(seed):
  """integer_verdict, on fresh random integers written the ways completions write them, gives
  math-verify's verdict (math_verify_reward); anything but one integer on
  each side it leaves to math-verify."""
  rng = np.random.default_rng(seed)
  shapes = ['{}', '\\boxed{{{}}}', 'so it is \\boxed{{{}}}.', ' {} ', '\\boxed{{ {} }}', '\\fbox{{{}}}',
            '<think>\\boxed{{3}}</think> \\boxed{{{}}}', 'first \\boxed{{1}}, no: \\boxed{{{}}}']
  pairs = []
  for _ in range(40):
    gold = int(rng.integers(-30, 1000))
    guess = gold if rng.random() < 0.5 else int(rng.integers(-30, 1000))
    written = rng.choice([str(guess), '+' + str(guess), '0' + str(guess)]) if guess >= 0 else str(guess)
    pairs.append((str(rng.choice(shapes)).format(written), rng.choice([str(gold), f' {gold}'])))
  pairs += [('-0', '0'), ('\\boxed{007}', '7'), ('\\boxed{+5}', '5'), ('\\boxed{-5}', '5')]
  settled = [rewards.integer_verdict(completion, answer) for completion, answer in pairs]
  # An unboxed '+12' is left to math-verify, which extracts no answer from it.
  assert [value is None for value in settled] == ['+' in completion and 'box' not in completion
                                                  for completion, _ in pairs], pairs
  assert 0.0 in settled and 1.0 in settled
  verified = [rewards.math_verify_reward(completion, answer) for completion, answer in pairs]
  assert [value for value in settled if value is not None] == [
      value for value, mine in zip(verified, settled) if mine is not None], pairs
  for completion, answer in [('\\boxed{1/2}', '0.5'), ('\\boxed{0.5}', '1'), ('\\boxed{1,234}', '1234'),
                             ('\\boxed{1\\,234}', '1234'), ('The answer is 12.', '12'), ('\\boxed{x}', '3'),
                             ('\\boxed{\u0663}', '3'), ('\\boxed{3}', '\\frac{6}{2}'), ('<think>12', '12'),
                             ('+12', '12')]:
    assert rewards.integer_verdict(completion, answer) is None, (completion, answer)


def test_pool_settles_integer_answers_without_its_workers(seed):
  """Pairs the integer shortcut settles never reach a worker: with its only worker killed, the pool
  still scores them, and counts no failure."""
  rng = np.random.default_rng(seed)
  golds = [str(value) for value in rng.integers(0, 100, 8)]
  with rewards.RewardPool(1) as pool:
    pool._workers[0].process.kill()
    pool._workers[0].process.join()
    guesses = [f'\\boxed{{{gold}}}' if i % 2 else str(int(gold) + 1) for i, gold in enumerate(golds)]
    assert pool.map(guesses, golds) == [float(i % 2) for i in range(8)] and pool.failures == 0


def test_pool_bounds_each_checks_memory():
  """A check that would take 8 GiB fails inside its worker's address-space cap: scored 0,
  counted, and the worker goes on scoring."""
  with rewards.RewardPool(1, score_fn=score_with_failures, memory_bytes=1 << 30) as pool:
    assert pool.map(['\\boxed{2}', 'x', '\\boxed{3}'], ['2', 'allocate', '3']) == [1.0, 0.0, 1.0]
    assert pool.failures == 1


def test_pool_says_when_workers_cannot_start():
  with rewards.RewardPool(1, score_fn=score_needing_a_missing_package) as pool:
    with pytest.raises(UserError, match="could not start: ModuleNotFoundError: No module named 'grpo_jax_no_such"):
      pool.map(['x'], ['1'])


# ---- sources ----

RECORDS = [{'question': f'What is {i} plus {i}?', 'answer': str(2 * i), 'meta': {'level': i % 3}}
           for i in range(5)]


def test_sources_round_trip(tmp_path):
  jsonl = tmp_path / 'data.jsonl'
  jsonl.write_text('\n'.join(json.dumps(r) for r in RECORDS) + '\n\n')
  assert load_records(str(jsonl)) == RECORDS
  plain = tmp_path / 'data.json'
  plain.write_text(json.dumps(RECORDS))
  assert load_records(str(plain)) == RECORDS
  by_split = tmp_path / 'splits.json'
  by_split.write_text(json.dumps({'train': RECORDS[:2], 'test': RECORDS[2:]}))
  assert load_records(str(by_split), 'test') == RECORDS[2:]
  lines_named_json = tmp_path / 'lines.json'  # what datasets' to_json writes
  lines_named_json.write_text('\n'.join(json.dumps(r) for r in RECORDS))
  assert load_records(str(lines_named_json)) == RECORDS
  pyarrow = pytest.importorskip('pyarrow', reason='parquet files need pyarrow (requirements-extras.txt)')
  import pyarrow.parquet
  parquet = tmp_path / 'data.parquet'
  pyarrow.parquet.write_table(pyarrow.Table.from_pylist(RECORDS), parquet)
  assert load_records(str(parquet)) == RECORDS
  assert column(RECORDS, 'meta.level', 'task.answer_field', 'x') == [0, 1, 2, 0, 1]


@pytest.mark.exhaustive
def test_tfds_source_gives_plain_strings():
  tfds = pytest.importorskip('tensorflow_datasets', reason='tfds comes with requirements-extras.txt')
  with tfds.testing.mock_data(num_examples=3):  # random examples with gsm8k's features, no files
    records = load_records('tfds:gsm8k', 'train')
  assert len(records) == 3
  assert all(isinstance(value, str) for record in records for value in record.values())
  assert len(column(records, 'question', 'task.prompt_field', 'tfds:gsm8k')) == 3


def one_line_error(call, *args, **kwargs) -> str:
  with pytest.raises(UserError) as raised:
    call(*args, **kwargs)
  message = str(raised.value)
  assert '\n' not in message
  return message


def test_source_errors(tmp_path):
  path = tmp_path / 'data.jsonl'
  path.write_text('\n'.join(json.dumps(r) for r in RECORDS))
  message = one_line_error(column, load_records(str(path)), 'problem', 'task.prompt_field', str(path))
  assert "task.prompt_field 'problem'" in message and str(path) in message and 'question' in message
  assert 'not found' in one_line_error(load_records, str(tmp_path / 'missing.jsonl'))
  assert '.parquet' in one_line_error(load_records, str(tmp_path / 'data.csv'))
  (tmp_path / 'empty.jsonl').write_text('\n')
  assert 'no records' in one_line_error(load_records, str(tmp_path / 'empty.jsonl'))
  (tmp_path / 'bad.jsonl').write_text('{"a": 1}\n{"a": \n')
  assert 'line 2' in one_line_error(load_records, str(tmp_path / 'bad.jsonl'))
  message = one_line_error(load_records, 'hf:grpo-jax-tests/not-a-cached-dataset', 'train')
  assert 'hf:grpo-jax-tests/not-a-cached-dataset' in message
  try:
    import datasets  # noqa: F401
    assert 'local Hugging Face cache' in message
  except ImportError:
    assert 'needs the datasets package' in message


# ---- MathTask: prompts ----

def chat_tokenizer_dir(directory) -> str:
  """The byte-level BPE of test_api plus Qwen's chat tokens and a ChatML template."""
  from tokenizers import Tokenizer
  os.makedirs(directory, exist_ok=True)
  write_tokenizer(directory)
  tokenizer = Tokenizer.from_file(os.path.join(directory, 'tokenizer.json'))
  tokenizer.add_special_tokens(['<|im_start|>', '<|im_end|>'])
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'Qwen2Tokenizer', 'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>',
               'chat_template': CHAT_TEMPLATE}, f)
  return str(directory)


def write_problems(path, count, long_ones=()):
  with open(path, 'w') as f:
    for i in range(count):
      question = 'nine ' * 200 if i in long_ones else f'What is {i} plus one?'
      f.write(json.dumps({'problem': question, 'solution': i + 1}) + '\n')
  return str(path)


def make_config(model_path, source, seed=0, **task):
  fields = dict(dict(prompt_field='problem', answer_field='solution'),
                **{name: task.pop(name) for name in ('format', 'prompt_field', 'answer_field') if name in task})
  task = dict(dict(dataset=DatasetSource(source, **fields), max_prompt_tokens=48, reward_workers=2), **task)
  return config_lib.Config(run=config_lib.RunConfig(seed=seed), model=config_lib.ModelConfig(path=model_path),
                           task=MathSection(**task))


def make_task(model_path, source, seed=0, **task):
  config = make_config(model_path, source, seed, **task)
  return MathTask(config.task, config.model.path, config.run.seed)


def test_prompts_left_padded_through_the_chat_template(tmp_path):
  model_path = chat_tokenizer_dir(tmp_path / 'tok')
  task = make_task(model_path, write_problems(tmp_path / 'p.jsonl', 8), prompt_template='Q: {prompt}')
  tokenizer = task.tokenizer
  assert task.stop_token_ids == (tokenizer.convert_tokens_to_ids('<|im_end|>'),
                                 tokenizer.convert_tokens_to_ids('<|endoftext|>'))
  assert task.eos_id == task.stop_token_ids[0] and task.pad_id == tokenizer.convert_tokens_to_ids('<|endoftext|>')
  assert task.vocab_size == 302 and task.prompt_length == 48
  prompts = task.prompts(jax.random.key(0), 0, 5)
  tokens, mask = np.asarray(prompts.tokens), np.asarray(prompts.mask)
  assert tokens.shape == mask.shape == (5, 48) and tokens.dtype == mask.dtype == np.int32
  for row, index in enumerate(task.order(0, 5)):
    expected = tokenizer(f'<|im_start|>user\nQ: What is {index} plus one?<|im_end|>\n<|im_start|>assistant\n',
                         add_special_tokens=False)['input_ids']
    length = len(expected)
    np.testing.assert_array_equal(mask[row], [0] * (48 - length) + [1] * length)
    np.testing.assert_array_equal(tokens[row, 48 - length:], expected)
    assert np.all(tokens[row, :48 - length] == task.pad_id)
    assert prompts.answers[row].answer == str(index + 1)
    assert prompts.answers[row].question == f'Q: What is {index} plus one?'


@pytest.mark.parametrize('thinking, suffix', [(None, ''), (True, ''), (False, '<think>\n\n</think>\n\n')])
def test_enable_thinking_reaches_the_chat_template(tmp_path, thinking, suffix):
  task = make_task(chat_tokenizer_dir(tmp_path / 'tok'), write_problems(tmp_path / 'p.jsonl', 2),
                   enable_thinking=thinking)
  assert task.problems.texts[0].endswith('<|im_start|>assistant\n' + suffix)


def test_plain_prompts_without_chat_template(tmp_path):
  write_tokenizer(tmp_path)
  task = make_task(str(tmp_path), write_problems(tmp_path / 'p.jsonl', 4),
                   prompt_template='{prompt} Put the answer in \\boxed{{}}.')
  assert task.stop_token_ids == (0,) and task.pad_id == 0
  prompts = task.prompts(None, 0, 1)
  index = int(task.order(0, 1)[0])
  real = np.asarray(prompts.tokens)[0][np.asarray(prompts.mask)[0] == 1]
  assert task.tokenizer.decode(real) == f'What is {index} plus one? Put the answer in \\boxed{{}}.'
  with pytest.raises(UserError, match='literal braces'):
    make_task(str(tmp_path), str(tmp_path / 'p.jsonl'), prompt_template='{prompt} \\boxed{}')
  with pytest.raises(UserError, match='has no {prompt}'):
    make_task(str(tmp_path), str(tmp_path / 'p.jsonl'), prompt_template='Solve it.')


def test_chat_message_prompts_and_nested_answers(tmp_path):
  """The layout of DAPO-Math-17k: prompt = chat messages, answer under reward_model.ground_truth."""
  model_path = chat_tokenizer_dir(tmp_path / 'tok')
  source = tmp_path / 'dapo.jsonl'
  source.write_text(json.dumps({'prompt': [{'role': 'user', 'content': 'What is two plus two?'}],
                                'reward_model': {'ground_truth': '4', 'style': 'rule'}}))
  task = make_task(model_path, str(source), prompt_field='prompt', answer_field='reward_model.ground_truth')
  assert task.texts == ['<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n']
  assert task.answers == ['4']


def test_order_is_a_function_of_seed_and_position(tmp_path):
  model_path = chat_tokenizer_dir(tmp_path / 'tok')
  source = write_problems(tmp_path / 'p.jsonl', 8)
  task = make_task(model_path, source, seed=3)
  stream = np.concatenate([task.order(position, 3) for position in range(0, 24, 3)])
  epochs = stream.reshape(3, 8)
  for epoch in epochs:
    assert sorted(epoch) == list(range(8))  # each epoch is a permutation of the data
  assert len({tuple(epoch) for epoch in epochs}) == 3  # reshuffled at each wrap-around
  np.testing.assert_array_equal(epochs[1], np.random.default_rng([3, 1]).permutation(8))
  # A resumed run (a new task, same seed) continues the same stream from the recorded position,
  # also across an epoch boundary and regardless of the batch size.
  resumed = make_task(model_path, source, seed=3)
  np.testing.assert_array_equal(resumed.order(6, 5), stream[6:11])
  np.testing.assert_array_equal(resumed.order(20, 2), stream[20:22])
  other_seed = make_task(model_path, source, seed=4)
  assert not np.array_equal(other_seed.order(0, 8), stream[:8])


def test_overlong_prompts_are_dropped_once(tmp_path, capsys):
  model_path = chat_tokenizer_dir(tmp_path / 'tok')
  task = make_task(model_path, write_problems(tmp_path / 'p.jsonl', 8, long_ones=(2, 5)))
  assert 'kept 6 of 8 records; skipped 2 longer than task.max_prompt_tokens=48, 0 without an answer' in \
      capsys.readouterr().err
  assert task.num_prompts == 6
  seen = set(task.answers[i] for i in task.order(0, 12))
  assert seen == {str(i + 1) for i in range(8) if i not in (2, 5)}
  assert capsys.readouterr().err == ''
  with pytest.raises(UserError, match='every prompt'):
    make_task(model_path, str(tmp_path / 'p.jsonl'), max_prompt_tokens=4)


def test_configuration_errors(tmp_path):
  source = write_problems(tmp_path / 'p.jsonl', 2)
  assert 'no tokenizer' in one_line_error(make_task, str(tmp_path), source)
  assert 'task.source' in one_line_error(make_task, str(tmp_path), None)
  model_path = chat_tokenizer_dir(tmp_path / 'tok')
  message = one_line_error(make_task, model_path, source, answer_field='answer')
  assert "none of the 2 records of" in message and "usable reference answer in field 'answer'" in message
  assert source in message
  message = one_line_error(make_task, model_path, source, prompt_field='question')
  assert "has no question in field 'question'" in message and 'record 0 of' in message and source in message


# ---- MathTask: rewards ----

def test_score_decodes_groups_in_order(tmp_path):
  model_path = chat_tokenizer_dir(tmp_path / 'tok')
  task = make_task(model_path, write_problems(tmp_path / 'p.jsonl', 8))
  prompts = task.prompts(None, 0, 2)
  first, second = (int(reference.answer) for reference in prompts.answers)
  texts = [f'\\boxed{{{first}}}', f'\\boxed{{{first + 1}}}', f'it is {second}', 'no idea']
  rows = [task.tokenizer(text, add_special_tokens=False)['input_ids'] + [task.eos_id] for text in texts]
  width = max(map(len, rows)) + 2
  tokens = np.full((4, width), task.pad_id, np.int32)
  mask = np.zeros((4, width), bool)
  for i, row in enumerate(rows):
    tokens[i, :len(row)], mask[i, :len(row)] = row, True
  tokens[1, len(rows[1])] = 999  # beyond the tokenizer (masked out anyway), must not break decoding
  rollout = Rollout(tokens=tokens, log_probs=np.zeros(tokens.shape, np.float32), mask=mask,
                    lengths=mask.sum(1), stopped=np.ones(4, bool))
  assert task.decode(tokens, mask) == texts
  try:
    scores = task.reward(rollout, prompts, 2, {})
  finally:
    task.close()
  assert scores.rewards.dtype == np.float32 and int(scores.failures) == 0
  np.testing.assert_array_equal(np.asarray(scores.rewards), [1.0, 0.0, 1.0, 0.0])


# ---- end to end ----

@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_training_run_on_a_math_dataset(tmp_path, make_hf_checkpoint, seed):
  model_path, _ = make_hf_checkpoint(seed)
  chat_tokenizer_dir(model_path)
  source = write_problems(tmp_path / 'problems.jsonl', 8)
  config = tmp_path / 'math.yaml'
  config.write_text(f"""
model: {{path: {model_path}}}
task: {{name: math, source: {source}, prompt_field: problem, answer_field: solution,
       prompt_template: '{{prompt}} Put the answer in \\boxed{{{{}}}}.', max_prompt_tokens: 64, reward_workers: 2}}
rollout: {{prompts_per_step: 2, max_new_tokens: 4}}
algo: {{group_size: 2}}
optim: {{learning_rate: 1.0e-4}}
train: {{steps: 3, checkpoint_every: 0, progress: false, tensorboard: false}}
""")
  train.main(['--config', str(config), '--workdir', str(tmp_path / 'run')])
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [row['step'] for row in rows] == [1, 2, 3]
  for row in rows:
    assert row['reward_s'] > 0 and 0 <= row['reward_mean'] <= 1 and np.isfinite(row['policy_loss'])
    assert 1 <= row['response_len_mean'] <= 4
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['3']


def test_workers_die_with_a_killed_trainer(tmp_path):
  """kill -9 of the process that owns the pool, while a worker is inside a slow check: the worker
  does not outlive it (parent-death signal / watchdog), it does not run on until its item ends."""
  import signal
  import subprocess
  import sys
  (tmp_path / 'slow_scorer.py').write_text(
      'import time\n\ndef score(completion, answer):\n  if answer == "hang":\n    time.sleep(600)\n  return 1.0\n')
  (tmp_path / 'owner.py').write_text(
      'import slow_scorer\nfrom grpo_jax.data import rewards\n\n'
      'if __name__ == "__main__":  # the workers are spawned: they import this file\n'
      '  pool = rewards.RewardPool(2, score_fn=slow_scorer.score, timeout_s=600)\n'
      '  print(" ".join(str(w.process.pid) for w in pool._workers), flush=True)\n'
      '  pool.map(["a", "b"], ["hang", "hang"])\n')
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')]))
  owner = subprocess.Popen([sys.executable, str(tmp_path / 'owner.py')], stdout=subprocess.PIPE, text=True, env=env)
  pids = []
  try:
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(3)  # both workers are now busy (warm-up done, each inside a 600 s check)
    assert all(alive(pid) for pid in pids)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
      time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)
  finally:
    if owner.poll() is None:
      owner.kill()
    for pid in pids:
      if alive(pid):  # only when the test failed: leave nothing running
        os.kill(pid, signal.SIGKILL)
