"""Stop and pad ids for every entry point (training tasks, generate, serve), resolved one way."""

import dataclasses

# Beyond the tokenizer's eos: Qwen chat models end a turn with <|im_end|>, base models with <|endoftext|>.
STOP_TOKENS = ('<|im_end|>', '<|endoftext|>')


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  eos_id: int | None  # the tokenizer's end token (None: the checkpoint has no tokenizer and no eos)
  pad_id: int  # fills prompts and finished rows; never attended to or trained on
  stop_ids: tuple[int, ...]  # a completion ends after emitting any of these


def special_tokens(tokenizer, eos_token_ids=()) -> SpecialTokens:
  """eos: the tokenizer's, else the first of STOP_TOKENS it has, else the model config's first
  eos_token_ids; pad: the tokenizer's, else eos, else 0; stops: eos, the STOP_TOKENS the tokenizer
  has, and the model config's eos_token_ids, in that order without repeats."""
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
  pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else None
  pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
  return SpecialTokens(eos_id=eos_id, pad_id=int(pad_id), stop_ids=tuple(dict.fromkeys(int(t) for t in stops)))
