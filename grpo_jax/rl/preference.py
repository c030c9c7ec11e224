"""Reward-model learning from preference pairs, as pure functions: the Bradley-Terry loss and the
pairwise accuracy over a batch of B pairs' scores, and the reward model's optimizer update on a batch
of pairs (`preference_update`).

Bradley-Terry (Bradley & Terry 1952; the reward-model loss of Ouyang et al. 2022): the chosen reply
of a pair beats the rejected one with probability sigmoid(r_chosen - r_rejected), and the model
minimises the pairs' mean negative log-likelihood

    loss = mean_b -log sigmoid(r_chosen_b - r_rejected_b - m_b) + c * mean_b (r_chosen_b + r_rejected_b)^2

m_b: an optional per-pair margin (how much better the chosen reply was rated, e.g. Llama 2's rating
gap): the chosen score must clear the rejected one by it before the pair stops pulling. c: the
optional centering coefficient (Eisenstein et al. 2023, "Helping or herding"): the Bradley-Terry
likelihood sees only differences, so a score's offset drifts freely; the term holds the pair's
mean near 0, which a reward composed with other terms (data/reward_terms.py) needs. Every function
is jittable; scores are [B] fp32.
"""

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from grpo_jax.errors import require
from grpo_jax.model import lora
from grpo_jax.rl.preference_packing import PackedLayout, packed_scores
from grpo_jax.rl.state import TrainState
from grpo_jax.sharding import constrain


def bradley_terry_terms(chosen: jax.Array, rejected: jax.Array, margin: jax.Array | None = None,
                        center_coef: float = 0.0) -> jax.Array:
  """Each pair's term of the loss [B] fp32 (see the module docstring)."""
  chosen, rejected = chosen.astype(jnp.float32), rejected.astype(jnp.float32)
  gap = chosen - rejected - (0.0 if margin is None else margin.astype(jnp.float32))
  terms = -jax.nn.log_sigmoid(gap)
  return terms + center_coef * jnp.square(chosen + rejected) if center_coef else terms


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array, margin: jax.Array | None = None,
                       center_coef: float = 0.0, weights: jax.Array | None = None) -> jax.Array:
  """The mean Bradley-Terry loss of B pairs' scores chosen [B], rejected [B] (see the module
  docstring); weights [B]: 1 on real pairs, 0 on the padding of a fixed-size batch (the mean is
  over real pairs)."""
  weights = jnp.ones_like(chosen, jnp.float32) if weights is None else weights.astype(jnp.float32)
  terms = bradley_terry_terms(chosen, rejected, margin, center_coef)
  return jnp.sum(terms * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def pairwise_accuracy(chosen: jax.Array, rejected: jax.Array, weights: jax.Array | None = None) -> jax.Array:
  """The fraction of real pairs whose chosen reply scores strictly higher (a tie counts as wrong)."""
  weights = jnp.ones_like(chosen, jnp.float32) if weights is None else weights.astype(jnp.float32)
  return jnp.sum((chosen > rejected) * weights) / jnp.maximum(jnp.sum(weights), 1.0)


# ---- the update ----


@struct.dataclass
class PreferenceBatch:
  """B preference pairs as the reward model reads them: each side's tokens [B, T] int32, padded
  with the reward model's pad id, and its 0/1 mask [B, T] (segment ids: 1 on the conversation's
  tokens); margin [B] fp32 or None; weights [B]: 1 on real pairs, 0 on the padding of a fixed-size
  batch."""

  chosen: jax.Array
  chosen_mask: jax.Array
  rejected: jax.Array
  rejected_mask: jax.Array
  weights: jax.Array
  margin: jax.Array | None = None

  def micro(self, count: int) -> 'PreferenceBatch':
    """[count, B / count, ...]: the pairs in `count` micro-batches of consecutive pairs."""
    rows = self.weights.shape[0]
    require(rows % count == 0, 'preferences.micro_batches', f'must divide the {rows} pairs of a batch, got {count}')
    return jax.tree.map(lambda x: x.reshape((count, rows // count) + x.shape[1:]), self)


def pair_scores(model, batch: PreferenceBatch, packed: PackedLayout | None = None) -> tuple[jax.Array, jax.Array]:
  """The reward model's scores of each pair's chosen and rejected conversation, [B] fp32 each: one
  forward over both sides stacked, each row read at its last token that is not the pad id; with
  `packed`, over the 2B conversations packed into rows (rl/preference_packing.py), where a padding
  pair (weight 0) takes no room."""
  rows = batch.chosen.shape[0]
  tokens = jnp.concatenate([batch.chosen, batch.rejected])
  masks = jnp.concatenate([batch.chosen_mask, batch.rejected_mask])
  if packed is None:
    scores = model.scores(constrain(tokens, ('batch', 'seq')), segment_ids=constrain(masks, ('batch', 'seq')))[:, 0]
  else:
    real = jnp.concatenate([batch.weights, batch.weights]) > 0
    scores = packed_scores(model, tokens, masks * real[:, None].astype(masks.dtype), packed)
  return scores[:rows], scores[rows:]


def preference_update(state: TrainState, batch: PreferenceBatch, *, graphdef, optimizer: optax.GradientTransformation,
                      schedule: optax.Schedule, micro_batches: int = 1, center_coef: float = 0.0,
                      packed: PackedLayout | None = None) -> tuple[TrainState, dict]:
  """One optimizer update of a reward model on B preference pairs: the Bradley-Terry loss's mean
  over the real pairs, its gradient accumulated over `micro_batches` micro-batches of B /
  micro_batches pairs (the same update as one batch, in a micro-batch's memory). An update whose
  loss or gradient is not finite is skipped and counted, as the RL update does. What trains is
  `state.params`: every parameter, or with LoRA the adapters and the score head (model/lora.py
  split_trainable), the frozen base in `state.frozen`. With `packed`, each micro-batch's pairs are
  packed into its own rows (pair_scores): both sides of a pair in one micro-batch, the same update.
  Traceable; the step counts one."""
  frozen = state.frozen
  micro = batch.micro(micro_batches)
  real = jnp.maximum(jnp.sum(batch.weights.astype(jnp.float32)), 1.0)

  def sums(params, piece: PreferenceBatch):
    chosen, rejected = pair_scores(nnx.merge(graphdef, lora.join(params, frozen)), piece, packed)
    weights = piece.weights.astype(jnp.float32)
    terms = bradley_terry_terms(chosen, rejected, piece.margin, center_coef)
    aux = dict(correct=jnp.sum((chosen > rejected) * weights), chosen_score=jnp.sum(chosen * weights),
               rejected_score=jnp.sum(rejected * weights))
    return jnp.sum(terms * weights), aux

  def accumulate(carry, piece):
    value, grads, aux = carry
    (piece_value, piece_aux), piece_grads = jax.value_and_grad(sums, has_aux=True)(state.params, piece)
    return (value + piece_value, jax.tree.map(jnp.add, grads, piece_grads),
            jax.tree.map(jnp.add, aux, piece_aux)), None

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  start = (jnp.zeros((), jnp.float32), zeros, dict(correct=jnp.zeros(()), chosen_score=jnp.zeros(()),
                                                   rejected_score=jnp.zeros(())))
  (total, grads, aux), _ = jax.lax.scan(accumulate, start, micro)
  loss, grads = total / real, jax.tree.map(lambda g: g / real, grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  step_updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, step_updates)
  keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
  metrics = dict(loss=loss, accuracy=aux['correct'] / real, chosen_score_mean=aux['chosen_score'] / real,
                 rejected_score_mean=aux['rejected_score'] / real, grad_norm=grad_norm, lr=schedule(state.updates),
                 nonfinite=(~finite).astype(jnp.float32), pairs=real)
  metrics['score_gap_mean'] = metrics['chosen_score_mean'] - metrics['rejected_score_mean']
  new_state = state.replace(params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
                            updates=state.updates + finite.astype(jnp.int32),
                            skips=jnp.where(finite, 0, state.skips + 1), step=state.step + 1)
  return new_state, metrics
