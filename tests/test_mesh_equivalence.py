"""A full GRPO step (sample, score, advantages, update) gives the same parameters and metrics on
8 devices laid out as (data, fsdp, tensor) = (8,1,1), (1,8,1), (2,2,2), (2,1,4) as on 1 device
(fp32, 1e-5), for the jittable arithmetic task (all four) and the host-scored math task (two).
Each mesh samples in the sampler's own layout with a different sampler tensor size (rollout.tensor:
2, 8, 4, 1; the tiny model's 2 KV heads and 17-token vocabulary divide only some of them)."""

import os

import jax
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax import sharding
from grpo_jax import train
from grpo_jax.build import build_task
from grpo_jax.data import word_problems
from grpo_jax.data.math_task import MathTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The one-device reference is a module fixture: the file runs on one xdist worker.
pytestmark = pytest.mark.xdist_group('test_mesh_equivalence')
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (2, 1, 4)]
ROLLOUT_TENSOR = {(8, 1, 1): 2, (1, 8, 1): 8, (2, 2, 2): 4, (2, 1, 4): 1}
COMPARED = ('reward_mean', 'reward_std', 'policy_loss', 'kl', 'entropy', 'grad_norm', 'response_len_mean')
# Rewards of a random model are almost all 0: the entropy bonus and the KL term give every update a
# gradient, so the parameters move and a wrong collective shows.
# The learning rate is small because Adam turns any difference in a near-zero gradient (the order of
# a cross-device sum) into a step of up to the learning rate.
MOVING = ['algo.entropy_coef=0.01', 'algo.kl_beta=0.01', 'optim.learning_rate=1e-3', 'optim.warmup_steps=0',
          'train.progress=false', 'train.tensorboard=false']


def two_steps(tmp_path, config_path, overrides, mesh_shape, task=None, name=None, fused=False, inspect=None):
  """Two RL steps from the host loop (or, `fused`, in one jit) -> (metric rows, parameters), on a
  mesh of shape (data, fsdp, tensor), (data, fsdp, tensor, expert) or (data, fsdp, tensor, expert, context).
  inspect(state, mesh), if given, is called before the steps and after them."""
  data, fsdp, tensor, expert, context = (*mesh_shape, 1, 1)[:5]
  config = config_lib.load_config(config_path, [*MOVING, *overrides, f'mesh.data={data}', f'mesh.fsdp={fsdp}',
                                                f'mesh.tensor={tensor}', f'mesh.expert={expert}', f'mesh.context={context}',
                                                f'rollout.tensor={ROLLOUT_TENSOR.get(tuple(mesh_shape), 1)}'])
  devices = jax.devices()[:data * fsdp * tensor * expert * context]
  mesh = sharding.make_mesh(config.mesh, devices)
  model = config.model.build(mesh, config.run.seed)
  task = task or build_task(config)
  run = train.Run(config, str(tmp_path / (name or 'x'.join(map(str, mesh_shape)))), mesh, model, task)
  try:
    if inspect is not None:
      inspect(run.state, mesh)
    rows = run.fused_steps(2) if fused else [run.host_step() for _ in range(2)]
    if inspect is not None:
      inspect(run.state, mesh)
    params = jax.tree.map(np.asarray, jax.device_get(run.state.params))
  finally:
    run.close()
  return rows, params


def assert_equal_runs(reference, other):
  (rows, params), (other_rows, other_params) = reference, other
  for row, other_row in zip(rows, other_rows):
    for name in COMPARED:
      np.testing.assert_allclose(other_row[name], row[name], rtol=1e-5, atol=1e-5, err_msg=name)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5), params, other_params)
  assert rows[-1]['grad_norm'] > 0


def rule_table_layout(state, mesh):
  """The partition spec of every leaf of the state (parameters, Adam moments), after checking that
  the parameters are placed by the rule table (q_weight's spec is sharding.spec_for's)."""
  q_weight = state.params['layers']['q_weight']
  assert q_weight.sharding.spec == sharding.spec_for(q_weight.shape, ('layers', 'embed', 'q_heads', 'head_dim'),
                                                     dict(mesh.shape))
  return [leaf.sharding.spec for leaf in jax.tree.leaves(state)]


JITTABLE = os.path.join(ROOT, 'configs', 'tiny_arith.yaml')
JITTABLE_OVERRIDES = ['rollout.prompts_per_step=8', 'algo.group_size=4', 'train.steps_per_call=1',
                      'algo.micro_batch_size=8']


@pytest.fixture(scope='module')
def jittable_reference(tmp_path_factory):
  """The jittable task's two steps on one device, shared by every mesh's test (one worker: the file's
  xdist_group)."""
  return two_steps(tmp_path_factory.mktemp('one-device'), JITTABLE, JITTABLE_OVERRIDES, (1, 1, 1))


# make test's mesh is the cube: data replicas, FSDP and tensor at once, both steps in one jit; the
# other three layouts are test-all's.
@pytest.mark.starts_first
@pytest.mark.parametrize('mesh_shape', [pytest.param(mesh, id='x'.join(map(str, mesh)),
                                                     marks=() if mesh == (2, 2, 2) else pytest.mark.exhaustive)
                                        for mesh in MESHES])
def test_jittable_task_on_a_mesh_equals_one_device(tmp_path, jittable_reference, mesh_shape):
  """Also: on every mesh the parameters and Adam moments keep their rule-table shardings through
  the donated update, in the K-step jit ((1,8,1), (2,2,2)) and from the host loop ((8,1,1), (2,1,4)).
  Four micro-batches: the data replicas each accumulate their own rows' (rl/update.py)."""
  # Two of the meshes run both steps in one jit: the layout changes inside it, once per step.
  fused = mesh_shape in ((1, 8, 1), (2, 2, 2))
  layouts = []
  assert_equal_runs(jittable_reference, two_steps(
      tmp_path, JITTABLE, JITTABLE_OVERRIDES, mesh_shape, fused=fused,
      inspect=lambda state, mesh: layouts.append(rule_table_layout(state, mesh))))
  before, after = layouts
  assert after == before, mesh_shape


# Context parallelism (the update's rows split along their length, ring attention): over FSDP, and
# with data replicas and tensor parallelism at once.
@pytest.mark.parametrize('mesh_shape', [pytest.param((1, 2, 1, 1, 2), id='fsdp2-context2'),
                                        pytest.param((2, 2, 1, 1, 2), id='data2-fsdp2-context2', marks=pytest.mark.exhaustive),
                                        pytest.param((2, 1, 2, 1, 2), id='data2-tensor2-context2',
                                                     marks=pytest.mark.exhaustive),
                                        pytest.param((1, 1, 2, 1, 4), id='tensor2-context4', marks=pytest.mark.exhaustive)])
def test_jittable_task_on_a_context_mesh_equals_one_device(tmp_path, jittable_reference, mesh_shape):
  assert_equal_runs(jittable_reference, two_steps(tmp_path, JITTABLE, JITTABLE_OVERRIDES, mesh_shape))


# Tree packing (each group's prompt once per packed row): the data x fsdp x tensor cube and fsdp x
# context (the trees' rows split along their length) against the padded one-device run, in fewer tokens.
@pytest.mark.exhaustive
@pytest.mark.parametrize('mesh_shape', [pytest.param((2, 2, 2), id='2x2x2'),
                                        pytest.param((1, 2, 1, 1, 2), id='fsdp2-context2')])
def test_tree_packed_steps_on_a_mesh_equal_one_device(tmp_path, jittable_reference, mesh_shape):
  # Rows of 4 sequences' width: a tree's root and its 4 branches fit one row (a row of one sequence's
  # width holds one branch and shares nothing when every answer is as long as the slots).
  overrides = [*JITTABLE_OVERRIDES, 'algo.packing=true', 'algo.tree_packing=true', 'algo.pack_length=36']
  rows, params = two_steps(tmp_path, JITTABLE, overrides, mesh_shape)
  assert_equal_runs(jittable_reference, (rows, params))
  assert all(row['packed_tokens'] < row['sequence_tokens'] for row in rows)


@pytest.mark.exhaustive
@pytest.mark.starts_first
def test_host_scored_task_on_every_mesh_equals_one_device(tmp_path):
  files = word_problems.write(str(tmp_path / 'data'))
  config_path = os.path.join(ROOT, 'configs', 'tiny_math.yaml')
  overrides = [f'task.source={files["train"]}', f'task.tokenizer={files["tokenizer"]}', 'eval.every=0',
               'rollout.prompts_per_step=8', 'algo.group_size=4', 'algo.dynamic_sampling=false']
  config = config_lib.load_config(config_path, overrides)
  task = MathTask(config.task, None, config.run.seed, config.rewards, config.rollout.max_new_tokens)
  try:  # one task (and one reward pool) for every mesh: its prompts depend only on seed and position
    reference = two_steps(tmp_path, config_path, overrides, (1, 1, 1), task)
    # The host part (decode, score) does not see the mesh: two layouts keep the suite short.
    for mesh_shape in [(2, 2, 2), (2, 1, 4)]:
      assert_equal_runs(reference, two_steps(tmp_path, config_path, overrides, mesh_shape, task))
  finally:
    task.close()


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_checkpoints_resume_across_the_hybrid_switch(tmp_path):
  """A checkpoint written under FSDP over 8 devices (1, 8, 1) restores under the hybrid layout (data 2
  x fsdp 4: parameters and Adam moments sharded within a group of 4, replicated across the 2) and
  the other way round: every parameter and moment equal to what was saved, resharded as the new
  mesh's rule table lays it out."""
  config_path = os.path.join(ROOT, 'configs', 'tiny_arith.yaml')
  overrides = [*MOVING, 'rollout.prompts_per_step=8', 'algo.group_size=4', 'train.steps_per_call=1']

  def run_on(mesh_shape, workdir):
    data, fsdp, tensor = mesh_shape
    config = config_lib.load_config(config_path, [*overrides, f'mesh.data={data}', f'mesh.fsdp={fsdp}',
                                                  f'mesh.tensor={tensor}'])
    mesh = sharding.make_mesh(config.mesh, jax.devices()[:8])
    return train.Run(config, str(workdir), mesh, config.model.build(mesh, config.run.seed), build_task(config)), mesh

  for first, second in (((1, 8, 1), (2, 4, 1)), ((2, 4, 1), (1, 8, 1))):
    workdir = tmp_path / 'x'.join(map(str, first))
    run, _ = run_on(first, workdir)
    try:
      run.host_step()
      run.save()
      run.checkpointer.wait()
      saved = jax.tree.map(np.asarray, jax.device_get(run.state.checkpointed()))
    finally:
      run.close()
    fresh, mesh = run_on(second, tmp_path / 'fresh')
    expected_layout = rule_table_layout(fresh.state, mesh)
    fresh.close()
    resumed, mesh = run_on(second, workdir)
    try:
      assert resumed.step == 1
      jax.tree.map(np.testing.assert_array_equal, saved, jax.tree.map(np.asarray, jax.device_get(
          resumed.state.checkpointed())))
      assert rule_table_layout(resumed.state, mesh) == expected_layout
      leaves = [leaf for leaf in jax.tree.leaves(resumed.state.checkpointed()) if hasattr(leaf, 'sharding')]
      assert all(dict(leaf.sharding.mesh.shape) == dict(mesh.shape) for leaf in leaves)
    finally:
      resumed.close()
