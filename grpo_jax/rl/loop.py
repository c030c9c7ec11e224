"""One RL step — rollout -> reward -> advantages -> update — as jittable pieces, and K steps in one jit.

`Trainer` holds the static parts (graph definition, optimizer, settings) and exposes:
  rollout(state, prompts)            jitted: G samples per prompt from the live parameters
  update(state, batch, ref_params)   jitted: the optax GRPO update (rl/step.py), state donated
  run_steps(state, ref_params)       jitted: K whole RL steps under lax.scan (jittable tasks only)
The host path (rewards computed in Python) calls rollout, then the task's reward, then
`make_batch` and update; the fused path composes exactly these functions inside one jit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.config import Config
from grpo_jax.rl import algo
from grpo_jax.rl.step import Batch, TrainState, UpdateSettings, learning_rate_schedule, make_optimizer, update
from grpo_jax.sampler.rollout import Rollout, sample_groups
from grpo_jax.sampler.sampling import SamplingConfig


def rollout_metrics(rollout: Rollout, rewards: jax.Array, group_size: int) -> dict:
  """Per-step statistics of the sampled completions and their rewards (jittable)."""
  grouped = rewards.reshape(-1, group_size)
  lengths = rollout.lengths.astype(jnp.float32)
  return dict(reward_mean=rewards.mean(), reward_std=rewards.std(),
              frac_zero_std_groups=jnp.mean(jnp.all(grouped == grouped[:, :1], axis=1)),
              response_len_mean=lengths.mean(), response_len_max=lengths.max(),
              truncated_frac=1.0 - rollout.stopped.astype(jnp.float32).mean(),
              completion_tokens=lengths.sum())


def make_batch(prompt_tokens: jax.Array, prompt_mask: jax.Array, rollout: Rollout, rewards: jax.Array,
               config: Config) -> Batch:
  """Joins left-padded prompts [P, Tp] with their G completions and attaches group advantages."""
  group = config.algo.group_size
  advantages = algo.ADVANTAGES[config.algo.advantage](rewards.reshape(-1, group),
                                                       config.algo.advantage_epsilon).reshape(-1)
  prompts = jnp.repeat(prompt_tokens, group, axis=0)
  prompt_segments = jnp.repeat(prompt_mask.astype(jnp.int32), group, axis=0)
  return Batch(tokens=jnp.concatenate([prompts, rollout.tokens], axis=1),
               segment_ids=jnp.concatenate([prompt_segments, rollout.mask.astype(jnp.int32)], axis=1),
               mask=rollout.mask, advantages=advantages, sampler_log_probs=rollout.log_probs)


class Trainer:
  """The jitted functions of a run, built once from the config and the model's graph."""

  def __init__(self, config: Config, graphdef, task, total_steps: int):
    self.config = config
    self.graphdef = graphdef
    self.task = task
    algo_config = config.algo
    updates_per_step = algo_config.ppo_epochs * algo_config.num_minibatches
    self.schedule = learning_rate_schedule(config.optim, total_steps * updates_per_step)
    self.optimizer = make_optimizer(config.optim, self.schedule)
    rows = config.rollout.prompts_per_step * algo_config.group_size
    self.settings = UpdateSettings(algo=algo_config, temperature=config.rollout.temperature, rows=rows)
    r = config.rollout
    self.sampling = SamplingConfig(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
    self.rollout = jax.jit(self._rollout)
    self.make_batch = jax.jit(functools.partial(make_batch, config=config))
    self._split3 = jax.jit(lambda key: tuple(jax.random.split(key, 3)))
    self.update = jax.jit(self._update, donate_argnums=0)
    self.run_steps = jax.jit(self._run_steps, static_argnums=2, donate_argnums=0)

  def pin_shardings(self, state: TrainState, mesh) -> None:
    """Makes the jitted update and K-step loop return the train state in exactly `state`'s
    shardings (parameters and optimizer moments laid out by the logical-axis rules), so the
    donated buffers are reused in place and nothing is relaid out between steps."""
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    self.update = jax.jit(self._update, donate_argnums=0, out_shardings=(state_shardings, replicated))
    self.run_steps = jax.jit(self._run_steps, static_argnums=2, donate_argnums=0,
                             out_shardings=(state_shardings, replicated))

  def _rollout(self, params, prompt_tokens, prompt_mask, key) -> Rollout:
    model = nnx.merge(self.graphdef, params)
    return sample_groups(model, prompt_tokens, prompt_mask, key, group_size=self.config.algo.group_size,
                         max_new_tokens=self.config.rollout.max_new_tokens, sampling=self.sampling,
                         stop_token_ids=self.task.stop_token_ids, pad_id=self.task.pad_id)

  def _update(self, state: TrainState, batch: Batch, ref_params) -> tuple[TrainState, dict]:
    state, metrics = update(state, batch, ref_params, graphdef=self.graphdef, optimizer=self.optimizer,
                            schedule=self.schedule, settings=self.settings)
    return state.replace(step=state.step + 1), metrics

  def split_key(self, state: TrainState) -> tuple[TrainState, jax.Array, jax.Array]:
    """(state with a fresh key, prompt key, sampling key): the step's randomness comes from the state."""
    key, prompt_key, sample_key = self._split3(state.key)
    return state.replace(key=key), prompt_key, sample_key

  def _fused_step(self, state: TrainState, ref_params) -> tuple[TrainState, dict]:
    state, prompt_key, sample_key = self.split_key(state)
    prompts = self.task.sample(prompt_key, self.config.rollout.prompts_per_step)
    rollout = self._rollout(state.params, prompts.tokens, prompts.mask, sample_key)
    answers = jnp.repeat(prompts.answers, self.config.algo.group_size, axis=0)
    rewards = self.task.reward(rollout.tokens, answers)
    batch = make_batch(prompts.tokens, prompts.mask, rollout, rewards, self.config)
    state, update_metrics = self._update(state, batch, ref_params)
    return state, dict(rollout_metrics(rollout, rewards, self.config.algo.group_size), **update_metrics)

  def _run_steps(self, state: TrainState, ref_params, num_steps: int) -> tuple[TrainState, dict]:
    """num_steps whole RL steps in one jit; metrics come back stacked [num_steps]."""
    return jax.lax.scan(lambda s, _: self._fused_step(s, ref_params), state, None, length=num_steps)


def model_flops_per_step(num_params: int, config: Config, prompt_length: int) -> float:
  """Approximate model FLOPs of one RL step: 2 N per sampled token, 6 N per trained token (plus
  2 N per token for each extra scoring pass: pi_old when mu > 1 or several mini-batches, pi_ref)."""
  rows = config.rollout.prompts_per_step * config.algo.group_size
  sequence = prompt_length + config.rollout.max_new_tokens
  sampled = config.rollout.prompts_per_step * prompt_length + rows * config.rollout.max_new_tokens
  trained = rows * sequence * config.algo.ppo_epochs
  scoring_passes = (config.algo.ppo_epochs > 1 or config.algo.num_minibatches > 1) + (config.algo.kl_beta > 0)
  return 2.0 * num_params * sampled + 6.0 * num_params * trained + 2.0 * num_params * rows * sequence * scoring_passes


def to_host(metrics: dict) -> dict:
  return {name: np.asarray(value) for name, value in jax.device_get(metrics).items()}


@functools.cache
def matmul_peak_flops(dtype: str = 'float32', size: int = 1024, repeats: int = 5) -> float:
  """Measured FLOP/s of a square jitted matmul on the default device (the MFU denominator)."""
  import time
  x = jnp.ones((size, size), dtype) * 0.5
  matmul = jax.jit(lambda a: a @ a)
  matmul(x).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size ** 3 / best
