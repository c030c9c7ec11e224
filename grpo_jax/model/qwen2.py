"""Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE decoder in Flax NNX: one model, the family's differences
are options of its Qwen2Config (`attention_bias`, `qk_norm`, `num_experts`).

Layer parameters are stored stacked along a leading layer axis L, so the decoder runs as one
`lax.scan` (compile time independent of depth) or, with `scan_layers=False`, as an unrolled loop
over the same arrays. Parameter names carry their dimension letters:

  embedding      [V, D]            lm_head     [D, V] (absent when tied)
  attn_norm      [L, D]            mlp_norm    [L, D]           final_norm [D]
  q_weight       [L, D, N, H]      q_bias      [L, N, H]        (attention_bias)
  k_weight       [L, D, K, H]      k_bias      [L, K, H]        (v_* likewise)
  q_norm         [L, H]            k_norm      [L, H]           (qk_norm)
  o_weight       [L, N, H, D]
  gate_weight    [Ld, D, F]        up_weight   [Ld, D, F]       down_weight [Ld, F, D]
  router_weight  [Ls, D, E]        expert_gate_weight, expert_up_weight [Ls, E, D, M]
  expert_down_weight [Ls, E, M, D]                                (num_experts > 0; model/moe.py)

A mixture of experts stores the dense MLP of its Ld dense layers and the experts of its Ls sparse
layers (config.sparse_layers) in stacks of their own, so no layer carries both. When every layer is
of one kind (every Qwen3-MoE checkpoint published: decoder_sparse_step 1, no mlp_only_layers) the
layers scan; a mixed model runs them unrolled, each layer reading its slice of its kind's stack.

Masking uses segment ids [B, T]: 0 marks padding, and a token attends to earlier tokens of its own
segment only. A Hugging Face 0/1 attention mask is a valid segment-id array, and packed sequences
use 1, 2, 3, ... per row. Left- and right-padded batches therefore give each real token the same
logits as the unpadded sequence.
"""

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.errors import require
from grpo_jax.model.attention import (ATTENTION_IMPLEMENTATIONS, DECODE_ATTENTIONS, Attend, AttentionImplementation,
                                      DecodeAttention, attention_mask, cache_attention, reads_stacked_cache,
                                      sequence_attention)
from grpo_jax.model.config import Qwen2Config
from grpo_jax.model.linear import matmul
from grpo_jax.model.lora import TARGETS, Adapter, LoraConfig, adapter_names, adapter_shapes, init_a
from grpo_jax.model.moe import Routing, sparse_mlp
from grpo_jax.model.token_ids import check_token_ids
from grpo_jax.sharding import constrain

DType = Literal['float32', 'bfloat16']
# Storage dtypes: float16 too, so a float16 checkpoint converts without a change of precision.
ParamDType = Literal['float32', 'bfloat16', 'float16']
RematPolicy = Literal['none', 'full', 'dots', 'dots_no_batch']

_REMAT_POLICIES = {
    'full': None,  # save nothing, recompute the whole block
    'dots': jax.checkpoint_policies.dots_saveable,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelOptions:
  """How the model computes; what it computes is its `Qwen2Config`. Checked on construction."""

  dtype: DType = 'float32'  # compute dtype of activations, matmul inputs and the KV cache
  param_dtype: ParamDType = 'float32'  # storage dtype of parameters (fp32 master weights with bf16 compute)
  remat: RematPolicy = 'none'  # rematerialisation of each layer under autodiff
  scan_layers: bool = True  # one lax.scan over layers: compile time independent of depth
  attention: AttentionImplementation = 'dense'  # full-sequence attention (attention.py); decoding: below
  attention_chunk: int = 512  # queries per chunk with attention='chunked'
  decode_attention: DecodeAttention = 'dense'  # attention over the KV cache while decoding (attention.py)
  decode_block: int = 256  # cache slots per block of 'blockwise' and 'pallas' decode attention
  # Low-rank adapters (model/lora.py): the base frozen in `dtype`, the adapters in `param_dtype`.
  lora: LoraConfig | None = None

  def __post_init__(self):
    choices = {'dtype': typing.get_args(DType), 'param_dtype': typing.get_args(ParamDType),
               'remat': typing.get_args(RematPolicy), 'attention': ATTENTION_IMPLEMENTATIONS,
               'decode_attention': DECODE_ATTENTIONS}
    for name, allowed in choices.items():
      require(getattr(self, name) in allowed, name,
              f'must be one of {" | ".join(map(repr, allowed))}, got {getattr(self, name)!r}')
    require(self.attention_chunk >= 1, 'attention_chunk', f'must be >= 1, got {self.attention_chunk}')
    require(self.decode_block >= 1, 'decode_block', f'must be >= 1, got {self.decode_block}')


DENSE_MLP_PARAMS = ('gate_weight', 'up_weight', 'down_weight')
EXPERT_PARAMS = ('router_weight', 'expert_gate_weight', 'expert_up_weight', 'expert_down_weight')
LAYER_PARAMS = ('attn_norm', 'q_weight', 'q_bias', 'q_norm', 'k_weight', 'k_bias', 'k_norm', 'v_weight', 'v_bias',
                'o_weight', 'mlp_norm') + DENSE_MLP_PARAMS + EXPERT_PARAMS


def layer_params(config: Qwen2Config) -> tuple[str, ...]:
  """The names of LAYER_PARAMS this architecture has."""
  absent = (() if config.attention_bias else ('q_bias', 'k_bias', 'v_bias')) + (() if config.qk_norm else
                                                                                  ('q_norm', 'k_norm'))
  absent += (() if config.num_sparse_layers else EXPERT_PARAMS)
  absent += (() if config.num_sparse_layers < config.num_hidden_layers else DENSE_MLP_PARAMS)
  return tuple(name for name in LAYER_PARAMS if name not in absent)


def stacked_layers(config: Qwen2Config, name: str) -> tuple[int, ...]:
  """The layers whose slices the stacked parameter `name` holds, in order."""
  return config.layers_of('sparse' if name in EXPERT_PARAMS else 'dense' if name in DENSE_MLP_PARAMS else 'all')


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """Keys and values of every layer for B rows of up to S tokens.

  k, v:         [L, B, S, K, H] in the compute dtype.
  segment_ids:  [B, S] int32, 0 for empty or padding slots.
  length:       [B] int32, slots written so far; the next token goes to slot `length`.
  """

  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  length: jax.Array

  @property
  def max_length(self) -> int:
    return self.k.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedPrefix:
  """Prompt caches that many rows read without a copy of their own (the G samples of a prompt,
  the slots of continuous batching): row r attends over prompt `index` of its group, then over
  its own cache row.

  The P = n * Pn prompts come in n groups, one per batch shard of the mesh, and the B = n * Bn rows
  likewise: row g * Bn + j reads prompt (g, index[g, j]), so a row only ever reads prompts held on
  its own devices (the gather is batched over the group axis, which stays sharded).

  k, v:         [L, n, Pn, W, K, H] in the compute dtype.
  segment_ids:  [n, Pn, W] int32, 0 on padding.
  index:        [n, Bn] int32, the prompt each row reads, within its group.
  """

  k: jax.Array
  v: jax.Array
  segment_ids: jax.Array
  index: jax.Array

  def rows(self, shared: jax.Array) -> jax.Array:
    """[n, Pn, ...] per-prompt values -> [B, ...] the value each row reads."""
    picked = jax.vmap(lambda values, index: values[index])(shared, self.index)
    return picked.reshape((-1,) + picked.shape[2:])


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm computed in fp32, cast back to x's dtype before scaling (as Qwen2 does)."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding, half-split convention. x: [B, T, n, H], positions: [B, T]."""
  head_dim = x.shape[-1]
  inverse_frequency = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions[..., None].astype(jnp.float32) * inverse_frequency  # [B, T, H/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, ...] into cache [B, S, ...] at slot start[b] of each row."""
  def write_row(row, update, index):
    return jax.lax.dynamic_update_slice_in_dim(row, update, index, axis=0)
  return jax.vmap(write_row)(cache, new, start)


def _write_layers(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [L, B, T, ...] into cache [L, B, S, ...] at slot start[b] of each row b."""
  # One scatter indexed on (layer, row, slot): a vmap over the row axis would move it to the front,
  # transposing the whole cache there and back. The layer is an index too, not part of the written
  # window: with one KV head per device (a tensor-parallel cache) XLA:TPU otherwise laid the cache
  # out layer-minor for the scatter and copied the whole cache into the layer scan's layer-major
  # layout on every decode step (twice the cache in temporaries).
  layers = jnp.arange(new.shape[0])[:, None, None]
  rows = jnp.arange(new.shape[1])[None, :, None]
  slots = (start[:, None] + jnp.arange(new.shape[2]))[None]
  return cache.at[layers, rows, slots].set(new, indices_are_sorted=True, unique_indices=True)


def decoder_block(params: dict, x: jax.Array, positions: jax.Array, attend: Attend, *,
                  config: Qwen2Config, dtype, lora_scale: float = 0.0, real: jax.Array | None = None,
                  replay: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array], Routing | None]:
  """One pre-norm decoder layer. params: one layer's slice of `LAYER_PARAMS` (and of the LoRA
  factors, added to their projection's output scaled by `lora_scale`, unmerged); x: [B, T, D];
  positions: [B, T]; attend(q [B, T, N, H], k, v [B, T, K, H]) -> [B, T, N, H] is the attention
  (over the T tokens, and for `extend` over the cache too). A sparse layer (its slice holds
  `router_weight`) routes as model/moe.py says: real [B, T] marks the tokens its load statistics
  count, replay [B, T, k] the experts to route to (None: the router's top k). -> (x [B, T, D], this
  layer's keys and values [B, T, K, H] in the compute dtype, its Routing or None when dense).
  """
  p = {name: value.astype(dtype) for name, value in params.items()}

  def project(x, target, contract=1):
    y = matmul(x, p[TARGETS[target][0]], contract)
    a, b = adapter_names(target)
    if a not in p:
      return y
    # x A as (A^T x^T)^T: with x on the other side of the dot, XLA:GPU's dot merger does not join it
    # with x W into one matmul over [W | A], which wrote a copy of W every step (bench/lora.py --target).
    rows, rank = x.shape[:x.ndim - contract], p[a].shape[-1]
    flat = x.reshape(-1, math.prod(x.shape[x.ndim - contract:]))
    xa = jnp.einsum('ir,ni->rn', p[a].reshape(-1, rank), flat).T.reshape(*rows, rank)
    return y + (matmul(xa, p[b]) * jnp.asarray(lora_scale, dtype)).astype(y.dtype)

  h = rms_norm(x, p['attn_norm'], config.rms_norm_eps)
  q, k, v = project(h, 'q'), project(h, 'k'), project(h, 'v')
  if config.attention_bias:
    q, k, v = q + p['q_bias'], k + p['k_bias'], v + p['v_bias']
  if config.qk_norm:  # each head's query and key normalised over H, before the rotation
    q, k = rms_norm(q, p['q_norm'], config.rms_norm_eps), rms_norm(k, p['k_norm'], config.rms_norm_eps)
  q = apply_rope(q, positions, config.rope_theta)
  k = apply_rope(k, positions, config.rope_theta)
  x = x + project(attend(q, k, v), 'o', contract=2)
  x = constrain(x, ('batch', 'seq', 'act_embed'))
  h = rms_norm(x, p['mlp_norm'], config.rms_norm_eps)
  routing = None
  if 'router_weight' in p:
    real = jnp.ones(h.shape[:2], bool) if real is None else real
    out, routing = sparse_mlp(p, h, real, top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                              replay=replay)
  else:
    out = project(jax.nn.silu(project(h, 'gate')) * project(h, 'up'), 'down')
  return constrain(x + out, ('batch', 'seq', 'act_embed')), (k, v), routing


def _gathered(stacked: Routing | None) -> Routing | None:
  """The sparse layers' Routing stacked over Ls -> the model's: experts [B, T, Ls, k], a token re-routed
  when any layer re-routed it."""
  if stacked is None:
    return None
  return Routing(experts=jnp.moveaxis(stacked.experts, 0, 2), load=stacked.load, probability=stacked.probability,
                 tokens=stacked.tokens[0], differs=jnp.any(stacked.differs, axis=0))


def _segments(tokens: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
  """segment_ids as int32 [B, T]; when None, every token is real and each row one sequence."""
  if segment_ids is None:
    return jnp.ones(tokens.shape, jnp.int32)
  return segment_ids.astype(jnp.int32)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Position of each token within its segment, counting from the segment's first token. [B, T]"""
  length = segment_ids.shape[1]
  index = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), segment_ids.shape)
  starts = jnp.concatenate(
      [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  segment_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  return index - segment_start


class DecoderLayers(nnx.Module):
  """The L decoder layers' parameters, stacked along a leading layer axis."""

  def __init__(self, config: Qwen2Config, param_dtype, rngs: nnx.Rngs):
    c = config
    L, D, F = c.num_hidden_layers, c.hidden_size, c.intermediate_size
    Ls = c.num_sparse_layers
    Ld, E, M = L - Ls, c.num_experts, c.moe_intermediate_size
    N, K, H = c.num_attention_heads, c.num_key_value_heads, c.resolved_head_dim
    normal = nnx.initializers.normal(c.initializer_range)

    def weight(shape, axes):
      return nnx.Param(normal(rngs.params(), shape, param_dtype), logical_axes=axes)

    def constant(value, shape, axes):
      return nnx.Param(jnp.full(shape, value, param_dtype), logical_axes=axes)

    self.names = layer_params(c)
    self.attn_norm = constant(1.0, (L, D), ('layers', 'act_embed'))
    self.q_weight = weight((L, D, N, H), ('layers', 'embed', 'q_heads', 'head_dim'))
    self.k_weight = weight((L, D, K, H), ('layers', 'embed', 'kv_heads', 'head_dim'))
    self.v_weight = weight((L, D, K, H), ('layers', 'embed', 'kv_heads', 'head_dim'))
    if c.attention_bias:
      self.q_bias = constant(0.0, (L, N, H), ('layers', 'q_heads', 'head_dim'))
      self.k_bias = constant(0.0, (L, K, H), ('layers', 'kv_heads', 'head_dim'))
      self.v_bias = constant(0.0, (L, K, H), ('layers', 'kv_heads', 'head_dim'))
    if c.qk_norm:
      self.q_norm = constant(1.0, (L, H), ('layers', 'head_dim'))
      self.k_norm = constant(1.0, (L, H), ('layers', 'head_dim'))
    self.o_weight = weight((L, N, H, D), ('layers', 'q_heads', 'head_dim', 'embed'))
    self.mlp_norm = constant(1.0, (L, D), ('layers', 'act_embed'))
    if Ld:
      self.gate_weight = weight((Ld, D, F), ('layers', 'embed', 'mlp'))
      self.up_weight = weight((Ld, D, F), ('layers', 'embed', 'mlp'))
      self.down_weight = weight((Ld, F, D), ('layers', 'mlp', 'embed'))
    if Ls:  # experts over the 'expert' mesh axis, each one's SwiGLU split like a dense MLP
      self.router_weight = weight((Ls, D, E), ('layers', 'embed', None))
      self.expert_gate_weight = weight((Ls, E, D, M), ('layers', 'experts', 'embed', 'mlp'))
      self.expert_up_weight = weight((Ls, E, D, M), ('layers', 'experts', 'embed', 'mlp'))
      self.expert_down_weight = weight((Ls, E, M, D), ('layers', 'experts', 'mlp', 'embed'))

  def add_adapters(self, lora: LoraConfig, key: jax.Array, dtype) -> None:
    """LoRA factors on the `lora.targets` projections (model/lora.py): A drawn from `key`, B zero."""
    for target, target_key in zip(lora.targets, jax.random.split(key, len(lora.targets))):
      stacked = getattr(self, TARGETS[target][0])
      (a_shape, a_axes), (b_shape, b_axes) = adapter_shapes(target, stacked.shape, stacked.logical_axes, lora.rank)
      a_name, b_name = adapter_names(target)
      setattr(self, a_name, Adapter(init_a(target_key, a_shape, dtype), logical_axes=a_axes))
      setattr(self, b_name, Adapter(jnp.zeros(b_shape, dtype), logical_axes=b_axes))
    self.names = self.names + tuple(name for target in lora.targets for name in adapter_names(target))

  def arrays(self) -> dict:
    return {name: getattr(self, name)[...] for name in self.names}


class Qwen2(nnx.Module):
  """Qwen2 causal LM. `model(tokens)` -> fp32 logits [B, T, V].

  options: dtypes, rematerialisation, layer scan and full-sequence attention (see ModelOptions);
  kept as `self.options`. Incremental decoding (`extend`) reads the cache
  as `options.decode_attention` says.
  """

  def __init__(self, config: Qwen2Config, options: ModelOptions = ModelOptions(), *, rngs: nnx.Rngs):
    self.config = config
    self.options = options
    normal = nnx.initializers.normal(config.initializer_range)
    V, D = config.vocab_size, config.hidden_size
    self.embedding = nnx.Param(normal(rngs.params(), (V, D), self.param_dtype),
                               logical_axes=('vocab', 'embed'))
    self.layers = DecoderLayers(config, self.param_dtype, rngs)
    self.final_norm = nnx.Param(jnp.ones((D,), self.param_dtype), logical_axes=('act_embed',))
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Param(normal(rngs.params(), (D, V), self.param_dtype),
                               logical_axes=('embed', 'vocab'))
    if options.lora is not None and config.num_sparse_layers:
      experts = [target for target in options.lora.targets if TARGETS[target][0] in DENSE_MLP_PARAMS]
      require(not experts, 'model.lora.targets',
              f'{experts[0] if experts else ""!r}: adapters on the MLP of a mixture of experts (its experts) are not '
              "built; target the attention projections ('q', 'k', 'v', 'o')")
    if options.lora is not None:  # drawn last: the base weights are those of the same seed without LoRA
      self.layers.add_adapters(options.lora, rngs.params(), jnp.dtype(options.param_dtype))

  @property
  def dtype(self) -> jnp.dtype:
    """Compute dtype: activations, matmul inputs, the KV cache."""
    return jnp.dtype(self.options.dtype)

  @property
  def param_dtype(self) -> jnp.dtype:
    """Storage dtype of the (base) parameters: with LoRA the frozen base is held in the compute
    dtype, and `options.param_dtype` is the adapters'."""
    return jnp.dtype(self.options.dtype if self.options.lora is not None else self.options.param_dtype)

  @property
  def lora_scale(self) -> float:
    return 0.0 if self.options.lora is None else self.options.lora.scale

  def run_layers(self, x: jax.Array, layer: Callable, xs=None,
                 replay: jax.Array | None = None) -> tuple[jax.Array, typing.Any, Routing | None]:
    """Runs the L layers on x [B, T, D]: `layer(x, params, xs_l, replay_l) -> (x, out_l, routing_l)`,
    where params is one layer's slice of the stacked parameters, xs_l of `xs` (a pytree of [L, ...]
    arrays, or None) and replay_l of `replay` ([Ls, B, T, k] routes of the sparse layers, or None;
    None in a dense layer). -> (x, the out_l stacked along a leading L axis, the sparse layers'
    Routing stacked along a leading Ls axis, or None in a dense model).

    As one lax.scan with `scan_layers` when every layer is of one kind, otherwise unrolled over the
    same arrays; either way xs is sliced one layer at a time, so a stacked KV cache is read in
    place, never carried.
    """
    params = self.layers.arrays()
    sparse = self.config.sparse_layers
    if self.options.scan_layers and len(set(sparse)) == 1:
      def body(x, inputs):
        x, out, routing = layer(x, *inputs)
        return x, (out, routing)
      x, (outs, routings) = jax.lax.scan(body, x, (params, xs, replay))
      return x, outs, routings
    slot = {name: {i: j for j, i in enumerate(stacked_layers(self.config, name))} for name in params}
    sparse_index = [sum(sparse[:i]) for i in range(len(sparse))]
    outs, routings = [], []
    for index in range(self.config.num_hidden_layers):
      own = {name: value[slot[name][index]] for name, value in params.items() if index in slot[name]}
      replay_l = None if replay is None or not sparse[index] else replay[sparse_index[index]]
      x, out, routing = layer(x, own, jax.tree.map(lambda a, i=index: a[i], xs), replay_l)
      outs.append(out)
      if routing is not None:
        routings.append(routing)
    stack = lambda parts: jax.tree.map(lambda *p: jnp.stack(p), *parts)  # noqa: E731
    return x, stack(outs), (stack(routings) if routings else None)

  # ---- full-sequence forward (training, scoring) ----

  def __call__(self, tokens: jax.Array, *, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, routes: jax.Array | None = None) -> jax.Array:
    """tokens [B, T] int32 -> logits [B, T, V] fp32."""
    return self.project(self.hidden_states(tokens, positions=positions, segment_ids=segment_ids, routes=routes))

  def hidden_states(self, tokens: jax.Array, *, positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None, routes: jax.Array | None = None,
                    return_routing: bool = False):
    """Final-norm hidden states [B, T, D] (what the fused log-prob op consumes).

    routes [B, T, Ls, k]: a mixture of experts routes each token to these experts (routing replay,
    model/moe.py). return_routing: return (hidden, Routing) instead, what the sparse layers did
    (None for a dense model).
    """
    segment_ids = _segments(tokens, segment_ids)
    if positions is None:
      positions = segment_positions(segment_ids)
    slots = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    attend = sequence_attention(self.options.attention, slots, segment_ids, self.options.attention_chunk)
    real = segment_ids != 0

    def block(params, x, replay):
      return decoder_block(params, x, positions, attend, config=self.config, dtype=self.dtype,
                           lora_scale=self.lora_scale, real=real, replay=replay)
    if self.options.remat != 'none':
      block = jax.checkpoint(block, policy=_REMAT_POLICIES[self.options.remat])

    def layer(x, params, _, replay):
      x, _, routing = block(params, x, replay)
      return x, None, routing

    x, _, routing = self.run_layers(self._embed(tokens), layer, replay=self._replay(routes))
    hidden = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
    return (hidden, _gathered(routing)) if return_routing else hidden

  def _replay(self, routes: jax.Array | None) -> jax.Array | None:
    """routes [B, T, Ls, k] -> [Ls, B, T, k], the sparse layers' slices (None: route live)."""
    if routes is None:
      return None
    c = self.config
    expected = (c.num_sparse_layers, c.num_experts_per_tok)
    if not c.num_sparse_layers or routes.shape[2:] != expected:
      raise ValueError(f'routes of shape {routes.shape}: this model routes [B, T, {expected[0]}, {expected[1]}]')
    return jnp.moveaxis(routes, 2, 0)

  def lm_head_weight(self) -> jax.Array:
    """[D, V] in the compute dtype; the transposed embedding when tied."""
    if self.config.tie_word_embeddings:
      return self.embedding[...].astype(self.dtype).T
    return self.lm_head[...].astype(self.dtype)

  def project(self, hidden: jax.Array) -> jax.Array:
    """hidden [B, T, D] -> logits [B, T, V], accumulated and returned in fp32."""
    logits = jnp.einsum('BTD,DV->BTV', hidden.astype(self.dtype), self.lm_head_weight(),
                        preferred_element_type=jnp.float32)
    return constrain(logits, ('batch', 'seq', 'vocab'))

  def _embed(self, tokens: jax.Array) -> jax.Array:
    if not isinstance(tokens, jax.core.Tracer) and getattr(tokens, 'is_fully_addressable', True):
      # An eager call checks its ids here; under jit the doors that take ids check them
      # (token_ids.py): a traced lookup cannot raise, and would answer a bad id with a NaN row.
      check_token_ids(np.asarray(tokens), self.config.vocab_size, 'model input')
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
    return constrain(x, ('batch', 'seq', 'act_embed'))

  # ---- incremental decoding with a KV cache (prefill, then one token at a time) ----

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    c = self.config
    shape = (c.num_hidden_layers, batch_size, max_length, c.num_key_value_heads, c.resolved_head_dim)
    axes = ('layers', 'batch', 'cache_seq', 'kv_heads', 'head_dim')  # rows over the batch axes, KV heads over 'tensor'
    return KVCache(k=constrain(jnp.zeros(shape, self.dtype), axes), v=constrain(jnp.zeros(shape, self.dtype), axes),
                   segment_ids=constrain(jnp.zeros((batch_size, max_length), jnp.int32), ('batch', 'cache_seq')),
                   length=constrain(jnp.zeros((batch_size,), jnp.int32), ('batch',)))

  def extend(self, tokens: jax.Array, cache: KVCache, *, positions: jax.Array | None = None,
             segment_ids: jax.Array | None = None, return_hidden: bool = False,
             prefix: SharedPrefix | None = None, return_routing: bool = False):
    """Appends T tokens per row to the cache and returns their logits [B, T, V] and the new cache.

    return_hidden: return the final-norm hidden states [B, T, D] instead of logits, so a prefill
    can project only the positions it samples from (a [P, Tp, V] logits array of a long prompt
    batch over Qwen's 151,936-token vocabulary would be tens of GB).

    Prefill is `extend` of a (left- or right-padded) prompt on an empty cache; decoding is `extend`
    of one token. Each row holds one sequence; by default a token's position is the number of
    real (segment id != 0) tokens before it in its row. The caller keeps length + T <= S.

    prefix: a SharedPrefix each row reads before its own cache row (which then holds only what
    follows the prompt); its real tokens count towards the positions and are attended with the
    same segment rule. Only `cache` is written.

    return_routing: return (out, cache, Routing) with what the sparse layers did for these
    tokens (its `experts` [B, T, Ls, k] are what the sampler records; None in a dense model).
    """
    segment_ids = _segments(tokens, segment_ids)
    prefix_segments = None if prefix is None else prefix.rows(prefix.segment_ids)  # [B, W]
    if positions is None:
      previous = jnp.sum(cache.segment_ids != 0, axis=1, dtype=jnp.int32)
      if prefix is not None:
        previous = previous + jnp.sum(prefix_segments != 0, axis=1, dtype=jnp.int32)
      running = jnp.cumsum(segment_ids != 0, axis=1, dtype=jnp.int32) - 1
      positions = previous[:, None] + jnp.maximum(running, 0)
    length = tokens.shape[1]
    query_slots = cache.length[:, None] + jnp.arange(length, dtype=jnp.int32)
    key_slots = jnp.broadcast_to(jnp.arange(cache.max_length, dtype=jnp.int32),
                                 cache.segment_ids.shape)
    # Cached slots before `length` (the slots from `length` on are this call's tokens, attended
    # through `mask`, or still empty).
    cache_mask = (attention_mask(query_slots, segment_ids, key_slots, cache.segment_ids)
                  & (key_slots < cache.length[:, None])[:, None, :])
    mask = attention_mask(query_slots, segment_ids, query_slots, segment_ids)

    # The cache is a layer input, read in place; only the T new tokens' keys and values leave each
    # layer, and they are written into the cache once, after the loop. Carrying the stacked cache
    # through a scan instead copies each layer's [B, S, K, H] slice in and out every step.
    # The prompt's keys come before all of the row's own: only the segment rule applies.
    prefix_mask = (None if prefix is None else
                   (prefix_segments[:, None, :] == segment_ids[:, :, None]) & (prefix_segments != 0)[:, None, :])

    implementation = self.options.decode_attention
    stacked = reads_stacked_cache(implementation)

    def layer(x, params, layer_cache, _):
      own, *shared = layer_cache  # this layer's cache rows, or (stacked) its index into the stack
      parts = [] if prefix is None else [(prefix.rows(shared[0]), prefix.rows(shared[1]), prefix_mask)]

      def attend(q, k, v):
        # Round the new keys and values to the cache dtype, as writing them first would.
        new = (k.astype(cache.k.dtype), v.astype(cache.v.dtype), mask)
        return cache_attention(implementation, q, new, parts, cache.k, cache.v, own, cache_mask, cache.length,
                               cache.segment_ids, segment_ids, query_slots, self.options.decode_block)

      return decoder_block(params, x, positions, attend, config=self.config, dtype=self.dtype,
                           lora_scale=self.lora_scale, real=segment_ids != 0)

    own = jnp.arange(self.config.num_hidden_layers, dtype=jnp.int32) if stacked else (cache.k, cache.v)
    layer_caches = (own,) + (() if prefix is None else (prefix.k, prefix.v))
    x, (k_new, v_new), routing = self.run_layers(self._embed(tokens), layer, layer_caches)
    hidden = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
    if length == cache.max_length:
      # The tokens fill the whole cache (so it was empty: length + T <= S): it is the new keys and
      # values themselves. No scatter, which on a mesh would gather every row's keys to every device.
      new_cache = KVCache(k=k_new.astype(cache.k.dtype), v=v_new.astype(cache.v.dtype), segment_ids=segment_ids,
                          length=cache.length + length)
    else:
      new_cache = KVCache(k=_write_layers(cache.k, k_new.astype(cache.k.dtype), cache.length),
                          v=_write_layers(cache.v, v_new.astype(cache.v.dtype), cache.length),
                          segment_ids=_write_rows(cache.segment_ids, segment_ids, cache.length),
                          length=cache.length + length)
    out = hidden if return_hidden else self.project(hidden)
    return (out, new_cache, _gathered(routing)) if return_routing else (out, new_cache)
