"""An agent as the trainer's task: the problems of each step, and the agent that runs their
episodes (`task.name: agent`, `task.environment` names it).

The task section's `environment` is a built-in (`guess_number`: agents/guess.py, `tool_use`:
agents/tool_use.py) or
`module:function`, a function of the run's Config returning an AgentTask (as custom reward terms
are named). The RL step (rl/step.py) runs the agent's episodes in place of sampling and scoring
(agents/stage.py): everything after that — advantages, the update, dynamic sampling, checkpoints
and resume — is the same as for any task.
"""

import dataclasses
import importlib
from typing import Any, Callable, Literal

import numpy as np

from grpo_jax.agents.agent import Agent, Problem
from grpo_jax.data.task import Prompts
from grpo_jax.data.math_task import ProblemFields
from grpo_jax.errors import UserError, require
from grpo_jax.sections import section

BUILT_IN = {'guess_number': 'grpo_jax.agents.guess', 'tool_use': 'grpo_jax.agents.tool_use'}


@dataclasses.dataclass
class AgentTask:
  """problems(position, count) -> the step's Problems (a problem's order depends only on the run's
  seed and its position, so a resumed run sees the same ones); agent: runs their episodes.
  prompt_length: Tp, prompts are left-padded to it with `pad_id`. eval_problems() -> the held-out
  problems evaluation runs episodes of (None: the task has none)."""

  agent: Agent
  problems: Callable[[int, int], list[Problem]]
  prompt_length: int
  vocab_size: int
  stop_token_ids: tuple[int, ...]
  pad_id: int
  tokenizer: Any = None
  close: Callable[[], None] = lambda: None
  eval_problems: Callable[[], list[Problem]] | None = None  # held-out problems (agents/evaluation.py)
  jittable = False

  def prompts(self, key, position: int, count: int) -> Prompts:
    """The step's problems, their prompts left-padded [count, Tp]; answers: the Problems."""
    del key
    problems = self.problems(position, count)
    tokens = np.full((count, self.prompt_length), self.pad_id, np.int32)
    mask = np.zeros((count, self.prompt_length), np.int32)
    for row, problem in enumerate(problems):
      length = len(problem.prompt)
      if not 1 <= length <= self.prompt_length:
        raise UserError(f'agent problem {position + row}: a prompt of {length} tokens; prompts hold 1 to '
                        f'{self.prompt_length}')
      tokens[row, self.prompt_length - length:] = problem.prompt
      mask[row, self.prompt_length - length:] = 1
    return Prompts(tokens=tokens, mask=mask, answers=problems)


def _module(environment: str):
  if environment in BUILT_IN:
    return importlib.import_module(BUILT_IN[environment])
  return None


@dataclasses.dataclass(frozen=True)
class AgentSection(ProblemFields):
  """The `task` section of `task.name: agent`: the environment and its episodes' bounds. The problem
  fields it shares with the math task are read by environments that pose a dataset's problems
  (tool_use); an environment's own fields are checked by its module's check(section)."""

  name: Literal['agent'] = 'agent'
  # A built-in environment (guess_number, tool_use) or module:function returning an agents.task.AgentTask
  environment: str = 'guess_number'
  max_turns: int = 4  # policy turns per episode
  turn_tokens: int = 0  # tool_use: tokens per policy turn; 0: the rollout's max_new_tokens
  tools: tuple[str, ...] = ('python', 'calculator')  # tool_use: the tools the policy may call
  tool_timeout_s: float = 10.0  # tool_use: the deadline of one tool call (and answer check)
  guess_range: int = 16  # guess_number: the secret is in [0, guess_range)

  def __post_init__(self):
    super().__post_init__()
    with section('task'):
      environment = self.environment
      require(environment in BUILT_IN or environment.count(':') == 1, 'environment',
              f'must be one of {", ".join(BUILT_IN)} or module:function, got {environment!r}')
      require(self.max_turns >= 1, 'max_turns', f'must be >= 1, got {self.max_turns}')
      require(self.turn_tokens >= 0, 'turn_tokens', f'must be >= 0, got {self.turn_tokens}')
      module = _module(environment)
      if module is not None:
        module.check(self)

  def check_run(self, config) -> None:
    """Agent episodes run on the inference server, one policy version each: no partial rollouts."""
    require(config.algo.max_lag == 0, 'algo.max_lag',
            'applies to single-turn tasks (arith, math); agent episodes run on the inference server')


def build(config) -> AgentTask:
  environment = config.task.environment
  module = _module(environment)
  if module is not None:
    return module.build(config)
  name, function = environment.split(':')
  try:
    factory = getattr(importlib.import_module(name), function)
  except (ImportError, AttributeError) as error:
    raise UserError(f'task.environment {environment}: cannot import it ({error})') from None
  task = factory(config)
  if not isinstance(task, AgentTask):
    raise UserError(f'task.environment {environment}: returned {type(task).__name__}, not an AgentTask')
  return task


def shape(config, architecture):
  """The task for the plan: a built-in's own shape when it has one (nothing read), else the task."""
  module = _module(config.task.environment)
  if module is not None and hasattr(module, 'shape'):
    return module.shape(config, architecture)
  return build(config)
