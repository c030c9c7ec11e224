"""Sampling from Qwen2 models: token selection, the GRPO group sampler (prefill once, decode in one
jit) and the JetStream engine with host-side slot refilling. Nothing here imports jetstream."""

from grpo_jax.sampler.engine import QwenEngine
from grpo_jax.sampler.rollout import GroupSampler, Rollout, sample_groups
from grpo_jax.sampler.sampling import SamplingConfig, select, truncated_logits
from grpo_jax.sampler.slots import Completions, generate_groups

__all__ = ['Completions', 'GroupSampler', 'QwenEngine', 'Rollout', 'SamplingConfig', 'generate_groups',
           'sample_groups', 'select', 'truncated_logits']
