"""GRPO groups: P prompts x G completions, decoded in one jitted function.

Each prompt is prefilled once; its KV prefix is copied into G decode rows; the decode loop is a
`lax.while_loop` that stops when every row has emitted a stop token or `max_new_tokens` tokens.
The function takes the model's parameter state as an argument, so the trainer's live parameters
are read in place: no copy and no resharding when sampler and trainer share a mesh.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.model.qwen2 import KVCache, Qwen2
from grpo_jax.sampler.sampling import SamplingConfig, select


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
  """Completions of P prompts x G samples; row p * G + g is sample g of prompt p.

  tokens:     [P*G, N] int32, N = max_new_tokens; `pad_id` after a row finished.
  log_probs:  [P*G, N] fp32, log softmax(logits / T) of each sampled token; 0 where masked.
  mask:       [P*G, N] bool, True on completion tokens (the stop token included).
  lengths:    [P*G] int32, completion tokens per row.
  stopped:    [P*G] bool, True if the row ended with a stop token ('stop'), else 'length'.
  """

  tokens: jax.Array
  log_probs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  stopped: jax.Array


def _repeat_rows(cache: KVCache, group_size: int) -> KVCache:
  """Copies each prompt's cache row into G consecutive decode rows."""
  return KVCache(k=jnp.repeat(cache.k, group_size, axis=1), v=jnp.repeat(cache.v, group_size, axis=1),
                 segment_ids=jnp.repeat(cache.segment_ids, group_size, axis=0),
                 length=jnp.repeat(cache.length, group_size, axis=0))


def sample_groups(model: Qwen2, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                  group_size: int, max_new_tokens: int, sampling: SamplingConfig,
                  stop_token_ids: tuple[int, ...] = (), pad_id: int = 0) -> Rollout:
  """Samples G completions for each of P prompts. Traceable: run it under jit (see GroupSampler).

  prompts [P, Tp] int32, left- or right-padded; prompt_mask [P, Tp], 1 on real tokens.
  """
  num_prompts, prompt_length = prompts.shape
  rows = num_prompts * group_size
  cache = model.init_cache(num_prompts, prompt_length + max_new_tokens)
  hidden, cache = model.extend(prompts, cache, segment_ids=prompt_mask, return_hidden=True)
  # The next-token logits sit at each prompt's last real token (left or right padding alike);
  # only those P positions are projected onto the vocabulary.
  last = jnp.max(jnp.where(prompt_mask > 0, jnp.arange(prompt_length), -1), axis=1)
  next_logits = model.project(jnp.take_along_axis(hidden, last[:, None, None], axis=1))[:, 0]
  cache = _repeat_rows(cache, group_size)
  next_logits = jnp.repeat(next_logits, group_size, axis=0)
  stop_ids = jnp.asarray(stop_token_ids or (-1,), jnp.int32)

  def emit(state, step, logits, key):
    tokens, log_probs, done = state['tokens'], state['log_probs'], state['done']
    token, log_prob = select(logits, key, sampling)
    live = ~done
    tokens = tokens.at[:, step].set(jnp.where(live, token, pad_id))
    log_probs = log_probs.at[:, step].set(jnp.where(live, log_prob, 0.0))
    stopped = state['stopped'] | (live & jnp.isin(token, stop_ids))
    return dict(state, tokens=tokens, log_probs=log_probs, stopped=stopped, done=done | stopped,
                mask=state['mask'].at[:, step].set(live), last=token)

  key, first = jax.random.split(key)
  state = dict(tokens=jnp.full((rows, max_new_tokens), pad_id, jnp.int32),
               log_probs=jnp.zeros((rows, max_new_tokens), jnp.float32),
               mask=jnp.zeros((rows, max_new_tokens), bool),
               stopped=jnp.zeros((rows,), bool), done=jnp.zeros((rows,), bool),
               last=jnp.zeros((rows,), jnp.int32))
  state = emit(state, 0, next_logits, first)

  def keep_going(carry):
    step, _, state, _ = carry
    return (step < max_new_tokens) & ~jnp.all(state['done'])

  def decode_step(carry):
    step, cache, state, key = carry
    logits, cache = model.extend(state['last'][:, None], cache)
    key, subkey = jax.random.split(key)
    return step + 1, cache, emit(state, step, logits[:, 0], subkey), key

  _, _, state, _ = jax.lax.while_loop(keep_going, decode_step, (jnp.int32(1), cache, state, key))
  return Rollout(tokens=state['tokens'], log_probs=state['log_probs'], mask=state['mask'],
                 lengths=state['mask'].sum(axis=1, dtype=jnp.int32), stopped=state['stopped'])


class GroupSampler:
  """Jitted `sample_groups` over a model's parameter state.

  `sampler(state, prompts, prompt_mask, key)` with `state = nnx.state(model)` (e.g. the trainer's
  live parameters); the graph definition and the static settings are fixed at construction.
  """

  def __init__(self, model: Qwen2, *, group_size: int, max_new_tokens: int,
               sampling: SamplingConfig = SamplingConfig(), stop_token_ids: tuple[int, ...] = (),
               pad_id: int = 0):
    graphdef, _ = nnx.split(model)
    settings = dict(group_size=group_size, max_new_tokens=max_new_tokens, sampling=sampling,
                    stop_token_ids=tuple(stop_token_ids), pad_id=pad_id)

    @jax.jit
    def run(state, prompts, prompt_mask, key):
      return sample_groups(nnx.merge(graphdef, state), prompts, prompt_mask, key, **settings)

    self._run = run

  def __call__(self, state, prompts, prompt_mask, key) -> Rollout:
    return self._run(state, prompts, prompt_mask, key)
