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

from grpo_jax.errors import UserError
from grpo_jax.sampler.rollout import Rollout


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
  vision:   the prompts' images and M-RoPE positions (model/vision.py Vision, rows [P, ...]) for a
            vision-language model; None: text prompts.
  """

  tokens: jax.Array
  mask: jax.Array
  answers: Any
  position: Any = None
  key: Any = None
  vision: Any = None

  def _rows(self) -> tuple:
    """The per-row arrays: tokens, mask and the vision's (None: none); a host task's answers are
    strings, and position and key describe the draw, not a row."""
    return self.tokens, self.mask, self.vision

  def map_arrays(self, fn) -> 'Prompts':
    """fn applied to the prompts' arrays (tokens, mask, each leaf of vision); the answers stay as
    they are (a host task's are strings)."""
    tokens, mask, vision = jax.tree.map(fn, self._rows())
    return dataclasses.replace(self, tokens=tokens, mask=mask, vision=vision)

  def repeat(self, group_size: int) -> 'Prompts':
    """Each prompt's arrays G times over, row p * G + g for sample g of prompt p (the rows of its
    completions); answers as they are."""
    return self.map_arrays(lambda x: jnp.repeat(x, group_size, axis=0))

  def take(self, rows) -> 'Prompts':
    """Rows `rows` (indices) of the prompts' arrays; answers as they are."""
    return self.map_arrays(lambda x: x[rows])

  @classmethod
  def concatenate(cls, prompts: 'list[Prompts]') -> 'Prompts':
    """The arrays of several draws' prompts, in order. Their answers, position and key are each
    draw's own: None here (the caller gathers the answers of the rows it keeps)."""
    tokens, mask, vision = jax.tree.map(lambda *rows: jnp.concatenate(rows), *[p._rows() for p in prompts])
    return cls(tokens=tokens, mask=mask, answers=None, vision=vision)


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
  # The images every prompt's are padded to (model.vision.ImageBucket), None for text prompts: the
  # shapes a pool of partial rollouts holds and the plan compiles with.
  vision_bucket: Any

  def prompts(self, key: jax.Array, position: int, count: int) -> Prompts:
    """The `count` prompts of a step. `position`: prompts consumed by the run so far (a dataset
    task's order depends only on it and the run's seed, so a resumed run sees the same prompts);
    `key`: the step's prompt key (a generated task draws its problems from it)."""

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int, model_scores: dict) -> Scores:
    """Scores the G completions of each prompt. model_scores: {label: [P*G] fp32}, what the step's
    models (reward models, rl/model_scores.py) gave the completions, for the reward terms that
    read them; {} in a run without such terms."""

  def state_dict(self) -> dict:
    """What the task carries from step to step beyond the data position (the running statistics of
    its reward terms), as JSON: checkpoints record it, so a resumed run scores as the
    uninterrupted one would. {} for a task that carries nothing (Stateless)."""

  def load_state_dict(self, state: dict) -> None:
    """Takes back what state_dict gave (a checkpoint's; {} from one written before it was recorded)."""

  def close(self) -> None:
    """Releases what the task holds (reward worker processes)."""


class Stateless:
  """The state_dict / load_state_dict of a task that carries nothing from step to step but the
  data position (which the train state holds)."""

  def state_dict(self) -> dict:
    return {}

  def load_state_dict(self, state: dict) -> None:
    del state


@dataclasses.dataclass(frozen=True)
class TaskShape(Stateless):
  """A host-scored task as compiled programs see it, without its data (the plan's): the prompt
  width and the special ids. Its prompts and rewards come from the host between the compiled
  sampler and update, so it has none to give."""

  prompt_length: int
  vocab_size: int
  stop_token_ids: tuple[int, ...]
  pad_id: int
  jittable = False
  vision_bucket = None

  def prompts(self, key, position: int, count: int) -> Prompts:
    raise UserError('a task shape has no prompts: build the task from its data')

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int, model_scores: dict) -> Scores:
    raise UserError('a task shape has no reward: build the task from its data')

  def close(self) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class TaskKind:
  """A built-in task: whether its prompts and reward are JAX functions, whether it is scored by
  checking answers to a dataset's problems (reward terms and `grpo_jax.eval` apply), whether its
  rollouts are episodes acted on the inference server, the module that holds it and the class of
  its `task` section there (a TaskSection). That module also defines build(config) -> Task (from a
  run's whole Config) and shape(config, architecture) -> Task (its shape for the plan, without its
  data)."""

  jittable: bool
  module: str  # imported when first used: a run imports only its own task's code
  section_class: str  # the TaskSection subclass in `module` holding this kind's fields
  answers: bool = False  # completions are answers checked against a dataset's (math)
  acts: bool = False  # rollouts are episodes on the inference server (agents.stage.AgentStage)

  @property
  def section(self) -> type['TaskSection']:
    return getattr(importlib.import_module(self.module), self.section_class)

  def build(self, config) -> Task:
    return importlib.import_module(self.module).build(config)

  def shape(self, config, architecture) -> Task:
    return importlib.import_module(self.module).shape(config, architecture)


TaskName = Literal['arith', 'math', 'agent', 'spot']
TASKS = {'arith': TaskKind(jittable=True, module='grpo_jax.data.arith', section_class='ArithSection'),
         'math': TaskKind(jittable=False, module='grpo_jax.data.math_task', section_class='MathSection', answers=True),
         'agent': TaskKind(jittable=False, module='grpo_jax.agents.task', section_class='AgentSection', acts=True),
         'spot': TaskKind(jittable=True, module='grpo_jax.data.spot', section_class='SpotSection')}
assert set(TASKS) == set(typing.get_args(TaskName))


@dataclasses.dataclass(frozen=True)
class TaskSection:
  """The `task` config section, a tagged union: `task.name` picks the task kind (TASKS), and the
  kind's own subclass, defined beside its code, holds its fields and checks them
  (data/arith.py ArithSection, data/math_task.py MathSection, agents/task.py AgentSection).
  config.py builds the subclass that `name` picks. A subclass's `check_run(config)` checks what the
  task asks of the run's other sections (config.Config runs it once they are built)."""

  # built-in arithmetic (reward in JAX) | math dataset (host reward) | agent (episodes) | spot (images, in JAX)
  name: TaskName = 'arith'

  @staticmethod
  def variants() -> dict[str, type['TaskSection']]:
    """The section's class for each value of its tag, `name` (config.py reads a section by it)."""
    return {name: kind.section for name, kind in TASKS.items()}

  @staticmethod
  def variant(name: 'TaskName') -> type['TaskSection']:
    """The section's class for the task named `name` (one of TASKS: config.py checks the name first)."""
    return TASKS[name].section

  @property
  def kind(self) -> TaskKind:
    return TASKS[self.name]

  @property
  def jittable(self) -> bool:
    return self.kind.jittable

  @property
  def tokenizer_directory(self) -> str | None:
    """The directory this section reads its tokenizer from (None: the model's, or a built-in one)."""
    return None

  def check_run(self, config) -> None:
    """What the task asks of the run's other sections (nothing by default)."""
    del config
