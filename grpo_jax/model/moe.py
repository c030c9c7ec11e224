"""The mixture-of-experts MLP of Qwen3-MoE: the router, routing replay, and the experts computed
dropless with grouped (ragged) matmuls.

A sparse layer scores each token against the E experts (router [D, E]), takes the softmax in fp32
and sends the token to its k most probable experts, weighting their outputs by those
probabilities (renormalised over the k when `norm_topk_prob`). Every token is computed: the
N * k (token, expert) pairs are sorted by expert, and each expert's SwiGLU multiplies its
contiguous run of rows with one grouped matmul per projection (ops/grouped_matmul.py: XLA's
ragged dot on TPUs, a Triton kernel on GPUs, where XLA:GPU would expand the ragged dot into
[experts, rows, ...] tensors), never a [tokens, experts, M] tensor. On CPUs the experts run densely
instead (experts_dense: every expert on every token, the unchosen ones weighted 0), which is
cheaper there than XLA:CPU's lowering of the ragged dot, itself a masked product over all experts.

Routing replay: given the expert ids a token was routed to before (the sampler's, recorded with
the rollout), the layer sends it to those experts while the gates still come from the live
router's softmax at those ids, so the router keeps its gradient. A token whose recorded ids are
`unrecorded` (the dtype's largest value; a token the sampler never fed back, such as an answer's
last) takes the live router's choice.

Shapes: x [B, T, D], router [D, E], expert_gate / expert_up [E, D, M], expert_down [E, M, D],
routes [B, T, k] int.
"""

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.model import expert_parallel
from grpo_jax.model.linear import matmul
from grpo_jax.ops import fixed_order
from grpo_jax.ops.grouped_matmul import expert_mlp
from grpo_jax.sharding import constrain


def route_dtype(num_experts: int) -> jnp.dtype:
  """The compact integer dtype recorded routes travel in: uint8 up to 255 experts, else int16."""
  return jnp.dtype(jnp.uint8 if num_experts <= 255 else jnp.int16)


def unrecorded_id(dtype) -> int:
  """What a route of `dtype` holds for a token that was not routed: the dtype's largest value,
  never an expert id."""
  return int(jnp.iinfo(dtype).max)


def unrecorded(shape, num_experts: int) -> jax.Array:
  """Routes of tokens that were not routed (`unrecorded_id`)."""
  dtype = route_dtype(num_experts)
  return jnp.full(shape, unrecorded_id(dtype), dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """What the sparse layers decided for B x T tokens (stacked over the Ls sparse layers).

  experts:     [B, T, Ls, k] route_dtype, the experts each token was computed with.
  load:        [Ls, E] fp32, (token, expert) pairs per expert, real tokens only.
  probability: [Ls, E] fp32, the router's softmax summed over real tokens.
  tokens:      [] fp32, real tokens (the normaliser of both sums).
  differs:     [B, T] bool, some layer's live top-k set is not the one used (always False
               without replay): the tokens replay re-routed.
  """

  experts: jax.Array
  load: jax.Array
  probability: jax.Array
  tokens: jax.Array
  differs: jax.Array

  def aux_loss(self) -> jax.Array:
    """The load-balancing loss as transformers' `load_balancing_loss_func` computes it over the
    sparse layers: E * sum_e f_e P_e, f_e the fraction of (token, k) pairs sent to expert e and
    P_e the mean router probability of e, both over every layer's real tokens. On the routes used
    (the recorded ones with replay)."""
    layers, experts = self.load.shape
    rows = jnp.maximum(self.tokens * layers, 1.0)
    fraction = jnp.sum(self.load, axis=0) / rows
    probability = jnp.sum(self.probability, axis=0) / rows
    return experts * jnp.sum(fraction * probability)

  def imbalance(self) -> jax.Array:
    """max / mean (token, expert) pairs per expert, averaged over the sparse layers (1: balanced)."""
    mean = jnp.maximum(jnp.mean(self.load, axis=1), 1e-9)
    return jnp.mean(jnp.max(self.load, axis=1) / mean)


@dataclasses.dataclass(frozen=True)
class Router:
  """How a sparse layer scores and chooses its experts: Qwen3-MoE's softmax and top k, or
  DeepSeekMoE's (`scoring` 'sigmoid'): sigmoid scores in fp32, the choice made on the scores plus
  the layer's bias (router_bias) within the `top_groups` of `groups` groups of experts whose two
  best biased scores sum highest, the gates the unbiased scores (renormalised over the k with
  norm_topk_prob) times `scaling`."""

  scoring: str = 'softmax'
  groups: int = 1
  top_groups: int = 1
  scaling: float = 1.0

  @classmethod
  def of(cls, config) -> 'Router':
    return cls(config.router_scoring, config.n_group, config.topk_group, config.routed_scaling_factor)


def _grouped_choice(choice: jax.Array, groups: int, top_groups: int) -> jax.Array:
  """choice [B, T, E] with the experts outside each token's top_groups groups (by the sum of a
  group's two best) at -inf."""
  if groups == 1:
    return choice
  per_group = choice.reshape(choice.shape[:-1] + (groups, -1))
  group_scores = jnp.sum(jax.lax.top_k(per_group, 2)[0], axis=-1)  # [B, T, groups]
  _, best = jax.lax.top_k(group_scores, top_groups)
  kept = jnp.any(jax.nn.one_hot(best, groups, dtype=bool), axis=-2)  # [B, T, groups]
  return jnp.where(kept[..., None], per_group, -jnp.inf).reshape(choice.shape)


def route(h: jax.Array, router: jax.Array, *, top_k: int, norm_topk_prob: bool,
          replay: jax.Array | None = None, bias: jax.Array | None = None,
          rule: Router = Router()) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """h [B, T, D] (compute dtype), router [D, E] -> (experts [B, T, k] int32, gates [B, T, k] in h's
  dtype, probabilities [B, T, E] fp32, differs [B, T] bool).

  replay [B, T, k] (`unrecorded` rows: the live choice): route to those experts instead of the top k; the gates
  are the live softmax at them, renormalised over them when `norm_topk_prob`. With `rule` sigmoid
  (DeepSeekMoE; bias [E] fp32 the choice's) the gates are the live sigmoid scores at them, the
  probabilities the scores normalised over the E (what the load statistics sum).
  """
  if rule.scoring == 'sigmoid':
    return _sigmoid_route(h, router, bias, top_k=top_k, norm_topk_prob=norm_topk_prob, replay=replay, rule=rule)
  if fixed_order.exact('matmul'):
    logits = matmul(h, router.astype(h.dtype))
  else:
    logits = jnp.einsum('BTD,DE->BTE', h, router.astype(h.dtype))
  exact = fixed_order.exact('sum')
  probabilities = (fixed_order.softmax if exact else jax.nn.softmax)(logits.astype(jnp.float32), axis=-1)
  _, chosen = jax.lax.top_k(probabilities, top_k)
  experts, differs = _replayed(chosen, replay, probabilities.shape[-1])
  gates = jnp.take_along_axis(probabilities, experts, axis=-1)
  if norm_topk_prob:
    gates = gates / (fixed_order.fold_sum(gates, axis=-1)[..., None] if exact else jnp.sum(gates, axis=-1, keepdims=True))
  return experts, gates.astype(h.dtype), probabilities, differs


def _replayed(chosen: jax.Array, replay: jax.Array | None, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(the experts used [B, T, k], whether they differ from the live choice [B, T]): the recorded
  ones where replay holds a route, the live choice elsewhere."""
  if replay is None:
    return chosen, jnp.zeros(chosen.shape[:-1], bool)
  replay = replay.astype(jnp.int32)
  recorded = (replay[..., :1] >= 0) & (replay[..., :1] < num_experts)
  experts = jnp.where(recorded, replay, chosen)
  return experts, jnp.any(jnp.sort(experts, axis=-1) != jnp.sort(chosen, axis=-1), axis=-1)


def _sigmoid_route(h, router, bias, *, top_k, norm_topk_prob, replay, rule):
  """route's DeepSeekMoE rule, in fp32 throughout (transformers' DeepseekV3TopkRouter)."""
  logits = jnp.einsum('BTD,DE->BTE', h.astype(jnp.float32), router.astype(jnp.float32))
  scores = jax.nn.sigmoid(logits)
  # The bias chooses and never weighs, so no gradient reaches it (top_k's indices have none).
  choice = _grouped_choice(scores + jax.lax.stop_gradient(bias), rule.groups, rule.top_groups)
  _, chosen = jax.lax.top_k(choice, top_k)
  experts, differs = _replayed(chosen, replay, scores.shape[-1])
  gates = jnp.take_along_axis(scores, experts, axis=-1)
  if norm_topk_prob:
    gates = gates / (jnp.sum(gates, axis=-1, keepdims=True) + 1e-20)
  gates = gates * rule.scaling
  probabilities = scores / jnp.sum(scores, axis=-1, keepdims=True)
  return experts, gates.astype(h.dtype), probabilities, differs


def experts_forward(x: jax.Array, experts: jax.Array, gates: jax.Array, gate_weight: jax.Array,
                    up_weight: jax.Array, down_weight: jax.Array) -> jax.Array:
  """x [B, T, D] through each token's k experts, weighted by gates [B, T, k] and summed -> [B, T, D].

  The B * T * k (token, expert) pairs are sorted by expert and each projection is one grouped
  matmul over the E runs (`grouped_matmul`): dropless, every pair computed, no capacity factor.
  """
  batch, length, width = x.shape
  top_k = experts.shape[-1]
  num_experts = gate_weight.shape[0]
  flat = experts.reshape(-1)  # [B*T*k]
  order = jnp.argsort(flat, stable=True)
  token = order // top_k
  sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  rows = jnp.take(x.reshape(-1, width), token, axis=0)  # [B*T*k, D], grouped by expert
  out = expert_mlp(rows, sizes, gate_weight, up_weight, down_weight)  # [B*T*k, D]
  out = out * jnp.take(gates.reshape(-1), order)[:, None]
  combined = jnp.zeros((batch * length, width), out.dtype).at[token].add(out)
  return constrain(combined.reshape(batch, length, width), ('batch', 'seq', 'act_embed'))


def experts_dense(x: jax.Array, experts: jax.Array, gates: jax.Array, gate_weight: jax.Array,
                  up_weight: jax.Array, down_weight: jax.Array) -> jax.Array:
  """experts_forward's result computed by every expert for every token, the k chosen ones weighted by
  their gates and the rest by 0: E / k times the active FLOPs, no sort, gather or scatter. The CPU's
  path: XLA:CPU lowers `ragged_dot` as a masked product over all E experts of all B * T * k pairs
  (k times more work than this), and the tiny CPU models are bound by per-op overheads."""
  num_experts, width, hidden_width = gate_weight.shape
  weights = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=gates.dtype) * gates[..., None], axis=-2)  # [B, T, E]
  # As 2-D matmuls over the experts' weights side by side, [D, E*M] (linear.matmul says why).
  side_by_side = lambda w: jnp.moveaxis(w, 0, 1).reshape(width, num_experts * hidden_width)  # noqa: E731
  # settle: under exact numerics the activation materialised on its own (ops/fixed_order.settle).
  hidden = fixed_order.settle(jax.nn.silu(matmul(x, side_by_side(gate_weight))) * matmul(x, side_by_side(up_weight)))
  hidden = fixed_order.settle(hidden.reshape(x.shape[:2] + (num_experts, hidden_width)) * weights[..., None])
  return matmul(hidden, down_weight, contract=2)


def dense_experts_here() -> bool:
  """Whether the experts run densely (experts_dense): when the program is for CPUs."""
  from grpo_jax.ops.logprob import target_platform  # the one rule for what a trace is compiled for
  return target_platform() == 'cpu'


def sparse_mlp(params: dict, h: jax.Array, real: jax.Array, *, top_k: int, norm_topk_prob: bool,
               replay: jax.Array | None = None, router: Router = Router()) -> tuple[jax.Array, Routing]:
  """One sparse layer's MLP. params: router_weight [D, E], expert_gate_weight, expert_up_weight
  [E, D, M], expert_down_weight [E, M, D] in the compute dtype; h [B, T, D]; real [B, T] bool, the
  tokens that count in the load statistics. -> (out [B, T, D], this layer's Routing, with
  `experts` [B, T, k] and load / probability [E])."""
  experts, gates, probabilities, differs = route(h, params['router_weight'], top_k=top_k,
                                                 norm_topk_prob=norm_topk_prob, replay=replay,
                                                 bias=params.get('router_bias'), rule=router)
  if fixed_order.exact('matmul'):
    # Exact numerics: the dense form on every mesh, whose combine is the down projection's fold over
    # the experts (an unchosen one adds exact zeros), not a scatter-add in whatever order the pairs
    # land. E / k times the experts' FLOPs.
    compute = experts_dense
  elif expert_parallel.applies(params['expert_gate_weight'].shape[0]):
    compute = expert_parallel.experts_forward  # the experts on the devices that hold them
  else:
    compute = experts_dense if dense_experts_here() else experts_forward
  out = compute(h, experts, gates, params['expert_gate_weight'], params['expert_up_weight'],
                params['expert_down_weight'])
  weight = real.astype(jnp.float32)
  num_experts = probabilities.shape[-1]
  load = jnp.einsum('BTkE,BT->E', jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), weight)
  probability = jnp.einsum('BTE,BT->E', probabilities, weight)
  routing = Routing(experts=experts.astype(route_dtype(num_experts)), load=load, probability=probability,
                    tokens=jnp.sum(weight), differs=differs & real)
  return out, routing


def gathered(stacked: Routing | None) -> Routing | None:
  """The sparse layers' Routing stacked over Ls -> the model's: experts [B, T, Ls, k], a token re-routed
  when any layer re-routed it."""
  if stacked is None:
    return None
  return Routing(experts=jnp.moveaxis(stacked.experts, 0, 2), load=stacked.load, probability=stacked.probability,
                 tokens=stacked.tokens[0], differs=jnp.any(stacked.differs, axis=0))
