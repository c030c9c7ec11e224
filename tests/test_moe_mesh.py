"""A mixture of experts with routing replay on 8 devices equals one device: the RL step's parameters and
metrics, with experts split over an `expert` axis composed with fsdp and with tensor, and the rule
table's layout of the expert weights."""

import os

import jax
import numpy as np
import pytest

from grpo_jax import sharding
from test_mesh_equivalence import assert_equal_runs, two_steps

pytestmark = pytest.mark.xdist_group('test_moe_mesh')  # one worker computes the one-device run for both meshes
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, 'configs', 'tiny_arith_moe.yaml')
OVERRIDES = ['rollout.prompts_per_step=8', 'algo.group_size=4', 'train.steps_per_call=1']


def expert_layout(state, mesh):
  """Each expert weight lies split over 'expert' by its E dimension, its D over 'fsdp' only."""
  weight = state.params['layers']['expert_gate_weight']
  spec = sharding.spec_for(weight.shape, ('layers', 'experts', 'embed', 'mlp'), dict(mesh.shape))
  assert weight.sharding.spec == spec and spec[1] == 'expert'
  shard = weight.sharding.shard_shape(weight.shape)
  assert shard[1] == weight.shape[1] // mesh.shape['expert']


@pytest.fixture(scope='module')
def one_device(tmp_path_factory):
  return two_steps(tmp_path_factory.mktemp('one'), CONFIG, OVERRIDES, (1, 1, 1, 1))


@pytest.mark.slow
@pytest.mark.parametrize('mesh_shape', [(1, 4, 1, 2), (1, 1, 2, 4)], ids=['fsdp-x-expert', 'tensor-x-expert'])
def test_moe_rl_steps_on_an_expert_mesh_equal_one_device(tmp_path, mesh_shape, one_device):
  reference = one_device
  other = two_steps(tmp_path, CONFIG, OVERRIDES, mesh_shape, inspect=expert_layout)
  assert_equal_runs(reference, other)
  for name in ('router_aux_loss', 'expert_load_max_over_mean', 'routing_replay_rerouted_frac'):
    np.testing.assert_allclose(other[0][-1][name], reference[0][-1][name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_moe_partial_rollouts_kill_and_resume_equal_uninterrupted(tmp_path):
  """Routes recorded by older weights ride in the pool of partial rollouts (max_lag 1) and in its
  checkpoints: a run on an expert-parallel mesh killed with SIGKILL and resumed equals an
  uninterrupted one, metric for metric."""
  from test_train import kill_and_resume
  kill_and_resume(tmp_path, 1, ['algo.max_lag=1', 'algo.tis_cap=2.0', 'mesh.fsdp=1', 'mesh.expert=2',
                                'rollout.prompts_per_step=8', 'algo.group_size=4'], config=CONFIG, devices=2)
