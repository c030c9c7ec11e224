"""Tool calls read from hostile turns, and the calculator against Python's own arithmetic."""

import json

import numpy as np
import pytest

from grpo_jax.agents.tools import MAX_INPUT_CHARS, ToolCall, calculate, parse_tool_call


def qwen(name, **arguments):
  return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.mark.parametrize('text, expected', [
    ('Let me compute. ' + qwen('calculator', expression='2*(3+4)') + ' trailing', ToolCall('calculator', '2*(3+4)')),
    ('<python>print(6*7)</python><calculator>1+1</calculator>', ToolCall('python', 'print(6*7)')),
    ('<calculator>1+1</calculator>' + qwen('python', code='x'), ToolCall('calculator', '1+1')),
    ('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>', ToolCall('python', 'print(1)')),
    ('no call here, only \\boxed{3}', None),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}', None),  # never closed
    ('<calculator>1+1', None),
])
def test_calls_in_either_format(text, expected):
  assert parse_tool_call(text) == expected


@pytest.mark.parametrize('text, message', [
    ('<tool_call>{not json}</tool_call>', 'not valid JSON'),
    ('<tool_call>[1, 2]</tool_call>', 'needs {"name"'),
    (qwen('shell', command='rm -rf /'), "unknown tool 'shell'"),
    (qwen('calculator', expr='1+1'), "needs the argument 'expression'"),
    (qwen('python', code=7), "needs the argument 'code'"),
    ('<tool_call>' + '[' * 100_000 + '</tool_call>', 'not valid JSON'),
    ('<python>' + 'x' * (MAX_INPUT_CHARS + 1) + '</python>', f'at most {MAX_INPUT_CHARS}'),
])
def test_unreadable_calls_carry_an_error_and_never_raise(text, message):
  call = parse_tool_call(text)
  assert call is not None and message in call.error


def test_calculator_equals_python_on_random_expressions(seed):
  rng = np.random.default_rng(seed)
  operators = ['+', '-', '*', '/', '//', '%']
  for _ in range(200):
    numbers = rng.integers(-50, 50, 4)
    ops = rng.choice(operators, 3)
    expression = f'({numbers[0]} {ops[0]} {numbers[1]}) {ops[1]} {numbers[2]} {ops[2]} ({numbers[3]})'
    try:
      expected = eval(expression)  # noqa: S307 (the reference: numbers and operators only)
    except ZeroDivisionError:
      assert calculate(expression) == 'error: division by zero'
      continue
    got = float(calculate(expression))
    assert got == pytest.approx(float(expected), rel=1e-12, abs=1e-12), expression


@pytest.mark.parametrize('expression', ['__import__("os").system("true")', 'open("/etc/passwd")', '[1] * 9',
                                        'x + 1', '9 ** 9 ** 9', '10 ** 101', '(-1) ** 0.5', '1e308 * 10',
                                        '(' * 5000 + '1' + ')' * 5000, ''])
def test_calculator_refuses_anything_but_bounded_arithmetic(expression):
  assert calculate(expression).startswith('error: ')


def test_python_tool_output_errors_and_floods():
  from grpo_jax.agents.tools import run_python
  assert run_python('print(6 * 7)') == '42'
  assert run_python('import sys\nprint("a"); print("b", file=sys.stderr)') == 'a\nb'
  assert run_python('print(1)\n1 / 0') == '1\nZeroDivisionError: division by zero'
  assert run_python('def f(:\n  pass').startswith('SyntaxError: ')
  assert run_python('raise SystemExit(3)') == ''
  flood = run_python('print("x" * 100_000)', limit=50)
  assert flood == 'x' * 50 + '\n... (99951 more characters cut)'  # 100,000 x and a newline, 50 kept


def test_python_tool_without_network_in_a_worker():
  """The worker-side switch: sockets fail, in a child process so the test's own stay intact."""
  import multiprocessing
  context = multiprocessing.get_context('spawn')
  with context.Pool(1) as pool:
    assert 'OSError: the python tool has no network' in pool.apply(_network_attempt)


def _network_attempt():
  from grpo_jax.agents.tools import disable_network, run_python
  disable_network()
  return run_python('import socket\nsocket.create_connection(("127.0.0.1", 9))')
