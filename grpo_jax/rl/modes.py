"""Rollout modes: how an RL step's P prompts become a Round, their completions and scores.

Each mode is one object with one signature, `mode(state, prompts, key, observe) -> (state, Round)`;
build.py chooses its class once (`rollout_mode`), and RLStep builds it twice: traced (its stages
plain functions, inside the K-steps jit) and for the host (each stage jitted on its own; a host
task's prompts and reward run as they are).

  GroupSampling  on-policy groups (sampler/rollout.py), scored by the run's models (reward models, a
                 judge: rl/model_scores.py) and then the task's reward.
  PoolSampling   partial rollouts (sampler/pool.py): the prompts join the groups in flight and the
                 P oldest complete groups leave, scored as group sampling's are. With split devices
                 (rollout.devices) the pool lives on the sampler's devices, and the sampler's
                 advance for the next step runs while the trainer updates on this one.
  Acting         agents act on the inference server (agents/stage.py) and score their own episodes.

A mode says what it needs through its own properties, declared with their defaults on RolloutMode
and overridden by the modes that differ: whether it traces inside the K-steps jit (`traceable`),
the task it samples for (`step_task`: a host task adapted to the mesh), whether its sampler has
devices of its own (`split`), how many RL steps one call may run (`steps_per_call`), the facts it
adds to a step's metrics (`facts`), and `prime(state, draw)`, which readies a fresh run's state
before its first step (the pool takes its first L * P prompts; the other modes have nothing to
ready).
"""

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from grpo_jax import distributed
from grpo_jax.data.task import Prompts, Scores, Task
from grpo_jax.model import lora
from grpo_jax.rl.host_task import HostTask
from grpo_jax.rl.model_scores import ModelScores
from grpo_jax.rl.state import TrainState, pool_shardings
from grpo_jax.sampler.decode import DecodeSettings
from grpo_jax.sampler.layout import RolloutLayout, cross
from grpo_jax.sampler.pool import Pipeline, PoolSettings, advance_resident, advance_split, fill
from grpo_jax.sampler.rollout import Rollout, RolloutConfig, sample_resident


@dataclasses.dataclass(frozen=True)
class Round:
  """One round of sampling: P prompts, their P * G completions and the completions' scores."""

  prompts: Prompts
  rollout: Rollout
  scores: Scores
  metrics: dict = dataclasses.field(default_factory=dict)  # the sampler's own (partial rollouts': lag, carry)


def no_observer(stage: str, value) -> None:
  del stage, value


@dataclasses.dataclass(frozen=True)
class Sampling:
  """What every mode samples with: the policy's graph, the task, and the sampler's settings.

  decode: the sampler's static settings for the task's stop and pad ids; slots: decode slots (B);
  layout: where the sampler decodes (sampler/layout.py), None: in the training layout; mesh: the
  trainer's; pool: partial rollouts' settings (None on-policy); rollout: the rollout section (the
  inference server's chunk and cache reuse for agents).
  """

  graphdef: Any
  task: Task
  group_size: int
  prompts_per_step: int
  decode: DecodeSettings
  slots: int
  layout: RolloutLayout | None
  mesh: jax.sharding.Mesh
  rollout: RolloutConfig
  pool: PoolSettings | None = None
  episodes: Any = None  # an acting run's agents.stage.EpisodeRows (its episodes' images and rows)
  model_scores: ModelScores = ModelScores.none()  # the run's reward models (rl/model_scores.py)

  @property
  def split(self) -> bool:
    """The sampler decodes on devices of its own (rollout.devices), apart from the trainer's."""
    return self.layout is not None and self.layout.split

  def sample(self, params, prompt_tokens, prompt_mask, key, vision=None) -> Rollout:
    """G completions of each prompt from `params` (sampler/rollout.py); vision: the prompts'
    images. Traceable."""
    return sample_resident(self.graphdef, params, prompt_tokens, prompt_mask, key, layout=self.layout,
                           group_size=self.group_size, settings=self.decode, slots=self.slots, vision=vision)

  def task_stage(self, fn: Callable, host: bool) -> Callable:
    """A task's prompts or reward as a stage: jitted on the host when the task is jittable (its
    count or group size static); a host task's as it is."""
    return jax.jit(fn, static_argnums=2) if host and self.task.jittable else fn

  def scoring_stage(self, host: bool) -> Callable:
    """The reward: the run's models score the round's rows in the mesh (rl/model_scores.py), then
    the task's reward, given their scores: (rollout, prompts, G) -> Scores."""
    models = self.model_scores if host else self.model_scores.traced()
    reward = self.task_stage(self.task.reward, host)

    def score(rollout: Rollout, prompts: Prompts, group_size: int) -> Scores:
      return reward(rollout, prompts, group_size, models(prompts, rollout))
    return score


class RolloutMode:
  """What every mode says about itself, with the defaults that the modes which differ override.
  A mode is built from the step's Sampling; `host` False: traced inside run_steps' jit."""

  traceable = True  # its stages trace inside the K-steps jit (else the host calls them, one step a call)

  def __init__(self, sampling: Sampling, host: bool):
    del host
    self.group_size = sampling.group_size
    self.jittable = sampling.task.jittable
    self.split = sampling.split

  @classmethod
  def step_task(cls, task: Task, mesh: jax.sharding.Mesh):
    """The task as the step calls it: a host-scored one adapted to the mesh (rl/host_task.py)."""
    return task if task.jittable else HostTask(task, mesh)

  def steps_per_call(self, requested: int) -> int:
    """The RL steps one call may run, given train.steps_per_call: all of them in one jit when the
    mode traces and the task is jittable; one from the host otherwise, and with split devices,
    whose sampler's and trainer's programs run side by side."""
    return requested if self.traceable and self.jittable and not self.split else 1

  def facts(self) -> dict:
    """What the mode adds to the step's metrics beyond the round's (none by default)."""
    return {}

  def prime(self, state: TrainState, draw) -> TrainState:
    del draw
    return state


class GroupSampling(RolloutMode):
  """On-policy groups: the P prompts' G samples each, scored by the task's reward."""

  def __init__(self, sampling: Sampling, host: bool):
    super().__init__(sampling, host)
    # (params, prompt tokens, prompt mask, key, vision) -> Rollout
    self.sample = jax.jit(sampling.sample) if host else sampling.sample
    self.reward = sampling.scoring_stage(host)  # (rollout, prompts, G) -> Scores
    self.prompts = sampling.task_stage(sampling.task.prompts, host)  # (key, position, P) -> Prompts

  def __call__(self, state: TrainState, prompts: Prompts, key, observe=no_observer) -> tuple[TrainState, Round]:
    rollout = self.sample(state.policy, prompts.tokens, prompts.mask, key, prompts.vision)
    observe('rollout', rollout)
    scores = self.reward(rollout, prompts, self.group_size)
    observe('reward', scores)
    return state, Round(prompts, rollout, scores)


class Acting(RolloutMode):
  """Agents act: the problems' episodes, G each, on the inference server over the live parameters
  (agents/stage.py); the episodes score themselves. Host only (the episodes run in Python)."""

  traceable = False

  def __init__(self, sampling: Sampling, host: bool):
    from grpo_jax.agents.stage import AgentStage  # the agents package only for an acting run
    super().__init__(sampling, host)
    self.stage = AgentStage(sampling.graphdef, sampling.task, sampling.decode, sampling.slots, sampling.mesh,
                            sampling.layout, sampling.rollout.decode_chunk, sampling.rollout.reuse_turn_caches,
                            sampling.episodes)
    self.prompts = self.stage.prompts

  @classmethod
  def step_task(cls, task: Task, mesh: jax.sharding.Mesh):
    """The agent task as it is: the acting stage places its own arrays."""
    del mesh
    return task

  def facts(self) -> dict:
    """The episodes' turns, tool calls and truncation since the last call (the step's metrics)."""
    return self.stage.take_facts()

  def __call__(self, state: TrainState, prompts: Prompts, key, observe=no_observer) -> tuple[TrainState, Round]:
    rollout, scores = self.stage.act(state.policy, prompts, key, self.group_size)
    observe('rollout', rollout)
    observe('reward', scores)
    return state, Round(prompts, rollout, scores)


class PoolSampling(RolloutMode):
  """Partial rollouts (algo.max_lag > 0): the step's prompts join the pool of groups in flight
  (`fill`), the sampler decodes until the P oldest complete groups may leave (`advance`), and those
  are scored by the task's reward. A host task's answers wait in an answer book by data position:
  the pool holds arrays only. With split devices the state's pool is a pool.Pipeline on the
  sampler's devices (its shape from pool.empty_pipeline, built with the run)."""

  def __init__(self, sampling: Sampling, host: bool):
    super().__init__(sampling, host)
    settings = sampling.pool
    self.priming = settings.priming
    self.answers = None if self.jittable else AnswerBook(sampling.task, sampling.prompts_per_step)
    self.reward = sampling.scoring_stage(host)
    self.prompts = sampling.task_stage(sampling.task.prompts, host)

    def fill_pool(pool, prompt_tokens, prompt_mask, answers, sample_key, prompt_key, position, version, vision):
      return fill(pool, prompt_tokens, prompt_mask, answers, version=version, key=sample_key, position=position,
                  prompt_key=prompt_key, group_size=sampling.group_size, pad_id=sampling.decode.pad_id, vision=vision)

    def advance_pool(params, pool, version):
      return advance_resident(sampling.graphdef, params, pool, layout=sampling.layout, **settings.advance(version))

    if not host:
      self.fill, self.advance = fill_pool, advance_pool
    elif not self.split:
      self.fill, self.advance = jax.jit(fill_pool, donate_argnums=0), jax.jit(advance_pool, donate_argnums=1)
    else:
      self.fill, self.advance, self.sampler_program = _pipeline_stages(sampling, fill_pool)

  def prime(self, state: TrainState, draw) -> TrainState:
    """A fresh run's pool holds no groups yet: L * P prompts from the data position enter it (so
    that each step's P new ones bring it to (L + 1) * P); split devices also sample the groups step
    0 trains on. `draw(state) -> (state, prompts, sampling key)`."""
    if int(distributed.host_value(state.step)) != 0:
      return state
    for index in range(self.priming):
      state, prompts, key = draw(state)
      state = self.join(state, prompts, key)
      if self.split and index == self.priming - 1:  # the groups step 0 trains on
        pipeline, _ = self.advance(state.policy, state.pool, state.step)
        state = state.replace(pool=pipeline)
    return state

  def join(self, state: TrainState, prompts: Prompts, key) -> TrainState:
    """The prompts into the pool's free entries (a host task's answers into its book)."""
    if self.answers is not None:
      self.answers.record(prompts.position, prompts.answers)
    answers = prompts.answers if self.jittable else None
    pool = self.fill(state.pool, prompts.tokens, prompts.mask, answers, key, prompts.key, prompts.position, state.step,
                     prompts.vision)
    return state.replace(pool=pool)

  def __call__(self, state: TrainState, prompts: Prompts, key, observe=no_observer) -> tuple[TrainState, Round]:
    state = self.join(state, prompts, key)
    pool, taken = self.advance(state.policy, state.pool, state.step)
    state = state.replace(pool=pool)
    observe('rollout', taken.rollout)
    answers = taken.answers if self.answers is None else self.answers.take(taken)
    prompts = Prompts(tokens=taken.prompt_tokens, mask=taken.prompt_mask, answers=answers, vision=taken.vision)
    scores = self.reward(taken.rollout, prompts, self.group_size)
    observe('reward', scores)
    return state, Round(prompts, taken.rollout, scores, taken.metrics)


def _pipeline_stages(sampling: Sampling, fill_pool):
  """Split devices' fill and advance, and the sampler's program (the plan compiles it): the step's
  prompts join the pool on the sampler's devices; the weights cross once (RolloutLayout.transfer);
  the sampler's advance for the next step is dispatched before the trainer's update of this one,
  so the two run at once on their own devices, and this step trains on the groups the sampler
  made ready during the last one."""
  layout, settings = sampling.layout, sampling.pool
  sampler_replicated = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec())
  onto_sampler = lambda tree: cross(tree, sampler_replicated)  # noqa: E731
  fill_on_sampler = jax.jit(fill_pool, donate_argnums=0)
  sampler_program = jax.jit(
      lambda resident, pool, version: advance_split(sampling.graphdef, resident, pool, layout=layout,
                                                    **settings.advance(version)), donate_argnums=1)

  def fill_stage(pipeline, *inputs):
    with jax.set_mesh(layout.mesh):
      return dataclasses.replace(pipeline, pool=fill_on_sampler(pipeline.pool, *onto_sampler(inputs)))

  sampler_base = []  # with LoRA, the frozen base on the sampler's devices: it crosses once

  def crossed(params):
    trained, frozen = lora.split_trainable(params)
    if frozen is None:
      return layout.transfer(params)
    if not sampler_base:
      sampler_base.append(layout.transfer(frozen))
    return lora.join(layout.transfer(trained), sampler_base[0])  # the adapters cross every step

  def advance_stage(params, pipeline, version):
    # Dispatched, not awaited: the sampler decodes the next step's groups under these weights ...
    resident = crossed(params)
    with jax.set_mesh(layout.mesh):
      pool, ready = sampler_program(resident, pipeline.pool, onto_sampler(version))
    # ... while this step trains on the groups sampled during the last one, by rows over the
    # trainer's batch axes.
    return Pipeline(pool=pool, ready=ready), cross(pipeline.ready, pool_shardings(pipeline.ready, sampling.mesh))

  return fill_stage, advance_stage, sampler_program


class AnswerBook:
  """A host task's answers (reference strings) for the prompts in the pool, by data position: the
  pool holds arrays only. After a resume, a missing answer is drawn again from the task with the
  batch position and prompt key the pool recorded."""

  def __init__(self, task: Task, prompts_per_step: int):
    self.task, self.count, self.by_source = task, prompts_per_step, {}

  def record(self, position: int, answers) -> None:
    for index, answer in enumerate(answers):
      self.by_source[int(position) + index] = answer

  def take(self, taken) -> list:
    """The answers of the groups taken, which leave the book."""
    sources, positions, keys = (distributed.host_value(x) for x in (taken.source, taken.batch_position,
                                                                      taken.batch_key))
    for source, position, key in zip(sources, positions, keys):
      if int(source) not in self.by_source:
        self.record(position, self.task.prompts(jnp.asarray(key), int(position), self.count).answers)
    return [self.by_source.pop(int(source)) for source in sources]
