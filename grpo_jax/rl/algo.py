"""The GRPO family as pure functions: advantages, KL estimators, clipped surrogates, aggregation.

Shapes: rewards [P, G] (P prompts, G samples each); per-token arrays [B, N] over B = P*G
completion rows of N tokens with a 0/1 `mask` (1 on completion tokens). Every function is
jittable and holds no state; the loss (rl/loss.py) chooses among them by name, as the run's
`algo` config section (`AlgoConfig`, at the end of this module) names them.

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

import dataclasses
import typing
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from grpo_jax.errors import require
from grpo_jax.ops import LogprobImplementation
from grpo_jax.sections import section

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


# ---- on-policy distillation: a teacher's per-token log-probs on the student's own samples ----

def discounted_sums(values: jax.Array, mask: jax.Array, discount: float) -> jax.Array:
  """sum_{k >= t} discount^(k - t) values_k over each row's `mask`ed tokens [B, N] (0 elsewhere);
  discount 0 gives the values themselves."""
  values = jnp.where(mask, values, 0.0)
  if discount == 0:
    return values

  def back(following, column):
    value, real = column
    total = value + discount * following
    return jnp.where(real, total, following), jnp.where(real, total, 0.0)

  _, sums = jax.lax.scan(back, jnp.zeros(values.shape[:1], values.dtype), (values.T, mask.T), reverse=True)
  return sums.T


def position_baseline(values: jax.Array, mask: jax.Array, group_size: int) -> jax.Array:
  """b [B, N]: at each position t, the mean of `values` [B, N] over the other rows of the row's
  group (G consecutive rows) that have a token there (leave-one-out), 0 where none has. It depends
  on the other samples only, so subtracting it leaves the policy gradient's expectation unchanged."""
  rows, length = values.shape
  grouped = jnp.where(mask, values, 0.0).reshape(-1, group_size, length)
  present = mask.astype(jnp.float32).reshape(-1, group_size, length)
  others = present.sum(axis=1, keepdims=True) - present
  total = grouped.sum(axis=1, keepdims=True) - grouped
  return jnp.where(others > 0, total / jnp.maximum(others, 1.0), 0.0).reshape(rows, length)


def distilled_advantages(advantages: jax.Array, sampler_log_probs: jax.Array, teacher_log_probs: jax.Array,
                         mask: jax.Array, *, weight: float, scale: float, discount: float = 0.0,
                         group_size: int = 0) -> jax.Array:
  """A_t = (1 - w) A_group + w s (D_t - b_t), [B, N]: the group advantage [B] of each row mixed with
  the per-token distillation advantage D_t = -(log pi_sampler(y_t) - log pi_teacher(y_t)), the
  negative reverse KL's per-token sample on the student's own tokens (summed over the row's later
  tokens with `discount` > 0), less b_t, its leave-one-out mean over the group's other rows at the
  same position (`position_baseline`; group_size 0: no baseline). No gradient flows through it: the
  sampler's log-probs are data."""
  negative_kl = jax.lax.stop_gradient(teacher_log_probs - sampler_log_probs)
  per_token = discounted_sums(negative_kl, mask, discount)
  if group_size:
    per_token = jnp.where(mask, per_token - position_baseline(per_token, mask, group_size), 0.0)
  return (1.0 - weight) * advantages[:, None] + weight * scale * per_token


def distillation_metrics(sampler_log_probs: jax.Array, teacher_log_probs: jax.Array, mask: jax.Array) -> dict:
  """Token means over the `mask`ed tokens: distill_reverse_kl, the sampled tokens' mean of
  log pi_sampler - log pi_teacher (an estimate of KL(pi_student || pi_teacher) per token), and
  distill_teacher_confident_frac, the share of them the teacher gives a higher probability."""
  weights = aggregation_weights(mask, 'token-mean')
  gap = sampler_log_probs - teacher_log_probs
  return dict(distill_reverse_kl=jnp.sum(gap * weights),
              distill_teacher_confident_frac=jnp.sum((gap < 0) * weights))


assert tuple(ADVANTAGES) == typing.get_args(Advantage) and tuple(KL_ESTIMATORS) == typing.get_args(KLEstimator)


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
  """The `algo` config section: the GRPO family above, and how the update batches it. Symbols
  follow the papers cited at the top of this module."""

  group_size: int = 8  # G: completions per prompt
  advantage: Advantage = 'grpo'  # (r - mean_G)/(std_G + eps) | r - mean_G | leave-one-out
  advantage_epsilon: float = 1e-6  # >= 0: eps in the GRPO advantage denominator
  epsilon_low: float = 0.2  # eps_low: ratio clipped below at 1 - eps_low
  epsilon_high: float = 0.2  # eps_high: ratio clipped above at 1 + eps_high (DAPO clip-higher: 0.28)
  dual_clip: float = 0.0  # c > 1 bounds the surrogate below by c * A for A < 0; 0 disables
  importance_ratio: Literal['token', 'sequence'] = 'token'  # 'sequence' is GSPO's s_i (use eps ~ 3e-4)
  kl_beta: float = 0.0  # beta: weight of KL(pi || pi_ref); 0 keeps no reference parameters
  kl_estimator: KLEstimator = 'k3'  # per-token KL estimator (Schulman 2020)
  entropy_coef: float = 0.0  # >= 0: weight of the entropy bonus (subtracted from the loss)
  loss_aggregation: LossAggregation = 'token-mean'  # see algo.aggregation_weights
  ppo_epochs: int = 1  # mu: passes over each batch; > 1 uses pi_old log-probs and clipping
  num_minibatches: int = 1  # optimizer steps per pass; P * G must divide evenly
  # How each pass deals the rows into mini-batches: 'rows' shuffled one by one, or whole 'groups'
  # (a prompt's G rows in one mini-batch, P divided evenly): a trained vision tower then runs once
  # per prompt per pass instead of on every prompt in every mini-batch.
  shuffle: Literal['rows', 'groups'] = 'rows'
  micro_batch_size: int = 0  # rows per gradient-accumulation micro-batch; 0: the whole mini-batch
  # Packing (rl/packing.py): each mini-batch's sequences (prompt + completion, padding dropped) are
  # packed into rows of pack_length tokens on the devices, and the pi_old / pi_ref passes and the loss
  # run over packed rows, in micro-batches as many as the real tokens need. Same loss as padded rows.
  packing: bool = False
  pack_length: int = 0  # L: tokens per packed row, >= prompt length + max_new_tokens; 0: exactly that
  # Packed rows per micro-batch on each batch shard (data x fsdp): micro_batch_tokens // pack_length
  # (bounds the activation memory by tokens, whatever the lengths); 0: as micro_batch_size rows would.
  micro_batch_tokens: int = 0
  # Tree packing (needs packing): the sequences that share a prompt (a group's G answers, in the same
  # mini-batch and batch shard: shuffle 'groups' with several mini-batches) hold its tokens once per
  # packed row, each completion a branch that attends to them, so a prompt of Tp tokens costs Tp,
  # not G x Tp, in the passes and the loss, as long as the row has room for the branches (a longer
  # pack_length holds more of them). Same loss and gradients as packed rows; a mixture's
  # load-balancing term and its load and rerouted-fraction metrics count a prompt's tokens once per
  # tree, as they are computed.
  tree_packing: bool = False
  tis_cap: float = 0.0  # C: truncated importance weight min(pi_old / pi_sampler, C); 0 disables
  logprob_implementation: LogprobImplementation = 'auto'  # ops.token_logprobs
  # DAPO dynamic sampling: groups whose G rewards are all equal are dropped and further rounds of P
  # prompts are sampled until P informative groups are found or max_sampling_rounds rounds are
  # spent; then the step trains on the informative groups found, filled up with the latest dropped
  # (zero-advantage) groups. Every prompt sampled counts as consumed.
  dynamic_sampling: bool = False
  max_sampling_rounds: int = 4  # >= 1: rounds of P prompts per step at most (dynamic_sampling)
  # Off-policy by a bounded lag (sampler/pool.py): (L + 1) * P prompt groups stay in flight across
  # steps, answers cut off when a step ends go on under the new weights, and each step trains on
  # the P oldest complete groups. A trained token is at most L policy versions older than the
  # update (its log-prob from the sampler is the behaviour policy: tis_cap weights it). 0: on-policy.
  max_lag: int = 0
  # max_lag > 0: 'wait': a step also waits for the groups at the bound, so none is ever too old;
  # 'regenerate': it waits for P complete groups only, and a group that would pass the bound restarts.
  stale_groups: Literal['wait', 'regenerate'] = 'wait'
  # Mixtures of experts (model/moe.py). 'rollout': the sampler records each token's experts in every
  # sparse layer and the trainer's pi_old and pi_theta passes route to them, the gates recomputed from
  # the live router (rollout routing replay); 'none': the trainer routes by its own router.
  routing_replay: Literal['none', 'rollout'] = 'none'
  replay_reference: bool = False  # pi_ref (kl_beta > 0) replays the rollout's routes too
  router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss on the routes used (logged either way)
  # On-policy distillation (rl/held.py): a teacher checkpoint (a Hugging Face directory, a grpo_jax
  # checkpoint, or a training run's workdir / checkpoints, full or LoRA) scores the student's sampled
  # tokens in the update; its tokenizer must be the student's. None: no teacher.
  teacher: str | None = None
  # w: A_t = (1 - w) A_group + w s -(log pi_sampler(y_t) - log pi_teacher(y_t)); 1: pure distillation,
  # 0: the reward alone (the teacher is still scored and its metrics logged).
  distill_weight: float = 1.0
  # s: nats of per-token reverse KL per unit of group advantage (which has unit spread). 1: the
  # pure-distillation update is the reverse KL's own policy gradient, so optim.learning_rate means
  # what it means for supervised fine-tuning, and a nat per token weighs one std of reward.
  distill_scale: float = 1.0
  # gamma: the per-token term summed over the row's later tokens with this discount; 0: each token
  # its own (the sampled token's KL alone, as on-policy distillation usually does).
  distill_discount: float = 0.0
  # 'group': the per-token term less its mean over the group's other rows at the same position
  # (leave-one-out, as RLOO's baseline: the same expected gradient, far less variance); 'none': raw.
  distill_baseline: Literal['group', 'none'] = 'group'
  # Exactly on-policy (ops/fixed_order.py): the policy computes in batch-invariant numerics (model.exact)
  # and the update's log-probs in the sampler's formula (logprob_implementation 'exact'), so the
  # sampler's log-probs and the trainer's recomputation under the same parameters are bitwise
  # equal, whatever the batch, packing, micro-batches or mesh: sampler_gap_max is 0 on-policy.
  exact_on_policy: bool = False

  def __post_init__(self):
    with section('algo'):
      require(self.advantage_epsilon >= 0, 'advantage_epsilon', f'must be >= 0, got {self.advantage_epsilon}')
      require(self.entropy_coef >= 0, 'entropy_coef', f'must be >= 0 (a bonus), got {self.entropy_coef}')
      require(self.group_size >= 2, 'group_size', f'must be >= 2 (a group needs a baseline), got {self.group_size}')
      require(self.num_minibatches >= 1, 'num_minibatches', f'must be >= 1, got {self.num_minibatches}')
      require(self.shuffle in ('rows', 'groups'), 'shuffle', f"must be 'rows' or 'groups', got {self.shuffle!r}")
      require(self.micro_batch_size >= 0, 'micro_batch_size', f'must be >= 0, got {self.micro_batch_size}')
      require(self.pack_length >= 0, 'pack_length', f'must be >= 0, got {self.pack_length}')
      require(self.micro_batch_tokens >= 0, 'micro_batch_tokens', f'must be >= 0, got {self.micro_batch_tokens}')
      for name in ('pack_length', 'micro_batch_tokens'):
        require(self.packing or not getattr(self, name), name,
                'applies to packed rows: set algo.packing=true (padded rows use micro_batch_size)')
      require(self.packing or not self.tree_packing, 'tree_packing',
              'packs a group as a tree into packed rows: set algo.packing=true too')
      require(not self.tree_packing or self.num_minibatches == 1 or self.shuffle == 'groups', 'shuffle',
              f"'rows' deals a prompt's G answers over the {self.num_minibatches} mini-batches, where tree_packing "
              "shares the prompt only among those in one: set algo.shuffle=groups")
      require(not (self.pack_length and self.micro_batch_tokens) or self.micro_batch_tokens >= self.pack_length,
              'micro_batch_tokens', f'({self.micro_batch_tokens}) must hold at least one packed row of '
              f'pack_length = {self.pack_length} tokens')
      require(self.ppo_epochs >= 1, 'ppo_epochs', f'must be >= 1, got {self.ppo_epochs}')
      require(self.max_lag >= 0, 'max_lag', f'must be >= 0 (0: on-policy), got {self.max_lag}')
      require(self.max_lag == 0 or self.tis_cap >= 1, 'tis_cap',
              f'must be >= 1 with max_lag={self.max_lag}: the importance weight pi_old / pi_sampler corrects '
              'for answers sampled by earlier policies (e.g. tis_cap: 2.0)')
      require(self.max_lag == 0 or not self.dynamic_sampling, 'max_lag',
              'cannot be combined with dynamic_sampling (which samples rounds of fresh prompts within a step)')
      require(self.max_sampling_rounds >= 1, 'max_sampling_rounds', f'must be >= 1, got {self.max_sampling_rounds}')
      require(0 <= self.epsilon_low < 1, 'epsilon_low', f'must be in [0, 1), got {self.epsilon_low}')
      require(self.epsilon_high >= 0, 'epsilon_high', f'must be >= 0, got {self.epsilon_high}')
      require(self.dual_clip == 0 or self.dual_clip > 1, 'dual_clip', f'must be 0 (off) or > 1, got {self.dual_clip}')
      require(self.kl_beta >= 0, 'kl_beta', f'must be >= 0, got {self.kl_beta}')
      require(self.tis_cap == 0 or self.tis_cap >= 1, 'tis_cap', f'must be 0 (off) or >= 1, got {self.tis_cap}')
      require(self.router_aux_loss_coef >= 0, 'router_aux_loss_coef', f'must be >= 0, got {self.router_aux_loss_coef}')
      require(0 <= self.distill_weight <= 1, 'distill_weight',
              f'must be in [0, 1] (0: the reward alone, 1: pure distillation), got {self.distill_weight}')
      require(self.distill_scale > 0, 'distill_scale', f'must be > 0, got {self.distill_scale}')
      require(0 <= self.distill_discount <= 1, 'distill_discount', f'must be in [0, 1], got {self.distill_discount}')
      require(self.teacher is None or bool(self.teacher), 'teacher', 'must name a checkpoint (or be left out)')
      require(self.routing_replay == 'rollout' or not self.replay_reference, 'replay_reference',
              "replays the rollout's routes: set algo.routing_replay=rollout")
