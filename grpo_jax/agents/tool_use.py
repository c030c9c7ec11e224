"""Tool use on a dataset's problems (`task.environment: tool_use`): the policy may call a tool
(Python or the calculator) as often as `task.max_turns` allows; each call's output comes back as
an observation it reads before it goes on, and the episode ends with a turn that calls no tool (its
answer is checked against the reference with math-verify: reward 1 or 0) or at max_turns (no
answer: 0). With no tools (`task.tools: []`) every turn is an answer: at max_turns 1 this is the
math task as a single-turn agent, its problems, prompts and rewards the math task's own.

The problems, their order and their rendering are the math task's (data/math_task.py: the same
sources, adapters, templates and resume-exact order); the chat template also lists the enabled
tools (tools.SCHEMAS, its `tools` argument). A call is read in either format (agents/tools.py):
Qwen2.5's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` or the tag format
`<python>...</python>`. Observations are rendered by the tokenizer's own chat template, as the
`tool` message that follows the policy's turn (Qwen2.5's: a user turn holding `<tool_response>`,
then the assistant's header); a tokenizer without one gets `<output>...</output>`. The tool's text
is tokenized with its special tokens split, so output that spells `<|im_end|>` cannot end a turn.

Tools and answer checks run in `task.reward_workers` bounded worker processes (grpo_jax.workers:
a deadline, a memory cap, dying with the trainer); each Python call runs from there in a sandbox of
its own (grpo_jax.sandbox, `task.sandbox: bwrap`), `task.tool_timeout_s` at most, its processes
holding their worker's share of TOOL_MEMORY_BYTES together (the pool's calls at once stay within
it); the line the sandbox's check gives says what holds that bound on this machine. A call that
cannot be read, fails, hangs, crashes or floods its output becomes a short error observation and
counts as a tool error, never a crash of the run.
"""

import functools
import os
import sys

from grpo_jax import sandbox
from grpo_jax.agents.agent import EnvironmentAgent, Problem, Step
from grpo_jax.agents.deadline import OnLoop
from grpo_jax.agents.inference import Completion
from grpo_jax.agents.task import AgentTask
from grpo_jax.agents.text import TextCodec
from grpo_jax.agents.tools import SCHEMAS, TOOLS, parse_tool_call, work, worker_setup
from grpo_jax.data import math_task
from grpo_jax.errors import require
from grpo_jax.evaluation import final_answer
from grpo_jax.workers import Failed, WorkerPool

MAX_OBSERVATION_CHARS = 1200
SANDBOX_MARGIN_S = 5.0  # the worker's deadline past the sandbox's: starting and ending one takes a moment
# The memory of the Python calls running at once (one per tool worker), together: each call's
# processes hold their worker's share, at most a call's default (sandbox.Limits.memory_bytes).
TOOL_MEMORY_BYTES = 4 << 30


class ToolWorld:
  """What every episode of a run shares: the tokenizer, the enabled tools, the observation format
  and the worker pool (tools and answer checks)."""

  def __init__(self, math: math_task.MathTask, tools: tuple[str, ...], pool: WorkerPool):
    self.math, self.tools, self.pool = math, tools, pool
    self.tokenizer = math.tokenizer
    # A result is the chat template's `tool` message after the policy's turn (agents/text.py).
    self.messages = TextCodec(math.tokenizer, math.stop_token_ids, math.use_chat_template, role='tool',
                              tools=[SCHEMAS[name] for name in tools]) if tools else None
    # Read off the template now: one that cannot render a tool message stops the run here, not mid-step.
    self.format = self.messages.format if self.messages is not None else None

  def text(self, tokens) -> str:
    return self.math.decode([tokens], [[True] * len(tokens)])[0] if tokens else ''

  def observation(self, result: str, turn: Completion) -> tuple[int, ...]:
    """The tokens that answer `turn` with the tool's `result`, cut to MAX_OBSERVATION_CHARS."""
    if len(result) > MAX_OBSERVATION_CHARS:
      result = result[:MAX_OBSERVATION_CHARS] + f'\n... ({len(result) - MAX_OBSERVATION_CHARS} more characters cut)'
    return self.messages.reply(result, turn)

  async def run(self, name: str, argument: str) -> tuple[str, bool]:
    """The tool's text and whether it failed."""
    result = await self.pool.call(name, argument)
    if isinstance(result, Failed):
      reason = {'deadline': f'the {name} call ran past its {self.pool.timeout_s:g} s limit',
                'crashed': f'the process running the {name} call died'}.get(result.reason, result.detail)
      return f'error: {reason}', True
    return result

  async def check(self, text: str, answer: str) -> float:
    reward = await self.pool.call('math', text, answer)
    return 0.0 if isinstance(reward, Failed) else float(reward)


class ToolEnvironment:
  """One episode: the problem's reference answer, the shared ToolWorld."""

  def __init__(self, world: ToolWorld, answer: str):
    self.world, self.answer = world, answer

  async def reset(self) -> tuple[int, ...]:
    return ()

  async def step(self, turn: Completion) -> Step:
    text = self.world.text(turn.tokens)
    call = parse_tool_call(text) if self.world.tools else None
    if call is None:  # the answer
      return Step(reward=await self.world.check(text, self.answer), done=True, answer=final_answer(text))
    if call.error is not None:
      result, failed = f'error: {call.error}', True
    elif call.name not in self.world.tools:
      result, failed = f'error: the {call.name} tool is not enabled; tools: {", ".join(self.world.tools)}', True
    else:
      result, failed = await self.world.run(call.name, call.argument)
    return Step(observation=self.world.observation(result, turn), tool_call=True, tool_error=failed)


def check(task_config) -> None:
  """The agent section's fields tool_use reads (agents/task.py AgentSection runs it)."""
  require(bool(task_config.dataset.source), 'source', 'must name the problems for task.environment=tool_use (a '
          '.jsonl/.json/.parquet file, hf:<name>[:<config>] or tfds:<name>)')
  require(set(task_config.tools) <= set(TOOLS), 'tools',
          f'must name tools among {", ".join(TOOLS)} (none: single-turn answers), got {list(task_config.tools)}')
  require(task_config.tool_timeout_s > 0, 'tool_timeout_s', f'must be > 0, got {task_config.tool_timeout_s}')


def _worker_setup(task, tools):
  """The tool workers' set-up: a sandbox per Python call (checked here: one line and no run when it
  cannot start), or, with `task.sandbox: none`, the code in the worker, said on every start."""
  if 'python' not in tools:
    return functools.partial(worker_setup, 'none')
  if task.sandbox == 'none':
    print(f'task.sandbox: none: the python tool runs model-written code unsandboxed, as the trainer\'s user (uid '
          f'{os.getuid()}), with its files, environment and network in reach', file=sys.stderr, flush=True)
    return functools.partial(worker_setup, 'none')
  limits = sandbox.Limits(timeout_s=task.tool_timeout_s, cpu_s=int(task.tool_timeout_s) + 1,
                          memory_bytes=call_memory_bytes(task.reward_workers))
  print(f'task.sandbox: bwrap: {sandbox.check(limits)}', file=sys.stderr, flush=True)
  return functools.partial(worker_setup, 'bwrap', limits)


def call_memory_bytes(workers: int) -> int:
  """A Python call's budget for its processes together: its worker's share of TOOL_MEMORY_BYTES."""
  return min(sandbox.Limits.memory_bytes, TOOL_MEMORY_BYTES // workers)


def build(config) -> AgentTask:
  task = config.task
  tools = tuple(dict.fromkeys(task.tools))
  schemas = [SCHEMAS[name] for name in tools] or None
  setup = _worker_setup(task, tools)  # before anything starts: a sandbox that cannot start stops the run here
  math = math_task.MathTask(task, config.model.path, config.run.seed, tools=schemas)
  pool = WorkerPool(task.reward_workers, work, warmup=('math', '\\boxed{1}', '1'), setup=setup,
                    timeout_s=task.tool_timeout_s + (SANDBOX_MARGIN_S if task.sandbox == 'bwrap' else 0.0),
                    name='tool worker')
  world = ToolWorld(math, tools, pool)

  def problems(position: int, count: int) -> list[Problem]:
    return [Problem(prompt=tuple(int(t) for t in math.problems.prompt_ids[index]), data=math.answers[index])
            for index in math.order(position, count)]

  def eval_problems() -> list[Problem]:  # eval.source, rendered like the task's prompts (tools listed)
    if config.eval.dataset.source is None:
      return []
    held_out = math_task.ProblemSet(math.tokenizer, math.use_chat_template, task, (config.eval.dataset,), 'eval',
                                    schemas)
    return [Problem(prompt=tuple(int(t) for t in ids), data=answer, source=source)
            for ids, answer, source in zip(held_out.prompt_ids, held_out.answers, held_out.data_sources)]

  # task.max_turns and task.turn_tokens bound its turns (agents/task.py); the task's stop ids end them.
  # Its steps only await the worker pool: they run on the episodes' loop (agents/deadline.py).
  agent = EnvironmentAgent(make_environment=lambda problem, episode: ToolEnvironment(world, problem.data),
                           calls=OnLoop())

  def close():
    pool.close()
    math.close()

  return AgentTask(agent, problems, prompt_length=math.prompt_length, vocab_size=math.vocab_size,
                   stop_token_ids=tuple(math.stop_token_ids), pad_id=math.pad_id, tokenizer=math.tokenizer, close=close,
                   eval_problems=eval_problems)


def shape(config, architecture):
  """The plan's view: the math task's shape (nothing read, no workers started)."""
  return math_task.shape(config, architecture)
