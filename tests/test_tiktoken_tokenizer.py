"""grpo_jax/data/tiktoken_tokenizer.py: a tiktoken BPE file made here (ranks learnt by tiktoken's own
trainer on a small text, special tokens past them, a tokenization_*.py whose pat_str is a join of
literals, as Moonlight's remote code writes it) converted to tokenizer.json, which encodes and decodes
fresh random text exactly as tiktoken's Encoding of the same ranks does, reads through transformers
without remote code, and keeps the chat template and special tokens."""

import base64
import json
import random

import pytest

from grpo_jax.data import tiktoken_tokenizer
from grpo_jax.errors import UserError

# A pre-tokenizing regex of the usual shape (contractions, letters, digits in threes, punctuation,
# spaces), written as the remote code writes its own: a "|".join of raw literals.
PATTERN_SOURCE = '''
class Tokenizer:
    pat_str = "|".join([
        r"""'(?i:[sdmt]|ll|ve|re)""",
        r"""[^\\r\\n\\p{L}\\p{N}]?\\p{L}+""",
        r"""\\p{N}{1,3}""",
        r""" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*""",
        r"""\\s*[\\r\\n]+""",
        r"""\\s+(?!\\S)""",
        r"""\\s+""",
    ])
'''
WORDS = ('the', 'model', 'samples', 'answers', 'reward', 'rises', 'latent', 'cache', 'expert', "don't", 'we\'ll',
         'Ünïcödé', '数学', 'ответ', '42', '3.14159', '\n', '  ', '!?', '(x+y)', 'naïve')


def _text(rng, words=60):
  return ''.join(rng.choice(WORDS) + rng.choice(['', ' ', ' ', '\n', ', ']) for _ in range(words))


@pytest.fixture
def tiktoken_dir(tmp_path, seed):
  import tiktoken._educational as educational
  rng = random.Random(seed)
  pattern = tiktoken_tokenizer._string_value(
      __import__('ast').parse(PATTERN_SOURCE).body[0].body[0].value)
  ranks = educational.bpe_train(_text(rng, 400), 300, pattern, visualise=None)
  directory = tmp_path / 'moonlight_like'
  directory.mkdir()
  with open(directory / 'tiktoken.model', 'w') as f:
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
      f.write(f'{base64.b64encode(token).decode()} {rank}\n')
  (directory / 'tokenization_moonshot.py').write_text(PATTERN_SOURCE)
  specials = {'[BOS]': len(ranks), '[EOS]': len(ranks) + 1, '<|im_user|>': len(ranks) + 2}
  config = dict(added_tokens_decoder={str(i): dict(content=c, special=True) for c, i in specials.items()},
                bos_token='[BOS]', eos_token='[EOS]', tokenizer_class='TikTokenTokenizer',
                auto_map={'AutoTokenizer': ['tokenization_moonshot.TikTokenTokenizer', None]},
                chat_template="{% for m in messages %}<|im_user|>{{ m['content'] }}{% endfor %}")
  (directory / 'tokenizer_config.json').write_text(json.dumps(config))
  return directory, ranks, pattern, specials


def test_the_converted_tokenizer_encodes_as_tiktoken(tiktoken_dir, tmp_path, seed):
  import tiktoken
  import tokenizers
  import transformers
  directory, ranks, pattern, specials = tiktoken_dir
  out = tiktoken_tokenizer.convert(str(directory), str(tmp_path / 'converted'))
  reference = tiktoken.Encoding('test', pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
  ours = tokenizers.Tokenizer.from_file(f'{out}/tokenizer.json')
  rng = random.Random(seed + 1)
  for _ in range(20):
    text = _text(rng)
    expected = reference.encode_ordinary(text)
    assert ours.encode(text).ids == expected, text
    assert ours.decode(expected) == text
  assert any(len(reference.decode_single_token_bytes(t)) > 3 for t in reference.encode_ordinary(_text(rng)))  # merges used
  fast = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)  # no remote code
  assert type(fast).__name__ in ('PreTrainedTokenizerFast', 'TokenizersBackend')
  assert fast.eos_token_id == specials['[EOS]'] and len(fast) == len(ranks) + len(specials)
  rendered = fast.apply_chat_template([{'role': 'user', 'content': 'the cache'}], tokenize=True)
  ids = rendered['input_ids'] if hasattr(rendered, 'keys') else rendered
  assert list(ids) == [specials['<|im_user|>']] + reference.encode_ordinary('the cache')


def test_bad_tiktoken_files_are_one_line_errors(tiktoken_dir, tmp_path):
  directory, *_ = tiktoken_dir
  with open(directory / 'tiktoken.model', 'a') as f:
    f.write('not-base64!! x\n')
  with pytest.raises(UserError, match='tiktoken.model:301: not a "base64 rank" line'):
    tiktoken_tokenizer.convert(str(directory), str(tmp_path / 'out'))
  with pytest.raises(UserError, match='tiktoken.model not found'):
    tiktoken_tokenizer.convert(str(tmp_path), str(tmp_path / 'out'))
