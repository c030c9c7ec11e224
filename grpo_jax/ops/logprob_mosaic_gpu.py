"""The 'mosaic_gpu' (GPU) schedule of the Pallas log-prob kernels, in Pallas's Mosaic GPU backend
(warpgroups, TMA copies, WGMMA), which replaced the 'triton' schedule (Pallas's Triton backend is
deprecated since jax 0.11).

One warpgroup per program, every grid axis parallel, each program looping over the reduction
axis itself with lax.fori_loop (as the Triton schedule did):
  forward  grid (token block): for each vocabulary tile, the logits tile is the sum over D of
           [block_tokens, block_model] x [block_model, block_vocab] products, each pair of slices
           TMA-copied into shared memory, then folded into the running statistics (tiles.py).
  dh       grid (token block, D group): for each vocabulary tile, the logits tile again, its
           d logits, and d logits @ W[group, tile]^T into fp32 accumulators in registers.
  dW       grid (vocabulary tile, D group): for each token block, the logits tile, its d logits
           (staged in shared memory) and h[block, group]^T @ d logits.
Shared memory holds one h slice, one W slice and (dW) one d logits tile whatever D is: 40 KiB at
the default (64, 128, 64) blocks in bf16, far below an H100's 227 KiB per block. The D groups
keep the register accumulators within MOSAIC_GPU_ACCUMULATOR_BYTES (`model_groups`); each group
recomputes the logits tiles over the whole of D. No double-buffering yet: this is the simple,
correct schedule, not a tuned one.

The vocabulary is rarely a multiple of the tile (151,936 = 2^7 x 1187), and padding W along V
would copy it, so the last tile starts at V - block_vocab instead (as the XLA path's last chunk
and the decode-attention kernel's last block do): TMA never reads past the array. Its columns
already seen by an earlier tile are masked out of the statistics and dh; dW writes them again,
with the same values. W narrower than a tile, or whose rows are not a multiple of 16 bytes (TMA's
stride alignment), is padded along V with zero columns, which are masked too. D arrives padded to
a multiple of block_model and h to one of block_tokens (logprob_pallas.py).

On a GPU h and W must be 16-bit: WGMMA transposes only 16-bit operands (the backward products
take W and h transposed; Mosaic GPU refused fp32 there), and would multiply fp32 as TF32, far from
the true fp32 products the other schedules give. In interpret mode (CPU) the products are plain
dots in any dtype, as the GPU interpreter has no WGMMA.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from grpo_jax.ops.tiles import (F32, CONTRACT_TOKENS, CONTRACT_VOCAB, dot_precision, finish_stats,
                                initial_stats, logit_gradient, update_stats)

SWIZZLE = 128  # bytes: the shared-memory swizzle of every tile
# A warpgroup's register file share: 128 threads x 255 registers x 4 bytes is 128 KiB; half of it for
# the backward kernels' fp32 accumulators.
MOSAIC_GPU_ACCUMULATOR_BYTES = 64 << 10


def model_groups(slices: int, block: int, block_model: int) -> int:
  """How many D groups a backward kernel splits D's `slices` block_model-wide slices into: the fewest
  that divide them evenly and keep a [block, group width] fp32 accumulator within
  MOSAIC_GPU_ACCUMULATOR_BYTES (block is block_tokens for dh, block_vocab for dW)."""
  per_group = max(1, MOSAIC_GPU_ACCUMULATOR_BYTES // (block * block_model * 4))
  return next(groups for groups in range(1, slices + 1)
              if slices % groups == 0 and slices // groups <= per_group)


def _smem(shape, dtype):
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(SWIZZLE, shape[-1] * itemsize)
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                              plgpu.SwizzleTransform(swizzle)))


def _tile_start(j, block_vocab, width):
  """First column of vocabulary tile j: a tile past W's width starts at width - block_vocab."""
  return jnp.minimum(j * block_vocab, width - block_vocab)


def _column(ref, rows):
  """Per-token values [block_tokens] fp32 / int32 from GMEM, in the layout of a WGMMA tile's rows."""
  return plgpu.load(ref.at[rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def _broadcast_rows(column, shape):
  return lax.broadcast_in_dim(column, shape, [0])


class _Tiles:
  """Shared-memory buffers and the logits-tile product of one program."""

  def __init__(self, h_ref, w_ref, h_smem, w_smem, barriers, *, block_model, inv_temperature,
               interpret):
    self.h_ref, self.w_ref, self.h_smem, self.w_smem = h_ref, w_ref, h_smem, w_smem
    self.barriers, self.block_model = barriers, block_model
    self.inv_temperature, self.interpret = inv_temperature, interpret
    self.slices = h_ref.shape[1] // block_model

  def model_slice(self, k):
    return pl.ds(pl.multiple_of(k * self.block_model, self.block_model), self.block_model)

  def fetch_h(self, rows, k):
    plgpu.copy_gmem_to_smem(self.h_ref.at[rows, self.model_slice(k)], self.h_smem, self.barriers.at[0])
    plgpu.barrier_wait(self.barriers.at[0])

  def fetch_w(self, k, columns):
    plgpu.copy_gmem_to_smem(self.w_ref.at[self.model_slice(k), columns], self.w_smem, self.barriers.at[1])
    plgpu.barrier_wait(self.barriers.at[1])

  def logits(self, rows, columns):
    """z = (h[rows] @ W[:, columns]) / temperature, [block_tokens, block_vocab] fp32, in the WGMMA
    layout. Each step copies one D slice of both operands and waits for its product before the
    next copy overwrites them."""
    shape = (self.h_smem.shape[0], self.w_smem.shape[1])

    def step(k, acc):
      self.fetch_h(rows, k)
      self.fetch_w(k, columns)
      if self.interpret:  # the GPU interpreter has no WGMMA: the same product on the tiles' values
        hk, wk = self.h_smem[...], self.w_smem[...]
        return acc + jnp.dot(hk, wk, preferred_element_type=F32, precision=dot_precision(hk.dtype))

      def product(acc_ref):
        plgpu.wgmma(acc_ref, self.h_smem, self.w_smem)
        plgpu.wgmma_wait(0)
      return pl.run_state(product)(plgpu.ACC.init(acc))

    z = lax.fori_loop(0, self.slices, step, plgpu.layout_cast(jnp.zeros(shape, F32), plgpu.Layout.WGMMA))
    return z * self.inv_temperature if self.inv_temperature != 1.0 else z


def _column_ids(start, shape):
  return start + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)


def _store_tile(value, smem, gmem):
  smem[...] = value.astype(smem.dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem, gmem)
  plgpu.wait_smem_to_gmem(0)  # the buffer is rewritten next


# ---- kernels ----

def _forward_kernel(h_ref, w_ref, y_ref, logp_ref, lse_ref, *refs, vocab, block_tokens, block_vocab,
                    block_model, inv_temperature, with_entropy, interpret):
  entropy_ref = refs[0] if with_entropy else None
  h_smem, w_smem, barriers = refs[-3:]
  tiles = _Tiles(h_ref, w_ref, h_smem, w_smem, barriers, block_model=block_model,
                 inv_temperature=inv_temperature, interpret=interpret)
  rows = pl.ds(pl.multiple_of(lax.axis_index('tokens') * block_tokens, block_tokens), block_tokens)
  shape = (block_tokens, block_vocab)
  y = _broadcast_rows(_column(y_ref, rows), shape)

  def step(j, stats):
    start = _tile_start(j, block_vocab, w_ref.shape[1])
    z = tiles.logits(rows, pl.ds(start, block_vocab))
    cols = _column_ids(start, shape)
    valid = (cols >= j * block_vocab) & (cols < vocab)
    return update_stats(stats, z, valid & (cols == y), valid, with_entropy)

  stats = tuple(plgpu.layout_cast(stat, plgpu.Layout.WGMMA.reduce(1))
                for stat in initial_stats(block_tokens, keepdims=False))
  stats = lax.fori_loop(0, pl.cdiv(vocab, block_vocab), step, stats)
  logp, lse, entropy = finish_stats(stats)
  for ref, value in zip((logp_ref, lse_ref, entropy_ref), (logp, lse, entropy)):
    if ref is not None:  # a [block_tokens] fp32 column: no TMA store for it (GMEM loads and stores need
      plgpu.store(ref.at[rows], value, optimized=False)  # optimized=False for 1-D columns)


def _backward_kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, *refs, grad_of, vocab, block_tokens,
                     block_vocab, block_model, group_slices, inv_temperature, with_entropy, interpret):
  """grad_of='hidden': program (token block i, D group g) owns dh[i, g] and loops over the vocabulary.
  grad_of='weight': program (vocabulary tile j, D group g) owns dW[g, j] and loops over tokens. A D
  group is `group_slices` block_model-wide slices of D, a tuple of fp32 accumulators."""
  entropy_ref, g_entropy_ref = refs[:2] if with_entropy else (None, None)
  out_ref, h_smem, w_smem, dz_smem, barriers = refs[-5:]
  tiles = _Tiles(h_ref, w_ref, h_smem, w_smem, barriers, block_model=block_model,
                 inv_temperature=inv_temperature, interpret=interpret)
  width = w_ref.shape[1]
  shape = (block_tokens, block_vocab)
  first_slice = lax.axis_index('group') * group_slices
  slices = range(group_slices)

  def token_columns(rows):
    """y, lse, g_logp[, entropy, g_entropy] of the rows, each broadcast to the tile's shape."""
    refs = (y_ref, lse_ref, g_ref) + ((entropy_ref, g_entropy_ref) if with_entropy else ())
    return [_broadcast_rows(_column(ref, rows), shape) for ref in refs]

  def tile_gradient(rows, start, valid, columns):
    z = tiles.logits(rows, pl.ds(start, block_vocab))
    cols = _column_ids(start, shape)
    y, lse, g_logp, *extra = columns
    return logit_gradient(z, cols == y, valid(cols), lse, g_logp, *extra,
                          inv_temperature=inv_temperature)

  if grad_of == 'hidden':
    rows = pl.ds(pl.multiple_of(lax.axis_index('block') * block_tokens, block_tokens), block_tokens)
    per_token = token_columns(rows)  # read once: the program's rows are fixed

    def step(j, acc):
      start = _tile_start(j, block_vocab, width)
      columns = pl.ds(start, block_vocab)
      # Columns an earlier tile covered (the shifted last tile) or past V count once / not at all.
      dz = tile_gradient(rows, start, lambda cols: (cols >= j * block_vocab) & (cols < vocab), per_token)
      dz = dz.astype(w_ref.dtype)
      new = []
      for k, a in zip(slices, acc):
        tiles.fetch_w(first_slice + k, columns)
        if interpret:
          wk = w_smem[...]
          new.append(a + lax.dot_general(dz, wk, CONTRACT_VOCAB, preferred_element_type=F32,
                                         precision=dot_precision(wk.dtype)))
        else:
          def product(acc_ref):
            plgpu.wgmma(acc_ref, dz, w_smem.T)
            plgpu.wgmma_wait(0)
          new.append(pl.run_state(product)(plgpu.ACC.init(a)))
      return tuple(new)

    zeros = plgpu.layout_cast(jnp.zeros((block_tokens, block_model), F32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, pl.cdiv(vocab, block_vocab), step, (zeros,) * group_slices)
    for k, a in zip(slices, acc):  # through h's buffer (same shape and dtype), TMA-copied out
      _store_tile(a, h_smem, out_ref.at[rows, tiles.model_slice(first_slice + k)])
  else:
    start = _tile_start(lax.axis_index('block'), block_vocab, width)
    columns = pl.ds(start, block_vocab)

    def step(i, acc):
      rows = pl.ds(pl.multiple_of(i * block_tokens, block_tokens), block_tokens)
      dz = tile_gradient(rows, start, lambda cols: cols < vocab, token_columns(rows))
      dz_smem[...] = dz.astype(h_ref.dtype)
      plgpu.commit_smem()
      new = []
      for k, a in zip(slices, acc):
        tiles.fetch_h(rows, first_slice + k)
        if interpret:
          hk = h_smem[...]
          new.append(a + lax.dot_general(hk, dz_smem[...], CONTRACT_TOKENS, preferred_element_type=F32,
                                         precision=dot_precision(hk.dtype)))
        else:
          def product(acc_ref):
            plgpu.wgmma(acc_ref, h_smem.T, dz_smem)
            plgpu.wgmma_wait(0)
          new.append(pl.run_state(product)(plgpu.ACC.init(a)))
      return tuple(new)

    zeros = plgpu.layout_cast(jnp.zeros((block_model, block_vocab), F32), plgpu.Layout.WGMMA)
    acc = lax.fori_loop(0, h_ref.shape[0] // block_tokens, step, (zeros,) * group_slices)
    for k, a in zip(slices, acc):  # through W's buffer
      _store_tile(a, w_smem, out_ref.at[tiles.model_slice(first_slice + k), columns])


# ---- calls: h [T, D] padded to (block_tokens, block_model), W [D, V] along D ----

def _call(kernel, grid, grid_names, out_type, scratch, interpret, name, *args):
  def entry(*refs):
    pl.run_scoped(lambda *buffers: kernel(*refs, *buffers), *scratch)

  return plgpu.kernel(entry, out_type=out_type, grid=grid, grid_names=grid_names,
                      interpret=plgpu.InterpretGPUParams() if interpret else None,
                      compiler_params=plgpu.CompilerParams(), kernel_name=name)(*args)


def _check_dtype(dtype, interpret):
  if not interpret and jnp.dtype(dtype).itemsize != 2:
    raise ValueError(f'mosaic_gpu log-prob kernels take 16-bit h and W on a GPU (WGMMA transposes only '
                     f'16-bit operands), got {jnp.dtype(dtype).name}; use xla_chunked for fp32')


def _pad_vocab(w, block_vocab):
  """W padded with zero columns where TMA needs it: to one whole tile, and to rows of 16 bytes."""
  multiple = 16 // jnp.dtype(w.dtype).itemsize
  width = max(block_vocab, -(-w.shape[1] // multiple) * multiple)
  return w if width == w.shape[1] else jnp.pad(w, ((0, 0), (0, width - w.shape[1])))


def _scratch(dtype, block_tokens, block_vocab, block_model, backward_of=None):
  buffers = [_smem((block_tokens, block_model), dtype), _smem((block_model, block_vocab), dtype)]
  if backward_of is not None:
    buffers.append(_smem((block_tokens, block_vocab), dtype))
  return buffers + [plgpu.Barrier(num_barriers=2)]


def forward(h, w, y, *, block_tokens, block_vocab, block_model, inv_temperature, with_entropy,
            interpret):
  """y [T, 1] int32 -> logp, lse[, entropy], each [T, 1] fp32."""
  _check_dtype(h.dtype, interpret)
  vocab, tokens = w.shape[1], h.shape[0]
  kernel = functools.partial(_forward_kernel, vocab=vocab, block_tokens=block_tokens,
                             block_vocab=block_vocab, block_model=block_model,
                             inv_temperature=inv_temperature, with_entropy=with_entropy,
                             interpret=interpret)
  column = jax.ShapeDtypeStruct((tokens,), F32)
  outputs = _call(kernel, (tokens // block_tokens,), ('tokens',), [column] * (3 if with_entropy else 2),
                  _scratch(h.dtype, block_tokens, block_vocab, block_model), interpret,
                  'token_logprobs_forward', h, _pad_vocab(w, block_vocab), y[:, 0])
  return [output[:, None] for output in outputs]


def backward(h, w, token_columns, *, block_tokens, block_vocab, block_model, inv_temperature,
             with_entropy, interpret):
  """token_columns: y, lse, g_logp[, entropy, g_entropy], each [T, 1]. -> dh [T, D], dW [D, V]."""
  _check_dtype(h.dtype, interpret)
  vocab = w.shape[1]
  padded = _pad_vocab(w, block_vocab)
  slices = h.shape[1] // block_model
  blocks = {'hidden': (h.shape[0] // block_tokens, block_tokens),
            'weight': (pl.cdiv(vocab, block_vocab), block_vocab)}
  shapes = {'hidden': h.shape, 'weight': padded.shape}
  columns = [column[:, 0] for column in token_columns]
  outputs = []
  for grad_of in ('hidden', 'weight'):
    programs, block = blocks[grad_of]
    groups = model_groups(slices, block, block_model)
    kernel = functools.partial(
        _backward_kernel, grad_of=grad_of, vocab=vocab, block_tokens=block_tokens,
        block_vocab=block_vocab, block_model=block_model, group_slices=slices // groups,
        inv_temperature=inv_temperature, with_entropy=with_entropy, interpret=interpret)
    outputs.append(_call(
        kernel, (programs, groups), ('block', 'group'), jax.ShapeDtypeStruct(shapes[grad_of], h.dtype),
        _scratch(h.dtype, block_tokens, block_vocab, block_model, grad_of), interpret,
        f'token_logprobs_grad_{grad_of}', h, padded, *columns))
  dh, dw = outputs
  return dh, dw[:, :vocab]
