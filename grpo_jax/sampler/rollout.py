"""GRPO groups: P prompts x G completions, decoded in one jitted function, with continuous batching.

The P prompts are prefilled once (decode.prefill) into a shared prompt cache that every sample of
a prompt reads in place (model.qwen2.SharedPrefix). The R = P * G requests (request p * G + g is
sample g of prompt p) wait in a queue on the devices; B decode slots (`slots`, default R) each hold
one request at a time. One `lax.while_loop` iteration first gives every free slot the next waiting
request (its prompt index, its hidden state and key, an emptied cache row: no copy of the prompt),
then runs decode.decode_step over all B slots, and writes each emitted token to its request's row
of the output. The loop ends when every request has finished, so a slot freed by a short answer
takes the next request at once and long-tailed lengths no longer keep the batch idle. Each request
draws from its own key, so its tokens and log-probs do not depend on B or on the slot it lands in
(and equal the JetStream engine's). The function takes the model's parameter state as an argument:
the trainer's live parameters, read in place, or (`sample_resident` with a RolloutLayout) cast and
laid out once per rollout in the sampler's own tensor-parallel layout (sampler/layout.py), so no
weight moves inside the decode loop. On a mesh, prompts, slots and requests are split into n
groups over the batch axes and each group's slots serve only its own requests, so no prompt cache
crosses devices.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.errors import require
from grpo_jax.model.qwen2 import Qwen2, SharedPrefix
from grpo_jax.model.sharding import batch_groups, grouped
from grpo_jax.sampler.decode import DecodeSettings, DecodeState, decode_step, prefill, request_keys
from grpo_jax.sampler.layout import RolloutLayout
from grpo_jax.sampler.sampling import SamplingConfig
from grpo_jax.sections import inline, section


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """The `rollout` config section: how the policy samples an RL step's completions. The sampling
  settings (greedy, temperature T, which the trainer's log-probs also use, top_k, top_p) are
  written in this section: `rollout.temperature`."""

  sampling: SamplingConfig = inline(SamplingConfig())
  prompts_per_step: int = 16  # P: prompts per RL step; a step scores P * G completions
  max_new_tokens: int = 8  # N_max: completion budget; longer answers end with finish reason 'length'
  # B: decode slots (continuous batching, below); a slot freed by a finished answer takes the next
  # waiting request. 0: one slot per completion (P * G); fewer bounds the KV cache.
  slots: int = 0
  # t: devices per tensor-parallel group of the sampler's own layout (sampler/layout.py): the
  # weights are resident, split over t devices and replicated over the n / t groups. 0: the largest
  # t dividing the KV heads and the devices, within one host on GPUs (1 on CPUs).
  tensor: int = 0
  # Split devices: the last `devices` devices are the sampler's own and the mesh section lays out
  # the trainer over the rest; the sampler decodes step t+1's groups while the trainer trains on
  # step t's (needs algo.max_lag >= 1: the sampler is one version behind; a jittable task's steps
  # then run one per call). 0: sampler and trainer share every device, one after the other.
  devices: int = 0
  # Agents (task.name: agent): decode steps per call of the inference server (agents/inference.py);
  # finished turns leave their slots, and waiting ones enter, between calls.
  decode_chunk: int = 4
  # Agents: keep each turn's KV cache for the episode's next turn (agents/inference.py). With fewer
  # slots than episodes, whether a turn finds its cache depends on timing, and a reused cache can
  # change a token by rounding: false makes such runs replay bit-exactly.
  reuse_turn_caches: bool = True

  def __post_init__(self):
    with section('rollout'):
      require(self.decode_chunk >= 1, 'decode_chunk', f'must be >= 1, got {self.decode_chunk}')
      require(self.tensor >= 0, 'tensor', f'must be >= 0 (0: chosen for the model and devices), got {self.tensor}')
      require(self.prompts_per_step >= 1, 'prompts_per_step', f'must be >= 1, got {self.prompts_per_step}')
      require(self.max_new_tokens >= 1, 'max_new_tokens', f'must be >= 1, got {self.max_new_tokens}')
      require(self.slots >= 0, 'slots', f'must be >= 0 (0: one per completion), got {self.slots}')
      require(self.devices >= 0, 'devices', f'must be >= 0 (0: the trainer\'s devices), got {self.devices}')

  def decode_settings(self, stop_token_ids, pad_id: int) -> DecodeSettings:
    """The sampler's static settings for a task's stop and pad ids."""
    return DecodeSettings(sampling=self.sampling, max_new_tokens=self.max_new_tokens,
                          stop_token_ids=tuple(stop_token_ids), pad_id=pad_id)


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
  decode_steps: int32 scalar, the decode loop's iterations (the jitted sampler; None elsewhere):
              with B slots, B * decode_steps row-steps ran, sum(lengths) of them useful.
  context:    [P*G, N] bool, every token of the row's sequence after its prompt: an agent's
              episode holds the environment's tokens between the policy's (agents/trajectory.py),
              where `mask` holds the policy's only and `lengths` counts them. None: `mask`.
  versions:   [P*G, N] int32, the policy version (RL steps done) that sampled each token, -1 where
              masked: partial rollouts (sampler/partial.py) carry answers across steps. None: the
              current version sampled every token.
  """

  tokens: jax.Array
  log_probs: jax.Array
  mask: jax.Array
  lengths: jax.Array
  stopped: jax.Array
  decode_steps: jax.Array | None = None
  context: jax.Array | None = None
  versions: jax.Array | None = None

  @property
  def sequence_mask(self) -> jax.Array:
    """[P*G, N] the tokens of each row's sequence after its prompt (what the model attends to)."""
    return self.mask if self.context is None else self.context

  ROWS = ('tokens', 'log_probs', 'mask', 'lengths', 'stopped')  # the per-request fields

  @property
  def finish_reasons(self) -> list[str]:
    """'stop' or 'length' per row (reads `stopped` back to the host)."""
    return ['stop' if stopped else 'length' for stopped in np.asarray(self.stopped)]


def _per_group(fn, *args):
  """fn mapped over the group axis of every argument (a gather or scatter within each group)."""
  return jax.vmap(fn)(*args)


def sample_groups(model: Qwen2, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                  group_size: int, settings: DecodeSettings, slots: int = 0) -> Rollout:
  """Samples G completions for each of P prompts through `slots` decode rows (0: one per request).
  Traceable: run it under jit (see GroupSampler).

  prompts [P, Tp] int32, left- or right-padded; prompt_mask [P, Tp], 1 on real tokens. Returns the
  Rollout in request order, with `decode_steps` (loop iterations) set.
  """
  num_prompts, prompt_length = prompts.shape
  requests, steps = num_prompts * group_size, settings.max_new_tokens
  slots = min(slots or requests, requests)
  groups = batch_groups(num_prompts, slots)
  per_prompts, per_slots, per_requests = num_prompts // groups, slots // groups, requests // groups
  prefix = prefill(model, prompts, prompt_mask.astype(jnp.int32), model.init_cache(num_prompts, prompt_length))
  cache = prefix.cache
  layers = cache.k.shape[0]
  split = lambda x: x.reshape((layers, groups, per_prompts) + x.shape[2:])  # noqa: E731
  shared = SharedPrefix(k=split(cache.k), v=split(cache.v), segment_ids=grouped(cache.segment_ids, groups),
                        index=jnp.zeros((groups, per_slots), jnp.int32))
  hidden, empty = grouped(prefix.hidden, groups), grouped(prefix.empty, groups)
  keys = grouped(request_keys(key, requests), groups)  # [n, R / n]
  state = DecodeState(cache=model.init_cache(slots, steps), hidden=jnp.zeros((slots, hidden.shape[-1]), hidden.dtype),
                      keys=keys[:, :per_slots].reshape(slots), generated=jnp.zeros((slots,), jnp.int32),
                      live=jnp.zeros((slots,), bool), prefix=shared)
  outputs = Rollout(tokens=jnp.full((groups, per_requests, steps), settings.pad_id, jnp.int32),
                    log_probs=jnp.zeros((groups, per_requests, steps), jnp.float32),
                    mask=jnp.zeros((groups, per_requests, steps), bool),
                    lengths=jnp.zeros((groups, per_requests), jnp.int32),
                    stopped=jnp.zeros((groups, per_requests), bool))
  # Per group: the request each slot holds (-1: none yet) and the next request waiting.
  holding = jnp.full((groups, per_slots), -1, jnp.int32)
  waiting = jnp.zeros((groups,), jnp.int32)

  def keep_going(carry):
    _, state, _, waiting, _ = carry
    return jnp.any(state.live) | jnp.any(waiting < per_requests)

  def insert(state: DecodeState, holding, waiting):
    """Every free slot takes the next waiting request of its group, in request order."""
    free = ~state.live.reshape(groups, per_slots)
    request = waiting[:, None] + jnp.cumsum(free, axis=1, dtype=jnp.int32) - 1
    taken = free & (request < per_requests)
    holding = jnp.where(taken, request, holding)
    prompt = jnp.maximum(holding, 0) // group_size
    flat = taken.reshape(slots)

    def pick(values, index):
      return _per_group(lambda v, i: v[i], values, index).reshape((slots,) + values.shape[2:])

    cache = state.cache
    state = dataclasses.replace(
        state, hidden=jnp.where(flat[:, None], pick(hidden, prompt).astype(state.hidden.dtype), state.hidden),
        keys=jnp.where(flat, pick(keys, jnp.maximum(holding, 0)), state.keys),
        generated=jnp.where(flat, 0, state.generated), live=jnp.where(flat, ~pick(empty, prompt), state.live),
        # The slot's own cache row starts empty; what the last request wrote there stays, masked.
        cache=dataclasses.replace(cache, length=jnp.where(flat, 0, cache.length),
                                  segment_ids=jnp.where(flat[:, None], 0, cache.segment_ids)),
        prefix=dataclasses.replace(state.prefix, index=jnp.where(taken, prompt, state.prefix.index)))
    return state, holding, waiting + jnp.sum(taken, axis=1, dtype=jnp.int32)

  def write(out: Rollout, holding, emitted) -> Rollout:
    """Each emitted token into its request's row, at the request's token index."""
    valid = emitted.valid.reshape(groups, per_slots)
    request = jnp.where(valid, holding, per_requests)  # out of range: dropped
    position = emitted.lengths.reshape(groups, per_slots) - 1

    def scatter(target, values, at_position=True):
      values = values.reshape(groups, per_slots)
      if at_position:
        return _per_group(lambda t, r, p, v: t.at[r, p].set(v, mode='drop'), target, request, position, values)
      return _per_group(lambda t, r, v: t.at[r].set(v, mode='drop'), target, request, values)

    return Rollout(tokens=scatter(out.tokens, emitted.tokens), log_probs=scatter(out.log_probs, emitted.log_probs),
                   mask=scatter(out.mask, emitted.valid), lengths=scatter(out.lengths, emitted.lengths, False),
                   stopped=scatter(out.stopped, emitted.stopped, False))

  def step(carry):
    count, state, holding, waiting, out = carry
    state, holding, waiting = insert(state, holding, waiting)
    state, emitted = decode_step(model, state, settings)
    return count + 1, state, holding, waiting, write(out, holding, emitted)

  with jax.named_scope('decode_loop'):  # the plan counts this loop's traffic per iteration (traffic.py)
    count, _, _, _, outputs = jax.lax.while_loop(
        keep_going, step, (jnp.int32(0), state, holding, waiting, outputs))
  flat = jax.tree.map(lambda x: x.reshape((requests,) + x.shape[2:]), outputs)
  return dataclasses.replace(flat, decode_steps=count)


def sample_resident(graphdef, params, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                    layout: RolloutLayout | None, group_size: int, settings: DecodeSettings,
                    slots: int = 0) -> Rollout:
  """sample_groups from the parameters `params` of the model `graphdef`, in the sampler's own
  layout (sampler/layout.py): the weights are cast and laid out once, the whole rollout is traced
  under the sampler's mesh, and the rows come back laid out over the source mesh's batch axes.
  layout None: in the parameters' own layout. Traceable."""
  if layout is None:
    return sample_groups(nnx.merge(graphdef, params), prompts, prompt_mask, key, group_size=group_size,
                         settings=settings, slots=slots)
  resident = layout.place(params)
  prompts, prompt_mask, key = layout.enter((prompts, prompt_mask, key))
  with layout.active():
    rollout = sample_groups(nnx.merge(graphdef, resident), prompts, prompt_mask, key, group_size=group_size,
                            settings=settings, slots=slots)
  return layout.rows_to_source(rollout)


class GroupSampler:
  """Jitted `sample_resident` over a model's parameter state.

  `sampler(state, prompts, prompt_mask, key)` with `state = nnx.state(model)` (e.g. the trainer's
  live parameters); the graph definition, the layout and the static settings are fixed at
  construction.
  """

  def __init__(self, model: Qwen2, *, group_size: int, settings: DecodeSettings, slots: int = 0,
               layout: RolloutLayout | None = None):
    graphdef, _ = nnx.split(model)

    @jax.jit
    def run(state, prompts, prompt_mask, key):
      return sample_resident(graphdef, state, prompts, prompt_mask, key, layout=layout, group_size=group_size,
                             settings=settings, slots=slots)

    self._run = run

  def __call__(self, state, prompts, prompt_mask, key) -> Rollout:
    return self._run(state, prompts, prompt_mask, key)
