"""The same logits on one device and on meshes of 8 fake CPU devices (set in conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from grpo_jax.errors import UserError
from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.sharding import named_sharding, spec_for

MESHES = {
    'data8': (MeshConfig(data=8, fsdp=1, tensor=1), 8),
    'fsdp8': (MeshConfig(data=1, fsdp=8, tensor=1), 8),
    'cube': (MeshConfig(data=2, fsdp=2, tensor=2), 8),
    'tensor4-divides-kv': (MeshConfig(data=2, fsdp=1, tensor=4), 8),
    'tensor8-replicates-kv': (MeshConfig(data=1, fsdp=1, tensor=8), 8),
    'fsdp-rest': (MeshConfig(data=2, fsdp=-1, tensor=2), 8),
    # the rows split along their length (context parallelism: ring attention)
    'fsdp2-context4': (MeshConfig(data=1, fsdp=2, tensor=1, context=4), 8),
}


def forward_on(model, mesh, tokens):
  """Jitted forward with explicit input and output shardings on `mesh`."""
  graphdef, state = nnx.split(model)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  tokens_sharding = named_sharding(mesh, tokens.shape, ('batch', 'seq'))
  logits_sharding = named_sharding(mesh, (*tokens.shape, model.config.vocab_size), ('batch', 'seq', 'vocab'))
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens),
                    in_shardings=(state_sharding, tokens_sharding), out_shardings=logits_sharding)
  with jax.set_mesh(mesh):
    logits = forward(state, jax.device_put(tokens, tokens_sharding))
  return logits


# Qwen3 (per-head q/k norms, head_dim 16 where D / N = 8) on the meshes that split heads differently,
# and the other families on the cube (their own weights laid out by the same rule table:
# test_families.py's architectures over this test's heads and widths).
QWEN3 = dict(model_type='qwen3', head_dim=16)


def _family(name):
  from test_families import FAMILIES
  fields = dict(FAMILIES[name][0])
  fields.pop('vocab_size', None)
  return fields


CASES = ([pytest.param(name, {}, id=f'{name}-qwen2') for name in sorted(MESHES)]
         + [pytest.param(name, QWEN3, id=f'{name}-qwen3') for name in ('cube', 'tensor8-replicates-kv')]
         + [pytest.param('cube', _family(family), id=f'cube-{family}',
                         marks=() if family == 'gemma3_text' else pytest.mark.exhaustive)
            for family in ('llama3', 'mistral', 'glm4', 'gemma3_text')]
         # Gemma 3's sliding windows across the ring's blocks
         + [pytest.param('fsdp2-context4', _family('gemma3_text'), id='fsdp2-context4-gemma3_text',
                         marks=pytest.mark.exhaustive)])


@pytest.mark.parametrize('name, architecture', CASES)
def test_mesh_logits_equal_single_device(name, architecture, seed, make_hf_checkpoint):
  assert len(jax.devices()) == 8
  directory, _ = make_hf_checkpoint(seed, **{**dict(num_attention_heads=8, num_key_value_heads=4,
                                                   intermediate_size=192, vocab_size=1024), **architecture})
  head_dim = architecture.get('head_dim', 8)
  tokens = np.random.default_rng(seed).integers(0, 1024, (8, 48), dtype=np.int32)
  single = np.asarray(from_pretrained(directory)(tokens))

  config, _ = MESHES[name]
  mesh = make_mesh(config)
  model = from_pretrained(directory, mesh=mesh)
  logits = forward_on(model, mesh, tokens)
  # fp32 sums in another order over the mesh: 1e-5 at Qwen's logits (largest ~3); the other families'
  # some tens of ulps of their largest logit (Gemma 3's scaled embedding and (1 + w) norms: ~6). Seen
  # for Gemma 3: 4.6e-6 of it on the cube (seed 2981468036), 4.0e-6 on fsdp2-context4 (seed 3173021852)
  bound = 7e-6 * np.abs(single).max() if model.config.family else 1e-5
  np.testing.assert_allclose(np.asarray(logits), single, rtol=0, atol=bound)

  shape = dict(mesh.shape)
  q_spec = model.layers.q_weight[...].sharding.spec
  k_spec = model.layers.k_weight[...].sharding.spec
  # Heads go to `tensor` when it divides them, D to `fsdp`; otherwise the dim is replicated.
  assert q_spec == spec_for((2, 64, 8, head_dim), ('layers', 'embed', 'q_heads', 'head_dim'), shape)
  if model.config.qk_norm:  # the per-head norms are laid out by the same rule table
    assert model.layers.q_norm[...].sharding.spec == spec_for((2, head_dim), ('layers', 'head_dim'), shape)
  if shape['tensor'] in (2, 4) and model.config.num_key_value_heads % shape['tensor'] == 0:
    assert k_spec[2] == 'tensor' and q_spec[2] == 'tensor'
  if shape['tensor'] == 8:
    assert len(k_spec) < 3 or k_spec[2] is None
  if shape['fsdp'] > 1:  # D over fsdp (and context, whose devices share the ZeRO shards)
    assert q_spec[1] == ('fsdp' if shape['context'] == 1 else ('fsdp', 'context'))
  assert logits.sharding.spec == named_sharding(mesh, logits.shape, ('batch', 'seq', 'vocab')).spec


def test_kv_cache_decode_on_mesh_matches_single_device(seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed, num_attention_heads=8, num_key_value_heads=4)
  tokens = np.random.default_rng(seed).integers(0, 1000, (4, 20), dtype=np.int32)
  single = np.asarray(from_pretrained(directory)(tokens))
  mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  model = from_pretrained(directory, mesh=mesh)
  graphdef, state = nnx.split(model)
  extend = jax.jit(lambda state, tokens, cache: nnx.merge(graphdef, state).extend(tokens, cache))
  with jax.set_mesh(mesh):
    cache = model.init_cache(4, 24)
    logits, cache = extend(state, tokens[:, :16], cache)
    steps = [np.asarray(logits)]
    for t in range(16, 20):
      logits, cache = extend(state, tokens[:, t:t + 1], cache)
      steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), single, rtol=0, atol=1e-5)


def test_spec_for_drops_axes_that_do_not_divide():
  mesh = {'data': 2, 'fsdp': 4, 'tensor': 4}
  assert spec_for((151936, 896), ('vocab', 'embed'), mesh) == P('tensor', 'fsdp')
  # Qwen2.5-0.5B: 14 query heads and 2 KV heads do not split 4 ways: replicated.
  assert spec_for((24, 896, 14, 64), ('layers', 'embed', 'q_heads', 'head_dim'), mesh) == P(None, 'fsdp')
  assert spec_for((24, 896, 2, 64), ('layers', 'embed', 'kv_heads', 'head_dim'), mesh) == P(None, 'fsdp')
  # Batch over data x fsdp when divisible, else the largest prefix that divides.
  assert spec_for((16, 10), ('batch', 'seq'), mesh) == P(('data', 'fsdp'))
  assert spec_for((6, 10), ('batch', 'seq'), mesh) == P('data')
  # Size-1 mesh axes never appear in a spec.
  assert spec_for((64, 64), ('embed', 'mlp'), {'data': 8, 'fsdp': 1, 'tensor': 1}) == P()


@pytest.mark.parametrize('sizes, message', [
    ((3, 1, 1), 'but 8 are available'),
    ((-1, -1, 1), 'mesh may have at most one axis of -1'),
    ((3, -1, 1), 'cannot be split'),
    ((0, -1, 1), 'mesh.data must be a positive size'),
    ((1, 1, -2), 'mesh.tensor must be a positive size or -1, got -2'),
])
def test_bad_mesh_shapes_are_one_line_errors(sizes, message):
  with pytest.raises(UserError, match=message):
    make_mesh(MeshConfig(*sizes))


def test_hybrid_layout_is_set_by_the_hosts():
  """mesh.hybrid sets data and fsdp itself (a size given beside it is refused, by name); on one
  process 'auto' is the plain FSDP mesh and true is data=1 over this host's devices (tests/
  test_plan.py compiles it over two GPU hosts); a config file's `hybrid: auto` reads as such."""
  from grpo_jax import config as config_lib

  with pytest.raises(UserError, match=r'^mesh.hybrid \(true\) sets data \(the hosts\) and fsdp'):
    MeshConfig(data=2, hybrid=True)
  with pytest.raises(UserError, match="^mesh.hybrid must be true, false or 'auto', got 'yes'"):
    MeshConfig(hybrid='yes')
  for hybrid in (True, 'auto'):
    mesh = make_mesh(MeshConfig(tensor=2, hybrid=hybrid))
    assert dict(mesh.shape) == {'data': 1, 'fsdp': 4, 'tensor': 2, 'expert': 1, 'context': 1}
  assert config_lib.load_config('configs/tiny_arith.yaml', ['mesh.hybrid=auto']).mesh.hybrid == 'auto'


@pytest.mark.parametrize('shape', [dict(data=2, fsdp=2, tensor=2), dict(data=2, fsdp=4), dict(fsdp=8), dict(data=8)],
                         ids=['hybrid+tensor', 'hybrid', 'fsdp', 'data'])
def test_embedding_gradient_on_a_mesh_equals_one_device(shape, seed):
  """The lookup's gradient, formed per D slice over the FSDP axes and summed over the others
  (model/embedding.py), equals jnp.take's on one device: repeated ids and rows of every device,
  and the table's rows split over tensor; it comes out laid out as the table is."""
  from grpo_jax.model.embedding import embedding_lookup

  rng = np.random.default_rng(seed)
  vocab, model = 1000, 48
  table = rng.standard_normal((vocab, model)).astype(np.float32)
  tokens = rng.integers(0, vocab, (8, 12)).astype(np.int32)
  tokens[:, :3] = rng.integers(0, vocab)  # one id in every row
  cotangent = rng.standard_normal((8, 12, model)).astype(np.float32)
  expected = jax.grad(lambda t: jnp.sum(jnp.take(t, tokens, axis=0) * cotangent))(table)
  mesh = make_mesh(MeshConfig(**shape))
  with jax.set_mesh(mesh):
    layouts = (named_sharding(mesh, table.shape, ('vocab', 'embed')),
               named_sharding(mesh, tokens.shape, ('batch', 'seq')))
    grad = jax.jit(jax.grad(lambda t, k: jnp.sum(embedding_lookup(t, k) * cotangent)), in_shardings=layouts)(
        *(jax.device_put(x, s) for x, s in zip((table, tokens), layouts)))
  np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=0, atol=1e-5)
  assert grad.sharding.spec == layouts[0].spec
