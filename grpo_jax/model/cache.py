"""The KV cache the decoder writes while decoding, and the shared prompt caches that many rows read.

  KVCache        keys and values of every layer for B rows (model.init_cache, model.extend), stacked
                 or one array per layer
  WindowCache    a sliding-window layer's keys and values, only the window's last tokens per row, in a ring
  SharedPrefix   prompt caches read by the rows of their group without a copy (the G samples of a
                 prompt, the slots of continuous batching)
  write_rows / write_layers   T new entries written into each row at its own slot (write_ids: ids)

An 8-bit cache (`rollout.kv_cache: int8 | fp8`) holds each key and value array as a Quantized
(model/quantize.py): 8-bit values [..., K, H] and one fp32 scale per token and KV head
[..., K, 1], written with the entries (`store`). The scale keeps the entries' rank, so whatever
moves cache rows (slots, pools, layers) moves a Quantized's two arrays alike (`each`); attention
reads the 8-bit values and folds the scales into its scores and probabilities
(model/attention.py), so no dequantized cache is ever made.
"""

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.model.quantize import FORMATS, Quantized, quantize


def each(fn, *arrays):
  """fn applied to the arrays of cache entries: to a Quantized's values and scale alike (both of the
  entries' rank), or to plain arrays."""
  return jax.tree.map(fn, *arrays)


def cache_format(entries) -> str:
  """'compute', or the 8-bit kind ('int8' | 'fp8') of cache entries (an array or a Quantized)."""
  if not isinstance(entries, Quantized):
    return 'compute'
  return next(kind for kind, (dtype, _) in FORMATS.items() if entries.values.dtype == jnp.dtype(dtype))


def store(x: jax.Array, like) -> 'jax.Array | Quantized':
  """New keys or values x [..., K, H] as a cache whose entries are `like` holds them: finite (NaN
  and infinities as 0), in its dtype, or quantized with one scale per token and head (over H)."""
  if isinstance(like, Quantized):
    return quantize(finite(x.astype(jnp.float32)), (x.ndim - 1,), cache_format(like))
  return finite(x.astype(like.dtype))


def unstack(x) -> tuple:
  """A stack [L, ...] (or a Quantized of stacks) as a tuple of its L layers."""
  return tuple(x[index] for index in range(x.shape[0]))


def stack_layers(layers: tuple):
  """A tuple of layers (arrays or Quantized) as one stack [L, ...]."""
  return each(lambda *parts: jnp.stack(parts), *layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer for B rows of up to S tokens.

  k, v:         [L, B, S, K, H] in the compute dtype (or Quantized, an 8-bit cache), or `layered`:
                a tuple of L [B, S, K, H] arrays, each read and written in place by its own layer of
                an unrolled decode step (a layer's slice of a stack is copied out of it on XLA:GPU:
                the whole cache, twice, every step).
  segment_ids:  [B, S] int32, 0 for empty or padding slots.
  length:       [B] int32, slots written so far; the next token goes to slot `length`.

  window:       the sliding-window layers' entries, each row's last W real tokens only (WindowCache);
                k and v then hold the other (full-attention) layers only, in layer order. None: k
                and v hold every layer.

  Every entry is finite (extend writes non-finite keys and values as 0): attention gives the
  entries it masks exactly no weight without selecting them away.
  """

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  segment_ids: jax.Array
  length: jax.Array
  window: 'WindowCache | None' = None

  @property
  def max_length(self) -> int:
    return self.segment_ids.shape[1]

  @property
  def layered(self) -> bool:
    return isinstance(self.k, tuple)

  @property
  def dtype(self) -> jnp.dtype:
    """The entries' storage dtype (an 8-bit cache's values')."""
    return self.entries.dtype

  @property
  def entries(self):
    """One layer's (or a stack's) keys: what `store` writes new entries like."""
    if self.layered and not self.k:  # every layer slides: its window's
      return self.window.stacked().k
    return self.k[0] if self.layered else self.k

  @property
  def format(self) -> str:
    """'compute' or the 8-bit kind of the entries (options.KV_CACHE_FORMATS)."""
    return cache_format(self.entries)

  def map_layers(self, fn) -> 'KVCache':
    """fn(k or v [L, B, ...], or one layer's [B, ...] when layered) applied to keys and values (of
    the full-attention layers; a cache with a window is refused)."""
    if self.window is not None:
      raise ValueError('map_layers: this cache keeps its sliding layers in a window ring (WindowCache)')
    apply = lambda x: tuple(each(fn, layer) for layer in x) if isinstance(x, tuple) else each(fn, x)  # noqa: E731
    return dataclasses.replace(self, k=apply(self.k), v=apply(self.v))

  def stacked(self) -> 'KVCache':
    """The same cache with [L, B, S, K, H] keys and values (a copy when layered)."""
    if not self.layered:
      return self
    window = None if self.window is None else self.window.stacked()
    if not self.k:  # every layer slides: no full-attention layer, an empty stack
      empty = each(lambda x: jnp.zeros((0,) + self.segment_ids.shape + x.shape[3:], x.dtype), window.k)
      return dataclasses.replace(self, k=empty, v=empty, window=window)
    return dataclasses.replace(self, k=stack_layers(self.k), v=stack_layers(self.v), window=window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WindowCache:
  """The sliding-window layers' keys and values (model.init_cache(windowed=True)): a layer that
  attends over the last W tokens needs no more of a row's past than that, so each row keeps a ring
  of W entries instead of the S of a full-attention layer (Gemma 3's local layers at 1,024 of a
  3,072-token answer: a third).

  The real token with ordinal o (its count of real tokens before it in its sequence, a prompt
  read from a SharedPrefix included) sits at entry o mod W; padding is never written. An entry is
  read when its segment is the query's and it is less than the window behind it
  (attention.window_mask); entries of an earlier request in the same row are cleared when a
  request is admitted (sampler/slots.py).

  k, v:         [Lw, B, W, K, H] in the compute dtype, or `layered`: a tuple of Lw [B, W, K, H].
  segment_ids:  [B, W] int32, 0 for an empty entry.
  ordinals:     [B, W] int32 each entry's ordinal.
  """

  k: jax.Array | tuple[jax.Array, ...]
  v: jax.Array | tuple[jax.Array, ...]
  segment_ids: jax.Array
  ordinals: jax.Array

  @property
  def size(self) -> int:
    return self.segment_ids.shape[1]

  def stacked(self) -> 'WindowCache':
    if not isinstance(self.k, tuple):
      return self
    return dataclasses.replace(self, k=stack_layers(self.k), v=stack_layers(self.v))

  def write(self, k_new: jax.Array, v_new: jax.Array, segment_ids: jax.Array, ordinals: jax.Array) -> 'WindowCache':
    """T new tokens per row (k_new, v_new [Lw, B, T, K, H]; segment_ids, ordinals [B, T]) into
    their entries: each real token at its ordinal mod W, the row's last W real tokens of them
    only (so no two land on one entry); padding nowhere."""
    size, rows = self.size, jnp.arange(segment_ids.shape[0])[:, None]
    real = segment_ids != 0
    last = jnp.max(jnp.where(real, ordinals, -1), axis=1, keepdims=True)
    entry = jnp.where(real & (ordinals > last - size), ordinals % size, size)  # size: out of range, dropped

    def put(target, new):
      if isinstance(target, tuple):
        return tuple(each(lambda t, n: t.at[rows, entry].set(n, mode='drop'), layer, new[index])
                     for index, layer in enumerate(target))
      return each(lambda t, n: t.at[jnp.arange(n.shape[0])[:, None, None], rows[None], entry[None]].set(n, mode='drop'),
                  target, new)
    return WindowCache(k=put(self.k, k_new), v=put(self.v, v_new),
                       segment_ids=self.segment_ids.at[rows, entry].set(segment_ids, mode='drop'),
                       ordinals=self.ordinals.at[rows, entry].set(ordinals, mode='drop'))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """Prompt caches that many rows read without a copy of their own (the G samples of a prompt,
  the slots of continuous batching): row r attends over prompt `index` of its group, then over
  its own cache row.

  The P = n * Pn prompts come in n groups, one per batch shard of the mesh, and the B = n * Bn rows
  likewise: row g * Bn + j reads prompt (g, index[g, j]), so a row only ever reads prompts held on
  its own devices (the gather is batched over the group axis, which stays sharded).

  k, v:         [L, n, Pn, W, K, H] in the compute dtype, or Quantized (an 8-bit cache's).
  segment_ids:  [n, Pn, W] int32, 0 on padding.
  index:        [n, Bn] int32, the prompt each row reads, within its group.
  readers:      at most this many rows with a real token read one prompt at a time (a prompt's G
                samples); dense attention then reads each prompt once for its readers
                (attention.SharedPart). None: no bound, each row reads a copy of its prompt.
  """

  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  index: jax.Array
  readers: int | None = dataclasses.field(default=None, metadata=dict(static=True))

  def rows(self, shared: jax.Array) -> jax.Array:
    """[n, Pn, ...] per-prompt values -> [B, ...] the value each row reads."""
    picked = jax.vmap(lambda values, index: values[index])(shared, self.index)
    # no -1: an MLA cache's values are empty
    return each(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), picked)


def write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, ...] into cache [B, S, ...] (or a Quantized's two arrays) at slot start[b]
  of each row."""
  def write_row(row, update, index):
    return jax.lax.dynamic_update_slice_in_dim(row, update, index, axis=0)
  return each(lambda c, n: jax.vmap(write_row)(c, n, start), cache, new)


def write_ids(ids: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """write_rows for a [B, S] array of ids (the cache's segment ids): on a TPU as one select over the
  rows' slots, where XLA:TPU expands the rows' batched update into a loop of one update per row
  (the 0.5B recipe's decode step on a v5e-8: a 64-trip loop of 10 ops, 640 of its 904)."""
  from grpo_jax.ops.logprob import target_platform  # no Pallas import
  if target_platform() != 'tpu':
    return write_rows(ids, new, start)
  offset = jnp.arange(ids.shape[1], dtype=jnp.int32)[None] - start[:, None]  # [B, S]: slot - start
  inside = (offset >= 0) & (offset < new.shape[1])
  return jnp.where(inside, jnp.take_along_axis(new, jnp.clip(offset, 0, new.shape[1] - 1), axis=1), ids)


def finite(x: jax.Array) -> jax.Array:
  """x with its NaN and infinite entries as 0: what a cache may hold (KVCache)."""
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def write_layer(cache: jax.Array, new: jax.Array, layer: int, start: jax.Array) -> jax.Array:
  """Writes one layer's new [B, T, ...] into the stacked cache [L, B, S, ...] at `layer`, slot
  start[b] of each row b: one scatter, in place."""
  rows = jnp.arange(new.shape[0])[:, None]
  slots = start[:, None] + jnp.arange(new.shape[1])
  return cache.at[layer, rows, slots].set(new, indices_are_sorted=True, unique_indices=True)


def write_layers(cache: jax.Array | tuple[jax.Array, ...], new: jax.Array, start: jax.Array):
  """Writes new [L, B, T, ...] into cache [L, B, S, ...] (or L [B, S, ...] layers) at slot
  start[b] of each row b."""
  if isinstance(cache, tuple):
    return tuple(write_rows(layer, new[index], start) for index, layer in enumerate(cache))
  # One scatter indexed on (layer, row, slot): a vmap over the row axis would move it to the front,
  # transposing the whole cache there and back. The layer is an index too, not part of the written
  # window: with one KV head per device (a tensor-parallel cache) XLA:TPU otherwise laid the cache
  # out layer-minor for the scatter and copied the whole cache into the layer scan's layer-major
  # layout on every decode step (twice the cache in temporaries).
  layers = jnp.arange(new.shape[0])[:, None, None]
  rows = jnp.arange(new.shape[1])[None, :, None]
  slots = (start[:, None] + jnp.arange(new.shape[2]))[None]
  return each(lambda c, n: c.at[layers, rows, slots].set(n, indices_are_sorted=True, unique_indices=True), cache, new)
