"""Sampling from Qwen2 models: token selection, the one prefill and decode step, the decode slots,
the GRPO group sampler (prefill once, decode in one jit), the pool of partial rollouts and the
rollout layout. Serving (the JetStream engine, request rules) lives in grpo_jax/serve/, above this
package: a training run never imports it."""

from grpo_jax.sampler.decode import DecodeSettings, DecodeState, Emitted, Prefix, decode_step, prefill
from grpo_jax.sampler.rollout import GroupSampler, Rollout, sample_groups
from grpo_jax.sampler.sampling import SamplingConfig, select, truncated_logits
from grpo_jax.sampler.special_tokens import SpecialTokens, special_tokens

__all__ = ['DecodeSettings', 'DecodeState', 'Emitted', 'GroupSampler', 'Prefix', 'Rollout',
           'SamplingConfig', 'SpecialTokens', 'decode_step', 'prefill', 'sample_groups',
           'select', 'special_tokens', 'truncated_logits']
