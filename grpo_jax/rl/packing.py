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
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec

from grpo_jax.model.attention import TREE_BRANCHES, tree_root
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
  real_tokens  [] int32         tokens the rows hold, of all groups: the sequences' real (prompt and
                                completion) tokens, a tree's shared prompt tokens counted once
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


def _scatter(values: jax.Array, targets: jax.Array, columns: jax.Array, rows: int, row_length: int, fill) -> jax.Array:
  """Per-token values [Bn, W, ...] of the padded rows into packed rows [R, L, ...] at (targets,
  columns) [Bn, W]; a column of L or more (padding, a dropped token) is dropped."""
  empty = jnp.full((rows, row_length) + values.shape[2:], fill, values.dtype)
  return empty.at[targets, columns].set(values, mode='drop', unique_indices=True)


def _packed_fields(tokens, segments, routes, positions, placement, targets, columns, rows: int, row_length: int):
  """(tokens, segment ids, routes, positions, placement) of one group scattered into its packed rows
  (rl/packing._scatter); `segments` [Bn, W] each token's packed segment id. The optional fields
  (None: absent) travel alike."""
  scatter = lambda values, fill: _scatter(values, targets, columns, rows, row_length, fill)  # noqa: E731
  return (scatter(tokens.astype(jnp.int32), 0), scatter(segments.astype(jnp.int32), 0),
          jax.tree.map(lambda r: scatter(r, unrecorded_id(r.dtype)), routes),
          jax.tree.map(lambda p: scatter(p.astype(jnp.int32), 0), positions),
          jax.tree.map(lambda p: scatter(p.astype(jnp.int32), -1), placement))


def _pack_group(tokens, segment_ids, routes, positions, placement, completion_length: int, rows: int,
                row_length: int):
  """One group's padded rows tokens, segment_ids [Bn, W] (prompt left-padded, completion
  right-padded), routes [Bn, W, Ls, k], positions [Bn, W, 3] and placement [Bn, W] or None ->
  tokens, segment_ids [R, L], routes, positions, placement packed alike (or None), row, start [Bn],
  rows used, tokens placed."""
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
  segments = jnp.broadcast_to(segment[:, None], columns.shape)
  fields = _packed_fields(tokens, segments, routes, positions, placement, targets, columns, rows, row_length)
  fill = jnp.zeros((rows,), jnp.int32).at[row].add(lengths)
  return (*fields, row, offset + prompt_tokens, jnp.sum(fill > 0, dtype=jnp.int32), jnp.sum(fill))


# Hash weights of a prompt's tokens (_prompt_leaders): fixed odd 32-bit constants, two per column.
_HASH_SEED = 0x7EE5


def _prompt_leaders(tokens, real, prompt_width: int, prompt_ids, routes) -> jax.Array:
  """[Bn] each sequence's leader: the group's first sequence with the same prompt (its real tokens
  in the first `prompt_width` columns, and where given the same `prompt_ids` [Bn] (whose images it
  shows) and the same recorded routes of its prompt tokens), itself when none before it. Found by
  two 32-bit hashes of the prompts, then checked token by token, so a collision only loses sharing."""
  prompt = jnp.where(real[:, :prompt_width], tokens[:, :prompt_width] + 1, 0).astype(jnp.uint32)
  weights = np.random.default_rng(_HASH_SEED).integers(0, 1 << 32, (2, prompt_width), dtype=np.uint64)
  hashes = jnp.sum(prompt[:, None, :] * jnp.asarray(weights.astype(np.uint32) | 1)[None], axis=2, dtype=jnp.uint32)
  if prompt_ids is not None:
    hashes = hashes + prompt_ids.astype(jnp.uint32)[:, None] * jnp.uint32(0x9E3779B1)
  count = tokens.shape[0]
  candidate = jnp.argmax(jnp.all(hashes[:, None, :] == hashes[None, :, :], axis=2), axis=1)  # the first equal
  same = jnp.all(prompt == prompt[candidate], axis=1)
  if prompt_ids is not None:
    same &= prompt_ids == prompt_ids[candidate]
  if routes is not None:
    prompt_routes = routes[:, :prompt_width]
    same &= jnp.all((prompt_routes == prompt_routes[candidate]).reshape(count, -1)
                    | ~jnp.repeat(real[:, :prompt_width], prompt_routes[0, 0].size, axis=1), axis=1)
  return jnp.where(same, candidate, jnp.arange(count)).astype(jnp.int32)


def place_trees(lengths: jax.Array, prefix: jax.Array, leader: jax.Array, rows: int, row_length: int):
  """Places S sequences of `lengths` [S] as trees into `rows` (>= S) rows of `row_length` (>= every
  length): the sequences of one `leader` [S] share their first `prefix` [S] tokens (their prompt
  but its last token; 0: a sequence of its own), which a tree holds once, its branches (each
  sequence's other tokens) right after it. Trees go largest first, each into the first row with
  room for it, a tree's branches longest first into the first row holding a copy of their tree
  with room for them, else into a new copy of the tree (its prefix again) in the first row with
  room, so no row holds a tree twice. -> (row [S], prefix_at [S]: the
  column where the sequence's tree begins when the sequence opened it, else -1, branch_at [S]: its
  branch's first column, segment [S]: its branch's segment id (attention.TREE_BRANCHES; a plain id
  below it for a sequence of its own), fill [rows]: tokens placed per row)."""
  count = lengths.shape[0]
  branch = lengths - prefix
  tree_size = prefix[leader] + jax.ops.segment_sum(branch, leader, num_segments=count)[leader]
  order = jnp.lexsort((-lengths, leader, -tree_size))  # the last key first: tree size, its leader, length
  per_sequence = jnp.zeros((count,), jnp.int32)
  per_row = jnp.zeros((rows,), jnp.int32)
  per_copy = jnp.zeros((count, rows), jnp.int32)  # [leader, row]: its copy's root id there (0: none), branches

  def place(index, carry):
    fill, plain, trees, copy_root, copy_count, row, prefix_at, branch_at, segment = carry
    sequence = order[index]
    lead, shared, own = leader[sequence], prefix[sequence], branch[sequence]
    tree = shared > 0
    roots, branches = copy_root[lead], copy_count[lead]
    # A branch joins the first copy of its tree with room for it (so a row holds a tree once), else
    # opens a copy, its prefix again, in the first row with room for both.
    joinable = tree & (roots > 0) & (fill + own <= row_length) & (branches + 1 < TREE_BRANCHES)
    joins = jnp.any(joinable)
    need = jnp.where(joins, own, shared + own)
    target = jnp.where(joins, jnp.argmax(joinable), jnp.argmax(fill + need <= row_length))  # an empty row has room
    start = fill[target]
    opens = tree & ~joins
    root = jnp.where(opens, (trees[target] + 1) * TREE_BRANCHES, roots[target])
    rank = jnp.where(opens, 1, branches[target] + 1)
    keep = lambda table, new: table.at[lead, target].set(jnp.where(tree, new, table[lead, target]))  # noqa: E731
    return (fill.at[target].add(need), plain.at[target].add(~tree), trees.at[target].add(opens),
            keep(copy_root, root), keep(copy_count, rank), row.at[sequence].set(target),
            prefix_at.at[sequence].set(jnp.where(opens, start, -1)),
            branch_at.at[sequence].set(start + jnp.where(opens, shared, 0)),
            segment.at[sequence].set(jnp.where(tree, root + rank, plain[target] + 1)))

  carry = (per_row, per_row, per_row, per_copy, per_copy, per_sequence, per_sequence, per_sequence, per_sequence)
  fill, _, _, _, _, row, prefix_at, branch_at, segment = jax.lax.fori_loop(0, count, place, carry)
  return row, prefix_at, branch_at, segment, fill


def _pack_tree_group(tokens, segment_ids, routes, positions, placement, prompt_ids, completion_length: int, rows: int,
                     row_length: int):
  """_pack_group with the sequences that share a prompt (_prompt_leaders) packed as trees
  (place_trees): the prompt's tokens but its last once per tree, each sequence's last prompt token
  and completion a branch after them, so its first completion token is predicted, as in its padded
  row, by the last prompt token having seen the whole prompt. prompt_ids [Bn] or None: whose images
  each sequence's prompt shows."""
  width = tokens.shape[1]
  prompt_width = width - completion_length
  real = segment_ids != 0
  lengths = jnp.sum(real, axis=1, dtype=jnp.int32)
  prompt_tokens = jnp.sum(real[:, :prompt_width], axis=1, dtype=jnp.int32)
  prefix = jnp.maximum(prompt_tokens - 1, 0)
  leader = _prompt_leaders(tokens, real, prompt_width, prompt_ids, routes)
  row, prefix_at, branch_at, segment, fill = place_trees(lengths, prefix, leader, rows, row_length)
  index = jnp.arange(width, dtype=jnp.int32)[None, :] - (prompt_width - prompt_tokens)[:, None]  # among real tokens
  shared = index < prefix[:, None]
  columns = jnp.where(shared, prefix_at[:, None] + index, branch_at[:, None] + index - prefix[:, None])
  kept = real & (~shared | (prefix_at >= 0)[:, None])  # a prefix token is written by its tree's opener only
  columns = jnp.where(kept, columns, row_length)
  targets = jnp.broadcast_to(row[:, None], columns.shape)
  segments = jnp.where(shared, tree_root(segment)[:, None], segment[:, None])
  fields = _packed_fields(tokens, segments, routes, positions, placement, targets, columns, rows, row_length)
  start = branch_at + prompt_tokens - prefix
  return (*fields, row, start, jnp.sum(fill > 0, dtype=jnp.int32), jnp.sum(fill))


def pack(tokens: jax.Array, segment_ids: jax.Array, completion_length: int, row_length: int,
         micro_rows: int, routes: jax.Array | None = None, vision: RowImages | None = None,
         rows: int | None = None, trees: bool = False) -> Packed:
  """Packs the padded rows tokens, segment_ids [B, W] (each a left-padded prompt then a completion
  of `completion_length` slots; routes [B, W, Ls, k] travel with their tokens, and so do the
  M-RoPE positions and image placements of `vision`, model/vision.py, its placements made flat over
  the B sequences' features) into rows of `row_length` >= W tokens, per batch group. Each group
  gets R = Bn rows rounded up to a multiple of `micro_rows` (one sequence per row at worst), so
  the packed rows split into micro-batches of `micro_rows` rows of every group. `rows`: a smaller
  R, known by the caller to hold every group's sequences (first-fit would put one that finds no
  room at row 0's end, cut where the row ends). `trees`: the sequences of a group that share a
  prompt hold it once per row (_pack_tree_group; algo.tree_packing)."""
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
  if trees:
    prompt_ids = None if vision is None else vision.prompt
    pack_one = lambda t, s, r, p, q, i: _pack_tree_group(t, s, r, p, q, i, completion_length, rows, row_length)  # noqa: E731
    inputs = (tokens, segment_ids, routes, positions, placement, prompt_ids)
  else:
    pack_one = lambda t, s, r, p, q: _pack_group(t, s, r, p, q, completion_length, rows, row_length)  # noqa: E731
    inputs = (tokens, segment_ids, routes, positions, placement)
  by_group = jax.tree.map(lambda x: grouped(x, groups), inputs)
  (packed_tokens, packed_segments, packed_routes, packed_positions, packed_placement, row, start, rows_used,
   placed) = jax.vmap(pack_one)(*by_group)
  packed = Packed(tokens=packed_tokens, segment_ids=packed_segments, row=row, start=start, rows_used=rows_used,
                  real_tokens=jnp.sum(placed), routes=packed_routes, positions=packed_positions,
                  placement=packed_placement)
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
