"""Context parallelism: the update's sequences split along their length over the `context` mesh
axis, attention by a ring (model/ring_attention.py), equal to one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.model.attention import attention, attention_mask, window_mask
from grpo_jax.model.ring_attention import from_zigzag, ring_attention, to_zigzag, zigzag_order
from test_sharding import forward_on


def _packed_segments(rng, batch, length):
  """[B, T] segment ids: left padding (0), then sequences of random lengths, as packed rows hold them."""
  segments = np.zeros((batch, length), np.int32)
  for row in range(batch):
    at, segment = int(rng.integers(0, length // 4)), 1
    while at < length:
      size = int(rng.integers(1, length // 2))
      segments[row, at:at + size] = segment
      at, segment = at + size, segment + 1
  return jnp.asarray(segments)


@pytest.mark.parametrize('context, window', [pytest.param(2, None, marks=pytest.mark.exhaustive), (4, None),
                                             pytest.param(4, 5, marks=pytest.mark.exhaustive)])
def test_ring_attention_equals_attention_and_its_gradient(context, window, seed):
  """The ring's output and its gradients (q, k, v) over zig-zag rows equal one device's attention
  under the same causal segment mask (packed rows with left padding; a sliding window); without the
  zig-zag skip too (test-all's cases); and a ring that skips one block's step differs."""
  rng = np.random.default_rng(seed)
  batch, length, heads, kv_heads, width = 2, 32, 4, 2, 8
  q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
             for shape in ((batch, length, heads, width), (batch, length, kv_heads, width),
                           (batch, length, kv_heads, width)))
  segments = _packed_segments(rng, batch, length)
  slots = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  ordinals = slots
  mask = attention_mask(slots, segments, slots, segments)
  if window is not None:
    mask = mask & window_mask(ordinals, ordinals, jnp.int32(window))
  weights = jnp.asarray(rng.normal(size=(batch, length, heads, width)), jnp.float32)
  reference = attention(q, k, v, mask)
  reference_grads = jax.grad(lambda q, k, v: (attention(q, k, v, mask) * weights).sum(), argnums=(0, 1, 2))(q, k, v)

  mesh = jax.make_mesh((8 // context, context), ('fsdp', 'context'), axis_types=(AxisType.Auto,) * 2)
  rows = NamedSharding(mesh, P(None, 'context'))
  placed = [jax.device_put(to_zigzag(x, context), rows) for x in (q, k, v, slots, segments, ordinals)]
  zigzag_weights = to_zigzag(weights, context)
  window_arg = None if window is None else jnp.int32(window)

  def ring(q, k, v, **options):
    return ring_attention(q, k, v, placed[3], placed[4], chunk=4, ordinals=placed[5], window=window_arg, **options)

  # The ring without the zig-zag skip (every block whole) where the case is test-all's.
  variants = (dict(),) if (context, window) == (4, None) else (dict(), dict(zigzag=False))
  with jax.set_mesh(mesh):
    for options in variants:
      out = jax.jit(lambda q, k, v: ring(q, k, v, **options))(*placed[:3])
      np.testing.assert_allclose(np.asarray(from_zigzag(out, context)), np.asarray(reference), rtol=0, atol=2e-6)
      grads = jax.jit(jax.grad(lambda q, k, v: (ring(q, k, v, **options) * zigzag_weights).sum(),
                               argnums=(0, 1, 2)))(*placed[:3])
      for name, grad, expected in zip('qkv', grads, reference_grads):
        np.testing.assert_allclose(np.asarray(from_zigzag(grad, context)), np.asarray(expected), rtol=0, atol=2e-5,
                                   err_msg=name)
    skipped = jax.jit(lambda q, k, v: ring(q, k, v, skip=context - 1))(*placed[:3])
  assert np.abs(np.asarray(from_zigzag(skipped, context)) - np.asarray(reference)).max() > 1e-2


def test_zigzag_order_is_a_reshape_of_the_rows():
  x = jnp.arange(3 * 24).reshape(3, 24)
  for devices in (1, 2, 3, 4):
    order = zigzag_order(24, devices)
    assert sorted(np.asarray(order).tolist()) == list(range(24))
    np.testing.assert_array_equal(np.asarray(to_zigzag(x, devices)), np.asarray(x[:, order]))
    np.testing.assert_array_equal(np.asarray(from_zigzag(to_zigzag(x, devices), devices)), np.asarray(x))
  with pytest.raises(ValueError, match='8 chunks: 20 tokens'):
    zigzag_order(20, 4)
  # On a mesh whose context axis splits the rows: the collective permutes' exchange, the same.
  for devices in (2, 4):
    mesh = jax.make_mesh((8 // devices, devices), ('fsdp', 'context'), axis_types=(AxisType.Auto,) * 2)
    y = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    with jax.set_mesh(mesh):
      placed = jax.device_put(y, NamedSharding(mesh, P(None, 'context')))
      there = jax.jit(lambda y: to_zigzag(y, devices))(placed)
      back = jax.jit(lambda y: from_zigzag(y, devices))(there)
    np.testing.assert_array_equal(np.asarray(there), np.asarray(y[:, zigzag_order(24, devices)]))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(y))


# make test's RL step on fsdp x context (test_mesh_equivalence.py) holds the forward; these, test-all's.
@pytest.mark.exhaustive
@pytest.mark.parametrize('mesh_shape', [dict(data=1, fsdp=4, tensor=1, context=2),
                                        dict(data=1, fsdp=1, tensor=2, context=4)])
def test_logits_on_a_context_mesh_equal_one_device(mesh_shape, seed, make_hf_checkpoint):
  directory, _ = make_hf_checkpoint(seed, num_attention_heads=8, num_key_value_heads=4, intermediate_size=192,
                                    vocab_size=1024)
  tokens = np.random.default_rng(seed).integers(0, 1024, (4, 48), dtype=np.int32)
  single = np.asarray(from_pretrained(directory)(tokens))
  mesh = make_mesh(MeshConfig(**mesh_shape))
  logits = forward_on(from_pretrained(directory, mesh=mesh), mesh, tokens)
  np.testing.assert_allclose(np.asarray(logits), single, rtol=0, atol=1e-5)


def test_a_context_axis_the_devices_do_not_take_is_one_line():
  from grpo_jax.errors import UserError
  with pytest.raises(UserError, match=r'^mesh: 8 devices cannot be split into data=1 x fsdp=-1 x tensor=1 x expert=1 '
                                      r'x context=3$'):
    make_mesh(MeshConfig(context=3))
  with pytest.raises(UserError, match=r'^mesh: data=2 x fsdp=1 x tensor=1 x expert=1 x context=2 = 4 devices, but 8 '):
    make_mesh(MeshConfig(data=2, fsdp=1, context=2))
  with pytest.raises(UserError, match=r'^mesh.context must be a positive size or -1, got 0'):
    MeshConfig(context=0)


def test_the_plan_offers_the_context_axis_for_long_rows_only():
  """advice.knobs: a 32k-token row of the 32B recipe on 64 devices gets mesh.context 2 .. 16 with
  micro-batches of one row per batch shard; 4k-token rows (under LONG_ROWS) get none."""
  from grpo_jax import config as config_lib
  from grpo_jax.plan import advice
  from grpo_jax.plan.programs import model_architecture
  config = config_lib.load_config('configs/qwen3_32b_dapo_aime.yaml', ['rollout.max_new_tokens=30720'])
  architecture = model_architecture(config, 'Qwen3-32B', None)
  offered = {knob.overrides[0]: knob.overrides for knob in advice.knobs(config, architecture, 64, 32768)
             if knob.overrides[0].startswith('mesh.context')}
  assert offered['mesh.context=4'] == ('mesh.context=4', 'mesh.data=1', 'mesh.fsdp=-1', 'algo.micro_batch_size=16')
  assert sorted(offered) == ['mesh.context=16', 'mesh.context=2', 'mesh.context=4', 'mesh.context=8']
  short = config_lib.load_config('configs/qwen3_32b_dapo_aime.yaml', ['rollout.max_new_tokens=2048'])
  assert not [knob for knob in advice.knobs(short, architecture, 64, 4096) if 'mesh.context' in knob.name]


@pytest.mark.parametrize('replicated', [False, True])
def test_no_activation_is_gathered_over_the_context_axis(replicated):
  """The forward of rows split over context 2 (the update's FSDP weights, or weights replicated as
  the sampler's prefill holds them): the compiled program all-gathers weights only, no [B, T, ...]
  activation of the whole row (a projection that flattened B x T had every device of the axis
  project the whole row)."""
  import re
  from flax import nnx
  from grpo_jax.model import Qwen2Config, init_model
  from grpo_jax.sharding import axis_rules, state_shardings
  config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
  mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1, context=2), devices=jax.devices()[:2])
  graphdef, state = nnx.split(init_model(config))
  rules = dict(embed=None, latent=None) if replicated else {}
  batch, length = 4, 64
  with axis_rules(rules):
    state = jax.device_put(state, state_shardings(state, mesh))
    run = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).sequence_pass(tokens)[0])
    with jax.set_mesh(mesh):
      hlo = run.lower(state, jnp.ones((batch, length), jnp.int32)).compile().as_text()
  gathered = re.findall(r'= ((?:f32|bf16)\[[\d,]*\])\S* all-gather\(', hlo)
  assert not [shape for shape in gathered if shape.split('[')[1].startswith(f'{batch},{length},')], gathered
  assert 'collective-permute' in hlo
