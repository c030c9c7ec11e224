"""Packed scoring of preference pairs (`preferences.packing`): a micro-batch's conversations, each
pair's chosen and rejected side, laid end to end in rows of L tokens instead of one per padded row
of W, so the reward model's forward and backward compute real tokens rather than padding.

The packer is the RL update's (rl/packing.py): inside the jit, each batch group of the mesh packs
its own conversations first-fit decreasing into its own R rows, each conversation one segment
(segment ids 1, 2, ..., 0 after the last), so attention never crosses conversations and positions
restart at each. A conversation is read at its rightmost token that is not the pad id, the padded
row's rule (model/qwen2.py score_positions) applied within its segment: its column in the padded
row plus the column where its segment starts. Scores are therefore the padded layout's, and with
them the loss, the accuracy and the gradient.

R is static (no compilation per step) and chosen once from the data, exactly: the run's order is
known from the start (data/preference_set.py), so `rows_used` packs every micro-batch the run
will train on, on the device with the same first-fit, and R is the most rows any group filled. No
batch is refused or split, and resuming packs the same pairs the same way. The bound of an
arbitrary batch (2 B / micro_batches rows, one conversation each) would compute more tokens than
the padded rows do whenever L > W.

Dimension letters: n batch groups, S conversations of a micro-batch (2 B / micro_batches), R
packed rows per group, L tokens per packed row, W tokens per padded row, D model.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.model.qwen2 import score_positions
from grpo_jax.rl import packing

# Micro-batches of conversations `rows_used` packs in one call: its memory stays bounded however
# many steps the run has.
CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """The static shape of a micro-batch's packed rows: R rows of L tokens per batch group."""

  rows: int  # R: packed rows per batch group of a micro-batch
  row_length: int  # L: tokens per packed row (>= every conversation's length)


def packed_scores(model, tokens: jax.Array, segment_ids: jax.Array, layout: PackedLayout) -> jax.Array:
  """The reward model's scores [S] fp32 of S conversations in padded rows tokens, segment_ids
  [S, W] (right-padded; segment ids 1 on a conversation's tokens, 0 elsewhere; a conversation of
  no tokens takes no room and reads a finite score of no meaning), computed over packed rows."""
  count, width = tokens.shape
  packed = packing.pack(tokens, segment_ids, width, layout.row_length, 1, rows=layout.rows)
  groups, rows, length = packed.tokens.shape
  hidden = model.hidden_states(packed.tokens.reshape(groups * rows, length),
                               segment_ids=packed.segment_ids.reshape(groups * rows, length))
  hidden = hidden.reshape(groups, rows, length, hidden.shape[-1])
  # A conversation's read column in its padded row (from 0) is the same within its segment.
  column = packed.start + score_positions(tokens, model.config.pad_token_id).reshape(packed.start.shape)

  def read(group_hidden, row, column):
    return group_hidden[row, jnp.clip(column, 0, length - 1)]
  last = packing.on_groups(jax.vmap(read), hidden, packed.row, column)
  return model.score_head(last.reshape(count, last.shape[-1]))[:, 0]


def micro_batch_lengths(lengths: np.ndarray, micro_batches: int) -> np.ndarray:
  """Pair lengths [K, B, 2] (each pair's chosen and rejected conversation's tokens; 0 for a
  padding pair) of K batches -> [K * micro_batches, S]: each micro-batch's conversations in the
  order the update packs them (the micro-batch's chosen sides, then its rejected sides)."""
  steps, pairs, _ = lengths.shape
  split = lengths.reshape(steps * micro_batches, pairs // micro_batches, 2)
  return np.swapaxes(split, 1, 2).reshape(steps * micro_batches, -1)


def rows_used(lengths: np.ndarray, groups: int, row_length: int) -> np.ndarray:
  """Conversation lengths [K, S] of K micro-batches -> the packed rows [K, n] each of the `groups`
  batch groups fills, placed as the update places them (rl/packing.py first_fit_decreasing)."""
  count, conversations = lengths.shape
  per_group = conversations // groups
  by_group = np.asarray(lengths, np.int32).reshape(count * groups, per_group)

  @jax.jit
  def used(chunk):
    row = jax.vmap(lambda one: packing.first_fit_decreasing(one, per_group, row_length)[0])(chunk)
    return jnp.max(jnp.where(chunk > 0, row + 1, 0), axis=1)
  filled = []
  for start in range(0, by_group.shape[0], CHUNK):
    chunk = by_group[start:start + CHUNK]
    padded = np.zeros((CHUNK, per_group), np.int32)
    padded[:len(chunk)] = chunk
    filled.append(np.asarray(used(padded))[:len(chunk)])
  return np.concatenate(filled).reshape(count, groups)


def padding_fractions(lengths: np.ndarray, rows: np.ndarray, layout: PackedLayout, width: int) -> dict:
  """Per batch (lengths [K, B, 2], rows [K, micro-batches, n] from `rows_used`): the padding of
  the padded rows (2B of W tokens), of the packed rows the update computes (R of L per group and
  micro-batch) and the packed rows in use."""
  real = lengths.reshape(lengths.shape[0], -1).sum(axis=1)
  pairs = lengths.shape[1]
  computed = rows[0].size * layout.rows * layout.row_length
  return dict(padding_frac=1.0 - real / (2 * pairs * width), packed_padding_frac=1.0 - real / computed,
              packed_rows=rows.reshape(rows.shape[0], -1).sum(axis=1).astype(np.float64))
