"""Sampling from Qwen2 models: token selection now; the group sampler and JetStream engine build on it."""

from grpo_jax.sampler.sampling import SamplingConfig, select, truncated_logits

__all__ = ['SamplingConfig', 'select', 'truncated_logits']
