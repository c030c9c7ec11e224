"""Composed host rewards: the reward of a completion is a weighted sum of named terms.

A run lists its terms in the config's `rewards:` section, e.g.

    rewards:
      - {name: math, weight: 1.0}                       # 1 if math-verify accepts the answer, else 0
      - {name: format, weight: 0.1, style: boxed}       # 1 if the answer is given in the asked form
      - {name: overlong, weight: 1.0, buffer_tokens: 4096}
      - {name: my_rewards:brevity, weight: 0.5}         # a custom term, imported by path

Terms (each logged per step, unweighted, as `reward/<name>`):

  math      1.0 / 0.0 from the math-verify check (data/rewards.py), in the reward worker pool:
            each check has a deadline and a memory limit, and a check that times out, crashes or
            runs out of memory scores 0 and is counted in `reward_failures`.
  format    1.0 if the completion states an answer in the requested `style`: `boxed` (a closed
            `\\boxed{...}`), `answer_tag` (`<answer>...</answer>`) or `answer_line` (a line
            `Answer: ...`); else 0.0. Linear-time string scans, in the trainer process.
  overlong  DAPO's soft overlong punishment, counted in tokens (not characters): with the
            completion length L (tokens, the stop token included), the budget N = max_new_tokens
            and the buffer B = `buffer_tokens`, 0 for L <= N - B, (N - B - L) / B inside the
            buffer, and -1 for a truncated answer (one that never emitted a stop token).
  module:function
            a custom term: `function(completions: list[str], references: list[str],
            lengths: np.ndarray) -> sequence of B floats`, called once per step with the step's
            B = P * G decoded completions, their reference answers and their lengths in tokens.
            It runs in the trainer process (it is the user's own code, trusted like the config):
            it must bound its own time on hostile completions. An exception or a non-finite value
            scores 0 for the affected completions and counts in `reward_failures` (the first
            exception of a run is printed).
"""

import dataclasses
import importlib
import math
import re
import sys
import traceback
from typing import Literal

import numpy as np

from grpo_jax.data.rewards import RewardPool, final_text, last_boxed
from grpo_jax.errors import UserError, require

BUILTIN_TERMS = ('math', 'format', 'overlong')
FormatStyle = Literal['boxed', 'answer_tag', 'answer_line']
ANSWER_LINE = re.compile(r'^[ \t]*(?:\*\*)?answer(?:\*\*)?[ \t]*:[ \t]*(?:\*\*)?[ \t]*\S', re.IGNORECASE | re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class RewardTerm:
  """One term of the reward (see the module docstring)."""

  name: str = 'math'  # math | format | overlong | <module>:<function>
  weight: float = 1.0  # multiplies the term in the sum
  style: FormatStyle = 'boxed'  # format: the form the answer must take
  buffer_tokens: int = 0  # overlong: B, the tokens before max_new_tokens over which the penalty ramps to -1

  def __post_init__(self):
    require(self.name in BUILTIN_TERMS or _is_import_path(self.name), 'name',
            f'must be one of {", ".join(BUILTIN_TERMS)} or <module>:<function>, got {self.name!r}')
    require(self.buffer_tokens >= 0, 'buffer_tokens', f'must be >= 0, got {self.buffer_tokens}')

  @property
  def label(self) -> str:
    """The metric name: reward/<label> (a custom term is labelled by its function's name)."""
    return self.name.rpartition(':')[2]


def _is_import_path(name: str) -> bool:
  module, _, function = name.partition(':')
  return bool(re.fullmatch(r'[A-Za-z_][\w.]*', module) and re.fullmatch(r'[A-Za-z_]\w*', function))


def load_custom(name: str):
  """The function named by `module:function`; a UserError naming the term when it cannot be had."""
  module_name, _, function_name = name.partition(':')
  try:
    module = importlib.import_module(module_name)
  except Exception as error:  # ImportError, or whatever the module raises while importing
    raise UserError(f'reward term {name!r}: module {module_name} cannot be imported '
                    f'({type(error).__name__}: {error})') from None
  function = getattr(module, function_name, None)
  if not callable(function):
    raise UserError(f'reward term {name!r}: {module_name} has no function {function_name}')
  return function


# ---- the terms ----

def format_reward(completion: str, style: FormatStyle) -> float:
  """1.0 if `completion`'s final text (after a thinking block) states its answer in `style`, else
  0.0 (linear in its length)."""
  completion = final_text(completion)
  if style == 'boxed':
    content = last_boxed(completion)
    return float(content is not None and bool(content.strip()))
  if style == 'answer_tag':
    start = completion.rfind('<answer>')
    end = completion.find('</answer>', start + len('<answer>')) if start >= 0 else -1
    return float(end >= 0 and bool(completion[start + len('<answer>'):end].strip()))
  return float(ANSWER_LINE.search(completion) is not None)


def overlong_penalty(lengths: np.ndarray, stopped: np.ndarray, max_new_tokens: int, buffer_tokens: int) -> np.ndarray:
  """DAPO's soft overlong punishment [B] in tokens: 0 up to N - B tokens, a linear ramp to -1 over
  the last B tokens of the budget N, and -1 for truncated answers."""
  lengths = np.asarray(lengths, np.float64)
  if buffer_tokens > 0:
    ramp = np.clip((max_new_tokens - buffer_tokens - lengths) / buffer_tokens, -1.0, 0.0)
  else:
    ramp = np.zeros_like(lengths)
  return np.where(np.asarray(stopped, bool), ramp, -1.0).astype(np.float32)


@dataclasses.dataclass
class Composed:
  """The rewards of one step: total [B] (weighted sum), terms {label: [B]} (unweighted), failures."""

  total: np.ndarray
  terms: dict
  failures: int


class RewardComposer:
  """Scores a step's completions with the run's terms; holds the math term's worker pool."""

  def __init__(self, terms: tuple[RewardTerm, ...], max_new_tokens: int, workers: int):
    if not terms:
      raise UserError('rewards: list at least one term (e.g. - {name: math})')
    labels = [term.label for term in terms]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
      raise UserError(f'rewards: the term {duplicated[0]!r} is listed twice')
    self.terms, self.max_new_tokens, self.workers = terms, max_new_tokens, workers
    self.custom = {term.name: load_custom(term.name) for term in terms if term.name not in BUILTIN_TERMS}
    self._pool = None
    self._reported = False

  def score(self, completions: list[str], references: list[str], lengths, stopped) -> Composed:
    """Rewards of B completions: their texts, reference answers, lengths [B] and stopped [B]."""
    size = len(completions)
    total = np.zeros(size, np.float32)
    terms, failures = {}, 0
    for term in self.terms:
      if term.name == 'math':
        if self._pool is None:
          self._pool = RewardPool(self.workers)
        before = self._pool.failures
        values = np.asarray(self._pool.map(completions, references), np.float32)
        failures += self._pool.failures - before
      elif term.name == 'format':
        values = np.asarray([format_reward(text, term.style) for text in completions], np.float32)
      elif term.name == 'overlong':
        values = overlong_penalty(lengths, stopped, self.max_new_tokens, term.buffer_tokens)
      else:
        values, failed = self._custom(term, completions, references, np.asarray(lengths))
        failures += failed
      terms[term.label] = values
      total += np.float32(term.weight) * values
    return Composed(total=total, terms=terms, failures=failures)

  def _custom(self, term: RewardTerm, completions, references, lengths) -> tuple[np.ndarray, int]:
    size = len(completions)
    try:
      values = [float(value) for value in self.custom[term.name](completions, references, lengths)]
    except Exception:  # the user's code: score this step's completions 0, count them, say it once
      self._report(term, traceback.format_exc())
      return np.zeros(size, np.float32), size
    if len(values) != size:
      raise UserError(f'reward term {term.name!r} returned {len(values)} values for {size} completions')
    finite = np.asarray([math.isfinite(value) for value in values])
    if not finite.all():
      self._report(term, f'{int((~finite).sum())} non-finite values\n')
    return np.where(finite, np.asarray(values, np.float64), 0.0).astype(np.float32), int((~finite).sum())

  def _report(self, term: RewardTerm, text: str) -> None:
    if not self._reported:
      self._reported = True
      print(f'warning: reward term {term.name!r} failed (scored 0, counted in reward_failures; '
            f'reported once per run):\n{text}', file=sys.stderr, flush=True)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None
