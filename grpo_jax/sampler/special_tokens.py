"""Stop and pad ids for every entry point (training tasks, generate, serve), resolved one way.

Families name their stops in three places, and a completion must end at any of them:
  * the tokenizer's eos (tokenizer_config.json);
  * config.json's `eos_token_id`, an id or a list;
  * generation_config.json's `eos_token_id`, an id or a list: Llama 3.1/3.2 instruct list
    <|end_of_text|>, <|eom_id|> and <|eot_id|> there while the tokenizer names one eos; Gemma 3 lists
    <eos> and <end_of_turn>; GLM-4 lists <|endoftext|>, <|user|> and <|observation|>.
`checkpoint_eos_ids` reads the last two from a model's (or a tokenizer's) directory; `special_tokens`
joins them with the tokenizer's; `tokenizer_size` is how many ids a tokenizer of either library decodes.

The pad id is only ever a filler. Every mask in the stack (the prompt's, the completion's, the
loss's, the reward's text, serving's and generate's answers, the agents' trajectories) is built
from lengths, never from `token != pad`: Qwen's own pad <|endoftext|> and GLM-4's are stop ids that
the model emits, so no value of pad could be told apart from a real token by comparing ids. A
family with no pad token (Llama 3, DeepSeek-LLM) still does not get pad = eos: its filler is the
tokenizer's unk token, else the smallest id that is no stop and no BOS, so a dump of the token
arrays never shows a false end of sequence.
"""

import dataclasses
import json
import os

from grpo_jax.errors import UserError

# Beyond the tokenizer's eos: Qwen chat models end a turn with <|im_end|>, base models with <|endoftext|>.
STOP_TOKENS = ('<|im_end|>', '<|endoftext|>')
EOS_FILES = ('config.json', 'generation_config.json')  # where a checkpoint lists its eos ids


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  eos_id: int | None  # the tokenizer's end token (None: the checkpoint has no tokenizer and no eos)
  pad_id: int  # fills prompts and finished rows; a filler only: masks come from lengths, never from it
  stop_ids: tuple[int, ...]  # a completion ends after emitting any of these


def _ids(value, where: str) -> tuple[int, ...]:
  """eos_token_id as a file writes it (absent, an id, or a list of ids) -> ids."""
  values = [] if value is None else value if isinstance(value, list) else [value]
  if not all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in values):
    raise UserError(f'{where}: eos_token_id must be a token id or a list of them, got {value!r}')
  return tuple(values)


def checkpoint_eos_ids(*directories) -> tuple[int, ...]:
  """The eos ids that config.json and generation_config.json list in each of `directories` (None
  and missing files skipped), in that order without repeats. A multimodal config.json keeps the
  language model's in its `text_config` when not at the top (Gemma 3 4B-27B)."""
  ids = []
  for directory in directories:
    for name in EOS_FILES if directory else ():
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        continue
      with open(path) as f:
        raw = json.load(f)
      value = raw.get('eos_token_id')
      if value is None and isinstance(raw.get('text_config'), dict):
        value = raw['text_config'].get('eos_token_id')
      ids += _ids(value, path)
  return tuple(dict.fromkeys(ids))


def special_tokens(tokenizer, eos_token_ids=()) -> SpecialTokens:
  """eos: the tokenizer's, else the first of STOP_TOKENS it has, else the first of `eos_token_ids`
  (checkpoint_eos_ids); stops: eos, the STOP_TOKENS the tokenizer has, and `eos_token_ids`, in that
  order without repeats; pad: the tokenizer's (GLM-4's and Qwen's name a stop: harmless, see the
  module's docstring), else its unk, else the smallest id that is neither a stop nor its BOS (a
  family without a pad never gets its eos), else 0 without a tokenizer."""
  stops = []
  eos_id = None
  if tokenizer is not None:
    vocab = tokenizer.get_vocab()
    known = [vocab[token] for token in STOP_TOKENS if token in vocab]
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else next(iter(known), None)
    stops = ([eos_id] if eos_id is not None else []) + known
  stops += [int(token) for token in eos_token_ids]
  if eos_id is None and stops:
    eos_id = stops[0]
  stop_ids = tuple(dict.fromkeys(int(t) for t in stops))
  return SpecialTokens(eos_id=eos_id, pad_id=_pad_id(tokenizer, stop_ids), stop_ids=stop_ids)


def _pad_id(tokenizer, stop_ids: tuple[int, ...]) -> int:
  if tokenizer is None:
    return 0
  for token in (tokenizer.pad_token_id, tokenizer.unk_token_id):
    if token is not None:
      return int(token)
  taken = set(stop_ids) | {tokenizer.bos_token_id}
  return next(token for token in range(len(tokenizer) + 1) if token not in taken)


def tokenizer_size(tokenizer) -> int:
  """How many ids the tokenizer decodes (added tokens included): a transformers tokenizer or a
  `tokenizers.Tokenizer`."""
  if hasattr(tokenizer, 'get_vocab_size'):
    return tokenizer.get_vocab_size(with_added_tokens=True)
  return len(tokenizer)
