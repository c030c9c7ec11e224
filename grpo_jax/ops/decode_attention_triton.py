"""The 'triton' (GPU) schedule of the ragged decode-attention kernel.

Grid (row b, kv head), both parallel; each program loops over its own row's written blocks only
(a loop whose trip count is ceil(length / block), read from the lengths array), so a short row
costs a short loop whatever the fullest row holds. The cache is read from the stacked
[L, B, S, K, H] array in place at the layer given as a one-element array: each load is a strided
[block, H] tile of it. Loads are masked to the row's written slots and zero-filled past them, so
slots past a row's length (NaN included) and past S are never read. Triton tiles have
power-of-two sides of at least 16 for its tensor-core dots: the query rows arrive padded to such
a count. Block checks and layouts are decode_attention.py's.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from grpo_jax.ops.tiles import F32, CONTRACT_VOCAB, dot_precision, row_blocks

NEG = float(jnp.finfo(jnp.float32).min)


def _kernel(layer_ref, lengths_ref, q_ref, query_slots_ref, query_segments_ref, segments_ref, k_ref,
            v_ref, m_ref, l_ref, acc_ref, *, block, scale):
  b, head = pl.program_id(0), pl.program_id(1)
  layer, length = layer_ref[0], lengths_ref[b]
  q = q_ref[b, head]  # [R, H]
  query_slots = query_slots_ref[b][:, None]  # [R, 1]
  query_segments = query_segments_ref[b][:, None]
  rows, head_dim = q.shape

  def step(j, stats):
    m, l, acc = stats
    start = pl.multiple_of(j * block, block)
    keys = pl.ds(start, block)
    slots = start + jnp.arange(block)
    written = slots < length
    segments = pltriton.load(segments_ref.at[b, keys], mask=written, other=0)
    tile_mask = jnp.broadcast_to(written[:, None], (block, head_dim))
    k = pltriton.load(k_ref.at[layer, b, keys, head, :], mask=tile_mask, other=0)
    v = pltriton.load(v_ref.at[layer, b, keys, head, :], mask=tile_mask, other=0)
    visible = written[None, :] & (slots[None, :] <= query_slots) & (segments[None, :] == query_segments)
    s = lax.dot_general(q, k, CONTRACT_VOCAB, preferred_element_type=F32,
                        precision=dot_precision(k.dtype)) * scale
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    rescale = jnp.exp(m - m_new)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32, precision=dot_precision(v.dtype))
    return m_new, l * rescale + jnp.sum(p, axis=1), acc * rescale[:, None] + pv

  stats = (jnp.full((rows,), NEG, F32), jnp.zeros((rows,), F32), jnp.zeros((rows, head_dim), F32))
  m, l, acc = lax.fori_loop(0, row_blocks(length, block), step, stats)
  m_ref[b, head] = m
  l_ref[b, head] = l
  acc_ref[b, head] = acc


def cache_stats(q, k_cache, v_cache, layer, lengths, cache_segments, query_slots, query_segments, *,
                block, scale, interpret):
  """q [B, K, R, H] (R a power of two >= 16); k_cache, v_cache [L, B, S, K, H]; layer [1] and
  lengths [B] int32; cache_segments [B, S]; query_slots, query_segments [B, R].
  -> m, l [B, K, R] and acc [B, K, R, H], fp32."""
  batch, kv_heads, rows, head_dim = q.shape
  stat = jax.ShapeDtypeStruct((batch, kv_heads, rows), F32)
  return pl.pallas_call(
      functools.partial(_kernel, block=block, scale=scale),
      grid=(batch, kv_heads),
      out_shape=[stat, stat, jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), F32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name='ragged_cache_attention',
  )(layer, lengths, q, query_slots, query_segments, cache_segments, k_cache, v_cache)
