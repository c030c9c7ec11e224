"""A prefill split over context: model.extend of prompts on an empty cache under a mesh with a
context axis runs them split along their length (ring attention, Qwen2.sequence_pass keeping every
layer's keys and values), against one device: the cache and the hidden states decoding continues
from; and the sampler's (rollout.prefill_context): whole rollouts in its own layout against the
unsplit prefill, its mesh, and the one-line refusals."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.errors import UserError
from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.sampler.decode import DecodeSettings, prefill
from grpo_jax.sampler.layout import rollout_layout
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.sampler.sampling import SamplingConfig
from grpo_jax.testing import left_padded, random_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


def _prompts(seed, lengths=(29, 7, 18, 3)):
  tokens, mask = left_padded(random_prompts(seed, list(lengths), vocab=VOCAB))
  return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32)


@pytest.mark.parametrize('context', [2, pytest.param(4, marks=pytest.mark.exhaustive)])
def test_a_prefill_split_over_context_equals_one_device(seed, make_hf_checkpoint, context):
  """model.extend of left-padded prompts (29 tokens, a width the ring pads to 2c chunks) on an empty
  cache under a mesh with a context axis: every real slot's keys and values and each prompt's last
  hidden state equal one device's (fp32, 1e-5), and the program passes blocks round the ring
  (collective permutes)."""
  directory, _ = make_hf_checkpoint(seed, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
  tokens, mask = _prompts(seed)
  model = from_pretrained(directory)
  reference = prefill(model, tokens, mask, model.init_cache(*tokens.shape))
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, context=context), devices=jax.devices()[:context])
  graphdef, state = nnx.split(from_pretrained(directory, mesh=mesh))
  run = jax.jit(lambda state, tokens, mask: prefill(nnx.merge(graphdef, state), tokens, mask,
                                                    nnx.merge(graphdef, state).init_cache(*tokens.shape)))
  with jax.set_mesh(mesh):
    split = run(state, tokens, mask)
    hlo = run.lower(state, tokens, mask).compile().as_text()
  assert 'collective-permute' in hlo
  real = np.asarray(mask) != 0
  for name in ('k', 'v'):
    np.testing.assert_allclose(np.asarray(getattr(split.cache, name))[:, real],
                               np.asarray(getattr(reference.cache, name))[:, real], rtol=1e-5, atol=1e-5, err_msg=name)
  np.testing.assert_allclose(np.asarray(split.hidden), np.asarray(reference.hidden), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(split.cache.length), np.asarray(reference.cache.length))


@pytest.mark.exhaustive
def test_a_ring_that_does_not_pass_its_blocks_differs(seed, make_hf_checkpoint, monkeypatch):
  """The check above can fail: with the permutes made identities (every device attends its own
  block c times), the prefill's hidden states differ from one device's."""
  from grpo_jax.model import ring_attention
  directory, _ = make_hf_checkpoint(seed, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
  tokens, mask = _prompts(seed)
  model = from_pretrained(directory)
  reference = prefill(model, tokens, mask, model.init_cache(*tokens.shape))
  monkeypatch.setattr(ring_attention.jax.lax, 'ppermute', lambda x, axis_name, perm: x)
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, context=2), devices=jax.devices()[:2])
  graphdef, state = nnx.split(from_pretrained(directory, mesh=mesh))
  with jax.set_mesh(mesh):
    split = jax.jit(lambda state: prefill(nnx.merge(graphdef, state), tokens, mask,
                                          nnx.merge(graphdef, state).init_cache(*tokens.shape)))(state)
  assert np.abs(np.asarray(split.hidden) - np.asarray(reference.hidden)).max() > 1e-3


@pytest.mark.parametrize('source_shape, tensor', [(dict(data=1, fsdp=4), 1),
                                                  pytest.param(dict(data=2, fsdp=4), 2, marks=pytest.mark.exhaustive)])
def test_rollouts_with_the_prefill_split_equal_the_unsplit_ones(seed, make_hf_checkpoint, source_shape, tensor):
  """The sampler's own layout (4 data groups of the trainer's devices): with rollout.prefill_context 2
  each prompt is prefilled split along its length over 2 groups' devices (the program passes blocks
  round the ring) and its cache then moved to its rows' group; greedy and sampled rollouts give the
  same tokens, and log-probs to 1e-5, as with every prompt prefilled whole on its own group."""
  directory, _ = make_hf_checkpoint(seed, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
  tokens, mask = _prompts(seed)
  source = make_mesh(MeshConfig(tensor=1, **source_shape), devices=jax.devices()[:math.prod(source_shape.values())])
  model = from_pretrained(directory, mesh=source)
  for sampling in (SamplingConfig(greedy=True), SamplingConfig(temperature=1.0)):
    rollouts = []
    for context in (1, 2):
      layout = rollout_layout(model, source, tensor=tensor, context=context)
      settings = DecodeSettings(max_new_tokens=6, sampling=sampling)
      sampler = GroupSampler(model, group_size=2, settings=settings, layout=layout)
      key = jax.random.key(seed % 1000)
      with jax.set_mesh(source):
        rollouts.append(jax.device_get(sampler(nnx.state(model), tokens, mask, key)))
        if context > 1 and sampling.greedy:
          assert 'collective-permute' in sampler._run.lower(nnx.state(model), tokens, mask, key).compile().as_text()
    plain, split = rollouts
    np.testing.assert_array_equal(split.tokens, plain.tokens)
    np.testing.assert_allclose(split.log_probs, plain.log_probs, rtol=1e-5, atol=1e-5)


def test_the_sampler_mesh_with_a_context_axis_keeps_the_devices_and_their_tensor_groups():
  """rollout.prefill_context 2 on 8 devices of tensor 2: the sampler's mesh holds them in the
  trainer's order as 2 data groups x 2 along context, each tensor group the same two devices as
  without it; its decoding counts all 4 groups; a context that does not divide the groups, or with
  a mixture of experts, is one line naming the field."""
  source = make_mesh(MeshConfig(data=8, fsdp=1, tensor=1))
  plain, split = (rollout_layout(_tiny_model(), source, tensor=2, context=c) for c in (1, 2))
  assert dict(split.mesh.shape) == dict(data=2, context=2, fsdp=1, tensor=2, expert=1)
  assert list(split.mesh.devices.reshape(-1)) == list(plain.mesh.devices.reshape(-1))
  tensor_groups = lambda m: sorted(tuple(d.id for d in row) for row in np.asarray(m.devices).reshape(-1, 2))  # noqa: E731
  assert tensor_groups(split.mesh) == tensor_groups(plain.mesh)
  assert split.data_groups == plain.data_groups == 4
  with pytest.raises(UserError, match=r"^rollout\.prefill_context=3 must divide the sampler's 4 data groups") as error:
    rollout_layout(_tiny_model(), source, tensor=2, context=3)
  assert '\n' not in str(error.value)
  with pytest.raises(UserError, match=r'^rollout\.prefill_context=2 splits the sampler\'s data groups; a mixture'):
    rollout_layout(_tiny_model(num_experts=4), source, tensor=2, context=2)


def _tiny_model(**extra):
  from grpo_jax.model import Qwen2Config, init_model
  if extra:
    extra = dict(moe_intermediate_size=16, num_experts_per_tok=2, qk_norm=True, **extra)
  return init_model(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, **extra))


@pytest.mark.parametrize('overrides, pattern', [
    (['rollout.prefill_context=0'], r'^rollout\.prefill_context must be >= 1, got 0'),
    (['rollout.prefill_context=2', 'algo.exact_on_policy=true'], r'^rollout\.prefill_context \(2\): ring attention'),
])
def test_bad_prefill_context_is_one_line(overrides, pattern):
  with pytest.raises(UserError, match=pattern) as error:
    config_lib.load_config(os.path.join(ROOT, 'configs', 'tiny_arith.yaml'), overrides)
  assert '\n' not in str(error.value)
