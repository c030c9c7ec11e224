"""token_logprobs: the fused paths (XLA chunks, and the Pallas schedules interpreted on CPU)
against the naive full-logits reference, in values and in gradients with respect to h and W."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.config import load_config
from grpo_jax.errors import UserError
from grpo_jax.sharding import MeshConfig, make_mesh, named_sharding
from grpo_jax.ops import token_logprobs
from grpo_jax.ops import logprob, logprob_mosaic, logprob_mosaic_gpu, logprob_pallas

# Blocks small enough that V=1000 and T=100 span several tiles and end in partial ones (vocab
# masked, tokens padded). Mosaic GPU's blocks are multiples of 64 (D=40 padded to one slice; its own
# fast test below walks two).
FUSED = {
    'xla_chunked': dict(block_vocab=384),
    'pallas_mosaic': dict(block_tokens=32, block_vocab=256),
    'pallas_mosaic_gpu': dict(block_tokens=64, block_vocab=128, block_model=64),
}
# The Mosaic GPU schedule runs in the GPU interpreter: make test holds its fast case
# (test_mosaic_gpu_matches_naive), test-all the rest.
fused = pytest.mark.parametrize('implementation', [
    pytest.param(name, marks=pytest.mark.exhaustive) if name == 'pallas_mosaic_gpu' else name
    for name in sorted(FUSED)])

# fp32: rtol 1e-5 as asked, plus an absolute floor of 1e-5 of the array's largest magnitude.
# Gradient entries are sums of up to V (dh) or T (dW) products that cancel to near zero in places,
# where no two summation orders agree to a relative 1e-5; their error scales with the summands.
# Measured (beyond rtol) over many seeds: <= 5.4e-7 of max at V=1000, and at V=151,936 up to
# 2.9e-6 for the (since removed) Triton schedule, whose dh added 2,374 vocabulary tiles one after another.
RTOL, ATOL_SCALE = 1e-5, 1e-5
# bf16 h and W, against fp32 maths on the same bf16-rounded inputs. Log-probs and entropy
# accumulate in fp32 from exactly representable inputs, so they meet the fp32 tolerance (worst
# seen over 20 seeds: 3.6e-7 of max). dh and dW round d logits to bf16 before their matmuls and
# are returned in bf16: worst seen 4.7e-3 of max |grad| for every fused path, against 3.0e-3 for
# the naive path's own bf16 autodiff (rounding the output alone costs up to 2^-8 = 3.9e-3).
BF16_GRAD = 1e-2

# Hidden sizes of Qwen2.5 0.5B, 1.5B, 3B, 7B, 14B / 32B and 72B.
QWEN_MODEL_DIMS = (896, 1536, 2048, 3584, 5120, 8192)


def assert_close(actual, expected, rtol=RTOL, atol_scale=ATOL_SCALE, what=''):
  expected = np.asarray(expected, np.float64)
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol,
                             atol=atol_scale * np.abs(expected).max(), err_msg=what)


def random_problem(rng, tokens, model, vocab, spread=2.0):
  """h [T, D], W [D, V], y [T] with logits of standard deviation ~spread, as a trained head
  gives (never zeros: a zero W would make every softmax uniform and hide indexing mistakes)."""
  h = rng.standard_normal((tokens, model)).astype(np.float32)
  w = (rng.standard_normal((model, vocab)) * spread / np.sqrt(model)).astype(np.float32)
  return h, w, rng.integers(0, vocab, tokens).astype(np.int32)


def value_and_grads(implementation, h, w, y, g_logp, g_entropy=None, **options):
  """(logp, entropy, dh, dW) of sum(g_logp * logp + g_entropy * entropy); random cotangents
  check the whole Jacobian-vector product, not just the gradient of a plain sum."""
  step = _step(implementation, g_entropy is not None, tuple(sorted(options.items())))
  return step(h, w, y, g_logp, g_entropy)


@functools.cache
def _step(implementation, with_entropy, options):
  """One jitted step per configuration, shared by the tests (interpret-mode compiles dominate)."""

  def loss(h, w, y, g_logp, g_entropy):
    out = token_logprobs(h, w, y, return_entropy=with_entropy, implementation=implementation,
                         **dict(options))
    logp, entropy = out if with_entropy else (out, None)
    total = jnp.sum(g_logp * logp) + (jnp.sum(g_entropy * entropy) if with_entropy else 0.0)
    return total, (logp, entropy)

  def step(h, w, y, g_logp, g_entropy):
    (_, (logp, entropy)), (dh, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(
        h, w, y, g_logp, g_entropy)
    return logp, entropy, dh, dw

  return jax.jit(step)


def check_against_naive(implementation, h, w, y, g_logp, g_entropy=None, **options):
  ours = value_and_grads(implementation, h, w, y, g_logp, g_entropy,
                         **FUSED.get(implementation, {}), **options)
  reference = value_and_grads('naive', h, w, y, g_logp, g_entropy, **options)
  for name, a, b in zip(('logp', 'entropy', 'dh', 'dW'), ours, reference):
    if b is not None:
      assert a.dtype == b.dtype, name
      assert_close(a, b, what=f'{implementation} {name}')
  return ours


@fused
def test_matches_naive_fp32(implementation, seed):
  """Values and gradients, with random cotangents on both outputs and then on each alone, so an
  error in one gradient term cannot hide behind the other."""
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=100, model=40, vocab=1000)
  g_logp, g_entropy = rng.standard_normal((2, 100)).astype(np.float32)
  check_against_naive(implementation, h, w, y, g_logp, g_entropy)
  check_against_naive(implementation, h, w, y, g_logp, np.zeros_like(g_entropy))
  check_against_naive(implementation, h, w, y, np.zeros_like(g_logp), g_entropy)


@fused
def test_temperature_without_entropy(implementation, seed):
  """The sampler's temperature divides the logits (hotter than 1 here, 0.7 in the GRPO test);
  return_entropy=False runs kernels that carry no entropy terms at all."""
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=100, model=40, vocab=1000)
  check_against_naive(implementation, h, w, y, rng.standard_normal(100).astype(np.float32),
                      temperature=1.6)


# Vocabulary blocks that leave a partial last block of 151,936 = 2^7 x 1187; the XLA default here
# is 33 chunks of 4,608, the last one shifted.
FULL_VOCAB_BLOCKS = {'xla_chunked': {}, 'pallas_mosaic': dict(block_vocab=1024),
                     'pallas_mosaic_gpu': dict(block_vocab=256)}


@pytest.mark.parametrize('implementation', [  # the GPU interpreter over 152k columns: test-all's
    pytest.param(name, marks=pytest.mark.exhaustive if name == 'pallas_mosaic_gpu' else ())
    for name in sorted(FUSED)])
def test_full_qwen_vocabulary(implementation, seed):
  """V = 151,936 at tiny D, targets at both ends of the vocabulary and in the last block."""
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=24, model=8, vocab=151936, spread=3.0)
  y[:3] = [0, 151935, 151935 - 37]
  g_logp, g_entropy = rng.standard_normal((2, 24)).astype(np.float32)
  ours = value_and_grads(implementation, h, w, y, g_logp, g_entropy,
                         **FULL_VOCAB_BLOCKS[implementation])
  reference = value_and_grads('naive', h, w, y, g_logp, g_entropy)
  for name, a, b in zip(('logp', 'entropy', 'dh', 'dW'), ours, reference):
    assert_close(a, b, what=name)


@fused
def test_masked_tokens_get_no_gradient(implementation, seed):
  """GRPO zeroes padding with a mask: those rows of dh must be exactly 0, and dW must be that of
  the real tokens alone."""
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=100, model=40, vocab=1000)
  mask = rng.random(100) < 0.6
  g = rng.standard_normal(100).astype(np.float32)
  options = FUSED[implementation]
  _, _, dh, dw = value_and_grads(implementation, h, w, y, g * mask, g * mask, **options)
  np.testing.assert_array_equal(np.asarray(dh)[~mask], 0.0)
  # The subset goes through the reference path, which sees no masked tokens at all.
  _, _, dh_real, dw_real = value_and_grads('naive', h[mask], w, y[mask], g[mask], g[mask])
  assert_close(np.asarray(dh)[mask], dh_real)
  assert_close(dw, dw_real)


@fused
def test_grpo_loss_gradient(implementation, seed):
  """jax.grad of a PPO-clipped GRPO loss with an entropy bonus, on [B, T, D] hidden states and at
  a sampling temperature of 0.7."""
  rng = np.random.default_rng(seed)
  batch, length, model, vocab = 4, 25, 40, 1000
  h, w, y = random_problem(rng, batch * length, model, vocab)
  h, y = h.reshape(batch, length, model), y.reshape(batch, length)
  mask = (np.arange(length)[None, :] < rng.integers(length // 2, length + 1, (batch, 1)))
  advantages = rng.standard_normal((batch, 1)).astype(np.float32)
  reference_logp = token_logprobs(h, w, y, implementation='naive', temperature=0.7)
  # Old log-probs spread by 0.15 so that about a quarter of the ratios leave [0.8, 1.2].
  old_logp = reference_logp + 0.15 * rng.standard_normal((batch, length)).astype(np.float32)
  assert np.any(np.abs(old_logp - reference_logp)[mask] > np.log(1.2))

  def grpo_loss(h, w, implementation):
    logp, entropy = token_logprobs(h, w, y, return_entropy=True, implementation=implementation,
                                   temperature=0.7, **FUSED.get(implementation, {}))
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1 - 0.2, 1 + 0.2)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages) - 0.01 * entropy
    # The summands' own scale, for the loss's tolerance (below).
    scale = jnp.sum(jnp.abs(per_token) * mask) / jnp.sum(mask)
    return jnp.sum(per_token * mask) / jnp.sum(mask), scale

  grad = jax.jit(jax.value_and_grad(grpo_loss, (0, 1), has_aux=True), static_argnums=2)
  ((loss, _), (dh, dw)) = grad(h, w, implementation)
  ((loss_ref, scale), (dh_ref, dw_ref)) = grad(h, w, 'naive')
  # The loss is a mean of mixed-sign terms of size ~1 that can cancel to ~1e-4 (seen in CI:
  # -7.5e-4, off by 4.6e-8), where no two summation orders agree to 1e-5 of the result; as for
  # the gradients, the absolute floor is 1e-5 of the summands' scale.
  np.testing.assert_allclose(np.float64(loss), np.float64(loss_ref), rtol=RTOL,
                             atol=ATOL_SCALE * float(scale), err_msg='loss')
  assert_close(dh, dh_ref, what='dh')
  assert_close(dw, dw_ref, what='dW')
  np.testing.assert_array_equal(np.asarray(dh)[~mask], 0.0)


@fused
def test_bf16_bound(implementation, seed):
  """bf16 h and W: logits accumulate in fp32, so log-probs stay fp32-accurate; gradients carry
  the rounding of d logits to bf16 before the dh / dW matmuls (as the naive path's autodiff
  does with bf16 operands). Truth is fp32 maths on the same bf16-rounded inputs."""
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=100, model=40, vocab=1000)
  h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  g = rng.standard_normal(100).astype(np.float32)
  truth = value_and_grads('naive', h16.astype(jnp.float32), w16.astype(jnp.float32), y, g, g)
  ours = value_and_grads(implementation, h16, w16, y, g, g, **FUSED[implementation])
  assert ours[2].dtype == ours[3].dtype == jnp.bfloat16
  for name, a, b in zip(('logp', 'entropy'), ours, truth):
    assert_close(a, b, what=name)
  for name, a, b in zip(('dh', 'dW'), ours[2:], truth[2:]):
    error = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
    assert error <= BF16_GRAD * np.abs(np.asarray(b)).max(), (name, error)


# (mesh, V): tokens and vocabulary both split; tokens only (1002 does not divide by tensor=4, so
# W's columns stay whole); vocabulary only (every token axis is of size 1); hybrid (dW scattered
# along D over fsdp, then summed over data).
MESH_CASES = [(dict(data=1, fsdp=2, tensor=4), 1000), (dict(data=2, fsdp=1, tensor=4), 1002),
              (dict(data=1, fsdp=1, tensor=8), 1000), (dict(data=2, fsdp=2, tensor=2), 1000)]


@fused
@pytest.mark.parametrize('mesh_shape,vocab', MESH_CASES, ids=['tokens+vocab', 'tokens', 'vocab', 'hybrid'])
def test_on_a_mesh(implementation, mesh_shape, vocab, seed):
  """Under a device mesh each device runs the op on its tokens and its slice of W's columns, and
  per-token statistics are combined over the vocabulary axis (Megatron's vocab-parallel layout).
  Values and gradients match the naive path on one device; and no device holds an array as wide
  as the whole vocabulary, which the partitioned program's shapes show."""
  if implementation == 'pallas_mosaic_gpu':
    pytest.skip('the Mosaic GPU interpreter keeps one shared memory per process: kernels interpreted on '
                'several devices at once trip its barrier checks (as in test_decode_attention); the '
                'shard_map around the kernels is every schedule\'s')
  mesh = make_mesh(MeshConfig(**mesh_shape))
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=200, model=40, vocab=vocab)
  h, y = h.reshape(4, 50, 40), y.reshape(4, 50)
  g_logp, g_entropy = rng.standard_normal((2, 4, 50)).astype(np.float32)
  reference = value_and_grads('naive', h, w, y, g_logp, g_entropy)

  def loss(h, w):
    logp, entropy = token_logprobs(h, w, y, return_entropy=True, implementation=implementation,
                                   **FUSED[implementation])
    return jnp.sum(g_logp * logp) + jnp.sum(g_entropy * entropy), (logp, entropy)

  with jax.set_mesh(mesh):
    shardings = (named_sharding(mesh, h.shape, ('batch', 'seq', 'act_embed')),
                 named_sharding(mesh, w.shape, ('embed', 'vocab')))
    step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True), in_shardings=shardings)
    compiled = step.lower(h, w).compile()
    (_, ours), grads = compiled(*(jax.device_put(a, s) for a, s in zip((h, w), shardings)))
  for name, a, b in zip(('logp', 'entropy', 'dh', 'dW'), (*ours, *grads), reference):
    assert_close(a, b, what=f'{mesh_shape} {name}')
  if mesh_shape['tensor'] > 1 and vocab % mesh_shape['tensor'] == 0:
    assert not re.search(rf'\[(\d+,)*{vocab}(,\d+)*\]', compiled.as_text())

def test_mosaic_gpu_matches_naive(monkeypatch, seed):
  """make test's case of the Mosaic GPU schedule, interpreted (the fused tests above run it in
  test-all): T=100 in two token blocks of 64, the second padded; D=100 padded to two 64-wide
  slices; V=1000 in eight tiles of 128, the last shifted to start at 872 with its first 24 columns
  (seen by the tile before) masked. The accumulator budget is shrunk so that both backward kernels
  split D into 2 groups. fp32 values and gradients with random cotangents on logp and entropy,
  then bf16 inputs against fp32 maths on the bf16-rounded values."""
  monkeypatch.setattr(logprob_mosaic_gpu, 'MOSAIC_GPU_ACCUMULATOR_BYTES', 64 * 64 * 4)
  assert logprob_mosaic_gpu.model_groups(2, 64, 64) == logprob_mosaic_gpu.model_groups(2, 128, 64) == 2
  rng = np.random.default_rng(seed)
  h, w, y = random_problem(rng, tokens=100, model=100, vocab=1000)
  y[:2] = [999, 872]  # in the shifted last tile, past and at its start
  g_logp, g_entropy = rng.standard_normal((2, 100)).astype(np.float32)

  def loss(h, w):
    logp, entropy = token_logprobs(h, w, y, return_entropy=True, implementation='pallas_mosaic_gpu',
                                   **FUSED['pallas_mosaic_gpu'])
    return jnp.sum(g_logp * logp) + jnp.sum(g_entropy * entropy), (logp, entropy)

  # A fresh jit, so the kernels are traced under the patched budget.
  step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  (_, ours), grads = step(h, w)
  reference = value_and_grads('naive', h, w, y, g_logp, g_entropy)
  for name, a, b in zip(('logp', 'entropy', 'dh', 'dW'), (*ours, *grads), reference):
    assert a.dtype == b.dtype, name
    assert_close(a, b, what=name)
  h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  (_, ours), grads = step(h16, w16)
  truth = value_and_grads('naive', h16.astype(jnp.float32), w16.astype(jnp.float32), y, g_logp, g_entropy)
  assert grads[0].dtype == grads[1].dtype == jnp.bfloat16
  for name, a, b in zip(('logp', 'entropy'), ours, truth):
    assert_close(a, b, what=name)
  for name, a, b in zip(('dh', 'dW'), grads, truth[2:]):
    error = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
    assert error <= BF16_GRAD * np.abs(np.asarray(b)).max(), (name, error)


def test_chunked_memory_stays_small():
  """Guards the point of the op: compiled forward + backward temporaries of the XLA path stay
  a few percent of the naive path's, whose [T, V] fp32 logits alone are 311 MB here."""
  shapes = (jax.ShapeDtypeStruct((512, 64), jnp.float32),
            jax.ShapeDtypeStruct((64, 151936), jnp.float32),
            jax.ShapeDtypeStruct((512,), jnp.int32))

  def temp_bytes(implementation):
    def loss(h, w, y):
      return jnp.sum(token_logprobs(h, w, y, implementation=implementation))
    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  assert temp_bytes('xla_chunked') < 0.05 * temp_bytes('naive')


def _pallas_calls(jaxpr) -> list:
  """Every Pallas kernel's equation in a jaxpr, inner jaxprs (custom_vjp, jit) included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ('pallas_call', 'mpmd_map'):  # mpmd_map: plgpu.kernel's (Mosaic GPU)
      found.append(eqn)
    for value in eqn.params.values():
      inner = getattr(value, 'jaxpr', value)
      if hasattr(inner, 'eqns'):
        found += _pallas_calls(inner)
  return found


def _described_target(platform):
  """An abstract one-device mesh of `platform` devices: what a deviceless compile lowers under."""
  from jax._src.mesh import AbstractDevice
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ('data',), abstract_device=AbstractDevice(
      device_kind=platform, num_cores=None, platform=platform)))


@pytest.mark.parametrize('platform,schedule,implementation,interpreted', [
    ('tpu', 'mosaic', 'pallas', False), ('cuda', 'mosaic_gpu', 'pallas', False),
    ('cuda', 'mosaic_gpu', 'pallas_mosaic_gpu', False), ('cpu', 'mosaic', 'pallas', True)])
def test_interpret_and_schedule_follow_the_target_not_the_host(platform, schedule, implementation, interpreted):
  """implementation='pallas' (or 'pallas_mosaic_gpu' by name) traced under a mesh of TPU or GPU devices
  (what compiling for a topology from this CPU-only host does) builds that target's kernel, not
  interpreted; only a CPU target interprets. Both used to follow the host's backend, so deviceless compiles silently
  built the interpreted kernel."""
  dtype = jnp.bfloat16 if schedule == 'mosaic_gpu' else jnp.float32  # Mosaic GPU takes 16-bit on a GPU
  shapes = (jax.ShapeDtypeStruct((64, 128), dtype), jax.ShapeDtypeStruct((128, 1024), dtype),
            jax.ShapeDtypeStruct((64,), jnp.int32))
  with _described_target(platform):
    assert logprob.target_platform() == ('gpu' if platform == 'cuda' else platform)
    jaxpr = jax.make_jaxpr(lambda h, w, y: token_logprobs(h, w, y, implementation=implementation))(*shapes)
  (call,) = _pallas_calls(jaxpr.jaxpr)
  assert bool(call.params['interpret']) == interpreted
  module = type(call.params['compiler_params']).__module__
  assert schedule in module and (schedule == 'mosaic_gpu') == ('mosaic_gpu' in module), module


@pytest.mark.parametrize('schedule,platform', [('mosaic', 'tpu'), ('mosaic_gpu', 'cuda')])
@pytest.mark.parametrize('dtype,model', [(jnp.float32, 896), (jnp.bfloat16, 896),
                                         (jnp.bfloat16, 5120)])
def test_kernels_lower_for_accelerators(schedule, platform, dtype, model):
  """Forward and both backward kernels lower for the real backend (not interpreted): Mosaic for
  TPU, Mosaic GPU for GPU, with Qwen2.5-0.5B's and 32B's shapes (the latter splits the backward
  kernels into D groups). This runs jax's lowering rules and block checks (and, for Mosaic GPU, its
  own layout inference and lowering to the module the custom call carries); Mosaic's own compiler
  needs the device. Mosaic GPU refuses fp32 on a GPU (WGMMA transposes only 16-bit operands), with
  a pointer to the XLA path."""
  hidden = jax.ShapeDtypeStruct((2, 128, model), dtype)
  weight = jax.ShapeDtypeStruct((model, 151936), dtype)
  targets = jax.ShapeDtypeStruct((2, 128), jnp.int32)

  def loss(h, w, y):
    logp, entropy = token_logprobs(h, w, y, return_entropy=True, temperature=0.8,
                                   implementation=f'pallas_{schedule}', interpret=False)
    return jnp.sum(logp) + jnp.sum(entropy)

  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  with _described_target(platform):
    if schedule == 'mosaic_gpu' and dtype == jnp.float32:
      with pytest.raises(ValueError, match='16-bit.*xla_chunked'):
        step.trace(hidden, weight, targets)
      return
    text = step.trace(hidden, weight, targets).lower(lowering_platforms=(platform,)).as_text()
  target = {'mosaic': '@tpu_custom_call', 'mosaic_gpu': '@mosaic_gpu_v2'}[schedule]
  assert text.count(target) >= 3
  if platform == 'tpu':  # each kernel carries its VMEM limit, within the smallest TPU's VMEM
    limits = [int(size) for size in re.findall(r'scoped_memory_configs.*?size.*?(\d+)\}', text)]
    assert len(limits) == 3 and all(limit <= 0.9 * (16 << 20) for limit in limits), limits



def test_mosaic_default_blocks_fit_vmem():
  """Default Mosaic blocks are (8, 128)-aligned and fit the share of VMEM they are sized to on
  every TPU generation (16, 64, 128 MiB per core); more VMEM never gives smaller blocks; a model
  too wide for any block gets an error that names the way out."""
  for itemsize in (2, 4):
    for model in QWEN_MODEL_DIMS:
      previous = (0, 0)
      for capacity in (16 << 20, 64 << 20, 128 << 20):
        try:
          blocks = logprob_mosaic.mosaic_blocks(model, itemsize, capacity)
        except ValueError as error:
          assert capacity == 16 << 20 and 'xla_chunked' in str(error), (model, itemsize, error)
          continue
        block_tokens, block_vocab = blocks
        assert block_tokens % 8 == 0 and block_vocab % 128 == 0
        need = logprob_mosaic.mosaic_vmem_bytes(block_tokens, block_vocab, model, itemsize)
        assert need <= logprob_mosaic.VMEM_SHARE * capacity
        assert min(blocks) >= min(previous), (model, itemsize, capacity, blocks, previous)
        previous = blocks
      # Every Qwen2.5 width gets blocks on the TPUs with 64 MiB of VMEM or more.
      assert previous != (0, 0), (model, itemsize)


def test_mosaic_refuses_blocks_beyond_vmem():
  """Widest Qwen2.5 shapes lowered for a TPU (the smallest VMEM is assumed off a TPU): 32B's
  D = 5120 in bf16 gets blocks that fit; 72B's D = 8192 is refused with a pointer to the XLA
  path, as are explicit blocks that cannot fit, before Mosaic's compiler would fail on them."""
  def lower(model, **blocks):
    def loss(h, w, y):
      return jnp.sum(token_logprobs(h, w, y, implementation='pallas_mosaic', interpret=False,
                                    **blocks))
    shapes = (jax.ShapeDtypeStruct((512, model), jnp.bfloat16),
              jax.ShapeDtypeStruct((model, 151936), jnp.bfloat16),
              jax.ShapeDtypeStruct((512,), jnp.int32))
    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    return step.trace(*shapes).lower(lowering_platforms=('tpu',)).as_text()

  assert lower(5120).count('@tpu_custom_call') >= 3
  with pytest.raises(ValueError, match='xla_chunked'):
    lower(8192)
  with pytest.raises(ValueError, match=r'blocks \(512, 1024\) at D=896.*smaller block_tokens'):
    lower(896, block_tokens=512, block_vocab=1024)


def test_auto_and_pallas_schedules_per_platform():
  for platform in ('cpu', 'gpu', 'tpu'):  # Pallas stays opt-in until checked on hardware
    assert logprob._schedule('auto', platform) == 'xla'
  assert logprob._schedule('pallas', 'tpu') == 'mosaic'
  assert logprob._schedule('pallas', 'cpu') == 'mosaic'
  assert logprob._schedule('pallas', 'gpu') == 'mosaic_gpu'
  assert logprob._schedule('pallas_mosaic_gpu', 'gpu') == 'mosaic_gpu'


def test_rejects_bad_arguments():
  h, w, y = jnp.ones((4, 8)), jnp.ones((8, 300)), jnp.zeros(4, jnp.int32)
  with pytest.raises(ValueError, match='implementation'):
    token_logprobs(h, w, y, implementation='fast')
  with pytest.raises(ValueError, match='must be'):
    token_logprobs(h, w, y[:3])
  with pytest.raises(ValueError, match='temperature'):
    token_logprobs(h, w, y, temperature=0.0)
  with pytest.raises(ValueError, match='128'):
    logprob_pallas.block_shapes('mosaic', 4, 8, 300, 32, 100, None)
  with pytest.raises(ValueError, match='mosaic_gpu block_vocab must be a multiple of 64'):
    logprob_pallas.block_shapes('mosaic_gpu', 4, 8, 300, 64, 96, 64)
  with pytest.raises(ValueError, match='at most 256'):
    logprob_pallas.block_shapes('mosaic_gpu', 4, 8, 300, 64, 128, 512)
  assert logprob_pallas.block_shapes('mosaic_gpu', 4, 8, 300, 128, 128, 64) == (64, 128, 64)


def test_the_removed_triton_name_is_refused():
  """The Triton kernels are gone, and with them their name: a config naming it gets the one-line
  error that names the key and lists the implementations, the op the same list."""
  with pytest.raises(UserError) as error:
    load_config(None, ['algo.logprob_implementation=pallas_triton'])
  assert ("config key 'algo.logprob_implementation' must be one of 'auto' | 'pallas' | 'pallas_mosaic' | "
          "'pallas_mosaic_gpu' | 'xla_chunked' | 'naive' | 'exact', got 'pallas_triton'") in str(error.value)
  with pytest.raises(ValueError, match=r"implementation must be one of .*'pallas_mosaic_gpu'.*got 'pallas_triton'"):
    token_logprobs(jnp.ones((4, 8)), jnp.ones((8, 300)), jnp.zeros(4, jnp.int32), implementation='pallas_triton')
