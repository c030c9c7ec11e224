"""The ragged decode-attention kernel (ops/decode_attention.py), both schedules interpreted on CPU,
against dense grouped attention over the same cache under the equivalent boolean mask; and both
compiled deviceless for a TPU and a GPU by Mosaic and Mosaic GPU."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model.attention import grouped_attention
from grpo_jax.ops import decode_attention, decode_attention_mosaic
from grpo_jax.ops.decode_attention import finish_stats, merge_stats, ragged_cache_attention
from test_deviceless import _run

NEG = float(jnp.finfo(jnp.float32).min)
SLOTS, LAYERS, HEAD_DIM = 256, 2, 16
# Blocks that split the 256 slots into several, so the fill levels below fall on block edges.
BLOCKS = {'mosaic': 128, 'mosaic_gpu': 64}
# The Mosaic GPU schedule runs in the GPU interpreter (slow): make test holds its fast case below.
schedules = pytest.mark.parametrize('schedule', [pytest.param(name, marks=pytest.mark.exhaustive)
                                                 if name == 'mosaic_gpu' else name for name in sorted(BLOCKS)])
# bf16 cache and queries, against fp32 maths on the same bf16-rounded values. Probabilities are
# rounded to bf16 before they weight the values, as in every path of model/attention.py. Worst
# seen over 12 seeds x both schedules x both shapes: 3.5e-3 for the kernel (fp32 output), against
# 1.5e-2 for dense grouped_attention in bf16 (which also rounds its output to bf16).
BF16_ATOL = 2 ** -7


def fill_levels(rng, batch, block):
  """Row lengths: empty, one slot, a block edge, just past one, full, then random levels."""
  fixed = [0, 1, block, block + 3, SLOTS]
  return np.asarray(fixed + list(rng.integers(0, SLOTS + 1, batch - len(fixed))), np.int32)


def random_case(rng, lengths, length, heads, kv_heads, dtype):
  """Random inputs (never zeros) for one decode step of T = length tokens per row."""
  batch = len(lengths)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
  q = normal(batch, length, heads, HEAD_DIM)
  k_cache, v_cache = (normal(LAYERS, batch, SLOTS, kv_heads, HEAD_DIM) for _ in range(2))
  written = np.arange(SLOTS)[None] < lengths[:, None]
  # Written slots: a random segment (2 stands for another sequence's padding); unwritten slots hold
  # the query's segment, so that only the length bound hides them.
  cache_segments = np.where(written, rng.integers(1, 3, (batch, SLOTS)), 1).astype(np.int32)
  query_segments = np.ones((batch, length), np.int32)
  # Query slots from a few before the row's end (hiding its last keys) to the decoding position.
  query_slots = (lengths[:, None] + np.arange(length)[None] - rng.integers(0, 4, (batch, 1))).astype(np.int32)
  new_k, new_v = normal(batch, length, kv_heads, HEAD_DIM), normal(batch, length, kv_heads, HEAD_DIM)
  return dict(q=q, k_cache=k_cache, v_cache=v_cache, layer=int(rng.integers(0, LAYERS)), lengths=lengths,
              cache_segments=cache_segments, query_segments=query_segments, query_slots=query_slots,
              new_k=new_k, new_v=new_v)


def cache_mask(case):
  """The [B, T, S] mask the kernel computes for itself."""
  slots = np.arange(SLOTS)[None, None]
  return ((slots < case['lengths'][:, None, None]) & (slots <= case['query_slots'][:, :, None])
          & (case['cache_segments'][:, None, :] == case['query_segments'][:, :, None]))


def new_token_part(case):
  length = case['q'].shape[1]
  causal = np.broadcast_to(np.tril(np.ones((length, length), bool)), (len(case['lengths']), length, length))
  return case['new_k'], case['new_v'], jnp.asarray(causal)


def part_stats(q, k, v, mask):
  """Online-softmax statistics of q [B, T, N, H] over one small part, densely, in the kernel's
  convention: -> m, l [B, K, G, T], acc [B, K, G, T, H] fp32."""
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  s = jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=jnp.float32) * head_dim ** -0.5
  visible = mask[:, None, None]
  s = jnp.where(visible, s, NEG)
  m = s.max(axis=-1)
  p = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
  acc = jnp.einsum('BKGTS,BSKH->BKGTH', p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return m, p.sum(axis=-1), acc


@functools.partial(jax.jit, static_argnames=('schedule', 'block'))
def kernel_output(case, schedule, block):
  """The kernel's cache statistics merged with the new tokens' -> ([B, T, N, H] fp32, stats)."""
  stats = ragged_cache_attention(case['q'], case['k_cache'], case['v_cache'], case['layer'], case['lengths'],
                                 case['cache_segments'], case['query_segments'], case['query_slots'],
                                 block=block, schedule=schedule)
  merged = merge_stats(part_stats(case['q'], *new_token_part(case)), stats)
  return finish_stats(merged, jnp.float32), stats


def dense_output(case, dtype=jnp.float32):
  """grouped_attention over the same layer's cache (and the new tokens), computed in `dtype`."""
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  k, v, causal = new_token_part(case)
  layer = case['layer']
  parts = [(cast(case['k_cache'][layer]), cast(case['v_cache'][layer]), jnp.asarray(cache_mask(case))),
           (cast(k), cast(v), causal)]
  return np.asarray(grouped_attention(cast(case['q']), parts), np.float32)


@schedules
# (10, 14, 2): a prefill chunk of 7 x 10 query rows per kv head, which the Mosaic GPU schedule takes
# in two parts of 64 rows.
@pytest.mark.parametrize('length, heads, kv_heads', [(1, 4, 2), (3, 14, 2), (10, 14, 2)])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_ragged_kernel_equals_dense_attention(seed, schedule, length, heads, kv_heads, dtype):
  rng = np.random.default_rng(seed)
  block = BLOCKS[schedule]
  case = random_case(rng, fill_levels(rng, 8, block), length, heads, kv_heads, jnp.dtype(dtype))
  got, (m, l, acc) = kernel_output(case, schedule, block)
  expected = dense_output(case)  # fp32 maths on the (possibly bf16-rounded) inputs
  if dtype == 'float32':
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)
  else:
    np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=BF16_ATOL)
  # The statistics' convention: an empty row saw no key, so its m is the most negative finite fp32
  # and nothing else was added.
  groups = heads // kv_heads
  assert m.shape == l.shape == (8, kv_heads, groups, length) and acc.shape == m.shape + (HEAD_DIM,)
  assert m.dtype == l.dtype == acc.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(m[0]), NEG)
  np.testing.assert_array_equal(np.asarray(l[0]), 0.0)
  np.testing.assert_array_equal(np.asarray(acc[0]), 0.0)


@schedules
@pytest.mark.parametrize('mesh_shape, heads, kv_heads', [
    pytest.param((2, 1, 4), 8, 4, id='rows+heads'),  # rows over data, kv heads (and their query heads) over tensor
    *(pytest.param(*case, id=name, marks=pytest.mark.exhaustive) for name, case in [
        ('rows+heads-gqa7', ((4, 1, 2), 14, 2)),  # 7 query heads per kv head
        ('rows', ((1, 8, 1), 4, 2)),  # rows only, over fsdp
        ('heads-undivided', ((2, 1, 4), 4, 2))])])  # 2 kv heads on a tensor axis of 4: heads whole, rows split
def test_kernel_on_a_mesh_equals_one_device_and_the_xla_path(seed, schedule, mesh_shape, heads, kv_heads):
  """Under a mesh (the sampler's layout: rows over the data groups, kv heads over tensor) the kernel
  runs inside shard_map on each device's rows and heads: the same statistics as on one device, and
  the same attention as the XLA path (dense grouped attention)."""
  from grpo_jax.model import MeshConfig, make_mesh

  if schedule == 'mosaic_gpu':
    pytest.skip('the Mosaic GPU interpreter keeps one shared memory per process: kernels interpreted on several '
                'devices at once trip its barrier checks; the shard_map around the kernel is every schedule\'s, and '
                'test_decode_attention_kernel_compiles_for_the_hardware[gpu-h100x8-layout] compiles it on 8 GPUs')
  rng = np.random.default_rng(seed)
  block = BLOCKS[schedule]
  case = random_case(rng, fill_levels(rng, 8, block), 2, heads, kv_heads, jnp.float32)
  alone = kernel_output(case, schedule, block)
  mesh = make_mesh(MeshConfig(*mesh_shape))
  on_mesh = jax.jit(kernel_output.__wrapped__, static_argnames=('schedule', 'block'))
  with jax.set_mesh(mesh):
    got = on_mesh(case, schedule=schedule, block=block)
    assert 'shard_map' in str(jax.make_jaxpr(on_mesh.__wrapped__, static_argnums=(1, 2))(case, schedule, block))
  for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(alone)):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[0]), dense_output(case), rtol=1e-5, atol=1e-5)


def test_mosaic_gpu_kernel_equals_dense_attention_and_skips_what_is_past_each_length(seed):
  """make test's case of the Mosaic GPU schedule (the others run in test-all): 14 query heads over 2
  kv heads in bf16 against dense attention, and NaN past each row's length never read."""
  test_ragged_kernel_equals_dense_attention(seed, 'mosaic_gpu', 3, 14, 2, 'bfloat16')
  test_slots_past_each_rows_own_length_are_never_used(seed, 'mosaic_gpu')


def prompted_case(rng, length, heads, kv_heads, dtype, groups=2, prompts=3, width=128):
  """random_case plus a SharedPrefix's layer: `groups` groups of `prompts` prompts of `width`
  slots (segments 0 on padding, 1 the query's, 2 another's), each row reading a random one of its
  group's; rows whose cache has room for the T new tokens. -> (case, prompt, the rows' copies of
  their prompts as a grouped_attention part)."""
  lengths = np.minimum(fill_levels(rng, 8, BLOCKS['mosaic_gpu']), SLOTS - length).astype(np.int32)
  case = random_case(rng, lengths, length, heads, kv_heads, dtype)
  # A decode step's queries sit at the row's next slots: the new tokens, once written, are then
  # what the causal rule among them shows each query.
  case['query_slots'] = (lengths[:, None] + np.arange(length)[None]).astype(np.int32)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
  k, v = (normal(groups, prompts, width, kv_heads, HEAD_DIM) for _ in range(2))
  segments = rng.integers(0, 3, (groups, prompts, width)).astype(np.int32)
  index = rng.integers(0, prompts, (groups, len(lengths) // groups)).astype(np.int32)
  picked = lambda x: x[np.arange(groups)[:, None], index].reshape((len(lengths),) + x.shape[2:])  # noqa: E731
  rows = picked(segments)
  mask = (rows[:, None, :] == case['query_segments'][:, :, None]) & (rows != 0)[:, None, :]
  return case, (k, v, jnp.asarray(index), jnp.asarray(segments)), (picked(k), picked(v), jnp.asarray(mask))


def written_case(case):
  """The case with its new tokens written into its layer of the cache (and counted in its lengths
  and segments), as a decode step that writes before it attends holds it."""
  rows = np.arange(len(case['lengths']))[:, None]
  slots = case['lengths'][:, None] + np.arange(case['q'].shape[1])
  written = dict(case, lengths=case['lengths'] + case['q'].shape[1])
  written['k_cache'] = case['k_cache'].at[case['layer'], rows, slots].set(case['new_k'])
  written['v_cache'] = case['v_cache'].at[case['layer'], rows, slots].set(case['new_v'])
  written['cache_segments'] = case['cache_segments'].copy()
  written['cache_segments'][rows, slots] = case['query_segments']
  return written


def decode_kernel(case, initial, prompt, block):
  return decode_attention.ragged_decode_attention(
      case['q'], initial, case['k_cache'], case['v_cache'], case['layer'], case['lengths'], case['cache_segments'],
      case['query_segments'], case['query_slots'], block=block, prompt=prompt, schedule='mosaic_gpu')


@pytest.mark.parametrize('length, dtype, starts', [
    (3, 'float32', ('written',)),  # make test's: the path an unrolled decode step on a GPU takes
    pytest.param(3, 'float32', ('started',), marks=pytest.mark.exhaustive),
    pytest.param(10, 'bfloat16', ('started', 'written'), marks=pytest.mark.exhaustive)])
def test_mosaic_gpu_decode_attention_reads_the_prompt_in_place_and_ends_the_softmax(seed, length, dtype, starts):
  """The whole decode attention in one Mosaic GPU kernel (interpreted): each row's shared prompt
  read at its index, then its cache, the softmax ended in the kernel. Started from the new tokens'
  statistics, or with the new tokens written into the cache first (what an unrolled decode step on a
  GPU does), it equals dense grouped attention over the row's copy of its prompt, its cache and
  its new tokens. 10 tokens x 7 query heads are 70 query rows per kv head: two parts of 64, the
  last storing 6 rows."""
  rng = np.random.default_rng(seed)
  block = BLOCKS['mosaic_gpu']
  case, prompt, copies = prompted_case(rng, length, 14, 2, jnp.dtype(dtype))
  layer = case['layer']
  expected = grouped_attention(
      case['q'].astype(jnp.float32), [tuple(jnp.asarray(x, jnp.float32) for x in part) for part in (
          copies, (case['k_cache'][layer], case['v_cache'][layer], jnp.asarray(cache_mask(case))), new_token_part(case))])
  tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == 'float32' else dict(rtol=0, atol=BF16_ATOL)
  runs = dict(started=lambda: decode_kernel(case, part_stats(case['q'], *new_token_part(case)), prompt, block),
              written=lambda: decode_kernel(written_case(case), None, prompt, block))
  for got in (runs[name]() for name in starts):
    assert got.shape == case['q'].shape and got.dtype == case['k_cache'].dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected), **tolerance)


@schedules
def test_slots_past_each_rows_own_length_are_never_used(seed, schedule):
  """NaN in every slot at or past each row's own length, in both layers: a slot read into the
  softmax there, or a value weighted by an exact 0 (0 x NaN), would poison that row. Rows end
  inside a block, on an edge, empty and full, so a kernel bounded by the fullest row (the full
  one) would read NaN in every other row."""
  rng = np.random.default_rng(seed)
  block = BLOCKS[schedule]
  lengths = np.asarray([5, block, 0, SLOTS, block + 7, 2 * block - 1], np.int32)
  case = random_case(rng, lengths, 1, 4, 2, jnp.float32)
  expected = dense_output(case)
  past = np.arange(SLOTS)[None, :] >= lengths[:, None]  # [B, S]
  for name in ('k_cache', 'v_cache'):
    case[name] = jnp.where(past[None, :, :, None, None], jnp.nan, case[name])
  got, _ = kernel_output(case, schedule, block)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@schedules
def test_an_unstacked_cache_reads_like_its_layer_of_the_stack(seed, schedule):
  rng = np.random.default_rng(seed)
  block = BLOCKS[schedule]
  case = random_case(rng, fill_levels(rng, 6, block), 1, 4, 2, jnp.float32)
  args = (case['lengths'], case['cache_segments'], case['query_segments'], case['query_slots'])
  layer = case['layer']
  stacked = ragged_cache_attention(case['q'], case['k_cache'], case['v_cache'], layer, *args, block=block,
                                   schedule=schedule)
  single = ragged_cache_attention(case['q'], case['k_cache'][layer], case['v_cache'][layer], None, *args,
                                  block=block, schedule=schedule)
  for one, other in zip(stacked, single):
    np.testing.assert_array_equal(np.asarray(one), np.asarray(other))


def test_mosaic_copies_only_each_rows_own_blocks():
  """Output values cannot show which blocks were skipped (a block past a row's length is fully
  masked either way), so this checks the schedule itself: the pipeline copies a cache block when
  a row's grid step maps to a new block index, and the index maps send row b's steps to exactly
  its written blocks (block 0 alone for an empty row); its compute runs for steps j < that count.
  The Mosaic GPU kernel loops over the same row_blocks(length, block) blocks."""
  block, slots = 128, 1024
  lengths = np.asarray([0, 1, 128, 129, 700, 1024], np.int32)
  for b, length in enumerate(lengths):
    indices = [int(decode_attention_mosaic.block_index(b, j, lengths, block)) for j in range(slots // block)]
    copies = 1 + sum(one != other for one, other in zip(indices, indices[1:]))
    assert copies == max(1, decode_attention.row_blocks(int(length), block)) == max(1, -(-length // block))
    assert indices == sorted(indices) and max(indices) * block < max(length, 1)


def test_mosaic_blocks_are_rows_of_128_lanes_that_fit_vmem():
  size = decode_attention.block_size
  assert size('mosaic', 4096, 512, 8, 128, 2) == 512  # 32B bf16: 8 MiB of double-buffered blocks
  assert size('mosaic', 4096, 1024, 4, 128, 2) == 512
  assert size('mosaic', 4096, 768, 8, 128, 4) == 384  # fp32: 12 MiB at 768 slots; still 128k
  assert size('mosaic', 100, 512, 2, 64, 2) == 100  # the whole cache
  with pytest.raises(ValueError, match='block % 128'):
    size('mosaic', 4096, 200, 2, 64, 2)


def test_mosaic_gpu_blocks_are_multiples_of_64_that_fit_shared_memory():
  """Two [block, H] key and value tiles each and the [64, H] query tile within 160 KiB of an H100's
  227 KiB; the cache's slots bound the block (a last block past them starts earlier)."""
  size = decode_attention.block_size
  assert size('mosaic_gpu', 4096, 256, 8, 64, 2) == 256  # 0.5B: 136 KiB
  assert size('mosaic_gpu', 4096, 256, 8, 128, 2) == 128  # 7B, 32B: 272 KiB at 256, 144 KiB at 128
  assert size('mosaic_gpu', 1024, 256, 2, 64, 2) == 256  # the 0.5B recipe's 1,024-slot cache: 4 blocks
  assert size('mosaic_gpu', 100, 256, 2, 64, 2) == 64
  for block in (32, 96 + 8):
    with pytest.raises(ValueError, match='multiple of 64'):
      size('mosaic_gpu', 4096, block, 2, 64, 2)
  with pytest.raises(ValueError, match='at least 64 slots'):
    size('mosaic_gpu', 40, 64, 2, 64, 2)


def test_an_unknown_schedule_is_refused():
  with pytest.raises(ValueError, match='schedule'):
    decode_attention.block_size('triton', 4096, 256, 2, 64, 2)


# ---- compiled by the real Mosaic and Mosaic GPU compilers (deviceless) ----

@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('platform, target, mesh', [('tpu', 'v5e-4', None), ('gpu', 'h100x1', None),
                                                   ('tpu', 'v5p-8', 'data=2,tensor=2'), ('gpu', 'h100x8', 'data=2,tensor=4')],
                         ids=['tpu-v5e-4', 'gpu-h100x1', 'tpu-v5p-8-layout', 'gpu-h100x8-layout'])
def test_decode_attention_kernel_compiles_for_the_hardware(platform, target, mesh):
  """Qwen2.5 0.5B, 7B and 32B head shapes, bf16, 64 rows of a 4,096-slot cache stacked over two
  layers: one kernel call in each lowered program (not the interpreter), compiled, and no copy of
  a layer's cache among the program's temporaries (the layer is read in place). With a mesh, laid
  out as the sampler's rollout layout lays the cache out (rows over data groups, kv heads over
  tensor): the kernel inside its shard_map, each device's cache its share only."""
  result = _run(platform, ['grpo_jax.plan.targets', 'decode-attention', target] + (['--mesh', mesh] if mesh else []),
                timeout=600)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  assert [line['model'] for line in lines] == ['0.5B', '7B', '32B'], result.stderr[-3000:]
  heads = {'0.5B': (2, 64), '7B': (4, 128), '32B': (8, 128)}  # K, H
  for line in lines:
    assert line['error'] is None, line
    assert line['kernel_calls'] == 1, line
    assert line['temp_bytes'] < line['layer_cache_bytes'] // 8, line
    if mesh:  # rows over data, and the kv heads over tensor where it divides them
      data, tensor = line['mesh']['data'], line['mesh']['tensor']
      kv_heads, head_dim = heads[line['model']]
      share = data * (tensor if kv_heads % tensor == 0 else 1)
      assert line['layer_cache_bytes'] == 64 * 4096 * kv_heads * head_dim * 2 // share, line
  assert result.returncode == 0


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_gpu_kernel_compiles_for_a_prefill_chunk():
  """512 query tokens per row (a prefill chunk) at the 0.5B, 7B and 32B head shapes on an H100: the
  query rows go in parts of 64 (the Mosaic GPU schedule's grid axis; the Triton one, in one program,
  asked for 656 KB of shared memory at the 0.5B shape and 1.3 MB at the 7B and 32B, of the 227 KB
  there are)."""
  result = _run('gpu', ['grpo_jax.plan.targets', 'decode-attention', 'h100x1', '--tokens', '512'], timeout=600)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  assert [line['model'] for line in lines] == ['0.5B', '7B', '32B'], result.stderr[-3000:]
  assert all(line['error'] is None and line['kernel_calls'] == 1 for line in lines), lines
