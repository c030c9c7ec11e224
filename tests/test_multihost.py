"""Many processes on JAX's own runtime: two processes on 127.0.0.1 (gloo collectives between CPU
devices) run the same RL steps as one process over the same 8 devices, and a checkpoint they wrote
together resumes in one process on another mesh."""

import json
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {'rollout_s', 'reward_s', 'update_s', 'step_time_s', 'tokens_per_s', 'mfu'}
COMMON = ['--config', 'configs/tiny_arith.yaml', '--set', 'train.steps_per_call=2', '--set', 'train.checkpoint_every=2',
          '--set', 'train.progress=false', '--set', 'rollout.prompts_per_step=8', '--set', 'algo.group_size=4',
          '--set', 'optim.warmup_steps=0', '--set', 'optim.learning_rate=0.01',
          # Rewards of a random model are almost all 0: the entropy bonus and the KL term give every
          # update a gradient, so the parameters move at every step and a wrong collective shows.
          '--set', 'algo.entropy_coef=0.01', '--set', 'algo.kl_beta=0.01']


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def environment(devices: int, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
  env.update(JAX_PLATFORMS='cpu', XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}', **extra)
  return env


def launch(workdir, processes: int, devices_each: int, *overrides, timeout=420) -> list[subprocess.CompletedProcess]:
  """`processes` trainers on this host (one coordinator on a free port); each ends by itself
  within `timeout`, and none is left behind whatever happens."""
  port = free_port()
  children = []
  for index in range(processes):
    extra = dict(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_NUM_PROCESSES=str(processes),
                 JAX_PROCESS_ID=str(index)) if processes > 1 else {}
    children.append(subprocess.Popen(
        [sys.executable, '-m', 'grpo_jax.train', *COMMON, '--workdir', str(workdir), *overrides],
        cwd=ROOT, env=environment(devices_each, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True))
  results = []
  try:
    for child in children:
      out, err = child.communicate(timeout=timeout)
      results.append(subprocess.CompletedProcess(child.args, child.returncode, out, err))
  finally:
    for child in children:
      if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
  for result in results:
    assert result.returncode == 0, result.stderr[-3000:]
  return results


def metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in f]


def assert_same_run(got, expected, tolerance=1e-5):
  assert [row['step'] for row in got] == [row['step'] for row in expected]
  for mine, theirs in zip(got, expected):
    assert mine.keys() == theirs.keys()
    for name in mine:
      np.testing.assert_allclose(mine[name], theirs[name], rtol=tolerance, atol=tolerance, err_msg=name)


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_on_one_process_with_another_mesh(tmp_path):
  one = launch(tmp_path / 'one', 1, 8, '--set', 'train.steps=6')
  two = launch(tmp_path / 'two', 2, 4, '--set', 'train.steps=4')
  # Process 0 alone reports; process 1 joins every step and checkpoint and writes no logs.
  assert 'mean reward' in two[0].stdout and 'mean reward' not in two[1].stdout
  assert 'over 2 process(es)' in two[0].stdout
  assert sorted(os.listdir(tmp_path / 'two' / 'checkpoints')) == ['2', '4']
  assert_same_run(metrics(tmp_path / 'two'), metrics(tmp_path / 'one')[:4])
  reference = metrics(tmp_path / 'one')
  assert all(row['grad_norm'] > 0 for row in reference) and reference[-1]['kl'] > 0
  # The checkpoint the two processes wrote together, restored by one process on a (2, 4, 1) mesh.
  resumed = launch(tmp_path / 'two', 1, 8, '--set', 'train.steps=6', '--set', 'mesh.data=2')
  assert 'resumed from' in resumed[0].stderr and 'mesh.data: 1 -> 2' in resumed[0].stderr
  assert_same_run(metrics(tmp_path / 'two'), metrics(tmp_path / 'one'))
