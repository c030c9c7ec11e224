"""python bench/exact_on_policy.py time [--config configs/tiny_arith.yaml] [--steps 12] [-- KEY=VALUE ...]
python bench/exact_on_policy.py learn [--seeds 0,1] [--plot bench/exact_on_policy.png] [-- KEY=VALUE ...]

algo.exact_on_policy, its price and what it buys.

time: the config's RL steps with the option off, then on, in this process (--steps + 2 steps each,
the first two, which compile, not counted); prints the median rollout, update and step seconds of
each, the ratios on / off, and each variant's largest sampler_gap_max (0 exactly with the option).

learn: whole runs (`python -m grpo_jax.train`, XLA's default optimisation level) in bf16 compute,
on-policy, with the option off, on, and off with algo.tis_cap 2 (the correction it replaces); per
seed the steps until the 10-step mean reward reaches --target, the last-10 mean, and the mean
sampler_gap_max; the reward curves drawn to --plot.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, os.path.join(ROOT, 'tests'))  # runs.train_here: the run the command line makes, in-process

VARIANTS = {'off': [], 'on': ['algo.exact_on_policy=true'], 'tis_cap 2': ['algo.tis_cap=2.0']}
BF16 = ['model.dtype=bfloat16', 'model.param_dtype=float32']


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[3])
  parser.add_argument('mode', choices=('time', 'learn'))
  parser.add_argument('--config', default='configs/tiny_arith.yaml')
  parser.add_argument('--steps', type=int, default=12, help='time: timed steps per variant')
  parser.add_argument('--seeds', default='0,1', help='learn: run seeds')
  parser.add_argument('--target', type=float, default=0.8, help='learn: reward the 10-step mean must reach')
  parser.add_argument('--plot', default=os.path.join(ROOT, 'bench', 'exact_on_policy.png'))
  parser.add_argument('overrides', nargs='*', help='more KEY=VALUE config overrides')
  return parser.parse_args()


def timed(args) -> None:
  import jax

  from grpo_jax import config as config_lib
  from grpo_jax import train
  base = ['train.progress=false', 'train.checkpoint_every=0', 'train.tensorboard=false', 'eval.every=0',
          'train.steps_per_call=1', *args.overrides]
  path = os.path.join(ROOT, args.config)
  rows = {}
  for name in ('off', 'on'):
    with tempfile.TemporaryDirectory() as workdir:
      config = config_lib.load_config(path, base + VARIANTS[name] + [f'train.steps={args.steps + 2}'])
      run = train.setup(config, path, workdir, devices=jax.devices()[:1])
      start = time.perf_counter()
      rows[name] = train.train(config, *run)[2:]  # the first two steps compile
      rows[name][0]['wall_s'] = time.perf_counter() - start
  for name, history in rows.items():
    step = statistics.median(r['rollout_s'] + r['update_s'] for r in history)
    print(f"{name:4s} rollout {statistics.median(r['rollout_s'] for r in history):.4f} s  "
          f"update {statistics.median(r['update_s'] for r in history):.4f} s  step {step:.4f} s  "
          f"sampler_gap_max {max(r['sampler_gap_max'] for r in history):.3g}")
  for part in ('rollout_s', 'update_s'):
    on = statistics.median(r[part] for r in rows['on'])
    off = statistics.median(r[part] for r in rows['off'])
    print(f'{part} on / off: {on / off:.2f}x')
  on = statistics.median(r['rollout_s'] + r['update_s'] for r in rows['on'])
  off = statistics.median(r['rollout_s'] + r['update_s'] for r in rows['off'])
  print(f'step on / off: {on / off:.2f}x')


def steps_to(rewards: list[float], target: float, window: int = 10) -> int | None:
  for end in range(window, len(rewards) + 1):
    if sum(rewards[end - window:end]) / window >= target:
      return end
  return None


def learn(args) -> None:
  curves = {}
  for seed in (int(s) for s in args.seeds.split(',')):
    for name, settings in VARIANTS.items():
      with tempfile.TemporaryDirectory() as workdir:
        command = [sys.executable, '-m', 'grpo_jax.train', '--config', os.path.join(ROOT, args.config),
                   '--workdir', workdir]
        for override in [f'run.seed={seed}', 'train.progress=false', 'train.checkpoint_every=0', *BF16, *settings,
                         *args.overrides]:
          command += ['--set', override]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
        with open(os.path.join(workdir, 'metrics.jsonl')) as f:
          history = [json.loads(line) for line in f]
      rewards = [row['reward_mean'] for row in history]
      gaps = [row['sampler_gap_max'] for row in history]
      curves[seed, name] = rewards
      print(f'seed {seed} {name:9s}: steps to {args.target}: {steps_to(rewards, args.target)}  '
            f'last-10 mean {sum(rewards[-10:]) / 10:.3f}  mean sampler_gap_max {sum(gaps) / len(gaps):.3g}', flush=True)
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  figure, axis = plt.subplots(figsize=(7, 4))
  for (seed, name), rewards in curves.items():
    smooth = [sum(rewards[max(0, i - 9):i + 1]) / len(rewards[max(0, i - 9):i + 1]) for i in range(len(rewards))]
    axis.plot(smooth, label=f'{name}, seed {seed}', linestyle=('-', '--', ':')[list(VARIANTS).index(name)])
  axis.set_xlabel('step')
  axis.set_ylabel('reward (10-step mean)')
  axis.set_title('bf16 compute: exact_on_policy off / on / tis_cap 2')
  axis.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(args.plot, dpi=100)
  print('plot:', args.plot)


if __name__ == '__main__':
  arguments = parse_args()
  (timed if arguments.mode == 'time' else learn)(arguments)
