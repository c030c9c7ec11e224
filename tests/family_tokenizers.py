"""Tokenizer directories shaped like each model family's, built here with the `tokenizers` library.

Each family's special tokens, BOS rule, chat template (written for these tests after the family's
layout), pad (or none) and the eos lists of its config.json and generation_config.json, on a
byte-level vocabulary: 256 byte symbols and the family's special tokens, so any text tokenizes
without training. `write_family(directory, name)` writes the directory and returns the Family.
transformers renders templates with trim_blocks: a newline right after a `{% ... %}` tag is
dropped, so the templates write theirs inside `{{ }}` or after text.
"""

import dataclasses
import json
import os

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}{% endfor %}")
GLM4_TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}{{ '<|observation|>' if m['role'] == 'tool' else '<|' + m['role'] + '|>' }}"
    "\n{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant: {{ m['content'] }}"
    "{{ eos_token }}{% else %}User: {{ m['content'] }}\n\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


@dataclasses.dataclass(frozen=True)
class Family:
  """name; specials: the special tokens, in id order, placed `first` (ids 0, 1, ...) or after the
  256 byte symbols; bos / eos / pad / unk: tokenizer_config.json's (None: absent); prefix: the
  tokens the tokenizer writes before a text (its post-processor); template and where it is stored
  ('config': tokenizer_config.json, 'jinja': chat_template.jinja); config_eos / generation_eos:
  config.json's and generation_config.json's eos_token_id (a name or a list of names);
  stops: every token that ends a completion."""

  name: str
  specials: tuple[str, ...]
  first: bool
  bos: str | None
  eos: str
  pad: str | None
  unk: str | None
  prefix: tuple[str, ...]
  template: str
  template_file: str
  config_eos: object
  generation_eos: object
  stops: tuple[str, ...]


FAMILIES = {
    'llama3': Family('llama3', ('<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>',
                                '<|eom_id|>', '<|eot_id|>'), False,
                     '<|begin_of_text|>', '<|eot_id|>', None, None, ('<|begin_of_text|>',), LLAMA3_TEMPLATE, 'config',
                     '<|end_of_text|>', ['<|end_of_text|>', '<|eom_id|>', '<|eot_id|>'],
                     ('<|eot_id|>', '<|end_of_text|>', '<|eom_id|>')),
    'mistral': Family('mistral', ('<unk>', '<s>', '</s>', '[INST]', '[/INST]'), True, '<s>', '</s>', None, '<unk>',
                      ('<s>',), MISTRAL_TEMPLATE, 'jinja', '</s>', '</s>', ('</s>',)),
    'glm4': Family('glm4', ('<|endoftext|>', '[MASK]', '[gMASK]', '[sMASK]', '<sop>', '<eop>', '<|system|>', '<|user|>',
                            '<|assistant|>', '<|observation|>'), False,
                   None, '<|endoftext|>', '<|endoftext|>', None, ('[gMASK]', '<sop>'), GLM4_TEMPLATE, 'jinja',
                   ['<|endoftext|>', '<|user|>', '<|observation|>'], ['<|endoftext|>', '<|user|>', '<|observation|>'],
                   ('<|endoftext|>', '<|user|>', '<|observation|>')),
    'gemma3': Family('gemma3', ('<pad>', '<eos>', '<bos>', '<unk>', '<start_of_turn>', '<end_of_turn>'), True,
                     '<bos>', '<eos>', '<pad>', '<unk>', ('<bos>',), GEMMA3_TEMPLATE, 'config',
                     '<eos>', ['<eos>', '<end_of_turn>'], ('<eos>', '<end_of_turn>')),
    'deepseek': Family('deepseek', ('<｜begin▁of▁sentence｜>', '<｜end▁of▁sentence｜>'), False,
                       '<｜begin▁of▁sentence｜>', '<｜end▁of▁sentence｜>', None, None, ('<｜begin▁of▁sentence｜>',),
                       DEEPSEEK_TEMPLATE, 'config', '<｜end▁of▁sentence｜>', '<｜end▁of▁sentence｜>',
                       ('<｜end▁of▁sentence｜>',)),
}


def vocabulary(family: Family) -> dict[str, int]:
  """token -> id: the 256 byte symbols and the family's special tokens, specials first or last."""
  from tokenizers import pre_tokenizers
  symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
  ordered = (*family.specials, *symbols) if family.first else (*symbols, *family.specials)
  return {token: index for index, token in enumerate(ordered)}


def _ids(names, vocab):
  return [vocab[name] for name in names] if isinstance(names, list) else vocab[names]


def write_family(directory: str, name: 'str | Family') -> Family:
  """The tokenizer files of family `name` (or a Family given whole) in `directory` (created), and
  the eos ids of its config.json (added to one already there: a checkpoint's) and
  generation_config.json."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
  family = name if isinstance(name, Family) else FAMILIES[name]
  os.makedirs(directory, exist_ok=True)
  vocab = vocabulary(family)
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in family.specials])
  if family.prefix:
    single = ' '.join(family.prefix) + ' $A'
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=single + ' $B', special_tokens=[(token, vocab[token]) for token in family.prefix])
  tokenizer.save(os.path.join(directory, 'tokenizer.json'))
  settings = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': family.eos, 'bos_token': family.bos,
              'pad_token': family.pad, 'unk_token': family.unk, 'model_max_length': 4096}
  if family.template_file == 'config':
    settings['chat_template'] = family.template
  else:
    with open(os.path.join(directory, 'chat_template.jinja'), 'w') as f:
      f.write(family.template)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w') as f:
    json.dump(settings, f, ensure_ascii=False)
  path = os.path.join(directory, 'config.json')
  config = {}
  if os.path.isfile(path):
    with open(path) as f:
      config = json.load(f)
  with open(path, 'w') as f:
    json.dump({**config, 'eos_token_id': _ids(family.config_eos, vocab), 'bos_token_id': None}, f)
  with open(os.path.join(directory, 'generation_config.json'), 'w') as f:
    json.dump({'eos_token_id': _ids(family.generation_eos, vocab),
               'bos_token_id': vocab[family.bos] if family.bos else None}, f)
  return family


def byte_symbols() -> dict[int, str]:
  """The byte-level alphabet's symbol of each byte, written out here as GPT-2 defined it: the
  printable bytes stand for themselves, the other 68 for code points 256, 257, ... in byte order."""
  printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
  others = [byte for byte in range(256) if byte not in printable]
  return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + n) for n, byte in enumerate(others)}}


def hand_ids(family: Family, pieces) -> list[int]:
  """The ids of `pieces` computed by hand: a special token's own id, any other text byte by byte."""
  vocab, symbols = vocabulary(family), byte_symbols()
  ids = []
  for piece in pieces:
    ids += [vocab[piece]] if piece in family.specials else [vocab[symbols[byte]] for byte in piece.encode()]
  return ids
