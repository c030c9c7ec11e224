"""The Task protocol: what the RL step asks of a task, and the types that cross that boundary.

A task gives the prompts of a step and scores the step's completions. With `jittable` both are
JAX functions, so the step runs whole inside a jit (K steps in one call); otherwise they run on the
host, between the step's jitted sampler and its jitted update. The step itself (rl/loop.py) is the
same either way.
"""

import dataclasses
from typing import Any, Protocol

import jax

from grpo_jax.sampler.rollout import Rollout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompts:
  """The P prompts of one step.

  tokens:   [P, Tp] int32, left-padded with the task's pad id.
  mask:     [P, Tp] int32, 1 on real tokens.
  answers:  what the task's reward compares completions with: [P, A] int32 expected tokens for the
            arithmetic task (a JAX array), P reference strings for a dataset task (host only).
  """

  tokens: jax.Array
  mask: jax.Array
  answers: Any


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
