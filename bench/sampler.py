"""python bench/sampler.py [--preset small|qwen2.5-0.5b] [--prompts P] [--group G] [--batch-sizes R,..]

Generated tokens/s of grpo_jax's GroupSampler (P prompts x G samples, prefill once, decode in one
jit) against transformers' Qwen2ForCausalLM.generate on the same weights, batch, prompt length,
number of new tokens (no early stop on either side), sampling settings (T=1, no top-k / top-p)
and CPU threads. grpo_jax's prefill share is an estimate: a separately jitted prefill (plus the
copy into G rows) is timed and decode = total - prefill. On an accelerator PyTorch (CPU) runs
only with --reference, and the decode steps are set against a measured copy bandwidth.
"""

import argparse
import os
import sys
import tempfile

import harness

PRESETS = harness.presets('small', 'qwen2.5-0.5b', 'qwen2.5-7b')
OVERRIDES = dict(hidden='hidden_size', intermediate='intermediate_size', layers='num_hidden_layers',
                 heads='num_attention_heads', kv_heads='num_key_value_heads', vocab='vocab_size')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
  for flag in OVERRIDES:
    parser.add_argument(f'--{flag.replace("_", "-")}', type=int, help='overrides the preset')
  parser.add_argument('--prompts', type=int, default=8, help='P')
  parser.add_argument('--group', type=int, default=8, help='G, samples per prompt')
  parser.add_argument('--batch-sizes', default='', help='comma-separated rows P*G (P = rows / G)')
  parser.add_argument('--prompt-length', type=int, default=64)
  parser.add_argument('--new-tokens', type=int, default=64)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--threads', type=int, default=os.cpu_count(), help='CPU threads for both')
  parser.add_argument('--repeats', type=int, default=5, help='timed runs after warm-up (median)')
  parser.add_argument('--reference', action='store_true', help='run PyTorch also on an accelerator')
  parser.add_argument('--decode-layers', default='auto', help='ModelOptions.decode_layers: auto | scan | unrolled')
  parser.add_argument('--decode-attention', default='dense', help='ModelOptions.decode_attention')
  parser.add_argument('--prompt-reads', default='auto', help='ModelOptions.prompt_reads: auto | copy | once')
  parser.add_argument('--weights', default='', help='rollout.weights (compute | bf16 | int8 | fp8): sample from '
                      'the resident copy the rollout layout makes, on one device; default: the model\'s own')
  parser.add_argument('--kv-cache', default='compute', help='rollout.kv_cache (compute | int8 | fp8): the decode '
                      "cache's entries")
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import testing  # noqa: E402
from grpo_jax.model import ModelOptions, Qwen2Config, from_pretrained, init_model, to_hf_dict  # noqa: E402
from grpo_jax.sampler import DecodeSettings, GroupSampler, SamplingConfig, decode  # noqa: E402


def torch_reference(config: Qwen2Config, directory: str):
  """A transformers model with every parameter perturbed by small normal noise (norms and biases
  would otherwise sit at 1 and 0), saved to `directory` for grpo_jax to load."""
  import torch
  import transformers

  torch.set_num_threads(args.threads)
  transformers.utils.logging.disable_progress_bar()
  model = testing.save_random_hf_checkpoint(directory, 0, init='default', jitter=0.02, **to_hf_dict(config))
  return model.to(getattr(torch, args.dtype))


def copy_bandwidth() -> float:
  """Bytes/s of a jitted elementwise pass over 1 GiB (read + write), the attainable HBM rate."""
  x = jnp.ones((2**28,), jnp.float32)
  bump = jax.jit(lambda x: x + 1)  # `+ 0` could be simplified away to a plain alias
  seconds = harness.interleaved({'copy': lambda: bump(x).block_until_ready()}, 10)['copy'][1]
  return 2 * x.nbytes / seconds


def matmul_peak() -> float:
  """FLOP/s of a jitted [8192, 8192] x [8192, 8192] bf16 product on random inputs (two input
  sets taken in turn), the attainable dense bf16 rate."""
  n = 8192
  keys = jax.random.split(jax.random.key(1), 4)
  inputs = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys]
  product = jax.jit(lambda a, b: a @ b)
  turn = iter(range(10**9))

  def step():
    i = 2 * (next(turn) % 2)
    product(inputs[i], inputs[i + 1]).block_until_ready()
  return 2 * n**3 / harness.interleaved({'matmul': step}, 10)['matmul'][1]


def run(model, reference, config: Qwen2Config, rows: int):
  """Times one batch of `rows` = P x G completions; prints its table."""
  P, G, Tp, N = rows // args.group, args.group, args.prompt_length, args.new_tokens
  prompts = np.random.default_rng(0).integers(1, config.vocab_size, (P, Tp), dtype=np.int32)
  mask = np.ones((P, Tp), np.int32)
  layout = sampler_layout = None
  if args.weights:  # the rollout layout's resident copy (8-bit with int8 / fp8), on one device
    from grpo_jax.sampler.layout import rollout_layout
    from grpo_jax.sharding import MESH_AXES
    layout = rollout_layout(model, jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1, 1),
                                                     MESH_AXES), 1, weights=args.weights)
    sampler_layout = layout
  sampler = GroupSampler(model, group_size=G, settings=DecodeSettings(max_new_tokens=N, stop_token_ids=(), pad_id=0,
                         sampling=SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)), layout=layout)
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, prompts, mask):
    # What the sampler does before its decode loop: decode.prefill, copied into G rows.
    model = nnx.merge(graphdef, state)
    prefix = decode.prefill(model, prompts, mask, model.init_cache(P, Tp + N))
    rows_of = lambda a: jnp.repeat(a, G, axis=1 if a.ndim == 5 else 0)  # k, v: [L, B, S, K, H]
    return jax.tree.map(rows_of, prefix)

  device_prompts, device_mask, key = jax.device_put(prompts), jax.device_put(mask), jax.random.key(0)
  out, jax_name = {}, f'grpo_jax (jax {jax.__version__})'

  def jax_step():
    out['jax'] = jax.block_until_ready(sampler(state, device_prompts, device_mask, key))

  steps = {jax_name: jax_step,
           'prefill': lambda: jax.block_until_ready(prefill(state, device_prompts, device_mask))}
  if reference is not None:
    import torch
    # Row p * G + g is sample g of prompt p on both sides.
    torch_prompts = torch.from_numpy(prompts.astype(np.int64)).repeat_interleave(G, dim=0)
    torch_mask, torch_name = torch.ones_like(torch_prompts), f'transformers (torch {torch.__version__})'

    def generate(new_tokens):
      with torch.inference_mode():
        return reference.generate(torch_prompts, attention_mask=torch_mask, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=0)

    def torch_step():
      out['torch'] = generate(N)

    # generate() of one new token is transformers' prefill (+ one sampling step): its estimate.
    steps[torch_name], steps['torch prefill'] = torch_step, lambda: generate(1)
  results = harness.interleaved(steps, args.repeats)

  assert out['jax'].tokens.shape == (rows, N) and int(out['jax'].lengths.min()) == N
  if reference is not None:
    assert tuple(out['torch'].shape) == (rows, Tp + N), out['torch'].shape
  generated = rows * N  # every row runs to N tokens: no stop token on either side
  print(f'\n{args.preset}: {config.num_params() / 1e6:.0f}M params, {P} prompts x {G} = {rows} rows, '
        f'prompt {Tp} + {N} new tokens, {args.dtype}, {jax.default_backend()}, '
        f'{args.threads} threads, median of {args.repeats}')
  print(f'{"implementation":<34} {"warm-up s":>9} {"total s":>8} {"tokens/s":>9} {"ratio":>6} '
        f'{"prefill s":>9} {"ms/step":>8}')
  names = [(jax_name, 'prefill')] + ([(torch_name, 'torch prefill')] if reference is not None else [])
  baseline = results[names[-1][0]][1] if reference is not None else None
  for name, prefill_name in names:
    first, total = results[name]
    prefill_s = results[prefill_name][1]
    step_ms = (total - prefill_s) / max(N - 1, 1) * 1e3  # the first token comes from the prefill
    ratio = f'{baseline / total:.2f}x' if baseline else '-'
    print(f'{name:<34} {first:>9.2f} {total:>8.3f} {generated / total:>9.0f} {ratio:>6} '
          f'{prefill_s:>9.3f} {step_ms:>8.2f}')
  total, prefill_s = results[jax_name][1], results['prefill'][1]
  print(f'grpo_jax split (estimate: jitted prefill + copy into G rows timed alone, decode = total - '
        f'prefill): prefill {prefill_s / total:.0%}, decode {1 - prefill_s / total:.0%}; ratio = '
        f'transformers s / grpo_jax s; ms/step = (total - prefill) / {max(N - 1, 1)} steps')
  if jax.default_backend() != 'cpu':
    itemsize = jnp.dtype(args.dtype).itemsize
    params_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    if sampler_layout is not None:  # what the decode loop reads: the resident copy
      from grpo_jax.sampler.layout import resident_bytes_per_device
      params_bytes = resident_bytes_per_device(state, sampler_layout)
    # The cache rows hold Tp + N / 2 tokens on average over the decode; the kernel may read more
    # (all Tp + N slots, masked), so this is the useful-bytes roofline.
    context = Tp + N / 2
    entries = 2 * config.num_hidden_layers * rows * context * config.num_key_value_heads  # per token and head
    kv_bytes = entries * (config.resolved_head_dim * itemsize if args.kv_cache == 'compute'
                          else config.resolved_head_dim + 4)  # 8-bit values and an fp32 scale
    # Every row's token through each matmul (the embedding table's rows are gathered, not
    # multiplied, unless tied to the lm_head) and its attention over the cache.
    matmul_params = config.num_params() - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    flops = 2 * rows * matmul_params + 4 * rows * context * config.num_attention_heads * config.resolved_head_dim * config.num_hidden_layers
    step_s = (total - prefill_s) / max(N - 1, 1)
    bandwidth, peak = copy_bandwidth(), matmul_peak()
    roofline = max((params_bytes + kv_bytes) / bandwidth, flops / peak)
    print(f'decode roofline = max(bytes / copy bandwidth, FLOPs / bf16 matmul peak) = max('
          f'{params_bytes / 2**20:.0f} MiB params + {kv_bytes / 2**20:.0f} MiB KV / {bandwidth / 1e9:.0f} GB/s, '
          f'{flops / 1e12:.3f} TFLOP / {peak / 1e12:.0f} TFLOP/s) = max({(params_bytes + kv_bytes) / bandwidth * 1e3:.3f}, '
          f'{flops / peak * 1e3:.3f}) ms; step {step_s * 1e3:.3f} ms: {roofline / step_s:.1%} of the roofline')

def main():
  overrides = {field: getattr(args, flag) for flag, field in OVERRIDES.items()
               if getattr(args, flag) is not None}
  config = Qwen2Config(**{**PRESETS[args.preset], **overrides})
  reference = None
  options = ModelOptions(dtype=args.dtype, param_dtype=args.dtype, decode_layers=args.decode_layers,
                         decode_attention=args.decode_attention, prompt_reads=args.prompt_reads,
                         kv_cache=args.kv_cache)
  with tempfile.TemporaryDirectory(prefix='bench_sampler_') as directory:
    if jax.default_backend() == 'cpu' or args.reference:
      reference = torch_reference(config, directory)
      model = from_pretrained(directory, options=options)
    else:
      model = init_model(config, options=options)
  batch_sizes = [int(b) for b in args.batch_sizes.split(',') if b] or [args.prompts * args.group]
  for rows in batch_sizes:
    if rows % args.group:
      raise SystemExit(f'--batch-sizes: {rows} rows is not a multiple of --group {args.group}')
    run(model, reference, config, rows)
  return 0


if __name__ == '__main__':
  sys.exit(main())
