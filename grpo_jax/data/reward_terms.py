"""Reward terms: the named parts of a completion's reward, each kind a dataclass of its own fields.

A run lists its terms in the config's `rewards:` section, e.g.

    rewards:
      - {name: math, weight: 1.0}                       # 1 if math-verify accepts the answer, else 0
      - {name: format, weight: 0.1, style: boxed}       # 1 if the answer is given in the asked form
      - {name: overlong, weight: 1.0, buffer_tokens: 4096}
      - {name: my_rewards:brevity, weight: 0.5}         # a custom term, imported by path
      - {name: reward_model, path: DIR, normalize: group}  # a reward model's score, computed in the mesh

Each term is logged per step, raw (unweighted, unnormalised), as `reward/<name>` (a custom term's:
its function's name). A term's kind is its `name`: one of the built-in terms registered in TERMS
(MathTerm, FormatTerm, OverlongTerm, RewardModelTerm, JudgeTerm), or `module:function` for a
CustomTerm; the two model terms read what the step's model-scoring stage gave the completions
(Completions.model_scores, rl/model_scores.py), the others score the text here. Each kind is a frozen
dataclass with its own fields beside the ones every kind takes (`name`, `weight`, `normalize`,
`clip`). A term scores a step's completions through the scorer it makes once per run, with what the
run gives it (RunScoring, the RewardComposer: the math check's worker pool, the token budget, the
failures' report).

How the terms are shaped (`normalize`, `clip`) and combined (the config's `reward_combination`)
into the reward trained on: data/reward_composer.py.
"""

import abc
import dataclasses
import importlib
import math
import re
import traceback
from typing import Callable, Literal, Protocol, get_args

import numpy as np

from grpo_jax.data.judge import ParseRule, check_template
from grpo_jax.data.rewards import RewardPool, final_text, last_boxed
from grpo_jax.errors import UserError, require

FormatStyle = Literal['boxed', 'answer_tag', 'answer_line']
Normalize = Literal['none', 'group', 'running']  # a term's standardisation before it is weighted
ANSWER_LINE = re.compile(r'^[ \t]*(?:\*\*)?answer(?:\*\*)?[ \t]*:[ \t]*(?:\*\*)?[ \t]*\S', re.IGNORECASE | re.MULTILINE)


class RunScoring(Protocol):
  """What a term's scorer may use of the run that scores it (data/reward_composer.RewardComposer
  is it; the composer imports the terms, never the other way)."""

  max_new_tokens: int  # the rollout's token budget

  def pool(self) -> RewardPool:
    """The run's worker pool for the math check."""

  def report(self, term: 'RewardTerm', text: str) -> None:
    """Records a term's failure (a custom term that raised or gave non-finite values)."""


@dataclasses.dataclass(frozen=True)
class Completions:
  """A step's B completions as the terms read them.

  texts:         B decoded completions (row p * G + g is completion g of prompt p).
  references:    B reference answers, their prompts'.
  lengths:       [B] int, tokens of each completion, its stop token included.
  stopped:       [B] bool, whether it emitted a stop token (else the budget cut it off).
  model_scores:  {label: [B] float32} what the step's models (reward models) gave these completions
                 in the mesh before the host stage (rl/model_scores.py), by the label of the term
                 they serve; {} for a run without such terms.
  """

  texts: list[str]
  references: list[str]
  lengths: np.ndarray
  stopped: np.ndarray
  model_scores: dict = dataclasses.field(default_factory=dict)


# A term's values [B] float32 for a step's completions, and how many of them failed (scored 0).
Scorer = Callable[[Completions], tuple[np.ndarray, int]]


@dataclasses.dataclass(frozen=True)
class RewardTerm(abc.ABC):
  """One term of the reward, a tagged union: `name` picks the kind (`variant`), whose own subclass
  holds its fields and checks them; config.py builds the subclass that `name` picks."""

  name: str = 'math'  # math | format | overlong | reward_model | judge | <module>:<function>
  weight: float = 1.0  # multiplies the term in the sum
  normalize: Normalize = 'none'  # none | group: within each prompt's G completions | running: over the run so far
  clip: tuple[float, float] | None = None  # [low, high] the term is clipped to, after normalize; None: unclipped

  def __post_init__(self):
    require(self.normalize in get_args(Normalize), 'normalize',
            f'must be one of {", ".join(get_args(Normalize))}, got {self.normalize!r}')
    if self.clip is not None:
      require(len(self.clip) == 2, 'clip', f'must be [low, high], got {list(self.clip)}')
      require(self.clip[0] < self.clip[1], 'clip', f'low ({self.clip[0]}) must be < high ({self.clip[1]})')

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

  # Whether the term checks completions against the problems' reference answers (a dataset of
  # prompts alone, task.format prompts, has none).
  needs_reference = False

  @property
  def label(self) -> str:
    """The metric name: reward/<label> (a custom term is labelled by its function's name)."""
    return self.name.rpartition(':')[2]

  def check_run(self, config) -> None:
    """What the term asks of the run's other sections (nothing by default)."""
    del config

  def with_paths(self, resolve: Callable[[str], str]) -> 'RewardTerm':
    """The term with the paths it reads passed through `resolve` (config.py makes local ones
    absolute); a term that reads none is itself."""
    del resolve
    return self

  @abc.abstractmethod
  def scorer(self, composer: RunScoring) -> Scorer:
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
  needs_reference = True

  def scorer(self, composer: RunScoring) -> Scorer:
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

  def scorer(self, composer: RunScoring) -> Scorer:
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
    super().__post_init__()
    require(self.buffer_tokens >= 0, 'buffer_tokens', f'must be >= 0, got {self.buffer_tokens}')

  def check_run(self, config) -> None:
    budget = config.rollout.max_new_tokens
    require(self.buffer_tokens <= budget, 'buffer_tokens',
            f'({self.buffer_tokens}) must be <= rollout.max_new_tokens ({budget})')

  def scorer(self, composer: RunScoring) -> Scorer:
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
    super().__post_init__()
    require(_is_import_path(self.name), 'name', f'must be <module>:<function>, got {self.name!r}')

  def scorer(self, composer: RunScoring) -> Scorer:
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


@dataclasses.dataclass(frozen=True)
class ModelTerm(RewardTerm):
  """A term scored by a model the run holds in the trainer's mesh (rl/model_scores.py): the step's
  model-scoring stage gives each completion its value before the host terms run, NaN where the
  model could give none (the term scores it 0 and counts it in reward_failures), and the term
  reads them by its label (Completions.model_scores)."""

  path: str = ''  # the model: a Hugging Face directory or a grpo_jax checkpoint, with its tokenizer
  dtype: str = 'bfloat16'  # the dtype its weights are held and computed in (float32 for exact parity)

  def __post_init__(self):
    super().__post_init__()
    require(bool(self.path), 'path', f'must name the {self.kind_name} (a directory: config.json, weights, tokenizer)')
    require(self.dtype in ('float32', 'bfloat16'), 'dtype', f"must be 'float32' or 'bfloat16', got {self.dtype!r}")

  @property
  def kind_name(self) -> str:
    """What the model is called in messages."""
    return self.name.replace('_', ' ')

  def with_paths(self, resolve: Callable[[str], str]) -> 'ModelTerm':
    return dataclasses.replace(self, path=resolve(self.path))

  def scorer(self, composer: RunScoring) -> Scorer:
    del composer

    def score(completions: Completions) -> tuple[np.ndarray, int]:
      if self.label not in completions.model_scores:
        raise UserError(f'reward term {self.name!r}: the step gave no scores of the {self.kind_name} {self.path}')
      values = np.asarray(completions.model_scores[self.label], np.float32)
      read = np.isfinite(values)
      return np.where(read, values, 0.0).astype(np.float32), int((~read).sum())
    return score


@dataclasses.dataclass(frozen=True)
class RewardModelTerm(ModelTerm):
  """The score of a reward model (a sequence classifier of one label: model/loading.py
  load_reward_model) of each completion after its prompt. The reward model runs in the trainer's
  mesh, as a program of the step between the rollout and the host stage (rl/model_scores.py), with
  its weights resident on the trainer's devices in `dtype`; the host term reads the scores it gave
  and shapes them like any other term's (`normalize`, `clip`: a reward model's scale is arbitrary,
  so `normalize: group` or `running` is the usual choice beside rule terms of 0/1). The raw score is
  logged as reward/reward_model.

  The conversation is read as the reward model's card says, through its own chat template. When
  its tokenizer and chat template are the policy's, it reads the policy's tokens as they are (the
  prompt as the task rendered it, the completion as sampled; rows longer than it reads are refused
  at start, not cut: rl/reward_model.py). Otherwise each completion is decoded on the host and its
  conversation (the prompt's messages, the completion as the assistant's reply) rendered through
  the reward model's template and tokenizer, at most `max_length` of its tokens: a longer one is
  not scored (0, and counted in reward_failures), since a cut conversation is another one."""

  name: Literal['reward_model'] = 'reward_model'
  # Conversations rendered through its own template (another tokenizer or template than the
  # policy's) are padded to this many of its tokens; 0: 1.5 x the policy's rows (prompt width +
  # rollout.max_new_tokens), at most its max_position_embeddings.
  max_length: int = 0

  def __post_init__(self):
    super().__post_init__()
    require(self.max_length >= 0, 'max_length', f'must be >= 0 (0: from the rows), got {self.max_length}')


@dataclasses.dataclass(frozen=True)
class JudgeTerm(ModelTerm):
  """A generative judge's verdict on each completion (data/judge.py): a language model shown the
  `template` (slots {prompt}: the question as the policy was asked it, before the chat template;
  {completion}, required; {reference}, only with `show_reference`) as one user message through its
  own chat template, its verdict decoded greedily by the project's sampler in the trainer's mesh
  (the judge's weights resident there in `dtype`) and read by `parse` into [0, 1] (a score's range
  scaled, or a choice's value). It runs in the step's model-scoring stage (rl/model_scores.py),
  before the host terms; an unparseable verdict, or a judge prompt longer than
  `max_prompt_tokens`, scores 0 and counts in reward_failures. The judge never sees the reference
  answer unless `show_reference` is true. One process only."""

  name: Literal['judge'] = 'judge'
  template: str = ''  # the judge's user message, with {completion} and optionally {prompt} and {reference}
  parse: ParseRule = ParseRule()  # how a verdict becomes a reward: kind score (low..high) or choice
  show_reference: bool = False  # whether the judge may see the reference answer ({reference})
  max_new_tokens: int = 64  # the verdict's budget in the judge's tokens
  max_prompt_tokens: int = 1024  # the judge's prompts are padded to this; a longer one is not judged (0, counted)

  def __post_init__(self):
    super().__post_init__()
    check_template(self.template, self.show_reference)
    require(self.max_new_tokens >= 1, 'max_new_tokens', f'must be >= 1, got {self.max_new_tokens}')
    require(self.max_prompt_tokens >= 1, 'max_prompt_tokens', f'must be >= 1, got {self.max_prompt_tokens}')


# The built-in terms by name; any other name of the form module:function is a CustomTerm.
TERMS: dict[str, type[RewardTerm]] = {'math': MathTerm, 'format': FormatTerm, 'overlong': OverlongTerm,
                                      'reward_model': RewardModelTerm, 'judge': JudgeTerm}
