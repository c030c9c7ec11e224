"""Agents on a mixture of experts with rollout routing replay: the inference server records the
experts of every token it runs (each turn's prefill, from a kept cache on, and each decode step),
the trajectory keeps them by position and the update replays them; on one device and over the
expert axis."""

import asyncio
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.agents.inference import InferenceServer
from grpo_jax.agents.trajectory import Episode, collate
from grpo_jax.model import from_pretrained
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.decode import request_keys
from grpo_jax.testing import left_padded, random_prompts
from runs import ROOT, train_here

T1 = SamplingConfig(temperature=1.0)
GUESS = os.path.join(ROOT, 'configs', 'tiny_guess.yaml')
# tiny_guess.yaml's model as a mixture of 8 experts (top 2), replaying the server's routes.
MOE_GUESS = ('model.architecture.head_dim=16', 'model.architecture.attention_bias=false', 'model.architecture.qk_norm=true',
             'model.architecture.num_experts=8', 'model.architecture.num_experts_per_tok=2',
             'model.architecture.moe_intermediate_size=88', 'model.architecture.norm_topk_prob=true',
             'algo.routing_replay=rollout', 'algo.router_aux_loss_coef=0.01')


def test_agent_turns_on_a_mixture_record_the_routes_the_update_replays(seed, make_hf_checkpoint):
  """Episodes of three turns on a tiny Qwen3-MoE through 3 slots, each turn continuing its kept
  cache (prefilling the last token and the observation) or, once a slot was taken, the whole
  context: the trajectory's routes are the experts the server ran every token with (the prompt's
  and observations' in a prefill, the policy's in its decode step), unrecorded only where a token
  never ran (each episode's last); they equal the full forward's own routes on the same weights,
  and the update's forward replaying them routes every token exactly there."""
  from test_moe import CASES
  from grpo_jax.model.moe import unrecorded_id
  directory, _ = make_hf_checkpoint(seed, **CASES['top2-norm-tied'])
  model = from_pretrained(directory)
  graphdef, params = nnx.split(model)
  settings = DecodeSettings(sampling=T1, max_new_tokens=5, record_routes=True)
  server = InferenceServer(graphdef, settings=settings, slots=3, max_context=64, chunk=2)
  server.bind(params)
  rng = np.random.default_rng(seed)
  prompts = random_prompts(seed, [6, 3, 9, 4])
  keys = request_keys(jax.random.key(seed % 1000), len(prompts))

  async def play(prompt, key):
    episode = Episode(server, prompt, budget=30, key=key)
    for turn in range(3):
      await episode.act(5)
      if turn < 2:
        await asyncio.sleep(0.01 * int(rng.integers(0, 3)))  # an environment thinking
        episode.observe(rng.integers(0, 1000, int(rng.integers(1, 4))).tolist())
    return episode.trajectory

  async def run():
    async with server:
      return await asyncio.gather(*(play(p, k) for p, k in zip(prompts, keys)))

  trajectories = asyncio.run(run())
  assert server.stats.reused > 0  # some turn went on from its kept cache
  width = max(map(len, prompts))
  rollout, _, _ = collate(trajectories, 30, 0, [len(p) for p in prompts], prompt_width=width)
  tokens, mask = left_padded(prompts)
  sequence = np.concatenate([tokens, rollout.tokens], axis=1)
  segments = np.concatenate([mask, rollout.context], axis=1).astype(np.int32)
  recorded = rollout.routes
  assert recorded.shape == sequence.shape + (2, 2) and recorded.dtype == np.uint8
  fed = segments.astype(bool).copy()
  fed[np.arange(len(fed)), width + np.asarray(rollout.context).sum(axis=1) - 1] = False  # each episode's last token
  assert (recorded[fed] < 8).all() and (recorded[~fed] == unrecorded_id(np.uint8)).all()

  def routed(routes):
    _, routing = model.hidden_states(jnp.asarray(sequence), segment_ids=jnp.asarray(segments), routes=routes,
                                     return_routing=True)
    return np.asarray(routing.experts)

  np.testing.assert_array_equal(np.sort(routed(None), -1)[fed], np.sort(recorded, -1)[fed])
  np.testing.assert_array_equal(routed(jnp.asarray(recorded))[fed], recorded[fed])



def test_the_agent_task_trains_a_mixture_replaying_the_servers_routes(tmp_path):
  """Two RL steps of the guess-number task on a mixture of experts with routing replay: the update
  replays the inference server's routes, which its own router would choose for almost every token
  on the weights that sampled them (the first step's update: only rounding between the server's
  incremental forward and the update's full one may change a near-tied choice)."""
  rows = train_here(tmp_path, GUESS, *MOE_GUESS, 'train.steps=2', 'rollout.prompts_per_step=8', 'algo.group_size=4',
                    'train.progress=false', 'train.tensorboard=false', 'train.checkpoint_every=0')
  assert len(rows) == 2 and rows[0]['episode/turns'] > 1
  assert 0.0 <= rows[0]['routing_replay_rerouted_frac'] < 0.02, rows[0]['routing_replay_rerouted_frac']
  assert rows[0]['router_aux_loss'] >= 1.0


@pytest.mark.exhaustive
def test_agent_steps_on_a_mixture_over_the_expert_axis_equal_one_device(tmp_path):
  """Two RL steps of the guess-number task on a mixture of experts with routing replay, on an
  fsdp 2 x tensor 2 x expert 2 mesh (the server's experts over the expert axis), equal one device's:
  the episodes, rewards, losses, rerouted fractions and parameters."""
  from test_mesh_equivalence import assert_equal_runs, two_steps
  overrides = [*MOE_GUESS, 'rollout.prompts_per_step=8', 'algo.group_size=4', 'optim.learning_rate=1e-4']
  reference = two_steps(tmp_path, GUESS, overrides, (1, 1, 1))
  other = two_steps(tmp_path, GUESS, overrides, (1, 2, 2, 2))
  assert_equal_runs(reference, other)
  for row, other_row in zip(reference[0], other[0]):
    for name in ('episode/turns', 'routing_replay_rerouted_frac', 'router_aux_loss'):
      np.testing.assert_allclose(other_row[name], row[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_step_whose_episodes_recorded_no_routes_still_has_them_all_unrecorded():
  """Every environment failed before the policy's first turn: the update replaying routes gets
  routes of the step's shape, all `unrecorded` (the trainer routes those tokens itself)."""
  from grpo_jax.agents.trajectory import Trajectory
  from grpo_jax.model.moe import unrecorded
  like = np.asarray(unrecorded((2, 2), 8))
  failed = [Trajectory(tokens=[5, 6], loss_mask=[0, 0], log_probs=[0.0, 0.0]) for _ in range(3)]
  rollout, _, _ = collate(failed, 4, 0, [3, 3, 3], prompt_width=5, routes_like=like)
  assert rollout.routes.shape == (3, 9, 2, 2) and rollout.routes.dtype == np.uint8 and (rollout.routes == 255).all()
  assert collate(failed, 4, 0, [3, 3, 3], prompt_width=5)[0].routes is None
