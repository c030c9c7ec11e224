"""Continuous batching in the jitted sampler: R = P x G requests through B decode slots give the
same completions for every B (each request draws from its own key), in request order, on one
device and on a mesh; a freed slot takes the next request at once."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts, seed_with_split_answers

FIELDS = ('tokens', 'log_probs', 'mask', 'lengths', 'stopped')


def settings(seed: int, sampling: SamplingConfig, steps: int = 20) -> DecodeSettings:
  # A tenth of the vocabulary stops a completion: lengths spread from 1 token to the budget.
  stops = tuple(int(t) for t in np.random.default_rng(seed).choice(1000, 100, replace=False))
  return DecodeSettings(max_new_tokens=steps, sampling=sampling, stop_token_ids=stops, pad_id=0)


def sample(model, tokens, mask, decode, slots, group_size=4, key=None):
  sampler = GroupSampler(model, group_size=group_size, settings=decode, slots=slots)
  return sampler(nnx.state(model), tokens, mask, key if key is not None else jax.random.key(7))


@pytest.mark.parametrize('sampling', [
    pytest.param(SamplingConfig(greedy=True), id='greedy'),
    pytest.param(SamplingConfig(temperature=1.0), id='t1', marks=pytest.mark.exhaustive),
    pytest.param(SamplingConfig(temperature=0.7, top_p=0.9), id='top_p', marks=pytest.mark.exhaustive)])
def test_every_slot_count_gives_the_same_completions(seed, make_hf_checkpoint, sampling):
  def load(seed):
    model = from_pretrained(make_hf_checkpoint(seed)[0])
    return model, left_padded(random_prompts(seed, [5, 17, 11, 3]))

  if sampling.greedy:  # the G samples of a prompt are one answer: stop on a token only some answers hold
    def greedy_answers(seed):
      model, (tokens, mask) = load(seed)
      free = sample(model, tokens, mask, DecodeSettings(max_new_tokens=20, sampling=sampling), 0)
      return np.asarray(free.tokens), (model, (tokens, mask))

    seed, stop, (model, (tokens, mask)) = seed_with_split_answers(seed, greedy_answers)
    decode = dataclasses.replace(settings(seed, sampling), stop_token_ids=(stop,))
  else:
    model, (tokens, mask) = load(seed)
    decode = settings(seed, sampling)
  fixed = sample(model, tokens, mask, decode, slots=0)  # one slot per request: 16
  lengths = np.asarray(fixed.lengths)
  assert lengths.min() < lengths.max()  # a long tail to refill around
  for slots in (4, 3, 1):
    continuous = sample(model, tokens, mask, decode, slots=slots)
    for name in ('tokens', 'mask', 'lengths', 'stopped'):
      np.testing.assert_array_equal(np.asarray(getattr(continuous, name)), np.asarray(getattr(fixed, name)),
                                    err_msg=f'{name}, {slots} slots')
    # The logits of B rows come from a [B, D] x [D, V] product whose blocking (so its summation
    # order) XLA picks by B: log-probs agree to an ulp or two of fp32, not bit for bit.
    np.testing.assert_allclose(np.asarray(continuous.log_probs), np.asarray(fixed.log_probs), rtol=1e-6, atol=1e-6,
                               err_msg=f'log_probs, {slots} slots')
    # Each freed slot takes the next request in the same iteration: the loop runs at most the
    # tokens of its busiest slot, and never fewer iterations than a perfect packing needs.
    steps = int(continuous.decode_steps)
    assert lengths.sum() / slots <= steps <= lengths.sum() + len(lengths)
  assert int(fixed.decode_steps) in (lengths.max(), lengths.max() + 1)


def test_one_slot_serves_requests_one_after_another(seed, make_hf_checkpoint):
  """With one slot the requests run strictly in turn: exactly one iteration per emitted token,
  plus one per request whose last token was a stop (its slot frees only after emitting it)."""
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  tokens, mask = left_padded(random_prompts(seed + 1, [6, 9]))
  rollout = sample(model, tokens, mask, settings(seed, SamplingConfig(temperature=1.0), steps=12), slots=1,
                   group_size=3)
  assert int(rollout.decode_steps) == int(np.asarray(rollout.lengths).sum())


@pytest.mark.exhaustive
@pytest.mark.parametrize('architecture', [{}, dict(model_type='qwen3', head_dim=24)], ids=['qwen2', 'qwen3'])
def test_slots_on_a_mesh_equal_one_device(seed, make_hf_checkpoint, architecture):
  """On 8 devices, prompts, slots and requests split into groups over the batch axes, each group's
  slots serving only its own requests: the completions equal one device's."""
  directory, _ = make_hf_checkpoint(seed, **architecture)
  tokens, mask = left_padded(random_prompts(seed, [5, 17, 11, 3, 8, 2, 14, 6]))
  decode = settings(seed, SamplingConfig(temperature=1.0))
  reference = sample(from_pretrained(directory), tokens, mask, decode, slots=0, group_size=2)
  for shape in [(1, 8, 1), (2, 2, 2)]:
    mesh = make_mesh(MeshConfig(*shape))
    with jax.set_mesh(mesh):
      model = from_pretrained(directory, mesh=mesh)
      rollout = sample(model, tokens, mask, decode, slots=8, group_size=2)
    for name in FIELDS:
      np.testing.assert_allclose(np.asarray(getattr(rollout, name)), np.asarray(getattr(reference, name)),
                                 rtol=0, atol=1e-5, err_msg=f'{name} on {shape}')
