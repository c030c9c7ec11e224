"""The KV cache the decoder writes while decoding, and the shared prompt caches that many rows read.

  KVCache        keys and values of every layer for B rows (model.init_cache, model.extend), stacked
                 or one array per layer
  WindowCache    a sliding-window layer's keys and values, only the window's last tokens per row, in a ring
  SharedPrefix   prompt caches read by the rows of their group without a copy (the G samples of a
                 prompt, the slots of continuous batching)
  write_rows / write_layers   T new entries written into each row at its own slot
"""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer for B rows of up to S tokens.

  k, v:         [L, B, S, K, H] in the compute dtype, or `layered`: a tuple of L [B, S, K, H]
                arrays, each read and written in place by its own layer of an unrolled decode step
                (a layer's slice of a stack is copied out of it on XLA:GPU: the whole cache, twice,
                every step).
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
    if self.layered and not self.k:  # every layer slides: its window's
      return self.window.stacked().k.dtype
    return (self.k[0] if self.layered else self.k).dtype

  def map_layers(self, fn) -> 'KVCache':
    """fn(k or v [L, B, ...], or one layer's [B, ...] when layered) applied to keys and values (of
    the full-attention layers; a cache with a window is refused)."""
    if self.window is not None:
      raise ValueError('map_layers: this cache keeps its sliding layers in a window ring (WindowCache)')
    each = lambda x: tuple(map(fn, x)) if isinstance(x, tuple) else fn(x)  # noqa: E731
    return dataclasses.replace(self, k=each(self.k), v=each(self.v))

  def stacked(self) -> 'KVCache':
    """The same cache with [L, B, S, K, H] keys and values (a copy when layered)."""
    if not self.layered:
      return self
    window = None if self.window is None else self.window.stacked()
    if not self.k:  # every layer slides: no full-attention layer, an empty stack
      empty = jnp.zeros((0,) + self.segment_ids.shape + window.k.shape[3:], window.k.dtype)
      return dataclasses.replace(self, k=empty, v=empty, window=window)
    return dataclasses.replace(self, k=jnp.stack(self.k), v=jnp.stack(self.v), window=window)


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
    return dataclasses.replace(self, k=jnp.stack(self.k), v=jnp.stack(self.v))

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
        return tuple(layer.at[rows, entry].set(part, mode='drop') for layer, part in zip(target, new))
      return target.at[jnp.arange(new.shape[0])[:, None, None], rows[None], entry[None]].set(new, mode='drop')
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

  k, v:         [L, n, Pn, W, K, H] in the compute dtype.
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
    return picked.reshape((picked.shape[0] * picked.shape[1],) + picked.shape[2:])  # no -1: an MLA cache's values are empty


def write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, ...] into cache [B, S, ...] at slot start[b] of each row."""
  def write_row(row, update, index):
    return jax.lax.dynamic_update_slice_in_dim(row, update, index, axis=0)
  return jax.vmap(write_row)(cache, new, start)


def finite(x: jax.Array) -> jax.Array:
  """x with its NaN and infinite entries as 0: what a cache may hold (KVCache)."""
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def write_layers(cache: jax.Array | tuple[jax.Array, ...], new: jax.Array, start: jax.Array):
  """Writes new [L, B, T, ...] into cache [L, B, S, ...] (or L [B, S, ...] layers) at slot
  start[b] of each row b."""
  if isinstance(cache, tuple):
    return tuple(write_rows(layer, part, start) for layer, part in zip(cache, new))
  # One scatter indexed on (layer, row, slot): a vmap over the row axis would move it to the front,
  # transposing the whole cache there and back. The layer is an index too, not part of the written
  # window: with one KV head per device (a tensor-parallel cache) XLA:TPU otherwise laid the cache
  # out layer-minor for the scatter and copied the whole cache into the layer scan's layer-major
  # layout on every decode step (twice the cache in temporaries).
  layers = jnp.arange(new.shape[0])[:, None, None]
  rows = jnp.arange(new.shape[1])[None, :, None]
  slots = (start[:, None] + jnp.arange(new.shape[2]))[None]
  return cache.at[layers, rows, slots].set(new, indices_are_sorted=True, unique_indices=True)
