"""The 'mosaic' (TPU) schedule of the ragged decode-attention kernel.

Grid (row b, cache block j), j the last axis ('arbitrary') with the running statistics in VMEM
scratch. The layer index and the row lengths are prefetched into SMEM, where the index maps read
them: a block at or past a row's last written block maps to that last block, and the pipeline
issues no copy for a block index it already holds, so each row moves only its own written blocks
from HBM; `pl.when` skips their compute. The cache is read from the stacked [L, B, S, K, H]
array in place: a block is [block, K, H] (Mosaic tiles the last two dimensions, so K and H come
whole) and the kernel loops over the K heads of it. Block checks and layouts are
decode_attention.py's.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from grpo_jax.ops.tiles import F32, CONTRACT_VOCAB, dot_precision, row_blocks

NEG = float(jnp.finfo(jnp.float32).min)


def _kernel(layer_ref, lengths_ref, q_ref, query_slots_ref, query_segments_ref, segments_ref, k_ref,
            v_ref, m_out, l_out, acc_out, m_scratch, l_scratch, acc_scratch, *, block, scale):
  """One row's query rows [K, R, H] (R = G x T) against cache block j of that row."""
  del layer_ref  # read by the index maps only
  b, j = pl.program_id(0), pl.program_id(1)
  length = lengths_ref[b]

  @pl.when(j == 0)
  def _():
    m_scratch[...] = jnp.full(m_scratch.shape, NEG, F32)
    l_scratch[...] = jnp.zeros(l_scratch.shape, F32)
    acc_scratch[...] = jnp.zeros(acc_scratch.shape, F32)

  @pl.when(j < row_blocks(length, block))
  def _():
    start = j * block
    slots = start + lax.broadcasted_iota(jnp.int32, (1, block), 1)  # keys along lanes
    visible = ((slots < length) & (slots <= query_slots_ref[...])
               & (segments_ref[...] == query_segments_ref[...]))  # [R, block]
    # Slots past the row's length may hold anything, NaN included: 0 x NaN must not reach acc.
    written = start + lax.broadcasted_iota(jnp.int32, (block, 1), 0) < length
    for head in range(q_ref.shape[0]):
      q, k, v = q_ref[head], k_ref[:, head, :], v_ref[:, head, :]
      s = lax.dot_general(q, k, CONTRACT_VOCAB, preferred_element_type=F32,
                          precision=dot_precision(k.dtype)) * scale
      s = jnp.where(visible, s, NEG)
      m_old = m_scratch[head]
      m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
      p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
      rescale = jnp.exp(m_old - m_new)
      v = jnp.where(written, v, jnp.zeros_like(v))
      pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32, precision=dot_precision(v.dtype))
      m_scratch[head] = m_new
      l_scratch[head] = l_scratch[head] * rescale + p.sum(axis=1, keepdims=True)
      acc_scratch[head] = acc_scratch[head] * rescale + pv

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    m_out[...] = m_scratch[...]
    l_out[...] = l_scratch[...]
    acc_out[...] = acc_scratch[...]


def block_index(b, j, lengths_ref, block: int):
  """The cache block grid step (b, j) holds: j, up to row b's last written block (block 0 when
  the row is empty). Past it the index stays put, and the pipeline copies nothing it holds."""
  return jnp.minimum(j, jnp.maximum(row_blocks(lengths_ref[b], block) - 1, 0))


def cache_stats(q, k_cache, v_cache, layer, lengths, cache_segments, query_slots, query_segments, *,
                block, scale, interpret):
  """q [B, K, R, H]; k_cache, v_cache [L, B, S, K, H]; layer [1] and lengths [B] int32;
  cache_segments [B, 1, S]; query_slots, query_segments [B, R, 1].
  -> m, l [B, K, R, 1] and acc [B, K, R, H], fp32."""
  batch, kv_heads, rows, head_dim = q.shape
  slots = k_cache.shape[2]

  def cache_block(b, j, layer_ref, lengths_ref):
    return layer_ref[0], b, block_index(b, j, lengths_ref, block), 0, 0

  def segment_block(b, j, layer_ref, lengths_ref):
    return b, 0, block_index(b, j, lengths_ref, block)

  def per_row(b, j, layer_ref, lengths_ref):
    return b, 0, 0

  def per_row_heads(b, j, layer_ref, lengths_ref):
    return b, 0, 0, 0

  cache_spec = pl.BlockSpec((None, None, block, kv_heads, head_dim), cache_block)
  query_column = pl.BlockSpec((None, rows, 1), per_row)
  stat_spec = pl.BlockSpec((None, kv_heads, rows, 1), per_row_heads)
  stat = jax.ShapeDtypeStruct((batch, kv_heads, rows, 1), F32)
  return pl.pallas_call(
      functools.partial(_kernel, block=block, scale=scale),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, pl.cdiv(slots, block)),
          in_specs=[pl.BlockSpec((None, kv_heads, rows, head_dim), per_row_heads), query_column,
                    query_column, pl.BlockSpec((None, 1, block), segment_block), cache_spec, cache_spec],
          out_specs=[stat_spec, stat_spec, pl.BlockSpec((None, kv_heads, rows, head_dim), per_row_heads)],
          scratch_shapes=[pltpu.VMEM((kv_heads, rows, 1), F32), pltpu.VMEM((kv_heads, rows, 1), F32),
                          pltpu.VMEM((kv_heads, rows, head_dim), F32)]),
      out_shape=[stat, stat, jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), F32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'arbitrary')),
      interpret=interpret,
      name='ragged_cache_attention',
  )(layer, lengths, q, query_slots, query_segments, cache_segments, k_cache, v_cache)
