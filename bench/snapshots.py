"""python bench/snapshots.py [--config configs/tiny_arith.yaml] [--steps 40] [--every 5] [-- KEY=VALUE ...]

What Hugging Face snapshots while training (train.export_hf_every) cost a step: the config's run
without snapshots, then with one every --every steps, in this process, from the same seed (the
first call of each, which compiles, not counted), --rounds times each in alternating order. Per variant: the median and mean step seconds
(the step's own clock, step_time_s), the snapshots' waits (export_hf_s: the policy's copy to the
host, and a wait for the previous snapshot's thread), and the cost: (step time + wait) with
snapshots over step time without. The writer thread runs beside the steps: what it takes from
them shows in the step times.

Default model: the arith demo's task at a width that gives each snapshot some size
(hidden 256, 4 layers: 3.2M parameters, 12.6 MB in fp32).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
sys.path.insert(0, os.path.join(ROOT, 'tests'))  # runs.train_here: the run the command line makes, in-process

WIDE = ['model.architecture.hidden_size=256', 'model.architecture.intermediate_size=688',
        'model.architecture.num_hidden_layers=4', 'model.architecture.num_attention_heads=4',
        'model.architecture.num_key_value_heads=2']


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--config', default='configs/tiny_arith.yaml')
  parser.add_argument('--steps', type=int, default=40)
  parser.add_argument('--every', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=2, help='runs of each variant, in the order A B B A A B B A ...')
  parser.add_argument('overrides', nargs='*', help='more KEY=VALUE config overrides (default: the wide model)')
  args = parser.parse_args()
  from runs import train_here

  common = ['train.steps_per_call=1', 'train.checkpoint_every=0', 'train.progress=false', 'train.tensorboard=false',
            f'train.steps={args.steps}', *(args.overrides or WIDE)]
  variants = {'without': [], 'with': [f'train.export_hf_every={args.every}']}
  order = [name for r in range(args.rounds) for name in (('without', 'with') if r % 2 == 0 else ('with', 'without'))]
  runs = {name: [] for name in variants}
  for name in order:
    with tempfile.TemporaryDirectory() as workdir:
      history = train_here(workdir, args.config, *common, *variants[name])[1:]
      size = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(os.path.join(workdir, 'hf'))
                 for f in files)
    runs[name].append((history, size))
  results = {}
  for name, done in runs.items():
    rows = [row for history, _ in done for row in history]
    steps = [row['step_time_s'] for row in rows]
    waits = [row.get('export_hf_s', 0.0) for row in rows]
    snapshots = sum('export_hf_s' in row for row in rows)
    results[name] = dict(runs=len(done), steps=len(rows), median_step_s=statistics.median(steps), mean_step_s=statistics.fmean(steps),
                         mean_wait_s=statistics.fmean(waits), snapshots=snapshots, max_wait_s=max(waits),
                         bytes_per_snapshot=sum(size for _, size in done) / max(snapshots, 1))
  base = results['without']['mean_step_s']
  with_ = results['with']
  results['cost'] = dict(step_ratio=with_['mean_step_s'] / base,
                         step_and_wait_ratio=(with_['mean_step_s'] + with_['mean_wait_s']) / base,
                         wait_per_snapshot_s=with_['mean_wait_s'] * with_['steps'] / max(with_['snapshots'], 1))
  print(json.dumps(results, indent=2))


if __name__ == '__main__':
  main()
