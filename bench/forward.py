"""python bench/forward.py [--preset mid|qwen2.5-0.5b] [--batch B] [--length T] [--dtype D] [--threads N]

Forward-pass tokens/s of grpo_jax against transformers' PyTorch Qwen2ForCausalLM on the same
architecture, the same weights and the same CPU thread count, with a logits parity check.
On an accelerator the PyTorch reference (always on CPU) runs only with --reference.
"""

import argparse
import os
import sys
import tempfile

import harness

PRESETS = harness.presets('mid', 'qwen2.5-0.5b')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='mid')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--threads', type=int, default=os.cpu_count(), help='CPU threads for both')
  parser.add_argument('--repeats', type=int, default=5, help='timed runs after warm-up (median)')
  parser.add_argument('--reference', action='store_true', help='run PyTorch also on an accelerator')
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import testing  # noqa: E402
from grpo_jax.model import ModelOptions, Qwen2Config, from_pretrained, init_model, to_hf_dict  # noqa: E402


def torch_reference(config: Qwen2Config, directory: str):
  """A random transformers model saved to `directory`; biases and norms jittered too, since
  their default init (0 and 1) would hide a layout mistake in the parity check."""
  import torch
  import transformers

  torch.set_num_threads(args.threads)
  transformers.utils.logging.disable_progress_bar()
  model = testing.save_random_hf_checkpoint(directory, 0, init='default', jitter={'bias': 0.1, 'norm.weight': 0.1},
                                            **to_hf_dict(config))
  return model.to(getattr(torch, args.dtype))


def main():
  config = Qwen2Config(**PRESETS[args.preset])
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (args.batch, args.length), dtype=np.int32)
  backend = jax.default_backend()
  use_torch = backend == 'cpu' or args.reference
  logits = {}

  with tempfile.TemporaryDirectory(prefix='bench_forward_') as directory:
    if use_torch:
      reference = torch_reference(config, directory)
      model = from_pretrained(directory, dtype=args.dtype)
    else:
      model = init_model(config, options=ModelOptions(dtype=args.dtype, param_dtype=args.dtype))

  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  device_tokens = jax.device_put(tokens)
  jax_name = f'grpo_jax (jax {jax.__version__})'
  steps = {jax_name: lambda: forward(state, device_tokens).block_until_ready()}
  devices = {jax_name: backend}
  if use_torch:
    import torch
    torch_tokens = torch.from_numpy(tokens.astype(np.int64))
    torch_name = f'transformers (torch {torch.__version__})'

    def torch_step():
      with torch.inference_mode():
        return reference(torch_tokens).logits

    steps[torch_name], devices[torch_name] = torch_step, 'cpu'
  results = harness.interleaved(steps, args.repeats)  # the first call of each compiles / warms up
  logits['jax'] = np.asarray(forward(state, device_tokens))
  if use_torch:
    logits['torch'] = torch_step().float().numpy()
  rows = [(name, devices[name], *results[name]) for name in steps]

  print(f'{args.preset}: {config.num_params() / 1e6:.0f}M params, batch {args.batch} x {args.length} '
        f'tokens, {args.dtype}, {args.threads} threads, median of {args.repeats}')
  if 'torch' in logits:
    diff = np.abs(logits['jax'] - logits['torch'])
    print(f'logits max |diff| {diff.max():.3e} (mean {diff.mean():.1e}, '
          f'|logits| max {np.abs(logits["torch"]).max():.2f})')
  baseline = rows[-1][3] if use_torch else None
  tokens_per_step = args.batch * args.length
  print(f'{"implementation":<34} {"device":<6} {"warm-up s":>9} {"step s":>8} {"tokens/s":>10} {"ratio":>6}')
  for name, device, first, seconds in rows:
    ratio = f'{baseline / seconds:.2f}x' if baseline else '-'
    print(f'{name:<34} {device:<6} {first:>9.2f} {seconds:>8.4f} {tokens_per_step / seconds:>10.0f} '
          f'{ratio:>6}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
