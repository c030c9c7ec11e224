"""Preference pairs of random words for the CPU demo of reward-model training
(configs/tiny_reward_model.yaml) and its tests, written on the fly.

`python -m grpo_jax.data.word_preferences --out DIR [--pairs N] [--seed S]` writes
  DIR/train.jsonl   {"prompt", "chosen", "rejected"} records (preferences.format: messages): a
                    question of random words and two replies of random words
  DIR/tokenizer/    a word-level tokenizer built with the `tokenizers` library, saved through
                    transformers with a ChatML chat template and a pad token
Which reply is chosen follows a hidden property, as data/synthetic_preferences.py draws it: a
reply's share of "sunny" words (SUNNY) sets its quality, and the chosen one is drawn by
Bradley-Terry, P(a chosen over b) = sigmoid(beta * (share(a) - share(b))). A reward model that
learns to count sunny words orders the pairs as well as the labels allow. Nothing is downloaded;
the same seed writes the same files.
"""

import argparse
import json
import os
import sys

import numpy as np

from grpo_jax.data.synthetic_preferences import bradley_terry_labels

SUNNY = ('bright', 'calm', 'clear', 'glad', 'kind', 'warm')
PLAIN = ('box', 'cloud', 'door', 'field', 'hill', 'lamp', 'leaf', 'road', 'rock', 'stone', 'tree', 'wall',
         'blue', 'green', 'small', 'tall', 'old', 'new', 'walks', 'sees', 'finds', 'keeps', 'and', 'the')
SPECIAL = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<unk>')
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def vocabulary() -> list[str]:
  return list(SPECIAL) + ['user', 'assistant', '?'] + list(SUNNY) + list(PLAIN)


def build_tokenizer():
  """A transformers fast tokenizer: one token per word; ChatML turns; <|endoftext|> pads."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  core = Tokenizer(models.WordLevel({token: index for index, token in enumerate(vocabulary())}, unk_token='<unk>'))
  core.pre_tokenizer = pre_tokenizers.Whitespace()
  core.decoder = decoders.WordPiece()
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                                      unk_token='<unk>', additional_special_tokens=['<|im_start|>'])
  tokenizer.chat_template = CHAT_TEMPLATE
  return tokenizer


def pairs(count: int, seed: int = 0, beta: float = 12.0, reply_words: tuple[int, int] = (2, 8)) -> list[dict]:
  """`count` preference records: a question of 2-5 plain words, two replies of `reply_words` words,
  each with its own share of sunny words, the chosen one drawn by Bradley-Terry (module docstring)."""
  rng = np.random.default_rng(seed)

  def reply():
    share = rng.uniform()
    words = [rng.choice(SUNNY) if rng.uniform() < share else rng.choice(PLAIN)
             for _ in range(rng.integers(reply_words[0], reply_words[1] + 1))]
    return ' '.join(words), sum(word in SUNNY for word in words) / len(words)

  records = []
  while len(records) < count:
    question = ' '.join(rng.choice(PLAIN, rng.integers(2, 6))) + ' ?'
    (first, first_share), (second, second_share) = reply(), reply()
    if first == second:
      continue
    first_wins = bool(bradley_terry_labels(rng, np.array([first_share]), np.array([second_share]), beta)[0])
    chosen, rejected = (first, second) if first_wins else (second, first)
    records.append({'prompt': question, 'chosen': chosen, 'rejected': rejected})
  return records


def write(out: str, count: int = 2048, seed: int = 0) -> dict:
  """Writes the pairs and the tokenizer under `out`; returns their paths."""
  os.makedirs(out, exist_ok=True)
  paths = dict(train=os.path.join(out, 'train.jsonl'), tokenizer=os.path.join(out, 'tokenizer'))
  with open(paths['train'], 'w') as f:
    f.writelines(json.dumps(record) + '\n' for record in pairs(count, seed))
  build_tokenizer().save_pretrained(paths['tokenizer'])
  return paths


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.data.word_preferences', description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, help='directory for train.jsonl and tokenizer/')
  parser.add_argument('--pairs', type=int, default=2048)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  paths = write(args.out, args.pairs, args.seed)
  print(f'wrote {paths["train"]} and {paths["tokenizer"]}/')


if __name__ == '__main__':
  main()
