"""Host-side rewards: completions checked against reference answers with math-verify, in a pool
of worker processes that a hanging or crashing check cannot take down.

`math_reward(completion, answer)` is 1.0 when the completion's answer equals the reference
(symbolically or numerically, as math-verify decides: `\\boxed{1/2}` matches `0.5`), else 0.0.
The answer is read from the completion's final text (`final_text`: after a reasoning model's
thinking block): the content of its last complete `\\boxed{...}` when it has one, otherwise
whatever math-verify extracts from that text.

Integer answers, the common case (DAPO-Math-17k's references are all integers), are settled without
math-verify: when the reference and the completion's answer (its last box, or its whole final
text) are each one integer, the reward is whether they are the same number (`integer_verdict`),
as math-verify would find, in microseconds instead of a parse of each.
Everything else is math-verify's: the completion's answer parsed, the reference's parse (kept per
process for the 4,096 most recent references: a group's completions all share one), and a symbolic
comparison.

`RewardPool(workers)` scores lists of (completion, answer) pairs in `workers` processes, one item
per process at a time, and returns the rewards in input order; pairs `integer_verdict` settles are
scored in the calling process, without a round trip to a worker. math-verify interrupts its own slow
parses and comparisons with SIGALRM (it must run on a process's main thread, hence processes, not
threads); an item that still outlives `timeout_s` (a loop in C that ignores the alarm, a crash)
gets 0.0 and its process is replaced, so one bad completion never stops a run. Each worker may
also grow by at most `memory_bytes` beyond what it holds after start-up (its address space is
capped), so a check that would build a gigantic number fails with MemoryError; a check that raises
scores 0.0 too, and all three count in `failures`.
"""

import functools
import logging
import math
import re

from grpo_jax.errors import UserError
from grpo_jax.workers import ITEM_MEMORY_BYTES, ITEM_TIMEOUT_S, WorkerPool

VERIFY_TIMEOUT_S = 3  # math-verify's own alarm for each parse and comparison (whole seconds)
BOX_COMMANDS = ('\\boxed', '\\fbox')
BOX_PATTERN = '(?:' + '|'.join(re.escape(command) for command in BOX_COMMANDS) + r')\{'


def last_boxed(text: str) -> str | None:
  """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text` whose braces close; None if none.

  Linear in len(text): one pass pairs every brace with its match, then the box openings are tried
  from the last one back. (Counting depth afresh from each opening was quadratic: a right answer
  followed by 100,000 unclosed `\\boxed{` outlived the reward deadline.)
  """
  closing, open_braces = {}, []
  for match in re.finditer('[{}]', text):
    if match.group() == '{':
      open_braces.append(match.start())
    elif open_braces:
      closing[open_braces.pop()] = match.start()
  openings = [match.end() - 1 for match in re.finditer(BOX_PATTERN, text)]
  for brace in reversed(openings):
    if brace in closing:
      return text[brace + 1:closing[brace]]
  return None


THINK_OPEN, THINK_CLOSE = '<think>', '</think>'


def final_text(completion: str) -> str:
  """The part of a completion that gives its answer: what follows the last `</think>` of a
  reasoning model (Qwen3's thinking block); nothing when a thinking block opened and never closed
  (the budget ran out before the answer); else the whole completion. A \\boxed{} inside the
  thinking is a draft, not the answer."""
  if THINK_CLOSE in completion:
    return completion.rsplit(THINK_CLOSE, 1)[1]
  return '' if THINK_OPEN in completion else completion


_INTEGER = re.compile(r'\s*([+-]?)0*([0-9]+)\s*')  # ASCII digits: math-verify reads no others as a number


def _integer(text: str) -> str | None:
  """'-12' for text that is one integer ('  -012 ', '+12', '12'); '0' for any zero; else None."""
  match = _INTEGER.fullmatch(text)
  if match is None:
    return None
  sign, digits = match.groups()
  return digits if sign != '-' or digits == '0' else '-' + digits


def integer_verdict(completion: str, answer: str) -> float | None:
  """math_reward's value where the reference and the completion's answer (the content of its last
  box, else its whole final text) are each a single integer: 1.0 when they are the same number
  (leading zeros aside, and a plus sign inside a box), else 0.0. None for anything else, which
  math-verify decides."""
  gold = _integer(answer)
  if gold is None:
    return None
  text = final_text(completion)
  boxed = last_boxed(text)
  if boxed is None and '+' in text:  # math-verify extracts no answer from a bare '+12'
    return None
  prediction = _integer(text if boxed is None else boxed)
  if prediction is None:
    return None
  return 1.0 if prediction == gold else 0.0


def math_reward(completion: str, answer: str, timeout_s: int = VERIFY_TIMEOUT_S) -> float:
  """1.0 if the completion's final answer equals the reference `answer` per math-verify, else 0.0
  (integer_verdict's value where it has one, math_verify_reward's otherwise)."""
  settled = integer_verdict(completion, answer)
  return math_verify_reward(completion, answer, timeout_s) if settled is None else settled


def _join_digit_groups(text: str) -> str:
  """Digits grouped by a thin or plain space joined ('1\\,234' -> '1234'). math-verify reads
  juxtaposed numbers as a mixed number or a product, so such a grouping became another number
  ('1\\,234' -> 235, '10\\,000' -> 0): the right answer scored 0 and a wrong one 1. Comma groupings
  ('1,234', '1{,}234', '1,\\!234') it reads as one number already."""
  return re.sub(r'(?<![\d.])\d{1,3}(?:(?:\\,|\\ | )\d{3})+(?!\d)',
                lambda number: re.sub(r'\\,|\\ | ', '', number.group()), text)


class _Unparsed(Exception):
  """The reference parsed to nothing (not cached: a parse cut short by its alarm may do better later)."""


@functools.lru_cache(maxsize=4096)
def _reference(answer: str, timeout_s: int) -> tuple:
  """The reference `answer` as math-verify parses it, once per worker: a group's G completions, and
  every later sample of the same problem, share it (about a quarter of each check's time)."""
  from math_verify import parse

  answer = _join_digit_groups(answer)
  # References are bare expressions ('0.5', '\frac{1}{2}', '(1, 2)'): boxed, math-verify reads them
  # as LaTeX, which keeps intervals, tuples and commands intact. An escaped dollar is a currency sign
  # (MATH's '\$18.90'), not a math delimiter: unboxed, such a reference parsed to nothing.
  delimited = any(mark in answer for mark in BOX_COMMANDS) or '$' in answer.replace('\\$', '')
  gold = parse(answer if delimited else '\\boxed{' + answer + '}', parsing_timeout=timeout_s)
  if not gold and not delimited:
    gold = parse(answer, parsing_timeout=timeout_s)
  if not gold:
    raise _Unparsed(answer)
  return tuple(gold)


def math_verify_reward(completion: str, answer: str, timeout_s: int = VERIFY_TIMEOUT_S) -> float:
  """math_reward decided by math-verify alone, integers included."""
  from math_verify import parse, verify

  completion = final_text(completion)
  boxed = last_boxed(completion)
  prediction = parse(completion if boxed is None else '\\boxed{' + _join_digit_groups(boxed) + '}',
                     parsing_timeout=timeout_s)
  try:
    gold = list(_reference(answer, timeout_s))
  except _Unparsed:
    return 0.0
  if not prediction:
    return 0.0
  return 1.0 if verify(gold, prediction, timeout_seconds=timeout_s) else 0.0


class RewardPool:
  """`workers` processes applying `score_fn(completion, answer) -> float` with a per-item deadline
  and memory cap (a grpo_jax.workers.WorkerPool). score_fn must be importable by name (a
  module-level function): it is sent to spawned processes."""

  def __init__(self, workers: int, score_fn=math_reward, timeout_s: float = ITEM_TIMEOUT_S,
               memory_bytes: int = ITEM_MEMORY_BYTES):
    if workers < 1:
      raise ValueError(f'a reward pool needs at least one worker, got {workers}')
    # The warm-up imports math-verify and its LaTeX grammar before the first deadline.
    self._pool = WorkerPool(workers, score_fn, warmup=('\\boxed{1/2}', '0.5'), setup=_quiet, timeout_s=timeout_s,
                            memory_bytes=memory_bytes, name='reward worker')
    self._settle = integer_verdict if score_fn is math_reward else None
    self.failures = 0  # items that got 0.0: past the deadline, the worker died, or the check raised

  @property
  def _workers(self):
    return self._pool._workers

  def map(self, completions: list[str], answers: list[str]) -> list[float]:
    """Rewards of each (completion, answer) pair, in order. A pair that occurs more than once (a
    group whose answers agree, as most do once a policy has learned a problem) is scored once."""
    if len(completions) != len(answers):
      raise ValueError(f'{len(completions)} completions but {len(answers)} answers')
    pairs = list(zip(completions, answers))
    unique = list(dict.fromkeys(pairs))
    scored = {}
    if self._settle is not None:
      scored = {pair: value for pair in unique if (value := self._settle(*pair)) is not None}
    checked = [pair for pair in unique if pair not in scored]
    try:
      scored.update(zip(checked, self._pool.map(checked)))
    except UserError as error:
      if 'could not start' in str(error):
        raise UserError(f'{error} (math-verify==0.9.0 is in requirements.txt)') from None
      raise
    rewards = []
    for result in (scored[pair] for pair in pairs):
      try:
        reward = float(result)
      except (TypeError, ValueError):  # Failed, or a scorer that returned no number
        self.failures += 1
        reward = 0.0
      rewards.append(reward if math.isfinite(reward) else 0.0)
    return rewards

  def close(self) -> None:
    """Ends the worker processes."""
    self._pool.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()


def _quiet() -> None:
  """In a reward worker: math-verify's timeout notices (one per item) stay off the log."""
  logging.getLogger('math_verify').setLevel(logging.CRITICAL)
