"""A generative judge's two rules: what the judge model is shown (its template) and how its verdict
becomes a reward (its parse rule). The judge samples a verdict for each completion; the rules here are
pure text functions, bounded and documented, so a verdict always gives the same reward.

Template: a text with the slots `{prompt}` (the question as the policy saw it, before the chat
template), `{completion}` (the policy's answer, required) and `{reference}` (the reference answer,
allowed only when the config says the judge may see it: `show_reference: true`). It is rendered
through the judge's own chat template as one user message. Braces that are not a slot are written
doubled, as in Python's str.format.

Parse rules (`parse`):

  score    the number after the last `marker` (default "Score:", case-insensitive; spaces, `**` and
           an opening parenthesis may stand between them), which must lie in [low, high]; the reward
           is (x - low) / (high - low), in [0, 1]. "Score: 7/10" reads 7.
  choice   the word after the last `marker` (default "Verdict:"), one of `choices` (compared
           without case and trailing punctuation); the reward is the value the config gives it.

A verdict with no such marker, a number outside the range or a word not among the choices is
unparseable: it scores 0 and is counted (a judge that cannot follow its template shows in the
count, not as a silent reward).
"""

import dataclasses
import re
import string
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.errors import require
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler

ParseKind = Literal['score', 'choice']
SLOTS = ('prompt', 'completion', 'reference')
_NUMBER = r'[-+]?(?:\d+(?:\.\d*)?|\.\d+)'
_BETWEEN = r'[\s*_(]*'  # what may stand between the marker and its value: spaces, markdown emphasis, '('


@dataclasses.dataclass(frozen=True)
class ParseRule:
  """How a verdict becomes a reward (module docstring): `kind` score (a number in [low, high]) or
  choice (a word among `choices`), read after the last `marker`."""

  kind: ParseKind = 'score'
  marker: str = ''  # '': 'Score:' for score, 'Verdict:' for choice
  low: float = 0.0
  high: float = 10.0
  choices: dict[str, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    require(self.kind in ('score', 'choice'), 'kind', f"must be 'score' or 'choice', got {self.kind!r}")
    if self.kind == 'score':
      require(self.low < self.high, 'low', f'must be below high ({self.high}), got {self.low}')
    else:
      require(bool(self.choices), 'choices', 'must name at least one word and its reward, e.g. {correct: 1}')
      words = [_word(word) for word in self.choices]
      require(all(words) and len(set(words)) == len(words), 'choices',
              f'must be distinct words (compared without case and trailing punctuation), got {list(self.choices)}')

  @property
  def resolved_marker(self) -> str:
    return self.marker or ('Score:' if self.kind == 'score' else 'Verdict:')

  def __call__(self, verdict: str) -> float | None:
    """The reward of a verdict, or None when it is unparseable."""
    marker = re.escape(self.resolved_marker)
    if self.kind == 'score':
      found = re.findall(marker + _BETWEEN + '(' + _NUMBER + ')', verdict, flags=re.IGNORECASE)
      if not found:
        return None
      value = float(found[-1])
      return (value - self.low) / (self.high - self.low) if self.low <= value <= self.high else None
    found = re.findall(marker + _BETWEEN + r'(\S+)', verdict, flags=re.IGNORECASE)
    if not found:
      return None
    choices = {_word(word): float(value) for word, value in self.choices.items()}
    return choices.get(_word(found[-1]))


def _word(text: str) -> str:
  return text.strip().strip(string.punctuation + '*_').lower()


def check_template(template: str, show_reference: bool) -> None:
  """One line when a judge template cannot be rendered as the module docstring says: no
  `{completion}` slot, a slot of another name, a `{reference}` slot the config does not allow, or
  braces that are not a slot."""
  try:
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
  except ValueError as error:
    require(False, 'template', f'is not a template with {{prompt}}, {{completion}} and {{reference}} slots ({error}); '
                               'write a literal brace doubled')
  unknown = [name for name in fields if name not in SLOTS]
  require(not unknown, 'template', f'has a slot {{{unknown[0] if unknown else ""}}}; its slots are '
                                   + ', '.join(f'{{{slot}}}' for slot in SLOTS))
  require('completion' in fields, 'template', 'has no {completion} slot: the judge would not see the answer it judges')
  require(show_reference or 'reference' not in fields, 'template',
          'has a {reference} slot, but the judge sees the reference answer only with show_reference: true')


def render_judge_prompt(template: str, prompt: str, completion: str, reference: str | None = None) -> str:
  """The judge's user message for one completion (the template checked by check_template)."""
  return template.format(prompt=prompt, completion=completion, reference='' if reference is None else reference)


@dataclasses.dataclass(frozen=True)
class Judged:
  """A step's verdicts: rewards [B] (0 where unparseable), the verdict texts, and how many were
  unparseable (too long a judge prompt included)."""

  rewards: np.ndarray
  verdicts: list[str]
  unparsed: int
  parsed: np.ndarray  # [B] bool, whether the verdict was read (a reward of 0 may be a verdict's)


class Judge:
  """A judge model with its rules, built once for a run: its sampler compiled once for B rows of
  `max_prompt_tokens` (the judge's prompts left-padded to it), so every step reuses the program.
  `judge(rows, key)` judges (prompt, completion, reference) rows: the template rendered (the
  reference dropped unless `show_reference`) as one user message through the judge's own chat
  template, the verdict sampled by the project's group sampler (greedy unless `sampling` says
  otherwise), decoded up to its stop token and read by `rule`. An unparseable verdict scores 0
  and is counted; so is a row whose judge prompt is longer than `max_prompt_tokens` (it is not
  judged: a cut prompt would be another question or another answer)."""

  def __init__(self, model, tokenizer, template: str, rule: ParseRule, *, max_new_tokens: int,
               max_prompt_tokens: int, stop_token_ids: tuple[int, ...], pad_id: int, sampling=None,
               show_reference: bool = False):
    check_template(template, show_reference)
    require(max_prompt_tokens >= 1, 'max_prompt_tokens', f'must be >= 1, got {max_prompt_tokens}')
    self.model, self.tokenizer, self.template, self.rule = model, tokenizer, template, rule
    self.width, self.show_reference, self.pad_id = max_prompt_tokens, show_reference, pad_id
    self.stop_token_ids = tuple(stop_token_ids)
    settings = DecodeSettings(sampling=sampling or SamplingConfig(greedy=True), max_new_tokens=max_new_tokens,
                              stop_token_ids=self.stop_token_ids, pad_id=pad_id)
    self.sampler = GroupSampler(model, group_size=1, settings=settings)

  def __call__(self, rows: list[tuple[str, str, str | None]], key=None) -> Judged:
    ids = [judge_prompt_ids(self.tokenizer, self.template, self.show_reference, *row) for row in rows]
    fits = np.asarray([len(row) <= self.width for row in ids])
    tokens = np.full((len(rows), self.width), self.pad_id, np.int32)
    mask = np.zeros((len(rows), self.width), np.int32)
    for index, row in enumerate(ids):
      row = row if fits[index] else row[-1:]  # a placeholder: the row's verdict is not read
      tokens[index, self.width - len(row):], mask[index, self.width - len(row):] = row, 1
    rollout = jax.device_get(self.sampler(nnx.state(self.model), jnp.asarray(tokens), jnp.asarray(mask),
                                          key if key is not None else jax.random.key(0)))
    verdicts = []
    for row, length in enumerate(np.asarray(rollout.lengths)):
      answer = [int(t) for t in np.asarray(rollout.tokens)[row, :int(length)] if int(t) not in self.stop_token_ids]
      verdicts.append(self.tokenizer.decode(answer, skip_special_tokens=True) if fits[row] else '')
    values = [self.rule(verdict) if fit else None for verdict, fit in zip(verdicts, fits)]
    parsed = np.asarray([value is not None for value in values])
    rewards = np.asarray([value if value is not None else 0.0 for value in values], np.float32)
    return Judged(rewards=rewards, verdicts=verdicts, unparsed=int((~parsed).sum()), parsed=parsed)


def judge_prompt_ids(tokenizer, template: str, show_reference: bool, prompt: str, completion: str,
                     reference: str | None) -> list[int]:
  """The token ids of one row's judge prompt: the template rendered (the reference only when shown)
  as one user message through the judge's chat template, with the generation prompt."""
  message = render_judge_prompt(template, prompt, completion, reference if show_reference else None)
  return list(tokenizer.apply_chat_template([{'role': 'user', 'content': message}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False))
