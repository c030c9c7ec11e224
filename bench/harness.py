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


def donated_update(architecture, algo, batch, dtype: str = 'float32'):
  """(step, compiled, live) of the trainer's own rl.update.update for `algo` (an AlgoConfig) on
  `batch`, jitted as rl/step.py jits it (state donated) on one device: step() runs one update and
  waits for it, live['metrics'] holds its last metrics. Imports jax: call after limit_threads."""
  import functools

  import jax
  from flax import nnx

  from grpo_jax import config as config_lib
  from grpo_jax.model import MeshConfig, ModelOptions, init_model, make_mesh
  from grpo_jax.rl import update as update_lib
  from grpo_jax.rl.held import Held
  from grpo_jax.rl.state import create_train_state

  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(init_model(architecture, options=ModelOptions(dtype=dtype), mesh=mesh))
  optimizer, schedule = config_lib.OptimConfig(learning_rate=1e-6).build(100)
  settings = update_lib.UpdateSettings(algo=algo, temperature=1.0, rows=batch.size, sequence_length=batch.tokens.shape[1])
  with jax.set_mesh(mesh):
    state = create_train_state(params, optimizer, 0)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  update = jax.jit(functools.partial(update_lib.update, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                                     settings=settings),
                   donate_argnums=0, out_shardings=(jax.tree.map(lambda x: x.sharding, state), replicated))
  with jax.set_mesh(mesh):
    compiled = update.lower(state, batch, Held()).compile()
  live = dict(state=state)

  def step():
    with jax.set_mesh(mesh):
      live['state'], live['metrics'] = jax.block_until_ready(compiled(live['state'], batch, Held()))

  return step, compiled, live
