"""The built-in task: short integer arithmetic, with prompts and rewards written in JAX.

A prompt is `<bos>a+b=` (operators from the config), the answer is the integer result followed by
`<|endoftext|>`, and the reward is 1 exactly when the completion starts with those tokens. Both
sampling prompts and scoring completions are jittable, so whole RL steps can run inside one jit
with no host round trip. The character-level tokenizer is built here with the `tokenizers`
library, so the task needs no files and no network.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from grpo_jax.data.task import Prompts, Scores, Stateless, TaskSection
from grpo_jax.errors import require
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sections import section

PAD, EOS, BOS = '<pad>', '<|endoftext|>', '<bos>'
SYMBOLS = (PAD, EOS, BOS) + tuple('0123456789+-*=')
OPERATORS = '+-*'


def build_tokenizer() -> Tokenizer:
  """One token per character; ids: <pad> 0, <|endoftext|> 1, <bos> 2, digits 3..12, + - * =."""
  tokenizer = Tokenizer(models.WordLevel({s: i for i, s in enumerate(SYMBOLS)}, unk_token=PAD))
  tokenizer.pre_tokenizer = pre_tokenizers.Split('', 'isolated')
  tokenizer.decoder = decoders.Fuse()
  return tokenizer


def check_arguments(max_operand: int, operators: str) -> None:
  """The task's own checks of its two settings."""
  require(1 <= max_operand <= 9999, 'max_operand', f'must be in [1, 9999], got {max_operand}')
  require(bool(operators) and all(op in OPERATORS for op in operators), 'operators',
          f'must be characters from {OPERATORS!r}, got {operators!r}')


@dataclasses.dataclass(frozen=True)
class ArithSection(TaskSection):
  """The `task` section of `task.name: arith` (the default): the problems' operands and operators.
  Its tokenizer is built in, so it asks nothing of the run's other sections."""

  name: Literal['arith'] = 'arith'
  max_operand: int = 9  # operands drawn from [0, max_operand]
  operators: str = '+'  # operators drawn uniformly from these characters (+ - *)

  def __post_init__(self):
    with section('task'):
      check_arguments(self.max_operand, self.operators)


def build(config) -> 'ArithmeticTask':
  """The task of a run's Config (its `task` section), checked against the rollout's budget."""
  task = ArithmeticTask(config.task.max_operand, config.task.operators)
  require(config.rollout.max_new_tokens >= task.answer_length, 'rollout.max_new_tokens',
          f'({config.rollout.max_new_tokens}) is shorter than the longest answer with its end token '
          f'({task.answer_length})')
  return task


def shape(config, architecture) -> 'ArithmeticTask':
  """What the plan compiles: the task itself (it has no data to read)."""
  del architecture
  return build(config)


class ArithmeticTask(Stateless):
  """`a op b =` with operands in [0, max_operand] and operators from `operators` (a Task)."""

  jittable = True
  vision_bucket = None  # text prompts

  def __init__(self, max_operand: int = 9, operators: str = '+'):
    check_arguments(max_operand, operators)
    self.max_operand = max_operand
    self.operators = operators
    self.tokenizer = build_tokenizer()
    self.vocab_size = len(SYMBOLS)
    self.pad_id, self.eos_id, self.bos_id = 0, 1, 2
    self.stop_token_ids = (self.eos_id,)
    self.operand_width = len(str(max_operand))
    largest = max_operand * max_operand if '*' in operators else 2 * max_operand
    self.result_width = len(str(largest)) + ('-' in operators)  # digits and a sign
    self.prompt_length = 2 + 2 * self.operand_width + 1  # <bos> a op b =
    self.answer_length = self.result_width + 1  # result and EOS

  def _id(self, symbol: str) -> int:
    return SYMBOLS.index(symbol)

  def _number(self, value: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """Right-aligned tokens [P, width] of integers (with a '-' sign) and their real-token mask."""
    magnitude = jnp.abs(value)
    powers = 10 ** jnp.arange(width - 1, -1, -1)
    digits = (magnitude[:, None] // powers) % 10
    # A digit is shown from the most significant non-zero one on (and the last digit always).
    shown = (magnitude[:, None] >= powers) | (powers == 1)
    tokens = jnp.where(shown, digits + self._id('0'), self.pad_id)
    # The sign goes in the slot just before the first shown digit.
    first = jnp.argmax(shown, axis=1)
    sign_slot = (jnp.arange(width)[None] == (first - 1)[:, None]) & (value < 0)[:, None]
    tokens = jnp.where(sign_slot, self._id('-'), tokens)
    return tokens.astype(jnp.int32), (shown | sign_slot).astype(jnp.int32)

  @staticmethod
  def _pack(tokens: jax.Array, real: jax.Array, left: bool) -> tuple[jax.Array, jax.Array]:
    """Moves each row's real tokens to the right end (left=True: left padding) or the left end."""
    order = jnp.argsort(real if left else 1 - real, axis=1, stable=True)
    return jnp.take_along_axis(tokens, order, axis=1), jnp.take_along_axis(real, order, axis=1)

  def prompts(self, key: jax.Array, position, count: int) -> Prompts:
    """`count` random problems drawn from `key` (`position` is unused: nothing is consumed). Jittable."""
    del position
    operand_key, operator_key = jax.random.split(key)
    a, b = jax.random.randint(operand_key, (2, count), 0, self.max_operand + 1)
    operator = jax.random.randint(operator_key, (count,), 0, len(self.operators))
    operator_ids = jnp.asarray([self._id(op) for op in self.operators], jnp.int32)[operator]
    results = jnp.zeros_like(a)
    for index, op in enumerate(self.operators):
      value = {'+': a + b, '-': a - b, '*': a * b}[op]
      results = jnp.where(operator == index, value, results)
    a_tokens, a_real = self._number(a, self.operand_width)
    b_tokens, b_real = self._number(b, self.operand_width)
    ones = jnp.ones((count, 1), jnp.int32)
    tokens = jnp.concatenate([ones * self.bos_id, a_tokens, operator_ids[:, None], b_tokens,
                              ones * self._id('=')], axis=1)
    real = jnp.concatenate([ones, a_real, ones, b_real, ones], axis=1)
    tokens, real = self._pack(tokens, real, left=True)
    result_tokens, result_real = self._number(results, self.result_width)
    answers = jnp.concatenate([result_tokens, ones * self.eos_id], axis=1)
    answers, answer_real = self._pack(answers, jnp.concatenate([result_real, ones], axis=1), left=False)
    return Prompts(tokens=tokens, mask=real, answers=jnp.where(answer_real > 0, answers, -1))

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int, model_scores: dict) -> Scores:
    """1.0 where a completion starts with its expected tokens (result and EOS), else 0.0. Jittable."""
    del model_scores  # its reward is its own (a run's reward terms are for dataset tasks)
    answers = jnp.repeat(prompts.answers, group_size, axis=0)  # [P*G, A]
    completions, width = rollout.tokens, answers.shape[1]
    if completions.shape[1] < width:
      completions = jnp.pad(completions, ((0, 0), (0, width - completions.shape[1])), constant_values=-2)
    head = completions[:, :width]
    rewards = jnp.all((head == answers) | (answers < 0), axis=1).astype(jnp.float32)
    return Scores(rewards=rewards, failures=jnp.zeros((), jnp.int32))

  def close(self) -> None:
    pass

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in np.asarray(ids) if i != self.pad_id], skip_special_tokens=False)
