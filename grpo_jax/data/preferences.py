"""Preference pairs: the records of a preference dataset as (conversation, chosen reply, rejected
reply), what a reward model learns from (Bradley-Terry: the chosen reply should score higher).

`adapt_preferences(records, format, source)` reads the plain dict records of data/sources.py
(JSONL, JSON, parquet, the Hugging Face cache) in one of these schemas:

  hh_rlhf   Anthropic HH-RLHF: `chosen` and `rejected` are whole transcripts,
            "\\n\\nHuman: ...\\n\\nAssistant: ..." turns; both share every turn but their last,
            an assistant turn, which is the reply.
  messages  the chat-message form (UltraFeedback-binarized, Skywork's preference sets, TRL's
            conversational preference schema): `chosen` and `rejected` are lists of
            {"role", "content"} messages; `prompt` (chat messages or text) is the conversation
            before the reply. Without `prompt`, or where `chosen` repeats it, the messages both
            replies share from the start are the conversation and the rest of each is its reply.
            A reply may also be plain text (an assistant message).

A pair is the conversation (messages, the last one the user's) and each reply (one or more
messages after it, the last one the assistant's). The full conversations are `prompt + chosen`
and `prompt + rejected`, rendered later with the reward model's chat template.

A record that is not a preference pair at all (a field missing, a message that is not a role and
content, a transcript that does not parse) is one error naming the source, the record and what is
wrong: the dataset is not what its format says. A record that is a pair but teaches nothing is
skipped and counted by reason: the two replies are the same ('identical'), or one is empty
('empty reply').
"""

import collections
import dataclasses
import math
import re
from typing import Literal, get_args

import numpy as np

from grpo_jax.data.adapters import lookup, not_a_message, plain_messages, scalar_text
from grpo_jax.errors import UserError

PreferenceFormat = Literal['hh_rlhf', 'messages']
PREFERENCE_FORMATS: tuple[str, ...] = get_args(PreferenceFormat)

Messages = tuple[dict, ...]
# An HH-RLHF turn marker: a blank line, the speaker, a colon (the space after it is the text's).
_HH_TURN = re.compile(r'\n\n(Human|Assistant):')
_HH_ROLES = {'Human': 'user', 'Assistant': 'assistant'}


@dataclasses.dataclass(frozen=True)
class Preference:
  """One preference pair. prompt: the conversation before the replies (chat messages, the last
  one the user's); chosen / rejected: the preferred and the other reply (messages after the
  prompt, the last one the assistant's); data_source: the dataset it came from; margin: how much
  better the chosen reply was rated (the record's margin field), None without one."""

  prompt: Messages
  chosen: Messages
  rejected: Messages
  data_source: str
  margin: float | None = None

  def conversations(self) -> tuple[Messages, Messages]:
    """The chosen and the rejected conversation, whole."""
    return self.prompt + self.chosen, self.prompt + self.rejected


@dataclasses.dataclass(frozen=True)
class AdaptedPreferences:
  """The pairs of a dataset, in record order, and the records skipped, counted by reason."""

  pairs: list[Preference]
  skipped: dict[str, int]


class _BadRecord(Exception):
  """What is wrong with one record (adapt_preferences names the record)."""


def _messages(value, field: str) -> Messages:
  """Chat messages of a field as plain {'role', 'content'} dicts (parquet gives each message every
  key any message has, filled with None); plain text is one assistant message."""
  if isinstance(value, str):
    return ({'role': 'assistant', 'content': value},)
  if not isinstance(value, (list, tuple)):
    raise _BadRecord(f'field {field!r} is a {type(value).__name__}, not chat messages or text')
  bad = not_a_message(value)
  if bad is not None:
    raise _BadRecord(f'field {field!r} holds a chat message that is not a {{"role": str, "content": str}} dict: '
                     f'{str(bad)[:80]}')
  return plain_messages(value)


def _transcript(text, field: str) -> Messages:
  """An HH-RLHF transcript as chat messages."""
  if not isinstance(text, str):
    raise _BadRecord(f'field {field!r} is a {type(text).__name__}, not a transcript')
  parts = _HH_TURN.split(text if text.startswith('\n\n') else '\n\n' + text.lstrip())
  if parts[0].strip() or len(parts) < 3:
    raise _BadRecord(f'field {field!r} is not a "\\n\\nHuman: ... \\n\\nAssistant: ..." transcript: {text[:80]!r}')
  return tuple({'role': _HH_ROLES[speaker], 'content': content.strip()}
               for speaker, content in zip(parts[1::2], parts[2::2]))


def _shared_start(first: Messages, second: Messages) -> int:
  """How many messages two conversations share from their start."""
  count = 0
  while count < min(len(first), len(second)) and first[count] == second[count]:
    count += 1
  return count


def _pair(chosen: Messages, rejected: Messages, prompt: Messages | None) -> tuple[Messages, Messages, Messages]:
  """(prompt, chosen reply, rejected reply): with a prompt, each side with the prompt taken off its
  start where it repeats it; without, the messages both share from the start (up to the last user
  message they share) are the prompt."""
  if prompt is None:
    shared = _shared_start(chosen, rejected)
    users = [index for index in range(shared) if chosen[index]['role'] == 'user']
    if not users:
      raise _BadRecord('the chosen and rejected conversations share no user message to reply to')
    cut = users[-1] + 1
    prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
  else:
    chosen = chosen[len(prompt):] if chosen[:len(prompt)] == prompt else chosen
    rejected = rejected[len(prompt):] if rejected[:len(prompt)] == prompt else rejected
  if not prompt or prompt[-1]['role'] != 'user':
    raise _BadRecord('the conversation before the replies does not end with a user message')
  for name, reply in (('chosen', chosen), ('rejected', rejected)):
    if reply and reply[-1]['role'] != 'assistant':
      raise _BadRecord(f'the {name} reply does not end with an assistant message')
  return prompt, chosen, rejected


def _read(record: dict, format: str) -> tuple[Messages, Messages, Messages]:
  for field in ('chosen', 'rejected'):
    if lookup(record, field) is None:
      raise _BadRecord(f'no field {field!r} (missing or null; its fields: {", ".join(map(str, record))})')
  if format == 'hh_rlhf':
    return _pair(_transcript(record['chosen'], 'chosen'), _transcript(record['rejected'], 'rejected'), None)
  prompt = record.get('prompt')
  if prompt is not None:
    prompt = ({'role': 'user', 'content': prompt},) if isinstance(prompt, str) else _messages(prompt, 'prompt')
  return _pair(_messages(record['chosen'], 'chosen'), _messages(record['rejected'], 'rejected'), prompt)


def _margin(record: dict, field: str) -> float:
  value = lookup(record, field)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise _BadRecord(f'margin field {field!r} is {value!r}, not a finite number')
  return float(value)


def adapt_preferences(records: list[dict], format: str, source: str,
                      margin_field: str | None = None) -> AdaptedPreferences:
  """The preference pairs of `records` read in `format` (see the module docstring); `source` (the
  config's source string) names the dataset in messages and is the default data source;
  `margin_field`: the (dotted) field holding each pair's margin, a number in every pair not skipped."""
  if format not in PREFERENCE_FORMATS:
    raise UserError(f'preference format {format!r} of {source} is not one of {", ".join(PREFERENCE_FORMATS)}')
  pairs, skipped = [], collections.Counter()
  for index, record in enumerate(records):
    try:
      prompt, chosen, rejected = _read(record, format)
      if not any(m['content'].strip() for m in chosen) or not any(m['content'].strip() for m in rejected):
        skipped['empty reply'] += 1
        continue
      if chosen == rejected:
        skipped['identical'] += 1
        continue
      margin = None if margin_field is None else _margin(record, margin_field)
    except _BadRecord as error:
      raise UserError(f'record {index} of {source} (format {format}): {error}') from None
    data_source = scalar_text(record.get('data_source')) or source
    pairs.append(Preference(prompt=prompt, chosen=chosen, rejected=rejected, data_source=data_source, margin=margin))
  if not pairs:
    raise UserError(f'none of the {len(records)} records of {source} (format {format}) is a usable preference pair '
                    f'(skipped: {dict(skipped)})')
  return AdaptedPreferences(pairs=pairs, skipped=dict(skipped))


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
  """Preference pairs as token ids for a reward model: each side's conversation rendered whole with
  the reward model's chat template (no generation prompt: the reply is there), right-padded to
  `max_length` with its pad id. chosen / rejected [B, max_length] int32, their masks [B, max_length]
  int32 (1 on the conversation's tokens), kept [B] the indices of the pairs taken; too_long: the pairs
  left out because a side does not fit."""

  chosen: np.ndarray
  chosen_mask: np.ndarray
  rejected: np.ndarray
  rejected_mask: np.ndarray
  kept: np.ndarray
  too_long: int


def encode_pairs(tokenizer, pairs: list[Preference], max_length: int, pad_id: int) -> EncodedPairs:
  """The pairs' conversations through `tokenizer`'s chat template (the reward model's own, which
  is how it reads a conversation: its model card's template, not the policy's). A pair with a side
  longer than `max_length` tokens is left out and counted, not cut: the reward model reads the
  last token, so cutting the end would score another reply, and cutting the start another
  conversation (the rule of TRL's reward trainer too). A side that ends in the pad id (a template
  that closes the reply with an eos that is the pad id) is read at the token before it, as
  transformers reads it (model/qwen2.py score_positions)."""
  if max_length <= 0:
    raise UserError(f'max_length must be positive, got {max_length}')
  sides, kept, too_long = ([], []), [], 0
  for index, pair in enumerate(pairs):
    ids = [list(tokenizer.apply_chat_template(list(conversation), tokenize=True, add_generation_prompt=False,
                                              return_dict=False)) for conversation in pair.conversations()]
    if max(map(len, ids)) > max_length:
      too_long += 1
      continue
    for side, row in zip(sides, ids):
      side.append(row)
    kept.append(index)

  def padded(rows):
    tokens = np.full((len(rows), max_length), pad_id, np.int32)
    mask = np.zeros((len(rows), max_length), np.int32)
    for row, ids in enumerate(rows):
      tokens[row, :len(ids)], mask[row, :len(ids)] = ids, 1
    return tokens, mask
  (chosen, chosen_mask), (rejected, rejected_mask) = padded(sides[0]), padded(sides[1])
  return EncodedPairs(chosen=chosen, chosen_mask=chosen_mask, rejected=rejected, rejected_mask=rejected_mask,
                      kept=np.asarray(kept, np.int64), too_long=too_long)
