"""python bench/lag_learning.py [--config configs/tiny_arith.yaml] [--seeds 0,1,2] [--lags 0,1,2] [--target 0.8]

Learning per step at a bounded lag: the same run (`python -m grpo_jax.train`) on-policy and with
partial rollouts at algo.max_lag 1 and 2 (tis_cap 2), several seeds each. For each run it prints
the first step at which the mean reward over the last 10 steps reaches --target, and the mean
reward of the last 10 steps. The issue's criterion: lag runs reach the target within 10% more
steps than the on-policy run of the same seed. Extra --set overrides go after `--`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--config', default=os.path.join(ROOT, 'configs', 'tiny_arith.yaml'))
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--lags', default='0,1,2')
  parser.add_argument('--target', type=float, default=0.8, help='reward the 10-step mean must reach')
  parser.add_argument('overrides', nargs='*', help='more KEY=VALUE config overrides')
  return parser.parse_args()


def steps_to(rewards: list[float], target: float, window: int = 10) -> int | None:
  for end in range(window, len(rewards) + 1):
    if sum(rewards[end - window:end]) / window >= target:
      return end
  return None


def run(config: str, seed: int, lag: int, overrides: list[str], workdir: str) -> list[float]:
  settings = [f'run.seed={seed}', f'algo.max_lag={lag}', 'train.progress=false', 'train.checkpoint_every=0',
              *(['algo.tis_cap=2.0'] if lag else []), *overrides]
  command = [sys.executable, '-m', 'grpo_jax.train', '--config', config, '--workdir', workdir]
  for setting in settings:
    command += ['--set', setting]
  subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line)['reward_mean'] for line in f]


def main():
  args = parse_args()
  seeds = [int(s) for s in args.seeds.split(',')]
  lags = [int(lag) for lag in args.lags.split(',')]
  print(f'{os.path.relpath(args.config, ROOT)} {" ".join(args.overrides)}: steps until the 10-step mean reward '
        f'reaches {args.target}; last-10 mean reward in brackets')
  print(f'{"seed":>4} ' + ' '.join(f'{"lag " + str(lag):>16}' for lag in lags))
  ratios = {lag: [] for lag in lags}
  with tempfile.TemporaryDirectory(prefix='lag_learning_') as scratch:
    for seed in seeds:
      cells, base = [], None
      for lag in lags:
        rewards = run(args.config, seed, lag, args.overrides, os.path.join(scratch, f's{seed}l{lag}'))
        reached = steps_to(rewards, args.target)
        if lag == lags[0]:
          base = reached
        if reached and base:
          ratios[lag].append(reached / base)
        last = sum(rewards[-10:]) / len(rewards[-10:])
        cells.append(f'{reached if reached else "never":>7} [{last:.3f}]')
      print(f'{seed:>4} ' + ' '.join(f'{cell:>16}' for cell in cells), flush=True)
  print('steps relative to the first column, per seed: ' + '; '.join(
      f'lag {lag}: {", ".join(f"{r:.2f}" for r in ratios[lag]) or "-"}' for lag in lags[1:]))


if __name__ == '__main__':
  main()
