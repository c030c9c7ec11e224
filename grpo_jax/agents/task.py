"""An agent as the trainer's task: the problems of each step, and the agent that runs their
episodes (`task.name: agent`, `task.environment` names it).

The task section's `environment` is a built-in (`guess_number`: agents/guess.py, `tool_use`:
agents/tool_use.py, `spot`: agents/spot.py, which shows images) or `module:function`: a factory
`function(config, **task.environment_args)` returning an AgentTask, imported from the Python path
(as custom reward terms are named). A text environment's factory is a few lines with `text_task`
(docs/agents.md, "Your own environment"). The RL step (rl/step.py) runs the agent's episodes in place of sampling and scoring (agents/stage.py):
everything after that — advantages, the update, dynamic sampling, checkpoints and resume — is the
same as for any task.
"""

import contextlib
import dataclasses
import importlib
import inspect
from typing import Any, Callable, Literal

import numpy as np

from grpo_jax.agents import images
from grpo_jax.agents.agent import Agent, EnvironmentAgent, Environment, Problem
from grpo_jax.agents.images import ImageReader
from grpo_jax.agents.text import TextCodec
from grpo_jax.data.math_task import (ProblemFields, open_tokenizer, prompt_messages, render_prompt, template_options,
                                     tokenize_prompts)
from grpo_jax.data.task import Prompts, Stateless
from grpo_jax.errors import FieldError, UserError, require
from grpo_jax.sections import section

BUILT_IN = {'guess_number': 'grpo_jax.agents.guess', 'tool_use': 'grpo_jax.agents.tool_use',
            'spot': 'grpo_jax.agents.spot'}


@dataclasses.dataclass
class AgentTask(Stateless):
  """problems(position, count) -> the step's Problems (a problem's order depends only on the run's
  seed and its position, so a resumed run sees the same ones); agent: runs their episodes.
  prompt_length: Tp, prompts are left-padded to it with `pad_id`. vocab_size: the ids the task's
  tokenizer has. stop_token_ids: the ids that end every policy turn (the one place they are set).
  tokenizer: decodes turns for the environment (Turn.text) and encodes its text answers.
  eval_problems() -> the held-out problems evaluation runs episodes of (None: the task has none).
  environment: what errors call it (task.environment); max_failure_frac: the share of a step's
  episodes whose environment may fail (Trajectory.failures) before the run stops (both set by
  `bound` from the run's task section)."""

  agent: Agent
  problems: Callable[[int, int], list[Problem]]
  prompt_length: int
  vocab_size: int
  stop_token_ids: tuple[int, ...]
  pad_id: int
  tokenizer: Any = None
  close: Callable[[], None] = lambda: None
  eval_problems: Callable[[], list[Problem]] | None = None  # held-out problems (agents/evaluation.py)
  environment: str = 'agent'
  max_failure_frac: float = 1.0
  images: ImageReader | None = None  # the run's, when its episodes may hold images (task.max_images)
  # Its turns can be rendered again (task.turn_context: as_rendered): text problems with their chat
  # messages and text observations, on a chat template (text_task's)
  renders_turns: bool = False
  jittable = False
  vision_bucket = None  # text prompts

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
  # module:function's own arguments, passed as written: function(config, **environment_args)
  environment_args: dict[str, Any] = dataclasses.field(default_factory=dict)
  max_turns: int = 4  # policy turns per episode, for every environment (one may set fewer of its own)
  # Tokens per policy turn, for every environment (one may set fewer of its own: guess_number's
  # turns are one token); 0: the rollout's max_new_tokens
  turn_tokens: int = 0
  tools: tuple[str, ...] = ('python', 'calculator')  # tool_use: the tools the policy may call
  tool_timeout_s: float = 10.0  # tool_use: the deadline of one tool call (and answer check)
  # tool_use: each Python call in a fresh bubblewrap sandbox (grpo_jax/sandbox.py); none: in the
  # tool worker, unsandboxed, as the trainer's user (said on every start)
  sandbox: Literal['bwrap', 'none'] = 'bwrap'
  guess_range: int = 16  # guess_number: the secret is in [0, guess_range)
  blank_images: bool = False  # spot: every image the same grey square, nothing to see (the control run)
  # The deadline of each call of an environment (reset, step); one that raises or runs past it ends
  # its episode only: masked from the loss, scored 0, counted in episode/failures and episode/timeouts
  env_timeout_s: float = 300.0
  # The share of a step's episodes whose environment may fail before the run stops (1: never stops)
  max_env_failure_frac: float = 0.25
  # Images an episode may hold, its prompt's and those its environment shows (agents/images.py; a
  # vision-language model); 0: text only. The update pads every episode's images to this many.
  max_images: int = 0
  # The image processor's bounds on an image's resized area (None: model.path's preprocessor_config.json,
  # else Qwen2.5-VL's); max_pixels also sizes the patches each image is padded to in the update.
  min_pixels: int | None = None
  max_pixels: int | None = None
  # What each policy turn is trained on: as_sampled, the trajectory's own ids (token in, token out:
  # the context the policy saw, one row per episode); as_rendered, step-wise, a row per turn whose
  # context is the conversation as the chat template renders it for deployment (a template that
  # rewrites history, as Qwen3's drops earlier turns' <think>, then trains on other context than
  # the policy sampled from: sampler_gap shows by how much)
  turn_context: Literal['as_sampled', 'as_rendered'] = 'as_sampled'

  def __post_init__(self):
    super().__post_init__()
    with section('task'):
      environment = self.environment
      require(environment in BUILT_IN or environment.count(':') == 1, 'environment',
              f'must be one of {", ".join(BUILT_IN)} or module:function, got {environment!r}')
      require(self.max_turns >= 1, 'max_turns', f'must be >= 1, got {self.max_turns}')
      require(self.turn_tokens >= 0, 'turn_tokens', f'must be >= 0, got {self.turn_tokens}')
      require(self.env_timeout_s > 0, 'env_timeout_s', f'must be > 0, got {self.env_timeout_s}')
      require(0 <= self.max_env_failure_frac <= 1, 'max_env_failure_frac',
              f'must be in [0, 1], got {self.max_env_failure_frac}')
      require(self.max_images >= 0, 'max_images', f'must be >= 0 (0: text only), got {self.max_images}')
      for name, value in (('min_pixels', self.min_pixels), ('max_pixels', self.max_pixels)):
        require(value is None or value >= 1, name, f'must be >= 1, got {value}')
      require(None in (self.min_pixels, self.max_pixels) or self.min_pixels <= self.max_pixels, 'min_pixels',
              f'({self.min_pixels}) must not exceed task.max_pixels ({self.max_pixels})')
      module = _module(environment)
      require(module is None or not self.environment_args, 'environment_args',
              f'are the arguments of an environment of your own (module:function); the built-in {environment} '
              'takes none (its settings are task keys of their own)')
      if module is not None:
        module.check(self)

  def check_run(self, config) -> None:
    """Agent episodes run on the inference server, one policy version each: no partial rollouts.
    Turns trained as rendered have no routes of their rendering, and their rows are not one per
    sample, which dynamic sampling's groups are."""
    require(config.algo.max_lag == 0, 'algo.max_lag',
            'applies to single-turn tasks (arith, math); agent episodes run on the inference server')
    if self.turn_context == 'as_rendered':
      for field, clash in (('algo.routing_replay', config.algo.routing_replay != 'none'),
                           ('algo.dynamic_sampling', config.algo.dynamic_sampling)):
        require(not clash, 'turn_context', f'as_rendered trains each turn on a context the server never ran: '
                f'{field} needs as_sampled')


def build(config) -> AgentTask:
  """The run's AgentTask: the built-in's, or what task.environment's factory returns for
  (config, **task.environment_args), with the run's turn bounds and the tokenizer's text on its
  EnvironmentAgent."""
  environment = config.task.environment
  module = _module(environment)
  if module is not None:
    return bound(module.build(config), config)
  name, function = environment.split(':')
  try:
    factory = getattr(importlib.import_module(name), function)
  except (ImportError, AttributeError) as error:
    raise UserError(f'task.environment {environment}: cannot import it ({error}; its module must be on the Python '
                    'path: installed, in the working directory, or on PYTHONPATH)') from None
  arguments = dict(config.task.environment_args)
  _check_arguments(factory, environment, arguments)
  with _naming_arguments():
    task = factory(config, **arguments)
  if not isinstance(task, AgentTask):
    raise UserError(f'task.environment {environment}: returned {type(task).__name__}, not an AgentTask')
  return bound(task, config)


def _check_arguments(factory, environment: str, arguments: dict) -> None:
  """task.environment_args against the factory's signature: each key one of its parameters, each
  parameter without a default given."""
  try:
    parameters = list(inspect.signature(factory).parameters.values())[1:]  # the first is the config
  except (TypeError, ValueError):  # no signature to read (a builtin): the call says what is wrong
    return
  named = {p.name: p for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  if not any(p.kind is p.VAR_KEYWORD for p in parameters):
    for key in arguments:
      require(key in named, f'task.environment_args.{key}',
              f'is not an argument of {environment} (its arguments: {", ".join(named) or "none"})')
  for key, parameter in named.items():
    require(parameter.default is not parameter.empty or key in arguments, f'task.environment_args.{key}',
            f'must be set: {environment} has no default for it')


@contextlib.contextmanager
def _naming_arguments():
  """A factory's require(condition, 'key', message) names task.environment_args.key; errors that
  already name a field in full (task.max_prompt_tokens, model.path) pass unchanged."""
  try:
    yield
  except FieldError as error:
    if '.' in error.field:
      raise
    raise error.renamed(f'task.environment_args.{error.field}') from None


def bound(task: AgentTask, config) -> AgentTask:
  """The task with the run's bounds: its name (task.environment) and task.max_env_failure_frac;
  on its EnvironmentAgent, task.max_turns, task.turn_tokens (0: rollout.max_new_tokens), each the
  smaller of the run's and the environment's own where it set one, the calls' deadline
  (task.env_timeout_s), the run's ImageReader (task.max_images), and the TextCodec of the task's
  tokenizer (replies as `user` messages of its chat template when task.chat_template holds). Any
  other Agent reads the config itself."""
  task = dataclasses.replace(task, environment=config.task.environment,
                             max_failure_frac=config.task.max_env_failure_frac, images=images.reader(config))
  agent = task.agent
  rendered = config.task.turn_context == 'as_rendered'
  if rendered and not (isinstance(agent, EnvironmentAgent) and task.renders_turns):
    raise UserError(f'task.turn_context: as_rendered renders each turn\'s conversation with the chat template; '
                    f'environment {config.task.environment} has no text conversation to render (text_task\'s '
                    'environments on a chat template do): use as_sampled')
  if not isinstance(agent, EnvironmentAgent):
    return task
  turns = min(config.task.max_turns, agent.max_turns or config.task.max_turns)
  tokens = config.task.turn_tokens or config.rollout.max_new_tokens
  tokens = min(tokens, agent.turn_tokens or tokens)
  text = agent.text
  if text is None and task.tokenizer is not None:
    text = TextCodec(task.tokenizer, task.stop_token_ids, config.task.chat_template, role='user',
                     options=template_options(config.task))
  return dataclasses.replace(task, agent=dataclasses.replace(agent, max_turns=turns, turn_tokens=tokens, text=text,
                                                             timeout_s=config.task.env_timeout_s, images=task.images,
                                                             rendered=rendered))


def text_task(config, problem: Callable[[int], tuple[Any, Any]],
              make_environment: Callable[[Problem, int], Environment],
              eval_problems: list[tuple[Any, Any]] | None = None) -> AgentTask:
  """An AgentTask of text problems and a text environment, on the run's tokenizer (task.tokenizer,
  else model.path).

  problem(index) -> (question, data) of the run's index-th problem: the same index must give the
  same problem (a resumed run replays its positions). The question is text, rendered as the math
  task's prompts are (task.prompt_template, then the chat template unless task.chat_template is
  false), or a list of chat messages; `data` is what the environment needs (a secret, a reference
  answer). make_environment(problem, episode) -> the Environment of one episode (problem.data is
  `data`). eval_problems: the held-out (question, data) pairs evaluation plays, if any.

  Turns end at the tokenizer's stop ids; prompts longer than task.max_prompt_tokens are an error
  naming the problem."""
  require(bool(config.model.path or config.task.tokenizer), 'model.path',
          f'or task.tokenizer must be set for task.environment {config.task.environment}: its text is read with that '
          'tokenizer')
  tokenizer, special, use_chat_template = open_tokenizer(config.task, config.model.path)
  limit = config.task.max_prompt_tokens

  def posed(question, data, index: int, where: str) -> Problem:
    text = render_prompt(tokenizer, use_chat_template, config.task, question, index, where)
    ids = tuple(tokenize_prompts(tokenizer, use_chat_template, [text])[0])
    if not 1 <= len(ids) <= limit:
      raise UserError(f'{config.task.environment}: {where} problem {index} has a prompt of {len(ids)} tokens; '
                      f'task.max_prompt_tokens is {limit}')
    messages = prompt_messages(use_chat_template, config.task, question, index, where)
    return Problem(prompt=ids, data=data, messages=tuple(messages) if use_chat_template else ())

  def problems(position: int, count: int) -> list[Problem]:
    return [posed(*problem(index), index, 'task') for index in range(position, position + count)]

  def held_out() -> list[Problem]:
    return [posed(question, data, index, 'eval') for index, (question, data) in enumerate(eval_problems)]

  return AgentTask(EnvironmentAgent(make_environment), problems, prompt_length=limit, vocab_size=len(tokenizer),
                   stop_token_ids=tuple(special.stop_ids), pad_id=special.pad_id, tokenizer=tokenizer,
                   eval_problems=None if eval_problems is None else held_out, renders_turns=use_chat_template)


def shape(config, architecture):
  """The task for the plan: a built-in's own shape when it has one (nothing read), else the task."""
  module = _module(config.task.environment)
  if module is not None and hasattr(module, 'shape'):
    return module.shape(config, architecture)
  return build(config)
