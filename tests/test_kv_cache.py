"""Prefill + one-token decode steps through the KV cache equal the full forward pass."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import torch_logits
from grpo_jax.model import ModelOptions, from_pretrained

TOLERANCE = 1e-4


def jitted_extend(model):
  graphdef, state = nnx.split(model)

  @jax.jit
  def extend(state, tokens, cache, segment_ids):
    return nnx.merge(graphdef, state).extend(tokens, cache, segment_ids=segment_ids)

  return lambda tokens, cache, segment_ids=None: extend(state, tokens, cache, segment_ids)


@pytest.mark.parametrize('scan_layers', [True, False])
def test_prefill_then_decode_matches_full_forward(seed, make_hf_checkpoint, scan_layers):
  """Left-padded prompts of different lengths, then N decode steps, against transformers."""
  directory, reference = make_hf_checkpoint(seed, num_key_value_heads=1)
  model = from_pretrained(directory, options=ModelOptions(scan_layers=scan_layers))
  extend = jitted_extend(model)
  rng = np.random.default_rng(seed)
  prompt_lengths, width, steps = [9, 23, 16], 24, 12
  sequences = [rng.integers(0, 1000, n + steps, dtype=np.int32) for n in prompt_lengths]
  prompts = np.zeros((3, width), np.int32)
  mask = np.zeros((3, width), np.int32)
  for row, n in enumerate(prompt_lengths):
    prompts[row, width - n:] = sequences[row][:n]
    mask[row, width - n:] = 1

  cache = model.init_cache(batch_size=3, max_length=width + steps)
  prefill_logits, cache = extend(prompts, cache, mask)
  decoded = []
  for step in range(steps):
    token = np.array([[s[n + step]] for s, n in zip(sequences, prompt_lengths)], np.int32)
    logits, cache = extend(token, cache)
    decoded.append(np.asarray(logits[:, 0]))
  assert np.asarray(cache.length).tolist() == [width + steps] * 3

  for row, n in enumerate(prompt_lengths):
    expected = torch_logits(reference, sequences[row][None])[0]
    np.testing.assert_allclose(np.asarray(prefill_logits[row, width - n:]), expected[:n],
                               rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(np.stack([d[row] for d in decoded]), expected[n:],
                               rtol=0, atol=TOLERANCE)


@pytest.mark.exhaustive
def test_chunked_prefill_matches_single_prefill(seed, make_hf_checkpoint):
  """Extending a cache by several multi-token chunks equals one prefill of the whole prompt."""
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  extend = jitted_extend(model)
  tokens = np.random.default_rng(seed).integers(0, 1000, (2, 30), dtype=np.int32)
  whole, _ = extend(tokens, model.init_cache(2, 32))
  cache = model.init_cache(2, 32)
  pieces = []
  for start, stop in ((0, 11), (11, 12), (12, 30)):
    logits, cache = extend(tokens[:, start:stop], cache)
    pieces.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.asarray(whole), rtol=0, atol=TOLERANCE)
  full = np.asarray(model(tokens))
  np.testing.assert_allclose(np.asarray(whole), full, rtol=0, atol=TOLERANCE)


def test_decode_ignores_stale_slots_past_length(seed, make_hf_checkpoint):
  """A cache rewound to an earlier length (as the engine does over a prompt's padding) must not
  attend to what its later slots still hold, even when they keep a live segment id."""
  directory, _ = make_hf_checkpoint(seed)
  model = from_pretrained(directory)
  graphdef, state = nnx.split(model)
  # Explicit positions: the default counts the stale slots' nonzero segment ids as earlier tokens.
  extend = jax.jit(lambda state, tokens, cache, positions: nnx.merge(graphdef, state).extend(
      tokens, cache, positions=positions))
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, 1000, (2, 14), dtype=np.int32)
  junk = rng.integers(0, 1000, (2, 5), dtype=np.int32)
  _, cache = extend(state, np.concatenate([tokens[:, :10], junk], axis=1), model.init_cache(2, 16),
                    np.broadcast_to(np.arange(15, dtype=np.int32), (2, 15)))
  cache = dataclasses.replace(cache, length=cache.length - 5)  # slots 10-14 keep junk, segment 1
  decoded = []
  for step in range(10, 14):
    logits, cache = extend(state, tokens[:, step:step + 1], cache, np.full((2, 1), step, np.int32))
    decoded.append(np.asarray(logits[:, 0]))
  full = np.asarray(model(tokens))
  np.testing.assert_allclose(np.stack(decoded, axis=1), full[:, 10:], rtol=0, atol=TOLERANCE)
