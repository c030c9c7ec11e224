"""The 'mosaic' (TPU) schedule of the Pallas log-prob kernels, and the VMEM sizing of its blocks.

Mosaic pipelines blocks through VMEM along the grid, so the reduction axis is the last grid axis,
marked 'arbitrary', and running statistics live in VMEM scratch across its steps. Blocks are
(8, 128)-aligned and D is taken whole, which makes VMEM, not registers, the limit: default blocks
are the largest whose buffers fit this TPU's VMEM (`mosaic_blocks`), and each call is compiled
with a matching scoped VMEM limit (`mosaic_vmem_limit`), so that a block too large is refused
here with a way out rather than by Mosaic's compiler. Padding and block checks are
logprob_pallas.py's; the tile maths is tiles.py's.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from grpo_jax.ops.tiles import (F32, CONTRACT_TOKENS, CONTRACT_VOCAB, dot_precision, finish_stats,
                                initial_stats, logit_gradient, update_stats)


# ---- kernels: reduction over the last grid axis, statistics in VMEM scratch ----

def _scaled_dot(h, w, inv_temperature):
  z = jnp.dot(h, w, preferred_element_type=F32, precision=dot_precision(h.dtype))
  return z if inv_temperature == 1.0 else z * inv_temperature


def _tile(h, w, y, col_start, vocab: int, inv_temperature: float):
  z = _scaled_dot(h, w, inv_temperature)
  col = col_start + lax.broadcasted_iota(jnp.int32, z.shape, 1)
  # Statically drop the mask when the vocabulary fills every block.
  valid = None if vocab % w.shape[1] == 0 else col < vocab
  return z, col == y, valid


def _forward_kernel(h_ref, w_ref, y_ref, logp_ref, lse_ref, *refs, vocab, inv_temperature,
                    with_entropy):
  entropy_ref, scratch = (refs[0], refs[1:]) if with_entropy else (None, refs)
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    for ref, value in zip(scratch, initial_stats(scratch[0].shape[0])):
      ref[...] = value

  block_vocab = w_ref.shape[1]
  z, hit, valid = _tile(h_ref[...], w_ref[...], y_ref[...], j * block_vocab, vocab,
                        inv_temperature)
  stats = update_stats(tuple(ref[...] for ref in scratch), z, hit, valid, with_entropy)
  for ref, value in zip(scratch, stats):
    ref[...] = value

  @pl.when(j == pl.num_programs(1) - 1)
  def _():
    logp, lse, entropy = finish_stats(stats)
    logp_ref[...] = logp
    lse_ref[...] = lse
    if with_entropy:
      entropy_ref[...] = entropy


def _backward_kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, *refs, vocab, inv_temperature,
                     with_entropy, grad_of):
  """grad_of='hidden': grid (token block i, vocab block j), accumulates dh over j.
  grad_of='weight': grid (vocab block j, token block i), accumulates dW over i."""
  if with_entropy:
    entropy_ref, g_entropy_ref, out_ref, acc_ref = refs
    entropy, g_entropy = entropy_ref[...], g_entropy_ref[...]
  else:
    out_ref, acc_ref = refs
    entropy = g_entropy = None
  vocab_axis, reduce_axis = (1, 1) if grad_of == 'hidden' else (0, 1)

  @pl.when(pl.program_id(reduce_axis) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  h, w = h_ref[...], w_ref[...]
  col_start = pl.program_id(vocab_axis) * w.shape[1]
  z, hit, valid = _tile(h, w, y_ref[...], col_start, vocab, inv_temperature)
  dz = logit_gradient(z, hit, valid, lse_ref[...], g_ref[...], entropy, g_entropy, inv_temperature)
  if grad_of == 'hidden':
    if valid is not None:
      # Padded W columns may be NaN, and 0 * NaN would leak into dh.
      w = jnp.where(col_start + lax.broadcasted_iota(jnp.int32, w.shape, 1) < vocab, w, 0)
    acc_ref[...] += lax.dot_general(dz.astype(w.dtype), w, CONTRACT_VOCAB,
                                    preferred_element_type=F32, precision=dot_precision(w.dtype))
  else:
    acc_ref[...] += lax.dot_general(h, dz.astype(h.dtype), CONTRACT_TOKENS,
                                    preferred_element_type=F32, precision=dot_precision(h.dtype))

  @pl.when(pl.program_id(reduce_axis) == pl.num_programs(reduce_axis) - 1)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


# ---- calls: h [T, D] and y [T, 1] padded to block_tokens, W [D, V] unpadded ----

def forward(h, w, y, *, block_tokens, block_vocab, inv_temperature, with_entropy, interpret):
  """-> logp, lse[, entropy], each [T, 1] fp32."""
  tokens, model = h.shape
  vocab = w.shape[1]
  vmem_limit = mosaic_vmem_limit(block_tokens, block_vocab, model, h.dtype.itemsize)
  token_spec = pl.BlockSpec((block_tokens, 1), lambda i, j: (i, 0))
  column = jax.ShapeDtypeStruct((tokens, 1), F32)
  outputs = 3 if with_entropy else 2
  kernel = functools.partial(_forward_kernel, vocab=vocab, inv_temperature=inv_temperature,
                             with_entropy=with_entropy)
  return pl.pallas_call(
      kernel,
      grid=(tokens // block_tokens, pl.cdiv(vocab, block_vocab)),
      in_specs=[pl.BlockSpec((block_tokens, model), lambda i, j: (i, 0)),
                pl.BlockSpec((model, block_vocab), lambda i, j: (0, j)), token_spec],
      out_specs=[token_spec] * outputs,
      out_shape=[column] * outputs,
      scratch_shapes=[pltpu.VMEM((block_tokens, 1), F32)] * 4,
      compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'arbitrary'),
                                           vmem_limit_bytes=vmem_limit),
      interpret=interpret,
      name='token_logprobs_forward',
  )(h, w, y)


def backward(h, w, token_columns, *, block_tokens, block_vocab, inv_temperature, with_entropy,
             interpret):
  """token_columns: y, lse, g_logp[, entropy, g_entropy], each [T, 1]. -> dh [T, D], dW [D, V]."""
  tokens, model = h.shape
  vocab = w.shape[1]
  vmem_limit = mosaic_vmem_limit(block_tokens, block_vocab, model, h.dtype.itemsize)
  token_grid, vocab_grid = tokens // block_tokens, pl.cdiv(vocab, block_vocab)
  kernel = functools.partial(_backward_kernel, vocab=vocab, inv_temperature=inv_temperature,
                             with_entropy=with_entropy)

  def call(grad_of, grid, index, out_spec, out_shape, acc_shape):
    """index(i, j) -> the grid indices, so one set of block specs serves both grid orders."""
    token_spec = pl.BlockSpec((block_tokens, 1), lambda *g: (index(*g)[0], 0))
    return pl.pallas_call(
        functools.partial(kernel, grad_of=grad_of),
        grid=grid,
        in_specs=[pl.BlockSpec((block_tokens, model), lambda *g: (index(*g)[0], 0)),
                  pl.BlockSpec((model, block_vocab), lambda *g: (0, index(*g)[1])),
                  *[token_spec] * len(token_columns)],
        out_specs=out_spec,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM(acc_shape, F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'arbitrary'),
                                             vmem_limit_bytes=vmem_limit),
        interpret=interpret,
        name=f'token_logprobs_grad_{grad_of}',
    )(h, w, *token_columns)

  dh = call('hidden', (token_grid, vocab_grid), lambda i, j: (i, j),
            pl.BlockSpec((block_tokens, model), lambda i, j: (i, 0)),
            jax.ShapeDtypeStruct(h.shape, h.dtype), (block_tokens, model))
  dw = call('weight', (vocab_grid, token_grid), lambda j, i: (i, j),
            pl.BlockSpec((model, block_vocab), lambda j, i: (0, j)),
            jax.ShapeDtypeStruct(w.shape, w.dtype), (model, block_vocab))
  return dh, dw


# ---- block sizes: what fits in VMEM ----

# VMEM per TensorCore in jax's TPU table: 16 MiB on v2-v4, 64 MiB on v5p and v7x, 128 MiB on v5e
# and v6e. Interpreted off a TPU, the kernels are sized for the smallest.
SMALLEST_VMEM = 16 << 20
# Default blocks use this share of VMEM, of at most BLOCK_VMEM_CAP; the rest is left to Mosaic
# (internal scratch, relayouts). Blocks of 256 x 256 already feed a v5e or v5p enough FLOPs per HBM
# byte (see mosaic_blocks); larger ones only made Mosaic spill registers into VMEM and compile
# slowly: sized from v5e's 128 MiB, D = 5,120 fp32 blocks needed 72 MiB of spill slots (143 MiB in
# all: refused) and the D = 3,584 kernels compiled in 40-70 s, against 1-5 s when sized from 16 MiB.
VMEM_SHARE = 0.75
BLOCK_VMEM_CAP = 32 << 20
LANES = 128  # VMEM tiles are (8, 128): a [rows, 1] block occupies [rows, 128]


def vmem_capacity() -> int:
  """VMEM bytes per TensorCore of the TPU compiled for (the mesh's devices, which may be a TPU
  topology compiled for from another host, else the default device), or of the smallest TPU when
  the target is not a TPU (interpret mode)."""
  try:
    return pltpu.get_tpu_info().vmem_capacity_bytes
  except ValueError:  # not a TPU
    return SMALLEST_VMEM


def mosaic_vmem_bytes(block_tokens: int, block_vocab: int, model: int, itemsize: int) -> int:
  """VMEM the largest of the three Mosaic kernels holds: its blocks, double-buffered by the
  pipeline, its accumulator scratch, and the fp32 temporaries of one logits tile (logits,
  exponentials, d logits and a cast: four [block_tokens, block_vocab] arrays) plus the masked
  copy of the W block that the dh kernel makes. itemsize is that of h and W."""
  hidden = block_tokens * model * itemsize
  weight = model * block_vocab * itemsize
  column = block_tokens * LANES * 4
  tile = 4 * block_tokens * block_vocab * 4 + weight
  forward = 2 * (hidden + weight + column) + 2 * 3 * column + 4 * column + tile
  streamed = 2 * (hidden + weight + 5 * column) + tile  # h, W, y, lse, g, entropy, g_entropy
  grad_hidden = streamed + 2 * hidden + block_tokens * model * 4
  grad_weight = streamed + 2 * weight + model * block_vocab * 4
  return max(forward, grad_hidden, grad_weight)


def mosaic_blocks(model: int, itemsize: int, capacity: int) -> tuple[int, int]:
  """Default (block_tokens, block_vocab): the largest pair whose blocks fit VMEM_SHARE of VMEM
  (of at most BLOCK_VMEM_CAP, unless no block fits under it).

  The forward and dh kernels read every W block once per token block, so each W byte from HBM
  feeds block_tokens multiply-adds; the dW kernel reads every h block once per vocabulary block
  (block_vocab). A TPU needs a few hundred FLOPs per HBM byte to be compute-bound (bf16 peak over
  HBM bandwidth: ~170 on v5p, ~240 on v5e, ~560 on v6e), so the smaller of the two blocks is
  maximised first, then the token block.
  """
  def candidates(budget):
    return [(tokens, vocab) for tokens in (1024, 512, 256, 128, 64, 32, 16, 8)
            for vocab in (1024, 512, 256, 128)
            if mosaic_vmem_bytes(tokens, vocab, model, itemsize) <= budget]

  # The cap yields to the whole share where nothing fits under it (D = 8,192 fp32 on a 64 MiB TPU).
  fitting = candidates(VMEM_SHARE * min(capacity, BLOCK_VMEM_CAP)) or candidates(VMEM_SHARE * capacity)
  if not fitting:
    raise ValueError(f'the Mosaic kernels take D={model} whole, and even (8, 128) blocks need '
                     f'{mosaic_vmem_bytes(8, 128, model, itemsize) / 2**20:.1f} MiB of the '
                     f'{capacity / 2**20:.0f} MiB of VMEM; use implementation=\'xla_chunked\'')
  return max(fitting, key=lambda blocks: (min(blocks), blocks[0]))


def mosaic_vmem_limit(block_tokens: int, block_vocab: int, model: int, itemsize: int) -> int:
  """The scoped VMEM limit the Mosaic kernels are compiled with: twice the blocks' estimate
  (headroom for Mosaic's own scratch), at least 16 MiB (the compiler's usual default), at most
  90% of the TPU's VMEM. Blocks over that are refused here, before Mosaic's compiler runs."""
  ceiling = vmem_capacity() * 9 // 10
  need = mosaic_vmem_bytes(block_tokens, block_vocab, model, itemsize)
  if need > ceiling:
    raise ValueError(f'mosaic blocks ({block_tokens}, {block_vocab}) at D={model} need about '
                     f'{need / 2**20:.1f} MiB of VMEM, more than the {ceiling / 2**20:.1f} MiB '
                     'a kernel may take on this TPU; pass smaller block_tokens / block_vocab')
  return min(ceiling, max(2 * need, 16 << 20))
