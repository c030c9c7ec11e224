"""P prompts x G samples through a QwenEngine's B slots, refilling each slot as it frees up.

Each prompt is prefilled once, when its first sample gets a slot, and that prefix is inserted into
G slots. The jitted generate step runs back to back; every `check_every` steps the host pulls
the steps' results and each slot's live flag in one transfer, records the tokens, and refills the
slots that finished. Request r = p * G + g draws from fold_in(key, r), so its tokens do not
depend on B, on the slot it gets, or on what runs beside it.
"""

import collections
import dataclasses

import jax
import numpy as np

from grpo_jax.sampler.engine import QwenEngine, pad_prompt


@dataclasses.dataclass(frozen=True)
class Completions:
  """Row p * G + g is sample g of prompt p; N = the engine's max_new_tokens.

  tokens:          [P*G, N] int32, the engine's pad_id after a row ends.
  log_probs:       [P*G, N] fp32, log softmax(logits / T) of each token; 0 where masked.
  mask:            [P*G, N] bool, True on completion tokens (the stop token included).
  lengths:         [P*G] int32.
  finish_reasons:  P*G strings: 'stop' (ended with a stop token) or 'length'.
  """

  tokens: np.ndarray
  log_probs: np.ndarray
  mask: np.ndarray
  lengths: np.ndarray
  finish_reasons: list[str]


def generate_groups(engine: QwenEngine, params, prompts, *, group_size: int = 1,
                    key: jax.Array | None = None, check_every: int = 4) -> Completions:
  """Samples `group_size` completions of each prompt (a list of token-id lists)."""
  if group_size < 1 or check_every < 1:
    raise ValueError('group_size and check_every must be at least 1')
  key = jax.random.key(engine.seed) if key is None else key
  rows, N = len(prompts) * group_size, engine.max_new_tokens
  tokens = np.full((rows, N), engine.pad_id, np.int32)
  log_probs = np.zeros((rows, N), np.float32)
  lengths = np.zeros((rows,), np.int32)
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

  while pending or any(request is not None for request in owner):
    for slot in range(len(owner)):
      if owner[slot] is None and pending:
        request = pending.popleft()
        state = engine.insert(prefix_for(request // group_size), state, slot,
                              key=jax.random.fold_in(key, request))
        owner[slot] = request
    results = []
    for _ in range(check_every):
      state, result = engine.generate(params, state)
      results.append(result.data)
    data, live = jax.device_get((results, state.live))
    requests = np.array([-1 if request is None else request for request in owner])
    for step in data:  # [B, 4]: token | valid | length | log-prob bits
      taken = (requests >= 0) & (step[:, 1] != 0)
      row, column = requests[taken], step[taken, 2] - 1
      tokens[row, column] = step[taken, 0]
      log_probs[row, column] = step[taken, 3].astype(np.int32).view(np.float32)
      lengths[row] = step[taken, 2]
    for slot in range(len(owner)):
      if not live[slot]:
        owner[slot] = None

  mask = np.arange(N)[None, :] < lengths[:, None]
  stop = set(engine.stop_token_ids)
  finish_reasons = ['stop' if n and tokens[r, n - 1] in stop else 'length' for r, n in enumerate(lengths)]
  return Completions(tokens=tokens, log_probs=log_probs, mask=mask, lengths=lengths,
                     finish_reasons=finish_reasons)
