"""python bench/longtail.py [--preset small] [--prompts 8 --group 8] [--new-tokens 512] [--slots 64,32,16]

Useful completion tokens/s on a long-tailed rollout: P x G requests whose answers stop at a stop
token drawn with probability ~1/mean per step (a geometric length distribution with mean ~N/8,
capped at N), so most rows finish early and a few run long. grpo_jax's jitted sampler with one
slot per request (the fixed batch: the loop runs until the longest row stops) and with B < P x G
continuous-batching slots (a finished slot takes the next request at once), against transformers'
generate (which also keeps finished rows in the batch until the last one stops), same weights,
prompts, stop tokens, sampling and CPU threads. Useful tokens = sum of completion lengths.
"""

import argparse
import os
import sys
import tempfile

import harness

PRESETS = harness.presets('small', 'mid', 'qwen2.5-0.5b')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
  parser.add_argument('--prompts', type=int, default=8, help='P')
  parser.add_argument('--group', type=int, default=8, help='G, samples per prompt')
  parser.add_argument('--prompt-length', type=int, default=32)
  parser.add_argument('--new-tokens', type=int, default=512, help='N, the length cap')
  parser.add_argument('--mean', type=float, default=0, help='target mean length (default N / 8)')
  parser.add_argument('--slots', default='32,16', help='continuous-batching slot counts B to run')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--no-reference', action='store_true', help='skip transformers')
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import testing  # noqa: E402
from grpo_jax.model import Qwen2Config, from_pretrained, to_hf_dict  # noqa: E402
from grpo_jax.sampler import DecodeSettings, GroupSampler, SamplingConfig  # noqa: E402


def main():
  config = Qwen2Config(**PRESETS[args.preset])
  P, G, Tp, N = args.prompts, args.group, args.prompt_length, args.new_tokens
  mean = args.mean or N / 8
  rng = np.random.default_rng(0)
  prompts = rng.integers(1, config.vocab_size, (P, Tp), dtype=np.int32)
  mask = np.ones((P, Tp), np.int32)
  with tempfile.TemporaryDirectory(prefix='bench_longtail_') as directory:
    import torch
    import transformers
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    reference = testing.save_random_hf_checkpoint(directory, 0, init='default', jitter=0.02,
                                                  **to_hf_dict(config)).to(getattr(torch, args.dtype))
    model = from_pretrained(directory, dtype=args.dtype)
  stops = harness.stop_tokens(config.vocab_size, mean)
  sampling = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0)
  settings = DecodeSettings(max_new_tokens=N, sampling=sampling, stop_token_ids=stops, pad_id=0)
  state, key = nnx.state(model), jax.random.key(0)
  device_prompts, device_mask = jax.device_put(prompts), jax.device_put(mask)
  runs, out = {}, {}
  for slots in [0] + [int(b) for b in args.slots.split(',') if b]:
    name = 'fixed batch (one slot per request)' if slots == 0 else f'continuous batching, {slots} slots'
    sampler = GroupSampler(model, group_size=G, settings=settings, slots=slots)
    runs[name] = (lambda sampler=sampler, name=name:
                  out.__setitem__(name, jax.block_until_ready(sampler(state, device_prompts, device_mask, key))))
  if not args.no_reference:
    torch_prompts = torch.from_numpy(prompts.astype(np.int64)).repeat_interleave(G, dim=0)

    def generate():
      with torch.inference_mode():
        out['transformers'] = reference.generate(
            torch_prompts, attention_mask=torch.ones_like(torch_prompts), do_sample=True, temperature=1.0, top_k=0,
            top_p=1.0, max_new_tokens=N, eos_token_id=list(stops), pad_token_id=0)
    runs[f'transformers generate (torch {torch.__version__})'] = generate
  results = harness.interleaved(runs, args.repeats)

  fixed = out['fixed batch (one slot per request)']
  lengths = np.asarray(fixed.lengths)
  print(f'\n{args.preset}: {config.num_params() / 1e6:.0f}M params, {P} prompts x {G} = {P * G} requests, prompt '
        f'{Tp} tokens, cap N = {N}, {len(stops)} stop tokens; completion lengths: mean {lengths.mean():.0f}, median '
        f'{np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}; {args.dtype}, '
        f'{jax.default_backend()}, {args.threads} threads, median of {args.repeats}')
  print(f'{"implementation":<44} {"warm-up s":>9} {"s":>8} {"useful tok":>10} {"useful tok/s":>12} {"vs fixed":>8} '
        f'{"steps":>6} {"occupancy":>9}')
  base = lengths.sum() / results['fixed batch (one slot per request)'][1]
  for name, (first, seconds) in results.items():
    if name.startswith('transformers'):
      generated = out['transformers'][:, Tp:].numpy()
      stopped = np.isin(generated, stops)
      ends = np.where(stopped.any(1), stopped.argmax(1) + 1, N)
      useful, steps, occupancy = int(ends.sum()), generated.shape[1], ends.sum() / (generated.shape[1] * P * G)
    else:
      rollout = out[name]
      useful, steps = int(np.asarray(rollout.lengths).sum()), int(rollout.decode_steps)
      slots = int(name.split(', ')[1].split()[0]) if 'slots' in name else P * G
      occupancy = useful / (steps * slots)
      assert np.array_equal(np.asarray(rollout.tokens), np.asarray(fixed.tokens)), name  # the same completions
    rate = useful / seconds
    print(f'{name:<44} {first:>9.2f} {seconds:>8.3f} {useful:>10} {rate:>12.0f} {rate / base:>7.2f}x {steps:>6} '
          f'{occupancy:>9.0%}')
  print('useful tok/s = completion tokens (stop token included) / seconds; vs fixed = that rate over the fixed '
        "batch's; occupancy = useful row-steps / (decode steps x rows in flight)")
  return 0


if __name__ == '__main__':
  sys.exit(main())
