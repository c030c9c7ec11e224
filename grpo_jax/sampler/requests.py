"""What a served request must satisfy before it is queued (`python -m grpo_jax.serve`).

JetStream's orchestrator queues a request as it comes and prefills it on a worker thread, where an
exception ends the whole server. Every check therefore runs in the request handler, on the
client's own call, before anything is queued: a bad request is refused to its client alone
(gRPC INVALID_ARGUMENT with this module's message) and the other requests never see it.

  token_content  ids in [0, vocab_size) (model/token_ids.py), at least one, used as sent.
  text_content   tokenized here, in the handler (chat template as the server was started), then
                 the same checks; refused when the server has no tokenizer (--token-ids-only).
  prompt length  at most max_prompt_tokens (--max-prefill-length); longer prompts are refused, or,
                 with long_prompts='truncate', cut to their last max_prompt_tokens tokens and the
                 cut reported to the client (serve.py: trailing metadata).
  max_tokens     0 (the proto's default) means the server's --max-new-tokens; negative is refused;
                 more than --max-new-tokens is capped at it.
"""

import dataclasses
import typing
from typing import Literal

from grpo_jax.model.token_ids import TokenIdError, check_token_ids
from grpo_jax.sampler.engine_tokenizer import HFTokenizer

LongPrompts = Literal['refuse', 'truncate']
LONG_PROMPTS = typing.get_args(LongPrompts)


class RequestError(ValueError):
  """A request the server refuses; the message is what its client reads."""


@dataclasses.dataclass(frozen=True)
class Admitted:
  """A request that passed every check.

  token_ids:       the prompt's ids, checked (its last max_prompt_tokens when truncated).
  max_tokens:      tokens to generate, in [1, max_new_tokens].
  text:            the request was text: the answer streams text besides ids.
  prompt_tokens:   the prompt's length as sent (tokenized), before any truncation.
  """

  token_ids: list[int]
  max_tokens: int
  text: bool
  prompt_tokens: int

  @property
  def truncated(self) -> bool:
    return len(self.token_ids) < self.prompt_tokens


@dataclasses.dataclass(frozen=True)
class RequestRules:
  """The server's limits. tokenizer None: a token-ids-only server."""

  vocab_size: int
  max_prompt_tokens: int
  max_new_tokens: int
  tokenizer: HFTokenizer | None = None
  long_prompts: LongPrompts = 'refuse'

  def __post_init__(self):
    if self.long_prompts not in LONG_PROMPTS:
      raise ValueError(f'long_prompts must be one of {", ".join(LONG_PROMPTS)}, got {self.long_prompts!r}')

  def admit(self, kind: str | None, content, max_tokens: int) -> Admitted:
    """kind: 'token_content' (content: the ids), 'text_content' (content: the text) or None (no
    content set) -> Admitted, or RequestError saying what is wrong."""
    if max_tokens < 0:
      raise RequestError(f'max_tokens must be >= 0 (0: the server\'s {self.max_new_tokens}), got {max_tokens}')
    max_tokens = min(max_tokens or self.max_new_tokens, self.max_new_tokens)
    if kind == 'text_content':
      if self.tokenizer is None or self.tokenizer.tokenizer is None:
        raise RequestError('text_content: this server has no tokenizer (started with --token-ids-only); '
                           'send token_content')
      ids = self.tokenizer.token_ids(content)
    elif kind == 'token_content':
      ids = list(content)
    else:
      raise RequestError('the request has neither token_content nor text_content')
    what = 'token_content.token_ids' if kind == 'token_content' else 'text_content (tokenized)'
    if not ids:
      raise RequestError(f'{what}: the prompt is empty (a request needs at least one token to continue)')
    try:
      ids = check_token_ids(ids, self.vocab_size, what).tolist()
    except TokenIdError as error:
      raise RequestError(str(error)) from None
    count = len(ids)
    if count > self.max_prompt_tokens:
      if self.long_prompts == 'refuse':
        raise RequestError(f'{what}: the prompt has {count} tokens, more than the server\'s '
                           f'--max-prefill-length {self.max_prompt_tokens}')
      ids = ids[-self.max_prompt_tokens:]
    return Admitted(token_ids=ids, max_tokens=max_tokens, text=kind == 'text_content', prompt_tokens=count)
