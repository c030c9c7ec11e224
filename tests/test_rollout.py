"""The group sampler against transformers' greedy generate and the model's own forward pass."""

import jax
import numpy as np
import pytest
import torch
from flax import nnx

from grpo_jax.model import ModelOptions, from_pretrained
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts

GREEDY = SamplingConfig(greedy=True)


@pytest.mark.parametrize('architecture', [dict(), dict(model_type='qwen3', head_dim=24),
                                          dict(model_type='qwen3_moe', head_dim=16, num_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=24, norm_topk_prob=True, tie_word_embeddings=True)],
                         ids=['qwen2', 'qwen3', 'qwen3-moe'])
# 'unrolled': one copy of the layer per index in the decode loop, each reading its own piece of the
# cut stack (Qwen2.loop_view) and its own layer of the cache (KVCache.layered), as the GPU default
# runs it, here with each prompt read once for its rows; 'scan' is the CPU's and TPU's.
@pytest.mark.parametrize('decode_layers', ['scan', pytest.param('unrolled', marks=pytest.mark.exhaustive)])
def test_greedy_matches_transformers_generate(seed, make_hf_checkpoint, architecture, decode_layers):
  directory, reference = make_hf_checkpoint(seed, **architecture)
  model = from_pretrained(directory, options=ModelOptions(
      decode_layers=decode_layers, prompt_reads='once' if decode_layers == 'unrolled' else 'copy'))
  prompts = random_prompts(seed, [5, 17, 11])
  tokens, mask = left_padded(prompts)
  rollout = GroupSampler(model, group_size=1, settings=DecodeSettings(max_new_tokens=16, sampling=GREEDY))(
      nnx.state(model), tokens, mask, jax.random.key(0))
  with torch.no_grad():
    expected = reference.generate(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                                  do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None)
  np.testing.assert_array_equal(np.asarray(rollout.tokens), expected[:, tokens.shape[1]:].numpy())
  assert np.asarray(rollout.mask).all() and not np.asarray(rollout.stopped).any()


def test_groups_share_one_prefill_and_equal_separate_prefills(seed, make_hf_checkpoint):
  """G greedy samples of a prompt equal one another and the result of prefilling it alone, the
  prompt's keys read once for the G rows (ModelOptions.prompt_reads)."""
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory, options=ModelOptions(prompt_reads='once'))
  prompts = random_prompts(seed, [9, 4])
  tokens, mask = left_padded(prompts)
  grouped = GroupSampler(model, group_size=3, settings=DecodeSettings(max_new_tokens=8, sampling=GREEDY))(
      nnx.state(model), tokens, mask, jax.random.key(0))
  for index, prompt in enumerate(prompts):
    alone = GroupSampler(model, group_size=1, settings=DecodeSettings(max_new_tokens=8, sampling=GREEDY))(
        nnx.state(model), np.asarray([prompt], np.int32), np.ones((1, len(prompt)), np.int32), jax.random.key(0))
    for g in range(3):
      np.testing.assert_array_equal(np.asarray(grouped.tokens[index * 3 + g]), np.asarray(alone.tokens[0]))


def test_sampler_log_probs_equal_full_forward(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  prompts = random_prompts(seed, [6, 13])
  tokens, mask = left_padded(prompts)
  sampling = SamplingConfig(temperature=0.8, top_k=50)
  rollout = GroupSampler(model, group_size=2, settings=DecodeSettings(max_new_tokens=10, sampling=sampling))(
      nnx.state(model), tokens, mask, jax.random.key(seed))
  for row in range(4):
    prompt = prompts[row // 2]
    completion = np.asarray(rollout.tokens[row])
    full = np.asarray([prompt + completion.tolist()], np.int32)
    logits = np.asarray(model(full))[0, len(prompt) - 1:-1] / 0.8
    log_softmax = logits - logits.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_softmax, completion[:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(np.asarray(rollout.log_probs[row]), expected, rtol=0, atol=1e-4)


@pytest.mark.exhaustive
def test_stop_tokens_end_rows_and_seeds_reproduce(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  tokens, mask = left_padded(random_prompts(seed, [7, 12]))
  state = nnx.state(model)
  free = GroupSampler(model, group_size=1, settings=DecodeSettings(max_new_tokens=12, sampling=GREEDY))(
      state, tokens, mask, jax.random.key(0))
  stop = int(free.tokens[0, 3])
  first_stop = [int(np.argmax(np.asarray(free.tokens[r]) == stop)) if stop in np.asarray(free.tokens[r]) else None
                for r in range(2)]
  stopped = GroupSampler(model, group_size=1, settings=DecodeSettings(
      max_new_tokens=12, sampling=GREEDY, stop_token_ids=(stop,), pad_id=-1))(state, tokens, mask, jax.random.key(0))
  for row in range(2):
    end = first_stop[row]
    if end is None:
      assert not bool(stopped.stopped[row]) and int(stopped.lengths[row]) == 12
      continue
    assert bool(stopped.stopped[row]) and int(stopped.lengths[row]) == end + 1
    np.testing.assert_array_equal(np.asarray(stopped.tokens[row, :end + 1]), np.asarray(free.tokens[row, :end + 1]))
    assert (np.asarray(stopped.tokens[row, end + 1:]) == -1).all()
    assert not np.asarray(stopped.mask[row, end + 1:]).any() and (np.asarray(stopped.log_probs[row, end + 1:]) == 0).all()

  sampler = GroupSampler(model, group_size=4,
                         settings=DecodeSettings(max_new_tokens=6, sampling=SamplingConfig(temperature=1.0)))
  a = sampler(state, tokens, mask, jax.random.key(seed))
  b = sampler(state, tokens, mask, jax.random.key(seed))
  c = sampler(state, tokens, mask, jax.random.key(seed + 1))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
