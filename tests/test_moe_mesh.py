"""A mixture of experts with routing replay on 8 devices equals one device: the RL step's parameters and
metrics with experts split over an `expert` axis composed with fsdp and tensor (the sampler's
tokens in its expert groups), the rule table's layout of the expert weights, gradients on an fsdp
mesh, and a run resumed on another expert size."""

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


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('mesh_shape', [(1, 2, 2, 2)], ids=['fsdp-x-tensor-x-expert'])  # wider expert axes: test_expert_parallel.py
def test_moe_rl_steps_on_an_expert_mesh_equal_one_device(tmp_path, mesh_shape, one_device):
  reference = one_device
  other = two_steps(tmp_path, CONFIG, OVERRIDES, mesh_shape, inspect=expert_layout)
  assert_equal_runs(reference, other)
  for name in ('router_aux_loss', 'expert_load_max_over_mean', 'routing_replay_rerouted_frac'):
    np.testing.assert_allclose(other[0][-1][name], reference[0][-1][name], rtol=1e-5, atol=1e-6, err_msg=name)


def _run(workdir, mesh_shape, overrides):
  """A training Run of the MoE demo on a mesh of (data, fsdp, tensor, expert), in `workdir`."""
  from grpo_jax import config as config_lib
  from grpo_jax import train
  from grpo_jax.build import build_task
  from test_mesh_equivalence import MOVING
  data, fsdp, tensor, expert = mesh_shape
  config = config_lib.load_config(CONFIG, [*MOVING, *OVERRIDES, *overrides, f'mesh.data={data}', f'mesh.fsdp={fsdp}',
                                           f'mesh.tensor={tensor}', f'mesh.expert={expert}'])
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:data * fsdp * tensor * expert])
  return train.Run(config, str(workdir), mesh, config.model.build(mesh, config.run.seed), build_task(config))


@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.long
def test_moe_partial_rollouts_resume_on_another_expert_size_equal_uninterrupted(tmp_path):
  """Routes recorded by older weights ride in the pool of partial rollouts (max_lag 1) and in its
  checkpoints: a run on an fsdp x expert mesh, saved after its second of 4 steps and resumed from that
  checkpoint on an expert axis twice as wide (the experts and Adam moments resharded), equals its
  own last 2 steps, metric for metric."""
  partial = ['algo.max_lag=1', 'algo.tis_cap=2.0']
  compared = ('reward_mean', 'policy_loss', 'kl', 'entropy', 'grad_norm', 'routing_replay_rerouted_frac',
              'router_aux_loss', 'carried_requests')
  run = _run(tmp_path / 'whole', (1, 4, 1, 2), partial)
  try:
    whole = [run.host_step() for _ in range(2)]
    run.save()  # mid-run, as the train loop's checkpoint_every saves: the run goes on untouched
    whole += [run.host_step() for _ in range(2)]
  finally:
    run.close()
  run = _run(tmp_path / 'whole', (1, 2, 1, 4), partial)
  try:
    assert run.step == 2
    resumed = [run.host_step() for _ in range(2)]
  finally:
    run.close()
  assert float(whole[2]['carried_requests']) > 0 or float(whole[3]['carried_requests']) > 0
  for row, other in zip(whole[2:], resumed):
    for name in compared:
      np.testing.assert_allclose(other[name], row[name], rtol=1e-5, atol=1e-6, err_msg=name)


# expert > 1: the RL steps above, test_expert_parallel.py; with the rows split along their length
# (context parallelism: ring attention, the experts' tokens over rows x context)
@pytest.mark.parametrize('mesh_shape', [(1, 8, 1, 1), pytest.param((1, 2, 1, 2, 2), id='fsdp2-expert2-context2', marks=pytest.mark.exhaustive)])
def test_moe_gradients_on_a_mesh_equal_one_device(seed, mesh_shape):
  """The model's loss gradients with the experts computed per device (model/expert_parallel.py: each
  device's own pairs; exchanged over 'expert' where it is > 1) equal the one-device dense path."""
  import jax.numpy as jnp
  from flax import nnx

  from grpo_jax.model.loading import init_model
  from test_moe import MOE_ARCHITECTURE
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, MOE_ARCHITECTURE.vocab_size, (8, 6)), jnp.int32)

  def gradients(mesh):
    model = init_model(MOE_ARCHITECTURE, mesh=mesh, seed=seed % 1000)
    graphdef, state = nnx.split(model)
    loss = lambda state: jnp.sum(nnx.merge(graphdef, state)(tokens)[..., :50] ** 2)  # noqa: E731
    if mesh is None:
      return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(state))
    with jax.set_mesh(mesh):
      return jax.tree.map(np.asarray, jax.jit(jax.grad(loss))(state))

  want = gradients(None)
  got = gradients(sharding.make_mesh(sharding.MeshConfig(*mesh_shape)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max()), got, want)
