"""The decoder's projections as plain 2-D matmuls (the dense MLP, attention, LoRA factors, and the
experts when they run densely)."""

import math

import jax


def matmul(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
  """x [B, T, *I] @ w [*I, *O] -> [B, T, *O], contracting x's last `contract` dims, as one 2-D
  [B*T, prod I] @ [prod I, prod O] matmul.

  Same maths as einsum('BTI,IO->BTO'), but its gradient with respect to w is then one dot with a
  single contracting dimension: with B and T kept apart, XLA:CPU contracts two dimensions and
  copies the activation gradient into a transposed layout first (measured on one SwiGLU block,
  [64, 37, 256] x F=704, forward + backward: 87 ms as an einsum, 37 ms flattened).
  """
  rows = x.shape[:x.ndim - contract]
  inner = w.shape[:contract]
  flat = x.reshape(-1, math.prod(inner)) @ w.reshape(math.prod(inner), -1)
  return flat.reshape(*rows, *w.shape[contract:])
