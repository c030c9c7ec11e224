"""The fused log-prob kernels' Mosaic GPU schedule on a GPU, against the XLA path on the same bf16
inputs and fp32 maths on them: python bench/gpu_logprob_check.py. Prints max differences relative
to each reference's largest magnitude, then exits non-zero past the bf16 bounds of tests/test_logprob.py."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.ops import token_logprobs


def run(implementation, h, w, y, g_logp, g_entropy):
  def loss(h, w):
    logp, entropy = token_logprobs(h, w, y, return_entropy=True, implementation=implementation)
    return jnp.sum(g_logp * logp) + jnp.sum(g_entropy * entropy), (logp, entropy)
  step = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))
  start = time.perf_counter()
  out = jax.block_until_ready(step(h, w))
  first = time.perf_counter() - start
  start = time.perf_counter()
  jax.block_until_ready(step(h, w))
  (_, (logp, entropy)), (dh, dw) = out
  return [np.asarray(x, np.float64) for x in (logp, entropy, dh, dw)], first, time.perf_counter() - start


failed = False
for tokens, model, vocab in ((300, 100, 1000), (2048, 896, 151936), (512, 5120, 151936)):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.standard_normal((tokens, model)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((model, vocab)) * 2 / np.sqrt(model), jnp.bfloat16)
  y = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32).at[:2].set(jnp.asarray([vocab - 1, 0]))
  g_logp, g_entropy = (jnp.asarray(x, jnp.float32) for x in rng.standard_normal((2, tokens)))
  ours, first, again = run('pallas_mosaic_gpu', h, w, y, g_logp, g_entropy)
  xla, _, xla_again = run('xla_chunked', h, w, y, g_logp, g_entropy)
  print(f'T={tokens} D={model} V={vocab}: mosaic_gpu {first:.2f} s first call, {again * 1e3:.1f} ms again; '
        f'xla_chunked {xla_again * 1e3:.1f} ms', flush=True)
  for name, a, b in zip(('logp', 'entropy', 'dh', 'dW'), ours, xla):
    error = np.abs(a - b).max() / np.abs(b).max()
    bound = 1e-5 if name in ('logp', 'entropy') else 1e-2
    failed |= not error <= bound  # NaN fails too
    print(f'  {name}: max |mosaic_gpu - xla_chunked| / max |xla_chunked| = {error:.2e} (bound {bound:g})', flush=True)
sys.exit(1 if failed else 0)
