"""The KV cache's writes (model/cache.py) against NumPy: the segment ids' write in both of its forms
(the rows' scatter, and on a TPU one select over the slots) and one layer's write into the stack."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import cache as cache_module
from grpo_jax.ops import logprob


def numpy_write(ids, new, start):
  out = ids.copy()
  for row, at in enumerate(start):
    out[row, at:at + new.shape[1]] = new[row]
  return out


@pytest.mark.parametrize('platform', ['cpu', 'tpu'])
@pytest.mark.parametrize('tokens', [1, 5])
def test_segment_ids_are_written_at_each_rows_own_slot(seed, monkeypatch, platform, tokens):
  rng = np.random.default_rng(seed)
  rows, slots = 6, 32
  ids = rng.integers(1, 9, (rows, slots)).astype(np.int32)
  new = rng.integers(10, 20, (rows, tokens)).astype(np.int32)
  start = np.asarray([0, 1, 7, slots - tokens, 13, rng.integers(0, slots - tokens + 1)], np.int32)
  monkeypatch.setattr(logprob, 'target_platform', lambda: platform)
  got = cache_module.write_ids(jnp.asarray(ids), jnp.asarray(new), jnp.asarray(start))
  np.testing.assert_array_equal(np.asarray(got), numpy_write(ids, new, start))


def test_one_layers_write_leaves_the_other_layers_and_slots(seed):
  rng = np.random.default_rng(seed)
  layers, rows, slots, tokens = 3, 4, 16, 2
  stack = rng.standard_normal((layers, rows, slots, 2, 8)).astype(np.float32)
  new = rng.standard_normal((rows, tokens, 2, 8)).astype(np.float32)
  start = np.asarray([0, 3, slots - tokens, 9], np.int32)
  got = np.asarray(cache_module.write_layer(jnp.asarray(stack), jnp.asarray(new), 1, jnp.asarray(start)))
  expected = stack.copy()
  for row, at in enumerate(start):
    expected[1, row, at:at + tokens] = new[row]
  np.testing.assert_array_equal(got, expected)
