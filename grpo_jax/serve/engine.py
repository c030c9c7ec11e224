"""A JetStream engine for Qwen2 / Qwen2.5: prefill, insert into a decode slot, generate one token.

It implements the Engine API of google-jetstream 0.2.2 (`jetstream/engine/engine_api.py`) without
importing jetstream, whose engine package pulls in seqio and TensorFlow: the core must run on
machines that have neither. `register_with_jetstream()` (server.py) makes `QwenEngine` and
`ResultTokens` virtual subclasses of JetStream's classes when serving.

The decode state (decode.DecodeState) holds B = `max_concurrent_decodes` slots, each a KV-cache
row of S = max_prefill_length + max_new_tokens entries, laid out on the parameters' mesh:

  prefill(tokens)  -> decode.Prefix: the prompt's KV cache [L, 1, W, K, H] and the final-norm hidden
                      state [1, D] of its last token (its projection gives the first token's logits).
  insert(prefix, state, slot) copies the prefix into row `slot`; one prefix can go into G slots.
  generate(state)  -> decode.decode_step: one token per slot, the same step the trainer's group
                      sampler runs inside its jit, so the same request key gives the same tokens.

A vision-language model (Qwen2.5-VL) prefills a prompt with its images (prefill's `images`, or
`padded_tokens` given as `with_images`: JetStream's prefill call has no image argument, so serve's
prefill thread hands them over on the tokens): the vision tower runs in the prefill, once per
prompt, over the images padded to a bucket (a power of two of images, of patches each), so the
compiled prefills are a bounded set; each slot keeps its prompt's M-RoPE offset for decoding.
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.model.cache import KVCache
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.token_ids import check_token_ids
from grpo_jax.model.vision import Vision, patch_bucket, vision_of
from grpo_jax.sampler.decode import DecodeSettings, DecodeState, Prefix, decode_step, prefill, request_keys, typed_key
from grpo_jax.sampler.slots import Entry, Slots, admit
from grpo_jax.serve.tokenizer import NO_TOKEN, HFTokenizer
from grpo_jax.sharding import named_sharding

# Column ranges of ResultTokens.data, one int32 row per slot.
TOKEN_COLUMNS, VALID_COLUMNS, LENGTH_COLUMNS, LOG_PROB_COLUMNS = (0, 1), (1, 2), (2, 3), (3, 4)
CACHE_AXES = ('layers', 'batch', 'cache_seq', 'kv_heads', 'head_dim')


class ImageTokens(np.ndarray):
  """Padded prompt ids carrying the prompt's images (`images`: (patches, grid) pairs, in order)."""

  images: tuple = ()


def with_images(tokens, images) -> ImageTokens:
  """`tokens` as an ImageTokens carrying `images` (QwenEngine.prefill reads them)."""
  out = np.asarray(tokens).view(ImageTokens)
  out.images = tuple(images)
  return out


def _power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _static():
  return dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotData:
  """One slot's share of a ResultTokens: tokens, valid [samples, 1], lengths [samples]."""

  tokens: jax.Array | np.ndarray
  valid: jax.Array | np.ndarray
  lengths: jax.Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ResultTokens:
  """JetStream's ResultTokens layout, plus the sampled tokens' log-probs.

  data: [B, 4] int32, one row per slot: token | valid | length | log-prob. The log-prob column
  holds the fp32 bits of log softmax(logits / T)[token], so one array still carries everything
  to the host; `log_probs` reads it back as floats. The first three column ranges and
  `get_result_at_slot` are exactly JetStream's.
  """

  data: jax.Array | np.ndarray
  tokens_idx: tuple[int, int] = _static()
  valid_idx: tuple[int, int] = _static()
  length_idx: tuple[int, int] = _static()
  samples_per_slot: int = _static()
  log_prob_idx: tuple[int, int] = _static()

  def copy_to_host_async(self) -> None:
    if not isinstance(self.data, np.ndarray):
      self.data.copy_to_host_async()

  def convert_to_numpy(self) -> 'ResultTokens':
    return dataclasses.replace(self, data=np.asarray(self.data))

  def get_result_at_slot(self, slot: int) -> SlotData:
    rows = slice(slot * self.samples_per_slot, (slot + 1) * self.samples_per_slot)
    return SlotData(tokens=self.data[rows, slice(*self.tokens_idx)],
                    valid=self.data[rows, slice(*self.valid_idx)],
                    lengths=self.data[rows, slice(*self.length_idx)][:, 0])

  @property
  def tokens(self):
    """[B] sampled token of each slot."""
    return self.data[:, self.tokens_idx[0]]

  @property
  def valid(self):
    """[B] bool: the slot held a live request and the token belongs to it."""
    return self.data[:, self.valid_idx[0]] != 0

  @property
  def lengths(self):
    """[B] tokens generated so far by each slot's request, this one included."""
    return self.data[:, self.length_idx[0]]

  @property
  def log_probs(self):
    """[B] fp32 log softmax(logits / T) of each sampled token."""
    bits = self.data[:, self.log_prob_idx[0]]
    if isinstance(bits, np.ndarray):
      return bits.astype(np.int32).view(np.float32)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


class QwenEngine:
  """JetStream Engine (0.2.2 API) over a `Qwen2` module; params are `nnx.state(model)`.

  slots: B, concurrent decodes. max_prefill_length: longest prompt (or prompt bucket) in tokens.
  settings: sampling, max_new_tokens (tokens a slot may generate: its cache row holds
  max_prefill_length + max_new_tokens entries), stop and pad ids.
  tokenizer_path: directory with the Hugging Face tokenizer that `build_tokenizer` loads.
  chat_template: 'auto' (apply the tokenizer's chat template to text requests when it has one),
  'always' or 'never'.
  """

  def __init__(self, model: Qwen2, *, slots: int = 8, max_prefill_length: int = 256,
               settings: DecodeSettings = DecodeSettings(), seed: int = 0,
               tokenizer_path: str | None = None, chat_template: str = 'auto'):
    if slots < 1 or max_prefill_length < 1 or settings.max_new_tokens < 1:
      raise ValueError('slots, max_prefill_length and max_new_tokens must be at least 1')
    if model.options.kv_cache != 'compute':  # its prefixes and decode state are laid out as compute-dtype arrays
      raise ValueError(f'the serving engine keeps its KV cache in the compute dtype; got a model whose kv_cache is '
                       f'{model.options.kv_cache!r} (build it with kv_cache=compute)')
    graphdef, params = nnx.split(model)
    self._model = model
    self._graphdef = graphdef
    self._params = params
    self._mesh = jax.tree.leaves(params)[0].sharding.mesh
    self.slots = slots
    self.settings = settings
    self.cache_length = max_prefill_length + settings.max_new_tokens
    self._max_prefill_length = max_prefill_length
    self.seed = seed
    self.tokenizer_path = tokenizer_path
    self.chat_template = chat_template
    self.prefill_count = 0  # prefills run so far: prompts shared across G slots count once
    self._inserts = 0  # requests inserted without a key of their own draw from fold_in(seed, count)

    state_shardings = self._decode_state_shardings()
    self._init = jax.jit(self._init_state, out_shardings=state_shardings)
    self._prefill = jax.jit(self._prefill_step, out_shardings=self.get_prefix_destination_sharding())
    self._insert = jax.jit(self._insert_step, donate_argnums=1, out_shardings=state_shardings)
    self._generate = jax.jit(self._generate_step, donate_argnums=1, out_shardings=(state_shardings, None))

  @property
  def vocab_size(self) -> int:
    """Valid token ids are [0, vocab_size) (the model's embedding rows)."""
    return self._model.config.vocab_size

  @property
  def max_new_tokens(self) -> int:
    return self.settings.max_new_tokens

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    return self.settings.stop_token_ids

  @property
  def pad_id(self) -> int:
    return self.settings.pad_id

  # ---- the Engine API ----

  def load_params(self, *args, **kwargs) -> nnx.State:
    """The model's parameter state, already on the mesh (a trainer can pass its live one)."""
    del args, kwargs
    return self._params

  def init_decode_state(self, *args, **kwargs) -> DecodeState:
    del args, kwargs
    with jax.set_mesh(self._mesh):
      return self._init()

  def prefill(self, *, params, existing_prefix: Prefix | None = None, padded_tokens,
              true_length: int, images=None) -> Prefix:
    """padded_tokens [T], the true_length real tokens first (right padding); a leading NO_TOKEN
    (-1: JetStream's BOS placeholder, Qwen has no BOS token) is skipped. Every other real id must
    be in [0, vocab_size): a TokenIdError (a ValueError) names the first that is not, before
    anything runs. existing_prefix: an earlier Prefix to continue (text models). images: the
    prompt's images, (patches, grid) pairs whose image tokens the prompt holds in order (default:
    those `padded_tokens` carries, with_images)."""
    images = tuple(images if images is not None else getattr(padded_tokens, 'images', ()))
    padded_tokens = np.asarray(padded_tokens).reshape(-1)
    width = len(padded_tokens) + (existing_prefix.cache.max_length if existing_prefix else 0)
    if width > self._max_prefill_length:
      raise ValueError(f'prefill of {width} tokens exceeds max_prefill_length={self._max_prefill_length}')
    true_length = min(int(true_length), len(padded_tokens))
    real = padded_tokens[:true_length].copy()
    if true_length and real[0] == NO_TOKEN:
      real[0] = 0  # the placeholder, skipped below
    check_token_ids(real, self.vocab_size, 'prefill padded_tokens')
    padded_tokens = padded_tokens.astype(np.int32)
    vision = self._vision(padded_tokens, true_length, images, existing_prefix)
    self.prefill_count += 1
    with jax.set_mesh(self._mesh):
      return self._prefill(params, existing_prefix, padded_tokens, np.int32(true_length), vision)

  def _vision(self, tokens: np.ndarray, true_length: int, images: tuple, existing: Prefix | None) -> Vision | None:
    """The Vision of one prompt's images in their bucket; None for a prompt without images."""
    config = self._model.config
    if config.vision is None:
      if images:
        raise ValueError(f'images for a text model ({config.model_type})')
      return None
    if existing is not None:
      raise ValueError('existing_prefix: a vision-language engine prefills whole prompts')
    if not images:
      return None
    real = (np.arange(len(tokens)) < true_length) & (tokens != NO_TOKEN)
    longest = max(len(patches) for patches, _ in images)
    return vision_of([list(images)], np.where(real, tokens, 0)[None], real[None].astype(np.int32), config,
                     max_patches=patch_bucket(_power_of_two(longest), config.vision),
                     max_images=_power_of_two(len(images)))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
             key: jax.Array | None = None) -> DecodeState:
    """Puts `prefix` into `slot`. key: the request's PRNG key (decode.request_keys); by default
    request n inserted without one draws from fold_in(key(seed), n)."""
    if not 0 <= slot < self.slots:
      raise ValueError(f'slot {slot} is outside [0, {self.slots})')
    if key is None:
      key = request_keys(jax.random.key(self.seed), 1, self._inserts)[0]
      self._inserts += 1
    with jax.set_mesh(self._mesh):
      return self._insert(prefix, decode_state, np.int32(slot), typed_key(key))

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    with jax.set_mesh(self._mesh):
      return self._generate(params, decode_state)

  def get_prefix_destination_sharding(self) -> Prefix:
    c = self._model.config
    width = self._max_prefill_length
    heads, key, value = c.cache_entry  # MLA's: one latent head, its values read from the keys
    cache_shape = (c.num_hidden_layers, 1, width, heads, key)
    one = named_sharding(self._mesh, (1,), ('batch',))
    return Prefix(cache=KVCache(k=named_sharding(self._mesh, cache_shape, CACHE_AXES),
                                v=named_sharding(self._mesh, cache_shape[:-1] + (value,), CACHE_AXES),
                                segment_ids=named_sharding(self._mesh, (1, width), ('batch', 'cache_seq')),
                                length=one),
                  hidden=named_sharding(self._mesh, (1, c.hidden_size), ('batch', 'act_embed')),
                  empty=one, offsets=one if c.vision is not None else None)

  def get_tokenizer(self):
    """TokenizerParameters(path=tokenizer directory); a plain namespace without jetstream."""
    try:
      from jetstream.engine import tokenizer_pb2
    except ImportError:
      return types.SimpleNamespace(path=self.tokenizer_path or '', extra_ids=0)
    return tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path or '')

  def build_tokenizer(self, metadata) -> HFTokenizer:
    return HFTokenizer(metadata.path or None, stop_token_ids=self.stop_token_ids,
                       pad_id=self.pad_id, chat_template=self.chat_template)

  @property
  def max_concurrent_decodes(self) -> int:
    return self.slots

  @property
  def samples_per_slot(self) -> int:
    return 1

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def colocated_cpus(self) -> None:
    return None

  # ---- traced bodies ----

  def _decode_state_shardings(self) -> DecodeState:
    c, B, S, mesh = self._model.config, self.slots, self.cache_length, self._mesh
    heads, key, value = c.cache_entry
    per_slot = named_sharding(mesh, (B,), ('batch',))

    def layers(width):
      cache_shape = (c.num_hidden_layers, B, S, heads, width)
      if self._model.layered_decode_cache:  # one array per layer (KVCache)
        return (named_sharding(mesh, cache_shape[1:], CACHE_AXES[1:]),) * c.num_hidden_layers
      return named_sharding(mesh, cache_shape, CACHE_AXES)
    return DecodeState(
        cache=KVCache(k=layers(key), v=layers(value), segment_ids=named_sharding(mesh, (B, S), ('batch', 'cache_seq')),
                      length=per_slot),
        hidden=named_sharding(mesh, (B, c.hidden_size), ('batch', 'act_embed')),
        keys=per_slot, generated=per_slot, live=per_slot, offsets=per_slot if c.vision is not None else None)

  def _init_state(self) -> DecodeState:
    return DecodeState.idle(self._model, self.slots, self.cache_length,
                            keys=request_keys(jax.random.key(self.seed), self.slots),
                            offsets=self._model.config.vision is not None)

  def _prefill_step(self, params, existing: Prefix | None, tokens: jax.Array, true_length: jax.Array,
                    vision: Vision | None) -> Prefix:
    model = nnx.merge(self._graphdef, params)
    T = tokens.shape[0]
    real = (jnp.arange(T) < true_length) & (tokens != NO_TOKEN)
    if existing is None:
      cache = model.init_cache(1, T)
    else:  # continue the earlier prefix in a cache row widened by T slots
      old, previous = existing.cache, existing.cache.max_length
      cache = model.init_cache(1, previous + T)
      cache = KVCache(k=cache.k.at[:, :, :previous].set(old.k), v=cache.v.at[:, :, :previous].set(old.v),
                      segment_ids=cache.segment_ids.at[:, :previous].set(old.segment_ids), length=old.length)
    prefix = prefill(model, jnp.where(real, tokens, 0)[None], real[None].astype(jnp.int32), cache, vision=vision)
    if model.config.vision is not None and prefix.offsets is None:  # a text prompt: plain positions
      prefix = dataclasses.replace(prefix, offsets=jnp.zeros((1,), jnp.int32))
    return prefix

  def _insert_step(self, prefix: Prefix, state: DecodeState, slot: jax.Array, key: jax.Array) -> DecodeState:
    width = prefix.cache.max_length
    if width > self.cache_length:
      raise ValueError(f'prefix of {width} tokens does not fit a cache row of {self.cache_length}')
    return admit(state, Slots(index=jnp.reshape(slot, (1,))),
                 Entry(hidden=prefix.hidden, keys=key[None], empty=prefix.empty, cache=prefix.cache,
                       offsets=prefix.offsets))

  def _generate_step(self, params, state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    state, emitted = decode_step(nnx.merge(self._graphdef, params), state, self.settings)
    data = jnp.stack([emitted.tokens, emitted.valid.astype(jnp.int32), emitted.lengths,
                      jax.lax.bitcast_convert_type(emitted.log_probs, jnp.int32)], axis=1)
    return state, ResultTokens(data=data, tokens_idx=TOKEN_COLUMNS, valid_idx=VALID_COLUMNS,
                               length_idx=LENGTH_COLUMNS, samples_per_slot=1, log_prob_idx=LOG_PROB_COLUMNS)
