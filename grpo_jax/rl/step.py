"""The one RL step: prompts -> rollout mode -> advantages -> update, for every task.

The sequence is written once (`RLStep._round` then the update): P prompts from the state's data
position, the run's rollout mode (rl/modes.py: group sampling, the pool of partial rollouts, or
agents acting) turns them into a Round of completions and scores, then advantages and the update.
With a jittable task (its prompts and reward are JAX functions) `run_steps` traces the step K
times under `lax.scan` inside one jit; otherwise train.py calls the step from the host, each
stage jitted on its own and the task's prompts and reward run on the host between them
(rl/host_task.py). DAPO's dynamic sampling repeats the step's first part (`_round`) until it has
enough informative groups.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import distributed
from grpo_jax.data.task import Prompts, Scores
from grpo_jax.model.vision import RowImages
from grpo_jax.rl import algo
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.held import Held
from grpo_jax.rl.modes import Round, Sampling, no_observer
from grpo_jax.rl.state import TrainState
from grpo_jax.rl.update import UpdateSettings, update
from grpo_jax.sampler.rollout import Rollout


def make_batch(prompts: Prompts, rollout: Rollout, scores: Scores, algo_config: AlgoConfig, version=None) -> Batch:
  """Joins left-padded prompts [P, Tp] with their G completions and attaches group advantages;
  with the rollout's token versions, each token's lag behind `version` (the policy trained)."""
  group = algo_config.group_size
  advantages = algo.ADVANTAGES[algo_config.advantage](scores.rewards.reshape(-1, group),
                                                      algo_config.advantage_epsilon).reshape(-1)
  rows = dataclasses.replace(prompts, vision=None).repeat(group)  # the images stay one per prompt
  # Rows per sample: 1, or an agent's turns (task.turn_context: as_rendered), turn-major: each block
  # of P * G rows is one turn of every episode, with its episode's reward, so its groups' advantages
  # are the episodes'.
  turns = rollout.tokens.shape[0] // (prompts.tokens.shape[0] * group)
  if turns > 1:
    rows = rows.map_arrays(lambda x: jnp.concatenate([x] * turns))
  if rollout.vision is not None:  # an agent's rows, each with images of its own over prompt and completion
    images, shown = rollout.vision.images, RowImages.own(rollout.vision)
  else:
    vision = prompts.vision
    images = None if vision is None else vision.images
    shown = None if vision is None else RowImages.answering(vision, group, rows.mask, rollout.sequence_mask)
  return Batch(prompt_tokens=rows.tokens, prompt_mask=rows.mask,
               rollout=dataclasses.replace(rollout, decode_steps=None, vision=None),
               advantages=advantages, images=images, vision=shown,
               lags=jax.tree.map(lambda versions: jnp.where(rollout.mask, version - versions, 0), rollout.versions))


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


def draw(state: TrainState, count: int) -> tuple[TrainState, jax.Array, jax.Array, jax.Array]:
  """(state with a fresh key and `count` more prompts consumed, prompt key, sampling key, the data
  position the prompts start at): the round's randomness and prompts come from the state."""
  key, prompt_key, sample_key = jax.random.split(state.key, 3)
  return state.replace(key=key, position=state.position + count), prompt_key, sample_key, state.position


@functools.partial(jax.jit, static_argnums=2)
def _draw_keys(key, position, count):
  return (*jax.random.split(key, 3), position + count)


def host_draw(state: TrainState, count: int) -> tuple[TrainState, jax.Array, jax.Array, int]:
  """draw from the host: only the key and the position enter the jit (the state may span two
  device sets); the position comes back as a host int (a host task indexes its data with it)."""
  key, prompt_key, sample_key, advanced = _draw_keys(state.key, state.position, count)
  position = int(distributed.host_value(state.position))
  return state.replace(key=key, position=advanced), prompt_key, sample_key, position


class RLStep:
  """One RL step over a TrainState, built once from the run's static parts (build.py builds it
  from a run's config). `rl_step(state, held)` runs one from the host; `run_steps(state,
  held, K)` runs K whole steps in one jit (jittable tasks; `fused` is that jit); `held`: the
  weights beside the policy (rl/held.Held: pi_ref's, a teacher's). The
  prompts come from the state's data position, which the step advances; the rollout mode readies
  a fresh state before the first step (the pool's first prompts).

  graphdef: the model's graph; mode: the rollout mode's class (rl/modes.py), chosen by build.py;
  sampling: what the mode samples with (its task, a data.task.Task, jittable or adapted to the
  host: rl/host_task.py); optimizer / schedule: optax's, counted in optimizer updates;
  state_shardings: the TrainState's shardings, which the jitted update and K-step loop return
  unchanged (donated buffers are reused in place, nothing is relaid out); empty_pool: the pool a
  fresh TrainState starts with (partial rollouts; with split devices a pool.Pipeline), else None.
  """

  def __init__(self, graphdef, mode: type, sampling: Sampling, algo_config: AlgoConfig,
               optimizer: optax.GradientTransformation, schedule: optax.Schedule, state_shardings,
               sequence_length: int, empty_pool=None):
    self.graphdef, self.algo, self.empty_pool = graphdef, algo_config, empty_pool
    self.optimizer, self.schedule, self.state_shardings = optimizer, schedule, state_shardings
    self.sampling, self.layout = sampling, sampling.layout
    self.prompts_per_step, self.slots = sampling.prompts_per_step, sampling.slots
    self.update_settings = UpdateSettings(algo=algo_config, temperature=sampling.rollout.sampling.temperature,
                                          rows=sampling.prompts_per_step * algo_config.group_size,
                                          sequence_length=sequence_length)
    self.mesh = sampling.mesh
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    # The mode traced inside run_steps' jit, and the mode whose stages are jitted one by one.
    self.traced_mode = mode(sampling, host=False) if mode.traceable else None
    self.host_mode = mode(sampling, host=True)
    # The update's program, on the state without its pool (which it never changes; with split
    # devices the pool lies on the sampler's devices): the plan compiles it, `learn` calls it.
    self.update_program = jax.jit(self._learn, donate_argnums=0,
                                  out_shardings=(state_shardings.replace(pool=None), replicated))
    self._sampled_metrics = jax.jit(self._rounds_metrics)
    self._take_groups = jax.jit(_take_groups)
    self.fused = jax.jit(self._run_steps, static_argnums=2, donate_argnums=0,
                         out_shardings=(state_shardings, replicated))

  def run_steps(self, state: TrainState, held: Held, num_steps: int) -> tuple[TrainState, dict]:
    """num_steps whole RL steps in one jit (jittable tasks); metrics come back stacked [num_steps]."""
    return self.fused(self._primed(state), held, num_steps)

  def __call__(self, state: TrainState, held: Held, observe=no_observer) -> tuple[TrainState, dict]:
    """One RL step from `state`, its stages called from the host. `observe(stage, value)` is
    called after each 'rollout', 'reward' and 'update' stage (the host path times them). The
    metrics' `sampling_rounds` times P prompts were consumed."""
    state = self._primed(state)
    if self.algo.dynamic_sampling:
      state, metrics = self._dynamic_step(state, held, observe)
    else:
      state, metrics = self._step(self.host_mode, host_draw, self.learn, state, held, observe)
      metrics = dict(metrics, sampling_rounds=1)
    return state, dict(metrics, **self.host_mode.facts())  # e.g. the agents' turns, tool calls, truncation

  def _drawn(self, mode, draw, state: TrainState) -> tuple[TrainState, Prompts, jax.Array]:
    """P prompts from the state's data position, marked with where they were drawn, and the
    round's sampling key."""
    state, prompt_key, sample_key, position = draw(state, self.prompts_per_step)
    prompts = mode.prompts(prompt_key, position, self.prompts_per_step)
    return state, dataclasses.replace(prompts, position=position, key=prompt_key), sample_key

  def _primed(self, state: TrainState) -> TrainState:
    return self.host_mode.prime(state, lambda state: self._drawn(self.host_mode, host_draw, state))

  def _round(self, mode, draw, state: TrainState, observe=no_observer) -> tuple[TrainState, Round]:
    """The step's first part: P prompts from the state's data position through the rollout mode."""
    state, prompts, key = self._drawn(mode, draw, state)
    return mode(state, prompts, key, observe)

  def _step(self, mode, draw, learn, state: TrainState, held: Held, observe=no_observer):
    """The RL step, written once: a round, then advantages and the update."""
    state, sampled = self._round(mode, draw, state, observe)
    state, metrics = learn(state, held, sampled.prompts.tokens, sampled.prompts.mask, sampled.rollout,
                           sampled.scores, sampled.prompts.vision)
    observe('update', metrics)
    return state, dict(metrics, **sampled.metrics)

  def _dynamic_step(self, state: TrainState, held: Held, observe) -> tuple[TrainState, dict]:
    """DAPO's dynamic sampling (algo.dynamic_sampling): rounds of P prompts are sampled and scored
    until P groups with unequal rewards are found or algo.max_sampling_rounds rounds are spent;
    the update sees the first P informative groups, filled up (when the rounds run out) with the
    latest all-equal groups, whose advantages are zero. reward_mean, reward_std, reward/<term>,
    reward_failures, frac_zero_std_groups, decode_steps and slot_occupancy describe every round
    sampled (the policy's reward, the sampler's work); trained_reward_mean the batch trained on."""
    prompts_per_step, group = self.prompts_per_step, self.algo.group_size
    rounds, informative, uninformative = [], [], []
    while len(informative) < prompts_per_step and len(rounds) < self.algo.max_sampling_rounds:
      state, sampled = self._round(self.host_mode, host_draw, state, observe)
      rewards = distributed.host_value(sampled.scores.rewards).reshape(prompts_per_step, group)
      for index, varied in enumerate(np.any(rewards != rewards[:, :1], axis=1)):
        (informative if varied else uninformative).append((len(rounds), index))
      rounds.append(sampled)
    shortfall = max(0, prompts_per_step - len(informative))
    chosen = sorted(informative[:prompts_per_step] + (uninformative[-shortfall:] if shortfall else []))
    trained = _gather_groups(self._take_groups, self.mesh, rounds, chosen, group)
    state, metrics = self.learn(state, held, trained.prompts.tokens, trained.prompts.mask, trained.rollout,
                                trained.scores, trained.prompts.vision)
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

  def _run_steps(self, state: TrainState, held: Held, num_steps: int) -> tuple[TrainState, dict]:
    def one(state, _):
      return self._step(self.traced_mode, draw, self._learn, state, held)
    return jax.lax.scan(one, state, jnp.arange(num_steps))

  # ---- the update ----

  def learn(self, state: TrainState, held: Held, prompt_tokens, prompt_mask, rollout: Rollout,
            scores: Scores, vision=None) -> tuple[TrainState, dict]:
    """The jitted update from the host; the pool passes by it as it is."""
    trained, metrics = self.update_program(state.replace(pool=None), held, prompt_tokens, prompt_mask, rollout,
                                           scores, vision)
    return trained.replace(pool=state.pool), metrics

  def _learn(self, state: TrainState, held: Held, prompt_tokens, prompt_mask, rollout: Rollout,
             scores: Scores, vision=None) -> tuple[TrainState, dict]:
    """Advantages, the optax update, the step's metrics; counts the step. vision: the prompts'
    images (a vision-language model), or None."""
    prompts = Prompts(tokens=prompt_tokens, mask=prompt_mask, answers=None, vision=vision)
    batch = make_batch(prompts, rollout, scores, self.algo, version=state.step)
    state, update_metrics = update(state, batch, held, graphdef=self.graphdef, optimizer=self.optimizer,
                                   schedule=self.schedule, settings=self.update_settings)
    metrics = dict(rollout_metrics(rollout, scores, self.algo.group_size, self.slots), **update_metrics)
    return state.replace(step=state.step + 1), metrics


def _take_groups(rounds: list[tuple[Prompts, Rollout, Scores]], prompt_rows: jax.Array, sample_rows: jax.Array):
  """(prompt arrays, rollout, scores) of the rows chosen from the rounds stacked in order, on the
  devices (jitted in RLStep)."""
  return (Prompts.concatenate([p for p, _, _ in rounds]).take(prompt_rows),
          Rollout.concatenate([r for _, r, _ in rounds]).take(sample_rows),
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
