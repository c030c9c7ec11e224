"""python bench/decode_fill.py [--preset small] [--batch 64] [--cache 4096] [--block 256]

Time of one decode step (the model's `extend` of one token per row over a KV cache of S slots)
with the cache 10% and 100% full, for decode attention 'dense' (reads every slot, masked) and
'blockwise' (reads blocks up to the fullest row's length), side by side in one process: the
ratio 10% / 100% shows whether a step's cost follows the cache's fill.
"""

import argparse
import os
import sys

import harness

PRESETS = harness.presets('small', 'mid', 'qwen2.5-0.5b')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--cache', type=int, default=4096, help='S, slots per cache row')
  parser.add_argument('--block', type=int, default=256)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=10)
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.model import ModelOptions, Qwen2Config, init_model  # noqa: E402


def main():
  config = Qwen2Config(**PRESETS[args.preset])
  B, S = args.batch, args.cache
  rng = np.random.default_rng(0)
  steps, outputs, inputs = {}, {}, {}
  reference = init_model(config, options=ModelOptions(dtype=args.dtype, param_dtype=args.dtype))
  for fill in (0.1, 1.0):  # the same cache and tokens for both implementations
    written = int(S * fill) - 1  # the step writes one more
    cache = reference.init_cache(B, S)
    inputs[fill] = (jnp.asarray(rng.integers(0, config.vocab_size, (B, 1)), jnp.int32), dataclasses.replace(
        cache, k=jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype),
        v=jnp.asarray(rng.standard_normal(cache.v.shape), cache.v.dtype),
        segment_ids=jnp.asarray(np.arange(S)[None].repeat(B, 0) < written, jnp.int32),
        length=jnp.full((B,), written, jnp.int32)))
  state = nnx.state(reference)
  for implementation in ('dense', 'blockwise'):
    model = init_model(config, options=ModelOptions(dtype=args.dtype, param_dtype=args.dtype,
                                                    decode_attention=implementation, decode_block=args.block))
    graphdef = nnx.graphdef(model)

    @jax.jit
    def step(state, tokens, cache, graphdef=graphdef):
      logits, cache = nnx.merge(graphdef, state).extend(tokens, cache)
      return logits, cache.length

    for fill in (0.1, 1.0):
      tokens, cache = inputs[fill]
      name = f'{implementation}, {fill:.0%} full'

      def run(name=name, tokens=tokens, cache=cache, step=step):
        outputs[name] = jax.block_until_ready(step(state, tokens, cache))[0]
      steps[name] = run
  results = harness.interleaved(steps, args.repeats)
  # The two orders of summation agree to fp32 rounding in float32; in bfloat16 each layer's outputs
  # are rounded to 8 bits of mantissa, so the logits differ by a few of those ulps after L layers:
  # compared there by the relative norm, at bf16's usual 1e-2 scale. (Small preset, 4 layers, CPU:
  # bf16 dense and bf16 blockwise are each 1.1e-2 from an fp32 dense reference and 1.2e-2 from each
  # other; elementwise 1e-3 fails on the CPU as on the GPU.)
  for fill in ('10%', '100%'):
    got = np.asarray(outputs[f'blockwise, {fill} full'], np.float64)
    want = np.asarray(outputs[f'dense, {fill} full'], np.float64)
    if args.dtype == 'float32':
      np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    relative = np.linalg.norm(got - want) / np.linalg.norm(want)
    print(f'blockwise vs dense logits at {fill} full: relative error {relative:.2e}')
    assert relative < 2e-2, f'blockwise and dense decode attention disagree: relative error {relative:.2e}'
  kv = 2 * config.num_hidden_layers * B * S * config.num_key_value_heads * config.resolved_head_dim
  print(f'\n{args.preset}: {config.num_params() / 1e6:.0f}M params, {B} rows x {S} cache slots '
        f'({kv * jnp.dtype(args.dtype).itemsize / 2**20:.0f} MiB of K and V), block {args.block}, {args.dtype}, '
        f'{jax.default_backend()}, {args.threads} threads, median of {args.repeats}')
  print(f'{"decode attention":<18} {"10% full ms":>12} {"100% full ms":>13} {"10% / 100%":>11}')
  for implementation in ('dense', 'blockwise'):
    low, high = (results[f'{implementation}, {fill} full'][1] * 1e3 for fill in ('10%', '100%'))
    print(f'{implementation:<18} {low:>12.2f} {high:>13.2f} {low / high:>10.2f}x')
  return 0


if __name__ == '__main__':
  sys.exit(main())
