"""Token selection against a NumPy reference: chi-square on many draws, truncation, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.sampler import SamplingConfig, select
from grpo_jax.sampler.sampling import block_log_masses, draw

DRAWS = 40_000
# Upper 1e-4 tail of chi-square with df degrees of freedom (Wilson-Hilferty, z = 3.719): a correct
# sampler fails one run in 10,000.
def chi_square_critical(df: int, z: float = 3.719) -> float:
  return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """NumPy: softmax(logits / T), restricted to top-k then top-p, renormalised."""
  scaled = logits.astype(np.float64) / temperature
  probs = np.exp(scaled - scaled.max())
  probs /= probs.sum()
  keep = np.ones_like(probs, bool)
  if top_k:
    keep &= scaled >= np.sort(scaled)[::-1][top_k - 1]
  if top_p < 1:
    renormalised = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    order = np.argsort(-renormalised, kind='stable')
    ahead = np.cumsum(renormalised[order]) - renormalised[order]
    nucleus = np.zeros_like(keep)
    nucleus[order[ahead < top_p]] = True
    keep &= nucleus
  out = np.where(keep, probs, 0)
  return out / out.sum()


@pytest.mark.parametrize('temperature, top_k, top_p', [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 0, 0.8), (0.9, 8, 0.7),
])
def test_frequencies_match_reference(seed, temperature, top_k, top_p):
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 1.5, 24).astype(np.float32)
  expected = reference_distribution(logits, temperature, top_k, top_p)
  config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  tokens, log_probs = jax.jit(lambda l, k: select(l, k, config))(
      jnp.broadcast_to(logits, (DRAWS, 24)), jax.random.key(seed))
  counts = np.bincount(np.asarray(tokens), minlength=24)
  assert counts[expected == 0].sum() == 0, 'drew a token outside the top-k / top-p set'
  support = expected > 0
  if support.sum() > 1:  # with one token left, the check above is the whole test
    statistic = ((counts[support] - DRAWS * expected[support]) ** 2 / (DRAWS * expected[support])).sum()
    assert statistic < chi_square_critical(support.sum() - 1), (statistic, counts, expected * DRAWS)
  # Reported log-probs are log softmax(logits / T) of the drawn token, before truncation.
  scaled = logits.astype(np.float64) / temperature
  full = scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())
  np.testing.assert_allclose(np.asarray(log_probs), full[np.asarray(tokens)], rtol=0, atol=1e-5)


def test_greedy_and_seeds(seed):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(0, 1, (16, 300)).astype(np.float32))
  tokens, log_probs = select(logits, jax.random.key(0), SamplingConfig(greedy=True))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(logits).argmax(-1))
  np.testing.assert_allclose(np.asarray(log_probs), np.asarray(jax.nn.log_softmax(logits)).max(-1), atol=1e-6)

  config = SamplingConfig(temperature=1.2, top_p=0.9)
  first = select(logits, jax.random.key(seed), config)[0]
  again = select(logits, jax.random.key(seed), config)[0]
  other = select(logits, jax.random.key(seed + 1), config)[0]
  np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
  assert not np.array_equal(np.asarray(first), np.asarray(other))


def test_top_k_keeps_ties_and_top_p_keeps_the_best_token():
  logits = jnp.array([[3.0, 1.0, 3.0, 0.5, 2.0]])
  config = SamplingConfig(top_k=1)
  drawn = set(np.asarray(select(jnp.repeat(logits, 2000, 0), jax.random.key(1), config)[0]).tolist())
  assert drawn == {0, 2}
  config = SamplingConfig(top_p=1e-6)
  drawn = set(np.asarray(select(jnp.repeat(logits * 4, 500, 0), jax.random.key(2), config)[0]).tolist())
  assert drawn <= {0, 2} and len(drawn) >= 1


@pytest.mark.parametrize('fields', [dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_settings(fields):
  with pytest.raises(ValueError):
    SamplingConfig(**fields)


def test_draw_matches_reference_over_many_blocks(seed):
  """V = 150 splits into 12 blocks of 13 (the last padded): the block stage and the within-block
  stage together must give softmax(logits)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 1, 150).astype(np.float32)
  expected = reference_distribution(logits, 1.0, 0, 1.0)
  tokens = jax.jit(draw)(jax.random.key(seed), jnp.broadcast_to(logits, (DRAWS, 150)))
  counts = np.bincount(np.asarray(tokens), minlength=150)
  assert counts.size == 150, 'drew a padding slot'
  # Tokens expected fewer than 5 times share one bin, so the chi-square approximation holds.
  small = DRAWS * expected < 5
  observed = np.append(counts[~small], counts[small].sum())
  predicted = DRAWS * np.append(expected[~small], expected[small].sum())
  observed, predicted = observed[predicted > 0], predicted[predicted > 0]
  statistic = ((observed - predicted) ** 2 / predicted).sum()
  assert statistic < chi_square_critical(observed.size - 1), statistic


def test_block_log_masses_keep_precision_far_below_the_best_token():
  """A block 200 nats below the best token keeps its relative mass (a row-wide shift would
  underflow it to 0), and a block of excluded tokens gets -inf."""
  scaled = np.full((1, 16), -np.inf, np.float32)
  scaled[0, :4] = [0.0, -1.0, -2.0, -3.0]
  scaled[0, 4:8] = [-200.0, -200.5, -201.0, -203.0]
  scaled[0, 8:11] = [-50.0, -49.0, -48.0]
  grouped, masses = block_log_masses(jnp.asarray(scaled), 4)
  assert grouped.shape == (1, 4, 4)
  expected = [np.logaddexp.reduce(scaled[0, i:i + 4].astype(np.float64)) for i in range(0, 12, 4)]
  np.testing.assert_allclose(np.asarray(masses[0, :3]), expected, rtol=1e-6)
  assert np.asarray(masses[0, 3]) == -np.inf
