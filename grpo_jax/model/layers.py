"""The decoder's layers: their stacked parameters and one layer's computation.

Layer parameters are stored stacked along a leading layer axis L, so the decoder runs as one
`lax.scan` (compile time independent of depth) or, with `scan_layers=False`, as an unrolled loop
over the same arrays (qwen2.Qwen2.run_layers). Parameter names carry their dimension letters:

  attn_norm      [L, D]            mlp_norm    [L, D]
  attn_post_norm [L, D]            mlp_post_norm [L, D]             (sandwich_norms: GLM-4, Gemma 3)
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

The families beyond Qwen act here and nowhere else in the layer: the norm ((1 + w) with
`norm_offset`), the extra norms on the attention's and the MLP's outputs (`sandwich_norms`), the
MLP's activation (`hidden_act`), the rotary embedding (frequencies per layer from
`inverse_frequencies`: scaled, partial, interleaved, local or global) and the query's scale
(`query_pre_attn_scalar`). The sliding window is the attention's mask (model/qwen2.py).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.model.attention import Attend
from grpo_jax.model.config import DENSE_MLP_PARAMS, EXPERT_PARAMS, Qwen2Config
from grpo_jax.model.linear import matmul
from grpo_jax.model.lora import TARGETS, Adapter, LoraConfig, adapted_weight, adapter_names, adapter_shapes, init_a
from grpo_jax.model.latent_attention import latent_attention_inputs
from grpo_jax.model.moe import Router, Routing, sparse_mlp
from grpo_jax.model.quantize import dequantize
from grpo_jax.ops import fixed_order
from grpo_jax.sharding import constrain

# Multi-head latent attention's (model/latent_attention.py), beside q_weight (without q_lora_rank) and o_weight.
LATENT_ATTENTION_PARAMS = ('q_a_weight', 'q_a_norm', 'q_b_weight', 'kv_a_weight', 'kv_a_norm', 'kv_b_weight')
LAYER_PARAMS = ('attn_norm', 'q_weight', 'q_bias', 'q_norm', 'k_weight', 'k_bias', 'k_norm', 'v_weight', 'v_bias',
                *LATENT_ATTENTION_PARAMS, 'o_weight', 'attn_post_norm', 'mlp_norm', 'mlp_post_norm',
                *DENSE_MLP_PARAMS, *EXPERT_PARAMS)
# Kept in fp32 whatever the compute dtype: DeepSeekMoE's router, as transformers keeps it.
FP32_ROUTER_PARAMS = ('router_weight', 'router_bias')
ACTIVATION_FUNCTIONS = {'silu': jax.nn.silu, 'gelu_pytorch_tanh': lambda x: jax.nn.gelu(x, approximate=True)}


def layer_params(config: Qwen2Config) -> tuple[str, ...]:
  """The names of LAYER_PARAMS this architecture has."""
  absent = (() if config.attention_bias else ('q_bias', 'k_bias', 'v_bias')) + (() if config.qk_norm else
                                                                                  ('q_norm', 'k_norm'))
  absent += (() if config.num_sparse_layers else EXPERT_PARAMS)
  absent += (() if config.sandwich_norms else ('attn_post_norm', 'mlp_post_norm'))
  absent += (() if config.num_sparse_layers < config.num_hidden_layers else DENSE_MLP_PARAMS)
  absent += (() if config.grouped_attention else ('k_weight', 'v_weight'))
  absent += (() if config.direct_queries else ('q_weight',))
  absent += (() if config.latent_queries else ('q_a_weight', 'q_a_norm', 'q_b_weight'))
  absent += (() if config.mla else ('kv_a_weight', 'kv_a_norm', 'kv_b_weight'))
  absent += (() if config.router_scoring == 'sigmoid' else ('router_bias',))
  absent += (() if config.n_shared_experts else ('shared_gate_weight', 'shared_up_weight', 'shared_down_weight'))
  return tuple(name for name in LAYER_PARAMS if name not in absent)


def stacked_layers(config: Qwen2Config, name: str) -> tuple[int, ...]:
  """The layers whose slices the stacked parameter `name` holds, in order (an adapter factor's:
  its weight's)."""
  return config.layers_holding(adapted_weight(name) or name)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: bool = False) -> jax.Array:
  """RMSNorm computed in fp32. Scaled by w after the cast back to x's dtype (Qwen2, Llama), or with
  `offset` by (1 + w) in fp32 before it (Gemma 3)."""
  x32 = x.astype(jnp.float32)
  if fixed_order.exact('sum'):
    # Exact numerics: the mean of squares folded over D, and x divided by the root: a square root and
    # a division round correctly everywhere, where the compiler's rsqrt rounded one way in one program
    # and another in the next (measured at XLA:CPU's default optimisation level).
    mean = fixed_order.fold_sum(fixed_order.settle(x32 * x32), axis=-1)[..., None] / x.shape[-1]
    normed = fixed_order.settle(x32 / fixed_order.settle(jnp.sqrt(mean + eps)))
  else:
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if offset:
    return fixed_order.settle((normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype))
  return fixed_order.settle(weight.astype(x.dtype) * normed.astype(x.dtype))


def rotate(x: jax.Array, angles: jax.Array, interleaved: bool = False, scale: float = 1.0) -> jax.Array:
  """Rotary embedding of x [..., T, n, R] by angles [..., T, R/2] (fp32): pair (i, i + R/2) by
  angles[i] (the half-split convention), or with `interleaved` pair (2i, 2i + 1) (GLM-4's,
  DeepSeek-V3's); cos and sin times `scale` (YaRN's attention factor)."""
  cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x32 = x.astype(jnp.float32)
  # Under exact numerics the products are settled before they are added (ops/fixed_order.settle):
  # a multiply fused into the add rounds once, not twice, in some places of a program and not others.
  settle = fixed_order.settle
  if interleaved:
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
    (a, b), (c, d) = settle(((x1 * cos, x2 * sin), (x2 * cos, x1 * sin)))
    return jnp.stack([a - b, c + d], axis=-1).reshape(x.shape).astype(x.dtype)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  (a, b), (c, d) = settle(((x1 * cos, x2 * sin), (x2 * cos, x1 * sin)))
  return jnp.concatenate([a - b, c + d], axis=-1).astype(x.dtype)


def _frequencies(config: Qwen2Config, theta: float, scaled: bool) -> np.ndarray:
  """[R/2] fp32 inverse frequencies of base `theta` over the rotated part R; `scaled`: stretched as
  rope_type says ('linear': all divided by rope_factor; 'llama3': long wavelengths divided, short
  ones kept, the band between blended)."""
  dim = config.rotary_dim
  frequency = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
  if not scaled or config.rope_type == 'default':
    return frequency
  factor = np.float32(config.rope_factor)
  if config.rope_type == 'linear':
    return frequency / factor
  if config.rope_type == 'yarn':
    return _yarn_frequencies(config, theta)
  original = np.float32(config.rope_original_max_position_embeddings)
  low, high = np.float32(config.rope_low_freq_factor), np.float32(config.rope_high_freq_factor)
  wavelength = np.float32(2 * np.pi) / frequency
  long_waves = np.where(wavelength > original / low, frequency / factor, frequency)
  weight = (original / wavelength - low) / (high - low)  # 0 at the long edge of the band, 1 at the short
  blended = (1 - weight) * long_waves / factor + weight * long_waves
  band = (wavelength >= original / high) & (wavelength <= original / low)
  return np.where(band, blended, long_waves).astype(np.float32)


def _yarn_frequencies(config: Qwen2Config, theta: float) -> np.ndarray:
  """YaRN's [R/2] fp32 frequencies: those that turn fewer than beta_slow times over the original
  context divided by rope_factor (interpolated), those that turn more than beta_fast times kept
  (extrapolated), a linear ramp over the dimensions between."""
  dim, original = config.rotary_dim, config.rope_original_max_position_embeddings

  def correction(rotations):  # the dimension whose wavelength fits `rotations` times in the original context
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
  low, high = correction(config.rope_beta_fast), correction(config.rope_beta_slow)
  if config.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  powers = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
  kept, divided = np.float32(1.0) / powers, np.float32(1.0) / (np.float32(config.rope_factor) * powers)
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
  extrapolated = np.float32(1.0) - ramp.astype(np.float32)
  return (divided * (1 - extrapolated) + kept * extrapolated).astype(np.float32)


def inverse_frequencies(config: Qwen2Config) -> np.ndarray:
  """[L, R/2] fp32: each layer's RoPE frequencies. With layer_types the sliding layers rotate by
  their own base (local_rope_theta, unscaled; Gemma 3), the others by rope_theta as rope_type
  scales it."""
  local = config.sliding_layers if config.layer_types else (False,) * config.num_hidden_layers
  return np.stack([_frequencies(config, config.local_rope_theta, False) if sliding
                   else _frequencies(config, config.rope_theta, True) for sliding in local])


def apply_rope(x: jax.Array, positions: jax.Array, inverse_frequency: jax.Array, mrope_section: tuple[int, ...] = (),
               interleaved: bool = False, scale: float = 1.0) -> jax.Array:
  """RoPE of x [B, T, n, H] at positions [B, T] by inverse_frequency [R/2]: the first R of H
  rotate (pairs as `rotate` says), the rest pass. With `mrope_section` (M-RoPE) positions may be
  [B, T, 3] (temporal, row, column), frequency i rotating by the component its section names
  (sections cycle 0, 1, 2); [B, T] positions are the same on all three, i.e. plain RoPE."""
  rotary = 2 * inverse_frequency.shape[-1]
  positions = positions.astype(jnp.float32)
  if positions.ndim == 3:
    component = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)  # [H/2]
    angles = positions[..., component] * inverse_frequency
  else:
    angles = positions[..., None] * inverse_frequency  # [B, T, R/2]
  if rotary == x.shape[-1]:
    return rotate(x, angles, interleaved, scale)
  return jnp.concatenate([rotate(x[..., :rotary], angles, interleaved, scale), x[..., rotary:]], axis=-1)


def decoder_block(params: dict, x: jax.Array, positions: jax.Array, attend: Attend, *,
                  config: Qwen2Config, dtype, inverse_frequency: jax.Array, lora_scale: float = 0.0,
                  real: jax.Array | None = None, replay: jax.Array | None = None,
                  absorbed: bool = False) -> tuple[jax.Array, tuple[jax.Array, jax.Array], Routing | None]:
  """One pre-norm decoder layer. params: one layer's slice of `LAYER_PARAMS` (and of the LoRA
  factors, added to their projection's output scaled by `lora_scale`, unmerged); x: [B, T, D];
  positions: [B, T] (or [B, T, 3] with M-RoPE); inverse_frequency [R/2]: this layer's RoPE
  (inverse_frequencies); attend(q [B, T, N, H], k, v [B, T, K, H]) -> [B, T, N, H] is the attention
  (over the T tokens, and for `extend` over the cache too). A sparse layer (its slice holds
  `router_weight`) routes as model/moe.py says: real [B, T] marks the tokens its load statistics
  count, replay [B, T, k] the experts to route to (None: the router's top k). -> (x [B, T, D], this
  layer's keys and values [B, T, K, H] in the compute dtype, its Routing or None when dense).

  Multi-head latent attention (config.mla, model/latent_attention.py) computes in its expanded
  form, or with `absorbed` (what a KV cache holds) in its absorbed one: attend then takes queries
  [B, T, N, R + Hr] over one key head [B, T, 1, R + Hr] whose values are its first R, and the
  keys and values returned are the cache's entry ([B, T, 1, R + Hr] and a [B, T, 1, 0] placeholder).
  """
  kept = FP32_ROUTER_PARAMS if config.router_scoring == 'sigmoid' else ()
  p = {name: value if name in kept else value.astype(dtype) for name, value in params.items()}

  def project(x, target, contract=1):
    y = matmul(x, p[TARGETS[target][0]], contract)
    a, b = adapter_names(target)
    if a not in p:
      return y
    # x A as (A^T x^T)^T: with x on the other side of the dot, XLA:GPU's dot merger does not join it
    # with x W into one matmul over [W | A], which wrote a copy of W every step (bench/lora.py --target).
    rows, rank = x.shape[:x.ndim - contract], p[a].shape[-1]
    flat = x.reshape(-1, math.prod(x.shape[x.ndim - contract:]))
    if fixed_order.exact('matmul'):
      xa = matmul(flat, p[a].reshape(-1, rank)).reshape(*rows, rank)
    else:
      xa = jnp.einsum('ir,ni->rn', p[a].reshape(-1, rank), flat).T.reshape(*rows, rank)
    return y + fixed_order.settle((matmul(xa, p[b]) * jnp.asarray(lora_scale, dtype)).astype(y.dtype))

  def norm(x, name):
    return rms_norm(x, p[name], config.rms_norm_eps, config.norm_offset)

  # settle: under exact numerics each value between the fixed-order ops materialised as computed
  # (ops/fixed_order.settle); a no-op otherwise.
  settle = fixed_order.settle
  h = norm(x, 'attn_norm')
  if config.mla:
    rope = lambda x, positions: apply_rope(x, positions, inverse_frequency, interleaved=config.rope_interleaved,  # noqa: E731
                                           scale=config.rope_attention_factor())
    q, k, v, finish, entry = latent_attention_inputs(p, h, positions, inverse_frequency, config=config,
                                                     absorbed=absorbed, project=project, norm=norm, rope=rope,
                                                     lora_scale=lora_scale)
    out = project(finish(attend(q, k, v)), 'o', contract=2)
    return _mlp_block(p, x, out, config, dtype, project, norm, real, replay, entry)
  q, k, v = project(h, 'q'), project(h, 'k'), project(h, 'v')
  if config.attention_bias:
    q, k, v = settle((q + p['q_bias'], k + p['k_bias'], v + p['v_bias']))
  if config.qk_norm:  # each head's query and key normalised over H, before the rotation
    q, k = norm(q, 'q_norm'), norm(k, 'k_norm')
  factor = config.rope_attention_factor()
  q = settle(apply_rope(q, positions, inverse_frequency, config.mrope_section, config.rope_interleaved, factor))
  k = settle(apply_rope(k, positions, inverse_frequency, config.mrope_section, config.rope_interleaved, factor))
  if config.query_pre_attn_scalar is not None:
    # Every attention path scales scores by H^-1/2; Gemma 3 scales them by query_pre_attn_scalar^-1/2,
    # folded into the query (the cached keys stay as they are).
    q = settle(q * jnp.asarray((q.shape[-1] / config.query_pre_attn_scalar) ** 0.5, q.dtype))
  out = project(attend(q, k, v), 'o', contract=2)
  return _mlp_block(p, x, out, config, dtype, project, norm, real, replay, (k, v))


def _mlp_block(p: dict, x: jax.Array, attended: jax.Array, config: Qwen2Config, dtype, project, norm, real, replay,
               entry) -> tuple[jax.Array, tuple[jax.Array, jax.Array], Routing | None]:
  """The rest of decoder_block after the attention's output `attended` [B, T, D]: the residual,
  the MLP (dense, or the experts and DeepSeekMoE's shared experts) and its residual."""
  settle = fixed_order.settle
  x = settle(x + (norm(attended, 'attn_post_norm') if config.sandwich_norms else attended))
  x = constrain(x, ('batch', 'seq', 'act_embed'))
  h = norm(x, 'mlp_norm')
  routing = None
  swiglu = lambda h, gate, up: settle(ACTIVATION_FUNCTIONS[config.hidden_act](gate(h)) * up(h))  # noqa: E731
  if 'router_weight' in p:
    real = jnp.ones(h.shape[:2], bool) if real is None else real
    # 8-bit experts (the sampler's, model/quantize.py) enter the grouped matmuls in the compute dtype;
    # DeepSeekMoE's router stays in fp32.
    kept = FP32_ROUTER_PARAMS if config.router_scoring == 'sigmoid' else ()
    experts = {name: value if name in kept else dequantize(value, dtype) for name, value in p.items()}
    out, routing = sparse_mlp(experts, h, real, top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                              replay=replay, router=Router.of(config))
    if 'shared_gate_weight' in p:  # DeepSeekMoE's shared experts: every token's, unweighted
      shared = swiglu(h, lambda h: project(h, 'shared_gate'), lambda h: project(h, 'shared_up'))
      out = settle(out + project(shared, 'shared_down'))
  elif len(p['gate_weight'].shape) == 3:  # a decode loop's gate and up as one [D, F, 2] weight (Qwen2.loop_view)
    both = matmul(h, p['gate_weight'])
    out = project(settle(ACTIVATION_FUNCTIONS[config.hidden_act](both[..., 0]) * both[..., 1]), 'down')
  else:
    out = project(swiglu(h, lambda h: project(h, 'gate'), lambda h: project(h, 'up')), 'down')
  if config.sandwich_norms:
    out = norm(out, 'mlp_post_norm')
  return constrain(settle(x + out), ('batch', 'seq', 'act_embed')), entry, routing


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
    one = 0.0 if c.norm_offset else 1.0  # a norm's identity weight: (1 + w) with norm_offset
    self.attn_norm = constant(one, (L, D), ('layers', 'act_embed'))
    if c.direct_queries:
      self.q_weight = weight((L, D, N, H), ('layers', 'embed', 'q_heads', 'head_dim'))
    if c.grouped_attention:
      self.k_weight = weight((L, D, K, H), ('layers', 'embed', 'kv_heads', 'head_dim'))
      self.v_weight = weight((L, D, K, H), ('layers', 'embed', 'kv_heads', 'head_dim'))
    # Multi-head latent attention (model/latent_attention.py): the up-projections' latent rank R
    # is FSDP's dimension there ('latent'); the latents themselves are activations, replicated.
    if c.latent_queries:
      self.q_a_weight = weight((L, D, c.q_lora_rank), ('layers', 'embed', None))
      self.q_a_norm = constant(one, (L, c.q_lora_rank), ('layers', None))
      self.q_b_weight = weight((L, c.q_lora_rank, N, H), ('layers', 'latent', 'q_heads', 'head_dim'))
    if c.mla:
      R = c.kv_lora_rank
      self.kv_a_weight = weight((L, D, R + c.qk_rope_head_dim), ('layers', 'embed', None))
      self.kv_a_norm = constant(one, (L, R), ('layers', None))
      self.kv_b_weight = weight((L, R, N, c.qk_nope_head_dim + c.v_head_dim),
                                ('layers', 'latent', 'q_heads', 'head_dim'))
    if c.attention_bias:
      self.q_bias = constant(0.0, (L, N, H), ('layers', 'q_heads', 'head_dim'))
      self.k_bias = constant(0.0, (L, K, H), ('layers', 'kv_heads', 'head_dim'))
      self.v_bias = constant(0.0, (L, K, H), ('layers', 'kv_heads', 'head_dim'))
    if c.qk_norm:
      self.q_norm = constant(one, (L, H), ('layers', 'head_dim'))
      self.k_norm = constant(one, (L, H), ('layers', 'head_dim'))
    self.o_weight = weight((L, N, c.value_head_dim, D), ('layers', 'q_heads', 'head_dim', 'embed'))
    self.mlp_norm = constant(one, (L, D), ('layers', 'act_embed'))
    if c.sandwich_norms:
      self.attn_post_norm = constant(one, (L, D), ('layers', 'act_embed'))
      self.mlp_post_norm = constant(one, (L, D), ('layers', 'act_embed'))
    if Ld:
      self.gate_weight = weight((Ld, D, F), ('layers', 'embed', 'mlp'))
      self.up_weight = weight((Ld, D, F), ('layers', 'embed', 'mlp'))
      self.down_weight = weight((Ld, F, D), ('layers', 'mlp', 'embed'))
    if Ls:  # experts over the 'expert' mesh axis, each one's SwiGLU split like a dense MLP
      if c.router_scoring == 'sigmoid':  # DeepSeekMoE's router in fp32, its choice bias zero (as transformers inits it)
        self.router_weight = nnx.Param(normal(rngs.params(), (Ls, D, E), jnp.float32), logical_axes=('layers', 'embed', None))
        self.router_bias = nnx.Param(jnp.zeros((Ls, E), jnp.float32), logical_axes=('layers', None))
      else:
        self.router_weight = weight((Ls, D, E), ('layers', 'embed', None))
      if c.n_shared_experts:
        S = c.shared_expert_size
        self.shared_gate_weight = weight((Ls, D, S), ('layers', 'embed', 'mlp'))
        self.shared_up_weight = weight((Ls, D, S), ('layers', 'embed', 'mlp'))
        self.shared_down_weight = weight((Ls, S, D), ('layers', 'mlp', 'embed'))
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
