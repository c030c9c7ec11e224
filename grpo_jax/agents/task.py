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
from typing import Any, Callable

import numpy as np

from grpo_jax.agents.agent import Agent, Problem
from grpo_jax.data.task import Prompts
from grpo_jax.errors import UserError, require

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


def check(task_config) -> None:
  """The `task` section's agent fields (data/task.py's registry runs it)."""
  environment = task_config.environment
  require(environment in BUILT_IN or environment.count(':') == 1, 'environment',
          f'must be one of {", ".join(BUILT_IN)} or module:function, got {environment!r}')
  require(task_config.max_turns >= 1, 'max_turns', f'must be >= 1, got {task_config.max_turns}')
  module = _module(environment)
  if module is not None:
    module.check(task_config)


def check_run(config) -> None:
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
