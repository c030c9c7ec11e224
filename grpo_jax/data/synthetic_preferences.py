"""Preference pairs with a known truth, for showing that reward-model training works: each
completion has a hidden property (its share of tokens from a chosen set), and which completion of
a pair is preferred is drawn by Bradley-Terry from the property,

    P(a preferred over b) = sigmoid(beta * (property(a) - property(b))),

so the labels are noisy (beta sets how noisy) and the best any reward model can do is to order
completions by the property. A reward model's held-out accuracy against the *property's* order
(not the noisy labels) says how much of the truth it learned; the policy's mean property says how
far RL against that reward model moved it (the proxy / gold picture).

Every function takes its randomness from a NumPy generator; arrays are token rows [R, N] int32 with
their 0/1 masks.
"""

import numpy as np


def token_share(tokens: np.ndarray, mask: np.ndarray, chosen: np.ndarray) -> np.ndarray:
  """[R] each row's share of its real tokens that are in `chosen` (an array of token ids); 0 for a
  row with none."""
  real = np.asarray(mask) == 1
  hits = np.isin(np.asarray(tokens), np.asarray(chosen)) & real
  return hits.sum(axis=1) / np.maximum(real.sum(axis=1), 1)


def bradley_terry_labels(rng: np.random.Generator, first: np.ndarray, second: np.ndarray,
                         beta: float) -> np.ndarray:
  """[R] bool: whether the first of each pair is preferred, drawn with probability
  sigmoid(beta * (first - second)) from the pairs' properties."""
  gap = beta * (np.asarray(first, np.float64) - np.asarray(second, np.float64))
  return rng.uniform(size=gap.shape) < 1.0 / (1.0 + np.exp(-gap))


def random_rows(rng: np.random.Generator, count: int, width: int, vocab: tuple[int, int],
                min_length: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, mask) [count, width]: rows of uniform ids in [vocab[0], vocab[1]), of lengths uniform
  in [min_length, width], right-padded with 0 (what a random-init policy's completions look like)."""
  lengths = rng.integers(min_length, width + 1, count)
  mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, rng.integers(vocab[0], vocab[1], (count, width)), 0).astype(np.int32)
  return tokens, mask


def preference_pairs(rng: np.random.Generator, first: tuple[np.ndarray, np.ndarray],
                     second: tuple[np.ndarray, np.ndarray], chosen_ids: np.ndarray, beta: float) -> dict:
  """Pairs of rows (first[i], second[i]) labelled by Bradley-Terry from their token share: {chosen,
  chosen_mask, rejected, rejected_mask} [R, N] and `truth` [R] bool, whether the chosen row's
  property is the higher one (what a held-out accuracy against the truth counts; ties count as
  not)."""
  share = [token_share(*rows, chosen_ids) for rows in (first, second)]
  first_wins = bradley_terry_labels(rng, share[0], share[1], beta)
  pick = lambda a, b: np.where(first_wins[:, None], a, b)  # noqa: E731
  chosen, chosen_mask = pick(first[0], second[0]), pick(first[1], second[1])
  rejected, rejected_mask = pick(second[0], first[0]), pick(second[1], first[1])
  truth = np.where(first_wins, share[0] > share[1], share[1] > share[0])
  return dict(chosen=chosen.astype(np.int32), chosen_mask=chosen_mask.astype(np.int32),
              rejected=rejected.astype(np.int32), rejected_mask=rejected_mask.astype(np.int32), truth=truth)
