"""Fused ops: per-token log-probs and entropy over a large vocabulary."""

from grpo_jax.ops.logprob import IMPLEMENTATIONS, token_logprobs

__all__ = ['IMPLEMENTATIONS', 'token_logprobs']
