"""The token embedding lookup, and its gradient laid out as the table is.

Forward it is `table[tokens]`. Its gradient is a scatter-add of each token's cotangent into the
table's row. Left to XLA's partitioner on a mesh whose batch axes split the tokens and whose FSDP
axes split the table's D, that gradient is formed whole ([V, D] fp32: 3 GB at Qwen2.5-32B) on
every device and all-reduced over every batch axis, hosts included, once per micro-batch. Here, on
such a mesh, each device instead receives, over the axes that split both the tokens and D (FSDP,
within a host in a hybrid mesh), the other devices' cotangents for its own D slice (an all-to-all
of [tokens, D], small beside the table), adds them into its [V / tensor, D / fsdp] slice, and sums
that slice over the remaining batch axes (data, across hosts): what crosses the hosts is the
device's own slice, not the whole table.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from grpo_jax.sharding import auto_shape, split_axes


def embedding_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table [V, D], tokens [...] int -> [..., D] rows of the table (an id outside [0, V) reads a
  NaN row, as jnp.take does)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or tokens.ndim == 0:
    return jnp.take(table, tokens, axis=0)
  shape = auto_shape(mesh)
  token_axes = split_axes(tokens.shape[0], 'batch', shape)
  scatter_axes = tuple(axis for axis in split_axes(table.shape[1], 'embed', shape) if axis in token_axes)
  if not token_axes:
    return jnp.take(table, tokens, axis=0)
  vocab_axes = split_axes(table.shape[0], 'vocab', shape)
  rows = table.shape[0] // math.prod(shape[axis] for axis in vocab_axes)
  return _lookup((token_axes, scatter_axes, vocab_axes, rows, jnp.dtype(table.dtype).name), table, tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(layout, table, tokens):
  """layout: (token axes, those that also split D, vocabulary axes, table rows per device, dtype)."""
  return jnp.take(table, tokens, axis=0)


def _lookup_fwd(layout, table, tokens):
  return jnp.take(table, tokens, axis=0), tokens


def _lookup_bwd(layout, tokens, cotangent):
  token_axes, scatter_axes, vocab_axes, rows, dtype = layout
  summed_axes = tuple(axis for axis in token_axes if axis not in scatter_axes)
  model = cotangent.shape[-1]

  def local(g, ids):
    g, ids = g.reshape(-1, model), ids.reshape(-1)
    if scatter_axes:  # every token of the group, this device's D slice of its cotangent
      g = lax.all_to_all(g, scatter_axes, split_axis=1, concat_axis=0, tiled=True)
      ids = lax.all_gather(ids, scatter_axes, tiled=True)
    if vocab_axes:  # this device's rows of the table
      ids = ids - lax.axis_index(vocab_axes) * rows
    ids = jnp.where((ids >= 0) & (ids < rows), ids, rows)  # others (and bad ids) land past the end: dropped
    grad = jnp.zeros((rows, g.shape[1]), jnp.float32).at[ids].add(g.astype(jnp.float32), mode='drop')
    if summed_axes:
      grad = lax.psum(grad, summed_axes)
    return grad.astype(dtype)

  token_spec = P(token_axes, *(None,) * (tokens.ndim - 1))
  grad = jax.shard_map(local, in_specs=(P(token_axes, *(None,) * tokens.ndim), token_spec),
                       out_specs=P(vocab_axes or None, scatter_axes or None), check_vma=False)(cotangent, tokens)
  return grad, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
