"""PYTHONPATH=. python bench/reward_packing.py [--config configs/tiny_reward_model.yaml] [--steps 40]

The reward-model trainer's step (python -m grpo_jax.train_reward) with and without
`preferences.packing`, side by side in one process, on the demo's preference pairs
(grpo_jax/data/synthetic_preferences.py, written to a temporary directory). Both runs are the
trainer's own RewardRun on the same config and pairs; their steps take turns, so drift in the
machine's load hits both alike. Prints, per layout, the first step (compile included), the median
seconds per step, the tokens each computed row holds (the fill: real tokens over the tokens the
update computes, over the run's batches) and the ratio of step times, with the losses of the last
step of each (the same pairs, so the same loss).
"""

import argparse
import os
import sys
import tempfile

import harness


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--config', default='configs/tiny_reward_model.yaml')
  parser.add_argument('--steps', type=int, default=40, help='timed steps of each layout')
  parser.add_argument('--packed-length', type=int, default=0, help='preferences.packed_length (0: max_length)')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--set', action='append', default=[], dest='overrides', help='more config overrides')
  return parser.parse_args()


args = parse_args()
harness.limit_threads(args.threads)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from grpo_jax import train_reward  # noqa: E402
from grpo_jax.data import synthetic_preferences  # noqa: E402


def main():
  scratch = tempfile.mkdtemp(prefix='reward_packing_')
  paths = synthetic_preferences.write(os.path.join(scratch, 'data'))
  common = [f'preferences.source={paths["pairs"]}', f'preferences.tokenizer={paths["tokenizer"]}',
            f'eval.source={paths["held_out"]}', f'train.steps={args.steps + 1}', 'train.progress=false',
            'train.tensorboard=false', *args.overrides]
  layouts = {'padded': ['preferences.packing=false'],
             'packed': ['preferences.packing=true', f'preferences.packed_length={args.packed_length}']}
  runs = {}
  for name, overrides in layouts.items():
    config = train_reward.load_config(args.config, [*common, *overrides])
    workdir, mesh = train_reward.setup(config, args.config, os.path.join(scratch, name), devices=jax.devices()[:1])
    runs[name] = train_reward.RewardRun(config, workdir, mesh)
  last = {}

  def stepper(name):
    def step():
      last[name] = runs[name].train_step(runs[name].step)
    return step
  timings = harness.interleaved({name: stepper(name) for name in runs}, args.steps)
  report = runs['packed'].data.report
  fill = runs['packed'].fill
  print(f'pairs {report["train_pairs"]}, {runs["padded"].config.preferences.pairs_per_batch} a step; padded rows of '
        f'{report["width"]} tokens, packed rows of {report["row_length"]} ({runs["packed"].packed.rows} per '
        f'micro-batch and group, {np.mean(fill["packed_rows"]):.1f} in use on average); {args.steps} timed steps')
  print(f'{"layout":>8}  {"first step s":>12}  {"s / step":>9}  {"fill":>6}  {"loss (last step)":>16}')
  fills = {'padded': 1 - np.mean(fill['padding_frac']), 'packed': 1 - np.mean(fill['packed_padding_frac'])}
  for name, (first, median) in timings.items():
    print(f'{name:>8}  {first:12.3f}  {median:9.4f}  {fills[name]:6.1%}  {last[name]["loss"]:16.6f}')
  ratio = timings['padded'][1] / timings['packed'][1]
  print(f'packed / padded: {ratio:.2f}x faster per step; fill {fills["packed"]:.1%} vs {fills["padded"]:.1%}')
  for run in runs.values():
    run.close()


if __name__ == '__main__':
  sys.exit(main())
