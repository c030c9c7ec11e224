"""Many processes on JAX's own runtime: two processes on 127.0.0.1 (gloo collectives between CPU
devices) run the same RL steps as one process over the same 8 devices (hybrid sharding over the two,
FSDP across them, split devices), and a checkpoint they wrote together resumes in one process on
another mesh."""

import collections
import os
import signal
import socket
import subprocess
import types
import sys

import numpy as np
import pytest

from runs import device_env, read_metrics, train_here, without_timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ['--config', 'configs/tiny_arith.yaml', '--set', 'train.steps_per_call=2', '--set', 'train.checkpoint_every=2',
          '--set', 'train.progress=false', '--set', 'train.tensorboard=false',
          '--set', 'rollout.prompts_per_step=8', '--set', 'algo.group_size=4',
          '--set', 'optim.warmup_steps=0', '--set', 'optim.learning_rate=0.01',
          # Rewards of a random model are almost all 0: the entropy bonus and the KL term give every
          # update a gradient, so the parameters move at every step and a wrong collective shows.
          '--set', 'algo.entropy_coef=0.01', '--set', 'algo.kl_beta=0.01']


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def environment(devices: int, **extra) -> dict:
  """A process of its own, on `devices` CPU devices (the suite's compilation cache kept)."""
  env = {k: v for k, v in device_env(devices).items()
         if not k.startswith('JAX_') or k.startswith(('JAX_COMPILATION_CACHE', 'JAX_PERSISTENT_CACHE'))}
  env.update(JAX_PLATFORMS='cpu', **extra)
  return env


def launch(workdir, processes: int, devices_each: int, *overrides, base=COMMON,
           timeout=420) -> list[subprocess.CompletedProcess]:
  """`processes` trainers on this host (one coordinator on a free port), each with the arguments
  `base` + `overrides`; each ends by itself within `timeout`, and none is left behind whatever happens."""
  port = free_port()
  children = []
  for index in range(processes):
    extra = dict(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_NUM_PROCESSES=str(processes),
                 JAX_PROCESS_ID=str(index)) if processes > 1 else {}
    children.append(subprocess.Popen(
        [sys.executable, '-m', 'grpo_jax.train', *base, '--workdir', str(workdir), *overrides],
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


def one_process(workdir, *overrides, base=COMMON) -> None:
  """The run `launch(workdir, 1, 8, *overrides, base=base)` makes, in this process on its 8 devices
  (the reference the processes are compared with; their collectives are what is under test)."""
  arguments = [*base, *overrides]
  config = arguments[arguments.index('--config') + 1]
  train_here(workdir, config, *[value for flag, value in zip(arguments, arguments[1:]) if flag == '--set'],
             devices=8)


def metrics(workdir, name='metrics.jsonl'):
  return without_timing(read_metrics(workdir, name))


def assert_same_run(got, expected, tolerance=1e-5):
  assert [row['step'] for row in got] == [row['step'] for row in expected]
  for mine, theirs in zip(got, expected):
    assert mine.keys() == theirs.keys()
    for name in mine:
      if isinstance(mine[name], str):
        assert mine[name] == theirs[name], name
      else:
        np.testing.assert_allclose(mine[name], theirs[name], rtol=tolerance, atol=tolerance, err_msg=name)


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_host_scored_math_task_on_two_processes_equals_one(tmp_path):
  """The math task's reward runs on the hosts: each process decodes and scores the groups on its
  own devices. With dynamic sampling (groups gathered across rounds) and in-training evaluation,
  two processes give the one-process run; the one process loads a Hugging Face checkpoint, the two
  its orbax conversion, each process reading only the shards of its own devices."""
  from grpo_jax import testing
  from grpo_jax.data import word_problems

  files = word_problems.write(str(tmp_path / 'data'))
  testing.save_random_hf_checkpoint(str(tmp_path / 'hf'), 5, vocab_size=64, tie_word_embeddings=True)
  base = ['--config', 'configs/tiny_math.yaml', '--set', f'task.source={files["train"]}',
          '--set', f'task.tokenizer={files["tokenizer"]}',
          '--set', f'eval.source={files["eval"]}', '--set', 'eval.every=2', '--set', 'eval.max_problems=16',
          '--set', 'eval.batch_prompts=8', '--set', 'rollout.prompts_per_step=8', '--set', 'algo.group_size=4',
          '--set', 'algo.max_sampling_rounds=3', '--set', 'train.steps=3', '--set', 'train.checkpoint_every=2',
          '--set', 'train.progress=false', '--set', 'train.tensorboard=false', '--set', 'optim.warmup_steps=0',
          '--set', 'algo.entropy_coef=0.01', '--set', 'algo.kl_beta=0.01']
  from conversion import hf_to_orbax, orbax_to_hf  # in this process: their command lines are test_conversion.py's
  hf_to_orbax.main(['--hf', str(tmp_path / 'hf'), '--out', str(tmp_path / 'orbax')])
  one_process(tmp_path / 'one', '--set', f'model.path={tmp_path / "hf"}', base=base)
  two = launch(tmp_path / 'two', 2, 4, '--set', f'model.path={tmp_path / "orbax"}', base=base)
  assert 'eval at step 2' in two[0].stderr and 'eval at step' not in two[1].stderr
  reference = metrics(tmp_path / 'one')
  assert_same_run(metrics(tmp_path / 'two'), reference)
  assert any(row['sampling_rounds'] > 1 for row in reference) and reference[-1]['grad_norm'] > 0
  assert_same_run(metrics(tmp_path / 'two', 'eval.jsonl'), metrics(tmp_path / 'one', 'eval.jsonl'))
  assert sorted(os.listdir(tmp_path / 'two' / 'eval')) == ['samples_0.jsonl', 'samples_2.jsonl', 'samples_3.jsonl']
  # The trained policy exported to Hugging Face from the checkpoint two processes wrote (one process
  # reads it, parameters only): the same tensors as the one-process run's export, moved by training.
  for run in ('one', 'two'):
    orbax_to_hf.main(['--ckpt', str(tmp_path / run), '--out', str(tmp_path / f'{run}_hf')])
  from safetensors.numpy import load_file
  one, two, initial = (load_file(str(tmp_path / name / 'model.safetensors')) for name in ('one_hf', 'two_hf', 'hf'))
  assert one.keys() == two.keys() == initial.keys()
  for name in one:
    np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert max(np.abs(one[name] - initial[name]).max() for name in one) > 1e-4
  assert os.path.isfile(tmp_path / 'two_hf' / 'tokenizer.json')  # from the run's task.tokenizer


_FakeDevice = collections.namedtuple('_FakeDevice', 'process_index id')


class _FakeLayout:
  """A stand-in for a global array's sharding over `processes` x `per_process` devices."""

  def __init__(self, rows: int, processes: int, per_process: int, shards: int):
    self.map = {}
    for device in range(processes * per_process):
      block = rows // shards
      start = (device % shards) * block
      self.map[_FakeDevice(process_index=device // per_process, id=device)] = (slice(start, start + block),)

  def devices_indices_map(self, shape):
    del shape
    return self.map


@pytest.mark.parametrize('processes, per_process, shards, expected', [
    (2, 4, 8, [[0, 1], [2, 3]]),  # rows sharded over all 8 devices: each process its own half
    (2, 4, 1, [[0, 2], [1, 3]]),  # replicated: the groups alternate between the processes
    (4, 2, 4, [[0], [2], [1], [3]]),  # each half on two processes: alternate among its holders
])
def test_each_group_is_scored_by_exactly_one_process_that_holds_it(monkeypatch, processes, per_process, shards,
                                                                   expected):
  from grpo_jax import distributed

  array = types.SimpleNamespace(shape=(16, 5), sharding=_FakeLayout(16, processes, per_process, shards))
  owned = []
  for process in range(processes):
    monkeypatch.setattr(distributed.jax, 'process_index', lambda process=process: process)
    owned.append(distributed.owned_groups(array, 4).tolist())
  assert owned == expected
  with pytest.raises(distributed.UserError, match='rollout.prompts_per_step'):
    distributed.owned_groups(types.SimpleNamespace(shape=(16, 5), sharding=_FakeLayout(16, 2, 4, 8)), 16)


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_split_devices_across_processes_equal_one_process_and_resume(tmp_path):
  """Split devices across processes: the trainer on process 0's 4 devices, the sampler on process
  1's (rollout.devices=4, max_lag 2), a host-scored task with in-training evaluation. The weights,
  each step's prompts and the groups made ready cross between the processes (the CPU's DCN
  transfer server); the step, the metrics and the host task's arrays are read on both; the run,
  checkpointed by the two and resumed by the two, equals one process over the same 8 devices."""
  from grpo_jax.data import word_problems

  files = word_problems.write(str(tmp_path / 'data'))
  base = ['--config', 'configs/tiny_math.yaml', *COMMON[2:], '--set', 'train.steps_per_call=1',
          '--set', f'task.source={files["train"]}', '--set', f'task.tokenizer={files["tokenizer"]}',
          '--set', f'eval.source={files["eval"]}',
          '--set', 'algo.dynamic_sampling=false', '--set', 'eval.every=2', '--set', 'eval.max_problems=16',
          '--set', 'eval.batch_prompts=8', '--set', 'rollout.devices=4', '--set', 'algo.max_lag=2',
          '--set', 'algo.tis_cap=2']
  one_process(tmp_path / 'one', '--set', 'train.steps=4', base=base)
  first = launch(tmp_path / 'two', 2, 4, '--set', 'train.steps=2', base=base)
  assert 'data=1 x fsdp=4 x tensor=1 x expert=1 x context=1 (4 devices) over 2 process(es)' in first[0].stdout
  resumed = launch(tmp_path / 'two', 2, 4, '--set', 'train.steps=4', base=base)
  assert 'resumed from' in resumed[0].stderr and 'eval at step 4' in resumed[0].stderr
  reference = metrics(tmp_path / 'one')
  assert all(row['grad_norm'] > 0 for row in reference) and max(row['lag_max'] for row in reference) == 2
  assert_same_run(metrics(tmp_path / 'two'), reference)
  assert_same_run(metrics(tmp_path / 'two', 'eval.jsonl'), metrics(tmp_path / 'one', 'eval.jsonl'))


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_hybrid_sharding_over_two_processes_equals_one_and_resumes_on_one_process_with_another_mesh(tmp_path):
  """Hybrid sharding composed with expert parallelism (a mixture of experts with rollout routing
  replay; its attention, embeddings and norms are laid out as a dense model's): data over the two
  processes, fsdp x expert over each one's 4 devices, equal to one process over the same 8 devices
  laid out (2, 2, 1, 2) by the mesh section. The checkpoint the two wrote together resumes in one
  process on an expert axis twice as wide (the experts and their Adam moments resharded)."""
  base = ['--config', 'configs/tiny_arith_moe.yaml', *COMMON[2:]]
  one_process(tmp_path / 'one', '--set', 'train.steps=6', '--set', 'mesh.data=2', '--set', 'mesh.expert=2', base=base)
  two = launch(tmp_path / 'two', 2, 4, '--set', 'train.steps=4', '--set', 'mesh.hybrid=true', '--set', 'mesh.expert=2',
               base=base)
  # Process 0 alone reports; process 1 joins every step and checkpoint and writes no logs.
  assert 'mean reward' in two[0].stdout and 'mean reward' not in two[1].stdout
  assert 'data=2 x fsdp=2 x tensor=1 x expert=2 x context=1 (8 devices) over 2 process(es)' in two[0].stdout
  assert sorted(os.listdir(tmp_path / 'two' / 'checkpoints')) == ['2', '4']
  reference = metrics(tmp_path / 'one')
  assert all(row['grad_norm'] > 0 for row in reference) and reference[-1]['kl'] > 0
  assert_same_run(metrics(tmp_path / 'two'), reference[:4])
  resumed = launch(tmp_path / 'two', 1, 8, '--set', 'train.steps=6', '--set', 'mesh.expert=4', base=base)
  assert 'resumed from' in resumed[0].stderr and 'mesh.expert: 2 -> 4' in resumed[0].stderr, resumed[0].stderr[-2000:]
  assert 'data=1 x fsdp=2 x tensor=1 x expert=4 x context=1 (8 devices) over 1 process(es)' in resumed[0].stdout
  assert_same_run(metrics(tmp_path / 'two'), reference)
