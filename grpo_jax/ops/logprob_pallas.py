"""Pallas kernels for token log-probs and entropy that never hold a [T, V] logits array.

Tokens are flattened (batch folded into T). For hidden h [T, D], lm_head W [D, V] and targets
y [T], a kernel computes one tile of logits z = (h @ W) / temperature at a time and folds it into
per-token running statistics (online softmax), so only [T] vectors leave the chip:

  logp [T] = z_y - lse        entropy [T] = lse - sum_v p_v z_v,  lse = log sum_v exp(z_v)

The backward pass recomputes each tile from h, W and the saved lse (and entropy), forms
d z = g_logp (onehot(y) - p) - g_entropy p (log p + entropy), and contracts it with W (dh) and
h (dW). dh sums over the vocabulary and dW over tokens, so each gets its own kernel whose grid
owns one output tile and loops over the other axis: the logits are computed three times in total
(as flash attention does for dq and dk/dv), but no kernel needs atomics or a [T, V] buffer.

Two schedules share the tile maths:
  'mosaic'  (TPU) the reduction axis is the last grid axis, marked 'arbitrary', and running
            statistics live in VMEM scratch; blocks are (8, 128)-aligned, D is taken whole, and
            default blocks are the largest whose buffers fit the TPU's VMEM (`mosaic_blocks`).
  'triton'  (GPU) every grid axis is parallel, so each program loops over the reduction axis
            itself with lax.fori_loop and masked loads; every loaded tile has power-of-two sides,
            so D is walked in `block_model` slices and padded columns read as zeros. The
            backward kernels' accumulators live in registers, so wide models split D into
            groups on a second grid axis, each recomputing the logits tiles.
Both run under `interpret=True` on CPU, which is how the tests exercise the kernel bodies.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
# Transposed-operand contractions: 'TV,DV->TD' (dh) and 'TD,TV->DV' (dW).
CONTRACT_VOCAB = (((1,), (1,)), ((), ()))
CONTRACT_TOKENS = (((0,), (0,)), ((), ()))


def dot_precision(dtype):
  """fp32 inputs get true fp32 products: by default TPUs multiply fp32 in bf16 passes and Triton
  in TF32, both far from the 1e-5 agreement the fp32 path is tested to."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# ---- tile maths shared by both schedules and by the XLA fallback ----

def initial_stats(rows: int):
  """(running max, running sum of exp, entropy term, target logit), each [rows, 1] fp32."""
  zeros = jnp.zeros((rows, 1), F32)
  return jnp.full((rows, 1), -jnp.inf, F32), zeros, zeros, zeros


def update_stats(stats, z, hit, valid, with_entropy: bool):
  """Folds one logits tile z [T, V'] into the running statistics.

  hit [T, V'] marks each token's target column, valid [T, V'] (or None) the real vocabulary
  columns. The entropy term is kept as sum exp(z - m) (z - m) relative to the running max m, not
  as sum p z, so that large logits do not cancel in lse - sum p z.
  """
  running_max, running_sum, entropy_term, target_logit = stats
  if valid is not None:
    z = jnp.where(valid, z, -jnp.inf)
  new_max = jnp.maximum(running_max, jnp.max(z, axis=1, keepdims=True))
  scale = jnp.exp(running_max - new_max)
  exps = jnp.exp(z - new_max)
  target_logit = target_logit + jnp.sum(jnp.where(hit, z, 0.0), axis=1, keepdims=True)
  if with_entropy:
    shifted = z - new_max if valid is None else jnp.where(valid, z - new_max, 0.0)
    # Rebasing sum exp(z - m)(z - m) onto the new max adds sum_so_far * (m - m_new); the first
    # tile starts from m = -inf, where that product is 0 * inf, hence the guard.
    rebased = scale * (entropy_term + running_sum * (running_max - new_max))
    entropy_term = (jnp.where(scale > 0, rebased, 0.0)
                    + jnp.sum(exps * shifted, axis=1, keepdims=True))
  running_sum = scale * running_sum + jnp.sum(exps, axis=1, keepdims=True)
  return new_max, running_sum, entropy_term, target_logit


def finish_stats(stats):
  """-> logp, lse, entropy, each [T, 1] fp32."""
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


def _scaled_dot(h, w, inv_temperature):
  z = jnp.dot(h, w, preferred_element_type=F32, precision=dot_precision(h.dtype))
  return z if inv_temperature == 1.0 else z * inv_temperature


# ---- 'mosaic' schedule: reduction over the last grid axis, statistics in VMEM scratch ----

def _mosaic_tile(h, w, y, col_start, vocab: int, inv_temperature: float):
  z = _scaled_dot(h, w, inv_temperature)
  col = col_start + lax.broadcasted_iota(jnp.int32, z.shape, 1)
  # Statically drop the mask when the vocabulary fills every block.
  valid = None if vocab % w.shape[1] == 0 else col < vocab
  return z, col == y, valid


def _mosaic_forward_kernel(h_ref, w_ref, y_ref, logp_ref, lse_ref, *refs, vocab, inv_temperature,
                           with_entropy):
  entropy_ref, scratch = (refs[0], refs[1:]) if with_entropy else (None, refs)
  j = pl.program_id(1)

  @pl.when(j == 0)
  def _():
    for ref, value in zip(scratch, initial_stats(scratch[0].shape[0])):
      ref[...] = value

  block_vocab = w_ref.shape[1]
  z, hit, valid = _mosaic_tile(h_ref[...], w_ref[...], y_ref[...], j * block_vocab, vocab,
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


def _mosaic_backward_kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, *refs, vocab, inv_temperature,
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
  z, hit, valid = _mosaic_tile(h, w, y_ref[...], col_start, vocab, inv_temperature)
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


def _mosaic_forward(h, w, y, *, block_tokens, block_vocab, inv_temperature, with_entropy,
                    interpret, vmem_limit):
  tokens, model = h.shape
  vocab = w.shape[1]
  token_spec = pl.BlockSpec((block_tokens, 1), lambda i, j: (i, 0))
  column = jax.ShapeDtypeStruct((tokens, 1), F32)
  outputs = 3 if with_entropy else 2
  kernel = functools.partial(_mosaic_forward_kernel, vocab=vocab, inv_temperature=inv_temperature,
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


def _mosaic_backward(h, w, token_columns, *, block_tokens, block_vocab, inv_temperature,
                     with_entropy, interpret, vmem_limit):
  """token_columns: y, lse, g_logp[, entropy, g_entropy], each [T, 1]. -> dh [T, D], dW [D, V]."""
  tokens, model = h.shape
  vocab = w.shape[1]
  token_grid, vocab_grid = tokens // block_tokens, pl.cdiv(vocab, block_vocab)
  kernel = functools.partial(_mosaic_backward_kernel, vocab=vocab, inv_temperature=inv_temperature,
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


# ---- 'triton' schedule: every grid axis parallel, each program loops over the reduction ----

def _masked_load(ref, mask):
  """Zero-fills where mask is False; an unmasked load when there is nothing to mask."""
  return ref[...] if mask is None else pltriton.load(ref, mask=mask, other=0)


def _triton_tile(h_ref, w_ref, y, rows, col_start, *, vocab, block_vocab, block_model,
                 inv_temperature):
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


def _triton_forward_kernel(h_ref, w_ref, y_ref, logp_ref, lse_ref, *entropy_ref, vocab,
                           block_tokens, block_vocab, block_model, inv_temperature, with_entropy):
  rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_tokens, block_tokens), block_tokens)
  y = y_ref[rows, :]

  def step(j, stats):
    col_start = pl.multiple_of(j * block_vocab, block_vocab)
    z, hit, valid = _triton_tile(h_ref, w_ref, y, rows, col_start, vocab=vocab,
                                 block_vocab=block_vocab, block_model=block_model,
                                 inv_temperature=inv_temperature)
    return update_stats(stats, z, hit, valid, with_entropy)

  stats = lax.fori_loop(0, pl.cdiv(vocab, block_vocab), step, initial_stats(block_tokens))
  logp, lse, entropy = finish_stats(stats)
  logp_ref[rows, :] = logp
  lse_ref[rows, :] = lse
  if with_entropy:
    entropy_ref[0][rows, :] = entropy


def _triton_backward_kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, *refs, grad_of, vocab,
                            block_tokens, block_vocab, block_model, group_slices, inv_temperature,
                            with_entropy):
  """grad_of='hidden': program (i, g) owns the dh rows of token block i in D group g, and loops
  over the vocabulary. grad_of='weight': program (j, g) owns the dW columns of vocab block j in
  D group g, and loops over tokens. A D group is `group_slices` block_model-wide slices of D,
  held as a tuple of fp32 accumulators (Triton tiles cannot be updated in place, and D, e.g. 896,
  is rarely a power of two). Every group recomputes the full logits tile (a contraction over all
  of D), so more groups cost more FLOPs; they exist to keep the accumulators in registers."""
  entropy_ref, g_entropy_ref, out_ref = refs if with_entropy else (None, None, refs[0])
  slices = range(group_slices)
  first_slice = pl.program_id(1) * group_slices
  tile = functools.partial(_triton_tile, h_ref, w_ref, vocab=vocab, block_vocab=block_vocab,
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


def _triton_call(kernel, grid, out_shape, interpret, name, num_warps):
  return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                        compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                                                num_stages=2))


def _triton_forward(h, w, y, *, block_tokens, block_vocab, block_model, inv_temperature,
                    with_entropy, interpret):
  kernel = functools.partial(_triton_forward_kernel, vocab=w.shape[1], block_tokens=block_tokens,
                             block_vocab=block_vocab, block_model=block_model,
                             inv_temperature=inv_temperature, with_entropy=with_entropy)
  column = jax.ShapeDtypeStruct((h.shape[0], 1), F32)
  return _triton_call(kernel, (h.shape[0] // block_tokens,), [column] * (3 if with_entropy else 2),
                      interpret, 'token_logprobs_forward', num_warps=4)(h, w, y)


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


def _triton_backward(h, w, token_columns, *, block_tokens, block_vocab, block_model,
                     inv_temperature, with_entropy, interpret):
  slices = h.shape[1] // block_model
  blocks = {'hidden': (h.shape[0] // block_tokens, block_tokens),
            'weight': (pl.cdiv(w.shape[1], block_vocab), block_vocab)}
  shapes = {'hidden': h, 'weight': w}
  outputs = []
  for grad_of in ('hidden', 'weight'):
    programs, block = blocks[grad_of]
    groups = triton_model_groups(slices, block, block_model)
    kernel = functools.partial(
        _triton_backward_kernel, grad_of=grad_of, vocab=w.shape[1], block_tokens=block_tokens,
        block_vocab=block_vocab, block_model=block_model, group_slices=slices // groups,
        inv_temperature=inv_temperature, with_entropy=with_entropy)
    outputs.append(_triton_call(
        kernel, (programs, groups),
        jax.ShapeDtypeStruct(shapes[grad_of].shape, shapes[grad_of].dtype), interpret,
        f'token_logprobs_grad_{grad_of}', num_warps=8)(h, w, *token_columns))
  return tuple(outputs)


# ---- Mosaic block sizes: what fits in VMEM ----

# VMEM per TensorCore in jax's TPU table: 16 MiB on v2-v4, 64 MiB on v5p and v7x, 128 MiB on v5e
# and v6e. Lowering for a TPU from another host assumes the smallest.
SMALLEST_VMEM = 16 << 20
# Default blocks use this share of VMEM; the rest is left to Mosaic (internal scratch, relayouts).
VMEM_SHARE = 0.75
LANES = 128  # VMEM tiles are (8, 128): a [rows, 1] block occupies [rows, 128]


def vmem_capacity() -> int:
  """VMEM bytes per TensorCore of the TPU in use, or of the smallest TPU when not on one."""
  if jax.default_backend() == 'tpu':
    return pltpu.get_tpu_info().vmem_capacity_bytes
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
  """Default (block_tokens, block_vocab): the largest pair whose blocks fit VMEM_SHARE of VMEM.

  The forward and dh kernels read every W block once per token block, so each W byte from HBM
  feeds block_tokens multiply-adds; the dW kernel reads every h block once per vocabulary block
  (block_vocab). A TPU needs a few hundred FLOPs per HBM byte to be compute-bound (bf16 peak over
  HBM bandwidth: ~170 on v5p, ~240 on v5e, ~560 on v6e), so the smaller of the two blocks is
  maximised first, then the token block.
  """
  budget = VMEM_SHARE * capacity
  fitting = [(tokens, vocab) for tokens in (1024, 512, 256, 128, 64, 32, 16, 8)
             for vocab in (1024, 512, 256, 128)
             if mosaic_vmem_bytes(tokens, vocab, model, itemsize) <= budget]
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


# ---- entry points: padding, block checks, schedule dispatch ----

def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def block_shapes(schedule: str, tokens: int, model: int, vocab: int, block_tokens: int,
                 block_vocab: int, block_model: int) -> tuple[int, int, int]:
  """Clamps requested blocks to the problem and checks them against the backend's rules:
  Mosaic wants (8, 128)-aligned blocks (or the whole dimension); Triton wants power-of-two tiles
  with every side >= 16 for its tensor-core dots."""
  if schedule == 'mosaic':
    block_tokens = min(block_tokens, _round_up(tokens, 8))
    if block_vocab >= vocab:
      block_vocab = vocab
    if block_tokens % 8 or (block_vocab % 128 and block_vocab != vocab):
      raise ValueError(f'mosaic blocks need block_tokens % 8 == 0 and block_vocab % 128 == 0, got '
                       f'{block_tokens} and {block_vocab}')
    return block_tokens, block_vocab, model
  block_tokens = min(block_tokens, max(16, pl.next_power_of_2(tokens)))
  for name, value in (('block_tokens', block_tokens), ('block_vocab', block_vocab),
                      ('block_model', block_model)):
    if value < 16 or value & (value - 1):
      raise ValueError(f'triton {name} must be a power of two >= 16, got {value}')
  # The largest power of two dividing D avoids padding W along D (a full copy of it).
  while block_model > 16 and model % block_model:
    block_model //= 2
  return block_tokens, block_vocab, block_model


def _pad(array, axis: int, multiple: int):
  extra = _round_up(array.shape[axis], multiple) - array.shape[axis]
  if not extra:
    return array
  widths = [(0, 0)] * array.ndim
  widths[axis] = (0, extra)
  return jnp.pad(array, widths)


def pallas_forward(h, w, y, *, schedule, block_tokens, block_vocab, block_model, inv_temperature,
                   with_entropy, interpret):
  """h [T, D], w [D, V], y [T] int32 -> (logp [T], lse [T], entropy [T] or None), fp32.

  Padded tokens (zero rows, target 0) are computed and dropped; the backward pass pads the
  cotangents with zeros, so they contribute nothing.
  """
  tokens = h.shape[0]
  block_tokens, block_vocab, block_model = block_shapes(
      schedule, tokens, h.shape[1], w.shape[1], block_tokens, block_vocab, block_model)
  h, w = _pad(_pad(h, 0, block_tokens), 1, block_model), _pad(w, 0, block_model)
  y = _pad(y[:, None], 0, block_tokens)
  common = dict(block_tokens=block_tokens, block_vocab=block_vocab,
                inv_temperature=inv_temperature, with_entropy=with_entropy, interpret=interpret)
  if schedule == 'mosaic':
    vmem_limit = mosaic_vmem_limit(block_tokens, block_vocab, h.shape[1], h.dtype.itemsize)
    columns = _mosaic_forward(h, w, y, vmem_limit=vmem_limit, **common)
  else:
    columns = _triton_forward(h, w, y, block_model=block_model, **common)
  logp, lse, *entropy = (column[:tokens, 0] for column in columns)
  return logp, lse, (entropy[0] if with_entropy else None)


def pallas_backward(h, w, y, lse, entropy, g_logp, g_entropy, *, schedule, block_tokens,
                    block_vocab, block_model, inv_temperature, interpret):
  """Per-token vectors [T] (entropy and g_entropy None without entropy) -> dh [T, D], dW [D, V]."""
  (tokens, model), with_entropy = h.shape, entropy is not None
  block_tokens, block_vocab, block_model = block_shapes(
      schedule, tokens, model, w.shape[1], block_tokens, block_vocab, block_model)
  columns = [y, lse, g_logp] + ([entropy, g_entropy] if with_entropy else [])
  columns = [_pad(column[:, None], 0, block_tokens) for column in columns]
  h_padded = _pad(_pad(h, 0, block_tokens), 1, block_model)
  w_padded = _pad(w, 0, block_model)
  common = dict(block_tokens=block_tokens, block_vocab=block_vocab,
                inv_temperature=inv_temperature, with_entropy=with_entropy, interpret=interpret)
  if schedule == 'mosaic':
    vmem_limit = mosaic_vmem_limit(block_tokens, block_vocab, model, h.dtype.itemsize)
    dh, dw = _mosaic_backward(h_padded, w_padded, columns, vmem_limit=vmem_limit, **common)
  else:
    dh, dw = _triton_backward(h_padded, w_padded, columns, block_model=block_model, **common)
  return dh[:tokens, :model], dw[:model]
