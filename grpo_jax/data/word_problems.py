"""Word problems for the CPU demo of the text path (configs/tiny_math.yaml), written on the fly.

`python -m grpo_jax.data.word_problems --out DIR` writes
  DIR/train.jsonl, DIR/eval.jsonl   {"question": ..., "answer": "7"} records (task.format: custom)
  DIR/tokenizer/                    a word-level tokenizer built with the `tokenizers` library,
                                    saved through transformers with a ChatML chat template
Every problem is one small addition or subtraction told as a story ("Ann has 3 pens and gets 4
more. How many pens does Ann have?"). The evaluation problems are other problems than the
training ones: story, person, object and numbers never appear together in train.jsonl. Nothing is
downloaded; the same seed writes the same files.
"""

import argparse
import itertools
import json
import os
import random
import sys

NAMES = ('Ann', 'Ben', 'Cat', 'Dan', 'Eve', 'Fay')
ITEMS = ('apples', 'pens', 'cards', 'books', 'coins', 'shells')
# (story, operation): a + b, or a - b with a >= b.
STORIES = (
    ('{name} has {a} {item} and gets {b} more . How many {item} does {name} have ?', '+'),
    ('{name} had {a} {item} . A friend gave {name} {b} {item} . How many {item} now ?', '+'),
    ('There are {a} {item} in a box and {name} puts in {b} more . How many {item} are in the box ?', '+'),
)
SPECIAL = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<unk>')
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def problems(max_operand: int = 4) -> list[dict]:
  """Every (story, name, item, a, b) problem with operands in [0, max_operand]."""
  rows = []
  for (story, operation), name, item, a, b in itertools.product(
      STORIES, NAMES, ITEMS, range(max_operand + 1), range(max_operand + 1)):
    if operation == '-' and a < b:
      continue
    answer = a + b if operation == '+' else a - b
    rows.append({'question': story.format(name=name, item=item, a=a, b=b), 'answer': str(answer)})
  return rows


def split(rows: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
  """(train, eval): a seeded shuffle, the last `eval_fraction` held out."""
  rows = list(rows)
  random.Random(seed).shuffle(rows)
  held_out = max(1, int(len(rows) * eval_fraction))
  return rows[:-held_out], rows[-held_out:]


def vocabulary() -> list[str]:
  words = {'user', 'assistant', *'0123456789'}
  for story, _ in STORIES:
    words.update(word for word in story.split() if not word.startswith('{'))
  words.update(NAMES)
  words.update(ITEMS)
  return list(SPECIAL) + sorted(words)


def build_tokenizer():
  """A transformers fast tokenizer: one token per word, digit and punctuation mark; ChatML turns."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {token: index for index, token in enumerate(vocabulary())}
  core = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
  core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                pre_tokenizers.Digits(individual_digits=True)])
  core.decoder = decoders.Fuse()  # completions decode to '12', not '1 2'
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                                      unk_token='<unk>', additional_special_tokens=['<|im_start|>'])
  tokenizer.chat_template = CHAT_TEMPLATE
  return tokenizer


def write(out: str, max_operand: int = 4, eval_fraction: float = 0.1, seed: int = 0) -> dict:
  """Writes the dataset and the tokenizer under `out`; returns their paths."""
  train, held_out = split(problems(max_operand), eval_fraction, seed)
  os.makedirs(out, exist_ok=True)
  paths = dict(train=os.path.join(out, 'train.jsonl'), eval=os.path.join(out, 'eval.jsonl'),
               tokenizer=os.path.join(out, 'tokenizer'))
  for name, rows in (('train', train), ('eval', held_out)):
    with open(paths[name], 'w') as f:
      f.writelines(json.dumps(row) + '\n' for row in rows)
  build_tokenizer().save_pretrained(paths['tokenizer'])
  return paths


def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.data.word_problems', description=__doc__.splitlines()[0])
  parser.add_argument('--out', required=True, help='directory for train.jsonl, eval.jsonl and tokenizer/')
  parser.add_argument('--max-operand', type=int, default=4)
  parser.add_argument('--eval-fraction', type=float, default=0.1)
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  paths = write(args.out, args.max_operand, args.eval_fraction, args.seed)
  print(f'wrote {paths["train"]}, {paths["eval"]} and {paths["tokenizer"]}/')


if __name__ == '__main__':
  main()
