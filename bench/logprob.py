"""python bench/logprob.py [--tokens T] [--model D] [--vocab V] [--dtype D] [--time-tokens T] [--mesh M]

Token log-probs over the lm_head, forward + backward (value_and_grad of sum(logp) with respect to
hidden and weight): peak temporary device memory from XLA's memory analysis and median wall time
of naive (full logits) against xla_chunked and pallas, with ratios against naive.

Memory is read from the compiled executable, so it needs no allocation and always uses --tokens.
Timing runs the executables on --time-tokens tokens (default: --tokens), which lets a CPU with
too little RAM for the naive path's [T, V] fp32 arrays time a smaller problem. Pallas runs only
on TPU/GPU, or in interpret mode with --pallas-interpret (a correctness path, not a fast one).
FLOP rates count 4 matmuls of 2*T*D*V (forward, recomputed logits, dh, dW); naive really does 3
and the Pallas kernels 5, so the column compares against the same nominal work.

--mesh data=A,fsdp=B,tensor=C runs every implementation under that device mesh (on CPU, as many
host devices are made), with tokens split over data x fsdp and W laid out as the model lays out
its lm_head (D over fsdp, V over tensor). Memory is then per device, and FLOP rates are totals.
"""

import argparse
import os
import statistics
import time


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--tokens', type=int, default=8 * 2048, help='T (batch x sequence)')
  parser.add_argument('--model', type=int, default=896, help='D, hidden size')
  parser.add_argument('--vocab', type=int, default=151936, help='V, vocabulary size')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--time-tokens', type=int, default=None,
                      help='T for timing (default: --tokens)')
  parser.add_argument('--implementations', default='naive,xla_chunked,pallas',
                      help="comma-separated; 'name:N' sets block_vocab N for that entry")
  parser.add_argument('--pallas-interpret', action='store_true',
                      help='run pallas interpreted on CPU')
  parser.add_argument('--block-tokens', type=int, default=None)
  parser.add_argument('--block-vocab', type=int, default=None)
  parser.add_argument('--block-model', type=int, default=None)
  parser.add_argument('--repeats', type=int, default=3, help='timed runs after a warm-up (median)')
  parser.add_argument('--no-time', action='store_true', help='memory analysis only')
  parser.add_argument('--matmul-peak', type=int, default=0, metavar='N',
                      help='also time an N x N x N matmul in --dtype for a measured peak')
  parser.add_argument('--threads', type=int, default=os.cpu_count(), help='CPU threads')
  parser.add_argument('--mesh', default='', metavar='data=A,fsdp=B,tensor=C',
                      help='run under this device mesh')
  return parser.parse_args()


args = parse_args()
mesh_sizes = {name: int(size) for name, _, size in
              (item.partition('=') for item in args.mesh.split(',') if item)}
# XLA:CPU reads its settings once, when the client starts, so they go in before jax.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_multi_thread_eigen=true'
                           f' intra_op_parallelism_threads={args.threads}').strip()

import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if mesh_sizes:  # host devices for a mesh on CPU (ignored by other backends)
  jax.config.update('jax_num_cpu_devices', math.prod(mesh_sizes.values()))

from grpo_jax.sharding import MeshConfig, make_mesh, named_sharding  # noqa: E402
from grpo_jax.ops import token_logprobs  # noqa: E402

MESH = make_mesh(MeshConfig(**{'fsdp': 1, **mesh_sizes})) if mesh_sizes else None


def layout(tokens: int):
  """Shardings of h, W, y under --mesh (None without one)."""
  if MESH is None:
    return None, None, None
  return (named_sharding(MESH, (tokens, args.model), ('batch', 'act_embed')),
          named_sharding(MESH, (args.model, args.vocab), ('embed', 'vocab')),
          named_sharding(MESH, (tokens,), ('batch',)))


def inputs(tokens: int):
  """Random h [T, D], W [D, V], y [T] with logits of unit-order spread, as a trained head gives."""
  keys = jax.random.split(jax.random.key(0), 3)
  dtype = jnp.dtype(args.dtype)
  hidden = jax.random.normal(keys[0], (tokens, args.model), dtype)
  weight = (jax.random.normal(keys[1], (args.model, args.vocab), jnp.float32)
            * args.model ** -0.5).astype(dtype)
  targets = jax.random.randint(keys[2], (tokens,), 0, args.vocab)
  if MESH is None:
    return hidden, weight, targets
  return tuple(jax.device_put(array, sharding)
               for array, sharding in zip((hidden, weight, targets), layout(tokens)))


def shapes(tokens: int):
  dtype = jnp.dtype(args.dtype)
  return tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, sharding in
               zip(((tokens, args.model), (args.model, args.vocab), (tokens,)),
                   (dtype, dtype, jnp.int32), layout(tokens)))


def step_function(entry: str):
  implementation, _, block_vocab = entry.partition(':')
  blocks = dict(block_tokens=args.block_tokens,
                block_vocab=int(block_vocab or 0) or args.block_vocab,
                block_model=args.block_model)
  if implementation == 'naive':
    blocks = {}
  interpret = True if implementation.startswith('pallas') and args.pallas_interpret else None
  # 'pallas': the platform's kernels (Mosaic on TPUs, Mosaic GPU on GPUs).

  def loss(hidden, weight, targets):
    return jnp.sum(token_logprobs(hidden, weight, targets, implementation=implementation,
                                  interpret=interpret, **blocks))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def median_seconds(runs: dict) -> dict:
  """{name: (compiled, operands)} -> {name: median seconds}. Runs interleave round-robin after a
  warm-up of each, so load from other processes on the machine hits every implementation alike."""
  for compiled, operands in runs.values():
    jax.block_until_ready(compiled(*operands))
  times = {name: [] for name in runs}
  for _ in range(args.repeats):
    for name, (compiled, operands) in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(compiled(*operands))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(values) for name, values in times.items()}


def matmul_peak(size: int) -> float:
  """Measured TFLOP/s of one size^3 matmul in --dtype with fp32 accumulation."""
  keys = jax.random.split(jax.random.key(1))
  a, b = (jax.random.normal(key, (size, size), jnp.dtype(args.dtype)) for key in keys)
  dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
  seconds = median_seconds({'dot': (dot.lower(a, b).compile(), (a, b))})['dot']
  return 2 * size ** 3 / seconds / 1e12


def main():
  if MESH is not None:
    with jax.set_mesh(MESH):
      return report()
  return report()


def report():
  backend = jax.default_backend()
  implementations = [name for name in args.implementations.split(',')
                     if not name.startswith('pallas') or backend != 'cpu' or args.pallas_interpret]
  time_tokens = args.time_tokens or args.tokens
  operands = None if args.no_time else inputs(time_tokens)
  nominal_flops = 4 * 2 * time_tokens * args.model * args.vocab
  temps, runs = {}, {}
  for name in implementations:
    step = step_function(name)
    memory = step.lower(*shapes(args.tokens)).compile().memory_analysis()
    temps[name] = memory.temp_size_in_bytes if memory is not None else float('nan')
    if operands is not None:
      runs[name] = (step.lower(*shapes(time_tokens)).compile(), operands)
  timings = median_seconds(runs) if runs else {}
  rows = [(name, temps[name], timings.get(name, float('nan'))) for name in implementations]

  print(f'{backend} ({jax.devices()[0].device_kind}), jax {jax.__version__}, {args.dtype}, '
        f'D={args.model}, V={args.vocab}, {args.threads} threads; memory at T={args.tokens}, '
        f'time at T={time_tokens} (median of {args.repeats})')
  if MESH is not None:
    print(f'mesh {dict(MESH.shape)}: temp memory per device')
  if args.block_tokens or args.block_vocab or args.block_model:
    print(f'blocks: tokens {args.block_tokens}, vocab {args.block_vocab}, model {args.block_model}')
  naive = {name: (temp, seconds) for name, temp, seconds in rows}.get('naive')
  print(f'{"implementation":<14} {"temp MiB":>10} {"vs naive":>9} {"time s":>9} {"vs naive":>9} '
        f'{"TFLOP/s":>8}')
  for name, temp, seconds in rows:
    temp_ratio = f'{temp / naive[0]:.2%}' if naive else '-'
    time_ratio = f'{seconds / naive[1]:.2f}x' if naive else '-'
    print(f'{name:<14} {temp / 2**20:>10.1f} {temp_ratio:>9} {seconds:>9.3f} {time_ratio:>9} '
          f'{nominal_flops / seconds / 1e12:>8.2f}')
  if args.matmul_peak:
    print(f'matmul {args.matmul_peak}^3 {args.dtype}: {matmul_peak(args.matmul_peak):.2f} TFLOP/s')


if __name__ == '__main__':
  main()
