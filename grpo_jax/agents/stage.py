"""The RL step's acting stage for an agent task: the step's problems, their episodes run by the
task's agent against the inference server over the live parameters, and the trajectories as the
arrays the update trains on (agents/trajectory.collate), replicated over the mesh.

Everything here runs on the host of a single process: the episodes' turns decide, as they finish,
which requests the server decodes next, so processes would not issue the same programs in the
same order. A run over several processes with an agent task is refused.

An episode whose environment failed (a call raised or ran past task.env_timeout_s) trains nothing
and scores 0 (agents/deadline.py); past task.max_env_failure_frac of a step's episodes the run
stops: an environment failing that often is broken, not unlucky.
"""

import asyncio
import dataclasses

import jax
import numpy as np

from grpo_jax import distributed
from grpo_jax.agents import images
from grpo_jax.agents.agent import episode_keys
from grpo_jax.agents.images import ImageReader
from grpo_jax.agents.inference import InferenceServer
from grpo_jax.agents.trajectory import collate
from grpo_jax.data.task import Prompts, Scores
from grpo_jax.errors import UserError
from grpo_jax.model.moe import unrecorded
from grpo_jax.sampler.decode import DecodeSettings
from grpo_jax.sampler.rollout import Rollout


@dataclasses.dataclass(frozen=True)
class EpisodeRows:
  """How an agent step's episodes become the update's rows, chosen where the run is built (`of`):
  the images they may hold (the run's ImageReader, task.max_images; None: text) and the rows per
  episode (task.max_turns with task.turn_context: as_rendered, a row per turn; 0: one row)."""

  images: ImageReader | None = None
  turns: int = 0

  @classmethod
  def of(cls, config) -> 'EpisodeRows':
    return cls(images=images.reader(config),
               turns=config.task.max_turns if config.task.turn_context == 'as_rendered' else 0)


class AgentStage:
  """`prompts(key, position, count)` and `act(params, prompts, key, group_size) -> (Rollout,
  Scores)` for an agents.task.AgentTask; the facts of the episodes acted since the last `take_facts`
  (turns, tool calls, tool errors, truncation, environment failures and timeouts) are kept for the
  step's metrics."""

  def __init__(self, graphdef, task, settings: DecodeSettings, slots: int, mesh: jax.sharding.Mesh, layout=None,
               chunk: int = 4, reuse: bool = True, rows: EpisodeRows = EpisodeRows()):
    if jax.process_count() > 1:
      raise UserError(f'task.name agent runs on one process; this run has {jax.process_count()}')
    self.task, self.mesh, self.budget, self.pad_id = task, mesh, settings.max_new_tokens, settings.pad_id
    self.images, self.turn_rows = rows.images, rows.turns
    self.server = InferenceServer(graphdef, settings=settings, slots=slots,
                                  max_context=task.prompt_length + settings.max_new_tokens, chunk=chunk, layout=layout,
                                  reuse=reuse, images=None if self.images is None else self.images.bucket)
    self._facts: list[dict] = []

  def prompts(self, key, position: int, count: int) -> Prompts:
    return self.task.prompts(key, position, count).map_arrays(lambda x: distributed.replicated(x, self.mesh))

  def act(self, params, prompts: Prompts, key: jax.Array, group_size: int) -> tuple[Rollout, Scores]:
    """The episodes of every problem, G each, problem p's from fold_in(key, p)."""
    self.server.bind(params)
    before = self.server.stats.decode_steps
    keys = episode_keys(key, len(prompts.answers))  # problem p's from fold_in(key, p)

    async def run():
      async with self.server:
        groups = await asyncio.gather(*(self.task.agent.episodes(self.server, problem, group_size, problem_key,
                                                                 self.budget)
                                        for problem, problem_key in zip(prompts.answers, keys)))
      return [trajectory for group in groups for trajectory in group]

    prompt_mask = np.asarray(prompts.mask).repeat(group_size, axis=0)
    rollout, scores, facts = collate(asyncio.run(run()), self.budget, self.pad_id, prompt_mask.sum(axis=1).tolist(),
                                     prompt_width=prompt_mask.shape[1], routes_like=self._routes_like(),
                                     prompts=(np.asarray(prompts.tokens).repeat(group_size, axis=0), prompt_mask),
                                     images=self.images, turn_rows=self.turn_rows)
    self._check_failures(facts['failures'])
    self._facts.append(facts)
    place = lambda value: distributed.replicated(value, self.mesh)  # noqa: E731
    rollout = dataclasses.replace(rollout.map_rows(place),
                                  decode_steps=place(np.int32(self.server.stats.decode_steps - before)))
    return rollout, dataclasses.replace(scores.map_rows(place), failures=place(scores.failures))

  def _routes_like(self) -> np.ndarray | None:
    """One token's routes, unrecorded ([Ls, k] of the routes' dtype), where the update replays them."""
    c = self.server.architecture
    if not self.server.settings.record_routes:
      return None
    return np.asarray(unrecorded((c.num_sparse_layers, c.num_experts_per_tok), c.num_experts))

  def _check_failures(self, failures: np.ndarray) -> None:
    """failures [P*G]: 1 where the episode's environment failed."""
    failed, episodes, limit = int(failures.sum()), len(failures), self.task.max_failure_frac
    if failed > limit * episodes:
      raise UserError(f'environment {self.task.environment}: {failed} of the step\'s {episodes} episodes failed '
                      '(a call raised or ran past task.env_timeout_s; the first of each is printed above), more than '
                      f'task.max_env_failure_frac ({limit:g}) allows')

  def take_facts(self) -> dict:
    """episode/<fact>: the means over the episodes acted since the last call."""
    facts, self._facts = self._facts, []
    return {f'episode/{name}': float(np.mean(np.concatenate([f[name] for f in facts]))) for name in facts[0]} \
        if facts else {}
