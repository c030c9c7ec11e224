"""The 'triton' (GPU) schedule of the Pallas log-prob kernels, and its register budget.

Triton runs every grid axis in parallel and has no scratch that persists across programs, so
each program loops over the reduction axis itself with lax.fori_loop and masked loads. Every
loaded tile must have power-of-two sides, so D is walked in `block_model` slices (D arrives
padded to a multiple of it, and padded columns read as zeros). The backward kernels' accumulators
live in registers, so wide models split D into groups on a second grid axis, each recomputing
the logits tiles (`triton_model_groups`). Padding and block checks are logprob_pallas.py's; the
tile maths is tiles.py's.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from grpo_jax.ops.tiles import (F32, CONTRACT_TOKENS, CONTRACT_VOCAB, dot_precision, finish_stats,
                                initial_stats, logit_gradient, update_stats)

# The backward kernels' fp32 accumulators per program are capped at half the 256 KiB register
# file of an A100 / H100 streaming multiprocessor; wider ones would spill to local memory.
TRITON_ACCUMULATOR_BYTES = 128 << 10


def triton_model_groups(slices: int, block: int, block_model: int) -> int:
  """How many D groups a backward kernel splits its `slices` block_model-wide slices of D into:
  the fewest that divide them evenly and keep a [block, group width] fp32 accumulator within
  TRITON_ACCUMULATOR_BYTES (block is block_tokens for dh, block_vocab for dW). One group up to
  D = 1024 at 32-wide blocks (Qwen2.5-0.5B's 896); 7B's 3584 takes 4."""
  per_group = max(1, TRITON_ACCUMULATOR_BYTES // (block * block_model * 4))
  return next(groups for groups in range(1, slices + 1)
              if slices % groups == 0 and slices // groups <= per_group)


# ---- kernels: every grid axis parallel, each program loops over the reduction ----

def _masked_load(ref, mask):
  """Zero-fills where mask is False; an unmasked load when there is nothing to mask."""
  return ref[...] if mask is None else pltriton.load(ref, mask=mask, other=0)


def _tile(h_ref, w_ref, y, rows, col_start, *, vocab, block_vocab, block_model, inv_temperature):
  """Logits tile [block_tokens, block_vocab] fp32 with its target and validity masks.

  D arrives padded to a multiple of block_model, so only vocabulary columns need masks; the
  masked load zero-fills them and `update_stats` / `logit_gradient` exclude them.
  """
  block_tokens = y.shape[0]
  cols = col_start + jnp.arange(block_vocab)[None, :]
  valid = None if vocab % block_vocab == 0 else cols < vocab
  column_slice = pl.ds(col_start, block_vocab)

  def step(k, acc):
    start = pl.multiple_of(k * block_model, block_model)
    hk = h_ref[rows, pl.ds(start, block_model)]
    wk = _masked_load(w_ref.at[pl.ds(start, block_model), column_slice], valid)
    return acc + jnp.dot(hk, wk, preferred_element_type=F32, precision=dot_precision(hk.dtype))

  z = lax.fori_loop(0, h_ref.shape[1] // block_model, step,
                    jnp.zeros((block_tokens, block_vocab), F32))
  if inv_temperature != 1.0:
    z = z * inv_temperature
  return z, cols == y, valid


def _forward_kernel(h_ref, w_ref, y_ref, logp_ref, lse_ref, *entropy_ref, vocab, block_tokens,
                    block_vocab, block_model, inv_temperature, with_entropy):
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_tokens, block_tokens), block_tokens)
  y = y_ref[rows, :]

  def step(j, stats):
    col_start = pl.multiple_of(j * block_vocab, block_vocab)
    z, hit, valid = _tile(h_ref, w_ref, y, rows, col_start, vocab=vocab, block_vocab=block_vocab,
                          block_model=block_model, inv_temperature=inv_temperature)
    return update_stats(stats, z, hit, valid, with_entropy)

  stats = lax.fori_loop(0, pl.cdiv(vocab, block_vocab), step, initial_stats(block_tokens))
  logp, lse, entropy = finish_stats(stats)
  logp_ref[rows, :] = logp
  lse_ref[rows, :] = lse
  if with_entropy:
    entropy_ref[0][rows, :] = entropy


def _backward_kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, *refs, grad_of, vocab, block_tokens,
                     block_vocab, block_model, group_slices, inv_temperature, with_entropy):
  """grad_of='hidden': program (i, g) owns the dh rows of token block i in D group g, and loops
  over the vocabulary. grad_of='weight': program (j, g) owns the dW columns of vocab block j in
  D group g, and loops over tokens. A D group is `group_slices` block_model-wide slices of D,
  held as a tuple of fp32 accumulators (Triton tiles cannot be updated in place, and D, e.g. 896,
  is rarely a power of two). Every group recomputes the full logits tile (a contraction over all
  of D), so more groups cost more FLOPs; they exist to keep the accumulators in registers."""
  entropy_ref, g_entropy_ref, out_ref = refs if with_entropy else (None, None, refs[0])
  slices = range(group_slices)
  first_slice = pl.program_id(1) * group_slices
  tile = functools.partial(_tile, h_ref, w_ref, vocab=vocab, block_vocab=block_vocab,
                           block_model=block_model, inv_temperature=inv_temperature)

  def tile_gradient(rows, col_start):
    z, hit, valid = tile(y_ref[rows, :], rows, col_start)
    extra = (entropy_ref[rows, :], g_entropy_ref[rows, :]) if with_entropy else ()
    return logit_gradient(z, hit, valid, lse_ref[rows, :], g_ref[rows, :], *extra,
                          inv_temperature=inv_temperature), valid

  def model_slice(k):
    return pl.ds(pl.multiple_of((first_slice + k) * block_model, block_model), block_model)

  if grad_of == 'hidden':
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_tokens, block_tokens), block_tokens)

    def step(j, acc):
      col_start = pl.multiple_of(j * block_vocab, block_vocab)
      dz, valid = tile_gradient(rows, col_start)
      dz = dz.astype(w_ref.dtype)
      # Zero-filled, not garbage, past the vocabulary: dz is 0 there and 0 * NaN must not occur.
      w_tiles = [_masked_load(w_ref.at[model_slice(k), pl.ds(col_start, block_vocab)], valid)
                 for k in slices]
      return tuple(a + lax.dot_general(dz, wk, CONTRACT_VOCAB, preferred_element_type=F32,
                                       precision=dot_precision(wk.dtype))
                   for a, wk in zip(acc, w_tiles))

    acc = lax.fori_loop(0, pl.cdiv(vocab, block_vocab), step,
                        tuple(jnp.zeros((block_tokens, block_model), F32) for _ in slices))
    for k, a in zip(slices, acc):
      out_ref[rows, model_slice(k)] = a.astype(out_ref.dtype)
  else:
    col_start = pl.multiple_of(pl.program_id(0) * block_vocab, block_vocab)

    def step(i, acc):
      rows = pl.ds(pl.multiple_of(i * block_tokens, block_tokens), block_tokens)
      dz, _ = tile_gradient(rows, col_start)
      dz = dz.astype(h_ref.dtype)
      return tuple(a + lax.dot_general(h_ref[rows, model_slice(k)], dz, CONTRACT_TOKENS,
                                       preferred_element_type=F32,
                                       precision=dot_precision(h_ref.dtype))
                   for k, a in zip(slices, acc))

    acc = lax.fori_loop(0, h_ref.shape[0] // block_tokens, step,
                        tuple(jnp.zeros((block_model, block_vocab), F32) for _ in slices))
    cols = col_start + jnp.arange(block_vocab)[None, :]
    mask = None if vocab % block_vocab == 0 else jnp.broadcast_to(cols < vocab,
                                                                  (block_model, block_vocab))
    for k, a in zip(slices, acc):
      pltriton.store(out_ref.at[model_slice(k), pl.ds(col_start, block_vocab)],
                     a.astype(out_ref.dtype), mask=mask)


# ---- calls: h [T, D] padded to (block_tokens, block_model), W [D, V] along D only ----

def _call(kernel, grid, out_shape, interpret, name, num_warps):
  return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                        compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                                                num_stages=2))


def forward(h, w, y, *, block_tokens, block_vocab, block_model, inv_temperature, with_entropy,
            interpret):
  """-> logp, lse[, entropy], each [T, 1] fp32."""
  kernel = functools.partial(_forward_kernel, vocab=w.shape[1], block_tokens=block_tokens,
                             block_vocab=block_vocab, block_model=block_model,
                             inv_temperature=inv_temperature, with_entropy=with_entropy)
  column = jax.ShapeDtypeStruct((h.shape[0], 1), F32)
  return _call(kernel, (h.shape[0] // block_tokens,), [column] * (3 if with_entropy else 2),
               interpret, 'token_logprobs_forward', num_warps=4)(h, w, y)


def backward(h, w, token_columns, *, block_tokens, block_vocab, block_model, inv_temperature,
             with_entropy, interpret):
  """token_columns: y, lse, g_logp[, entropy, g_entropy], each [T, 1]. -> dh [T, D], dW [D, V]."""
  slices = h.shape[1] // block_model
  blocks = {'hidden': (h.shape[0] // block_tokens, block_tokens),
            'weight': (pl.cdiv(w.shape[1], block_vocab), block_vocab)}
  shapes = {'hidden': h, 'weight': w}
  outputs = []
  for grad_of in ('hidden', 'weight'):
    programs, block = blocks[grad_of]
    groups = triton_model_groups(slices, block, block_model)
    kernel = functools.partial(
        _backward_kernel, grad_of=grad_of, vocab=w.shape[1], block_tokens=block_tokens,
        block_vocab=block_vocab, block_model=block_model, group_slices=slices // groups,
        inv_temperature=inv_temperature, with_entropy=with_entropy)
    outputs.append(_call(
        kernel, (programs, groups),
        jax.ShapeDtypeStruct(shapes[grad_of].shape, shapes[grad_of].dtype), interpret,
        f'token_logprobs_grad_{grad_of}', num_warps=8)(h, w, *token_columns))
  return tuple(outputs)
