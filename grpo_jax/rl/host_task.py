"""A host-scored task as the RL step sees it: the task's prompts and reward (Python on the host)
wrapped so that they take and give global arrays over the mesh, on one process or many.

The RL step (rl/step.py) calls a task's `prompts` and `reward` the same way whether they are JAX
functions (jitted there) or this adapter's host functions; only the run's builder (build.py)
knows which one it hands the step.
"""

import dataclasses
import functools

import jax
import numpy as np

from grpo_jax import distributed
from grpo_jax import sharding
from grpo_jax.data.task import Prompts, Scores, Task
from grpo_jax.sampler.rollout import Rollout


class HostTask:
  """`task` (not jittable) with its prompts replicated over `mesh` and its reward scored by the
  processes that hold each group's rows; the Task protocol's other fields are `task`'s."""

  jittable = False

  def __init__(self, task: Task, mesh: jax.sharding.Mesh):
    self.task, self.mesh = task, mesh
    self.prompt_length, self.vocab_size = task.prompt_length, task.vocab_size
    self.stop_token_ids, self.pad_id, self.vision_bucket = task.stop_token_ids, task.pad_id, task.vision_bucket

  def prompts(self, key, position: int, count: int) -> Prompts:
    """The task's prompts as global arrays (every process computes the same ones)."""
    with distributed.on_this_host():
      prompts = self.task.prompts(distributed.host_value(key), position, count)
    return prompts.map_arrays(lambda x: distributed.replicated(x, self.mesh))

  def _row_shardings(self, tree):
    return jax.tree.map(lambda x: sharding.row_sharding(self.mesh, x.shape), tree)

  def reward(self, rollout: Rollout, prompts: Prompts, group_size: int, model_scores: dict) -> Scores:
    """Scores the rollout with the task's host reward. Each process decodes and scores only the
    groups whose rows lie on its own devices (all of them on one process), with the step's model
    scores of those rows; the rewards are then summed over processes (each row is scored by exactly
    one) into replicated global arrays."""
    # Every field of the rollout, and the model scores, laid out by rows alike.
    rollout, model_scores = jax.device_put((rollout, model_scores), self._row_shardings((rollout, model_scores)))
    groups = distributed.owned_groups(rollout.tokens, group_size)
    rows = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
    mine = rollout.map_rows(lambda x: distributed.local_rows(x, rows))
    my_scores = {label: distributed.local_rows(values, rows) for label, values in model_scores.items()}
    with distributed.on_this_host():
      scores = self.task.reward(mine, Prompts(tokens=None, mask=None, answers=[prompts.answers[g] for g in groups]),
                                group_size, my_scores)

    def spread(values):  # this process's rows in place, zeros elsewhere
      values = np.asarray(values, np.float32)
      full = np.zeros(rollout.tokens.shape[:1], np.float32)
      full[rows] = values
      return full

    spread_out = dataclasses.replace(scores.map_rows(spread), failures=np.asarray(scores.failures, np.int32))
    total = distributed.sum_over_processes(spread_out)
    return jax.tree.map(functools.partial(distributed.replicated, mesh=self.mesh), total)

  def state_dict(self) -> dict:
    return self.task.state_dict()

  def load_state_dict(self, state: dict) -> None:
    self.task.load_state_dict(state)

  def close(self) -> None:
    self.task.close()
