"""Sampling from Qwen2 models: token selection, the one prefill and decode step, the GRPO group
sampler (prefill once, decode in one jit) and the JetStream engine with host-side slot refilling.
Nothing here imports jetstream."""

from grpo_jax.sampler.decode import DecodeSettings, DecodeState, Emitted, Prefix, decode_step, prefill
from grpo_jax.sampler.engine import QwenEngine
from grpo_jax.sampler.rollout import GroupSampler, Rollout, sample_groups
from grpo_jax.sampler.sampling import SamplingConfig, select, truncated_logits
from grpo_jax.sampler.special_tokens import SpecialTokens, special_tokens

__all__ = ['DecodeSettings', 'DecodeState', 'Emitted', 'GroupSampler', 'Prefix', 'QwenEngine', 'Rollout',
           'SamplingConfig', 'SpecialTokens', 'decode_step', 'prefill', 'sample_groups',
           'select', 'special_tokens', 'truncated_logits']
