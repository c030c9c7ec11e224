"""python bench/tree_packing.py [--shapes dapo,agent] [--preset wide-small-vocab] [--repeats 3]

One GRPO update (pi_old pass + loss + backward + optimizer, two mini-batches of whole groups) on groups of G
answers to one prompt, packed flat (algo.packing: every sequence whole, its prompt in each of the G)
against packed as trees (algo.tree_packing: the prompt once per packed row, each answer a branch
after it), side by side in one process, same rows (pack_length), same token budget per
micro-batch. Two shapes, each scaled down from a recipe for a CPU:

  dapo   the DAPO recipe's (2,048-token prompts, 10,240-token answers, G = 16) at 1/8: Tp = 256,
         N = 1,280, G = 16, 2 prompts; answers long-tailed (log-normal, mean N / 4) and at full length
  agent  a long shared history and short turns: Tp = 1,024, N = 64, G = 8, 2 prompts; answers
         long-tailed (mean N / 2)

Prints, per shape and batch: the tokens each layout computes (the packed rows' real tokens) and
the 6 N per-token FLOPs they stand for, seconds per update (median, interleaved), the ratios, and
the loss and gradient norm of both (equal: the tree update is the flat one, computed once per
prompt). metrics.update_tokens_per_group's full-length count (the plan's) is printed beside.
"""

import argparse
import os
import sys

import harness

harness.ARCHITECTURES['wide-small-vocab'] = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, tie_word_embeddings=False)  # D = 256: the matmuls dominate, not the vocabulary
PRESETS = harness.presets('wide-small-vocab', 'small')
# name -> (Tp, N, G, P, mean answer / N)
SHAPES = {'dapo': (256, 1280, 16, 2, 0.25), 'agent': (1024, 64, 8, 2, 0.5)}


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--shapes', default='dapo,agent', help='comma-separated: ' + ', '.join(SHAPES))
  parser.add_argument('--preset', choices=sorted(PRESETS), default='wide-small-vocab')
  parser.add_argument('--row-sequences', type=int, default=2,
                      help='pack_length in sequences of Tp + N tokens (both layouts)')
  parser.add_argument('--micro-rows', type=int, default=2, help='packed rows per micro-batch (both layouts)')
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
from grpo_jax.metrics import update_tokens_per_group  # noqa: E402
from grpo_jax.model import Qwen2Config  # noqa: E402
from grpo_jax.rl.batch import Batch  # noqa: E402


def group_batch(shape, vocab_size: int, full: bool, seed: int = 0) -> Batch:
  """P prompts of random real lengths in [Tp / 2, Tp], each answered G times (rows p * G + g)."""
  Tp, N, G, P, mean = shape
  rng = np.random.default_rng(seed)
  B = P * G
  prompt_real = np.repeat(rng.integers(Tp // 2, Tp + 1, P), G)
  prompts = np.repeat(rng.integers(1, vocab_size, (P, Tp), dtype=np.int32), G, axis=0)
  if full:
    lengths = np.full(B, N)
  else:
    sigma = 1.0
    mu = np.log(mean * N) - sigma ** 2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    lengths = np.clip(np.round(rng.lognormal(mu, sigma, B)), 1, N).astype(int)
  prompt_segments = np.arange(Tp)[None, :] >= (Tp - prompt_real)[:, None]
  mask = np.arange(N)[None, :] < lengths[:, None]
  tokens = np.concatenate([prompts, rng.integers(1, vocab_size, (B, N), dtype=np.int32)], axis=1)
  segments = np.concatenate([prompt_segments, mask], axis=1)
  tokens[~segments] = 0
  return Batch.of_sequences(tokens=jnp.asarray(tokens), segment_ids=jnp.asarray(segments, jnp.int32),
                            mask=jnp.asarray(mask), advantages=jnp.asarray(rng.standard_normal(B), jnp.float32),
                            sampler_log_probs=jnp.asarray(-rng.uniform(0.01, 5.0, (B, N)), jnp.float32))


def algo_config(shape, trees: bool) -> config_lib.AlgoConfig:
  Tp, N, G, _, _ = shape
  length = args.row_sequences * (Tp + N)
  return config_lib.AlgoConfig(group_size=G, num_minibatches=2, shuffle='groups', packing=True, tree_packing=trees,
                               pack_length=length,
                               micro_batch_tokens=args.micro_rows * length, logprob_implementation='xla_chunked')


def compare(architecture: Qwen2Config, name: str, full: bool) -> None:
  shape = SHAPES[name]
  Tp, N, G, P, _ = shape
  batch = group_batch(shape, architecture.vocab_size, full)
  lengths = np.asarray(batch.mask).sum(1)
  real = int(np.asarray(batch.segment_ids != 0).sum())
  print(f'\n{name}, {"every answer at full length" if full else "long-tailed answers"}: {P} prompts x G = {G}, '
        f'Tp = {Tp}, N = {N}, rows of {args.row_sequences * (Tp + N)} tokens; answer length mean '
        f'{lengths.mean():.0f}, max {lengths.max()}; the sequences\' real tokens {real:,}', flush=True)
  steps, live = {}, {}
  for layout, trees in (('flat', False), ('tree', True)):
    steps[layout], _, live[layout] = harness.donated_update(architecture, algo_config(shape, trees), batch)
  results = harness.interleaved(steps, args.repeats)
  active = architecture.num_params(active=True)
  print(f'{"layout":>6} {"tokens":>9} {"GFLOP (6N)":>11} {"first call s":>13} {"s / update":>11} {"packed rows":>12}')
  tokens = {}
  for layout, (first, median) in results.items():
    metrics = live[layout]['metrics']
    tokens[layout] = float(metrics['packed_tokens'])
    print(f'{layout:>6} {tokens[layout]:9,.0f} {6 * active * tokens[layout] / 1e9:11.1f} {first:13.2f} '
          f'{median:11.2f} {float(metrics["packed_rows"]):12.0f}')
  planned = P * update_tokens_per_group(Tp, N, algo_config(shape, True))
  print(f'tree / flat: {tokens["flat"] / tokens["tree"]:.2f}x fewer tokens, '
        f'{results["flat"][1] / results["tree"][1]:.2f}x faster; the plan\'s full-length count: {planned:,} tokens '
        f'against {P * G * (Tp + N):,} ({P * G * (Tp + N) / planned:.2f}x)')
  for metric in ('loss', 'policy_loss', 'grad_norm'):
    print(f'  {metric}: flat {float(live["flat"]["metrics"][metric]):+.6f}, '
          f'tree {float(live["tree"]["metrics"][metric]):+.6f}')


def main():
  architecture = Qwen2Config(**PRESETS[args.preset])
  print(f'{args.preset}: D = {architecture.hidden_size}, L = {architecture.num_hidden_layers}, V = '
        f'{architecture.vocab_size}, float32, {jax.devices()[0].device_kind}, {args.threads} threads, '
        f'micro-batches of {args.micro_rows} packed rows', flush=True)
  for name in args.shapes.split(','):
    for batch in args.batches.split(','):
      compare(architecture, name, full=batch == 'full')


if __name__ == '__main__':
  sys.exit(main())
