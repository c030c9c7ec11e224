"""python bench/split_devices.py [--preset small] [--prompts 8 --group 8] [--new-tokens 128] [--steps 4] [--repeats 3]

Split devices on the CPU (rollout.devices, algo.max_lag 1): two host devices, one the sampler's
and one the trainer's, on long-tailed answers (bench/harness.LongTailTask, mean N/8). 'pipelined'
is the run as train.py runs it: each step dispatches the sampler's advance for the next step, then
its own update, and the two programs run at once on their devices. 'serial' is the same run with
the host waiting for the sampler before it dispatches the update (what a step costs when nothing
overlaps). Each timed call runs --steps whole RL steps from the host and waits for both devices.
"""

import argparse
import dataclasses
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
  parser.add_argument('--new-tokens', type=int, default=128, help='N, the length cap')
  parser.add_argument('--steps', type=int, default=4, help='RL steps per timed call')
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--repeats', type=int, default=3)
  return parser.parse_args()


args = parse_args()
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=2').strip()
harness.limit_threads(args.threads)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax.build import build_rl_step  # noqa: E402
from grpo_jax.config import load_config  # noqa: E402
from grpo_jax.model import MeshConfig, Qwen2Config, make_mesh  # noqa: E402
from grpo_jax.model.loading import init_model  # noqa: E402
from grpo_jax.rl.state import create_train_state  # noqa: E402


def main():
  architecture = Qwen2Config(**PRESETS[args.preset])
  P, G, N = args.prompts, args.group, args.new_tokens
  task = harness.LongTailTask(architecture.vocab_size, args.prompt_length, harness.stop_tokens(architecture.vocab_size, N / 8))
  trainer, sampler = jax.devices()[:1], jax.devices()[1:2]
  mesh = make_mesh(MeshConfig(1, 1, 1), devices=trainer)
  overrides = [f'rollout.prompts_per_step={P}', f'algo.group_size={G}', f'rollout.max_new_tokens={N}',
               'rollout.temperature=1.0', 'algo.packing=true', f'algo.micro_batch_tokens={8 * (args.prompt_length + N)}',
               'algo.max_lag=1', 'algo.tis_cap=2.0', 'optim.learning_rate=1e-5', 'rollout.devices=1',
               'train.checkpoint_every=0']
  config = load_config(os.path.join(os.path.dirname(__file__), '..', 'configs', 'tiny_arith.yaml'), overrides)
  runs, out = {}, {}
  for name in ('serial', 'pipelined'):
    with jax.set_mesh(mesh):
      model = init_model(architecture, options=config.model.options, mesh=mesh, seed=0)
      rl_step = build_rl_step(config, model, mesh, task, sampler_devices=sampler)
      state = create_train_state(nnx.state(model), rl_step.optimizer, 0, pool=rl_step.empty_pool,
                                 shardings=rl_step.state_shardings)
      state, position = rl_step.prime(state, 0)
    if name == 'serial':  # the host waits for the sampler's advance before it goes on
      advance = rl_step.jitted.advance
      rl_step.jitted = dataclasses.replace(rl_step.jitted,
                                           advance=lambda *a, advance=advance: jax.block_until_ready(advance(*a)))
    carried = [state, position]

    def run(name=name, rl_step=rl_step, carried=carried):
      state, position = carried
      rows = []
      with jax.set_mesh(mesh):
        for _ in range(args.steps):
          state, metrics = rl_step(state, None, position)
          rows.append(metrics)
          position += P
      carried[:] = [jax.block_until_ready(state), position]
      out.setdefault(name, []).append(jax.device_get(rows))
    runs[name] = run
  results = harness.interleaved(runs, args.repeats)

  print(f'\n{args.preset}: {architecture.num_params() / 1e6:.0f}M params, {P} prompts x {G} samples per step, '
        f'cap N = {N}, mean length ~{N / 8:.0f}; sampler and trainer on one CPU device each, max_lag 1; '
        f'{args.steps} RL steps per call, {args.threads} threads, median of {args.repeats}')
  print(f'{"mode":<10} {"warm-up s":>9} {"s/step":>8} {"vs serial":>9} {"decode it/step":>14} {"lag mean":>8}')
  base = results['serial'][1]
  for name, (first, seconds) in results.items():
    rows = [row for call in out[name][1:] for row in call]
    print(f'{name:<10} {first:>9.2f} {seconds / args.steps:>8.3f} {base / seconds:>8.2f}x '
          f'{np.mean([row["decode_steps"] for row in rows]):>14.1f} {np.mean([row["lag_mean"] for row in rows]):>8.2f}')


if __name__ == '__main__':
  main()
