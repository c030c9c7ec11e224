"""Expert parallelism (model/expert_parallel.py): on 8 CPU devices, meshes of fsdp x expert, tensor x
expert, fsdp x expert and data x tensor x expert give the output and the gradients (x, gates, the
three expert weights) of the single-device `experts_dense`, fp32 (on CPUs the exchanges are the
fixed-capacity all_to_all); and compiled deviceless for a TPU slice and a GPU host, the program
dispatches with ragged all-to-alls and gathers expert weights over 'fsdp' only."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.model import expert_parallel
from grpo_jax.model.moe import experts_dense
from grpo_jax.plan import traffic
from grpo_jax.sharding import MeshConfig, make_mesh, named_sharding
from test_deviceless import _run

# E = 8 experts of width M = 8 at D = 16, k = 3 a token: on an expert axis of 4, each rank owns
# El = 2 < k experts, so a device sends a rank at most 2 of a token's pairs (the tighter buffer).
EXPERTS, WIDTH, HIDDEN, TOP_K = 8, 16, 8, 3
AXES = (('batch', 'seq', 'act_embed'), ('batch', 'seq', None), ('batch', 'seq', None),
        ('experts', 'embed', 'mlp'), ('experts', 'embed', 'mlp'), ('experts', 'mlp', 'embed'))


def _routes(rng, tokens: int) -> np.ndarray:
  """[tokens, k] distinct experts a token, skewed: 90% of tokens take one hot expert, the rest of
  the pairs go to 4 other experts, and the remaining E - 5 experts receive nothing."""
  hot, *used = rng.permutation(EXPERTS)[:5]
  routes = []
  for _ in range(tokens):
    if rng.random() < 0.9:
      routes.append([hot, *rng.choice(used, TOP_K - 1, replace=False)])
    else:
      routes.append(rng.choice([hot, *used], TOP_K, replace=False))
  return np.asarray(routes, np.int32)


def _inputs(seed: int, batch: int, length: int):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  return (normal(batch, length, WIDTH), _routes(rng, batch * length).reshape(batch, length, TOP_K),
          rng.random((batch, length, TOP_K)).astype(np.float32),
          0.3 * normal(EXPERTS, WIDTH, HIDDEN), 0.3 * normal(EXPERTS, WIDTH, HIDDEN),
          0.3 * normal(EXPERTS, HIDDEN, WIDTH)), normal(batch, length, WIDTH)


def _output_and_grads(compute, cotangent):
  """compute(x, routes, gates, *weights) -> jitted (output, gradients of <output, cotangent> with
  respect to x, gates and the three weights)."""

  def loss(x, routes, gates, *weights):
    out = compute(x, routes, gates, *weights)
    return jnp.sum(out * cotangent), out

  return jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5), has_aux=True))


@pytest.mark.parametrize('mesh_shape, batch, length', [
    ((1, 4, 1, 2), 8, 6),  # fsdp x expert
    ((1, 1, 2, 4), 4, 6),  # tensor x expert: M split in two, partial sums summed over 'tensor'
    ((1, 2, 1, 4), 3, 5),  # 15 tokens over 8 devices: rows replicated, padded to 16 inside
    ((2, 1, 2, 2), 4, 4),  # data x tensor x expert: weight gradients summed over 'data'
])
def test_expert_parallel_equals_dense_experts(seed, mesh_shape, batch, length):
  assert jax.device_count() >= 8  # conftest.py configures 8 CPU devices before jax starts
  args, cotangent = _inputs(seed, batch, length)
  expected_grads, expected = _output_and_grads(experts_dense, cotangent)(*args)

  mesh = make_mesh(MeshConfig(*mesh_shape), jax.devices()[:8])
  with jax.set_mesh(mesh):
    assert expert_parallel.applies(EXPERTS)
    placed = [jax.device_put(a, named_sharding(mesh, a.shape, axes)) for a, axes in zip(args, AXES)]
    assert placed[3].sharding.spec[0] == 'expert'  # the rule table's layout: E over 'expert'
    grads, out = _output_and_grads(expert_parallel.experts_forward, cotangent)(*placed)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
  for name, grad, expected_grad in zip(('x', 'gates', 'gate', 'up', 'down'), grads, expected_grads):
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-5, atol=1e-5, err_msg=name)
  # The routes did what the docstring says: empty experts, and one with most of the pairs.
  load = np.bincount(args[1].reshape(-1), minlength=EXPERTS)
  assert (load == 0).sum() == EXPERTS - 5 and load.max() > batch * length / 2


@pytest.mark.parametrize('mesh_shape, batch, length, chunks', [
    ((1, 4, 1, 2), 8, 6, 2),  # fsdp x expert: 6 tokens per device in 2 chunks
    ((1, 1, 2, 4), 4, 6, 3),  # tensor x expert: 6 tokens per device in 3 chunks
])
def test_tokens_in_chunks_equal_dense_experts(seed, mesh_shape, batch, length, chunks, monkeypatch):
  """With a receive budget that one exchange of a device's tokens would pass, the tokens go through
  the expert group in chunks (the fewest that fit), and the output and every gradient still equal
  the single-device dense experts."""
  args, cotangent = _inputs(seed, batch, length)
  expected_grads, expected = _output_and_grads(experts_dense, cotangent)(*args)
  mesh = make_mesh(MeshConfig(*mesh_shape), jax.devices()[:8])
  ranks = mesh_shape[3]
  per_token = ranks * min(TOP_K, EXPERTS // ranks) * WIDTH * 4
  tokens = batch * length // 8 if mesh_shape[2] == 1 else batch * length // (8 // mesh_shape[2])
  monkeypatch.setattr(expert_parallel, 'RECEIVE_BUDGET', tokens // chunks * per_token)
  assert expert_parallel.token_chunks(tokens, ranks, TOP_K, EXPERTS // ranks, WIDTH, 4) == chunks
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, named_sharding(mesh, a.shape, axes)) for a, axes in zip(args, AXES)]
    grads, out = _output_and_grads(expert_parallel.experts_forward, cotangent)(*placed)
  np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
  for name, grad, expected_grad in zip(('x', 'gates', 'gate', 'up', 'down'), grads, expected_grads):
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-5, atol=1e-5, err_msg=name)


# ---- compiled by the real XLA:TPU and XLA:GPU compilers (deviceless) ----

@pytest.mark.exhaustive
@pytest.mark.starts_first
@pytest.mark.parametrize('platform, target', [('tpu', 'v5p-16'), ('gpu', 'h100x8')])
def test_compiled_layer_dispatches_tokens_not_weights(platform, target):
  """One Qwen3-30B-A3B layer's experts (E = 128, D = 2,048, M = 768, k = 8, bf16), forward and
  backward, 512 tokens a device, on 8 devices as fsdp 2 x expert 4: the rows travel by
  ragged-all-to-all within the expert groups, and every collective that could carry a weight
  (an all-gather, reduce-scatter or all-reduce past a few KiB) runs within the fsdp pairs."""
  result = _run(platform, ['grpo_jax.plan.experts', 'layer', target, '--fsdp', '2', '--expert', '4'], timeout=600)
  lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{')]
  assert lines and result.returncode == 0, result.stderr[-3000:]
  summary = lines[0]
  print(target, summary['bytes_by_kind'])
  # Logical device ids over the mesh (data, fsdp, tensor, expert) = (1, 2, 1, 4), in order.
  ids = np.arange(8).reshape(2, 4)
  fsdp_groups, expert_groups = {tuple(g) for g in ids.T.tolist()}, {tuple(g) for g in ids.tolist()}
  assert summary['ragged_all_to_all'] >= 4  # out and back, forward and backward
  found = [traffic.Collective(**{**c, 'groups': tuple(map(tuple, c['groups'])), 'in_loop': False})
           for c in summary['collectives']]
  assert {c.kind for c in found} >= {'all-to-all', 'all-gather', 'reduce-scatter'}
  for collective in found:
    groups = set(collective.groups)
    if collective.kind == 'all-to-all':
      assert groups == expert_groups, collective
    elif collective.bytes > 64 << 10:
      assert groups == fsdp_groups, collective
  # Each device gathers its 32 experts' three weights, D whole: 3 x 32 x 2048 x 768 x 2 bytes.
  weight_bytes = 3 * 32 * 2048 * 768 * 2
  gathered = sum(c.bytes * c.count for c in found if c.kind == 'all-gather' and set(c.groups) == fsdp_groups)
  assert weight_bytes <= gathered <= 2 * weight_bytes, summary['bytes_by_kind']
