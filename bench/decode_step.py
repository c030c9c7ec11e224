"""python bench/decode_step.py [--preset qwen2.5-0.5b] [--rows 64] [--cache 1024] [--target h100x1]

One decode step (every row's next token through the model over its KV cache: `Qwen2.extend` of
one token) compiled for a target, for each decode-attention implementation: the kernels it
launches (the layer loop's body counted once per layer), the bytes of their operands and results,
the bytes XLA's cost analysis says it reads and writes (not on GPUs), and its temporaries. No device is needed for an accelerator target:

  .venv/bin/python bench/decode_step.py                                     # the host's CPU
  PYTHONPATH=.venv/compilers:. JAX_PLATFORMS=cpu .venv/bin/python bench/decode_step.py --target h100x1
  PYTHONPATH=.venv/compilers:. JAX_PLATFORMS=cpu .venv/bin/python bench/decode_step.py --target v5e-1

The bytes are the compiler's estimate of what one step moves through memory; set against the
weights plus the whole cache (what a decode step at least reads, with 'dense' attention), they
show whether a change added a pass over the cache.
"""

import argparse
import math
import re

import harness

PRESETS = harness.presets('small', 'qwen2.5-0.5b', 'qwen2.5-7b')
TRIVIAL = ('parameter', 'bitcast', 'get-tuple-element', 'tuple', 'constant', 'while')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='qwen2.5-0.5b')
  parser.add_argument('--rows', type=int, default=64, help='B, decode rows')
  parser.add_argument('--cache', type=int, default=1024, help='S, cache slots per row')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='bfloat16')
  parser.add_argument('--target', help='grpo_jax.plan.targets name (h100x1, v5e-1, ...); default: the host')
  parser.add_argument('--attention', default='dense,blockwise', help='comma-separated decode attentions')
  return parser.parse_args()


ITEMSIZE = dict(f64=8, f32=4, bf16=2, f16=2, s32=4, u32=4, s8=1, u8=1, pred=1)


def shape_bytes(text: str) -> int:
  return sum(ITEMSIZE.get(dtype, 4) * math.prod(int(d) for d in dims.split(',') if d)
             for dtype, dims in re.findall(r'\b([a-z]+\d*)\[([\d,]*)\]', text))


def kernel_table(text: str, layers: int) -> tuple[int, int]:
  """(kernels, bytes) of the optimized HLO: the non-trivial instructions of the entry computation
  and of each of its while bodies (the layer loop: x layers), and the bytes of their operands and
  results (an upper bound: an in-place update counts its whole buffer)."""
  computations = {name: (bool(entry), body) for entry, name, body in
                  re.findall(r'\n(ENTRY )?(%\S+) [^\n]*\{\n(.*?)\n\}', text, re.S)}
  entry = next(body for is_entry, body in computations.values() if is_entry)
  count = moved = 0
  for body, times in [(entry, 1)] + [(computations[loop][1], layers)
                                     for loop in re.findall(r'while\([^\n]*body=(%[\w.-]+)', entry)]:
    for result, op, operands in re.findall(r'\n\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) ([\w-]+)\((.*?)\)[,\s]',
                                           '\n' + body + ' '):
      if op not in TRIVIAL:
        count += times
        moved += times * (shape_bytes(result) + shape_bytes(operands))
  return count, moved


def main():
  args = parse_args()
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec

  from grpo_jax.model import ModelOptions, Qwen2Config
  from grpo_jax.model.loading import abstract_model

  if args.target:
    from grpo_jax.plan import targets
    devices = targets.parse_target(args.target).devices()[:1]
  else:
    devices = jax.devices()[:1]
  one = NamedSharding(jax.sharding.Mesh(devices, ('data',)), PartitionSpec())
  config = Qwen2Config(**PRESETS[args.preset])
  B, S = args.rows, args.cache
  itemsize = jnp.dtype(args.dtype).itemsize
  cache_bytes = 2 * config.num_hidden_layers * B * S * config.num_key_value_heads * config.resolved_head_dim * itemsize
  print(f'{args.preset}, one decode step compiled for {args.target or devices[0].platform} ({jax.__version__}), '
        f'{B} rows x {S} cache slots, {args.dtype}')
  print(f'{"attention":<10} {"kernels":>8} {"kernel bytes MiB":>17} {"cost-analysis MiB":>18} '
        f'{"weights + cache MiB":>20} {"temporaries MiB":>16}')
  for attention in args.attention.split(','):
    options = ModelOptions(dtype=args.dtype, param_dtype=args.dtype, decode_attention=attention)
    model = abstract_model(config, options)
    graphdef, state = nnx.split(model)
    placed = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one)  # noqa: E731
    state, cache = jax.tree.map(placed, (state, jax.eval_shape(lambda: model.init_cache(B, S))))
    weights = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))

    def step(state, tokens, cache):
      return nnx.merge(graphdef, state).extend(tokens, cache, return_hidden=True)
    with jax.set_mesh(one.mesh):
      compiled = jax.jit(step, donate_argnums=2).trace(
          state, jax.ShapeDtypeStruct((B, 1), jnp.int32, sharding=one), cache).lower().compile()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    accessed = cost.get('bytes accessed', float('nan'))  # XLA:GPU gives no cost analysis
    count, moved = kernel_table(compiled.as_text(), config.num_hidden_layers)
    print(f'{attention:<10} {count:>8} {moved / 2**20:>17.1f} {accessed / 2**20:>18.1f} '
          f'{(weights + cache_bytes) / 2**20:>20.1f} {compiled.memory_analysis().temp_size_in_bytes / 2**20:>16.1f}')


if __name__ == '__main__':
  main()
