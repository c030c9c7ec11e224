"""LoRA on every rollout path, against the non-composed reference: the same model with each adapted
weight merged (W + s A B, model/lora.merged) and no adapters. With adapters drawn nonzero, the
group sampler (continuous batching), the pool of partial rollouts and the agents' inference server
(requests with images on a vision-language model) must sample what they sample from the merged model: the same tokens, log-probs to 1e-5
(tests/rollout_matrix.py's LoRA cells). Each case runs on one device and again with the adapted
model laid out on a mesh of its kind (fsdp x tensor, and the expert axis for a mixture) against the
merged model on one device."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model import MeshConfig, lora, make_mesh
from grpo_jax.model.lora import LoraConfig
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.decode import request_keys
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts
from test_lora import _adapted

# The kinds: their checkpoint's fields and the adapters (a mixture's on its attention: expert
# adapters are refused at build).
KINDS = {
    'dense': (dict(), ('q', 'k', 'v', 'o', 'gate', 'up', 'down')),
    'moe': ('top2-norm-tied', ('q', 'k', 'v', 'o')),
    'vl': (dict(model_type='qwen2_5_vl'), ('q', 'v', 'gate')),
}
# (data, fsdp, tensor, expert) over the 8 test devices.
MESHES = {'dense': (2, 2, 2, 1), 'moe': (1, 2, 2, 2), 'vl': (2, 2, 2, 1)}
CASES = [('group', 'dense'), ('group', 'moe'), ('group', 'vl'), ('partial', 'dense'), ('partial', 'moe'),
         ('partial', 'vl'), ('agents', 'dense'), ('agents', 'moe'), ('agents', 'vl')]
FAST = {('group', 'dense', 'one'), ('agents', 'dense', 'one')}
T1 = SamplingConfig(temperature=1.0)


def _models(seed, make_hf_checkpoint, kind, mesh=None):
  """(the adapted model, its merged twin) in fp32; with `mesh`, the adapted model laid out on it
  (the same adapters) and the merged twin on one device."""
  fields, targets = KINDS[kind]
  if isinstance(fields, str):
    from test_moe import CASES as MOE
    fields = MOE[fields]
  directory, _ = make_hf_checkpoint(seed, **fields)
  settings = LoraConfig(rank=4, targets=targets)
  adapted = _adapted(directory, settings, seed)
  state = nnx.state(adapted)
  base = lora.merged(state, settings)
  twin = _adapted(directory, LoraConfig(rank=4, targets=targets), seed, randomise=False)
  graphdef = nnx.graphdef(twin)
  # The merged weights into the same graph with every adapter off (B = 0: x A 0 adds exact zeros).
  trainable, frozen = lora.split_trainable(nnx.state(twin))
  merged = nnx.merge(graphdef, lora.join(lora.adapters_off(trainable), base))
  assert not np.array_equal(np.asarray(nnx.state(merged)['layers']['q_weight'][...]),
                            np.asarray(state['layers']['q_weight'][...]))  # the adapters do change W
  if mesh is not None:
    with jax.set_mesh(mesh):
      adapted = _adapted(directory, settings, seed, mesh=mesh)
    assert adapted.layers.q_weight[...].sharding.mesh.shape == mesh.shape
  return adapted, merged


def _group(model, seed):
  tokens, mask = left_padded(random_prompts(seed, [5, 13, 2, 9]))
  settings = DecodeSettings(max_new_tokens=8, sampling=T1)
  return jax.device_get(GroupSampler(model, group_size=2, settings=settings, slots=3)(
      nnx.state(model), tokens, mask, jax.random.key(seed % 1000)))


def _group_vl(model, seed):
  from grpo_jax.model import vision
  from test_vision_model import image_batch
  tokens, mask, images = image_batch(np.random.default_rng(seed), model.config, [[(1, 4, 8)], [], [(1, 4, 4)]],
                                     [2, 7, 1])
  prompts = vision.vision_of(images, tokens, mask, model.config)
  settings = DecodeSettings(max_new_tokens=6, sampling=T1)
  return jax.device_get(GroupSampler(model, group_size=2, settings=settings, slots=3)(
      nnx.state(model), jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32), jax.random.key(seed % 1000),
      prompts))


def _partial(model, seed):
  from test_partial import Driver, decode_settings
  graphdef, params = nnx.split(model)
  driver = Driver(graphdef, prompts_per_step=3, group_size=2, max_lag=1, slots=4, settings=decode_settings(seed))
  driver.join(seed, 0)
  taken = []
  for step in range(3):
    driver.join(seed + 1 + step, step)
    taken.append(jax.device_get(driver.step(params, step).rollout))
  return taken


def _partial_vl(model, seed):
  """{source: its group's rollout} of the groups the image pool took over 3 steps. Which groups
  leave at a step depends on the mesh (each part of the batch axes takes its own), so the mesh run
  and the one-device run are compared group by group, on the groups both took."""
  from test_vision_rl import carry_image_prompts
  groups = {}
  for sources, rollout in carry_image_prompts(model, seed, steps=3):
    size = len(rollout.tokens) // len(sources)
    for index, source in enumerate(sources):
      groups[int(source)] = jax.tree.map(lambda x: x[index * size:(index + 1) * size] if np.ndim(x) else x, rollout)
  return groups


def _agents(model, seed):
  from test_agents import serve
  from grpo_jax.agents.inference import Request
  prompts = random_prompts(seed, [5, 13, 2, 9, 4])
  keys = request_keys(jax.random.key(seed % 1000), len(prompts))
  results, _ = serve(model, [Request(tokens=tuple(p), max_new_tokens=8, key=keys[i]) for i, p in enumerate(prompts)],
                     slots=2)
  return results


def _agents_vl(model, seed):
  """Requests with images (none, one, two) through the server of a vision-language model."""
  from test_agent_images import image
  from test_agents import serve
  from grpo_jax.agents.images import Placed
  from grpo_jax.agents.inference import Request
  from grpo_jax.model.vision import ImageBucket, patch_bucket
  rng, requests = np.random.default_rng(seed), []
  keys = request_keys(jax.random.key(seed % 1000), 3)
  for index, grids in enumerate([[(1, 4, 8)], [], [(1, 4, 4), (1, 2, 6)]]):
    tokens, shown = rng.integers(0, 900, 2).tolist(), []
    for grid in grids:
      (patches, _), block = image(rng, model.config, grid)
      shown.append(Placed(patches, grid, len(tokens) + 1))
      tokens += block + rng.integers(0, 900, 2).tolist()
    requests.append(Request(tokens=tuple(tokens), max_new_tokens=8, key=keys[index], images=tuple(shown)))
  results, _ = serve(model, requests, slots=2, images=ImageBucket(2, patch_bucket(32, model.config.vision)))
  return results


def _same(got, want):
  for name in ('tokens', 'lengths'):
    if hasattr(want, name):
      np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
  np.testing.assert_allclose(np.asarray(got.log_probs), np.asarray(want.log_probs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('path, kind, where', [
    pytest.param(*case, where, id='-'.join(case) + ('-mesh' if where == 'mesh' else ''),
                 marks=() if (*case, where) in FAST else pytest.mark.exhaustive)
    for case in CASES for where in ('one', 'mesh')
    # group-dense-mesh: test_lora.py's rollout layout test.
    if (*case, where) != ('group', 'dense', 'mesh')])
def test_lora_sampling_equals_the_merged_model(seed, make_hf_checkpoint, path, kind, where):
  mesh = make_mesh(MeshConfig(*MESHES[kind])) if where == 'mesh' else None
  adapted, merged = _models(seed, make_hf_checkpoint, kind, mesh)
  run = {'group': _group_vl if kind == 'vl' else _group, 'partial': _partial_vl if kind == 'vl' else _partial,
         'agents': _agents_vl if kind == 'vl' else _agents}[path]
  want = run(merged, seed)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    got = run(adapted, seed)
  if path == 'agents':
    for one, other in zip(got, want):
      assert one.tokens == other.tokens
      np.testing.assert_allclose(one.log_probs, other.log_probs, rtol=1e-5, atol=1e-5)
  elif path == 'partial' and kind == 'vl':
    both = sorted(set(got) & set(want))
    assert len(both) >= 4, (sorted(got), sorted(want))  # of the 6 each takes (8 prompts joined)
    for source in both:
      _same(got[source], want[source])
  elif path == 'partial':
    for one, other in zip(got, want):
      _same(one, other)
  else:
    _same(got, want)


def _naive_greedy(model, prompt, steps):
  """Greedy decoding by a full forward over the whole sequence at every step (no cache)."""
  sequence = list(prompt)
  forward = jax.jit(lambda tokens: nnx.merge(*nnx.split(model))(tokens)[0, -1])
  for _ in range(steps):
    sequence.append(int(np.argmax(np.asarray(forward(jnp.asarray([sequence]))))))
  return sequence[len(prompt):]


@pytest.mark.exhaustive
@pytest.mark.parametrize('kind', ['dense', 'moe', 'vl'])
@pytest.mark.long
def test_serve_decodes_a_lora_run_of_each_kind(tmp_path, kind, monkeypatch):
  """`serve --ckpt <a LoRA run's workdir>` of a dense model, a mixture (attention adapters, the
  experts over the expert axis) and a vision-language model (adapters in the decoder, the tower as
  trained), on the 8 test devices (tensor pairs) and on a host of one device: the engine's model
  gives the restored policy's logits, the adapters act (the base's differ), and the engine decodes
  (prefill, insert, generate through its slots) the greedy tokens a full forward per step of the
  restored policy gives, with its log-probs."""
  import os
  from engine_driver import generate_groups
  from runs import ROOT, one_local_device, train_here
  from test_engine import full_forward_log_probs
  from grpo_jax.checkpoint import locate
  from grpo_jax.restore import restore_policy
  from grpo_jax.serve import __main__ as serve
  from grpo_jax.testing import random_prompts
  from conversion.common import host_mesh
  config, targets = {'dense': ('tiny_arith_lora.yaml', '[q, k, v, o, gate, up, down]'),
                     'moe': ('tiny_arith_moe.yaml', '[q, v]'), 'vl': ('tiny_spot.yaml', '[q, v, gate]')}[kind]
  run = tmp_path / 'run'
  train_here(run, os.path.join(ROOT, 'configs', config), 'model.lora.rank=4', f'model.lora.targets={targets}',
             'train.steps=2', 'train.steps_per_call=1', 'train.checkpoint_every=2', 'optim.learning_rate=5e-2',
             'algo.entropy_coef=1.0', 'train.progress=false', 'train.tensorboard=false')
  graphdef, params, _, _ = restore_policy(*locate(str(run)), host_mesh())
  policy = nnx.merge(graphdef, params)
  vocab = policy.config.vocab_size
  tokens = np.random.default_rng(0).integers(0, vocab, (2, 9))
  ours = np.asarray(policy(tokens))
  trainable, frozen = lora.split_trainable(params)
  base = np.asarray(nnx.merge(graphdef, lora.join(lora.adapters_off(trainable), frozen))(tokens))
  assert np.abs(ours - base).max() > 1e-4  # the trained adapters act
  prompts = random_prompts(1, [4, 7, 3], vocab=vocab)
  greedy = [_naive_greedy(policy, prompt, 5) for prompt in prompts]
  expected_log_probs = full_forward_log_probs(policy, list(zip(prompts, greedy)))
  base_log_probs = full_forward_log_probs(nnx.merge(graphdef, lora.join(lora.adapters_off(trainable), frozen)),
                                          list(zip(prompts, greedy)))
  # The base gives these tokens other log-probs (0.06-0.6 apart here): a decode without the adapters fails.
  assert max(np.abs(a - b).max() for a, b in zip(base_log_probs, expected_log_probs)) > 1e-3
  for devices in (8, 1):
    if devices == 1:
      one_local_device(monkeypatch)
    engine, _ = serve.build_engine(serve.parse_args(['--ckpt', str(run), '--port', '0', '--token-ids-only',
                                                     '--dtype', 'float32', '--greedy', '--max-new-tokens', '5',
                                                     '--slots', '2', '--tensor', str(min(devices, 2))]))
    served = engine.load_params()
    assert len(jax.tree.leaves(served)[0].sharding.device_set) == devices
    np.testing.assert_allclose(np.asarray(engine._model(tokens)), ours, rtol=0, atol=1e-5)
    completions = generate_groups(engine, served, prompts)
    for row, want in enumerate(greedy):
      assert completions.tokens[row].tolist() == want, (devices, row)
      np.testing.assert_allclose(completions.log_probs[row], expected_log_probs[row], atol=1e-5)
