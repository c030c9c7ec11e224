"""The train CLI end to end: the demo learns, runs reproduce, kill -9 mid-save never costs more than
the steps since the last complete checkpoint (test_crash_safety.py: kill -9 on every path, resumed
exactly)."""

import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from grpo_jax import train
from grpo_jax.build import build_task
from runs import device_env, read_metrics, train_here, without_timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, 'configs', 'tiny_arith.yaml')
# A smaller batch for the resume and reproducibility tests.
SMALL = ['--set', 'rollout.prompts_per_step=8', '--set', 'algo.group_size=4', '--set', 'train.progress=false',
         '--set', 'train.tensorboard=false']


def run_cli(workdir, *overrides, check=True, devices=1):
  """python -m grpo_jax.train in a subprocess on `devices` CPU devices (one by default: conftest's 8
  fake devices would only add collectives to these runs; the mesh tests below cover them); returns
  the CompletedProcess."""
  result = subprocess.run([sys.executable, '-m', 'grpo_jax.train', '--config', CONFIG, '--workdir', str(workdir),
                           *overrides], cwd=ROOT, env=device_env(devices), capture_output=True, text=True,
                          timeout=600)
  if check:
    assert result.returncode == 0, result.stderr
  return result


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_demo_reward_rises(tmp_path):
  """The demo's first 120 steps from the command line (make demo runs its 400: mean reward 0.00 over
  the first 10, 0.60 over steps 101-120, 0.91 over the last 40): the reward rises from nothing to
  over half the answers."""
  result = run_cli(tmp_path, '--set', 'train.steps=120', '--set', 'train.checkpoint_every=30')
  rows = read_metrics(tmp_path)
  assert [row['step'] for row in rows] == list(range(1, 121))
  first = np.mean([row['reward_mean'] for row in rows[:10]])
  last = np.mean([row['reward_mean'] for row in rows[-20:]])
  assert first <= 0.1 and last >= 0.5 and last - first >= 0.4, (first, last)
  required = {'reward_mean', 'reward_std', 'frac_zero_std_groups', 'response_len_mean', 'response_len_max',
              'truncated_frac', 'policy_loss', 'kl', 'entropy', 'clip_frac_low', 'clip_frac_high',
              'grad_norm', 'lr', 'rollout_s', 'reward_s', 'update_s', 'step_time_s', 'tokens_per_s', 'mfu'}
  assert required <= set(rows[0])
  assert all(row['tokens_per_s'] > 0 and 0 < row['mfu'] < 1 for row in rows)
  assert os.path.isfile(tmp_path / 'config.yaml') and os.path.getsize(tmp_path / 'reward.png') > 10_000
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['120', '60', '90']  # max_to_keep: 3
  assert 'reward_mean' in result.stdout and 'step 120/120' in result.stderr  # summary table, progress bar


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_demo_learns_with_fewer_decode_slots_and_a_packed_update(tmp_path):
  """The long-tail settings inside the fused K-step jit: 256 completions through 48 decode slots,
  and the update over packed rows of 36 tokens in micro-batches of 16 rows. A random model's
  answers run to the 4-token cap (sequences of 9 tokens: 4 a row, 64 rows, 4 micro-batches); the
  trained one's stop after 2 (7 tokens: 5 a row), so fewer rows. 150 steps (measured: 63 rows at
  the first, 52 at the last; mean reward 0.68 over the last 20)."""
  train_here(tmp_path, CONFIG, 'train.steps=150', 'train.checkpoint_every=150', 'rollout.slots=48', 'algo.packing=true',
             'algo.pack_length=36', 'algo.micro_batch_tokens=576', 'train.progress=false', 'train.tensorboard=false')
  rows = read_metrics(tmp_path)
  assert all(row['micro_batches'] <= 4 and row['packed_rows'] <= 64 for row in rows)
  assert rows[0]['packed_rows'] >= 60 and rows[-1]['packed_rows'] <= 58
  first = np.mean([row['reward_mean'] for row in rows[:10]])
  last = np.mean([row['reward_mean'] for row in rows[-20:]])
  assert first <= 0.2 and last >= 0.6 and last - first >= 0.4, (first, last)
  for row in rows:  # every slot busy but for the tail of the queue
    assert row['decode_steps'] >= row['response_len_mean'] * 256 / 48
    assert 0.5 < row['slot_occupancy'] <= 1.0


@pytest.mark.exhaustive
def test_tensorboard_events_through_clu(tmp_path):
  pytest.importorskip('clu.metric_writers', reason='clu + TensorFlow come with requirements-extras.txt')
  import tensorflow as tf
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  run_cli(tmp_path, *SMALL, '--set', 'train.steps=6', '--set', 'train.steps_per_call=3',
          '--set', 'train.checkpoint_every=0', '--set', 'train.tensorboard=true')
  events = EventAccumulator(str(tmp_path / 'tensorboard'))
  events.Reload()
  logged = events.Tensors('reward_mean')
  assert [event.step for event in logged] == list(range(1, 7))
  values = [float(tf.make_ndarray(event.tensor_proto)) for event in logged]
  np.testing.assert_allclose(values, [row['reward_mean'] for row in read_metrics(tmp_path)], rtol=1e-6)


@pytest.mark.exhaustive
def test_same_seed_same_curve_and_fused_equals_host_loop(tmp_path):
  common = [*SMALL[1::2], 'train.steps=12', 'train.checkpoint_every=0']
  runs = {'a': ['train.steps_per_call=4'], 'b': ['train.steps_per_call=4'], 'host': ['train.steps_per_call=1'],
          'c': ['train.steps_per_call=4', 'run.seed=1']}
  for name, extra in runs.items():  # in this process: the same seed twice here, across processes in the resume tests
    train_here(tmp_path / name, CONFIG, *common, *extra)
  a, b, host, c = (without_timing(read_metrics(tmp_path / name)) for name in runs)
  assert a == b
  assert not os.path.exists(tmp_path / 'a' / 'tensorboard')  # train.tensorboard=false: no events
  # K steps in one jit and the host loop run the same functions: same samples, same rewards.
  assert [row['reward_mean'] for row in a] == [row['reward_mean'] for row in host]
  for fused_row, host_row in zip(a, host):
    for name in ('policy_loss', 'entropy', 'grad_norm'):
      assert fused_row[name] == pytest.approx(host_row[name], rel=1e-4, abs=1e-6), name
  assert c != a  # different seeds give a different run


def _start(workdir, steps, *overrides, config=CONFIG, devices=1):
  command = [sys.executable, '-m', 'grpo_jax.train', '--config', config, '--workdir', str(workdir), *SMALL,
             '--set', f'train.steps={steps}', *overrides]
  return subprocess.Popen(command, cwd=ROOT, env=device_env(devices), stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)


def _finished_steps(workdir):
  return sorted(int(name) for name in os.listdir(workdir / 'checkpoints') if name.isdigit()) \
      if os.path.isdir(workdir / 'checkpoints') else []


def _wait_for(predicate, process, timeout=240):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if predicate():
      return True
    if process.poll() is not None:
      return False
    time.sleep(0.005)
  return False


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_kill_mid_save_leaves_last_complete_checkpoint(tmp_path):
  """Kill -9 while orbax is writing a step: that step never counts, the previous one restores."""
  options = ['--set', 'train.steps_per_call=1', '--set', 'train.checkpoint_every=1', '--set', 'train.max_to_keep=2']
  caught_mid_save = False
  for attempt in range(5):
    workdir = tmp_path / f'try{attempt}'
    victim = _start(workdir, 400, *options)
    in_progress = lambda: bool(glob.glob(str(workdir / 'checkpoints' / '*.orbax-checkpoint-tmp*')))
    started = _wait_for(lambda: len(_finished_steps(workdir)) >= 2 and in_progress(), victim)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    if started and in_progress():
      caught_mid_save = True
      break
  assert caught_mid_save, 'never caught a save in progress'
  finished = _finished_steps(workdir)
  resumed = _start(workdir, finished[-1] + 2, *options)
  _, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err
  assert 'resumed from' in err
  rows = read_metrics(workdir)
  assert [row['step'] for row in rows] == list(range(1, finished[-1] + 3))


def test_bad_config_is_one_line_error(tmp_path):
  result = run_cli(tmp_path, '--set', 'algo.num_minibatches=3', check=False)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'error: algo.num_minibatches (3) must divide prompts_per_step * group_size (256)']


@pytest.mark.exhaustive
def test_nonfinite_updates_stop_the_run_with_checkpoint_intact(tmp_path):
  # A learning rate of 1e30 sends the parameters to inf after the first update; every later
  # update is non-finite and skipped, and the run stops after max_consecutive_skips of them.
  result = run_cli(tmp_path, *SMALL, '--set', 'optim.learning_rate=1e30', '--set', 'optim.max_grad_norm=0',
                   '--set', 'optim.warmup_steps=0', '--set', 'train.steps=40', '--set', 'train.steps_per_call=1',
                   '--set', 'train.checkpoint_every=1', '--set', 'train.max_consecutive_skips=3', check=False)
  assert result.returncode == 2
  message = result.stderr.strip().splitlines()[-1]
  assert message.startswith('error: 3 updates in a row had a non-finite loss or gradient')
  rows = read_metrics(tmp_path)
  assert sum(row['nonfinite'] for row in rows) >= 3


@pytest.mark.exhaustive
def test_fsdp_shards_the_optimizer_state_like_the_parameters(tmp_path):
  """fsdp=8 on 8 devices: each device holds 1/8 of the parameters and of each AdamW moment (plus
  the small tensors the rules replicate), before and after fused and host steps."""
  import jax
  import optax
  from grpo_jax import config as config_lib
  from grpo_jax import sharding
  config = config_lib.load_config(CONFIG, ['mesh.fsdp=8', 'rollout.prompts_per_step=8', 'algo.group_size=4',
                                           'train.progress=false', 'train.tensorboard=false', 'train.steps=2'])
  mesh = sharding.make_mesh(config.mesh)
  run = train.Run(config, str(tmp_path), mesh, config.model.build(mesh, config.run.seed),
                  build_task(config))

  def fullest_device_bytes(tree):
    per_device = {}
    for leaf in jax.tree.leaves(tree):
      for shard in leaf.addressable_shards:
        per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())

  def check(state):
    is_adam = lambda node: isinstance(node, optax.ScaleByAdamState)  # noqa: E731
    (adam,) = [node for node in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(node)]
    params = jax.tree.leaves(state.params)
    replicated = sum(leaf.nbytes for leaf in params if leaf.sharding.is_fully_replicated)
    total = sum(leaf.nbytes for leaf in params)
    assert 0 < replicated < total / 20  # the norms and biases, not the matrices
    for tree in (state.params, adam.mu, adam.nu):
      assert fullest_device_bytes(tree) <= total / 8 + replicated
      assert [leaf.sharding.spec for leaf in jax.tree.leaves(tree)] == [leaf.sharding.spec for leaf in params]

  try:
    check(run.state)
    run.fused_steps(1)
    run.host_step()
    check(run.state)
  finally:
    run.close()


@pytest.mark.exhaustive
def test_bf16_compute_keeps_fp32_master_weights(tmp_path, seed):
  from grpo_jax import config as config_lib
  from grpo_jax import sharding
  config = config_lib.load_config(CONFIG, [
      'model.dtype=bfloat16', 'model.param_dtype=float32', 'rollout.prompts_per_step=8', 'algo.group_size=4',
      'train.progress=false', 'train.tensorboard=false', 'train.steps=3'])
  mesh = sharding.make_mesh(config.mesh)
  run = train.Run(config, str(tmp_path), mesh, config.model.build(mesh, config.run.seed),
                  build_task(config))
  start = {path: np.array(leaf, copy=True) for path, leaf in _leaves(run.state.params)}  # the update donates
  import jax
  from grpo_jax.data.task import Scores
  rng = np.random.default_rng(seed)
  rows = []
  step = run.rl_step.host_mode
  with jax.set_mesh(mesh):
    for index in range(3):
      prompts = step.prompts(jax.random.PRNGKey(index), 0, 8)
      rollout = step.sample(run.state.params, prompts.tokens, prompts.mask, jax.random.PRNGKey(10 + index))
      rewards = rng.random(32).astype(np.float32)  # random scores: every group has a signal
      run.state, metrics = run.rl_step.learn(run.state, run.held, prompts.tokens, prompts.mask, rollout,
                                      Scores(rewards=rewards, failures=np.int32(0)))
      rows.append({k: float(v) for k, v in metrics.items()})
  run.close()
  assert all(np.isfinite(row['policy_loss']) and row['grad_norm'] > 0 for row in rows)
  for path, leaf in _leaves(run.state.params):
    assert leaf.dtype == np.float32, path
  # Updates smaller than bf16's resolution still move the fp32 master weights.
  moved = [path for path, leaf in _leaves(run.state.params) if not np.array_equal(np.asarray(leaf), start[path])]
  assert len(moved) == len(start)


def _leaves(tree):
  import jax
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.mark.exhaustive
def test_resume_with_a_different_model_is_one_line_error(tmp_path):
  common = [*SMALL, '--set', 'train.steps=2', '--set', 'train.steps_per_call=1']
  run_cli(tmp_path, *common)
  result = run_cli(tmp_path, *common, '--set', 'train.steps=4', '--set', 'model.architecture.hidden_size=32',
                   '--set', 'model.architecture.intermediate_size=64', check=False)
  assert result.returncode == 2
  message = result.stderr.strip().splitlines()[-1]
  assert message == (f'error: checkpoint {tmp_path / "checkpoints"}/2 does not match this run: '
                     'params.embedding.value is (17, 64) there and (17, 32) here (model or optimizer changed?)')
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2']  # nothing lost
