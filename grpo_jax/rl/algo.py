"""The GRPO family as pure functions: advantages, KL estimators, clipped surrogates, aggregation.

Shapes: rewards [P, G] (P prompts, G samples each); per-token arrays [B, N] over B = P*G
completion rows of N tokens with a 0/1 `mask` (1 on completion tokens). Every function is
jittable and holds no state; the update step (rl/step.py) chooses among them by name.

References for the symbols used in the docstrings and in `AlgoConfig`:
  GRPO      Shao et al. 2024, DeepSeekMath (group-normalised advantage, k3 KL, beta)
  DAPO      Yu et al. 2025 (clip-higher eps_low / eps_high, token-level aggregation)
  Dr.GRPO   Liu et al. 2025, Understanding R1-Zero-like training (no std, no length normalisation)
  RLOO      Ahmadian et al. 2024 (leave-one-out baseline)
  GSPO      Zheng et al. 2025 (sequence-level importance ratio)
  dual clip Ye et al. 2020 (lower bound c*A on the surrogate for A < 0)
  TIS       Yao et al. 2025, Your efficient RL framework secretly brings you off-policy RL training
  KL k1/k2/k3  Schulman 2020, Approximating KL divergence
"""

import typing
from typing import Callable, Literal

import jax
import jax.numpy as jnp

# The names the config accepts (AlgoConfig imports these types); each registry below holds
# exactly one function per name, checked at the end of this module.
Advantage = Literal['grpo', 'drgrpo', 'rloo']  # (r - mean_G)/(std_G + eps) | r - mean_G | leave-one-out
KLEstimator = Literal['k1', 'k2', 'k3']
LossAggregation = Literal['token-mean', 'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm']

# ---- advantages: rewards [P, G] -> advantages [P, G] ----

ADVANTAGES: dict[str, Callable] = {}


def _register(table: dict, name: str):
  def add(function):
    table[name] = function
    return function
  return add


def _centred(rewards: jax.Array) -> jax.Array:
  """r - mean_G r, exactly 0 for a group of equal rewards.

  Rewards are first shifted by the group's first reward, so an all-equal group becomes exact
  zeros; subtracting a rounded fp32 mean from r directly leaves a few ulps, which GRPO's division
  by a std just as tiny would blow up into a random advantage.
  """
  shifted = rewards.astype(jnp.float32) - rewards[..., :1].astype(jnp.float32)
  return shifted - shifted.mean(axis=-1, keepdims=True)


@_register(ADVANTAGES, 'grpo')
def grpo_advantages(rewards: jax.Array, epsilon: float = 1e-6) -> jax.Array:
  """A_i = (r_i - mean_G r) / (std_G r + eps), std with Bessel's correction (G - 1), as verl/TRL."""
  centred = _centred(rewards)
  std = jnp.sqrt(jnp.sum(jnp.square(centred), axis=-1, keepdims=True) / (rewards.shape[-1] - 1))
  return centred / (std + epsilon)


@_register(ADVANTAGES, 'drgrpo')
def drgrpo_advantages(rewards: jax.Array, epsilon: float = 1e-6) -> jax.Array:
  """A_i = r_i - mean_G r (Dr.GRPO: no division by the group's std)."""
  del epsilon
  return _centred(rewards)


@_register(ADVANTAGES, 'rloo')
def rloo_advantages(rewards: jax.Array, epsilon: float = 1e-6) -> jax.Array:
  """A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_G r)."""
  del epsilon
  group = rewards.shape[-1]
  return _centred(rewards) * group / (group - 1)


# ---- KL to the reference policy, per token: log_ratio = log pi(y) - log pi_ref(y) ----

KL_ESTIMATORS: dict[str, Callable] = {}


@_register(KL_ESTIMATORS, 'k1')
def kl_k1(log_ratio: jax.Array) -> jax.Array:
  """log(pi / pi_ref): unbiased, high variance, can be negative."""
  return log_ratio


@_register(KL_ESTIMATORS, 'k2')
def kl_k2(log_ratio: jax.Array) -> jax.Array:
  """(log(pi / pi_ref))^2 / 2: low variance, biased."""
  return 0.5 * jnp.square(log_ratio)


@_register(KL_ESTIMATORS, 'k3')
def kl_k3(log_ratio: jax.Array) -> jax.Array:
  """pi_ref / pi - 1 - log(pi_ref / pi): unbiased, non-negative (GRPO's choice)."""
  return jnp.expm1(-log_ratio) + log_ratio


# ---- importance ratios ----

def token_log_ratio(log_probs: jax.Array, old_log_probs: jax.Array) -> jax.Array:
  """log r_t = log pi(y_t) - log pi_old(y_t), [B, N]."""
  return log_probs - old_log_probs


def sequence_log_ratio(log_probs: jax.Array, old_log_probs: jax.Array, mask: jax.Array) -> jax.Array:
  """GSPO per-token log-ratio: log s_i = mean_t log r_t over the row's tokens, broadcast to [B, N].

  Written as sg(log s_i) + log pi(y_t) - sg(log pi(y_t)) so that its value is log s_i for every
  token while its gradient is that of GSPO-token: s_i * grad log pi(y_t) / |y_i| after aggregation.
  """
  mask = mask.astype(jnp.float32)
  lengths = jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0)
  log_s = ((log_probs - old_log_probs) * mask).sum(axis=-1, keepdims=True) / lengths
  # Parenthesised so the value is exactly log s_i (lp - sg(lp) is exactly 0, adding then
  # subtracting lp would round log s_i to the ulp of lp).
  return jax.lax.stop_gradient(log_s) + (log_probs - jax.lax.stop_gradient(log_probs))


def clipped_surrogate(log_ratio: jax.Array, advantages: jax.Array, *, epsilon_low: float,
                      epsilon_high: float, dual_clip: float = 0.0) -> dict[str, jax.Array]:
  """Per-token PPO loss -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), [B, N].

  advantages [B, N] (or [B, 1]). With dual_clip = c > 1 the loss of tokens with A < 0 is capped
  at -c A (the surrogate is bounded below by c A). Also returns where clipping bound:
  clipped_low (r < 1 - eps_low with A < 0) and clipped_high (r > 1 + eps_high with A > 0).
  """
  ratio = jnp.exp(log_ratio)
  clipped_ratio = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
  loss = jnp.maximum(-ratio * advantages, -clipped_ratio * advantages)
  if dual_clip > 0:
    loss = jnp.where(advantages < 0, jnp.minimum(loss, -dual_clip * advantages), loss)
  return dict(loss=loss, ratio=ratio,
              clipped_low=(ratio < 1.0 - epsilon_low) & (advantages < 0),
              clipped_high=(ratio > 1.0 + epsilon_high) & (advantages > 0))


def truncated_importance_weight(old_log_probs: jax.Array, sampler_log_probs: jax.Array,
                                cap: float) -> jax.Array:
  """TIS: min(pi_old(y) / pi_sampler(y), C), no gradient: corrects for the sampler's numerics
  (e.g. bf16 decoding) differing from the trainer's forward. [B, N]."""
  weight = jnp.exp(old_log_probs - sampler_log_probs)
  return jax.lax.stop_gradient(jnp.minimum(weight, cap))


# ---- aggregation: per-token loss [B, N] -> scalar, as weights summing the loss ----

AGGREGATIONS = typing.get_args(LossAggregation)


def aggregation_weights(mask: jax.Array, mode: str, max_tokens: int | None = None) -> jax.Array:
  """w [B, N] with loss = sum(w * token_loss), so a batch split into micro-batches sums exactly.

  token-mean:               sum_{b,t} L m / sum_{b,t} m            (DAPO)
  seq-mean-token-mean:      mean_b (sum_t L m / sum_t m)           (GRPO paper)
  seq-mean-token-sum:       mean_b sum_t L m
  seq-mean-token-sum-norm:  sum_{b,t} L m / (B * N_max)            (Dr.GRPO, N_max = max_tokens)
  """
  mask = mask.astype(jnp.float32)
  rows = mask.shape[0]
  if mode == 'token-mean':
    return mask / jnp.maximum(mask.sum(), 1.0)
  if mode == 'seq-mean-token-mean':
    return mask / jnp.maximum(mask.sum(axis=-1, keepdims=True), 1.0) / rows
  if mode == 'seq-mean-token-sum':
    return mask / rows
  if mode == 'seq-mean-token-sum-norm':
    return mask / (rows * (max_tokens or mask.shape[-1]))
  raise ValueError(f'unknown loss aggregation {mode!r}; choose one of {", ".join(AGGREGATIONS)}')


def aggregate(token_loss: jax.Array, mask: jax.Array, mode: str, max_tokens: int | None = None) -> jax.Array:
  return jnp.sum(token_loss * aggregation_weights(mask, mode, max_tokens))


assert tuple(ADVANTAGES) == typing.get_args(Advantage) and tuple(KL_ESTIMATORS) == typing.get_args(KLEstimator)
