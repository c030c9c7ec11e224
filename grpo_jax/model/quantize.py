"""8-bit weights for the sampler's resident copy (`rollout.weights: int8 | fp8`).

Decoding reads every weight once per token, so halving their bytes shortens a memory-bound decode
step by up to half. The trainer keeps its own parameters in its own precision; the sampler's copy,
made once per RL step when it is laid out (sampler/layout.py), holds each large matmul weight as
8-bit values and one scale per output channel:

  w[..., i, o] ~= values[..., i, o] * scale[..., 1, o]     (i: the contracted dims, o: the outputs)

scale = max |w| over the contracted dims / the format's largest value (127 for int8, 448 for
float8_e4m3fn); int8 values are round-to-nearest, fp8 values the format's own rounding. With one
scale per output, a matmul reads the 8-bit values (converted to the compute dtype as it loads them)
and scales its output: y[o] = (x @ values)[o] * scale[o], the same product up to rounding.

Quantized: the layer weights (attention and MLP projections, a mixture's experts) and the output
projection (the tied embedding, whose lookup scales each gathered row by its token's scale). Not
quantized: norms, biases, the router, the vision tower, LoRA adapters, the KV cache. What the
sampler computes then differs from the trainer's policy; the update's importance weights against
the sampler's log-probs (algo.tis_cap) correct for it, and the rollout's mismatch metrics show it.
"""

import dataclasses
import typing
from typing import Literal

import jax
import jax.numpy as jnp

# The sampler's resident weights: 'compute' (the model's compute dtype: bf16 in every recipe), 'bf16',
# or 8-bit with per-channel scales.
RolloutWeights = Literal['compute', 'bf16', 'int8', 'fp8']
ROLLOUT_WEIGHTS = typing.get_args(RolloutWeights)
FORMATS = {'int8': (jnp.int8, 127.0), 'fp8': (jnp.float8_e4m3fn, 448.0)}

# The contracted (input) dims of each quantized weight in the model's own layout: a layer weight's
# [L, ...] stack (a mixture's experts [Ls, E, ...]) and the output projection [D, V] or the tied
# embedding [V, D].
CONTRACTED = {'q_weight': (1,), 'k_weight': (1,), 'v_weight': (1,), 'o_weight': (1, 2), 'gate_weight': (1,),
              'up_weight': (1,), 'down_weight': (1,), 'expert_gate_weight': (2,), 'expert_up_weight': (2,),
              'expert_down_weight': (2,), 'lm_head': (0,), 'embedding': (1,)}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
  """A weight as 8-bit `values` (its shape) and fp32 `scale` (its shape with the contracted dims 1).
  Indexing and slicing along the leading (layer) dims slice both, so a stack of quantized layers
  scans, unrolls and cuts (Qwen2.loop_view) as plain arrays do."""

  values: jax.Array
  scale: jax.Array

  @property
  def shape(self):
    return self.values.shape

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def dtype(self):
    return self.values.dtype

  def __getitem__(self, index) -> 'Quantized':
    return Quantized(self.values[index], self.scale[index])

  def astype(self, dtype) -> 'Quantized':
    """The compute dtype is the matmul's (linear.matmul converts the values as it reads them)."""
    del dtype
    return self

  @property
  def T(self) -> 'Quantized':  # noqa: N802 (as jax.Array's)
    return Quantized(self.values.T, self.scale.T)


def quantize(weight: jax.Array, contracted: tuple[int, ...], kind: str) -> Quantized:
  """weight (any float dtype) -> Quantized with one scale per output channel (module docstring).
  An all-zero channel gets scale 1 (its values are 0)."""
  dtype, largest = FORMATS[kind]
  w = weight.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w), axis=contracted, keepdims=True)
  scale = jnp.where(amax > 0, amax / largest, 1.0)
  scaled = w / scale
  if kind == 'int8':
    scaled = jnp.round(scaled)
  return Quantized(jnp.clip(scaled, -largest, largest).astype(dtype), scale)


def dequantize(weight, dtype=None):
  """A Quantized weight as values * scale in `dtype` (default: the scale's, fp32); an array as is."""
  if not isinstance(weight, Quantized):
    return weight if dtype is None else weight.astype(dtype)
  dtype = dtype or weight.scale.dtype
  return weight.values.astype(dtype) * weight.scale.astype(dtype)


def output_scale(weight: Quantized, contract: int) -> jax.Array:
  """The scale of a 2-D-like weight [*I, *O] (I: its first `contract` dims) shaped [*O]."""
  return weight.scale.reshape(weight.shape[contract:])

