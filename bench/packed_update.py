"""python bench/packed_update.py [--preset wide-small-vocab] [--rows 64] [--prompt-length 64] [--new-tokens 1024]

One GRPO update (pi_old pass + loss + backward + optimizer, two mini-batches) on a long-tailed
batch, padded rows [B, Tp + N] against packed rows (algo.packing), side by side in one process,
then the same with every answer at full length (where packing can only cost). Answer lengths are
log-normal (sigma 1.2) with mean ~N/8, capped at N; prompts have random real lengths in
[Tp / 2, Tp]. Both layouts bound each micro-batch by the same tokens: the padded path takes
`--micro-rows` rows of Tp + N tokens, the packed path micro_batch_tokens = that many tokens. Prints
seconds per update (median, interleaved), real tokens/s, the ratio, the compiler's temporary
memory for each program, the padding of each layout and the micro-batches the packed one ran.
Both run the trainer's own rl.update.update, jitted as rl/step.py jits it, state donated.
"""

import argparse
import os
import sys

import harness

harness.ARCHITECTURES['wide-small-vocab'] = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, tie_word_embeddings=False)  # D = 256: the matmuls dominate, not the vocabulary
PRESETS = harness.presets('wide-small-vocab', 'small', 'qwen2.5-0.5b')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='wide-small-vocab')
  parser.add_argument('--rows', type=int, default=64, help='B = P x G')
  parser.add_argument('--prompt-length', type=int, default=64, help='Tp')
  parser.add_argument('--new-tokens', type=int, default=1024, help='N, the answer length cap')
  parser.add_argument('--micro-rows', type=int, default=8, help='padded rows per micro-batch (the token budget)')
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--batches', default='long-tail,full', help='which batches: long-tail, full (comma-separated)')
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax.model import Qwen2Config  # noqa: E402
from grpo_jax.rl.batch import Batch  # noqa: E402

GiB = 2 ** 30


def answer_lengths(rng, full: bool) -> np.ndarray:
  N = args.new_tokens
  if full:
    return np.full(args.rows, N)
  sigma = 1.2
  mu = np.log(N / 8) - sigma ** 2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2) = N / 8
  return np.clip(np.round(rng.lognormal(mu, sigma, args.rows)), 1, N).astype(int)


def long_tail_batch(vocab_size: int, full: bool, seed: int = 0) -> Batch:
  rng = np.random.default_rng(seed)
  B, Tp, N = args.rows, args.prompt_length, args.new_tokens
  prompt_real = rng.integers(Tp // 2, Tp + 1, B)
  lengths = answer_lengths(rng, full)
  prompt_segments = np.arange(Tp)[None, :] >= (Tp - prompt_real)[:, None]
  mask = np.arange(N)[None, :] < lengths[:, None]
  tokens = rng.integers(1, vocab_size, (B, Tp + N), dtype=np.int32)
  segments = np.concatenate([prompt_segments, mask], axis=1)
  tokens[~segments] = 0
  return Batch.of_sequences(tokens=jnp.asarray(tokens), segment_ids=jnp.asarray(segments, jnp.int32),
                            mask=jnp.asarray(mask), advantages=jnp.asarray(rng.standard_normal(B), jnp.float32),
                            sampler_log_probs=jnp.asarray(-rng.uniform(0.01, 5.0, (B, N)), jnp.float32))


def make_update(architecture: Qwen2Config, packing: bool, batch: Batch):
  """(step, compiled, live): step() runs one donated update of `batch` and waits for it."""
  width = args.prompt_length + args.new_tokens
  algo = config_lib.AlgoConfig(group_size=args.rows, num_minibatches=2, packing=packing,
                               micro_batch_size=0 if packing else args.micro_rows,
                               micro_batch_tokens=args.micro_rows * width if packing else 0,
                               logprob_implementation='xla_chunked')
  return harness.donated_update(architecture, algo, batch, args.dtype)


def temporary_gib(compiled) -> str:
  memory = compiled.memory_analysis()
  return 'n/a' if memory is None else f'{memory.temp_size_in_bytes / GiB:.2f}'


def compare(architecture: Qwen2Config, full: bool) -> None:
  batch = long_tail_batch(architecture.vocab_size, full)
  lengths = np.asarray(batch.mask).sum(1)
  real = int(np.asarray(batch.segment_ids != 0).sum())
  print(f'\n{"every answer at full length" if full else "long-tailed answers"}: {args.rows} rows, Tp = '
        f'{args.prompt_length}, N = {args.new_tokens}; answer length mean {lengths.mean():.0f}, p50 '
        f'{np.median(lengths):.0f}, p90 {np.percentile(lengths, 90):.0f}, max {lengths.max()}; real tokens {real:,}'
        f' of {batch.tokens.size:,} ({real / batch.tokens.size:.1%})', flush=True)
  steps, compiled, live = {}, {}, {}
  for name, packing in (('padded', False), ('packed', True)):
    steps[name], compiled[name], live[name] = make_update(architecture, packing, batch)
  results = harness.interleaved(steps, args.repeats)
  print(f'{"layout":>8} {"first call s":>13} {"s / update":>11} {"real tokens/s":>14} {"temp GiB":>9} '
        f'{"padding":>8} {"micro-batches":>14}')
  for name, (first, median) in results.items():
    metrics = live[name]['metrics']
    padding = metrics['packed_padding_frac'] if name == 'packed' else metrics['padding_frac']
    print(f'{name:>8} {first:13.2f} {median:11.2f} {real / median:14,.0f} {temporary_gib(compiled[name]):>9} '
          f'{float(padding):8.1%} {float(metrics["micro_batches"]):14.1f}')
  speedup = results['padded'][1] / results['packed'][1]
  print(f'packed / padded: {speedup:.2f}x faster' if speedup >= 1 else f'packed / padded: {1 / speedup:.2f}x slower')
  for name in ('loss', 'policy_loss', 'grad_norm'):
    print(f'  {name}: padded {float(live["padded"]["metrics"][name]):+.6f}, '
          f'packed {float(live["packed"]["metrics"][name]):+.6f}')


def main():
  architecture = Qwen2Config(**PRESETS[args.preset])
  print(f'{args.preset}: D = {architecture.hidden_size}, L = {architecture.num_hidden_layers}, V = '
        f'{architecture.vocab_size}, {args.dtype}, {jax.devices()[0].device_kind}, {args.threads} threads, '
        f'micro-batches of {args.micro_rows} x {args.prompt_length + args.new_tokens} tokens', flush=True)
  for batch in args.batches.split(','):
    compare(architecture, full=batch == 'full')


if __name__ == '__main__':
  sys.exit(main())
