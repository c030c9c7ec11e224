"""A prefill split over context: model.extend of prompts on an empty cache under a mesh with a
context axis runs them split along their length (ring attention, Qwen2.sequence_pass keeping every
layer's keys and values), against one device: the cache and the hidden states decoding continues
from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.sampler.decode import prefill
from grpo_jax.testing import left_padded, random_prompts

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
