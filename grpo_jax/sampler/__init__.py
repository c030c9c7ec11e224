"""Sampling from Qwen2 models: token selection and the GRPO group sampler (prefill once, decode in one jit)."""

from grpo_jax.sampler.rollout import GroupSampler, Rollout, sample_groups
from grpo_jax.sampler.sampling import SamplingConfig, select, truncated_logits

__all__ = ['GroupSampler', 'Rollout', 'SamplingConfig', 'sample_groups', 'select', 'truncated_logits']
