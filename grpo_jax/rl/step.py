"""The GRPO update: one jitted, optax-based function from a scored batch to new parameters.

Inside one call: pi_old and pi_ref log-probs (only when needed), then mu passes x mini-batches of
optimizer updates, each accumulating gradients over micro-batches. Log-probs come from the fused
op (`ops.token_logprobs`): no [tokens, vocab] logits are materialised. A non-finite loss or
gradient leaves parameters and optimizer state untouched and counts a skip.

Two layouts feed the model: the padded rows [B, Tp + N] (micro-batches of a fixed number of rows,
under `lax.scan`), or with `algo.packing` each mini-batch's sequences packed into rows of
`pack_length` tokens (rl/packing.py), in micro-batches of a fixed number of packed rows whose count
follows the step's real tokens (a loop with a data-dependent trip count). The loss itself is one
function of per-token arrays in the padded [B, N] layout either way; packing only changes where the
model's log-probs come from, so both layouts give the same loss, gradients and metrics.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding, PartitionSpec

from grpo_jax.config import AlgoConfig, OptimConfig
from grpo_jax.errors import require
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.sharding import batch_groups
from grpo_jax.ops import token_logprobs
from grpo_jax.rl import algo, packing


@struct.dataclass
class TrainState:
  """Everything that changes during training (and is checkpointed)."""

  step: jax.Array  # int32 RL steps done: the run's one step counter
  params: nnx.State  # master parameters (param_dtype)
  opt_state: optax.OptState
  key: jax.Array  # uint32[2] PRNG state for rollouts and mini-batch shuffling
  updates: jax.Array  # int32 optimizer updates applied (drives the learning-rate schedule)
  skips: jax.Array  # int32 consecutive updates skipped for non-finite loss or gradients


@struct.dataclass
class Batch:
  """A scored rollout ready for the update; B = P * G rows.

  tokens        [B, Tp + N] int32  left-padded prompt followed by the completion
  segment_ids   [B, Tp + N] int32  1 on real prompt and completion tokens, 0 on padding
  mask          [B, N] bool        completion tokens (the stop token included)
  advantages    [B] fp32
  sampler_log_probs [B, N] fp32    the sampler's log pi(y_t) (for the TIS correction)
  """

  tokens: jax.Array
  segment_ids: jax.Array
  mask: jax.Array
  advantages: jax.Array
  sampler_log_probs: jax.Array

  @property
  def completion_length(self) -> int:
    return self.mask.shape[1]


@struct.dataclass
class LossInputs:
  """The rows the loss reads: a mini-batch, or one micro-batch of it. B rows, N completion tokens.

  tokens, segment_ids, mask, advantages, sampler_log_probs: as in `Batch`.
  old_log_probs  [B, N] fp32 pi_old(y_t); None on-policy (pi_old is the current policy, no pass).
  ref_log_probs  [B, N] fp32 pi_ref(y_t); None when beta = 0.
  weights        [B, N] fp32 the loss aggregation's weights, normalised over the whole mini-batch,
                 so micro-batch losses (and gradients) add up to the mini-batch loss exactly.
  token_weights  [B, N] fp32 token-mean weights over the mini-batch, for the reported metrics.
  """

  tokens: jax.Array
  segment_ids: jax.Array
  mask: jax.Array
  advantages: jax.Array
  sampler_log_probs: jax.Array
  old_log_probs: jax.Array | None = None
  ref_log_probs: jax.Array | None = None
  weights: jax.Array | None = None
  token_weights: jax.Array | None = None


def learning_rate_schedule(config: OptimConfig, total_updates: int) -> optax.Schedule:
  peak = config.learning_rate
  if config.schedule == 'constant':
    if config.warmup_steps == 0:
      return optax.constant_schedule(peak)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, config.warmup_steps),
                                 optax.constant_schedule(peak)], [config.warmup_steps])
  decay = config.decay_steps or max(total_updates, config.warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(0.0, peak, config.warmup_steps, decay,
                                            end_value=peak * config.min_lr_ratio)


def make_optimizer(config: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """AdamW on `schedule` (see learning_rate_schedule), after global-norm clipping when enabled."""
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                      weight_decay=config.weight_decay)
  if config.max_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
  return adamw


def completion_log_probs(model: Qwen2, tokens: jax.Array, segment_ids: jax.Array, completion_length: int,
                         *, temperature: float, implementation: str, with_entropy: bool = False):
  """log pi(y_t) [B, N] (and entropy [B, N]) of the last N tokens, from the fused op.

  The logits predicting completion token t sit at position Tp + t - 1, so the op reads the hidden
  states of positions Tp - 1 .. Tp + N - 2; prompts must be left-padded.
  """
  hidden = model.hidden_states(tokens, segment_ids=segment_ids)
  hidden = hidden[:, -completion_length - 1:-1]
  return token_logprobs(hidden, model.lm_head_weight(), tokens[:, -completion_length:],
                        temperature=temperature, return_entropy=with_entropy,
                        implementation=implementation)


def packed_token_log_probs(model: Qwen2, packed: packing.Packed, *, temperature: float, implementation: str,
                           with_entropy: bool = False):
  """log pi [n, m, L - 1] (and entropy) of every packed token but each row's first, at the column
  before it (position c - 1 predicts the token in column c), for packed rows [n, m, L]."""
  groups, rows, length = packed.tokens.shape
  tokens = packed.tokens.reshape(groups * rows, length)
  hidden = model.hidden_states(tokens, segment_ids=packed.segment_ids.reshape(groups * rows, length))
  out = token_logprobs(hidden[:, :-1], model.lm_head_weight(), tokens[:, 1:], temperature=temperature,
                       return_entropy=with_entropy, implementation=implementation)
  return jax.tree.map(lambda x: x.reshape(groups, rows, length - 1), out)


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  """Static settings of the update (hashable)."""

  algo: AlgoConfig
  temperature: float
  rows: int  # B = P * G
  sequence_length: int = 0  # Tp + N, when known here: checks the packing settings against it

  def __post_init__(self):
    if self.algo.packing and self.sequence_length:
      length = self.row_length(self.sequence_length)
      require(length >= self.sequence_length, 'algo.pack_length',
              f'({length}) must hold a whole sequence: at least the prompt length + rollout.max_new_tokens '
              f'= {self.sequence_length} tokens')
      require(self.algo.micro_batch_tokens == 0 or self.algo.micro_batch_tokens >= length, 'algo.micro_batch_tokens',
              f'({self.algo.micro_batch_tokens}) must hold at least one packed row of algo.pack_length = {length} tokens')

  def row_length(self, sequence_length: int) -> int:
    """L: tokens per packed row."""
    return self.algo.pack_length or sequence_length

  def packed_micro_rows(self, rows: int, row_length: int) -> int:
    """Packed rows per batch group in one micro-batch of a `rows`-row batch: algo.micro_batch_tokens
    worth of rows, else as many as the padded micro-batch puts on each group."""
    groups = batch_groups(rows)
    if self.algo.micro_batch_tokens:
      per_group = self.algo.micro_batch_tokens // row_length
    else:
      per_group = min(self.micro_rows, rows) // groups
    return max(1, min(per_group, rows // groups))

  @property
  def on_policy(self) -> bool:
    """mu = 1 and one mini-batch: pi_old is the current policy, so its log-probs need no pass."""
    return self.algo.ppo_epochs == 1 and self.algo.num_minibatches == 1

  @property
  def minibatch_rows(self) -> int:
    return self.rows // self.algo.num_minibatches

  @property
  def micro_rows(self) -> int:
    return self.algo.micro_batch_size or self.minibatch_rows


def _split_rows(tree, chunk: int):
  """[B, ...] leaves -> [B / chunk, chunk, ...]."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:]), tree)


def _merge_rows(x):
  return x.reshape(-1, *x.shape[2:])


LOG_2 = float(np.log(2.0))  # |log ratio| > log 2: the ratio lies outside [0.5, 2]
# The sampler <-> trainer mismatch metrics: per-step values from the parameters the sampler used.
MISMATCH = ('sampler_gap_mean', 'sampler_gap_max', 'sampler_ratio_outside')


def policy_loss(params, graphdef, micro: LossInputs, settings: UpdateSettings, packed: packing.Packed | None = None):
  """Weighted-sum GRPO loss of one micro-batch and its weighted metric sums.

  packed: the micro-batch's packed rows; `micro` then holds the whole mini-batch in the padded
  layout, its mask and weights zero outside the sequences packed into these rows.
  """
  config = settings.algo
  model = nnx.merge(graphdef, params)
  mask = micro.mask
  options = dict(temperature=settings.temperature, implementation=config.logprob_implementation, with_entropy=True)
  if packed is None:
    log_probs, entropy = completion_log_probs(model, micro.tokens, micro.segment_ids, mask.shape[1], **options)
  else:
    log_probs, entropy = (packing.unpack(values, packed, mask.shape[1])
                          for values in packed_token_log_probs(model, packed, **options))
    if not settings.on_policy:  # elsewhere: the old policy's values, so every ratio there is a finite 1
      log_probs = jnp.where(mask, log_probs, micro.old_log_probs)
  old = jax.lax.stop_gradient(log_probs) if settings.on_policy else micro.old_log_probs
  if config.importance_ratio == 'sequence':
    log_ratio = algo.sequence_log_ratio(log_probs, old, mask)
  else:
    log_ratio = algo.token_log_ratio(log_probs, old)
  surrogate = algo.clipped_surrogate(log_ratio, micro.advantages[:, None],
                                     epsilon_low=config.epsilon_low, epsilon_high=config.epsilon_high,
                                     dual_clip=config.dual_clip)
  token_loss = surrogate['loss']
  if config.tis_cap > 0:
    token_loss = token_loss * algo.truncated_importance_weight(old, micro.sampler_log_probs, config.tis_cap)
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
  # How far the trainer's log-probs are from the sampler's for the same tokens (read from the first
  # mini-batch, whose parameters are the sampler's: see update).
  gap = jnp.abs(jax.lax.stop_gradient(log_probs) - micro.sampler_log_probs)
  metrics = dict(sampler_gap_mean=jnp.sum(gap * per_token), sampler_gap_max=jnp.max(jnp.where(mask, gap, 0.0)),
                 sampler_ratio_outside=jnp.sum((gap > LOG_2) * per_token),
                 policy_loss=jnp.sum(pg_loss * per_token), kl=jnp.sum(kl * per_token),
                 entropy=jnp.sum(jax.lax.stop_gradient(entropy) * per_token),
                 clip_frac_low=jnp.sum(surrogate['clipped_low'] * per_token),
                 clip_frac_high=jnp.sum(surrogate['clipped_high'] * per_token),
                 ratio_mean=jnp.sum(surrogate['ratio'] * per_token))
  return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


def _scored_log_probs(graphdef, params, batch: Batch, settings: UpdateSettings,
                      packed: packing.Packed | None = None):
  """Log-probs [B, N] of the whole batch without gradients, one micro-batch at a time: of the
  padded rows, or of the `packed` rows (micro-batches while any group has rows left)."""
  model = lambda: nnx.merge(graphdef, params)  # noqa: E731  (merged inside each traced loop body)
  options = dict(temperature=settings.temperature, implementation=settings.algo.logprob_implementation)
  if packed is None:
    def score(chunk):
      return completion_log_probs(model(), chunk['tokens'], chunk['segment_ids'], batch.completion_length, **options)
    chunks = _split_rows(dict(tokens=batch.tokens, segment_ids=batch.segment_ids), settings.micro_rows)
    return _merge_rows(jax.lax.map(score, chunks))

  micro_rows = settings.packed_micro_rows(batch.tokens.shape[0], packed.row_length)

  def score_packed(index, out):
    values = packed_token_log_probs(model(), packing.micro_batch(packed, index, micro_rows), **options)
    return jax.lax.dynamic_update_slice_in_dim(out, values, index * micro_rows, axis=1)

  groups, rows, length = packed.tokens.shape
  out = jax.lax.fori_loop(0, packing.micro_batch_count(packed, micro_rows), score_packed,
                          jnp.zeros((groups, rows, length - 1), jnp.float32))
  return packing.unpack(out, packed, batch.completion_length)


def _pack(settings: UpdateSettings, tokens, segment_ids, completion_length: int) -> tuple[packing.Packed, int]:
  """The rows packed as `settings` says, and the packed rows per group of one micro-batch."""
  length = settings.row_length(tokens.shape[1])
  micro_rows = settings.packed_micro_rows(tokens.shape[0], length)
  return packing.pack(tokens, segment_ids, completion_length, length, micro_rows), micro_rows


def _add_metrics(totals: dict, metrics: dict) -> dict:
  """Micro-batch metric sums added up (the largest gap kept)."""
  return {name: (jnp.maximum if name == 'sampler_gap_max' else jnp.add)(totals[name], value)
          for name, value in metrics.items()}


def update(state: TrainState, batch: Batch, ref_params: nnx.State | None, *, graphdef,
           optimizer: optax.GradientTransformation, schedule: optax.Schedule,
           settings: UpdateSettings) -> tuple[TrainState, dict]:
  """mu passes of mini-batch optimizer updates over `batch`. Traceable (rl/loop.py jits it)."""
  config = settings.algo
  completion_length = batch.completion_length
  # pi_old and pi_ref score the whole batch, packed once for both.
  scoring = None
  if config.packing and (not settings.on_policy or config.kl_beta > 0):
    scoring, _ = _pack(settings, batch.tokens, batch.segment_ids, completion_length)
  rows = LossInputs(
      tokens=batch.tokens, segment_ids=batch.segment_ids, mask=batch.mask, advantages=batch.advantages,
      sampler_log_probs=batch.sampler_log_probs,
      old_log_probs=None if settings.on_policy else _scored_log_probs(graphdef, state.params, batch, settings, scoring),
      ref_log_probs=(_scored_log_probs(graphdef, ref_params, batch, settings, scoring)
                     if config.kl_beta > 0 else None))

  key, shuffle_key = jax.random.split(state.key)
  if config.num_minibatches > 1:
    orders = [jax.random.permutation(k, settings.rows) for k in jax.random.split(shuffle_key, config.ppo_epochs)]
  else:
    orders = [jnp.arange(settings.rows)] * config.ppo_epochs
  orders = jnp.stack(orders).reshape(-1, settings.minibatch_rows)  # [mu * minibatches, rows per minibatch]
  grad_fn = jax.value_and_grad(policy_loss, has_aux=True)

  def padded_gradients(params, minibatch: LossInputs):
    """Loss, metric sums and gradients over fixed micro-batches of padded rows."""
    def accumulate(totals, micro):
      (loss, metrics), grads = grad_fn(params, graphdef, micro, settings)
      total_loss, total_metrics, total_grads = totals
      return (total_loss + loss, _add_metrics(total_metrics, metrics), jax.tree.map(jnp.add, total_grads, grads)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        lambda: grad_fn(params, graphdef, jax.tree.map(lambda x: x[:settings.micro_rows], minibatch), settings)))
    (loss, metrics), grads = zeros[0], zeros[1]
    (loss, metrics, grads), _ = jax.lax.scan(accumulate, (loss, metrics, grads),
                                             _split_rows(minibatch, settings.micro_rows))
    return loss, dict(metrics, micro_batches=jnp.float32(settings.minibatch_rows // settings.micro_rows)), grads

  def packed_gradients(params, minibatch: LossInputs):
    """Loss, metric sums and gradients over micro-batches of packed rows, as many as the
    mini-batch's real tokens need: each sees the whole mini-batch's per-token arrays with its own
    sequences' weights, so the micro-batch sums add up to the padded path's."""
    packed, micro_rows = _pack(settings, minibatch.tokens, minibatch.segment_ids, completion_length)
    count = packing.micro_batch_count(packed, micro_rows)

    def micro_inputs(index):
      micro_packed = packing.micro_batch(packed, index, micro_rows)
      member = packing.members(micro_packed)[:, None]
      return micro_packed, minibatch.replace(mask=minibatch.mask & member, weights=minibatch.weights * member,
                                             token_weights=minibatch.token_weights * member)

    def accumulate(index, totals):
      micro_packed, micro = micro_inputs(index)
      (loss, metrics), grads = grad_fn(params, graphdef, micro, settings, micro_packed)
      total_loss, total_metrics, total_grads = totals
      return total_loss + loss, _add_metrics(total_metrics, metrics), jax.tree.map(jnp.add, total_grads, grads)

    def first_micro_batch():
      micro_packed, micro = micro_inputs(0)
      return grad_fn(params, graphdef, micro, settings, micro_packed)

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(first_micro_batch))
    (loss, metrics), grads = zeros[0], zeros[1]
    loss, metrics, grads = jax.lax.fori_loop(0, count, accumulate, (loss, metrics, grads))
    groups, _, length = packed.tokens.shape
    computed = (count * groups * micro_rows * length).astype(jnp.float32)
    return loss, dict(metrics, micro_batches=count.astype(jnp.float32),
                      packed_rows=jnp.sum(packed.rows_used).astype(jnp.float32),
                      packed_padding_frac=1.0 - packed.real_tokens / computed), grads

  def minibatch_update(carry, order):
    params, opt_state, updates, skips = carry
    minibatch = jax.tree.map(lambda x: x[order], rows)
    minibatch = minibatch.replace(
        weights=algo.aggregation_weights(minibatch.mask, config.loss_aggregation, completion_length),
        token_weights=algo.aggregation_weights(minibatch.mask, 'token-mean'))
    loss, metrics, grads = (packed_gradients if config.packing else padded_gradients)(params, minibatch)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    step_updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, step_updates)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    carry = (keep(new_params, params), keep(new_opt_state, opt_state),
             updates + finite.astype(jnp.int32), jnp.where(finite, 0, skips + 1))
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm, lr=schedule(updates),
                   nonfinite=(~finite).astype(jnp.float32))
    return carry, metrics

  carry = (state.params, state.opt_state, state.updates, state.skips)
  (params, opt_state, updates, skips), metrics = jax.lax.scan(minibatch_update, carry, orders)
  # The mismatch: from pi_old over the whole batch when it was scored (the sampler's parameters),
  # else from the first mini-batch (the only one before an update moved the parameters).
  mismatch = ({name: metrics[name][0] for name in MISMATCH} if rows.old_log_probs is None
              else _mismatch(rows.old_log_probs, batch.sampler_log_probs, batch.mask))
  metrics = dict(jax.tree.map(jnp.mean, metrics), **mismatch)
  metrics['nonfinite'] = metrics['nonfinite'] * orders.shape[0]  # count, not mean
  real = jnp.sum(batch.segment_ids != 0)
  metrics.update(sequence_tokens=real.astype(jnp.float32),
                 padding_frac=1.0 - real / jnp.float32(batch.segment_ids.size))
  new_state = state.replace(params=params, opt_state=opt_state, key=key, updates=updates, skips=skips)
  return new_state, metrics


def _mismatch(trainer_log_probs, sampler_log_probs, mask) -> dict:
  """Mean and max |log pi_trainer - log pi_sampler| over completion tokens, and the fraction whose
  ratio lies outside [0.5, 2]."""
  gap = jnp.abs(trainer_log_probs - sampler_log_probs)
  tokens = jnp.maximum(jnp.sum(mask), 1)
  return dict(sampler_gap_mean=jnp.sum(jnp.where(mask, gap, 0.0)) / tokens,
              sampler_gap_max=jnp.max(jnp.where(mask, gap, 0.0)),
              sampler_ratio_outside=jnp.sum(mask & (gap > LOG_2)) / tokens)


def init_train_state(params: nnx.State, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                    key=jax.random.PRNGKey(seed), updates=jnp.zeros((), jnp.int32),
                    skips=jnp.zeros((), jnp.int32))


def train_state_shardings(params: nnx.State, optimizer: optax.GradientTransformation) -> TrainState:
  """The one layout of a TrainState: the parameters as they lie (the logical-axis rules of
  model/sharding.py), every optimizer leaf that mirrors a parameter (AdamW's moments) laid out
  like that parameter, so FSDP shards the optimizer state too, and the counters and key
  replicated. Init, the jitted update, the K-step loop and checkpoint restore all use it."""
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  replicated = NamedSharding(jax.tree.leaves(param_shardings)[0].mesh, PartitionSpec())
  opt_shardings = optax.tree_map_params(optimizer, lambda _, sharding: sharding,
                                        jax.eval_shape(optimizer.init, params), param_shardings,
                                        transform_non_params=lambda _: replicated)
  return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings, key=replicated,
                    updates=replicated, skips=replicated)


def create_train_state(params: nnx.State, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
  """A fresh TrainState in `train_state_shardings`, built on the parameters' devices."""
  init = jax.jit(functools.partial(init_train_state, optimizer=optimizer, seed=seed),
                 out_shardings=train_state_shardings(params, optimizer))
  return init(params)
