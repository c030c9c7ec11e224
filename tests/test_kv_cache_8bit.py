"""rollout.kv_cache: int8 | fp8 (model/cache.py): the decode cache's keys and values 8-bit with a
scale per token and KV head. Its quantization against NumPy's; attention over 8-bit parts against
NumPy's attention over their dequantized entries; prefill and decode through an 8-bit cache against
the same model whose compute-dtype cache is rounded to the same entries after every write; and the
sampler's paths (shared prompts read once or copied, continuous batching) against each other."""

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from grpo_jax.model import from_pretrained
from grpo_jax.model.attention import SharedPart, grouped_attention, reader_layout
from grpo_jax.model.cache import KVCache, store
from grpo_jax.model.options import ModelOptions
from grpo_jax.model.quantize import Quantized, dequantize
from grpo_jax.testing import left_padded, random_prompts

LARGEST = {'int8': 127.0, 'fp8': 448.0}
VOCAB = 256
CONFIG = str(pathlib.Path(__file__).parents[1] / 'configs' / 'tiny_arith.yaml')


def numpy_entries(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
  """(values, scale [..., K, 1]): one scale per token and head, max |x| over H / the format's
  largest value (1 for an all-zero entry), the values x / scale rounded to the format."""
  x = np.asarray(x, np.float64)
  amax = np.max(np.abs(x), axis=-1, keepdims=True)
  scale = np.where(amax > 0, amax / LARGEST[kind], 1.0)
  scaled = np.clip(x / scale, -LARGEST[kind], LARGEST[kind])
  if kind == 'int8':
    return np.round(scaled).astype(np.int8), scale
  return scaled.astype(ml_dtypes.float8_e4m3fn), scale


def _like(kind):
  dtype = jnp.int8 if kind == 'int8' else jnp.float8_e4m3fn
  return Quantized(jnp.zeros((1, 1), dtype), jnp.zeros((1, 1), jnp.float32))


@pytest.mark.parametrize('kind', ['int8', 'fp8'])
def test_stored_entries_equal_numpy_per_token_and_head(seed, kind):
  """Entries [B, S, K, H] of heads of very different magnitudes, one all zero and one with NaN: a
  scale per token and head follows each; non-finite entries are stored as 0."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((3, 5, 4, 16)).astype(np.float32) * np.exp(rng.uniform(-4, 3, (3, 5, 4, 1))).astype(np.float32)
  x[0, 1, 2] = 0.0
  x[1, 2, 0, 3] = np.nan
  stored = store(jnp.asarray(x), _like(kind))
  values, scale = numpy_entries(np.nan_to_num(x, nan=0.0), kind)
  assert stored.values.dtype == values.dtype and stored.scale.shape == (3, 5, 4, 1)
  np.testing.assert_allclose(np.asarray(stored.scale), scale, rtol=1e-6)
  got = np.asarray(stored.values).astype(np.float32)
  if kind == 'int8':  # the float32 division may land across a rounding midpoint: at most one step
    assert np.abs(got - values.astype(np.float32)).max() <= 1
  else:
    np.testing.assert_array_equal(got, values.astype(np.float32))
  assert np.all(np.isfinite(np.asarray(dequantize(stored))))


def numpy_attention(q, parts):
  """q [B, T, N, H] over the concatenated (k, v [B, S, K, H], mask [B, T, S]) parts, float64."""
  k = np.concatenate([p[0] for p in parts], axis=1).astype(np.float64)
  v = np.concatenate([p[1] for p in parts], axis=1).astype(np.float64)
  mask = np.concatenate([p[2] for p in parts], axis=2)
  batch, length, heads, width = q.shape
  groups = heads // k.shape[2]
  k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
  scores = np.einsum('btnh,bsnh->bnts', q.astype(np.float64), k) * width ** -0.5
  scores = np.where(mask[:, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum('bnts,bsnh->btnh', probs, v)


@pytest.mark.parametrize('kind', ['int8', 'fp8'])
def test_attention_over_8bit_parts_equals_numpy_over_their_entries(seed, kind):
  """grouped_attention over an 8-bit cache part, an 8-bit shared prompt read once for its rows
  (SharedPart) and the new tokens in fp32 equals NumPy's attention over the dequantized entries
  (fp32, 1e-5): the scales folded into scores and probabilities are the dequantization."""
  rng = np.random.default_rng(seed)
  groups, prompts, rows, width, slots, heads, kv_heads, dim, length = 2, 2, 4, 6, 5, 4, 2, 8, 1
  q = rng.standard_normal((groups * rows, length, heads, dim)).astype(np.float32)

  def entries(shape):
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-2, 2, shape[:-1] + (1,))).astype(np.float32)
    return store(jnp.asarray(x), _like(kind))
  prompt_k, prompt_v = entries((groups, prompts, width, kv_heads, dim)), entries((groups, prompts, width, kv_heads, dim))
  cache_k, cache_v = entries((groups * rows, slots, kv_heads, dim)), entries((groups * rows, slots, kv_heads, dim))
  new_k, new_v = (rng.standard_normal((groups * rows, length, kv_heads, dim)).astype(np.float32) for _ in range(2))
  index = np.array([[0, 0, 1, 1], [1, 0, 1, 0]], np.int32)
  prompt_mask = rng.random((groups * rows, length, width)) < 0.8
  cache_mask = rng.random((groups * rows, length, slots)) < 0.7
  new_mask = np.ones((groups * rows, length, length), bool)
  readers, at = reader_layout(jnp.asarray(index), jnp.ones(index.shape, bool), prompts, 2)
  parts = [SharedPart(prompt_k, prompt_v, jnp.asarray(prompt_mask), readers, at),
           (cache_k, cache_v, jnp.asarray(cache_mask)), (jnp.asarray(new_k), jnp.asarray(new_v), jnp.asarray(new_mask))]
  out = np.asarray(grouped_attention(jnp.asarray(q), parts))
  rows_of = lambda x: np.asarray(dequantize(x)).reshape((groups, prompts) + x.shape[2:])[  # noqa: E731
      np.arange(groups)[:, None], index].reshape((groups * rows,) + x.shape[2:])
  reference = numpy_attention(q, [(rows_of(prompt_k), rows_of(prompt_v), prompt_mask),
                                  (np.asarray(dequantize(cache_k)), np.asarray(dequantize(cache_v)), cache_mask),
                                  (new_k, new_v, new_mask)])
  np.testing.assert_allclose(out, reference, rtol=1e-5, atol=1e-5)


def _entries(cache: KVCache) -> np.ndarray:
  """Keys and values as one fp32 array [2, L, B, S, K, H], an 8-bit cache's dequantized."""
  def layers(x):
    return np.stack([np.asarray(dequantize(layer, jnp.float32)) for layer in x]) if isinstance(x, tuple) else \
        np.asarray(dequantize(x, jnp.float32))
  return np.stack([layers(cache.k), layers(cache.v)])


def _holding(cache: KVCache, entries: np.ndarray, dtype) -> KVCache:
  """A compute cache like `cache` (scanned or layered) holding `entries` [2, L, B, S, K, H]."""
  def put(x, values):
    return tuple(jnp.asarray(v, dtype) for v in values) if isinstance(x, tuple) else jnp.asarray(values, dtype)
  return dataclasses.replace(cache, k=put(cache.k, entries[0]), v=put(cache.v, entries[1]))


@pytest.mark.parametrize('kind, layers', [('int8', 'scan'), pytest.param('int8', 'unrolled', marks=pytest.mark.exhaustive),
                                          pytest.param('fp8', 'unrolled', marks=pytest.mark.exhaustive)])
def test_decoding_through_an_8bit_cache_equals_a_cache_rounded_after_each_write(seed, make_hf_checkpoint, kind,
                                                                                 layers):
  """Left-padded prompts prefilled, then 6 tokens fed one at a time. At every step the logits through
  the 8-bit cache equal the model's with a compute cache holding the same entries, dequantized (fp32,
  1e-5), scanned and unrolled (one cache array per layer) alike; the entry each step writes is the
  8-bit rounding of the compute model's entry, as store() rounds it; and the logits differ from an
  unrounded cache's (the cache really is 8-bit). The reference takes the 8-bit cache's own entries,
  not its own rounding of them: two programs' keys a few ulps apart can round to neighbouring 8-bit
  values, and one such entry moves later logits by more than fp32's tolerance."""
  directory, _ = make_hf_checkpoint(seed, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
  tokens, mask = left_padded(random_prompts(seed, [9, 4, 7], vocab=VOCAB))
  tokens, mask = jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, jnp.int32)
  follow = jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, (3, 6)), jnp.int32)
  options = ModelOptions(decode_layers=layers)
  quantized = from_pretrained(directory, options=dataclasses.replace(options, kv_cache=kind))
  plain = from_pretrained(directory, options=options)
  width, start = tokens.shape[1] + follow.shape[1], tokens.shape[1]
  compute = plain.init_cache(3, width).dtype  # the plain model's cache entries

  cache = quantized.init_cache(3, width, layered=quantized.layered_decode_cache)
  logits, cache = quantized.extend(tokens, cache, segment_ids=mask)
  assert cache.format == kind and cache.dtype == (jnp.int8 if kind == 'int8' else jnp.float8_e4m3fn)
  got, caches = [logits[:, -1]], [cache]
  for step in range(follow.shape[1]):
    logits, cache = quantized.extend(follow[:, step:step + 1], cache)
    got.append(logits[:, 0])
    caches.append(cache)
  got = np.stack([np.asarray(o) for o in got], 1)

  like, flips, written = _like(kind), 0, 0
  for step in range(follow.shape[1]):
    held = _entries(caches[step])
    logits, after = plain.extend(follow[:, step:step + 1], _holding(caches[step], held, compute))
    np.testing.assert_allclose(got[:, step + 1], np.asarray(logits[:, 0]), rtol=1e-5, atol=1e-5, err_msg=f'step {step}')
    new = _entries(after)[..., start + step, :, :]
    rounded = np.asarray(dequantize(store(jnp.asarray(new), like), jnp.float32))
    wrote = _entries(caches[step + 1])[..., start + step, :, :]
    # a tie broken the other way by a few ulps of the key moves one entry by one 8-bit step
    flips += int((~np.isclose(wrote, rounded, rtol=1e-6, atol=1e-7)).sum())
    written += wrote.size
    step_size = np.abs(new).max(-1, keepdims=True) / LARGEST[kind]
    bound = step_size * (0.5 + 1e-4) if kind == 'int8' else np.abs(new) * 2.0 ** -4 + step_size * 2.0 ** -9
    assert np.all(np.abs(wrote - new) <= bound + 1e-6), f'step {step}: an entry further than rounding from its key'
  assert flips <= written // 200, (flips, written)

  def run_plain():
    cache = plain.init_cache(3, width, layered=plain.layered_decode_cache)
    logits, cache = plain.extend(tokens, cache, segment_ids=mask)
    outs = [logits[:, -1]]
    for step in range(follow.shape[1]):
      logits, cache = plain.extend(follow[:, step:step + 1], cache)
      outs.append(logits[:, 0])
    return np.stack([np.asarray(o) for o in outs], 1)

  unrounded = run_plain()
  np.testing.assert_allclose(got[:, 0], unrounded[:, 0], rtol=1e-5, atol=1e-5)  # prefill attends in full precision
  assert np.abs(got[:, 1:] - unrounded[:, 1:]).max() > 1e-4


@pytest.mark.parametrize('kind, family', [pytest.param('int8', None, marks=pytest.mark.exhaustive),
                                          pytest.param('fp8', None, marks=pytest.mark.exhaustive),
                                          pytest.param('int8', 'gemma3_text', marks=pytest.mark.exhaustive)])
def test_the_sampler_s_paths_on_an_8bit_cache_agree(seed, make_hf_checkpoint, kind, family):
  """GroupSampler on an 8-bit cache (groups of 2 over left-padded prompts, temperature 1): on one
  device with each row's copy of its prompt, on a (2, 2, 2) mesh with the rollout layout's tensor
  size 2 and the prompts read once, and in 3 decode slots (continuous batching: rows enter as
  others finish), the same tokens and log-probs (fp32, 2e-4) in all groups but at most one (an
  entry rounded the other way): each entry's scale is its own token's and head's, so no row reads
  another's rounding. The log-probs differ from a compute cache's.
  Gemma 3: its sliding layers' window rings 8-bit too (window 6 of 10-token answers)."""
  from flax import nnx

  from grpo_jax.model import MeshConfig, make_mesh
  from grpo_jax.sampler import DecodeSettings, SamplingConfig
  from grpo_jax.sampler.layout import rollout_layout
  from grpo_jax.sampler.rollout import GroupSampler
  architecture = {}
  if family is not None:
    from test_families import FAMILIES
    architecture = {key: value for key, value in FAMILIES[family][0].items() if key != 'vocab_size'}
  directory, _ = make_hf_checkpoint(seed, **{**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                    num_attention_heads=4, num_key_value_heads=2), **architecture})
  tokens, mask = left_padded(random_prompts(seed, [5, 17, 11, 3], vocab=VOCAB))
  decode = DecodeSettings(max_new_tokens=10, sampling=SamplingConfig(temperature=1.0))
  key = jax.random.key(seed % 1000)

  def sample(options, mesh=None, slots=0):
    model = from_pretrained(directory, options=options, mesh=mesh)
    layout = None if mesh is None else rollout_layout(model, mesh, 2)
    return jax.device_get(GroupSampler(model, group_size=2, settings=decode, layout=layout, slots=slots)(
        nnx.state(model), tokens, mask, key))

  reference = sample(ModelOptions(kv_cache=kind, prompt_reads='copy'))
  mesh = make_mesh(MeshConfig(2, 2, 2))
  with jax.set_mesh(mesh):
    once = sample(ModelOptions(kv_cache=kind, prompt_reads='once'), mesh)
  slotted = sample(ModelOptions(kv_cache=kind), slots=3)
  real = np.asarray(reference.mask) != 0
  for name, rollout in (('mesh, prompts read once', once), ('3 slots', slotted)):
    np.testing.assert_array_equal(rollout.tokens, reference.tokens, err_msg=name)
    # Two programs' keys a few ulps apart can round to neighbouring 8-bit values: such an entry moves
    # the later log-probs (by up to 4e-3, seen) of the rows reading it, its own or its prompt's group,
    # no other group's. A scale shared between rows would move every group that shares it.
    apart = real & ~np.isclose(rollout.log_probs, reference.log_probs, rtol=2e-4, atol=2e-4)
    groups = np.unique(np.flatnonzero(apart.any(1)) // 2)
    assert len(groups) <= 1, (name, groups, np.abs(np.asarray(rollout.log_probs) - reference.log_probs)[real].max())
  plain = sample(ModelOptions(prompt_reads='copy'))
  assert np.abs(np.asarray(reference.log_probs) - np.asarray(plain.log_probs))[real].max() > 1e-4


@pytest.mark.parametrize('overrides, message', [
    (['rollout.kv_cache=int4'], r"^config key 'rollout\.kv_cache' must be one of 'compute' \| 'int8' \| 'fp8'"),
    (['rollout.kv_cache=int8', 'model.decode_attention=pallas'], r"^model\.decode_attention \('pallas'\) must be 'dense'"),
    (['rollout.kv_cache=int8', 'model.kv_cache=fp8'], r"^rollout\.kv_cache \('int8'\) and model\.kv_cache \('fp8'\)")])
def test_what_an_8bit_cache_cannot_do_is_refused_in_one_line(overrides, message):
  from grpo_jax import config as config_lib
  from grpo_jax.errors import UserError
  with pytest.raises(UserError, match=message) as error:
    config_lib.load_config(CONFIG, overrides)
  assert '\n' not in str(error.value)
  assert config_lib.load_config(CONFIG, ['rollout.kv_cache=fp8']).model.options.kv_cache == 'fp8'


def test_the_plan_counts_an_8bit_cache_s_bytes():
  """The plan's KV cache figure for the 7B math recipe on one device: a byte per value and an fp32
  scale per token and head, against the bf16 cache's two bytes a value (so a decode step's cache
  reads fall to (1 + 4 / H) / 2 = 51.6% at H = 128)."""
  from grpo_jax import config as config_lib
  from grpo_jax.model import MeshConfig, make_mesh
  from grpo_jax.model.presets import preset
  from grpo_jax.plan.report import kv_cache_bytes_per_device
  architecture = preset('7B')
  mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
  recipe = str(pathlib.Path(CONFIG).parent / 'qwen2_5_math_dapo.yaml')
  plain, quantized = (config_lib.load_config(recipe, [f'rollout.kv_cache={kind}']) for kind in ('compute', 'int8'))
  assert plain.model.options.dtype == 'bfloat16'
  entries = 2 * architecture.num_hidden_layers * architecture.num_key_value_heads * (
      plain.rollout.prompts_per_step * 64 + plain.completions_per_step * plain.rollout.max_new_tokens)
  head = architecture.resolved_head_dim
  assert kv_cache_bytes_per_device(architecture, plain, 64, mesh) == entries * head * 2
  assert kv_cache_bytes_per_device(architecture, quantized, 64, mesh) == entries * (head + 4)
