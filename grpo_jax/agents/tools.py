"""Tool calls in a policy's turn, and the built-in tools: a calculator and Python, run from bounded
worker processes (grpo_jax.workers: a deadline, a memory cap, dying with the trainer), never in the
trainer's process. Each Python call runs in a fresh OS-level sandbox (grpo_jax.sandbox: bubblewrap
namespaces, an unprivileged uid, rlimits, no network, no file of the trainer's); only with
`task.sandbox: none` does it run inside the worker itself, bounded against accidents alone.

Two formats are read:
  Qwen2.5's chat template:  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "2*(3+4)"}}\\n</tool_call>
  the tag format:           <calculator>2*(3+4)</calculator>   <python>print(6*7)</python>
The first complete call of a turn counts; what follows it is ignored. A call that cannot be read
(bad JSON, an unknown tool, arguments missing) is a `ToolCall` with its `error` set, which the
environment answers with a short error observation: hostile output never raises.
"""

import ast
import contextlib
import dataclasses
import io
import json
import math
import operator
import re
import os
import resource
import socket
import tempfile

TOOLS = {'calculator': 'expression', 'python': 'code'}  # tool -> its one argument
# The tools as the chat template's `tools` (function schemas): Qwen2.5's lists them in the system
# prompt and asks for <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
SCHEMAS = {
    'calculator': {'type': 'function', 'function': {
        'name': 'calculator', 'description': 'Evaluates an arithmetic expression (+ - * / // % ** and parentheses).',
        'parameters': {'type': 'object', 'properties': {'expression': {'type': 'string', 'description':
                                                                       'e.g. (3 + 4) * 12 / 5'}},
                       'required': ['expression']}}},
    'python': {'type': 'function', 'function': {
        'name': 'python', 'description': 'Runs a Python 3 script and returns what it prints (no network, '
                                         'a few seconds at most).',
        'parameters': {'type': 'object', 'properties': {'code': {'type': 'string', 'description':
                                                                 'the script; print the values you need'}},
                       'required': ['code']}}},
}
MAX_INPUT_CHARS = 4096
_QWEN_CALL = re.compile(r'<tool_call>\s*(.*?)\s*</tool_call>', re.DOTALL)
_TAG_CALL = re.compile(r'<(' + '|'.join(TOOLS) + r')>(.*?)</\1>', re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """name: the tool; argument: its input text; error: why the call cannot run (None: it can)."""

  name: str
  argument: str = ''
  error: str | None = None


def parse_tool_call(text: str) -> ToolCall | None:
  """The first complete tool call in `text` (either format), or None when it has none."""
  found = [(match.start(), 'qwen', match) for match in [_QWEN_CALL.search(text)] if match]
  found += [(match.start(), 'tag', match) for match in [_TAG_CALL.search(text)] if match]
  if not found:
    return None
  _, kind, match = min(found, key=lambda item: item[0])
  if kind == 'tag':
    return _checked(match.group(1), match.group(2))
  try:
    call = json.loads(match.group(1))
  except (ValueError, RecursionError):
    return ToolCall(name='', error='the tool call is not valid JSON')
  if not isinstance(call, dict) or not isinstance(call.get('name'), str):
    return ToolCall(name='', error='a tool call needs {"name": ..., "arguments": {...}}')
  name, arguments = call['name'], call.get('arguments', {})
  if isinstance(arguments, str):  # some templates write the arguments as a JSON string
    try:
      arguments = json.loads(arguments)
    except (ValueError, RecursionError):
      return ToolCall(name=name[:64], error='the arguments are not valid JSON')
  if name not in TOOLS:
    return ToolCall(name=name[:64], error=f'unknown tool {name[:64]!r}; tools: {", ".join(TOOLS)}')
  if not isinstance(arguments, dict) or not isinstance(arguments.get(TOOLS[name]), str):
    return ToolCall(name=name, error=f'{name} needs the argument {TOOLS[name]!r} (a string)')
  return _checked(name, arguments[TOOLS[name]])


def _checked(name: str, argument: str) -> ToolCall:
  if len(argument) > MAX_INPUT_CHARS:
    return ToolCall(name=name, error=f'the input is {len(argument)} characters; at most {MAX_INPUT_CHARS}')
  return ToolCall(name=name, argument=argument)


# ---- the calculator: arithmetic on numbers only, bounded ----

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_MAGNITUDE = 1e100
MAX_EXPONENT = 1000


def calculate(expression: str) -> str:
  """The value of an arithmetic expression (+ - * / // % **, parentheses, numbers), as text; an
  error message for anything else, for a result past 1e100 or an exponent past 1000."""
  try:
    tree = ast.parse(expression.strip(), mode='eval')
    value = _evaluate(tree.body)
  except ZeroDivisionError:
    return 'error: division by zero'
  except (SyntaxError, ValueError, TypeError, OverflowError, RecursionError) as error:
    return f'error: {str(error)[:200] or type(error).__name__}'
  if isinstance(value, float):
    return repr(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
  return repr(value)


def _evaluate(node):
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _bounded(_UNARY[type(node.op)](_evaluate(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise ValueError(f'exponent {right} is past {MAX_EXPONENT}')
    return _bounded(_BINARY[type(node.op)](left, right))
  raise ValueError('only numbers and + - * / // % ** ( ) are allowed')


def _bounded(value):
  if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)) \
      or abs(value) > MAX_MAGNITUDE:
    raise ValueError('the result is out of range')
  return value


# ---- the Python tool's body: what a bounded worker process runs (the pool comes next) ----

MAX_OUTPUT_CHARS = 1000


class _Bounded(io.StringIO):
  """A text buffer that keeps the first `limit` characters and counts the rest."""

  def __init__(self, limit: int):
    super().__init__()
    self.limit, self.dropped = limit, 0

  def write(self, text: str) -> int:
    room = self.limit - self.tell()
    if room > 0:
      super().write(text[:room])
    self.dropped += max(0, len(text) - max(room, 0))
    return len(text)


def _no_network(*args, **kwargs):
  raise OSError('the python tool has no network')


def disable_network() -> None:
  """For the worker process that runs the tool: every new socket fails."""
  socket.socket = _no_network  # type: ignore[assignment, misc]
  socket.create_connection = _no_network  # type: ignore[assignment]


MAX_FILE_BYTES = 16 << 20


def _no_signals(*args, **kwargs):
  raise PermissionError('the python tool cannot send signals')


_SANDBOX = None  # the worker's grpo_jax.sandbox.Sandbox, when the pool runs Python sandboxed


def worker_setup(sandbox: str = 'none', limits=None) -> None:
  """A tool worker's start. `sandbox: bwrap`: each Python call runs in a new sandbox under
  `limits` (a grpo_jax.sandbox.Limits), as a uid of its own when the trainer is root.
  `none`: it runs in this worker, with accidents bounded only (no new sockets, no signals through
  os.kill, files of at most 16 MiB, a fresh temporary working directory): ctypes, `_socket`,
  /proc and the trainer's files and environment are all within its reach."""
  import logging
  logging.getLogger('math_verify').setLevel(logging.CRITICAL)
  if sandbox == 'bwrap':
    global _SANDBOX
    from grpo_jax import sandbox as sandbox_lib
    _SANDBOX = sandbox_lib.Sandbox(limits or sandbox_lib.Limits())
    return
  disable_network()
  os.kill = os.killpg = _no_signals  # type: ignore[assignment]
  try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
  except (OSError, ValueError):
    pass
  os.chdir(tempfile.mkdtemp(prefix='grpo_jax_tool_'))


def work(kind: str, first: str, second: str = '') -> tuple[str, bool] | float:
  """What a tool worker does: `calculator` / `python` run the tool on `first` ((its text, whether
  it failed) back), `math` checks the answer `first` against the reference `second` (a reward back)."""
  if kind == 'math':
    from grpo_jax.data.rewards import math_reward
    return math_reward(first, second)
  if kind == 'calculator':
    text = calculate(first)
    return text, text.startswith('error:')
  if kind == 'python':
    return _SANDBOX.python(first) if _SANDBOX is not None else _python(first)
  raise ValueError(f'unknown work {kind!r}')


def run_python(code: str, limit: int = MAX_OUTPUT_CHARS) -> str:
  """Runs `code` as a script and returns what it printed (stdout and stderr, at most `limit`
  characters, a note of how many were cut), or its exception's last line. Meant for a worker
  process with a deadline and a memory cap, never the trainer's."""
  return _python(code, limit)[0]


def _python(code: str, limit: int = MAX_OUTPUT_CHARS) -> tuple[str, bool]:
  """run_python's text, and whether the script raised."""
  output = _Bounded(limit)
  try:
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
      exec(compile(code, '<tool>', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})  # noqa: S102
  except SystemExit:
    pass
  except BaseException as error:  # noqa: BLE001 (any failure of the model's code is its observation)
    text = output.getvalue()
    return (text + ('\n' if text and not text.endswith('\n') else '') +
            f'{type(error).__name__}: {str(error)[:200]}').strip(), True
  text = output.getvalue()
  if output.dropped:
    text += f'\n... ({output.dropped} more characters cut)'
  return text.strip(), False
