"""The one RL step: prompts -> rollout -> reward -> advantages -> update, for every task.

`RLStep.__call__` is written once. With a jittable task (its prompts and reward are JAX
functions) `run_steps` traces it K times under `lax.scan` inside one jit; otherwise train.py calls
it directly, and each stage runs where it can: the sampler and the update as jitted functions,
the task's prompts and reward on the host between them. Only where the reward runs differs.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import distributed
from grpo_jax.config import AlgoConfig, RolloutConfig, completions_per_step
from grpo_jax.data.task import Prompts, Scores, Task
from grpo_jax.model import sharding
from grpo_jax.rl import algo
from grpo_jax.rl.step import Batch, TrainState, UpdateSettings, update
from grpo_jax.sampler.decode import DecodeSettings
from grpo_jax.sampler.layout import RolloutLayout
from grpo_jax.sampler.rollout import Rollout, sample_resident


def make_batch(prompts: Prompts, rollout: Rollout, scores: Scores, algo_config: AlgoConfig) -> Batch:
  """Joins left-padded prompts [P, Tp] with their G completions and attaches group advantages."""
  group = algo_config.group_size
  advantages = algo.ADVANTAGES[algo_config.advantage](scores.rewards.reshape(-1, group),
                                                      algo_config.advantage_epsilon).reshape(-1)
  prompt_tokens = jnp.repeat(prompts.tokens, group, axis=0)
  prompt_segments = jnp.repeat(prompts.mask.astype(jnp.int32), group, axis=0)
  return Batch(tokens=jnp.concatenate([prompt_tokens, rollout.tokens], axis=1),
               segment_ids=jnp.concatenate([prompt_segments, rollout.mask.astype(jnp.int32)], axis=1),
               mask=rollout.mask, advantages=advantages, sampler_log_probs=rollout.log_probs)


def rollout_metrics(rollout: Rollout, scores: Scores, group_size: int, slots: int = 0) -> dict:
  """Per-step statistics of the sampled completions and their rewards (jittable). With the
  sampler's `decode_steps`: slot_occupancy, the fraction of the B slots' row-steps (B = `slots`,
  0: one per completion) that emitted a completion token."""
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
    row_steps = rollout.decode_steps.astype(jnp.float32) * min(slots or lengths.shape[0], lengths.shape[0])
    metrics.update(decode_steps=rollout.decode_steps, slot_occupancy=lengths.sum() / jnp.maximum(row_steps, 1.0))
  return metrics


def _no_observer(stage: str, value) -> None:
  del stage, value


class RLStep:
  """One RL step over a TrainState, built once from the run's static parts. Its stages are
  attributes: split_key, prompts, sample, reward, learn (jitted, except a host task's prompts and
  reward); `run_steps(state, ref_params, position, K)` runs K whole steps in one jit.

  graphdef: the model's graph; task: a data.task.Task; optimizer / schedule: optax's, counted in
  optimizer updates; state_shardings: the TrainState's shardings, which the jitted update and
  K-step loop return unchanged (donated buffers are reused in place, nothing is relaid out);
  layout: where the sampler decodes (sampler/layout.py: the policy's weights cast and laid out once
  per rollout, resident on every device); None: in the training layout.
  """

  def __init__(self, graphdef, task: Task, rollout: RolloutConfig, algo_config: AlgoConfig,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, state_shardings,
               layout: RolloutLayout | None = None):
    self.graphdef, self.task, self.algo, self.layout = graphdef, task, algo_config, layout
    self.optimizer, self.schedule = optimizer, schedule
    self.prompts_per_step, self.slots = rollout.prompts_per_step, rollout.slots
    self.settings = UpdateSettings(algo=algo_config, temperature=rollout.temperature,
                                   rows=completions_per_step(rollout, algo_config),
                                   sequence_length=task.prompt_length + rollout.max_new_tokens)
    self.decode = DecodeSettings(sampling=rollout.settings, max_new_tokens=rollout.max_new_tokens,
                                 stop_token_ids=tuple(task.stop_token_ids), pad_id=task.pad_id)
    self.mesh = jax.tree.leaves(state_shardings)[0].mesh
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    # The stages as traced inside run_steps' jit (jitting each again there only costs compile time) ...
    self._bodies = types.SimpleNamespace(split_key=self._split_key_body, prompts=task.prompts,
                                         sample=self._sample_body, reward=task.reward, learn=self._learn_body)
    # ... and as called one by one from the host.
    self.split_key = jax.jit(self._split_key_body)
    self.sample = jax.jit(self._sample_body)
    self.learn = jax.jit(self._learn_body, donate_argnums=0, out_shardings=(state_shardings, replicated))
    self.prompts = jax.jit(task.prompts, static_argnums=2) if task.jittable else self._host_prompts
    self.reward = jax.jit(task.reward, static_argnums=2) if task.jittable else self._host_reward
    self._take_rows = jax.jit(_take_rows)
    self.run_steps = jax.jit(self._run_steps, static_argnums=3, donate_argnums=0,
                             out_shardings=(state_shardings, replicated))

  def __call__(self, state: TrainState, ref_params, position, observe=_no_observer) -> tuple[TrainState, dict]:
    """One RL step from `state`, its stages called from the host; `position`: prompts the run has
    consumed. `observe(stage, value)` is called after each 'rollout', 'reward' and 'update' stage
    (the host path times them). The metrics' `sampling_rounds` times P prompts were consumed."""
    if self.algo.dynamic_sampling:
      return self._dynamic_step(state, ref_params, position, observe)
    state, metrics = self._step(self, state, ref_params, position, observe)
    return state, dict(metrics, sampling_rounds=1)

  def _step(self, stages, state: TrainState, ref_params, position, observe=_no_observer) -> tuple[TrainState, dict]:
    """The RL step, written once: `stages` are this object's jitted stages or their bodies."""
    state, prompt_key, sample_key = stages.split_key(state)
    prompts = stages.prompts(prompt_key, position, self.prompts_per_step)
    rollout = stages.sample(state.params, prompts.tokens, prompts.mask, sample_key)
    observe('rollout', rollout)
    scores = stages.reward(rollout, prompts, self.algo.group_size)
    observe('reward', scores)
    state, metrics = stages.learn(state, ref_params, prompts.tokens, prompts.mask, rollout, scores)
    observe('update', metrics)
    return state, metrics

  def _dynamic_step(self, state: TrainState, ref_params, position, observe) -> tuple[TrainState, dict]:
    """DAPO's dynamic sampling (algo.dynamic_sampling): rounds of P prompts are sampled and scored
    until P groups with unequal rewards are found or algo.max_sampling_rounds rounds are spent;
    the update sees the first P informative groups, filled up (when the rounds run out) with the
    latest all-equal groups, whose advantages are zero. reward_mean, reward_std, reward/<term> and
    frac_zero_std_groups describe every completion sampled (the policy's reward); trained_reward_mean
    the batch trained on."""
    prompts_per_step, group = self.prompts_per_step, self.algo.group_size
    rounds, sampled_rewards, informative, uninformative = [], [], [], []
    while len(informative) < prompts_per_step and len(rounds) < self.algo.max_sampling_rounds:
      state, prompt_key, sample_key = self.split_key(state)
      prompts = self.prompts(prompt_key, position + len(rounds) * prompts_per_step, prompts_per_step)
      rollout = self.sample(state.params, prompts.tokens, prompts.mask, sample_key)
      observe('rollout', rollout)
      scores = self.reward(rollout, prompts, group)
      observe('reward', scores)
      rewards = distributed.host_value(scores.rewards).reshape(prompts_per_step, group)
      sampled_rewards.append(rewards)
      for index, varied in enumerate(np.any(rewards != rewards[:, :1], axis=1)):
        (informative if varied else uninformative).append((len(rounds), index))
      rounds.append((prompts, rollout, scores))
    shortfall = max(0, prompts_per_step - len(informative))
    chosen = sorted(informative[:prompts_per_step] + (uninformative[-shortfall:] if shortfall else []))
    prompts, rollout, scores = _gather_groups(self._take_rows, self.mesh, rounds, chosen, group)
    state, metrics = self.learn(state, ref_params, prompts.tokens, prompts.mask, rollout, scores)
    observe('update', metrics)
    everything = np.concatenate(sampled_rewards)
    # The rounds' sampling as a whole: every round ran its own decode loop over the same slots.
    steps = [int(distributed.host_value(sampled.decode_steps)) for _, sampled, _ in rounds]
    useful = sum(float(distributed.host_value(sampled.lengths).sum()) for _, sampled, _ in rounds)
    slots = min(self.slots or prompts_per_step * group, prompts_per_step * group)
    metrics = dict(metrics, trained_reward_mean=metrics['reward_mean'], reward_mean=everything.mean(),
                   reward_std=everything.std(), frac_zero_std_groups=1.0 - len(informative) / everything.shape[0],
                   reward_failures=sum(int(distributed.host_value(sampled.failures)) for _, _, sampled in rounds),
                   sampling_rounds=len(rounds), groups_dropped=len(rounds) * prompts_per_step - prompts_per_step,
                   groups_filled=shortfall, decode_steps=sum(steps), slot_occupancy=useful / max(1, sum(steps) * slots))
    for label in scores.terms:
      metrics[f'reward/{label}'] = np.concatenate([distributed.host_value(sampled.terms[label])
                                                   for _, _, sampled in rounds]).mean()
    return state, metrics

  def _run_steps(self, state: TrainState, ref_params, position, num_steps: int) -> tuple[TrainState, dict]:
    """num_steps whole RL steps in one jit (jittable tasks); metrics come back stacked [num_steps]."""
    def one(state, index):
      return self._step(self._bodies, state, ref_params, position + index * self.prompts_per_step)
    return jax.lax.scan(one, state, jnp.arange(num_steps))

  # ---- a host task's stages, on one process or many ----

  def _host_prompts(self, key, position: int, count: int) -> Prompts:
    """The task's prompts as global arrays (every process computes the same ones)."""
    prompts = self.task.prompts(key, position, count)
    return Prompts(tokens=distributed.replicated(prompts.tokens, self.mesh),
                   mask=distributed.replicated(prompts.mask, self.mesh), answers=prompts.answers)

  def _row_shardings(self, tree):
    return jax.tree.map(lambda x: sharding.named_sharding(self.mesh, x.shape, ('batch',) + (None,) * (x.ndim - 1))
                        if x.ndim else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()), tree)

  def _host_reward(self, rollout: Rollout, prompts: Prompts, group_size: int) -> Scores:
    """Scores the rollout with the task's host reward. Each process decodes and scores only the
    groups whose rows lie on its own devices (all of them on one process); the rewards are then
    summed over processes (each row is scored by exactly one) into replicated global arrays."""
    rollout = jax.device_put(rollout, self._row_shardings(rollout))  # every field laid out by rows alike
    groups = distributed.owned_groups(rollout.tokens, group_size)
    rows = (groups[:, None] * group_size + np.arange(group_size)).reshape(-1)
    mine = Rollout(**{name: distributed.local_rows(getattr(rollout, name), rows) for name in Rollout.ROWS})
    scores = self.task.reward(mine, Prompts(tokens=None, mask=None, answers=[prompts.answers[g] for g in groups]),
                              group_size)

    def spread(values):  # this process's rows in place, zeros elsewhere
      values = np.asarray(values, np.float32)
      full = np.zeros(rollout.tokens.shape[:1], np.float32)
      full[rows] = values
      return full

    total = distributed.sum_over_processes(dict(rewards=spread(scores.rewards),
                                                failures=np.asarray(scores.failures, np.int32),
                                                terms={label: spread(values) for label, values in scores.terms.items()}))
    place = functools.partial(distributed.replicated, mesh=self.mesh)
    return Scores(rewards=place(total['rewards']), failures=place(total['failures']),
                  terms={label: place(values) for label, values in total['terms'].items()})

  # ---- the jitted stages ----

  @staticmethod
  def _split_key_body(state: TrainState) -> tuple[TrainState, jax.Array, jax.Array]:
    """(state with a fresh key, prompt key, sampling key): the step's randomness comes from the state."""
    key, prompt_key, sample_key = jax.random.split(state.key, 3)
    return state.replace(key=key), prompt_key, sample_key

  def _sample_body(self, params, prompt_tokens, prompt_mask, key) -> Rollout:
    return sample_resident(self.graphdef, params, prompt_tokens, prompt_mask, key, layout=self.layout,
                           group_size=self.algo.group_size, settings=self.decode, slots=self.slots)

  def _learn_body(self, state: TrainState, ref_params, prompt_tokens, prompt_mask, rollout: Rollout,
                scores: Scores) -> tuple[TrainState, dict]:
    """Advantages, the optax update, the step's metrics; counts the step."""
    prompts = Prompts(tokens=prompt_tokens, mask=prompt_mask, answers=None)
    batch = make_batch(prompts, rollout, scores, self.algo)
    state, update_metrics = update(state, batch, ref_params, graphdef=self.graphdef, optimizer=self.optimizer,
                                   schedule=self.schedule, settings=self.settings)
    metrics = dict(rollout_metrics(rollout, scores, self.algo.group_size, self.slots), **update_metrics)
    return state.replace(step=state.step + 1), metrics


def _take_rows(arrays: list, rows: jax.Array) -> jax.Array:
  """Rows `rows` of the arrays stacked along axis 0, on the devices."""
  return jnp.concatenate(arrays)[rows]


def _gather_groups(take, mesh, rounds, chosen, group_size: int) -> tuple[Prompts, Rollout, Scores]:
  """The prompts, rollout rows and scores of the `chosen` (round, prompt) groups, in that order,
  gathered on the devices by `take` (_take_rows, jitted): nothing but the indices crosses to or
  from the host, so it works the same when the arrays span processes."""
  prompts_per_round = rounds[0][0].tokens.shape[0]
  prompt_rows = np.asarray([round_index * prompts_per_round + index for round_index, index in chosen])
  sample_rows = (prompt_rows[:, None] * group_size + np.arange(group_size)).reshape(-1)
  prompt_rows, sample_rows = (distributed.replicated(rows.astype(np.int32), mesh) for rows in (prompt_rows, sample_rows))

  def gathered(get, rows):
    return take([get(round_) for round_ in rounds], rows)

  prompts = Prompts(tokens=gathered(lambda r: r[0].tokens, prompt_rows), mask=gathered(lambda r: r[0].mask, prompt_rows),
                    answers=[rounds[round_index][0].answers[index] for round_index, index in chosen])
  rollout = Rollout(**{name: gathered(lambda r, name=name: getattr(r[1], name), sample_rows) for name in Rollout.ROWS},
                    decode_steps=rounds[-1][1].decode_steps)  # the metrics of all rounds are the caller's
  failures = sum(int(distributed.host_value(r[2].failures)) for r in rounds)
  scores = Scores(rewards=gathered(lambda r: r[2].rewards, sample_rows),
                  failures=distributed.replicated(np.int32(failures), mesh),
                  terms={label: gathered(lambda r, label=label: r[2].terms[label], sample_rows)
                         for label in rounds[0][2].terms})
  return prompts, rollout, scores
