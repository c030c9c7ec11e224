"""python -m grpo_jax.train --config configs/X.yaml [--set a.b=c ...] [--workdir DIR]

Resolves and saves the config, builds the device mesh and the model on it. The GRPO loop
(rollout -> reward -> advantages -> update) plugs in after `setup`.
"""

import argparse
import os
import sys
import time

import jax
import numpy as np

from grpo_jax import config as config_lib
from grpo_jax.errors import UserError, cli_main
from grpo_jax.model import sharding
from grpo_jax.model.loading import from_pretrained, init_model


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.train', description=__doc__.splitlines()[0])
  parser.add_argument('--config', required=True, help='YAML run config (see configs/)')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', dest='overrides',
                      help='override one config key, e.g. --set mesh.tensor=2 (repeatable)')
  parser.add_argument('--workdir', help='output directory (default: run.workdir or runs/<name>-<time>)')
  return parser.parse_args(argv)


def build_model(config: config_lib.Config, mesh):
  options = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                 remat=config.model.remat, scan_layers=config.model.scan_layers)
  if config.model.path:
    return from_pretrained(config.model.path, mesh=mesh, **options)
  return init_model(config.model.architecture, mesh=mesh, seed=config.run.seed, **options)


def setup(config: config_lib.Config, config_path: str | None, workdir: str | None):
  """Writes the resolved config to the workdir and builds the mesh and the model."""
  workdir = config_lib.resolve_workdir(config, config_path, workdir)
  os.makedirs(workdir, exist_ok=True)
  resolved = config_lib.to_yaml(config)
  with open(os.path.join(workdir, 'config.yaml'), 'w') as f:
    f.write(resolved)
  print(f'# resolved config (saved to {workdir}/config.yaml)\n{resolved}', flush=True)
  mesh = sharding.make_mesh(config.mesh)
  model = build_model(config, mesh)
  return workdir, mesh, model


def forward_check(model, mesh, seed: int, batch: int = 8, length: int = 64) -> float:
  """Runs the jitted forward on the mesh once and returns tokens/s of the second call."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  tokens_sharding = sharding.named_sharding(mesh, (batch, length), ('batch', 'seq'))

  @jax.jit
  def forward(state, tokens):
    return nnx.merge(graphdef, state)(tokens).mean()

  tokens = np.random.default_rng(seed).integers(0, model.config.vocab_size, (batch, length))
  tokens = jax.device_put(tokens.astype(np.int32), tokens_sharding)
  with jax.set_mesh(mesh):
    value = forward(state, tokens)
    if not np.isfinite(float(value)):
      raise UserError('the model produced non-finite logits; check model.path and model.dtype')
    start = time.perf_counter()
    forward(state, tokens).block_until_ready()
  return batch * length / (time.perf_counter() - start)


@cli_main
def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  config = config_lib.load_config(args.config, args.overrides)
  workdir, mesh, model = setup(config, args.config, args.workdir)
  from flax import nnx
  state = nnx.state(model)
  print(f'mesh: {sharding.describe(mesh)}')
  print(f'model: {model.config.num_params() / 1e6:.2f}M parameters, '
        f'{sharding.bytes_per_device(state) / 2**20:.1f} MiB on the fullest device')
  print(f'forward: {forward_check(model, mesh, config.run.seed):,.0f} tokens/s')
  print('The GRPO update loop is not part of this build yet; the run stopped after building the '
        f'model on the mesh. Outputs: {workdir}')


if __name__ == '__main__':
  main()
