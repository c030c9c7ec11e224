"""Images in environments: an agent's conversation holds images in its prompt and in later turns
(agents/images.py). The inference server prefills each image in the turn that brings it, over the
cache it kept of the turns before, and answers as transformers does on the whole conversation; the
trajectory carries the images into the update, whose forward gives the server's log-probs; the
environment demo that must read its images learns, and its blanked-image control does not."""

import asyncio
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.agents.images import ImageReader, Observation
from grpo_jax.agents.inference import InferenceServer
from grpo_jax.agents.trajectory import Episode, collate
from grpo_jax.errors import UserError
from grpo_jax.model import from_pretrained
from grpo_jax.model.images import ImageSettings
from grpo_jax.model.vision import ImageBucket, image_tokens, patch_bucket
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.decode import request_keys
from grpo_jax.testing import TINY_VL_TOKENS, left_padded
from runs import ROOT, train_here

IMAGE, START, END = (TINY_VL_TOKENS[name]
                     for name in ('image_token_id', 'vision_start_token_id', 'vision_end_token_id'))
SPOT_AGENT = os.path.join(ROOT, 'configs', 'tiny_spot_agent.yaml')
STEPS = 5  # tokens a turn


def image(rng, config, grid):
  """Random patches of an image of patch grid `grid`, with the tokens that stand for it."""
  patches = rng.normal(size=(int(np.prod(grid)), config.vision.patch_dim)).astype(np.float32)
  return (patches, grid), [START] + [IMAGE] * image_tokens(grid, config.vision) + [END]


def transformers_greedy(reference, context, images):
  import torch
  tokens = torch.tensor([context])
  with torch.no_grad():
    out = reference.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens),
                             pixel_values=torch.tensor(np.concatenate([patches for patches, _ in images])),
                             image_grid_thw=torch.tensor([grid for _, grid in images]),
                             mm_token_type_ids=(tokens == IMAGE).int(), max_new_tokens=STEPS, do_sample=False)
  return tuple(out[0, len(context):].tolist())


def test_two_turns_with_an_image_each_answer_as_transformers(seed, make_hf_checkpoint):
  """Three conversations at once through two slots: an image in the prompt, the greedy turn, then
  the environment's text and a second image, and the next greedy turn, continuing the kept cache
  where the slot still holds it. Each turn's tokens equal transformers' greedy generate on the
  whole conversation so far, its images as pixel_values; and the trajectories' images, laid out for
  the update, give the forward the turns were sampled from (tokens' log-probs equal the server's)."""
  directory, reference = make_hf_checkpoint(seed, model_type='qwen2_5_vl')
  model = from_pretrained(directory)
  config = model.config
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(seed)
  grids = [((1, 4, 4), (1, 2, 6)), ((1, 8, 4), (1, 4, 4)), ((1, 2, 2), (1, 6, 4))]
  bucket = ImageBucket(2, patch_bucket(32, config.vision))
  reader = ImageReader(config, ImageSettings(), bucket)
  server = InferenceServer(graphdef, settings=DecodeSettings(sampling=SamplingConfig(greedy=True),
                                                             max_new_tokens=STEPS), slots=2, max_context=96, chunk=2,
                           images=bucket)
  server.bind(params)
  conversations = []
  for first, second in grids:
    shown, block = image(rng, config, first)
    prompt = rng.integers(0, 900, int(rng.integers(1, 5))).tolist() + block + rng.integers(0, 900, 2).tolist()
    later, later_block = image(rng, config, second)
    observation = rng.integers(0, 900, int(rng.integers(0, 3))).tolist() + later_block + [17]
    conversations.append((prompt, shown, observation, later))

  async def play(prompt, shown, observation, later, key):
    episode = Episode(server, prompt, budget=40, key=key, images=(shown,), reader=reader)
    first = await episode.act(STEPS)
    episode.observe(observation, (later,))
    context = prompt + episode.trajectory.tokens
    second = await episode.act(STEPS)
    return episode.trajectory, first.tokens, context, second.tokens

  async def run():
    async with server:
      keys = request_keys(jax.random.key(seed % 1000), len(conversations))
      return await asyncio.gather(*(play(*c, k) for c, k in zip(conversations, keys)))

  played = asyncio.run(run())
  assert server.stats.reused >= 1  # some second turn prefilled its image over the kept cache
  compared = 0
  for (prompt, shown, observation, later), (trajectory, first, context, second) in zip(conversations, played):
    assert first == transformers_greedy(reference, prompt, [shown])
    assert [image.start for image in trajectory.images] == [prompt.index(IMAGE),
                                                             len(prompt) + len(first) + observation.index(IMAGE)]
    if {IMAGE, START, END} & set(first):
      # The random model answered with an image's own token: transformers would read a third image
      # in the second turn's context (and stop for want of its grid), so that turn is not compared.
      continue
    assert second == transformers_greedy(reference, context, [shown, later])
    compared += 1
  assert compared >= 1
  prompts = [prompt for prompt, *_ in conversations]
  tokens, mask = left_padded(prompts)
  rollout, _, _ = collate([trajectory for trajectory, *_ in played], 40, 0, [len(p) for p in prompts],
                          prompt_width=tokens.shape[1], prompts=(tokens, mask), images=reader)
  assert_update_log_probs(model, tokens, mask, rollout, atol=1e-4)


def assert_update_log_probs(model, prompt_tokens, prompt_mask, rollout, atol):
  """The update's forward over collate's rows (prompt, then trajectory, with rollout.vision) gives
  each sampled token the server's log-prob."""
  from grpo_jax.model.vision import model_inputs
  width = prompt_tokens.shape[1]
  tokens = jnp.concatenate([jnp.asarray(prompt_tokens), jnp.asarray(rollout.tokens)], axis=1)
  segments = jnp.concatenate([jnp.asarray(prompt_mask, jnp.int32), jnp.asarray(rollout.context, jnp.int32)], axis=1)
  logits = model(tokens, segment_ids=segments, **model_inputs(rollout.vision))
  predicted = jax.nn.log_softmax(logits[:, width - 1:-1].astype(jnp.float32), axis=-1)
  log_probs = np.asarray(jnp.take_along_axis(predicted, jnp.asarray(rollout.tokens)[..., None], axis=-1)[..., 0])
  mask = np.asarray(rollout.mask)
  np.testing.assert_allclose(log_probs[mask], np.asarray(rollout.log_probs)[mask], rtol=0, atol=atol)


def test_the_update_reads_the_images_the_server_showed(tmp_path):
  """The image demo's episodes (two turns, an image each from the environment, task.environment
  spot) sampled at temperature 1 through the acting stage: the update's rows laid out by collate
  (each row's images, the second in the completion, and its M-RoPE positions) give every sampled
  token the log-prob the server sampled it with. The policy samples the image token's id too, as
  an answer: text, never an image, on both sides."""
  from grpo_jax import config as config_lib
  from grpo_jax.agents import task as agent_task
  from grpo_jax.agents.stage import AgentStage, EpisodeRows
  from grpo_jax.model.loading import init_model
  config = config_lib.load_config(SPOT_AGENT, ['rollout.prompts_per_step=8', 'algo.group_size=8'])
  task = agent_task.build(config)
  model = init_model(config.model.architecture, seed=3)
  graphdef, params = nnx.split(model)
  mesh = jax.tree.leaves(params)[0].sharding.mesh
  settings = DecodeSettings(sampling=SamplingConfig(temperature=1.0), max_new_tokens=config.rollout.max_new_tokens,
                            stop_token_ids=task.stop_token_ids, pad_id=task.pad_id)
  stage = AgentStage(graphdef, task, settings, slots=32, mesh=mesh, rows=EpisodeRows.of(config))
  key = jax.random.key(7)
  prompts = stage.prompts(key, 0, 8)
  rollout, _ = stage.act(params, prompts, key, 8)
  width = prompts.tokens.shape[1]
  mask, vision = np.asarray(rollout.mask), rollout.vision
  assert (np.asarray(vision.images.placement)[:, width:] >= 0).sum() == 2 * 4 * 64  # two images an episode
  assert (np.asarray(rollout.tokens)[mask] == IMAGE_SPOT).any()  # the policy answered with the image token
  assert_update_log_probs(model, np.repeat(prompts.tokens, 8, axis=0), np.repeat(prompts.mask, 8, axis=0), rollout,
                          atol=2e-5)


IMAGE_SPOT = 4  # the spot vocabulary's image token (data/spot.py)


def test_an_environment_showing_images_the_run_does_not_take_is_one_line():
  """An Observation with images on a run without task.max_images, and one with more image markers
  than images, each answer in one line naming the environment."""
  from grpo_jax.agents.agent import EnvironmentAgent
  from grpo_jax.agents.spot import Spot

  environment = Spot(np.random.default_rng(0), 2, 16, False)
  agent = EnvironmentAgent(make_environment=None)
  with pytest.raises(UserError, match=r'environment grpo_jax\.agents\.spot\.Spot: reset\(\) showed 1 images, but '
                                      r'the run takes none: set task\.max_images'):
    agent.observation(environment, 'reset()', environment.show(), None, 11)


@pytest.mark.exhaustive
def test_image_agent_steps_on_a_mesh_equal_one_device(tmp_path):
  """Two RL steps of the image environment on fsdp 2 x tensor 2 (the server's weights in tensor
  groups, the update's images and rows over the mesh) equal one device's: the episodes, rewards,
  losses and parameters."""
  from test_mesh_equivalence import assert_equal_runs, two_steps
  overrides = ['rollout.prompts_per_step=8', 'algo.group_size=4', 'optim.learning_rate=1e-4']
  reference = two_steps(tmp_path, SPOT_AGENT, overrides, (1, 1, 1))
  assert_equal_runs(reference, two_steps(tmp_path, SPOT_AGENT, overrides, (1, 2, 2)))


@pytest.mark.exhaustive
@pytest.mark.long
def test_the_image_environment_demo_learns_only_when_it_can_see(tmp_path):
  """configs/tiny_spot_agent.yaml, its first 160 of 450 steps: the policy learns the quadrants from
  the images its environment shows (turn after turn; seed 0 here: 0.10 over the first 10 steps,
  0.68 over steps 151-160, 0.91 by step 200), and the same run on blank images, its first 80 steps,
  stays at chance (at most 1/4 in expectation; 0.24-0.26 from step 40 on)."""
  common = ('train.progress=false', 'train.tensorboard=false', 'train.checkpoint_every=0')
  seen = train_here(tmp_path / 'seen', SPOT_AGENT, 'train.steps=160', *common)
  blank = train_here(tmp_path / 'blank', SPOT_AGENT, 'task.blank_images=true', 'train.steps=80', *common)
  last = lambda rows: float(np.mean([row['reward_mean'] for row in rows[-10:]]))  # noqa: E731
  assert last(seen) > 0.35, last(seen)
  assert last(blank) < 0.3, last(blank)
  assert max(row['sampler_gap_max'] for row in seen) < 1e-4
