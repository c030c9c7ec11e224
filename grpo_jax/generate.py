"""python -m grpo_jax.generate --ckpt DIR (--prompt TEXT | --prompt-ids "1 2 3") [options]

Quick try-out of any checkpoint (Hugging Face directory or grpo_jax checkpoint): G samples of one
prompt through the group sampler. --json prints one JSON object with token_ids, logprobs,
finish_reason and, when the checkpoint has a tokenizer, text.

A vision-language checkpoint (Qwen2.5-VL) takes `--image PATH` (repeatable): each `<image>` in
--prompt becomes that image's `<|vision_start|>`, image tokens and `<|vision_end|>` (a prompt without
markers gets them at its front, one per image), the image processed as the checkpoint's
preprocessor_config.json says (--min-pixels / --max-pixels override it).
"""

import argparse
import json
import os
import sys

import jax
import numpy as np
from flax import nnx

from grpo_jax.errors import UserError, cli_main
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import from_pretrained, load_tokenizer
from grpo_jax.model.token_ids import check_token_ids
from grpo_jax.sampler.decode import DecodeSettings
from grpo_jax.sampler.layout import rollout_layout, serving_read_mesh
from grpo_jax.sampler.rollout import GroupSampler
from grpo_jax.sampler.sampling import add_sampling_flags, sampling_from_flags
from grpo_jax.sampler.special_tokens import checkpoint_eos_ids, special_tokens


def parse_args(argv):
  parser = argparse.ArgumentParser(prog='python -m grpo_jax.generate', description=__doc__.splitlines()[0])
  parser.add_argument('--ckpt', required=True, help='Hugging Face directory or grpo_jax checkpoint')
  prompt = parser.add_mutually_exclusive_group(required=True)
  prompt.add_argument('--prompt', help='prompt text (needs a tokenizer in --ckpt)')
  prompt.add_argument('--prompt-ids', help='prompt as space-separated token ids')
  parser.add_argument('--max-new-tokens', type=int, default=64)
  add_sampling_flags(parser)
  parser.add_argument('--num-samples', type=int, default=1, help='G: completions of the prompt')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
  parser.add_argument('--tensor', type=int, default=0,
                      help='devices per tensor-parallel group; the host\'s devices form groups of this size '
                           '(0: the largest dividing the KV heads)')
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  parser.add_argument('--image', action='append', default=[], help='an image file (vision-language checkpoints); '
                      'repeat for several, in the order of the prompt\'s <image> markers')
  parser.add_argument('--min-pixels', type=int, help='resize bound of --image (default: the checkpoint\'s)')
  parser.add_argument('--max-pixels', type=int, help='resize bound of --image (default: the checkpoint\'s)')
  return parser.parse_args(argv)


def image_prompt(args, tokenizer, config):
  """(token ids, Vision) of --prompt with its --image files, for a vision-language model."""
  from grpo_jax.model.images import ImageSettings, load_image, process_image
  from grpo_jax.data.multimodal import IMAGE_MARKER, expand_image_tokens
  from grpo_jax.model.vision import check_processor, image_tokens, vision_of
  if config.vision is None:
    raise UserError(f'--image: {args.ckpt} is a text model ({config.model_type}); images need a vision-language one')
  if args.prompt is None or tokenizer is None:
    raise UserError('--image needs --prompt and a tokenizer in --ckpt (the image tokens are placed in the text)')
  settings = ImageSettings.from_checkpoint(args.ckpt, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
  check_processor(settings, config.vision, f'{args.ckpt}/preprocessor_config.json')
  processed = [process_image(load_image(path, f'--image {path}', settings), settings) for path in args.image]
  text = args.prompt if IMAGE_MARKER in args.prompt else (IMAGE_MARKER + '\n') * len(processed) + args.prompt
  if text.count(IMAGE_MARKER) != len(processed):
    raise UserError(f'--prompt holds {text.count(IMAGE_MARKER)} {IMAGE_MARKER} markers for {len(processed)} --image files')
  text = expand_image_tokens(text, [image_tokens(tuple(grid), config.vision) for _, grid in processed])
  ids = check_token_ids(tokenizer(text)['input_ids'], config.vocab_size, '--prompt').tolist()
  prompt = np.array([ids], np.int32)
  return ids, vision_of([[(patches, tuple(grid)) for patches, grid in processed]], prompt, None, config)


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
  return check_token_ids(ids, vocab_size, '--prompt-ids' if args.prompt_ids is not None else '--prompt').tolist()


@cli_main
def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.max_new_tokens < 1 or args.num_samples < 1:
    raise UserError('--max-new-tokens and --num-samples must be at least 1')
  sampling = sampling_from_flags(args)
  if args.tensor < 0:
    raise UserError(f'--tensor must be >= 0 (0: chosen for the model), got {args.tensor}')
  if not os.path.isdir(args.ckpt):
    raise UserError(f'model path {args.ckpt} is not a directory')
  if os.path.isdir(os.path.join(args.ckpt, 'checkpoints')) or os.path.isdir(os.path.join(args.ckpt, 'state')) \
      or os.path.basename(os.path.normpath(args.ckpt)) == 'checkpoints':
    raise UserError(f'--ckpt {args.ckpt} is a training run; generate reads a model directory: serve the run as it '
                    f'is (python -m grpo_jax.serve --ckpt {args.ckpt}, a LoRA run\'s adapters on its base), or export '
                    'it first (python -m conversion.orbax_to_hf, with --merge-lora for a LoRA run)')
  # Resident weights in the sampler's layout over this host's devices (sampler/layout.py); a
  # mixture of experts with its experts over the tensor groups (serving_read_mesh).
  architecture = load_hf_config(args.ckpt)
  mesh = serving_read_mesh(architecture, args.tensor)
  model = from_pretrained(args.ckpt, dtype=args.dtype, mesh=mesh)
  layout = rollout_layout(model, mesh, args.tensor) if architecture.num_sparse_layers else None
  tokenizer = load_tokenizer(args.ckpt)
  vision = None
  if args.image:
    ids, vision = image_prompt(args, tokenizer, model.config)
  else:
    ids = prompt_ids(args, tokenizer, model.config.vocab_size)
  special = special_tokens(tokenizer, (*model.config.eos_token_ids, *checkpoint_eos_ids(args.ckpt)))
  settings = DecodeSettings(sampling=sampling, max_new_tokens=args.max_new_tokens, stop_token_ids=special.stop_ids,
                            pad_id=special.pad_id)
  sampler = GroupSampler(model, group_size=args.num_samples, settings=settings, layout=layout)
  prompt = np.array([ids], np.int32)
  with jax.set_mesh(mesh):
    rollout = jax.device_get(sampler(nnx.state(model), prompt, np.ones_like(prompt), jax.random.key(args.seed),
                                     vision))
  finish_reasons = rollout.finish_reasons

  samples = []
  for row in range(args.num_samples):
    length = int(rollout.lengths[row])
    sample = {'token_ids': rollout.tokens[row, :length].tolist(),
              'logprobs': [round(float(x), 6) for x in rollout.log_probs[row, :length]],
              'finish_reason': finish_reasons[row]}
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
