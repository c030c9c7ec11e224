"""The one prefill and the one decode step behind every sampling path.

The trainer's group sampler (rollout.py), the JetStream engine (serve/engine.py), `python -m
grpo_jax.generate` and `python -m grpo_jax.serve` all sample through these two functions, so a
request's tokens depend only on its prompt, its key and the parameters, never on the path:

  prefill(model, tokens, segment_ids, cache) -> Prefix
      runs P prompts (left- or right-padded) through the model once, and keeps the final-norm
      hidden state of each prompt's last real token: its projection gives the first token's logits.
  decode_step(model, state, settings) -> (state, Emitted)
      samples one token per row from the stored hidden states, then, if any row is still live,
      runs those tokens through the model so the next step's hidden states are ready. One forward
      per step; the forward after the last token is skipped when every row has finished.

PRNG policy: request r of a call draws from `request_keys(key, R)[r] = fold_in(key, r)`, and the
n-th token of a request from `fold_in(request key, n)`. A request's samples therefore do not depend
on the batch around it, on the slot it lands in, or on how many slots there are.
"""

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.model.moe import unrecorded
from grpo_jax.model.cache import KVCache, SharedPrefix
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.vision import Vision, model_inputs
from grpo_jax.records import along
from grpo_jax.sampler.sampling import SamplingConfig, select


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
  """Static settings of decoding (hashable, fixed at trace time)."""

  sampling: SamplingConfig = SamplingConfig()
  max_new_tokens: int = 16  # N: a request finishes with reason 'length' after this many tokens
  stop_token_ids: tuple[int, ...] = ()  # a request finishes with reason 'stop' after emitting one
  pad_id: int = 0  # written where a row emits nothing
  record_routes: bool = False  # keep the experts each token was routed to (routing replay; MoE only)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
  """P prefilled prompts.

  cache:   KVCache [L, P, W, K, H]; `length` is the slot after each prompt's last real token, so
           decoding continues right after it (right padding is overwritten, left padding masked).
  hidden:  [P, D] final-norm hidden state of each prompt's last real token.
  empty:   [P] bool, the prompt had no real token (its request finishes at once, with no tokens).
  routes:  [P, T, Ls, k] the experts each prompt token was routed to (model/moe.py), or None when
           not recorded.
  offsets: [P] int32 M-RoPE position offsets of prompts with images (model/vision.py), or None.
  """

  cache: KVCache
  hidden: jax.Array = along('prompt')
  empty: jax.Array = along('prompt')
  routes: jax.Array | None = along('prompt', default=None)
  offsets: jax.Array | None = along('prompt', default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Everything a decode step transforms, for B rows (slots).

  cache:      KVCache [L, B, S, K, H].
  hidden:     [B, D] hidden state whose projection gives each row's next-token logits.
  keys:       [B] typed PRNG keys, one per request.
  generated:  [B] int32 tokens the row's request has emitted so far.
  live:       [B] bool, the row holds a request that has not finished.
  prefix:     a SharedPrefix holding the rows' prompts (then `cache` holds only what each row
              generates), or None when each cache row starts with its own copy of its prompt.
  limit:      [B] int32 tokens each row's request may emit (at most the settings' max_new_tokens),
              or None: the settings' for every row (requests of one budget).
  stops:      [B, M] int32 stop ids of each row's own (padded with -1), besides the settings' ones;
              None: only the settings' (the inference server's requests carry their own).
  offsets:    [B] int32 M-RoPE position offset of each row's prompt (prompts with images); None: 0.
  The fields along 'slot' lead with the B rows (the caches and the shared prompts do not).
  """

  cache: KVCache
  hidden: jax.Array = along('slot')
  keys: jax.Array = along('slot')
  generated: jax.Array = along('slot')
  live: jax.Array = along('slot')
  prefix: SharedPrefix | None = None
  limit: jax.Array | None = along('slot', default=None)
  stops: jax.Array | None = along('slot', default=None)
  offsets: jax.Array | None = along('slot', default=None)

  @classmethod
  def idle(cls, model: Qwen2, slots: int, length: int, *, dtype=None, keys: jax.Array | None = None,
           prefix: SharedPrefix | None = None, offsets: bool = False, stops: int | None = None,
           windowed: bool = False) -> 'DecodeState':
    """B = `slots` rows holding no request, each with its own empty cache row of `length` entries:
    what every sampling path starts from before `slots.admit` lets requests in.

    dtype:    the hidden states' (default: the model's compute dtype).
    keys:     [B] the rows' keys until their requests bring their own (default: split from key 0).
    prefix:   the shared prompts the rows read (group sampling, the pool).
    offsets:  the rows carry M-RoPE offsets (a vision-language model), 0 until admitted.
    stops:    M: the rows carry their requests' own budgets (0 until admitted) and M stop ids each
              (-1); None: the settings' (the inference server's requests bring their own).
    windowed: the sliding-window layers keep only their window (model.init_cache); the requests
              then enter at slot 0 or as whole rows.
    """
    own = stops is not None
    return cls(cache=model.init_cache(slots, length, layered=model.layered_decode_cache, windowed=windowed),
               hidden=jnp.zeros((slots, model.config.hidden_size), model.dtype if dtype is None else dtype),
               keys=jax.random.split(jax.random.key(0), slots) if keys is None else keys,
               generated=jnp.zeros((slots,), jnp.int32), live=jnp.zeros((slots,), bool), prefix=prefix,
               limit=jnp.zeros((slots,), jnp.int32) if own else None,
               stops=jnp.full((slots, stops), -1, jnp.int32) if own else None,
               offsets=jnp.zeros((slots,), jnp.int32) if offsets else None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emitted:
  """One decode step's output, one entry per row.

  tokens:     [B] int32, the sampled token; `pad_id` where the row emitted nothing.
  log_probs:  [B] fp32 log softmax(logits / T)[token]; 0 where the row emitted nothing.
  valid:      [B] bool, the row held a live request and emitted this token.
  lengths:    [B] int32 tokens the row's request has emitted, this one included.
  stopped:    [B] bool, this token is a stop token (the request finished with reason 'stop').
  routes:     [B, Ls, k] the experts this token was routed to when fed back (settings.record_routes),
              `unrecorded` where it was not fed back (the row's last token, or none emitted); else None.
  """

  tokens: jax.Array
  log_probs: jax.Array
  valid: jax.Array
  lengths: jax.Array
  stopped: jax.Array
  routes: jax.Array | None = None


def typed_key(key: jax.Array) -> jax.Array:
  """A typed PRNG key from a typed one or raw uint32 key data (as `jax.random.PRNGKey` gives)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key)


def request_keys(key: jax.Array, count: int, first: int = 0) -> jax.Array:
  """[count] keys of requests first .. first + count - 1: fold_in(key, r)."""
  return jax.vmap(jax.random.fold_in, (None, 0))(typed_key(key), first + jnp.arange(count))


def prefill(model: Qwen2, tokens: jax.Array, segment_ids: jax.Array, cache: KVCache,
            prefix: SharedPrefix | None = None, record_routes: bool = False, vision: Vision | None = None) -> Prefix:
  """Runs tokens [P, T] (segment_ids [P, T], 0 on padding) into `cache` [L, P, S, K, H] from its
  current length on (an empty cache, or an earlier prefix to continue); `prefix`: shared prompts
  the rows continue (partial rollouts prefill a cut-off answer over its prompt). Only the P hidden states
  that are sampled from leave the model: the [P, T, V] logits of a long prompt batch would be
  tens of GB over Qwen's 151,936-token vocabulary. record_routes: keep each token's experts.
  vision: the prompts' images and M-RoPE positions (a vision-language model; prompts on an empty cache)."""
  start = cache.length
  hidden, cache, routing = model.extend(tokens, cache, segment_ids=segment_ids, return_hidden=True, prefix=prefix,
                                        return_routing=True, **model_inputs(vision))
  last = jnp.max(jnp.where(segment_ids != 0, jnp.arange(tokens.shape[1]), -1), axis=1)  # [P]
  cache = dataclasses.replace(cache, length=start + last + 1)
  hidden = jnp.take_along_axis(hidden, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]
  routes = _recorded(routing, segment_ids != 0) if record_routes else None
  return Prefix(cache=cache, hidden=hidden, empty=last < 0, routes=routes,
                offsets=None if vision is None else vision.offsets)


def _recorded(routing, real: jax.Array) -> jax.Array:
  """routing.experts [B, T, Ls, k] where `real` [B, T], `unrecorded` elsewhere."""
  if routing is None:
    raise ValueError('routes are recorded for a mixture of experts only (this model is dense)')
  experts = routing.experts
  return jnp.where(real[:, :, None, None], experts, unrecorded(experts.shape, routing.load.shape[-1]))


def _select_one(logits: jax.Array, key: jax.Array, sampling: SamplingConfig):
  """select() for one row: logits [V] -> (token, log-prob) scalars."""
  tokens, log_probs = select(logits[None], key, sampling)
  return tokens[0], log_probs[0]


def _advance(model: Qwen2, state: DecodeState, tokens: jax.Array) -> tuple[DecodeState, jax.Array | None]:
  """Feeds each live row's token through the model into its cache row; other rows are untouched.
  -> (state, the fed tokens' routes [B, Ls, k], `unrecorded` on rows not live; None in a dense model)."""
  live = state.live
  hidden, cache, routing = model.extend(tokens[:, None], state.cache, segment_ids=live[:, None].astype(jnp.int32),
                                        return_hidden=True, prefix=state.prefix, return_routing=True,
                                        position_offsets=state.offsets)
  # A free row writes a padding entry at its current slot but keeps its length, so it never runs
  # past the end of its row and the entry is overwritten by the next request inserted there.
  cache = dataclasses.replace(cache, length=jnp.where(live, cache.length, state.cache.length))
  routes = None if routing is None else _recorded(routing, live[:, None])[:, 0]
  return dataclasses.replace(state, cache=cache, hidden=hidden[:, 0].astype(state.hidden.dtype)), routes


def decode_step(model: Qwen2, state: DecodeState, settings: DecodeSettings) -> tuple[DecodeState, Emitted]:
  """Emits one token per live row, then advances the rows still live. Traceable."""
  logits = model.project(state.hidden[:, None])[:, 0]  # [B, V]
  step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.generated)
  tokens, log_probs = jax.vmap(_select_one, (0, 0, None))(logits, step_keys, settings.sampling)
  live = state.live
  generated = state.generated + live
  stop_ids = jnp.asarray(settings.stop_token_ids or (-1,), jnp.int32)
  stopped = live & jnp.isin(tokens, stop_ids)
  if state.stops is not None:
    stopped = stopped | (live & jnp.any(tokens[:, None] == state.stops, axis=1))
  emitted = Emitted(tokens=jnp.where(live, tokens, settings.pad_id), log_probs=jnp.where(live, log_probs, 0.0),
                    valid=live, lengths=generated, stopped=stopped)
  limit = settings.max_new_tokens if state.limit is None else jnp.minimum(state.limit, settings.max_new_tokens)
  state = dataclasses.replace(state, generated=generated, live=live & ~stopped & (generated < limit))
  # Always advanced, even when no row is live any more (one wasted forward per rollout): under a
  # lax.cond skipping it, XLA:GPU copied both whole KV caches into the loop's buffers on every
  # decode step (the 32B recipe's rollout held the cache twice, 96.6 GiB per H100; 50.2 without).
  state, routes = _advance(model, state, tokens)
  if settings.record_routes:
    emitted = dataclasses.replace(emitted, routes=routes)
  return state, emitted
