"""Shared benchmark plumbing: architectures, CPU thread limits and interleaved timing. Imports no
jax (grpo_jax.model.presets starts none either), so `limit_threads` can run before jax starts its CPU
client."""

import os
import statistics
import time

from grpo_jax.model.presets import QWEN2_5_PRESETS

# Qwen2 architectures the benchmarks run (keyword arguments of grpo_jax.model.Qwen2Config): two
# bench-only shapes, and the Qwen2.5 sizes as 'qwen2.5-0.5b' ... 'qwen2.5-72b'.
ARCHITECTURES = {
    'small': dict(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    'mid': dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    **{f'qwen2.5-{size.lower()}': shape for size, shape in QWEN2_5_PRESETS.items()},
}


def presets(*names: str) -> dict:
  return {name: ARCHITECTURES[name] for name in names}


def limit_threads(threads: int) -> None:
  """Caps XLA:CPU (and PyTorch in this process) at `threads` cores. Call before importing jax."""
  # XLA reads its thread settings once, when the CPU client starts.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_multi_thread_eigen=true'
                             f' intra_op_parallelism_threads={threads}').strip()
  if threads < os.cpu_count() and hasattr(os, 'sched_setaffinity'):
    # The flags above do not cap XLA:CPU's pool (measured: still ~1.9 cores busy with N=1); it
    # is sized from the cores this process may run on, so pin the process to N of them.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])


def timed(step) -> float:
  start = time.perf_counter()
  step()
  return time.perf_counter() - start


def interleaved(steps: dict, repeats: int) -> dict:
  """name -> (first call incl. compile, median of `repeats` calls). The implementations take
  turns each repetition so drift in machine load (a shared VM) hits all alike."""
  first = {name: timed(step) for name, step in steps.items()}
  times = {name: [] for name in steps}
  for _ in range(repeats):
    for name, step in steps.items():
      times[name].append(timed(step))
  return {name: (first[name], statistics.median(times[name])) for name in steps}


def stop_tokens(vocab_size: int, mean: float) -> tuple[int, ...]:
  """A random 1/mean share of the vocabulary: a random model's next-token distribution is close
  to uniform, so an answer stops at each step with probability ~1/mean (long-tailed lengths)."""
  import numpy as np  # here, not at the top: limit_threads must come before numpy sizes its pools
  count = max(1, round(vocab_size / mean))
  return tuple(int(t) for t in np.random.default_rng(1).choice(vocab_size, count, replace=False))


class LongTailTask:
  """Random prompts; answers stop at any of `stops` (stop_tokens: long-tailed lengths); reward:
  the share of even tokens in the answer (a JAX function, so whole steps can run in one jit)."""

  jittable = True
  vision_bucket = None  # text prompts
  pad_id = 0

  def __init__(self, vocab_size: int, prompt_length: int, stops: tuple[int, ...]):
    self.vocab_size, self.prompt_length, self.stop_token_ids = vocab_size, prompt_length, stops

  def prompts(self, key, position, count):
    import jax
    import jax.numpy as jnp
    from grpo_jax.data.task import Prompts
    tokens = jax.random.randint(jax.random.fold_in(key, position), (count, self.prompt_length), 1, self.vocab_size)
    return Prompts(tokens=tokens.astype(jnp.int32), mask=jnp.ones((count, self.prompt_length), jnp.int32),
                   answers=jnp.zeros((count, 1), jnp.int32))

  def reward(self, rollout, prompts, group_size, model_scores):
    import jax.numpy as jnp
    from grpo_jax.data.task import Scores
    even = jnp.sum((rollout.tokens % 2 == 0) & rollout.mask, axis=1) / jnp.maximum(rollout.lengths, 1)
    return Scores(rewards=even.astype(jnp.float32), failures=jnp.int32(0))

  def close(self):
    pass
