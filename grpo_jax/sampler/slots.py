"""Decode slots: how a request enters one, and the one loop that runs groups of requests through them.

`admit(state, slots, entry)` is the only place a request takes a decode slot, on every sampling
path: GRPO groups and the pool of partial rollouts (inside their decode loop, below), the
inference server's first and continued turns (agents/inference.py) and the JetStream engine's
insert (serve/engine.py). It sets what decode_step reads for the row (the hidden state to sample from,
the request's key, tokens already emitted, its budget and stop ids, the shared prompt it reads)
and writes the row's own cache. A slot forgets its last occupant here and nowhere else: every
cache entry of the row past the ones the entering request brings, or keeps for a continued turn,
is marked empty (segment 0), so attention never reads what an earlier request left there.

`GroupLoop` is the slot loop of group sampling, written once for the on-policy group sampler
(rollout.sample_groups) and the pool (pool.advance): R requests in n groups of the mesh, each
group's B / n slots serving only its own requests, a freed slot taking the group's next waiting
request at the top of each iteration, each emitted token written to its request's row. The object
holds what stays fixed through one loop (the model, the decode settings, the prompts, the
requests' keys and queue); the loop's state is a typed record, LoopState (iterations run, the slots'
DecodeState, the request each slot holds, the requests each group has let in, the decoded rows),
and each part of the loop is a method from state to state:

  loop.idle(decoded)          the state before the loop: no slot holding a request
  loop.insert(state)          every free slot takes its group's next waiting request (via `admit`)
  loop.step(state, view)      insert, one decode_step over every slot, each token to its request's row
  loop.run(state, enough)     step until nothing is live or waiting, or every group has `enough`
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from grpo_jax.model.moe import unrecorded, unrecorded_id
from grpo_jax.model.cache import KVCache, SharedPrefix, each
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.vision import Vision
from grpo_jax.records import along, fields_along, map_along
from grpo_jax.sampler.decode import DecodeSettings, DecodeState, Emitted, decode_step, prefill
from grpo_jax.sampler.layout import PREFILL_RULES
from grpo_jax.sharding import auto_shape, axis_rules, constrain, grouped


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Entry:
  """R requests entering decode slots, one row each.

  hidden:     [R, D] final-norm hidden state of the request's last context token.
  keys:       [R] typed PRNG keys (token n draws from fold_in(key, n)).
  empty:      [R] bool, no context to continue: the request finishes at once, with no tokens.
  generated:  [R] int32 tokens the request emitted before (an answer resumed in the pool); None: 0.
  cache:      KVCache rows [L, R, W, K, H] the request brings into its slot's row (a prefilled
              context, or the tokens after a kept cache), `length` [R] the row's length after
              them; None: none (the prompt is read from a SharedPrefix).
  start:      [R] int32 where those W entries go in the row: the kept cache's length for a
              continued turn (the row's entries before it stay); None: 0, a new occupant.
  prompt:     [R] int32 the shared prompt each request reads (SharedPrefix.index); None: no
              shared prompts.
  limit:      [R] int32 token budget; stops: [R, M] int32 stop ids (-1 padded); None: the
              settings' (the state then carries neither).
  offsets:    [R] int32 the M-RoPE position offset of the request's prompt (images); None: none.
  """

  hidden: jax.Array
  keys: jax.Array
  empty: jax.Array
  generated: jax.Array | None = None
  cache: KVCache | None = None
  start: jax.Array | None = None
  prompt: jax.Array | None = None
  limit: jax.Array | None = None
  stops: jax.Array | None = None
  offsets: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Slots:
  """Which of the B slots the entering requests take.

  mask:   [B] bool, the entry laid out per slot (R = B): a select, elementwise, so slots split over
          the batch axes stay on their devices (inside the decode loops).
  index:  [R] int32 the slot of each request; B or more: none (a padding row, dropped).
  """

  mask: jax.Array | None = None
  index: jax.Array | None = None

  def put(self, target: jax.Array, values: jax.Array, axis: int = 0) -> jax.Array:
    """target [..., B, ...] with the entering rows' values [..., R, ...] written along `axis`."""
    values = values if values.dtype == target.dtype else values.astype(target.dtype)
    if self.mask is not None:
      where = self.mask.reshape((1,) * axis + self.mask.shape + (1,) * (target.ndim - axis - 1))
      return jnp.where(where, values, target)
    return target.at[(slice(None),) * axis + (self.index,)].set(values, mode='drop')

  def get(self, source: jax.Array) -> jax.Array:
    """The entering rows' current values [R, ...] of source [B, ...]."""
    return source if self.mask is not None else jnp.take(source, self.index, axis=0, mode='clip')


def _row_cache(cache: KVCache, slots: Slots, entry: Entry) -> KVCache:
  """The slots' cache rows: kept before `start`, the entry's W entries from there, empty after."""
  rows, length = entry.hidden.shape[0], cache.max_length
  start = jnp.zeros((rows,), jnp.int32) if entry.start is None else entry.start
  offset = jnp.arange(length)[None, :] - start[:, None]  # [R, S] position relative to the entry
  kept = jnp.where(offset < 0, slots.get(cache.segment_ids), 0)
  window = cache.window
  if window is not None and (entry.start is not None or (entry.cache is not None and slots.mask is None)):
    raise ValueError('a cache whose sliding layers keep a window ring takes requests from slot 0, or whole rows')
  if entry.cache is None:
    if window is not None:  # the earlier request's entries leave the ring
      window = dataclasses.replace(window, segment_ids=slots.put(window.segment_ids, jnp.zeros((rows, window.size),
                                                                                               jnp.int32)))
    return dataclasses.replace(cache, segment_ids=slots.put(cache.segment_ids, kept), length=slots.put(cache.length, start),
                               window=window)
  width = entry.cache.max_length
  brought = jnp.take_along_axis(entry.cache.segment_ids, jnp.clip(offset, 0, width - 1), axis=1)
  segment_ids = jnp.where((offset >= 0) & (offset < width), brought, kept)
  if slots.mask is not None and (width != length or entry.start is not None):
    raise ValueError(f'a masked admission brings whole cache rows ({length} entries from 0), got {width}')
  positions = start[:, None] + jnp.arange(width)  # [R, W]

  def put_array(target, values):  # target [..., B, S, K, H]: a stack or one layer's; values [..., R, W, K, H]
    axis = target.ndim - 4
    if slots.mask is not None:  # rows laid out per slot: whole rows
      return slots.put(target, values, axis=axis)
    return target.at[(slice(None),) * axis + (slots.index[:, None], positions)].set(values.astype(target.dtype),
                                                                                    mode='drop')

  def put(target, values):  # an 8-bit cache's values and scales alike (model/cache.py)
    return each(put_array, target, values)

  def layers(target, values):  # each layer of a layered cache takes its own layer of the entry's
    if isinstance(target, tuple):
      return tuple(put(part, values[index]) for index, part in enumerate(target))
    return put(target, values)

  if window is not None:  # whole rows (a masked admission)
    brought = entry.cache.window
    window = dataclasses.replace(window, k=layers(window.k, brought.k), v=layers(window.v, brought.v),
                                 segment_ids=slots.put(window.segment_ids, brought.segment_ids),
                                 ordinals=slots.put(window.ordinals, brought.ordinals))
  return KVCache(k=layers(cache.k, entry.cache.k), v=layers(cache.v, entry.cache.v),
                 segment_ids=slots.put(cache.segment_ids, segment_ids),
                 length=slots.put(cache.length, entry.cache.length), window=window)


def admit(state: DecodeState, slots: Slots, entry: Entry) -> DecodeState:
  """The requests of `entry` into their slots of `state` (module docstring). Traceable."""
  put = slots.put
  generated = jnp.zeros(entry.empty.shape, jnp.int32) if entry.generated is None else entry.generated
  changes = dict(cache=_row_cache(state.cache, slots, entry), hidden=put(state.hidden, entry.hidden),
                 keys=put(state.keys, entry.keys), generated=put(state.generated, generated),
                 live=put(state.live, ~entry.empty))
  if entry.prompt is not None:
    index = state.prefix.index
    changes['prefix'] = dataclasses.replace(state.prefix, index=put(index.reshape(-1), entry.prompt).reshape(index.shape))
  for name in ('limit', 'stops', 'offsets'):
    if getattr(entry, name) is not None:
      changes[name] = put(getattr(state, name), getattr(entry, name))
  return dataclasses.replace(state, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Decoded:
  """What R requests in n groups of the mesh have decoded (Rg = R / n each), N = max_new_tokens.

  tokens:     [n, Rg, N] int32; pad after each request's tokens.
  log_probs:  [n, Rg, N] fp32 the sampler's log-prob of each token.
  versions:   [n, Rg, N] int32 the policy version that sampled each token, -1 after them; None:
              not recorded (every token is the current version's).
  lengths:    [n, Rg] int32; stopped: [n, Rg] bool, ended with a stop id; done: [n, Rg] bool.
  routes:     [n, Rg, N, Ls, k] the experts each token was routed to (settings.record_routes; MoE),
              `unrecorded` where none; None: not recorded.
  A field along 'token' holds one entry per token, one along 'request' one per request: the
  loop writes each emitted token's fields (decode.Emitted's of the same name) into them. Each
  field's `start` is what a request holds there before its first token ('pad': the pad id,
  'unrecorded': no expert).
  """

  tokens: jax.Array = along('token', metadata={'start': 'pad'})
  log_probs: jax.Array = along('token', metadata={'start': 0.0})
  versions: jax.Array | None = along('token', metadata={'start': -1})
  lengths: jax.Array = along('request', metadata={'start': 0})
  stopped: jax.Array = along('request', metadata={'start': False})
  done: jax.Array = along('request', metadata={'start': False})
  routes: jax.Array | None = along('token', default=None, metadata={'start': 'unrecorded'})

  @classmethod
  def empty(cls, groups: int, requests: int, settings: DecodeSettings, versions: bool,
            model: Qwen2 | None = None) -> 'Decoded':
    """No tokens yet; `model` (a mixture of experts) sizes the routes when settings.record_routes."""
    shape = (groups, requests, settings.max_new_tokens)
    routes = None
    if settings.record_routes:
      c = model.config
      routes = unrecorded(shape + (c.num_sparse_layers, c.num_experts_per_tok), c.num_experts)
    return cls(tokens=jnp.full(shape, settings.pad_id, jnp.int32), log_probs=jnp.zeros(shape, jnp.float32),
               versions=jnp.full(shape, -1, jnp.int32) if versions else None,
               lengths=jnp.zeros(shape[:2], jnp.int32), stopped=jnp.zeros(shape[:2], bool),
               done=jnp.zeros(shape[:2], bool), routes=routes)

  def restarted(self, reset: jax.Array, pad_id: int) -> 'Decoded':
    """The requests where `reset` (the requests' shape, e.g. [n, Rg]) start again, each field back
    to its `start`: no tokens, not done. The others as they are."""
    changes = {}
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is not None:
        start = field.metadata['start']
        start = pad_id if start == 'pad' else unrecorded_id(value.dtype) if start == 'unrecorded' else start
        where = reset.reshape(reset.shape + (1,) * (value.ndim - reset.ndim))
        changes[field.name] = jnp.where(where, jnp.asarray(start, value.dtype), value)
    return dataclasses.replace(self, **changes)


def gather(values: jax.Array, index: jax.Array) -> jax.Array:
  """values [n, M, ...], index [n, K] -> [n, K, ...] within each group."""
  return jax.vmap(lambda v, i: v[i])(values, index)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompts:
  """P prompts prefilled once for every request of their groups, split into n groups of the mesh.

  shared:  SharedPrefix [L, n, Pn, W, K, H] (its `index` [n, Bn], the prompt each slot reads).
  hidden:  [n, Pn, D] the hidden state each prompt's first token is sampled from.
  empty:   [n, Pn] bool, the prompt has no real token.
  routes:  [n, Pn, W, Ls, k] the experts each prompt token was routed to, or None (not recorded).
  offsets: [n, Pn] int32 each prompt's M-RoPE position offset (prompts with images), or None.
  """

  shared: SharedPrefix
  hidden: jax.Array = along('prompt')
  empty: jax.Array = along('prompt')
  routes: jax.Array | None = along('prompt', default=None)
  offsets: jax.Array | None = along('prompt', default=None)

  def request_routes(self, requests: int, group_size: int) -> jax.Array:
    """[n * requests, W, Ls, k]: each of a group's `requests` requests' prompt routes (request r
    reads prompt r // group_size of its group)."""
    groups = self.routes.shape[0]
    index = jnp.broadcast_to(jnp.arange(requests, dtype=jnp.int32) // group_size, (groups, requests))
    picked = gather(self.routes, index)
    return picked.reshape((-1,) + picked.shape[2:])


def prefill_prompts(model: Qwen2, prompts: jax.Array, prompt_mask: jax.Array, groups: int, slots: int,
                    group_size: int, record_routes: bool = False, vision: Vision | None = None) -> Prompts:
  """Prompts [P, Tp] (prompt_mask 1 on real tokens) prefilled into their shared cache, for
  `slots` decode slots split into `groups`, each prompt read by at most `group_size` requests at
  a time (SharedPrefix.readers); record_routes: keep their tokens' experts; vision: their images
  (each prompt's run through the vision tower once, here). On a sampler mesh with a context axis
  (rollout.prefill_context) the prompts are prefilled split along their length over it
  (layout.PREFILL_RULES: model.extend's ring attention), and their cache then moves to the rows'
  groups, where decoding reads it. Traceable."""
  count, width = prompts.shape

  def run():
    return prefill(model, prompts, prompt_mask.astype(jnp.int32), model.init_cache(count, width),
                   record_routes=record_routes, vision=vision)
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and auto_shape(mesh).get('context', 1) > 1:
    with axis_rules(PREFILL_RULES):
      done = run()
    axes = ('layers', 'batch', 'cache_seq', 'kv_heads' if model.config.grouped_attention else None, 'head_dim')
    moved = lambda x: each(lambda a: constrain(a, axes), x)  # noqa: E731
    done = dataclasses.replace(done, cache=dataclasses.replace(done.cache, k=moved(done.cache.k), v=moved(done.cache.v)))
  else:
    done = run()
  layers = done.cache.k.shape[0]
  split = lambda x: each(lambda a: a.reshape((layers, groups, count // groups) + a.shape[2:]), x)  # noqa: E731
  shared = SharedPrefix(k=split(done.cache.k), v=split(done.cache.v),
                        segment_ids=grouped(done.cache.segment_ids, groups),
                        index=jnp.zeros((groups, slots // groups), jnp.int32), readers=group_size)
  return Prompts(shared=shared, **jax.tree.map(lambda x: grouped(x, groups), fields_along(done, 'prompt')))


def _rows(x: jax.Array) -> jax.Array:
  """x [B, ...] laid out by rows over the batch axes only (GroupLoop.step says why)."""
  return constrain(x, ('batch',) + (None,) * (x.ndim - 1))


def _pinned(state: DecodeState) -> DecodeState:
  """The slots' per-row fields (not their caches) laid out by rows (`_rows`)."""
  return dataclasses.replace(map_along(state, 'slot', _rows),
                             prefix=dataclasses.replace(state.prefix, index=_rows(state.prefix.index)))


def _at_requests(target: jax.Array, request: jax.Array, values: jax.Array, position: jax.Array | None = None,
                 trailing: int = 0) -> jax.Array:
  """target [n, Rg, ...] with values [B] or [n, Bg] (and `trailing` dims after) written at each
  group's `request` [n, Bg] rows (at their token `position` [n, Bg] when given); rows of Rg or
  more are dropped."""
  values = values.reshape(request.shape + values.shape[values.ndim - trailing:])
  if position is None:
    return jax.vmap(lambda t, r, v: t.at[r].set(v, mode='drop'))(target, request, values)
  return jax.vmap(lambda t, r, p, v: t.at[r, p].set(v, mode='drop'))(target, request, position, values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """The group loop's carry: R requests in n groups of the mesh (Rg = R / n each) through B decode
  slots (Bg = B / n each; slot g * Bg + b is slot b of group g).

  count:    int32 scalar, the iterations run.
  slots:    DecodeState of the B slots ([B, ...] rows, reading their prompts from the shared cache).
  holding:  [n, Bg] int32 the request each slot holds (-1: none).
  waiting:  [n] int32 the requests each group has let into a slot from its queue: queue[g, waiting[g]]
            is the next to enter.
  decoded:  Decoded [n, Rg, ...] the requests' rows, each token written as it comes.
  """

  count: jax.Array
  slots: DecodeState
  holding: jax.Array
  waiting: jax.Array
  decoded: Decoded


@dataclasses.dataclass(frozen=True)
class GroupLoop:
  """The slot loop of group sampling (module docstring): what stays fixed through one loop; the
  loop's state is a LoopState, which its methods take and return. Rg and Bg as in LoopState.

  model:       the decoding model (`run` reads its weights in place, Qwen2.loop_view).
  settings:    DecodeSettings.
  prompts:     Prompts the requests read; its shared cache's index [n, Bg] sizes the slots.
  keys:        [n, Rg] each request's key.
  queue:       [n, Rg] int32 each group's waiting requests in the order they take slots, the first
               `queued` [n] of them real.
  group_size:  G: request r of a group reads its prompt r // G.
  version:     int32, written to `decoded.versions` for every token (when it records them).
  """

  model: Qwen2
  settings: DecodeSettings
  prompts: Prompts
  keys: jax.Array
  queue: jax.Array
  queued: jax.Array
  group_size: int
  version: jax.Array | None = None

  @property
  def groups(self) -> int:
    """n, the groups of the mesh."""
    return self.queue.shape[0]

  @property
  def group_requests(self) -> int:
    """Rg, the requests of each group."""
    return self.queue.shape[1]

  @property
  def group_slots(self) -> int:
    """Bg, the slots of each group."""
    return self.prompts.shared.index.shape[1]

  def _flat(self, x: jax.Array) -> jax.Array:
    """[n, Bg, ...] -> [B, ...]."""
    return x.reshape((self.groups * self.group_slots,) + x.shape[2:])

  def idle(self, decoded: Decoded) -> LoopState:
    """No slot holding a request, none let in yet; `decoded` the requests' rows to write to
    (Decoded.empty, or the pool's requests with their earlier tokens)."""
    prompts = self.prompts
    slots = DecodeState.idle(self.model, self.groups * self.group_slots, self.settings.max_new_tokens,
                             dtype=prompts.hidden.dtype, prefix=prompts.shared, offsets=prompts.offsets is not None,
                             windowed=True)
    return LoopState(count=jnp.int32(0), slots=slots, holding=jnp.full((self.groups, self.group_slots), -1, jnp.int32),
                     waiting=jnp.zeros((self.groups,), jnp.int32), decoded=decoded)

  def insert(self, state: LoopState) -> LoopState:
    """Every free slot takes the next waiting request of its group, in queue order (through `admit`)."""
    prompts, flat = self.prompts, self._flat
    free = ~state.slots.live.reshape(self.groups, self.group_slots)
    position = state.waiting[:, None] + jnp.cumsum(free, axis=1, dtype=jnp.int32) - 1
    taken = free & (position < self.queued[:, None])
    holding = jnp.where(taken, gather(self.queue, jnp.clip(position, 0, self.group_requests - 1)), state.holding)
    request = jnp.maximum(holding, 0)
    prompt = request // self.group_size
    empty = gather(prompts.empty, prompt)
    slots = admit(state.slots, Slots(mask=flat(taken)),
                  Entry(hidden=flat(gather(prompts.hidden, prompt)), keys=flat(gather(self.keys, request)),
                        empty=flat(empty), prompt=flat(prompt),
                        offsets=jax.tree.map(lambda x: flat(gather(x, prompt)), prompts.offsets)))
    # A request of an empty prompt finishes at once, with no tokens.
    done = _at_requests(state.decoded.done, jnp.where(taken & empty, holding, self.group_requests),
                        jnp.ones_like(taken))
    return dataclasses.replace(state, slots=slots, holding=holding,
                               waiting=state.waiting + jnp.sum(taken, axis=1, dtype=jnp.int32),
                               decoded=dataclasses.replace(state.decoded, done=done))

  def write(self, decoded: Decoded, holding: jax.Array, emitted: Emitted, live: jax.Array) -> Decoded:
    """Each token the slots `emitted` into its request's row (holding [n, Bg]), at the request's token
    index; live [B]: the slots still live after it (a request whose slot is not is done)."""
    valid = emitted.valid.reshape(holding.shape)
    request = jnp.where(valid, holding, self.group_requests)  # out of range: dropped
    position = emitted.lengths.reshape(holding.shape) - 1
    ended = valid & ~live.reshape(holding.shape)
    # What each slot's token brings, by the name of the field it goes to: the decode step's, the
    # version that sampled it (when the requests record versions), and whether it was the request's
    # last (`done`: a slot emits only while its request is not done).
    values = {field.name: getattr(emitted, field.name) for field in dataclasses.fields(emitted)}
    values['done'] = ended.reshape(-1)
    if decoded.versions is not None:
      values['versions'] = jnp.broadcast_to(jnp.asarray(self.version, jnp.int32), emitted.valid.shape)
    decoded = map_along(decoded, 'token', lambda target, value: _at_requests(target, request, value, position,
                                                                              trailing=value.ndim - 1), values)
    return map_along(decoded, 'request', lambda target, value: _at_requests(target, request, value), values)

  def step(self, state: LoopState, view: tuple) -> LoopState:
    """One iteration: free slots take waiting requests (`insert`), every slot decodes one token
    (decode_step) and each token is written to its request's row (`write`). view: `run`'s
    (pieces, rebuild) of the weights and of the prompts' keys and values, rebuilt here in the body."""
    pieces, rebuild, prompt_pieces, prompt_rebuild = view
    state = self.insert(state)
    # The slots stay by rows over the batch axes only: left to propagation they can also split
    # over 'tensor', and every prompt cache the slots gather would then cross devices at each token
    # (an all-to-all per layer per decoded token).
    slots, holding = _pinned(state.slots), _rows(state.holding)
    carried = slots.prefix  # its keys and values pass through the loop unchanged
    k, v = prompt_rebuild(prompt_pieces)
    slots = dataclasses.replace(slots, prefix=dataclasses.replace(carried, k=k, v=v))
    slots, emitted = decode_step(rebuild(pieces), slots, self.settings)
    slots = dataclasses.replace(slots, prefix=dataclasses.replace(slots.prefix, k=carried.k, v=carried.v))
    return LoopState(count=state.count + 1, slots=slots, holding=holding, waiting=state.waiting,
                     decoded=self.write(state.decoded, holding, emitted, slots.live))

  def going(self, state: LoopState, enough: Callable[[Decoded], jax.Array] | None = None) -> jax.Array:
    """Whether a slot is live or a request waits, and (with `enough`) a group still needs more."""
    going = jnp.any(state.slots.live) | jnp.any(state.waiting < self.queued)
    return going if enough is None else going & jnp.any(~enough(state.decoded))

  def run(self, state: LoopState, enough: Callable[[Decoded], jax.Array] | None = None) -> LoopState:
    """`step` from `state` until no slot is live and no request waits, or `enough`: decoded -> [n]
    bool, each group has what it needs (the loop stops when all have). Traceable."""
    pieces, rebuild = self.model.loop_view()  # the weights as the loop's matmuls read them in place
    # The prompts' keys and values likewise, cut per layer when the loop's layers are unrolled: a
    # layer's slice of the carried [L, ...] stack is copied every step on XLA:GPU.
    prompt_pieces, prompt_rebuild = self.model.layer_view((state.slots.prefix.k, state.slots.prefix.v))
    view = (pieces, rebuild, prompt_pieces, prompt_rebuild)
    with jax.named_scope('decode_loop'):  # the plan counts this loop's traffic per iteration (plan/traffic.py)
      return jax.lax.while_loop(functools.partial(self.going, enough=enough), functools.partial(self.step, view=view),
                                state)
