"""The inference interface agents and environments hold: `await server.generate(request)` over the
live policy, many episodes' requests decoded together in one set of decode slots.

A request is the whole token context of one model turn (the prompt and the conversation so far),
its token budget, its own stop ids and its PRNG key; its result is the new tokens, their sampler
log-probs and a finish reason. Requests queue until a decode slot is free, are prefilled in
batches of one width bucket (8, 12, 16, 24, ...), and decode in chunks of `chunk` steps of the one decode step every
sampling path shares (sampler/decode.py). A request leaves its slot the moment it finishes (a stop
id, its budget): an episode that is waiting on its environment holds no slot, and the other slots
keep decoding. With asyncio, an environment is straight-line code:

    server = InferenceServer(graphdef, settings=..., slots=64, max_context=512)
    server.bind(params)  # before each rollout: leaving `async with` frees the weights and the cache
    async with server:
      answer = await server.generate(Request(tokens=prompt, max_new_tokens=32, key=key))

Determinism: the n-th token of a request is drawn from fold_in(request key, n) (decode.py's PRNG
policy), every prefill of a width bucket and every decode chunk has one shape whatever else is in
flight, so a request's tokens depend on its context, key and the parameters only — not on which
slot it lands in, nor on when its episode's environment answered (up to rounding where it
continues a kept cache, below).

Sampling settings are per server (one compiled decode step): a request may name them, and they
must be the server's.

KV reuse across turns: a finished request's slot keeps its cache (the context and every new token
but the last) until another request needs the slot; free slots holding no kept cache, then the
ones freed longest ago, are taken first. A request that `continues` a completion whose cache is
still kept goes back to that slot and prefills only the tokens after it (the last new token and
the environment's answer), attending over the kept cache. Its tokens can then differ from a
whole-context prefill's by rounding (the kept keys and values were computed one decode step at a
time), as with any prefix cache; `reuse=False` turns it off.
"""

import asyncio
import collections
import contextlib
import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.agents.images import check_request_images, prefill_vision
from grpo_jax.errors import UserError
from grpo_jax.model.moe import unrecorded
from grpo_jax.model.token_ids import check_token_ids
from grpo_jax.sampler.decode import DecodeSettings, DecodeState, Emitted, decode_step, prefill, typed_key
from grpo_jax.sampler.sampling import SamplingConfig
from grpo_jax.model.vision import ImageBucket
from grpo_jax.sampler.slots import Entry, Slots, admit

FinishReason = Literal['stop', 'length']
MIN_BUCKET = 8  # the narrowest prefill width; wider ones grow by 1.5x and 4/3 in turn up to max_context
TURN_BLOCK = 16  # keys folded per device call (folded_keys)


def key_data(key) -> np.ndarray:
  """The raw uint32 data of a PRNG key (typed key, its data, or a NumPy copy of it)."""
  if isinstance(key, np.ndarray):
    return key.astype(np.uint32)
  if jnp.issubdtype(getattr(key, 'dtype', np.uint32), jax.dtypes.prng_key):
    return np.asarray(jax.random.key_data(key))
  return np.asarray(key, np.uint32)


@jax.jit
def _fold_range(key, first):
  """Raw key data [TURN_BLOCK, 2] of fold_in(key, first + i): a block of turn keys in one call."""
  return jax.random.key_data(jax.vmap(jax.random.fold_in, (None, 0))(typed_key(key), first + jnp.arange(TURN_BLOCK)))


def folded_keys(key, first: int) -> np.ndarray:
  """fold_in(key, first + i) for i < TURN_BLOCK, as raw key data [TURN_BLOCK, 2] (one device call)."""
  return np.asarray(_fold_range(key, np.int32(first)))


@dataclasses.dataclass(frozen=True)
class Request:
  """One model turn.

  tokens:          the whole context: the prompt and every turn and observation so far.
  max_new_tokens:  the turn's budget (at most the server's max_new_tokens; the context plus the
                   budget must fit the server's max_context).
  key:             the request's PRNG key: typed, or its raw key data (NumPy uint32, as
                   `key_data` gives: no device call per request); its n-th token draws from
                   fold_in(key, n).
  stop_token_ids:  ids that end this request, besides the server's (at most `max_stops` of them).
  sampling:        None: the server's; anything else must equal it.
  continues:       the `cache_id` of an earlier completion this context goes on from (its
                   context, its tokens, then more): the server reuses that completion's KV cache
                   when it still holds it and prefills only what follows; else the whole context.
  images:          the context's images in order, each (patches [n, C*T*P*P], grid (t, h, w),
                   start) (agents/images.Placed; patches and grid as model/images.process_image
                   gives them), standing for the run of image tokens from context position `start`
                   (a vision-language model; the server's `images` bucket bounds them). The image
                   token's id anywhere else is text (a token the policy sampled). A turn runs
                   through the vision tower only the images it prefills (those after a kept
                   cache); every token's M-RoPE position is the whole context's.
  """

  tokens: tuple[int, ...]
  max_new_tokens: int
  key: jax.Array
  stop_token_ids: tuple[int, ...] = ()
  sampling: SamplingConfig | None = None
  continues: int | None = None
  images: tuple = ()


@dataclasses.dataclass(frozen=True)
class Completion:
  """A request's result: its new tokens (the stop id included), their log softmax(logits / T)
  under the sampler, and why it ended ('stop': a stop id, 'length': its budget). `cache_id`
  names the KV cache the server may keep of it (a later request that goes on from it passes it
  as `continues`).

  routes:       with settings.record_routes (a mixture of experts): [n, Ls, k] the experts of the
                tokens this request ran through the model, context positions routes_from ..
                routes_from + n - 1 of `request.tokens + tokens`: the context it prefilled (all
                of it, or what follows a kept cache), then its new tokens, the last of which was
                never fed back (`unrecorded`, moe.unrecorded_id). None otherwise.
  routes_from:  the context position of routes[0].
  """

  tokens: tuple[int, ...]
  log_probs: tuple[float, ...]
  finish_reason: FinishReason
  cache_id: int | None = None
  routes: np.ndarray | None = None
  routes_from: int = 0


@dataclasses.dataclass
class _Pending:
  request: Request
  future: asyncio.Future
  tokens: list = dataclasses.field(default_factory=list)
  log_probs: list = dataclasses.field(default_factory=list)
  routes: list = dataclasses.field(default_factory=list)  # [n, Ls, k] pieces, prefill's then decode's
  routes_from: int = 0


@dataclasses.dataclass
class ServerStats:
  """Work done since the server was made: decode chunks and steps (each over every slot), tokens
  the requests received, prefilled rows (padding rows of a batch included), requests served, those
  that reused a kept cache, and the context tokens prefilled."""

  chunks: int = 0
  decode_steps: int = 0
  tokens: int = 0
  prefill_rows: int = 0
  requests: int = 0
  reused: int = 0  # requests that went on from a kept cache
  prefilled_tokens: int = 0  # context tokens run through a prefill (reused prefixes not counted)


class InferenceServer:
  """Decode slots over a model's graph; `bind(params)` gives it the parameters to sample from
  (the trainer's live ones, once per step); `generate` is the interface.

  settings:     the sampling settings, the server-wide stop ids and pad id, and max_new_tokens (the
                largest budget a request may ask for).
  slots:        B, requests decoded at once.
  max_context:  S, the longest context plus budget of a request (a cache row's length).
  chunk:        the most decode steps per jitted call (a call ends early when every slot is idle):
                the host sees results (and refills slots) between calls. Larger is fewer
                dispatches; smaller lets waiting requests into finished slots sooner.
  prefill_rows: the most requests prefilled per call; a call's rows are padded with empty ones to
                a power of two (so each width bucket compiles a handful of shapes).
  max_stops:    the most per-request stop ids.
  layout:       the sampler's own layout (sampler/layout.py), or None to decode in the parameters'.
  reuse:        keep finished requests' caches for the requests that continue them (above).
  images:       (images, patches) that one prefill row's images are padded to (model/vision.py
                ImageBucket): the server of a vision-language model whose requests hold images
                (their rows then carry M-RoPE offsets); None: text requests.
  """

  def __init__(self, graphdef, *, settings: DecodeSettings, slots: int, max_context: int, chunk: int = 4,
               prefill_rows: int = 64, max_stops: int = 4, layout=None, reuse: bool = True,
               images: ImageBucket | None = None):
    if min(slots, max_context, chunk, prefill_rows) < 1:
      raise UserError(f'inference server: slots, max_context, chunk and prefill_rows must be >= 1, got '
                      f'{slots}, {max_context}, {chunk}, {prefill_rows}')
    self.graphdef, self.settings, self.slots, self.max_context = graphdef, settings, slots, max_context
    self.chunk, self.prefill_rows, self.max_stops, self.layout = chunk, min(prefill_rows, slots), max_stops, layout
    self.stats = ServerStats()
    self._params = None
    self.vocab_size: int | None = None  # valid request ids are [0, vocab_size): the bound model's
    self.architecture = None  # the bound model's config
    self._state: DecodeState | None = None
    self._waiting: collections.deque[_Pending] = collections.deque()
    self._holding: list[_Pending | None] = [None] * slots
    self.reuse, self.images = reuse, images
    self._kept: dict[int, tuple[int, tuple[int, ...]]] = {}  # cache_id -> (slot, the tokens its cache holds)
    self._slot_cache: list[int | None] = [None] * slots  # the cache_id each slot keeps
    self._freed: list[int] = [0] * slots  # when each slot was freed (a counter): the oldest go first
    self._next_id = 0
    self._wake: asyncio.Event | None = None
    self._task: asyncio.Task | None = None
    self._closing = False
    self._init = jax.jit(self._init_state)
    self._prefill = jax.jit(self._prefill_into, donate_argnums=1)
    self._extend = jax.jit(self._extend_into, donate_argnums=1)
    self._decode = jax.jit(self._decode_chunk, donate_argnums=1)
    self._place = jax.jit(layout.place) if layout is not None else None

  # ---- the interface ----

  def bind(self, params) -> None:
    """The parameters the next rollout's decode steps read (the trainer's live ones, laid out once
    into the sampler's own layout when the server has one). Call before each `async with`: leaving
    it frees them, with the slots' cache."""
    if self.vocab_size is None:  # the graph, and so the vocabulary, is the server's for life
      self.architecture = nnx.merge(self.graphdef, params).config
      self.vocab_size = self.architecture.vocab_size
      if self.images is not None and self.architecture.vision is None:
        raise UserError(f'inference server: images of requests need a vision-language model; this one '
                        f'({self.architecture.model_type}) has no vision tower')
    self._params = self._place(params) if self._place is not None else params
    self._forget()  # kept caches were computed with the old parameters

  def _forget(self) -> None:
    self._kept.clear()
    self._slot_cache = [None] * self.slots

  async def generate(self, request: Request) -> Completion:
    """The request's completion, once its tokens are decoded."""
    self._check(request)
    if self._task is None:
      raise UserError('inference server: generate() outside `async with server:`')
    future = asyncio.get_running_loop().create_future()
    self._waiting.append(_Pending(request, future))
    self._wake.set()
    return await future

  async def __aenter__(self) -> 'InferenceServer':
    if self._params is None:
      raise UserError('inference server: bind(params) before serving')
    self._wake, self._closing = asyncio.Event(), False
    self._task = asyncio.create_task(self._serve())
    return self

  async def __aexit__(self, *exc_info) -> None:
    self._closing = True
    self._wake.set()
    task, self._task = self._task, None
    if exc_info[0] is not None:
      task.cancel()
    try:
      await task
    except asyncio.CancelledError:
      pass
    finally:
      # The slots' KV cache (slots x max_context rows) and the resident copy of the weights are
      # freed between rollouts: the update that follows needs the memory.
      self._state, self._params = None, None
      self._forget()

  # ---- the loop ----

  async def _serve(self) -> None:
    try:
      await self._loop()
    except BaseException as error:  # a failed program or a cancelled rollout: no request waits forever
      for pending in [*self._waiting, *filter(None, self._holding)]:
        if not pending.future.done():
          pending.future.set_exception(error if isinstance(error, Exception) else asyncio.CancelledError())
      self._waiting.clear()
      self._holding = [None] * self.slots
      self._forget()
      self._state = None  # rows may still be live on the devices: start afresh
      raise

  async def _loop(self) -> None:
    with self._mesh_context():
      if self._state is None:
        self._state = self._init()
      while True:
        if not self._waiting and not any(self._holding):
          if self._closing:
            return
          self._wake.clear()
          await self._wake.wait()
          continue
        self._fill()
        if any(self._holding):
          self._state, emitted, steps = self._decode(self._params, self._state)
          # Read back in a thread: episodes' environments run while the chunk computes.
          host = await asyncio.to_thread(jax.device_get, (emitted, self._state.live, steps))
          self._collect(*host)
        await asyncio.sleep(0)

  def _mesh_context(self):
    """The mesh the server's programs trace under: the sampler's own, or the parameters'."""
    if self.layout is not None:
      return self.layout.active()
    sharding = getattr(jax.tree.leaves(self._params)[0], 'sharding', None)
    return jax.set_mesh(sharding.mesh) if isinstance(sharding, jax.sharding.NamedSharding) else contextlib.nullcontext()

  def _check(self, request: Request) -> None:
    context, budget = len(request.tokens), request.max_new_tokens
    if request.sampling is not None and request.sampling != self.settings.sampling:
      raise UserError(f'inference request: sampling {request.sampling} differs from the server\'s '
                      f'{self.settings.sampling} (one sampling setting per server)')
    if context < 1:
      raise UserError('inference request: tokens is empty (a request needs a context to continue)')
    if self._params is not None:
      check_token_ids(request.tokens, self.vocab_size, 'inference request tokens')
    if not 1 <= budget <= self.settings.max_new_tokens:
      raise UserError(f'inference request: max_new_tokens {budget} outside [1, {self.settings.max_new_tokens}]')
    if context + budget > self.max_context:
      raise UserError(f'inference request: {context} context tokens + {budget} new exceed the server\'s '
                      f'max_context {self.max_context}')
    if len(request.stop_token_ids) > self.max_stops:
      raise UserError(f'inference request: {len(request.stop_token_ids)} stop ids, at most {self.max_stops}')
    if request.images:
      check_request_images(request.tokens, request.images, self.images, self.architecture)

  def _bucket(self, length: int) -> int:
    """The prefill width of a context: the next of 8, 12, 16, 24, 32, 48, ... (powers of two and
    1.5 times them: at most a third of a prefill is padding), at most max_context."""
    power = 1 << max(3, math.ceil(math.log2(length)))
    width = power * 3 // 4 if power * 3 // 4 >= max(length, MIN_BUCKET) else power
    return min(self.max_context, width)

  def _fill(self) -> None:
    """Prefills waiting requests into free slots, R at a time, each batch of one width bucket:
    requests that continue a kept cache extend it in its slot; the others take the free slots
    holding no kept cache first, then those freed longest ago."""
    free = {slot for slot, held in enumerate(self._holding) if held is None}
    fresh: dict[int, list] = collections.defaultdict(list)  # width -> [(pending, slot, tokens)]
    extend: dict[int, list] = collections.defaultdict(list)
    others = []
    while len(others) < len(free) and self._waiting:
      pending = self._waiting.popleft()
      if pending.future.cancelled():
        continue
      request = pending.request
      kept = self._kept.get(request.continues) if self.reuse and request.continues is not None else None
      if kept is not None and kept[0] in free and request.tokens[:len(kept[1])] == kept[1]:
        slot, cached = kept
        suffix = request.tokens[len(cached):]
        width = self._bucket(len(suffix))
        if len(cached) + width <= self.max_context:
          free.discard(slot)
          self._claim(slot, pending)
          extend[width].append((pending, slot, suffix))
          continue
      others.append(pending)
    order = sorted(free, key=lambda slot: (self._slot_cache[slot] is not None, self._freed[slot]))
    for pending, slot in zip(others, order):
      self._claim(slot, pending)
      fresh[self._bucket(len(pending.request.tokens))].append((pending, slot, pending.request.tokens))
    self._waiting.extendleft(reversed(others[len(order):]))
    for program, batches in ((self._prefill, fresh), (self._extend, extend)):
      for width, group in sorted(batches.items()):
        for start in range(0, len(group), self.prefill_rows):
          self._prefill_batch(program, width, group[start:start + self.prefill_rows])
    self.stats.reused += sum(len(group) for group in extend.values())

  def _claim(self, slot: int, pending: _Pending) -> None:
    """Gives `slot` to `pending`; the cache it kept is gone."""
    self._kept.pop(self._slot_cache[slot], None)
    self._slot_cache[slot] = None
    self._holding[slot] = pending

  def _prefill_batch(self, program, width: int, batch: list) -> None:
    rows = 1 << math.ceil(math.log2(len(batch)))
    tokens = np.zeros((rows, width), np.int32)
    real = np.zeros((rows, width), np.int32)
    slots = np.full((rows,), self.slots, np.int32)  # past the end: dropped by the scatter
    limits = np.zeros((rows,), np.int32)
    stops = np.full((rows, self.max_stops), -1, np.int32)
    keys = []
    for row, (pending, slot, context) in enumerate(batch):
      request = pending.request
      tokens[row, :len(context)] = context
      real[row, :len(context)] = 1
      slots[row] = slot
      limits[row] = request.max_new_tokens
      stops[row, :len(request.stop_token_ids)] = request.stop_token_ids
      keys.append(key_data(request.key))
      self.stats.prefilled_tokens += len(context)
    keys += [keys[0]] * (rows - len(batch))
    vision = None
    if self.images is not None:
      vision = prefill_vision([(p.request.tokens, p.request.images, len(p.request.tokens) - len(context))
                               for p, _, context in batch], tokens, real, self.images, self.architecture)
    self._state, routes = program(self._params, self._state, tokens, real, slots, np.stack(keys), limits, stops,
                                  vision)
    self.stats.prefill_rows += rows
    if routes is not None:  # [rows, width, Ls, k]: each context's own entries
      routes = np.asarray(routes)
      for row, (pending, _, context) in enumerate(batch):
        pending.routes = [routes[row, :len(context)]]
        pending.routes_from = len(pending.request.tokens) - len(context)

  def _collect(self, emitted, live, steps) -> None:
    """Appends each held request's new tokens; resolves the requests whose rows went idle."""
    self.stats.chunks += 1
    self.stats.decode_steps += int(steps)
    valid, tokens, log_probs, stops = (np.asarray(x) for x in (emitted.valid, emitted.tokens, emitted.log_probs,
                                                              emitted.stopped))
    routes = None if emitted.routes is None else np.asarray(emitted.routes)  # [chunk, B, Ls, k]
    for slot, pending in enumerate(self._holding):
      if pending is None:
        continue
      emitted_here = valid[:, slot]
      pending.tokens += tokens[emitted_here, slot].tolist()
      pending.log_probs += log_probs[emitted_here, slot].tolist()
      if routes is not None:
        pending.routes.append(routes[emitted_here, slot])
      if not live[slot]:
        stopped = bool(stops[emitted_here, slot].any())
        self._holding[slot] = None
        self.stats.tokens += len(pending.tokens)
        self.stats.requests += 1
        # The slot's cache holds the context and every new token but the last (never fed back).
        cache_id, self._next_id = self._next_id, self._next_id + 1
        self._kept[cache_id] = (slot, pending.request.tokens + tuple(pending.tokens[:-1]))
        self._slot_cache[slot] = cache_id
        self._freed[slot] = self.stats.requests
        if not pending.future.cancelled():
          pending.future.set_result(Completion(
              tokens=tuple(pending.tokens), log_probs=tuple(pending.log_probs),
              finish_reason='stop' if stopped else 'length', cache_id=cache_id,
              routes=np.concatenate(pending.routes) if routes is not None else None, routes_from=pending.routes_from))

  # ---- traced bodies ----

  def _init_state(self) -> DecodeState:
    return DecodeState.idle(nnx.merge(self.graphdef, self._params), self.slots, self.max_context,
                            stops=self.max_stops, offsets=self.images is not None)

  def _prefill_into(self, params, state: DecodeState, tokens, real, slots, keys, limits, stops,
                    vision) -> DecodeState:
    """Prefills R right-padded contexts of width W into a W-entry cache (attention over W keys,
    not the row's S) and admits each into its slot (slot B: a padding row) with those entries;
    `vision`: their images and M-RoPE positions (a vision-language server; else None)."""
    model = nnx.merge(self.graphdef, params)
    rows, width = tokens.shape
    done = prefill(model, tokens, real, model.init_cache(rows, width), record_routes=self.settings.record_routes,
                   vision=vision)
    return admit(state, Slots(index=slots), Entry(hidden=done.hidden, keys=jax.random.wrap_key_data(keys),
                                                  empty=done.empty, cache=done.cache, limit=limits,
                                                  stops=stops, offsets=done.offsets)), done.routes

  def _extend_into(self, params, state: DecodeState, tokens, real, slots, keys, limits, stops,
                   vision) -> DecodeState:
    """Prefills R right-padded continuations of width W onto the caches their slots kept (each
    row's cache from its length on; attention over the row's S keys) and admits each into its
    slot with the W new entries after the kept ones."""
    model = nnx.merge(self.graphdef, params)
    cache, width = state.cache, tokens.shape[1]
    rows_of = lambda values, axis: jnp.take(values, slots, axis=axis, mode='clip')  # noqa: E731
    kept = dataclasses.replace(cache.map_layers(lambda x: rows_of(x, x.ndim - 4)),
                               segment_ids=rows_of(cache.segment_ids, 0), length=rows_of(cache.length, 0))
    done = prefill(model, tokens, real, kept, record_routes=self.settings.record_routes, vision=vision)
    start = kept.length  # [R] where each row's new entries begin

    def new_entries(x):  # [..., R, S, K, H] -> [..., R, W, K, H] from each row's start
      axis = x.ndim - 4
      return jax.vmap(lambda row, first: jax.lax.dynamic_slice_in_dim(row, first, width, axis=axis), (axis, 0), axis)(
          x, start)

    brought = dataclasses.replace(done.cache.map_layers(new_entries), segment_ids=jax.vmap(
        lambda row, first: jax.lax.dynamic_slice_in_dim(row, first, width))(done.cache.segment_ids, start))
    return admit(state, Slots(index=slots), Entry(hidden=done.hidden, keys=jax.random.wrap_key_data(keys),
                                                  empty=done.empty, cache=brought, start=start, limit=limits,
                                                  stops=stops, offsets=done.offsets)), done.routes

  def _decode_chunk(self, params, state: DecodeState):
    """Up to `chunk` decode steps, fewer when every slot goes idle first -> (state, Emitted
    [chunk, B] with valid False past the steps run, steps run)."""
    model = nnx.merge(self.graphdef, params)
    pieces, rebuild = model.loop_view()
    B, pad, c = self.slots, self.settings.pad_id, model.config
    routes = None
    if self.settings.record_routes:
      routes = unrecorded((self.chunk, B, c.num_sparse_layers, c.num_experts_per_tok), c.num_experts)
    out = Emitted(tokens=jnp.full((self.chunk, B), pad, jnp.int32), log_probs=jnp.zeros((self.chunk, B), jnp.float32),
                  valid=jnp.zeros((self.chunk, B), bool), lengths=jnp.zeros((self.chunk, B), jnp.int32),
                  stopped=jnp.zeros((self.chunk, B), bool), routes=routes)

    def body(carry):
      count, state, out = carry
      state, emitted = decode_step(rebuild(pieces), state, self.settings)
      return count + 1, state, jax.tree.map(lambda all_, one: all_.at[count].set(one), out, emitted)

    count, state, out = jax.lax.while_loop(lambda carry: (carry[0] < self.chunk) & jnp.any(carry[1].live), body,
                                           (jnp.int32(0), state, out))
    return state, out, count
