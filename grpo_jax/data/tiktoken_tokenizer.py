"""A tiktoken BPE tokenizer (Moonlight's and Kimi's `tiktoken.model`, which the hub loads through remote
code) written as a Hugging Face tokenizer.json that `tokenizers` and transformers read without it.

  python -m grpo_jax.data.tiktoken_tokenizer MODEL_DIR --out TOKENIZER_DIR [--pattern REGEX]

MODEL_DIR holds `tiktoken.model` (one "base64(bytes) rank" line per token), `tokenizer_config.json`
(its special tokens, `added_tokens_decoder`, and the chat template) and the remote code's
`tokenization_*.py`, from which the pre-tokenizing regex (`pat_str`) is read as text (parsed, never
run). TOKENIZER_DIR gets tokenizer.json and a tokenizer_config.json for PreTrainedTokenizerFast
(the same special tokens and chat template; no remote code): point `task.tokenizer` at it.

The encoding is tiktoken's, exactly: the text split by the regex; each piece that is a token
itself taken whole, the others merged pair by pair from their bytes, always the adjacent pair whose
join has the lowest rank. As a BPE model that is the vocabulary of the ranks (byte-level: each
byte as GPT-2's printable character) with every split (a, b) of a token t into two tokens as a
merge of priority rank(t), and whole pieces looked up first (ignore_merges).
"""

import argparse
import ast
import base64
import glob
import json
import os

from grpo_jax.errors import UserError

RANKS_FILE = 'tiktoken.model'


def byte_characters() -> dict[int, str]:
  """Each byte's character in a byte-level BPE vocabulary (GPT-2's): printable Latin-1 bytes as
  themselves, the other 68 as the code points from 256 up, in byte order."""
  printable = [*range(ord('!'), ord('~') + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  table, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      table[byte] = chr(byte)
    else:
      table[byte] = chr(256 + extra)
      extra += 1
  return table


def read_ranks(path: str) -> dict[bytes, int]:
  """A tiktoken file's {token bytes: rank}; one-line errors naming the file and line."""
  ranks = {}
  with open(path, 'rb') as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        token, rank = line.split()
        ranks[base64.b64decode(token, validate=True)] = int(rank)
      except ValueError as error:
        raise UserError(f'{path}:{number}: not a "base64 rank" line of a tiktoken file ({error})') from None
  if sorted(ranks.values()) != list(range(len(ranks))):
    raise UserError(f'{path}: the ranks are not 0 .. {len(ranks) - 1}, each once')
  return ranks


def _string_value(node: ast.AST):
  """A string built of literals: a constant, `+` of strings, `"sep".join([...])`; None otherwise."""
  if isinstance(node, ast.Constant) and isinstance(node.value, str):
    return node.value
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    left, right = _string_value(node.left), _string_value(node.right)
    return None if left is None or right is None else left + right
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == 'join'
      and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple))):
    separator = _string_value(node.func.value)
    parts = [_string_value(element) for element in node.args[0].elts]
    return None if separator is None or None in parts else separator.join(parts)
  return None


def read_pattern(directory: str) -> str:
  """The `pat_str` regex assigned in the directory's tokenization_*.py, read from its syntax tree."""
  for path in sorted(glob.glob(os.path.join(directory, 'tokenization_*.py'))):
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Assign) and any(isinstance(t, (ast.Name, ast.Attribute)) and
                                              getattr(t, 'id', getattr(t, 'attr', None)) == 'pat_str'
                                              for t in node.targets):
        value = _string_value(node.value)
        if value is not None:
          return value
  raise UserError(f'{directory}: no tokenization_*.py assigns pat_str a string of literals; pass --pattern')


def special_tokens(directory: str, vocabulary: int) -> tuple[dict[str, int], dict]:
  """({special token: id}, the tokenizer_config.json) of the directory: the added_tokens_decoder
  entries, each id at or past the ranks' count."""
  path = os.path.join(directory, 'tokenizer_config.json')
  if not os.path.isfile(path):
    return {}, {}
  with open(path) as f:
    config = json.load(f)
  tokens = {}
  for key, entry in (config.get('added_tokens_decoder') or {}).items():
    content = entry['content'] if isinstance(entry, dict) else str(entry)
    if int(key) < vocabulary:
      raise UserError(f'{path}: added token {content!r} has id {key}, inside the BPE ranks [0, {vocabulary})')
    tokens[content] = int(key)
  return tokens, config


def tokenizer_json(ranks: dict[bytes, int], pattern: str, specials: dict[str, int]) -> dict:
  """The tokenizer.json of a tiktoken encoding (the module docstring's construction)."""
  characters = byte_characters()
  text = {token: ''.join(characters[byte] for byte in token) for token in ranks}
  merges = []
  for token, rank in ranks.items():
    for cut in range(1, len(token)):
      left, right = token[:cut], token[cut:]
      if left in ranks and right in ranks:
        merges.append((rank, ranks[left], ranks[right], text[left], text[right]))
  merges.sort()
  added = [dict(id=index, content=content, single_word=False, lstrip=False, rstrip=False, normalized=False,
                special=True) for content, index in sorted(specials.items(), key=lambda item: item[1])]
  return {
      'version': '1.0', 'truncation': None, 'padding': None, 'added_tokens': added, 'normalizer': None,
      'pre_tokenizer': {'type': 'Sequence', 'pretokenizers': [
          {'type': 'Split', 'pattern': {'Regex': pattern}, 'behavior': 'Isolated', 'invert': False},
          {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False}]},
      'post_processor': None,
      'decoder': {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False},
      'model': {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
                'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False, 'ignore_merges': True,
                'vocab': {text[token]: rank for token, rank in ranks.items()},
                'merges': [[left, right] for _, _, _, left, right in merges]},
  }


def convert(directory: str, out: str, pattern: str | None = None) -> str:
  """Writes `out`/tokenizer.json and tokenizer_config.json from `directory`'s tiktoken tokenizer;
  returns `out`."""
  path = os.path.join(directory, RANKS_FILE)
  if not os.path.isfile(path):
    raise UserError(f'{path} not found: a tiktoken tokenizer directory holds {RANKS_FILE}')
  ranks = read_ranks(path)
  specials, config = special_tokens(directory, len(ranks))
  pattern = pattern or read_pattern(directory)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'tokenizer.json'), 'w') as f:
    json.dump(tokenizer_json(ranks, pattern, specials), f, ensure_ascii=False)
  kept = {key: value for key, value in config.items() if key not in ('auto_map', 'tokenizer_class', 'tokenizer_file',
                                                                    'vocab_file')}
  with open(os.path.join(out, 'tokenizer_config.json'), 'w') as f:
    json.dump({**kept, 'tokenizer_class': 'PreTrainedTokenizerFast'}, f, ensure_ascii=False, indent=2)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('directory', help='the model directory holding tiktoken.model and tokenizer_config.json')
  parser.add_argument('--out', required=True, help='where tokenizer.json and tokenizer_config.json are written')
  parser.add_argument('--pattern', help="the pre-tokenizing regex (default: the tokenization_*.py's pat_str)")
  args = parser.parse_args(argv)
  print(convert(args.directory, args.out, args.pattern))


if __name__ == '__main__':
  try:
    main()
  except UserError as error:
    raise SystemExit(f'error: {error}') from None
