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
from grpo_jax.model.options import KV_CACHE_FORMATS, KVCacheFormat
from grpo_jax.model.quantize import ROLLOUT_WEIGHTS, RolloutWeights
from grpo_jax.model.qwen2 import Qwen2
from grpo_jax.model.vision import Vision
from grpo_jax.records import along, fields_along, map_along
from grpo_jax.sampler.decode import DecodeSettings, request_keys
from grpo_jax.sampler.layout import RolloutLayout, run_resident
from grpo_jax.sampler.sampling import SamplingConfig
from grpo_jax.sampler.slots import Decoded, GroupLoop, prefill_prompts
from grpo_jax.sections import inline, section
from grpo_jax.sharding import batch_groups, grouped


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
  # The sampler's resident copy of the weights, made once per RL step (sampler/layout.py): 'compute'
  # (the model's compute dtype), 'bf16', or 'int8' / 'fp8': the projections 8-bit with a scale per
  # output channel (model/quantize.py), about half the bytes each decode step reads. The sampler then
  # samples from a slightly different policy than the trainer's: set algo.tis_cap to correct for it.
  weights: RolloutWeights = 'compute'
  # The sampler's KV cache: 'compute' (the compute dtype), or 'int8' / 'fp8': keys and values 8-bit
  # with a scale per token and KV head (model/cache.py), half the bytes a bf16 cache reads at each
  # decode step. Sets model.kv_cache; like 8-bit weights, the sampler's policy then differs a little
  # from the trainer's (algo.tis_cap corrects for it).
  kv_cache: KVCacheFormat = 'compute'
  # c > 1: each step's prompts are prefilled split along their length over c of the sampler's data
  # groups (ring attention, as mesh.context splits the update's rows), for prompts whose prefill does
  # not fit one group's devices (an agent's long history); their cache then moves to the rows' own
  # groups, and decoding is unchanged (sampler/layout.py). c must divide the data groups
  # (devices / tensor); not with a mixture of experts or multi-head latent attention.
  prefill_context: int = 1

  def __post_init__(self):
    with section('rollout'):
      require(self.decode_chunk >= 1, 'decode_chunk', f'must be >= 1, got {self.decode_chunk}')
      require(self.tensor >= 0, 'tensor', f'must be >= 0 (0: chosen for the model and devices), got {self.tensor}')
      require(self.prompts_per_step >= 1, 'prompts_per_step', f'must be >= 1, got {self.prompts_per_step}')
      require(self.max_new_tokens >= 1, 'max_new_tokens', f'must be >= 1, got {self.max_new_tokens}')
      require(self.slots >= 0, 'slots', f'must be >= 0 (0: one per completion), got {self.slots}')
      require(self.devices >= 0, 'devices', f'must be >= 0 (0: the trainer\'s devices), got {self.devices}')
      require(self.prefill_context >= 1, 'prefill_context', f'must be >= 1, got {self.prefill_context}')
      require(self.weights in ROLLOUT_WEIGHTS, 'weights',
              f'must be one of {" | ".join(ROLLOUT_WEIGHTS)}, got {self.weights!r}')
      require(self.kv_cache in KV_CACHE_FORMATS, 'kv_cache',
              f'must be one of {" | ".join(KV_CACHE_FORMATS)}, got {self.kv_cache!r}')

  def decode_settings(self, stop_token_ids, pad_id: int, record_routes: bool = False) -> DecodeSettings:
    """The sampler's static settings for a task's stop and pad ids (record_routes: routing replay)."""
    return DecodeSettings(sampling=self.sampling, max_new_tokens=self.max_new_tokens,
                          stop_token_ids=tuple(stop_token_ids), pad_id=pad_id, record_routes=record_routes)


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
              masked: partial rollouts (sampler/pool.py) carry answers across steps. None: the
              current version sampled every token.
  routes:     [P*G, Tp + N, Ls, k] the experts each token of the row's sequence (its prompt, then
              its completion) was routed to by the sampler, `unrecorded` on padding and on the
              tokens never fed back (a mixture of experts with routing replay; model/moe.py).
              None: not recorded.
  vision:     Vision over [P*G, Tp + N]: each row's images and M-RoPE positions over its prompt and
              completion, where the completion holds images of its own (an agent's episode shown
              images by its environment, agents/images.py). None: the prompts' (Prompts.vision),
              which the update extends over the completions, or text.
  """

  tokens: jax.Array = along('row')
  log_probs: jax.Array = along('row')
  mask: jax.Array = along('row')
  lengths: jax.Array = along('row')
  stopped: jax.Array = along('row')
  decode_steps: jax.Array | None = None  # the loop's, not a row's
  context: jax.Array | None = along('row', default=None)
  versions: jax.Array | None = along('row', default=None)
  routes: jax.Array | None = along('row', default=None)
  vision: Vision | None = along('row', default=None)

  @property
  def sequence_mask(self) -> jax.Array:
    """[P*G, N] the tokens of each row's sequence after its prompt (what the model attends to)."""
    return self.mask if self.context is None else self.context

  def map_rows(self, fn) -> 'Rollout':
    """fn applied to every per-row field (along('row')), the optional ones present included: a
    field added later with its kind travels with the rows on every path."""
    return map_along(self, 'row', fn)

  def take(self, rows) -> 'Rollout':
    """Rows `rows` (indices) of every per-row field."""
    return self.map_rows(lambda x: x[rows])

  @classmethod
  def concatenate(cls, rollouts: 'list[Rollout]') -> 'Rollout':
    """The rows of rollouts sampled one after another (dynamic sampling's rounds), in order;
    `decode_steps` their sum (the rounds' loops ran one after another over the same slots)."""
    first = rollouts[0]
    rows = {name: jnp.concatenate([getattr(r, name) for r in rollouts])
            for name, value in fields_along(first, 'row').items() if value is not None}
    steps = jax.tree.map(lambda *counts: sum(counts), *[r.decode_steps for r in rollouts])
    return dataclasses.replace(first, decode_steps=steps, **rows)

  @classmethod
  def of(cls, decoded: Decoded, decode_steps: jax.Array | None = None,
         prompt_routes: jax.Array | None = None) -> 'Rollout':
    """The rows of slots.Decoded [n, Rg, ...], flattened in request order; prompt_routes
    [P*G, Tp, Ls, k]: the recorded routes of each row's prompt (with decoded.routes)."""
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), decoded)
    mask = jnp.arange(flat.tokens.shape[1])[None, :] < flat.lengths[:, None]
    routes = jax.tree.map(lambda answer: jnp.concatenate([prompt_routes, answer], axis=1), flat.routes)
    return cls(tokens=flat.tokens, log_probs=flat.log_probs, mask=mask, lengths=flat.lengths, stopped=flat.stopped,
               decode_steps=decode_steps, versions=flat.versions, routes=routes)

  @property
  def finish_reasons(self) -> list[str]:
    """'stop' or 'length' per row (reads `stopped` back to the host)."""
    return ['stop' if stopped else 'length' for stopped in np.asarray(self.stopped)]


def sample_groups(model: Qwen2, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                  group_size: int, settings: DecodeSettings, slots: int = 0, vision: Vision | None = None) -> Rollout:
  """Samples G completions for each of P prompts through `slots` decode rows (0: one per request),
  in the one slot loop (slots.GroupLoop) with every request queued in order. Traceable: run
  it under jit (see GroupSampler).

  prompts [P, Tp] int32, left- or right-padded; prompt_mask [P, Tp], 1 on real tokens; vision:
  the prompts' images (model/vision.py), through the vision tower once per prompt in the prefill.
  Returns the Rollout in request order, with `decode_steps` (loop iterations) set.
  """
  num_prompts = prompts.shape[0]
  requests = num_prompts * group_size
  slots = min(slots or requests, requests)
  groups = batch_groups(num_prompts, slots)
  per_requests = requests // groups
  shared = prefill_prompts(model, prompts, prompt_mask, groups, slots, group_size,
                           record_routes=settings.record_routes, vision=vision)
  order = jnp.broadcast_to(jnp.arange(per_requests, dtype=jnp.int32), (groups, per_requests))
  loop = GroupLoop(model, settings, shared, keys=grouped(request_keys(key, requests), groups), queue=order,
                   queued=jnp.full((groups,), per_requests, jnp.int32), group_size=group_size)
  done = loop.run(loop.idle(Decoded.empty(groups, per_requests, settings, versions=False, model=model)))
  prompt_routes = shared.request_routes(per_requests, group_size) if settings.record_routes else None
  return Rollout.of(done.decoded, done.count, prompt_routes)


def sample_resident(graphdef, params, prompts: jax.Array, prompt_mask: jax.Array, key: jax.Array, *,
                    layout: RolloutLayout | None, group_size: int, settings: DecodeSettings,
                    slots: int = 0, vision: Vision | None = None) -> Rollout:
  """sample_groups from the parameters `params` of the model `graphdef`, in the sampler's own
  layout (sampler/layout.py): the weights are cast and laid out once, the whole rollout is traced
  under the sampler's mesh, and the rows come back laid out over the source mesh's batch axes.
  layout None: in the parameters' own layout. Traceable."""
  def sample(model: Qwen2, inputs) -> Rollout:
    prompts, prompt_mask, key, vision = inputs
    return sample_groups(model, prompts, prompt_mask, key, group_size=group_size, settings=settings, slots=slots,
                         vision=vision)

  return run_resident(graphdef, params, (prompts, prompt_mask, key, vision), sample, layout=layout)


class GroupSampler:
  """Jitted `sample_resident` over a model's parameter state.

  `sampler(state, prompts, prompt_mask, key[, vision])` with `state = nnx.state(model)` (e.g. the
  trainer's live parameters); the graph definition, the layout and the static settings are fixed
  at construction.
  """

  def __init__(self, model: Qwen2, *, group_size: int, settings: DecodeSettings, slots: int = 0,
               layout: RolloutLayout | None = None):
    graphdef, _ = nnx.split(model)

    @jax.jit
    def run(state, prompts, prompt_mask, key, vision=None):
      return sample_resident(graphdef, state, prompts, prompt_mask, key, layout=layout, group_size=group_size,
                             settings=settings, slots=slots, vision=vision)

    self._run = run

  def __call__(self, state, prompts, prompt_mask, key, vision: Vision | None = None) -> Rollout:
    return self._run(state, prompts, prompt_mask, key, vision)
