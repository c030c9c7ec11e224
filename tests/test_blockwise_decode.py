"""Decode attention that reads only the written part of the KV cache (model.decode_attention =
'blockwise'): equal to the dense path for random fill levels, never reading blocks past the
fullest row, and the sampler's completions unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model import ModelOptions, from_pretrained
from grpo_jax.model.attention import blockwise_cache_attention, grouped_attention
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts


def random_case(rng, batch, length, slots, heads, kv_heads, head_dim, lengths):
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q = normal(batch, length, heads, head_dim)
  k_cache, v_cache = normal(batch, slots, kv_heads, head_dim), normal(batch, slots, kv_heads, head_dim)
  # Written slots carry a random segment (as a row's prompt padding would); the query's is 1.
  key_segments = rng.integers(0, 2, (batch, slots)) * (np.arange(slots)[None] < lengths[:, None])
  cache_mask = jnp.asarray(np.broadcast_to((key_segments == 1)[:, None, :], (batch, length, slots)))
  new_k, new_v = normal(batch, length, kv_heads, head_dim), normal(batch, length, kv_heads, head_dim)
  causal = jnp.asarray(np.tril(np.ones((length, length), bool))[None].repeat(batch, 0))
  prompt_k, prompt_v = normal(batch, 7, kv_heads, head_dim), normal(batch, 7, kv_heads, head_dim)
  prompt_mask = jnp.asarray(rng.integers(0, 2, (batch, length, 7)).astype(bool))
  parts = [(new_k, new_v, causal), (prompt_k, prompt_v, prompt_mask)]
  return q, parts, k_cache, v_cache, cache_mask


@pytest.mark.parametrize('length, heads, kv_heads, block', [(1, 4, 2, 16), (3, 14, 2, 16), (1, 4, 2, 24)])
def test_blockwise_equals_dense_for_random_fill_levels(seed, length, heads, kv_heads, block):
  rng = np.random.default_rng(seed)
  slots = 64
  lengths = np.asarray([0, 1, 17, 33, 64, 40])  # empty, one slot, past a block edge, full
  q, parts, k_cache, v_cache, cache_mask = random_case(rng, 6, length, slots, heads, kv_heads, 16, lengths)
  expected = grouped_attention(q, [parts[1], (k_cache, v_cache, cache_mask), parts[0]])
  got = jax.jit(blockwise_cache_attention, static_argnums=6)(q, parts, k_cache, v_cache, cache_mask,
                                                             jnp.asarray(lengths, jnp.int32), block)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_blocks_past_the_fullest_row_are_never_read(seed):
  """NaN in every block past the fullest row's length: a block read there would poison the
  output (0 x NaN), so an output equal to the dense one on clean data shows they were skipped."""
  rng = np.random.default_rng(seed)
  slots, block = 256, 16
  lengths = np.asarray([5, 30, 0, 19])  # the fullest row ends inside block 1 (slots 16..31)
  q, parts, k_cache, v_cache, cache_mask = random_case(rng, 4, 1, slots, 4, 2, 16, lengths)
  expected = grouped_attention(q, [parts[1], (k_cache, v_cache, cache_mask), parts[0]])
  poisoned = [cache.at[:, 32:].set(jnp.nan) for cache in (k_cache, v_cache)]
  got = blockwise_cache_attention(q, parts, *poisoned, cache_mask, jnp.asarray(lengths, jnp.int32), block)
  np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.exhaustive
@pytest.mark.parametrize('slots, architecture', [(0, {}), (3, {}), (3, dict(model_type='qwen3', head_dim=24))],
                         ids=['qwen2-groups', 'qwen2-slots', 'qwen3-slots'])
def test_the_sampler_with_blockwise_and_kernel_decode_attention_equals_dense(seed, make_hf_checkpoint, slots,
                                                                             architecture):
  directory, _ = make_hf_checkpoint(seed, **architecture)
  tokens, mask = left_padded(random_prompts(seed, [5, 17, 11]))
  settings = DecodeSettings(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0),
                            stop_token_ids=tuple(range(0, 1000, 25)))
  rollouts = {}
  # The ragged Pallas kernel (interpreted here, TPU schedule) takes blocks of 128 slots or the whole row.
  for implementation, block in (('dense', 4), ('blockwise', 4), ('pallas', 128)):
    model = from_pretrained(directory, options=ModelOptions(decode_attention=implementation, decode_block=block))
    sampler = GroupSampler(model, group_size=2, settings=settings, slots=slots)
    rollouts[implementation] = sampler(nnx.state(model), tokens, mask, jax.random.key(seed % 1000))
  dense = rollouts['dense']
  for implementation in ('blockwise', 'pallas'):
    other = rollouts[implementation]
    for name in ('tokens', 'mask', 'lengths', 'stopped'):
      np.testing.assert_array_equal(np.asarray(getattr(other, name)), np.asarray(getattr(dense, name)),
                                    f'{implementation}: {name}')
    np.testing.assert_allclose(np.asarray(other.log_probs), np.asarray(dense.log_probs), rtol=1e-5, atol=1e-5,
                               err_msg=implementation)


@pytest.mark.exhaustive
def test_the_sampler_with_the_whole_attention_in_the_gpu_kernel_equals_dense(seed, make_hf_checkpoint, monkeypatch):
  """'pallas' decode attention as it runs on a GPU (the Mosaic GPU schedule, interpreted here), its
  layers unrolled: each layer writes its new keys and values into its cache row before it attends,
  and one kernel reads the row's shared prompt in place (prompts of at least a 64-slot block), then
  its cache, and ends the softmax. The group sampler's completions equal dense attention's, token
  for token, and their log-probs to 1e-5; every layer of every call took that path."""
  from grpo_jax.ops import decode_attention

  directory, _ = make_hf_checkpoint(seed)
  tokens, mask = left_padded(random_prompts(seed, [70, 64]))
  settings = DecodeSettings(max_new_tokens=64, sampling=SamplingConfig(temperature=1.0),
                            stop_token_ids=tuple(range(0, 1000, 5)))  # short answers: the interpreter is slow
  calls = []
  kernel = decode_attention.ragged_decode_attention

  def recorded(q, initial, *args, prompt=None, **kwargs):
    calls.append((q.shape[1], initial is None, prompt is not None))
    return kernel(q, initial, *args, prompt=prompt, **kwargs)
  monkeypatch.setattr(decode_attention, 'ragged_decode_attention', recorded)
  rollouts = {}
  for implementation, block in (('dense', 4), ('pallas', 64)):
    model = from_pretrained(directory, options=ModelOptions(decode_attention=implementation, decode_block=block,
                                                            decode_layers='unrolled'))
    sampler = GroupSampler(model, group_size=2, settings=settings)
    with decode_attention.scheduled('mosaic_gpu'):
      rollouts[implementation] = sampler(nnx.state(model), tokens, mask, jax.random.key(seed % 1000))
  layers = model.config.num_hidden_layers
  # The decode step traced once (the prefill before it runs the kernel from the prompt's own statistics):
  # each layer's new token written first, its prompt read in place.
  assert [call for call in calls if call[0] == 1] == [(1, True, True)] * layers
  dense, kernel_run = rollouts['dense'], rollouts['pallas']
  for name in ('tokens', 'mask', 'lengths', 'stopped'):
    np.testing.assert_array_equal(np.asarray(getattr(kernel_run, name)), np.asarray(getattr(dense, name)), name)
  np.testing.assert_allclose(np.asarray(kernel_run.log_probs), np.asarray(dense.log_probs), rtol=1e-5, atol=1e-5)
