"""The one check of token ids that come from outside the model.

Valid ids are [0, vocab_size) of the model's config: its whole embedding table, padded-vocabulary
rows included. Inside a jitted program a bad id cannot raise: `jnp.take` answers it with a NaN
row, which then spreads through attention. So every door where ids enter (serving requests,
`generate`, the inference server's requests, environment observations, the serving engine's
prefill in serve/engine.py and an eager model call) calls `check_token_ids`, and an id outside the
vocabulary is refused there, never clipped or wrapped (that would silently answer another prompt).
"""

import numpy as np

from grpo_jax.errors import UserError


class TokenIdError(UserError, ValueError):
  """An id outside [0, vocab_size): `position` and `token_id` name the first one."""

  def __init__(self, what: str, position: int, token_id: int, vocab_size: int):
    super().__init__(f'{what}: token id {token_id} at position {position} is outside the vocabulary '
                     f'[0, {vocab_size})')
    self.what, self.position, self.token_id, self.vocab_size = what, position, token_id, vocab_size


def check_token_ids(ids, vocab_size: int, what: str = 'tokens') -> np.ndarray:
  """ids (any integer sequence or array) as an int32 array, or TokenIdError naming the first id
  outside [0, vocab_size) and its flat position. `what` names the ids in the message (a request
  field, a flag, an environment). Non-integer values are refused too."""
  array = np.asarray(ids)
  if array.size == 0:
    return array.astype(np.int32).reshape(array.shape)
  if not np.issubdtype(array.dtype, np.integer):
    flat = array.reshape(-1)
    for position, value in enumerate(flat):
      if not float(value).is_integer():
        raise TokenIdError(what, position, value, vocab_size)
    array = array.astype(np.int64)
  bad = np.flatnonzero((array.reshape(-1) < 0) | (array.reshape(-1) >= vocab_size))
  if bad.size:
    position = int(bad[0])
    raise TokenIdError(what, position, int(array.reshape(-1)[position]), vocab_size)
  return array.astype(np.int32)
