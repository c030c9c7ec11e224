"""The 'triton' (GPU) schedule of the ragged decode-attention kernel.

Grid (row b, kv head, block of query rows), all parallel; each program loops over its own row's
written blocks only
(a loop whose trip count is ceil(length / block), read from the lengths array), so a short row
costs a short loop whatever the fullest row holds. The cache is read from the stacked
[L, B, S, K, H] array in place at the layer given as a one-element array: each load is a strided
[block, H] tile of it. Loads are masked to the row's written slots and zero-filled past them, so
slots past a row's length (NaN included) and past S are never read. Triton tiles have
power-of-two sides of at least 16 for its tensor-core dots: the query rows arrive padded to such
a count. A prefill's many query rows (G x T) go in blocks of 16 to 64 per program (`query_block`),
so a program's [query rows, block] scores stay within a multiprocessor's shared memory (the 0.5B
recipe's 512-token prefill chunk asked for 656 KB of an H100's 227 KB in one program). Block
checks and layouts are decode_attention.py's.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from grpo_jax.ops.tiles import F32, CONTRACT_VOCAB, dot_precision, row_blocks

NEG = float(jnp.finfo(jnp.float32).min)


def query_block(rows: int, block: int, head_dim: int, itemsize: int, tile_bytes: int) -> int:
  """Query rows per program: 64, or 16 where the key and value tiles already take more than half
  of `tile_bytes` (decode_attention.TRITON_TILE_BYTES). Measured against the H100's 227 KB of
  shared memory, deviceless: 64 rows of H = 64 at a 256-slot block fit, 64 rows of H = 128 asked
  for 273 KB."""
  return min(rows, 64 if 2 * block * head_dim * itemsize <= tile_bytes // 2 else 16)


def _kernel(layer_ref, lengths_ref, q_ref, query_slots_ref, query_segments_ref, segments_ref, k_ref,
            v_ref, m_ref, l_ref, acc_ref, *, block, scale):
  b, head, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer, length = layer_ref[0], lengths_ref[b]
  query_rows = pl.ds(pl.multiple_of(part * q_ref.shape[2] // pl.num_programs(2), 16), q_ref.shape[2] // pl.num_programs(2))
  q = q_ref[b, head, query_rows]  # [R', H]
  query_slots = query_slots_ref[b, query_rows][:, None]  # [R', 1]
  query_segments = query_segments_ref[b, query_rows][:, None]
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
  m_ref[b, head, query_rows] = m
  l_ref[b, head, query_rows] = l
  acc_ref[b, head, query_rows] = acc


def cache_stats(q, k_cache, v_cache, layer, lengths, cache_segments, query_slots, query_segments, *,
                block, scale, interpret, tile_bytes):
  """q [B, K, R, H] (R a power of two >= 16); k_cache, v_cache [L, B, S, K, H]; layer [1] and
  lengths [B] int32; cache_segments [B, S]; query_slots, query_segments [B, R].
  -> m, l [B, K, R] and acc [B, K, R, H], fp32."""
  batch, kv_heads, rows, head_dim = q.shape
  stat = jax.ShapeDtypeStruct((batch, kv_heads, rows), F32)
  return pl.pallas_call(
      functools.partial(_kernel, block=block, scale=scale),
      grid=(batch, kv_heads, rows // query_block(rows, block, head_dim, k_cache.dtype.itemsize, tile_bytes)),
      out_shape=[stat, stat, jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), F32)],
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name='ragged_cache_attention',
  )(layer, lengths, q, query_slots, query_segments, cache_segments, k_cache, v_cache)
