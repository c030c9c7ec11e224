"""The decoder's projections as plain 2-D matmuls (the dense MLP, attention, LoRA factors, and the
experts when they run densely)."""

import math

import jax
import jax.numpy as jnp

from grpo_jax.model.quantize import Quantized, output_scale
from grpo_jax.model.ring_attention import context_size
from grpo_jax.ops import fixed_order


def matmul(x: jax.Array, w, contract: int = 1) -> jax.Array:
  """x [B, T, *I] @ w [*I, *O] -> [B, T, *O], contracting x's last `contract` dims, as one 2-D
  [B*T, prod I] @ [prod I, prod O] matmul.

  Same maths as einsum('BTI,IO->BTO'), but its gradient with respect to w is then one dot with a
  single contracting dimension: with B and T kept apart, XLA:CPU contracts two dimensions and
  copies the activation gradient into a transposed layout first (measured on one SwiGLU block,
  [64, 37, 256] x F=704, forward + backward: 87 ms as an einsum, 37 ms flattened).

  w Quantized (the sampler's 8-bit weights, model/quantize.py): x times the values converted to x's
  dtype, then each output scaled by its channel's scale.

  Under exact numerics (ops/fixed_order.py) each output is a fold over the contraction, in fp32,
  then rounded to the inputs' dtype.

  When the rows' length is split over the context axis (ring attention), B and T stay apart: B
  split over the batch axes and T over context do not flatten into one tiled dimension, and XLA
  gathered every projection's input over the context axis to flatten it (the whole row projected on
  every device of the axis, the update's and the sampler's split prefill alike).
  """
  if isinstance(w, Quantized):
    y = matmul(x, w.values.astype(x.dtype), contract)
    return y * output_scale(w, contract).astype(y.dtype)
  rows = x.shape[:x.ndim - contract]
  inner = w.shape[:contract]
  if fixed_order.exact('matmul'):  # each output a fold over the contraction (exact numerics)
    flat = fixed_order.fold_matmul(x.reshape(-1, math.prod(inner)), w.reshape(math.prod(inner), -1))
    return flat.astype(jnp.result_type(x.dtype, w.dtype)).reshape(*rows, *w.shape[contract:])
  if len(rows) > 1 and context_size() > 1:
    return (x.reshape(*rows, math.prod(inner)) @ w.reshape(math.prod(inner), -1)).reshape(*rows, *w.shape[contract:])
  flat = x.reshape(-1, math.prod(inner)) @ w.reshape(math.prod(inner), -1)
  return flat.reshape(*rows, *w.shape[contract:])
