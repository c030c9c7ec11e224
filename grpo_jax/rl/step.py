"""The one RL step: prompts -> rollout -> reward -> advantages -> update, for every task.

The sequence is written once (`RLStep._round` then `learn`), over a set of `Stages`. With partial
rollouts (algo.max_lag > 0) the rollout stage is the pool's (sampler/pool.py): the step's
prompts join the groups in flight, and the P oldest complete groups are scored and trained on. With a
jittable task (its prompts and reward are JAX functions) `run_steps` traces the step K times under
`lax.scan` inside one jit; otherwise train.py calls the step from the host, each stage jitted on
its own and the task's prompts and reward run on the host between them (rl/host_task.py). DAPO's
dynamic sampling repeats the step's first part (`_round`) until it has enough informative groups.
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import distributed
from grpo_jax.data.task import Prompts, Scores, Task
from grpo_jax.model import lora
from grpo_jax.rl import algo
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.state import TrainState, pool_shardings
from grpo_jax.rl.update import Batch, UpdateSettings, update
from grpo_jax.sampler.layout import RolloutLayout
from grpo_jax.sampler.pool import Pipeline, advance_resident, advance_split, fill
from grpo_jax.sampler.rollout import Rollout, RolloutConfig, sample_resident


def make_batch(prompts: Prompts, rollout: Rollout, scores: Scores, algo_config: AlgoConfig, version=None) -> Batch:
  """Joins left-padded prompts [P, Tp] with their G completions and attaches group advantages;
  with the rollout's token versions, each token's lag behind `version` (the policy trained)."""
  group = algo_config.group_size
  advantages = algo.ADVANTAGES[algo_config.advantage](scores.rewards.reshape(-1, group),
                                                      algo_config.advantage_epsilon).reshape(-1)
  rows = prompts.repeat(group)
  return Batch(tokens=jnp.concatenate([rows.tokens, rollout.tokens], axis=1),
               segment_ids=jnp.concatenate([rows.mask.astype(jnp.int32), rollout.sequence_mask.astype(jnp.int32)],
                                           axis=1),
               mask=rollout.mask, advantages=advantages, sampler_log_probs=rollout.log_probs,
               lags=None if rollout.versions is None else jnp.where(rollout.mask, version - rollout.versions, 0))


def rollout_metrics(rollout: Rollout, scores: Scores, group_size: int, slots: int) -> dict:
  """Per-step statistics of the sampled completions and their rewards (jittable). With the
  sampler's `decode_steps`: slot_occupancy, the fraction of the `slots` decode slots' row-steps
  that emitted a completion token."""
  rewards = scores.rewards
  grouped = rewards.reshape(-1, group_size)
  lengths = rollout.lengths.astype(jnp.float32)
  metrics = dict(reward_mean=rewards.mean(), reward_std=rewards.std(), reward_failures=scores.failures,
                 frac_zero_std_groups=jnp.mean(jnp.all(grouped == grouped[:, :1], axis=1)),
                 response_len_mean=lengths.mean(), response_len_max=lengths.max(),
                 truncated_frac=1.0 - rollout.stopped.astype(jnp.float32).mean(),
                 completion_tokens=lengths.sum(),
                 **{f'reward/{label}': values.mean() for label, values in scores.terms.items()})
  if rollout.decode_steps is not None:
    row_steps = rollout.decode_steps.astype(jnp.float32) * slots
    metrics.update(decode_steps=rollout.decode_steps, slot_occupancy=lengths.sum() / jnp.maximum(row_steps, 1.0))
  return metrics


@dataclasses.dataclass(frozen=True)
class Round:
  """One round of sampling: P prompts, their P * G completions and the completions' scores."""

  prompts: Prompts
  rollout: Rollout
  scores: Scores
  metrics: dict = dataclasses.field(default_factory=dict)  # the sampler's own (partial rollouts': lag, carry)


@dataclasses.dataclass(frozen=True)
class Stages:
  """The step's stages, each as a function of arrays. RLStep has two sets: `traced` (plain
  functions, traced inside run_steps' jit) and `jitted` (each jitted on its own, called from the
  host; a host task's prompts and reward run there as they are).

  split_key(state) -> (state, prompt key, sampling key)
  prompts(prompt key, position, P) -> Prompts
  sample(params, prompt tokens, prompt mask, sampling key) -> Rollout
  reward(rollout, prompts, G) -> Scores
  learn(state, ref_params, prompt tokens, prompt mask, rollout, scores) -> (state, metrics)
  act(params, prompts, sampling key, G) -> (Rollout, Scores): an agent task's episodes, sampled
      and scored together (agents/stage.py), in place of sample and reward; None for other tasks.
  fill(pool, prompt tokens, prompt mask, answers, sampling key, prompt key, position, version) -> pool
  advance(params, pool, version) -> (pool, pool.Taken): partial rollouts (algo.max_lag > 0) in
      place of sample: the prompts join the pool, the P groups taken leave it; None on-policy.
  """

  split_key: Callable
  prompts: Callable
  sample: Callable
  reward: Callable
  learn: Callable
  act: Callable | None = None
  fill: Callable | None = None
  advance: Callable | None = None


def _no_observer(stage: str, value) -> None:
  del stage, value


def split_key(state: TrainState) -> tuple[TrainState, jax.Array, jax.Array]:
  """(state with a fresh key, prompt key, sampling key): the step's randomness comes from the state."""
  key, prompt_key, sample_key = jax.random.split(state.key, 3)
  return state.replace(key=key), prompt_key, sample_key


class RLStep:
  """One RL step over a TrainState, built once from the run's static parts (build.py builds it
  from a run's config). `rl_step(state, ref_params, position)` runs one from the host;
  `run_steps(state, ref_params, position, K)` runs K whole steps in one jit (jittable tasks).

  graphdef: the model's graph; task: a data.task.Task, jittable or adapted to the host
  (rl/host_task.py); optimizer / schedule: optax's, counted in optimizer updates; state_shardings:
  the TrainState's shardings, which the jitted update and K-step loop return unchanged (donated
  buffers are reused in place, nothing is relaid out); layout: where the sampler decodes
  (sampler/layout.py: the policy's weights cast and laid out once per rollout, resident on every
  device); None: in the training layout. empty_pool: with algo.max_lag > 0, the partial-rollout
  pool a fresh TrainState starts with (build.empty_pool). acts: the task's rollouts are episodes
  acted on the inference server (its registered kind says so: data/task.py TaskKind.acts).
  """

  def __init__(self, graphdef, task: Task, rollout: RolloutConfig, algo_config: AlgoConfig,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, state_shardings,
               layout: RolloutLayout | None = None, empty_pool=None, params=None, acts: bool = False):
    self.graphdef, self.task, self.algo, self.layout = graphdef, task, algo_config, layout
    self.empty_pool = empty_pool
    self.optimizer, self.schedule, self.state_shardings = optimizer, schedule, state_shardings
    self.split = layout is not None and layout.split  # rollout.devices: the sampler on devices of its own
    self.prompts_per_step = rollout.prompts_per_step
    rows = rollout.prompts_per_step * algo_config.group_size
    self.slots = min(rollout.slots or rows, rows)  # decode slots the sampler fills
    self.update_settings = UpdateSettings(algo=algo_config, temperature=rollout.sampling.temperature, rows=rows,
                                          sequence_length=task.prompt_length + rollout.max_new_tokens)
    self.decode = rollout.decode_settings(task.stop_token_ids, task.pad_id)
    self.mesh = jax.tree.leaves(state_shardings)[0].mesh
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self.max_lag = algo_config.max_lag
    partial = self.max_lag > 0
    # The pool's own bound (build.empty_pool sizes it (bound + 1) * P): with split devices one lag
    # fewer than max_lag, as the sampler runs one version behind.
    self.pool_lag = empty_pool.entries // self.prompts_per_step - 1 if partial else 0
    self.answers = None if task.jittable or not partial else _AnswerBook(task, self.prompts_per_step)
    self.traced = Stages(split_key=split_key, prompts=task.prompts, sample=self._sample, reward=task.reward,
                         learn=self._learn, fill=self._fill if partial else None,
                         advance=self._advance if partial else None)
    # A jittable task's prompts and reward are jitted like the other stages; a host task's run as they are.
    task_stage = (lambda f: jax.jit(f, static_argnums=2)) if task.jittable else (lambda f: f)
    self.acting = None
    if acts:  # agents.task.AgentTask: episodes on the inference server
      from grpo_jax.agents.stage import AgentStage
      self.acting = AgentStage(graphdef, task, self.decode, self.slots, self.mesh, layout, rollout.decode_chunk,
                               rollout.reuse_turn_caches)
    self.jitted = Stages(split_key=_host_split_key,
                         prompts=self.acting.prompts if self.acting else task_stage(task.prompts),
                         sample=jax.jit(self._sample), reward=task_stage(task.reward),
                         learn=jax.jit(self._learn, donate_argnums=0, out_shardings=(state_shardings, replicated)),
                         act=self.acting.act if self.acting else None,
                         fill=jax.jit(self._fill, donate_argnums=0) if partial else None,
                         advance=jax.jit(self._advance, donate_argnums=1) if partial else None)
    if self.split:
      self._pipeline_stages(empty_pool, params)
    self._sampled_metrics = jax.jit(self._rounds_metrics)
    self._take_groups = jax.jit(_take_groups)
    self.run_steps = jax.jit(self._run_steps, static_argnums=3, donate_argnums=0,
                             out_shardings=(state_shardings, replicated))

  def __call__(self, state: TrainState, ref_params, position, observe=_no_observer) -> tuple[TrainState, dict]:
    """One RL step from `state`, its stages called from the host; `position`: prompts the run has
    consumed. `observe(stage, value)` is called after each 'rollout', 'reward' and 'update' stage
    (the host path times them). The metrics' `sampling_rounds` times P prompts were consumed."""
    if self.algo.dynamic_sampling:
      state, metrics = self._dynamic_step(state, ref_params, position, observe)
    else:
      state, metrics = self._step(self.jitted, state, ref_params, position, observe)
      metrics = dict(metrics, sampling_rounds=1)
    if self.acting is not None:  # the episodes' turns, tool calls and truncation
      metrics = dict(metrics, **self.acting.take_facts())
    return state, metrics

  def _round(self, stages: Stages, state: TrainState, position, observe=_no_observer) -> tuple[TrainState, Round]:
    """The step's first part: P prompts from `position`, sampled and scored (with partial
    rollouts: the P groups that leave the pool, scored)."""
    state, prompt_key, sample_key = stages.split_key(state)
    prompts = stages.prompts(prompt_key, position, self.prompts_per_step)
    if stages.advance is not None:
      state = self._join(stages, state, prompts, sample_key, prompt_key, position)
      pool, taken = stages.advance(state.policy, state.pool, state.step)
      state = state.replace(pool=pool)
      observe('rollout', taken.rollout)
      prompts = self._taken_prompts(taken)
      scores = stages.reward(taken.rollout, prompts, self.algo.group_size)
      observe('reward', scores)
      return state, Round(prompts, taken.rollout, scores, taken.metrics)
    if stages.act is not None:
      rollout, scores = stages.act(state.policy, prompts, sample_key, self.algo.group_size)
      observe('rollout', rollout)
    else:
      rollout = stages.sample(state.policy, prompts.tokens, prompts.mask, sample_key)
      observe('rollout', rollout)
      scores = stages.reward(rollout, prompts, self.algo.group_size)
    observe('reward', scores)
    return state, Round(prompts, rollout, scores)

  def _step(self, stages: Stages, state: TrainState, ref_params, position, observe=_no_observer):
    """The RL step, written once: a round, then advantages and the update."""
    state, sampled = self._round(stages, state, position, observe)
    state, metrics = stages.learn(state, ref_params, sampled.prompts.tokens, sampled.prompts.mask, sampled.rollout,
                                  sampled.scores)
    observe('update', metrics)
    return state, dict(metrics, **sampled.metrics)

  def _dynamic_step(self, state: TrainState, ref_params, position, observe) -> tuple[TrainState, dict]:
    """DAPO's dynamic sampling (algo.dynamic_sampling): rounds of P prompts are sampled and scored
    until P groups with unequal rewards are found or algo.max_sampling_rounds rounds are spent;
    the update sees the first P informative groups, filled up (when the rounds run out) with the
    latest all-equal groups, whose advantages are zero. reward_mean, reward_std, reward/<term>,
    reward_failures, frac_zero_std_groups, decode_steps and slot_occupancy describe every round
    sampled (the policy's reward, the sampler's work); trained_reward_mean the batch trained on."""
    prompts_per_step, group = self.prompts_per_step, self.algo.group_size
    rounds, informative, uninformative = [], [], []
    while len(informative) < prompts_per_step and len(rounds) < self.algo.max_sampling_rounds:
      state, sampled = self._round(self.jitted, state, position + len(rounds) * prompts_per_step, observe)
      rewards = distributed.host_value(sampled.scores.rewards).reshape(prompts_per_step, group)
      for index, varied in enumerate(np.any(rewards != rewards[:, :1], axis=1)):
        (informative if varied else uninformative).append((len(rounds), index))
      rounds.append(sampled)
    shortfall = max(0, prompts_per_step - len(informative))
    chosen = sorted(informative[:prompts_per_step] + (uninformative[-shortfall:] if shortfall else []))
    trained = _gather_groups(self._take_groups, self.mesh, rounds, chosen, group)
    state, metrics = self.jitted.learn(state, ref_params, trained.prompts.tokens, trained.prompts.mask,
                                       trained.rollout, trained.scores)
    observe('update', metrics)
    sampled = self._sampled_metrics([r.rollout for r in rounds], [r.scores for r in rounds])
    everything = ('reward_mean', 'reward_std', 'reward_failures', 'frac_zero_std_groups', 'decode_steps',
                  'slot_occupancy', *(f'reward/{label}' for label in trained.scores.terms))
    return state, dict(metrics, **{name: sampled[name] for name in everything},
                       trained_reward_mean=metrics['reward_mean'], sampling_rounds=len(rounds),
                       groups_dropped=len(rounds) * prompts_per_step - prompts_per_step, groups_filled=shortfall)

  def _rounds_metrics(self, rollouts: list[Rollout], scores: list[Scores]) -> dict:
    """rollout_metrics of every round's completions together; the rounds' decode loops ran one
    after another over the same slots."""
    return rollout_metrics(Rollout.concatenate(rollouts), Scores.concatenate(scores), self.algo.group_size, self.slots)

  def _run_steps(self, state: TrainState, ref_params, position, num_steps: int) -> tuple[TrainState, dict]:
    """num_steps whole RL steps in one jit (jittable tasks); metrics come back stacked [num_steps]."""
    def one(state, index):
      return self._step(self.traced, state, ref_params, position + index * self.prompts_per_step)
    return jax.lax.scan(one, state, jnp.arange(num_steps))

  # ---- partial rollouts (algo.max_lag > 0) ----

  def needs_priming(self, state: TrainState) -> bool:
    """A fresh run's pool holds no groups yet: `prime` it before the first step."""
    return self.max_lag > 0 and int(state.step) == 0

  def prime(self, state: TrainState, position: int) -> tuple[TrainState, int]:
    """Fills a fresh pool with L * P prompts from `position` (so that each step's P new ones bring
    it to (L + 1) * P); returns the state and the prompts consumed."""
    for index in range(self.max_lag):
      state, prompt_key, sample_key = self.jitted.split_key(state)
      at = position + index * self.prompts_per_step
      prompts = self.jitted.prompts(prompt_key, at, self.prompts_per_step)
      state = self._join(self.jitted, state, prompts, sample_key, prompt_key, at)
      if self.split and index == self.max_lag - 1:  # the groups step 0 trains on
        pipeline, _ = self.jitted.advance(state.policy, state.pool, state.step)
        state = state.replace(pool=pipeline)
    return state, self.max_lag * self.prompts_per_step

  def _join(self, stages: Stages, state: TrainState, prompts: Prompts, sample_key, prompt_key, position) -> TrainState:
    """The prompts into the pool's free entries (a host task's answers into its book)."""
    if self.answers is not None:
      self.answers.record(position, prompts.answers)
    answers = prompts.answers if self.task.jittable else None
    pool = stages.fill(state.pool, prompts.tokens, prompts.mask, answers, sample_key, prompt_key, position, state.step)
    return state.replace(pool=pool)

  def _taken_prompts(self, taken) -> Prompts:
    answers = taken.answers if self.answers is None else self.answers.take(taken)
    return Prompts(tokens=taken.prompt_tokens, mask=taken.prompt_mask, answers=answers)

  def _fill(self, pool, prompt_tokens, prompt_mask, answers, sample_key, prompt_key, position, version):
    return fill(pool, prompt_tokens, prompt_mask, answers, version=version, key=sample_key, position=position,
                prompt_key=prompt_key, group_size=self.algo.group_size, pad_id=self.decode.pad_id)

  def _advance_settings(self, version) -> dict:
    return dict(version=version, take=self.prompts_per_step, group_size=self.algo.group_size, settings=self.decode,
                slots=self.slots, max_lag=self.pool_lag, regenerate=self.algo.stale_groups == 'regenerate')

  def _advance(self, params, pool, version):
    return advance_resident(self.graphdef, params, pool, layout=self.layout, **self._advance_settings(version))

  # ---- split devices (rollout.devices): the sampler and the trainer pipelined ----

  def _pipeline_stages(self, pool, params) -> None:
    """The state between steps becomes a pool.Pipeline on the sampler's devices, and the host
    stages that touch it move there: the step's prompts join the pool on the sampler; the weights
    cross once (RolloutLayout.transfer); the sampler's `advance` is dispatched for the next step
    before the trainer's update of this one, so the two run at once on their own devices."""
    layout = self.layout
    shapes = jax.eval_shape(
        lambda params, pool: advance_split(self.graphdef, layout.mirror.place(params), pool, layout=layout,
                                           **self._advance_settings(jnp.int32(0))), params, pool)[1]
    self.empty_pool = Pipeline(pool=pool, ready=jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
    self.state_shardings = self.state_shardings.replace(pool=pool_shardings(self.empty_pool, layout.mesh))
    rows = pool_shardings(shapes, self.mesh)  # the taken groups, by rows over the trainer's batch axes
    self._to_trainer = lambda taken: jax.device_put(taken, rows)
    self._onto_sampler = lambda tree: jax.device_put(
        tree, jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec()))
    fill_pool = jax.jit(self._fill, donate_argnums=0)
    sampler_advance = jax.jit(
        lambda resident, pool, version: advance_split(self.graphdef, resident, pool, layout=layout,
                                                      **self._advance_settings(version)), donate_argnums=1)
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    learn = jax.jit(self._learn, donate_argnums=0, out_shardings=(self.state_shardings.replace(pool=None), replicated))

    self.sampler_program, self.trainer_program = sampler_advance, learn  # what the plan compiles

    def fill_stage(pipeline, *inputs):
      with jax.set_mesh(layout.mesh):
        return dataclasses.replace(pipeline, pool=fill_pool(pipeline.pool, *self._onto_sampler(inputs)))

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
        pool, ready = sampler_advance(resident, pipeline.pool, self._onto_sampler(version))
      # ... while this step trains on the groups sampled during the last one.
      return Pipeline(pool=pool, ready=ready), self._to_trainer(pipeline.ready)

    def learn_stage(state, *inputs):
      trained, metrics = learn(state.replace(pool=None), *inputs)
      return trained.replace(pool=state.pool), metrics

    self.jitted = dataclasses.replace(self.jitted, fill=fill_stage, advance=advance_stage, learn=learn_stage)

  # ---- the stages of arrays ----

  def _sample(self, params, prompt_tokens, prompt_mask, key) -> Rollout:
    return sample_resident(self.graphdef, params, prompt_tokens, prompt_mask, key, layout=self.layout,
                           group_size=self.algo.group_size, settings=self.decode, slots=self.slots)

  def _learn(self, state: TrainState, ref_params, prompt_tokens, prompt_mask, rollout: Rollout,
             scores: Scores) -> tuple[TrainState, dict]:
    """Advantages, the optax update, the step's metrics; counts the step."""
    prompts = Prompts(tokens=prompt_tokens, mask=prompt_mask, answers=None)
    batch = make_batch(prompts, rollout, scores, self.algo, version=state.step)
    state, update_metrics = update(state, batch, ref_params, graphdef=self.graphdef, optimizer=self.optimizer,
                                   schedule=self.schedule, settings=self.update_settings)
    metrics = dict(rollout_metrics(rollout, scores, self.algo.group_size, self.slots), **update_metrics)
    return state.replace(step=state.step + 1), metrics


class _AnswerBook:
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


_split_key = jax.jit(lambda key: jax.random.split(key, 3))


def _host_split_key(state: TrainState) -> tuple[TrainState, jax.Array, jax.Array]:
  """split_key from the host: only the key enters the jit (the state may span two device sets)."""
  key, prompt_key, sample_key = _split_key(state.key)
  return state.replace(key=key), prompt_key, sample_key


def _take_groups(rounds: list[tuple[Prompts, Rollout, Scores]], prompt_rows: jax.Array, sample_rows: jax.Array):
  """(prompt arrays, rollout, scores) of the rows chosen from the rounds stacked in order, on the
  devices (jitted in RLStep)."""
  prompts = Prompts(tokens=jnp.concatenate([p.tokens for p, _, _ in rounds])[prompt_rows],
                    mask=jnp.concatenate([p.mask for p, _, _ in rounds])[prompt_rows], answers=None)
  return (prompts, Rollout.concatenate([r for _, r, _ in rounds]).take(sample_rows),
          Scores.concatenate([s for _, _, s in rounds]).take(sample_rows))


def _gather_groups(take, mesh, rounds: list[Round], chosen, group_size: int) -> Round:
  """The prompts, rollout rows and scores of the `chosen` (round, prompt) groups, in that order,
  gathered on the devices by `take` (_take_groups, jitted): nothing but the indices crosses to or
  from the host, so it works the same when the arrays span processes. Every field of the rollout
  and scores travels (Rollout.take); the rollout's decode_steps and the failures are every
  round's (the caller reports the rounds' metrics)."""
  prompts_per_round = rounds[0].prompts.tokens.shape[0]
  prompt_rows = np.asarray([round_index * prompts_per_round + index for round_index, index in chosen])
  sample_rows = (prompt_rows[:, None] * group_size + np.arange(group_size)).reshape(-1)
  prompt_rows, sample_rows = (distributed.replicated(rows.astype(np.int32), mesh) for rows in (prompt_rows, sample_rows))
  arrays = [(dataclasses.replace(r.prompts, answers=None), r.rollout, r.scores) for r in rounds]
  prompts, rollout, scores = take(arrays, prompt_rows, sample_rows)
  answers = [rounds[round_index].prompts.answers[index] for round_index, index in chosen]
  return Round(dataclasses.replace(prompts, answers=answers), rollout, scores)
