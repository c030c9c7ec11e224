"""Training runs for the tests: in this process where the process itself is not under test (a
run's outputs, its metrics, its checkpoints), so JAX is imported once and the compiled programs
are shared through the suite's compilation cache; `python -m grpo_jax.train` in a subprocess
where it is (kill -9, the command line's output, multi-host)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, 'configs')
TIMING = {'rollout_s', 'reward_s', 'update_s', 'step_time_s', 'tokens_per_s', 'rollout_tokens_per_s',
          'update_tokens_per_s', 'mfu'}


def config_path(name: str) -> str:
  """A config by file name (configs/NAME), path relative to the repository, or absolute path."""
  if os.path.isabs(name):
    return name
  return os.path.join(ROOT, name) if os.sep in name else os.path.join(CONFIGS, name)


def train_here(workdir, config: str, *overrides: str, devices: int = 1) -> list[dict]:
  """The run `python -m grpo_jax.train --config config --workdir workdir --set ...` makes, in this
  process on its first `devices` CPU devices; returns the metrics history (a resumed run's too)."""
  import jax

  from grpo_jax import config as config_lib
  from grpo_jax import train

  path = config_path(config)
  loaded = config_lib.load_config(path, list(overrides))
  workdir, mesh, model = train.setup(loaded, path, str(workdir), devices=jax.devices()[:devices])
  return train.train(loaded, workdir, mesh, model)


def device_env(count: int, **extra) -> dict:
  """This process's environment (with the suite's XLA flags, tests/conftest.py) for a subprocess
  that sees `count` CPU devices."""
  flags = [flag for flag in os.environ.get('XLA_FLAGS', '').split()
           if not flag.startswith('--xla_force_host_platform_device_count=')]
  return dict(os.environ, XLA_FLAGS=' '.join([*flags, f'--xla_force_host_platform_device_count={count}']), **extra)


def train_cli(workdir, config: str, *overrides: str, devices: int = 1, check: bool = True, timeout: int = 600):
  """python -m grpo_jax.train in a subprocess on `devices` CPU devices; returns the CompletedProcess."""
  result = subprocess.run([sys.executable, '-m', 'grpo_jax.train', '--config', config_path(config), '--workdir',
                           str(workdir), *[a for o in overrides for a in ('--set', o)]], cwd=ROOT,
                          env=device_env(devices), capture_output=True, text=True, timeout=timeout)
  if check:
    assert result.returncode == 0, result.stderr[-3000:]
  return result


def read_metrics(workdir, name: str = 'metrics.jsonl') -> list[dict]:
  with open(os.path.join(workdir, name)) as f:
    return [json.loads(line) for line in f]


def without_timing(rows):
  return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]
