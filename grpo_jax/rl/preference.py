"""Reward-model learning from preference pairs, as pure functions: the Bradley-Terry loss and the
pairwise accuracy over a batch of B pairs' scores.

Bradley-Terry (Bradley & Terry 1952; the reward-model loss of Ouyang et al. 2022): the chosen reply
of a pair beats the rejected one with probability sigmoid(r_chosen - r_rejected), and the model
minimises the pairs' mean negative log-likelihood

    loss = mean_b -log sigmoid(r_chosen_b - r_rejected_b - m_b) + c * mean_b (r_chosen_b + r_rejected_b)^2

m_b: an optional per-pair margin (how much better the chosen reply was rated, e.g. Llama 2's rating
gap): the chosen score must clear the rejected one by it before the pair stops pulling. c: the
optional centering coefficient (Eisenstein et al. 2023, "Helping or herding"): the Bradley-Terry
likelihood sees only differences, so a score's offset drifts freely; the term holds the pair's
mean near 0, which a reward composed with other terms (data/reward_terms.py) needs. Every function
is jittable; scores are [B] fp32.
"""

import jax
import jax.numpy as jnp


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array, margin: jax.Array | None = None,
                       center_coef: float = 0.0, weights: jax.Array | None = None) -> jax.Array:
  """The mean Bradley-Terry loss of B pairs' scores chosen [B], rejected [B] (see the module
  docstring); weights [B]: 1 on real pairs, 0 on the padding of a fixed-size batch (the mean is
  over real pairs)."""
  chosen, rejected = chosen.astype(jnp.float32), rejected.astype(jnp.float32)
  weights = jnp.ones_like(chosen) if weights is None else weights.astype(jnp.float32)
  gap = chosen - rejected - (0.0 if margin is None else margin.astype(jnp.float32))
  per_pair = -jax.nn.log_sigmoid(gap)
  if center_coef:
    per_pair = per_pair + center_coef * jnp.square(chosen + rejected)
  return jnp.sum(per_pair * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def pairwise_accuracy(chosen: jax.Array, rejected: jax.Array, weights: jax.Array | None = None) -> jax.Array:
  """The fraction of real pairs whose chosen reply scores strictly higher (a tie counts as wrong)."""
  weights = jnp.ones_like(chosen, jnp.float32) if weights is None else weights.astype(jnp.float32)
  return jnp.sum((chosen > rejected) * weights) / jnp.maximum(jnp.sum(weights), 1.0)
