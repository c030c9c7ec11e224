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

# Full-sequence attention: 'dense' (the [T, T] scores at once), 'chunked' (query chunks one at a
# time, rematerialised: O(chunk x T) memory), 'cudnn' (cuDNN flash attention through
# jax.nn.dot_product_attention; NVIDIA GPUs only).
AttentionImplementation = Literal['dense', 'chunked', 'cudnn']
ATTENTION_IMPLEMENTATIONS = typing.get_args(AttentionImplementation)

# attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H]) -> [B, T, N, H]: T tokens over themselves.
Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def attention_mask(query_slots, query_segments, key_slots, key_segments) -> jax.Array:
  """[B, T, S] bool: causal in slot order and restricted to the query's own segment.

  query_slots, query_segments: [B, T]; key_slots, key_segments: [B, S].
  """
  causal = key_slots[:, None, :] <= query_slots[:, :, None]
  same_segment = key_segments[:, None, :] == query_segments[:, :, None]
  return causal & same_segment


def _concatenate(arrays: list[jax.Array]) -> jax.Array:
  # One part needs no concatenate op: the dense path's program stays as it was.
  return arrays[0] if len(arrays) == 1 else jnp.concatenate(arrays, axis=-1)


def grouped_attention(q: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
  """q attends over the keys of every part with one softmax. q: [B, T, N, H]; parts: (k, v
  [B, S_i, K, H], mask [B, T, S_i]) with one value dtype -> [B, T, N, H].

  Query head n uses key/value head n // G. The softmax runs over the concatenated S_1 + S_2 + ...
  scores, so attending over parts is attending over their concatenated keys; only the small score
  arrays are concatenated, never the keys or values (a KV cache part is read in place). A fully
  masked row gives a uniform, not NaN, row.
  """
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = parts[0][0].shape[2]
  q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores = _concatenate([jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=jnp.float32)
                         for k, _, _ in parts])
  scores = scores * (head_dim ** -0.5)
  mask = _concatenate([mask for _, _, mask in parts])
  scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(parts[0][1].dtype)
  out, start = None, 0
  for k, v, _ in parts:
    part_probs = probs if len(parts) == 1 else probs[..., start:start + k.shape[1]]
    part = jnp.einsum('BKGTS,BSKH->BTKGH', part_probs, v)
    out = part if out is None else out + part
    start += k.shape[1]
  return out.reshape(batch, length, num_heads, head_dim)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Dense attention. q: [B, T, N, H]; k, v: [B, S, K, H]; mask: [B, T, S] -> [B, T, N, H]."""
  return grouped_attention(q, [(k, v, mask)])


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
  cuDNN's fused flash attention on NVIDIA GPUs; 'xla': the library's own XLA path). q:
  [B, T, N, H]; k, v: [B, T, K, H]; mask [B, T, T] must be causal in slot order, as
  `attention_mask` makes it: the call also declares causality, which lets cuDNN skip the upper
  triangle. -> [B, T, N, H] in q's dtype."""
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True,
                                     implementation=implementation)
  return out.astype(q.dtype)


def sequence_attention(implementation: AttentionImplementation, slots: jax.Array, segments: jax.Array,
                       chunk: int) -> Attend:
  """The `attend(q, k, v)` of T tokens over themselves that `implementation` names. slots,
  segments: [B, T] (the causal order and segment of each token); chunk: queries per chunk for
  'chunked'."""
  if implementation == 'chunked':
    # No [B, T, T] mask: each chunk builds its own [B, chunk, T] block, keeping memory O(chunk x T).
    return functools.partial(chunked_attention, slots=slots, segments=segments, chunk=chunk)
  mask = attention_mask(slots, segments, slots, segments)
  if implementation == 'cudnn':
    return functools.partial(library_attention, mask=mask, implementation='cudnn')
  return functools.partial(attention, mask=mask)
