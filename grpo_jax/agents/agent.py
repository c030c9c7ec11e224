"""Agents and environments over the inference interface.

An `Agent` is anything with

    async def episodes(llm, problem, count, key, budget) -> list[Trajectory]

that runs `count` episodes of one problem (a GRPO group) with the inference server `llm`, each in
at most `budget` tokens after the problem's prompt, and returns their trajectories with rewards.
Episode g draws from fold_in(key, g). The trainer owns the control flow: it hands an agent the
problems of a step, the live policy behind `llm` and the keys, and trains on what comes back.

Most agents are an `EnvironmentAgent`: the policy and an `Environment` take turns, up to
`max_turns` policy turns; the environment answers each turn with an observation (appended to the
conversation, outside the loss), a reward and whether the episode is over. Environments are
straight-line async code; one that waits (a tool in a worker process, a sleeping service) holds
no decode slot while it waits.
"""

import asyncio
import dataclasses
from typing import Any, Callable, Protocol

import jax
import numpy as np

from grpo_jax.agents.inference import TURN_BLOCK, Completion, InferenceServer, folded_keys
from grpo_jax.agents.trajectory import Episode, Trajectory
from grpo_jax.errors import UserError
from grpo_jax.model.token_ids import TokenIdError, check_token_ids


def episode_keys(key, count: int) -> np.ndarray:
  """fold_in(key, g) for the episodes g < count of a group, as raw key data [count, 2]."""
  return np.concatenate([folded_keys(key, first) for first in range(0, count, TURN_BLOCK)])[:count]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem of a step: the prompt every episode of its group starts from, what the
  environment needs to answer and score them (a secret, a reference answer), and its dataset's
  name (evaluation reports per source)."""

  prompt: tuple[int, ...]
  data: Any = None
  source: str = ''


class Agent(Protocol):

  async def episodes(self, llm: InferenceServer, problem: Problem, count: int, key: jax.Array,
                     budget: int) -> list[Trajectory]:
    """`count` episodes of `problem`, each within `budget` tokens after its prompt."""


@dataclasses.dataclass(frozen=True)
class Step:
  """An environment's answer to one policy turn: tokens appended for the policy to read (ignored
  when `done`), the reward the turn earned, whether the episode is over, whether the turn
  called a tool and whether that call failed (counted per episode), and the answer the turn gave
  (normalised text; evaluation's majority vote counts it), if any."""

  observation: tuple[int, ...] = ()
  reward: float = 0.0
  done: bool = False
  tool_call: bool = False
  tool_error: bool = False
  answer: str | None = None


class Environment(Protocol):

  async def reset(self) -> tuple[int, ...]:
    """Tokens the episode starts with after the prompt (often none)."""

  async def step(self, turn: Completion) -> Step:
    """Answers the policy's turn."""


@dataclasses.dataclass(frozen=True)
class EnvironmentAgent:
  """The policy and an environment taking turns: `make_environment(problem, episode)` makes episode
  `episode`'s environment; each policy turn is at most `turn_tokens` tokens, ending early at one of
  `stop_token_ids`; at most `max_turns` turns. An episode's reward is the sum of its turns'."""

  make_environment: Callable[[Problem, int], Environment]
  max_turns: int
  turn_tokens: int
  stop_token_ids: tuple[int, ...] = ()

  async def episodes(self, llm: InferenceServer, problem: Problem, count: int, key: jax.Array,
                     budget: int) -> list[Trajectory]:
    keys = episode_keys(key, count)
    return list(await asyncio.gather(*(self.episode(llm, problem, index, keys[index], budget)
                                       for index in range(count))))

  async def episode(self, llm: InferenceServer, problem: Problem, index: int, key: jax.Array,
                    budget: int) -> Trajectory:
    environment = self.make_environment(problem, index)
    episode = Episode(llm, problem.prompt, budget, key)
    episode.observe(observation(environment, 'reset()', await environment.reset(), llm.vocab_size))
    trajectory = episode.trajectory
    for _ in range(self.max_turns):
      turn = await episode.act(self.turn_tokens, self.stop_token_ids)
      if turn is None:
        break
      step = await environment.step(turn)
      trajectory.reward += step.reward
      trajectory.tool_calls += int(step.tool_call)
      trajectory.tool_errors += int(step.tool_error)
      if step.answer is not None:
        trajectory.answer = step.answer
      if step.done:
        break
      episode.observe(observation(environment, 'step()', step.observation, llm.vocab_size))
    return trajectory


def observation(environment: Environment, method: str, tokens, vocab_size: int) -> tuple[int, ...]:
  """An environment's answer, its ids checked against the model's vocabulary: an id outside it is
  a bug in the environment, which stops the run (UserError naming the environment) rather than
  reach the model, where it would be a NaN row."""
  try:
    return tuple(check_token_ids(tokens, vocab_size, 'observation').tolist())
  except TokenIdError as error:
    name = f'{type(environment).__module__}.{type(environment).__qualname__}'
    raise UserError(f'environment {name}: {method} returned an {error} (a bug in the environment)') from None
