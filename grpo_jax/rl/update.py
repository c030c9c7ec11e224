"""The GRPO update: one traceable, optax-based function from a scored batch to new parameters.

Inside one call: pi_old, pi_ref and a teacher's log-probs (only when needed), then mu passes x mini-batches of
optimizer updates, each accumulating the loss's gradients (rl/loss.py) over micro-batches. A
non-finite loss or gradient leaves parameters and optimizer state untouched and counts a skip.

Two layouts feed the model, chosen by `algo.packing`: the padded rows [B, Tp + N] in micro-batches
of a fixed number of rows, or each mini-batch's sequences packed into rows of `pack_length` tokens
(rl/packing.py) in micro-batches of a fixed number of packed rows, as many as the step's real
tokens need. The micro-batch loop is written once for both (`_accumulate`, `_score`); only which
rows a micro-batch holds differs, and the loss sees the padded [B, N] layout either way, so both
give the same loss, gradients and metrics.

Images: the vision tower runs once per prompt, outside the micro-batches, and each row takes its
prompt's features (LossInputs.features). A frozen tower (`model.freeze_vision`, or LoRA's base) runs
once per update and its features serve every pass; a trained one runs once per mini-batch on the
prompts whose rows the mini-batch holds (`_image_owners`): all P when rows are shuffled one by one
(`algo.shuffle: rows`), its own P / M with whole groups (`groups`), and its own rows' when each row
shows images of its own (an agent's episodes). The loss's gradients with respect to its rows'
features, summed over the micro-batches whichever of them holds a prompt's rows, go back through
the tower once (`jax.vjp`). The tower's parameters are never among those the micro-batches
differentiate, so no gradient buffer of them is carried.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from grpo_jax.errors import require
from grpo_jax.model import lora
from grpo_jax.rl import algo, packing
from grpo_jax.rl.algo import AlgoConfig
from grpo_jax.rl.batch import Batch
from grpo_jax.rl.held import Held
from grpo_jax.rl.loss import (MISMATCH, LossInputs, lag_means, log_probs_of, mismatch_by_lag, policy_loss,
                              sampler_mismatch)
from grpo_jax.rl.state import TrainState
from grpo_jax.sharding import batch_axes, batch_groups, constrain


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
  """Static settings of the update (hashable)."""

  algo: AlgoConfig
  temperature: float
  rows: int  # B = P * G
  sequence_length: int = 0  # Tp + N, when known here: checks the packing settings against it

  def __post_init__(self):
    deal = self.algo.group_size * self.algo.num_minibatches
    require(self.algo.shuffle == 'rows' or self.rows % deal == 0, 'algo.shuffle',
            f"'groups' deals whole groups of {self.algo.group_size} rows into {self.algo.num_minibatches} mini-batches: "
            f'{self.rows} rows do not divide evenly')
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


@dataclasses.dataclass(frozen=True)
class MicroBatches:
  """How a set of rows splits into micro-batches, in either layout: `count` micro-batches (a traced
  count when packed), micro-batch i holding padded rows i, i + count, i + 2 count, ... of every leaf
  (`rows` of them), or (packed) packed rows [i * rows, (i + 1) * rows) of every batch group.

  Padded micro-batches are strided: the rows lie over the batch shards in contiguous blocks, so
  each shard holds its share of every micro-batch and taking one moves nothing between devices. A
  contiguous micro-batch would lie on one shard, and XLA gathered the whole mini-batch's leaves to
  every device in every micro-batch: for the 7B VL recipe its rows' image features, 2.9-5.7 GiB a
  gather, 32 times an update."""

  count: int | jax.Array
  rows: int
  packed: packing.Packed | None = None

  @classmethod
  def of(cls, settings: UpdateSettings, batch: Batch, micro_rows: int) -> 'MicroBatches':
    """The micro-batches of the batch's padded rows [B, Tp + N] (and their routes, their images'
    positions and placements) as `settings` lay them out; `micro_rows`: padded rows per micro-batch."""
    if not settings.algo.packing:
      return cls(count=batch.size // micro_rows, rows=micro_rows)
    tokens = batch.tokens
    length = settings.row_length(tokens.shape[1])
    rows = settings.packed_micro_rows(batch.size, length)
    packed = packing.pack(tokens, batch.segment_ids, batch.completion_length, length, rows, batch.routes, batch.vision,
                          trees=settings.algo.tree_packing)
    return cls(count=packing.micro_batch_count(packed, rows), rows=rows, packed=packed)

  def take(self, index, inputs: LossInputs) -> tuple[LossInputs, packing.Packed | None]:
    """Micro-batch `index` of `inputs` (their rows [B, ...]): its own rows, or (packed) its packed
    rows and the whole `inputs` with the mask and weights of the sequences outside them zeroed."""
    if self.packed is None:
      return inputs.map_rows(lambda x: jax.lax.dynamic_index_in_dim(self.strided(x), index, axis=1,
                                                                      keepdims=False)), None
    packed = packing.micro_batch(self.packed, index, self.rows)
    member = packing.members(packed)[:, None]
    if inputs.weights is not None:
      inputs = inputs.replace(weights=inputs.weights * member, token_weights=inputs.token_weights * member)
    return inputs.replace(batch=inputs.batch.masked(member)), packed

  def strided(self, x: jax.Array) -> jax.Array:
    """Padded rows [B, ...] as [rows, count, ...]: [r, i] is row r of micro-batch i."""
    return x.reshape(self.rows, self.count, *x.shape[1:])

  def metrics(self) -> dict:
    """micro_batches, and with packing the packed rows, the tokens they hold (update() reports a
    pass's: fewer than the sequences', sequence_tokens, with tree packing) and their padding fraction."""
    count = jnp.asarray(self.count, jnp.float32)
    if self.packed is None:
      return dict(micro_batches=count)
    groups, _, length = self.packed.tokens.shape
    computed = count * groups * self.rows * length
    return dict(micro_batches=count, packed_rows=jnp.sum(self.packed.rows_used).astype(jnp.float32),
                packed_tokens=self.packed.real_tokens.astype(jnp.float32),
                packed_padding_frac=1.0 - self.packed.real_tokens / computed)


def _add_metrics(totals: dict, metrics: dict) -> dict:
  """Micro-batch metric sums added up (the largest gap kept)."""
  return {name: (jnp.maximum if name == 'sampler_gap_max' else jnp.add)(totals[name], value)
          for name, value in metrics.items()}


def _accumulate(gradients, count):
  """Loss, metric sums and gradients summed over micro-batches 0 .. count - 1, where
  `gradients(index)` -> ((loss, metrics), grads) of one (grads: any pytree)."""
  def add(index, totals):
    (loss, metrics), grads = gradients(index)
    total_loss, total_metrics, total_grads = totals
    return total_loss + loss, _add_metrics(total_metrics, metrics), jax.tree.map(jnp.add, total_grads, grads)

  (loss, metrics), grads = jax.tree.map(jnp.zeros_like, jax.eval_shape(gradients, 0))
  return jax.lax.fori_loop(0, count, add, (loss, metrics, grads))


REPLICAS = 'data'  # the mesh axis whose devices hold whole copies of the parameters (sharding.py)


def _replicas_of(micro: 'MicroBatches', rows: int) -> int:
  """How many replicas (the mesh's 'data' axis) each accumulate the gradients of their own rows: its
  size where an update has several micro-batches, the mesh has no tensor axis, and the data axis
  splits the mini-batch's rows and each replica's micro-batch rows (padded) or packed groups split
  evenly over its own batch axes (fsdp, expert); else 1: the whole mesh computes each micro-batch,
  and the data axis reduces its gradients, as any batch axis does. Inside the replicas' shard_map,
  XLA's partitioner aborted placing the embedding gather of a vocabulary split over 'tensor', that
  of a micro-batch of fewer rows than a replica's devices, and the ring attention's shard_map over
  'context' (spmd_partitioner_util.cc: the partition groups' device count; jax 0.12): a context axis
  also keeps the whole mesh on each micro-batch."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  sizes = dict(mesh.shape)
  replicas = sizes.get(REPLICAS, 1)
  inner = math.prod(size for name, size in sizes.items() if name in batch_axes() and name != REPLICAS)
  parts = micro.rows if micro.packed is None else micro.packed.tokens.shape[0]
  even = rows % replicas == 0 and parts % (replicas * inner) == 0
  # One micro-batch: nothing to save (the whole mesh reduces it once).
  several = micro.count > 1 if micro.packed is None else micro.packed.tokens.shape[1] > micro.rows
  alone = sizes.get('tensor', 1) == 1 and sizes.get('context', 1) == 1
  return replicas if replicas > 1 and alone and even and several else 1


def _over_replicas(accumulate, params, rows: LossInputs, micro: 'MicroBatches'):
  """accumulate(params, rows, micro) -> (loss, metric sums, (gradients, the rows' feature
  gradients [B, F, D] or None)) over every micro-batch of `rows`, run by each replica of the mesh's 'data' axis on its own rows (a shard_map manual over
  'data' alone; inside it each replica is a mesh of fsdp x expert), then summed across the
  replicas once. Hybrid sharding's contract: a micro-batch's gradients are reduce-scattered over
  the host's fsdp devices, and only the update's sum crosses the hosts, once per optimizer update
  rather than once per micro-batch; inside the shard_map nothing else can cross 'data'. A
  replica's rows split into micro-batches of 1/data as many rows (padded) or of its own packed
  groups, so micro-batches differ from one device's, but their sums are the same. The sums cross
  in the gradients' dtype (fp32 parameters: fp32, as the log-prob op's dW sums already ran), in
  bytes no more than XLA's per-micro-batch bf16 reductions of the weight gradients from 2
  micro-batches on. The feature gradients are each replica's own rows', gathered by rows. Where
  `_replicas_of` says 1, accumulate runs on the whole mesh."""
  replicas = _replicas_of(micro, rows.batch.size)
  if replicas == 1:
    return accumulate(params, rows, micro)
  local_rows = rows.batch.size // replicas
  by_rows = lambda tree: jax.tree.map(lambda _: PartitionSpec(REPLICAS), tree)  # noqa: E731

  def replica(params, rows, packed):
    if packed is not None and packed.placement is not None:  # a packed token's image: its row among these rows
      sequence = packed.placement[..., 0]
      local = jnp.where(sequence >= 0, sequence - jax.lax.axis_index(REPLICAS) * local_rows, -1)
      packed = packed.replace(placement=packed.placement.at[..., 0].set(local))
    own = MicroBatches(count=micro.count, rows=micro.rows if packed is not None else micro.rows // replicas,
                       packed=packed)
    loss, metrics, (grads, feature_grads) = accumulate(params, rows, own)
    metrics = {name: (jax.lax.pmax if name == 'sampler_gap_max' else jax.lax.psum)(value, REPLICAS)
               for name, value in metrics.items()}
    return jax.lax.psum(loss, REPLICAS), metrics, (jax.lax.psum(grads, REPLICAS), feature_grads)

  packed = micro.packed
  # Every packed leaf leads with the groups but the batch's token count.
  packed_specs = None if packed is None else by_rows(packed).replace(real_tokens=PartitionSpec())
  # check_vma off: the gradients of the replicated parameters stay each replica's own until the psum
  # (with the varying-type check, the backward would sum them across the replicas in every micro-batch).
  # A packed count (traced) enters closed over: the same on every replica.
  out_specs = (PartitionSpec(), PartitionSpec(), (PartitionSpec(), PartitionSpec(REPLICAS)))
  return jax.shard_map(replica, in_specs=(PartitionSpec(), by_rows(rows), packed_specs), out_specs=out_specs,
                       axis_names={REPLICAS}, check_vma=False)(params, rows, packed)


def _score(graphdef, params, inputs: LossInputs, micro: MicroBatches, settings: UpdateSettings,
           replay: bool) -> jax.Array:
  """Log-probs [B, N] of every row of `inputs` without gradients, one micro-batch at a time (the
  pi_old and pi_ref passes), routed to the inputs' recorded experts when `replay`. Packed
  micro-batches each fill their own sequences' rows."""
  def one(index, out):
    rows, packed = micro.take(index, inputs)
    values = log_probs_of(nnx.merge(graphdef, params), rows, packed, temperature=settings.temperature,
                          implementation=settings.algo.logprob_implementation, replay=replay)
    if packed is None:
      return jax.lax.dynamic_update_index_in_dim(out, values, index, axis=1)
    return jnp.where(rows.batch.mask, values, out)

  if micro.packed is None:  # filled micro-batch by micro-batch in their strided layout
    scored = jax.lax.fori_loop(0, micro.count, one, micro.strided(jnp.zeros(inputs.batch.mask.shape, jnp.float32)))
    return scored.reshape(inputs.batch.mask.shape)
  return jax.lax.fori_loop(0, micro.count, one, jnp.zeros(inputs.batch.mask.shape, jnp.float32))


def _head_for_logprobs(frozen: nnx.State) -> nnx.State:
  """A frozen base whose lm_head (or tied embedding) is laid out once as the log-prob op reads it:
  whole along D, split over V. A trained lm_head is cast to the compute dtype once per update, and
  XLA gathers that cast copy once; a frozen one is already in the compute dtype, and XLA:TPU then
  gathered it over 'fsdp' inside the micro-batch and vocabulary-chunk loops, every iteration
  (23,936 gathers of 1 GiB per step for the 7B LoRA recipe on a v5e-8)."""
  def place(path, variable):
    name = str(path[-1]) if len(path) == 1 else None
    if name == 'lm_head':
      return variable.replace(constrain(variable[...], (None, 'vocab')))
    if name == 'embedding' and 'lm_head' not in frozen:
      return variable.replace(constrain(variable[...], ('vocab', None)))
    return variable
  return nnx.map_state(place, frozen)


def _orders(key: jax.Array, settings: UpdateSettings) -> jax.Array:
  """The rows of each mini-batch of each pass [mu * M, B / M]: one random order per pass, of the
  rows one by one or of whole groups (`algo.shuffle`; G consecutive rows are a group, row p * G + g
  the g-th answer to prompt p); the rows in order with one mini-batch."""
  config = settings.algo
  if config.num_minibatches == 1:
    orders = [jnp.arange(settings.rows)] * config.ppo_epochs
  elif config.shuffle == 'groups':
    group = config.group_size
    orders = [(jax.random.permutation(k, settings.rows // group)[:, None] * group + jnp.arange(group)).reshape(-1)
              for k in jax.random.split(key, config.ppo_epochs)]
  else:
    orders = [jax.random.permutation(k, settings.rows) for k in jax.random.split(key, config.ppo_epochs)]
  return jnp.stack(orders).reshape(-1, settings.minibatch_rows)


def _image_owners(orders: jax.Array, owners: int, settings: UpdateSettings) -> jax.Array:
  """Whose images each mini-batch's rows show [mu * M, K], among the batch's `owners` image rows:
  the rows themselves when each row shows its own (owners = B: an agent's episodes), the mini-batch's
  P / M prompts when it holds whole groups, else all P prompts (any may have a row in it)."""
  if owners == settings.rows:
    return orders
  if settings.algo.shuffle == 'groups' or settings.algo.num_minibatches == 1:
    group = settings.rows // owners
    return orders[:, ::group] // group
  return jnp.broadcast_to(jnp.arange(owners, dtype=orders.dtype), (orders.shape[0], owners))


TOWER = 'visual'  # the vision tower's parameters (model/qwen2.py)


def split_tower(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
  """(the parameters but the vision tower's, the tower's or None)."""
  if TOWER not in params:
    return params, None
  tower, rest = nnx.split_state(params, lambda path, _: path[0] == TOWER, ...)
  return rest, tower


def update(state: TrainState, batch: Batch, held: Held, *, graphdef,
           optimizer: optax.GradientTransformation, schedule: optax.Schedule,
           settings: UpdateSettings) -> tuple[TrainState, dict]:
  """mu passes of mini-batch optimizer updates over `batch`. Traceable (rl/step.py jits it).
  held: the weights beside the policy (rl/held.py): pi_ref's whole parameter state (algo.kl_beta
  > 0; None with LoRA, where pi_ref is the state's own base with the adapters off), and a teacher
  (algo.teacher), whose log-probs of the sampled tokens make the advantages per token."""
  config = settings.algo
  frozen = None if state.frozen is None else _head_for_logprobs(state.frozen)
  ref_params, teacher = held.reference, held.teacher
  if config.kl_beta > 0 and ref_params is None:
    require(frozen is not None, 'held.reference', 'is needed for algo.kl_beta > 0 without LoRA')
    ref_params = lora.join(lora.adapters_off(state.params), frozen)
  require((teacher is not None) == (config.teacher is not None), 'algo.teacher',
          'and the teacher the step holds disagree: load it (build.build_teacher) when algo.teacher is set')
  completion_length = batch.completion_length
  replay = config.routing_replay == 'rollout'
  require(not replay or batch.routes is not None, 'algo.routing_replay',
          "is 'rollout', but this rollout recorded no routes (a dense model, or a rollout mode that records none)")
  images = batch.images
  rows = LossInputs(batch=(batch if replay else batch.without_routes()).without_images())
  policy = lora.join(state.params, frozen)

  def features_of(params, shown, images=images, graphdef=graphdef):
    """The rows' image features: the tower on each prompt's images once, taken by its rows."""
    return None if images is None else shown.features(nnx.merge(graphdef, params).image_features(images))

  # The policy's features now: a frozen tower's for every pass, a trained one's for pi_old's.
  rows = rows.replace(features=jax.lax.stop_gradient(features_of(policy, rows.batch.vision)))
  tower_trains = images is not None and TOWER in state.params and not nnx.merge(graphdef, policy).options.freeze_vision
  # pi_old, pi_ref and the teacher score the whole batch, laid out (packed) once for all three.
  distilled = {}
  if not settings.on_policy or config.kl_beta > 0 or teacher is not None:
    scoring = MicroBatches.of(settings, rows.batch, settings.micro_rows)
    rows = rows.replace(
        old_log_probs=None if settings.on_policy else _score(graphdef, policy, rows, scoring, settings, replay),
        ref_log_probs=(_score(graphdef, ref_params, rows.replace(features=features_of(ref_params, rows.batch.vision)),
                              scoring, settings, replay and config.replay_reference)
                       if config.kl_beta > 0 else None))
    if teacher is not None:  # routed by its own router: the student's experts are not its own
      shown = features_of(teacher.params, rows.batch.vision, graphdef=teacher.graphdef)
      teacher_log_probs = _score(teacher.graphdef, teacher.params, rows.replace(features=shown), scoring, settings,
                                 replay=False)
      rows = rows.replace(advantages=algo.distilled_advantages(
          batch.advantages, batch.sampler_log_probs, teacher_log_probs, batch.mask, weight=config.distill_weight,
          scale=config.distill_scale, discount=config.distill_discount,
          group_size=config.group_size if config.distill_baseline == 'group' else 0))
      distilled = algo.distillation_metrics(batch.sampler_log_probs, teacher_log_probs, batch.mask)

  key, shuffle_key = jax.random.split(state.key)
  orders = _orders(shuffle_key, settings)  # [mu * minibatches, rows per minibatch]
  owners = None if not tower_trains else _image_owners(orders, images.patches.shape[0], settings)

  def minibatch_update(carry, order_and_owners):
    params, opt_state, updates, skips = carry
    order, mine = order_and_owners
    minibatch = rows.map_rows(lambda x: x[order])
    mask = minibatch.batch.mask
    minibatch = minibatch.replace(weights=algo.aggregation_weights(mask, config.loss_aggregation, completion_length),
                                  token_weights=algo.aggregation_weights(mask, 'token-mean'))
    micro = MicroBatches.of(settings, minibatch.batch, settings.micro_rows)
    # Gradients with respect to the trained parameters but the tower (with LoRA: the adapters; the
    # frozen base is a constant of the loss, so no weight gradient of it is ever formed), and, when
    # the tower trains, the rows' features, computed here once per prompt.
    trained, tower = split_tower(params)
    constants = lora.join(tower, frozen) if tower is not None else frozen
    if tower_trains:
      # The tower on the images of the prompts this mini-batch's rows show (`mine`), each row then
      # taking its prompt's among them; fp32 rows' features: each prompt's G rows' gradients add up
      # in fp32 before the tower's backward.
      shown = minibatch.batch.vision
      local = dataclasses.replace(shown, prompt=jnp.argmax(shown.prompt[:, None] == mine[None, :], axis=1).astype(
          jnp.int32))
      features, pullback = jax.vjp(
          lambda tower: features_of(lora.join(lora.join(trained, tower), frozen), local,
                                    images.map_rows(lambda x: x[mine])).astype(jnp.float32), tower)
      minibatch = minibatch.replace(features=features)

    def accumulate(trained, rows, micro):
      def gradients(index):
        def loss(trained, features):
          inputs, packed = micro.take(index, rows.replace(features=features))
          return policy_loss(lora.join(trained, constants), graphdef, inputs, config, settings.temperature,
                             settings.on_policy, packed)
        if tower_trains:
          return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(trained, rows.features)
        value, grads = jax.value_and_grad(loss, has_aux=True)(trained, rows.features)
        return value, (grads, None)
      return _accumulate(gradients, micro.count)

    loss, metrics, (grads, feature_grads) = _over_replicas(accumulate, trained, minibatch, micro)
    if tower is not None:  # a frozen tower's gradient is zero
      tower_grads = pullback(feature_grads)[0] if tower_trains else jax.tree.map(jnp.zeros_like, tower)
      grads = lora.join(grads, tower_grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    step_updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, step_updates)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    carry = (keep(new_params, params), keep(new_opt_state, opt_state),
             updates + finite.astype(jnp.int32), jnp.where(finite, 0, skips + 1))
    metrics = dict(metrics, **micro.metrics(), loss=loss, grad_norm=grad_norm, lr=schedule(updates),
                   nonfinite=(~finite).astype(jnp.float32))
    return carry, metrics

  carry = (state.params, state.opt_state, state.updates, state.skips)
  (params, opt_state, updates, skips), metrics = jax.lax.scan(minibatch_update, carry, (orders, owners))
  # The mismatch, measured on the sampler's parameters: on-policy by the loss on its one mini-batch,
  # else here from pi_old's log-probs of the whole batch.
  by_lag = [name for name in metrics if name.startswith(('lag_tokens/', 'lag_gap/'))]
  if settings.on_policy:
    mismatch = {name: metrics[name][0] for name in (*MISMATCH, *by_lag)}
  else:
    mismatch = sampler_mismatch(rows.old_log_probs, batch.sampler_log_probs, batch.mask,
                                algo.aggregation_weights(batch.mask, 'token-mean'))
    if batch.lags is not None:
      mismatch.update(mismatch_by_lag(rows.old_log_probs, batch.sampler_log_probs, batch.mask, batch.lags,
                                      config.max_lag))
  metrics = dict(jax.tree.map(jnp.mean, metrics), **mismatch)
  if batch.lags is not None:
    metrics = lag_means(metrics, config.max_lag)
  metrics.update(distilled)
  metrics['nonfinite'] = metrics['nonfinite'] * orders.shape[0]  # count, not mean
  if 'packed_tokens' in metrics:  # a pass's, its mini-batches' sum, beside sequence_tokens
    metrics['packed_tokens'] = metrics['packed_tokens'] * config.num_minibatches
  real = jnp.sum(batch.segment_ids != 0)
  metrics.update(sequence_tokens=real.astype(jnp.float32),
                 padding_frac=1.0 - real / jnp.float32(batch.segment_ids.size))
  new_state = state.replace(params=params, opt_state=opt_state, key=key, updates=updates, skips=skips)
  return new_state, metrics
