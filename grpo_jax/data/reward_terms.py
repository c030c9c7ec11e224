"""Composed host rewards: the reward of a completion is a weighted sum of named terms.

A run lists its terms in the config's `rewards:` section, e.g.

    rewards:
      - {name: math, weight: 1.0}                       # 1 if math-verify accepts the answer, else 0
      - {name: format, weight: 0.1, style: boxed}       # 1 if the answer is given in the asked form
      - {name: overlong, weight: 1.0, buffer_tokens: 4096}
      - {name: my_rewards:brevity, weight: 0.5}         # a custom term, imported by path

Each term is logged per step, unweighted, as `reward/<name>` (a custom term's: its function's
name). A term's kind is its `name`: one of the built-in terms registered in TERMS (MathTerm,
FormatTerm, OverlongTerm), or `module:function` for a CustomTerm; each kind is a frozen dataclass
with its own fields beside `name` and `weight`. A term scores a step's completions through the
scorer it makes once per run, with what the RewardComposer holds for the run (the math check's
worker pool, the token budget).
"""

import abc
import dataclasses
import importlib
import math
import re
import sys
import traceback
from typing import Callable, Literal

import numpy as np

from grpo_jax.data.rewards import RewardPool, final_text, last_boxed
from grpo_jax.errors import UserError, require

FormatStyle = Literal['boxed', 'answer_tag', 'answer_line']
ANSWER_LINE = re.compile(r'^[ \t]*(?:\*\*)?answer(?:\*\*)?[ \t]*:[ \t]*(?:\*\*)?[ \t]*\S', re.IGNORECASE | re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Completions:
  """A step's B completions as the terms read them.

  texts:       B decoded completions (row p * G + g is completion g of prompt p).
  references:  B reference answers, their prompts'.
  lengths:     [B] int, tokens of each completion, its stop token included.
  stopped:     [B] bool, whether it emitted a stop token (else the budget cut it off).
  """

  texts: list[str]
  references: list[str]
  lengths: np.ndarray
  stopped: np.ndarray


# A term's values [B] float32 for a step's completions, and how many of them failed (scored 0).
Scorer = Callable[[Completions], tuple[np.ndarray, int]]


@dataclasses.dataclass(frozen=True)
class RewardTerm(abc.ABC):
  """One term of the reward, a tagged union: `name` picks the kind (`variant`), whose own subclass
  holds its fields and checks them; config.py builds the subclass that `name` picks."""

  name: str = 'math'  # math | format | overlong | <module>:<function>
  weight: float = 1.0  # multiplies the term in the sum

  @staticmethod
  def variants() -> dict[str, type['RewardTerm']]:
    """The built-in terms' classes by name (config.py names the kind a key of another kind
    belongs to); a custom term has no fields of its own."""
    return TERMS

  @staticmethod
  def variant(name: str) -> type['RewardTerm']:
    """The class of the term named `name`; a FieldError listing the known names for any other."""
    if name in TERMS:
      return TERMS[name]
    require(_is_import_path(name), 'name', f'must be one of {", ".join(TERMS)} or <module>:<function>, got {name!r}')
    return CustomTerm

  @property
  def label(self) -> str:
    """The metric name: reward/<label> (a custom term is labelled by its function's name)."""
    return self.name.rpartition(':')[2]

  def check_run(self, config) -> None:
    """What the term asks of the run's other sections (nothing by default)."""
    del config

  @abc.abstractmethod
  def scorer(self, composer: 'RewardComposer') -> Scorer:
    """The function scoring this term for every step of a run, made once when the run's composer
    is (a custom term's function is imported then, so a bad path stops the run before step 1)."""


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


# ---- the kinds ----

@dataclasses.dataclass(frozen=True)
class MathTerm(RewardTerm):
  """1.0 / 0.0 from the math-verify check (data/rewards.py), in the reward worker pool: each check
  has a deadline and a memory limit, and a check that times out, crashes or runs out of memory
  scores 0 and is counted in `reward_failures`."""

  name: Literal['math'] = 'math'

  def scorer(self, composer: 'RewardComposer') -> Scorer:
    def score(completions: Completions) -> tuple[np.ndarray, int]:
      pool = composer.pool()
      before = pool.failures
      values = np.asarray(pool.map(completions.texts, completions.references), np.float32)
      return values, pool.failures - before
    return score


@dataclasses.dataclass(frozen=True)
class FormatTerm(RewardTerm):
  """1.0 if the completion states an answer in the requested `style`: `boxed` (a closed
  `\\boxed{...}`), `answer_tag` (`<answer>...</answer>`) or `answer_line` (a line `Answer: ...`);
  else 0.0. Linear-time string scans, in the trainer process."""

  name: Literal['format'] = 'format'
  style: FormatStyle = 'boxed'  # the form the answer must take

  def scorer(self, composer: 'RewardComposer') -> Scorer:
    del composer
    return lambda completions: (np.asarray([format_reward(text, self.style) for text in completions.texts],
                                           np.float32), 0)


@dataclasses.dataclass(frozen=True)
class OverlongTerm(RewardTerm):
  """DAPO's soft overlong punishment, counted in tokens (not characters): with the completion length
  L (tokens, the stop token included), the budget N = rollout.max_new_tokens and the buffer
  B = `buffer_tokens`, 0 for L <= N - B, (N - B - L) / B inside the buffer, and -1 for a truncated
  answer (one that never emitted a stop token)."""

  name: Literal['overlong'] = 'overlong'
  buffer_tokens: int = 0  # B, the tokens before max_new_tokens over which the penalty ramps to -1

  def __post_init__(self):
    require(self.buffer_tokens >= 0, 'buffer_tokens', f'must be >= 0, got {self.buffer_tokens}')

  def check_run(self, config) -> None:
    budget = config.rollout.max_new_tokens
    require(self.buffer_tokens <= budget, 'buffer_tokens',
            f'({self.buffer_tokens}) must be <= rollout.max_new_tokens ({budget})')

  def scorer(self, composer: 'RewardComposer') -> Scorer:
    return lambda completions: (overlong_penalty(completions.lengths, completions.stopped, composer.max_new_tokens,
                                                 self.buffer_tokens), 0)


@dataclasses.dataclass(frozen=True)
class CustomTerm(RewardTerm):
  """A term of the user's: `name` is `module:function`, with `function(completions: list[str],
  references: list[str], lengths: np.ndarray) -> sequence of B floats`, called once per step with
  the step's B = P * G decoded completions, their reference answers and their lengths in tokens.
  It runs in the trainer process (it is the user's own code, trusted like the config): it must
  bound its own time on hostile completions. An exception or a non-finite value scores 0 for the
  affected completions and counts in `reward_failures` (the first failure of a run is printed)."""

  name: str  # <module>:<function>, imported when the run's composer is made

  def __post_init__(self):
    require(_is_import_path(self.name), 'name', f'must be <module>:<function>, got {self.name!r}')

  def scorer(self, composer: 'RewardComposer') -> Scorer:
    function = load_custom(self.name)

    def score(completions: Completions) -> tuple[np.ndarray, int]:
      size = len(completions.texts)
      try:
        values = [float(value) for value in function(completions.texts, completions.references, completions.lengths)]
      except Exception:  # the user's code: score this step's completions 0, count them, say it once
        composer.report(self, traceback.format_exc())
        return np.zeros(size, np.float32), size
      if len(values) != size:
        raise UserError(f'reward term {self.name!r} returned {len(values)} values for {size} completions')
      finite = np.asarray([math.isfinite(value) for value in values])
      if not finite.all():
        composer.report(self, f'{int((~finite).sum())} non-finite values\n')
      return np.where(finite, np.asarray(values, np.float64), 0.0).astype(np.float32), int((~finite).sum())
    return score


# The built-in terms by name; any other name of the form module:function is a CustomTerm.
TERMS: dict[str, type[RewardTerm]] = {'math': MathTerm, 'format': FormatTerm, 'overlong': OverlongTerm}


# ---- the sum ----

@dataclasses.dataclass
class Composed:
  """The rewards of one step: total [B] (weighted sum), terms {label: [B]} (unweighted), failures."""

  total: np.ndarray
  terms: dict
  failures: int


class RewardComposer:
  """Scores a step's completions with the run's terms; holds what they share for the run: the math
  check's worker pool, the token budget (rollout.max_new_tokens) and one warning per run for a
  custom term's failures."""

  def __init__(self, terms: tuple[RewardTerm, ...], max_new_tokens: int, workers: int):
    if not terms:
      raise UserError('rewards: list at least one term (e.g. - {name: math})')
    labels = [term.label for term in terms]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
      raise UserError(f'rewards: the term {duplicated[0]!r} is listed twice')
    self.terms, self.max_new_tokens, self.workers = terms, max_new_tokens, workers
    self._pool = None
    self._reported = False
    self.scorers = [term.scorer(self) for term in terms]

  def pool(self) -> RewardPool:
    """The math check's worker pool, started when a term first asks for it."""
    if self._pool is None:
      self._pool = RewardPool(self.workers)
    return self._pool

  def score(self, completions: list[str], references: list[str], lengths, stopped) -> Composed:
    """Rewards of B completions: their texts, reference answers, lengths [B] and stopped [B]."""
    batch = Completions(texts=completions, references=references, lengths=np.asarray(lengths),
                        stopped=np.asarray(stopped))
    total = np.zeros(len(completions), np.float32)
    terms, failures = {}, 0
    for term, scorer in zip(self.terms, self.scorers):
      values, failed = scorer(batch)
      terms[term.label] = values
      total += np.float32(term.weight) * values
      failures += failed
    return Composed(total=total, terms=terms, failures=failures)

  def report(self, term: RewardTerm, text: str) -> None:
    """Prints a term's failure, the first of the run only."""
    if not self._reported:
      self._reported = True
      print(f'warning: reward term {term.name!r} failed (scored 0, counted in reward_failures; '
            f'reported once per run):\n{text}', file=sys.stderr, flush=True)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None
