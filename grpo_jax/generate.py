"""python -m grpo_jax.generate --ckpt DIR (--prompt TEXT | --prompt-ids "1 2 3") [options]

Quick try-out of any checkpoint (Hugging Face directory or grpo_jax checkpoint): G samples of one
prompt through the group sampler. --json prints one JSON object with token_ids, logprobs,
finish_reason and, when the checkpoint has a tokenizer, text.
"""

import argparse
import json
import sys

import jax
import numpy as np
from flax import nnx

from grpo_jax.errors import UserError, cli_main
from grpo_jax.model.loading import from_pretrained, load_tokenizer
from grpo_jax.sampler import GroupSampler, SamplingConfig


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.generate', description=__doc__.splitlines()[0])
  parser.add_argument('--ckpt', required=True, help='Hugging Face directory or grpo_jax checkpoint')
  prompt = parser.add_mutually_exclusive_group(required=True)
  prompt.add_argument('--prompt', help='prompt text (needs a tokenizer in --ckpt)')
  prompt.add_argument('--prompt-ids', help='prompt as space-separated token ids')
  parser.add_argument('--max-new-tokens', type=int, default=64)
  parser.add_argument('--greedy', action='store_true', help='argmax decoding')
  parser.add_argument('--temperature', type=float, default=1.0)
  parser.add_argument('--top-p', type=float, default=1.0)
  parser.add_argument('--top-k', type=int, default=0)
  parser.add_argument('--num-samples', type=int, default=1, help='G: completions of the prompt')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  return parser.parse_args(argv)


def prompt_ids(args, tokenizer, vocab_size: int) -> list[int]:
  if args.prompt_ids is not None:
    try:
      ids = [int(part) for part in args.prompt_ids.split()]
    except ValueError:
      raise UserError(f'--prompt-ids must be space-separated integers, got {args.prompt_ids!r}') from None
  elif tokenizer is None:
    raise UserError(f'--prompt needs a tokenizer, and {args.ckpt} has none; use --prompt-ids')
  else:
    ids = tokenizer(args.prompt)['input_ids']
  if not ids:
    raise UserError('the prompt is empty')
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise UserError(f'prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})')
  return ids


@cli_main
def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.max_new_tokens < 1 or args.num_samples < 1:
    raise UserError('--max-new-tokens and --num-samples must be at least 1')
  try:
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p)
  except ValueError as error:
    raise UserError(str(error)) from None
  model = from_pretrained(args.ckpt, dtype=args.dtype)
  tokenizer = load_tokenizer(args.ckpt)
  ids = prompt_ids(args, tokenizer, model.config.vocab_size)
  stop = tuple(model.config.eos_token_ids)
  if tokenizer is not None and tokenizer.eos_token_id is not None:
    stop = tuple(sorted(set(stop) | {tokenizer.eos_token_id}))
  sampler = GroupSampler(model, group_size=args.num_samples, max_new_tokens=args.max_new_tokens,
                         sampling=sampling, stop_token_ids=stop)
  prompt = np.array([ids], np.int32)
  rollout = jax.device_get(sampler(nnx.state(model), prompt, np.ones_like(prompt), jax.random.key(args.seed)))

  samples = []
  for row in range(args.num_samples):
    length = int(rollout.lengths[row])
    sample = {'token_ids': rollout.tokens[row, :length].tolist(),
              'logprobs': [round(float(x), 6) for x in rollout.log_probs[row, :length]],
              'finish_reason': 'stop' if rollout.stopped[row] else 'length'}
    if tokenizer is not None:
      sample['text'] = tokenizer.decode(sample['token_ids'], skip_special_tokens=True)
    samples.append(sample)
  if args.json:
    print(json.dumps({key: [s[key] for s in samples] for key in samples[0]}))
    return
  for index, sample in enumerate(samples):
    shown = sample.get('text', ' '.join(map(str, sample['token_ids'])))
    print(f'--- sample {index} ({sample["finish_reason"]}, {len(sample["token_ids"])} tokens)\n{shown}')


if __name__ == '__main__':
  main()
