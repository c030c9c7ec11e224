"""The 'mosaic_gpu' (GPU) schedule of the ragged decode-attention kernel, in Pallas's Mosaic GPU
backend (warpgroups, TMA copies, WGMMA), which replaces its Triton schedule (deprecated in jax 0.11).

Grid (row b, kv head, part of 64 query rows), one warpgroup per program. The program loops over
its own row's written cache blocks only (a loop of ceil(length / block) steps, the length read from the lengths array):
each step copies a [block, H] key and value tile of the stacked [L, B, S, K, H] cache at the layer
into shared memory (TMA, double-buffered: the next block's copy is issued before this block is
computed), then the scores of the program's query rows (the G x T rows of the kv head, padded to
WGMMA's 64) over the block, the visibility mask, the online softmax and the weighted values. A
block holds 64 to 256 slots, so a row's whole cache (the 0.5B recipe's 1,024 slots) never needs
shared memory at once: two [block, H] tiles of keys and of values and the query tile, 80 KiB at
block 128, H 128 in bf16. Block checks and layouts are decode_attention.py's.

Slots past a row's length may hold anything, NaN included: their scores are masked to the most
negative finite fp32 and their values zeroed before the weighted sum, as the other schedules do.

A decode step's whole attention (decode_attention.ragged_decode_attention) runs in the same loop:
its first steps copy the row's shared prompt's blocks (prompt_of[b] of the [P, W, K, H] prompts,
read in place: a prompt's G readers copy nothing), the online softmax may start from statistics
computed outside (the new tokens'), and the kernel ends the softmax itself, storing only the
program's real query rows (G x T of its 64) through shared memory and TMA. Mosaic GPU refuses a
scalar predicate broadcast into a select and boolean or/not, so the prompt-or-cache choice of
the mask is made on fp32 values.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from grpo_jax.ops.tiles import CONTRACT_VOCAB, F32, row_blocks

NEG = float(jnp.finfo(jnp.float32).min)
ROWS = 64  # WGMMA's M: a program's query rows, padded
SWIZZLE = 128  # bytes: the shared-memory swizzle of the key, value and query tiles


def _tile_transforms(head_dim: int, itemsize: int):
  swizzle = min(SWIZZLE, head_dim * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def cache_stats(q, k_cache, v_cache, layer, lengths, cache_segments, query_slots, query_segments, *,
                block, scale, interpret, prompt=None, initial=None, finish=False):
  """q [B, K, R, H]; k_cache, v_cache [L, B, S, K, H] (S >= block, block a multiple of 64: a last
  block past S starts at S - block instead, its slots already seen masked); layer [1] and lengths [B]
  int32; cache_segments [B, S]; query_slots, query_segments [B, R]. The R rows go in parts of 64 (a
  grid axis). -> m, l [B, K, R] and acc [B, K, R, H], fp32.

  prompt: (k, v [P, W, K, H], prompt_of [B] int32, segments [P, W] int32): the shared prompts, row
  b reading prompt prompt_of[b] before its cache (W >= block: a last block past W starts at
  W - block), a key visible iff its segment is not 0 and equals the query's. Read in place, so a
  prompt's G readers copy nothing.
  initial: (m, l [B, K, R], acc [B, K, R, H]) fp32 statistics the online softmax starts from (the
  new tokens' own, computed outside).
  finish (implied by initial): the kernel ends the softmax itself, each query having seen a key
  (l > 0) -> the attention [B, K, R, H] in the cache's dtype, not the statistics.
  """
  finish = finish or initial is not None
  batch, kv_heads, rows, head_dim = q.shape
  slots = k_cache.shape[2]
  dtype = k_cache.dtype
  if block % 64 or block > slots:
    raise ValueError(f'mosaic_gpu decode attention needs a block that is a multiple of 64 and at most the '
                     f'cache\'s {slots} slots, got {block}')
  width = 0 if prompt is None else prompt[0].shape[1]
  if prompt is not None and block > width:
    raise ValueError(f'mosaic_gpu decode attention needs a block of at most the prompts\' {width} slots, got {block}')
  prompt_steps = row_blocks(width, block)
  parts = -(-rows // ROWS)
  pad = parts * ROWS - rows
  q = jnp.pad(q.astype(dtype), ((0, 0), (0, 0), (0, pad), (0, 0)))
  # Padded rows repeat row 0's slot and segment: finite scores, dropped below.
  query_slots, query_segments = (jnp.pad(x.astype(jnp.int32), ((0, 0), (0, pad)), mode='edge')
                                 for x in (query_slots, query_segments))
  transforms = _tile_transforms(head_dim, jnp.dtype(dtype).itemsize)
  extra = ()
  if prompt is not None:
    extra += (prompt[2].astype(jnp.int32), prompt[3].astype(jnp.int32), prompt[0], prompt[1])
  if initial is not None:  # padded rows start from l = 1: finite, dropped below
    m0, l0, acc0 = (x.astype(F32) for x in initial)
    extra += (jnp.pad(m0, ((0, 0), (0, 0), (0, pad))), jnp.pad(l0, ((0, 0), (0, 0), (0, pad)), constant_values=1.0),
              jnp.pad(acc0, ((0, 0), (0, 0), (0, pad), (0, 0))))

  def kernel(layer_ref, lengths_ref, q_ref, slots_ref, segments_ref, cache_segments_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    prompt_of_ref, prompt_segments_ref, pk_ref, pv_ref = (refs.pop(0) for _ in range(4)) if prompt else (None,) * 4
    m0_ref, l0_ref, acc0_ref = (refs.pop(0) for _ in range(3)) if initial else (None,) * 3
    out_refs = [refs.pop(0)] if finish else [refs.pop(0) for _ in range(3)]
    q_smem, k_smem, v_smem, q_barrier, k_barriers, v_barriers, *out_smem = refs
    out_smem = out_smem[0] if out_smem else None
    b, head, part = lax.axis_index('row'), lax.axis_index('head'), lax.axis_index('part')
    layer_index, length = layer_ref[0], lengths_ref[b]
    source = prompt_of_ref[b] if prompt else None
    # Steps 0 .. prompt_steps - 1 read the row's prompt, the rest its own written cache blocks.
    steps = prompt_steps + row_blocks(length, block)
    query_rows = pl.ds(part * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, head, query_rows], q_smem, q_barrier)

    def start_of(step):  # a block past the cache's end starts at S - block
      return jnp.minimum(step * block, slots - block)

    def prompt_start(step):  # likewise past the prompt's W
      return jnp.minimum(step * block, width - block)

    def fetch(step, slot):
      def from_cache():
        keys = pl.ds(start_of(step - prompt_steps), block)
        plgpu.copy_gmem_to_smem(k_ref.at[layer_index, b, keys, head], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[layer_index, b, keys, head], v_smem.at[slot], v_barriers.at[slot])
      if not prompt:
        return from_cache()
      pl.when(step >= prompt_steps)(from_cache)

      @pl.when(step < prompt_steps)
      def _():
        keys = pl.ds(prompt_start(step), block)
        plgpu.copy_gmem_to_smem(pk_ref.at[source, keys, head], k_smem.at[slot], k_barriers.at[slot])
        plgpu.copy_gmem_to_smem(pv_ref.at[source, keys, head], v_smem.at[slot], v_barriers.at[slot])

    @pl.when(steps > 0)
    def _():
      fetch(0, 0)

    plgpu.barrier_wait(q_barrier)
    query_slots = plgpu.load(slots_ref.at[b, query_rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    query_segments = plgpu.load(segments_ref.at[b, query_rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    shape = (ROWS, block)
    query_slots = lax.broadcast_in_dim(query_slots, shape, [0])
    query_segments = lax.broadcast_in_dim(query_segments, shape, [0])

    def step(j, carry):
      m, l, acc = carry
      slot = lax.rem(j, 2)

      @pl.when(j + 1 < steps)
      def _():
        fetch(j + 1, 1 - slot)

      plgpu.barrier_wait(k_barriers.at[slot])
      plgpu.barrier_wait(v_barriers.at[slot])
      cache_step = jnp.maximum(j - prompt_steps, 0)
      start = start_of(cache_step)

      @pl.when((start + block > length) & (j >= prompt_steps))  # the row's last block: its values past the length zeroed
      def _():
        tile = plgpu.load(v_smem.at[slot], layout=plgpu.Layout.WGMMA)
        written = start + plgpu.broadcasted_iota(jnp.int32, tile.shape, 0, layout=plgpu.Layout.WGMMA) < length
        v_smem[slot] = jnp.where(written, tile, jnp.zeros_like(tile))
        plgpu.commit_smem()

      if interpret:  # the GPU interpreter has no WGMMA: the same product on the tiles' values
        s = lax.dot_general(q_smem[...], k_smem[slot], CONTRACT_VOCAB, preferred_element_type=F32)
      else:
        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
          return acc_ref[...]
        s = pl.run_scoped(scores, plgpu.ACC(shape, F32))
      s = s * scale
      iota = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
      key_slots = start + iota
      segments = plgpu.load(cache_segments_ref.at[b, pl.ds(start, block)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
      visible = ((key_slots >= cache_step * block) & (key_slots < length) & (key_slots <= query_slots)
                 & (lax.broadcast_in_dim(segments, shape, [1]) == query_segments))
      if prompt:
        first = prompt_start(j)
        prompt_segments = lax.broadcast_in_dim(plgpu.load(
            prompt_segments_ref.at[source, pl.ds(first, block)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False),
            shape, [1])
        in_prompt = ((first + iota >= j * block) & (prompt_segments != 0) & (prompt_segments == query_segments))
        # j < prompt_steps, as an array (a scalar predicate is an implicit broadcast Mosaic GPU refuses)
        prompt_step = iota + j * block < prompt_steps * block
        # (and chosen as fp32: Mosaic GPU has no or / not of boolean registers)
        visible = jnp.where(prompt_step, jnp.where(in_prompt, 1.0, 0.0), jnp.where(visible, 1.0, 0.0)) > 0.5
      s = jnp.where(visible, s, NEG)
      m_new = jnp.maximum(m, s.max(axis=1))
      p = jnp.where(visible, jnp.exp(s - lax.broadcast_in_dim(m_new, shape, [0])), 0.0)
      rescale = jnp.exp(m - m_new)
      l = l * rescale + p.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(rescale, (ROWS, head_dim), [0])

      if interpret:
        acc = acc + jnp.dot(p.astype(dtype), v_smem[slot], preferred_element_type=F32)
      else:
        def weighted(acc_ref):
          plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])
        acc = pl.run_state(weighted)(plgpu.ACC.init(acc))
      return m_new, l, acc

    if initial:
      stats = (plgpu.load(m0_ref.at[b, head, query_rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False),
               plgpu.load(l0_ref.at[b, head, query_rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False),
               plgpu.load(acc0_ref.at[b, head, query_rows], layout=plgpu.Layout.WGMMA, optimized=False))
    else:
      stats = (plgpu.layout_cast(jnp.full((ROWS,), NEG, F32), plgpu.Layout.WGMMA.reduce(1)),
               plgpu.layout_cast(jnp.zeros((ROWS,), F32), plgpu.Layout.WGMMA.reduce(1)),
               plgpu.layout_cast(jnp.zeros((ROWS, head_dim), F32), plgpu.Layout.WGMMA))
    m, l, acc = lax.fori_loop(0, steps, step, stats)
    if finish:  # the softmax ended here: the attention in the cache's dtype, only the real rows
      # Through an untiled tile of shared memory and TMA: a 16-bit tile stored from registers writes
      # part sectors, and the real rows (G x T, not a whole 64) are a slice no tiled tile can take.
      out_smem[...] = (acc / lax.broadcast_in_dim(l, (ROWS, head_dim), [0])).astype(dtype)
      plgpu.commit_smem()
      last = rows - (parts - 1) * ROWS  # the last part's real rows

      def store(count):
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, count)], out_refs[0].at[b, head, pl.ds(part * ROWS, count)])
      if parts == 1:
        store(last)
      else:
        pl.when(part < parts - 1)(lambda: store(ROWS))
        pl.when(part == parts - 1)(lambda: store(last))
      plgpu.wait_smem_to_gmem(0)
      return
    for ref, value in zip(out_refs, (m, l, acc)):
      ref[b, head, query_rows] = value

  def entry(*refs):
    pl.run_scoped(lambda *scratch: kernel(*refs, *scratch),
                  plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
                  plgpu.SMEM((2, block, head_dim), dtype, transforms=transforms),
                  plgpu.SMEM((2, block, head_dim), dtype, transforms=transforms),
                  plgpu.Barrier(num_barriers=1), plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
                  *([plgpu.SMEM((ROWS, head_dim), dtype)] if finish else []))

  stat = jax.ShapeDtypeStruct((batch, kv_heads, parts * ROWS), F32)
  if not finish:
    out_type = (stat, stat, jax.ShapeDtypeStruct((batch, kv_heads, parts * ROWS, head_dim), F32))
  else:
    out_type = (jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), dtype),)
  out = plgpu.kernel(
      entry, out_type=out_type,
      grid=(batch, kv_heads, parts), grid_names=('row', 'head', 'part'), interpret=plgpu.InterpretGPUParams() if interpret else None,
      compiler_params=plgpu.CompilerParams(),
      kernel_name='ragged_decode_attention' if finish else 'ragged_cache_attention',
  )(layer, lengths, q, query_slots, query_segments, cache_segments.astype(jnp.int32), k_cache, v_cache, *extra)
  return out[0] if finish else tuple(x[:, :, :rows] for x in out)
