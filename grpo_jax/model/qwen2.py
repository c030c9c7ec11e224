"""Qwen2 / Qwen2.5 decoder in Flax NNX.

Layer parameters are stored stacked along a leading layer axis L, so the decoder runs as one
`lax.scan` (compile time independent of depth) or, with `scan_layers=False`, as an unrolled loop
over the same arrays. Parameter names carry their dimension letters:

  embedding      [V, D]            lm_head     [D, V] (absent when tied)
  attn_norm      [L, D]            mlp_norm    [L, D]           final_norm [D]
  q_weight       [L, D, N, H]      q_bias      [L, N, H]
  k_weight       [L, D, K, H]      k_bias      [L, K, H]        (v_* likewise)
  o_weight       [L, N, H, D]
  gate_weight    [L, D, F]         up_weight   [L, D, F]        down_weight [L, F, D]

Masking uses segment ids [B, T]: 0 marks padding, and a token attends to earlier tokens of its own
segment only. A Hugging Face 0/1 attention mask is a valid segment-id array, and packed sequences
use 1, 2, 3, ... per row. Left- and right-padded batches therefore give each real token the same
logits as the unpadded sequence.
"""

import dataclasses
import functools
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.sharding import constrain

RematPolicy = Literal['none', 'full', 'dots', 'dots_no_batch']
# Full-sequence attention: 'dense' (the [T, T] scores at once), 'chunked' (query chunks one at a
# time, rematerialised: O(chunk x T) memory), 'cudnn' (cuDNN flash attention through
# jax.nn.dot_product_attention; NVIDIA GPUs only).
AttentionImplementation = Literal['dense', 'chunked', 'cudnn']
ATTENTION_IMPLEMENTATIONS = typing.get_args(AttentionImplementation)

_REMAT_POLICIES = {
    'full': None,  # save nothing, recompute the whole block
    'dots': jax.checkpoint_policies.dots_saveable,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

LAYER_PARAMS = ('attn_norm', 'q_weight', 'q_bias', 'k_weight', 'k_bias', 'v_weight', 'v_bias',
                'o_weight', 'mlp_norm', 'gate_weight', 'up_weight', 'down_weight')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer for B rows of up to S tokens.

  k, v:         [L, B, S, K, H] in the compute dtype.
  segment_ids:  [B, S] int32, 0 for empty or padding slots.
  length:       [B] int32, slots written so far; the next token goes to slot `length`.
  """

  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  length: jax.Array

  @property
  def max_length(self) -> int:
    return self.k.shape[2]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in fp32, cast back to x's dtype before scaling (as Qwen2 does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split convention. x: [B, T, n, H], positions: [B, T]."""
  head_dim = x.shape[-1]
  inverse_frequency = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions[..., None].astype(jnp.float32) * inverse_frequency  # [B, T, H/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_mask(query_slots, query_segments, key_slots, key_segments) -> jax.Array:
  """[B, T, S] bool: causal in slot order and restricted to the query's own segment."""
  causal = key_slots[:, None, :] <= query_slots[:, :, None]
  same_segment = key_segments[:, None, :] == query_segments[:, :, None]
  return causal & same_segment


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Grouped-query attention. q: [B, T, N, H]; k, v: [B, S, K, H]; mask: [B, T, S] -> [B, T, N, H].

  Query head n uses key/value head n // G, G = N / K. Scores and softmax are fp32. Masked
  scores use the most negative finite fp32 so a fully masked row gives a uniform, not NaN, row.
  """
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=jnp.float32)
  scores = scores * (head_dim ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum('BKGTS,BSKH->BTKGH', probs, v)
  return out.reshape(batch, length, num_heads, head_dim)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, segments: jax.Array,
                      chunk: int) -> jax.Array:
  """`attention` of T tokens over themselves, `chunk` queries at a time. q: [B, T, N, H];
  k, v: [B, T, K, H]; slots, segments: [B, T] (the causal order and segment of each token).

  Exact (each chunk's softmax runs over all T keys under the same mask as `attention`). The
  chunks run one after another under `lax.map`, each rematerialised under autodiff, so only one
  chunk's [chunk, T] scores exist at a time, forward or backward: peak score memory is
  O(chunk x T) per layer instead of O(T^2) (measured: T = 1024, chunk 64: 11 MiB of compiled
  temporaries for forward + backward against 129 MiB dense). FLOPs are the dense path's plus
  one recomputation of the attention; the masked upper triangle is still computed.
  """
  batch, length = q.shape[:2]
  chunk = min(chunk, length)
  pad = -length % chunk
  # Extra query rows (pad of them) copy the last real one (a non-empty mask) and are dropped below.
  q, query_slots, query_segments = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode='edge')
                                    for x in (q, slots, segments))

  def chunks(x):  # [B, T + pad, ...] -> [(T + pad) / chunk, B, chunk, ...]
    return jnp.moveaxis(x.reshape(batch, -1, chunk, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def one_chunk(inputs):
    q_chunk, chunk_slots, chunk_segments = inputs
    return attention(q_chunk, k, v, attention_mask(chunk_slots, chunk_segments, slots, segments))

  out = jax.lax.map(one_chunk, (chunks(q), chunks(query_slots), chunks(query_segments)))
  return jnp.moveaxis(out, 0, 1).reshape(batch, length + pad, *out.shape[3:])[:, :length]


def library_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                      implementation: str) -> jax.Array:
  """`attention` of T tokens over themselves through jax.nn.dot_product_attention ('cudnn':
  cuDNN's fused flash attention on NVIDIA GPUs; 'xla': the library's own XLA path). mask
  [B, T, T] must be causal in slot order, as `attention_mask` makes it: the call also declares
  causality, which lets cuDNN skip the upper triangle."""
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True,
                                     implementation=implementation)
  return out.astype(q.dtype)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, cache_mask: jax.Array) -> jax.Array:
  """`attention` over the cache's earlier tokens and the T new tokens, without writing the new
  keys and values into the cache first. q, k, v: [B, T, *, H]; mask: [B, T, T]; k_cache, v_cache:
  [B, S, K, H]; cache_mask: [B, T, S] -> [B, T, N, H].

  One softmax runs over the concatenated S + T scores, so this is the same attention as over
  the cache with the new tokens written in; only the small score arrays are concatenated, never
  the [B, S, K, H] cache, which the layer scan then reads in place.
  """
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads, slots = k.shape[2], k_cache.shape[1]
  q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores = jnp.concatenate(
      [jnp.einsum('BTKGH,BSKH->BKGTS', q, k_cache, preferred_element_type=jnp.float32),
       jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=jnp.float32)], axis=-1)
  scores = scores * (head_dim ** -0.5)
  mask = jnp.concatenate([cache_mask, mask], axis=-1)
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = (jnp.einsum('BKGTS,BSKH->BTKGH', probs[..., :slots], v_cache)
         + jnp.einsum('BKGTS,BSKH->BTKGH', probs[..., slots:], v))
  return out.reshape(batch, length, num_heads, head_dim)


def _write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, ...] into cache [B, S, ...] at slot start[b] of each row."""
  def write_row(row, update, index):
    return jax.lax.dynamic_update_slice_in_dim(row, update, index, axis=0)
  return jax.vmap(write_row)(cache, new, start)


def _write_layers(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [L, B, T, ...] into cache [L, B, S, ...] at slot start[b] of each row b."""
  # One scatter indexed on (row, slot): a vmap over the row axis would move it to the front,
  # transposing the whole cache there and back.
  rows = jnp.arange(new.shape[1])[:, None]
  slots = start[:, None] + jnp.arange(new.shape[2])
  return cache.at[:, rows, slots].set(new, indices_are_sorted=True, unique_indices=True)


def matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
  """x [B, T, *I] @ w [*I, *O] -> [B, T, *O], contracting x's last `contract` dims, as one 2-D
  [B*T, prod I] @ [prod I, prod O] matmul.

  Same maths as einsum('BTI,IO->BTO'), but its gradient with respect to w is then one dot with a
  single contracting dimension: with B and T kept apart, XLA:CPU contracts two dimensions and
  copies the activation gradient into a transposed layout first (measured on one SwiGLU block,
  [64, 37, 256] x F=704, forward + backward: 87 ms as an einsum, 37 ms flattened).
  """
  rows = x.shape[:x.ndim - contract]
  inner = w.shape[:contract]
  flat = x.reshape(-1, math.prod(inner)) @ w.reshape(math.prod(inner), -1)
  return flat.reshape(*rows, *w.shape[contract:])


def decoder_block(params: dict, x: jax.Array, positions: jax.Array, mask: jax.Array,
                  cache: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                  *, config: Qwen2Config, dtype, attend=None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
  """One pre-norm decoder layer. x: [B, T, D] -> (x, this layer's new keys and values [B, T, K, H]).

  mask [B, T, T] is among the T tokens; without a cache, `attend(q, k, v)`, when given, replaces
  the dense `attention` over it (the model's `attention` setting). With `cache` = (k, v [B, S, K, H], cache_mask [B, T, S]),
  the tokens also attend to the cached tokens that cache_mask allows; the cache is only read.
  """
  p = {name: value.astype(dtype) for name, value in params.items()}
  h = rms_norm(x, p['attn_norm'], config.rms_norm_eps)
  q = matmul(h, p['q_weight']) + p['q_bias']
  k = matmul(h, p['k_weight']) + p['k_bias']
  v = matmul(h, p['v_weight']) + p['v_bias']
  q = apply_rope(q, positions, config.rope_theta)
  k = apply_rope(k, positions, config.rope_theta)
  if cache is None:
    attended = attend(q, k, v) if attend is not None else attention(q, k, v, mask)
  else:
    k_cache, v_cache, cache_mask = cache
    # Round the new keys and values to the cache dtype, as writing them first would.
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    attended = cached_attention(q, k, v, mask, k_cache, v_cache, cache_mask)
  x = x + matmul(attended, p['o_weight'], contract=2)
  x = constrain(x, ('batch', 'seq', 'act_embed'))
  h = rms_norm(x, p['mlp_norm'], config.rms_norm_eps)
  x = x + matmul(jax.nn.silu(matmul(h, p['gate_weight'])) * matmul(h, p['up_weight']), p['down_weight'])
  return constrain(x, ('batch', 'seq', 'act_embed')), (k, v)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Position of each token within its segment, counting from the segment's first token. [B, T]"""
  length = segment_ids.shape[1]
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  segment_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return index - segment_start


class DecoderLayers(nnx.Module):
  """The L decoder layers' parameters, stacked along a leading layer axis."""

  def __init__(self, config: Qwen2Config, param_dtype, rngs: nnx.Rngs):
    c = config
    L, D, F = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    N, K, H = c.num_attention_heads, c.num_key_value_heads, c.resolved_head_dim
    normal = nnx.initializers.normal(c.initializer_range)

    def weight(shape, axes):
      return nnx.Param(normal(rngs.params(), shape, param_dtype), logical_axes=axes)

    def constant(value, shape, axes):
      return nnx.Param(jnp.full(shape, value, param_dtype), logical_axes=axes)

    self.attn_norm = constant(1.0, (L, D), ('layers', 'act_embed'))
    self.q_weight = weight((L, D, N, H), ('layers', 'embed', 'q_heads', 'head_dim'))
    self.q_bias = constant(0.0, (L, N, H), ('layers', 'q_heads', 'head_dim'))
    self.k_weight = weight((L, D, K, H), ('layers', 'embed', 'kv_heads', 'head_dim'))
    self.k_bias = constant(0.0, (L, K, H), ('layers', 'kv_heads', 'head_dim'))
    self.v_weight = weight((L, D, K, H), ('layers', 'embed', 'kv_heads', 'head_dim'))
    self.v_bias = constant(0.0, (L, K, H), ('layers', 'kv_heads', 'head_dim'))
    self.o_weight = weight((L, N, H, D), ('layers', 'q_heads', 'head_dim', 'embed'))
    self.mlp_norm = constant(1.0, (L, D), ('layers', 'act_embed'))
    self.gate_weight = weight((L, D, F), ('layers', 'embed', 'mlp'))
    self.up_weight = weight((L, D, F), ('layers', 'embed', 'mlp'))
    self.down_weight = weight((L, F, D), ('layers', 'mlp', 'embed'))

  def arrays(self) -> dict:
    return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


class Qwen2(nnx.Module):
  """Qwen2 causal LM. `model(tokens)` -> fp32 logits [B, T, V].

  dtype: compute dtype (activations, matmul inputs); param_dtype: storage dtype of parameters.
  remat: rematerialisation policy of each layer under autodiff ('none', 'full', 'dots',
  'dots_no_batch'). scan_layers: run the layer stack as one lax.scan. attention: how the
  full-sequence forward attends (see AttentionImplementation), attention_chunk: queries per chunk
  for 'chunked'. Incremental decoding (`extend`) always reads the cache densely.
  """

  def __init__(self, config: Qwen2Config, *, dtype='float32', param_dtype='float32',
               remat: RematPolicy = 'none', scan_layers: bool = True,
               attention: AttentionImplementation = 'dense', attention_chunk: int = 512, rngs: nnx.Rngs):
    if remat != 'none' and remat not in _REMAT_POLICIES:
      raise ValueError(f'remat must be one of none, {", ".join(_REMAT_POLICIES)}; got {remat!r}')
    if attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f'attention must be one of {", ".join(ATTENTION_IMPLEMENTATIONS)}; got {attention!r}')
    if attention_chunk < 1:
      raise ValueError(f'attention_chunk must be >= 1, got {attention_chunk}')
    self.attention = attention
    self.attention_chunk = attention_chunk
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.param_dtype = jnp.dtype(param_dtype)
    self.remat = remat
    self.scan_layers = scan_layers
    normal = nnx.initializers.normal(config.initializer_range)
    V, D = config.vocab_size, config.hidden_size
    self.embedding = nnx.Param(normal(rngs.params(), (V, D), self.param_dtype),
                               logical_axes=('vocab', 'embed'))
    self.layers = DecoderLayers(config, self.param_dtype, rngs)
    self.final_norm = nnx.Param(jnp.ones((D,), self.param_dtype), logical_axes=('act_embed',))
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Param(normal(rngs.params(), (D, V), self.param_dtype),
                               logical_axes=('embed', 'vocab'))

  # ---- full-sequence forward (training, scoring) ----

  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """tokens [B, T] int32 -> logits [B, T, V] fp32."""
    return self.project(self.hidden_states(tokens, positions=positions, segment_ids=segment_ids))

  def hidden_states(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """Final-norm hidden states [B, T, D] (what the fused log-prob op consumes)."""
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if positions is None:
      positions = segment_positions(segment_ids)
    slots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    mask, attend = None, None
    if self.attention == 'chunked':
      attend = functools.partial(chunked_attention, slots=slots, segments=segment_ids,
                                 chunk=self.attention_chunk)
    else:
      mask = attention_mask(slots, segment_ids, slots, segment_ids)
      if self.attention == 'cudnn':
        attend = functools.partial(library_attention, mask=mask, implementation='cudnn')
    block = functools.partial(decoder_block, config=self.config, dtype=self.dtype, attend=attend)
    if self.remat != 'none':
      block = jax.checkpoint(block, policy=_REMAT_POLICIES[self.remat])

    def layer(x, params):
      x, _ = block(params, x, positions, mask)
      return x, None

    x = self._embed(tokens)
    params = self.layers.arrays()
    if self.scan_layers:
      x, _ = jax.lax.scan(layer, x, params)
    else:
      for index in range(self.config.num_hidden_layers):
        x, _ = layer(x, jax.tree.map(lambda a, i=index: a[i], params))
    return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)

  def lm_head_weight(self) -> jax.Array:
    """[D, V] in the compute dtype; the transposed embedding when tied."""
    if self.config.tie_word_embeddings:
      return self.embedding[...].astype(self.dtype).T
    return self.lm_head[...].astype(self.dtype)

  def project(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, D] -> logits [B, T, V], accumulated and returned in fp32."""
    logits = jnp.einsum('BTD,DV->BTV', hidden.astype(self.dtype), self.lm_head_weight(),
                        preferred_element_type=jnp.float32)
    return constrain(logits, ('batch', 'seq', 'vocab'))

  def _embed(self, tokens: jax.Array) -> jax.Array:
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
    return constrain(x, ('batch', 'seq', 'act_embed'))

  # ---- incremental decoding with a KV cache (prefill, then one token at a time) ----

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    c = self.config
    shape = (c.num_hidden_layers, batch_size, max_length, c.num_key_value_heads, c.resolved_head_dim)
    return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype),
                   segment_ids=jnp.zeros((batch_size, max_length), jnp.int32),
                   length=jnp.zeros((batch_size,), jnp.int32))

  def extend(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None, return_hidden: bool = False) -> tuple[jax.Array, KVCache]:
    """Appends T tokens per row to the cache and returns their logits [B, T, V] and the new cache.

    return_hidden: return the final-norm hidden states [B, T, D] instead of logits, so a prefill
    can project only the positions it samples from (a [P, Tp, V] logits array of a long prompt
    batch over Qwen's 151,936-token vocabulary would be tens of GB).

    Prefill is `extend` of a (left- or right-padded) prompt on an empty cache; decoding is `extend`
    of one token. Each row holds one sequence; by default a token's position is the number of
    real (segment id != 0) tokens before it in its row. The caller keeps length + T <= S.
    """
    if segment_ids is None:
      segment_ids = jnp.ones(tokens.shape, jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    if positions is None:
      previous = jnp.sum(cache.segment_ids != 0, axis=1, dtype=jnp.int32)
      running = jnp.cumsum(segment_ids != 0, axis=1, dtype=jnp.int32) - 1
      positions = previous[:, None] + jnp.maximum(running, 0)
    length = tokens.shape[1]
    query_slots = cache.length[:, None] + jnp.arange(length, dtype=jnp.int32)
    key_slots = jnp.broadcast_to(jnp.arange(cache.max_length, dtype=jnp.int32),
                                 cache.segment_ids.shape)
    # Cached slots before `length` (the slots from `length` on are this call's tokens, attended
    # through `mask`, or still empty).
    cache_mask = (attention_mask(query_slots, segment_ids, key_slots, cache.segment_ids)
                  & (key_slots < cache.length[:, None])[:, None, :])
    mask = attention_mask(query_slots, segment_ids, query_slots, segment_ids)
    block = functools.partial(decoder_block, config=self.config, dtype=self.dtype)

    # The cache is a scan input, read in place; only the T new tokens' keys and values leave each
    # layer, and they are written into the cache once, after the scan. Carrying the stacked cache
    # through the scan instead copies each layer's [B, S, K, H] slice in and out every step.
    def layer(x, xs):
      params, k_cache, v_cache = xs
      return block(params, x, positions, mask, (k_cache, v_cache, cache_mask))

    x, params = self._embed(tokens), self.layers.arrays()
    if self.scan_layers:
      x, (k_new, v_new) = jax.lax.scan(layer, x, (params, cache.k, cache.v))
    else:
      new = []
      for index in range(self.config.num_hidden_layers):
        x, kv = layer(x, jax.tree.map(lambda a, i=index: a[i], (params, cache.k, cache.v)))
        new.append(kv)
      k_new, v_new = (jnp.stack(parts) for parts in zip(*new))
    hidden = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
    new_cache = KVCache(k=_write_layers(cache.k, k_new, cache.length),
                        v=_write_layers(cache.v, v_new, cache.length),
                        segment_ids=_write_rows(cache.segment_ids, segment_ids, cache.length),
                        length=cache.length + length)
    return (hidden if return_hidden else self.project(hidden)), new_cache
