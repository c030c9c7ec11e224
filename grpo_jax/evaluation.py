"""Held-out evaluation of a policy on math problems: the `eval` config section, the estimators and
the Evaluator that samples and scores (python -m grpo_jax.eval runs it on a checkpoint, train.py
every `eval.every` steps on the live parameters). Reports, overall and per data source:

  pass@k   the unbiased estimator 1 - C(n - c, k) / C(n, k) of "one of k answers is right" (c of
           the n answers right), averaged over problems
  mean@k   the mean accuracy of one sampled answer, c / n (avg@k when n = k)
  maj@k    whether the most frequent answer among the first k samples is right (votes are the
           normalised final answers: the last \\boxed{} content, else the last number; ties go to
           the answer that appeared first; samples without an answer do not vote)
  greedy   accuracy of the greedy answer

for k' = 1, 2, 4, ... up to k. Problems with images (a vision-language model) are sampled with
their images, padded to the held-out set's own bucket (data/math_task.py).
"""

import dataclasses
import json
import math
import os
import re
from collections import Counter

import jax
import numpy as np
from flax import nnx

from grpo_jax import distributed
from grpo_jax import metrics as metrics_lib
from grpo_jax.data.math_task import MathTask, ProblemSet
from grpo_jax.data.rewards import RewardPool, final_text, last_boxed
from grpo_jax.data.sources import DatasetSource
from grpo_jax.errors import UserError, require
from grpo_jax.sampler.layout import rollout_layout
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.sampler.sampling import SamplingConfig
from grpo_jax.sections import inline, section


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """The `eval` config section: held-out evaluation, by `python -m grpo_jax.eval` and every `every`
  steps of training. The problems are written in this section (`eval.source`, `eval.split`, ...:
  data/sources.py) and rendered like the task's (template, chat template, max_prompt_tokens)."""

  dataset: DatasetSource = inline(DatasetSource(split='test'))  # the problems (eval.source, ...); no source: none
  every: int = 0  # RL steps between evaluations during training (and after the last); 0: never
  samples: int = 8  # n: answers sampled per problem, n >= k
  k: int = 8  # pass@k, mean@k and maj@k are reported for k' = 1, 2, 4, ... up to k
  temperature: float = 1.0  # sampling temperature of the n answers
  greedy: bool = True  # also decode one greedy answer per problem (greedy accuracy)
  max_problems: int = 0  # the first this many problems of the set; 0: all
  batch_prompts: int = 8  # problems per sampler call (each with its n answers)
  max_new_tokens: int = 0  # answer budget; 0: rollout.max_new_tokens

  def __post_init__(self):
    with section('eval'):
      require(self.every >= 0, 'every', f'must be >= 0, got {self.every}')
      require(self.k >= 1, 'k', f'must be >= 1, got {self.k}')
      require(self.samples >= self.k, 'samples', f'({self.samples}) must be >= k ({self.k})')
      require(self.temperature > 0, 'temperature', f'must be > 0, got {self.temperature}')
      require(self.max_problems >= 0, 'max_problems', f'must be >= 0, got {self.max_problems}')
      require(self.batch_prompts >= 1, 'batch_prompts', f'must be >= 1, got {self.batch_prompts}')
      require(self.max_new_tokens >= 0, 'max_new_tokens', f'must be >= 0, got {self.max_new_tokens}')


NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?')


# ---- estimators ----

def pass_at_k(samples: int, correct: int, k: int) -> float:
  """Unbiased pass@k from `correct` right answers among `samples` (n >= k): 1 - C(n-c, k) / C(n, k),
  as a product so that large n does not overflow."""
  if samples < k:
    raise ValueError(f'pass@{k} needs at least {k} samples, got {samples}')
  if samples - correct < k:
    return 1.0
  return 1.0 - float(np.prod(1.0 - k / np.arange(samples - correct + 1, samples + 1)))


def final_answer(completion: str) -> str | None:
  """The answer a completion votes for: in its final text (after a thinking block), its last
  \\boxed{} content, else its last number, with whitespace and thousands separators removed; None
  when it gives neither."""
  completion = final_text(completion)
  boxed = last_boxed(completion)
  if boxed is None:
    numbers = NUMBER.findall(completion)
    boxed = numbers[-1] if numbers else None
  if boxed is None:
    return None
  answer = re.sub(r'\s+', '', boxed)
  return answer.replace(',', '') if NUMBER.fullmatch(answer) else answer


def majority_correct(answers: list[str | None], correct: list[bool], k: int) -> bool:
  """maj@k of one problem: is the most frequent non-empty answer among the first k right? Ties
  go to the answer seen first; a problem whose first k samples give no answer scores False."""
  votes = [(answer, right) for answer, right in zip(answers[:k], correct[:k]) if answer is not None]
  if not votes:
    return False
  counts = Counter(answer for answer, _ in votes)
  top = max(counts.values())
  winner = next(answer for answer, _ in votes if counts[answer] == top)
  return next(right for answer, right in votes if answer == winner)


def k_values(k: int) -> list[int]:
  """1, 2, 4, ... below k, and k."""
  values = [2 ** i for i in range(int(math.log2(k)) + 1) if 2 ** i < k]
  return values + [k]


def summarize(results: list[dict], k: int) -> dict:
  """eval/<metric> over all problems and eval/<source>/<metric> per data source; `results` hold
  each problem's `correct` [n] booleans, `answers` [n], `data_source` and optionally `greedy_correct`."""
  def metrics(rows, prefix):
    out = {}
    for kk in k_values(k):
      out[f'{prefix}pass@{kk}'] = float(np.mean([pass_at_k(len(r['correct']), sum(r['correct']), kk) for r in rows]))
      out[f'{prefix}maj@{kk}'] = float(np.mean([majority_correct(r['answers'], r['correct'], kk) for r in rows]))
    out[f'{prefix}mean@{k}'] = float(np.mean([np.mean(r['correct']) for r in rows]))
    if all('greedy_correct' in r for r in rows):
      out[f'{prefix}greedy'] = float(np.mean([r['greedy_correct'] for r in rows]))
    return out

  summary = metrics(results, 'eval/')
  sources = sorted({row['data_source'] for row in results})
  if len(sources) > 1:
    for source in sources:
      summary.update(metrics([r for r in results if r['data_source'] == source], f'eval/{source}/'))
  summary['eval/problems'] = len(results)
  return summary


# ---- the evaluator ----

class Evaluator:
  """Samples and scores the `eval` section's problems with any parameters of the model `graphdef`
  describes; `task` (a MathTask) lends its tokenizer, prompt rendering and stop ids."""

  def __init__(self, config, task: MathTask, graphdef, params):
    """config: the run's Config (its eval, task, rollout and run sections)."""
    settings = config.eval
    if settings.dataset.source is None:
      raise UserError('eval.source is not set: name the held-out problems (or pass --data)')
    self.config, self.settings, self.task = config, settings, task
    self.problems = ProblemSet(task.tokenizer, task.use_chat_template, config.task, (settings.dataset,), 'eval',
                               images=task.image_inputs)
    self.count = min(len(self.problems), settings.max_problems or len(self.problems))
    budget = settings.max_new_tokens or config.rollout.max_new_tokens
    model = nnx.merge(graphdef, params)

    def decode(sampling):  # the rollout's settings with eval's sampling and budget
      return dataclasses.replace(config.rollout, sampling=sampling, max_new_tokens=budget).decode_settings(
          task.stop_token_ids, task.pad_id)

    # The sampler's own layout over the parameters' mesh, as the trainer's rollouts use it.
    layout = rollout_layout(model, jax.tree.leaves(params)[0].sharding.mesh, config.rollout.tensor,
                            context=config.rollout.prefill_context)
    self.sampler = GroupSampler(model, group_size=settings.samples, layout=layout,
                                settings=decode(SamplingConfig(temperature=settings.temperature)))
    self.greedy = GroupSampler(model, group_size=1, settings=decode(SamplingConfig(greedy=True)), layout=layout) \
        if settings.greedy else None
    self.key = jax.random.fold_in(jax.random.key(config.run.seed), 0xE7A1)  # the same draws at every evaluation
    self._pool = None

  def run(self, params, out_path: str | None = None, progress: bool = False) -> dict:
    """Evaluates `params`; returns the summary metrics and writes per-problem rows to `out_path`."""
    settings, batch = self.settings, self.settings.batch_prompts
    if self._pool is None:
      self._pool = RewardPool(self.config.task.reward_workers)
    results = []
    bar = metrics_lib.ProgressBar(self.count, enabled=progress, noun='problem', metric='pass@1')
    for start in range(0, self.count, batch):
      indices = list(range(start, min(start + batch, self.count)))
      padded = indices + [indices[0]] * (batch - len(indices))  # one shape: one compile
      tokens, mask = self.problems.left_padded(padded, self.task.prompt_length, self.task.pad_id)
      vision = self.problems.vision(padded, tokens, mask)  # the images, in the set's one bucket
      # Global arrays over the parameters' mesh; the completions come back whole to every process
      # (each scores them all: only process 0 writes, but every one runs the same program).
      tokens, mask, vision = jax.tree.map(lambda x: _placed(x, params), (tokens, mask, vision))
      rollout = self.sampler(params, tokens, mask, jax.random.fold_in(self.key, start), vision)
      texts = self.task.decode(distributed.host_value(rollout.tokens), distributed.host_value(rollout.mask))
      references = [self.problems.answers[i] for i in padded for _ in range(settings.samples)]
      if self.greedy is not None:
        greedy = self.greedy(params, tokens, mask, self.key, vision)
        texts += self.task.decode(distributed.host_value(greedy.tokens), distributed.host_value(greedy.mask))
        references += [self.problems.answers[i] for i in padded]
      scores = self._pool.map(texts, references)
      lengths = distributed.host_value(rollout.lengths)
      for row, index in enumerate(indices):
        window = slice(row * settings.samples, (row + 1) * settings.samples)
        samples = texts[window]
        result = dict(index=index, data_source=self.problems.data_sources[index], reference=self.problems.answers[index],
                      prompt=self.problems.texts[index], samples=samples,
                      answers=[final_answer(text) for text in samples],
                      correct=[score == 1.0 for score in scores[window]], lengths=lengths[window].tolist())
        if self.greedy is not None:
          offset = batch * settings.samples + row
          result.update(greedy=texts[offset], greedy_correct=scores[offset] == 1.0)
        results.append(result)
      bar.update(len(results), float(np.mean([np.mean(result['correct']) for result in results])))  # pass@1 so far
    if out_path and distributed.is_primary():
      os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
      with open(out_path, 'w') as f:
        f.writelines(json.dumps(result) + '\n' for result in results)
    return summarize(results, settings.k)

  def close(self) -> None:
    if self._pool is not None:
      self._pool.close()
      self._pool = None


def _placed(value: np.ndarray, params) -> jax.Array:
  """A host array replicated over the parameters' mesh (a global array on many processes)."""
  layout = jax.tree.leaves(params)[0].sharding
  if isinstance(layout, jax.sharding.NamedSharding):
    return distributed.replicated(value, layout.mesh)
  return jax.device_put(value, layout)
