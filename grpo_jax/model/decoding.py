"""Incremental decoding with a KV cache: prefill, then one token at a time (Qwen2's `init_cache` and
`extend`, a part of the model's class kept in a file of its own). The cache is model/cache.py's;
the attention over it model/attention.py's; a decode step's layers run through the model's own
`run_layers`, scanned or unrolled (ModelOptions.decode_layers), each layer reading its slice of the
cache in place; a sliding-window layer reads its window ring (WindowCache) when the cache keeps one.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model.attention import (SharedPart, attention_mask, cache_attention, ends_softmax, fuses_prompts,
                                      grouped_attention, reader_layout, reads_stacked_cache, real_segments, window_mask,
                                      written_cache_attention)
from grpo_jax.model.cache import (KVCache, SharedPrefix, WindowCache, each, finite, store, unstack, write_ids,
                                  write_layer, write_layers, write_rows)
from grpo_jax.model.latent_attention import latent_values
from grpo_jax.model.layers import decoder_block
from grpo_jax.model.moe import gathered
from grpo_jax.model.quantize import FORMATS, Quantized
from grpo_jax.model.ring_attention import context_size
from grpo_jax.model.vision import Images
from grpo_jax.ops import fixed_order
from grpo_jax.sharding import constrain


def _prefix_parts(prefix: SharedPrefix | None, shared, reading, mask, values) -> list:
  """One layer's shared-prompt part of decode attention: none, each prompt read once for its rows
  (SharedPart, with `reading`'s reader layout), or each row's copy of its prompt. values(k, v): the
  values attention reads of stored keys and values (MLA's: the keys' latent)."""
  if prefix is None:
    return []
  if reading is not None:
    return [SharedPart(shared[0], values(*shared), mask, *reading)]
  k = prefix.rows(shared[0])
  return [(k, values(k, prefix.rows(shared[1])), mask)]


class CacheDecoding:
  """Qwen2's incremental decoding (mixed into model/qwen2.Qwen2, whose config, options, layers and
  run_layers it uses)."""

  @property
  def layered_decode_cache(self) -> bool:
    """Whether a decode step reads its cache best as one array per layer (KVCache.layered): its
    layers unrolled (`decode_layers`) with 'dense' decode attention, which would otherwise take
    each layer's rows out of the stack (a copy on XLA:GPU), or with the kernel that ends the
    softmax (attention.ends_softmax), each layer writing and reading its own arrays."""
    implementation = self.options.decode_attention
    return not self._scan_decode() and (not reads_stacked_cache(implementation) or ends_softmax(implementation))

  def init_cache(self, batch_size: int, max_length: int, layered: bool = False, windowed: bool = False) -> KVCache:
    """An empty (zeroed) cache of B rows of S slots; layered: one array per layer (KVCache).
    windowed: the sliding-window layers keep only their window (a WindowCache of min(window, S)
    entries per row; none where no layer slides or the window holds all S); every path that fills
    rows token by token from an empty row can hold one (model.extend); rows brought in from
    elsewhere at a slot past 0 cannot (sampler/slots.py). With options.kv_cache 'int8' or 'fp8' the
    entries are 8-bit with a scale per token and KV head (model/cache.py)."""
    c = self.config
    sliding = c.sliding_layers if windowed and c.sliding_window is not None and c.sliding_window < max_length else ()
    full_layers = c.num_hidden_layers - sum(sliding)

    heads, key_width, value_width = c.cache_entry  # MLA's: one latent per token, its values read from it

    kind = self.options.kv_cache

    def empty(shape, axes):
      if kind == 'compute':
        return constrain(jnp.zeros(shape, self.dtype), axes)
      # 8-bit values and a scale per token and head (its rank the entries': the same axes, H as 1)
      return Quantized(constrain(jnp.zeros(shape, FORMATS[kind][0]), axes),
                       constrain(jnp.zeros(shape[:-1] + (1,), jnp.float32), axes))

    def zeros(layers, width, entry=key_width):
      shape = (batch_size, width, heads, entry)
      # rows over the batch axes, KV heads over 'tensor' (MLA's one latent head replicated)
      axes = ('batch', 'cache_seq', 'kv_heads' if c.grouped_attention else None, 'head_dim')
      if layered:
        return tuple(empty(shape, axes) for _ in range(layers))
      return empty((layers,) + shape, ('layers',) + axes)

    def row_ints(width, value=0):
      return constrain(jnp.full((batch_size, width), value, jnp.int32), ('batch', 'cache_seq'))
    window = None
    if any(sliding):
      size = c.sliding_window
      window = WindowCache(k=zeros(sum(sliding), size), v=zeros(sum(sliding), size), segment_ids=row_ints(size),
                           ordinals=row_ints(size, -1))
    return KVCache(k=zeros(full_layers, max_length), v=zeros(full_layers, max_length, value_width),
                   segment_ids=row_ints(max_length),
                   length=constrain(jnp.zeros((batch_size,), jnp.int32), ('batch',)), window=window)

  @fixed_order.model_numerics
  def extend(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None, return_hidden: bool = False,
             prefix: SharedPrefix | None = None, return_routing: bool = False, images: Images | None = None,
             position_offsets: jax.Array | None = None):
    """Appends T tokens per row to the cache and returns their logits [B, T, V] and the new cache.

    return_hidden: return the final-norm hidden states [B, T, D] instead of logits, so a prefill
    can project only the positions it samples from (a [P, Tp, V] logits array of a long prompt
    batch over Qwen's 151,936-token vocabulary would be tens of GB).

    Prefill is `extend` of a (left- or right-padded) prompt on an empty cache; decoding is `extend`
    of one token. Each row holds one sequence; by default a token's position is the number of
    real (segment id != 0) tokens before it in its row. The caller keeps length + T <= S.

    prefix: a SharedPrefix each row reads before its own cache row (which then holds only what
    follows the prompt); its real tokens count towards the positions and are attended with the
    same segment rule. Only `cache` is written.

    return_routing: return (out, cache, Routing) with what the sparse layers did for these
    tokens (its `experts` [B, T, Ls, k] are what the sampler records; None in a dense model).

    images: a prefill's images (model/vision.py); its positions are then M-RoPE's [B, T, 3].
    position_offsets [B]: added to the default positions (M-RoPE: a decoded token after an image
    prompt sits at its count of real tokens before it plus the prompt's offset).
    """
    if (context_size() > 1 and tokens.shape[1] == cache.max_length and prefix is None and cache.window is None
        and position_offsets is None):
      return self._context_prefill(tokens, cache, positions, segment_ids, return_hidden, return_routing, images)
    segment_ids = real_segments(tokens, segment_ids)
    prefix_segments = None if prefix is None else prefix.rows(prefix.segment_ids)  # [B, W]
    # Each token's count of real tokens before it in its row (the prompt's included): its default
    # position, and what a sliding window measures distance in.
    previous = jnp.sum(cache.segment_ids != 0, axis=1, dtype=jnp.int32)
    if prefix is not None:
      previous = previous + jnp.sum(prefix_segments != 0, axis=1, dtype=jnp.int32)
    running = jnp.cumsum(segment_ids != 0, axis=1, dtype=jnp.int32) - 1
    ordinals = previous[:, None] + jnp.maximum(running, 0)
    if positions is None:
      positions = ordinals if position_offsets is None else ordinals + position_offsets[:, None]
    length = tokens.shape[1]
    query_slots = cache.length[:, None] + jnp.arange(length, dtype=jnp.int32)
    key_slots = jnp.broadcast_to(jnp.arange(cache.max_length, dtype=jnp.int32),
                                 cache.segment_ids.shape)
    # Cached slots before `length` (the slots from `length` on are this call's tokens, attended
    # through `mask`, or still empty).
    cache_mask = (attention_mask(query_slots, segment_ids, key_slots, cache.segment_ids)
                  & (key_slots < cache.length[:, None])[:, None, :])
    mask = attention_mask(query_slots, segment_ids, query_slots, segment_ids)

    # The cache is a layer input, read in place; only the T new tokens' keys and values leave each
    # layer, and they are written into the cache once, after the loop. Carrying the stacked cache
    # through a scan instead copies each layer's [B, S, K, H] slice in and out every step.
    # The prompt's keys come before all of the row's own: only the segment rule applies.
    prefix_mask = (None if prefix is None else
                   (prefix_segments[:, None, :] == segment_ids[:, :, None]) & (prefix_segments != 0)[:, None, :])
    settings = self.layer_settings()
    if settings[1] is not None:  # the keys' counts of real tokens before them (attention.window_mask)
      prompt_count = 0 if prefix is None else jnp.sum(prefix_segments != 0, axis=1, dtype=jnp.int32)[:, None]
      cache_ordinals = jnp.cumsum(cache.segment_ids != 0, axis=1, dtype=jnp.int32) - 1 + prompt_count
      prefix_ordinals = None if prefix is None else jnp.cumsum(prefix_segments != 0, axis=1, dtype=jnp.int32) - 1

    implementation = self.options.decode_attention
    stacked = reads_stacked_cache(implementation)
    mla = self.config.mla
    # The values attention reads of stored keys and values: MLA's cache holds the latent in its keys.
    values = (lambda k, v: latent_values(self.config, k)) if mla else (lambda k, v: v)  # noqa: E731
    scan = self._scan_decode() if length == 1 else None
    ring = cache.window
    if ring is not None:
      # Two kinds of cache row, a window's and a whole sequence's: the layers run unrolled, each
      # reading its own stack. A window layer attends over its ring densely (it holds W entries).
      scan = False
      sliding = np.asarray(self.config.sliding_layers)
      ring_mask = ((ring.segment_ids[:, None, :] == segment_ids[:, :, None]) & (ring.segment_ids != 0)[:, None, :]
                   & (ring.ordinals[:, None, :] < ordinals[:, :, None]))
    layered = cache.layered
    # Unrolled, where one kernel ends each layer's softmax: each layer writes its new keys and values
    # into its cache (in place) before it attends, so the kernel reads them there and the new tokens
    # need no attention part of their own, nor a write after the loop. A layered cache keeps each
    # layer's write and read to that layer's arrays.
    written = None
    if (scan is False and ring is None and not mla and length < cache.max_length and ends_softmax(implementation)):
      written = dict(k=list(cache.k) if layered else cache.k, v=list(cache.v) if layered else cache.v,
                     segments=write_ids(cache.segment_ids, segment_ids, cache.length))
    elif layered and (stacked or self._scans(scan)):  # these read a stack: one is made (a copy)
      cache = cache.stacked()
    # Unrolled decode layers with 'dense' attention take their layer's cache rows when the layer's
    # input exists: the index passes an optimization barrier with x. Sliced up front, XLA:GPU held
    # every layer's copy at once (the 32B recipe's rollout: 92 GiB of temporaries per H100, not 48).
    # A layered cache needs neither: each layer reads its own arrays.
    ordered = scan is False and not stacked and not cache.layered
    entries = cache.entries  # what the new keys and values are stored like
    # The new tokens attend to their own keys and values as the cache holds them (rounded to its
    # dtype); an 8-bit cache's in the compute dtype, as a compute cache's (its entries' rounding is
    # what later steps read).
    dtype = self.dtype if isinstance(entries, Quantized) else cache.dtype
    reading = None
    if self._reads_prompts_once(prefix) and implementation == 'dense':
      groups, per_prompts = prefix.segment_ids.shape[:2]
      reads = jnp.any(segment_ids != 0, axis=1).reshape(groups, -1)
      reading = reader_layout(prefix.index, reads, per_prompts, prefix.readers)

    def layer_of(stacks, index, x):  # one layer's (k, v) of a pair of stacks (or tuples), after x exists
      if isinstance(stacks[0], tuple):
        return (stacks[0][index], stacks[1][index]), x
      index, x = jax.lax.optimization_barrier((jnp.int32(index), x))
      return tuple(each(lambda s: jax.lax.dynamic_index_in_dim(s, index, keepdims=False), stack) for stack in stacks), x

    def layer(x, params, inputs, _):
      (frequency, window), (own, *shared) = inputs  # own: this layer's cache rows, or its index into them
      windowed = {}  # each mask with this layer's sliding window, if it has one
      if window is not None:
        windowed = {'new': mask & window_mask(ordinals, ordinals, window),
                    'cache': cache_mask & window_mask(ordinals, cache_ordinals, window),
                    'prefix': None if prefix is None else prefix_mask & window_mask(ordinals, prefix_ordinals, window)}
      own_mask, new_mask = windowed.get('cache', cache_mask), windowed.get('new', mask)
      # The kernel that ends the softmax reads each row's prompt in place (no window, no latent).
      in_kernel = (prefix is not None and window is None and not mla and ring is None
                   and fuses_prompts(implementation, prefix.segment_ids.shape[-1]))
      prompt = (shared[0], shared[1], prefix.index, prefix.segment_ids) if in_kernel else None
      parts = [] if in_kernel else _prefix_parts(prefix, shared, reading, windowed.get('prefix', prefix_mask), values)
      in_ring = False
      if ring is not None:  # own: (whether the layer keeps a window ring, its index in its stack)
        in_ring, own = bool(own[0]), int(own[1])
        if in_ring:
          (ring_k, ring_v), x = layer_of((ring.k, ring.v), own, x)
          parts.append((ring_k, ring_v, ring_mask & window_mask(ordinals, ring.ordinals, window)))
        elif not stacked:
          own, x = layer_of((cache.k, cache.v), own, x)
      elif cache.layered and written is None:
        own = (cache.k[int(own)], cache.v[int(own)])
      elif ordered:
        own, x = jax.lax.optimization_barrier((own, x))
        own = tuple(each(lambda s, i=own: jax.lax.dynamic_index_in_dim(s, i, keepdims=False), stack)
                    for stack in (cache.k, cache.v))

      def attend(q, k, v):
        # The new keys and values as the cache will hold them (rounded to its dtype, finite).
        new = (finite(k.astype(dtype)), finite(v.astype(dtype)), new_mask)
        if written is not None:
          index = int(own)
          for name, entry in (('k', new[0]), ('v', new[1])):
            if layered:
              written[name][index] = write_rows(written[name][index], entry, cache.length)
            else:
              written[name] = write_layer(written[name], entry, index, cache.length)
          stacks = [written[name][index][None] if layered else written[name] for name in ('k', 'v')]
          return written_cache_attention(q, *stacks, 0 if layered else index, cache.length + length,
                                         written['segments'], segment_ids, query_slots, self.options.decode_block,
                                         prompt=prompt)
        if in_ring:  # the prompt, the ring, the new tokens: dense, over W entries
          return grouped_attention(q, parts + [new])
        rows = own if stacked else (own[0], values(*own))
        return cache_attention(implementation, q, new, parts, cache.k, values(cache.k, cache.v) if stacked else cache.v,
                               rows, own_mask,
                               cache.length, cache.segment_ids, segment_ids, query_slots, self.options.decode_block,
                               prompt=prompt)

      return decoder_block(params, x, positions, attend, config=self.config, dtype=self.dtype,
                           inverse_frequency=self.frequency(frequency), lora_scale=self.lora_scale,
                           real=segment_ids != 0, absorbed=mla)

    layers = self.config.num_hidden_layers
    if ring is not None:  # (window layer, index in its stack), as constants of the unrolled loop
      own = np.stack([sliding, np.where(sliding, np.cumsum(sliding) - 1, np.cumsum(~sliding) - 1)], axis=1)
    elif cache.layered:  # indices the unrolled loop hands each layer as constants
      own = np.arange(layers)
    else:
      own = jnp.arange(layers, dtype=jnp.int32) if stacked or ordered else (cache.k, cache.v)
      if stacked and scan is False:  # constants of the unrolled loop (a slice of an iota is a kernel each)
        own = np.arange(layers, dtype=np.int32)
    layer_caches = (own,) + (() if prefix is None else (prefix.k, prefix.v))
    x, (k_new, v_new), routing = self.run_layers(self._embed(tokens, images), layer, (settings, layer_caches),
                                                 scan=scan)
    hidden = self.final_norm_of(x)
    k_new, v_new = store(k_new, entries), store(v_new, entries)
    new_ring = None
    if ring is not None:
      new_ring = ring.write(k_new[np.flatnonzero(sliding)], v_new[np.flatnonzero(sliding)], segment_ids, ordinals)
      k_new, v_new = k_new[np.flatnonzero(~sliding)], v_new[np.flatnonzero(~sliding)]
    if written is not None:  # written layer by layer
      new_cache = KVCache(k=tuple(written['k']) if layered else written['k'],
                          v=tuple(written['v']) if layered else written['v'], segment_ids=written['segments'],
                          length=cache.length + length, window=None)
    elif length == cache.max_length:
      # The tokens fill the whole cache (so it was empty: length + T <= S): it is the new keys and
      # values themselves. No scatter, which on a mesh would gather every row's keys to every device.
      new_cache = KVCache(k=k_new, v=v_new, segment_ids=segment_ids, length=cache.length + length, window=new_ring)
    else:
      new_cache = KVCache(k=write_layers(cache.k, k_new, cache.length), v=write_layers(cache.v, v_new, cache.length),
                          segment_ids=write_ids(cache.segment_ids, segment_ids, cache.length),
                          length=cache.length + length, window=new_ring)
    if layered and not new_cache.layered:
      if new_ring is not None:
        new_ring = dataclasses.replace(new_ring, k=unstack(new_ring.k), v=unstack(new_ring.v))
      new_cache = dataclasses.replace(new_cache, k=unstack(new_cache.k), v=unstack(new_cache.v), window=new_ring)
    out = hidden if return_hidden else self.project(hidden)
    return (out, new_cache, gathered(routing)) if return_routing else (out, new_cache)

  def _context_prefill(self, tokens, cache: KVCache, positions, segment_ids, return_hidden: bool,
                       return_routing: bool, images: Images | None):
    """extend of prompts that fill an empty cache, under a mesh with a context axis: the rows split
    along their length over it and attended by the ring (the full-sequence forward,
    Qwen2.sequence_pass), every layer's keys and values kept, so no device holds a whole prompt's
    activations. The cache is those keys and values in the row's order (the caller lays it out)."""
    hidden, routing, (k_new, v_new) = self.sequence_pass(tokens, positions=positions, segment_ids=segment_ids,
                                                         images=images, keep_kv=True)
    k_new, v_new = store(k_new, cache.entries), store(v_new, cache.entries)
    if cache.layered:
      k_new, v_new = unstack(k_new), unstack(v_new)
    new_cache = KVCache(k=k_new, v=v_new, segment_ids=real_segments(tokens, segment_ids), length=cache.length +
                        tokens.shape[1])
    out = hidden if return_hidden else self.project(hidden)
    return (out, new_cache, routing) if return_routing else (out, new_cache)
