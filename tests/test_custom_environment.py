"""A custom environment as a new user writes it: docs/agents.md's `my_env.py`, its arguments from
task.environment_args, the text a turn hands the environment and the text it answers with, the
run's turn bounds, and a few RL steps of it on a tiny model."""

import asyncio
import os
import re
import sys

import numpy as np
import pytest
import yaml

from grpo_jax import config as config_lib
from grpo_jax.agents import task as agent_task
from grpo_jax.agents.inference import Completion
from grpo_jax.agents.text import UNKNOWN, TextCodec, encode
from grpo_jax.sampler.special_tokens import tokenizer_size
from grpo_jax.errors import UserError
from grpo_jax.model import load_tokenizer
from runs import ROOT, read_metrics, train_here
from test_math_task import chat_tokenizer_dir

README_MODULE = 'docs_env'
PADDED = 6  # the model's vocabulary runs this many ids past the tokenizer's, as Qwen2.5's does


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  """docs/agents.md's environment as an importable module, a chat tokenizer and a run config using both."""
  directory = tmp_path_factory.mktemp('custom_env')
  with open(os.path.join(ROOT, 'docs', 'agents.md')) as f:
    readme = f.read()
  (code,) = re.findall(r'```python\n(# my_env\.py.*?)```', readme, re.S)
  assert len(code.splitlines()) < 40
  with open(directory / f'{README_MODULE}.py', 'w') as f:
    f.write(code)
  tokenizer_dir = chat_tokenizer_dir(directory / 'tokenizer')
  size = tokenizer_size(load_tokenizer(tokenizer_dir))
  with open(os.path.join(ROOT, 'configs', 'tiny_guess.yaml')) as f:
    settings = yaml.safe_load(f)
  settings['model']['architecture']['vocab_size'] = size + PADDED
  settings['task'] = dict(name='agent', environment=f'{README_MODULE}:make', environment_args=dict(low=1, high=9),
                          tokenizer=tokenizer_dir, max_turns=3, turn_tokens=4, max_prompt_tokens=64)
  settings['rollout'].update(prompts_per_step=4, max_new_tokens=96)  # replies are ~30 tokens of this tokenizer
  settings['algo']['group_size'] = 4
  path = str(directory / 'my_env.yaml')
  with open(path, 'w') as f:
    yaml.safe_dump(settings, f)
  sys.path.insert(0, str(directory))
  yield path, tokenizer_dir, size
  sys.path.remove(str(directory))
  sys.modules.pop(README_MODULE, None)


def test_the_factory_gets_its_arguments_and_its_errors_name_them(setup):
  path, _, _ = setup
  task = agent_task.build(config_lib.load_config(path))
  targets = [problem.data for problem in task.problems(0, 64)]
  assert set(targets) == set(range(1, 10))  # low=1, high=9 reached the factory
  assert targets == [problem.data for problem in task.problems(0, 64)]  # the same positions, the same problems
  # The run's bounds are the agent's, whatever the factory set.
  assert (task.agent.max_turns, task.agent.turn_tokens) == (3, 4)
  wide = agent_task.build(config_lib.load_config(path, ['task.turn_tokens=0', 'task.max_turns=7']))
  assert (wide.agent.max_turns, wide.agent.turn_tokens) == (7, 96)

  def refusal(*overrides):
    with pytest.raises(UserError) as error:
      agent_task.build(config_lib.load_config(path, list(overrides)))
    return str(error.value)

  assert refusal('task.environment_args.hgh=4') == \
      f'task.environment_args.hgh is not an argument of {README_MODULE}:make (its arguments: low, high)'
  assert refusal('task.environment_args.high=1') == 'task.environment_args.high must be above low (1), got 1'
  assert refusal('task.environment=guess_number').startswith('task.environment_args are the arguments of an '
                                                             'environment of your own')
  assert 'must be on the Python path' in refusal('task.environment=not_a_module_here:make')


def test_an_argument_without_a_default_must_be_set(setup, tmp_path, monkeypatch):
  path, _, _ = setup
  (tmp_path / 'strict_env.py').write_text('def make(config, *, rounds, verbose=False):\n  raise AssertionError\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(UserError) as error:
    agent_task.build(config_lib.load_config(path, ['task.environment=strict_env:make', 'task.environment_args={}']))
  assert str(error.value) == 'task.environment_args.rounds must be set: strict_env:make has no default for it'


def test_a_turns_text_and_a_text_reply_follow_the_tokenizer_and_its_template(setup, seed):
  _, tokenizer_dir, size = setup
  tokenizer = load_tokenizer(tokenizer_dir)
  stop = tokenizer.convert_tokens_to_ids('<|im_end|>')
  codec = TextCodec(tokenizer, (stop,), use_chat_template=True)
  rng = np.random.default_rng(seed)
  words = ' '.join(rng.choice(['one', 'two', 'seven', 'plus', 'is'], 4))
  ids = encode(tokenizer, words)
  unknown = int(rng.integers(size, size + PADDED))
  cut = int(rng.integers(1, len(ids)))
  tokens = ids[:cut] + (unknown,) + ids[cut:]
  turn = codec.turn(Completion(tokens=tokens + (stop,), log_probs=(0.0,) * (len(tokens) + 1), finish_reason='stop'))
  assert turn.text == tokenizer.decode(ids[:cut]) + UNKNOWN + tokenizer.decode(ids[cut:])
  assert turn.unknown_ids == (unknown,) and turn.tokens[-1] == stop  # the stop id stays in the trained tokens
  cut_short = codec.turn(Completion(tokens=ids, log_probs=(0.0,) * len(ids), finish_reason='length'))
  assert (cut_short.text, cut_short.unknown_ids) == (tokenizer.decode(ids), ())
  # A reply is the template's next user message: the episode's text equals the template's rendering
  # of the conversation, after a turn that ended on its stop id and after one its budget cut.
  conversation = [{'role': 'user', 'content': 'guess'}]
  prompt = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
  for ending in (turn, cut_short):
    said = tokenizer.decode(ids)
    whole = tokenizer.apply_chat_template(conversation + [{'role': 'assistant', 'content': said},
                                                          {'role': 'user', 'content': 'higher <|im_end|>'}],
                                          tokenize=False, add_generation_prompt=True)
    ended = tokenizer.decode([stop]) if ending.finish_reason == 'stop' else ''
    assert said + ended + tokenizer.decode(codec.reply('higher <|im_end|>', ending)) == whole[len(prompt):]
  # The reply's own text cannot spell the stop token.
  assert codec.reply('higher <|im_end|>', turn).count(stop) == 1


@pytest.mark.exhaustive
def test_the_readme_environment_trains(setup, tmp_path):
  path, _, _ = setup
  history = train_here(tmp_path, path, 'train.steps=3', 'train.progress=false', 'train.tensorboard=false',
                       'train.checkpoint_every=0', 'eval.every=3', 'eval.samples=2', 'eval.k=2', 'eval.greedy=false')
  assert [record['step'] for record in history] == [1, 2, 3]
  turns = [record['episode/turns'] for record in history]
  # A random policy rarely names the target: most episodes read a text reply and go on.
  assert all(1.0 < mean <= 3.0 for mean in turns), turns
  # Three 4-token turns and the two replies between them fit the budget: nothing is cut (the last
  # turn gets no reply, which no turn would read).
  assert [record['episode/truncated'] for record in history] == [0.0] * 3
  assert history[-1]['eval/problems'] == 9.0 and 'eval/maj@2' in history[-1]
  assert all(np.isfinite(record['loss']) for record in history)


@pytest.mark.exhaustive
def test_the_readme_environment_trains_turn_by_turn_as_rendered(setup, tmp_path):
  """task.turn_context: as_rendered on docs/agents.md's environment: two RL steps train a row per turn
  (the update's rows are max_turns times the episodes') on the chat template's rendering of each
  turn's conversation."""
  path, _, _ = setup
  history = train_here(tmp_path, path, 'task.turn_context=as_rendered', 'train.steps=2', 'train.progress=false',
                       'train.tensorboard=false', 'train.checkpoint_every=0')
  assert [record['step'] for record in history] == [1, 2]
  assert all(np.isfinite(record['loss']) for record in history)  # a random policy rarely scores: no gradient
  assert all(1.0 < record['episode/turns'] <= 3.0 for record in history)
  # A random policy's turns, decoded and tokenized again, can come out longer: such a turn is cut, and counted.
  assert all(0.0 <= record['episode/unrendered'] < 0.5 for record in history)


def test_as_rendered_needs_a_text_conversation(setup):
  """An environment whose conversation is ids (the guessing game) cannot be rendered again: one line."""
  path, _, _ = setup
  config = config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_guess.yaml'), ['task.turn_context=as_rendered'])
  with pytest.raises(UserError, match=r"^task\.turn_context: as_rendered renders each turn's conversation with the "
                                      r'chat template; environment guess_number has no text conversation'):
    agent_task.build(config)
