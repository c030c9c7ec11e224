"""Checkpoint conversion between Hugging Face safetensors and grpo_jax (orbax) checkpoints."""
