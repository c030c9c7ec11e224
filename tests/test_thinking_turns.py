"""Multi-turn episodes under a chat template that rewrites history: token in, token out.

Qwen3's chat template drops the <think> part of an assistant turn that comes before the last user
message when it renders a conversation, so rendering a trajectory again gives other tokens than
the policy saw. grpo_jax never renders the history again: a trajectory is the prompt's ids, then
each turn's sampled ids as the server returned them and each reply's ids (the template's text
around the message, agents/text.py), so the update trains on exactly the tokens sampled, with the
loss on exactly those. A tool's result is no user query: the template keeps the reasoning before it.
The template here is written for this test after Qwen3's layout, on tests/family_tokenizers.py's
byte-level vocabulary.
"""

import asyncio

import numpy as np
import pytest

from family_tokenizers import Family, hand_ids, write_family
from grpo_jax.agents.inference import Completion
from grpo_jax.agents.text import TextCodec
from grpo_jax.agents.trajectory import Episode, collate

# An assistant message's reasoning (before </think>) is kept only after the last user query; a tool
# result is rendered inside a user turn but is no query.
QWEN3_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set content = m['content'] %}"
    "{% set reasoning = '' %}{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > ns.last %}{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{% endif %}"
    "{% elif m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN3 = Family('qwen3', ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<think>', '</think>', '<tool_response>',
                         '</tool_response>'), False, None, '<|im_end|>', '<|endoftext|>', None, (), QWEN3_TEMPLATE,
               'jinja', '<|im_end|>', ['<|im_end|>', '<|endoftext|>'], ('<|im_end|>', '<|endoftext|>'))
TURNS = [('look at 3', 'x=3'), ('no, add one', 'x=4'), ('why', 'x=4 still')]


class ScriptedPolicy:
  """What the inference server would answer, turn after turn (each turn thinks, then answers)."""

  def __init__(self, turns):
    self.turns = iter(turns)

  async def generate(self, request):
    del request
    turn = next(self.turns)
    return Completion(tokens=tuple(turn), log_probs=(-0.5,) * len(turn), finish_reason='stop')


@pytest.mark.parametrize('role', ['user', 'tool'])
def test_the_update_trains_on_the_sampled_tokens_not_the_rerendered_history(tmp_path, role):
  from transformers import AutoTokenizer
  write_family(str(tmp_path), QWEN3)
  tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
  end = hand_ids(QWEN3, ['<|im_end|>'])
  codec = TextCodec(tokenizer, end + hand_ids(QWEN3, ['<|endoftext|>']), True, role=role)
  messages = [{'role': 'user', 'content': 'What is 3 plus one?'}]
  prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
  sampled = [hand_ids(QWEN3, ['<think>', f'\nthinking about {hint}\n', '</think>', f'\n\n{answer}']) + end
             for hint, answer in TURNS]

  async def play():
    episode = Episode(ScriptedPolicy(sampled), prompt, budget=400, key=np.zeros(2, np.uint32))
    replies = []
    for index, (hint, _) in enumerate(TURNS):
      turn = codec.turn(await episode.act(100))
      assert turn.text == f'<think>\nthinking about {hint}\n</think>\n\n{TURNS[index][1]}'
      if index < len(TURNS) - 1:
        replies.append(list(codec.reply(f'reply {index}', turn)))
        episode.observe(replies[-1])
    return episode.trajectory, replies

  trajectory, replies = asyncio.run(play())
  expected = sampled[0] + replies[0] + sampled[1] + replies[1] + sampled[2]
  rollout, _, _ = collate([trajectory], 400, 0)
  length = len(expected)
  assert rollout.tokens[0, :length].tolist() == expected  # the ids the update trains on: as sampled
  in_loss = [1] * len(sampled[0]) + [0] * len(replies[0]) + [1] * len(sampled[1]) + [0] * len(replies[1]) + \
      [1] * len(sampled[2])
  assert rollout.mask[0, :length].astype(int).tolist() == in_loss and not rollout.mask[0, length:].any()

  # The deployed conversation, rendered by the template: each reply is where the template puts it ...
  conversation = list(messages)
  for index, (_, answer) in enumerate(TURNS):
    conversation.append({'role': 'assistant', 'content': tokenizer.decode(sampled[index][:-1])})
    if index < len(TURNS) - 1:
      conversation.append({'role': role, 'content': f'reply {index}'})
  rendered = tokenizer.apply_chat_template(conversation, return_dict=False)
  assert rendered[:len(prompt)] == prompt
  ours = prompt + expected + hand_ids(QWEN3, ['\n'])  # the template ends the last message with a newline
  if role == 'tool':  # ... and with tool results only, the history is rendered as it was sampled
    assert rendered == ours
  else:  # a user message after a turn drops that turn's reasoning: rendering again changes the tokens
    assert rendered != ours
    assert hand_ids(QWEN3, ['<think>'])[0] not in rendered[len(prompt):len(prompt) + len(sampled[0])]
    assert rendered.count(hand_ids(QWEN3, ['<think>'])[0]) == 1  # the last turn's only


class Replies:
  """A text environment that answers each turn with a user message."""

  def __init__(self):
    self.count = 0

  async def reset(self):
    return ()

  async def step(self, turn):
    from grpo_jax.agents.agent import Step
    self.count += 1
    return Step(observation=f'reply {self.count - 1}')


def test_as_rendered_trains_each_turn_on_the_templates_context(tmp_path):
  """task.turn_context: as_rendered, on the Qwen3-style template: a row per turn (turn-major), each
  the conversation so far as the template renders it for deployment (the earlier turns' reasoning
  dropped, as a deployed Qwen3 reads it), then the turn's sampled ids, the loss on those only; the
  episode's reward on each of its rows. The same episode as_sampled is one row of the ids as
  sampled (the test above)."""
  from transformers import AutoTokenizer
  from grpo_jax.agents.agent import EnvironmentAgent, Problem
  from grpo_jax.agents.deadline import OnLoop
  write_family(str(tmp_path), QWEN3)
  tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
  end = hand_ids(QWEN3, ['<|im_end|>'])
  codec = TextCodec(tokenizer, end + hand_ids(QWEN3, ['<|endoftext|>']), True, role='user')
  messages = ({'role': 'user', 'content': 'What is 3 plus one?'},)
  prompt = tuple(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_dict=False))
  sampled = [hand_ids(QWEN3, ['<think>', f'\nthinking about {hint}\n', '</think>', f'\n\n{answer}']) + end
             for hint, answer in TURNS]
  policy = ScriptedPolicy(sampled)
  policy.vocab_size = len(tokenizer)
  agent = EnvironmentAgent(lambda problem, episode: Replies(), max_turns=3, turn_tokens=100, text=codec,
                           calls=OnLoop(), rendered=True)
  trajectory = asyncio.run(agent.episode(policy, Problem(prompt, messages=messages), 0, np.zeros(2, np.uint32), 400))
  trajectory.reward = 0.5
  rollout, scores, _ = collate([trajectory], 400, 0, turn_rows=3)
  conversation = list(messages)
  for k, (_, answer) in enumerate(TURNS):
    context = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    row = context[len(prompt):] + sampled[k]
    assert rollout.tokens[k, :len(row)].tolist() == row
    assert rollout.mask[k].astype(int).tolist() == [0] * (len(row) - len(sampled[k])) + [1] * len(sampled[k]) + \
        [0] * (400 - len(row))
    if k:  # the earlier turns' reasoning is gone from the rendered context
      assert hand_ids(QWEN3, ['<think>'])[0] not in context[len(prompt):]
    conversation += [{'role': 'assistant', 'content': tokenizer.decode(sampled[k][:-1])},
                     {'role': 'user', 'content': f'reply {k}'}]
  np.testing.assert_array_equal(rollout.log_probs[rollout.mask], -0.5)
  np.testing.assert_array_equal(scores.rewards, [0.5] * 3)


def test_turn_rows_take_their_episodes_advantage():
  """make_batch over turn rows (K per episode, turn-major): each row's advantage is its episode's,
  the group's statistics taken over episodes, not rows (NumPy: GRPO with Bessel's std)."""
  import jax.numpy as jnp
  from grpo_jax.data.task import Prompts, Scores
  from grpo_jax.rl.algo import AlgoConfig
  from grpo_jax.rl.step import make_batch
  from grpo_jax.sampler.rollout import Rollout
  rng = np.random.default_rng(0)
  prompts_count, group, turns, width = 3, 4, 2, 5
  episodes = rng.random(prompts_count * group).astype(np.float32)
  rows = turns * prompts_count * group
  rollout = Rollout(tokens=jnp.zeros((rows, width), jnp.int32), log_probs=jnp.zeros((rows, width)),
                    mask=jnp.ones((rows, width), bool), lengths=jnp.full((rows,), width), stopped=jnp.ones(rows, bool))
  prompts = Prompts(tokens=jnp.asarray(rng.integers(0, 9, (prompts_count, 3)), jnp.int32),
                    mask=jnp.ones((prompts_count, 3), jnp.int32), answers=None)
  batch = make_batch(prompts, rollout, Scores(rewards=jnp.tile(episodes, turns), failures=np.int32(0)),
                     AlgoConfig(group_size=group))
  grouped = episodes.reshape(-1, group)
  expected = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(np.asarray(batch.advantages), np.tile(expected.reshape(-1), turns), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(batch.prompt_tokens),
                                np.tile(np.repeat(prompts.tokens, group, 0), (turns, 1)))
