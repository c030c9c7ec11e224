"""The GRPO loss of one micro-batch: the policy's log-probs from the fused op, then the per-token
maths of rl/algo.py, summed with the aggregation's weights.

Log-probs come from `ops.token_logprobs` (no [tokens, vocab] logits), either of the padded rows
[B, Tp + N] or of packed rows (rl/packing.py) brought back to the padded [B, N] layout: the loss
itself only ever sees per-token arrays [B, N], so both layouts give the same loss.

Rows with images take their features as inputs (`LossInputs.features`): the update runs the
vision tower once per prompt, outside the micro-batches, and each of the prompt's G rows takes its
features; when the tower trains, the loss's gradient with respect to them is what the update
carries back through the tower (rl/update.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.ring_attention import context_size
from grpo_jax.model.vision import RowImages
from grpo_jax.ops import token_logprobs
from grpo_jax.rl import algo, packing
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.batch import Batch


@struct.dataclass
class LossInputs:
  """The rows the loss reads: a mini-batch, or one micro-batch of it, of the update's Batch, and
  what the update adds to it. B rows, N completion tokens.

  batch          rl/batch.Batch of the B rows; its routes (the sampler's experts) only when the
                 passes replay them (algo.routing_replay 'rollout'), else None: the model routes
                 by its own router. Its lags [B, N] (partial rollouts): versions between the
                 token's sampler and the policy trained; None: every token is the current policy's.
  old_log_probs  [B, N] fp32 pi_old(y_t); None on-policy (pi_old is the current policy, no pass).
  ref_log_probs  [B, N] fp32 pi_ref(y_t); None when beta = 0.
  weights        [B, N] fp32 the loss aggregation's weights, normalised over the whole mini-batch,
                 so micro-batch losses (and gradients) add up to the mini-batch loss exactly.
  token_weights  [B, N] fp32 token-mean weights over the mini-batch, for the reported metrics.
  advantages     [B, N] fp32 per-token advantages (on-policy distillation: algo.distilled_advantages),
                 or None: each row's group advantage, batch.advantages [B].
  features       [B, F, D] each row's image features (its prompt's, shown at batch.vision's
                 placements), or None (text rows)
  """

  batch: Batch
  old_log_probs: jax.Array | None = None
  ref_log_probs: jax.Array | None = None
  weights: jax.Array | None = None
  token_weights: jax.Array | None = None
  features: jax.Array | None = None
  advantages: jax.Array | None = None

  def map_rows(self, fn) -> 'LossInputs':
    """fn applied to every leaf that leads with the rows, the batch's included (Batch.map_rows)."""
    return jax.tree.map(fn, self.replace(batch=None)).replace(batch=self.batch.map_rows(fn))


def shown(rows: RowImages | None, features: jax.Array | None) -> dict:
  """The model's image keywords (Qwen2.hidden_states) for padded rows showing their `features`
  [B, F, D] at their placements; none for text rows."""
  return {} if rows is None else dict(positions=rows.positions, placed=(features, rows.placement))


def completion_log_probs(model: Qwen2, tokens: jax.Array, segment_ids: jax.Array, completion_length: int,
                         *, temperature: float, implementation: str, with_entropy: bool = False,
                         routes: jax.Array | None = None, **images):
  """(log pi(y_t) [B, N] (and entropy [B, N]) of the last N tokens, from the fused op; the
  model's Routing of the rows, None for a dense model). routes [B, Tp + N, Ls, k]: replayed.
  images: the model's image keywords: the rows' own images run through the tower
  (vision.model_inputs), or features computed already (`shown`).

  The logits predicting completion token t sit at position Tp + t - 1, so the op reads the hidden
  states of positions Tp - 1 .. Tp + N - 2; prompts must be left-padded.
  """
  hidden, routing = model.hidden_states(tokens, segment_ids=segment_ids, routes=routes, return_routing=True,
                                        **images)
  return next_token_log_probs(model, hidden, tokens, tokens.shape[1] - completion_length - 1, temperature=temperature,
                              return_entropy=with_entropy, implementation=implementation), routing


def next_token_log_probs(model: Qwen2, hidden: jax.Array, tokens: jax.Array, start: int, **options):
  """log pi (and entropy) [B, T - 1 - start] of tokens[:, start + 1:], each predicted by the hidden
  state [B, T, D] of the position before it (token_logprobs' options). Rows split along their
  length (context parallelism) take every position's, the targets shifted, and cut the result: a
  slice of the hidden states would leave T - 1 - start positions the context axis does not divide,
  which the partitioner gathers whole on every device."""
  if context_size() > 1:
    out = token_logprobs(hidden, model.lm_head_weight(), jnp.roll(tokens, -1, axis=1), **options)
    return jax.tree.map(lambda x: x[:, start:-1], out)
  return token_logprobs(hidden[:, start:-1], model.lm_head_weight(), tokens[:, start + 1:], **options)


def packed_token_log_probs(model: Qwen2, packed: packing.Packed, *, temperature: float, implementation: str,
                           with_entropy: bool = False, replay: bool = False, features: jax.Array | None = None):
  """(log pi [n, m, L - 1] (and entropy) of every packed token but each row's first, at the column
  before it (position c - 1 predicts the token in column c), for packed rows [n, m, L]; the
  model's Routing). replay: route to the packed rows' recorded experts. features [B, F, D]: the
  batch's rows' image features, which the packed tokens take (packed.placement)."""
  groups, rows, length = packed.tokens.shape
  flat = packed.map_tokens(lambda x: x.reshape((groups * rows,) + x.shape[2:]))
  tokens = flat.tokens
  placed = None if features is None else (features, flat.placement)
  hidden, routing = model.hidden_states(tokens, segment_ids=flat.segment_ids, routes=flat.routes if replay else None,
                                        return_routing=True, positions=flat.positions, placed=placed)
  out = next_token_log_probs(model, hidden, tokens, 0, temperature=temperature, return_entropy=with_entropy,
                             implementation=implementation)
  return jax.tree.map(lambda x: x.reshape(groups, rows, length - 1), out), routing


def log_probs_of(model: Qwen2, micro: LossInputs, packed: packing.Packed | None, *, temperature: float,
                 implementation: str, with_entropy: bool = False, replay: bool = False, with_routing: bool = False):
  """log pi [B, N] (and entropy) of the micro-batch's completions in the padded layout: from its
  padded rows, or (packed) from its packed rows, 0 outside the sequences packed into them.
  replay: route to `micro.batch.routes` (the sampler's experts). with_routing: return (values, Routing)."""
  options = dict(temperature=temperature, implementation=implementation, with_entropy=with_entropy)
  batch = micro.batch
  completion_length = batch.completion_length
  if packed is None:
    values, routing = completion_log_probs(model, batch.tokens, batch.segment_ids, completion_length, **options,
                                           routes=batch.routes if replay else None,
                                           **shown(batch.vision, micro.features))
  else:
    values, routing = packed_token_log_probs(model, packed, **options, replay=replay, features=micro.features)
    values = (tuple(packing.unpack(value, packed, completion_length) for value in values) if with_entropy
              else packing.unpack(values, packed, completion_length))
  return (values, routing) if with_routing else values


LOG_2 = float(np.log(2.0))  # |log ratio| > log 2: the ratio lies outside [0.5, 2]
# The sampler <-> trainer mismatch metrics, from the parameters the sampler used.
MISMATCH = ('sampler_gap_mean', 'sampler_gap_max', 'sampler_ratio_outside')


def sampler_mismatch(trainer_log_probs: jax.Array, sampler_log_probs: jax.Array, mask: jax.Array,
                     token_weights: jax.Array) -> dict:
  """How far the trainer's log-probs are from the sampler's for the same tokens [B, N]: the
  `token_weights`-weighted sums of |gap| and of [ratio outside [0.5, 2]] (token means when the
  weights are the token-mean weights), and the largest gap on a `mask`ed token."""
  gap = jnp.abs(jax.lax.stop_gradient(trainer_log_probs) - sampler_log_probs)
  return dict(sampler_gap_mean=jnp.sum(gap * token_weights), sampler_gap_max=jnp.max(jnp.where(mask, gap, 0.0)),
              sampler_ratio_outside=jnp.sum((gap > LOG_2) * token_weights))


def mismatch_by_lag(trainer_log_probs: jax.Array, sampler_log_probs: jax.Array, mask: jax.Array,
                    lags: jax.Array, max_lag: int) -> dict:
  """Per lag l = 0 .. max_lag, sums over the `mask`ed tokens sampled l versions ago: `lag_tokens/l`
  and `lag_gap/l`, their |log pi_trainer - log pi_sampler| (lag_means turns them into means)."""
  gap = jnp.abs(jax.lax.stop_gradient(trainer_log_probs) - sampler_log_probs)
  sums = {}
  for lag in range(max_lag + 1):
    at = mask & (lags == lag)
    sums[f'lag_tokens/{lag}'] = jnp.sum(at).astype(jnp.float32)
    sums[f'lag_gap/{lag}'] = jnp.sum(jnp.where(at, gap, 0.0))
  return sums


def lag_means(metrics: dict, max_lag: int) -> dict:
  """`metrics` with mismatch_by_lag's sums replaced by sampler_gap_mean/lag_l (the mean gap of
  the tokens sampled l versions ago), lag_frac/l (their share of the tokens), and the trained
  tokens' lag_mean and lag_max."""
  metrics = dict(metrics)
  tokens = {lag: metrics.pop(f'lag_tokens/{lag}') for lag in range(max_lag + 1)}
  total = jnp.maximum(sum(tokens.values()), 1.0)
  for lag in range(max_lag + 1):
    metrics[f'sampler_gap_mean/lag_{lag}'] = metrics.pop(f'lag_gap/{lag}') / jnp.maximum(tokens[lag], 1.0)
    metrics[f'lag_frac/{lag}'] = tokens[lag] / total
  metrics['lag_mean'] = sum(lag * count for lag, count in tokens.items()) / total
  metrics['lag_max'] = jnp.max(jnp.asarray([jnp.where(tokens[lag] > 0, lag, 0) for lag in tokens]))
  return metrics


def policy_loss(params, graphdef, micro: LossInputs, config: AlgoConfig, temperature: float, on_policy: bool,
                packed: packing.Packed | None = None):
  """Weighted-sum GRPO loss of one micro-batch and its weighted metric sums.

  on_policy: pi_old is the current policy (its log-probs are these, without gradient), and the
  sampler mismatch is measured here; else pi_old's come in `micro.old_log_probs` and the update
  measures the mismatch from them once. packed: the micro-batch's packed rows; `micro` then holds
  the whole mini-batch in the padded layout, its mask and weights zero outside these rows.
  """
  model = nnx.merge(graphdef, params)
  batch = micro.batch
  mask = batch.mask
  (log_probs, entropy), routing = log_probs_of(model, micro, packed, temperature=temperature,
                                               implementation=config.logprob_implementation, with_entropy=True,
                                               replay=config.routing_replay == 'rollout', with_routing=True)
  if packed is not None and not on_policy:  # elsewhere: the old policy's values, so every ratio there is a finite 1
    log_probs = jnp.where(mask, log_probs, micro.old_log_probs)
  old = jax.lax.stop_gradient(log_probs) if on_policy else micro.old_log_probs
  if config.importance_ratio == 'sequence':
    log_ratio = algo.sequence_log_ratio(log_probs, old, mask)
  else:
    log_ratio = algo.token_log_ratio(log_probs, old)
  advantages = batch.advantages[:, None] if micro.advantages is None else micro.advantages
  surrogate = algo.clipped_surrogate(log_ratio, advantages,
                                     epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
                                     dual_clip=config.dual_clip)
  token_loss = surrogate['loss']
  if config.tis_cap > 0:
    token_loss = token_loss * algo.truncated_importance_weight(old, batch.sampler_log_probs, config.tis_cap)
  pg_loss = token_loss
  kl = jnp.zeros_like(token_loss)
  if config.kl_beta > 0:
    kl = algo.KL_ESTIMATORS[config.kl_estimator](log_probs - micro.ref_log_probs)
    token_loss = token_loss + config.kl_beta * kl
  if config.entropy_coef > 0:
    token_loss = token_loss - config.entropy_coef * entropy
  loss = jnp.sum(token_loss * micro.weights)
  # Reported metrics are token means over the mini-batch, whatever the loss aggregation.
  per_token = micro.token_weights
  experts = {}
  if routing is not None:
    # Per micro-batch, weighted by its share of the mini-batch's completion tokens: the sums over
    # micro-batches are the mini-batch's token-weighted means (so is the auxiliary loss's term).
    share = jnp.sum(per_token)
    aux = routing.aux_loss()
    loss = loss + config.router_aux_loss_coef * aux * share
    experts = dict(router_aux_loss=aux * share, expert_load_max_over_mean=routing.imbalance() * share)
    if config.routing_replay == 'rollout':
      rerouted = jnp.sum(routing.differs) / jnp.maximum(routing.tokens, 1.0)
      experts['routing_replay_rerouted_frac'] = rerouted * share
  metrics = dict(policy_loss=jnp.sum(pg_loss * per_token), kl=jnp.sum(kl * per_token),
                 entropy=jnp.sum(jax.lax.stop_gradient(entropy) * per_token),
                 clip_frac_low=jnp.sum(surrogate['clipped_low'] * per_token),
                 clip_frac_high=jnp.sum(surrogate['clipped_high'] * per_token),
                 ratio_mean=jnp.sum(surrogate['ratio'] * per_token), **experts)
  if on_policy:
    metrics.update(sampler_mismatch(log_probs, batch.sampler_log_probs, mask, per_token))
    if batch.lags is not None:
      metrics.update(mismatch_by_lag(log_probs, batch.sampler_log_probs, mask, batch.lags, config.max_lag))
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)
