"""A test driver of the JetStream Engine API: P prompts x G samples through a QwenEngine's B slots,
refilling each slot as it frees up, as a serving orchestrator drives an engine from the host. The
trainer samples with sampler/rollout.py (the slots refilled inside one jit); this loop only checks
that the engine's prefill / insert / generate give the same requests the same tokens.

Each prompt is prefilled once, when its first sample gets a slot, and that prefix is inserted into
G slots. The jitted generate step runs back to back; every `check_every` steps the host pulls
the steps' results and each slot's live flag in one transfer, records the tokens, and refills the
slots that finished. Request r = p * G + g draws from decode.request_keys(key, ...)[r], as in the
trainer's group sampler, so its tokens do not depend on B, on the slot it gets, or on the path.
"""

import collections

import jax
import numpy as np

from grpo_jax.sampler.decode import request_keys
from grpo_jax.sampler.rollout import Rollout
from grpo_jax.serve.engine import QwenEngine
from grpo_jax.serve.tokenizer import pad_prompt


def generate_groups(engine: QwenEngine, params, prompts, *, group_size: int = 1,
                    key: jax.Array | None = None, check_every: int = 4) -> Rollout:
  """Samples `group_size` completions of each prompt (a list of token-id lists); numpy arrays."""
  if group_size < 1 or check_every < 1:
    raise ValueError('group_size and check_every must be at least 1')
  key = jax.random.key(engine.seed) if key is None else key
  rows, N = len(prompts) * group_size, engine.max_new_tokens
  keys = request_keys(key, rows)
  tokens = np.full((rows, N), engine.pad_id, np.int32)
  log_probs = np.zeros((rows, N), np.float32)
  lengths = np.zeros((rows,), np.int32)
  stopped = np.zeros((rows,), bool)
  pending = collections.deque(range(rows))
  prefixes = {}  # prompt index -> (prefix, samples still to insert)
  owner = [None] * engine.max_concurrent_decodes  # slot -> request
  state = engine.init_decode_state()

  def prefix_for(prompt_index):
    if prompt_index not in prefixes:
      ids = list(prompts[prompt_index])
      padded = pad_prompt(ids, engine.max_prefill_length, engine.pad_id)
      prefixes[prompt_index] = [engine.prefill(params=params, padded_tokens=padded, true_length=len(ids)),
                                group_size]
    entry = prefixes[prompt_index]
    entry[1] -= 1
    if entry[1] == 0:
      del prefixes[prompt_index]
    return entry[0]

  stop_ids = np.asarray(engine.stop_token_ids or (-1,))
  while pending or any(request is not None for request in owner):
    for slot in range(len(owner)):
      if owner[slot] is None and pending:
        request = pending.popleft()
        state = engine.insert(prefix_for(request // group_size), state, slot, key=keys[request])
        owner[slot] = request
    results = []
    for _ in range(check_every):
      state, result = engine.generate(params, state)
      results.append(result)
    results, live = jax.device_get((results, state.live))
    requests = np.array([-1 if request is None else request for request in owner])
    for step in results:
      taken = (requests >= 0) & step.valid
      row, column = requests[taken], step.lengths[taken] - 1
      tokens[row, column] = step.tokens[taken]
      log_probs[row, column] = step.log_probs[taken]
      lengths[row] = step.lengths[taken]
      stopped[row] |= np.isin(step.tokens[taken], stop_ids)
    for slot in range(len(owner)):
      if not live[slot]:
        owner[slot] = None

  mask = np.arange(N)[None, :] < lengths[:, None]
  return Rollout(tokens=tokens, log_probs=log_probs, mask=mask, lengths=lengths, stopped=stopped)
