"""The sampler's cache keeps only a sliding-window layer's window (model/cache.py WindowCache).

A local layer of Gemma 3 or a Mistral with `sliding_window` never attends further back than its
window, so the decode slots keep a ring of W entries per row for it instead of the whole answer.
Decoding over the ring must equal transformers on rows that run well past the window: prompts
left-padded, chunks longer than the window written at once, one token at a time after, a layer
loop over one stack or one array per layer; the slots' ring is cleared between requests and the
pool's carried answers are prefilled into it again (tests/test_slot_isolation.py,
tests/test_partial.py run those paths on a windowed model too).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import torch_logits
from test_families import FAMILIES
from grpo_jax.model import ModelOptions, from_pretrained
from grpo_jax.plan.report import kv_cache_bytes_per_device
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts

TOLERANCE = 1e-4


@pytest.mark.parametrize('family, layers', [('gemma3_text', 'scan'),
                                            pytest.param('mistral', 'unrolled', marks=pytest.mark.exhaustive)])
def test_decoding_over_the_window_ring_equals_transformers(seed, make_hf_checkpoint, family, layers):
  """Gemma 3 (local and global layers: two stacks) and Mistral (every layer slides: no full-
  attention stack at all). Rows of 4 + 30 tokens through a window of 6 or 7."""
  directory, reference = make_hf_checkpoint(seed, **FAMILIES[family][0])
  model = from_pretrained(directory, options=ModelOptions(decode_layers=layers))
  config = model.config
  window, sliding = config.sliding_window, np.asarray(config.sliding_layers)
  rng = np.random.default_rng(seed)
  lengths, width, chunks = [4, 2, 3], 4, [3, window + 4, 1, 1, 1, window - 1, 1, 1, 1, 1, 1, 1]
  total = width + sum(chunks)
  sequences = [rng.integers(0, config.vocab_size, n + sum(chunks), dtype=np.int32) for n in lengths]
  prompts, mask = np.zeros((3, width), np.int32), np.zeros((3, width), np.int32)
  for row, n in enumerate(lengths):
    prompts[row, width - n:], mask[row, width - n:] = sequences[row][:n], 1

  graphdef, state = nnx.split(model)
  extend = jax.jit(lambda state, tokens, cache, segment_ids: nnx.merge(graphdef, state).extend(
      tokens, cache, segment_ids=segment_ids))
  cache = model.init_cache(3, total, layered=model.layered_decode_cache, windowed=True)
  # The local layers' rows are W entries, not S; the global layers keep every slot.
  assert cache.window.size == window and cache.segment_ids.shape == (3, total)
  full_layers = int((~sliding).sum())
  assert (len(cache.window.k) if cache.layered else cache.window.k.shape[0]) == int(sliding.sum())
  assert (len(cache.k) if cache.layered else cache.k.shape[0]) == full_layers
  logits, cache = extend(state, prompts, cache, mask)
  got = [[np.asarray(logits[row, width - n:])] for row, n in enumerate(lengths)]
  at = 0
  for chunk in chunks:
    tokens = np.stack([s[n + at:n + at + chunk] for s, n in zip(sequences, lengths)])
    logits, cache = extend(state, tokens, cache, np.ones_like(tokens))
    for row in range(3):
      got[row].append(np.asarray(logits[row]))
    at += chunk
  # The ring holds each row's last W tokens, by ordinal.
  ordinals = np.sort(np.asarray(cache.window.ordinals), axis=1)
  for row, n in enumerate(lengths):
    np.testing.assert_array_equal(ordinals[row], np.arange(n + at - window, n + at))
    want = torch_logits(reference, sequences[row][None])[0]
    np.testing.assert_allclose(np.concatenate(got[row]), want, rtol=0, atol=TOLERANCE, err_msg=f'row {row}')


def test_the_plan_counts_the_window(seed, make_hf_checkpoint):
  """The plan's KV cache figure: the slots' rows of a local layer at the window, not the answer."""
  from grpo_jax import config as config_lib
  from grpo_jax.model import MeshConfig, make_mesh
  directory, _ = make_hf_checkpoint(seed, **FAMILIES['gemma3_text'][0])
  architecture = from_pretrained(directory).config
  config = config_lib.Config()
  config = dataclasses.replace(
      config, rollout=dataclasses.replace(config.rollout, max_new_tokens=30, prompts_per_step=2),
      algo=dataclasses.replace(config.algo, group_size=4),
      model=dataclasses.replace(config.model, options=ModelOptions(dtype='float32')))
  mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  heads, layers = architecture.num_key_value_heads * architecture.resolved_head_dim, architecture.num_hidden_layers
  local, window = sum(architecture.sliding_layers), architecture.sliding_window
  # K and V, fp32: 2 prompts of 8 tokens in every layer; 8 slots of 30 tokens, 6 in a local layer.
  want = 2 * 4 * heads * (2 * 8 * layers + 8 * ((layers - local) * 30 + local * window))
  assert local and window < 30
  assert kv_cache_bytes_per_device(architecture, config, 8, mesh) == want


def test_a_slot_clears_its_ring_between_requests(seed, make_hf_checkpoint):
  """One slot taking four requests in turn samples what four slots at once do (each request draws
  from its own key). The prompts are chosen so that each later request starts within a window
  of where the one before it in the slot ended: an entry left in the ring would be read."""
  directory, _ = make_hf_checkpoint(seed, **FAMILIES['gemma3_text'][0])
  model = from_pretrained(directory)
  steps = 12
  tokens, mask = left_padded(random_prompts(seed, [3, steps + 4, 2, steps + 3]))
  settings = DecodeSettings(max_new_tokens=steps, sampling=SamplingConfig(temperature=1.0))
  key = jax.random.key(seed % 1000)
  one, four = (jax.device_get(GroupSampler(model, group_size=1, settings=settings, slots=slots)(
      nnx.state(model), tokens, mask, key)) for slots in (1, 4))
  assert (np.asarray(one.lengths) == steps).all()  # no stop: every answer runs its whole budget
  np.testing.assert_array_equal(one.tokens, four.tokens)
  np.testing.assert_allclose(one.log_probs, four.log_probs, rtol=0, atol=1e-5)
