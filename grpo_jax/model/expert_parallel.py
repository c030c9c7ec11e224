"""Expert parallelism: each token's (token, expert) pairs travel to the devices that hold those
experts, are computed there and travel back, inside one shard_map over the whole mesh.

`experts_forward` here computes what model/moe.py's `experts_forward` computes, for a mesh whose
'expert' axis (of size ep) splits the E experts into ep runs of El = E / ep. The weights keep the
rule table's layout (sharding.py): [E, D, M] with E over 'expert', D over 'fsdp' and M over
'tensor'; tokens keep theirs, rows over the batch axes ('data', 'fsdp', 'expert') and, with context
parallelism, each row's length over 'context' (the 'tokens' rule). Every device:

  1. sorts its n tokens' P = n * k pairs by expert (its experts' runs are then in the order of the
     ranks that own them) and counts them, [E]; the counts of the whole expert group, [ep, E],
     are gathered over 'expert' (ep * E integers), from which every device derives the same
     offsets without a further exchange;
  2. sends each rank of its expert group the rows of that rank's experts, one slice per
     (rank, expert), landing on the owner already grouped by expert and, within an expert, by
     sender: the owner's buffer is expert-major, as the grouped matmul wants it, with no sort;
  3. gathers its experts' D shards over 'fsdp' (what XLA does for a dense FSDP weight; their
     transpose, a reduce-scatter, is the weight gradient's) and runs `expert_mlp` (ragged_dot
     on CPUs and TPUs, the Triton kernels on GPUs) on its M columns;
  4. returns each result to the slot its pair came from, weights it by its gate, sums the k
     pairs of a token, and sums the partial products of the M columns over 'tensor'. That sum
     is taken last, on [n, D], the smallest array the linear steps after the down projection
     reach (the return, the gates and the sum over k commute with it).

Buffers. Without a capacity factor nothing may drop, so the static shapes are the worst case.
Each token's k experts are distinct (as `route` chooses them), so a device sends one rank at most
C = n * min(k, El) rows, and receives at most ep * C rows (every sender's pairs to this rank).

Chunks. Those bounds are the worst case of every pair landing on one rank, ep * n * min(k, El)
rows of D per device: for DeepSeek-V3's update (n = 6,144 tokens, k = 8, ep = 8) 5.25 GiB per
buffer, several alive at once. Where one receive buffer would pass RECEIVE_BUDGET bytes the
device's tokens go through in chunks (the fewest that fit, one after another, each rematerialised
under autodiff), the experts' weights gathered once for all of them: the buffers are a chunk's.

Transport. On TPUs and GPUs the exchanges are `jax.lax.ragged_all_to_all`: a device sends its P
rows and nothing more. XLA:CPU does not implement ragged-all-to-all (jax 0.12), so there a
fixed-capacity `jax.lax.all_to_all` stands in with the same meaning: [ep, C, D] buffers, each
rank's slices packed at the front of its block, ep times the rows a ragged exchange moves at
worst; the receiver writes the rows where a ragged exchange would have. One sequence on every
platform, and the CPU tests check its offsets.

On GPUs the Triton grouped matmul runs inside this shard_map; that path is compiled deviceless
for H100s (tests/test_expert_parallel.py), not run: the Pallas interpreter the CPU tests would use
does not run under shard_map's checked manual-axis types (jax 0.12).

The tensor ranks of a group hold the same tokens and send the same rows (each to its own
expert group); splitting the pairs over them as well is not done.

Shapes: x [B, T, D], experts [B, T, k] int, gates [B, T, k], gate / up weights [E, D, M],
down weight [E, M, D].

`python -m grpo_jax.plan.experts layer TARGET` compiles one Qwen3-30B-A3B layer's experts,
forward and backward, under an fsdp x expert mesh of TARGET (deviceless, grpo_jax/plan/targets.py)
and prints its collectives as one JSON line.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from grpo_jax.ops.grouped_matmul import expert_mlp
from grpo_jax.sharding import LOGICAL_AXIS_RULES, auto_shape, constrain, current_mesh, spec_for

AXIS = 'expert'
TOKEN_AXES = dict(LOGICAL_AXIS_RULES)['tokens']  # B x T: the batch's axes, then context's
WEIGHT_AXES = ('experts', 'embed', 'mlp')  # gate / up [E, D, M]; down is [E, M, D]


def expert_axis_size() -> int:
  """The size of the current mesh's 'expert' axis (1 outside a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else auto_shape(mesh).get(AXIS, 1)


def applies(num_experts: int) -> bool:
  """Whether the experts run here, under a mesh of more than one device whose 'expert' axis divides
  the E experts (else the rule table leaves E whole and shards D over 'expert' too). An 'expert'
  axis of 1 still gains from it: each device sorts and computes its own tokens' pairs with the
  experts' D gathered over 'fsdp', as a dense FSDP layer does, where XLA's partitioner would sort
  the whole batch's pairs across devices."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and mesh.size > 1 and num_experts % expert_axis_size() == 0


def experts_forward(x: jax.Array, experts: jax.Array, gates: jax.Array, gate_weight: jax.Array,
                    up_weight: jax.Array, down_weight: jax.Array) -> jax.Array:
  """x [B, T, D] through each token's k experts, weighted by gates [B, T, k] and summed -> [B, T, D],
  the experts computed on the devices that hold them (the module docstring). Needs `applies`."""
  num_experts = gate_weight.shape[0]
  if not applies(num_experts):
    raise ValueError(f'expert parallelism needs an expert mesh axis that divides the {num_experts} experts; '
                     f'this mesh has expert={expert_axis_size()}')
  mesh = current_mesh()
  sizes = auto_shape(mesh)
  batch, length, width = x.shape
  top_k = experts.shape[-1]
  # Rows over every batch axis: a token count they do not divide is padded with tokens gated 0 (to
  # k distinct experts, as the buffer bounds assume), so each device holds its own tokens.
  shards = math.prod(sizes.get(axis, 1) for axis in TOKEN_AXES)
  tokens = batch * length
  padding = -tokens % shards
  pad = lambda a: jnp.pad(a.reshape(tokens, -1), ((0, padding), (0, 0)))  # noqa: E731
  x_flat, gates_flat = pad(x), pad(gates)
  experts_flat = jnp.concatenate([experts.reshape(tokens, top_k).astype(jnp.int32),
                                  jnp.broadcast_to(jnp.arange(top_k, dtype=jnp.int32), (padding, top_k))])

  rows_spec = spec_for((tokens + padding, width), ('tokens', None), sizes)
  gate_spec = spec_for(gate_weight.shape, WEIGHT_AXES, sizes)
  down_spec = spec_for(down_weight.shape, (WEIGHT_AXES[0], WEIGHT_AXES[2], WEIGHT_AXES[1]), sizes)
  local = functools.partial(_local_experts, top_k=top_k, gathered=_axes(gate_spec, 1), summed=_axes(gate_spec, 2),
                            ragged=_ragged_here())
  out = jax.shard_map(local, mesh=mesh, in_specs=(rows_spec, rows_spec, rows_spec, gate_spec, gate_spec, down_spec),
                      out_specs=rows_spec)(x_flat, experts_flat, gates_flat, gate_weight, up_weight, down_weight)
  return constrain(out[:tokens].reshape(batch, length, width), ('batch', 'seq', 'act_embed'))


def _axes(spec: PartitionSpec, dim: int) -> tuple[str, ...]:
  """The mesh axes dimension `dim` of a spec is split over."""
  entry = spec[dim] if dim < len(spec) else None
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _ragged_here() -> bool:
  from grpo_jax.ops.logprob import target_platform  # the one rule for what a trace is compiled for
  return target_platform() != 'cpu'


# The bytes one exchange's receive buffer may take before a device's tokens go in chunks.
RECEIVE_BUDGET = 1 << 30


def token_chunks(tokens: int, ranks: int, top_k: int, local_experts: int, width: int, itemsize: int) -> int:
  """The fewest chunks (a divisor of `tokens`) whose receive buffer, ranks * tokens / chunks *
  min(k, El) rows of `width`, fits RECEIVE_BUDGET; 1 on one rank (no exchange)."""
  if ranks == 1:
    return 1
  per_token = ranks * min(top_k, local_experts) * width * itemsize
  return next((c for c in range(1, tokens + 1) if tokens % c == 0 and tokens // c * per_token <= RECEIVE_BUDGET),
              tokens)


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
  return jnp.cumsum(a, axis=axis) - a


def _local_experts(x, experts, gates, gate_weight, up_weight, down_weight, *, top_k: int,
                   gathered: tuple[str, ...], summed: tuple[str, ...], ragged: bool):
  """One device's part: x [n, D], experts / gates [n, k]; weights [El, D / fsdp, M / tensor] and
  [El, M / tensor, D / fsdp] -> [n, D], its tokens' outputs."""
  tokens, width = x.shape
  ranks = jax.lax.axis_size(AXIS)
  local_experts = gate_weight.shape[0]
  num_experts = ranks * local_experts
  if gathered:
    gate_weight, up_weight = (jax.lax.all_gather(w, gathered, axis=1, tiled=True) for w in (gate_weight, up_weight))
    down_weight = jax.lax.all_gather(down_weight, gathered, axis=2, tiled=True)
  weights = (gate_weight, up_weight, down_weight)
  chunks = token_chunks(tokens, ranks, top_k, local_experts, width, x.dtype.itemsize)
  one = lambda x, experts, gates: _token_pairs(x, experts, gates, weights, num_experts, top_k, ragged)  # noqa: E731
  if chunks == 1:
    combined = one(x, experts, gates)
  else:  # one chunk of tokens after another (the module docstring's Chunks)
    split = lambda a: a.reshape(chunks, tokens // chunks, *a.shape[1:])  # noqa: E731
    combined = jax.lax.map(jax.checkpoint(lambda part: one(*part)), (split(x), split(experts), split(gates)))
    combined = combined.reshape(tokens, width)
  return jax.lax.psum(combined, summed) if summed else combined


def _token_pairs(x, experts, gates, weights, num_experts: int, top_k: int, ragged: bool):
  """Tokens x [n, D] with their experts / gates [n, k] through the expert group (its weights
  `weights`, gathered over 'fsdp') -> [n, D], before the sum over 'tensor'."""
  gate_weight, up_weight, down_weight = weights
  tokens, width = x.shape
  ranks = jax.lax.axis_size(AXIS)
  local_experts = gate_weight.shape[0]
  flat = experts.reshape(-1)  # [P]
  order = jnp.argsort(flat, stable=True)
  token = order // top_k
  rows = jnp.take(x, token, axis=0)  # [P, D], by expert and so by owning rank
  counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  if ranks == 1:  # every expert here: no exchange
    back = expert_mlp(rows, counts, gate_weight, up_weight, down_weight)
  else:
    dispatch, combine, group_sizes = _slices(jax.lax.all_gather(counts, AXIS), jax.lax.axis_index(AXIS), local_experts)
    transport = _Transport(ragged, capacity=tokens * min(top_k, local_experts))
    received = _exchange(transport, (len(rows), ranks * transport.capacity), rows, dispatch, combine)
    out = expert_mlp(received, group_sizes, gate_weight, up_weight, down_weight)  # rows past the groups: 0
    back = _exchange(transport, (len(out), len(rows)), out, combine, dispatch)  # [P, D], in `order`
  weighted = back * jnp.take(gates.reshape(-1), order)[:, None]
  return jnp.zeros((tokens, width), weighted.dtype).at[token].add(weighted)


def _slices(counts: jax.Array, rank: jax.Array, local_experts: int):
  """Where every slice goes, from the expert group's counts c [ep, E] (c[s, e]: the pairs sender s
  routes to expert e), the same on every device; a slice is one (sender, expert) run of rows.
  -> (dispatch, combine, group_sizes [El]): the (input_offsets, send_sizes, output_offsets,
  recv_sizes) of the exchange out (slices by expert e, to rank e // El) and of the one back
  (slices by sender s and local expert, to rank s), in ragged_all_to_all's meaning; and the rows of
  each of this rank's experts, all senders together."""
  ranks, num_experts = counts.shape
  sent_from = _exclusive_cumsum(counts, axis=1)  # [ep, E]: where among s's sorted rows e's start
  per_expert = jnp.sum(counts, axis=0)
  first_row = _exclusive_cumsum(per_expert.reshape(ranks, local_experts), axis=1).reshape(num_experts)
  lands_at = first_row[None] + _exclusive_cumsum(counts, axis=0)  # [ep, E]: on e's owner, expert-major
  mine = lambda a: jax.lax.dynamic_slice_in_dim(a, rank * local_experts, local_experts, axis=-1)  # noqa: E731
  dispatch = (sent_from[rank], counts[rank], lands_at[rank], mine(counts).reshape(-1))
  combine = (mine(lands_at).reshape(-1), mine(counts).reshape(-1), mine(sent_from).reshape(-1), counts[rank])
  return dispatch, combine, mine(per_expert)


@dataclasses.dataclass(frozen=True)
class _Transport:
  """How slices of rows travel within the expert group.

  ragged:   by ragged_all_to_all (TPUs, GPUs), else by a fixed-capacity all_to_all (CPUs).
  capacity: the most rows one device sends one rank (the fixed-capacity blocks' height).
  """

  ragged: bool
  capacity: int

  def move(self, operand, slices, out_rows: int):
    """operand [R, D] -> [out_rows, D]: the slices (input_offsets, send_sizes, output_offsets,
    recv_sizes, in ragged_all_to_all's meaning) written into zeros."""
    # zeros_like: typed as varying like the rows (ragged_all_to_all's result takes the buffer's type).
    output = jnp.zeros_like(operand, shape=(out_rows, operand.shape[1]))
    if self.ragged:
      return jax.lax.ragged_all_to_all(operand, output, *slices, axis_name=AXIS)
    return self._padded(operand, output, *slices)

  def _padded(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """ragged_all_to_all's result by a fixed-capacity all_to_all: each rank's slices are packed
    into a [capacity, D] block, and the receiver writes each block's slices at the offsets their
    sender chose."""
    ranks = jax.lax.axis_size(AXIS)
    slot = jnp.arange(self.capacity)

    def unpack(offsets, sizes):
      """For each rank's block [ep, capacity]: the row each slot holds, with slices of `sizes`
      [ep, S] packed in order at `offsets` [ep, S], and whether the slot holds one."""
      starts = _exclusive_cumsum(sizes, axis=1)
      # A slot belongs to the last slice starting at or before it (empty slices share a start).
      slice_of = jax.vmap(lambda s: jnp.searchsorted(s, slot, side='right') - 1)(starts)
      row = (jnp.take_along_axis(offsets, slice_of, axis=1) + slot[None]
             - jnp.take_along_axis(starts, slice_of, axis=1))
      return row, slot[None] < jnp.sum(sizes, axis=1, keepdims=True)

    source, valid = unpack(input_offsets.reshape(ranks, -1), send_sizes.reshape(ranks, -1))
    block = jnp.where(valid[..., None], jnp.take(operand, jnp.where(valid, source, 0), axis=0), 0)
    block = jax.lax.all_to_all(block, AXIS, 0, 0)  # [ep, capacity, D], now by sender
    landing = jax.lax.all_to_all(output_offsets.reshape(ranks, -1), AXIS, 0, 0)  # [ep, S]: where they land here
    target, valid = unpack(landing, recv_sizes.reshape(ranks, -1))
    target = jnp.where(valid, target, output.shape[0])  # past the end: dropped
    return output.at[target.reshape(-1)].set(block.reshape(-1, output.shape[1]), mode='drop')


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exchange(transport: _Transport, rows: tuple[int, int], operand, there, back):
  """operand [rows[0], D] -> [rows[1], D], moved by the slices `there`. Its VJP is the move back by
  `back`, the same slices reversed: jax's own transpose of ragged_all_to_all would first
  exchange the offsets again, and all-reduce a cotangent for the zeros it writes into."""
  return transport.move(operand, there, rows[1])


def _exchange_forward(transport, rows, operand, there, back):
  return _exchange(transport, rows, operand, there, back), (there, back)


def _exchange_backward(transport, rows, residuals, cotangent):
  there, back = residuals
  return _exchange(transport, rows[::-1], cotangent, back, there), None, None


_exchange.defvjp(_exchange_forward, _exchange_backward)
