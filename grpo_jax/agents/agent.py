"""Agents and environments over the inference interface.

An `Agent` is anything with

    async def episodes(llm, problem, count, key, budget) -> list[Trajectory]

that runs `count` episodes of one problem (a GRPO group) with the inference server `llm`, each in
at most `budget` tokens after the problem's prompt, and returns their trajectories with rewards.
Episode g draws from fold_in(key, g). The trainer owns the control flow: it hands an agent the
problems of a step, the live policy behind `llm` and the keys, and trains on what comes back.

Most agents are an `EnvironmentAgent`: the policy and an `Environment` take turns, up to
`max_turns` policy turns; the environment reads each turn (a `Turn`: its ids and its text) and
answers with an observation (ids or text, appended to the conversation, outside the loss; an
`Observation` with images for a vision-language policy, agents/images.py), a reward and whether the
episode is over. Environments are
straight-line async code; one that waits (a tool in a worker process, a sleeping service) holds
no decode slot while it waits. Each call of an environment has a deadline (`task.env_timeout_s`);
one that raises or runs past it ends its episode only (agents/deadline.py).
"""

import asyncio
import dataclasses
from typing import Any, Callable, Protocol

import jax
import numpy as np

from grpo_jax.agents.deadline import EnvironmentFailed, InThreads, OnLoop, name
from grpo_jax.agents.images import ImageReader, Observation
from grpo_jax.agents.inference import TURN_BLOCK, InferenceServer, folded_keys
from grpo_jax.agents.text import TextCodec, Turn
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
  name (evaluation reports per source). images: the prompt's images in order (a vision-language
  policy; anything model/images.load_image reads), each standing in `prompt` for its run of image
  tokens (agents/images.py). messages: the chat messages `prompt` renders (its chat template's
  input), which task.turn_context: as_rendered renders again with each turn's history; () where
  the prompt is no chat (ids of its own)."""

  prompt: tuple[int, ...]
  data: Any = None
  source: str = ''
  images: tuple = ()
  messages: tuple = ()


class Agent(Protocol):

  async def episodes(self, llm: InferenceServer, problem: Problem, count: int, key: jax.Array,
                     budget: int) -> list[Trajectory]:
    """`count` episodes of `problem`, each within `budget` tokens after its prompt."""


@dataclasses.dataclass(frozen=True)
class Step:
  """An environment's answer to one policy turn: what the policy reads next (ignored when `done`):
  token ids, or text (sent as the task's next `user` message, agents/text.py), or an Observation of
  either with images (agents/images.py: task.max_images must make room for them); the reward the turn
  earned; whether the episode is over; whether the turn called a tool and whether that call failed
  (counted per episode); and the answer the turn gave, if any: normalised text, which evaluation's
  majority vote counts (the episode's last answer is its vote)."""

  observation: tuple[int, ...] | str | Observation = ()
  reward: float = 0.0
  done: bool = False
  tool_call: bool = False
  tool_error: bool = False
  answer: str | None = None


class Environment(Protocol):

  async def reset(self) -> tuple[int, ...] | str | Observation:
    """What the episode starts with after the prompt (often nothing): ids, or text appended as
    written, or an Observation of either with images."""

  async def step(self, turn: Turn) -> Step:
    """Answers the policy's turn (turn.text: its text without the stop id; turn.tokens: its ids)."""


@dataclasses.dataclass(frozen=True)
class EnvironmentAgent:
  """The policy and an environment taking turns: `make_environment(problem, episode)` makes episode
  `episode`'s environment; a policy turn ends at one of the task's stop ids (AgentTask.stop_token_ids,
  the one place they are set) or after `turn_tokens` tokens; an episode ends when a step says
  `done`, after `max_turns` turns, or when its token budget is spent. Its reward is the sum of its
  turns'.

  `max_turns` and `turn_tokens` are the run's (`task.max_turns`, `task.turn_tokens`): the task's
  build (agents/task.py) sets them, and `text` (the task tokenizer's TextCodec, for Turn.text and
  text observations). An environment may give tighter bounds of its own here (the guessing game's
  turns are one token): the smaller of its value and the run's applies.

  `calls` runs the making of the environment, its reset and its step (agents/deadline.py): in
  worker threads (the default, for environments of your own, whose code may block) or on the
  episodes' loop (OnLoop: the built-ins, which only await); `timeout_s` is each call's deadline (the run's
  `task.env_timeout_s`, which the task's build sets; None: none). A call that raises or runs past
  it ends its episode: masked from the loss, scored 0, counted (Trajectory.fail).

  `images`: how the images an environment shows (and a problem's) become the model's, set by the
  task's build from task.max_images (None: the run takes none, and an Observation with images is
  refused in one line).

  `rendered` (task.turn_context: as_rendered): each turn's context is also kept as the chat
  template renders the conversation so far (the problem's messages, each turn's text as the
  assistant's, each text observation as a `text.role` message; Trajectory.contexts), which the
  update then trains the turn on instead of the context as sampled."""

  make_environment: Callable[[Problem, int], Environment]
  max_turns: int | None = None
  turn_tokens: int | None = None
  text: TextCodec | None = None
  calls: OnLoop = dataclasses.field(default_factory=InThreads)
  timeout_s: float | None = None
  images: ImageReader | None = None
  rendered: bool = False

  async def episodes(self, llm: InferenceServer, problem: Problem, count: int, key: jax.Array,
                     budget: int) -> list[Trajectory]:
    keys = episode_keys(key, count)
    images = self.prompt_images(problem)  # made into patches once for the group
    return list(await asyncio.gather(*(self.episode(llm, problem, index, keys[index], budget, images)
                                       for index in range(count))))

  def prompt_images(self, problem: Problem) -> tuple:
    """The problem's images as the model's (patches, grid), checked against its prompt."""
    if not problem.images:
      return ()
    where = f'agent problem ({len(problem.prompt)} prompt tokens)'
    if self.images is None:
      raise UserError(f'{where} holds {len(problem.images)} images, but the run takes none: set task.max_images '
                      '(images an episode may hold) on a vision-language model')
    if len(problem.images) > self.images.bucket.images:
      raise UserError(f'{where} holds {len(problem.images)} images, over task.max_images '
                      f'({self.images.bucket.images})')
    images = self.images.read(problem.images, where)
    self.images.check(problem.prompt, images, where)
    return images

  async def episode(self, llm: InferenceServer, problem: Problem, index: int, key: jax.Array,
                    budget: int, images: tuple = ()) -> Trajectory:
    if self.max_turns is None or self.turn_tokens is None:
      raise ValueError('EnvironmentAgent: max_turns and turn_tokens are unset (agents.task.build sets them from the '
                       'run\'s task section)')
    episode = Episode(llm, problem.prompt, budget, key, images=images, reader=self.images)
    trajectory = episode.trajectory
    conversation = list(problem.messages) if self.rendered else None
    async with self.calls.open(None, self.timeout_s) as call:
      try:
        environment = await call.make(self.make_environment, problem, index)
        reset = await call('reset')
        if self.rendered and reset not in ((), ''):
          raise UserError(f'environment {name(environment)}: reset() returned {reset!r}; with task.turn_context: '
                          'as_rendered the episode starts at its prompt (its first message): return nothing')
        episode.observe(*self.observation(environment, 'reset()', reset, None, llm.vocab_size,
                                          len(trajectory.images)))
        for index in range(self.max_turns):
          if conversation is not None:
            trajectory.contexts.append(self.rendered_context(problem, conversation) if index else ())
          completion = await episode.act(self.turn_tokens)
          if completion is None:
            break
          turn = self.text.turn(completion) if self.text is not None else Turn(**vars(completion))
          if conversation is not None:
            conversation.append({'role': 'assistant', 'content': turn.text})
          step = await call('step', turn)
          trajectory.reward += step.reward
          trajectory.tool_calls += int(step.tool_call)
          trajectory.tool_errors += int(step.tool_error)
          if step.answer is not None:
            trajectory.answer = step.answer
          if step.done or index == self.max_turns - 1:  # no turn reads an answer to the last one
            break
          if conversation is not None:
            if not isinstance(step.observation, str):
              raise UserError(f'environment {name(environment)}: step() answered with ids or images; '
                              'task.turn_context: as_rendered renders the conversation again, which takes text '
                              'observations')
            conversation.append({'role': self.text.role, 'content': step.observation})
          episode.observe(*self.observation(environment, 'step()', step.observation, turn, llm.vocab_size,
                                            len(trajectory.images)))
      except EnvironmentFailed as failure:  # an id outside the vocabulary is a UserError: it stops the run
        trajectory.fail(failure.timed_out)
    return trajectory

  def rendered_context(self, problem: Problem, conversation: list[dict]) -> tuple[int, ...]:
    """The conversation's ids as its chat template renders them, after the prompt (which they must
    start with, as a template renders the first message the same whatever follows)."""
    ids = self.text.render(conversation)
    prompt = tuple(problem.prompt)
    if ids[:len(prompt)] != prompt:
      raise UserError('task.turn_context: as_rendered: the chat template renders the conversation with another '
                      'start than its prompt (the first message), so its turns cannot share the prompt')
    return ids[len(prompt):]

  def observation(self, environment: Environment, method: str, answer, turn: Turn | None,
                  vocab_size: int, shown: int = 0) -> tuple[tuple[int, ...], tuple]:
    """An environment's answer as (ids, images): text through the task's tokenizer (a reply to
    `turn`, or as written after the prompt), an Observation's images made into patches and its
    markers into their image tokens, ids checked against the model's vocabulary. `shown`: the
    images the episode holds already (with these, at most task.max_images)."""
    images, where = (), f'environment {name(environment)}: {method}'
    if isinstance(answer, Observation):
      if answer.images:
        if self.images is None:
          raise UserError(f'{where} showed {len(answer.images)} images, but the run takes none: set '
                          'task.max_images (images an episode may hold) on a vision-language model')
        if shown + len(answer.images) > self.images.bucket.images:
          raise UserError(f'{where} showed image {shown + len(answer.images)} of its episode, over task.max_images '
                          f'({self.images.bucket.images})')
        images = self.images.read(answer.images, where)
      answer = answer.content
      if isinstance(answer, str) and self.images is not None:
        answer = self.images.expand(answer, images, where)
    if isinstance(answer, str):
      if self.text is None:
        raise UserError(f'environment {name(environment)}: {method} returned text, but the task has no tokenizer '
                        '(AgentTask.tokenizer) to encode it')
      answer = self.text.encode(answer) if turn is None else self.text.reply(answer, turn)
    ids = observation(environment, method, answer, vocab_size)
    if self.images is not None:
      self.images.check(ids, images, where)
    return ids, images


def observation(environment: Environment, method: str, tokens, vocab_size: int) -> tuple[int, ...]:
  """An environment's answer, its ids checked against the model's vocabulary: an id outside it is
  a bug in the environment, which stops the run (UserError naming the environment) rather than
  reach the model, where it would be a NaN row."""
  try:
    return tuple(check_token_ids(tokens, vocab_size, 'observation').tolist())
  except TokenIdError as error:
    raise UserError(f'environment {name(environment)}: {method} returned an {error} (a bug in the environment)') \
        from None
