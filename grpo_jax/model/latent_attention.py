"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Moonlight, Kimi-K2), the attention block beside
grouped-query attention that a config with kv_lora_rank > 0 builds (model/layers.decoder_block).

Each token's keys and values come from one latent c = norm(x W_kv_a[:R]) of R = kv_lora_rank values
and one rotary key k_r = rope(x W_kv_a[R:]) of Hr values that every head shares. Head n's key is
[c W_uk_n, k_r] (Hn + Hr values) and its value c W_uv_n (Hv), both up-projections of the latent by
the two halves of kv_b_weight [R, N, Hn + Hv]. Queries are x W_q, or with q_lora_rank a latent of
their own, norm(x W_q_a) W_q_b; each head's last Hr values rotate.

Two forms compute the same attention:

  expanded   keys and values per head, [B, T, N, Hn + Hr] and [B, T, N, Hv]: attention as for any
             model (the full-sequence forward: training, scoring, where the T x T scores dominate
             and the per-head keys cost nothing to keep).
  absorbed   the up-projections folded into the query and the output: q_n W_uk_n^T against the
             latent, so all heads read one key of R + Hr values per token, and the probabilities
             weight the latent itself before W_uv_n takes it to the head's value width. This is
             what the KV cache holds: [c, k_r] per token and layer (576 values for DeepSeek-V3
             instead of 128 heads x (192 + 128) = 40,960), its values the first R of them (a value
             width of 0 in the cache; Qwen2Config.cache_entry).

The scores are scaled by (Hn + Hr)^-1/2 (times YaRN's mscale squared: Qwen2Config.attention_scale)
in both forms, folded into the query, since every attention path scales by its query width^-1/2.
"""

import jax
import jax.numpy as jnp

from grpo_jax.model.config import Qwen2Config


def latent_attention_inputs(p: dict, h: jax.Array, positions: jax.Array, inverse_frequency: jax.Array, *,
                            config: Qwen2Config, absorbed: bool, project, norm, rope, lora_scale: float = 0.0):
  """One layer's attention inputs from the normed hidden state h [B, T, D]. p: the layer's
  parameters in the compute dtype; project(x, target) a projection with its LoRA factors (model/lora.py
  TARGETS: q, q_a, q_b, kv_a, kv_b), norm(x, name) the layer's RMSNorm by parameter name,
  rope(x [B, T, n, Hr], positions) the rotation; lora_scale the adapters' (the absorbed form folds
  kv_b's adapter into its weight).

  -> (q, k, v, finish, entry): attend(q, k, v) then finish(that) gives the heads' outputs
  [B, T, N, Hv] for o_weight; entry (keys, values) is what the KV cache keeps of these tokens
  (absorbed: [B, T, 1, R + Hr] and a [B, T, 1, 0] placeholder; expanded: the per-head keys and
  values themselves)."""
  c = config
  nope, latent_width = c.qk_nope_head_dim, c.kv_lora_rank
  if c.latent_queries:
    q = project(norm(project(h, 'q_a'), 'q_a_norm'), 'q_b')  # [B, T, N, Hn + Hr]
  else:
    q = project(h, 'q')
  compressed = project(h, 'kv_a')  # [B, T, R + Hr]
  latent = norm(compressed[..., :latent_width], 'kv_a_norm')  # [B, T, R]
  key_rope = rope(compressed[..., None, latent_width:], positions)  # [B, T, 1, Hr], shared by the heads
  q_nope, q_rope = q[..., :nope], rope(q[..., nope:], positions)
  scale = c.attention_scale()
  if not absorbed:
    heads = q.shape[-2]
    k_nope, v = jnp.split(project(latent, 'kv_b'), [nope], axis=-1)  # [B, T, N, Hn], [B, T, N, Hv]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(key_rope, key_rope.shape[:2] + (heads, key_rope.shape[-1]))], -1)
    q = _scaled(jnp.concatenate([q_nope, q_rope], axis=-1), scale)
    return q, k, v, (lambda out: out), (k, v)
  up = p['kv_b_weight']  # [R, N, Hn + Hv], with its adapter's low-rank update when it has one
  if 'kv_b_lora_a' in p:
    update = jnp.einsum('Rr,rNB->RNB', p['kv_b_lora_a'], p['kv_b_lora_b'], preferred_element_type=jnp.float32)
    up = (up.astype(jnp.float32) + lora_scale * update).astype(up.dtype)
  up_keys, up_values = up[..., :nope], up[..., nope:]  # [R, N, Hn], [R, N, Hv]
  # The absorbed query: each head's non-rotary query taken into the latent's space, [B, T, N, R].
  q_latent = jnp.einsum('BTNh,RNh->BTNR', q_nope, up_keys, preferred_element_type=jnp.float32).astype(q.dtype)
  q = _scaled(jnp.concatenate([q_latent, q_rope], axis=-1), scale)
  k = jnp.concatenate([latent[:, :, None, :], key_rope], axis=-1)  # [B, T, 1, R + Hr]

  def finish(out):  # [B, T, N, R] weighted latents -> [B, T, N, Hv]
    return jnp.einsum('BTNR,RNv->BTNv', out, up_values, preferred_element_type=jnp.float32).astype(out.dtype)
  return q, k, latent_values(c, k), finish, (k, k[..., :0])


def _scaled(q: jax.Array, scale: float) -> jax.Array:
  """q with the scores' scale folded in: every attention path scales by q's width^-1/2, MLA's
  scores by `scale`; multiplied in fp32 (the factor unrounded) and rounded once to q's dtype."""
  return (q.astype(jnp.float32) * (scale * q.shape[-1] ** 0.5)).astype(q.dtype)


def latent_values(config: Qwen2Config, k: jax.Array) -> jax.Array:
  """The values of absorbed-form keys [..., R + Hr] read from a cache: their first R (the latent)."""
  return k[..., :config.kv_lora_rank]
