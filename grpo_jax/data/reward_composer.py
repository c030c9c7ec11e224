"""The reward of a step's completions from the run's terms (data/reward_terms.py): each term shaped
before it is weighted (`normalize`, then `clip`), and the terms combined (the config's
`reward_combination`) by the RewardComposer, which also holds what the terms share for the run.

Shaping a term before it is weighted (`normalize`, then `clip`), and combining the terms (the
config's `reward_combination`):

    normalize: group     x' = (x - mean_G x) / (std_G x + eps) within each prompt's G completions
    normalize: running   x' = (x - mean_run) / (std_run + eps), the statistics of every completion
                         of the run so far, this step's included
    clip: [low, high]    x' clipped to [low, high] (the raw value when normalize is none)
    sum                  total = sum_k w_k x'_k
    normalize_then_sum   GDPO (Liu et al. 2026): A_k = each term standardised within its group,
                         S = sum_k w_k A_k, and total = (S - mean_B S) / (std_B S + eps) over the
                         step's B completions: the advantage itself (each group's mean is 0), so
                         the config asks for algo.advantage: drgrpo, whose centring leaves it as it
                         is, and for terms without their own normalize or clip

Every std is the population one (divided by the count, not count - 1), and eps = 1e-6. (GDPO's and
TRL's group std is the sample one; under normalize_then_sum that scales every A_k by the same
sqrt(G / (G - 1)), which the batch standardisation removes: the totals agree up to eps.)
"""

import dataclasses
import math
import sys
from typing import Literal

import jax
import numpy as np

from grpo_jax.data.reward_terms import Completions, RewardTerm
from grpo_jax.data.rewards import RewardPool
from grpo_jax.errors import UserError

Combination = Literal['sum', 'normalize_then_sum']  # how the terms make the reward (config's reward_combination)
EPSILON = 1e-6  # eps of every standardisation: a group of equal values gives 0, not 0 / 0


# ---- normalisation ----

def standardized(values: np.ndarray, group_size: int) -> np.ndarray:
  """(x - mean x) / (std x + eps) within each run of `group_size` consecutive values (a prompt's G
  completions; the whole batch when group_size = B), [B] float64.

  std is the population one (the root mean square deviation, divided by G, not G - 1): the group is
  the whole set being standardised, not a sample of a larger one, so its values come out with mean 0
  and (up to eps) unit variance, and G = 1 is defined. GRPO's advantage (rl/algo.py) divides by the
  sample std as verl and TRL do; a term's scale differs from that by sqrt(G / (G - 1)), the same for
  every term and group. A group of equal values gives exact zeros: terms are float32 and the
  arithmetic float64, in which the sum of G equal float32 values, and so their mean, is exact (no
  rounded mean leaves ulps that eps would turn into noise)."""
  values = np.asarray(values, np.float64).reshape(-1, group_size)
  centred = values - values.mean(axis=1, keepdims=True)
  std = np.sqrt(np.mean(np.square(centred), axis=1, keepdims=True))
  return (centred / (std + EPSILON)).reshape(-1)


@dataclasses.dataclass(frozen=True)
class RunningStats:
  """Mean and M2 (the sum of squared deviations) of every value a term has had in the run, merged
  one step's batch at a time (Chan et al.'s parallel form of Welford's update), in float64. They are
  state of the run: checkpoints record them (as_dict, from_dict: JSON numbers, which round-trip a
  float64 exactly), so a resumed run standardises as the uninterrupted one would."""

  count: int = 0
  mean: float = 0.0
  m2: float = 0.0

  def merged(self, values: np.ndarray) -> 'RunningStats':
    """The statistics with a batch of values added."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
      return self
    count = self.count + values.size
    batch_mean = float(values.mean())
    batch_m2 = float(np.sum(np.square(values - batch_mean)))
    delta = batch_mean - self.mean
    mean = self.mean + delta * values.size / count
    return RunningStats(count, mean, self.m2 + batch_m2 + delta * delta * self.count * values.size / count)

  @property
  def std(self) -> float:
    """The population std of the values seen (0 before any)."""
    return math.sqrt(self.m2 / self.count) if self.count else 0.0

  def standardized(self, values: np.ndarray) -> np.ndarray:
    return (np.asarray(values, np.float64) - self.mean) / (self.std + EPSILON)

  def as_dict(self) -> dict:
    return dict(count=self.count, mean=self.mean, m2=self.m2)

  @classmethod
  def from_dict(cls, data: dict) -> 'RunningStats':
    return cls(int(data['count']), float(data['mean']), float(data['m2']))


# ---- the sum ----

@dataclasses.dataclass
class Composed:
  """The rewards of one step: total [B] (the combined reward), terms {label: [B]} (raw: unweighted,
  unnormalised), failures."""

  total: np.ndarray
  terms: dict
  failures: int


class RewardComposer:
  """Scores a step's completions with the run's terms and combines them (`combination`: `sum` or
  `normalize_then_sum`, the config's reward_combination); holds what they share for the run: the
  math check's worker pool, the token budget (rollout.max_new_tokens), the running statistics of
  the terms with `normalize: running` (`state_dict`, which checkpoints record) and one warning per
  run for a custom term's failures.

  Running statistics and normalize_then_sum's batch standardisation need every completion of the
  step: a run of several processes, each scoring its own groups, is refused with them."""

  def __init__(self, terms: tuple[RewardTerm, ...], max_new_tokens: int, workers: int,
               combination: Combination = 'sum'):
    if not terms:
      raise UserError('rewards: list at least one term (e.g. - {name: math})')
    labels = [term.label for term in terms]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
      raise UserError(f'rewards: the term {duplicated[0]!r} is listed twice')
    self.terms, self.max_new_tokens, self.workers, self.combination = terms, max_new_tokens, workers, combination
    self.running = {term.label: RunningStats() for term in terms if term.normalize == 'running'}
    if jax.process_count() > 1 and (self.running or combination == 'normalize_then_sum'):
      what = 'reward_combination: normalize_then_sum' if combination != 'sum' else 'normalize: running'
      raise UserError(f'rewards: {what} needs every completion of a step in one process; this run has '
                      f'{jax.process_count()} processes, each scoring its own groups (use normalize: group)')
    self._pool = None
    self._reported = False
    self.scorers = [term.scorer(self) for term in terms]

  def pool(self) -> RewardPool:
    """The math check's worker pool, started when a term first asks for it."""
    if self._pool is None:
      self._pool = RewardPool(self.workers)
    return self._pool

  def score(self, completions: list[str], references: list[str], lengths, stopped, group_size: int,
            model_scores: dict | None = None) -> Composed:
    """Rewards of B completions: their texts, reference answers, lengths [B] and stopped [B], and
    what the step's models scored them ({label: [B]}, Completions.model_scores); rows p * G + g
    are the G = `group_size` completions of prompt p."""
    batch = Completions(texts=completions, references=references, lengths=np.asarray(lengths),
                        stopped=np.asarray(stopped), model_scores=dict(model_scores or {}))
    total = np.zeros(len(completions), np.float32)
    terms, failures = {}, 0
    for term, scorer in zip(self.terms, self.scorers):
      values, failed = scorer(batch)
      terms[term.label] = values
      total += np.float32(term.weight) * self.shaped(term, values, group_size)
      failures += failed
    if self.combination == 'normalize_then_sum':
      total = standardized(total, total.size).astype(np.float32)
    return Composed(total=total, terms=terms, failures=failures)

  def shaped(self, term: RewardTerm, values: np.ndarray, group_size: int) -> np.ndarray:
    """A term's values [B] float32 as they enter the sum: standardised as its `normalize` says
    (within each group under normalize_then_sum, where the config leaves normalize and clip unset),
    then clipped to its `clip`. `running` merges the
    step's values into the statistics first and standardises with the result: step 1 is then
    standardised by its own batch (no empty statistics to special-case), and every step's values
    count in the statistics they are judged by, as running reward normalisers commonly do."""
    normalize = 'group' if self.combination == 'normalize_then_sum' else term.normalize
    if normalize == 'group':
      values = standardized(values, group_size)
    elif normalize == 'running':
      self.running[term.label] = self.running[term.label].merged(values)
      values = self.running[term.label].standardized(values)
    if term.clip is not None:
      values = np.clip(values, *term.clip)
    return np.asarray(values, np.float32)

  def state_dict(self) -> dict:
    """What the composer carries from step to step, as JSON: each running term's statistics."""
    return dict(running={label: stats.as_dict() for label, stats in self.running.items()})

  def load_state_dict(self, state: dict) -> None:
    """Takes back a state_dict (a checkpoint's). A running term the state does not hold (one added
    to the config since) starts from no statistics; a term the config no longer has is dropped."""
    stored = state.get('running', {})
    for label in self.running:
      self.running[label] = RunningStats.from_dict(stored[label]) if label in stored else RunningStats()

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
