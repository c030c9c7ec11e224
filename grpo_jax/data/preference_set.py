"""The preference pairs of a reward-model run (`python -m grpo_jax.train_reward`): its `preferences`
and `eval` config sections, and the pairs as token rows in the order the run trains on them.

The training pairs are read from `preferences.source` (data/sources.py: JSONL, JSON, parquet, the
Hugging Face cache) in `preferences.format` (data/preferences.py), rendered with the reward model's
chat template, and held as fixed-width token rows. The held-out pairs come from `eval.source`, or
are `eval.held_out` of the training source's pairs (chosen by run.seed, never trained on).

Order: each epoch visits every training pair once, in a permutation drawn from (run.seed, epoch);
step s of the run trains on batch s mod E of epoch s div E (E batches an epoch), so the pairs of a
step depend on the seed and the step alone and a resumed run trains on what the uninterrupted one
would. Every batch holds `preferences.pairs_per_batch` pairs: the last of an epoch is filled with
padding pairs of weight 0 (the loss and the gradient leave them out) rather than compiled again
at another size.
"""

import dataclasses
import math
import os

import numpy as np

from grpo_jax.data.preferences import PreferenceFormat, adapt_preferences, encode_pairs
from grpo_jax.data.sources import load_records
from grpo_jax.errors import UserError, require
from grpo_jax.sections import section

# Rows are cut to the longest conversation of the data rounded up to this (at most max_length): one
# width for the whole run, and no compute spent on padding that no pair needs.
WIDTH_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class PreferencesConfig:
  """The `preferences` section: the pairs a reward model trains on, and the Bradley-Terry loss."""

  source: str | None = None  # .jsonl/.json/.parquet file or hf:<name>[:<config>] of preference records
  split: str = 'train'  # the split of a .json {split: [...]} file or a hub dataset
  format: PreferenceFormat = 'messages'  # hh_rlhf (transcripts) | messages (chat messages; data/preferences.py)
  margin_field: str | None = None  # the records' field holding each pair's margin (m in the loss); None: no margin
  tokenizer: str | None = None  # tokenizer directory where model.path holds none (a random model); None: model.path's
  max_length: int = 512  # tokens of a conversation; a pair with a longer side is left out (counted), not cut
  pairs_per_batch: int = 16  # B: pairs of one optimizer update
  micro_batches: int = 1  # the batch's gradient accumulated over this many micro-batches of B / micro_batches
  center_coef: float = 0.0  # c: weight of the centering term c * mean (r_chosen + r_rejected)^2
  packing: bool = False  # each micro-batch's conversations packed first-fit into rows of packed_length (docs/math-and-rewards.md)
  packed_length: int = 0  # L: tokens of a packed row, >= max_length; 0: max_length

  def __post_init__(self):
    with section('preferences'):
      require(self.max_length >= 2, 'max_length', f'must be >= 2, got {self.max_length}')
      require(self.pairs_per_batch >= 1, 'pairs_per_batch', f'must be >= 1, got {self.pairs_per_batch}')
      require(self.micro_batches >= 1 and self.pairs_per_batch % self.micro_batches == 0, 'micro_batches',
              f'({self.micro_batches}) must divide pairs_per_batch ({self.pairs_per_batch})')
      require(self.center_coef >= 0, 'center_coef', f'must be >= 0, got {self.center_coef}')
      require(self.packed_length == 0 or self.packed_length >= self.max_length, 'packed_length',
              f'({self.packed_length}) must be 0 (max_length) or hold a conversation of max_length '
              f'({self.max_length}) tokens')

  @property
  def row_length(self) -> int:
    """L: tokens of a packed row."""
    return self.packed_length or self.max_length


@dataclasses.dataclass(frozen=True)
class PreferenceEvalConfig:
  """The `eval` section of a reward-model run: held-out pairwise accuracy and loss."""

  every: int = 0  # steps between evaluations (also before the first step and after the last); 0: after the last only
  source: str | None = None  # held-out preference records (read like preferences.source); None: `held_out`
  split: str = 'test'  # the split of eval.source
  held_out: float = 0.1  # without eval.source: the share of the training pairs held out (seeded by run.seed)

  def __post_init__(self):
    with section('eval'):
      require(self.every >= 0, 'every', f'must be >= 0, got {self.every}')
      require(0 < self.held_out < 1, 'held_out', f'must be in (0, 1), got {self.held_out}')


@dataclasses.dataclass(frozen=True)
class Rows:
  """Encoded pairs: chosen / rejected tokens and masks [M, W] int32, margin [M] fp32 or None."""

  chosen: np.ndarray
  chosen_mask: np.ndarray
  rejected: np.ndarray
  rejected_mask: np.ndarray
  margin: np.ndarray | None

  def __len__(self) -> int:
    return self.chosen.shape[0]

  @property
  def lengths(self) -> np.ndarray:
    """[M, 2] int64: each pair's chosen and rejected conversation's tokens."""
    return np.stack([self.chosen_mask.sum(axis=1), self.rejected_mask.sum(axis=1)], axis=1).astype(np.int64)

  def take(self, indices: np.ndarray, real: int) -> dict:
    """The pairs at `indices` as the fields of a batch (rl/preference.py PreferenceBatch), the first
    `real` of them weighted 1 and the rest (padding) 0."""
    weights = (np.arange(len(indices)) < real).astype(np.float32)
    return dict(chosen=self.chosen[indices], chosen_mask=self.chosen_mask[indices], rejected=self.rejected[indices],
                rejected_mask=self.rejected_mask[indices], weights=weights,
                margin=None if self.margin is None else self.margin[indices])


def _records(source: str, split: str, key: str) -> list[dict]:
  if not source.startswith(('hf:', 'tfds:')) and not os.path.isfile(source):
    raise UserError(f'{key} {source} not found')
  return load_records(source, split)


class PreferenceSet:
  """The run's training and held-out pairs as token rows (see the module docstring); `report`:
  what was read, skipped and left out, for the run's log."""

  def __init__(self, preferences: PreferencesConfig, evaluation: PreferenceEvalConfig, tokenizer, pad_id: int,
               seed: int):
    require(preferences.source is not None, 'preferences.source', 'is not set: name the preference records to train on')
    self.batch_size, self.seed = preferences.pairs_per_batch, seed
    self._orders: dict[int, np.ndarray] = {}  # epoch -> its order (epoch_order)
    train = adapt_preferences(_records(preferences.source, preferences.split, 'preferences.source'),
                              preferences.format, preferences.source, preferences.margin_field)
    pairs, held = train.pairs, []
    if evaluation.source is not None:
      held = adapt_preferences(_records(evaluation.source, evaluation.split, 'eval.source'), preferences.format,
                               evaluation.source, preferences.margin_field).pairs
    else:
      order = np.random.default_rng([seed, 1]).permutation(len(pairs))
      count = max(1, round(evaluation.held_out * len(pairs)))
      require(count < len(pairs), 'eval.held_out', f'({evaluation.held_out}) leaves none of the '
              f'{len(pairs)} pairs of {preferences.source} to train on')
      held, pairs = [pairs[i] for i in sorted(order[:count])], [pairs[i] for i in sorted(order[count:])]
    encoded = [encode_pairs(tokenizer, group, preferences.max_length, pad_id) for group in (pairs, held)]
    for group, what, key in ((encoded[0], preferences.source, 'preferences.source'),
                             (encoded[1], evaluation.source or 'the held-out pairs', 'eval.source')):
      require(len(group.kept) > 0, key, f'{what}: every pair has a side longer than preferences.max_length '
              f'({preferences.max_length} tokens)')
    longest = max(int(mask.sum(axis=1).max()) for group in encoded for mask in (group.chosen_mask, group.rejected_mask))
    width = min(preferences.max_length, WIDTH_MULTIPLE * math.ceil(longest / WIDTH_MULTIPLE))
    self.train, self.held_out = (self._rows(group, source, width) for group, source in zip(encoded, (pairs, held)))
    self.width = width
    self.report = dict(train_pairs=len(self.train), held_out_pairs=len(self.held_out), width=width,
                       too_long=encoded[0].too_long + encoded[1].too_long, skipped=train.skipped)

  @staticmethod
  def _rows(encoded, pairs, width: int) -> Rows:
    margins = [pairs[i].margin for i in encoded.kept]
    margin = None if not margins or margins[0] is None else np.asarray(margins, np.float32)
    return Rows(chosen=encoded.chosen[:, :width], chosen_mask=encoded.chosen_mask[:, :width],
                rejected=encoded.rejected[:, :width], rejected_mask=encoded.rejected_mask[:, :width], margin=margin)

  @property
  def batches_per_epoch(self) -> int:
    return math.ceil(len(self.train) / self.batch_size)

  def epoch_order(self, epoch: int) -> np.ndarray:
    """The training pairs' order in `epoch`: a permutation drawn from (run.seed, epoch), drawn once
    (every step of the epoch reads it; the last two epochs' are kept)."""
    if epoch not in self._orders:
      if len(self._orders) >= 2:
        self._orders.pop(min(self._orders))
      self._orders[epoch] = np.random.default_rng([self.seed, 2, epoch]).permutation(len(self.train))
    return self._orders[epoch]

  def position(self, step: int) -> dict:
    """Where in the data step `step` (0-based) trains: its epoch and its batch in the epoch."""
    return dict(epoch=step // self.batches_per_epoch, batch=step % self.batches_per_epoch)

  def batch(self, step: int) -> dict:
    """The pairs of step `step` (0-based): batch b of epoch e's order, padded to B pairs."""
    where = self.position(step)
    order = self.epoch_order(where['epoch'])[where['batch'] * self.batch_size:(where['batch'] + 1) * self.batch_size]
    return self.train.take(_padded(order, self.batch_size), len(order))

  def pair_lengths(self, steps: int) -> np.ndarray:
    """[steps, B, 2]: the tokens of each conversation that steps 0 .. steps - 1 train on, as
    `batch` lays them out (0 for a padding pair): what packing them takes, known before the run."""
    per_epoch = self.batches_per_epoch * self.batch_size
    epochs = []
    for epoch in range(-(-steps // self.batches_per_epoch)):
      order = self.epoch_order(epoch)
      real = (np.arange(per_epoch) < len(order))[:, None]
      epochs.append(self.train.lengths[_padded(order, per_epoch)] * real)
    return np.concatenate(epochs)[:steps * self.batch_size].reshape(steps, self.batch_size, 2)

  def held_out_lengths(self) -> np.ndarray:
    """[K, B, 2]: the conversations' tokens of the K held-out batches (0 for a padding pair)."""
    batches = math.ceil(len(self.held_out) / self.batch_size)
    lengths = np.zeros((batches * self.batch_size, 2), np.int64)
    lengths[:len(self.held_out)] = self.held_out.lengths
    return lengths.reshape(batches, self.batch_size, 2)

  def held_out_batches(self):
    """The held-out pairs in order, in batches of B (the last padded)."""
    for start in range(0, len(self.held_out), self.batch_size):
      indices = np.arange(start, min(start + self.batch_size, len(self.held_out)))
      yield self.held_out.take(_padded(indices, self.batch_size), len(indices))


def _padded(indices: np.ndarray, size: int) -> np.ndarray:
  """`indices` filled up to `size` with the first one (a padding pair, weighted 0)."""
  return np.concatenate([indices, np.full(size - len(indices), indices[0], indices.dtype)])
