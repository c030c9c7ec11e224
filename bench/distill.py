"""On-policy distillation against GRPO alone, on CPU: steps for a fresh student to reach a mean
reward of 0.8 over its last 20 steps, with the teacher's per-token signal and with the reward alone,
from the same initial weights (run.seed), at each seed; the table and both curves for BENCHMARKS.md.

The student is configs/tiny_arith_distill.yaml (half the arith demo's width); the teacher is the
checkpoint the arith demo trains at run.seed=1 (made here first when --teacher holds none, as
`make demo-distill` makes it). GRPO alone is the same config without the teacher, at its own
learning rate (--rl-learning-rate; the arith demo's 1e-3, the best of those tried for it).

  python bench/distill.py [--seeds 0 1 2] [--steps 600] [--teacher runs/tiny_arith_teacher]
                          [--plot bench/distill.png]
"""

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = 'configs/tiny_arith_distill.yaml'
TARGET, WINDOW = 0.8, 20


def make_teacher(directory: str) -> None:
  """The arith demo's run at run.seed=1 into `directory`, unless it holds a checkpoint already."""
  if os.path.isdir(os.path.join(directory, 'checkpoints')) and os.listdir(os.path.join(directory, 'checkpoints')):
    return
  subprocess.run([sys.executable, '-m', 'grpo_jax.train', '--config', 'configs/tiny_arith.yaml', '--workdir', directory,
                  '--set', 'run.seed=1', '--set', 'train.progress=false'], cwd=ROOT, check=True,
                 stdout=subprocess.DEVNULL)


def train(seed: int, steps: int, overrides: list[str]) -> tuple[list[float], float]:
  """(reward_mean per step, wall seconds) of one run of CONFIG."""
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, '-m', 'grpo_jax.train', '--config', CONFIG, '--workdir', workdir,
               '--set', f'run.seed={seed}', '--set', f'train.steps={steps}', '--set', 'train.progress=false',
               '--set', 'train.tensorboard=false', '--set', 'train.checkpoint_every=0',
               *(x for o in overrides for x in ('--set', o))]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
      raise SystemExit(f'seed {seed} {overrides}: exit {result.returncode}\n{result.stderr[-2000:]}')
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      return [json.loads(line)['reward_mean'] for line in f], time.perf_counter() - start


def steps_to_target(rewards: list[float]) -> int | None:
  """The first step whose last-WINDOW mean reward reaches TARGET, None when none does."""
  trailing = np.convolve(rewards, np.ones(WINDOW) / WINDOW, mode='valid')
  reached = np.flatnonzero(trailing >= TARGET)
  return int(reached[0]) + WINDOW if reached.size else None


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
  parser.add_argument('--steps', type=int, default=600, help='each run\'s length (a run not at 0.8 by then: "> steps")')
  parser.add_argument('--teacher', default=os.path.join(ROOT, 'runs', 'tiny_arith_teacher'))
  parser.add_argument('--rl-learning-rate', type=float, default=1e-3)
  parser.add_argument('--parallel', type=int, default=2)
  parser.add_argument('--plot', help='a PNG of the curves')
  args = parser.parse_args()
  make_teacher(args.teacher)
  runs = [(seed, kind) for seed in args.seeds for kind in ('distill', 'grpo')]
  overrides = dict(distill=[f'algo.teacher={args.teacher}'],
                   grpo=['algo.teacher=null', f'optim.learning_rate={args.rl_learning_rate}'])
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    results = dict(zip(runs, pool.map(lambda run: train(run[0], args.steps, overrides[run[1]]), runs)))
  print(f'python bench/distill.py --seeds {" ".join(map(str, args.seeds))} --steps {args.steps}')
  print(f'| seed | steps to a last-{WINDOW} reward of {TARGET}, distillation | GRPO alone | ratio | '
        f'last-{WINDOW} reward at the end, distillation | GRPO alone | wall, distillation | GRPO alone |')
  print('|---|---|---|---|---|---|---|---|')
  for seed in args.seeds:
    (distill, distill_s), (grpo, grpo_s) = results[seed, 'distill'], results[seed, 'grpo']
    reach = [steps_to_target(distill), steps_to_target(grpo)]
    ratio = f'{reach[0] / reach[1]:.2f}' if None not in reach else '-'
    shown = [str(r) if r is not None else f'> {args.steps}' for r in reach]
    print(f'| {seed} | {shown[0]} | {shown[1]} | {ratio} | {np.mean(distill[-WINDOW:]):.3f} | '
          f'{np.mean(grpo[-WINDOW:]):.3f} | {distill_s:.0f} s | {grpo_s:.0f} s |')
  if args.plot:
    import matplotlib
    matplotlib.use('Agg')
    from matplotlib import pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    for seed in args.seeds:
      for kind, color in (('distill', 'tab:blue'), ('grpo', 'tab:orange')):
        rewards = results[seed, kind][0]
        trailing = np.convolve(rewards, np.ones(WINDOW) / WINDOW, mode='valid')
        label = ('on-policy distillation' if kind == 'distill' else 'GRPO alone') if seed == args.seeds[0] else None
        axes.plot(np.arange(WINDOW, len(rewards) + 1), trailing, color=color, alpha=0.8, label=label)
    axes.axhline(TARGET, color='grey', linestyle=':')
    axes.set_xlabel('RL step')
    axes.set_ylabel(f'mean reward, last {WINDOW} steps')
    axes.set_title(f'tiny arith student, seeds {", ".join(map(str, args.seeds))}')
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.plot, dpi=100)


if __name__ == '__main__':
  main()
