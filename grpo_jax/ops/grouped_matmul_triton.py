"""The Triton (GPU) kernels of the grouped matmul (grouped_matmul.py holds the contract).

Rows arrive sorted by group and are read in place: no padded copy, no [E, R, *] array. A row
tile is `block_rows` consecutive rows of ONE group, starting at the group's first row or
block_rows after its previous tile, so a group of s rows takes ceil(s / block_rows) tiles, the
last one masked. The tile map (`tile_group`, `tile_start`, `tile_end`, int32 [Tl], from
grouped_matmul.row_tiles) tells each program where its rows are and whose weight they meet.
Tiles of group E (one past the last) cover the rows past the groups' total and store zeros, as
ragged_dot gives there; the map's unused tiles are empty and store nothing.

  rows kernel    out[r] = x[r] @ W[g(r)]  (or @ W[g(r)]^T): grid (row tiles, N tiles), each program
                 loops over the contraction in `block_inner` slices, its weight tiles read at the
                 group id loaded from the map. Serves the forward (W [E, D, M]) and d rows
                 (dout [R, M] against W [E, D, M] read transposed, never copied).
  weight kernel  dW[g] = x_g^T @ dy_g: grid (E, D tiles, M tiles), each program looping over its
                 group's rows (a trip count read from the group bounds: an empty group stores
                 zeros without reading anything, a group holding every row loops over all).

Triton's dots want power-of-two tiles of at least 16 on each side; dimensions that the blocks
do not divide are masked, and masked loads fill zeros, so no garbage (NaN included) enters a
contraction. Loads and stores at row offsets that are not multiples of the tile are ordinary
pointer arithmetic for Triton.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from grpo_jax.ops.tiles import F32, CONTRACT_TOKENS, CONTRACT_VOCAB, dot_precision, row_blocks


def _within(first, block: int, size: int):
  """[block] bool: which of first, first + 1, ... lie below size; None when every tile fits."""
  return None if size % block == 0 else first + jnp.arange(block) < size


def _tile_mask(row_mask, column_mask):
  """[rows, columns] mask from per-row and per-column ones (either may be None: all true)."""
  if row_mask is None and column_mask is None:
    return None
  if row_mask is None:
    return column_mask[None, :]
  return row_mask[:, None] if column_mask is None else row_mask[:, None] & column_mask[None, :]


def _load(ref, row_mask, column_mask):
  mask = _tile_mask(row_mask, column_mask)
  if mask is None:
    return ref[...]
  return pltriton.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def _rows_kernel(group_ref, start_ref, end_ref, x_ref, w_ref, out_ref, *, block_rows, block_out,
                 block_inner, transpose, groups):
  """x_ref [R, K]; w_ref [E, K, N] ([E, N, K] when transpose); out_ref [R, N]."""
  tile, column_tile = pl.program_id(0), pl.program_id(1)
  group, start, end = group_ref[tile], start_ref[tile], end_ref[tile]
  inner, outer = x_ref.shape[1], out_ref.shape[1]
  live = start + jnp.arange(block_rows) < end
  first_column = pl.multiple_of(column_tile * block_out, block_out)
  columns = pl.ds(first_column, block_out)
  columns_in = _within(first_column, block_out, outer)

  def step(k, acc):
    first = pl.multiple_of(k * block_inner, block_inner)
    inner_in = _within(first, block_inner, inner)
    x = _load(x_ref.at[pl.ds(start, block_rows), pl.ds(first, block_inner)], live, inner_in)
    if transpose:
      w = _load(w_ref.at[group, columns, pl.ds(first, block_inner)], columns_in, inner_in)
      return acc + lax.dot_general(x, w, CONTRACT_VOCAB, preferred_element_type=F32,
                                   precision=dot_precision(w.dtype))
    w = _load(w_ref.at[group, pl.ds(first, block_inner), columns], inner_in, columns_in)
    return acc + jnp.dot(x, w, preferred_element_type=F32, precision=dot_precision(w.dtype))

  # Tiles of the rows past the groups' total (group == groups) read no weight: their sum is empty.
  trips = (group < groups).astype(jnp.int32) * pl.cdiv(inner, block_inner)
  acc = lax.fori_loop(0, trips, step, jnp.zeros((block_rows, block_out), F32))
  mask = _tile_mask(live, columns_in)
  pltriton.store(out_ref.at[pl.ds(start, block_rows), columns], acc.astype(out_ref.dtype),
                 mask=jnp.broadcast_to(mask, acc.shape))


def _weight_kernel(first_ref, end_ref, x_ref, dy_ref, dw_ref, *, block_rows, block_in, block_out):
  """x_ref [R, K]; dy_ref [R, N]; dw_ref [E, K, N]; group g owns rows [first_ref[g], end_ref[g])."""
  group, in_tile, out_tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  first, end = first_ref[group], end_ref[group]
  first_in = pl.multiple_of(in_tile * block_in, block_in)
  first_out = pl.multiple_of(out_tile * block_out, block_out)
  inside, outside = pl.ds(first_in, block_in), pl.ds(first_out, block_out)
  in_mask = _within(first_in, block_in, x_ref.shape[1])
  out_mask = _within(first_out, block_out, dy_ref.shape[1])

  def step(i, acc):
    start = first + i * block_rows
    # Rows past the group's end belong to the next group: they must read as zeros here.
    live = start + jnp.arange(block_rows) < end
    x = _load(x_ref.at[pl.ds(start, block_rows), inside], live, in_mask)
    dy = _load(dy_ref.at[pl.ds(start, block_rows), outside], live, out_mask)
    return acc + lax.dot_general(x, dy, CONTRACT_TOKENS, preferred_element_type=F32,
                                 precision=dot_precision(x.dtype))

  acc = lax.fori_loop(0, row_blocks(end - first, block_rows), step,
                      jnp.zeros((block_in, block_out), F32))
  mask = _tile_mask(in_mask, out_mask)
  value = acc.astype(dw_ref.dtype)
  pltriton.store(dw_ref.at[group, inside, outside], value,
                 mask=None if mask is None else jnp.broadcast_to(mask, value.shape))


def _params(accumulator_rows: int, accumulator_columns: int):
  """8 warps from a [128, 128] fp32 accumulator up (64 of a thread's registers), else 4."""
  warps = 8 if accumulator_rows * accumulator_columns >= 128 * 128 else 4
  return pltriton.CompilerParams(num_warps=warps, num_stages=3)


def varying_axes(x) -> frozenset:
  """The manual mesh axes (inside a shard_map) that x varies over: jax 0.12 keeps them in its type's
  ManualAxisType, jax 0.11 (the GPU machines') in `vma`."""
  aval = jax.typeof(x)
  return frozenset(aval.mat.varying if hasattr(aval, 'mat') else aval.vma)


def sum_to_type(cotangent, primal):
  """A custom VJP's cotangent summed over the mesh axes it varies over and its primal does not:
  the transpose of the implicit broadcast that put the primal into a varying product (d rows
  over the 'tensor' shards of M, d weight over the batch axes)."""
  extra = tuple(sorted(varying_axes(cotangent) - varying_axes(primal)))
  return lax.psum(cotangent, extra) if extra else cotangent


def _result(shape, dtype, *operands) -> jax.ShapeDtypeStruct:
  """A kernel's result type, varying over the mesh axes its operands vary over: inside a shard_map
  that checks them (model/expert_parallel.py) a pallas_call must be told."""
  varying = frozenset().union(*map(varying_axes, operands))
  if not hasattr(jax.sharding, 'ManualAxisType'):  # jax 0.11
    return jax.ShapeDtypeStruct(shape, dtype, vma=varying)
  return jax.ShapeDtypeStruct(shape, dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=varying) if varying else None)


def rows_matmul(tiles, x, w, *, transpose: bool, block_rows: int, block_out: int,
                block_inner: int, interpret: bool, name: str):
  """tiles: (tile_group, tile_start, tile_end) int32 [Tl]; x [R, K]; w [E, K, N] (transpose:
  [E, N, K]) -> [R, N] in x's dtype, row r multiplied by the weight of the group its tile names."""
  groups = w.shape[0]
  outer = w.shape[1] if transpose else w.shape[2]
  kernel = functools.partial(_rows_kernel, block_rows=block_rows, block_out=block_out,
                             block_inner=block_inner, transpose=transpose, groups=groups)
  return pl.pallas_call(
      kernel, grid=(tiles[0].shape[0], pl.cdiv(outer, block_out)),
      out_shape=_result((x.shape[0], outer), x.dtype, x, w),
      compiler_params=_params(block_rows, block_out), interpret=interpret, name=name,
  )(*tiles, x, w)


def weight_matmul(group_first, group_end, x, dy, *, block_rows: int, block_in: int,
                  block_out: int, interpret: bool):
  """group_first, group_end int32 [E]; x [R, K]; dy [R, N] -> dW [E, K, N] in x's dtype,
  dW[g] = x[first_g:end_g]^T @ dy[first_g:end_g] (zeros for an empty group)."""
  groups, inner, outer = group_first.shape[0], x.shape[1], dy.shape[1]
  kernel = functools.partial(_weight_kernel, block_rows=block_rows, block_in=block_in,
                             block_out=block_out)
  return pl.pallas_call(
      kernel, grid=(groups, pl.cdiv(inner, block_in), pl.cdiv(outer, block_out)),
      out_shape=_result((groups, inner, outer), x.dtype, x, dy),
      compiler_params=_params(block_in, block_out), interpret=interpret,
      name='grouped_matmul_grad_weight',
  )(group_first, group_end, x, dy)
