"""Preference pairs with a known truth, for showing that reward-model training works: each
completion has a hidden property (its share of tokens from a chosen set), and which completion of
a pair is preferred is drawn by Bradley-Terry from the property,

    P(a preferred over b) = sigmoid(beta * (property(a) - property(b))),

so the labels are noisy (beta sets how noisy) and the best any reward model can do is to order
completions by the property. A reward model's held-out accuracy against the *property's* order
(not the noisy labels) says how much of the truth it learned; the policy's mean property says how
far RL against that reward model moved it (the proxy / gold picture).

Every function takes its randomness from a NumPy generator; arrays are token rows [R, N] int32 with
their 0/1 masks.
"""

import numpy as np


def token_share(tokens: np.ndarray, mask: np.ndarray, chosen: np.ndarray) -> np.ndarray:
  """[R] each row's share of its real tokens that are in `chosen` (an array of token ids); 0 for a
  row with none."""
  real = np.asarray(mask) == 1
  hits = np.isin(np.asarray(tokens), np.asarray(chosen)) & real
  return hits.sum(axis=1) / np.maximum(real.sum(axis=1), 1)


def bradley_terry_labels(rng: np.random.Generator, first: np.ndarray, second: np.ndarray,
                         beta: float) -> np.ndarray:
  """[R] bool: whether the first of each pair is preferred, drawn with probability
  sigmoid(beta * (first - second)) from the pairs' properties."""
  gap = beta * (np.asarray(first, np.float64) - np.asarray(second, np.float64))
  return rng.uniform(size=gap.shape) < 1.0 / (1.0 + np.exp(-gap))


def random_rows(rng: np.random.Generator, count: int, width: int, vocab: tuple[int, int],
                min_length: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """(tokens, mask) [count, width]: rows of uniform ids in [vocab[0], vocab[1]), of lengths uniform
  in [min_length, width], right-padded with 0 (what a random-init policy's completions look like)."""
  lengths = rng.integers(min_length, width + 1, count)
  mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int32)
  tokens = np.where(mask == 1, rng.integers(vocab[0], vocab[1], (count, width)), 0).astype(np.int32)
  return tokens, mask


def preference_pairs(rng: np.random.Generator, first: tuple[np.ndarray, np.ndarray],
                     second: tuple[np.ndarray, np.ndarray], chosen_ids: np.ndarray, beta: float) -> dict:
  """Pairs of rows (first[i], second[i]) labelled by Bradley-Terry from their token share: {chosen,
  chosen_mask, rejected, rejected_mask} [R, N] and `truth` [R] bool, whether the chosen row's
  property is the higher one (what a held-out accuracy against the truth counts; ties count as
  not)."""
  share = [token_share(*rows, chosen_ids) for rows in (first, second)]
  first_wins = bradley_terry_labels(rng, share[0], share[1], beta)
  pick = lambda a, b: np.where(first_wins[:, None], a, b)  # noqa: E731
  chosen, chosen_mask = pick(first[0], second[0]), pick(first[1], second[1])
  rejected, rejected_mask = pick(second[0], first[0]), pick(second[1], first[1])
  truth = np.where(first_wins, share[0] > share[1], share[1] > share[0])
  return dict(chosen=chosen.astype(np.int32), chosen_mask=chosen_mask.astype(np.int32),
              rejected=rejected.astype(np.int32), rejected_mask=rejected_mask.astype(np.int32), truth=truth)


# ---- the CPU demo's files (make demo-rm) ----
#
# Words, not bare ids: the reward model is trained from text files through its chat template, as a
# real one is, and the policy samples words. The hidden property of a completion is its share of
# COLOURS among its words; a random-init policy's samples have about 6 / 30 of them (the
# vocabulary's share), the optimum is 1.

COLOURS = ('red', 'blue', 'green', 'gold', 'pink', 'teal')  # the chosen set
OTHERS = ('cat', 'dog', 'sky', 'sea', 'tree', 'rock', 'road', 'hill', 'rain', 'snow', 'moon', 'star',
          'fish', 'bird', 'lamp', 'door', 'book', 'cup')
SPECIAL = ('<|endoftext|>', '<|im_start|>', '<|im_end|>', '<unk>')
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPTS = tuple(f'say something about the {word}' for word in OTHERS) + tuple(
    f'tell me of a {word}' for word in OTHERS)


def vocabulary() -> list[str]:
  words = {'user', 'assistant', 'say', 'something', 'about', 'the', 'tell', 'me', 'of', 'a', *COLOURS, *OTHERS}
  return list(SPECIAL) + sorted(words)


def build_tokenizer():
  """A transformers fast tokenizer of one token per word, decoding with spaces between words; ChatML
  turns. Decoding a row of word ids and tokenizing the text again gives the same ids."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  core = Tokenizer(models.WordLevel({token: index for index, token in enumerate(vocabulary())}, unk_token='<unk>'))
  core.pre_tokenizer = pre_tokenizers.Whitespace()
  core.decoder = decoders.WordPiece(cleanup=False)  # words joined by spaces
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token='<|im_end|>', pad_token='<|endoftext|>',
                                      unk_token='<unk>', additional_special_tokens=['<|im_start|>'])
  tokenizer.chat_template = CHAT_TEMPLATE
  return tokenizer


def colour_share(text: str) -> float:
  """The hidden property of a completion's text: its share of words that are COLOURS (0 for none)."""
  words = text.split()
  return sum(word in COLOURS for word in words) / len(words) if words else 0.0


def chosen_share(completions, references, lengths):
  """The hidden property as a reward term (`{name: grpo_jax.data.synthetic_preferences:chosen_share,
  weight: 0}`): logged as reward/chosen_share beside the reward model's score, the gold beside the
  proxy, and adding nothing to the reward."""
  del references, lengths
  return [colour_share(text) for text in completions]


def replies(rng: np.random.Generator, count: int, max_words: int) -> list[str]:
  """`count` replies of 1..max_words words, each reply with its own share of colours drawn uniformly
  in [0, 1]: a random-init policy's replies hold about the vocabulary's share, but the reward model
  must rank replies of every share the policy will reach as it learns."""
  texts = []
  for _ in range(count):
    length, share = int(rng.integers(1, max_words + 1)), rng.uniform()
    colour = rng.uniform(size=length) < share
    texts.append(' '.join(str(rng.choice(COLOURS)) if c else str(rng.choice(OTHERS)) for c in colour))
  return texts


def pair_records(rng: np.random.Generator, count: int, max_words: int, beta: float | None) -> list[dict]:
  """Preference records in the chat-message form ({prompt, chosen, rejected}, data/preferences.py):
  the reply preferred drawn by Bradley-Terry from the property gap (`beta`), or, with beta None, the
  reply of the higher property (ties left out): a held-out set whose accuracy is against the truth."""
  records = []
  while len(records) < count:
    first, second = replies(rng, 2, max_words)
    if first == second:  # no preference to learn (and the preference reader skips such a pair)
      continue
    shares = colour_share(first), colour_share(second)
    if beta is None:
      if shares[0] == shares[1]:
        continue
      first_wins = shares[0] > shares[1]
    else:
      first_wins = bool(bradley_terry_labels(rng, np.asarray([shares[0]]), np.asarray([shares[1]]), beta)[0])
    chosen, rejected = (first, second) if first_wins else (second, first)
    prompt = [{'role': 'user', 'content': str(rng.choice(PROMPTS))}]
    records.append(dict(prompt=prompt, chosen=[{'role': 'assistant', 'content': chosen}],
                        rejected=[{'role': 'assistant', 'content': rejected}]))
  return records


def write(out: str, pairs: int = 4096, held_out: int = 512, max_words: int = 8, beta: float = 20.0,
          seed: int = 0) -> dict:
  """Writes under `out`: tokenizer/, pairs.jsonl (noisy Bradley-Terry labels), held_out.jsonl (the
  property's order) and prompts.jsonl (the RL prompts, format prompts); returns their paths."""
  import json
  import os
  rng = np.random.default_rng(seed)
  os.makedirs(out, exist_ok=True)
  files = dict(tokenizer='tokenizer', pairs='pairs.jsonl', held_out='held_out.jsonl', prompts='prompts.jsonl')
  paths = {name: os.path.join(out, file) for name, file in files.items()}
  rows = dict(pairs=pair_records(rng, pairs, max_words, beta), held_out=pair_records(rng, held_out, max_words, None),
              prompts=[{'prompt': prompt} for prompt in PROMPTS])
  for name, records in rows.items():
    with open(paths[name], 'w') as f:
      f.writelines(json.dumps(record) + '\n' for record in records)
  build_tokenizer().save_pretrained(paths['tokenizer'])
  return paths


def plot_proxy_and_gold(history: list[dict], path: str, proxy: str = 'reward/reward_model',
                        gold: str = 'reward/chosen_share') -> str | None:
  """The proxy / gold picture of an RL run against a learned reward: the reward model's mean score
  (proxy) against the hidden property's mean (gold) of each step's samples, coloured by step, as a
  PNG; None without matplotlib or without both in the history."""
  rows = [row for row in history if row.get(proxy) is not None and row.get(gold) is not None]
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  if not rows:
    return None
  figure, axes = plt.subplots(figsize=(6, 4.5))
  points = axes.scatter([row[gold] for row in rows], [row[proxy] for row in rows], c=[row['step'] for row in rows],
                        cmap='viridis', s=14)
  figure.colorbar(points, label='RL step')
  axes.set_xlabel(f'gold: {gold.removeprefix("reward/")} (the hidden property, mean of the step)')
  axes.set_ylabel(f'proxy: {proxy.removeprefix("reward/")} (mean score)')
  axes.set_xlim(0, 1)
  axes.grid(alpha=0.3)
  axes.set_title('the reward model\'s score against the hidden property')
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def main(argv=None):
  import argparse
  import os
  import sys
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.data.synthetic_preferences',
                                   description="writes the reward-model demo's tokenizer, preference pairs and "
                                   "prompts; with --plot, draws a finished RL run's proxy / gold picture")
  parser.add_argument('--out', help='directory for tokenizer/, pairs.jsonl, held_out.jsonl, prompts.jsonl')
  parser.add_argument('--pairs', type=int, default=4096)
  parser.add_argument('--beta', type=float, default=20.0, help='Bradley-Terry sharpness of the training labels')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--plot', metavar='WORKDIR', help='an RL run\'s workdir: writes WORKDIR/proxy_gold.png')
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)
  if args.plot:
    import json
    with open(os.path.join(args.plot, 'metrics.jsonl')) as f:
      history = [json.loads(line) for line in f if line.strip()]
    written = plot_proxy_and_gold(history, os.path.join(args.plot, 'proxy_gold.png'))
    first, last = history[0], history[-1]
    print(f'gold (colour share) {first["reward/chosen_share"]:.3f} at step {first["step"]} -> '
          f'{last["reward/chosen_share"]:.3f} at step {last["step"]}; proxy {first["reward/reward_model"]:.3f} -> '
          f'{last["reward/reward_model"]:.3f}' + (f'; wrote {written}' if written else ''))
    return
  if not args.out:
    parser.error('--out (or --plot) is required')
  paths = write(args.out, pairs=args.pairs, beta=args.beta, seed=args.seed)
  print(f'wrote {", ".join(paths.values())}')


if __name__ == '__main__':
  main()
