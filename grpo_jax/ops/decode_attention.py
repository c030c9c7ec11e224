"""Ragged decode attention over the KV cache: a Pallas kernel in which each row reads only the
cache blocks below its own length, not the fullest row's.

`ragged_decode_attention` (Mosaic GPU's schedule: `ends_softmax`) is a decode step's whole
attention in one kernel: the row's shared prompt read in place, then its cache (into which the step
may already have written its new tokens), the softmax ended there.

`ragged_cache_attention` gives the online-softmax statistics (m, l, acc) of the query over the
cache part alone, in the convention of model/attention.py's blockwise_cache_attention: scores
fp32 and scaled by H^-1/2, masked keys weigh exactly 0, m starts at the most negative finite
fp32. The caller folds in its small parts (the new tokens, a shared prompt) with `merge_stats`
and ends with `finish_stats`. The cache mask is computed in the kernel from what decoding
already holds (the cache's segment ids, the query's segment ids and slots, the row lengths), so
no [B, T, S] mask is built or read.

Two schedules, each in its own module so that a machine imports only the Pallas backend it runs:
  'mosaic'  (TPU, decode_attention_mosaic.py) grid (row, block), the blocks past a row's length
            mapped onto its last written one (so not copied again) and skipped; blocks are a
            multiple of 128 slots.
  'mosaic_gpu' (GPU, decode_attention_mosaic_gpu.py, the default there) grid (row, kv head, 64 query
            rows), each program looping over its row's written blocks, TMA-copied and double-buffered
            into shared memory, the products on WGMMA; blocks are a multiple of 64 slots.
The Triton schedule (Pallas's deprecated Triton backend) was removed once the Mosaic GPU one had
run on a GPU (an H200, BENCHMARKS.md).
Both run under `interpret=True` on CPU, which is how the tests exercise the kernel bodies.
"""

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from grpo_jax.ops.logprob import target_platform
from grpo_jax.sharding import auto_shape, current_mesh, split_axes
from grpo_jax.ops.tiles import row_blocks  # noqa: F401  (the kernels' block count, shared with them)

SCHEDULES = ('mosaic', 'mosaic_gpu')
# Mosaic GPU stages a [block, H] key and value tile twice each (double-buffered) and the query rows'
# [64, H] tile in shared memory: at block 256 and H 128 in bf16, 272 KiB, past an H100's 227 KiB.
MOSAIC_GPU_TILE_BYTES = 160 << 10
# Mosaic double-buffers a [block, K, H] key and value block in VMEM, K padded to a whole sublane
# tile (8 rows of 32 bits: 16 of bf16) and H to 128 lanes. Half of the smallest default scoped
# VMEM limit (16 MiB, v5e) for them: a 1,024-slot block of the 7B cache (16 MiB) was refused.
MOSAIC_BLOCK_BYTES = 8 << 20


def block_size(schedule: str, slots: int, block: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
  """Clamps the cache block to the cache and to on-chip memory, and checks it against the
  backend's rules. Mosaic tiles an array's last two dimensions by (8, 128): a block of the
  [B, 1, S] segment ids puts the slots on lanes, so it is a multiple of 128 (or all S slots);
  it shrinks until its buffers fit MOSAIC_BLOCK_BYTES. Mosaic GPU wants multiples of 64 slots
  (a last block past S starts at S - block), halved until its tiles fit MOSAIC_GPU_TILE_BYTES."""
  if schedule == 'mosaic':
    if block < slots and block % 128:
      raise ValueError(f'mosaic decode attention needs block % 128 == 0 (or block >= S = {slots}), '
                       f'got {block}')
    block = min(block, slots)
    sublanes = 8 * (4 // itemsize)
    padded = -(-kv_heads // sublanes) * sublanes * -(-head_dim // 128) * 128 * itemsize
    while block > 128 and 4 * block * padded > MOSAIC_BLOCK_BYTES:
      block = max(128, block // 256 * 128)
    return block
  if schedule == 'mosaic_gpu':
    if block < 64 or block % 64:
      raise ValueError(f'mosaic_gpu decode attention needs a block that is a multiple of 64, got {block}')
    if slots < 64:
      raise ValueError(f'mosaic_gpu decode attention needs a cache of at least 64 slots, got {slots}')
    block = min(block, slots // 64 * 64)
    while block > 64 and (4 * block + 64) * head_dim * itemsize > MOSAIC_GPU_TILE_BYTES:
      block = max(64, block // 128 * 64)
    return block
  raise ValueError(f'decode attention schedule must be one of {SCHEDULES}, got {schedule!r}')


def ragged_cache_attention(q, k_cache, v_cache, layer, lengths, cache_segments, query_segments,
                           query_slots, *, block: int, schedule: str | None = None,
                           interpret: bool | None = None):
  """Statistics of q over the written part of the cache, each row reading its own blocks only.

  q [B, T, N, H]; k_cache, v_cache [L, B, S, K, H] read in place at `layer` (an int32 scalar),
  or [B, S, K, H] with layer None; lengths [B] int32 (slots written per row); cache_segments
  [B, S] int32 (0 on empty or padding slots); query_segments, query_slots [B, T] int32. Key slot
  s is visible to query t of row b iff s < lengths[b], s <= query_slots[b, t] and
  cache_segments[b, s] == query_segments[b, t]. Query head n uses kv head n // (N / K).

  schedule: 'mosaic' or 'mosaic_gpu'; by default 'mosaic_gpu' on GPU and 'mosaic' elsewhere. interpret
  defaults to True exactly when the target is a CPU. Not differentiable (decoding only).
  -> m, l [B, K, G, T] and acc [B, K, G, T, H], fp32 (G = N / K).

  Under a mesh (the trainer's, or the sampler's layout entered with sharding.use_mesh) the kernel
  runs inside shard_map, each device on its rows (split as the 'batch' rule splits B) and, where the
  mesh's tensor axis divides both K and N, on its kv heads and their query heads: a Pallas call,
  which XLA cannot partition, would otherwise run whole on every device.
  """
  schedule = schedule_of(schedule)
  interpret = target_platform() == 'cpu' if interpret is None else interpret
  k_cache, v_cache, layer = _stacked(k_cache, v_cache, layer)
  local = functools.partial(_cache_stats, block=block, schedule=schedule, interpret=interpret)
  args = (q, k_cache, v_cache, layer, lengths, cache_segments, query_segments, query_slots)
  split = _split(q, k_cache)
  if split is None:
    return local(*args)
  b, h = split
  per_row = P(b, None)
  return jax.shard_map(local, mesh=current_mesh(), check_vma=False,
                       in_specs=(P(b, None, h, None), P(None, b, None, h, None), P(None, b, None, h, None), P(),
                                 P(b), per_row, per_row, per_row),
                       out_specs=(P(b, h, None, None), P(b, h, None, None), P(b, h, None, None, None)))(*args)


def _stacked(k_cache, v_cache, layer):
  """The caches as [L, B, S, K, H] stacks and the layer an int32 scalar (one layer's [B, S, K, H]
  with layer None: a stack of one)."""
  if layer is None:
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
  return k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(())


def _split(q, k_cache):
  """Under a mesh, how the kernel's shard_map splits its work: (the mesh axes of the rows, those of
  the kv heads, each None when unsplit), the heads only where the axes divide both K and N (q
  [B, T, N, H], k_cache [L, B, S, K, H]); None where nothing is split (no mesh, or no axis divides)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  shape = auto_shape(mesh)
  rows = split_axes(q.shape[0], 'batch', shape)
  heads = split_axes(k_cache.shape[3], 'kv_heads', shape)
  if heads and q.shape[2] % math.prod(shape[axis] for axis in heads):
    heads = ()
  if not rows and not heads:
    return None
  return rows or None, heads or None


_SCHEDULE = contextvars.ContextVar('decode_attention_schedule', default=None)


@contextlib.contextmanager
def scheduled(schedule: str):
  """Kernels traced inside run `schedule` instead of the target's (on a CPU, interpreted: how the
  tests run the Mosaic GPU schedule through the model and the sampler)."""
  if schedule not in SCHEDULES:
    raise ValueError(f'decode attention schedule must be one of {SCHEDULES}, got {schedule!r}')
  token = _SCHEDULE.set(schedule)
  try:
    yield
  finally:
    _SCHEDULE.reset(token)


def schedule_of(schedule: str | None = None) -> str:
  """The kernel's schedule: `schedule`, else the one `scheduled` set, else the target's
  ('mosaic_gpu' on GPUs, 'mosaic' elsewhere)."""
  return schedule or _SCHEDULE.get() or ('mosaic_gpu' if target_platform() == 'gpu' else 'mosaic')


def ends_softmax(schedule: str | None = None) -> bool:
  """Whether the schedule takes a decode step's whole attention (`ragged_decode_attention`): the
  shared prompts read in place, the new tokens' statistics folded in, the softmax ended in the
  kernel. Mosaic GPU's does; the TPU one gives the cache's statistics only."""
  return schedule_of(schedule) == 'mosaic_gpu'


def ragged_decode_attention(q, initial, k_cache, v_cache, layer, lengths, cache_segments, query_segments,
                            query_slots, *, block: int, prompt=None, schedule: str | None = None,
                            interpret: bool | None = None) -> jax.Array:
  """A decode step's whole attention in one kernel: q [B, T, N, H] over its shared prompt (if any),
  then over the written part of its cache row (as `ragged_cache_attention`), starting from the
  statistics `initial` (m, l [B, K, G, T], acc [B, K, G, T, H] fp32: the new tokens' own, kept
  out of the cache) or, with initial None, from none (the new tokens already written into the
  cache and counted in `lengths`) -> [B, T, N, H] in the cache's dtype. Every query must see a
  key (its own).

  prompt: (k, v [n, Pn, W, K, H], index [n, Bn], segments [n, Pn, W]), a SharedPrefix's layer: row
  g * Bn + j reads prompt (g, index[g, j]) in place, its keys visible where their segment is not 0
  and equals the query's. W >= 64. Only the 'mosaic_gpu' schedule (`ends_softmax`).
  """
  schedule = schedule_of(schedule)
  if schedule != 'mosaic_gpu':
    raise ValueError(f'the {schedule!r} decode-attention schedule gives the cache\'s statistics only')
  interpret = target_platform() == 'cpu' if interpret is None else interpret
  k_cache, v_cache, layer = _stacked(k_cache, v_cache, layer)
  local = functools.partial(_decode_attention, block=block, interpret=interpret, prompted=prompt is not None,
                            started=initial is not None)
  args = (q, *(initial or ()), k_cache, v_cache, layer, lengths, cache_segments, query_segments, query_slots,
          *(prompt or ()))
  split = _split(q, k_cache)
  if split is None:
    return local(*args)
  b, h = split
  per_row = P(b, None)
  stat = P(b, h, None, None)
  specs = ((P(b, None, h, None),) + ((stat, stat, P(b, h, None, None, None)) if initial is not None else ())
           + (P(None, b, None, h, None), P(None, b, None, h, None), P(), P(b), per_row, per_row, per_row))
  if prompt is not None:  # the prompts' groups go with their rows
    specs += (P(b, None, None, h, None), P(b, None, None, h, None), per_row, P(b, None, None))
  return jax.shard_map(local, mesh=current_mesh(), check_vma=False, in_specs=specs,
                       out_specs=P(b, None, h, None))(*args)


def _decode_attention(q, *args, block: int, interpret: bool, prompted: bool, started: bool):
  """ragged_decode_attention on one device's rows and heads."""
  initial, args = (args[:3], args[3:]) if started else (None, args)
  k_cache, v_cache, layer, lengths, cache_segments, query_segments, query_slots, *prompt = args
  from grpo_jax.ops import decode_attention_mosaic_gpu  # Pallas Mosaic GPU, imported only when it runs
  batch, length, num_heads, head_dim = q.shape
  slots, kv_heads = k_cache.shape[2], k_cache.shape[3]
  groups = num_heads // kv_heads
  block = block_size('mosaic_gpu', slots, block, kv_heads, head_dim, k_cache.dtype.itemsize)
  shared = None
  if prompted:
    pk, pv, index, segments = prompt
    count, per, width = segments.shape
    block = min(block, width // 64 * 64)
    flat = lambda x: x.reshape((count * per,) + x.shape[2:])  # noqa: E731
    prompt_of = (jnp.arange(count, dtype=jnp.int32)[:, None] * per + index.astype(jnp.int32)).reshape(-1)
    shared = (flat(pk), flat(pv), prompt_of, flat(segments))
  q = q.reshape(batch, length, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
  q = q.reshape(batch, kv_heads, groups * length, head_dim)
  rows = lambda x: jnp.tile(x.astype(jnp.int32), (1, groups))  # noqa: E731  [B, T] -> [B, G x T]
  if started:
    m, l, acc = initial
    initial = (m.reshape(batch, kv_heads, -1), l.reshape(batch, kv_heads, -1),
               acc.reshape(batch, kv_heads, groups * length, head_dim))
  out = decode_attention_mosaic_gpu.cache_stats(
      q, k_cache, v_cache, jnp.asarray(layer, jnp.int32).reshape(1), lengths.astype(jnp.int32),
      cache_segments.astype(jnp.int32), rows(query_slots), rows(query_segments), block=block,
      scale=head_dim ** -0.5, interpret=interpret, prompt=shared, initial=initial, finish=True)
  out = out.reshape(batch, kv_heads, groups, length, head_dim)
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, head_dim)


def _cache_stats(q, k_cache, v_cache, layer, lengths, cache_segments, query_segments, query_slots, *, block: int,
                 schedule: str, interpret: bool):
  """ragged_cache_attention on one device's rows and heads (k_cache, v_cache stacked, layer a scalar)."""
  batch, length, num_heads, head_dim = q.shape
  slots, kv_heads = k_cache.shape[2], k_cache.shape[3]
  groups = num_heads // kv_heads
  block = block_size(schedule, slots, block, kv_heads, head_dim, k_cache.dtype.itemsize)
  scale = head_dim ** -0.5
  # Query rows r = g * T + t of kv head k: G x T rows share one [block, H] key tile.
  q = q.reshape(batch, length, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)
  q = q.reshape(batch, kv_heads, groups * length, head_dim)

  def rows(x):  # [B, T] -> [B, G x T], row r holding query r % T's value
    return jnp.tile(x.astype(jnp.int32), (1, groups))

  layer = jnp.asarray(layer, jnp.int32).reshape(1)
  lengths, cache_segments = lengths.astype(jnp.int32), cache_segments.astype(jnp.int32)
  if schedule == 'mosaic_gpu':
    from grpo_jax.ops import decode_attention_mosaic_gpu  # Pallas Mosaic GPU, imported only when it runs
    m, l, acc = decode_attention_mosaic_gpu.cache_stats(
        q, k_cache, v_cache, layer, lengths, cache_segments, rows(query_slots), rows(query_segments),
        block=block, scale=scale, interpret=interpret)
  else:
    from grpo_jax.ops import decode_attention_mosaic  # Pallas TPU, imported only when it runs
    m, l, acc = decode_attention_mosaic.cache_stats(
        q, k_cache, v_cache, layer, lengths, cache_segments[:, None, :], rows(query_slots)[..., None],
        rows(query_segments)[..., None], block=block, scale=scale, interpret=interpret)
    m, l = m[..., 0], l[..., 0]
  shape = (batch, kv_heads, groups, length)
  return m.reshape(shape), l.reshape(shape), acc.reshape(shape + (head_dim,))


def merge_stats(first, second):
  """Two (m, l, acc) triples of the same queries over disjoint keys -> the triple over both."""
  (m1, l1, acc1), (m2, l2, acc2) = first, second
  m = jnp.maximum(m1, m2)
  scale1, scale2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
  return m, l1 * scale1 + l2 * scale2, acc1 * scale1[..., None] + acc2 * scale2[..., None]


def finish_stats(stats, dtype) -> jax.Array:
  """(m, l [B, K, G, T], acc [B, K, G, T, H]) -> attention output [B, T, N, H] in dtype. Every
  query must have seen a key (l > 0)."""
  _, l, acc = stats
  batch, kv_heads, groups, length, head_dim = acc.shape
  out = acc / l[..., None]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, kv_heads * groups, head_dim).astype(dtype)
