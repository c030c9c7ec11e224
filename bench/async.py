"""python bench/async.py [--preset small] [--prompts 8 --group 8] [--new-tokens 256] [--lags 1,2] [--steps 6]

Whole RL steps per second with partial rollouts (algo.max_lag L: groups in flight across steps,
sampler/pool.py) against on-policy steps, on long-tailed answers: each decoded token is a stop
token with probability ~1/mean (a random 1/mean share of a random model's vocabulary; mean N/8 by
default, capped at N), so an on-policy step waits for its longest answer while partial rollouts
keep every decode slot busy. Each step is the run's whole step (rl/step.py, K steps in one jit):
prompts, rollout, a reward in JAX, advantages and the optax update, same model, slots, prompts
per step, packed update (only real tokens are trained on) and CPU threads. The table also shows the tokens each step trained on and the lag.
With --split two last rows run split devices at max_lag 1 (rollout.devices=1): the sampler on a
second host device decodes the next step's groups while the first trains, the same cores shared
('pipelined', as train.py runs it), and the same run with the host waiting for the sampler's
advance before it dispatches the update ('serial': what a step costs when nothing overlaps).
"""


import argparse
import os
import sys

import harness

PRESETS = harness.presets('small', 'mid')


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
  parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
  parser.add_argument('--prompts', type=int, default=8, help='P, prompts per step')
  parser.add_argument('--group', type=int, default=8, help='G, samples per prompt')
  parser.add_argument('--prompt-length', type=int, default=16)
  parser.add_argument('--new-tokens', type=int, default=256, help='N, the length cap')
  parser.add_argument('--mean', type=float, default=0, help='target mean answer length (default N / 8)')
  parser.add_argument('--lags', default='1,2', help='algo.max_lag values to run beside on-policy (0)')
  parser.add_argument('--steps', type=int, default=6, help='RL steps per timed call (one jit)')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--stale-groups', default='wait', choices=['wait', 'regenerate'],
                      help='algo.stale_groups of the partial-rollout modes')
  parser.add_argument('--split', action='store_true',
                      help='also split devices at max_lag 1: sampler and trainer on one CPU device each, '
                           'pipelined and serial (rollout.devices=1; host loop, one step per call)')
  return parser.parse_args()


args = parse_args()
if args.split:  # a second host device for the sampler (the other modes use the first only)
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2').strip()
harness.limit_threads(args.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.rl.held import Held
from grpo_jax.build import build_rl_step  # noqa: E402
from grpo_jax.config import load_config  # noqa: E402
from grpo_jax.model import MeshConfig, Qwen2Config, make_mesh  # noqa: E402
from grpo_jax.model.loading import init_model  # noqa: E402
from grpo_jax.rl.state import create_train_state  # noqa: E402


def main():
  architecture = Qwen2Config(**PRESETS[args.preset])
  P, G, N = args.prompts, args.group, args.new_tokens
  mean = args.mean or N / 8
  task = harness.LongTailTask(architecture.vocab_size, args.prompt_length, harness.stop_tokens(architecture.vocab_size, mean))
  mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  runs, states, steps_of, out = {}, {}, {}, {}
  lags = [0] + [int(lag) for lag in args.lags.split(',') if lag]
  modes = [(lag, '') for lag in lags] + ([(1, 'pipelined'), (1, 'serial')] if args.split else [])
  for lag, split in modes:
    overrides = [f'rollout.prompts_per_step={P}', f'algo.group_size={G}', f'rollout.max_new_tokens={N}',
                 'rollout.temperature=1.0', 'algo.packing=true', f'algo.micro_batch_tokens={8 * (args.prompt_length + N)}', f'algo.max_lag={lag}', 'algo.tis_cap=2.0', 'optim.learning_rate=1e-5',
                 f'train.steps_per_call={args.steps}', 'train.checkpoint_every=0', f'rollout.devices={int(bool(split))}',
                 f'algo.stale_groups={args.stale_groups}']
    config = load_config(os.path.join(os.path.dirname(__file__), '..', 'configs', 'tiny_arith.yaml'), overrides)
    with jax.set_mesh(mesh):
      model = init_model(architecture, options=config.model.options, mesh=mesh, seed=0)
      rl_step = build_rl_step(config, model, mesh, task, sampler_devices=jax.devices()[1:2] if split else None)
      state = create_train_state(nnx.state(model), rl_step.optimizer, 0, pool=rl_step.empty_pool,
                                 shardings=rl_step.state_shardings)
    if split == 'serial':  # the host waits for the sampler's advance before it goes on
      advance = rl_step.host_mode.advance
      rl_step.host_mode.advance = lambda *a, advance=advance: jax.block_until_ready(advance(*a))
    name = (f'split devices, max_lag 1, {split}' if split else 'on-policy' if lag == 0 else
            f'partial rollouts, max_lag {lag}')
    if lag and args.stale_groups == 'regenerate':
      name += ', regenerate'
    states[name], steps_of[name] = state, rl_step

    def run(name=name, split=bool(split)):
      state = states[name]
      with jax.set_mesh(mesh):
        if split:  # two programs on two devices: steps from the host, stacked like run_steps' metrics
          rows = []
          for _ in range(args.steps):
            state, row = steps_of[name](state, None)
            rows.append(row)
          metrics = {key: np.stack([np.asarray(row[key]) for row in jax.device_get(rows)]) for key in rows[0]}
          state = jax.block_until_ready(state)  # the sampler's last advance is part of the call
        else:
          state, metrics = steps_of[name].run_steps(state, Held(), args.steps)
          metrics = jax.device_get(metrics)
      states[name] = state
      out.setdefault(name, []).append(metrics)
    runs[name] = run
  results = harness.interleaved(runs, args.repeats)

  print(f'\n{args.preset}: {architecture.num_params() / 1e6:.0f}M params, {P} prompts x {G} samples per step, '
        f'{P * G} decode slots, cap N = {N}, target mean length {mean:.0f}; {args.steps} RL steps per call, '
        f'{jax.default_backend()}, {args.threads} threads, median of {args.repeats}')
  print(f'{"mode":<36} {"warm-up s":>9} {"s/step":>8} {"steps/s":>8} {"vs on-policy":>12} {"decode it/step":>14} '
        f'{"trained tok/step":>16} {"lag mean":>8} {"lag max":>7} {"occupancy":>9}')
  base = args.steps / results['on-policy'][1]
  for name, (first, seconds) in results.items():
    metrics = {key: np.concatenate([np.asarray(m[key]).reshape(-1) for m in out[name][1:]])
               for key in out[name][0]}
    rate = args.steps / seconds
    lag_mean = float(np.mean(metrics['lag_mean'])) if 'lag_mean' in metrics else 0.0
    lag_max = int(np.max(metrics['lag_max'])) if 'lag_max' in metrics else 0
    print(f'{name:<36} {first:>9.2f} {seconds / args.steps:>8.3f} {rate:>8.2f} {rate / base:>11.2f}x '
          f'{np.mean(metrics["decode_steps"]):>14.1f} {np.mean(metrics["completion_tokens"]):>16.0f} '
          f'{lag_mean:>8.2f} {lag_max:>7} {np.mean(metrics["slot_occupancy"]):>9.0%}')
  print('steps/s: whole RL steps (rollout, reward, update); decode it/step: decode-loop iterations per step; '
        'occupancy: decoded tokens / (iterations x slots)')


if __name__ == '__main__':
  main()
