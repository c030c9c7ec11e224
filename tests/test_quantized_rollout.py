"""rollout.weights: int8 | fp8 (model/quantize.py): the sampler's resident weights quantized per
output channel, against NumPy's quantization, and the sampler on them against the same model with
NumPy's dequantized weights on one device."""

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from grpo_jax.model import MeshConfig, from_pretrained, make_mesh
from grpo_jax.model.quantize import CONTRACTED, Quantized, dequantize, quantize
from grpo_jax.sampler import DecodeSettings, SamplingConfig
from grpo_jax.sampler.layout import resident_bytes_per_device, rollout_layout
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.testing import left_padded, random_prompts

pytestmark = pytest.mark.xdist_group('test_rollout_layout')  # 8-device meshes, as that file's

LARGEST = {'int8': 127.0, 'fp8': 448.0}


def numpy_quantized(weight: np.ndarray, contracted: tuple[int, ...], kind: str) -> tuple[np.ndarray, np.ndarray]:
  """(values, scale): a scale per output channel (max |w| over the contracted dims / the format's
  largest value), values = w / scale rounded to the format (int8: to nearest, ties to even)."""
  w = np.asarray(weight, np.float64)
  amax = np.max(np.abs(w), axis=contracted, keepdims=True)
  scale = np.where(amax > 0, amax / LARGEST[kind], 1.0)
  scaled = np.clip(w / scale, -LARGEST[kind], LARGEST[kind])
  if kind == 'int8':
    return np.round(scaled).astype(np.int8), scale
  return scaled.astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize('kind', ['int8', 'fp8'])
@pytest.mark.parametrize('name, shape', [('q_weight', (3, 32, 4, 8)), ('o_weight', (3, 4, 8, 32)),
                                         ('down_weight', (3, 48, 32)), ('expert_up_weight', (2, 5, 32, 12)),
                                         ('lm_head', (32, 96)), ('embedding', (96, 32))])
def test_quantize_equals_numpy_per_output_channel(seed, name, shape, kind):
  rng = np.random.default_rng(seed)
  # Channels of very different magnitudes, one all zero: a scale per channel must follow each.
  weight = rng.standard_normal(shape, np.float32) * np.exp(rng.uniform(-4, 2, shape[-1])).astype(np.float32)
  weight[..., 0] = 0.0
  values, scale = numpy_quantized(weight, CONTRACTED[name], kind)
  quantized = quantize(jax.numpy.asarray(weight), CONTRACTED[name], kind)
  assert quantized.values.dtype == values.dtype and quantized.scale.shape == scale.shape
  np.testing.assert_allclose(np.asarray(quantized.scale), scale, rtol=1e-6)
  if kind == 'int8':  # float32 division may land a value across a rounding midpoint: at most one step
    assert np.abs(np.asarray(quantized.values, np.int32) - values.astype(np.int32)).max() <= 1
    assert np.mean(np.asarray(quantized.values) == values) > 0.999
  else:
    np.testing.assert_array_equal(np.asarray(quantized.values).astype(np.float32), values.astype(np.float32))
  # The reconstruction error: half a step of the channel's scale for int8, fp8's 3-bit mantissa.
  error = np.abs(np.asarray(dequantize(quantized)) - weight)
  bound = scale * 0.5 if kind == 'int8' else np.maximum(np.abs(weight) * 2.0 ** -4, scale * 2.0 ** -9)
  assert np.all(error <= bound * 1.0001 + 1e-12)


def _dequantized_reference(directory: str, kind: str):
  """The checkpoint on one device with each quantized weight replaced by its 8-bit values x scale in
  NumPy. The values are `quantize`'s (checked against NumPy's above, up to a step where the float32
  division lands across a rounding midpoint): with NumPy's own, one value in ~10^4 a step away made
  a different model, 2e-3 away in a log-prob through Gemma's scaled embedding in CI."""
  model = from_pretrained(directory)
  state = nnx.state(model)

  def replace(path, leaf):
    name = next((key.key for key in reversed(path) if isinstance(key, jax.tree_util.DictKey)), None)
    if name not in CONTRACTED:
      return leaf
    weight = quantize(leaf, CONTRACTED[name], kind)
    values, scale = np.asarray(weight.values, np.float64), np.asarray(weight.scale, np.float64)
    return jax.numpy.asarray((values * scale).astype(np.float32))
  nnx.update(model, jax.tree_util.tree_map_with_path(replace, state))
  return model


@pytest.mark.parametrize('kind, architecture, mesh_shape, tensor', [
    pytest.param('int8', dict(), (1, 8, 1), 2, id='int8-fsdp8-t2', marks=pytest.mark.exhaustive),
    pytest.param('fp8', dict(tie_word_embeddings=True), (2, 2, 2), 4, id='fp8-tied-2x2x2-t4'),
    pytest.param('int8', dict(model_type='qwen3_moe', head_dim=16, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=24), (1, 8, 1), 2, id='int8-moe-fsdp8-t2',
                 marks=pytest.mark.exhaustive),
    *[pytest.param(kind, family, (2, 2, 2), 2, id=f'{kind}-{family}-2x2x2-t2', marks=pytest.mark.exhaustive)
      for kind, family in (('int8', 'gemma3_text'), ('fp8', 'glm4'), ('int8', 'mistral'))]])
def test_sampler_on_8bit_weights_equals_the_dequantized_model(seed, make_hf_checkpoint, kind, architecture,
                                                              mesh_shape, tensor):
  if isinstance(architecture, str):  # a family of test_families.py, at this test's sizes
    from test_families import FAMILIES
    architecture = {key: value for key, value in FAMILIES[architecture][0].items() if key != 'vocab_size'}
  directory, _ = make_hf_checkpoint(seed, **{**dict(vocab_size=256, hidden_size=64, intermediate_size=128),
                                             **architecture})
  tokens, mask = left_padded(random_prompts(seed, [5, 17, 11, 3], vocab=256))
  decode = DecodeSettings(max_new_tokens=10, sampling=SamplingConfig(temperature=1.0))
  key = jax.random.key(seed % 1000)

  def sample(model, layout=None):
    return jax.device_get(GroupSampler(model, group_size=2, settings=decode, layout=layout)(
        nnx.state(model), tokens, mask, key))

  reference = sample(_dequantized_reference(directory, kind))
  plain = sample(from_pretrained(directory))
  mesh = make_mesh(MeshConfig(*mesh_shape))
  with jax.set_mesh(mesh):
    model = from_pretrained(directory, mesh=mesh)
    layout = rollout_layout(model, mesh, tensor, weights=kind)
    resident = jax.eval_shape(layout.place, nnx.state(model))
    rollout = sample(model, layout)
  quantized = {name for name, leaf in jax.tree_util.tree_leaves_with_path(
      resident, is_leaf=lambda x: isinstance(x, Quantized)) if isinstance(leaf, Quantized) for name in [name]}
  assert len(quantized) == sum(1 for path, _ in jax.tree_util.tree_leaves_with_path(nnx.state(model))
                               if path[-2].key in CONTRACTED)
  np.testing.assert_array_equal(rollout.tokens, reference.tokens)
  np.testing.assert_allclose(rollout.log_probs, reference.log_probs, rtol=2e-4, atol=2e-4)
  # ... and not the unquantized model's (the 8 bits did change the policy).
  assert np.abs(np.asarray(rollout.log_probs) - np.asarray(plain.log_probs)).max() > 1e-4
  # The resident bytes: the projections at one byte a value (and their scales), about a quarter of fp32.
  full = resident_bytes_per_device(nnx.state(model), rollout_layout(model, mesh, tensor))
  assert resident_bytes_per_device(nnx.state(model), layout) < 0.4 * full
