"""Fused ops: per-token log-probs and entropy over a large vocabulary."""

from grpo_jax.ops.logprob import IMPLEMENTATIONS, LogprobImplementation, token_logprobs

__all__ = ['IMPLEMENTATIONS', 'LogprobImplementation', 'token_logprobs']
