"""Training runs for the tests: in this process where the process itself is not under test (a
run's outputs, its metrics, its checkpoints), so JAX is imported once and the compiled programs
are shared through the suite's compilation cache; the environment of a subprocess where it is
(kill -9, the command line's output, multi-host); a run's metrics."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {'rollout_s', 'reward_s', 'update_s', 'step_time_s', 'tokens_per_s', 'rollout_tokens_per_s',
          'update_tokens_per_s', 'mfu'}


def train_here(workdir, config: str, *overrides: str, devices: int = 1) -> list[dict]:
  """The run `python -m grpo_jax.train --config config --workdir workdir --set ...` makes, in this
  process on its first `devices` CPU devices (`config`: relative to the repository, or absolute);
  returns the metrics history (a resumed run's too)."""
  import jax

  from grpo_jax import config as config_lib
  from grpo_jax import train

  path = os.path.join(ROOT, config)
  loaded = config_lib.load_config(path, list(overrides))
  workdir, mesh, model = train.setup(loaded, path, str(workdir), devices=jax.devices()[:devices])
  return train.train(loaded, workdir, mesh, model)


def one_local_device(monkeypatch):
  """This process seen by generate and serve as a host of one device: they lay a model over
  jax.local_devices(), narrowed here to the first of the suite's devices (until the test ends)."""
  import jax
  one = jax.devices()[:1]
  monkeypatch.setattr(jax, 'local_devices', lambda *args, **kwargs: one)


def device_env(count: int, **extra) -> dict:
  """This process's environment (with the suite's XLA flags, tests/conftest.py) for a subprocess
  that sees `count` CPU devices."""
  flags = [flag for flag in os.environ.get('XLA_FLAGS', '').split()
           if not flag.startswith('--xla_force_host_platform_device_count=')]
  return dict(os.environ, XLA_FLAGS=' '.join([*flags, f'--xla_force_host_platform_device_count={count}']), **extra)


# The suite's XLA:CPU at -O0 (tests/conftest.py) halves compiles, and makes the compiled steps slower:
# the learning demos run a hundred steps and more, so they run at XLA's default level in a process
# of their own (the agent demo's 120 steps: 70.5 s at -O0, 55.3 s so).
O0 = '--xla_backend_optimization_level=0'


def learning_env(count: int = 1) -> dict:
  """device_env(count) compiling at XLA's default optimisation level (see O0)."""
  env = device_env(count)
  env['XLA_FLAGS'] = ' '.join(flag for flag in env['XLA_FLAGS'].split() if flag != O0)
  return env


def train_learning(workdir, config: str, *overrides: str, timeout: int = 600) -> list[dict]:
  """A long learning run from the command line on one CPU device at XLA's default optimisation
  level (learning_env): `python -m grpo_jax.train --config config --workdir workdir --set ...`;
  returns its metrics history."""
  command = [sys.executable, '-m', 'grpo_jax.train', '--config', os.path.join(ROOT, config), '--workdir', str(workdir)]
  command += [argument for override in overrides for argument in ('--set', override)]
  result = subprocess.run(command, cwd=ROOT, env=learning_env(1), capture_output=True, text=True, timeout=timeout)
  assert result.returncode == 0, result.stderr[-3000:]
  return read_metrics(workdir)


def read_metrics(workdir, name: str = 'metrics.jsonl') -> list[dict]:
  with open(os.path.join(workdir, name)) as f:
    return [json.loads(line) for line in f]


def without_timing(rows):
  return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def alive(pid: int) -> bool:
  """The process runs (a zombie waiting for a reaper counts as gone: a container's init may never
  reap an orphan's)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except OSError:
    return False
