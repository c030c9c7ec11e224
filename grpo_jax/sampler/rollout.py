"""GRPO groups: P prompts x G completions, decoded in one jitted function.

The P prompts are prefilled once (decode.prefill); each prefix is copied into its G decode rows;
a `lax.while_loop` runs decode.decode_step until every row has emitted a stop token or
`max_new_tokens` tokens. Request p * G + g (sample g of prompt p) draws from its own key, exactly
as on the JetStream engine's path. The function takes the model's parameter state as an argument,
so the trainer's live parameters are read in place: no copy and no resharding when sampler and
trainer share a mesh.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.model.qwen2 import KVCache, Qwen2
from grpo_jax.sampler.decode import DecodeSettings, DecodeState, decode_step, prefill, request_keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
  """Completions of P prompts x G samples; row p * G + g is sample g of prompt p. The output of
  every sampling path (jax arrays from the jitted sampler, numpy from the engine's host loop).

  tokens:     [P*G, N] int32, N = max_new_tokens; `pad_id` after a row finished.
  log_probs:  [P*G, N] fp32, log softmax(logits / T) of each sampled token; 0 where masked.
  mask:       [P*G, N] bool, True on completion tokens (the stop token included).
  lengths:    [P*G] int32, completion tokens per row.
  stopped:    [P*G] bool, True if the row ended with a stop token (finish reason 'stop'), False
              if it ran out of tokens ('length').
  """

  tokens: jax.Array
  log_probs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  stopped: jax.Array

  @property
  def finish_reasons(self) -> list[str]:
    """'stop' or 'length' per row (reads `stopped` back to the host)."""
    return ['stop' if stopped else 'length' for stopped in np.asarray(self.stopped)]


def _repeat_rows(tree, group_size: int, axis: int = 0):
  return jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=axis), tree)


def sample_groups(model: Qwen2, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                  group_size: int, settings: DecodeSettings) -> Rollout:
  """Samples G completions for each of P prompts. Traceable: run it under jit (see GroupSampler).

  prompts [P, Tp] int32, left- or right-padded; prompt_mask [P, Tp], 1 on real tokens.
  """
  num_prompts, prompt_length = prompts.shape
  rows, steps = num_prompts * group_size, settings.max_new_tokens
  prefix = prefill(model, prompts, prompt_mask.astype(jnp.int32),
                   model.init_cache(num_prompts, prompt_length + steps))
  cache = prefix.cache
  state = DecodeState(
      cache=KVCache(k=_repeat_rows(cache.k, group_size, axis=1), v=_repeat_rows(cache.v, group_size, axis=1),
                    segment_ids=_repeat_rows(cache.segment_ids, group_size),
                    length=_repeat_rows(cache.length, group_size)),
      hidden=_repeat_rows(prefix.hidden, group_size), keys=request_keys(key, rows),
      generated=jnp.zeros((rows,), jnp.int32), live=~_repeat_rows(prefix.empty, group_size))
  # Every row starts at step 0, so a live row emits its n-th token at loop step n.
  outputs = Rollout(tokens=jnp.full((rows, steps), settings.pad_id, jnp.int32),
                    log_probs=jnp.zeros((rows, steps), jnp.float32), mask=jnp.zeros((rows, steps), bool),
                    lengths=jnp.zeros((rows,), jnp.int32), stopped=jnp.zeros((rows,), bool))

  def keep_going(carry):
    _, state, _ = carry
    return jnp.any(state.live)

  def step(carry):
    index, state, out = carry
    state, emitted = decode_step(model, state, settings)
    out = Rollout(tokens=out.tokens.at[:, index].set(emitted.tokens),
                  log_probs=out.log_probs.at[:, index].set(emitted.log_probs),
                  mask=out.mask.at[:, index].set(emitted.valid),
                  lengths=jnp.where(emitted.valid, emitted.lengths, out.lengths),
                  stopped=out.stopped | emitted.stopped)
    return index + 1, state, out

  _, _, outputs = jax.lax.while_loop(keep_going, step, (jnp.int32(0), state, outputs))
  return outputs


class GroupSampler:
  """Jitted `sample_groups` over a model's parameter state.

  `sampler(state, prompts, prompt_mask, key)` with `state = nnx.state(model)` (e.g. the trainer's
  live parameters); the graph definition and the static settings are fixed at construction.
  """

  def __init__(self, model: Qwen2, *, group_size: int, settings: DecodeSettings):
    graphdef, _ = nnx.split(model)

    @jax.jit
    def run(state, prompts, prompt_mask, key):
      return sample_groups(nnx.merge(graphdef, state), prompts, prompt_mask, key, group_size=group_size,
                           settings=settings)

    self._run = run

  def __call__(self, state, prompts, prompt_mask, key) -> Rollout:
    return self._run(state, prompts, prompt_mask, key)
