"""The tokenizer JetStream's orchestrator uses with QwenEngine: a Hugging Face tokenizer behind
JetStream's Tokenizer interface (encode -> padded ids + true length, decode, pad/eos/bos ids,
stop tokens), without importing jetstream.

Text requests: with a chat template (chat_template='auto' and the tokenizer has one, or 'always'),
the text is one user message, or a whole conversation when it is a JSON list of
{"role": ..., "content": ...} objects, rendered with `apply_chat_template(add_generation_prompt=True)`;
otherwise the text is tokenized as is. Token requests are used as sent.

Qwen has no BOS token, but JetStream 0.2.2 prepends `bos_id` to every token request without a
session cache; `bos_id` is therefore -1, which QwenEngine.prefill skips.
"""

import json

import numpy as np

from grpo_jax.model.loading import load_tokenizer

CHAT_TEMPLATE_MODES = ('auto', 'always', 'never')
NO_TOKEN = -1  # a prompt position prefill skips (JetStream's BOS slot: Qwen has no BOS token)
MIN_BUCKET = 16


def pad_prompt(ids, max_length: int, pad_id: int = 0) -> np.ndarray:
  """ids right-padded to the smallest power of two >= len(ids) (at least 16, at most max_length),
  so prompts of similar lengths share one compiled prefill."""
  if len(ids) > max_length:
    raise ValueError(f'prompt of {len(ids)} tokens exceeds max_prefill_length={max_length}')
  bucket = MIN_BUCKET
  while bucket < len(ids):
    bucket *= 2
  padded = np.full((min(bucket, max_length),), pad_id, np.int32)
  padded[:len(ids)] = ids
  return padded


def chat_messages(text: str) -> list[dict]:
  """The conversation in a text request: a JSON list of role/content objects, else one user turn."""
  if text.lstrip().startswith('['):
    try:
      messages = json.loads(text)
    except json.JSONDecodeError:
      messages = None
    if (isinstance(messages, list) and messages
        and all(isinstance(m, dict) and {'role', 'content'} <= set(m) for m in messages)):
      return messages
  return [{'role': 'user', 'content': text}]


class HFTokenizer:
  """JetStream Tokenizer over the Hugging Face tokenizer in `path` (None: token requests only)."""

  def __init__(self, path: str | None, *, stop_token_ids=(), pad_id: int = 0, chat_template: str = 'auto'):
    if chat_template not in CHAT_TEMPLATE_MODES:
      raise ValueError(f'chat_template must be one of {", ".join(CHAT_TEMPLATE_MODES)}, got {chat_template!r}')
    self.tokenizer = load_tokenizer(path) if path else None
    has_template = self.tokenizer is not None and bool(getattr(self.tokenizer, 'chat_template', None))
    if chat_template == 'always' and not has_template:
      raise ValueError(f'chat_template=always, but the tokenizer in {path} has no chat template')
    self.use_chat_template = has_template and chat_template != 'never'
    self._stop_tokens = set(int(t) for t in stop_token_ids)
    self._pad_id = pad_id

  def token_ids(self, text: str) -> list[int]:
    if self.use_chat_template:
      return self.conversation_ids(chat_messages(text))
    return list(self.tokenizer(text)['input_ids'])

  def conversation_ids(self, messages: list[dict]) -> list[int]:
    """The ids of `messages` rendered with the chat template, ready for the assistant's turn."""
    return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))

  def encode(self, s: str, **kwargs) -> tuple[np.ndarray, int]:
    """Text -> (ids right-padded to a length bucket, true length); ValueError for a prompt longer
    than max_prefill_length or a tokenizer-less checkpoint. `serve` never gets here: its handler
    tokenizes and checks each request before queueing it (requests.py)."""
    max_length = kwargs.get('max_prefill_length') or 1 << 30
    if self.tokenizer is None:
      raise ValueError('text request: the checkpoint has no tokenizer; send token ids')
    ids = self.token_ids(s)
    return pad_prompt(ids, max_length, self._pad_id), len(ids)

  def decode(self, token_ids: list[int], **kwargs) -> str:
    if self.tokenizer is None:
      return ''
    # The model's vocabulary may be larger than the tokenizer's (Qwen pads it): such ids have no text.
    known = [t for t in token_ids if 0 <= t < len(self.tokenizer)]
    return self.tokenizer.decode(known, skip_special_tokens=False)

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def eos_id(self) -> int:
    if self._stop_tokens:
      return min(self._stop_tokens)
    eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
    return NO_TOKEN if eos is None else int(eos)

  @property
  def bos_id(self) -> int:
    return NO_TOKEN

  @property
  def stop_tokens(self) -> set[int]:
    return set(self._stop_tokens)
