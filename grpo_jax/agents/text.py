"""The text side of an episode, for environments that read and write text rather than token ids.

A policy turn reaches `Environment.step` as a `Turn`: the sampled tokens as the server returned
them (the stop id that ended the turn included: it is trained on) and their `text`, decoded by the
task's tokenizer without that stop id. The model's vocabulary is often larger than its tokenizer's
(Qwen2.5 pads 151,665 tokens to 151,936 rows), so the policy can sample ids in [tokenizer size,
vocab_size) that no tokenizer can decode: each one is written as U+FFFD in `text` and listed in
`unknown_ids`, never dropped silently. (Ids at or past the model's vocab_size cannot be sampled.)

An environment's text answer (`Step.observation` as a string) is sent the way the tokenizer's chat
template writes a message of `role` after the assistant's turn (`user` for an environment's reply,
`tool` for a tool's result): the end of the policy's message, the new message, the next assistant
header. Without a chat template it is appended as written. The message's own text is tokenized
with special tokens split, so an answer that spells `<|im_end|>` cannot end a turn or open one.
A policy turn that ended on a stop id whose text the template writes next (<|im_end|>, Llama 3's
<|eot_id|>, Gemma's <end_of_turn>, GLM-4's <|user|> or <|observation|>, which open the next
message) already holds that text: the reply starts after it, so the conversation reads as the
template renders it, the end of the turn written once. The template's own BOS is never repeated:
everything after the prompt is tokenized without special tokens added.
"""

import dataclasses
import functools

from grpo_jax.agents.inference import Completion
from grpo_jax.errors import UserError
from grpo_jax.sampler.special_tokens import tokenizer_size

UNKNOWN = '\ufffd'  # an id the tokenizer lacks, in a Turn's text
_SLOT = '\x00'  # stands for a message's content while the chat template renders around it


@dataclasses.dataclass(frozen=True)
class Turn(Completion):
  """A policy turn as an environment gets it: the Completion (`tokens` with the stop id that ended
  it, `finish_reason` 'stop' or 'length'), its `text` without that stop id (None when the task has
  no tokenizer), and the ids of the turn that the tokenizer lacks (`unknown_ids`, each U+FFFD in
  `text`)."""

  text: str | None = None
  unknown_ids: tuple[int, ...] = ()


def decode(tokenizer, tokens) -> str:
  """The text of `tokens`, special tokens kept, each id the tokenizer lacks written as U+FFFD."""
  size, pieces, run = tokenizer_size(tokenizer), [], []
  for token in tokens:
    if 0 <= int(token) < size:
      run.append(int(token))
      continue
    if run:
      pieces.append(tokenizer.decode(run, skip_special_tokens=False))
      run = []
    pieces.append(UNKNOWN)
  if run:
    pieces.append(tokenizer.decode(run, skip_special_tokens=False))
  return ''.join(pieces)


def encode(tokenizer, text: str, split_special_tokens: bool = True) -> tuple[int, ...]:
  """The ids of `text`, no BOS/EOS added; `split_special_tokens`: a special token's spelling is
  tokenized as plain text (a `tokenizers.Tokenizer` always reads specials as written)."""
  if hasattr(tokenizer, 'get_vocab_size'):
    return tuple(tokenizer.encode(text, add_special_tokens=False).ids)
  return tuple(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)['input_ids'])


@dataclasses.dataclass(frozen=True)
class MessageFormat:
  """The text around a message after a policy turn: `before` (what follows the turn's last token:
  the end of its message, the new message's opening) and `after` (its end, the next assistant
  header). `turn_end`: the text of a stop token that `before` starts with (a turn that stopped on
  it already holds it), '' when none does."""

  before: str
  after: str
  turn_end: str = ''


def message_format(tokenizer, use_chat_template: bool, tools=None, role: str = 'tool', stops=()) -> MessageFormat:
  """The chat template's rendering of a `role` message after an assistant turn (read off the
  template by rendering a conversation with and without it); without a chat template, a tool's
  result in `<output>` tags and anything else as written. `tools`: the function schemas the
  template lists; `stops`: the texts of the task's stop tokens (the tokenizer's eos is one too)."""
  if not use_chat_template:
    return MessageFormat('\n<output>\n', '\n</output>\n') if role == 'tool' else MessageFormat('', '')
  conversation = [{'role': 'user', 'content': 'q'}, {'role': 'assistant', 'content': _SLOT},
                  {'role': role, 'content': _SLOT}]
  options = {'tools': tools} if tools else {}
  try:
    answered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **options)
  except Exception as error:  # noqa: BLE001 (jinja's errors have no common base)
    raise UserError(f'the tokenizer\'s chat template cannot render a {role} message ({type(error).__name__}: '
                    f'{error}); set task.chat_template: false to send it as written') from None
  if answered.count(_SLOT) != 2:
    raise UserError(f'the tokenizer\'s chat template does not render a {role} message after the assistant\'s turn; '
                    'set task.chat_template: false to send it as written')
  # Only what follows the assistant's content is read: how the template renders the turns before
  # (Qwen3's drops the <think> part of an assistant turn before the last user message) never
  # changes the tokens the policy already sampled (token in, token out).
  _, before, after = answered.split(_SLOT)
  eos = getattr(tokenizer, 'eos_token', None)
  written = [stop for stop in (*stops, *([eos] if eos else [])) if stop and before.startswith(stop)]
  return MessageFormat(before, after, max(written, key=len, default=''))


class TextCodec:
  """A task's tokenizer for its environments: `turn(completion)` -> the Turn an environment reads;
  `reply(text, turn)` -> the ids of a `role` message answering `turn` (the chat template's layout
  when `use_chat_template`, read off the template on first use); `encode(text)` -> ids as written."""

  def __init__(self, tokenizer, stop_token_ids, use_chat_template: bool = False, role: str = 'user', tools=None,
               options: dict | None = None):
    self.tokenizer, self.stop_token_ids = tokenizer, frozenset(int(t) for t in stop_token_ids)
    self.size = tokenizer_size(tokenizer)
    self.use_chat_template = use_chat_template and bool(getattr(tokenizer, 'chat_template', None))
    self.role, self.tools = role, tools
    self.options = dict(options or {})  # the template's other keywords (enable_thinking)

  @functools.cached_property
  def format(self) -> MessageFormat:
    stops = [decode(self.tokenizer, [token]) for token in sorted(self.stop_token_ids) if 0 <= token < self.size]
    return message_format(self.tokenizer, self.use_chat_template, self.tools, self.role, stops)

  @functools.cached_property
  def _around(self) -> dict:
    """(before, after) ids around a message, after a turn that did not / did end on its stop token."""
    layout = self.format
    return {ended: (encode(self.tokenizer, layout.before[len(layout.turn_end) if ended else 0:], False),
                    encode(self.tokenizer, layout.after, False)) for ended in (False, True)}

  def turn(self, completion: Completion) -> Turn:
    tokens = completion.tokens
    stopped = completion.finish_reason == 'stop' and bool(tokens) and tokens[-1] in self.stop_token_ids
    content = tokens[:-1] if stopped else tokens
    return Turn(tokens=tokens, log_probs=completion.log_probs, finish_reason=completion.finish_reason,
                cache_id=completion.cache_id, text=decode(self.tokenizer, content),
                unknown_ids=tuple(t for t in content if not 0 <= t < self.size))

  def encode(self, text: str) -> tuple[int, ...]:
    return encode(self.tokenizer, text)

  def render(self, messages: list[dict]) -> tuple[int, ...]:
    """The ids the chat template gives `messages` with the next assistant header: a turn's
    context as a deployed model would read it (task.turn_context: as_rendered)."""
    options = dict(self.options, **({'tools': self.tools} if self.tools else {}))
    text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    return encode(self.tokenizer, text, False)

  def reply(self, text: str, turn: Completion) -> tuple[int, ...]:
    """The ids answering `turn` with the message `text`: the template's text around it (tokenized
    once, with its special tokens), `text` with special tokens split."""
    layout = self.format
    ended = bool(layout.turn_end) and turn.finish_reason == 'stop' and bool(turn.tokens) and \
        decode(self.tokenizer, turn.tokens[-1:]) == layout.turn_end
    before, after = self._around[ended]
    return before + self.encode(text) + after
