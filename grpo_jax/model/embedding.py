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

from grpo_jax.sharding import auto_shape, row_and_length_axes, split_axes


def embedding_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table [V, D], tokens [...] int -> [..., D] rows of the table (an id outside [0, V) reads a
  NaN row, as jnp.take does)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or tokens.ndim == 0:
    return jnp.take(table, tokens, axis=0)
  shape = auto_shape(mesh)
  # Rows of tokens [B, T] split along their length too (context parallelism): T over the 'seq' axes.
  row_axes, length_axes = (row_and_length_axes(*tokens.shape, shape) if tokens.ndim == 2 else
                           (split_axes(tokens.shape[0], 'batch', shape), ()))
  token_axes = row_axes + length_axes
  scatter_axes = tuple(axis for axis in split_axes(table.shape[1], 'embed', shape) if axis in token_axes)
  if not token_axes:
    return jnp.take(table, tokens, axis=0)
  vocab_axes = split_axes(table.shape[0], 'vocab', shape)
  rows = table.shape[0] // math.prod(shape[axis] for axis in vocab_axes)
  return _lookup((row_axes, length_axes, scatter_axes, vocab_axes, rows, jnp.dtype(table.dtype).name), table, tokens)


def _token_spec(layout, ndim: int) -> P:
  row_axes, length_axes = layout[:2]
  length = (length_axes,) if length_axes else ()
  return P(row_axes or None, *length, *(None,) * (ndim - 1 - len(length)))


def _take(layout, table, tokens):
  """Each device's tokens' rows, the table's D gathered first as an FSDP weight is (with the
  tokens split along their length, XLA's partitioner would otherwise replicate the rows)."""
  vocab_axes = layout[3]
  if layout[1]:
    table = jax.lax.with_sharding_constraint(table, P(vocab_axes or None, None))
    return jax.lax.with_sharding_constraint(jnp.take(table, tokens, axis=0), P(*_token_spec(layout, tokens.ndim), None))
  return jnp.take(table, tokens, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lookup(layout, table, tokens):
  """layout: (row axes, length axes, those of both that also split D, vocabulary axes, table rows per
  device, dtype)."""
  return _take(layout, table, tokens)


def _lookup_fwd(layout, table, tokens):
  return _take(layout, table, tokens), tokens


def _lookup_bwd(layout, tokens, cotangent):
  row_axes, length_axes, scatter_axes, vocab_axes, rows, dtype = layout
  token_axes = row_axes + length_axes
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

  token_spec = _token_spec(layout, tokens.ndim)
  grad = jax.shard_map(local, in_specs=(P(*token_spec, None), token_spec),
                       out_specs=P(vocab_axes or None, scatter_axes or None), check_vma=False)(cotangent, tokens)
  return grad, None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)
