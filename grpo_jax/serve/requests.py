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
                 cut reported to the client (server.py: trailing metadata).
  max_tokens     0 (the proto's default) means the server's --max-new-tokens; negative is refused;
                 more than --max-new-tokens is capped at it.
  images         (a vision-language checkpoint, `ImageRules`) parts of a text_content conversation:
                 {"type": "image", "image": URI} or {"type": "image_url", "image_url": {"url": URI}},
                 URI a `data:image/...;base64,` one or bare base64 (the server reads no files and
                 fetches nothing); at most --max-images a request, each at most --max-image-bytes
                 encoded and max_source_pixels decoded, resized into [--min-pixels, --max-pixels]
                 (model/images.py). Each becomes the chat template's image part and its image tokens;
                 an image token the request did not earn by an image is refused (as text or ids), and
                 a prompt with images is never cut (too long: refused).
"""

import base64
import binascii
import dataclasses
import typing
from typing import Literal

from grpo_jax.errors import UserError
from grpo_jax.model.config import VisionConfig
from grpo_jax.model.images import ImageSettings, load_image, process_image
from grpo_jax.model.token_ids import TokenIdError, check_token_ids
from grpo_jax.model.vision import image_tokens
from grpo_jax.serve.tokenizer import HFTokenizer, chat_messages

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
  images:          the prompt's images in order, each (patches [t*h*w, C*T*P*P], grid (t, h, w)),
                   its image tokens already in token_ids.
  """

  token_ids: list[int]
  max_tokens: int
  text: bool
  prompt_tokens: int
  images: tuple = ()

  @property
  def truncated(self) -> bool:
    return len(self.token_ids) < self.prompt_tokens


@dataclasses.dataclass(frozen=True)
class ImageRules:
  """How a vision-language server reads the images of a request (module docstring)."""

  settings: ImageSettings
  vision: VisionConfig
  max_images: int = 4
  max_image_bytes: int = 16 << 20

  def __post_init__(self):
    if self.max_images < 1 or self.max_image_bytes < 1:
      raise ValueError('max_images and max_image_bytes must be at least 1')

  def read(self, messages: list[dict]) -> tuple[list[dict], tuple]:
    """A conversation's image parts -> (the conversation with each one {'type': 'image'}, the images
    processed in order), or RequestError naming the message and part."""
    images, out = [], []
    for m, message in enumerate(messages):
      content = message['content']
      if not isinstance(content, list):
        out.append(message)
        continue
      parts = []
      for p, part in enumerate(content):
        where = f'text_content message {m} part {p}'
        kind = part.get('type') if isinstance(part, dict) else None
        if kind in ('video', 'video_url'):
          raise RequestError(f'{where}: videos are not served; send images')
        if kind not in ('image', 'image_url'):
          parts.append(part)
          continue
        if len(images) == self.max_images:
          raise RequestError(f'{where}: more than the server\'s --max-images {self.max_images} images')
        data = self._decoded(part.get('image_url', {}).get('url') if kind == 'image_url' and
                             isinstance(part.get('image_url'), dict) else part.get(kind), where)
        try:
          images.append(process_image(load_image(data, where, self.settings), self.settings))
        except UserError as error:
          raise RequestError(str(error)) from None
        parts.append({'type': 'image'})
      out.append({**message, 'content': parts})
    return out, tuple(images)

  def _decoded(self, uri, where: str) -> bytes:
    if not isinstance(uri, str) or not uri:
      raise RequestError(f'{where}: an image part needs its image as a base64 string '
                         '({"type": "image", "image": "data:image/png;base64,..."})')
    if uri.startswith('data:'):
      header, comma, uri = uri.partition(',')
      if not comma or not header.endswith(';base64'):
        raise RequestError(f'{where}: a data URI image must be base64 (data:image/...;base64,...)')
    elif uri.startswith(('http://', 'https://', 'file:', '/')):
      raise RequestError(f'{where}: images are read inline only (base64); the server fetches no URL and reads '
                         'no file')
    if len(uri) * 3 // 4 > self.max_image_bytes + 2:
      raise RequestError(f'{where}: the image is about {len(uri) * 3 // 4} bytes, over the server\'s '
                         f'--max-image-bytes {self.max_image_bytes}')
    try:
      data = base64.b64decode(uri, validate=True)
    except (binascii.Error, ValueError):
      raise RequestError(f'{where}: the image is not valid base64') from None
    if len(data) > self.max_image_bytes:
      raise RequestError(f'{where}: the image is {len(data)} bytes, over the server\'s --max-image-bytes '
                         f'{self.max_image_bytes}')
    return data

  def expand(self, ids: list[int], images: tuple, what: str) -> list[int]:
    """ids with the i-th image token (the chat template's one per image part) repeated for images[i]'s
    features; an image token without its image is refused."""
    image_id = self.vision.image_token_id
    where = [i for i, token in enumerate(ids) if token == image_id]
    if len(where) != len(images):
      if not images:
        raise RequestError(f'{what}: token {image_id} (at position {where[0]}) is the image token; send the image '
                           'as an image part of a text_content conversation')
      raise RequestError(f'{what}: the prompt holds {len(where)} image tokens ({image_id}) for {len(images)} images '
                         '(the chat template renders one per image part, and the text may hold none)')
    out, start = [], 0
    for at, (_, grid) in zip(where, images):
      out += ids[start:at] + [image_id] * image_tokens(tuple(grid), self.vision)
      start = at + 1
    return out + ids[start:]


@dataclasses.dataclass(frozen=True)
class RequestRules:
  """The server's limits. tokenizer None: a token-ids-only server; images None: a text model."""

  vocab_size: int
  max_prompt_tokens: int
  max_new_tokens: int
  tokenizer: HFTokenizer | None = None
  long_prompts: LongPrompts = 'refuse'
  images: ImageRules | None = None

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
      ids, images = self._text_ids(content)
    elif kind == 'token_content':
      ids, images = list(content), ()
    else:
      raise RequestError('the request has neither token_content nor text_content')
    what = 'token_content.token_ids' if kind == 'token_content' else 'text_content (tokenized)'
    if not ids:
      raise RequestError(f'{what}: the prompt is empty (a request needs at least one token to continue)')
    try:
      ids = check_token_ids(ids, self.vocab_size, what).tolist()
    except TokenIdError as error:
      raise RequestError(str(error)) from None
    if self.images is not None:
      ids = self.images.expand(ids, images, what)
    count = len(ids)
    if count > self.max_prompt_tokens:
      if self.long_prompts == 'refuse' or images:
        raise RequestError(f'{what}: the prompt has {count} tokens{" with its image tokens" if images else ""}, more '
                           f'than the server\'s --max-prefill-length {self.max_prompt_tokens}'
                           + (' (a prompt with images is never cut)' if images else ''))
      ids = ids[-self.max_prompt_tokens:]
    return Admitted(token_ids=ids, max_tokens=max_tokens, text=kind == 'text_content', prompt_tokens=count,
                    images=images)

  def _text_ids(self, text: str) -> tuple[list[int], tuple]:
    """A text request's ids and images: a conversation's image parts are read only by a
    vision-language server with a chat template (else refused)."""
    if not self.tokenizer.use_chat_template:
      return self.tokenizer.token_ids(text), ()
    messages = chat_messages(text)
    if self.images is None:
      for m, message in enumerate(messages):
        if isinstance(message['content'], list) and any(
            isinstance(part, dict) and part.get('type') in ('image', 'image_url', 'video', 'video_url')
            for part in message['content']):
          raise RequestError(f'text_content message {m}: an image part, but this server\'s checkpoint is a text model')
      return self.tokenizer.conversation_ids(messages), ()
    messages, images = self.images.read(messages)
    return self.tokenizer.conversation_ids(messages), images
