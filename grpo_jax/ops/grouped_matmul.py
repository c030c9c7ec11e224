"""Grouped matmul: rows sorted by group, each group multiplied by its own weight matrix.

`grouped_matmul(rows [R, D], weight [E, D, M], group_sizes [E])` -> [R, M] has exactly
`jax.lax.ragged_dot`'s semantics: group g owns the next group_sizes[g] rows, rows past the
groups' total come out as zeros (and get zero gradient), and a total past R is cut at R. It is
what a mixture-of-experts layer multiplies its expert-sorted (token, expert) rows with
(model/moe.py), and is differentiable in rows and weight.

Implementations (same results up to fp32 summation order):
  'ragged_dot'  jax.lax.ragged_dot and its own autodiff. XLA:TPU keeps it as a Mosaic
                grouped-matmul kernel; XLA:CPU lowers it as a masked dense product over the E
                groups ([E, R, *] temporaries), which the tiny CPU test models afford.
  'triton'      Pallas Triton kernels (grouped_matmul_triton.py) with a custom VJP: d rows is the
                same kernel against the weight read transposed, d weight a kernel over (group,
                D tile, M tile) looping over the group's rows. XLA:GPU expands ragged_dot
                densely into [E, R, D] and [E, R, M] tensors (jax 0.12, with or without its
                ragged-dot fusion flags), which at Qwen3-30B-A3B's 128 experts is 128 times the
                work and memory; these kernels never build an [E, R, *] array.
  'auto'        'triton' when compiling for GPUs (`target_platform`), else 'ragged_dot'.

The Triton kernels read rows in tiles of block_rows rows of one group each (a group's last tile
masked), so a group of s rows costs ceil(s / block_rows) tiles: at most E tiles more than a dense
product over R rows. The tile map is built with a few [E]- and [Tl]-sized jnp ops (`row_tiles`),
Tl = ceil(R / block_rows) + E tiles: a static grid whose unused tiles return at once. Triton's
dots take tiles of at least 16 rows, so a decode step's few rows an expert (Qwen3-30B-A3B: 512
rows over 128 experts) cost 4x the FLOPs of the rows; the weights, which bound it, are read once
either way. Not yet
run on a GPU: compiled deviceless for H100 (tests/test_grouped_matmul.py) and tested in
interpret mode against ragged_dot; the blocks are untuned.

Under a device mesh the Pallas call is not partitioned by XLA (as with any custom call): it runs
inside model/expert_parallel.py's shard_map, on each device's own experts.

`python -m grpo_jax.plan.experts mlp TARGET` compiles a Qwen3-30B-A3B expert MLP for TARGET
(deviceless, see grpo_jax/plan/targets.py) and prints what is in the program as one JSON line.
"""

import dataclasses
import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from grpo_jax.ops.logprob import target_platform

GroupedMatmulImplementation = Literal['auto', 'ragged_dot', 'triton']
IMPLEMENTATIONS = typing.get_args(GroupedMatmulImplementation)
# Caps of the Triton tiles, untuned (no GPU at hand): [128 rows, 128 columns] fp32 accumulators
# (64 registers a thread at 8 warps) and 64-deep contraction slices, whose bf16 operand tiles in
# 3 pipeline stages take 96 KiB of an H100's 227 KiB of shared memory. A row tile reads its group's whole weight slice, so
# taller tiles read the weights fewer times (at 256 rows an expert, twice instead of four times).
# The weight gradient's [D tile, M tile] accumulators are 128 x 128 for the same reason: each
# program reads its group's d out columns once per D tile.
BLOCK_ROWS, BLOCK_OUT, BLOCK_INNER, BLOCK_WEIGHT = 128, 128, 64, 128


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static tiling of one Triton call (hashable: a custom_vjp nondiff argument)."""
  block_rows: int
  interpret: bool


def grouped_matmul(rows, weight, group_sizes, *, implementation: GroupedMatmulImplementation = 'auto',
                   block_rows: int | None = None, interpret: bool | None = None):
  """rows [R, D] sorted by group, weight [E, D, M], group_sizes [E] integer -> [R, M].

  Row r of group g (the rows sum(group_sizes[:g]) .. sum(group_sizes[:g+1]) - 1) becomes
  rows[r] @ weight[g]; rows past sum(group_sizes) become zeros. The result has the common dtype
  of rows and weight, accumulated in fp32. block_rows (triton: a power of two >= 16) defaults to
  the mean group size rounded up to a power of two within [16, 128], so small decode batches do
  not pad each group's few rows to 128. interpret defaults to True exactly on CPU targets.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}')
  if (rows.ndim != 2 or weight.ndim != 3 or group_sizes.shape != weight.shape[:1]
          or rows.shape[1] != weight.shape[1]):
    raise ValueError(f'rows {rows.shape}, weight {weight.shape} and group_sizes {group_sizes.shape} '
                     'must be [R, D], [E, D, M] and [E]')
  platform = target_platform()
  if implementation == 'auto':
    implementation = 'triton' if platform == 'gpu' else 'ragged_dot'
  if implementation == 'ragged_dot':
    return jax.lax.ragged_dot(rows, weight, group_sizes)
  block_rows = block_rows or default_block_rows(rows.shape[0], weight.shape[0])
  if block_rows < 16 or block_rows & (block_rows - 1):
    raise ValueError(f'triton grouped_matmul needs a power-of-two block_rows >= 16, got {block_rows}')
  dtype = jnp.result_type(rows.dtype, weight.dtype)
  plan = _Plan(block_rows, platform == 'cpu' if interpret is None else interpret)
  return _triton(plan, rows.astype(dtype), weight.astype(dtype), group_sizes.astype(jnp.int32))


def default_block_rows(num_rows: int, num_groups: int) -> int:
  """The Triton row tile: the mean group size as a power of two within [16, BLOCK_ROWS]."""
  return min(BLOCK_ROWS, max(16, pl.next_power_of_2(-(-num_rows // num_groups))))


def group_bounds(group_sizes, num_rows: int):
  """group_sizes [E] -> (first, end) int32 [E]: group g owns rows [first[g], end[g]), cut at R
  as ragged_dot cuts them."""
  end = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), num_rows).astype(jnp.int32)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]]), end


def row_tiles(group_sizes, num_rows: int, block_rows: int):
  """group_sizes [E] -> (group, start, end) int32 [Tl], Tl = ceil(R / block_rows) + E: tile t
  holds rows [start[t], end[t]) (at most block_rows) of group[t]. Group E is the rows past the
  groups' total; unused tiles are empty (start == end == 0, group E).

  Tl is enough: E + 1 runs of lengths a_0 .. a_E summing to R take sum ceil(a_i / block_rows)
  <= ceil(R / block_rows) + E tiles.
  """
  num_groups = group_sizes.shape[0]
  first, end = group_bounds(group_sizes, num_rows)
  first = jnp.append(first, end[-1])  # group E: the rows past the total
  end = jnp.append(end, num_rows)
  counts = (end - first + block_rows - 1) // block_rows  # [E + 1]
  tile_end = jnp.cumsum(counts)
  tiles = jnp.arange(-(-num_rows // block_rows) + num_groups, dtype=jnp.int32)
  group = jnp.searchsorted(tile_end, tiles, side='right', method='compare_all').astype(jnp.int32)
  used = group <= num_groups
  group = jnp.minimum(group, num_groups)
  start = first[group] + (tiles - (tile_end - counts)[group]) * block_rows
  stop = jnp.minimum(start + block_rows, end[group])
  return group, jnp.where(used, start, 0), jnp.where(used, stop, 0)


# ---- the Triton path: one custom VJP, kernels in grouped_matmul_triton.py ----

def _blocks(size: int, cap: int) -> int:
  """A power-of-two tile side >= 16 (Triton's dots) for a dimension of `size`, at most cap."""
  return min(cap, max(16, pl.next_power_of_2(size)))


def _rows_product(plan: _Plan, x, w, group_sizes, *, transpose: bool, name: str):
  from grpo_jax.ops import grouped_matmul_triton as kernels  # Triton imported only when it runs
  inner = w.shape[2] if transpose else w.shape[1]
  outer = w.shape[1] if transpose else w.shape[2]
  tiles = row_tiles(group_sizes, x.shape[0], plan.block_rows)
  return kernels.rows_matmul(tiles, x, w, transpose=transpose, block_rows=plan.block_rows,
                             block_out=_blocks(outer, BLOCK_OUT), block_inner=_blocks(inner, BLOCK_INNER),
                             interpret=plan.interpret, name=name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _triton(plan: _Plan, rows, weight, group_sizes):
  return _rows_product(plan, rows, weight, group_sizes, transpose=False, name='grouped_matmul')


def _triton_fwd(plan: _Plan, rows, weight, group_sizes):
  return _triton(plan, rows, weight, group_sizes), (rows, weight, group_sizes)


def _triton_bwd(plan: _Plan, residuals, d_out):
  """d rows [R, D] = d_out's rows against their group's weight transposed; d weight [E, D, M]
  = per group rows^T @ d_out. Rows past the total get zero d rows and add nothing to d weight."""
  from grpo_jax.ops import grouped_matmul_triton as kernels
  rows, weight, group_sizes = residuals
  d_out = d_out.astype(rows.dtype)
  d_rows = _rows_product(plan, d_out, weight, group_sizes, transpose=True,
                         name='grouped_matmul_grad_rows')
  first, end = group_bounds(group_sizes, rows.shape[0])
  d_weight = kernels.weight_matmul(first, end, rows, d_out, block_rows=plan.block_rows,
                                   block_in=_blocks(weight.shape[1], BLOCK_WEIGHT),
                                   block_out=_blocks(weight.shape[2], BLOCK_OUT),
                                   interpret=plan.interpret)
  return kernels.sum_to_type(d_rows, rows), kernels.sum_to_type(d_weight, weight), None


_triton.defvjp(_triton_fwd, _triton_bwd)


# ---- deviceless compiles: what the program holds on the hardware (tests, bench/moe.py) ----

# Qwen3-30B-A3B's sparse layers: E experts of SwiGLU width M at model width D, k experts a token.
QWEN3_30B_A3B = dict(experts=128, model=2048, hidden=768, top_k=8)


def expert_mlp(rows, group_sizes, gate_weight, up_weight, down_weight, **options):
  """rows [R, D] sorted by expert, group_sizes [E], gate / up [E, D, M], down [E, M, D] -> [R, D]:
  each row through its expert's SwiGLU, as three grouped matmuls (model/moe.py's experts, and the
  compiles and benchmark below)."""
  hidden = (jax.nn.silu(grouped_matmul(rows, gate_weight, group_sizes, **options))
            * grouped_matmul(rows, up_weight, group_sizes, **options))
  return grouped_matmul(hidden, down_weight, group_sizes, **options)


def triton_cost(group_sizes, inner: int, outer: int, itemsize: int, *, weight_gradient: bool = False,
                block_rows: int | None = None) -> dict:
  """What one Triton kernel call does, counted from its tiles, since XLA's cost analysis sees a
  custom call as nothing: group_sizes [E] (NumPy), rows [sum, inner] against weights [E, inner,
  outer] (the rows kernel), or rows^T [inner, sum] @ d out [sum, outer] per group (the weight
  gradient). flops include the masked rows of each group's last tile; bytes are each operand and
  result moved once (HBM traffic if L2 serves a row tile's reuse across M tiles; not measured)."""
  import numpy as np
  sizes = np.asarray(group_sizes, np.int64)
  rows = int(sizes.sum())
  block_rows = block_rows or default_block_rows(rows, sizes.size)
  padded = int((-(-sizes // block_rows) * block_rows).sum())
  weights = sizes.size if weight_gradient else int(np.count_nonzero(sizes))
  return dict(flops=2.0 * padded * inner * outer,
              bytes=float(itemsize * (rows * inner + rows * outer + weights * inner * outer)))
