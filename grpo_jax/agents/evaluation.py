"""Held-out evaluation of an agent task: pass@k, maj@k, mean@k and greedy over whole episodes.

An episode succeeds when its reward reaches 1 (the built-in environments reward a solved episode
with 1: the secret found, the answer accepted). The problems are the task's held-out ones
(`AgentTask.eval_problems`: tool use reads `eval.source` rendered with the tools, the guessing
game plays every secret once); each runs `eval.samples` episodes at `eval.temperature` on an
inference server of its own over the parameters being evaluated (and one greedy episode with
`eval.greedy`), with the same turn and token budgets as training (`eval.max_new_tokens`, else the
rollout's). The summary has the estimators of grpo_jax.evaluation, plus eval/episode/<fact>
(turns, tool calls, tool errors, truncation, environment failures and timeouts: means over the
sampled episodes; an episode whose environment failed scores 0 and evaluation goes on); each
problem's episodes go to the samples file as their text (when the task has a tokenizer) or tokens.
"""

import asyncio
import dataclasses
import json
import os

import jax
import numpy as np
from flax import nnx

from grpo_jax import distributed
from grpo_jax import metrics as metrics_lib
from grpo_jax.agents.agent import episode_keys
from grpo_jax.agents.inference import InferenceServer
from grpo_jax.agents.text import decode
from grpo_jax.agents.trajectory import FACTS
from grpo_jax.errors import UserError
from grpo_jax.evaluation import summarize
from grpo_jax.sampler.layout import rollout_layout
from grpo_jax.sampler.sampling import SamplingConfig


class EpisodeEvaluator:
  """Evaluator for agent tasks: run(params, out_path, progress) -> summary; close()."""

  def __init__(self, config, task, graphdef, params):
    if task.eval_problems is None:
      raise UserError(f'task.environment {config.task.environment}: has no held-out problems to evaluate '
                      '(tool_use reads eval.source)')
    self.config, self.settings, self.task = config, config.eval, task
    self.problems = task.eval_problems()
    if not self.problems:
      raise UserError('eval: the agent task has no held-out problems')
    self.count = min(len(self.problems), self.settings.max_problems or len(self.problems))
    self.budget = self.settings.max_new_tokens or config.rollout.max_new_tokens
    # The sampler's own layout over the parameters' mesh, as the training rollouts use it.
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    layout = rollout_layout(nnx.merge(graphdef, params), mesh, config.rollout.tensor,
                            context=config.rollout.prefill_context)
    slots = config.rollout.slots or self.settings.batch_prompts * self.settings.samples

    def server(sampling):
      settings = dataclasses.replace(config.rollout, sampling=sampling, max_new_tokens=self.budget).decode_settings(
          task.stop_token_ids, task.pad_id)
      return InferenceServer(graphdef, settings=settings, slots=slots, max_context=task.prompt_length + self.budget,
                             chunk=config.rollout.decode_chunk, layout=layout, reuse=config.rollout.reuse_turn_caches)

    self.sampled = server(SamplingConfig(temperature=self.settings.temperature))
    self.greedy = server(SamplingConfig(greedy=True)) if self.settings.greedy else None
    key = jax.random.fold_in(jax.random.key(config.run.seed), 0xE7A1)  # the same draws at every evaluation
    self.keys = episode_keys(key, self.count)  # problem i's episodes draw from fold_in(key, i)

  def _episodes(self, server, params, indices, count):
    server.bind(params)
    keys = self.keys

    async def run():
      async with server:
        return await asyncio.gather(*(self.task.agent.episodes(server, self.problems[index], count, keys[index],
                                                               self.budget) for index in indices))
    return asyncio.run(run())

  def run(self, params, out_path: str | None = None, progress: bool = False) -> dict:
    settings, batch = self.settings, self.settings.batch_prompts
    results, facts = [], {name: [] for name in FACTS}
    bar = metrics_lib.ProgressBar(self.count, enabled=progress, noun='problem', metric='pass@1')
    for start in range(0, self.count, batch):
      indices = list(range(start, min(start + batch, self.count)))
      groups = self._episodes(self.sampled, params, indices, settings.samples)
      greedy = self._episodes(self.greedy, params, indices, 1) if self.greedy is not None else None
      for row, index in enumerate(indices):
        problem, episodes = self.problems[index], groups[row]
        for name in FACTS:
          facts[name] += [float(getattr(episode, name)) for episode in episodes]
        result = dict(index=index, data_source=problem.source or self.config.task.environment,
                      reference=str(problem.data), samples=[self._text(episode) for episode in episodes],
                      answers=[episode.answer for episode in episodes],
                      correct=[episode.reward >= 1.0 for episode in episodes],
                      rewards=[episode.reward for episode in episodes], turns=[episode.turns for episode in episodes])
        if greedy is not None:
          result.update(greedy=self._text(greedy[row][0]), greedy_correct=greedy[row][0].reward >= 1.0)
        results.append(result)
      bar.update(len(results), float(np.mean([np.mean(result['correct']) for result in results])))
    if out_path and distributed.is_primary():
      os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
      with open(out_path, 'w') as f:
        f.writelines(json.dumps(result) + '\n' for result in results)
    summary = summarize(results, settings.k)
    summary.update({f'eval/episode/{name}': float(np.mean(values)) for name, values in facts.items()})
    return summary

  def _text(self, episode):
    if self.task.tokenizer is None:
      return [int(token) for token in episode.tokens]
    return decode(self.task.tokenizer, episode.tokens)  # ids the tokenizer lacks as U+FFFD

  def close(self) -> None:
    pass

