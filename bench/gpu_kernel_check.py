"""The ragged decode-attention kernel's Mosaic GPU schedule compiled and run on the GPU at hand,
against NumPy: the 0.5B recipe's shape (14 query heads on 2 kv heads of 64, a 1,024-slot cache)
and a 7B-like one (28 on 4 of 128), rows of 0, a few and nearly all slots, bf16, and its time per
call.

  python bench/gpu_kernel_check.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.ops import decode_attention_mosaic_gpu


def numpy_attention(q, k, v, length, scale):
  """q [N, H], k, v [S, K, H]: each query head over its kv head's first `length` slots."""
  heads, kv_heads = q.shape[0], k.shape[1]
  out = np.zeros(q.shape, np.float64)
  for n in range(heads):
    s = q[n].astype(np.float64) @ k[:length, n // (heads // kv_heads)].astype(np.float64).T * scale
    p = np.exp(s - s.max())
    out[n] = (p / p.sum()) @ v[:length, n // (heads // kv_heads)].astype(np.float64)
  return out


def check(name, rows, heads, kv_heads, head_dim, slots, block, layers=2):
  rng = np.random.default_rng(0)
  group = heads // kv_heads
  lengths = np.asarray([0, 7, slots - 3, slots // 2][:rows], np.int32)
  q = jnp.asarray(rng.standard_normal((rows, kv_heads, group, head_dim)), jnp.bfloat16)  # head n = k * G + g
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((layers, rows, slots, kv_heads, head_dim)), jnp.bfloat16)
                      for _ in range(2))
  scale = head_dim ** -0.5
  args = (q, k_cache, v_cache, jnp.asarray([1], jnp.int32), jnp.asarray(lengths), jnp.ones((rows, slots), jnp.int32),
          jnp.asarray(np.repeat(lengths[:, None], group, 1)), jnp.ones((rows, group), jnp.int32))
  kernel = jax.jit(lambda *a: decode_attention_mosaic_gpu.cache_stats(*a, block=block, scale=scale, interpret=False))
  _, l, acc = (np.asarray(x, np.float64) for x in kernel(*args))  # l [B, K, G], acc [B, K, G, H]
  worst = 0.0
  for b in range(rows):
    if lengths[b] == 0:
      assert not l[b].any(), f'{name}: row {b} has no slots, yet its sum is {l[b].max()}'
      continue
    want = numpy_attention(np.asarray(q[b], np.float32).reshape(heads, head_dim), np.asarray(k_cache[1, b], np.float32),
                           np.asarray(v_cache[1, b], np.float32), lengths[b], scale)
    got = (acc[b] / l[b][..., None]).reshape(heads, head_dim)
    worst = max(worst, float(np.abs(got - want).max()))
  jax.block_until_ready(kernel(*args))
  start = time.perf_counter()
  for _ in range(20):
    out = kernel(*args)
  jax.block_until_ready(out)
  per_call = (time.perf_counter() - start) / 20
  print(f'{name}: {rows} rows, {heads}/{kv_heads} heads of {head_dim}, {slots} slots, block {block}: '
        f'max |difference| {worst:.2e} against NumPy, {per_call * 1e6:.0f} us per call', flush=True)
  assert worst < 3e-2, (name, worst)


def main():
  print(jax.__version__, jax.devices())
  check('0.5B recipe', 4, 14, 2, 64, 1024, 64)
  check('7B-like', 4, 28, 4, 128, 2048, 64)
  print('ok')


if __name__ == '__main__':
  main()
