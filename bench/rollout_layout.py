"""python bench/rollout_layout.py --config configs/X.yaml --model-size 32B --target h100x8x8 [--tensors 1,2,4,8]

The sampler's program compiled for a target that is not attached (deviceless, grpo_jax/plan/targets.py),
once in the training layout (weights gathered for every decoded token, as grpo_jax decoded before
the rollout layout) and once per sampler tensor size t in its own layout (weights resident), side
by side: the compiler's peak memory per device, the collectives read from the optimized program
(traffic.py) per run (the once-per-rollout reshard and the prefill) and per decode step, and per
decode step the two times that bound it: HBM (the resident weights and half the KV cache read) and
interconnect (the decode step's collectives at the target's link bandwidth). Run with the compilers
on the path: PYTHONPATH=.venv/compilers:. JAX_PLATFORMS=cpu TPU_WORKER_HOSTNAMES=localhost
ALLOW_MULTIPLE_LIBTPU_LOAD=1.
"""

import argparse
import json
import os
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_jax import config as config_lib  # noqa: E402
from grpo_jax.plan import programs, report as plan, targets  # noqa: E402
from grpo_jax.errors import UserError  # noqa: E402

GiB = 1 << 30


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--config', required=True)
  parser.add_argument('--model-size')
  parser.add_argument('--target', required=True)
  parser.add_argument('--layers', type=int)
  parser.add_argument('--tensors', default='1,2,4,8', help='sampler tensor sizes t to compile')
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  parser.add_argument('--json', help='also write the rows as JSON')
  return parser.parse_args()


def row(label: str, report: dict, target: targets.Target, steps: int) -> dict:
  rollout = next(program for program in report['programs'] if program['name'] != 'update')
  per_device = report['per_device']
  hbm_s = (per_device['resident_weights'] + per_device['kv_cache'] / 2) / target.hbm_bandwidth
  return dict(layout=label, peak_gib=rollout['peak'] / GiB, fits=rollout['peak'] <= target.hbm_bytes,
              resident_gib=per_device['resident_weights'] / GiB,
              per_run_gib={k: v / GiB for k, v in rollout['collectives']['outside'].items() if v},
              per_step_gib={k: v / GiB for k, v in rollout['collectives']['per_decode_step'].items() if v},
              step_hbm_ms=1e3 * hbm_s, step_interconnect_ms=1e3 * rollout['interconnect_s']['per_decode_step'],
              rollout_s=steps * max(hbm_s, rollout['interconnect_s']['per_decode_step'])
              + rollout['interconnect_s']['outside'])


def main():
  args = parse_args()
  target = targets.parse_target(args.target)
  config = config_lib.load_config(args.config, args.overrides)
  architecture = programs.model_architecture(config, args.model_size, args.layers)
  only = None if config.task.jittable else {'rollout'}
  steps = config.rollout.max_new_tokens
  rows = []
  trials = [('training layout', config, False)] + [
      (f'resident, t={tensor}', config_lib.load_config(args.config, [*args.overrides, f'rollout.tensor={tensor}']), True)
      for tensor in (int(t) for t in args.tensors.split(','))]
  for label, configured, resident in trials:
    try:
      rows.append(row(label, plan.plan(configured, target, architecture, only=only, resident=resident), target, steps))
    except UserError as error:  # XLA:TPU refuses a program whose temporaries exceed the HBM
      rows.append(dict(layout=label, refused=str(error)))
  print(f'# {target.describe()}; {architecture.num_params() / 1e9:.2f}B parameters, {steps} decode steps')
  print(f'{"layout":<18}{"peak GiB":>9}{"resident":>9}{"reshard+prefill GiB":>21}{"per step GiB":>13}'
        f'{"HBM ms":>8}{"link ms":>9}{"rollout s":>10}  (per step = max(HBM, link))')
  for r in rows:
    if 'refused' in r:
      print(f'{r["layout"]:<18}  {r["refused"]}')
      continue
    print(f'{r["layout"]:<18}{r["peak_gib"]:>9.2f}{r["resident_gib"]:>9.2f}{sum(r["per_run_gib"].values()):>21.2f}'
          f'{sum(r["per_step_gib"].values()):>13.3f}{r["step_hbm_ms"]:>8.2f}{r["step_interconnect_ms"]:>9.2f}'
          f'{r["rollout_s"]:>10.1f}' + ('' if r['fits'] else '  DOES NOT FIT'))
  best = min((r for r in rows if r.get('fits')), key=lambda r: r['rollout_s'], default=None)
  if best is not None:
    before = rows[0].get('rollout_s')
    print(f'fastest that fits: {best["layout"]}' + (f' ({before / best["rollout_s"]:.1f}x the training layout)'
                                                      if before else ''))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)


if __name__ == '__main__':
  main()
