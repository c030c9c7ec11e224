"""python bench/rewards.py [--completions 1024] [--workers 2] [--repeats 3] [--seed 0]

The math reward's cost per step on integer answers (DAPO-Math-17k's references are all integers):
the reward pool as it runs (`RewardPool`, pairs whose answers are single integers settled in the
calling process by `rewards.integer_verdict`), against the same pool with every pair sent to
math-verify in its workers (the reference: `rewards.math_verify_reward`).
Completions are a few dozen words of working ending in a boxed integer, half of them right, all
distinct (no pair is scored twice). Per call: wall time of one `map` over all completions, median
of `--repeats`; both paths must give the same rewards (asserted).
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_jax.data import rewards  # noqa: E402


def workload(count: int, seed: int) -> tuple[list[str], list[str]]:
  rng = np.random.default_rng(seed)
  words = ['so', 'the', 'sum', 'is', 'then', 'we', 'add', 'and', 'get', 'each', 'of', 'has', 'more', 'left']
  completions, answers = [], []
  for index in range(count):
    gold = int(rng.integers(0, 10_000))
    guess = gold if index % 2 else gold + int(rng.integers(1, 50))
    working = ' '.join(rng.choice(words, int(rng.integers(20, 60))).tolist())
    steps = f'{int(rng.integers(1, 99))} + {int(rng.integers(1, 99))} = {int(rng.integers(2, 198))}'
    completions.append(f'{working} {steps}, {index} in all. The answer is \\boxed{{{guess}}}.')
    answers.append(str(gold))
  return completions, answers


def timed(pool, completions, answers, repeats: int) -> tuple[float, list[float]]:
  pool.map(completions[:8], answers[:8])  # the workers started and warm
  seconds, got = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    got = pool.map(completions, answers)
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds), got


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--completions', type=int, default=1024)
  parser.add_argument('--workers', type=int, default=2)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args()
  completions, answers = workload(args.completions, args.seed)
  with rewards.RewardPool(args.workers, score_fn=rewards.math_verify_reward) as pool:
    reference, expected = timed(pool, completions, answers, args.repeats)
  with rewards.RewardPool(args.workers) as pool:
    shortcut, got = timed(pool, completions, answers, args.repeats)
  assert got == expected, 'the integer shortcut and math-verify disagree'
  assert sum(got) == args.completions // 2
  print(f'{args.completions} integer-answer completions, {args.workers} reward workers (median of {args.repeats})')
  print(f'{"path":<28} {"s per map":>10} {"completions/s":>14}')
  for name, seconds in (('math-verify in the workers', reference), ('integer shortcut', shortcut)):
    print(f'{name:<28} {seconds:>10.4f} {args.completions / seconds:>14,.0f}')
  print(f'shortcut vs math-verify: {reference / shortcut:.1f}x faster')


if __name__ == '__main__':
  main()
