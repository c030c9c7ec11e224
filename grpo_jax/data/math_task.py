"""Math word problems from a dataset, rewarded on the host by checking answers with math-verify.

The task reads the records of `task.source` (data/sources.py), renders each question through
`task.prompt_template` and, for chat models, the tokenizer's chat template, tokenizes everything
once, and drops prompts longer than `task.max_prompt_tokens`. Prompts are served in a seeded
shuffle per epoch: the prompts of a step depend only on (run.seed, number of prompts consumed so
far), so a resumed run sees exactly the prompts the uninterrupted run would have seen.
Completions are decoded and scored 1.0 / 0.0 against the reference answers in a pool of
`task.reward_workers` processes (data/rewards.py); checks that time out or crash score 0 and are
counted in `Scores.failures`.
"""

import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.config import TaskConfig
from grpo_jax.data.rewards import RewardPool
from grpo_jax.data.sources import column, load_records
from grpo_jax.data.task import Prompts, Scores
from grpo_jax.errors import UserError
from grpo_jax.model.loading import load_tokenizer
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sampler.special_tokens import special_tokens


class MathTask:
  """Prompts from `task.source`, rewards from math-verify on the host (a Task). The tokenizer is
  read from `model_path`; `seed` (run.seed) orders the prompts."""

  jittable = False

  def __init__(self, task: TaskConfig, model_path: str, seed: int):
    self.tokenizer = load_tokenizer(model_path)
    if self.tokenizer is None:
      raise UserError(f'model.path {model_path} has no tokenizer (tokenizer.json or vocab.json)')
    self.task_config, self.seed = task, seed
    self.vocab_size = len(self.tokenizer)
    special = special_tokens(self.tokenizer)
    if special.eos_id is None:
      raise UserError(f'the tokenizer in model.path {model_path} has no eos token (set eos_token in '
                      'tokenizer_config.json)')
    self.eos_id, self.pad_id, self.stop_token_ids = special.eos_id, special.pad_id, special.stop_ids
    self.prompt_length = task.max_prompt_tokens
    self.use_chat_template = task.chat_template and bool(getattr(self.tokenizer, 'chat_template', None))
    if '\0' not in _format(task.prompt_template, '\0'):
      raise UserError(f'task.prompt_template {task.prompt_template!r} has no {{prompt}} for the question')
    self._load(task)
    self._permutations = {}
    self._pool = None

  # ---- data ----

  def _load(self, task: TaskConfig) -> None:
    records = load_records(task.source, task.split)
    questions = column(records, task.prompt_field, 'task.prompt_field', task.source)
    answers = column(records, task.answer_field, 'task.answer_field', task.source)
    texts = [self.render(question, index) for index, question in enumerate(questions)]
    ids = self.tokenizer(texts, add_special_tokens=not self.use_chat_template)['input_ids']
    keep = [index for index, row in enumerate(ids) if 0 < len(row) <= task.max_prompt_tokens]
    if not keep:
      raise UserError(f'every prompt of {task.source} is longer than task.max_prompt_tokens='
                      f'{task.max_prompt_tokens} tokens (the shortest has {min(map(len, ids))})')
    if len(keep) < len(ids):
      print(f'task: skipped {len(ids) - len(keep)} of {len(ids)} prompts of {task.source} longer than '
            f'task.max_prompt_tokens={task.max_prompt_tokens}', file=sys.stderr, flush=True)
    self.prompt_ids = [np.asarray(ids[index], np.int32) for index in keep]
    self.answers = [str(answers[index]) for index in keep]
    self.texts = [texts[index] for index in keep]

  def render(self, question, index: int = 0) -> str:
    """The prompt text of one question: the template, then the chat template for chat models."""
    if isinstance(question, list):  # already chat messages, as in some RL datasets
      if not self.use_chat_template:
        raise UserError(f'task.prompt_field {self.task_config.prompt_field!r} holds chat messages in record {index} '
                        f'of {self.task_config.source}; they need task.chat_template: true and a tokenizer with a '
                        'chat template')
      messages = question
    else:
      text = _format(self.task_config.prompt_template, question)
      if not self.use_chat_template:
        return text
      messages = [{'role': 'user', 'content': text}]
    return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

  @property
  def num_prompts(self) -> int:
    return len(self.prompt_ids)

  def order(self, position: int, count: int) -> np.ndarray:
    """Dataset indices of prompts position .. position + count - 1 of the run's stream: epoch e
    (= position // dataset size) is a permutation seeded by (run.seed, e)."""
    size = self.num_prompts
    indices = np.empty(count, np.int64)
    for i in range(count):
      epoch, offset = divmod(position + i, size)
      indices[i] = self._permutation(epoch)[offset]
    return indices

  def _permutation(self, epoch: int) -> np.ndarray:
    if epoch not in self._permutations:
      if len(self._permutations) >= 2:  # a batch spans at most the current epoch and the next
        self._permutations.pop(min(self._permutations))
      self._permutations[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)
    return self._permutations[epoch]

  def prompts(self, key: jax.Array, position: int, count: int) -> Prompts:
    """Prompts `position` .. `position + count - 1` of the run, left-padded to prompt_length;
    answers: their reference answers. `key` is unused: the order comes from run.seed and
    `position`, which checkpoints record."""
    del key
    indices = self.order(position, count)
    tokens = np.full((count, self.prompt_length), self.pad_id, np.int32)
    mask = np.zeros((count, self.prompt_length), np.int32)
    for row, index in enumerate(indices):
      ids = self.prompt_ids[index]
      tokens[row, self.prompt_length - len(ids):] = ids
      mask[row, self.prompt_length - len(ids):] = 1
    return Prompts(tokens=jnp.asarray(tokens), mask=jnp.asarray(mask),
                   answers=[self.answers[index] for index in indices])

  # ---- rewards ----

  def decode(self, tokens, mask) -> list[str]:
    """Completion texts of rows tokens [B, N] where mask [B, N]; ids beyond the tokenizer (the
    model's padded vocabulary) and special tokens are dropped."""
    tokens, mask = np.asarray(tokens), np.asarray(mask).astype(bool)
    return [self.tokenizer.decode(row[keep & (row < self.vocab_size)], skip_special_tokens=True)
            for row, keep in zip(tokens, mask)]

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int) -> Scores:
    """Rewards [P * G] (float32): row p * G + g is completion g of prompt p."""
    completions = self.decode(rollout.tokens, rollout.mask)
    answers = [answer for answer in prompts.answers for _ in range(group_size)]
    if len(completions) != len(answers):
      raise ValueError(f'{len(completions)} completions for {len(prompts.answers)} prompts x {group_size}')
    if self._pool is None:
      self._pool = RewardPool(self.task_config.reward_workers)
      weakref.finalize(self, self._pool.close)  # the workers end with the task, not only at exit
    failures = self._pool.failures
    rewards = self._pool.map(completions, answers)
    return Scores(rewards=jnp.asarray(rewards, jnp.float32),
                  failures=jnp.asarray(self._pool.failures - failures, jnp.int32))

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None


def _format(template: str, question) -> str:
  try:
    return template.format(prompt=question)
  except (KeyError, IndexError, ValueError) as error:
    raise UserError(f'task.prompt_template {template!r} is not a format string with only {{prompt}} '
                    f'({type(error).__name__}: {error}); write literal braces doubled, e.g. \\boxed{{{{}}}}') from None
