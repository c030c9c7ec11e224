"""Partial rollouts: prompt groups that stay in flight across RL steps, under a bound on their lag.

With `algo.max_lag` L > 0 the sampler keeps a pool of Q = (L + 1) * P prompt groups (a `Pool`, part
of the TrainState, so checkpoints hold it). Each RL step at policy version v (the RL steps done):

  1. `fill`: the step's P new prompts take the pool's free entries (L * P more at the run's start).
  2. Every entry's prompt is prefilled once with the current weights into a shared prompt cache (as
     rollout.sample_groups does), and each request cut off mid-answer when the last step ended is
     prefilled again with its tokens so far: it goes on under the new weights (the in-flight
     update). Only tokens carry over, never a KV cache, so the pool stays small and a resumed run
     continues exactly as an uninterrupted one.
  3. The slot loop (slots.GroupLoop) decodes through B slots, a freed slot taking the oldest waiting request,
     until at least P groups are complete and every group that entered at version v - L or
     earlier is complete. The newer groups' requests keep the slots busy meanwhile.
  4. The P oldest complete groups leave the pool for the update; everything else carries over.

Every token records the version that sampled it; the update treats the sampler's log-probs as the
behaviour policy (the truncated importance weight pi_old / pi_sampler, algo.tis_cap).

The lag bound holds by construction ('wait'): by step v, (L + 1) * P + (v - L) * P groups have
entered at version v - L or earlier and v * P have left, so at most P of them remain; step 3 waits
for them and step 4 takes them first. Every group left afterwards entered after v - L, so its
tokens are at most L versions old when it is trained. With `algo.stale_groups: regenerate` the step
waits only for P complete groups, and a remaining group whose oldest token would be more than L
versions old at the next step starts again from its prompt (counted in `groups_regenerated`).

On a mesh the entries, requests and slots are split into n groups over the batch axes, as in
sample_groups, and each group of the mesh keeps its own part of the pool: P / n of its entries
are taken per step, so its prompt cache never crosses devices.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.model.cache import each
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.moe import unrecorded
from grpo_jax.model.qwen2 import Qwen2, SharedPrefix
from grpo_jax.records import along, fields_along, map_along, names_along
from grpo_jax.sampler.decode import DecodeSettings, typed_key
from grpo_jax.sampler.layout import RolloutLayout, run_resident
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.sampler.slots import Decoded, Entry, GroupLoop, Slots, admit, gather, prefill_prompts
from grpo_jax.sharding import batch_groups, constrain, grouped

_LAST = jnp.iinfo(jnp.int32).max  # sorts after every real rank


@dataclasses.dataclass(frozen=True)
class PoolSettings:
  """A run's pool, derived once from its config (build.pool_settings).

  take:        P, the groups that leave the pool each step (the step's new prompts).
  group_size:  G.
  lag:         L, the pool's own bound on a group's lag: algo.max_lag, one fewer with split devices
               (their sampler runs one version behind the trainer).
  decode:      the sampler's static settings.
  slots:       B, the decode slots.
  regenerate:  algo.stale_groups is 'regenerate'.
  priming:     batches of P prompts a fresh pool takes before the first step: algo.max_lag (with
               split devices one more than `lag`: the first advance runs before the first update).
  """

  take: int
  group_size: int
  lag: int
  decode: DecodeSettings
  slots: int
  regenerate: bool
  priming: int

  @property
  def entries(self) -> int:
    """Q = (L + 1) * P entries: the pool's size."""
    return (self.lag + 1) * self.take

  def advance(self, version) -> dict:
    """`advance`'s keyword arguments at policy version `version`."""
    return dict(version=version, take=self.take, group_size=self.group_size, settings=self.decode, slots=self.slots,
                max_lag=self.lag, regenerate=self.regenerate)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pool:
  """Q prompt groups in flight between RL steps; R = Q * G requests (request q * G + g is sample g
  of entry q), N = max_new_tokens.

  prompt_tokens:  [Q, Tp] int32 the entry's prompt, left-padded.
  prompt_mask:    [Q, Tp] int32, 1 on real prompt tokens.
  answers:        the task's answers per entry, [Q, ...] (a jittable task's arrays); None for a
                  host task, whose answers rl/step.py keeps on the host by `source`.
  entered:        [Q] int32 the policy version when the prompt entered; -1: a free entry.
  source:         [Q] int32 the prompt's data position (prompts the run consumed before it).
  batch_position: [Q] int32 the data position of the batch it came in ...
  batch_key:      [Q, 2] uint32 ... and that batch's prompt key: its prompts can be drawn again.
  keys:           [Q, 2] uint32 the entry's sampling key; request g draws from fold_in(key, g).
  tokens:         [R, N] int32 the tokens sampled so far; pad after them.
  log_probs:      [R, N] fp32 the sampler's log-prob of each (the behaviour policy's).
  versions:       [R, N] int32 the policy version that sampled each token; -1 after them.
  lengths:        [R] int32 tokens sampled so far.
  stopped:        [R] bool, ended with a stop token.
  done:           [R] bool, finished (stop token or max_new_tokens).
  routes:         [R, N, Ls, k] the experts each sampled token was routed to, recorded when it was
                  sampled (with its log-prob: a resumed answer keeps its older routes); `unrecorded`
                  after them. None: not recorded (a dense model, or no routing replay).
  vision:         the entry's images and M-RoPE positions (model/vision.py Vision, [Q, ...]), or None
                  (text prompts). Its images run through the vision tower again at every step's
                  prefill of the entries, as the prompts' tokens do: the features are not kept.

  Fields along 'entry' lead with the Q entries; along 'token' and 'request' with the R requests,
  the decoded requests' (slots.Decoded) of the same names.
  """

  prompt_tokens: jax.Array = along('entry')
  prompt_mask: jax.Array = along('entry')
  answers: object = along('entry')
  entered: jax.Array = along('entry')
  source: jax.Array = along('entry')
  batch_position: jax.Array = along('entry')
  batch_key: jax.Array = along('entry')
  keys: jax.Array = along('entry')
  tokens: jax.Array = along('token')
  log_probs: jax.Array = along('token')
  versions: jax.Array = along('token')
  lengths: jax.Array = along('request')
  stopped: jax.Array = along('request')
  done: jax.Array = along('request')
  routes: jax.Array | None = along('token', default=None)
  vision: object = along('entry', default=None)

  @property
  def requests(self) -> Decoded:
    """The requests' rows as the slot loop decodes them."""
    return Decoded(**fields_along(self, 'token'), **fields_along(self, 'request'))

  def with_requests(self, decoded: Decoded) -> 'Pool':
    """The pool with the requests' rows `decoded`."""
    return dataclasses.replace(self, **fields_along(decoded, 'token'), **fields_along(decoded, 'request'))

  @property
  def entries(self) -> int:
    return self.entered.shape[0]


def empty_pool(entries: int, group_size: int, prompt_length: int, settings: DecodeSettings, answers=None,
               architecture: Qwen2Config | None = None, vision=None) -> Pool:
  """A pool of `entries` free entries. answers: one batch's answers (arrays or ShapeDtypeStructs
  [P, ...]) of a jittable task, whose per-entry arrays the pool then holds; None for a host task.
  architecture: the model's, which sizes the routes when settings.record_routes. vision: one
  batch's Vision (arrays or shapes) when the prompts carry images."""
  requests, steps = entries * group_size, settings.max_new_tokens
  routes = None
  if settings.record_routes:
    c = architecture
    routes = unrecorded((requests, steps, c.num_sparse_layers, c.num_experts_per_tok), c.num_experts)
  zeros = lambda shape, dtype=jnp.int32: jnp.zeros(shape, dtype)  # noqa: E731
  # One batch's arrays (or shapes) -> zeros for every entry.
  per_entry = lambda x: jnp.zeros((entries,) + tuple(x.shape[1:]), x.dtype)  # noqa: E731
  return Pool(prompt_tokens=jnp.full((entries, prompt_length), settings.pad_id, jnp.int32),
              prompt_mask=zeros((entries, prompt_length)),
              answers=jax.tree.map(per_entry, answers),
              entered=jnp.full((entries,), -1, jnp.int32), source=zeros((entries,)),
              batch_position=zeros((entries,)), batch_key=zeros((entries, 2), jnp.uint32),
              keys=zeros((entries, 2), jnp.uint32),
              tokens=jnp.full((requests, steps), settings.pad_id, jnp.int32),
              log_probs=zeros((requests, steps), jnp.float32), versions=jnp.full((requests, steps), -1, jnp.int32),
              lengths=zeros((requests,)), stopped=zeros((requests,), bool), done=zeros((requests,), bool),
              routes=routes, vision=jax.tree.map(per_entry, vision))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Taken:
  """The P groups a step trains on, oldest first within each group of the mesh.

  rollout:        Rollout [P*G, N] with `versions` set (and `decode_steps`: this step's loop).
  prompt_tokens:  [P, Tp]; prompt_mask [P, Tp]; answers [P, ...] (None for a host task).
  source, batch_position: [P] int32; batch_key [P, 2] uint32: where each prompt came from.
  vision:         the prompts' images and positions [P, ...], or None.
  metrics:        groups_regenerated, carried_requests (started, unfinished), carried_groups
                  (entries left in the pool), decoded_tokens and slot_occupancy (this step's loop);
                  the update reports the lags (rl/loss.lag_means).
  """

  rollout: Rollout
  prompt_tokens: jax.Array = along('entry')  # the fields along 'entry': the taken entries' Pool fields
  prompt_mask: jax.Array = along('entry')
  answers: object = along('entry')
  source: jax.Array = along('entry')
  batch_position: jax.Array = along('entry')
  batch_key: jax.Array = along('entry')
  metrics: dict = dataclasses.field(default_factory=dict)
  vision: object = along('entry', default=None)


def _group_view(pool: Pool, groups: int) -> Pool:
  return jax.tree.map(lambda x: grouped(x, groups), pool)


def _flat_view(pool: Pool) -> Pool:
  return jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), pool)


def _reset_requests(pool: Pool, reset: jax.Array, pad_id: int) -> Pool:
  """Requests where `reset` [n, Rg] start again: no tokens, not done (Decoded.restarted)."""
  return pool.with_requests(pool.requests.restarted(reset, pad_id))


def fill(pool: Pool, prompt_tokens: jax.Array, prompt_mask: jax.Array, answers, *, version, key: jax.Array,
         position, prompt_key: jax.Array, group_size: int, pad_id: int, vision=None) -> Pool:
  """The P prompts [P, Tp] into the pool's first free entries (in each group of the mesh, its own
  P / n prompts). Entry q filled by new prompt p samples from fold_in(key, p); `position`: the
  batch's data position, `prompt_key`: the key it was drawn with; vision: the prompts' images.
  Traceable."""
  count = prompt_tokens.shape[0]
  groups = batch_groups(count, pool.entries)
  per = count // groups
  view = _group_view(pool, groups)
  free = view.entered < 0  # [n, Qg]
  rank = jnp.cumsum(free, axis=1, dtype=jnp.int32) - 1
  take = free & (rank < per)
  src = jnp.clip(rank, 0, per - 1)
  keys = jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(typed_key(key), jnp.arange(count)))
  new = dict(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask.astype(jnp.int32), answers=answers,
             entered=jnp.full((count,), version, jnp.int32), source=position + jnp.arange(count, dtype=jnp.int32),
             batch_position=jnp.full((count,), position, jnp.int32),
             batch_key=jnp.broadcast_to(jax.random.key_data(typed_key(prompt_key)), (count, 2)), keys=keys,
             vision=vision)

  def place(old, incoming):
    incoming = gather(grouped(incoming, groups), src)
    return jnp.where(take.reshape(take.shape + (1,) * (old.ndim - 2)), incoming.astype(old.dtype), old)

  view = map_along(view, 'entry', place, new)
  view = _reset_requests(view, jnp.repeat(take, group_size, axis=1), pad_id)
  return _flat_view(view)


def _entry_rank(entered: jax.Array) -> jax.Array:
  """[n, Qg] each occupied entry's rank by age within its group (older first, then by index)."""
  order = jnp.argsort(jnp.where(entered >= 0, entered, _LAST), axis=1, stable=True)
  return jnp.argsort(order, axis=1).astype(jnp.int32)


def _chunk(steps: int, widest: int = 32) -> int:
  """Tokens per chunk of the answers' prefill: the largest divisor of N up to `widest` (N itself
  when no divisor of 8 or more is)."""
  if steps <= widest:
    return steps
  best = max(d for d in range(1, widest + 1) if steps % d == 0)
  return best if best >= 8 else steps


ANSWER_BLOCKS = 4  # row blocks of the answers' prefill, each run only up to its own longest answer


def _prefill_answers(model: Qwen2, tokens: jax.Array, lengths: jax.Array, shared: SharedPrefix, groups: int,
                     offsets: jax.Array | None = None):
  """Each slot's answer so far, tokens [B, N] (the first `lengths` [B] real), run over its prompt
  in `shared` into a fresh slot cache [L, B, N, K, H]; offsets [B]: its prompt's M-RoPE offset. The slots of each mesh group are taken in
  ANSWER_BLOCKS blocks, and each block runs in chunks only up to its own longest answer: the caller
  puts the longest answers in the first slots, so the many short ones cost little. Returns (cache,
  [B, D] hidden state of each answer's last token); rows of length 0 hold nothing."""
  slots, steps = tokens.shape
  per_slots = slots // groups
  blocks = ANSWER_BLOCKS if per_slots % ANSWER_BLOCKS == 0 else 1
  width, chunk = per_slots // blocks, _chunk(steps)
  grouped_tokens, grouped_lengths = tokens.reshape(groups, per_slots, steps), lengths.reshape(groups, per_slots)
  grouped_offsets = jax.tree.map(lambda x: x.reshape(groups, per_slots), offsets)

  def block(rows: slice):
    block_tokens = grouped_tokens[:, rows].reshape(groups * width, steps)
    block_lengths = grouped_lengths[:, rows].reshape(groups * width)
    block_offsets = jax.tree.map(lambda x: x[:, rows].reshape(groups * width), grouped_offsets)
    prefix = dataclasses.replace(shared, index=shared.index[:, rows])

    def one(carry):
      offset, cache, hidden = carry
      piece = jax.lax.dynamic_slice_in_dim(block_tokens, offset, chunk, axis=1)
      real = ((offset + jnp.arange(chunk))[None, :] < block_lengths[:, None]).astype(jnp.int32)
      out, cache = model.extend(piece, cache, segment_ids=real, return_hidden=True, prefix=prefix,
                                position_offsets=block_offsets)
      last = block_lengths - 1 - offset
      here = (last >= 0) & (last < chunk)
      picked = jnp.take_along_axis(out, jnp.clip(last, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
      return offset + chunk, cache, jnp.where(here[:, None], picked.astype(hidden.dtype), hidden)

    start = (jnp.int32(0), model.init_cache(groups * width, steps, windowed=True),
             jnp.zeros((groups * width, model.config.hidden_size), model.dtype))
    longest = jnp.max(block_lengths)
    _, cache, hidden = jax.lax.while_loop(lambda carry: carry[0] < longest, one, start)
    return cache, hidden

  parts = [block(slice(index * width, (index + 1) * width)) for index in range(blocks)]

  def join_arrays(*arrays, axis):  # the blocks' rows back in slot order, group by group
    arrays = [a.reshape(a.shape[:axis] + (groups, width) + a.shape[axis + 1:]) for a in arrays]
    joined = jnp.concatenate(arrays, axis=axis + 1)
    return joined.reshape(joined.shape[:axis] + (slots,) + joined.shape[axis + 2:])

  def join(arrays, axis):  # of arrays, or of an 8-bit cache's values and scales alike
    return each(lambda *parts: join_arrays(*parts, axis=axis), *arrays)

  caches = [cache for cache, _ in parts]
  # Laid out as a fresh slot cache (model.init_cache): the decode loop's attention then finds the
  # slots' rows where it finds their shared prompts' (a joined layout costs an all-to-all per token).
  axes = ('layers', 'batch', 'cache_seq', 'kv_heads', 'head_dim')
  rows = ('batch', 'cache_seq')
  window = caches[0].window
  if window is not None:
    window = dataclasses.replace(window, k=each(lambda x: constrain(x, axes), join([c.window.k for c in caches], 1)),
                                 v=each(lambda x: constrain(x, axes), join([c.window.v for c in caches], 1)),
                                 segment_ids=constrain(join([c.window.segment_ids for c in caches], 0), rows),
                                 ordinals=constrain(join([c.window.ordinals for c in caches], 0), rows))
  cache = dataclasses.replace(caches[0], k=each(lambda x: constrain(x, axes), join([c.k for c in caches], 1)),
                              v=each(lambda x: constrain(x, axes), join([c.v for c in caches], 1)),
                              segment_ids=constrain(join([c.segment_ids for c in caches], 0), rows),
                              length=lengths, window=window)  # decoding goes on right after each answer
  return cache, join([hidden for _, hidden in parts], 0)


def advance(model: Qwen2, pool: Pool, *, version, take: int, group_size: int, settings: DecodeSettings,
            slots: int, max_lag: int, regenerate: bool) -> tuple[Pool, Taken]:
  """Steps 2-4 of the module docstring on a filled pool: decodes until `take` (P) groups may
  leave, and returns the pool that carries over and the P groups taken. Traceable."""
  entries, prompt_length = pool.prompt_tokens.shape
  requests = entries * group_size
  slots = min(slots or take * group_size, requests)
  groups = batch_groups(take, entries, slots)
  per_entries, per_requests, per_slots, per_take = entries // groups, requests // groups, slots // groups, take // groups
  version = jnp.asarray(version, jnp.int32)

  # The shared prompt cache of every entry, prefilled with the current weights.
  prompts = prefill_prompts(model, pool.prompt_tokens, pool.prompt_mask, groups, slots, group_size,
                            record_routes=settings.record_routes, vision=pool.vision)

  view = _group_view(pool, groups)
  occupied = view.entered >= 0  # [n, Qg]
  entry_of = jnp.arange(per_requests, dtype=jnp.int32) // group_size  # [Rg]
  rank = _entry_rank(view.entered)
  priority = rank[:, entry_of] * group_size + jnp.arange(per_requests, dtype=jnp.int32) % group_size  # [n, Rg]
  occupied_requests = occupied[:, entry_of]
  entry_keys = jax.random.wrap_key_data(view.keys)  # [n, Qg]
  request_keys = jax.vmap(jax.vmap(jax.random.fold_in))(entry_keys[:, entry_of],
                                                         jnp.broadcast_to(jnp.arange(per_requests) % group_size,
                                                                          (groups, per_requests)))

  # Requests cut off mid-answer take the first slots, oldest first; any beyond the slots (fewer
  # slots than when they were cut off) start again.
  partial = occupied_requests & (view.lengths > 0) & ~view.done
  partial_order = jnp.argsort(jnp.where(partial, priority, _LAST), axis=1, stable=True)
  partial_count = jnp.sum(partial, axis=1, dtype=jnp.int32)
  partial_rank = jnp.argsort(partial_order, axis=1)
  view = _reset_requests(view, partial & (partial_rank >= per_slots), settings.pad_id)
  held = jnp.arange(per_slots)[None, :] < jnp.minimum(partial_count, per_slots)[:, None]  # [n, Bg]
  holding = jnp.where(held, partial_order[:, :per_slots], -1).astype(jnp.int32)
  # Longest answers in the first slots (a request's tokens do not depend on its slot): the
  # prefill's row blocks then each stop at their own longest answer.
  by_length = jnp.argsort(-jnp.where(held, gather(view.lengths, jnp.maximum(holding, 0)), 0), axis=1, stable=True)
  holding, held = gather(holding, by_length), gather(held, by_length)

  # The requests not yet started wait for a slot, oldest entry first; the loop starts with the
  # cut-off ones in their slots.
  unstarted = occupied_requests & (view.lengths == 0) & ~view.done
  queue = jnp.argsort(jnp.where(unstarted, priority, _LAST), axis=1, stable=True).astype(jnp.int32)
  loop = GroupLoop(model, settings, prompts, keys=request_keys, queue=queue,
                   queued=jnp.sum(unstarted, axis=1, dtype=jnp.int32), group_size=group_size, version=version)
  start = dataclasses.replace(loop.idle(view.requests), holding=holding)

  # Their tokens so far are prefilled again over their prompts, with the current weights, and
  # they enter their slots with that cache.
  held_rows = jnp.maximum(holding, 0)
  lengths = jnp.where(held, gather(view.lengths, held_rows), 0)
  tokens = jnp.where(held[..., None], gather(view.tokens, held_rows), settings.pad_id)
  flat = lambda x: x.reshape((slots,) + x.shape[2:])  # noqa: E731
  if max_lag:
    reading = dataclasses.replace(prompts.shared, index=entry_of[held_rows])
    offsets = jax.tree.map(lambda x: flat(gather(x, entry_of[held_rows])), prompts.offsets)
    cache, resumed = _prefill_answers(model, flat(tokens), flat(lengths), reading, groups, offsets)
    start = dataclasses.replace(start, slots=admit(
        start.slots, Slots(mask=flat(held)),
        Entry(hidden=resumed, keys=flat(gather(request_keys, held_rows)), empty=jnp.zeros((slots,), bool),
              generated=flat(lengths), cache=cache, prompt=flat(entry_of[held_rows]), offsets=offsets)))
  # else every group entered is taken each step (split devices at L = 1): nothing is ever cut off

  forced = occupied & (view.entered <= version - max_lag) if not regenerate else jnp.zeros_like(occupied)
  started_tokens = jnp.sum(view.lengths)

  def complete(done):
    return occupied & jnp.all(done.reshape(groups, per_entries, group_size), axis=2)

  def enough(decoded: Decoded):
    finished = complete(decoded.done)
    return (jnp.sum(finished, axis=1) >= per_take) & jnp.all(finished | ~forced, axis=1)

  done = loop.run(start, enough)
  count = done.count
  view = view.with_requests(done.decoded)
  decoded_tokens = jnp.sum(view.lengths) - started_tokens

  # The P / n oldest complete entries of each group leave the pool.
  finished = complete(view.done)
  chosen = jnp.argsort(jnp.where(finished, rank, _LAST), axis=1, stable=True)[:, :per_take].astype(jnp.int32)
  rows = (chosen[..., None] * group_size + jnp.arange(group_size)).reshape(groups, per_take * group_size)

  # The taken rows' prompt routes are this step's prefill's (the prompt is prefilled anew every step).
  prompt_routes = None
  if settings.record_routes:
    picked = gather(prompts.routes, jnp.repeat(chosen, group_size, axis=1))
    prompt_routes = picked.reshape((-1,) + picked.shape[2:])
  rollout = Rollout.of(jax.tree.map(lambda x: gather(x, rows), view.requests), count, prompt_routes)
  entry = lambda x: gather(x, chosen).reshape((take,) + x.shape[2:])  # noqa: E731
  prompts = jax.tree.map(entry, {name: getattr(view, name) for name in names_along(Taken, 'entry')})

  # The taken entries are freed; with `regenerate`, a group whose oldest token would be more than
  # L versions old at the next step starts again.
  leaving = jnp.zeros((groups, per_entries), bool)
  leaving = jax.vmap(lambda left, c: left.at[c].set(True))(leaving, chosen)
  view = dataclasses.replace(view, entered=jnp.where(leaving, -1, view.entered))
  view = _reset_requests(view, leaving[:, entry_of], settings.pad_id)
  oldest = jnp.min(jnp.where(view.versions >= 0, view.versions, _LAST).reshape(groups, per_entries, -1), axis=2)
  stale = (view.entered >= 0) & (oldest < version + 1 - max_lag)
  if regenerate:
    view = _reset_requests(view, stale[:, entry_of], settings.pad_id)
  carried = (view.entered >= 0)[:, entry_of]
  metrics = dict(groups_regenerated=jnp.sum(stale) if regenerate else jnp.int32(0),
                 carried_requests=jnp.sum(carried & (view.lengths > 0) & ~view.done),
                 carried_groups=jnp.sum(view.entered >= 0), decoded_tokens=decoded_tokens,
                 slot_occupancy=decoded_tokens / jnp.maximum(count * slots, 1))
  taken = Taken(rollout=rollout, metrics=metrics, **prompts)
  return _flat_view(view), taken


def advance_resident(graphdef, params, pool: Pool, *, layout: RolloutLayout | None, **settings) -> tuple[Pool, Taken]:
  """`advance` from the parameters `params` of `graphdef`, in the sampler's own layout when
  `layout` is given (as rollout.sample_resident): the pool enters it replicated (by rows over the
  sampler's data groups, XLA:TPU needed 41 GiB more per device for the 32B recipe) and comes back
  laid out by rows over the trainer mesh's batch axes. Traceable."""
  return run_resident(graphdef, params, pool, lambda model, pool: advance(model, pool, **settings), layout=layout)


def advance_split(graphdef, resident, pool: Pool, *, layout: RolloutLayout, **settings) -> tuple[Pool, Taken]:
  """`advance` on the sampler's own devices (split devices, rollout.devices): `resident` are the
  weights already there (RolloutLayout.transfer) and the pool lies there by rows. Traceable."""
  with layout.active():
    return advance(nnx.merge(graphdef, resident), pool, **settings)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pipeline:
  """Split devices' state between RL steps, on the sampler's devices: the pool in flight and the
  P groups sampled during the last step (`ready`), which the next step trains on while the sampler
  decodes the step after. Checkpointed with the TrainState, so a resumed run trains the same groups."""

  pool: Pool
  ready: Taken


def empty_pipeline(graphdef, params, pool: Pool, layout: RolloutLayout, settings: PoolSettings) -> Pipeline:
  """Split devices' state between steps before the first one: `pool` (empty) and zeros shaped like
  the groups the sampler's advance makes ready (params: the policy's state, or abstract arrays)."""
  shapes = jax.eval_shape(lambda params, pool: advance_split(graphdef, layout.mirror.place(params), pool, layout=layout,
                                                             **settings.advance(jnp.int32(0))), params, pool)[1]
  return Pipeline(pool=pool, ready=jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
