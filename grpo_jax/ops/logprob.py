"""Per-token log-probs (and entropy) of targets under the lm_head, without [B, T, V] logits.

GRPO needs log pi(y_t) = log_softmax((h_t @ W) / temperature)[y_t] for every sampled token. With
Qwen2.5's 151,936-word vocabulary the fp32 logits of 8 x 4,096 tokens alone take ~20 GB, so
`token_logprobs` streams the vocabulary in tiles, keeps a running max / log-sum-exp per token,
and recomputes the tiles in a custom VJP that saves only h, W, y and per-token lse (and entropy).

Implementations (same signature, same results up to rounding):
  'pallas'       fused kernels (logprob_pallas.py): Mosaic on TPU (logprob_mosaic.py), Mosaic GPU
                 on GPUs (logprob_mosaic_gpu.py), and the Mosaic schedule in interpret mode on
                 CPU. 'pallas_mosaic' / 'pallas_mosaic_gpu' force a schedule (to measure or tune
                 one, or to interpret it on CPU). Imported only when one runs.
  'xla_chunked'  the same algorithm, with the same tile maths (tiles.py), as a lax.scan over
                 vocabulary chunks in plain XLA.
  'naive'        full logits, log_softmax, take_along_axis; the reference, plain autodiff.
  'exact'        the sampler's own formula in fixed order (ops/fixed_order.py: the logits folded
                 over D, the log-sum-exp over V), a block of tokens at a time: bitwise what the
                 sampler computed for the same hidden states (algo.exact_on_policy). Its gradient
                 is the naive path's; its entropy too.
  'auto'         'xla_chunked' on every platform for now: the Pallas kernels are tested in
                 interpret mode and compiled in CI for v5e, v5p, v6e and H100 by Mosaic and
                 Mosaic GPU (deviceless, tests/test_deviceless.py), but have not yet been measured
                 on the hardware (the Mosaic GPU ones not run at all), so they are opt-in ('pallas').

Targets must lie in [0, V). Padding tokens may carry any valid id; mask them in the loss, and
their rows of dh are then exactly zero.

Under a device mesh (`jax.set_mesh`) the fused implementations run inside shard_map in the
vocabulary-parallel layout Megatron uses for its cross-entropy: tokens split over the mesh axes of
the 'batch' rule, W's columns over those of the 'vocab' rule (grpo_jax/sharding.py), each device
computing its tokens against its columns, with per-token log-sum-exp, target logit and entropy
combined over the vocabulary axis. Without it XLA would gather W's columns on every device, and
a Pallas call, which XLA cannot partition, would run whole on every device.
"""

import dataclasses
import functools
import math
import typing
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from grpo_jax.ops.tiles import (F32, CONTRACT_TOKENS, CONTRACT_VOCAB, dot_precision, finish_stats,
                                initial_stats, logit_gradient, update_stats)
from grpo_jax.sharding import auto_shape, row_and_length_axes, split_axes

LogprobImplementation = Literal['auto', 'pallas', 'pallas_mosaic', 'pallas_mosaic_gpu', 'xla_chunked', 'naive',
                                'exact']
IMPLEMENTATIONS = typing.get_args(LogprobImplementation)
# The XLA fallback sizes its vocabulary chunk so that one fp32 [T, chunk] tile holds about this
# many elements (64 MiB), and takes at least 32 chunks, so that its temporaries stay a few percent
# of the naive path's [T, V] ones at any T. On CPU, chunks of 1,024 to 4,096 columns ran equally
# fast at D = 896 (512 was 10% slower).
XLA_CHUNK_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static configuration of one fused call (hashable: it is a custom_vjp nondiff argument)."""
  schedule: str  # 'xla', 'mosaic' or 'mosaic_gpu'
  inv_temperature: float
  with_entropy: bool
  block_tokens: int | None
  block_vocab: int | None
  block_model: int | None
  interpret: bool


def token_logprobs(hidden, weight, targets, *, temperature: float = 1.0,
                   return_entropy: bool = False, implementation: LogprobImplementation = 'auto',
                   block_tokens: int | None = None, block_vocab: int | None = None,
                   block_model: int | None = None, interpret: bool | None = None):
  """log pi(targets) under logits = (hidden @ weight) / temperature, optionally with entropy.

  hidden [B, T, D] or [T, D]; weight [D, V]; targets [B, T] or [T] integer ids in [0, V).
  Returns logp with targets' shape, fp32, or (logp, entropy) with return_entropy. Differentiable
  with respect to hidden and weight; gradients come back in their dtypes. Dots run in the common
  dtype of hidden and weight with fp32 accumulation (true fp32 products for fp32 inputs).

  temperature is static (a Python float). block_tokens / block_vocab / block_model override the
  tile sizes (block_model: the D slice of the Mosaic GPU kernels); for 'xla_chunked', block_vocab is
  the vocabulary chunk. interpret (pallas only) defaults to True exactly when the target is a CPU
  (`target_platform`), wherever the compiler runs.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}')
  if not temperature > 0:
    raise ValueError(f'temperature must be positive, got {temperature}')
  model = weight.shape[0]
  if weight.ndim != 2 or hidden.shape[-1] != model or hidden.shape[:-1] != targets.shape:
    raise ValueError(f'hidden {hidden.shape}, weight {weight.shape} and targets {targets.shape} '
                     'must be [..., D], [D, V] and [...]')
  dtype = jnp.result_type(hidden.dtype, weight.dtype)
  h = hidden.reshape(-1, model).astype(dtype)
  w = weight.astype(dtype)
  y = targets.reshape(-1).astype(jnp.int32)
  inv_temperature = 1.0 / float(temperature)

  if implementation == 'naive':
    logp, entropy = _naive(h, w, y, inv_temperature, return_entropy)
  elif implementation == 'exact':
    from grpo_jax.ops import fixed_order
    logp = fixed_order.exact_logprobs(h, w, y, float(temperature))
    entropy = _naive(h, w, y, inv_temperature, True)[1] if return_entropy else None
  else:
    platform = target_platform()
    schedule = _schedule(implementation, platform)
    defaults = default_blocks(schedule, model, jnp.dtype(dtype).itemsize)
    plan = _Plan(schedule, inv_temperature, return_entropy,
                 block_tokens or defaults[0], block_vocab or defaults[1],
                 block_model or defaults[2],
                 platform == 'cpu' if interpret is None else interpret)
    token_axes, vocab_axes = _mesh_axes(hidden.shape[:-1], w.shape[1])
    if token_axes or vocab_axes:
      logp, entropy = _fused_on_mesh(plan, (token_axes, _scatter_axes(token_axes, w.shape[0])), vocab_axes, h, w, y)
    else:
      logp, entropy = _fused(plan, h, w, y)
  logp = logp.reshape(targets.shape)
  return (logp, entropy.reshape(targets.shape)) if return_entropy else logp


def target_platform() -> str:
  """'cpu', 'gpu' or 'tpu': what the code being traced is compiled for. Under `jax.set_mesh` that is
  the mesh's devices, which may be a TPU or GPU topology compiled for from a CPU-only host
  (deviceless AOT); otherwise the default backend. Kernels are interpreted only on CPU targets."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else mesh.abstract_device
  platform = device.platform if device is not None else jax.default_backend()
  return 'gpu' if platform in ('cuda', 'rocm') else platform


def default_blocks(schedule: str, model: int, itemsize: int) -> tuple:
  """(block_tokens, block_vocab, block_model) for a schedule, None where it takes no such block.

  mosaic: the largest blocks whose buffers fit this TPU's VMEM (logprob_mosaic.mosaic_blocks);
    they are compiled with a matching scoped VMEM limit. Sized from a VMEM estimate, not tuned
    on a TPU.
  mosaic_gpu: a 64-row WGMMA tile of tokens, 128 vocabulary columns and 64-wide D slices: 40 KiB
    of shared memory in bf16 at any D; the backward kernels' register accumulators are split into
    D groups (logprob_mosaic_gpu.model_groups). Untuned: not yet run on a GPU.
  xla: the vocabulary chunk is sized from the token count (see XLA_CHUNK_ELEMENTS).
  """
  if schedule == 'mosaic':
    from grpo_jax.ops import logprob_mosaic  # Pallas TPU, imported only when it runs
    return (*logprob_mosaic.mosaic_blocks(model, itemsize, logprob_mosaic.vmem_capacity()), None)
  if schedule == 'mosaic_gpu':
    return 64, 128, 64
  return None, None, None


def _schedule(implementation: str, platform: str) -> str:
  if implementation == 'auto':
    # Pallas becomes the default on TPU / GPU once a hardware run has checked it compiles there
    # and beats the XLA path (bench/logprob.py); until then a compile failure must not be the default.
    implementation = 'xla_chunked'
  if implementation == 'xla_chunked':
    return 'xla'
  if implementation == 'pallas':
    # On GPUs the Mosaic GPU kernels.
    return 'mosaic_gpu' if platform == 'gpu' else 'mosaic'
  return implementation.removeprefix('pallas_')


def _naive(h, w, y, inv_temperature: float, with_entropy: bool):
  """The reference: h [T, D], w [D, V], y [T] -> logp [T] (, entropy [T]) via full logits."""
  logits = jnp.einsum('TD,DV->TV', h, w, preferred_element_type=F32,
                      precision=dot_precision(h.dtype)) * inv_temperature
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(log_probs, y[:, None], axis=-1)[:, 0]
  entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1) if with_entropy else None
  return logp, entropy


# ---- fused path: one custom VJP for the Pallas kernels and the XLA fallback ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(plan: _Plan, h, w, y):
  logp, _, entropy = _fused_forward(plan, h, w, y)
  return logp, entropy


def _fused_forward(plan: _Plan, h, w, y):
  """-> logp [T], lse [T], entropy [T] or None."""
  if plan.schedule == 'xla':
    return _chunked_forward(h, w, y, plan)
  from grpo_jax.ops import logprob_pallas  # Pallas TPU and Mosaic GPU, imported only when they run
  return logprob_pallas.pallas_forward(
      h, w, y, schedule=plan.schedule, block_tokens=plan.block_tokens,
      block_vocab=plan.block_vocab, block_model=plan.block_model,
      inv_temperature=plan.inv_temperature, with_entropy=plan.with_entropy,
      interpret=plan.interpret)


def _fused_fwd(plan: _Plan, h, w, y):
  logp, lse, entropy = _fused_forward(plan, h, w, y)
  return (logp, entropy), (h, w, y, lse, entropy)


def _fused_backward(plan: _Plan, h, w, y, lse, entropy, g_logp, g_entropy):
  """-> dh [T, D], dW [D, V] in the dtypes of h and w."""
  if plan.schedule == 'xla':
    return _chunked_backward(h, w, y, lse, entropy, g_logp, g_entropy, plan)
  from grpo_jax.ops import logprob_pallas
  return logprob_pallas.pallas_backward(
      h, w, y, lse, entropy, g_logp, g_entropy, schedule=plan.schedule,
      block_tokens=plan.block_tokens, block_vocab=plan.block_vocab, block_model=plan.block_model,
      inv_temperature=plan.inv_temperature, interpret=plan.interpret)


def _fused_bwd(plan: _Plan, residuals, cotangents):
  return (*_fused_backward(plan, *residuals, *cotangents), None)


_fused.defvjp(_fused_fwd, _fused_bwd)


# ---- on a device mesh: tokens split over the batch axes, the vocabulary over the tensor axis ----

def _mesh_axes(tokens: tuple[int, ...], vocab: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Mesh axes that split the flattened tokens of leading shape [B, T] or [T] (B by the 'batch' rule,
  then T by the 'seq' rule: context parallelism's rows split along their length) and the vocabulary
  ('vocab' rule) when tracing under a mesh (`jax.set_mesh`); ((), ()) off a mesh or where nothing
  divides."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), ()
  shape = auto_shape(mesh)
  vocab_axes = split_axes(vocab, 'vocab', shape)
  if len(tokens) == 2:
    rows, length = row_and_length_axes(*tokens, shape)
    if length:
      return rows + length, vocab_axes
  return split_axes(math.prod(tokens), 'batch', shape), vocab_axes


def _scatter_axes(token_axes: tuple[str, ...], model: int) -> tuple[str, ...]:
  """The token axes that also split a weight's D ('embed' rule: FSDP): dW's sum over the tokens is
  scattered over them (each device keeps its own D slice, as the parameter is laid out) and summed
  over the others, so no device receives all of dW and only a D slice crosses the other axes.

  None on TPUs: XLA:TPU's pass that moves a loop's accumulated reductions out of the micro-batch
  loop fails a RET_CHECK on this reduce-scatter (while_loop_all_reduce_code_motion.cc:1112,
  "user->opcode() == kAdd", compiling the 7B recipe's update for a v5e-8); there the all-reduce is
  kept (a slice's ICI joins all of its chips: no slower link for the whole dW to cross)."""
  if target_platform() == 'tpu':
    return ()
  embed = split_axes(model, 'embed', auto_shape(jax.sharding.get_abstract_mesh()))
  return tuple(axis for axis in embed if axis in token_axes)


def _local_offset(vocab_axes, local_vocab: int):
  """First vocabulary id of this device's W columns."""
  return lax.axis_index(vocab_axes) * local_vocab if vocab_axes else 0


def _combine_vocab_shards(logp, lse, entropy, in_shard, vocab_axes):
  """Per-token results over each device's vocabulary slice -> results over the whole vocabulary.

  With slice k's log-sum-exp L_k, the whole one is L = log sum_k exp(L_k). The target's logit z_y
  is logp_k + L_k on the slice that holds y. The entropy is H = L - sum_v p_v z_v, and slice k's
  part of sum_v p_v z_v is exp(L_k - L) (L_k - H_k), hence H = sum_k exp(L_k - L) (H_k + L - L_k)
  (a weighted mean of non-negative terms: no large logits cancel).
  """
  top = lax.pmax(lse, vocab_axes)
  scaled = jnp.exp(lse - top)
  total = lax.psum(scaled, vocab_axes)
  whole = top + jnp.log(total)
  target_logit = lax.psum(jnp.where(in_shard, logp + lse, 0.0), vocab_axes)
  if entropy is not None:
    entropy = lax.psum(scaled * (entropy + whole - lse), vocab_axes) / total
  return target_logit - whole, whole, entropy


def _mesh_forward(plan: _Plan, token_axes, vocab_axes, h, w, y):
  """-> logp [T], lse [T], entropy [T] or None, each split over token_axes like h."""

  def local(h, w, y):
    offset = _local_offset(vocab_axes, w.shape[1])
    logp, lse, entropy = _fused_forward(plan, h, w, y - offset)
    if vocab_axes:
      in_shard = (y >= offset) & (y < offset + w.shape[1])
      logp, lse, entropy = _combine_vocab_shards(logp, lse, entropy, in_shard, vocab_axes)
    return (logp, lse) + ((entropy,) if plan.with_entropy else ())

  tokens = P(token_axes or None)
  columns = jax.shard_map(
      local, in_specs=(P(token_axes or None, None), P(None, vocab_axes or None), tokens),
      out_specs=(tokens,) * (3 if plan.with_entropy else 2), check_vma=False)(h, w, y)
  return columns[0], columns[1], (columns[2] if plan.with_entropy else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_on_mesh(plan: _Plan, axes, vocab_axes, h, w, y):
  """The fused op inside shard_map, Megatron's vocabulary-parallel layout: each device runs the
  kernels on its tokens against its slice of W's columns, and per-token statistics are combined
  across the vocabulary axes. No device computes another's tokens or holds all of W's columns;
  without this a Pallas call, which XLA cannot partition, would run whole on every device.
  axes: (the token axes, those of them that also split W's D: _scatter_axes)."""
  logp, _, entropy = _mesh_forward(plan, axes[0], vocab_axes, h, w, y)
  return logp, entropy


def _fused_on_mesh_fwd(plan: _Plan, axes, vocab_axes, h, w, y):
  logp, lse, entropy = _mesh_forward(plan, axes[0], vocab_axes, h, w, y)
  return (logp, entropy), (h, w, y, lse, entropy)


def _fused_on_mesh_bwd(plan: _Plan, axes, vocab_axes, residuals, cotangents):
  """Each device's d logits need only the whole-vocabulary lse and entropy (residuals), so its
  dh sums over its vocabulary slice (then over the vocabulary axes) and its dW columns over its
  tokens, then over the token axes: reduce-scattered along D over those that split the weight's D
  (FSDP, within a host in a hybrid mesh) and summed over the rest (data), a D slice each. The sums
  run in fp32."""
  token_axes, scatter_axes = axes
  summed_axes = tuple(axis for axis in token_axes if axis not in scatter_axes)
  h, w, y, lse, entropy = residuals
  g_logp, g_entropy = cotangents
  with_entropy = entropy is not None

  def local(h, w, y, lse, g_logp, *entropy_terms):
    entropy, g_entropy = entropy_terms if with_entropy else (None, None)
    offset = _local_offset(vocab_axes, w.shape[1])
    dh, dw = _fused_backward(plan, h, w, y - offset, lse, entropy, g_logp, g_entropy)
    if vocab_axes:
      dh = lax.psum(dh.astype(F32), vocab_axes).astype(h.dtype)
    if token_axes:
      dw = dw.astype(F32)
      if scatter_axes:
        dw = lax.psum_scatter(dw, scatter_axes, scatter_dimension=0, tiled=True)
      if summed_axes:
        dw = lax.psum(dw, summed_axes)
      dw = dw.astype(w.dtype)
    return dh, dw

  tokens = P(token_axes or None)
  rows, columns = P(token_axes or None, None), P(None, vocab_axes or None)
  entropy_terms = (entropy, g_entropy) if with_entropy else ()
  dh, dw = jax.shard_map(
      local, in_specs=(rows, columns, tokens, tokens, tokens) + (tokens,) * len(entropy_terms),
      out_specs=(rows, P(scatter_axes or None, vocab_axes or None)), check_vma=False)(
          h, w, y, lse, g_logp, *entropy_terms)
  return dh, dw, None


_fused_on_mesh.defvjp(_fused_on_mesh_fwd, _fused_on_mesh_bwd)


# ---- XLA fallback: lax.scan over vocabulary chunks ----

def _chunk_size(plan: _Plan, tokens: int, vocab: int) -> int:
  if plan.block_vocab:
    return min(plan.block_vocab, vocab)
  chunk = min(XLA_CHUNK_ELEMENTS // max(tokens, 1), vocab // 32) // 256 * 256
  return min(vocab, max(512, chunk))


def _chunk(h, w, y, index, chunk: int, inv_temperature: float):
  """Logits of vocabulary chunk `index` -> z [T, C] fp32, its W columns [D, C], start, the
  target hits [T, C] and fresh [1, C].

  V is rarely a multiple of the chunk (151,936 = 2^7 x 1187), and padding W would copy it, so
  the last chunk is shifted left to end at V; `fresh` [1, C] marks the columns no earlier chunk
  covered, so the overlap is counted once.
  """
  vocab = w.shape[1]
  start = jnp.minimum(index * chunk, vocab - chunk)
  w_chunk = lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
  z = jnp.einsum('TD,DV->TV', h, w_chunk, preferred_element_type=F32,
                 precision=dot_precision(h.dtype))
  if inv_temperature != 1.0:
    z = z * inv_temperature
  cols = start + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
  fresh = cols >= index * chunk
  return z, w_chunk, start, cols == y[:, None], fresh


def _chunked_forward(h, w, y, plan: _Plan):
  tokens, vocab = h.shape[0], w.shape[1]
  chunk = _chunk_size(plan, tokens, vocab)

  def step(stats, index):
    z, _, _, hit, fresh = _chunk(h, w, y, index, chunk, plan.inv_temperature)
    return update_stats(stats, z, hit & fresh, fresh, plan.with_entropy), None

  stats, _ = lax.scan(step, initial_stats(tokens), jnp.arange(-(-vocab // chunk)))
  logp, lse, entropy = (column[:, 0] for column in finish_stats(stats))
  return logp, lse, (entropy if plan.with_entropy else None)


def _chunked_backward(h, w, y, lse, entropy, g_logp, g_entropy, plan: _Plan):
  """dh [T, D] accumulates over chunks in fp32; dW is written chunk by chunk into its own
  buffer (dynamic_update_slice on the scan carry, done in place by XLA)."""
  tokens, vocab = h.shape[0], w.shape[1]
  chunk = _chunk_size(plan, tokens, vocab)
  columns = dict(lse=lse[:, None], g_logp=g_logp[:, None])
  if entropy is not None:
    columns.update(entropy=entropy[:, None], g_entropy=g_entropy[:, None])

  def step(carry, index):
    dh, dw = carry
    z, w_chunk, start, hit, fresh = _chunk(h, w, y, index, chunk, plan.inv_temperature)
    # Overlapped columns get their full gradient again for dW (rewriting identical values) but
    # are masked out of dh, which sums over columns.
    dz = logit_gradient(z, hit, None, inv_temperature=plan.inv_temperature, **columns)
    dh = dh + lax.dot_general(jnp.where(fresh, dz, 0.0).astype(w.dtype), w_chunk, CONTRACT_VOCAB,
                              preferred_element_type=F32, precision=dot_precision(w.dtype))
    dw_chunk = lax.dot_general(h, dz.astype(h.dtype), CONTRACT_TOKENS, preferred_element_type=F32,
                               precision=dot_precision(h.dtype))
    dw = lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, axis=1)
    return (dh, dw), None

  initial = (jnp.zeros(h.shape, F32), jnp.zeros(w.shape, w.dtype))
  (dh, dw), _ = lax.scan(step, initial, jnp.arange(-(-vocab // chunk)))
  return dh.astype(h.dtype), dw
