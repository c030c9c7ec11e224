"""The KV cache the decoder writes while decoding, and the shared prompt caches that many rows read.

  KVCache        keys and values of every layer for B rows (model.init_cache, model.extend)
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
  """

  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  index: jax.Array

  def rows(self, shared: jax.Array) -> jax.Array:
    """[n, Pn, ...] per-prompt values -> [B, ...] the value each row reads."""
    picked = jax.vmap(lambda values, index: values[index])(shared, self.index)
    return picked.reshape((-1,) + picked.shape[2:])


def write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, ...] into cache [B, S, ...] at slot start[b] of each row."""
  def write_row(row, update, index):
    return jax.lax.dynamic_update_slice_in_dim(row, update, index, axis=0)
  return jax.vmap(write_row)(cache, new, start)


def write_layers(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [L, B, T, ...] into cache [L, B, S, ...] at slot start[b] of each row b."""
  # One scatter indexed on (layer, row, slot): a vmap over the row axis would move it to the front,
  # transposing the whole cache there and back. The layer is an index too, not part of the written
  # window: with one KV head per device (a tensor-parallel cache) XLA:TPU otherwise laid the cache
  # out layer-minor for the scatter and copied the whole cache into the layer scan's layer-major
  # layout on every decode step (twice the cache in temporaries).
  layers = jnp.arange(new.shape[0])[:, None, None]
  rows = jnp.arange(new.shape[1])[None, :, None]
  slots = (start[:, None] + jnp.arange(new.shape[2]))[None]
  return cache.at[layers, rows, slots].set(new, indices_are_sorted=True, unique_indices=True)
