"""The Task protocol: what the RL step asks of a task, and the types that cross that boundary.

A task gives the prompts of a step and scores the step's completions. With `jittable` both are
JAX functions, so the step runs whole inside a jit (K steps in one call); otherwise they run on the
host, between the step's jitted sampler and its jitted update. The step itself (rl/step.py) is the
same either way.

The built-in tasks are registered by name in `TASKS`; the run's `task` config section names one.
"""

import dataclasses
import importlib
import typing
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp

from grpo_jax.data.sources import DatasetSource
from grpo_jax.errors import UserError, require
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sections import inline, section


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompts:
  """The P prompts of one step.

  tokens:   [P, Tp] int32, left-padded with the task's pad id.
  mask:     [P, Tp] int32, 1 on real tokens.
  answers:  what the task's reward compares completions with: [P, A] int32 expected tokens for the
            arithmetic task (a JAX array), P reference strings for a dataset task (host only).
  position: where the RL step drew them: the data position of the first (int32), and ...
  key:      ... the prompt key (the pool of partial rollouts records both, so a host task's answers
            can be drawn again after a resume); None from a task itself.
  """

  tokens: jax.Array
  mask: jax.Array
  answers: Any
  position: Any = None
  key: Any = None

  def map_arrays(self, fn) -> 'Prompts':
    """fn applied to the prompts' arrays (tokens, mask); the answers stay as they are (a host
    task's are strings)."""
    return dataclasses.replace(self, tokens=fn(self.tokens), mask=fn(self.mask))

  def repeat(self, group_size: int) -> 'Prompts':
    """Each prompt's arrays G times over, row p * G + g for sample g of prompt p (the rows of its
    completions); answers as they are."""
    return self.map_arrays(lambda x: jnp.repeat(x, group_size, axis=0))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scores:
  """Rewards of one step's P * G completions (row p * G + g is sample g of prompt p).

  rewards:   [P*G] fp32, the reward each completion trains on.
  failures:  int32 count of completions whose check timed out or crashed (scored 0).
  terms:     {label: [P*G] fp32} the unweighted terms a composed reward is the sum of (logged as
             reward/<label>); empty for a task with a single reward.
  """

  rewards: jax.Array
  failures: jax.Array
  terms: dict = dataclasses.field(default_factory=dict)

  def map_rows(self, fn) -> 'Scores':
    """fn applied to every per-row array (the rewards and each term); `failures` as it is."""
    return dataclasses.replace(self, rewards=fn(self.rewards), terms={label: fn(v) for label, v in self.terms.items()})

  def take(self, rows) -> 'Scores':
    """Rows `rows` (indices) of the rewards and terms; `failures` (a count over all rows) stays."""
    return self.map_rows(lambda x: x[rows])

  @classmethod
  def concatenate(cls, scores: 'list[Scores]') -> 'Scores':
    """The rows of several rounds' scores in order; failures summed."""
    return cls(rewards=jnp.concatenate([s.rewards for s in scores]), failures=sum(s.failures for s in scores),
               terms={label: jnp.concatenate([s.terms[label] for s in scores]) for label in scores[0].terms})


class Task(Protocol):
  """What the RL step needs from a task."""

  jittable: bool  # prompts() and reward() are JAX functions: whole steps can run inside one jit
  prompt_length: int  # Tp, the padded prompt width
  vocab_size: int  # ids the task's tokenizer can produce (<= the model's vocabulary)
  stop_token_ids: tuple[int, ...]  # a completion ends after emitting one of these
  pad_id: int  # fills prompts and finished completions

  def prompts(self, key: jax.Array, position: int, count: int) -> Prompts:
    """The `count` prompts of a step. `position`: prompts consumed by the run so far (a dataset
    task's order depends only on it and the run's seed, so a resumed run sees the same prompts);
    `key`: the step's prompt key (a generated task draws its problems from it)."""

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int) -> Scores:
    """Scores the G completions of each prompt."""

  def close(self) -> None:
    """Releases what the task holds (reward worker processes)."""


@dataclasses.dataclass(frozen=True)
class TaskShape:
  """A host-scored task as compiled programs see it, without its data (the plan's): the prompt
  width and the special ids. Its prompts and rewards come from the host between the compiled
  sampler and update, so it has none to give."""

  prompt_length: int
  vocab_size: int
  stop_token_ids: tuple[int, ...]
  pad_id: int
  jittable = False

  def prompts(self, key, position: int, count: int) -> Prompts:
    raise UserError('a task shape has no prompts: build the task from its data')

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int) -> Scores:
    raise UserError('a task shape has no reward: build the task from its data')

  def close(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class TaskKind:
  """A built-in task: whether its prompts and reward are JAX functions, whether it is scored by
  checking answers to a dataset's problems (reward terms and `grpo_jax.eval` apply), whether its
  rollouts are episodes acted on the inference server, and the module that holds it. That module
  defines check(task section) (the section's fields the task owns), check_run(config) (what the
  task asks of the run's other sections), build(config) -> Task (from a run's whole Config) and
  shape(config, architecture) -> Task (its shape for the plan, without its data)."""

  jittable: bool
  module: str  # imported when first used: a run imports only its own task's code
  answers: bool = False  # completions are answers checked against a dataset's (math)
  acts: bool = False  # rollouts are episodes on the inference server (agents.stage.AgentStage)

  def check(self, task_config: 'TaskConfig') -> None:
    importlib.import_module(self.module).check(task_config)

  def check_run(self, config) -> None:
    """The task's checks across a run's sections (config.Config runs it once they are built)."""
    importlib.import_module(self.module).check_run(config)

  def build(self, config) -> Task:
    return importlib.import_module(self.module).build(config)

  def shape(self, config, architecture) -> Task:
    return importlib.import_module(self.module).shape(config, architecture)


TaskName = Literal['arith', 'math', 'agent']
TASKS = {'arith': TaskKind(jittable=True, module='grpo_jax.data.arith'),
         'math': TaskKind(jittable=False, module='grpo_jax.data.math_task', answers=True),
         'agent': TaskKind(jittable=False, module='grpo_jax.agents.task', acts=True)}
assert set(TASKS) == set(typing.get_args(TaskName))


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """The `task` config section: what the policy is asked and how it is scored (data/arith.py,
  data/math_task.py). A dataset task's problems are written in this section: `task.source`,
  `task.split`, `task.format`, `task.prompt_field`, `task.answer_field` (data/sources.py)."""

  name: TaskName = 'arith'  # built-in arithmetic (reward in JAX) | math dataset (host reward) | agent (episodes)
  max_operand: int = 9  # arith: operands drawn from [0, max_operand]
  operators: str = '+'  # arith: operators drawn uniformly from these characters (+ - *)
  dataset: DatasetSource = inline(DatasetSource())  # math: the problems
  mix: tuple[DatasetSource, ...] = ()  # math: more datasets, shuffled into one stream with the task's own
  prompt_template: str = '{prompt}'  # math: format string; chat models go through the chat template
  chat_template: bool = True  # math: apply the tokenizer's chat template when it has one
  # math: the chat template's thinking switch (Qwen3: a <think> block before the answer, which the
  # reward skips); None: the template's own default. Templates without the switch ignore it.
  enable_thinking: bool | None = None
  tokenizer: str | None = None  # math: directory of the Hugging Face tokenizer; None: model.path's
  max_prompt_tokens: int = 512  # math: prompts are left-padded to this; longer prompts are skipped
  reward_workers: int = 4  # math: processes verifying answers with math-verify
  # agent: a built-in environment (guess_number, tool_use) or module:function returning an agents.task.AgentTask
  environment: str = 'guess_number'
  max_turns: int = 4  # agent: policy turns per episode
  turn_tokens: int = 0  # agent, tool_use: tokens per policy turn; 0: the rollout's max_new_tokens
  tools: tuple[str, ...] = ('python', 'calculator')  # agent, tool_use: the tools the policy may call
  tool_timeout_s: float = 10.0  # agent, tool_use: the deadline of one tool call (and answer check)
  guess_range: int = 16  # agent, guess_number: the secret is in [0, guess_range)

  def __post_init__(self):
    with section('task'):
      TASKS[self.name].check(self)
      for index, dataset in enumerate(self.mix):
        require(bool(dataset.source), f'mix[{index}].source', 'must name a dataset')
      require(self.reward_workers >= 1, 'reward_workers', f'must be >= 1, got {self.reward_workers}')
      require(self.turn_tokens >= 0, 'turn_tokens', f'must be >= 0, got {self.turn_tokens}')
      require(self.max_prompt_tokens >= 1, 'max_prompt_tokens', f'must be >= 1, got {self.max_prompt_tokens}')

  @property
  def kind(self) -> TaskKind:
    return TASKS[self.name]

  @property
  def jittable(self) -> bool:
    return self.kind.jittable
