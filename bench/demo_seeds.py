"""Does a demo learn at every seed? Runs a config's whole training at seeds 0-4 (two at a time, each
on one process of this machine's CPU) and prints, per seed, the mean reward over the first and the
last 10 steps, the last 10 steps' mean entropy and the wall time: the per-seed table BENCHMARKS.md
keeps for each `configs/tiny_*.yaml` demo.

  python bench/demo_seeds.py --config configs/tiny_arith_moe.yaml [--seeds 0 1 2 3 4] [--set KEY=VALUE ...]
                            [--metrics DIR]   (keeps each seed's metrics.jsonl as DIR/seed_S.jsonl)
"""

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, seed: int, overrides: list[str], keep: str | None) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, '-m', 'grpo_jax.train', '--config', config, '--workdir', workdir,
               '--set', f'run.seed={seed}', '--set', 'train.progress=false', '--set', 'train.tensorboard=false',
               '--set', 'train.checkpoint_every=0', *(x for o in overrides for x in ('--set', o))]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
      raise SystemExit(f'seed {seed}: exit {result.returncode}\n{result.stderr[-2000:]}')
    if keep:
      shutil.copy(os.path.join(workdir, 'metrics.jsonl'), os.path.join(keep, f'seed_{seed}.jsonl'))
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = [json.loads(line) for line in f]
  mean = lambda rows, name: sum(row.get(name, 0.0) for row in rows) / len(rows)  # noqa: E731
  return dict(seed=seed, steps=len(rows), first=mean(rows[:10], 'reward_mean'), last=mean(rows[-10:], 'reward_mean'),
              entropy=mean(rows[-10:], 'entropy'), seconds=seconds)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True)
  parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2, 3, 4])
  parser.add_argument('--set', dest='overrides', action='append', default=[])
  parser.add_argument('--parallel', type=int, default=2)
  parser.add_argument('--metrics', help="a folder to keep each seed's metrics.jsonl in")
  args = parser.parse_args()
  if args.metrics:
    os.makedirs(args.metrics, exist_ok=True)
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    results = list(pool.map(lambda seed: run(args.config, seed, args.overrides, args.metrics), args.seeds))
  print(f'{args.config} {" ".join(args.overrides)}')
  print('| seed | steps | reward, first 10 | reward, last 10 | entropy, last 10 | wall |')
  print('|---|---|---|---|---|---|')
  for r in results:
    print(f'| {r["seed"]} | {r["steps"]} | {r["first"]:.3f} | {r["last"]:.3f} | {r["entropy"]:.3f} '
          f'| {r["seconds"]:.0f} s |')


if __name__ == '__main__':
  main()
