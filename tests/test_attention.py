"""Training-time attention implementations: 'chunked' (query chunks, rematerialised) and the
jax.nn.dot_product_attention mapping behind 'cudnn', against transformers and the dense path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import torch_logits
from grpo_jax import config as config_lib
from grpo_jax.errors import UserError
from grpo_jax.model import ModelOptions, attention, from_pretrained
from grpo_jax.testing import left_padded


def random_left_padded(rng, rows, width, vocab):
  """Token ids and segment ids (0 on left padding, 1 on tokens), both [rows, width], of rows of
  random lengths; the first row fills the width."""
  lengths = rng.integers(width // 3, width + 1, rows)
  lengths[0] = width
  draws = rng.integers(0, vocab, (rows, width))
  return left_padded([row[width - length:] for row, length in zip(draws, lengths)])


def loss_and_grads(model, tokens, segments):
  graphdef, state = nnx.split(model)

  def loss(state):
    logits = nnx.merge(graphdef, state)(tokens, segment_ids=segments)
    return jnp.sum(jax.nn.log_softmax(logits)[:, :-1].max(-1) * segments[:, 1:]) / segments.sum(), logits

  (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  return value, logits, jax.tree.leaves(grads)


# not dividing T = 40 (make test's), dividing a padded T, > T
@pytest.mark.parametrize('chunk', [7, *(pytest.param(chunk, marks=pytest.mark.exhaustive) for chunk in (16, 64))])
def test_chunked_attention_matches_transformers_and_dense(seed, make_hf_checkpoint, chunk):
  directory, reference = make_hf_checkpoint(seed, num_hidden_layers=2)
  tokens, segments = random_left_padded(np.random.default_rng(seed), rows=3, width=40, vocab=1000)
  chunked = ModelOptions(attention='chunked', attention_chunk=chunk)
  value, logits, grads = loss_and_grads(from_pretrained(directory, options=chunked), tokens, segments)
  base_value, base_logits, base_grads = loss_and_grads(from_pretrained(directory), tokens, segments)

  positions = np.maximum(np.cumsum(segments, axis=1) - 1, 0)
  expected = torch_logits(reference, tokens, attention_mask=segments, position_ids=positions)
  real = segments == 1  # transformers' rows at left padding are not defined the same way
  np.testing.assert_allclose(np.asarray(logits)[real], expected[real], rtol=1e-4, atol=1e-4)
  # fp32 rounding follows the magnitude of the sums behind each logit, not the logit itself: an
  # entry that cancels to ~0.01 carries the error of its O(1) summands (the rule of test_logprob's
  # and test_update's scalar checks); seen: 1.25e-6 on a logit of -0.014 with |logits| up to ~4.
  np.testing.assert_allclose(logits, base_logits, rtol=1e-5, atol=1e-6 * np.abs(base_logits).max())
  np.testing.assert_allclose(value, base_value, rtol=1e-6)
  for got, want in zip(grads, base_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_chunked_attention_keeps_one_chunk_of_scores():
  """Compiled forward + backward temporaries of one attention at T = 1024: the chunked path holds
  one [64, T] block of scores at a time, the dense one the whole [T, T]."""
  batch, length, heads, kv_heads, head_dim = 2, 1024, 4, 2, 32
  shapes = [jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)] + \
      [jax.ShapeDtypeStruct((batch, length, kv_heads, head_dim), jnp.float32)] * 2
  segments = jnp.ones((batch, length), jnp.int32)
  slots = jnp.broadcast_to(jnp.arange(length), (batch, length))

  def temp_bytes(attend):
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), (0, 1, 2)))
    return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  mask = attention.attention_mask(slots, segments, slots, segments)
  dense = temp_bytes(lambda q, k, v: attention.attention(q, k, v, mask))
  chunked = temp_bytes(functools.partial(attention.chunked_attention, slots=slots, segments=segments, chunk=64))
  scores = batch * heads * length * length * 4  # one fp32 [T, T] score array
  assert dense >= scores
  assert chunked < 0.15 * dense  # measured 11 MiB vs 129 MiB


def test_library_attention_mapping(seed):
  """The arguments 'cudnn' hands jax.nn.dot_product_attention (GQA heads, the [B, T, T] mask,
  causality) give the dense result through the library's XLA implementation."""
  rng = np.random.default_rng(seed)
  batch, length, heads, kv_heads, head_dim = 3, 29, 6, 2, 16
  q = rng.standard_normal((batch, length, heads, head_dim)).astype(np.float32)
  k, v = (rng.standard_normal((batch, length, kv_heads, head_dim)).astype(np.float32) for _ in range(2))
  segments = (np.arange(length)[None, :] >= rng.integers(0, length // 2, (batch, 1))).astype(np.int32)
  slots = np.broadcast_to(np.arange(length), (batch, length))
  mask = attention.attention_mask(slots, segments, slots, segments)
  np.testing.assert_allclose(attention.library_attention(q, k, v, mask, implementation='xla'),
                             attention.attention(q, k, v, mask), rtol=1e-5, atol=1e-6)


def test_attention_settings_are_checked():
  with pytest.raises(UserError, match='model.attention_chunk'):
    config_lib.load_config(None, ['model.attention_chunk=0'])
  with pytest.raises(UserError, match='attention_chunk must be >= 1'):
    ModelOptions(attention_chunk=0)
  with pytest.raises(UserError, match='model.attention'):
    config_lib.load_config(None, ['model.attention=flash'])
  if jax.default_backend() != 'gpu':
    config = config_lib.Config(model=config_lib.ModelConfig(options=ModelOptions(attention='cudnn')))
    with pytest.raises(UserError, match='model.attention: cudnn runs on NVIDIA GPUs only'):
      config.model.build(mesh=None, seed=0)


@pytest.mark.parametrize('length', [1, 3])
def test_shared_part_equals_each_row_reading_a_copy_of_its_prompt(seed, length):
  """attention.SharedPart (each prompt's keys read once, for the rows that read it) against the
  rows each holding a copy of their prompt's keys: the queries of 2 groups of 12 rows, each row
  reading one of its group's 4 prompts (at most 3 rows a prompt), or none, with a cache part."""
  rng = np.random.default_rng(seed)
  groups, rows, prompts, readers, width, slots, heads, kv_heads, dim = 2, 12, 4, 3, 5, 6, 4, 2, 8
  index = np.stack([rng.permutation(np.repeat(np.arange(prompts), readers))[:rows] for _ in range(groups)])
  reading = rng.random((groups, rows)) < 0.8
  index = np.where(reading, index, rng.integers(0, prompts, (groups, rows)))  # where a row reads none
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  q, k, v = normal(groups * rows, length, heads, dim), normal(groups, prompts, width, kv_heads, dim), normal(
      groups, prompts, width, kv_heads, dim)
  own_k, own_v = normal(groups * rows, slots, kv_heads, dim), normal(groups * rows, slots, kv_heads, dim)
  # The prompt's keys a query may see (its last ones padding in some prompts), none in rows not reading.
  prompt_mask = jnp.asarray(rng.random((groups, prompts, width)) < 0.8).at[..., 0].set(True)
  flat_reading = reading.reshape(-1)
  mask = jnp.asarray(np.take_along_axis(np.asarray(prompt_mask), index[..., None], axis=1).reshape(-1, width))
  mask = jnp.broadcast_to(mask[:, None] & flat_reading[:, None, None], (groups * rows, length, width))
  # Every query sees at least its first own key, as a decoded token sees itself: a query that sees no
  # key has no defined output (seed 4033989963 drew one in a row reading no prompt).
  own_mask = jnp.asarray(rng.random((groups * rows, length, slots)) < 0.7).at[..., 0].set(True)
  table, at = attention.reader_layout(jnp.asarray(index), jnp.asarray(reading), prompts, readers)

  copied = lambda x: jax.vmap(lambda values, i: values[i])(x, jnp.asarray(index)).reshape((-1,) + x.shape[2:])  # noqa: E731
  want = attention.grouped_attention(q, [(copied(k), copied(v), mask), (own_k, own_v, own_mask)])
  got = attention.grouped_attention(q, [attention.SharedPart(k, v, mask, table, at), (own_k, own_v, own_mask)])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  # Each prompt's readers are the rows reading it, each once.
  for group in range(groups):
    for prompt in range(prompts):
      listed = sorted(int(r) for r in np.asarray(table[group, prompt]) if r < rows)
      assert listed == sorted(np.flatnonzero(reading[group] & (index[group] == prompt)).tolist())
