"""Online-softmax maths over one logits tile, shared by every fused log-prob implementation.

Tokens are flattened (batch folded into T). For hidden h [T, D], lm_head W [D, V] and targets
y [T], a fused implementation computes one tile of logits z = (h @ W) / temperature at a time and
folds it into per-token running statistics, so only [T] vectors outlive a tile:

  logp [T] = z_y - lse        entropy [T] = lse - sum_v p_v z_v,  lse = log sum_v exp(z_v)

The backward pass recomputes each tile from h, W and the saved lse (and entropy) and forms
d z = g_logp (onehot(y) - p) - g_entropy p (log p + entropy).

The XLA chunked path (logprob.py) and the Pallas kernels (logprob_mosaic.py, logprob_mosaic_gpu.py)
call the same functions here, so they agree by construction rather than by parallel edits. This
module imports only jax itself: the default XLA path must not pull in Pallas TPU or Mosaic GPU.
"""

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
# Transposed-operand contractions: 'TV,DV->TD' (dh) and 'TD,TV->DV' (dW).
CONTRACT_VOCAB = (((1,), (1,)), ((), ()))
CONTRACT_TOKENS = (((0,), (0,)), ((), ()))


def dot_precision(dtype):
  """fp32 inputs get true fp32 products: by default TPUs multiply fp32 in bf16 passes and GPUs
  in TF32, both far from the 1e-5 agreement the fp32 path is tested to."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def initial_stats(rows: int, keepdims: bool = True):
  """(running max, running sum of exp, entropy term, target logit), each [rows, 1] fp32, or [rows]
  without keepdims (Mosaic GPU, whose register layouts have no [rows, 1] shape: a tile's row
  statistics are 1-D there, broadcast back along the tile's rows)."""
  shape = (rows, 1) if keepdims else (rows,)
  zeros = jnp.zeros(shape, F32)
  return jnp.full(shape, -jnp.inf, F32), zeros, zeros, zeros


def _row_sum(x, keepdims: bool, op=jnp.sum):
  return op(x, axis=1, keepdims=keepdims)


def _along_rows(stat, shape):
  """A [T, 1] statistic as it is; a [T] one broadcast to the tile's [T, V'] shape."""
  return stat if stat.ndim == 2 else lax.broadcast_in_dim(stat, shape, [0])


def update_stats(stats, z, hit, valid, with_entropy: bool):
  """Folds one logits tile z [T, V'] into the running statistics.

  hit [T, V'] marks each token's target column, valid [T, V'] (or None) the real vocabulary
  columns. The statistics are [T, 1] or, from initial_stats(keepdims=False), [T]. The entropy
  term is kept as sum exp(z - m) (z - m) relative to the running max m, not as sum p z, so that
  large logits do not cancel in lse - sum p z.
  """
  running_max, running_sum, entropy_term, target_logit = stats
  keepdims = running_max.ndim == 2
  if valid is not None:
    z = jnp.where(valid, z, -jnp.inf)
  new_max = jnp.maximum(running_max, _row_sum(z, keepdims, jnp.max))
  scale = jnp.exp(running_max - new_max)
  shifted = z - _along_rows(new_max, z.shape)
  exps = jnp.exp(shifted)
  target_logit = target_logit + _row_sum(jnp.where(hit, z, 0.0), keepdims)
  if with_entropy:
    shifted = shifted if valid is None else jnp.where(valid, shifted, 0.0)
    # Rebasing sum exp(z - m)(z - m) onto the new max adds sum_so_far * (m - m_new); the first
    # tile starts from m = -inf, where that product is 0 * inf, hence the guard.
    rebased = scale * (entropy_term + running_sum * (running_max - new_max))
    entropy_term = jnp.where(scale > 0, rebased, 0.0) + _row_sum(exps * shifted, keepdims)
  running_sum = scale * running_sum + _row_sum(exps, keepdims)
  return new_max, running_sum, entropy_term, target_logit


def finish_stats(stats):
  """-> logp, lse, entropy, each [T, 1] fp32 ([T] from 1-D statistics)."""
  running_max, running_sum, entropy_term, target_logit = stats
  log_sum = jnp.log(running_sum)
  lse = running_max + log_sum
  return target_logit - lse, lse, log_sum - entropy_term / running_sum


def logit_gradient(z, hit, valid, lse, g_logp, entropy=None, g_entropy=None, inv_temperature=1.0):
  """d loss / d (h @ W) for one tile, [T, V'] fp32; zero outside `valid`.

  With p = softmax(z) and H = lse - sum p z:  d logp_y / d z_j = onehot_j - p_j and
  d H / d z_j = -p_j (z_j - sum p z) = -p_j (log p_j + H). z is (h @ W) / temperature, hence the
  final factor.
  """
  log_p = z - lse
  p = jnp.exp(log_p)
  dz = jnp.where(hit, g_logp, 0.0) - g_logp * p
  if entropy is not None:
    dz = dz - g_entropy * p * (log_p + entropy)
  if inv_temperature != 1.0:
    dz = dz * inv_temperature
  # A select, not a product: columns past the vocabulary may hold NaN (padding of an edge block).
  return dz if valid is None else jnp.where(valid, dz, 0.0)


def row_blocks(length, block: int):
  """How many cache blocks a row of `length` written slots reads: ceil(length / block), 0 when it
  is empty. Works on Python ints, NumPy and traced values alike."""
  return (length + block - 1) // block
