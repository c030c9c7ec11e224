"""python -m conversion.orbax_to_hf --ckpt DIR --out DIR [--step N] [--like HF_DIR] [--merge-lora | --peft]

Converts a grpo_jax checkpoint back to Hugging Face safetensors + config.json, loadable by
`transformers.AutoModelForCausalLM.from_pretrained`. --ckpt is a model checkpoint (config.json +
params/, as hf_to_orbax writes) or a training run's policy: its workdir, checkpoints/ directory
(the newest step, or --step) or one checkpoints/<step>, whichever number of processes wrote it;
only the parameters are read, not the optimizer state. With --like, the original directory's
config.json keys that grpo_jax does not model and its tokenizer files are carried over (a training
run's tokenizer is otherwise taken from its task.tokenizer or model.path, where they still exist).

A LoRA run's checkpoint holds only its adapters (the base is read again from the run's model.path):
--merge-lora writes the base with the adapters merged in (W + s A B), a plain Hugging Face model;
--peft writes the adapters alone as a PEFT adapter directory for `peft.PeftModel.from_pretrained`.
"""

import argparse
import json
import os
import sys
import time

from conversion.common import atomic_directory, host_mesh
from grpo_jax.checkpoint import locate
from grpo_jax.restore import restore_adapters, restore_policy, run_of, run_tokenizer
from grpo_jax.errors import UserError, cli_main
from grpo_jax.model import lora
from grpo_jax.model.hf_config import load_hf_config
from grpo_jax.model.loading import copy_tokenizer_files, is_orbax_checkpoint, load_orbax, save_hf
from grpo_jax.model.qwen2 import ModelOptions


@cli_main
def main(argv=None):
  parser = argparse.ArgumentParser(prog='python -m conversion.orbax_to_hf', description=__doc__.splitlines()[0])
  parser.add_argument('--ckpt', required=True,
                      help='grpo_jax checkpoint directory (config.json + params/), or a training workdir / checkpoint')
  parser.add_argument('--step', type=int, help='with a training run: the checkpoint step (default: the newest)')
  parser.add_argument('--out', required=True, help='Hugging Face directory to write')
  parser.add_argument('--like', help='original Hugging Face directory to take extra config keys and tokenizer from')
  parser.add_argument('--max-shard-gb', type=float, default=4.0, help='split safetensors above this size')
  parser.add_argument('--force', action='store_true', help='replace a non-empty --out')
  exports = parser.add_mutually_exclusive_group()
  exports.add_argument('--merge-lora', action='store_true',
                       help='a LoRA run: write the base with the adapters merged into its weights')
  exports.add_argument('--peft', action='store_true', help='a LoRA run: write the adapters as a PEFT adapter directory')
  args = parser.parse_args(sys.argv[1:] if argv is None else argv)

  start = time.perf_counter()
  if not args.max_shard_gb > 0:
    raise UserError(f'--max-shard-gb must be > 0, got {args.max_shard_gb}')
  training = None if is_orbax_checkpoint(args.ckpt) else locate(args.ckpt)
  if training is None and not is_orbax_checkpoint(args.ckpt):
    raise UserError(f'--ckpt {args.ckpt} is not a grpo_jax checkpoint (no params/ directory), nor a training '
                    'run\'s workdir or checkpoints')
  if args.step is not None and training is None:
    raise UserError('--step applies to a training run\'s checkpoints; --ckpt is a model checkpoint')
  if (args.merge_lora or args.peft) and training is None:
    raise UserError(f'--{"merge-lora" if args.merge_lora else "peft"} applies to a LoRA training run\'s checkpoints; '
                    f'--ckpt {args.ckpt} is a model checkpoint')
  if training is not None:
    check_lora_flags(args, run_of(*training_step(*training, args.step))[0].model.options.lora)
  if args.like:
    load_hf_config(args.like)  # fail early on a wrong --like
  with atomic_directory(args.out, args.force) as staging:
    if training is None:
      # Only the storage dtype matters: conversion runs no forward pass.
      model = load_orbax(args.ckpt, options=ModelOptions(param_dtype=load_hf_config(args.ckpt).checkpoint_dtype),
                         mesh=host_mesh())
      tokenizer = args.ckpt
    elif args.peft:  # the adapters alone: the base's weights are not read (nor needed here)
      adapters, run_config, step = restore_adapters(*training_step(*training, args.step), host_mesh())
      print(f'adapters of run {run_config.run.name!r} at step {step}', file=sys.stderr, flush=True)
      lora.save_peft(adapters, run_config.model.options.lora, staging, run_config.model.path,
                     run_config.model.architecture)
      model, tokenizer = None, run_tokenizer(run_config)
    else:
      model, tokenizer, run_config = trained_policy(*training, step=args.step)
      model = lora_export(model, args, staging)
    if model is not None:
      save_hf(model, staging, max_shard_bytes=int(args.max_shard_gb * 2**30))
    if args.like or tokenizer:
      copy_tokenizer_files(args.like or tokenizer, staging)
    if args.like:
      _merge_config(os.path.join(args.like, 'config.json'), os.path.join(staging, 'config.json'))
  print(f'wrote {args.out} in {time.perf_counter() - start:.1f}s')


def training_step(checkpoints: str, found_step: int | None, step: int | None) -> tuple[str, int | None]:
  """(checkpoints, the step --ckpt and --step name: None for the newest)."""
  if step is not None and found_step is not None and step != found_step:
    raise UserError(f'--step {step} differs from the step of --ckpt {checkpoints}/{found_step}')
  return checkpoints, step if step is not None else found_step


def check_lora_flags(args, settings) -> None:
  """One line, before anything is loaded, where --merge-lora / --peft and the checkpoint disagree
  (`settings`: the run's model.lora, read from the checkpoint's metadata; None: full-parameter)."""
  if settings is None and (args.merge_lora or args.peft):
    raise UserError(f'--{"merge-lora" if args.merge_lora else "peft"}: --ckpt {args.ckpt} is from a full-parameter '
                    'run (no model.lora): it holds no adapters; convert it without the flag')
  if settings is not None and not (args.merge_lora or args.peft):
    raise UserError(f'--ckpt {args.ckpt} holds LoRA adapters (model.lora rank {settings.rank}): pass --merge-lora for '
                    'a merged Hugging Face model, or --peft for a PEFT adapter directory')


def trained_policy(checkpoints: str, found_step: int | None, step: int | None):
  """(model on the host, tokenizer directory or None, the run's config) of a training run's checkpoint."""
  from flax import nnx

  graphdef, params, config, step = restore_policy(*training_step(checkpoints, found_step, step), host_mesh(),
                                                  options=None)
  print(f'policy of run {config.run.name!r} at step {step} ({checkpoints}/{step})', file=sys.stderr, flush=True)
  return nnx.merge(graphdef, params), run_tokenizer(config), config


def lora_export(model, args, staging: str):
  """A LoRA policy merged into its base (--merge-lora); a full-parameter policy as it is
  (check_lora_flags has refused flags that do not fit the run; --peft does not load the policy)."""
  import dataclasses

  from flax import nnx

  from grpo_jax.model.loading import abstract_model

  settings = model.options.lora
  if settings is None:
    return model
  plain = dataclasses.replace(model.options, lora=None, param_dtype=model.options.dtype)
  return nnx.merge(nnx.graphdef(abstract_model(model.config, plain)), lora.merged(nnx.state(model), settings))


def _merge_config(original_path: str, written_path: str) -> None:
  """Keeps the original's extra keys (generation defaults, versions); grpo_jax's fields win. A
  vision-language original whose language model alone was written (Gemma 3's) gives the keys of its
  `text_config`."""
  with open(original_path) as f:
    merged = json.load(f)
  with open(written_path) as f:
    written = json.load(f)
  if merged.get('model_type') != written.get('model_type') and isinstance(merged.get('text_config'), dict):
    merged = dict(merged['text_config'])
  merged.update(written)
  merged.pop('quantization_config', None)  # the weights written are in the training dtype, not fp8
  with open(written_path, 'w') as f:
    json.dump(merged, f, indent=2)


if __name__ == '__main__':
  main()
