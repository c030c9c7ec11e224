"""Packing: a batch's sequences (prompt + completion, padding dropped) laid end to end in rows of
L tokens, so the update's passes compute real tokens instead of padding.

Everything here is traceable and runs inside the update's jit. The rows [B] of a batch are split
into n groups over the mesh's batch axes (as the sampler's slots are: `batch_groups`), and each
group packs only its own sequences into its own R packed rows, so no token crosses devices. Within
a group, first-fit decreasing places the sequences: longest first, each into the first row with
room for it. Since L >= Tp + N, every sequence fits an empty row, no sequence is split, and the
rows in use are always the first `rows_used` of the group.

A packed row holds its sequences as segments 1, 2, 3, ... (0 after the last one); the model
restarts positions at each segment and attends within it, so every real token sees exactly what
it sees in its padded row. Per-token quantities of the loss stay in the padded [B, N] layout; only
the model's log-probs travel, gathered from the packed layout by each sequence's (row, column).

Dimension letters: n batch groups, Bn sequences per group, R packed rows per group, L tokens per
packed row, W = Tp + N tokens per padded row, N completion tokens.
"""

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec

from grpo_jax.model.moe import unrecorded_id
from grpo_jax.model.vision import RowImages
from grpo_jax.records import along, map_along
from grpo_jax.sharding import auto_shape, batch_groups, constrain, grouped, split_axes


@struct.dataclass
class Packed:
  """The sequences of n batch groups, each group's packed into its own R rows of L tokens.

  tokens       [n, R, L] int32
  segment_ids  [n, R, L] int32  1, 2, ... for the sequences of a row, in order; 0 after them
  row          [n, Bn] int32    the packed row of each sequence (of its group)
  start        [n, Bn] int32    the column of each sequence's first completion token
  rows_used    [n] int32        rows holding a real token: rows [0, rows_used) of each group
  real_tokens  [] int32         real (prompt and completion) tokens of all groups
  routes       [n, R, L, Ls, k] the tokens' recorded experts (routing replay), or None
  positions    [n, R, L, 3]     the tokens' M-RoPE positions (sequences with images), or None
  placement    [n, R, L, 2] int32 each token's image feature: (its sequence b among the batch's B,
                                the feature's index among b's features, its prompt's), (-1, -1) for a
                                token that keeps its embedding; None without images
  """

  tokens: jax.Array = along('token')
  segment_ids: jax.Array = along('token')
  row: jax.Array
  start: jax.Array
  rows_used: jax.Array
  real_tokens: jax.Array
  routes: jax.Array | None = along('token', default=None)
  positions: jax.Array | None = along('token', default=None)
  placement: jax.Array | None = along('token', default=None)

  @property
  def row_length(self) -> int:
    return self.tokens.shape[-1]

  def map_tokens(self, fn) -> 'Packed':
    """fn applied to every per-token field present ([n, R, L, ...]: a micro-batch's rows, ...)."""
    return map_along(self, 'token', fn)


def first_fit_decreasing(lengths: jax.Array, rows: int, row_length: int):
  """Places sequences of `lengths` [S] (each <= row_length) into `rows` (>= S) rows, longest first,
  each into the first row with room. -> (row [S], offset [S]: its first column, segment [S]: its
  1-based index within the row)."""
  count = lengths.shape[0]
  order = jnp.argsort(-lengths, stable=True)

  def place(index, carry):
    fill, placed, row, offset, segment = carry
    sequence = order[index]
    length = lengths[sequence]
    target = jnp.argmax(fill + length <= row_length)  # the first row with room (an empty one always has)
    return (fill.at[target].add(length), placed.at[target].add(1), row.at[sequence].set(target),
            offset.at[sequence].set(fill[target]), segment.at[sequence].set(placed[target] + 1))

  zeros = jnp.zeros((count,), jnp.int32)
  carry = (jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32), zeros, zeros, zeros)
  _, _, row, offset, segment = jax.lax.fori_loop(0, count, place, carry)
  return row, offset, segment


def _pack_group(tokens, segment_ids, routes, positions, placement, completion_length: int, rows: int,
                row_length: int):
  """One group's padded rows tokens, segment_ids [Bn, W] (prompt left-padded, completion
  right-padded), routes [Bn, W, Ls, k], positions [Bn, W, 3] and placement [Bn, W] or None ->
  tokens, segment_ids [R, L], routes, positions, placement packed alike (or None), row, start [Bn],
  rows used."""
  width = tokens.shape[1]
  real = segment_ids != 0
  lengths = jnp.sum(real, axis=1, dtype=jnp.int32)
  prompt_tokens = jnp.sum(real[:, :width - completion_length], axis=1, dtype=jnp.int32)
  row, offset, segment = first_fit_decreasing(lengths, rows, row_length)
  # Column of each real token: its sequence's offset plus its index among the sequence's real tokens.
  first = width - completion_length - prompt_tokens  # the first real (prompt) token of each row
  columns = offset[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :] - first[:, None]
  columns = jnp.where(real, columns, row_length)  # padding: out of range, dropped
  targets = jnp.broadcast_to(row[:, None], columns.shape)
  def scatter(values, fill):
    empty = jnp.full((rows, row_length) + values.shape[2:], fill, values.dtype)
    return empty.at[targets, columns].set(values, mode='drop', unique_indices=True)

  packed_tokens = scatter(tokens.astype(jnp.int32), 0)
  packed_segments = scatter(jnp.broadcast_to(segment[:, None], columns.shape).astype(jnp.int32), 0)
  # The optional fields (None: absent) travel alike.
  packed_routes = jax.tree.map(lambda r: scatter(r, unrecorded_id(r.dtype)), routes)
  packed_positions = jax.tree.map(lambda p: scatter(p.astype(jnp.int32), 0), positions)
  packed_placement = jax.tree.map(lambda p: scatter(p.astype(jnp.int32), -1), placement)
  fill = jnp.zeros((rows,), jnp.int32).at[row].add(lengths)
  return (packed_tokens, packed_segments, packed_routes, packed_positions, packed_placement, row,
          offset + prompt_tokens, jnp.sum(fill > 0, dtype=jnp.int32))


def pack(tokens: jax.Array, segment_ids: jax.Array, completion_length: int, row_length: int,
         micro_rows: int, routes: jax.Array | None = None, vision: RowImages | None = None,
         rows: int | None = None) -> Packed:
  """Packs the padded rows tokens, segment_ids [B, W] (each a left-padded prompt then a completion
  of `completion_length` slots; routes [B, W, Ls, k] travel with their tokens, and so do the
  M-RoPE positions and image placements of `vision`, model/vision.py, its placements made flat over
  the B sequences' features) into rows of `row_length` >= W tokens, per batch group. Each group
  gets R = Bn rows rounded up to a multiple of `micro_rows` (one sequence per row at worst), so
  the packed rows split into micro-batches of `micro_rows` rows of every group. `rows`: a smaller
  R, known by the caller to hold every group's sequences (first-fit would put one that finds no
  room at row 0's end, cut where the row ends)."""
  groups = batch_groups(tokens.shape[0])
  per_group = tokens.shape[0] // groups
  if rows is None:
    rows = -(-per_group // micro_rows) * micro_rows
  positions = placement = None
  if vision is not None:
    local = vision.placement
    sequence = jnp.broadcast_to(jnp.arange(tokens.shape[0], dtype=jnp.int32)[:, None], local.shape)
    placement = jnp.stack([jnp.where(local >= 0, sequence, -1), local], axis=-1)
    positions = vision.positions
  pack_one = lambda t, s, r, p, q: _pack_group(t, s, r, p, q, completion_length, rows, row_length)  # noqa: E731
  by_group = jax.tree.map(lambda x: grouped(x, groups), (tokens, segment_ids, routes, positions, placement))
  packed_tokens, packed_segments, packed_routes, packed_positions, packed_placement, row, start, rows_used = jax.vmap(
      pack_one)(*by_group)
  packed = Packed(tokens=packed_tokens, segment_ids=packed_segments, row=row, start=start, rows_used=rows_used,
                  real_tokens=jnp.sum(segment_ids != 0, dtype=jnp.int32), routes=packed_routes,
                  positions=packed_positions, placement=packed_placement)
  return packed.map_tokens(lambda x: constrain(x, ('batch',) + (None,) * (x.ndim - 1)))  # each group's rows on its devices



def micro_batch_count(packed: Packed, micro_rows: int) -> jax.Array:
  """Micro-batches of `micro_rows` rows per group that cover every group's rows in use."""
  return (jnp.max(packed.rows_used) + micro_rows - 1) // micro_rows


def micro_batch(packed: Packed, index: jax.Array, micro_rows: int) -> Packed:
  """Micro-batch `index`: rows [index * m, (index + 1) * m) of every group (tokens [n, m, L]);
  `row` relative to them, -1 for the sequences packed elsewhere."""
  first = index * micro_rows
  take = lambda x: jax.lax.dynamic_slice_in_dim(x, first, micro_rows, axis=1)  # noqa: E731
  inside = (packed.row >= first) & (packed.row < first + micro_rows)
  return packed.map_tokens(take).replace(row=jnp.where(inside, packed.row - first, -1))


def unpack(values: jax.Array, packed: Packed, completion_length: int) -> jax.Array:
  """Per-token values [n, R, L - 1] of the packed rows, aligned so that values[:, r, c - 1]
  belongs to the token in column c (what position c - 1 predicts) -> [B, N] in the padded layout:
  completion token t of a sequence from column start + t of its row. Sequences absent from
  `packed` (row -1) read 0; slots past a sequence's completion read a finite value of no meaning
  (the completion mask excludes them, as it excludes the padded layout's padding)."""
  def one_group(group_values, row, start):
    columns = start[:, None] - 1 + jnp.arange(completion_length, dtype=jnp.int32)[None, :]
    inside = (row[:, None] >= 0) & (columns < group_values.shape[1])
    picked = group_values[jnp.maximum(row, 0)[:, None], jnp.clip(columns, 0, group_values.shape[1] - 1)]
    return jnp.where(inside, picked, 0.0)
  out = on_groups(jax.vmap(one_group), values, packed.row, packed.start)
  return out.reshape((-1,) + out.shape[2:])


def on_groups(fn, *groups: jax.Array) -> jax.Array:
  """fn(*groups) of arrays that lead with the n batch groups, run by each device on its own groups
  (as the batch rule splits n; a shard_map) where a mesh splits them: the work stays local, and
  XLA's partitioner never has to place the gathers of `fn` (a batched gather over groups that a
  subset of the axes splits has aborted it)."""
  mesh = jax.sharding.get_abstract_mesh()
  axes = () if mesh.empty else split_axes(groups[0].shape[0], 'batch', auto_shape(mesh))
  if not axes:
    return fn(*groups)
  spec = PartitionSpec(axes)
  return jax.shard_map(fn, in_specs=(spec,) * len(groups), out_specs=spec, check_vma=False)(*groups)


def members(packed: Packed) -> jax.Array:
  """[B] bool: the sequences packed into these rows (a micro-batch's)."""
  return (packed.row >= 0).reshape(-1)
