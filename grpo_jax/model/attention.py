"""Grouped-query attention of Qwen2: the causal segment mask and its implementations.

Dimension letters: B batch, T query tokens, S key tokens, N query heads, K key/value heads,
G = N / K query heads per key/value head, H head dim. Every implementation computes the same
function: fp32 scores scaled by H^-1/2, masked with the most negative finite fp32, an fp32
softmax, and the probabilities cast to the values' dtype before they weight the values.
"""

import functools
import typing
from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from grpo_jax.model.quantize import Quantized
from grpo_jax.ops import fixed_order
from grpo_jax.sharding import constrain

# Full-sequence attention: 'dense' (the [T, T] scores at once), 'chunked' (query chunks one at a
# time, rematerialised: O(chunk x T) memory), 'cudnn' (cuDNN fused attention through
# jax.nn.dot_product_attention; NVIDIA GPUs only), 'auto' (resolve_attention: 'cudnn' when compiling
# for NVIDIA GPUs in bf16 or fp16, else 'chunked').
AttentionImplementation = Literal['dense', 'chunked', 'cudnn', 'auto']
ATTENTION_IMPLEMENTATIONS = typing.get_args(AttentionImplementation)


def resolve_attention(implementation: AttentionImplementation, dtype) -> AttentionImplementation:
  """'auto' as the code being traced is compiled: 'cudnn' for NVIDIA GPUs (the mesh's devices, which
  may be a deviceless target, else the default backend; cuDNN's fused attention takes bf16 and
  fp16 only), 'chunked' elsewhere. Any other implementation as it is."""
  if implementation != 'auto':
    return implementation
  if fixed_order.exact('attention'):  # cuDNN orders its own sums
    return 'chunked'
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device
  platform = device.platform if device is not None else jax.default_backend()
  rocm = platform == 'rocm' or (platform == 'gpu' and 'rocm' in jax.devices()[0].client.platform_version.lower())
  half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  return 'cudnn' if platform in ('cuda', 'gpu') and not rocm and half else 'chunked'

# attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H]) -> [B, T, N, H]: T tokens over themselves.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def real_segments(tokens: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """segment_ids as int32 [B, T]; when None, every token is real and each row one sequence."""
  if segment_ids is None:
    return jnp.ones(tokens.shape, jnp.int32)
  return segment_ids.astype(jnp.int32)


# Tree rows (rl/packing.py: a prompt's tokens once for several completions). A segment id below
# TREE_BRANCHES is a sequence of its own. From it up, id t x TREE_BRANCHES (t >= 1) is tree t's
# root, the prompt, and t x TREE_BRANCHES + b (1 <= b < TREE_BRANCHES) its branch b: a completion,
# which sees the root's tokens and its own. A row holds each tree whole, its root first and its
# branches right after it (segment_positions counts a branch's positions on from its root's).
TREE_BRANCHES = 1 << 16


def tree_root(segments: jax.Array) -> jax.Array:
  """The root segment each token also sees: its tree's for a branch token, else its own."""
  return jnp.where(segments >= TREE_BRANCHES, segments - segments % TREE_BRANCHES, segments)


def attention_mask(query_slots, query_segments, key_slots, key_segments) -> jax.Array:
  """[B, T, S] bool: causal in slot order and restricted to the query's own segment (and, for a
  tree's branch, its root's: TREE_BRANCHES).

  query_slots, query_segments: [B, T]; key_slots, key_segments: [B, S].
  """
  causal = key_slots[:, None, :] <= query_slots[:, :, None]
  same_segment = ((key_segments[:, None, :] == query_segments[:, :, None])
                  | (key_segments[:, None, :] == tree_root(query_segments)[:, :, None]))
  return causal & same_segment


def window_mask(query_ordinals: jax.Array, key_ordinals: jax.Array, window: jax.Array) -> jax.Array:
  """[B, T, S] bool: the keys at most window - 1 tokens before the query (sliding-window attention).

  Ordinals [B, T] and [B, S] count the real tokens of a sequence before each token (a token's
  position when positions are the default), so the distance between two tokens of one sequence is
  the same whether its row is left-padded, packed with others or split between a prompt cache and
  the row's own; only pairs attention_mask allows (same segment, causal) are meaningful. window:
  a scalar int32, per layer.
  """
  return (query_ordinals[:, :, None] - key_ordinals[:, None, :]) < window


def _concatenate_keys(arrays: list[jax.Array], axis: int) -> jax.Array:
  return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=axis)


def _concatenate(arrays: list[jax.Array]) -> jax.Array:
  # One part needs no concatenate op: the dense path's program stays as it was.
  return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-1)


class SharedPart(typing.NamedTuple):
  """Keys that many rows read (one layer of a SharedPrefix: each prompt's, for the rows reading
  it), attended prompt by prompt: the queries of a prompt's readers are gathered to the prompt
  and its keys and values read once, instead of copied into a row of their own for each reader
  (B x W x K x H per layer, G times the prompts' bytes, written and read again every step).

  k, v:     [n, Pn, W, K, H] the prompts of the n groups of rows.
  mask:     [B, T, W] the keys each query may see (its row's prompt's).
  readers:  [n, Pn, R] the rows of group n (0 .. Bn - 1) that read each prompt; Bn where none.
  at:       [n, Bn] each row's place among its prompt's readers (prompt x R + rank), Pn x R
            for a row that reads none (its mask must then be all False).
  """

  k: jax.Array
  v: jax.Array
  mask: jax.Array
  readers: jax.Array
  at: jax.Array


def reader_layout(index: jax.Array, reading: jax.Array, prompts: int, readers: int) -> tuple[jax.Array, jax.Array]:
  """SharedPart's (readers [n, Pn, R], at [n, Bn]) for rows that read prompt index [n, Bn] within
  their group, those with `reading` [n, Bn] False reading none. At most R = `readers` rows may read
  one prompt (a prompt's G samples); a further one would read none."""
  groups, rows = index.shape
  key = jnp.where(reading, index, prompts)  # rows reading nothing sort last
  order = jnp.argsort(key, axis=1, stable=True)
  sorted_key = jnp.take_along_axis(key, order, axis=1)
  first = jax.vmap(lambda keys: jnp.searchsorted(keys, jnp.arange(prompts), side='left', method='compare_all'))(
      sorted_key)  # [n, Pn]: no loop
  rank = jax.vmap(lambda o: jnp.zeros_like(o).at[o].set(jnp.arange(rows, dtype=o.dtype)))(order)  # order's inverse
  place = rank - jnp.take_along_axis(first, jnp.clip(index, 0, prompts - 1), axis=1)
  at = jnp.where(reading & (place < readers), index * readers + place, prompts * readers)
  position = (first[:, :, None] + jnp.arange(readers)).reshape(groups, -1)  # [n, Pn x R] into the sorted rows
  clipped = jnp.clip(position, 0, rows - 1)
  owned = (position < rows) & (jnp.take_along_axis(sorted_key, clipped, axis=1)
                               == jnp.repeat(jnp.arange(prompts), readers)[None])
  table = jnp.where(owned, jnp.take_along_axis(order, clipped, axis=1), rows)
  return table.reshape(groups, prompts, readers).astype(jnp.int32), at.astype(jnp.int32)


def _within(values: jax.Array, index: jax.Array) -> jax.Array:
  """values [n, M, ...], index [n, ...] -> values[g, index[g, ...]] per group; 0 out of range."""
  return jax.vmap(lambda x, i: jnp.take(x, i, axis=0, mode='fill', fill_value=0))(values, index)


def _entries(x, dtype):
  """Cache entries as a matmul reads them: an 8-bit cache's values (Quantized) converted to `dtype`
  as they load, their scale applied outside the matmul (`_scales`); else as they are."""
  return x.values.astype(dtype) if isinstance(x, Quantized) else x


def _scales(x, scale_axes: str, target: str):
  """A Quantized part's per-token, per-head scale [..., S, K, 1] (einsum axes `scale_axes`, the
  last dropped) broadcast to the einsum axes `target` of what it multiplies; 1 for plain entries."""
  if not isinstance(x, Quantized):
    return 1.0
  scale = x.scale[..., 0]
  present = scale_axes[:-1]
  order = ''.join(axis for axis in target if axis in present)
  scale = jnp.einsum(f'{present}->{order}', scale)
  return jnp.expand_dims(scale, [index for index, axis in enumerate(target) if axis not in present])


def _part_scores(q: jax.Array, part) -> jax.Array:
  """q [B, T, K, G, H] against one part's keys -> fp32 scores [B, K, G, T, S_i]. 8-bit keys: the
  values' scores, each scaled by its key's scale."""
  if not isinstance(part, SharedPart):
    k = part[0]
    scores = jnp.einsum('BTKGH,BSKH->BKGTS', q, _entries(k, q.dtype), preferred_element_type=jnp.float32)
    return scores * _scales(k, 'BSKH', 'BKGTS')
  groups, rows = part.at.shape
  picked = _within(q.reshape((groups, rows) + q.shape[1:]), part.readers)  # [n, Pn, R, T, K, G, H]
  scores = jnp.einsum('nPRTKGH,nPWKH->nPRKGTW', picked, _entries(part.k, q.dtype), preferred_element_type=jnp.float32)
  scores = scores * _scales(part.k, 'nPWKH', 'nPRKGTW')
  scores = _within(scores.reshape((groups, -1) + scores.shape[3:]), part.at)  # [n, Bn, K, G, T, W]
  return scores.reshape((groups * rows,) + scores.shape[2:])


def _part_values(probs: jax.Array, part) -> jax.Array:
  """One part's probabilities [B, K, G, T, S_i] over its values -> [B, T, K, G, H]. 8-bit values:
  each probability scaled by its value's scale first."""
  if not isinstance(part, SharedPart):
    v = part[1]
    weights = (probs * _scales(v, 'BSKH', 'BKGTS')).astype(probs.dtype)
    return jnp.einsum('BKGTS,BSKH->BTKGH', weights, _entries(v, probs.dtype))
  groups, rows = part.at.shape
  picked = _within(probs.reshape((groups, rows) + probs.shape[1:]), part.readers)  # [n, Pn, R, K, G, T, W]
  picked = (picked * _scales(part.v, 'nPWKH', 'nPRKGTW')).astype(probs.dtype)
  out = jnp.einsum('nPRKGTW,nPWKH->nPRTKGH', picked, _entries(part.v, probs.dtype))
  out = _within(out.reshape((groups, -1) + out.shape[3:]), part.at)  # [n, Bn, T, K, G, H]
  return out.reshape((groups * rows,) + out.shape[2:])


def grouped_attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array] | SharedPart]) -> jax.Array:
  """q attends over the keys of every part with one softmax. q: [B, T, N, H]; parts: (k, v
  [B, S_i, K, H], mask [B, T, S_i]), or SharedParts, with one value dtype -> [B, T, N, H].

  Query head n uses key/value head n // G. The softmax runs over the concatenated S_1 + S_2 + ...
  scores, so attending over parts is attending over their concatenated keys; only the small score
  arrays are concatenated, never the keys or values (a KV cache part is read in place). A fully
  masked row gives a uniform, not NaN, row.

  Under exact numerics (ops/fixed_order.py) the parts' keys are joined in their order (a shared
  prompt's, the cache's, the new tokens': the sequence's) and every sum over them folded in that
  order, so a query's output is the same however its keys are split into parts and padded; a
  fully masked row gives 0.
  """
  if fixed_order.exact('attention'):
    if any(isinstance(part, SharedPart) for part in parts):
      raise ValueError('exact numerics read a shared prompt as each row\'s copy (prompt_reads copy), not once')
    joined = [_concatenate_keys([part[i] for part in parts], axis) for i, axis in ((0, 1), (1, 1), (2, 2))]
    return fixed_order.fixed_attention(q, *joined)
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = parts[0][0].shape[-2]
  q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores = _concatenate([_part_scores(q, part) for part in parts])
  scores = scores * (head_dim ** -0.5)
  mask = _concatenate([part[2] for part in parts])
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  values = parts[0][1]
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype if isinstance(values, Quantized) else values.dtype)
  out, start = None, 0
  for part in parts:
    width = part[0].shape[-3]
    one = _part_values(probs if len(parts) == 1 else probs[..., start:start + width], part)
    out = one if out is None else out + one
    start += width
  return out.reshape(batch, length, num_heads, out.shape[-1])  # the values' width (MLA's may differ from H)


# Attention over the KV cache while decoding: 'dense' (every slot, masked), 'blockwise' (XLA: blocks
# up to the fullest row's length), 'pallas' (the ragged kernel, ops/decode_attention.py: each row
# reads its own blocks only; one device, not yet split over a mesh).
# Attention over the KV cache while decoding (`cache_attention`): 'dense' reads every slot of each
# cache row (masked); 'blockwise' reads blocks only up to the fullest row's written length;
# 'pallas' runs the ragged kernel, each row reading blocks only up to its own length. The last two
# read the stacked [L, B, S, K, H] cache by layer index instead of taking each layer's rows.
DecodeAttention = Literal['dense', 'blockwise', 'pallas']
DECODE_ATTENTIONS = typing.get_args(DecodeAttention)


def reads_stacked_cache(implementation: DecodeAttention) -> bool:
  return implementation in ('blockwise', 'pallas')


def ends_softmax(implementation: DecodeAttention) -> bool:
  """Whether `implementation` runs a decode step's whole attention in one kernel, the softmax ended
  there: 'pallas' where its schedule does (Mosaic GPU's, ops/decode_attention.ends_softmax)."""
  if implementation != 'pallas':
    return False
  from grpo_jax.ops import decode_attention  # no Pallas import: the kernels import it when they run
  return decode_attention.ends_softmax()


def fuses_prompts(implementation: DecodeAttention, prompt_width: int) -> bool:
  """Whether `cache_attention` takes shared prompts of `prompt_width` slots whole into its kernel
  (read in place): where it ends the softmax, for prompts of at least one 64-slot block."""
  return prompt_width >= 64 and ends_softmax(implementation)


def written_cache_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: int, lengths: jax.Array,
                            cache_segments: jax.Array, query_segments: jax.Array, query_slots: jax.Array,
                            block: int, prompt=None) -> jax.Array:
  """q [B, T, N, H] over the stacked cache [L, B, S, K, H] at `layer` into which this call's T
  tokens are already written (lengths [B] and cache_segments [B, S] count them), after the shared
  prompt `prompt` (cache_attention's) if any: one kernel (`ends_softmax`), so the new tokens need
  no part of their own."""
  from grpo_jax.ops import decode_attention  # Pallas, imported only when this path runs
  return decode_attention.ragged_decode_attention(q, None, k_cache, v_cache, layer, lengths, cache_segments,
                                                  query_segments, query_slots, block=block, prompt=prompt)


def _block_size(length: int, block: int) -> int:
  """The largest block <= `block` that divides `length` (dynamic slices must not overlap)."""
  block = min(block, length)
  while length % block:
    block -= 1
  return block


def blockwise_cache_attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
                              k_cache: jax.Array, v_cache: jax.Array, cache_mask: jax.Array, lengths: jax.Array,
                              block: int, layer: jax.Array | None = None) -> jax.Array:
  """`grouped_attention(q, parts + [(k_cache, v_cache, cache_mask)])`, reading only the cache
  blocks that hold a written slot of some row: q [B, T, N, H]; parts as in grouped_attention
  (small: the new tokens, a prompt); k_cache, v_cache [B, S, K, H]; cache_mask [B, T, S], False
  at slots >= lengths [B]. One online softmax (running max, sum and weighted values, fp32): the
  parts first, then blocks of `block` slots (a divisor of S) in a loop that stops after block
  ceil(max(lengths) / block), so a decode step's cost follows how full the cache is, not S.
  Every query must see at least one key among `parts` (a decoded token sees itself), which keeps
  the running max finite; masked keys weigh exactly 0. Not differentiable (decoding only).

  layer: with stacked caches [L, B, S, K, H], the layer to read; each block is sliced from the
  stack itself, so no layer's whole cache is ever copied out of it (a per-layer slice handed to
  the loop would be materialised: a copy of the whole cache every decode step).
  """
  batch, length, num_heads, head_dim = q.shape
  stacked = layer is not None
  slots, num_kv_heads = k_cache.shape[1 + stacked], k_cache.shape[2 + stacked]
  block = _block_size(slots, block)
  q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim) * (head_dim ** -0.5)
  neg = jnp.finfo(jnp.float32).min

  def scores(k, mask):  # -> [B, K, G, T, S] fp32
    s = jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, None, None], s, neg)

  def merge(stats, s, v, mask):
    m, l, acc = stats
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
    scale = jnp.exp(m - m_new)
    acc = acc * scale[..., None] + jnp.einsum('BKGTS,BSKH->BKGTH', p.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return m_new, l * scale + p.sum(axis=-1), acc

  shape = (batch, num_kv_heads, num_heads // num_kv_heads, length)
  value_width = v_cache.shape[-1]
  stats = (jnp.full(shape, neg, jnp.float32), jnp.zeros(shape, jnp.float32),
           jnp.zeros(shape + (value_width,), jnp.float32))
  for k, v, mask in parts:
    stats = merge(stats, scores(k, mask), v, mask)

  def body(carry):
    index, stats = carry
    start = index * block
    if stacked:
      at = (layer, 0, start, 0, 0)
      k, v = (jax.lax.dynamic_slice(cache, at, (1, batch, block, num_kv_heads, cache.shape[-1]))[0]
              for cache in (k_cache, v_cache))
    else:
      k = jax.lax.dynamic_slice_in_dim(k_cache, start, block, axis=1)
      v = jax.lax.dynamic_slice_in_dim(v_cache, start, block, axis=1)
    mask = jax.lax.dynamic_slice_in_dim(cache_mask, start, block, axis=2)
    return index + 1, merge(stats, scores(k, mask), v, mask)

  blocks = (jnp.max(lengths) + block - 1) // block
  _, (_, l, acc) = jax.lax.while_loop(lambda carry: carry[0] < blocks, body, (jnp.int32(0), stats))
  out = acc / l[..., None]  # [B, K, G, T, H]
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, value_width).astype(v_cache.dtype)


def ragged_kernel_attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]],
                            k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, lengths: jax.Array,
                            cache_segments: jax.Array, query_segments: jax.Array, query_slots: jax.Array,
                            block: int, prompt=None) -> jax.Array:
  """`blockwise_cache_attention` with the cache part in the ragged Pallas kernel: the small parts'
  online-softmax statistics in XLA, the stacked cache's [L, B, S, K, H] at `layer` from the kernel
  (each row reading only its own written blocks; the mask from the cache's segment ids and the
  query's segments and slots), merged into one softmax. Where the kernel ends the softmax itself
  (decode_attention.ends_softmax: Mosaic GPU's) it starts from the parts' statistics and also reads
  `prompt` (a SharedPrefix's layer, decode_attention.ragged_decode_attention) in place: the whole
  attention is then one kernel and the parts' statistics one fusion."""
  from grpo_jax.ops import decode_attention  # Pallas, imported only when this path runs
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k_cache.shape[3]
  grouped_q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  neg = jnp.finfo(jnp.float32).min
  stats = None
  for k, v, mask in parts:
    s = jnp.einsum('BTKGH,BSKH->BKGTS', grouped_q, k, preferred_element_type=jnp.float32) * (head_dim ** -0.5)
    s = jnp.where(mask[:, None, None], s, neg)
    m = s.max(axis=-1)
    p = jnp.where(mask[:, None, None], jnp.exp(s - m[..., None]), 0.0)
    part = (m, p.sum(axis=-1), jnp.einsum('BKGTS,BSKH->BKGTH', p.astype(v.dtype), v,
                                          preferred_element_type=jnp.float32))
    stats = part if stats is None else decode_attention.merge_stats(stats, part)
  if decode_attention.ends_softmax():  # the kernel folds the parts' statistics in and ends the softmax
    return decode_attention.ragged_decode_attention(q, stats, k_cache, v_cache, layer, lengths, cache_segments,
                                                    query_segments, query_slots, block=block, prompt=prompt)
  if prompt is not None:
    raise ValueError('a shared prompt read in place needs the kernel that ends the softmax (ends_softmax)')
  cache = decode_attention.ragged_cache_attention(q, k_cache, v_cache, layer, lengths, cache_segments, query_segments,
                                                  query_slots, block=block)
  return decode_attention.finish_stats(decode_attention.merge_stats(stats, cache), v_cache.dtype)


def cache_attention(implementation: DecodeAttention, q: jax.Array, new: tuple, parts: list, k_cache: jax.Array,
                    v_cache: jax.Array, own, cache_mask: jax.Array, lengths: jax.Array, cache_segments: jax.Array,
                    query_segments: jax.Array, query_slots: jax.Array, block: int, prompt=None) -> jax.Array:
  """q [B, T, N, H] over this call's own tokens `new` (k, v, mask), the shared-prefix `parts` and
  the KV cache, as `implementation` reads the cache. own: this layer's cache rows (k, v
  [B, S, K, H]) for 'dense', else its index into the stacked k_cache, v_cache [L, B, S, K, H];
  cache_mask [B, T, S]: the written slots each query may see; lengths [B]: slots written per row;
  cache_segments [B, S], query_segments and query_slots [B, T]: the kernel's own mask;
  block: cache slots per block; prompt: 'pallas' only, where the kernel ends the softmax
  (`fuses_prompts`): a SharedPrefix's layer (k, v, index, segment_ids) read in place by the kernel,
  not in `parts`."""
  if implementation == 'pallas':
    return ragged_kernel_attention(q, [new] + parts, k_cache, v_cache, own, lengths, cache_segments, query_segments,
                                   query_slots, block, prompt)
  if implementation == 'blockwise':
    return blockwise_cache_attention(q, [new] + parts, k_cache, v_cache, cache_mask, lengths, block, layer=own)
  return grouped_attention(q, parts + [(own[0], own[1], cache_mask), new])


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Dense attention. q: [B, T, N, H]; k, v: [B, S, K, H]; mask: [B, T, S] -> [B, T, N, H]."""
  return grouped_attention(q, [(k, v, mask)])


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, segments: jax.Array,
                      chunk: int, ordinals: jax.Array | None = None, window: jax.Array | None = None) -> jax.Array:
  """`attention` of T tokens over themselves, `chunk` queries at a time. q: [B, T, N, H];
  k, v: [B, T, K, H]; slots, segments: [B, T] (the causal order and segment of each token).

  Exact (each chunk's softmax runs over all T keys under the same mask as `attention`). The
  chunks run one after another under `lax.map`, each rematerialised under autodiff, so only one
  chunk's [chunk, T] scores exist at a time, forward or backward: peak score memory is
  O(chunk x T) per layer instead of O(T^2) (measured: T = 1024, chunk 64: 11 MiB of compiled
  temporaries for forward + backward against 129 MiB dense). FLOPs are the dense path's plus
  one recomputation of the attention; the masked upper triangle is still computed. With a
  `window`, keys further back than it from the query are masked too (window_mask over `ordinals`
  [B, T]).
  """
  batch, length = q.shape[:2]
  chunk = min(chunk, length)
  pad = -length % chunk
  windowed = window is not None
  query_ordinals = ordinals if windowed else segments
  query_slots, query_segments = slots, segments
  if pad:  # extra query rows (pad of them) copy the last real one (a non-empty mask) and are dropped below
    q, query_slots, query_segments, query_ordinals = (
        jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode='edge')
        for x in (q, slots, segments, query_ordinals))

  def chunks(x):  # [B, T + pad, ...] -> [(T + pad) / chunk, B, chunk, ...], the rows as the batch's
    stacked = jnp.moveaxis(x.reshape(batch, -1, chunk, *x.shape[2:]), 1, 0)
    return constrain(stacked, (None, 'batch') + (None,) * (stacked.ndim - 2))

  @jax.checkpoint
  def one_chunk(inputs):
    q_chunk, chunk_slots, chunk_segments, chunk_ordinals = inputs
    mask = attention_mask(chunk_slots, chunk_segments, slots, segments)
    if windowed:
      mask = mask & window_mask(chunk_ordinals, ordinals, window)
    return attention(q_chunk, k, v, mask)

  out = jax.lax.map(one_chunk, (chunks(q), chunks(query_slots), chunks(query_segments), chunks(query_ordinals)))
  return jnp.moveaxis(out, 0, 1).reshape(batch, length + pad, *out.shape[3:])[:, :length]


def library_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                      implementation: str) -> jax.Array:
  """`attention` of T tokens over themselves through jax.nn.dot_product_attention ('cudnn':
  cuDNN's fused flash attention on NVIDIA GPUs; 'xla': the library's own XLA path). q:
  [B, T, N, H]; k, v: [B, T, K, H]; mask [B, T, T] must be causal in slot order, as
  `attention_mask` makes it: the call also declares causality, which lets cuDNN skip the upper
  triangle. -> [B, T, N, H] in q's dtype."""
  width = v.shape[-1]
  if width != q.shape[-1]:  # values narrower than the keys (MLA's): padded to their width, the pad cut after
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - width)])
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True,
                                     implementation=implementation)
  return out[..., :width].astype(q.dtype)


def sequence_attention(implementation: AttentionImplementation, slots: jax.Array, segments: jax.Array,
                       chunk: int, ordinals: jax.Array | None = None) -> Callable:
  """The `attend(q, k, v, window=None)` of T tokens over themselves that `implementation` names.
  slots, segments: [B, T] (the causal order and segment of each token); chunk: queries per chunk
  for 'chunked'; ordinals [B, T]: each token's count of earlier real tokens in its sequence, what a
  sliding `window` (a scalar, per layer) measures distance in (window_mask). Every implementation
  takes a window, as part of its mask."""
  if implementation == 'chunked':
    # No [B, T, T] mask: each chunk builds its own [B, chunk, T] block, keeping memory O(chunk x T).
    return functools.partial(chunked_attention, slots=slots, segments=segments, chunk=chunk, ordinals=ordinals)
  mask = attention_mask(slots, segments, slots, segments)

  def attend(q, k, v, window=None):
    full = mask if window is None else mask & window_mask(ordinals, ordinals, window)
    if implementation == 'cudnn':
      return library_attention(q, k, v, full, implementation='cudnn')
    return attention(q, k, v, full)
  return attend
